"""What a verifier path names on disk, checked before anything loads it: a hub id or a local
path, a GGUF file or a Hugging Face folder (its config.json and weights), and the checksum of
its weight files that the verifier's identity carries."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from eagle3lib.config import PACKAGE_PREFIX, resolve_package_path
from eagle3lib.errors import UserError
from eagle3lib.fileio import sha256_bytes, sha256_file, sha256_json
from eagle3lib.modelfiles import safetensors_problem

# Hash weight files in full up to this total size; above it hash the safetensors headers
# (tensor names, dtypes, shapes, offsets) and file sizes, which is fast for terabyte models.
FULL_HASH_LIMIT = 8 << 30


def is_local(path: str) -> bool:
    return path.startswith(("/", "./", "../")) or Path(path).exists() or is_gguf_file(path)


def is_gguf_file(path: str) -> bool:
    """verifier.path names a local GGUF file (a hub id never ends in .gguf: transformers loads
    no GGUF from a hub id without its file name)."""
    return not path.startswith(PACKAGE_PREFIX) and path.lower().endswith(".gguf")


def gguf_file(path: str) -> Path | None:
    """The GGUF file of verifier.path (packaged or local), or None for a folder or hub id.
    The file must exist and be named *.gguf."""
    if path.startswith(PACKAGE_PREFIX):
        gguf = resolve_package_path(path, "verifier.path")
        if gguf.suffix.lower() != ".gguf":
            raise UserError(
                f"config key verifier.path: {path!r} is not a .gguf file; name a GGUF file "
                "inside the package (package:<module>/<file>.gguf)"
            )
        return gguf
    return Path(path) if is_gguf_file(path) else None


def local_path_problem(path: str) -> str | None:
    """What is wrong with a local verifier.path (a folder or a .gguf file) before anything is
    read from it, one line with the remedy; None when it is a folder with a config.json or an
    existing GGUF file (and for package: references and hub ids)."""
    if path.startswith(PACKAGE_PREFIX) or not is_local(path):
        return None
    where = Path(path)
    fix = "fix the path (relative paths start at the working directory)"
    if is_gguf_file(path):
        if where.is_file():
            return None
        what = "is a folder, not a GGUF file" if where.is_dir() else "does not exist"
        return f"config key verifier.path: {path!r} {what}; {fix}"
    if not where.exists():
        return (
            f"config key verifier.path: folder {path!r} does not exist; {fix}, or give a hub "
            "id or a .gguf file"
        )
    if not where.is_dir():
        return (
            f"config key verifier.path: {path!r} is a file, not a model folder; point it at "
            "the folder that holds the model's config.json, or at a .gguf file"
        )
    if not (where / "config.json").is_file():
        ggufs = sorted(where.glob("*.gguf"))
        hint = f"; it holds {ggufs[0].name}: point verifier.path at that file" if ggufs else ""
        return (
            f"config key verifier.path: {path!r} is not a model folder (no config.json); "
            f"point it at a Hugging Face model folder or a hub id{hint}"
        )
    return None


def config_json_problem(config_path: Path) -> str | None:
    """Why a local verifier's config.json is not a model's config (unparsable, not an object,
    nothing that names a model type), or None."""
    try:
        data = json.loads(config_path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        return f"{config_path}: not UTF-8 text; fix or replace its config.json"
    except RecursionError:
        return f"{config_path}: JSON nested too deeply to read; fix or replace its config.json"
    except json.JSONDecodeError as exc:
        return (
            f"{config_path}:{exc.lineno}: invalid JSON ({exc.msg}); fix or replace its config.json"
        )
    if not isinstance(data, dict):
        return f"{config_path}: not a JSON object; fix or replace its config.json"
    if not any(key in data for key in ("model_type", "architectures", "text_config")):
        return (
            f"{config_path}: not a model's config (no model_type); point verifier.path at the "
            "model's own folder, or fix or replace its config.json"
        )
    return None


def weights_problem(folder: Path) -> str | None:
    """A local verifier's weight files that cannot be whole: a safetensors file cut short or
    corrupt, or a file its index names that is missing; None when all are there."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
            return f"{index}: unreadable weight index; fix or replace it"
        missing = sorted(n for n in names if not (folder / n).is_file())
        if missing:
            return (
                f"{index}: names {len(missing)} missing weight file(s) ({missing[0]}, ...); "
                "copy the model folder again, complete"
            )
    for f in sorted(folder.glob("*.safetensors")):
        problem = safetensors_problem(f)
        if problem:
            return (
                f"{f}: truncated or corrupt safetensors file ({problem}); download or copy "
                "the model again"
            )
    return None


def weight_files(folder: Path) -> tuple[list[Path], list[Path]]:
    """(safetensors files, pickle .bin/.pt files) of a model folder."""
    safetensors = sorted(folder.glob("*.safetensors"))
    pickles = sorted(p for ext in ("*.bin", "*.pt", "*.pth") for p in folder.glob(ext))
    return safetensors, pickles


def _safetensors_header(path: Path) -> bytes:
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        return fh.read(n)


def weights_checksum(files: list[Path]) -> dict[str, Any]:
    """Checksum of a verifier's weight files: each file's sha256 up to ``FULL_HASH_LIMIT`` bytes
    in all, above it each safetensors file's header and size (pickle files have no header to
    read, so they are always hashed in full)."""
    total = sum(f.stat().st_size for f in files)
    if total <= FULL_HASH_LIMIT or any(f.suffix != ".safetensors" for f in files):
        digests = {f.name: sha256_file(f) for f in files}
        kind = "sha256"
    else:
        digests = {
            f.name: sha256_bytes(_safetensors_header(f) + str(f.stat().st_size).encode())
            for f in files
        }
        kind = "sha256-of-safetensors-headers"
    return {"kind": kind, "bytes": total, "files": digests, "sha256": sha256_json(digests)}
