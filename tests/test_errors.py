"""Bad input through the real workflow: a one-line error naming the file, line or key, a
non-zero exit, and no partial artifact."""

import errno
import json
import os
import re

import pytest
import tiny
from conftest import run_snakemake

pytestmark = pytest.mark.slow


def workspace(tmp_path, verifier_dir):
    evals = tiny.write_jsonl(
        tmp_path / "eval.jsonl", [{"question_id": 1, "turns": ["Tell me something"]}]
    )

    def make(train_records=None, train_text=None, **overrides):
        train = tmp_path / "train.jsonl"
        if train_text is not None:
            train.write_text(train_text)
        else:
            tiny.write_jsonl(
                train, train_records if train_records is not None else tiny.conversations(6)
            )
        config = tiny.write_config(
            tmp_path / "config.yaml",
            "t",
            overrides.pop("verifier", verifier_dir),
            train,
            evals,
            **overrides,
        )
        return config

    return tmp_path, make


@pytest.fixture
def setup(tmp_path, verifier_dir):
    return workspace(tmp_path, verifier_dir)


@pytest.fixture(scope="module")
def prepare_setup(tmp_path_factory, verifier_dir):
    """One folder for the tests whose prepare job fails: its verifier job runs once, and no
    test leaves a prepared sample behind for the next (each checks that)."""
    return workspace(tmp_path_factory.mktemp("prepare-errors"), verifier_dir)


def one_error_line(text: str) -> str:
    assert "Traceback" not in text, text
    lines = [line for line in text.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, text
    return lines[0]


def assert_no_partial_artifacts(results):
    if results.exists():
        assert not [p for p in results.rglob("*") if ".tmp-" in p.name]


def run_target(tmp_path, config, target):
    proc = run_snakemake(tmp_path, config, target, check=False)
    assert proc.returncode != 0
    return proc


def test_malformed_json_line_names_file_and_line(prepare_setup):
    tmp_path, make = prepare_setup
    good = json.dumps(tiny.conversations(1)[0])
    config = make(train_text=f'{good}\n{good}\n{{"conversations": [}}\n')
    run_target(tmp_path, config, "results/t/prepared/samples.json")
    line = one_error_line((tmp_path / "results/t/logs/prepare.log").read_text())
    assert line.endswith("fix or remove the line")
    assert f"{tmp_path}/train.jsonl:3: invalid JSON" in line
    assert not (tmp_path / "results/t/prepared/samples.safetensors").exists()
    assert_no_partial_artifacts(tmp_path / "results")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        # blank lines only (an empty file is refused when the workflow plans)
        ("\n\n", "no usable training samples (0 records read; dropped no records)"),
        (
            json.dumps({"messages": [{"role": "user", "content": "anyone there?"}]}) + "\n",
            "dropped no_assistant_turn: 1",
        ),
    ],
)
def test_dataset_without_usable_samples(prepare_setup, text, message):
    tmp_path, make = prepare_setup
    config = make(train_text=text)
    run_target(tmp_path, config, "results/t/prepared/samples.json")
    line = one_error_line((tmp_path / "results/t/logs/prepare.log").read_text())
    assert message in line and "train.jsonl" in line
    assert not (tmp_path / "results/t/prepared").exists() or not any(
        (tmp_path / "results/t/prepared").iterdir()
    )


def test_unknown_config_key(setup):
    tmp_path, make = setup
    config = make(train={"lrr": 0.1})
    proc = run_target(tmp_path, config, "results/t/prepared/samples.json")
    line = one_error_line(proc.stderr)
    assert line.startswith("error: config key train.lrr: unknown key; allowed here: ")
    assert not (tmp_path / "results").exists()


def test_config_value_of_the_wrong_type(setup):
    tmp_path, make = setup
    config = make(extract={"shards": "two"})
    proc = run_target(tmp_path, config, "results/t/prepared/samples.json")
    assert one_error_line(proc.stderr).startswith(
        "error: config key extract.shards: 'two' is not of type 'integer'; "
    )


def test_missing_verifier_folder(setup):
    tmp_path, make = setup
    config = make(verifier=tmp_path / "no-such-model")
    proc = run_target(tmp_path, config, "results/t/prepared/samples.json")
    line = one_error_line(proc.stderr)
    assert line == (
        f"error: config key verifier.path: folder '{tmp_path}/no-such-model' does not exist; "
        "fix the path (relative paths start at the working directory), or give a hub id or a "
        ".gguf file"
    )
    assert not (tmp_path / "results").exists()


def test_aux_layer_out_of_range(setup, verifier_dir):
    """Known from the verifier's config.json when the workflow plans: no job runs."""
    tmp_path, make = setup
    config = make(extract={"aux_layers": [1, 4, 9]})
    proc = run_target(tmp_path, config, "results/t/hidden_states/shard-0.safetensors")
    assert one_error_line(proc.stderr) == (
        "error: config key extract.aux_layers: layer id(s) [9] out of range [0, 7] for a "
        "verifier with 8 layers (the final layer is always added); use ids from 0 to 7 "
        f"(verifier: {verifier_dir}/config.json)"
    )
    assert "rule verifier" not in proc.stdout + proc.stderr  # no job started
    assert not (tmp_path / "results").exists()


def test_draft_vocab_larger_than_the_verifier_vocab(setup):
    tmp_path, make = setup
    config = make(train={"draft_vocab_size": 100000})
    proc = run_target(tmp_path, config, "results/t/vocab/vocab_map.safetensors")
    line = one_error_line(proc.stderr)
    assert "config key train.draft_vocab_size: 100000 is larger than the verifier vocab" in line
    assert "use at most 400" in line
    assert not (tmp_path / "results").exists()


def test_a_librarys_failed_write_is_a_full_disk_only_when_it_is(tmp_path, monkeypatch):
    """as_disk_full: an OSError ENOSPC or EDQUOT (named by the folder where it names no file)
    and safetensors' "os error 28" are a full disk; torch's zip writer failing is one only
    while the folder's disk is (nearly) full, with torch's line kept; another error, or an
    OSError of another kind, is not one, full disk or not."""
    import shutil
    from collections import namedtuple

    import torch

    from eagle3lib import errors

    usage = namedtuple("usage", "total used free")
    free = {"bytes": 10 << 30}
    monkeypatch.setattr(shutil, "disk_usage", lambda _path: usage(0, 0, free["bytes"]))
    safetensors = RuntimeError(
        "Error while serializing: I/O error: No space left on device (os error 28)"
    )
    full = errors.as_disk_full(safetensors, tmp_path)
    assert (full.errno, full.strerror, full.filename) == (
        errno.ENOSPC, "No space left on device", str(tmp_path)
    )  # fmt: skip
    named = OSError(errno.ENOSPC, "No space left on device", "/x/optimizer_state_dict.pt")
    assert errors.as_disk_full(named, tmp_path) is named
    quota = errors.as_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"), tmp_path)
    assert quota.filename == str(tmp_path)
    torch_write = RuntimeError(
        "[enforce fail at inline_container.cc:672] . unexpected pos 704647168 vs 704647056"
    )
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    others = [torch_write, oom, RuntimeError("a bug"), KeyError("step"),
              OSError(errno.EACCES, "Permission denied"),
              errors.UserError("x: cannot reserve 9 bytes (No space left on device); free ...")]  # fmt: skip
    assert [errors.as_disk_full(e, tmp_path) for e in others] == [None] * 6  # 10 GiB free
    free["bytes"] = 4096  # the disk full: only torch's write failure changes
    full = errors.as_disk_full(torch_write, tmp_path)
    assert (full.errno, full.filename) == (errno.ENOSPC, str(tmp_path))
    assert full.strerror == (
        "No space left on device (torch: [enforce fail at inline_container.cc:672] . unexpected "
        "pos 704647168 vs 704647056)"
    )
    assert [errors.as_disk_full(e, tmp_path) for e in others[1:]] == [None] * 5


def test_a_collective_that_lost_another_process_is_one_line_only_in_a_job_of_several(
    monkeypatch, capsys
):
    """errors.cli: gloo's closed connection (and NCCL's remote error) in a process of several
    (WORLD_SIZE > 1) is one line naming the rank, torch's first line kept, exit status 1; the
    same error in a single process, or another RuntimeError, keeps its traceback."""
    from eagle3lib import errors

    gloo = RuntimeError(
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
        "closed by peer [127.0.0.1]:9091. This is typically caused by a remote worker crashing."
    )

    def raising(exc):
        def main():
            raise exc

        return errors.cli(main)

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as stopped:
        raising(gloo)()
    assert stopped.value.code == 1
    assert capsys.readouterr().err == (
        "error: rank 1: another process of this job ended first (its error, if it printed one, "
        "is above), so this one stopped too: [/__w/pytorch/pytorch/third_party/gloo/gloo/"
        "transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:9091. This is "
        "typically caused by a remote worker crashing.\n"
    )
    nccl = RuntimeError("NCCL error: remote process exited or there was a network error")
    with pytest.raises(SystemExit):
        raising(nccl)()
    assert capsys.readouterr().err.startswith("error: rank 1: another process of this job")
    with pytest.raises(RuntimeError, match="a bug"):
        raising(RuntimeError("a bug"))()
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        raising(gloo)()


@pytest.mark.parametrize(
    ("code", "advice"),
    [
        (errno.ENOSPC, "No space left on device; free disk space or point the results "
         "elsewhere, then rerun"),
        (errno.EDQUOT, "Disk quota exceeded; free space within your disk quota (or have it "
         "raised) or point the results elsewhere, then rerun"),
        (errno.EFBIG, "File too large; a file reached the largest size allowed to this process "
         "(the shell's `ulimit -f`) or to the file system: raise the limit or point the results "
         "at another file system, then rerun"),
    ],
)  # fmt: skip
def test_a_full_disk_quota_or_file_size_limit_each_says_what_to_do(code, advice, capsys):
    """errors.cli: one line naming the file, the system's words and what to do about that
    cause (a quota is not freed like a disk; a file size limit is raised, not freed)."""
    from eagle3lib import errors

    def main():
        raise OSError(code, os.strerror(code), "results/run/train/state")

    with pytest.raises(SystemExit) as stopped:
        errors.cli(main)()
    assert stopped.value.code == 1
    assert capsys.readouterr().err == f"error: results/run/train/state: {advice}\n"


@pytest.mark.parametrize(
    ("limit", "numel"),
    [(512 << 10, 300_000), (4 << 20, 2_000_000)],  # under and over the probe's 1 MiB
)
def test_torch_saves_failure_under_a_file_size_limit_is_found(tmp_path, limit, numel):
    """A limit that free space does not show (here a real RLIMIT_FSIZE, SIGXFSZ ignored, in a
    child process): torch.save of a larger state fails with torch's own RuntimeError while the
    disk has room, and as_disk_full finds the limit (EFBIG, torch's line kept, no probe file
    left): under 1 MiB by its probe write into the folder (a quota the same way), above it by
    the half-written file that reached the limit; the same error without the limit, the probe
    written, is not a full disk."""
    import subprocess
    import sys

    child = r"""
import errno, resource, signal, sys, torch
from eagle3lib import errors
folder = sys.argv[1]
try:
    torch.save({"a": torch.zeros(1)}, folder + "/small.pt")
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), resource.RLIM_INFINITY))
    torch.save({"a": torch.zeros(int(sys.argv[3]))}, folder + "/state.pt")
except RuntimeError as exc:
    full = errors.as_disk_full(exc, folder)
    print(errno.errorcode[full.errno], full.filename == folder, full.strerror, sep="|")
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
print(errors.as_disk_full(RuntimeError("file write failed"), folder))
"""
    proc = subprocess.run(
        [sys.executable, "-c", child, str(tmp_path), str(limit), str(numel)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    code, named, strerror = proc.stdout.splitlines()[0].split("|")
    assert (code, named) == ("EFBIG", "True")
    assert re.fullmatch(r"File too large \(torch: .*unexpected pos \d+ vs \d+\)", strerror)
    assert proc.stdout.splitlines()[1] == "None"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small.pt", "state.pt"]  # no probe


def test_atomic_path_asks_about_a_full_disk_while_the_half_written_file_holds_its_space(
    tmp_path, monkeypatch
):
    """fileio.atomic_path: a failed write is looked at (as_disk_full's probe) before the
    half-written temporary file is removed, so a quota it filled is still full then; the file
    is removed afterwards and the full disk raised naming the target."""
    from eagle3lib import fileio

    seen = {}

    def as_disk_full(exc, where):
        seen["temporary files"] = sorted(p.name for p in tmp_path.iterdir())
        return OSError(errno.EDQUOT, "Disk quota exceeded", str(where))

    monkeypatch.setattr(fileio, "as_disk_full", as_disk_full)
    target = tmp_path / "shard.safetensors"
    with (
        pytest.raises(OSError, match="Disk quota exceeded") as raised,
        fileio.atomic_path(target) as tmp,
    ):
        tmp.write_bytes(b"x" * 100)
        raise RuntimeError("unexpected pos 100 vs 64")
    assert raised.value.filename == str(target)
    [name] = seen["temporary files"]
    assert name.startswith(".shard.safetensors.tmp-"), seen
    assert list(tmp_path.iterdir()) == []  # removed after
