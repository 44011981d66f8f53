"""``StreamingTrainer``: speculators' Trainer with a step loop that never makes the host wait
for the GPU, and its progress lines."""

from __future__ import annotations

import collections
import contextlib
import math
import signal
import sys
import time
from pathlib import Path

import torch
from speculators.train.trainer import Trainer

from eagle3lib.distributed import barrier
from eagle3lib.errors import UserError
from eagle3lib.lifetime import StopRequest, stop_requests
from eagle3lib.speculators_compat import speculators_patches


def thread_schedstat() -> tuple[int, int] | None:
    """The calling thread's nanoseconds so far on a core and runnable but waiting for one (in
    the kernel's run queue), from Linux's /proc/thread-self/schedstat; None where the kernel
    does not report them (no file) or has not accounted this thread yet (zeros: a thread that
    only just started, until the scheduler's next update)."""
    try:
        run, wait, _ = Path("/proc/thread-self/schedstat").read_text().split()
    except (OSError, ValueError):
        return None
    return (int(run), int(wait)) if int(run) else None


def thread_shares(before, after, seconds: float) -> dict[str, float] | None:
    """How a thread spent ``seconds`` between two ``thread_schedstat`` readings: the fraction
    on a core and the fraction waiting for one (other processes holding the cores)."""
    if before is None or after is None or seconds <= 0:
        return None
    return {
        "cpu_fraction": round((after[0] - before[0]) / (seconds * 1e9), 3),
        "runqueue_wait_fraction": round((after[1] - before[1]) / (seconds * 1e9), 4),
    }


class StepsInFlight:
    """Holds the host at most ``limit`` steps ahead of the GPU: ``launched()`` after each
    step's launches records an event (a blocking one: the host sleeps on it instead of
    spinning a core) and, with more than ``limit`` pending, waits for the oldest, adding the
    time to ``wait_seconds`` (the GPU setting the pace). Without a bound, a step that launches
    in a fraction of its GPU time (a graphed step) runs ahead until the loader's reused pinned
    buffers are all in flight, then waits for one inside the loader: the GPU's back-pressure,
    counted as data wait. On a CPU it does nothing."""

    def __init__(self, limit: int = 2):
        self.limit, self.wait_seconds = limit, 0.0
        self.pending: collections.deque = collections.deque()

    def launched(self) -> None:
        if not torch.cuda.is_available():
            return
        event = torch.cuda.Event(blocking=True)
        event.record()
        self.pending.append(event)
        if len(self.pending) > self.limit:
            t0 = time.perf_counter()
            self.pending.popleft().synchronize()
            self.wait_seconds += time.perf_counter() - t0


STARVED = 0.05  # a training thread waiting for a core longer than this share of its run


def starved_line(shares: dict[str, float] | None, rank: int) -> str | None:
    """A warning where the training thread (the one launching the GPU's work) waited for a
    core more than STARVED of the run, else None."""
    if not shares or shares["runqueue_wait_fraction"] <= STARVED:
        return None
    return (
        f"train: rank {rank}'s training thread waited for a CPU core "
        f"{shares['runqueue_wait_fraction']:.0%} of the run, so other processes on this machine "
        "slowed the training: run fewer jobs beside it, or give it cores of its own"
    )


def duration(seconds: float) -> str:
    """``1 h 02 min``, ``3 min 20 s`` or ``42 s``."""
    s = max(0, round(seconds))
    if s >= 3600:
        return f"{s // 3600} h {s % 3600 // 60:02d} min"
    if s >= 60:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s} s"


def progress_line(
    step: int,
    total: int,
    epoch: int,
    epochs: int,
    tokens: int,
    seconds: float,
    steps_run: int,
    elapsed: float | None = None,
    recent: tuple[int, float] | None = None,
) -> str:
    """One line of training progress: ``step`` of ``total`` done; the pace from ``steps_run``
    steps (``tokens`` real tokens) in ``seconds`` run by this process, the rest extrapolated at
    it; ``elapsed`` the process's training time so far (``seconds`` where not given);
    ``recent``: (steps, seconds) since the previous line, its time a step (a pace that falls
    during an epoch shows there, where the pace from the start hides it)."""
    rate = tokens / seconds if seconds > 0 else 0.0
    left = (total - step) * seconds / steps_run if steps_run else 0.0
    line = (
        f"train: step {step}/{total} (epoch {epoch + 1}/{epochs}), {rate:,.0f} tokens/s, "
        f"{duration(seconds if elapsed is None else elapsed)} elapsed, about {duration(left)} left"
    )
    if recent and recent[0]:
        line += f"; {1000 * recent[1] / recent[0]:,.1f} ms a step since the last line"
    return line


def first_step_line(
    step: int, total: int, epoch: int, epochs: int, seconds: float, data_wait: float | None = None
) -> str:
    """The line after this process's first step, which also compiles and fills the loader: its
    time, of it ``data_wait`` seconds waiting for its batch where known, and no pace (one
    extrapolated from it was hours off on a GPU)."""
    included = (
        "compilation and loading included"
        if data_wait is None
        else f"{duration(data_wait)} of it waiting for its batch, the rest set-up, any compilation "
        "and the step"
    )
    return (
        f"train: step {step}/{total} (epoch {epoch + 1}/{epochs}), first step in "
        f"{duration(seconds)} ({included}); pace from the next steps"
    )


# the trainer's methods a run's time is split into, by the name each phase is reported under
PHASES = {
    "train_epoch": "steps",
    "maybe_save_checkpoint": "saves",
    "val_epoch": "validation",
    "maybe_update_best": "best",
}


class PhaseClock:
    """Host seconds a trainer spends in each of ``PHASES``' methods, each phase's own: a save
    inside an epoch (a mid-epoch checkpoint, a stop) counts as a save, not as steps."""

    def __init__(self, clock=time.perf_counter) -> None:
        self.clock = clock
        self.seconds = dict.fromkeys(PHASES.values(), 0.0)
        self._inner: list[float] = []  # per open phase: the seconds of phases opened inside it

    @contextlib.contextmanager
    def timing(self, trainer):
        """Time ``trainer``'s phase methods within the block (as they resolve at its start:
        enter it where the run's patches are in place), then put back what was there."""
        held = {m: trainer.__dict__[m] for m in PHASES if m in trainer.__dict__}
        for method, phase in PHASES.items():
            setattr(trainer, method, self._timed(phase, getattr(trainer, method)))
        try:
            yield self
        finally:
            for method in PHASES:
                if method in held:
                    setattr(trainer, method, held[method])
                else:
                    trainer.__dict__.pop(method, None)

    def _timed(self, phase: str, method):
        def timed(*args, **kwargs):
            start = self.clock()
            self._inner.append(0.0)
            try:
                return method(*args, **kwargs)
            finally:
                total = self.clock() - start
                self.seconds[phase] += total - self._inner.pop()
                if self._inner:
                    self._inner[-1] += total

        return timed


class TrainingProgress:
    """Prints ``first_step_line`` to stderr after the first step, then ``progress_line`` every
    ``every`` seconds and after the last step, its pace measured from the end of the first
    step (host clock only: no wait for the GPU)."""

    def __init__(self, epochs: int, max_steps: int | None = None, every: float = 10.0, stream=None):
        self.epochs, self.max_steps, self.every = epochs, max_steps, every
        self.stream = stream
        self.total = max_steps or 0
        self.start = self.last = time.perf_counter()
        self.first = self.start  # the end of the first step
        self.tokens = 0
        self.steps_run = 0
        self.steps_at_last = 0  # steps_run at the previous line

    def epoch_started(self, epoch: int, steps_before: int, steps_in_epoch: int) -> None:
        """The run's total, as if every epoch left had this one's steps (the sampler's packing,
        so the count, changes from epoch to epoch); at most ``max_steps``."""
        total = steps_before + (self.epochs - epoch) * steps_in_epoch
        self.total = min(total, self.max_steps) if self.max_steps is not None else total

    def step(self, step: int, epoch: int, tokens: int, data_wait: float | None = None) -> None:
        """``step`` steps are done (the last one of ``epoch``, with ``tokens`` real tokens);
        ``data_wait``: the host's seconds waiting for batches so far."""
        import sys

        self.steps_run += 1
        now = time.perf_counter()
        if self.steps_run == 1:
            self.first = self.last = now
            line = first_step_line(
                step, self.total, epoch, self.epochs, now - self.start, data_wait
            )
        else:
            self.tokens += tokens  # the pace leaves the first step out
            if step < self.total and now - self.last < self.every:
                return
            recent = (self.steps_run - self.steps_at_last, now - self.last)
            self.last = now
            line = progress_line(
                step,
                self.total,
                epoch,
                self.epochs,
                self.tokens,
                now - self.first,
                self.steps_run - 1,
                elapsed=now - self.start,
                recent=recent,
            )
        self.steps_at_last = self.steps_run
        print(line, file=self.stream or sys.stderr, flush=True)


def stop_buffer_broadcast(ddp_model) -> None:
    """A DistributedDataParallel model no longer broadcasts its buffers before each forward
    (they were synced when it was built; torch's ``broadcast_buffers``)."""
    ddp_model.broadcast_buffers = False


def _keep(_event=None) -> None:
    """release() of a batch that owns its memory."""


# DDP's ranks agree on a stop at every logging step and, where logging steps are further
# apart than this (train.log_every's default), by a vote this many steps after they last
# agreed: a large log_every does not delay a stop past a scheduler's grace period
STOP_VOTE_STEPS = 10


class StopVote:
    """A stop vote of DDP's ranks without a host sync of its own: ``cast`` starts the flags'
    all-reduce after a step, ``counted`` reads it after the next one, when the GPU has
    finished the first (so the wait does not empty its queue), or when the epoch has no next
    step. Every rank counts, casts and reads at the same steps."""

    def __init__(self) -> None:
        self.pending = None
        self.steps = 0  # since the ranks last agreed (a logging step or a vote)

    def due(self, at_log_step: bool) -> bool:
        """Count a step: whether a vote is due after it (STOP_VOTE_STEPS steps without a
        logging step or a vote)."""
        self.steps = 0 if at_log_step else self.steps + 1
        return self.steps >= STOP_VOTE_STEPS

    def cast(self, stop: bool, device) -> None:
        import torch.distributed as dist

        flag = torch.tensor([float(stop)], device=device)
        self.pending = (flag, dist.all_reduce(flag, async_op=True))
        self.steps = 0

    def counted(self) -> bool:
        """Whether any rank voted to stop in the vote cast last (False when none is open)."""
        if self.pending is None:
            return False
        flag, work = self.pending
        self.pending = None
        work.wait()
        return flag.item() > 0


class StreamingTrainer(Trainer):
    """speculators' Trainer with a step loop that never makes the host wait for the GPU.

    speculators' own loop synchronises every step (it builds metric tensors from Python
    numbers, a blocking copy) and copies each batch to the device just before using it, so the
    GPU idles while the host prepares the next step. Here the next batch is copied on a side
    stream while the current step runs, and metrics leave the device only on logging steps.
    The model's loss metrics run without their host syncs (``speculators_compat`` entries
    ``sync_free_eagle3``). Forward
    (autocast), loss, backward, gradient clipping, optimiser, scheduler, mid-epoch checkpoints,
    resume skipping and max_steps are speculators' own, unchanged.
    """

    data_wait_seconds = 0.0  # host time blocked waiting for the next batch (all epochs)
    steps_in_flight = 2  # the host runs at most this many steps ahead of the GPU
    _in_flight: StepsInFlight | None = None

    loader_threads = 4  # threads building batches (train.loader_threads); 0: one, as before
    sync_free = True  # speculators' loss metrics without host syncs (entries sync_free_eagle3)
    batched_muon = True  # on a GPU, Muon batched by matrix shape (muon.BatchedMuon)
    newton_schulz = "gram"  # with batched_muon: train.newton_schulz (train.train sets it)
    # with batched_muon under DDP: each rank orthogonalises a share of Muon's matrices and
    # broadcasts it (muon.Ranks), instead of every rank all of them (torch's Muon's way)
    muon_across_ranks = True

    progress: TrainingProgress | None = None
    stop_request = StopRequest()  # run_training's: SIGTERM or SIGINT, acted on between steps
    stop_vote: StopVote | None = None  # under DDP, between logging steps (train_epoch's)
    # DDP re-sends the model's buffers from rank 0 before every forward (torch's default); the
    # draft's (t2d, d2t, rotary frequencies) never change after DDP's initial sync, so False
    # saves that per-step collective (bench/train.py variant ours_nobcast measures it)
    ddp_broadcast_buffers = True
    # DDP copies each gradient into its all-reduce buckets and back after the reduction
    # (torch's default); True makes the gradients views of the buckets (torch's
    # gradient_as_bucket_view: no copies and no second copy of the gradients held)
    ddp_gradient_as_bucket_view = False
    # train.graph_step: the step captured into a CUDA graph once and replayed
    # (graphed_step.GraphedStep); AdamW or batched Muon, one GPU, batches of one shape
    graph_step = False
    _graphed = None

    _threaded = None  # this epoch's ThreadedBatches, while it runs
    _buffer_wait_done = 0.0  # the earlier epochs' buffer waits

    @property
    def buffer_wait_seconds(self) -> float:
        """The loader threads' time (summed over them, all epochs) blocked for a free pinned
        buffer set (``batches._Pool``): the GPU holding the sets, not the loader's own pace."""
        pool = getattr(self._threaded, "pool", None)
        return self._buffer_wait_done + (pool.wait_seconds if pool is not None else 0.0)

    @property
    def gpu_wait_seconds(self) -> float:
        """Host time blocked on the GPU by ``steps_in_flight`` (all epochs)."""
        return 0.0 if self._in_flight is None else self._in_flight.wait_seconds

    def _setup_model_ddp(self, load_checkpoint: bool):
        options = {"gradient_as_bucket_view": self.ddp_gradient_as_bucket_view}
        with speculators_patches("ddp_options", ddp_options=options):
            super()._setup_model_ddp(load_checkpoint)
        if not self.ddp_broadcast_buffers:
            stop_buffer_broadcast(self.model)

    def run_training(self):
        """speculators' run_training, stopped by SIGTERM or SIGINT only between steps, where
        it saves a state a rerun resumes from (``stop_here``); speculators' own handler
        (``with_graceful_shutdown``) is left out: it breaks off the step wherever it is, saves
        an "interrupted" folder no rerun resumes from and returns as if training had ended."""
        if self.rank == 0:
            self.progress = TrainingProgress(self.config.num_epochs, self.config.max_steps)
        sync_free = ("sync_free_eagle3",) if self.sync_free else ()
        with speculators_patches(*sync_free), stop_requests() as self.stop_request:
            Trainer.run_training.__wrapped__(self)
            if self.stop_vote is not None:  # a vote cast after max_steps' step: finished
                self.stop_vote.counted()
            if self.stop_request.signum is not None and self.rank == 0:  # exits as asked
                print(
                    f"train: stopped by {self.stop_request.name} after the last step; the last "
                    "epoch's state is saved: a rerun exports the checkpoint",
                    file=sys.stderr,
                    flush=True,
                )

    def stop_here(self, epoch: int, local_step: int) -> None:
        """Save the state after this step as speculators' mid-epoch checkpoint (what a rerun
        resumes from, exactly), then exit as the signal asked (128 + its number; SIGTERM's on
        a rank that got none itself)."""
        request = self.stop_request
        # the save its loop makes every checkpoint_freq of an epoch, whatever checkpoint_freq
        self.config = self.config._replace(checkpoint_freq=0.5, save_best=False)
        self.maybe_save_checkpoint(epoch, local_step=local_step)
        barrier()  # no rank exits (its launcher then ends the others) before rank 0 swapped it in
        if self.rank == 0:
            print(
                f"train: stopped by {request.name or 'a signal to another rank'} after step "
                f"{self.global_step} (epoch {epoch + 1}); the state after it is saved in "
                f"{self.checkpointer.path / str(epoch)}: a rerun resumes from it",
                file=sys.stderr,
                flush=True,
            )
        raise SystemExit(128 + (request.signum or signal.SIGTERM))

    def setup_optimizer(self):
        """speculators' optimisers; on a GPU its AdamW runs as one fused kernel (same update)
        and its Muon batched by matrix shape (``batched_muon``), its wide matrices by Gram
        Newton-Schulz where ``newton_schulz`` is "gram" (``muon.BatchedMuon``), split over
        DDP's ranks where ``muon_across_ranks`` (FSDP's sharded matrices take torch's step)."""
        gpu, optimizer = torch.cuda.is_available(), self.config.optimizer
        patches = [
            name
            for name, on in (
                ("fused_adamw", gpu and optimizer == "adamw"),
                ("batched_muon", gpu and optimizer == "muon" and self.batched_muon),
            )
            if on
        ]
        across_ranks = self.muon_across_ranks and self.is_distributed and not self.config.fsdp_shard
        with speculators_patches(
            *patches, newton_schulz=self.newton_schulz, across_ranks=across_ranks
        ):
            built = super().setup_optimizer()
        from eagle3lib.graphed_step import plain_rates

        plain_rates(self.optimizers)  # state saved by a graphed run (train.graph_step)
        return built

    def maybe_save_checkpoint(self, epoch, local_step: int = 0):
        """speculators' save, a graphed step's rate tensors saved as numbers
        (``graphed_step.rates_as_numbers``)."""
        from eagle3lib.graphed_step import rates_as_numbers

        with rates_as_numbers(self.optimizers, getattr(self, "schedulers", None) or []):
            return super().maybe_save_checkpoint(epoch, local_step=local_step)

    def _prefetched(self, loader, depth: int = 4):
        """(batch, release) of ``loader`` in order, built ahead in background threads.

        Without DataLoader workers, ``loader_threads`` threads build them
        (``batches.ThreadedBatches``: into reused pinned buffers, handed back by ``release``);
        with workers, or with ``loader_threads`` 0, one thread iterates the DataLoader."""
        if self.loader_threads and not loader.num_workers:
            from eagle3lib.batches import ThreadedBatches

            self._threaded = ThreadedBatches(loader, self.loader_threads)
            batches = iter(self._threaded)
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
            self._buffer_wait_done = self.buffer_wait_seconds
            self._threaded = None

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

    def _train_step(self, gpu_batch: dict, autocast_cache: bool = True):
        """speculators' step: forward under autocast, backward, clipping, optimisers; returns
        the loss and the metrics (device tensors)."""
        with torch.autocast(
            self.device_type, dtype=self.config.hidden_states_dtype, cache_enabled=autocast_cache
        ):
            _draft_tokens, loss, metrics = self.model(
                **gpu_batch, **(self.config.train_call_kwargs or {})
            )
        self._optimizers_zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self._optimizers_step()
        return loss, metrics

    def _graphed_step(self):
        """``graph_step``'s GraphedStep over ``_train_step`` (kept across epochs); refused
        where it cannot run, with the reason."""
        from eagle3lib.graphed_step import GraphedStep, capturable_optimizers

        if not torch.cuda.is_available() or self.is_distributed:
            raise UserError("graphed step: one process on a GPU only (no CPU, no DDP)")
        if not self.sync_free:  # speculators' own metrics wait for the GPU inside the step
            raise UserError("graphed step: needs the sync-free loss metrics (sync_free)")
        if self._graphed is None:
            # capturable from the first eager step on, not at the capture: every step of a
            # run, eager or replayed, fresh or resumed, then takes the same update (a resumed
            # run's eager steps would otherwise read its rates as numbers where the run it
            # resumes replayed the graph, and end in other bytes)
            capturable_optimizers(self.optimizers, torch.device("cuda", self.local_rank))
            self._graphed = GraphedStep(self._train_step, self._optimizers_zero_grad)
        return self._graphed

    # long: speculators' Trainer.train_epoch, kept step for step in its order so it can be compared
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
        stop_agreed = False
        if self.stop_vote is None:
            self.stop_vote = StopVote()

        def stop_asked() -> bool:
            return self.stop_request.signum is not None

        step = self._train_step
        if self.graph_step:
            step = self._graphed_step()
        if self._in_flight is None:
            self._in_flight = StepsInFlight(self.steps_in_flight)
        in_flight = self._in_flight
        interval_gpu_wait = in_flight.wait_seconds

        local_step = skip_steps
        for local_step_rel, (batch, gpu_batch) in enumerate(self._device_batches(loader), 1):
            local_step = local_step_rel + skip_steps
            gpu_batch.pop(RECOVERY_METADATA_KEY, None)  # a rank's empty batch carries it
            tokens = int((batch["document_ids"] != -1).sum())
            interval_tokens += tokens
            loss, metrics = step(gpu_batch)
            in_flight.launched()
            at_log_step = self.global_step % self.config.log_freq == 0
            if at_log_step:  # the rates this step used (a graphed step's are device tensors)
                current_lrs = {
                    type(o).__name__: float(o.param_groups[0]["lr"]) for o in self.optimizers
                }
            self._schedulers_step()

            if at_log_step:  # the only full host sync (a stop vote waits a step behind)
                metrics = dict(metrics)  # a graphed step's own dict stays as captured
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                now = time.perf_counter()
                metrics["error_records_sum"] = torch.tensor(float(batch["error_records"]))
                metrics["error_records_total"] = torch.tensor(1.0 if self.rank == 0 else 0.0)
                if self.is_distributed:  # a stop asked of any rank stops them all here
                    metrics["stop_requested"] = torch.tensor(float(stop_asked()))
                    metrics = st._all_reduce_metrics(  # noqa: SLF001
                        {k: v.to(loss.device) for k, v in metrics.items()}
                    )
                values = {k: v.item() for k, v in metrics.items()}
                stop_agreed = values.pop("stop_requested", 0.0) > 0
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
                            "gpu_wait_fraction": (in_flight.wait_seconds - interval_gpu_wait)
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
                interval_gpu_wait = in_flight.wait_seconds
                diverged(values.get("loss"), self.global_step, epoch, lrs)
            self.global_step += 1
            if self.progress is not None:
                self.progress.step(self.global_step, epoch, tokens, self.data_wait_seconds)
            if step_callback is not None:
                step_callback()
            # between steps: one process acts on a stop at once; ranks agree on it at a logging
            # step (in the metrics' all-reduce) and, between them, by a vote at least every
            # STOP_VOTE_STEPS steps (read a step after it is cast: no host sync of its own)
            if self.is_distributed:
                stop_agreed = self.stop_vote.counted() or stop_agreed
                if self.stop_vote.due(at_log_step) and not stop_agreed:
                    self.stop_vote.cast(stop_asked(), loss.device)
            if stop_agreed or (not self.is_distributed and stop_asked()):
                self.stop_here(epoch, local_step)
            if self.config.max_steps is not None and self.global_step >= self.config.max_steps:
                break
            if (
                step_interval is not None
                and not self.config.save_best
                and local_step % step_interval == 0
                and num_steps - local_step >= step_interval * st.MIN_STEP_PCT
            ):
                self.maybe_save_checkpoint(epoch, local_step=local_step)
        else:  # the epoch's last step done: a vote cast after it is read now, not after the
            # next epoch's first step (which would wait through a validation and a save)
            if self.is_distributed and self.stop_vote.counted():
                self.stop_here(epoch, local_step)


def diverged(loss: float | None, step: int, epoch: int, lrs) -> None:
    """Stop the training at a logging step whose loss is NaN or infinite: the weights are then
    not finite either (no later step recovers them), and the draft they would export proposes
    one id whatever it is given. Every rank sees the all-reduced loss, so all stop here."""
    if loss is None or math.isfinite(loss):
        return
    raise UserError(
        f"train: the loss is {loss} at step {step} (epoch {epoch}, learning rate {lrs}): the "
        "training diverged; lower train.lr (each logging step's loss: train/state/metrics.jsonl)"
    )


# ---- model and trainer -----------------------------------------------------------------------
