"""How long a job's processes live, and who may write an artifact folder.

- ``die_with_parent``: the kernel sends this process SIGTERM when the thread that started it
  dies, even by SIGKILL (Linux ``prctl(PR_SET_PDEATHSIG)``). Every rule's command replaces the
  shell snakemake starts (``exec``), so a job's first process is snakemake's own child; every
  script asks for the signal when it starts (``scripts/_bootstrap.py``), the GPU lease wrapper
  asks it for the command it runs, and it survives the ``exec`` into torchrun. A job therefore
  ends with the snakemake process that started it, and each process below it with its parent.
- ``sigterm_deferred``: while a job stops what it started (a process group, a server), a
  further SIGTERM waits until the stop is done, so that it cannot cut the stop short of its
  SIGKILL. A job stopped by SLURM or snakemake gets several: one sent to every process, one
  from the wrapper stopping its group, one when its parent dies.
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
from collections.abc import MutableMapping
from pathlib import Path

from eagle3lib.errors import UserError

PR_SET_PDEATHSIG = 1

# Lock descriptors this process holds, by lock file: kept open (and locked) until it exits.
_HELD: dict[str, int] = {}


def die_with_parent(parent: int | None = None, sig: int = signal.SIGTERM) -> bool:
    """Ask for ``sig`` when the parent (the thread that forked this process) dies. Returns
    False when the parent is already gone: not ``parent`` (if given) or, without it, init."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: nothing to ask for
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    ppid = os.getppid()
    return ppid == parent if parent is not None else ppid != 1


def child_dies_with_me():
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets SIGTERM when this process
    dies, and exits at once if it already has. Start the child from the main thread: the
    signal follows the thread that forked it."""
    parent = os.getpid()

    def preexec() -> None:
        if not die_with_parent(parent):
            os._exit(128 + signal.SIGTERM)

    return preexec


@contextlib.contextmanager
def sigterm_deferred():
    """Hold SIGTERM back for the block: one that arrives meanwhile is delivered (to the handler
    that was there before) once the block ends. Only the main thread handles signals; in
    another thread this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived = []
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: arrived.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
        if arrived:
            signal.raise_signal(signal.SIGTERM)


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
