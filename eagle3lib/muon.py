"""torch's Muon with its per-matrix work batched for small matrices: one launch per shape.

torch.optim.Muon (speculators' Muon) orthogonalises each weight matrix on its own: about 23
eager operations per matrix (momentum, cast, norm, 5 Newton-Schulz iterations of three
matmuls, weight decay, update). A small draft's step is bound by the host launching them
(three SmolLM2-sized layers: 22 matrices, about 500 launches a step). ``BatchedMuon`` stacks
the matrices of one shape (taken in the orientation torch orthogonalises them in, rows <=
columns) and runs the same iteration with batched matmuls; the momentum, weight decay and
update run as foreach operations. Every formula is torch's; the launch grouping differs, so
the update equals torch's up to the rounding of batched against single matmuls
(tests/test_muon.py states the tolerance), and the step holds all its matrices' updates at
once (stacked), not one matrix's at a time. ``gpu_optimizers`` gives it the matrices of at most
``BATCH_MAX_ELEMENTS`` elements and leaves larger ones, where the GPU's matmuls and not the
launches take the time, to torch's Muon as built."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.optim._muon import _adjust_lr

# Matrices up to this many elements go to BatchedMuon. On one H200 (BENCHMARKS.md) batching
# made the Muon step of a SmolLM2-shaped draft (matrices of at most 576 x 1728, about 1.0 M
# elements) 2.5 x faster and that of a Llama-8B-shaped one 5.6 % slower; the smallest matrix
# of an 8B-shaped draft of any depth (k and v of the layers after the first: 1024 x 4096,
# 4.2 M) is above this bound, so such drafts keep torch's Muon.
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


def _by_shape(updates: list[Tensor]) -> dict[tuple, list[int]]:
    """Indices of ``updates`` grouped by the shape torch orthogonalises them in (rows <=
    columns: a tall matrix is transposed), device and dtype."""
    groups: dict[tuple, list[int]] = {}
    for i, u in enumerate(updates):
        m, n = u.shape
        groups.setdefault((min(m, n), max(m, n), u.device, u.dtype), []).append(i)
    return groups


def _orthogonalised(updates: list[Tensor], coefficients, steps: int, eps: float):
    """Each update's orthogonalisation, in the input's orientation and dtype (bf16 to fp32
    is exact), the matrices of one shape batched."""
    out: list[Tensor | None] = [None] * len(updates)
    for (*_, dtype), indices in _by_shape(updates).items():
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
    by_alpha: dict[float, tuple[list[Tensor], list[Tensor]]] = {}
    for p, o in zip(params, ortho, strict=True):
        ps, us = by_alpha.setdefault(-_adjust_lr(lr, adjust_lr_fn, p.shape), ([], []))
        ps.append(p)
        us.append(o)
    for alpha, (ps, us) in by_alpha.items():
        torch._foreach_add_(ps, us, alpha=alpha)


class BatchedMuon(torch.optim.Muon):
    """torch.optim.Muon whose step runs ``batched_muon``: the same settings and state (one
    momentum buffer per matrix), so its state dict loads into torch's Muon over the same
    matrices and back. Sharded (DTensor) parameters take torch's own step."""

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


def gpu_optimizers(optimizers: list[torch.optim.Optimizer]) -> list[torch.optim.Optimizer]:
    """speculators' optimisers for a GPU run: its Muon's small matrices in a BatchedMuon, its
    large ones left to torch's Muon (as built when all are large), the others as built. A
    mixed draft gets one optimiser more than speculators builds, so its saved training state
    has another layout (``train._fingerprint`` tells the two apart)."""
    out: list[torch.optim.Optimizer] = []
    for o in optimizers:
        if type(o) is not torch.optim.Muon:
            out.append(o)
            continue
        if o.state:
            raise ValueError("convert Muon before its first step")
        small, large = _split(o)
        if small:
            out.append(BatchedMuon(small, **o.defaults))
        if large:
            out.append(torch.optim.Muon(large, **o.defaults) if small else o)
    return out
