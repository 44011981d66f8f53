"""How often the GPU lease wrapper misses a SIGTERM that reaches it while it is frozen.

The preemption test of a two-node training job (tests/test_multinode.py) freezes every
process of the job with SIGSTOP, sends each SIGTERM, then thaws them with SIGCONT. After the
thaw, whichever thread of the wrapper resumes first takes the signal. Each trial here starts
``scripts/gpu_job.py`` of a checkout with ``--log`` (so the wrapper has its output thread)
around ``sleep 30``, waits a second, sends SIGSTOP, SIGTERM and SIGCONT, and counts the
wrapper as having missed the signal if it has not exited 5 s later.

    python3 bench/signal_race.py --trials 20                    # this checkout
    python3 bench/signal_race.py --trials 20 --tree /tmp/old    # e.g. a worktree of e990173

Measured on 2026-12-05 (2-core AMD EPYC): e990173's wrapper (a blocking waitpid) missed it in
13 and 12 of 20 trials (two runs), the polling wait since 75c8657 in 0 of 20 both times
(BENCHMARKS.md). Prints ``signal_race.missed = M`` and ``signal_race.trials = N``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def trial(tree: Path, work: Path, wait: float = 5.0) -> bool:
    """One trial; True if the wrapper exited within ``wait`` seconds of the SIGCONT."""
    proc = subprocess.Popen(
        [
            sys.executable, str(tree / "scripts" / "gpu_job.py"), "--gpus", "0",
            "--rule", "race", "--record", str(work / "race.json"),
            "--lock-dir", str(work / "locks"), "--log", str(work / "race.log"),
            "--", "sleep", "30",
        ],
        env={**os.environ, "PYTHONPATH": str(tree)},
        start_new_session=True,
    )  # fmt: skip
    try:
        time.sleep(1.0)  # the wrapper started its job and its output thread
        for sig in (signal.SIGSTOP, signal.SIGTERM, signal.SIGCONT):
            os.kill(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
            return True
        except subprocess.TimeoutExpired:
            return False
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--tree", type=Path, default=ROOT, help="the checkout to try")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        missed = sum(not trial(args.tree.resolve(), Path(tmp)) for _ in range(args.trials))
    print(f"{args.tree}: {missed} of {args.trials} wrappers did not exit within 5 s")
    print(f"signal_race.missed = {missed}")
    print(f"signal_race.trials = {args.trials}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
