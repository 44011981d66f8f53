"""BatchedMuon's contract where tests/test_muon.py and tests/test_muon_settings.py leave it
open: bf16 momentum buffers with nesterov, parameter groups with settings of their own through
``gpu_optimizers``, sharded (DTensor) parameters, and stacks of one shape but different dtypes
(each compared with torch.optim.Muon or with the matrix stepped alone, on the CPU, with tiny
matrices)."""

import pytest
import torch
from test_muon import ALL_SETTINGS  # BatchedMuon's four paths

from eagle3lib import muon
from eagle3lib.muon import BatchedMuon

# wide, tall (sharing a stack with the wide one), square, and a Gram-wide 32 x 96
SHAPES = [(16, 48), (48, 16), (24, 24), (8, 24), (32, 96)]


def stepped(cls, dtype=torch.float32, n=3, **settings):
    """The parameters and momentum buffers after ``n`` steps of ``cls`` over SHAPES from
    seeded weights and gradients in ``dtype``."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]
    opt = cls(params, lr=0.02, weight_decay=0.1, **settings)
    for _ in range(n):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(dtype)
        opt.step()
    return params, [opt.state[p]["momentum_buffer"] for p in params]


@ALL_SETTINGS
def test_bf16_momentum_buffers_with_nesterov_are_left_as_torchs(settings):
    """With nesterov the orthogonalised input is a new tensor (the gradient lerped towards the
    buffer), so torch's Muon leaves a bf16 momentum buffer as the lerp made it, not divided by
    its norm: every path's buffers equal torch's to the bit over 3 steps."""
    _, ours = stepped(BatchedMuon, torch.bfloat16, nesterov=True, **settings)
    _, theirs = stepped(torch.optim.Muon, torch.bfloat16, nesterov=True)
    for shape, mine, torchs in zip(SHAPES, ours, theirs, strict=True):
        assert mine.dtype == torch.bfloat16 and torch.equal(mine, torchs), shape


@pytest.mark.parametrize("newton_schulz", ["standard", "gram"])
def test_gpu_optimizers_keep_each_groups_own_settings(monkeypatch, newton_schulz):
    """speculators may build its Muon with parameter groups whose settings differ from the
    defaults: split into small and large matrices, every group keeps its own lr, momentum,
    weight decay, nesterov and Newton-Schulz settings, not the optimiser's defaults."""
    first = [torch.nn.Parameter(torch.randn(s)) for s in [(8, 8), (4, 8)]]
    second = [torch.nn.Parameter(torch.randn(s)) for s in [(2, 4), (6, 8)]]
    own = {"lr": 0.05, "momentum": 0.8, "weight_decay": 0.3, "nesterov": False, "ns_steps": 3,
           "adjust_lr_fn": "match_rms_adamw"}  # fmt: skip
    torch_muon = torch.optim.Muon([{"params": first}, {"params": second, **own}], lr=0.01)
    want = [{k: v for k, v in g.items() if k != "params"} for g in torch_muon.param_groups]
    monkeypatch.setattr(muon, "BATCH_MAX_ELEMENTS", 32)  # 4 x 8 and 2 x 4 small
    out = muon.gpu_optimizers([torch_muon], newton_schulz)
    got = [
        ([tuple(p.shape) for p in g["params"]], {k: v for k, v in g.items() if k != "params"})
        for o in out
        for g in o.param_groups
    ]
    large = BatchedMuon if newton_schulz == "gram" else torch.optim.Muon
    assert [type(o) for o in out] == [BatchedMuon, large]
    assert got == [([(4, 8)], want[0]), ([(2, 4)], want[1]), ([(8, 8)], want[0]),
                   ([(6, 8)], want[1])]  # fmt: skip


def test_sharded_parameters_take_torchs_own_step(monkeypatch):
    """FSDP's sharded (DTensor) parameters take torch.optim.Muon's step (here every parameter
    stands for one): BatchedMuon's own step does not run, and a Gram, batched BatchedMuon
    (whose update would differ from torch's) ends with torch's parameters and buffers to the
    bit."""
    import torch.distributed.tensor

    monkeypatch.setattr(torch.distributed.tensor, "DTensor", torch.nn.Parameter)

    def refused(*args, **kwargs):
        raise AssertionError("BatchedMuon's own step ran for sharded parameters")

    monkeypatch.setattr(muon, "batched_muon", refused)
    ours = stepped(BatchedMuon, newton_schulz="gram")
    theirs = stepped(torch.optim.Muon)
    for mine, torchs in zip(ours[0] + ours[1], theirs[0] + theirs[1], strict=True):
        assert torch.equal(mine, torchs)


def test_matrices_of_one_shape_stack_only_with_their_dtype_and_device():
    """A stack holds matrices of one oriented shape, dtype and device (a tall matrix joins the
    wide ones of its dtype): one dtype's update is not rounded to another's, and no stack
    spans devices."""
    like = [torch.empty(16, 48), torch.empty(16, 48, dtype=torch.bfloat16), torch.empty(48, 16),
            torch.empty(16, 48, device="meta"), torch.empty(48, 16, dtype=torch.bfloat16)]  # fmt: skip
    units = muon._units(like, 5, gram=False, batched=True)
    assert sorted(units) == [([0, 2], "stacked"), ([1, 4], "stacked"), ([3], "stacked")]


@pytest.mark.parametrize("newton_schulz", ["standard", "gram"])
def test_a_matrixs_update_does_not_depend_on_the_dtypes_sharing_its_shape(newton_schulz):
    """A bf16 and an fp32 parameter of one shape in one group each end as they do stepped
    alone, to the bit: the fp32 one's update (by Gram Newton-Schulz: fp16 times GRAM_SCALE,
    unscaled exactly) is not rounded to bf16 on the way."""

    def run(dtypes: dict[int, torch.dtype]) -> list[torch.Tensor]:
        """One step over the matrices ``dtypes`` names (index: dtype) of two seeded ones."""
        gen = torch.Generator().manual_seed(0)
        weights = [torch.randn(32, 96, generator=gen) for _ in range(2)]
        grads = [torch.randn(32, 96, generator=gen) for _ in range(2)]
        params = [torch.nn.Parameter(weights[i].to(dt)) for i, dt in dtypes.items()]
        opt = BatchedMuon(params, lr=0.02, weight_decay=0.1, newton_schulz=newton_schulz)
        for p, i in zip(params, dtypes, strict=True):
            p.grad = grads[i].to(p.dtype)
        opt.step()
        return params

    together = run({0: torch.bfloat16, 1: torch.float32})
    alone = run({0: torch.bfloat16}) + run({1: torch.float32})
    for mine, single in zip(together, alone, strict=True):
        assert mine.dtype == single.dtype and torch.equal(mine, single)
