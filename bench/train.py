"""Benchmark draft training: this project's train stage against speculators' own trainer.

    python bench/train.py --smoke                       # CPU, tiny shapes, seconds
    python bench/train.py --steps 60                    # one GPU, Llama-3.1-8B verifier shape
    torchrun --nproc-per-node 2 bench/train.py ...      # DDP over 2 GPUs (our stage only)

Both trainers train the same EAGLE-3 draft (1 layer, hidden 4096, draft vocab 32000, 3 TTT
steps, packed sequences of 2048) on the same synthetic hidden-state shards with the same
seed; speculators' data path (multipack sampler, CollateFn, shift_batch) and model are used by
both. Variants:

    ours                  eagle3lib.train.StreamingTrainer, AdamW, metrics every 100 steps
    ours_syncs            the same with speculators' loss metrics as they are (8 host syncs
                          a step; `ours` removes them, eagle3lib.train.sync_free_eagle3)
    speculators_fastest   speculators.train.trainer.Trainer, AdamW, no per-step logging,
                          its loader settings (12 spawn workers, prefetch 4, pinned)
    speculators_cli       speculators' CLI defaults: Muon, logging every step

Real (non-padding) tokens per second are timed between steps --warmup and --steps with the
GPU synchronised at both ends. Prints a table and `key = value` lines; writes
bench_train.json to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LLAMA_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    tie_word_embeddings=False,
)
TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


VARIANTS = (
    "ours",
    "ours_fp8",  # ours on fp8 shards of the same states (extract.storage: fp8)
    "ours_syncs",
    "ours_workers",
    "speculators_fastest",
    "speculators_cli",
)
WITH_WORKERS = ("ours_workers", "speculators_fastest", "speculators_cli")  # loader workers


def make_verifier(path: Path, shape: dict) -> Path:
    """A verifier folder holding only what the draft needs: config, embeddings, norm, lm_head."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    if (path / "model.safetensors").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    LlamaConfig(**shape, architectures=["LlamaForCausalLM"]).save_pretrained(path)
    g = torch.Generator().manual_seed(0)
    v, h = shape["vocab_size"], shape["hidden_size"]
    save_file(
        {
            "model.embed_tokens.weight": (torch.randn(v, h, generator=g) * 0.02).bfloat16(),
            "lm_head.weight": (torch.randn(v, h, generator=g) * 0.02).bfloat16(),
            "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
        },
        str(path / "model.safetensors"),
    )
    return path


def make_shards(
    out: Path, record: dict, lengths: list[int], n_shards: int, seed: int, storage: str = "bf16"
):
    """Synthetic shards in the project's format (random bf16 states, written by ShardWriter;
    the same states, quantized, for fp8 storage)."""
    from eagle3lib import hidden_states
    from eagle3lib.fileio import sha256_file, write_json
    from eagle3lib.verifier import identity

    layers = record["num_hidden_layers"]
    aux = hidden_states.resolve_aux_layers(None, layers)
    h = record["hidden_size"]
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    g = torch.Generator(device=device).manual_seed(seed)
    rng = np.random.default_rng(seed)
    shards, manifests = [], []
    for s in range(n_shards):
        part = lengths[s::n_shards]
        path, mpath = out / f"shard-{s}.safetensors", out / f"shard-{s}.json"
        if not mpath.exists():
            layout = hidden_states.ShardLayout(tuple(part), len(aux) + 1, h, storage=storage)
            writer = hidden_states.ShardWriter(
                path, layout, {}, device=device, max_batch_rows=max(part)
            )
            ids = [rng.integers(0, record["vocab_size"], n) for n in part]
            for i, n in enumerate(part):
                states = torch.randn(
                    1, n, len(aux) + 1, h, generator=g, device=device, dtype=torch.bfloat16
                )
                writer.put_batch([i], states, [n])
            writer.close(np.concatenate(ids), np.ones(sum(part), np.uint8))
            write_json(
                mpath,
                {
                    "verifier": identity(record),
                    "layer_ids": [*aux, layers],
                    "hidden_size": h,
                    "state_dtype": hidden_states.STORAGE_DTYPES[storage],
                    "tokens": sum(part),
                    "rejected": [],
                    "file": {
                        "name": path.name,
                        "bytes": path.stat().st_size,
                        "sha256": sha256_file(path),
                    },
                },
            )
        shards.append(path)
        manifests.append(mpath)
    return shards, manifests


class StepClock:
    """Synchronised timestamps at two steps: the timed window excludes warm-up/compilation.

    After the window, ``sync_steps`` steps run in CUDA's sync debug mode (SyncSites), then
    ``profile_steps`` under torch.profiler, to report how busy the GPU was (kernel time over
    wall time)."""

    def __init__(self, start: int, stop: int, profile_steps: int = 0, sync_steps: int = 0):
        self.start, self.stop, self.step = start, stop, 0
        self.sync_sites = SyncSites(sync_steps) if torch.cuda.is_available() else None
        self.t0 = self.t1 = None
        self.profile_steps = profile_steps if torch.cuda.is_available() else 0
        self.prof = None
        self.gpu_busy = None
        self.table = ""

    def __call__(self):
        self.step += 1
        if self.step in (self.start, self.stop):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            if self.step == self.start:
                self.t0 = time.perf_counter()
            else:
                self.t1 = time.perf_counter()
        # after the timed window: first the sync-debug steps, then the profiled ones
        if self.sync_sites is not None:
            self.sync_sites.at_step(self.step - self.stop)
        after = self.stop + (self.sync_sites.steps if self.sync_sites is not None else 0)
        if self.profile_steps and self.step == after:
            self._profile_start()
        elif self.prof is not None and self.step == after + self.profile_steps:
            self._profile_stop()

    def _profile_start(self):
        try:
            self.prof = torch.profiler.profile(
                activities=[
                    torch.profiler.ProfilerActivity.CPU,
                    torch.profiler.ProfilerActivity.CUDA,
                ]
            )
            self.prof.__enter__()
            self.p0 = time.perf_counter()
        except Exception as exc:  # noqa: BLE001 - profiling is optional
            print(f"profiler unavailable: {exc}", flush=True)
            self.prof = None

    def _profile_stop(self):
        try:
            torch.cuda.synchronize()
            wall = time.perf_counter() - self.p0
            self.prof.__exit__(None, None, None)
            kernels = [
                e for e in self.prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
            ]
            busy = sum(e.device_time for e in kernels) / 1e6  # microseconds -> seconds
            self.gpu_busy = round(busy / wall, 3)
            averages = self.prof.key_averages()
            self.table = "\n".join(
                averages.table(sort_by=key, row_limit=25)
                for key in ("self_cpu_time_total", "self_device_time_total")
            )
        except Exception as exc:  # noqa: BLE001
            print(f"profiler failed: {exc}", flush=True)
        self.prof = None


class SyncSites:
    """Where the training step makes the host wait for the GPU: ``steps`` steps after the timed
    window run under CUDA's sync debug mode, and each synchronising call's Python stack is
    counted (outside the window: recording the stacks takes time)."""

    def __init__(self, steps: int):
        self.steps, self.sites, self._saved = steps, {}, None

    def at_step(self, k: int) -> None:
        """``k``: steps since the timed window ended."""
        if self.steps and k == 0:
            self.start()
        elif k == self.steps:
            self.close()

    def start(self) -> None:
        import warnings

        self._saved = warnings.catch_warnings()  # restores filters and showwarning on exit
        self._saved.__enter__()
        self._show, warnings.showwarning = warnings.showwarning, self._record
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")

    def close(self) -> None:
        if self._saved is not None:
            torch.cuda.set_sync_debug_mode("default")
            self._saved.__exit__(None, None, None)
            self._saved = None

    def _record(self, message, category, filename, lineno, file=None, line=None):
        import traceback

        if "synchroniz" not in str(message):
            return self._show(message, category, filename, lineno, file, line)
        stack = [
            f"{Path(f.filename).name}:{f.lineno} {f.name}"
            for f in traceback.extract_stack()[:-2]
            if "warnings" not in f.filename
        ][-6:]
        key = " <- ".join(reversed(stack))
        self.sites[key] = self.sites.get(key, 0) + 1

    def report(self) -> str:
        per_step = sorted(self.sites.items(), key=lambda kv: -kv[1])
        return "\n".join(f"{n / max(self.steps, 1):5.1f}/step  {k}" for k, n in per_step)


def real_tokens_per_batch(loader, epoch: int, total_seq_len: int) -> list[int]:
    """Real tokens of each batch as CollateFn/shift_batch pack them (same for all variants)."""
    sampler = loader.batch_sampler
    lengths = np.asarray(loader.dataset.approx_lengths)
    out = []
    for batch in sampler._generate_batches(epoch):  # noqa: SLF001
        out.append(int(min(total_seq_len, (lengths[batch] - 1).sum())))
    return out


def run_variant(
    name: str, index: int, args, record, shards, manifests, vocab_map, out: Path
) -> dict:
    from speculators.train import trainer as st

    from eagle3lib import train
    from eagle3lib.config import TrainConfig

    optimizer = "muon" if name == "speculators_cli" else "adamw"
    log_every = {"speculators_fastest": 10**9, "speculators_cli": 1}.get(name, 100)
    cfg = TrainConfig(
        epochs=1,
        total_seq_len=args.total_seq_len,
        draft_vocab_size=args.draft_vocab,
        optimizer=optimizer,
        max_steps=args.steps + args.sync_sites + args.profile_steps + 1,
        log_every=log_every,
        seed=0,
        val_fraction=0.02,
        loader_workers=args.workers if name in WITH_WORKERS else 0,
        loss="eager" if args.eager_loss else "auto",
        fsdp=args.fsdp,
    )
    if args.log_every:  # for comparing loss curves (a host sync per logged step)
        cfg = dataclasses.replace(cfg, log_every=args.log_every)
    clock = StepClock(args.warmup, args.steps, args.profile_steps, args.sync_sites)
    tokens_box = {}

    def timed(cls):
        class TimedTrainer(cls):
            def __init__(self, *a, **k):
                super().__init__(*a, **k)
                tokens_box["per_batch"] = real_tokens_per_batch(
                    self.train_loader, 0, args.total_seq_len
                )
                self.train_epoch = functools.partial(super().train_epoch, step_callback=clock)

            def val_epoch(self, epoch):  # not part of the benchmark
                return None

        return TimedTrainer

    base = train.StreamingTrainer if name.startswith("ours") else st.Trainer
    if name == "ours_syncs":  # the loss metrics with speculators' host syncs, for comparison
        base = type("StreamingTrainerWithSyncs", (base,), {"sync_free": False})
    cls = timed(base)
    state = out / f"state-{name}-{index}"  # a repeated variant never resumes the earlier run
    if state.exists() and os.environ.get("RANK", "0") == "0":  # other ranks wait in train()
        import shutil

        shutil.rmtree(state)
    try:
        stats = train.train(
            cfg,
            record,
            shards,
            manifests,
            vocab_map,
            state,
            state / "metrics.jsonl",
            trainer_class=cls,
        )
    finally:  # training that ended inside the sync-debug steps leaves nothing switched on
        if clock.sync_sites is not None:
            clock.sync_sites.close()
    (out / f"profile-{name}.txt").write_text(clock.table)
    if clock.sync_sites is not None and clock.sync_sites.steps:
        (out / f"sync-sites-{name}.txt").write_text(clock.sync_sites.report() + "\n")
        print(f"sync sites ({name}):\n{clock.sync_sites.report()}", flush=True)
    per_batch = tokens_box["per_batch"]
    tokens = sum(per_batch[args.warmup : args.steps])
    seconds = clock.t1 - clock.t0
    processes = stats.get("processes", 1)
    if processes > 1:  # every rank trained its own batches: add them up
        import torch.distributed as dist

        both = torch.tensor(
            [float(tokens), seconds], device="cuda" if torch.cuda.is_available() else "cpu"
        )
        dist.all_reduce(both)
        tokens, seconds = int(both[0]), float(both[1]) / processes
    curve = None
    if args.log_every:
        curves = train.loss_curves(train.read_metrics(state / "metrics.jsonl"))
        curve = {"step": curves["step"], "train_loss": curves["train_loss"]}
    kind = "fsdp" if args.fsdp else "ddp"
    return {
        "variant": name + (f"_{kind}{processes}" if processes > 1 else ""),
        "total_seq_len": args.total_seq_len,
        "loss_curve": curve,
        "processes": processes,
        "optimizer": optimizer,
        "steps_timed": args.steps - args.warmup,
        "real_tokens": tokens,
        "seconds": round(seconds, 3),
        "ms_per_step": round(1000 * seconds / (args.steps - args.warmup), 2),
        "tokens_per_s": round(tokens / seconds),
        "data_wait_fraction": stats.get("data_wait_fraction") if name.startswith("ours") else None,
        "gpu_busy_fraction": clock.gpu_busy,
        "attention": stats["attention"],
        "loss_implementation": stats["loss_implementation"],
    }


def paired_speedups(
    results: list[dict], a: str = "ours", b: str = "speculators_fastest"
) -> list[float]:
    """Tokens/s of the i-th run of variant ``a`` over the i-th run of ``b``."""
    first = [r["tokens_per_s"] for r in results if r["variant"] == a]
    second = [r["tokens_per_s"] for r in results if r["variant"] == b]
    return [round(x / y, 3) for x, y in zip(first, second, strict=False)]


def device_tag() -> str:
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name(0).lower()
    return "h200" if "h200" in name else "gpu"


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--variants", default="ours,speculators_fastest,speculators_cli,ours_workers")
    p.add_argument("--samples", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--total-seq-len", type=int, default=None)
    p.add_argument("--draft-vocab", type=int, default=None)
    p.add_argument("--workers", type=int, default=12)
    p.add_argument("--profile-steps", type=int, default=5, help="steps profiled after the window")
    p.add_argument(
        "--sync-sites",
        type=int,
        default=0,
        help="steps after the timed ones run in CUDA sync debug mode; lists where the host waits",
    )
    p.add_argument(
        "--baseline", default=None, help="bench_train.json of a 1-GPU run (DDP efficiency)"
    )
    p.add_argument(
        "--eager-loss", action="store_true", help="torch 2.11: the fused loss breaks compile"
    )
    p.add_argument("--fsdp", action="store_true", help="shard the draft over the ranks (FSDP2)")
    p.add_argument(
        "--log-every", type=int, default=None, help="log the loss every N steps (loss curves)"
    )
    p.add_argument("--out", default=os.environ.get("BENCH_DIR", "/tmp/eagle3-bench-train"))
    args = p.parse_args()
    smoke = args.smoke
    args.samples = args.samples or (48 if smoke else 400)
    args.steps = args.steps or (12 if smoke else 60)
    args.warmup = args.warmup or (3 if smoke else 10)
    args.total_seq_len = args.total_seq_len or (256 if smoke else 2048)
    args.draft_vocab = args.draft_vocab or (128 if smoke else 32000)
    if smoke:
        args.workers = 0

    names = args.variants.split(",")
    if unknown := sorted(set(names) - set(VARIANTS)):
        p.error(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")

    from eagle3lib import vocab
    from eagle3lib.verifier import materialize

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shape = TINY if smoke else LLAMA_8B
    verifier = make_verifier(out / "verifier", shape)
    record = materialize(str(verifier), "bench-verifier", out / "unused")
    rng = np.random.default_rng(0)
    low, high = (32, 200) if smoke else (256, 2048)
    lengths = [int(x) for x in rng.integers(low, high + 1, args.samples)]
    shards, manifests = make_shards(out, record, lengths, 4, seed=0)
    fp8 = None
    if "ours_fp8" in names:
        (out / "fp8").mkdir(exist_ok=True)
        fp8 = make_shards(out / "fp8", record, lengths, 4, seed=0, storage="fp8")
    freq = np.bincount(rng.integers(0, shape["vocab_size"], 200000), minlength=shape["vocab_size"])
    d2t, t2d = vocab.build(freq, args.draft_vocab)

    results = []
    for index, name in enumerate(names):
        data = fp8 if name == "ours_fp8" else (shards, manifests)
        results.append(run_variant(name, index, args, record, *data, {"d2t": d2t, "t2d": t2d}, out))
        print(json.dumps(results[-1]), flush=True)
    from eagle3lib import train

    rank = int(os.environ.get("RANK", "0"))
    train.teardown_distributed()
    if rank != 0:
        return
    summary = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "results": results,
    }
    pairs = paired_speedups(results)
    if pairs:
        # repeated variants (ours,speculators_fastest,ours,...) pair up in order; the median
        # of the pairs is the figure, so one slow run does not decide it
        summary["speedups_per_pair"] = pairs
        summary["speedup_vs_speculators"] = round(float(np.median(pairs)), 3)
    kind = "fsdp" if args.fsdp else "ddp"
    name = "bench_train" + (
        f"_{kind}{results[0]['processes']}" if results[0]["processes"] > 1 else ""
    )
    (out / f"{name}.json").write_text(json.dumps(summary, indent=2))
    if args.baseline and results[0]["processes"] > 1:
        single = json.loads(Path(args.baseline).read_text())
        one = next(r for r in single["results"] if r["variant"] == "ours")["tokens_per_s"]
        eff = results[0]["tokens_per_s"] / (results[0]["processes"] * one)
        tag = f"{results[0]['processes']}x{device_tag()}" + (".fsdp" if args.fsdp else "")
        print(f"train.{tag}.tokens_per_s = {results[0]['tokens_per_s']}")
        print(f"train.{tag}.scaling_efficiency = {eff:.3f}")
    print(f"{'variant':22s} {'optimizer':9s} {'ms/step':>8s} {'tokens/s':>9s}")
    for r in results:
        print(
            f"{r['variant']:22s} {r['optimizer']:9s} {r['ms_per_step']:8.1f} {r['tokens_per_s']:9d}"
        )
    ours = [r for r in results if r["variant"] == "ours"]
    if ours:  # the median run of ours (the middle one of an odd number of repeats)
        mid = sorted(ours, key=lambda r: r["tokens_per_s"])[(len(ours) - 1) // 2]
        print(f"train.{device_tag()}.tokens_per_s = {mid['tokens_per_s']}")
        print(f"train.data_wait_fraction = {mid['data_wait_fraction']:.4f}")
    if len(pairs) > 1:
        print("speedup per pair: " + ", ".join(f"{x:.3f}" for x in pairs))
    if "speedup_vs_speculators" in summary:
        print(f"train.{device_tag()}.speedup_vs_speculators = {summary['speedup_vs_speculators']}")
    fp8 = paired_speedups(results, "ours_fp8", "ours")
    if fp8:  # the same states from fp8 shards (dequantized on the GPU) against bf16 shards
        print("fp8 / bf16 per pair: " + ", ".join(f"{x:.3f}" for x in fp8))
        print(f"train.{device_tag()}.fp8_vs_bf16_tokens_per_s = {float(np.median(fp8)):.3f}")


if __name__ == "__main__":
    main()
