"""Contract tests of eagle3lib.regenerate's pure logic that the other tests left open (found by
mutation testing): the one-file read path, the log lines, the template checks of synthetic
prompts and the step that runs none."""

import pytest
import tiny

from eagle3lib import conversations
from eagle3lib import regenerate as rg
from eagle3lib.config import RegenerateConfig
from eagle3lib.errors import UserError


class _Template:
    """A stand-in tokenizer: one id per character, a ChatML-like template."""

    eos_token_id = 0
    name_or_path = ""

    def apply_chat_template(self, messages, tokenize):
        if tokenize is not False:
            return [ord(c) for c in "ids"]  # token ids, as a real tokenizer's
        return "".join(f"<{m['role']}>{m['content']}</>" for m in messages)

    def __call__(self, text, add_special_tokens):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens):
        return "".join(chr(i) for i in ids if i > 1)


# Catches: read_sources' one-file path dropped (the several-files path would name the file in
# the dedupe log line) or reading a source it never assigned.
def test_one_training_file_is_read_as_data_train_and_logged_without_its_name(tmp_path):
    records = tiny.conversations(3)
    path = tiny.write_jsonl(tmp_path / "train.jsonl", [records[0], records[0], *records[1:]])
    (source,) = conversations.train_sources([path], {"train": {"max_samples": 2}})
    logged = []
    read = rg.read_sources([source], "error", dedupe=True, log=logged.append)
    assert [c["id"] for c in read] == ["c0", "c1"]
    assert logged == ["regenerate: 1 conversation(s) skipped: first prompt repeats an earlier one"]
    (tmp_path / "empty.jsonl").write_text("\n")
    (empty,) = conversations.train_sources([tmp_path / "empty.jsonl"], {"train": {}})
    with pytest.raises(UserError, match=r"empty\.jsonl: no conversation with a user turn"):
        rg.read_sources([empty], "error")


# Catches: the dedupe count logged when dedupe is off (a "0 conversation(s) skipped" line).
def test_no_repeat_count_is_logged_without_dedupe(tmp_path):
    path = tiny.write_jsonl(tmp_path / "c.jsonl", tiny.conversations(2))
    logged = []
    assert len(rg.read_conversations(path, None, False, "error", log=logged.append)) == 2
    assert logged == []


# Catches: either template check of user_turn_prefix dropped, or the template asked for token
# ids instead of its text (a prefix cut at the wrong place,
# or a system prompt the template ignores, would be sampled after silently).
def test_a_template_that_drops_the_user_text_or_the_system_turn_is_refused():
    class NoUserText(_Template):
        def apply_chat_template(self, messages, tokenize):
            return "".join(f"<{m['role']}></>" for m in messages)

    with pytest.raises(
        UserError,
        match=r"regenerate\.synthetic_prompts: the verifier's chat template does not render "
        r"a user turn's text as given; set synthetic_prompts: 0",
    ):
        rg.user_turn_prefix(NoUserText())

    class NoSystem(_Template):
        def apply_chat_template(self, messages, tokenize):
            kept = [m for m in messages if m["role"] != "system"]
            return super().apply_chat_template(kept, tokenize)

    assert rg.user_turn_prefix(NoSystem()) == [ord(c) for c in "<user>"]
    with pytest.raises(
        UserError,
        match=r"regenerate\.synthetic_system_prompts: the verifier's chat template does not "
        r"render the system turn 'Be brief\.'; leave the key empty",
    ):
        rg.user_turn_prefix(NoSystem(), "Be brief.")


# Catches: synthesizer building the step when no synthetic prompt is asked for (the job would
# then sample, and render the template, for nothing).
def test_no_synthetic_step_without_synthetic_prompts():
    class Untouchable:
        def __getattr__(self, name):
            raise AssertionError(f"tokenizer.{name} used")

    def make_sampler(width):
        raise AssertionError("sampler built")

    assert rg.synthesizer(make_sampler, Untouchable(), RegenerateConfig()) is None


# Catches: a killed writer's temporary synthetic.jsonl left behind when the prompts are sampled
# again, and their reuse not logged.
def test_synthetic_prompts_clear_stale_temps_and_their_reuse_is_logged(tmp_path):
    kept = [{"id": "synthetic-0", "turns": [{"role": "user", "content": "q"}]}]
    stale = tmp_path / ".synthetic.jsonl.tmp-x"
    stale.write_text("half the prompts")
    assert rg.synthetic_once(tmp_path, lambda: kept, log=lambda m: None) == kept
    assert not stale.exists()
    logged = []

    def synthesize():
        raise AssertionError("sampled again")

    assert rg.synthetic_once(tmp_path, synthesize, logged.append) == kept
    assert logged == ["regenerate: 1 synthetic prompts of an earlier attempt reused"]


# Catches: user_turn_prefix's message for a template that raises on a system turn dropped.
def test_a_template_that_refuses_a_system_turn_names_it():
    class NoSystem(_Template):
        def apply_chat_template(self, messages, tokenize):
            if messages[0]["role"] == "system":
                raise ValueError("System role not supported")
            return super().apply_chat_template(messages, tokenize)

    with pytest.raises(
        UserError,
        match=r"regenerate\.synthetic_system_prompts: the verifier's chat template refused the "
        r"system turn 'Be brief\.' \(System role not supported\); leave the key empty",
    ):
        rg.user_turn_prefix(NoSystem(), "Be brief.")


def _fake_generate(prompts):
    return [[len(p)] for p in prompts]


def _render(histories):
    return [[0] * sum(len(m["content"]) + 1 for m in messages) for messages in histories]


def _decode(ids):
    return f"r{ids[0]}"


# Catches: a killed writer's temporary chunk left behind, the chunk log line dropped, a
# worker's summary not returned, and a synthetic count reported without synthetic prompts.
def test_regenerate_clears_stale_chunk_temps_logs_and_summarizes(tmp_path, monkeypatch):
    monkeypatch.setattr(rg.time, "perf_counter", lambda: 5.0)  # every duration 0
    convs = [{"id": str(i), "turns": [{"role": "user", "content": "q"}]} for i in range(3)]
    cfg = RegenerateConfig(chunk_size=2)
    work = tmp_path / "work"
    args = (_fake_generate, _render, _decode, cfg, 1000, work, {"a": 1}, tmp_path / "out.jsonl")
    logged = []
    done = rg.regenerate(convs, *args, log=logged.append, worker=(1, 2))
    assert done == {"chunks_reused": 0, "seconds": 0.0}
    assert logged == [
        "regenerate: chunk 2/2, call 1: 1 turns answered, at most 0 to go (1 in 0.0 s)",
        "regenerate: chunk 2/2 (1 conversations) in 0.0 s",
    ]
    stale = work / ".chunk-00000.jsonl.tmp-x"
    stale.write_text("half a chunk")
    logged.clear()
    summary = rg.regenerate(convs, *args, log=logged.append)
    assert not stale.exists()
    assert (
        logged[0] == "regenerate: chunk 1/2, call 1: 2 turns answered, at most 0 to go (2 in 0.0 s)"
    )
    assert logged[-1] == "regenerate: chunk 2/2 already done"
    assert summary == {
        "conversations_in": 3,
        "synthetic_conversations": 0,
        "conversations_out": 3,
        "chunks": 2,
        "chunks_reused": 1,
        "seconds": 0.0,
    }


_WORKER = """
import os, pathlib, sys, time
out, share = pathlib.Path(sys.argv[1]), sys.argv[-1]
pid_file = out / "sleeper.pid"
if share == "0/2":
    while not pid_file.exists():
        time.sleep(0.02)
    sys.exit(3)
pid_file.with_suffix(".tmp").write_text(str(os.getpid()))
pid_file.with_suffix(".tmp").rename(pid_file)
time.sleep(30)
"""


# Catches: run_workers leaving the other workers running after one failed (orphans that
# keep their GPUs and write chunks after the job has failed), or logging "GPUs: None".
def test_a_failed_worker_stops_the_others_before_the_job_fails(tmp_path):
    import os
    import sys

    logged = []
    with pytest.raises(UserError, match=r"a worker failed \(exit status 3\)"):
        rg.run_workers([sys.executable, "-c", _WORKER, str(tmp_path)], None, 2, logged.append)
    assert logged == [f"regenerate: worker {k}/2 started (GPUs: none)" for k in (1, 2)]
    pid = int((tmp_path / "sleeper.pid").read_text())
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return  # stopped and reaped
    os.kill(pid, 9)  # the orphan this test started
    pytest.fail("a worker outlived the failed job")


# Catches: one chunk too many counted when the conversations fill their chunks exactly (the
# final pass would read a chunk no worker wrote).
def test_conversations_that_fill_their_chunks_make_no_extra_chunk(tmp_path):
    convs = [{"id": str(i), "turns": [{"role": "user", "content": "q"}]} for i in range(4)]
    args = (_fake_generate, _render, _decode, RegenerateConfig(chunk_size=2), 1000)
    summary = rg.regenerate(convs, *args, tmp_path, {}, tmp_path / "out.jsonl", log=lambda m: 0)
    assert (summary["chunks"], summary["conversations_out"]) == (2, 4)


# Catches: the progress line's "at most N to go" subtracting the turns still to come.
def test_progress_counts_the_queued_and_the_later_turns_to_go():
    two = [{"role": "user", "content": "q"}, {"role": "user", "content": "q"}]
    convs = [{"id": "a", "turns": two}, {"id": "b", "turns": two}]
    lines = []
    rg.regenerate_chunk(
        convs, _render, _decode, _fake_generate, 1000, wave=1, progress=lines.append
    )
    assert [line.split(" (")[0] for line in lines] == [
        f"call {k}: {k} turns answered, at most {4 - k} to go" for k in range(1, 5)
    ]


# Catches: synthesizer without system prompts sampling under none (every prompt continues the
# template's own first user turn: prefix None), and a wrong duration in its log line.
def test_synthetic_prompts_without_system_prompts_continue_the_plain_user_turn(monkeypatch):
    monkeypatch.setattr(rg.time, "perf_counter", lambda: 5.0)  # every duration 0
    asked = []

    def make_sampler(width):
        def sample(prompts):
            asked.extend(prompts)
            return [[ord("q"), 0] for _ in prompts]

        return sample

    cfg = RegenerateConfig(synthetic_prompts=2)
    logged = []
    synthesize = rg.synthesizer(make_sampler, _Template(), cfg, log=logged.append)
    assert [c["turns"][0]["content"] for c in synthesize()] == ["q"]  # the repeat dropped
    assert asked == [[ord(c) for c in "<user>"]] * 2
    assert logged == [
        "regenerate: 1 of 2 synthetic prompts kept in 0.0 s (0 not ended within 128 tokens, "
        "0 empty, 1 repeats)"
    ]


# Catches: the cut character kept after a one-character answer (the test for "something else
# is left" looking one character too far back).
def test_a_one_character_answer_loses_only_its_cut_character():
    assert rg.without_cut_character("a\ufffd") == "a"
    assert rg.without_cut_character("\ufffd") == "\ufffd"
