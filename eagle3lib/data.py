"""Conversations -> token ids and loss masks (assistant tokens only), and held-out prompts.

Loss masks come from the verifier's own chat template: for every assistant turn j the
supervised span is render(turns[:j+1]) minus render(turns[:j], add_generation_prompt=True),
so the end-of-turn tokens the template emits are supervised too. When a template rewrites
history (e.g. drops earlier ``<think>`` blocks) one conversation fans out into one sample per
assistant turn, each the exact token sequence the verifier sees at that turn.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from eagle3lib.errors import UserError
from eagle3lib.leakage import EvalPromptIndex

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
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise UserError(
            f"{path}:{line}: not valid UTF-8 (byte {exc.start}); re-encode the file as UTF-8"
        ) from None


def read_records(path: Path, allow_truncated_json: bool = False) -> Iterator[tuple[int, Any]]:
    """Yield (line number, record) from a JSONL file or a JSON array file."""
    text = _open_text(path)
    stripped = text.lstrip()
    if not stripped:
        return
    is_jsonl = ".jsonl" in path.suffixes or not stripped.startswith("[")
    if is_jsonl:
        # split on newlines only: JSON strings may hold U+2028 and other line separators
        for lineno, line in enumerate(text.split("\n"), 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(
                    f"{path}:{lineno}: invalid JSON ({exc.msg}, column {exc.colno}); "
                    "fix or remove the line"
                ) from None
        return

    decoder = json.JSONDecoder()
    skip = re.compile(r"\s*")
    pos = text.index("[") + 1
    lines_before, counted_to = 1, 0

    def line_of(p: int) -> int:
        nonlocal lines_before, counted_to
        lines_before += text.count("\n", counted_to, p)
        counted_to = p
        return lines_before

    first = True
    while True:
        pos = skip.match(text, pos).end()
        if pos >= len(text):
            if allow_truncated_json:
                return
            raise UserError(
                f"{path}:{line_of(len(text))}: JSON array is not closed (file truncated?); "
                "repair it or set data.train.allow_truncated_json: true"
            )
        if text[pos] == "]":
            return
        if not first:
            if text[pos] != ",":
                raise UserError(
                    f"{path}:{line_of(pos)}: invalid JSON (expected ',' between array items); "
                    "add the missing comma or fix the record before it"
                )
            pos = skip.match(text, pos + 1).end()
        first = False
        start = pos
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            # The file ends inside this record: a string runs to EOF, or the error is at EOF.
            cut = exc.msg.startswith("Unterminated string") or exc.pos >= len(text.rstrip())
            if cut and allow_truncated_json:
                return
            if cut:
                raise UserError(
                    f"{path}:{line_of(start)}: the file ends inside this record (truncated?); "
                    "repair it or set data.train.allow_truncated_json: true to keep the records "
                    "before it"
                ) from None
            raise UserError(
                f"{path}:{line_of(exc.pos)}: invalid JSON ({exc.msg}); fix the record or, "
                "for a file cut off mid-record, set data.train.allow_truncated_json: true"
            ) from None
        yield line_of(start), obj


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise InvalidRecord("non-text content part", "only text is supported")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise InvalidRecord("content is not a string", type(content).__name__)


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
        text = _content_text(content)
        if not text.strip():
            raise InvalidRecord("empty content", f"turn {i}, {mapped}")
        messages.append({"role": mapped, "content": text})
    return messages


def render_ids(tokenizer, messages, add_generation_prompt: bool) -> list[int]:
    """Token ids of ``messages`` rendered with the tokenizer's chat template."""
    ids = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
    )
    return list(ids)


def check_chat_template(tokenizer, where: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(
            f"{where}: the verifier's tokenizer has no chat template; loss masks are derived "
            "from it. Use an instruct/chat model or add chat_template.jinja to its folder"
        )


# What to do when every sample was dropped for this reason (the "no usable samples" error).
DROP_REMEDIES = {
    "too_long": "raise data.max_length or set data.truncation: truncate",
    "prompt_exceeds_max_length": "raise data.max_length (the prompts alone fill it)",
    "no_supervised_tokens": (
        "the chat template renders no assistant tokens (loss mask all zero) or too few: use a "
        "template that renders assistant replies, or lower data.min_supervised_tokens"
    ),
    "no_assistant_turn": "give every conversation an assistant reply after a user turn",
    "eval_prompt_overlap": "the training data repeats the eval prompts: use other data.eval",
}


def supervised_spans(
    tokenizer, messages: list[dict[str, str]], stop_at: int | None = None
) -> list[tuple[list[int], int, int]]:
    """(render of turns[:j+1], start, end) of every assistant turn j that follows a user turn.

    With ``stop_at``, turns whose prompt already has ``stop_at`` tokens are not rendered
    (they would be cut off by truncation anyway).
    """
    spans = []
    seen_user = False
    for j, message in enumerate(messages):
        if message["role"] == "user":
            seen_user = True
        if message["role"] != "assistant" or not seen_user:
            continue
        prompt = render_ids(tokenizer, messages[:j], add_generation_prompt=True)
        if stop_at is not None and len(prompt) >= stop_at:
            break
        full = render_ids(tokenizer, messages[: j + 1], add_generation_prompt=False)
        if full[: len(prompt)] != prompt:
            raise InvalidRecord(
                "chat template is not prefix-stable",
                "render(turns[:j+1]) does not start with render(turns[:j], generation prompt)",
            )
        spans.append((full, len(prompt), len(full)))
    return spans


def tokenize_conversation(
    tokenizer, messages: list[dict[str, str]], stop_at: int | None = None
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Token ids and loss masks for one conversation (one sample, or one per turn if needed)."""
    spans = supervised_spans(tokenizer, messages, stop_at)
    if not spans:
        return []
    last_full = spans[-1][0]
    if all(last_full[: len(full)] == full for full, _, _ in spans):
        ids = np.asarray(last_full, dtype=np.int64)
        mask = np.zeros(len(ids), dtype=np.uint8)
        for _, start, end in spans:
            mask[start:end] = 1
        return [(ids, mask)]
    # The template rewrites history (e.g. strips earlier reasoning): one sample per turn.
    samples = []
    for full, start, end in spans:
        mask = np.zeros(len(full), dtype=np.uint8)
        mask[start:end] = 1
        samples.append((np.asarray(full, dtype=np.int64), mask))
    return samples


@dataclasses.dataclass
class PreparedSamples:
    ids: list[str]
    input_ids: list[np.ndarray]
    loss_masks: list[np.ndarray]
    token_freq: Counter
    summary: dict[str, Any]


def prepare_samples(
    tokenizer, path: Path, cfg, held_out: EvalPromptIndex | None = None
) -> PreparedSamples:
    """Read conversations, build samples with loss masks, count what was dropped and why.

    Conversations whose user turns hold an eval prompt of ``held_out`` (copies, substrings,
    near-duplicates: eagle3lib/leakage.py) are dropped and counted per eval set.
    """
    check_chat_template(tokenizer, getattr(tokenizer, "name_or_path", "") or str(path))
    held_out = held_out or EvalPromptIndex()
    overlap: Counter = Counter()
    dropped: Counter = Counter()
    ids, all_ids, all_masks = [], [], []
    freq: Counter = Counter()
    records = 0
    truncated = 0
    for lineno, record in read_records(path, cfg.allow_truncated_json):
        if cfg.max_samples is not None and len(ids) >= cfg.max_samples:
            break
        records += 1
        try:
            messages = normalize_conversation(record)
            sets = held_out.overlapping_sets(m["content"] for m in messages if m["role"] == "user")
            if sets:
                dropped["eval_prompt_overlap"] += 1
                overlap.update(sets)
                continue
            try:
                stop_at = cfg.max_length if cfg.truncation == "truncate" else None
                samples = tokenize_conversation(tokenizer, messages, stop_at)
            except InvalidRecord:
                raise
            except Exception as exc:  # jinja raise_exception, e.g. roles must alternate
                raise InvalidRecord("chat template failed", str(exc).splitlines()[0]) from None
        except InvalidRecord as exc:
            if cfg.on_invalid_record == "error":
                raise UserError(
                    f"{path}:{lineno}: {exc}; fix the record or set "
                    "data.on_invalid_record: skip to drop such records"
                ) from None
            dropped[f"invalid: {exc.reason}"] += 1
            continue
        if not samples:
            roles = [m["role"] for m in messages]
            first_user = roles.index("user") if "user" in roles else len(roles)
            has_reply = "assistant" in roles[first_user:]
            # With a reply but no span, the prompt alone already filled max_length.
            dropped["prompt_exceeds_max_length" if has_reply else "no_assistant_turn"] += 1
            continue
        record_id = str(record.get("id", lineno)) if isinstance(record, dict) else str(lineno)
        for turn, (tok, mask) in enumerate(samples):
            if len(tok) > cfg.max_length:
                if cfg.truncation == "drop":
                    dropped["too_long"] += 1
                    continue
                tok, mask = tok[: cfg.max_length], mask[: cfg.max_length]
                truncated += 1
            if int(mask.sum()) < cfg.min_supervised_tokens:
                dropped["no_supervised_tokens"] += 1
                continue
            if cfg.max_samples is not None and len(ids) >= cfg.max_samples:
                break
            ids.append(record_id if len(samples) == 1 else f"{record_id}#{turn}")
            all_ids.append(tok)
            all_masks.append(mask)
            freq.update(tok[mask.astype(bool)].tolist())

    summary = {
        "records_read": records,
        "samples": len(ids),
        "dropped": dict(sorted(dropped.items())),
        "truncated": truncated,
        "tokens": int(sum(len(t) for t in all_ids)),
        "supervised_tokens": int(sum(int(m.sum()) for m in all_masks)),
        "eval_overlap": {
            "ngram": held_out.n,
            "min_containment": held_out.min_containment,
            "dropped_per_eval_file": [overlap[i] for i in range(held_out.n_sets)],
        },
    }
    if not ids:
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(dropped.items())) or "no records"
        remedy = DROP_REMEDIES.get(
            max(dropped, key=dropped.get) if dropped else "",
            "check the data format and the verifier's chat template",
        )
        raise UserError(
            f"{path}: no usable training samples ({records} records read; dropped {reasons}); "
            f"{remedy}"
        )
    return PreparedSamples(ids, all_ids, all_masks, freq, summary)


def read_eval_prompts(path: Path, max_prompts: int | None) -> list[dict[str, str]]:
    """Held-out prompts: MT-bench ({turns}), HumanEval ({prompt}) or conversations (first user turn)."""
    prompts = []
    for lineno, record in read_records(path):
        if max_prompts is not None and len(prompts) >= max_prompts:
            break
        if not isinstance(record, dict):
            raise UserError(
                f"{path}:{lineno}: a prompt record must be a JSON object; fix or remove the line"
            )
        rid = str(record.get("question_id", record.get("task_id", record.get("id", lineno))))
        if isinstance(record.get("turns"), list) and record["turns"]:
            text = record["turns"][0]
        elif isinstance(record.get("prompt"), str):
            text = record["prompt"]
        else:
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
            text = users[0]
        if not isinstance(text, str) or not text.strip():
            raise UserError(f"{path}:{lineno}: empty prompt; write the prompt or remove the line")
        prompts.append({"id": rid, "text": text})
    if not prompts:
        raise UserError(
            f"{path}: no evaluation prompts found; add prompt records ({{turns}}, {{prompt}} or "
            "a conversation) or point the eval set at another file"
        )
    return prompts


def eos_ids(*values) -> set[int]:
    """End-of-sequence ids from tokenizer/generation-config fields (an id, a list, or None)."""
    out: set[int] = set()
    for value in values:
        if isinstance(value, (list, tuple, set)):
            out.update(int(v) for v in value)
        elif value is not None:
            out.add(int(value))
    return out


def until_eos(tokens: list[int], eos: set[int], limit: int | None = None) -> list[int]:
    """``tokens`` cut after the first end-of-sequence id (and to ``limit`` tokens)."""
    tokens = tokens[:limit] if limit is not None else tokens
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def prompt_token_ids(tokenizer, text: str) -> list[int]:
    return render_ids(tokenizer, [{"role": "user", "content": text}], add_generation_prompt=True)


# ---- the prepared-samples artifact -------------------------------------------------------


def save_prepared(prepared: PreparedSamples, samples_path: Path, vocab_size: int) -> None:
    """samples.safetensors: flat input_ids/loss_mask + offsets, and the token frequencies."""
    import torch
    from safetensors.torch import save_file

    from eagle3lib.fileio import atomic_path

    lengths = np.asarray([len(t) for t in prepared.input_ids], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    freq = np.zeros(vocab_size, dtype=np.int64)
    for token, count in prepared.token_freq.items():
        if token >= vocab_size:
            raise UserError(
                f"{samples_path}: token id {token} is outside the verifier vocab ({vocab_size}); "
                "the tokenizer has more tokens than the model's config.json vocab_size: fix "
                "the verifier folder"
            )
        freq[token] = count
    tensors = {
        "input_ids": torch.from_numpy(np.concatenate(prepared.input_ids).astype(np.int32)),
        "loss_mask": torch.from_numpy(np.concatenate(prepared.loss_masks).astype(np.uint8)),
        "offsets": torch.from_numpy(offsets),
        "token_freq": torch.from_numpy(freq),
    }
    with atomic_path(samples_path) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "eagle3lib.samples/1"})


@dataclasses.dataclass
class Samples:
    """The prepared samples, loaded: sample i is input_ids[offsets[i]:offsets[i+1]]."""

    input_ids: np.ndarray
    loss_mask: np.ndarray
    offsets: np.ndarray
    token_freq: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = self.offsets[i], self.offsets[i + 1]
        return self.input_ids[a:b], self.loss_mask[a:b]


def load_samples(path: Path) -> Samples:
    from safetensors.numpy import load_file

    try:
        t = load_file(str(path))
        return Samples(t["input_ids"], t["loss_mask"], t["offsets"], t["token_freq"])
    except Exception as exc:  # noqa: BLE001 - SafetensorError, OSError, a missing tensor
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(
            f"{path}: unreadable prepared samples ({detail}); delete it and rerun the prepare rule"
        ) from None


def shard_range(n_samples: int, shard: int, n_shards: int) -> tuple[int, int]:
    """Shard i holds the fixed slice [n*i/N, n*(i+1)/N) of the samples."""
    return n_samples * shard // n_shards, n_samples * (shard + 1) // n_shards
