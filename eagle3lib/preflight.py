"""Checks made when the workflow plans, before any job runs: everything knowable from the
config, the input files' existence, the eval prompt files and the verifier's config.

rules/common.smk calls ``problems`` in Snakemake's main process (after the config passed its
schema) and stops at the first problem with its one line, so that a mistake of this kind never
costs a run: the settings against each other and against the verifier (its layers, vocabulary
and context length), the result folders, and inputs that a job would only reject after the
verifier was converted. The jobs keep their own checks (a job can run on its own).

The verifier's facts come from what can be read without loading a model: ``verifier.json``
once the verifier rule has run, else a local folder's ``config.json``, else a GGUF file's
header (packaged or local: the header is checked whole before conversion). A hub id is known
only once the verifier rule has run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from eagle3lib.config import aux_layer_errors, forward_dtype
from eagle3lib.errors import UserError

# The folders a run writes under results/<run>/: those the paths of rules/common.smk name
# (which Python cannot import; tests/test_rules.py checks this list against them) and .locks/
# (eagle3lib/lifetime.py).
RUN_FOLDERS = (
    "verifier", "regenerated", "prepared", "hidden_states", "vocab", "train", "checkpoint",
    "reports", "logs", "benchmarks", "gpu", ".locks",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class VerifierFacts:
    """What planning knows of the verifier's language model (None: not known)."""

    source: str  # the file they were read from, named in messages
    num_hidden_layers: int | None = None
    hidden_size: int | None = None
    vocab_size: int | None = None
    max_position_embeddings: int | None = None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# config.json names of each fact: transformers' own, then common older spellings (GPT-2 style)
_CONFIG_NAMES = {
    "num_hidden_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "vocab_size": ("vocab_size",),
    "max_position_embeddings": ("max_position_embeddings", "n_positions", "max_seq_len"),
}


def facts_from_config(config: dict[str, Any], source: str) -> VerifierFacts:
    """Facts of a config.json (its language model's: a nested ``text_config`` first)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    found = {
        fact: next((_int(text.get(n)) for n in names if _int(text.get(n)) is not None), None)
        for fact, names in _CONFIG_NAMES.items()
    }
    return VerifierFacts(source, **found)


def facts_from_record(record: dict[str, Any], source: str) -> VerifierFacts:
    """Facts of the verifier rule's record (verifier.json)."""
    return VerifierFacts(source, **{f: _int(record.get(f)) for f in _CONFIG_NAMES})


def verifier_facts(spec: str, record_path: Path) -> VerifierFacts | None:
    """The verifier's facts from the cheapest source there is (see the module docstring);
    None for a hub id before the verifier rule ran. A local verifier that cannot be one (a
    missing path, a folder without config.json, a config.json that is not a model's, a GGUF
    file cut short) raises a UserError naming it."""
    from eagle3lib import verifier_files

    if record_path.is_file():
        try:
            return facts_from_record(
                json.loads(record_path.read_text(encoding="utf-8")), str(record_path)
            )
        except (OSError, ValueError, AttributeError):
            pass  # the verifier rule rewrites it; read what the config names instead
    problem = verifier_files.local_path_problem(spec)
    if problem:
        raise UserError(problem)
    gguf = verifier_files.gguf_file(spec)
    if gguf is not None:
        from eagle3lib.modelfiles import read_gguf_header

        header = read_gguf_header(gguf)
        return VerifierFacts(
            str(gguf),
            header.num_hidden_layers,
            header.hidden_size,
            header.vocab_size,
            header.max_position_embeddings,
        )
    if not verifier_files.is_local(spec):
        return None
    config_path = Path(spec) / "config.json"
    problem = verifier_files.config_json_problem(config_path)
    if problem:
        raise UserError(problem)
    return facts_from_config(json.loads(config_path.read_text(encoding="utf-8")), str(config_path))


# ---- the result folders ---------------------------------------------------------------------


def output_path_problems(run_dir: Path, folders: Iterable[str] = RUN_FOLDERS) -> list[str]:
    """Files where the run's folders should be, and folders this user cannot write."""
    remedy = "move or delete it, or choose another run name (config key run)"
    for parent in reversed([run_dir, *run_dir.parents]):
        if parent == Path(".") or parent == Path(parent.anchor):
            continue
        what = "the run's folder" if parent == run_dir else f"a folder of {run_dir}"
        if parent.is_symlink() and not parent.exists():  # a cleaned scratch space, say
            return [_dangling(parent, what)]
        if parent.exists() and not parent.is_dir():
            return [f"{parent}: a file is where {what} should be; {remedy}"]
    if run_dir.is_dir():
        for name in folders:
            folder = run_dir / name
            if folder.is_symlink() and not folder.exists():
                return [_dangling(folder, "a folder the run writes")]
            if folder.exists() and not folder.is_dir():
                return [f"{folder}: a file is where the run writes a folder; {remedy}"]
    existing = next(p for p in [run_dir, *run_dir.parents] if p.exists())
    for folder in [existing, *(run_dir / n for n in folders if (run_dir / n).is_dir())]:
        if not os.access(folder, os.W_OK | os.X_OK):
            return [
                f"{folder}: not writable by this user; make it writable, or run from a "
                "working directory where results/ can be written"
            ]
    return []


def _dangling(link: Path, what: str) -> str:
    return (
        f"{link}: a symbolic link to {os.readlink(link)}, which does not exist, is where {what} "
        "should be; create the folder it points to, or move or delete the link"
    )


# ---- input files ----------------------------------------------------------------------------


def input_file_problems(files: dict[str, Path]) -> list[str]:
    """Input files (by config key) that are empty or cannot be opened for reading."""
    out = []
    for key, path in files.items():
        if not os.access(path, os.R_OK):
            out.append(f"config key {key}: file '{path}' is not readable; fix its permissions")
        elif path.stat().st_size == 0:
            out.append(
                f"config key {key}: file '{path}' is empty; point {key} at a file of records"
            )
    return out


def eval_prompt_problems(sets: Sequence[dict[str, Any]]) -> list[str]:
    """Each eval set's file must give prompts as evaluate reads them: all of its records (as
    prepare reads them to exclude them from training), none empty."""
    from eagle3lib.conversations import read_eval_prompts

    for eval_set in sets:
        try:
            read_eval_prompts(Path(eval_set["path"]), None)
        except UserError as exc:
            return [f"{exc} (config key {eval_set['key']}.path)"]
    return []


# ---- settings, against each other and against the verifier ----------------------------------


def _ks(k: int | list[int]) -> list[int]:
    return [k] if isinstance(k, int) else list(k)


def setting_problems(
    config: dict[str, Any],
    facts: VerifierFacts | None,
    samples: int | None = None,
) -> list[str]:
    """What the (schema-valid, defaults filled) config gets wrong, one line each: settings that
    contradict each other, or the verifier ``facts`` (None: unknown yet). ``samples``: how
    many training samples the current prepare made, once it has run. A job with no GPU
    (``*.gpus: 0``) sees none (scripts/gpu_job.py), so GPU-only features are known to fail."""
    out = (
        _eval_k_problems(config)
        + _draft_layer_problems(config)
        + _sample_problems(config, samples)
        + _train_device_problems(config)
        + _regenerate_problems(config)
        + _extract_sharing_problems(config)
    )
    if facts is None:
        return out
    return (
        out
        + _aux_layer_problems(config, facts)
        + _vocab_problems(config, facts)
        + _context_problems(config, facts)
        + _vllm_context_problems(config, facts)
    )


# -- the config alone


def _eval_k_problems(config: dict[str, Any]) -> list[str]:
    """evaluate.k against evaluate.max_new_tokens."""
    evaluate = config["evaluate"]
    k = max(_ks(evaluate["k"]))
    if k <= evaluate["max_new_tokens"]:
        return []
    return [
        f"config key evaluate.k: k = {k} proposes more tokens per step than "
        f"evaluate.max_new_tokens ({evaluate['max_new_tokens']}) generates in all; use k "
        f"of at most {evaluate['max_new_tokens']}, or raise evaluate.max_new_tokens"
    ]


def _draft_layer_problems(config: dict[str, Any]) -> list[str]:
    """train.full_attention_layers against the draft's train.num_layers."""
    train = config["train"]
    bad = [i for i in train["full_attention_layers"] if i >= train["num_layers"]]
    if not bad:
        return []
    return [
        f"config key train.full_attention_layers: layer id(s) {bad} out of range for a "
        f"draft of train.num_layers = {train['num_layers']}; use ids from 0 to "
        f"{train['num_layers'] - 1}, or raise train.num_layers"
    ]


def _sample_problems(config: dict[str, Any], samples: int | None) -> list[str]:
    """extract.shards against the samples there can be (data.train.max_samples, and
    data.extra_train's) and those prepare made; too few samples to train on. With
    regeneration and synthetic prompts, prepare reads the regenerated file uncapped, so they
    count too (rules/common.smk, prepare_section)."""
    shards = config["extract"]["shards"]
    sources = [config["data"]["train"], *config["data"].get("extra_train", [])]
    caps = [s.get("max_samples") for s in sources]
    regenerate = config["regenerate"]
    synthetic = regenerate["synthetic_prompts"] if regenerate["enabled"] else 0
    max_samples = None if None in caps else sum(caps) + synthetic
    keys = "data.train.max_samples" + (" and data.extra_train's" if len(caps) > 1 else "")
    keys += " and regenerate.synthetic_prompts" if synthetic else ""
    out = []
    if max_samples is not None and shards > max_samples:
        out.append(
            f"config key extract.shards: {shards} shards for at most {max_samples} "
            f"samples ({keys}) leaves a shard empty; use at most {max_samples} "
            "shards"
        )
    if samples is not None and shards > samples:
        out.append(
            f"config key extract.shards: {shards} shards for the {samples} samples "
            f"prepare made leaves a shard empty; use at most {samples} shards"
        )
    if samples is not None and samples < 2:
        out.append(
            f"data.train.path: prepare made {samples} training sample(s), training needs at "
            "least 2; add conversations or raise data.train.max_samples"
        )
    return out


def _train_device_problems(config: dict[str, Any]) -> list[str]:
    """Training's attention and loss against its device: GPU-only features on CPU
    (train.gpus: 0), a sequence length flex attention's block mask cannot take on a GPU."""
    train = config["train"]
    cpu_train = train["gpus"] == 0
    out = []
    if cpu_train and train["attention"] == "simple_flex_attention":
        out.append(
            "config key train.attention: flex attention has no backward pass on CPU "
            "(train.gpus: 0); use sdpa or eager (numerically equal) or auto, or set train.gpus"
        )
    if cpu_train and train["loss"] == "fused":
        out.append(
            "config key train.loss: the fused loss needs a GPU and Triton (train.gpus: 0); use "
            "eager or auto, or set train.gpus"
        )
    flex = train["gpus"] > 0 and train["attention"] in ("auto", "simple_flex_attention")
    if flex and train["total_seq_len"] % 128:
        out.append(
            f"config key train.total_seq_len: {train['total_seq_len']} is not a multiple of "
            "128, which flex attention's block mask needs (train.attention: "
            f"{train['attention']} on a GPU); use e.g. {(train['total_seq_len'] // 128 + 1) * 128}"
            ", or train.attention: sdpa"
        )
    return out


def _regenerate_problems(config: dict[str, Any]) -> list[str]:
    """regenerate.workers against regenerate.gpus and synthetic prompts (when regeneration
    runs)."""
    regenerate = config["regenerate"]
    if not regenerate["enabled"]:
        return []
    problems = []
    if regenerate["gpus"] % regenerate["workers"]:
        problems.append(
            f"config key regenerate.workers: {regenerate['workers']} workers cannot share "
            f"{regenerate['gpus']} GPU(s) evenly; make regenerate.gpus a multiple of "
            "regenerate.workers"
        )
    if regenerate["synthetic_prompts"] and regenerate["workers"] > 1:
        problems.append(
            f"config key regenerate.synthetic_prompts: prompts are sampled once, by one process, "
            f"not by {regenerate['workers']} regenerate.workers; set regenerate.workers: 1 "
            "(or synthetic_prompts: 0)"
        )
    return problems


def _extract_sharing_problems(config: dict[str, Any]) -> list[str]:
    """extract.jobs_per_gpu against the backend: a vLLM server takes a fixed share of its
    GPU's memory up front (vllm.gpu_memory_utilization), so two cannot share one."""
    extract = config["extract"]
    if extract["jobs_per_gpu"] == 1 or extract["backend"] != "vllm":
        return []
    return [
        f"config key extract.jobs_per_gpu: {extract['jobs_per_gpu']} jobs per GPU need "
        "extract.backend: hf (each vLLM server reserves its GPU's memory); set it to 1"
    ]


def setting_warnings(config: dict[str, Any]) -> list[str]:
    """Settings that run but cost acceptance, one line each (printed at planning, not fatal):

    - the verifier extracting in one dtype (either backend resolves extract.dtype alike) and
      evaluating in another. The draft then learns the one verifier's states and argmax and is
      measured against the other's, which differ (for SmolLM2-135M-Instruct, bf16 against
      fp32: BENCHMARKS.md, bench/acceptance_gap.py dtype);
    - packs shorter than the samples: speculators' packing cuts a sample longer than
      train.total_seq_len to that length, so the rest of it is never trained on."""
    warnings = []
    extract, evaluate, train = config["extract"], config["evaluate"], config["train"]
    train_dtype = forward_dtype(extract["dtype"], extract["gpus_per_job"] > 0)
    eval_dtype = forward_dtype(evaluate["dtype"], evaluate["gpus"] > 0)
    if train_dtype != eval_dtype:
        warnings.append(
            f"config keys extract.dtype ({extract['dtype']}) and evaluate.dtype "
            f"({evaluate['dtype']}): the verifier's states are extracted in {train_dtype} but "
            f"acceptance is measured with it in {eval_dtype}, so the draft is measured against "
            "a verifier it did not learn from (auto is bfloat16 on a GPU, float32 on a CPU); "
            "set both to the same dtype"
        )
    max_length = config["data"]["max_length"]
    if train["total_seq_len"] < max_length:
        warnings.append(
            f"config keys train.total_seq_len ({train['total_seq_len']}) and data.max_length "
            f"({max_length}): a sample longer than a pack is cut to train.total_seq_len, and "
            "the rest of it is never trained on; raise train.total_seq_len to at least "
            "data.max_length"
        )
    return warnings


# -- against the verifier (a fact it does not know is not checked)


def _where(facts: VerifierFacts) -> str:
    """The end of a message about the verifier: where its facts were read."""
    return f"(verifier: {facts.source})"


def _aux_layer_problems(config: dict[str, Any], facts: VerifierFacts) -> list[str]:
    """extract.aux_layers against the verifier's layers."""
    layers = facts.num_hidden_layers
    if layers is None:
        return []
    where = _where(facts)
    if layers < 1:  # no decoder layer: no hidden states to train a draft on
        return [
            f"the verifier has num_hidden_layers {layers} {where}; a draft learns from its "
            "decoder layers' states: fix num_hidden_layers in its config, or use another model"
        ]
    return [f"{e} {where}" for e in aux_layer_errors(config["extract"]["aux_layers"], layers)]


def _vocab_problems(config: dict[str, Any], facts: VerifierFacts) -> list[str]:
    """train.draft_vocab_size against the verifier's vocabulary."""
    vocab, draft_vocab = facts.vocab_size, config["train"]["draft_vocab_size"]
    if vocab is None or draft_vocab <= vocab:
        return []
    return [
        f"config key train.draft_vocab_size: {draft_vocab} is larger than the "
        f"verifier vocab ({vocab}); use at most {vocab} {_where(facts)}"
    ]


def _context_problems(config: dict[str, Any], facts: VerifierFacts) -> list[str]:
    """data.max_length and the new tokens of evaluate (and regenerate, when it runs) against
    the verifier's context."""
    context = facts.max_position_embeddings
    if context is None:
        return []
    where = _where(facts)
    data, regenerate = config["data"], config["regenerate"]
    out = []
    if data["max_length"] > context:
        out.append(
            f"config key data.max_length: {data['max_length']} is longer than the verifier's "
            f"context (max_position_embeddings {context}); use at most {context} {where}"
        )
    lengths = [("evaluate.max_new_tokens", config["evaluate"]["max_new_tokens"])]
    if regenerate["enabled"]:
        lengths.append(("regenerate.max_new_tokens", regenerate["max_new_tokens"]))
    for key, value in lengths:
        if value >= context:
            out.append(
                f"config key {key}: {value} new tokens leave no room for the prompt in the "
                f"verifier's context (max_position_embeddings {context}); use fewer than "
                f"{context} {where}"
            )
    return out


def _vllm_context_problems(config: dict[str, Any], facts: VerifierFacts) -> list[str]:
    """vllm.max_model_len against the verifier's context, when a job runs vLLM."""
    context, max_model_len = facts.max_position_embeddings, config["vllm"]["max_model_len"]
    if context is None or max_model_len is None or max_model_len <= context:
        return []
    if not vllm_jobs(config):
        return []
    return [
        f"config key vllm.max_model_len: {max_model_len} is longer than the "
        f"verifier's context (max_position_embeddings {context}), which vLLM refuses; "
        f"use at most {context}, or null {_where(facts)}"
    ]


def vllm_jobs(config: dict[str, Any]) -> list[str]:
    """The rules whose jobs start vLLM with this config: serve_check, and regenerate and
    extract on their vllm backend."""
    extract, regenerate = config["extract"], config["regenerate"]
    return [
        rule
        for rule, uses in (
            ("regenerate", regenerate["enabled"] and regenerate["backend"] == "vllm"),
            ("extract", extract["backend"] == "vllm"),
            ("serve_check", config["serve_check"]["enabled"]),
        )
        if uses
    ]


def vllm_python_problems(config: dict[str, Any], python: str, job: str) -> list[str]:
    """vLLM's interpreter (vllm.python; by default make's .venv-vllm, ``python`` relative to
    the working folder) where ``job`` starts vLLM with this config: one that cannot run would
    fail the job only when it starts, after the stages before it ran."""
    if job not in vllm_jobs(config) or shutil.which(python):
        return []
    chosen = "" if config["vllm"]["python"] else " (null: make's .venv-vllm)"
    return [
        f"config key vllm.python{chosen}: {python} cannot run (no such file, or not "
        f"executable), and the {job} job starts vLLM with it; run `make envs` to make "
        ".venv-vllm, set vllm.python to the python of an environment with vLLM installed, or "
        + (
            "turn serve_check off (serve_check: {enabled: false})"
            if job == "serve_check"
            else f"use {job}.backend: hf"
        )
    ]


def planning_problems(
    config: dict[str, Any],
    record_path: Path,
    files: dict[str, Path],
    eval_sets: Sequence[dict[str, Any]],
    samples: int | None,
) -> tuple[list[str], VerifierFacts | None]:
    """(problems, verifier facts) of a config whose input paths resolved (``files``: by config
    key; ``eval_sets``: [{key, path}]): the input files, the eval prompts, the verifier as far
    as it can be read (``record_path``: its verifier.json), then the settings against each
    other and against the verifier. What rules/common.smk runs after the result folders'
    check; it stops at the first problem."""
    problems = input_file_problems(files) + eval_prompt_problems(eval_sets)
    if problems:
        return problems, None
    try:
        facts = verifier_facts(config["verifier"]["path"], record_path)
    except UserError as exc:
        return [str(exc)], None
    return setting_problems(config, facts, samples), facts
