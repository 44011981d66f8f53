"""VllmServer's stop, with a stand-in process for vLLM's API server (vLLM itself is run by
tests/test_vllm.py): SIGTERM goes to the server, and a note follows vLLM's spurious
EngineDeadError traceback only where the stop was normal and the traceback came during it."""

import os
import subprocess
import sys
import time

import pytest

from eagle3lib import serve

TRACEBACK = "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue."


def stop_stand_in(tmp_path, at_start: str, at_stop: str, code: int) -> str:
    """A process that logs ``at_start``, then on SIGTERM ``at_stop`` and exits with ``code``,
    stopped by VllmServer._stop; the log it leaves."""
    log_path = tmp_path / "server.log"
    log_path.write_text(f"an earlier server\n{TRACEBACK}\n")  # before this one: not its log
    server = serve.VllmServer(sys.executable, "model", [], log_path, dict(os.environ))
    log = open(log_path, "ab")  # noqa: SIM115 - closed by _stop
    server._log, server._log_start = log, log.tell()
    script = (
        "import signal, sys, time\n"
        f"print({at_start!r}, 'ready', flush=True)\n"
        f"signal.signal(signal.SIGTERM, lambda *a: (print({at_stop!r}, flush=True), sys.exit({code})))\n"
        "while True: time.sleep(0.05)\n"
    )
    server.proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    deadline = time.monotonic() + 30
    while "ready" not in log_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    server._stop()
    assert server.proc.returncode == code  # stopped by SIGTERM, as vLLM's server is
    return log_path.read_text()


@pytest.mark.parametrize(
    ("at_start", "at_stop", "code", "noted"),
    [
        ("", f"[shutdown] API server: shutdown triggered\n{TRACEBACK}", 0, True),
        ("", "[shutdown] API server: shutdown triggered", 0, False),  # no traceback
        (TRACEBACK, "[shutdown] API server: shutdown triggered", 0, False),  # a real failure
        ("", f"[shutdown] API server: shutdown triggered\n{TRACEBACK}", 1, False),  # not normal
    ],
)
def test_a_note_follows_vllms_spurious_shutdown_traceback_only(
    tmp_path, at_start, at_stop, code, noted
):
    text = stop_stand_in(tmp_path, at_start, at_stop, code)
    assert text.startswith(f"an earlier server\n{TRACEBACK}\n")
    assert (serve.SHUTDOWN_RACE_NOTE in text) is noted
    if noted:
        assert text.rstrip().endswith(serve.SHUTDOWN_RACE_NOTE)


def test_the_server_is_asked_to_drain_its_engine_on_sigterm(tmp_path):
    server = serve.VllmServer("python", "model", ["--x"], tmp_path / "log", {})
    command = server.command
    at = command.index("--shutdown-timeout")
    assert int(command[at + 1]) == serve.SHUTDOWN_TIMEOUT_S > 0
    assert command[-1] == "--x"


def test_a_second_sigterm_waits_for_the_server_to_stop(tmp_path):
    """SIGTERM reaches the job while it stops the server (SLURM signals every process, the
    GPU wrapper its group): the stop still ends (the server's SIGTERM handling takes 1.5 s
    here), and the job's own SIGTERM handling runs after it."""
    import signal
    import threading

    server = serve.VllmServer(sys.executable, "model", [], tmp_path / "log", dict(os.environ))
    script = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(1.5), sys.exit(0)))\n"
        "print('ready', flush=True)\n"
        "while True: time.sleep(0.05)\n"
    )
    server.proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, start_new_session=True
    )
    assert server.proc.stdout.readline() == b"ready\n"

    def terminate(signum, _frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminate)
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM))
    try:
        timer.start()
        with pytest.raises(SystemExit) as stopped:
            server._stop()
    finally:
        timer.cancel()
        signal.signal(signal.SIGTERM, previous)
    assert stopped.value.code == 128 + signal.SIGTERM
    assert server.proc.returncode == 0  # it stopped as asked, not cut short by the signal
