"""User-facing errors: one line naming the file, line or key and what to do, then exit 1."""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import re
import shutil
import signal
import sys
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable[..., object])

# A write that fails for want of space: the disk, the quota, or a file size limit.
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
# What to do about each, after the folder or file and the system's own words (``cli``)
DISK_FULL_ADVICE = {
    errno.ENOSPC: "free disk space or point the results elsewhere, then rerun",
    errno.EDQUOT: "free space within your disk quota (or have it raised) or point the results "
    "elsewhere, then rerun",
    errno.EFBIG: "a file reached the largest size allowed to this process (the shell's "
    "`ulimit -f`) or to the file system: raise the limit or point the results at another file "
    "system, then rerun",
}


# What to change when a job's GPU runs out of memory, by the job's script (its file name).
GPU_MEMORY_KEYS = {
    "extract": "extract.batch_tokens (where extract jobs share a GPU, set extract.jobs_per_gpu: "
    "1; for a verifier too big for one GPU, raise extract.gpus_per_job)",
    "regenerate": "regenerate.batch_size",
    "train": "train.total_seq_len (for a draft whose training state does not fit one GPU, "
    "train.fsdp: true with train.gpus > 1)",
    "evaluate": "evaluate.batch_size (with evaluate.method: replay), or set evaluate.dtype: "
    "bfloat16 instead of float32",
}


# How safetensors (a Rust library) names the system's error of a failed write: "... (os error 28)".
OS_ERROR_NUMBER = re.compile(r"\(os error (\d+)\)")
# Free space below which torch.save's failed write (a RuntimeError naming no cause, not an
# OSError) is taken for a full disk.
NEARLY_FULL_BYTES = 64 << 20
# How torch's zip writer reports a write that failed (the cause is not given).
TORCH_WRITE_FAILED = ("unexpected pos", "iostream error", "file write failed")


def as_disk_full(exc: BaseException, where: str | os.PathLike) -> OSError | None:
    """``exc``, a failed write into the folder ``where``, as the OSError of a full disk naming
    ``where`` (what ``cli`` prints as one line), or None when the disk is not what failed:
    an OSError of a full disk; safetensors' error naming the errno of one (os error 28, or
    122 for a quota, 27 for a file size limit, on Linux); torch's zip writer
    failing while less than NEARLY_FULL_BYTES are free, or while a probe write into ``where``
    fails as on a full disk (a quota, a file size limit: ``_write_refused``), its own first
    line kept. A UserError already says what to do: it is not one."""
    if isinstance(exc, UserError):
        return None
    if isinstance(exc, OSError):
        if exc.errno not in DISK_FULL:
            return None
        return exc if exc.filename else OSError(exc.errno, exc.strerror, str(where))
    text = str(exc)
    named = [int(n) for n in OS_ERROR_NUMBER.findall(text) if int(n) in DISK_FULL]
    if named or "No space left on device" in text:
        code = named[0] if named else errno.ENOSPC
        return OSError(code, os.strerror(code), str(where))
    if not isinstance(exc, RuntimeError) or _gpu_out_of_memory(exc):
        return None
    if not any(sign in text for sign in TORCH_WRITE_FAILED):
        return None
    try:
        nearly_full = shutil.disk_usage(where).free < NEARLY_FULL_BYTES
    except OSError:
        return None
    # free space does not show a quota or a file size limit: a probe write does, or a file
    # that reached this process's file size limit (one above the probe's size lets it through)
    code = errno.ENOSPC if nearly_full else (_write_refused(where) or _size_limit_reached(where))
    if code is None:
        return None
    detail = f"{os.strerror(code)} (torch: {first_line(exc)})"
    return OSError(code, detail, str(where))


# A write this size into the folder of a failed torch.save tells a quota or a file size limit
# already reached (the half-written file still holds its space) from another failure.
PROBE_BYTES = 1 << 20


def _size_limit_reached(where: str | os.PathLike) -> int | None:
    """EFBIG where this process has a file size limit (RLIMIT_FSIZE, the shell's `ulimit -f`)
    that a file under the folder ``where`` (or the folder of the file ``where``) has reached:
    the half-written one, still there; else None."""
    import resource

    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit == resource.RLIM_INFINITY:
        return None
    folder = where if os.path.isdir(where) else os.path.dirname(os.fspath(where)) or "."
    for root, _dirs, names in os.walk(folder):
        for name in names:
            with contextlib.suppress(OSError):
                if os.path.getsize(os.path.join(root, name)) >= limit:
                    return errno.EFBIG
    return None


def _write_refused(where: str | os.PathLike) -> int | None:
    """The errno (of DISK_FULL) with which a PROBE_BYTES write into the folder ``where`` (or
    the folder of the file ``where``) fails, or None where it succeeds or fails otherwise; the
    probe file is removed."""
    import tempfile

    folder = where if os.path.isdir(where) else os.path.dirname(os.fspath(where)) or "."
    try:
        fd, name = tempfile.mkstemp(prefix=".disk-probe-", dir=folder)
    except OSError as exc:
        return exc.errno if exc.errno in DISK_FULL else None
    try:
        try:
            left = memoryview(bytes(PROBE_BYTES))
            while left:  # a write near a limit may be short; the next one fails
                left = left[os.write(fd, left) :]
            os.fsync(fd)  # some file systems report a quota only as the data is written
        finally:
            os.close(fd)  # or only at the close (NFS)
    except OSError as exc:
        return exc.errno if exc.errno in DISK_FULL else None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(name)
    return None


class UserError(Exception):
    """Bad input or configuration. The message is shown to the user as one line."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name if it has none), to quote
    a library's error inside a one-line UserError."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _terminate(signum, _frame):
    raise SystemExit(128 + signum)


def cli(main: F) -> F:
    """Run ``main``; turn a UserError into ``error: <message>`` on stderr and exit status 1, as
    also a full disk, a GPU out of memory, and a collective that lost another process of the
    job (each as one line)."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        # SIGTERM (how snakemake and schedulers stop jobs) unwinds like an exception, so
        # servers are stopped and half-written files removed on the way out.
        signal.signal(signal.SIGTERM, _terminate)
        if main.__module__ == "__main__":  # a job's process (not a test calling main)
            from eagle3lib.lifetime import die_with_parent, parent_death_signal, parent_gone

            # SIGTERM when its parent dies, SIGKILL for a torchrun worker (eagle3lib/lifetime.py)
            if not die_with_parent(sig=parent_death_signal()):
                print(f"error: {parent_gone()}", file=sys.stderr, flush=True)
                sys.exit(128 + signal.SIGTERM)
        try:
            return main(*args, **kwargs)
        except UserError as exc:
            print(f"error: {' '.join(str(exc).split())}", file=sys.stderr, flush=True)
            sys.exit(1)
        except RuntimeError as exc:
            if _lost_peer(exc):
                print(f"error: {lost_peer_message(exc)}", file=sys.stderr, flush=True)
                sys.exit(1)
            if not _gpu_out_of_memory(exc):
                raise
            print(f"error: {gpu_memory_message(exc, sys.argv[0])}", file=sys.stderr, flush=True)
            sys.exit(1)
        except OSError as exc:
            if exc.errno not in DISK_FULL:
                raise
            where = exc.filename or "results"
            print(
                f"error: {where}: {exc.strerror}; {DISK_FULL_ADVICE[exc.errno]}",
                file=sys.stderr,
                flush=True,
            )
            sys.exit(1)

    return wrapper  # type: ignore[return-value]


# How a collective reports that another process of the job is gone: gloo's closed or reset
# connection, NCCL's remote error (ncclRemoteError's text in torch's ProcessGroupNCCL).
PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "remote process exited or there was a network error",
)


def _lost_peer(exc: BaseException) -> bool:
    """A collective of a process of several (torchrun's WORLD_SIZE > 1) that failed because
    another process ended: that one has printed the job's error; a traceback here would bury
    it."""
    try:
        several = int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        several = False
    return several and any(sign in str(exc) for sign in PEER_LOST)


def lost_peer_message(exc: BaseException) -> str:
    """One line for a process whose collective lost another process of the job."""
    rank = os.environ.get("RANK", "?")
    return (
        f"rank {rank}: another process of this job ended first (its error, if it printed one, "
        f"is above), so this one stopped too: {first_line(exc)}"
    )


def _gpu_out_of_memory(exc: BaseException) -> bool:
    torch = sys.modules.get("torch")  # a job that never imported torch has no GPU to run out of
    return torch is not None and isinstance(exc, torch.OutOfMemoryError)


def gpu_memory_message(exc: BaseException, script: str) -> str:
    """One line for a job whose GPU ran out of memory: torch's first line and the config key
    that sizes the job's GPU memory."""
    from pathlib import Path

    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    keys = GPU_MEMORY_KEYS.get(Path(script).stem, "the batch size of this rule's config section")
    return f"the GPU ran out of memory ({first}); lower {keys}, then rerun"
