"""Whole-workflow runs of the real Snakefile on the tiny verifier, and what reruns when.

The tests of this module run in order on one working directory: each starts from the state
the previous one left.
"""

import json
import re

import pytest
import tiny
from conftest import assert_same_bytes, executed_jobs, job_counts, run_snakemake

from eagle3lib.fileio import sha256_file
from eagle3lib.train import loss_curves, read_metrics

pytestmark = pytest.mark.slow

EXTRACT_RULES = {"verifier", "prepare", "extract"}


def verifier_replies(model, tokenizer, conversations: list[dict]) -> list[dict]:
    """The conversations' first user turns answered by the verifier's own greedy decoding (24
    tokens), as the regenerate rule would answer them: a draft trained on them can learn what
    the verifier says (on the random conversations it could learn nothing, and accepted
    nothing: acceptance length 1.0)."""
    from eagle3lib import data, evaluate

    eos = data.eos_ids(tokenizer.eos_token_id, model.generation_config.eos_token_id)
    out = []
    for record in conversations:
        user = record["conversations"][0]["value"]
        ids = data.prompt_token_ids(tokenizer, user)
        reply = tokenizer.decode(
            evaluate.greedy_reference(model, ids, 24, eos), skip_special_tokens=True
        ).strip()
        turns = [{"from": "human", "value": user}, {"from": "gpt", "value": reply or "ok"}]
        out.append({"id": record["id"], "conversations": turns})
    return out


@pytest.fixture(scope="module")
def ws(tmp_path_factory, verifier_dir, verifier_model, tokenizer):
    root = tmp_path_factory.mktemp("workflow")
    replies = verifier_replies(verifier_model, tokenizer, tiny.conversations(30, seed=7))
    # the 31st conversation asks an eval prompt inside a longer turn: prepare drops it
    leak = {
        "id": "leak",
        "conversations": [
            {"from": "human", "value": "One more thing: WHY is it fast? Thanks."},
            {"from": "gpt", "value": "It is fast because the draft is small."},
        ],
    }
    train = tiny.write_jsonl(root / "train.jsonl", [*replies, leak])
    prompts = [
        {"question_id": i, "turns": [t, "and then?"]}
        for i, t in enumerate(["Tell me about the model", "Write three numbers", "Why is it fast"])
    ]
    evals = tiny.write_jsonl(root / "eval.jsonl", prompts)

    class Workspace:
        dir = root
        results = root / "results" / "t"
        config = root / "config.yaml"
        overrides: dict = {}

        def write(self, **overrides):
            for key, value in overrides.items():
                self.overrides[key] = (
                    {**self.overrides.get(key, {}), **value} if isinstance(value, dict) else value
                )
            verifier = self.overrides.get("verifier_dir", verifier_dir)
            sections = {k: v for k, v in self.overrides.items() if k != "verifier_dir"}
            tiny.write_config(self.config, "t", verifier, train, evals, **sections)

        def run(self, *args, check=True):
            proc = run_snakemake(self.dir, self.config, *args, check=check)
            return proc.stdout + proc.stderr

    ws = Workspace()
    ws.write()
    return ws


def test_first_run_builds_checkpoint_and_report(ws):
    out = ws.run()
    counts = job_counts(out)
    assert counts["extract"] == 2 and counts["train"] == 1 and counts["evaluate"] == 1
    ckpt = ws.results / "checkpoint"
    assert (ckpt / "model.safetensors").stat().st_size > 0
    config = json.loads((ckpt / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == "tiny-llama"
    summary = json.loads((ws.results / "reports" / "summary.json").read_text())
    assert summary["k"] == 3 and len(summary["per_position_acceptance"]) == 3
    acceptance = json.loads((ws.results / "reports" / "acceptance.json").read_text())
    assert (
        summary["acceptance_length"]
        == acceptance["acceptance_length"]
        == pytest.approx(1 + acceptance["accepted_tokens"] / acceptance["steps"])
        == pytest.approx(1 + sum(summary["per_position_acceptance"]))
    )
    assert summary["checkpoint_valid"] is True and summary["text_matches_verifier"] is True
    assert set(summary["gpu_memory"]) == {"extract-0", "extract-1", "train", "evaluate"}
    for entry in summary["gpu_memory"].values():
        assert entry["available"] is False and entry["reason"].startswith("no NVIDIA device")
    assert summary["data"]["samples"] == 30 and summary["hidden_states"]["shards"] == 2
    assert summary["data"]["dropped"] == {"eval_prompt_overlap": 1}
    assert summary["data"]["eval_overlap"] == {
        "ngram": 8,
        "min_containment": 0.7,
        "dropped_per_eval_set": {"eval": 1},
    }
    markdown = (ws.results / "reports" / "summary.md").read_text()
    assert "| training conversations dropped as holding an eval prompt" in markdown
    assert "| eval 1 |" in markdown
    per_token = acceptance["per_token_accuracy"]
    assert len(per_token) == 3 and all(0 <= a <= 1 for a in per_token)
    val = summary["training"]["val"][-1]
    assert (
        "| draft accuracy per token of held-out training data (validation's full_acc) | "
        + ", ".join(f"{val[f'full_acc_{j}_epoch']:.3f}" for j in range(3))
        + " |"
    ) in markdown
    assert (
        "| draft accuracy per token of the eval text, teacher-forced (per TTT step) | "
        + ", ".join(f"{a:.3f}" for a in per_token)
        + " |"
    ) in markdown
    assert summary["min_acceptance_length"] == {}
    assert summary["valid"] is True and summary["problems"] == []
    assert "| valid | yes (no acceptance gate set) |" in markdown
    t = summary["training"]
    assert t["train_samples"] + t["val_samples"] == 30 and t["val_samples"] >= 1
    assert (
        f"| training | {t['epochs']} epochs on {t['train_samples']} samples ({t['val_samples']} "
        f"held out for validation), {' and '.join(t['optimizers'])}, float32 on cpu |"
    ) in markdown
    # the train job's time by phase, from its summary (on a CPU nothing compiles)
    assert f"| training time | {t['seconds']:.1f} s: steps " in markdown
    assert t["phase_seconds"]["steps"] > 0 and t["compile_seconds"] == 0.0, t
    # the job's process timeline (seconds since its process started), in order, each also
    # logged; the training itself between "loaders ready" and "training ended"
    steps = ["started", "imported", "shards opened", "draft built", "loaders ready",
             "training ended", "checkpoint exported", "model card written"]  # fmt: skip
    times = [t["timeline"][step] for step in steps]  # (summary.json sorts its keys)
    assert len(t["timeline"]) == len(steps) and times == sorted(times), t["timeline"]
    loop = t["timeline"]["training ended"] - t["timeline"]["loaders ready"]
    assert abs(loop - t["seconds"]) < 0.5, (t["seconds"], t["timeline"])
    log_text = (ws.results / "logs" / "train.log").read_text()
    assert f"train: model card written at {t['timeline']['model card written']:.1f} s" in log_text
    assert (ws.results / "reports" / "validation.txt").read_text().startswith("valid:")
    for png in ("acceptance.png", "loss.png"):
        assert (ws.results / "reports" / png).read_bytes()[:4] == b"\x89PNG"
    for rule in (
        "verifier",
        "prepare",
        "extract-0",
        "extract-1",
        "vocab",
        "train",
        "evaluate",
        "report",
    ):
        assert (ws.results / "logs" / f"{rule}.log").exists()
    assert not list(ws.results.rglob(".*.tmp-*"))
    # the train job's progress reaches the terminal; its log keeps all its output
    progress = re.findall(
        r"^train: step \d+/\d+ \(epoch 1/1\), [\d,]+ tokens/s, .* left"
        r"(?:; [\d,.]+ ms a step since the last line)?$",
        out,
        re.M,
    )
    assert progress and "about 0 s left; " in progress[-1], out
    assert progress[-1] in (ws.results / "logs" / "train.log").read_text()
    # rule prepare's threads (8, scaled to the run's 2 cores) reach it as OMP_NUM_THREADS
    assert "prepare: 2 tokenizing processes" in (ws.results / "logs/prepare.log").read_text()


def test_the_trained_draft_accepts_far_more_than_an_untrained_one(ws, verifier_model, tokenizer):
    """The workflow's acceptance against the same evaluation of an untrained draft (random
    init, the run's own vocab map and layers) on the same prompts: measured 3.45 (11 steps, 27
    accepted tokens) with train.packing: ffd, the default, against 1.0 at k = 3 on the 2-core
    CPU (2.5, 14 steps and 21 tokens, with speculators' multipack, the default before)."""
    import torch

    from eagle3lib import data, evaluate, train, vocab
    from eagle3lib.config import EvaluateConfig, TrainConfig
    from eagle3lib.conversations import read_eval_prompts
    from eagle3lib.verifier import read_record

    record = read_record(ws.results / "verifier" / "verifier.json")
    layers = json.loads((ws.results / "hidden_states" / "shard-0.json").read_text())["layer_ids"]
    maps = vocab.load(ws.results / "vocab" / "vocab_map.safetensors")
    torch.manual_seed(0)
    untrained = train.build_draft(
        TrainConfig(draft_vocab_size=256, total_seq_len=256), record, layers[:-1], maps, "sdpa"
    )
    prompts = read_eval_prompts(ws.dir / "eval.jsonl", 3)
    for prompt in prompts:
        prompt["token_ids"] = data.prompt_token_ids(tokenizer, prompt["text"])
    baseline = evaluate.evaluate(
        verifier_model,
        untrained.float(),
        tokenizer,
        [{"name": "eval", "prompts": prompts}],
        EvaluateConfig(k=3, max_new_tokens=12),
        layers[:-1],
        log=lambda m: None,
    )
    trained = json.loads((ws.results / "reports" / "acceptance.json").read_text())
    assert trained["prompts"] == baseline["prompts"] == 3
    assert baseline["acceptance_length"] < 1.25
    assert 3.0 <= trained["acceptance_length"] <= 3.9  # a band around the measured 3.45
    assert trained["acceptance_length"] >= baseline["acceptance_length"] + 1.0


def test_second_run_does_nothing(ws):
    out = ws.run()
    assert "Nothing to be done" in out
    assert job_counts(out) == {}


def test_changing_gpu_and_node_counts_reruns_nothing(ws, monkeypatch):
    """train.gpus and train.nodes are resources: the train job's command keeps its text and
    parameters. (train.nodes: 2 plans only under SLURM: here SLURM_JOB_ID is set, as inside
    an allocation, and the run is a dry run.)"""
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    ws.write(train={"gpus": 1, "nodes": 2})
    out = ws.run("-n")
    ws.write(train={"gpus": 0, "nodes": 1})
    assert "Nothing to be done" in out and job_counts(out) == {}, out


def test_newton_schulz_gram_reruns_nothing_and_standard_reruns_train(ws):
    """train.newton_schulz: gram, its default, leaves the train rule's parameters and stamp as
    runs before the key made them; standard (torch's iteration on a GPU) reruns train and what
    follows it. Dry runs: the results stay as they were."""
    stamp = ws.results / "checkpoint" / "provenance-train.json"
    assert "newton_schulz" not in stamp.read_text()
    ws.write(train={"newton_schulz": "gram"})
    gram = ws.run("-n")
    ws.write(train={"newton_schulz": "standard"})
    standard = ws.run("-n")
    ws.write(train={"newton_schulz": "gram"})
    assert "Nothing to be done" in gram and job_counts(gram) == {}, gram
    assert "train" in job_counts(standard) and "extract" not in job_counts(standard), standard
    assert "Nothing to be done" in ws.run("-n")


def test_graph_step_auto_reruns_nothing_and_true_or_false_rerun_train_only(ws):
    """train.graph_step: auto, its default, leaves the train rule's parameters as runs before
    the key made them; true or false reruns the train job (and what reads its checkpoint),
    never the extraction. Dry runs: the results stay as they were."""
    stamp = ws.results / "checkpoint" / "provenance-train.json"
    assert "graph_step" not in stamp.read_text()
    ws.write(train={"graph_step": "auto"})
    auto = ws.run("-n")
    ws.write(train={"graph_step": True})
    on = ws.run("-n")
    ws.write(train={"graph_step": False})
    off = ws.run("-n")
    ws.write(train={"graph_step": "auto"})
    assert "Nothing to be done" in auto and job_counts(auto) == {}, auto
    for run in (on, off):
        assert "train" in job_counts(run) and "extract" not in job_counts(run), run
    assert "Nothing to be done" in ws.run("-n")


def test_keep_states_reruns_nothing_and_reaches_the_train_command(ws):
    """train.keep_states sets how many epochs' states the train job leaves on the disk, not
    what it trains: any value reruns nothing (a resource, like loader_threads), and a forced
    train job's command carries it. Dry runs: the results stay as they were."""
    stamp = ws.results / "checkpoint" / "provenance-train.json"
    assert "keep_states" not in stamp.read_text()
    ws.write(train={"keep_states": 0})
    every = ws.run("-n")
    forced = ws.run("-n", "-p", "--forcerun", "train")
    ws.write(train={"keep_states": 1})
    assert "Nothing to be done" in every and job_counts(every) == {}, every
    assert " --keep-states 0 " in forced, forced
    assert " --keep-states 1 " in ws.run("-n", "-p", "--forcerun", "train")


def test_train_threads_count_the_loader_threads_or_the_dataloader_workers(ws):
    """The train job asks for its training thread and its loader threads per process, or with
    train.loader_workers one thread per worker process instead (they replace the threads).
    Both are resources: a changed count reruns nothing (the same batches), and a forced train
    job's command carries them. Dry runs: the results stay as they were."""
    stamp = ws.results / "checkpoint" / "provenance-train.json"
    assert "loader_workers" not in stamp.read_text()
    ws.write(train={"loader_threads": 1})
    threads = ws.run("-n", "-p", "--forcerun", "train", "--cores", "8")
    ws.write(train={"loader_threads": 1, "loader_workers": 4})
    unchanged = ws.run("-n")
    workers = ws.run("-n", "-p", "--forcerun", "train", "--cores", "8")
    for key in ("loader_threads", "loader_workers"):
        ws.overrides["train"].pop(key)
    ws.write()
    assert " --threads 2 --loader-threads 1 --loader-workers 0 " in threads, threads
    assert " --threads 5 --loader-threads 1 --loader-workers 4 " in workers, workers
    assert "Nothing to be done" in unchanged and job_counts(unchanged) == {}, unchanged
    assert "Nothing to be done" in ws.run("-n")


def test_dedupe_off_reruns_nothing_and_on_reruns_from_prepare(ws):
    """data.train.dedupe: false is how every run before the key was made (the rules' parameters
    leave it out); true changes the prepared samples, so prepare and what follows rerun. The
    dry runs leave the results as they were (the tests after this one copy them)."""
    train = {"path": str(ws.dir / "train.jsonl")}
    record = ws.results / "prepared" / "provenance-prepare.json"
    dated = record.stat().st_mtime_ns
    ws.write(data={"train": {**train, "dedupe": False}})
    off = ws.run("-n")
    ws.write(data={"train": {**train, "dedupe": True}})
    on = ws.run("-n")
    ws.write(data={"train": train})
    assert "Nothing to be done" in off and job_counts(off) == {}, off
    assert {"prepare", "extract", "train"} <= set(job_counts(on)), on
    assert "verifier" not in job_counts(on), on
    assert record.stat().st_mtime_ns == dated
    assert "Nothing to be done" in ws.run("-n")


def test_extra_train_files_join_the_data_and_none_reruns_nothing(ws, tmp_path):
    """data.extra_train: [] is how every run before the key was made (the rules' parameters
    leave it out); a file reruns prepare and what follows, and prepare spreads its samples
    among data.train's (a real run of prepare, in another folder)."""
    record = ws.results / "prepared" / "provenance-prepare.json"
    dated = record.stat().st_mtime_ns
    # what runs before the key recorded: prepare's parameters and stamp never name it
    assert "extra_train" not in record.read_text()
    extra = tiny.write_jsonl(tmp_path / "extra.jsonl", tiny.conversations(6, seed=9))
    ws.write(data={"extra_train": []})
    none = ws.run("-n")
    ws.write(data={"extra_train": [{"path": str(extra), "max_samples": 4}]})
    one = ws.run("-n")
    config = tmp_path / "config.yaml"
    config.write_text(ws.config.read_text())
    ws.overrides["data"].pop("extra_train")
    ws.write()
    assert "Nothing to be done" in none and job_counts(none) == {}, none
    assert {"prepare", "extract", "train"} <= set(job_counts(one)), one
    assert "verifier" not in job_counts(one), one
    assert record.stat().st_mtime_ns == dated
    assert "Nothing to be done" in ws.run("-n")

    run_snakemake(tmp_path, config, "results/t/prepared/samples.safetensors")
    info = json.loads((tmp_path / "results/t/prepared/samples.json").read_text())
    assert info["sources"] == [
        {"path": "train.jsonl", "records_read": 31, "samples": 30},  # the leak is dropped
        {"path": "extra.jsonl", "records_read": 4, "samples": 4},
    ]
    extras = [i for i in info["ids"] if i.startswith("extra_train[0]:")]
    assert extras == [f"extra_train[0]:c{i}" for i in range(4)]
    assert info["ids"].index("extra_train[0]:c3") == 29  # spread: at 7/8 of the 34 samples


ARTIFACTS = (
    "hidden_states/shard-0.safetensors",
    "hidden_states/shard-1.safetensors",
    "hidden_states/shard-0.json",
    "vocab/vocab_map.safetensors",
    "prepared/samples.safetensors",
    "checkpoint/model.safetensors",
    "checkpoint/config.json",
)


def test_clean_rebuild_gives_identical_bytes(ws, tmp_path):
    """Same config and seed on CPU, a clean working directory: the same bytes. Built up to the
    checkpoint, the last of the compared artifacts (what follows it reads them, and the first
    run's test checks it). The rebuild trains with a DataLoader worker process
    (train.loader_workers 1, a resource), the first run with the training process's loader
    threads: the same batches, so the same checkpoint."""
    import yaml

    settings = yaml.safe_load(ws.config.read_text())
    settings["train"]["loader_workers"] = 1
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(settings))
    proc = run_snakemake(tmp_path, config, "results/t/checkpoint/model.safetensors")
    counts = job_counts(proc.stdout + proc.stderr)
    assert counts.get("train") == 1 and counts.get("extract") == 2 and "evaluate" not in counts
    summaries = [
        json.loads((r / "train/summary.json").read_text())
        for r in (tmp_path / "results/t", ws.results)
    ]
    assert [s["batch_loading"]["loader_workers"] for s in summaries] == [1, 0], summaries
    # the worker processes were stopped with the training, none left for the wrapper to find
    record = json.loads((tmp_path / "results/t/gpu/train.json").read_text())
    assert record["stray_processes"] is False, record
    for artifact in ARTIFACTS:
        what = artifact
        if artifact.startswith("checkpoint/"):  # where training differed first, if it did
            rebuilt, first = (
                loss_curves(read_metrics(r / "train/state/metrics.jsonl"))
                for r in (tmp_path / "results/t", ws.results)
            )
            steps = [
                s
                for s, a, b in zip(
                    first["step"], rebuilt["train_loss"], first["train_loss"], strict=False
                )
                if a != b
            ]
            what += (
                f" (train losses of {len(rebuilt['step'])} and {len(first['step'])} steps;"
                f" first differing at step {steps[0] if steps else None})"
            )
        assert_same_bytes(tmp_path / "results/t" / artifact, ws.results / artifact, what)
    provenance = json.loads((tmp_path / "results/t/checkpoint/provenance-train.json").read_text())
    assert provenance["config"]["seed"] == 42 and provenance["verifier"]["name"] == "tiny-llama"
    assert provenance["packages"]["speculators"] == "0.9.0" and provenance["git"]["commit"]


def test_copied_results_are_not_rebuilt(ws, tmp_path):
    """Results copied elsewhere with their timestamps (cp -a, rsync -a) are up to date; copied
    without them, one `snakemake --touch` (documented) restores the order without rebuilding."""
    import os
    import random
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(ws.dir / "results", copy / "results", copy_function=shutil.copy2, symlinks=True)
    config = copy / "config.yaml"
    config.write_text(ws.config.read_text())
    out = run_snakemake(copy, config, "--dry-run").stdout
    assert "Nothing to be done" in out, out
    files = [p for p in (copy / "results").rglob("*") if p.is_file()]
    random.Random(0).shuffle(files)
    for i, p in enumerate(files):  # timestamps in a random order, as a careless copy leaves them
        os.utime(p, (1_700_000_000 + i, 1_700_000_000 + i))
    assert "Nothing to be done" not in run_snakemake(copy, config, "--dry-run").stdout
    sizes = {p: p.stat().st_size for p in files}
    run_snakemake(copy, config, "--touch")
    assert {p: p.stat().st_size for p in files} == sizes
    out = run_snakemake(copy, config, "--dry-run").stdout
    assert "Nothing to be done" in out, out


def test_a_moved_run_rebuilds_what_a_changed_config_makes_stale(ws, tmp_path):
    """The README's move (`cp -a`) takes no Snakemake metadata along. After a change of
    train.epochs the stamps in the provenance records still say what is stale: training and
    what follows it are rebuilt (also when only the checkpoint is asked for), nothing before."""
    import subprocess

    import yaml

    copy = tmp_path / "moved"
    copy.mkdir()
    subprocess.run(["cp", "-a", str(ws.dir / "results"), str(copy / "results")], check=True)
    config = yaml.safe_load(ws.config.read_text())
    epochs = config["train"]["epochs"]
    config["train"]["epochs"] = epochs + 1
    (copy / "config.yaml").write_text(yaml.safe_dump(config))
    results = copy / "results" / "t"
    record = results / "checkpoint" / "provenance-train.json"
    dated = record.stat().st_mtime_ns
    plan = run_snakemake(copy, copy / "config.yaml", "--dry-run")
    said = plan.stdout + plan.stderr
    assert f"(train.epochs: {epochs} -> {epochs + 1}); rebuilding train" in said, said
    assert record.stat().st_mtime_ns == dated  # the dry run put the record's time back
    assert set(job_counts(said)) == {
        "train", "check_checkpoint", "evaluate", "report", "validate", "all"
    }  # fmt: skip
    run_snakemake(copy, copy / "config.yaml", "results/t/checkpoint/model.safetensors")
    assert json.loads(record.read_text())["config"]["epochs"] == epochs + 1
    weights = "checkpoint/model.safetensors"
    # (their hashes: an equal pair would print both files whole)
    assert sha256_file(results / weights) != sha256_file(ws.results / weights)
    plan = run_snakemake(copy, copy / "config.yaml", "--dry-run")  # trained: what follows
    said = plan.stdout + plan.stderr
    assert "warning" not in said
    assert set(job_counts(said)) == {"check_checkpoint", "evaluate", "report", "validate", "all"}


def test_a_renamed_run_folder_refers_only_to_itself(ws, tmp_path):
    """results/t copied to results/t2 (and the config's run renamed): only the report, which
    names the run, is rebuilt, and no file of the new run folder names the old one."""
    import subprocess

    import yaml

    (tmp_path / "results").mkdir()
    subprocess.run(["cp", "-a", str(ws.results), str(tmp_path / "results" / "t2")], check=True)
    config = yaml.safe_load(ws.config.read_text())
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({**config, "run": "t2"}))
    done = run_snakemake(tmp_path, tmp_path / "config.yaml")
    assert set(job_counts(done.stdout + done.stderr)) == {"report", "validate", "all"}
    run = tmp_path / "results" / "t2"
    assert json.loads((run / "reports" / "summary.json").read_text())["run"] == "t2"
    naming_t = [
        str(p.relative_to(run))
        for p in run.rglob("*")
        if p.is_file() and "logs" not in p.parts and b"results/t/" in p.read_bytes()
    ]
    assert naming_t == []  # logs record what ran, where it ran


def test_html_report_has_the_dag_plots_and_tables(ws):
    """`snakemake --report` (and, where Debian's chromium is installed, it renders)."""
    import shutil
    import subprocess

    report = ws.dir / "report.html"
    run_snakemake(ws.dir, ws.config, "--report", str(report))
    html = report.read_text()
    for item in (
        "acceptance.png",
        "loss.png",
        "tables.html",
        "EAGLE-3 draft build",
        "check_checkpoint",
    ):
        assert item in html, item
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip(
            "chromium is not installed (Debian package chromium): the report's HTML was "
            "checked, not rendered in a browser"
        )
    shot = ws.dir / "report.png"
    subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={ws.dir / 'chromium'}",
            "--window-size=1400,1000",
            "--virtual-time-budget=8000",
            f"--screenshot={shot}",
            f"file://{report}",
        ],
        capture_output=True,
        timeout=120,
        check=True,
    )
    assert shot.read_bytes()[:4] == b"\x89PNG" and shot.stat().st_size > 30_000  # not a blank page


def test_a_setting_the_train_job_cannot_run_stops_the_run_before_any_job(ws):
    """Flex attention on a CPU train job (train.gpus: 0) is known to fail: the workflow stops
    when it plans, with one line, and runs nothing (it used to fail in the train job)."""
    ws.write(train={"attention": "simple_flex_attention"})
    proc = run_snakemake(ws.dir, ws.config, check=False)
    ws.write(train={"attention": "auto"})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Traceback" not in out
    assert [line for line in out.splitlines() if line.startswith("error: ")] == [
        "error: config key train.attention: flex attention has no backward pass on CPU "
        "(train.gpus: 0); use sdpa or eager (numerically equal) or auto, or set train.gpus"
    ]
    assert "rule train" not in out and "Job stats" not in out


def test_a_failing_train_job_shows_its_one_line_on_a_plain_snakemake_terminal(ws, tmp_path):
    """A job that fails (a shard whose bytes changed after it was built, same size, so only
    the train job's sha256 check can tell): a plain `snakemake`, with profiles/default as a
    user gets it, prints the job's one error line on the terminal, and keeps no checkpoint.
    In a copy of the run (cp -a), so the shared workspace stays built."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(ws.dir / "results", copy / "results", copy_function=shutil.copy2, symlinks=True)
    config = copy / "config.yaml"
    config.write_text(ws.config.read_text())
    results = copy / ws.results.relative_to(ws.dir)
    shard = results / "hidden_states" / "shard-0.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0xFF
    shard.write_bytes(bytes(raw))  # newer than the checkpoint: train reruns
    proc = run_snakemake(copy, config, check=False, workflow_profile=None)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Error in rule train" in out
    assert "Using workflow specific profile" in out and "Traceback" not in out
    [line] = [line for line in out.splitlines() if line.startswith("error: ")]
    assert line.startswith(f"error: {shard.relative_to(copy)}: content does not match")
    assert line.endswith("rerun the workflow to rebuild this shard")
    assert line in (results / "logs" / "train.log").read_text().splitlines()
    assert not (results / "checkpoint" / "model.safetensors").exists()


def test_acceptance_gate_fails_the_build_naming_set_k_and_both_numbers(ws):
    """validate.min_acceptance_length: a gate for a k that evaluate does not measure stops the
    run at planning; one above the draft's acceptance fails validate (only the report and
    validate rerun), naming the set, k, the measured and the required length."""
    ws.write(validate={"min_acceptance_length": {"eval": {4: 2.0}}})
    out = ws.run("--dry-run", check=False)
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert errors == [
        "error: config key validate.min_acceptance_length.eval.4: evaluate.k is 3, so no "
        "acceptance at k=4 is measured; gate a k that evaluate.k lists, or add 4 to it"
    ]
    assert "Traceback" not in out
    ws.write(validate={"min_acceptance_length": {"eval": {3: 3.99}}})
    try:
        out = ws.run(check=False)
        assert set(job_counts(out)) - {"all"} == {"report", "validate"}
        measured = json.loads((ws.results / "reports" / "summary.json").read_text())
        problem = (
            f"acceptance (eval k=3): acceptance length {measured['acceptance_length']:.4f} is "
            "below validate.min_acceptance_length 3.99"
        )
        assert measured["problems"] == [problem] and measured["valid"] is False
        log = (ws.results / "logs" / "validate.log").read_text()
        summary = ws.results.relative_to(ws.dir) / "reports" / "summary.json"
        assert f"error: {summary}: 1 problem(s): {problem}" in log
        assert not (ws.results / "reports" / "validation.txt").exists()
    finally:
        ws.write(validate={"min_acceptance_length": {"eval": {3: 1.0}}})  # passes: the next run


def test_changing_a_training_hyperparameter_retrains_without_extracting(ws):
    """Planned: training and what follows; run: up to the checkpoint (what follows it is what
    the first run's test checks)."""
    before = {p.name: p.stat().st_mtime_ns for p in (ws.results / "hidden_states").iterdir()}
    ws.write(train={"lr": 0.002})
    planned = job_counts(ws.run("--dry-run"))
    assert planned.get("train") == planned.get("evaluate") == planned.get("report") == 1, planned
    assert not EXTRACT_RULES & set(planned) and "vocab" not in planned, planned
    counts = job_counts(ws.run("results/t/checkpoint/model.safetensors"))
    assert counts.get("train") == 1 and not EXTRACT_RULES & set(counts), counts
    assert "vocab" not in counts
    after = {p.name: p.stat().st_mtime_ns for p in (ws.results / "hidden_states").iterdir()}
    assert after == before


def test_deleting_one_shard_rebuilds_that_shard_only(ws):
    """Planned: that shard, then training and what follows; run: up to the shards only."""
    shard1 = ws.results / "hidden_states" / "shard-1.safetensors"
    old_bytes = shard1.read_bytes()
    shard0_mtime = (ws.results / "hidden_states" / "shard-0.safetensors").stat().st_mtime_ns
    shard1.unlink()
    planned = job_counts(ws.run("--dry-run"))
    assert planned.get("extract") == 1 and planned.get("train") == 1, planned
    out = ws.run("--until", "extract")
    extracts = [j for j in executed_jobs(out) if j.startswith("extract")]
    assert extracts == ["extract[shard=1]"], executed_jobs(out)
    assert_same_bytes(shard1, old_bytes)  # deterministic on CPU
    assert (ws.results / "hidden_states" / "shard-0.safetensors").stat().st_mtime_ns == shard0_mtime


def test_extract_jobs_sharing_a_gpu_take_turns_and_write_the_same_bytes(ws, monkeypatch):
    """extract.jobs_per_gpu: 2 on one "GPU" (CUDA_VISIBLE_DEVICES=0 gives the locks a device;
    torch still computes on the CPU here): changing it reruns nothing; the two shard jobs ask
    snakemake for no GPU, lease device 0 (the workflow tells scripts/gpu_job.py through the
    environment), each waits for its turn at it, and the shards come out byte for byte as
    before."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    folder = ws.results / "hidden_states"
    before = {i: (folder / f"shard-{i}.safetensors").read_bytes() for i in (0, 1)}
    ws.write(extract={"gpus_per_job": 1, "jobs_per_gpu": 2})
    try:
        assert "extract" not in job_counts(ws.run("-n"))
        for i in (0, 1):
            (folder / f"shard-{i}.safetensors").unlink()
        # one thread a job: both run at once on the tests' two cores
        out = ws.run("--until", "extract", "--printshellcmds", "--set-threads", "extract=1")
        assert out.count("gpu_job.py --gpus 0 --rule extract") == 2, out  # snakemake's count
        held, turns = [], []
        for i in (0, 1):
            assert_same_bytes(folder / f"shard-{i}.safetensors", before[i])
            record = json.loads((ws.results / "gpu" / f"extract-{i}.json").read_text())
            assert record["shared_by"] == 2 and record["devices"] == [0], record
            held.append((record["started_at"], record["ended_at"]))
            log = (ws.results / "logs" / f"extract-{i}.log").read_text()
            assert "extract: GPU turn at" in log, log
            turns.append(json.loads(log[log.rindex("\n{") :])["turn_span"])
        (a, b), (c, d) = sorted(held)
        assert c < b, held  # both held the device at once
        (a, b), (c, d) = sorted(turns)
        assert b <= c, turns  # their turns at it did not overlap
    finally:
        ws.write(extract={"gpus_per_job": 0, "jobs_per_gpu": 1})
    assert "extract" not in job_counts(ws.run("-n"))  # (the newer shards retrain)


def test_changing_the_shard_count_reextracts(ws):
    """Planned: every shard, then training and what follows; run: up to the shards only (the
    rest of the DAG is what the tests above run)."""
    ws.write(extract={"shards": 3})
    planned = job_counts(ws.run("--dry-run"))
    assert planned.get("extract") == 3 and planned.get("train") == planned.get("evaluate") == 1
    counts = job_counts(ws.run("--until", "extract"))
    assert counts.get("extract") == 3 and "prepare" not in counts and "verifier" not in counts
    manifests = sorted((ws.results / "hidden_states").glob("shard-*.json"))
    assert [json.loads(m.read_text())["shards"] for m in manifests] == [3, 3, 3]


def test_changing_the_verifier_reextracts(ws, tmp_path_factory):
    other = tiny.build_verifier(tmp_path_factory.mktemp("other") / "tiny-llama-2", seed=1)
    ws.write(verifier_dir=other)
    out = ws.run("--dry-run")
    counts = job_counts(out)
    assert counts.get("verifier") == 1 and counts.get("prepare") == 1 and counts.get("extract") == 3
    assert counts.get("vocab") == counts.get("train") == 1
    ws.run("results/t/hidden_states/shard-0.json")  # the rest of the DAG: the tests above
    manifest = json.loads((ws.results / "hidden_states" / "shard-0.json").read_text())
    record = json.loads((ws.results / "verifier" / "verifier.json").read_text())
    assert record["path"] == str(other)
    assert manifest["verifier"]["weights_sha256"] == record["weights"]["sha256"]
