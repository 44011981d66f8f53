"""Contracts of eagle3lib.train and eagle3lib.distributed that their functions answer
without training: config -> speculators' trainer arguments, the resume fingerprint, the run
summary's fields, runtime refusals and the process group's rank logic; the state folder's
recovery and epoch folders, the metrics file and loss curves, the draft built, and train on
a finished run's state (it trains no step) (mutation audits)."""

import dataclasses
import os
import shutil
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch
from conftest import one_torchrun_rank, train_pipeline

from eagle3lib import distributed, streaming_trainer, train
from eagle3lib.config import TrainConfig
from eagle3lib.errors import UserError


def test_the_trainer_config_takes_every_train_key_speculators_reads(tmp_path):
    """Each train.* key reaches speculators' TrainerConfig under its own name (distinct values,
    so a key dropped or read from another shows); the state folder is resumed from."""
    from speculators.losses.utils import resolve_loss_config

    cfg = TrainConfig(
        epochs=3, lr=2e-3, optimizer="muon", weight_decay=0.05, scheduler="cosine",
        warmup_ratio=0.2, ttt_steps=2, ttt_step_loss_decay=0.8, log_every=7, max_steps=11,
        checkpoint_freq=0.5, fsdp=True,
    )  # fmt: skip
    runtime = {"attention": "sdpa", "loss": "eager", "dtype": torch.float16}
    got = train._trainer_config(cfg, tmp_path, runtime)._asdict()
    loss = resolve_loss_config("kl_div", "eager")
    call = {"ttt_steps": 2, "ttt_step_loss_decay": 0.8, "loss_config": loss}
    assert {k: got[k] for k in (
        "lr", "num_epochs", "save_path", "resume_from_checkpoint", "train_call_kwargs",
        "val_call_kwargs", "optimizer", "weight_decay", "muon_lr", "scheduler_type",
        "scheduler_warmup_ratio", "hidden_states_dtype", "log_freq", "max_steps",
        "checkpoint_freq", "fsdp_shard",
    )} == {
        "lr": 2e-3, "num_epochs": 3, "save_path": str(tmp_path), "resume_from_checkpoint": True,
        "train_call_kwargs": call, "val_call_kwargs": call, "optimizer": "muon",
        "weight_decay": 0.05, "muon_lr": 2e-3, "scheduler_type": "cosine",
        "scheduler_warmup_ratio": 0.2, "hidden_states_dtype": torch.float16, "log_freq": 7,
        "max_steps": 11, "checkpoint_freq": 0.5, "fsdp_shard": True,
    }  # fmt: skip


FINGERPRINT_PARTS = (
    [{"file": {"sha256": "ab"}}, {"file": {"sha256": "cd"}}],
    {"d2t": torch.tensor([0, 1])},
    {"attention": "sdpa", "loss": "eager", "dtype": torch.float32},
)


def test_the_resume_fingerprint_ignores_only_the_resource_keys():
    """A state folder is resumed after a change of train.gpus, checkpoint_freq, keep_states,
    loader_threads, loader_workers or graph_step (how the run is carried out), not of a key
    that changes what is trained; multipack packing is left out (as before the key existed),
    ffd is not; loader_workers is recorded as 0 whatever its count (as folders saved before
    it was a resource key recorded the default); the shards, the vocab map and the runtime
    are in it."""
    cfg = TrainConfig(packing="multipack")
    base = train._fingerprint(cfg, *FINGERPRINT_PARTS)
    assert "packing" not in base["train"] and "newton_schulz" not in base["train"]
    assert base["train"]["loader_workers"] == 0  # as folders saved before it was a resource
    assert base["shards"] == ["ab", "cd"]
    assert base["runtime"] == {"attention": "sdpa", "loss": "eager"}
    resources = {"gpus": 2, "checkpoint_freq": 0.5, "keep_states": 3, "loader_threads": 1,
                 "loader_workers": 2, "graph_step": True}  # fmt: skip
    assert set(resources) == set(train.RESOURCE_KEYS)

    def changed(**change):
        return train._fingerprint(dataclasses.replace(cfg, **change), *FINGERPRINT_PARTS)

    for key, value in resources.items():
        assert changed(**{key: value}) == base, key
    for key, value in {"lr": 2e-3, "epochs": 3, "seed": 1, "packing": "ffd"}.items():
        other = changed(**{key: value})
        assert other != base and other["train"][key] == value, key
    shards, vocab, runtime = FINGERPRINT_PARTS
    assert train._fingerprint(cfg, shards[:1], vocab, runtime) != base
    assert train._fingerprint(cfg, shards, {"d2t": torch.tensor([1, 0])}, runtime) != base
    assert train._fingerprint(cfg, shards, vocab, {**runtime, "loss": "fused"}) != base


class _Shard:
    def __init__(self, lengths):
        self.lengths = lengths

    def length(self, i):
        return self.lengths[i]


def _trainer(**extra):
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    clock = SimpleNamespace(seconds={"steps": 1.23456, "saves": 0.5})
    extra = {"train_loader": SimpleNamespace(num_workers=0), "loader_threads": 3, **extra}
    return SimpleNamespace(optimizers=[opt], phase_clock=clock, **extra)


def test_the_run_statistics_say_what_was_trained_and_where_the_time_went(monkeypatch):
    """train's summary fields from the shards, the split, the runtime and the trainer: the
    samples and tokens of the training side only, one process (so no FSDP even where the
    config asks for it), the first step's seconds (rounded to ms) and the share of the run
    spent waiting for data."""
    shards = [_Shard([10, 20, 30]), _Shard([5, 7])]
    pairs = ([(0, 0), (0, 2), (1, 1)], [(0, 1), (1, 0)])
    cfg = TrainConfig(fsdp=True, graph_step=False)
    runtime = {"attention": "sdpa", "loss": "eager", "dtype": torch.float32}
    progress = SimpleNamespace(start=1.0, first=3.2346, steps_run=4)
    trainer = _trainer(progress=progress, data_wait_seconds=2.0)
    assert train._run_stats(cfg, shards, pairs, [2, 4], runtime, trainer, 8.0) == {
        "train_samples": 3, "val_samples": 2, "train_tokens_per_epoch": 10 + 30 + 7,
        "aux_layer_ids": [2, 4], "attention": "sdpa", "loss_implementation": "eager",
        "dtype": "float32", "device": "cpu", "optimizers": ["AdamW"], "processes": 1,
        "fsdp": False, "graph_step": False, "gpu_memory_peak_bytes": None,
        "batch_loading": {"loader_workers": 0, "loader_threads": 3},
        "phase_seconds": {"steps": 1.235, "saves": 0.5}, "first_step_seconds": 2.235,
        "data_wait_fraction": 0.25,
    }  # fmt: skip
    # no step run, speculators' trainer (no progress, no data wait), no time: no figures
    idle = _trainer(progress=SimpleNamespace(start=1.0, first=1.0, steps_run=0))
    stats = train._run_stats(cfg, shards, pairs, [2, 4], runtime, idle, 0.0)
    assert (stats["first_step_seconds"], stats["data_wait_fraction"]) == (None, None)
    stats = train._run_stats(cfg, shards, pairs, [2, 4], runtime, _trainer(), 4.0)
    assert (stats["first_step_seconds"], stats["data_wait_fraction"]) == (None, 0.0)
    # DataLoader workers build the batches instead of the threads; speculators' own trainer
    # (no loader threads) on its training thread
    for loader, threads, expected in (
        (SimpleNamespace(num_workers=2), 3, {"loader_workers": 2, "loader_threads": 0}),
        (SimpleNamespace(num_workers=0), None, {"loader_workers": 0, "loader_threads": 0}),
    ):
        other = _trainer(train_loader=loader, loader_threads=threads)
        if threads is None:
            del other.loader_threads
        stats = train._run_stats(cfg, shards, pairs, [2, 4], runtime, other, 4.0)
        assert stats["batch_loading"] == expected
    # two processes: sharded only where the config asks for it
    monkeypatch.setattr(train, "world_size", lambda: 2)
    for fsdp in (False, True):
        stats = train._run_stats(
            dataclasses.replace(cfg, fsdp=fsdp), shards, pairs, [2, 4], runtime, trainer, 8.0
        )
        assert (stats["processes"], stats["fsdp"]) == (2, fsdp)


def test_the_compile_seconds_are_dynamos_and_the_backward_compiles_in_ms(monkeypatch):
    """compile_seconds sums torch's timers of dynamo's compiles and of the backward compiles
    left to the first backward, no other, rounded to the millisecond."""
    from torch._dynamo import utils

    monkeypatch.setattr(utils, "compilation_time_metrics", {
        "_compile.compile_inner": [0.12345, 1.0], "backward._backward_impl": [0.5],
        "OutputGraph.call_user_compiler": [7.0],
    })  # fmt: skip
    assert train.compile_seconds() == 1.623


def test_the_disk_warning_counts_every_epochs_state_by_default(tmp_path):
    """disk_warning without keep: every epoch's state stays (train.keep_states 0); the last
    epoch's state to come is warned about too."""
    line = train.disk_warning(1_000_000_000, 4_000_000_000, 5, tmp_path)
    assert line is not None and "5 more are to be saved (5 GB)" in line
    line = train.disk_warning(1_000_000_000, 900_000_000, 1, tmp_path)
    assert line is not None and "1 more are to be saved (1 GB)" in line
    # more states than kept on the disk (keep_states lowered since): room for the staged one
    assert train.states_to_add(5, 1, 3) == 1


def test_the_largest_relative_difference_is_over_the_steps_both_runs_have():
    assert train.max_relative_difference([2.0, 4.0, 8.0], [2.0, 3.0]) == 0.25


def test_the_recompile_limit_leaves_room_for_each_drafts_measured_frames():
    """Never below dynamo's default of 8, and twice the decoder call's compiled variants
    measured on the CPU (6 for two layers, 11 for three), growing with the layers."""
    limits = [train.draft_recompile_limit(n) for n in (1, 2, 3, 4)]
    assert limits[0] >= 8 and limits[1] >= 2 * 6 and limits[2] >= 2 * 11
    assert limits == sorted(set(limits))


@pytest.mark.parametrize(("length", "next_multiple"), [(255, 256), (257, 384)])
def test_a_sequence_length_flex_attention_cannot_mask_is_refused_with_the_next_multiple(
    gpu_with_triton, length, next_multiple
):
    gpu_with_triton("2.13.0")
    with pytest.raises(UserError) as refused:
        train.resolve_runtime(TrainConfig(total_seq_len=length))
    assert str(refused.value) == (
        f"config key train.total_seq_len: {length} is not a multiple of 128, which flex "
        f"attention's block mask needs; use e.g. {next_multiple}"
    )
    assert train.resolve_runtime(TrainConfig(total_seq_len=256)) == {
        "attention": "simple_flex_attention", "loss": "eager", "dtype": torch.bfloat16,
    }  # fmt: skip
    flex = train.resolve_runtime(TrainConfig(total_seq_len=256, attention="simple_flex_attention"))
    assert flex["attention"] == "simple_flex_attention"  # asked for by name on a GPU
    sdpa = train.resolve_runtime(TrainConfig(total_seq_len=length, attention="sdpa"))
    assert sdpa["attention"] == "sdpa"  # sdpa masks any length


def test_the_cpu_runtime_is_sdpa_in_fp32():
    assert train.resolve_runtime(TrainConfig(total_seq_len=300)) == {
        "attention": "sdpa", "loss": "eager", "dtype": torch.float32,
    }  # fmt: skip
    assert train.resolve_runtime(TrainConfig(loss="eager"))["loss"] == "eager"


def test_the_eager_loss_runs_under_any_torch_and_the_fused_one_from_2_13(gpu_with_triton):
    """The torch version bounds only the fused loss, and 2.12 is still before the fix."""
    gpu_with_triton("2.12.1")
    assert train.resolve_runtime(TrainConfig(loss="eager"))["loss"] == "eager"
    with pytest.raises(UserError, match="the fused loss crashes under torch 2.12.1's compiler"):
        train.resolve_runtime(TrainConfig(loss="fused"))


@pytest.mark.parametrize(("cuda", "triton"), [(False, False), (False, True), (True, False)])
def test_the_fused_loss_needs_both_a_gpu_and_triton(monkeypatch, cuda, triton):
    import sys
    import types

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    # a None entry makes ``import triton`` fail as if it were not installed
    monkeypatch.setitem(sys.modules, "triton", types.ModuleType("triton") if triton else None)
    with pytest.raises(UserError) as refused:
        train.resolve_runtime(TrainConfig(loss="fused", attention="sdpa"))
    assert str(refused.value) == (
        "config key train.loss: the fused loss needs a GPU and Triton; use eager"
    )


def test_a_vocab_map_of_another_size_than_the_config_is_refused_before_any_shard_opens(
    tmp_path,
):
    from eagle3lib.fileio import write_json

    manifest = tmp_path / "shard-0.json"
    write_json(manifest, {"layer_ids": [1, 2, 3], "state_dtype": "bfloat16"})
    record = {"name": "v", "config_sha256": "c", "weights": {"sha256": "w"}, "hidden_size": 8}
    with pytest.raises(UserError) as refused:
        train.train(
            TrainConfig(draft_vocab_size=6), record, [tmp_path / "missing.safetensors"],
            [manifest], {"d2t": torch.zeros(5)}, tmp_path / "state", tmp_path / "m.jsonl",
        )  # fmt: skip
    assert str(refused.value) == "vocab map has 5 draft tokens but train.draft_vocab_size is 6"


def test_joining_torchruns_group_once_sets_up_speculators_data_parallel_split(monkeypatch):
    """setup_distributed joins torchrun's group once; called again in the group it returns
    the rank instead of joining again (which torch refuses), and sets up speculators'
    data-parallel group. The teardown leaves the process outside any group, speculators' view
    of it too."""
    from speculators.train import distributed as sd

    one_torchrun_rank(monkeypatch)
    with distributed.torn_down():
        assert distributed.setup_distributed() == 0
        assert distributed.world_size() == 1 and sd.is_distributed()
        # speculators' data-parallel group, by which make_loader's sampler splits the batches
        # over the ranks (without it every rank of several would train on every batch)
        assert sd.get_dp_group() is not None
        assert (sd.get_dp_size(), sd.get_dp_rank()) == (1, 0)
        assert distributed.setup_distributed() == 0
        model = torch.nn.Linear(2, 2)
        assert distributed.ranks_agree(model) is None  # a group of one: nothing to compare
    assert not torch.distributed.is_initialized()
    assert not sd.is_distributed()


def test_ranks_agree_only_when_every_rank_holds_the_same_weights(monkeypatch):
    """ranks_agree compares this rank's checksum with every rank's (all_gather, faked here as
    two ranks): one rank with other weights is a disagreement."""
    from speculators.train import distributed as sd

    model = torch.nn.Linear(2, 2)
    mine = distributed.weights_checksum(model)
    monkeypatch.setattr(sd, "is_distributed", lambda: True)
    monkeypatch.setattr(sd, "get_world_size", lambda: 2)
    for theirs, agree in ((mine, True), (mine + 1, False)):

        def all_gather(every, tensor, theirs=theirs):
            assert torch.equal(tensor, mine) and len(every) == 2
            every[0].copy_(tensor)
            every[1].copy_(theirs)

        monkeypatch.setattr(torch.distributed, "all_gather", all_gather)
        assert distributed.ranks_agree(model) is agree


def test_the_weights_checksum_reads_eight_byte_parameters():
    model = torch.nn.Linear(3, 2).double()
    before = distributed.weights_checksum(model)
    model.weight.data.view(-1).view(torch.int64)[0] ^= 1
    assert not torch.equal(before, distributed.weights_checksum(model))


def test_a_cpu_train_job_of_no_gpus_keeps_one_thread_for_training():
    """scripts/train.py passes 0 processes where the job leases no GPU (train.gpus: 0): one
    process, whose loader threads leave its training thread one of the threads granted."""
    cfg = TrainConfig(loader_threads=4)
    assert train.with_loader_threads(cfg, None, 3, 0).loader_threads == 2
    assert train.with_loader_threads(cfg, None, 1, 0).loader_threads == 1


def _epoch(folder, model=b"m"):
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(model)


def test_recovering_the_state_folder_undoes_each_cut_short_save_and_removal(tmp_path):
    """recover_state_dir, after a kill: an epoch moved aside (``<epoch>.old``) whose
    replacement never arrived is put back, bytes unchanged; one whose replacement did arrive
    is removed (the replacement stays); the half-written staging folder and an older state cut
    short in its removal (``.pruning-<epoch>``) go; the rest of the folder stays."""
    _epoch(tmp_path / "2.old", b"epoch 2")  # killed between swap_in's two renames
    _epoch(tmp_path / "3.old", b"epoch 3, replaced")  # killed before swap_in's last removal
    _epoch(tmp_path / "3", b"epoch 3")
    _epoch(tmp_path / ".staging" / "4")
    _epoch(tmp_path / ".pruning-1")
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "checkpoint_best").symlink_to("2", target_is_directory=True)
    train.recover_state_dir(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "2", "3", "checkpoint_best", "metrics.jsonl",
    ]  # fmt: skip
    assert (tmp_path / "2" / "model.safetensors").read_bytes() == b"epoch 2"
    assert (tmp_path / "3" / "model.safetensors").read_bytes() == b"epoch 3"
    assert train.epoch_dirs(tmp_path) == [tmp_path / "2", tmp_path / "3"]


def test_swapping_in_replaces_a_leftover_moved_aside_folder_too(tmp_path):
    """swap_in where an earlier swap of the same epoch left ``<epoch>.old`` (its removal
    failed): the leftover goes first, the new folder replaces the old one."""
    _epoch(tmp_path / "0", b"old")
    _epoch(tmp_path / "0.old", b"older")
    _epoch(tmp_path / ".staging" / "0", b"new")
    train.swap_in(tmp_path / ".staging" / "0", tmp_path / "0")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".staging", "0"]
    assert (tmp_path / "0" / "model.safetensors").read_bytes() == b"new"


def test_epoch_folders_are_the_numbered_folders_holding_a_model_oldest_first(tmp_path):
    """epoch_dirs orders by number (10 after 9), and leaves out a link with an epoch's name, a
    file, a folder without a model and any other name; last_epoch_dir: the newest, None
    without any."""
    assert train.epoch_dirs(tmp_path) == [] and train.last_epoch_dir(tmp_path) is None
    for name in ("10", "9", "x1", "1a"):
        _epoch(tmp_path / name)
    (tmp_path / "11").mkdir()
    (tmp_path / "12").write_text("a file")
    (tmp_path / "13").symlink_to("10", target_is_directory=True)
    assert train.epoch_dirs(tmp_path) == [tmp_path / "9", tmp_path / "10"]
    assert train.last_epoch_dir(tmp_path) == tmp_path / "10"


def test_the_metrics_recorder_appends_each_dict_logged_as_one_json_line(tmp_path):
    """MetricsRecorder: the dicts speculators logs, one JSON line each, readable at once (a
    killed run keeps them), a tensor as its number; other messages are not metrics; a resumed
    run's recorder appends to the same file, in folders it creates."""
    import logging

    path = tmp_path / "run" / "state" / "m.jsonl"

    def log(recorder, msg):
        recorder.emit(logging.LogRecord("speculators.metrics", logging.INFO, "", 0, msg, (), None))

    first = train.MetricsRecorder(path)
    log(first, {"train": {"loss": torch.tensor(1.5)}, "global_step": 0})
    log(first, "epoch 0 done")
    assert path.read_text() == '{"train": {"loss": 1.5}, "global_step": 0}\n'
    first.close()
    second = train.MetricsRecorder(path)
    log(second, {"val": {"loss": 2.0}, "epoch": 0})
    second.close()
    assert train.read_metrics(path) == [
        {"train": {"loss": 1.5}, "global_step": 0}, {"val": {"loss": 2.0}, "epoch": 0},
    ]  # fmt: skip
    assert train.read_metrics(tmp_path / "none.jsonl") == []


def test_the_loss_curves_take_a_resumed_runs_later_record_of_each_step_and_epoch():
    """loss_curves: steps in order with their training loss (a record without a loss is not a
    point), the last record of a step logged twice (a resumed run logs again the steps after
    its last checkpoint), one validation entry an epoch, in epoch order, its epoch first."""
    metrics = [
        {"train": {"loss": 3.0}, "global_step": 1, "epoch": 0},
        {"train": {"loss": 4.0}, "global_step": 0, "epoch": 0},
        {"train": {"lr": 0.1}, "global_step": 2, "epoch": 0},
        {"val": {"loss": 9.0, "accuracy": 0.1}, "epoch": 1},
        {"val": {"loss": 8.0, "accuracy": 0.2}, "epoch": 0},
        {"train": {"loss": 2.5}, "global_step": 1, "epoch": 0},  # the rerun's
        {"val": {"loss": 7.0, "accuracy": 0.3}, "epoch": 1},  # the rerun's
    ]
    curves = train.loss_curves(metrics)
    assert curves == {
        "step": [0, 1],
        "train_loss": [4.0, 2.5],
        "step_epoch": [0, 0],
        "val": [
            {"epoch": 0, "loss": 8.0, "accuracy": 0.2},
            {"epoch": 1, "loss": 7.0, "accuracy": 0.3},
        ],
    }
    assert list(curves["val"][0]) == ["epoch", "loss", "accuracy"]


def test_a_rerun_recovers_the_state_a_kill_mid_save_left_before_resuming_from_it(
    pipeline, tmp_path, monkeypatch, capsys
):
    """train on a finished run's state folder that a kill inside swap_in left with its newest
    epoch moved aside (``1.old``), a half-written staging folder and an older epoch: the epoch
    is put back first, so the run resumes from it and trains no step again; the older epoch
    (not the best) is pruned at the end (train.keep_states 1), the leftovers are gone, the
    metrics file is closed, and the job's phases are marked in order. A DDP disagreement of
    the ranks (faked) is said, an agreement is not."""
    import time

    from eagle3lib.lifetime import Phases

    state = tmp_path / "state"
    shutil.copytree(pipeline["dir"] / "state", state, symlinks=True)
    shutil.copytree(state / "1", state / "0")  # an older epoch, as keep_states 0 leaves
    os.rename(state / "1", state / "1.old")
    _epoch(state / ".staging" / "1")
    metrics = (state / "metrics.jsonl").read_text()
    closed, close = [], train.MetricsRecorder.close
    monkeypatch.setattr(
        train.MetricsRecorder, "close", lambda self: closed.append(self.path) or close(self)
    )

    def rerun(agree, phases=None):
        monkeypatch.setattr(train, "ranks_agree", lambda model: agree)
        return train.train(
            dataclasses.replace(pipeline["train_cfg"], loader_threads=1), pipeline["record"],
            pipeline["shards"], pipeline["manifests"], pipeline["vocab_map"], state,
            state / "metrics.jsonl", phases=phases,
        )  # fmt: skip

    phases = Phases("train", echo=False)
    start = time.perf_counter()
    stats = rerun(False, phases)
    assert 0 < stats["seconds"] <= time.perf_counter() - start
    assert stats["resumed"] is True and stats["final_epoch_dir"] == str(state / "1")
    assert (state / "metrics.jsonl").read_text() == metrics  # no step ran again
    assert sorted(p.name for p in state.iterdir()) == [
        "1", "checkpoint_best", "fingerprint.json", "metrics.jsonl",
    ]  # fmt: skip
    assert closed == [state / "metrics.jsonl"]
    assert list(phases.marks) == ["shards opened", "draft built", "loaders ready", "training ended"]
    assert (stats["rank"], stats["uncompiled_functions"], stats["ranks_agree"]) == (0, [], False)
    assert stats["compile_seconds"] == 0.0  # nothing compiled on the CPU
    said = "train: the ranks ended with different weights, which DDP's ranks must not"
    assert said in capsys.readouterr().err
    # torch.compile's seconds over the run (the process's before it not counted), in ms
    compiled = iter([10.0, 12.3456])
    monkeypatch.setattr(train, "compile_seconds", lambda: next(compiled))
    stats = rerun(True)
    assert (stats["ranks_agree"], stats["compile_seconds"]) == (True, 2.346)
    assert said not in capsys.readouterr().err


class _Idle(streaming_trainer.StreamingTrainer):
    """Trains and saves nothing; records what the train job set on it."""

    seen: ClassVar[dict] = {}

    def run_training(self):
        _Idle.seen = {"loader_threads": self.loader_threads, "device_type": self.device_type}


def test_a_run_that_saved_no_checkpoint_is_an_error_naming_the_state_folder(pipeline, tmp_path):
    """A trainer that ends without a checkpoint in the state folder: one line naming it. The
    trainer was given train.loader_threads and the CPU as its device."""
    state = tmp_path / "state"
    with pytest.raises(UserError) as refused:
        train_pipeline(pipeline, state, _Idle, loader_threads=2)
    assert str(refused.value) == f"training finished without a checkpoint in {state}"
    assert _Idle.seen == {"loader_threads": 2, "device_type": "cpu"}


def test_the_draft_is_built_with_every_train_key_speculators_cli_passes(pipeline):
    """build_draft: each train.* key that shapes the draft reaches speculators' model and its
    saved config (values other than speculators' defaults: its norms before fc and of the
    output are off, its aux layers for 8 are 2, 4, 5; so a key dropped shows), the attention
    asked for, the verifier named portably (its record's name, not its load path), on the
    CPU."""
    cfg = TrainConfig(
        num_layers=2, sliding_window=64, full_attention_layers=[1], norm_before_residual=False,
        ttt_steps=2, draft_vocab_size=256,
    )  # fmt: skip
    vocab_map = pipeline["vocab_map"]
    model = train.build_draft(cfg, pipeline["record"], [1, 3, 6], vocab_map, "eager")
    config, layers = model.config, model.config.transformer_layer_config
    assert len(model.layers) == 2 and model.input_norm is not None and model.fc_norm is None
    assert (layers.num_hidden_layers, layers.model_type, layers.hidden_act) == (2, "llama", "silu")
    assert (layers.sliding_window, layers.layer_types) == (
        64,
        ["sliding_attention", "full_attention"],
    )
    assert (layers._attn_implementation, layers._name_or_path) == ("eager", "")
    assert config.speculators_config.verifier.name_or_path == pipeline["record"]["name"]
    assert config.speculators_config.proposal_methods[0].speculative_tokens == 2
    assert (
        config.draft_vocab_size, config.eagle_aux_hidden_state_layer_ids,
        config.norm_before_residual, config.norm_before_fc, config.fc_norm, config.norm_output,
    ) == (256, [1, 3, 6], False, True, False, True)  # fmt: skip
    assert torch.equal(model.d2t, vocab_map["d2t"]) and torch.equal(model.t2d, vocab_map["t2d"])
    assert {p.device.type for p in model.parameters()} == {"cpu"}


class _Built(Exception):
    """Stops train once the draft is built."""


def test_the_draft_starts_from_the_configured_seeds_weights_whatever_ran_before(
    pipeline, tmp_path, monkeypatch
):
    """train seeds the draft's random initialisation with train.seed: the same weights after
    any earlier use of torch's generator, other weights for another seed."""
    built = []
    real = train.build_draft

    def build(*args, **kwargs):
        built.append(real(*args, **kwargs).fc.weight.detach().clone())
        raise _Built

    monkeypatch.setattr(train, "build_draft", build)
    for run, (earlier, seed) in enumerate([(1, 0), (2, 0), (1, 5)]):
        torch.manual_seed(earlier)
        with pytest.raises(_Built):
            train_pipeline(pipeline, tmp_path / str(run), seed=seed)
    assert torch.equal(built[0], built[1]) and not torch.equal(built[0], built[2])
