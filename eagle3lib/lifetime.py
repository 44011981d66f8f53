"""How long a job's processes live, and who may write an artifact folder.

- ``die_with_parent``: the kernel sends this process SIGTERM when the thread that started it
  dies, even by SIGKILL (Linux ``prctl(PR_SET_PDEATHSIG)``). Every rule's command replaces the
  shell snakemake starts (``exec``), so a job's first process is snakemake's own child; every
  script asks for the signal when its main starts (``errors.cli``), and stops at once if the
  parent it started with (``scripts/_bootstrap.py`` notes it) is gone by then; the GPU lease
  wrapper asks it for the command it runs, and it survives the ``exec`` into torchrun. A job therefore
  ends with the snakemake process that started it, and each process below it with its parent.
  A torchrun worker asks for SIGKILL instead (``parent_death_signal``).
- ``signals_deferred``: while a job stops what it started (a process group, a server), a
  further SIGTERM or SIGINT waits until the stop is done, so that it cannot cut the stop
  short of its SIGKILL. A job stopped by SLURM or snakemake gets several: one sent to every
  process, one from the wrapper stopping its group, one when its parent dies; a user
  presses Ctrl-C twice.
- ``stop_requests``: where a job can stop cleanly only at certain points (training, between
  steps: it saves a state a rerun resumes from), SIGTERM and SIGINT only note the request;
  the job's loop acts on it at its next such point. Later signals are ignored (each of
  SLURM, torchrun and the GPU wrapper passes one on); one that hangs is SIGKILLed by
  whoever sent the SIGTERM once their grace runs out (the wrapper, torchrun and SLURM's
  KillWait: 30 s each).
- ``hold_folders``: the job takes an exclusive ``flock`` per artifact folder it writes (the
  lock file holds its PID and host; see ``lock_path``) for the life of its process (the lock's
  descriptor is inherited across ``exec``); a second writer of the same job's artifacts stops
  with one line naming the holder. The kernel releases the lock when the holder dies.
- ``interpreter_first_on_path``: the Python a job's command names (``python``) is the one
  running snakemake, whose packages planning imports too, unless the job activates an
  environment of its own (``--sdm conda`` puts it first on PATH in the job's shell).

Standard library only: the vLLM environment's scripts import it too.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping, MutableMapping
from pathlib import Path

from eagle3lib.errors import UserError

PR_SET_PDEATHSIG = 1

# Lock descriptors this process holds, by lock file: kept open (and locked) until it exits.
_HELD: dict[str, int] = {}


# The parent this process had when this module was first imported (a script imports it first
# thing, in scripts/_bootstrap.py). A parent PID of 1 is no sign that the parent is gone: in a
# container snakemake itself may be PID 1 (``docker run image snakemake``); and an orphan's
# new parent need not be PID 1 (a subreaper adopts it).
PARENT_AT_START = os.getppid()


def die_with_parent(parent: int | None = None, sig: int = signal.SIGTERM) -> bool:
    """Ask for ``sig`` when the parent (the thread that forked this process) dies. Returns
    False when the parent is already gone: the parent is no longer ``parent`` (if given) or,
    without it, the one this process started with (``PARENT_AT_START``)."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: nothing to ask for
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    return os.getppid() == (parent if parent is not None else PARENT_AT_START)


def parent_gone() -> str:
    """The line a job's process prints when its parent died before it asked for the signal."""
    return (
        f"the process that started this one (PID {PARENT_AT_START}) ended before it could "
        "begin; nothing was run"
    )


def parent_death_signal(env: Mapping[str, str] = os.environ) -> int:
    """The signal a job's process asks for when its parent dies: SIGKILL for a torchrun
    worker (torchrun sets ``TORCHELASTIC_RUN_ID``), SIGTERM for any other. torchrun passes a
    SIGTERM on to its workers itself and SIGKILLs them after its shutdown timeout (30 s), but
    its workers run in sessions of their own, out of reach of the GPU wrapper's group stop,
    whose SIGKILL (also after 30 s) may end torchrun first. A worker that could not act on
    SIGTERM (blocked in a collective) would then hold its GPU past the lease."""
    return signal.SIGKILL if "TORCHELASTIC_RUN_ID" in env else signal.SIGTERM


def child_dies_with_me():
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets SIGTERM when this process
    dies, and exits at once if it already has. Start the child from the main thread: the
    signal follows the thread that forked it."""
    parent = os.getpid()

    def preexec() -> None:
        if not die_with_parent(parent):
            os._exit(128 + signal.SIGTERM)

    return preexec


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def signals_deferred():
    """Hold SIGTERM and SIGINT back for the block: one that arrives meanwhile is delivered (to
    the handler that was there before) once the block ends. Only the main thread handles
    signals; in another thread this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    previous = {
        s: signal.signal(s, lambda signum, _frame: arrived.append(signum)) for s in STOP_SIGNALS
    }
    try:
        yield
    finally:
        for sig, handler in previous.items():
            if handler is not None:  # None: installed outside Python, left as it is
                signal.signal(sig, handler)
        for sig in dict.fromkeys(arrived):
            signal.raise_signal(sig)


class StopRequest:
    """A stop asked for by a signal (``stop_requests``): ``signum``, None until one came."""

    signum: int | None = None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""


@contextlib.contextmanager
def stop_requests():
    """For the block, the first SIGTERM or SIGINT sets the yielded ``StopRequest`` instead of
    unwinding (later ones are ignored); the block acts on it where stopping is safe. A request
    not acted on by the block's end exits there (``SystemExit``, 128 + the signal). Signals
    are noted in the main thread only (where Python runs their handlers); in another thread
    the block gets a request no signal sets."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return

    def note(signum, _frame):
        if request.signum is None:
            request.signum = signum

    previous = {s: signal.signal(s, note) for s in STOP_SIGNALS}
    try:
        yield request
    finally:
        for sig, handler in previous.items():
            if handler is not None:  # None: installed outside Python, left as it is
                signal.signal(sig, handler)
    if request.signum is not None:
        raise SystemExit(128 + request.signum)


def lock_path(folder: Path, job: str) -> Path:
    """The lock of ``job`` on ``folder``: beside the folder, in a hidden ``.locks`` folder of
    its parent (``results/<run>/.locks/checkpoint.train.lock``), so that the artifact folders
    (a checkpoint is shipped as it is) hold only artifacts."""
    return folder.parent / ".locks" / f"{folder.name}.{job}.lock"


def _holder(fd: int) -> str:
    with contextlib.suppress(OSError):
        text = os.pread(fd, 200, 0).decode(errors="replace").split()
        if len(text) >= 2:
            return f"pid {text[0]} on {text[1]}"
    return "pid unknown"


def hold_folders(job: str, *paths: str | os.PathLike | None) -> None:
    """Lock, for ``job`` and the life of this process, the folder of every path in ``paths``
    (the files the job writes; None is skipped); raise a one-line UserError if another process
    holds one."""
    for folder in sorted({Path(p).parent for p in paths if p is not None}):
        lock = str(lock_path(folder, job))
        Path(lock).parent.mkdir(parents=True, exist_ok=True)
        if lock in _HELD:
            continue
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise UserError(
                f"{folder}: another {job} job is writing here ({holder}, lock {lock}); stop "
                "it or let it finish, then rerun"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        os.set_inheritable(fd, True)  # held on across exec (train's torchrun relaunch)
        _HELD[lock] = fd


def interpreter_first_on_path(
    environ: MutableMapping[str, str] = os.environ, executable: str = sys.executable
) -> None:
    """Put ``executable``'s folder first on ``environ``'s PATH (once), so that the jobs
    snakemake starts from this process run ``python`` from it: `.venv/bin/snakemake` then
    works without activating .venv."""
    folder = str(Path(executable).parent)
    path = environ.get("PATH", "")
    if path.split(os.pathsep)[0] != folder:
        environ["PATH"] = os.pathsep.join([folder, path]) if path else folder


class Phases:
    """When each step of a job ended, in seconds since its process started (interpreter
    start-up and imports included): its process timeline. Each is also logged as
    ``<job>: <name> at N s`` where ``echo``."""

    def __init__(self, job: str, echo: bool = True):
        import psutil

        self.job, self.echo = job, echo  # echo: log each mark (one process of several: not)
        self.start = psutil.Process().create_time()
        self.marks: dict[str, float] = {}

    def mark(self, name: str) -> None:
        self.marks[name] = round(time.time() - self.start, 2)
        if self.echo:
            print(f"{self.job}: {name} at {self.marks[name]:.1f} s", file=sys.stderr, flush=True)
