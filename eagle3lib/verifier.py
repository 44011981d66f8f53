"""The verifier: materialise it once (GGUF -> HF folder), record its identity, load it.

The record written by the ``verifier`` rule (``verifier.json``) is the only way later stages
find the verifier, so changing the verifier changes that file and re-runs what depends on it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from eagle3lib.config import PACKAGE_PREFIX
from eagle3lib.errors import UserError, first_line
from eagle3lib.fileio import atomic_path, read_json, sha256_file, sha256_json
from eagle3lib.modelfiles import read_gguf_header
from eagle3lib.verifier_files import (
    config_json_problem,
    gguf_file,
    is_gguf_file,
    is_local,
    local_path_problem,
    weight_files,
    weights_checksum,
    weights_problem,
)


def text_config(config):
    """The language-model config of a verifier; nested ``text_config`` (Kimi-K2.5, Qwen-VL)."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else getattr(config, "text_config", config)


@contextlib.contextmanager
def gguf_parsed_once():
    """Within the block, each GGUF file is parsed once and gguf's tensor-name map built once
    per architecture and depth. transformers parses the file three times (tokenizer, config,
    weights: about 5.7 s each for SmolLM2-135M on a 2-core CPU) and builds the map once per
    tensor (397 times, 7 s); both are read-only results of their arguments, so they are shared.
    """
    import gguf

    real = {name: getattr(gguf, name) for name in ("GGUFReader", "get_tensor_name_map")}
    readers: dict[tuple[str, str], Any] = {}

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = real["GGUFReader"](path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    gguf.get_tensor_name_map = functools.cache(real["get_tensor_name_map"])
    try:
        yield
    finally:
        for name, value in real.items():
            setattr(gguf, name, value)


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantise a GGUF checkpoint into a plain HF folder (weights fp32, tokenizer, template)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        with gguf_parsed_once():
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(
                str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
            )
    except ValueError as exc:  # e.g. an architecture transformers cannot read from GGUF
        raise UserError(
            f"{gguf}: transformers cannot convert this GGUF file ({first_line(exc)}); "
            "convert the model to a Hugging Face folder and point verifier.path at it"
        ) from None
    # transformers refuses to save a GGUF-loaded model; the weights are plain tensors now.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config._name_or_path = ""  # noqa: SLF001 - GGUF metadata name, not a path
    with atomic_path(out_dir, directory=True) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)


# A quantisation suffix of a GGUF file name: model.Q4_K_M.gguf, model-f16.gguf
_QUANT_SUFFIX = re.compile(r"[.-](I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)


def default_name(path: str) -> str:
    if path.startswith(PACKAGE_PREFIX) or is_gguf_file(path):
        return _QUANT_SUFFIX.sub("", Path(path).name[: -len(".gguf")])
    return Path(os.path.abspath(path)).name if is_local(path) else path


def ships_code(config_dict: dict[str, Any]) -> bool:
    """The config names its own configuration code (``auto_map``)."""
    return "AutoConfig" in (config_dict.get("auto_map") or {})


def needs_custom_code(config_dict: dict[str, Any]) -> bool:
    """Only the verifier's own code can load it: transformers does not ship its model type.

    Decided from transformers' static list of model types, so a custom config registered in
    this process (see ``load_config``) still counts as custom code."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return ships_code(config_dict) and config_dict.get("model_type") not in CONFIG_MAPPING_NAMES


def custom_code_refused(path: str, model_type: str | None) -> UserError:
    return UserError(
        f"config key verifier.trust_remote_code: verifier {path!r} ships custom code "
        f"(model type {model_type!r}); set verifier.trust_remote_code: true if you trust it"
    )


def read_config(path: str, load_path: str, trust_remote_code: bool):
    """(config, whether the verifier's own code is used) of the verifier. With
    trust_remote_code transformers prefers a verifier's code over its own classes."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig, PretrainedConfig

    local_config = Path(load_path) / "config.json"
    if local_config.is_file():
        problem = config_json_problem(local_config)
        if problem:
            raise UserError(problem)
    try:
        config_dict, _ = PretrainedConfig.get_config_dict(load_path)
        if needs_custom_code(config_dict) and not trust_remote_code:
            raise custom_code_refused(path, config_dict.get("model_type"))
        config = AutoConfig.from_pretrained(load_path, trust_remote_code=trust_remote_code)
    except (ValueError, TypeError, KeyError, StrictDataclassError) as exc:
        if "trust_remote_code" in str(exc):
            raise custom_code_refused(path, None) from None
        if local_config.is_file():
            raise UserError(
                f"{local_config}: not a valid model config ({first_line(exc)}); fix or replace "
                "its config.json"
            ) from None
        raise UserError(
            f"verifier {path!r}: cannot read its config ({first_line(exc)}); use a local "
            "model folder or a hub id whose config transformers reads"
        ) from None
    except OSError as exc:
        local_config = Path(load_path) / "config.json"
        if local_config.is_file():  # there, but transformers cannot parse it
            raise UserError(
                f"{local_config}: not a valid model config ({first_line(exc)}); fix or "
                "replace its config.json"
            ) from None
        hint = " (offline: HF_HUB_OFFLINE is set)" if os.environ.get("HF_HUB_OFFLINE") else ""
        raise UserError(
            f"config key verifier.path: cannot load {path!r}{hint}; use a local model folder "
            f"or a reachable hub id ({first_line(exc)})"
        ) from None
    return config, ships_code(config_dict) and trust_remote_code


def materialize(
    path: str,
    name: str | None,
    hf_dir: Path,
    *,
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
) -> dict[str, Any]:
    """Make the verifier loadable and return its identity record. A GGUF file (packaged or
    local) is checked whole, hashed, then converted once to ``hf_dir``; a local folder's
    config.json and weight files are checked before anything loads them."""
    load_path, kind, source = _loadable(path, hf_dir)
    config, custom_code = read_config(path, load_path, trust_remote_code)
    weights = _weights_record(path, load_path, kind, allow_pickle)

    from eagle3lib import lm_weights

    lm = lm_weights.resolve(path, load_path, kind, config, trust_remote_code, allow_pickle)
    # the jobs after this one tokenize with its chat template: a broken one stops the run here
    from eagle3lib.data import check_chat_template

    tokenizer = load_tokenizer(
        {"path": path, "load_path": load_path, "trust_remote_code": trust_remote_code}
    )
    check_chat_template(tokenizer, f"verifier {path!r}")
    config_sha256 = _config_sha256(config)
    return {
        "name": name or default_name(path),
        "path": path,
        "load_path": load_path,
        "kind": kind,
        **_config_fields(config),
        "gguf": source,  # the GGUF file it was converted from (name, bytes, sha256)
        "config_sha256": config_sha256,
        "weights": weights,
        "trust_remote_code": trust_remote_code,
        "custom_code": custom_code,  # its own (trusted) code, not transformers', builds it
        "allow_pickle": allow_pickle,
        "lm_weights": lm,  # checkpoint keys of the language model's embeddings, LM head, norm
    }


def _loadable(path: str, hf_dir: Path) -> tuple[str, str, dict[str, Any] | None]:
    """(load path, kind: gguf, local or hub, the GGUF file's record or None) of verifier.path.
    A local path is checked first; a GGUF file is checked whole, hashed and converted to
    ``hf_dir``; a local folder's weight files are checked."""
    problem = local_path_problem(path)
    if problem:
        raise UserError(problem)
    gguf = gguf_file(path)
    if gguf is not None:
        header = read_gguf_header(gguf)  # a truncated or corrupt file stops here, in one line
        source = {"file": gguf.name, "bytes": header.file_bytes, "sha256": sha256_file(gguf)}
        convert_gguf(gguf, hf_dir)
        return str(hf_dir), "gguf", source
    if is_local(path):
        problem = weights_problem(Path(path))
        if problem:
            raise UserError(problem)
        return path, "local", None
    return path, "hub", None


def _weights_record(path: str, load_path: str, kind: str, allow_pickle: bool) -> dict[str, Any]:
    """The checksum record of the verifier's weight files (none for a hub id); pickle-only
    weights are refused unless allowed."""
    if kind == "hub":
        return {"kind": "hub", "files": {}, "sha256": None}
    safetensors, pickles = weight_files(Path(load_path))
    if not safetensors and pickles and not allow_pickle:
        raise UserError(
            f"verifier {path!r} has only pickle weights ({pickles[0].name}); convert them "
            "to safetensors, or set verifier.allow_pickle: true if you trust the files"
        )
    if not safetensors and not pickles:
        raise UserError(f"verifier {path!r}: no weight files (*.safetensors) found")
    return weights_checksum(safetensors or pickles)


def _config_fields(config) -> dict[str, Any]:
    """The record's fields read from the verifier's config (its language model's)."""
    tc = text_config(config)
    return {
        "model_type": getattr(config, "model_type", None),
        "text_model_type": getattr(tc, "model_type", None),
        "num_hidden_layers": tc.num_hidden_layers,
        "hidden_size": tc.hidden_size,
        "vocab_size": tc.vocab_size,
        "max_position_embeddings": getattr(tc, "max_position_embeddings", None),
    }


def _config_sha256(config) -> str:
    """The hash of the whole config, without its load path and transformers version."""
    config_dict = json.loads(config.to_json_string(use_diff=False))
    config_dict.pop("_name_or_path", None)
    config_dict.pop("transformers_version", None)
    return sha256_json(config_dict)


def portable(record: dict[str, Any], record_path: Path) -> dict[str, Any]:
    """The record as verifier.json holds it: a load path inside the record's own folder (the
    HF folder converted from a GGUF) relative to that folder, so that a copied or renamed run
    folder refers to its own copy."""
    load_path = Path(record["load_path"])
    folder = Path(record_path).parent
    if record["kind"] != "gguf" or not load_path.resolve().is_relative_to(folder.resolve()):
        return record
    relative = str(load_path.resolve().relative_to(folder.resolve()))
    return {**record, "load_path": relative, "load_path_relative": True}


def read_record(path: str | os.PathLike) -> dict[str, Any]:
    """verifier.json, with a load path relative to its folder resolved (see ``portable``)."""
    record = read_json(path)
    if record.pop("load_path_relative", False):
        record["load_path"] = str(Path(path).parent / record["load_path"])
    return record


def identity(record: dict[str, Any]) -> dict[str, Any]:
    """The fields that decide what the verifier computes (hashed into shard manifests)."""
    return {
        "name": record["name"],
        "config_sha256": record["config_sha256"],
        "weights_sha256": record["weights"]["sha256"],
    }


def load_tokenizer(record: dict[str, Any]):
    """The verifier's tokenizer; tokenizer files that are missing or do not parse stop with
    one line naming the verifier."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(
            record["load_path"], trust_remote_code=record["trust_remote_code"]
        )
    except (OSError, ValueError, TypeError, KeyError) as exc:  # JSONDecodeError: ValueError
        raise UserError(
            f"verifier {record['path']!r}: its tokenizer does not load ({first_line(exc)}); "
            "its folder needs the tokenizer files of its model (tokenizer.json or the files "
            "its tokenizer class reads, and tokenizer_config.json), intact"
        ) from None


def load_config(record: dict[str, Any]):
    """The verifier's config. A trusted custom-code config class is also registered with
    AutoConfig for this process: speculators reads the verifier config again without passing
    ``trust_remote_code`` (building the draft, loading it, reading the verifier's weights)."""
    from transformers import AutoConfig

    trust = record["trust_remote_code"]
    config = AutoConfig.from_pretrained(record["load_path"], trust_remote_code=trust)
    if trust and not type(config).__module__.startswith("transformers."):
        AutoConfig.register(config.model_type, type(config), exist_ok=True)
    return config


def model_auto_class(config, trust_remote_code: bool):
    """The Auto class that builds the verifier with its LM head: a causal LM (Llama, Qwen3;
    custom code mapped to AutoModelForCausalLM), else an image-text-to-text model whose text
    part is the language model (Qwen-VL, Kimi-K2.5 in transformers)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto_map = (getattr(config, "auto_map", None) or {}) if trust_remote_code else {}
    for auto in (AutoModelForCausalLM, AutoModelForImageTextToText):
        if auto.__name__ in auto_map or type(config) in auto._model_mapping:  # noqa: SLF001
            return auto
    raise UserError(
        f"verifier model type {config.model_type!r}: transformers has no causal-LM or "
        "image-text-to-text class for it (nor does its custom code, if any)"
    )


def load_model(record: dict[str, Any], dtype, device_map=None):
    """The verifier with its LM head (causal LM or multimodal wrapper) in eval mode. The job's
    log gets one line with the time it took (``verifier: loaded ... in N s``)."""
    t0 = time.perf_counter()
    config = load_config(record)
    auto = model_auto_class(config, record["trust_remote_code"])
    model, info = auto.from_pretrained(
        record["load_path"],
        config=config,
        dtype=dtype,
        device_map=device_map,
        trust_remote_code=record["trust_remote_code"],
        use_safetensors=not record["allow_pickle"],
        output_loading_info=True,
    )
    missing = sorted(info.get("missing_keys") or [])
    if missing:  # transformers would leave them random: states of another model
        shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
        raise UserError(
            f"verifier {record['path']!r}: its weight files lack {len(missing)} of the model's "
            f"tensors ({shown}); check that they belong to its config.json (model type, "
            "layer count, tensor names)"
        )
    model.eval()
    print(
        f"verifier: loaded {record['name']} in {time.perf_counter() - t0:.1f} s",
        file=sys.stderr,
        flush=True,
    )
    return model


def device_map_for_job():
    """HF device_map for the GPUs this job leased: none on CPU, one GPU, or spread over all."""
    import torch

    if not torch.cuda.is_available():
        return None
    return "auto" if torch.cuda.device_count() > 1 else {"": 0}


def allow_recompiles(limit: int) -> None:
    """Let dynamo compile a frame up to ``limit`` times in this process (never lowered; the
    limit on all frames together is raised to match). Past its limit (8 by default) dynamo
    runs every call that matches none of the frame's compiled variants uncompiled, and flex
    attention there falls back to an unfused kernel that materialises the whole score matrix."""
    import torch

    config = torch._dynamo.config  # noqa: SLF001
    for key in ("cache_size_limit", "recompile_limit", "accumulated_recompile_limit"):
        if hasattr(config, key):
            setattr(config, key, max(getattr(config, key), limit))


@contextlib.contextmanager
def compile_fallbacks():
    """Inside the block, the functions that reached dynamo's recompile limit (from then on a
    call that matches none of their compiled variants runs uncompiled), as the list yielded:
    one line each, "'name' (file:line)", from dynamo's own warning (logged at WARNING, which
    TORCH_LOGS can silence), each function once."""
    found: list[str] = []

    class Hits(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines = record.getMessage().splitlines()
            if lines and lines[0].startswith("torch._dynamo hit config."):
                where = [x.split("function:", 1)[1].strip() for x in lines if "function:" in x]
                if (name := where[0] if where else lines[0]) not in found:
                    found.append(name)

    logger = logging.getLogger("torch._dynamo.convert_frame")
    handler = Hits(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield found
    finally:
        logger.removeHandler(handler)


@contextlib.contextmanager
def compiled_layers(model):
    """Each decoder layer's forward under torch.compile (dynamic shapes) inside the block; the
    eager forwards are put back on leaving it. Hooks on the layers still run (eagerly, around
    the compiled forward). Compilation happens at the first call, where its errors surface."""
    import torch

    layers = decoder_layers(model)
    # The layers share one compiled graph where dynamo inlines the modules (torch's default);
    # room for an entry per layer object and per batch-size-1 specialisation where it cannot.
    allow_recompiles(4 * len(layers) + 8)
    # an instance attribute already there (accelerate's hooks put one) is put back as it was
    own = [layer.__dict__.get("forward") for layer in layers]
    try:
        for layer in layers:
            layer.forward = torch.compile(layer.forward, dynamic=True)
        yield layers
    finally:
        for layer, forward in zip(layers, own, strict=True):
            if forward is None:
                del layer.forward  # the class's forward again
            else:
                layer.forward = forward


def decoder_layers(model):
    """The ModuleList of decoder layers of the language model (nested models included)."""
    import torch

    n = text_config(model.config).num_hidden_layers
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    layers = getattr(decoder, "layers", None)
    if isinstance(layers, torch.nn.ModuleList) and len(layers) == n:
        return layers
    candidates = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.ModuleList) and len(module) == n and name.endswith("layers")
    ]
    if not candidates:
        raise UserError(f"cannot find the {n} decoder layers of {type(model).__name__}")
    # The language model's layers have the shortest path among same-length lists.
    return min(candidates, key=lambda c: c[0].count("."))[1]


def text_decoder(model):
    """The language model's base decoder (embeddings, decoder layers, final norm): the module
    extraction runs, without a vision tower or an LM head (whatever ``get_decoder`` returns)."""
    layers = decoder_layers(model)
    for module in model.modules():
        if getattr(module, "layers", None) is layers:
            return module
    raise UserError(f"cannot find the module holding the decoder layers of {type(model).__name__}")
