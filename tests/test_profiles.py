"""The Snakemake profiles in profiles/: the workstation profile's GPU cap and the sbatch lines
the SLURM profile makes the slurm executor plugin submit for every rule."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import slurm_stub
import tiny
import yaml

ROOT = Path(__file__).resolve().parents[1]
WORKSTATION = ROOT / "profiles" / "workstation"
SLURM = ROOT / "profiles" / "slurm"
DEFAULT = ROOT / "profiles" / "default"  # the workflow profile snakemake loads by itself
PROFILE_FILE = "profile.v9+.yaml"

# The GPU counts of the test config (resources: gpu=N of each GPU rule).
GPUS = {"extract": 1, "train": 2, "evaluate": 1}
CPU_RULES = ("verifier", "prepare", "vocab")


def snakemake(
    workdir: Path,
    configfile: Path,
    *args: str,
    env=None,
    timeout: float = 120,
    workflow_profile: str | None = "none",
):
    """`snakemake` on this repo's Snakefile in ``workdir``, like conftest.run_snakemake but
    without --cores (profiles set it), with a timeout and an optional environment. The runs
    with a --profile pass ``workflow_profile=None``: profiles/default is then merged in, as
    for a user, so that they show it replaces nothing of the profile."""
    if env is None:
        env = dict(os.environ)
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(ROOT / "Snakefile")]
    cmd += ["--directory", str(workdir)]
    if workflow_profile is not None:
        cmd += ["--workflow-profile", workflow_profile]
    cmd += [*args, "--configfile", str(configfile)]  # targets before --configfile
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


def job_resources(output: str) -> dict[str, list[dict[str, str]]]:
    """The `resources:` line of every job block of a run's output, by rule."""
    jobs: dict[str, list[dict[str, str]]] = {}
    for block in re.split(r"\n(?=(?:local)?rule \w+:)", output):
        m = re.match(r"(?:local)?rule (\w+):", block.strip())
        r = re.search(r"^\s+resources: (.+)$", block, re.MULTILINE)
        if m and r:
            pairs = (item.split("=", 1) for item in r.group(1).split(", ") if "=" in item)
            jobs.setdefault(m.group(1), []).append({k: v for k, v in pairs})
    return jobs


@pytest.fixture
def workspace(tmp_path, verifier_dir):
    """A working directory with tiny data and a config whose GPU rules ask for GPUS."""
    train = tiny.write_jsonl(tmp_path / "train.jsonl", tiny.conversations(8, seed=3))
    evals = tiny.write_jsonl(
        tmp_path / "eval.jsonl", [{"question_id": 1, "turns": ["Tell me about the model"]}]
    )

    def write(**gpus):
        counts = {**GPUS, **gpus}
        return tiny.write_config(
            tmp_path / "config.yaml",
            "t",
            verifier_dir,
            train,
            evals,
            extract={"gpus_per_job": counts["extract"]},
            train={"gpus": counts["train"]},
            evaluate={"gpus": counts["evaluate"]},
        )

    write.dir = tmp_path
    return write


# ---- the profile files themselves ------------------------------------------------------------


PROFILES = [WORKSTATION, SLURM, DEFAULT]


@pytest.mark.parametrize("profile", PROFILES, ids=[p.name for p in PROFILES])
def test_snakemake_picks_the_profile_file(profile):
    from snakemake.cli import get_profile_dir

    assert get_profile_dir(str(profile)) == (profile, profile / PROFILE_FILE)
    assert sorted(p.name for p in profile.iterdir()) == [PROFILE_FILE]


@pytest.mark.parametrize("profile", PROFILES, ids=[p.name for p in PROFILES])
def test_every_profile_entry_is_commented(profile):
    lines = (profile / PROFILE_FILE).read_text().splitlines()
    for i, line in enumerate(lines):
        if re.match(r"^\s*[\w-]+:", line) and "#" not in line:
            above = lines[i - 1].strip() if i else ""
            assert above.startswith("#"), f"{profile.name} line {i + 1} has no comment: {line}"


def test_the_workflow_profile_only_shows_failed_logs():
    """profiles/default sets one key, so that it replaces no key of a --profile (profiles merge
    per top-level key) and a plain `snakemake` shows a failed job's log on the terminal."""
    assert yaml.safe_load((DEFAULT / PROFILE_FILE).read_text()) == {"show-failed-logs": True}


def test_slurm_profile_requests_gpus_only_through_the_gpu_resource():
    profile = yaml.safe_load((SLURM / PROFILE_FILE).read_text())
    assert profile["executor"] == "slurm"
    # every GPU-capable rule (serve_check and regenerate are off in the run test below)
    assert set(profile["set-resources"]) == set(GPUS) | {"serve_check", "regenerate"}
    for rule, resources in profile["set-resources"].items():
        assert resources["slurm_partition"] != profile["default-resources"]["slurm_partition"]
        assert {"runtime", "mem_mb"} <= set(resources), rule
        # GPU counts come from the config; `gpus`/`nvidia_gpu` would request no GPU and
        # `tasks` would run the job once per GPU
        # (https://github.com/snakemake/snakemake-executor-plugin-slurm/issues/459).
        forbidden = {"gpu", "gpus", "nvidia_gpu", "gres", "tasks", "tasks_per_gpu", "slurm_extra"}
        assert not forbidden & set(resources), rule
    assert profile["set-resources"]["train"]["cpus_per_gpu"] >= 1


# ---- runs ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_workstation_profile_dry_run_shows_gpu_resources_and_caps_them(workspace):
    proc = snakemake(
        workspace.dir, workspace(), "-n", "--profile", str(WORKSTATION), workflow_profile=None
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert re.search(
        rf"Using profiles {WORKSTATION} and workflow specific profile \S*default ", out
    )
    # the shards' size is known before anything runs (tiny verifier: 4 slots of 64)
    assert "hidden states: 517 bytes a token (4 slots of 64 in bf16; extract.storage: fp8" in out
    jobs = job_resources(out)
    assert len(jobs["extract"]) == 2
    for rule, count in GPUS.items():
        assert all(job["gpu"] == str(count) for job in jobs[rule]), (rule, jobs[rule])
    for rule in CPU_RULES:
        assert all("gpu" not in job for job in jobs[rule]), (rule, jobs[rule])

    # The profile's `resources: [gpu=2]` is the machine's GPU count: a job asking for more is
    # scaled down to it (and never runs next to another GPU job holding those devices).
    proc = snakemake(workspace.dir, workspace(train=5), "-n", "--profile", str(WORKSTATION))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [job["gpu"] for job in job_resources(proc.stdout)["train"]] == ["2"]


def pretend_built(work: Path, config: Path, env: dict | None = None) -> None:
    """Every output and benchmark file of the DAG, empty: jobs submitted to the stub sbatch
    only pretend to run, and Snakemake checks that a finished job's files exist."""
    dry = snakemake(work, config, "-n", "--cores", "1", env=env, timeout=60)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    files = re.findall(r"^\s+(?:output|benchmark): (.+)$", dry.stdout, re.MULTILINE)
    assert files
    for path in (p for line in files for p in line.split(", ")):
        (work / path).parent.mkdir(parents=True, exist_ok=True)
        (work / path).touch()
        if re.search(r"hidden_states/shard-\d+\.json$", path):  # describes the empty shard,
            (work / path).write_text('{"file": {"bytes": 0}}')  # else it would be rebuilt
        if re.search(r"/provenance-[\w-]+\.json$", path):  # a record without a stamp (an
            (work / path).write_text("{}")  # unreadable one marks its artifacts stale)


def submit_to_stubs(
    work: Path, config: Path, env: dict, *args: str, timeout: float = 150, **kwargs
):
    """snakemake --profile profiles/slurm with the stub SLURM commands of ``env``, polling
    every second; ``args`` last (targets); ``kwargs`` go to ``snakemake``."""
    return snakemake(
        work, config, "--profile", str(SLURM), "--jobs", "4", "--latency-wait", "1",
        "--seconds-between-status-checks", "1", "--slurm-init-seconds-before-status-checks",
        "1", *args, env=env, timeout=timeout, **kwargs,
    )  # fmt: skip


def sbatch_jobs(calls: list[dict]) -> dict[str, list[list[str]]]:
    """The recorded sbatch calls by rule (from --comment rule_<rule>[_wildcards_<w>]), each
    without its --wrap (the job's own snakemake command line)."""
    jobs: dict[str, list[list[str]]] = {}
    for call in calls:
        if call["tool"] != "sbatch":
            continue
        argv = call["argv"]
        comment = argv[argv.index("--comment") + 1]
        rule = re.fullmatch(r"rule_(\w+?)(?:_wildcards_.*)?", comment).group(1)
        jobs.setdefault(rule, []).append([a for a in argv if not a.startswith("--wrap")])
    return jobs


@pytest.mark.slow
def test_slurm_profile_submits_gpu_rules_with_gpus_and_cpu_rules_without(workspace):
    """A real (not dry) run of the whole workflow with --profile profiles/slurm.

    The stub scripts of tests/slurm_stub.py (`sbatch`, `sacctmgr`, `scontrol`, `sshare`,
    `squeue`, `sacct`), first on PATH, stand in for a SLURM cluster, which cannot run here:
    they record their command lines, `sbatch` prints a job id without running anything, and
    `squeue`/`sacct` report every submitted job COMPLETED. The outputs of all jobs are created empty beforehand and
    --forceall submits every job anyway, so the plugin walks the whole DAG, rule by rule, and
    every sbatch line it builds is recorded and checked.
    """
    profile = yaml.safe_load((SLURM / PROFILE_FILE).read_text())
    defaults, per_rule = profile["default-resources"], profile["set-resources"]
    config = workspace()
    work = workspace.dir

    stubs = slurm_stub.install(work / "slurm-stubs")
    env = slurm_stub.environment(stubs, defaults["slurm_account"])

    pretend_built(work, config)
    # as a user runs it: profiles/default merged in
    proc = submit_to_stubs(work, config, env, "--forceall", workflow_profile=None)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert re.search(rf"Using profiles {SLURM} and workflow specific profile \S*default ", out)
    assert "SLURM run ID" in out

    calls = [json.loads(line) for line in (stubs / "calls.jsonl").read_text().splitlines()]
    jobs = sbatch_jobs(calls)
    (work / "sbatch-lines.txt").write_text(
        "".join(f"{rule}: {shlex.join(a)}\n" for rule, argvs in jobs.items() for a in argvs)
    )
    assert {rule: len(argvs) for rule, argvs in jobs.items()} == {
        "verifier": 1,
        "prepare": 1,
        "extract": 2,
        "vocab": 1,
        "train": 1,
        "check_checkpoint": 1,
        "evaluate": 1,
        "report": 1,
        "validate": 1,
    }
    for call in calls:
        if call["tool"] == "sbatch":
            assert not any("--ntasks-per-gpu" in a for a in call["argv"]), call["argv"]

    def flags(argv):
        return {a for a in argv if a.startswith("--")}

    for rule, argvs in jobs.items():
        for argv in argvs:
            assert argv[argv.index("-A") + 1] == defaults["slurm_account"], argv
            partition = per_rule.get(rule, defaults)["slurm_partition"]
            assert argv[argv.index("-p") + 1] == partition, argv
            gpu_flags = {f for f in flags(argv) if f.startswith(("--gpus", "--gres"))}
            if rule in GPUS:
                assert gpu_flags == {f"--gpus={GPUS[rule]}"}, argv
            else:
                assert not gpu_flags, argv
                assert not any(f.startswith("--cpus-per-gpu") for f in flags(argv)), argv
    (train,) = jobs["train"]
    assert f"--cpus-per-gpu={per_rule['train']['cpus_per_gpu']}" in train
    assert "--nodes=1" in train  # DDP on one node: its GPUs never spread over several
    assert not any(a.startswith("--cpus-per-task") for a in train), train
    # every other rule: --cpus-per-task = its threads (profiles/README.md's table)
    threads = {"prepare": 8, "extract": 4, "evaluate": 4}
    for rule in ("extract", "evaluate", "check_checkpoint", "report", "validate", *CPU_RULES):
        cpus = [a for a in jobs[rule][0] if a.startswith("--cpus-per-task=")]
        assert cpus == [f"--cpus-per-task={threads.get(rule, 1)}"], jobs[rule]
