"""Bad input, one table: every case runs the entry point a workflow rule runs (the script's
``main()`` in-process, or ``config_errors``/``resolve_data_path`` that rules/common.smk calls
while parsing the config) and must give

(a) exactly one stderr line ``error: ...`` and no traceback, with exit status 1,
(b) the file (and line) or the config key at fault,
(c) what to do about it,
(d) no partial artifact: the output folder holds no file at all (no temporary, no output).

The same cases through real ``snakemake`` live in tests/test_errors.py (slow); the table holds
other variants so that nothing is tested twice. A few cases also run a script as a real
subprocess to show the exit status and the one-line stderr a rule's log gets.
"""

from __future__ import annotations

import bz2
import dataclasses
import gzip
import importlib.util
import json
import lzma
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import tiny
import torch
import yaml

from eagle3lib import data, precision, shard_writer, shards, vocab
from eagle3lib.config import PrepareConfig, config_errors, resolve_data_path
from eagle3lib.errors import UserError
from eagle3lib.fileio import sha256_file, write_json
from eagle3lib.verifier import identity

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
SCHEMA = ROOT / "rules" / "schemas" / "config.schema.yaml"
AUX = [2, 4, 5]  # the default aux layers of the 8-layer tiny verifier

# ---- shared inputs ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world(tmp_path_factory, verifier_dir, verifier_record, tokenizer):
    """Good inputs of every stage, built once: the bad cases break one thing each."""
    base = tmp_path_factory.mktemp("bad_input")
    record = base / "verifier.json"
    write_json(record, verifier_record)
    evals = tiny.write_jsonl(base / "eval.jsonl", [{"question_id": 1, "turns": ["Tell me more"]}])
    train = tiny.write_jsonl(base / "train.jsonl", tiny.conversations(6, seed=3))
    prepared = data.prepare_samples(tokenizer, train, PrepareConfig(max_length=128))
    samples = base / "samples.safetensors"
    data.save_prepared(prepared, samples, verifier_record["vocab_size"])
    info = base / "samples.json"
    write_json(info, {**prepared.summary, "ids": prepared.ids})
    loaded = data.load_samples(samples)
    d2t, t2d = vocab.build(loaded.token_freq, 256)
    vocab_map = base / "vocab_map.safetensors"
    vocab.save(vocab_map, d2t, t2d)
    return SimpleNamespace(
        base=base,
        verifier_dir=verifier_dir,
        record=verifier_record,
        record_path=record,
        evals=evals,
        samples=samples,
        info=info,
        ids=prepared.ids,
        loaded=loaded,
        vocab_map=vocab_map,
        d2t=d2t,
        t2d=t2d,
    )


_SCRIPTS: dict[str, object] = {}


def load_script(name: str):
    """scripts/<name>.py as a module (its ``main`` is what the rule's shell command runs)."""
    if name not in _SCRIPTS:
        if str(SCRIPTS) not in sys.path:
            sys.path.append(str(SCRIPTS))  # for their `import _bootstrap`
        spec = importlib.util.spec_from_file_location(f"_script_{name}", SCRIPTS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _SCRIPTS[name] = module
    return _SCRIPTS[name]


def run_main(name: str, argv, capfd, monkeypatch) -> str:
    """Run scripts/<name>.py's main() in-process with ``argv``; it must exit with status 1.
    Returns everything written to stderr."""
    module = load_script(name)
    monkeypatch.setattr(sys, "argv", [str(SCRIPTS / f"{name}.py"), *map(str, argv)])
    capfd.readouterr()
    handler = signal.getsignal(signal.SIGTERM)  # errors.cli installs its own
    try:
        with pytest.raises(SystemExit) as exited:
            module.main()
    finally:
        signal.signal(signal.SIGTERM, handler)
    assert exited.value.code == 1
    return capfd.readouterr().err


class Env:
    """One case's folders (``inp`` for inputs, ``out`` for what the stage would write)."""

    def __init__(self, tmp: Path, world, capfd, monkeypatch):
        self.inp, self.out = tmp / "in", tmp / "out"
        self.inp.mkdir()
        self.out.mkdir()
        self.w = world
        self.capfd = capfd
        self.monkeypatch = monkeypatch

    def script(self, name: str, *argv) -> str:
        return run_main(name, argv, self.capfd, self.monkeypatch)

    def config(self, mutate: Callable[[dict], None]) -> str:
        """The workflow's config check (rules/common.smk: one ``error:`` line, then exit 1) on
        the tiny config after ``mutate``."""
        path = tiny.write_config(
            self.inp / "config.yaml", "t", self.w.verifier_dir, self.w.base, self.w.evals
        )
        config = yaml.safe_load(path.read_text())
        mutate(config)
        problems = config_errors(config, SCHEMA)
        assert len(problems) == 1, problems
        return f"error: {problems[0]}\n"

    # -- stage runners: the good arguments of each script, with some replaced ------------------

    def prepare(self, train: Path, *, record: Path | None = None, evals=None, **data_cfg) -> str:
        section = {
            "train": {"path": str(train), "allow_truncated_json": False, "max_samples": None},
            "eval": {"path": str(evals or self.w.evals)},
            "max_length": 128,
            "truncation": "truncate",
            "min_supervised_tokens": 1,
            "on_invalid_record": "error",
        }
        for key, value in data_cfg.items():
            section[key] = value
        return self.script(
            "prepare",
            "--verifier", record or self.w.record_path,
            "--train", train,
            "--eval", evals or self.w.evals,
            "--data", json.dumps(section),
            "--out-samples", self.out / "samples.safetensors",
            "--out-info", self.out / "samples.json",
        )  # fmt: skip

    def verifier(self, path: str, **section) -> str:
        spec = {"path": path, "name": None, "trust_remote_code": False, "allow_pickle": False}
        return self.script(
            "verifier",
            "--verifier", json.dumps({**spec, **section}),
            "--hf-dir", self.out / "hf",
            "--out", self.out / "verifier.json",
        )  # fmt: skip

    def vocab(self, samples: Path | None = None, draft_vocab_size: int = 256) -> str:
        return self.script(
            "vocab",
            "--samples", samples or self.w.samples,
            "--draft-vocab-size", draft_vocab_size,
            "--out-map", self.out / "vocab_map.safetensors",
            "--out-info", self.out / "vocab.json",
        )  # fmt: skip

    def extract(self, shard: int = 0, samples: Path | None = None, **extract_cfg) -> str:
        section = {"shards": 2, "batch_tokens": 512, "aux_layers": None, **extract_cfg}
        return self.script(
            "extract",
            "--verifier", self.w.record_path,
            "--samples", samples or self.w.samples,
            "--info", self.w.info,
            "--shard", shard,
            "--extract", json.dumps(section),
            "--out-shard", self.out / f"shard-{shard}.safetensors",
            "--out-manifest", self.out / f"shard-{shard}.json",
        )  # fmt: skip

    def shard(self, states=None, **manifest_overrides) -> tuple[Path, Path]:
        """A one-shard extraction result (shard + manifest) of the prepared samples, with
        ``states(i, n)`` as sample i's hidden states (default: finite random values)."""
        samples, n_layers, hidden = self.w.loaded, len(AUX) + 1, self.w.record["hidden_size"]
        lengths = tuple(int(n) for n in np.diff(samples.offsets))
        shard_path, manifest_path = self.inp / "shard-0.safetensors", self.inp / "shard-0.json"
        writer = shard_writer.ShardWriter(
            shard_path,
            shards.ShardLayout(lengths, n_layers, hidden),
            {"format": shards.SHARD_FORMAT},
        )
        gen = torch.Generator().manual_seed(0)
        for i, n in enumerate(lengths):
            s = states(i, n) if states else torch.randn(n, n_layers, hidden, generator=gen)
            writer.put_states(i, s)
        writer.close(samples.input_ids, samples.loss_mask)
        rejected = [
            {"id": self.w.ids[i], "reason": "non-finite hidden states"}
            for i in np.flatnonzero(shards.open_shard(shard_path).valid == 0).tolist()
        ]
        manifest = {
            "format": shards.SHARD_FORMAT,
            "shard": 0,
            "shards": 1,
            "sample_range": [0, len(lengths)],
            "sample_ids": self.w.ids,
            "token_counts": list(lengths),
            "tokens": int(sum(lengths)),
            "rejected": rejected,
            "verifier": identity(self.w.record),
            "layer_ids": [*AUX, self.w.record["num_hidden_layers"]],
            "hidden_size": hidden,
            "state_dtype": "bfloat16",
            "file": {
                "name": shard_path.name,
                "bytes": shard_path.stat().st_size,
                "sha256": sha256_file(shard_path),
            },
            **manifest_overrides,
        }
        write_json(manifest_path, manifest)
        return shard_path, manifest_path

    def train(self, shard: Path, manifest: Path, vocab_map: Path | None = None) -> str:
        cfg = {"epochs": 1, "total_seq_len": 256, "draft_vocab_size": 256, "optimizer": "adamw"}
        ckpt = self.out / "checkpoint"
        return self.script(
            "train",
            "--verifier", self.w.record_path,
            "--shards", shard,
            "--manifests", manifest,
            "--vocab-map", vocab_map or self.w.vocab_map,
            "--train", json.dumps(cfg),
            "--state-dir", self.out / "train" / "state",
            "--out-config", ckpt / "config.json",
            "--out-weights", ckpt / "model.safetensors",
            "--out-card", ckpt / "README.md",
            "--out-summary", self.out / "train" / "summary.json",
        )  # fmt: skip

    def checkpoint(self) -> Path:
        """An untrained draft checkpoint (config.json + model.safetensors) for the verifier."""
        from eagle3lib import train
        from eagle3lib.config import TrainConfig

        cfg = TrainConfig(draft_vocab_size=256, total_seq_len=256)
        model = train.build_draft(
            cfg, self.w.record, AUX, {"d2t": self.w.d2t, "t2d": self.w.t2d}, "sdpa"
        )
        ckpt = self.inp / "checkpoint"
        model.save_pretrained(str(ckpt))
        assert (ckpt / "config.json").is_file() and (ckpt / "model.safetensors").is_file()
        return ckpt

    def evaluate(self, ckpt: Path, evals: Path | None = None, **evaluate_cfg) -> str:
        manifest = self.inp / "shard-0.json"  # evaluate reads the layer ids only
        write_json(manifest, {"layer_ids": [*AUX, self.w.record["num_hidden_layers"]]})
        evals = evals or self.w.evals
        return self.script(
            "evaluate",
            "--verifier", self.w.record_path,
            "--config", ckpt / "config.json",
            "--manifest", manifest,
            "--eval-sets", json.dumps([{"name": "eval", "path": str(evals), "max_prompts": None}]),
            "--evaluate", json.dumps({"k": 2, "max_new_tokens": 4, **evaluate_cfg}),
            "--out", self.out / "acceptance.json",
        )  # fmt: skip

    def serve_check(self, **vllm_cfg) -> str:
        return self.script(
            "serve_check",
            "--verifier", self.w.record_path,
            "--config", self.inp / "checkpoint" / "config.json",
            "--prompts", self.w.evals,
            "--evaluate", json.dumps({"k": 2, "max_new_tokens": 4}),
            "--vllm", json.dumps(vllm_cfg),
            "--vllm-python", sys.executable,
            "--server-log", self.out / "server.log",
            "--out", self.out / "vllm_acceptance.json",
        )  # fmt: skip

    def tokenizer_record(self, template: str | None) -> Path:
        """A verifier record whose tokenizer has ``template`` as its chat template (or none)."""
        folder = self.inp / "tokenizer"
        tok = tiny.build_tokenizer(folder, template)
        for leftover in folder.glob("chat_template*"):
            if template is None:
                leftover.unlink()
        record = {**self.w.record, "load_path": str(folder), "vocab_size": len(tok)}
        path = self.inp / "verifier.json"
        write_json(path, record)
        return path


# ---- helpers for building bad files ---------------------------------------------------------


def good_lines(n: int = 2, fmt: str = "openai") -> list[str]:
    return [json.dumps(r) for r in tiny.conversations(n, seed=11, fmt=fmt)]


def jsonl(env: Env, *lines: str, name: str = "train.jsonl") -> Path:
    path = env.inp / name
    path.write_text("".join(line + "\n" for line in lines))
    return path


def json_array(env: Env, items: list[str], joiner: str = ",\n", name: str = "train.json") -> Path:
    """A JSON array file with one item per line, starting on line 2."""
    path = env.inp / name
    path.write_text("[\n" + joiner.join(items) + "\n]\n")
    return path


def record_with(*turns: dict) -> str:
    return json.dumps({"id": "bad", "messages": list(turns)})


USER = {"role": "user", "content": "What is a draft model?"}
ASSISTANT = {"role": "assistant", "content": "A small model that proposes tokens."}

# A template that renders user turns only: every loss mask is all zero.
NO_ASSISTANT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'assistant' %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endif %}{% endfor %}"
)
RAISING_TEMPLATE = "{{ raise_exception('Conversation roles must alternate user/assistant') }}"


def verifier_copy(env: Env, *, config: bool = True, weights: bool = True) -> Path:
    """The tiny verifier's folder, copied, optionally without config.json or weights."""
    folder = env.inp / "model"
    folder.mkdir()
    for f in env.w.verifier_dir.iterdir():
        if f.name == "config.json" and not config:
            continue
        if f.suffix == ".safetensors" and not weights:
            continue
        shutil.copy(f, folder / f.name)
    return folder


# ---- the cases -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    run: Callable[[Env], str]  # makes the bad input, runs the entry point, returns its stderr
    where: str  # file[:line] or config key; {inp} {out} {verifier} are filled in
    remedy: str  # what the message tells the user to do
    xfail: str | None = None  # a known gap in a module this suite's author does not own


def _array_bad_record(env):
    return env.prepare(json_array(env, [*good_lines(2), '{"messages": [}', good_lines(1)[0]]))


def _array_missing_comma(env):
    lines = good_lines(3)
    return env.prepare(json_array(env, [",\n".join(lines[:2]), lines[2]], joiner="\n"))


def _array_truncated(env):
    path = json_array(env, good_lines(3))
    text = path.read_text()
    path.write_text(text[: text.rindex('"content"') + 15])  # inside record 3, on line 4
    return env.prepare(path)


def _eval_bad_line(env):
    evals = jsonl(env, '{"turns": ["hi"]}', '{"turns": ["hi"', name="eval.jsonl")
    return env.prepare(env.w.base / "train.jsonl", evals=evals)


def _invalid_record(record: str):
    return lambda env: env.prepare(jsonl(env, *good_lines(2), record))


def _non_utf8(env):
    path = env.inp / "train.jsonl"
    bad = '{"messages": [{"role": "user", "content": "caf\xe9"}]}'.encode("latin-1")
    path.write_bytes((good_lines(1)[0] + "\n").encode() + bad + b"\n")
    return env.prepare(path)


def _gzip_not_gzip(env):
    path = env.inp / "train.jsonl.gz"
    path.write_text("\n".join(good_lines(2)) + "\n")
    return env.prepare(path)


def _gzip_truncated(env):
    path = env.inp / "train.jsonl.gz"
    packed = gzip.compress(("\n".join(good_lines(4)) + "\n").encode())
    path.write_bytes(packed[: len(packed) // 2])
    return env.prepare(path)


def _compressed(name: str, pack):
    def run(env):
        path = env.inp / name
        path.write_bytes(pack(("\n".join(good_lines(4)) + "\n").encode()))
        return env.prepare(path)

    return run


def _too_long_dropped(env):
    return env.prepare(jsonl(env, *good_lines(3)), max_length=8, truncation="drop")


def _prompt_fills_max_length(env):
    return env.prepare(jsonl(env, *good_lines(3)), max_length=8)


def _no_chat_template(env):
    return env.prepare(jsonl(env, *good_lines(2)), record=env.tokenizer_record(None))


def _template_masks_nothing(env):
    record = env.tokenizer_record(NO_ASSISTANT_TEMPLATE)
    return env.prepare(jsonl(env, *good_lines(3)), record=record)


def _template_raises(env):
    return env.prepare(jsonl(env, *good_lines(2)), record=env.tokenizer_record(RAISING_TEMPLATE))


def _train_file_missing(env):
    try:
        resolve_data_path(str(env.inp / "missing.jsonl"), "data.train.path")
    except UserError as exc:  # common.smk: fail(exc)
        return f"error: {exc}\n"
    raise AssertionError("no error")


def _verifier_without_config(env):
    return env.verifier(str(verifier_copy(env, config=False)))


def _verifier_pickle_only(env):
    folder = verifier_copy(env, weights=False)
    (folder / "pytorch_model.bin").write_bytes(b"not loaded: refused by file name")
    return env.verifier(str(folder))


def _verifier_custom_code(env):
    folder = verifier_copy(env)
    config = json.loads((folder / "config.json").read_text())
    config.update(
        model_type="my-custom-llm",
        auto_map={"AutoConfig": "configuration_custom.CustomConfig"},
    )
    (folder / "config.json").write_text(json.dumps(config))
    marker = env.inp / "custom-code-ran"
    (folder / "configuration_custom.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    err = env.verifier(str(folder))
    assert not marker.exists(), "the verifier's custom code was executed"
    return err


def _verifier_hub_offline(env):
    env.monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return env.verifier("no-such-org/no-such-model")


def _verifier_corrupt_config(env):
    folder = verifier_copy(env)
    (folder / "config.json").write_text('{"model_type": "llama",')
    return env.verifier(str(folder))


def _samples_truncated(env):
    cut = env.inp / "samples.safetensors"
    raw = env.w.samples.read_bytes()
    cut.write_bytes(raw[: len(raw) - 40])
    return env.vocab(samples=cut)


def _vocab_map_truncated(env):
    shard, manifest = env.shard()
    cut = env.inp / "vocab_map.safetensors"
    raw = env.w.vocab_map.read_bytes()
    cut.write_bytes(raw[: len(raw) // 2])
    return env.train(shard, manifest, vocab_map=cut)


def _shard_truncated(env):
    shard, manifest = env.shard()
    raw = shard.read_bytes()
    shard.write_bytes(raw[:-64])
    return env.train(shard, manifest)


def _nan_states(env):
    return env.train(*env.shard(states=lambda i, n: torch.full((n, len(AUX) + 1, 64), np.nan)))


def _checkpoint_truncated(env):
    ckpt = env.checkpoint()
    weights = ckpt / "model.safetensors"
    raw = weights.read_bytes()
    weights.write_bytes(raw[: len(raw) - 1000])
    return env.evaluate(ckpt)


def _without_native_bf16(env):
    """This host's CPU as one without native bf16, whatever it has."""
    env.monkeypatch.setattr(precision, "cpu_native_bf16", lambda: False)
    return env


def _eval_prompt_past_the_context(env):
    evals = env.inp / "long.jsonl"
    long = " ".join(["the quick brown fox jumps over the lazy dog"] * 300)
    evals.write_text(
        json.dumps({"question_id": 1, "turns": ["Hi"]}) + "\n"
        + json.dumps({"question_id": 7, "turns": [long]}) + "\n"
    )  # fmt: skip
    return env.evaluate(env.checkpoint(), evals=evals)


def _checkpoint_config_missing(env):
    ckpt = env.inp / "checkpoint"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(b"")
    return env.evaluate(ckpt)


def _set(section: str, key: str, value):
    def mutate(config):
        config.setdefault(section, {})[key] = value

    return lambda env: env.config(mutate)


def _drop_verifier_path(env):
    return env.config(lambda c: c["verifier"].pop("path"))


def _nested_typo(env):
    return env.config(lambda c: c["data"]["train"].update(pathh="x.jsonl"))


ON_INVALID = "fix the record or set data.on_invalid_record: skip"
REDO_SHARDS = "delete results for this run's hidden states and rerun"

CASES = [
    # -- conversations (prepare) --
    Case("json-array-bad-record", _array_bad_record, "{inp}/train.json:4: invalid JSON",
         "fix the record"),
    Case("json-array-missing-comma", _array_missing_comma, "{inp}/train.json:4: invalid JSON",
         "add the missing comma"),
    Case("json-array-truncated", _array_truncated, "{inp}/train.json:4: the file ends inside",
         "set data.train.allow_truncated_json: true"),
    Case("eval-jsonl-bad-line", _eval_bad_line, "{inp}/eval.jsonl:2: invalid JSON",
         "fix or remove the line"),
    Case("record-not-an-object", _invalid_record("[1, 2]"),
         "{inp}/train.jsonl:3: record is not a JSON object", ON_INVALID),
    Case("record-without-conversations-or-messages", _invalid_record('{"text": "hi"}'),
         "{inp}/train.jsonl:3: record has neither 'conversations'", ON_INVALID),
    Case("unknown-role",
         _invalid_record(record_with(USER, {"role": "narrator", "content": "x"})),
         "{inp}/train.jsonl:3: unknown role", ON_INVALID),
    Case("empty-content", _invalid_record(record_with(USER, {**ASSISTANT, "content": " \n"})),
         "{inp}/train.jsonl:3: empty content", ON_INVALID),
    Case("turn-without-role", _invalid_record(record_with(USER, {"content": "orphan"})),
         "{inp}/train.jsonl:3: turn lacks role/content", ON_INVALID),
    Case("non-utf8-bytes", _non_utf8, "{inp}/train.jsonl:2: not valid UTF-8",
         "re-encode the file as UTF-8"),
    Case("gz-suffix-but-plain-text", _gzip_not_gzip, "{inp}/train.jsonl.gz: not a complete gzip",
         "re-compress it"),
    Case("gzip-truncated", _gzip_truncated, "{inp}/train.jsonl.gz: not a complete gzip",
         "re-compress it"),
    Case("bzip2-compressed", _compressed("train.jsonl.bz2", bz2.compress),
         "{inp}/train.jsonl.bz2: compressed with bzip2", "decompress it"),
    Case("xz-compressed", _compressed("train.jsonl.xz", lzma.compress),
         "{inp}/train.jsonl.xz: compressed with xz", "re-compress it with gzip"),
    Case("gzip-without-gz-suffix", _compressed("train.jsonl", gzip.compress),
         "{inp}/train.jsonl: compressed with gzip but not named .gz",
         "rename it to end in .gz"),
    Case("samples-longer-than-max-length", _too_long_dropped,
         "{inp}/train.jsonl: no usable training samples",
         "raise data.max_length or set data.truncation: truncate"),
    Case("prompts-fill-max-length", _prompt_fills_max_length,
         "{inp}/train.jsonl: no usable training samples", "raise data.max_length"),
    Case("tokenizer-without-chat-template", _no_chat_template,
         "{inp}/tokenizer: the verifier's tokenizer has no chat template",
         "add chat_template.jinja to its folder"),
    Case("template-masks-no-token", _template_masks_nothing,
         "{inp}/train.jsonl: no usable training samples",
         "use a template that renders assistant replies"),
    Case("template-raises", _template_raises, "{inp}/train.jsonl:1: chat template failed",
         ON_INVALID),
    Case("train-file-missing", _train_file_missing, "config key data.train.path",
         "fix the path"),
    # -- verifier --
    Case("verifier-folder-without-config", _verifier_without_config,
         "config key verifier.path: '{inp}/model' is not a model folder",
         "point it at a Hugging Face model folder"),
    Case("verifier-pickle-weights-only", _verifier_pickle_only,
         "verifier '{inp}/model' has only pickle weights (pytorch_model.bin)",
         "set verifier.allow_pickle: true"),
    Case("verifier-custom-code", _verifier_custom_code, "verifier '{inp}/model' ships custom code",
         "set verifier.trust_remote_code: true"),
    Case("verifier-hub-id-offline", _verifier_hub_offline,
         "config key verifier.path: cannot load 'no-such-org/no-such-model' (offline",
         "use a local model folder"),
    Case("verifier-config-not-json", _verifier_corrupt_config, "{inp}/model/config.json",
         "fix or replace its config.json"),
    # -- vocab --
    Case("draft-vocab-one-above-vocab",
         lambda env: env.vocab(draft_vocab_size=env.w.record["vocab_size"] + 1),
         "config key train.draft_vocab_size", "use at most"),
    Case("samples-artifact-truncated", _samples_truncated, "{inp}/samples.safetensors: unreadable",
         "delete it and rerun the prepare rule"),
    # -- hidden states (extract) --
    Case("aux-layers-duplicate", lambda env: env.extract(aux_layers=[2, 4, 4]),
         "config key extract.aux_layers: duplicate layer id(s) [4]", "list each layer once"),
    Case("aux-layers-negative", lambda env: env.extract(aux_layers=[-1, 2, 5]),
         "config key extract.aux_layers: negative layer id(s) [-1]", "use ids from 0"),
    Case("aux-layer-equals-depth", lambda env: env.extract(aux_layers=[0, 3, 8]),
         "config key extract.aux_layers: layer id(s) [8]", "out of range [0, 7]"),
    Case("more-shards-than-samples", lambda env: env.extract(shard=0, shards=7),
         "config key extract.shards", "use at most 6 shards"),
    Case("extract-bf16-on-a-cpu-without-bf16",
         lambda env: _without_native_bf16(env).extract(dtype="bfloat16"),
         "config key extract.dtype: bfloat16 on this CPU", "use auto or float32"),
    # -- shards and vocab map (train) --
    Case("manifest-hidden-size-differs", lambda env: env.train(*env.shard(hidden_size=4096)),
         "{inp}/shard-0.json: shard was extracted with hidden_size=4096", REDO_SHARDS),
    Case("manifest-verifier-differs",
         lambda env: env.train(*env.shard(verifier={**identity(env.w.record), "name": "other"})),
         "{inp}/shard-0.json: shard was extracted with verifier=", REDO_SHARDS),
    Case("shard-truncated", _shard_truncated, "{inp}/shard-0.safetensors",
         "rerun the workflow"),
    Case("vocab-map-truncated", _vocab_map_truncated, "{inp}/vocab_map.safetensors: unreadable",
         "delete it and rerun the vocab rule"),
    Case("nan-hidden-states-everywhere", _nan_states, "{inp}/shard-0.json",
         "extract in higher precision"),
    # -- checkpoint (evaluate) --
    Case("checkpoint-truncated", _checkpoint_truncated,
         "{inp}/checkpoint/model.safetensors: unreadable checkpoint weights",
         "rerun the workflow to retrain it"),
    Case("checkpoint-config-missing", _checkpoint_config_missing,
         "{inp}/checkpoint/config.json: unreadable checkpoint config",
         "rerun the workflow to retrain it"),
    Case("eval-prompt-past-the-verifiers-context", _eval_prompt_past_the_context,
         "{inp}/long.jsonl: the prompt with id '7' is",
         "passes the verifier's context of 2048 positions; shorten or remove the prompt"),
    Case("vllm-bf16-on-a-cpu-without-bf16",
         lambda env: _without_native_bf16(env).serve_check(dtype="bfloat16"),
         "config key vllm.dtype: bfloat16 on this CPU", "use auto or float32"),
    Case("evaluate-bf16-on-a-cpu-without-bf16",
         lambda env: _without_native_bf16(env).evaluate(env.checkpoint(), dtype="bfloat16"),
         "config key evaluate.dtype: bfloat16 on this CPU", "use auto or float32"),
    # -- the config file (checked when the workflow starts) --
    Case("config-unknown-nested-key", _nested_typo, "config key data.train.pathh: unknown key",
         "allowed here: allow_truncated_json, dedupe, max_samples, path"),
    Case("config-wrong-type-boolean", _set("verifier", "trust_remote_code", "yes"),
         "config key verifier.trust_remote_code: 'yes' is not of type 'boolean'",
         "give a value of that type"),
    Case("config-not-in-enum", _set("data", "truncation", "cut"),
         "config key data.truncation: 'cut' is not one of", "use one of the listed values"),
    Case("config-below-minimum", _set("extract", "shards", 0),
         "config key extract.shards: 0 is less than the minimum of 1", "use a larger value"),
    Case("config-whole-number-written-as-decimal", _set("extract", "shards", 2.0),
         "config key extract.shards: 2.0 is a decimal where a whole number is expected",
         "write 2"),
    Case("config-decimal-in-a-list-of-whole-numbers", _set("evaluate", "k", [3, 5.0]),
         "config key evaluate.k.1: 5.0 is a decimal", "write 5"),
    Case("config-not-a-finite-number", _set("train", "lr", float("nan")),
         "config key train.lr: nan is not a finite number", "give a finite number"),
    Case("config-missing-required-key", _drop_verifier_path,
         "config key verifier: 'path' is a required property", "add it"),
    Case("config-duplicate-aux-layers", _set("extract", "aux_layers", [3, 3, 5]),
         "config key extract.aux_layers: duplicate layer id(s) [3]", "list each layer once"),
    Case("config-evaluate-k-above-bound", _set("evaluate", "k", 17),
         "config key evaluate.k: 17 is greater than the maximum of 16", "use a smaller value"),
    Case("config-evaluate-k-list-above-bound", _set("evaluate", "k", [3, 40]),
         "config key evaluate.k.1: 40 is greater than the maximum of 16", "use a smaller value"),
    Case("gate-for-an-unknown-eval-set",
         _set("validate", "min_acceptance_length", {"mt-bench": {3: 2.0}}),
         "config key validate.min_acceptance_length.mt-bench: no eval set has this name",
         "use one of those names or remove the entry"),
    Case("gate-for-a-k-not-evaluated", _set("validate", "min_acceptance_length", {"eval": {5: 2.0}}),
         "config key validate.min_acceptance_length.eval.5: evaluate.k is 3",
         "gate a k that evaluate.k lists, or add 5 to it"),
    Case("gate-above-what-k-can-reach",
         _set("validate", "min_acceptance_length", {"eval": {"3": 4.5}}),
         "config key validate.min_acceptance_length.eval.3: 4.5 is above 4",
         "use a value up to 4"),
]  # fmt: skip


def one_error_line(stderr: str) -> str:
    """The one ``error:`` line, last on stderr (progress output of the stage may precede it)."""
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], stderr
    return errors[0]


def leftovers(folder: Path) -> list[str]:
    """Everything in ``folder`` that is not an (empty) directory, nor a job's writer lock
    (``.locks/``, eagle3lib/lifetime.py: held while a job runs, not an artifact)."""
    return sorted(
        str(p.relative_to(folder))
        for p in folder.rglob("*")
        if not p.is_dir() and p.parent.name != ".locks"
    )


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, id=c.id, marks=pytest.mark.xfail(reason=c.xfail, strict=True))
        if c.xfail
        else pytest.param(c, id=c.id)
        for c in CASES
    ],
)
def test_bad_input(case, world, tmp_path, capfd, monkeypatch):
    env = Env(tmp_path, world, capfd, monkeypatch)
    line = one_error_line(case.run(env))  # (a) one line, exit status 1 (checked by env.script)
    where = case.where.format(inp=env.inp, out=env.out, verifier=world.verifier_dir)
    assert where in line, f"(b) {where!r} not named in {line!r}"
    assert case.remedy in line, f"(c) no remedy {case.remedy!r} in {line!r}"
    assert line.index(where) < line.index(case.remedy)
    assert leftovers(env.out) == [], "(d) partial artifacts left behind"


def test_the_table_is_large_and_distinct():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)) and len([c for c in CASES if not c.xfail]) >= 22


# ---- real processes: exit status and stderr as a rule's log gets them ----------------------


def run_script(name: str, *argv) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPTS / f"{name}.py"), *map(str, argv)],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=300,
    )


def test_vocab_script_process(world, tmp_path):
    too_big = world.record["vocab_size"] + 100
    out = tmp_path / "out"
    proc = run_script(
        "vocab",
        "--samples", world.samples,
        "--draft-vocab-size", too_big,
        "--out-map", out / "vocab_map.safetensors",
        "--out-info", out / "vocab.json",
    )  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        f"error: config key train.draft_vocab_size: {too_big} is larger than the verifier vocab "
        f"({world.record['vocab_size']}); use at most {world.record['vocab_size']}"
    )
    assert not out.exists() or leftovers(out) == []


def test_verifier_script_process(world, tmp_path):
    env = SimpleNamespace(inp=tmp_path / "in", w=world)
    env.inp.mkdir()
    folder = verifier_copy(env, weights=False)
    (folder / "model.bin").write_bytes(b"pickle")
    out = tmp_path / "out"
    proc = run_script(
        "verifier",
        "--verifier", json.dumps({"path": str(folder)}),
        "--hf-dir", out / "hf",
        "--out", out / "verifier.json",
    )  # fmt: skip
    assert proc.returncode == 1
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith(f"error: verifier '{folder}' has only pickle weights (model.bin)")
    assert not out.exists() or leftovers(out) == []


def test_cli_handler_process():
    """The handler every script uses: a multi-line UserError becomes one stderr line, status 1;
    other exceptions (bugs) keep their traceback and are not swallowed."""
    code = (
        "import sys; sys.path.insert(0, {root!r})\n"
        "from eagle3lib.errors import UserError, cli\n"
        "@cli\n"
        "def main():\n"
        "    raise {exc}\n"
        "main()\n"
    )
    user = subprocess.run(
        [sys.executable, "-c", code.format(root=str(ROOT), exc="UserError('a.json:3: bad\\n  x')")],
        capture_output=True,
        text=True,
    )
    assert user.returncode == 1 and user.stderr == "error: a.json:3: bad x\n"
    bug = subprocess.run(
        [sys.executable, "-c", code.format(root=str(ROOT), exc="KeyError('k')")],
        capture_output=True,
        text=True,
    )
    assert bug.returncode == 1 and "Traceback" in bug.stderr
