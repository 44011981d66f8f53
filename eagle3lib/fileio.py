"""Atomic writes and content hashes shared by every stage."""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import os
import queue
import shutil
import tempfile
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from eagle3lib.errors import UserError, as_disk_full, first_line


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, directory: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of ``path``; rename it onto ``path`` only on success.

    A crash or kill leaves at most a ``.tmp-*`` sibling, never a half-written ``path``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if directory:
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    else:
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
        os.close(fd)
        tmp = Path(name)
    try:
        yield tmp
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, (0o777 if directory else 0o666) & ~umask)  # mkstemp/mkdtemp made it private
        fsync_tree(tmp)
        if directory and path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
        fsync_tree(path.parent, recursive=False)  # the rename itself
    except BaseException as exc:
        try:  # before the half-written file frees its space: a probe write still meets a quota
            full = as_disk_full(exc, path) if isinstance(exc, Exception) else None
        finally:
            if tmp.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)
        if full is not None and full is not exc:
            raise full from None  # a full disk, named by the file (errors.cli: one line)
        raise


def fsync_tree(path: str | os.PathLike, recursive: bool = True) -> None:
    """Flush a file, or a folder and (``recursive``) everything under it, to the disk: a rename
    after it then publishes complete contents even across a power loss, not only a kill."""
    path = Path(path)
    for item in [path, *path.rglob("*")] if path.is_dir() and recursive else [path]:
        fd = os.open(item, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def remove_stale_temps(path: str | os.PathLike) -> None:
    """Delete what a killed writer of ``path`` left (its ``.tmp-*`` siblings, which may hold
    disk space reserved for a whole shard). Only for outputs one job owns, as Snakemake's are."""
    path = Path(path)
    for stale in path.parent.glob(f".{path.name}.tmp-*"):
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)


def size_mismatch(path: Path, manifest_path: Path) -> str | None:
    """Why a built file differs from its manifest's ``file.bytes`` (truncated, replaced), or
    None; a cheap check for planning time (the sha256 is compared where the file is read)."""
    if not (path.exists() and manifest_path.exists()):
        return None  # not built, or half built: Snakemake builds it anyway
    try:
        expected = json.loads(manifest_path.read_text(encoding="utf-8"))["file"]["bytes"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{manifest_path}: unreadable manifest"
    size = path.stat().st_size
    if size != expected:
        return f"{path}: {size} bytes, its manifest says {expected}"
    return None


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as indented, key-sorted JSON, atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(
            json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8"
        )


class DamagedJson(UserError, ValueError):
    """A JSON file of the workflow's that does not parse (also a ValueError, as json's own)."""


def read_json(path: str | os.PathLike) -> Any:
    """One of the workflow's own JSON files; one that does not parse (cut short, edited) stops
    with one line naming it and what to do."""
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
        why = first_line(exc)
        raise DamagedJson(
            f"{path}: not valid JSON ({why}); the workflow wrote it, so it was cut short or "
            "edited since: delete it and rerun, snakemake makes it again"
        ) from None


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_json(obj: Any) -> str:
    """Hash of the canonical JSON form of ``obj``."""
    return sha256_bytes(canonical_json(obj).encode())


def fingerprinted_dir(path: str | os.PathLike, fingerprint: Any) -> bool:
    """Keep the work folder ``path`` (resumable state) only if the same inputs made it.

    Returns True when it was kept; otherwise it is emptied and stamped with ``fingerprint``.
    """
    path = Path(path)
    marker = path / "fingerprint.json"
    digest = sha256_json(fingerprint)
    with contextlib.suppress(ValueError, AttributeError):  # a damaged marker: start over
        if marker.exists() and read_json(marker).get("sha256") == digest:
            return True
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    write_json(marker, {"sha256": digest, "fingerprint": fingerprint})
    return False


def _read_sha256(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


# {file identity: its digest, being computed} of the files hash_ahead was given
_AHEAD: dict[tuple[int, ...], concurrent.futures.Future] = {}
_AHEAD_CHUNK = 1 << 24  # a hashing thread takes the GIL once per 16 MiB (4 MiB: twice as slow
#                         beside a thread importing modules)


def _identity(path: str | os.PathLike) -> tuple[int, ...] | None:
    """What changes when a file is written, replaced or touched; None when it is missing."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def hash_ahead(paths: Iterable[str | os.PathLike], threads: int = 8) -> None:
    """Start computing the sha256 of these files in background threads (at most ``threads``):
    a later ``sha256_file`` of one of them then waits for its digest instead of reading the
    file again, while the file is unchanged (same inode, size and times). A job starts this
    first, so that checking its inputs overlaps its imports and set-up; hashing and file reads
    release the GIL. The threads are daemons: a job that fails meanwhile does not wait."""
    todo: queue.SimpleQueue = queue.SimpleQueue()
    for path in paths:
        key = _identity(path)
        if key is None or key in _AHEAD:
            continue
        future: concurrent.futures.Future = concurrent.futures.Future()
        _AHEAD[key] = future
        todo.put((path, future))
    count = min(threads, todo.qsize())

    def work() -> None:
        while True:
            try:
                path, future = todo.get_nowait()
            except queue.Empty:
                return
            try:
                future.set_result(_read_sha256(path, _AHEAD_CHUNK))
            except BaseException as exc:  # noqa: BLE001 - sha256_file reads it again itself
                future.set_exception(exc)

    for _ in range(count):
        threading.Thread(target=work, name="hash_ahead", daemon=True).start()


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    """The file's sha256 (hex); the digest hash_ahead computed when the file is unchanged."""
    key = _identity(path)
    future = _AHEAD.pop(key, None) if key is not None else None
    if future is not None and future.exception() is None and _identity(path) == key:
        return future.result()
    return _read_sha256(path, chunk)
