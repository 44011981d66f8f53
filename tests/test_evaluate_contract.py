"""eagle3lib/evaluate.py: the figures acceptance.json reports beyond test_evaluate.py: the
bookkeeping of both methods (text checks, argmax agreement, per-prompt records), the summary's
top-level fields, the log line and the category order (from a mutation audit; each test names
what it catches). Cheap: no verifier or draft model; the model-running steps (decoding, greedy
generation, the teacher-forced forward, the draft) are replaced by stand-ins that return
hand-written tokens, so every figure below is counted by hand."""

import pytest
import torch

from eagle3lib import evaluate
from eagle3lib.config import EvaluateConfig

EOS = 1
WORDS = ["<|endoftext|>", "<|im_end|>", "w2", "w3", "w4", "w5", "w6", "w7"]

# Two prompts of set "a" (the headline), the second also alone in set "b". The verifier's
# greedy continuations: "short" ends at end-of-sequence; "long" runs past max_new_tokens = 4.
SHORT = {"id": "short", "token_ids": [3, 2, 2]}
LONG = {"id": "long", "token_ids": [2, 3]}
GREEDY = {(3, 2, 2): [5, EOS], (2, 3): [4, 5, 6, 7, 4, 5, 6]}
# The stand-in draft never proposes 6 (its vocabulary lacks it) and is right everywhere else:
# chain runs (k = 2) short [2, 2, 1, 0] (the EOS stops it), long [2, 1, 0, 2, 2, 1, 0, 0].
VOCABULARY = {1, 2, 3, 4, 5, 7}
DISAGREEMENTS = {(3, 2, 2): 0, (2, 3): 1}  # teacher-forced argmax != the generated token


def word_tokenizer():
    """A real fast tokenizer over WORDS (no training): decode joins words with spaces."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token=WORDS[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=WORDS[EOS], pad_token=WORDS[0])


class Verifier(torch.nn.Module):
    """What evaluate reads of a verifier besides running it: its decoder layers (Capture hooks
    them) and its generation config's end-of-sequence id."""

    def __init__(self):
        super().__init__()
        self.config = type("Config", (), {"num_hidden_layers": 3})()
        self.generation_config = type("GenerationConfig", (), {"eos_token_id": EOS})()
        self.layers = torch.nn.ModuleList([torch.nn.Identity() for _ in range(3)])


class StandInDrafter:
    """Stands in for eagle3lib.drafter.Drafter (monkeypatched into evaluate): teacher-forced
    predictions by the rule above, and the vocabulary."""

    def __init__(self, draft):
        self.dtype = torch.float32

    def predict_all(self, tokens: list[int], steps: int) -> torch.Tensor:
        # row j, column i proposes x_{i+2+j}: right unless it is 6 (then 0); past the end, -9
        target = tokens + [-9] * (steps + 2)
        n = len(tokens) - 1
        return torch.tensor(
            [[0 if target[i + 2 + j] == 6 else target[i + 2 + j] for i in range(n)]
             for j in range(steps)]
        )  # fmt: skip

    def vocabulary(self) -> set[int]:
        return VOCABULARY


@pytest.fixture
def stand_ins(monkeypatch):
    """Replaces evaluate's model-running functions (not torch's or transformers'): greedy
    generation (records its settings), the teacher-forced pass, the decode loop and the
    greedy reference (which differs from decoding for "long", as numerics can make it)."""
    calls = {"generate": [], "decode": []}

    def hf_generate(model, tokenizer, cfg):
        calls["generate"].append((cfg.max_new_tokens, cfg.batch_size, cfg.temperature))
        return lambda prompts: [GREEDY[tuple(p)] for p in prompts]

    def replay_prompt(model, capture, drafter, tokens, prompt_len, steps):
        predictions = drafter.predict_all(tokens, steps)
        return predictions, DISAGREEMENTS[tuple(tokens[:prompt_len])], len(tokens) - prompt_len

    def speculative_decode(model, capture, drafter, prompt, k, max_new_tokens, eos):
        calls["decode"].append((tuple(prompt), k, max_new_tokens, eos))
        # what the loop gives with this draft at k = 2 (as replay_steps walks it)
        return {(3, 2, 2): {"tokens": [5, EOS], "accepted": [1]},
                (2, 3): {"tokens": [4, 5, 6, 7], "accepted": [1, 2]}}[tuple(prompt)]  # fmt: skip

    def greedy_reference(model, prompt, max_new_tokens, eos):
        return {(3, 2, 2): [5, EOS], (2, 3): [4, 5, 6, 4]}[tuple(prompt)]

    for name, value in [
        ("hf_generate", hf_generate),
        ("replay_prompt", replay_prompt),
        ("speculative_decode", speculative_decode),
        ("greedy_reference", greedy_reference),
        ("Drafter", StandInDrafter),
    ]:
        monkeypatch.setattr(evaluate, name, value)
    return calls


def run(method, k):
    sets = [{"name": "a", "prompts": [SHORT, LONG]}, {"name": "b", "prompts": [LONG]}]
    cfg = EvaluateConfig(k=k, max_new_tokens=4, method=method, batch_size=5)
    lines = []
    model = Verifier()
    result = evaluate.evaluate(model, None, word_tokenizer(), sets, cfg, [0, 1], log=lines.append)
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.layers)
    return result, lines


# Catches: the summary's max_new_tokens not cfg's; a per-(set, k) result without its
# "seconds"; argmax_agreement over one position too many (or per-prompt disagreements of 0);
# replay's mismatched_prompts 0 instead of None (it checks no text); greedy generation asked
# for fewer than max_new_tokens + max(k) + 1 tokens; the headline's text keeping the
# end-of-sequence token (skip_special_tokens off); the log line's digits or its last figure.
def test_replay_summary_counts_every_figure_by_hand(stand_ins):
    """Replay at k = 2 and 1, max_new_tokens = 4: one greedy generation of 4 + 2 + 1 tokens a
    prompt, then the walk: short accepts [1] at both k (the EOS, then it stops); long [1, 2] at
    k = 2, [1, 1] at k = 1. Per token (steps 0, 1): short 1 of 1, 0 of 0; long 2 of 3, 0 of 2.
    Set a's argmax agreement: 1 disagreement in 2 + 7 generated tokens."""
    result, lines = run("replay", [2, 1])
    assert stand_ins["generate"] == [(7, 5, 0.0), (7, 5, 0.0)]  # one call per set
    seconds = result.pop("seconds")
    assert isinstance(seconds, float) and seconds >= 0
    results = result.pop("results")
    headline = {
        "eval_set": "a",
        "prompts": 2,
        "k": 2,
        "steps": 3,
        "accepted_tokens": 4,
        "acceptance_length": pytest.approx(1 + 4 / 3),
        "per_position_acceptance": pytest.approx([1.0, 1 / 3]),
        "per_token_accuracy": [0.75, 0.0],
        "text_matches_verifier": None,
        "mismatched_prompts": None,
        "argmax_agreement": pytest.approx(1 - 1 / 9),
        "out_of_draft_vocab": pytest.approx(1 / 6),  # the 6 of long's [4, 5, 6, 7]; short [5, 1]
    }
    assert result == {
        **headline,
        "method": "replay",
        "max_new_tokens": 4,
        "per_prompt": [
            {"id": "short", "steps": 1, "acceptance_length": 2.0, "new_tokens": 2,
             "argmax_disagreements": 0, "text": "w5"},
            {"id": "long", "steps": 2, "acceptance_length": 2.5, "new_tokens": 4,
             "argmax_disagreements": 1},
        ],
    }  # fmt: skip
    for r in results:
        assert isinstance(r.pop("seconds"), float)
    long_alone = {"eval_set": "b", "prompts": 1, "text_matches_verifier": None,
                  "mismatched_prompts": None, "argmax_agreement": pytest.approx(6 / 7),
                  "out_of_draft_vocab": 0.25}  # fmt: skip
    assert results == [
        {**headline},
        {**headline, "k": 1, "steps": 3, "accepted_tokens": 3, "acceptance_length": 2.0,
         "per_position_acceptance": [1.0], "per_token_accuracy": [0.75]},
        {**long_alone, "k": 2, "steps": 2, "accepted_tokens": 3, "acceptance_length": 2.5,
         "per_position_acceptance": [1.0, 0.5], "per_token_accuracy": [2 / 3, 0.0]},
        {**long_alone, "k": 1, "steps": 2, "accepted_tokens": 2, "acceptance_length": 2.0,
         "per_position_acceptance": [1.0], "per_token_accuracy": [2 / 3]},
    ]  # fmt: skip
    assert [line for line in lines if " k=" in line] == [
        "evaluate: a k=2 acceptance_length=2.333 per position 1.000, 0.333 per token "
        "(teacher-forced) 0.750, 0.000 out of the draft's vocabulary 0.167",
        "evaluate: a k=1 acceptance_length=2.000 per position 1.000 per token "
        "(teacher-forced) 0.750 out of the draft's vocabulary 0.167",
        "evaluate: b k=2 acceptance_length=2.500 per position 1.000, 0.500 per token "
        "(teacher-forced) 0.667, 0.000 out of the draft's vocabulary 0.250",
        "evaluate: b k=1 acceptance_length=2.000 per position 1.000 per token "
        "(teacher-forced) 0.667 out of the draft's vocabulary 0.250",
    ]


# Catches: a prompt whose speculative text differs from greedy decoding not counted in
# mismatched_prompts, text_matches_verifier true regardless, or the per-prompt
# matches_verifier true regardless (the report's only sign that decoding went wrong).
def test_decode_counts_the_prompts_whose_text_differs_from_greedy_decoding(stand_ins):
    """The decode loop gives long [4, 5, 6, 7], greedy decoding [4, 5, 6, 4]: one prompt of
    set a and the one of set b mismatch; short matches. The counts are the loop's."""
    result, _ = run("decode", 2)
    assert stand_ins["decode"] == [
        ((3, 2, 2), 2, 4, {EOS}), ((2, 3), 2, 4, {EOS}), ((2, 3), 2, 4, {EOS}),
    ]  # fmt: skip
    assert stand_ins["generate"] == []
    assert (result["text_matches_verifier"], result["mismatched_prompts"]) == (False, 1)
    assert [r["matches_verifier"] for r in result["per_prompt"]] == [True, False]
    assert [(r["eval_set"], r["text_matches_verifier"], r["mismatched_prompts"])
            for r in result["results"]] == [("a", False, 1), ("b", False, 1)]  # fmt: skip
    assert (result["steps"], result["accepted_tokens"]) == (3, 4)
    assert result["per_token_accuracy"] == [0.75, 0.0]
    assert result["per_prompt"][0]["text"] == "w5"
    assert [r["new_tokens"] for r in result["per_prompt"]] == [2, 4]
    assert "argmax_agreement" not in result and result["method"] == "decode"


# Catches: the log line printing 2 digits, or another figure in place of the out-of-vocabulary
# share; None (no verifier step, no position counted) printed other than as n/a.
def test_run_line_prints_three_digits_and_n_a_for_what_was_not_measured():
    run_ = {"k": 2, "acceptance_length": None, "per_position_acceptance": [0.0, 0.0],
            "per_token_accuracy": [None, 0.5], "out_of_draft_vocab": 0.0123}  # fmt: skip
    assert evaluate._run_line("mtbench", run_) == (
        "evaluate: mtbench k=2 acceptance_length=n/a per position 0.000, 0.000 per token "
        "(teacher-forced) n/a, 0.500 out of the draft's vocabulary 0.012"
    )


# Catches: by_category's categories sorted (by name) instead of in the order they first appear
# (the report's table and acceptance.png list them in acceptance.json's order).
def test_categories_are_listed_in_the_order_they_first_appear():
    prompts = [{"category": "writing"}, {"category": "math"}, {}, {"category": "coding"},
               {"category": "math"}]  # fmt: skip
    got = evaluate.by_category(prompts, [[1], [0, 2], [3], [2], [1]], 2)
    assert list(got) == ["writing", "math", "coding"]
    assert got["math"] == {"prompts": 2, "steps": 3, "acceptance_length": 2.0}


# Catches: by_category's or acceptance_stats' zip losing strict=True: a list of accepted counts
# (or of per-token counts) one short would silently drop a prompt (or a step) from the figures.
def test_counts_that_do_not_line_up_are_refused_not_truncated():
    with pytest.raises(ValueError, match="zip"):
        evaluate.by_category([{"category": "x"}, {"category": "y"}], [[1]], 2)
    with pytest.raises(ValueError, match="zip"):
        evaluate.acceptance_stats([1], 2, [1, 0], [2])
