"""torch's Muon with its per-matrix work batched for small matrices: one launch per shape.

torch.optim.Muon (speculators' Muon) orthogonalises each weight matrix on its own: about 23
eager operations per matrix (momentum, cast, norm, 5 Newton-Schulz iterations of three
matmuls, weight decay, update). A small draft's step is bound by the host launching them
(three SmolLM2-sized layers: 22 matrices, about 500 launches a step). ``BatchedMuon`` stacks
the small matrices of one shape (taken in the orientation torch orthogonalises them in, rows
<= columns) and runs the same iteration with batched matmuls; the momentum, weight decay and
update run as foreach operations. Large matrices (above ``BATCH_MAX_ELEMENTS``, where the
GPU's matmuls, not the launches, take the time) and shapes of one matrix go through torch's
own ``_zeropower_via_newtonschulz``. Every formula is torch's; only the launch grouping
differs, so the update equals torch's up to the rounding of batched against single matmuls
(tests/test_muon.py states the tolerance)."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

# Matrices up to this many elements are orthogonalised batched by shape. On one H200
# (BENCHMARKS.md) batching every shape made the Muon step of a Llama-8B-shaped draft (its
# smallest matrices 1024 x 8192) 5.6 % slower and that of a SmolLM2-shaped one (at most
# 576 x 1728) 2.5 x faster; this bound lies between the two.
BATCH_MAX_ELEMENTS = 1 << 22


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


def _by_shape(updates: list[Tensor]) -> dict[tuple, list[int]]:
    """Indices of ``updates`` grouped by the shape torch orthogonalises them in (rows <=
    columns: a tall matrix is transposed), device and dtype."""
    groups: dict[tuple, list[int]] = {}
    for i, u in enumerate(updates):
        m, n = u.shape
        groups.setdefault((min(m, n), max(m, n), u.device, u.dtype), []).append(i)
    return groups


def _orthogonalised(updates: list[Tensor], coefficients, steps: int, eps: float):
    """Each update's orthogonalisation, in the input's orientation: the small matrices of a
    shape batched (returned in the update's dtype: bf16 to fp32 is exact), the others by
    torch's own function (bf16)."""
    out: list[Tensor | None] = [None] * len(updates)
    for (m, n, _, dtype), indices in _by_shape(updates).items():
        if len(indices) == 1 or m * n > BATCH_MAX_ELEMENTS:
            for i in indices:
                out[i] = _zeropower_via_newtonschulz(updates[i], coefficients, steps, eps)
            continue
        tall = [updates[i].shape[0] > updates[i].shape[1] for i in indices]
        stacked = torch.stack(
            [updates[i].T if t else updates[i] for i, t in zip(indices, tall, strict=True)]
        )
        ortho = _newton_schulz(stacked.bfloat16(), coefficients, steps, eps).to(dtype)
        for i, t, o in zip(indices, tall, ortho.unbind(0), strict=True):
            out[i] = o.T if t else o
    return out


def batched_muon(params, grads, bufs, *, lr: float, weight_decay: float, momentum: float,
                 nesterov: bool, ns_coefficients, ns_steps: int, eps: float,
                 adjust_lr_fn) -> None:  # fmt: skip
    """One Muon step over ``params`` (torch's ``_single_tensor_muon``, batched by shape)."""
    torch._foreach_lerp_(bufs, grads, 1 - momentum)
    updates = torch._foreach_lerp(grads, bufs, momentum) if nesterov else bufs
    ortho = _orthogonalised(updates, ns_coefficients, ns_steps, eps)
    torch._foreach_mul_(params, 1 - lr * weight_decay)
    by_alpha: dict[tuple, tuple[list[Tensor], list[Tensor]]] = {}
    for p, o in zip(params, ortho, strict=True):
        alpha = -_adjust_lr(lr, adjust_lr_fn, p.shape)
        ps, us = by_alpha.setdefault((alpha, o.dtype), ([], []))
        ps.append(p)
        us.append(o)
    for (alpha, _), (ps, us) in by_alpha.items():
        torch._foreach_add_(ps, us, alpha=alpha)


class BatchedMuon(torch.optim.Muon):
    """torch.optim.Muon whose step runs ``batched_muon``: the same settings, state (one
    momentum buffer per matrix) and checkpoints. Sharded (DTensor) parameters take torch's
    own step."""

    @torch.no_grad()
    def step(self, closure=None):
        from torch.distributed.tensor import DTensor

        if any(isinstance(p, DTensor) for g in self.param_groups for p in g["params"]):
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params: list[Tensor] = []
            grads: list[Tensor] = []
            bufs: list[Tensor] = []
            self._init_group(group, params, grads, bufs)
            if params:
                batched_muon(
                    params, grads, bufs, lr=float(group["lr"]),
                    weight_decay=group["weight_decay"], momentum=group["momentum"],
                    nesterov=group["nesterov"], ns_coefficients=group["ns_coefficients"],
                    ns_steps=group["ns_steps"], eps=group["eps"],
                    adjust_lr_fn=group["adjust_lr_fn"],
                )  # fmt: skip
        return loss


def like(cls, muon: torch.optim.Muon) -> torch.optim.Muon:
    """A ``cls`` (a Muon subclass) with the parameter groups and settings of a freshly built
    ``muon`` (no state yet)."""
    if muon.state:
        raise ValueError("convert Muon before its first step")
    return cls([dict(group) for group in muon.param_groups], **muon.defaults)


def gpu_optimizers(optimizers: list[torch.optim.Optimizer]) -> list[torch.optim.Optimizer]:
    """speculators' optimisers for a GPU run: its Muon batched by shape, the others as built."""
    return [like(BatchedMuon, o) if type(o) is torch.optim.Muon else o for o in optimizers]
