"""Time the demo's train job on this CPU: torch's Muon (bf16 Newton-Schulz) against Fp32Muon.

    make demo   # or: snakemake ... results/demo/hidden_states/shard-{0,1}.safetensors
                #                   results/demo/vocab/vocab_map.safetensors
    python bench/train_cpu.py --steps 8
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
        python bench/train_cpu.py --steps 8

The last command emulates a CPU without bf16 instructions (AVX2 kernels only: ATen's, oneDNN's
and MKL's, whose GEMM torch's fp32 matrix products use). Both variants
run eagle3lib.train.train on the demo's shards, vocab map and train section (config.yaml),
stopped after --steps steps; they differ only in the Muon optimiser: `bf16_muon` is
torch.optim.Muon as speculators builds it, `fp32_muon` is eagle3lib.precision.Fp32Muon.
`selected` names the one the train job uses on this CPU (precision.cpu_native_bf16). The
figure is the median of the logged per-step real tokens per second after the first --skip
steps. Also measured: a 576 x 8192 matrix times its transpose in fp32 and bf16 on one thread.
Prints `key = value` lines (and the details as JSON on stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eagle3lib import precision, train, vocab  # noqa: E402
from eagle3lib.config import TrainConfig, from_dict  # noqa: E402
from eagle3lib.verifier import read_record  # noqa: E402


def matmul_gflops(dtype: torch.dtype, seconds: float = 1.5) -> float:
    """GFLOP/s of a 576 x 8192 matrix times its transpose on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.randn(576, 8192).to(dtype)
        a @ a.T
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            a @ a.T
            n += 1
        return 2 * 576 * 576 * 8192 * n / (time.perf_counter() - t0) / 1e9
    finally:
        torch.set_num_threads(threads)


def run_variant(
    name: str, native: bool, cfg, epochs: int, results: Path, work: Path, skip: int
) -> dict:
    precision.cpu_native_bf16 = lambda: native  # torch's Muon where "native", else Fp32Muon
    hs = results / "hidden_states"
    shards = sorted(hs.glob("shard-*.safetensors"))
    state = work / name
    stats = train.train(
        cfg,
        read_record(results / "verifier" / "verifier.json"),
        shards,
        [p.with_suffix(".json") for p in shards],
        vocab.load(results / "vocab" / "vocab_map.safetensors"),
        state,
        state / "metrics.jsonl",
    )
    steps = [m for m in train.read_metrics(state / "metrics.jsonl") if "profile" in m]
    timed = steps[skip:]
    rate = statistics.median(m["profile"]["tokens_per_s"] for m in timed)
    return {
        "optimizers": stats["optimizers"],
        "steps_timed": len(timed),
        "tokens_per_s": rate,
        # the demo's training steps at this rate (validation and start-up not included)
        "train_minutes_estimate": epochs * stats["train_tokens_per_epoch"] / rate / 60,
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--results", type=Path, default=ROOT / "results" / "demo")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--skip", type=int, default=2, help="first steps not timed (warm-up)")
    p.add_argument("--threads", type=int, default=2, help="as the demo's train job on 2 cores")
    p.add_argument("--variants", default="bf16_muon,fp32_muon")
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    section = yaml.safe_load((ROOT / "config.yaml").read_text())["train"]
    # one epoch cut at --steps (later epochs would only validate); the estimate uses the demo's
    epochs = from_dict(TrainConfig, section).epochs
    cfg = from_dict(TrainConfig, {**section, "epochs": 1, "max_steps": args.steps, "log_every": 1})
    emulated = {
        k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA") if k in os.environ
    }
    out = {
        "cpu": precision.cpu_model(),
        "env": " ".join(f"{k}={v}" for k, v in emulated.items()) or "none",
        "aten_capability": torch.backends.cpu.get_cpu_capability(),
        "native_bf16": precision.cpu_native_bf16(),
        "load_before": os.getloadavg()[0],
        "matmul_fp32_gflops": matmul_gflops(torch.float32),
        "matmul_bf16_gflops": matmul_gflops(torch.bfloat16),
    }
    out["selected"] = "bf16_muon" if out["native_bf16"] else "fp32_muon"
    with tempfile.TemporaryDirectory() as work:
        for name in args.variants.split(","):
            native = name == "bf16_muon"
            result = run_variant(name, native, cfg, epochs, args.results, Path(work), args.skip)
            out[name] = result
    out["load_after"] = os.getloadavg()[0]
    out["max_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    tag = "avx2_emulated" if emulated else "native"
    print(json.dumps(out, indent=2), file=sys.stderr)
    print(f"train_cpu.{tag}.cpu = {out['cpu']}")
    print(f"train_cpu.{tag}.native_bf16 = {out['native_bf16']}")
    print(f"train_cpu.{tag}.matmul_fp32_gflops = {out['matmul_fp32_gflops']:.1f}")
    print(f"train_cpu.{tag}.matmul_bf16_gflops = {out['matmul_bf16_gflops']:.1f}")
    for name in args.variants.split(","):
        print(f"train_cpu.{tag}.{name}.tokens_per_s = {out[name]['tokens_per_s']:.0f}")
        minutes = out[name]["train_minutes_estimate"]
        print(f"train_cpu.{tag}.{name}.train_minutes_estimate = {minutes:.1f}")
    print(f"train_cpu.{tag}.selected = {out['selected']}")
    print(f"train_cpu.{tag}.max_rss_gib = {out['max_rss_gib']:.2f}")
    print(f"train_cpu.{tag}.load = {out['load_before']:.2f} -> {out['load_after']:.2f}")


if __name__ == "__main__":
    main()
