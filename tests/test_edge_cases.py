"""Edge cases, one table: result folders in the way, verifier files and folders of every kind
the README accepts (a folder, a local or packaged .gguf file, a hub id) in every wrong shape,
corrupt model files, empty or unreadable inputs, and settings that contradict each other or
the verifier. tests/test_bad_input.py holds the data errors; none is repeated here.

Every case must give
(a) exactly one ``error: ...`` line and no traceback,
(b) the file (and line) or the config key at fault,
(c) what to do about it,
(d) nothing final written.

A ``plan`` case runs what rules/common.smk runs when the workflow plans, before any job:
``preflight.output_path_problems`` on results/<run>, the input paths resolved, then
``preflight.planning_problems`` (the first problem is the line ``fail`` prints). A ``verifier``
case runs the verifier rule's script (scripts/verifier.py main, in-process). Cases marked
``process`` also run through a real, plain ``snakemake --configfile config.yaml --cores 2``
(no ``--workflow-profile none``: profiles/default is loaded as for a user, so a job's error
reaches the terminal through its log), all of them at once in one module fixture.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import tiny
import yaml
from conftest import assert_same_bytes, job_counts, run_snakemake
from test_bad_input import leftovers, one_error_line, run_main

from eagle3lib import preflight
from eagle3lib.config import config_errors, resolve_data_path
from eagle3lib.errors import UserError
from eagle3lib.fileio import sha256_file

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ROOT / "rules" / "schemas" / "config.schema.yaml"


@pytest.fixture(scope="module")
def gguf(verifier_dir, tmp_path_factory) -> Path:
    """The tiny verifier as a GGUF file (1.4 MB; tests/tiny.py build_gguf)."""
    return tiny.build_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf", verifier_dir)


class Env:
    """One case's working directory (``dir``), its config (``config``, the tiny one) and the
    folder a job would write into (``out``)."""

    def __init__(self, folder: Path, verifier_dir: Path, gguf: Path):
        self.dir = folder
        self.out = folder / "out"
        self.out.mkdir(parents=True)
        self.verifier_dir, self.gguf = verifier_dir, gguf
        self.samples: int | None = None  # what a current prepare made (samples.json)
        train = tiny.write_jsonl(folder / "train.jsonl", tiny.conversations(6, seed=3))
        evals = tiny.write_jsonl(folder / "eval.jsonl", [{"turns": ["Tell me more"]}])
        path = tiny.write_config(folder / "config.yaml", "t", verifier_dir, train, evals)
        self.config = yaml.safe_load(path.read_text())

    def set(self, dotted: str, value) -> None:
        section, key = dotted.split(".", 1)
        self.config.setdefault(section, {})[key] = value

    def model_copy(self, *, weights: bool = True) -> Path:
        folder = self.dir / "model"
        folder.mkdir()
        for f in self.verifier_dir.iterdir():
            if weights or f.suffix != ".safetensors":
                shutil.copy(f, folder / f.name)
        self.set("verifier.path", str(folder))
        return folder

    def write_config(self) -> Path:
        path = self.dir / "config.yaml"
        path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        return path

    def files(self) -> list[str]:
        """Every file under the working directory's results/ (what a case must not add to)."""
        results = self.dir / "results"
        return sorted(str(p) for p in results.rglob("*")) if results.is_dir() else []


def plan(env: Env) -> str:
    """rules/common.smk's checks on the case's config; the line its ``fail`` prints."""
    from snakemake.utils import validate

    config = copy.deepcopy(env.config)
    assert config_errors(config, SCHEMA) == []  # the cases are schema-valid
    validate(config, schema=str(SCHEMA), set_default=True)
    run_dir = env.dir / "results" / config["run"]
    problems = preflight.output_path_problems(run_dir)
    if problems:
        return f"error: {problems[0]}\n"
    try:
        train = resolve_data_path(config["data"]["train"]["path"], "data.train.path")
        specs = {"data.eval": config["data"]["eval"]}
        specs.update(
            {f"data.extra_eval[{i}]": e for i, e in enumerate(config["data"]["extra_eval"])}
        )
        sets = [
            {"key": k, "path": resolve_data_path(e["path"], f"{k}.path")} for k, e in specs.items()
        ]
    except UserError as exc:
        return f"error: {exc}\n"
    files = {"data.train.path": train, **{f"{s['key']}.path": s["path"] for s in sets}}
    problems, _ = preflight.planning_problems(
        config, run_dir / "verifier" / "verifier.json", files, sets, env.samples
    )
    assert problems, "no problem found"
    return f"error: {problems[0]}\n"


def run_verifier_script(env: Env, capfd, monkeypatch) -> str:
    """scripts/verifier.py as the verifier rule runs it; it must exit with status 1."""
    section = {"name": None, "trust_remote_code": False, "allow_pickle": False}
    section["path"] = env.config["verifier"]["path"]
    argv = ["--verifier", json.dumps(section), "--hf-dir", env.out / "hf"]
    return run_main("verifier", [*argv, "--out", env.out / "verifier.json"], capfd, monkeypatch)


# ---- the bad inputs --------------------------------------------------------------------------


def _results_file(relative: str):
    def setup(env):
        path = env.dir / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("not a folder\n")

    return setup


def _cut_gguf(keep: Callable[[int], int]):
    def setup(env):
        raw = env.gguf.read_bytes()
        (env.dir / "model.gguf").write_bytes(raw[: keep(len(raw))])
        env.set("verifier.path", str(env.dir / "model.gguf"))

    return setup


def _not_gguf(env):
    (env.dir / "model.gguf").write_text("I am a text file\n" * 10)
    env.set("verifier.path", str(env.dir / "model.gguf"))


def _gguf_folder(env):
    (env.dir / "model.gguf").mkdir()
    env.set("verifier.path", str(env.dir / "model.gguf"))


def _gguf_missing(env):
    env.set("verifier.path", str(env.dir / "missing.gguf"))


def _verifier_is_config_file(env):
    env.set("verifier.path", str(env.model_copy() / "config.json"))


def _folder_with_only_a_gguf(env):
    folder = env.dir / "model"
    folder.mkdir()
    shutil.copy(env.gguf, folder / "tiny.Q8_0.gguf")
    env.set("verifier.path", str(folder))


def _config_json(text: str):
    def setup(env):
        (env.model_copy() / "config.json").write_text(text)

    return setup


def _config_field(**fields):
    def setup(env):
        config_path = env.model_copy() / "config.json"
        config = json.loads(config_path.read_text())
        config.update(fields)
        config_path.write_text(json.dumps(config))

    return setup


def _set(**dotted):
    def setup(env):
        for key, value in dotted.items():
            env.set(key.replace("__", "."), value)

    return setup


def _eval_file(text: str, key: str = "eval"):
    def setup(env):
        path = env.dir / f"{key}.jsonl"
        path.write_text(text)
        if key == "eval":
            env.config["data"]["eval"]["path"] = str(path)
        else:
            env.config["data"]["extra_eval"] = [{"name": key, "path": str(path)}]

    return setup


def _empty_train(env):
    (env.dir / "train.jsonl").write_text("")


def _train_folder(env):
    (env.dir / "conversations").mkdir()
    env.config["data"]["train"]["path"] = str(env.dir / "conversations")


def _eval_fifo(env):
    os.mkfifo(env.dir / "prompts.fifo")  # reading it would block until a writer came
    env.config["data"]["eval"]["path"] = str(env.dir / "prompts.fifo")


def _prepared(samples: int):
    def setup(env):
        env.set("extract.shards", 1)
        env.samples = samples

    return setup


def _shards_for_prepared(env):
    env.set("extract.shards", 4)
    env.samples = 3


def _truncated_safetensors(env):
    weights = env.model_copy() / "model.safetensors"
    raw = weights.read_bytes()
    weights.write_bytes(raw[: len(raw) - 4096])


def _index_names_missing_file(env):
    folder = env.model_copy()
    index = {"metadata": {}, "weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def _tokenizer_files(**files: str | None):
    """The verifier folder's tokenizer files replaced by ``files`` (None: removed)."""

    def setup(env):
        folder = env.model_copy()
        for name, text in files.items():
            path = folder / name.replace("__", ".")
            path.unlink() if text is None else path.write_text(text)

    return setup


def _serve_check(**dotted):
    def setup(env):
        env.set("serve_check.enabled", True)
        env.set("vllm.python", sys.executable)
        _set(**dotted)(env)

    return setup


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    setup: Callable[[Env], None]  # breaks one thing
    where: str  # file[:line] or config key; {dir} is the case's working directory
    remedy: str
    stage: str = "plan"  # "plan" (rules/common.smk) or "verifier" (the verifier job)
    process: bool = False  # also through a real plain snakemake process


GGUF_REMEDY = "download or convert the file again"
CONTEXT = "max_position_embeddings 2048"

CASES = [
    # -- result folders
    Case("run-folder-is-a-file", _results_file("results/t"),
         "results/t: a file is where the run's folder should be",
         "move or delete it, or choose another run name (config key run)", process=True),
    Case("results-folder-is-a-file", _results_file("results"),
         "results: a file is where a folder of", "move or delete it"),
    Case("stage-folder-is-a-file", _results_file("results/t/checkpoint"),
         "results/t/checkpoint: a file is where the run writes a folder", "move or delete it"),
    # -- verifier.path: local GGUF files and folders of every wrong shape
    Case("local-gguf-missing", _gguf_missing,
         "config key verifier.path: '{dir}/missing.gguf' does not exist", "fix the path"),
    Case("local-gguf-truncated-in-its-tensors", _cut_gguf(lambda n: n - 1000),
         "{dir}/model.gguf: truncated GGUF file: its tensors end at byte", GGUF_REMEDY,
         process=True),
    Case("local-gguf-cut-in-its-header", _cut_gguf(lambda n: 300),
         "{dir}/model.gguf: truncated GGUF file: it ends inside its header", GGUF_REMEDY),
    Case("local-gguf-is-not-gguf", _not_gguf, "{dir}/model.gguf: not a GGUF file",
         "point verifier.path at a .gguf model file"),
    Case("local-gguf-path-is-a-folder", _gguf_folder,
         "config key verifier.path: '{dir}/model.gguf' is a folder, not a GGUF file",
         "fix the path"),
    Case("verifier-path-is-a-plain-file", _verifier_is_config_file,
         "config key verifier.path: '{dir}/model/config.json' is a file, not a model folder",
         "point it at the folder that holds the model's config.json, or at a .gguf file"),
    Case("verifier-folder-holds-only-a-gguf", _folder_with_only_a_gguf,
         "config key verifier.path: '{dir}/model' is not a model folder (no config.json)",
         "it holds tiny.Q8_0.gguf: point verifier.path at that file"),
    Case("verifier-config-is-not-a-model-config", _config_json('{"tokenizer_class": "X"}'),
         "{dir}/model/config.json: not a model's config (no model_type)",
         "point verifier.path at the model's own folder", process=True),
    Case("verifier-config-is-a-json-array", _config_json("[1, 2]"),
         "{dir}/model/config.json: not a JSON object", "fix or replace its config.json"),
    Case("verifier-config-field-of-the-wrong-type", _config_field(num_hidden_layers="eight"),
         "{dir}/model/config.json: not a valid model config", "fix or replace its config.json",
         stage="verifier"),
    Case("verifier-config-unknown-model-type", _config_field(model_type="no-such-model"),
         "{dir}/model/config.json: not a valid model config", "fix or replace its config.json",
         stage="verifier"),
    Case("verifier-weights-truncated", _truncated_safetensors,
         "{dir}/model/model.safetensors: truncated or corrupt safetensors file",
         "download or copy the model again", stage="verifier", process=True),
    Case("verifier-index-names-a-missing-file", _index_names_missing_file,
         "{dir}/model/model.safetensors.index.json: names 1 missing weight file(s)",
         "copy the model folder again", stage="verifier"),
    Case("verifier-without-tokenizer-files",
         _tokenizer_files(tokenizer__json=None, tokenizer_config__json=None),
         "verifier '{dir}/model': its tokenizer does not load",
         "its folder needs the tokenizer files of its model", stage="verifier", process=True),
    Case("verifier-tokenizer-json-cut-short", _tokenizer_files(tokenizer__json='{"version": "1.0", "trunc'),
         "verifier '{dir}/model': its tokenizer does not load",
         "its folder needs the tokenizer files of its model", stage="verifier"),
    Case("verifier-without-a-chat-template", _tokenizer_files(chat_template__jinja=None),
         "verifier '{dir}/model': the verifier's tokenizer has no chat template",
         "add chat_template.jinja to its folder", stage="verifier"),
    Case("verifier-chat-template-does-not-parse",
         _tokenizer_files(chat_template__jinja="{% for m in messages %}{{ m.content "),
         "verifier '{dir}/model': the verifier's chat template does not parse",
         "fix chat_template.jinja", stage="verifier"),
    Case("local-gguf-truncated-reaching-the-verifier-job", _cut_gguf(lambda n: n // 2),
         "{dir}/model.gguf: truncated GGUF file", GGUF_REMEDY, stage="verifier"),
    # -- settings against the verifier (its config.json / GGUF header), before any job
    Case("aux-layer-beyond-the-verifier", _set(extract__aux_layers=[2, 4, 8]),
         "config key extract.aux_layers: layer id(s) [8] out of range [0, 7]",
         "use ids from 0 to 7"),
    Case("verifier-without-decoder-layers", _config_field(num_hidden_layers=0),
         "the verifier has num_hidden_layers 0", "fix num_hidden_layers in its config"),
    Case("default-aux-layers-of-a-2-layer-verifier", _config_field(num_hidden_layers=2),
         "config key extract.aux_layers: the default [2, 1, -1] is invalid",
         "set extract.aux_layers to distinct ids in [0, 1]"),
    Case("draft-vocab-beyond-the-gguf-vocab",
         lambda env: (_gguf_as_verifier(env), env.set("train.draft_vocab_size", 1000)),
         "config key train.draft_vocab_size: 1000 is larger than the verifier vocab (400)",
         "use at most 400"),
    Case("draft-vocab-beyond-the-verifier-vocab", _set(train__draft_vocab_size=100000),
         "config key train.draft_vocab_size: 100000 is larger than the verifier vocab (400)",
         "use at most 400", process=True),
    Case("max-length-beyond-the-context", _set(data__max_length=4096),
         "config key data.max_length: 4096 is longer than the verifier's context", "use at most 2048"),
    Case("eval-new-tokens-fill-the-context", _set(evaluate__max_new_tokens=2048),
         "config key evaluate.max_new_tokens: 2048 new tokens leave no room for the prompt",
         "use fewer than 2048"),
    Case("regenerate-new-tokens-fill-the-context",
         _set(regenerate__enabled=True, regenerate__max_new_tokens=5000),
         "config key regenerate.max_new_tokens: 5000 new tokens", "use fewer than 2048"),
    Case("vllm-max-model-len-beyond-the-context", _serve_check(vllm__max_model_len=4096),
         "config key vllm.max_model_len: 4096 is longer than the verifier's context",
         "use at most 2048, or null"),
    # -- settings against each other
    Case("k-beyond-max-new-tokens", _set(evaluate__k=[3, 8], evaluate__max_new_tokens=4),
         "config key evaluate.k: k = 8 proposes more tokens per step than",
         "use k of at most 4, or raise evaluate.max_new_tokens", process=True),
    Case("full-attention-layer-beyond-the-draft", _set(train__full_attention_layers=[1]),
         "config key train.full_attention_layers: layer id(s) [1] out of range",
         "use ids from 0 to 0, or raise train.num_layers"),
    Case("more-shards-than-max-samples",
         _set(extract__shards=4, data__train={"path": "PLACEHOLDER", "max_samples": 3}),
         "config key extract.shards: 4 shards for at most 3 samples", "use at most 3 shards"),
    Case("more-shards-than-the-training-files-max-samples",
         _set(extract__shards=6, data__train={"path": "PLACEHOLDER", "max_samples": 3},
              data__extra_train=[{"path": "PLACEHOLDER", "max_samples": 2}]),
         "config key extract.shards: 6 shards for at most 5 samples (data.train.max_samples "
         "and data.extra_train's)", "use at most 5 shards", process=True),
    Case("more-shards-than-prepared-samples", _shards_for_prepared,
         "config key extract.shards: 4 shards for the 3 samples prepare made",
         "use at most 3 shards"),
    Case("flex-attention-on-a-cpu-train-job", _set(train__attention="simple_flex_attention"),
         "config key train.attention: flex attention has no backward pass on CPU",
         "use sdpa or eager"),
    Case("fused-loss-on-a-cpu-train-job", _set(train__loss="fused"),
         "config key train.loss: the fused loss needs a GPU", "use eager or auto"),
    Case("flex-attention-block-size-on-a-gpu", _set(train__gpus=1, train__total_seq_len=200),
         "config key train.total_seq_len: 200 is not a multiple of 128", "use e.g. 256"),
    Case("regenerate-workers-share-gpus-unevenly",
         _set(regenerate__enabled=True, regenerate__gpus=3, regenerate__workers=2),
         "config key regenerate.workers: 2 workers cannot share 3 GPU(s) evenly",
         "make regenerate.gpus a multiple of regenerate.workers"),
    Case("synthetic-prompts-with-regenerate-workers",
         _set(regenerate__enabled=True, regenerate__gpus=2, regenerate__workers=2,
              regenerate__synthetic_prompts=100),
         "config key regenerate.synthetic_prompts: prompts are sampled once, by one process, "
         "not by 2 regenerate.workers", "set regenerate.workers: 1"),
    Case("extract-jobs-sharing-a-gpu-with-vllm",
         _set(extract__backend="vllm", extract__gpus_per_job=1, extract__jobs_per_gpu=2),
         "config key extract.jobs_per_gpu: 2 jobs per GPU need extract.backend: hf",
         "set it to 1"),
    # -- input files
    Case("eval-prompt-empty", _eval_file('{"turns": ["  "]}\n'), "{dir}/eval.jsonl:1: empty prompt",
         "write the prompt or remove the line", process=True),
    Case("eval-file-of-blank-lines", _eval_file("\n\n"),
         "{dir}/eval.jsonl: no evaluation prompts found", "add prompt records"),
    Case("eval-record-not-an-object", _eval_file('{"turns": ["hi"]}\n[1, 2]\n'),
         "{dir}/eval.jsonl:2: a prompt record must be a JSON object", "fix or remove the line"),
    Case("eval-turns-a-string", _eval_file('{"turns": "Tell me more"}\n'),
         "{dir}/eval.jsonl:1: 'turns' is \"Tell me more\", not a list of strings",
         "fix or remove the line"),
    Case("eval-turns-empty", _eval_file('{"turns": ["hi"]}\n{"turns": []}\n'),
         "{dir}/eval.jsonl:2: 'turns' is [], not a list of strings", "fix or remove the line"),
    Case("eval-prompt-a-number", _eval_file('{"prompt": 5}\n'),
         "{dir}/eval.jsonl:1: 'prompt' is 5, not a string", "fix or remove the line"),
    Case("eval-jsonl-holding-a-json-array", _eval_file('[{"turns": ["hi"]},\n{"turns": ["ho"]}]\n'),
         "{dir}/eval.jsonl:1: invalid JSON", "goes in a .json file, not .jsonl: rename it"),
    Case("eval-jsonl-holding-a-one-line-array", _eval_file('[{"turns": ["hi"]}]\n'),
         "{dir}/eval.jsonl:1: a JSON array in a .jsonl file", "goes in a .json file: rename it"),
    Case("eval-line-nested-too-deeply", _eval_file("[" * 100000 + "]" * 100000 + "\n"),
         "{dir}/eval.jsonl:1: JSON nested too deeply to read", "fix or remove the line"),
    Case("extra-eval-prompt-empty", _eval_file('{"prompt": "def f():"}\n{"prompt": ""}\n', "extra"),
         "{dir}/extra.jsonl:2: empty prompt", "(config key data.extra_eval[0].path)"),
    Case("train-file-empty", _empty_train,
         "config key data.train.path: file '{dir}/train.jsonl' is empty",
         "point data.train.path at a file of records"),
    Case("train-path-is-a-folder", _train_folder,
         "config key data.train.path: '{dir}/conversations' is a folder, not a file",
         "point data.train.path at a JSON or JSONL file"),
    Case("eval-path-is-a-fifo", _eval_fifo,
         "config key data.eval.path: '{dir}/prompts.fifo' is not a regular file",
         "point it at a JSON or JSONL file"),
    # Catches: M38 (samples < 2 -> samples < 1), M39 (the "fewer than 2 samples" check removed)
    Case("one-prepared-sample", _prepared(1),
         "data.train.path: prepare made 1 training sample(s), training needs at least 2",
         "add conversations or raise data.train.max_samples"),
    # Catches: M44 (% 128 -> % 64: 192 is a multiple of 64, not of 128)
    Case("flex-attention-block-size-a-multiple-of-64", _set(train__gpus=1, train__total_seq_len=192),
         "config key train.total_seq_len: 192 is not a multiple of 128", "use e.g. 256"),
    # Catches: M63 (extract.backend: vllm no longer counts as running vLLM), M49 (jobs_per_gpu
    # 1 with vllm refused)
    Case("vllm-max-model-len-beyond-the-context-for-extract",
         _set(extract__backend="vllm", extract__gpus_per_job=1, vllm__max_model_len=4096),
         "config key vllm.max_model_len: 4096 is longer than the verifier's context",
         "use at most 2048, or null"),
]  # fmt: skip


def _gguf_as_verifier(env):
    shutil.copy(env.gguf, env.dir / "tiny.gguf")
    env.set("verifier.path", str(env.dir / "tiny.gguf"))


def setup_case(case: Case, folder: Path, verifier_dir: Path, gguf: Path) -> Env:
    env = Env(folder, verifier_dir, gguf)
    case.setup(env)
    for train in [env.config["data"]["train"], *env.config["data"].get("extra_train", [])]:
        if train.get("path") == "PLACEHOLDER":
            train["path"] = str(env.dir / "train.jsonl")
    env.write_config()
    return env


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_edge_case(case, tmp_path, verifier_dir, gguf, capfd, monkeypatch):
    env = setup_case(case, tmp_path, verifier_dir, gguf)
    before = env.files()
    run = plan if case.stage == "plan" else lambda e: run_verifier_script(e, capfd, monkeypatch)
    err = run(env)
    line = one_error_line(err)  # (a)
    where = case.where.format(dir=env.dir)
    assert where in line, f"(b) {where!r} not named in {line!r}"
    assert case.remedy in line, f"(c) no remedy {case.remedy!r} in {line!r}"
    assert line.index(where) < line.index(case.remedy)
    assert env.files() == before and leftovers(env.out) == [], "(d) something was written"


def test_the_table_is_large_and_distinct():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)) and len(ids) >= 20
    assert sum(c.process for c in CASES) >= 5


# ---- the same cases through a real plain `snakemake` ------------------------------------------


PROCESS_CASES = [c for c in CASES if c.process]


@pytest.fixture(scope="module")
def plain_runs(tmp_path_factory, verifier_dir, gguf):
    """{case id: (env, finished process)}: `snakemake --configfile config.yaml --cores 2` in
    each case's working directory, all started at once (planning failures take seconds each;
    the one job failure, the verifier's, its import of transformers)."""
    env_vars = dict(os.environ)
    env_vars["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env_vars.get('PATH', '')}"
    started = {}
    for case in PROCESS_CASES:
        env = setup_case(case, tmp_path_factory.mktemp(case.id), verifier_dir, gguf)
        cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(ROOT / "Snakefile")]
        cmd += ["--configfile", "config.yaml", "--cores", "2"]
        proc = subprocess.Popen(
            cmd, cwd=env.dir, env=env_vars, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        started[case.id] = (env, env.files(), proc)
    runs = {}
    for case_id, (env, before, proc) in started.items():
        out, _ = proc.communicate(timeout=300)
        runs[case_id] = (env, before, proc.returncode, out)
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("case", PROCESS_CASES, ids=[c.id for c in PROCESS_CASES])
def test_edge_case_through_plain_snakemake(case, plain_runs):
    env, before, returncode, terminal = plain_runs[case.id]
    assert returncode != 0, terminal
    assert "Using workflow specific profile" in terminal  # profiles/default, as for a user
    line = one_error_line_anywhere(terminal)  # (a) on the terminal, as the user sees it
    where = case.where.format(dir=env.dir)
    assert where in line and case.remedy in line, (where, case.remedy, line)
    run = env.dir / "results" / "t"
    written = [
        p for p in env.files()
        if p not in before and Path(p).is_file() and not _job_bookkeeping(run, Path(p))
    ]  # fmt: skip
    assert written == [], f"(d) {written}"


def _job_bookkeeping(run: Path, path: Path) -> bool:
    """A failed job's log, its writer lock and benchmark: records of the attempt, not results."""
    return path.parent in (run / "logs", run / ".locks", run / "benchmarks")


def one_error_line_anywhere(terminal: str) -> str:
    """The one ``error:`` line of a snakemake run's terminal output (Snakemake's own lines
    around it, the failed job's log between its ``====`` rulers)."""
    assert "Traceback" not in terminal, terminal
    errors = [line for line in terminal.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, terminal
    return errors[0]


# ---- the good case: a local .gguf file as verifier.path --------------------------------------


def test_a_local_gguf_is_converted_and_identified_by_its_content(
    gguf, verifier_model, tokenizer, tmp_path
):
    """A local GGUF file is checked whole, hashed and converted (as a packaged one) into an HF
    folder that computes what the model it was written from computes; planning reads the same
    facts from its header as the record holds."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle3lib.verifier import materialize

    record = materialize(str(gguf), None, tmp_path / "hf")
    assert record["kind"] == "gguf" and record["load_path"] == str(tmp_path / "hf")
    assert record["name"] == "tiny-llama"
    assert record["gguf"] == {
        "file": gguf.name,
        "bytes": gguf.stat().st_size,
        "sha256": sha256_file(gguf),
    }
    facts = preflight.verifier_facts(str(gguf), tmp_path / "no-record.json")
    assert facts == preflight.VerifierFacts(str(gguf), 8, 64, 400, 2048)
    assert facts == preflight.facts_from_record(record, str(gguf))
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    ids = torch.tensor([tokenizer.encode("Tell me about the draft model")])
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, verifier_model(ids).logits)
    assert AutoTokenizer.from_pretrained(tmp_path / "hf").encode("a draft") == tokenizer.encode(
        "a draft"
    )


def test_gguf_conversion_parses_the_file_once_and_writes_the_same_bytes(
    gguf, tmp_path, monkeypatch
):
    """transformers reads a GGUF file three times (tokenizer, config, weights); the conversion
    shares one parse and writes exactly what three parses write."""
    import contextlib

    import gguf as gguf_lib

    from eagle3lib import verifier

    parsed = []

    class Counting(gguf_lib.GGUFReader):
        def __init__(self, path, mode="r"):
            parsed.append(Path(path).name)
            super().__init__(path, mode)

    monkeypatch.setattr(gguf_lib, "GGUFReader", Counting)
    verifier.convert_gguf(gguf, tmp_path / "once")
    assert parsed == [gguf.name] and gguf_lib.GGUFReader is Counting  # restored after
    monkeypatch.setattr(verifier, "gguf_parsed_once", contextlib.nullcontext)
    verifier.convert_gguf(gguf, tmp_path / "thrice")
    assert len(parsed) == 4
    files = sorted(p.name for p in (tmp_path / "once").iterdir())
    assert "model.safetensors" in files and files == sorted(
        p.name for p in (tmp_path / "thrice").iterdir()
    )
    for name in files:
        assert_same_bytes(tmp_path / "once" / name, tmp_path / "thrice" / name)


@pytest.mark.slow
def test_a_local_gguf_verifier_in_the_workflow(gguf, tmp_path, tmp_path_factory):
    """verifier.path: models/tiny-llama.gguf (relative) in a real run: converted once under
    results/<run>/verifier/hf; a file with other content under the same name reruns it."""
    (tmp_path / "models").mkdir()
    shutil.copy2(gguf, tmp_path / "models" / "tiny-llama.gguf")
    env = Env(tmp_path, Path("models/tiny-llama.gguf"), gguf)
    config = env.write_config()
    target = "results/t/verifier/verifier.json"
    run_snakemake(tmp_path, config, target)
    record = json.loads((tmp_path / target).read_text())
    assert record["kind"] == "gguf" and record["load_path"] == "hf"  # inside the run folder
    assert (tmp_path / "results/t/verifier/hf/model.safetensors").is_file()
    assert record["gguf"]["sha256"] == sha256_file(tmp_path / "models" / "tiny-llama.gguf")
    assert "Nothing to be done" in run_snakemake(tmp_path, config, target, "-n").stdout
    other = tiny.build_verifier(tmp_path_factory.mktemp("other") / "tiny-llama", seed=1)
    tiny.build_gguf(tmp_path / "models" / "tiny-llama.gguf", other)
    plan = run_snakemake(tmp_path, config, target, "-n")
    assert job_counts(plan.stdout) == {"verifier": 1}


def test_the_venvs_snakemake_runs_its_jobs_with_the_venv_unactivated(tmp_path, verifier_dir):
    """`.venv/bin/snakemake ...` as README shows it, with .venv not on PATH (not activated):
    the jobs' `python` is the interpreter running snakemake, not the first one on PATH (whose
    packages lack transformers here)."""
    env = Env(tmp_path, verifier_dir, verifier_dir)
    config = env.write_config()
    clean = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    clean["PATH"] = os.pathsep.join(["/usr/local/bin", "/usr/bin", "/bin"])
    target = "results/t/verifier/verifier.json"
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "--snakefile", str(ROOT / "Snakefile"),
         "--directory", str(tmp_path), "--cores", "1", "--workflow-profile", "none",
         target, "--configfile", str(config)],
        env=clean, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / target).read_text())["num_hidden_layers"] == 8


def test_a_missing_vllm_interpreter_stops_a_run_before_its_first_job_and_a_dry_run_warns(
    tmp_path, verifier_dir
):
    """serve_check on and vllm.python naming no interpreter (.venv-vllm not made): a real run
    stops while planning with one line naming the key, the jobs that start vLLM and what to
    do, and runs no job (else it would fail at serve_check, after training); a dry run (a
    login node planning without vLLM) and a rule graph only warn."""
    env = Env(tmp_path, verifier_dir, verifier_dir)
    missing = tmp_path / "no-venv" / "bin" / "python"
    env.set("serve_check.enabled", True)
    env.set("vllm.python", str(missing))
    config = env.write_config()
    before = env.files()
    expected = (
        f"config key vllm.python: {missing} cannot run (no such file, or not executable), and "
        "the serve_check job starts vLLM with it; run `make envs` to make .venv-vllm, set "
        "vllm.python to the python of an environment with vLLM installed, or turn serve_check "
        "off (serve_check: {enabled: false})"
    )
    real = run_snakemake(tmp_path, config, check=False)
    assert real.returncode == 1 and one_error_line(real.stderr) == f"error: {expected}"
    assert env.files() == before and not (tmp_path / "results").exists()
    dry = run_snakemake(tmp_path, config, "-n")
    assert dry.stderr.splitlines().count(f"warning: {expected}") == 1
    assert {"verifier", "train", "serve_check"} <= set(job_counts(dry.stdout))
    graph = run_snakemake(tmp_path, config, "--rulegraph", "mermaid-js")  # runs no job either
    assert f"warning: {expected}" in graph.stderr.splitlines() and "serve_check" in graph.stdout
    assert env.files() == before


def test_the_vllm_interpreter_is_checked_only_for_a_job_that_starts_vllm(tmp_path, monkeypatch):
    """vllm_python_problems: nothing for a job that does not start vLLM (an hf regeneration or
    extraction, serve_check off); a vllm regeneration, a vllm extraction and serve_check each
    get their own remedy; a found interpreter (a path relative to the working folder, or a
    name on PATH) is no problem; the default's line says it is make's environment."""
    off = {
        "extract": {"backend": "hf"},
        "regenerate": {"enabled": False, "backend": "vllm"},
        "serve_check": {"enabled": False},
        "vllm": {"python": None},
    }
    for job in ("regenerate", "extract", "serve_check"):
        assert preflight.vllm_python_problems(off, "no/such/python", job) == []
    every = {
        "extract": {"backend": "vllm"},
        "regenerate": {"enabled": True, "backend": "vllm"},
        "serve_check": {"enabled": True},
        "vllm": {"python": None},
    }
    [line] = preflight.vllm_python_problems(every, "no/such/python", "extract")
    assert line == (
        "config key vllm.python (null: make's .venv-vllm): no/such/python cannot run (no such "
        "file, or not executable), and the extract job starts vLLM with it; run `make envs` to "
        "make .venv-vllm, set vllm.python to the python of an environment with vLLM installed, "
        "or use extract.backend: hf"
    )
    [line] = preflight.vllm_python_problems(every, "no/such/python", "regenerate")
    assert ", and the regenerate job starts vLLM with it; " in line
    assert line.endswith(", or use regenerate.backend: hf")
    monkeypatch.chdir(tmp_path)
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n")
    assert preflight.vllm_python_problems(every, "venv/bin/python", "serve_check") != []
    python.chmod(0o755)  # executable now
    assert preflight.vllm_python_problems(every, "venv/bin/python", "serve_check") == []
    monkeypatch.setenv("PATH", str(python.parent))
    assert preflight.vllm_python_problems(every, "python", "serve_check") == []


def test_weights_lacking_a_tensor_of_the_model_stop_the_job_that_loads_it(tmp_path, verifier_dir):
    """A weight file without one of the model's tensors (or with other tensor names):
    transformers would leave those tensors random and the run would extract the states of
    another model; loading the verifier stops with one line instead."""
    import torch

    from eagle3lib.verifier import load_model, materialize

    folder = tmp_path / "model"
    shutil.copytree(verifier_dir, folder)
    record = materialize(str(folder), None, tmp_path / "hf")
    assert load_model(record, torch.float32).config.num_hidden_layers == 8  # intact: loads
    tiny.edit_weights(folder, drop=("model.layers.3.self_attn.q_proj.weight",))
    with pytest.raises(UserError) as refused:
        load_model(materialize(str(folder), None, tmp_path / "hf"), torch.float32)
    assert str(refused.value) == (
        f"verifier {str(folder)!r}: its weight files lack 1 of the model's tensors "
        "(model.layers.3.self_attn.q_proj.weight); check that they belong to its config.json "
        "(model type, layer count, tensor names)"
    )


@pytest.mark.parametrize("text", ['{"problems": [], "acceptance_le', "\xff\xfe", "[" * 100000])
def test_a_damaged_json_file_of_the_workflow_stops_with_one_line(
    text, tmp_path, capfd, monkeypatch
):
    """A JSON file the workflow wrote, cut short, not UTF-8 or nested beyond the parser's
    depth: the job reading it (here validate, on reports/summary.json) names it and says to
    delete it, and writes nothing."""
    summary = tmp_path / "summary.json"
    summary.write_bytes(text.encode("latin-1"))
    out = tmp_path / "out" / "validation.txt"
    err = run_main("validate", ["--summary", summary, "--out", out], capfd, monkeypatch)
    line = one_error_line(err)
    assert line.startswith(f"error: {summary}: not valid JSON (")
    assert line.endswith("delete it and rerun, snakemake makes it again")
    assert not out.exists()


def test_validate_judges_the_summary_again_not_only_its_list_of_problems(
    tmp_path, capfd, monkeypatch
):
    """A summary.json that lists no problem but holds an impossible acceptance length (edited
    by hand) fails validate; one that is not the report job's (a key missing) says so."""
    from test_report import summary

    path, out = tmp_path / "summary.json", tmp_path / "validation.txt"
    edited = {**summary(), "problems": [], "acceptance_length": 0.5, "k": 3}
    edited["acceptance"] = {**edited["acceptance"], "results": [], "acceptance_length": 0.5}
    path.write_text(json.dumps(edited))
    err = run_main("validate", ["--summary", path, "--out", out], capfd, monkeypatch)
    assert one_error_line(err) == (
        f"error: {path}: 1 problem(s): acceptance (mtbench k=3): acceptance length 0.5000 is "
        "outside [1, 4], which no decoding gives: acceptance.json was damaged or edited; rerun "
        "evaluate (-R evaluate)"
    )
    path.write_text(json.dumps({"problems": []}))
    err = run_main("validate", ["--summary", path, "--out", out], capfd, monkeypatch)
    assert one_error_line(err) == (
        f"error: {path}: not a summary the report job writes (no 'checkpoint'); delete it and "
        "rerun, snakemake makes it again"
    )
    assert not out.exists()


# ---- preflight's settings checks, called directly ---------------------------------------------

# config.yaml's verifier, SmolLM2-135M-Instruct: 30 layers, hidden 576, vocab 49152, context 8192
FACTS = preflight.VerifierFacts("model/config.json", 30, 576, 49152, 8192)


def settings(**dotted) -> dict:
    """config.yaml with ``dotted`` keys (section__key) set, schema-valid, defaults filled (as
    rules/common.smk hands it to preflight)."""
    from snakemake.utils import validate

    config = yaml.safe_load((ROOT / "config.yaml").read_text())
    for key, value in dotted.items():
        section, name = key.split("__", 1)
        config.setdefault(section, {})[name] = value
    assert config_errors(config, SCHEMA) == []
    validate(config, schema=str(SCHEMA), set_default=True)
    return config


# ---- settings at their limits are no problem ---------------------------------------------------

LIMITS = {
    # Catches: M31 (k <= max_new_tokens -> k < max_new_tokens)
    "k-equal-to-max-new-tokens": (dict(evaluate__k=[2, 4], evaluate__max_new_tokens=4), None),
    # Catches: M36 (shards > max_samples -> >=)
    "shards-equal-to-max-samples": (
        dict(extract__shards=3, data__train={"path": "t.jsonl", "max_samples": 3}), None),
    # Catches: M37 (shards > samples -> >=)
    "shards-equal-to-prepared-samples": (dict(extract__shards=2), 2),
    # Catches: M34 (an uncapped extra_train file taken as adding 0 samples)
    "an-uncapped-extra-train-file": (
        dict(extract__shards=4, data__train={"path": "t.jsonl", "max_samples": 3},
             data__extra_train=[{"path": "u.jsonl"}]), None),
    # Catches: M40 (train.gpus 1 taken for CPU training), M41 (fused loss refused on a GPU)
    "flex-attention-and-fused-loss-on-a-gpu": (
        dict(train__gpus=1, train__attention="simple_flex_attention", train__loss="fused"), None),
    # Catches: M42 (the 128-multiple demanded of CPU training, where auto is sdpa)
    "any-total-seq-len-on-a-cpu-train-job": (dict(train__total_seq_len=200), None),
    # Catches: M46 (regenerate's workers checked while it is off), M59 (its max_new_tokens
    # checked against the context while off), M64 (its vllm backend counted while off)
    "regenerate-off-ignores-its-settings": (
        dict(regenerate__gpus=3, regenerate__workers=2, regenerate__synthetic_prompts=100,
             regenerate__max_new_tokens=8192, regenerate__backend="vllm",
             vllm__max_model_len=16384, serve_check__enabled=False), None),
    # Catches: M47 (gpus % workers -> workers % gpus)
    "regenerate-workers-dividing-its-gpus": (
        dict(regenerate__enabled=True, regenerate__gpus=4, regenerate__workers=2), None),
    # Catches: M48 (workers > 1 -> >= 1 for synthetic prompts)
    "synthetic-prompts-with-one-worker": (
        dict(regenerate__enabled=True, regenerate__synthetic_prompts=100), None),
    # Catches: M49 (jobs_per_gpu == 1 or backend != vllm -> and), M61 (max_model_len equal to
    # the context refused)
    "vllm-extract-one-job-per-gpu-at-the-context": (
        dict(extract__backend="vllm", extract__gpus_per_job=1, vllm__max_model_len=8192), None),
    # Catches: M57 (draft_vocab_size equal to the vocab refused), M58 (max_length equal to the
    # context refused)
    "draft-vocab-and-max-length-equal-to-the-verifiers": (
        dict(train__draft_vocab_size=49152, data__max_length=8192,
             evaluate__max_new_tokens=8191), None),
}  # fmt: skip


@pytest.mark.parametrize("name", LIMITS)
def test_settings_at_their_limits_are_no_problem(name):
    dotted, samples = LIMITS[name]
    assert preflight.setting_problems(settings(**dotted), FACTS, samples) == []


# ---- the exact lines, where a table row only finds a part ------------------------------------

ERRORS = {
    # Catches: M54 (the "(verifier: <source>)" ending of a message about the verifier changed)
    "draft-vocab-one-beyond": (
        dict(train__draft_vocab_size=49153),
        "config key train.draft_vocab_size: 49153 is larger than the verifier vocab (49152); use "
        "at most 49152 (verifier: model/config.json)"),
    # Catches: M44 (exact message, with the resolved attention and the next multiple)
    "total-seq-len-192-on-a-gpu": (
        dict(train__gpus=1, train__total_seq_len=192),
        "config key train.total_seq_len: 192 is not a multiple of 128, which flex attention's "
        "block mask needs (train.attention: auto on a GPU); use e.g. 256, or train.attention: sdpa"),
    # Catches: M63 (extract.backend vllm alone runs vLLM), M49, M54
    "vllm-extract-beyond-the-context": (
        dict(extract__backend="vllm", extract__gpus_per_job=1, serve_check__enabled=False,
             vllm__max_model_len=16384),
        "config key vllm.max_model_len: 16384 is longer than the verifier's context "
        "(max_position_embeddings 8192), which vLLM refuses; use at most 8192, or null "
        "(verifier: model/config.json)"),
    # the regenerate job's vLLM server, regeneration on (the positive side of M64)
    "vllm-regenerate-beyond-the-context": (
        dict(regenerate__enabled=True, regenerate__backend="vllm", serve_check__enabled=False,
             vllm__max_model_len=16384),
        "config key vllm.max_model_len: 16384 is longer than the verifier's context "
        "(max_position_embeddings 8192), which vLLM refuses; use at most 8192, or null "
        "(verifier: model/config.json)"),
}  # fmt: skip


@pytest.mark.parametrize("name", ERRORS)
def test_a_setting_problem_is_one_exact_line(name):
    dotted, line = ERRORS[name]
    assert preflight.setting_problems(settings(**dotted), FACTS) == [line]


# Catches: M37, M38, M39 (exact line; the table row above checks it through plan)
def test_fewer_than_two_prepared_samples_is_a_problem():
    config = settings(extract__shards=1)
    assert preflight.setting_problems(config, None, samples=1) == [
        "data.train.path: prepare made 1 training sample(s), training needs at least 2; add "
        "conversations or raise data.train.max_samples"
    ]
    assert preflight.setting_problems(config, None, samples=2) == []


# ---- the verifier's facts ---------------------------------------------------------------------


# Catches: M01 (a bool taken for an int), M02 (text_config ignored), M03 (only the first name
# of each fact read), M04 (a missing fact read as 0, not unknown), M71/M72 (GPT-2 style names
# n_positions / n_layer dropped)
def test_facts_of_a_config_json_are_its_language_models_in_any_common_spelling():
    facts = preflight.facts_from_config
    gpt2 = {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "vocab_size": 50257,
            "n_positions": 1024}  # fmt: skip
    assert facts(gpt2, "c.json") == preflight.VerifierFacts("c.json", 12, 768, 50257, 1024)
    t5 = {"model_type": "t5", "num_layers": 6, "d_model": 512, "vocab_size": 32128,
          "max_seq_len": 512}  # fmt: skip
    assert facts(t5, "c.json") == preflight.VerifierFacts("c.json", 6, 512, 32128, 512)
    nested = {
        "model_type": "qwen3_vl",
        "vision_config": {"num_hidden_layers": 27, "hidden_size": 1152},
        "text_config": {"num_hidden_layers": 36, "hidden_size": 4096, "vocab_size": 151936,
                        "max_position_embeddings": 262144},
    }  # fmt: skip
    assert facts(nested, "c.json") == preflight.VerifierFacts("c.json", 36, 4096, 151936, 262144)
    odd = {"model_type": "x", "num_hidden_layers": True, "hidden_size": "64", "vocab_size": 4.0}
    assert facts(odd, "c.json") == preflight.VerifierFacts("c.json")  # nothing known


# Catches: M05 (a record's non-integer values taken as facts)
def test_facts_of_the_verifier_record_are_its_integers_only():
    record = {"kind": "hf", "num_hidden_layers": 8, "hidden_size": "64", "vocab_size": None,
              "max_position_embeddings": 2048}  # fmt: skip
    assert preflight.facts_from_record(record, "v.json") == preflight.VerifierFacts(
        "v.json", 8, None, None, 2048
    )


# Catches: M06 (verifier.json never read), M07 (a cut-short verifier.json raises instead of
# being passed over), M08 (a verifier.json holding a list raises instead)
def test_verifier_facts_read_the_record_first_and_past_a_damaged_one(tmp_path, verifier_dir):
    record = tmp_path / "verifier.json"
    record.write_text(json.dumps({"num_hidden_layers": 3, "hidden_size": 32, "vocab_size": 99,
                                  "max_position_embeddings": 512}))  # fmt: skip
    assert preflight.verifier_facts(str(verifier_dir), record) == preflight.VerifierFacts(
        str(record), 3, 32, 99, 512
    )
    from_config = preflight.VerifierFacts(str(verifier_dir / "config.json"), 8, 64, 400, 2048)
    for damaged in ('{"num_hidden_layers": 3, "hidd', "[1, 2]"):
        record.write_text(damaged)
        assert preflight.verifier_facts(str(verifier_dir), record) == from_config
    assert preflight.verifier_facts("org/model", tmp_path / "none.json") is None  # a hub id


# Catches: M67 (planning_problems returns no facts: the disk estimate of rules/common.smk,
# print_disk_estimate, then silently prints nothing)
def test_planning_returns_the_verifier_facts_it_read(tmp_path, verifier_dir):
    from snakemake.utils import validate

    config = copy.deepcopy(Env(tmp_path, verifier_dir, verifier_dir).config)
    validate(config, schema=str(SCHEMA), set_default=True)
    train, evals = Path(config["data"]["train"]["path"]), Path(config["data"]["eval"]["path"])
    problems, facts = preflight.planning_problems(
        config,
        tmp_path / "results" / "t" / "verifier" / "verifier.json",
        {"data.train.path": train, "data.eval.path": evals},
        [{"key": "data.eval", "path": evals}],
        6,
    )
    assert problems == []
    assert facts == preflight.VerifierFacts(str(verifier_dir / "config.json"), 8, 64, 400, 2048)


# ---- result folders and input files (the tests run as root here: os.access is faked) -----------


def _deny(monkeypatch, denied: set[Path], mode: int) -> None:
    """os.access in preflight answers False for ``denied`` paths asked for ``mode``."""
    real = os.access
    monkeypatch.setattr(
        preflight.os, "access", lambda p, m: not (Path(p) in denied and m & mode) and real(p, m)
    )


# Catches: M21 (R_OK asked instead of W_OK | X_OK), M22 (the run's existing stage folders not
# checked), M23 (the message's text)
def test_folders_this_user_cannot_write_stop_planning(tmp_path, monkeypatch):
    run_dir = tmp_path / "results" / "t"
    remedy = "make it writable, or run from a working directory where results/ can be written"
    _deny(monkeypatch, {tmp_path}, os.W_OK)
    assert preflight.output_path_problems(run_dir) == [  # the deepest folder that exists
        f"{tmp_path}: not writable by this user; {remedy}"
    ]
    monkeypatch.undo()
    (run_dir / "checkpoint").mkdir(parents=True)
    _deny(monkeypatch, {run_dir / "checkpoint"}, os.W_OK)
    assert preflight.output_path_problems(run_dir) == [
        f"{run_dir / 'checkpoint'}: not writable by this user; {remedy}"
    ]
    monkeypatch.undo()
    assert preflight.output_path_problems(run_dir) == []


# Catches: M15 (only a regular file counted as in the way: a FIFO is not a folder either)
def test_a_fifo_where_the_results_folder_should_be(tmp_path):
    os.mkfifo(tmp_path / "results")
    run_dir = tmp_path / "results" / "t"
    assert preflight.output_path_problems(run_dir) == [
        f"{tmp_path / 'results'}: a file is where a folder of {run_dir} should be; move or "
        "delete it, or choose another run name (config key run)"
    ]


# Catches: M24 (the readability check removed), M68 (its message's remedy), M69 (an unreadable
# empty file reported twice: elif -> if), M26 (a one-byte file taken for empty)
def test_an_unreadable_input_file_is_one_line_and_a_one_byte_file_is_not_empty(
    tmp_path, monkeypatch
):
    empty, one = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    empty.write_text("")
    one.write_text("x")
    assert preflight.input_file_problems({"data.eval.path": one}) == []
    _deny(monkeypatch, {empty}, os.R_OK)
    assert preflight.input_file_problems({"data.train.path": empty}) == [
        f"config key data.train.path: file '{empty}' is not readable; fix its permissions"
    ]


# ---- synthetic prompts are samples too --------------------------------------------------


# Catches: planning ignoring regenerate.synthetic_prompts. With regeneration and
# data.extra_train, prepare reads the regenerated file uncapped (rules/common.smk,
# prepare_section: max_samples None), which holds each file's max_samples conversations plus
# up to regenerate.synthetic_prompts synthetic ones; planning refused shards prepare fills.
def test_synthetic_prompts_count_towards_the_samples_the_shards_can_take():
    config = settings(
        data__train={"path": "t.jsonl", "max_samples": 3},
        data__extra_train=[{"path": "u.jsonl", "max_samples": 2}],
        regenerate__enabled=True,
        regenerate__synthetic_prompts=10,
        extract__shards=8,
    )
    assert preflight.setting_problems(config, None) == []  # up to 3 + 2 + 10 samples
    config["extract"]["shards"] = 16
    [line] = preflight.setting_problems(config, None)
    assert line.startswith("config key extract.shards: 16 shards for at most 15 samples")
    assert (
        "(data.train.max_samples and data.extra_train's and regenerate.synthetic_prompts)" in line
    )


# Catches: synthetic prompts counted only beside data.extra_train. Without extra files too,
# prepare reads the regenerated file whole once it holds synthetic prompts (prepare_section),
# so they add to data.train.max_samples; without them the cap stands.
def test_synthetic_prompts_add_to_data_train_alone_too():
    config = settings(
        data__train={"path": "t.jsonl", "max_samples": 3},
        regenerate__enabled=True,
        regenerate__synthetic_prompts=10,
        extract__shards=13,
    )
    assert preflight.setting_problems(config, None) == []  # up to 3 + 10 samples
    config["extract"]["shards"] = 14
    [line] = preflight.setting_problems(config, None)
    assert line.startswith(
        "config key extract.shards: 14 shards for at most 13 samples (data.train.max_samples "
        "and regenerate.synthetic_prompts)"
    )
    config["regenerate"]["synthetic_prompts"] = 0
    config["extract"]["shards"] = 4
    [line] = preflight.setting_problems(config, None)
    assert line.startswith("config key extract.shards: 4 shards for at most 3 samples (data.")
