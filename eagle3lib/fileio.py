"""Atomic writes and content hashes shared by every stage."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


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
        if not directory:
            with open(tmp, "rb+") as fh:
                os.fsync(fh.fileno())
        if directory and path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as indented, key-sorted JSON, atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def read_json(path: str | os.PathLike) -> Any:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


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
    if marker.exists() and read_json(marker).get("sha256") == digest:
        return True
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    write_json(marker, {"sha256": digest, "fingerprint": fingerprint})
    return False


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()
