"""Wrapper fidelity (not a quality comparison): this project's train stage vs speculators' own CLI,
trained from the identical hidden states and vocab map, scored by the same offline evaluator.

    # the finished demo run (about 40 minutes on 2 CPU cores: 4 trainings, 4 evaluations)
    .venv/bin/python bench/quality_parity.py --run-dir /tmp/fresh_demo/results/demo \\
        --config /tmp/fresh_demo/config.yaml --work /tmp/quality_parity --seeds 42 43

    # a tiny locally built verifier end to end (about 80 s on 2 CPU cores)
    .venv/bin/python bench/quality_parity.py --smoke

For a finished workflow run (``results/<run>``) and its config this

1. converts the run's shards into speculators' CLI data format: an HF ``datasets`` Arrow
   dataset (``input_ids`` List(int32), ``loss_mask`` List(int64), ``seq_len`` int64, torch
   format, exactly what ``speculators prepare-data`` writes) whose row order is the order our
   trainer uses (shard by shard, valid samples; the last ``val_fraction`` is validation in
   both), plus ``hidden_states/hs_{row}.safetensors`` with ``hidden_states`` [seq, L, hidden]
   (bf16, as stored in the shards and as vLLM writes them) and ``token_ids`` int64; the run's
   vocab map becomes ``d2t-<K>.npy``/``t2d-<K>.npy``. It then reads every row back through
   speculators' own ``ArrowDataset`` and checks it equals what our ``ShardDataset`` serves,
   and that both multipack samplers give the same training batches;
2. trains (a) with our stage: ``scripts/train.py`` with the config's train section, exactly as
   the workflow's train rule runs it (and exports the checkpoint), but packed by speculators'
   multipack sampler (``train.packing: multipack``; the workflow's default is ffd), as its CLI
   packs;
3. trains (b) with speculators' real CLI entry, ``speculators.train.cli.main(
   TrainConfig.resolve(argv))``, with the same hyper-parameters, plus what a CPU needs
   (``eagle3lib.speculators_compat.cpu_trainer_patches()``, and the attention, loss and
   dtype our stage resolves on this machine: sdpa, eager, float32 on a CPU, where the CLI's default bfloat16
   would run without autocast; no loader workers; ``--on-missing raise``); everything else is
   the CLI's default. Its final epoch is exported with ``eagle3lib.checkpoint.export``;
4. evaluates both checkpoints with ``eagle3lib.evaluate.evaluate`` on the held-out prompts and
   settings of the workflow's evaluate rule (as ``scripts/evaluate.py`` does);
5. repeats for every seed; prints a table and ``key = value`` lines and writes a JSON.

Each training and each evaluation runs in its own Python process. Finished steps are reused
when the script is rerun with the same --work (``--force`` redoes them).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TRAINERS = ("ours", "speculators_cli")
SCHEMA = ROOT / "rules" / "schemas" / "config.schema.yaml"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)


# ---- the run and its config ------------------------------------------------------------------


def with_defaults(schema: dict, name: str, values: dict | None) -> dict:
    """A config section with the schema's defaults filled in (as Snakemake's validate does)."""
    props = schema["properties"][name]["properties"]
    out = {k: v["default"] for k, v in props.items() if "default" in v}
    out.update(values or {})
    return out


def load_run(run_dir: Path, config_path: Path, workdir: Path) -> dict[str, Any]:
    """Everything the comparison needs from a finished workflow run."""
    import yaml

    from eagle3lib.config import resolve_data_path
    from eagle3lib.verifier import read_record

    config = yaml.safe_load(config_path.read_text())
    schema = yaml.safe_load(SCHEMA.read_text())
    train = with_defaults(schema, "train", config.get("train"))
    train.pop("gpus", None)  # a resource, as the workflow's section() drops it
    evaluate = with_defaults(schema, "evaluate", config.get("evaluate"))
    evaluate.pop("gpus", None)
    eval_data = {"max_prompts": None, **config["data"]["eval"]}
    spec = eval_data["path"]
    if not spec.startswith("package:") and not Path(spec).is_absolute():
        spec = str(workdir / spec)
    prompts = resolve_data_path(spec, "data.eval.path")

    record = read_record(run_dir / "verifier" / "verifier.json")  # relative to its folder
    if record.get("kind") != "hub" and not Path(record["load_path"]).is_absolute():
        record["load_path"] = str((workdir / record["load_path"]).resolve())

    shards = sorted(
        (run_dir / "hidden_states").glob("shard-*.safetensors"),
        key=lambda p: int(p.stem.split("-")[1]),
    )
    if not shards:
        raise SystemExit(f"{run_dir}/hidden_states: no shards; is this a finished run?")
    manifests = [p.with_suffix(".json") for p in shards]
    vocab_map = run_dir / "vocab" / "vocab_map.safetensors"

    # The run's own record of what it trained with: the config must be the one that made it.
    fingerprint_path = run_dir / "train" / "state" / "fingerprint.json"
    if fingerprint_path.exists():
        trained = read_json(fingerprint_path)["fingerprint"]["train"]
        differ = {k: (v, train.get(k)) for k, v in trained.items() if train.get(k) != v}
        if differ:
            raise SystemExit(
                f"{config_path}: train section differs from what {run_dir} trained with "
                f"(key: run, config): {differ}"
            )
    return {
        "run": config.get("run", run_dir.name),
        "run_dir": run_dir,
        "config_path": config_path,
        "train": train,
        "evaluate": evaluate,
        "prompts": prompts,
        "max_prompts": eval_data["max_prompts"],
        "eval_name": eval_data.get(
            "name", schema["$defs"]["eval_set"]["properties"]["name"]["default"]
        ),
        "record": record,
        "shards": shards,
        "manifests": manifests,
        "vocab_map": vocab_map,
        "samples": run_dir / "prepared" / "samples.safetensors",
        "demo_acceptance": run_dir / "reports" / "acceptance.json",
    }


# ---- step 1: our shards -> speculators' CLI data format ----------------------------------------


def row_order(shard_paths: list[Path], val_fraction: float):
    """The (shard, sample) pairs in our trainer's order: training pairs, then validation."""
    from eagle3lib.shards import open_shard
    from eagle3lib.train_data import split_indices

    shards = [open_shard(p) for p in shard_paths]
    train_pairs, val_pairs = split_indices(shards, val_fraction)
    return shards, train_pairs, val_pairs


def cli_train_ratio(n_rows: int, n_train: int, val_fraction: float) -> float:
    """--train-data-ratio that makes speculators split at our boundary (int(N * ratio))."""
    ratio = round(1.0 - val_fraction, 12)
    if int(n_rows * ratio) == n_train:
        return ratio
    return (n_train + 0.5) / n_rows


def check_against_prepared(run: dict, shards, pairs) -> None:
    """The shards hold the prepared samples, in the prepared order (sanity, not needed)."""
    import numpy as np

    from eagle3lib.data import load_samples, shard_range

    if not run["samples"].exists():
        return
    samples = load_samples(run["samples"])
    for s, shard in enumerate(shards):
        start, stop = shard_range(len(samples), s, len(shards))
        if stop - start != len(shard):
            raise SystemExit(f"shard {s}: {len(shard)} samples, prepared slice has {stop - start}")
        for i in range(len(shard)):
            ids, mask = samples.sample(start + i)
            a, b = int(shard.offsets[i]), int(shard.offsets[i + 1])
            if not (
                np.array_equal(ids, shard.input_ids[a:b])
                and np.array_equal(mask, shard.loss_mask[a:b])
            ):
                raise SystemExit(f"shard {s} sample {i} differs from prepared sample {start + i}")


def convert(run: dict, out_dir: Path, force: bool = False) -> dict[str, Any]:
    """Write speculators' CLI data dir (dataset + hs_{i} files + d2t/t2d) from our shards."""
    import numpy as np
    import torch
    from datasets import Dataset, Features, List, Value
    from safetensors.torch import save_file

    from eagle3lib import vocab
    from eagle3lib.fileio import sha256_json

    manifests = [read_json(p) for p in run["manifests"]]
    vocab_map = vocab.load(run["vocab_map"])
    k = int(vocab_map["d2t"].numel())
    stamp = {
        "shards": [m["file"]["sha256"] for m in manifests],
        "vocab": sha256_json(vocab_map["d2t"].tolist()),
        "val_fraction": run["train"]["val_fraction"],
    }
    stamp_path = out_dir / "converted.json"
    if not force and stamp_path.exists() and read_json(stamp_path)["stamp"] == stamp:
        log(f"convert: reusing {out_dir}")
        return read_json(stamp_path)

    shards, train_pairs, val_pairs = row_order(run["shards"], run["train"]["val_fraction"])
    check_against_prepared(run, shards, train_pairs + val_pairs)
    rows = train_pairs + val_pairs
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "hidden_states").mkdir(parents=True)
    columns: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    t0 = time.perf_counter()
    for row, (s, i) in enumerate(rows):
        shard = shards[s]
        a, b = int(shard.offsets[i]), int(shard.offsets[i + 1])
        ids = shard.input_ids[a:b].astype(np.int64)
        save_file(
            {
                "hidden_states": shard.sample(i)["hidden_states"].clone(),  # [seq, L, hidden]
                "token_ids": torch.from_numpy(ids),
            },
            str(tmp / "hidden_states" / f"hs_{row}.safetensors"),
        )
        columns["input_ids"].append(ids.astype(np.int32).tolist())
        columns["loss_mask"].append(shard.loss_mask[a:b].astype(np.int64).tolist())
        columns["seq_len"].append(b - a)
    # The columns and types speculators' prepare-data writes (and its reader reads).
    features = Features(
        {
            "input_ids": List(Value("int32")),
            "loss_mask": List(Value("int64")),
            "seq_len": Value("int64"),
        }
    )
    dataset = Dataset.from_dict(columns, features=features)
    dataset.set_format(type="torch")
    dataset.save_to_disk(str(tmp))
    np.save(tmp / f"d2t-{k}.npy", vocab_map["d2t"].numpy())
    np.save(tmp / f"t2d-{k}.npy", vocab_map["t2d"].numpy())
    ratio = cli_train_ratio(len(rows), len(train_pairs), run["train"]["val_fraction"])
    info = {
        "stamp": stamp,
        "rows": len(rows),
        "train_rows": len(train_pairs),
        "val_rows": len(val_pairs),
        "row_order": [[s, i] for s, i in rows],
        "train_data_ratio": ratio,
        "draft_vocab_size": k,
        "d2t_path": str(out_dir / f"d2t-{k}.npy"),
        "t2d_path": str(out_dir / f"t2d-{k}.npy"),
        "tokens": int(sum(columns["seq_len"])),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    verify(run, out_dir, train_pairs, val_pairs, ratio)
    write_json(stamp_path, info)
    log(f"convert: {len(rows)} rows, {info['tokens']} tokens -> {out_dir} ({info['seconds']} s)")
    return info


def verify(run: dict, data_dir: Path, train_pairs, val_pairs, ratio: float) -> None:
    """speculators' own reader serves exactly what our dataset serves, row for row, and both
    multipack samplers pack the same training batches."""
    import torch
    from speculators.train.data import ArrowDataset
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    from eagle3lib.config import TrainConfig, from_dict
    from eagle3lib.train import resolve_runtime
    from eagle3lib.train_data import ShardDataset

    cfg = from_dict(TrainConfig, run["train"])
    dtype = resolve_runtime(cfg)["dtype"]
    for split, pairs in (("train", train_pairs), ("val", val_pairs)):
        ours = ShardDataset(run["shards"], pairs, cfg.total_seq_len, dtype)
        cli = ArrowDataset(
            cfg.total_seq_len,
            data_dir,
            on_missing="raise",
            train_ratio=ratio,
            split=split,
            hidden_states_dtype=dtype,
        )
        if len(ours) != len(cli) or ours.approx_lengths != cli.approx_lengths:
            raise SystemExit(f"{split}: {len(ours)} vs {len(cli)} rows or lengths differ")
        for n in range(len(ours)):
            a, b = ours[n], cli[n]
            if not isinstance(b, dict):
                raise SystemExit(f"{split} row {n}: speculators' reader skipped it ({b})")
            same = (
                torch.equal(a["hidden_states"], b["hidden_states"].to(dtype))
                and torch.equal(
                    a["verifier_last_hidden_states"], b["verifier_last_hidden_states"].to(dtype)
                )
                and torch.equal(a["input_ids"], b["input_ids"])
                and torch.equal(a["loss_mask"], b["loss_mask"].bool())
                and bool(((b["loss_mask"] == 0) | (b["loss_mask"] == 1)).all())
                and torch.equal(a["position_ids"], b["position_ids"])
            )
            if not same:
                raise SystemExit(f"{split} row {n}: speculators' reader differs from ours")
        if split == "train":
            batches = [
                [
                    [int(i) for i in batch]
                    for batch in MultipackDistributedBatchSamplerV2(
                        batch_max_length=cfg.total_seq_len,
                        lengths=d.approx_lengths,
                        num_replicas=1,
                        rank=0,
                        seed=cfg.seed,
                    )
                ]
                for d in (ours, cli)
            ]
            if batches[0] != batches[1]:
                raise SystemExit("the two trainers' samplers pack different training batches")
    log(
        f"verify: speculators' ArrowDataset == our ShardDataset on all "
        f"{len(train_pairs)}+{len(val_pairs)} rows; same training batches"
    )


# ---- steps 2-3: the two trainings -------------------------------------------------------------


def train_section(run: dict, seed: int) -> dict:
    """Our stage's train section for ``seed``, packed by speculators' multipack sampler (the
    only one its CLI has), so that both trainers train on the same batches whatever the run's
    ``train.packing``: the comparison is of the wrapper, not of a packing."""
    return {**run["train"], "seed": seed, "packing": "multipack"}


def cli_argv(run: dict, conv: dict, seed: int, save_path: Path, log_dir: Path) -> list[str]:
    """speculators train's argv: the demo's hyper-parameters, the run's data and vocab map,
    and the CPU settings our stage resolves on this machine (sdpa/eager/fp32 here)."""
    from eagle3lib.config import TrainConfig, from_dict
    from eagle3lib.train import resolve_runtime

    t = train_section(run, seed)
    cfg = from_dict(TrainConfig, t)
    runtime = resolve_runtime(cfg)
    aux = read_json(run["manifests"][0])["layer_ids"][:-1]

    def flag(name: str, on: bool) -> str:
        return f"--{name}" if on else f"--no-{name}"

    argv = [
        "--speculator-type", "eagle3",
        "--verifier-name-or-path", run["record"]["load_path"],
        "--data-path", str(Path(conv["d2t_path"]).parent),
        "--save-path", str(save_path),
        "--log-dir", str(log_dir),
        "--d2t-path", conv["d2t_path"],
        "--t2d-path", conv["t2d_path"],
        "--draft-vocab-size", str(cfg.draft_vocab_size),
        "--target-layer-ids", *map(str, aux),
        "--num-layers", str(cfg.num_layers),
        "--sliding-window", str(cfg.sliding_window),
        *(["--full-attention-indices", *map(str, cfg.full_attention_layers)]
          if cfg.full_attention_layers else []),
        flag("norm-before-residual", cfg.norm_before_residual),
        flag("norm-before-fc", cfg.norm_before_fc),
        flag("norm-output", cfg.norm_output),
        "--epochs", str(cfg.epochs),
        "--lr", repr(cfg.lr),
        "--optimizer", cfg.optimizer,
        "--weight-decay", repr(cfg.weight_decay),
        "--scheduler-type", cfg.scheduler,
        *(["--scheduler-warmup-ratio", repr(cfg.warmup_ratio)]
          if cfg.warmup_ratio is not None else []),
        "--total-seq-len", str(cfg.total_seq_len),
        "--train-data-ratio", repr(conv["train_data_ratio"]),
        "--ttt-steps", str(cfg.ttt_steps),
        "--ttt-step-loss-decay", repr(cfg.ttt_step_loss_decay),
        "--seed", str(cfg.seed),
        "--log-freq", str(cfg.log_every),
        *(["--max-steps", str(cfg.max_steps)] if cfg.max_steps else []),
        # CPU: no flex backward, no Triton, spawn workers are slow, no vLLM to fall back on
        "--draft-attn-impl", runtime["attention"],
        "--loss-implementation", runtime["loss"],
        "--hidden-states-dtype", str(runtime["dtype"]).removeprefix("torch."),
        "--num-workers", "0",
        "--on-missing", "raise",
    ]  # fmt: skip
    return argv


def run_logged(cmd: list[str], log_path: Path, cwd: Path = ROOT) -> float:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log_path, "w") as fh:
        fh.write("$ " + shlex.join(cmd) + "\n")
        fh.flush()
        proc = subprocess.run(cmd, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT, check=False)
    if proc.returncode:
        tail = "\n".join(log_path.read_text().splitlines()[-25:])
        raise SystemExit(f"failed ({proc.returncode}): {shlex.join(cmd)}\n{tail}")
    return time.perf_counter() - t0


def train_ours(run: dict, seed: int, out: Path, record_path: Path, threads: int) -> dict:
    """Our train stage exactly as the workflow's train rule runs it."""
    state = out / "state"
    shutil.rmtree(state, ignore_errors=True)
    ckpt = out / "checkpoint"
    cmd = [
        sys.executable, str(ROOT / "scripts" / "train.py"),
        "--verifier", str(record_path),
        "--shards", *map(str, run["shards"]),
        "--manifests", *map(str, run["manifests"]),
        "--vocab-map", str(run["vocab_map"]),
        "--train", json.dumps(train_section(run, seed), sort_keys=True),
        "--state-dir", str(state),
        "--gpus", "0",
        "--threads", str(threads),
        "--out-config", str(ckpt / "config.json"),
        "--out-weights", str(ckpt / "model.safetensors"),
        "--out-card", str(ckpt / "README.md"),
        "--out-summary", str(out / "train_summary.json"),
    ]  # fmt: skip
    wall = run_logged(cmd, out / "train.log")
    from eagle3lib.train import loss_curves, read_metrics

    summary = read_json(out / "train_summary.json")
    result = {
        "command": shlex.join(cmd),
        "wall_seconds": round(wall, 1),
        "train_seconds": round(summary["seconds"], 1),
        "checkpoint": str(ckpt),
        "curves": loss_curves(read_metrics(state / "metrics.jsonl")),
    }
    write_json(out / "summary.json", result)
    return result


def train_cli(run: dict, conv: dict, seed: int, out: Path, threads: int) -> dict:
    """speculators' CLI in a fresh process (see cli_child)."""
    state = out / "state"
    shutil.rmtree(state, ignore_errors=True)
    argv = cli_argv(run, conv, seed, state, out / "logs")
    spec = {
        "argv": argv,
        "threads": threads,
        "save_path": str(state),
        "metrics": str(out / "metrics.jsonl"),
        "checkpoint": str(out / "checkpoint"),
        "verifier_name": run["record"]["name"],
        "summary": str(out / "cli_summary.json"),
    }
    (out / "metrics.jsonl").unlink(missing_ok=True)
    write_json(out / "cli_spec.json", spec)
    cmd = [sys.executable, str(Path(__file__).resolve()), "_train_cli", str(out / "cli_spec.json")]
    wall = run_logged(cmd, out / "train.log")
    child = read_json(out / "cli_summary.json")
    result = {
        "argv": argv,
        "command": "speculators train " + shlex.join(argv),
        "wall_seconds": round(wall, 1),
        "train_seconds": child["seconds"],
        "checkpoint": spec["checkpoint"],
        "final_epoch_dir": child["final_epoch_dir"],
        "curves": child["curves"],
    }
    write_json(out / "summary.json", result)
    return result


def cli_child(spec_path: str) -> None:
    """Run speculators' CLI entry in this process on CPU, then export its final epoch."""
    import logging

    import torch

    spec = read_json(Path(spec_path))
    torch.set_num_threads(spec["threads"])
    from speculators.train import cli as scli
    from speculators.train.config import TrainConfig

    from eagle3lib import checkpoint
    from eagle3lib.speculators_compat import cpu_trainer_patches
    from eagle3lib.train import MetricsRecorder, last_epoch_dir, loss_curves, read_metrics

    # Record the metrics speculators logs, as our stage does. Its logging set-up (dictConfig)
    # closes every handler that exists then, so the recorder is made after it.
    recorders = []
    setup = scli.setup_metric_logger

    def setup_and_record(*args, **kwargs):
        setup(*args, **kwargs)
        recorders.append(MetricsRecorder(Path(spec["metrics"])))
        logging.getLogger("speculators.metrics").addHandler(recorders[-1])

    scli.setup_metric_logger = setup_and_record
    print("speculators train " + shlex.join(spec["argv"]), flush=True)
    cfg = TrainConfig.resolve(spec["argv"])
    t0 = time.perf_counter()
    with cpu_trainer_patches():
        scli.main(cfg)
    seconds = time.perf_counter() - t0
    for recorder in recorders:
        recorder.close()
    final = last_epoch_dir(Path(spec["save_path"]))
    if final is None:
        raise SystemExit(f"speculators wrote no checkpoint under {spec['save_path']}")
    checkpoint.export(final, Path(spec["checkpoint"]), spec["verifier_name"])
    write_json(
        Path(spec["summary"]),
        {
            "seconds": round(seconds, 1),
            "final_epoch_dir": str(final),
            "curves": loss_curves(read_metrics(Path(spec["metrics"]))),
        },
    )


# ---- step 4: the offline evaluation -----------------------------------------------------------


def evaluate_all(run: dict, record_path: Path, jobs: list[dict], out: Path, threads: int) -> None:
    spec = {
        "verifier": str(record_path),
        "manifest": str(run["manifests"][0]),
        "prompts": str(run["prompts"]),
        "max_prompts": run["max_prompts"] or 0,
        "eval_name": run["eval_name"],
        "evaluate": run["evaluate"],
        "threads": threads,
        "jobs": jobs,
    }
    write_json(out / "eval_spec.json", spec)
    cmd = [sys.executable, str(Path(__file__).resolve()), "_evaluate", str(out / "eval_spec.json")]
    run_logged(cmd, out / "evaluate.log")


def evaluate_child(spec_path: str) -> None:
    """scripts/evaluate.py's steps (same evaluator, prompts, settings), the verifier loaded once
    for several checkpoints."""
    import torch

    from eagle3lib import checkpoint, data, evaluate, verifier
    from eagle3lib.config import EvaluateConfig, from_dict
    from eagle3lib.conversations import read_eval_prompts
    from eagle3lib.hidden_states import resolve_dtype

    spec = read_json(Path(spec_path))
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    cfg = from_dict(EvaluateConfig, spec["evaluate"])
    record = read_json(Path(spec["verifier"]))
    aux = read_json(Path(spec["manifest"]))["layer_ids"][:-1]
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    dtype = resolve_dtype(cfg.dtype, device, "evaluate.dtype")
    tokenizer = verifier.load_tokenizer(record)
    prompts = read_eval_prompts(Path(spec["prompts"]), spec["max_prompts"] or None)
    for prompt in prompts:
        prompt["token_ids"] = data.prompt_token_ids(tokenizer, prompt["text"])
    eval_sets = [{"name": spec["eval_name"], "prompts": prompts}]  # data.eval, the headline set
    model = verifier.load_model(record, dtype, device_map=verifier.device_map_for_job())
    for job in spec["jobs"]:
        ckpt = Path(job["checkpoint"])
        draft = checkpoint.load_draft(ckpt, record, "sdpa", dtype).to(device)
        result = evaluate.evaluate(
            model, draft, tokenizer, eval_sets, cfg, aux, log=lambda m: print(m, flush=True)
        )
        result["device"] = device.type
        result["dtype"] = str(dtype).removeprefix("torch.")
        write_json(Path(job["out"]), result)
        print(f"{ckpt}: acceptance_length={result['acceptance_length']}", flush=True)
        del draft


# ---- orchestration and report -----------------------------------------------------------------


def trainer_diff(ours: dict, cli: dict) -> dict[str, Any]:
    """How far apart the two trainings of one seed ended: exported weights and loss curves."""
    from safetensors.torch import load_file

    a = load_file(str(Path(ours["checkpoint"]) / "model.safetensors"))
    b = load_file(str(Path(cli["checkpoint"]) / "model.safetensors"))
    if sorted(a) != sorted(b):
        return {"same_tensor_names": False}
    weight = max((a[k].double() - b[k].double()).abs().max().item() for k in a)
    ca, cb = ours["curves"], cli["curves"]
    steps = dict(zip(cb["step"], cb["train_loss"], strict=True))
    common = [
        (x, steps[s]) for s, x in zip(ca["step"], ca["train_loss"], strict=True) if s in steps
    ]
    va = [v["loss_epoch"] for v in ca["val"]]
    vb = [v["loss_epoch"] for v in cb["val"]]
    return {
        "same_tensor_names": True,
        "weights_identical": all(torch_equal(a[k], b[k]) for k in a),
        "max_abs_weight_diff": weight,
        "train_steps_compared": len(common),
        "train_steps": [len(ca["step"]), len(cb["step"])],
        "max_abs_train_loss_diff": max((abs(x - y) for x, y in common), default=None),
        "val_loss_per_epoch": {"ours": va, "speculators_cli": vb},
    }


def torch_equal(x, y) -> bool:
    import torch

    return bool(torch.equal(x, y))


def fmt(x: float | None, digits: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def final_val(curves: dict) -> dict:
    return curves["val"][-1] if curves.get("val") else {}


def report(run: dict, conv: dict, results: dict, seeds: list[int], out_json: Path) -> dict:
    name = run["run"]
    lines, table = [], []
    table.append(
        f"{'trainer':<16} {'seed':>4} {'acc.len':>8} {'pos1':>6} {'pos2':>6} {'pos3':>6} "
        f"{'val_loss':>9} {'val_acc0':>8} {'train_s':>8}"
    )
    summary: dict[str, Any] = {"per_trainer": {}}
    for trainer in TRAINERS:
        values = []
        for seed in seeds:
            r = results.get(trainer, {}).get(seed)
            if not r or "acceptance" not in r:
                continue
            acc = r["acceptance"]
            val = final_val(r["train"]["curves"])
            values.append(acc["acceptance_length"])
            pos = acc["per_position_acceptance"]
            table.append(
                f"{trainer:<16} {seed:>4} {fmt(acc['acceptance_length']):>8} "
                + " ".join(f"{fmt(p):>6}" for p in pos[:3])
                + f" {fmt(val.get('loss_epoch')):>9} {fmt(val.get('full_acc_0_epoch')):>8}"
                f" {r['train']['train_seconds']:>8.0f}"
            )
            key = f"quality_parity.{name}.{trainer}.seed{seed}"
            lines.append(f"{key}.acceptance_length = {acc['acceptance_length']:.4f}")
            for j, p in enumerate(pos, 1):
                lines.append(f"{key}.acceptance_at_position_{j} = {p:.4f}")
            lines.append(f"{key}.accepted_tokens = {acc['accepted_tokens']}")
            lines.append(f"{key}.steps = {acc['steps']}")
            lines.append(
                f"{key}.text_matches_verifier = {str(acc['text_matches_verifier']).lower()}"
            )
            if val:
                lines.append(f"{key}.val_loss = {val['loss_epoch']:.4f}")
                lines.append(f"{key}.val_full_acc_0 = {val['full_acc_0_epoch']:.4f}")
            lines.append(f"{key}.train_seconds = {r['train']['train_seconds']:.0f}")
        if values:
            mean = statistics.fmean(values)
            spread = max(values) - min(values)
            summary["per_trainer"][trainer] = {"values": values, "mean": mean, "spread": spread}
            lines.append(f"quality_parity.{name}.{trainer}.mean.acceptance_length = {mean:.4f}")
            lines.append(f"quality_parity.{name}.{trainer}.seed_spread = {spread:.4f}")
    for seed in seeds:
        c = results.get("comparison", {}).get(seed)
        if not c or not c.get("same_tensor_names"):
            continue
        key = f"quality_parity.{name}.ours_vs_cli.seed{seed}"
        lines.append(f"{key}.weights_identical = {str(c['weights_identical']).lower()}")
        lines.append(f"{key}.max_abs_weight_diff = {c['max_abs_weight_diff']:.3g}")
        if c["max_abs_train_loss_diff"] is not None:
            lines.append(f"{key}.max_abs_train_loss_diff = {c['max_abs_train_loss_diff']:.3g}")
    per = summary["per_trainer"]
    if all(t in per for t in TRAINERS):
        diff = per["ours"]["mean"] - per["speculators_cli"]["mean"]
        noise = max(per["ours"]["spread"], per["speculators_cli"]["spread"])
        verdict = diff >= -noise
        summary.update({"diff_mean": diff, "noise": noise, "ours_ge_cli_within_noise": verdict})
        lines.append(f"quality_parity.{name}.diff_mean_acceptance_length = {diff:+.4f}")
        lines.append(f"quality_parity.{name}.noise_seed_spread = {noise:.4f}")
        lines.append(f"quality_parity.{name}.ours_ge_cli_within_noise = {str(verdict).lower()}")
    print("\n".join(table))
    print()
    print("\n".join(lines))
    payload = {
        "run": name,
        "run_dir": str(run["run_dir"]),
        "config": str(run["config_path"]),
        "train_section": run["train"],
        "evaluate_section": run["evaluate"],
        "prompts": str(run["prompts"]),
        "max_prompts": run["max_prompts"],
        "seeds": seeds,
        "conversion": {k: v for k, v in conv.items() if k != "row_order"},
        "results": {t: {str(s): r for s, r in v.items()} for t, v in results.items()},
        "summary": summary,
        "key_values": lines,
        "table": table,
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
    }
    if run["demo_acceptance"].exists():
        payload["workflow_acceptance_length"] = read_json(run["demo_acceptance"])[
            "acceptance_length"
        ]
    write_json(out_json, payload)
    log(f"wrote {out_json}")
    return payload


def compare(run: dict, work: Path, seeds: list[int], threads: int, force: bool) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    record_path = work / "verifier.json"  # the run's record, load_path made absolute
    write_json(record_path, run["record"])
    conv = convert(run, work / "speculators_data", force=force)
    results: dict[str, dict[int, dict]] = {t: {} for t in (*TRAINERS, "comparison")}
    for seed in seeds:
        jobs = []
        for trainer in TRAINERS:
            out = work / trainer / f"seed{seed}"
            summary_path = out / "summary.json"
            if force or not (summary_path.exists() and (out / "checkpoint/config.json").exists()):
                log(f"train {trainer} seed {seed} ...")
                if trainer == "ours":
                    train_ours(run, seed, out, record_path, threads)
                else:
                    train_cli(run, conv, seed, out, threads)
            summary = read_json(summary_path)
            log(f"train {trainer} seed {seed}: {summary['train_seconds']} s")
            results[trainer][seed] = {"train": summary}
            acc_path = out / "acceptance.json"
            if force or not acc_path.exists():
                jobs.append({"checkpoint": summary["checkpoint"], "out": str(acc_path)})
        if jobs:
            log(f"evaluate seed {seed}: {len(jobs)} checkpoint(s) ...")
            evaluate_all(run, record_path, jobs, work / f"eval-seed{seed}", threads)
        for trainer in TRAINERS:
            acc = read_json(work / trainer / f"seed{seed}" / "acceptance.json")
            results[trainer][seed]["acceptance"] = {
                k: v for k, v in acc.items() if k != "per_prompt"
            }
            results[trainer][seed]["per_prompt"] = [
                {k: p[k] for k in ("id", "acceptance_length", "steps", "matches_verifier")}
                for p in acc["per_prompt"]
            ]
            log(f"{trainer} seed {seed}: acceptance_length {acc['acceptance_length']:.4f}")
        results["comparison"][seed] = trainer_diff(
            results["ours"][seed]["train"], results["speculators_cli"][seed]["train"]
        )
        done = seeds[: seeds.index(seed) + 1]
        payload = report(run, conv, results, done, work / "quality_parity.json")
    return payload


# ---- smoke: a tiny verifier and a tiny run, built here ------------------------------------------


def build_smoke_run(root: Path) -> tuple[Path, Path]:
    """A finished-run layout (verifier, prepared samples, 2 shards, vocab map) from the tests'
    tiny random Llama verifier, and a config for it."""
    sys.path.insert(0, str(ROOT / "tests"))
    import tiny
    from transformers import AutoTokenizer

    from eagle3lib import data, hidden_states, vocab
    from eagle3lib.config import ExtractConfig, PrepareConfig
    from eagle3lib.verifier import materialize

    shutil.rmtree(root, ignore_errors=True)
    run_dir = root / "results" / "smoke"
    verifier_dir = tiny.build_verifier(root / "tiny-llama")
    record = materialize(str(verifier_dir), "tiny-llama", run_dir / "verifier" / "hf")
    write_json(run_dir / "verifier" / "verifier.json", record)
    train_path = tiny.write_jsonl(root / "train.jsonl", tiny.conversations(40, seed=5))
    eval_path = tiny.write_jsonl(root / "eval.jsonl", tiny.conversations(3, seed=9))
    tokenizer = AutoTokenizer.from_pretrained(verifier_dir)
    prepared = data.prepare_samples(tokenizer, train_path, PrepareConfig(max_length=128))
    samples_path = run_dir / "prepared" / "samples.safetensors"
    samples_path.parent.mkdir(parents=True)
    data.save_prepared(prepared, samples_path, record["vocab_size"])
    samples = data.load_samples(samples_path)
    extract = ExtractConfig(shards=2, batch_tokens=512)
    (run_dir / "hidden_states").mkdir(parents=True)
    for i in range(2):
        hidden_states.extract_shard(
            samples,
            prepared.ids,
            i,
            extract,
            record,
            run_dir / "hidden_states" / f"shard-{i}.safetensors",
            run_dir / "hidden_states" / f"shard-{i}.json",
        )
    d2t, t2d = vocab.build(samples.token_freq, 256)
    (run_dir / "vocab").mkdir(parents=True)
    vocab.save(run_dir / "vocab" / "vocab_map.safetensors", d2t, t2d)
    config = tiny.write_config(
        root / "config.yaml",
        "smoke",
        verifier_dir,
        train_path,
        eval_path,
        train={"optimizer": "muon", "lr": 3e-3, "epochs": 1},
        evaluate={"k": 3, "max_new_tokens": 8},
        data={
            "train": {"path": str(train_path)},
            "eval": {"path": str(eval_path), "max_prompts": 2},
            "max_length": 128,
        },
    )
    return run_dir, config


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] in ("_train_cli", "_evaluate"):
        (cli_child if sys.argv[1] == "_train_cli" else evaluate_child)(sys.argv[2])
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--run-dir", type=Path, help="a finished run, e.g. results/demo")
    p.add_argument("--config", type=Path, help="the config.yaml that made it")
    p.add_argument(
        "--workdir", type=Path, help="where the workflow ran (default: the config's folder)"
    )
    p.add_argument("--work", type=Path, help="output folder (default: /tmp/quality_parity)")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="default: 42 43")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--force", action="store_true", help="redo finished steps")
    p.add_argument("--smoke", action="store_true", help="tiny local verifier, about a minute")
    a = p.parse_args()
    t0 = time.perf_counter()
    if a.smoke:
        work = a.work or Path("/tmp/quality_parity_smoke")
        log(f"smoke: building a tiny verifier and run under {work / 'workflow'}")
        run_dir, config = build_smoke_run(work / "workflow")
        seeds = a.seeds or [42]
        force = True
    else:
        if not (a.run_dir and a.config):
            p.error("give --run-dir and --config (or --smoke)")
        run_dir, config = a.run_dir.resolve(), a.config.resolve()
        work = a.work or Path("/tmp/quality_parity")
        seeds = a.seeds or [42, 43]
        force = a.force
    run = load_run(run_dir, config, (a.workdir or config.parent).resolve())
    compare(run, work.resolve(), seeds, a.threads, force)
    log(f"done in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
