"""One source of config defaults: the schema (rules/schemas/config.schema.yaml), from which
Snakemake fills the config. The dataclasses of eagle3lib/config.py repeat those defaults for
callers that build them without a config; these tests hold the two equal."""

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from eagle3lib.config import (
    EvaluateConfig,
    ExtractConfig,
    PrepareConfig,
    RegenerateConfig,
    TrainConfig,
    aux_layer_errors,
    repeated_keys,
    resolve_aux_layers,
)
from eagle3lib.errors import UserError

SCHEMA = yaml.safe_load(
    (Path(__file__).parents[1] / "rules" / "schemas" / "config.schema.yaml").read_text()
)

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
