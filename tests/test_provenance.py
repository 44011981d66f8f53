"""Stamps: what made an artifact, recorded in its provenance and compared when the workflow
plans (eagle3lib/provenance.py; rules/common.smk forget_stale_artifacts)."""

import json
import shutil

from eagle3lib import provenance, verifier
from eagle3lib.fileio import write_json


def test_a_stamp_names_config_and_file_contents_not_paths_or_times(tmp_path):
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "train.jsonl").write_text('{"x": 1}\n')
    a = provenance.stamp({"train": {"epochs": 3}}, {"data.train.path": tmp_path / "a/train.jsonl"})
    b = provenance.stamp({"train": {"epochs": 3}}, {"data.train.path": tmp_path / "b/train.jsonl"})
    assert a == b and "/a/" not in a
    (tmp_path / "b/train.jsonl").write_text('{"x": 2}\n')
    c = provenance.stamp({"train": {"epochs": 3}}, {"data.train.path": tmp_path / "b/train.jsonl"})
    assert c != a


def record(tmp_path, stamp):
    path = tmp_path / "provenance-train.json"
    provenance.write(path, "train", {"epochs": 1}, stamp=stamp)
    return path


def test_stale_reason_names_what_changed(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("one\n")
    made = provenance.stamp({"train": {"epochs": 1, "lr": 0.1}}, {"data.train.path": data})
    path = record(tmp_path, made)
    assert json.loads(path.read_text())["stamp"]["config"] == {"train": {"epochs": 1, "lr": 0.1}}
    assert provenance.stale_reason(path, made) is None
    assert provenance.stale_reason(tmp_path / "missing.json", made) is None  # not built yet
    now = provenance.stamp({"train": {"epochs": 2, "lr": 0.1}}, {"data.train.path": data})
    assert provenance.stale_reason(path, now) == ("made with other settings (train.epochs: 1 -> 2)")
    data.write_text("two\n")
    now = provenance.stamp({"train": {"epochs": 1, "lr": 0.1}}, {"data.train.path": data})
    assert provenance.stale_reason(path, now) == (
        "made with other settings (the file of data.train.path changed)"
    )


def test_records_without_a_stamp_are_kept_and_unreadable_ones_are_not(tmp_path):
    old = tmp_path / "old.json"
    write_json(old, {"job": "train", "config": {}})  # written before stamps existed
    current = provenance.stamp({"train": {}}, {})
    assert provenance.stale_reason(old, current) is None
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    assert provenance.stale_reason(broken, current) == "unreadable provenance record"


def test_a_converted_verifiers_record_follows_its_run_folder(tmp_path, verifier_record):
    """verifier.json of a GGUF verifier names its converted copy relative to itself: a run
    folder copied under another name loads its own copy, not the original run's."""
    run = tmp_path / "results" / "t" / "verifier"
    (run / "hf").mkdir(parents=True)
    made = {**verifier_record, "kind": "gguf", "load_path": str(run / "hf")}
    write_json(run / "verifier.json", verifier.portable(made, run / "verifier.json"))
    stored = json.loads((run / "verifier.json").read_text())
    assert stored["load_path"] == "hf" and str(tmp_path) not in json.dumps(stored["load_path"])
    copy = tmp_path / "results" / "t2"
    shutil.copytree(tmp_path / "results" / "t", copy)
    assert verifier.read_record(copy / "verifier" / "verifier.json")["load_path"] == str(
        copy / "verifier" / "hf"
    )
    local = verifier.portable(verifier_record, run / "verifier.json")  # a user's folder: as is
    assert local["load_path"] == verifier_record["load_path"]


def test_planning_edits_are_undone_to_the_byte_and_the_nanosecond(tmp_path):
    """What planning changed to make Snakemake rerun jobs (a record dated 1970, a file removed,
    the same file twice) is put back exactly (contents and modification times; reading a file
    moves its access time): a dry run leaves the results as it found them."""
    import os

    from eagle3lib.provenance import PlanningEdits

    record, manifest = tmp_path / "provenance-train.json", tmp_path / "shard-1.json"
    shard = tmp_path / "shard-1.safetensors"
    shard.write_bytes(b"states")
    record.write_text("{}")
    manifest.write_bytes(b'{"bytes": 6}')
    for i, p in enumerate((record, manifest)):
        os.utime(p, ns=(1_700_000_000_123_456_789 + i, 1_700_000_001_987_654_321 + i))
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in (record, manifest)}
    edits = PlanningEdits()
    edits.make_old(record)
    edits.make_old(record)
    edits.remove(manifest, of=shard)
    assert record.stat().st_mtime == 1 and not manifest.exists()
    edits.undo()
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in (record, manifest)} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "provenance-train.json", "shard-1.json", "shard-1.safetensors"
    ]  # fmt: skip
    edits.undo()  # nothing left to undo
    assert record.stat().st_mtime_ns == before[record][1]


def test_planning_edits_leave_what_changed_since_alone(tmp_path):
    """A record rewritten after planning dated it (a real run beside a dry run) keeps its new
    time; a removed manifest is not brought back once it exists again, nor when its shard is
    gone (snakemake --delete-all-output removes both)."""
    import os

    from eagle3lib.provenance import PlanningEdits

    record, manifest, shard = (tmp_path / n for n in ("p.json", "m.json", "s.safetensors"))
    for p in (record, manifest, shard):
        p.write_text("old")
    edits = PlanningEdits()
    edits.make_old(record)
    edits.remove(manifest, of=shard)
    record.write_text("rewritten")
    os.utime(record, ns=(1_800_000_000_000_000_000,) * 2)
    manifest.write_text("rebuilt")
    edits.undo()
    assert record.stat().st_mtime_ns == 1_800_000_000_000_000_000
    assert manifest.read_text() == "rebuilt"
    edits.remove(manifest, of=shard)
    shard.unlink()
    edits.undo()
    assert not manifest.exists()
