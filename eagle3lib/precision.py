"""bf16 only where the CPU computes it natively; torch's Muon orthogonalising in fp32 elsewhere.

On a CPU without bf16 instructions (AVX2 only, or AVX-512 without AVX512-BF16/AMX) torch's
bf16 matrix products fall back to kernels several times slower than fp32 (BENCHMARKS.md), and
torch.optim.Muon always runs its Newton-Schulz iteration in bf16: on such CPUs that iteration
was most of a training step. There the CPU path computes in fp32 only.
"""

from __future__ import annotations

import functools
import os
import platform

import torch
from torch.overrides import TorchFunctionMode

# oneDNN ISA caps (ONEDNN_MAX_CPU_ISA) that exclude its bf16 kernels: the bf16 dot products
# start at AVX512_CORE_BF16 (and AMX).
_ONEDNN_ISAS_WITHOUT_BF16 = frozenset(
    {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}
)


def native_bf16(
    *,
    x86: bool,
    aten_capability: str,
    onednn_bf16: bool,
    bf16_instructions: bool,
    onednn_max_isa: str | None,
) -> bool:
    """Whether torch computes bf16 natively, from what torch reports about this CPU.

    ``aten_capability`` is ``torch.backends.cpu.get_cpu_capability()`` (the kernels ATen
    dispatches to, lowered by ``ATEN_CPU_CAPABILITY``); ``onednn_bf16`` is
    ``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` (oneDNN supports bf16 at the ISA it
    uses, lowered by ``ONEDNN_MAX_CPU_ISA``; the only check off x86); ``bf16_instructions``
    is AVX512-BF16 or AMX in the CPU's flags; ``onednn_max_isa`` is ``ONEDNN_MAX_CPU_ISA``
    (oneDNN also supports bf16, slowly, on AVX-512 without bf16 instructions). On x86 all of
    them must allow bf16, so a CPU emulating AVX2 counts as one without."""
    if not onednn_bf16:
        return False
    if not x86:
        return True
    if (onednn_max_isa or "ALL").upper() in _ONEDNN_ISAS_WITHOUT_BF16:
        return False
    return aten_capability.upper().startswith("AVX512") and bf16_instructions


def _onednn_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())  # noqa: SLF001
    except (AttributeError, RuntimeError):  # a torch built without oneDNN
        return False


@functools.cache
def cpu_native_bf16() -> bool:
    """``native_bf16`` for this process's CPU and environment (read once per process)."""
    env = os.environ
    return native_bf16(
        x86=platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"),
        aten_capability=torch.backends.cpu.get_cpu_capability(),
        onednn_bf16=_onednn_bf16(),
        bf16_instructions=torch.cpu._is_avx512_bf16_supported()  # noqa: SLF001
        or torch.cpu._is_amx_tile_supported(),  # noqa: SLF001
        onednn_max_isa=env.get("ONEDNN_MAX_CPU_ISA") or env.get("DNNL_MAX_CPU_ISA"),
    )


def cpu_model() -> str:
    """The CPU's model name as lscpu prints it (from /proc/cpuinfo), else the platform's name."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def bf16_is_slow(device: torch.device | str) -> bool:
    """bf16 compute on ``device`` would fall back to slow kernels (a CPU without bf16)."""
    return torch.device(device).type == "cpu" and not cpu_native_bf16()


class _Bf16CastsAsFp32(TorchFunctionMode):
    """``tensor.bfloat16()`` gives an fp32 copy instead (the only bf16 cast in Muon's step)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.bfloat16:
            return args[0].to(torch.float32, copy=True)
        return func(*args, **(kwargs or {}))


class Fp32Muon(torch.optim.Muon):
    """torch.optim.Muon whose Newton-Schulz iteration runs in fp32 instead of bf16.

    torch's Muon casts the momentum update to bf16 before orthogonalising it and has no
    argument to change that; here its own step runs with that one cast giving an fp32 copy,
    so every other line (momentum, Nesterov, coefficients, lr adjustment, weight decay) is
    torch's. The update equals torch's within bf16 rounding (tests/test_precision.py)."""

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with _Bf16CastsAsFp32():
            super().step()
        return loss

    @classmethod
    def like(cls, muon: torch.optim.Muon) -> Fp32Muon:
        """The same parameter groups and settings as a freshly built ``muon`` (no state yet)."""
        if muon.state:
            raise ValueError("convert Muon before its first step")
        return cls([dict(group) for group in muon.param_groups], **muon.defaults)


def cpu_optimizers(optimizers: list[torch.optim.Optimizer]) -> list[torch.optim.Optimizer]:
    """speculators' optimisers for a CPU run: Muon in fp32 where bf16 is slow, else as built."""
    if cpu_native_bf16():
        return optimizers
    return [Fp32Muon.like(o) if type(o) is torch.optim.Muon else o for o in optimizers]
