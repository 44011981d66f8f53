"""Typed views of the validated workflow configuration (rules/schemas/config.schema.yaml).

Snakemake validates config.yaml against the schema and fills defaults; each rule hands its
section to a script as JSON, and the script builds one of these dataclasses from it. The
schema is the one source of defaults: the dataclasses' own (for callers without a config) must
equal it, which tests/test_config.py checks key by key.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
from pathlib import Path
from typing import Any, TypeVar

from eagle3lib.errors import UserError, first_line

PACKAGE_PREFIX = "package:"

T = TypeVar("T")


def resolve_package_path(spec: str, key: str = "path") -> Path:
    """Turn ``package:<module>/<relative path>`` into the file inside the installed package.

    The package is located without importing it (its ``__init__`` may need heavy deps); a
    dotted name's parent packages are imported (Python finds a subpackage through them).
    """
    rest = spec[len(PACKAGE_PREFIX) :]
    module, _, relative = rest.partition("/")
    if not module or not relative:
        raise UserError(f"config key {key}: {spec!r} must look like package:<module>/<file>")
    try:
        found = importlib.util.find_spec(module)
    except ImportError as exc:  # a parent package of a dotted name is missing or broken
        raise UserError(
            f"config key {key}: Python package {module!r} cannot be found ({first_line(exc)}); "
            f"install it (see README) or point {key} at a file"
        ) from None
    if found is None:
        raise UserError(
            f"config key {key}: Python package {module!r} is not installed; "
            f"install it (see README) or point {key} at a file"
        )
    if not found.submodule_search_locations:
        raise UserError(
            f"config key {key}: {module!r} is a Python module, not a package holding data "
            f"files; name a package or point {key} at a file"
        )
    path = Path(next(iter(found.submodule_search_locations))) / relative
    if not path.exists():
        raise UserError(f"config key {key}: {relative!r} not found inside package {module!r}")
    return path


def expand_home(config: dict[str, Any]) -> None:
    """A path setting that starts with ``~`` or ``~user`` names that home folder, as in a
    shell (YAML keeps it as written, and nothing else would expand it): the verifier, each
    data file and vllm.python, in place in the validated ``config``."""

    def expand(section: dict[str, Any], key: str) -> None:
        value = section.get(key)
        if isinstance(value, str) and value.startswith("~"):
            section[key] = os.path.expanduser(value)

    expand(config["verifier"], "path")
    data = config["data"]
    for section in (data["train"], data["eval"], *data["extra_train"], *data["extra_eval"]):
        expand(section, "path")
    expand(config["vllm"], "python")


def resolve_data_path(spec: str, key: str) -> Path:
    """A data file given as a path or a ``package:`` reference; it must exist."""
    if spec.startswith(PACKAGE_PREFIX):
        return resolve_package_path(spec, key)
    path = Path(spec)
    if path.is_dir():
        raise UserError(
            f"config key {key}: {spec!r} is a folder, not a file; point {key} at a JSON or "
            "JSONL file"
        )
    if path.exists() and not path.is_file():  # a FIFO, a socket, a device
        raise UserError(
            f"config key {key}: {spec!r} is not a regular file (jobs read it more than once); "
            "point it at a JSON or JSONL file"
        )
    if not path.is_file():
        raise UserError(
            f"config key {key}: file {spec!r} does not exist; fix the path (relative paths "
            "start at the working directory) or use package:<module>/<file>"
        )
    return path


def from_dict(cls: type[T], data: dict[str, Any]) -> T:
    """Build dataclass ``cls`` from a (schema-validated) mapping, ignoring unknown keys."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    return cls(**{k: v for k, v in data.items() if k in names})


def from_json(cls: type[T], text: str) -> T:
    return from_dict(cls, json.loads(text))


@dataclasses.dataclass(frozen=True)
class PrepareConfig:
    max_length: int = 2048
    truncation: str = "truncate"
    min_supervised_tokens: int = 1
    on_invalid_record: str = "error"
    max_samples: int | None = None
    allow_truncated_json: bool = False
    dedupe: bool = False


@dataclasses.dataclass(frozen=True)
class RegenerateConfig:
    backend: str = "hf"
    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    batch_size: int = 16
    concurrency: int = 8
    chunk_size: int = 64
    max_turns: int | None = None
    kv_cache: str = "static"
    compile: bool = False
    dtype: str = "auto"
    synthetic_prompts: int = 0
    synthetic_max_tokens: int = 128
    synthetic_system_prompts: list[str | None] = dataclasses.field(default_factory=list)


def synthetic_keys_left_out(regenerate: dict[str, Any]) -> tuple[str, ...]:
    """The synthetic-prompt keys of the regenerate section that its rule leaves out of its
    parameters, so that runs made before a key existed stay current: all of them while no
    prompts are sampled, the system prompts while none is given (only nulls sample as none)."""
    keys = ("synthetic_prompts", "synthetic_max_tokens", "synthetic_system_prompts")
    if not regenerate["synthetic_prompts"]:
        return keys
    if all(s is None for s in regenerate["synthetic_system_prompts"]):
        return keys[2:]
    return ()


def default_aux_layers(num_layers: int) -> list[int]:
    """speculators' default auxiliary layers."""
    return [2, num_layers // 2, num_layers - 3]


def aux_layer_errors(aux_layers: Any, num_layers: int | None = None) -> list[str]:
    """What is wrong with extract.aux_layers (null: speculators' default), one line each:
    empty, duplicate or negative ids, and, once the verifier's depth ``num_layers`` is known,
    ids beyond its last layer or a default that does not fit it."""
    key = "config key extract.aux_layers"
    if aux_layers is None:
        if num_layers is None:
            return []
        ids = default_aux_layers(num_layers)
        if len(set(ids)) == len(ids) and min(ids) >= 0:
            return []
        return [
            f"{key}: the default {ids} is invalid for a verifier with {num_layers} layers; "
            f"set extract.aux_layers to distinct ids in [0, {num_layers - 1}]"
        ]
    if not isinstance(aux_layers, list):
        return []  # the schema names the type
    if not aux_layers:
        return [f"{key}: empty list; give at least one layer id, or null for the default"]
    duplicates = sorted({k for k in aux_layers if aux_layers.count(k) > 1})
    negative = [k for k in aux_layers if k < 0]
    beyond = [k for k in aux_layers if num_layers is not None and k >= num_layers]
    errors = []
    if duplicates:
        errors.append(
            f"{key}: duplicate layer id(s) {duplicates} in {aux_layers}; list each layer once, "
            "or use null for speculators' default"
        )
    if negative:
        errors.append(
            f"{key}: negative layer id(s) {negative}; use ids from 0 (the embeddings' output) "
            "to the verifier's num_hidden_layers - 1"
        )
    if beyond:
        errors.append(
            f"{key}: layer id(s) {beyond} out of range [0, {num_layers - 1}] for a verifier "
            f"with {num_layers} layers (the final layer is always added); use ids from 0 to "
            f"{num_layers - 1}"
        )
    return errors


def forward_dtype(setting: str, gpu: bool) -> str:
    """The dtype name a dtype setting (extract.dtype, evaluate.dtype) computes in on a job's
    device: auto is bfloat16 on a GPU and float32 on a CPU (hidden_states.resolve_dtype)."""
    if setting != "auto":
        return setting
    return "bfloat16" if gpu else "float32"


def resolve_aux_layers(aux_layers: list[int] | None, num_layers: int) -> list[int]:
    """The aux layer ids for a verifier of ``num_layers`` layers (None: speculators'
    default); the first of aux_layer_errors stops the job."""
    errors = aux_layer_errors(aux_layers, num_layers)
    if errors:
        raise UserError(errors[0])
    return default_aux_layers(num_layers) if aux_layers is None else [int(k) for k in aux_layers]


@dataclasses.dataclass(frozen=True)
class ExtractConfig:
    shards: int = 1
    aux_layers: list[int] | None = None
    dtype: str = "auto"
    batch_tokens: int = 16384
    gpus_per_job: int = 0
    backend: str = "hf"
    concurrency: int = 8
    storage: str = "bf16"
    compile: bool = False

    def __post_init__(self):
        errors = aux_layer_errors(self.aux_layers)
        if errors:
            raise UserError(errors[0])


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    epochs: int = 20
    lr: float = 1e-3
    optimizer: str = "muon"
    newton_schulz: str = "gram"
    weight_decay: float = 0.01
    scheduler: str = "linear"
    warmup_ratio: float | None = None
    total_seq_len: int = 8192
    draft_vocab_size: int = 32000
    ttt_steps: int = 3
    ttt_step_loss_decay: float = 1.0
    num_layers: int = 1
    norm_before_residual: bool = True
    norm_before_fc: bool = True
    norm_output: bool = True
    sliding_window: int = 2048
    full_attention_layers: list[int] = dataclasses.field(default_factory=list)
    val_fraction: float = 0.1
    seed: int = 42
    max_steps: int | None = None
    checkpoint_freq: float = 1.0
    keep_states: int = 1  # the newest epochs' states kept (0: every epoch's)
    fsdp: bool = False
    log_every: int = 10
    loader_workers: int = 0
    loader_threads: int = 4
    graph_step: bool | str = "auto"  # true, false or auto (graphed where it can run)
    packing: str = "ffd"
    attention: str = "auto"
    loss: str = "auto"
    gpus: int = 0


def process_threads(loader_threads: int, loader_workers: int = 0) -> int:
    """The cores one train process (one per GPU of a node) asks for: its training thread and
    its ``loader_threads`` batch-loading threads, or with ``loader_workers`` DataLoader worker
    processes (train.loader_workers, which then replace the threads) one core for each of
    them, as speculators' worker set-up holds each to one thread. torch's intra-op threads
    are held to the training thread's share (scripts/train.py), so that beside other jobs'
    busy processes the process does not run more threads than the cores it was given."""
    return 1 + (loader_workers or loader_threads)


@dataclasses.dataclass(frozen=True)
class EvaluateConfig:
    k: int | list[int] = 3
    max_new_tokens: int = 256
    method: str = "decode"
    batch_size: int = 16
    dtype: str = "auto"
    gpus: int = 0

    @property
    def k_values(self) -> list[int]:
        """Every k to evaluate; the first is the headline (and serve_check's)."""
        return [self.k] if isinstance(self.k, int) else list(self.k)


def repeated_keys(path: str | Path) -> list[str]:
    """Keys a YAML (or JSON) config file gives twice in one mapping, one line each: YAML keeps
    only the last, so a second ``train:`` section silently replaces the first."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    found: list[tuple[int, str]] = []

    def mapping(loader, node, deep=False):
        first: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in first:
                found.append(
                    (
                        line,
                        f"{path}:{line}: key {key!r} given twice in one section (first on line "
                        f"{first[key]}); YAML keeps only the last: merge the two",
                    )
                )
            first.setdefault(key, line)
        return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    with open(path, encoding="utf-8") as fh:
        yaml.load(fh, Loader=Loader)  # noqa: S506 - a SafeLoader subclass
    return [message for _, message in sorted(found)]  # in the file's order


def config_errors(config: dict[str, Any], schema_path: str | Path) -> list[str]:
    """Schema violations of ``config``, one line each, naming the key and what to do."""
    import jsonschema
    import yaml

    schema_path = Path(schema_path)
    schema = yaml.safe_load(schema_path.read_text(encoding="utf-8"))
    validator = _strict_numbers(jsonschema.Draft202012Validator)(schema)
    messages = []
    for error in sorted(validator.iter_errors(config), key=lambda e: list(map(str, e.path))):
        # oneOf/anyOf (e.g. a number or a list): the alternative whose type matched says more
        # (or the one that refused a float)
        floats = [e for e in error.context or () if _number_problem(e)]
        matched = floats or [e for e in error.context or () if e.validator != "type"]
        error = matched[0] if matched else error
        where = ".".join(str(p) for p in error.absolute_path)
        number = _number_problem(error)
        if number:
            messages.append(f"config key {where}: {number}")
        elif error.validator == "additionalProperties":
            allowed = sorted(error.schema.get("properties", {}))
            unknown = sorted(set(error.instance) - set(allowed))
            for key in unknown:
                full = f"{where}.{key}" if where else key
                messages.append(
                    f"config key {full}: unknown key; allowed here: {', '.join(allowed)}"
                )
        else:
            remedy = _REMEDIES.get(str(error.validator), "fix the value")
            messages.append(
                f"config key {where or '<top level>'}: {error.message}; {remedy} "
                f"(see {schema_path.name})"
            )
    if not messages and isinstance(config.get("extract"), dict):
        messages += aux_layer_errors(config["extract"].get("aux_layers"))
    if not messages:
        messages += acceptance_gate_errors(config, schema)
    if not messages:
        messages += regenerate_dtype_errors(config.get("regenerate") or {})
    return messages


def _strict_numbers(validator_class):
    """``validator_class`` whose "integer" takes no float (JSON Schema counts 2.0 as one, and
    the jobs then fail on a float where they count) and whose "number" takes no NaN or
    infinity (NaN passes every bound)."""
    import jsonschema

    def integer(_checker, value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    def number(_checker, value) -> bool:
        return integer(_checker, value) or isinstance(value, float) and math.isfinite(value)

    checker = validator_class.TYPE_CHECKER.redefine_many({"integer": integer, "number": number})
    return jsonschema.validators.extend(validator_class, type_checker=checker)


def _number_problem(error) -> str | None:
    """The message for a float that _strict_numbers refused (the schema's own would say only
    that ``2.0`` is not an integer, or not valid under any of the given schemas)."""
    value = error.instance
    if not isinstance(value, float):
        return None
    if not math.isfinite(value):
        return f"{value} is not a finite number; give a finite number"
    wanted = [error, *(error.context or ())]
    if value.is_integer() and any(
        e.validator == "type" and "integer" in _as_list(e.validator_value) for e in wanted
    ):
        return f"{value} is a decimal where a whole number is expected; write {int(value)}"
    return None


def _as_list(value) -> list:
    return value if isinstance(value, list) else [value]


def regenerate_dtype_errors(regenerate: dict[str, Any]) -> list[str]:
    """regenerate.dtype set with the vllm backend, which computes in vllm.dtype."""
    if regenerate.get("backend") == "vllm" and regenerate.get("dtype", "auto") != "auto":
        return [
            "config key regenerate.dtype: the hf backend's dtype; the vllm backend computes in "
            "vllm.dtype: set that instead, or leave regenerate.dtype at auto"
        ]
    return []


def acceptance_gate(gate: dict[str, dict[Any, float]] | None) -> dict[str, dict[str, float]]:
    """validate.min_acceptance_length with every k as a string (YAML gives 3 or "3"), sorted;
    null is no gate, and a set given as null is not gated."""
    return {
        name: {str(k): float(v) for k, v in sorted(per_k.items(), key=lambda kv: int(kv[0]))}
        for name, per_k in sorted((gate or {}).items())
        if per_k is not None
    }


def acceptance_gate_errors(config: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    """A gate (validate.min_acceptance_length) for a set or k that evaluate does not measure,
    or one that no draft can pass; checked at planning, defaults taken from the schema."""
    gate = (config.get("validate") or {}).get("min_acceptance_length") or {}
    key = "config key validate.min_acceptance_length"
    data = config["data"]
    default_name = schema["$defs"]["eval_set"]["properties"]["name"]["default"]
    names = [s.get("name", default_name) for s in [data["eval"], *data.get("extra_eval", [])]]
    k = (config.get("evaluate") or {}).get(
        "k", schema["properties"]["evaluate"]["properties"]["k"]["default"]
    )
    ks = [k] if isinstance(k, int) else list(k)
    errors = []
    for name, per_k in gate.items():
        if per_k is None:  # that set is not gated
            continue
        if name not in names:
            errors.append(
                f"{key}.{name}: no eval set has this name (data.eval and data.extra_eval: "
                f"{', '.join(names)}); use one of those names or remove the entry"
            )
            continue
        seen: set[int] = set()
        for k_key, minimum in per_k.items():
            k_value = int(k_key)
            if k_value in seen:
                errors.append(f"{key}.{name}.{k_key}: k={k_value} is given twice; keep one")
            seen.add(k_value)
            if k_value not in ks:
                errors.append(
                    f"{key}.{name}.{k_key}: evaluate.k is {k}, so no acceptance at k={k_value} "
                    f"is measured; gate a k that evaluate.k lists, or add {k_value} to it"
                )
            elif minimum > 1 + k_value:
                errors.append(
                    f"{key}.{name}.{k_key}: {minimum} is above {1 + k_value}, the most a draft "
                    f"proposing {k_value} tokens a step can reach; use a value up to {1 + k_value}"
                )
    return errors


# What to do about a schema violation, by the JSON-schema keyword that failed.
_REMEDIES = {
    "type": "give a value of that type",
    "enum": "use one of the listed values",
    "required": "add it",
    "minimum": "use a larger value",
    "exclusiveMinimum": "use a larger value",
    "maximum": "use a smaller value",
    "exclusiveMaximum": "use a smaller value",
    "minLength": "give a non-empty value",
    "minItems": "give more items",
    "pattern": "use only the allowed characters",
}
