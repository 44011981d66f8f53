"""Train the EAGLE-3 draft with speculators' Eagle3DraftModel and Trainer, from our shards.

speculators does the modelling, the loss, TTT, the optimiser, scheduling and checkpointing;
this module supplies a Dataset that reads the shards memory-mapped, builds the model the way
speculators' CLI does, and makes the trainer work on a CPU-only machine (its landmines 3, 4, 7
and 8 in reference/speculators.md) without touching its GPU path.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from eagle3lib.errors import UserError
from eagle3lib.fileio import read_json, sha256_json, write_json
from eagle3lib.hidden_states import Shard, check_manifest, check_shard, open_shard
from eagle3lib.verifier import identity

STATE_CONFIG = "eagle3lib_train_config.json"


# ---- data ------------------------------------------------------------------------------------


def open_verified_shards(
    shard_paths: Sequence[Path], manifest_paths: Sequence[Path], expect: dict[str, Any]
) -> list[Shard]:
    """Open every shard after checking it against its manifest (size, hash, what made it)."""
    shards = []
    for shard_path, manifest_path in zip(shard_paths, manifest_paths, strict=True):
        manifest = read_json(manifest_path)
        check_manifest(manifest, expect, str(manifest_path))
        check_shard(Path(shard_path), manifest)
        shards.append(open_shard(Path(shard_path)))
    return shards


def split_indices(
    shards: Sequence[Shard], val_fraction: float
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(shard, sample) pairs of valid samples; the last ``val_fraction`` is validation."""
    pairs = [(s, i) for s, shard in enumerate(shards) for i in range(len(shard)) if shard.valid[i]]
    if len(pairs) < 2:
        raise UserError(
            f"only {len(pairs)} usable sample(s) in the shards; training needs at least 2 "
            "(raise data.train.max_samples)"
        )
    n_val = min(len(pairs) - 1, max(1, round(len(pairs) * val_fraction)))
    return pairs[:-n_val], pairs[-n_val:]


def _base_dataset():
    from speculators.train.data import BaseDataset

    return BaseDataset


class ShardDataset(_base_dataset()):
    """speculators' dataset contract (hidden_states [T, aux*H], verifier_last_hidden_states,
    input_ids, loss_mask) served from shard files, one mmap per shard and no per-sample opens."""

    def __init__(self, shard_paths: Sequence[Path], pairs, max_len: int, dtype: torch.dtype):
        self.shard_paths = [Path(p) for p in shard_paths]
        self.pairs = list(pairs)
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
        states = item["hidden_states"].to(self.hidden_states_dtype)
        return {
            "hidden_states": states[:, :-1].flatten(1),
            "input_ids": item["input_ids"],
            "verifier_last_hidden_states": states[:, -1],
            "loss_mask": item["loss_mask"],
        }


def make_loader(dataset, total_seq_len: int, hidden_size: int, n_aux: int, seed: int):
    """The DataLoader speculators' CLI builds: multipack sampler, CollateFn with shift_batch."""
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn
    from speculators.train.distributed import get_dp_rank, get_dp_size
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2
    from torch.utils.data import DataLoader

    sampler = MultipackDistributedBatchSamplerV2(
        batch_max_length=total_seq_len,
        lengths=dataset.approx_lengths,
        num_replicas=get_dp_size(),
        rank=get_dp_rank(),
        seed=seed,
    )
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=0,
        pin_memory=torch.cuda.is_available(),
        collate_fn=CollateFn(
            total_seq_len,
            hidden_size,
            num_target_layers=n_aux,
            dtype=dataset.hidden_states_dtype,
            preprocess=shift_batch,
        ),
    )


# ---- CPU support -----------------------------------------------------------------------------


@contextlib.contextmanager
def cpu_trainer_patches() -> Iterator[None]:
    """Let speculators' Trainer run without an accelerator (no-op when one is present).

    - Trainer moves the model to ``get_local_rank()`` (device 0) -> "cpu";
    - its step timer calls ``torch.accelerator.synchronize()`` -> skipped;
    - the checkpointer loads resume state onto "cuda:0" -> "cpu".
    """
    if torch.accelerator.current_accelerator() is not None:
        yield
        return
    from speculators.train import checkpointer, trainer

    class CpuStepTimer(trainer._StepTimer):  # noqa: SLF001
        def mark(self, name: str) -> None:
            if self.enabled:
                self._marks[name] = time.perf_counter()

        def now(self) -> float | None:
            return time.perf_counter() if self.enabled else None

    saved = (trainer.get_local_rank, trainer._StepTimer, checkpointer.get_current_device)  # noqa: SLF001
    trainer.get_local_rank = lambda: "cpu"
    trainer._StepTimer = CpuStepTimer  # noqa: SLF001
    checkpointer.get_current_device = lambda: "cpu"
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype")
            yield
    finally:
        trainer.get_local_rank, trainer._StepTimer, checkpointer.get_current_device = saved  # noqa: SLF001


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
    loss = cfg.loss
    has_triton = False
    with contextlib.suppress(ImportError):
        import triton  # noqa: F401

        has_triton = True
    if loss == "auto":
        loss = "fused" if cuda and has_triton else "eager"
    elif loss == "fused" and not (cuda and has_triton):
        raise UserError("config key train.loss: the fused loss needs a GPU and Triton; use eager")
    # bf16 autocast on GPU; plain fp32 on CPU (CPUs without bf16 units are ~2x slower in bf16).
    dtype = torch.bfloat16 if cuda else torch.float32
    return {"attention": attention, "loss": loss, "dtype": dtype}


def build_draft(
    cfg, record: dict[str, Any], aux: list[int], vocab_map: dict[str, torch.Tensor], attention: str
):
    """Eagle3DraftModel exactly as speculators' CLI builds it for eagle3."""
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config

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
    return Eagle3DraftModel.from_training_args(
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


def prepare_state_dir(state_dir: Path, fingerprint: dict[str, Any]) -> bool:
    """Keep ``state_dir`` (resume) only if it was made by the same inputs; return resumed?"""
    marker = state_dir / STATE_CONFIG
    digest = sha256_json(fingerprint)
    if marker.exists() and read_json(marker).get("sha256") == digest:
        return True
    if state_dir.exists():
        shutil.rmtree(state_dir)
    state_dir.mkdir(parents=True)
    write_json(marker, {"sha256": digest, "fingerprint": fingerprint})
    return False


def train(
    cfg,
    record: dict[str, Any],
    shard_paths: Sequence[Path],
    manifest_paths: Sequence[Path],
    vocab_map: dict[str, torch.Tensor],
    state_dir: Path,
    metrics_path: Path,
) -> dict[str, Any]:
    """Train; return the epoch directory of the final checkpoint and run statistics."""
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.cli import set_seed
    from speculators.train.trainer import Trainer, TrainerConfig

    manifests = [read_json(p) for p in manifest_paths]
    layer_ids = manifests[0]["layer_ids"]
    aux = layer_ids[:-1]
    # Every shard must come from this verifier, with the same layers and hidden size.
    expect = {
        "verifier": identity(record),
        "layer_ids": layer_ids,
        "hidden_size": record["hidden_size"],
    }
    k = int(vocab_map["d2t"].numel())
    if k != cfg.draft_vocab_size:
        raise UserError(
            f"vocab map has {k} draft tokens but train.draft_vocab_size is {cfg.draft_vocab_size}"
        )
    shards = open_verified_shards(shard_paths, manifest_paths, expect)
    train_pairs, val_pairs = split_indices(shards, cfg.val_fraction)
    runtime = resolve_runtime(cfg)

    fingerprint = {
        "train": {k_: v for k_, v in vars(cfg).items() if k_ != "gpus"},
        "shards": [m["file"]["sha256"] for m in manifests],
        "vocab": sha256_json(vocab_map["d2t"].tolist()),
        "runtime": {"attention": runtime["attention"], "loss": runtime["loss"]},
    }
    resumed = prepare_state_dir(state_dir, fingerprint)

    set_seed(cfg.seed)
    dtype = runtime["dtype"]
    model = build_draft(cfg, record, aux, vocab_map, runtime["attention"])
    hidden = record["hidden_size"]
    train_loader = make_loader(
        ShardDataset(shard_paths, train_pairs, cfg.total_seq_len, dtype),
        cfg.total_seq_len,
        hidden,
        len(aux),
        cfg.seed,
    )
    val_loader = make_loader(
        ShardDataset(shard_paths, val_pairs, cfg.total_seq_len, dtype),
        cfg.total_seq_len,
        hidden,
        len(aux),
        cfg.seed,
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
        log_freq=1,
    )
    recorder = MetricsRecorder(metrics_path)
    metric_logger = logging.getLogger("speculators.metrics")
    metric_logger.addHandler(recorder)
    metric_logger.setLevel(logging.INFO)
    t0 = time.perf_counter()
    try:
        with cpu_trainer_patches():
            trainer = Trainer(model, trainer_config, train_loader, val_loader)
            if torch.accelerator.current_accelerator() is None:
                trainer.device_type = "cpu"
            trainer.run_training()
    finally:
        metric_logger.removeHandler(recorder)
        recorder.close()
    seconds = time.perf_counter() - t0
    final = state_dir / str(cfg.epochs - 1)
    if not (final / "model.safetensors").exists():
        raise UserError(f"training finished without a checkpoint in {final}")
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
    }


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def loss_curves(metrics: list[dict[str, Any]]) -> dict[str, list]:
    """Per-step training loss and per-epoch validation loss/accuracy from the recorded logs."""
    steps, losses, val = [], [], []
    for m in metrics:
        if "train" in m and "loss" in m["train"]:
            steps.append(m.get("global_step"))
            losses.append(m["train"]["loss"])
        if "val" in m:
            val.append({"epoch": m.get("epoch"), **m["val"]})
    return {"step": steps, "train_loss": losses, "val": val}
