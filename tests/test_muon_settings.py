"""BatchedMuon: settings, corner cases and the host grouping that tests/test_muon.py leaves
at their defaults (each compared with torch.optim.Muon, on the CPU, with tiny matrices)."""

import pytest
import torch
from test_muon import ALL_SETTINGS  # BatchedMuon's four paths

from eagle3lib import muon
from eagle3lib.muon import BatchedMuon

# wide, tall (sharing a stack with the wide one), square, and a Gram-wide 32 x 96
SHAPES = [(16, 48), (48, 16), (24, 24), (8, 24), (32, 96)]


def stepped(cls, groups, *, n=2, dtype=torch.float32, zero=False, **settings):
    """Each step's update of every matrix and the final momentum buffers, for ``n`` steps of
    ``cls`` over SHAPES (split into parameter groups as ``groups`` says: a list of the option
    dicts of consecutive pairs of matrices, the last taking the rest) from seeded weights and
    gradients (``zero``: gradients of zeros)."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]
    param_groups = [{"params": params[2 * k : 2 * k + 2], **g} for k, g in enumerate(groups)]
    param_groups[-1]["params"] = params[2 * (len(groups) - 1) :]
    opt = cls(param_groups, **settings)
    updates = []
    for _ in range(n):
        before = [p.detach().clone() for p in params]
        for p in params:
            grad = torch.zeros(p.shape) if zero else torch.randn(p.shape, generator=gen)
            p.grad = grad.to(dtype)
        opt.step()
        updates.append([p.detach() - b for p, b in zip(params, before, strict=True)])
    return updates, [opt.state[p]["momentum_buffer"] for p in params]


def worst(ours, theirs) -> float:
    """The largest relative Frobenius distance of any step's update of any matrix."""
    return max(
        ((a - b).norm() / b.norm()).item()
        for sa, sb in zip(ours, theirs, strict=True)
        for a, b in zip(sa, sb, strict=True)
    )


@ALL_SETTINGS
def test_every_groups_own_settings_reach_the_step(settings):
    """Momentum, weight decay, Newton-Schulz coefficients, lr and nesterov away from torch's
    defaults, different in each parameter group: every path's updates within 1 % of torch's
    Muon (the same settings changed by as little as momentum 0.8 -> 0.95 give 5 %), and the
    momentum buffers (no matmul) equal."""
    base = {"lr": 0.03, "momentum": 0.8, "weight_decay": 0.4,
            "ns_coefficients": (1.875, -1.25, 0.375)}  # fmt: skip
    groups = [{}, {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.0, "nesterov": False}]
    ours, our_bufs = stepped(BatchedMuon, groups, **base, **settings)
    theirs, their_bufs = stepped(torch.optim.Muon, groups, **base)
    assert worst(ours, theirs) < 0.01
    for shape, mine, torchs in zip(SHAPES, our_bufs, their_bufs, strict=True):
        assert torch.equal(mine, torchs), shape


@ALL_SETTINGS
def test_eps_bounds_the_norm_each_matrix_is_divided_by(settings):
    """torch divides each matrix by its Frobenius norm held above ``eps``: with eps (40)
    above the gradients' norms (about 28) every path's update is torch's within 3 % (the Gram
    form's distance from torch's bf16 iteration over these shapes is under 2 %), and 17 %
    from the update with torch's default eps."""
    ours, _ = stepped(BatchedMuon, [{}], lr=0.02, eps=40.0, **settings)
    theirs, _ = stepped(torch.optim.Muon, [{}], lr=0.02, eps=40.0)
    default_eps, _ = stepped(torch.optim.Muon, [{}], lr=0.02)
    assert worst(ours, theirs) < 0.03
    assert worst(default_eps, theirs) > 0.1


@ALL_SETTINGS
def test_bf16_momentum_buffers_of_zero_gradients_stay_zero(settings):
    """Without nesterov a bf16 momentum buffer is divided by its norm held above eps, as
    torch's Newton-Schulz does to it in place: a buffer of zeros (a layer without signal)
    stays zeros as in torch's Muon, not NaN, and so do the updates apart from weight decay."""
    ours, bufs = stepped(BatchedMuon, [{}], dtype=torch.bfloat16, zero=True, lr=0.02,
                         weight_decay=0.0, nesterov=False, **settings)  # fmt: skip
    for buf in bufs:
        assert buf.dtype == torch.bfloat16 and torch.isfinite(buf).all() and not buf.any()
    assert not any(update.any() for step in ours for update in step)


@pytest.mark.parametrize("settings", [{}, {"newton_schulz": "gram"}], ids=["stacked", "gram"])
def test_bf16_parameters_take_torchs_weight_decay_when_batched(settings):
    """Weight decay alone (zero gradients, so no update), bf16 parameters: the stacked paths
    leave every parameter with torch's Muon's bits, as the one-at-a-time paths do."""
    ours, _ = stepped(BatchedMuon, [{}], dtype=torch.bfloat16, zero=True, lr=0.02,
                      nesterov=False, **settings)  # fmt: skip
    theirs, _ = stepped(torch.optim.Muon, [{}], dtype=torch.bfloat16, zero=True, lr=0.02,
                        nesterov=False)  # fmt: skip
    for step_ours, step_torch in zip(ours, theirs, strict=True):
        for shape, mine, torchs in zip(SHAPES, step_ours, step_torch, strict=True):
            assert torch.equal(mine, torchs), shape


@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"], ids=str)
def test_bf16_parameters_take_the_gram_update_rounded_to_bf16(adjust_lr_fn):
    """As torch's Muon adds its bf16 update to a bf16 parameter, the Gram form's update (one
    matrix at a time, wide and tall) is rounded to bf16 before it is added: every parameter
    ends as p - lr' bf16(o), to the bit (not with the fp16 or fp32 update added as it is)."""
    gen = torch.Generator().manual_seed(6)
    shapes = [(32, 128), (128, 32)]
    weights = [torch.randn(s, generator=gen).bfloat16() for s in shapes]
    grads = [torch.randn(s, generator=gen).bfloat16() for s in shapes]
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = BatchedMuon(params, lr=0.02, weight_decay=0.0, nesterov=False, adjust_lr_fn=adjust_lr_fn,
                      newton_schulz="gram", batched=False)  # fmt: skip
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    opt.step()
    for w, g, p in zip(weights, grads, params, strict=True):
        buf = torch.zeros_like(g).lerp_(g, 1 - 0.95)
        oriented = buf.T if buf.shape[0] > buf.shape[1] else buf
        result = muon._gram_newton_schulz(oriented[None], (3.4445, -4.7750, 2.0315), 5, 1e-7)
        o = (result[0].float() / muon.GRAM_SCALE).bfloat16()
        o = o.T if buf.shape[0] > buf.shape[1] else o
        lr = muon._adjust_lr(0.02, adjust_lr_fn, w.shape)
        assert torch.equal(p.detach(), w.clone().add_(o, alpha=-lr)), w.shape


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64], ids=str)
def test_gram_newton_schulz_normalises_in_fp32_whatever_the_input_dtype(dtype):
    """The Gram form divides each matrix by its Frobenius norm taken in fp32: a bf16 (a bf16
    parameter's momentum buffer) or fp64 stack gives the bits of its fp32 copy."""
    gen = torch.Generator().manual_seed(0)
    stack = torch.randn(2, 16, 48, generator=gen).to(dtype)
    coefficients = (3.4445, -4.7750, 2.0315)
    ours = muon._gram_newton_schulz(stack, coefficients, 5, 1e-7)
    assert torch.equal(ours, muon._gram_newton_schulz(stack.float(), coefficients, 5, 1e-7))


@ALL_SETTINGS
def test_step_evaluates_the_closure_with_gradients_and_returns_its_loss(settings):
    """As torch's Muon: ``step(closure)`` runs the closure with autograd on (step itself runs
    without), steps on the gradients it leaves and returns its loss."""
    weight = torch.nn.Parameter(torch.ones(4, 8))
    opt = BatchedMuon([weight], lr=0.02, **settings)

    def closure():
        opt.zero_grad()
        loss = (weight**2).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert loss.item() == 32.0
    assert weight.grad is not None and not torch.equal(weight, torch.ones(4, 8))


def test_the_ranks_are_checked_once_over_steps_with_gradients(monkeypatch):
    """The check that DDP's ranks step the same matrices (one gather over the host) runs at
    the first step with gradients only, not at every step."""

    class Ranks:
        def __init__(self):
            self.checked = []

        def check_same_matrices(self, shapes):
            self.checked.append(shapes)

    stepped_with = []
    monkeypatch.setattr(muon, "batched_muon", lambda *args, **kw: stepped_with.append(kw))
    ranks = Ranks()
    weight = torch.nn.Parameter(torch.ones(4, 8))
    opt = BatchedMuon([weight], lr=0.02, ranks=ranks)
    for _ in range(3):
        weight.grad = torch.ones(4, 8)
        opt.step()
    assert ranks.checked == [[[(4, 8)]]]
    assert len(stepped_with) == 3 and all(kw["ranks"] is ranks for kw in stepped_with)


def of_this_host(monkeypatch, hosts: list[str], group_ranks: list[str]) -> list:
    """What ``Ranks.of_this_host`` gives each rank of a default group whose ranks run on the
    machines ``hosts`` with torchrun's GROUP_RANK ``group_ranks`` (a stand-in for
    torch.distributed: each rank's gathered object is the one it passes in), and the groups
    made (a rank's group: the index of the group made for it)."""
    import socket

    import torch.distributed as dist

    world = len(hosts)
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: world)
    passed: dict[int, object] = {}

    def run_as(rank: int, gather):
        monkeypatch.setattr(dist, "get_rank", lambda: rank)
        monkeypatch.setattr(socket, "gethostname", lambda: hosts[rank])
        monkeypatch.setenv("GROUP_RANK", group_ranks[rank])
        monkeypatch.setattr(dist, "all_gather_object", gather)
        return muon.Ranks.of_this_host()

    class Gathered(Exception):
        pass

    def record(rank):
        def gather(out, obj, group=None):
            passed[rank] = obj
            raise Gathered

        return gather

    for rank in range(world):  # first what each rank passes to the gather
        with pytest.raises(Gathered):
            run_as(rank, record(rank))

    made: list[list[int]] = []
    monkeypatch.setattr(dist, "new_group", lambda ranks: made.append(list(ranks)) or len(made) - 1)

    def gather(out, obj, group=None):
        out[:] = [passed[r] for r in range(world)]

    result = []
    for rank in range(world):
        made.clear()
        result.append(run_as(rank, gather))
    return result, made


def test_a_host_is_a_machine_and_torchruns_node_on_it(monkeypatch):
    """Two torchrun nodes on one machine are two hosts (GROUP_RANK tells them apart): each
    rank gets its own node's ranks and the group made for them; every rank makes every
    group, in the same order."""
    got, made = of_this_host(monkeypatch, ["m"] * 4, ["0", "0", "1", "1"])
    assert got == [muon.Ranks(0, (0, 1)), muon.Ranks(1, (0, 1)),
                   muon.Ranks(0, (2, 3)), muon.Ranks(1, (2, 3))]  # fmt: skip
    assert made == [[0, 1], [2, 3]]
    assert [r.group for r in got] == [0, 0, 1, 1]


def test_one_host_splits_in_the_default_group_and_a_lone_rank_not_at_all(monkeypatch):
    """Where the default group is one host's, its ranks share the work in it (no group is
    made); a rank alone on its machine splits nothing."""
    got, made = of_this_host(monkeypatch, ["a", "a"], ["", ""])
    assert got == [muon.Ranks(0, (0, 1)), muon.Ranks(1, (0, 1))] and made == []
    assert all(r.group is None for r in got)
    got, made = of_this_host(monkeypatch, ["a", "b", "a"], ["", "", ""])
    assert got == [muon.Ranks(0, (0, 2)), None, muon.Ranks(1, (0, 2))]


def test_without_muon_no_ranks_are_gathered(monkeypatch):
    """``across_ranks`` looks for the host's ranks (a gather over every rank) only where there
    is a Muon to split: other optimisers come back as built, with no collective."""

    def gather():
        raise AssertionError("gathered the ranks without a Muon")

    monkeypatch.setattr(muon.Ranks, "of_this_host", classmethod(lambda cls: gather()))
    adamw = torch.optim.AdamW([torch.nn.Parameter(torch.ones(4))])
    assert muon.gpu_optimizers([adamw], "gram", across_ranks=True) == [adamw]
