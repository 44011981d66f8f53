"""Verifier hidden states -> shard files, exactly as vLLM's extract_hidden_states gives them.

Layer id k is the residual stream entering decoder layer k (HF ``output_hidden_states[k]``);
the last slot of every token is the output of the final decoder layer *before* the final norm
(HF's last ``output_hidden_states`` entry is after the norm, which would corrupt the targets).

Batches (sorted by length, right-padded) are computed in the shard's ``order`` and their states
stored in that same order, so ``ShardWriter`` writes the file front to back while the next
batch computes. ``Capture`` (the hooks that keep those states) is also what evaluation uses.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle3lib.config import forward_dtype, resolve_aux_layers
from eagle3lib.errors import UserError
from eagle3lib.lifetime import Phases
from eagle3lib.shard_writer import ShardWriter
from eagle3lib.shards import SHARD_FORMAT, STORAGE_DTYPES, ShardLayout, input_hash


class Capture:
    """Hooks that keep the residual stream entering ``aux`` layers and the last layer's output."""

    def __init__(self, layers: torch.nn.ModuleList, aux: Sequence[int]):
        self.aux = list(aux)
        self.states: dict[Any, torch.Tensor] = {}
        self._handles = []
        for k in self.aux:
            self._handles.append(
                layers[k].register_forward_pre_hook(self._pre_hook(k), with_kwargs=True)
            )
        self._handles.append(layers[len(layers) - 1].register_forward_hook(self._last_hook))

    def _pre_hook(self, k):
        def hook(_module, args, kwargs):
            self.states[k] = args[0] if args else kwargs["hidden_states"]

        return hook

    def _last_hook(self, _module, _args, output):
        self.states["last"] = output[0] if isinstance(output, tuple) else output

    def stacked(self, device: torch.device | None = None) -> torch.Tensor:
        """[batch, seq, len(aux)+1, hidden] on ``device`` (default: where the first captured
        layer ran; layers may sit on several GPUs with device_map). References are dropped."""
        parts = [self.states[k] for k in self.aux] + [self.states["last"]]
        device = device or parts[0].device
        out = torch.stack([p.to(device, non_blocking=True) for p in parts], dim=2)
        self.states.clear()
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def length_batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Indices grouped by length (longest first) so that batch * max_len <= batch_tokens."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        width = lengths[current[0]] if current else lengths[i]
        if current and (len(current) + 1) * width > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


@torch.inference_mode()
def forward_batch(
    decoder, capture: Capture, samples: Sequence[np.ndarray], device: torch.device
) -> tuple[torch.Tensor, list[int]]:
    """Right-padded [B, T, len(aux)+1, hidden] states of one batch, and the true lengths.

    No attention mask: the padding is on the right and attention is causal, so no real token
    ever attends to a pad, and the positions of real tokens are 0..n-1 as in a one-sample
    forward. Without a mask the attention runs as plain causal attention (flash kernels on a
    GPU) instead of a masked kernel; the states are equal (tests compare batched states with
    one-sample forwards)."""
    lengths = [len(s) for s in samples]
    width = max(lengths)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    for b, s in enumerate(samples):
        ids[b, : len(s)] = torch.as_tensor(s, dtype=torch.long)
    ids = ids.pin_memory() if device.type == "cuda" else ids
    decoder(input_ids=ids.to(device, non_blocking=True), use_cache=False)
    return capture.stacked(device), lengths  # on the input device, where the writer's stream is


def forward_states(
    decoder, capture: Capture, samples: Sequence[np.ndarray], device: torch.device
) -> list[torch.Tensor]:
    """Per-sample [len, len(aux)+1, hidden] states of one right-padded batch."""
    states, lengths = forward_batch(decoder, capture, samples, device)
    return [states[b, :n] for b, n in enumerate(lengths)]


def iter_progress(items: Sequence, total_tokens: int, log_every: float = 10.0) -> Iterator:
    """Yield items, printing tokens/s progress to stderr at most every ``log_every`` seconds."""
    done, t0, last = 0, time.perf_counter(), 0.0
    for item, tokens in items:
        yield item
        done += tokens
        now = time.perf_counter() - t0
        if now - last >= log_every or done == total_tokens:
            last = now
            rate = done / now if now > 0 else 0.0
            print(
                f"extract: {done}/{total_tokens} tokens ({100 * done / max(total_tokens, 1):.0f}%)"
                f" {rate:.0f} tok/s",
                file=sys.stderr,
                flush=True,
            )


# ---- one extraction job ----------------------------------------------------------------------


def resolve_dtype(name: str, device: torch.device, key: str = "dtype") -> torch.dtype:
    """Compute dtype for config value ``name`` of config key ``key``: auto is bf16 on GPU and
    fp32 on CPU; bf16 is refused on a CPU without native bf16 (precision.bf16_is_slow)."""
    from eagle3lib.precision import bf16_is_slow

    name = forward_dtype(name, device.type == "cuda")
    if name == "bfloat16" and bf16_is_slow(device):
        raise UserError(
            f"config key {key}: bfloat16 on this CPU, which has no native bf16 (it would run "
            "several times slower than float32); use auto or float32"
        )
    return getattr(torch, name)


def input_device(model) -> torch.device:
    """Where the input ids go: the embedding's device (models spread with device_map too)."""
    return model.get_input_embeddings().weight.device


def warm_compiled(decoder, capture: Capture, samples, device) -> None:
    """Compile on a slice of the shard (two samples, at most 32 tokens); a failure stops the
    job naming extract.compile."""
    try:
        forward_batch(decoder, capture, [s[:32] for s in samples[:2]], device)
    except Exception as exc:  # dynamo, inductor or a missing compiler: many exception types
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise UserError(
            f"extract.compile: torch.compile failed on this verifier ({reason}); "
            "set extract.compile: false"
        ) from None


def _compile_for_job(stack, model, decoder, capture, samples, device, wanted: bool) -> dict:
    """Enter compiled_layers on ``stack`` (extract.compile: true) and compile."""
    from eagle3lib.verifier import compiled_layers

    if not wanted:
        return {"compiled": False, "compile_seconds": 0.0}
    t0 = time.perf_counter()
    stack.enter_context(compiled_layers(model))
    warm_compiled(decoder, capture, samples, device)
    return {"compiled": True, "compile_seconds": round(time.perf_counter() - t0, 2)}


def extract_samples(
    model,
    samples: Sequence[np.ndarray],
    masks: Sequence[np.ndarray],
    aux: Sequence[int],
    cfg,
    shard_path: Path,
    metadata: dict[str, str],
    phases: Phases | None = None,
    turn=None,
) -> dict[str, Any]:
    """Forward ``samples`` through ``model`` in length-sorted batches and write one shard.
    ``turn``: a context manager factory (eagle3lib.gpu.turn) held from after compiling and
    the shard writer's set-up until the last states have left the GPU: a job sharing its GPU
    compiles while the other one extracts, and the other one extracts while this one's last
    writes, fsync and hash finish."""
    from eagle3lib.verifier import decoder_layers, text_config, text_decoder

    device = input_device(model)
    lengths = tuple(len(s) for s in samples)
    batches = length_batches(lengths, cfg.batch_tokens)
    order = tuple(i for batch in batches for i in batch)  # states are stored as computed
    hidden = text_config(model.config).hidden_size
    layout = ShardLayout(lengths, len(aux) + 1, hidden, order, cfg.storage)
    padded = sum(len(b) * lengths[b[0]] for b in batches) - layout.tokens
    decoder = text_decoder(model)  # the language model alone: no vision tower, no LM head
    capture = Capture(decoder_layers(model), aux)
    with contextlib.ExitStack() as stack:
        stack.callback(capture.remove)
        compiling = _compile_for_job(stack, model, decoder, capture, samples, device, cfg.compile)
        if phases and compiling["compiled"]:
            phases.mark("layers compiled")
        writer = ShardWriter(
            shard_path,
            layout,
            metadata,
            device=device,
            max_batch_rows=max(len(b) * lengths[b[0]] for b in batches),
        )
        if phases:
            phases.mark("shard writer ready")
        try:
            with contextlib.ExitStack() as gpu_turn:
                waited = gpu_turn.enter_context(turn()) if turn else 0.0
                turn_span = [time.time()]
                if phases and turn:
                    phases.mark("GPU turn")
                t0 = time.perf_counter()
                work = [(batch, sum(lengths[i] for i in batch)) for batch in batches]
                for batch in iter_progress(work, layout.tokens):
                    states, _ = forward_batch(decoder, capture, [samples[i] for i in batch], device)
                    writer.put_batch(batch, states, [lengths[i] for i in batch])
                writer.device_done()
                turn_span.append(time.time())  # stamped before the turn, if any, is given back
            sha256 = writer.close(np.concatenate(samples), np.concatenate(masks))
        except BaseException:
            writer.abort()
            raise
    stats = writer_stats(writer, time.perf_counter() - t0, padded, sha256)
    timing = {"turn_wait_seconds": round(waited, 2)}
    if turn:
        timing["turn_span"] = [round(t, 3) for t in turn_span]
    return {**stats, **compiling, **timing}


def writer_stats(writer: ShardWriter, seconds: float, padded: int, sha256: str) -> dict[str, Any]:
    tokens = writer.layout.tokens
    return {
        "tokens": tokens,
        "padded_tokens": padded,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds else 0.0,
        "write_seconds": writer.write_seconds,
        "hash_seconds": writer.hash_seconds,
        "stall_seconds": writer.stall_seconds,
        "valid": writer.valid,
        "sha256": sha256,
    }


def check_against_single_forward(
    model, aux: Sequence[int], samples: Sequence[np.ndarray]
) -> dict[str, float]:
    """Batched capture vs a one-sample HF forward (``output_hidden_states``): the largest
    absolute difference and the relative L2 error over all aux slots of all samples."""
    from eagle3lib.verifier import decoder_layers, text_decoder

    device = input_device(model)
    capture = Capture(decoder_layers(model), aux)
    try:
        batched = forward_states(text_decoder(model), capture, list(samples), device)
    finally:
        capture.remove()
    worst = 0.0
    err = dict.fromkeys(aux, 0.0)
    norm = dict.fromkeys(aux, 0.0)
    with torch.inference_mode():
        for s, states in zip(samples, batched, strict=True):
            ref = model(
                torch.as_tensor(s)[None].to(device), output_hidden_states=True
            ).hidden_states
            for slot, k in enumerate(aux):
                a = states[:, slot].double()
                b = ref[k][0].to(states.device).double()
                worst = max(worst, float((a - b).abs().max()))
                err[k] += float(((a - b) ** 2).sum())
                norm[k] += float((b**2).sum())
    rel = {k: (err[k] / norm[k]) ** 0.5 if norm[k] else 0.0 for k in aux}
    return {
        "max_abs": worst,
        "rel_l2": (sum(err.values()) / max(sum(norm.values()), 1e-30)) ** 0.5,
        "rel_l2_per_layer": {str(k): round(v, 6) for k, v in rel.items()},
    }


def _shard_spec(record: dict[str, Any], layer_ids: list[int], dtype: torch.dtype, cfg) -> dict:
    """What a shard's states depend on besides its tokens (recorded in its manifest)."""
    from eagle3lib.verifier import identity

    return {
        "verifier": identity(record),
        "layer_ids": layer_ids,
        "hidden_size": record["hidden_size"],
        "compute_dtype": str(dtype).removeprefix("torch."),
        "state_dtype": STORAGE_DTYPES[cfg.storage],
        "backend": cfg.backend,
    }


def _manifest(
    shard: int, cfg, sample_range: tuple[int, int], sample_ids, lengths, stats, spec, digest, path
) -> dict[str, Any]:
    """The shard's manifest: what made it, which samples (and which were rejected), and the
    file's size and sha256 (computed while it was written). Takes "valid" and "sha256" out of
    ``stats``."""
    start, stop = sample_range
    rejected = [
        {"id": sample_ids[start + i], "reason": "non-finite hidden states"}
        for i in np.flatnonzero(stats.pop("valid") == 0).tolist()
    ]
    return {
        "format": SHARD_FORMAT,
        "shard": shard,
        "shards": cfg.shards,
        "sample_range": [start, stop],
        "sample_ids": list(sample_ids[start:stop]),
        "token_counts": lengths,
        "tokens": stats["tokens"],
        "rejected": rejected,
        "input_hash": digest,
        **spec,
        "compiled": stats.get("compiled", False),  # decoder layers under torch.compile
        "file": {"name": path.name, "bytes": path.stat().st_size, "sha256": stats.pop("sha256")},
    }


def _extract_with_hf(record, dtype, ids, masks, aux, cfg, shard_path, metadata, phases) -> dict:
    """Load the verifier in ``dtype`` and write the shard from its forward passes. A job that
    shares its GPUs (extract.jobs_per_gpu) loads (and compiles) while another extracts, then
    waits for its turn at them (eagle3lib.gpu.turn)."""
    from eagle3lib.gpu import TURN_ENV, turn
    from eagle3lib.verifier import device_map_for_job, load_model

    # several leased GPUs: the layers are spread over them (a verifier bigger than one)
    t0 = time.perf_counter()
    model = load_model(record, dtype, device_map=device_map_for_job())
    load_seconds = time.perf_counter() - t0
    phases.mark("verifier loaded")
    sharing = turn if os.environ.get(TURN_ENV) else None
    stats = extract_samples(model, ids, masks, aux, cfg, shard_path, metadata, phases, sharing)
    stats["model_load_seconds"] = load_seconds
    return stats


def _shard_samples(samples, shard: int, cfg) -> tuple[int, int]:
    """The sample range of shard ``shard``; an empty one is a config error."""
    from eagle3lib.data import shard_range

    start, stop = shard_range(len(samples), shard, cfg.shards)
    if stop <= start:
        raise UserError(
            f"config key extract.shards: {cfg.shards} shards for {len(samples)} samples leaves "
            f"shard {shard} empty; use at most {len(samples)} shards"
        )
    return start, stop


def extract_shard(
    samples,
    sample_ids: Sequence[str],
    shard: int,
    cfg,
    record: dict[str, Any],
    shard_path: Path,
    manifest_path: Path,
    engine: dict[str, Any] | None = None,
    vllm_python: str | None = None,
) -> dict[str, Any]:
    """Run the verifier over shard ``shard``'s samples and write the shard and its manifest.

    ``extract.backend`` hf runs the HF forward here; vllm asks a vLLM server started with
    ``vllm_python`` (and the config's ``vllm`` section as ``engine``)."""
    from eagle3lib.fileio import remove_stale_temps, write_json

    phases = Phases("extract")
    phases.mark("started")
    for output in (shard_path, manifest_path):
        remove_stale_temps(output)  # a killed earlier attempt's half-written shard
    start, stop = _shard_samples(samples, shard, cfg)
    cuda = torch.cuda.is_available()
    dtype = resolve_dtype(cfg.dtype, torch.device("cuda" if cuda else "cpu"), "extract.dtype")
    num_layers = record["num_hidden_layers"]
    aux = resolve_aux_layers(cfg.aux_layers, num_layers)
    layer_ids = [*aux, num_layers]

    tokens = [samples.sample(i) for i in range(start, stop)]
    ids = [t[0] for t in tokens]
    masks = [t[1] for t in tokens]
    lengths = [len(t) for t in ids]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    spec = _shard_spec(record, layer_ids, dtype, cfg)
    digest = input_hash(np.concatenate(ids), np.concatenate(masks), offsets, spec)

    metadata = {"format": SHARD_FORMAT, "input_hash": digest}
    if cfg.backend == "vllm":
        from eagle3lib.vllm_extraction import extract_with_vllm

        stats = extract_with_vllm(
            ids, masks, record, layer_ids, dtype, cfg, shard_path, metadata, engine, vllm_python
        )
    else:
        stats = _extract_with_hf(record, dtype, ids, masks, aux, cfg, shard_path, metadata, phases)
    phases.mark("shard written")
    manifest = _manifest(
        shard, cfg, (start, stop), sample_ids, lengths, stats, spec, digest, shard_path
    )
    write_json(manifest_path, manifest)
    phases.mark("manifest written")
    stats["phases"] = phases.marks
    stats["rejected"] = len(manifest["rejected"])
    stats["write_gb_per_s"] = (
        manifest["file"]["bytes"] / stats["write_seconds"] / 1e9 if stats["write_seconds"] else None
    )
    return stats
