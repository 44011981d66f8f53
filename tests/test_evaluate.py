import pytest
import torch

from eagle3lib import checkpoint, data, evaluate, train
from eagle3lib.config import EvaluateConfig
from eagle3lib.hidden_states import Capture, forward_states
from eagle3lib.verifier import decoder_layers

AUX = [2, 4, 5]


@pytest.fixture(scope="module")
def draft(pipeline):
    return checkpoint.load_draft(
        pipeline["checkpoint"], pipeline["record"]["load_path"], "sdpa", torch.float32
    )


def test_acceptance_stats_follow_vllm_definitions():
    stats = evaluate.acceptance_stats([3, 0, 1, 2], 3)
    assert stats["acceptance_length"] == pytest.approx(1 + 6 / 4)
    assert stats["per_position_acceptance"] == [0.75, 0.5, 0.25]
    assert stats["steps"] == 4 and stats["accepted_tokens"] == 6


def test_first_proposal_matches_speculators_training_alignment(pipeline, draft, verifier_model):
    """Draft index i pairs the aux state of token i with token i+1, as shift_batch does."""
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn

    ds = train.ShardDataset(pipeline["shards"], [(0, 0)], 256, torch.float32)
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
    drafter = evaluate.Drafter(draft)
    for n in (5, 17, n_real - 1):
        [p] = drafter.propose(aux[:n], ids[: n + 1], 1)
        assert p == int(drafter.to_verifier_ids(tokens[0, n - 1]))


def prompts(tokenizer, n=3):
    texts = ["Tell me about the draft model", "Write a list of numbers", "Why is decoding fast"]
    return [
        {"id": str(i), "token_ids": data.prompt_token_ids(tokenizer, t)}
        for i, t in enumerate(texts[:n])
    ]


def test_speculative_output_equals_greedy_decoding(draft, verifier_model, tokenizer):
    result = evaluate.evaluate(
        verifier_model,
        draft,
        tokenizer,
        prompts(tokenizer),
        EvaluateConfig(k=3, max_new_tokens=24),
        AUX,
        log=lambda m: None,
    )
    assert result["text_matches_verifier"] is True and result["mismatched_prompts"] == 0
    assert result["prompts"] == 3 and result["k"] == 3
    assert 1.0 <= result["acceptance_length"] <= 4.0
    assert len(result["per_position_acceptance"]) == 3
    pp = result["per_position_acceptance"]
    assert pp[0] >= pp[1] >= pp[2]


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


def test_aux_states_during_decoding_equal_a_full_forward(verifier_model, tokenizer):
    """The verifier states fed to the draft while decoding with a KV cache equal a fresh forward."""
    seen = []

    class Recorder:
        dtype = torch.float32

        def propose(self, aux, tokens, k):
            seen.append((aux.clone(), tokens.clone()))
            return [0] * k

    capture = Capture(decoder_layers(verifier_model), AUX)
    try:
        prompt = prompts(tokenizer, 1)[0]["token_ids"]
        evaluate.speculative_decode(verifier_model, capture, Recorder(), prompt, 2, 8, set())
        aux, tokens = seen[-1]
        [ref] = forward_states(
            verifier_model.get_decoder(), capture, [tokens[:-1].numpy()], torch.device("cpu")
        )
    finally:
        capture.remove()
    assert aux.shape == (len(tokens) - 1, 3 * 64)
    torch.testing.assert_close(aux, ref[:, :-1].flatten(1), rtol=1e-4, atol=1e-4)


def test_bf16_evaluation_runs_the_draft_in_its_own_dtype(pipeline, verifier_model, tokenizer):
    """The path a GPU takes (bf16 verifier and draft), here on CPU."""
    import copy

    draft = checkpoint.load_draft(
        pipeline["checkpoint"], pipeline["record"]["load_path"], "sdpa", torch.bfloat16
    )
    model = copy.deepcopy(verifier_model).to(torch.bfloat16)
    result = evaluate.evaluate(
        model,
        draft,
        tokenizer,
        prompts(tokenizer, 1),
        EvaluateConfig(k=2, max_new_tokens=6),
        AUX,
        log=lambda m: None,
    )
    assert result["steps"] > 0 and result["k"] == 2
