import errno
import os
import re
import struct
import threading

import numpy as np
import pytest
import tiny
import torch
from conftest import assert_same_bytes, prepare_conversations, wait_until

from eagle3lib import config, data, hidden_states, shard_writer, shards
from eagle3lib.config import ExtractConfig
from eagle3lib.errors import UserError
from eagle3lib.fileio import read_json, sha256_file
from eagle3lib.verifier import decoder_layers


def test_aux_layer_defaults_and_validation():
    assert config.resolve_aux_layers(None, 32) == [2, 16, 29]
    assert config.resolve_aux_layers(None, 8) == [2, 4, 5]
    with pytest.raises(UserError, match=r"config key extract.aux_layers: the default \[2, 2, 1\]"):
        config.resolve_aux_layers(None, 4)
    with pytest.raises(UserError, match="duplicate"):
        config.resolve_aux_layers([1, 1, 3], 8)
    with pytest.raises(UserError, match=r"\[8\] out of range \[0, 7\]"):
        config.resolve_aux_layers([1, 3, 8], 8)
    assert config.resolve_aux_layers([5, 0, 3], 8) == [5, 0, 3]


def sample_ids(tokenizer, n, seed=0):
    out = []
    for record in tiny.conversations(n, seed=seed, fmt="openai"):
        [(ids, _)] = data.tokenize_conversation(tokenizer, record["messages"])
        out.append(ids)
    return out


def test_capture_equals_hf_reference_with_pre_norm_last_layer(verifier_model, tokenizer):
    model = verifier_model
    aux = [2, 4, 5]
    ids = sample_ids(tokenizer, 1)[0]
    capture = hidden_states.Capture(decoder_layers(model), aux)
    try:
        [states] = hidden_states.forward_states(
            model.get_decoder(), capture, [ids], torch.device("cpu")
        )
    finally:
        capture.remove()
    with torch.no_grad():
        ref = model(torch.as_tensor(ids)[None], output_hidden_states=True).hidden_states
    assert states.shape == (len(ids), 4, 64)
    for slot, k in enumerate(aux):
        torch.testing.assert_close(states[:, slot], ref[k][0], rtol=0, atol=0)
    last = states[:, -1]
    # HF's last entry is after the final norm; ours is the final decoder layer's output before it.
    torch.testing.assert_close(model.model.norm(last), ref[-1][0], rtol=1e-5, atol=1e-5)
    assert (last - ref[-1][0]).abs().max() > 0.1


def test_batching_does_not_change_per_sample_states(verifier_model, tokenizer):
    model = verifier_model
    samples = sample_ids(tokenizer, 4, seed=1)
    assert len({len(s) for s in samples}) > 1  # padding really happens
    capture = hidden_states.Capture(decoder_layers(model), [1, 3, 6])
    try:
        batched = hidden_states.forward_states(
            model.get_decoder(), capture, samples, torch.device("cpu")
        )
        alone = [
            hidden_states.forward_states(model.get_decoder(), capture, [s], torch.device("cpu"))[0]
            for s in samples
        ]
    finally:
        capture.remove()
    for b, a, s in zip(batched, alone, samples, strict=True):
        assert b.shape == (len(s), 4, 64)
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_length_batches_respect_the_token_budget():
    lengths = [5, 100, 30, 31, 7, 100]
    batches = hidden_states.length_batches(lengths, 128)
    # longest first; a batch grows while its rows times its longest row fit 128 tokens
    assert batches == [[1], [5], [3, 2, 4, 0]]
    assert hidden_states.length_batches(lengths, 200) == [[1, 5], [3, 2, 4, 0]]


@pytest.fixture(scope="module")
def extracted(tokenizer, verifier_record, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("extract")
    prepared, samples = prepare_conversations(tokenizer, verifier_record, tmp, 9, seed=2)
    cfg = ExtractConfig(shards=2, batch_tokens=300)
    stats = hidden_states.extract_shard(
        samples,
        prepared.ids,
        1,
        cfg,
        verifier_record,
        tmp / "shard-1.safetensors",
        tmp / "shard-1.json",
    )
    return tmp, samples, prepared.ids, cfg, stats


def assert_same_states(got: torch.Tensor, want: torch.Tensor) -> None:
    """The same fp32 forward stored as bf16: equal, except that in about one pytest process in
    ten on an AMX CPU the process's first extraction rounds differently (fp32 kernels picked
    differently, amplified by the random layers): then at most 2 % of the values may differ,
    each by at most one bf16 step of the row's scale. A wrong sample, layer or position
    differs everywhere."""
    equal = (got == want).float().mean().item()
    assert equal >= 0.98, f"only {equal:.2%} of the stored values equal the reference"
    scale = want.float().abs().amax(-1, keepdim=True).clamp_min(1e-6)
    assert ((got.float() - want.float()).abs() <= scale * 2**-7).all()


def test_shard_holds_its_slice_with_states_equal_to_one_sample_forward(extracted, verifier_model):
    tmp, samples, ids, _, stats = extracted
    manifest = read_json(tmp / "shard-1.json")
    start, stop = data.shard_range(len(samples), 1, 2)
    assert manifest["sample_range"] == [start, stop] == [4, 9]
    assert manifest["sample_ids"] == ids[4:9]
    assert manifest["layer_ids"] == [2, 4, 5, 8]
    assert manifest["token_counts"] == [len(samples.sample(i)[0]) for i in range(4, 9)]
    shard = shards.open_shard(tmp / "shard-1.safetensors")
    assert len(shard) == 5 and shard.valid.tolist() == [1] * 5
    assert stats["tokens"] == manifest["tokens"] == shard.hidden_states.shape[0]
    shards.check_shard(tmp / "shard-1.safetensors", manifest)

    capture = hidden_states.Capture(decoder_layers(verifier_model), [2, 4, 5])
    try:
        for j, i in enumerate(range(start, stop)):
            item = shard.sample(j)
            tokens, mask = samples.sample(i)
            assert item["input_ids"].tolist() == tokens.tolist()
            assert item["loss_mask"].tolist() == mask.astype(bool).tolist()
            [ref] = hidden_states.forward_states(
                verifier_model.get_decoder(), capture, [tokens], torch.device("cpu")
            )
            assert item["hidden_states"].dtype == torch.bfloat16
            assert_same_states(item["hidden_states"], ref.to(torch.bfloat16))
    finally:
        capture.remove()


def test_shard_bytes_per_token_are_states_plus_five(extracted):
    tmp, *_ = extracted
    manifest = read_json(tmp / "shard-1.json")
    per_token = manifest["file"]["bytes"] / manifest["tokens"]
    assert 4 * 64 * 2 + 5 <= per_token <= 1.01 * 4 * 64 * 2 + 5


def test_states_are_stored_as_computed_and_hashed_while_written(extracted):
    """The manifest's sha256 (computed from the bytes as they were written, no read-back) is
    the file's; states sit in processing order (longest first), tokens in sample order."""
    tmp, samples, _, cfg, _ = extracted
    manifest = read_json(tmp / "shard-1.json")
    assert manifest["file"]["sha256"] == sha256_file(tmp / "shard-1.safetensors")
    shard = shards.open_shard(tmp / "shard-1.safetensors")
    lengths = manifest["token_counts"]
    assert len(set(lengths)) > 1
    order = [i for b in hidden_states.length_batches(lengths, cfg.batch_tokens) for i in b]
    assert order != list(range(len(lengths)))  # the test means something
    assert np.argsort(shard.row_starts, kind="stable").tolist() == order
    assert shard.offsets.tolist() == np.concatenate([[0], np.cumsum(lengths)]).tolist()


def write_two_samples(path, order, second):
    layout = shards.ShardLayout((3, 2), 2, 4, order)
    writer = shard_writer.ShardWriter(path, layout, {"format": "test"})
    states = {0: torch.ones(3, 2, 4), 1: second}
    for i in layout.put_order:
        writer.put_states(i, states[i])
    return writer.close(np.arange(5), np.ones(5, np.uint8))


@pytest.mark.parametrize("order", [None, (1, 0)])
def test_writer_hash_equals_the_file_hash_in_any_order_with_rejected_samples(tmp_path, order):
    bad = torch.full((2, 2, 4), 2.0)
    bad[1, 0, 2] = float("inf")
    digest = write_two_samples(tmp_path / "s.safetensors", order, bad)
    assert digest == sha256_file(tmp_path / "s.safetensors")
    shard = shards.open_shard(tmp_path / "s.safetensors")
    assert shard.valid.tolist() == [1, 0]
    assert shard.sample(0)["hidden_states"].float().eq(1).all()
    assert shard.sample(1)["input_ids"].tolist() == [3, 4]
    assert shard.row_starts.tolist() == ([0, 3] if order is None else [2, 0])


def test_writer_refuses_samples_out_of_layout_order(tmp_path):
    layout = shards.ShardLayout((3, 2), 2, 4, (1, 0))
    writer = shard_writer.ShardWriter(tmp_path / "s.safetensors", layout, {})
    with pytest.raises(ValueError, match="sample 0 put where the layout expects 1"):
        writer.put_states(0, torch.ones(3, 2, 4))
    writer.abort()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="permutation"):
        shards.ShardLayout((3, 2), 2, 4, (0, 0))


def test_format_1_shards_without_row_starts_are_read(tmp_path):
    from safetensors.torch import save_file

    states = torch.arange(5 * 2 * 4, dtype=torch.float32).view(5, 2, 4).to(torch.bfloat16)
    save_file(
        {
            "hidden_states": states,
            "input_ids": torch.arange(5, dtype=torch.int32),
            "loss_mask": torch.ones(5, dtype=torch.uint8),
            "offsets": torch.tensor([0, 3, 5]),
            "valid": torch.ones(2, dtype=torch.uint8),
        },
        str(tmp_path / "old.safetensors"),
        metadata={"format": "eagle3lib.shard/1"},
    )
    shard = shards.open_shard(tmp_path / "old.safetensors")
    assert torch.equal(shard.sample(1)["hidden_states"], states[3:5])


def test_extraction_is_deterministic_and_input_hash_tracks_inputs(
    extracted, verifier_record, tmp_path
):
    tmp, samples, ids, cfg, _ = extracted
    hidden_states.extract_shard(
        samples, ids, 1, cfg, verifier_record, tmp_path / "s.safetensors", tmp_path / "s.json"
    )
    assert_same_bytes(tmp_path / "s.safetensors", tmp / "shard-1.safetensors")
    a = read_json(tmp / "shard-1.json")
    b = read_json(tmp_path / "s.json")
    assert a["file"].pop("name") == "shard-1.safetensors"
    assert b["file"].pop("name") == "s.safetensors"
    assert a == b
    other = {
        **{k: a[k] for k in ("verifier", "layer_ids", "hidden_size")},
        "layer_ids": [1, 2, 3, 8],
    }
    tokens, mask, offsets = np.zeros(3, dtype=np.int32), np.zeros(3, np.uint8), np.array([0, 3])
    base = shards.input_hash(tokens, mask, offsets, other)
    assert base == shards.input_hash(tokens.copy(), mask.copy(), offsets.copy(), dict(other))
    changed = [  # each input of a shard's bytes, changed alone, changes the hash
        shards.input_hash(tokens + 1, mask, offsets, other),
        shards.input_hash(tokens, mask + 1, offsets, other),
        shards.input_hash(tokens, mask, np.array([0, 1, 3]), other),
        shards.input_hash(tokens, mask, offsets, {**other, "layer_ids": [1, 2, 3, 7]}),
        shards.input_hash(tokens, mask, offsets, {**other, "verifier": "another"}),
        shards.input_hash(tokens, mask, offsets, {**other, "storage": "fp8"}),
    ]
    assert len({base, *changed}) == 1 + len(changed)


def test_truncated_or_corrupt_shard_is_detected(extracted, tmp_path):
    tmp, *_ = extracted
    manifest = read_json(tmp / "shard-1.json")
    data_bytes = (tmp / "shard-1.safetensors").read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data_bytes[:-100])
    with pytest.raises(UserError, match="truncated"):
        shards.check_shard(cut, manifest)
    with pytest.raises(UserError, match="truncated or corrupt"):
        shards.open_shard(cut)
    flipped = bytearray(data_bytes)
    flipped[len(flipped) // 2] ^= 0xFF
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(flipped))
    with pytest.raises(UserError, match="does not match the sha256"):
        shards.check_shard(bad, manifest)


def test_manifest_mismatch_names_the_field(extracted):
    tmp, *_ = extracted
    manifest = read_json(tmp / "shard-1.json")
    with pytest.raises(UserError, match="hidden_size=64"):
        shards.check_manifest(manifest, {"hidden_size": 4096}, "shard-1.json")


def test_non_finite_states_reject_the_sample(tmp_path):
    layout = shards.ShardLayout((3, 2), 2, 4)
    writer = shard_writer.ShardWriter(tmp_path / "s.safetensors", layout, {"format": "test"})
    writer.put_states(0, torch.ones(3, 2, 4))
    bad = torch.ones(2, 2, 4)
    bad[1, 0, 2] = float("nan")
    writer.put_states(1, bad)
    writer.close(np.arange(5), np.ones(5, np.uint8))
    shard = shards.open_shard(tmp_path / "s.safetensors")
    assert shard.valid.tolist() == [1, 0]
    assert shard.sample(0)["hidden_states"].float().eq(1).all()
    # The file is valid safetensors too.
    from safetensors.torch import load_file

    tensors = load_file(str(tmp_path / "s.safetensors"))
    assert tensors["hidden_states"].shape == (5, 2, 4)
    assert tensors["offsets"].tolist() == [0, 3, 5]


def test_aborted_writer_leaves_no_file(tmp_path):
    layout = shards.ShardLayout((3,), 2, 4)
    writer = shard_writer.ShardWriter(tmp_path / "s.safetensors", layout, {})
    writer.put_states(0, torch.ones(3, 2, 4))
    writer.abort()
    assert list(tmp_path.iterdir()) == []


def test_fp8_quantization_keeps_every_row_within_e4m3_precision():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 64, generator=gen) * torch.logspace(-3, 3, 5)[:, None, None]
    x[1, 2] = 0.0  # a zero row
    x = x.to(torch.bfloat16)
    values, scales = shards.quantize_fp8(x)
    assert values.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
    assert scales.shape == (5, 3) and scales[1, 2] == 1.0
    # every row uses e4m3's whole range: its largest value maps to 448 exactly
    assert torch.equal(values.float().abs().amax(-1)[scales != 1], torch.full((14,), 448.0))
    back = shards.dequantize_fp8(values, scales, torch.float32)
    assert torch.equal(back[1, 2], torch.zeros(64))
    big = x.float().abs() >= x.float().abs().amax(-1, keepdim=True) / 64  # e4m3 normal range
    rel = ((back - x.float()).abs() / x.float().abs().clamp_min(1e-30))[big]
    assert rel.max() <= 2**-4 + 1e-6  # 3 mantissa bits: half a step is 1/16
    assert torch.equal(shards.dequantize_fp8(values.view(torch.uint8), scales, torch.float32), back)


def test_fp8_bytes_per_token_at_llama_8b_shape():
    """Half of bf16 within 0.51 at the 8B shape (4 slots of 4096): 16,405 vs 32,773 bytes."""
    bf16 = shards.ShardLayout((2048,), 4, 4096)
    fp8 = shards.ShardLayout((2048,), 4, 4096, storage="fp8")
    assert fp8.bytes_per_token == 16405 and bf16.bytes_per_token == 32773
    assert fp8.data_bytes() / bf16.data_bytes() <= 0.51


@pytest.fixture(scope="module")
def extracted_fp8(extracted, verifier_record, tmp_path_factory):
    tmp, samples, ids, cfg, _ = extracted
    out = tmp_path_factory.mktemp("fp8")
    fp8 = ExtractConfig(shards=cfg.shards, batch_tokens=cfg.batch_tokens, storage="fp8")
    hidden_states.extract_shard(
        samples, ids, 1, fp8, verifier_record, out / "shard-1.safetensors", out / "shard-1.json"
    )
    return out, fp8


def test_fp8_shard_holds_the_bf16_shard_quantized(extracted, extracted_fp8):
    """Byte for byte, the fp8 shard is quantize_fp8 of the bf16 shard's states; its manifest
    carries its own sha256, size and storage; bytes per token as the layout says."""
    tmp, *_ = extracted
    out, _ = extracted_fp8
    bf16 = shards.open_shard(tmp / "shard-1.safetensors")
    fp8 = shards.open_shard(out / "shard-1.safetensors")
    assert fp8.storage == "fp8" and bf16.storage == "bf16"
    for i in range(len(bf16)):
        values, scales = shards.quantize_fp8(bf16.sample(i)["hidden_states"])
        item = fp8.sample(i)
        # byte for byte where the two extractions computed the same bf16 states (see
        # assert_same_states: a process's first extraction may round differently)
        same = (item["hidden_states"].view(torch.uint8) == values.view(torch.uint8)).float()
        assert same.mean().item() >= 0.98, same.mean().item()
        torch.testing.assert_close(item["hidden_scales"], scales, rtol=2**-7, atol=0)
        assert torch.equal(item["input_ids"], bf16.sample(i)["input_ids"])
        torch.testing.assert_close(fp8.states(i), bf16.states(i), rtol=2**-4, atol=1e-2)
    manifest = read_json(out / "shard-1.json")
    assert manifest["state_dtype"] == "float8_e4m3fn"
    assert manifest["file"]["sha256"] == sha256_file(out / "shard-1.safetensors")
    layout = shards.ShardLayout(tuple(manifest["token_counts"]), 4, 64, storage="fp8")
    header = layout.header({"format": shards.SHARD_FORMAT, "input_hash": manifest["input_hash"]})
    assert manifest["file"]["bytes"] == len(header) + layout.data_bytes()
    assert manifest["file"]["bytes"] == (out / "shard-1.safetensors").stat().st_size
    with pytest.raises(UserError, match="state_dtype='float8_e4m3fn'.*'bfloat16'"):
        shards.check_manifest(manifest, {"state_dtype": "bfloat16"}, "shard-1.json")


def test_fp8_extraction_is_byte_reproducible(extracted, extracted_fp8, verifier_record, tmp_path):
    _, samples, ids, *_ = extracted
    out, cfg = extracted_fp8
    again = tmp_path / "again.safetensors"
    hidden_states.extract_shard(samples, ids, 1, cfg, verifier_record, again, tmp_path / "a.json")
    assert_same_bytes(again, out / "shard-1.safetensors")


def test_disk_estimate_line():
    from eagle3lib.shards import disk_estimate

    assert disk_estimate(4096, 4, "bf16", 1_276_971) == (
        "hidden states: 32,773 bytes a token (4 slots of 4096 in bf16; extract.storage: fp8 "
        "would take 16,405); the 1,276,971 prepared tokens need 41.9 GB"
    )
    assert disk_estimate(4096, 4, "fp8").endswith(
        "; 164 GB per 10 M tokens (prepare counts the tokens)"
    )


def _shard_states(path):
    shard = shards.open_shard(path)
    return torch.cat([shard.sample(j)["hidden_states"].float() for j in range(len(shard))])


@pytest.mark.slow
def test_compiled_layers_give_eager_states_and_reproducible_shards(
    extracted, verifier_record, tmp_path, monkeypatch
):
    """extract.compile: true (on the CPU here): torch.compile of each decoder layer stores the
    eager states up to fp32 rounding, and the same bytes twice in one process (one compiled
    code; a fresh compilation elsewhere may round differently). Inductor's cache is this
    test's own, and it compiles in this process: its parallel C++ workers have been seen to
    race for a precompiled header of a fresh cache (a CPU-only path: GPUs compile Triton)."""
    import torch._inductor.config as inductor_config

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    tmp, samples, ids, cfg, _ = extracted
    assert read_json(tmp / "shard-1.json")["compiled"] is False  # the default
    compiled = ExtractConfig(shards=cfg.shards, batch_tokens=cfg.batch_tokens, compile=True)
    paths = [tmp_path / f"c{i}.safetensors" for i in range(2)]
    # the config's own patch: pytest's monkeypatch finds no old value on a torch config module
    # and deletes the key on undo, which hides it from every later compilation in the process
    with inductor_config.patch(compile_threads=1):
        for path in paths:
            stats = hidden_states.extract_shard(
                samples, ids, 1, compiled, verifier_record, path, path.with_suffix(".json")
            )
            assert stats["compiled"] is True and read_json(path.with_suffix(".json"))["compiled"]
    assert_same_bytes(paths[0], paths[1])
    eager = _shard_states(tmp / "shard-1.safetensors")
    # fp32 compute either way; fused kernels round differently in the last fp32 bits, which
    # the 8 random layers amplify (up to 6e-5 seen on values near zero, where a bf16 step is
    # relatively large); inductor's fresh compilations have not always chosen the same kernels
    torch.testing.assert_close(_shard_states(paths[0]), eager, rtol=2**-7, atol=2e-4)


def test_failed_compilation_names_the_key_and_writes_nothing(
    extracted, verifier_record, tmp_path, monkeypatch
):
    tmp, samples, ids, cfg, _ = extracted

    def broken(fn, **kwargs):
        def run(*args, **kw):
            raise RuntimeError("no C++ compiler found\nmore detail")

        return run

    monkeypatch.setattr(torch, "compile", broken)
    compiled = ExtractConfig(shards=cfg.shards, batch_tokens=cfg.batch_tokens, compile=True)
    with pytest.raises(UserError, match=r"extract.compile: .*\(no C\+\+ compiler found\); set "):
        hidden_states.extract_shard(
            samples,
            ids,
            1,
            compiled,
            verifier_record,
            tmp_path / "x.safetensors",
            tmp_path / "x.json",
        )
    assert not list(tmp_path.glob("x.*"))  # nothing half-written


def test_compiled_layers_put_the_eager_forwards_back(verifier_model):
    from eagle3lib.verifier import compiled_layers

    layers = decoder_layers(verifier_model)
    eager = [layer.forward for layer in layers]
    with pytest.raises(KeyError), compiled_layers(verifier_model):
        assert all(layer.forward != f for layer, f in zip(layers, eager, strict=True))
        raise KeyError("a failing job")
    assert [layer.forward for layer in layers] == eager
    assert all("forward" not in layer.__dict__ for layer in layers)  # no instance attribute left


def test_a_job_sharing_its_gpu_compiles_before_its_turn_and_extracts_only_during_it(
    extracted, verifier_model, tmp_path, monkeypatch
):
    """extract.jobs_per_gpu: the turn (eagle3lib.gpu.turn) is taken after compiling and the
    shard writer's set-up, so one job does both while the other extracts, and given back once
    the last states have left the device, before the shard's last writes, fsync and hash; the
    wait is in the stats. (Compiling is replaced by a marker here; the compile tests above
    compile.)"""
    import contextlib

    _, samples, _, cfg, stats = extracted
    events = []

    def compile_marker(*_args, **_kwargs):
        events.append("compile")
        return {"compiled": False, "compile_seconds": 0.0}

    real_forward = hidden_states.forward_batch

    def forward(*args, **kwargs):
        events.append("forward")
        return real_forward(*args, **kwargs)

    @contextlib.contextmanager
    def turn():
        events.append("turn")
        yield 0.25
        events.append("end of turn")

    class Writer(hidden_states.ShardWriter):
        def __init__(self, *args, **kwargs):
            events.append("writer")
            super().__init__(*args, **kwargs)

        def device_done(self):
            events.append("device done")
            super().device_done()

        def close(self, *args):
            events.append("close")
            return super().close(*args)

    monkeypatch.setattr(hidden_states, "_compile_for_job", compile_marker)
    monkeypatch.setattr(hidden_states, "forward_batch", forward)
    monkeypatch.setattr(hidden_states, "ShardWriter", Writer)
    rows = [samples.sample(i) for i in range(4)]
    got = hidden_states.extract_samples(
        verifier_model,
        [r[0] for r in rows],
        [r[1] for r in rows],
        config.resolve_aux_layers(None, verifier_model.config.num_hidden_layers),
        cfg,
        tmp_path / "shard.safetensors",
        {"format": "test"},
        turn=turn,
    )
    forwards = events.count("forward")
    lengths = [len(r[0]) for r in rows]
    assert forwards == len(hidden_states.length_batches(lengths, cfg.batch_tokens))
    assert got["turn_wait_seconds"] == 0.25
    assert events == [
        "compile",
        "writer",
        "turn",
        *["forward"] * forwards,
        "device done",
        "end of turn",
        "close",
    ], events
    assert stats["turn_wait_seconds"] == 0.0  # a job that shares nothing waits for nothing
    assert (tmp_path / "shard.safetensors").stat().st_size > 0


def two_sample_shard(tmp_path, order=(1, 0)):
    """write_two_samples' shard (samples of 3 and 2 tokens, states 1 and 2) and a manifest
    with its size and sha256, as extraction writes them."""
    path = tmp_path / "s.safetensors"
    digest = write_two_samples(path, order, torch.full((2, 2, 4), 2.0))
    return path, {"file": {"bytes": path.stat().st_size, "sha256": digest}}


def test_layout_refuses_an_unknown_storage():
    with pytest.raises(ValueError, match=r"storage must be one of \['bf16', 'fp8'\]"):
        shards.ShardLayout((3, 2), 2, 4, storage="fp16")


def test_fp8_quantizes_the_states_as_the_bf16_shard_holds_them():
    """fp32 states are rounded to bf16 first: the same e4m3 bytes and scales as quantizing
    the bf16 shard's states."""
    x = torch.randn(6, 3, 64, generator=torch.Generator().manual_seed(1))
    values, scales = shards.quantize_fp8(x)
    want_values, want_scales = shards.quantize_fp8(x.to(torch.bfloat16))
    assert torch.equal(values.view(torch.uint8), want_values.view(torch.uint8))
    assert torch.equal(scales, want_scales)


# and S19 (Shard.states defaults to float32 instead of bf16)
def test_shard_length_and_states_of_each_sample(tmp_path):
    """Sample i's length is its token count (3, 2) whatever the row order; its states come
    back as bf16 by default, in the dtype asked for otherwise."""
    path, _ = two_sample_shard(tmp_path)
    shard = shards.open_shard(path)
    assert len(shard) == 2 and [shard.length(i) for i in range(2)] == [3, 2]
    assert shard.states(0).dtype == torch.bfloat16
    assert torch.equal(shard.states(1), torch.full((2, 2, 4), 2.0, dtype=torch.bfloat16))
    assert torch.equal(shard.states(0, torch.float32), torch.ones(3, 2, 4))
    assert shard.states(0, torch.float32).dtype == torch.float32  # torch.equal ignores dtype


@pytest.mark.parametrize("raw", [b"", b"\x08\x00\x00"], ids=["empty", "three-bytes"])
def test_shard_without_a_header_is_reported(tmp_path, raw):
    path = tmp_path / "s.safetensors"
    path.write_bytes(raw)
    with pytest.raises(UserError, match=r"s.safetensors: truncated shard \(no header\)"):
        shards.open_shard(path)


@pytest.mark.parametrize("header", [b'{"a\xff":1}', b'{"a": '], ids=["not-utf8", "not-json"])
def test_corrupt_shard_header_is_reported(tmp_path, header):
    path = tmp_path / "s.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(UserError, match="s.safetensors: corrupt shard header; delete it"):
        shards.open_shard(path)


def test_shard_with_bytes_after_its_data_is_reported(tmp_path):
    path, _ = two_sample_shard(tmp_path)
    size = path.stat().st_size
    path.write_bytes(path.read_bytes() + b"\0" * 16)
    message = f"shard is {size + 16} bytes but its header describes {size}"
    with pytest.raises(UserError, match=message):
        shards.open_shard(path)


def test_shard_arrays_are_copy_on_write(tmp_path):
    """open_shard maps the file copy-on-write: its arrays (and tensors) are writable, and a
    write changes the process's copy, never the file."""
    path, _ = two_sample_shard(tmp_path)
    before = path.read_bytes()
    shard = shards.open_shard(path)
    assert shard.input_ids.flags.writeable and shard.valid.flags.writeable
    shard.input_ids[0] = 99
    shard.hidden_states[0] = 0
    assert shard.sample(0)["input_ids"].tolist() == [99, 1, 2]
    del shard
    assert path.read_bytes() == before


def test_check_shard_reports_a_missing_shard(tmp_path):
    _, manifest = two_sample_shard(tmp_path)
    with pytest.raises(UserError, match="gone.safetensors: missing shard; rerun the workflow"):
        shards.check_shard(tmp_path / "gone.safetensors", manifest)


def test_check_shard_without_the_hash_still_compares_the_size(tmp_path):
    """Ranks other than the first skip the sha256 (full_hash=False) but not the size: a file
    longer than its manifest says is refused too, a matching one accepted."""
    path, manifest = two_sample_shard(tmp_path)
    shards.check_shard(path, manifest, full_hash=False)
    size = manifest["file"]["bytes"]
    path.write_bytes(path.read_bytes() + b"\0")
    with pytest.raises(UserError, match=f"{size + 1} bytes, manifest says {size}: truncated or"):
        shards.check_shard(path, manifest, full_hash=False)


@pytest.mark.parametrize(
    "key, value",
    [("verifier", {"name": "other"}), ("layer_ids", [1, 4, 5, 8]), ("hidden_size", 4096),
     ("state_dtype", "float8_e4m3fn")],
)  # fmt: skip
def test_manifest_mismatch_of_each_key_is_refused(key, value):
    """Each of verifier, layer_ids, hidden_size and state_dtype must equal the config's; a
    key the config does not give is not compared."""
    manifest = {"verifier": {"name": "tiny"}, "layer_ids": [2, 4, 5, 8], "hidden_size": 64,
                "state_dtype": "bfloat16"}  # fmt: skip
    shards.check_manifest(manifest, {k: v for k, v in manifest.items() if k != key}, "m.json")
    shards.check_manifest(manifest, dict(manifest), "m.json")
    with pytest.raises(UserError, match=f"m.json: shard was extracted with {key}="):
        shards.check_manifest(manifest, {**manifest, key: value}, "m.json")


def open_fds() -> set[str]:
    """The file descriptors this process holds now."""
    return set(os.listdir("/proc/self/fd"))


# Catches: a fallocate failure other than "not supported" (a full disk) swallowed instead of
# raised, the errno test inverted, the half-set-up writer's temp file left behind, and its file
# descriptor left open.
def test_writer_on_a_full_disk_names_the_shard_and_leaves_nothing(tmp_path, monkeypatch):
    """A disk too small for the whole shard fails when the writer is made (its blocks are
    reserved up front), naming the file and the size; no temp file and no open descriptor
    stay behind."""

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(shard_writer.os, "posix_fallocate", full)
    layout = shards.ShardLayout((3, 2), 2, 4)
    size = len(layout.header({"format": "test"})) + layout.data_bytes()
    before = open_fds()
    message = (
        rf"s\.safetensors: cannot reserve {size:,} bytes for the shard \(No space left on "
        r"device\); free disk space"
    )
    # the error is kept (as a caller's handler or a traceback printer keeps it): the writer
    # removes its temp file itself, not only when the half-made writer is garbage collected
    with pytest.raises(UserError, match=message) as caught:
        shard_writer.ShardWriter(tmp_path / "s.safetensors", layout, {"format": "test"})
    assert list(tmp_path.iterdir()) == []
    assert open_fds() == before
    del caught


# Catches: the errno test inverted (a file system without fallocate refused instead of
# falling back to ftruncate).
def test_writer_falls_back_where_fallocate_is_not_supported(tmp_path, monkeypatch):
    """On a file system without posix_fallocate (EOPNOTSUPP) the shard is still written whole,
    with the size its header describes and the sha256 close() returns."""
    calls = []

    def unsupported(fd, offset, length):
        calls.append(length)
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr(shard_writer.os, "posix_fallocate", unsupported)
    path = tmp_path / "s.safetensors"
    layout = shards.ShardLayout((3, 2), 2, 4)
    writer = shard_writer.ShardWriter(path, layout, {"format": "test"})
    writer.put_states(0, torch.ones(3, 2, 4))
    writer.put_states(1, torch.full((2, 2, 4), 2.0))
    digest = writer.close(np.arange(5), np.ones(5, np.uint8))
    assert calls == [path.stat().st_size]
    assert digest == sha256_file(path)
    assert torch.equal(shards.open_shard(path).states(1, torch.float32), torch.full((2, 2, 4), 2.0))


# Catches: an error of the background writer thread dropped (close then fails only on the
# row count, or not at all), put_batch not raising the writer's pending error, close not
# raising it, and close's failure leaving the temp file.
def test_a_failed_background_write_is_raised_by_the_next_put_and_by_close(tmp_path, monkeypatch):
    """A write that fails on the writer thread (an I/O error) is raised, as itself, by the next
    put_batch and by close; the half-written shard is removed."""
    real_pwrite = os.pwrite

    def pwrite(fd, data, pos):
        if threading.current_thread().name == "shard-writer":
            raise OSError(errno.EIO, "Input/output error")
        return real_pwrite(fd, data, pos)

    monkeypatch.setattr(shard_writer.os, "pwrite", pwrite)
    layout = shards.ShardLayout((3, 2), 2, 4)
    writer = shard_writer.ShardWriter(tmp_path / "s.safetensors", layout, {"format": "test"})
    writer.put_states(0, torch.ones(3, 2, 4))
    assert wait_until(lambda: writer._error is not None, timeout=10)  # the thread has failed
    with pytest.raises(OSError, match="Input/output error"):
        writer.put_states(1, torch.ones(2, 2, 4))
    with pytest.raises(OSError, match="Input/output error"):
        writer.close(np.arange(5), np.ones(5, np.uint8))
    assert list(tmp_path.iterdir()) == []


# Catches: the periodic fdatasync dropped, its byte counter never reset (a sync after every
# batch once past the threshold), and the threshold compared with > instead of >=.
def test_writer_syncs_every_sync_every_bytes(tmp_path, monkeypatch):
    """With sync_every of 48 bytes (3 rows of 16), the writer fdatasyncs once the unsynced
    bytes reach 48 and starts counting again: 48 (sync), 32, 32+32 (sync): two syncs."""
    synced = []
    monkeypatch.setattr(shard_writer.os, "fdatasync", lambda fd: synced.append(fd))
    layout = shards.ShardLayout((3, 2, 2), 2, 4)
    assert layout.row_bytes == 16
    writer = shard_writer.ShardWriter(
        tmp_path / "s.safetensors", layout, {"format": "test"}, sync_every=48
    )
    for i, n in enumerate(layout.lengths):
        writer.put_states(i, torch.ones(n, 2, 4))
    writer.close(np.arange(7), np.ones(7, np.uint8))
    assert len(synced) == 2


# Catches: the non-finite check reading padding positions (positions < length compared with
# <=, or the mask of real positions dropped): a sample rejected for its pad's values.
def test_non_finite_padding_does_not_reject_a_sample(tmp_path):
    """put_batch takes right-padded batches: a NaN in a padding position (past a sample's
    length) is not a non-finite state; the sample stays valid and only its real rows are
    stored."""
    layout = shards.ShardLayout((3, 2), 2, 4)
    writer = shard_writer.ShardWriter(tmp_path / "s.safetensors", layout, {"format": "test"})
    states = torch.ones(2, 3, 2, 4)
    states[1] = 2.0
    states[1, 2] = float("nan")  # sample 1 has 2 tokens: its third row is padding
    writer.put_batch([0, 1], states, [3, 2])
    writer.close(np.arange(5), np.ones(5, np.uint8))
    shard = shards.open_shard(tmp_path / "s.safetensors")
    assert shard.valid.tolist() == [1, 1]
    assert torch.equal(shard.states(1, torch.float32), torch.full((2, 2, 4), 2.0))
    assert torch.equal(shard.states(0, torch.float32), torch.ones(3, 2, 4))


# Catches: the layout-order check looking only at a batch's first sample, or dropped.
def test_writer_checks_the_order_of_every_sample_of_a_batch(tmp_path):
    """Every sample of a batch must come in layout order, not just the first: a batch [0, 2]
    where the layout expects 0, 1, 2 is refused naming sample 2 and the expected 1."""
    layout = shards.ShardLayout((3, 2, 2), 2, 4)
    writer = shard_writer.ShardWriter(tmp_path / "s.safetensors", layout, {})
    with pytest.raises(ValueError, match="sample 2 put where the layout expects 1"):
        writer.put_batch([0, 2], torch.ones(2, 3, 2, 4), [3, 2])
    writer.abort()
    assert list(tmp_path.iterdir()) == []


# Catches: close not checking that every state row was put (a shard with zero states for the
# samples never put), and a failing close leaving its temp file behind.
def test_close_before_every_sample_was_put_is_refused_and_leaves_nothing(tmp_path):
    """Closing a writer that got 3 of its layout's 5 state rows raises, names the counts, and
    removes the half-written shard."""
    layout = shards.ShardLayout((3, 2), 2, 4)
    writer = shard_writer.ShardWriter(tmp_path / "s.safetensors", layout, {"format": "test"})
    writer.put_states(0, torch.ones(3, 2, 4))
    with pytest.raises(ValueError, match="ShardWriter: 3 of 5 state rows were put"):
        writer.close(np.arange(5), np.ones(5, np.uint8))
    assert list(tmp_path.iterdir()) == []


# Catches: extract_samples not aborting the shard writer when a forward fails (the temp file,
# with its whole shard's disk space reserved, stays behind until a rerun).
def test_a_failed_forward_leaves_no_half_written_shard(
    extracted, verifier_model, tmp_path, monkeypatch
):
    """A forward that fails mid-extraction (after the shard writer reserved the file) raises
    its own error and leaves nothing in the output folder."""
    _, samples, _, cfg, _ = extracted

    def broken(*_args, **_kwargs):
        raise RuntimeError("CUDA error: an illegal memory access")

    monkeypatch.setattr(hidden_states, "forward_batch", broken)
    rows = [samples.sample(i) for i in range(4)]
    with pytest.raises(RuntimeError, match="illegal memory access"):
        hidden_states.extract_samples(
            verifier_model,
            [r[0] for r in rows],
            [r[1] for r in rows],
            config.resolve_aux_layers(None, verifier_model.config.num_hidden_layers),
            cfg,
            tmp_path / "shard.safetensors",
            {"format": "test"},
        )
    assert list(tmp_path.iterdir()) == []


# Catches: the manifest's rejected ids taken at the sample's index within the shard instead of
# within the whole data set (the shard's start not added), and the rejected count in the
# job's stats (which scripts/extract.py warns about) not counted.
def test_rejected_samples_are_named_by_their_data_set_id(
    extracted, verifier_record, tmp_path, monkeypatch
):
    """A sample whose states are non-finite is rejected by its own id (shard 1 starts at
    sample 4): in the manifest, in the shard's valid flags, and counted in the stats."""
    tmp, samples, ids, cfg, _ = extracted
    manifest = read_json(tmp / "shard-1.json")
    lengths = manifest["token_counts"]
    first = hidden_states.length_batches(lengths, cfg.batch_tokens)[0][0]  # computed first
    real_forward = hidden_states.forward_batch
    calls = []

    def poisoned(*args, **kwargs):
        states, n = real_forward(*args, **kwargs)
        if not calls:  # the first batch's first sample (its first row is never padding)
            states = states.clone()
            states[0, 0, 0, 0] = float("nan")
        calls.append(1)
        return states, n

    monkeypatch.setattr(hidden_states, "forward_batch", poisoned)
    path = tmp_path / "s.safetensors"
    stats = hidden_states.extract_shard(
        samples, ids, 1, cfg, verifier_record, path, tmp_path / "s.json"
    )
    start = manifest["sample_range"][0]
    assert start == 4
    got = read_json(tmp_path / "s.json")
    assert got["rejected"] == [{"id": ids[start + first], "reason": "non-finite hidden states"}]
    assert stats["rejected"] == 1
    valid = [1] * len(lengths)
    valid[first] = 0
    assert shards.open_shard(path).valid.tolist() == valid


# Catches: extract_shard no longer removing what a killed earlier attempt left (temp siblings
# of the shard and the manifest, which may hold a whole shard's reserved disk space).
def test_extraction_removes_a_killed_attempts_temp_files(extracted, verifier_record, tmp_path):
    """.<name>.tmp-* siblings of the shard and of its manifest are deleted; other files in the
    folder are not."""
    _, samples, ids, cfg, _ = extracted
    stale = [tmp_path / ".s.safetensors.tmp-abc123", tmp_path / ".s.json.tmp-def456"]
    for path in stale:
        path.write_bytes(b"\0" * 1024)
    (tmp_path / "keep.txt").write_text("mine")
    hidden_states.extract_shard(
        samples, ids, 1, cfg, verifier_record, tmp_path / "s.safetensors", tmp_path / "s.json"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt", "s.json", "s.safetensors"]


# Catches: the empty-shard check comparing stop < start (an empty shard let through).
def test_more_shards_than_samples_is_a_config_error():
    """3 samples in 4 shards leave shard 0 empty (the slice [0, 0)): a config error naming
    the key and the most shards that would do."""
    cfg = ExtractConfig(shards=4)
    message = (
        r"config key extract.shards: 4 shards for 3 samples leaves shard 0 empty; use at most 3 "
        r"shards"
    )
    with pytest.raises(UserError, match=message):
        hidden_states._shard_samples([0, 1, 2], 0, cfg)
    assert hidden_states._shard_samples([0, 1, 2], 3, cfg) == (2, 3)


# Catches: the padded-token count taken from a batch's shortest sample instead of its longest
# (the batch's padded width).
def test_padded_tokens_are_each_batch_width_times_rows_less_the_real_tokens(extracted):
    """padded_tokens in the stats: per batch, its rows times its longest sample, less the real
    tokens."""
    tmp, _, _, cfg, stats = extracted
    lengths = read_json(tmp / "shard-1.json")["token_counts"]
    batches = hidden_states.length_batches(lengths, cfg.batch_tokens)
    want = sum(len(b) * max(lengths[i] for i in b) - sum(lengths[i] for i in b) for b in batches)
    assert want > 0  # the batches really are padded
    assert stats["padded_tokens"] == want


# Catches: the progress line at the end (all tokens done) no longer printed, and a line printed
# for every batch regardless of log_every.
def test_progress_prints_at_most_every_log_every_and_always_at_the_end(capsys):
    """A slow log interval prints only the final 100 % line; an interval of 0 prints after
    every item, with the running token count and percentage."""
    items = [("a", 2), ("b", 3)]
    assert list(hidden_states.iter_progress(items, 5, log_every=3600)) == ["a", "b"]
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and re.fullmatch(r"extract: 5/5 tokens \(100%\) \d+ tok/s", lines[0])
    list(hidden_states.iter_progress(items, 5, log_every=0))
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" tok")[0] for line in lines] == [
        "extract: 2/5",
        "extract: 5/5",
    ]
    assert "(40%)" in lines[0]


# Catches: Capture.stacked keeping its references to the captured states (a batch's
# activations held until the next forward).
def test_capture_drops_the_states_it_stacked(verifier_model, tokenizer):
    """After stacked() the capture holds no states: a forward's activations are not kept
    alive by the hooks until the next one."""
    capture = hidden_states.Capture(decoder_layers(verifier_model), [2, 4, 5])
    try:
        ids = tokenizer("hello there, how are you")["input_ids"]
        [states] = hidden_states.forward_states(
            verifier_model.get_decoder(), capture, [np.array(ids)], torch.device("cpu")
        )
        assert states.shape == (len(ids), 4, 64)
        assert capture.states == {}
    finally:
        capture.remove()


# Catches: abort closing the file descriptor without first stopping the writer and hash threads
# (a queued batch could then be written to whatever file reuses that descriptor number).
def test_abort_stops_the_writer_threads(tmp_path):
    """abort() ends the writer's background threads (after they finish what was queued)
    before it closes the file: none of them outlives it."""
    before = set(threading.enumerate())
    layout = shards.ShardLayout((3, 2), 2, 4)
    writer = shard_writer.ShardWriter(tmp_path / "s.safetensors", layout, {"format": "test"})
    writer.put_states(0, torch.ones(3, 2, 4))
    writer.abort()
    assert [t.name for t in set(threading.enumerate()) - before] == []
    assert list(tmp_path.iterdir()) == []


# Catches: the extraction backend left out of the shard's spec (manifest and input hash), and
# the compute dtype recorded as torch's repr ("torch.float32").
def test_manifest_records_what_the_states_depend_on_and_hashes_it(extracted):
    """The manifest names the compute dtype, storage dtype and backend as plain strings, and its
    input_hash covers the tokens, masks, offsets and that whole spec."""
    tmp, samples, _, _, _ = extracted
    manifest = read_json(tmp / "shard-1.json")
    assert manifest["compute_dtype"] == "float32"  # auto on a CPU
    assert manifest["state_dtype"] == "bfloat16" and manifest["backend"] == "hf"
    assert manifest["compiled"] is False and manifest["format"] == shards.SHARD_FORMAT
    start, stop = manifest["sample_range"]
    tokens = [samples.sample(i) for i in range(start, stop)]
    ids = np.concatenate([t[0] for t in tokens])
    masks = np.concatenate([t[1] for t in tokens])
    offsets = np.concatenate([[0], np.cumsum(manifest["token_counts"])]).astype(np.int64)
    keys = ("verifier", "layer_ids", "hidden_size", "compute_dtype", "state_dtype", "backend")
    spec = {k: manifest[k] for k in keys}
    assert manifest["input_hash"] == shards.input_hash(ids, masks, offsets, spec)


# Catches: the manifest's "compiled" defaulting to True for a backend whose stats do not say
# (the vLLM backend's), and rejected ids taken without the shard's start.
def test_manifest_of_a_backend_without_compile_stats_says_not_compiled(tmp_path):
    """_manifest on stats without "compiled" (what extract_with_vllm returns) records
    compiled: false; a rejected sample (valid 0) of a shard starting at sample 2 is named by
    its data set id; "valid" and "sha256" are taken out of the stats."""
    path = tmp_path / "s.safetensors"
    path.write_bytes(b"\0" * 24)
    stats = {"tokens": 7, "valid": np.array([1, 0, 1], np.uint8), "sha256": "ab" * 32}
    manifest = hidden_states._manifest(
        1, ExtractConfig(shards=2), (2, 5), ["a", "b", "c", "d", "e"], [3, 2, 2], stats,
        {"backend": "vllm"}, "digest", path,
    )  # fmt: skip
    assert manifest["compiled"] is False and manifest["backend"] == "vllm"
    assert manifest["rejected"] == [{"id": "d", "reason": "non-finite hidden states"}]
    assert manifest["sample_ids"] == ["c", "d", "e"] and manifest["sample_range"] == [2, 5]
    assert manifest["file"] == {"name": "s.safetensors", "bytes": 24, "sha256": "ab" * 32}
    assert stats == {"tokens": 7}
