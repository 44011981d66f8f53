"""StreamingTrainer.train_epoch's bookkeeping on a stand-in model and loader (no pipeline):
what its metric records say, when it saves, where it stops."""

import io
import types

import pytest
import torch
from speculators.train import trainer as st
from speculators.train.recovery import RECOVERY_METADATA_KEY

from eagle3lib import streaming_trainer


class Draft(torch.nn.Module):
    """One weight; each call is one second of the stand-in clock and 0.25 s of data wait and
    0.5 s of GPU wait on its trainer."""

    def __init__(self, now, trainer):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))
        self.now, self.trainer = now, trainer
        self.modes = []

    def forward(self, document_ids, error_records):  # only a batch's own keys
        self.now[0] += 1.0
        self.modes.append(self.training)
        self.trainer.data_wait_seconds += 0.25
        self.trainer._in_flight.wait_seconds += 0.5
        loss = (self.w - self.w.detach()).sum() + 2.0  # 2, with a gradient
        return None, loss, {"loss_sum": loss.detach(), "loss_total": torch.tensor(1.0)}


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


def trainer_on(monkeypatch, loader, *, log_freq=2, optimizers=1, **config):
    now = [0.0]
    monkeypatch.setattr(
        streaming_trainer, "time", types.SimpleNamespace(perf_counter=lambda: now[0])
    )
    trainer = streaming_trainer.StreamingTrainer.__new__(streaming_trainer.StreamingTrainer)
    model = Draft(now, trainer)
    opts = [torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.Adam(model.parameters())]
    trainer.__dict__.update(
        model=model,
        train_loader=loader,
        optimizers=opts[:optimizers],
        # the rate doubles every step: a record shows the rate of its own step
        schedulers=[torch.optim.lr_scheduler.LambdaLR(opts[0], lambda s: 2.0**s)],
        config=types.SimpleNamespace(
            **{
                "max_steps": None,
                "log_freq": log_freq,
                "checkpoint_freq": 1.0,
                "save_best": False,
                "hidden_states_dtype": torch.bfloat16,
                "train_call_kwargs": None,
                **config,
            }
        ),
        device_type="cpu",
        local_rank=0,
        rank=0,
        is_distributed=False,
        global_step=0,
        loader_threads=0,
        _in_flight=streaming_trainer.StepsInFlight(),
        stop_request=types.SimpleNamespace(signum=None),
        saves=[],
    )
    trainer._prepare_resume_skip = lambda epoch: 0
    trainer.maybe_save_checkpoint = lambda epoch, local_step=0: trainer.saves.append(local_step)
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
    trainer.train_epoch(0)
    assert trainer.model.modes == [True] * 5
    assert trainer.global_step == 5
    assert [r["global_step"] for r in records] == [0, 2, 4]
    assert [r["lr"] for r in records] == [pytest.approx(0.1 * 2**s) for s in (0, 2, 4)]
    for r in records:
        assert r["epoch"] == 0
        assert r["profile"] == pytest.approx(
            {"tokens_per_s": 3.0, "data_wait_fraction": 0.25, "gpu_wait_fraction": 0.5}
        )
    assert [r["train"]["error_records"] for r in records] == [0.0, 2.0, 4.0]
    assert [r["train"]["loss"] for r in records] == [2.0, 2.0, 2.0]
    trainer.train_epoch(1)  # the waits add up over the epochs
    assert trainer.gpu_wait_seconds == 5.0 and trainer.data_wait_seconds == 2.5
    assert [r["global_step"] for r in records[3:]] == [6, 8]


def test_two_optimisers_rates_are_logged_by_name(monkeypatch):
    trainer, records = trainer_on(monkeypatch, batches(1), optimizers=2)
    trainer.train_epoch(0)
    assert records[0]["lr"] == {"SGD": pytest.approx(0.1), "Adam": pytest.approx(0.001)}


def test_max_steps_ends_the_epoch_and_every_later_one(monkeypatch):
    trainer, records = trainer_on(monkeypatch, batches(5), max_steps=3, log_freq=1)
    trainer.train_epoch(0)
    assert trainer.global_step == 3 and len(records) == 3
    trainer.train_epoch(1)  # speculators' own loop would run one more step here
    assert trainer.global_step == 3 and len(records) == 3


def test_mid_epoch_saves_at_speculators_cadence_not_near_the_epochs_end(monkeypatch):
    """checkpoint_freq 0.25 of 10 steps: a save every round(2.5) = 2 steps, none with less
    than a quarter of an interval left (step 10); every step where the share rounds to none;
    none where save_best."""
    trainer, _ = trainer_on(monkeypatch, batches(10), checkpoint_freq=0.25)
    trainer.train_epoch(0)
    assert trainer.saves == [2, 4, 6, 8]
    trainer, _ = trainer_on(monkeypatch, batches(4), checkpoint_freq=0.1)  # round(0.4): 1
    trainer.train_epoch(0)
    assert trainer.saves == [1, 2, 3]
    trainer, _ = trainer_on(monkeypatch, batches(10), checkpoint_freq=0.25, save_best=True)
    trainer.train_epoch(0)
    assert trainer.saves == []


def test_a_resumed_epoch_counts_its_steps_from_the_epochs_start(monkeypatch):
    """Resumed after 6 of 10 steps (the loader serves the 4 left): saves at local steps 8
    (not 2 and 4), the progress total from the epoch's start."""
    trainer, _ = trainer_on(monkeypatch, batches(4), checkpoint_freq=0.2)
    trainer.train_loader = type("Len10", (Loader,), {"__len__": lambda self: 10})(batches(4))
    trainer._prepare_resume_skip = lambda epoch: 6
    trainer.global_step = 16  # one epoch of 10 and 6 steps of this one
    trainer.progress = streaming_trainer.TrainingProgress(epochs=3, stream=io.StringIO())
    trainer.train_epoch(1)
    assert trainer.saves == [8]
    assert trainer.progress.total == 30


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
