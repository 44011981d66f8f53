"""Atomic writes, stale temporaries, size checks, canonical JSON and background hashing
(eagle3lib/fileio.py)."""

import errno
import hashlib
import os
import stat
import subprocess
import sys
import threading

import pytest
from conftest import wait_until

from eagle3lib import fileio, provenance
from eagle3lib.fileio import (
    atomic_path,
    canonical_json,
    fingerprinted_dir,
    read_json,
    remove_stale_temps,
    sha256_json,
    size_mismatch,
    write_json,
)


def names(folder):
    """The names in ``folder``, sorted (new helper of tests/test_fileio.py)."""
    return sorted(p.name for p in folder.iterdir())


def join_hashing_threads():
    """Wait until every hash_ahead thread has ended (new helper of tests/test_fileio.py)."""
    for thread in threading.enumerate():
        if thread.name == "hash_ahead":
            thread.join(10)


# Catches: atomic_path no longer creating the parent folder; the chmod dropped (files stay
# 0600 as mkstemp made them) or given another mode (0o644: no group write); the process umask left at 0 after
# atomic_path read it (os.umask(umask) dropped).
def test_an_atomic_write_makes_its_folder_and_gets_a_plain_files_mode(tmp_path):
    """A file or folder written atomically lands in folders made for it, with the mode a plain
    open()/mkdir would give under the umask (not mkstemp's private 0600), and the process's
    umask is left as it was."""
    before = os.umask(0o002)  # a group sharing results
    try:
        write_json(tmp_path / "new" / "deeper" / "a.json", {"x": 1})
        with atomic_path(tmp_path / "new" / "hf", directory=True) as tmp:
            (tmp / "w").write_text("w")
        (tmp_path / "plain").write_text("plain")
        umask_after = os.umask(0o002)
    finally:
        os.umask(before)
    path = tmp_path / "new" / "deeper" / "a.json"
    assert read_json(path) == {"x": 1}
    assert stat.S_IMODE(path.stat().st_mode) == 0o664
    assert stat.S_IMODE(path.stat().st_mode) == stat.S_IMODE((tmp_path / "plain").stat().st_mode)
    assert stat.S_IMODE((tmp_path / "new" / "hf").stat().st_mode) == 0o775
    assert umask_after == 0o002
    assert names(path.parent) == ["a.json"] and names(tmp_path / "new") == ["deeper", "hf"]


# Catches: an existing target folder no longer removed before the rename (os.replace fails on
# a non-empty folder); rmtree applied to an existing target FILE too (write_json over a file
# fails); the temporary folder's name not hidden (".<name>.tmp-" prefix lost).
def test_an_atomic_write_replaces_what_was_there(tmp_path):
    """Writing a file or a folder again replaces it whole (no file of the old folder is left);
    the temporary is a hidden sibling of the target."""
    path = tmp_path / "a.json"
    write_json(path, {"v": 1})
    write_json(path, {"v": 2})
    assert read_json(path) == {"v": 2}
    out = tmp_path / "hf"
    for version in ("old", "new"):
        with atomic_path(out, directory=True) as tmp:
            assert tmp.parent == tmp_path and tmp.name.startswith(".hf.tmp-"), tmp
            (tmp / version).mkdir()
            (tmp / version / "w").write_text(version)
    assert names(out) == ["new"] and (out / "new" / "w").read_text() == "new"
    assert names(tmp_path) == ["a.json", "hf"]


# Catches: a failed write leaving its temporary file or temporary folder behind (the cleanup
# of either branch dropped); a kill (KeyboardInterrupt, a BaseException) leaving it too.
def test_a_failed_write_keeps_the_old_contents_and_leaves_no_temporary(tmp_path):
    """An exception or a kill inside atomic_path: the target keeps what it held, and neither
    the temporary file nor the temporary folder (with what was written into it) is left."""
    path, folder = tmp_path / "a.json", tmp_path / "hf"
    write_json(path, {"v": 1})
    with atomic_path(folder, directory=True) as tmp:
        (tmp / "w").write_text("old")
    for error in (RuntimeError("killed"), KeyboardInterrupt()):
        for target, directory in ((path, False), (folder, True)):
            with pytest.raises(type(error)), atomic_path(target, directory=directory) as tmp:
                (tmp / "w" if directory else tmp).write_text("half")
                raise error
    assert read_json(path) == {"v": 1} and names(folder) == ["w"]
    assert (folder / "w").read_text() == "old"
    assert names(tmp_path) == ["a.json", "hf"]


# Catches: the fsync of the temporary (file or folder tree) before the rename dropped;
# fsync_tree no longer recursive (only the folder itself flushed); the fsync of the parent
# folder after the rename (the rename itself) dropped or moved before it.
def test_an_atomic_write_is_on_disk_before_its_rename_and_the_rename_after(tmp_path, monkeypatch):
    """What a power loss could otherwise lose: every file and folder of the temporary is
    fsynced before it is renamed onto the target, and the parent folder after the rename."""
    events = []
    fsync, replace = os.fsync, os.replace

    def recording_fsync(fd):
        events.append(os.readlink(f"/proc/self/fd/{fd}"))
        fsync(fd)

    def recording_replace(src, dst):
        events.append(("rename", str(dst)))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "replace", recording_replace)
    out = tmp_path / "hf"
    with atomic_path(out, directory=True) as tmp:
        (tmp / "sub").mkdir()
        (tmp / "sub" / "w.bin").write_bytes(b"w")
    assert sorted(events[:-2]) == [str(tmp), str(tmp / "sub"), str(tmp / "sub" / "w.bin")]
    assert events[-2:] == [("rename", str(out)), str(tmp_path)]
    events.clear()
    write_json(tmp_path / "a.json", {})
    [temporary, rename, parent] = events
    assert temporary.startswith(str(tmp_path / ".a.json.tmp-"))
    assert (rename, parent) == (("rename", str(tmp_path / "a.json")), str(tmp_path))


# Catches: remove_stale_temps matching any output's temporaries (".*.tmp-*"), or any sibling
# whose name starts with the output's (".<name>*": .train.jsonl.tmp-* of another job), or
# no longer removing a temporary folder (unlink on a folder raises).
def test_only_the_outputs_own_temporaries_are_removed(tmp_path):
    """A killed writer's .<name>.tmp-* files and folders go; temporaries of other outputs in the
    folder (another job may be writing them now), even one whose name begins the same, stay."""
    own = [tmp_path / ".train.json.tmp-a1", tmp_path / ".train.json.tmp-b2"]
    own[0].write_bytes(b"\0" * 64)
    own[1].mkdir()
    (own[1] / "part").write_bytes(b"\0" * 64)
    others = ["train.json", ".train.jsonl.tmp-c3", ".eval.json.tmp-d4", "train.json.tmp-e5"]
    for name in others:
        (tmp_path / name).write_text("keep")
    remove_stale_temps(tmp_path / "train.json")
    assert names(tmp_path) == sorted(others)


# Catches: size_mismatch checking when only one of shard and manifest exists ("and" -> "or");
# a truncated shard let through (size > expected instead of !=); the two sizes swapped in the
# message; an unreadable manifest reported as None, or a manifest of the wrong shape
# (KeyError, TypeError) raising instead of being reported.
def test_size_mismatch_names_a_shard_that_its_manifest_does_not_describe(tmp_path):
    """rules/common.smk forget_damaged_shards: a shard cut short or grown since its manifest was
    written is named with both sizes; nothing to compare (not built, half built) is None; a
    manifest that does not parse or has no file.bytes is named as unreadable."""
    shard, manifest = tmp_path / "shard-0.safetensors", tmp_path / "shard-0.json"
    assert size_mismatch(shard, manifest) is None  # not built
    shard.write_bytes(b"x" * 10)
    assert size_mismatch(shard, manifest) is None  # half built: no manifest yet
    write_json(manifest, {"file": {"bytes": 10, "sha256": "0" * 64}})
    assert size_mismatch(shard, manifest) is None
    shard.write_bytes(b"x" * 4)
    assert size_mismatch(shard, manifest) == f"{shard}: 4 bytes, its manifest says 10"
    shard.write_bytes(b"x" * 11)
    assert size_mismatch(shard, manifest) == f"{shard}: 11 bytes, its manifest says 10"
    for text in ("{", "[]", '{"file": {}}', '{"file": 3}'):
        manifest.write_text(text)
        assert size_mismatch(shard, manifest) == f"{manifest}: unreadable manifest", text
    shard.unlink()
    assert size_mismatch(shard, manifest) is None  # removed: Snakemake builds it anyway


# Catches: canonical_json without sort_keys, with json's default separators or with
# ensure_ascii (each changes every stamp's sha256, so every existing result would look stale);
# write_json without its final newline, without sort_keys or escaping non-ASCII text.
def test_json_is_hashed_and_written_in_one_fixed_form(tmp_path):
    """The canonical form (stamps, manifests: their digests are compared with ones recorded by
    earlier runs) and the written form (byte-identical artifacts across rebuilds) are pinned."""
    obj = {"b": [1, 2.5, None], "a": {"é": "ü"}}
    assert canonical_json(obj) == '{"a":{"é":"ü"},"b":[1,2.5,null]}'
    assert canonical_json(dict(reversed(obj.items()))) == canonical_json(obj)
    assert sha256_json(obj) == hashlib.sha256(canonical_json(obj).encode()).hexdigest()
    assert sha256_json(obj) == "d6faf43b19bb46589e6b37af5ed8f8474081c148d450fc90e53573e60248101b"
    write_json(tmp_path / "o.json", obj)
    assert (tmp_path / "o.json").read_bytes() == (
        '{\n  "a": {\n    "é": "ü"\n  },\n  "b": [\n    1,\n    2.5,\n    null\n  ]\n}\n'
    ).encode()


# Catches: write_json writing in the locale's encoding (Path.write_text without encoding=) while
# read_json reads UTF-8: under a non-UTF-8 locale a record holding non-ASCII config text (a
# path, a system prompt) failed to be written (ASCII locale: UnicodeEncodeError).
def test_json_files_are_utf8_whatever_the_locale(tmp_path):
    """A JSON file written under the C locale without UTF-8 mode is UTF-8 and reads back."""
    path = tmp_path / "provenance-prepare.json"
    child = (
        "import sys\n"
        "from eagle3lib.fileio import read_json, write_json\n"
        "write_json(sys.argv[1], {'path': '/data/caf\\u00e9/train.jsonl'})\n"
        "print(read_json(sys.argv[1])['path'] == '/data/caf\\u00e9/train.jsonl')\n"
    )
    env = {**os.environ, "LC_ALL": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0"}
    proc = subprocess.run(
        [sys.executable, "-c", child, str(path)],
        capture_output=True, text=True, timeout=60, env=env, cwd=provenance.ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "True"
    assert path.read_bytes() == '{\n  "path": "/data/café/train.jsonl"\n}\n'.encode()


# Catches: fingerprinted_dir crashing on a marker that does not parse (ValueError no longer
# suppressed) or that is JSON but not an object (AttributeError no longer suppressed).
def test_a_damaged_fingerprint_starts_the_state_over(tmp_path):
    """A fingerprint.json cut short or edited into a list or string: the state folder is
    emptied and stamped afresh, as for other inputs, instead of the job stopping."""
    state = tmp_path / "state"
    assert fingerprinted_dir(state, {"lr": 1}) is False
    for text in ("{", "[1]", '"x"'):
        (state / "0").mkdir()
        (state / "fingerprint.json").write_text(text)
        assert fingerprinted_dir(state, {"lr": 1}) is False, text
        assert names(state) == ["fingerprint.json"]
        assert read_json(state / "fingerprint.json") == {
            "sha256": sha256_json({"lr": 1}), "fingerprint": {"lr": 1}
        }  # fmt: skip


# Catches: hash_ahead queueing a file again that it is already hashing (key in _AHEAD no
# longer skipped: two threads read it); _identity reduced to (device, inode), so a file
# rewritten in place after it was hashed ahead gets its old digest.
def test_a_file_hashed_ahead_is_read_once_and_again_once_rewritten_in_place(tmp_path, monkeypatch):
    """hash_ahead twice on the same file reads it once; a file rewritten in place afterwards
    (same inode, same size, other bytes and time) is read again for its new digest."""
    reads = []
    read = fileio._read_sha256
    monkeypatch.setattr(fileio, "_AHEAD", {})
    monkeypatch.setattr(
        fileio, "_read_sha256", lambda p, chunk=1 << 22: reads.append(p.name) or read(p, chunk)
    )
    a = tmp_path / "a.bin"
    a.write_bytes(b"x" * 1000)
    fileio.hash_ahead([a])
    fileio.hash_ahead([a])
    join_hashing_threads()
    assert fileio.sha256_file(a) == hashlib.sha256(b"x" * 1000).hexdigest()
    assert reads == ["a.bin"]

    fileio.hash_ahead([a])
    join_hashing_threads()
    with open(a, "r+b") as fh:
        fh.write(b"y" * 1000)
    os.utime(a, ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_000))
    assert fileio.sha256_file(a) == hashlib.sha256(b"y" * 1000).hexdigest()
    assert reads == ["a.bin", "a.bin", "a.bin"]


# Catches: sha256_file no longer checking the file again after waiting for its digest (a file
# changed while it was hashed gets the digest of its old bytes); hash_ahead's threads not
# daemons (a job that fails meanwhile waits for the hashing).
def test_a_file_changed_while_its_digest_is_awaited_is_read_again(tmp_path, monkeypatch):
    """sha256_file takes the hashing thread's future and waits; the file changes before the
    thread is done: the digest returned is that of the new bytes, not the thread's."""
    monkeypatch.setattr(fileio, "_AHEAD", {})
    a = tmp_path / "a.bin"
    a.write_bytes(b"old")
    key = fileio._identity(a)
    read = fileio._read_sha256

    def changed_while_hashed(path, chunk=1 << 22):
        digest = read(path, chunk)
        if threading.current_thread().name == "hash_ahead":
            assert wait_until(lambda: key not in fileio._AHEAD, timeout=10)  # sha256_file waits
            a.write_bytes(b"new")
            os.utime(a, ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_000))
        return digest

    monkeypatch.setattr(fileio, "_read_sha256", changed_while_hashed)
    fileio.hash_ahead([a])
    hashing = [t for t in threading.enumerate() if t.name == "hash_ahead"]
    assert hashing and all(t.daemon for t in hashing)
    assert fileio.sha256_file(a) == hashlib.sha256(b"new").hexdigest()
    join_hashing_threads()


# Catches: sha256_file re-raising the error of a failed background hash (future.exception()
# no longer checked) instead of reading the file itself.
def test_a_failed_background_hash_is_not_final(tmp_path, monkeypatch):
    """The hashing thread's read failed (here a transient EIO): sha256_file reads the file
    itself and returns its digest."""
    monkeypatch.setattr(fileio, "_AHEAD", {})
    a = tmp_path / "a.bin"
    a.write_bytes(b"states")
    calls = []
    read = fileio._read_sha256

    def flaky(path, chunk=1 << 22):
        calls.append(threading.current_thread().name)
        if len(calls) == 1:
            raise OSError(errno.EIO, "Input/output error", str(path))
        return read(path, chunk)

    monkeypatch.setattr(fileio, "_read_sha256", flaky)
    fileio.hash_ahead([a])
    assert fileio.sha256_file(a) == hashlib.sha256(b"states").hexdigest()
    assert calls == ["hash_ahead", "MainThread"]
