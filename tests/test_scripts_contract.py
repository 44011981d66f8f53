"""Contracts of the rules' scripts (scripts/*.py): each main(), run in-process with the rule's
arguments, hands every argument to the function it names, writes the files it names (and no
others), and answers with the exit status and lines the rule expects (mutation audit).

The stages' own work is stood in for here (a verifier, a GPU, the model hub and vLLM are not
available to a fast test; eagle3lib's functions have tests of their own): a stand-in records
what the script handed it and returns a small answer the script then writes."""

import importlib.util
import json
import os
import signal
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from eagle3lib import provenance
from eagle3lib.config import EvaluateConfig, ExtractConfig, PrepareConfig, from_json
from eagle3lib.fileio import read_json, write_json
from eagle3lib.leakage import EvalPromptIndex

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
STAMP = json.dumps({"rule": "x"})


def script(name: str):
    """scripts/<name>.py as a fresh module (its ``main`` is what the rule's shell runs)."""
    if str(SCRIPTS) not in sys.path:
        sys.path.append(str(SCRIPTS))  # for their `import _bootstrap`
    spec = importlib.util.spec_from_file_location(f"_contract_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(module, argv, monkeypatch, capfd) -> SimpleNamespace:
    """main() with ``argv``: its exit status (0 when it returns), stdout and stderr."""
    monkeypatch.setattr(sys, "argv", [module.__file__, *map(str, argv)])
    capfd.readouterr()
    handler = signal.getsignal(signal.SIGTERM)  # errors.cli installs its own
    try:
        module.main()
        code = 0
    except SystemExit as exc:
        code = exc.code
    finally:
        signal.signal(signal.SIGTERM, handler)
    out, err = capfd.readouterr()
    return SimpleNamespace(code=code, out=out, err=err)


def printed(value) -> str:
    """What a script prints of ``value`` (indented JSON, for people reading the job's log)."""
    return json.dumps(value, indent=2) + "\n"


def recorder(calls: list, name: str, answer=None):
    """A stand-in that records its arguments under ``name`` and returns ``answer``."""

    def stand_in(*args, **kwargs):
        calls.append((name, args, kwargs))
        return answer(*args, **kwargs) if callable(answer) else answer

    return stand_in


def called(calls, name):
    [(args, kwargs)] = [(a, k) for n, a, k in calls if n == name]
    return args, kwargs


@pytest.fixture
def written(monkeypatch):
    """provenance.write, recorded (the real one asks git and NVML)."""
    records = []

    def write(path, job, config, verifier_json=None, seed=None, stamp=None):
        records.append({"path": Path(path), "job": job, "config": config,
                        "verifier": verifier_json, "seed": seed, "stamp": stamp})  # fmt: skip

    monkeypatch.setattr(provenance, "write", write)
    return records


@pytest.fixture
def record(tmp_path):
    """A verifier.json (the fields the scripts read)."""
    path = tmp_path / "verifier.json"
    write_json(path, {"name": "tiny", "path": "org/tiny", "load_path": str(tmp_path / "hf"),
                      "trust_remote_code": True, "vocab_size": 100, "kind": "hf",
                      "config_sha256": "c", "weights": {"sha256": "w"}})  # fmt: skip
    return path


# ---- validate ------------------------------------------------------------------------------


def valid_summary(**change):
    return {"problems": [], "checkpoint": {"problems": [], "valid": True},
            "checkpoint_valid": True, "gpu_memory": {}, "acceptance": {"k": 3,
            "acceptance_length": 2.5}, "acceptance_length": 2.5, "k": 3, **change}  # fmt: skip


def test_validate_writes_its_line_for_a_valid_summary(tmp_path, monkeypatch, capfd):
    summary, out = tmp_path / "summary.json", tmp_path / "v" / "valid.txt"
    write_json(summary, valid_summary())
    got = run(script("validate"), ["--summary", summary, "--out", out], monkeypatch, capfd)
    assert (got.code, got.err) == (0, "")
    assert out.read_text() == "valid: acceptance_length=2.5000 k=3 checkpoint_valid=True\n"


def test_validate_names_each_problem_once_and_exits_1(tmp_path, monkeypatch, capfd):
    summary, out = tmp_path / "summary.json", tmp_path / "valid.txt"
    write_json(summary, valid_summary(problems=["a", "b", "a"], acceptance_length=None))
    got = run(script("validate"), ["--summary", summary, "--out", out], monkeypatch, capfd)
    judged = "acceptance: no verifier step was measured (raise evaluate.max_new_tokens)"
    assert got.code == 1 and not out.exists()
    assert got.err.splitlines() == [
        "problem: a", "problem: b", f"problem: {judged}", f"error: {summary}: 3 problem(s): a",
    ]  # fmt: skip


def test_validate_refuses_a_summary_the_report_did_not_write(tmp_path, monkeypatch, capfd):
    summary, out = tmp_path / "summary.json", tmp_path / "valid.txt"
    write_json(summary, {"k": 3})
    got = run(script("validate"), ["--summary", summary, "--out", out], monkeypatch, capfd)
    assert got.code == 1 and not out.exists()
    assert got.err == (
        f"error: {summary}: not a summary the report job writes (no 'problems'); delete it "
        "and rerun, snakemake makes it again\n"
    )


# ---- vocab ---------------------------------------------------------------------------------


def test_vocab_hands_the_size_and_writes_map_info_and_provenance(
    tmp_path, monkeypatch, capfd, written
):
    from eagle3lib import vocab

    module, calls, freq = script("vocab"), [], torch.tensor([3, 1])
    monkeypatch.setattr(
        module, "load_samples", recorder(calls, "load", SimpleNamespace(token_freq=freq))
    )
    monkeypatch.setattr(vocab, "build", recorder(calls, "build", ("D2T", "T2D")))
    monkeypatch.setattr(vocab, "save", recorder(calls, "save"))
    monkeypatch.setattr(vocab, "coverage", recorder(calls, "coverage", {"coverage": 0.9}))
    o = tmp_path / "o"
    got = run(module, ["--samples", tmp_path / "s.safetensors", "--draft-vocab-size", 7,
                       "--out-map", o / "map.safetensors", "--out-info", o / "vocab.json",
                       "--provenance", o / "p.json", "--stamp", STAMP], monkeypatch, capfd)  # fmt: skip
    assert got.code == 0 and got.out == printed({"coverage": 0.9})
    assert called(calls, "load") == ((tmp_path / "s.safetensors",), {})
    assert called(calls, "build")[0][1] == 7 and called(calls, "build")[0][0] is freq
    assert called(calls, "save") == ((o / "map.safetensors", "D2T", "T2D"), {})
    assert called(calls, "coverage")[0][1] == "T2D"
    assert read_json(o / "vocab.json") == {"coverage": 0.9}
    assert written == [{"path": o / "p.json", "job": "vocab", "config": {"draft_vocab_size": 7},
                        "verifier": None, "seed": None, "stamp": STAMP}]  # fmt: skip


# ---- check_checkpoint ----------------------------------------------------------------------


def test_check_checkpoint_checks_the_folder_with_the_aux_layers(
    tmp_path, monkeypatch, capfd, written, record
):
    from eagle3lib import checkpoint

    calls = []
    answer = {"valid": True, "problems": [], "tensors": {"w": [2]}}
    monkeypatch.setattr(checkpoint, "check", recorder(calls, "check", answer))
    manifest, config = tmp_path / "shard-0.json", tmp_path / "checkpoint" / "config.json"
    write_json(manifest, {"layer_ids": [2, 4, 5, 8]})
    out = tmp_path / "reports" / "checkpoint.json"
    got = run(script("check_checkpoint"), ["--verifier", record, "--config", config,
              "--manifest", manifest, "--out", out, "--provenance", tmp_path / "p.json",
              "--stamp", STAMP], monkeypatch, capfd)  # fmt: skip
    assert got.code == 0
    args, _ = called(calls, "check")
    assert args[0] == config.parent and args[1]["name"] == "tiny" and args[2] == [2, 4, 5]
    assert read_json(out) == {**answer, "checkpoint": "../checkpoint"}
    assert got.out == printed({"valid": True, "problems": [], "checkpoint": "../checkpoint"})
    assert written == [{"path": tmp_path / "p.json", "job": "check_checkpoint",
                        "config": {"aux_layer_ids": [2, 4, 5]}, "verifier": record,
                        "seed": None, "stamp": STAMP}]  # fmt: skip


# ---- extract -------------------------------------------------------------------------------


@pytest.mark.parametrize("rejected", [0, 2])
def test_extract_hands_its_arguments_and_warns_of_rejected_samples(
    tmp_path, monkeypatch, capfd, written, record, rejected
):
    from eagle3lib import hidden_states

    module, calls = script("extract"), []
    stats = {"rejected": rejected, "samples": 5}
    monkeypatch.setattr(module, "load_samples", recorder(calls, "load", "SAMPLES"))
    monkeypatch.setattr(hidden_states, "extract_shard", recorder(calls, "extract", stats))
    monkeypatch.setattr(torch, "set_num_threads", recorder(calls, "threads"))
    info = tmp_path / "samples.json"
    write_json(info, {"ids": ["a", "b"]})
    section = {"shards": 3, "batch_tokens": 64}
    # the engine and threads as given, or their defaults (no engine, torch's own threads)
    given = ["--threads", 3, "--vllm", '{"dtype": "float32"}', "--vllm-python", "/venv/python"]
    got = run(module, ["--verifier", record, "--samples", tmp_path / "s.safetensors",
              "--info", info, "--shard", 1, "--extract", json.dumps(section),
              *(given if rejected else []), "--out-shard", tmp_path / "o" / "shard-1.safetensors",
              "--out-manifest", tmp_path / "o" / "shard-1.json",
              "--provenance", tmp_path / "p.json", "--stamp", STAMP], monkeypatch, capfd)  # fmt: skip
    assert got.code == 0 and got.out == printed(stats)
    warning = f"warning: {rejected} sample(s) rejected for non-finite states\n"
    assert got.err == (warning if rejected else "")
    assert [a for n, a, _ in calls if n == "threads"] == ([(3,)] if rejected else [])
    assert called(calls, "load") == ((tmp_path / "s.safetensors",), {})
    args, kwargs = called(calls, "extract")
    assert args[:4] == ("SAMPLES", ["a", "b"], 1, from_json(ExtractConfig, json.dumps(section)))
    assert args[4]["name"] == "tiny"
    assert args[5:] == (tmp_path / "o" / "shard-1.safetensors", tmp_path / "o" / "shard-1.json")
    if rejected:
        assert kwargs == {"engine": {"dtype": "float32"}, "vllm_python": "/venv/python"}
    else:
        assert kwargs == {"engine": {}, "vllm_python": None}
    assert written == [{"path": tmp_path / "p.json", "job": "extract-1", "config": section,
                        "verifier": record, "seed": None, "stamp": STAMP}]  # fmt: skip


# ---- evaluate ------------------------------------------------------------------------------


@pytest.mark.parametrize("threads", [None, 2])
def test_evaluate_reads_each_eval_set_and_writes_the_result(
    tmp_path, monkeypatch, capfd, written, record, threads
):
    from eagle3lib import checkpoint, conversations, data, evaluate, verifier

    calls = []
    draft = SimpleNamespace(to=recorder(calls, "to", "DRAFT"))
    result = {"acceptance_length": 2.0, "per_prompt": [1]}
    prompts = lambda path, n: [{"text": f"{path.name}:{n}"}]  # noqa: E731
    monkeypatch.setattr(conversations, "read_eval_prompts", recorder(calls, "read", prompts))
    monkeypatch.setattr(data, "prompt_token_ids", lambda tok, text: [tok, text])
    monkeypatch.setattr(verifier, "load_tokenizer", recorder(calls, "tok", "TOK"))
    monkeypatch.setattr(verifier, "load_model", recorder(calls, "model", "MODEL"))
    monkeypatch.setattr(verifier, "device_map_for_job", lambda: "MAP")
    monkeypatch.setattr(checkpoint, "load_draft", recorder(calls, "draft", draft))
    monkeypatch.setattr(evaluate, "evaluate", recorder(calls, "evaluate", result))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch, "set_num_threads", recorder(calls, "threads"))
    manifest, config = tmp_path / "shard-0.json", tmp_path / "ckpt" / "config.json"
    write_json(manifest, {"layer_ids": [1, 3, 8]})
    sets = [{"name": "a", "path": str(tmp_path / "a.jsonl"), "max_prompts": 2},
            {"name": "b", "path": str(tmp_path / "b.jsonl"), "max_prompts": None}]  # fmt: skip
    section = {"k": [2, 4], "max_new_tokens": 4, "dtype": "float32"}
    out = tmp_path / "reports" / "acceptance.json"
    got = run(script("evaluate"), ["--verifier", record, "--config", config,
              "--manifest", manifest, "--eval-sets", json.dumps(sets),
              "--evaluate", json.dumps(section), *(["--threads", threads] if threads else []), "--out", out,
              "--provenance", tmp_path / "p.json", "--stamp", STAMP], monkeypatch, capfd)  # fmt: skip
    assert got.code == 0
    assert [a for n, a, _ in calls if n == "threads"] == ([(2,)] if threads else [])
    reads = [a for n, a, _ in calls if n == "read"]
    assert reads == [(tmp_path / "a.jsonl", 2), (tmp_path / "b.jsonl", None)]
    assert called(calls, "model")[0][1] == torch.float32
    args, _ = called(calls, "draft")
    assert (args[0], args[1]["name"], args[2:]) == (config.parent, "tiny", ("sdpa", torch.float32))
    assert called(calls, "to") == ((torch.device("cpu"),), {})
    args, kwargs = called(calls, "evaluate")
    assert args[:3] == ("MODEL", "DRAFT", "TOK") and args[4:] == (
        from_json(EvaluateConfig, json.dumps(section)),
        [1, 3],
    )
    assert [s["prompts"] for s in args[3]] == [
        [{"text": "a.jsonl:2", "token_ids": ["TOK", "a.jsonl:2"]}],
        [{"text": "b.jsonl:None", "token_ids": ["TOK", "b.jsonl:None"]}],
    ]
    kwargs["log"]("evaluate: a line")  # the job's progress goes to stderr
    assert capfd.readouterr().err == "evaluate: a line\n"
    assert called(calls, "model")[1] == {"device_map": "MAP"}
    assert read_json(out) == {**result, "device": "cpu", "dtype": "float32"}
    assert got.out == printed({"acceptance_length": 2.0, "device": "cpu", "dtype": "float32"})
    assert written == [{"path": tmp_path / "p.json", "job": "evaluate",
                        "config": {**section, "eval_sets": sets}, "verifier": record,
                        "seed": None, "stamp": STAMP}]  # fmt: skip


# ---- prepare -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("omp", "threads"), [(None, 1), ("", 1), ("3,2", 3), (" 5", 5), ("0", 1), ("64", 16)]
)
def test_prepare_takes_the_jobs_threads_at_most_its_cpus(monkeypatch, omp, threads):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    assert script("prepare").job_threads() == threads


@pytest.mark.parametrize("workers", [None, 4])
def test_prepare_hands_its_arguments_and_writes_samples_info_and_provenance(
    tmp_path, monkeypatch, capfd, written, record, workers
):
    from eagle3lib import data

    module, calls = script("prepare"), []
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    words = " ".join(f"w{i}" for i in range(20))
    prompts = lambda path, n: [{"text": f"{path.stem} {words}"}]  # noqa: E731
    prepared = SimpleNamespace(summary={"samples": 2}, ids=["a", "b"])
    monkeypatch.setattr(module, "load_tokenizer", recorder(calls, "tok", "TOK"))
    monkeypatch.setattr(module, "read_eval_prompts", recorder(calls, "read", prompts))
    monkeypatch.setattr(module, "train_sources", recorder(calls, "sources", "SOURCES"))
    monkeypatch.setattr(data, "prepare_samples", recorder(calls, "prepare", prepared))
    monkeypatch.setattr(data, "save_prepared", recorder(calls, "save", None))
    section = {"train": {"path": "t.jsonl", "max_samples": 3}, "max_length": 64}
    o = tmp_path / "o"
    got = run(module, ["--verifier", record, "--train", tmp_path / "t.jsonl", tmp_path / "x.jsonl",
              "--eval", tmp_path / "e1.jsonl", tmp_path / "e2.jsonl", "--data", json.dumps(section),
              "--out-samples", o / "samples.safetensors", "--out-info", o / "samples.json",
              "--provenance", o / "p.json", "--stamp", STAMP,
              *(["--workers", workers] if workers else [])], monkeypatch, capfd)  # fmt: skip
    assert got.code == 0
    assert [a for n, a, _ in calls if n == "read"] == [
        (tmp_path / "e1.jsonl", None), (tmp_path / "e2.jsonl", None),
    ]  # fmt: skip
    assert called(calls, "tok")[0][0]["name"] == "tiny"
    assert called(calls, "sources") == (([tmp_path / "t.jsonl", tmp_path / "x.jsonl"], section), {})
    args, _ = called(calls, "prepare")
    assert args[0] == "TOK" and args[1] == "SOURCES" and args[4] == (workers or 3)
    assert args[2] == PrepareConfig(max_length=64, max_samples=3)
    assert args[3] == EvalPromptIndex.build([[f"e1 {words}"], [f"e2 {words}"]])
    assert called(calls, "save") == ((prepared, o / "samples.safetensors", 100), {})
    assert read_json(o / "samples.json") == {"samples": 2, "ids": ["a", "b"]}
    assert got.out.startswith(f"prepare: {workers or 3} tokenizing processes\n")
    assert got.out.split("\n", 1)[1] == printed({"samples": 2})
    assert written == [{"path": o / "p.json", "job": "prepare", "config": section,
                        "verifier": record, "seed": None, "stamp": STAMP}]  # fmt: skip


# ---- verifier ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags", [{}, {"name": "n", "trust_remote_code": True, "allow_pickle": True}]
)
def test_verifier_hands_the_sections_flags_and_writes_the_record(
    tmp_path, monkeypatch, capfd, written, flags
):
    module, calls = script("verifier"), []
    answer = {"kind": "hf", "load_path": "org/m", "name": "m"}
    monkeypatch.setattr(module, "materialize", recorder(calls, "materialize", answer))
    section, out = {"path": "org/m", **flags}, tmp_path / "run" / "verifier.json"
    got = run(module, ["--verifier", json.dumps(section), "--hf-dir", tmp_path / "hf",
              "--out", out, "--provenance", tmp_path / "p.json", "--stamp", STAMP],
              monkeypatch, capfd)  # fmt: skip
    assert got.code == 0 and got.out == printed(answer)
    assert called(calls, "materialize") == (("org/m", flags.get("name"), tmp_path / "hf"), {
        "trust_remote_code": flags.get("trust_remote_code", False),
        "allow_pickle": flags.get("allow_pickle", False),
    })  # fmt: skip
    assert read_json(out) == answer
    assert written == [{"path": tmp_path / "p.json", "job": "verifier", "config": section,
                        "verifier": out, "seed": None, "stamp": STAMP}]  # fmt: skip


# ---- report --------------------------------------------------------------------------------


@pytest.mark.parametrize("optional", [False, True])
def test_report_hands_every_input_and_writes_every_output(
    tmp_path, monkeypatch, capfd, written, record, optional
):
    from eagle3lib import report, report_plots, report_text

    calls, i = [], tmp_path / "in"
    by_category = {"chat": [0.5]} if optional else None
    summary = {"acceptance_length": 2.0, "per_position_acceptance": [0.5], "valid": True,
               "k": 3, "acceptance": {"by_category": by_category, "eval_set": "mt"},
               "other": 1}  # fmt: skip

    def plot(name):
        def draw(*args):
            calls.append((name, args, {}))
            Path(args[2] if name == "acceptance" else args[-1]).write_text(name)

        return draw

    monkeypatch.setattr(report, "summarize", recorder(calls, "summarize", summary))
    monkeypatch.setattr(report_plots, "plot_acceptance", plot("acceptance"))
    monkeypatch.setattr(report_plots, "plot_loss", plot("loss"))
    monkeypatch.setattr(report_text, "markdown", recorder(calls, "markdown", "MD"))
    monkeypatch.setattr(report_text, "html_tables", recorder(calls, "tables", "HTML"))
    files = {n: i / f"{n}.json" for n in ("samples", "m0", "m1", "vocab", "train", "ckpt",
             "acc", "g-a", "g-b", "v", "r", "p0")}  # fmt: skip
    for name, path in files.items():
        write_json(path, {"name": name, "ids": [1]})
    curves = {"train_loss": [3.0, 2.0] if optional else [], "val": [1.5]}
    write_json(files["train"], {"name": "train", "curves": curves})
    (i / "b-x.tsv").write_text("s\n1\n")
    o = tmp_path / "reports"
    outs = {"--out": o / "summary.json", "--out-markdown": o / "summary.md",
            "--out-plot-acceptance": o / "acc.png", "--out-plot-loss": o / "loss.png",
            "--out-tables": o / "tables.html"}  # fmt: skip
    extra = ["--benchmarks", i / "b-x.tsv", i / "b-missing.tsv",  # (one not written)
             "--vllm-acceptance", files["v"], "--regenerated", files["r"],
             "--min-acceptance-length", '{"a": {"3": 2.0}}', "--provenance", files["p0"],
             "--out-provenance", o / "p.json", "--stamp", STAMP]  # fmt: skip
    got = run(script("report"), ["--run", "r1", "--verifier", record,
              "--samples-info", files["samples"], "--manifests", files["m0"], files["m1"],
              "--vocab-info", files["vocab"], "--train-summary", files["train"],
              "--checkpoint-report", files["ckpt"], "--acceptance", files["acc"],
              "--gpu", files["g-a"], files["g-b"],
              *[str(x) for kv in outs.items() for x in kv], *(extra if optional else [])],
              monkeypatch, capfd)  # fmt: skip
    assert got.code == 0
    _, kwargs = called(calls, "summarize")
    assert kwargs == {
        "run": "r1", "verifier": read_json(record), "prepare": {"name": "samples"},
        "manifests": [{"name": "m0", "ids": [1]}, {"name": "m1", "ids": [1]}],
        "vocab": {"name": "vocab", "ids": [1]},
        "training": {"name": "train", "final_train_loss": 2.0 if optional else None,
                     "val": [1.5]},
        "checkpoint": {"name": "ckpt", "ids": [1]}, "acceptance": {"name": "acc", "ids": [1]},
        "gpu_records": {"g-a": files["g-a"], "g-b": files["g-b"]},
        "benchmarks": {"b-x": i / "b-x.tsv"} if optional else {},
        "provenance": [{"name": "p0", "ids": [1]}] if optional else [],
        "vllm": {"name": "v", "ids": [1]} if optional else None,
        "regenerated": {"name": "r", "ids": [1]} if optional else None,
        "min_acceptance_length": {"a": {"3": 2.0}} if optional else {},
    }  # fmt: skip
    assert called(calls, "acceptance")[0][:2] == ([0.5], 3)
    assert called(calls, "acceptance")[0][3:] == (by_category, "mt")
    assert called(calls, "loss")[0][0] == curves
    per = " and per category" if optional else ""
    assert called(calls, "markdown") == ((summary, {f"Acceptance per position{per}": "acc.png",
                                                    "Training loss": "loss.png"}), {})  # fmt: skip
    assert called(calls, "tables") == ((summary,), {})
    assert [(o / n).read_text() for n in ("acc.png", "loss.png", "summary.md", "tables.html")] == [
        "acceptance", "loss", "MD", "HTML",
    ]  # fmt: skip
    assert read_json(o / "summary.json") == summary
    assert got.out == printed({"acceptance_length": 2.0, "per_position_acceptance": [0.5],
                               "valid": True})  # fmt: skip
    assert written == ([{"path": o / "p.json", "job": "report", "config": {"run": "r1"},
                         "verifier": record, "seed": None, "stamp": STAMP}] if optional else [])  # fmt: skip


# ---- serve_check ---------------------------------------------------------------------------


@pytest.mark.parametrize("cpu", [True, False])
def test_serve_check_hands_its_arguments_and_writes_the_command_it_ran(
    tmp_path, monkeypatch, capfd, written, record, cpu
):
    """The command written is the one serve_check served with: on a CPU with the KV cache of
    vllm.cpu_kvcache_gib. (vLLM is not importable here, and no tokenizer folder is at hand:
    stand-in modules answer vLLM's version and the tokenizer.)"""
    from eagle3lib import conversations, data, hidden_states, serve

    calls = []
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(__version__="0.0-test"))
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(serve, "on_cpu", lambda: cpu)
    tokenizer = SimpleNamespace(from_pretrained=recorder(calls, "tok", "TOK"))
    monkeypatch.setitem(sys.modules, "transformers", SimpleNamespace(AutoTokenizer=tokenizer))
    read = lambda path, n: [{"text": path.name}]  # noqa: E731
    monkeypatch.setattr(conversations, "read_eval_prompts", recorder(calls, "read", read))
    monkeypatch.setattr(data, "prompt_token_ids", lambda tok, text: [tok, text])
    monkeypatch.setattr(serve, "serve_check", recorder(calls, "serve", {"k": 4, "al": 2.0}))
    monkeypatch.setattr(hidden_states, "resolve_dtype", recorder(calls, "dtype"))
    monkeypatch.chdir(tmp_path)  # the rule's paths are relative to the working directory
    run_dir = Path("run")
    (run_dir / "checkpoint").mkdir(parents=True)
    out = run_dir / "reports" / "vllm_acceptance.json"
    section = {"k": [4, 2], "max_new_tokens": 9, "dtype": "float32"}
    engine = {"cpu_kvcache_gib": 4, "startup_timeout": 60}
    got = run(script("serve_check"), ["--verifier", record, "--config",
              run_dir / "checkpoint" / "config.json", "--prompts", tmp_path / "e.jsonl",
              "--max-prompts", 0, "--evaluate", json.dumps(section), "--vllm", json.dumps(engine),
              "--vllm-python", "/venv/python", "--server-log", tmp_path / "server.log",
              "--out", out, "--provenance", tmp_path / "p.json", "--stamp", STAMP],
              monkeypatch, capfd)  # fmt: skip
    assert got.code == 0
    load_path = str(tmp_path / "hf")
    assert called(calls, "tok") == ((load_path,), {"trust_remote_code": True})
    assert called(calls, "read") == ((tmp_path / "e.jsonl", None), {})
    args, kwargs = called(calls, "serve")
    assert args[:3] == ("/venv/python", load_path, "run/checkpoint")
    assert args[3] == [{"text": "e.jsonl", "token_ids": ["TOK", "e.jsonl"]}]
    assert args[4:] == (4, 9, {**engine, "dtype": "float32"}, tmp_path / "server.log")
    assert kwargs["trust_remote_code"] is True and callable(kwargs["log"])
    spec = '{"method": "eagle3", "model": "checkpoint", "num_speculative_tokens": 4}'
    command = f"vllm serve {load_path} --trust-remote-code --speculative-config '{spec}'"
    command = f"VLLM_CPU_KVCACHE_SPACE=4 {command}" if cpu else command
    assert read_json(out) == {"k": 4, "al": 2.0, "vllm_version": "0.0-test",
                              "serve_command": command}  # fmt: skip
    result = {"k": 4, "al": 2.0, "vllm_version": "0.0-test", "serve_command": command}
    assert got.out == printed(result) + f"serve the draft from run with:\n  {command}\n"
    # no GPU: the dtype is refused where vLLM on this CPU would be slow in it
    assert called(calls, "dtype") == (("float32", torch.device("cpu"), "vllm.dtype"), {})
    assert written == [{"path": tmp_path / "p.json", "job": "serve_check",
                        "config": {**section, **engine, "dtype": "float32"}, "verifier": record,
                        "seed": None, "stamp": STAMP}]  # fmt: skip


def test_serve_check_reads_at_most_max_prompts(tmp_path, monkeypatch, capfd, record):
    from eagle3lib import conversations, serve

    calls = []
    tokenizer = SimpleNamespace(from_pretrained=lambda *a, **k: None)
    monkeypatch.setitem(sys.modules, "transformers", SimpleNamespace(AutoTokenizer=tokenizer))
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(__version__="x"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(conversations, "read_eval_prompts", recorder(calls, "read", []))
    monkeypatch.setattr(serve, "serve_check", recorder(calls, "serve", {"k": 3}))
    monkeypatch.setattr(serve, "on_cpu", lambda: True)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    got = run(script("serve_check"), ["--verifier", record, "--config", tmp_path / "c" / "config.json",
              "--prompts", tmp_path / "e.jsonl", "--max-prompts", 5, "--evaluate",
              '{"max_new_tokens": 2}', "--vllm", "{}", "--vllm-python", "py",
              "--server-log", tmp_path / "s.log", "--out", tmp_path / "r" / "o.json"],
              monkeypatch, capfd)  # fmt: skip
    assert got.code == 0
    assert called(calls, "read") == ((tmp_path / "e.jsonl", 5), {})
    assert called(calls, "serve")[0][4:7] == (3, 2, {"dtype": "float32"})
    # vllm.cpu_kvcache_gib's default, as serve.serve_check served with
    assert read_json(tmp_path / "r" / "o.json")["serve_command"].startswith(
        "VLLM_CPU_KVCACHE_SPACE=1 vllm serve "
    )


# ---- train ---------------------------------------------------------------------------------


class Relaunched(Exception):
    """os.execv's stand-in: torchrun would replace the process."""


def train_job(tmp_path, monkeypatch, *, rank=0, torchrun=None):
    """scripts/train.py with the trainer, the export and the relaunch stood in (no GPU here;
    eagle3lib.train's own tests train for real)."""
    from eagle3lib import checkpoint, train, vocab

    module, calls = script("train"), []
    state = tmp_path / "state"
    stats = {"rank": rank, "final_epoch_dir": str(state / "epoch-2"), "steps": 5}
    monkeypatch.setattr(module, "relaunch", recorder(calls, "relaunch", (rank == 0, torchrun)))
    monkeypatch.setattr(module, "hash_ahead", recorder(calls, "hash"))
    monkeypatch.setattr(
        os, "execv", recorder(calls, "execv", lambda *a: (_ for _ in ()).throw(Relaunched()))
    )
    monkeypatch.setattr(torch, "set_num_threads", recorder(calls, "threads"))
    monkeypatch.setattr(train, "train", recorder(calls, "train", stats))
    monkeypatch.setattr(train, "read_metrics", recorder(calls, "metrics", "METRICS"))
    monkeypatch.setattr(train, "loss_curves", recorder(calls, "curves", {"train_loss": [1.0]}))
    monkeypatch.setattr(vocab, "load", recorder(calls, "vocab", "VOCAB"))
    monkeypatch.setattr(checkpoint, "export", recorder(calls, "export", {"cfg": 1}))
    monkeypatch.setattr(checkpoint, "model_card", recorder(calls, "card", "CARD"))
    monkeypatch.setenv("RANK", str(rank))
    return module, calls, state


TRAIN_SECTION = {"epochs": 3, "seed": 7, "loader_threads": 4, "keep_states": 1, "loader_workers": 1}


@pytest.mark.parametrize(
    ("given", "processes"),
    [
        ([], 2),
        (["--processes", 1, "--loader-workers", 2], 1),
        (["--nodes", 2, "--node-gpus", 3], 3),
    ],
)
def test_train_hands_its_arguments_and_writes_card_summary_and_provenance(
    tmp_path, monkeypatch, capfd, written, record, given, processes
):
    from eagle3lib.config import TrainConfig

    module, calls, state = train_job(tmp_path, monkeypatch)
    ckpt, o = tmp_path / "run" / "checkpoint", tmp_path / "run" / "train"
    argv = ["--verifier", record, "--shards", tmp_path / "s0", tmp_path / "s1",
            "--manifests", tmp_path / "m0", tmp_path / "m1", "--vocab-map", tmp_path / "v",
            "--train", json.dumps(TRAIN_SECTION), "--state-dir", state, "--gpus", 2,
            "--threads", 12, "--keep-states", 4, "--out-config", ckpt / "config.json",
            "--out-weights", ckpt / "model.safetensors", "--out-card", ckpt / "README.md",
            "--out-summary", o / "summary.json", "--provenance", o / "p.json",
            "--stamp", STAMP, *given]  # fmt: skip
    got = run(module, argv, monkeypatch, capfd)
    assert got.code == 0
    args, _ = called(calls, "relaunch")
    assert args[:2] == (2 if "--nodes" in given else 1, processes)
    assert args[2] == [module.__file__, *map(str, argv)]
    assert called(calls, "hash") == (([tmp_path / "s0", tmp_path / "s1"],), {})
    # --loader-workers (the rule's resource) over the section's
    workers = 2 if "--loader-workers" in given else TRAIN_SECTION["loader_workers"]
    assert called(calls, "threads") == ((12 // processes - workers,), {})  # less its workers
    args, kwargs = called(calls, "train")
    assert args[0] == TrainConfig(**{**TRAIN_SECTION, "keep_states": 4, "loader_workers": workers,
                                     "loader_threads": min(4, 12 // processes - 1)})  # fmt: skip
    assert args[1]["name"] == "tiny" and args[4] == "VOCAB"
    assert args[2:4] == ([tmp_path / "s0", tmp_path / "s1"], [tmp_path / "m0", tmp_path / "m1"])
    assert args[5:] == (state, state / "metrics.jsonl") and "phases" in kwargs
    assert called(calls, "vocab") == ((tmp_path / "v",), {})
    assert called(calls, "export") == ((state / "epoch-2", ckpt, "tiny"), {})
    assert called(calls, "card")[0][0] == {"cfg": 1}
    assert called(calls, "metrics") == ((state / "metrics.jsonl",), {})
    assert (ckpt / "README.md").read_text() == "CARD"
    summary = read_json(o / "summary.json")
    assert json.loads(got.out) == {k: v for k, v in summary.items() if k != "curves"}
    assert got.out.startswith('{\n  "rank": 0,\n')  # indented, for people
    marks = ["started", "imported", "checkpoint exported", "model card written"]
    assert sorted(summary.pop("timeline")) == sorted(marks)  # the first process logs each
    assert [line.split(" at ")[0] for line in got.err.splitlines()] == [
        f"train: {m}" for m in marks
    ]
    assert summary == {
        "rank": 0, "steps": 5, "epochs": 3, "final_epoch_dir": "../../state/epoch-2",
        "curves": {"train_loss": [1.0]},
    }  # fmt: skip
    assert written == [{"path": o / "p.json", "job": "train", "config": TRAIN_SECTION,
                        "verifier": record, "seed": 7, "stamp": STAMP}]  # fmt: skip


def test_train_writes_nothing_from_a_rank_but_the_first(
    tmp_path, monkeypatch, capfd, written, record
):
    module, calls, state = train_job(tmp_path, monkeypatch, rank=1)
    o = tmp_path / "o"
    got = run(module, ["--verifier", record, "--shards", tmp_path / "s", "--manifests",
              tmp_path / "m", "--vocab-map", tmp_path / "v", "--train", "{}", "--state-dir",
              state, "--out-config", o / "config.json", "--out-weights", o / "w",
              "--out-card", o / "README.md", "--out-summary", o / "summary.json",
              "--provenance", o / "p.json"], monkeypatch, capfd)  # fmt: skip
    assert (got.code, got.out, got.err) == (0, "", "")  # the first process logs
    assert called(calls, "relaunch")[0][:2] == (1, 0)  # one node, no GPU: one process
    assert [n for n, _, _ in calls] == ["relaunch", "vocab", "train"]  # no hashing, no threads
    assert written == [] and not [p for p in o.glob("*") if not p.name.startswith(".")]


def test_train_execs_torchrun_when_relaunched(tmp_path, monkeypatch, capfd, record):
    module, calls, state = train_job(tmp_path, monkeypatch, torchrun=["/bin/torchrun", "x"])
    monkeypatch.chdir(tmp_path)  # its relative paths' folder is locked
    with pytest.raises(Relaunched):
        run(module, ["--verifier", record, "--shards", "s", "--manifests", "m", "--vocab-map", "v",
            "--train", "{}", "--state-dir", state, "--gpus", 2, "--out-config", "c",
            "--out-weights", "w", "--out-card", "r", "--out-summary", "s"], monkeypatch, capfd)  # fmt: skip
    assert called(calls, "execv") == (("/bin/torchrun", ["/bin/torchrun", "x"]), {})
    assert [n for n, _, _ in calls] == ["relaunch", "execv"]


# ---- regenerate ----------------------------------------------------------------------------


def regenerate_job(monkeypatch, **backends):
    """scripts/regenerate.py with the tokenizer, the files and the generation stood in (no
    verifier weights, GPU or vLLM here; eagle3lib.regenerate's own tests generate for real)."""
    from eagle3lib import conversations, data, verifier
    from eagle3lib import regenerate as rg

    module, calls = script("regenerate"), []
    sources = [SimpleNamespace(path=Path("d/t.jsonl"), id_prefix=""),
               SimpleNamespace(path=Path("d/x.jsonl"), id_prefix="x:")]  # fmt: skip
    convs = [{"id": "a"}, {"id": "x:b"}, {"id": "x:c"}]
    monkeypatch.setattr(verifier, "load_tokenizer", recorder(calls, "tok", "TOK"))
    monkeypatch.setattr(data, "check_chat_template", recorder(calls, "template"))
    monkeypatch.setattr(conversations, "train_sources", recorder(calls, "sources", sources))
    monkeypatch.setattr(rg, "read_sources", recorder(calls, "read", convs))
    monkeypatch.setattr(rg, "regenerate", recorder(calls, "regenerate", {"answered": 3}))
    for name in ("with_hf", "with_vllm", "with_workers"):
        answer = backends.get(name, lambda *a, name=name: pytest.fail(f"{name} ran"))
        monkeypatch.setattr(module, name, recorder(calls, name, answer))
    return module, calls, convs


def regenerate_argv(tmp_path, record, section, *extra, data_section=None):
    data_section = data_section or {"train": {"path": "t", "dedupe": True}, "max_length": 64,
                                    "extra_train": [{"path": "x"}], "on_invalid_record": "skip"}  # fmt: skip
    return ["--verifier", record, "--train", tmp_path / "t.jsonl", tmp_path / "x.jsonl",
            "--data", json.dumps(data_section), "--regenerate", json.dumps(section),
            "--vllm", '{"startup_timeout": 30}', "--vllm-python", "/venv/python",
            "--work-dir", tmp_path / "work", "--server-log", tmp_path / "server.log",
            "--out", tmp_path / "o" / "t.jsonl", "--out-info", tmp_path / "o" / "regenerate.json",
            "--provenance", tmp_path / "o" / "p.json", "--stamp", STAMP, *extra]  # fmt: skip


def test_regenerate_hands_its_arguments_and_writes_info_per_source(
    tmp_path, monkeypatch, capfd, written, record
):
    from eagle3lib.config import RegenerateConfig
    from eagle3lib.fileio import sha256_json

    hf = lambda a, cfg, rec, tok, run: {**run("GEN"), "dtype": "float32"}  # noqa: E731
    module, calls, convs = regenerate_job(monkeypatch, with_hf=hf)
    section = {"seed": 5, "max_new_tokens": 8}
    argv = regenerate_argv(tmp_path, record, section)
    got = run(module, argv, monkeypatch, capfd)
    assert got.code == 0
    data_section = json.loads(argv[argv.index("--data") + 1])
    assert called(calls, "sources") == (
        ([tmp_path / "t.jsonl", tmp_path / "x.jsonl"], data_section),
        {},
    )
    assert called(calls, "template") == (("TOK", "verifier 'org/tiny'"), {})
    args, _ = called(calls, "read")
    assert args[1:] == ("skip", True)
    args, kwargs = called(calls, "regenerate")
    assert args[:2] == (convs, "GEN") and args[4:6] == (
        RegenerateConfig(seed=5, max_new_tokens=8),
        64,
    )
    assert args[6] == tmp_path / "work" and args[8] == tmp_path / "o" / "t.jsonl"
    assert args[7] == {"regenerate": section, "verifier": "c", "weights": "w",
                       "data": data_section["train"], "max_length": 64,
                       "extra_train": [{"path": "x"}], "conversations": sha256_json(convs)}  # fmt: skip
    assert kwargs["worker"] is None and kwargs["synthesize"] is None
    assert called(calls, "with_hf")[0][2]["name"] == "tiny"
    info = {"answered": 3, "dtype": "float32", "settings": section, "verifier": "tiny",
            "source": [{"path": "t.jsonl", "conversations": 1},
                       {"path": "x.jsonl", "conversations": 2}]}  # fmt: skip
    assert read_json(tmp_path / "o" / "regenerate.json") == info and got.out == printed(info)
    assert written == [{"path": tmp_path / "o" / "p.json", "job": "regenerate", "config": section,
                        "verifier": record, "seed": 5, "stamp": STAMP}]  # fmt: skip


def test_regenerate_picks_the_backend_and_a_worker_writes_no_info(
    tmp_path, monkeypatch, capfd, written, record
):
    stats = lambda *a: {"answered": 1}  # noqa: E731
    module, calls, _ = regenerate_job(monkeypatch, with_hf=lambda a, c, r, t, run: run("G"),
                                      with_vllm=stats, with_workers=stats)  # fmt: skip
    info = tmp_path / "o" / "regenerate.json"
    got = run(module, regenerate_argv(tmp_path, record, {}, "--workers", 2, "--worker", "1/2"),
              monkeypatch, capfd)  # fmt: skip
    assert (got.code, got.out, written) == (0, "", []) and not info.exists()
    assert called(calls, "regenerate")[1]["worker"] == (1, 2)
    got = run(module, regenerate_argv(tmp_path, record, {}, "--workers", 2), monkeypatch, capfd)
    assert got.code == 0 and called(calls, "with_workers")[0][0].workers == 2
    got = run(module, regenerate_argv(tmp_path, record, {"backend": "vllm"}), monkeypatch, capfd)
    assert got.code == 0 and called(calls, "with_vllm")[0][2] == {"startup_timeout": 30}
    assert read_json(info)["answered"] == 1 and len(written) == 2


def test_regenerate_refuses_synthetic_prompts_with_workers(tmp_path, monkeypatch, capfd, record):
    module, calls, _ = regenerate_job(monkeypatch)
    argv = regenerate_argv(tmp_path, record, {"synthetic_prompts": 4}, "--workers", 3)
    got = run(module, argv, monkeypatch, capfd)
    assert got.code == 1 and calls == []
    assert got.err == (
        "error: config key regenerate.synthetic_prompts: prompts are sampled once, by one "
        "process, not by 3 workers; set regenerate.workers: 1\n"
    )


# ---- every script: its required options, and the lock on the folders it writes -------------

# Each script's required options (in its parser's order), with a value that parses.
REQUIRED = {
    "check_checkpoint": {"--verifier": "v", "--config": "c", "--manifest": "m", "--out": "o/r"},
    "evaluate": {"--verifier": "v", "--config": "c", "--manifest": "m", "--eval-sets": "[]",
                 "--evaluate": "{}", "--out": "o/r"},
    "extract": {"--verifier": "v", "--samples": "s", "--info": "i", "--shard": "2",
                "--extract": "{}", "--out-shard": "o/s", "--out-manifest": "o/m"},
    "prepare": {"--verifier": "v", "--train": "t", "--eval": "e", "--data": "{}",
                "--out-samples": "o/s", "--out-info": "o/i"},
    "regenerate": {"--verifier": "v", "--train": "t", "--data": "{}", "--regenerate": "{}",
                   "--vllm": "{}", "--vllm-python": "p", "--work-dir": "w",
                   "--server-log": "l", "--out": "o/t", "--out-info": "o/i"},
    "report": {"--run": "r", "--verifier": "v", "--samples-info": "s", "--manifests": "m",
               "--vocab-info": "v", "--train-summary": "t", "--checkpoint-report": "c",
               "--acceptance": "a", "--gpu": "g", "--out": "o/s", "--out-markdown": "o/m",
               "--out-plot-acceptance": "o/a", "--out-plot-loss": "o/l", "--out-tables": "o/t"},
    "serve_check": {"--verifier": "v", "--config": "c", "--prompts": "p", "--evaluate": "{}",
                    "--vllm": "{}", "--vllm-python": "p", "--server-log": "l", "--out": "o/r"},
    "train": {"--verifier": "v", "--shards": "s", "--manifests": "m", "--vocab-map": "v",
              "--train": "{}", "--state-dir": "d", "--out-config": "o/c",
              "--out-weights": "o/w", "--out-card": "o/r", "--out-summary": "o/s"},
    "validate": {"--summary": "s", "--out": "o/v"},
    "verifier": {"--verifier": "{}", "--hf-dir": "h/hf", "--out": "o/v"},
    "vocab": {"--samples": "s", "--draft-vocab-size": "8", "--out-map": "o/m",
              "--out-info": "o/i"},
}  # fmt: skip
JOBS = {"extract": "extract-2"}  # the lock's job name, where it is not the script's


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_a_script_names_every_required_option_it_misses(name, monkeypatch, capfd):
    got = run(script(name), [], monkeypatch, capfd)
    assert got.code == 2
    assert got.err.splitlines()[-1].endswith(
        f"error: the following arguments are required: {', '.join(REQUIRED[name])}"
    )


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_a_script_refuses_a_folder_another_job_of_its_kind_writes(
    name, tmp_path, monkeypatch, capfd
):
    """The folder of the files it writes is locked for the job before anything is read."""
    import fcntl

    from eagle3lib.lifetime import lock_path

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(os, "execv", lambda *a: pytest.fail("relaunched"))
    (tmp_path / "o").mkdir()
    lock = lock_path(tmp_path / "o", JOBS.get(name, name))
    lock.parent.mkdir()
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, b"4242 elsewhere\n")
        argv = [x for kv in REQUIRED[name].items() for x in kv]
        got = run(script(name), argv, monkeypatch, capfd)
    finally:
        os.close(fd)
    assert got.code == 1
    job = JOBS.get(name, name)
    assert got.err == (
        f"error: o: another {job} job is writing here (pid 4242 on elsewhere, lock "
        f".locks/o.{job}.lock); stop it or let it finish, then rerun\n"
    )
