"""Conversations -> token ids and loss masks (assistant tokens only), and the prepared-samples
file that holds them.

Loss masks come from the verifier's own chat template: for every assistant turn j the
supervised span is render(turns[:j+1]) minus render(turns[:j], add_generation_prompt=True),
so the end-of-turn tokens the template emits are supervised too. When a template rewrites
history (e.g. drops earlier ``<think>`` blocks) one conversation fans out into one sample per
assistant turn, each the exact token sequence the verifier sees at that turn.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import multiprocessing
import os
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from eagle3lib.conversations import (
    InvalidRecord,
    TrainSource,
    first_prompt_key,
    normalize_conversation,
    read_records,
    spread,
)
from eagle3lib.errors import UserError, first_line
from eagle3lib.leakage import EvalPromptIndex


def render_ids(tokenizer, messages, add_generation_prompt: bool) -> list[int]:
    """Token ids of ``messages`` rendered with the tokenizer's chat template."""
    return render_ids_batch(tokenizer, [messages], add_generation_prompt)[0]


def render_ids_batch(tokenizer, conversations, add_generation_prompt: bool) -> list[list[int]]:
    """``render_ids`` of several conversations, encoded as one batch (on all cores)."""
    if not conversations:
        return []
    ids = tokenizer.apply_chat_template(
        conversations, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
    )
    return [list(x) for x in ids]


def check_chat_template(tokenizer, where: str) -> None:
    """The tokenizer has a chat template, and it parses (a syntax error would otherwise be
    reported against the first training record)."""
    from jinja2 import TemplateSyntaxError

    if not getattr(tokenizer, "chat_template", None):
        raise UserError(
            f"{where}: the verifier's tokenizer has no chat template; loss masks are derived "
            "from it. Use an instruct/chat model or add chat_template.jinja to its folder"
        )
    exchange = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    try:
        tokenizer.apply_chat_template(exchange, tokenize=False)
    except Exception as exc:  # noqa: BLE001 - whatever the template raises
        if not isinstance(exc, TemplateSyntaxError):
            return  # a template may refuse this exchange (raise_exception); records will tell
        raise UserError(
            f"{where}: the verifier's chat template does not parse ({first_line(exc)}); fix "
            "chat_template.jinja (or chat_template in tokenizer_config.json) in its folder"
        ) from None


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


# One sample: token ids (int64) and their loss mask (uint8, 1 where supervised).
Sample = tuple[np.ndarray, np.ndarray]


@dataclasses.dataclass
class PreparedSamples:
    """prepare_samples' output: the samples in file order, their ids and what it counted."""

    ids: list[str]
    input_ids: list[np.ndarray]
    loss_masks: list[np.ndarray]
    token_freq: Counter
    summary: dict[str, Any]

    def add(self, sample_id: str, input_ids: np.ndarray, loss_mask: np.ndarray) -> None:
        """Append one sample and count its supervised tokens."""
        self.ids.append(sample_id)
        self.input_ids.append(input_ids)
        self.loss_masks.append(loss_mask)
        self.token_freq.update(input_ids[loss_mask.astype(bool)].tolist())


@dataclasses.dataclass
class _Counts:
    """What prepare_samples read, dropped (by reason, in the order first met) and truncated."""

    records: int = 0
    truncated: int = 0
    dropped: Counter = dataclasses.field(default_factory=Counter)
    overlap: Counter = dataclasses.field(default_factory=Counter)  # dropped per eval set


def prepare_samples(
    tokenizer,
    sources: Path | list[TrainSource],
    cfg,
    held_out: EvalPromptIndex | None = None,
    workers: int = 1,
) -> PreparedSamples:
    """Read conversations, build samples with loss masks, count what was dropped and why.

    ``sources``: one file (read with ``cfg``'s allow_truncated_json and max_samples), or the
    files of data.train and data.extra_train in order, each with its own options; a sample of
    an extra file has its ``id_prefix`` before its id. Conversations whose user turns hold an
    eval prompt of ``held_out`` (copies, substrings, near-duplicates: eagle3lib/leakage.py)
    are dropped and counted per eval set; with ``cfg.dedupe``, so are those whose first prompt
    repeats a kept conversation's (conversations.first_prompt_key), of any file. With
    ``workers`` > 1 the records are tokenized by that many processes; the result is the same.
    """
    if isinstance(sources, (str, Path)):
        sources = [TrainSource(Path(sources), cfg.allow_truncated_json, cfg.max_samples)]
    check_chat_template(tokenizer, getattr(tokenizer, "name_or_path", "") or str(sources[0].path))
    held_out = held_out or EvalPromptIndex()
    stop_at = cfg.max_length if cfg.truncation == "truncate" else None
    out = PreparedSamples([], [], [], Counter(), {})
    counts = _Counts()
    kept_prompts: set[str] = set()  # first_prompt_key of the conversations kept (dedupe)
    per_source = []
    for source in sources:
        records_before, samples_before = counts.records, len(out.ids)
        _prepare_source(
            tokenizer, source, cfg, (held_out, stop_at, workers), out, counts, kept_prompts
        )
        per_source.append(
            {
                "path": source.path.name,
                "records_read": counts.records - records_before,
                "samples": len(out.ids) - samples_before,
            }
        )
    if len(sources) > 1:  # the files' samples spread evenly among each other
        starts = list(itertools.accumulate([0] + [s["samples"] for s in per_source]))
        order = spread([range(a, b) for a, b in itertools.pairwise(starts)])
        out.ids = [out.ids[i] for i in order]
        out.input_ids = [out.input_ids[i] for i in order]
        out.loss_masks = [out.loss_masks[i] for i in order]
    out.summary = _summary(out, counts, held_out)
    if len(sources) > 1:  # one file's summary stays as it was
        out.summary["sources"] = per_source
    if not out.ids:
        raise _no_samples_error(", ".join(str(s.path) for s in sources), counts)
    return out


def _prepare_source(
    tokenizer,
    source: TrainSource,
    cfg,
    how: tuple[EvalPromptIndex, int | None, int],
    out: PreparedSamples,
    counts: _Counts,
    kept_prompts: set[str],
) -> None:
    """prepare_samples for one file: its samples added to ``out``, at most its max_samples."""
    held_out, stop_at, workers = how
    path, samples_before = source.path, len(out.ids)
    records = read_records(path, source.allow_truncated_json, source.key)
    for lineno, record, outcome in _outcomes(records, (tokenizer, held_out, stop_at), workers):
        room = (
            None
            if source.max_samples is None
            else source.max_samples - (len(out.ids) - samples_before)
        )
        counts.records += 1
        samples, reason, sets, invalid, key = outcome
        if invalid and cfg.on_invalid_record == "error":
            raise UserError(
                f"{path}:{lineno}: {invalid}; fix the record or set "
                "data.on_invalid_record: skip to drop such records"
            )
        counts.overlap.update(sets)
        if not reason and cfg.dedupe and key in kept_prompts:
            reason = "repeated_prompt"
        if reason:
            counts.dropped[reason] += 1
            continue
        record_id = source.id_prefix + _record_id(record, lineno)
        kept, dropped, truncated = _fit_samples(samples, record_id, cfg, room)
        counts.dropped.update(dropped)
        counts.truncated += truncated
        if kept:
            kept_prompts.add(key)
        for sample_id, input_ids, loss_mask in kept:
            out.add(sample_id, input_ids, loss_mask)
        if room is not None and len(kept) >= room:
            break  # enough samples: no later record is read (nor computed, nor an error in it)


# What the worker processes of _outcomes tokenize with: (tokenizer, held_out, stop_at), set
# before they are forked, so that nothing of it is pickled.
_WORKER_ARGS: tuple | None = None


def _outcomes(
    records: Iterable[tuple[int, Any]], args: tuple, workers: int, window: int = 64
) -> Iterator[tuple[int, Any, tuple]]:
    """(line, record, _record_outcome(record)) in file order. With ``workers`` > 1, forked
    processes compute them ``window`` records a worker at a time, the next window while the
    caller consumes this one (a caller that stops early wastes at most two windows). An error
    in reading a record or in computing its outcome is raised where one process would meet
    it: after the records before it, and not at all for a caller that stops earlier. A worker
    that dies (e.g. killed for memory) fails the call instead of hanging it."""
    if workers <= 1:
        for lineno, record in records:
            yield lineno, record, _record_outcome(*args, record)
        return
    global _WORKER_ARGS
    _WORKER_ARGS = args
    size = window * workers
    pool = concurrent.futures.ProcessPoolExecutor(
        workers, mp_context=multiprocessing.get_context("fork"), initializer=_worker_start
    )

    def read_window():
        batch, error = [], None
        try:
            batch.extend(itertools.islice(records, size))
        except Exception as exc:  # noqa: BLE001 - raised below, in file order
            error = exc
        return batch, pool.map(_worker_outcome, [r for _, r in batch], chunksize=8), error

    try:
        current = read_window()
        while True:
            batch, outcomes, error = current
            more = len(batch) == size and error is None
            if more:
                current = read_window()
            for (lineno, record), outcome in zip(batch, outcomes, strict=True):
                if isinstance(outcome, BaseException):
                    raise outcome
                yield lineno, record, outcome
            if error is not None:
                raise error
            if not more:
                return
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        _WORKER_ARGS = None


def _worker_start() -> None:
    # each forked worker encodes one conversation at a time: no Rust thread pool per worker
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _worker_outcome(record: Any) -> tuple | Exception:
    """_record_outcome in a worker; an unexpected error is returned, to be raised in order."""
    try:
        return _record_outcome(*_WORKER_ARGS, record)
    except Exception as exc:  # noqa: BLE001 - raised by _outcomes at this record
        return exc


def _record_outcome(
    tokenizer, held_out: EvalPromptIndex, stop_at: int | None, record: Any
) -> tuple[list[Sample], str, set[int], str, str | None]:
    """_record_samples' (samples, reason, sets), "" and the record's first_prompt_key, or for
    a record that cannot be used (no samples, "invalid: <its reason>", no sets, the error's
    message, None); picklable."""
    try:
        return (*_record_samples(tokenizer, record, held_out, stop_at), "", _prompt_key(record))
    except InvalidRecord as exc:
        return [], f"invalid: {exc.reason}", set(), str(exc), None


def _prompt_key(record: Any) -> str | None:
    return first_prompt_key(normalize_conversation(record))


def _record_samples(
    tokenizer, record: Any, held_out: EvalPromptIndex, stop_at: int | None
) -> tuple[list[Sample], str, set[int]]:
    """A record's samples and "", or no samples and the reason the record is dropped; with the
    eval sets its user turns overlap. Raises InvalidRecord for a record that cannot be used."""
    messages = normalize_conversation(record)
    sets = held_out.overlapping_sets(m["content"] for m in messages if m["role"] == "user")
    if sets:
        return [], "eval_prompt_overlap", sets
    try:
        samples = tokenize_conversation(tokenizer, messages, stop_at)
    except InvalidRecord:
        raise
    except Exception as exc:  # jinja raise_exception, e.g. roles must alternate
        raise InvalidRecord("chat template failed", first_line(exc)) from None
    return samples, "" if samples else _no_samples_reason(messages), set()


def _no_samples_reason(messages: list[dict[str, str]]) -> str:
    """Why a valid conversation gave no sample."""
    roles = [m["role"] for m in messages]
    first_user = roles.index("user") if "user" in roles else len(roles)
    has_reply = "assistant" in roles[first_user:]
    # With a reply but no span, the prompt alone already filled max_length.
    return "prompt_exceeds_max_length" if has_reply else "no_assistant_turn"


def _record_id(record: Any, lineno: int) -> str:
    return str(record.get("id", lineno)) if isinstance(record, dict) else str(lineno)


def _fit_samples(
    samples: list[Sample], record_id: str, cfg, room: int | None
) -> tuple[list[tuple[str, np.ndarray, np.ndarray]], Counter, int]:
    """One record's samples cut to (or dropped above) max_length, less those with too few
    supervised tokens, at most ``room`` of them, with their ids; what was dropped and how
    many were truncated (a truncated sample past ``room`` counts too)."""
    kept: list[tuple[str, np.ndarray, np.ndarray]] = []
    dropped: Counter = Counter()
    truncated = 0
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
        if room is not None and len(kept) >= room:
            break
        kept.append((record_id if len(samples) == 1 else f"{record_id}#{turn}", tok, mask))
    return kept, dropped, truncated


def _summary(prepared: PreparedSamples, counts: _Counts, held_out: EvalPromptIndex) -> dict:
    return {
        "records_read": counts.records,
        "samples": len(prepared.ids),
        "dropped": dict(sorted(counts.dropped.items())),
        "truncated": counts.truncated,
        "tokens": int(sum(len(t) for t in prepared.input_ids)),
        "supervised_tokens": int(sum(int(m.sum()) for m in prepared.loss_masks)),
        "eval_overlap": {
            "ngram": held_out.n,
            "min_containment": held_out.min_containment,
            "dropped_per_eval_file": [counts.overlap[i] for i in range(held_out.n_sets)],
        },
    }


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


def _no_samples_error(path: Path | str, counts: _Counts) -> UserError:
    dropped = counts.dropped
    reasons = ", ".join(f"{k}: {v}" for k, v in sorted(dropped.items())) or "no records"
    remedy = DROP_REMEDIES.get(
        max(dropped, key=dropped.get) if dropped else "",
        "check the data format and the verifier's chat template",
    )
    return UserError(
        f"{path}: no usable training samples ({counts.records} records read; dropped {reasons}); "
        f"{remedy}"
    )


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
        detail = first_line(exc)
        raise UserError(
            f"{path}: unreadable prepared samples ({detail}); delete it and rerun the prepare rule"
        ) from None


def shard_range(n_samples: int, shard: int, n_shards: int) -> tuple[int, int]:
    """Shard i holds the fixed slice [n*i/N, n*(i+1)/N) of the samples."""
    return n_samples * shard // n_shards, n_samples * (shard + 1) // n_shards
