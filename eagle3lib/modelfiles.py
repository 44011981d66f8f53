"""Model files checked before anything loads them: a GGUF file's header (its metadata and the
extent of its tensor data) and a safetensors file's header against the file's size.

Both read the headers only (a GGUF's token list included, never its tensor data), so the
workflow can check a verifier when it plans, in well under a second, and refuse a truncated or
corrupt file in one line instead of a loader's ``struct.error`` or ``SafetensorError``.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path
from typing import Any, BinaryIO

from eagle3lib.errors import UserError

GGUF_MAGIC = b"GGUF"
GGUF_DEFAULT_ALIGNMENT = 32
# GGUF metadata value types: fixed-size scalars (struct format), 8 = string, 9 = array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}  # fmt: skip
_STRING, _ARRAY = 8, 9
GGUF_REMEDY = "download or convert the file again (a copy cut short, or not a GGUF model)"


class _Truncated(Exception):
    """The file ended where the format needs more bytes."""


@dataclasses.dataclass(frozen=True)
class GgufHeader:
    """What a GGUF file's header says about the model (None: not in the metadata)."""

    path: Path
    version: int
    architecture: str | None
    num_hidden_layers: int | None
    hidden_size: int | None
    max_position_embeddings: int | None
    vocab_size: int | None
    tensors: int
    data_end: int  # the byte where the last tensor's data ends
    file_bytes: int


def _read(fh: BinaryIO, n: int) -> bytes:
    raw = fh.read(n)
    if len(raw) != n:
        raise _Truncated
    return raw


def _unpack(fh: BinaryIO, fmt: str):
    return struct.unpack(fmt, _read(fh, struct.calcsize(fmt)))[0]


def _string(fh: BinaryIO, limit: int) -> bytes:
    n = _unpack(fh, "<Q")
    if n > limit:
        raise ValueError(f"a string of {n} bytes in a file of {limit}")
    return _read(fh, n)


def _value(fh: BinaryIO, kind: int, limit: int, keep: bool = True) -> Any:
    """One metadata value; arrays of strings are skipped through (their length is kept)."""
    if kind in _SCALARS:
        return _unpack(fh, _SCALARS[kind])
    if kind == _STRING:
        raw = _string(fh, limit)
        return raw.decode("utf-8", "replace") if keep else None
    if kind == _ARRAY:
        item, count = _unpack(fh, "<I"), _unpack(fh, "<Q")
        if count > limit:
            raise ValueError(f"an array of {count} items in a file of {limit} bytes")
        if item in _SCALARS:
            size = struct.calcsize(_SCALARS[item])
            fh.seek(size * count, 1)
            return count
        for _ in range(count):
            _value(fh, item, limit, keep=False)
        return count  # an array stands for its length here (the token list's is the vocab)
    raise ValueError(f"unknown metadata value type {kind}")


def read_gguf_header(path: str | Path) -> GgufHeader:
    """The header of a GGUF file; a file that is not one, or is cut short anywhere (in its
    metadata, its tensor table or its tensor data), is refused with one line."""
    sizes = _quant_sizes()
    path = Path(path)
    size = path.stat().st_size
    try:
        with open(path, "rb") as fh:
            _check_magic(fh, path)
            version = _version(fh)
            n_tensors, n_kv = _unpack(fh, "<Q"), _unpack(fh, "<Q")
            meta = _metadata(fh, n_kv, size)
            ends = [_tensor_end(fh, size, sizes) for _ in range(n_tensors)]
            start = _data_start(fh.tell(), meta)
    except _Truncated:
        raise UserError(
            f"{path}: truncated GGUF file: it ends inside its header ({size:,} bytes); "
            f"{GGUF_REMEDY}"
        ) from None
    except (ValueError, struct.error) as exc:
        raise UserError(f"{path}: corrupt GGUF file ({exc}); {GGUF_REMEDY}") from None
    data_end = start + max(ends, default=0)
    if data_end > size:
        raise UserError(
            f"{path}: truncated GGUF file: its tensors end at byte {data_end:,}, the file has "
            f"{size:,}; {GGUF_REMEDY}"
        )
    return GgufHeader(
        path=path,
        version=version,
        **_model_fields(meta),
        tensors=n_tensors,
        data_end=data_end,
        file_bytes=size,
    )


def _quant_sizes() -> dict[int, tuple[int, int]]:
    """(elements, bytes) of a block of each GGML tensor type, by type id (the gguf package's
    table)."""
    from gguf.constants import GGML_QUANT_SIZES

    return {int(kind): sizes for kind, sizes in GGML_QUANT_SIZES.items()}


def _check_magic(fh: BinaryIO, path: Path) -> None:
    """Refuse a file that does not start as a GGUF file does."""
    if fh.read(4) != GGUF_MAGIC:
        raise UserError(
            f"{path}: not a GGUF file (it does not start with 'GGUF'); point "
            "verifier.path at a .gguf model file or a Hugging Face model folder"
        )


def _version(fh: BinaryIO) -> int:
    """The format version, one this reader knows."""
    version = _unpack(fh, "<I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (this reader knows 2 and 3)")
    return version


def _metadata(fh: BinaryIO, n_kv: int, limit: int) -> dict[str, Any]:
    """The ``n_kv`` metadata keys and their values (an array stands for its length)."""
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = _string(fh, limit).decode("utf-8", "replace")
        meta[key] = _value(fh, _unpack(fh, "<I"), limit)
    return meta


def _tensor_end(fh: BinaryIO, limit: int, sizes: dict[int, tuple[int, int]]) -> int:
    """One entry of the tensor table: the offset where its data ends (from the data start);
    ``sizes``: ``_quant_sizes()``."""
    name = _string(fh, limit)
    dims = [_unpack(fh, "<Q") for _ in range(_unpack(fh, "<I"))]
    kind, offset = _unpack(fh, "<I"), _unpack(fh, "<Q")
    if kind not in sizes:
        raise ValueError(f"tensor {name[:80]!r} has unknown type {kind}")
    block, block_bytes = sizes[kind]
    count = 1
    for d in dims:
        count *= d
    return offset + count // block * block_bytes


def _data_start(header_end: int, meta: dict[str, Any]) -> int:
    """The byte where the tensor data starts: the header's end, aligned as the metadata says."""
    align = meta.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise ValueError(f"general.alignment {align!r} is not a power of two")
    return -(-header_end // align) * align


def _model_fields(meta: dict[str, Any]) -> dict[str, Any]:
    """GgufHeader's fields about the model, from the metadata (None: not in it)."""
    arch = meta.get("general.architecture")

    def field(name: str) -> int | None:
        value = meta.get(f"{arch}.{name}")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    vocab = field("vocab_size") or meta.get("tokenizer.ggml.tokens")
    return {
        "architecture": arch if isinstance(arch, str) else None,
        "num_hidden_layers": field("block_count"),
        "hidden_size": field("embedding_length"),
        "max_position_embeddings": field("context_length"),
        "vocab_size": vocab if isinstance(vocab, int) else None,
    }


def safetensors_problem(path: str | Path) -> str | None:
    """Why a safetensors file cannot be whole (cut short, longer than its tensors, not
    safetensors), or None. Reads the header only: its JSON must parse and its tensors' data
    must end where the file ends."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            return f"{size} bytes, too short for a safetensors header"
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            return f"its header claims {n:,} bytes, the file has {size:,}"
        try:
            header = json.loads(fh.read(n))
            end = max(
                (int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"),
                default=0,
            )
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return "its header is not a safetensors header"
    if 8 + n + end != size:  # safetensors refuses bytes after the last tensor, too
        return f"its tensors end at byte {8 + n + end:,}, the file has {size:,}"
    return None
