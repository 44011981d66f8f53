"""reports/acceptance.png (per position, and per category where the headline set has them) and
loss.png (matplotlib's Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_acceptance(
    per_position: list[float],
    k: int,
    path: Path,
    by_category: dict[str, dict[str, Any]] | None = None,
) -> None:
    """Per-position acceptance; beside it, where the headline set's prompts have categories
    (MT-bench's), each category's acceptance length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if by_category:
        fig, (ax, cats) = plt.subplots(1, 2, figsize=(10, 3), width_ratios=(1, 1.4))
    else:
        fig, ax = plt.subplots(figsize=(4.5, 3))
    ax.bar([str(i + 1) for i in range(k)], per_position, color="#3b7dd8")
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1)
    ax.set_title("Per-position acceptance")
    if by_category:
        names = list(by_category)
        cats.barh(names, [by_category[n]["acceptance_length"] for n in names], color="#3b7dd8")
        cats.invert_yaxis()  # the eval file's order, top down
        cats.set_xlim(1, k + 1)
        cats.set_xlabel(f"acceptance length (k={k})")
        cats.set_title("By category")
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)


def plot_loss(curves: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    ax.plot(curves["step"], curves["train_loss"], label="train", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("Training loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)
