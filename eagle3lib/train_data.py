"""Training data from shards: the verified shards, the train/validation split, speculators'
dataset contract served from the shard files (bf16 or fp8), and the DataLoader speculators'
CLI builds over them."""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from speculators.train.data import BaseDataset

from eagle3lib.distributed import launched_rank
from eagle3lib.errors import UserError
from eagle3lib.fileio import read_json
from eagle3lib.shards import Shard, check_manifest, check_shard, dequantize_fp8, open_shard

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
        # (this runs before the process group is joined: the rank torchrun gave)
        checks.append((path, manifest, Path(manifest_path), key))

    def check(item) -> UserError | None:
        path, manifest, _, key = item
        try:
            check_shard(path, manifest, full_hash=key not in _VERIFIED and launched_rank() == 0)
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
    if launched_rank() == 0:  # hashed here
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


def stop_workers(*loaders) -> None:
    """Stop the worker processes of ``loaders`` (persistent ones live as long as the loader's
    iterator): otherwise they outlive the training until the process exits, and a moment
    after it, when the job's GPU wrapper finds them running and the report flags the job.
    torch keeps them in the loader's ``_iterator`` and stops them in its ``_shutdown_workers``
    (what the iterator's ``__del__`` calls); a loader without workers has nothing to stop."""
    for loader in loaders:
        iterator = getattr(loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
            loader._iterator = None


# ---- CPU support -----------------------------------------------------------------------------
