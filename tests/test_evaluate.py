import math
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from eagle3lib import checkpoint, data, evaluate, train, train_data
from eagle3lib.config import EvaluateConfig
from eagle3lib.drafter import Drafter
from eagle3lib.hidden_states import Capture, forward_states
from eagle3lib.verifier import decoder_layers

AUX = [2, 4, 5]


@pytest.fixture(scope="module")
def draft(pipeline):
    return checkpoint.load_draft(pipeline["checkpoint"], pipeline["record"], "sdpa", torch.float32)


@pytest.fixture(scope="module")
def two_layer_draft(pipeline):
    """A draft of two decoder layers (train.num_layers: 2; vLLM serves such drafts), randomly
    initialised as speculators builds it: the second layer reads the first one's output."""
    from eagle3lib.config import TrainConfig

    torch.manual_seed(0)
    cfg = TrainConfig(num_layers=2, draft_vocab_size=256)
    model = train.build_draft(cfg, pipeline["record"], AUX, pipeline["vocab_map"], "sdpa")
    assert len(model.layers) == 2
    return model.float().eval()


@pytest.fixture(scope="module")
def unnormed_draft(pipeline):
    """A draft without the input norm before its fc layer and with the LM head's norm kept
    off its hidden output (train.norm_before_fc, train.norm_output: false), randomly
    initialised as speculators builds it; with a norm of each aux layer's states instead
    (speculators' fc_norm: build_draft never sets it, another trainer's checkpoint may),
    made here as speculators makes it, with random weights."""
    from eagle3lib.config import TrainConfig

    torch.manual_seed(1)
    cfg = TrainConfig(draft_vocab_size=256, norm_before_fc=False, norm_output=False)
    model = train.build_draft(cfg, pipeline["record"], AUX, pipeline["vocab_map"], "sdpa")
    assert model.input_norm is None and model.fc_norm is None and not model.config.norm_output
    norm, eps = type(model.norm), model.config.transformer_layer_config.rms_norm_eps
    model.fc_norm = torch.nn.ModuleList([norm(model.hidden_size, eps=eps) for _ in AUX])
    for n in model.fc_norm:
        torch.nn.init.uniform_(n.weight, 0.5, 1.5)
    return model.float().eval()


def test_acceptance_stats_follow_vllm_definitions():
    stats = evaluate.acceptance_stats([3, 0, 1, 2], 3)
    assert stats["acceptance_length"] == pytest.approx(1 + 6 / 4)
    assert stats["per_position_acceptance"] == [0.75, 0.5, 0.25]
    assert stats["steps"] == 4 and stats["accepted_tokens"] == 6


def test_first_proposal_matches_speculators_training_alignment(pipeline, draft, verifier_model):
    """Draft index i pairs the aux state of token i with token i+1, as shift_batch does."""
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn

    ds = train_data.ShardDataset(pipeline["shards"], [(0, 0)], 256, torch.float32)
    batch = CollateFn(256, 64, 3, torch.float32, preprocess=shift_batch)([ds[0]])
    n_real = int((batch["document_ids"] != -1).sum())
    with torch.no_grad():
        tokens = draft(
            hidden_states=batch["hidden_states"][:, :n_real],
            input_ids=batch["input_ids"][:, :n_real],
            document_ids=batch["document_ids"][:, :n_real],
            position_ids=batch["position_ids"][:, :n_real],
            ttt_steps=1,
        )[0]
    sample = ds.shards[0].sample(0)
    aux = sample["hidden_states"][:, :-1].flatten(1).float()
    ids = sample["input_ids"]
    drafter = Drafter(draft)
    for n in (5, 17, n_real - 1):
        [p] = drafter.propose(aux[:n], ids[: n + 1], 1)
        assert p == int(drafter.to_verifier_ids(tokens[0, n - 1]))


def draft_logits(draft, run):
    """(result of ``run()``, the draft's LM-head output at the last position of every pass)."""
    rows = []
    hook = draft.lm_head.register_forward_hook(lambda m, args, out: rows.append(out[0]))
    try:
        return run(), rows
    finally:
        hook.remove()


def reference_logits(draft, aux, tokens, proposals):
    """What speculators' own forward computes at the newest position when the draft's earlier
    proposals are fed back (teacher forcing with its own tokens): one pass of len(proposals)
    TTT steps, the way the decode loop ran the draft before it was incremental."""
    k, n = len(proposals), aux.shape[0]
    hidden = torch.cat([aux, aux.new_zeros(k - 1, aux.shape[1])])
    forced = torch.cat([tokens, torch.tensor(proposals[:-1], dtype=tokens.dtype)])
    _, rows = draft_logits(draft, lambda: Drafter(draft).predict_all(hidden, forced, k))
    return torch.stack([r[n - 1] for r in rows])


def test_replay_runs_a_compiled_draft_forward_eagerly(pipeline, draft):
    """On a GPU speculators' ``forward`` is a torch.compile'd function; replay's draft pass
    (one call a prompt, each of its own length) must not compile it: here the forward is
    compiled with a backend that counts its compilations, and replay's proposals equal the
    plain draft's."""
    import copy

    compiled = []

    def counting_backend(graph, example_inputs):
        compiled.append(graph)
        return graph.forward

    aux, ids = sample_states(pipeline)
    twin = copy.copy(draft)  # the same parameters, its own forward
    twin.forward = torch.compile(type(draft).forward.__get__(twin), backend=counting_backend)
    for n in (12, 20):
        got = Drafter(twin).predict_all(aux[:n], ids[: n + 1], 3)
        assert torch.equal(got, Drafter(draft).predict_all(aux[:n], ids[: n + 1], 3))
    assert compiled == []
    twin(hidden_states=aux[None, :12], input_ids=ids[None, 1:13],
         document_ids=torch.zeros(1, 12, dtype=torch.long), ttt_steps=1)  # fmt: skip
    assert compiled, "the twin's forward compiles when called outside replay"


def sample_states(pipeline):
    ds = train_data.ShardDataset(pipeline["shards"], [(0, 0)], 256, torch.float32)
    sample = ds.shards[0].sample(0)
    return sample["hidden_states"][:, :-1].flatten(1).float(), sample["input_ids"].long()


@pytest.mark.parametrize("layers", ["draft", "two_layer_draft", "unnormed_draft"])
@pytest.mark.parametrize("window", [None, 6])
def test_incremental_proposals_equal_speculators_forward(pipeline, request, layers, window):
    """The incremental drafter (its own KV cache across calls, one pass per proposal) computes
    the logits of speculators' forward, also with a sliding window shorter than the context
    (on the first layer only, for two layers), with a draft of two layers and with one without
    the optional norms."""
    import copy

    draft = request.getfixturevalue(layers)
    if window is not None:
        draft = copy.deepcopy(draft)
        draft.sliding_window, draft.sliding_window_indices = window, [0]
        draft.uses_sliding_window_attn, draft.uses_full_attn = True, len(draft.layers) > 1
    aux, ids = sample_states(pipeline)
    drafter = Drafter(draft)
    seen = set()
    for n in (5, 9, 10, 17, 30):  # one prompt that grows, as accepted tokens arrive
        proposals, rows = draft_logits(draft, lambda n=n: drafter.propose(aux[:n], ids[: n + 1], 4))
        got = torch.stack([r[-1] for r in rows])
        want = reference_logits(draft, aux[:n], ids[: n + 1], proposals)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert [int(drafter.to_verifier_ids(i)) for i in want.argmax(-1)] == proposals
        seen.add(tuple(proposals))
    assert len(seen) > 1  # different contexts, different proposals
    drafter.propose(aux[:3], ids[:4], 2)  # another (shorter) sequence starts over
    assert drafter.propose(aux[:12], ids[:13], 3) == Drafter(draft).propose(aux[:12], ids[:13], 3)


@pytest.mark.parametrize(
    "settings",
    [
        {"norm_before_fc": False},
        {"norm_output": False},
        {"norm_before_residual": False},
        {"num_layers": 2, "sliding_window": 6, "full_attention_layers": [1]},
    ],
    ids=["no-norm-before-fc", "no-norm-output", "no-norm-before-residual", "window-config"],
)
def test_incremental_proposals_follow_the_drafts_train_settings(pipeline, settings):
    """Drafts built by the train job with its draft-shape keys off their defaults
    (train.norm_before_fc, norm_output, norm_before_residual; sliding_window with
    full_attention_layers): the incremental drafter still computes speculators' forward, its
    norms' weights drawn at random."""
    from eagle3lib.config import TrainConfig

    torch.manual_seed(1)
    cfg = TrainConfig(draft_vocab_size=256, **settings)
    draft = train.build_draft(cfg, pipeline["record"], AUX, pipeline["vocab_map"], "sdpa")
    draft = draft.float().eval()
    with torch.no_grad():  # norms' weights start at 1, where norming twice equals once
        for name, weight in draft.named_parameters():
            if "norm" in name:
                weight.uniform_(0.5, 1.5)
    for key in ("norm_before_fc", "norm_output", "norm_before_residual"):
        assert getattr(draft.config, key) is getattr(cfg, key), key
    assert (draft.input_norm is None) is not cfg.norm_before_fc
    if "sliding_window" in settings:
        assert (draft.sliding_window, list(draft.sliding_window_indices)) == (6, [0])
    aux, ids = sample_states(pipeline)
    drafter = Drafter(draft)
    for n in (9, 17, 30):
        proposals, rows = draft_logits(draft, lambda n=n: drafter.propose(aux[:n], ids[: n + 1], 3))
        got = torch.stack([r[-1] for r in rows])
        torch.testing.assert_close(
            got, reference_logits(draft, aux[:n], ids[: n + 1], proposals), rtol=1e-4, atol=1e-4
        )


def test_a_new_sequence_without_reset_proposes_as_a_fresh_drafter(pipeline, draft):
    """A sequence that differs from the cached one at its first token (another prompt, no
    ``reset``): the whole cache is dropped, as for a fresh drafter (transformers' cache
    ``crop(0)`` keeps everything, so dropping it all must not go through it), down to the
    logits. The same context asked again is proposed for again, as the first time."""
    aux, ids = sample_states(pipeline)
    drafter = Drafter(draft)
    drafter.propose(aux[:20], ids[:21], 3)
    other_aux, other_ids = aux.flip(0), ids.flip(0)
    (got, got_rows), (want, want_rows) = [
        draft_logits(draft, partial(d.propose, other_aux[:9], other_ids[:10], 3))
        for d in (drafter, Drafter(draft))
    ]
    assert got == want
    torch.testing.assert_close([r[-1] for r in got_rows], [r[-1] for r in want_rows])
    assert drafter.cache.get_seq_length() == 9
    assert drafter.propose(other_aux[:9], other_ids[:10], 3) == want


def test_proposing_k_tokens_costs_k_draft_passes(pipeline, draft):
    """One pass over the positions new since the last call (the last one at least), then one
    single-position pass per further proposal (was k(k+1)/2 passes over the whole context)."""
    aux, ids = sample_states(pipeline)
    lengths = []
    hook = draft.layers[0].register_forward_hook(lambda m, args, out: lengths.append(out.shape[1]))
    try:
        drafter = Drafter(draft)
        drafter.propose(aux[:10], ids[:11], 5)
        assert lengths == [10, 1, 1, 1, 1]
        lengths.clear()
        drafter.propose(aux[:13], ids[:14], 5)  # three tokens accepted since
        assert lengths == [3, 1, 1, 1, 1]
        lengths.clear()
        drafter.propose(aux[:13], ids[:14], 2)  # the same context: only its last position
        assert lengths == [1, 1]
    finally:
        hook.remove()


def test_eager_attention_drafts_incrementally_as_sdpa_does(pipeline, draft):
    """Drafter with eager attention (additive masks, as speculators' create_float_mask) computes
    the logits and proposals of the sdpa drafter, over a growing prompt and with a sliding
    window shorter than the context."""
    import copy

    eager = checkpoint.load_draft(
        pipeline["checkpoint"], pipeline["record"], "eager", torch.float32
    )
    aux, ids = sample_states(pipeline)
    for window in (None, 6):
        pair = [copy.copy(draft), eager if window is None else copy.copy(eager)]
        for d in pair:
            d.sliding_window, d.sliding_window_indices = window, [0] if window else []
        drafters = [Drafter(d) for d in pair]
        assert [d.attention for d in drafters] == ["sdpa", "eager"]
        for n in (5, 9, 17):
            runs = [
                draft_logits(d.draft, partial(d.propose, aux[:n], ids[: n + 1], 3))
                for d in drafters
            ]
            (want, want_rows), (got, got_rows) = runs
            assert got == want
            torch.testing.assert_close(
                torch.stack([r[-1] for r in got_rows]), torch.stack([r[-1] for r in want_rows])
            )


def test_incremental_drafting_refuses_flex_attention(pipeline):
    from eagle3lib.config import TrainConfig

    cfg = TrainConfig(draft_vocab_size=256)
    flex = train.build_draft(
        cfg, pipeline["record"], AUX, pipeline["vocab_map"], "simple_flex_attention"
    )
    with pytest.raises(ValueError) as refused:
        Drafter(flex)
    assert str(refused.value) == (
        "incremental drafting needs sdpa or eager attention, not simple_flex_attention"
    )


def prompts(tokenizer, n=3):
    texts = ["Tell me about the draft model", "Write a list of numbers", "Why is decoding fast"]
    return [
        {"id": str(i), "token_ids": data.prompt_token_ids(tokenizer, t)}
        for i, t in enumerate(texts[:n])
    ]


@pytest.fixture(scope="module")
def fitted_checkpoint(verifier_model, verifier_record, tokenizer, tmp_path_factory):
    """A draft that accepts well on ``prompts``: trained (as the train rule does, on states
    extracted as the extract rule does) on the very prompts followed by the verifier's greedy
    continuations, 12 copies each, 5 epochs (35 steps, about 15 s). Its acceptance length at
    k = 3 on them was 2.95 when written (the pipeline's draft: about 1.1)."""
    from collections import Counter

    import numpy as np

    from eagle3lib import hidden_states, vocab
    from eagle3lib.config import ExtractConfig, TrainConfig

    tmp = tmp_path_factory.mktemp("fitted")
    ids, inputs, masks, freq = [], [], [], Counter()
    for p in prompts(tokenizer):
        continuation = evaluate.greedy_reference(verifier_model, p["token_ids"], 24, set())
        full = np.asarray(p["token_ids"] + continuation, dtype=np.int64)
        mask = np.zeros(len(full), dtype=np.uint8)
        mask[len(p["token_ids"]) :] = 1
        for copy in range(12):
            ids.append(f"{p['id']}-{copy}")
            inputs.append(full)
            masks.append(mask)
            freq.update(continuation)
    prepared = data.PreparedSamples(ids, inputs, masks, freq, {})
    data.save_prepared(prepared, tmp / "samples.safetensors", verifier_record["vocab_size"])
    samples = data.load_samples(tmp / "samples.safetensors")
    shard, manifest = tmp / "shard-0.safetensors", tmp / "shard-0.json"
    extract_cfg = ExtractConfig(shards=1, batch_tokens=1024)
    hidden_states.extract_shard(samples, ids, 0, extract_cfg, verifier_record, shard, manifest)
    d2t, t2d = vocab.build(samples.token_freq, 256)
    cfg = TrainConfig(
        epochs=5, total_seq_len=256, draft_vocab_size=256, optimizer="adamw", lr=0.01,
        scheduler="none", seed=0, log_every=50,
    )  # fmt: skip
    stats = train.train(
        cfg, verifier_record, [shard], [manifest], {"d2t": d2t, "t2d": t2d},
        tmp / "state", tmp / "state" / "metrics.jsonl",
    )  # fmt: skip
    checkpoint.export(Path(stats["final_epoch_dir"]), tmp / "checkpoint", "tiny-llama")
    return tmp / "checkpoint"


@pytest.fixture(scope="module")
def fitted_draft(fitted_checkpoint, verifier_record):
    return checkpoint.load_draft(fitted_checkpoint, verifier_record, "sdpa", torch.float32)


def decode_accounting(result, k: int) -> None:
    """The counts of a decode result add up: acceptance length is 1 + the per-position rates'
    sum (both are accepted tokens per step), and every prompt's tokens are its first token, one
    verifier token and the accepted proposals per step (at most k beyond an end token)."""
    assert result["acceptance_length"] == pytest.approx(1 + sum(result["per_position_acceptance"]))
    assert result["acceptance_length"] == pytest.approx(
        1 + result["accepted_tokens"] / result["steps"]
    )
    for record in result["per_prompt"]:
        accepted = round((record["acceptance_length"] - 1) * record["steps"])
        produced = 1 + record["steps"] + accepted
        assert 0 <= produced - record["new_tokens"] <= k, record


def test_speculative_output_equals_greedy_decoding(draft, verifier_model, tokenizer):
    result = evaluate.evaluate(
        verifier_model,
        draft,
        tokenizer,
        [{"name": "eval", "prompts": prompts(tokenizer)}],
        EvaluateConfig(k=3, max_new_tokens=24),
        AUX,
        log=lambda m: None,
    )
    assert result["text_matches_verifier"] is True and result["mismatched_prompts"] == 0
    assert result["prompts"] == 3 and result["k"] == 3
    assert len(result["per_position_acceptance"]) == 3
    pp = result["per_position_acceptance"]
    assert pp[0] > 0  # some drafts accepted: the accepting path ran
    # per position: the share of steps accepting past it, so they add up to the accepted tokens
    assert result["steps"] == sum(r["steps"] for r in result["per_prompt"])
    assert math.isclose(sum(pp) * result["steps"], result["accepted_tokens"])
    decode_accounting(result, 3)


class OracleDrafter:
    """Proposes the verifier's own greedy continuation: every proposal must be accepted."""

    dtype = torch.float32

    def __init__(self, model):
        self.model = model

    def propose(self, aux, tokens, k):
        out = self.model.generate(tokens[None], max_new_tokens=k, do_sample=False, min_new_tokens=k)
        return out[0, len(tokens) :].tolist()


def test_acceptance_accounting_with_an_oracle_draft(verifier_model, tokenizer):
    capture = Capture(decoder_layers(verifier_model), AUX)
    try:
        prompt = prompts(tokenizer, 1)[0]["token_ids"]
        result = evaluate.speculative_decode(
            verifier_model, capture, OracleDrafter(verifier_model), prompt, 3, 17, set()
        )
    finally:
        capture.remove()
    assert result["accepted"] == [3, 3, 3, 3]  # 1 + 4 steps x (3 accepted + bonus) = 17 tokens
    reference = evaluate.greedy_reference(verifier_model, prompt, 17, set())
    assert result["tokens"] == reference


@pytest.mark.parametrize("accepting", [False, True])
def test_aux_states_during_decoding_equal_a_full_forward(verifier_model, tokenizer, accepting):
    """The verifier states fed to the draft while decoding with a KV cache equal a fresh forward,
    after steps whose proposals were all rejected and after steps that accepted them all (the
    states of accepted tokens come from the verification pass)."""
    seen = []

    class Recorder(OracleDrafter):
        def propose(self, aux, tokens, k):
            seen.append((aux.clone(), tokens.clone()))
            return super().propose(aux, tokens, k) if accepting else [0] * k

    capture = Capture(decoder_layers(verifier_model), AUX)
    try:
        prompt = prompts(tokenizer, 1)[0]["token_ids"]
        result = evaluate.speculative_decode(
            verifier_model, capture, Recorder(verifier_model), prompt, 2, 8, set()
        )
        assert set(result["accepted"]) == ({2} if accepting else {0})
        aux, tokens = seen[-1]
        [ref] = forward_states(
            verifier_model.get_decoder(), capture, [tokens[:-1].numpy()], torch.device("cpu")
        )
    finally:
        capture.remove()
    assert aux.shape == (len(tokens) - 1, 3 * 64)
    torch.testing.assert_close(aux, ref[:, :-1].flatten(1), rtol=1e-4, atol=1e-4)


def test_bf16_evaluation_runs_the_draft_in_its_own_dtype(
    fitted_checkpoint, fitted_draft, verifier_record, verifier_model, tokenizer
):
    """The path a GPU takes (bf16 verifier and draft), here on CPU, with the draft that accepts
    well: the draft computes in bf16, the text is the bf16 verifier's own greedy text, the
    counts add up, and acceptance stays near the fp32 run's (bf16 rounding may change some
    greedy tokens, which the draft was not trained on)."""
    import copy

    draft = checkpoint.load_draft(fitted_checkpoint, verifier_record, "sdpa", torch.bfloat16)
    model = copy.deepcopy(verifier_model).to(torch.bfloat16)
    sets = [{"name": "eval", "prompts": prompts(tokenizer)}]
    cfg = EvaluateConfig(k=3, max_new_tokens=20)
    dtypes = set()
    hook = draft.lm_head.register_forward_hook(lambda m, args, out: dtypes.add(args[0].dtype))
    try:
        result = evaluate.evaluate(model, draft, tokenizer, sets, cfg, AUX, log=lambda m: None)
    finally:
        hook.remove()
    fp32 = evaluate.evaluate(
        verifier_model, fitted_draft, tokenizer, sets, cfg, AUX, log=lambda m: None
    )
    assert dtypes == {torch.bfloat16}
    assert result["text_matches_verifier"] is True and result["prompts"] == 3
    assert result["k"] == 3 and result["steps"] >= 3
    decode_accounting(result, 3)
    assert fp32["acceptance_length"] >= 2.0
    assert abs(result["acceptance_length"] - fp32["acceptance_length"]) <= 0.6, (result, fp32)


def test_chain_runs_count_leading_matches_and_stop_after_an_accepted_eos():
    tokens = torch.tensor([10, 11, 12, 13, 14, 2, 16])  # x_0..x_6; 2 is end-of-sequence
    # predictions[j, i] is the proposal for x_{i+2+j}
    predictions = torch.tensor(
        [
            [12, 13, 0, 2, 16, 0],  # step 0: right at i = 0, 1, 3, 4
            [13, 14, 2, 16, 0, 0],  # step 1: right at i = 0, 1, 3 (x_5 = 2, then x_6 = 16)
            [14, 2, 16, 0, 0, 0],  # step 2: right at i = 0, 1; i = 2's x_6 follows a rejection
        ]
    )
    assert evaluate.chain_runs(predictions, tokens, set()) == [3, 3, 0, 2, 1, 0]
    # with 2 as EOS: i = 1 accepts x_3, x_4 then x_5 = EOS, i = 3 accepts x_5 = EOS and stops
    assert evaluate.chain_runs(predictions, tokens, {2}) == [3, 3, 0, 1, 1, 0]


def test_acceptance_by_category_pools_the_verifier_steps_of_its_prompts():
    prompts_ = [{"category": "math"}, {"category": "stem"}, {"category": "math"}, {}]
    accepted = [[2, 0], [1], [3], [3, 3]]
    assert evaluate.by_category(prompts_, accepted, 3) == {
        "math": {"prompts": 2, "steps": 3, "acceptance_length": pytest.approx(1 + 5 / 3)},
        "stem": {"prompts": 1, "steps": 1, "acceptance_length": 2.0},
    }
    assert evaluate.by_category([{}, {}], [[1], [2]], 3) is None


def test_replay_steps_walk_the_decode_loop():
    prompt = [7, 8]
    tokens = prompt + [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]
    runs = [0, 2, 9, 0, 1, 3, 0, 0, 0, 0, 0]  # indexed by draft position i (x_{i+1} is newest)
    accepted, out = evaluate.replay_steps(runs, tokens, 2, k=3, max_new_tokens=8, eos=set())
    # i=1: 2 accepted (+bonus) -> i=4: 1 -> i=6: 0 -> i=7: 0; 1+3+2+1+1 = 8 tokens
    assert accepted == [2, 1, 0, 0] and out == tokens[2:10]
    accepted, _ = evaluate.replay_steps(runs, tokens, 2, k=1, max_new_tokens=8, eos=set())
    assert accepted == [1, 0, 1, 0, 0]  # capped at k = 1: i=1 -> 3 -> 4 -> 6 -> 7
    accepted, out = evaluate.replay_steps(runs, tokens, 2, k=3, max_new_tokens=8, eos={23})
    assert accepted == [2] and out == [20, 21, 22, 23]  # the first step reaches the EOS token


def test_per_token_accuracy_counts_every_generated_position_as_validation_does():
    """token_accuracy counts position i's first j + 1 proposals (x_{i+2}..x_{i+2+j}) at every
    position whose step-0 proposal is a generated token, like speculators' full_acc_j; the
    decode loop only counts the positions where a verifier step starts."""
    prompt = [7, 8]
    # runs at draft positions 1..9 (position 1 proposes the second generated token): an easy
    # stretch of long runs, then hard positions where only every other step-0 proposal is right
    runs = [3, 3, 3, 3, 3, 3, 3, 0, 1, 0, 3, 0, 0, 0]  # positions 0 and 10 are never counted
    tokens = prompt + list(range(20, 32))  # 12 generated tokens
    assert evaluate.token_accuracy(runs, 2, 10, 3) == [7, 6, 6]  # positions 1..9, 1..8, 1..7
    assert [evaluate.token_positions(10, j) for j in range(3)] == [9, 8, 7]
    counts = evaluate.TokenCounts(3)
    counts.add(runs, 2, 10)
    counts.add(runs, 2, 10)
    stats = evaluate.acceptance_stats([3, 0], 3, *counts.first(3))
    assert stats["per_token_accuracy"] == pytest.approx([7 / 9, 6 / 8, 6 / 7])
    # the loop: i=1 accepts 3 (+bonus) -> i=5: 3 -> i=9: 0 -> 10 tokens; its first proposals
    # are right at 2 of 3 steps (the easy stretch is crossed in two), per token at 7 of 9
    accepted, out = evaluate.replay_steps(runs, tokens, 2, k=3, max_new_tokens=10, eos=set())
    assert accepted == [3, 3, 0] and len(out) == 10
    assert evaluate.acceptance_stats(accepted, 3)["per_position_acceptance"][0] == 2 / 3
    # a continuation of one token has no drafted position
    assert evaluate.token_accuracy(runs, 2, 1, 2) == [0, 0]
    assert evaluate.acceptance_stats([], 2, [0, 0], [0, 0])["per_token_accuracy"] == [None, None]


def test_replay_gives_the_decode_loops_counts(fitted_draft, verifier_model, tokenizer):
    """Same prompts, same draft: the batched replay equals speculative decoding for every k,
    with a draft that accepts well (long accepted runs, so the walk through them is tested)."""
    draft = fitted_draft
    sets = [
        {"name": "a", "prompts": prompts(tokenizer, 2)},
        {"name": "b", "prompts": prompts(tokenizer, 3)[2:]},
    ]
    for prompt, category in zip(sets[0]["prompts"], ("x", "y"), strict=True):
        prompt["category"] = category  # as MT-bench's records carry one; "b"'s have none
    results = {}
    for method in ("decode", "replay"):
        cfg = EvaluateConfig(k=[3, 1, 5], max_new_tokens=20, method=method, batch_size=2)
        results[method] = evaluate.evaluate(
            verifier_model, draft, tokenizer, sets, cfg, AUX, log=lambda m: None
        )
    decode, replay = results["decode"], results["replay"]
    keys = (
        "eval_set",
        "k",
        "prompts",
        "steps",
        "accepted_tokens",
        "per_position_acceptance",
        "per_token_accuracy",
        "out_of_draft_vocab",
    )
    assert [[r[k] for k in keys] for r in replay["results"]] == [
        [r[k] for k in keys] for r in decode["results"]
    ]
    assert [r.get("by_category") for r in replay["results"]] == [
        r.get("by_category") for r in decode["results"]
    ]
    assert [r["eval_set"] for r in decode["results"] if "by_category" in r] == ["a"] * 3
    # one prompt per category: each category's figures are its prompt's
    assert decode["by_category"] == {
        c: {"prompts": 1, "steps": p["steps"], "acceptance_length": p["acceptance_length"]}
        for c, p in zip(("x", "y"), decode["per_prompt"], strict=True)
    }
    assert [(r["eval_set"], r["k"]) for r in replay["results"]] == [
        ("a", 3),
        ("a", 1),
        ("a", 5),
        ("b", 3),
        ("b", 1),
        ("b", 5),
    ]
    at_3 = [r for r in decode["results"] if r["k"] == 3]
    steps = sum(r["steps"] for r in at_3)
    assert 1 + sum(r["accepted_tokens"] for r in at_3) / steps >= 2.0  # it accepts well
    assert max(r["per_position_acceptance"][-1] for r in decode["results"] if r["k"] == 5) > 0
    for r in decode["results"]:  # per token: one rate per step
        tokens = r["per_token_accuracy"]
        assert len(tokens) == r["k"] and all(0 <= a <= 1 for a in tokens), r
        assert tokens[0] > 0, r
    assert decode["text_matches_verifier"] is True and replay["text_matches_verifier"] is None
    assert replay["argmax_agreement"] == 1.0
    assert replay["per_prompt"][0]["text"] == decode["per_prompt"][0]["text"]
    assert replay["k"] == 3 and replay["eval_set"] == "a" and replay["method"] == "replay"


def test_report_flags_any_eval_set_and_k_whose_greedy_text_is_off():
    """Every (eval set, k) result is checked, not only the headline one."""
    from eagle3lib.report import problems_of

    def summary(results):
        return {
            "checkpoint": {"problems": []},
            "gpu_memory": {},
            "acceptance_length": 1.5,
            "acceptance": {"results": results},
        }

    fine = {"eval_set": "mtbench", "k": 3, "acceptance_length": 1.5, "text_matches_verifier": True}
    replayed = {"eval_set": "humaneval", "k": 5, "acceptance_length": 2.0,
                "text_matches_verifier": None}  # fmt: skip
    assert problems_of(summary([fine, {**replayed, "argmax_agreement": 0.999}])) == []
    [problem] = problems_of(summary([fine, {**replayed, "argmax_agreement": 0.9}]))
    assert (
        problem.startswith("acceptance (humaneval k=5): the greedy tokens equal")
        and "90.0%" in problem
    )
    [problem] = problems_of(
        summary([fine, {**fine, "k": 5, "text_matches_verifier": False, "mismatched_prompts": 2}])
    )
    assert problem == (
        "acceptance (mtbench k=5): 2 prompt(s) decoded differently from verifier-only greedy decoding"
    )


def test_out_of_draft_vocab_share_counts_tokens_the_draft_cannot_propose(draft):
    """The draft's vocabulary is its t2d mask; the share is over every generated token."""
    from eagle3lib.drafter import Drafter

    vocabulary = Drafter(draft).vocabulary()
    assert vocabulary == set(torch.nonzero(draft.t2d).flatten().tolist())
    assert len(vocabulary) == len(draft.d2t) == 256
    outside = next(t for t in range(len(draft.t2d)) if t not in vocabulary)
    inside = sorted(vocabulary)[:3]
    assert evaluate.out_of_draft_vocab([inside, [outside]], vocabulary) == 0.25
    assert evaluate.out_of_draft_vocab([inside], None) == 0.0  # no map: the full vocabulary
    assert evaluate.out_of_draft_vocab([[], []], vocabulary) is None


def prompt_ids(tokenizer, text="Tell me about the draft model"):
    return data.prompt_token_ids(tokenizer, text)


def hook_count(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in decoder_layers(model))


# Catches: replay_steps starting its loop even when the first generated token is
# end-of-sequence (initial done forced False); acceptance_stats of no verifier step giving an
# acceptance length (1.0) instead of None, or per-position rates of None instead of 0.0.
def test_a_first_token_that_ends_the_sequence_takes_no_verifier_step():
    """An empty answer (the prompt's forward already yields end-of-sequence): the replayed loop
    takes no step and outputs that one token, and the stats of no step have no acceptance
    length (not 1.0) and zero per-position rates."""
    tokens = [7, 8, 2, 21, 22, 23, 24, 25]  # 2 (end-of-sequence) is the first generated token
    runs = [3] * len(tokens)  # the draft would have been right everywhere
    accepted, out = evaluate.replay_steps(runs, tokens, 2, k=3, max_new_tokens=5, eos={2})
    assert accepted == [] and out == [2]
    stats = evaluate.acceptance_stats(accepted, 3)
    assert stats["steps"] == 0 and stats["accepted_tokens"] == 0
    assert stats["acceptance_length"] is None
    assert stats["per_position_acceptance"] == [0.0, 0.0, 0.0]


# Catches: token_positions without its clamp at zero (negative position counts for answers of
# one token, which then shrink the denominators summed over prompts).
def test_a_one_token_answer_adds_no_per_token_positions():
    """A continuation of one token has no drafted position at any step: it adds 0 (never a
    negative count) to every step's positions, so other prompts' rates are unchanged."""
    assert [evaluate.token_positions(1, j) for j in range(3)] == [0, 0, 0]
    assert [evaluate.token_positions(0, j) for j in range(3)] == [0, 0, 0]
    runs = [3, 3, 3, 3, 3, 3, 3, 0, 1, 0, 3, 0, 0, 0]  # as in the per-token accuracy test
    counts = evaluate.TokenCounts(3)
    counts.add(runs, 2, 10)
    counts.add(runs, 2, 1)  # an answer of one token (its end-of-sequence)
    assert counts.first(3) == ([7, 6, 6], [9, 8, 7])
    stats = evaluate.acceptance_stats([3, 0], 3, *counts.first(3))
    assert stats["per_token_accuracy"] == pytest.approx([7 / 9, 6 / 8, 6 / 7])


# Catches: speculative_decode entering its loop (one verifier step, one draft call) when the
# prompt's forward already yields end-of-sequence (initial done forced False).
def test_decoding_takes_no_step_when_the_first_token_ends_the_sequence(verifier_model, tokenizer):
    """The verifier's first token is end-of-sequence: the output is that token, no verifier
    step is taken and the draft is never asked, as greedy decoding also stops there."""
    prompt = prompt_ids(tokenizer)
    first = evaluate.greedy_reference(verifier_model, prompt, 1, set())[0]

    class Never:
        dtype = torch.float32

        def propose(self, aux, tokens, k):
            raise AssertionError("the draft was asked for proposals")

    capture = Capture(decoder_layers(verifier_model), AUX)
    try:
        result = evaluate.speculative_decode(
            verifier_model, capture, Never(), prompt, 3, 10, {first}
        )
    finally:
        capture.remove()
    assert result == {"tokens": [first], "accepted": []}
    assert evaluate.greedy_reference(verifier_model, prompt, 10, {first}) == [first]


# Catches: the decode loop's acceptance no longer stopping after an accepted end-of-sequence
# proposal (proposals after it counted as accepted when they equal the verifier's argmax).
def test_decoding_counts_no_proposal_after_an_accepted_end_of_sequence(verifier_model, tokenizer):
    """With an oracle draft and the second greedy token declared end-of-sequence, the first
    step accepts the proposal that is that token and none after it (which the verifier, running
    on past the end, would also predict): accepted [1], as chain_runs counts, and the text ends
    at that token like greedy decoding."""
    prompt = prompt_ids(tokenizer, "Why is decoding fast")
    greedy = evaluate.greedy_reference(verifier_model, prompt, 6, set())
    end = greedy[1]
    assert end != greedy[0]  # the tiny verifier's greedy text: [188, 277, 188, 277, ...]
    capture = Capture(decoder_layers(verifier_model), AUX)
    try:
        result = evaluate.speculative_decode(
            verifier_model, capture, OracleDrafter(verifier_model), prompt, 3, 10, {end}
        )
    finally:
        capture.remove()
    assert result["accepted"] == [1]
    assert result["tokens"] == greedy[:2]
    assert result["tokens"] == evaluate.greedy_reference(verifier_model, prompt, 10, {end})


# Catches: replay_prompt reporting one position more (or fewer) compared than the generated
# tokens, which skews argmax_agreement.
def test_replay_prompt_compares_the_verifier_argmax_at_every_generated_token(
    draft, verifier_model, tokenizer
):
    """On the verifier's own greedy text every generated token is compared and agrees; a
    changed generated token is counted as a disagreement out of the same positions. The
    draft's predictions cover every position for every step."""
    from eagle3lib.drafter import Drafter

    prompt = prompt_ids(tokenizer)
    greedy = evaluate.greedy_reference(verifier_model, prompt, 6, set())
    tokens = prompt + greedy
    capture = Capture(decoder_layers(verifier_model), AUX)
    try:
        drafter = Drafter(draft)
        predictions, wrong, compared = evaluate.replay_prompt(
            verifier_model, capture, drafter, tokens, len(prompt), 2
        )
        assert (wrong, compared) == (0, 6)
        assert predictions.shape == (2, len(tokens) - 1)
        changed = tokens[:-1] + [(tokens[-1] + 1) % verifier_model.config.vocab_size]
        _, wrong, compared = evaluate.replay_prompt(
            verifier_model, capture, drafter, changed, len(prompt), 2
        )
        assert (wrong, compared) == (1, 6)
    finally:
        capture.remove()


# Catches: evaluate leaving its hooks on the verifier (capture.remove() dropped from the
# finally), on success and when a set fails; the summary's "results" keeping every set's
# per-prompt records; the headline's per-prompt records after the first keeping their tokens.
def test_evaluate_leaves_no_hooks_and_keeps_per_prompt_records_only_for_the_headline(
    draft, verifier_model, tokenizer
):
    """After evaluate (or an error in it) the verifier has no hooks left; "results" are one
    summary per (set, k) without per-prompt records; the top-level per-prompt records are the
    headline's: the first with its text (the greedy text decoded), the others without tokens."""
    before = hook_count(verifier_model)
    prompts = [
        {"id": str(i), "token_ids": prompt_ids(tokenizer, t)}
        for i, t in enumerate(["Tell me about the draft model", "Why is decoding fast"])
    ]
    sets = [{"name": "a", "prompts": prompts}, {"name": "b", "prompts": prompts[:1]}]
    cfg = EvaluateConfig(k=[2, 1], max_new_tokens=6, method="replay", batch_size=2)
    result = evaluate.evaluate(verifier_model, draft, tokenizer, sets, cfg, AUX, log=lambda m: None)
    assert hook_count(verifier_model) == before
    assert [(r["eval_set"], r["k"]) for r in result["results"]] == [
        ("a", 2), ("a", 1), ("b", 2), ("b", 1),
    ]  # fmt: skip
    assert all("per_prompt" not in r for r in result["results"])
    first, second = result["per_prompt"]
    greedy = evaluate.greedy_reference(verifier_model, prompts[0]["token_ids"], 6, set())
    assert "tokens" not in first
    assert first["text"] == tokenizer.decode(greedy, skip_special_tokens=True)
    assert "tokens" not in second and "text" not in second
    broken = [{"name": "c", "prompts": [{"id": "0"}]}]  # no token_ids: fails inside the loop
    with pytest.raises(KeyError, match="token_ids"):
        evaluate.evaluate(verifier_model, draft, tokenizer, broken, cfg, AUX, log=lambda m: None)
    assert hook_count(verifier_model) == before


class _DraftStandIn:
    """What Drafter reads of a draft before it drafts (a real one's d2t is its vocab map;
    one without a map proposes verifier ids directly)."""

    def __init__(self, d2t=None):
        if d2t is not None:
            self.d2t = d2t
        self.config = SimpleNamespace(
            transformer_layer_config=SimpleNamespace(_attn_implementation="sdpa")
        )

    def parameters(self):
        return iter([torch.zeros(1, dtype=torch.bfloat16)])


def test_draft_ids_become_verifier_ids_through_the_vocab_map_if_there_is_one():
    """Drafter: draft id i is verifier id i + d2t[i]; the draft's vocabulary is every one of
    them, None without a map (every verifier id); the verifier's states are cast to the
    draft's dtype."""
    mapped = Drafter(_DraftStandIn(torch.tensor([5, 5, 0, 7])))
    assert mapped.to_verifier_ids(torch.tensor([2, 0, 3])).tolist() == [2, 5, 10]
    assert mapped.vocabulary() == {5, 6, 2, 10} and mapped.dtype == torch.bfloat16
    plain = Drafter(_DraftStandIn())
    assert plain.to_verifier_ids(torch.tensor([2, 0])).tolist() == [2, 0]
    assert plain.vocabulary() is None
