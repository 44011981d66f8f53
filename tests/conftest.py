from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))

# Two test workers share the cores, and their jobs run torch's OpenMP threads: spinning while
# they wait (libgomp's default, read once when torch loads) made one job several times slower
# beside another (BENCHMARKS.md, "Waiting OpenMP threads"); waiting passively does not. Set before
# torch loads, here and in every subprocess (they inherit the environment).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import tiny  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


# Files of whole-workflow runs (minutes each) go first, so that with several pytest-xdist
# workers the longest files do not start last. `make test` passes --no-loadscope-reorder with
# --dist loadfile; without it xdist hands out the files with the most tests first, and this
# order only breaks ties. By the files' measured totals, largest first: 339, 323, 269, 268,
# 197, 163, 98, 59, 44, 40, 38, 35 s (`make test` with xdist's reorder on the 2-core AMD EPYC,
# family 25, 2026-12-06: 18 min 58 s). Handing those out in xdist's order to whichever of two
# workers is free gives them about 1,105 and 914 s; in this order about 1,010 each.
LONGEST_FIRST = (
    "test_faults.py",
    "test_bench_smoke.py",
    "test_workflow.py",
    "test_vllm.py",
    "test_multinode.py",
    "test_presets.py",
    "test_train.py",
    "test_regenerate.py",
    "test_gpu.py",
    "test_security.py",
    "test_edge_cases.py",
    "test_errors.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order kept


def pytest_terminal_summary(terminalreporter) -> None:
    """The CPU this run's test times were measured on, and whether torch computes bf16 on it
    natively (without, the CPU path computes in fp32: eagle3lib.precision)."""
    from eagle3lib.precision import cpu_model, cpu_native_bf16

    bf16 = "yes" if cpu_native_bf16() else "no (fp32 on the CPU path)"
    terminalreporter.write_line(
        f"machine: {cpu_model()}, {os.cpu_count()} cores; torch computes bf16 natively: {bf16}"
    )


@pytest.fixture(scope="session")
def verifier_dir(tmp_path_factory) -> Path:
    """Tiny random Llama verifier (8 layers, hidden 64) with a ChatML tokenizer."""
    return tiny.build_verifier(tmp_path_factory.mktemp("verifier") / "tiny-llama")


@pytest.fixture(scope="session")
def tokenizer(verifier_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(verifier_dir)


@pytest.fixture(scope="session")
def verifier_model(verifier_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(verifier_dir, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def verifier_record(verifier_dir, tmp_path_factory):
    from eagle3lib.verifier import materialize

    return materialize(str(verifier_dir), "tiny-llama", tmp_path_factory.mktemp("hf") / "hf")


def run_snakemake(
    workdir: Path,
    configfile: Path | None,
    *args: str,
    check: bool = True,
    workflow_profile: str | None = "none",
):
    """A real `snakemake` run in ``workdir`` with this repo's Snakefile; returns the process.

    ``--workflow-profile none`` by default: snakemake would load profiles/default (which only
    turns on --show-failed-logs) by itself, and these runs check logs and outputs themselves.
    ``workflow_profile=None`` runs as a user's plain `snakemake` does, with it."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    cmd = [
        sys.executable,
        "-m",
        "snakemake",
        "--snakefile",
        str(ROOT / "Snakefile"),
        "--directory",
        str(workdir),
        "--cores",
        "2",
    ]
    if workflow_profile is not None:
        cmd += ["--workflow-profile", workflow_profile]
    cmd += args  # targets before --configfile, which takes several values
    if configfile is not None:
        cmd += ["--configfile", str(configfile)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"snakemake failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def proc_entries(name: str) -> list[tuple[int, Path]]:
    """(pid, /proc/<pid>/<name>) of every process listed now. Listed, not globbed: Path.glob
    stats each match, and a process that exits meanwhile makes that stat raise ESRCH
    (ProcessLookupError), which glob does not skip; reading a listed one may fail the same
    way, so callers catch OSError."""
    return [(int(d), Path("/proc", d, name)) for d in os.listdir("/proc") if d.isdigit()]


def alive(pid: int) -> bool:
    """The process runs (a zombie that nobody reaped has ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_until(condition, timeout: float = 30.0) -> bool:
    """Poll ``condition`` until it holds (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def regenerate_command(
    verifier_json: Path, train: Path, data: dict, section: dict, work: Path
) -> list[str]:
    """scripts/regenerate.py as the regenerate rule runs it, writing into ``work``."""
    return [
        sys.executable, str(ROOT / "scripts" / "regenerate.py"),
        "--verifier", str(verifier_json), "--train", str(train),
        "--data", json.dumps(data), "--regenerate", json.dumps(section), "--vllm", "{}",
        "--vllm-python", sys.executable, "--work-dir", str(work / "chunks"),
        "--server-log", str(work / "server.log"), "--threads", "1",
        "--out", str(work / "out.jsonl"), "--out-info", str(work / "info.json"),
    ]  # fmt: skip


def train_command(pipeline, tmp: Path, cfg) -> list[str]:
    """scripts/train.py on the pipeline's shards and vocab map with ``cfg``, writing into
    ``tmp`` (state/, checkpoint/, summary.json), one process and one thread."""
    import dataclasses

    from eagle3lib import vocab
    from eagle3lib.fileio import write_json

    write_json(tmp / "verifier.json", pipeline["record"])
    if not (tmp / "vocab.safetensors").exists():
        vocab.save(
            tmp / "vocab.safetensors", pipeline["vocab_map"]["d2t"], pipeline["vocab_map"]["t2d"]
        )
    out = tmp / "checkpoint"
    return [
        sys.executable, str(ROOT / "scripts" / "train.py"),
        "--verifier", str(tmp / "verifier.json"),
        "--shards", *map(str, pipeline["shards"]),
        "--manifests", *map(str, pipeline["manifests"]),
        "--vocab-map", str(tmp / "vocab.safetensors"),
        "--train", json.dumps(dataclasses.asdict(cfg)),
        "--state-dir", str(tmp / "state"),
        "--threads", "1",
        "--out-config", str(out / "config.json"),
        "--out-weights", str(out / "model.safetensors"),
        "--out-card", str(out / "README.md"),
        "--out-summary", str(tmp / "summary.json"),
    ]  # fmt: skip


def run_training(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{what}: " + proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.fixture(scope="session")
def two_process_training(pipeline, tmp_path_factory) -> dict:
    """scripts/train.py on one node with two processes (torchrun --standalone, gloo), two
    epochs: also the reference of the runs over two "nodes" of one process each (the same
    global batch). Its folder, config, exported weights' bytes and optimiser steps."""

    cfg = pipeline["train_cfg"]  # 2 epochs of 9 steps
    work = tmp_path_factory.mktemp("two_processes")
    run_training([*train_command(pipeline, work, cfg), "--processes", "2"], "one node, 2")
    state = json.loads((work / "state" / "1" / "training_state.json").read_text())
    return {
        "dir": work,
        "cfg": cfg,
        "weights": (work / "checkpoint" / "model.safetensors").read_bytes(),
        "steps": state["global_step"],
    }


def _safetensors_spans(data: bytes) -> dict[str, tuple[int, int]] | None:
    """A safetensors file's header and tensors as absolute byte spans; None if it is not one."""
    try:
        size = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + size])
        spans = {"the header": (0, 8 + size)}
        for name, entry in header.items():
            if name != "__metadata__":
                start, end = entry["data_offsets"]
                spans[f"{name} ({entry['dtype']} {entry['shape']})"] = (
                    8 + size + start,
                    8 + size + end,
                )
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    return spans


def assert_same_bytes(got: Path | bytes, want: Path | bytes, what: str = "") -> None:
    """Byte equality of two files (or a file and bytes kept before). On a difference the message
    names the files, their sizes, the first differing offset and, in safetensors files, the parts
    that differ (header, tensors): a few lines in CI's log, not a dump of both files."""
    a = got.read_bytes() if isinstance(got, Path) else got
    b = want.read_bytes() if isinstance(want, Path) else want
    if a == b:
        return
    first = next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
    differing = sum(x != y for x, y in zip(a, b, strict=False)) + abs(len(a) - len(b))
    names = " against ".join(str(x) if isinstance(x, Path) else "bytes kept" for x in (got, want))
    message = (
        f"{what + ': ' if what else ''}{names}: {len(a)} and {len(b)} bytes, {differing} differ,"
        f" the first at offset {first}"
    )
    spans_a, spans_b = _safetensors_spans(a), _safetensors_spans(b)
    if spans_a is not None and spans_a == spans_b:
        parts = [name for name, (lo, hi) in spans_a.items() if a[lo:hi] != b[lo:hi]]
        message += f"; safetensors parts that differ: {', '.join(parts)}"
    elif spans_a is not None or spans_b is not None:
        message += "; safetensors headers differ in layout"
    raise AssertionError(message)


def job_counts(output: str) -> dict[str, int]:
    """Snakemake's 'Job stats' table as {rule: count} (empty when nothing was to be done)."""
    counts: dict[str, int] = {}
    if "Job stats:" not in output:
        return counts
    table = output.split("Job stats:", 1)[1]
    for line in table.splitlines()[3:]:
        m = re.match(r"^(\w+)\s+(\d+)$", line.strip())
        if not m:
            break
        if m.group(1) != "total":
            counts[m.group(1)] = int(m.group(2))
    return counts


def executed_jobs(output: str) -> list[str]:
    """'rule X:' headers of jobs snakemake started, with their wildcards, e.g. 'extract[shard=1]'."""
    jobs = []
    blocks = re.split(r"\n(?=(?:local)?rule \w+:)", output)
    for block in blocks:
        m = re.match(r"(?:local)?rule (\w+):", block.strip())
        if not m:
            continue
        w = re.search(r"wildcards: ([^\n]+)", block)
        jobs.append(f"{m.group(1)}[{w.group(1)}]" if w else m.group(1))
    return jobs


def one_torchrun_rank(monkeypatch) -> None:
    """torchrun's variables for one rank in a group of one on a free local port: train.train
    then takes DDP's code path in this process (gloo on a CPU)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1",
                        "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port)}.items():  # fmt: skip
        monkeypatch.setenv(name, value)


@pytest.fixture
def gpu_with_triton(monkeypatch):
    """resolve_runtime's view of a GPU machine with Triton, at the torch version given (only
    what it reads is faked: torch.cuda.is_available, an importable triton, torch.__version__)."""
    import types

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "triton", types.ModuleType("triton"))
    return lambda version: monkeypatch.setattr(torch, "__version__", version)


def train_pipeline(pipeline: dict, state: Path, trainer_class=None, **changes) -> dict:
    """eagle3lib.train.train on the pipeline's shards and vocab map, its train config with
    ``changes``, state (and metrics, m.jsonl) in ``state``; returns the run statistics."""
    from dataclasses import replace

    from eagle3lib import train

    return train.train(
        replace(pipeline["train_cfg"], **changes),
        pipeline["record"],
        pipeline["shards"],
        pipeline["manifests"],
        pipeline["vocab_map"],
        state,
        state / "m.jsonl",
        trainer_class=trainer_class,
    )


def prepare_conversations(tokenizer, verifier_record, folder: Path, n: int, seed: int, **prepare):
    """``n`` tiny conversations (``seed``) prepared with PrepareConfig(**prepare), saved to
    <folder>/samples.safetensors and read back: (the PreparedSamples, the loaded samples)."""
    from eagle3lib import data
    from eagle3lib.config import PrepareConfig

    path = tiny.write_jsonl(folder / "train.jsonl", tiny.conversations(n, seed=seed))
    prepared = data.prepare_samples(tokenizer, path, PrepareConfig(**prepare))
    data.save_prepared(prepared, folder / "samples.safetensors", verifier_record["vocab_size"])
    return prepared, data.load_samples(folder / "samples.safetensors")


@pytest.fixture(scope="session")
def pipeline(tokenizer, verifier_record, tmp_path_factory):
    """Prepared samples, two shards, a vocab map and a trained tiny draft (a few seconds)."""
    from eagle3lib import checkpoint, hidden_states, train, vocab
    from eagle3lib.config import ExtractConfig, TrainConfig

    tmp = tmp_path_factory.mktemp("pipeline")
    prepared, samples = prepare_conversations(
        tokenizer, verifier_record, tmp, 40, seed=5, max_length=128
    )
    extract_cfg = ExtractConfig(shards=2, batch_tokens=512)
    shards, manifests = [], []
    for i in range(2):
        shards.append(tmp / f"shard-{i}.safetensors")
        manifests.append(tmp / f"shard-{i}.json")
        hidden_states.extract_shard(
            samples, prepared.ids, i, extract_cfg, verifier_record, shards[i], manifests[i]
        )
    d2t, t2d = vocab.build(samples.token_freq, 256)
    train_cfg = TrainConfig(
        epochs=2,
        total_seq_len=256,
        draft_vocab_size=256,
        optimizer="adamw",
        lr=3e-3,
        seed=0,
        log_every=1,
        packing="multipack",  # speculators' batches: 9 steps an epoch (also over 2 processes)
    )
    stats = train.train(
        train_cfg,
        verifier_record,
        shards,
        manifests,
        {"d2t": d2t, "t2d": t2d},
        tmp / "state",
        tmp / "state" / "metrics.jsonl",
    )
    ckpt = tmp / "checkpoint"
    checkpoint.export(Path(stats["final_epoch_dir"]), ckpt, verifier_record["name"])
    return {
        "dir": tmp,
        "samples": samples,
        "ids": prepared.ids,
        "shards": shards,
        "manifests": manifests,
        "vocab_map": {"d2t": d2t, "t2d": t2d},
        "train_cfg": train_cfg,
        "stats": stats,
        "checkpoint": ckpt,
        "record": verifier_record,
    }


@pytest.fixture(scope="session")
def fp8_shards(pipeline, tmp_path_factory):
    """The pipeline's shards again, states stored in fp8 (extract.storage: fp8)."""
    from eagle3lib import hidden_states
    from eagle3lib.config import ExtractConfig

    out = tmp_path_factory.mktemp("fp8_shards")
    cfg = ExtractConfig(shards=2, batch_tokens=512, storage="fp8")
    paths = []
    for i in range(2):
        paths.append((out / f"shard-{i}.safetensors", out / f"shard-{i}.json"))
        hidden_states.extract_shard(
            pipeline["samples"], pipeline["ids"], i, cfg, pipeline["record"], *paths[-1]
        )
    return [p for p, _ in paths], [m for _, m in paths]
