"""Train the EAGLE-3 draft with speculators' Eagle3DraftModel and Trainer, from our shards.

speculators does the modelling, the loss, TTT, the optimiser, scheduling and checkpointing;
this module supplies a Dataset that reads the shards memory-mapped, builds the model the way
speculators' CLI does, and makes the trainer work on a CPU-only machine (its landmines 3, 4, 7
and 8 in reference/speculators.md) without touching its GPU path.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import json
import logging
import os
import shutil
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from speculators.train.data import BaseDataset
from speculators.train.trainer import Trainer

from eagle3lib.errors import UserError
from eagle3lib.fileio import fingerprinted_dir, fsync_tree, read_json, sha256_json
from eagle3lib.hidden_states import Shard, check_manifest, check_shard, open_shard
from eagle3lib.verifier import identity

# ---- data ------------------------------------------------------------------------------------


# Shards whose sha256 this process already checked, keyed by (path, size, mtime, sha256).
_VERIFIED: set[tuple] = set()


def open_verified_shards(
    shard_paths: Sequence[Path], manifest_paths: Sequence[Path], expect: dict[str, Any]
) -> list[Shard]:
    """Open every shard after checking it against its manifest (size, hash, what made it).

    The shards are hashed in parallel threads (hashlib and file reads release the GIL), so the
    check runs at the disk's read rate rather than one core's hashing rate."""
    checks = []
    for shard_path, manifest_path in zip(shard_paths, manifest_paths, strict=True):
        manifest = read_json(manifest_path)
        check_manifest(manifest, expect, str(manifest_path))
        path = Path(shard_path)
        stat = path.stat() if path.exists() else None
        key = (
            str(path.resolve()),
            stat and stat.st_size,
            stat and stat.st_mtime_ns,
            manifest["file"]["sha256"],
        )
        # one full hash per shard and process; under DDP only rank 0 reads the shards to hash
        checks.append((path, manifest, Path(manifest_path), key))

    def check(item) -> UserError | None:
        path, manifest, _, key = item
        try:
            check_shard(path, manifest, full_hash=key not in _VERIFIED and distributed_rank() == 0)
        except UserError as exc:
            return exc
        return None

    workers = max(1, min(len(checks), os.cpu_count() or 1, 8))
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        problems = list(pool.map(check, checks))
    damaged = [(item, exc) for item, exc in zip(checks, problems, strict=True) if exc]
    for (_, _, manifest_path, _), _exc in damaged:
        # never trained on: without its manifest the next run rebuilds the shard
        manifest_path.unlink(missing_ok=True)
    if damaged:
        (_, _, manifest_path, _), exc = damaged[0]
        others = f" (and {len(damaged) - 1} more damaged shard(s))" if len(damaged) > 1 else ""
        raise UserError(
            f"{str(exc).split(';')[0]}{others}; removed its manifest {manifest_path}: rerun the "
            "workflow to rebuild this shard"
        )
    _VERIFIED.update(key for *_, key in checks)
    return [open_shard(path) for path, *_ in checks]


def split_indices(
    shards: Sequence[Shard], val_fraction: float
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(shard, sample) pairs of valid samples; the last ``val_fraction`` is validation."""
    pairs = [(s, i) for s, shard in enumerate(shards) for i in range(len(shard)) if shard.valid[i]]
    if len(pairs) < 2:
        rejected = sum(len(shard) - int(shard.valid.sum()) for shard in shards)
        if rejected:
            where = ", ".join(str(shard.path.with_suffix(".json")) for shard in shards)
            raise UserError(
                f"{where}: {rejected} sample(s) rejected for non-finite (NaN/inf) hidden states, "
                f"{len(pairs)} usable; training needs at least 2: check the verifier's weights "
                "or extract in higher precision (extract.dtype: float32)"
            )
        raise UserError(
            f"only {len(pairs)} usable sample(s) in the shards; training needs at least 2 "
            "(raise data.train.max_samples)"
        )
    n_val = min(len(pairs) - 1, max(1, round(len(pairs) * val_fraction)))
    return pairs[:-n_val], pairs[-n_val:]


# fp8 shards travel to the GPU as e4m3 bytes and float32 scales under these keys (names
# without "hidden_states": speculators' collate would cast those to the training dtype), and
# the draft's forward pre-hook turns them into speculators' hidden_states keys (``fp8_inputs``).
FP8_KEYS = ("fp8_aux", "fp8_aux_scales", "fp8_last", "fp8_last_scales")
COMMON_KEYS = ("input_ids", "loss_mask", "lengths", "position_ids")


class ShardDataset(BaseDataset):
    """speculators' dataset contract (hidden_states [T, aux*H], verifier_last_hidden_states,
    input_ids, loss_mask) served from shard files, one mmap per shard and no per-sample opens.
    From fp8 shards it serves the e4m3 bytes and scales instead (``FP8_KEYS``), dequantized on
    the device by the draft's forward pre-hook (``fp8_inputs``)."""

    def __init__(
        self,
        shard_paths: Sequence[Path],
        pairs,
        max_len: int,
        dtype: torch.dtype,
        storage: str = "bf16",
    ):
        self.shard_paths = [Path(p) for p in shard_paths]
        self.pairs = list(pairs)
        self.fp8 = storage == "fp8"
        self._shards: list[Shard] | None = None
        super().__init__(max_len=max_len, hidden_states_dtype=dtype)

    @property
    def shards(self) -> list[Shard]:
        if self._shards is None:
            self._shards = [open_shard(p) for p in self.shard_paths]
        return self._shards

    def __getstate__(self):  # DataLoader workers reopen the memory maps themselves
        state = self.__dict__.copy()
        state["_shards"] = None
        return state

    def __len__(self) -> int:
        return len(self.pairs)

    def _compute_approx_lengths(self) -> list[int]:
        return [
            int(self.shards[s].offsets[i + 1] - self.shards[s].offsets[i]) for s, i in self.pairs
        ]

    def _get_raw_data(self, index: int) -> dict[str, torch.Tensor]:
        s, i = self.pairs[index]
        item = self.shards[s].sample(i)
        if self.fp8:
            values, scales = item["hidden_states"].view(torch.uint8), item["hidden_scales"]
            return {
                "fp8_aux": values[:, :-1].flatten(1),
                "fp8_aux_scales": scales[:, :-1],
                "fp8_last": values[:, -1],
                "fp8_last_scales": scales[:, -1],
                "input_ids": item["input_ids"],
                "loss_mask": item["loss_mask"],
            }
        states = item["hidden_states"].to(self.hidden_states_dtype)
        return {
            "hidden_states": states[:, :-1].flatten(1),
            "input_ids": item["input_ids"],
            "verifier_last_hidden_states": states[:, -1],
            "loss_mask": item["loss_mask"],
        }


def shift_fp8_batch(batch: dict[str, Any]) -> dict[str, Any]:
    """speculators' ``shift_batch`` (states at t predict the token at t+1) for fp8 samples: the
    same shift, applied by speculators' own function to the bytes and to the scales."""
    from speculators.models.eagle3.data import shift_batch

    if "fp8_aux" not in batch:  # the collate's placeholder when no sample is available
        aux, last = batch["hidden_states"], batch["verifier_last_hidden_states"]
        n_aux = aux.shape[1] // last.shape[1]
        batch = {
            **{k: batch[k] for k in COMMON_KEYS},
            "fp8_aux": torch.zeros(aux.shape, dtype=torch.uint8),
            "fp8_aux_scales": torch.zeros(aux.shape[0], n_aux),
            "fp8_last": torch.zeros(last.shape, dtype=torch.uint8),
            "fp8_last_scales": torch.zeros(last.shape[0]),
        }
    common = {k: batch[k] for k in COMMON_KEYS}
    values = shift_batch(
        {
            **common,
            "hidden_states": batch["fp8_aux"],
            "verifier_last_hidden_states": batch["fp8_last"],
        }
    )
    scales = shift_batch(
        {
            **common,
            "hidden_states": batch["fp8_aux_scales"],
            "verifier_last_hidden_states": batch["fp8_last_scales"],
        }
    )
    return {
        **{k: values[k] for k in COMMON_KEYS},
        "fp8_aux": values["hidden_states"],
        "fp8_aux_scales": scales["hidden_states"],
        "fp8_last": values["verifier_last_hidden_states"],
        "fp8_last_scales": scales["verifier_last_hidden_states"],
    }


def fp8_inputs(dtype: torch.dtype):
    """A forward pre-hook for the draft: the fp8 keys of a batch (on the device by now) become
    speculators' hidden_states [1, T, aux*H] and verifier_last_hidden_states [1, T, H] in
    ``dtype``. Batches without them pass unchanged. Works under any trainer, DDP or FSDP."""
    from eagle3lib.hidden_states import dequantize_fp8

    def hook(_module, args, kwargs):
        if "fp8_aux" not in kwargs:
            return args, kwargs
        aux, aux_scales, last, last_scales = (kwargs.pop(k) for k in FP8_KEYS)
        n_aux = aux_scales.shape[-1]
        kwargs["hidden_states"] = dequantize_fp8(
            aux.unflatten(-1, (n_aux, -1)), aux_scales, dtype
        ).flatten(-2)
        kwargs["verifier_last_hidden_states"] = dequantize_fp8(last, last_scales, dtype)
        return args, kwargs

    return hook


def make_loader(
    dataset,
    total_seq_len: int,
    hidden_size: int,
    n_aux: int,
    seed: int,
    workers: int = 0,
    packing: str = "multipack",
):
    """The DataLoader speculators' CLI builds: multipack sampler, CollateFn with shift_batch.

    With ``workers`` > 0 it uses speculators' loader settings (spawned workers, prefetch 4,
    pinned memory); with 0 the StreamingTrainer builds its batches in background threads
    (``batches.ThreadedBatches``). ``packing`` "ffd" packs fuller batches
    (``batches.FirstFitDecreasingSampler``).
    """
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn
    from speculators.train.distributed import get_dp_rank, get_dp_size
    from torch.utils.data import DataLoader

    from eagle3lib.batches import make_sampler

    sampler = make_sampler(
        packing, dataset.approx_lengths, total_seq_len, get_dp_size(), get_dp_rank(), seed
    )
    collate = CollateFn(
        total_seq_len,
        hidden_size,
        num_target_layers=n_aux,
        dtype=dataset.hidden_states_dtype,
        preprocess=shift_fp8_batch if getattr(dataset, "fp8", False) else shift_batch,
    )
    extra = {}
    if workers:
        from speculators.train.dataloader import _worker_init_fn

        extra = dict(
            prefetch_factor=4,
            persistent_workers=True,
            multiprocessing_context="spawn",
            worker_init_fn=_worker_init_fn,
        )
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=workers,
        pin_memory=torch.cuda.is_available(),
        collate_fn=collate,
        **extra,
    )


# ---- CPU support -----------------------------------------------------------------------------


@contextlib.contextmanager
def cpu_trainer_patches() -> Iterator[None]:
    """Let speculators' Trainer run without an accelerator (no-op when one is present).

    - Trainer moves the model to ``get_local_rank()`` (device 0) -> "cpu";
    - its step timer calls ``torch.accelerator.synchronize()`` -> skipped;
    - the checkpointer loads resume state onto "cuda:0" -> "cpu";
    - its optimisers come from ``precision.cpu_optimizers``: on a CPU without native bf16,
      torch's Muon orthogonalises in fp32 (``precision.Fp32Muon``).

    Autocast gets fp32 on CPU (``resolve_runtime``), which torch turns off: fp32 throughout.
    """
    if torch.accelerator.current_accelerator() is not None:
        yield
        return
    from speculators.train import checkpointer, trainer

    from eagle3lib.precision import cpu_optimizers

    class CpuStepTimer(trainer._StepTimer):  # noqa: SLF001
        def mark(self, name: str) -> None:
            if self.enabled:
                self._marks[name] = time.perf_counter()

        def now(self) -> float | None:
            return time.perf_counter() if self.enabled else None

    build = trainer.build_optimizers
    saved = (trainer.get_local_rank, trainer._StepTimer, checkpointer.get_current_device, build)  # noqa: SLF001
    trainer.get_local_rank = lambda: "cpu"
    trainer._StepTimer = CpuStepTimer  # noqa: SLF001
    checkpointer.get_current_device = lambda: "cpu"
    trainer.build_optimizers = lambda model, config: cpu_optimizers(build(model, config))
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype")
            yield
    finally:
        (
            trainer.get_local_rank,
            trainer._StepTimer,  # noqa: SLF001
            checkpointer.get_current_device,
            trainer.build_optimizers,
        ) = saved


def accuracy_counts(pred_ids, target_ids, loss_mask=None, prev_correct=None):
    """speculators' ``compute_accuracy_single_step`` without its host syncs: the same four
    counts (correct, total, correct again, conditional total) as device tensors, and the same
    in-place update of ``prev_correct``. speculators selects the masked positions with
    ``masked_select`` (its size depends on the data, so the host waits for the GPU); a masked
    sum gives the same counts without waiting."""

    def count(n: int):
        return torch.full((), n, dtype=torch.float, device=correct.device)

    correct = pred_ids == target_ids
    if prev_correct is None:
        cond_total = count(correct.numel())
    else:
        cond_total = prev_correct.sum().float()
        correct = torch.logical_and(prev_correct, correct, out=prev_correct)
    if loss_mask is None:
        correct_sum, full_total = correct.float().sum(), count(correct.numel())
    else:
        correct, mask = torch.broadcast_tensors(correct, loss_mask.to(torch.bool))
        correct_sum = torch.logical_and(correct, mask).float().sum()
        full_total = mask.sum().float()
    return correct_sum, full_total, correct_sum.clone(), cond_total


def _scalar_tensor(data, *args, dtype=None, device=None, **kwargs):
    """``torch.tensor`` whose Python scalars on a GPU are filled there (no host-to-device copy,
    which waits for all queued GPU work); anything else goes to ``torch.tensor`` itself."""
    if (
        isinstance(data, (bool, int, float))
        and not args
        and not kwargs
        and device is not None
        and torch.device(device).type != "cpu"
    ):
        return torch.full((), data, dtype=dtype, device=device)
    return torch.tensor(data, *args, dtype=dtype, device=device, **kwargs)


@functools.cache
def _torch_with_device_scalars():
    """``torch`` with ``tensor`` replaced by ``_scalar_tensor`` (one object per process, so a
    compiled forward traced with it stays valid from one run to the next)."""
    import types

    torch_ns = types.ModuleType("torch")
    torch_ns.__dict__.update(vars(torch))
    torch_ns.tensor = _scalar_tensor
    return torch_ns


@contextlib.contextmanager
def sync_free_eagle3() -> Iterator[None]:
    """Run speculators' EAGLE-3 forward and loss without the host syncs found on an H200.

    ``bench/train.py --sync-sites`` (CUDA sync debug mode) found 8 a step, all in the loss
    metrics: 3 ``masked_select`` in ``compute_accuracy_single_step`` and 5 scalars created from
    Python numbers (``torch.tensor(1.0, device=...)``) in ``compute_metrics`` and the forward.
    Here the accuracy counts come from ``accuracy_counts`` and those modules see a ``torch``
    whose ``tensor`` fills scalars on the device; values are unchanged (tests compare them with
    speculators' own). Patched for the whole run, so torch.compile traces one version.
    """
    from speculators.models.eagle3 import core, metrics

    torch_ns = _torch_with_device_scalars()
    patches = [
        (metrics, "compute_accuracy_single_step", accuracy_counts),
        (metrics, "torch", torch_ns),
        (core, "torch", torch_ns),
    ]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    try:
        for module, name, value in patches:
            setattr(module, name, value)
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


class MetricsRecorder(logging.Handler):
    """Collects the dicts speculators logs on 'speculators.metrics' (loss, accuracy, lr)."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(path, "a", encoding="utf-8")  # noqa: SIM115

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, dict):
            self._fh.write(json.dumps(record.msg, default=float) + "\n")
            self._fh.flush()

    def close(self) -> None:
        self._fh.close()
        super().close()


def duration(seconds: float) -> str:
    """``1 h 02 min``, ``3 min 20 s`` or ``42 s``."""
    s = max(0, round(seconds))
    if s >= 3600:
        return f"{s // 3600} h {s % 3600 // 60:02d} min"
    if s >= 60:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s} s"


def progress_line(
    step: int, total: int, epoch: int, epochs: int, tokens: int, seconds: float, steps_run: int
) -> str:
    """One line of training progress: ``step`` of ``total`` done, ``steps_run`` of them (and
    ``tokens`` real tokens) in ``seconds`` by this process; the rest at the same pace."""
    rate = tokens / seconds if seconds > 0 else 0.0
    left = (total - step) * seconds / steps_run if steps_run else 0.0
    return (
        f"train: step {step}/{total} (epoch {epoch + 1}/{epochs}), {rate:,.0f} tokens/s, "
        f"{duration(seconds)} elapsed, about {duration(left)} left"
    )


class TrainingProgress:
    """Prints ``progress_line`` to stderr after the first step, then every ``every`` seconds
    and after the last step (host clock only: no wait for the GPU)."""

    def __init__(self, epochs: int, max_steps: int | None = None, every: float = 10.0, stream=None):
        self.epochs, self.max_steps, self.every = epochs, max_steps, every
        self.stream = stream
        self.total = max_steps or 0
        self.start = self.last = time.perf_counter()
        self.tokens = 0
        self.steps_run = 0

    def epoch_started(self, epoch: int, steps_before: int, steps_in_epoch: int) -> None:
        """The run's total, as if every epoch left had this one's steps (the sampler's packing,
        so the count, changes from epoch to epoch); at most ``max_steps``."""
        total = steps_before + (self.epochs - epoch) * steps_in_epoch
        self.total = min(total, self.max_steps) if self.max_steps is not None else total

    def step(self, step: int, epoch: int, tokens: int) -> None:
        """``step`` steps are done (the last one of ``epoch``, with ``tokens`` real tokens)."""
        import sys

        self.tokens += tokens
        self.steps_run += 1
        now = time.perf_counter()
        if self.steps_run > 1 and step < self.total and now - self.last < self.every:
            return
        self.last = now
        line = progress_line(
            step, self.total, epoch, self.epochs, self.tokens, now - self.start, self.steps_run
        )
        print(line, file=self.stream or sys.stderr, flush=True)


def stop_buffer_broadcast(ddp_model) -> None:
    """A DistributedDataParallel model no longer broadcasts its buffers before each forward
    (they were synced when it was built; torch's ``broadcast_buffers``)."""
    ddp_model.broadcast_buffers = False


def _keep(_event=None) -> None:
    """release() of a batch that owns its memory."""


class StreamingTrainer(Trainer):
    """speculators' Trainer with a step loop that never makes the host wait for the GPU.

    speculators' own loop synchronises every step (it builds metric tensors from Python
    numbers, a blocking copy) and copies each batch to the device just before using it, so the
    GPU idles while the host prepares the next step. Here the next batch is copied on a side
    stream while the current step runs, and metrics leave the device only on logging steps.
    The model's loss metrics run without their host syncs (``sync_free_eagle3``). Forward
    (autocast), loss, backward, gradient clipping, optimiser, scheduler, mid-epoch checkpoints,
    resume skipping and max_steps are speculators' own, unchanged.
    """

    data_wait_seconds = 0.0  # host time blocked waiting for the next batch (all epochs)
    loader_threads = 4  # threads building batches (train.loader_threads); 0: one, as before
    sync_free = True  # speculators' loss metrics without host syncs (sync_free_eagle3)

    progress: TrainingProgress | None = None
    # DDP re-sends the model's buffers from rank 0 before every forward (torch's default); the
    # draft's (t2d, d2t, rotary frequencies) never change after DDP's initial sync, so False
    # saves that per-step collective (bench/train.py variant ours_nobcast measures it)
    ddp_broadcast_buffers = True

    def _setup_model_ddp(self, load_checkpoint: bool):
        super()._setup_model_ddp(load_checkpoint)
        if not self.ddp_broadcast_buffers:
            stop_buffer_broadcast(self.model)

    def run_training(self):
        if self.rank == 0:
            self.progress = TrainingProgress(self.config.num_epochs, self.config.max_steps)
        with sync_free_eagle3() if self.sync_free else contextlib.nullcontext():
            return super().run_training()

    def setup_optimizer(self):
        """speculators' optimisers; on a GPU its AdamW runs as one fused kernel (same update)."""
        import speculators.train.trainer as st

        if not (torch.cuda.is_available() and self.config.optimizer == "adamw"):
            return super().setup_optimizer()

        def fused_adamw(model, config):
            params = model.named_parameters()
            return [
                torch.optim.AdamW(
                    params, lr=config.lr, weight_decay=config.weight_decay, fused=True
                )
            ]

        original, st.build_optimizers = st.build_optimizers, fused_adamw
        try:
            return super().setup_optimizer()
        finally:
            st.build_optimizers = original

    def _prefetched(self, loader, depth: int = 4):
        """(batch, release) of ``loader`` in order, built ahead in background threads.

        Without DataLoader workers, ``loader_threads`` threads build them
        (``batches.ThreadedBatches``: into reused pinned buffers, handed back by ``release``);
        with workers, or with ``loader_threads`` 0, one thread iterates the DataLoader."""
        if self.loader_threads and not loader.num_workers:
            from eagle3lib.batches import ThreadedBatches

            batches = iter(ThreadedBatches(loader, self.loader_threads))
        else:
            batches = self._one_thread(loader, depth)
        try:
            while True:
                t0 = time.perf_counter()
                item = next(batches, None)
                self.data_wait_seconds += time.perf_counter() - t0
                if item is None:
                    return
                yield item
        finally:
            batches.close()  # stops its threads now, also when the epoch ends early

    def _one_thread(self, loader, depth: int):
        """(batch, release) of ``loader``, iterated in one background thread (reading and
        collating overlap the step)."""
        import queue
        import threading

        q: queue.Queue = queue.Queue(maxsize=depth)
        done = object()
        stop = threading.Event()

        def produce():
            try:
                for batch in loader:
                    if stop.is_set():
                        return
                    q.put(batch)
            except BaseException as exc:  # re-raised in the training thread
                q.put(exc)
            q.put(done)

        thread = threading.Thread(target=produce, name="batch-prefetch", daemon=True)
        thread.start()
        try:
            while True:
                item = q.get()
                if item is done:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item, _keep
        finally:
            stop.set()
            while thread.is_alive():  # unblock the producer
                with contextlib.suppress(queue.Empty):
                    q.get_nowait()
                thread.join(timeout=0.05)

    def _device_batches(self, loader):
        """Yield (host batch, device batch); on CUDA batch k+1 is copied while k computes.
        A host batch's buffers go back to the loader once its step is done and its copy has
        completed (the event recorded after it)."""
        batches = self._prefetched(loader)
        try:
            yield from self._device_batches_of(batches)
        finally:
            batches.close()

    def _device_batches_of(self, batches):
        device = self.local_rank
        if not torch.cuda.is_available():
            for batch, release in batches:
                yield batch, batch
                release(None)
            return
        stream = torch.cuda.Stream()

        def move(batch):
            with torch.cuda.stream(stream):
                moved = {
                    k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                    for k, v in batch.items()
                }
                copied = torch.cuda.Event()
                copied.record(stream)
            return moved, copied

        def ready(moved):
            torch.cuda.current_stream().wait_stream(stream)
            for v in moved.values():
                if isinstance(v, torch.Tensor):
                    v.record_stream(torch.cuda.current_stream())
            return moved

        it = iter(batches)
        try:
            pending, pending_release = next(it)
        except StopIteration:
            return
        moved, copied = move(pending)
        for batch, release in it:
            current, current_release, current_copied = pending, pending_release, copied
            current_moved = ready(moved)
            pending, pending_release = batch, release
            moved, copied = move(batch)
            yield current, current_moved
            current_release(current_copied)
        yield pending, ready(moved)
        pending_release(copied)

    def train_epoch(self, epoch, *, step_callback=None):  # noqa: C901 - mirrors speculators'
        from speculators.train import trainer as st
        from speculators.train.recovery import RECOVERY_METADATA_KEY
        from speculators.train.utils import normalize_counted_metrics

        if self.config.max_steps is not None and self.global_step >= self.config.max_steps:
            return  # speculators would run one more step in every later epoch

        self.model.train()
        if hasattr(self.train_loader.batch_sampler, "set_epoch"):
            self.train_loader.batch_sampler.set_epoch(epoch)
        num_steps = len(self.train_loader)
        skip_steps = self._prepare_resume_skip(epoch)
        if self.progress is not None:
            self.progress.epoch_started(epoch, self.global_step - skip_steps, num_steps)
        loader = self.train_loader
        step_interval = (
            max(1, round(num_steps * self.config.checkpoint_freq))
            if self.config.checkpoint_freq < 1
            else None
        )
        interval_tokens, interval_start = 0, time.perf_counter()
        interval_wait = self.data_wait_seconds
        for local_step_rel, (batch, gpu_batch) in enumerate(self._device_batches(loader), 1):
            local_step = local_step_rel + skip_steps
            gpu_batch.pop(RECOVERY_METADATA_KEY, None)  # a rank's empty batch carries it
            tokens = int((batch["document_ids"] != -1).sum())
            interval_tokens += tokens
            with torch.autocast(self.device_type, dtype=self.config.hidden_states_dtype):
                _draft_tokens, loss, metrics = self.model(
                    **gpu_batch, **(self.config.train_call_kwargs or {})
                )
            self._optimizers_zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self._optimizers_step()
            current_lrs = {type(o).__name__: o.param_groups[0]["lr"] for o in self.optimizers}
            self._schedulers_step()

            if self.global_step % self.config.log_freq == 0:  # the only host sync
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                now = time.perf_counter()
                metrics["error_records_sum"] = torch.tensor(float(batch["error_records"]))
                metrics["error_records_total"] = torch.tensor(1.0 if self.rank == 0 else 0.0)
                if self.is_distributed:
                    metrics = st._all_reduce_metrics(  # noqa: SLF001
                        {k: v.to(loss.device) for k, v in metrics.items()}
                    )
                values = {k: v.item() for k, v in metrics.items()}
                world = st.dist.get_world_size() if self.is_distributed else 1
                values = normalize_counted_metrics(values, world)
                lrs = current_lrs if len(current_lrs) > 1 else next(iter(current_lrs.values()))
                st.metric_logger.info(
                    {
                        "train": values,
                        "profile": {
                            "tokens_per_s": interval_tokens / max(now - interval_start, 1e-9),
                            "data_wait_fraction": (self.data_wait_seconds - interval_wait)
                            / max(now - interval_start, 1e-9),
                        },
                        "epoch": epoch,
                        "lr": lrs,
                        "global_step": self.global_step,
                    },
                    extra={"step": self.global_step},
                )
                interval_tokens, interval_start = 0, now
                interval_wait = self.data_wait_seconds
            self.global_step += 1
            if self.progress is not None:
                self.progress.step(self.global_step, epoch, tokens)
            if step_callback is not None:
                step_callback()
            if self.config.max_steps is not None and self.global_step >= self.config.max_steps:
                break
            if (
                step_interval is not None
                and not self.config.save_best
                and local_step % step_interval == 0
                and num_steps - local_step >= step_interval * st.MIN_STEP_PCT
            ):
                self.maybe_save_checkpoint(epoch, local_step=local_step)


# ---- model and trainer -----------------------------------------------------------------------


def resolve_runtime(cfg) -> dict[str, Any]:
    """Attention, loss implementation and dtype for this machine."""
    cuda = torch.cuda.is_available()
    attention = cfg.attention
    if attention == "auto":
        attention = "simple_flex_attention" if cuda else "sdpa"
    elif attention == "simple_flex_attention" and not cuda:
        raise UserError(
            "config key train.attention: flex attention has no backward pass on CPU; "
            "use sdpa or eager (numerically equal) or auto"
        )
    if attention == "simple_flex_attention" and cfg.total_seq_len % 128:
        raise UserError(
            f"config key train.total_seq_len: {cfg.total_seq_len} is not a multiple of 128, "
            "which flex attention's block mask needs; use e.g. "
            f"{(cfg.total_seq_len // 128 + 1) * 128}"
        )
    loss = cfg.loss
    has_triton = False
    with contextlib.suppress(ImportError):
        import triton  # noqa: F401

        has_triton = True
    if loss == "auto":
        # speculators' fused loss crashes under torch < 2.13's compiler (pytorch issue 177600)
        new_torch = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 13)
        loss = "fused" if cuda and has_triton and new_torch else "eager"
    elif loss == "fused" and not (cuda and has_triton):
        raise UserError("config key train.loss: the fused loss needs a GPU and Triton; use eager")
    # bf16 autocast on GPU; fp32 on CPU, where torch then turns autocast off.
    dtype = torch.bfloat16 if cuda else torch.float32
    return {"attention": attention, "loss": loss, "dtype": dtype}


def build_draft(
    cfg, record: dict[str, Any], aux: list[int], vocab_map: dict[str, torch.Tensor], attention: str
):
    """Eagle3DraftModel exactly as speculators' CLI builds it for eagle3.

    speculators takes the shape and vocab size from the language model of the verifier
    (``text_config``); its embeddings, final norm and LM head are the tensors resolved from the
    verifier's architecture (``lm_weights``), not speculators' suffix search."""
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config

    from eagle3lib.lm_weights import speculators_reads
    from eagle3lib.verifier import load_config

    load_config(record)  # a trusted custom-code config must be readable without the flag
    verifier = record["load_path"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer_config = create_transformer_layer_config(
            verifier_name_or_path=verifier,
            num_layers=cfg.num_layers,
            draft_arch="llama",
            hidden_act="silu",
            sliding_window=cfg.sliding_window,
            full_attention_indices=list(cfg.full_attention_layers),
            trust_remote_code=record["trust_remote_code"],
        )
    with speculators_reads(record):
        model = Eagle3DraftModel.from_training_args(
            verifier_config=layer_config,
            t2d=vocab_map["t2d"],
            d2t=vocab_map["d2t"],
            verifier_name_or_path=verifier,
            target_layer_ids=aux,
            draft_vocab_size=cfg.draft_vocab_size,
            norm_before_residual=cfg.norm_before_residual,
            norm_before_fc=cfg.norm_before_fc,
            norm_output=cfg.norm_output,
            fc_norm=False,
            ttt_steps=cfg.ttt_steps,
            draft_attn_impl=attention,
            trust_remote_code=record["trust_remote_code"],
        )
    # The trainer's saved configs name the verifier portably (as the exported checkpoint
    # does), never a path into the run folder (a GGUF verifier's converted copy).
    model.config.speculators_config.verifier.name_or_path = record["name"]
    model.config.transformer_layer_config._name_or_path = ""  # noqa: SLF001
    return model


def save_state_losslessly(checkpointer) -> None:
    """Save resumable state in fp32 instead of speculators' bf16 (its landmine 19).

    speculators converts the weights and the whole optimiser state to bf16 when it saves, the
    Adam step counter included: the counter then rounds above 256 and a resumed run's weights
    and moments differ from the uninterrupted run's. fp32 holds every value the trainer keeps
    exactly (its weights and optimiser state are fp32 or bf16; bf16 compute is autocast), so a
    run killed and resumed ends with the bytes of one that was not. The exported checkpoint is
    still bf16 (checkpoint.export)."""
    checkpointer.save_checkpoint = functools.partial(
        checkpointer.save_checkpoint, float_dtype=torch.float32
    )


STAGING = ".staging"


def swap_in(new: Path, final: Path) -> None:
    """Replace the folder ``final`` by ``new``; a kill at any point leaves a whole checkpoint
    under ``final`` or under ``final.old`` (which recover_state_dir puts back)."""
    old = final.with_name(final.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    fsync_tree(new)  # the new checkpoint's bytes are on disk before it replaces the old one
    if final.exists():
        os.rename(final, old)
    os.rename(new, final)
    fsync_tree(final.parent, recursive=False)  # ...and so are the renames
    shutil.rmtree(old, ignore_errors=True)


def recover_state_dir(state_dir: Path) -> None:
    """Undo what a kill during a checkpoint save left: a half-written staging folder, or an
    epoch folder moved aside (``<epoch>.old``) whose replacement never arrived."""
    shutil.rmtree(state_dir / STAGING, ignore_errors=True)
    for old in state_dir.glob("*.old"):
        final = old.with_name(old.name.removesuffix(".old"))
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(old, final)


def save_checkpoints_atomically(trainer, rank: int) -> None:
    """speculators writes a checkpoint's files (weights, optimiser, scheduler, training state)
    in place into ``<state>/<epoch>/``, overwriting the epoch's previous mid-epoch checkpoint: a
    kill during that save would leave no usable checkpoint. Here each save goes to a staging
    folder first and is swapped in whole."""
    save = trainer.maybe_save_checkpoint
    checkpointer = trainer.checkpointer

    def atomic_save(epoch, local_step: int = 0):
        root = checkpointer.path
        staging = root / STAGING
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        checkpointer.path = staging
        try:
            save(epoch, local_step=local_step)
        finally:
            checkpointer.path = root
        if rank == 0:
            if (staging / str(epoch)).is_dir():
                swap_in(staging / str(epoch), root / str(epoch))
            shutil.rmtree(staging, ignore_errors=True)

    trainer.maybe_save_checkpoint = atomic_save


def with_loader_threads(cfg, configured: int | None, threads: int, processes: int):
    """``cfg`` with ``configured`` loader threads (None: its own), at most what each of
    ``processes`` gets of ``threads`` granted (0: no limit) besides its training thread, and at
    least 1 unless 0 is configured (one thread running speculators' collate)."""
    import dataclasses

    n = cfg.loader_threads if configured is None else configured
    if n and threads:
        n = max(1, min(n, threads // max(processes, 1) - 1))
    return dataclasses.replace(cfg, loader_threads=n)


# train.* keys that do not change what is trained (its state stays resumable when they change)
RESOURCE_KEYS = ("gpus", "checkpoint_freq", "loader_threads")


def train(
    cfg,
    record: dict[str, Any],
    shard_paths: Sequence[Path],
    manifest_paths: Sequence[Path],
    vocab_map: dict[str, torch.Tensor],
    state_dir: Path,
    metrics_path: Path,
    trainer_class: type[Trainer] | None = None,
) -> dict[str, Any]:
    """Train; return the epoch directory of the final checkpoint and run statistics.

    ``trainer_class`` defaults to StreamingTrainer; speculators' own Trainer also works.
    """
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.cli import set_seed
    from speculators.train.trainer import TrainerConfig

    manifests = [read_json(p) for p in manifest_paths]
    layer_ids = manifests[0]["layer_ids"]
    aux = layer_ids[:-1]
    # Every shard must come from this verifier, with the same layers, hidden size and storage.
    state_dtype = manifests[0].get("state_dtype")
    expect = {
        "verifier": identity(record),
        "layer_ids": layer_ids,
        "hidden_size": record["hidden_size"],
        "state_dtype": state_dtype,
    }
    storage = "fp8" if state_dtype == "float8_e4m3fn" else "bf16"
    k = int(vocab_map["d2t"].numel())
    if k != cfg.draft_vocab_size:
        raise UserError(
            f"vocab map has {k} draft tokens but train.draft_vocab_size is {cfg.draft_vocab_size}"
        )
    shards = open_verified_shards(shard_paths, manifest_paths, expect)
    train_pairs, val_pairs = split_indices(shards, cfg.val_fraction)
    runtime = resolve_runtime(cfg)

    # how often state is saved, on how many GPUs and by how many loader threads do not change
    # what is trained; speculators' packing is left out as before the option existed
    trained = {k_: v for k_, v in vars(cfg).items() if k_ not in RESOURCE_KEYS}
    if trained["packing"] == "multipack":
        del trained["packing"]
    fingerprint = {
        "train": trained,
        "shards": [m["file"]["sha256"] for m in manifests],
        "vocab": sha256_json(vocab_map["d2t"].tolist()),
        "runtime": {"attention": runtime["attention"], "loss": runtime["loss"]},
    }
    rank = setup_distributed()
    resumed = fingerprinted_dir(state_dir, fingerprint) if rank == 0 else None
    if rank == 0:
        recover_state_dir(state_dir)
    barrier()

    set_seed(cfg.seed)
    dtype = runtime["dtype"]
    model = build_draft(cfg, record, aux, vocab_map, runtime["attention"])
    if storage == "fp8":  # dequantized on the device, inside the input pipeline
        model.register_forward_pre_hook(fp8_inputs(dtype), with_kwargs=True)
    hidden = record["hidden_size"]
    train_loader = make_loader(
        ShardDataset(shard_paths, train_pairs, cfg.total_seq_len, dtype, storage),
        cfg.total_seq_len,
        hidden,
        len(aux),
        cfg.seed,
        cfg.loader_workers,
        cfg.packing,
    )
    # Validation is packed with seed 0, as speculators' CLI does: the same batches for every
    # seed, so validation losses compare across runs and with the CLI's.
    val_loader = make_loader(
        ShardDataset(shard_paths, val_pairs, cfg.total_seq_len, dtype, storage),
        cfg.total_seq_len,
        hidden,
        len(aux),
        0,
        cfg.loader_workers,
    )
    train_kwargs, val_kwargs = Eagle3DraftModel.get_trainer_kwargs(
        loss_fn="kl_div",
        loss_implementation=runtime["loss"],
        ttt_steps=cfg.ttt_steps,
        ttt_step_loss_decay=cfg.ttt_step_loss_decay,
    )
    trainer_config = TrainerConfig(
        lr=cfg.lr,
        num_epochs=cfg.epochs,
        save_path=str(state_dir),
        resume_from_checkpoint=True,
        train_call_kwargs=train_kwargs,
        val_call_kwargs=val_kwargs,
        optimizer=cfg.optimizer,
        weight_decay=cfg.weight_decay,
        muon_lr=cfg.lr,
        scheduler_type=cfg.scheduler,
        scheduler_warmup_ratio=cfg.warmup_ratio,
        hidden_states_dtype=dtype,
        log_freq=cfg.log_every,
        max_steps=cfg.max_steps,
        checkpoint_freq=cfg.checkpoint_freq,
        fsdp_shard=cfg.fsdp,
    )
    recorder = MetricsRecorder(metrics_path) if rank == 0 else logging.NullHandler()
    metric_logger = logging.getLogger("speculators.metrics")
    metric_logger.addHandler(recorder)
    metric_logger.setLevel(logging.INFO)
    t0 = time.perf_counter()
    try:
        with cpu_trainer_patches():
            trainer_cls = trainer_class or StreamingTrainer
            trainer = trainer_cls(model, trainer_config, train_loader, val_loader)
            if isinstance(trainer, StreamingTrainer):
                trainer.loader_threads = cfg.loader_threads
            save_state_losslessly(trainer.checkpointer)
            save_checkpoints_atomically(trainer, rank)
            if torch.accelerator.current_accelerator() is None:
                trainer.device_type = "cpu"
            trainer.run_training()
    finally:
        metric_logger.removeHandler(recorder)
        recorder.close()
    seconds = time.perf_counter() - t0
    barrier()
    final = last_epoch_dir(state_dir)
    if final is None:
        raise UserError(f"training finished without a checkpoint in {state_dir}")
    train_tokens = sum(int(shards[s].offsets[i + 1] - shards[s].offsets[i]) for s, i in train_pairs)
    return {
        "final_epoch_dir": str(final),
        "resumed": resumed,
        "seconds": seconds,
        "train_samples": len(train_pairs),
        "val_samples": len(val_pairs),
        "train_tokens_per_epoch": train_tokens,
        "aux_layer_ids": aux,
        "attention": runtime["attention"],
        "loss_implementation": runtime["loss"],
        "dtype": str(dtype).removeprefix("torch."),
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "optimizers": [type(o).__name__ for o in trainer.optimizers],
        "processes": world_size(),
        "fsdp": bool(cfg.fsdp and world_size() > 1),
        "rank": rank,
        "data_wait_fraction": getattr(trainer, "data_wait_seconds", 0.0) / seconds
        if seconds
        else None,
    }


def setup_distributed() -> int:
    """Join the torchrun process group if launched by torchrun; return this rank.

    On GPUs this is speculators' own set-up (NCCL, one device per local rank); on CPU (tests)
    a gloo group fills the same topology state speculators' trainer and sampler read.
    """
    import os

    from speculators.train import distributed as sd

    if "LOCAL_RANK" not in os.environ or sd.is_distributed():
        return sd.get_rank()
    if torch.accelerator.current_accelerator() is not None:
        sd.maybe_setup_distributed()
        return sd.get_rank()
    import torch.distributed as dist

    dist.init_process_group("gloo")
    sd._local_rank = int(os.environ["LOCAL_RANK"])  # noqa: SLF001
    sd._is_distributed = True  # noqa: SLF001
    sd._rank, sd._world_size = dist.get_rank(), dist.get_world_size()  # noqa: SLF001
    sd._init_sp_process_groups(sd._rank, sd._world_size, 1)  # noqa: SLF001
    return sd._rank  # noqa: SLF001


def distributed_rank() -> int:
    from speculators.train import distributed as sd

    return sd.get_rank()


def world_size() -> int:
    from speculators.train import distributed as sd

    return sd.get_world_size()


def barrier() -> None:
    from speculators.train import distributed as sd

    if sd.is_distributed():
        import torch.distributed as dist

        dist.barrier()


def teardown_distributed() -> None:
    from speculators.train import distributed as sd

    sd.maybe_destroy_distributed()


def last_epoch_dir(state_dir: Path) -> Path | None:
    """speculators' newest epoch checkpoint folder (``<state>/<epoch>/model.safetensors``)."""
    epochs = [
        int(d.name)
        for d in state_dir.iterdir()
        if d.is_dir()
        and not d.is_symlink()
        and d.name.isdigit()
        and (d / "model.safetensors").exists()
    ]
    return state_dir / str(max(epochs)) if epochs else None


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# Two trainers on the same batches, same seed and recipe, in bf16 autocast on a GPU: their
# per-step losses may differ this much (relative). bf16 keeps 8 significant bits (a relative
# step of 2^-8 = 0.39 %), ours steps AdamW as one fused kernel (speculators: foreach), and
# small differences grow over the steps. A skipped batch or another learning rate must move
# the losses by more: tests/test_train.py checks both on CPU (fp32, where ours is exact),
# bench/train.py --same-training twice the lr on a GPU. Not yet measured on a GPU.
SAME_TRAINING_BF16_RTOL = 0.01


def max_relative_difference(reference: Sequence[float], other: Sequence[float]) -> float:
    """The largest |other - reference| / |reference| over the steps both have (each must have
    at least one)."""
    n = min(len(reference), len(other))
    if n == 0:
        raise ValueError("no common steps to compare")
    return max(abs(b - a) / abs(a) for a, b in zip(reference[:n], other[:n], strict=True))


def loss_curves(metrics: list[dict[str, Any]]) -> dict[str, list]:
    """Per-step training loss and per-epoch validation loss/accuracy from the recorded logs.

    A resumed run logs again the steps after its last checkpoint: the later record wins."""
    train_loss, val = {}, {}
    for m in metrics:
        if "train" in m and "loss" in m["train"]:
            train_loss[m.get("global_step")] = m["train"]["loss"]
        if "val" in m:
            val[m.get("epoch")] = {"epoch": m.get("epoch"), **m["val"]}
    steps = sorted(train_loss)
    return {
        "step": steps,
        "train_loss": [train_loss[s] for s in steps],
        "val": [val[e] for e in sorted(val)],
    }
