"""Draft vocabulary: the draft_vocab_size most frequent supervised tokens (speculators' rule).

``d2t[i]`` is an offset: verifier id = i + d2t[i]; ``t2d`` marks the chosen verifier ids.
When fewer distinct tokens were seen than the draft vocab holds, speculators pads with the
lowest unused ids, deterministically.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle3lib.errors import UserError, first_line
from eagle3lib.fileio import atomic_path


def build(token_freq: np.ndarray, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) from dense token counts over the verifier vocab."""
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    vocab_size = len(token_freq)
    if draft_vocab_size > vocab_size:
        raise UserError(
            f"config key train.draft_vocab_size: {draft_vocab_size} is larger than the "
            f"verifier vocab ({vocab_size}); use at most {vocab_size}"
        )
    seen = np.flatnonzero(token_freq)
    counts = {int(t): int(token_freq[t]) for t in seen}
    d2t, t2d = build_vocab_mappings_from_distribution(counts, draft_vocab_size, vocab_size)
    check(d2t, t2d, draft_vocab_size, vocab_size)
    return d2t, t2d


def check(d2t: torch.Tensor, t2d: torch.Tensor, draft_vocab_size: int, vocab_size: int) -> None:
    """The invariants vLLM and speculators rely on; raise ValueError if one fails."""
    if d2t.dim() != 1 or t2d.dim() != 1:
        raise ValueError(
            f"d2t has shape {list(d2t.shape)}, t2d {list(t2d.shape)} (expected 1-D: "
            f"[{draft_vocab_size}] and [{vocab_size}])"
        )
    targets = torch.arange(len(d2t)) + d2t
    if len(d2t) != draft_vocab_size or len(t2d) != vocab_size:
        raise ValueError(
            f"d2t has {len(d2t)} entries (expected {draft_vocab_size}), "
            f"t2d {len(t2d)} (expected {vocab_size})"
        )
    if d2t.dtype != torch.long or t2d.dtype != torch.bool:
        raise ValueError(f"d2t/t2d dtypes {d2t.dtype}/{t2d.dtype}, expected int64/bool")
    if int(t2d.sum()) != draft_vocab_size:
        raise ValueError(f"t2d marks {int(t2d.sum())} tokens, expected {draft_vocab_size}")
    if (
        not bool((targets[1:] > targets[:-1]).all())
        or targets.min() < 0
        or targets.max() >= vocab_size
    ):
        raise ValueError("d2t does not map draft ids to increasing, in-range verifier ids")
    if not torch.equal(torch.nonzero(t2d).flatten(), targets):
        raise ValueError("d2t and t2d disagree")


def coverage(token_freq: np.ndarray, t2d: torch.Tensor) -> dict[str, Any]:
    """How much of the supervised text the draft vocab can express."""
    total = int(token_freq.sum())
    covered = int(token_freq[t2d.numpy()].sum())
    distinct = int((token_freq > 0).sum())
    k = int(t2d.sum())
    return {
        "draft_vocab_size": k,
        "verifier_vocab_size": len(token_freq),
        "distinct_supervised_tokens": distinct,
        "padded_with_unseen_ids": max(0, k - distinct),
        "supervised_tokens": total,
        "token_coverage": covered / total if total else None,
    }


def save(path: Path, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:
        save_file({"d2t": d2t.contiguous(), "t2d": t2d.contiguous()}, str(tmp))


def load(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path))
    except Exception as exc:  # noqa: BLE001 - SafetensorError, OSError
        detail = first_line(exc)
        raise UserError(
            f"{path}: unreadable vocab map ({detail}); delete it and rerun the vocab rule"
        ) from None
    missing = [k for k in ("d2t", "t2d") if k not in tensors]
    if missing:
        raise UserError(
            f"{path}: vocab map lacks {', '.join(missing)}; delete it and rerun the vocab rule"
        )
    return tensors
