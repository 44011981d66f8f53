"""BatchedMuon: torch's Muon update, batched by matrix shape; its wide matrices by Gram
Newton-Schulz (train.newton_schulz: gram)."""

import functools

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from eagle3lib import muon, speculators_compat
from eagle3lib.muon import BatchedMuon
from eagle3lib.precision import Fp32Muon

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


def test_the_patch_swaps_speculators_muon_while_applied(monkeypatch):
    """The ``batched_muon`` entry (StreamingTrainer.setup_optimizer applies it on a GPU):
    speculators' build_optimizers then returns BatchedMuon (Gram Newton-Schulz as the
    context's newton_schulz says), and torch's Muon again after."""
    from speculators.train import trainer

    class Config:
        optimizer, lr, weight_decay = "muon", 0.01, 0.0
        muon_lr, muon_momentum, muon_weight_decay, muon_ns_steps = 0.01, 0.95, 0.1, 5
        muon_adjust_lr_fn = None

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    monkeypatch.setattr(muon, "BATCH_MAX_ELEMENTS", 0)  # the 8 x 8 weight is large
    pair = muon.Ranks(0, (0, 1))  # as if in a group of two ranks on this host
    monkeypatch.setattr(muon.Ranks, "of_this_host", classmethod(lambda cls: pair))
    with speculators_compat.speculators_patches(
        "batched_muon", newton_schulz="gram", across_ranks=True
    ):
        inside = trainer.build_optimizers(model, Config())
    with speculators_compat.speculators_patches(
        "batched_muon", newton_schulz="gram", across_ranks=False
    ):
        alone = trainer.build_optimizers(model, Config())
    outside = trainer.build_optimizers(model, Config())
    assert [type(o).__name__ for o in inside] == ["BatchedMuon", "AdamW"] and inside[0].gram
    assert inside[0].ranks is pair and alone[0].ranks is None  # split as the context asks
    assert [type(o).__name__ for o in outside] == ["Muon", "AdamW"]


def test_an_8b_shaped_draft_of_any_depth_has_only_large_matrices():
    """The bound lies between a SmolLM2-shaped draft's largest matrix (576 x 1728) and an
    8B-shaped one's smallest (k and v after the first layer: 1024 x 4096): the one batched
    by torch's iteration, the other taken one at a time (by Gram Newton-Schulz where wide)."""
    assert 576 * 1728 <= muon.BATCH_MAX_ELEMENTS < 1024 * 4096


def test_the_muon_layout_enters_the_resume_fingerprint(monkeypatch):
    """A state folder saved with speculators' Muon is not resumed by a run that splits it (nor
    the reverse): the fingerprints differ, so the run starts afresh instead of failing to load
    the other layout. On a CPU, or with AdamW, the fingerprint is as before."""
    from types import SimpleNamespace

    from eagle3lib import train
    from eagle3lib.streaming_trainer import StreamingTrainer

    cfg = SimpleNamespace(optimizer="muon", newton_schulz="standard")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert train.muon_layout(cfg, StreamingTrainer) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert train.muon_layout(cfg, StreamingTrainer) == "batched up to 2097152 elements"
    gram = SimpleNamespace(optimizer="muon", newton_schulz="gram")
    assert train.muon_layout(gram, StreamingTrainer) == (
        "batched up to 2097152 elements, large wide ones by Gram Newton-Schulz"
    )
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


def test_the_newton_schulz_setting_leaves_the_trained_fingerprint_to_the_layout():
    """train.newton_schulz changes the update only where the layout says so (a GPU): the
    train section's fingerprint is the same for both settings, and as before the key."""
    from types import SimpleNamespace

    from eagle3lib import train

    def fingerprint(**extra):
        cfg = SimpleNamespace(optimizer="muon", packing="ffd", lr=0.01, **extra)
        parts = ([{"file": {"sha256": "ab"}}], {"d2t": torch.tensor([0, 1])},
                 {"attention": "flex", "loss": "eager"})  # fmt: skip
        return train._fingerprint(cfg, *parts)

    assert fingerprint(newton_schulz="gram") == fingerprint(newton_schulz="standard")
    assert fingerprint(newton_schulz="gram") == fingerprint()


def test_the_train_job_trainer_takes_the_configured_newton_schulz():
    """train.train builds its trainer with train.newton_schulz (the optimisers are built in
    the trainer's constructor, so the setting is on the class); speculators' Trainer as is."""
    from speculators.train.trainer import Trainer

    from eagle3lib import train
    from eagle3lib.streaming_trainer import StreamingTrainer

    assert StreamingTrainer.newton_schulz == "gram"
    assert train.with_newton_schulz(StreamingTrainer, "gram") is StreamingTrainer
    standard = train.with_newton_schulz(StreamingTrainer, "standard")
    assert issubclass(standard, StreamingTrainer) and standard.newton_schulz == "standard"
    assert StreamingTrainer.newton_schulz == "gram"
    assert train.with_newton_schulz(Trainer, "standard") is Trainer


@pytest.mark.parametrize(
    ("distributed", "fsdp", "on", "split"),
    [(True, False, True, True), (False, False, True, False), (True, True, True, False),
     (True, False, False, False)],
    ids=["ddp", "one_process", "fsdp", "switched_off"],
)  # fmt: skip
def test_the_train_job_splits_muon_over_ddp_ranks_only(monkeypatch, distributed, fsdp, on, split):
    """StreamingTrainer.setup_optimizer on a GPU asks the batched_muon entry to split Muon
    over the ranks under DDP (muon_across_ranks), not in one process and not under FSDP (its
    sharded matrices take torch's step)."""
    import contextlib
    from types import SimpleNamespace

    from speculators.train.trainer import Trainer

    from eagle3lib import streaming_trainer

    asked = {}

    @contextlib.contextmanager
    def patches(*names, **context):
        asked.update(names=names, **context)
        yield

    monkeypatch.setattr(streaming_trainer, "speculators_patches", patches)
    # speculators' setup_optimizer builds self.optimizers (none here)
    monkeypatch.setattr(Trainer, "setup_optimizer", lambda self: setattr(self, "optimizers", []))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    trainer = streaming_trainer.StreamingTrainer.__new__(streaming_trainer.StreamingTrainer)
    trainer.config = SimpleNamespace(optimizer="muon", fsdp_shard=fsdp)
    trainer.is_distributed, trainer.muon_across_ranks = distributed, on
    trainer.setup_optimizer()
    assert asked == {"names": ("batched_muon",), "newton_schulz": "gram", "across_ranks": split}


# Gram Newton-Schulz. The exact iteration: torch's formulas in fp64.
COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def exact(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    return muon.exact_newton_schulz(g, COEFFICIENTS, steps)


def distance(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).norm() / ref.norm()).item()


def inputs():
    """Wide and tall matrices, Gaussian and of rank 4 plus noise (torch's bf16 iteration is
    far from the exact one there: the noise's small singular values are amplified)."""
    gen = torch.Generator().manual_seed(0)
    for m, n in [(64, 192), (192, 64), (32, 128), (128, 256), (48, 96)]:
        yield torch.randn(m, n, generator=gen)
        low = torch.randn(m, 4, generator=gen) @ torch.randn(4, n, generator=gen)
        yield 3 * low + 0.1 * torch.randn(m, n, generator=gen)


def gram_orthogonalised(g: torch.Tensor, batched: bool = True) -> torch.Tensor:
    return muon._orthogonalised([g], COEFFICIENTS, 5, 1e-7, gram=True, batched=batched)[0]


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "one_at_a_time"])
def test_gram_newton_schulz_is_closer_to_the_exact_iteration_than_torchs(batched):
    """Stated tolerance of train.newton_schulz: gram. Every result is at most half as far
    (relative Frobenius distance) from the exact iteration as torch's bf16 one, in the input's
    orientation and dtype: torch's update up to torch's own rounding."""
    for g in inputs():
        ours, ref = gram_orthogonalised(g, batched), exact(g)
        theirs = _zeropower_via_newtonschulz(g, COEFFICIENTS, 5, 1e-7)
        assert ours.shape == g.shape and ours.dtype == torch.float32
        assert distance(ours, ref) <= 0.5 * distance(theirs, ref), g.shape


def test_gram_newton_schulz_without_its_restart_is_outside_the_tolerance(monkeypatch):
    """The tolerance separates: never restarted, the Gram form in half precision drifts (its
    authors' finding) to farther from the exact iteration than torch's bf16 one."""
    monkeypatch.setattr(muon, "GRAM_RESTART", 99)
    worst = max(
        distance(gram_orthogonalised(g), exact(g))
        / distance(_zeropower_via_newtonschulz(g, COEFFICIENTS, 5, 1e-7), exact(g))
        for g in inputs()
    )
    assert worst > 1.0


def test_gram_takes_the_matrices_where_it_needs_fewer_flops_and_counts_them():
    """Gram where its FLOPs (newton_schulz_flops, here checked against torch's FLOP counter)
    are fewer: wide matrices (n > 1.5 m), not square ones, which take torch's iteration."""
    for m, n in [(16, 48), (32, 128), (24, 24), (40, 60), (8, 24)]:
        for gram in (True, False):
            x = torch.randn(1, m, n)
            run = muon._gram_newton_schulz if gram else muon._newton_schulz
            with FlopCounterMode(display=False) as counter:
                run(x, COEFFICIENTS, 5, 1e-7)
            assert counter.get_total_flops() == muon.newton_schulz_flops(m, n, 5, gram)
    assert muon._gram_pays(16, 48, 5) and muon._gram_pays(32, 128, 5)
    assert not muon._gram_pays(24, 24, 5) and not muon._gram_pays(40, 60, 5)  # n = 1.5 m
    assert not muon._gram_pays(40, 59, 5) and muon._gram_pays(40, 61, 5)
    # an 8B-shaped one-layer draft's MLP matrix: 30 % fewer
    assert muon.newton_schulz_flops(4096, 14336, 5, True) / muon.newton_schulz_flops(
        4096, 14336, 5, False
    ) == pytest.approx(0.70, abs=0.005)


GRAM = functools.partial(BatchedMuon, newton_schulz="gram")


@pytest.mark.parametrize("nesterov", [True, False], ids=["nesterov", "plain"])
def test_gram_muon_update_is_closer_to_the_fp32_iteration_than_torchs(nesterov):
    """The optimiser's step with newton_schulz="gram": every matrix's update in every step at
    most as far from torch's Muon iterating in fp32 (precision.Fp32Muon) as torch's own bf16
    update is, the square ones (no Gram form) within bf16 rounding of torch's; momentum
    buffers equal."""
    ours, our_bufs = steps(GRAM, nesterov=nesterov)
    torchs, torch_bufs = steps(torch.optim.Muon, nesterov=nesterov)
    fp32, _ = steps(Fp32Muon, nesterov=nesterov)
    for mine, theirs in zip(our_bufs, torch_bufs, strict=True):
        assert torch.equal(mine, theirs)
    for step_ours, step_torch, step_fp32 in zip(ours, torchs, fp32, strict=True):
        for shape, mine, theirs, ref in zip(SHAPES, step_ours, step_torch, step_fp32, strict=True):
            if muon._gram_pays(min(shape), max(shape), 5):
                assert (mine - ref).norm() <= 0.5 * (theirs - ref).norm(), shape
            else:
                assert (mine - theirs).norm() / theirs.norm() < 0.01, shape


def test_gpu_optimizers_with_gram_take_large_matrices_one_at_a_time(monkeypatch):
    """With "gram" large matrices go to a BatchedMuon taking them one at a time by Gram
    Newton-Schulz (torch's own function for those without a Gram form), small ones, where the
    launches take the time, to one batching them by torch's iteration; settings and names as
    speculators built them."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 4))
    torch_muon, adamw = built(model)
    monkeypatch.setattr(muon, "BATCH_MAX_ELEMENTS", 0)
    (large, rest) = muon.gpu_optimizers([torch_muon, adamw], "gram")
    assert type(large) is BatchedMuon and large.gram and not large.batched and rest is adamw
    assert large.state_dict() == torch_muon.state_dict()
    monkeypatch.setattr(muon, "BATCH_MAX_ELEMENTS", 32)
    small, large, _ = muon.gpu_optimizers([torch_muon, adamw], "gram")
    assert (small.gram, small.batched, large.gram, large.batched) == (False, True, True, False)
    assert large.param_groups[0]["param_names"] == ["0.weight"]
    with pytest.raises(ValueError, match="newton_schulz must be one of"):
        BatchedMuon([torch.nn.Parameter(torch.randn(4, 4))], lr=0.01, newton_schulz="fast")


def loss_curve(cls, lr: float = 0.02, n: int = 60) -> list[float]:
    """Losses of a two-layer tanh network (matrices 96 x 32 and 32 x 96, both wide once
    oriented) fitting a random linear map, ``n`` Muon steps of ``cls`` from fixed weights."""
    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 96, bias=False), torch.nn.Tanh(), torch.nn.Linear(96, 32, bias=False)
    )
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    target = torch.randn(32, 32, generator=gen)
    opt = cls(model.parameters(), lr=lr)
    losses = []
    for _ in range(n):
        x = torch.randn(256, 32, generator=gen)
        loss = ((model(x) - x @ target) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_training_with_gram_muon_follows_torchs_muon():
    """Over 60 steps the losses with Gram Newton-Schulz (one matrix at a time, as the train
    job takes large matrices) stay within 1 % of torch's Muon's while falling by more than a
    third; 1.5 x the lr, a mutation of that size, leaves the tolerance."""
    gram = functools.partial(BatchedMuon, newton_schulz="gram", batched=False)
    theirs, ours = loss_curve(torch.optim.Muon), loss_curve(gram)
    assert ours[-1] < 0.66 * ours[0]
    assert max(abs(a - b) / b for a, b in zip(ours, theirs, strict=True)) < 0.01
    faster = loss_curve(gram, lr=0.03)
    assert max(abs(a - b) / b for a, b in zip(faster, theirs, strict=True)) > 0.05


def outlier_columns(scale: float, m: int = 256, n: int = 1024) -> torch.Tensor:
    """A Gaussian matrix whose first 4 columns are ``scale`` times the rest (as a gradient of
    inputs with a few large channels)."""
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(m, n, generator=gen)
    g[:, :4] *= scale
    return g


def test_gram_newton_schulz_with_a_few_large_columns():
    """The documented limit: the Gram matrix squares the input's range, so with a few columns
    10^3-10^5 times the rest the Gram form in fp16 loses its edge and is up to 3 x farther
    from the exact iteration than torch's bf16 result, still within 0.02 of it (256 x 1024:
    1.2-2.3 x; up to 10^2 it is at most half as far)."""
    for scale, worst in ((1e2, 0.5), (1e3, 3.0), (1e4, 3.0), (1e5, 3.0)):
        g = outlier_columns(scale)
        ref = exact(g)
        ours = distance(gram_orthogonalised(g, batched=False), ref)
        theirs = distance(_zeropower_via_newtonschulz(g, COEFFICIENTS, 5, 1e-7), ref)
        assert ours <= worst * theirs and ours < 0.02, (scale, ours, theirs)


@pytest.mark.parametrize("ns_steps", [3, 5, 6, 8, 12])
def test_gram_newton_schulz_holds_for_other_step_counts(ns_steps):
    """Restarted every GRAM_SPAN steps after the first restart, the fp16 Gram form stays finite
    and at most half as far from the exact iteration as torch's at any step count (without the
    later restarts it overflowed at 8 steps); its FLOP count follows the restarts."""
    gen = torch.Generator().manual_seed(3)
    g = 3 * torch.randn(128, 16, generator=gen) @ torch.randn(16, 512, generator=gen)
    g = g + 0.1 * torch.randn(128, 512, generator=gen)
    ours = muon._orthogonalised([g], COEFFICIENTS, ns_steps, 1e-7, gram=True, batched=False)[0]
    ref = exact(g, ns_steps)
    theirs = _zeropower_via_newtonschulz(g, COEFFICIENTS, ns_steps, 1e-7)
    assert torch.isfinite(ours).all()
    assert distance(ours, ref) <= 0.5 * distance(theirs, ref)
    with FlopCounterMode(display=False) as counter:
        muon._gram_newton_schulz(g[None], COEFFICIENTS, ns_steps, 1e-7)
    assert counter.get_total_flops() == muon.newton_schulz_flops(128, 512, ns_steps, True)


def test_gram_muon_takes_fp64_parameters_and_survives_a_copy():
    """fp64 parameters (torch's Muon takes them) and a deep copy of the optimiser (its
    settings are part of its pickled state)."""
    import copy

    p = torch.nn.Parameter(torch.randn(16, 48, dtype=torch.float64))
    opt = GRAM_ONE_AT_A_TIME([p], lr=0.02)
    p.grad = torch.randn(16, 48, dtype=torch.float64)
    opt.step()
    assert p.dtype == torch.float64 and torch.isfinite(p).all()
    clone = copy.deepcopy(opt)
    assert (clone.gram, clone.batched) == (True, False)
    clone.step()


GRAM_ONE_AT_A_TIME = functools.partial(BatchedMuon, newton_schulz="gram", batched=False)

# BatchedMuon's four paths: matrices of one shape stacked or one at a time, each with torch's
# iteration or Gram Newton-Schulz where it pays
ALL_SETTINGS = pytest.mark.parametrize(
    "settings",
    [
        {},
        {"newton_schulz": "gram"},
        {"batched": False},
        {"newton_schulz": "gram", "batched": False},
    ],
    ids=["stacked", "gram", "one_at_a_time", "gram_one_at_a_time"],
)


@pytest.mark.parametrize("nesterov", [True, False], ids=["nesterov", "plain"])
def test_one_at_a_time_muon_equals_torchs_for_matrices_without_a_gram_form(nesterov):
    """Taken one at a time (the large matrices' optimiser), a matrix that is not wide enough
    for the Gram form gets torch's update to the bit, settings of two parameter groups
    included; momentum buffers equal."""
    gen = torch.Generator().manual_seed(2)
    shapes = [(24, 24), (30, 40), (40, 30)]
    weights = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(3)]

    def run(cls):
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        groups = [{"params": params[:2]},
                  {"params": params[2:], "lr": 0.05, "adjust_lr_fn": "match_rms_adamw"}]  # fmt: skip
        opt = cls(groups, lr=0.02, weight_decay=0.1, nesterov=nesterov)
        for step in grads:
            for p, g in zip(params, step, strict=True):
                p.grad = g.clone()
            opt.step()
        return params, [opt.state[p]["momentum_buffer"] for p in params]

    ours, our_bufs = run(GRAM_ONE_AT_A_TIME)
    theirs, their_bufs = run(torch.optim.Muon)
    for a, b in zip(ours + our_bufs, theirs + their_bufs, strict=True):
        assert torch.equal(a, b)


def test_gram_newton_schulz_sums_in_fp32_and_restores_torchs_setting():
    """The scaled Gram matrix's square exceeds fp16's range before its alpha scales it back:
    cuBLAS may not reduce partial sums in fp16 while the Gram form runs, and torch's setting
    is as before after it (here torch's default, True)."""
    matmul = torch.backends.cuda.matmul
    seen = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in ("bmm", "baddbmm"):
                seen.append(matmul.allow_fp16_reduced_precision_reduction)
            return func(*args, **(kwargs or {}))

    assert matmul.allow_fp16_reduced_precision_reduction
    with Spy():
        muon._gram_newton_schulz(torch.randn(1, 16, 48), COEFFICIENTS, 5, 1e-7)
    assert seen and not any(seen)
    assert matmul.allow_fp16_reduced_precision_reduction


# ---- split over ranks (DDP) -------------------------------------------------------------------


def test_ranks_are_grouped_by_host():
    """Muon is split only among one host's ranks: each host's ranks, in order of their first."""
    assert muon.host_groups(["a", "a", "b", "b"]) == [[0, 1], [2, 3]]
    assert muon.host_groups(["b", "a", "b", "a", "c"]) == [[0, 2], [1, 3], [4]]
    assert muon.host_groups(["a", "a"]) == [[0, 1]]


def test_units_go_to_the_least_loaded_rank_costliest_first():
    """Longest-processing-time order: the same owners on every rank, from the costs alone."""
    assert muon.Ranks(0, (0, 1)).owners([8, 7, 6, 5, 4]) == [0, 1, 1, 0, 0]  # loads 17 and 13
    assert muon.Ranks(1, (0, 1, 2)).owners([1, 9, 1, 1]) == [1, 0, 2, 1]
    assert muon.Ranks(0, (0, 1)).owners([]) == []


def test_outside_a_process_group_nothing_is_split(monkeypatch):
    """No default group (or one of one process): BatchedMuon runs alone, and gpu_optimizers
    leaves large matrices with "standard" to torch's Muon as before."""
    assert muon.Ranks.of_this_host() is None
    torch_muon, adamw = built(torch.nn.Sequential(torch.nn.Linear(8, 8)))
    monkeypatch.setattr(muon, "BATCH_MAX_ELEMENTS", 0)  # the 8 x 8 weight is large
    assert muon.gpu_optimizers([torch_muon, adamw], "standard", across_ranks=True)[0] is torch_muon


def test_an_8b_shaped_drafts_matrices_split_evenly_by_flops():
    """The one-layer 8B-shaped draft's eight Muon matrices (all large: one unit each) over two
    ranks: 9.96 and 10.45 of the 20.40 TFLOP of a Gram step, each rank's within 5 % of half;
    by count alone (four each, the first four to one rank) it would be 7.66 and 12.74."""
    shapes = [(4096, 12288), (4096, 8192), (1024, 8192), (1024, 8192), (4096, 4096),
              (14336, 4096), (14336, 4096), (4096, 14336)]  # fmt: skip
    like = [torch.empty(s, device="meta") for s in shapes]
    units = muon._units(like, 5, gram=True, batched=False)
    assert [kind for _, kind in units] == ["gram"] * 4 + ["torch"] + ["gram"] * 3
    costs = [muon._unit_flops(like, unit, 5) for unit in units]
    owners = muon.Ranks(0, (0, 1)).owners(costs)
    loads = [sum(c for c, o in zip(costs, owners, strict=True) if o == r) for r in (0, 1)]
    assert [round(x / 1e12, 2) for x in loads] == [9.96, 10.45]
    assert max(loads) < 1.05 * sum(loads) / 2


@pytest.mark.parametrize("hosts", ["a,a", "a,a,b,b", "a,b"])
def test_split_over_a_hosts_ranks_gives_each_the_unsplit_update(tmp_path, hosts):
    """gloo ranks standing for ranks on ``hosts``, with the same gradients (as under DDP):
    each host's ranks orthogonalise a share each and broadcast it among themselves (a host of
    one rank splits nothing). Every rank ends every setting (batched, one at a time by Gram or
    by torch's function) with the parameters and momentum buffers of the unsplit optimiser to
    the bit, and the matmul launches of a host's ranks add up to its, each running some; with
    bf16 parameters and no nesterov too, where torch's function divides the momentum buffer
    itself in place. gpu_optimizers splits its BatchedMuons, and with "standard" gives the
    large matrices to one as well."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    import muon_ranks_worker as worker

    host_of = hosts.split(",")
    worker_file = Path(worker.__file__)
    outs = [tmp_path / f"rank{r}.pt" for r in range(len(host_of))]
    # the workers import this checkout's eagle3lib, not an installed one
    env = {**os.environ, "PYTHONPATH": str(worker_file.parents[1])}
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker_file), str(tmp_path / "store"), str(r), hosts, str(out)],
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r, out in enumerate(outs)
    ]
    try:
        for proc in procs:
            _, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err[-2000:]
    finally:  # one that failed leaves the others waiting in gloo
        for proc in procs:
            proc.kill()
    ranked = [torch.load(out) for out in outs]
    groups = muon.host_groups(host_of)
    split = {r: (g.index(r), len(g)) if len(g) > 1 else None for g in groups for r in g}
    split_of = {r: g[0] for g in groups for r in g}  # the first rank of each one's host
    for setting in worker.SETTINGS:
        alone = worker.run(setting, across_ranks=False)
        assert alone["ranks"] is None
        for r, results in enumerate(ranked):
            got = results[setting]
            assert got["ranks"] == split[r]
            for mine, theirs in zip(got["params"] + got["bufs"], alone["params"] + alone["bufs"],
                                    strict=True):  # fmt: skip
                assert torch.equal(mine, theirs), setting
        for group in groups:
            shares = [ranked[r][setting]["matmuls"] for r in group]
            assert sum(shares) == alone["matmuls"] and min(shares) > 0, (setting, shares)
            for member, r in enumerate(group):  # the units Ranks.owners gives it, each step
                owned = worker.owned(setting, member, len(group))
                assert ranked[r][setting]["orthogonalised"] == sorted(owned * 3), (setting, r)
    for r, results in enumerate(ranked):
        large = ("BatchedMuon", False, False, split[r]) if split[r] else ("Muon", None, None, None)
        assert results["built"]["gram"] == [("BatchedMuon", True, False, split[r]),
                                            ("BatchedMuon", False, True, split[r])]  # fmt: skip
        assert results["built"]["standard"] == [("BatchedMuon", True, False, split[r]), large]
    # ranks about to step different matrices stop with an error instead of hanging: those
    # sharing the work with rank 1, which holds no gradient for one matrix
    for r, results in enumerate(ranked):
        if split[r] and 1 in next(g for g in groups if r in g):
            assert results["mismatched"] == (
                f"Muon split over ranks: rank {split_of[r]} steps 9 matrices with gradients, "
                "rank 1 8 (or of other shapes); the ranks sharing Muon's work must hold "
                "gradients for the same parameters, as DDP gives them"
            )
        else:
            assert results["mismatched"] is None, r


@pytest.mark.parametrize("tall", [False, True], ids=["wide", "tall"])
def test_scaling_to_fp16_in_one_kernel_gives_the_two_kernels_bits(tall):
    """Gram Newton-Schulz's input, scaled and stored in fp16 by one kernel: the bits of scaling
    in fp32 and then casting, on values spread over fp16's whole range (a tall matrix's
    transposed view included), and contiguous."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 64, 96, generator=gen) * torch.logspace(-6, 4, 96)
    x = x.mT if tall else x
    scale = torch.rand(3, 1, 1, generator=gen) * 100 + 0.5
    ours = muon._scaled_half(x, scale)
    assert ours.dtype == torch.float16 and ours.is_contiguous()
    assert torch.equal(ours, (x * scale).half())


@pytest.mark.parametrize("nesterov", [True, False], ids=["nesterov", "plain"])
@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"], ids=str)
def test_gram_update_added_in_fp16_equals_adding_it_unpacked(nesterov, adjust_lr_fn):
    """A Gram unit's fp16 result is added with its scale folded into the step size (no fp32
    copy of it): every parameter ends as it does when the unpacked fp32 update is added as
    torch's Muon adds it, p (1 - lr wd) - lr' o, to the bit, for wide and tall matrices."""
    gen = torch.Generator().manual_seed(6)
    shapes = [(32, 128), (128, 32)]  # both wide enough for the Gram form, one transposed
    assert all(muon._gram_pays(min(s), max(s), 5) for s in shapes)
    weights = [torch.randn(s, generator=gen) for s in shapes]
    grads = [torch.randn(s, generator=gen) for s in shapes]
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    settings = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=nesterov,
                    adjust_lr_fn=adjust_lr_fn)  # fmt: skip
    opt = GRAM_ONE_AT_A_TIME(params, **settings)
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    opt.step()
    for w, g, p in zip(weights, grads, params, strict=True):
        buf = torch.zeros_like(g).lerp_(g, 1 - 0.95)
        update = g.lerp(buf, 0.95) if nesterov else buf
        result = muon._unit_result([update], "gram", (3.4445, -4.7750, 2.0315), 5, 1e-7)
        (o,) = muon._unpacked(result, "gram", [w])
        lr = muon._adjust_lr(0.02, adjust_lr_fn, w.shape)
        expected = w.clone().mul_(1 - 0.02 * 0.1).add_(o, alpha=-lr)
        assert torch.equal(p.detach(), expected), w.shape


@pytest.mark.filterwarnings("ignore:Detected call of .lr_scheduler.step")
@ALL_SETTINGS
@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"], ids=str)
def test_a_rate_tensor_on_the_device_gives_the_numbers_update(monkeypatch, settings, adjust_lr_fn):
    """A captured step's learning rate (graphed_step.capturable_optimizers: a float32 tensor
    that the scheduler fills in place) gives each matrix the update a number gives, within
    1e-6 of it (relative Frobenius norm: the rate's float32 rounding), over steps whose rate
    the scheduler changes. On a CPU the tensor stands in for one on the GPU (``_rate`` keeps
    it); a rate off by 1 % is far outside."""
    from eagle3lib.graphed_step import capturable_optimizers

    monkeypatch.setattr(muon, "_rate", lambda lr: lr)

    def updates(as_tensor: bool, scale: float = 1.0) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(3)
        params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES + [(64, 256)]]
        start = [p.detach().clone() for p in params]
        opt = BatchedMuon(params, lr=0.02 * scale, weight_decay=0.1, adjust_lr_fn=adjust_lr_fn,
                          **settings)  # fmt: skip
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (k + 1))
        if as_tensor:
            capturable_optimizers([opt], torch.device("cpu"))
            rate = opt.param_groups[0]["lr"]
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
            sched.step()
        if as_tensor:
            assert opt.param_groups[0]["lr"] is rate and rate.item() == pytest.approx(
                0.02 * scale / 4
            )
        return [p.detach() - s for p, s in zip(params, start, strict=True)]

    def worst(ours, ref):
        return max(((a - b).norm() / b.norm()).item() for a, b in zip(ours, ref, strict=True))

    numbers = updates(False)
    assert worst(updates(True), numbers) < 1e-6
    assert worst(updates(True, scale=1.01), numbers) > 1e-3


@ALL_SETTINGS
def test_a_matrix_without_gradient_signal_stays_finite_as_in_torchs_muon(settings):
    """A gradient of zeros (a layer that got no signal) orthogonalises to zeros, as torch's
    Muon (its norm held above eps) does: only weight decay moves the weights, to torch's
    bits, on every path; the Gram form's wide matrix among them."""

    def stepped(cls, **kwargs):
        gen = torch.Generator().manual_seed(4)
        params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES + [(64, 256)]]
        opt = cls(params, lr=0.02, weight_decay=0.1, **kwargs)
        for _ in range(2):
            for p in params:
                p.grad = torch.zeros(p.shape)
            opt.step()
        return params

    for ours, theirs in zip(
        stepped(BatchedMuon, **settings), stepped(torch.optim.Muon), strict=True
    ):
        assert torch.isfinite(ours).all() and torch.equal(ours, theirs)


@ALL_SETTINGS
def test_bf16_momentum_buffers_without_nesterov_stay_torchs(settings):
    """torch's Newton-Schulz divides a bf16 input by its norm in place, and without nesterov
    that input is the momentum buffer: every path leaves each buffer as torch's Muon does,
    to the bit, over 3 steps (the stacked and Gram paths orthogonalise copies and divide the
    buffers after)."""

    def buffers(cls, **kwargs):
        gen = torch.Generator().manual_seed(5)
        shapes = SHAPES + [(64, 256)]
        params = [torch.nn.Parameter(torch.randn(s, generator=gen).bfloat16()) for s in shapes]
        opt = cls(params, lr=0.02, nesterov=False, **kwargs)
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen).bfloat16()
            opt.step()
        return [opt.state[p]["momentum_buffer"] for p in params]

    ours, theirs = buffers(BatchedMuon, **settings), buffers(torch.optim.Muon)
    for shape, mine, torchs in zip(SHAPES + [(64, 256)], ours, theirs, strict=True):
        assert mine.dtype == torch.bfloat16 and torch.equal(mine, torchs), shape


def test_a_rate_on_the_device_stays_a_tensor_and_one_on_the_cpu_becomes_a_number():
    """A captured step's rate (a tensor on the GPU: meta stands in) is applied as it is; a
    number read there would be baked into the graph, and the schedule ignored."""
    on_device = torch.tensor(0.1, device="meta")
    assert muon._rate(on_device) is on_device
    assert type(muon._rate(torch.tensor(0.5))) is float and muon._rate(torch.tensor(0.5)) == 0.5
    assert muon._rate(0.25) == 0.25


def test_the_ranks_check_repeats_until_a_step_had_gradients():
    """BatchedMuon checks that DDP's ranks hold the same matrices at its first step with any
    gradient, not at a first step without (it would find nothing to compare)."""

    class Ranks:
        def __init__(self):
            self.checked = []

        def check_same_matrices(self, shapes):
            self.checked.append(shapes)

    ranks = Ranks()
    opt = BatchedMuon([torch.nn.Parameter(torch.ones(4, 8))], lr=0.02, ranks=ranks)
    opt.step()
    opt.step()
    assert ranks.checked == [[[]], [[]]]


def test_a_units_flops_count_every_matrix_of_it():
    """Units go to ranks by their FLOPs: a stack of two 16 x 48 matrices (a tall 48 x 16 one
    oriented so) costs twice one, a Gram unit its own count."""
    like = [torch.empty(s) for s in SHAPES]
    one = muon.newton_schulz_flops(16, 48, 5, False)
    assert muon._unit_flops(like, ([0, 1, 2], "stacked"), 5) == 3 * one
    assert muon._unit_flops(like, ([7], "gram"), 5) == muon.newton_schulz_flops(16, 32, 5, True)


def test_gram_newton_schulz_restarts_before_its_third_step_then_every_third():
    """Its authors restart five steps once, before the third; longer runs restart every
    GRAM_SPAN steps after that, so Q never spans more than 3 steps (eigenvalues up to 40.9)."""
    assert muon._restarts(5) == {2}
    assert muon._restarts(8) == {2, 5}
    assert muon._restarts(12) == {2, 5, 8, 11}
    assert muon._restarts(2) == set()


def test_gram_scale_lifts_small_entries_into_fp16s_normal_range_without_overflow():
    """With a few columns 10^4 times the rest, a normalised matrix's other entries fall below
    fp16's normal range (6.1e-5): nearly all of them unscaled, under a fifth times
    GRAM_SCALE; the Gram matrix's eigenvalues (below 1.45) times its square stay below 2.4e4."""
    g = outlier_columns(1e4)
    norm = torch.linalg.vector_norm(g)

    def subnormal_share(scale: float) -> float:
        bulk = muon._scaled_half(g[None], scale / norm)[0, :, 4:].float().abs()
        return (bulk < 6.1e-5).float().mean().item()

    assert subnormal_share(1.0) > 0.9
    assert subnormal_share(muon.GRAM_SCALE) < 0.2
    assert 1.45 * muon.GRAM_SCALE**2 < 2.4e4
