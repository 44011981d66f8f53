"""Regenerate assistant turns with the verifier, turn by turn, so the draft learns the
verifier's own distribution (EAGLE-3 trains on the target model's responses).

For every conversation the original assistant turns are dropped; each user turn is answered by
the verifier given the regenerated history so far. Backends: ``hf`` (batched ``generate``:
the same turn of many conversations at once, left-padded) and ``vllm`` (an OpenAI server on
127.0.0.1, requests in parallel). Work is done in chunks of conversations written as they
finish, so an interrupted job resumes with the missing chunks only.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from eagle3lib.config import RegenerateConfig
from eagle3lib.conversations import (
    InvalidRecord,
    TrainSource,
    first_prompt_key,
    normalize_conversation,
    read_records,
    spread,
)
from eagle3lib.data import eos_ids, until_eos
from eagle3lib.errors import UserError
from eagle3lib.fileio import atomic_path, fingerprinted_dir, remove_stale_temps
from eagle3lib.lifetime import signals_deferred

Generate = Callable[[list[list[int]]], list[list[int]]]  # prompts (token ids) -> new token ids


# generate() arguments that switch off the logit processors a verifier's generation_config may
# carry (a repetition penalty would make "greedy" differ from the argmax the draft learns).
RAW_LOGITS = {
    "repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "bad_words_ids": None,
    "min_new_tokens": None,
    "min_length": 0,
    "top_k": None,
}


def prompts_of(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """The turns that drive regeneration: system and user turns (assistant turns are redone)."""
    return [m for m in messages if m["role"] in ("system", "user")]


def read_conversations(
    path: Path,
    limit: int | None,
    allow_truncated: bool,
    on_invalid: str,
    dedupe: bool = False,
    log=None,
    *,
    seen: set[str] | None = None,
    source: TrainSource | None = None,
) -> list[dict[str, Any]]:
    """The first ``limit`` usable conversations with at least one user turn; with ``dedupe``,
    none whose first prompt repeats an earlier one's (conversations.first_prompt_key; also
    one in ``seen``, which is updated). With ``source`` (one of several files): its id prefix
    before the ids, its config key in errors, its name in the log, and no error when no
    conversation is left (read_sources checks all files together)."""
    out = []
    seen = set() if seen is None else seen
    repeats = 0
    config_key = source.key if source else "data.train"
    for lineno, record in read_records(path, allow_truncated, config_key):
        if limit is not None and len(out) >= limit:
            break
        try:
            messages = normalize_conversation(record)
        except InvalidRecord as exc:
            if on_invalid == "error":
                raise UserError(
                    f"{path}:{lineno}: {exc}; fix it or set data.on_invalid_record: skip"
                ) from None
            continue
        turns = prompts_of(messages)
        if not any(m["role"] == "user" for m in turns):
            continue
        if dedupe:
            key = first_prompt_key(turns)
            if key in seen:
                repeats += 1
                continue
            seen.add(key)
        rid = str(record.get("id", lineno)) if isinstance(record, dict) else str(lineno)
        out.append({"id": (source.id_prefix if source else "") + rid, "turns": turns})
    if dedupe and log is not None:
        where = f" ({path.name})" if source else ""
        log(
            f"regenerate: {repeats} conversation(s){where} skipped: first prompt repeats an "
            "earlier one"
        )
    if not out and source is None:
        raise UserError(f"{path}: no conversation with a user turn to regenerate")
    return out


def read_sources(
    sources: list[TrainSource], on_invalid: str, dedupe: bool = False, log=None
) -> list[dict[str, Any]]:
    """read_conversations of each file (data.train's, then data.extra_train's), read in
    order, each at most its max_samples (with ``dedupe`` no first prompt repeats one of any
    file read before), then spread evenly among each other (conversations.spread)."""
    if len(sources) == 1:
        s = sources[0]
        return read_conversations(s.path, s.max_samples, s.allow_truncated_json, on_invalid,
                                  dedupe, log)  # fmt: skip
    seen: set[str] = set()
    each = [
        read_conversations(
            s.path, s.max_samples, s.allow_truncated_json, on_invalid, dedupe, log,
            seen=seen, source=s,
        )
        for s in sources
    ]  # fmt: skip
    if not any(each):
        names = ", ".join(str(s.path) for s in sources)
        raise UserError(f"{names}: no conversation with a user turn to regenerate")
    return spread(each)


def answer_text(tokenizer, ids: list[int]) -> str:
    """The assistant turn stored for the generated ``ids``: their text without special tokens,
    stripped (prepare renders it through the chat template again, so the tokens trained on
    can differ from ``ids`` where decoding and encoding do not round-trip), without a
    character the token limit cut (``without_cut_character``)."""
    return without_cut_character(tokenizer.decode(ids, skip_special_tokens=True).strip())


def without_cut_character(text: str) -> str:
    """``text`` without its last U+FFFD: what decoding leaves of a character whose bytes the
    token limit cut off (one U+FFFD, however many of its bytes came). Kept where nothing else
    would be left (a text of such characters only)."""
    if text.endswith("\ufffd") and text[:-1].strip():
        return text[:-1].strip()
    return text


def regenerate_chunk(
    conversations: list[dict[str, Any]],
    render: Callable[[list[list[dict[str, str]]]], list[list[int]]],
    decode: Callable[[list[int]], str],
    generate: Generate,
    max_length: int,
    max_turns: int | None = None,
    wave: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Answer every user turn of every conversation (the first ``max_turns``), each given the
    conversation's regenerated history. ``render`` gives the token ids of several histories
    at once (the tokenizer encodes a batch on all cores).

    A conversation's next turn is ready once its previous answer is in. Each generate call
    takes the ready turns: all of them (``wave`` None: one call per turn index), or the
    ``wave`` whose conversations have the most user turns left (ties: the shorter prompts,
    then chunk order). With
    ``wave`` the size of a generate batch, every call but the last is a full batch and the
    long conversations are answered alongside the short ones instead of after them, so a
    chunk needs about (its turns / ``wave``) calls rather than one per turn index.
    ``progress`` gets a line after each call."""
    histories: list[list[dict[str, str]]] = [[] for _ in conversations]
    pending = [list(c["turns"]) for c in conversations]
    left = [max_turns or sys.maxsize] * len(conversations)  # answers still allowed
    prompts: dict[int, list[int]] = {}

    def ask(conversations: Iterable[int]) -> None:
        """Queue each conversation's next user turn (with the system turns before it), if
        one is left and its prompt leaves room for a reply within max_length."""
        asked, before = [], {}
        for i in conversations:
            turns = pending[i]
            if left[i] == 0:
                continue
            before[i] = len(histories[i])
            while turns and turns[0]["role"] == "system":
                histories[i].append(turns.pop(0))
            if turns:
                histories[i].append(turns.pop(0))
                asked.append(i)
            else:  # system turns that lead no user turn: left out, as after max_turns
                del histories[i][before[i] :]
        for i, ids in zip(
            asked, render([histories[i] for i in asked]) if asked else [], strict=True
        ):
            if len(ids) >= max_length:  # the reply would be cut off by data.max_length anyway
                del histories[i][before[i] :]  # the turn and the system turns before it
            else:
                prompts[i] = ids

    def users_left(i: int) -> int:
        """User turns conversation i may still have answered after its queued one."""
        return min(left[i] - (i in prompts), sum(m["role"] == "user" for m in pending[i]))

    ask(range(len(conversations)))
    answered = calls = 0
    while prompts:
        t0 = time.perf_counter()
        ready = sorted(prompts)
        if wave is not None:  # ties: the shorter prompts (less padding), then chunk order
            ready = sorted(ready, key=lambda i: (-users_left(i), len(prompts[i])))[:wave]
        for i, new in zip(ready, generate([prompts.pop(i) for i in ready]), strict=True):
            histories[i].append({"role": "assistant", "content": decode(new)})
            left[i] -= 1
        ask(ready)
        answered, calls = answered + len(ready), calls + 1
        if progress is not None:
            at_most = len(prompts) + sum(users_left(i) for i in range(len(conversations)))
            progress(
                f"call {calls}: {answered} turns answered, at most {at_most} to go "
                f"({len(ready)} in {time.perf_counter() - t0:.1f} s)"
            )
    return [
        {"id": c["id"], "messages": h}
        for c, h in zip(conversations, histories, strict=True)
        if any(m["role"] == "assistant" for m in h)
    ]


# The attention HF generate runs under grouped_query_decoding (registered on first use).
GROUPED_SDPA = "eagle3-grouped-sdpa"
# Decoding steps (and short verification chunks) are folded; a prefill is left to HF's sdpa.
FOLD_MAX_QUERIES = 16
# (device type, dtype) whose decoding steps SDPA's cuDNN backend takes whole (enable_gqa with
# the padding mask), set by grouped_query_decoding from cudnn_grouped_decoding; None: fold.
_cudnn_step = None


@functools.cache
def cudnn_grouped_decoding(device: str, dtype, groups: int, head_dim: int) -> bool:
    """Whether SDPA's cuDNN backend takes a decoding step with grouped key/value heads under a
    padding mask (``enable_gqa``) on ``device`` in ``dtype``, and agrees with the math backend
    there: one small call each. cuDNN takes bf16 and fp16 on recent NVIDIA GPUs, never fp32,
    and none of this on a CPU. On an H200 such a bf16 step of batch 1024 ran 1.8 x faster than
    the folded heads, giving transformers' sdpa output to the bit (BENCHMARKS.md)."""
    import torch

    if torch.device(device).type != "cuda":
        return False
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator(device=device).manual_seed(0)
    query = torch.randn(2, groups, 1, head_dim, generator=g, device=device, dtype=dtype)
    key, value = (
        torch.randn(2, 1, 64, head_dim, generator=g, device=device, dtype=dtype) for _ in range(2)
    )
    mask = (torch.arange(64, device=device) >= torch.tensor([[0], [37]], device=device))[
        :, None, None
    ]  # the second row left-padded
    sdpa = torch.nn.functional.scaled_dot_product_attention
    try:  # torch warns why each kernel declines before it raises: the answer is enough here
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = sdpa(query, key, value, attn_mask=mask, enable_gqa=True)
    except RuntimeError:  # "No available kernel": this dtype, head size or cuDNN
        return False
    with sdpa_kernel([SDPBackend.MATH]):
        want = sdpa(query, key, value, attn_mask=mask, enable_gqa=True)
    return bool(torch.allclose(got.float(), want.float(), rtol=0.02, atol=0.02))


def grouped_sdpa_attention(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs
):
    """HF's ``sdpa`` attention, except where a few query positions (a decoding step) attend
    under a padding mask with grouped key/value heads (GQA): the query heads that share a
    key/value head are then attended as extra query rows of that head. transformers instead
    copies every key and value once per query head whenever a mask is given (torch's flash
    and memory-efficient kernels take no mask together with ``enable_gqa``), so a decoding
    step of a large left-padded batch writes and reads its KV cache several times over (at
    SmolLM2-135M's 9 query and 3 key/value heads: 3 copies). Each query row's scores, softmax
    and weighted sum are the same computation either way; the kernels may round differently
    (bit-identical in fp32 on an H200, a rounding step in 3 values of 10,000 in bf16:
    BENCHMARKS.md). Where cuDNN's kernel takes the step with ``enable_gqa`` and the mask (bf16
    or fp16 on a GPU, cudnn_grouped_decoding), that one call runs instead: it reads each
    key/value head once for its query heads, without folding them."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, queries, dim = query.shape
    kv_heads = key.shape[1]
    if (
        groups == 1
        or attention_mask is None
        or attention_mask.ndim != 4
        or attention_mask.shape[1] != 1
        or queries > FOLD_MAX_QUERIES
        or dropout > 0
        or heads != kv_heads * groups
        or any(kwargs.get(k) is not None for k in ("position_bias", "cache"))
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    mask = attention_mask[:, :, :, : key.shape[-2]]
    if (query.device.type, query.dtype) == _cudnn_step:
        # cuDNN first (torch's default order puts it last on some GPUs); math if it refuses
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH], set_priority=True):
            out = torch.nn.functional.scaled_dot_product_attention(
                query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True
            )
        return out.transpose(1, 2).contiguous(), None
    # query head h uses key/value head h // groups (HF's repeat_kv): rows (group, position)
    mask = mask[:, :, None].expand(batch, 1, groups, queries, mask.shape[-1])
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(batch, kv_heads, groups * queries, dim),
        key,
        value,
        attn_mask=mask.reshape(batch, 1, groups * queries, -1),
        scale=scaling,
    )
    return out.reshape(batch, heads, queries, dim).transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def grouped_query_decoding(model):
    """Run ``model`` with grouped_sdpa_attention while in the block, where it uses HF's sdpa
    (other implementations are left as they are), and restore it after."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        yield
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if GROUPED_SDPA not in AttentionInterface._global_mapping:  # noqa: SLF001
        AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_attention)
        AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)  # the masks sdpa gets
    global _cudnn_step
    before = _cudnn_step
    weight = model.get_input_embeddings().weight
    geometry = head_geometry(model.config)
    cudnn = (
        geometry is not None
        and cudnn_usable()
        and cudnn_grouped_decoding(str(weight.device), weight.dtype, *geometry)
    )
    model.set_attn_implementation(GROUPED_SDPA)
    _cudnn_step = (weight.device.type, weight.dtype) if cudnn else None
    try:
        yield
    finally:
        model.set_attn_implementation("sdpa")
        _cudnn_step = before


def head_geometry(config) -> tuple[int, int] | None:
    """(query heads per key/value head, head size) of an HF model's language model (its text
    config where it nests one), or None where the config does not say."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    if not isinstance(heads, int) or heads <= 0:
        return None
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or getattr(text, "hidden_size", 0) // heads
    return (heads // kv_heads, head_dim) if head_dim else None


def cudnn_usable() -> bool:
    """Whether SDPA may use cuDNN now: it is on, and deterministic algorithms (which cuDNN's
    kernel is not) are not asked for. Otherwise a step sent to it would fall to the math
    backend, many times slower than the folded heads."""
    import torch

    return (
        torch.backends.cuda.cudnn_sdp_enabled() and not torch.are_deterministic_algorithms_enabled()
    )


def hf_generate(
    model, tokenizer, cfg: RegenerateConfig, prompt_width: int | None = None
) -> Generate:
    """Batched greedy/sampled generation with the HF verifier (left padding). With
    ``cfg.compile`` (static cache) every call has one shape, ``cfg.batch_size`` rows (filler
    rows repeat the batch's first prompt; their output is dropped) left-padded to
    ``prompt_width`` tokens, so that generate's compiled decoding compiles once."""
    import torch

    device = model.get_input_embeddings().weight.device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = model.generation_config.eos_token_id or tokenizer.eos_token_id
    torch.manual_seed(cfg.seed)
    # A static KV cache is written in place; the dynamic one is concatenated every step. On an
    # H200 (SmolLM2-135M, 256 new tokens) that is 45 vs 85 ms a step at batch 512 and 161 vs
    # 200 ms at 2048 (BENCHMARKS.md). generate's auto-compile is off: it recompiles per shape.
    fixed = cfg.compile and cfg.kv_cache == "static"
    cache = (
        {"cache_implementation": "static", "disable_compile": not fixed}
        if cfg.kv_cache == "static"
        else {}
    )

    def generate(prompts: list[list[int]]) -> list[list[int]]:
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        results: dict[int, list[int]] = {}
        for start in range(0, len(order), cfg.batch_size):
            batch = order[start : start + cfg.batch_size]
            width = max(len(prompts[i]) for i in batch)
            rows = batch
            if fixed:
                width = max(width, prompt_width or 0)
                rows = batch + [batch[0]] * (cfg.batch_size - len(batch))
            ids = torch.full((len(rows), width), pad, dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for r, i in enumerate(rows):
                ids[r, width - len(prompts[i]) :] = torch.as_tensor(prompts[i])
                mask[r, width - len(prompts[i]) :] = 1
            with torch.inference_mode(), grouped_query_decoding(model):
                gen = model.generate(
                    input_ids=ids.to(device),
                    attention_mask=mask.to(device),
                    max_new_tokens=cfg.max_new_tokens,
                    do_sample=cfg.temperature > 0,
                    temperature=cfg.temperature if cfg.temperature > 0 else None,
                    top_p=cfg.top_p if cfg.temperature > 0 else None,
                    pad_token_id=pad,
                    eos_token_id=eos,
                    **RAW_LOGITS,
                    **cache,
                )
            for r, i in enumerate(batch):
                results[i] = until_eos(gen[r, width:].tolist(), eos_ids(eos))  # padding follows
        return [results[i] for i in range(len(prompts))]

    return generate


def vllm_generate(server, cfg: RegenerateConfig) -> Generate:
    """Requests to a running vLLM server, ``cfg.concurrency`` at a time."""

    def one(item: tuple[int, list[int]]) -> list[int]:
        return server.complete(
            item[1], cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p, seed=cfg.seed
        )

    return in_parallel(one, cfg.concurrency)


def in_parallel(one, concurrency: int) -> Generate:
    """A Generate that sends ``one((i, prompt))`` for every prompt, ``concurrency`` at a time."""

    def generate(prompts: list[list[int]]) -> list[list[int]]:
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=concurrency)
        try:
            out = list(pool.map(one, enumerate(prompts)))
        except BaseException:
            # a failed request, or SIGTERM: the requests under way are not waited for (they
            # end once the caller stops the server); the others are not sent
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown()
        return out

    return generate


# ---- synthetic prompts (regenerate.synthetic_prompts): Magpie, Xu et al. 2024 ----------------

USER_TEXT = "\x00user text\x00"  # where a user turn's text goes; no template writes it


def user_turn_prefix(tokenizer, system: str | None = None) -> list[int]:
    """The chat template rendered up to where the text of a first user turn begins: under
    system turn ``system``, or the one the template adds by default (if any) for None. What a
    synthetic prompt continues."""
    turns = [{"role": "system", "content": system}] if system is not None else []
    try:
        text = tokenizer.apply_chat_template(
            [*turns, {"role": "user", "content": USER_TEXT}], tokenize=False
        )
    except Exception as exc:  # e.g. a template that raises on a system turn
        if system is None:
            raise
        raise UserError(
            f"config key regenerate.synthetic_system_prompts: the verifier's chat template "
            f"refused the system turn {system!r} ({exc}); leave the key empty"
        ) from exc
    if USER_TEXT not in text:
        raise UserError(
            "config key regenerate.synthetic_prompts: the verifier's chat template does not "
            "render a user turn's text as given; set synthetic_prompts: 0"
        )
    if system is not None and system.strip() not in text:  # templates may trim it
        raise UserError(
            "config key regenerate.synthetic_system_prompts: the verifier's chat template does "
            f"not render the system turn {system!r}; leave the key empty"
        )
    return tokenizer(text[: text.index(USER_TEXT)], add_special_tokens=False)["input_ids"]


def sampling(cfg: RegenerateConfig) -> RegenerateConfig:
    """How synthetic prompts are sampled: temperature 1, no nucleus cut, at most
    synthetic_max_tokens tokens."""
    return dataclasses.replace(
        cfg, temperature=1.0, top_p=1.0, max_new_tokens=cfg.synthetic_max_tokens
    )


def vllm_sample(server, cfg: RegenerateConfig) -> Generate:
    """Synthetic prompts from a vLLM server: request i gets seed ``cfg.seed + i``, so that the
    same prefix gives different samples, reproducibly."""

    s = sampling(cfg)

    def one(item: tuple[int, list[int]]) -> list[int]:
        i, prompt = item
        return server.complete(
            prompt, s.max_new_tokens, temperature=s.temperature, top_p=s.top_p, seed=s.seed + i
        )  # top_k, min_p and repetition penalty off (serve.VllmServer.completion)

    return in_parallel(one, cfg.concurrency)


def synthetic_conversations(
    sample: Generate,
    prefixes: list[list[int]],
    cfg: RegenerateConfig,
    decode,
    eos: set[int],
    log=print,
) -> list[dict[str, Any]]:
    """``cfg.synthetic_prompts`` user prompts sampled after ``prefixes`` (prompt i after
    prefix i mod their number: one per system prompt), as one-turn conversations
    ``synthetic-<i>``; dropped: a prompt that has not ended its turn (an ``eos`` token) within
    ``cfg.synthetic_max_tokens`` tokens, an empty one, one repeating an earlier kept one
    (conversations.first_prompt_key)."""
    t0 = time.perf_counter()
    out, seen = [], set()
    unfinished = empty = repeats = 0
    asked = [list(prefixes[i % len(prefixes)]) for i in range(cfg.synthetic_prompts)]
    for i, ids in enumerate(sample(asked)):
        text = decode(ids)
        turns = [{"role": "user", "content": text}]
        if len(ids) >= cfg.synthetic_max_tokens and ids[-1] not in eos:
            unfinished += 1
        elif not text:
            empty += 1
        elif (key := first_prompt_key(turns)) in seen:
            repeats += 1
        else:
            seen.add(key)
            out.append({"id": f"synthetic-{i}", "turns": turns})
    under = f" under {len(prefixes)} system prompts" if len(prefixes) > 1 else ""
    log(
        f"regenerate: {len(out)} of {cfg.synthetic_prompts} synthetic prompts{under} kept "
        f"in {time.perf_counter() - t0:.1f} s ({unfinished} not ended within "
        f"{cfg.synthetic_max_tokens} tokens, {empty} empty, {repeats} repeats)"
    )
    return out


def turn_ends(tokenizer) -> set[int]:
    """The tokens that end a turn: the tokenizer's end-of-sequence token and the verifier's
    generation_config's, where the tokenizer knows its folder."""
    path = Path(getattr(tokenizer, "name_or_path", "") or ".") / "generation_config.json"
    config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    return eos_ids(tokenizer.eos_token_id, config.get("eos_token_id"))


def synthesizer(make_sampler, tokenizer, cfg: RegenerateConfig, log=print):
    """The synthetic-prompt step for ``regenerate`` (None when none are asked for);
    ``make_sampler(width)`` builds the sampling Generate (prompts of at most ``width``
    tokens) when the step runs."""
    if not cfg.synthetic_prompts:
        return None
    # a template that renders no user text (or not a system turn as given) fails before any work
    prefixes = [user_turn_prefix(tokenizer, s) for s in cfg.synthetic_system_prompts or [None]]

    def synthesize() -> list[dict[str, Any]]:
        sample = make_sampler(max(map(len, prefixes)))
        decode = lambda ids: answer_text(tokenizer, ids)  # noqa: E731
        return synthetic_conversations(sample, prefixes, cfg, decode, turn_ends(tokenizer), log)

    return synthesize


def interleave(conversations: list, synthetic: list) -> list:
    """``synthetic`` spread evenly among ``conversations``, each keeping its order, so that
    the last samples (which validation holds out) hold both kinds in proportion."""
    return spread([conversations, synthetic])


def synthetic_once(work_dir: Path, synthesize, log=print) -> list[dict[str, Any]]:
    """The synthetic conversations of this job: sampled once and kept in ``work_dir`` (an
    interrupted job resumes with the same ones, whose chunks may be finished already)."""
    path = work_dir / "synthetic.jsonl"
    if path.exists():
        records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
        log(f"regenerate: {len(records)} synthetic prompts of an earlier attempt reused")
        return records
    remove_stale_temps(path)
    records = synthesize()
    with atomic_path(path) as tmp:
        tmp.write_text(
            "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8"
        )
    return records


def wave_size(cfg: RegenerateConfig) -> int | None:
    """Turns per generate call: one HF batch (``batch_size``); a vLLM server batches
    continuously, so it gets every ready turn at once."""
    return cfg.batch_size if cfg.backend == "hf" else None


def chunks(items: list, size: int) -> Iterator[tuple[int, list]]:
    for i in range(0, len(items), size):
        yield i // size, items[i : i + size]


def regenerate(
    conversations: list[dict[str, Any]],
    generate: Generate,
    render,
    decode,
    cfg: RegenerateConfig,
    max_length: int,
    work_dir: Path,
    fingerprint: dict[str, Any],
    out_path: Path,
    log=print,
    worker: tuple[int, int] | None = None,
    synthesize: Callable[[], list[dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """Regenerate chunk by chunk into ``work_dir`` (resumable), then write ``out_path``.

    ``worker=(i, n)``: do chunks i, i + n, ... only and write no ``out_path`` (one of n
    data-parallel workers; a final call without ``worker`` finds every chunk done).
    ``synthesize``: synthetic one-turn conversations to add (``synthesizer``), interleaved.
    """
    fingerprinted_dir(work_dir, fingerprint)
    t0 = time.perf_counter()
    synthetic, read = 0, len(conversations)
    if synthesize is not None:
        records = synthetic_once(work_dir, synthesize, log)
        synthetic = len(records)
        conversations = interleave(conversations, records)
    n_chunks = (len(conversations) + cfg.chunk_size - 1) // cfg.chunk_size
    reused = 0
    for index, part in chunks(conversations, cfg.chunk_size):
        if worker is not None and index % worker[1] != worker[0]:
            continue
        path = work_dir / f"chunk-{index:05d}.jsonl"
        if path.exists():
            reused += 1
            log(f"regenerate: chunk {index + 1}/{n_chunks} already done")
            continue
        remove_stale_temps(path)  # what a killed writer of this chunk left
        t = time.perf_counter()
        records = regenerate_chunk(
            part, render, decode, generate, max_length, cfg.max_turns, wave_size(cfg),
            progress=lambda line, index=index: log(f"regenerate: chunk {index + 1}/{n_chunks}, {line}"),
        )  # fmt: skip
        with atomic_path(path) as tmp:
            tmp.write_text(
                "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8"
            )
        log(
            f"regenerate: chunk {index + 1}/{n_chunks} ({len(part)} conversations) in {time.perf_counter() - t:.1f} s"
        )
    if worker is not None:
        return {"chunks_reused": reused, "seconds": round(time.perf_counter() - t0, 2)}
    written = 0
    with atomic_path(out_path) as tmp, open(tmp, "w", encoding="utf-8") as fh:
        for index in range(n_chunks):
            text = (work_dir / f"chunk-{index:05d}.jsonl").read_text(encoding="utf-8")
            fh.write(text)
            written += text.count("\n")
    return {
        "conversations_in": read,
        "synthetic_conversations": synthetic,
        "conversations_out": written,
        "chunks": n_chunks,
        "chunks_reused": reused,
        "seconds": round(time.perf_counter() - t0, 2),
    }


def worker_devices(visible: str | None, workers: int) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES of each data-parallel worker: the leased devices split evenly
    (None everywhere when the job leased none, on a CPU)."""
    devices = [d for d in (visible or "").split(",") if d.strip()]
    if not devices:
        return [None] * workers
    if len(devices) % workers:
        raise UserError(
            f"config key regenerate.workers: {workers} workers cannot share {len(devices)} "
            "GPU(s) evenly; make regenerate.gpus a multiple of regenerate.workers"
        )
    size = len(devices) // workers
    return [",".join(devices[i * size : (i + 1) * size]) for i in range(workers)]


def run_workers(argv: list[str], visible: str | None, workers: int, log=print) -> None:
    """Start ``workers`` copies of this command (``--worker i/n``), each on its share of the
    leased GPUs, and wait for all; the first failure stops the others."""
    import os
    import subprocess

    procs = []
    failed = None
    try:
        for i, devices in enumerate(worker_devices(visible, workers)):
            env = dict(os.environ)
            if devices is not None:
                env["CUDA_VISIBLE_DEVICES"] = devices
            procs.append(subprocess.Popen([*argv, "--worker", f"{i}/{workers}"], env=env))
            log(f"regenerate: worker {i + 1}/{workers} started (GPUs: {devices or 'none'})")
        while procs and failed is None:
            for proc in list(procs):
                if proc.poll() is not None:
                    procs.remove(proc)
                    if proc.returncode:
                        failed = proc.returncode
            time.sleep(0.2)
    finally:  # a failed worker, or this process stopped: no worker outlives it
        with signals_deferred():
            for proc in procs:
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    if failed is not None:
        raise UserError(f"regenerate: a worker failed (exit status {failed}); its log is above")


def log_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
