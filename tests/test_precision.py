"""No bf16 compute on a CPU without native bf16: detection, torch's Muon in fp32, dtypes."""

import os
import platform
import subprocess
import sys

import pytest
import torch
from conftest import train_pipeline
from torch.utils._python_dispatch import TorchDispatchMode

from eagle3lib import precision
from eagle3lib.errors import UserError
from eagle3lib.hidden_states import resolve_dtype

# ops that move or reinterpret bf16 data without computing with it
DATA_MOVEMENT = {"_to_copy", "copy_", "view", "_unsafe_view", "detach", "alias", "slice", "select"}


class Bf16Ops(TorchDispatchMode):
    """Names of the aten ops run (in this thread) with a bf16 tensor in or out."""

    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [
            t
            for t in torch.utils._pytree.tree_leaves((args, kwargs, out))
            if isinstance(t, torch.Tensor)
        ]
        if any(t.dtype == torch.bfloat16 for t in tensors):
            self.ops.add(func._schema.name.removeprefix("aten::"))
        return out

    @property
    def compute(self) -> set[str]:
        return self.ops - DATA_MOVEMENT


@pytest.fixture(params=[False, True], ids=["no-native-bf16", "native-bf16"])
def native(request, monkeypatch):
    """Force the detection either way, whatever this host's CPU has."""
    monkeypatch.setattr(precision, "cpu_native_bf16", lambda: request.param)
    return request.param


X86 = dict(x86=True, onednn_bf16=True, bf16_instructions=True, onednn_max_isa=None)


@pytest.mark.parametrize(
    "reported, expected",
    [
        (dict(X86, aten_capability="AVX512"), True),  # e.g. AMD Zen 4, Intel Sapphire Rapids
        (dict(X86, aten_capability="AVX2"), False),  # ATEN_CPU_CAPABILITY=avx2
        (dict(X86, aten_capability="AVX2", onednn_bf16=False), False),  # an AVX2-only CPU
        (dict(X86, aten_capability="AVX512", onednn_bf16=False), False),  # oneDNN capped
        (dict(X86, aten_capability="AVX512", bf16_instructions=False), False),  # Skylake-X
        (dict(X86, aten_capability="AVX512", onednn_max_isa="avx512_core"), False),
        (dict(X86, aten_capability="AVX512", onednn_max_isa="AVX512_CORE_BF16"), True),
        (dict(X86, aten_capability="AVX512", onednn_max_isa="AVX512_CORE_AMX"), True),
        (dict(X86, x86=False, aten_capability="SVE256", bf16_instructions=False), True),
        (dict(X86, x86=False, aten_capability="DEFAULT", onednn_bf16=False), False),
    ],
)
def test_native_bf16_needs_every_layer_torch_uses_to_allow_it(reported, expected):
    assert precision.native_bf16(**reported) is expected


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 emulation")
@pytest.mark.parametrize(
    "env",
    [
        {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
        {"ATEN_CPU_CAPABILITY": "avx2"},
        {"ONEDNN_MAX_CPU_ISA": "AVX2"},
    ],
    ids=["both", "aten", "onednn"],
)
def test_a_cpu_emulating_avx2_has_no_native_bf16(env):
    code = "from eagle3lib.precision import cpu_native_bf16; print(cpu_native_bf16())"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "False"


def muon_steps(cls, shape, nesterov=True, steps=3, seed=0):
    """Three steps of ``cls`` on one matrix with fixed gradients: (updates, momentum buffer)."""
    g = torch.Generator().manual_seed(seed)
    param = torch.nn.Parameter(torch.randn(shape, generator=g) * 0.02)
    grads = [torch.randn(shape, generator=g) for _ in range(steps)]
    opt = cls([param], lr=0.02, weight_decay=0.1, nesterov=nesterov, adjust_lr_fn="match_rms_adamw")
    updates = []
    for grad in grads:
        before = param.detach().clone()
        param.grad = grad
        opt.step()
        updates.append(param.detach() - before)
    return updates, opt.state[param]["momentum_buffer"]


def reference_update(shape, nesterov=True):
    """torch's own Muon with its Newton-Schulz iteration in float64 (the exact-ish answer)."""

    class Fp64(precision._Bf16CastsAsFp32):  # noqa: SLF001
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.Tensor.bfloat16:
                return args[0].to(torch.float64, copy=True)
            return func(*args, **(kwargs or {}))

    class Fp64Muon(torch.optim.Muon):
        def step(self, closure=None):
            with Fp64():
                return super().step(closure)

    return muon_steps(Fp64Muon, shape, nesterov)


@pytest.mark.parametrize("shape", [(64, 192), (192, 64), (576, 576)], ids=str)
@pytest.mark.parametrize("nesterov", [True, False], ids=["nesterov", "plain"])
def test_fp32_muon_update_equals_torchs_muon_within_bf16_rounding(shape, nesterov):
    """Stated tolerance: every step's update within 3 % (relative Frobenius norm) of torch's
    bf16 one, which is itself about 1 % off; and closer than torch's to the fp64 iteration."""
    ours, ours_buf = muon_steps(precision.Fp32Muon, shape, nesterov)
    torchs, torch_buf = muon_steps(torch.optim.Muon, shape, nesterov)
    exact, _ = reference_update(shape, nesterov)
    torch.testing.assert_close(ours_buf, torch_buf, rtol=0, atol=0)  # momentum untouched
    for mine, theirs, ref in zip(ours, torchs, exact, strict=True):
        assert mine.dtype == torch.float32
        assert (mine - theirs).norm() / theirs.norm() < 0.03
        assert (mine - ref).norm() < 0.1 * (theirs - ref).norm()


@pytest.mark.parametrize(
    "cls, bf16", [(precision.Fp32Muon, False), (torch.optim.Muon, True)], ids=["ours", "torch"]
)
def test_fp32_muon_step_computes_nothing_in_bf16(cls, bf16):
    with Bf16Ops() as seen:
        muon_steps(cls, (32, 48), steps=1)
    assert bool(seen.compute & {"mm", "addmm"}) is bf16, seen.ops


def test_cpu_optimizers_swap_torchs_muon_only_without_native_bf16(native):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    muon = torch.optim.Muon(
        [(n, p) for n, p in model.named_parameters() if p.ndim == 2], lr=0.01, ns_steps=4
    )
    adamw = torch.optim.AdamW([p for p in model.parameters() if p.ndim == 1])
    out = precision.cpu_optimizers([muon, adamw])
    assert out[1] is adamw
    if native:
        assert out[0] is muon
    else:
        assert type(out[0]) is precision.Fp32Muon
        assert out[0].state_dict() == muon.state_dict()  # same groups, names and settings


def test_training_on_a_cpu_without_bf16_computes_nothing_in_bf16(pipeline, tmp_path, native):
    with Bf16Ops() as seen:
        stats = train_pipeline(pipeline, tmp_path / "s", optimizer="muon", epochs=1, max_steps=2)
    assert stats["dtype"] == "float32"
    assert stats["optimizers"] == ["Muon" if native else "Fp32Muon", "AdamW"]
    if native:
        assert "mm" in seen.compute  # torch's Muon, as speculators builds it
    else:
        assert seen.compute == set(), seen.compute


@pytest.mark.parametrize("key", ["extract.dtype", "evaluate.dtype", "vllm.dtype"])
def test_bf16_is_refused_only_on_a_cpu_without_it(native, key):
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("auto", cpu, key) == torch.float32
    assert resolve_dtype("auto", gpu, key) == torch.bfloat16
    assert resolve_dtype("bfloat16", gpu, key) == torch.bfloat16
    assert resolve_dtype("float32", cpu, key) == torch.float32
    if native:
        assert resolve_dtype("bfloat16", cpu, key) == torch.bfloat16
    else:
        with pytest.raises(UserError, match=rf"^config key {key}: bfloat16 on this CPU.*float32$"):
            resolve_dtype("bfloat16", cpu, key)
