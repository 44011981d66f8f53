"""Loading the verifier: weights read ahead while transformers is imported give the same model
as from_pretrained reading the files itself, and anything that path cannot load falls back."""

import json
from pathlib import Path

import pytest
import tiny
import torch
from safetensors.torch import save_file

from eagle3lib import verifier


def state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def plain_load(record, dtype, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(verifier, "preload_weights", lambda *args: None)
        return verifier.load_model(record, dtype)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_preloaded_weights_build_the_same_model(tmp_path, monkeypatch, tied, dtype):
    folder = tiny.build_verifier(tmp_path / "v", layers=2, tie_word_embeddings=tied)
    record = verifier.materialize(str(folder), None, tmp_path / "hf")
    used = []
    original = verifier.preload_weights
    monkeypatch.setattr(
        verifier, "preload_weights", lambda *a: used.append(original(*a)) or used[-1]
    )
    fast = verifier.load_model(record, dtype)
    assert used and used[0] is not None  # the read-ahead path was taken
    slow = plain_load(record, dtype, monkeypatch)
    a, b = state(fast), state(slow)
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype == dtype, key
        assert torch.equal(a[key], b[key]), key
    assert not fast.training
    emb, head = fast.get_input_embeddings().weight, fast.get_output_embeddings().weight
    assert (emb.data_ptr() == head.data_ptr()) is tied
    ids = torch.tensor([[1, 5, 9, 3]])
    assert torch.equal(fast(ids).logits, slow(ids).logits)


def test_missing_preloaded_parameters_fall_back_to_the_files(tmp_path, monkeypatch, capsys):
    folder = tiny.build_verifier(tmp_path / "v", layers=2)
    record = verifier.materialize(str(folder), None, tmp_path / "hf")
    original = verifier.preload_weights

    def lose_one(*args):
        future = original(*args)
        weights = future.result()
        weights.pop("model.layers.1.mlp.down_proj.weight")
        return future

    monkeypatch.setattr(verifier, "preload_weights", lose_one)
    model = verifier.load_model(record, torch.float32)
    err = capsys.readouterr().err
    assert "1 parameter(s) not in the preloaded weights" in err
    assert "loading from the files instead" in err
    a, b = state(model), state(plain_load(record, torch.float32, monkeypatch))
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_model_safetensors_follows_the_index_and_ignores_other_files(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    assert verifier.model_safetensors(folder) is None
    save_file({"x": torch.zeros(1)}, folder / "consolidated.safetensors")
    assert verifier.model_safetensors(folder) is None  # not the HF model's weights
    save_file({"x": torch.zeros(1)}, folder / "model.safetensors")
    assert verifier.model_safetensors(folder) == [folder / "model.safetensors"]
    weight_map = {"a": "model-00002-of-00002.safetensors", "b": "model-00001-of-00002.safetensors"}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert verifier.model_safetensors(folder) == [
        folder / "model-00001-of-00002.safetensors",
        folder / "model-00002-of-00002.safetensors",
    ]


@pytest.mark.parametrize(
    "change, device_map",
    [
        ({"kind": "hub"}, None),
        ({"trust_remote_code": True}, None),
        ({}, "auto"),  # several GPUs: from_pretrained places the layers itself
        ({}, {"": 1}),
    ],
    ids=["hub", "custom-code", "several-gpus", "other-device"],
)
def test_no_read_ahead_where_from_pretrained_must_read(tmp_path, change, device_map):
    folder = tiny.build_verifier(tmp_path / "v", layers=1)
    record = verifier.materialize(str(folder), None, tmp_path / "hf")
    assert verifier.preload_weights({**record, **change}, device_map) is None
    assert verifier.preload_weights(record, None) is not None
    assert Path(record["load_path"]).is_dir()
