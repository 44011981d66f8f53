"""The torchrun process group as speculators' trainer and sampler see it: set up, queried, torn
down. speculators' own set-up serves GPUs; on CPU a gloo group fills the same state."""

from __future__ import annotations

import contextlib
import gc
import os
import traceback
from collections.abc import Iterator

import torch
from speculators.train import distributed as sd

from eagle3lib.speculators_compat import speculators_patches

# The CPU group's entries in speculators' distributed state, restored by teardown_distributed.
_GROUP = contextlib.ExitStack()


def setup_distributed() -> int:
    """Join the torchrun process group if launched by torchrun; return this rank.

    On GPUs this is speculators' own set-up (NCCL, one device per local rank); on CPU (tests)
    a gloo group fills the same topology state speculators' trainer and sampler read
    (``speculators_compat`` entry ``gloo_group``), until ``teardown_distributed``.
    """
    if "LOCAL_RANK" not in os.environ or sd.is_distributed():
        return sd.get_rank()
    if torch.accelerator.current_accelerator() is not None:
        sd.maybe_setup_distributed()
        return sd.get_rank()
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    _GROUP.enter_context(
        speculators_patches(
            "gloo_group", local_rank=int(os.environ["LOCAL_RANK"]), rank=rank, world_size=world
        )
    )
    sd._init_sp_process_groups(rank, world, 1)  # noqa: SLF001 - speculators' own set-up step
    return rank


def launched_rank() -> int:
    """This process's rank as torchrun started it (its RANK), known before the process group
    is joined (speculators' own rank reads 0 until then); 0 without torchrun."""
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    return sd.get_world_size()


def barrier() -> None:
    if sd.is_distributed():
        import torch.distributed as dist

        dist.barrier()


def weights_checksum(model: torch.nn.Module) -> torch.Tensor:
    """Each parameter's bits summed as integers, on its device: equal weights give equal
    sums, and one changed bit changes its parameter's sum."""
    sums = []
    for p in model.parameters():
        bits = p.detach().contiguous().view(-1)
        bits = bits.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[bits.element_size()])
        sums.append(bits.sum(dtype=torch.int64))
    return torch.stack(sums)


def ranks_agree(model: torch.nn.Module) -> bool | None:
    """Whether every rank holds the same weights (``weights_checksum``), as DDP's ranks must
    (each takes the same step from the same averaged gradients); None outside a group of
    several. Every rank must call it. Not for sharded (FSDP) weights: each rank holds its own."""
    if not sd.is_distributed() or sd.get_world_size() < 2:
        return None
    import torch.distributed as dist

    mine = weights_checksum(model)
    every = [torch.empty_like(mine) for _ in range(sd.get_world_size())]
    dist.all_gather(every, mine)
    return all(torch.equal(mine, other) for other in every)


def teardown_distributed() -> None:
    # A DDP module that outlives its process group (kept by a reference cycle until a later
    # collection) frees the group from its reducer holding the GIL; gloo's destructor then
    # joins worker threads, one of which may need the GIL to drop its last allreduce: a hang
    # (https://github.com/pytorch/pytorch/issues/56297). Free such modules first.
    gc.collect()
    sd.maybe_destroy_distributed()
    _GROUP.close()


@contextlib.contextmanager
def torn_down() -> Iterator[None]:
    """Run the block, then ``teardown_distributed``, also when the block raises. A raised
    exception's traceback (and those of the exceptions it was raised from or during) keeps the
    locals of every frame it passed through (the trainer, its DDP module) alive past any
    collection, so those finished frames are cleared first."""
    try:
        yield
    except BaseException as exc:
        seen, chain = set(), [exc]
        while chain:  # the exception and those it was raised from or during
            error = chain.pop()
            if error is not None and id(error) not in seen:
                seen.add(id(error))
                traceback.clear_frames(error.__traceback__)
                chain += [error.__cause__, error.__context__]
        raise
    finally:
        teardown_distributed()
