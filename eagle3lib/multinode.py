"""One training job over several SLURM nodes (``train.nodes`` > 1): ``srun`` starts one task
per node, each task runs ``torchrun`` for the node's GPUs, and the torchruns meet in a c10d
rendezvous on the allocation's first node.

The chain, every link of which dies with the one before it (eagle3lib/lifetime.py):

    snakemake (the job's, in the batch step on the first node)
      exec gpu_job.py --nodes N        picks the rendezvous endpoint, runs srun, merges records
        srun (one task per node)       forwards SIGTERM to the tasks, ends the step on a failure
          gpu_job.py (one per node)    leases and records the node's GPUs (host in the record)
            train.py                   the node's agent: exec torchrun (node 0 holds the locks)
              torchrun --nnodes N      c10d rendezvous at the endpoint
                train.py workers       gloo/NCCL over all nodes

Under snakemake-executor-plugin-slurm the job's ``mpi`` resource makes the job-step executor
run the rule's command in the batch step itself (no ``srun`` around it), and that executor
removes the allocation's ``SLURM_*`` variables except the job id from the command's
environment: the node list is therefore read with ``scontrol show job``.
"""

from __future__ import annotations

import re
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from eagle3lib.errors import UserError

# The rendezvous endpoint and id, from the launching wrapper to every node's agent (srun
# passes the environment on).
ENDPOINT_VAR = "EAGLE3_RDZV_ENDPOINT"
RDZV_ID_VAR = "EAGLE3_RDZV_ID"

GPU_JOB = Path(__file__).resolve().parents[1] / "scripts" / "gpu_job.py"
# torch's torchrun, ended by a failed worker with one line a rank (scripts/torchrun.py)
TORCHRUN = [sys.executable, str(GPU_JOB.with_name("torchrun.py"))]


def nodes_refusal(
    nodes: int, executor: str | None, env: Mapping[str, str], which: Callable = shutil.which
) -> str | None:
    """Why ``train.nodes: nodes`` cannot run with ``executor`` (the snakemake executor plugin's
    name), or None. Several nodes need SLURM: the slurm executor (or its job-step executor),
    or a run inside an allocation (``SLURM_JOB_ID``: ``srun`` reaches its nodes). A dry run
    or ``--touch`` runs no job: there ``sbatch`` on PATH counts as SLURM."""
    if nodes <= 1 or executor in ("slurm", "slurm-jobstep") or env.get("SLURM_JOB_ID"):
        return None
    if executor in ("dryrun", "touch") and which("sbatch"):
        return None
    return (
        f"config key train.nodes: {nodes} nodes need SLURM (srun starts one torchrun per "
        "node) and this run has none; set train.nodes: 1 on a workstation, or run with "
        "--profile profiles/slurm on a SLURM login node"
    )


def sharing_refusal(jobs_per_gpu: int, executor: str | None) -> str | None:
    """Why ``extract.jobs_per_gpu`` cannot run with ``executor``, or None: GPU sharing is
    between the jobs of this machine (the local executor; a dry run or --touch runs none),
    and sharing jobs ask snakemake for no GPU, so a cluster executor would give them none."""
    if jobs_per_gpu <= 1 or executor in (None, "local", "dryrun", "touch"):
        return None
    return (
        f"config key extract.jobs_per_gpu: {jobs_per_gpu} shares the GPUs of this machine "
        f"between shard jobs, and the {executor} executor runs jobs elsewhere, each with GPUs "
        "of its own: set it to 1"
    )


def _run(argv: Sequence[str]) -> str:
    try:
        return subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", None) or str(exc)
        raise UserError(
            f"`{' '.join(argv)}` failed ({' '.join(detail.split())}); run the train job with "
            "train.nodes > 1 inside a SLURM allocation (--profile profiles/slurm)"
        ) from None


def allocation_hosts(env: Mapping[str, str], run: Callable = _run) -> list[str]:
    """The allocation's host names in SLURM's order: ``scontrol show hostnames`` of its node
    list (``SLURM_JOB_NODELIST``, else ``scontrol show job``'s ``NodeList``)."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        job = env.get("SLURM_JOB_ID")
        if not job:
            raise UserError(
                "train.nodes > 1: SLURM_JOB_ID is not set; the train job must run inside "
                "its SLURM allocation (--profile profiles/slurm)"
            )
        found = re.search(r"(?:^|\s)NodeList=(\S+)", run(["scontrol", "show", "job", "-o", job]))
        if not found or found.group(1) in ("", "(null)"):
            raise UserError(f"scontrol show job {job}: no NodeList; is the job running?")
        nodelist = found.group(1)
    hosts = run(["scontrol", "show", "hostnames", nodelist]).split()
    if not hosts:
        raise UserError(f"scontrol show hostnames {nodelist}: no host names")
    return hosts


def free_port() -> int:
    """A TCP port free on this host now (the batch step runs on the allocation's first node,
    where the rendezvous is hosted)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def srun_argv(
    nodes: int, gpus_per_node: int, cpus_per_node: int | None, command: Sequence[str]
) -> list[str]:
    """``srun`` running ``command`` once per node: one task per node, the node's GPUs and
    CPUs for it, output lines labelled with the task, the step ended when a task fails."""
    argv = ["srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1"]
    argv += ["--kill-on-bad-exit=1", "--label"]
    if cpus_per_node:
        argv.append(f"--cpus-per-task={cpus_per_node}")
    if gpus_per_node:
        argv.append(f"--gres=gpu:{gpus_per_node}")
    return [*argv, *command]


def torchrun_argv(
    nodes: int,
    processes_per_node: int,
    endpoint: str,
    rdzv_id: str,
    script: Sequence[str],
    node: int,
) -> list[str]:
    """torchrun for node ``node`` of ``nodes``: c10d rendezvous at ``endpoint`` (host:port, on
    node 0), whose store node 0's torchrun hosts (``is_host``: not left to matching host
    names, which every node matches where several share a machine, and then whichever started
    first hosts it and may end first, leaving the others' torchruns without their store); node
    ranks are given by the rendezvous (c10d ignores --node-rank)."""
    return [
        *TORCHRUN,
        f"--nnodes={nodes}", f"--nproc-per-node={processes_per_node}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={rdzv_id}",
        f"--rdzv-conf=is_host={int(node == 0)}", "--max-restarts=0", *script,
    ]  # fmt: skip


def node_launch(env: Mapping[str, str]) -> tuple[str, str, int]:
    """This node's (endpoint, rendezvous id, node id) inside the srun step."""
    endpoint, rdzv_id = env.get(ENDPOINT_VAR), env.get(RDZV_ID_VAR)
    node = env.get("SLURM_NODEID")
    if not endpoint or not rdzv_id or node is None:
        raise UserError(
            "train.nodes > 1: this process was not started by the GPU wrapper's srun step "
            f"({ENDPOINT_VAR}, {RDZV_ID_VAR} or SLURM_NODEID unset); run it through the "
            "train rule"
        )
    return endpoint, rdzv_id, int(node)


def per_node(nodes: int, gpus: int, node_gpus: int) -> int:
    """A train job's GPUs on each node: its ``gpu`` resource on one node (the workstation
    profile's cap may have lowered it), ``node_gpus`` on several (``gpu`` is 0 there: sbatch
    asks for them per node)."""
    return gpus if nodes == 1 else node_gpus


def relaunch(
    nodes: int, processes: int, script: Sequence[str], env: Mapping[str, str]
) -> tuple[bool, list[str] | None]:
    """How the train script started by its rule goes on: (whether this process takes the
    artifact folders' locks, the torchrun command line to exec or None to train itself).
    A torchrun worker trains (its agent holds the locks, inherited); on one node more than one
    process relaunches under ``torchrun --standalone``; on several, each node's agent under a
    multi-node torchrun, and only node 0's takes the locks (the others would contend for the
    same lock files on the shared file system)."""
    if "LOCAL_RANK" in env:
        return False, None
    if nodes > 1:
        endpoint, rdzv_id, node = node_launch(env)
        return node == 0, torchrun_argv(nodes, max(processes, 1), endpoint, rdzv_id, script, node)
    if processes > 1:
        return True, [*TORCHRUN, "--standalone", f"--nproc-per-node={processes}", *script]
    return True, None


def node_record(record: Path, node: int) -> Path:
    """Where node ``node`` of a multi-node job writes its GPU record."""
    return record.with_name(f"{record.stem}.node{node}{record.suffix}")


def launch_environment(env: Mapping[str, str], hosts: Sequence[str], port: int) -> dict[str, str]:
    """``env`` with the rendezvous on the first host at ``port``, id from the job id."""
    out = dict(env)
    out[ENDPOINT_VAR] = f"{hosts[0]}:{port}"
    out[RDZV_ID_VAR] = f"{env.get('SLURM_JOB_ID', 'local')}-{port}"
    return out


def gpu_job_per_node(
    gpus: int, rule: str, record: Path, lock_dir: Path, command: Sequence[str]
) -> list[str]:
    """The GPU wrapper as each srun task runs it: its node's lease and record."""
    return [
        sys.executable, str(GPU_JOB), "--gpus", str(gpus), "--rule", rule,
        "--record", str(record), "--per-node", "--lock-dir", str(lock_dir), "--", *command,
    ]  # fmt: skip


def exit_status(code: int) -> int:
    """A process's exit status as a shell reports it: 128 + N for one ended by signal N
    (torch records those as -N)."""
    return 128 - code if code < 0 else code


def run_torchrun(argv: Sequence[str]) -> int:
    """torch's torchrun (``torch.distributed.run.main``) on ``argv``. When a worker fails it
    prints one line a failed rank (its exit status; each worker has printed its own error)
    instead of torch's traceback and failure table, and returns the status of the first
    failure: 143 for a worker stopped by SIGTERM, as the job's status."""
    from torch.distributed import run
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    try:
        run.main(list(argv))
    except SignalException as exc:  # srun ending the step (another node's task failed first)
        print(
            f"torchrun: stopped by {signal.Signals(exc.sigval).name} before its workers' ends "
            "were reported; they were stopped (the step was ended: see the first node's lines)",
            file=sys.stderr,
            flush=True,
        )
        return 128 + int(exc.sigval)
    except RendezvousConnectionError as exc:  # node 0's torchrun, holding the store, ended
        cause = str(exc.__cause__ or exc).partition("\n")[0]
        print(
            "torchrun: no connection to the rendezvous store on node 0 (its torchrun ended, or "
            f"cannot be reached); this node's workers, if started, were stopped: {cause}",
            file=sys.stderr,
            flush=True,
        )
        return 1
    except ChildFailedError as exc:
        first, _ = exc.get_first_failure()
        for rank, failure in sorted(exc.failures.items()):
            print(
                f"torchrun: rank {rank} (pid {failure.pid}) exited with status "
                f"{exit_status(failure.exitcode)}" + (", the first" if rank == first else ""),
                file=sys.stderr,
                flush=True,
            )
        return exit_status(exc.failures[first].exitcode) or 1
    return 0
