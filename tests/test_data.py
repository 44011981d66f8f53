import gzip
import itertools
import json
import time
from collections import Counter

import numpy as np
import pytest
import tiny

from eagle3lib import conversations, data
from eagle3lib.config import PrepareConfig
from eagle3lib.errors import UserError


def spans(ids, mask, tokenizer):
    """Decoded text of each contiguous supervised span."""
    out, start = [], None
    for i, m in enumerate([*mask.tolist(), 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append(tokenizer.decode(ids[start:i].tolist()))
            start = None
    return out


CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello there"},
    {"role": "assistant", "content": "Hi. How can I help?"},
    {"role": "user", "content": "Tell me two numbers"},
    {"role": "assistant", "content": "One and two."},
]


def test_loss_mask_covers_assistant_turns_and_end_of_turn_only(tokenizer):
    [(ids, mask)] = data.tokenize_conversation(tokenizer, CHAT)
    assert tokenizer.decode(ids.tolist()) == tokenizer.apply_chat_template(CHAT, tokenize=False)
    assert spans(ids, mask, tokenizer) == [
        "Hi. How can I help?<|im_end|>\n",
        "One and two.<|im_end|>\n",
    ]
    # Nothing of the system/user turns nor the assistant header is supervised.
    prompt = data.render_ids(tokenizer, CHAT[:2], add_generation_prompt=True)
    assert mask[: len(prompt)].sum() == 0


def test_conversation_ending_with_user_turn_and_leading_assistant(tokenizer):
    chat = [
        {"role": "assistant", "content": "Welcome!"},  # no user before: context only
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    [(ids, mask)] = data.tokenize_conversation(tokenizer, chat)
    assert spans(ids, mask, tokenizer) == ["Hello.<|im_end|>\n"]
    assert "Bye" not in tokenizer.decode(ids.tolist())  # trailing user turn is not rendered


def test_think_template_fans_out_one_sample_per_turn(tmp_path):
    tok = tiny.build_tokenizer(tmp_path, tiny.THINK_TEMPLATE)
    chat = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "<think>x y</think> first"},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "<think>z</think> second"},
    ]
    samples = data.tokenize_conversation(tok, chat)
    assert len(samples) == 2
    assert spans(*samples[0], tok) == ["<think>x y</think> first<|im_end|>\n"]
    # The second sample is what the verifier sees at turn 2: history without the think block.
    assert "x y" not in tok.decode(samples[1][0].tolist())
    assert spans(*samples[1], tok) == ["<think>z</think> second<|im_end|>\n"]


@pytest.mark.parametrize("fmt", ["sharegpt", "openai"])
def test_sharegpt_and_openai_records_normalise_the_same(fmt):
    [record] = tiny.conversations(1, seed=3, fmt=fmt)
    messages = conversations.normalize_conversation(record)
    [reference] = tiny.conversations(1, seed=3, fmt="openai")
    assert messages == reference["messages"]


def test_json_array_and_jsonl_read_the_same(tmp_path):
    records = tiny.conversations(5)
    (tmp_path / "a.json").write_text(json.dumps(records, indent=2))
    tiny.write_jsonl(tmp_path / "a.jsonl", records)
    from_json = [r for _, r in conversations.read_records(tmp_path / "a.json")]
    from_jsonl = [r for _, r in conversations.read_records(tmp_path / "a.jsonl")]
    assert from_json == from_jsonl == records


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"messages": []}\n{"messages": [}\n')
    with pytest.raises(UserError, match=r"bad\.jsonl:2: invalid JSON"):
        list(conversations.read_records(path))


def test_truncated_json_array_needs_opt_in(tmp_path):
    records = tiny.conversations(3)
    text = json.dumps(records, indent=1)
    path = tmp_path / "cut.json"
    path.write_text(text[: text.rindex('"value"') + 12])  # cut inside the last record
    with pytest.raises(UserError, match="allow_truncated_json"):
        list(conversations.read_records(path))
    kept = [r for _, r in conversations.read_records(path, allow_truncated_json=True)]
    assert kept == records[:2]


def test_non_utf8_file_is_a_clear_error(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"a": 1}\n{"a": "caf\xe9"}\n')
    with pytest.raises(UserError, match=r"latin1\.jsonl:2: not valid UTF-8"):
        list(conversations.read_records(path))


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        ({"text": "hi"}, "neither 'conversations'"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "unknown role"),
        ({"messages": [{"role": "user", "content": "  "}]}, "empty content"),
        ({"messages": "hello"}, "not a list"),
        ({"conversations": []}, "no turns"),
        ({"messages": []}, "no turns"),
        ([1, 2], "not a JSON object"),
    ],
)
def test_invalid_records_are_named(record, reason):
    with pytest.raises(conversations.InvalidRecord, match=reason):
        conversations.normalize_conversation(record)


def prepare(tokenizer, tmp_path, records, **cfg):
    path = tiny.write_jsonl(tmp_path / "train.jsonl", records)
    return data.prepare_samples(tokenizer, path, PrepareConfig(**cfg))


def test_prepare_counts_drops_and_token_frequencies(tokenizer, tmp_path):
    records = tiny.conversations(6, fmt="openai")
    records.insert(2, {"messages": [{"role": "user", "content": "only a question"}]})
    records.insert(4, {"messages": [{"role": "user", "content": ""}]})
    records.insert(5, {"id": "empty", "conversations": []})
    prepared = prepare(tokenizer, tmp_path, records, on_invalid_record="skip")
    assert prepared.summary["samples"] == 6
    assert prepared.summary["dropped"] == {
        "invalid: empty content": 1,
        "invalid: no turns": 1,
        "no_assistant_turn": 1,
    }
    supervised = np.concatenate(
        [
            ids[m.astype(bool)]
            for ids, m in zip(prepared.input_ids, prepared.loss_masks, strict=True)
        ]
    )
    assert (
        sum(prepared.token_freq.values())
        == len(supervised)
        == prepared.summary["supervised_tokens"]
    )
    assert prepared.ids[:2] == ["c0", "c1"]


def repeats_of(records):
    """records with copies of the first and third conversations' first prompts (spacing and
    case changed, other replies), a copy under another system turn, and one of a dropped
    conversation's prompt."""
    first, third = records[0]["messages"], records[2]["messages"]
    return [
        *records,
        {"messages": [{"role": "user", "content": "  " + first[0]["content"].upper()},
                      {"role": "assistant", "content": "another reply"}]},
        {"messages": [third[0], {"role": "assistant", "content": "x"}, *first[:2]]},
        {"messages": [{"role": "system", "content": "Be brief."}, *first[:2]]},
        {"messages": [{"role": "user", "content": "only a question"}]},
        {"messages": [{"role": "user", "content": "only a question"},
                      {"role": "assistant", "content": "now answered"}]},
    ]  # fmt: skip


@pytest.mark.parametrize("workers", [1, 2])
def test_dedupe_drops_conversations_repeating_a_kept_first_prompt(tokenizer, tmp_path, workers):
    records = repeats_of(tiny.conversations(4, fmt="openai"))
    path = tiny.write_jsonl(tmp_path / "train.jsonl", records)
    every = data.prepare_samples(tokenizer, path, PrepareConfig(), workers=workers)
    assert every.summary["samples"] == 8 and "repeated_prompt" not in every.summary["dropped"]
    cfg = PrepareConfig(dedupe=True, max_samples=5)
    deduped = data.prepare_samples(tokenizer, path, cfg, workers=workers)
    # the system-turn copy is another prompt; the answered "only a question" follows a
    # conversation that was dropped (no reply), so it repeats nothing kept
    assert deduped.ids == ["c0", "c1", "c2", "c3", "7"]
    assert deduped.summary["dropped"] == {"repeated_prompt": 2}
    assert deduped.summary["samples"] == 5
    all_kept = data.prepare_samples(tokenizer, path, PrepareConfig(dedupe=True), workers=workers)
    assert all_kept.ids == ["c0", "c1", "c2", "c3", "7", "9"]
    assert all_kept.summary["dropped"] == {"repeated_prompt": 2, "no_assistant_turn": 1}


def test_first_prompt_key_ignores_spacing_case_and_later_turns():
    key = conversations.first_prompt_key
    chat = [{"role": "user", "content": "Hello  there\n"}, {"role": "assistant", "content": "a"}]
    assert key(chat) == key([{"role": "user", "content": "hello there"}]) == "user: hello there"
    assert key([{"role": "system", "content": "S"}, *chat]) == "system: s\nuser: hello there"
    assert key([{"role": "user", "content": "hello"}]) != key(chat)
    assert key([{"role": "assistant", "content": "no user turn"}]) is None


def test_invalid_record_is_fatal_by_default(tokenizer, tmp_path):
    records = [
        *tiny.conversations(2, fmt="openai"),
        {"messages": [{"role": "bot", "content": "x"}]},
    ]
    with pytest.raises(UserError, match=r"train\.jsonl:3: unknown role .*on_invalid_record: skip"):
        prepare(tokenizer, tmp_path, records)


def test_record_without_turns_is_invalid_not_silently_dropped(tokenizer, tmp_path):
    """`conversations: []` follows data.on_invalid_record like any other invalid record."""
    records = [*tiny.conversations(2), {"id": "x", "conversations": []}]
    with pytest.raises(UserError) as err:
        prepare(tokenizer, tmp_path, records)
    assert str(err.value).startswith(f"{tmp_path / 'train.jsonl'}:3: no turns")
    assert "on_invalid_record: skip" in str(err.value) and "\n" not in str(err.value)


def test_max_length_truncates_or_drops(tokenizer, tmp_path):
    records = tiny.conversations(8, fmt="openai")
    full = prepare(tokenizer, tmp_path, records, max_length=4096)
    longest = max(len(t) for t in full.input_ids)
    cut = prepare(tokenizer, tmp_path, records, max_length=longest - 5)
    assert max(len(t) for t in cut.input_ids) == longest - 5
    assert cut.summary["truncated"] >= 1
    dropped = prepare(tokenizer, tmp_path, records, max_length=longest - 5, truncation="drop")
    assert dropped.summary["dropped"]["too_long"] >= 1
    assert len(dropped.ids) == len(full.ids) - dropped.summary["dropped"]["too_long"]


def test_empty_dataset_and_no_assistant_turn_are_errors(tokenizer, tmp_path):
    with pytest.raises(UserError, match="no usable training samples"):
        prepare(tokenizer, tmp_path, [])
    with pytest.raises(UserError, match="no_assistant_turn: 2"):
        prepare(tokenizer, tmp_path, [{"messages": [{"role": "user", "content": "q"}]}] * 2)


def test_tokenizer_without_chat_template_is_an_error(tokenizer, tmp_path):
    tok = tiny.build_tokenizer(tmp_path / "tok")
    tok.chat_template = None
    with pytest.raises(UserError, match="no chat template"):
        prepare(tok, tmp_path, tiny.conversations(2))


def test_eval_prompts_are_held_out_of_training(tokenizer, tmp_path):
    """A conversation whose user turn holds an eval prompt (here inside a longer turn) is
    dropped and counted for the eval set (file) it overlaps; eagle3lib/leakage.py's own tests
    cover what counts as overlap."""
    from eagle3lib.leakage import EvalPromptIndex

    records = tiny.conversations(4, fmt="openai")
    first_user = records[1]["messages"][0]["content"]
    records[1]["messages"][0]["content"] = f"Please: {first_user.upper()}!"
    path = tiny.write_jsonl(tmp_path / "train.jsonl", records)
    held_out = EvalPromptIndex.build([["an unrelated question of another set"], [first_user]])
    prepared = data.prepare_samples(tokenizer, path, PrepareConfig(), held_out)
    assert prepared.summary["dropped"] == {"eval_prompt_overlap": 1}
    assert prepared.ids == ["c0", "c2", "c3"]
    assert prepared.summary["eval_overlap"] == {
        "ngram": 8,
        "min_containment": 0.7,
        "dropped_per_eval_file": [0, 1],
    }


def _same_prepared(a, b):
    assert a.ids == b.ids and a.summary == b.summary and a.token_freq == b.token_freq
    pairs = [
        *zip(a.input_ids, b.input_ids, strict=True),
        *zip(a.loss_masks, b.loss_masks, strict=True),
    ]
    for x, y in pairs:
        assert x.dtype == y.dtype and np.array_equal(x, y)


@pytest.mark.parametrize("max_samples", [None, 7])
def test_worker_processes_prepare_the_same_samples(tokenizer, tmp_path, max_samples):
    """Truncation, invalid records, eval overlap and the max_samples cut, with 1 and 2 workers."""
    from eagle3lib.leakage import EvalPromptIndex

    records = tiny.conversations(12, fmt="openai")
    records.insert(3, {"messages": [{"role": "user", "content": ""}]})
    records.insert(6, {"messages": [{"role": "user", "content": "only a question"}]})
    path = tiny.write_jsonl(tmp_path / "train.jsonl", records)
    held_out = EvalPromptIndex.build([[records[8]["messages"][0]["content"]]])
    cfg = PrepareConfig(max_length=40, on_invalid_record="skip", max_samples=max_samples)
    one = data.prepare_samples(tokenizer, path, cfg, held_out)
    assert one.summary["truncated"] > 0
    assert set(one.summary["dropped"]) == {
        "eval_prompt_overlap", "invalid: empty content", "no_assistant_turn"
    }  # fmt: skip
    assert len(one.ids) == (max_samples or 11)
    _same_prepared(one, data.prepare_samples(tokenizer, path, cfg, held_out, workers=2))
    with pytest.raises(UserError, match=r"train\.jsonl:4: empty content"):
        data.prepare_samples(tokenizer, path, PrepareConfig(), workers=2)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_bad_line_after_max_samples_is_never_met(tokenizer, tmp_path, workers):
    """Worker processes read ahead; an unreadable line past the samples asked for still does
    not fail the job, and one before them fails it naming the line, as with one process."""
    lines = [json.dumps(r) for r in tiny.conversations(6, fmt="openai")]
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join([*lines[:4], "{not json", *lines[4:]]) + "\n")
    prepared = data.prepare_samples(tokenizer, path, PrepareConfig(max_samples=3), workers=workers)
    assert prepared.ids == ["c0", "c1", "c2"]
    with pytest.raises(UserError, match=r"train\.jsonl:5: invalid JSON"):
        data.prepare_samples(tokenizer, path, PrepareConfig(max_samples=5), workers=workers)


def test_a_worker_error_is_raised_at_its_record_and_a_dead_worker_fails_the_job(
    tokenizer, tmp_path, monkeypatch
):
    """Forked workers inherit the patched function: an error at the fourth record does not
    stop a run that needs three, and is raised by one that needs five; a worker killed by
    the kernel (e.g. for memory) fails the job instead of hanging it."""
    import concurrent.futures
    import os
    import signal

    path = tiny.write_jsonl(tmp_path / "train.jsonl", tiny.conversations(6, fmt="openai"))
    real = data._record_samples

    def failing(tokenizer, record, *args):
        if record["id"] == "c3":
            raise RuntimeError("a bug at c3")
        return real(tokenizer, record, *args)

    monkeypatch.setattr(data, "_record_samples", failing)
    cfg = PrepareConfig(max_samples=3)
    assert data.prepare_samples(tokenizer, path, cfg, workers=2).ids == ["c0", "c1", "c2"]
    with pytest.raises(RuntimeError, match="a bug at c3"):
        data.prepare_samples(tokenizer, path, PrepareConfig(max_samples=5), workers=2)

    def killed(tokenizer, record, *args):
        os.kill(os.getpid(), signal.SIGKILL)

    monkeypatch.setattr(data, "_record_samples", killed)
    signal.alarm(120)  # a hang fails the test run instead of stalling it
    try:
        with pytest.raises(concurrent.futures.process.BrokenProcessPool):
            data.prepare_samples(tokenizer, path, PrepareConfig(), workers=2)
    finally:
        signal.alarm(0)


def test_prepare_takes_its_worker_count_from_the_jobs_threads(monkeypatch):
    """snakemake sets OMP_NUM_THREADS to a job's threads; prepare.py uses its leading number,
    at most the CPUs the process may run on."""
    import importlib
    import os
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts"))
    prepare = importlib.import_module("prepare")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)))
    for value, expected in [("", 1), ("3", 3), ("8,4", 4), ("abc", 1), ("2", 2)]:
        monkeypatch.setenv("OMP_NUM_THREADS", value)
        assert prepare.job_threads() == expected, value


def test_worker_windows_keep_file_order(tokenizer):
    from eagle3lib.leakage import EvalPromptIndex

    records = list(enumerate(tiny.conversations(9, fmt="openai")))
    args = (tokenizer, EvalPromptIndex(), None)
    serial = list(data._outcomes(iter(records), args, 1))
    windows = list(data._outcomes(iter(records), args, 2, window=1))  # 5 windows of 2 records
    assert [line for line, _, _ in windows] == list(range(9))
    for (_, _, a), (_, _, b) in zip(serial, windows, strict=True):
        assert [s[0].tolist() for s in a[0]] == [s[0].tolist() for s in b[0]] and a[1:] == b[1:]


def test_eval_prompt_formats(tmp_path):
    path = tiny.write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"question_id": 81, "category": "writing", "turns": ["first turn", "second turn"]},
            {"task_id": "HumanEval/0", "prompt": "def f():\n"},
            {
                "id": "x",
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "yo"},
                ],
            },
        ],
    )
    prompts = conversations.read_eval_prompts(path, None)
    assert [(p["id"], p["text"]) for p in prompts] == [
        ("81", "first turn"),
        ("HumanEval/0", "def f():\n"),
        ("x", "hi"),
    ]
    # MT-bench's category goes with its prompt (evaluation reports per category); none elsewhere
    assert [p.get("category") for p in prompts] == ["writing", None, None]
    assert len(conversations.read_eval_prompts(path, 2)) == 2


def test_prepared_samples_round_trip_and_shard_ranges(tokenizer, tmp_path):
    prepared = prepare(tokenizer, tmp_path, tiny.conversations(7))
    data.save_prepared(prepared, tmp_path / "s.safetensors", len(tokenizer))
    samples = data.load_samples(tmp_path / "s.safetensors")
    assert len(samples) == 7
    for i in range(7):
        ids, mask = samples.sample(i)
        assert np.array_equal(ids, prepared.input_ids[i])
        assert np.array_equal(mask, prepared.loss_masks[i])
    assert int(samples.token_freq.sum()) == prepared.summary["supervised_tokens"]
    ranges = [data.shard_range(7, i, 3) for i in range(3)]
    assert ranges == [(0, 2), (2, 4), (4, 7)]


@pytest.mark.parametrize("name", ["a.json", "a.jsonl"])
def test_a_byte_order_mark_is_not_part_of_the_first_record(tmp_path, name):
    """Some editors start a UTF-8 file with U+FEFF; the records read the same without it."""
    records = [{"messages": [{"role": "user", "content": "hi"}]}, {"prompt": "ho"}]
    text = json.dumps(records) if name.endswith(".json") else "\n".join(map(json.dumps, records))
    (tmp_path / name).write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert [r for _, r in conversations.read_records(tmp_path / name)] == records


@pytest.mark.parametrize("workers", [1, 2])
def test_extra_train_files_follow_data_trains_each_to_its_own_max_samples(
    tokenizer, tmp_path, workers
):
    """data.extra_train: each file read after the ones before it, at most its own max_samples,
    its ids prefixed; dedupe across the files; the files' samples spread among each other (the
    last ones, validation's, hold each file); a bad record named by its own file, line and
    config key."""
    main = tiny.write_jsonl(tmp_path / "train.jsonl", tiny.conversations(4, fmt="openai"))
    records = tiny.conversations(4, seed=5)  # ShareGPT: the formats mix
    copy = tiny.conversations(4, fmt="openai")[1]["messages"]  # data.train's second prompt
    records.insert(1, {"messages": [copy[0], {"role": "assistant", "content": "other reply"}]})
    extra = tiny.write_jsonl(tmp_path / "extra.jsonl", records)
    section = {"train": {"max_samples": 3}, "extra_train": [{"max_samples": 3}]}
    sources = conversations.train_sources([main, extra], section)
    assert [s.id_prefix for s in sources] == ["", "extra_train[0]:"]
    cfg = PrepareConfig(dedupe=True)
    both = data.prepare_samples(tokenizer, sources, cfg, workers=workers)
    assert both.ids == ["c0", "extra_train[0]:c0", "c1", "extra_train[0]:c1", "c2",
                        "extra_train[0]:c2"]  # fmt: skip
    assert both.summary["dropped"] == {"repeated_prompt": 1}  # the copy of c1's prompt
    assert both.summary["sources"] == [
        {"path": "train.jsonl", "records_read": 3, "samples": 3},
        {"path": "extra.jsonl", "records_read": 4, "samples": 3},
    ]
    alone = data.prepare_samples(tokenizer, main, PrepareConfig(max_samples=3), workers=workers)
    assert alone.ids == both.ids[::2] and "sources" not in alone.summary  # one file: as before
    for a, b in zip(alone.input_ids, both.input_ids[::2], strict=True):
        assert np.array_equal(a, b)
    records.insert(2, {"messages": [{"role": "user", "content": ""}]})
    tiny.write_jsonl(extra, records)
    with pytest.raises(UserError, match=r"extra\.jsonl:3: empty content"):
        data.prepare_samples(tokenizer, sources, cfg, workers=workers)
    with pytest.raises(UserError, match=r"2 training file\(s\) given for 1 in the data section"):
        conversations.train_sources([main, extra], {"train": {}})
    (tmp_path / "cut.json").write_text('[{"messages": [{"role": "user", "content": "a"}')
    cut = conversations.train_sources([main, tmp_path / "cut.json"], section)
    with pytest.raises(UserError, match=r"cut\.json:1: .*data\.extra_train\[0\]\.allow_trunc"):
        data.prepare_samples(tokenizer, cut, cfg, workers=workers)


def test_regeneration_reads_extra_train_files_after_data_trains(tmp_path):
    from eagle3lib import regenerate

    main = tiny.write_jsonl(tmp_path / "train.jsonl", tiny.conversations(3))
    records = tiny.conversations(3, seed=5, fmt="openai")
    records[2] = {"messages": tiny.conversations(3, fmt="openai")[0]["messages"]}  # a repeat
    extra = tiny.write_jsonl(tmp_path / "extra.jsonl", records)
    section = {"train": {"max_samples": 2}, "extra_train": [{}]}
    sources = conversations.train_sources([main, extra], section)
    read = regenerate.read_sources(sources, "error", dedupe=True)
    assert [c["id"] for c in read] == ["c0", "extra_train[0]:c0", "c1", "extra_train[0]:c1"]
    every = regenerate.read_sources(sources, "error")
    assert [c["id"] for c in every][-1] == "extra_train[0]:3"  # no id: its line
    # an extra file whose every prompt repeats data.train's: no error (prepare takes none of
    # it either); none in any file is one
    tiny.write_jsonl(extra, [{"messages": tiny.conversations(1, fmt="openai")[0]["messages"]}])
    logged = []
    assert len(regenerate.read_sources(sources, "error", True, log=logged.append)) == 2
    assert "1 conversation(s) (extra.jsonl) skipped: first prompt repeats" in logged[-1]
    (tmp_path / "empty.jsonl").write_text("\n")
    nothing = conversations.train_sources([main, tmp_path / "empty.jsonl"], section)
    assert len(regenerate.read_sources(nothing, "error")) == 2  # an empty extra file
    nothing = conversations.train_sources([tmp_path / "empty.jsonl", extra], section)
    tiny.write_jsonl(extra, [{"messages": [{"role": "assistant", "content": "no user turn"}]}])
    with pytest.raises(UserError, match=r"empty\.jsonl, .*extra\.jsonl: no conversation with"):
        regenerate.read_sources(nothing, "error")


def _pretty_array(records):
    """A JSON array file's text with each record pretty-printed over several lines."""
    return "[\n" + ",\n".join(json.dumps(r, indent=2) for r in records) + "\n]\n"


def _start_lines(records):
    """The line each record of _pretty_array(records) starts on."""
    lines, line = [], 2
    for r in records:
        lines.append(line)
        line += json.dumps(r, indent=2).count("\n") + 1
    return lines


# A template whose generation prompt holds tokens the rendered assistant turn lacks (like
# Qwen3 with thinking off): render(turns[:j+1]) does not start with the prompt's render.
THINKING_PROMPT_TEMPLATE = tiny.CHATML.replace(
    "'<|im_start|>assistant\n'", "'<|im_start|>assistant\n<think></think>\n'"
)


# ============================================================================================
# tests/test_data.py -- reading records (conversations.read_records and its helpers)
# ============================================================================================


# Catches: a JSON-array record yielded with the line where it ends instead of where it
# starts; a record cut off by the end of the file named by the line of the error (the
# unterminated string) instead of the record's first line.
def test_pretty_printed_json_array_records_are_named_by_their_first_line(tmp_path):
    """In a JSON array whose records span several lines, each record's line number (used in
    invalid-record errors and as the id of a record without one) is the line it starts on;
    a record cut off mid-string is named by its first line, an invalid token by its own."""
    records = tiny.conversations(3, fmt="openai")
    text = _pretty_array(records)
    starts = _start_lines(records)
    assert all(b - a > 3 for a, b in itertools.pairwise(starts))  # records span many lines
    path = tmp_path / "pretty.json"
    path.write_text(text)
    assert list(conversations.read_records(path)) == list(zip(starts, records, strict=True))

    cut = text[: text.rindex('"content": "') + len('"content": "') + 3]  # inside the last record
    path.write_text(cut)
    assert cut.count("\n") + 1 > starts[2]  # the cut is on a later line than the record starts
    with pytest.raises(UserError, match=rf"pretty\.json:{starts[2]}: the file ends inside"):
        list(conversations.read_records(path))
    kept = list(conversations.read_records(path, allow_truncated_json=True))
    assert kept == list(zip(starts[:2], records[:2], strict=True))

    bad_at = text.index('"role": "assistant"', text.index('"id": "c1"'))
    path.write_text(
        text[:bad_at] + '"role": assistant' + text[bad_at + len('"role": "assistant"') :]
    )
    bad_line = text[:bad_at].count("\n") + 1
    assert bad_line > starts[1]
    with pytest.raises(UserError, match=rf"pretty\.json:{bad_line}: invalid JSON"):
        list(conversations.read_records(path))


# Catches: the end-of-file check of the array reader raising even with allow_truncated_json
# (a file cut right after a whole record, with no "]"); the "cut" test dropping its "error at the end of
# the file" clause, so a file cut outside a string (after a value) is an invalid-JSON error
# even with allow_truncated_json.
def test_json_array_cut_between_records_or_outside_a_string_keeps_the_records_before(tmp_path):
    """A JSON array cut off after a whole record (before or after its comma), or inside a
    record but not inside a string, is an error naming the line without allow_truncated_json
    (the last line with text, not the empty one after its newline) and, with it, keeps every
    complete record before the cut."""
    r0, r1 = tiny.conversations(2, fmt="openai")
    path = tmp_path / "cut.json"
    path.write_text(f"[\n{json.dumps(r0)},\n{json.dumps(r1)}\n")  # no "]"
    with pytest.raises(UserError, match=r"cut\.json:3: JSON array is not closed .*"
                       r"data\.train\.allow_truncated_json: true"):  # fmt: skip
        list(conversations.read_records(path))
    assert [r for _, r in conversations.read_records(path, allow_truncated_json=True)] == [r0, r1]
    path.write_text(f"[\n{json.dumps(r0)},\n{json.dumps(r1)},\n")  # cut after a comma
    with pytest.raises(UserError, match=r"cut\.json:3: JSON array is not closed"):
        list(conversations.read_records(path))
    assert [r for _, r in conversations.read_records(path, allow_truncated_json=True)] == [r0, r1]

    path.write_text(f'[\n{json.dumps(r0)},\n{{"messages": [{{"role": "user", "content": "a"}}')
    with pytest.raises(UserError, match=r"cut\.json:3: the file ends inside this record"):
        list(conversations.read_records(path))
    assert [r for _, r in conversations.read_records(path, allow_truncated_json=True)] == [r0]


# Catches: JSONL split with str.splitlines(), which also breaks lines at U+2028, U+2029, NEL
# and other separators that JSON strings may hold unescaped.
def test_jsonl_strings_may_hold_unicode_line_separators(tmp_path):
    """A JSONL line is ended by "\\n" only: a string holding U+2028, U+2029 or NEL (written
    unescaped, as ensure_ascii=False does) reads back whole, with the right line numbers."""
    records = [
        {"messages": [{"role": "user", "content": "a\u2028b\u2029c\x85d"}]},
        {"prompt": "plain"},
    ]
    path = tmp_path / "seps.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    assert "\u2028" in path.read_text()  # really unescaped
    assert list(conversations.read_records(path)) == [(1, records[0]), (2, records[1])]


# Catches: write_gzipped_jsonl stamping the current time into the gzip header (mtime=0
# dropped), so that the same records give other bytes (and another sha256 stamp) each run.
def test_gzipped_jsonl_round_trips_and_gives_the_same_bytes_at_any_time(tmp_path, monkeypatch):
    """write_gzipped_jsonl: read_records reads the records back (non-ASCII text, U+2028
    included), and the same records written at another time give the same bytes."""
    records = [{"messages": [{"role": "user", "content": "café\u2028naïve"}]}, {"prompt": "x"}]
    a, b = tmp_path / "a.jsonl.gz", tmp_path / "b.jsonl.gz"
    monkeypatch.setattr(time, "time", lambda: 1_000_000_000.0)
    conversations.write_gzipped_jsonl(a, records)
    monkeypatch.setattr(time, "time", lambda: 2_000_000_000.0)
    conversations.write_gzipped_jsonl(b, records)
    assert a.read_bytes() == b.read_bytes()
    assert gzip.decompress(a.read_bytes()).decode().count("\n") == 2
    assert [r for _, r in conversations.read_records(a)] == records


# Catches: train_sources dropping an entry's allow_truncated_json (always False).
def test_train_sources_carry_each_entrys_own_options(tmp_path):
    """Each training file gets its own config entry's allow_truncated_json and max_samples,
    id prefix and config key; a truncated extra file that allows it keeps the records
    before the cut while data.train's file stays strict."""
    section = {
        "train": {"max_samples": 5},
        "extra_train": [{"allow_truncated_json": True}, {"max_samples": 2}],
    }
    paths = [tmp_path / "a.jsonl", tmp_path / "b.json", tmp_path / "c.jsonl"]
    sources = conversations.train_sources(paths, section)
    assert [
        (s.path, s.allow_truncated_json, s.max_samples, s.id_prefix, s.key) for s in sources
    ] == [
        (paths[0], False, 5, "", "data.train"),
        (paths[1], True, None, "extra_train[0]:", "data.extra_train[0]"),
        (paths[2], False, 2, "extra_train[1]:", "data.extra_train[1]"),
    ]
    r0 = tiny.conversations(1, fmt="openai")[0]
    paths[1].write_text(f'[{json.dumps(r0)}, {{"messages": [{{"role": "us')
    s = sources[1]
    assert [r for _, r in conversations.read_records(s.path, s.allow_truncated_json, s.key)] == [r0]


# ============================================================================================
# tests/test_data.py -- normalising conversations (conversations.normalize_conversation)
# ============================================================================================


# Catches: content parts joined with a space instead of nothing; a part of another type
# (an image) accepted instead of refused.
def test_openai_content_parts_join_their_text_and_refuse_other_parts():
    """OpenAI content given as parts is the parts' text concatenated as is; a part that is
    not text (e.g. an image) makes the record invalid."""
    parts = [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]
    record = {"messages": [{"role": "user", "content": parts}]}
    assert conversations.normalize_conversation(record) == [
        {"role": "user", "content": "Hello, world"}
    ]
    image = {"type": "image_url", "image_url": {"url": "x.png"}}
    with pytest.raises(conversations.InvalidRecord, match="non-text content part") as err:
        conversations.normalize_conversation(
            {"messages": [{"role": "user", "content": [parts[0], image]}]}
        )
    assert err.value.reason == "non-text content part"
    assert str(err.value) == "non-text content part (turn 0: only text is supported)"


# Catches: roles matched case-sensitively (ShareGPT's "Human"/"GPT" refused); the "model"
# alias (Gemini-style data) dropped.
@pytest.mark.parametrize(
    ("role", "mapped"),
    [("Human", "user"), ("GPT", "assistant"), ("model", "assistant"), ("ChatGPT", "assistant"),
     ("bard", "assistant"), ("bing", "assistant"), ("SYSTEM", "system"), ("tool", "tool")],
)  # fmt: skip
def test_role_aliases_map_in_any_case(role, mapped):
    """Every role alias is recognised whatever its case and maps to user/assistant/system/tool."""
    record = {"conversations": [{"from": role, "value": "text"}]}
    assert conversations.normalize_conversation(record) == [{"role": mapped, "content": "text"}]


# Catches: the "turn is not an object" check dropped (an AttributeError escapes instead of
# an InvalidRecord, so data.on_invalid_record: skip no longer skips the record).
@pytest.mark.parametrize(
    ("record", "reason"),
    [
        ({"messages": ["hi"]}, "turn is not an object"),
        ({"messages": [{"role": "user", "content": 5}]}, "content is not a string"),
        ({"messages": [{"role": "user"}]}, "turn lacks role/content (or from/value)"),
    ],
)
def test_more_invalid_records_are_named_by_their_reason(record, reason):
    """Malformed turns raise InvalidRecord with the stable reason they are counted under."""
    with pytest.raises(conversations.InvalidRecord) as err:
        conversations.normalize_conversation(record)
    assert err.value.reason == reason


def test_a_turns_content_error_names_the_turn():
    """As the other turn errors do: which turn holds content that is not text."""
    record = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": 5}]}
    with pytest.raises(conversations.InvalidRecord) as err:
        conversations.normalize_conversation(record)
    assert str(err.value) == "content is not a string (turn 1: int)"


# ============================================================================================
# tests/test_data.py -- evaluation prompts (conversations.read_eval_prompts)
# ============================================================================================


# Catches: a prompt record without question_id/task_id/id given a constant id instead of its
# line number; a conversation's prompt taken from its last user turn instead of its first.
def test_eval_prompt_ids_default_to_the_line_and_conversations_give_their_first_user_turn(
    tmp_path,
):
    """A prompt record with no id is named by its line (blank lines counted); a
    conversation record's prompt is its first user turn, not a later one."""
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "an answer"},
        {"role": "user", "content": "follow-up"},
    ]
    path = tmp_path / "p.jsonl"
    path.write_text(
        json.dumps({"turns": ["a"]})
        + "\n\n"
        + json.dumps({"messages": chat})
        + "\n"
        + json.dumps({"prompt": "b"})
        + "\n"
    )
    prompts = conversations.read_eval_prompts(path, None)
    assert [(p["id"], p["text"]) for p in prompts] == [
        ("1", "a"), ("3", "first question"), ("4", "b")
    ]  # fmt: skip


# ============================================================================================
# tests/test_data.py -- tokenizing and preparing samples (data.py)
# ============================================================================================


# Catches: the prefix-stability check of supervised_spans dropped (the mask then silently
# covers the wrong tokens); an InvalidRecord from tokenizing re-wrapped as "chat template
# failed" instead of keeping its own reason.
def test_a_template_that_is_not_prefix_stable_makes_records_invalid(tmp_path):
    """With a template whose generation prompt is not the start of the rendered reply, no
    loss mask can be derived: the record is invalid, counted under "chat template is not
    prefix-stable", and fatal by default naming the file and line."""
    tok = tiny.build_tokenizer(tmp_path / "tok", THINKING_PROMPT_TEMPLATE)
    chat = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "yes"}]
    with pytest.raises(conversations.InvalidRecord) as err:
        data.tokenize_conversation(tok, chat)
    assert err.value.reason == "chat template is not prefix-stable"
    records = tiny.conversations(2, fmt="openai")
    with pytest.raises(UserError, match=r"train\.jsonl:1: chat template is not prefix-stable"):
        prepare(tok, tmp_path, records)
    with pytest.raises(UserError, match=r"invalid: chat template is not prefix-stable: 2"):
        prepare(tok, tmp_path, records, on_invalid_record="skip")


ONE_TURN_CHAT = [
    {"role": "user", "content": "hello there"},
    {"role": "assistant", "content": "one two"},
]


# Catches: supervised_spans' stop_at compared with ">" instead of ">=" (a prompt of exactly
# max_length tokens is rendered and reported as "no_supervised_tokens", whose remedy is
# wrong, instead of "prompt_exceeds_max_length").
def test_a_prompt_of_exactly_max_length_is_reported_as_filling_it(tokenizer, tmp_path):
    """A prompt that alone fills max_length leaves no room for a supervised token: the
    record is dropped as prompt_exceeds_max_length (with its remedy); one token more of
    max_length gives a truncated sample with one supervised token."""
    prompt = len(data.render_ids(tokenizer, ONE_TURN_CHAT[:1], add_generation_prompt=True))
    with pytest.raises(UserError) as err:
        prepare(tokenizer, tmp_path, [{"messages": ONE_TURN_CHAT}], max_length=prompt)
    assert "dropped prompt_exceeds_max_length: 1" in str(err.value)
    assert str(err.value).endswith("raise data.max_length (the prompts alone fill it)")
    one_more = prepare(tokenizer, tmp_path, [{"messages": ONE_TURN_CHAT}], max_length=prompt + 1)
    assert [len(t) for t in one_more.input_ids] == [prompt + 1]
    assert one_more.loss_masks[0].tolist() == [0] * prompt + [1]
    assert one_more.summary["truncated"] == 1


# Catches: _fit_samples comparing the length with ">=" instead of ">" (a sample of exactly
# max_length tokens truncated/dropped); the summary's "tokens" counting supervised tokens only.
@pytest.mark.parametrize("truncation", ["truncate", "drop"])
def test_a_sample_of_exactly_max_length_is_kept_whole(tokenizer, tmp_path, truncation):
    """max_length is the longest sample kept whole: one that long is neither truncated nor
    dropped; the summary counts all its tokens and, apart, the supervised ones."""
    [(ids, mask)] = data.tokenize_conversation(tokenizer, ONE_TURN_CHAT)
    prepared = prepare(
        tokenizer,
        tmp_path,
        [{"messages": ONE_TURN_CHAT}],
        max_length=len(ids),
        truncation=truncation,
    )
    assert np.array_equal(prepared.input_ids[0], ids)
    assert np.array_equal(prepared.loss_masks[0], mask)
    assert prepared.summary["truncated"] == 0 and prepared.summary["dropped"] == {}
    assert prepared.summary["tokens"] == len(ids)
    assert prepared.summary["supervised_tokens"] == int(mask.sum()) < len(ids)


# Catches: _fit_samples dropping samples with "<=" min_supervised_tokens instead of "<"
# (the minimum not inclusive).
def test_min_supervised_tokens_is_an_inclusive_minimum(tokenizer, tmp_path):
    """A sample with exactly min_supervised_tokens supervised tokens is kept; one fewer than
    asked for is dropped as no_supervised_tokens."""
    [(_, mask)] = data.tokenize_conversation(tokenizer, ONE_TURN_CHAT)
    n = int(mask.sum())
    kept = prepare(tokenizer, tmp_path, [{"messages": ONE_TURN_CHAT}], min_supervised_tokens=n)
    assert kept.summary["samples"] == 1 and kept.summary["supervised_tokens"] == n
    with pytest.raises(UserError, match="dropped no_supervised_tokens: 1"):
        prepare(tokenizer, tmp_path, [{"messages": ONE_TURN_CHAT}], min_supervised_tokens=n + 1)


# Catches: _fit_samples' room check using ">" instead of ">=" (a record fanned out into one
# sample per turn adds one sample more than max_samples allows).
def test_max_samples_caps_the_samples_of_a_record_fanned_out_per_turn(tmp_path):
    """With a template that rewrites history, a record gives one sample per assistant turn
    (ids <id>#<turn>); max_samples counts those samples, even within one record."""
    tok = tiny.build_tokenizer(tmp_path / "tok", tiny.THINK_TEMPLATE)
    chat = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "<think>x</think> first"},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "<think>y</think> second"},
    ]
    records = [{"id": "t", "messages": chat}, *tiny.conversations(2, fmt="openai")]
    assert prepare(tok, tmp_path, records).ids == ["t#0", "t#1", "c0", "c1"]
    assert prepare(tok, tmp_path, records, max_samples=1).ids == ["t#0"]
    assert prepare(tok, tmp_path, records, max_samples=3).ids == ["t#0", "t#1", "c0"]


# Catches: dedupe's "repeated_prompt" overriding a reason the record already had (a
# conversation without a reply counted as a repeat instead of as no_assistant_turn).
def test_dedupe_leaves_a_record_dropped_for_another_reason_under_that_reason(tokenizer, tmp_path):
    """A record that repeats a kept conversation's first prompt but is dropped anyway (here:
    no assistant reply) is counted under its own reason, not as repeated_prompt."""
    records = tiny.conversations(2, fmt="openai")
    records.append({"messages": records[0]["messages"][:1]})  # c0's prompt, no reply
    prepared = prepare(tokenizer, tmp_path, records, dedupe=True)
    assert prepared.ids == ["c0", "c1"]
    assert prepared.summary["dropped"] == {"no_assistant_turn": 1}


# Catches: dedupe remembering the first prompt of a record none of whose samples was kept
# (all dropped as too_long), so that a later, usable conversation with that prompt is
# dropped as a repeat of nothing.
def test_dedupe_keeps_a_prompt_whose_earlier_conversation_gave_no_sample(tokenizer, tmp_path):
    """With dedupe and truncation: drop, a conversation dropped as too_long keeps nothing,
    so a later conversation with the same first prompt is kept."""
    long_reply = " ".join(["the model writes a long answer"] * 20)
    records = [
        {"id": "long", "messages": [{"role": "user", "content": "Tell me a story"},
                                    {"role": "assistant", "content": long_reply}]},
        {"id": "short", "messages": [{"role": "user", "content": "tell me a  story"},
                                     {"role": "assistant", "content": "Once."}]},
    ]  # fmt: skip
    prepared = prepare(tokenizer, tmp_path, records, dedupe=True, truncation="drop", max_length=48)
    assert prepared.ids == ["short"]
    assert prepared.summary["dropped"] == {"too_long": 1}


# Catches: _no_samples_reason counting an assistant turn before the first user turn as a
# reply (the record reported as prompt_exceeds_max_length, with the remedy "raise
# data.max_length", instead of no_assistant_turn).
def test_a_reply_before_the_first_user_turn_is_no_assistant_turn(tokenizer, tmp_path):
    """Conversations whose only assistant turn precedes the first user turn give no sample
    and are dropped as no_assistant_turn, with that reason's remedy."""
    record = {"messages": [{"role": "assistant", "content": "Welcome!"},
                           {"role": "user", "content": "hi"}]}  # fmt: skip
    with pytest.raises(UserError) as err:
        prepare(tokenizer, tmp_path, [record, record])
    assert "dropped no_assistant_turn: 2)" in str(err.value)
    assert str(err.value).endswith("give every conversation an assistant reply after a user turn")


# Catches: the "no usable samples" error giving the remedy of the least common drop reason
# (min instead of max).
def test_no_samples_error_gives_the_remedy_of_the_commonest_reason(tokenizer, tmp_path):
    """When every record was dropped for several reasons, the error lists them all and gives
    the remedy of the reason most records were dropped for."""
    long = tiny.conversations(1, fmt="openai")[0]
    question = {"messages": [{"role": "user", "content": "only a question"}]}
    with pytest.raises(UserError) as err:
        prepare(tokenizer, tmp_path, [question, long, question], max_length=8,
                      truncation="drop")  # fmt: skip
    message = str(err.value)
    assert "(3 records read; dropped no_assistant_turn: 2, too_long: 1)" in message
    assert message.endswith(data.DROP_REMEDIES["no_assistant_turn"])


# Catches: eos_ids not iterating a tuple (or set) of ids (TypeError from int(tuple));
# until_eos cutting before the end-of-sequence id instead of after it.
def test_eos_ids_and_until_eos():
    """End-of-sequence ids come from ints, lists, tuples and sets (None skipped); a token
    list is cut just after its first one, and to the limit first."""
    assert data.eos_ids(2, [3, 4], (5,), {6}, None) == {2, 3, 4, 5, 6}
    assert data.eos_ids(None) == set()
    assert data.until_eos([7, 8, 3, 9, 3], {3, 4}) == [7, 8, 3]
    assert data.until_eos([7, 8, 9], {3}) == [7, 8, 9]
    assert data.until_eos([7, 8, 3, 9], {3}, limit=2) == [7, 8]


# Catches: save_prepared's vocab check using ">" (a token id equal to vocab_size, one past
# the last, written out of bounds: an IndexError instead of the UserError).
def test_save_prepared_refuses_a_token_id_equal_to_the_vocab_size(tmp_path):
    """Token ids run from 0 to vocab_size - 1: a supervised id equal to vocab_size is a
    clear error naming the id and the vocab size; one below it is saved and counted."""
    prepared = data.PreparedSamples(
        ["a"], [np.array([1, 5], dtype=np.int64)], [np.array([0, 1], dtype=np.uint8)],
        Counter({5: 1}), {},
    )  # fmt: skip
    with pytest.raises(UserError, match=r"token id 5 is outside the verifier vocab \(5\)"):
        data.save_prepared(prepared, tmp_path / "s.safetensors", 5)
    data.save_prepared(prepared, tmp_path / "s.safetensors", 6)
    assert data.load_samples(tmp_path / "s.safetensors").token_freq.tolist() == [0] * 5 + [1]


# Catches: prompt_token_ids rendering the user turn without the generation prompt (the
# evaluation/regeneration prompt would lack the assistant header the verifier answers after).
# Optional: that mutation is also caught, but only by the slow
# tests/test_evaluate.py::test_speculative_output_equals_greedy_decoding; this pins it in ms.
def test_prompt_token_ids_end_with_the_assistant_header(tokenizer):
    """An eval prompt's token ids are its user turn rendered with the chat template and the
    generation prompt, exactly what the verifier sees before its reply."""
    ids = data.prompt_token_ids(tokenizer, "hi")
    assert tokenizer.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
