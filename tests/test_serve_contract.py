"""eagle3lib/serve.py contracts the other serve tests leave open: vLLM's environment on a GPU
and its caches, the exact server command, the health wait on a server that answers but is
not healthy, the stop of a worker left in the server's group, the shutdown note where the
server's first line is vLLM's shutdown, and serve_check's defaults, environment, log lines
and timings. No vLLM here: stand-ins are named in each test (tests/test_vllm.py runs it)."""

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from test_serve_standin import NoServer, gone, gpu_job, open_fds

from eagle3lib import serve
from eagle3lib.errors import UserError

TRACEBACK = "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue."


# ---- vLLM's environment and flags --------------------------------------------------------


def test_a_gpu_job_leaves_vllms_engine_in_its_own_process(monkeypatch, tmp_path):
    """Only a CPU job runs vLLM's engine inside the server process; on a GPU vLLM's own
    default (an engine process) stands."""
    gpu_job(monkeypatch, tmp_path, "0")
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in serve.engine_env()


def test_vllms_caches_go_under_the_working_directory_unless_the_job_says(monkeypatch, tmp_path):
    """VLLM_CACHE_ROOT is .cache/vllm of the working directory as an absolute path (the
    server may run elsewhere); one the job set is kept."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("VLLM_CACHE_ROOT", raising=False)
    assert serve.engine_env()["VLLM_CACHE_ROOT"] == str(tmp_path.resolve() / ".cache" / "vllm")
    monkeypatch.setenv("VLLM_CACHE_ROOT", "/scratch/vllm")
    assert serve.engine_env()["VLLM_CACHE_ROOT"] == "/scratch/vllm"


def test_without_a_pythonpath_of_the_job_vllm_gets_the_project_alone(monkeypatch):
    """No empty entry (the working directory, to Python) is added to vLLM's PYTHONPATH."""
    monkeypatch.delenv("PYTHONPATH", raising=False)
    assert serve.engine_env()["PYTHONPATH"] == str(serve.ROOT)


def test_one_gpu_is_no_tensor_parallelism(monkeypatch, tmp_path):
    """A job of one GPU, or one that leased none on a GPU machine, serves on one GPU."""
    gpu_job(monkeypatch, tmp_path, "3")
    assert serve.tensor_parallel() == 1
    assert "--tensor-parallel-size" not in serve.engine_args({})
    gpu_job(monkeypatch, tmp_path, None)
    assert serve.tensor_parallel() == 1


def test_the_server_command_is_the_api_server_with_the_flags_given_once(tmp_path):
    """The command: vLLM's OpenAI API server on the verifier, on 127.0.0.1 at its port,
    draining on SIGTERM, then the flags given, each once, as they were when it was made."""
    args = ["--speculative-config", "{}", "--enforce-eager"]
    server = serve.VllmServer("/venv/python", "verifier", args, tmp_path / "log", {})
    args.append("--later")
    assert server.command == [
        "/venv/python", "-m", "vllm.entrypoints.openai.api_server",
        "--model", "verifier", "--host", "127.0.0.1", "--port", str(server.port),
        "--shutdown-timeout", str(serve.SHUTDOWN_TIMEOUT_S),
        "--speculative-config", "{}", "--enforce-eager",
    ]  # fmt: skip


def test_the_reference_engine_keeps_the_jobs_multiprocessing_setting(monkeypatch):
    """reference_greedy runs vLLM's engine in this process unless the job set
    VLLM_ENABLE_V1_MULTIPROCESSING itself (kept, as engine_env keeps it for the server).
    vLLM's offline engine is a stand-in module."""
    seen = {}

    class LLM:
        def __init__(self, **kwargs):
            seen["env"] = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")

        def generate(self, prompts, params):
            ids = types.SimpleNamespace(token_ids=[0])
            return [types.SimpleNamespace(outputs=[ids]) for _ in prompts]

    module = types.ModuleType("vllm")
    module.LLM, module.SamplingParams = LLM, lambda **kwargs: kwargs
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    assert serve.reference_greedy("m", [[1]], 1, {}) == [[0]]
    assert seen["env"] == "1"


# ---- the server's start and stop ---------------------------------------------------------


class Health(BaseHTTPRequestHandler):
    """A stand-in for vLLM's /health: the status in the server's ``health`` attribute."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.send_response(self.server.health if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()


@pytest.fixture
def health():
    """A stand-in HTTP server answering /health (200 unless the test sets ``health``)."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    httpd.daemon_threads, httpd.health = True, 200
    threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True).start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def sleeper(monkeypatch, tmp_path: Path, health, timeout: float, code: str = ""):
    """A VllmServer whose process is a stand-in Python (``code``, then it sleeps) and whose
    /health is asked of the ``health`` stand-in."""
    server = serve.VllmServer("python", "m", [], tmp_path / "log", dict(os.environ), timeout)
    command = [sys.executable, "-c", f"{code}\nimport time\ntime.sleep(60)\n"]
    monkeypatch.setattr(serve.VllmServer, "command", property(lambda self: command))
    server.url = f"http://127.0.0.1:{health.server_address[1]}"
    return server


def test_a_server_that_answers_but_is_not_healthy_is_not_taken_as_started(
    health, tmp_path, monkeypatch
):
    """/health answering 503 (vLLM still loading) is waited through, not taken for a
    started server; the timeout, given as a float in the vllm section, is reported in whole
    seconds. The server is a sleeping stand-in process, /health a stand-in HTTP server."""
    health.health = 503
    server = sleeper(monkeypatch, tmp_path, health, 1.0)
    with pytest.raises(UserError) as failed, server:
        pass
    assert str(failed.value) == f"vLLM server not healthy after 1 s; see {tmp_path / 'log'}"
    assert server.proc.poll() is not None
    assert open_fds(tmp_path / "log") == []


def test_a_worker_the_server_leaves_running_is_killed_with_its_group(health, tmp_path, monkeypatch):
    """The server runs in a process group of its own, killed at the stop: a worker of it
    that ignores SIGTERM and that the server does not stop is gone after the ``with`` block.
    The server is a stand-in process that starts such a worker; /health a stand-in."""
    pid_file = tmp_path / "worker.pid"
    spawn = (
        "import signal, subprocess, sys\n"
        "w = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(w.pid))\n"
    )
    server = sleeper(monkeypatch, tmp_path, health, 30, spawn)
    worker = None
    try:
        with server:
            deadline = time.monotonic() + 10
            while not pid_file.exists() or not pid_file.read_text():
                assert time.monotonic() < deadline
                time.sleep(0.05)
            worker = int(pid_file.read_text())
        assert gone(worker)
    finally:
        if worker is not None:
            with contextlib.suppress(OSError):
                os.kill(worker, signal.SIGKILL)


def test_a_server_group_that_cannot_be_signalled_still_ends_the_stop(tmp_path, monkeypatch):
    """The group kill after the server ended may meet a group it may not signal (its id
    taken by another user's process): the stop still ends, its log closed. The server is a
    stand-in process that has already exited; the refusal is a stand-in for os.killpg."""
    log_path = tmp_path / "log"
    server = serve.VllmServer("python", "m", [], log_path, {})
    server._log, server._log_start = open(log_path, "ab"), 0  # noqa: SIM115 - closed by _stop
    server.proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    server.proc.wait()

    def refused(pid, sig):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(serve.os, "killpg", refused)
    server.__exit__(None, None, None)
    assert open_fds(log_path) == []


def test_the_note_follows_a_shutdown_logged_as_the_servers_first_line(tmp_path):
    """The spurious-traceback note also where vLLM's shutdown line is the first this server
    wrote (an earlier run's lines before it are not its own). The server is a stand-in
    process that has exited normally."""
    log_path = tmp_path / "log"
    log_path.write_text("an earlier server\n")
    server = serve.VllmServer("python", "m", [], log_path, {})
    log = open(log_path, "ab")  # noqa: SIM115 - closed by _stop
    server._log, server._log_start = log, log.tell()
    server.proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    server.proc.wait()
    with open(log_path, "a") as fh:
        fh.write(f"shutdown triggered\n{TRACEBACK}\n")
    server._stop()
    assert log_path.read_text().rstrip().endswith(serve.SHUTDOWN_RACE_NOTE)


def test_a_missing_vllm_interpreter_leaves_no_log_open(tmp_path):
    """vllm.python that does not exist (.venv-vllm not made, a wrong path): the start fails
    and the server log it opened is closed."""
    log_path = tmp_path / "log"
    server = serve.VllmServer(str(tmp_path / "no-venv" / "python"), "m", [], log_path, {})
    try:
        with contextlib.suppress(Exception), server:
            pass
        assert open_fds(log_path) == []
    finally:
        if getattr(server, "_log", None):
            server._log.close()


def test_a_missing_vllm_interpreter_is_a_user_error(tmp_path):
    """vllm.python that does not exist is a configuration mistake (an extract or regenerate
    job runs in the training environment and starts vLLM's interpreter itself): a UserError
    naming the interpreter and what to do, not Popen's traceback."""
    python = str(tmp_path / "no-venv" / "python")
    server = serve.VllmServer(python, "m", [], tmp_path / "log", {})
    try:
        with pytest.raises(UserError) as raised, server:
            pass
        assert str(raised.value) == (
            f"cannot start the vLLM server with {python}: No such file or directory; set "
            "vllm.python to the python of an environment with vLLM installed, or run "
            "`make envs` to make .venv-vllm"
        )
    finally:
        if getattr(server, "_log", None):
            server._log.close()


# ---- serve_check ------------------------------------------------------------------------


@pytest.fixture
def stand_ins(monkeypatch):
    """serve_check with a stand-in VllmServer (records what it was made with; no draft
    steps; answers every prompt with ``max_tokens`` zeros) and a stand-in vLLM offline engine
    (the same answers); os.environ restored afterwards (serve_check adds to it)."""
    saved = dict(os.environ)
    made = {}

    class Server(NoServer):
        def __init__(self, python, model, args, log_path, env, startup_timeout=900.0):
            made.update(env=env, startup_timeout=startup_timeout)

    class LLM:
        def __init__(self, **kwargs):
            pass

        def generate(self, prompts, params):
            ids = types.SimpleNamespace(token_ids=[0] * params["max_tokens"])
            return [types.SimpleNamespace(outputs=[ids]) for _ in prompts]

    module = types.ModuleType("vllm")
    module.LLM, module.SamplingParams = LLM, lambda **kwargs: kwargs
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setattr(serve, "VllmServer", Server)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    for key in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_NO_USAGE_STATS"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("PYTHONPATH", "/site/a")
    yield made
    os.environ.clear()
    os.environ.update(saved)


PROMPTS = [{"id": "a", "token_ids": [1]}, {"id": "b", "token_ids": [2, 3]}]


def test_serve_check_defaults_and_log_lines(stand_ins, tmp_path):
    """Without vllm.cpu_kvcache_gib and vllm.startup_timeout: a KV cache of 1 GiB and 900 s
    to start; one log line per prompt, counted from 1."""
    messages = []
    serve.serve_check("python", "v", "ckpt", PROMPTS, 3, 2, {}, tmp_path / "log", messages.append)
    assert stand_ins["env"]["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert stand_ins["startup_timeout"] == 900
    assert messages[1:] == [
        "serve_check: prompt 1/2 id=a tokens=2",
        "serve_check: prompt 2/2 id=b tokens=2",
    ]


def test_serve_check_adds_vllms_settings_to_the_job_but_keeps_its_own(stand_ins, tmp_path):
    """After the server, this process gets vLLM's settings it lacks (for the offline
    reference engine); what the job set, its PYTHONPATH included, stays as it was."""
    serve.serve_check("python", "v", "ckpt", PROMPTS, 3, 2, {}, tmp_path / "log", lambda m: None)
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert os.environ["VLLM_NO_USAGE_STATS"] == "1"
    assert os.environ["PYTHONPATH"] == "/site/a"


def test_serve_check_reports_the_server_start_and_its_whole_time(stand_ins, tmp_path, monkeypatch):
    """server_start_seconds is the server's start, seconds the whole check (the reference
    decoding included), each to a tenth of a second. The clock is a stand-in."""
    ticks = iter([100.0, 103.26, 110.04])
    monkeypatch.setattr(serve.time, "perf_counter", lambda: next(ticks))
    result = serve.serve_check(
        "python", "v", "ckpt", PROMPTS, 3, 2, {}, tmp_path / "log", lambda m: None
    )
    assert (result["server_start_seconds"], result["seconds"]) == (3.3, 10.0)
