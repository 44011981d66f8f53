"""The shard file's layout: tensors, byte offsets and header, for bf16 or fp8 storage.

Kept free of torch so that planning (``rules/common.smk``) can size shards without importing
it; ``eagle3lib.hidden_states`` writes and reads the files.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from typing import Any

import numpy as np

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
