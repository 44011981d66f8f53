import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eagle3lib import gpu

ROOT = Path(__file__).resolve().parents[1]


def test_no_nvidia_device_is_reported_honestly():
    snap = gpu.nvml_snapshot()
    if snap["available"]:
        pytest.skip("this machine has an NVIDIA device")
    assert snap["reason"].startswith("no NVIDIA device")
    assert "devices" not in snap  # never a fake zero reading


def test_leaked_memory_is_named_per_device():
    before = {
        "available": True,
        "devices": [
            {"index": 0, "used_mib": 500.0, "pids": []},
            {"index": 1, "used_mib": 0.0, "pids": []},
        ],
    }
    after = {
        "available": True,
        "devices": [
            {"index": 0, "used_mib": 600.0, "pids": []},
            {"index": 1, "used_mib": 9000.0, "pids": [42]},
        ],
    }
    assert gpu.leaked(before, after) == ["GPU 1: 9000 MiB left behind (pids [42])"]
    assert gpu.leaked({"available": False}, {"available": False}) == []


def test_reading_after_a_job_waits_for_the_driver_to_free_memory(monkeypatch):
    """NVML itself is absent here: the readings are scripted (used MiB per call)."""

    def reading(used):
        return {"available": True, "devices": [{"index": 0, "used_mib": used, "pids": []}]}

    before = reading(500.0)
    readings = iter([9000.0, 9000.0, 510.0, 9000.0])
    monkeypatch.setattr(gpu, "nvml_snapshot", lambda _devices: reading(next(readings)))
    assert gpu.settled_snapshot([0], before, wait=5, poll=0.01) == reading(510.0)
    readings = iter([9000.0] * 1000)
    t0 = time.monotonic()
    after = gpu.settled_snapshot([0], before, wait=0.2, poll=0.01)
    assert after == reading(9000.0) and 0.2 <= time.monotonic() - t0 < 2  # a real leak stays


def run_job(tmp_path, name, pool, gpus, command):
    """A gpu_job wrapper process over a fake device pool (CUDA_VISIBLE_DEVICES)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": pool}
    return subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "scripts" / "gpu_job.py"),
            "--gpus",
            str(gpus),
            "--rule",
            name,
            "--record",
            str(tmp_path / f"{name}.json"),
            "--lock-dir",
            str(tmp_path / "locks"),
            "--",
            *command,
        ],
        env=env,
    )


def test_lease_sets_cuda_visible_devices_and_never_shares_a_device(tmp_path):
    """Fake pool of 2 devices, 4 jobs of 1 GPU each: at most 2 at a time, never on one device."""
    log = tmp_path / "log"
    script = (
        "import os, time, sys; d = os.environ['CUDA_VISIBLE_DEVICES']; "
        f"open({str(log)!r}, 'a').write(f'{{d}} {{time.time()}} start\\n'); time.sleep(0.6); "
        f"open({str(log)!r}, 'a').write(f'{{d}} {{time.time()}} end\\n')"
    )
    procs = [
        run_job(tmp_path, f"job{i}", "0,1", 1, [sys.executable, "-c", script]) for i in range(4)
    ]
    assert [p.wait(timeout=60) for p in procs] == [0, 0, 0, 0]
    events = [line.split() for line in log.read_text().splitlines()]
    assert {d for d, _, _ in events} <= {"0", "1"}
    for dev in ("0", "1"):
        spans = []
        for d, t, kind in events:
            if d == dev and kind == "start":
                spans.append([float(t), None])
            elif d == dev:
                spans[-1][1] = float(t)
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False)), spans
    record = json.loads((tmp_path / "job0.json").read_text())
    assert record["rule"] == "job0" and record["gpus_requested"] == 1
    assert len(record["devices"]) == 1 and record["stray_processes"] is False


def test_two_gpu_job_gets_both_devices(tmp_path):
    out = tmp_path / "cvd"
    p = run_job(
        tmp_path,
        "pair",
        "0,1",
        2,
        [
            sys.executable,
            "-c",
            f"import os; open({str(out)!r}, 'w').write(os.environ['CUDA_VISIBLE_DEVICES'])",
        ],
    )
    assert p.wait(timeout=30) == 0
    assert out.read_text() == "0,1"


def test_cpu_job_sees_no_gpu_and_failure_writes_no_record(tmp_path):
    out = tmp_path / "cvd"
    p = run_job(
        tmp_path,
        "cpu",
        "0,1",
        0,
        [
            sys.executable,
            "-c",
            f"import os; open({str(out)!r}, 'w').write(os.environ['CUDA_VISIBLE_DEVICES'])",
        ],
    )
    assert p.wait(timeout=30) == 0
    assert out.read_text() == ""  # a CPU job must not touch the machine's GPUs
    p = run_job(tmp_path, "fails", "0", 0, [sys.executable, "-c", "raise SystemExit(3)"])
    assert p.wait(timeout=30) == 3
    assert not (tmp_path / "fails.json").exists()


def test_job_that_leaves_a_process_behind_is_recorded_and_stopped(tmp_path):
    pidfile = tmp_path / "pid"
    child = f"import subprocess, sys; p = subprocess.Popen(['sleep', '60']); open({str(pidfile)!r}, 'w').write(str(p.pid))"
    p = run_job(tmp_path, "leaky", "0", 1, [sys.executable, "-c", child])
    assert p.wait(timeout=30) == 0
    record = json.loads((tmp_path / "leaky.json").read_text())
    assert record["stray_processes"] is True
    pid = int(pidfile.read_text())
    for _ in range(50):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("stray process still running")


def test_job_output_goes_to_its_log_and_matching_lines_to_the_terminal(tmp_path, capfd):
    code = "import sys; print('loading'); print('\\rbar train: step 3/9, 12 tokens/s'); sys.stderr.write('oops\\n')"
    rc = gpu.main(
        ["run", "--record", str(tmp_path / "r.json"), "--rule", "t",
         "--lock-dir", str(tmp_path / "locks"), "--log", str(tmp_path / "job.log"),
         "--echo", "train: step .*", "--", sys.executable, "-c", code]
    )  # fmt: skip
    assert rc == 0
    log = (tmp_path / "job.log").read_text()
    assert "loading\n" in log and "train: step 3/9" in log and "oops\n" in log
    err = capfd.readouterr().err
    assert err.splitlines() == ["train: step 3/9, 12 tokens/s"]
