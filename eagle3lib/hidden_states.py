"""Verifier hidden states -> shard files, exactly as vLLM's extract_hidden_states gives them.

Layer id k is the residual stream entering decoder layer k (HF ``output_hidden_states[k]``);
the last slot of every token is the output of the final decoder layer *before* the final norm
(HF's last ``output_hidden_states`` entry is after the norm, which would corrupt the targets).

A shard is one safetensors file whose layout is fixed before the forward passes start, so
batches (sorted by length, right-padded) are written in place at their final offsets by a
background thread while the next batch computes:

    hidden_states [tokens, len(aux)+1, hidden] bf16   (aux layers in config order, then final)
    input_ids     [tokens] int32
    loss_mask     [tokens] uint8
    offsets       [samples+1] int64                    sample i = rows offsets[i]:offsets[i+1]
    valid         [samples] uint8                      0 = rejected (non-finite states)

The file is written under a temporary name and renamed when complete; ``shard-<i>.json`` (the
manifest) records what made it and the file's size and sha256.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle3lib.errors import UserError
from eagle3lib.fileio import atomic_path, sha256_bytes, sha256_file, sha256_json

SHARD_FORMAT = "eagle3lib.shard/1"
STATE_DTYPE = torch.bfloat16


def default_aux_layers(num_layers: int) -> list[int]:
    """speculators' default auxiliary layers."""
    return [2, num_layers // 2, num_layers - 3]


def resolve_aux_layers(aux_layers: Sequence[int] | None, num_layers: int) -> list[int]:
    """Validate the aux layer ids (distinct, in [0, L-1]); None picks speculators' default."""
    if aux_layers is None:
        ids = default_aux_layers(num_layers)
        if len(set(ids)) != len(ids) or min(ids) < 0:
            raise UserError(
                f"config key extract.aux_layers: the default {ids} is invalid for a verifier with "
                f"{num_layers} layers; set extract.aux_layers to distinct ids in [0, {num_layers - 1}]"
            )
        return ids
    ids = [int(k) for k in aux_layers]
    if not ids:
        raise UserError("config key extract.aux_layers: give at least one layer id (or null)")
    if len(set(ids)) != len(ids):
        raise UserError(f"config key extract.aux_layers: duplicate layer ids in {ids}")
    bad = [k for k in ids if not 0 <= k < num_layers]
    if bad:
        raise UserError(
            f"config key extract.aux_layers: layer id(s) {bad} out of range [0, {num_layers - 1}] "
            f"for a verifier with {num_layers} layers (the final layer is always added)"
        )
    return ids


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

    def stacked(self) -> torch.Tensor:
        """[batch, seq, len(aux)+1, hidden]; the stored references are dropped."""
        out = torch.stack([self.states[k] for k in self.aux] + [self.states["last"]], dim=2)
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
def forward_states(
    decoder, capture: Capture, samples: Sequence[np.ndarray], device: torch.device
) -> list[torch.Tensor]:
    """Per-sample [len, len(aux)+1, hidden] states of one right-padded batch."""
    lengths = [len(s) for s in samples]
    width = max(lengths)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    mask = torch.zeros(len(samples), width, dtype=torch.long)
    for b, s in enumerate(samples):
        ids[b, : len(s)] = torch.as_tensor(s, dtype=torch.long)
        mask[b, : len(s)] = 1
    decoder(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
    states = capture.stacked()
    return [states[b, :n] for b, n in enumerate(lengths)]


# ---- shard file layout ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    lengths: tuple[int, ...]
    n_layers: int
    hidden: int

    @property
    def tokens(self) -> int:
        return int(sum(self.lengths))

    @property
    def row_bytes(self) -> int:
        return self.n_layers * self.hidden * 2

    def tensors(self) -> list[tuple[str, str, list[int], int]]:
        n, t = len(self.lengths), self.tokens
        return [
            ("hidden_states", "BF16", [t, self.n_layers, self.hidden], t * self.row_bytes),
            ("input_ids", "I32", [t], 4 * t),
            ("loss_mask", "U8", [t], t),
            ("offsets", "I64", [n + 1], 8 * (n + 1)),
            ("valid", "U8", [n], n),
        ]

    def header(self, metadata: dict[str, str]) -> bytes:
        entries: dict[str, Any] = {"__metadata__": metadata}
        pos = 0
        for name, dtype, shape, nbytes in self.tensors():
            entries[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + nbytes]}
            pos += nbytes
        raw = json.dumps(entries, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        return struct.pack("<Q", len(raw)) + raw

    def data_bytes(self) -> int:
        return sum(nbytes for *_, nbytes in self.tensors())


class ShardWriter:
    """Writes one shard in place: states land at their final offsets from a background thread."""

    def __init__(
        self, path: Path, layout: ShardLayout, metadata: dict[str, str], queue_size: int = 4
    ):
        self.path = path
        self.layout = layout
        self.offsets = np.concatenate([[0], np.cumsum(layout.lengths)]).astype(np.int64)
        self.valid = np.ones(len(layout.lengths), dtype=np.uint8)
        self._atomic = atomic_path(path)
        self.tmp = self._atomic.__enter__()
        header = layout.header(metadata)
        self.data_start = len(header)
        self.fd = os.open(self.tmp, os.O_WRONLY)
        os.ftruncate(self.fd, self.data_start + layout.data_bytes())
        os.pwrite(self.fd, header, 0)
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._error: BaseException | None = None
        self.bytes_written = 0
        self.write_seconds = 0.0
        self._thread = threading.Thread(target=self._run, name="shard-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            if self._error is not None:
                continue
            try:
                pos, payload = item
                t0 = time.perf_counter()
                os.pwrite(self.fd, payload, self.data_start + pos)
                self.write_seconds += time.perf_counter() - t0
                self.bytes_written += len(payload)
            except BaseException as exc:  # surfaced in put()/close()
                self._error = exc

    def _raise_pending(self) -> None:
        if self._error is not None:
            raise self._error

    def put_states(self, sample: int, states: torch.Tensor) -> None:
        """Queue one sample's [len, layers, hidden] states (any device, any float dtype)."""
        self._raise_pending()
        if not bool(torch.isfinite(states).all()):
            self.valid[sample] = 0
            return
        host = states.to(device="cpu", dtype=STATE_DTYPE).contiguous()
        payload = host.view(torch.uint8).numpy().tobytes()
        self._queue.put((int(self.offsets[sample]) * self.layout.row_bytes, payload))

    def close(self, input_ids: np.ndarray, loss_mask: np.ndarray) -> None:
        """Write the token tensors and the valid flags, sync and rename into place."""
        self._queue.put(None)
        self._thread.join()
        try:
            self._raise_pending()
            pos = self.layout.tokens * self.layout.row_bytes
            for array in (
                input_ids.astype(np.int32),
                loss_mask.astype(np.uint8),
                self.offsets,
                self.valid,
            ):
                data = np.ascontiguousarray(array).tobytes()
                os.pwrite(self.fd, data, self.data_start + pos)
                pos += len(data)
            os.fsync(self.fd)
            os.close(self.fd)
            self.fd = -1
        except BaseException as exc:
            self.abort()
            raise exc
        self._atomic.__exit__(None, None, None)

    def abort(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            raise RuntimeError("shard aborted")
        except RuntimeError as exc:
            self._atomic.__exit__(type(exc), exc, exc.__traceback__)


# ---- reading and checking shards -----------------------------------------------------------


@dataclasses.dataclass
class Shard:
    """A shard opened memory-mapped; nothing is read until a sample is sliced."""

    path: Path
    hidden_states: torch.Tensor  # [tokens, layers, hidden] bf16, mmap-backed
    input_ids: np.ndarray
    loss_mask: np.ndarray
    offsets: np.ndarray
    valid: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def sample(self, i: int) -> dict[str, Any]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return {
            "hidden_states": self.hidden_states[a:b],
            "input_ids": torch.from_numpy(self.input_ids[a:b].astype(np.int64)),
            "loss_mask": torch.from_numpy(self.loss_mask[a:b].astype(bool)),
        }


def read_header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise UserError(f"{path}: truncated shard (no header); delete it and rerun")
        (n,) = struct.unpack("<Q", head)
        raw = fh.read(n)
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"{path}: corrupt shard header; delete it and rerun") from None


def open_shard(path: Path) -> Shard:
    header = read_header(path)
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
    start = 8 + n
    size = path.stat().st_size
    end = max(meta["data_offsets"][1] for k, meta in header.items() if k != "__metadata__")
    if size != start + end:
        raise UserError(
            f"{path}: shard is {size} bytes but its header describes {start + end}; "
            "it is truncated or corrupt: delete it and rerun"
        )
    mm = np.memmap(path, dtype=np.uint8, mode="c")  # copy-on-write: torch wants writable

    def view(name: str, dtype) -> np.ndarray:
        a, b = header[name]["data_offsets"]
        return mm[start + a : start + b].view(dtype).reshape(header[name]["shape"])

    hs = view("hidden_states", np.uint16)
    hidden_states = torch.from_numpy(hs).view(torch.bfloat16)
    return Shard(
        path=path,
        hidden_states=hidden_states,
        input_ids=view("input_ids", np.int32),
        loss_mask=view("loss_mask", np.uint8),
        offsets=view("offsets", np.int64),
        valid=view("valid", np.uint8),
    )


def check_shard(shard_path: Path, manifest: dict[str, Any], *, full_hash: bool = True) -> None:
    """The shard is the one its manifest describes (size, sha256); raise UserError if not."""
    if not shard_path.exists():
        raise UserError(f"{shard_path}: missing shard; rerun the workflow to rebuild it")
    f = manifest["file"]
    size = shard_path.stat().st_size
    if size != f["bytes"]:
        raise UserError(
            f"{shard_path}: {size} bytes, manifest says {f['bytes']}: truncated or replaced; "
            "delete it and its manifest and rerun"
        )
    if full_hash and sha256_file(shard_path) != f["sha256"]:
        raise UserError(
            f"{shard_path}: content does not match the sha256 in its manifest (corrupt); "
            "delete it and its manifest and rerun"
        )


def check_manifest(manifest: dict[str, Any], expect: dict[str, Any], where: str) -> None:
    """Fail if a shard was made for another verifier, layer set or hidden size."""
    for key in ("verifier", "layer_ids", "hidden_size"):
        if key in expect and manifest.get(key) != expect[key]:
            raise UserError(
                f"{where}: shard was extracted with {key}={manifest.get(key)!r}, the config "
                f"expects {expect[key]!r}; delete results for this run's hidden states and rerun"
            )


def input_hash(
    input_ids: np.ndarray, loss_mask: np.ndarray, offsets: np.ndarray, spec: dict[str, Any]
) -> str:
    """Hash of everything that determines a shard's bytes."""
    tokens = sha256_bytes(
        np.ascontiguousarray(input_ids, dtype=np.int32).tobytes()
        + np.ascontiguousarray(loss_mask, dtype=np.uint8).tobytes()
        + np.ascontiguousarray(offsets, dtype=np.int64).tobytes()
    )
    return sha256_json({"tokens": tokens, **spec})


def iter_progress(items: Sequence, total_tokens: int, log_every: float = 10.0) -> Iterator:
    """Yield items, printing tokens/s progress to stderr at most every ``log_every`` seconds."""
    import sys

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


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def extract_shard(
    samples,
    sample_ids: Sequence[str],
    shard: int,
    cfg,
    record: dict[str, Any],
    shard_path: Path,
    manifest_path: Path,
) -> dict[str, Any]:
    """Run the verifier over shard ``shard``'s samples and write the shard and its manifest."""
    from eagle3lib.data import shard_range
    from eagle3lib.verifier import decoder_layers, identity, load_model, text_config

    start, stop = shard_range(len(samples), shard, cfg.shards)
    if stop <= start:
        raise UserError(
            f"config key extract.shards: {cfg.shards} shards for {len(samples)} samples leaves "
            f"shard {shard} empty; use at most {len(samples)} shards"
        )
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    dtype = resolve_dtype(cfg.dtype, device)
    num_layers = record["num_hidden_layers"]
    aux = resolve_aux_layers(cfg.aux_layers, num_layers)
    layer_ids = [*aux, num_layers]

    tokens = [samples.sample(i) for i in range(start, stop)]
    lengths = tuple(len(t[0]) for t in tokens)
    input_ids = np.concatenate([t[0] for t in tokens])
    loss_mask = np.concatenate([t[1] for t in tokens])
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    spec = {
        "verifier": identity(record),
        "layer_ids": layer_ids,
        "hidden_size": record["hidden_size"],
        "compute_dtype": str(dtype).removeprefix("torch."),
        "state_dtype": "bfloat16",
    }
    digest = input_hash(input_ids, loss_mask, offsets, spec)

    model = load_model(
        record, dtype, device_map={"": device.index or 0} if device.type == "cuda" else None
    )
    decoder = model.get_decoder()
    capture = Capture(decoder_layers(model), aux)
    layout = ShardLayout(lengths, len(layer_ids), text_config(model.config).hidden_size)
    writer = ShardWriter(shard_path, layout, {"format": SHARD_FORMAT, "input_hash": digest})
    batches = length_batches(lengths, cfg.batch_tokens)
    t0 = time.perf_counter()
    try:
        work = [(batch, sum(lengths[i] for i in batch)) for batch in batches]
        for batch in iter_progress(work, layout.tokens):
            states = forward_states(decoder, capture, [tokens[i][0] for i in batch], device)
            for i, s in zip(batch, states, strict=True):
                writer.put_states(i, s)
        writer.close(input_ids, loss_mask)
    except BaseException:
        writer.abort()
        raise
    finally:
        capture.remove()
    seconds = time.perf_counter() - t0

    rejected = [
        {"id": sample_ids[start + i], "reason": "non-finite hidden states"}
        for i in np.flatnonzero(writer.valid == 0).tolist()
    ]
    manifest = {
        "format": SHARD_FORMAT,
        "shard": shard,
        "shards": cfg.shards,
        "sample_range": [start, stop],
        "sample_ids": list(sample_ids[start:stop]),
        "token_counts": list(lengths),
        "tokens": layout.tokens,
        "rejected": rejected,
        "input_hash": digest,
        **spec,
        "file": {
            "name": shard_path.name,
            "bytes": shard_path.stat().st_size,
            "sha256": sha256_file(shard_path),
        },
    }
    from eagle3lib.fileio import write_json

    write_json(manifest_path, manifest)
    return {
        "tokens": layout.tokens,
        "seconds": seconds,
        "tokens_per_s": layout.tokens / seconds if seconds else 0.0,
        "write_gb_per_s": writer.bytes_written / writer.write_seconds / 1e9
        if writer.write_seconds
        else None,
        "rejected": len(rejected),
    }
