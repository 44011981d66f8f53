"""The bench scripts' own CPU smoke runs (the commands their docstrings give), end to end: a
bench that no longer runs is found here, not on a GPU machine's scarce time. The figures they
print are CPU figures of tiny shapes, not benchmarks; what is asserted is that each run finishes
and prints its keys (and, for quality_parity, that our trainer and speculators' CLI train the
same weights)."""

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def smoke(script: str, *args: str, root: Path = ROOT, env: dict | None = None) -> str:
    done = subprocess.run(
        [sys.executable, str(root / "bench" / script), "--smoke", *args],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=root,
        env=env,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return done.stdout


def test_extract_smoke(tmp_path):
    out = smoke("extract.py", "--out", str(tmp_path))
    assert "extract.cpu.bytes_per_token = " in out


def test_draft_build_smoke(tmp_path):
    """bench/draft_build.py on a CPU (tiny shape, the CPU build only): its verifier, the
    train job's draft built from it, the key line."""
    import tiny

    tiny.build_tokenizer(tmp_path / "xfer" / "tokenizer")
    out = smoke("draft_build.py", "--rounds", "1", "--work", str(tmp_path / "work"),
                "--xfer", str(tmp_path / "xfer"))  # fmt: skip
    assert re.search(r"^draft_build\.cpu\.cpu_seconds = \d+\.\d\d$", out, re.M), out


def test_resume_smoke(tmp_path):
    """bench/resume.py on a CPU (tiny shape): the runs stopped mid-epoch and at the first
    epoch's end exit as the train job does and, resumed, end with the reference's files."""
    smoke("resume.py", "--out", str(tmp_path), "--samples", "30", "--stop-at", "2")
    result = json.loads((tmp_path / "bench_resume.json").read_text())
    assert result["steps"] == 2 * result["first_epoch_steps"] > 2
    runs = {r["name"]: r for r in result["runs"]}
    assert list(runs) == ["again", "mid_epoch", "epoch_end"]
    assert (runs["mid_epoch"]["exit_code"], runs["epoch_end"]["exit_code"]) == (143, 130)
    assert runs["epoch_end"]["stopped_after"] == result["first_epoch_steps"]
    assert all(r["files_equal"] and r["weights_max_abs_difference"] == 0 for r in runs.values())
    assert [r["resumed"] for r in runs.values()] == [False, True, True]


def test_resume_comparison_finds_a_changed_weight_and_loss(tmp_path):
    """bench/resume.py's comparison is not blind: one weight changed by 1e-3 and one loss
    changed are found, with the file that differs."""
    sys.path.insert(0, str(ROOT / "bench"))
    import resume
    import torch
    from safetensors.torch import save_file

    runs = []
    for name, bump in (("a", 0.0), ("b", 1e-3)):
        final = tmp_path / name
        final.mkdir()
        w = torch.zeros(3, 2)
        w[1, 1] += bump
        save_file({"w": w, "d2t": torch.arange(4)}, str(final / "model.safetensors"))
        (final / "training_state.json").write_text("{}")
        losses = [2.0, 1.5, 1.25 + bump]
        runs.append({"final": final, "digests": resume.folder_digests(final), "losses": losses})
    found = resume.compare(*runs)
    assert found["files_equal"] is False and found["files_differing"] == ["model.safetensors"]
    assert found["weights_max_abs_difference"] == pytest.approx(1e-3)
    assert found["first_differing_step"] == 2
    assert found["losses_max_relative_difference"] == pytest.approx(1e-3 / 1.25)
    assert resume.compare(runs[0], runs[0])["files_equal"] is True


def test_newton_schulz_smoke(tmp_path):
    """Gram Newton-Schulz against torch's iteration at a SmolLM2-shaped draft's Muon shapes:
    the wide ones by Gram, at most half as far from the fp64 iteration; o_proj (square) by
    torch's own function, the same result."""
    out = smoke("newton_schulz.py", "--out", str(tmp_path))
    rows = json.loads((tmp_path / "bench_newton_schulz.json").read_text())["rows"]
    assert [(r["matrices"], r["gram"]) for r in rows] == [
        ("fc", True), ("q", True), ("k, v", True), ("o", False), ("gate, up, down", True),
    ]  # fmt: skip
    assert all(r["ours_to_exact"] <= 0.5 * r["torch_to_exact"] for r in rows if r["gram"])
    assert [r["ours_to_torch"] for r in rows if not r["gram"]] == [0.0]
    assert "newton_schulz.smollm2.gram_worst_distance_ratio_to_exact = " in out
    assert "newton_schulz.smollm2.draft_tflop_ours = 0.05" in out


def test_newton_schulz_on_the_packaged_verifiers_own_states(tmp_path):
    """fc gradients from SmolLM2-135M-Instruct's own hidden states (real text, RMS-normalised
    as the draft does): their columns within 100 x of the median, and the Gram form at most
    half as far from the fp64 iteration as torch's bf16 one (measured: 0.13 x)."""
    out = smoke("newton_schulz.py", "--verifier-states", "--out", str(tmp_path))
    rows = json.loads((tmp_path / "bench_newton_schulz.json").read_text())["rows"]
    real = [r for r in rows if r["kind"].startswith("verifier states")]
    assert [(r["matrices"], r["m"], r["n"], r["gram"]) for r in real] == [
        ("fc", 576, 1728, True)
    ] * 3
    assert all(r["column_spread"] < 100 for r in real)
    assert all(r["ours_to_exact"] <= 0.5 * r["torch_to_exact"] for r in real)
    assert "newton_schulz.smollm2.verifier_states.worst_distance_ratio = " in out


def test_train_smoke(tmp_path):
    """Its verifier passes the verifier checks (a tokenizer with a chat template), and each
    variant trains a draft of --num-layers layers. Run as the workflow runs the train job:
    OpenMP's threads waiting passively (set by the bench where the environment does not) and
    ours with torch's threads held to the job's share; speculators' trainer with torch's
    default threads (here set to 1, unlike the job's 5)."""
    import json
    import os

    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = smoke(
        "train.py", "--profile-steps", "0", "--variants",
        "ours,speculators_fastest,ours_ffd_graph", "--num-layers", "2", "--muon-check", "2",
        "--out", str(tmp_path), env={**env, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    summary = json.loads((tmp_path / "bench_train.json").read_text())
    results = summary["results"]
    assert [r["name"] for r in results] == ["ours", "speculators_fastest"]
    # the graphed step reaches the train job's own setting, which refuses it on a CPU; an
    # experiment's failure is noted and the call goes on
    assert summary["failed"] == [
        {
            "name": "ours_ffd_graph",
            "error": "UserError: train.graph_step: true, but it needs a GPU; set it to auto "
            "(graphed where it can run) or false",
        }
    ]
    assert all(r["num_layers"] == 2 and r["tokens_per_s"] > 0 for r in results)
    # ours: its training thread and 4 loader threads (the train job's); theirs: torch's default
    assert [r["intra_op_threads"] for r in results] == [5, 1]
    # ours' waits in the window (the loader's for a free buffer set, the loop's for the GPU);
    # speculators' trainer has none
    assert [r["buffer_wait_fraction"] is None for r in results] == [False, True]
    assert [r["gpu_wait_fraction"] for r in results] == [0.0, None]  # no GPU to wait for
    assert {r["omp_wait_policy"] for r in results} == {"PASSIVE"}
    # the training thread's time in the window from Linux's schedstat: on a core for part of
    # it (it trains on the CPU here), never more than all of it; waiting for a core the rest
    if Path("/proc/thread-self/schedstat").exists():
        for thread in (r["training_thread"] for r in results):
            assert 0.05 < thread["cpu_fraction"] <= 1.01, thread
            assert 0 <= thread["runqueue_wait_fraction"] <= 1.01 - thread["cpu_fraction"], thread
    assert " rq wait " in out
    assert "train.cpu.multipack.tokens_per_s = " in out
    # the train job's Muon against torch's on the two-layer draft's Muon matrices: all small,
    # so all batched by torch's iteration (none large enough for Gram Newton-Schulz)
    check = summary["muon_check"]
    assert check["matrices"] == check["batched_matrices"] == 1 + 2 * 7
    assert check["gram_matrices"] == 0 and check["newton_schulz"] == "gram"
    assert check["max_relative_difference"] < 0.01
    assert "train.cpu.batched_muon.max_relative_difference = " in out


def test_train_ddp_smoke_checks_its_ranks_and_scaling(tmp_path):
    """The DDP part of the two-GPU queue (bench/queues/train-2gpu.txt) on a CPU: torchrun with
    two gloo ranks, each variant against its own one-process run (ours_muon_ffd_every_rank
    against ours_muon_ffd), and every run's ranks ending with the same weights. (Muon is split
    over the ranks on a GPU only; here both variants train alike.)"""
    one = tmp_path / "one"
    smoke("train.py", "--profile-steps", "0", "--variants", "ours_muon_ffd", "--out", str(one))
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         str(ROOT / "bench" / "train.py"), "--smoke", "--samples", "120", "--profile-steps", "0",
         "--variants", "ours_muon_ffd,ours_muon_ffd_every_rank",
         "--baseline", str(one / "bench_train.json"), "--out", str(tmp_path / "ddp")],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    results = json.loads((tmp_path / "ddp" / "bench_train_ddp2.json").read_text())["results"]
    assert [(r["variant"], r["ranks_agree"]) for r in results] == [
        ("ours_muon_ffd_ddp2", True), ("ours_muon_ffd_every_rank_ddp2", True),
    ]  # fmt: skip
    assert "train.2xcpu.muon_ffd.scaling_efficiency = " in done.stdout
    # #16's key is the train rule's recipe's (the default: Muon, ffd), the same figure
    (named,) = [x for x in done.stdout.splitlines() if x.startswith("train.2xcpu.muon_ffd.scal")]
    assert f"train.2xcpu.scaling_efficiency = {named.split(' = ')[1]}" in done.stdout
    assert "train.2xcpu.muon_ffd_every_rank.scaling_efficiency = " in done.stdout
    assert "ranks disagree" not in done.stdout


def test_train_kernel_launch_experiments_run_and_log_the_same_losses_on_a_cpu(tmp_path):
    """The CUDA graphs and C++ wrapper variants switch inductor settings around their runs
    only; on a CPU, where speculators compiles nothing, their losses equal the default
    recipe's to the bit (on a GPU the pairs measure what the settings change)."""
    out = smoke(
        "train.py", "--profile-steps", "0", "--log-every", "1", "--out", str(tmp_path),
        "--variants", "ours_muon_ffd,ours_muon_ffd_cg,ours_muon_ffd_cppwrap",
    )  # fmt: skip
    assert "train.cpu.cuda_graphs.speedup.max_loss_relative_difference = 0.00000" in out
    assert "train.cpu.cpp_wrapper.speedup.max_loss_relative_difference = 0.00000" in out
    assert "ours_muon_ffd_cg: compiled regions without CUDA graphs per run: [0]" in out
    results = json.loads((tmp_path / "bench_train.json").read_text())["results"]
    curves = [r["loss_curve"]["train_loss"] for r in results]
    assert len(curves[0]) >= 5 and curves[0] == curves[1] == curves[2]


def test_train_refuses_a_timed_window_past_the_epoch(tmp_path):
    """A window that never closes used to end in a TypeError after training; now the run stops
    when the trainer is built, naming the flags, and writes no summary."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "train.py"), "--smoke", "--variants", "ours",
         "--steps", "5000", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 1
    assert "--steps 5000 is past the end of the epoch" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "bench_train.json").exists()


def test_forward_speed_smoke():
    out = smoke("forward_speed.py")
    assert "forward.cpu.layer.tokens_per_s = " in out


@pytest.mark.slow
def test_quality_parity_smoke(tmp_path):
    out = smoke("quality_parity.py", "--work", str(tmp_path))
    assert "quality_parity.smoke.ours_vs_cli.seed42.weights_identical = true" in out
    assert (tmp_path / "quality_parity.json").exists()


@pytest.mark.slow
def test_workflow_gpu_smoke(tmp_path):
    """It runs snakemake in the project folder, as a user would: here a copy of the tracked
    files, so that no run folder or snakemake lock lands in this checkout."""
    import shutil

    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split("\0")
    root = tmp_path / "project"
    for name in filter(None, files):
        if (ROOT / name).is_file():  # not a tracked file deleted in this checkout
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, root / name)
    xfer = tmp_path / "xfer"  # the tokenizer and ShareGPT slice, as `pack` makes them
    setup = [str(ROOT / "bench" / "gpu_setup.sh"), "pack-text", str(xfer)]
    subprocess.run(setup, check=True, capture_output=True, timeout=600)
    work = ["--work", str(tmp_path / "work"), "--xfer", str(xfer), "--rerun-train", "0"]
    out = smoke("workflow_gpu.py", *work, root=root)
    assert "workflow.cpu.extract.job_vs_bench = " in out
    # the train job again, from scratch (not resumed from the run's state): all its steps
    assert re.search(r"^workflow\.cpu\.train\.rerun\.job_tokens_per_s = \d+$", out, re.M), out
    (rerun,) = json.loads((tmp_path / "work" / "workflow_gpu.json").read_text())["reruns"]
    first = json.loads((tmp_path / "work" / "workflow_gpu.json").read_text())["workflow"]
    assert rerun["train"]["tokens"] == first["jobs"]["train"]["tokens"] > 0
    assert rerun["train"]["resumed"] is False and rerun["train"]["phase_seconds"]["steps"] > 0
    # the job ran again (its own summary), and both jobs' files were kept in the run's logs
    logs = root / "results" / "wf8b" / "logs"
    kept = [json.loads((logs / f"train.run{i}.summary.json").read_text()) for i in (0, 1)]
    assert kept[0]["timeline"] != kept[1]["timeline"], kept
    assert (logs / "train.run0.log").read_text() != (logs / "train.run1.log").read_text()
    assert (root / "results" / "wf8b" / "checkpoint" / "model.safetensors").exists()
    # where the disk went, per folder of the run and epoch of the training state
    disk = re.search(r"disk: (\{.*\})", out)
    used = ast.literal_eval(disk.group(1))
    assert {"hidden_states", "train", "train/state/0", "free"} <= set(used), used
    assert used["hidden_states"] > 0 and used["train/state/0"] > 0, used


def test_quality_parity_reads_a_verifier_record_relative_to_its_folder(tmp_path):
    """The verifier rule writes a GGUF-converted verifier's load path relative to verifier.json's
    folder (verifier.portable); the comparison resolves it there, not in the working folder."""
    import importlib.util
    import json
    import shutil

    spec = importlib.util.spec_from_file_location(
        "quality_parity", ROOT / "bench/quality_parity.py"
    )
    qp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(qp)
    run_dir, config = qp.build_smoke_run(tmp_path / "smoke")
    path = run_dir / "verifier" / "verifier.json"
    record = json.loads(path.read_text())
    shutil.copytree(record["load_path"], run_dir / "verifier" / "hf")  # as a converted GGUF
    path.write_text(json.dumps({**record, "load_path": "hf", "load_path_relative": True}))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run = qp.load_run(run_dir, config, elsewhere)
    assert Path(run["record"]["load_path"]) == run_dir / "verifier" / "hf"


def test_quality_table_prints_the_presets_keys_from_a_runs_reports(tmp_path):
    """`quality_smollm2.py table` reads a finished run's reports and prints the preset's keys
    (`quality.smollm2_preset.*`: BENCHMARKS.md's `quality.smollm2.*` hold the best build, not the
    preset); a run that has not finished is listed as such."""
    import json

    reports = tmp_path / "smollm2-gpu" / "reports"
    reports.mkdir(parents=True)
    result = {
        "eval_set": "mtbench",
        "k": 3,
        "acceptance_length": 2.51964,
        "per_position_acceptance": [0.676, 0.482, 0.361],
        "prompts": 80,
        "steps": 6911,
    }
    (reports / "acceptance.json").write_text(
        json.dumps({"results": [result], "argmax_agreement": 1.0})
    )
    (reports / "summary.json").write_text(
        json.dumps(
            {
                "seconds_per_job": {"train": 436.5},
                "disk_bytes": {"hidden_states": 29.2e9},
                "data": {"samples": 9889},
                "hidden_states": {"tokens": 6337793},
                "regenerated": None,
            }
        )
    )
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench/quality_smollm2.py"),
            "table",
            "--results",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert "quality.smollm2_preset.mtbench.k3.acceptance_length = 2.5196" in lines
    assert (
        "quality.smollm2_preset.mtbench.k3.per_position_acceptance = 0.676, 0.482, 0.361" in lines
    )
    assert "quality.smollm2_preset.argmax_agreement = 1.00000" in lines
    assert not [line for line in lines if line.startswith("quality.smollm2.")]
    assert "| smollm2-gpu-no-regen | (not run) | | | | | |" in lines
    assert "| hidden_states | 29,200.0 |" in lines


def workflow_gpu_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("workflow_gpu", ROOT / "bench/workflow_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# an extract job's figures as workflow_gpu.collect gives them: 1.8 M tokens at 24,000 tokens/s
EXTRACT_JOB = {
    "tokens": 1_800_000, "tokens_per_s": 24_000.0, "wall_seconds": 75.0,
    "model_load_seconds": 6.0, "extraction_seconds": 46.0, "extraction_tokens_per_s": 39_130.0,
    "write_seconds": 1.0, "hash_seconds": 1.0, "stall_seconds": 0.0, "phases": {},
}  # fmt: skip


def shared_fp8_report(capsys, workflow: dict, bench_rate: int, gpus: int = 1) -> list[str]:
    """The key lines workflow_gpu.report prints for two compiled fp8 extract jobs sharing one
    H200 (jobs of 1.8 M tokens, 24,000 and 20,000 tokens/s), given the stage's figures."""
    from types import SimpleNamespace

    job = EXTRACT_JOB
    jobs = {"extract-0": job, "extract-1": dict(job, tokens_per_s=20_000.0)}
    result = {
        "machine": {"gpus": ["NVIDIA H200"] * gpus},
        "wall_seconds": 200.0,
        "workflow": {"jobs": jobs, "extract_tokens": 3_600_000, **workflow},
        "bench_extract": {
            "tokens_per_s": 24_000, "tokens_per_s_after_compiling": bench_rate,
            "roofline_fraction": 0.5, "forward_only_tokens_per_s": None,
            "forward_only_masked_tokens_per_s": None,
        },
    }  # fmt: skip
    a = SimpleNamespace(
        smoke=False, gpus=gpus, storage="fp8", jobs_per_gpu=2, compile="true", until="extract",
        epochs=1, graph_step="auto",
    )  # fmt: skip
    workflow_gpu_module().report(result, a)
    return capsys.readouterr().out.splitlines()


def train_report(capsys, result: dict, gpus: int = 1) -> list[str]:
    """The lines workflow_gpu.report prints for a bf16 run of the whole DAG on ``gpus`` GPUs."""
    from types import SimpleNamespace

    a = SimpleNamespace(
        smoke=False, gpus=gpus, storage="bf16", jobs_per_gpu=1, compile="false", until=None,
        epochs=2, graph_step="auto",
    )  # fmt: skip
    workflow_gpu_module().report(result, a)
    return capsys.readouterr().out.splitlines()


SHARED_FP8 = "workflow.h200.extract.fp8.shared2.compiled"


@pytest.mark.parametrize(
    ("graphed", "peak", "note", "key"),
    [
        (True, {"allocated": 12 * 2**30, "reserved": 20.5 * 2**30},
         "step graphed; peak GPU memory 12.0 GiB allocated, 20.5 reserved |",
         "workflow.h200.train.peak_reserved_gib = 20.5"),
        (False, None, "step eager |", None),  # a CPU's summary: no peak
        (None, None, "step ? |", None),  # a summary written before graph_step was recorded
    ],
)  # fmt: skip
def test_workflow_gpu_reports_the_train_jobs_step_and_peak_memory(capsys, graphed, peak, note,
                                                                   key):  # fmt: skip
    """The train job's row says whether its step was graphed and its GPU's peak memory (the
    summary's gpu_memory_peak_bytes, in GiB), and a key gives the reserved peak."""

    train = {
        "tokens": 2_000_000, "tokens_per_s": 10_000.0, "wall_seconds": 200.0,
        "model_load_seconds": None, "loop_seconds": 150.0, "loop_tokens_per_s": 13_333.0,
        "steady_tokens_per_s": 20_000.0, "data_wait_fraction": 0.001,
        "graph_step": graphed, "gpu_memory_peak_bytes": peak,
    }  # fmt: skip
    result = {
        "machine": {"gpus": ["NVIDIA H200"]},
        "wall_seconds": 400.0,
        "workflow": {
            "jobs": {"extract-0": EXTRACT_JOB, "train": train},
            "extract_tokens": 1_800_000,
            "extract_window_seconds": 80.0,
        },
        "bench_extract": None,
    }
    out = train_report(capsys, result)
    (row,) = [line for line in out if line.startswith("| train |")]
    assert row.endswith(note), row
    peaks = [line for line in out if ".peak_reserved_gib = " in line]
    assert peaks == ([key] if key else []), peaks


def test_workflow_gpu_splits_the_train_jobs_loop_by_phase(capsys):
    """The train row and keys give the summary's phase_seconds and first_step_seconds: where a
    short job's time beside its steady steps goes (compiling, saves, validation)."""

    train = {
        "tokens": 1_450_000, "tokens_per_s": 7_500.0, "wall_seconds": 194.0,
        "model_load_seconds": None, "loop_seconds": 147.8, "loop_tokens_per_s": 9_817.0,
        "steady_tokens_per_s": 55_000.0, "data_wait_fraction": 0.003, "graph_step": True,
        "gpu_memory_peak_bytes": None, "first_step_seconds": 61.04, "compile_seconds": 48.26,
        "phase_seconds": {"best": 0.04, "saves": 21.46, "steps": 88.0, "validation": 30.0},
    }  # fmt: skip
    result = {
        "machine": {"gpus": ["NVIDIA H100 80GB HBM3"]},
        "wall_seconds": 356.0,
        "workflow": {"jobs": {"extract-0": EXTRACT_JOB, "train": train},
                     "extract_tokens": 1_800_000, "extract_window_seconds": 80.0},
        "bench_extract": None,
    }  # fmt: skip
    out = train_report(capsys, result)
    (row,) = [line for line in out if line.startswith("| train |")]
    assert row.endswith(
        "step graphed; steps 88.0 s (the first 61.0 s), saves 21.5 s, validation 30.0 s, "
        "marking the best epoch 0.0 s; torch.compile 48.3 s of it |"
    ), row
    keys = [line for line in out if line.startswith("workflow.h100.train.")]
    for key in ("first_step_seconds = 61.0", "compile_seconds = 48.3", "steps_seconds = 88.0", "saves_seconds = 21.5",
                "validation_seconds = 30.0", "best_seconds = 0.0"):  # fmt: skip
        assert f"workflow.h100.train.{key}" in keys, keys


def test_workflow_gpu_reports_the_train_job_run_again(capsys):
    """--gpus 2 --train-gpus 1 --rerun-train 1 2 1: each train job's keys are named after the
    GPUs it trained on; a rerun on as many GPUs as an earlier job takes .rerun (on a GPU,
    torch.compile's cache warm), the next .rerun2; the two-GPU job's scaling efficiency is its
    steady tokens/s against the first job's, both rank 0's own (the trainer's metrics)."""

    def train(wall, steady, processes, first_step):
        return {
            "tokens": 1_450_000, "tokens_per_s": 1_450_000 / wall, "wall_seconds": wall,
            "model_load_seconds": None, "loop_seconds": wall - 40, "loop_tokens_per_s": 9_000.0,
            "steady_tokens_per_s": steady, "data_wait_fraction": 0.002, "graph_step": processes == 1,
            "gpu_memory_peak_bytes": None, "first_step_seconds": first_step, "compile_seconds": 5.0,
            "phase_seconds": {"steps": 30.0}, "processes": processes,
        }  # fmt: skip

    result = {
        "machine": {"gpus": ["NVIDIA H200", "NVIDIA H200"]},
        "wall_seconds": 400.0,
        "workflow": {"jobs": {"extract-0": EXTRACT_JOB, "train": train(229.1, 56_000.0, 1, 106.5)},
                     "extract_tokens": 1_800_000, "extract_window_seconds": 80.0},
        "bench_extract": None,
        "reruns": [
            {"gpus": 1, "wall_seconds": 150.0, "train": train(145.0, 56_500.0, 1, 12.0)},
            {"gpus": 2, "wall_seconds": 160.0, "train": train(120.0, 50_400.0, 2, 20.0)},
            {"gpus": 1, "wall_seconds": 150.0, "train": train(146.0, 56_400.0, 1, 11.0)},
        ],
    }  # fmt: skip
    # as summary.json holds it, by name
    result["reruns"][0]["train"]["timeline"] = {
        "imported": 9.5,
        "loaders ready": 14.0,
        "started": 2.0,
    }
    out = train_report(capsys, result, gpus=2)
    rows = [line for line in out if line.startswith("| train again")]
    assert [row.split(" | ")[:3] for row in rows] == [
        ["| train again, train.gpus 1", "145.0", "10,000"],
        ["| train again, train.gpus 2", "120.0", "12,083"],
        ["| train again, train.gpus 1", "146.0", "9,932"],
    ], rows
    assert "steps 30.0 s (the first 12.0 s)" in rows[0] and "step eager" in rows[1], rows
    assert "steady 50,400/s per rank;" in rows[1] and "steady 56,500/s;" in rows[0], rows
    assert rows[0].endswith(
        "; process timeline {'started': 2.0, 'imported': 9.5, 'loaders ready': 14.0} |"
    ), rows[0]
    assert "process timeline" not in rows[1], rows[1]
    keys = dict(line.split(" = ") for line in out if ".train." in line)
    assert keys["workflow.h200.train.first_step_seconds"] == "106.5"
    assert keys["workflow.h200.train.rerun.first_step_seconds"] == "12.0"
    assert keys["workflow.h200.train.rerun.steady_tokens_per_s"] == "56500"
    assert keys["workflow.h200.train.rerun2.first_step_seconds"] == "11.0"
    assert keys["workflow.2xh200.train.steady_tokens_per_s"] == "50400"
    assert keys["workflow.2xh200.train.scaling_efficiency"] == "0.9"  # 50,400 / 56,000
    assert [k for k in keys if k.endswith("scaling_efficiency")] == [
        "workflow.2xh200.train.scaling_efficiency"
    ]


def test_workflow_gpu_leaves_room_for_the_training_states_the_job_keeps():
    """Without --tokens the shards take the disk but this: 24 GB for 2 epochs (what a 2-epoch
    run needed, 2026-12-05/06), and no more for further epochs: the train job keeps at most
    the newest state and the best one (train.keep_states: 1, the default)."""
    module = workflow_gpu_module()
    assert [module.disk_reserve(e) for e in (1, 2, 4)] == [19e9, 24e9, 24e9]


@pytest.mark.parametrize(
    ("names", "gpus", "tag"),
    [
        (["NVIDIA H200"], 1, "h200"),
        (["NVIDIA H100 80GB HBM3"], 1, "h100"),
        (["NVIDIA H200", "NVIDIA H200"], 2, "2xh200"),
        (["NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3"], 1, "h100"),  # one of two used
        (["NVIDIA H100 80GB HBM3", "NVIDIA H200"], 2, "2xgpu"),  # a mix
        (["NVIDIA A100-SXM4-80GB"], 1, "gpu"),
        ([], 1, "gpu"),
    ],
)
def test_workflow_gpu_names_its_keys_after_the_card_it_ran_on(names, gpus, tag):
    """An H100 run's figures must not land under h200 keys (a lent H200 may come as an H100)."""
    assert workflow_gpu_module().bench_extract.card_tag(names, gpus) == tag


def test_bench_keys_name_a_cpu_run_by_its_processes():
    """Without CUDA the device tag is cpu, with the count before it for several processes
    (bench/train.py's DDP runs, bench/extract.py's jobs)."""
    device_tag = workflow_gpu_module().bench_extract.device_tag
    assert [device_tag(), device_tag(1), device_tag(2)] == ["cpu", "cpu", "2xcpu"]


def test_workflow_gpu_compares_a_compiled_stage_with_the_isolated_rate_once_compiled(capsys):
    """With extract.compile the isolated run's own compiling is a fixed cost, not part of the
    rate a shared GPU sees: the stage (first lease to last release) and each job are compared
    with the isolated rate after compiling, under keys that say compiled and shared."""
    lines = shared_fp8_report(capsys, {"extract_window_seconds": 100.0}, bench_rate=40_000)
    ex = SHARED_FP8
    assert f"{ex}.aggregate_tokens_per_s = 36000" in lines
    assert f"{ex}.stage_vs_bench = 0.9" in lines
    assert f"{ex}.bench_tokens_per_s_after_compiling = 40000" in lines
    assert f"{ex}.job_vs_bench = 0.55" in lines  # the median job, 22,000 tokens/s
    assert not any(".gpu_turns" in line for line in lines)  # no turn spans: no such keys


def test_workflow_gpu_times_the_gpu_turns_of_jobs_sharing_a_gpu(capsys):
    """Jobs sharing a GPU: the stage splits into the time before the first GPU turn (start-up,
    load, compiling of the first jobs) and the turns from there to the last one's end."""
    workflow_gpu = workflow_gpu_module()
    extract = [
        {"start": 1000.0, "end": 1078.0, "turn_span": [1028.0, 1075.7]},
        {"start": 1000.5, "end": 1126.0, "turn_span": [1075.5, 1123.8]},
    ]
    before, turns = workflow_gpu.turns_window(extract)
    assert (round(before, 3), round(turns, 3)) == (28.0, 95.8)
    assert workflow_gpu.turns_window([extract[0], dict(extract[1], turn_span=None)]) is None
    stage = {"extract_window_seconds": 126.0, "extract_turns": (before, turns)}
    lines = shared_fp8_report(capsys, stage, bench_rate=36_000)
    ex = SHARED_FP8
    assert f"{ex}.first_turn_seconds = 28.0" in lines
    assert f"{ex}.gpu_turns_tokens_per_s = 37578" in lines  # 3.6 M tokens in 95.8 s
    assert f"{ex}.gpu_turns_vs_bench = 1.044" in lines
    assert f"{ex}.aggregate_tokens_per_s = 28571" in lines  # the whole stage, 126 s
    # two GPUs: each has its own turns, so one span over all jobs means nothing; no such keys
    lines = shared_fp8_report(capsys, stage, bench_rate=36_000, gpus=2)
    assert "workflow.2xh200.extract.fp8.shared2.compiled.aggregate_tokens_per_s = 28571" in lines
    assert not any("turn" in line for line in lines if line.startswith("workflow."))


def test_workflow_gpu_reads_the_turns_from_the_jobs_stats_and_gpu_records(tmp_path):
    """collect() takes each extract job's turn_span from the stats its log ends with and its
    lease from its GPU record (NVML's time); a job without a lease time (no NVML) gives none."""
    workflow_gpu = workflow_gpu_module()
    for d in ("benchmarks", "logs", "gpu"):
        (tmp_path / d).mkdir()
    jobs = {"extract-0": (1000.0, [1028.0, 1075.7]), "extract-1": (1000.5, [1075.5, 1123.8])}
    for name, (start, span) in jobs.items():
        (tmp_path / "benchmarks" / f"{name}.tsv").write_text("s\th:m:s\n77.9\t0:01:17\n")
        stats = {
            "tokens": 1_900_000, "seconds": 47.7, "tokens_per_s": 39_800.0,
            "write_seconds": 8.8, "stall_seconds": 0.3, "turn_span": span,
        }  # fmt: skip
        (tmp_path / "logs" / f"{name}.log").write_text(
            "extract: ...\n" + json.dumps(stats, indent=2)
        )
        gpu = {"before": {"time": start}, "after": {"time": span[1] + 2}, "devices": [0]}
        (tmp_path / "gpu" / f"{name}.json").write_text(json.dumps(gpu))
    before, turns = workflow_gpu.collect(tmp_path)["extract_turns"]
    assert (round(before, 3), round(turns, 3)) == (28.0, 95.8)
    (tmp_path / "gpu" / "extract-1.json").write_text(
        json.dumps({"before": {}, "after": {}, "devices": []})
    )
    assert workflow_gpu.collect(tmp_path)["extract_turns"] is None


def test_signal_race_finds_no_missed_sigterm_in_this_checkout():
    """bench/signal_race.py on this checkout: the wrapper, frozen, sent SIGTERM and thawed,
    exits every time (the blocking wait of e990173 missed it in 13 and 12 of 20)."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "signal_race.py"), "--trials", "3"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "signal_race.missed = 0\nsignal_race.trials = 3\n" in done.stdout


def test_same_training_with_muon_smoke(tmp_path):
    """--same-training with Muon on a CPU: speculators' trainer, ours and ours with twice the
    rate train the same batches; on a CPU both run torch's Muon in fp32, so ours is within the
    bf16 tolerance and the mutation outside it, under the Muon keys."""
    out = smoke(
        "train.py", "--profile-steps", "0", "--variants", "", "--same-training", "8",
        "--same-training-optimizer", "muon", "--out", str(tmp_path),
    )  # fmt: skip
    same = json.loads((tmp_path / "bench_train.json").read_text())["same_training"]
    assert same["optimizer"] == "muon"
    assert sorted(same["losses"]) == ["ours_muon", "ours_muon_lr2x", "speculators_muon_w0"]
    assert same["steps"] == 8
    assert same["ours_max_relative_difference"] <= same["tolerance"]
    assert same["lr2x_max_relative_difference"] > same["tolerance"]
    assert "train.cpu.same_training.muon.max_relative_difference = " in out
