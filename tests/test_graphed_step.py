"""eagle3lib.graphed_step on a CPU: what can be checked without a GPU (the capture itself
needs one: bench/train.py's ours_ffd_graph variant runs it)."""

import pytest
import torch

from eagle3lib.errors import UserError
from eagle3lib.graphed_step import capturable_optimizers, copy_into, detached


def test_copy_into_writes_the_captured_tensors_in_place():
    static = {"input_ids": torch.zeros(1, 4, dtype=torch.long), "ttt_steps": 3}
    held = static["input_ids"]
    copy_into(static, {"input_ids": torch.tensor([[1, 2, 3, 4]]), "ttt_steps": 3})
    assert static["input_ids"] is held  # the graph reads this memory
    assert held.tolist() == [[1, 2, 3, 4]]
    static["error_records"] = 0  # the loop logs the host batch's count, not the graph's
    copy_into(static, {"input_ids": torch.ones(1, 4, dtype=torch.long), "ttt_steps": 3,
                       "error_records": 2})  # fmt: skip
    assert held.tolist() == [[1, 1, 1, 1]]


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        ({"input_ids": torch.zeros(1, 5, dtype=torch.long), "ttt_steps": 3}, "'input_ids'"),
        ({"input_ids": torch.zeros(1, 4), "ttt_steps": 3}, "one shape"),
        ({"input_ids": torch.zeros(1, 4, dtype=torch.long), "ttt_steps": 2}, "changed from 3"),
        ({"input_ids": torch.zeros(1, 4, dtype=torch.long)}, "keys"),
    ],
)
def test_copy_into_refuses_what_the_graph_did_not_capture(batch, message):
    static = {"input_ids": torch.zeros(1, 4, dtype=torch.long), "ttt_steps": 3}
    with pytest.raises(UserError, match=message):
        copy_into(static, batch)
    assert static["input_ids"].sum() == 0


@pytest.mark.filterwarnings("ignore:Detected call of .lr_scheduler.step")
def test_adamw_becomes_capturable_and_its_scheduler_fills_the_rate_in_place():
    params = [torch.nn.Parameter(torch.ones(2))]
    opt = torch.optim.AdamW(params, lr=0.5, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))
    capturable_optimizers([opt], torch.device("cpu"))
    group = opt.param_groups[0]
    rate = group["lr"]
    assert group["capturable"] is True
    assert isinstance(rate, torch.Tensor) and rate.item() == 0.5
    assert rate.dtype == torch.float32
    sched.step()
    assert group["lr"] is rate  # the captured step reads this tensor
    assert rate.item() == 0.25


def test_optimisers_other_than_adamw_and_batched_muon_are_refused_by_name():
    """torch's Muon (speculators' own, or the large matrices with train.newton_schulz:
    standard) takes its rate as a number; BatchedMuon split over DDP's ranks is refused too."""
    from eagle3lib.muon import BatchedMuon

    muon = torch.optim.Muon([torch.nn.Parameter(torch.ones(2, 2))], lr=0.02)
    with pytest.raises(UserError, match="Muon cannot be captured.*newton_schulz: gram"):
        capturable_optimizers([muon], torch.device("cpu"))
    split = BatchedMuon([torch.nn.Parameter(torch.ones(2, 2))], lr=0.02)
    split.ranks = object()
    with pytest.raises(UserError, match="split over ranks"):
        capturable_optimizers([split], torch.device("cpu"))


def test_foreach_adamw_becomes_capturable_with_its_step_counts_kept():
    """speculators' AdamW beside Muon is foreach: its eager steps' counts (on the CPU) move to
    the capture's device as float32 tensors, their values kept, and its rate becomes a tensor."""
    weight = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([weight], lr=0.5, foreach=True)
    for _ in range(3):
        weight.grad = torch.ones(2)
        opt.step()
    capturable_optimizers([opt], torch.device("cpu"))
    group, step = opt.param_groups[0], opt.state[weight]["step"]
    assert group["capturable"] is True and isinstance(group["lr"], torch.Tensor)
    assert step.dtype == torch.float32 and step.item() == 3.0


def test_an_eager_steps_outputs_leave_their_autograd_history_behind():
    weight = torch.nn.Parameter(torch.ones(2))
    loss = (weight * 2).sum()
    metrics = {"loss": loss * 1, "steps": 3}
    out_loss, out_metrics = detached((loss, metrics))
    assert loss.grad_fn is not None and out_loss.grad_fn is None
    assert out_metrics["loss"].grad_fn is None and out_metrics["steps"] == 3
    assert out_loss.item() == 4.0


@pytest.mark.parametrize(
    ("changes", "processes", "gpu", "message"),
    [
        ({}, 1, False, "needs a GPU"),
        ({}, 2, True, "one GPU only"),
        ({"fsdp": True}, 1, True, "one GPU only"),
        ({"packing": "multipack"}, 1, True, "train.packing: ffd"),
        ({"newton_schulz": "standard"}, 1, True, "train.newton_schulz: gram"),
    ],
)
def test_train_graph_step_is_refused_where_it_cannot_run(changes, processes, gpu, message):
    from dataclasses import replace

    from eagle3lib.config import TrainConfig
    from eagle3lib.graphed_step import refusal

    assert refusal(TrainConfig(), 1, True) is None  # the default recipe on one GPU
    assert refusal(TrainConfig(optimizer="adamw", newton_schulz="standard"), 1, True) is None
    assert message in refusal(replace(TrainConfig(), **changes), processes, gpu)


@pytest.mark.parametrize(
    ("setting", "changes", "processes", "gpu", "graphed", "reason"),
    [
        ("auto", {}, 1, True, True, "captured into one CUDA graph (train.graph_step: auto)"),
        ("auto", {"optimizer": "adamw"}, 1, True, True, "graph (train.graph_step: auto)"),
        (
            "auto",
            {},
            1,
            False,
            False,
            "eagerly (train.graph_step: auto; a graphed step: it needs a GPU",
        ),
        ("auto", {}, 2, True, False, "a graphed step: it runs on one GPU only"),
        ("auto", {"packing": "multipack"}, 1, True, False, "it needs batches of one shape"),
        ("auto", {"newton_schulz": "standard"}, 1, True, False, "train.newton_schulz: gram"),
        (True, {}, 1, True, True, "captured into one CUDA graph (train.graph_step: true)"),
        (False, {}, 1, True, False, "the step run eagerly (train.graph_step: false)"),
        (False, {}, 1, False, False, "the step run eagerly (train.graph_step: false)"),
    ],
)
def test_graph_step_auto_graphs_where_it_can_run_and_says_why_not(
    setting, changes, processes, gpu, graphed, reason
):
    from dataclasses import replace

    from eagle3lib.config import TrainConfig
    from eagle3lib.graphed_step import decide

    assert TrainConfig().graph_step == "auto"  # the default
    cfg = replace(TrainConfig(), graph_step=setting, **changes)
    got, why = decide(cfg, processes, gpu, True, MEASURED)
    assert got is graphed and reason in why, why
    if setting == "auto":  # speculators' own Trainer (trainer_class) steps eagerly
        got, why = decide(cfg, processes, gpu, False, MEASURED)
        assert got is False and "needs eagle3lib's StreamingTrainer" in why, why


# what resolve_runtime gives on a GPU by default (the graphed step's measured setting)
MEASURED = {"attention": "simple_flex_attention", "loss": "eager", "dtype": None}


@pytest.mark.parametrize("value", ["true", "yes", 1, 0, None, "Auto"])
def test_a_graph_step_value_other_than_auto_true_or_false_is_an_error_naming_it(value):
    from dataclasses import replace

    from eagle3lib.config import TrainConfig
    from eagle3lib.graphed_step import decide

    with pytest.raises(UserError, match=r"^train.graph_step: .*; use auto, true or false$"):
        decide(replace(TrainConfig(), graph_step=value), 1, True, True, MEASURED)


@pytest.mark.parametrize(
    ("runtime", "reason"),
    [
        ({"loss": "fused"}, "not yet run with train.loss fused (set it true to try)"),
        ({"attention": "sdpa"}, "not yet run with train.attention sdpa (set it true to try)"),
        (
            {"attention": "eager", "loss": "fused"},
            "not yet run with train.attention eager and train.loss fused (set it true to try)",
        ),
    ],
)
def test_graph_step_auto_keeps_the_step_eager_with_an_attention_or_loss_not_yet_measured(
    runtime, reason
):
    """auto graphs only what was timed and compared on a GPU (flex attention, the eager loss);
    true still captures the others."""
    from dataclasses import replace

    from eagle3lib.config import TrainConfig
    from eagle3lib.graphed_step import decide

    resolved = MEASURED | runtime
    got, why = decide(TrainConfig(), 1, True, True, resolved)
    assert got is False and why.endswith(f"a graphed step: {reason})"), why
    assert decide(replace(TrainConfig(), graph_step=True), 1, True, True, resolved)[0] is True


@pytest.mark.parametrize(("processes", "gpu"), [(1, False), (2, True)])
def test_graph_step_true_where_it_cannot_run_is_an_error_naming_the_key(processes, gpu):
    from dataclasses import replace

    from eagle3lib.config import TrainConfig
    from eagle3lib.graphed_step import decide

    with pytest.raises(
        UserError,
        match=r"^train.graph_step: true, but it (needs a GPU|runs on one GPU only \(.*\)); "
        r"set it to auto \(graphed where it can run\) or false$",
    ):
        decide(replace(TrainConfig(), graph_step=True), processes, gpu, True, MEASURED)


def test_the_train_job_with_graph_step_auto_runs_eagerly_on_a_cpu_and_says_so(
    pipeline, tmp_path, capfd
):
    """The default on a CPU trains (the eager step) and its log line names the key and why."""
    from conftest import train_pipeline

    stats = train_pipeline(pipeline, tmp_path / "s", epochs=1, max_steps=2, graph_step="auto")
    assert stats["graph_step"] is False
    err = capfd.readouterr().err
    assert (
        "train: the step run eagerly (train.graph_step: auto; a graphed step: it needs a GPU)\n"
        in err
    ), err


@pytest.mark.parametrize("trainer", ["streaming", "streaming_with_syncs", "speculators"])
def test_the_train_job_decides_with_its_trainer_and_resolved_runtime(
    pipeline, tmp_path, monkeypatch, trainer
):
    """train.train asks decide with the trainer it runs (StreamingTrainer with sync-free
    metrics, or not) and the attention and loss it resolved, and hands the trainer the bool
    decided (never auto). decide is recorded here: on a CPU the real one refuses first."""
    from conftest import train_pipeline
    from speculators.train.trainer import Trainer

    from eagle3lib import train
    from eagle3lib.streaming_trainer import StreamingTrainer

    trainer_class = {
        "streaming": StreamingTrainer,
        "streaming_with_syncs": type("Syncs", (StreamingTrainer,), {"sync_free": False}),
        "speculators": Trainer,
    }[trainer]
    asked, given = [], []
    monkeypatch.setattr(
        train, "decide_graph_step", lambda *a: asked.append(a) or (False, "recorded")
    )
    original = train._run_trainer  # noqa: SLF001

    def run_trainer(cls, model, config, loaders, cfg, *rest):
        given.append(cfg.graph_step)
        return original(cls, model, config, loaders, cfg, *rest)

    monkeypatch.setattr(train, "_run_trainer", run_trainer)
    train_pipeline(pipeline, tmp_path / "s", trainer_class, epochs=1, max_steps=1)
    ((cfg, processes, gpu, streaming, runtime),) = asked
    assert cfg.graph_step == "auto" and processes == 1 and gpu is False
    assert streaming is (trainer == "streaming")
    assert runtime == train.resolve_runtime(cfg)
    assert given == [False]


def test_the_train_job_refuses_graph_step_on_a_cpu_before_training(pipeline, tmp_path):
    """train.train says why, naming the key, and leaves no state behind."""
    from conftest import train_pipeline

    state = tmp_path / "state"
    state.mkdir()
    with pytest.raises(UserError, match=r"^train.graph_step: true, but it needs a GPU"):
        train_pipeline(pipeline, state, graph_step=True)
    assert list(state.iterdir()) == []


def test_a_graphed_runs_saved_optimiser_state_loads_back_into_an_eager_step():
    """State saved with capturable rates (a graphed run's) and loaded into a new optimiser
    becomes an eager one's again (plain_rates, which StreamingTrainer.setup_optimizer applies):
    rate a number, capturable off, step counts on the CPU, and its next step on a CPU gives
    the update of an optimiser that never was capturable, to the bit."""
    from eagle3lib.graphed_step import plain_rates

    def stepped(convert: bool):
        weight = torch.nn.Parameter(torch.arange(4.0))
        opt = torch.optim.AdamW([weight], lr=0.5, foreach=True)
        for k in range(3):
            weight.grad = torch.full((4,), float(k + 1))
            opt.step()
        if convert:
            capturable_optimizers([opt], torch.device("cpu"))
            fresh = torch.optim.AdamW([weight], lr=0.1, foreach=True)
            fresh.load_state_dict(opt.state_dict())
            plain_rates([fresh])
            opt = fresh
        weight.grad = torch.ones(4)
        opt.step()
        return weight.detach(), opt

    plain, _ = stepped(False)
    resumed, opt = stepped(True)
    group, step = opt.param_groups[0], opt.state[opt.param_groups[0]["params"][0]]["step"]
    assert group["lr"] == 0.5 and type(group["lr"]) is float and group["capturable"] is False
    assert step.device.type == "cpu" and step.item() == 4.0
    assert torch.equal(resumed, plain)


@pytest.mark.filterwarnings("ignore:Detected call of .lr_scheduler.step")
def test_a_graphed_runs_checkpoint_saves_its_rates_as_numbers(monkeypatch):
    """StreamingTrainer's save (speculators' maybe_save_checkpoint, stood in for here) runs
    with every rate tensor swapped for its value and the schedulers' last rates as numbers,
    so the saved state holds no device tensor; afterwards the step reads, and the scheduler
    fills, the same tensor as before."""
    import io

    from speculators.train.trainer import Trainer

    from eagle3lib.streaming_trainer import StreamingTrainer

    weight = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([weight], lr=0.5, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))
    capturable_optimizers([opt], torch.device("cpu"))
    rate = opt.param_groups[0]["lr"]
    sched.step()
    assert isinstance(sched.get_last_lr()[0], torch.Tensor)  # torch clones the tensor there
    saved = {}

    def save(self, epoch, local_step=0):
        buffer = io.BytesIO()
        torch.save([self.optimizers[0].state_dict(), sched.state_dict()], buffer)
        buffer.seek(0)
        saved["state"] = torch.load(buffer, weights_only=True)

    monkeypatch.setattr(Trainer, "maybe_save_checkpoint", save)
    trainer = object.__new__(StreamingTrainer)
    trainer.optimizers, trainer.schedulers = [opt], [sched]
    trainer.maybe_save_checkpoint(0)
    optimizer_state, scheduler_state = saved["state"]
    assert optimizer_state["param_groups"][0]["lr"] == 0.25
    assert type(optimizer_state["param_groups"][0]["lr"]) is float
    assert [type(x) for x in scheduler_state["_last_lr"]] == [float]
    assert scheduler_state["_last_lr"] == [0.25]
    assert opt.param_groups[0]["lr"] is rate
    sched.step()
    assert rate.item() == pytest.approx(0.5 / 3)


def test_a_graphed_runs_optimisers_are_capturable_from_its_first_eager_step(monkeypatch):
    """StreamingTrainer makes its optimisers capturable when it builds the GraphedStep, before
    that step's eager calls, not at the capture: the eager steps before the capture (and a
    resumed run's, whose loaded state plain_rates made eager) take the update the replayed
    graph takes. The capture's own preparation only sets the gradients to None. On a CPU
    the CUDA device is faked and capturable_optimizers recorded."""
    from eagle3lib import graphed_step
    from eagle3lib.streaming_trainer import StreamingTrainer

    weight = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([weight], lr=0.5)
    trainer = StreamingTrainer.__new__(StreamingTrainer)  # only what _graphed_step reads
    trainer.optimizers, trainer.local_rank, trainer.is_distributed = [opt], 0, False
    trainer._graphed = None  # noqa: SLF001
    made = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(graphed_step, "capturable_optimizers", lambda o, d: made.append((o, d)))
    step = trainer._graphed_step()  # noqa: SLF001
    assert made == [([opt], torch.device("cuda", 0))] and step.calls == 0
    assert trainer._graphed_step() is step and len(made) == 1  # noqa: SLF001 - kept
    weight.grad = torch.ones(2)
    step.prepare()
    assert weight.grad is None and len(made) == 1


def test_copy_into_refuses_a_later_key_before_copying_an_earlier_one():
    static = {"input_ids": torch.zeros(1, 4, dtype=torch.long), "ttt_steps": 3}
    with pytest.raises(UserError, match="changed from 3"):
        copy_into(static, {"input_ids": torch.ones(1, 4, dtype=torch.long), "ttt_steps": 2})
    assert static["input_ids"].sum() == 0


def test_capturable_optimizers_put_rates_and_step_counts_on_the_capture_device():
    """On the GPU (meta stands in) the rate and a foreach AdamW's step counts move there; left
    on the CPU, the captured step would not read them (a rate number is baked in)."""
    from eagle3lib.muon import BatchedMuon

    weight = torch.nn.Parameter(torch.ones(2))
    adamw = torch.optim.AdamW([weight], lr=0.5, foreach=True)
    weight.grad = torch.ones(2)
    adamw.step()
    muon = BatchedMuon([torch.nn.Parameter(torch.ones(2, 2))], lr=0.02)
    capturable_optimizers([adamw, muon], torch.device("meta"))
    assert adamw.state[weight]["step"].device.type == "meta"
    for opt in (adamw, muon):
        assert opt.param_groups[0]["lr"].device.type == "meta"


def test_plain_rates_leave_fused_adamws_step_counts_on_the_device():
    """Fused AdamW reads its step counts on the device, captured or not: an eager resume
    leaves them there (meta stands in for the GPU) and turns only the rate into a number."""
    from eagle3lib.graphed_step import plain_rates

    weight = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([weight], lr=0.5, fused=True, capturable=True)
    opt.param_groups[0]["lr"] = torch.tensor(0.5)
    opt.state[weight]["step"] = torch.tensor(3.0, device="meta")
    plain_rates([opt])
    assert opt.state[weight]["step"].device.type == "meta"
    assert opt.param_groups[0]["lr"] == 0.5 and opt.param_groups[0]["capturable"] is False


class GraphRecorder:
    """torch.cuda.CUDAGraph and torch.cuda.graph stood in for on a CPU: the capture and each
    replay recorded with the captured inputs' values at that time (a replay reruns nothing)."""

    def __init__(self, monkeypatch, fail_at_exit: bool = False):
        import contextlib

        from eagle3lib.graphed_step import GraphedStep

        self.events, self.step = [], None
        recorder = self

        class Graph:
            def replay(self):
                recorder.events.append(("replay", recorder.step.static["x"].tolist()))

        @contextlib.contextmanager
        def graph(_graph, stream=None, capture_error_mode=None):
            self.events.append(("capture", capture_error_mode))
            try:
                yield
            except Exception:
                if fail_at_exit:  # as ending a capture broken by the step fails in torch
                    raise RuntimeError("operation not permitted when stream is capturing") from None
                raise

        monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
        monkeypatch.setattr(torch.cuda, "graph", graph)
        monkeypatch.setattr(GraphedStep, "_on_side_stream", lambda _self, run, _batch: run())


def test_a_graphed_step_runs_eagerly_then_captures_once_and_replays_each_batch(monkeypatch):
    """GraphedStep's order of work (the capture itself needs a GPU): ``eager_steps`` eager
    calls on their own batches, outputs detached; then ``prepare`` and one capture on a copy
    of the next batch, replayed at once; every later batch copied into the captured inputs
    and replayed, the graph's same output tensors returned each time."""
    from eagle3lib.graphed_step import GraphedStep

    recorder = GraphRecorder(monkeypatch)
    weight = torch.nn.Parameter(torch.ones(1))

    def step(batch, autocast_cache):
        recorder.events.append(("step", batch["x"].tolist(), autocast_cache))
        loss = (weight * batch["x"]).sum()
        return loss, {"loss": loss}

    graphed = GraphedStep(step, lambda: recorder.events.append(("prepare",)), eager_steps=2)
    recorder.step = graphed
    outputs = [graphed({"x": torch.tensor([float(k)])}) for k in range(1, 6)]
    assert recorder.events == [
        ("step", [1.0], False),
        ("step", [2.0], False),
        ("prepare",),
        ("capture", "thread_local"),
        ("step", [3.0], False),
        ("replay", [3.0]),
        ("replay", [4.0]),
        ("replay", [5.0]),
    ]
    assert all(loss.grad_fn is None for loss, _ in outputs[:2])
    assert outputs[2] is outputs[3] is outputs[4] is graphed.outputs


@pytest.mark.parametrize("fail_at_exit", [True, False], ids=["capture_end_fails", "plain"])
def test_a_step_that_fails_in_the_capture_is_named_not_hidden(monkeypatch, fail_at_exit):
    """A step that raises inside the capture: where ending the capture fails too (torch's
    error would say only that), the step's own error is named; otherwise it propagates."""
    from eagle3lib.graphed_step import GraphedStep

    GraphRecorder(monkeypatch, fail_at_exit=fail_at_exit)

    def step(batch, _autocast_cache):
        if batch is graphed.static:  # the capture's copy of its batch
            raise ValueError("a shape the graph cannot hold")
        return batch["x"].sum(), {}

    graphed = GraphedStep(step, lambda: None, eager_steps=1)
    graphed({"x": torch.ones(1)})
    error, message = (
        (RuntimeError, "the capture failed: ValueError: a shape")
        if fail_at_exit
        else (ValueError, "^a shape the graph cannot hold$")
    )
    with pytest.raises(error, match=message):
        graphed({"x": torch.ones(1)})
    assert graphed.graph is None
