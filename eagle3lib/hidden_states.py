"""Verifier hidden states -> shard files, exactly as vLLM's extract_hidden_states gives them.

Layer id k is the residual stream entering decoder layer k (HF ``output_hidden_states[k]``);
the last slot of every token is the output of the final decoder layer *before* the final norm
(HF's last ``output_hidden_states`` entry is after the norm, which would corrupt the targets).

A shard is one safetensors file whose layout is fixed before the forward passes start. Batches
(sorted by length, right-padded) are computed in ``order``, and their states are stored in that
same order, so the file is written front to back by a background thread while the next batch
computes, and its sha256 is computed on the way (no read-back):

    hidden_states [tokens, len(aux)+1, hidden] bf16   (aux layers in config order, then final;
                                                        rows in processing order)
    input_ids     [tokens] int32                       (sample order)
    loss_mask     [tokens] uint8                       (sample order)
    offsets       [samples+1] int64                    sample i's tokens = offsets[i]:offsets[i+1]
    row_starts    [samples] int64                      sample i's states start at this row
    valid         [samples] uint8                      0 = rejected (non-finite states)
    hidden_scales [tokens, len(aux)+1] float32         fp8 storage only (below)

With ``extract.storage: fp8`` the states are float8 e4m3 with one float32 scale per token and
layer slot: a row of the bf16 states divided by amax(|row|)/448 (448 is e4m3's largest value),
so every row uses e4m3's whole range; its states read back as values x scale. Half the bytes of
bf16. The scales are small (16 bytes a token at 4 slots) and written with the tail tensors.

The file is written under a temporary name and renamed when complete; ``shard-<i>.json`` (the
manifest) records what made it and the file's size and sha256. Shards of format 1 (states in
sample order, no ``row_starts``) are still read.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import queue
import struct
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle3lib.config import default_aux_layers, resolve_aux_layers  # noqa: F401 - re-exported
from eagle3lib.errors import UserError
from eagle3lib.fileio import atomic_path, sha256_bytes, sha256_file, sha256_json
from eagle3lib.shards import SHARD_FORMAT, STORAGE_DTYPES, ShardLayout  # noqa: F401 - re-exported

STATE_DTYPE = torch.bfloat16
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value


def quantize_fp8(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, float32 scales) of ``states`` [..., hidden], one scale per row: what the
    bf16 shard would hold, divided by amax(|row|)/448. A zero row gets scale 1."""
    x = states.to(STATE_DTYPE).float()
    amax = x.abs().amax(-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (x / scale.unsqueeze(-1)).to(FP8), scale


def dequantize_fp8(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """States [..., hidden] in ``dtype`` from e4m3 values (or their bytes, uint8) and scales."""
    if values.dtype == torch.uint8:
        values = values.view(FP8)
    return (values.float() * scales.unsqueeze(-1)).to(dtype)


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


# ---- shard file layout ---------------------------------------------------------------------


class ShardWriter:
    """Writes one shard front to back from background threads, hashing it on the way.

    ``put_batch`` never waits for the disk or, on a GPU, for the device: states are cast to
    bf16 and checked for non-finite values on the device, copied into a pinned host buffer on a
    side stream, and the writer thread waits for that copy before writing. Samples must be put
    in ``layout.put_order``, so every write lands right after the previous one and a second
    thread feeds the same bytes, in file order, to sha256 (``close`` returns the digest; the
    file is never read back). A bounded pool of staging buffers gives back-pressure when the
    disk or the hash is the bottleneck. The writer syncs every ``sync_every`` bytes so dirty
    pages never pile up behind the final fsync.
    """

    def __init__(
        self,
        path: Path,
        layout: ShardLayout,
        metadata: dict[str, str],
        *,
        device: torch.device | None = None,
        max_batch_rows: int = 0,
        buffers: int = 6,
        sync_every: int = 8 << 30,
    ):
        self.path = path
        self.layout = layout
        self.offsets = np.concatenate([[0], np.cumsum(layout.lengths)]).astype(np.int64)
        self.row_starts = layout.row_starts()
        self.valid = np.ones(len(layout.lengths), dtype=np.uint8)
        self.sync_every = sync_every
        self._expected = iter(layout.put_order)
        self._atomic = atomic_path(path)
        self.tmp = self._atomic.__enter__()
        self.fd = -1
        header = layout.header(metadata)
        self.data_start = len(header)
        self._hash = hashlib.sha256(header)
        size = self.data_start + layout.data_bytes()
        try:
            self.fd = os.open(self.tmp, os.O_WRONLY)
            try:  # reserve the blocks now: a full disk fails here, not hours later
                os.posix_fallocate(self.fd, 0, size)
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise UserError(
                        f"{path}: cannot reserve {size:,} bytes for the shard ({exc.strerror}); "
                        "free disk space or write results elsewhere, then rerun"
                    ) from None
                os.ftruncate(self.fd, size)
            os.pwrite(self.fd, header, 0)
            self._setup_staging(device, max_batch_rows, buffers)
        except BaseException:
            if self.fd >= 0:
                os.close(self.fd)
            self._atomic.__exit__(*sys.exc_info())
            raise

    def _setup_staging(self, device, max_batch_rows: int, buffers: int) -> None:
        layout = self.layout
        self.cuda = device is not None and device.type == "cuda"
        self._free: queue.Queue = queue.Queue()
        if self.cuda:
            self._stream = torch.cuda.Stream(device)
            rows = max(max_batch_rows, max(layout.lengths, default=1))
            self._buffer_bytes = rows * layout.row_bytes
            self._buffers_left = buffers  # allocated when first needed, while the GPU computes
        self._queue: queue.Queue = queue.Queue(maxsize=buffers)
        self._hash_queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self.bytes_written = 0
        self.write_seconds = 0.0
        self.hash_seconds = 0.0
        self.stall_seconds = 0.0  # producer time spent waiting for a free staging buffer
        self._unsynced = 0
        self._row = 0  # the next state row to write
        # fp8: the scales of every row, in file order (written with the tail tensors)
        self.scales = np.ones((layout.tokens, layout.n_layers), np.float32) if layout.fp8 else None
        self._thread = threading.Thread(target=self._run, name="shard-writer", daemon=True)
        self._hasher = threading.Thread(target=self._run_hash, name="shard-hash", daemon=True)
        self._thread.start()
        self._hasher.start()

    def _run(self) -> None:
        """Write each batch's samples at the next rows of the file, then hand them to hashing."""
        while (item := self._queue.get()) is not None:
            event, host, scales, bad, samples, lengths, pinned = item
            parts = []
            try:
                if self._error is not None:
                    continue
                if event is not None:
                    event.synchronize()
                flags = bad.tolist()
                t0 = time.perf_counter()
                for b, (sample, n) in enumerate(zip(samples, lengths, strict=True)):
                    if flags[b]:
                        self.valid[sample] = 0  # its (non-finite) rows are stored, never read
                    rows = host[b, :n].view(torch.uint8).numpy()
                    pos = self.data_start + self._row * self.layout.row_bytes
                    os.pwrite(self.fd, rows, pos)
                    # Start writeback of these pages now (asynchronously) instead of letting
                    # dirty pages pile up for the final fsync; clean pages leave the cache.
                    os.posix_fadvise(self.fd, pos, rows.nbytes, os.POSIX_FADV_DONTNEED)
                    parts.append(rows)
                    if scales is not None:
                        self.scales[self._row : self._row + n] = scales[b, :n].numpy()
                    self._row += n
                    self.bytes_written += rows.nbytes
                    self._unsynced += rows.nbytes
                if self._unsynced >= self.sync_every:
                    os.fdatasync(self.fd)
                    self._unsynced = 0
                self.write_seconds += time.perf_counter() - t0
            except BaseException as exc:  # surfaced in put_batch()/close()
                self._error = exc
            finally:
                # the staging buffer goes back to the pool once its bytes are hashed
                self._hash_queue.put((parts, pinned))
        self._hash_queue.put(None)

    def _run_hash(self) -> None:
        """sha256 of the state rows in file order (hashlib releases the GIL on large data)."""
        while (item := self._hash_queue.get()) is not None:
            parts, pinned = item
            try:
                if self._error is None:
                    t0 = time.perf_counter()
                    for rows in parts:
                        self._hash.update(rows)
                    self.hash_seconds += time.perf_counter() - t0
            except BaseException as exc:
                self._error = exc
            finally:
                if pinned is not None:
                    self._free.put(pinned)

    def _raise_pending(self) -> None:
        if self._error is not None:
            raise self._error

    def _check_order(self, samples: Sequence[int]) -> None:
        for sample in samples:
            expected = next(self._expected, None)
            if sample != expected:
                raise ValueError(
                    f"ShardWriter: sample {sample} put where the layout expects {expected}"
                )

    def put_batch(
        self, samples: Sequence[int], states: torch.Tensor, lengths: Sequence[int]
    ) -> None:
        """Queue a right-padded batch [B, T, layers, hidden] (any device, any float dtype) of
        the next samples of ``layout.put_order``. fp8 storage is quantized here, on the
        states' device (the GPU), before the copy out."""
        self._raise_pending()
        self._check_order(samples)
        states = states.to(STATE_DTYPE)
        lens = torch.tensor(list(lengths), dtype=torch.long)
        if states.is_cuda:  # never a blocking copy on the producer's path
            lens = lens.pin_memory().to(states.device, non_blocking=True)
        real = torch.arange(states.shape[1], device=states.device)[None, :] < lens[:, None]
        bad = ((~torch.isfinite(states).flatten(2).all(-1)) & real).any(-1)  # [B]
        scales = None
        if self.layout.fp8:
            states, scales = quantize_fp8(states)
        if not self.cuda:
            item = (None, states.contiguous(), scales, bad, list(samples), list(lengths), None)
            self._queue.put(item)
            return
        t0 = time.perf_counter()
        try:
            pinned = self._free.get_nowait()
        except queue.Empty:
            if self._buffers_left:
                self._buffers_left -= 1
                pinned = torch.empty(self._buffer_bytes, dtype=torch.uint8, pin_memory=True)
            else:
                pinned = self._free.get()  # waits while the disk (or the hash) is behind
        self.stall_seconds += time.perf_counter() - t0
        nbytes = states.numel() * states.element_size()
        host = pinned[:nbytes].view(states.dtype).view(states.shape)
        bad_host = torch.empty(bad.shape, dtype=torch.bool, pin_memory=True)
        scales_host = None
        if scales is not None:
            scales_host = torch.empty(scales.shape, dtype=scales.dtype, pin_memory=True)
        compute = torch.cuda.current_stream(states.device)
        self._stream.wait_stream(compute)
        with torch.cuda.stream(self._stream):
            host.copy_(states, non_blocking=True)
            bad_host.copy_(bad, non_blocking=True)
            if scales is not None:
                scales_host.copy_(scales, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        for tensor in (states, bad, scales):
            if tensor is not None:
                tensor.record_stream(self._stream)
        self._queue.put((event, host, scales_host, bad_host, list(samples), list(lengths), pinned))

    def put_states(self, sample: int, states: torch.Tensor) -> None:
        """Queue one sample's [len, layers, hidden] states."""
        self.put_batch([sample], states[None], [states.shape[0]])

    def _join(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self._hasher.join()

    def close(self, input_ids: np.ndarray, loss_mask: np.ndarray) -> str:
        """Write the token tensors and the valid flags, sync, rename into place; return the
        file's sha256."""
        self._join()
        try:
            self._raise_pending()
            if self._row != self.layout.tokens:
                raise ValueError(
                    f"ShardWriter: {self._row} of {self.layout.tokens} state rows were put"
                )
            pos = self.layout.tokens * self.layout.row_bytes
            for array in (
                input_ids.astype(np.int32),
                loss_mask.astype(np.uint8),
                self.offsets,
                self.row_starts,
                self.valid,
                *([self.scales] if self.scales is not None else []),
            ):
                data = np.ascontiguousarray(array).tobytes()
                os.pwrite(self.fd, data, self.data_start + pos)
                self._hash.update(data)
                pos += len(data)
            os.fsync(self.fd)
            os.close(self.fd)
            self.fd = -1
        except BaseException as exc:
            self.abort()
            raise exc
        self._atomic.__exit__(None, None, None)
        return self._hash.hexdigest()

    def abort(self) -> None:
        if self._thread.is_alive():
            self._join()
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
    row_starts: np.ndarray  # where each sample's states start (format 1: offsets[:-1])
    valid: np.ndarray
    scales: np.ndarray | None = None  # fp8 storage: [tokens, layers] float32, in row order

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def length(self, i: int) -> int:
        return int(self.offsets[i + 1] - self.offsets[i])

    def sample(self, i: int) -> dict[str, Any]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        row = int(self.row_starts[i])
        item = {
            "hidden_states": self.hidden_states[row : row + b - a],
            "input_ids": torch.from_numpy(self.input_ids[a:b].astype(np.int64)),
            "loss_mask": torch.from_numpy(self.loss_mask[a:b].astype(bool)),
        }
        if self.scales is not None:  # e4m3 values, and their scales
            item["hidden_scales"] = torch.from_numpy(self.scales[row : row + b - a])
        return item

    @property
    def storage(self) -> str:
        return "fp8" if self.scales is not None else "bf16"

    def states(self, i: int, dtype: torch.dtype = STATE_DTYPE) -> torch.Tensor:
        """Sample i's states [len, layers, hidden] as values in ``dtype`` (fp8 dequantized)."""
        item = self.sample(i)
        if self.scales is None:
            return item["hidden_states"].to(dtype)
        return dequantize_fp8(item["hidden_states"], item["hidden_scales"], dtype)


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

    fp8 = header["hidden_states"]["dtype"] == "F8_E4M3"
    hs = view("hidden_states", np.uint8 if fp8 else np.uint16)
    hidden_states = torch.from_numpy(hs).view(FP8 if fp8 else torch.bfloat16)
    offsets = view("offsets", np.int64)
    return Shard(
        path=path,
        hidden_states=hidden_states,
        input_ids=view("input_ids", np.int32),
        loss_mask=view("loss_mask", np.uint8),
        offsets=offsets,
        row_starts=view("row_starts", np.int64) if "row_starts" in header else offsets[:-1],
        valid=view("valid", np.uint8),
        scales=view("hidden_scales", np.float32) if fp8 else None,
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
    """Fail if a shard was made for another verifier, layer set, hidden size or storage."""
    for key in ("verifier", "layer_ids", "hidden_size", "state_dtype"):
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


class Phases:
    """When each step of a job ended, in seconds since its process started (interpreter
    start-up and imports included); each is also logged as ``extract: <name> at N s``."""

    def __init__(self):
        import psutil

        self.start = psutil.Process().create_time()
        self.marks: dict[str, float] = {}

    def mark(self, name: str) -> None:
        self.marks[name] = round(time.time() - self.start, 2)
        print(f"extract: {name} at {self.marks[name]:.1f} s", file=sys.stderr, flush=True)


def resolve_dtype(name: str, device: torch.device, key: str = "dtype") -> torch.dtype:
    """Compute dtype for config value ``name`` of config key ``key``: auto is bf16 on GPU and
    fp32 on CPU; bf16 is refused on a CPU without native bf16 (precision.bf16_is_slow)."""
    from eagle3lib.precision import bf16_is_slow

    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name == "bfloat16" and bf16_is_slow(device):
        raise UserError(
            f"config key {key}: bfloat16 on this CPU, which has no native bf16 (it would run "
            "several times slower than float32); use auto or float32"
        )
    return getattr(torch, name)


def input_device(model) -> torch.device:
    """Where the input ids go: the embedding's device (models spread with device_map too)."""
    return model.get_input_embeddings().weight.device


def extract_samples(
    model,
    samples: Sequence[np.ndarray],
    masks: Sequence[np.ndarray],
    aux: Sequence[int],
    cfg,
    shard_path: Path,
    metadata: dict[str, str],
    phases: Phases | None = None,
) -> dict[str, Any]:
    """Forward ``samples`` through ``model`` in length-sorted batches and write one shard."""
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
    writer = ShardWriter(
        shard_path,
        layout,
        metadata,
        device=device,
        max_batch_rows=max(len(b) * lengths[b[0]] for b in batches),
    )
    if phases:
        phases.mark("shard writer ready")
    t0 = time.perf_counter()
    try:
        work = [(batch, sum(lengths[i] for i in batch)) for batch in batches]
        for batch in iter_progress(work, layout.tokens):
            states, _ = forward_batch(decoder, capture, [samples[i] for i in batch], device)
            writer.put_batch(batch, states, [lengths[i] for i in batch])
        sha256 = writer.close(np.concatenate(samples), np.concatenate(masks))
    except BaseException:
        writer.abort()
        raise
    finally:
        capture.remove()
    return writer_stats(writer, time.perf_counter() - t0, padded, sha256)


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


def vllm_extraction_args(layer_ids: Sequence[int], storage: Path, cuda: bool) -> list[str]:
    """Server flags for vLLM's extract_hidden_states method (what speculators launches)."""
    spec = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
    }
    connector = {
        "kv_connector": "ExampleHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(storage)},
    }
    if not cuda:
        connector["kv_connector"] = "CpuHiddenStatesConnector"
        connector["kv_connector_module_path"] = "eagle3lib.vllm_connector"
    return ["--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(connector)]


def extract_samples_vllm(
    server,
    samples: Sequence[np.ndarray],
    masks: Sequence[np.ndarray],
    layout_hidden: int,
    n_layers: int,
    cfg,
    shard_path: Path,
    metadata: dict[str, str],
) -> dict[str, Any]:
    """Hidden states from a vLLM server (extract_hidden_states + the KV connector), one
    request per sample, ``cfg.concurrency`` in flight, written into one shard in place."""
    import concurrent.futures
    import fcntl

    from safetensors.torch import load_file

    lengths = tuple(len(s) for s in samples)
    order = sorted(range(len(samples)), key=lambda i: -lengths[i])  # longest first
    layout = ShardLayout(lengths, n_layers, layout_hidden, tuple(order), cfg.storage)
    writer = ShardWriter(shard_path, layout, metadata)

    def fetch(i: int) -> torch.Tensor:
        out = server.completion(samples[i].tolist(), max_tokens=1)
        path = (out.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path:
            raise UserError(
                "vLLM returned no hidden_states_path: is the extraction connector configured?"
            )
        with open(path + ".lock") as lock:
            fcntl.flock(
                lock, fcntl.LOCK_SH
            )  # the connector holds LOCK_EX until the file is written
            data = load_file(path)
        for leftover in (path, path + ".lock"):
            Path(leftover).unlink(missing_ok=True)
        if data["token_ids"].tolist() != samples[i].tolist():
            raise UserError(f"vLLM hidden states of sample {i} belong to other tokens")
        states = data["hidden_states"]
        if tuple(states.shape) != (lengths[i], n_layers, layout_hidden):
            raise UserError(f"vLLM returned states of shape {tuple(states.shape)} for sample {i}")
        return states

    t0 = time.perf_counter()
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=cfg.concurrency)
    try:
        # At most 2 x concurrency samples in flight or waiting to be written: memory stays
        # bounded whatever the shard's size.
        window = 2 * cfg.concurrency
        futures = {i: pool.submit(fetch, i) for i in order[:window]}
        for n, i in enumerate(iter_progress([(i, lengths[i]) for i in order], layout.tokens)):
            if n + window < len(order):
                nxt = order[n + window]
                futures[nxt] = pool.submit(fetch, nxt)
            states = futures.pop(i).result()
            writer.put_batch([i], states[None], [lengths[i]])
        sha256 = writer.close(np.concatenate(samples), np.concatenate(masks))
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        writer.abort()
        raise
    finally:
        pool.shutdown(wait=True)
    return writer_stats(writer, time.perf_counter() - t0, 0, sha256)


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
    from eagle3lib.data import shard_range
    from eagle3lib.fileio import remove_stale_temps, write_json
    from eagle3lib.verifier import device_map_for_job, identity, load_model

    phases = Phases()
    phases.mark("started")
    for output in (shard_path, manifest_path):
        remove_stale_temps(output)  # a killed earlier attempt's half-written shard
    start, stop = shard_range(len(samples), shard, cfg.shards)
    if stop <= start:
        raise UserError(
            f"config key extract.shards: {cfg.shards} shards for {len(samples)} samples leaves "
            f"shard {shard} empty; use at most {len(samples)} shards"
        )
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
    spec = {
        "verifier": identity(record),
        "layer_ids": layer_ids,
        "hidden_size": record["hidden_size"],
        "compute_dtype": str(dtype).removeprefix("torch."),
        "state_dtype": STORAGE_DTYPES[cfg.storage],
        "backend": cfg.backend,
    }
    digest = input_hash(np.concatenate(ids), np.concatenate(masks), offsets, spec)

    metadata = {"format": SHARD_FORMAT, "input_hash": digest}
    if cfg.backend == "vllm":
        from eagle3lib import serve

        storage = shard_path.parent / f".vllm-{shard_path.stem}"
        engine = {
            **(engine or {}),
            "dtype": str(dtype).removeprefix("torch."),  # the same numerics as the hf backend
            "max_model_len": max(lengths) + 8,
        }
        args = [
            *vllm_extraction_args(layer_ids, storage.resolve(), cuda),
            *serve.engine_args(engine, record.get("trust_remote_code", False)),
        ]
        env = serve.engine_env(engine.get("cpu_kvcache_gib", 1))
        log_path = shard_path.parent / f"vllm-server-{shard_path.stem}.log"
        try:
            with serve.VllmServer(vllm_python, record["load_path"], args, log_path, env) as server:
                stats = extract_samples_vllm(
                    server,
                    ids,
                    masks,
                    record["hidden_size"],
                    len(layer_ids),
                    cfg,
                    shard_path,
                    metadata,
                )
        finally:
            import shutil

            shutil.rmtree(storage, ignore_errors=True)
    else:
        # several leased GPUs: the layers are spread over them (a verifier bigger than one)
        t0 = time.perf_counter()
        model = load_model(record, dtype, device_map=device_map_for_job())
        load_seconds = time.perf_counter() - t0
        phases.mark("verifier loaded")
        stats = extract_samples(model, ids, masks, aux, cfg, shard_path, metadata, phases)
        stats["model_load_seconds"] = load_seconds
    phases.mark("shard written")
    rejected = [
        {"id": sample_ids[start + i], "reason": "non-finite hidden states"}
        for i in np.flatnonzero(stats.pop("valid") == 0).tolist()
    ]
    manifest = {
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
        "file": {
            "name": shard_path.name,
            "bytes": shard_path.stat().st_size,
            "sha256": stats.pop("sha256"),  # computed while the shard was written
        },
    }
    write_json(manifest_path, manifest)
    phases.mark("manifest written")
    stats["phases"] = phases.marks
    stats["rejected"] = len(rejected)
    stats["write_gb_per_s"] = (
        manifest["file"]["bytes"] / stats["write_seconds"] / 1e9 if stats["write_seconds"] else None
    )
    return stats
