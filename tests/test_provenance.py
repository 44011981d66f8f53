"""Stamps: what made an artifact, recorded in its provenance and compared when the workflow
plans (eagle3lib/provenance.py; rules/common.smk forget_stale_artifacts)."""

import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys

from eagle3lib import provenance, verifier
from eagle3lib.fileio import canonical_json, read_json, sha256_json, write_json


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


# Catches: a key dropped from the record (config_sha256, seed, gpus: the report job's
# provenance_table then fails with a KeyError, only in slow workflow runs); torch dropped from
# PACKAGES; the verifier's identity recorded without its path, or not at all; another format
# of "finished"; provenance.write no longer removing its record's stale temporaries.
def test_a_record_holds_what_made_the_artifact_and_what_the_report_reads(
    tmp_path, verifier_record, monkeypatch
):
    from eagle3lib import report

    monkeypatch.setattr(provenance, "gpus", lambda: ["0: NVIDIA H100 80GB HBM3"])
    verifier_json = tmp_path / "verifier.json"
    write_json(verifier_json, verifier_record)
    path = tmp_path / "provenance-extract-1.json"
    (tmp_path / ".provenance-extract-1.json.tmp-k1ll3d").write_bytes(b"\0" * 64)
    provenance.write(path, "extract", {"shards": 2}, verifier_json, seed=7)
    got = read_json(path)
    assert sorted(got) == [
        "config", "config_sha256", "finished", "git", "gpus", "host", "job", "packages",
        "platform", "python", "seed", "verifier",
    ]  # fmt: skip
    assert (got["job"], got["config"], got["seed"]) == ("extract", {"shards": 2}, 7)
    assert got["config_sha256"] == sha256_json({"shards": 2})
    assert got["verifier"] == {
        **verifier.identity(verifier_record),
        "path": verifier_record["path"],
    }
    assert set(got["packages"]) <= set(provenance.PACKAGES)
    for name in ("torch", "transformers", "safetensors", "numpy"):
        assert got["packages"][name] == importlib.metadata.version(name)
    assert got["python"] == sys.version.split()[0]
    assert got["gpus"] == ["0: NVIDIA H100 80GB HBM3"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d{4}", got["finished"])
    assert report.provenance_table([got])["extract"]["gpus"] == ["0: NVIDIA H100 80GB HBM3"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name, "verifier.json"]


# Catches: git_commit ignoring a failed `git rev-parse` (no repository); untracked files (the
# results folder) counting as local changes (--untracked-files=no dropped); "dirty" inverted;
# the commit keeping rev-parse's newline.
def test_the_record_names_the_workflows_commit_and_whether_it_was_edited(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert provenance.git_commit(tmp_path) is None  # not a repository

    def git(*args):
        return subprocess.run(
            ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@example.com",
             "-c", "commit.gpgsign=false", *args],
            capture_output=True, text=True, check=True, timeout=30,
        ).stdout  # fmt: skip

    git("init", "-q")
    (tmp_path / "Snakefile").write_text("rule all:\n")
    git("add", "Snakefile")
    git("commit", "-qm", "one")
    head = git("rev-parse", "HEAD").strip()
    assert re.fullmatch(r"[0-9a-f]{40}", head)
    assert provenance.git_commit(tmp_path) == {"commit": head, "dirty": False}
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "out.json").write_text("{}")  # outputs are not local changes
    assert provenance.git_commit(tmp_path) == {"commit": head, "dirty": False}
    (tmp_path / "Snakefile").write_text("rule all:\n    input: []\n")
    assert provenance.git_commit(tmp_path) == {"commit": head, "dirty": True}


# Catches: gpus() querying NVML when CUDA_VISIBLE_DEVICES is empty (a CPU job); asking for no
# device (instead of all) when it is unset; a GPU named without its index.
def test_the_record_names_the_gpus_the_job_could_see(monkeypatch):
    from eagle3lib import gpu

    asked = []

    def snapshot(indices=None):
        asked.append(indices)
        shown = indices if indices is not None else [0, 1]
        return {"available": True, "devices": [{"index": i, "name": "NVIDIA H100"} for i in shown]}

    monkeypatch.setattr(gpu, "nvml_snapshot", snapshot)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert provenance.gpus() == [] and asked == []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3")
    assert provenance.gpus() == ["1: NVIDIA H100", "3: NVIDIA H100"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert provenance.gpus() == ["0: NVIDIA H100", "1: NVIDIA H100"]
    assert asked == [[1, 3], None]
    monkeypatch.setattr(gpu, "nvml_snapshot", lambda indices=None: {"available": False})
    assert provenance.gpus() == []


def test_the_record_names_gpus_the_job_saw_by_uuid(monkeypatch):
    """A job run outside the GPU wrapper with CUDA_VISIBLE_DEVICES naming GPUs by UUID: NVML
    is a stand-in here (no NVIDIA driver on this machine) that knows two GPUs' UUIDs."""
    from eagle3lib import gpu

    uuids = ["GPU-aaaa0000", "GPU-bbbb1111"]
    monkeypatch.setattr(gpu, "_nvml_uuids", lambda: uuids)
    monkeypatch.setattr(gpu, "nvml_snapshot", lambda indices=None: {
        "available": True, "devices": [{"index": i, "name": "NVIDIA H200"} for i in indices]
    })  # fmt: skip
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-bbbb")
    assert provenance.gpus() == ["1: NVIDIA H200"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-aaaa0000")  # not a GPU's UUID: none named
    assert provenance.gpus() == []


# Catches: a file of exactly FINGERPRINT_LIMIT bytes fingerprinted by its size (<= -> <).
def test_files_up_to_the_limit_are_identified_by_content_larger_ones_by_size(tmp_path, monkeypatch):
    monkeypatch.setattr(provenance, "FINGERPRINT_LIMIT", 8)
    small, large = tmp_path / "small.jsonl", tmp_path / "large.jsonl"
    small.write_bytes(b"12345678")
    large.write_bytes(b"123456789")
    assert provenance.fingerprint(small) == "sha256:" + hashlib.sha256(b"12345678").hexdigest()
    assert provenance.fingerprint(large) == "bytes:9"


# Catches: changes() missing keys added in the new config, or missing added and removed keys;
# values printed with str() (a string not quoted, None not "null"); a change of a config that
# is not a mapping at all printed without the name "config".
def test_changes_name_added_removed_and_retyped_settings():
    changes = provenance.changes
    assert changes({"train": {"lr": 0.1}}, {"train": {"lr": 0.1, "warmup": 5}}) == [
        "train.warmup: null -> 5"
    ]
    assert changes({"data": {"path": "a.jsonl", "max": 3}}, {"data": {"path": "b.jsonl"}}) == [
        "data.max: 3 -> null",
        'data.path: "a.jsonl" -> "b.jsonl"',
    ]
    assert changes({"aux": [1, 2]}, {"aux": None}) == ["aux: [1, 2] -> null"]
    assert changes(None, {"k": 1}) == ['config: null -> {"k": 1}']
    assert changes({"a": {"b": 1}}, {"a": {"b": 1}}) == []


# Catches: stale_reason looking only at the current stamp's files (a file key dropped since is
# not named); its parts joined with another separator; no "another stamp" when only the
# digest differs; a record that is JSON but not an object, or a stamp without "files",
# crashing planning instead of being named.
def test_stale_reason_lists_every_change(tmp_path):
    data, evals = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    data.write_text("one\n")
    evals.write_text("q\n")
    made = provenance.stamp(
        {"train": {"epochs": 1}}, {"data.train.path": data, "data.eval.path": evals}
    )
    path = record(tmp_path, made)
    now = provenance.stamp({"train": {"epochs": 2}}, {"data.train.path": data})
    assert provenance.stale_reason(path, now) == (
        "made with other settings (train.epochs: 1 -> 2; the file of data.eval.path changed)"
    )
    other = {"config": {"train": {"epochs": 1}}, "files": {}, "version": 2}
    path = record(tmp_path, canonical_json(other))  # same config and files, other digest
    now = provenance.stamp({"train": {"epochs": 1}}, {})
    assert provenance.stale_reason(path, now) == "made with other settings (another stamp)"
    write_json(path, {"stamp": {"sha256": "0" * 64, "config": {"train": {"epochs": 1}}}})
    now = provenance.stamp({"train": {"epochs": 1}}, {"data.train.path": data})
    assert provenance.stale_reason(path, now) == (
        "made with other settings (the file of data.train.path changed)"
    )
    write_json(path, [{"stamp": {}}])
    assert provenance.stale_reason(path, now) == "unreadable provenance record"


# Catches: make_old or remove keeping a relative path, or the file `of` kept relative (undo
# runs at exit, where the working directory may differ: nothing would be put back); undo not
# taking the latest edit first (a record dated, then removed, comes back dated 1970).
def test_planning_edits_are_undone_from_another_folder_latest_first(tmp_path, monkeypatch):
    from eagle3lib.provenance import PlanningEdits

    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    run.mkdir()
    elsewhere.mkdir()
    files = [run / n for n in ("p.json", "m.json", "v.json", "s.safetensors")]
    for i, p in enumerate(files):
        p.write_text(p.name)
        os.utime(p, ns=(1_700_000_000_000_000_000 + i, 1_700_000_001_000_000_000 + i))
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in files}
    monkeypatch.chdir(run)
    edits = PlanningEdits()
    edits.make_old("p.json")
    edits.remove("m.json", of="s.safetensors")
    edits.make_old("v.json")  # the same file dated, then removed
    edits.remove("v.json", of="s.safetensors")
    monkeypatch.chdir(elsewhere)
    edits.undo()
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in files} == before
    assert sorted(p.name for p in run.iterdir()) == ["m.json", "p.json", "s.safetensors", "v.json"]
    assert list(elsewhere.iterdir()) == []
