"""Train the EAGLE-3 draft with speculators' Eagle3DraftModel and Trainer, from our shards.

speculators does the modelling, the loss, TTT, the optimiser, scheduling and checkpointing;
this module builds the model the way speculators' CLI does, runs its trainer
(``StreamingTrainer`` by default) on the shards (``train_data``), keeps its saved state whole
across kills, and reads back the metrics it logged. What is changed in speculators, for a
CPU-only machine and for exact resumption, is in ``speculators_compat``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from speculators.train.trainer import Trainer

from eagle3lib.distributed import barrier, ranks_agree, setup_distributed, world_size
from eagle3lib.errors import UserError
from eagle3lib.fileio import fingerprinted_dir, fsync_tree, read_json, sha256_json
from eagle3lib.graphed_step import decide as decide_graph_step
from eagle3lib.lifetime import Phases
from eagle3lib.speculators_compat import cpu_trainer_patches, speculators_patches
from eagle3lib.streaming_trainer import (
    PhaseClock,
    StreamingTrainer,
    starved_line,
    thread_schedstat,
    thread_shares,
)
from eagle3lib.train_data import (
    ShardDataset,
    fp8_inputs,
    make_loader,
    open_verified_shards,
    split_indices,
    stop_workers,
)
from eagle3lib.verifier import allow_recompiles, compile_fallbacks, identity


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


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


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
    if loss == "auto":
        # the eager loss: every GPU figure of this project was measured with it, the graphed
        # step among them; speculators' fused Triton loss (its own default) was not, since it
        # crashes under torch < 2.13's compiler (https://github.com/pytorch/pytorch/issues/177600),
        # the torch of those GPU runs (2.11), older than the 2.13 this workflow installs
        loss = "eager"
    elif loss == "fused" and not (cuda and _has_triton()):
        raise UserError("config key train.loss: the fused loss needs a GPU and Triton; use eager")
    elif loss == "fused" and tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 13):
        raise UserError(
            f"config key train.loss: the fused loss crashes under torch {torch.__version__}'s "
            "compiler (https://github.com/pytorch/pytorch/issues/177600); use eager, or torch "
            "2.13 or later"
        )
    # bf16 autocast on GPU; fp32 on CPU, where torch then turns autocast off.
    dtype = torch.bfloat16 if cuda else torch.float32
    return {"attention": attention, "loss": loss, "dtype": dtype}


def draft_recompile_limit(num_layers: int) -> int:
    """Compilations of the decoder layer's call that training and validation may need.

    speculators compiles the draft's forward, but its graph breaks at every TTT step (flex
    attention's ``extend_mask_for_draft_tokens`` is kept out of the compiler) and inside the
    first decoder layer (a ``graph_break()`` speculators puts there under torch >= 2.10,
    https://github.com/pytorch/pytorch/issues/175250). Dynamo then compiles the decoder layers'
    shared ``__call__`` frame on its own, again for each layer and variant of shape, grad mode
    and training flag (measured on the CPU: 6 entries for two layers, 11 for three). Past
    dynamo's default limit of 8 a three-layer draft's validation ran uncompiled on the H200,
    94-112 s an epoch instead of 5-7 s (BENCHMARKS.md)."""
    return 8 * num_layers + 8


def build_draft(
    cfg,
    record: dict[str, Any],
    aux: list[int],
    vocab_map: dict[str, torch.Tensor],
    attention: str,
    device: torch.device | None = None,
):
    """Eagle3DraftModel exactly as speculators' CLI builds it for eagle3, on ``device`` (the
    CPU's by default, as the CLI does).

    speculators takes the shape and vocab size from the language model of the verifier
    (``text_config``); its embeddings, final norm and LM head are the tensors resolved from the
    verifier's architecture (``lm_weights``), not speculators' suffix search. speculators draws
    random values for every parameter, the embeddings and both LM heads too (then replaced by
    the verifier's): for an 8B verifier's one-layer draft that took 13.6 of build_draft's 16.3
    s on a 2-core CPU (AMD EPYC), on the CPU's one-thread generator; a GPU draws them in
    milliseconds. Its draws differ from the CPU's, so a draft built there starts from other
    random layers than the CLI's (the same for the same seed on the same GPU model)."""
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
    with speculators_reads(record), torch.device(device or "cpu"):
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


def draft_device(cfg) -> torch.device | None:
    """Where the train job builds the draft: on this rank's GPU (the trainer moves it there
    anyway), except under FSDP, whose set-up shards a model built on the CPU; None: the CPU."""
    if not torch.cuda.is_available() or (cfg.fsdp and world_size() > 1):
        return None
    return torch.device("cuda", torch.cuda.current_device())


STAGING = ".staging"  # where a checkpoint is written before it is swapped in
PRUNING = ".pruning-"  # an older epoch's state being removed (prune_states)


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


def states_to_add(epochs_left: int, keep: int, kept_now: int) -> int:
    """How many more epoch states the disk must hold at once than the ``kept_now`` on it:
    every epoch's still to be saved (``keep`` 0, train.keep_states), or, keeping the newest
    ``keep`` and the best one (``prune_states``), as many as bring them up to ``keep`` + 1 and
    one more, the state staged before the oldest is removed."""
    if epochs_left <= 0:
        return 0
    if keep == 0:
        return epochs_left
    return min(epochs_left, max(keep + 1 - kept_now, 0) + 1)


def disk_warning(
    state_bytes: int, free_bytes: int, epochs_left: int, where: Path, keep: int = 0,
    kept_now: int = 1,
) -> str | None:  # fmt: skip
    """A line for the log when the epochs still to be saved will not fit on the disk: each
    state takes ``state_bytes`` (the last one saved), ``free_bytes`` are left at ``where``,
    and the newest ``keep`` states and the best one stay (0: all; ``states_to_add``); None
    when they fit (or none are left)."""
    more = states_to_add(epochs_left, keep, kept_now)
    need = state_bytes * more
    if more == 0 or free_bytes >= need:
        return None
    saved = (
        f"{epochs_left} more are to be saved ({need / 1e9:.3g} GB)"
        if more == epochs_left
        else f"{epochs_left} more are to be saved, keeping the newest {keep} (room for {more} "
        f"more at once: {need / 1e9:.3g} GB)"
    )
    return (
        f"train: warning: an epoch's state takes {state_bytes / 1e9:.3g} GB and {saved}, but "
        f"{where} has {free_bytes / 1e9:.3g} GB free: free disk space before then, or the job "
        "stops at a full disk (a rerun resumes from the last state saved)"
    )


def recover_state_dir(state_dir: Path) -> None:
    """Undo what a kill during a checkpoint save left: a half-written staging folder, or an
    epoch folder moved aside (``<epoch>.old``) whose replacement never arrived."""
    shutil.rmtree(state_dir / STAGING, ignore_errors=True)
    for going in state_dir.glob(PRUNING + "*"):  # an older state whose removal was cut short
        shutil.rmtree(going, ignore_errors=True)
    for old in state_dir.glob("*.old"):
        final = old.with_name(old.name.removesuffix(".old"))
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(old, final)


def with_loader_threads(cfg, configured: int | None, threads: int, processes: int):
    """``cfg`` with ``configured`` loader threads (None: its own), at most what each of
    ``processes`` gets of ``threads`` granted (0: no limit) besides its training thread, and at
    least 1 unless 0 is configured (one thread running speculators' collate)."""
    n = cfg.loader_threads if configured is None else configured
    if n and threads:
        n = max(1, min(n, threads // max(processes, 1) - 1))
    return dataclasses.replace(cfg, loader_threads=n)


# train.* keys that do not change what is trained (its state stays resumable when they change)
RESOURCE_KEYS = (
    "gpus", "checkpoint_freq", "keep_states", "loader_threads", "loader_workers", "graph_step",
)  # fmt: skip


def _expected_shards(manifests: list[dict], record: dict[str, Any]) -> dict[str, Any]:
    """What every shard's manifest must say: made from this verifier, with the first shard's
    layers and storage and the verifier's hidden size."""
    return {
        "verifier": identity(record),
        "layer_ids": manifests[0]["layer_ids"],
        "hidden_size": record["hidden_size"],
        "state_dtype": manifests[0].get("state_dtype"),
    }


def with_newton_schulz(trainer_class: type, newton_schulz: str) -> type:
    """``trainer_class`` orthogonalising as train.newton_schulz says: a subclass setting it
    where a StreamingTrainer says otherwise (its optimisers are built in its constructor);
    speculators' own Trainer as it is."""
    if not issubclass(trainer_class, StreamingTrainer):
        return trainer_class
    if trainer_class.newton_schulz == newton_schulz:
        return trainer_class
    return type(trainer_class.__name__, (trainer_class,), {"newton_schulz": newton_schulz})


def muon_layout(cfg, trainer_class) -> str | None:
    """How the run splits speculators' Muon (``muon.gpu_optimizers``, on a GPU where the
    trainer batches it), or None where it runs as speculators builds it."""
    from eagle3lib.muon import BATCH_MAX_ELEMENTS

    batched = getattr(trainer_class, "batched_muon", False) and torch.cuda.is_available()
    if cfg.optimizer != "muon" or not batched:
        return None
    gram = ", large wide ones by Gram Newton-Schulz" if cfg.newton_schulz == "gram" else ""
    return f"batched up to {BATCH_MAX_ELEMENTS} elements{gram}"


def _fingerprint(
    cfg, manifests: list[dict], vocab_map: dict, runtime: dict, layout: str | None = None
) -> dict[str, Any]:
    """What the trained state depends on: a state folder made with another is not resumed.
    How often state is saved, on how many GPUs and by how many loader threads or DataLoader
    workers (the same batches) do not change what is trained; speculators' packing is left
    out as before the option existed.
    ``layout`` (``muon_layout``): the saved optimiser state's layout where it is not
    speculators' (a mixed draft's has one optimiser more), so a folder of the other layout
    starts afresh instead of failing to load."""
    trained = {k: v for k, v in vars(cfg).items() if k not in RESOURCE_KEYS}
    # recorded at its default, as folders saved before it was a resource key did (the usual
    # 0): those resume too, after the train rule's command changed
    trained["loader_workers"] = 0
    trained.pop("newton_schulz", None)  # in ``layout`` where it applies (a GPU)
    if trained["packing"] == "multipack":
        del trained["packing"]
    fingerprint = {
        "train": trained,
        "shards": [m["file"]["sha256"] for m in manifests],
        "vocab": sha256_json(vocab_map["d2t"].tolist()),
        "runtime": {"attention": runtime["attention"], "loss": runtime["loss"]},
    }
    if layout is not None:
        fingerprint["runtime"]["muon"] = layout
    return fingerprint


def _loaders(cfg, shard_paths, pairs: tuple[list, list], hidden: int, n_aux: int, dtype, storage):
    """The train and validation DataLoaders. Validation is packed by speculators' multipack
    sampler with seed 0, as its CLI does: the same batches for every seed and train.packing,
    so validation losses compare across runs and with the CLI's."""
    train_pairs, val_pairs = pairs
    seq = cfg.total_seq_len
    train_loader = make_loader(
        ShardDataset(shard_paths, train_pairs, seq, dtype, storage),
        seq, hidden, n_aux, cfg.seed, cfg.loader_workers, cfg.packing,
    )  # fmt: skip
    val_loader = make_loader(
        ShardDataset(shard_paths, val_pairs, seq, dtype, storage),
        seq, hidden, n_aux, 0, cfg.loader_workers, "multipack",
    )  # fmt: skip
    return train_loader, val_loader


def _trainer_config(cfg, state_dir: Path, runtime: dict[str, Any]):
    """speculators' TrainerConfig for ``cfg``: its kl_div loss with TTT, resuming from
    ``state_dir``."""
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.trainer import TrainerConfig

    train_kwargs, val_kwargs = Eagle3DraftModel.get_trainer_kwargs(
        loss_fn="kl_div",
        loss_implementation=runtime["loss"],
        ttt_steps=cfg.ttt_steps,
        ttt_step_loss_decay=cfg.ttt_step_loss_decay,
    )
    return TrainerConfig(
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
        hidden_states_dtype=runtime["dtype"],
        log_freq=cfg.log_every,
        max_steps=cfg.max_steps,
        checkpoint_freq=cfg.checkpoint_freq,
        fsdp_shard=cfg.fsdp,
    )


def _run_trainer(trainer_cls, model, trainer_config, loaders, cfg, rank: int, metrics_path):
    """Build the trainer and run it, its metrics recorded (rank 0) in ``metrics_path``; its
    saved state is fp32 and swapped in whole (``speculators_compat``). Returns the trainer."""
    recorder = MetricsRecorder(metrics_path) if rank == 0 else logging.NullHandler()
    metric_logger = logging.getLogger("speculators.metrics")
    metric_logger.addHandler(recorder)
    metric_logger.setLevel(logging.INFO)
    try:
        with cpu_trainer_patches():
            trainer = trainer_cls(model, trainer_config, *loaders)
            if isinstance(trainer, StreamingTrainer):
                trainer.loader_threads = cfg.loader_threads
                trainer.graph_step = cfg.graph_step
            if torch.accelerator.current_accelerator() is None:
                trainer.device_type = "cpu"
            with speculators_patches(
                "fp32_state", "staged_saves",
                checkpointer=trainer.checkpointer, trainer=trainer, rank=rank,
                keep_states=cfg.keep_states,
            ):  # fmt: skip
                trainer.phase_clock = PhaseClock()
                with trainer.phase_clock.timing(trainer):
                    trainer.run_training()
    finally:
        metric_logger.removeHandler(recorder)
        recorder.close()
        stop_workers(*loaders)
    return trainer


def train(
    cfg,
    record: dict[str, Any],
    shard_paths: Sequence[Path],
    manifest_paths: Sequence[Path],
    vocab_map: dict[str, torch.Tensor],
    state_dir: Path,
    metrics_path: Path,
    trainer_class: type[Trainer] | None = None,
    phases: Phases | None = None,
) -> dict[str, Any]:
    """Train; return the epoch directory of the final checkpoint and run statistics.

    ``trainer_class`` defaults to StreamingTrainer; speculators' own Trainer also works.
    ``phases``: the process's timeline, marked as the shards open, the draft is built, the
    loaders are ready and the training ends.
    """
    mark = phases.mark if phases else lambda _name: None
    from speculators.train.cli import set_seed

    manifests = [read_json(p) for p in manifest_paths]
    expect = _expected_shards(manifests, record)
    aux = expect["layer_ids"][:-1]
    storage = "fp8" if expect["state_dtype"] == "float8_e4m3fn" else "bf16"
    k = int(vocab_map["d2t"].numel())
    if k != cfg.draft_vocab_size:
        raise UserError(
            f"vocab map has {k} draft tokens but train.draft_vocab_size is {cfg.draft_vocab_size}"
        )
    shards = open_verified_shards(shard_paths, manifest_paths, expect)
    mark("shards opened")
    pairs = split_indices(shards, cfg.val_fraction)
    runtime = resolve_runtime(cfg)
    rank = setup_distributed()
    trainer_class = with_newton_schulz(trainer_class or StreamingTrainer, cfg.newton_schulz)
    graphed, graph_reason = decide_graph_step(
        cfg,
        world_size(),
        torch.cuda.is_available(),
        # speculators' own Trainer, and a subclass with its metrics' host syncs, step eagerly
        issubclass(trainer_class, StreamingTrainer) and trainer_class.sync_free,
        runtime,
    )
    cfg = dataclasses.replace(cfg, graph_step=graphed)  # a bool from here on
    if rank == 0:
        print(f"train: {graph_reason}", file=sys.stderr, flush=True)
    layout = muon_layout(cfg, trainer_class)
    fingerprint = _fingerprint(cfg, manifests, vocab_map, runtime, layout)
    resumed = fingerprinted_dir(state_dir, fingerprint) if rank == 0 else None
    if rank == 0:
        recover_state_dir(state_dir)
    barrier()

    set_seed(cfg.seed)
    dtype = runtime["dtype"]
    allow_recompiles(draft_recompile_limit(cfg.num_layers))
    model = build_draft(cfg, record, aux, vocab_map, runtime["attention"], draft_device(cfg))
    mark("draft built")
    if storage == "fp8":  # dequantized on the device, inside the input pipeline
        model.register_forward_pre_hook(fp8_inputs(dtype), with_kwargs=True)
    loaders = _loaders(cfg, shard_paths, pairs, record["hidden_size"], len(aux), dtype, storage)
    trainer_config = _trainer_config(cfg, state_dir, runtime)
    mark("loaders ready")
    t0, sched0, compiled0 = time.perf_counter(), thread_schedstat(), compile_seconds()
    with compile_fallbacks() as uncompiled:
        trainer = _run_trainer(
            trainer_class,
            model,
            trainer_config,
            loaders,
            cfg,
            rank,
            metrics_path,
        )
    seconds = time.perf_counter() - t0
    mark("training ended")
    thread = thread_shares(sched0, thread_schedstat(), seconds)
    # on a GPU the thread launches the work and the process's other threads are few; on a CPU
    # its own compute threads share the cores with it, so a wait there proves nothing
    if torch.cuda.is_available() and (line := starved_line(thread, rank)) is not None:
        print(line, file=sys.stderr, flush=True)
    for where in uncompiled:
        print(
            f"train: torch.compile reached its recompile limit on {where}; calls matching none "
            "of its compiled variants ran uncompiled (slower steps): a bug of this project, "
            "whose limit (eagle3lib.train.draft_recompile_limit) was too low for this draft",
            file=sys.stderr,
            flush=True,
        )
    if rank == 0:  # an earlier best left by the last save (validation comes after a save)
        prune_states(state_dir, cfg.keep_states)
    barrier()  # the other ranks read the state folder after it (last_epoch_dir)
    agree = None if cfg.fsdp else ranks_agree(trainer.model)
    if agree is False and rank == 0:
        print(
            "train: the ranks ended with different weights, which DDP's ranks must not (each "
            "takes the same step from the same averaged gradients): a bug of this project; "
            "the checkpoint is rank 0's",
            file=sys.stderr,
            flush=True,
        )
    final = last_epoch_dir(state_dir)
    if final is None:
        raise UserError(f"training finished without a checkpoint in {state_dir}")
    return {
        "final_epoch_dir": str(final),
        "resumed": resumed,
        "seconds": seconds,
        "uncompiled_functions": uncompiled,
        "ranks_agree": agree,  # under DDP: every rank ended with the same weights
        # this rank's training thread over the run: on a core, and waiting for one
        "training_thread": thread,
        **_run_stats(cfg, shards, pairs, aux, runtime, trainer, seconds),
        # torch.compile's seconds in this run (the process may have compiled before it)
        "compile_seconds": None if compiled0 is None else round(compile_seconds() - compiled0, 3),
        "rank": rank,
    }


def _run_stats(cfg, shards, pairs, aux, runtime, trainer, seconds: float) -> dict[str, Any]:
    """What was trained, how, and where the time went."""
    train_pairs, val_pairs = pairs
    train_tokens = sum(shards[s].length(i) for s, i in train_pairs)
    return {
        "train_samples": len(train_pairs),
        "val_samples": len(val_pairs),
        "train_tokens_per_epoch": train_tokens,
        "aux_layer_ids": aux,
        "attention": runtime["attention"],
        "loss_implementation": runtime["loss"],
        "dtype": str(runtime["dtype"]).removeprefix("torch."),
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "optimizers": [type(o).__name__ for o in trainer.optimizers],
        "processes": world_size(),
        "fsdp": bool(cfg.fsdp and world_size() > 1),
        "graph_step": cfg.graph_step,
        "batch_loading": batch_loading(trainer),
        # this rank's peak over the run, validation included (a graphed step keeps its
        # memory reserved for the run, so validation's comes on top of it); None on a CPU
        "gpu_memory_peak_bytes": {
            "allocated": torch.cuda.max_memory_allocated(),
            "reserved": torch.cuda.max_memory_reserved(),
        }
        if torch.cuda.is_available()
        else None,
        # where the run's host time went: each phase's own seconds (PHASES), and (rank 0 of
        # StreamingTrainer) the seconds from the start of training, after the trainer's
        # set-up, to the end of the first step, its compiling or graph capture included
        "phase_seconds": {k: round(v, 3) for k, v in trainer.phase_clock.seconds.items()},
        "first_step_seconds": round(progress.first - progress.start, 3)
        if (progress := getattr(trainer, "progress", None)) and progress.steps_run
        else None,
        "data_wait_fraction": getattr(trainer, "data_wait_seconds", 0.0) / seconds
        if seconds
        else None,
    }


def batch_loading(trainer) -> dict[str, int]:
    """What built the training batches: DataLoader worker processes (train.loader_workers) or
    the StreamingTrainer's loader threads (train.loader_threads; speculators' own trainer
    and 0 threads: its training thread)."""
    workers = trainer.train_loader.num_workers
    threads = 0 if workers else getattr(trainer, "loader_threads", 0)
    return {"loader_workers": workers, "loader_threads": threads}


def compile_seconds() -> float | None:
    """Seconds this process spent in torch.compile so far: dynamo's tracing and inductor's
    compiles (``_compile.compile_inner``; with symbolic shapes the backward's too), and the
    backward compiles left to the first backward (``backward._backward_impl``); from torch's
    own timers (``torch._dynamo.utils``, not a public API: None where they are missing).
    Cache hits count the time they took."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:
        return None
    return round(
        sum(
            sum(times)
            for name, times in compilation_time_metrics.items()
            if name in ("_compile.compile_inner", "backward._backward_impl")
        ),
        3,
    )


def epoch_dirs(state_dir: Path) -> list[Path]:
    """speculators' epoch checkpoint folders (``<state>/<epoch>/model.safetensors``), oldest
    first."""
    epochs = [
        int(d.name)
        for d in state_dir.iterdir()
        if d.is_dir()
        and not d.is_symlink()
        and d.name.isdigit()
        and (d / "model.safetensors").exists()
    ]
    return [state_dir / str(e) for e in sorted(epochs)]


def last_epoch_dir(state_dir: Path) -> Path | None:
    """speculators' newest epoch checkpoint folder, the one a rerun resumes from."""
    epochs = epoch_dirs(state_dir)
    return epochs[-1] if epochs else None


def prune_states(state_dir: Path, keep: int) -> list[Path]:
    """Remove the epoch folders older than the newest ``keep`` (train.keep_states; 0 keeps
    all), once the newest is whole (after ``swap_in``), except the one speculators' link
    ``checkpoint_best`` names (the lowest validation loss so far: a resumed run reads it back,
    as an uninterrupted one keeps it); returns the folders removed."""
    best = state_dir / "checkpoint_best"
    best_name = Path(os.readlink(best)).name if best.is_symlink() else None
    old = [d for d in (epoch_dirs(state_dir)[:-keep] if keep else []) if d.name != best_name]
    for folder in old:
        # out of the epochs' names first: a kill mid-removal leaves a folder that no resume
        # reads and recover_state_dir removes (a half-removed epoch folder would stay)
        going = folder.with_name(PRUNING + folder.name)
        try:
            os.rename(folder, going)
            shutil.rmtree(going)
        except OSError as exc:  # housekeeping: the state saved stays usable
            print(
                f"train: warning: could not remove the older state {folder} ({exc}); remove it "
                "by hand to free its space",
                file=sys.stderr,
                flush=True,
            )
    return old


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [
        json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()
    ]


# Two trainers on the same batches, same seed and recipe, in bf16 autocast on a GPU: their
# per-step losses may differ this much (relative). bf16 keeps 8 significant bits (a relative
# step of 2^-8 = 0.39 %), ours steps AdamW as one fused kernel (speculators: foreach), and
# small differences grow over the steps. A skipped batch or another learning rate must move
# the losses by more: tests/test_train.py checks both on CPU (fp32, where ours is exact),
# bench/train.py --same-training twice the lr on a GPU. On an H200 (BENCHMARKS.md, 2026-12-01)
# the first 50 losses differed by at most 0.24 %, and by 24 % with twice the lr.
SAME_TRAINING_BF16_RTOL = 0.01


def max_relative_difference(reference: Sequence[float], other: Sequence[float]) -> float:
    """The largest |other - reference| / |reference| over the steps both have (each must have
    at least one)."""
    n = min(len(reference), len(other))
    if n == 0:
        raise ValueError("no common steps to compare")
    return max(abs(b - a) / abs(a) for a, b in zip(reference[:n], other[:n], strict=True))


def loss_curves(metrics: list[dict[str, Any]]) -> dict[str, list]:
    """Per-step training loss (with each step's epoch) and per-epoch validation loss/accuracy
    from the recorded logs (steps as logged: from 0).

    A resumed run logs again the steps after its last checkpoint: the later record wins."""
    train_loss, epoch_of, val = {}, {}, {}
    for m in metrics:
        if "train" in m and "loss" in m["train"]:
            train_loss[m.get("global_step")] = m["train"]["loss"]
            epoch_of[m.get("global_step")] = m.get("epoch")
        if "val" in m:
            val[m.get("epoch")] = {"epoch": m.get("epoch"), **m["val"]}
    steps = sorted(train_loss)
    return {
        "step": steps,
        "train_loss": [train_loss[s] for s in steps],
        "step_epoch": [epoch_of[s] for s in steps],
        "val": [val[e] for e in sorted(val)],
    }
