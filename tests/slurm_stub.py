"""Stand-ins for SLURM's commands, for tests on a machine without SLURM (they say so on stderr).

`install(folder)` writes one executable per command into ``folder`` (put it first on PATH).
Every call is recorded, command line and all, in ``$STUB_SLURM_DIR/calls.jsonl``. (The stubs'
own settings do not start with ``SLURM_``: the job-step executor removes such variables.) They answer
as SLURM would, without a cluster:

- ``sbatch``: prints a new job id; runs nothing, except the job scripts (``--wrap``) of the
  rules named in ``$STUB_SLURM_RUN`` (comma-separated): those it starts in the background, on
  this machine, as SLURM runs a batch script (in ``-D``, output to ``--output``,
  ``SLURM_JOB_ID`` and ``SLURM_JOB_NODELIST`` set). ``squeue``/``sacct`` report such a job
  RUNNING until its script ends, then COMPLETED or FAILED by its exit status, and every other
  job submitted so far COMPLETED. ``sacctmgr``/``sshare`` list ``$STUB_SLURM_ACCOUNT``.
- ``scontrol show job -o <id>``: ``NodeList=$STUB_SLURM_NODELIST``; ``scontrol show hostnames
  <list>``: the comma-separated names of the list, one a line; ``scontrol show config``: the
  two settings the executor plugin reads.
- ``srun``: runs its command once per task, all on this machine, as one "node" each: with
  ``SLURM_NODEID``/``SLURM_PROCID`` = the task, ``SLURM_NNODES``, and, for ``--gres=gpu:G``,
  ``CUDA_VISIBLE_DEVICES`` = the task's own G device ids (real nodes each have devices
  0..G-1; here the "nodes" share one host and its lock files, so their ids must differ).
  ``--label`` prefixes output lines with the task; SIGTERM and SIGINT are passed on to the
  tasks; ``--kill-on-bad-exit=1`` ends the others when a task fails; the exit status is the
  highest of the tasks'.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

TOOLS = ("sbatch", "sacctmgr", "scontrol", "sshare", "squeue", "sacct", "srun")

LAUNCHER = """#!{python}
# Stand-in for the SLURM command {tool!r} (a test stub, no cluster): tests/slurm_stub.py
import sys
sys.path.insert(0, {tests!r})
import slurm_stub
sys.exit(slurm_stub.main({tool!r}, sys.argv[1:]))
"""


def install(folder: Path) -> Path:
    """Write the stub commands into ``folder``; returns it."""
    folder.mkdir(parents=True, exist_ok=True)
    for tool in TOOLS:
        path = folder / tool
        path.write_text(
            LAUNCHER.format(python=sys.executable, tool=tool, tests=str(Path(__file__).parent))
        )
        path.chmod(0o755)
    return folder


def environment(stubs: Path, account: str = "stub_account", **extra: str) -> dict[str, str]:
    """This process's environment without SLURM's variables, the stubs first on PATH, then
    this interpreter's folder (snakemake, python), and ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PATH"] = os.pathsep.join([str(stubs), str(Path(sys.executable).parent), env["PATH"]])
    env.update(STUB_SLURM_DIR=str(stubs), STUB_SLURM_ACCOUNT=str(account), **extra)
    return env


def calls(state: Path, tool: str | None = None) -> list[list[str]]:
    """The recorded command lines (of ``tool``, or of all as [tool, *argv])."""
    path = state / "calls.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    if tool is None:
        return [[r["tool"], *r["argv"]] for r in rows]
    return [r["argv"] for r in rows if r["tool"] == tool]


def main(tool: str, argv: list[str]) -> int:
    state = Path(os.environ["STUB_SLURM_DIR"])
    with open(state / "lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with open(state / "calls.jsonl", "a") as out:
            out.write(json.dumps({"tool": tool, "argv": argv}) + "\n")
        ids = state / "job_ids"
        known = ids.read_text().split() if ids.exists() else []
        if tool == "sbatch":  # --parsable: print the new job id
            job_id = str(1000 + len(known))
            ids.write_text("".join(f"{i}\n" for i in [*known, job_id]))
            run_job(state, job_id, argv)
            print(job_id)
    if tool in ("squeue", "sacct"):
        for job_id in known:
            print(f"{job_id}|{job_state(state, job_id)}")
    elif tool in ("sacctmgr", "sshare"):  # the user's accounts
        print(os.environ["STUB_SLURM_ACCOUNT"])
    elif tool == "scontrol":
        return scontrol(argv)
    elif tool == "srun":
        return srun(argv)
    return 0


def run_job(state: Path, job_id: str, argv: list[str]) -> None:
    """Start the job script of a rule named in $STUB_SLURM_RUN, as SLURM would on the
    allocation's first node; its exit status goes to ``state/exit-<id>``."""
    rule = argv[argv.index("--comment") + 1].removeprefix("rule_").split("_wildcards_")[0]
    if rule not in os.environ.get("STUB_SLURM_RUN", "").split(","):
        return
    (script,) = [a.removeprefix("--wrap=") for a in argv if a.startswith("--wrap=")]
    output = argv[argv.index("--output") + 1].replace("%j", job_id)
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, SLURM_JOB_ID=job_id, SLURM_JOB_NODELIST=stub_nodelist())
    (state / f"started-{job_id}").touch()
    with open(output, "w") as log:
        subprocess.Popen(
            ["sh", "-c", f'{script}\necho $? > "{state}/exit-{job_id}"'],
            cwd=argv[argv.index("-D") + 1], env=env, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip


def job_state(state: Path, job_id: str) -> str:
    if not (state / f"started-{job_id}").exists():
        return "COMPLETED"  # a job that only pretended to run
    done = state / f"exit-{job_id}"
    if not done.exists() or not done.read_text().strip():
        return "RUNNING"
    return "COMPLETED" if done.read_text().strip() == "0" else "FAILED"


def scontrol(argv: list[str]) -> int:
    if argv[:2] == ["show", "hostnames"]:
        print("\n".join(argv[2].split(",")))
    elif argv[:2] == ["show", "job"]:
        job = argv[-1]
        print(f"JobId={job} JobName=stub JobState=RUNNING NodeList={stub_nodelist()}")
    else:  # scontrol show config
        print("MaxArraySize = 1001\nMinJobAge = 300 sec")
    return 0


def stub_nodelist() -> str:
    return os.environ.get("STUB_SLURM_NODELIST", "localhost")


def _options(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """srun's --name=value options and flags, and the command after them."""
    options, i = {}, 0
    while i < len(argv) and argv[i].startswith("-"):
        name, _, value = argv[i].partition("=")
        options[name] = value
        i += 1
    return options, argv[i:]


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)


def srun(argv: list[str]) -> int:
    options, command = _options(argv)
    tasks = int(options.get("--ntasks") or options.get("--nodes") or 1)
    gres = options.get("--gres", "")
    gpus = int(gres.split(":")[-1]) if gres.startswith("gpu:") else 0
    print(f"srun (test stub, no SLURM): {tasks} task(s) on this machine", file=sys.stderr)
    procs = []
    for task in range(tasks):
        env = dict(os.environ)
        env.update(
            SLURM_NODEID=str(task), SLURM_PROCID=str(task), SLURM_LOCALID="0",
            SLURM_NNODES=str(tasks), SLURM_NTASKS=str(tasks), SLURM_STEP_ID="0",
        )  # fmt: skip
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(
                str(d) for d in range(task * gpus, (task + 1) * gpus)
            )
        procs.append(
            subprocess.Popen(
                command,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )  # fmt: skip
        )
    label = "--label" in options

    def copy(task: int, stream) -> None:
        for line in iter(stream.readline, b""):
            sys.stdout.buffer.write((f"{task}: ".encode() if label else b"") + line)
            sys.stdout.buffer.flush()

    pumps = [threading.Thread(target=copy, args=(t, p.stdout)) for t, p in enumerate(procs)]
    for pump in pumps:
        pump.start()

    def forward(signum, _frame) -> None:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    kill_on_bad_exit = options.get("--kill-on-bad-exit") == "1"
    ended: dict[int, int] = {}
    ending = None  # when the step was told to end (then SIGKILL 20 s later, as KillWait)
    while len(ended) < len(procs):
        for task, proc in enumerate(procs):
            if task not in ended and proc.poll() is not None:
                ended[task] = proc.returncode
                if proc.returncode != 0 and kill_on_bad_exit and ending is None:
                    print(f"srun (stub): task {task} failed, ending the step", file=sys.stderr)
                    forward(signal.SIGTERM, None)
                    ending = time.monotonic()
        if ending is not None and time.monotonic() > ending + 20:
            forward(signal.SIGKILL, None)
        time.sleep(0.05)
    for pump in pumps:
        pump.join()
    return max(code if code >= 0 else 128 - code for code in ended.values())
