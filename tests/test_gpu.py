import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import slurm_stub
from conftest import alive, wait_until

from eagle3lib import gpu, report

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


def test_a_helper_ending_just_after_the_job_is_no_straggler(tmp_path):
    """A process of the job's group that ends on its own a moment after the job (as
    multiprocessing's resource tracker does once the process that started it has exited:
    a train job with DataLoader workers was flagged for it) is not recorded as left behind."""
    child = "import subprocess; subprocess.Popen(['sleep', '0.5'])"
    p = run_job(tmp_path, "helper", "0", 1, [sys.executable, "-c", child])
    assert p.wait(timeout=30) == 0
    assert json.loads((tmp_path / "helper.json").read_text())["stray_processes"] is False


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


# Catches: a job asking for more GPUs than it sees failing without naming its config key (the
# user's fix), or after the job started; the key of extract jobs (gpus_per_job)
@pytest.mark.parametrize(
    ("rule", "visible", "pool", "key"),
    [("train", "", [], "train.gpus"), ("extract", "0", [0], "extract.gpus_per_job")],
)
def test_a_job_needing_more_gpus_than_it_sees_names_its_setting(
    tmp_path, capfd, monkeypatch, rule, visible, pool, key
):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    rc = gpu.main(
        ["run", "--gpus", "2", "--rule", rule, "--record", str(tmp_path / "r.json"),
         "--lock-dir", str(tmp_path / "locks"), "--", "touch", str(tmp_path / "ran")]
    )  # fmt: skip
    assert rc == 1 and not (tmp_path / "ran").exists() and not (tmp_path / "r.json").exists()
    assert capfd.readouterr().err == (
        f"error: the {rule} job needs 2 GPU(s), and {len(pool)} are visible to it {pool}: set "
        f"{key} to at most {len(pool)} (0 runs the job on the CPU), or run it where it sees "
        "that many\n"
    )


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


HOST = socket.gethostname()
MIB = 2**20


# ---- a stand-in for NVML ----------------------------------------------------------------------


class FakeNVML(types.ModuleType):
    """A fake ``pynvml`` module (no NVIDIA driver on the test machine): devices whose used
    memory is scripted, one ``{index: used MiB}`` reading per NVML session (nvmlInit), the
    last one repeating; ``pids`` per device; names as bytes (as older pynvml returns them)."""

    class NVMLError(Exception):
        pass

    def __init__(self, readings, pids=None, total_mib=81559.0, init_error=None, uuids=None):
        super().__init__("pynvml")
        self.readings = list(readings)
        self.uuids = uuids or {}  # {index: "GPU-..."}
        self.pids = pids or {}
        self.total_mib = total_mib
        self.init_error = init_error
        self.sessions = 0  # nvmlInit calls that succeeded
        self.open = 0  # sessions not shut down
        self.current = {}

    def nvmlInit(self):
        if self.init_error:
            raise self.NVMLError(self.init_error)
        self.current = self.readings[min(self.sessions, len(self.readings) - 1)]
        self.sessions += 1
        self.open += 1

    def nvmlShutdown(self):
        self.open -= 1

    def nvmlDeviceGetCount(self):
        return len(self.current)

    def nvmlDeviceGetHandleByIndex(self, i):
        if i not in self.current:
            raise self.NVMLError("Invalid Argument")
        return i

    def nvmlDeviceGetMemoryInfo(self, handle):
        used = int(self.current[handle] * MIB)
        total = int(self.total_mib * MIB)
        return types.SimpleNamespace(used=used, total=total, free=total - used)

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        return [types.SimpleNamespace(pid=p, usedGpuMemory=None) for p in self.pids.get(handle, [])]

    def nvmlDeviceGetName(self, handle):
        return b"NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetUUID(self, handle):
        return self.uuids[handle].encode()  # (bytes, as older pynvml returns them)


@pytest.fixture
def fake_nvml(monkeypatch):
    """Install a FakeNVML as ``pynvml`` (nvml_snapshot imports it when called)."""

    def install(*readings, **kwargs) -> FakeNVML:
        fake = FakeNVML(readings, **kwargs)
        monkeypatch.setitem(sys.modules, "pynvml", fake)
        return fake

    return install


def reading(used: dict[int, float], pids=None) -> dict:
    """The devices part of an NVML reading: {index: used MiB}."""
    return {
        "available": True,
        "devices": [
            {"index": i, "used_mib": mib, "pids": (pids or {}).get(i, [])}
            for i, mib in used.items()
        ],
    }


@contextlib.contextmanager
def within(seconds: float):
    """Fail (instead of hanging) if the block takes longer: SIGALRM interrupts a blocking
    flock in the main thread."""

    def expired(*_):
        raise TimeoutError(f"took longer than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def probe_free(path: Path) -> bool:
    """Whether another job could take ``path``'s lock exclusively now (a lock of its own open
    file description: it contends with this process's other descriptors too)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # (also drops the probe's lock)


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


# ---- NVML readings -----------------------------------------------------------------------------


# Catches: indices ignored, KiB instead of MiB, pids unsorted, no nvmlShutdown, name not decoded,
# device_count = devices read
def test_nvml_reading_of_the_leased_devices_only(fake_nvml):
    """NVML is a fake here (FakeNVML): 3 devices, the reading asked for device 1 only."""
    nvml = fake_nvml({0: 1000.0, 1: 2048.5, 2: 0.0}, pids={1: [30, 7]})
    snap = gpu.nvml_snapshot([1])
    assert snap["available"] is True and snap["device_count"] == 3
    assert snap["devices"] == [
        {"index": 1, "name": "NVIDIA H100 80GB HBM3", "used_mib": 2048.5,
         "total_mib": 81559.0, "pids": [7, 30]}
    ]  # fmt: skip
    assert [d["index"] for d in gpu.nvml_snapshot()["devices"]] == [0, 1, 2]
    with pytest.raises(nvml.NVMLError):  # a device NVML does not know
        gpu.nvml_snapshot([5])
    assert nvml.sessions == 3 and nvml.open == 0  # every session shut down, even on an error


# Catches: ImportError reason text; NVMLError reason text, also caught today where the driver is
# missing
def test_no_nvml_is_a_reading_that_says_why(fake_nvml, monkeypatch):
    """pynvml absent (sys.modules entry None: the import fails) or its init failing (fake)."""
    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert gpu.nvml_snapshot() == {
        "available": False,
        "reason": "no NVIDIA device: nvidia-ml-py is not installed",
    }
    fake_nvml({0: 0.0}, init_error="Driver Not Loaded")
    assert gpu.nvml_snapshot([0]) == {
        "available": False,
        "reason": "no NVIDIA device: Driver Not Loaded",
    }


# Catches: empty CUDA_VISIBLE_DEVICES = unset: all NVML devices, non-numeric ids crash the wrapper
def test_device_pool_is_cuda_visible_devices_or_every_nvml_device(fake_nvml, monkeypatch):
    """NVML is a fake with 3 devices."""
    fake_nvml({0: 0.0, 1: 0.0, 2: 0.0})
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpu.device_pool() == [0, 1, 2]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU visible: none to lease
    assert gpu.device_pool() == []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 0")  # in its order
    assert gpu.device_pool() == [2, 0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,-1,0")  # CUDA reads up to the first bad entry
    assert gpu.device_pool() == [2]


UUIDS = {
    0: "GPU-8e1c4d2a-1111-2222-3333-444455556666",
    1: "GPU-8e1c9f00-aaaa-bbbb-cccc-ddddeeeeffff",
    2: "GPU-03b7e6c1-0000-1111-2222-333344445555",
}


def test_gpus_named_by_uuid_are_leased_by_their_nvml_index(fake_nvml, monkeypatch):
    """NVML is a fake with 3 devices and their UUIDs; CUDA takes a UUID whole or a prefix of
    one GPU's."""
    fake_nvml({0: 0.0, 1: 0.0, 2: 0.0}, uuids=UUIDS)
    assert gpu.visible_devices(f"{UUIDS[2]},GPU-8e1c9") == [2, 1]
    assert gpu.visible_devices(f"1,{UUIDS[0]}") == [1, 0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-03b7")
    assert gpu.device_pool() == [2]


@pytest.mark.parametrize(
    ("visible", "message"),
    [
        ("GPU-8e1c", "CUDA_VISIBLE_DEVICES names GPU-8e1c, and 2 GPUs' UUIDs on this host"),
        ("0,GPU-ffff", "CUDA_VISIBLE_DEVICES names GPU-ffff, and no GPU's UUID on this host"),
        ("MIG-5c2d1a3e-aaaa", "CUDA_VISIBLE_DEVICES names a MIG instance (MIG-5c2d1a3e-aaaa): "
         "GPU jobs lease whole GPUs; name GPUs by index or UUID"),
    ],
)  # fmt: skip
def test_devices_a_lease_cannot_take_stop_the_wrapper_with_one_line(
    fake_nvml, monkeypatch, visible, message
):
    """NVML is a fake with 3 devices and their UUIDs."""
    fake_nvml({0: 0.0, 1: 0.0, 2: 0.0}, uuids=UUIDS)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    with pytest.raises(SystemExit) as stop:
        gpu.device_pool()
    assert str(stop.value).startswith(f"error: {message}")
    assert "\n" not in str(stop.value)
    if "UUID on" in message or "UUIDs on" in message:
        assert str(stop.value).endswith(f"({', '.join(UUIDS.values())}); fix CUDA_VISIBLE_DEVICES")


def test_gpus_by_uuid_without_nvml_ask_for_indices(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # nvidia-ml-py not installed
    with pytest.raises(gpu.VisibleDevicesError, match=r"names GPUs by UUID \(GPU-8e1c\) and "
                       r"NVML cannot be read to find them \(.+\); name GPUs by index"):  # fmt: skip
        gpu.visible_devices("GPU-8e1c")
    assert gpu.visible_devices("3,1") == [3, 1]  # indices need no NVML


# ---- leak verdicts -----------------------------------------------------------------------------


# Catches: > threshold becomes >=, threshold 512, a reading lost after the job: `and` instead of
# `or` raises KeyError
def test_leak_threshold_and_readings_lost_after_the_job():
    before = reading({0: 1000.0, 1: 1000.0, 2: 1000.0})
    after = reading({0: 1000.0 + 256, 1: 1000.0 + 256.5, 2: 1000.0 + 300})
    assert gpu.LEAK_THRESHOLD_MIB == 256
    assert gpu.leaked(before, after) == [
        "GPU 1: 256 MiB left behind (pids [])",  # (rounded: 256.5 MiB grew, over 256)
        "GPU 2: 300 MiB left behind (pids [])",
    ]
    lost = {"available": False, "reason": "no NVIDIA device: GPU is lost"}
    assert gpu.leaked(before, lost) == [] and gpu.leaked(lost, after) == []


# ---- locks and leases --------------------------------------------------------------------------


# Catches: no per-allocation folder, relative lock folder, no host in the lock name, kind ignored:
# the turn/slot locks would be the device lock itself
def test_lock_files_are_per_allocation_and_per_host(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    folder = gpu.lock_folder(Path("locks"))
    assert folder == (tmp_path / "locks" / "slurm-77").resolve() and folder.is_dir()
    assert folder.is_absolute()
    assert gpu.device_lock(folder, 2) == folder / f"{HOST}-gpu2.lock"
    assert gpu.device_lock(folder, 2, "turn") == folder / f"{HOST}-gpu2.turn.lock"
    assert gpu.device_lock(folder, 2, "slot1") == folder / f"{HOST}-gpu2.slot1.lock"
    monkeypatch.delenv("SLURM_JOB_ID")
    assert gpu.lock_folder(Path("locks")) == (tmp_path / "locks").resolve()


# Catches: blocking flock: waits for the busy device instead of taking the free one, locks not
# released when the lease ends, devices not sorted
def test_a_lease_skips_a_busy_device_and_releases_its_locks(tmp_path):
    folder = gpu.lock_folder(tmp_path / "locks")
    busy = gpu._try_lock(gpu.device_lock(folder, 0))  # another job holds device 0
    try:
        with within(5), gpu.lease(1, [0, 1], tmp_path / "locks", poll=0.01) as devices:
            assert devices == [1]
            assert not probe_free(gpu.device_lock(folder, 1))
    finally:
        os.close(busy)
    assert probe_free(gpu.device_lock(folder, 1))  # given back
    with gpu.lease(2, [1, 0], tmp_path / "locks") as devices:
        assert devices == [0, 1]
    assert probe_free(gpu.device_lock(folder, 0)) and probe_free(gpu.device_lock(folder, 1))


# Catches: no pool-size check (waits for ever); its message changed
def test_a_lease_larger_than_the_pool_fails_at_once(tmp_path):
    with within(5), pytest.raises(SystemExit) as failed, gpu.lease(3, [0, 1], tmp_path / "locks"):
        pass
    assert str(failed.value) == "error: job needs 3 GPU(s), the pool has 2 ([0, 1])"
    with gpu.lease(2, [0, 1], tmp_path / "locks") as devices:
        assert devices == [0, 1]


# Catches: a partial set kept while waiting: deadlocks multi-GPU jobs, the busy lock's descriptor
# leaked each poll, no sleep between polls: a busy loop
def test_a_waiting_lease_holds_no_device_between_polls(tmp_path, monkeypatch):
    """Device 1 is busy: a 2-GPU lease must give device 0 back before it waits (the wait is
    stopped at its first poll)."""
    folder = gpu.lock_folder(tmp_path / "locks")
    busy = gpu._try_lock(gpu.device_lock(folder, 1))
    baseline = fd_count()
    polls = []

    class FirstPoll(Exception):
        pass

    def first_poll(seconds):
        polls.append((seconds, probe_free(gpu.device_lock(folder, 0)), fd_count()))
        raise FirstPoll

    monkeypatch.setattr(gpu.time, "sleep", first_poll)
    try:
        with (
            within(5),
            pytest.raises(FirstPoll),
            gpu.lease(2, [0, 1], tmp_path / "locks", poll=0.25),
        ):
            pass
    finally:
        os.close(busy)
    assert polls == [(0.25, True, baseline)]


# Catches: a sharing job whose slot is taken keeps the device's shared lock: an exclusive job cannot
# have the device while it waits
def test_a_sharing_job_that_finds_no_free_slot_holds_nothing(tmp_path, monkeypatch):
    folder = gpu.lock_folder(tmp_path / "locks")
    slots = [gpu._try_lock(gpu.device_lock(folder, 0, f"slot{k}")) for k in range(2)]
    baseline = fd_count()
    with within(5):
        assert gpu._hold(folder, 0, 2, 0) is None and gpu._hold(folder, 0, 2, 1) is None
    assert probe_free(gpu.device_lock(folder, 0)) and fd_count() == baseline
    os.close(slots[1])
    fds = gpu._hold(folder, 0, 2, 1)
    assert fds is not None and not probe_free(gpu.device_lock(folder, 0, "slot1"))
    for fd in [*fds, slots[0]]:
        os.close(fd)


# ---- turns -------------------------------------------------------------------------------------


# Catches: turn locks not taken in sorted order: crosswise waits, locks split on ',' instead of
# os.pathsep, wait not measured, no "waiting" line
def test_turns_take_every_lock_in_order_and_time_the_wait(tmp_path, capsys):
    """A job sharing two devices names their turn locks (out of order here); device 0's turn
    is busy: the job says so and waits for it before it takes device 1's."""
    first, second = tmp_path / "h-gpu0.turn.lock", tmp_path / "h-gpu1.turn.lock"
    env = {gpu.TURN_ENV: os.pathsep.join([str(second), str(first)])}
    holder = os.open(first, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(holder, fcntl.LOCK_EX)
    got = {}

    def job():
        with gpu.turn(env) as waited:
            got["waited"] = waited
            got["held"] = [not probe_free(first), not probe_free(second)]

    thread = threading.Thread(target=job, daemon=True)
    thread.start()
    try:
        err = ""
        deadline = time.monotonic() + 5
        while "waiting for the GPU" not in err and time.monotonic() < deadline:
            err += capsys.readouterr().err
            time.sleep(0.02)
        assert err == "waiting for the GPU: another job is extracting\n"
        assert probe_free(second)  # not taken while the job waits for the first
        time.sleep(0.3)
    finally:
        os.close(holder)
    thread.join(5)
    assert got["held"] == [True, True] and 0.3 <= got["waited"] < 5
    assert probe_free(first) and probe_free(second)


# ---- stopping a job's process group ------------------------------------------------------------


def started_group(code: str) -> subprocess.Popen:
    """A process running ``code`` as the leader of a new process group, once it said 'ready'."""
    proc = subprocess.Popen(
        [sys.executable, "-c", code], start_new_session=True, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "ready"
    return proc


# Catches: SIGKILL first: no clean stop, exited leader not reaped: its zombie keeps the group
# "alive" for the whole grace, SIGKILL right after SIGTERM
def test_stop_group_lets_a_job_stop_cleanly_and_returns_once_it_has(tmp_path):
    noted = tmp_path / "stopped"
    proc = started_group(
        "import pathlib, signal, sys, time\n"
        f"def stop(*_): pathlib.Path({str(noted)!r}).write_text('clean'); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, stop)\nprint('ready', flush=True)\ntime.sleep(60)\n"
    )
    t0 = time.monotonic()
    gpu.stop_group(proc.pid, grace=10, leader=proc)
    assert time.monotonic() - t0 < 5
    assert proc.wait(timeout=5) == 0 and noted.read_text() == "clean"


# Catches: no SIGKILL once the grace is over, no wait for the grace
def test_stop_group_kills_a_job_that_ignores_sigterm_after_the_grace():
    proc = started_group(
        "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('ready', flush=True)\ntime.sleep(60)\n"
    )
    try:
        t0 = time.monotonic()
        gpu.stop_group(proc.pid, grace=0.5, leader=proc)
        assert time.monotonic() - t0 >= 0.5
        assert proc.wait(timeout=5) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# Catches: the wrapper's SIGTERM handler left installed after the job
def test_waiting_for_a_job_restores_the_sigterm_handler():
    previous = signal.getsignal(signal.SIGTERM)
    proc, pumping = gpu.start(
        [sys.executable, "-c", "raise SystemExit(4)"], dict(os.environ), None, None
    )
    assert pumping is None and gpu.wait(proc, pumping) == 4
    assert signal.getsignal(signal.SIGTERM) is previous


# Catches: a second SIGTERM while the first one's SystemExit unwinds, before the group stop defers
# signals, would cut the stop short
def test_the_first_sigterm_exits_143_and_ignores_the_next():
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as stopped:
            gpu._raise_exit(signal.SIGTERM, None)
        assert stopped.value.code == 128 + signal.SIGTERM
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)


def kill_all(*pids: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


# Catches: exit status 128, not 128 + SIGTERM, SystemExit not caught: the group's other processes
# outlive the wrapper, no handler: the wrapper dies at once, leaving the group running
def test_sigterm_to_the_wrapper_stops_the_jobs_whole_group_and_exits_143(tmp_path):
    pids = tmp_path / "pids"
    job = (
        "import os, pathlib, subprocess, time\n"
        "worker = subprocess.Popen(['sleep', '60'])\n"
        f"pathlib.Path({str(pids)!r}).write_text(f'{{os.getpid()}} {{worker.pid}}')\n"
        "time.sleep(60)\n"
    )
    p = run_job(tmp_path, "stopped", "0", 1, [sys.executable, "-c", job])
    try:
        assert wait_until(lambda: pids.exists() and len(pids.read_text().split()) == 2, 30)
        job_pid, worker = map(int, pids.read_text().split())
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=20) == 128 + signal.SIGTERM
        assert wait_until(lambda: not alive(job_pid) and not alive(worker), 5), (
            alive(job_pid),
            alive(worker),
        )
        assert not (tmp_path / "stopped.json").exists()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        if pids.exists():
            kill_all(*map(int, pids.read_text().split()))


# Catches: the job does not get SIGTERM when its wrapper is SIGKILLed
def test_a_job_ends_when_its_wrapper_is_killed(tmp_path):
    pid = tmp_path / "pid"
    job = f"import os, pathlib, time; pathlib.Path({str(pid)!r}).write_text(str(os.getpid())); time.sleep(60)"
    p = run_job(tmp_path, "orphan", "0", 1, [sys.executable, "-c", job])
    try:
        assert wait_until(lambda: pid.exists() and pid.read_text(), 30)
        p.kill()
        p.wait()
        assert wait_until(lambda: not alive(int(pid.read_text())), 5), (
            "the job outlived its wrapper"
        )
    finally:
        if pid.exists() and pid.read_text():
            kill_all(int(pid.read_text()))


# ---- the wrapper's command line, environment and record -----------------------------------------

# A job that writes the variables the wrapper hands it to the JSON file argv[1] names
ENV_DUMP = (
    "import json, os, sys, time; time.sleep(float(sys.argv[2])); json.dump({k: os.environ.get(k) "
    "for k in ('CUDA_VISIBLE_DEVICES', 'EAGLE3_GPU_TURN', 'CUDA_DEVICE_ORDER')}, "
    "open(sys.argv[1], 'w'))"
)


def gpu_main(tmp_path, *options, sleep=0.0, lock_dir=None) -> tuple[int, dict, dict | None]:
    """``python -m eagle3lib.gpu run`` in this process on ENV_DUMP: (exit status, the job's
    variables, the record or None)."""
    record, seen = tmp_path / "gpu.json", tmp_path / "seen.json"
    for path in (record, seen):
        path.unlink(missing_ok=True)
    with within(20):  # (a lease that never comes fails the test instead of hanging it)
        rc = gpu.main(
            ["run", "--rule", "extract", "--record", str(record),
             "--lock-dir", str(lock_dir or tmp_path / "locks"), *options,
             "--", sys.executable, "-c", ENV_DUMP, str(seen), str(sleep)]
        )  # fmt: skip
    return (
        rc,
        json.loads(seen.read_text()),
        (json.loads(record.read_text()) if record.exists() else None),
    )


# Catches: the reading after the job not given time to settle, started_at taken at the end, no host,
# an inherited EAGLE3_GPU_TURN kept for an exclusive job, --share defaults to sharing, whole-machine
# readings
def test_an_exclusive_jobs_record_names_its_lease_host_span_and_settled_reading(
    tmp_path, fake_nvml, monkeypatch
):
    """NVML is a fake (FakeNVML): device 0 shows 9000 MiB right after the job, 510 MiB once
    the driver has freed the exited process's memory."""
    fake_nvml({0: 500.0, 1: 7000.0}, {0: 9000.0, 1: 7000.0}, {0: 510.0, 1: 7000.0})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv(gpu.TURN_ENV, "/elsewhere/h-gpu5.turn.lock")  # e.g. a nested wrapper
    t0 = time.time()
    rc, seen, record = gpu_main(tmp_path, "--gpus", "1", sleep=0.3)
    # NVML's indices, which CUDA takes as NVML does under PCI_BUS_ID order
    assert rc == 0 and seen == {
        "CUDA_VISIBLE_DEVICES": "0",
        "EAGLE3_GPU_TURN": None,
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    }
    assert record["rule"] == "extract" and record["host"] == HOST
    assert record["gpus_requested"] == 1 and record["devices"] == [0]
    assert record["shared_by"] == 1 and record["stray_processes"] is False
    assert [d["used_mib"] for d in record["before"]["devices"]] == [500.0]
    assert [d["used_mib"] for d in record["after"]["devices"]] == [510.0]
    assert record["leaks"] == []
    assert t0 - 0.001 <= record["started_at"] and record["ended_at"] <= time.time()
    assert record["ended_at"] - record["started_at"] >= 0.3  # the job's own span
    assert record["seconds"] >= 0.3


# Catches: a shared job's record names the other job's memory as its leak, turn locks outside this
# allocation's absolute lock folder
def test_a_sharing_jobs_turn_locks_and_record(tmp_path, fake_nvml, monkeypatch):
    """NVML is a fake: the device's memory grows by the other sharing job's 16.5 GB."""
    fake_nvml({0: 500.0}, {0: 17000.0})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv(gpu.GPU_SHARING_ENV, gpu.sharing_setting("extract", 1, 2))
    monkeypatch.chdir(tmp_path)
    rc, seen, record = gpu_main(tmp_path, "--gpus", "0", lock_dir=Path("locks"))
    turn = tmp_path.resolve() / "locks" / "slurm-7" / f"{HOST}-gpu0.turn.lock"
    assert rc == 0 and seen == {
        "CUDA_VISIBLE_DEVICES": "0",
        "EAGLE3_GPU_TURN": str(turn),
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    }
    assert record["shared_by"] == 2 and record["devices"] == [0] and record["leaks"] == []
    assert [d["used_mib"] for d in record["after"]["devices"]] == [17000.0]


# Catches: the workflow's sharing setting overrides an explicit --gpus
def test_the_sharing_setting_applies_only_to_jobs_that_asked_for_no_gpu(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(gpu, "run", lambda *args: calls.append(args) or 0)
    monkeypatch.setenv(gpu.GPU_SHARING_ENV, gpu.sharing_setting("extract", 2, 3))
    common = ["run", "--rule", "extract", "--record", str(tmp_path / "r.json"), "--"]
    assert gpu.main([*common[:5], "--gpus", "1", *common[5:], "true"]) == 0
    assert gpu.main([*common[:5], "--gpus", "0", *common[5:], "true"]) == 0
    assert [(gpus, share) for _, gpus, *_, share in calls] == [(1, 1), (2, 3)]


# Catches: no command: Popen([]) fails with a traceback instead of a usage error
def test_a_wrapper_without_a_command_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as usage:
        gpu.main(["run", "--rule", "t", "--record", str(tmp_path / "r.json"), "--"])
    assert usage.value.code == 2
    assert "error: no command given after --" in capsys.readouterr().err


# Catches: snapshot prints nothing
def test_snapshot_prints_the_nvml_reading(fake_nvml, capsys):
    """NVML is a fake with one device."""
    fake_nvml({0: 1536.0}, pids={0: [11]})
    assert gpu.main(["snapshot"]) == 0
    snap = json.loads(capsys.readouterr().out)
    assert snap["available"] is True and snap["device_count"] == 1
    assert [(d["index"], d["used_mib"], d["pids"]) for d in snap["devices"]] == [(0, 1536.0, [11])]


# Catches: a CPU job (--gpus 0) recording the whole machine's NVML reading and naming as its leak
# whatever another job grew on any device meanwhile (e.g. serve_check.gpus: 0 beside an evaluate job
# on GPU 0): report.gpu_problems then failed the build.
def test_a_cpu_job_is_never_blamed_for_other_jobs_gpu_memory(tmp_path, fake_nvml, monkeypatch):
    """NVML is a fake: device 0's memory grows by 9 GB (another job's) while the CPU job runs."""
    fake_nvml({0: 1000.0}, {0: 10000.0})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    rc, seen, record = gpu_main(tmp_path, "--gpus", "0")
    assert rc == 0 and seen["CUDA_VISIBLE_DEVICES"] == ""
    assert record["devices"] == [] and record["leaks"] == []
    table = report.gpu_memory_table({"serve_check": tmp_path / "gpu.json"})
    assert report.gpu_problems(table) == []


# ---- one job over several SLURM nodes (stub SLURM commands, tests/slurm_stub.py) --------------


def nodes_job(tmp_path, nodelist: str, command: list[str], path: str | None = None):
    """gpu_job.py --nodes 2 --node-gpus 1 in a stub SLURM allocation (its stub srun runs each
    "node" here, device ids 0 and 1): the finished process and the merged record's path."""
    stubs = slurm_stub.install(tmp_path / "stubs")
    env = slurm_stub.environment(stubs, SLURM_JOB_ID="4242", STUB_SLURM_NODELIST=nodelist)
    env["PYTHONPATH"] = str(ROOT)
    if path is not None:
        env["PATH"] = path + os.pathsep + env["PATH"]
    record = tmp_path / "gpu" / "train.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_job.py"), "--gpus", "0", "--nodes", "2",
         "--node-gpus", "1", "--rule", "train", "--record", str(record),
         "--lock-dir", str(tmp_path / "locks"), "--", *command],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    return proc, record


# Catches: an allocation of exactly N nodes refused, every node writes node 0's record, --node-
# gpus/--gpus swapped: nodes lease no GPU, node records left, hosts beyond the job's nodes, a node's
# failure status lost
def test_a_job_over_two_nodes_leases_each_nodes_gpu_and_merges_their_records(tmp_path):
    seen = tmp_path / "seen"
    job = (
        "import os, pathlib; n = os.environ['SLURM_NODEID']; pathlib.Path("
        f"{str(seen)!r} + n).write_text(os.environ['CUDA_VISIBLE_DEVICES'] + ' ' + "
        "os.environ['EAGLE3_RDZV_ENDPOINT'])"
    )
    proc, record = nodes_job(tmp_path, "127.0.0.1,localhost,spare", [sys.executable, "-c", job])
    assert proc.returncode == 0, proc.stderr
    merged = json.loads(record.read_text())
    endpoint = merged["rendezvous"]
    assert endpoint.startswith("127.0.0.1:")
    assert [(tmp_path / f"seen{n}").read_text() for n in (0, 1)] == [
        f"0 {endpoint}", f"1 {endpoint}",
    ]  # fmt: skip
    assert merged["nodes"] == 2 and merged["hosts"] == ["127.0.0.1", "localhost"]
    assert merged["gpus_requested"] == 1 and merged["stray_processes"] is False
    assert [r["devices"] for r in merged["per_node"]] == [[0], [1]]
    assert sorted(p.name for p in record.parent.iterdir()) == ["train.json"]
    record.unlink()
    # node 1 fails: srun ends the step (node 0's wrapper gets SIGTERM: 143), and the job
    # fails with srun's status
    fails = (
        "import os, sys, time; sys.exit(3) if os.environ['SLURM_NODEID'] == '1' else time.sleep(30)"
    )
    proc, record = nodes_job(tmp_path, "127.0.0.1,localhost", [sys.executable, "-c", fails])
    assert proc.returncode == 128 + signal.SIGTERM and not record.exists(), proc.stderr


# Catches: no check: srun would start fewer nodes than asked, UserError not turned into one line and
# status 1
def test_a_job_over_more_nodes_than_the_allocation_has_stops_with_one_line(tmp_path):
    proc, record = nodes_job(tmp_path, "localhost", ["true"])
    assert proc.returncode == 1 and not record.exists()
    assert proc.stderr.splitlines() == [
        "error: train: 2 nodes asked for, the allocation has 1 (['localhost']); submit the job "
        "with --profile profiles/slurm, which asks for the nodes"
    ]


# Catches: an earlier run's node records taken for this run's, missing node records not noticed: a
# traceback, what the srun step left running not stopped
def test_srun_that_ends_without_the_nodes_records_fails_and_leaves_nothing_running(tmp_path):
    """A broken srun (a script first on PATH): it starts a process that would outlive it and
    exits 0 without running the nodes' tasks; the records of an earlier run are still there."""
    broken = tmp_path / "broken"
    broken.mkdir()
    pid = tmp_path / "pid"
    (broken / "srun").write_text(
        f"#!/bin/sh\nsleep 60 >/dev/null 2>&1 &\necho $! > {pid}\nexit 0\n"
    )
    (broken / "srun").chmod(0o755)
    (tmp_path / "gpu").mkdir()
    for n in (0, 1):
        (tmp_path / "gpu" / f"train.node{n}.json").write_text('{"stale": true}')
    try:
        proc, record = nodes_job(tmp_path, "127.0.0.1,localhost", ["true"], path=str(broken))
        assert proc.returncode == 1 and not record.exists(), proc.stderr
        assert proc.stderr.startswith("error: train: srun ended without the records of every node")
        assert wait_until(lambda: not alive(int(pid.read_text())), 5), "srun's leftover runs"
    finally:
        if pid.exists():
            kill_all(int(pid.read_text()))
