"""Job processes end with the process that started them; one writer per artifact folder
(eagle3lib/lifetime.py). Real processes, real signals and real flocks."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, alive, proc_entries, wait_until


def pids_running(program: str, marker: str) -> list[int]:
    """Running processes of this interpreter whose first argument is ``program`` and whose
    command line contains ``marker`` (not the job's ``bash -c "... exec ..."`` before it execs)."""
    found = []
    for pid, cmdline in proc_entries("cmdline"):
        try:
            argv = cmdline.read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if argv[:2] == [sys.executable, program] and marker in " ".join(argv):
            found.append(pid)
    return [p for p in found if alive(p)]


# As snakemake runs a job: a pool thread starts `bash -c "set -euo pipefail; exec ..."` and
# waits for it; the main thread goes on. The marker names the job's own process.
FAKE_SNAKEMAKE = """
import subprocess, sys, threading, time
def run():
    subprocess.Popen(["bash", "-c", "set -euo pipefail; " + sys.argv[1]]).wait()
threading.Thread(target=run).start()
time.sleep(600)
"""


def test_a_job_and_its_gpu_wrapper_end_with_the_snakemake_that_started_them(tmp_path):
    """kill -9 of the starting process alone (not its group): the wrapper, which replaced the
    shell (exec), gets SIGTERM from the kernel and stops the job it leased GPUs for."""
    marker = f"sleep-{os.getpid()}-{time.time_ns()}"
    job = (
        f"exec {sys.executable} {ROOT / 'scripts' / 'gpu_job.py'} --gpus 0 --rule t"
        f" --record {tmp_path / 'gpu.json'} --lock-dir {tmp_path / 'locks'} --"
        f" {sys.executable} -c 'import time; time.sleep(300)  # {marker}'"
    )
    parent = subprocess.Popen([sys.executable, "-c", FAKE_SNAKEMAKE, job], start_new_session=True)
    try:

        def job():
            return [p for p in pids_running("-c", marker) if p != parent.pid]

        assert wait_until(job), "the job did not start"
        [sleeper] = job()
        [wrapper] = pids_running(str(ROOT / "scripts" / "gpu_job.py"), marker)
        os.kill(parent.pid, signal.SIGKILL)  # only the "snakemake" process
        parent.wait()
        assert wait_until(lambda: not alive(sleeper) and not alive(wrapper), 10), (
            "the job outlived the process that started it"
        )
    finally:
        for pid in [parent.pid, *pids_running("-c", marker)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


HOLDER = """
import sys, time
sys.path.insert(0, sys.argv[1])
from eagle3lib.lifetime import hold_folders
hold_folders("vocab", sys.argv[2])
print("held", flush=True)
time.sleep(600)
"""


def test_a_second_writer_stops_with_one_line_naming_the_holder(tmp_path):
    """While a process holds the vocab job's lock on results/<run>/vocab (an orphan of an
    earlier run), the vocab script refuses before it reads or writes anything; once the holder
    is gone (even by SIGKILL) the kernel has released the lock."""
    out = tmp_path / "results" / "t" / "vocab"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(ROOT), str(out / "vocab_map.safetensors")],
        stdout=subprocess.PIPE,
        text=True,
    )
    vocab = [
        sys.executable, str(ROOT / "scripts" / "vocab.py"),
        "--samples", str(tmp_path / "missing.safetensors"), "--draft-vocab-size", "8",
        "--out-map", str(out / "vocab_map.safetensors"), "--out-info", str(out / "vocab.json"),
    ]  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        refused = subprocess.run(vocab, capture_output=True, text=True)
        lines = refused.stderr.strip().splitlines()
        assert refused.returncode == 1 and len(lines) == 1, refused.stderr
        assert lines[0].startswith(f"error: {out}: another vocab job is writing here (pid ")
        assert f"pid {holder.pid} on " in lines[0] and "stop it or let it finish" in lines[0]
        assert not out.exists() or list(out.iterdir()) == []
    finally:
        holder.kill()
        holder.wait()
    after = subprocess.run(vocab, capture_output=True, text=True)  # the lock is free again
    assert after.returncode != 0 and "another vocab job" not in after.stderr
    assert "missing.safetensors" in after.stderr


def test_stop_requests_note_the_first_signal_and_exit_at_the_blocks_end():
    """Inside the block SIGTERM and SIGINT only set the request (the first one's number; a
    later one is ignored); the block's end exits with 128 + it; the handlers are restored."""
    from eagle3lib.lifetime import stop_requests

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    ran_on = []
    with pytest.raises(SystemExit) as stopped, stop_requests() as request:
        assert request.signum is None and request.name == ""
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGINT)
        ran_on.append(request.signum)  # not unwound by either signal
    assert ran_on == [signal.SIGTERM] and request.name == "SIGTERM"
    assert stopped.value.code == 128 + signal.SIGTERM
    assert {s: signal.getsignal(s) for s in before} == before

    with stop_requests() as request:  # no signal: the block ends as it would
        pass
    assert request.signum is None


def test_stop_requests_in_another_thread_leave_the_handlers_alone():
    import threading

    from eagle3lib.lifetime import stop_requests

    seen = []

    def run():
        with stop_requests() as request:
            seen.append((request.signum, signal.getsignal(signal.SIGTERM)))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == [(None, signal.getsignal(signal.SIGTERM))]
