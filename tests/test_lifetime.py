"""Job processes end with the process that started them; one writer per artifact folder
(eagle3lib/lifetime.py). Real processes, real signals and real flocks."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
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


# ---- die_with_parent, parent_death_signal, child_dies_with_me ---------------------------------

# A job's script as errors.cli runs it (its main in __main__): the signal it asked the kernel
# for, read back with prctl(PR_GET_PDEATHSIG).
CLI_DEATH_SIGNAL = """
import ctypes, sys
sys.path.insert(0, sys.argv[1])
from eagle3lib.errors import cli

@cli
def main():
    asked = ctypes.c_int()
    ctypes.CDLL(None, use_errno=True).prctl(2, ctypes.byref(asked), 0, 0, 0)  # PR_GET_PDEATHSIG
    print(asked.value)

main()
"""


# Catches: die_with_parent asks for SIGTERM whatever `sig` says, parent_death_signal's SIGKILL and
# SIGTERM swapped, torchrun's variable misnamed.
def test_a_jobs_process_asks_for_sigterm_and_a_torchrun_worker_for_sigkill():
    env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RUN_ID"}
    for extra, want in (({}, signal.SIGTERM), ({"TORCHELASTIC_RUN_ID": "7"}, signal.SIGKILL)):
        proc = subprocess.run(
            [sys.executable, "-c", CLI_DEATH_SIGNAL, str(ROOT)],
            env={**env, **extra}, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert proc.returncode == 0 and proc.stdout == f"{int(want)}\n", (extra, proc.stderr)


# A process whose parent dies after it started but before it asks for the signal: the parent
# forks it, waits until it has imported eagle3lib.lifetime, and exits; the child waits until it
# has been adopted, then asks.
ORPHAN = """
import os, sys, time
sys.path.insert(0, sys.argv[1])
r, w = os.pipe()
parent = os.getpid()
if os.fork():
    os.read(r, 1)
    os._exit(0)
from eagle3lib.lifetime import die_with_parent
os.write(w, b"x")
while os.getppid() == parent:
    time.sleep(0.01)
print(os.getppid(), die_with_parent(), flush=True)
"""


# Catches: a process adopted by init or a subreaper not taken for one whose parent is gone (the job
# would run on, and never get the signal).
def test_a_process_whose_parent_died_before_it_asked_is_told_so():
    proc = subprocess.run(
        [sys.executable, "-c", ORPHAN, str(ROOT)], capture_output=True, text=True, timeout=60
    )
    adopter, told = proc.stdout.split()
    assert told == "False", (adopter, proc.stderr)  # by init or by a subreaper


# The child's preexec names this process as its parent; a forked copy of it then starts the
# child, whose parent is therefore not the one named: as if that one had died meanwhile.
CHILD_OF_A_GONE_PARENT = """
import os, subprocess, sys
sys.path.insert(0, sys.argv[1])
from eagle3lib.lifetime import child_dies_with_me

child = [sys.executable, "-c", "print('ran', flush=True)"]
print(subprocess.Popen(child, preexec_fn=child_dies_with_me()).wait(), flush=True)
preexec = child_dies_with_me()
pid = os.fork()
if pid == 0:
    print(subprocess.Popen(child, preexec_fn=preexec).wait(), flush=True)
    os._exit(0)
os.waitpid(pid, 0)
"""


# Catches: the child runs although its parent is gone, the parent compared with init, not with the
# process that started the child.
def test_a_child_whose_parent_is_already_gone_exits_at_once_with_143():
    proc = subprocess.run(
        [sys.executable, "-c", CHILD_OF_A_GONE_PARENT, str(ROOT)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["ran", "0", str(128 + signal.SIGTERM)]  # never ran: 143


# ---- signals_deferred -------------------------------------------------------------------------


# Catches: nothing held in the main thread, the previous handlers not restored, held signals
# dropped, only the first kind delivered, a repeated one delivered twice.
def test_signals_deferred_hold_sigterm_and_sigint_until_the_block_ends():
    """What a job stops (a process group, a server) is stopped in full: SIGTERM and SIGINT
    arriving meanwhile reach the handler that was there before only once the block ends,
    each kind once, in the order they came. In another thread it does nothing (and does not
    fail: only the main thread may set handlers)."""
    from eagle3lib.lifetime import signals_deferred

    got = []

    def note(signum, _frame):
        got.append(signum)

    before = {s: signal.signal(s, note) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with signals_deferred():
            for s in (signal.SIGTERM, signal.SIGINT, signal.SIGTERM):
                signal.raise_signal(s)
            held = list(got)
        assert held == [] and got == [signal.SIGTERM, signal.SIGINT]
        assert all(signal.getsignal(s) is note for s in before)
        got.clear()
        with signals_deferred():
            pass
        assert got == []

        seen = []

        def run():
            with signals_deferred():
                seen.append(signal.getsignal(signal.SIGTERM))

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        assert seen == [note]
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


# Catches: the held SIGTERM never delivered: the job would go on after its stop.
def test_a_sigterm_held_while_stopping_ends_the_job_once_the_stop_is_done():
    """As in a job's script (errors.cli: SIGTERM raises SystemExit(143)): the block runs to
    its end, then the job exits 143."""
    from eagle3lib.errors import _terminate
    from eagle3lib.lifetime import signals_deferred

    previous = signal.signal(signal.SIGTERM, _terminate)
    done = []
    try:
        with pytest.raises(SystemExit) as stopped, signals_deferred():
            signal.raise_signal(signal.SIGTERM)
            done.append("stopped the group")
        assert done == ["stopped the group"] and stopped.value.code == 128 + signal.SIGTERM
        assert signal.getsignal(signal.SIGTERM) is _terminate
    finally:
        signal.signal(signal.SIGTERM, previous)


# ---- hold_folders ------------------------------------------------------------------------------

# Runs the hold_folders calls given as JSON ([[job, [path or null, ...]], ...]) in order,
# printing "held" or the refusal for each, then, with --exec, replaces itself with a sleeper
# that prints "exec"; else sleeps while the test looks on.
HOLD = """
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
from eagle3lib.errors import UserError
from eagle3lib.lifetime import hold_folders

for job, paths in json.loads(sys.argv[2]):
    try:
        hold_folders(job, *paths)
        print("held", flush=True)
    except UserError as exc:
        print(f"refused: {exc}", flush=True)
if "--exec" in sys.argv:
    os.execv(sys.executable, [sys.executable, "-c",
             "import time; print('exec', flush=True); time.sleep(600)"])
print("done", flush=True)
time.sleep(600)
"""


@contextlib.contextmanager
def holding(*calls, exec_after: bool = False):
    """A process that makes ``calls`` (job, path...) of hold_folders and then lives on; yields
    it and the line printed for each call."""
    argv = [sys.executable, "-c", HOLD, str(ROOT), json.dumps([[j, list(p)] for j, *p in calls])]
    proc = subprocess.Popen(argv + ["--exec"] * exec_after, stdout=subprocess.PIPE, text=True)
    try:
        lines = [proc.stdout.readline().strip() for _ in calls]
        assert proc.stdout.readline().strip() == ("exec" if exec_after else "done"), lines
        yield proc, lines
    finally:
        proc.kill()
        proc.wait()


def locks(folder) -> list[str]:
    return sorted(p.name for p in (folder / ".locks").iterdir())


# Catches: the lock named after the job alone, after the folder alone: jobs writing one folder, the
# extract shards, would refuse each other, a None path not skipped.
def test_one_lock_per_job_and_folder_beside_the_artifacts(tmp_path):
    """The extract jobs of one run write their shards into one folder, each its own: they
    hold different locks (`<folder>.<job>.lock` in the run's `.locks`), and only a second
    writer of the same job's artifacts is refused. The lock file names its holder."""
    run = tmp_path / "results" / "t"
    shards, vocab = run / "shards", run / "vocab"
    with holding(("extract-0", str(shards / "shard-0.safetensors"), None)) as (first, lines):
        assert lines == ["held"]
        assert locks(run) == ["shards.extract-0.lock"] and sorted(os.listdir(run)) == [".locks"]
        lock = run / ".locks" / "shards.extract-0.lock"
        assert lock.read_text() == f"{first.pid} {socket.gethostname()}\n"
        with holding(
            ("extract-1", str(shards / "shard-1.safetensors"), str(shards / "shard-1.json")),
            ("vocab", str(vocab / "vocab_map.safetensors")),
            ("vocab", str(shards / "vocab_map.safetensors")),
            ("extract-0", str(run / "other" / "shard-0.safetensors")),
            ("extract-0", str(shards / "shard-0.json")),
        ) as (_second, lines):
            assert lines[:4] == ["held"] * 4
            assert lines[4] == (
                f"refused: {shards}: another extract-0 job is writing here (pid {first.pid} on "
                f"{socket.gethostname()}, lock {lock}); stop it or let it finish, then rerun"
            )
        assert locks(run) == [
            "other.extract-0.lock", "shards.extract-0.lock", "shards.extract-1.lock",
            "shards.vocab.lock", "vocab.vocab.lock",
        ]  # fmt: skip


# Catches: a lock this process holds taken again: it refuses itself, the lock not remembered as
# held.
def test_a_process_may_ask_again_for_a_folder_it_holds(tmp_path):
    """A script's main run twice in one process (a test, a retry) asks again for its folders:
    it already holds them, it is not "another job"."""
    out = tmp_path / "results" / "t" / "vocab"
    calls = [("vocab", str(out / "vocab_map.safetensors"))] * 2
    with holding(*calls) as (_proc, lines):
        assert lines == ["held", "held"]


# Catches: the lock's descriptor not inherited across exec: train's torchrun relaunch would let a
# second writer in.
def test_the_lock_is_held_on_across_exec(tmp_path):
    out = tmp_path / "results" / "t" / "checkpoint"
    with holding(("train", str(out / "model.safetensors")), exec_after=True) as (proc, lines):
        assert lines == ["held"]
        with holding(("train", str(out / "config.json"))) as (_second, refused):
            assert refused[0].startswith(f"refused: {out}: another train job is writing here")
            assert f"(pid {proc.pid} on " in refused[0]


# ---- interpreter_first_on_path, Phases --------------------------------------------------------


# Catches: the last entry checked: added on every call, added even when first, an empty PATH gets a
# trailing empty entry: the working directory, appended, not first, the interpreter itself, not its
# folder.
def test_the_interpreters_folder_goes_first_on_path_once():
    from eagle3lib.lifetime import interpreter_first_on_path

    env = {"PATH": "/usr/bin:/bin"}
    interpreter_first_on_path(env, "/venv/bin/python")
    assert env == {"PATH": "/venv/bin:/usr/bin:/bin"}
    interpreter_first_on_path(env, "/venv/bin/python")
    assert env == {"PATH": "/venv/bin:/usr/bin:/bin"}
    env = {"PATH": "/usr/bin:/venv/bin"}  # on PATH, not first: put first
    interpreter_first_on_path(env, "/venv/bin/python")
    assert env == {"PATH": "/venv/bin:/usr/bin:/venv/bin"}
    for env in ({}, {"PATH": ""}):
        interpreter_first_on_path(env, "/venv/bin/python")
        assert env == {"PATH": "/venv/bin"}


# Catches: marks in seconds since the epoch, echo inverted, logged to stdout.
def test_phases_mark_seconds_since_the_process_started_and_log_them(capsys):
    import psutil

    from eagle3lib.lifetime import Phases

    age = time.time() - psutil.Process().create_time()
    loud, quiet = Phases("train"), Phases("train rank 1", echo=False)
    loud.mark("loaded")
    quiet.mark("loaded")
    at = loud.marks["loaded"]
    assert age - 0.01 <= at < age + 60 and age - 0.01 <= quiet.marks["loaded"] < age + 60
    out = capsys.readouterr()
    assert out.out == "" and out.err == f"train: loaded at {at:.1f} s\n"


# ---- a snakemake that is PID 1 (a container's entrypoint) --------------------------------------

# As snakemake runs a job, but as PID 1 of a PID namespace of its own, as `docker run image
# snakemake ...` (no --init) or a pod whose command is snakemake starts it.
PID1_SNAKEMAKE = """
import subprocess, sys
argv = ["bash", "-c", "set -euo pipefail; " + sys.argv[1]]
job = subprocess.run(argv, capture_output=True, text=True)
print(job.returncode, job.stdout.strip(), job.stderr.strip().replace(chr(10), " | "), sep="\\n")
"""


def as_pid1(job: str) -> list[str]:
    if subprocess.run(["unshare", "-Urpf", "true"], capture_output=True).returncode != 0:
        pytest.skip("no user and PID namespaces here (unshare -Urpf)")
    run = subprocess.run(
        ["unshare", "-Urpf", "--mount-proc", sys.executable, "-c", PID1_SNAKEMAKE, job],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    return run.stdout.split("\n")[:3]


# Catches: a parent PID of 1 taken for "the parent is gone" although PID 1 is the snakemake that
# started the job (the wrapper and every script exited 143 at once, printing nothing).
def test_jobs_of_a_snakemake_that_is_pid_1_run(tmp_path):
    wrapper = (
        f"exec {sys.executable} {ROOT / 'scripts' / 'gpu_job.py'} --gpus 0 --rule t --record "
        f"{tmp_path / 'gpu.json'} --lock-dir {tmp_path / 'locks'} -- echo the job ran"
    )
    assert as_pid1(wrapper)[:2] == ["0", "the job ran"]
    out = tmp_path / "results" / "t" / "vocab"
    vocab = (
        f"exec {sys.executable} {ROOT / 'scripts' / 'vocab.py'} --samples "
        f"{tmp_path / 'missing.safetensors'} --draft-vocab-size 8 --out-map "
        f"{out / 'vocab_map.safetensors'} --out-info {out / 'vocab.json'}"
    )
    rc, _stdout, stderr = as_pid1(vocab)
    assert rc == "1" and "missing.safetensors" in stderr  # the script ran: its own error
