"""Verifiers whose config nests the language model's config as ``text_config``.

Tiny composite verifiers built locally: Qwen3-VL (transformers-native, an image-text-to-text
model with no causal-LM class) and Kimi-K2.5 style (outer config + vision tower around a
DeepSeek-V3 language model with MLA and MoE), once as a custom-code folder that needs
``trust_remote_code`` (the hub's form) and once with transformers' own Kimi_K25 classes. Each
goes through the real code paths: materialize, hidden-state extraction (checked against a
one-sample HF forward), training, export/check, evaluation.
"""

import functools
from pathlib import Path

import pytest
import tiny
import torch
from conftest import assert_same_bytes

from eagle3lib import (
    checkpoint,
    data,
    evaluate,
    hidden_states,
    report_text,
    shards,
    train,
    verifier,
    vocab,
)
from eagle3lib.config import EvaluateConfig, ExtractConfig, PrepareConfig, TrainConfig
from eagle3lib.errors import UserError
from eagle3lib.fileio import read_json

AUX = [2, 4, 5]  # speculators' default for 8 layers
KINDS = {  # builder, trust_remote_code
    "qwen_vl": (tiny.build_qwen_vl_verifier, False),
    "kimi": (tiny.build_kimi_verifier, True),
    "kimi_native": (functools.partial(tiny.build_kimi_verifier, custom_code=False), False),
}
MODEL_CLASSES = {  # the whole verifier, its language model
    "qwen_vl": ("Qwen3VLForConditionalGeneration", "Qwen3VLTextModel"),
    "kimi": ("TinyKimiK25ForConditionalGeneration", "DeepseekV3Model"),
    "kimi_native": ("Kimi_K25ForConditionalGeneration", "DeepseekV3Model"),
}


@pytest.fixture(scope="module", params=sorted(KINDS))
def nested(request, tmp_path_factory):
    """(kind, record, model, tokenizer) of one tiny nested verifier."""
    build, trust = KINDS[request.param]
    folder = build(tmp_path_factory.mktemp("nested") / f"tiny-{request.param}")
    record = verifier.materialize(str(folder), None, folder.parent / "hf", trust_remote_code=trust)
    model = verifier.load_model(record, torch.float32)
    return request.param, record, model, verifier.load_tokenizer(record)


def test_custom_code_verifier_needs_trust_remote_code(tmp_path):
    folder = tiny.build_kimi_verifier(tmp_path / "tiny-kimi-refused", layers=2)
    with pytest.raises(UserError, match=r"verifier\.trust_remote_code") as err:
        verifier.materialize(str(folder), None, tmp_path / "hf")
    assert "\n" not in str(err.value) and "tiny_kimi_k25" in str(err.value)
    record = verifier.materialize(str(folder), None, tmp_path / "hf", trust_remote_code=True)
    assert record["trust_remote_code"] is True and record["custom_code"] is True  # verifier.json
    assert "`verifier.trust_remote_code: true` (its own code ran)" in report_text.trust_note(record)
    # Once this process has registered the trusted class, an untrusted run is still refused.
    verifier.load_config(record)
    with pytest.raises(UserError, match=r"verifier\.trust_remote_code"):
        verifier.materialize(str(folder), None, tmp_path / "hf")


def test_record_describes_the_language_model(nested):
    kind, record, _, tokenizer = nested
    expect = {
        "qwen_vl": ("qwen3_vl", "qwen3_vl_text", False),
        "kimi": ("tiny_kimi_k25", "deepseek_v3", True),
        "kimi_native": ("kimi_k25", "deepseek_v3", False),
    }[kind]
    assert (record["model_type"], record["text_model_type"], record["custom_code"]) == expect
    assert record["trust_remote_code"] is expect[2]
    assert (record["num_hidden_layers"], record["hidden_size"]) == (8, 64)
    assert record["max_position_embeddings"] == 2048  # the text config's, not the outer one's
    assert record["vocab_size"] == len(tokenizer)


def test_loads_the_whole_model_and_finds_its_language_model(nested):
    kind, _, model, _ = nested
    decoder = verifier.text_decoder(model)
    layers = verifier.decoder_layers(model)
    assert decoder.layers is layers and len(layers) == 8
    assert decoder.embed_tokens is model.get_input_embeddings()
    assert (type(model).__name__, type(decoder).__name__) == MODEL_CLASSES[kind]
    if kind.startswith("kimi"):
        attn = layers[1].self_attn  # MLA: low-rank q and compressed kv with a rope part
        assert hasattr(attn, "q_a_proj") and hasattr(attn, "kv_a_proj_with_mqa")
        assert not hasattr(layers[0].mlp, "experts")  # first_k_dense_replace = 1
        assert all(hasattr(layer.mlp, "experts") for layer in layers[1:])  # MoE


def test_plain_causal_lm_is_unchanged(verifier_record, verifier_model):
    from transformers import AutoModelForCausalLM

    config = verifier.load_config(verifier_record)
    assert verifier.model_auto_class(config, False) is AutoModelForCausalLM
    assert verifier.text_decoder(verifier_model) is verifier_model.get_decoder()
    assert verifier_record["custom_code"] is False


def test_capture_equals_one_sample_hf_forward_with_pre_norm_last_layer(nested):
    _, _, model, tokenizer = nested
    [(ids, _)] = data.tokenize_conversation(
        tokenizer, tiny.conversations(1, seed=3, fmt="openai")[0]["messages"]
    )
    capture = hidden_states.Capture(verifier.decoder_layers(model), AUX)
    try:
        [states] = hidden_states.forward_states(
            verifier.text_decoder(model), capture, [ids], hidden_states.input_device(model)
        )
    finally:
        capture.remove()
    with torch.no_grad():
        ref = model(torch.as_tensor(ids)[None], output_hidden_states=True).hidden_states
    assert len(ref) == 9 and states.shape == (len(ids), 4, 64)
    for slot, k in enumerate(AUX):
        torch.testing.assert_close(states[:, slot], ref[k][0], rtol=1e-5, atol=1e-5)
    last = states[:, -1]  # before the language model's final norm; HF's last entry is after it
    norm = verifier.text_decoder(model).norm
    torch.testing.assert_close(norm(last), ref[-1][0], rtol=1e-5, atol=1e-5)
    assert (last - ref[-1][0]).abs().max() > 0.1


def extract_and_train(record, tokenizer, tmp_path, name):
    """Prepared samples, one shard, a vocab map, one epoch of training and the exported
    checkpoint of a nested verifier (seeded: the same verifier tensors give the same bytes)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tiny.write_jsonl(tmp_path / "train.jsonl", tiny.conversations(12, seed=5))
    prepared = data.prepare_samples(tokenizer, path, PrepareConfig(max_length=96))
    data.save_prepared(prepared, tmp_path / "samples.safetensors", record["vocab_size"])
    samples = data.load_samples(tmp_path / "samples.safetensors")
    shard, manifest = tmp_path / "shard-0.safetensors", tmp_path / "shard-0.json"
    hidden_states.extract_shard(
        samples, prepared.ids, 0, ExtractConfig(shards=1, batch_tokens=384), record, shard, manifest
    )
    d2t, t2d = vocab.build(samples.token_freq, 256)
    cfg = TrainConfig(
        epochs=1, total_seq_len=256, draft_vocab_size=256, optimizer="adamw", lr=3e-3, seed=0
    )
    stats = train.train(
        cfg, record, [shard], [manifest], {"d2t": d2t, "t2d": t2d}, tmp_path / "s", tmp_path / "m"
    )
    out = tmp_path / "checkpoint"
    config = checkpoint.export(Path(stats["final_epoch_dir"]), out, name)
    return {"shard": shard, "manifest": manifest, "t2d": t2d, "config": config, "checkpoint": out}


def test_extract_train_check_and_evaluate(nested, tmp_path):
    kind, record, model, tokenizer = nested
    run = extract_and_train(record, tokenizer, tmp_path, kind)
    shard, manifest, t2d, config, out = (
        run[k] for k in ("shard", "manifest", "t2d", "config", "checkpoint")
    )
    assert read_json(manifest)["layer_ids"] == [*AUX, 8]
    assert read_json(manifest)["hidden_size"] == 64

    # Batched extraction equals a one-sample forward of the whole HF model (bf16 storage).
    stored = shards.open_shard(shard)
    norm = verifier.text_decoder(model).norm
    for i in (0, len(stored) - 1):
        item = stored.sample(i)
        with torch.no_grad():
            ref = model(item["input_ids"].long()[None], output_hidden_states=True).hidden_states
        got = item["hidden_states"].float()
        for slot, k in enumerate(AUX):
            torch.testing.assert_close(got[:, slot], ref[k][0], rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(norm(got[:, -1]), ref[-1][0], rtol=5e-2, atol=5e-2)

    assert config["transformer_layer_config"]["hidden_size"] == 64
    assert config["transformer_layer_config"]["vocab_size"] == record["vocab_size"]
    # check() reloads the draft with speculators, which reads a custom-code verifier's config
    # without trust_remote_code: load_model registered the trusted class in this process.
    checked = checkpoint.check(out, record, AUX)
    assert checked["valid"], checked["problems"]

    # The draft's verifier-derived weights are the language model's (bf16 in the checkpoint).
    draft = checkpoint.load_draft(out, record, "sdpa", torch.float32)
    lm_head = model.get_output_embeddings().weight
    pairs = [
        (draft.embed_tokens.weight, model.get_input_embeddings().weight),
        (draft.verifier_lm_head.weight, lm_head[t2d.bool()]),
        (draft.verifier_norm.weight, norm.weight),
    ]
    for got, want in pairs:
        torch.testing.assert_close(got, want.detach(), rtol=2**-8, atol=0)

    prompts = [
        {"id": str(i), "token_ids": data.prompt_token_ids(tokenizer, text)}
        for i, text in enumerate(["Tell me about the draft model", "Why is decoding fast"])
    ]
    sets = [{"name": "eval", "prompts": prompts}]
    result, replayed = (
        evaluate.evaluate(
            model, draft, tokenizer, sets, EvaluateConfig(k=2, max_new_tokens=10, method=m), AUX,
            log=lambda m: None,
        )
        for m in ("decode", "replay")
    )  # fmt: skip
    assert result["text_matches_verifier"] is True and result["steps"] > 0
    assert [replayed[k] for k in ("steps", "accepted_tokens")] == [
        result[k] for k in ("steps", "accepted_tokens")
    ]


@pytest.mark.slow
def test_a_vision_tensor_named_like_the_embeddings_is_never_trained_on(tmp_path):
    """A multimodal checkpoint with a vision weight whose name ends in embed_tokens.weight and
    is shorter than the language model's (speculators' suffix search picks it): with the same
    shape as the language model's embeddings, and with another shape. The draft is built from
    the language model's tensors in both cases: the exported weights equal those of the same
    verifier without the decoy, byte for byte, and its embed_tokens are the language model's."""
    import shutil

    from safetensors.torch import load_file

    plain = tiny.build_qwen_vl_verifier(tmp_path / "tiny-qwen_vl")
    folders = {"plain": plain}
    noise = torch.Generator().manual_seed(3)
    for name, rows in (("same_shape", None), ("other_shape", 7)):
        folders[name] = tmp_path / f"tiny-qwen_vl-{name}"
        shutil.copytree(plain, folders[name])
        decoy = torch.randn(rows or 400, 64, generator=noise) * 3
        tiny.edit_weights(folders[name], add={"model.visual.embed_tokens.weight": decoy})
    exported = {}
    for name, folder in folders.items():
        record = verifier.materialize(str(folder), None, tmp_path / "hf")
        assert record["lm_weights"]["embed_tokens"]["key"] == (
            "model.language_model.embed_tokens.weight"
        )
        tokenizer = verifier.load_tokenizer(record)
        run = extract_and_train(record, tokenizer, tmp_path / name, "qwen_vl")
        exported[name] = (run["checkpoint"] / "model.safetensors").read_bytes()
    assert_same_bytes(exported["same_shape"], exported["plain"], "same_shape against plain")
    assert_same_bytes(exported["other_shape"], exported["plain"], "other_shape against plain")
    model = verifier.load_model(record, torch.float32)
    weights = load_file(str(run["checkpoint"] / "model.safetensors"))
    lm_embed = model.get_input_embeddings().weight.detach().to(torch.bfloat16)
    assert torch.equal(weights["embed_tokens.weight"], lm_embed)
    decoy = load_file(str(folders["same_shape"] / "model.safetensors"))
    assert not torch.equal(
        weights["embed_tokens.weight"], decoy["model.visual.embed_tokens.weight"].to(torch.bfloat16)
    )
