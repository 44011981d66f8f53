"""Security defaults: nothing is unpickled, custom code runs only when the config says so (and
the report says it did), vLLM listens on 127.0.0.1 only, HF_HUB_OFFLINE is honoured, and the
default run works with the network cut."""

from __future__ import annotations

import ast
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tiny
import yaml

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("eagle3lib", "scripts", "bench")
UNPICKLERS = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "joblib", "marshal", "shelve"}


def python_files() -> list[Path]:
    files = [p for d in SOURCE_DIRS for p in sorted((ROOT / d).rglob("*.py"))]
    assert len(files) > 20
    return files


def dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{dotted(node.value)}.{node.attr}"
    return ""


def is_const(node: ast.AST | None, value) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


def unsafe_loads(source: str, name: str = "<src>") -> list[str]:
    """Every place in ``source`` that could unpickle: ``torch.load`` without a literal
    ``weights_only=True``, ``numpy.load`` with ``allow_pickle`` other than False, any import or
    call of pickle-like modules, ``trust_remote_code=True`` written as a literal."""
    found = []
    for node in ast.walk(ast.parse(source)):
        where = f"{name}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            found += [f"{where}: import {a.name}" for a in node.names if a.name in UNPICKLERS]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module.split(".")[0] in UNPICKLERS:
                found.append(f"{where}: from {module} import ...")
            if module == "torch" and any(a.name == "load" for a in node.names):
                found.append(f"{where}: from torch import load")
        elif isinstance(node, ast.Call):
            func = dotted(node.func)
            kw = {k.arg: k.value for k in node.keywords}
            if func == "torch.load" or func.endswith(".torch.load"):
                if not is_const(kw.get("weights_only"), True):
                    found.append(f"{where}: torch.load without weights_only=True")
            elif func in ("np.load", "numpy.load"):
                if "allow_pickle" in kw and not is_const(kw["allow_pickle"], False):
                    found.append(f"{where}: numpy.load(allow_pickle=...)")
            elif func.split(".")[0] in UNPICKLERS:
                found.append(f"{where}: {func}()")
            if is_const(kw.get("trust_remote_code"), True):
                found.append(f"{where}: trust_remote_code=True")
    return found


# ---- 1. no pickle loads ----------------------------------------------------------------------


def test_the_scanner_finds_unsafe_loads():
    bad = """
import pickle
from dill import loads
import numpy as np
import torch
torch.load("a.pt")
torch.load("a.pt", weights_only=False)
np.load("a.npy", allow_pickle=True)
pickle.loads(b"")
AutoModel.from_pretrained("x", trust_remote_code=True)
"""
    assert len(unsafe_loads(bad)) == 7
    good = """
import torch, numpy as np
torch.load("a.pt", weights_only=True, map_location="cpu")
np.load("a.npy")
AutoModel.from_pretrained("x", trust_remote_code=record["trust_remote_code"])
"""
    assert unsafe_loads(good) == []


def test_no_pickle_loads_in_the_project():
    found = []
    for path in python_files():
        found += unsafe_loads(path.read_text(), str(path.relative_to(ROOT)))
    assert found == []
    pattern = re.compile(r"torch\.load|pickle\.load|allow_pickle\s*=\s*True|trust_remote_code=True")
    for path in [ROOT / "Snakefile", *sorted((ROOT / "rules").glob("*.smk"))]:
        assert not pattern.search(path.read_text()), path


def test_resumed_training_state_is_loaded_weights_only():
    """The trainer state eagle3lib resumes from is read by speculators.train: it must use
    torch.load(weights_only=True) as well (a dependency update could change that)."""
    import importlib.util

    folder = Path(importlib.util.find_spec("speculators").origin).parent / "train"
    assert (folder / "checkpointer.py").is_file()
    found = []
    for path in sorted(folder.rglob("*.py")):
        found += [f for f in unsafe_loads(path.read_text(), path.name) if "torch.load" in f]
    assert found == []


def test_the_verifier_is_loaded_from_safetensors_without_remote_code(verifier_record, monkeypatch):
    import transformers

    from eagle3lib import verifier

    seen = {}

    def capture(kind):
        def from_pretrained(*args, **kwargs):
            seen[kind] = kwargs
            raise StopIteration  # stop before loading anything

        return from_pretrained

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", capture("model"))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", capture("tokenizer"))
    for load in (verifier.load_model, verifier.load_tokenizer):
        with pytest.raises(StopIteration):
            load(verifier_record, *(["float32"] if load is verifier.load_model else []))
    assert seen["model"]["use_safetensors"] is True
    assert seen["model"]["trust_remote_code"] is False
    assert seen["tokenizer"]["trust_remote_code"] is False


# ---- 2. trust_remote_code is opt-in ----------------------------------------------------------


def test_trust_remote_code_and_pickle_are_off_by_default(verifier_record):
    from eagle3lib.verifier import materialize

    schema = yaml.safe_load((ROOT / "rules/schemas/config.schema.yaml").read_text())
    verifier = schema["properties"]["verifier"]["properties"]
    assert verifier["trust_remote_code"]["default"] is False
    assert verifier["allow_pickle"]["default"] is False
    params = inspect.signature(materialize).parameters
    assert params["trust_remote_code"].default is False
    assert params["allow_pickle"].default is False
    script = (ROOT / "scripts/verifier.py").read_text()
    assert 'v.get("trust_remote_code", False)' in script
    assert 'v.get("allow_pickle", False)' in script
    assert verifier_record["trust_remote_code"] is False
    assert verifier_record["allow_pickle"] is False


def report_summary(verifier: dict) -> tuple[dict, str]:
    from eagle3lib import report, report_text

    acceptance = {
        "k": 3,
        "acceptance_length": 1.5,
        "per_position_acceptance": [0.3, 0.15, 0.05],
        "text_matches_verifier": True,
        "prompts": 1,
        "steps": 4,
    }
    manifest = {"tokens": 10, "file": {"bytes": 100}, "layer_ids": [2, 4, 5, 8], "rejected": []}
    summary = report.summarize(
        "t",
        verifier,
        {"samples": 1, "dropped": {}},
        [manifest],
        {"token_coverage": 1.0},
        {},
        {"valid": True, "problems": []},
        acceptance,
        {},
        {},
    )
    return summary, report_text.markdown(summary, {})


def test_the_report_says_when_trust_remote_code_was_on(verifier_record):
    off, off_md = report_summary(verifier_record)
    on, on_md = report_summary({**verifier_record, "trust_remote_code": True})
    assert off["verifier"]["trust_remote_code"] is False
    assert on["verifier"]["trust_remote_code"] is True
    assert "trust_remote_code" not in off_md
    assert "trust_remote_code: true" in on_md


# ---- 3. vLLM listens on 127.0.0.1 only -------------------------------------------------------


def test_vllm_servers_bind_loopback_only(tmp_path, monkeypatch):
    from eagle3lib import serve
    from eagle3lib.vllm_extraction import vllm_extraction_args

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    # Whatever the vllm section holds, no setting reaches the host flag.
    engine = {"dtype": "bfloat16", "max_model_len": 64, "host": "0.0.0.0", "port": 80}
    for args in (
        [*vllm_extraction_args([2, 4, 5, 8], tmp_path, cuda=False), *serve.engine_args(engine)],
        ["--speculative-config", json.dumps({"method": "eagle3"}), *serve.engine_args(engine)],
    ):
        server = serve.VllmServer("python", "model", args, tmp_path / "log", {})
        command = server.command
        assert command.count("--host") == 1
        assert command[command.index("--host") + 1] == "127.0.0.1"
        assert "0.0.0.0" not in " ".join(command)
        assert server.url == f"http://127.0.0.1:{server.port}"
        assert "--trust-remote-code" not in command  # off unless the verifier config says so


def test_vllm_gets_trust_remote_code_only_from_the_verifier_config():
    from eagle3lib import serve

    assert "--trust-remote-code" not in serve.engine_args({"trust_remote_code": True})
    assert serve.engine_args({}, trust_remote_code=True)[0] == "--trust-remote-code"
    assert "--trust-remote-code" in serve.serve_command("m", "ckpt", 3, trust_remote_code=True)
    assert "--trust-remote-code" not in serve.serve_command("m", "ckpt", 3)
    assert serve.serve_command("m", "ckpt", 3).startswith("vllm serve m ")  # a GPU: as it is
    assert serve.serve_command("m", "ckpt", 3, cpu_kvcache_gib="4").startswith(
        "VLLM_CPU_KVCACHE_SPACE=4 vllm serve m "
    )


def test_only_serve_py_starts_vllm_servers():
    """Every vLLM server is a serve.VllmServer (the one place that passes --host)."""
    pattern = re.compile(r"entrypoints\.openai|api_server|\"serve\"|'serve'|0\.0\.0\.0")
    offenders = [
        str(p.relative_to(ROOT))
        for p in [*python_files(), *sorted((ROOT / "rules").glob("*.smk"))]
        if p.name != "serve.py" and pattern.search(p.read_text())
    ]
    assert offenders == []


def test_vllm_environment_is_offline(monkeypatch):
    from eagle3lib import serve

    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "VLLM_NO_USAGE_STATS", "DO_NOT_TRACK"):
        monkeypatch.delenv(key, raising=False)
    env = serve.engine_env()
    assert env["HF_HUB_OFFLINE"] == env["TRANSFORMERS_OFFLINE"] == "1"
    assert env["VLLM_NO_USAGE_STATS"] == env["DO_NOT_TRACK"] == "1"


# ---- 4. no network ---------------------------------------------------------------------------

# Logs every attempt to reach the network from Python (connect, name lookups, datagrams) to
# $NET_AUDIT_LOG; loaded into every Python process of a run through PYTHONPATH.
SITECUSTOMIZE = """
import json, os, socket, sys, traceback

_LOG = os.environ.get("NET_AUDIT_LOG")
_EVENTS = {"socket.connect", "socket.getaddrinfo", "socket.gethostbyname",
           "socket.gethostbyname_ex", "socket.gethostbyaddr", "socket.sendto", "socket.sendmsg"}


def _hook(event, args):
    if event not in _EVENTS or not _LOG:
        return
    if event in ("socket.connect", "socket.sendto", "socket.sendmsg"):
        if getattr(args[0], "family", None) == socket.AF_UNIX:
            return
        detail = repr(args[1:])
    else:
        detail = repr(args)
    with open(_LOG, "a") as fh:
        fh.write(json.dumps({"pid": os.getpid(), "argv": sys.argv[:2], "event": event,
                             "args": detail[:200],
                             "stack": traceback.format_stack(limit=8)[:-1]}) + "\\n")


if _LOG:  # which processes ran with the hook installed
    with open(_LOG + ".procs", "a") as fh:
        fh.write(json.dumps(sys.argv[:2]) + "\\n")
    sys.addaudithook(_hook)
"""

PROBE = """
import socket
try:
    socket.create_connection(("1.1.1.1", 53), timeout=3).close()
    print("connected")
except OSError as exc:
    print(f"cut: {exc}")
"""


@pytest.fixture(scope="module")
def no_network(tmp_path_factory):
    """(command prefix that cuts the network, audit setup). The prefix is an unshared network
    namespace (``unshare -rn``, or ``unshare -n`` as root): only a loopback that is down, so
    nothing, Python or C (libcurl, gRPC), can reach anything. The audit hook additionally logs
    every attempt made from Python, so a silently-caught failed attempt is seen too."""
    hook_dir = tmp_path_factory.mktemp("nethook")
    (hook_dir / "sitecustomize.py").write_text(SITECUSTOMIZE)
    prefix = None
    for candidate in (["unshare", "-rn"], ["unshare", "-n"]):
        try:
            probe = subprocess.run(
                [*candidate, sys.executable, "-c", PROBE], capture_output=True, text=True
            )
        except FileNotFoundError:
            break
        if probe.returncode == 0 and probe.stdout.startswith("cut:"):
            prefix = candidate
            break
    if prefix is None:
        pytest.skip(
            "no network namespace here: needs util-linux's `unshare` and either user namespaces "
            "(`unshare -rn`) or root (`unshare -n`); the network could not be cut"
        )

    def env_for(log: Path, **extra) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
        }
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(hook_dir), env.get("PYTHONPATH")]))
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        env["NET_AUDIT_LOG"] = str(log)
        return {**env, **extra}

    return prefix, env_for


def attempts(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_the_audit_hook_sees_network_attempts(no_network, tmp_path):
    """Positive control: a download attempt inside the cut namespace fails and is logged."""
    prefix, env_for = no_network
    log = tmp_path / "net.jsonl"
    code = "import urllib.request\ntry:\n urllib.request.urlopen('https://pypi.org', timeout=3)\nexcept OSError as e:\n print('failed', e)"
    proc = subprocess.run(
        [*prefix, sys.executable, "-c", code], capture_output=True, text=True, env=env_for(log)
    )
    assert proc.stdout.startswith("failed"), proc.stdout + proc.stderr
    assert any("pypi.org" in a["args"] for a in attempts(log)), attempts(log)
    assert hooked_scripts(log) == set()  # `python -c`: no script, but the hook ran (above)


def test_hf_hub_offline_is_honoured(no_network, tmp_path):
    """A hub id with HF_HUB_OFFLINE=1 fails at once, naming the setting, with no attempt."""
    prefix, env_for = no_network
    log = tmp_path / "net.jsonl"
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
        "from eagle3lib.errors import cli\n"
        "from eagle3lib.verifier import materialize\n"
        "cli(lambda: materialize('no-such-org/no-such-model', None, None))()\n"
    )
    proc = subprocess.run(
        [*prefix, sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env_for(log, HF_HUB_OFFLINE="1"),
        timeout=120,
    )
    assert proc.returncode == 1
    assert "(offline: HF_HUB_OFFLINE is set)" in proc.stderr.strip().splitlines()[-1]
    assert attempts(log) == []


def hooked_scripts(log: Path) -> set[str]:
    """Names of the Python scripts that ran with the audit hook installed."""
    procs = Path(f"{log}.procs")
    argvs = [json.loads(line) for line in procs.read_text().splitlines()] if procs.exists() else []
    return {Path(a).name for argv in argvs for a in argv if a.endswith(".py")}


@pytest.mark.slow
def test_default_run_needs_no_network(no_network, tmp_path, verifier_dir):
    """A real snakemake run (verifier, prepare, one extraction shard, vocab) on the tiny verifier
    inside a network namespace with no network, HF_HUB_OFFLINE unset: it succeeds, and no
    Python process of it (snakemake, each job) even tried to reach the network."""
    prefix, env_for = no_network
    log = tmp_path / "net.jsonl"
    train = tiny.write_jsonl(tmp_path / "train.jsonl", tiny.conversations(6, seed=4))
    evals = tiny.write_jsonl(tmp_path / "eval.jsonl", [{"question_id": 1, "turns": ["Hi there"]}])
    config = tiny.write_config(tmp_path / "config.yaml", "t", verifier_dir, train, evals)
    targets = ["results/t/hidden_states/shard-0.safetensors", "results/t/vocab/vocab.json"]
    cmd = [
        *prefix, sys.executable, "-m", "snakemake", "--snakefile", str(ROOT / "Snakefile"),
        "--directory", str(tmp_path), "--cores", "2", "--workflow-profile", "none",
        *targets, "--configfile", str(config),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env_for(log), timeout=300)
    logs = "\n".join(p.read_text() for p in sorted((tmp_path / "results/t/logs").glob("*.log")))
    assert proc.returncode == 0, proc.stdout + proc.stderr + logs
    for target in targets:
        assert (tmp_path / target).stat().st_size > 0
    record = json.loads((tmp_path / "results/t/verifier/verifier.json").read_text())
    assert record["trust_remote_code"] is False
    # every job ran under the audit hook (so the empty log below means something)
    assert {"verifier.py", "prepare.py", "extract.py", "vocab.py"} <= hooked_scripts(log)
    assert attempts(log) == [], json.dumps(attempts(log), indent=1)[:4000]
