"""The training step captured once into a CUDA graph and replayed every step after.

An experiment of ``bench/train.py`` (its ``*_graph`` variants), not a train option: on an
H100 beside 12 busy processes the host's launches of a step took up to 3.1 times as long and
the GPU waited for them (BENCHMARKS.md, "The train job's threads on an H100"). Replaying a
captured graph launches the whole step (forward under autocast, backward, gradient clipping,
the optimiser) with one call, so the host's pace stops mattering. What it needs:

- batches of one shape: every batch is copied into the graph's own input tensors
  (``train.packing: ffd`` pads each to ``total_seq_len``); another shape is refused;
- no host synchronisation inside the step (``StreamingTrainer``'s loop has none between
  logging steps; speculators' loss metrics are made sync-free, ``sync_free_eagle3``);
- optimisers whose step can be captured with a learning rate that changes: AdamW with
  ``capturable`` and its rate in a device tensor, which the schedulers fill in place;
- one process (no DDP).

The first ``eager_steps`` steps run as ``StreamingTrainer`` runs them (compiling, creating
the optimiser's state), but on a side stream and with autocast's cast cache off, as inside
the graph, so nothing compiles during the capture. Not yet run on a GPU: an independent
read of torch's and speculators' sources found no host synchronisation or value-dependent
host code in the step (flex attention's block mask follows the copied-in document ids)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def capturable_optimizers(optimizers: list[torch.optim.Optimizer], device) -> None:
    """Each optimiser made capturable in place, its learning rate moved into a float32 tensor
    on ``device`` (torch's schedulers then fill it in place instead of replacing it; fused
    AdamW reads a rate on the GPU from there, while one on the CPU would be baked into the
    graph); anything but fused AdamW (whose step counts live on the device) is refused,
    naming it."""
    for o in optimizers:
        if not isinstance(o, torch.optim.AdamW):
            raise ValueError(
                f"graphed step: {type(o).__name__} cannot be captured with a learning rate "
                "that changes every step; only AdamW (train.optimizer: adamw) can"
            )
        for group in o.param_groups:
            if not group.get("fused"):
                raise ValueError("graphed step: AdamW must be fused (its step counts on the GPU)")
            group["capturable"] = True
            group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)


# a batch's host-side count that changes from batch to batch: the loop logs the host batch's
PER_BATCH = ("error_records",)


def copy_into(static: dict[str, Any], batch: dict[str, Any]) -> None:
    """``batch``'s tensors copied into ``static``'s (the graph's inputs), in order on the
    current stream; a key, shape or dtype that differs, or another non-tensor value (but
    ``PER_BATCH``'s), is refused with the key named (the graph replays what it captured)."""
    if static.keys() != batch.keys():
        raise ValueError(
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
                raise ValueError(
                    f"graphed step: batch[{key!r}] is {got}, the graph captured "
                    f"{(held.shape, held.dtype)}; it needs batches of one shape "
                    "(train.packing: ffd pads each to total_seq_len)"
                )
            held.copy_(value, non_blocking=True)
        elif value != held and key not in PER_BATCH:
            raise ValueError(f"graphed step: batch[{key!r}] changed from {held!r} to {value!r}")


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
        self.prepare()  # optimisers capturable, gradients None (the graph allocates them)
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
