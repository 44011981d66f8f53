"""StreamingTrainer.train_epoch's bookkeeping on a stand-in model and loader (no pipeline):
what its metric records say, when it saves, where it stops."""

import collections
import contextlib
import io
import signal
import types

import pytest
import torch
from speculators.train import trainer as st
from speculators.train.recovery import RECOVERY_METADATA_KEY

from eagle3lib import streaming_trainer
from eagle3lib.lifetime import StopRequest


class Draft(torch.nn.Module):
    """One weight; each call is half a second of the stand-in clock (a record's interval can
    be under a second) and 0.125 s of data wait and 0.25 s of GPU wait on its trainer; its
    loss 2 with a gradient of 0.2 a real token; its metrics a loss (a sum and its count) and a 1 (a value of its own, averaged over DDP's
    ranks)."""

    def __init__(self, now, trainer):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))
        self.now, self.trainer = now, trainer
        self.modes = []

    def forward(self, document_ids, error_records):  # only a batch's own keys
        self.now[0] += 0.5
        self.modes.append(self.training)
        self.trainer.data_wait_seconds += 0.125
        self.trainer._in_flight.wait_seconds += 0.25
        # 2, with a gradient of 0.2 a real token
        loss = (self.w - self.w.detach()).sum() * 0.2 * (document_ids != -1).sum() + 2.0
        metrics = {
            "loss_sum": loss.detach(),
            "loss_total": torch.tensor(1.0),
            "one": torch.tensor(1.0),
        }
        return None, loss, metrics


class Loader(list):
    num_workers = 0
    batch_sampler = None


def batches(n, tokens=3):
    """n batches of ``tokens`` real tokens (and one padding), batch k with k error records."""
    ids = torch.tensor([[0] * tokens + [-1]])
    loader = Loader({"document_ids": ids, "error_records": k} for k in range(n))
    if loader:  # the key a rank's empty batch carries, never passed to the model
        loader[0][RECOVERY_METADATA_KEY] = {}
    return loader


class Stopped(Exception):
    """The stand-in trainer's stop_here: (epoch, local step)."""


def trainer_on(monkeypatch, loader, *, log_freq=2, optimizers=1, **config):
    now = [0.0]
    monkeypatch.setattr(
        streaming_trainer, "time", types.SimpleNamespace(perf_counter=lambda: now[0])
    )
    trainer = streaming_trainer.StreamingTrainer.__new__(streaming_trainer.StreamingTrainer)
    model = Draft(now, trainer)
    opts = [torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.Adam(model.parameters())]
    config = {
        "max_steps": None,
        "log_freq": log_freq,
        "checkpoint_freq": 1.0,
        "save_best": False,
        "hidden_states_dtype": torch.bfloat16,
        "train_call_kwargs": None,
        **config,
    }
    trainer.__dict__.update(
        model=model,
        train_loader=loader,
        optimizers=opts[:optimizers],
        # the rate doubles every step: a record shows the rate of its own step
        schedulers=[torch.optim.lr_scheduler.LambdaLR(opts[0], lambda s: 2.0**s)],
        config=collections.namedtuple("Config", config)(**config),  # speculators' is one
        device_type="cpu",
        local_rank=0,
        rank=0,
        is_distributed=False,
        global_step=0,
        loader_threads=0,
        _in_flight=streaming_trainer.StepsInFlight(),
        stop_request=StopRequest(),
        saves=[],
    )
    trainer._prepare_resume_skip = lambda epoch: 0
    trainer.maybe_save_checkpoint = lambda epoch, local_step=0: trainer.saves.append(local_step)

    def stop_here(epoch, local_step):
        raise Stopped(epoch, local_step)

    trainer.stop_here = stop_here
    records = []
    monkeypatch.setattr(st.metric_logger, "info", lambda record, extra: records.append(record))
    return trainer, records


def test_each_record_covers_the_steps_since_the_one_before(monkeypatch):
    """log_every 2: records at global steps 0, 2, 4; each one's pace, data wait and GPU wait
    over the steps since the record before (the first: its own step), the rate its step used
    and that step's batch's error records; the model in training mode; the next epoch starts
    between logging steps (global step 5) and adds to the waits."""
    trainer, records = trainer_on(monkeypatch, batches(5))
    trainer.model.eval()  # as the validation before it left it
    launched = []  # StepsInFlight told of each step (on a GPU it bounds the steps ahead)
    trainer._in_flight.launched = lambda: launched.append(trainer.global_step)
    trainer.train_epoch(0)
    assert trainer.model.modes == [True] * 5 and launched == [0, 1, 2, 3, 4]
    assert trainer.global_step == 5
    assert [r["global_step"] for r in records] == [0, 2, 4]
    assert [r["lr"] for r in records] == [pytest.approx(0.1 * 2**s) for s in (0, 2, 4)]
    for r in records:
        assert r["epoch"] == 0
        assert r["profile"] == pytest.approx(
            {"tokens_per_s": 6.0, "data_wait_fraction": 0.25, "gpu_wait_fraction": 0.5}
        )
    assert [r["train"] for r in records] == [
        {"loss": 2.0, "one": 1.0, "error_records": k} for k in (0.0, 2.0, 4.0)
    ]
    trainer.train_epoch(1)  # the waits add up over the epochs
    assert trainer.gpu_wait_seconds == 2.5 and trainer.data_wait_seconds == 1.25
    assert [r["global_step"] for r in records[3:]] == [6, 8]


def test_each_step_zeroes_the_gradients_clips_them_to_norm_1_and_steps(monkeypatch):
    """Gradients 0.6, 0.6 (not 1.2: zeroed between steps), then 3 clipped to 1; SGD at the
    scheduler's rates 0.1, 0.2, 0.4."""
    trainer, _ = trainer_on(monkeypatch, Loader([*batches(2), *batches(1, tokens=15)]))
    trainer.train_epoch(0)
    assert trainer.model.w.item() == pytest.approx(1 - 0.1 * 0.6 - 0.2 * 0.6 - 0.4, abs=1e-5)


@pytest.mark.parametrize(
    "gpu, distributed, sync_free, reason",
    [
        (False, False, True, "one process on a GPU only (no CPU, no DDP)"),
        (True, True, True, "one process on a GPU only (no CPU, no DDP)"),
        (True, False, False, "needs the sync-free loss metrics (sync_free)"),
    ],
)
def test_a_graphed_step_is_refused_where_it_cannot_run(
    monkeypatch, gpu, distributed, sync_free, reason
):
    from eagle3lib.errors import UserError

    trainer, _ = trainer_on(monkeypatch, batches(1))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    trainer.graph_step, trainer.is_distributed, trainer.sync_free = True, distributed, sync_free
    with pytest.raises(UserError) as refused:
        trainer.train_epoch(0)
    assert str(refused.value) == f"graphed step: {reason}"


def test_two_optimisers_rates_are_logged_by_name(monkeypatch):
    trainer, records = trainer_on(monkeypatch, batches(1), optimizers=2)
    trainer.train_epoch(0)
    assert records[0]["lr"] == {"SGD": pytest.approx(0.1), "Adam": pytest.approx(0.001)}


def test_with_graph_step_every_step_is_the_graphed_steps_and_its_metrics_stay_as_captured(
    monkeypatch,
):
    """train.graph_step: each step replays the graphed step, which returns the same metrics
    dict every time (its captured outputs); logging reads it without adding to it."""
    trainer, records = trainer_on(monkeypatch, batches(3))
    graphed, captured = [], {}

    def replay(batch):
        graphed.append(batch["error_records"])
        loss, metrics = trainer._train_step(batch)
        captured.update(metrics if not captured else {})
        return loss, captured

    trainer.graph_step = True
    trainer._graphed_step = lambda: replay
    trainer.train_epoch(0)
    assert graphed == [0, 1, 2] and sorted(captured) == ["loss_sum", "loss_total", "one"]
    assert [r["train"] for r in records] == [
        {"loss": 2.0, "one": 1.0, "error_records": k} for k in (0.0, 2.0)
    ]


def test_max_steps_ends_the_epoch_and_every_later_one(monkeypatch):
    trainer, records = trainer_on(monkeypatch, batches(5), max_steps=3, log_freq=1)
    trainer.train_epoch(0)
    assert trainer.global_step == 3 and len(records) == 3
    trainer.train_epoch(1)  # speculators' own loop would run one more step here
    assert trainer.global_step == 3 and len(records) == 3


def test_mid_epoch_saves_at_speculators_cadence_not_near_the_epochs_end(monkeypatch):
    """checkpoint_freq 0.25 of 10 steps: a save every round(2.5) = 2 steps, none with less
    than a quarter of an interval left (step 10); every step where the share rounds to none;
    none where save_best; one where exactly a quarter of an interval is left."""
    trainer, _ = trainer_on(monkeypatch, batches(10), checkpoint_freq=0.25)
    trainer.train_epoch(0)
    assert trainer.saves == [2, 4, 6, 8]
    trainer, _ = trainer_on(monkeypatch, batches(4), checkpoint_freq=0.1)  # round(0.4): 1
    trainer.train_epoch(0)
    assert trainer.saves == [1, 2, 3]
    trainer, _ = trainer_on(monkeypatch, batches(10), checkpoint_freq=0.25, save_best=True)
    trainer.train_epoch(0)
    assert trainer.saves == []
    trainer, _ = trainer_on(monkeypatch, batches(9), checkpoint_freq=0.45)  # round(4.05): 4
    trainer.train_epoch(0)
    assert trainer.saves == [4, 8]  # step 8: a quarter of an interval (one step) left, saved


def test_a_resumed_epoch_counts_its_steps_from_the_epochs_start(monkeypatch):
    """Resumed after 6 of 10 steps (the loader serves the 4 left): saves at local steps 8
    (not 2 and 4); progress lines (one a step: every 0 s) with the total from the epoch's
    start, the pace from 3 real tokens each half-second step."""
    trainer, _ = trainer_on(monkeypatch, batches(4), checkpoint_freq=0.2)
    trainer.train_loader = type("Len10", (Loader,), {"__len__": lambda self: 10})(batches(4))
    trainer._prepare_resume_skip = lambda epoch: 6
    trainer.global_step = 16  # one epoch of 10 and 6 steps of this one
    trainer.model.now[0] = 1000.0  # the clock's own origin
    out = io.StringIO()
    trainer.progress = streaming_trainer.TrainingProgress(epochs=3, every=0.0, stream=out)
    trainer.train_epoch(1)
    assert trainer.saves == [8]
    lines = out.getvalue().splitlines()
    assert lines[0] == (
        "train: step 17/30 (epoch 2/3), first step in 0 s (0 s of it waiting for its batch, "
        "the rest set-up, any compilation and the step); pace from the next steps"
    )
    assert lines[1:] == [
        f"train: step {step}/30 (epoch 2/3), 6 tokens/s, {elapsed} s elapsed, about {left} s "
        "left; 500.0 ms a step since the last line"
        for step, elapsed, left in ((18, 1, 6), (19, 2, 6), (20, 2, 5))
    ]


def test_an_epoch_starting_between_logging_steps_runs_to_its_end(monkeypatch):
    """log_every 2 from global step 1 (a resumed run): the epoch's first step logs nothing and
    no stop is taken as agreed before any record or vote said so."""
    trainer, records = trainer_on(monkeypatch, batches(3))
    trainer.global_step = 1
    trainer.train_epoch(0)
    assert trainer.global_step == 4
    assert [r["global_step"] for r in records] == [2]


def test_the_phase_clock_puts_back_an_instances_own_method_itself():
    """After the block an instance's own method is the very one it had, not the timed one."""

    class Trainer:
        def train_epoch(self): ...
        def maybe_save_checkpoint(self): ...
        def val_epoch(self): ...
        def maybe_update_best(self): ...

    trainer = Trainer()
    trainer.val_epoch = own = lambda: "own"
    with streaming_trainer.PhaseClock().timing(trainer):
        assert trainer.val_epoch is not own
    assert trainer.val_epoch is own


def signal_after(trainer, global_step, signum=signal.SIGTERM):
    """train_epoch's step_callback: this process's stop request set after ``global_step``."""

    def callback():
        if trainer.global_step == global_step:
            trainer.stop_request.signum = signum

    return callback


def two_ranks(monkeypatch, trainer, other_asks=False):
    """DDP stood in for in this process: this rank and one alike (the same batches; the
    error-record count rank 0's, theirs or this one's), whose stop vote is ``other_asks``;
    returns the stop flags cast in votes, (global step, flag)."""
    import torch.distributed as dist

    def reduce_metrics(metrics):
        other = {**metrics, "stop_requested": torch.tensor(0.0)}
        other["error_records_total"] = torch.tensor(float(trainer.rank != 0))
        return {k: v + other[k] for k, v in metrics.items()}

    votes = []

    def all_reduce(flag, async_op):
        votes.append((trainer.global_step, flag.item()))
        # asynchronous: the other rank's vote is in once the work is waited for
        return (
            types.SimpleNamespace(wait=lambda: flag.add_(float(other_asks))) if async_op else None
        )

    monkeypatch.setattr(st, "_all_reduce_metrics", reduce_metrics)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    trainer.is_distributed = True
    return votes


def test_one_process_stops_after_the_step_the_signal_came_in(monkeypatch):
    trainer, records = trainer_on(monkeypatch, batches(5))
    with pytest.raises(Stopped) as stopped:
        trainer.train_epoch(0, step_callback=signal_after(trainer, 2))
    assert stopped.value.args == (0, 2) and trainer.global_step == 2
    assert [r["global_step"] for r in records] == [0]


@pytest.mark.parametrize("rank", [0, 1])
def test_ddp_ranks_agree_on_a_stop_at_the_next_logging_step(monkeypatch, rank):
    """A signal after global step 1, log_every 4: the ranks go on to the logging step at
    global step 4, whose all-reduce carries the stop, and stop after it (local step 5); the
    record's metrics are the ranks' (error records summed, counted by rank 0 alone, the loss
    and the 1 averaged), without the stop flag; no vote between logging steps 4 apart."""
    trainer, records = trainer_on(monkeypatch, batches(8), log_freq=4)
    trainer.rank = rank
    votes = two_ranks(monkeypatch, trainer)
    with pytest.raises(Stopped) as stopped:
        trainer.train_epoch(0, step_callback=signal_after(trainer, 1))
    assert stopped.value.args == (0, 5) and trainer.global_step == 5
    assert [r["global_step"] for r in records] == [0, 4]
    assert records[1]["train"] == {"loss": 2.0, "one": 1.0, "error_records": 8.0}
    assert votes == []


@pytest.mark.parametrize(
    "steps, other_asks, stop", [(14, False, 12), (11, False, 11), (14, True, 12)]
)
def test_ddp_ranks_vote_between_logging_steps_and_read_the_vote_a_step_later(
    monkeypatch, steps, other_asks, stop
):
    """No logging step after global step 0: a vote is cast after step 11 (STOP_VOTE_STEPS
    after the logging step) and read after the next step, or at the epoch's end where step 11
    is its last; the stop is this rank's signal (after step 2) or the other rank's vote."""
    trainer, _ = trainer_on(monkeypatch, batches(steps), log_freq=1000)
    votes = two_ranks(monkeypatch, trainer, other_asks=other_asks)
    callback = None if other_asks else signal_after(trainer, 2)
    with pytest.raises(Stopped) as stopped:
        trainer.train_epoch(0, step_callback=callback)
    assert stopped.value.args == (0, stop) and trainer.global_step == stop
    assert votes == [(11, 0.0 if other_asks else 1.0)]


def test_a_ddp_epoch_without_a_stop_votes_every_ten_steps_and_runs_to_its_end(monkeypatch):
    trainer, records = trainer_on(monkeypatch, batches(23), log_freq=1000)
    votes = two_ranks(monkeypatch, trainer)
    trainer.train_epoch(0)
    assert trainer.global_step == 23 and len(records) == 1
    assert votes == [(11, 0.0), (21, 0.0)]


@pytest.mark.parametrize(
    "rank, signum, name",
    [(0, signal.SIGINT, "SIGINT"), (0, None, "a signal to another rank"), (1, signal.SIGTERM, "")],
)
def test_a_stop_saves_the_state_after_its_step_then_exits_as_the_signal_asked(
    monkeypatch, capsys, rank, signum, name
):
    """stop_here: speculators' mid-epoch save of this step whatever checkpoint_freq and
    save_best, then the barrier, then rank 0's line and the exit (128 + the signal, SIGTERM's
    on a rank that got none)."""
    from pathlib import Path

    trainer, _ = trainer_on(monkeypatch, batches(0), save_best=True)
    trainer.rank, trainer.global_step, trainer.stop_request.signum = rank, 17, signum
    trainer.checkpointer = types.SimpleNamespace(path=Path("state"))
    events = []
    trainer.maybe_save_checkpoint = lambda epoch, local_step=0: events.append(
        ("save", epoch, local_step, trainer.config.checkpoint_freq, trainer.config.save_best)
    )
    monkeypatch.setattr(streaming_trainer, "barrier", lambda: events.append("barrier"))
    with pytest.raises(SystemExit) as stopped:
        streaming_trainer.StreamingTrainer.stop_here(trainer, 2, 5)
    assert stopped.value.code == 128 + (signum or signal.SIGTERM)
    assert events == [("save", 2, 5, 0.5, False), "barrier"]
    assert capsys.readouterr().err == (
        f"train: stopped by {name} after step 17 (epoch 3); the state after it is saved in "
        f"{Path('state', '2')}: a rerun resumes from it\n"
        if rank == 0
        else ""
    )


class Threaded:
    """batches.ThreadedBatches stood in for: its pool's wait grows a second a batch; it notes
    its threads and whether it was closed."""

    def __init__(self, loader, threads):
        self.loader, self.threads, self.closed = loader, threads, False
        self.pool = types.SimpleNamespace(wait_seconds=0.0)

    def __iter__(self):
        self.items = iter(self.loader)
        return self

    def __next__(self):
        batch = next(self.items)
        self.pool.wait_seconds += 1.0
        return batch, "release"

    def close(self):
        self.closed = True


def test_loader_threads_buffer_waits_add_up_over_epochs_and_an_epoch_cut_short_closes_them(
    monkeypatch,
):
    """loader_threads 3 without DataLoader workers: ThreadedBatches with 3 threads; the pool's
    wait counts while the epoch runs and adds up over epochs (one of 3 batches, one cut short
    after 1); each epoch closes its batches, also one _device_batches cut short; with
    workers, one thread and nothing to release."""
    from eagle3lib import batches as batches_module

    fresh = streaming_trainer.StreamingTrainer.__new__(streaming_trainer.StreamingTrainer)
    assert (fresh.buffer_wait_seconds, fresh.gpu_wait_seconds) == (0.0, 0.0)  # no epoch yet
    made = []
    monkeypatch.setattr(
        batches_module, "ThreadedBatches", lambda *a: made.append(Threaded(*a)) or made[-1]
    )
    trainer, _ = trainer_on(monkeypatch, batches(0))
    trainer.loader_threads = 3
    epoch = trainer._prefetched(batches(3))
    assert [next(epoch)[1], next(epoch)[1]] == ["release"] * 2
    assert trainer.buffer_wait_seconds == 2.0
    assert len(list(epoch)) == 1 and trainer.buffer_wait_seconds == 3.0
    epoch = trainer._prefetched(batches(3))
    next(epoch)
    epoch.close()
    assert trainer.buffer_wait_seconds == 4.0
    assert [(t.threads, t.closed) for t in made] == [(3, True), (3, True)]
    with_workers = type("WithWorkers", (Loader,), {"num_workers": 2})(batches(2))
    got = list(trainer._prefetched(with_workers))
    assert [b["error_records"] for b, _ in got] == [0, 1]
    assert {release for _, release in got} == {streaming_trainer._keep} and len(made) == 2
    trainer._prefetched = lambda loader: iter(made[0])
    made[0].closed = False
    epoch = trainer._device_batches(batches(3))
    next(epoch)
    epoch.close()
    assert made[0].closed


def test_each_batch_is_released_after_its_step_and_on_a_gpu_the_next_copied_during_it(
    monkeypatch,
):
    """_device_batches_of without a GPU: each host batch itself, released after its step.
    With CUDA stood in for (a side stream, events numbered by the copy they follow, tensors
    that note their copies): batch k+1's copy (to the rank's GPU, not blocking, on the side
    stream) is started before step k, the step's stream waits for the side stream and holds
    the copied tensors, and batch k's buffers go back after its step with its copy's event."""
    log = []

    class OnDevice(torch.Tensor):
        def to(self, device, non_blocking=False):
            log.append(("to", device, non_blocking))
            moved = torch.zeros(1).as_subclass(OnDevice)
            moved.host = self
            return moved

        def record_stream(self, stream):
            log.append(("held by", stream))

    class Event:
        def record(self, stream):
            self.n = sum(entry[0] == "copy" for entry in log)
            log.append(("copy", self.n, stream))

    monkeypatch.setattr(torch.cuda, "Stream", lambda: "side")
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: step_stream)
    step_stream = types.SimpleNamespace(wait_stream=lambda stream: log.append(("wait", stream)))
    trainer, _ = trainer_on(monkeypatch, batches(0))
    trainer.local_rank = 3

    def host(k):
        batch = {"k": k, "ids": torch.tensor([k]).as_subclass(OnDevice)}
        return batch, lambda event: log.append(("release", k, getattr(event, "n", event)))

    for batch, moved in trainer._device_batches_of(iter([host(k) for k in range(2)])):
        assert moved is batch
        log.append(("step", batch["k"]))
    assert log == [("step", 0), ("release", 0, None), ("step", 1), ("release", 1, None)]
    log.clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for batch, moved in trainer._device_batches_of(iter([host(k) for k in range(3)])):
        assert moved["k"] == batch["k"] and moved["ids"].host is batch["ids"]
        log.append(("step", batch["k"]))
    copy = [("to", 3, True)]
    ready = [("wait", "side"), ("held by", step_stream)]
    assert log == [
        *copy, ("copy", 0, "side"),
        *ready, *copy, ("copy", 1, "side"), ("step", 0), ("release", 0, 0),
        *ready, *copy, ("copy", 2, "side"), ("step", 1), ("release", 1, 1),
        *ready, ("step", 2), ("release", 2, 2),
    ]  # fmt: skip
    log.clear()
    assert list(trainer._device_batches_of(iter([]))) == [] and log == []


def test_an_epoch_ended_while_the_loader_thread_waits_on_a_full_queue_stops_it(monkeypatch):
    """One loader thread (a daemon), blocked putting a batch into its full queue (depth 2)
    when the epoch ends: closing the batches unblocks and ends it."""
    import threading
    import time

    read = []

    def endless():
        while True:
            read.append(len(read))
            yield {"k": read[-1]}

    trainer, _ = trainer_on(monkeypatch, batches(0))
    epoch = trainer._one_thread(endless(), 2)
    assert next(epoch)[0]["k"] == 0
    while len(read) < 4:  # 1 and 2 queued, 3 read and waiting for room
        time.sleep(0.001)
    (thread,) = [t for t in threading.enumerate() if t.name == "batch-prefetch"]
    assert thread.daemon
    closing = threading.Thread(target=epoch.close, daemon=True)
    closing.start()
    closing.join(timeout=2)
    assert not closing.is_alive() and not thread.is_alive()
    assert len(read) == 5  # the batch it put once unblocked, then one read to find it stopped


@pytest.mark.parametrize(
    "rank, sync_free, signalled", [(0, True, True), (1, False, True), (0, True, False)]
)
def test_run_training_reads_a_vote_left_open_and_reports_a_stop_after_the_last_step(
    monkeypatch, capsys, rank, sync_free, signalled
):
    """run_training around speculators' loop (stood in for: it leaves a vote open and a
    signal may come after its last step): rank 0's progress over the run's epochs and
    max_steps; the loss metrics sync-free inside where asked; the open vote read (waited for)
    after the loop; a stop reported by rank 0, then the exit the signal asked for."""
    from speculators.models.eagle3 import metrics
    from speculators.train.trainer import Trainer

    from eagle3lib import speculators_compat

    seen = []

    def loop(self):
        seen.append(metrics.compute_accuracy_single_step is speculators_compat.accuracy_counts)
        self.stop_vote = streaming_trainer.StopVote()
        work = types.SimpleNamespace(wait=lambda: seen.append("waited"))
        self.stop_vote.pending = (torch.tensor([0.0]), work)
        self.stop_request.signum = signal.SIGTERM if signalled else None

    monkeypatch.setattr(Trainer.run_training, "__wrapped__", loop)
    trainer, _ = trainer_on(monkeypatch, batches(0), num_epochs=3, max_steps=40)
    trainer.rank, trainer.sync_free = rank, sync_free
    with pytest.raises(SystemExit) if signalled else contextlib.nullcontext() as stopped:
        trainer.run_training()
    assert not signalled or stopped.value.code == 128 + signal.SIGTERM  # stop_requests' exit
    assert seen == [sync_free, "waited"] and trainer.stop_vote.pending is None
    progress = trainer.progress and (trainer.progress.epochs, trainer.progress.max_steps)
    assert progress == ((3, 40) if rank == 0 else None)
    assert capsys.readouterr().err == (
        "train: stopped by SIGTERM after the last step; the last epoch's state is saved: a "
        "rerun exports the checkpoint\n"
        if rank == 0 and signalled
        else ""
    )


def test_durations_at_their_units_boundaries():
    cases = {
        -3: "0 s",  # a negative time left
        59: "59 s",
        59.6: "1 min 00 s",
        119: "1 min 59 s",
        3599: "59 min 59 s",
        3600: "1 h 00 min",
        3659: "1 h 00 min",
        3660: "1 h 01 min",
        7199: "1 h 59 min",
        7200: "2 h 00 min",
    }
    assert {seconds: streaming_trainer.duration(seconds) for seconds in cases} == cases


def test_no_pace_without_time_or_steps_and_shares_only_between_two_readings():
    """A progress line before any time or step: no pace, nothing left. A thread's shares of
    2 s from readings 0.5 s on a core and 0.2 s waiting apart; none without the later one."""
    assert streaming_trainer.progress_line(5, 10, 0, 1, 0, 0.0, 0) == (
        "train: step 5/10 (epoch 1/1), 0 tokens/s, 0 s elapsed, about 0 s left"
    )
    before, after = (400_000_000, 100_000_000), (900_000_000, 300_000_000)
    assert streaming_trainer.thread_shares(before, after, 2.0) == {
        "cpu_fraction": 0.25,
        "runqueue_wait_fraction": 0.1,
    }
    assert streaming_trainer.thread_shares(before, None, 2.0) is None


def recorded_patches(monkeypatch) -> list:
    """streaming_trainer's speculators_patches stood in for: the patches asked for, with
    their context, and their end, in order."""
    calls = []

    @contextlib.contextmanager
    def patches(*names, **context):
        calls.append(("patched", names, context))
        yield
        calls.append("unpatched")

    monkeypatch.setattr(streaming_trainer, "speculators_patches", patches)
    return calls


@pytest.mark.parametrize("broadcast, bucket_view", [(True, False), (False, True)])
def test_ddp_is_built_with_the_trainers_options(monkeypatch, broadcast, bucket_view):
    """_setup_model_ddp: speculators' own (stood in for), inside the ddp_options patch
    carrying gradient_as_bucket_view; the model then stops broadcasting its buffers where
    ddp_broadcast_buffers is off."""
    from speculators.train.trainer import Trainer

    calls = recorded_patches(monkeypatch)

    def setup(self, load_checkpoint):
        calls.append(("setup", load_checkpoint))
        self.model = types.SimpleNamespace(broadcast_buffers=True)

    monkeypatch.setattr(Trainer, "_setup_model_ddp", setup)
    trainer, _ = trainer_on(monkeypatch, batches(0))
    trainer.ddp_broadcast_buffers, trainer.ddp_gradient_as_bucket_view = broadcast, bucket_view
    trainer._setup_model_ddp(True)
    options = {"ddp_options": {"gradient_as_bucket_view": bucket_view}}
    assert calls == [("patched", ("ddp_options",), options), ("setup", True), "unpatched"]
    assert trainer.model.broadcast_buffers is broadcast


@pytest.mark.parametrize(
    "optimizer, distributed, fsdp, across",
    [("adamw", True, False, True), ("muon", True, True, False), ("muon", False, False, False)],
)
def test_the_optimisers_are_speculators_with_their_rates_as_numbers(
    monkeypatch, optimizer, distributed, fsdp, across
):
    """setup_optimizer on a CPU: speculators' optimisers (stood in for) built with no GPU
    patch, Muon split over DDP's ranks only (not in one process, not under FSDP), and rates
    a graphed run's saved state made tensors numbers again."""
    from speculators.train.trainer import Trainer

    calls = recorded_patches(monkeypatch)

    def setup(self):
        calls.append("setup")
        self.optimizers = [torch.optim.SGD(self.model.parameters())]
        self.optimizers[0].param_groups[0]["lr"] = torch.tensor(0.5)
        return "built"

    monkeypatch.setattr(Trainer, "setup_optimizer", setup)
    trainer, _ = trainer_on(monkeypatch, batches(0), optimizer=optimizer, fsdp_shard=fsdp)
    trainer.is_distributed = distributed
    assert trainer.setup_optimizer() == "built"
    context = {"newton_schulz": "gram", "across_ranks": across}
    assert calls == [("patched", (), context), "setup", "unpatched"]
    lr = trainer.optimizers[0].param_groups[0]["lr"]
    assert type(lr) is float and lr == 0.5


def test_a_save_is_speculators_with_a_graphed_steps_rates_as_numbers(monkeypatch):
    """maybe_save_checkpoint: speculators' save (stood in for) at the epoch's end (local step
    0: speculators' own loop names no step) or the step given, its rates numbers while it
    saves and the tensors back after; a trainer without schedulers saves too."""
    from speculators.train.trainer import Trainer

    saved = []

    def save(self, epoch, *, local_step):
        saved.append((epoch, local_step, self.optimizers[0].param_groups[0]["lr"]))

    monkeypatch.setattr(Trainer, "maybe_save_checkpoint", save)
    trainer, _ = trainer_on(monkeypatch, batches(0))
    del trainer.maybe_save_checkpoint  # the stand-in trainer's: its own here
    rate = trainer.optimizers[0].param_groups[0]["lr"] = torch.tensor(0.5)
    trainer.maybe_save_checkpoint(1)
    del trainer.schedulers
    trainer.maybe_save_checkpoint(2, local_step=7)
    assert saved == [(1, 0, 0.5), (2, 7, 0.5)] and [type(r) for *_, r in saved] == [float] * 2
    assert trainer.optimizers[0].param_groups[0]["lr"] is rate
