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
    eval_set: str | None = None,
) -> None:
    """The headline set's (``eval_set``, at ``k``) per-position acceptance; beside it, where its
    prompts have categories (MT-bench's), each category's acceptance length."""
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
    ax.set_title(f"Per-position acceptance ({eval_set + ', ' if eval_set else ''}k={k})")
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


def loss_points(curves: dict[str, Any]) -> tuple[tuple[list, list], tuple[list, list]]:
    """(steps, losses) of training and of validation for loss.png: steps counted from 1, as
    the train job's log counts them; an epoch's validation loss at its last logged step."""
    steps = [s + 1 for s in curves["step"]]
    # later steps of an epoch win; curves of a summary written before step_epoch have none
    last = dict(zip(curves.get("step_epoch", []), steps, strict=False))
    val = [
        (last[v["epoch"]], v["loss_epoch"])
        for v in curves.get("val", [])
        if v.get("epoch") in last and "loss_epoch" in v
    ]
    return (steps, list(curves["train_loss"])), ([x for x, _ in val], [y for _, y in val])


def plot_loss(curves: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    train, val = loss_points(curves)
    ax.plot(*train, label="train (logged steps)", lw=1)
    if val[0]:
        ax.plot(*val, "o-", label="validation (epoch's end)", lw=1)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (summed over TTT steps)")
    ax.set_title("Training loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)
