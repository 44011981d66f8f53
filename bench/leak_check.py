"""Validation fails a GPU job that leaves device memory behind: shown with real NVML readings.

    python bench/leak_check.py --out /tmp/leak-check      # needs an NVIDIA GPU

Two jobs run through the wrapper every GPU rule uses (scripts/gpu_job.py: lease, NVML before,
the job, NVML after): `clean_job` allocates 2 GiB on its GPU and exits; `leaky_job` starts a
child that holds 2 GiB and exits without stopping it, the way a forgotten server or dataloader
worker does. The report's own functions then build the GPU-memory table and the problem list
from the two records, as the report and validate rules do. Exit 0 when the leak, and only the
leak, is reported; prints `key = value` lines.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HOLD = "import torch, time; x = torch.ones(2 << 30, dtype=torch.uint8, device='cuda'); "
CLEAN = HOLD + "torch.cuda.synchronize()"
LEAKY = (
    "import subprocess, sys, time; "
    f"subprocess.Popen([sys.executable, '-c', {HOLD + 'time.sleep(300)'!r}]); "
    "time.sleep(8)"  # the child has its 2 GiB by now; the job's main process exits
)


def run_job(rule: str, code: str, out: Path) -> Path:
    record = out / f"{rule}.json"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "gpu_job.py"),
            "--gpus",
            "1",
            "--rule",
            rule,
            "--record",
            str(record),
            "--lock-dir",
            str(out / "locks"),
            "--",
            sys.executable,
            "-c",
            code,
        ],
        check=True,
    )
    return record


def main() -> int:
    from eagle3lib.report import gpu_memory_table, gpu_problems

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, default=Path("/tmp/eagle3-leak-check"))
    out = p.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    records = {
        rule: run_job(rule, code, out)
        for rule, code in [("clean_job", CLEAN), ("leaky_job", LEAKY)]
    }
    table = gpu_memory_table(records)
    problems = gpu_problems(table)
    print(json.dumps(table, indent=2))
    for line in problems:
        print(f"problem: {line}")
    caught = any(line.startswith("leaky_job: GPU") for line in problems)
    clean = not any(line.startswith("clean_job") for line in problems)
    print(f"leak_check.leaky_job_failed_validation = {caught}")
    print(f"leak_check.clean_job_passed_validation = {clean}")
    return 0 if caught and clean else 1


if __name__ == "__main__":
    sys.exit(main())
