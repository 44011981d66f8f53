"""hidden_states' contract beyond test_hidden_states.py (mutation audit): Capture with aux layers
out of order, with layers called by keyword that return tuples, and on a device asked for;
length_batches with a sample over the budget; the progress line's timing and rate; the
compile failure's message; extract_samples' writer size, hooks, marks, stats and Ctrl-C;
writer_stats; check_against_single_forward; extract_shard's manifest, turn, phases and the
layers it asks vLLM for. Cheap: the tiny verifier, a few short samples."""

import types

import numpy as np
import pytest
import torch
from conftest import prepare_conversations

from eagle3lib import gpu, hidden_states, precision, shard_writer, shards, vllm_extraction
from eagle3lib.config import ExtractConfig
from eagle3lib.errors import UserError
from eagle3lib.fileio import read_json
from eagle3lib.lifetime import Phases
from eagle3lib.verifier import decoder_layers

CPU = torch.device("cpu")


def token_samples(vocab, lengths, seed=0):
    gen = np.random.default_rng(seed)
    return [gen.integers(1, vocab, n).astype(np.int64) for n in lengths]


def hf_states(model, ids, aux):
    """One-sample HF forward: the states [len, hidden] of layers ``aux`` (output_hidden_states[k])
    and HF's last entry, the final norm's output."""
    with torch.inference_mode():
        ref = model(torch.as_tensor(ids)[None], output_hidden_states=True).hidden_states
    return [ref[k][0] for k in aux], ref[-1][0]


def assert_states_match(got, model, ids, aux):
    """``got`` [len, len(aux)+1, hidden] (any float dtype) holds HF's states of layers ``aux``
    in that order (within one bf16 step of each row's scale) and the pre-norm last layer."""
    aux_ref, normed_ref = hf_states(model, ids, aux)
    assert got.shape == (len(ids), len(aux) + 1, model.config.hidden_size)
    for slot, want in enumerate(aux_ref):
        scale = want.abs().amax(-1, keepdim=True).clamp_min(1e-6)
        assert ((got[:, slot].float() - want).abs() <= scale * 2**-7).all(), f"slot {slot}"
    with torch.inference_mode():
        normed = model.model.norm(got[:, -1].float())
    torch.testing.assert_close(normed, normed_ref, rtol=2e-2, atol=2e-2)


def layer_hooks(model) -> list:
    """The hooks on each decoder layer (transformers keeps its own output-capturing hooks on
    them once a forward asked for output_hidden_states)."""
    return [(list(m._forward_pre_hooks), list(m._forward_hooks)) for m in decoder_layers(model)]


# ---- Capture ---------------------------------------------------------------------------------


# Catches: the stacked slots put in sorted layer order instead of the aux list's order (a config
# with aux_layers [5, 0, 3] would get layer 0's states under layer id 5 in its shards).
def test_capture_stacks_unsorted_aux_layers_in_the_order_given(verifier_model):
    """aux [5, 0, 3] (a valid config): slot 0 is layer 5's input, slot 1 the embeddings, slot 2
    layer 3's input, exactly HF's output_hidden_states[5], [0], [3]."""
    ids = token_samples(verifier_model.config.vocab_size, [9])[0]
    capture = hidden_states.Capture(decoder_layers(verifier_model), [5, 0, 3])
    try:
        [states] = hidden_states.forward_states(verifier_model.get_decoder(), capture, [ids], CPU)
    finally:
        capture.remove()
    aux_ref, _ = hf_states(verifier_model, ids, [5, 0, 3])
    for slot, want in enumerate(aux_ref):  # fp32 kernels may round apart (test_hidden_states)
        torch.testing.assert_close(states[:, slot], want, rtol=1e-5, atol=1e-5)


class KeywordLayer(torch.nn.Module):
    """A decoder layer as older transformers and some remote code write them: called with
    ``hidden_states=`` by keyword, returning a tuple (states, attention weights)."""

    def __init__(self, factor):
        super().__init__()
        self.factor = factor

    def forward(self, hidden_states, attention_mask=None):
        return hidden_states * self.factor + 1, None


class KeywordDecoder(torch.nn.Module):
    def __init__(self, layers=4):
        super().__init__()
        self.layers = torch.nn.ModuleList(KeywordLayer(k + 2) for k in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(hidden_states=x, attention_mask=None)[0]
        return x


# Catches: the pre-hook reading only positional arguments (an IndexError for a layer called
# with hidden_states= by keyword) and the last hook keeping a tuple output whole (stack fails).
def test_capture_takes_keyword_inputs_and_the_first_element_of_tuple_outputs():
    """Real torch modules, not stand-ins for torch: layers multiply by 2, 3, 4, 5 and add 1.
    Capturing aux [0, 2] keeps the input x, the input of layer 2 ((2x+1)*3+1) and the last
    layer's output (its tuple's first element); remove() leaves no hook."""
    decoder = KeywordDecoder()
    x = torch.arange(6, dtype=torch.float32).view(1, 2, 3)
    capture = hidden_states.Capture(decoder.layers, [0, 2])
    decoder(x)
    out = capture.stacked()
    capture.remove()
    into2 = (2 * x + 1) * 3 + 1
    last = (into2 * 4 + 1) * 5 + 1
    assert out.shape == (1, 2, 3, 3)
    assert torch.equal(out, torch.stack([x, into2, last], dim=2))
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in decoder.layers)


# Catches: stacked() ignoring the device it is asked for (with device_map the states go where
# the first aux layer ran, not to the input device where the shard writer's stream is).
def test_capture_stacks_on_the_device_asked_for():
    """stacked(meta) puts the stack on the meta device; with no device, where the states are."""
    decoder = KeywordDecoder(3)
    capture = hidden_states.Capture(decoder.layers, [1])
    decoder(torch.ones(1, 2, 3))
    assert capture.stacked(torch.device("meta")).device.type == "meta"
    decoder(torch.ones(1, 2, 3))
    assert capture.stacked().device == CPU
    capture.remove()


# ---- batching and progress -------------------------------------------------------------------


# Catches: the budget check made without "current" (an empty batch [] opened before a sample
# longer than batch_tokens, which then crashes the padded-token count and the forward).
def test_a_sample_longer_than_the_budget_is_a_batch_of_its_own():
    """Samples of 300 and 200 tokens with a budget of 128 each form one batch; no empty batch."""
    assert hidden_states.length_batches([300, 10, 200, 20], 128) == [[0], [2], [3, 1]]
    assert hidden_states.length_batches([129], 128) == [[0]]


# Catches: the progress line's last-print time never updated (a line per item once log_every
# has passed once), the rate printed as seconds per token, and a print exactly log_every after
# the last one skipped (> instead of >=).
def test_progress_lines_follow_the_clock_and_give_tokens_per_second(monkeypatch, capsys):
    """A stand-in clock for the module's ``time`` (not torch): perf_counter reads 0 at the
    start, then 5, 7, 10 and 11 s after the four items of 100 tokens. With log_every 5: a line
    at 5 s (20 tok/s), none at 7 s (2 s after it), one at 10 s (5 s after it: >=), and the end
    line at 11 s (400 / 11 = 36 tok/s)."""
    clock = iter([0.0, 5.0, 7.0, 10.0, 11.0])
    fake = types.SimpleNamespace(perf_counter=lambda: next(clock))
    monkeypatch.setattr(hidden_states, "time", fake)
    items = [(c, 100) for c in "abcd"]
    assert list(hidden_states.iter_progress(items, 400, log_every=5)) == ["a", "b", "c", "d"]
    assert capsys.readouterr().err.splitlines() == [
        "extract: 100/400 tokens (25%) 20 tok/s",
        "extract: 300/400 tokens (75%) 30 tok/s",
        "extract: 400/400 tokens (100%) 36 tok/s",
    ]


# ---- compiling -------------------------------------------------------------------------------


def failing_decoder(exc):
    """A decoder whose (compiled) forward raises ``exc``, as a dynamo, inductor or compiler
    failure surfaces at the first call."""

    def decoder(**_kwargs):
        raise exc

    return decoder


# Catches: the reason taken without strip() (a message starting with a newline gives "()"),
# an empty message's IndexError escaping instead of the type's name, the reason cut shorter
# than 300 characters, and only RuntimeError caught (a missing compiler raises OSError).
@pytest.mark.parametrize(
    "exc, reason",
    [
        (OSError("\ncc1plus: not found\nwhile compiling"), "cc1plus: not found"),
        (RuntimeError(""), "RuntimeError"),
        (ValueError("  "), "ValueError"),
        (RuntimeError("x" * 400 + "\nmore"), "x" * 300),
    ],
    ids=["leading-newline-oserror", "empty", "blank", "long"],
)
def test_a_failed_warm_up_compile_names_the_key_and_the_first_line(exc, reason):
    """Whatever the exception type: a UserError naming extract.compile, the first non-blank
    line of the message (at most 300 characters) or, without one, the exception's type."""
    samples = token_samples(100, [40, 5, 7])
    # no Capture: the decoder raises before any state would be stacked
    with pytest.raises(UserError) as caught:
        hidden_states.warm_compiled(failing_decoder(exc), None, samples, CPU)
    assert str(caught.value) == (
        f"extract.compile: torch.compile failed on this verifier ({reason}); "
        "set extract.compile: false"
    )


def pass_through_compile(monkeypatch):
    """torch.compile replaced by one that returns the function as it is (a stand-in for torch,
    unavoidable here: a real compilation of the 8 layers takes tens of seconds on a CPU); it
    records the functions it was given."""
    given = []

    def compile_(fn, **_kwargs):
        given.append(fn)
        return fn

    monkeypatch.setattr(torch, "compile", compile_)
    return given


# ---- extract_samples -------------------------------------------------------------------------

LENGTHS = [7, 19, 12, 3]  # budget 40: batches [1, 2] (2 x 19) and [0, 3] (2 x 7)
AUX = [5, 0, 3]
STATS_KEYS = {
    "tokens", "padded_tokens", "seconds", "tokens_per_s", "write_seconds", "hash_seconds",
    "stall_seconds", "valid", "sha256", "compiled", "compile_seconds", "turn_wait_seconds",
}  # fmt: skip


class RecordingWriter(shard_writer.ShardWriter):
    """The real ShardWriter; it keeps the keyword arguments it was made with."""

    made: list = []

    def __init__(self, *args, **kwargs):
        RecordingWriter.made.append(kwargs)
        super().__init__(*args, **kwargs)


def run_extract_samples(model, path, monkeypatch, compile=False, aux=AUX):
    monkeypatch.setattr(hidden_states, "ShardWriter", RecordingWriter)
    RecordingWriter.made = []
    samples = token_samples(model.config.vocab_size, LENGTHS, seed=2)
    masks = [np.arange(n, dtype=np.uint8) % 2 for n in LENGTHS]
    phases = Phases("extract", echo=False)
    cfg = ExtractConfig(batch_tokens=40, compile=compile)
    stats = hidden_states.extract_samples(
        model, samples, masks, aux, cfg, path, {"format": "test"}, phases
    )
    return samples, stats, phases


# Catches: the writer's staging size taken from a batch's shortest sample (a GPU batch larger
# than its pinned buffer), the decoder hooks left on the model after the job (a later forward
# in the process still captures), a "layers compiled" or "shard writer ready" mark wrong, a
# turn_span without a turn, the progress line counting samples instead of tokens, and the
# shard's slots in sorted order for aux layers given unsorted.
def test_extract_samples_writes_the_states_and_leaves_the_model_as_it_was(
    verifier_model, tmp_path, monkeypatch, capsys
):
    """Four samples in two batches of 2: the writer is sized for the widest batch (2 x 19
    rows); each sample's slots are HF's layers 5, 0, 3 and the pre-norm last layer; the stats
    have exactly their keys, with 11 padded tokens; the only phase is the writer's; the
    progress ends at 41/41 tokens; no hook is left on the layers."""
    path = tmp_path / "shard.safetensors"
    hooks = layer_hooks(verifier_model)
    samples, stats, phases = run_extract_samples(verifier_model, path, monkeypatch)
    assert [m["max_batch_rows"] for m in RecordingWriter.made] == [38]
    assert RecordingWriter.made[0]["device"] == CPU
    assert set(stats) == STATS_KEYS
    assert (stats["tokens"], stats["padded_tokens"], stats["turn_wait_seconds"]) == (41, 11, 0.0)
    assert (stats["compiled"], stats["compile_seconds"]) == (False, 0.0)
    assert list(phases.marks) == ["shard writer ready"]
    assert capsys.readouterr().err.splitlines()[-1].startswith("extract: 41/41 tokens (100%) ")
    assert layer_hooks(verifier_model) == hooks
    shard = shards.open_shard(path)
    assert [shard.length(i) for i in range(4)] == LENGTHS and shard.valid.tolist() == [1] * 4
    for i, ids in enumerate(samples):
        assert shard.sample(i)["input_ids"].tolist() == ids.tolist()
        assert_states_match(shard.states(i), verifier_model, ids, AUX)


# Catches: extract.compile: true recorded as compiled: false (manifest and stats), and the
# "layers compiled" mark missing.
def test_extract_samples_with_compile_enters_the_compiled_layers(
    verifier_model, tmp_path, monkeypatch
):
    """With extract.compile (torch.compile a pass-through stand-in, see pass_through_compile):
    every decoder layer's forward is given to torch.compile, the stats say compiled, the
    phases mark it before the writer, and the eager forwards are back afterwards."""
    given = pass_through_compile(monkeypatch)
    hooks = layer_hooks(verifier_model)
    path = tmp_path / "shard.safetensors"
    _, stats, phases = run_extract_samples(verifier_model, path, monkeypatch, compile=True)
    assert len(given) == verifier_model.config.num_hidden_layers
    assert stats["compiled"] is True and stats["compile_seconds"] >= 0
    assert list(phases.marks) == ["layers compiled", "shard writer ready"]
    assert all("forward" not in layer.__dict__ for layer in decoder_layers(verifier_model))
    assert layer_hooks(verifier_model) == hooks


# Catches: only Exception aborting the writer (Ctrl-C, a KeyboardInterrupt, leaves the
# temp file with its whole shard's disk space reserved).
def test_an_interrupted_extraction_leaves_no_half_written_shard(
    verifier_model, tmp_path, monkeypatch
):
    """A KeyboardInterrupt in a forward propagates; the folder is empty and no hook is left."""

    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(hidden_states, "forward_batch", interrupted)
    hooks = layer_hooks(verifier_model)
    with pytest.raises(KeyboardInterrupt):
        run_extract_samples(verifier_model, tmp_path / "shard.safetensors", monkeypatch)
    assert list(tmp_path.iterdir()) == []
    assert layer_hooks(verifier_model) == hooks


# Catches: tokens_per_s inverted, write and hash seconds swapped, stall seconds dropped.
def test_writer_stats_report_the_writers_counters(tmp_path):
    """writer_stats of a closed writer (5 tokens, counters set to 1.5, 0.25 and 0.125 s) over
    2 s: 2.5 tokens a second, each counter under its own key; 0 s gives a rate of 0."""
    layout = shards.ShardLayout((3, 2), 2, 4)
    writer = shard_writer.ShardWriter(tmp_path / "s.safetensors", layout, {"format": "test"})
    writer.put_states(0, torch.ones(3, 2, 4))
    writer.put_states(1, torch.full((2, 2, 4), float("nan")))
    digest = writer.close(np.arange(5), np.ones(5, np.uint8))
    writer.write_seconds, writer.hash_seconds, writer.stall_seconds = 1.5, 0.25, 0.125
    stats = hidden_states.writer_stats(writer, 2.0, 3, digest)
    assert stats.pop("valid").tolist() == [1, 0]
    assert stats == {
        "tokens": 5, "padded_tokens": 3, "seconds": 2.0, "tokens_per_s": 2.5,
        "write_seconds": 1.5, "hash_seconds": 0.25, "stall_seconds": 0.125, "sha256": digest,
    }  # fmt: skip
    assert hidden_states.writer_stats(writer, 0.0, 0, digest)["tokens_per_s"] == 0.0


# ---- check_against_single_forward ------------------------------------------------------------


# Catches: the reference taken at layer k+1, the batched states' last slot compared for every
# layer, the largest difference kept with min (always 0), the relative L2 error without its
# square root.
def test_check_against_single_forward_measures_a_batching_error(verifier_model):
    """Clean: batched capture equals HF's one-sample states (errors ~0, per layer by id). With
    a batching fault injected (a pre-hook, a real torch hook, that doubles layer 3's input in
    batched forwards only): layer 2 right, layer 3 off by its whole value (relative error 1),
    max_abs the largest |state| of layer 3's input, rel_l2 sqrt(n3 / (n2 + n3))."""
    model = verifier_model
    samples = token_samples(model.config.vocab_size, [9, 6], seed=4)
    clean = hidden_states.check_against_single_forward(model, [5, 0, 3], samples)
    assert list(clean["rel_l2_per_layer"]) == ["5", "0", "3"]
    assert clean["max_abs"] <= 1e-3 and clean["rel_l2"] <= 1e-4
    assert all(v <= 1e-4 for v in clean["rel_l2_per_layer"].values())

    def double_when_batched(_module, args):
        return (args[0] * 2, *args[1:]) if args[0].shape[0] > 1 else None

    handle = decoder_layers(model)[3].register_forward_pre_hook(double_when_batched)
    try:
        faulty = hidden_states.check_against_single_forward(model, [2, 3], samples)
    finally:
        handle.remove()
    refs = [hf_states(model, s, [2, 3])[0] for s in samples]
    n2 = sum(float((r[0].double() ** 2).sum()) for r in refs)
    n3 = sum(float((r[1].double() ** 2).sum()) for r in refs)
    assert 0.2 < n3 / (n2 + n3) < 0.8  # sqrt of the ratio differs from the ratio
    assert faulty["rel_l2_per_layer"]["2"] <= 1e-4
    assert faulty["rel_l2_per_layer"]["3"] == pytest.approx(1.0, abs=1e-3)
    assert faulty["max_abs"] == pytest.approx(max(float(r[1].abs().max()) for r in refs), 1e-3)
    assert faulty["rel_l2"] == pytest.approx((n3 / (n2 + n3)) ** 0.5, 1e-3)


# ---- extract_shard ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prepared(tokenizer, verifier_record, tmp_path_factory):
    """Six prepared conversations: (samples, their ids)."""
    tmp = tmp_path_factory.mktemp("contract")
    prep, samples = prepare_conversations(tokenizer, verifier_record, tmp, 6, seed=3)
    return samples, prep.ids


# Catches: the manifest's shard and shards values wrong (shard + 1, shards = shard), a job
# started as a sharing one (EAGLE3_GPU_TURN set) taking no turn, the model load time or the
# "verifier loaded" mark or the phases left out of the stats, write_gb_per_s off by 1e3.
def test_extract_shard_records_its_shard_its_turn_and_its_phases(
    prepared, verifier_record, tmp_path, monkeypatch
):
    """Shard 1 of 3 of a job whose turn lock is a file here: the manifest says shard 1 of 3 and
    its two samples; the stats give the turn's span, the load time, the phases in order and
    the write rate in GB/s."""
    samples, ids = prepared
    monkeypatch.setenv(gpu.TURN_ENV, str(tmp_path / "turn.lock"))
    cfg = ExtractConfig(shards=3, batch_tokens=300)
    path = tmp_path / "s.safetensors"
    stats = hidden_states.extract_shard(
        samples, ids, 1, cfg, verifier_record, path, tmp_path / "s.json"
    )
    manifest = read_json(tmp_path / "s.json")
    assert (manifest["shard"], manifest["shards"]) == (1, 3)
    assert manifest["sample_range"] == [2, 4] and manifest["sample_ids"] == ids[2:4]
    assert list(stats["phases"]) == [
        "started", "verifier loaded", "shard writer ready", "GPU turn", "shard written",
        "manifest written",
    ]  # fmt: skip
    start, end = stats["turn_span"]
    assert start <= end and stats["turn_wait_seconds"] >= 0
    assert stats["model_load_seconds"] > 0
    assert stats["rejected"] == 0 and stats["write_seconds"] > 0
    assert stats["write_gb_per_s"] == manifest["file"]["bytes"] / stats["write_seconds"] / 1e9
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.json", "s.safetensors", "turn.lock"]


# Catches: the bf16 refusal naming the key "dtype" instead of "extract.dtype".
@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a CPU")
def test_extract_shard_refuses_bf16_on_a_cpu_without_it_naming_extract_dtype(
    prepared, verifier_record, tmp_path, monkeypatch
):
    """extract.dtype: bfloat16 on a CPU without native bf16 (the detection forced, as
    test_precision does) is a config error naming extract.dtype; nothing is written."""
    samples, ids = prepared
    monkeypatch.setattr(precision, "cpu_native_bf16", lambda: False)
    cfg = ExtractConfig(dtype="bfloat16")
    with pytest.raises(UserError, match=r"^config key extract\.dtype: bfloat16 on this CPU"):
        hidden_states.extract_shard(
            samples, ids, 0, cfg, verifier_record, tmp_path / "s.safetensors", tmp_path / "s.json"
        )
    assert list(tmp_path.iterdir()) == []


# Catches: the vllm backend asked for the aux layers without the last layer (vLLM's
# extract_hidden_states would then return one slot fewer, or the wrong last one).
def test_extract_shard_asks_vllm_for_the_aux_layers_and_the_last_layer(
    prepared, verifier_record, tmp_path, monkeypatch
):
    """backend vllm: extract_with_vllm (a stand-in here: vLLM is not in the test venv; it
    writes a 16-byte file and returns a writer's stats) is asked for layers [1, 3, 6, 8] of
    the 8-layer verifier, in the compute dtype, with the shard's input hash as metadata and the
    engine and interpreter given; the manifest records the same layers, backend vllm, not
    compiled, no write rate."""
    samples, ids = prepared
    calls = []

    def stand_in(ids_, masks, record, layer_ids, dtype, cfg, shard_path, metadata, *rest):
        calls.append((layer_ids, dtype, metadata, rest))
        shard_path.write_bytes(b"\0" * 16)
        return {"tokens": sum(map(len, ids_)), "valid": np.ones(len(ids_), np.uint8),
                "sha256": "ab" * 32, "write_seconds": 0.0}  # fmt: skip

    monkeypatch.setattr(vllm_extraction, "extract_with_vllm", stand_in)
    cfg = ExtractConfig(shards=2, backend="vllm", aux_layers=[1, 3, 6])
    stats = hidden_states.extract_shard(
        samples, ids, 0, cfg, verifier_record, tmp_path / "s.safetensors", tmp_path / "s.json",
        engine={"gpu_memory_utilization": 0.5}, vllm_python="/venv/bin/python",
    )  # fmt: skip
    manifest = read_json(tmp_path / "s.json")
    [(layer_ids, dtype, metadata, rest)] = calls
    assert layer_ids == manifest["layer_ids"] == [1, 3, 6, 8]
    assert dtype == torch.float32 and manifest["compute_dtype"] == "float32"
    assert metadata == {"format": shards.SHARD_FORMAT, "input_hash": manifest["input_hash"]}
    assert rest == ({"gpu_memory_utilization": 0.5}, "/venv/bin/python")
    assert manifest["backend"] == "vllm" and manifest["compiled"] is False
    assert manifest["file"] == {"name": "s.safetensors", "bytes": 16, "sha256": "ab" * 32}
    assert stats["write_gb_per_s"] is None and stats["rejected"] == 0
