"""Compare two training loss curves (bench/train.py --log-every 1 results).

    python bench/compare_curves.py bench_train.json bench_train_ddp2.json

Used to check that DDP over N GPUs at the same global batch (N packed sequences of L tokens)
trains like one GPU with one packed sequence of N x L tokens: prints the loss of both, smoothed
over a window, and their largest relative difference, as `key = value` lines.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np


def smoothed(values: list[float], window: int) -> np.ndarray:
    v = np.asarray(values, dtype=np.float64)
    kernel = np.ones(window) / window
    return np.convolve(v, kernel, mode="valid")


def curve(path: str) -> tuple[str, list[float]]:
    result = json.loads(Path(path).read_text())["results"][0]
    return result["variant"], result["loss_curve"]["train_loss"]


def main() -> None:
    (name_a, a), (name_b, b) = curve(sys.argv[1]), curve(sys.argv[2])
    window = int(sys.argv[3]) if len(sys.argv) > 3 else 10
    n = min(len(a), len(b))
    sa, sb = smoothed(a[:n], window), smoothed(b[:n], window)
    rel = np.abs(sa - sb) / np.abs(sa)
    print(f"{'step':>5s} {name_a:>14s} {name_b:>14s}")
    for i in range(0, len(sa), max(1, len(sa) // 10)):
        print(f"{i + window:5d} {sa[i]:14.4f} {sb[i]:14.4f}")
    print(f"loss_curve.steps = {n}")
    print(f"loss_curve.{name_a}.first_last = {sa[0]:.4f} {sa[-1]:.4f}")
    print(f"loss_curve.{name_b}.first_last = {sb[0]:.4f} {sb[-1]:.4f}")
    print(f"loss_curve.max_relative_difference_smoothed{window} = {rel.max():.4f}")
    print(f"loss_curve.mean_relative_difference_smoothed{window} = {rel.mean():.4f}")


if __name__ == "__main__":
    main()
