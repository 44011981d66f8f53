"""Contracts of eagle3lib.train and eagle3lib.distributed that their pure functions answer
without training: config -> speculators' trainer arguments, the resume fingerprint, the run
summary's fields, runtime refusals and the process group's rank logic (mutation audit)."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from conftest import one_torchrun_rank

from eagle3lib import distributed, train
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
    loader_threads or graph_step (how the run is carried out), not of a key that changes
    what is trained; multipack packing is left out (as before the key existed), ffd is not;
    the shards, the vocab map and the runtime are in it."""
    cfg = TrainConfig(packing="multipack")
    base = train._fingerprint(cfg, *FINGERPRINT_PARTS)
    assert "packing" not in base["train"] and "newton_schulz" not in base["train"]
    assert base["shards"] == ["ab", "cd"]
    assert base["runtime"] == {"attention": "sdpa", "loss": "eager"}
    resources = {"gpus": 2, "checkpoint_freq": 0.5, "keep_states": 3, "loader_threads": 1,
                 "graph_step": True}  # fmt: skip
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
        "phase_seconds": {"steps": 1.235, "saves": 0.5}, "first_step_seconds": 2.235,
        "data_wait_fraction": 0.25,
    }  # fmt: skip
    # no step run, speculators' trainer (no progress, no data wait), no time: no figures
    idle = _trainer(progress=SimpleNamespace(start=1.0, first=1.0, steps_run=0))
    stats = train._run_stats(cfg, shards, pairs, [2, 4], runtime, idle, 0.0)
    assert (stats["first_step_seconds"], stats["data_wait_fraction"]) == (None, None)
    stats = train._run_stats(cfg, shards, pairs, [2, 4], runtime, _trainer(), 4.0)
    assert (stats["first_step_seconds"], stats["data_wait_fraction"]) == (None, 0.0)
    # two processes: sharded only where the config asks for it
    monkeypatch.setattr(train, "world_size", lambda: 2)
    for fsdp in (False, True):
        stats = train._run_stats(
            dataclasses.replace(cfg, fsdp=fsdp), shards, pairs, [2, 4], runtime, trainer, 8.0
        )
        assert (stats["processes"], stats["fsdp"]) == (2, fsdp)


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
