"""A GPU build's checkpoint brought back in parts (bench/smollm2_campaign.sh wait, checkpoint-back)
and unpacked for vLLM on the CPU (bench/serve_gpu_draft.py): the bytes arrive unchanged, and a
missing or damaged part is refused by name."""

import importlib.util
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import assert_same_bytes

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def serve_gpu_draft():
    spec = importlib.util.spec_from_file_location(
        "serve_gpu_draft", ROOT / "bench/serve_gpu_draft.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def campaign(tree: Path, out: Path, *args: str, run: str = "r") -> subprocess.CompletedProcess:
    """The campaign script, run in a copy of bench/ beside a fake build (it works relative to
    its own folder's parent, as on the device machine), with $OUT a fresh folder."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    env = {**os.environ, "CAMPAIGN": str(tree / "campaign"), "OUT": str(out), "RUN_NAME": run}
    return subprocess.run(
        ["bash", str(tree / "bench/smollm2_campaign.sh"), *args],
        env=env, capture_output=True, text=True,
    )  # fmt: skip


def checkpoint_back(tree: Path, part_set: int) -> Path:
    out = tree / f"out-{part_set}"
    proc = campaign(tree, out, "checkpoint-back", str(part_set))
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    tree = tmp_path_factory.mktemp("device")
    (tree / "bench").mkdir()
    shutil.copy(ROOT / "bench/smollm2_campaign.sh", tree / "bench")
    (tree / "campaign").mkdir()
    run = tree / "results/r"
    (run / "checkpoint").mkdir(parents=True)
    (run / "reports").mkdir()
    # incompressible: 70 MiB of gzip'd tar is five parts of 15 MiB, two calls' worth
    (run / "checkpoint/model.safetensors").write_bytes(os.urandom(70 << 20))
    (run / "checkpoint/config.json").write_text('{"architectures": ["Eagle3Speculator"]}')
    (run / "reports/acceptance.json").write_text(json.dumps({"acceptance_length": 2.75}))
    (run / "reports/summary.json").write_text("{}")
    return tree


def test_the_parts_of_two_calls_unpack_to_the_same_bytes(build, serve_gpu_draft, tmp_path):
    first, second = checkpoint_back(build, 0), checkpoint_back(build, 1)
    assert sorted(p.name for p in first.iterdir()) == [
        "checkpoint.sha256",
        *(f"checkpoint.tar.gz.part-0{n}" for n in range(4)),
    ]
    assert sorted(p.name for p in second.iterdir()) == [
        "checkpoint.sha256",
        "checkpoint.tar.gz.part-04",
    ]
    assert all(p.stat().st_size <= 15 << 20 for p in [*first.iterdir(), *second.iterdir()])
    parts = tmp_path / "parts"
    parts.mkdir()
    for p in [*first.iterdir(), *second.iterdir()]:
        shutil.copy(p, parts)
    run = serve_gpu_draft.unpack(parts, tmp_path / "unpacked")
    assert run.name == "r"
    for name in (
        "checkpoint/model.safetensors",
        "checkpoint/config.json",
        "reports/acceptance.json",
    ):
        assert_same_bytes(run / name, build / "results/r" / name)


def test_wait_on_an_ended_build_brings_the_first_parts_and_checkpoint_back_1_the_rest(
    build, serve_gpu_draft, tmp_path
):
    """The wait call that finds the build ended sends parts 0-3 beside campaign.tgz (within
    a call's 8 files and 64 MiB); checkpoint-back 1 then completes the set. campaign.tgz never
    packs the checkpoint archive, on the first wait or a later one."""
    (build / "campaign/status").write_text("12:00:00 build: exit 0\n")
    (build / "campaign/done").touch()
    try:
        for call in ("first", "again"):
            proc = campaign(build, tmp_path / call, "wait", "0")
            assert proc.returncode == 0, proc.stderr
            assert "the rest: checkpoint-back 1" in proc.stdout
            files = sorted(p.name for p in (tmp_path / call).iterdir())
            assert files == [
                "campaign.tgz",
                "checkpoint.sha256",
                *(f"checkpoint.tar.gz.part-0{n}" for n in range(4)),
            ]
            assert sum(p.stat().st_size for p in (tmp_path / call).iterdir()) <= 64 << 20
            assert (tmp_path / call / "campaign.tgz").stat().st_size < 1 << 20
    finally:
        (build / "campaign/done").unlink()
        (build / "campaign/status").unlink()
    rest = campaign(build, tmp_path / "rest", "checkpoint-back", "1")
    assert rest.returncode == 0, rest.stderr
    parts = tmp_path / "parts"
    parts.mkdir()
    for p in [*(tmp_path / "first").glob("checkpoint*"), *(tmp_path / "rest").iterdir()]:
        shutil.copy(p, parts)
    run = serve_gpu_draft.unpack(parts, tmp_path / "unpacked")
    model = "checkpoint/model.safetensors"
    assert_same_bytes(run / model, build / "results/r" / model)


def test_wait_on_a_running_build_brings_no_checkpoint(build, tmp_path):
    (build / "campaign/status").write_text("12:00:00 build: start\n")
    try:
        proc = campaign(build, tmp_path / "out", "wait", "0")
    finally:
        (build / "campaign/status").unlink()
    assert proc.returncode == 0, proc.stderr
    assert "checkpoint-back" not in proc.stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["campaign.tgz"]


def test_checkpoint_back_of_a_second_run_packs_that_runs_checkpoint(serve_gpu_draft, tmp_path):
    """Two builds one after the other on one machine (an ablation's pair): checkpoint-back
    under the second run name brings the second run's checkpoint, not the archive the first
    one left in the campaign folder."""
    tree = tmp_path / "device"
    (tree / "bench").mkdir(parents=True)
    shutil.copy(ROOT / "bench/smollm2_campaign.sh", tree / "bench")
    (tree / "campaign").mkdir()
    for run in ("r", "r2"):
        (tree / "results" / run / "checkpoint").mkdir(parents=True)
        (tree / "results" / run / "reports").mkdir()
        (tree / "results" / run / "checkpoint/model.safetensors").write_bytes(os.urandom(4096))
        for name in ("acceptance.json", "summary.json"):
            (tree / "results" / run / "reports" / name).write_text("{}")
    for run in ("r", "r2"):
        proc = campaign(tree, tmp_path / f"out-{run}", "checkpoint-back", "0", run=run)
        assert proc.returncode == 0, proc.stderr
        unpacked = serve_gpu_draft.unpack(tmp_path / f"out-{run}", tmp_path / f"unpacked-{run}")
        assert unpacked.name == run
        model = "checkpoint/model.safetensors"
        assert_same_bytes(unpacked / model, tree / "results" / run / model)


def brought_back(build, to: Path) -> Path:
    to.mkdir()
    for part_set in (0, 1):
        for p in checkpoint_back(build, part_set).iterdir():
            shutil.copy(p, to)
    return to


def test_a_missing_part_is_refused(build, serve_gpu_draft, tmp_path):
    parts = brought_back(build, tmp_path / "parts")
    (parts / "checkpoint.tar.gz.part-04").unlink()
    with pytest.raises(SystemExit) as exc:
        serve_gpu_draft.unpack(parts, tmp_path / "unpacked")
    assert str(exc.value).startswith(f"error: 4 parts in {parts} hash to ")
    assert str(exc.value).endswith("one is missing or damaged; bring them back again")
    assert not (tmp_path / "unpacked").exists()


def test_a_damaged_part_is_refused(build, serve_gpu_draft, tmp_path):
    parts = brought_back(build, tmp_path / "parts")
    part = parts / "checkpoint.tar.gz.part-02"
    data = bytearray(part.read_bytes())
    data[1000] ^= 1
    part.write_bytes(bytes(data))
    with pytest.raises(SystemExit, match=f"error: 5 parts in {parts} hash to "):
        serve_gpu_draft.unpack(parts, tmp_path / "unpacked")
    assert not (tmp_path / "unpacked").exists()


def test_checkpoint_back_without_a_finished_build_says_so(tmp_path):
    (tmp_path / "bench").mkdir()
    shutil.copy(ROOT / "bench/smollm2_campaign.sh", tmp_path / "bench")
    env = {**os.environ, "CAMPAIGN": str(tmp_path), "OUT": str(tmp_path), "RUN_NAME": "none"}
    proc = subprocess.run(
        ["bash", str(tmp_path / "bench/smollm2_campaign.sh"), "checkpoint-back", "0"],
        env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        "error: results/none/checkpoint/model.safetensors is missing: no finished build to "
        "bring back"
    )
