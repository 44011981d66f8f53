import json
import shutil

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from eagle3lib import checkpoint


def test_exported_checkpoint_is_portable_and_valid(pipeline):
    ckpt = pipeline["checkpoint"]
    config = json.loads((ckpt / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["speculators_config"]["verifier"]["name_or_path"] == "tiny-llama"
    assert checkpoint.absolute_paths(config) == []
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert config["draft_vocab_size"] == 256
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    tensors = load_file(str(ckpt / "model.safetensors"))
    assert torch.equal(tensors["d2t"], pipeline["vocab_map"]["d2t"])
    assert torch.equal(tensors["t2d"], pipeline["vocab_map"]["t2d"])
    assert (
        tensors["fc.weight"].shape == (64, 3 * 64) and tensors["fc.weight"].dtype == torch.bfloat16
    )
    assert tensors["lm_head.weight"].shape == (256, 64)

    report = checkpoint.check(ckpt, pipeline["record"], [2, 4, 5])
    assert report["problems"] == [] and report["valid"] is True
    assert report["reload_forward"] == {"ttt_steps": 3, "shape": [1, 8]}


@pytest.fixture
def broken(pipeline, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(pipeline["checkpoint"], ckpt)
    return ckpt


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (lambda c: [], "config.json holds a JSON list, not an object"),
        (lambda c: {**c, "speculators_config": None},
         "speculators_config.verifier.name_or_path is empty (vLLM requires it)"),
        (lambda c: {**c, "transformer_layer_config": [1]}, "hidden_size None != verifier 64"),
    ],
    ids=["list", "null-section", "list-section"],
)  # fmt: skip
def test_check_reports_a_config_of_the_wrong_shape(broken, pipeline, damage, problem):
    """Valid JSON of the wrong shape (a list, a section null or a list) is a problem in the
    report, not an exception (check never raises for a bad checkpoint)."""
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps(damage(config)))
    report = checkpoint.check(broken, pipeline["record"], [2, 4, 5])
    assert report["valid"] is False
    assert problem in report["problems"]


def rewrite_tensors(ckpt, fn):
    tensors = load_file(str(ckpt / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(ckpt / "model.safetensors"))


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (lambda t: t.pop("fc.weight"), "tensor fc.weight missing"),
        (lambda t: t.update({"norm.weight": t["norm.weight"].float()}), "norm.weight is F32"),
        (
            lambda t: t.update({"lm_head.weight": torch.zeros(10, 64, dtype=torch.bfloat16)}),
            "lm_head.weight has shape [10, 64]",
        ),
        (lambda t: t.update({"d2t": t["d2t"].flip(0)}), "d2t does not map"),
        (lambda t: t.update({"t2d": torch.zeros_like(t["t2d"])}), "t2d marks 0 tokens"),
    ],
)
def test_damaged_tensors_are_reported(broken, pipeline, damage, problem):
    rewrite_tensors(broken, damage)
    report = checkpoint.check(broken, pipeline["record"], [2, 4, 5])
    assert report["valid"] is False
    assert any(problem in p for p in report["problems"]), report["problems"]


def test_config_problems_are_reported(broken, pipeline):
    config = json.loads((broken / "config.json").read_text())
    config["speculators_config"]["verifier"]["name_or_path"] = "/home/me/models/tiny"
    (broken / "config.json").write_text(json.dumps(config))
    report = checkpoint.check(broken, pipeline["record"], [1, 2, 3])
    assert any("absolute path" in p for p in report["problems"])
    assert any("!= extraction layers [1, 2, 3]" in p for p in report["problems"])


def test_truncated_weights_are_reported(broken, pipeline):
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    report = checkpoint.check(broken, pipeline["record"], [2, 4, 5])
    assert report["valid"] is False
    assert report["problems"][0].startswith("model.safetensors unreadable")


def test_model_card_has_the_vllm_command(pipeline):
    config = json.loads((pipeline["checkpoint"] / "config.json").read_text())
    card = checkpoint.model_card(
        config, pipeline["record"], {"epochs": 2, "train_samples": 36, "device": "cpu"}
    )
    assert "vllm serve tiny-llama --speculative-config" in card
    assert '"method": "eagle3"' in card and '"num_speculative_tokens": 3' in card
    assert "set `VLLM_CPU_KVCACHE_SPACE`" in card and "reports/summary.md" in card
    # a local folder named by its folder's name: the card says what to give vllm serve
    local = {**pipeline["record"], "kind": "local", "path": "/models/tiny-llama"}
    assert "`tiny-llama` is the verifier folder's name" in checkpoint.model_card(config, local, {})
    named = {**local, "name": "org/tiny-llama"}
    assert "folder's name" not in checkpoint.model_card(config, named, {})
    gguf = {**local, "kind": "gguf", "gguf": {"file": "tiny.Q4_1.gguf"}, "name": "org/tiny"}
    assert "The hidden states came from `tiny.Q4_1.gguf`" in checkpoint.model_card(config, gguf, {})


def test_model_card_header_names_a_hub_verifier_as_base_model(pipeline):
    """The YAML header the Hub reads: the verifier as base_model only where its name is a hub
    id; a folder's name would link to a model that is not it."""
    config = json.loads((pipeline["checkpoint"] / "config.json").read_text())

    def header(record):
        card = checkpoint.model_card(config, record, {})
        assert card.startswith("---\n")
        return yaml.safe_load(card.split("---\n")[1])

    tags = ["speculative-decoding", "eagle3", "speculators", "vllm"]
    assert header(pipeline["record"]) == {"tags": tags}  # tiny-llama: a folder's name
    named = {**pipeline["record"], "name": "org-1/tiny_llama.v2"}
    assert header(named) == {"base_model": "org-1/tiny_llama.v2", "tags": tags}
    for not_an_id in ("org/tiny llama", "a/b/c", "/models/tiny", "org/"):
        assert header({**pipeline["record"], "name": not_an_id}) == {"tags": tags}, not_an_id
