"""Faults: kill -9 at seeded random points, then rerun; nothing lost, nothing silently wrong.

Every kill is a real SIGKILL of the whole process group (like a node crash or the OOM killer):
of `snakemake` with its extraction jobs, of the train job, of the regenerate job. After each,
a plain rerun must finish, and what it builds must be the bytes of an uninterrupted run (CPU,
fp32, fixed seeds). A full disk is a real size-capped tmpfs (skipped where mounting is not
permitted).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import tiny
from conftest import (
    ROOT,
    alive,
    assert_same_bytes,
    executed_jobs,
    job_counts,
    proc_entries,
    regenerate_command,
    run_snakemake,
    train_command,
    wait_until,
)

pytestmark = pytest.mark.slow

TRIALS = 3  # kill moments per fault test: seeds 0 and 2 while writing, 1 at a random moment


def job_env() -> dict[str, str]:
    """The environment snakemake gives a job: this venv's python first on PATH."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def start(cmd: list[str], cwd: Path | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        cmd,
        cwd=cwd,
        env=job_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def kill_when(proc: subprocess.Popen, ready, delay: float, timeout: float = 120.0) -> bool:
    """SIGKILL the process group ``delay`` s after ``ready()`` holds; False if it ended first."""
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.wait()
            return False
        time.sleep(0.02)
    time.sleep(delay)
    if proc.poll() is not None:
        return False
    kill_tree(proc.pid)
    proc.wait()
    return True


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, also those in sessions of their own (the GPU wrapper
    starts each job in its own session), from /proc."""
    children: dict[int, list[int]] = {}
    for child, stat in proc_entries("stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(child)
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and everything it started, at once, as a crash of the machine would."""
    for victim in [pid, *descendants(pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)


def kill_each(runs: list[tuple[list[str], Callable[[], bool], float]]) -> list[bool]:
    """Start every command at once (the trials overlap; each is still killed at its own
    seeded moment): SIGKILL each, with all it started, ``delay`` s after its ``ready()``
    first holds. Per run: was it killed (False: it finished first)."""
    procs = [
        subprocess.Popen(cmd, env=job_env(), stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)
        for cmd, _, _ in runs
    ]  # fmt: skip
    due: list[float | None] = [None] * len(runs)
    killed = [False] * len(runs)
    give_up = time.monotonic() + 300
    while time.monotonic() < give_up and any(
        p.poll() is None and not k for p, k in zip(procs, killed, strict=True)
    ):
        now = time.monotonic()
        for i, (proc, (_, ready, delay)) in enumerate(zip(procs, runs, strict=True)):
            if killed[i] or proc.poll() is not None:
                continue
            if due[i] is None and ready():
                due[i] = now + delay
            if due[i] is not None and now >= due[i]:
                kill_tree(proc.pid)
                killed[i] = True
        time.sleep(0.02)
    for proc in procs:
        if proc.poll() is None:
            kill_tree(proc.pid)
        proc.wait()
    return killed


def run_each(cmds: list[list[str]], logs: list[Path]) -> list[int]:
    """Run the commands at once, each writing to its log; their exit statuses."""
    procs = []
    for cmd, log in zip(cmds, logs, strict=True):
        with open(log, "w") as fh:
            procs.append(subprocess.Popen(cmd, env=job_env(), stdout=fh, stderr=fh))
    return [proc.wait() for proc in procs]


# ---- extraction: the shard job, and snakemake with it, killed -----------------------------


def make_extraction(root: Path, verifier_dir: Path, storage: str = "bf16"):
    """A workspace with the verifier and samples built, the shards of an uninterrupted run,
    and the shell command of shard 1's job exactly as snakemake runs it."""
    train = tiny.write_jsonl(root / "train.jsonl", tiny.conversations(60, seed=11))
    evals = tiny.write_jsonl(root / "eval.jsonl", [{"question_id": 0, "turns": ["Hello"]}])
    config = root / "config.yaml"
    extract = {"shards": 3, "storage": storage}
    tiny.write_config(config, "t", verifier_dir, train, evals, extract=extract)
    results = root / "results" / "t" / "hidden_states"
    targets = [
        f"results/t/hidden_states/shard-{i}.{ext}"
        for i in range(3)
        for ext in ("safetensors", "json")
    ]
    built = run_snakemake(root, config, *targets, "--printshellcmds")
    reference = {
        p.name: p.read_bytes() for p in sorted(results.iterdir()) if p.name.startswith("shard-")
    }
    [job] = [
        line.split("Shell command:", 1)[1].strip()
        for line in (built.stdout + built.stderr).splitlines()
        if "Shell command:" in line and "scripts/extract.py" in line and " --shard 1 " in line
    ]
    return root, config, results, targets, reference, job


@pytest.fixture(scope="module")
def extraction(tmp_path_factory, verifier_dir):
    return make_extraction(tmp_path_factory.mktemp("faults-extract"), verifier_dir)


@pytest.fixture(scope="module")
def extraction_fp8(tmp_path_factory, verifier_dir):
    return make_extraction(tmp_path_factory.mktemp("faults-extract-fp8"), verifier_dir, "fp8")


def shard_files(results: Path) -> dict[str, bytes]:
    return {
        p.name: p.read_bytes() for p in sorted(results.iterdir()) if p.name.startswith("shard-")
    }


def assert_shards_as_uninterrupted(results: Path, reference: dict[str, bytes]) -> None:
    from eagle3lib.shards import check_shard

    built = shard_files(results)
    assert built.keys() == reference.keys()
    for name, data in reference.items():
        assert_same_bytes(built[name], data, name)
    for i in range(3):
        manifest = json.loads((results / f"shard-{i}.json").read_text())
        check_shard(results / f"shard-{i}.safetensors", manifest)
    assert not list(results.glob(".*.tmp-*"))  # the killed job's half-written shard is gone


@pytest.mark.parametrize(
    ("storage", "seed"), [("bf16", seed) for seed in range(TRIALS)] + [("fp8", 0), ("fp8", 1)]
)
def test_killed_shard_job_reruns_to_the_same_bytes(request, storage, seed):
    """kill -9 of the extract job (its shell command, as snakemake runs it): even seeds while
    the shard is being written, odd seeds at a random moment of the job; bf16 and fp8 shards."""
    fixture = "extraction" if storage == "bf16" else "extraction_fp8"
    root, _config, results, _targets, reference, job = request.getfixturevalue(fixture)
    if storage == "fp8":
        assert b"F8_E4M3" in reference["shard-1.safetensors"][:4096]
    for name in ("shard-1.safetensors", "shard-1.json"):
        (results / name).unlink(missing_ok=True)
    rng = random.Random(seed)
    shard = results / "shard-1.safetensors"

    def writing() -> bool:  # its temporary file is being filled, or renamed without manifest
        return any(results.glob(".shard-1.safetensors.tmp-*")) or shard.exists()

    if seed % 2 == 0:
        ready, delay = writing, rng.uniform(0.0, 0.05)
    else:
        ready, delay = (lambda: True), rng.uniform(0.5, 3.5)
    assert kill_when(start(["bash", "-c", job], cwd=root), ready, delay), "finished first"
    rerun = subprocess.run(
        ["bash", "-c", job], cwd=root, env=job_env(), capture_output=True, text=True
    )
    assert rerun.returncode == 0, rerun.stderr
    assert_shards_as_uninterrupted(results, reference)


def test_killed_workflow_reruns_to_the_same_bytes(extraction):
    """kill -9 of snakemake with its shard jobs, then what the README says to do after a
    crash: release snakemake's lock and rerun (--rerun-incomplete, safe here because every
    artifact is written under a temporary name and renamed)."""
    root, config, results, targets, reference, _job = extraction
    for p in results.iterdir():
        if p.name.startswith("shard-"):
            p.unlink()
    logs = root / "results" / "t" / "logs"
    for log in logs.glob("extract-*.log"):
        log.unlink()
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(ROOT / "Snakefile"), "--cores", "2",
           "--workflow-profile", "none", *targets, "--configfile", str(config)]  # fmt: skip
    ready = lambda: any(logs.glob("extract-*.log"))  # noqa: E731 - a shard job has started
    assert kill_when(start(cmd, cwd=root), ready, random.Random(0).uniform(2.0, 5.0))
    locked = run_snakemake(root, config, *targets, check=False)
    said = locked.stdout + locked.stderr
    # snakemake refuses a plain rerun: its lock, or outputs of the killed jobs marked incomplete
    assert locked.returncode != 0 and ("--unlock" in said or "--rerun-incomplete" in said), said
    run_snakemake(root, config, *targets, "--unlock")
    run_snakemake(root, config, *targets, "--rerun-incomplete")
    assert_shards_as_uninterrupted(results, reference)


def test_a_rerun_refuses_while_an_orphan_writes_the_shard(extraction):
    """A process that holds shard 1's writer lock (what an orphaned extract job of an earlier
    run would hold; simulated by a process taking the same lock, as no job survives its
    snakemake now): the rerun's extract job stops with one line naming that process, and
    touches nothing the holder writes; once the holder is gone the rerun builds the shard."""
    root, config, results, targets, reference, _job = extraction
    run_snakemake(root, config, *targets)  # whatever the trials left: complete
    for name in ("shard-1.safetensors", "shard-1.json"):
        (results / name).unlink()
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; sys.path.insert(0, sys.argv[1]);"
         " from eagle3lib.lifetime import hold_folders;"
         " hold_folders('extract-1', sys.argv[2]); print('held', flush=True); time.sleep(600)",
         str(ROOT), str(results / "shard-1.safetensors")],
        stdout=subprocess.PIPE, text=True, cwd=root,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        refused = run_snakemake(root, config, *targets, check=False)
        assert refused.returncode != 0
        log = (results.parent / "logs" / "extract-1.log").read_text().strip().splitlines()
        assert log[-1].startswith(f"error: {results.relative_to(root)}: another extract-1 job")
        assert f"(pid {holder.pid} on " in log[-1] and "Traceback" not in "".join(log)
        assert not (results / "shard-1.safetensors").exists()
    finally:
        holder.kill()
        holder.wait()
    run_snakemake(root, config, *targets)
    assert_shards_as_uninterrupted(results, reference)


def test_truncated_shard_is_rebuilt_not_trained_on(extraction):
    """A shard cut short after it was built (disk trouble, a bad copy) no longer matches its
    manifest: the next run rebuilds that shard, and only that one."""
    root, config, results, targets, reference, _job = extraction
    run_snakemake(root, config, *targets)  # whatever the trials left: complete
    shard = results / "shard-1.safetensors"
    with open(shard, "r+b") as fh:
        fh.truncate(shard.stat().st_size // 2)
    manifest = results / "shard-1.json"
    kept = manifest.read_bytes(), manifest.stat().st_mtime_ns
    plan = run_snakemake(root, config, *targets, "--dry-run")
    assert "rebuilding shard 1" in plan.stderr and "extract" in job_counts(plan.stdout)
    assert (manifest.read_bytes(), manifest.stat().st_mtime_ns) == kept  # a dry run changes nothing
    proc = run_snakemake(root, config, *targets)
    out = proc.stdout + proc.stderr
    assert "shard-1.safetensors" in out and "rebuilding shard 1" in out
    assert [j for j in executed_jobs(out) if j.startswith("extract")] == ["extract[shard=1]"]
    assert_same_bytes(shard, reference["shard-1.safetensors"])


# ---- snakemake's whole process group killed: no job outlives it ---------------------------


def job_processes(root: int, script: str) -> list[int]:
    """Processes below ``root`` that run scripts/<script> (not the GPU wrapper naming it)."""
    found = []
    for pid in descendants(root):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if len(argv) > 1 and argv[1].decode().endswith(f"scripts/{script}") and alive(pid):
            found.append(pid)
    return found


def test_killing_snakemakes_process_group_leaves_no_job_running(tmp_path, verifier_dir):
    """kill -9 of snakemake's process group (a scheduler, a lost login shell) while an
    extract, a train and an evaluate job runs: within seconds none of the processes snakemake
    had started is left (the jobs run in their own sessions, outside that group)."""
    train = tiny.write_jsonl(tmp_path / "train.jsonl", tiny.conversations(40, seed=2))
    prompts = [{"question_id": i, "turns": [f"Tell me about {w}"]} for i, w in enumerate("abc")]
    evals = tiny.write_jsonl(tmp_path / "eval.jsonl", prompts)
    config = tiny.write_config(
        tmp_path / "config.yaml", "t", verifier_dir, train, evals,
        train={"epochs": 4}, evaluate={"k": 3, "max_new_tokens": 40},
    )  # fmt: skip
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(ROOT / "Snakefile"),
           "--cores", "2", "--workflow-profile", "none", "--rerun-incomplete",
           "--configfile", str(config)]  # fmt: skip
    for script in ("extract.py", "train.py", "evaluate.py"):
        snakemake = start(cmd, cwd=tmp_path)
        pid = snakemake.pid
        assert wait_until(lambda s=script, p=pid: job_processes(p, s), 300), script
        time.sleep(1.0)  # past its start-up
        tree = descendants(pid)
        [job] = job_processes(pid, script)
        argv = Path(f"/proc/{job}/cmdline").read_bytes().decode().split("\0")
        last_output = tmp_path / argv[argv.index("--provenance") + 1]  # written last
        os.killpg(pid, signal.SIGKILL)
        snakemake.wait()
        assert wait_until(lambda t=tree: not [p for p in t if alive(p)], 10), (
            f"{script}: still running: {[p for p in tree if alive(p)]}"
        )
        assert not last_output.exists(), f"{script} was not stopped: it finished"
        run_snakemake(tmp_path, config, "--unlock")


# ---- training: the train job killed mid-epoch --------------------------------------------------


def step_counters(epoch_dir: Path) -> set[float]:
    import torch

    state = torch.load(epoch_dir / "optimizer_state_dict.pt", weights_only=True)
    return {float(s["step"]) for s in state["state"].values()}


def test_killed_training_resumes_mid_epoch_to_the_same_bytes(pipeline, tmp_path):
    """kill -9 after a mid-epoch checkpoint: the rerun resumes from it (not from zero), the
    optimiser's step counter is exact, and the checkpoint equals an uninterrupted run's."""
    import dataclasses

    cfg = dataclasses.replace(pipeline["train_cfg"], epochs=1, checkpoint_freq=0.25)
    ref = tmp_path / "ref"
    ref.mkdir()
    subprocess.run(train_command(pipeline, ref, cfg), check=True, capture_output=True)
    reference = (ref / "checkpoint" / "model.safetensors").read_bytes()
    total_steps = json.loads((ref / "state" / "0" / "training_state.json").read_text())[
        "global_step"
    ]

    def train_records(work: Path) -> int:
        metrics = work / "state" / "metrics.jsonl"
        if not metrics.exists():
            return 0
        return sum('"train"' in line for line in metrics.read_text().splitlines())

    works = [tmp_path / f"trial{seed}" for seed in range(TRIALS)]
    cmds = []
    for work in works:
        work.mkdir()
        cmds.append(train_command(pipeline, work, cfg))
    # each killed at a seeded moment after its first mid-epoch checkpoint was saved
    killed = kill_each(
        [
            (cmd, lambda w=work: any((w / "state").glob("[0-9]*/training_state.json")),
             random.Random(seed).uniform(0.0, 1.5))
            for seed, (cmd, work) in enumerate(zip(cmds, works, strict=True))
        ]
    )  # fmt: skip
    assert all(killed), killed
    had_checkpoint = [any((w / "state").glob("[0-9]*/training_state.json")) for w in works]
    steps_before = [train_records(w) for w in works]
    statuses = run_each(cmds, [w / "rerun.log" for w in works])
    for seed, work in enumerate(works):
        assert statuses[seed] == 0, (work / "rerun.log").read_text()[-2000:]
        summary = json.loads((work / "summary.json").read_text())
        if had_checkpoint[seed]:  # continued from it (its state kept): fewer steps than a run
            assert summary["resumed"] is True, seed
            assert train_records(work) - steps_before[seed] < total_steps
        assert_same_bytes(work / "checkpoint" / "model.safetensors", reference, f"trial {seed}")
        final = work / summary["final_epoch_dir"]
        global_step = json.loads((final / "training_state.json").read_text())["global_step"]
        assert global_step == total_steps and step_counters(final) == {float(total_steps)}
        states = work / "state"
        assert not list(states.glob("*.old")) and not (states / ".staging").exists()


def test_step_counter_is_exact_above_256(tmp_path):
    """speculators saves optimiser state in bf16, where 257 reads back as 256; ours does not."""
    import torch
    from speculators.train.checkpointer import SingleGPUCheckpointer

    from eagle3lib import speculators_compat

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(257):
        model(torch.ones(1, 4)).sum().backward()
        opt.step()
    with speculators_compat.cpu_trainer_patches():
        stock = SingleGPUCheckpointer(tmp_path / "stock")
        model.save_pretrained = lambda path, state_dict: Path(path).mkdir(parents=True)
        stock.save_checkpoint(model, opt, 0)
        ours = SingleGPUCheckpointer(tmp_path / "ours")
        with speculators_compat.speculators_patches("fp32_state", checkpointer=ours):
            ours.save_checkpoint(model, opt, 0)
    assert step_counters(tmp_path / "stock" / "0") == {256.0}  # speculators as installed
    assert step_counters(tmp_path / "ours" / "0") == {257.0}


# ---- regeneration: the regenerate job killed ---------------------------------------------------


def test_killed_regeneration_resumes_to_the_same_bytes(verifier_record, tmp_path):
    from eagle3lib.fileio import write_json

    convs = tiny.write_jsonl(tmp_path / "train.jsonl", tiny.conversations(24, seed=3))
    write_json(tmp_path / "verifier.json", verifier_record)
    data = {"train": {"path": str(convs)}, "max_length": 256}
    section = {"backend": "hf", "max_new_tokens": 12, "batch_size": 4, "chunk_size": 4}

    def command(work: Path) -> list[str]:
        return regenerate_command(tmp_path / "verifier.json", convs, data, section, work)

    subprocess.run(command(tmp_path / "ref"), check=True, capture_output=True)
    reference = (tmp_path / "ref" / "out.jsonl").read_bytes()
    works = [tmp_path / f"trial{seed}" for seed in range(TRIALS)]
    killed = kill_each(
        [
            (command(work),
             lambda w=work, n=1 + seed % 3: len(list((w / "chunks").glob("chunk-*.jsonl"))) >= n,
             random.Random(seed).uniform(0.0, 0.5))
            for seed, work in enumerate(works)
        ]
    )  # fmt: skip
    done = [len(list((w / "chunks").glob("chunk-*.jsonl"))) for w in works]
    statuses = run_each([command(w) for w in works], [w / "rerun.log" for w in works])
    for seed, work in enumerate(works):
        assert statuses[seed] == 0, (work / "rerun.log").read_text()[-2000:]
        info = json.loads((work / "info.json").read_text())
        if killed[seed]:
            assert info["chunks_reused"] == done[seed]  # finished chunks were not redone
        assert_same_bytes(work / "out.jsonl", reference, f"trial {seed}")
    assert sum(killed) >= 3, killed  # most trials were cut off, not finished first


# ---- a full disk -------------------------------------------------------------------------------


@contextlib.contextmanager
def tmpfs(mnt: Path, size: str):
    """A tmpfs of ``size`` at ``mnt`` (needs root or CAP_SYS_ADMIN: the test is skipped where
    mounting is not permitted)."""
    mnt.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True
    )
    if proc.returncode != 0:
        pytest.skip(
            "cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): "
            f"{proc.stderr.decode().strip()}"
        )
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs."""
    with tmpfs(tmp_path / "small", "1m") as mnt:
        yield mnt


def test_full_disk_is_a_clear_error_and_leaves_nothing(pipeline, small_disk):
    from eagle3lib.config import ExtractConfig
    from eagle3lib.errors import UserError
    from eagle3lib.hidden_states import extract_shard

    shard, manifest = small_disk / "shard-0.safetensors", small_disk / "shard-0.json"
    with pytest.raises(UserError, match=r"shard-0\.safetensors: cannot reserve .* free disk space"):
        extract_shard(
            pipeline["samples"], pipeline["ids"], 0, ExtractConfig(shards=2, batch_tokens=512),
            pipeline["record"], shard, manifest,
        )  # fmt: skip
    assert list(small_disk.iterdir()) == []  # no shard, no temp file, no manifest


def test_disk_full_during_a_write_is_one_line(small_disk):
    """Any write that runs out of space (a manifest, a log, a checkpoint) exits with one line
    naming the file, not a traceback."""
    code = (
        "import sys; sys.path.insert(0, {!r})\n"
        "from eagle3lib.errors import cli\n"
        "from eagle3lib.fileio import write_json\n"
        "cli(lambda: write_json({!r}, {{'x': 'y' * (4 << 20)}}))()\n"
    ).format(str(ROOT), str(small_disk / "big.json"))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "free disk space" in lines[0]
    assert str(small_disk) in lines[0]
    assert list(small_disk.iterdir()) == []


@pytest.mark.parametrize(
    ("size", "what"),
    [
        ("256k", r"No space left on device"),  # the model (403 KB) fails: safetensors' error
        ("640k", r"No space left on device \(torch: .*unexpected pos \d+ vs \d+\)"),  # torch.save's
    ],
)
def test_disk_full_while_saving_a_training_checkpoint_is_one_line(pipeline, tmp_path, size, what):
    """The train job's state folder on a disk too small for its first checkpoint (a real
    tmpfs): safetensors fails on the model (a SafetensorError naming os error 28), or, where
    the model fits, torch.save on the optimiser state (a RuntimeError naming no cause); the job
    reports either as the one line of a full disk naming the state folder (torch's line kept),
    with the half-written checkpoint removed (its space freed) and no epoch folder."""
    import dataclasses

    with tmpfs(tmp_path / "tiny", size) as disk:
        cfg = dataclasses.replace(pipeline["train_cfg"], epochs=1)
        cmd = train_command(pipeline, tmp_path, cfg)
        cmd[cmd.index("--state-dir") + 1] = str(disk / "state")
        proc = subprocess.run(cmd, env=job_env(), capture_output=True, text=True)
        assert proc.returncode == 1, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
        last = proc.stderr.strip().splitlines()[-1]
        assert re.fullmatch(
            rf"error: {re.escape(str(disk / 'state'))}: {what}; free disk space or point the "
            r"results elsewhere, then rerun",
            last,
        ), proc.stderr[-3000:]
        left = sorted(p.name for p in (disk / "state").iterdir())
        assert ".staging" not in left and not [n for n in left if n.isdigit()], left
        assert not (tmp_path / "checkpoint" / "model.safetensors").exists()


@pytest.mark.slow
def test_disk_full_in_a_job_of_two_processes_is_one_line_on_each(pipeline, tmp_path):
    """Two processes (torchrun, gloo) with the state folder on a real 256 KiB tmpfs: rank 0's
    save fails on the full disk while rank 1 waits at speculators' barrier after it. Rank 0
    prints the full disk's line; rank 1, whose barrier then loses rank 0, one line saying so
    (or none, where torchrun's SIGTERM reaches it first), and torchrun one line a rank: no
    traceback (rank 1 printed gloo's before). torchrun names one rank "the first": the one whose
    end it saw first, which can be rank 1 (it stops as soon as rank 0 closes its connection,
    and rank 0's process may take longer to end after that; seen in a fresh-clone run)."""
    import dataclasses

    with tmpfs(tmp_path / "tiny", "256k") as disk:
        cfg = dataclasses.replace(pipeline["train_cfg"], epochs=1)
        cmd = [*train_command(pipeline, tmp_path, cfg), "--processes", "2"]
        cmd[cmd.index("--state-dir") + 1] = str(disk / "state")
        proc = subprocess.run(cmd, env=job_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors[0] == (
        f"error: {disk / 'state'}: No space left on device; free disk space or point the "
        "results elsewhere, then rerun"
    ), proc.stderr[-3000:]
    assert all(line.startswith("error: rank 1: another process") for line in errors[1:]), errors
    ends = re.findall(r"^torchrun: rank (\d) \(pid \d+\) exited with status (\d+)(, the first)?$",
                      proc.stderr, re.M)  # fmt: skip
    assert sorted(rank for rank, _, _ in ends) == ["0", "1"], proc.stderr[-3000:]
    assert ("0", "1") in [(rank, status) for rank, status, _ in ends], proc.stderr[-3000:]
    assert sum(bool(first) for _, _, first in ends) == 1, proc.stderr[-3000:]


def test_a_disk_too_small_for_the_epochs_to_come_is_warned_of_after_the_first(pipeline, tmp_path):
    """Two epochs with the state folder on a real 1.5 MiB tmpfs, which holds one epoch's state
    (about 0.9 MB) but not two: after the first save the log warns, once, that the second will
    not fit, with the sizes; the second save then stops the job with the full disk's line."""
    import dataclasses

    with tmpfs(tmp_path / "small", "1536k") as disk:
        cfg = dataclasses.replace(pipeline["train_cfg"], epochs=2)
        cmd = train_command(pipeline, tmp_path, cfg)
        cmd[cmd.index("--state-dir") + 1] = str(disk / "state")
        proc = subprocess.run(cmd, env=job_env(), capture_output=True, text=True)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        warnings = [line for line in proc.stderr.splitlines() if "train: warning:" in line]
        assert len(warnings) == 1, proc.stderr[-3000:]
        found = re.fullmatch(
            r"train: warning: an epoch's state takes ([\d.e-]+) GB and 1 more are to be saved "
            rf"\(([\d.e-]+) GB\), but {re.escape(str(disk / 'state'))} has ([\d.e-]+) GB free: "
            r"free disk space before then, or the job stops at a full disk \(a rerun resumes "
            r"from the last state saved\)",
            warnings[0],
        )
        assert found, warnings[0]
        state = sum(p.stat().st_size for p in (disk / "state" / "0").iterdir())
        # the epoch's folder as saved (about 0.0009 GB; its validation metrics come after)
        assert found.group(1) == found.group(2)
        assert float(found.group(1)) == pytest.approx(state / 1e9, abs=1e-5)
        assert float(found.group(3)) < state / 1e9  # the second will not fit
        assert proc.stderr.strip().splitlines()[-1].startswith(f"error: {disk / 'state'}: No space")


@pytest.mark.parametrize(
    ("script", "key"),
    [("train.py", "train.total_seq_len"), ("extract.py", "extract.jobs_per_gpu: 1")],
)
def test_a_job_out_of_gpu_memory_says_so_in_one_line_naming_the_key(tmp_path, script, key):
    """torch's OutOfMemoryError (what a GPU job raises when its batch does not fit; raised
    here on the CPU) ends the job with one line naming the config key to lower, not a
    traceback; any other error still shows its traceback."""
    body = (
        "import sys; sys.path.insert(0, {!r})\n"
        "import torch\n"
        "from eagle3lib.errors import cli\n"
        "def main():\n"
        "    raise {}\n"
        "cli(main)()\n"
    )
    oom = "torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB.\\nmore')"
    path = tmp_path / script
    path.write_text(body.format(str(ROOT), oom))
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: the GPU ran out of memory (CUDA out of memory. Tried to")
    assert key in lines[0] and lines[0].endswith("then rerun")

    path.write_text(body.format(str(ROOT), "RuntimeError('a bug')"))
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True)
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "a bug" in proc.stderr
