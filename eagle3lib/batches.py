"""Training batches: how samples are packed into them and how they are built.

Packing. speculators' multipack sampler fills each batch with the next samples of the epoch's
shuffled order until the next one does not fit, which leaves about a quarter of 2048 positions
as padding on a 256-2048 token mix (``pack_fill``). ``FirstFitDecreasingSampler`` packs the same
shuffled samples window by window, longest first, each into the fullest batch it still fits
(best-fit decreasing): every sample exactly once per epoch, whole, deterministic per seed and
epoch; only which samples share a batch, and so the number of steps, changes.

Building. speculators' ``CollateFn`` builds a batch in three passes over its bytes (zero-filled
buffers, copies, then the DataLoader's copy into pinned memory), on the training process's one
loading thread. ``ShardCollator`` writes the same batch, bit for bit, straight from the shards'
memory maps into reusable (pinned) buffers, in one pass; ``ThreadedBatches`` runs it on several
threads (numpy copies release the GIL and use no OpenMP pool that a busy host could stall),
batches in order.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import itertools
import queue
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

PACKINGS = ("ffd", "multipack")  # train.packing's default first
# ThreadedBatches' caller holds at most two batches' buffers: the one being copied to the GPU
# and the current one (StreamingTrainer._device_batches)
HELD_BATCHES = 2


# ---- packing ---------------------------------------------------------------------------------


def best_fit_decreasing(costs: np.ndarray, capacity: int) -> list[list[int]]:
    """Positions of ``costs`` grouped into bins of at most ``capacity``: longest first, each
    into the bin with the least room that still holds it (a new bin when none does). Ties go
    to the earlier position and the older bin, so the result depends on the input alone."""
    order = np.argsort(-costs, kind="stable")
    room: list[tuple[int, int]] = []  # (room left, bin), sorted
    bins: list[list[int]] = []
    for pos in order.tolist():
        cost = int(costs[pos])
        k = bisect.bisect_left(room, (cost, -1))
        if k < len(room):
            left, b = room.pop(k)
            bins[b].append(pos)
            bisect.insort(room, (left - cost, b))
        else:
            bins.append([pos])
            bisect.insort(room, (capacity - cost, len(bins) - 1))
    return bins


def _split(bin_: list[int], costs: np.ndarray) -> tuple[list[int], list[int]]:
    """A bin's samples in two bins, longest first, alternately."""
    order = sorted(bin_, key=lambda p: -int(costs[p]))
    return order[0::2], order[1::2]


class FirstFitDecreasingSampler(MultipackDistributedBatchSamplerV2):
    """speculators' multipack sampler with fuller batches.

    Per epoch the samples are shuffled as speculators shuffles them (``seed + epoch``), then
    packed ``window`` samples at a time by ``best_fit_decreasing``, and the window's batches
    put in a random order. Samples cost the positions they fill after speculators'
    ``shift_batch`` (``length - shift``), so a batch never truncates one. Under DDP step k
    gives rank r batch ``k * replicas + r``; when the batch count is not a multiple of the
    ranks, the batches with most samples are split in two (only with single-sample batches
    left, the last < ``replicas`` batches are dropped, as speculators drops < ``replicas``
    samples). Resume (speculators' fast skip), ``set_epoch`` and ``max_batches`` work as in
    the parent class.
    """

    def __init__(
        self, batch_max_length, lengths, *args, window: int = 1024, shift: int = 1, **kwargs
    ):
        super().__init__(batch_max_length, lengths, *args, **kwargs)
        self.window = window
        # from the lengths as given: the parent's are clipped to the batch, so a longer sample
        # would cost one position less than it fills and leave room for a sample of one
        self.costs = np.clip(np.asarray(lengths) - shift, 0, self.batch_max_length)

    def _generate_batches(self, epoch: int) -> list[np.ndarray]:
        if self._cached_generated_batches[0] == epoch:
            return self._cached_generated_batches[1]
        rng = np.random.default_rng(seed=self.seed + epoch)
        indices = rng.permutation(self.valid_indices)
        costs = self.costs[indices]
        bins: list[list[int]] = []
        for start in range(0, len(indices), self.window):
            part = best_fit_decreasing(costs[start : start + self.window], self.batch_max_length)
            for k in rng.permutation(len(part)).tolist():
                bins.append([start + p for p in part[k]])
        replicas = self.num_replicas
        while len(bins) % replicas:
            widest = max(range(len(bins)), key=lambda b: (len(bins[b]), b))
            if len(bins[widest]) < 2:
                bins = bins[: len(bins) - len(bins) % replicas]
                break
            first, second = _split(bins.pop(widest), costs)
            bins += [first, second]
        batches = [indices[np.asarray(b, dtype=np.int64)] for b in bins[self.rank :: replicas]]
        if self.max_batches is not None:
            batches = batches[: self.max_batches]
        self._cached_generated_batches = (epoch, batches)
        return batches


def make_sampler(
    packing: str, lengths: Sequence[int], total_seq_len: int, replicas: int, rank: int, seed: int
):
    """The batch sampler for ``packing``: speculators' ``multipack`` or ``ffd``."""
    if packing not in PACKINGS:
        raise ValueError(f"packing {packing!r}: choose from {', '.join(PACKINGS)}")
    cls = FirstFitDecreasingSampler if packing == "ffd" else MultipackDistributedBatchSamplerV2
    return cls(
        batch_max_length=total_seq_len,
        lengths=lengths,
        num_replicas=replicas,
        rank=rank,
        seed=seed,
    )


def real_tokens(batches: Sequence[np.ndarray], lengths: np.ndarray, total_seq_len: int) -> list:
    """Real tokens of each batch after speculators' shift_batch and CollateFn (its lengths
    minus one per sample, at most ``total_seq_len``)."""
    lengths = np.asarray(lengths)
    return [int(min(total_seq_len, np.clip(lengths[b] - 1, 0, None).sum())) for b in batches]


def pack_fill(
    packing: str,
    lengths: Sequence[int],
    total_seq_len: int,
    replicas: int = 1,
    seed: int = 0,
    epoch: int = 0,
) -> float:
    """Real tokens over positions of one epoch's batches (all ranks) with ``packing``."""
    lengths = np.asarray(lengths)
    tokens = positions = 0
    for rank in range(replicas):
        sampler = make_sampler(packing, lengths, total_seq_len, replicas, rank, seed)
        batches = sampler._generate_batches(epoch)  # noqa: SLF001
        tokens += sum(real_tokens(batches, lengths, total_seq_len))
        positions += len(batches) * total_seq_len
    return tokens / positions if positions else 0.0


# ---- building batches ------------------------------------------------------------------------


def _np(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor; bf16 and fp8 as same-sized integers (bytes copied as
    they are)."""
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    elif t.element_size() == 1 and t.dtype not in (torch.uint8, torch.int8, torch.bool):
        t = t.view(torch.uint8)
    return t.numpy()


class ShardCollator:
    """speculators' ``CollateFn`` with ``shift_batch`` (or ``shift_fp8_batch``) over a
    ``ShardDataset``, written once into given buffers.

    The batch equals ``CollateFn(max_len, hidden, aux, dtype, preprocess)([dataset[i] ...])``
    bit for bit: the same keys in the same order, sample i's rows shifted as speculators
    shifts them, its truncation of a last sample that does not fit, ``document_ids`` from its
    lengths, zeros after the last real token. States are copied as bytes when the dataset's
    dtype is the shards' (bf16 on a GPU), converted by torch otherwise (fp32 on a CPU)."""

    def __init__(self, dataset, max_len: int, pin: bool = False):
        self.dataset, self.max_len, self.pin = dataset, max_len, pin
        shards = dataset.shards
        layers, self.hidden = shards[0].hidden_states.shape[1:]
        self.aux = layers - 1
        self.fp8 = dataset.fp8
        self.dtype = dataset.hidden_states_dtype
        if self.fp8:
            self.keys = (
                "input_ids", "loss_mask", "position_ids",
                "fp8_aux", "fp8_aux_scales", "fp8_last", "fp8_last_scales",
            )  # fmt: skip
        else:
            self.keys = (
                "input_ids", "hidden_states", "verifier_last_hidden_states", "loss_mask",
                "position_ids",
            )  # fmt: skip

    def buffers(self) -> dict[str, torch.Tensor]:
        """One batch's buffers ([1, max_len, ...], pinned on a GPU host)."""
        n, h, aux = self.max_len, self.hidden, self.aux
        shapes = {
            "input_ids": ((n,), torch.long),
            "loss_mask": ((n,), torch.bool),
            "position_ids": ((n,), torch.long),
            "document_ids": ((n,), torch.long),
        }
        if self.fp8:
            shapes |= {
                "fp8_aux": ((n, aux * h), torch.uint8),
                "fp8_aux_scales": ((n, aux), torch.float32),
                "fp8_last": ((n, h), torch.uint8),
                "fp8_last_scales": ((n,), torch.float32),
            }
        else:
            shapes |= {
                "hidden_states": ((n, aux * h), self.dtype),
                "verifier_last_hidden_states": ((n, h), self.dtype),
            }
        return {
            k: torch.empty((1, *shape), dtype=dtype, pin_memory=self.pin)
            for k, (shape, dtype) in shapes.items()
        }

    def _states(self, out: torch.Tensor, shard, rows: slice, slot) -> None:
        """``out`` <- the shard's states ``[rows, slot]`` (bytes, or converted by torch)."""
        src = shard.hidden_states[rows, slot]
        if self.fp8 or src.dtype == out.dtype:
            np.copyto(_np(out), _np(src).reshape(out.shape))
        else:
            out.copy_(src.reshape(out.shape))

    def __call__(self, indices: Sequence[int], buffers: dict[str, torch.Tensor]) -> dict:
        ds, max_len, aux = self.dataset, self.max_len, self.aux
        flat = {k: v[0] for k, v in buffers.items()}
        arrays = {k: _np(v) for k, v in flat.items()}
        offset, lengths = 0, []
        for index in indices:
            s, i = ds.pairs[int(index)]
            shard = ds.shards[s]
            a, n = int(shard.offsets[i]), int(shard.offsets[i + 1] - shard.offsets[i])
            row = int(shard.row_starts[i])
            lengths.append(max(n - 1, 0))  # shift_batch: one token less
            rows = min(max(n - 1, 0), max_len - offset)
            if offset == max_len:
                continue  # CollateFn stops copying, but keeps the lengths
            dst = slice(offset, offset + rows)
            arrays["input_ids"][dst] = shard.input_ids[a + 1 : a + 1 + rows]
            np.not_equal(shard.loss_mask[a + 1 : a + 1 + rows], 0, out=arrays["loss_mask"][dst])
            arrays["position_ids"][dst] = np.arange(1, rows + 1)
            now, later = slice(row, row + rows), slice(row + 1, row + 1 + rows)
            if self.fp8:
                self._states(flat["fp8_aux"][dst], shard, now, slice(0, aux))
                self._states(flat["fp8_last"][dst], shard, later, aux)
                arrays["fp8_aux_scales"][dst] = shard.scales[now, :aux]
                arrays["fp8_last_scales"][dst] = shard.scales[later, aux]
            else:
                self._states(flat["hidden_states"][dst], shard, now, slice(0, aux))
                self._states(flat["verifier_last_hidden_states"][dst], shard, later, aux)
            offset += rows
        for key in self.keys:
            arrays[key][offset:] = 0
        # CollateFn's lengths: whole samples while they fit, the last one truncated
        kept, total = [], 0
        for length in lengths:
            if length + total >= max_len:
                kept.append(max_len - total)
                break
            kept.append(length)
            total += length
        docs = arrays["document_ids"]
        start = 0
        for d, length in enumerate(kept):
            docs[start : start + length] = d
            start += length
        docs[start:] = -1
        batch: dict[str, Any] = {k: buffers[k] for k in self.keys}
        batch["document_ids"] = buffers["document_ids"]
        batch["error_records"] = 0
        return batch


def shard_collator(dataset, collate_fn, pin: bool) -> ShardCollator | None:
    """A ShardCollator equal to ``collate_fn`` over ``dataset``, or None where it would not
    be (another dataset, collate function or preprocessing)."""
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn

    from eagle3lib.train_data import ShardDataset, shift_fp8_batch

    if not (isinstance(dataset, ShardDataset) and type(collate_fn) is CollateFn):
        return None
    shift = shift_fp8_batch if dataset.fp8 else shift_batch
    if collate_fn.preprocess is not shift or collate_fn.dtype != dataset.hidden_states_dtype:
        return None
    collator = ShardCollator(dataset, collate_fn.max_len, pin)
    if (collator.hidden, collator.aux) != (collate_fn.hidden_size, collate_fn.num_target_layers):
        return None
    return collator


class _Pool:
    """Reusable batch buffers, made on first use, at most ``size`` sets. A set comes back with
    the CUDA event recorded after its copy to the GPU and is written again only after it.
    ``wait_seconds``: the loader threads' time (summed over them) blocked for a set, waiting
    for one to come back or for its copy to finish (the GPU's back-pressure on the loader)."""

    def __init__(self, make: Callable[[], dict], size: int):
        import threading

        self.make, self.size, self.made = make, size, 0
        self.free: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.wait_seconds = 0.0
        self.held = 0  # sets handed to ThreadedBatches' caller and not released yet

    def get(self) -> dict:
        with self.lock:
            fresh = self.free.empty() and self.made < self.size
            self.made += fresh
        if fresh:
            return self.make()
        t0 = time.perf_counter()
        buffers, event = self.free.get()
        if buffers is None:
            raise RuntimeError("the epoch's batches were closed")  # close(): nobody waits
        if event is not None:
            event.synchronize()
        waited = time.perf_counter() - t0
        with self.lock:
            self.wait_seconds += waited
        return buffers

    def put(self, buffers: dict, event=None) -> None:
        self.free.put((buffers, event))

    def close(self) -> None:
        """Wake the loader threads waiting for a set (fewer than ``size``): the epoch is over."""
        for _ in range(self.size):
            self.free.put((None, None))


class ThreadedBatches:
    """The batches of a DataLoader without workers (its dataset, batch sampler and collate
    function), built by ``threads`` threads, ``depth`` ahead, yielded in order as (batch,
    release). Over a ShardDataset with speculators' CollateFn they are built by
    ``ShardCollator`` into reused buffers: ``release(event)`` hands a batch's buffers back once
    the caller is done with them (``event``: its copy to the GPU). Otherwise each batch is
    ``collate_fn([dataset[i] ...])``, pinned if the loader pins, and release does nothing."""

    def __init__(self, loader, threads: int, depth: int | None = None):
        self.loader = loader
        self.threads = max(1, threads)
        self.depth = depth or max(2, self.threads)
        self.pin = bool(loader.pin_memory) and torch.cuda.is_available()
        self.collator = shard_collator(loader.dataset, loader.collate_fn, self.pin)
        self.pool: _Pool | None = None  # the iteration's buffer sets (with the ShardCollator)

    def __len__(self) -> int:
        return len(self.loader.batch_sampler)

    def _generic(self, indices) -> dict:
        from torch.utils.data._utils.pin_memory import pin_memory

        batch = self.loader.collate_fn([self.loader.dataset[int(i)] for i in indices])
        return pin_memory(batch) if self.pin else batch

    def __iter__(self) -> Iterator[tuple[dict, Callable]]:
        batches = iter(list(self.loader.batch_sampler))
        # a set is in the window (depth batches) or the caller's (HELD_BATCHES)
        pool = _Pool(self.collator.buffers, self.depth + HELD_BATCHES) if self.collator else None
        self.pool = pool  # its wait_seconds: the loader's wait for a free buffer set

        def build(indices):
            if pool is None or len(indices) == 0:
                return self._generic(indices), None
            buffers = pool.get()
            return self.collator(indices, buffers), buffers

        def nothing(_event=None):
            return None

        device = torch.cuda.current_device() if torch.cuda.is_available() else None

        def on_this_device():  # pinned buffers and events in this rank's context, not GPU 0's
            if device is not None:
                torch.cuda.set_device(device)

        executor = concurrent.futures.ThreadPoolExecutor(
            self.threads, thread_name_prefix="batch-loader", initializer=on_this_device
        )
        window = [executor.submit(build, i) for i in itertools.islice(batches, self.depth)]
        try:
            while window:
                if pool is not None and pool.held > HELD_BATCHES:  # its set would never come
                    raise RuntimeError(
                        f"ThreadedBatches: the caller holds {pool.held} batches whose buffers "
                        f"it has not released; release each (release(event)) once its copy to "
                        f"the GPU is recorded: at most {HELD_BATCHES} may be held"
                    )
                batch, buffers = window.pop(0).result()
                for indices in itertools.islice(batches, 1):
                    window.append(executor.submit(build, indices))
                yield batch, (nothing if buffers is None else _releaser(pool, buffers))
        finally:
            for future in window:
                future.cancel()
            if pool is not None:
                pool.close()
            executor.shutdown(wait=True, cancel_futures=True)


def _releaser(pool: _Pool, buffers: dict) -> Callable:
    released = False
    with pool.lock:
        pool.held += 1

    def release(event=None) -> None:
        nonlocal released
        if released:  # the set would be handed out twice: two batches written into one
            raise RuntimeError("ThreadedBatches: a batch's buffers were released twice")
        released = True
        with pool.lock:
            pool.held -= 1
        pool.put(buffers, event)

    return release
