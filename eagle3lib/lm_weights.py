"""The language model's own embeddings, final norm and LM head, found from the verifier's class.

speculators reads these three tensors of the verifier (the draft's ``embed_tokens``,
``verifier_norm`` and ``verifier_lm_head``/``lm_head``) with
``speculators.utils.loading.load_model_layers``, which takes the shortest checkpoint key that
ends in ``embed_tokens.weight`` (and so on): a vision tower's tensor of a multimodal verifier
wins when its name is shorter. Here the verifier's own model class, built on the meta device
(no memory), says which parameters they are (``get_input_embeddings``,
``get_output_embeddings``, the language model's final norm), and transformers' own checkpoint
key mapping (what ``from_pretrained`` uses) says which checkpoint key loads each. A parameter
that no key, or more than one key, loads stops the verifier rule with one line naming the
candidates. ``speculators_reads`` hands speculators exactly these tensors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from eagle3lib.errors import UserError, first_line

PARTS = ("embed_tokens", "lm_head", "norm")
# The names speculators asks its loader for, and which part each is.
SPECULATORS_NAMES = {
    "embed_tokens.weight": "embed_tokens",
    "lm_head.weight": "lm_head",
    "model.norm.weight": "norm",
}
# Attribute names of a decoder's final norm in transformers' language models.
NORM_NAMES = ("norm", "final_layernorm", "norm_f", "ln_f")
MAX_NAMED = 8


def weight_index(load_path: str, kind: str, allow_pickle: bool) -> dict[str, tuple[str, list]]:
    """{checkpoint key: (file name, shape)} of a verifier's weights: local safetensors files,
    else local pickle files (read with ``weights_only=True``, only when allowed), or a hub
    repository's safetensors metadata."""
    index: dict[str, tuple[str, list]] = {}
    if kind == "hub":
        from huggingface_hub import get_safetensors_metadata, snapshot_download

        try:
            meta = get_safetensors_metadata(load_path)
        except Exception as exc:  # noqa: BLE001 - offline, missing repository, no safetensors
            try:  # offline: the weights in the local hub cache
                folder = snapshot_download(
                    load_path, allow_patterns=["*.safetensors*"], local_files_only=True
                )
            except Exception:  # noqa: BLE001
                raise UserError(
                    f"config key verifier.path: cannot read the weight index of {load_path!r} "
                    f"({first_line(exc)}); use a local model folder or a reachable "
                    "hub id"
                ) from None
            return weight_index(folder, "local", allow_pickle)
        for name, info in meta.files_metadata.items():
            for key, tensor in info.tensors.items():
                index[key] = (name, list(tensor.shape))
        return index
    from safetensors import safe_open

    folder = Path(load_path)
    files = sorted(folder.glob("*.safetensors"))
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():  # noqa: SIM118 - safe_open has no __iter__
                index[key] = (f.name, list(fh.get_slice(key).get_shape()))
    if not files and allow_pickle:
        for f in sorted(p for ext in ("*.bin", "*.pt", "*.pth") for p in folder.glob(ext)):
            for key, tensor in _pickled(f).items():
                index[key] = (f.name, list(tensor.shape))
    return index


def _pickled(path: Path) -> dict[str, Any]:
    import torch

    return torch.load(path, map_location="cpu", mmap=True, weights_only=True)


def read_tensor(load_path: str, kind: str, file: str, key: str):
    """One tensor of a verifier's weights (a hub file is downloaded, or read from its cache)."""
    if kind == "hub":
        from huggingface_hub import hf_hub_download

        path = Path(hf_hub_download(load_path, file))
    else:
        path = Path(load_path) / file
    if path.suffix != ".safetensors":
        return _pickled(path)[key].clone()
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        return fh.get_tensor(key)


def meta_model(config, trust_remote_code: bool):
    """The verifier's model class (with its LM head) built on the meta device."""
    import torch

    from eagle3lib.verifier import model_auto_class

    auto = model_auto_class(config, trust_remote_code)
    with torch.device("meta"):
        return auto.from_config(config, trust_remote_code=trust_remote_code)


def parameter_names(model) -> dict[str, str | None]:
    """{part: parameter name} of the language model's embeddings, final norm and LM head;
    the LM head is None when it is the embeddings' tensor (tied)."""
    from eagle3lib.verifier import text_decoder

    names = {id(module): name for name, module in model.named_modules()}
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is None:
        raise UserError(f"verifier class {type(model).__name__} has no LM head (output embeddings)")
    decoder = text_decoder(model)
    norm = next((getattr(decoder, n) for n in NORM_NAMES if hasattr(decoder, n)), None)
    if norm is None or getattr(norm, "weight", None) is None:
        raise UserError(
            f"verifier class {type(model).__name__}: its language model "
            f"{type(decoder).__name__} has no final norm named {' or '.join(NORM_NAMES)}"
        )
    return {
        "embed_tokens": f"{names[id(embed)]}.weight",
        "lm_head": None if head.weight is embed.weight else f"{names[id(head)]}.weight",
        "norm": f"{names[id(norm)]}.weight",
    }


def loading_keys(model, keys, targets: set[str]) -> dict[str, list[str]]:
    """{parameter name: the checkpoint keys that load it}, by transformers' own key mapping
    (renamings of the model's conversion mapping, base-model prefix), as from_pretrained
    does. A key that a weight converter assembles with others counts as loading nothing."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    meta = model.state_dict()
    prefix = model.base_model_prefix
    found: dict[str, list[str]] = {t: [] for t in targets}
    for key in keys:
        renamed, converted = rename_source_key(key, renamings, converters, prefix, meta)
        if renamed not in meta and key in meta:
            renamed, converted = rename_source_key(key, [], [], prefix, meta)
        if renamed in found and converted is None:
            found[renamed].append(key)
    return found


def _named(keys: list[str]) -> str:
    shown = ", ".join(keys[:MAX_NAMED])
    return shown + (f" and {len(keys) - MAX_NAMED} more" if len(keys) > MAX_NAMED else "")


def resolve(
    path: str, load_path: str, kind: str, config, trust_remote_code: bool, allow_pickle: bool
) -> dict[str, dict[str, Any]]:
    """{part: {"key", "file", "shape"}} of the language model's embeddings, LM head and final
    norm in the verifier's weights (``"tied": True`` on an LM head that is the embeddings).
    ``path`` names the verifier in errors."""
    from eagle3lib.verifier import text_config

    index = weight_index(load_path, kind, allow_pickle)
    model = meta_model(config, trust_remote_code)
    targets = parameter_names(model)
    found = loading_keys(model, index, {t for t in targets.values() if t})
    tc = text_config(config)
    expected = {
        "embed_tokens": [tc.vocab_size, tc.hidden_size],
        "lm_head": [tc.vocab_size, tc.hidden_size],
        "norm": [tc.hidden_size],
    }
    resolved: dict[str, dict[str, Any]] = {}
    for part in PARTS:
        target = targets[part]
        if target is None:
            resolved[part] = {**resolved["embed_tokens"], "tied": True}
            continue
        keys = found[target]
        what = f"verifier {path!r}: the language model's {part} ({target})"
        if len(keys) > 1:
            raise UserError(
                f"{what} is loaded by {len(keys)} tensors of its weights: {_named(keys)}; "
                "keep one of them in the checkpoint"
            )
        if not keys:
            leaf = ".".join(target.split(".")[-2:])
            candidates = [k for k in index if k == leaf or k.endswith("." + leaf)]
            raise UserError(
                f"{what} is in none of its weight files (tensors ending in {leaf}: "
                f"{_named(candidates) or 'none'}); check that the weights match its config"
            )
        key = keys[0]
        file, shape = index[key]
        if shape != expected[part]:
            raise UserError(
                f"{what}: tensor {key} has shape {shape}, its config implies {expected[part]}; "
                "check that the weights match the config"
            )
        resolved[part] = {"key": key, "file": file, "shape": shape}
    return resolved


def of_record(record: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The resolution in verifier.json, or resolved now for a record written without it."""
    if record.get("lm_weights"):
        return record["lm_weights"]
    from eagle3lib.verifier import load_config

    return resolve(
        record["path"],
        record["load_path"],
        record["kind"],
        load_config(record),
        record["trust_remote_code"],
        record["allow_pickle"],
    )


def load(record: dict[str, Any]) -> dict[str, Any]:
    """{part: tensor} of the language model, as resolved for this verifier."""
    resolved = of_record(record)
    return {
        part: read_tensor(record["load_path"], record["kind"], r["file"], r["key"])
        for part, r in resolved.items()
    }


@contextlib.contextmanager
def speculators_reads(record: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Inside this block speculators' verifier-weight loader returns the language model's
    tensors resolved for this verifier (and refuses any other verifier or tensor name)."""
    from eagle3lib.speculators_compat import speculators_patches

    tensors = load(record)
    with speculators_patches("resolved_verifier_weights", record=record, tensors=tensors):
        yield tensors
