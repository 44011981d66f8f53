"""eagle3lib/conversations.py: what a user sees of reading record files and conversations
(from a mutation audit; each test names what it catches)."""

import json

import pytest
import tiny

from eagle3lib import conversations
from eagle3lib.errors import UserError


def _records(path):
    return list(conversations.read_records(path))


# Catches: the file's text not stripped of leading whitespace before looking for "[" (a
# JSON array after a blank line read as JSONL and refused), and a whitespace-only file
# no longer yielding nothing.
def test_a_json_array_may_start_after_blank_lines_and_a_blank_file_holds_no_records(tmp_path):
    """A JSON array file may start with blank lines or spaces: its records are read, named
    by the lines they start on; a file of blank lines holds no records (no error)."""
    r0, r1 = tiny.conversations(2, fmt="openai")
    path = tmp_path / "a.json"
    path.write_text(f"\n  \n [\n{json.dumps(r0)},\n{json.dumps(r1)}\n]\n")
    assert _records(path) == [(4, r0), (5, r1)]
    path.write_text("\n \n\t\n")
    assert _records(path) == []


# Catches: the format chosen by ".jsonl in the suffixes AND not an array" instead of OR (a
# .json file of one record a line read as an array).
def test_a_json_file_of_one_record_a_line_reads_as_jsonl(tmp_path):
    """A .json file whose text does not start with "[" is JSONL: one record a line, each
    named by its line (blank lines counted)."""
    r0, r1 = tiny.conversations(2, fmt="openai")
    path = tmp_path / "lines.json"
    path.write_text(f"{json.dumps(r0)}\n\n{json.dumps(r1)}\n")
    assert _records(path) == [(1, r0), (3, r1)]


# Catches: the check for a one-line JSON array in a .jsonl file dropped (the array read as
# a single record, then refused record by record as "not a JSON object").
def test_a_one_line_json_array_in_a_jsonl_training_file_is_named_with_its_remedy(tmp_path):
    """A .jsonl file whose first line is a whole JSON array: an error naming the file and
    line 1, telling to rename it to .json (where the same text reads as an array)."""
    records = tiny.conversations(2, fmt="openai")
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(records) + "\n")
    with pytest.raises(UserError, match=r"train\.jsonl:1: a JSON array in a \.jsonl file") as err:
        _records(path)
    assert "goes in a .json file: rename it" in str(err.value)
    renamed = path.rename(tmp_path / "train.json")
    assert [r for _, r in _records(renamed)] == records


# Catches: the comma check between JSON array items dropped (two records with no comma
# between them read as if there were one).
def test_a_missing_comma_between_array_records_names_the_line_of_the_next_record(tmp_path):
    """In a JSON array, a record not followed by "," or "]" is an error naming the line
    where the comma is missing, even with allow_truncated_json (the file is not cut)."""
    r0, r1 = tiny.conversations(2, fmt="openai")
    path = tmp_path / "a.json"
    path.write_text(f"[\n{json.dumps(r0)}\n{json.dumps(r1)}\n]\n")
    for allow in (False, True):
        with pytest.raises(UserError, match=r"a\.json:3: invalid JSON \(expected ','"):
            list(conversations.read_records(path, allow_truncated_json=allow))


# Catches: the unreadable-file error dropped (a NameError escapes instead of a UserError
# naming the path).
def test_a_missing_file_is_named_with_its_remedy(tmp_path):
    path = tmp_path / "nowhere.jsonl"
    with pytest.raises(UserError) as err:
        _records(path)
    assert str(err.value) == (
        f"{path}: cannot read the file (No such file or directory); check the path in the config"
    )


# Catches: the line of a byte that is not UTF-8 counted from the bytes after it instead of
# before it (the existing test's bad byte is on the last line, where both counts agree).
def test_a_byte_that_is_not_utf8_is_named_by_its_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"a": 1}\n{"a": "caf\xe9"}\n{"a": 3}\n{"a": 4}\n{"a": 5}\n')
    with pytest.raises(UserError, match=r"latin1\.jsonl:2: not valid UTF-8 \(byte 19\)"):
        _records(path)


# Catches: InvalidRecord's detail defaulting to something other than "" (a reason without
# details then printed with an empty or stray parenthesis).
def test_an_invalid_record_without_details_reads_as_its_reason_alone():
    with pytest.raises(conversations.InvalidRecord) as err:
        conversations.normalize_conversation({"text": "hi"})
    reason = "record has neither 'conversations' (ShareGPT) nor 'messages' (OpenAI)"
    assert err.value.reason == reason and str(err.value) == reason


# Catches: a conversation with no user turn given as an eval prompt raising IndexError
# (no file or line) instead of naming its line.
def test_an_eval_conversation_without_a_user_turn_names_its_line(tmp_path):
    path = tmp_path / "eval.jsonl"
    chat = [{"role": "system", "content": "Be brief."}, {"role": "assistant", "content": "Hi"}]
    path.write_text(json.dumps({"turns": ["a"]}) + "\n" + json.dumps({"messages": chat}) + "\n")
    with pytest.raises(UserError, match=r"eval\.jsonl:2: conversation has no user turn"):
        conversations.read_eval_prompts(path, None)
    assert [p["text"] for p in conversations.read_eval_prompts(path, 1)] == ["a"]


# Catches: an MT-bench record's prompt taken from a later turn than its first.
def test_an_mt_bench_records_prompt_is_its_first_turn(tmp_path):
    path = tmp_path / "mt.jsonl"
    record = {"question_id": 81, "category": "writing", "turns": ["first", "second"]}
    path.write_text(json.dumps(record) + "\n")
    assert conversations.read_eval_prompts(path, None) == [
        {"id": "81", "text": "first", "category": "writing"}
    ]


# Catches: a record that is no prompt record (neither turns, prompt, conversations nor
# messages) raising NameError instead of naming its line and the keys expected.
def test_an_eval_record_of_no_known_format_names_its_line_and_the_keys(tmp_path):
    path = tmp_path / "eval.jsonl"
    path.write_text(json.dumps({"question": "hi"}) + "\n")
    with pytest.raises(UserError, match=r"eval\.jsonl:1: not a prompt record \(record has ne"):
        conversations.read_eval_prompts(path, None)


# Catches: blank JSONL lines skipped only when empty (a line of spaces, or the "\r" of a
# blank line in a CRLF file, then refused as invalid JSON).
def test_jsonl_lines_of_only_whitespace_are_skipped(tmp_path):
    r0, r1 = tiny.conversations(2, fmt="openai")
    path = tmp_path / "crlf.jsonl"
    path.write_bytes(f"{json.dumps(r0)}\r\n\r\n   \r\n{json.dumps(r1)}\r\n".encode())
    assert _records(path) == [(1, r0), (4, r1)]


# Catches: an invalid first JSONL line that is no array given the "rename it to .json" hint
# (the array test joined with "or" instead of "and").
def test_an_invalid_first_jsonl_line_that_is_not_an_array_is_told_to_be_fixed(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"messages": [}\n')
    with pytest.raises(UserError, match=r"bad\.jsonl:1: invalid JSON") as err:
        _records(path)
    assert str(err.value).endswith("; fix or remove the line")


# Catches: a record of a JSON array nested too deeply escaping as a RecursionError instead
# of an error naming the file and the line the record starts on.
def test_a_json_array_record_nested_too_deeply_names_its_line(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text('[\n{"prompt": "a"},\n' + "[" * 100_000 + "]" * 100_000 + "\n]\n")
    with pytest.raises(UserError, match=r"deep\.json:3: JSON nested too deeply to read"):
        _records(path)


# Catches: the stable reasons invalid records are counted under (in prepare's summary and
# its "invalid: <reason>: <count>" errors) changed.
@pytest.mark.parametrize(
    ("record", "reason"),
    [
        ([1, 2], "record is not a JSON object"),
        ({"messages": "hello"}, "turns are not a list"),
        ({"messages": []}, "no turns"),
        ({"messages": [{"role": "user", "content": " "}]}, "empty content"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "unknown role"),
    ],
)
def test_invalid_records_carry_their_exact_reason(record, reason):
    with pytest.raises(conversations.InvalidRecord) as err:
        conversations.normalize_conversation(record)
    assert err.value.reason == reason
    assert str(err.value).startswith(reason)


# Catches: spread placing item i of a list of n elsewhere than at (2i + 1) / 2n (the
# existing tests spread lists of equal length, which any such key keeps interleaved).
def test_spread_places_lists_of_unequal_length_in_proportion():
    """Item i of a list of n goes at (2i + 1) / 2n, ties in list order: a list of one
    item lands in the middle of a list of three, and the last items hold both lists."""
    assert conversations.spread([["a0", "a1", "a2"], ["b0"]]) == ["a0", "a1", "b0", "a2"]
    assert conversations.spread([["a0", "a1"], ["b0", "b1", "b2", "b3"]]) == [
        "b0", "a0", "b1", "b2", "a1", "b3"
    ]  # fmt: skip
    assert conversations.spread([[], ["b0"]]) == ["b0"]
