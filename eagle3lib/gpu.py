"""GPU jobs: a lease (one lock per GPU) that sets CUDA_VISIBLE_DEVICES, and NVML memory
readings before and after the job, so validation can fail a job that left memory behind.

Snakemake assigns no device ids to local jobs
(https://github.com/snakemake/snakemake/issues/281), so every GPU rule runs its command
through ``scripts/gpu_job.py``: it takes ``--gpus N`` free devices from the pool
(``CUDA_VISIBLE_DEVICES``'s GPUs, by index or UUID, if set, else all NVML devices) with
non-blocking ``flock``s that the kernel releases even on SIGKILL, records NVML used memory per
leased device, runs the command in its own process group with ``CUDA_VISIBLE_DEVICES`` set to
the lease (NVML's indices, with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``: CUDA's numbering then is
NVML's), and reads NVML again
once the command's main process has exited: anything it left running in its group is still
alive then, so its memory shows; such processes are recorded and stopped before the lease is
released. On a machine without an NVIDIA driver the record says so. Each record names its
host: device indices are per host, and each record is compared only with itself. The command
gets SIGTERM when the wrapper dies (even by SIGKILL), and the wrapper when snakemake does (see
eagle3lib/lifetime.py).

With ``--share K`` (extract.jobs_per_gpu) up to K jobs hold a device at once: each holds the
device's lock shared (so no exclusive job runs beside them) and one of its K slot locks, and
they take turns at its compute: the wrapper names the device's turn lock in
``EAGLE3_GPU_TURN``, and the command holds it (``turn``) only while it computes, so one job
loads its model while the other extracts. A shared device's used memory also moves with the
other job, so the record of a shared job names as leaks only what the job left running.

With ``--nodes N`` (a train job over N SLURM nodes) the wrapper leases nothing itself: it runs
the command through one ``srun`` step with one task per node, each task this wrapper again
(``--per-node``) leasing and recording its node's GPUs, and merges the nodes' records into one
(eagle3lib/multinode.py).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from eagle3lib import multinode
from eagle3lib.errors import UserError
from eagle3lib.fileio import read_json, write_json
from eagle3lib.lifetime import child_dies_with_me, signals_deferred

# Memory a finished job may leave on a device before validation calls it a leak.
LEAK_THRESHOLD_MIB = 256


def nvml_snapshot(indices: Sequence[int] | None = None) -> dict[str, Any]:
    """Used memory per device from NVML, or ``{"available": False, "reason": ...}``."""
    try:
        import pynvml
    except ImportError:
        return {"available": False, "reason": "no NVIDIA device: nvidia-ml-py is not installed"}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return {"available": False, "reason": f"no NVIDIA device: {exc}"}
    try:
        count = pynvml.nvmlDeviceGetCount()
        devices = []
        for i in indices if indices is not None else range(count):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
            name = pynvml.nvmlDeviceGetName(handle)
            devices.append(
                {
                    "index": i,
                    "name": name.decode() if isinstance(name, bytes) else name,
                    "used_mib": round(mem.used / 2**20, 1),
                    "total_mib": round(mem.total / 2**20, 1),
                    "pids": sorted(p.pid for p in procs),
                }
            )
        return {"available": True, "device_count": count, "devices": devices, "time": time.time()}
    finally:
        pynvml.nvmlShutdown()


class VisibleDevicesError(ValueError):
    """CUDA_VISIBLE_DEVICES names devices that cannot be found or leased."""


def _nvml_uuids() -> list[str]:
    """Each NVML device's UUID ("GPU-..."), by index."""
    import pynvml

    pynvml.nvmlInit()
    try:
        uuids = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
            uuids.append(uuid.decode() if isinstance(uuid, bytes) else uuid)
        return uuids
    finally:
        pynvml.nvmlShutdown()


def visible_devices(visible: str) -> list[int]:
    """NVML indices of the devices a CUDA_VISIBLE_DEVICES value names, in its order: indices
    as they are, GPUs by UUID (``GPU-...``, whole or a prefix of one GPU's, as CUDA takes them)
    looked up in NVML. As CUDA does, the list ends at its first entry that is neither (``-1``
    hides every device). MIG instances are parts of a GPU, which a lease cannot take."""
    indices: list[int] = []
    uuids: list[str] | None = None
    for entry in (x.strip() for x in visible.split(",")):
        if entry.isdigit():
            indices.append(int(entry))
        elif entry.startswith("MIG-"):
            raise VisibleDevicesError(
                f"CUDA_VISIBLE_DEVICES names a MIG instance ({entry}): GPU jobs lease whole "
                "GPUs; name GPUs by index or UUID"
            )
        elif entry.startswith("GPU-"):
            if uuids is None:
                try:
                    uuids = _nvml_uuids()
                except Exception as exc:  # noqa: BLE001 - pynvml missing or its NVMLError
                    raise VisibleDevicesError(
                        f"CUDA_VISIBLE_DEVICES names GPUs by UUID ({entry}) and NVML cannot "
                        f"be read to find them ({exc or type(exc).__name__}); name GPUs by index"
                    ) from None
            found = [i for i, uuid in enumerate(uuids) if uuid.startswith(entry)]
            if len(found) != 1:
                what = "no GPU's UUID" if not found else f"{len(found)} GPUs' UUIDs"
                raise VisibleDevicesError(
                    f"CUDA_VISIBLE_DEVICES names {entry}, and {what} on this host begin(s) with "
                    f"it ({', '.join(uuids) or 'no GPUs'}); fix CUDA_VISIBLE_DEVICES"
                )
            indices.append(found[0])
        else:
            break
    return indices


def gpu_setting(rule: str) -> str:
    """The config key of job ``rule``'s GPU count (the rule's resource gpu)."""
    return "extract.gpus_per_job" if rule == "extract" else f"{rule}.gpus"


def device_pool() -> list[int]:
    """Device indices jobs may lease: CUDA_VISIBLE_DEVICES's devices if set, else all."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        try:
            return visible_devices(visible)
        except VisibleDevicesError as exc:
            raise SystemExit(f"error: {exc}") from None
    snap = nvml_snapshot()
    return list(range(snap.get("device_count", 0)))


TURN_ENV = "EAGLE3_GPU_TURN"  # the turn locks a sharing job holds while it computes
# "<rule>:<gpus>:<share>": that rule's jobs ask snakemake for no GPU (so that several run at
# once) and lease <gpus> shared by <share> jobs; set by the workflow (rules/common.smk)
GPU_SHARING_ENV = "EAGLE3_GPU_SHARING"


def sharing_setting(rule: str, gpus: int, share: int) -> str:
    return f"{rule}:{gpus}:{share}"


def shared_lease(rule: str, env: dict[str, str]) -> tuple[int, int] | None:
    """(GPUs, jobs per GPU) of ``rule``'s jobs if the workflow shares their GPUs, else None."""
    name, _, counts = env.get(GPU_SHARING_ENV, "").partition(":")
    if name != rule:
        return None
    gpus, _, share = counts.partition(":")
    return int(gpus), int(share)


def lock_folder(lock_dir: Path) -> Path:
    """Where the device locks live (an absolute path): per SLURM allocation inside one (device
    ids are relative to the allocation, so other allocations on the node, same ids, other
    GPUs, never contend)."""
    if os.environ.get("SLURM_JOB_ID"):
        lock_dir = lock_dir / f"slurm-{os.environ['SLURM_JOB_ID']}"
    lock_dir.mkdir(parents=True, exist_ok=True)
    return lock_dir.resolve()


def device_lock(lock_dir: Path, dev: int, kind: str = "") -> Path:
    """A device's lock (``kind`` "": exclusive jobs hold it alone, sharing jobs together;
    "slot<k>": one of a sharing job's slots; "turn": held while a sharing job computes). The
    host is in the name: lock files may sit on a filesystem shared by several hosts."""
    suffix = f".{kind}.lock" if kind else ".lock"
    return lock_dir / f"{socket.gethostname()}-gpu{dev}{suffix}"


def _try_lock(path: Path, mode: int = fcntl.LOCK_EX) -> int | None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _hold(lock_dir: Path, dev: int, share: int, slot: int) -> list[int] | None:
    """The locks of device ``dev`` for one job, or None if it cannot have them now: its own
    lock exclusively (``share`` 1), or shared plus slot ``slot``'s lock."""
    if share == 1:
        fd = _try_lock(device_lock(lock_dir, dev))
        return None if fd is None else [fd]
    fd = _try_lock(device_lock(lock_dir, dev), fcntl.LOCK_SH)  # no exclusive job on it
    if fd is None:
        return None
    slot_fd = _try_lock(device_lock(lock_dir, dev, f"slot{slot}"))
    if slot_fd is None:
        os.close(fd)
        return None
    return [fd, slot_fd]


@contextlib.contextmanager
def lease(
    n: int, pool: Sequence[int], lock_dir: Path, poll: float = 0.5, share: int = 1
) -> Iterator[list[int]]:
    """Hold ``n`` devices of ``pool``; wait until that many are free. ``share`` 1: each
    device's lock, exclusively. Above 1: each device's lock shared (an exclusive job waits
    until no sharing job holds the device, and the other way round) and one of its ``share``
    slot locks (at most that many jobs hold a device); the first slots of all devices are
    taken before any second one, so jobs spread over the GPUs before they share one; the jobs
    of a device take turns at it through ``turn``."""
    if n == 0:
        yield []
        return
    if n > len(pool):
        raise SystemExit(f"error: job needs {n} GPU(s), the pool has {len(pool)} ({list(pool)})")
    lock_dir = lock_folder(lock_dir)
    while True:
        held: dict[int, list[int]] = {}
        for slot in range(share):
            for dev in pool:
                if dev in held or len(held) == n:
                    continue
                fds = _hold(lock_dir, dev, share, slot)
                if fds is not None:
                    held[dev] = fds
        if len(held) == n:
            break
        for fds in held.values():  # never sit on a partial set: that deadlocks multi-GPU jobs
            for fd in fds:
                os.close(fd)
        time.sleep(poll)
    try:
        yield sorted(held)
    finally:
        for fds in held.values():
            for fd in fds:
                os.close(fd)


@contextlib.contextmanager
def turn(env: dict[str, str] | None = None) -> Iterator[float]:
    """A sharing job's turn at its devices (the turn locks ``EAGLE3_GPU_TURN`` names, in
    order, so that two sharing jobs never wait on each other crosswise); yields the seconds
    waited, and says on stderr when it has to wait. A job not started as a sharing one (no
    such variable) does not wait."""
    paths = [
        p for p in (env if env is not None else os.environ).get(TURN_ENV, "").split(os.pathsep) if p
    ]
    t0 = time.perf_counter()
    fds = []
    try:
        for path in sorted(paths):
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            fds.append(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                print("waiting for the GPU: another job is extracting", file=sys.stderr, flush=True)
                fcntl.flock(fd, fcntl.LOCK_EX)
        yield time.perf_counter() - t0
    finally:
        for fd in fds:
            os.close(fd)


def leaked(
    before: dict[str, Any], after: dict[str, Any], threshold_mib: float = LEAK_THRESHOLD_MIB
) -> list[str]:
    """Devices whose used memory grew by more than the threshold over the job."""
    if not before.get("available") or not after.get("available"):
        return []
    base = {d["index"]: d["used_mib"] for d in before["devices"]}
    return [
        f"GPU {d['index']}: {d['used_mib'] - base.get(d['index'], 0):.0f} MiB left behind "
        f"(pids {d['pids']})"
        for d in after["devices"]
        if d["used_mib"] - base.get(d["index"], 0) > threshold_mib
    ]


def settled_snapshot(
    devices: Sequence[int], before: dict[str, Any], wait: float = 1.0, poll: float = 0.1
) -> dict[str, Any]:
    """NVML reading after a job: the driver frees an exited process's memory a moment later,
    so read again every ``poll`` seconds, for at most ``wait``, until no device shows a leak."""
    deadline = time.monotonic() + wait
    while True:
        after = nvml_snapshot(devices)
        if not leaked(before, after) or time.monotonic() >= deadline:
            return after
        time.sleep(poll)


def _raise_exit(signum, _frame):
    signal.signal(signum, signal.SIG_IGN)  # another one must not cut short the stop it starts
    raise SystemExit(128 + signum)


def group_alive(pgid: int) -> bool:
    """Whether a process of the group ``pgid`` runs. A zombie (ended, not yet reaped: an
    orphan's new parent, PID 1 or a subreaper, may reap late) holds nothing and does not
    count; Linux's /proc tells them apart, elsewhere any member counts."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    if not os.path.isdir("/proc"):
        return True
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # ended meanwhile
            continue
        state, _ppid, pgrp = text[text.rindex(")") + 2 :].split()[:3]
        if int(pgrp) == pgid and state != "Z":
            return True
    return False


def left_running(pgid: int, grace: float = 2.0) -> bool:
    """Whether processes of the group ``pgid`` still run ``grace`` seconds after its first one
    ended (that one reaped): helpers that end with the process that started them, such as
    multiprocessing's resource tracker beside a DataLoader's worker processes, take a moment
    to see it gone and are no stragglers."""
    deadline = time.monotonic() + grace
    while group_alive(pgid):
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.05)
    return False


def stop_group(pgid: int, grace: float = 30.0, leader: subprocess.Popen | None = None) -> None:
    """SIGTERM a process group, wait for it, SIGKILL what is left. ``leader``: the group's
    first process, our child, reaped as soon as it exits (a zombie still counts as alive)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if leader is not None:
            leader.poll()  # reaped once it has exited
        if not group_alive(pgid):
            break
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def pump(stream, log: Path, echo: re.Pattern | None) -> threading.Thread:
    """Copy a job's output to its log line by line; lines matching ``echo`` (their matching
    part) also go to this process's stderr, the terminal of snakemake."""

    def copy() -> None:
        with open(log, "wb") as out:
            for line in iter(stream.readline, b""):
                out.write(line)
                out.flush()
                found = echo.search(line.decode(errors="replace")) if echo else None
                if found:
                    print(found.group(0), file=sys.stderr, flush=True)
        stream.close()

    thread = threading.Thread(target=copy, name="job-output", daemon=True)
    thread.start()
    return thread


def start(argv: Sequence[str], env: dict[str, str], log: Path | None, echo: str | None):
    """Start ``argv`` in its own process group (stopped as a whole), with SIGTERM when this
    wrapper dies; with ``log`` its output goes there (lines matching ``echo`` also to the
    terminal). Returns the process and the thread copying its output (or None)."""
    output = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT} if log else {}
    proc = subprocess.Popen(
        list(argv), env=env, start_new_session=True, preexec_fn=child_dies_with_me(), **output
    )
    pumping = pump(proc.stdout, log, re.compile(echo) if echo else None) if log else None
    return proc, pumping


def wait(proc: subprocess.Popen, pumping: threading.Thread | None) -> int:
    """The job's exit status; SIGTERM (how snakemake and schedulers stop jobs) or any other
    exception stops its whole group first.

    The wait polls rather than block in waitpid: the kernel hands a signal sent to this
    process to any one of its threads, and when the output thread takes SIGTERM, Python runs
    the handler on the main thread only once that thread runs Python again. A blocked
    waitpid would wait for the job instead of stopping it (a preempted multi-node training
    job hung so). Another SIGTERM or SIGINT while the group is being stopped (srun passes
    one on, the parent's death sends one) waits for the stop to end."""
    previous = signal.signal(signal.SIGTERM, _raise_exit)
    try:
        while True:
            with contextlib.suppress(subprocess.TimeoutExpired):
                return proc.wait(timeout=0.5)
    except BaseException:
        with signals_deferred():
            stop_group(proc.pid, leader=proc)  # the lease is released once the job is gone
            end_output(pumping)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


def end_output(pumping: threading.Thread | None, grace: float = 10.0) -> None:
    """Let the output thread copy what the ended job wrote. Called once the job's group is
    gone: a process it left running holds the output pipe open, so the copy ends only with
    it; one that left the group (its own session) is given ``grace`` seconds."""
    if pumping:
        pumping.join(grace)


def run(
    argv: Sequence[str],
    gpus: int,
    record: Path,
    rule: str,
    lock_dir: Path,
    log: Path | None = None,
    echo: str | None = None,
    share: int = 1,
) -> int:
    """Lease, snapshot, run ``argv`` in its own process group, snapshot again, write record.
    With ``log`` the job's output goes there (and lines matching ``echo`` to the terminal);
    ``share`` > 1: the devices are shared with that many jobs, taking turns (module doc)."""
    pool = device_pool() if gpus else []
    if gpus > len(pool):
        raise UserError(
            f"the {rule} job needs {gpus} GPU(s), and {len(pool)} are visible to it {pool}: set "
            f"{gpu_setting(rule)} to at most {len(pool)} (0 runs the job on the CPU), or run it "
            "where it sees that many"
        )
    with lease(gpus, pool, lock_dir, share=share) as devices:
        env = dict(os.environ)
        # A job sees exactly its lease; a CPU job (gpus 0) sees no GPU at all. The lease's
        # indices are NVML's, which number GPUs by PCI bus id; CUDA numbers them so only with
        # CUDA_DEVICE_ORDER=PCI_BUS_ID (by default the fastest first).
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devices))
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        if share > 1 and devices:
            folder = lock_folder(lock_dir)
            env[TURN_ENV] = os.pathsep.join(str(device_lock(folder, d, "turn")) for d in devices)
        else:
            env.pop(TURN_ENV, None)  # a job of its own GPUs takes no turns
        before = nvml_snapshot(devices)  # none for a CPU job: it can use no GPU
        t0 = time.time()
        proc, pumping = start(argv, env, log, echo)
        rc = wait(proc, pumping)
        # Anything the job started and left running (a server, a worker) holds memory:
        # record it, read NVML while it still runs, then stop it before the lease ends.
        with signals_deferred():
            stragglers = left_running(proc.pid)
            if gpus and share == 1:
                after = settled_snapshot(devices, before)
            else:  # (a shared device's memory moves with the other job: no leak verdict)
                after = nvml_snapshot(devices)
            if stragglers:
                stop_group(proc.pid)
            end_output(pumping)
    if rc != 0:
        return rc
    write_json(
        record,
        {
            "rule": rule,
            "host": socket.gethostname(),
            "gpus_requested": gpus,
            "devices": devices,
            "seconds": round(time.time() - t0, 2),
            "started_at": round(t0, 3),  # the job's own span (the lease held around it)
            "ended_at": round(time.time(), 3),
            "before": before,
            "after": after,
            "stray_processes": stragglers,
            "shared_by": share if devices else 1,
            "leaks": job_leaks(before, after, share if devices else 1),
        },
    )
    return 0


def job_leaks(before: dict[str, Any], after: dict[str, Any], shared_by: int = 1) -> list[str]:
    """The leaks a job's record names: a device's growth over the job, unless other jobs shared
    the device (their memory comes and goes too; what the job left running is recorded as
    its stray processes either way)."""
    return leaked(before, after) if shared_by <= 1 else []


def run_over_nodes(
    argv: Sequence[str],
    nodes: int,
    gpus: int,
    cpus: int | None,
    record: Path,
    rule: str,
    lock_dir: Path,
    log: Path | None = None,
    echo: str | None = None,
) -> int:
    """Run ``argv`` once on each of ``nodes`` nodes of this SLURM allocation through one
    ``srun`` step (eagle3lib/multinode.py): each node's task is this wrapper again, leasing
    and recording that node's ``gpus`` GPUs; the tasks find the c10d rendezvous endpoint (the
    allocation's first host, a port free here) in their environment. ``record`` gets every
    node's record, each with its host."""
    hosts = multinode.allocation_hosts(os.environ)
    if len(hosts) < nodes:
        raise UserError(
            f"{rule}: {nodes} nodes asked for, the allocation has {len(hosts)} ({hosts}); "
            "submit the job with --profile profiles/slurm, which asks for the nodes"
        )
    env = multinode.launch_environment(os.environ, hosts, multinode.free_port())
    parts = [multinode.node_record(record, node) for node in range(nodes)]
    for part in parts:
        part.unlink(missing_ok=True)
    per_node = multinode.gpu_job_per_node(gpus, rule, record, lock_dir, argv)
    t0 = time.time()
    proc, pumping = start(multinode.srun_argv(nodes, gpus, cpus, per_node), env, log, echo)
    rc = wait(proc, pumping)
    with signals_deferred():
        stragglers = group_alive(proc.pid)
        if stragglers:
            stop_group(proc.pid)
        end_output(pumping)
    if rc != 0:
        return rc
    missing = [str(p) for p in parts if not p.exists()]
    if missing:
        raise UserError(f"{rule}: srun ended without the records of every node ({missing})")
    write_json(
        record,
        {
            "rule": rule,
            "nodes": nodes,
            "hosts": hosts[:nodes],
            "gpus_requested": gpus,
            "seconds": round(time.time() - t0, 2),
            "rendezvous": env[multinode.ENDPOINT_VAR],
            "per_node": [read_json(p) for p in parts],
            "stray_processes": stragglers,
        },
    )
    for part in parts:
        part.unlink()
    return 0


def main(args: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle3lib.gpu")
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a command on leased GPUs and record NVML memory")
    r.add_argument("--gpus", type=int, default=0)
    r.add_argument(
        "--share", type=int, default=1, help="jobs that may hold each leased GPU, taking turns"
    )
    r.add_argument("--record", type=Path, required=True)
    r.add_argument("--rule", required=True)
    r.add_argument("--lock-dir", type=Path, default=Path(".snakemake/gpu_locks"))
    r.add_argument("--log", type=Path, help="write the job's output here")
    r.add_argument("--echo", help="regex: matching parts of output lines also go to stderr")
    r.add_argument("--nodes", type=int, default=1, help="SLURM nodes: one srun task on each")
    r.add_argument("--node-gpus", type=int, default=0, help="with --nodes > 1: GPUs per node")
    r.add_argument("--cpus-per-node", type=int, help="CPUs of each node's srun task")
    r.add_argument(
        "--per-node", action="store_true", help="a node's task: record this node (SLURM_NODEID)"
    )
    r.add_argument("command", nargs=argparse.REMAINDER)
    sub.add_parser("snapshot", help="print the NVML reading")
    ns = parser.parse_args(args)
    if ns.cmd == "snapshot":
        import json

        print(json.dumps(nvml_snapshot(), indent=2))
        return 0
    command = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
    if not command:
        parser.error("no command given after --")
    try:
        if ns.nodes > 1:
            gpus = multinode.per_node(ns.nodes, ns.gpus, ns.node_gpus)
            return run_over_nodes(
                command, ns.nodes, gpus, ns.cpus_per_node, ns.record, ns.rule, ns.lock_dir,
                ns.log, ns.echo,
            )  # fmt: skip
        record = ns.record
        if ns.per_node:
            record = multinode.node_record(record, int(os.environ.get("SLURM_NODEID", "0")))
        gpus, share = ns.gpus, ns.share
        if ns.gpus == 0 and (shared := shared_lease(ns.rule, os.environ)):
            gpus, share = shared  # asked snakemake for no GPU: it shares (GPU_SHARING_ENV)
        return run(command, gpus, record, ns.rule, ns.lock_dir, ns.log, ns.echo, share)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
