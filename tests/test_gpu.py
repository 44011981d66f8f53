import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import alive, wait_until

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


def run_job(tmp_path, name, pool, gpus, command, share=1, log=False, sigint=None):
    """A gpu_job wrapper process over a fake device pool (CUDA_VISIBLE_DEVICES); with ``log``
    the job's output goes to ``<name>.log`` (copied by the wrapper's output thread); with
    ``sigint`` the wrapper starts with that SIGINT disposition."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": pool, "PYTHONPATH": str(ROOT)}
    logging = ["--log", str(tmp_path / f"{name}.log")] if log else []
    return subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "scripts" / "gpu_job.py"),
            "--gpus",
            str(gpus),
            "--share",
            str(share),
            "--rule",
            name,
            "--record",
            str(tmp_path / f"{name}.json"),
            "--lock-dir",
            str(tmp_path / "locks"),
            *logging,
            "--",
            *command,
        ],
        env=env,
        preexec_fn=None if sigint is None else lambda: signal.signal(signal.SIGINT, sigint),
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


def spans(log: Path) -> dict[tuple[str, str], list[float]]:
    """{(job, what): [start, end]} from lines "<job> <what> start|end <time>"."""
    out: dict[tuple[str, str], list[float]] = {}
    for line in log.read_text().splitlines():
        job, what, kind, t = line.split()
        out.setdefault((job, what), [0.0, 0.0])[kind == "end"] = float(t)
    return out


def overlap(a: list[float], b: list[float]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def sharing_script(log: Path) -> str:
    """A sharing job: marks when it holds the device and its turn, in <log>."""
    mark = (
        f"lambda what, kind: open({str(log)!r}, 'a').write("
        "f'{sys.argv[1]} {what} {kind} {time.time()}\\n')"
    )
    return (
        f"import sys, time; from eagle3lib import gpu; m = {mark}; m('held', 'start'); "
        "time.sleep(0.3)\nwith gpu.turn():\n    m('turn', 'start'); time.sleep(1.5); "
        "m('turn', 'end')\nm('held', 'end')"
    )


def test_jobs_sharing_a_gpu_hold_it_two_at_a_time_and_take_turns(tmp_path):
    """One fake device, three jobs that share it by 2 (extract.jobs_per_gpu) and one exclusive
    job: at most two sharing jobs hold the device at once, the second loads while the first
    has its turn, turns never overlap, and the exclusive job runs only when no sharing job
    holds the device."""
    log = tmp_path / "log"
    mark = f"lambda what, kind: open({str(log)!r}, 'a').write(f'{{sys.argv[1]}} {{what}} {{kind}} {{time.time()}}\\n')"
    exclusive = (
        f"import sys, time; m = {mark}; m('held', 'start'); time.sleep(0.3); m('held', 'end')"
    )
    script = sharing_script(log)
    procs = [
        run_job(tmp_path, f"s{i}", "0", 1, [sys.executable, "-c", script, f"s{i}"], share=2)
        for i in range(3)
    ]
    time.sleep(0.2)
    procs.append(run_job(tmp_path, "x", "0", 1, [sys.executable, "-c", exclusive, "x"]))
    assert [p.wait(timeout=60) for p in procs] == [0, 0, 0, 0]
    got = spans(log)
    held = [got[(f"s{i}", "held")] for i in range(3)]
    turns = [got[(f"s{i}", "turn")] for i in range(3)]
    assert not any(overlap(a, b) for i, a in enumerate(turns) for b in turns[i + 1 :]), turns
    for i, h in enumerate(held):  # never three holders at once
        others = [o for j, o in enumerate(held) if j != i and overlap(h, o)]
        assert not (len(others) == 2 and overlap(*others)), held
    first, second = sorted(held)[:2]
    first_turn = min(turns)
    assert second[0] < first_turn[1]  # the second held the device during the first one's turn
    assert not any(overlap(got[("x", "held")], h) for h in held), (got[("x", "held")], held)
    record = json.loads((tmp_path / "s0.json").read_text())
    assert record["shared_by"] == 2 and record["devices"] == [0] and record["leaks"] == []
    assert json.loads((tmp_path / "x.json").read_text())["shared_by"] == 1


def test_sharing_jobs_spread_over_the_gpus_before_they_share_one(tmp_path):
    log = tmp_path / "log"
    script = sharing_script(log)
    procs = [
        run_job(tmp_path, f"s{i}", "0,1", 1, [sys.executable, "-c", script, f"s{i}"], share=2)
        for i in range(2)
    ]
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    devices = [json.loads((tmp_path / f"s{i}.json").read_text())["devices"] for i in range(2)]
    assert sorted(devices) == [[0], [1]], devices
    got = spans(log)  # on two devices, their turns did not wait for each other
    assert overlap(got[("s0", "turn")], got[("s1", "turn")])


def test_the_workflow_names_the_rule_whose_jobs_share_their_gpus():
    env = {gpu.GPU_SHARING_ENV: gpu.sharing_setting("extract", 2, 3)}
    assert gpu.shared_lease("extract", env) == (2, 3)
    assert gpu.shared_lease("train", env) is None and gpu.shared_lease("extract", {}) is None


def test_a_job_not_started_to_share_takes_no_turn(tmp_path):
    """Without EAGLE3_GPU_TURN (a CPU job, an exclusive lease) turn() waits for nothing, even
    while another holds the turn lock."""
    import fcntl

    lock = tmp_path / "host-gpu0.turn.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with gpu.turn({}) as waited:
            assert waited < 0.01
    finally:
        os.close(fd)
    other = os.open(lock, os.O_RDWR)
    try:
        with gpu.turn({gpu.TURN_ENV: str(lock)}) as waited:  # free again: no wait
            assert waited < 1.0
            with pytest.raises(BlockingIOError):  # the turn is held while in the block
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # and given back after it
    finally:
        os.close(other)


def test_a_shared_jobs_record_names_no_leak_from_the_other_jobs_memory():
    def reading(used):
        return {"available": True, "devices": [{"index": 0, "used_mib": used, "pids": []}]}

    assert gpu.job_leaks(reading(500.0), reading(17000.0), shared_by=2) == []
    assert gpu.job_leaks(reading(500.0), reading(17000.0)) == [
        "GPU 0: 16500 MiB left behind (pids [])"
    ]


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


@pytest.mark.parametrize("log", [False, True], ids=["output-inherited", "output-to-log"])
def test_job_that_leaves_a_process_behind_is_recorded_and_stopped(tmp_path, log):
    """The process left behind holds the job's output: with a log, the wrapper's copy of it
    must not wait for that process's end (60 s) before stopping it."""
    pidfile = tmp_path / "pid"
    child = f"import subprocess, sys; p = subprocess.Popen(['sleep', '60']); open({str(pidfile)!r}, 'w').write(str(p.pid))"
    p = run_job(tmp_path, "leaky", "0", 1, [sys.executable, "-c", child], log=log)
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


def threads_of(pid: int) -> list[int]:
    return sorted(int(t.name) for t in Path(f"/proc/{pid}/task").iterdir())


@pytest.mark.slow
def test_sigterm_taken_by_the_wrappers_output_thread_still_stops_the_job(tmp_path):
    """A signal sent to a process goes to any one of its threads: when the job's output
    thread takes SIGTERM (here sent to that thread alone, tgkill), the wrapper must still stop
    the job and exit. It once waited for the job instead, its main thread blocked in waitpid:
    the intermittent hang of a preempted multi-node training job. The job here notes each
    SIGTERM and carries on (as a process blocked in a collective does for a while); a second
    SIGTERM then reaches the wrapper while it stops the job: the stop still ends in SIGKILL,
    30 s on. A second SIGINT (Ctrl-C twice) is held back the same way."""
    import ctypes

    noted = tmp_path / "sigterm"
    job = [
        sys.executable, "-c",
        "import signal, time\n"
        f"signal.signal(signal.SIGTERM, lambda *a: open({str(noted)!r}, 'a').write('x'))\n"
        "print('started', flush=True)\n"
        "while True: time.sleep(0.05)\n",
    ]  # fmt: skip
    # Ctrl-C's default handling in the wrapper, as under a terminal, whatever this run has
    p = run_job(tmp_path, "stopped", "0", 0, job, log=True, sigint=signal.SIG_DFL)
    try:
        log = tmp_path / "stopped.log"
        assert wait_until(lambda: log.exists() and "started" in log.read_text(), 30)
        helpers = [t for t in threads_of(p.pid) if t != p.pid]
        assert len(helpers) == 1, helpers  # the output thread
        children = Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()
        (job_pid,) = map(int, children)
        t0 = time.monotonic()
        assert ctypes.CDLL(None).tgkill(p.pid, helpers[0], signal.SIGTERM) == 0
        assert wait_until(noted.exists, 5), "the wrapper did not pass SIGTERM on to the job"
        os.kill(p.pid, signal.SIGTERM)  # the second one
        os.kill(p.pid, signal.SIGINT)
        time.sleep(1)
        assert p.poll() is None and alive(job_pid), "the stop was cut short"
        # the Ctrl-C delivered once the stop is done: Python ends by SIGINT
        assert p.wait(timeout=45) == -signal.SIGINT
        assert 29 < time.monotonic() - t0 < 45  # the grace, then SIGKILL
        assert wait_until(lambda: not alive(job_pid), 10), "the job outlived its wrapper"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
