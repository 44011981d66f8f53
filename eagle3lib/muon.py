"""torch's Muon with its per-matrix work batched for small matrices: one launch per shape.

torch.optim.Muon (speculators' Muon) orthogonalises each weight matrix on its own: about 23
eager operations per matrix (momentum, cast, norm, 5 Newton-Schulz iterations of three
matmuls, weight decay, update). A small draft's step is bound by the host launching them
(three SmolLM2-sized layers: 22 matrices, about 500 launches a step). ``BatchedMuon`` stacks
the matrices of one shape (taken in the orientation torch orthogonalises them in, rows <=
columns) and runs the same iteration with batched matmuls; the momentum, weight decay and
update run as foreach operations. Every formula is torch's; the launch grouping differs, so
the update equals torch's up to the rounding of batched against single matmuls
(tests/test_muon.py states the tolerance), and the step holds one shape's updates at once
(stacked), not one matrix's. ``gpu_optimizers`` gives it the matrices of at most
``BATCH_MAX_ELEMENTS`` elements and leaves larger ones, where the GPU's matmuls and not the
launches take the time, to torch's Muon as built where train.newton_schulz is standard.

``gpu_optimizers`` with "gram" (train.newton_schulz's default) gives those large matrices to a
BatchedMuon that takes them one after another as torch does and orthogonalises the wide ones
(m x n, n > 1.5 m once oriented) by Gram Newton-Schulz (Zhang, Amsel, Chen and Dao, "Gram
Newton-Schulz", 2026): the same polynomial iteration written as X_k = Q_k X_0, Q_k a
polynomial in the m x m Gram matrix X_0 X_0^T, so that the steps multiply m x m matrices
instead of m x n ones: for five steps 8 m^2 n + 28 m^3 FLOPs instead of 20 m^2 n + 10 m^3 (a
4096 x 14336 MLP matrix: 30 % fewer). In exact arithmetic the result is torch's. In half
precision the Gram form drifts unless restarted, so, as its authors do, it starts afresh from
X_2 after two steps (and every three steps after that, for more than five); it runs in fp16
(three mantissa bits more than bf16) with X scaled by 2^7 so that small entries keep fp16's
precision. Its result is closer to the exact (fp64) iteration than torch's bf16 one, except
where a few columns are 10^3-10^5 times the rest: the Gram matrix squares that range, and on
smaller matrices the result was then up to 2.4 x as far (tests/test_muon.py bounds it at 3 x
and a relative distance of 0.02; bench/newton_schulz.py checks a draft's real shapes).
Sharded (FSDP) matrices take torch's step.

Under DDP every rank holds the same averaged gradients, and torch's Muon has each of them
orthogonalise every matrix. With ``gpu_optimizers``' ``across_ranks`` (the train job's DDP
runs) the units (a stack of one shape, or one large matrix) are dealt out over the ranks of
each host (``Ranks.of_this_host``: across hosts sending the results would cost more than
computing them), costliest first, each to the least loaded rank (``Ranks.owners``, FLOPs by
``newton_schulz_flops``); a unit's owner broadcasts its 16-bit result while the next unit
runs, and every rank applies the same bits, the unsplit step's (tests/test_muon.py: gloo
processes standing for one host and for two). The momentum buffers stay on every rank, so
the saved state is the same as without the split."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

# Matrices up to this many elements go to BatchedMuon. On one H200 (BENCHMARKS.md) batching
# made the Muon step of a SmolLM2-shaped draft (matrices of at most 576 x 1728, about 1.0 M
# elements) 2.5 x faster and that of a Llama-8B-shaped one 5.6 % slower; the smallest matrix
# of an 8B-shaped draft of any depth (k and v of the layers after the first: 1024 x 4096,
# 4.2 M) is above this bound, so such drafts' matrices are taken one at a time (by torch's
# Muon as built with train.newton_schulz: standard).
BATCH_MAX_ELEMENTS = 1 << 21


def _newton_schulz(stacked: Tensor, coefficients, steps: int, eps: float) -> Tensor:
    """torch's ``_zeropower_via_newtonschulz`` for a stack (B, m, n) of bf16 matrices with
    m <= n: each divided by its own Frobenius norm, then the same quintic iteration."""
    a, b, c = coefficients
    norms = torch.linalg.vector_norm(stacked, dim=(1, 2), keepdim=True)
    x = stacked / norms.clamp(min=eps)
    for _ in range(steps):
        gram = torch.bmm(x, x.transpose(1, 2))
        gram_update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, gram_update, x, beta=a)
    return x


# Gram Newton-Schulz starts afresh (X_k = Q_k X_0 formed, its Gram matrix recomputed) before
# this step, its authors' choice for five steps in half precision, and every GRAM_SPAN steps
# after it (none in five steps): Q then spans at most GRAM_SPAN steps, its eigenvalues at most
# a^3 = 40.9, and the scaled X_k it multiplies stays in fp16's range.
GRAM_RESTART = 2
GRAM_SPAN = 3
# X is held times this in fp16 (its Gram matrix times the square): a normalised matrix's
# entries and Gram matrix are small (about 1 / sqrt(m n) and 1 / m), and an input with a few
# large columns leaves the rest far smaller, below fp16's normal range (6.1e-5) unscaled; the
# Gram matrix's eigenvalues stay below 1.45 (the quintic maps [0, 1] into [0, 1.21]), so
# scaled by 2^14 they and every product stay below 2.4e4, under fp16's 65504.
GRAM_SCALE = 2.0**7


def _restarts(steps: int) -> set[int]:
    """The steps Gram Newton-Schulz restarts before."""
    return set(range(GRAM_RESTART, steps, GRAM_SPAN)) - {0}


def newton_schulz_flops(m: int, n: int, steps: int, gram: bool) -> int:
    """Matmul FLOPs of orthogonalising one m x n matrix (m <= n) by ``steps`` Newton-Schulz
    steps: torch's iteration, or ``_gram_newton_schulz``'s."""
    if not gram:
        return steps * (4 * m * m * n + 2 * m**3)
    restarts = _restarts(steps)
    square = 0
    for k in range(steps):
        square += 2  # the Gram matrix squared
        if k != 0 and k not in restarts:
            square += 2  # Q_k = P_k Q_(k-1)
        if k + 1 < steps and k + 1 not in restarts:
            square += 4  # the next Gram matrix, P_k (A_k P_k)
    # X_0 X_0^T; at each restart Q X_0 and its Gram matrix; Q X_0 at the end
    wide = 2 + 4 * len(restarts) + 2
    return wide * m * m * n + square * m**3


def _gram_pays(m: int, n: int, steps: int) -> bool:
    return newton_schulz_flops(m, n, steps, True) < newton_schulz_flops(m, n, steps, False)


@contextlib.contextmanager
def _fp32_accumulation():
    """fp16 matmuls that sum in fp32 throughout: torch lets cuBLAS reduce split-K partial sums
    in fp16 by default, and the scaled Gram matrix's square (up to 6e8 before its alpha scales
    it back) would overflow there."""
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_fp16_reduced_precision_reduction
    matmul.allow_fp16_reduced_precision_reduction = False
    try:
        yield
    finally:
        matmul.allow_fp16_reduced_precision_reduction = before


def _scaled_half(x: Tensor, scale: Tensor) -> Tensor:
    """``(x * scale).half()``, contiguous, by one kernel: the product is rounded to fp32 and
    then to fp16 as there, without writing and reading the fp32 product."""
    out = torch.empty(x.shape, dtype=torch.float16, device=x.device)
    return torch.mul(x, scale, out=out)


def _gram_newton_schulz(stacked: Tensor, coefficients, steps: int, eps: float) -> Tensor:
    """torch's iteration for a stack (B, m, n) with m <= n, in Gram form and fp16: each matrix
    divided by its own Frobenius norm (in fp32), then X_(k+1) = P_k X_k with P_k = a I + b A_k
    + c A_k^2 and A_k = X_k X_k^T, carried as X_k = Q_k X_0 and A_(k+1) = P_k A_k P_k (the
    matrices commute), restarted from X_k before the steps of ``_restarts``. X is held scaled
    by GRAM_SCALE and A by its square, so that small entries stay in fp16's normal range; the
    result is returned so (fp16, times GRAM_SCALE)."""
    a, b, c = coefficients
    t = GRAM_SCALE
    s = t * t
    x = stacked.float()
    norms = torch.linalg.vector_norm(x, dim=(1, 2), keepdim=True)
    x = _scaled_half(x, t / norms.clamp(min=eps))
    with _fp32_accumulation():
        gram = torch.bmm(x, x.mT)  # s A_0
        q, restarts = None, _restarts(steps)
        for k in range(steps):
            if k in restarts:
                x = torch.bmm(q, x)
                gram, q = torch.bmm(x, x.mT), None
            p = torch.baddbmm(gram, gram, gram, beta=b / s, alpha=c / (s * s))
            p.diagonal(dim1=1, dim2=2).add_(a)
            q = p if q is None else torch.bmm(p, q)
            if k + 1 < steps and k + 1 not in restarts:
                gram = torch.bmm(p, torch.bmm(gram, p))
        return x if q is None else torch.bmm(q, x)


def exact_newton_schulz(g: Tensor, coefficients, steps: int) -> Tensor:
    """torch's iteration on ``g`` in fp64, in ``g``'s orientation: the reference the checks of
    the Gram form measure distances to (tests/test_muon.py, bench/newton_schulz.py)."""
    a, b, c = coefficients
    tall = g.shape[0] > g.shape[1]
    x = (g.T if tall else g).double()
    x = x / x.norm()
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def _by_shape(updates: list[Tensor]) -> dict[tuple, list[int]]:
    """Indices of ``updates`` grouped by the shape torch orthogonalises them in (rows <=
    columns: a tall matrix is transposed), device and dtype."""
    groups: dict[tuple, list[int]] = {}
    for i, u in enumerate(updates):
        m, n = u.shape
        groups.setdefault((min(m, n), max(m, n), u.device, u.dtype), []).append(i)
    return groups


# How a unit of matrices (one, or a stack of one oriented shape) is orthogonalised: "torch"
# (torch's own function, one matrix), "stacked" (torch's iteration, batched) or "gram"
Unit = tuple[list[int], str]


def _units(like: list[Tensor], steps: int, *, gram: bool, batched: bool) -> list[Unit]:
    """``like``'s matrices in units orthogonalised together: the matrices of one oriented
    shape (``batched``) or each alone; by Gram Newton-Schulz where ``gram`` and it takes
    fewer FLOPs, else by torch's iteration."""
    groups = _by_shape(like).values() if batched else [[i] for i in range(len(like))]
    units = []
    for indices in groups:
        if gram and _gram_pays(*sorted(like[indices[0]].shape), steps):
            kind = "gram"
        else:
            kind = "stacked" if batched else "torch"
        units.append((list(indices), kind))
    return units


def _unit_flops(like: list[Tensor], unit: Unit, steps: int) -> int:
    indices, kind = unit
    m, n = sorted(like[indices[0]].shape)
    return len(indices) * newton_schulz_flops(m, n, steps, kind == "gram")


def _oriented(u: Tensor) -> Tensor:
    return u.T if u.shape[0] > u.shape[1] else u


def _unit_result(updates: list[Tensor], kind: str, coefficients, steps: int, eps: float) -> Tensor:
    """A unit's orthogonalisation as the stack (B, m, n), m <= n, of its matrices oriented so
    and in the 16 bits its iteration leaves them in (what ranks exchange; ``_unpacked`` makes
    the updates of it): bf16, or for "gram" fp16 times GRAM_SCALE. Contiguous."""
    if kind == "torch":  # its result is in the input's orientation (a tall one transposed back)
        return _oriented(_zeropower_via_newtonschulz(updates[0], coefficients, steps, eps))[None]
    oriented = [_oriented(u) for u in updates]
    if kind == "gram":  # one matrix as a view: the iteration's first step copies it
        stacked = oriented[0][None] if len(oriented) == 1 else torch.stack(oriented)
        return _gram_newton_schulz(stacked, coefficients, steps, eps)
    return _newton_schulz(torch.stack(oriented).bfloat16(), coefficients, steps, eps)


def _empty_result(like: list[Tensor], kind: str) -> Tensor:
    """Room for the ``_unit_result`` of matrices shaped as ``like``."""
    dtype = torch.float16 if kind == "gram" else torch.bfloat16
    return torch.empty((len(like), *sorted(like[0].shape)), dtype=dtype, device=like[0].device)


def _unpacked(result: Tensor, kind: str, like: list[Tensor]) -> list[Tensor]:
    """The updates in ``result`` in the orientation and dtype of ``like`` (from 16 bits, and
    unscaling by a power of two, exact)."""
    if kind == "gram":
        result = result.float().mul_(1 / GRAM_SCALE)
    return _oriented_as(result.to(like[0].dtype), like)


def _oriented_as(result: Tensor, like: list[Tensor]) -> list[Tensor]:
    """The matrices of ``result`` (B, m, n) as views in the orientation of ``like``'s."""
    return [o.T if u.shape[0] > u.shape[1] else o
            for u, o in zip(like, result.unbind(0), strict=True)]  # fmt: skip


def _orthogonalised(updates: list[Tensor], coefficients, steps: int, eps: float, *,
                    gram: bool, batched: bool) -> list[Tensor]:  # fmt: skip
    """Each update's orthogonalisation, in the input's orientation and dtype, by the units of
    ``_units``."""
    out: list[Tensor | None] = [None] * len(updates)
    for indices, kind in _units(updates, steps, gram=gram, batched=batched):
        like = [updates[i] for i in indices]
        result = _unit_result(like, kind, coefficients, steps, eps)
        for i, o in zip(indices, _unpacked(result, kind, like), strict=True):
            out[i] = o
    return out


def host_groups(hosts: list[str]) -> list[list[int]]:
    """The ranks of each host (``hosts``: each rank's), hosts in the order of their first rank."""
    groups: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        groups.setdefault(host, []).append(rank)
    return list(groups.values())


@dataclass(frozen=True)
class Ranks:
    """The ranks of one host, each holding the same gradients (DDP): each orthogonalises its
    share of the units and broadcasts the results to the others. Only within a host: across
    hosts the results (16 bits an element, every step) would take longer to send than to
    compute over a network much slower than the GPUs' own links."""

    rank: int  # this process's index in ``members``
    members: tuple[int, ...]  # the host's ranks in the default group
    group: Any = field(default=None, compare=False)  # theirs, None: the default group

    @property
    def world(self) -> int:
        return len(self.members)

    @classmethod
    def of_this_host(cls) -> Ranks | None:
        """This host's ranks of the default group (a group of their own where it spans
        several hosts), or None outside a group or where this host has one rank. A host is a
        machine (its name) and torchrun's node there (``GROUP_RANK``). Every rank of the
        default group must call it (it gathers their hosts)."""
        import os
        import socket

        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        hosts: list[str | None] = [None] * dist.get_world_size()
        # the machine, and torchrun's node on it (several torchruns may share one machine)
        node = f"{socket.gethostname()} node {os.environ.get('GROUP_RANK', '')}"
        dist.all_gather_object(hosts, node)
        groups, me = host_groups(hosts), dist.get_rank()
        mine = next(g for g in groups if me in g)
        group = None
        if len(groups) > 1:
            for ranks in groups:  # every rank makes every group, in the same order
                made = dist.new_group(ranks)
                if ranks is mine:
                    group = made
        return cls(mine.index(me), tuple(mine), group) if len(mine) > 1 else None

    def check_same_matrices(self, shapes: list[list[tuple[int, ...]]]) -> None:
        """Raise where the host's ranks are about to step different matrices (``shapes``: this
        rank's with gradients, by parameter group): their broadcasts would not match and the
        step would hang. DDP gives every rank gradients for the same parameters; this catches
        any other caller, once (one gather of the shapes over the host's ranks)."""
        import torch.distributed as dist

        gathered: list = [None] * self.world
        dist.all_gather_object(gathered, shapes, group=self.group)
        other = next((i for i, g in enumerate(gathered) if g != gathered[0]), None)
        if other is not None:
            count = [sum(map(len, gathered[i])) for i in (0, other)]  # matrices, all groups
            raise RuntimeError(
                f"Muon split over ranks: rank {self.members[0]} steps {count[0]} matrices with "
                f"gradients, rank {self.members[other]} {count[1]} (or of other shapes); the "
                "ranks sharing Muon's work must hold gradients for the same parameters, as DDP "
                "gives them"
            )

    def owners(self, costs: list[int]) -> list[int]:
        """The member orthogonalising each unit (its index in ``members``): the costliest
        unit first, each to the least loaded member (the same on every rank: it depends on
        the costs alone)."""
        load, owners = [0] * self.world, [0] * len(costs)
        for u in sorted(range(len(costs)), key=lambda u: (-costs[u], u)):
            owners[u] = min(range(self.world), key=lambda r: (load[r], r))
            load[owners[u]] += costs[u]
        return owners


def _apply(params: list[Tensor], result: Tensor, kind: str, lr: float | Tensor,
           weight_decay: float, adjust_lr_fn, batched: bool) -> None:  # fmt: skip
    """torch's weight decay and update from a unit's ``_unit_result`` (its lr scale depends on
    the matrix's orientation, which a unit's matrices need not share). A "gram" result taken
    one matrix at a time (as ``gpu_optimizers`` takes them) is added to fp32 or fp64
    parameters in fp16 with GRAM_SCALE folded into the step size: the same bits as adding its
    ``_unpacked`` updates by the same kernel (the scale is a power of two, and the fp16 values
    convert exactly), without writing and reading them. Batched, the foreach kernels take
    lists of one dtype only, so stacks are unpacked."""
    if kind == "gram" and not batched and params[0].dtype in (torch.float32, torch.float64):
        ortho, scale = _oriented_as(result, params), 1 / GRAM_SCALE
    else:
        ortho, scale = _unpacked(result, kind, params), 1.0
    if isinstance(lr, Tensor):
        _apply_rate_on_device(params, ortho, scale, lr, weight_decay, adjust_lr_fn)
        return
    if not batched:
        for p, o in zip(params, ortho, strict=True):
            p.mul_(1 - lr * weight_decay)
            p.add_(o, alpha=-_adjust_lr(lr, adjust_lr_fn, p.shape) * scale)
        return
    if params[0].dtype in (torch.float32, torch.float64):
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    else:  # (foreach_mul_ rounds a number to bf16 or fp16 parameters' dtype; mul_ does not)
        for p in params:
            p.mul_(1 - lr * weight_decay)
    by_alpha: dict[float, tuple[list[Tensor], list[Tensor]]] = {}
    for p, o in zip(params, ortho, strict=True):
        ps, us = by_alpha.setdefault(-_adjust_lr(lr, adjust_lr_fn, p.shape) * scale, ([], []))
        ps.append(p)
        us.append(o)
    for alpha, (ps, us) in by_alpha.items():
        torch._foreach_add_(ps, us, alpha=alpha)


def _apply_rate_on_device(params: list[Tensor], ortho: list[Tensor], scale: float, lr: Tensor,
                          weight_decay: float, adjust_lr_fn) -> None:  # fmt: skip
    """``_apply``'s update with the learning rate a tensor on the device (a captured step's:
    ``graphed_step.capturable_optimizers``), read there instead of baked in as a number:
    the decay and each step size are tensors (the step size by matrix shape, torch's
    ``_adjust_lr``), and each update is added in the parameter's dtype (addcmul, as ``add``'s
    alpha does); for fp32 or fp64 parameters (the trainer's) the same update up to the
    rounding of the rate (float32) and its products; a bf16 or fp16 parameter would take its
    step size rounded to its own dtype (``add``'s alpha stays fp32)."""
    torch._foreach_mul_(params, 1 - lr * weight_decay)
    alphas: dict[float, Tensor] = {}
    for p, o in zip(params, ortho, strict=True):
        factor = -_adjust_lr(1.0, adjust_lr_fn, p.shape) * scale
        if factor not in alphas:
            alphas[factor] = lr * factor
        p.addcmul_(o, alphas[factor])


def batched_muon(params, grads, bufs, *, lr: float | Tensor, weight_decay: float, momentum: float,
                 nesterov: bool, ns_coefficients, ns_steps: int, eps: float,
                 adjust_lr_fn, gram: bool = False, batched: bool = True,
                 ranks: Ranks | None = None) -> None:  # fmt: skip
    """One Muon step over ``params``: torch's ``_single_tensor_muon``, with ``batched`` its
    elementwise work as foreach operations and the matrices of one shape orthogonalised
    together, else one matrix after another as torch does; by Gram Newton-Schulz where
    ``gram`` (``_units``). Alone, one unit's update is held at a time. Over ``ranks`` every
    rank updates every momentum buffer and parameter, but each unit is orthogonalised by one
    rank (``Ranks.owners``) and broadcast from it while the next runs: every rank applies
    the same bits, each holding the results it sent and received until they are applied.
    Every rank must hold gradients for the same parameters (as DDP gives them), or the ranks'
    broadcasts do not match and the step hangs (BatchedMuon checks it at its first step:
    ``Ranks.check_same_matrices``)."""
    if batched:
        torch._foreach_lerp_(bufs, grads, 1 - momentum)
    else:
        for buf, grad in zip(bufs, grads, strict=True):
            buf.lerp_(grad, 1 - momentum)
    units = _units(bufs, ns_steps, gram=gram, batched=batched)
    if ranks is None:
        owners, order = [None] * len(units), range(len(units))
    else:
        costs = [_unit_flops(bufs, unit, ns_steps) for unit in units]
        owners = ranks.owners(costs)
        order = sorted(range(len(units)), key=lambda u: (-costs[u], u))
    sent = []
    for u in order:
        indices, kind = units[u]
        unit_params = [params[i] for i in indices]
        if owners[u] is None or owners[u] == ranks.rank:
            unit_bufs = [bufs[i] for i in indices]
            updates = unit_bufs
            if nesterov:
                unit_grads = [grads[i] for i in indices]
                if batched:
                    updates = torch._foreach_lerp(unit_grads, unit_bufs, momentum)
                else:
                    updates = [
                        g.lerp(b, momentum) for g, b in zip(unit_grads, unit_bufs, strict=True)
                    ]
            result = _unit_result(updates, kind, ns_coefficients, ns_steps, eps)
            del updates
            if kind != "torch" and not nesterov:  # these orthogonalised a copy of each buffer
                for i in indices:
                    _normalised_as_torch_does(bufs[i], eps)
        else:
            result = _empty_result(unit_params, kind)
            if not nesterov:
                for i in indices:
                    _normalised_as_torch_does(bufs[i], eps)
        if owners[u] is not None:
            import torch.distributed as dist

            source = ranks.members[owners[u]]
            work = dist.broadcast(result, src=source, group=ranks.group, async_op=True)
            sent.append((u, result, work))
            continue
        _apply(unit_params, result, kind, lr, weight_decay, adjust_lr_fn, batched)
        del result
    for u, result, work in sent:
        work.wait()
        unit_params = [params[i] for i in units[u][0]]
        _apply(unit_params, result, units[u][1], lr, weight_decay, adjust_lr_fn, batched)


def _normalised_as_torch_does(buf: Tensor, eps: float) -> None:
    """What torch's ``_zeropower_via_newtonschulz`` does to its input besides orthogonalising
    it: a bf16 input (``bfloat16()`` returns it as it is) is divided by its norm in place.
    Without nesterov the input is the momentum buffer itself, so with bf16 parameters torch's
    Muon leaves it so divided; a step that orthogonalises a copy of the buffer (stacked, or
    by Gram Newton-Schulz), and a rank that does not orthogonalise it, does the same, so that
    every path and rank keeps the buffer torch's step leaves."""
    if buf.dtype == torch.bfloat16:
        x = buf.T if buf.size(0) > buf.size(1) else buf
        x.div_(x.norm().clamp(min=eps))


def _rate(lr: float | Tensor) -> float | Tensor:
    """A group's learning rate for ``batched_muon``: a number, or a tensor on the device as it
    is (a captured step's: ``float()`` would wait for the GPU and bake the value in)."""
    return lr if isinstance(lr, Tensor) and lr.device.type != "cpu" else float(lr)


NEWTON_SCHULZ = ("gram", "standard")  # train.newton_schulz


class BatchedMuon(torch.optim.Muon):
    """torch.optim.Muon whose step runs ``batched_muon``: the same settings and state (one
    momentum buffer per matrix), so its state dict loads into torch's Muon over the same
    matrices and back. ``newton_schulz``: "gram" for Gram Newton-Schulz where it takes fewer
    FLOPs, "standard" for torch's iteration only; ``batched``: the matrices of one shape
    stacked, or one at a time; ``ranks`` (``Ranks.of_this_host``): ranks holding the same
    gradients (DDP), each orthogonalising its share, so they must step together. Sharded
    (DTensor) parameters take torch's own step."""

    def __init__(self, params, *, newton_schulz: str = "standard", batched: bool = True,
                 ranks: Ranks | None = None, **settings) -> None:  # fmt: skip
        if newton_schulz not in NEWTON_SCHULZ:
            raise ValueError(f"newton_schulz must be one of {NEWTON_SCHULZ}, not {newton_schulz!r}")
        super().__init__(params, **settings)
        self.gram, self.batched, self.ranks = newton_schulz == "gram", batched, ranks

    def __getstate__(self):  # a copy or pickle keeps the settings (torch's keeps its own only)
        # but not the ranks (a process group does not pickle): a copy steps alone, which
        # gives the same update
        return {**super().__getstate__(), "gram": self.gram, "batched": self.batched}

    @torch.no_grad()
    def step(self, closure=None):
        from torch.distributed.tensor import DTensor

        if any(isinstance(p, DTensor) for g in self.param_groups for p in g["params"]):
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = []
        for group in self.param_groups:
            params: list[Tensor] = []
            grads: list[Tensor] = []
            bufs: list[Tensor] = []
            self._init_group(group, params, grads, bufs)
            groups.append((group, params, grads, bufs))
        ranks = getattr(self, "ranks", None)
        if ranks is not None and not getattr(self, "_ranks_checked", False):
            ranks.check_same_matrices([[tuple(p.shape) for p in g[1]] for g in groups])
            # once some matrix had a gradient (the ranks agree on that, having gathered)
            self._ranks_checked = any(g[1] for g in groups)
        for group, params, grads, bufs in groups:
            if params:
                batched_muon(
                    params, grads, bufs, lr=_rate(group["lr"]),
                    weight_decay=group["weight_decay"], momentum=group["momentum"],
                    nesterov=group["nesterov"], ns_coefficients=group["ns_coefficients"],
                    ns_steps=group["ns_steps"], eps=group["eps"],
                    adjust_lr_fn=group["adjust_lr_fn"], gram=self.gram, batched=self.batched,
                    ranks=ranks,
                )  # fmt: skip
        return loss


def _split(muon: torch.optim.Muon) -> tuple[list[dict], list[dict]]:
    """``muon``'s parameter groups split in two: matrices of at most BATCH_MAX_ELEMENTS
    elements, and larger ones (names and settings kept; empty groups left out)."""
    small, large = [], []
    for group in muon.param_groups:
        settings = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        names = group.get("param_names")
        for keep, into in ((True, small), (False, large)):
            idx = [i for i, p in enumerate(group["params"])
                   if (p.numel() <= BATCH_MAX_ELEMENTS) is keep]  # fmt: skip
            if idx:
                part = {**settings, "params": [group["params"][i] for i in idx]}
                if names is not None:
                    part["param_names"] = [names[i] for i in idx]
                into.append(part)
    return small, large


def gpu_optimizers(
    optimizers: list[torch.optim.Optimizer],
    newton_schulz: str = "standard",
    across_ranks: bool = False,
) -> list[torch.optim.Optimizer]:
    """speculators' optimisers for a GPU run: its Muon's small matrices in a BatchedMuon, its
    large ones, where the matmuls and not the launches take the time, with ``newton_schulz``
    "gram" in one that takes them one at a time by Gram Newton-Schulz where it needs fewer
    FLOPs, with "standard" left to torch's Muon (as built when all are large); the others as
    built. ``across_ranks`` (DDP, every rank calling this): where this host has several
    ranks, the BatchedMuons split their orthogonalisation over them (``Ranks.of_this_host``),
    and large matrices with "standard" go to one too (torch's iteration, one at a time), so
    they are split as well. A mixed draft gets one optimiser more
    than speculators builds, so its saved training state has another layout
    (``train._fingerprint`` tells the two apart); splitting over ranks changes no state."""
    muon = any(type(o) is torch.optim.Muon for o in optimizers)
    ranks = Ranks.of_this_host() if across_ranks and muon else None
    out: list[torch.optim.Optimizer] = []
    for o in optimizers:
        if type(o) is not torch.optim.Muon:
            out.append(o)
            continue
        if o.state:
            raise ValueError("convert Muon before its first step")
        small, large = _split(o)
        if small:
            out.append(BatchedMuon(small, ranks=ranks, **o.defaults))
        if large and (newton_schulz == "gram" or ranks is not None):
            out.append(BatchedMuon(large, newton_schulz=newton_schulz, batched=False,
                                   ranks=ranks, **o.defaults))  # fmt: skip
        elif large:
            out.append(torch.optim.Muon(large, **o.defaults) if small else o)
    return out
