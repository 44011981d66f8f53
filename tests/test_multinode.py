"""One train job over several SLURM nodes (train.nodes, eagle3lib/multinode.py), without a
cluster: stub SLURM commands (tests/slurm_stub.py) record the sbatch and srun lines, and the
stub srun starts each "node" as a process of this machine, so the rest is real: the GPU
wrapper per node, torchrun per node, a c10d rendezvous on 127.0.0.1, gloo between the ranks.

Two "nodes" of one process each train with the global batch of one node with two processes
(tests/conftest.py's two_process_training), so their checkpoints must be the same bytes.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import slurm_stub
from conftest import ROOT, alive, assert_same_bytes, train_command, wait_until

from eagle3lib import multinode, report
from eagle3lib.errors import UserError
from eagle3lib.multinode import ENDPOINT_VAR, RDZV_ID_VAR

TORCHRUN = [sys.executable, str(ROOT / "scripts" / "torchrun.py")]


# ---- planning and command lines ---------------------------------------------------------------


def test_extract_jobs_share_gpus_only_outside_the_slurm_executor():
    refusal = multinode.sharing_refusal(2, "slurm")
    assert refusal.startswith("config key extract.jobs_per_gpu: 2 shares the GPUs of this")
    assert "the slurm executor runs jobs elsewhere" in refusal and refusal.endswith("set it to 1")
    for executor in ("slurm-jobstep", "kubernetes", "cluster-generic"):
        assert multinode.sharing_refusal(2, executor)
    for executor in ("local", "dryrun", "touch", None):
        assert multinode.sharing_refusal(2, executor) is None
    assert multinode.sharing_refusal(1, "slurm") is None


def test_several_nodes_need_slurm():
    no_sbatch, sbatch = (lambda _: None), (lambda _: "/usr/bin/sbatch")
    refusal = multinode.nodes_refusal(2, "local", {}, no_sbatch)
    assert refusal.startswith("config key train.nodes: 2 nodes need SLURM") and "\n" not in refusal
    assert "train.nodes: 1" in refusal and "--profile profiles/slurm" in refusal
    assert multinode.nodes_refusal(1, "local", {}, no_sbatch) is None
    for executor in ("slurm", "slurm-jobstep"):
        assert multinode.nodes_refusal(2, executor, {}, no_sbatch) is None
    # inside an allocation srun reaches its nodes, whatever runs the jobs
    assert multinode.nodes_refusal(2, "local", {"SLURM_JOB_ID": "7"}, no_sbatch) is None
    # jobs run here: a login node's sbatch does not help them
    assert multinode.nodes_refusal(2, "local", {}, sbatch) == refusal
    # a dry run (or --touch) runs nothing: SLURM is there if sbatch is
    for executor in ("dryrun", "touch"):
        assert multinode.nodes_refusal(2, executor, {}, sbatch) is None
        assert multinode.nodes_refusal(2, executor, {}, no_sbatch) == refusal


def test_allocation_hosts_come_from_scontrol():
    """The SLURM job-step executor drops SLURM_JOB_NODELIST from the job's environment (it
    keeps the job id): then the node list is the job's, from `scontrol show job`."""
    calls = []

    def run(argv):
        calls.append(argv)
        if argv[2] == "job":
            return "JobId=7 JobName=t JobState=RUNNING NodeList=gpu[03-04] BatchHost=gpu03\n"
        return "gpu03\ngpu04\n"

    assert multinode.allocation_hosts({"SLURM_JOB_ID": "7"}, run) == ["gpu03", "gpu04"]
    assert calls == [
        ["scontrol", "show", "job", "-o", "7"],
        ["scontrol", "show", "hostnames", "gpu[03-04]"],
    ]
    calls.clear()
    assert multinode.allocation_hosts({"SLURM_JOB_NODELIST": "gpu[03-04]"}, run)[0] == "gpu03"
    assert calls == [["scontrol", "show", "hostnames", "gpu[03-04]"]]
    with pytest.raises(UserError, match="SLURM_JOB_ID is not set"):
        multinode.allocation_hosts({}, run)


def test_exit_status_of_a_worker_ended_by_a_signal():
    assert [multinode.exit_status(c) for c in (0, 1, 143, -15, -9)] == [0, 1, 143, 143, 137]


def test_srun_and_torchrun_command_lines():
    wrapper = ["python", "gpu_job.py", "--per-node"]
    assert multinode.srun_argv(2, 8, 64, wrapper) == [
        "srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
        "--label", "--cpus-per-task=64", "--gres=gpu:8", *wrapper,
    ]  # fmt: skip
    assert "--gres" not in " ".join(multinode.srun_argv(2, 0, None, wrapper))

    env = {ENDPOINT_VAR: "gpu03:41000", RDZV_ID_VAR: "7-41000", "SLURM_NODEID": "1"}
    script = ["train.py", "--nodes", "2"]
    assert multinode.relaunch(2, 8, script, env) == (
        False,  # node 1 leaves the artifact locks to node 0
        [
            *TORCHRUN, "--nnodes=2", "--nproc-per-node=8", "--rdzv-backend=c10d",
            "--rdzv-endpoint=gpu03:41000", "--rdzv-id=7-41000", "--rdzv-conf=is_host=0",
            "--max-restarts=0", *script,
        ],
    )  # fmt: skip
    lock, argv = multinode.relaunch(2, 0, script, {**env, "SLURM_NODEID": "0"})
    assert lock is True and "--nproc-per-node=1" in argv  # a CPU node: one process
    assert "--rdzv-conf=is_host=1" in argv  # node 0's torchrun holds the rendezvous store
    # one node: torchrun --standalone for several processes, else the script trains itself
    assert multinode.relaunch(1, 2, script, {}) == (
        True,
        [*TORCHRUN, "--standalone", "--nproc-per-node=2", *script],
    )
    assert multinode.relaunch(1, 1, script, {}) == (True, None)
    assert multinode.relaunch(2, 8, script, {**env, "LOCAL_RANK": "0"}) == (False, None)
    with pytest.raises(UserError, match="not started by the GPU wrapper's srun step"):
        multinode.relaunch(2, 8, script, {"SLURM_NODEID": "0"})


def test_a_lost_rendezvous_store_ends_torchrun_with_one_line(monkeypatch, capsys):
    """A node's torchrun whose rendezvous store went away (node 0's torchrun ended first)
    prints one line naming the cause, not torch's traceback, and fails."""
    from torch.distributed import run
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    def lost(_argv):
        try:
            raise RuntimeError("Failed to recv, got 0 bytes.\nConnection was likely closed.")
        except RuntimeError as exc:
            raise RendezvousConnectionError("The connection to the C10d store has failed.") from exc

    monkeypatch.setattr(run, "main", lost)
    assert multinode.run_torchrun(["train.py"]) == 1
    err = capsys.readouterr().err
    assert err == (
        "torchrun: no connection to the rendezvous store on node 0 (its torchrun ended, or "
        "cannot be reached); this node's workers, if started, were stopped: Failed to recv, "
        "got 0 bytes.\n"
    )


def test_several_nodes_without_slurm_stop_the_run_while_it_plans(verifier_dir, tmp_path):
    """On a workstation (no SLURM, no sbatch on PATH) a dry run and a real run with
    train.nodes: 2 both stop with one line naming the key, before any job runs."""
    import tiny
    from test_profiles import snakemake

    train = tiny.write_jsonl(tmp_path / "train.jsonl", tiny.conversations(4, seed=1))
    evals = tiny.write_jsonl(tmp_path / "eval.jsonl", [{"question_id": 1, "turns": ["Hi"]}])
    config = tiny.write_config(
        tmp_path / "config.yaml", "t", verifier_dir, train, evals, train={"nodes": 2}
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), "/usr/bin", "/bin"])
    for args in (["-n"], ["--cores", "1"]):
        proc = snakemake(tmp_path, config, *args, env=env, timeout=120)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 1 and errors == [
            "error: " + multinode.nodes_refusal(2, "local", {}, lambda _: None)
        ], proc.stderr[-3000:]
        assert not (tmp_path / "results").exists()


def gpu_record(host: str, used: dict[int, tuple[float, float]], rule: str = "extract") -> dict:
    """A GPU wrapper's record on ``host``: used MiB before and after per device index."""

    def reading(i: int) -> dict:
        return {
            "available": True,
            "devices": [
                {"index": d, "name": "H200", "used_mib": mib[i], "pids": [9] if i else []}
                for d, mib in used.items()
            ],
        }

    return {
        "rule": rule, "host": host, "gpus_requested": len(used),
        "before": reading(0), "after": reading(1), "stray_processes": False,
    }  # fmt: skip


def test_gpu_memory_check_is_per_node(tmp_path):
    """Shard jobs on two nodes both use their node's GPU 0; a train job spans both nodes. Each
    record is compared with itself, on its host: the leak is named with its node."""
    from eagle3lib.fileio import write_json

    records = {
        "extract-0": gpu_record("gpu03", {0: (100.0, 5000.0)}),
        "extract-1": gpu_record("gpu04", {0: (4800.0, 4800.0)}),
        "train": {
            "rule": "train", "nodes": 2, "hosts": ["gpu03", "gpu04"], "gpus_requested": 2,
            "per_node": [
                gpu_record("gpu03", {0: (0.0, 0.0), 1: (0.0, 0.0)}, "train"),
                gpu_record("gpu04", {0: (0.0, 0.0), 1: (10.0, 700.0)}, "train"),
            ],
            "stray_processes": False,
        },
    }  # fmt: skip
    paths = {}
    for job, record in records.items():
        paths[job] = tmp_path / f"{job}.json"
        write_json(paths[job], record)
    table = report.gpu_memory_table(paths)
    assert list(table) == ["extract-0", "extract-1", "train node 0", "train node 1"]
    assert [table[j]["host"] for j in table] == ["gpu03", "gpu04", "gpu03", "gpu04"]
    assert report.gpu_problems(table) == [
        "extract-0 on gpu03: GPU 0: 4900 MiB left behind (pids [9])",
        "train node 1 on gpu04: GPU 1: 690 MiB left behind (pids [9])",
    ]


# ---- two "nodes" on this machine ---------------------------------------------------------------

JOB_ID = "4242"
NODELIST = "127.0.0.1,localhost"  # the stub's allocation: its first host is the rendezvous


def tiny_config(work: Path, verifier: Path, train: Path, evals: Path, cfg) -> Path:
    """A workflow config with train.nodes: 2, train.gpus: 1 and ``cfg``'s training."""
    import tiny

    section = {
        "epochs": cfg.epochs, "lr": cfg.lr, "seed": cfg.seed, "nodes": 2, "gpus": 1,
        "checkpoint_freq": cfg.checkpoint_freq, "packing": cfg.packing,
    }  # fmt: skip
    return tiny.write_config(work / "config.yaml", "t", verifier, train, evals, train=section)


def two_node_job(pipeline, work: Path, cfg) -> tuple[list[str], dict[str, str]]:
    """The train rule's command with train.nodes: 2 and train.gpus: 1, as it runs in the
    batch step of a SLURM job (SLURM_JOB_ID set, stub SLURM commands first on PATH); the
    GPUs are fake ids (no CUDA here: each "node" trains one process on the CPU)."""
    stubs = slurm_stub.install(work / "stubs")
    env = slurm_stub.environment(stubs, SLURM_JOB_ID=JOB_ID, STUB_SLURM_NODELIST=NODELIST)
    cmd = [
        sys.executable, str(ROOT / "scripts" / "gpu_job.py"),
        "--gpus", "0", "--nodes", "2", "--node-gpus", "1", "--cpus-per-node", "1",
        "--rule", "train", "--record", str(work / "gpu" / "train.json"),
        "--lock-dir", str(work / "locks"), "--log", str(work / "train.log"),
        "--echo", "train: step .*",
        "--", *train_command(pipeline, work, cfg), "--gpus", "0", "--nodes", "2",
        "--node-gpus", "1",
    ]  # fmt: skip
    return cmd, env


def tree(pid: int) -> list[int]:
    from test_faults import descendants

    return [pid, *descendants(pid)]


def cmdline(pid: int) -> list[str]:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
    return []


def environ(pid: int) -> dict[str, str]:
    with contextlib.suppress(OSError):
        items = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
        return dict(item.split("=", 1) for item in items if "=" in item)
    return {}


def node_of(pid: int) -> str | None:
    return environ(pid).get("SLURM_NODEID")


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def workers(root: int) -> dict[str, int]:
    """The training processes below ``root`` (those a torchrun started) by node."""
    found = {}
    for pid in tree(root):
        argv = cmdline(pid)
        script = any(a.endswith("scripts/train.py") for a in argv[1:3])
        if script and alive(pid) and cmdline(parent_of(pid))[: len(TORCHRUN)] == TORCHRUN:
            found[node_of(pid)] = pid
    return found


def checkpoint_step(work: Path) -> int | None:
    """The optimiser step of the newest complete checkpoint in train/state/, if any."""
    states = list((work / "state").glob("[0-9]*/training_state.json"))
    steps = []
    for path in states:
        with contextlib.suppress(OSError, ValueError):
            steps.append(json.loads(path.read_text())["global_step"])
    return max(steps) if steps else None


def logged_steps(work: Path) -> list[int]:
    metrics = work / "state" / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    return [json.loads(line)["global_step"] for line in lines if '"train"' in line]


def interrupt_after_checkpoint(cmd, env, work: Path, after: int, interrupt) -> None:
    """Start the job; once a checkpoint past step ``after`` is saved, ``interrupt(pid)``; the
    job must end (with a failure) and leave no process of its tree behind."""
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL)
    try:
        assert wait_until(lambda: (checkpoint_step(work) or -1) > after, 180), "no checkpoint"
        processes = tree(proc.pid)
        for pid in processes:  # frozen until the interruption is delivered (as SLURM: SIGCONT)
            os.kill(pid, signal.SIGSTOP)
        assert proc.poll() is None, "training finished before it could be interrupted"
        interrupt(proc.pid)
        for pid in processes:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        proc.wait(timeout=120)
        assert proc.returncode != 0
        assert wait_until(lambda: not [p for p in processes if alive(p)], 30), [
            cmdline(p) for p in processes if alive(p)
        ]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.slow
def test_two_nodes_preempted_then_a_rank_killed_resume_to_one_nodes_bytes(
    pipeline, two_process_training, tmp_path
):
    """Two "nodes" (2 x 1 process) against one node with 2 processes (the same global batch):
    preempted mid-run (SIGTERM to every process of the job, as SLURM does before a requeue),
    rerun (the requeued job), one rank then killed with SIGKILL (a node lost), rerun again.
    Each rerun resumes from the last checkpoint, not from step 0, and the last one ends with
    the one-node run's checkpoint bytes; each interruption leaves no process behind."""
    cfg = replace(two_process_training["cfg"], checkpoint_freq=0.25)
    cmd, env = two_node_job(pipeline, tmp_path, cfg)

    def preempt(pid: int) -> None:
        for victim in tree(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGTERM)

    interrupt_after_checkpoint(cmd, env, tmp_path, 0, preempt)
    first = checkpoint_step(tmp_path)
    assert first is not None and logged_steps(tmp_path)[0] == 0
    # the ranks agreed on the step to stop after and saved the state after it
    log = (tmp_path / "train.log").read_text()
    assert f"train: stopped by SIGTERM after step {first} " in log, log[-3000:]
    assert logged_steps(tmp_path)[-1] == first - 1

    def kill_node_1_rank(pid: int) -> None:
        ranks = workers(pid)
        assert set(ranks) == {"0", "1"}, ranks
        for rank in ranks.values():  # the per-node torchruns and their rendezvous
            argv = cmdline(parent_of(rank))
            assert argv[: len(TORCHRUN)] == TORCHRUN and "--nnodes=2" in argv, argv
            assert "--rdzv-backend=c10d" in argv and "--nproc-per-node=1" in argv, argv
            assert any(a.startswith("--rdzv-endpoint=127.0.0.1:") for a in argv), argv
        os.kill(ranks["1"], signal.SIGKILL)

    before = len(logged_steps(tmp_path))
    interrupt_after_checkpoint(cmd, env, tmp_path, first, kill_node_1_rank)
    assert logged_steps(tmp_path)[before] == first  # resumed from the preempted run's state
    second = checkpoint_step(tmp_path)

    before = len(logged_steps(tmp_path))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:] + (tmp_path / "train.log").read_text()[-3000:]
    assert logged_steps(tmp_path)[before] == second  # resumed again
    assert_same_bytes(
        tmp_path / "checkpoint" / "model.safetensors", two_process_training["weights"]
    )
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["resumed"] is True
    assert checkpoint_step(tmp_path) == two_process_training["steps"]
    record = json.loads((tmp_path / "gpu" / "train.json").read_text())
    assert record["nodes"] == 2 and len(record["per_node"]) == 2
    assert record["rendezvous"].startswith("127.0.0.1:")
    assert [r["devices"] for r in record["per_node"]] == [[0], [1]]  # each node its own lease
    assert not list((tmp_path / "gpu").glob("train.node*.json"))
    (srun,) = {tuple(c) for c in slurm_stub.calls(tmp_path / "stubs", "srun")}
    assert list(srun[:7]) == [
        "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--label",
        "--cpus-per-task=1", "--gres=gpu:1",
    ]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    ("log_every", "agreed_after"),
    [(3, lambda step: (step - 1) % 3 == 0), (1000, lambda step: step == 12)],
    ids=["logging_step", "vote"],
)
def test_sigterm_to_one_rank_stops_every_rank_after_the_same_step(
    pipeline, two_process_training, tmp_path, log_every, agreed_after
):
    """SIGTERM to rank 1's training process only: the ranks agree at the next logging step
    (train.log_every 3: the step after it is logged) or, with logging steps 1000 apart, by
    the vote cast 10 steps after the first logging step and read a step later (the job's 18
    steps: the vote after step 11 is read after step 12), and stop there, rank 0 having saved
    the state after that step; the rerun resumes from it and ends with the one-node run's
    checkpoint bytes."""
    cfg = replace(two_process_training["cfg"], checkpoint_freq=0.25, log_every=log_every)
    cmd, env = two_node_job(pipeline, tmp_path, cfg)

    def sigterm_to_rank_1(pid: int) -> None:  # not rank 0, which saves and prints
        (rank_1,) = [p for p in workers(pid).values() if environ(p).get("RANK") == "1"]
        os.kill(rank_1, signal.SIGTERM)

    interrupt_after_checkpoint(cmd, env, tmp_path, 0, sigterm_to_rank_1)
    log = (tmp_path / "train.log").read_text()
    stopped = re.search(r"train: stopped by a signal to another rank after step (\d+) ", log)
    assert stopped, log[-3000:]
    step = int(stopped.group(1))
    assert checkpoint_step(tmp_path) == step and agreed_after(step), step
    # each node's torchrun: one line a rank, no traceback (scripts/torchrun.py). Both ranks
    # exit 143 after the final barrier, at about the same moment: whichever node's torchrun
    # reports first, srun (--kill-on-bad-exit) may end the other node's before it prints
    # (which then prints one line saying so)
    assert "Traceback" not in log and "ChildFailedError" not in log, log[-3000:]
    assert re.search(r"torchrun: rank [01] \(pid \d+\) exited with status 143, the first", log)

    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:] + (tmp_path / "train.log").read_text()[-3000:]
    assert json.loads((tmp_path / "summary.json").read_text())["resumed"] is True
    assert_same_bytes(
        tmp_path / "checkpoint" / "model.safetensors", two_process_training["weights"]
    )


@pytest.mark.slow
def test_two_node_job_through_the_slurm_executor_trains_one_nodes_bytes(
    pipeline, two_process_training, verifier_dir, tmp_path
):
    """The whole chain on this machine: `snakemake --profile profiles/slurm` submits the jobs
    of a config with train.nodes: 2 and train.gpus: 1 to the stub sbatch, which runs only the
    train job's script (--wrap: the job's own snakemake, with the SLURM job-step executor), as
    SLURM runs a batch script; the rule's command starts srun with one task per "node"
    (stub), and on each the GPU wrapper and a torchrun (c10d on 127.0.0.1, gloo). The exact
    sbatch and srun lines are checked, and the checkpoint's bytes equal those of one node with
    two processes (the same global batch)."""
    from test_profiles import pretend_built, sbatch_jobs, submit_to_stubs

    from eagle3lib import vocab
    from eagle3lib.config import TrainConfig, from_json
    from eagle3lib.fileio import write_json

    work = tmp_path
    reference = two_process_training["cfg"]
    evals = work / "eval.jsonl"
    evals.write_text(json.dumps({"question_id": 1, "turns": ["Tell me about the model"]}) + "\n")
    config = tiny_config(work, verifier_dir, pipeline["dir"] / "train.jsonl", evals, reference)
    stubs = slurm_stub.install(work / "stubs")
    env = slurm_stub.environment(
        stubs, "your_account", STUB_SLURM_NODELIST=NODELIST, STUB_SLURM_RUN="train"
    )
    pretend_built(work, config, env)  # a dry run: with sbatch on PATH, SLURM is there
    # the train job's inputs, real: the session's verifier record, shards and vocab map
    results = work / "results" / "t"
    write_json(results / "verifier" / "verifier.json", pipeline["record"])
    for i in range(2):
        shutil.copy(pipeline["shards"][i], results / "hidden_states" / f"shard-{i}.safetensors")
        shutil.copy(pipeline["manifests"][i], results / "hidden_states" / f"shard-{i}.json")
    d2t, t2d = pipeline["vocab_map"]["d2t"], pipeline["vocab_map"]["t2d"]
    vocab.save(results / "vocab" / "vocab_map.safetensors", d2t, t2d)

    target = "results/t/checkpoint/model.safetensors"
    proc = submit_to_stubs(work, config, env, "--forcerun=train", target, timeout=400)
    log = (results / "logs" / "train.log").read_text()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:] + log[-3000:]
    submitted = [json.loads(line) for line in (stubs / "calls.jsonl").read_text().splitlines()]
    (train,) = sbatch_jobs(submitted)["train"]
    flags = train[train.index("-A") : train.index("-D")] + train[train.index("-D") + 2 :]
    assert flags == [
        "-A", "your_account", "-p", "gpu", "-t", "1440", "--mem", "128000",
        "--nodes=2", "--ntasks=2", "--cpus-per-gpu=8", "--gres=gpu:1",
    ]  # fmt: skip
    sbatch = [c["argv"] for c in submitted if c["tool"] == "sbatch"]
    job_id = str(1000 + [("rule_train" in argv) for argv in sbatch].index(True))
    # the job-step executor drops SLURM_JOB_NODELIST: the rule asks scontrol for the job's
    asked = [c for c in slurm_stub.calls(stubs, "scontrol") if c != ["show", "config"]]
    assert asked == [
        ["show", "job", "-o", job_id],
        ["show", "hostnames", NODELIST],
    ]
    (srun,) = slurm_stub.calls(stubs, "srun")
    split = srun.index("--")
    assert srun[:split] == [
        "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--label",
        "--cpus-per-task=2", "--gres=gpu:1",  # the job's threads, capped to this machine's 2
        sys.executable, str(ROOT / "scripts" / "gpu_job.py"), "--gpus", "1", "--rule", "train",
        "--record", "results/t/gpu/train.json", "--per-node", "--lock-dir",
        ".snakemake/gpu_locks",
    ]  # fmt: skip
    command = srun[split + 1 :]
    assert command[1].endswith("scripts/train.py")
    at = command.index("--gpus")
    assert command[at : at + 6] == ["--gpus", "0", "--nodes", "2", "--node-gpus", "1"]
    assert from_json(TrainConfig, command[command.index("--train") + 1]) == reference
    # srun's output, labelled with the task; rank 0 (which prints) is on either "node":
    # c10d numbers the nodes as they arrive
    assert re.search(r"\n[01]: train: step 1/18 ", log), log
    assert_same_bytes(results / "checkpoint" / "model.safetensors", two_process_training["weights"])
    summary = json.loads((results / "train" / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["resumed"] is False
    record = json.loads((results / "gpu" / "train.json").read_text())
    assert record["hosts"] == ["127.0.0.1", "localhost"] and len(record["per_node"]) == 2


@pytest.mark.slow
def test_a_torchrun_worker_dies_with_its_torchrun_even_when_it_cannot_act_on_sigterm(
    pipeline, tmp_path
):
    """torchrun's workers run in sessions of their own, beyond the GPU wrapper's group stop,
    whose SIGKILL (after its 30 s grace) can end torchrun before torchrun's own SIGKILL of its
    workers. A worker blocked in a collective cannot act on SIGTERM (here one is frozen with
    SIGSTOP, the other waits for it in gloo): each asks for SIGKILL when torchrun dies, so
    neither holds its GPU past the lease."""
    cfg = replace(pipeline["train_cfg"], epochs=20)
    out = tmp_path / "out.log"
    with open(out, "wb") as log:
        proc = subprocess.Popen(
            [*train_command(pipeline, tmp_path, cfg), "--processes", "2"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    ranks: list[int] = []
    try:
        assert wait_until(lambda: "train: step" in out.read_text(), 300), out.read_text()[-2000:]
        assert cmdline(proc.pid)[: len(TORCHRUN)] == TORCHRUN  # train.py became torchrun
        ranks = [p for p in tree(proc.pid)[1:] if any("train.py" in a for a in cmdline(p))]
        assert len(ranks) == 2 and {parent_of(r) for r in ranks} == {proc.pid}, ranks
        os.kill(ranks[1], signal.SIGSTOP)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert wait_until(lambda: not [r for r in ranks if alive(r)], 10), [
            cmdline(r) for r in ranks if alive(r)
        ]
    finally:
        for pid in [proc.pid, *ranks]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()


HINT = "run the train job with train.nodes > 1 inside a SLURM allocation (--profile profiles/slurm)"


# Catches: scontrol's failure ignored: "no NodeList" instead of its error, a missing scontrol raises
# FileNotFoundError, a traceback, scontrol's own error left out.
def test_a_failing_or_missing_scontrol_stops_the_job_with_its_error(tmp_path, monkeypatch):
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(  # scontrol's error, over two lines
        "#!/bin/sh\necho 'slurm_load_jobs error:' >&2\n"
        "echo '  Invalid job id specified' >&2\nexit 1\n"
    )
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(UserError) as failed:
        multinode.allocation_hosts({"SLURM_JOB_ID": "7"})
    assert str(failed.value) == (
        "`scontrol show job -o 7` failed (slurm_load_jobs error: Invalid job id specified); " + HINT
    )
    scontrol.unlink()  # not installed
    with pytest.raises(UserError) as failed:
        multinode.allocation_hosts({"SLURM_JOB_NODELIST": "gpu[03-04]"})
    assert str(failed.value) == (
        "`scontrol show hostnames gpu[03-04]` failed ([Errno 2] No such file or directory: "
        "'scontrol'); " + HINT
    )


# Catches: SLURM_NODELIST not read, ReqNodeList= taken for NodeList=, a pending job's
# NodeList=(null) passed on to scontrol, no host names: an empty list.
def test_allocation_hosts_read_the_node_list_as_scontrol_prints_it():
    def scontrol(job_line: str, hostnames: str = "gpu03\ngpu04\n"):
        return lambda argv: job_line if argv[2] == "job" else hostnames

    running = (
        "JobId=7 JobName=train JobState=RUNNING NumNodes=2 ReqNodeList=(null) "
        "ExcNodeList=(null) NodeList=gpu[03-04] BatchHost=gpu03\n"
    )
    assert multinode.allocation_hosts({"SLURM_JOB_ID": "7"}, scontrol(running)) == [
        "gpu03", "gpu04",
    ]  # fmt: skip
    pending = running.replace("RUNNING", "PENDING").replace(
        "NodeList=gpu[03-04]", "NodeList=(null)"
    )
    with pytest.raises(UserError) as failed:
        multinode.allocation_hosts({"SLURM_JOB_ID": "7"}, scontrol(pending))
    assert str(failed.value) == "scontrol show job 7: no NodeList; is the job running?"
    # SLURM's older name for the node list
    assert multinode.allocation_hosts({"SLURM_NODELIST": "gpu[03-04]"}, scontrol("")) == [
        "gpu03", "gpu04",
    ]  # fmt: skip
    with pytest.raises(UserError) as failed:
        multinode.allocation_hosts({"SLURM_JOB_NODELIST": "gpu[03-04]"}, scontrol("", ""))
    assert str(failed.value) == "scontrol show hostnames gpu[03-04]: no host names"


# Catches: --cpus-per-task=None without a CPU count, one of the rendezvous variables missing not
# refused: torchrun with --rdzv-id=None, per_node.
def test_command_lines_leave_out_what_is_not_given_and_refuse_what_is_missing():
    wrapper = ["python", "gpu_job.py", "--per-node"]
    assert multinode.srun_argv(2, 0, None, wrapper) == [
        "srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
        "--label", *wrapper,
    ]  # fmt: skip
    for unset in (ENDPOINT_VAR, RDZV_ID_VAR, "SLURM_NODEID"):
        env = {ENDPOINT_VAR: "gpu03:41000", RDZV_ID_VAR: "7-41000", "SLURM_NODEID": "0"}
        del env[unset]
        with pytest.raises(UserError, match="not started by the GPU wrapper's srun step"):
            multinode.relaunch(2, 8, ["train.py"], env)
    # one node: its gpu resource (a workstation cap may have lowered it); several: node_gpus
    assert [multinode.per_node(n, g, 8) for n, g in ((1, 3), (2, 0), (3, 0))] == [3, 8, 8]


# Catches: node records without their suffix, the rendezvous on the last host, a rendezvous id
# without the port, the caller's environment changed, the per-node wrapper without --per-node: every
# node would write the one record, each node's wrapper leases no GPU.
def test_each_nodes_wrapper_gets_the_rendezvous_and_a_record_of_its_own():
    record = Path("results/t/logs/train.gpu.json")
    assert [multinode.node_record(record, n) for n in (0, 1)] == [
        Path("results/t/logs/train.gpu.node0.json"), Path("results/t/logs/train.gpu.node1.json"),
    ]  # fmt: skip
    env = {"SLURM_JOB_ID": "7", "PATH": "/bin"}
    assert multinode.launch_environment(env, ["gpu03", "gpu04"], 41000) == {
        **env, ENDPOINT_VAR: "gpu03:41000", RDZV_ID_VAR: "7-41000",
    }  # fmt: skip
    assert env == {"SLURM_JOB_ID": "7", "PATH": "/bin"}
    assert multinode.launch_environment({}, ["127.0.0.1"], 5)[RDZV_ID_VAR] == "local-5"
    argv = multinode.gpu_job_per_node(8, "train", record, Path("locks"), ["python", "train.py"])
    assert argv == [
        sys.executable, str(ROOT / "scripts" / "gpu_job.py"), "--gpus", "8", "--rule", "train",
        "--record", str(record), "--per-node", "--lock-dir", "locks", "--", "python", "train.py",
    ]  # fmt: skip


def test_a_torchrun_stopped_by_srun_ends_with_one_line_and_the_signals_status(monkeypatch, capsys):
    """A node's torchrun that srun stops (--kill-on-bad-exit: another node's task failed
    first) before it saw its workers end prints one line, not torch's SignalException
    traceback, and ends with 128 + the signal (seen in a two-node SIGTERM test under load)."""
    import signal

    from torch.distributed import run
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def stopped(_argv):
        raise SignalException("Process 7 got signal: 15", sigval=signal.SIGTERM)

    monkeypatch.setattr(run, "main", stopped)
    assert multinode.run_torchrun(["train.py"]) == 143
    assert capsys.readouterr().err == (
        "torchrun: stopped by SIGTERM before its workers' ends were reported; they were stopped "
        "(the step was ended: see the first node's lines)\n"
    )


# Catches: ", the first" on the wrong rank, -15 returned, not 143, 1 returned whatever the status, a
# torchrun that succeeded returns 1, only one rank named.
def test_failed_workers_end_torchrun_with_one_line_a_rank_and_the_first_ones_status(
    monkeypatch, capsys
):
    from torch.distributed import run
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    stopped = ProcessFailure(local_rank=1, pid=202, exitcode=-15, error_file="")
    failed = ProcessFailure(local_rank=0, pid=201, exitcode=1, error_file="")
    stopped.timestamp, failed.timestamp = 100, 200  # rank 1 (stopped by SIGTERM) failed first

    def workers_failed(_argv):
        raise ChildFailedError("train.py", {1: stopped, 0: failed})

    monkeypatch.setattr(run, "main", workers_failed)
    assert multinode.run_torchrun(["train.py"]) == 128 + 15
    assert capsys.readouterr().err == (
        "torchrun: rank 0 (pid 201) exited with status 1\n"
        "torchrun: rank 1 (pid 202) exited with status 143, the first\n"
    )
    monkeypatch.setattr(run, "main", lambda _argv: None)
    assert multinode.run_torchrun(["train.py"]) == 0
    assert capsys.readouterr().err == ""
