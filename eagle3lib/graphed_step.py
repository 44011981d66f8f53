"""The training step captured once into a CUDA graph and replayed every step after.

``train.graph_step`` (``auto``, the default, captures the step where ``decide`` finds it can
run and it was measured; ``bench/train.py``'s ``*_graph`` variants time it): on
an H100 beside 12 busy processes the host's launches of a step took up to 3.1 times as long
and the GPU waited for them (BENCHMARKS.md, "The train job's threads on an H100"). Replaying a
captured graph launches the whole step (forward under autocast, backward, gradient clipping,
the optimiser) with one call, so the host's pace stops mattering. What it needs:

- batches of one shape: every batch is copied into the graph's own input tensors
  (``train.packing: ffd`` pads each to ``total_seq_len``); another shape is refused;
- no host synchronisation inside the step (``StreamingTrainer``'s loop has none between
  logging steps; speculators' loss metrics are made sync-free, ``sync_free_eagle3``);
- optimisers whose step can be captured with a learning rate that changes: AdamW with
  ``capturable`` and ``muon.BatchedMuon`` (``capturable_optimizers``), their rates in device
  tensors, which the schedulers fill in place;
- one process (no DDP); ``refusal`` names what the train config lacks before a run starts.

The first ``eager_steps`` steps run as ``StreamingTrainer`` runs them (compiling, creating
the optimiser's state; ``StreamingTrainer`` makes the optimisers capturable before them, so
they take the replayed graph's update), but on a side stream and with autocast's cast cache
off, as inside the graph, so nothing compiles during the capture.

Measured on an H100 (BENCHMARKS.md, "The step captured into one CUDA graph" and "The default
recipe's step captured into one CUDA graph"; before the optimisers were made capturable
from the first step, 2026-12-05): with AdamW the graphed run's 50 losses within
0.0087 (relative) of the eager run's, and beside 12 busy processes it kept 0.995-0.998 of its
quiet pace where the eager step kept 0.654-0.825; with Muon (``BatchedMuon`` with a rate
tensor, the default recipe) within 0.00004, and 0.996-1.001 of its quiet pace."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from eagle3lib.errors import UserError


def capturable_optimizers(optimizers: list[torch.optim.Optimizer], device) -> None:
    """Each optimiser made capturable in place, its learning rate moved into a float32 tensor
    on ``device`` (torch's schedulers then fill it in place instead of replacing it; the
    step reads the rate on the GPU from there, while a number would be baked into the graph):
    AdamW (fused, or foreach as speculators builds it beside Muon: its step counts, kept on
    the CPU by an eager foreach step, are moved to ``device``) and ``muon.BatchedMuon`` on
    one process (``batched_muon`` applies a rate tensor on the device); anything else is
    refused, naming it and what to set instead."""
    from eagle3lib.muon import BatchedMuon

    for o in optimizers:
        if isinstance(o, BatchedMuon):
            if getattr(o, "ranks", None) is not None:
                raise UserError("graphed step: Muon split over ranks (DDP) cannot be captured")
        elif not isinstance(o, torch.optim.AdamW):
            raise UserError(
                f"graphed step: {type(o).__name__} cannot be captured with a learning rate "
                "that changes every step; only AdamW (train.optimizer: adamw, and beside "
                "Muon) and batched Muon (train.optimizer: muon with train.newton_schulz: gram) can"
            )
        for group in o.param_groups:
            if isinstance(o, torch.optim.AdamW):
                group["capturable"] = True
                for p in group["params"]:
                    state = o.state.get(p, {})
                    if isinstance(state.get("step"), torch.Tensor):
                        state["step"] = state["step"].to(device=device, dtype=torch.float32)
            group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)


@contextlib.contextmanager
def rates_as_numbers(optimizers: list[torch.optim.Optimizer], schedulers: list) -> Iterator[None]:
    """A graphed run's rates saved as numbers: inside, each optimiser's rate tensor is swapped
    for its value and each scheduler's last rates (clones of those tensors) become numbers, so
    a saved state holds no tensor of this GPU (speculators loads the schedulers' without a
    device map: a resume on a CPU, or another rank's GPU, would fail or allocate there). The
    tensors are put back on exit: the captured step reads them, the schedulers fill them."""
    held = []
    for o in optimizers:
        for group in o.param_groups:
            if isinstance(group["lr"], torch.Tensor):
                held.append((group, group["lr"]))
                group["lr"] = float(group["lr"])
    for s in schedulers:
        last = getattr(s, "_last_lr", None)
        if last is not None:
            s._last_lr = [float(x) for x in last]  # noqa: SLF001 - torch keeps them there
    try:
        yield
    finally:
        for group, rate in held:
            group["lr"] = rate


def plain_rates(optimizers: list[torch.optim.Optimizer]) -> None:
    """``capturable_optimizers`` undone in place, for optimisers whose state was saved by a
    graphed run and loaded into an eager one: rates back to numbers, ``capturable`` off, and a
    foreach AdamW's step counts back on the CPU (where its eager step reads them without
    waiting for the GPU; fused AdamW keeps them on the device either way)."""
    for o in optimizers:
        for group in o.param_groups:
            if isinstance(group["lr"], torch.Tensor):
                group["lr"] = float(group["lr"])
            if not group.get("capturable"):
                continue
            group["capturable"] = False
            if group.get("fused"):
                continue
            for p in group["params"]:
                state = o.state.get(p, {})
                if isinstance(state.get("step"), torch.Tensor):
                    state["step"] = state["step"].to("cpu", torch.float32)


def refusal(cfg, processes: int, gpu: bool, streaming: bool = True) -> str | None:
    """Why ``train.graph_step`` cannot run with train config ``cfg`` over ``processes``
    processes (``gpu``: one is there; ``streaming``: the trainer is StreamingTrainer with
    ``sync_free`` metrics), or
    None: said before the run starts, not at the capture a few steps in."""
    if not streaming:
        return (
            "it needs eagle3lib's StreamingTrainer with its sync-free metrics (speculators' "
            "Trainer steps eagerly)"
        )
    if not gpu:
        return "it needs a GPU"
    if processes > 1 or cfg.fsdp:
        return "it runs on one GPU only (train.gpus: 1, without DDP or FSDP)"
    if cfg.packing != "ffd":
        return "it needs batches of one shape (train.packing: ffd pads each to total_seq_len)"
    if cfg.optimizer == "muon" and cfg.newton_schulz != "gram":
        return (
            "with Muon it needs train.newton_schulz: gram (with standard, torch's Muon takes "
            "the large matrices and reads its learning rate as a number)"
        )
    return None


# the draft's attention and loss (train.resolve_runtime) the graphed step was measured with
MEASURED = {"attention": "simple_flex_attention", "loss": "eager"}


def unmeasured(runtime: dict[str, Any]) -> str | None:
    """Why auto leaves the step eager with ``runtime``'s attention and loss (their resolved
    values), or None: the graphed step was timed and its losses compared with ``MEASURED``'s
    only (true still captures the others)."""
    other = {k: runtime[k] for k, v in MEASURED.items() if runtime[k] != v}
    if not other:
        return None
    names = " and ".join(f"train.{k} {v}" for k, v in other.items())
    return f"not yet run with {names} (set it true to try)"


def decide(
    cfg, processes: int, gpu: bool, streaming: bool, runtime: dict[str, Any]
) -> tuple[bool, str]:
    """Whether the train job captures its step (``train.graph_step``: true, false or auto),
    with the reason for its log. auto graphs where neither ``refusal`` nor ``unmeasured``
    (``runtime``: the resolved attention and loss) finds anything against it, and runs the
    eager step elsewhere; true where it cannot run, or another value, is a UserError naming
    the key."""
    if not (isinstance(cfg.graph_step, bool) or cfg.graph_step == "auto"):
        raise UserError(f"train.graph_step: {cfg.graph_step!r}; use auto, true or false")
    if cfg.graph_step is False:
        return False, "the step run eagerly (train.graph_step: false)"
    why = refusal(cfg, processes, gpu, streaming)
    if cfg.graph_step is True:
        if why is not None:
            raise UserError(
                f"train.graph_step: true, but {why}; set it to auto (graphed where it can "
                "run) or false"
            )
        return True, "the step captured into one CUDA graph (train.graph_step: true)"
    why = why or unmeasured(runtime)
    if why is None:
        return True, "the step captured into one CUDA graph (train.graph_step: auto)"
    return False, f"the step run eagerly (train.graph_step: auto; a graphed step: {why})"


# a batch's host-side count that changes from batch to batch: the loop logs the host batch's
PER_BATCH = ("error_records",)


def copy_into(static: dict[str, Any], batch: dict[str, Any]) -> None:
    """``batch``'s tensors copied into ``static``'s (the graph's inputs), in order on the
    current stream; a key, shape or dtype that differs, or another non-tensor value (but
    ``PER_BATCH``'s), is refused with the key named (the graph replays what it captured),
    before anything is copied."""
    if static.keys() != batch.keys():
        raise UserError(
            f"graphed step: a batch with keys {sorted(batch)} after capturing {sorted(static)}"
        )
    for key, value in batch.items():
        held = static[key]
        if isinstance(held, torch.Tensor):
            if not isinstance(value, torch.Tensor) or (value.shape, value.dtype) != (
                held.shape,
                held.dtype,
            ):
                got = (value.shape, value.dtype) if isinstance(value, torch.Tensor) else value
                raise UserError(
                    f"graphed step: batch[{key!r}] is {got}, the graph captured "
                    f"{(held.shape, held.dtype)}; it needs batches of one shape "
                    "(train.packing: ffd pads each to total_seq_len)"
                )
        elif value != held and key not in PER_BATCH:
            raise UserError(f"graphed step: batch[{key!r}] changed from {held!r} to {value!r}")
    for key, value in batch.items():
        if isinstance(static[key], torch.Tensor):
            static[key].copy_(value, non_blocking=True)


def detached(outputs: tuple[torch.Tensor, dict]) -> tuple[torch.Tensor, dict]:
    """An eager step's loss and metrics without their autograd history: a loss kept alive
    across the capture would keep the parameters' AccumulateGrad nodes, which remember the
    stream they last ran on, and autograd refuses to capture with those."""
    loss, metrics = outputs
    return loss.detach(), {
        k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()
    }


class GraphedStep:
    """Runs ``step(batch, autocast_cache)`` -> (loss, metrics): eagerly for the first
    ``eager_steps`` calls, then captures it into a CUDA graph with the batch of that call and
    replays the graph from then on, each batch copied into the captured inputs. The returned
    loss and metrics are the graph's own tensors, overwritten by each replay.

    The eager steps and the capture run on one side stream (torch: a whole backward is
    captured only after warm-up steps off the default stream), ordered after and before the
    current stream's work; the capture is "thread_local", so the loader threads' event
    waits and pinned allocations during it do not invalidate it."""

    def __init__(
        self,
        step: Callable[[dict[str, Any], bool], tuple[torch.Tensor, dict]],
        prepare: Callable[[], None],
        eager_steps: int = 3,
    ):
        self.step, self.prepare, self.eager_steps = step, prepare, eager_steps
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static: dict[str, Any] | None = None
        self.outputs: tuple[torch.Tensor, dict] | None = None
        self.stream = None

    def __call__(self, batch: dict[str, Any]) -> tuple[torch.Tensor, dict]:
        self.calls += 1
        if self.calls <= self.eager_steps:
            return detached(self._on_side_stream(lambda: self.step(batch, False), batch))
        if self.graph is None:
            self._on_side_stream(lambda: self._capture(batch), batch)
        else:
            copy_into(self.static, batch)
        self.graph.replay()
        return self.outputs

    def _on_side_stream(self, run: Callable[[], Any], batch: dict[str, Any]) -> Any:
        """``run()`` on the side stream, after the current stream's work and before its
        next; ``batch``'s tensors are marked as used there (the allocator keeps them)."""
        if self.stream is None:
            self.stream = torch.cuda.Stream()
        current = torch.cuda.current_stream()
        self.stream.wait_stream(current)
        for value in batch.values():
            if isinstance(value, torch.Tensor) and value.is_cuda:
                value.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            out = run()
        current.wait_stream(self.stream)
        return out

    def _capture(self, batch: dict[str, Any]) -> None:
        self.prepare()  # gradients None: the graph allocates them
        self.static = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        graph = torch.cuda.CUDAGraph()
        failed = None
        try:
            with torch.cuda.graph(graph, stream=self.stream, capture_error_mode="thread_local"):
                try:
                    self.outputs = self.step(self.static, False)
                except Exception as exc:
                    failed = exc
                    raise
        except Exception as exc:  # ending the capture fails too and would hide the cause
            if failed is not None and exc is not failed:
                raise RuntimeError(
                    f"graphed step: the capture failed: {type(failed).__name__}: {failed}"
                ) from failed
            raise
        self.graph = graph
