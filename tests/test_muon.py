"""BatchedMuon: torch's Muon update, batched by matrix shape."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from eagle3lib import muon, speculators_compat
from eagle3lib.muon import BatchedMuon

# A small three-layer draft's matrix shapes in miniature: wide, tall (transposed before the
# iteration, sharing a group with the wide ones of the same oriented shape), and repeats.
SHAPES = [(16, 48), (48, 16), (16, 48), (24, 24), (24, 24), (8, 24), (24, 8), (16, 32)]
GROUPS = 4  # oriented shapes: 16x48, 24x24, 8x24, 16x32


def steps(cls, *, nesterov=True, adjust_lr_fn=None, n=4, ns_steps=5):
    """Each step's update of every matrix, and the final momentum buffers, for ``n`` steps of
    ``cls`` from the same weights and gradients."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    opt = cls(params, lr=0.02, weight_decay=0.1, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn,
              ns_steps=ns_steps)  # fmt: skip
    updates = []
    for _ in range(n):
        before = [p.detach().clone() for p in params]
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
        updates.append([p.detach() - b for p, b in zip(params, before, strict=True)])
    return updates, [opt.state[p]["momentum_buffer"] for p in params]


@pytest.mark.parametrize("nesterov", [True, False], ids=["nesterov", "plain"])
@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"], ids=str)
def test_batched_update_equals_torchs_muon_within_bf16_rounding(nesterov, adjust_lr_fn):
    """Stated tolerance: every step's update of every matrix within 1 % (relative Frobenius
    norm) of torch's; the momentum buffers (fp32, no matmul) are equal."""
    ours, our_bufs = steps(BatchedMuon, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    torchs, torch_bufs = steps(torch.optim.Muon, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    for mine, theirs in zip(our_bufs, torch_bufs, strict=True):
        assert torch.equal(mine, theirs)
    for step_ours, step_torch in zip(ours, torchs, strict=True):
        for shape, mine, theirs in zip(SHAPES, step_ours, step_torch, strict=True):
            assert mine.shape == shape and mine.dtype == torch.float32
            assert (mine - theirs).norm() / theirs.norm() < 0.01, shape


def test_a_wrong_update_is_outside_the_tolerance():
    """The tolerance separates: BatchedMuon with a setting changed (the lr scale, one
    Newton-Schulz step fewer) differs from torch's Muon by far more than 1 %."""
    torchs, _ = steps(torch.optim.Muon)
    other, _ = steps(BatchedMuon, adjust_lr_fn="match_rms_adamw")
    fewer, _ = steps(BatchedMuon, ns_steps=4)
    for changed in (other, fewer):
        worst = max(
            ((a - b).norm() / b.norm()).item()
            for sa, sb in zip(changed, torchs, strict=True)
            for a, b in zip(sa, sb, strict=True)
        )
        assert worst > 0.05


def test_state_moves_between_batched_and_torchs_muon():
    """A state dict saved by BatchedMuon loads into torch's Muon over the same matrices (and
    back): the run continues as if uninterrupted, within the same tolerance."""
    gen = torch.Generator().manual_seed(1)
    weights = [torch.randn(s, generator=gen) for s in SHAPES]
    grads = [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(4)]

    def run(classes):
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        saved = None
        for k, cls in enumerate(classes):
            opt = cls(params, lr=0.02, weight_decay=0.1)
            if saved is not None:
                opt.load_state_dict(saved)
            for p, g in zip(params, grads[k], strict=True):
                p.grad = g
            opt.step()
            saved = opt.state_dict()
        return params

    through = run([BatchedMuon, torch.optim.Muon, BatchedMuon, torch.optim.Muon])
    straight = run([torch.optim.Muon] * 4)
    for a, b in zip(through, straight, strict=True):
        assert ((a - b).norm() / b.norm()).item() < 0.01


class MatmulCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def matmuls(cls) -> int:
    """The matmul launches of one step of ``cls`` over SHAPES."""
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    opt = cls(params, lr=0.02)
    for p in params:
        p.grad = torch.randn(p.shape)
    with MatmulCount() as seen:
        opt.step()
    return sum(seen.counts.get(k, 0) for k in ("mm", "addmm", "bmm", "baddbmm"))


def test_one_set_of_matmuls_per_matrix_shape():
    """Batched: 3 matmuls per Newton-Schulz iteration for each oriented shape; torch's Muon
    does them for each matrix."""
    assert matmuls(BatchedMuon) == 3 * 5 * GROUPS
    assert matmuls(torch.optim.Muon) == 3 * 5 * len(SHAPES)


def built(model):
    """speculators' Muon over ``model``'s 2-D weights (named), and an AdamW for the rest."""
    muon_params = [(n, p) for n, p in model.named_parameters() if p.ndim == 2]
    torch_muon = torch.optim.Muon(muon_params, lr=0.01, ns_steps=4)
    return torch_muon, torch.optim.AdamW([p for p in model.parameters() if p.ndim == 1])


def test_gpu_optimizers_batch_small_matrices_and_keep_torchs_settings():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 4))
    torch_muon, adamw = built(model)
    out = muon.gpu_optimizers([torch_muon, adamw])
    assert [type(o) for o in out] == [BatchedMuon, torch.optim.AdamW] and out[1] is adamw
    assert out[0].state_dict() == torch_muon.state_dict()  # same groups, names and settings
    before = model[0].weight.detach().clone()
    model[0].weight.grad = torch.randn(8, 8)
    out[0].step()
    assert not torch.equal(model[0].weight, before)  # it optimises speculators' parameters
    with pytest.raises(ValueError, match="before its first step"):
        muon.gpu_optimizers([_stepped_muon()])


def _stepped_muon():
    p = torch.nn.Parameter(torch.randn(4, 4))
    opt = torch.optim.Muon([p], lr=0.01)
    p.grad = torch.randn(4, 4)
    opt.step()
    return opt


def test_gpu_optimizers_leave_large_matrices_to_torchs_muon(monkeypatch):
    """Above BATCH_MAX_ELEMENTS a matrix stays with torch's Muon: all large, the very object
    speculators built; mixed, a BatchedMuon and a torch Muon sharing the matrices, names and
    settings between them."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 4))
    torch_muon, adamw = built(model)
    monkeypatch.setattr(muon, "BATCH_MAX_ELEMENTS", 0)
    assert muon.gpu_optimizers([torch_muon, adamw])[0] is torch_muon
    monkeypatch.setattr(muon, "BATCH_MAX_ELEMENTS", 32)  # the 8 x 4 weight, 32: small
    small, large, rest = muon.gpu_optimizers([torch_muon, adamw])
    assert type(small) is BatchedMuon and type(large) is torch.optim.Muon and rest is adamw
    assert small.param_groups[0]["param_names"] == ["2.weight"]
    assert large.param_groups[0]["param_names"] == ["0.weight"]
    assert small.param_groups[0]["params"][0] is model[2].weight
    assert large.param_groups[0]["params"][0] is model[0].weight
    assert small.defaults == large.defaults == torch_muon.defaults
    assert large.param_groups[0]["ns_steps"] == 4


def test_the_patch_swaps_speculators_muon_while_applied():
    """The ``batched_muon`` entry (StreamingTrainer.setup_optimizer applies it on a GPU):
    speculators' build_optimizers then returns BatchedMuon, and torch's Muon again after."""
    from speculators.train import trainer

    class Config:
        optimizer, lr, weight_decay = "muon", 0.01, 0.0
        muon_lr, muon_momentum, muon_weight_decay, muon_ns_steps = 0.01, 0.95, 0.1, 5
        muon_adjust_lr_fn = None

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    with speculators_compat.speculators_patches("batched_muon"):
        inside = trainer.build_optimizers(model, Config())
    outside = trainer.build_optimizers(model, Config())
    assert [type(o).__name__ for o in inside] == ["BatchedMuon", "AdamW"]
    assert [type(o).__name__ for o in outside] == ["Muon", "AdamW"]


def test_an_8b_shaped_draft_of_any_depth_keeps_torchs_muon():
    """The bound lies between a SmolLM2-shaped draft's largest matrix (576 x 1728) and an
    8B-shaped one's smallest (k and v after the first layer: 1024 x 4096)."""
    assert 576 * 1728 <= muon.BATCH_MAX_ELEMENTS < 1024 * 4096


def test_the_muon_layout_enters_the_resume_fingerprint(monkeypatch):
    """A state folder saved with speculators' Muon is not resumed by a run that splits it (nor
    the reverse): the fingerprints differ, so the run starts afresh instead of failing to load
    the other layout. On a CPU, or with AdamW, the fingerprint is as before."""
    from types import SimpleNamespace

    from eagle3lib import train
    from eagle3lib.streaming_trainer import StreamingTrainer

    cfg = SimpleNamespace(optimizer="muon")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert train.muon_layout(cfg, StreamingTrainer) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert train.muon_layout(cfg, StreamingTrainer) == "batched up to 2097152 elements"
    assert train.muon_layout(SimpleNamespace(optimizer="adamw"), StreamingTrainer) is None
    from speculators.train.trainer import Trainer

    assert train.muon_layout(cfg, Trainer) is None  # speculators' own trainer: as built
    parts = (
        SimpleNamespace(optimizer="muon", packing="multipack", lr=0.01),
        [{"file": {"sha256": "ab"}}],
        {"d2t": torch.tensor([0, 1])},
        {"attention": "flex", "loss": "eager"},
    )
    plain = train._fingerprint(*parts)
    split = train._fingerprint(*parts, "batched up to 2097152 elements")
    assert plain["runtime"] == {"attention": "flex", "loss": "eager"}  # as before the split
    assert split["runtime"]["muon"] == "batched up to 2097152 elements" and split != plain
