"""The language model's embeddings, LM head and final norm: resolved from the verifier's own class
and transformers' key mapping, never by a suffix search (eagle3lib/lm_weights.py)."""

import shutil

import pytest
import tiny
import torch

from eagle3lib import lm_weights, verifier
from eagle3lib.errors import UserError


@pytest.fixture(scope="module")
def small_verifier(tmp_path_factory):
    return tiny.build_verifier(tmp_path_factory.mktemp("lm") / "tiny-llama", layers=2)


def edited(small_verifier, tmp_path, **edits):
    folder = tmp_path / "verifier"
    shutil.copytree(small_verifier, folder)
    return tiny.edit_weights(folder, **edits)


def materialize_error(folder, tmp_path) -> str:
    with pytest.raises(UserError) as err:
        verifier.materialize(str(folder), None, tmp_path / "hf")
    message = str(err.value)
    assert "\n" not in message and f"verifier {str(folder)!r}" in message
    return message


def test_record_holds_the_language_models_keys(verifier_record):
    assert {part: r["key"] for part, r in verifier_record["lm_weights"].items()} == {
        "embed_tokens": "model.embed_tokens.weight",
        "lm_head": "lm_head.weight",
        "norm": "model.norm.weight",
    }
    assert verifier_record["lm_weights"]["embed_tokens"]["shape"] == [400, 64]


def test_a_tied_lm_head_is_the_embeddings(tmp_path):
    folder = tiny.build_verifier(tmp_path / "tied", layers=2, tie_word_embeddings=True)
    record = verifier.materialize(str(folder), None, tmp_path / "hf")
    head = record["lm_weights"]["lm_head"]
    assert head["key"] == "model.embed_tokens.weight" and head["tied"] is True
    tensors = lm_weights.load(record)
    assert torch.equal(tensors["lm_head"], tensors["embed_tokens"])


def test_two_keys_loading_one_parameter_are_ambiguous(small_verifier, tmp_path):
    """transformers loads a key without the base-model prefix into the same parameter."""
    embed = torch.randn(400, 64)
    folder = edited(small_verifier, tmp_path, add={"embed_tokens.weight": embed})
    message = materialize_error(folder, tmp_path)
    assert "the language model's embed_tokens (model.embed_tokens.weight)" in message
    assert "loaded by 2 tensors of its weights: embed_tokens.weight, model.embed_tokens.weight" in (
        message
    )
    assert message.endswith("keep one of them in the checkpoint")


def test_a_missing_norm_names_the_candidates(small_verifier, tmp_path):
    decoy = {"vision.norm.weight": torch.ones(64)}
    folder = edited(small_verifier, tmp_path, add=decoy, drop=("model.norm.weight",))
    message = materialize_error(folder, tmp_path)
    assert "the language model's norm (model.norm.weight) is in none of its weight files" in (
        message
    )
    assert "(tensors ending in norm.weight: vision.norm.weight)" in message


def test_a_wrong_shape_is_named(small_verifier, tmp_path):
    folder = edited(small_verifier, tmp_path, add={"model.norm.weight": torch.ones(32)})
    message = materialize_error(folder, tmp_path)
    assert "tensor model.norm.weight has shape [32], its config implies [64]" in message


def test_speculators_gets_exactly_the_resolved_tensors(verifier_record, verifier_model):
    from speculators.utils import loading

    original = loading.load_model_layers
    names = ["embed_tokens.weight", "lm_head.weight", "model.norm.weight"]
    with lm_weights.speculators_reads(verifier_record):
        got = loading.load_model_layers(names, verifier_record["load_path"])
        with pytest.raises(RuntimeError, match="only .* are resolved"):
            loading.load_model_layers(names, "/somewhere/else")
        with pytest.raises(RuntimeError, match="asked for"):
            loading.load_model_layers(
                ["model.layers.0.mlp.up_proj.weight"], verifier_record["load_path"]
            )
    assert loading.load_model_layers is original
    want = [
        verifier_model.get_input_embeddings().weight,
        verifier_model.get_output_embeddings().weight,
        verifier_model.get_decoder().norm.weight,
    ]
    for name, tensor in zip(names, want, strict=True):
        assert torch.equal(got[name], tensor.detach()), name
