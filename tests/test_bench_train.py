"""bench/train.py's summary: which runs pair up and what the keys report."""

import importlib.util
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_train", ROOT / "bench" / "train.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_train"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def run(name, tokens_per_s, wait=None):
    return {"name": name, "tokens_per_s": tokens_per_s, "data_wait_fraction": wait}


def test_summary_pairs_ours_with_speculators_best_setting_and_reports_the_min(bench):
    results = []
    for k in range(3):  # three rounds, interleaved as --repeat 3 runs them
        results += [
            run("ours", [46000, 40000, 45000][k], 0.001),
            run("speculators_w0", 23000),
            run("speculators_w4", [26000, 25000, 27000][k]),
            run("speculators_w12", 25200),
            run("ours_muon", [30000, 31000, 29000][k]),
            run("speculators_cli", 15500),
            run("ours_muon_torch", [25000, 31000, 20000][k]),
            run("ours+contend", [44000, 43000, 45000][k], [0.01, 0.015, 0.012][k]),
        ]
    summary, lines = bench.summarize(results, "h200")
    assert summary["speculators_best"] == "speculators_w4"
    # ours and ours_muon pack as speculators does (multipack): their keys name it, and #16's
    # own keys, the workflow's default packing's (ffd), are not printed from them
    best = summary["multipack.speedup_vs_speculators"]
    assert best["pairs"] == [round(46000 / 26000, 3), 1.6, round(45000 / 27000, 3)]
    assert best["min"] == 1.6 and best["median"] == round(45000 / 27000, 3)
    assert "train.h200.multipack.speedup_vs_speculators = 1.600" in lines
    assert "train.h200.muon_multipack.speedup_vs_speculators_cli = 1.871" in lines  # 29000/15500
    assert "train.h200.multipack.tokens_per_s = 45000" in lines  # the median ours run
    assert "train.h200.multipack.contended.tokens_per_s = 44000" in lines
    assert "train.h200.multipack.contended.data_wait_fraction = 0.0150 (max)" in lines
    assert "train.h200.multipack.contended.vs_quiet = 0.978" in lines
    assert "train.h200.multipack.contended.vs_quiet_per_pair = 0.957" in lines  # 44000 / 46000
    assert not [line for line in lines if line.startswith(("train.h200.speedup_vs",
                "train.h200.muon.speedup", "train.h200.tokens_per_s", "train.h200.contended"))]  # fmt: skip
    batched = summary["batched_muon.speedup_vs_torch_muon"]
    assert batched["pairs"] == [1.2, 1.0, 1.45] and batched["against"] == "ours_muon_torch"
    assert "train.h200.batched_muon.speedup_vs_torch_muon = 1.000" in lines


def test_summary_pairs_the_default_packing_with_speculators_best_and_its_cli(bench):
    """ffd is the workflow's default packing: ours_ffd pairs with speculators' best setting of
    the call and ours_muon_ffd (the default recipe whole) with its CLI defaults."""
    results = []
    for k in range(3):
        results += [
            run("ours_ffd", [52000, 41600, 54000][k]) | {"window_fill": 0.94},
            run("speculators_w0", [26000, 23000, 24000][k]),
            run("speculators_w12", 25000),
            run("ours_muon_ffd", [31000, 29450, 33000][k]),
            run("speculators_cli", 15500),
        ]
    summary, lines = bench.summarize(results, "h200")
    assert summary["speculators_best"] == "speculators_w12"
    ffd = summary["ffd.speedup_vs_speculators"]
    assert ffd["pairs"] == [2.08, 1.664, 2.16] and ffd["against"] == "speculators_w12"
    assert "train.h200.ffd.speedup_vs_speculators = 1.664" in lines
    assert "train.h200.muon_ffd.speedup_vs_speculators_cli = 1.900" in lines  # 29450 / 15500
    assert "train.h200.muon_ffd.speedup_vs_speculators_cli.median = 2.000" in lines
    # #16's own keys are the default packing's: the same figures
    assert summary["speedup_vs_speculators"] == ffd
    assert "train.h200.speedup_vs_speculators = 1.664" in lines
    assert "train.h200.muon.speedup_vs_speculators_cli = 1.900" in lines
    assert "train.h200.tokens_per_s = 52000" in lines  # the median ours_ffd run
    assert "train.h200.ffd.tokens_per_s = 52000" in lines
    assert "multipack.speedup_vs_speculators" not in summary  # no plain ours run in this call


def test_pack_fill_is_the_default_packings_and_each_packing_has_its_own_key(bench):
    fills = {"multipack.2048": 0.7113, "ffd.2048": 0.9228, "multipack.8192": 0.9, "ffd.8192": 0.97}
    assert bench.pack_fill_lines(fills, "h200", 2048) == [
        "train.h200.pack_fill = 0.9228",  # ffd: train.packing's default
        "train.h200.ffd.pack_fill = 0.9228",
        "train.h200.multipack.pack_fill = 0.7113",
    ]
    assert bench.pack_fill_lines(fills, "h200", 8192)[0] == "train.h200.pack_fill = 0.9700"


def test_summary_compares_the_default_recipes_loaders_with_its_4_threads(bench):
    results = []
    for k in range(2):
        results += [
            run("ours_muon", [30000, 32000][k]),
            run("ours_muon_1loader", [33000, 32000][k]),
            run("ours_muon_workers", [27000, 35200][k]),
        ]
    summary, lines = bench.summarize(results, "h200")
    assert summary["muon.loader_1thread_vs_4threads"]["pairs"] == [1.1, 1.0]
    assert summary["muon.loader_workers_vs_threads"]["pairs"] == [0.9, 1.1]
    assert "train.h200.muon.loader_workers_vs_threads = 0.900" in lines
    assert "train.h200.muon.loader_workers_vs_threads.median = 1.000" in lines
    assert bench.VARIANTS["ours_muon_1loader"].loader_threads == 1
    assert bench.VARIANTS["ours_muon_workers"].workers is None  # --workers
    assert bench.VARIANTS["ours_muon_workers"].optimizer == "muon"


def test_contend_modifier_names_a_known_variant(bench):
    assert bench.variant("ours+contend") == bench.VARIANTS["ours"]
    assert bench.variant("speculators_cli").optimizer == "muon"
    assert bench.VARIANTS["ours_muon"].log_every == 10  # the workflow's default
    assert bench.VARIANTS["ours_muon"].batched_muon  # as the train stage runs on a GPU
    assert not bench.VARIANTS["ours_muon_torch"].batched_muon
    assert bench.VARIANTS["ours_muon_torch"].optimizer == "muon"


def test_compiled_newton_schulz_is_torchs_function_compiled_and_restored(bench):
    """The ours_muon_nscompiled experiment swaps torch's Newton-Schulz function for a compiled
    one inside the block only; the compiled one orthogonalises as torch's does (bf16; traced by
    dynamo and AOTAutograd here; inductor's code generation is left to the GPU run)."""
    import torch
    from torch.optim import _muon

    eager = _muon._zeropower_via_newtonschulz
    grad = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    args = ((3.4445, -4.775, 2.0315), 5, 1e-7)
    with bench.compiled_newton_schulz(True, backend="aot_eager"):  # no C++ build: seconds
        assert _muon._zeropower_via_newtonschulz is not eager
        compiled = _muon._zeropower_via_newtonschulz(grad, *args)
    assert _muon._zeropower_via_newtonschulz is eager
    with bench.compiled_newton_schulz(False):
        assert _muon._zeropower_via_newtonschulz is eager
    expected = eager(grad, *args)
    assert compiled.shape == expected.shape == (16, 8)
    torch.testing.assert_close(compiled.float(), expected.float(), rtol=0.02, atol=0.02)


def test_a_verifier_of_another_shape_is_not_reused(bench, tmp_path):
    """--out kept from a run of another --shape: the verifier is rebuilt, not reused."""
    import json

    small = dict(bench.TINY)
    path = bench.make_verifier(tmp_path / "verifier", small)
    first = (path / "model.safetensors").stat().st_mtime_ns
    assert bench.make_verifier(path, small) == path  # the same shape: reused as it is
    assert (path / "model.safetensors").stat().st_mtime_ns == first
    other = dict(small, vocab_size=small["vocab_size"] * 2)
    bench.make_verifier(path, other)
    assert json.loads((path / "config.json").read_text())["vocab_size"] == other["vocab_size"]


def test_a_timed_window_past_the_epoch_is_refused_naming_both_flags(bench):
    bench.check_window(batches=120, steps=120, samples=1000)  # ends on the epoch's last step
    with pytest.raises(SystemExit) as refused:
        bench.check_window(batches=119, steps=120, samples=1000)
    message = str(refused.value)
    assert "--steps 120" in message and "119 batches" in message
    assert "--samples 1000" in message and "raise --samples or lower --steps" in message


def test_summary_compares_kernel_launch_experiments_with_the_default_recipe(bench):
    """ours_muon_ffd_cg (CUDA graphs) and ours_muon_ffd_cppwrap pair with ours_muon_ffd; where
    the runs logged losses, each pair's largest relative loss difference is reported."""

    def logged(name, tokens_per_s, losses):
        return run(name, tokens_per_s) | {"loss_curve": {"train_loss": losses}}

    results = []
    for k in range(2):
        results += [
            logged("ours_muon_ffd", [20000, 21000][k], [4.0, 2.0, 1.0]),
            logged("ours_muon_ffd_cg", [30000, 31500][k], [4.0, 2.02, 1.0, 0.5][: 3 + k])
            | {"cudagraph_skips": [2, 0][k]},
            run("ours_muon_ffd_cppwrap", [22000, 21000][k]) | {"loss_curve": None},
        ]
    summary, lines = bench.summarize(results, "h200")
    cg = summary["cuda_graphs.speedup"]
    assert cg["pairs"] == [1.5, 1.5] and cg["against"] == "ours_muon_ffd"
    assert cg["max_loss_relative_difference"] == pytest.approx(0.01)  # 2.02 against 2.0
    assert "train.h200.cuda_graphs.speedup.max_loss_relative_difference = 0.01000" in lines
    assert "ours_muon_ffd_cg: compiled regions without CUDA graphs per run: [2, 0]" in lines
    wrap = summary["cpp_wrapper.speedup"]
    assert wrap["pairs"] == [1.1, 1.0] and "max_loss_relative_difference" not in wrap
    for name in ("ours_muon_ffd_cg", "ours_muon_ffd_cppwrap"):  # only how kernels launch differs
        other = bench.VARIANTS[name]
        assert (
            bench.dataclasses.replace(other, cuda_graphs=False, cpp_wrapper=False)
            == (bench.VARIANTS["ours_muon_ffd"])
        )


def test_summary_compares_gram_newton_schulz_with_torchs_iteration(bench):
    """ours_muon_ffd (train.newton_schulz: gram, the default) pairs with
    ours_muon_ffd_standard, which differs from it in that setting only; with losses logged,
    the largest relative difference between them is reported."""
    results = []
    for k in range(3):
        results += [
            run("ours_muon_ffd", [30000, 33000, 31000][k])
            | {"loss_curve": {"train_loss": [4.0, 2.1]}},
            run("ours_muon_ffd_standard", [25000, 30000, 31000][k])
            | {"loss_curve": {"train_loss": [4.0, 2.0]}},
        ]
    summary, lines = bench.summarize(results, "h200")
    gram = summary["gram.speedup_vs_standard"]
    assert gram["pairs"] == [1.2, 1.1, 1.0] and gram["against"] == "ours_muon_ffd_standard"
    assert "train.h200.gram.speedup_vs_standard = 1.000" in lines
    assert "train.h200.gram.speedup_vs_standard.median = 1.100" in lines
    assert gram["max_loss_relative_difference"] == pytest.approx(0.05)
    assert (
        bench.VARIANTS["ours_muon_ffd"].newton_schulz == "gram" == bench.TrainConfig.newton_schulz
    )
    assert (
        bench.dataclasses.replace(bench.VARIANTS["ours_muon_ffd_standard"], newton_schulz="gram")
        == (bench.VARIANTS["ours_muon_ffd"])
    )


def test_an_experiments_failure_is_noted_and_the_call_goes_on(bench):
    """A CUDA graphs or C++ wrapper run that fails on the GPU (a setting that may not work
    there) must not cost the call's other runs; any other variant's failure still ends it."""

    def fails():
        raise RuntimeError("CUDA graph capture failed\nmore detail")

    failures = []
    assert bench.run_or_note("ours_muon_ffd_cg", fails, failures) is None
    assert bench.run_or_note("ours_muon_ffd_cppwrap", lambda: {"tokens_per_s": 1}, failures) == {
        "tokens_per_s": 1
    }
    assert failures == [
        {
            "name": "ours_muon_ffd_cg",
            "error": "RuntimeError: CUDA graph capture failed\nmore detail",
        }
    ]
    with pytest.raises(RuntimeError, match="capture failed"):
        bench.run_or_note("ours_muon_ffd", fails, failures)
    assert [n for n, v in bench.VARIANTS.items() if v.experiment] == [
        "ours_muon_ffd_cg",
        "ours_muon_ffd_cppwrap",
        "ours_ffd_graph",
        "ours_muon_ffd_graph",
    ]


def test_scaling_efficiency_compares_each_variant_with_its_own_one_gpu_run(bench):
    """Under DDP each variant is set against its own one-GPU median (the default recipe
    against the default recipe), ours_nobcast and ours_muon_ffd_every_rank, which differ only
    under DDP, against ours and ours_muon_ffd; #16's own key is the default recipe's (the
    train rule's), ours (AdamW, multipack) takes multipack's name."""
    single = [run("ours", 50000), run("ours", 52000), run("ours_muon_ffd", 24000)]
    ddp = [run("ours", 90000), run("ours_nobcast", 96000), run("ours_muon_ffd", 45600),
           run("ours_muon_ffd_every_rank", 40800)]  # fmt: skip
    lines = bench.scaling_lines(ddp, single, 2, "2xh200")
    assert lines == [
        "train.2xh200.multipack.scaling_efficiency = 0.882",  # 90000 / (2 * 51000)
        "train.2xh200.nobcast.tokens_per_s = 96000",
        "train.2xh200.nobcast.scaling_efficiency = 0.941",
        "train.2xh200.muon_ffd.tokens_per_s = 45600",
        "train.2xh200.muon_ffd.scaling_efficiency = 0.950",  # 45600 / (2 * 24000)
        "train.2xh200.scaling_efficiency = 0.950",
        "train.2xh200.muon_ffd_every_rank.tokens_per_s = 40800",
        "train.2xh200.muon_ffd_every_rank.scaling_efficiency = 0.850",
    ]
    alone = bench.scaling_lines([run("ours_fp8", 80000)], single, 2, "2xh200")
    assert alone == ["no scaling efficiency for ours_fp8: --baseline has no one-GPU run of it"]


def test_summary_reports_the_default_packing_under_contention(bench):
    """ours_ffd+contend (the default packing with busy processes beside it) against quiet
    ours_ffd, as ours+contend against ours: tokens/s, the worst data wait, the ratio of the
    medians and the worst pair, under #16's own keys and under those naming ffd."""
    results = []
    for k in range(3):
        results += [
            run("ours_ffd", [57000, 58000, 56000][k], 0.001) | {"window_fill": 0.94},
            run("ours_ffd+contend", [51000, 57000, 55000][k], [0.02, 0.003, 0.001][k]),
        ]
    summary, lines = bench.summarize(results, "h200")
    for prefix in ("contended", "ffd.contended"):
        assert f"train.h200.{prefix}.tokens_per_s = 55000" in lines
        assert f"train.h200.{prefix}.data_wait_fraction = 0.0200 (max)" in lines
        assert f"train.h200.{prefix}.vs_quiet = 0.965" in lines  # 55000 / 57000
        assert summary[f"{prefix}.vs_quiet_per_pair"]["pairs"] == [0.895, 0.983, 0.982]
        assert f"train.h200.{prefix}.vs_quiet_per_pair = 0.895" in lines
    assert "multipack.contended" not in summary  # no ours+contend runs
    assert bench.packing_keys("muon.speedup_vs_speculators_cli", "multipack") == [
        "muon_multipack.speedup_vs_speculators_cli"
    ]


def test_every_queued_train_command_parses_and_names_known_variants(bench, capsys):
    """The device queues (bench/queues/*.txt, run by bench/gpu_queue.sh on a lent GPU machine)
    hold bench/train.py command lines: each parses, and each variant it names exists, so no
    device call is spent on a typo. A misspelt variant is refused."""
    import shlex

    commands, workflow = [], []
    for queue in sorted((ROOT / "bench" / "queues").glob("*.txt")):
        for line in queue.read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                words = shlex.split(line)
                if "bench/train.py" in words:
                    commands.append(words[words.index("bench/train.py") + 1 :])
                if "bench/workflow_gpu.py" in words:
                    workflow.append(words[words.index("bench/workflow_gpu.py") + 1 :])
    assert len(commands) >= 10 and len(workflow) >= 2
    spec = importlib.util.spec_from_file_location("workflow_gpu", ROOT / "bench/workflow_gpu.py")
    workflow_gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(workflow_gpu)
    for argv in workflow:  # bench/workflow_gpu.py's lines parse too
        assert workflow_gpu.parser().parse_args(argv).run
    with pytest.raises(SystemExit):
        workflow_gpu.parser().parse_args(["--graph-step", "--run", "x"])  # needs a value
    capsys.readouterr()
    for argv in commands:
        args, names = bench.parse_args(argv)
        assert args.out.startswith("/tmp/o/") and len(names) == len(set(names)) * args.repeat
    with pytest.raises(SystemExit):
        bench.parse_args(["--variants", "ours,ours_muon_fdd"])
    assert "--variants: unknown ours_muon_fdd; choose from ours," in capsys.readouterr().err


def test_summary_compares_muon_split_over_the_ranks_with_every_rank_computing_all(bench):
    """Under DDP the default recipe with Muon split over the ranks against every rank
    orthogonalising every matrix: the ratio per interleaved pair, its min and median."""
    results = [run("ours_muon_ffd", 52000), run("ours_muon_ffd_every_rank", 40000),
               run("ours_muon_ffd", 50000), run("ours_muon_ffd_every_rank", 41000)]  # fmt: skip
    summary, lines = bench.summarize(results, "2xh200")
    assert summary["muon_split.speedup_vs_every_rank"]["pairs"] == [1.3, 1.22]
    assert "train.2xh200.muon_split.speedup_vs_every_rank = 1.220" in lines
    assert "train.2xh200.muon_split.speedup_vs_every_rank.median = 1.260" in lines


def test_host_lead_is_the_gpu_work_queued_as_each_step_ends(bench):
    """The GPU finished step k's work gpu_ms[k] after the window's start and the host ended
    the step at host_ms[k]: the lead is their difference; its min and median are reported."""
    lead = bench.host_lead([10.0, 20.0, 30.0, 40.0], [45.0, 50.0, 30.5, 60.0])
    assert lead == {"steps": 4, "min": 0.5, "median": 30.0}
    assert bench.host_lead([], []) == {"steps": 0}
    with pytest.raises(ValueError):
        bench.host_lead([1.0, 2.0], [3.0])


def test_summary_compares_the_graphed_step_with_ours_ffd_under_its_own_keys(bench):
    """ours_ffd_graph (the step captured into a CUDA graph) pairs with ours_ffd, quiet and
    beside busy processes; its contended figures take graph_step.* keys, never #16's."""
    results = []
    for k in range(2):
        results += [
            run("ours_ffd", 50000, 0.001)
            | {"loss_curve": {"train_loss": [4.0, 2.0]}, "window_fill": 0.94},
            run("ours_ffd+contend", [20000, 40000][k], 0.001),
            run("ours_ffd_graph", [55000, 60000][k], 0.001)
            | {"loss_curve": {"train_loss": [4.0, 2.04]}},
            run("ours_ffd_graph+contend", [52250, 54000][k], 0.002),
        ]
    summary, lines = bench.summarize(results, "h100")
    assert summary["graph_step.speedup"]["pairs"] == [1.1, 1.2]
    assert summary["graph_step.speedup"]["max_loss_relative_difference"] == pytest.approx(0.02)
    assert summary["graph_step.contended.vs_quiet_per_pair"]["pairs"] == [0.95, 0.9]
    assert "train.h100.graph_step.contended.tokens_per_s = 53125" in lines
    assert summary["contended.vs_quiet_per_pair"]["pairs"] == [0.4, 0.8]  # ours_ffd's alone
    assert "train.h100.contended.tokens_per_s = 30000" in lines
    graph = bench.VARIANTS["ours_ffd_graph"]
    assert graph.experiment and bench.variant("ours_ffd_graph+contend") == graph
    assert bench.dataclasses.replace(graph, graph_step=False) == bench.VARIANTS["ours_ffd"]


def test_the_graphed_default_recipe_takes_its_own_keys_beside_the_eager_ones(bench):
    """ours_muon_ffd_graph pairs with ours_muon_ffd (losses too) and speculators_cli, and its
    contended runs with its quiet ones under graph_step.muon.*; ours_muon_ffd+contend takes
    muon.contended.*; AdamW's #16 keys (contended.*) stay absent without ours_ffd runs."""
    results = []
    for k in range(2):
        results += [
            run("ours_muon_ffd", 26000) | {"loss_curve": {"train_loss": [5.0, 4.0]}},
            run("ours_muon_ffd+contend", [13000, 19500][k], 0.001),
            run("ours_muon_ffd_graph", [28600, 31200][k])
            | {"loss_curve": {"train_loss": [5.0, 4.04]}},
            run("ours_muon_ffd_graph+contend", [28314, 31200][k], 0.003),
            run("speculators_cli", 13000),
        ]
    summary, lines = bench.summarize(results, "h200")
    assert summary["graph_step.muon.speedup"]["pairs"] == [1.1, 1.2]
    assert summary["graph_step.muon.speedup"]["max_loss_relative_difference"] == pytest.approx(0.01)
    assert "train.h200.graph_step.muon.speedup_vs_speculators_cli = 2.200" in lines
    assert summary["graph_step.muon.contended.vs_quiet_per_pair"]["pairs"] == [0.99, 1.0]
    assert "train.h200.graph_step.muon.contended.data_wait_fraction = 0.0030 (max)" in lines
    assert summary["muon.contended.vs_quiet_per_pair"]["pairs"] == [0.5, 0.75]
    assert "train.h200.muon.contended.tokens_per_s = 16250" in lines
    assert "contended" not in summary and "graph_step.contended" not in summary
    graph = bench.VARIANTS["ours_muon_ffd_graph"]
    assert graph.experiment
    assert bench.dataclasses.replace(graph, graph_step=False) == bench.VARIANTS["ours_muon_ffd"]


def test_the_graphed_adamw_step_pairs_with_speculators_best_under_graph_step_keys(bench):
    """ours_ffd_graph (the train job's step on one GPU) against speculators' best setting of
    the call: graph_step.speedup_vs_speculators and its median run's graph_step.tokens_per_s,
    beside ours_ffd's #16 keys, which keep the eager step's figures."""
    results = []
    for k in range(3):
        results += [
            run("ours_ffd", [50000, 48000, 52000][k], 0.001)
            | {"loss_curve": None, "window_fill": 0.94},
            run("ours_ffd_graph", [52000, 53000, 54000][k], [0.002, 0.004, 0.003][k])
            | {"loss_curve": None},
            run("speculators_w0", [26000, 25000, 27000][k]),
            run("speculators_w12", 20000),
        ]
    summary, lines = bench.summarize(results, "h100")
    assert summary["speculators_best"] == "speculators_w0"
    assert summary["graph_step.speedup_vs_speculators"]["pairs"] == [2.0, 2.12, 2.0]
    assert "train.h100.graph_step.speedup_vs_speculators = 2.000" in lines
    assert "train.h100.graph_step.tokens_per_s = 53000" in lines
    assert "train.h100.graph_step.data_wait_fraction = 0.0040" in lines
    assert "train.h100.tokens_per_s = 50000" in lines  # ours_ffd's (#16's key), eager
    assert summary["speedup_vs_speculators"]["pairs"] == [1.923, 1.92, 1.926]


def test_repeated_runs_of_a_step_report_how_far_their_losses_drift_apart(bench):
    """With --log-every and --repeat, each of ours_ffd's and ours_ffd_graph's later runs is
    compared with its first (the yardstick for the graphed step against the eager one); a
    variant with one logged run, or none, reports nothing."""
    results = []
    for k in range(3):
        results += [
            run("ours_ffd", 50000)
            | {"loss_curve": {"train_loss": [4.0, [2.0, 2.02, 1.99][k]]}, "window_fill": 0.94},
            run("ours_ffd_graph", 52000) | {"loss_curve": {"train_loss": [4.0, 2.0]}},
            run("ours_muon_ffd", 26000) | {"loss_curve": None if k else {"train_loss": [5.0]}},
        ]
    summary, lines = bench.summarize(results, "h100")
    assert summary["ours_ffd.repeat"]["runs"] == 3
    assert summary["ours_ffd.repeat"]["max_loss_relative_difference"] == pytest.approx(0.01)
    assert "train.h100.ours_ffd.repeat.max_loss_relative_difference = 0.01000" in lines
    assert summary["ours_ffd_graph.repeat"]["max_loss_relative_difference"] == 0.0
    assert "ours_muon_ffd.repeat" not in summary


def test_gpu_queue_runs_its_entries_and_brings_back_a_workflow_runs_logs_and_metrics(tmp_path):
    """bench/gpu_queue.sh's run and collect (start, which copies the tree and installs wheels,
    is for the GPU machine): every entry runs though one fails; after each, a run's shards and
    training state are deleted, its training metrics moved out first; collect packs each
    entry's log and exit status, an --out folder's bench_*.json files and profile tables
    (bench/train.py's profile-*.txt), and a workflow run's
    (--run RUN) logs, train summary and metrics, and workflow_gpu.py's JSON (its entry's only)."""
    import subprocess
    import tarfile

    repo, queue_dir, out = tmp_path / "repo", tmp_path / "gpuq", tmp_path / "out"
    repo.mkdir()
    queue_dir.mkdir()
    out.mkdir()
    bench_out = tmp_path / "o" / "b"
    make_run = (
        "r=results/wfx && mkdir -p $r/logs $r/train/state $r/hidden_states"
        " && echo train-log > $r/logs/train.log && echo '{}' > $r/train/summary.json"
        " && echo '{\"step\": 1}' > $r/train/state/metrics.jsonl"
        " && echo shard > $r/hidden_states/shard-0.safetensors"
        " && echo '{\"reruns\": []}' > $GPUQ_WORK/workflow_gpu.json"
    )
    (queue_dir / "queue").write_text(
        "# a comment\n"
        f"wf {make_run} && echo done  # --run wfx\n"
        f"broken false --out {tmp_path / 'o' / 'x'}\n"
        f"bench mkdir -p {bench_out} && echo '{{}}' > {bench_out}/bench_train.json"
        f" && echo t > {bench_out}/profile-ours.txt && echo s > {bench_out}/shard.bin"
        f" --out {bench_out}\n"
    )
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "profile.json").write_text("{}")  # not a bench_*.json: deleted
    (tmp_path / "work" / "verifier").mkdir(parents=True)  # workflow_gpu.py's: deleted
    env = dict(os.environ, GPUQ_DIR=str(queue_dir), GPUQ_REPO=str(repo),
               GPUQ_OUTS=str(tmp_path / "o"), GPUQ_WORK=str(tmp_path / "work"),
               OUT=str(out))  # fmt: skip
    script = str(ROOT / "bench" / "gpu_queue.sh")
    subprocess.run([script, "run"], env=env, check=True, timeout=60)
    waited = subprocess.run(
        [script, "wait", "1"], env=env, check=True, capture_output=True, text=True
    )
    assert [line.split(" after ")[0] for line in waited.stdout.splitlines()] == [
        "wf: exit 0", "broken: exit 1", "bench: exit 0",
    ]  # fmt: skip
    assert not (repo / "results/wfx/hidden_states").exists()
    assert not (repo / "results/wfx/train/state").exists()
    assert not (tmp_path / "o" / "profile.json").exists()
    assert not (tmp_path / "work" / "verifier").exists()
    assert (bench_out / "bench_train.json").exists()
    assert (bench_out / "profile-ours.txt").exists()
    assert not (bench_out / "shard.bin").exists()
    subprocess.run([script, "collect"], env=env, check=True, timeout=60)
    with tarfile.open(out / "results.tgz") as tar:
        names = {n.removeprefix("./") for n in tar.getnames()}
        metrics = tar.extractfile("./wf/run/metrics.jsonl").read()
    assert {
        "wf/wf.log", "wf/wf.rc", "wf/run/logs/train.log", "wf/run/summary.json",
        "wf/run/metrics.jsonl", "wf/wf.workflow_gpu.json", "broken/broken.rc",
        "bench/bench_train.json", "bench/profile-ours.txt",
    } <= names, names  # fmt: skip
    assert not [n for n in names if n.endswith("workflow_gpu.json") and not n.startswith("wf/")]
    assert metrics == b'{"step": 1}\n'
    assert not [n for n in names if "shard" in n or n.startswith("broken/bench_")], names
