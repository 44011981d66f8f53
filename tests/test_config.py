"""One source of config defaults: the schema (rules/schemas/config.schema.yaml), from which
Snakemake fills the config. The dataclasses of eagle3lib/config.py repeat those defaults for
callers that build them without a config; these tests hold the two equal."""

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

import eagle3lib
from eagle3lib.config import (
    EvaluateConfig,
    ExtractConfig,
    PrepareConfig,
    RegenerateConfig,
    TrainConfig,
    acceptance_gate,
    aux_layer_errors,
    config_errors,
    forward_dtype,
    from_json,
    process_threads,
    repeated_keys,
    resolve_aux_layers,
    resolve_data_path,
    resolve_package_path,
)
from eagle3lib.errors import UserError

SCHEMA_PATH = Path(__file__).parents[1] / "rules" / "schemas" / "config.schema.yaml"
SCHEMA = yaml.safe_load(SCHEMA_PATH.read_text())

# Each dataclass and the schema sections its fields come from (prepare reads data and data.train).
SECTIONS = {
    PrepareConfig: ("data", "data.train"),
    RegenerateConfig: ("regenerate",),
    ExtractConfig: ("extract",),
    TrainConfig: ("train",),
    EvaluateConfig: ("evaluate",),
}

# Schema keys with a default that no dataclass holds, and why.
NO_DATACLASS = {
    "verifier.name": "scripts/verifier.py reads the verifier section as a mapping",
    "verifier.trust_remote_code": "scripts/verifier.py reads the verifier section as a mapping",
    "verifier.allow_pickle": "scripts/verifier.py reads the verifier section as a mapping",
    "data.extra_eval": "the workflow turns the eval sets into evaluate's --eval-sets list",
    "data.extra_train": "conversations.train_sources pairs its entries with the --train files",
    "eval_set.name": "the workflow turns the eval sets into evaluate's --eval-sets list",
    "eval_set.max_prompts": "the workflow turns the eval sets into evaluate's --eval-sets list",
    "regenerate.enabled": "the switch of the regenerate job (rules/common.smk)",
    "regenerate.workers": "a resource of the regenerate rule (--workers)",
    "regenerate.gpus": "a resource of the regenerate rule",
    "train.nodes": "a resource of the train rule (--nodes)",
    "extract.jobs_per_gpu": "a resource of the extract rule (the lease scripts/gpu_job.py takes)",
    "vllm.python": "the workflow's path to the vLLM interpreter (--vllm-python)",
    "vllm.max_model_len": "the vllm section reaches eagle3lib/serve.py as a mapping (--vllm)",
    "vllm.dtype": "the vllm section reaches eagle3lib/serve.py as a mapping (--vllm)",
    "vllm.enforce_eager": "the vllm section reaches eagle3lib/serve.py as a mapping (--vllm)",
    "vllm.cpu_kvcache_gib": "the vllm section reaches eagle3lib/serve.py as a mapping (--vllm)",
    "vllm.startup_timeout": "the vllm section reaches eagle3lib/serve.py as a mapping (--vllm)",
    "serve_check.enabled": "the switch of the serve_check job (rules/common.smk)",
    "serve_check.gpus": "a resource of the serve_check rule",
    "validate.min_acceptance_length": "the report reads it as --min-acceptance-length JSON",
}


def properties(section: str) -> dict:
    """The schema's properties of a dotted section (data.train), or of a $defs entry."""
    if section in SCHEMA["$defs"]:
        return SCHEMA["$defs"][section]["properties"]
    node = SCHEMA
    for part in section.split("."):
        node = node["properties"][part]
    return node["properties"]


def schema_defaults() -> dict[str, object]:
    """{section.key: default} of every schema key with a default (not whole sections)."""
    sections = [name for name, node in SCHEMA["properties"].items() if "properties" in node]
    sections += ["data.train", *SCHEMA["$defs"]]
    return {
        f"{section}.{key}": node["default"]
        for section in sections
        for key, node in properties(section).items()
        if "default" in node and "properties" not in node
    }


def field_default(field: dataclasses.Field) -> object:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


@pytest.mark.parametrize("cls", SECTIONS, ids=lambda cls: cls.__name__)
def test_every_dataclass_default_is_the_schemas(cls):
    defaults = schema_defaults()
    for field in dataclasses.fields(cls):
        if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            continue
        keys = [f"{section}.{field.name}" for section in SECTIONS[cls]]
        key = next((k for k in keys if k in defaults), None)
        assert key is not None, f"{cls.__name__}.{field.name}: no schema default at {keys}"
        ours, schemas = field_default(field), defaults[key]
        assert ours == schemas and isinstance(ours, bool) == isinstance(schemas, bool), (
            f"config key {key}: {cls.__name__} defaults to {ours!r}, the schema to {schemas!r}"
        )


def test_every_schema_default_has_a_dataclass_field_or_a_reason():
    held = {
        f"{section}.{field.name}"
        for cls, sections in SECTIONS.items()
        for section in sections
        for field in dataclasses.fields(cls)
    }
    missing = [key for key in schema_defaults() if key not in held and key not in NO_DATACLASS]
    assert not missing, f"schema keys with a default but no dataclass field: {missing}"
    stale = [key for key in NO_DATACLASS if key not in schema_defaults() or key in held]
    assert not stale, (
        f"NO_DATACLASS lists keys the schema has no default for or a field holds: {stale}"
    )


@pytest.mark.parametrize(
    ("aux_layers", "num_layers", "message"),
    [
        ([], None, "empty list"),
        ([2, 4, 4], None, "duplicate layer id(s) [4]"),
        ([-1, 2], None, "negative layer id(s) [-1]"),
        ([0, 3, 8], 8, "layer id(s) [8] out of range [0, 7]"),
        (None, 4, "the default [2, 2, 1] is invalid"),
    ],
)
def test_one_aux_layer_check_before_and_after_the_depth_is_known(aux_layers, num_layers, message):
    errors = aux_layer_errors(aux_layers, num_layers)
    assert errors and message in errors[0], errors
    if num_layers is not None:
        with pytest.raises(UserError, match=re.escape(message)):
            resolve_aux_layers(aux_layers, num_layers)
    assert resolve_aux_layers(None, 8) == [2, 4, 5] and resolve_aux_layers([5, 0], 8) == [5, 0]


def test_the_regenerate_rule_leaves_out_the_synthetic_keys_it_does_not_use():
    """Runs made before a synthetic-prompt key existed stay current while the key is unused:
    no prompts sampled, or no system prompt given (only nulls sample as none)."""
    from eagle3lib.config import synthetic_keys_left_out

    def left_out(prompts, system):
        return synthetic_keys_left_out(
            {"synthetic_prompts": prompts, "synthetic_system_prompts": system}
        )

    every = ("synthetic_prompts", "synthetic_max_tokens", "synthetic_system_prompts")
    assert left_out(0, ["Write code."]) == every
    assert left_out(5, []) == left_out(5, [None, None]) == ("synthetic_system_prompts",)
    assert left_out(5, [None, "Write code."]) == ()


def test_a_section_given_twice_in_a_config_file_stops_planning_naming_both_lines(tmp_path):
    """YAML keeps the last of two equal keys: a second `train:` section would silently drop the
    first one's settings, and a later error would blame a default. Planning stops at once, in
    a real `snakemake -n`, naming the file and both lines; a file without repeats passes."""
    from conftest import ROOT, run_snakemake

    text = "run: t\ntrain:\n  epochs: 1\nevaluate: {k: 3, k: 4}\ntrain:\n  epochs: 2\n"
    config = tmp_path / "config.yaml"
    config.write_text(text)
    assert repeated_keys(config) == [
        f"{config}:4: key 'k' given twice in one section (first on line 4); YAML keeps only "
        "the last: merge the two",
        f"{config}:5: key 'train' given twice in one section (first on line 2); YAML keeps "
        "only the last: merge the two",
    ]
    proc = run_snakemake(tmp_path, config, "-n", check=False)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == f"error: {repeated_keys(config)[0]}"
    assert "Traceback" not in proc.stderr
    assert repeated_keys(ROOT / "config.yaml") == []


def minimal_config(**sections) -> dict:
    """The smallest schema-valid config (as written by a user, before defaults are filled),
    with ``sections`` added or replaced."""
    config = {
        "run": "t",
        "verifier": {"path": "verifier"},
        "data": {"train": {"path": "train.jsonl"}, "eval": {"path": "eval.jsonl"}},
    }
    return {**config, **sections}


# Catches: an unknown top-level key reported as ".key" (the `if where else key` branch
# dropped); only the first of several unknown keys reported; a top-level violation's key
# rendered as "" instead of <top level>; the schema file's name dropped from the message.
def test_config_errors_name_top_level_keys_and_the_schema_file():
    """Unknown top-level keys are named bare, each on its own line; a missing top-level key is
    reported at <top level>, with its remedy and the schema file to read."""
    allowed = "data, evaluate"
    errors = config_errors(minimal_config(trian={}, evalute={}), SCHEMA_PATH)
    assert [e.split(";")[0] for e in errors] == [
        "config key evalute: unknown key",
        "config key trian: unknown key",
    ]
    assert allowed in errors[0]
    config = minimal_config()
    del config["run"]
    assert config_errors(config, SCHEMA_PATH) == [
        "config key <top level>: 'run' is a required property; add it (see config.schema.yaml)"
    ]
    assert config_errors(minimal_config(), SCHEMA_PATH) == []


# Catches: the aux-layer check run on a config that already broke the schema (it then crashes
# comparing a string with 0); the acceptance-gate check run on one that lacks `data`
# (KeyError instead of the schema's message).
def test_semantic_checks_wait_for_a_schema_valid_config():
    """aux_layers and the acceptance gate are checked only once the schema passes: a config
    breaking the schema gets the schema's one line, not a crash of a later check."""
    errors = config_errors(minimal_config(extract={"aux_layers": [1, "x"]}), SCHEMA_PATH)
    assert len(errors) == 1 and errors[0].startswith("config key extract.aux_layers"), errors
    config = minimal_config(validate={"min_acceptance_length": {"eval": {3: 2.0}}})
    del config["data"]
    assert config_errors(config, SCHEMA_PATH) == [
        "config key <top level>: 'data' is a required property; add it (see config.schema.yaml)"
    ]


# Catches: regenerate.dtype's default ("auto") not applied when the key is absent (config
# errors run on the user's config, before snakemake fills defaults).
def test_the_vllm_backend_without_a_regenerate_dtype_is_valid():
    """config_errors sees the config as written: the vllm backend with no regenerate.dtype is
    the default auto, not an error; a dtype given with it is."""
    assert config_errors(minimal_config(regenerate={"backend": "vllm"}), SCHEMA_PATH) == []
    errors = config_errors(
        minimal_config(regenerate={"backend": "vllm", "dtype": "float32"}), SCHEMA_PATH
    )
    assert len(errors) == 1 and errors[0].startswith("config key regenerate.dtype:"), errors


def gate_errors(gate: dict, **sections) -> list[str]:
    return config_errors(
        minimal_config(validate={"min_acceptance_length": gate}, **sections), SCHEMA_PATH
    )


# Catches: `>` turned into `>=` (a gate of exactly 1 + k refused); the schema's default
# evaluate.k not used when the evaluate section is absent; a null set crashing or being
# checked; a k given twice ("3" and 3) not reported; an unknown set's k checked too (the
# `continue` after the unknown-name error dropped); the default eval-set name not used.
def test_acceptance_gate_errors_at_their_bounds():
    """The gate may reach 1 + k exactly (evaluate.k from the schema's default 3 when the section
    is absent); a null set is not gated; k given as 3 and "3" is one k given twice; an unknown
    set gets one line only; eval sets are named as the schema defaults them."""
    key = "config key validate.min_acceptance_length"
    assert gate_errors({"eval": {3: 4.0}}) == []
    assert gate_errors({"eval": {3: 4.01}}) == [
        f"{key}.eval.3: 4.01 is above 4, the most a draft proposing 3 tokens a step can reach; "
        "use a value up to 4"
    ]
    assert gate_errors({"eval": None}) == []
    assert gate_errors({"eval": {3: 2.0, "3": 2.5}}) == [
        f"{key}.eval.3: k=3 is given twice; keep one"
    ]
    errors = gate_errors({"mtbench": {5: 2.0}})
    assert len(errors) == 1 and errors[0].startswith(f"{key}.mtbench: no eval set"), errors
    extra = {"train": {"path": "t.jsonl"}, "eval": {"path": "e.jsonl"}}
    extra["extra_eval"] = [{"path": "h.jsonl", "name": "humaneval"}]
    assert gate_errors({"humaneval": {5: 6.0}}, data=extra, evaluate={"k": [3, 5]}) == []


# Catches: the gate's k sorted as strings ("10" before "3"); a set given as null kept.
def test_acceptance_gate_sorts_k_numerically_and_drops_null_sets():
    """The gate handed to the report: k as strings in numeric order, sets sorted, a null set
    left out."""
    gate = acceptance_gate({"b": {10: 2, "3": 1.5}, "a": None})
    assert gate == {"b": {"3": 1.5, "10": 2.0}}
    assert list(gate["b"]) == ["3", "10"]
    assert acceptance_gate(None) == {}


# Catches: the "must look like package:<module>/<file>" check weakened to `and`; a module that
# is not a package (no submodule_search_locations) not reported (TypeError); a missing file
# inside the package not reported; the prefix cut one character off; resolve_data_path not
# handing package: specs to resolve_package_path.
def test_package_paths_resolve_inside_the_package_or_say_what_is_wrong():
    """package:<module>/<file> is the file inside the installed package; each malformed or
    missing part gets its own message naming the config key."""
    here = Path(eagle3lib.__file__).parent
    assert resolve_package_path("package:eagle3lib/config.py", "k") == here / "config.py"
    assert resolve_data_path("package:eagle3lib/config.py", "k") == here / "config.py"
    cases = {
        "package:eagle3lib": "config key k: 'package:eagle3lib' must look like package:",
        "package:/config.py": "config key k: 'package:/config.py' must look like package:",
        "package:no_such_pkg_zz/a.json": "config key k: Python package 'no_such_pkg_zz' is not",
        "package:no_such_pkg_zz.data/a.json": "config key k: Python package 'no_such_pkg_zz.data' "
        "cannot be found (No module named 'no_such_pkg_zz'); install it",
        "package:dataclasses/a.json": "config key k: 'dataclasses' is a Python module, not a package",
        "package:eagle3lib/nope.json": "config key k: 'nope.json' not found inside package",
    }
    for spec, message in cases.items():
        with pytest.raises(UserError, match=re.escape(message)):
            resolve_data_path(spec, "k")


# Catches: the missing-file message losing the config key; the folder check dropped (a folder
# then reads as "not a regular file").
def test_a_missing_or_folder_data_path_names_the_key_and_the_path(tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(UserError, match=re.escape(f"config key data.eval.path: file {missing!r}")):
        resolve_data_path(missing, "data.eval.path")
    folder = str(tmp_path)
    with pytest.raises(UserError, match=re.escape(f"{folder!r} is a folder, not a file")):
        resolve_data_path(folder, "data.eval.path")
    good = tmp_path / "eval.jsonl"
    good.write_text("{}\n")
    assert resolve_data_path(str(good), "data.eval.path") == good


# Catches: from_dict passing keys the dataclass lacks (a rule's section holds schema keys
# that are resources, e.g. train.nodes).
def test_a_section_builds_its_dataclass_ignoring_keys_it_does_not_hold():
    config = from_json(TrainConfig, '{"epochs": 2, "nodes": 4, "gpus": 1}')
    assert (config.epochs, config.gpus, config.lr) == (2, 1, 1e-3)


# Catches: the default's validity check `min(ids) >= 0` turned into `> 0` (layer 0 is the
# embeddings' output, a valid id); the default's last id changed from num_layers - 3.
def test_the_default_aux_layers_may_include_layer_zero():
    """A 3-layer verifier's default [2, 1, 0] is valid: 0 is the embeddings' output."""
    assert aux_layer_errors(None, 3) == []
    assert resolve_aux_layers(None, 3) == [2, 1, 0]
    assert aux_layer_errors([0, 1, 2], 3) == []


# Catches: ExtractConfig no longer checking aux_layers when it is built (a script given a bad
# --extract section runs on).
def test_an_extract_section_with_bad_aux_layers_is_refused_when_built():
    with pytest.raises(UserError, match=re.escape("duplicate layer id(s) [3]")):
        ExtractConfig(aux_layers=[3, 3, 5])
    with pytest.raises(UserError, match="empty list"):
        ExtractConfig(aux_layers=[])
    assert ExtractConfig(aux_layers=[0, 3]).aux_layers == [0, 3]


# Catches: auto mapped the wrong way round (float32 on a GPU, bfloat16 on a CPU); the
# training thread left out of a train process's cores; k_values keeping only the first k.
def test_small_derived_settings():
    assert forward_dtype("auto", gpu=True) == "bfloat16"
    assert forward_dtype("auto", gpu=False) == "float32"
    assert forward_dtype("float16", gpu=False) == "float16"
    assert process_threads(4) == 5 and process_threads(0) == 1
    assert process_threads(4, loader_workers=12) == 13 and process_threads(0, 2) == 3
    assert EvaluateConfig(k=[3, 5]).k_values == [3, 5]
    assert EvaluateConfig(k=4).k_values == [4]


# Catches: a key's "first on line" taken from its latest repeat (setdefault replaced by
# assignment); repeats reported out of the file's order. Runs without snakemake.
def test_a_key_given_three_times_names_its_first_line_each_time(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("run: a\ntrain:\n  epochs: 1\n  epochs: 2\nrun: b\nrun: c\n")
    assert [m.split(": key")[0] for m in repeated_keys(path)] == [
        f"{path}:4",
        f"{path}:5",
        f"{path}:6",
    ]
    assert all("(first on line 1)" in m for m in repeated_keys(path)[1:])
    assert "(first on line 3)" in repeated_keys(path)[0]
