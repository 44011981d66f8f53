"""BatchedMuon split over ranks (``across_ranks``), the run tests/test_muon.py compares: each
gloo rank started as ``python muon_ranks_worker.py STORE RANK HOSTS OUT`` (HOSTS: each
rank's host name, comma-separated; this rank stands for its own) steps the same parameters
with the same gradients and saves what it ends with; the test runs ``run`` alone in its own
process for the unsplit reference."""

import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from eagle3lib import muon
from eagle3lib.muon import BatchedMuon

# wide, tall and square matrices, repeated shapes, and wide ones where the Gram form pays
SHAPES = [(16, 48), (48, 16), (16, 48), (24, 24), (24, 24), (8, 24), (24, 8), (16, 32), (32, 96)]
# BatchedMuon's settings, and the parameters' dtype: with bf16 parameters and no nesterov
# torch's function divides the momentum buffer itself in place (each rank must do the same)
SETTINGS = {
    "batched": ({}, torch.float32),
    "gram_one_at_a_time": ({"newton_schulz": "gram", "batched": False}, torch.float32),
    "standard_one_at_a_time": ({"batched": False}, torch.float32),
    "standard_one_at_a_time_plain": ({"batched": False, "nesterov": False}, torch.float32),
    "standard_one_at_a_time_bf16_plain": ({"batched": False, "nesterov": False}, torch.bfloat16),
    "batched_bf16_plain": ({"nesterov": False}, torch.bfloat16),
}


def unit(kind: str, like: list[torch.Tensor]) -> tuple:
    """A unit as the worker records it: its kind, its matrices' count and first shape."""
    return kind, len(like), tuple(like[0].shape)


def owned(setting: str, member: int, world: int) -> list[tuple]:
    """The units ``Ranks.owners`` gives member ``member`` of ``world`` in one step of
    ``setting`` (sorted)."""
    settings, dtype = SETTINGS[setting]
    like = [torch.empty(s, dtype=dtype, device="meta") for s in SHAPES]
    gram, batched = settings.get("newton_schulz") == "gram", settings.get("batched", True)
    units = muon._units(like, 5, gram=gram, batched=batched)
    owners = muon.Ranks(member, tuple(range(world))).owners(
        [muon._unit_flops(like, u, 5) for u in units]
    )
    return sorted(unit(kind, [like[i] for i in indices])
                  for (indices, kind), o in zip(units, owners, strict=True) if o == member)  # fmt: skip


class Matmuls(TorchDispatchMode):
    """Counts the matmul launches run under it."""

    n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in ("mm", "addmm", "bmm", "baddbmm"):
            self.n += 1
        return func(*args, **(kwargs or {}))


def run(setting: str, across_ranks: bool, n: int = 3) -> dict:
    """``n`` steps of BatchedMuon (``SETTINGS[setting]``) from seeded weights and gradients:
    the parameters, momentum buffers and matmul launches it ends with, and the units it
    orthogonalised."""
    settings, dtype = SETTINGS[setting]
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]
    ranks = muon.Ranks.of_this_host() if across_ranks else None
    opt = BatchedMuon(params, lr=0.02, weight_decay=0.1, ranks=ranks, **settings)
    done, orthogonalise = [], muon._unit_result

    def recorded(updates, kind, *args):
        done.append(unit(kind, updates))
        return orthogonalise(updates, kind, *args)

    muon._unit_result = recorded
    try:
        with Matmuls() as counted:
            for _ in range(n):
                for p in params:
                    p.grad = torch.randn(p.shape, generator=gen).to(dtype)
                opt.step()
    finally:
        muon._unit_result = orthogonalise
    return {
        "params": [p.detach().clone() for p in params],
        "bufs": [opt.state[p]["momentum_buffer"].clone() for p in params],
        "matmuls": counted.n,
        "orthogonalised": sorted(done),  # the units this rank orthogonalised, all steps
        "ranks": None if opt.ranks is None else (opt.ranks.rank, opt.ranks.world),
    }


def mismatched(rank: int) -> str | None:
    """A step where rank 1 holds no gradient for the last matrix: the error each rank gets
    (None: none; a rank not splitting with rank 1 steps as usual)."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    opt = BatchedMuon(params, lr=0.02, ranks=muon.Ranks.of_this_host())
    for p in params[:-1] if rank == 1 else params:
        p.grad = torch.randn(p.shape, generator=gen)
    try:
        opt.step()
    except RuntimeError as exc:
        return str(exc)
    return None


def built_optimizers(newton_schulz: str) -> list[tuple]:
    """What ``gpu_optimizers`` makes of torch's Muon over one large and one small matrix with
    ``across_ranks``: (type, batched, gram, ranks) each."""
    big, small = torch.nn.Parameter(torch.randn(8, 8)), torch.nn.Parameter(torch.randn(2, 2))
    before, muon.BATCH_MAX_ELEMENTS = muon.BATCH_MAX_ELEMENTS, 16
    try:
        built = muon.gpu_optimizers(
            [torch.optim.Muon([big, small], lr=0.01)], newton_schulz, across_ranks=True
        )
    finally:
        muon.BATCH_MAX_ELEMENTS = before
    ranks = [getattr(o, "ranks", None) for o in built]
    return [
        (type(o).__name__, getattr(o, "batched", None), getattr(o, "gram", None),
         None if r is None else (r.rank, r.world))
        for o, r in zip(built, ranks, strict=True)
    ]  # fmt: skip


if __name__ == "__main__":
    import socket

    import torch.distributed as dist

    store, rank, hosts, out = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(","), sys.argv[4]
    socket.gethostname = lambda: hosts[rank]  # the host this rank stands for
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=len(hosts))  # fmt: skip
    results = {s: run(s, across_ranks=True) for s in SETTINGS}
    results["built"] = {ns: built_optimizers(ns) for ns in ("gram", "standard")}
    results["mismatched"] = mismatched(rank)
    torch.save(results, out)
    dist.barrier()  # every rank's collectives are done
    # Exit without tearing gloo down: once in a full test run (1 of 2 clean-clone runs) a
    # rank that had saved its results aborted while exiting ("terminate called without an
    # active exception", a thread of gloo's destroyed unjoined). The train job's gloo runs
    # (CPU) do not split Muon, so they start no asynchronous broadcasts.
    import os

    os._exit(0)
