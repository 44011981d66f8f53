"""Does a stopped and resumed `train` job end with an uninterrupted run's bytes on a GPU?

    bench/gpu_setup.sh pack                            # here: wheels -> .xfer/
    eval "$(bench/gpu_setup.sh install)"               # on the GPU machine
    python3 bench/resume.py --out /tmp/o/resume        # one GPU, Llama-3.1-8B verifier shape
    python bench/resume.py --smoke --out /tmp/resume   # CPU, tiny shape: checks this script

On a CPU the tests show it (tests/test_train.py: SIGTERM mid-epoch, SIGINT at an epoch's end,
SIGTERM after the last step). This runs the same check where users train: the workflow's
default recipe (``TrainConfig``'s defaults: Muon, ffd packing, ``graph_step: auto``, which on
one GPU captures the step into a CUDA graph) on synthetic shards (bench/train.py's), 2 epochs,
metrics every step, in one process:

    reference    trained from scratch to the end
    again        the same again: whether training on this GPU is repeatable at all
    mid_epoch    SIGTERM after step --stop-at; the job saves and exits 143; then resumed
    epoch_end    SIGINT after the first epoch's last step (exit 130); then resumed

A stopped run must have exited as the train job does (128 + the signal) and resumed, and
no step may be logged twice (the script stops otherwise). Each run's final epoch folder is
compared file by file with the reference's (sha256), its
``model.safetensors`` tensor by tensor (the largest absolute difference), and its losses with
the reference's (the first step that differs, the largest relative difference). With
``--deterministic`` two more runs train under ``torch.use_deterministic_algorithms(True,
warn_only=True)`` (not what the train job runs) and are compared with each other; torch's
warnings name the operations that have no deterministic implementation.
Prints a table and ``key = value`` lines (resume.<device>.*); writes bench_resume.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the workflow's jobs run

import numpy as np  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import train as bench_train  # noqa: E402
from extract import device_tag  # noqa: E402

from eagle3lib.config import TrainConfig  # noqa: E402
from eagle3lib.fileio import sha256_file  # noqa: E402


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("/tmp/o/resume"))
    p.add_argument("--samples", type=int, default=60, help="synthetic samples (256-2048 tokens)")
    p.add_argument("--stop-at", type=int, default=7, help="mid_epoch's last step before its stop")
    p.add_argument("--deterministic", action="store_true", help="also two deterministic runs")
    p.add_argument("--smoke", action="store_true", help="tiny shape on the CPU")
    return p.parse_args(argv)


def stopping_trainer(at: int | None, signum: int):
    """The train job's trainer sending itself ``signum`` once ``at`` steps are done (as
    tests/test_train.py's SignalledAt; ``at`` None: never)."""
    from eagle3lib.streaming_trainer import StreamingTrainer

    class Stopping(StreamingTrainer):
        def train_epoch(self, epoch, *, step_callback=None):
            def callback():
                if self.global_step == at:
                    signal.raise_signal(signum)

            super().train_epoch(epoch, step_callback=callback)

    return Stopping


def folder_digests(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): sha256_file(p) for p in sorted(folder.rglob("*")) if p.is_file()
    }


def weights_difference(a: Path, b: Path) -> float:
    """The largest absolute difference between two model.safetensors files' tensors."""
    from safetensors.torch import load_file

    x, y = load_file(str(a)), load_file(str(b))
    assert x.keys() == y.keys(), sorted(x.keys() ^ y.keys())
    return max(
        (float((x[k].double() - y[k].double()).abs().max()) for k in x if x[k].numel()), default=0.0
    )


def losses(metrics: Path) -> list[float]:
    from eagle3lib import train

    return train.loss_curves(train.read_metrics(metrics))["train_loss"]


def loss_difference(a: list[float], b: list[float]) -> tuple[int | None, float]:
    """The first step (0-based) whose losses differ, and the largest relative difference."""
    assert len(a) == len(b), (len(a), len(b))
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
    worst = max((abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b, strict=True)), default=0.0)
    return first, worst


def compare(reference: dict, run: dict) -> dict:
    """What a run's final epoch folder and losses share with the reference's."""
    a, b = reference["digests"], run["digests"]
    first, worst = loss_difference(reference["losses"], run["losses"])
    return {
        "files_equal": a == b,
        "files_differing": sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k)),
        "weights_max_abs_difference": weights_difference(
            reference["final"] / "model.safetensors", run["final"] / "model.safetensors"
        ),
        "first_differing_step": first,
        "losses_max_relative_difference": worst,
    }


def main(argv=None) -> int:
    args = parse(argv)
    from eagle3lib import train, vocab
    from eagle3lib.verifier import allow_recompiles, materialize

    started = time.perf_counter()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    shape = bench_train.TINY if args.smoke else bench_train.LLAMA_8B
    verifier = bench_train.make_verifier(out / "verifier", shape)
    record = materialize(str(verifier), "bench-verifier", out / "unused")
    rng = np.random.default_rng(0)
    low, high = (32, 200) if args.smoke else (256, 2048)
    lengths = [int(x) for x in rng.integers(low, high + 1, args.samples)]
    # make_shards reuses a folder's shards: one folder a sample count
    (out / f"shards-{args.samples}").mkdir(exist_ok=True)
    shards, manifests = bench_train.make_shards(
        out / f"shards-{args.samples}", record, lengths, 2, 0
    )
    draft_vocab = 64 if args.smoke else 32000
    v = shape["vocab_size"]
    d2t, t2d = vocab.build(np.bincount(rng.integers(0, v, 200000), minlength=v), draft_vocab)
    vocab_map = {"d2t": d2t, "t2d": t2d}
    cfg = TrainConfig(
        epochs=2,
        total_seq_len=512 if args.smoke else 2048,
        draft_vocab_size=draft_vocab,
        seed=0,
        val_fraction=0.05,
        log_every=1,  # every step's loss
    )
    allow_recompiles(1024)

    def run(name: str, at: int | None = None, signum: int = signal.SIGTERM) -> dict:
        state = out / name
        shutil.rmtree(state, ignore_errors=True)
        t0 = time.perf_counter()
        exit_code = None
        kwargs = {"trainer_class": stopping_trainer(at, signum)} if at is not None else {}
        if at is not None:
            try:
                train.train(cfg, record, shards, manifests, vocab_map, state, state / "m.jsonl",
                            **kwargs)  # fmt: skip
            except SystemExit as stop:
                exit_code = stop.code
        stats = train.train(cfg, record, shards, manifests, vocab_map, state, state / "m.jsonl")
        final = Path(stats["final_epoch_dir"])
        if at is not None and (exit_code != 128 + signum or stats["resumed"] is not True):
            raise SystemExit(f"{name}: the stop after step {at} did not happen as asked (exit "
                             f"{exit_code}, resumed {stats['resumed']})")  # fmt: skip
        logged = [m["global_step"] for m in train.read_metrics(state / "m.jsonl") if "train" in m]
        if logged != sorted(set(logged)):
            raise SystemExit(f"{name}: a step ran twice or out of order: {logged}")
        return {
            "name": name,
            "stopped_after": at,
            "exit_code": exit_code,
            "resumed": stats["resumed"],
            "graph_step": stats.get("graph_step"),
            "final": final,
            "digests": folder_digests(final),
            "losses": losses(state / "m.jsonl"),
            "seconds": round(time.perf_counter() - t0, 1),
        }

    rows = []
    reference = run("reference")
    steps = len(reference["losses"])
    first_epoch = len(
        [
            m
            for m in train.read_metrics(out / "reference" / "m.jsonl")
            if "train" in m and m["epoch"] == 0
        ]
    )
    if not 0 < args.stop_at < first_epoch:
        raise SystemExit(
            f"--stop-at {args.stop_at}: give a step inside the first epoch (1-{first_epoch - 1})"
        )

    def keep(result: dict, against: dict) -> None:
        row = {k: v for k, v in result.items() if k not in ("final", "digests", "losses")}
        row.update(compare(against, result))
        rows.append(row)
        print(json.dumps(row), flush=True)

    for name, at, signum in (("again", None, signal.SIGTERM),
                             ("mid_epoch", args.stop_at, signal.SIGTERM),
                             ("epoch_end", first_epoch, signal.SIGINT)):  # fmt: skip
        keep(run(name, at, signum), reference)
        shutil.rmtree(out / name)  # GBs of training state an epoch (a GPU machine's disk)
    caught: list[str] = []
    if args.deterministic:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.use_deterministic_algorithms(True, warn_only=True)
            try:
                first = run("deterministic_1")
                keep(run("deterministic_2"), first)
            finally:
                torch.use_deterministic_algorithms(False)
                for name in ("deterministic_1", "deterministic_2"):
                    shutil.rmtree(out / name, ignore_errors=True)
        caught = sorted({str(w.message).split("\n")[0][:300] for w in seen
                         if "deterministic" in str(w.message)})  # fmt: skip
    tag = device_tag()
    lines = [f"{'run':<16}{'stopped':>8}{'exit':>6}{'files equal':>13}{'max |dw|':>11}"
             f"{'1st loss diff':>15}{'max rel':>10}{'s':>7}"]  # fmt: skip
    for r in rows:
        lines.append(
            f"{r['name']:<16}{r['stopped_after'] or '-':>8}{r['exit_code'] or '-':>6}"
            f"{str(r['files_equal']):>13}{r['weights_max_abs_difference']:>11.3g}"
            f"{r['first_differing_step'] if r['first_differing_step'] is not None else '-':>15}"
            f"{r['losses_max_relative_difference']:>10.2g}{r['seconds']:>7}"
        )
    for r in rows:
        if r["files_differing"]:
            lines.append(f"{r['name']}: differing files: {', '.join(r['files_differing'])}")
    lines += [f"nondeterministic operation: {w}" for w in caught]
    lines.append(f"steps: {steps} ({first_epoch} in the first epoch); graph_step: "
                 f"{reference['graph_step']}; reference {reference['seconds']} s")  # fmt: skip
    for r in rows:
        lines.append(f"resume.{tag}.{r['name']}.files_equal = {str(r['files_equal']).lower()}")
        lines.append(f"resume.{tag}.{r['name']}.weights_max_abs_difference = "
                     f"{r['weights_max_abs_difference']:.3g}")  # fmt: skip
    summary = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "steps": steps,
        "first_epoch_steps": first_epoch,
        "reference_seconds": reference["seconds"],
        "runs": rows,
        "nondeterministic_operations": caught,
        "wall_s": round(time.perf_counter() - started),
    }
    (out / "bench_resume.json").write_text(json.dumps(summary, indent=2))
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
