"""The host sampler of bench/smollm2_campaign.sh and bench/host_pace.py, which reads its log:
the pace of each new progress line beside the CPU time stolen and busy over the same interval."""

import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def host_pace():
    spec = importlib.util.spec_from_file_location("host_pace", ROOT / "bench/host_pace.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def progress(step: int, ms: float) -> str:
    return (
        f"train: step {step}/10484 (epoch 1/4), 187,328 tokens/s, 2 min 02 s elapsed, about "
        f"7 min 11 s left; {ms:,.1f} ms a step since the last line"
    )


def line(clock: int, user: int, steal: int, idle: int, train: str, gpu: str = "") -> str:
    # user nice system idle iowait irq softirq steal guest guest_nice
    return f"{clock} cpu  {user} 0 0 {idle} 0 0 0 {steal} 0 0 | 1.00 1.00 1.00 | {gpu} | {train}"


def test_each_new_progress_line_gets_the_hosts_stolen_and_busy_share(host_pace):
    samples = [
        host_pace.parse_line(x)
        for x in (
            line(100, 1000, 10, 5000, ""),  # before training: no pace
            line(110, 1800, 10, 5200, progress(239, 42.1), "1980, 350.12, 45;"),
            line(120, 2500, 110, 5400, progress(239, 42.1)),  # the same line: skipped
            line(130, 3100, 310, 5600, progress(472, 1147.0)),
        )
    ]
    rows = host_pace.intervals(samples)
    assert [(r["seconds"], r["step"], r["ms_per_step"]) for r in rows] == [
        (10, 239, 42.1),
        (30, 472, 1147.0),
    ]
    # 800 user, 0 steal, 200 idle jiffies; then 600 user, 200 steal, 200 idle
    assert rows[0]["steal"] == 0 and rows[0]["busy"] == pytest.approx(0.8)
    assert rows[1]["steal"] == pytest.approx(0.2) and rows[1]["busy"] == pytest.approx(0.6)
    assert rows[0]["sm_mhz"] == 1980 and rows[1]["sm_mhz"] is None


def test_the_report_correlates_pace_with_steal_and_leaves_out_validation_lines(tmp_path):
    log = tmp_path / "host.log"
    lines, user, steal, idle = [], 0, 0, 0
    for i, (ms, stolen) in enumerate([(40, 0), (50, 100), (60, 200), (45, 50), (2000, 0)]):
        user, steal, idle = user + 800, steal + stolen, idle + 200
        lines.append(line(100 + 10 * i, user, steal, idle, progress(100 * (i + 1), ms)))
    log.write_text("\n".join([line(90, 0, 0, 0, "")] + lines) + "\n")
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench/host_pace.py"), str(log)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "host_pace.lines = 4" in out  # the 2,000 ms line spans a validation pass
    assert "host_pace.ms_per_step.range = 40.0-60.0" in out
    assert "host_pace.steal.correlation_with_ms_per_step = +1.00" in out
    assert "host_pace.sm_mhz" not in out  # no GPU readings (a CPU)


def test_a_damaged_line_is_named(tmp_path):
    log = tmp_path / "host.log"
    log.write_text(line(90, 0, 0, 0, "") + "\n1796408371 cpu  16640\n")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench/host_pace.py"), str(log)], capture_output=True, text=True
    )
    assert proc.returncode != 0
    assert f"error: {log} line 2: not a host.log line" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_campaigns_sampler_writes_lines_the_report_reads(tmp_path, host_pace):
    """The sampler of smollm2_campaign.sh's run mode (extracted from the script: run mode starts
    snakemake), a second apart here, until the build's done file appears."""
    script = (ROOT / "bench/smollm2_campaign.sh").read_text()
    start = script.index("host_sample() {")
    function = script[start : script.index("\n}\n", start) + 3]
    (tmp_path / "results/r/logs").mkdir(parents=True)
    (tmp_path / "results/r/logs/train.log").write_text(progress(239, 42.1) + "\n")
    campaign = tmp_path / "campaign"
    campaign.mkdir()
    env = {**os.environ, "HOST_SAMPLE_SECONDS": "0.5"}
    body = f"set -euo pipefail\nC={campaign}\nR=results/r\n{function}\nhost_sample\n"
    proc = subprocess.Popen(["bash", "-c", body], cwd=tmp_path, env=env)
    time.sleep(1.8)
    (campaign / "done").touch()
    assert proc.wait(timeout=10) == 0
    lines = (campaign / "host.log").read_text().splitlines()
    assert len(lines) >= 3
    samples = [host_pace.parse_line(x) for x in lines]
    assert all(s.train == progress(239, 42.1) for s in samples)
    assert samples[-1].cpu["user"] >= samples[0].cpu["user"] > 0
    if shutil.which("nvidia-smi") is None:
        assert all(s.sm_mhz is None for s in samples)
