"""The shard file format: layout, encoding, reading, checking.

A shard is one safetensors file whose layout is fixed before the forward passes start. Batches
(sorted by length, right-padded) are computed in ``order``, and their states are stored in that
same order, so the file is written front to back by a background thread while the next batch
computes, and its sha256 is computed on the way (no read-back):

    hidden_states [tokens, len(aux)+1, hidden] bf16   (aux layers in config order, then final;
                                                        rows in processing order)
    input_ids     [tokens] int32                       (sample order)
    loss_mask     [tokens] uint8                       (sample order)
    offsets       [samples+1] int64                    sample i's tokens = offsets[i]:offsets[i+1]
    row_starts    [samples] int64                      sample i's states start at this row
    valid         [samples] uint8                      0 = rejected (non-finite states)
    hidden_scales [tokens, len(aux)+1] float32         fp8 storage only (below)

With ``extract.storage: fp8`` the states are float8 e4m3 with one float32 scale per token and
layer slot: a row of the bf16 states divided by amax(|row|)/448 (448 is e4m3's largest value),
so every row uses e4m3's whole range; its states read back as values x scale. Half the bytes of
bf16. The scales are small (16 bytes a token at 4 slots) and written with the tail tensors.

The file is written under a temporary name and renamed when complete; ``shard-<i>.json`` (the
manifest) records what made it and the file's size and sha256. Shards of format 1 (states in
sample order, no ``row_starts``) are still read.

The layout is planned without torch (``rules/common.smk`` sizes shards at planning time), so
this module imports torch only where a tensor is made; ``shard_writer`` writes the files.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from eagle3lib.errors import UserError
from eagle3lib.fileio import sha256_bytes, sha256_file, sha256_json

if TYPE_CHECKING:
    import torch

SHARD_FORMAT = "eagle3lib.shard/2"
STORAGE_DTYPES = {"bf16": "bfloat16", "fp8": "float8_e4m3fn"}  # manifest state_dtype


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """Shapes and byte offsets of a shard. ``order`` is the order in which samples' states are
    put and stored (default: sample order)."""

    lengths: tuple[int, ...]
    n_layers: int
    hidden: int
    order: tuple[int, ...] | None = None
    storage: str = "bf16"  # or "fp8" (e4m3 values, a float32 scale per token and layer slot)

    def __post_init__(self):
        if self.order is not None and sorted(self.order) != list(range(len(self.lengths))):
            raise ValueError("ShardLayout.order must be a permutation of the sample indices")
        if self.storage not in STORAGE_DTYPES:
            raise ValueError(f"ShardLayout.storage must be one of {sorted(STORAGE_DTYPES)}")

    @property
    def fp8(self) -> bool:
        return self.storage == "fp8"

    @property
    def tokens(self) -> int:
        return int(sum(self.lengths))

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's states."""
        return self.n_layers * self.hidden * (1 if self.fp8 else 2)

    @property
    def bytes_per_token(self) -> float:
        """Bytes per token of the whole file, but for its header and per-sample tensors."""
        return self.row_bytes + 4 + 1 + (4 * self.n_layers if self.fp8 else 0)

    @property
    def put_order(self) -> tuple[int, ...]:
        return self.order if self.order is not None else tuple(range(len(self.lengths)))

    def row_starts(self) -> np.ndarray:
        """First state row of each sample (in sample order)."""
        starts = np.zeros(len(self.lengths), dtype=np.int64)
        row = 0
        for i in self.put_order:
            starts[i] = row
            row += self.lengths[i]
        return starts

    def tensors(self) -> list[tuple[str, str, list[int], int]]:
        n, t, slots = len(self.lengths), self.tokens, self.n_layers
        dtype = "F8_E4M3" if self.fp8 else "BF16"
        tensors = [
            ("hidden_states", dtype, [t, slots, self.hidden], t * self.row_bytes),
            ("input_ids", "I32", [t], 4 * t),
            ("loss_mask", "U8", [t], t),
            ("offsets", "I64", [n + 1], 8 * (n + 1)),
            ("row_starts", "I64", [n], 8 * n),
            ("valid", "U8", [n], n),
        ]
        if self.fp8:
            tensors.append(("hidden_scales", "F32", [t, slots], 4 * t * slots))
        return tensors

    def header(self, metadata: dict[str, str]) -> bytes:
        entries: dict[str, Any] = {"__metadata__": metadata}
        pos = 0
        for name, dtype, shape, nbytes in self.tensors():
            entries[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + nbytes]}
            pos += nbytes
        raw = json.dumps(entries, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        return struct.pack("<Q", len(raw)) + raw

    def data_bytes(self) -> int:
        return sum(nbytes for *_, nbytes in self.tensors())


def disk_estimate(hidden: int, slots: int, storage: str, tokens: int | None = None) -> str:
    """One line: shard bytes per token for this verifier shape and storage, and the total for
    ``tokens`` (or per 10 M tokens while the count is not known)."""
    per = ShardLayout((1,), slots, hidden, storage=storage).bytes_per_token
    other = "fp8" if storage == "bf16" else "bf16"
    alt = ShardLayout((1,), slots, hidden, storage=other).bytes_per_token
    line = (
        f"hidden states: {per:,} bytes a token ({slots} slots of {hidden} in {storage}; "
        f"extract.storage: {other} would take {alt:,})"
    )
    if tokens:
        return line + f"; the {tokens:,} prepared tokens need {tokens * per / 1e9:,.1f} GB"
    return line + f"; {1e7 * per / 1e9:,.0f} GB per 10 M tokens (prepare counts the tokens)"


# ---- encoding, reading and checking ----------------------------------------------------------


FP8_MAX = 448.0  # e4m3's largest finite value


def quantize_fp8(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, float32 scales) of ``states`` [..., hidden], one scale per row: what the
    bf16 shard would hold, divided by amax(|row|)/448. A zero row gets scale 1."""
    import torch

    x = states.to(torch.bfloat16).float()
    amax = x.abs().amax(-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (x / scale.unsqueeze(-1)).to(torch.float8_e4m3fn), scale


def dequantize_fp8(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """States [..., hidden] in ``dtype`` from e4m3 values (or their bytes, uint8) and scales."""
    import torch

    if values.dtype == torch.uint8:
        values = values.view(torch.float8_e4m3fn)
    return (values.float() * scales.unsqueeze(-1)).to(dtype)


@dataclasses.dataclass
class Shard:
    """A shard opened memory-mapped; nothing is read until a sample is sliced."""

    path: Path
    hidden_states: torch.Tensor  # [tokens, layers, hidden] bf16, mmap-backed
    input_ids: np.ndarray
    loss_mask: np.ndarray
    offsets: np.ndarray
    row_starts: np.ndarray  # where each sample's states start (format 1: offsets[:-1])
    valid: np.ndarray
    scales: np.ndarray | None = None  # fp8 storage: [tokens, layers] float32, in row order

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def length(self, i: int) -> int:
        return int(self.offsets[i + 1] - self.offsets[i])

    def sample(self, i: int) -> dict[str, Any]:
        import torch

        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        row = int(self.row_starts[i])
        item = {
            "hidden_states": self.hidden_states[row : row + b - a],
            "input_ids": torch.from_numpy(self.input_ids[a:b].astype(np.int64)),
            "loss_mask": torch.from_numpy(self.loss_mask[a:b].astype(bool)),
        }
        if self.scales is not None:  # e4m3 values, and their scales
            item["hidden_scales"] = torch.from_numpy(self.scales[row : row + b - a])
        return item

    @property
    def storage(self) -> str:
        return "fp8" if self.scales is not None else "bf16"

    def states(self, i: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Sample i's states [len, layers, hidden] as values in ``dtype`` (default bf16; fp8
        dequantized)."""
        import torch

        dtype = dtype or torch.bfloat16
        item = self.sample(i)
        if self.scales is None:
            return item["hidden_states"].to(dtype)
        return dequantize_fp8(item["hidden_states"], item["hidden_scales"], dtype)


def read_header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise UserError(f"{path}: truncated shard (no header); delete it and rerun")
        (n,) = struct.unpack("<Q", head)
        raw = fh.read(n)
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"{path}: corrupt shard header; delete it and rerun") from None


def open_shard(path: Path) -> Shard:
    header = read_header(path)
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
    start = 8 + n
    size = path.stat().st_size
    end = max(meta["data_offsets"][1] for k, meta in header.items() if k != "__metadata__")
    if size != start + end:
        raise UserError(
            f"{path}: shard is {size} bytes but its header describes {start + end}; "
            "it is truncated or corrupt: delete it and rerun"
        )
    import torch

    mm = np.memmap(path, dtype=np.uint8, mode="c")  # copy-on-write: torch wants writable

    def view(name: str, dtype) -> np.ndarray:
        a, b = header[name]["data_offsets"]
        return mm[start + a : start + b].view(dtype).reshape(header[name]["shape"])

    fp8 = header["hidden_states"]["dtype"] == "F8_E4M3"
    hs = view("hidden_states", np.uint8 if fp8 else np.uint16)
    hidden_states = torch.from_numpy(hs).view(torch.float8_e4m3fn if fp8 else torch.bfloat16)
    offsets = view("offsets", np.int64)
    return Shard(
        path=path,
        hidden_states=hidden_states,
        input_ids=view("input_ids", np.int32),
        loss_mask=view("loss_mask", np.uint8),
        offsets=offsets,
        row_starts=view("row_starts", np.int64) if "row_starts" in header else offsets[:-1],
        valid=view("valid", np.uint8),
        scales=view("hidden_scales", np.float32) if fp8 else None,
    )


def check_shard(shard_path: Path, manifest: dict[str, Any], *, full_hash: bool = True) -> None:
    """The shard is the one its manifest describes (size, sha256); raise UserError if not."""
    if not shard_path.exists():
        raise UserError(f"{shard_path}: missing shard; rerun the workflow to rebuild it")
    f = manifest["file"]
    size = shard_path.stat().st_size
    if size != f["bytes"]:
        raise UserError(
            f"{shard_path}: {size} bytes, manifest says {f['bytes']}: truncated or replaced; "
            "delete it and its manifest and rerun"
        )
    if full_hash and sha256_file(shard_path) != f["sha256"]:
        raise UserError(
            f"{shard_path}: content does not match the sha256 in its manifest (corrupt); "
            "delete it and its manifest and rerun"
        )


def check_manifest(manifest: dict[str, Any], expect: dict[str, Any], where: str) -> None:
    """Fail if a shard was made for another verifier, layer set, hidden size or storage."""
    for key in ("verifier", "layer_ids", "hidden_size", "state_dtype"):
        if key in expect and manifest.get(key) != expect[key]:
            raise UserError(
                f"{where}: shard was extracted with {key}={manifest.get(key)!r}, the config "
                f"expects {expect[key]!r}; delete results for this run's hidden states and rerun"
            )


def input_hash(
    input_ids: np.ndarray, loss_mask: np.ndarray, offsets: np.ndarray, spec: dict[str, Any]
) -> str:
    """Hash of everything that determines a shard's bytes."""
    tokens = sha256_bytes(
        np.ascontiguousarray(input_ids, dtype=np.int32).tobytes()
        + np.ascontiguousarray(loss_mask, dtype=np.uint8).tobytes()
        + np.ascontiguousarray(offsets, dtype=np.int64).tobytes()
    )
    return sha256_json({"tokens": tokens, **spec})
