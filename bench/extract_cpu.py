"""Time the demo's extract job on this CPU at several extract.batch_tokens (interleaved rounds).

    make demo   # or: snakemake results/demo/hidden_states/shard-0.safetensors --configfile config.yaml
    python bench/extract_cpu.py --batch-tokens 16384,4096,2048 --rounds 2

Each variant runs eagle3lib.hidden_states.extract_shard on shard 0 of the demo (config.yaml's
extract section with only batch_tokens changed): the verifier loaded, the forward, the shard
written, fsynced and hashed, as the extract job runs it (the job process's imports and start-up
not included). The variants run in rounds, one of each per round, so that a change of the
machine's load falls on all of them. Per run: tokens/s of the whole call, the CPU seconds in
user and in kernel mode, and the minor page faults (the kernel mode time is mostly faults:
tensors bigger than glibc's mmap threshold, at most 32 MiB, are mapped and unmapped on every
batch). Prints `key = value` lines (the median run of each variant) and the runs as JSON on
stderr.
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

from eagle3lib import precision  # noqa: E402
from eagle3lib.config import ExtractConfig, from_dict  # noqa: E402
from eagle3lib.data import load_samples  # noqa: E402
from eagle3lib.hidden_states import extract_shard  # noqa: E402
from eagle3lib.verifier import read_record  # noqa: E402


def run(cfg: ExtractConfig, samples, record: dict, out: Path) -> dict:
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    stats = extract_shard(
        samples,
        [str(i) for i in range(len(samples))],
        0,
        cfg,
        record,
        out / "shard-0.safetensors",
        out / "shard-0.json",
    )
    seconds = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    tokens = stats["tokens"]
    return {
        "tokens": tokens,
        "seconds": round(seconds, 2),
        "tokens_per_s": round(tokens / seconds, 1),
        "loop_tokens_per_s": round(stats["tokens_per_s"], 1),
        "user_s": round(r1.ru_utime - r0.ru_utime, 1),
        "sys_s": round(r1.ru_stime - r0.ru_stime, 1),
        "minor_faults": r1.ru_minflt - r0.ru_minflt,
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--results", type=Path, default=ROOT / "results" / "demo")
    p.add_argument("--batch-tokens", default="16384,4096,2048")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2, help="as the demo's extract job on 2 cores")
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    section = yaml.safe_load((ROOT / "config.yaml").read_text())["extract"]
    variants = [int(b) for b in args.batch_tokens.split(",")]
    samples = load_samples(args.results / "prepared" / "samples.safetensors")
    record = read_record(args.results / "verifier" / "verifier.json")
    runs: dict[int, list[dict]] = {b: [] for b in variants}
    load = [os.getloadavg()[0]]
    for _ in range(args.rounds):
        for b in variants:
            cfg = from_dict(ExtractConfig, {**section, "batch_tokens": b})
            with tempfile.TemporaryDirectory() as out:
                runs[b].append(run(cfg, samples, record, Path(out)))
            print(f"batch_tokens {b}: {runs[b][-1]}", file=sys.stderr, flush=True)
    load.append(os.getloadavg()[0])
    print(json.dumps({"cpu": precision.cpu_model(), "load": load, "runs": runs}), file=sys.stderr)
    print(f"extract_cpu.cpu = {precision.cpu_model()}")
    print(f"extract_cpu.load = {load[0]:.2f} -> {load[1]:.2f}")
    for b in variants:
        rates = [r["tokens_per_s"] for r in runs[b]]
        median = statistics.median(rates)
        print(f"extract_cpu.batch_tokens_{b}.tokens_per_s = {median:.0f}")
        print(
            f"extract_cpu.batch_tokens_{b}.tokens_per_s.range = {min(rates):.0f}-{max(rates):.0f}"
        )
        faults = statistics.median(r["minor_faults"] for r in runs[b])
        print(f"extract_cpu.batch_tokens_{b}.minor_faults = {faults:.0f}")
        print(
            f"extract_cpu.batch_tokens_{b}.sys_s = {statistics.median(r['sys_s'] for r in runs[b]):.1f}"
        )


if __name__ == "__main__":
    main()
