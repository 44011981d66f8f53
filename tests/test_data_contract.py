"""eagle3lib/data.py: token ids and loss masks as training sees them, and what a user reads
when no sample is left (from a mutation audit; each test names what it catches)."""

import numpy as np
import pytest
import tiny

from eagle3lib import conversations, data
from eagle3lib.config import PrepareConfig
from eagle3lib.errors import UserError

THINK_CHAT = [
    {"role": "user", "content": "a"},
    {"role": "assistant", "content": "<think>x</think> first"},
    {"role": "user", "content": "b"},
    {"role": "assistant", "content": "<think>y</think> second"},
]


# Catches: the per-turn samples of a template that rewrites history given a loss mask of 2
# (not 1) on the supervised span (doubled supervised-token counts, a mask that is no longer
# 0/1); tests that decode the supervised spans only look at which tokens are non-zero.
def test_each_fanned_out_sample_masks_exactly_its_own_reply_with_ones(tmp_path):
    """With a template that drops earlier <think> blocks, sample j is render(turns[:2j+2])
    and its mask is 0 over the prompt (generation header included), 1 over the reply and
    its end-of-turn tokens, nothing else."""
    tok = tiny.build_tokenizer(tmp_path / "tok", tiny.THINK_TEMPLATE)
    samples = data.tokenize_conversation(tok, THINK_CHAT)
    assert len(samples) == 2
    for j, (ids, mask) in enumerate(samples):
        turns = THINK_CHAT[: 2 * j + 2]
        prompt = data.render_ids(tok, turns[:-1], add_generation_prompt=True)
        full = data.render_ids(tok, turns, add_generation_prompt=False)
        assert ids.dtype == np.int64 and ids.tolist() == full
        assert mask.dtype == np.uint8
        assert mask.tolist() == [0] * len(prompt) + [1] * (len(full) - len(prompt))


# Catches: prepare_samples spreading the ids and input_ids of several files among each other
# but not their loss masks (each sample then trained with another sample's mask).
def test_samples_of_several_files_keep_their_own_loss_masks(tokenizer, tmp_path):
    """With data.extra_train the samples of the files are interleaved; every sample's loss
    mask still is the one tokenize_conversation gives for that sample's conversation."""
    main_records = tiny.conversations(3, fmt="openai")
    extra_records = tiny.conversations(2, seed=7, fmt="openai")
    main = tiny.write_jsonl(tmp_path / "train.jsonl", main_records)
    extra = tiny.write_jsonl(tmp_path / "extra.jsonl", extra_records)
    sources = conversations.train_sources([main, extra], {"train": {}, "extra_train": [{}]})
    prepared = data.prepare_samples(tokenizer, sources, PrepareConfig())
    by_id = {r["id"]: r for r in main_records}
    by_id |= {"extra_train[0]:" + r["id"]: r for r in extra_records}
    assert prepared.ids == ["c0", "extra_train[0]:c0", "c1", "extra_train[0]:c1", "c2"]
    for sample_id, ids, mask in zip(
        prepared.ids, prepared.input_ids, prepared.loss_masks, strict=True
    ):
        messages = conversations.normalize_conversation(by_id[sample_id])
        [(want_ids, want_mask)] = data.tokenize_conversation(tokenizer, messages)
        assert np.array_equal(ids, want_ids) and np.array_equal(mask, want_mask), sample_id


# Catches: the "no usable samples" error of a file with no records listing an empty
# "dropped" (the "no records" fallback lost); its drop reasons listed in the order first met
# instead of sorted.
def test_a_file_without_records_says_so_and_what_to_check(tokenizer, tmp_path):
    """An empty training file: the error names the file, 0 records read, "no records"
    dropped, and the generic remedy. Drop reasons are listed sorted by name."""
    path = tiny.write_jsonl(tmp_path / "train.jsonl", [])
    with pytest.raises(UserError) as err:
        data.prepare_samples(tokenizer, path, PrepareConfig())
    assert str(err.value) == (
        f"{path}: no usable training samples (0 records read; dropped no records); "
        "check the data format and the verifier's chat template"
    )
    long = tiny.conversations(1, fmt="openai")[0]
    question = {"messages": [{"role": "user", "content": "only a question"}]}
    tiny.write_jsonl(path, [long, question, question])
    with pytest.raises(UserError, match=r"dropped no_assistant_turn: 2, too_long: 1\)"):
        data.prepare_samples(tokenizer, path, PrepareConfig(max_length=8, truncation="drop"))


# Catches: the chat-template check naming only the tokenizer's name_or_path (an empty
# prefix ": the verifier's tokenizer has no chat template" for a tokenizer not loaded from
# a folder) instead of falling back to the training file.
def test_a_missing_chat_template_of_an_unnamed_tokenizer_names_the_training_file(tmp_path):
    tok = tiny.build_tokenizer(tmp_path / "tok")
    tok.chat_template = None
    tok.name_or_path = ""
    path = tiny.write_jsonl(tmp_path / "train.jsonl", tiny.conversations(1))
    with pytest.raises(UserError) as err:
        data.prepare_samples(tok, path, PrepareConfig())
    assert str(err.value).startswith(f"{path}: the verifier's tokenizer has no chat template")


# Catches: tokenize_conversation returning None (not an empty list) for a conversation
# without a supervised turn; render_ids_batch of no conversations asking the tokenizer
# (which refuses an empty batch) instead of returning [].
def test_no_supervised_turn_gives_no_samples_and_no_conversations_no_renders(tokenizer):
    question = [{"role": "user", "content": "only a question"}]
    assert data.tokenize_conversation(tokenizer, question) == []
    assert data.render_ids_batch(tokenizer, [], add_generation_prompt=True) == []
