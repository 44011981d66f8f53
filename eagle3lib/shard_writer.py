"""``ShardWriter``: one shard file written front to back from background threads while the
next batch computes, hashed on the way (the format: ``shards``)."""

from __future__ import annotations

import errno
import hashlib
import os
import queue
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from eagle3lib.errors import UserError
from eagle3lib.fileio import atomic_path
from eagle3lib.shards import ShardLayout, quantize_fp8

STATE_DTYPE = torch.bfloat16


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

    def device_done(self) -> None:
        """Wait until every batch put so far has left the device (its copy into pinned host
        memory has finished); the disk writes and the hash may still be running. A job that
        shares its GPU gives its turn back after this."""
        if self.cuda:
            self._stream.synchronize()

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
