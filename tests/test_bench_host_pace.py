"""The host sampler of bench/smollm2_campaign.sh and bench/host_pace.py, which reads its log:
the pace of each progress line beside the CPU time stolen and busy over the span it covers."""

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


@pytest.fixture(scope="module")
def host_pace():
    spec = importlib.util.spec_from_file_location("host_pace", ROOT / "bench/host_pace.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def progress(step: int, ms: float, epoch: int = 1) -> str:
    return (
        f"train: step {step}/10484 (epoch {epoch}/4), 187,328 tokens/s, 2 min 02 s elapsed, "
        f"about 7 min 11 s left; {ms:,.1f} ms a step since the last line"
    )


FIRST_STEP = (
    "train: step 1/10484 (epoch 1/4), first step in 1 min 52 s (0 s of it waiting for its "
    "batch, the rest set-up, any compilation and the step); pace from the next steps"
)


def line(clock: float, jiffies: dict[str, int], train: str, gpu: str = "") -> str:
    cpu = " ".join(str(jiffies[k]) for k in FIELDS)
    return f"{clock:.0f} cpu  {cpu} 0 0 | 1.00 1.00 1.00 | {gpu} | {train}"


class Host:
    """/proc/stat's cpu counters, advanced by each interval's jiffies."""

    def __init__(self):
        self.jiffies = dict.fromkeys(FIELDS, 100)

    def advance(self, **delta: int) -> dict[str, int]:
        for key, value in delta.items():
            self.jiffies[key] += value
        return dict(self.jiffies)


def test_each_progress_line_gets_the_host_over_the_span_its_pace_covers(host_pace):
    host = Host()
    # every field distinct, so that a share counting the wrong ones differs
    step = {"user": 500, "nice": 7, "system": 90, "idle": 200, "iowait": 40, "irq": 3,
            "softirq": 11}  # fmt: skip
    samples = [
        host_pace.parse_line(x)
        for x in (
            line(100, host.advance(), ""),  # before training
            line(102, host.advance(**step, steal=0), FIRST_STEP),
            line(104, host.advance(**step, steal=100), FIRST_STEP),
            line(106, host.advance(**step, steal=149), progress(239, 42.1), "1980, 350.1, 45;"),
            line(108, host.advance(**step, steal=0), progress(239, 42.1), "1900, 300, 55;"),
            line(110, host.advance(**step, steal=50), progress(472, 43.0), "2000, 400.5, 66;"),
            line(112, host.advance(**step, steal=0), progress(480, 1147.0, epoch=2)),
            line(114, host.advance(**step, steal=0), progress(700, 57.5, epoch=2), "[N/A], 1, 2;"),
        )
    ]
    rows = host_pace.intervals(samples)
    # the first line's span: from the first-step line (sample 1) to it (sample 3); the epoch's
    # first line spans the validation pass and is left out
    assert [(r["seconds"], r["step"], r["ms_per_step"]) for r in rows] == [
        (6, 239, 42.1),
        (10, 472, 43.0),
        (14, 700, 57.5),
    ]
    per_sample = sum(step.values())  # 851 jiffies, plus the steal
    assert rows[0]["steal"] == pytest.approx(249 / (2 * per_sample + 249))
    assert rows[1]["steal"] == pytest.approx(50 / (2 * per_sample + 50))
    assert rows[2]["steal"] == 0
    busy = 500 + 7 + 90 + 3 + 11  # user nice system irq softirq: not idle, iowait or steal
    assert rows[2]["busy"] == pytest.approx(busy / per_sample)
    # the GPU's readings: the mean of the span's samples that have them
    assert (rows[0]["sm_mhz"], rows[0]["gpu_watts"], rows[0]["gpu_busy"]) == (1980, 350.1, 45)
    assert (rows[1]["sm_mhz"], rows[1]["gpu_watts"], rows[1]["gpu_busy"]) == (1950, 350.25, 60.5)
    assert rows[2]["sm_mhz"] is None  # nvidia-smi's [N/A] (and no reading in the span's other)
    assert (rows[2]["gpu_watts"], rows[2]["gpu_busy"]) == (1, 2)
    other = host_pace.parse_line(line(116, host.advance(), "", "No devices were found;"))
    assert other.gpus == ((None, None, None),)


def write_log(path: Path, paces: list[float], steals: list[int]) -> None:
    host = Host()
    lines = [line(100, host.advance(), FIRST_STEP)]
    for i, (ms, stolen) in enumerate(zip(paces, steals, strict=True)):
        jiffies = host.advance(user=800, idle=200, steal=stolen)
        lines.append(line(110 + 10 * i, jiffies, progress(100 * (i + 1), ms)))
    path.write_text("\n".join(lines) + "\n")


def report(log: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "bench/host_pace.py"), str(log), *args],
        capture_output=True, text=True,
    )  # fmt: skip


@pytest.mark.parametrize(("steals", "sign"), [([0, 100, 200, 50], "+"), ([200, 100, 0, 150], "-")])
def test_the_report_correlates_pace_with_steal(tmp_path, steals, sign):
    log = tmp_path / "host.log"
    write_log(log, [40, 50, 60, 45, 2000], [*steals, 0])
    out = report(log).stdout
    assert "host_pace.lines = 4" in out  # the 2,000 ms line: a stall beyond --max-ms
    assert "host_pace.ms_per_step.range = 40.0-60.0" in out
    correlation = out.split("host_pace.steal.correlation_with_ms_per_step = ")[1].split()[0]
    assert correlation.startswith(sign) and abs(float(correlation)) > 0.9
    assert "host_pace.sm_mhz" not in out  # no GPU readings (a CPU)


def test_a_damaged_last_line_is_left_out_and_any_other_is_an_error(tmp_path):
    log = tmp_path / "host.log"
    write_log(log, [40, 50, 60], [0, 10, 20])
    whole = log.read_text()
    log.write_text(whole + "1796408371 cpu  16640")  # archived while being written
    proc = report(log)
    assert proc.returncode == 0 and "host_pace.lines = 3" in proc.stdout
    assert f"warning: {log} line 5 left out: not a host.log line" in proc.stderr
    lines = whole.splitlines()
    log.write_text("\n".join([lines[0], "1796408371 cpu  16640", *lines[1:]]) + "\n")
    proc = report(log)
    assert proc.returncode != 0
    assert f"error: {log} line 2: not a host.log line" in proc.stderr
    proc = report(tmp_path / "missing.log")
    assert proc.returncode != 0 and f"error: {tmp_path / 'missing.log'}: " in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_campaigns_sampler_writes_lines_the_report_reads(tmp_path, host_pace):
    """The sampler of smollm2_campaign.sh's run mode (extracted from the script: run mode starts
    snakemake), samples a fraction of a second apart, until the build's done file appears."""
    script = (ROOT / "bench/smollm2_campaign.sh").read_text()
    start = script.index("host_sample() {")
    function = script[start : script.index("\n}\n", start) + 3]
    (tmp_path / "results/r/logs").mkdir(parents=True)
    (tmp_path / "results/r/logs/train.log").write_text(progress(239, 42.1) + "\n")
    campaign = tmp_path / "campaign"
    campaign.mkdir()
    env = {**os.environ, "HOST_SAMPLE_SECONDS": "0.2"}
    body = f"set -euo pipefail\nC={campaign}\nR=results/r\n{function}\nhost_sample\n"
    proc = subprocess.Popen(["bash", "-c", body], cwd=tmp_path, env=env)
    log = campaign / "host.log"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (
            not log.exists() or len(log.read_text().splitlines()) < 3
        ):
            time.sleep(0.1)
        (campaign / "done").touch()
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
    samples = [host_pace.parse_line(x) for x in log.read_text().splitlines()]
    assert len(samples) >= 3
    assert all(s.train == progress(239, 42.1) for s in samples)
    assert samples[-1].cpu["user"] >= samples[0].cpu["user"] > 0
    assert samples[-1].clock >= samples[0].clock > 1.7e9
