import dataclasses
import json
import math
import pickle
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from conftest import assert_same_bytes, one_torchrun_rank, train_pipeline

from eagle3lib import batches, speculators_compat, streaming_trainer, train, train_data
from eagle3lib.errors import UserError
from eagle3lib.shards import open_shard


def test_training_runs_and_records_loss_curves(pipeline):
    stats = pipeline["stats"]
    assert stats["device"] == "cpu" and stats["attention"] == "sdpa"
    assert stats["loss_implementation"] == "eager" and stats["dtype"] == "float32"
    assert stats["gpu_memory_peak_bytes"] is None  # a GPU's peak, on a CPU none
    assert stats["train_samples"] + stats["val_samples"] == 40
    metrics = train.read_metrics(pipeline["dir"] / "state" / "metrics.jsonl")
    curves = train.loss_curves(metrics)
    assert len(curves["train_loss"]) >= 4
    assert all(math.isfinite(x) for x in curves["train_loss"])
    assert [v["epoch"] for v in curves["val"]] == [0, 1]
    assert curves["step"] == list(range(len(curves["step"])))
    # where the run's time went: steps, a save and a validation per epoch, within the run
    phases = stats["phase_seconds"]
    assert phases.keys() == {"steps", "saves", "validation", "best"}, phases
    assert min(phases["steps"], phases["saves"], phases["validation"]) > 0, phases
    assert sum(phases.values()) <= stats["seconds"], (phases, stats["seconds"])
    assert 0 < stats["first_step_seconds"] < phases["steps"] + phases["saves"], stats
    # the training thread's time over the run (Linux's schedstat): it trained on a core here
    if streaming_trainer.thread_schedstat() is not None:
        thread = stats["training_thread"]
        assert 0.05 < thread["cpu_fraction"] <= 1.01, thread
        assert 0 <= thread["runqueue_wait_fraction"] <= 1.01 - thread["cpu_fraction"], thread


def test_compile_seconds_count_the_forward_and_backward_compiles():
    """compile_seconds: torch.compile's time in this process, a backward compiled at the first
    backward included, and a backward compiled with its forward (symbolic shapes) counted
    once. torch's compile caches are off here: a cached graph (an earlier run's, on this
    machine) brings its backward along with the forward."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    before = train.compile_seconds()
    with (
        inductor_config.patch(fx_graph_cache=False),
        functorch_config.patch(enable_autograd_cache=False),
    ):
        f = torch.compile(lambda x: (x * 3.5).cos().sum())
        x = torch.randn(5, requires_grad=True)
        loss = f(x)
        forward = train.compile_seconds()
        loss.backward()
        lazy = train.compile_seconds()
        assert before < forward < lazy, (before, forward)
        # dynamic: the backward compiles inside the forward's call, timed once
        g = torch.compile(lambda x: (x * 1.5).sin().sum(), dynamic=True)
        t0 = time.perf_counter()
        loss = g(x)
        took = time.perf_counter() - t0
        loss.backward()
    assert 0 < train.compile_seconds() - lazy <= took, (lazy, took)


def test_phase_clock_gives_a_save_inside_an_epoch_to_the_saves():
    """Each phase counts its own time: a mid-epoch save is the saves', not the steps'; after
    the block the trainer's methods are its own again."""
    now = [0.0]

    class Trainer:
        def train_epoch(self):
            now[0] += 1
            self.maybe_save_checkpoint()
            now[0] += 2

        def maybe_save_checkpoint(self):
            now[0] += 5

        def val_epoch(self):
            now[0] += 3

        def maybe_update_best(self):
            return "best"

    trainer, clock = Trainer(), streaming_trainer.PhaseClock(clock=lambda: now[0])
    trainer.val_epoch = lambda: "own"  # an instance's own method is put back as it was
    with clock.timing(trainer):
        trainer.train_epoch()
        trainer.maybe_save_checkpoint()
        assert trainer.val_epoch() == "own"
        assert trainer.maybe_update_best() == "best"
    assert clock.seconds == {"steps": 3, "saves": 10, "validation": 0, "best": 0}
    assert not {"train_epoch", "maybe_save_checkpoint", "maybe_update_best"} & vars(trainer).keys()
    assert trainer.val_epoch() == "own" and clock.seconds["validation"] == 0


def test_the_training_threads_time_on_a_core_is_its_cpu_time():
    """thread_schedstat reads the calling thread's own time on a core: in a thread spinning
    0.2 s of CPU time, while a third spins 0.4 s and the main thread waits, it grows by what
    that thread's time.thread_time says, not by the process's or the main thread's time."""
    import threading
    import time

    def spin(seconds):
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    if streaming_trainer.thread_schedstat() is None:
        pytest.skip("this kernel reports no schedstat")
    measured = {}

    def worker():
        # a thread that only just started may not be accounted yet (its schedstat reads zeros,
        # seen under load): it runs a little first
        spin(0.02)
        before, cpu0 = streaming_trainer.thread_schedstat(), time.thread_time()
        spin(0.2)
        after, cpu1 = streaming_trainer.thread_schedstat(), time.thread_time()
        measured.update(run=(after[0] - before[0]) / 1e9, cpu=cpu1 - cpu0,
                        waited=after[1] >= before[1])  # fmt: skip

    threads = [threading.Thread(target=worker), threading.Thread(target=spin, args=(0.4,))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert measured["run"] == pytest.approx(measured["cpu"], abs=0.02)
    assert measured["cpu"] == pytest.approx(0.2, abs=0.02) and measured["waited"]


def test_a_starved_training_thread_is_reported():
    """The fractions of a run between two readings, and the warning where the thread waited
    for a core more than 5 % of it."""
    shares = streaming_trainer.thread_shares((1_000, 0), (500_001_000, 200_000_000), 1.0)
    assert shares == {"cpu_fraction": 0.5, "runqueue_wait_fraction": 0.2}
    assert streaming_trainer.thread_shares(None, (1, 1), 1.0) is None
    assert streaming_trainer.thread_shares((1, 1), (2, 2), 0.0) is None  # no time between
    fine = streaming_trainer.thread_shares((0, 0), (123_456, 12_345), 1e-3)
    assert fine == {"cpu_fraction": 0.123, "runqueue_wait_fraction": 0.0123}  # 3 and 4 places
    line = streaming_trainer.starved_line(shares, 1)
    assert line.startswith("train: rank 1's training thread waited for a CPU core 20% of the run")
    assert "run fewer jobs beside it, or give it cores of its own" in line
    quiet = {"cpu_fraction": 0.9, "runqueue_wait_fraction": 0.05}
    assert streaming_trainer.starved_line(quiet, 0) is None
    assert streaming_trainer.starved_line(None, 0) is None


def test_the_host_waits_for_the_step_launched_limit_steps_before(monkeypatch):
    """StepsInFlight (CUDA stood in for by events that record their order and a wait on
    them): after each launch an event that blocks rather than spins; with more than ``limit``
    pending, the host waits for the oldest and counts the time as the GPU's. On a CPU the
    bound does nothing."""
    waited: list[int] = []

    class Event:
        made = 0

        def __init__(self, blocking=False):
            assert blocking  # the host sleeps on it, leaving its core to the loader threads
            Event.made += 1
            self.n = Event.made

        def record(self):
            pass

        def synchronize(self):
            waited.append(self.n)
            time.sleep(0.01)

    bound = streaming_trainer.StepsInFlight(limit=2)
    bound.launched()  # no GPU: nothing recorded
    assert not bound.pending and bound.wait_seconds == 0.0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    for _ in range(5):
        bound.launched()
    assert waited == [1, 2, 3]  # steps 1-3 waited for as steps 3-5 were launched
    assert [e.n for e in bound.pending] == [4, 5]
    assert bound.wait_seconds >= 0.03


def test_dataset_serves_speculators_contract_from_shards(pipeline):
    shards = [open_shard(p) for p in pipeline["shards"]]
    train_pairs, val_pairs = train_data.split_indices(shards, 0.1)
    every = [(s, i) for s, shard in enumerate(shards) for i in range(len(shard))]
    assert train_pairs == every[:-4] and val_pairs == every[-4:]  # the last tenth, disjoint
    ds = train_data.ShardDataset(pipeline["shards"], train_pairs, 256, torch.float32)
    item = ds[3]
    s, i = train_pairs[3]
    raw = shards[s].sample(i)
    n = raw["input_ids"].shape[0]
    assert item["hidden_states"].shape == (n, 3 * 64)
    assert item["verifier_last_hidden_states"].shape == (n, 64)
    # the three aux slots in order, side by side (speculators' layout)
    assert torch.equal(item["hidden_states"], raw["hidden_states"][:, :3].float().flatten(1))
    torch.testing.assert_close(
        item["verifier_last_hidden_states"], raw["hidden_states"][:, 3].float()
    )
    assert item["position_ids"].tolist() == list(range(n))
    assert ds.approx_lengths[3] == n


def test_rejected_samples_are_not_trained_on(pipeline):
    shards = [open_shard(p) for p in pipeline["shards"]]
    shards[0].valid = shards[0].valid.copy()
    shards[0].valid[1] = 0
    train_pairs, val_pairs = train_data.split_indices(shards, 0.1)
    kept = [(s, i) for s, shard in enumerate(shards) for i in range(len(shard)) if (s, i) != (0, 1)]
    assert len(kept) == 39 and train_pairs + val_pairs == kept
    assert val_pairs == kept[-4:] and not set(train_pairs) & set(val_pairs)


def rerun_pipeline_training(pipeline) -> dict:
    """train.train again on the pipeline's inputs and state folder (every epoch already done:
    it resumes), with another loader thread count (a resource, not an input)."""
    from dataclasses import replace

    return train.train(
        replace(pipeline["train_cfg"], loader_threads=1),
        pipeline["record"],
        pipeline["shards"],
        pipeline["manifests"],
        pipeline["vocab_map"],
        pipeline["dir"] / "state",
        pipeline["dir"] / "state" / "metrics.jsonl",
    )


def test_rerun_with_same_inputs_resumes_from_saved_state(pipeline):
    from torch._dynamo import config as dynamo

    with dynamo.patch(recompile_limit=8):  # torch's default
        stats = rerun_pipeline_training(pipeline)
        layers = pipeline["train_cfg"].num_layers
        assert dynamo.recompile_limit == train.draft_recompile_limit(layers)
    assert stats["resumed"] is True
    metrics = train.read_metrics(pipeline["dir"] / "state" / "metrics.jsonl")
    steps = [m["global_step"] for m in metrics if "train" in m]
    assert len(steps) == len(set(steps))  # every epoch was already done: no step ran again


def test_a_three_layer_drafts_compiled_frames_fit_the_recompile_limit(pipeline):
    """speculators compiles the draft's forward (on a GPU); its graph breaks at each TTT step
    and inside the first decoder layer, and dynamo compiles the layers' shared call frame again
    per layer. Counted here with dynamo's graph-only backend (flex attention has no CPU backward,
    so both modes run without grad; the GPU's grad-mode variants and inductor may add some:
    the factor 2 is a margin for them). A three-layer draft needs more than torch's default
    limit of 8, which on the H200 sent its validation to the uncompiled, unfused attention."""
    from speculators.losses.utils import resolve_loss_config
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from transformers.modeling_layers import GradientCheckpointingLayer

    from eagle3lib.config import TrainConfig
    from eagle3lib.verifier import allow_recompiles

    torch._dynamo.reset()
    cfg = TrainConfig(num_layers=3, draft_vocab_size=256)
    model = train.build_draft(
        cfg, pipeline["record"], [2, 4, 5], pipeline["vocab_map"], "simple_flex_attention"
    )
    data = train_data.ShardDataset(pipeline["shards"], [(0, 0), (0, 1)], 256, torch.float32)
    collate = CollateFn(256, 64, 3, torch.float32, preprocess=shift_batch)
    forward = torch.compile(model.forward, backend="eager")
    frame = GradientCheckpointingLayer.__call__.__code__
    allow_recompiles(train.draft_recompile_limit(cfg.num_layers))
    try:
        with torch.no_grad():
            for training in (True, False):
                model.train(training)
                for i in range(2):
                    forward(
                        **collate([data[i]]),
                        ttt_steps=cfg.ttt_steps,
                        loss_config=resolve_loss_config("kl_div", "eager"),
                    )
        entries = len(_debug_get_cache_entry_list(frame))
    finally:
        torch._dynamo.reset()
    assert entries > 8
    assert 2 * entries <= train.draft_recompile_limit(cfg.num_layers)


def test_training_reports_functions_that_reached_the_recompile_limit(pipeline, monkeypatch, capsys):
    """train.train returns (uncompiled_functions) and prints each function dynamo reported at
    its recompile limit while training ran; dynamo's warning is logged here as dynamo logs it."""
    import logging

    run_trainer = train._run_trainer

    def warned(*args, **kwargs):
        logging.getLogger("torch._dynamo.convert_frame").warning(
            "torch._dynamo hit config.%s (%s)\n   function: %s\n   last reason: %s",
            "recompile_limit",
            8,
            "'__call__' (modeling_layers.py:80)",
            "6/7: type id",
        )
        return run_trainer(*args, **kwargs)

    monkeypatch.setattr(train, "_run_trainer", warned)
    stats = rerun_pipeline_training(pipeline)
    assert stats["uncompiled_functions"] == ["'__call__' (modeling_layers.py:80)"]
    assert "reached its recompile limit on '__call__' (modeling_layers.py:80)" in (
        capsys.readouterr().err
    )


def test_compile_fallbacks_name_the_function_dynamo_gave_up_on():
    from torch._dynamo import config as dynamo

    from eagle3lib.verifier import compile_fallbacks

    def doubled(x):
        return x * 2

    torch._dynamo.reset()
    compiled = torch.compile(doubled, backend="eager")
    try:
        with dynamo.patch(recompile_limit=2), compile_fallbacks() as uncompiled:
            for dtype in (torch.float32, torch.float64, torch.int32, torch.int64):
                assert compiled(torch.ones(2, dtype=dtype)).tolist() == [2, 2]  # still right
    finally:
        torch._dynamo.reset()
    assert len(uncompiled) == 1
    assert uncompiled[0].startswith("'doubled' (") and "test_train.py" in uncompiled[0]


def test_changed_inputs_reset_the_state(tmp_path):
    from eagle3lib.fileio import fingerprinted_dir

    state = tmp_path / "state"
    assert fingerprinted_dir(state, {"lr": 1}) is False
    (state / "0").mkdir()
    assert fingerprinted_dir(state, {"lr": 1}) is True
    assert (state / "0").exists()
    assert fingerprinted_dir(state, {"lr": 2}) is False
    assert not (state / "0").exists()


def test_cpu_patches_are_scoped():
    from speculators.train import checkpointer, trainer

    before = (trainer.get_local_rank, trainer._StepTimer, checkpointer.get_current_device)
    with speculators_compat.cpu_trainer_patches():
        assert trainer.get_local_rank() == "cpu"
        assert checkpointer.get_current_device() == "cpu"
        timer = trainer._StepTimer(enabled=True)
        timer.mark("start")  # would call torch.accelerator.synchronize() unpatched
    assert (trainer.get_local_rank, trainer._StepTimer, checkpointer.get_current_device) == before


def test_flex_attention_on_cpu_is_refused():
    from eagle3lib.config import TrainConfig

    with pytest.raises(UserError, match="flex attention has no backward pass on CPU"):
        train.resolve_runtime(TrainConfig(attention="simple_flex_attention"))


@pytest.mark.parametrize("version", ["2.11.0+cu130", "2.13.0+cu130", "2.14.1"])
def test_train_loss_auto_is_the_eager_loss_on_a_gpu_at_any_torch(gpu_with_triton, version):
    """auto is the loss every GPU figure was measured with (and the graphed step's), not
    speculators' fused loss, also with the torch 2.13 the workflow installs."""
    from eagle3lib.config import TrainConfig

    gpu_with_triton(version)
    runtime = train.resolve_runtime(TrainConfig())
    assert (runtime["loss"], runtime["attention"]) == ("eager", "simple_flex_attention")


def test_the_fused_loss_is_refused_under_torch_before_2_13_and_taken_from_it_on(gpu_with_triton):
    from eagle3lib.config import TrainConfig

    gpu_with_triton("2.11.0+cu130")
    with pytest.raises(UserError) as refused:
        train.resolve_runtime(TrainConfig(loss="fused"))
    assert str(refused.value) == (
        "config key train.loss: the fused loss crashes under torch 2.11.0+cu130's compiler "
        "(https://github.com/pytorch/pytorch/issues/177600); use eager, or torch 2.13 or later"
    )
    gpu_with_triton("2.13.0+cu130")
    assert train.resolve_runtime(TrainConfig(loss="fused"))["loss"] == "fused"


class SkipsOneBatch(streaming_trainer.StreamingTrainer):
    """A mutation of ours: the second batch of the epoch is never trained on."""

    def _device_batches(self, loader):
        for k, item in enumerate(super()._device_batches(loader)):
            if k != 1:
                yield item


def test_streaming_trainer_trains_exactly_like_speculators_trainer(pipeline, tmp_path):
    """Same data, seed and steps: the loss of every step equals speculators' own loop; a
    skipped batch or another learning rate moves the losses beyond the bf16 tolerance."""

    from speculators.train.trainer import Trainer

    curves = {}
    runs = (
        ("speculators", Trainer, {}),
        ("streaming", streaming_trainer.StreamingTrainer, {}),
        ("skips-a-batch", SkipsOneBatch, {}),
        ("lr-1.5x", streaming_trainer.StreamingTrainer, {"lr": pipeline["train_cfg"].lr * 1.5}),
    )
    for name, cls, changes in runs:
        state = tmp_path / name
        train_pipeline(pipeline, state, trainer_class=cls, epochs=1, **changes)
        curves[name] = train.loss_curves(train.read_metrics(state / "m.jsonl"))
    ref = curves["speculators"]["train_loss"]
    assert len(curves["streaming"]["train_loss"]) >= 3
    assert curves["streaming"]["train_loss"] == ref
    assert curves["streaming"]["val"] == curves["speculators"]["val"]
    assert train.max_relative_difference(ref, curves["streaming"]["train_loss"]) == 0
    for mutant in ("skips-a-batch", "lr-1.5x"):
        difference = train.max_relative_difference(ref, curves[mutant]["train_loss"])
        assert difference > train.SAME_TRAINING_BF16_RTOL, mutant


def test_max_relative_difference():
    assert train.max_relative_difference([2.0, 4.0], [2.0, 3.0, 9.0]) == 0.25
    with pytest.raises(ValueError, match="no common steps to compare"):
        train.max_relative_difference([], [1.0])


def test_loader_threads_follow_the_threads_granted_per_process():
    from eagle3lib.config import TrainConfig

    cfg = TrainConfig()
    assert train.with_loader_threads(cfg, None, 0, 1).loader_threads == 4  # no limit given
    assert train.with_loader_threads(cfg, 6, 14, 2).loader_threads == 6  # 7 a process
    assert train.with_loader_threads(cfg, 6, 8, 2).loader_threads == 3  # fewer granted
    assert train.with_loader_threads(cfg, 6, 2, 4).loader_threads == 1
    assert train.with_loader_threads(cfg, 0, 8, 1).loader_threads == 0  # one-thread collate


def test_ffd_packing_trains(pipeline, tmp_path):
    """train.packing: ffd reaches the trainer (the sampler's own tests: test_batches.py)."""
    seen = []
    real = batches.FirstFitDecreasingSampler._generate_batches

    def recording(self, epoch):
        seen.append(epoch)
        return real(self, epoch)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(batches.FirstFitDecreasingSampler, "_generate_batches", recording)
        train_pipeline(pipeline, tmp_path / "s", epochs=1, max_steps=2, packing="ffd")
    curve = train.loss_curves(train.read_metrics(tmp_path / "s" / "m.jsonl"))
    assert seen and len(curve["train_loss"]) == 2
    assert all(math.isfinite(x) for x in curve["train_loss"])


@pytest.mark.parametrize("packing", ["ffd", "multipack"])
def test_validation_is_packed_by_speculators_sampler_whatever_the_training_packing(
    packing, monkeypatch
):
    """Validation batches are the same for every train.packing and seed (speculators' CLI's:
    multipack, seed 0), so validation losses compare across builds."""
    from eagle3lib.config import TrainConfig

    calls = []
    monkeypatch.setattr(train, "ShardDataset", lambda *args: args[1])  # the split's pairs
    monkeypatch.setattr(train, "make_loader", lambda *args: calls.append(args) or args)
    cfg = dataclasses.replace(TrainConfig(), packing=packing, seed=7)
    train._loaders(cfg, ["s.safetensors"], (["t"], ["v"]), 64, 3, torch.bfloat16, "bf16")
    (t, *_, t_seed, _, t_packing), (v, *_, v_seed, _, v_packing) = calls
    assert (t, t_seed, t_packing) == (["t"], 7, packing)
    assert (v, v_seed, v_packing) == (["v"], 0, "multipack")


def test_training_never_changes_the_drafts_buffers(pipeline, tmp_path):
    """What lets DDP skip re-sending them every step (StreamingTrainer.ddp_broadcast_buffers)."""
    seen = {}

    class Recording(streaming_trainer.StreamingTrainer):
        def run_training(self):
            seen["before"] = {k: v.clone() for k, v in self.model.named_buffers()}
            super().run_training()
            seen["after"] = dict(self.model.named_buffers())

    train_pipeline(pipeline, tmp_path / "s", trainer_class=Recording, epochs=1, max_steps=3)
    assert {"t2d", "d2t"} <= set(seen["before"])
    assert seen["before"].keys() == seen["after"].keys()
    for name, value in seen["before"].items():
        assert torch.equal(value, seen["after"][name]), name


def _buffer_broadcast_switch():
    from torch.nn.parallel import DistributedDataParallel

    module = torch.nn.Linear(2, 2)
    module.register_buffer("table", torch.arange(3))
    ddp = DistributedDataParallel(module)
    assert ddp.will_sync_module_buffers()
    streaming_trainer.stop_buffer_broadcast(ddp)
    assert not ddp.will_sync_module_buffers()
    ddp(torch.ones(1, 2)).sum().backward()  # still trains


def test_ddp_stops_broadcasting_buffers_when_asked():
    """The DDP module is freed (on the helper's return) before its process group is destroyed:
    freed after, its reducer would run the gloo group's destructor holding the GIL, which can
    hang on a worker thread that needs the GIL to drop its last allreduce
    (https://github.com/pytorch/pytorch/issues/56297); it hung this suite once."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        _buffer_broadcast_switch()
    finally:
        dist.destroy_process_group()


def test_a_failed_run_frees_its_modules_before_the_teardown(monkeypatch):
    """A training run that raises keeps its modules (a DDP one among them) in its traceback's
    frames; ``torn_down`` clears them, so that they are freed before the process group is torn
    down (the order the test above needs), and the error still reaches the caller."""
    import weakref

    from eagle3lib import distributed

    alive_at_teardown = []
    monkeypatch.setattr(
        distributed, "teardown_distributed", lambda: alive_at_teardown.append(module() is not None)
    )
    module = None

    def failing_step():
        nonlocal module
        model = torch.nn.Linear(2, 2)
        module = weakref.ref(model)
        raise ValueError("step failed")

    def failing_run():  # the module is in the traceback of the error it was raised from
        try:
            failing_step()
        except ValueError as exc:
            raise RuntimeError("training failed") from exc

    for run in (failing_step, failing_run):
        with pytest.raises((ValueError, RuntimeError), match="failed"), distributed.torn_down():
            run()
    assert alive_at_teardown == [False, False]
    with distributed.torn_down():
        pass
    assert alive_at_teardown == [False, False, False]


def test_max_steps_stops_training_and_keeps_a_checkpoint(pipeline, tmp_path):
    state = tmp_path / "s"
    stats = train_pipeline(pipeline, state, epochs=2, max_steps=2)
    curves = train.loss_curves(train.read_metrics(state / "m.jsonl"))
    assert curves["step"] == [0, 1]
    assert stats["final_epoch_dir"] == str(state / "1")


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_two_processes_train_and_export_once(pipeline, tmp_path, fsdp, request):
    """The train script relaunches itself under torchrun (gloo on CPU): 2 ranks, 1 export;
    the draft replicated (DDP) or sharded over the ranks (FSDP2, train.fsdp)."""
    import json
    from dataclasses import replace

    from conftest import run_training, train_command

    from eagle3lib import checkpoint

    if fsdp:
        cfg = replace(pipeline["train_cfg"], epochs=1, fsdp=True)
        run_training([*train_command(pipeline, tmp_path, cfg), "--processes", "2"], "fsdp")
        work = tmp_path
    else:  # the session's run (also the reference of the runs over two "nodes")
        work = request.getfixturevalue("two_process_training")["dir"]
    summary = json.loads((work / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["rank"] == 0 and summary["fsdp"] is fsdp
    # DDP's ranks checked that they ended with the same weights; sharded ones hold their own
    assert summary["ranks_agree"] is (None if fsdp else True)
    assert len(summary["curves"]["train_loss"]) >= 2
    assert checkpoint.check(work / "checkpoint", pipeline["record"], [2, 4, 5])["valid"] is True


def test_swap_in_flushes_the_checkpoint_before_it_replaces_the_old_one(tmp_path, monkeypatch):
    """The staged checkpoint's files reach the disk before the rename that publishes them, and
    the renames are flushed after (a power loss then leaves the old or the new checkpoint)."""
    final = tmp_path / "state" / "0"
    final.mkdir(parents=True)
    (final / "weights").write_text("old")
    new = tmp_path / "state" / "staging"
    (new / "sub").mkdir(parents=True)
    (new / "weights").write_text("new")
    calls = []
    real = train.fsync_tree

    def recording(path, recursive=True):
        calls.append((Path(path), recursive, (final / "weights").read_text()))
        real(path, recursive)

    monkeypatch.setattr(train, "fsync_tree", recording)
    train.swap_in(new, final)
    assert calls == [(new, True, "old"), (final.parent, False, "new")]
    assert (final / "weights").read_text() == "new" and not new.exists()
    assert not final.with_name("0.old").exists()


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32, None], ids=str)
@pytest.mark.parametrize("prev_rows", [1, 2, None], ids=["prev", "prev-broadcast", "no-prev"])
def test_accuracy_counts_equal_speculators_without_masked_select(mask_dtype, prev_rows):
    """The sync-free counts are speculators' counts, and prev_correct is updated the same
    (bool or float masks, as loss_mask.clone() makes prev_correct; a broadcasting prev)."""
    from speculators.models.metrics import compute_accuracy_single_step

    g = torch.Generator().manual_seed(3)
    pred = torch.randint(0, 4, (1, 300), generator=g)
    target = torch.randint(0, 4, (1, 300), generator=g)
    mask = (torch.rand(1, 300, generator=g) > 0.3).to(mask_dtype) if mask_dtype else None
    prev = None
    if prev_rows:
        prev = (torch.rand(prev_rows, 300, generator=g) > 0.2).to(mask_dtype or torch.bool)
    with_prev = prev is not None
    prev_ours = prev.clone() if with_prev else None
    theirs = compute_accuracy_single_step(pred, target, mask, prev)
    ours = speculators_compat.accuracy_counts(pred, target, mask, prev_ours)
    assert [t.dtype for t in ours] == [t.dtype for t in theirs] == [torch.float32] * 4
    assert [t.item() for t in ours] == [t.item() for t in theirs]
    assert 0 < ours[0].item() < ours[1].item()
    if with_prev:
        assert torch.equal(prev_ours, prev)


def test_scalar_tensors_are_filled_on_the_device_with_torch_tensors_dtype():
    """Python scalars on a non-CPU device (meta here, CUDA on a GPU) are filled there with the
    dtype torch.tensor would give; everything else is torch.tensor itself."""
    for value in (1.0, 0, True):
        made = speculators_compat.scalar_tensor(value, device="meta")
        assert (made.shape, made.dtype, made.device.type) == (
            torch.Size([]),
            torch.tensor(value).dtype,
            "meta",
        )
    assert (
        speculators_compat.scalar_tensor(2.5, device="meta", dtype=torch.float64).dtype
        == torch.float64
    )
    assert torch.equal(speculators_compat.scalar_tensor([1, 2]), torch.tensor([1, 2]))
    assert speculators_compat.scalar_tensor(3.0, device="cpu").item() == 3.0


def test_sync_free_patches_are_scoped():
    from speculators.models.eagle3 import core, metrics

    before = (metrics.compute_accuracy_single_step, metrics.torch, core.torch)
    with speculators_compat.speculators_patches("sync_free_eagle3"):
        assert metrics.compute_accuracy_single_step is speculators_compat.accuracy_counts
        assert core.torch.tensor is speculators_compat.scalar_tensor
        assert core.torch.cat is torch.cat and metrics.torch.argmax is torch.argmax
    assert (metrics.compute_accuracy_single_step, metrics.torch, core.torch) == before


def test_damaged_shards_lose_their_manifests_and_are_never_opened(pipeline, tmp_path):
    """Training hashes every shard (in parallel) against its manifest; each damaged one loses
    its manifest, so the next run rebuilds exactly those, and nothing is opened."""
    import shutil

    copies = []
    for shard, manifest in zip(pipeline["shards"], pipeline["manifests"], strict=True):
        shutil.copy(shard, tmp_path / shard.name)
        shutil.copy(manifest, tmp_path / manifest.name)
        copies.append((tmp_path / shard.name, tmp_path / manifest.name))
    shards, manifests = zip(*copies, strict=True)
    assert len(train_data.open_verified_shards(shards, manifests, {})) == 2  # intact: both open

    def flip(path):  # same size, other content: only the sha256 can tell
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))

    flip(shards[1])
    with pytest.raises(UserError, match=r"shard-1.safetensors: content does not match.*removed"):
        train_data.open_verified_shards(shards, manifests, {})
    assert manifests[0].exists() and not manifests[1].exists()

    shutil.copy(pipeline["manifests"][1], manifests[1])
    flip(shards[0])
    with pytest.raises(UserError, match=r"shard-0.*\(and 1 more damaged shard\(s\)\)"):
        train_data.open_verified_shards(shards, manifests, {})
    assert not manifests[0].exists() and not manifests[1].exists()


def test_files_hashed_ahead_are_read_once_and_a_changed_one_again(tmp_path, monkeypatch):
    """fileio.hash_ahead (the train job's first process starts it on its shards before its
    imports): sha256_file then takes each file's digest from its hashing thread, without
    reading it again; a file changed since is read again, and its new digest returned."""
    import hashlib

    from eagle3lib import fileio

    reads = []
    read = fileio._read_sha256

    def counted(path, chunk=1 << 22):
        reads.append(Path(path).name)
        return read(path, chunk)

    monkeypatch.setattr(fileio, "_read_sha256", counted)
    monkeypatch.setattr(fileio, "_AHEAD", {})  # this test's own
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(b"x" * 5_000_000)
    b.write_bytes(b"y" * 100)
    fileio.hash_ahead([a, b, tmp_path / "missing.bin"], threads=2)
    assert fileio.sha256_file(a) == hashlib.sha256(b"x" * 5_000_000).hexdigest()
    assert fileio.sha256_file(b) == hashlib.sha256(b"y" * 100).hexdigest()
    assert sorted(reads) == ["a.bin", "b.bin"]  # once each, by the hashing threads

    reads.clear()
    fileio.hash_ahead([a])
    (tmp_path / "new.bin").write_bytes(b"z" * 5_000_000)  # the same size, other bytes
    (tmp_path / "new.bin").replace(a)  # replaced after (or while) it was hashed
    assert fileio.sha256_file(a) == hashlib.sha256(b"z" * 5_000_000).hexdigest()
    assert reads.count("a.bin") in (1, 2)  # the changed file read again by sha256_file


def test_the_draft_is_built_on_the_rank_gpu_except_under_fsdp(monkeypatch):
    """train.draft_device: this rank's GPU (speculators' random initialisation there), the
    CPU without one and under FSDP over several processes (its set-up shards a CPU model)."""
    from eagle3lib.config import TrainConfig

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(train, "world_size", lambda: 2)
    assert train.draft_device(TrainConfig()) == torch.device("cuda", 3)
    assert train.draft_device(TrainConfig(fsdp=True)) is None
    monkeypatch.setattr(train, "world_size", lambda: 1)
    assert train.draft_device(TrainConfig(fsdp=True)) == torch.device("cuda", 3)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert train.draft_device(TrainConfig()) is None


def test_only_the_first_process_hashes_the_shards(pipeline, monkeypatch, tmp_path):
    """Under DDP the shards are checked before the process group is joined: the process that
    torchrun started as rank 0 (RANK) hashes them, the others only check their sizes."""
    import shutil

    from eagle3lib import fileio

    for path in (*pipeline["shards"], *pipeline["manifests"]):
        shutil.copy(path, tmp_path / path.name)
    shards = [tmp_path / p.name for p in pipeline["shards"]]
    manifests = [tmp_path / p.name for p in pipeline["manifests"]]
    reads = []
    monkeypatch.setattr(fileio, "_read_sha256", lambda path, chunk=0: reads.append(path) or "")
    monkeypatch.setenv("RANK", "1")
    assert len(train_data.open_verified_shards(shards, manifests, {})) == 2
    assert reads == []
    monkeypatch.setenv("RANK", "0")  # whose digests ("") match no manifest
    with pytest.raises(UserError, match="content does not match the sha256 in its manifest"):
        train_data.open_verified_shards(shards, manifests, {})
    assert len(reads) == 2


def test_fp8_batches_reach_the_draft_as_the_bf16_batches_quantized(pipeline, fp8_shards):
    """Same packing, same tokens; on the way into the draft's forward the fp8 bytes and scales
    become exactly the dequantized bf16 states (speculators' shift applied to both)."""
    from eagle3lib.shards import dequantize_fp8, quantize_fp8

    shards = [open_shard(p) for p in pipeline["shards"]]
    pairs, _ = train_data.split_indices(shards, 0.1)
    hook = train_data.fp8_inputs(torch.float32)
    loaders = [
        train_data.make_loader(
            train_data.ShardDataset(paths, pairs, 256, torch.float32, storage), 256, 64, 3, 0
        )
        for paths, storage in ((pipeline["shards"], "bf16"), (fp8_shards[0], "fp8"))
    ]
    n = 0
    for plain, fp8 in zip(*loaders, strict=True):
        assert "hidden_states" not in fp8 and fp8["fp8_aux"].dtype == torch.uint8
        _, kwargs = hook(None, (), dict(fp8))
        assert set(kwargs) == set(plain)
        for key in ("input_ids", "loss_mask", "position_ids", "document_ids"):
            assert torch.equal(kwargs[key], plain[key])
        for key, slots in (("hidden_states", 3), ("verifier_last_hidden_states", 1)):
            ref = plain[key].unflatten(-1, (slots, 64)).to(torch.bfloat16)
            expect = dequantize_fp8(*quantize_fp8(ref), torch.float32).flatten(-2)
            assert torch.equal(kwargs[key], expect)
            assert (kwargs[key] - plain[key]).abs().max() > 0  # really quantized
        n += 1
    assert n >= 2


def test_training_on_fp8_shards_follows_bf16_training(pipeline, fp8_shards, tmp_path):
    """The same run on fp8 shards: a checkpoint, finite losses close to the bf16 run's."""
    cfg = pipeline["train_cfg"]
    stats = train.train(
        cfg, pipeline["record"], *fp8_shards, pipeline["vocab_map"], tmp_path / "state",
        tmp_path / "metrics.jsonl",
    )  # fmt: skip
    assert Path(stats["final_epoch_dir"]).exists()
    fp8 = train.loss_curves(train.read_metrics(tmp_path / "metrics.jsonl"))["train_loss"]
    bf16 = train.loss_curves(train.read_metrics(pipeline["dir"] / "state" / "metrics.jsonl"))[
        "train_loss"
    ]
    assert len(fp8) == len(bf16) >= 4
    assert fp8 != bf16  # the fp8 states were used
    for a, b in zip(fp8, bf16, strict=True):
        assert math.isfinite(a) and abs(a - b) <= 0.02 * abs(b)


@pytest.mark.parametrize(
    "seconds, text", [(0.4, "0 s"), (42, "42 s"), (200, "3 min 20 s"), (3725, "1 h 02 min")]
)
def test_duration(seconds, text):
    assert streaming_trainer.duration(seconds) == text


def test_progress_line_extrapolates_from_this_runs_pace():
    # a resumed run: steps 100..120 took 60 s here, 180 steps are left at 3 s each
    line = streaming_trainer.progress_line(120, 300, 1, 3, 24_000, 60.0, 20)
    assert line == (
        "train: step 120/300 (epoch 2/3), 400 tokens/s, 1 min 00 s elapsed, about 9 min 00 s left"
    )


def test_progress_prints_the_first_step_then_every_interval_and_the_last(monkeypatch):
    import io

    clock = iter([0.0, 100.0, 101.0, 111.5, 112.0, 113.0])  # the first step compiles: 100 s
    monkeypatch.setattr(train.time, "perf_counter", lambda: next(clock))
    out = io.StringIO()
    progress = streaming_trainer.TrainingProgress(epochs=1, every=10.0, stream=out)
    progress.epoch_started(0, 0, 5)
    for step in range(1, 6):
        progress.step(step, 0, 100, data_wait=12.0)
    lines = out.getvalue().splitlines()
    assert lines[0] == (
        "train: step 1/5 (epoch 1/1), first step in 1 min 40 s (12 s of it waiting for its "
        "batch, the rest set-up, any compilation and the step); pace from the next steps"
    )
    assert streaming_trainer.first_step_line(1, 5, 0, 1, 100.0) == (
        "train: step 1/5 (epoch 1/1), first step in 1 min 40 s (compilation and loading "
        "included); pace from the next steps"
    )
    assert [line.split(" (")[0] for line in lines[1:]] == ["train: step 3/5", "train: step 5/5"]
    # steps 2-3 (200 tokens) in 11.5 s after the first; 2 steps left at 5.75 s each
    assert lines[1].endswith(
        "17 tokens/s, 1 min 52 s elapsed, about 12 s left; 5,750.0 ms a step since the last line"
    )
    # steps 2-5 (400 tokens) in 13 s after the first: the first step's 100 s not in the pace;
    # since the line before, steps 4-5 in 1.5 s
    assert lines[-1].endswith(
        "31 tokens/s, 1 min 53 s elapsed, about 0 s left; 750.0 ms a step since the last line"
    )


def test_progress_total_follows_each_epochs_step_count_and_max_steps():
    progress = streaming_trainer.TrainingProgress(epochs=3)
    progress.epoch_started(0, 0, 71)
    assert progress.total == 213
    progress.epoch_started(2, 141, 70)  # the packing gave the last epoch one step less
    assert progress.total == 211
    capped = streaming_trainer.TrainingProgress(epochs=3, max_steps=100)
    capped.epoch_started(0, 0, 71)
    assert capped.total == 100


def test_streaming_trainer_prints_progress_to_stderr(pipeline, tmp_path, capfd):
    state = tmp_path / "s"
    train_pipeline(pipeline, state, epochs=2)
    steps = len(train.loss_curves(train.read_metrics(state / "m.jsonl"))["step"])
    lines = [x for x in capfd.readouterr().err.splitlines() if x.startswith("train: step")]
    assert lines[0].startswith("train: step 1/")
    assert (
        " of it waiting for its batch, the rest set-up, any compilation and the step)" in lines[0]
    )
    assert lines[-1].startswith(f"train: step {steps}/{steps} (epoch 2/2), ")
    assert "tokens/s" in lines[-1] and "about 0 s left; " in lines[-1]
    assert lines[-1].endswith(" ms a step since the last line")


class SignalledAt(streaming_trainer.StreamingTrainer):
    """Sends itself ``signum`` once ``at`` steps are done (from its step callback), or, with
    ``at`` None, during the last epoch's validation (after the last step)."""

    at: int | None = None
    signum = signal.SIGTERM

    def train_epoch(self, epoch, *, step_callback=None):
        def callback():
            if self.global_step == self.at:
                signal.raise_signal(self.signum)

        super().train_epoch(epoch, step_callback=callback)

    def val_epoch(self, epoch):
        if self.at is None and epoch == self.config.num_epochs - 1:
            signal.raise_signal(self.signum)
        return super().val_epoch(epoch)


@pytest.mark.parametrize(
    ("where", "signum"),
    [
        ("mid-epoch", signal.SIGTERM),
        ("epoch-end", signal.SIGINT),
        ("after-training", signal.SIGTERM),
    ],
)
def test_a_stop_signal_saves_the_state_after_the_step_and_the_rerun_ends_with_the_same_bytes(
    pipeline, tmp_path, capfd, where, signum
):
    """SIGTERM (how schedulers preempt) or SIGINT during training: the step finishes, its
    state is saved where a rerun resumes from it, the job exits 128 + the signal; the rerun
    runs each remaining step once and ends with an uninterrupted run's bytes and curves."""
    reference = tmp_path / "reference"
    train_pipeline(pipeline, reference, epochs=2)
    ref_metrics = train.read_metrics(reference / "m.jsonl")
    total = len([m for m in ref_metrics if "train" in m])
    first_epoch = len([m for m in ref_metrics if "train" in m and m["epoch"] == 0])
    at = {"mid-epoch": 3, "epoch-end": first_epoch, "after-training": None}[where]
    stopping = type("Stopping", (SignalledAt,), {"at": at, "signum": signum})

    state = tmp_path / "state"
    capfd.readouterr()
    with pytest.raises(SystemExit) as stopped:
        train_pipeline(pipeline, state, trainer_class=stopping, epochs=2)
    assert stopped.value.code == 128 + signum
    err = capfd.readouterr().err
    name = signal.Signals(signum).name
    if at is None:
        assert (
            f"train: stopped by {name} after the last step; the last epoch's state is saved" in err
        )
        last = train.read_metrics(state / "m.jsonl")[-1]
        assert "val" in last and last["epoch"] == 1  # the validation it came in finished
    else:
        assert f"train: stopped by {name} after step {at} (epoch 1); the state after it" in err
        saved = json.loads((state / "0" / "training_state.json").read_text())
        assert saved == {"epoch": 0, "local_step": at, "global_step": at}
        assert not (state / "1").exists()
    assert not (state / "interrupted").exists()  # speculators' own handler's folder

    stats = train_pipeline(pipeline, state, epochs=2)
    assert stats["resumed"] is True
    if at is not None:  # the rerun's progress counts the steps run before it
        epoch = 1 if at < first_epoch else 2
        assert f"train: step {at + 1}/{total} (epoch {epoch}/2), first step in" in (
            capfd.readouterr().err
        )
    steps = [m["global_step"] for m in train.read_metrics(state / "m.jsonl") if "train" in m]
    assert steps == list(range(total))  # no step lost or run twice
    final = Path(stats["final_epoch_dir"])
    assert final == state / "1"
    assert_same_bytes(final / "model.safetensors", reference / "1" / "model.safetensors")
    curves = train.loss_curves(train.read_metrics(state / "m.jsonl"))
    reference_curves = train.loss_curves(ref_metrics)
    assert curves["train_loss"] == reference_curves["train_loss"]
    assert curves["val"] == reference_curves["val"]


def test_a_ddp_vote_cast_after_an_epochs_last_step_stops_before_its_validation(
    pipeline, tmp_path, capfd, monkeypatch
):
    """Under DDP a stop is voted on between logging steps and the vote read a step later; a
    vote cast after an epoch's last step is read at the epoch's end, so the job stops there,
    not after a validation, a save and the next epoch's first step. One rank in a gloo group
    of one in this process (torchrun's variables set): DDP's code path, votes and all. No
    logging step after step 0, and votes due every (steps an epoch - 1) steps: the first is
    cast after the first epoch's last step, when the signal has come."""
    from eagle3lib import distributed

    metrics = train.read_metrics(pipeline["dir"] / "state" / "metrics.jsonl")
    first_epoch = len([m for m in metrics if "train" in m and m["epoch"] == 0])
    one_torchrun_rank(monkeypatch)
    monkeypatch.setattr(streaming_trainer, "STOP_VOTE_STEPS", first_epoch - 1)
    stopping = type("Stopping", (SignalledAt,), {"at": first_epoch})
    state = tmp_path / "state"
    capfd.readouterr()
    with pytest.raises(SystemExit) as stopped, distributed.torn_down():
        train_pipeline(pipeline, state, trainer_class=stopping, epochs=2, log_every=1000)
    assert stopped.value.code == 128 + signal.SIGTERM
    err = capfd.readouterr().err
    assert f"train: stopped by SIGTERM after step {first_epoch} (epoch 1); the state" in err, err
    saved = json.loads((state / "0" / "training_state.json").read_text())
    assert saved == {"epoch": 0, "local_step": first_epoch, "global_step": first_epoch}
    assert not [m for m in train.read_metrics(state / "m.jsonl") if "val" in m]


class DdpRecorded(streaming_trainer.StreamingTrainer):
    seen: dict

    def run_training(self):
        super().run_training()
        self.seen["bucket_view"] = self.model.gradient_as_bucket_view
        self.seen["grad_is_bucket"] = [
            p.grad is not None and p.grad.untyped_storage().nbytes() > p.grad.nbytes
            for p in self.model.module.parameters()
            if p.requires_grad
        ]
        weights = self.model.module.state_dict()
        self.seen["weights"] = {k: v.clone() for k, v in weights.items()}


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_ddp_gradients_as_bucket_views_train_the_same_weights(
    pipeline, tmp_path, monkeypatch, optimizer
):
    """StreamingTrainer.ddp_gradient_as_bucket_view reaches speculators' DDP (torch's
    gradient_as_bucket_view: each gradient a view of an all-reduce bucket, so several share
    one storage), and the draft trains to the same bytes as with DDP's copies. One rank in a
    gloo group of one in this process: DDP's code path, its reducer and all-reduce."""
    from eagle3lib import distributed

    one_torchrun_rank(monkeypatch)
    runs = {}
    for view in (False, True):
        runs[view] = {}
        recorded = type(
            "Recorded", (DdpRecorded,), {"seen": runs[view], "ddp_gradient_as_bucket_view": view}
        )
        with distributed.torn_down():
            train_pipeline(
                pipeline, tmp_path / str(view), recorded, epochs=1, max_steps=4, optimizer=optimizer
            )
    assert (runs[False]["bucket_view"], runs[True]["bucket_view"]) == (False, True)
    assert not any(runs[False]["grad_is_bucket"])
    assert any(runs[True]["grad_is_bucket"])
    assert runs[False]["weights"].keys() == runs[True]["weights"].keys()
    for name, value in runs[False]["weights"].items():
        assert torch.equal(value, runs[True]["weights"][name]), name


class SavesRecorded(streaming_trainer.StreamingTrainer):
    saves: list

    def maybe_save_checkpoint(self, epoch, local_step: int = 0):
        self.saves.append((epoch, local_step))
        return super().maybe_save_checkpoint(epoch, local_step=local_step)


def test_mid_epoch_states_are_saved_at_speculators_cadence(pipeline, tmp_path):
    """train.checkpoint_freq 0.25 of a 17-step epoch: as speculators' own loop, a state after
    every round(17 x 0.25) = 4 steps while a quarter of that interval is left (steps 4, 8, 12
    and 16), then the epoch's own save (local step 0: the epoch done)."""
    saves = []
    recorded = type("Recorded", (SavesRecorded,), {"saves": saves})
    train_pipeline(pipeline, tmp_path / "state", recorded, epochs=1, checkpoint_freq=0.25)
    metrics = train.read_metrics(tmp_path / "state" / "m.jsonl")
    assert len([m for m in metrics if "train" in m]) == 17
    assert saves == [(0, 4), (0, 8), (0, 12), (0, 16), (0, 0)]


def test_the_weights_checksum_tells_a_one_bit_change():
    """A DDP train job ends by checking that its ranks hold the same weights
    (distributed.ranks_agree): equal weights give equal checksums, a one-bit change in a
    parameter of any dtype a different one. One process is in no group: nothing to check."""
    import copy

    from eagle3lib import distributed

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2).bfloat16())
    before = distributed.weights_checksum(model)
    assert torch.equal(before, distributed.weights_checksum(copy.deepcopy(model)))
    for p in model.parameters():
        bits = p.data.view(-1).view({4: torch.int32, 2: torch.int16}[p.element_size()])
        bits[0] ^= 1
        assert not torch.equal(before, distributed.weights_checksum(model))
        bits[0] ^= 1
    assert torch.equal(before, distributed.weights_checksum(model))
    assert distributed.ranks_agree(model) is None


def test_keeping_the_newest_states_asks_room_for_those_up_to_keep_and_one_staged():
    """train.states_to_add: keeping every epoch's state, each one to come; keeping the newest
    k and the best, as many as bring those on the disk to k + 1 (the best may be an older
    one), and one more staged before the oldest goes; never more than the epochs to come."""
    assert [train.states_to_add(5, 0, 1), train.states_to_add(0, 0, 1)] == [5, 0]
    assert [train.states_to_add(left, 1, 1) for left in (0, 1, 2, 5)] == [0, 1, 2, 2]
    assert [train.states_to_add(left, 3, 1) for left in (1, 2, 3, 4, 9)] == [1, 2, 3, 4, 4]
    assert [train.states_to_add(9, 3, 3), train.states_to_add(9, 1, 2)] == [2, 1]


def test_the_disk_warning_counts_only_the_states_kept(tmp_path):
    """Keeping the newest state and the best (train.keep_states: 1, the default), with one on
    the disk 3 epochs to come need room for two more at once: no warning with 9 GB free for
    4.1 GB states, and the line says so where that does not fit."""
    assert train.disk_warning(4_100_000_000, 9_000_000_000, 3, tmp_path, 1, 1) is None
    line = train.disk_warning(4_100_000_000, 5_000_000_000, 3, tmp_path, 1, 1)
    assert line == (
        "train: warning: an epoch's state takes 4.1 GB and 3 more are to be saved, keeping the "
        f"newest 1 (room for 2 more at once: 8.2 GB), but {tmp_path} has 5 GB free: free disk "
        "space before then, or the job stops at a full disk (a rerun resumes from the last "
        "state saved)"
    )


def test_prune_states_removes_only_epoch_folders_older_than_the_newest_kept(tmp_path):
    """train.prune_states: the newest ``keep`` epoch folders holding a model stay, and the one
    speculators' ``checkpoint_best`` links to; older ones go; anything else in the state
    folder (metrics, a folder without a model, a staging or moved-aside folder, speculators'
    ``interrupted``) is left; keep 0 removes nothing."""
    for name in ("0", "1", "2", "3", "10", "interrupted", "4.old", ".staging"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"x")
    (tmp_path / "11").mkdir()  # no model: not a checkpoint (a save under way writes staging)
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "checkpoint_best").symlink_to("1", target_is_directory=True)  # as speculators
    assert train.prune_states(tmp_path, 0) == []
    removed = train.prune_states(tmp_path, 2)  # by number: 10 is the newest
    assert removed == [tmp_path / "0", tmp_path / "2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".staging", "1", "10", "11", "3", "4.old", "checkpoint_best", "interrupted",
        "metrics.jsonl",
    ]  # fmt: skip
    (tmp_path / "checkpoint_best").unlink()
    assert train.prune_states(tmp_path, 1) == [tmp_path / "1", tmp_path / "3"]
    assert train.last_epoch_dir(tmp_path) == tmp_path / "10"
    assert not list(tmp_path.glob(".pruning-*"))


def test_an_older_state_cut_short_in_its_removal_is_removed_on_the_next_start(tmp_path):
    """prune_states renames a folder out of the epochs' names before removing it; what a kill
    leaves of it (``.pruning-<epoch>``) no resume reads and recover_state_dir removes."""
    (tmp_path / ".pruning-0").mkdir()
    (tmp_path / ".pruning-0" / "optimizer_state_dict.pt").write_bytes(b"x")
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "model.safetensors").write_bytes(b"x")
    assert train.last_epoch_dir(tmp_path) == tmp_path / "1"
    train.recover_state_dir(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1"]


def test_a_state_that_cannot_be_removed_is_a_warning_not_a_failure(tmp_path, capsys, monkeypatch):
    """Removing an older state is housekeeping: where it fails (here the rename before the
    removal, as a busy NFS folder fails it), the job says which folder to remove by hand and
    goes on."""
    import errno
    import os

    for name in ("0", "1"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"x")

    def busy(src, dst):
        raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(src))

    monkeypatch.setattr(train.os, "rename", busy)
    assert train.prune_states(tmp_path, 1) == [tmp_path / "0"]
    assert (tmp_path / "0" / "model.safetensors").exists()
    err = capsys.readouterr().err
    assert err == (
        f"train: warning: could not remove the older state {tmp_path / '0'} ([Errno 16] "
        f"Device or resource busy: '{tmp_path / '0'}'); remove it by hand to free its space\n"
    )


class WorseLater(streaming_trainer.StreamingTrainer):
    """Its validation loss is the epoch's number: the first epoch stays the best."""

    def val_epoch(self, epoch):
        return {**(super().val_epoch(epoch) or {}), "loss_epoch": float(epoch)}


def test_a_run_keeps_the_newest_state_and_the_best_after_each_save(
    pipeline, tmp_path, monkeypatch, capfd
):
    """Three epochs whose first validates best: train.keep_states 1 (the default) leaves, after
    each save, the newest state and the best (the one speculators' checkpoint_best links to);
    0 every epoch's. Stopped by SIGTERM in the second epoch and resumed, the keep-1 run reads
    the best back (its link stays on the first epoch) and ends with the same folders and
    final bytes; a keep-0 state resumes under keep 1 (the key is not part of what is trained)
    and is pruned at its end."""
    from eagle3lib import train as train_module

    seen = []
    prune = train_module.prune_states

    def spy(state, keep):
        removed = prune(state, keep)
        seen.append(sorted(p.name for p in train.epoch_dirs(state)))
        return removed

    monkeypatch.setattr(train_module, "prune_states", spy)

    def run(name, keep, trainer_class=WorseLater):
        seen.clear()
        state = tmp_path / name
        stats = train_pipeline(pipeline, state, trainer_class, epochs=3, keep_states=keep)
        return state, stats, list(seen)

    every, _, every_seen = run("every", 0)
    kept, stats, kept_seen = run("kept", 1)
    # after each of the three saves, then after training
    assert every_seen == [["0"], ["0", "1"], ["0", "1", "2"], ["0", "1", "2"]]
    assert kept_seen == [["0"], ["0", "1"], ["0", "2"], ["0", "2"]]
    assert Path(stats["final_epoch_dir"]) == kept / "2"
    for state in (every, kept):
        assert (state / "checkpoint_best").readlink().name == "0"
    assert_same_bytes(kept / "2" / "model.safetensors", every / "2" / "model.safetensors")

    first_epoch = len([m for m in train.read_metrics(kept / "m.jsonl")
                       if "train" in m and m["epoch"] == 0])  # fmt: skip
    stopping = type("Stopping", (WorseLater, SignalledAt), {"at": first_epoch + 2})
    capfd.readouterr()
    with pytest.raises(SystemExit):
        run("stopped", 1, stopping)
    # the run's step, not the epoch's (2)
    assert f"stopped by SIGTERM after step {first_epoch + 2} (epoch 2);" in capfd.readouterr().err
    stopped = tmp_path / "stopped"
    assert [p.name for p in train.epoch_dirs(stopped)] == ["0", "1"]
    _, stats, _ = run("stopped", 1)
    assert stats["resumed"] is True
    assert [p.name for p in train.epoch_dirs(stopped)] == ["0", "2"]
    assert (stopped / "checkpoint_best").readlink().name == "0"
    assert_same_bytes(stopped / "2" / "model.safetensors", kept / "2" / "model.safetensors")

    _, stats, _ = run("every", 1)
    assert stats["resumed"] is True and train.epoch_dirs(every) == [every / "0", every / "2"]


def test_the_disk_warning_names_the_sizes_only_when_the_epochs_to_come_do_not_fit(tmp_path):
    """train.disk_warning: epochs_left states of state_bytes each against the free bytes."""
    assert train.disk_warning(4_000_000_000, 8_000_000_000, 2, tmp_path) is None  # just fits
    assert train.disk_warning(4_000_000_000, 0, 0, tmp_path) is None  # the last epoch saved
    line = train.disk_warning(4_100_000_000, 8_000_000_000, 2, tmp_path)
    assert line == (
        "train: warning: an epoch's state takes 4.1 GB and 2 more are to be saved (8.2 GB), "
        f"but {tmp_path} has 8 GB free: free disk space before then, or the job stops at a "
        "full disk (a rerun resumes from the last state saved)"
    )


def test_a_thread_the_kernel_has_not_accounted_yet_has_no_reading(monkeypatch):
    """/proc/thread-self/schedstat reads zeros for a thread that only just started: no
    reading, rather than a share of 0 % on a core."""

    class Proc:
        text = "0 0 0"

        def __init__(self, _path):
            pass

        def read_text(self):
            return Proc.text

    monkeypatch.setattr(streaming_trainer, "Path", Proc)
    assert streaming_trainer.thread_schedstat() is None
    Proc.text = "5 7 1"
    assert streaming_trainer.thread_schedstat() == (5, 7)


class FinishedWork:
    def wait(self):
        pass


def test_the_stop_vote_is_due_every_ten_steps_without_a_logging_step(monkeypatch):
    """Between DDP's logging steps (whose metrics' all-reduce carries a stop) the ranks vote
    after every STOP_VOTE_STEPS steps; a logging step or a vote starts the count again; a
    vote counts once, read after the next step (all_reduce stood in for: one process)."""
    import torch.distributed as dist

    reduced = []
    monkeypatch.setattr(
        dist, "all_reduce", lambda flag, async_op: reduced.append(flag) or FinishedWork()
    )
    vote = streaming_trainer.StopVote()
    assert [vote.due(False) for _ in range(10)] == [False] * 9 + [True]
    assert vote.due(True) is False  # a logging step agreed
    assert [vote.due(False) for _ in range(10)][-1] is True
    assert vote.counted() is False  # none cast
    vote.cast(True, "cpu")
    assert vote.due(False) is False  # the count started again
    assert vote.counted() is True and vote.counted() is False
    vote.cast(False, "cpu")
    assert vote.counted() is False
    assert [f.item() for f in reduced] == [1.0, 0.0]


def one_thread_trainer():
    return streaming_trainer.StreamingTrainer.__new__(streaming_trainer.StreamingTrainer)


def test_one_loader_thread_keeps_the_order_and_reraises_the_loaders_error():
    """train.loader_threads: 0 (or DataLoader workers): one background thread iterates the
    loader; its batches come in order, and an error it meets is raised in the training thread
    after the batches before it."""

    def failing():
        yield from ({"k": k} for k in range(2))
        raise ValueError("a damaged shard")

    trainer = one_thread_trainer()
    assert [b["k"] for b, _ in trainer._one_thread([{"k": k} for k in range(7)], 2)] == list(
        range(7)
    )
    got = []
    with pytest.raises(ValueError, match="a damaged shard"):
        for batch, _release in trainer._one_thread(failing(), 2):
            got.append(batch["k"])
    assert got == [0, 1]


def test_an_epoch_ended_early_stops_the_loader_thread():
    """Closing the batches (an epoch cut short by max_steps or a stop) ends the loader thread
    at once, without reading the loader to its end."""
    import threading

    read = []

    def endless():
        k = 0
        while True:
            read.append(k)
            yield {"k": k}
            k += 1

    batches = one_thread_trainer()._one_thread(endless(), 2)
    assert next(batches)[0]["k"] == 0
    batches.close()
    assert not [t for t in threading.enumerate() if t.name == "batch-prefetch"]
    assert len(read) <= 5  # the first batch, the queue's 2 and the ones blocked on putting


def test_the_wait_for_each_batch_is_counted_as_data_wait():
    """The training thread's time blocked on its next batch adds up over the epoch."""

    class SlowLoader:
        num_workers = 0

        def __iter__(self):
            for k in range(4):
                time.sleep(0.05)
                yield {"k": k}

    trainer = one_thread_trainer()
    trainer.loader_threads = 0
    assert [b["k"] for b, _ in trainer._prefetched(SlowLoader(), depth=1)] == [0, 1, 2, 3]
    assert trainer.data_wait_seconds >= 4 * 0.05 * 0.9


def test_metrics_are_logged_every_log_every_steps_with_the_rate_as_a_number(pipeline, tmp_path):
    """train.log_every: 3 logs global steps 0, 3, 6, ... (speculators' cadence), AdamW's rate
    as a number, and a pace in tokens a second in each record."""
    train_pipeline(pipeline, tmp_path / "s", epochs=1, log_every=3)
    records = [r for r in train.read_metrics(tmp_path / "s" / "m.jsonl") if "train" in r]
    steps = json.loads((tmp_path / "s" / "0" / "training_state.json").read_text())
    assert [r["global_step"] for r in records] == list(range(0, steps["global_step"], 3))
    assert len(records) >= 3
    assert all(type(r["lr"]) is float for r in records)
    assert all(r["profile"]["tokens_per_s"] > 0 for r in records)


def copied_shards(pipeline, tmp_path):
    """The pipeline's shards and manifests copied into tmp_path (so they can be changed)."""
    shards, manifests = [], []
    for shard, manifest in zip(pipeline["shards"], pipeline["manifests"], strict=True):
        shutil.copy(shard, tmp_path / shard.name)
        shutil.copy(manifest, tmp_path / manifest.name)
        shards.append(tmp_path / shard.name)
        manifests.append(tmp_path / manifest.name)
    return shards, manifests


# catches these mutations: '(and 0 more damaged shard(s))' for one, the whole check_shard text
# kept
def test_one_damaged_shard_is_one_line_naming_it_and_its_removed_manifest(pipeline, tmp_path):
    """One damaged shard: the first clause of its problem, no '(and N more ...)', the manifest
    removed, what to do: exactly this line."""
    shards, manifests = copied_shards(pipeline, tmp_path)
    data = bytearray(shards[1].read_bytes())
    data[len(data) // 2] ^= 0xFF
    shards[1].write_bytes(bytes(data))
    with pytest.raises(UserError) as err:
        train_data.open_verified_shards(shards, manifests, {})
    assert str(err.value) == (
        f"{shards[1]}: content does not match the sha256 in its manifest (corrupt); removed its "
        f"manifest {manifests[1]}: rerun the workflow to rebuild this shard"
    )


# catches these mutations: zip without strict=True: a shard without its manifest silently left out
def test_shards_and_manifests_must_pair_up(pipeline, tmp_path):
    """Two shards with one manifest is a programming error, never a silent one-shard run."""
    shards, manifests = copied_shards(pipeline, tmp_path)
    with pytest.raises(ValueError, match="zip"):
        train_data.open_verified_shards(shards, manifests[:1], {})


# catches these mutations: ThreadPoolExecutor(max_workers=0) for no shards
def test_no_shards_open_to_none():
    """No shards: nothing to check, an empty list (split_indices then says why it can't train)."""
    assert train_data.open_verified_shards([], [], {}) == []


# catches these mutations: every call hashes every shard again, ignoring _VERIFIED
def test_a_shard_is_hashed_once_per_process_until_it_changes(pipeline, tmp_path, monkeypatch):
    """The first check hashes each shard; a second check of the same unchanged files reads
    none (size and mtime unchanged); a rewritten file is hashed again."""
    import os

    from eagle3lib import fileio

    shards, manifests = copied_shards(pipeline, tmp_path)
    reads = []
    read = fileio._read_sha256
    monkeypatch.setattr(
        fileio,
        "_read_sha256",
        lambda p, chunk=1 << 22: reads.append(Path(p).name) or read(p, chunk),
    )
    monkeypatch.setattr(train_data, "_VERIFIED", set())
    monkeypatch.delenv("RANK", raising=False)
    assert len(train_data.open_verified_shards(shards, manifests, {})) == 2
    assert sorted(reads) == ["shard-0.safetensors", "shard-1.safetensors"]
    assert len(train_data.open_verified_shards(shards, manifests, {})) == 2
    assert len(reads) == 2  # both known: not read again
    st = shards[0].stat()
    os.utime(shards[0], ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    train_data.open_verified_shards(shards, manifests, {})
    assert reads[2:] == ["shard-0.safetensors"]  # touched: hashed again


def only_valid(pipeline, keep):
    """The pipeline's shards with every sample but those in ``keep`` rejected."""
    shards = [open_shard(p) for p in pipeline["shards"]]
    for s, shard in enumerate(shards):
        shard.valid = shard.valid.copy()
        shard.valid[:] = 0
        for ks, ki in keep:
            if ks == s:
                shard.valid[ki] = 1
    return shards


# catches these mutations: len(pairs) < 1: one sample gives an empty training set
def test_one_usable_sample_is_refused(pipeline):
    """One usable sample (the others rejected for NaN): a UserError, not a run on nothing."""
    shards = only_valid(pipeline, [(1, 3)])
    with pytest.raises(
        UserError, match=r"rejected for non-finite .* 1 usable; training needs at least 2"
    ):
        train_data.split_indices(shards, 0.1)
    two = train_data.split_indices(only_valid(pipeline, [(0, 2), (1, 3)]), 0.1)
    assert two == ([(0, 2)], [(1, 3)])


# catches these mutations: n_val up to len(pairs): nothing left to train on, max(0, ...): n_val 0
# makes pairs[:-0] empty and validation everything
@pytest.mark.parametrize(("fraction", "n_val"), [(0.01, 1), (0.1, 4), (0.5, 20), (0.99, 39)])
def test_the_split_keeps_at_least_one_sample_on_each_side(pipeline, fraction, n_val):
    """40 samples: validation is the last round(40 * fraction) of them, at least 1 and at
    most 39, so training always keeps the first ones."""
    shards = [open_shard(p) for p in pipeline["shards"]]
    every = [(s, i) for s, shard in enumerate(shards) for i in range(len(shard))]
    train_pairs, val_pairs = train_data.split_indices(shards, fraction)
    assert train_pairs == every[: 40 - n_val] and val_pairs == every[40 - n_val :]


# catches these mutations: __getstate__ keeps the open shards: each DataLoader worker gets a copy
# of them
def test_a_pickled_dataset_reopens_its_shards(pipeline):
    """What a spawned DataLoader worker receives: the dataset without its memory maps (not
    copies of whole shards), which it reopens on first use and serves the same samples from."""
    ds = train_data.ShardDataset(pipeline["shards"], [(0, 0), (1, 2)], 256, torch.float32)
    want = ds[1]
    assert ds._shards is not None
    data = pickle.dumps(ds)
    assert len(data) < 10_000
    copy = pickle.loads(data)
    assert copy._shards is None
    got = copy[1]
    assert all(torch.equal(got[k], want[k]) for k in want)


# catches these mutations: placeholder scales [T, aux*H] instead of [T, aux], last scales [T, H]
def test_the_fp8_placeholder_batch_has_a_real_batchs_keys_shapes_and_dtypes(pipeline, fp8_shards):
    """A batch without any sample (CollateFn's placeholder) from an fp8 dataset has the keys,
    shapes and dtypes of a real fp8 batch (as the hook and a compiled draft expect), its states
    all zero."""
    from speculators.train.data import CollateFn

    shards = [open_shard(p) for p in fp8_shards[0]]
    pairs, _ = train_data.split_indices(shards, 0.1)
    ds = train_data.ShardDataset(fp8_shards[0], pairs, 256, torch.float32, "fp8")
    real = next(iter(train_data.make_loader(ds, 256, 64, 3, 0)))
    empty = CollateFn(256, 64, 3, torch.float32, train_data.shift_fp8_batch)([])
    for key, value in real.items():  # (the placeholder adds speculators' "__recovery__")
        if isinstance(value, torch.Tensor):
            assert (empty[key].shape, empty[key].dtype) == (value.shape, value.dtype), key
    assert empty["fp8_aux_scales"].shape == (1, 256, 3)
    assert empty["fp8_last_scales"].shape == (1, 256)
    for key in train_data.FP8_KEYS:
        assert not empty[key].any(), key


# catches these mutations: the hook assumes 3 aux layers
@pytest.mark.parametrize("n_aux", [1, 2, 4])
def test_fp8_inputs_dequantizes_any_number_of_aux_layers(n_aux):
    """The pre-hook splits fp8_aux by its scales' count (the aux layers), whatever it is: the
    states are exactly dequantize_fp8 of each slot, side by side; other kwargs pass."""
    from eagle3lib.shards import dequantize_fp8, quantize_fp8

    torch.manual_seed(0)
    aux_states, last_states = torch.randn(1, 5, n_aux, 8), torch.randn(1, 5, 8)
    aux, aux_scales = quantize_fp8(aux_states)
    last, last_scales = quantize_fp8(last_states)
    kwargs = {
        "fp8_aux": aux.view(torch.uint8).flatten(-2),
        "fp8_aux_scales": aux_scales,
        "fp8_last": last.view(torch.uint8),
        "fp8_last_scales": last_scales,
        "input_ids": torch.arange(5)[None],
    }
    _, out = train_data.fp8_inputs(torch.float32)(None, (), kwargs)
    assert set(out) == {"input_ids", "hidden_states", "verifier_last_hidden_states"}
    assert out["hidden_states"].shape == (1, 5, n_aux * 8)
    assert torch.equal(
        out["hidden_states"], dequantize_fp8(aux, aux_scales, torch.float32).flatten(-2)
    )
    assert torch.equal(
        out["verifier_last_hidden_states"], dequantize_fp8(last, last_scales, torch.float32)
    )


# catches these mutations: the sampler's seed ignored
def test_the_loaders_batches_follow_the_seed(pipeline):
    """The same seed gives the same batches; another seed packs or orders them differently."""
    shards = [open_shard(p) for p in pipeline["shards"]]
    pairs, _ = train_data.split_indices(shards, 0.1)
    ds = train_data.ShardDataset(pipeline["shards"], pairs, 256, torch.float32)

    def order(seed):
        return [list(b) for b in train_data.make_loader(ds, 256, 64, 3, seed).batch_sampler]

    assert order(0) == order(0)
    assert order(0) != order(1)


def test_a_diverging_training_stops_at_the_logging_step_naming_the_loss_and_train_lr(
    pipeline, tmp_path
):
    """A learning rate far too large makes the loss NaN (and every weight after it): the job
    stops at the first logging step that sees it, naming the step and train.lr, instead of
    exporting a draft that proposes one id whatever it is given."""
    state = tmp_path / "s"
    with pytest.raises(UserError) as raised:
        train_pipeline(pipeline, state, optimizer="adamw", lr=1e10, log_every=1, epochs=1)
    message = str(raised.value)
    logged = [json.loads(line) for line in (state / "m.jsonl").read_text().splitlines()]
    losses = [r["train"]["loss"] for r in logged if "train" in r]
    assert all(math.isfinite(x) for x in losses[:-1]) and not math.isfinite(losses[-1])
    step = [r["global_step"] for r in logged if "train" in r][-1]
    assert message.startswith(f"train: the loss is nan at step {step} (epoch 0, learning rate ")
    assert message.endswith("the training diverged; lower train.lr (each logging step's loss: "
                            "train/state/metrics.jsonl)")  # fmt: skip
