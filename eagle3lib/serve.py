"""vLLM in the loop: serve the verifier with the trained draft and read acceptance from vLLM.

A server is started on 127.0.0.1 at a free port in its own process group, waited for
(``/health``), and stopped by its process group at the end, also on failure. Prompts go to
``/v1/completions`` as token ids (the same tokens the offline evaluator decodes), greedily;
acceptance comes from the ``vllm:spec_decode_*`` counters of ``/metrics`` (before/after).
The reference text is vLLM's own greedy decoding without a draft (offline engine).
Only the standard library is used here, so this module runs in the vLLM environment.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eagle3lib.errors import UserError
from eagle3lib.lifetime import child_dies_with_me, signals_deferred

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def on_cpu() -> bool:
    """This job has no GPU (the lease gives CPU jobs an empty CUDA_VISIBLE_DEVICES)."""
    import shutil

    return os.environ.get("CUDA_VISIBLE_DEVICES") == "" or shutil.which("nvidia-smi") is None


def engine_env(cpu_kvcache_gib: int = 1) -> dict[str, str]:
    """Environment for vLLM: offline, caches inside the working directory, small CPU KV cache;
    on CPU the engine runs inside the server process (one process to start, not two)."""
    env = dict(os.environ)
    if on_cpu():
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("VLLM_CACHE_ROOT", str(Path(".cache/vllm").resolve()))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cpu_kvcache_gib))
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def _get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - 127.0.0.1 only
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""


def post_json(url: str, body: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - 127.0.0.1 only
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:500]
        raise UserError(f"vLLM answered {exc.code} to {url}: {detail}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise UserError(f"vLLM at {url} did not answer: {exc}") from None


# Seconds vLLM's API server waits for its engine to stop on SIGTERM (vLLM's --shutdown-timeout)
SHUTDOWN_TIMEOUT_S = 10
SHUTDOWN_RACE_NOTE = (
    "eagle3lib: the server above stopped normally (exit code 0): the EngineDeadError traceback "
    "at its shutdown is vLLM's known spurious log (vllm-project/vllm#48745), not a failure"
)


class VllmServer:
    """An OpenAI-compatible vLLM server for the lifetime of a ``with`` block."""

    def __init__(
        self,
        python: str,
        model: str,
        args: Sequence[str],
        log_path: Path,
        env: dict[str, str],
        startup_timeout: float = 900.0,
    ):
        self.python, self.model, self.args = python, model, list(args)
        self.log_path, self.env, self.startup_timeout = Path(log_path), env, startup_timeout
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    @property
    def command(self) -> list[str]:
        return [
            self.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model, "--host", "127.0.0.1", "--port", str(self.port),
            # on SIGTERM, wait for the engine to stop rather than kill it at once (which logs
            # an EngineDeadError traceback at every normal end)
            "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S), *self.args,
        ]  # fmt: skip

    def __enter__(self) -> VllmServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - closed in __exit__
        self._log, self._log_start = log, log.tell()
        try:
            self.proc = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,  # its own group: stopped as a whole, workers included
                preexec_fn=child_dies_with_me(),  # SIGTERM when the job dies, even by SIGKILL
            )
        except OSError as e:  # no such interpreter, or not executable
            log.close()
            raise UserError(
                f"cannot start the vLLM server with {self.python}: {e.strerror}; set "
                "vllm.python to the python of an environment with vLLM installed, or run "
                "`make envs` to make .venv-vllm"
            ) from None
        try:
            self._wait_healthy()
        except BaseException:  # also Ctrl-C or SIGTERM during the wait
            self._stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise UserError(
                    f"vLLM server exited with code {self.proc.returncode} while starting; "
                    f"see {self.log_path}: {self.log_tail()}"
                )
            with contextlib.suppress(OSError):
                if _get(f"{self.url}/health", timeout=2.0)[0] == 200:
                    return
            time.sleep(1.0)
        raise UserError(
            f"vLLM server not healthy after {self.startup_timeout:.0f} s; see {self.log_path}"
        )

    def __exit__(self, *exc) -> None:
        self._stop()

    def _stop(self) -> None:
        with signals_deferred():  # a second SIGTERM or Ctrl-C must not leave it running
            self._stop_server()

    def _stop_server(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            # the API server stops its engine process itself; the group is killed after
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if self.proc is not None:
                os.killpg(self.proc.pid, signal.SIGKILL)  # workers left in the group
        if getattr(self, "_log", None):
            if self.proc is not None and self.proc.returncode == 0:
                self._note_shutdown_race()
            self._log.close()

    def _note_shutdown_race(self) -> None:
        """After a normal stop, say so below vLLM's EngineDeadError traceback where it logged
        one during its shutdown (not before it): the output handler can see the engine gone
        before it is cancelled (vllm-project/vllm#48745, open), which reads like a crash but
        is not one."""
        self._log.flush()
        with open(self.log_path, "rb") as fh:
            fh.seek(self._log_start)
            text = fh.read()
        shutdown = text.find(b"shutdown triggered")
        if 0 <= shutdown < text.find(b"EngineDeadError"):  # the first one after the trigger
            self._log.write(SHUTDOWN_RACE_NOTE.encode() + b"\n")

    def log_tail(self, lines: int = 3) -> str:
        """The last lines this server wrote (the log is appended to: an earlier run's lines
        are not this one's)."""
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(getattr(self, "_log_start", 0))
                text = fh.read().decode("utf-8", errors="replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(text[-lines:])

    def metrics(self) -> str:
        try:
            status, text = _get(f"{self.url}/metrics", timeout=30.0)
        except OSError as exc:  # (the server gone: connection refused, or no answer)
            raise UserError(
                f"vLLM /metrics could not be read ({exc}); see {self.log_path}: {self.log_tail()}"
            ) from None
        if status != 200:
            raise UserError(f"vLLM /metrics answered {status}")
        return text

    def completion(self, prompt_ids: list[int], max_tokens: int, **sampling) -> dict[str, Any]:
        """/v1/completions of token ids (greedy unless ``sampling`` says otherwise), on the raw
        logits: vLLM would otherwise take top_k, min_p and a repetition penalty from the
        verifier's generation_config (as eagle3lib.regenerate.RAW_LOGITS does for HF)."""
        body = {
            "model": self.model,
            "prompt": prompt_ids,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "top_k": -1,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "return_token_ids": True,
            **sampling,
        }
        return post_json(f"{self.url}/v1/completions", body)

    def complete(self, prompt_ids: list[int], max_tokens: int, **sampling) -> list[int]:
        """The generated token ids of a completion."""
        return list(self.completion(prompt_ids, max_tokens, **sampling)["choices"][0]["token_ids"])


_COUNTER = re.compile(
    r"^vllm:spec_decode_(num_drafts|num_draft_tokens|num_accepted_tokens|num_accepted_tokens_per_pos)_total"
    r"\{([^}]*)\}\s+([0-9.eE+-]+)$",
    re.M,
)


def spec_decode_counters(metrics_text: str) -> dict[str, Any]:
    """The spec-decoding counters of a /metrics page (summed over label sets)."""
    counters: dict[str, Any] = {
        "num_drafts": 0.0,
        "num_draft_tokens": 0.0,
        "num_accepted_tokens": 0.0,
        "per_pos": {},
    }
    for name, labels, value in _COUNTER.findall(metrics_text):
        if name == "num_accepted_tokens_per_pos":
            pos = int(re.search(r'position="(\d+)"', labels).group(1))
            counters["per_pos"][pos] = counters["per_pos"].get(pos, 0.0) + float(value)
        else:
            counters[name] += float(value)
    return counters


def acceptance_from_counters(
    before: dict[str, Any], after: dict[str, Any], k: int
) -> dict[str, Any]:
    drafts = after["num_drafts"] - before["num_drafts"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    per_pos = [
        (after["per_pos"].get(j, 0.0) - before["per_pos"].get(j, 0.0)) / drafts if drafts else 0.0
        for j in range(k)
    ]
    return {
        "k": k,
        "drafts": int(drafts),
        "draft_tokens": int(after["num_draft_tokens"] - before["num_draft_tokens"]),
        "accepted_tokens": int(accepted),
        "acceptance_length": 1 + accepted / drafts if drafts else None,
        "per_position_acceptance": per_pos,
    }


def engine_args(engine: dict[str, Any], trust_remote_code: bool = False) -> list[str]:
    """Server flags from the config's vllm section (and the verifier's trust_remote_code)."""
    args = ["--trust-remote-code"] if trust_remote_code else []
    if engine.get("dtype"):
        args += ["--dtype", engine["dtype"]]
    if engine.get("max_model_len"):
        args += ["--max-model-len", str(engine["max_model_len"])]
    if engine.get("enforce_eager", True):
        args.append("--enforce-eager")
    if on_cpu():
        args += ["--distributed-executor-backend", "uni"]
    elif tensor_parallel() > 1:
        args += ["--tensor-parallel-size", str(tensor_parallel())]
    return args


def tensor_parallel() -> int:
    """GPUs vLLM spreads the verifier over: the job's GPUs where it leased several, else 1."""
    return 1 if on_cpu() else max(1, leased_gpus())


def compute_dtype(engine_dtype: str | None, evaluate_dtype: str, cuda: bool) -> str:
    """vLLM's dtype: vllm.dtype when set, else the offline evaluator's (evaluate.dtype; auto is
    bfloat16 on a GPU, float32 on CPU), so that both decode the same greedy text and their
    acceptance compares."""
    if engine_dtype:
        return engine_dtype
    if evaluate_dtype != "auto":
        return evaluate_dtype
    return "bfloat16" if cuda else "float32"


def leased_gpus() -> int:
    """GPUs this job holds (the lease sets CUDA_VISIBLE_DEVICES)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return len([d for d in visible.split(",") if d.strip()]) if visible else 0


def serve_command(
    verifier: str,
    checkpoint: str,
    k: int,
    trust_remote_code: bool = False,
    cpu_kvcache_gib: str | None = None,
) -> str:
    """The command a user runs to serve the verifier with this draft. On a CPU (``cpu_kvcache_gib``
    given) it sets the KV cache size as serve_check did: vllm-cpu otherwise asks for 92 % of the
    memory and refuses to start when less is free."""
    spec = json.dumps({"method": "eagle3", "model": checkpoint, "num_speculative_tokens": k})
    trust = " --trust-remote-code" if trust_remote_code else ""
    env = f"VLLM_CPU_KVCACHE_SPACE={shlex.quote(cpu_kvcache_gib)} " if cpu_kvcache_gib else ""
    return (
        f"{env}vllm serve {shlex.quote(verifier)}{trust} --speculative-config {shlex.quote(spec)}"
    )


def from_folder(path: str, folder: str | os.PathLike) -> str:
    """A relative local path as seen from ``folder`` (hub ids and absolute paths as they are)."""
    if os.path.isabs(path) or not os.path.exists(path):
        return path
    return os.path.relpath(path, folder)


def reference_greedy(
    model: str, prompts: list[list[int]], max_tokens: int, engine_kwargs: dict[str, Any]
) -> list[list[int]]:
    """vLLM's own greedy decoding without a draft (an in-process engine, no server)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    # spread over the job's GPUs as the server is (engine_args): a verifier that needs several
    # GPUs fits, and greedy text is computed with the server's reductions
    gpus = tensor_parallel()
    parallel = (
        {"tensor_parallel_size": gpus} if gpus > 1 else {"distributed_executor_backend": "uni"}
    )
    llm = LLM(model=model, **parallel, **engine_kwargs)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=max_tokens),
    )
    result = [list(o.outputs[0].token_ids) for o in outputs]
    del llm
    return result


def serve_check(
    python: str,
    verifier_path: str,
    checkpoint: str,
    prompts: list[dict[str, Any]],
    k: int,
    max_new_tokens: int,
    engine: dict[str, Any],
    log_path: Path,
    log=print,
    trust_remote_code: bool = False,
) -> dict[str, Any]:
    """Acceptance of the draft as vLLM measures it, and a text check against no-draft greedy."""
    env = engine_env(engine.get("cpu_kvcache_gib", 1))
    spec = {"method": "eagle3", "model": checkpoint, "num_speculative_tokens": k}
    args = ["--speculative-config", json.dumps(spec), *engine_args(engine, trust_remote_code)]
    t0 = time.perf_counter()
    outputs: list[list[int]] = []
    with VllmServer(
        python, verifier_path, args, log_path, env, engine.get("startup_timeout", 900)
    ) as server:
        started = time.perf_counter() - t0
        log(f"serve_check: vLLM ready in {started:.0f} s at {server.url}")
        before = spec_decode_counters(server.metrics())
        for n, prompt in enumerate(prompts, 1):
            outputs.append(server.complete(prompt["token_ids"], max_new_tokens))
            log(
                f"serve_check: prompt {n}/{len(prompts)} id={prompt['id']} tokens={len(outputs[-1])}"
            )
        after = spec_decode_counters(server.metrics())
    stats = acceptance_from_counters(before, after, k)
    os.environ.update({k_: v for k_, v in env.items() if k_ not in os.environ})
    reference = reference_greedy(
        verifier_path,
        [p["token_ids"] for p in prompts],
        max_new_tokens,
        {
            "max_model_len": engine.get("max_model_len"),
            "enforce_eager": True,
            "dtype": engine.get("dtype") or "auto",
            "trust_remote_code": trust_remote_code,  # (as the server was started)
        },
    )
    mismatched = [p["id"] for p, a, b in zip(prompts, outputs, reference, strict=True) if a != b]
    return {
        **stats,
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "text_matches_verifier": not mismatched,
        "mismatched_prompts": mismatched,
        "server_start_seconds": round(started, 1),
        "seconds": round(time.perf_counter() - t0, 1),
        "serve_command": serve_command(verifier_path, checkpoint, k, trust_remote_code),
    }
