"""Reading conversation and prompt files: records from JSONL or JSON-array files (gzipped too;
written back as gzipped JSONL),
ShareGPT/OpenAI conversations validated into [{role, content}] turns, and held-out prompts
(MT-bench, HumanEval or conversation records)."""

from __future__ import annotations

import dataclasses
import gzip
import json
import re
from collections.abc import Iterator, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

from eagle3lib.errors import UserError

ROLE_ALIASES = {
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool",
}


class InvalidRecord(Exception):
    """A record that cannot be used; skipped or fatal depending on data.on_invalid_record.

    ``reason`` is the short, stable key it is counted under; the message has the details.
    """

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}{f' ({detail})' if detail else ''}")
        self.reason = reason


# the leading bytes of compressed files a data file may be mistaken for
_COMPRESSED = (
    (b"\x1f\x8b", "gzip"),
    (b"BZh", "bzip2"),
    (b"\xfd7zXZ\x00", "xz"),
    (b"\x28\xb5\x2f\xfd", "zstd"),
    (b"PK\x03\x04", "zip"),
)


def _open_text(path: Path) -> str:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise UserError(
            f"{path}: cannot read the file ({exc.strerror}); check the path in the config"
        ) from None
    if path.suffix == ".gz":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as exc:  # BadGzipFile is an OSError; a cut file is EOFError
            raise UserError(
                f"{path}: not a complete gzip file ({exc or 'truncated'}); re-compress it, or "
                "drop the .gz suffix if it is plain text"
            ) from None
    try:
        return raw.decode("utf-8-sig")  # a byte-order mark some editors write is dropped
    except UnicodeDecodeError as exc:
        compressed = next((name for magic, name in _COMPRESSED if raw.startswith(magic)), None)
        if compressed == "gzip":
            raise UserError(
                f"{path}: compressed with gzip but not named .gz; rename it to end in .gz (read "
                "as gzip then) or decompress it"
            ) from None
        if compressed:
            raise UserError(
                f"{path}: compressed with {compressed}; only plain and gzip (.gz) files are read: "
                "decompress it, or re-compress it with gzip as a .gz file"
            ) from None
        line = raw[: exc.start].count(b"\n") + 1
        raise UserError(
            f"{path}:{line}: not valid UTF-8 (byte {exc.start}); re-encode the file as UTF-8"
        ) from None


def read_records(
    path: Path, allow_truncated_json: bool = False, key: str = "data.train"
) -> Iterator[tuple[int, Any]]:
    """Yield (line number, record) from a JSONL file or a JSON array file; ``key``: the config
    entry of the file, whose allow_truncated_json an error names."""
    text = _open_text(path)
    stripped = text.lstrip()
    if not stripped:
        return
    if ".jsonl" in path.suffixes or not stripped.startswith("["):
        yield from _jsonl_records(path, text)
    else:
        yield from _json_array_records(path, text, allow_truncated_json, key)


@dataclasses.dataclass(frozen=True)
class TrainSource:
    """One file of training conversations: data.train's, or an entry of data.extra_train."""

    path: Path
    allow_truncated_json: bool = False
    max_samples: int | None = None  # of this file (prepare: samples; regenerate: conversations)
    id_prefix: str = ""  # before its records' ids: "" for data.train, "extra_train[k]:" else
    key: str = "data.train"  # its config entry: "data.train" or "data.extra_train[k]"


def train_sources(paths: Sequence[Path], data: dict[str, Any]) -> list[TrainSource]:
    """The training files a job was given (data.train's, then data.extra_train's, in the
    config's order) with their options from the config's ``data`` section."""
    options = [data["train"], *data.get("extra_train", [])]
    if len(paths) != len(options):
        raise UserError(
            f"{len(paths)} training file(s) given for {len(options)} in the data section "
            "(data.train, data.extra_train); run the job through the workflow"
        )
    return [
        TrainSource(
            Path(path),
            bool(o.get("allow_truncated_json", False)),
            o.get("max_samples"),
            "" if k == 0 else f"extra_train[{k - 1}]:",
            "data.train" if k == 0 else f"data.extra_train[{k - 1}]",
        )
        for k, (path, o) in enumerate(zip(paths, options, strict=True))
    ]


def spread(lists: Sequence[Sequence[Any]]) -> list[Any]:
    """The items of ``lists`` spread evenly among each other, each list keeping its order
    (item i of a list of n at (2i + 1) / 2n, ties in list order), so that the last items,
    which validation holds out, hold every list in proportion."""
    keyed = [
        (Fraction(2 * i + 1, 2 * len(items)), k, i)
        for k, items in enumerate(lists)
        for i in range(len(items))
    ]
    return [lists[k][i] for _, k, i in sorted(keyed)]


def write_gzipped_jsonl(path: Path, records: list[Any]) -> None:
    """``records`` as gzipped JSONL that read_records reads back, with no time in the gzip
    header: the same records give the same bytes (a stamp by sha256 stays as it was)."""
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    Path(path).write_bytes(gzip.compress(text.encode(), mtime=0))


def _jsonl_records(path: Path, text: str) -> Iterator[tuple[int, Any]]:
    # split on newlines only: JSON strings may hold U+2028 and other line separators
    for lineno, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            array = lineno == 1 and line.lstrip().startswith("[")
            raise UserError(
                f"{path}:{lineno}: invalid JSON ({exc.msg}, column {exc.colno}); "
                + (
                    "a JSON array of records goes in a .json file, not .jsonl: rename it"
                    if array
                    else "fix or remove the line"
                )
            ) from None
        except RecursionError:
            raise UserError(
                f"{path}:{lineno}: JSON nested too deeply to read; fix or remove the line"
            ) from None
        if lineno == 1 and isinstance(record, list) and ".jsonl" in path.suffixes:
            raise UserError(
                f"{path}:1: a JSON array in a .jsonl file (one JSON object a line); a JSON "
                "array of records goes in a .json file: rename it"
            )
        yield lineno, record


class _LineCounter:
    """The line number of a position in ``text``; positions must be asked for in order."""

    def __init__(self, text: str):
        self.text, self.line, self.counted_to = text, 1, 0

    def __call__(self, pos: int) -> int:
        self.line += self.text.count("\n", self.counted_to, pos)
        self.counted_to = pos
        return self.line


_SPACE = re.compile(r"\s*")


def _json_array_records(
    path: Path, text: str, allow_truncated_json: bool, key: str = "data.train"
) -> Iterator[tuple[int, Any]]:
    """The items of a JSON array one by one, so that a file cut off mid-record keeps the
    records before the cut (with ``allow_truncated_json``)."""
    decoder = json.JSONDecoder()
    line_of = _LineCounter(text)
    pos = text.index("[") + 1
    first = True
    while True:
        pos = _SPACE.match(text, pos).end()
        if text.startswith("]", pos):
            return
        if not first and pos < len(text):
            if text[pos] != ",":
                raise UserError(
                    f"{path}:{line_of(pos)}: invalid JSON (expected ',' between array items); "
                    "add the missing comma or fix the record before it"
                )
            pos = _SPACE.match(text, pos + 1).end()
        if pos >= len(text):  # the file ends after a record or its comma
            if allow_truncated_json:
                return
            raise UserError(
                f"{path}:{line_of(len(text.rstrip()))}: JSON array is not closed (file "
                f"truncated?); repair it or set {key}.allow_truncated_json: true"
            )
        first = False
        start = pos
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except RecursionError:
            raise UserError(
                f"{path}:{line_of(start)}: JSON nested too deeply to read; fix or remove the record"
            ) from None
        except json.JSONDecodeError as exc:
            # The file ends inside this record: a string runs to EOF, or the error is at EOF.
            cut = exc.msg.startswith("Unterminated string") or exc.pos >= len(text.rstrip())
            if cut and allow_truncated_json:
                return
            line = line_of(start if cut else exc.pos)
            raise _array_item_error(path, exc, cut, line, key) from None
        yield line_of(start), obj


def _array_item_error(
    path: Path, exc: json.JSONDecodeError, cut: bool, line: int, key: str
) -> UserError:
    if cut:
        return UserError(
            f"{path}:{line}: the file ends inside this record (truncated?); "
            f"repair it or set {key}.allow_truncated_json: true to keep the records "
            "before it"
        )
    return UserError(
        f"{path}:{line}: invalid JSON ({exc.msg}); fix the record or, "
        f"for a file cut off mid-record, set {key}.allow_truncated_json: true"
    )


def _content_text(content: Any, turn: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise InvalidRecord("non-text content part", f"turn {turn}: only text is supported")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise InvalidRecord("content is not a string", f"turn {turn}: {type(content).__name__}")


def normalize_conversation(record: Any) -> list[dict[str, str]]:
    """ShareGPT or OpenAI record -> [{role, content}] with roles user/assistant/system/tool."""
    if not isinstance(record, dict):
        raise InvalidRecord("record is not a JSON object", type(record).__name__)
    turns = record.get("conversations", record.get("messages"))
    if turns is None:
        raise InvalidRecord("record has neither 'conversations' (ShareGPT) nor 'messages' (OpenAI)")
    if not isinstance(turns, list):
        raise InvalidRecord("turns are not a list")
    if not turns:
        raise InvalidRecord("no turns", "the turn list is empty")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise InvalidRecord("turn is not an object", f"turn {i}")
        role = turn.get("role", turn.get("from"))
        content = turn.get("content", turn.get("value"))
        if role is None or content is None:
            raise InvalidRecord("turn lacks role/content (or from/value)", f"turn {i}")
        mapped = ROLE_ALIASES.get(str(role).lower())
        if mapped is None:
            raise InvalidRecord(
                "unknown role", f"turn {i}: {role!r}; known: {', '.join(sorted(ROLE_ALIASES))}"
            )
        text = _content_text(content, i)
        if not text.strip():
            raise InvalidRecord("empty content", f"turn {i}, {mapped}")
        messages.append({"role": mapped, "content": text})
    return messages


def first_prompt_key(messages: list[dict[str, str]]) -> str | None:
    """What data.train.dedupe compares: the system turns before the first user turn and that
    turn, whitespace collapsed and case folded (None without a user turn). Two conversations
    with the same key get the same greedy reply to their first turn."""
    parts = []
    for m in messages:
        if m["role"] in ("system", "user"):
            parts.append(f"{m['role']}: {' '.join(m['content'].split()).casefold()}")
        if m["role"] == "user":
            return "\n".join(parts)
    return None


def read_eval_prompts(path: Path, max_prompts: int | None) -> list[dict[str, str]]:
    """Held-out prompts: MT-bench ({turns}), HumanEval ({prompt}) or conversations (first user
    turn); {id, text}, and the record's category where it has one (MT-bench's)."""
    prompts = []
    for lineno, record in read_records(path):
        if max_prompts is not None and len(prompts) >= max_prompts:
            break
        if not isinstance(record, dict):
            raise UserError(
                f"{path}:{lineno}: a prompt record must be a JSON object; fix or remove the line"
            )
        rid = str(record.get("question_id", record.get("task_id", record.get("id", lineno))))
        text = _prompt_text(path, lineno, record)
        if not isinstance(text, str) or not text.strip():
            raise UserError(f"{path}:{lineno}: empty prompt; write the prompt or remove the line")
        prompt = {"id": rid, "text": text}
        if isinstance(record.get("category"), str):  # MT-bench's: evaluation reports per category
            prompt["category"] = record["category"]
        prompts.append(prompt)
    if not prompts:
        raise UserError(
            f"{path}: no evaluation prompts found; add prompt records ({{turns}}, {{prompt}} or "
            "a conversation) or point the eval set at another file"
        )
    return prompts


def _wrong_type(path: Path, lineno: int, key: str, value: Any, want: str) -> UserError:
    return UserError(
        f"{path}:{lineno}: '{key}' is {json.dumps(value)[:40]}, not {want}; fix or remove the line"
    )


def _prompt_text(path: Path, lineno: int, record: dict[str, Any]) -> Any:
    """A prompt record's prompt: its first turn, its prompt, or its first user turn."""
    turns, prompt = record.get("turns"), record.get("prompt")
    if turns is not None:
        if isinstance(turns, list) and turns and isinstance(turns[0], str):
            return turns[0]
        want = "a list of strings, the first one the prompt"
        raise _wrong_type(path, lineno, "turns", turns, want)
    if prompt is not None:
        if isinstance(prompt, str):
            return prompt
        raise _wrong_type(path, lineno, "prompt", prompt, "a string")
    try:
        messages = normalize_conversation(record)
    except InvalidRecord as exc:
        raise UserError(
            f"{path}:{lineno}: not a prompt record ({exc}); expected 'turns', 'prompt', "
            "'conversations' or 'messages'"
        ) from None
    users = [m["content"] for m in messages if m["role"] == "user"]
    if not users:
        raise UserError(
            f"{path}:{lineno}: conversation has no user turn to use as prompt; add one "
            "or remove the line"
        )
    return users[0]
