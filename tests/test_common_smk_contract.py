"""What the planning helpers of rules/common.smk put on the jobs' command lines, and so what
reruns when (docs/workflow.md, "What reruns when"): Snakemake reruns a job whose parameters'
text changed, and planning reruns one whose stamp differs from its provenance record's.

Each test plans the whole workflow once (`snakemake -n -p --forceall`, a few seconds, no job
runs) and reads the jobs' parameters, stamps, resources and inputs off the printed blocks.
"""

from __future__ import annotations

import json
import re
import shlex
import sys

import pytest
import tiny
from conftest import run_snakemake

# The keys of a section its rule leaves out: resources, and defaults left out so that runs
# made before a key existed stay current (docs/workflow.md).
TRAIN_RESOURCES = {"gpus", "nodes", "loader_threads", "loader_workers", "keep_states"}


@pytest.fixture
def plan(tmp_path, verifier_dir, monkeypatch):
    """plan(**sections): the dry run's jobs as {rule: [job]}, each job a dict of its block's
    fields (input, resources, threads) and its command's options ({--flag: value}), with the
    config's sections merged into tests/tiny.py's."""
    monkeypatch.setenv("SLURM_JOB_ID", "1")  # train.nodes > 1 plans (as inside an allocation)
    train = tiny.write_jsonl(tmp_path / "train.jsonl", tiny.conversations(6, seed=3))
    evals = tiny.write_jsonl(tmp_path / "eval.jsonl", [{"question_id": 1, "turns": ["Hi"]}])
    second = tiny.write_jsonl(tmp_path / "eval2.jsonl", [{"question_id": 2, "turns": ["Why"]}])
    extra = tiny.write_jsonl(tmp_path / "extra.jsonl", tiny.conversations(3, seed=5))
    files = {"train": train, "eval": evals, "eval2": second, "extra": extra}

    def run(verifier=verifier_dir, **sections):
        config = tiny.write_config(
            tmp_path / "config.yaml", "t", verifier, train, evals, **sections
        )
        proc = run_snakemake(tmp_path, config, "-n", "-p", "--forceall", "--cores", "64")
        return parse_jobs(proc.stdout)

    run.files = files
    run.verifier = verifier_dir
    return run


def parse_jobs(output: str) -> dict[str, list[dict]]:
    jobs: dict[str, list[dict]] = {}
    for block in re.split(r"\n(?=(?:local)?rule \w+:)", output):
        m = re.match(r"(?:local)?rule (\w+):", block.strip())
        if not m:
            continue
        job = {}
        for field in ("input", "resources", "threads"):
            f = re.search(rf"^\s+{field}: (.+)$", block, re.MULTILINE)
            job[field] = f.group(1) if f else ""
        job["inputs"] = job["input"].split(", ")
        job["resources"] = dict(
            item.split("=", 1) for item in job["resources"].split(", ") if "=" in item
        )
        cmd = re.search(r"^Shell command: (.+)$", block, re.MULTILINE)
        job["options"] = options(cmd.group(1)) if cmd and cmd.group(1) != "None" else {}
        jobs.setdefault(m.group(1), []).append(job)
    return jobs


def options(command: str) -> dict[str, str]:
    """{--flag: its value(s), space-joined} of a command line (the gpu_job.py wrapper's
    options are overwritten by the job's own, which follow its `--`)."""
    words = shlex.split(command.split(" > ")[0])
    found, flag = {}, None
    for word in words:
        if word.startswith("--") and len(word) > 2:
            flag = word
            found[flag] = ""
        elif flag:
            found[flag] = f"{found[flag]} {word}".strip()
    return found


def param(job: dict, flag: str):
    return json.loads(job["options"][flag])


def stamp(job: dict) -> dict:
    return json.loads(job["options"]["--stamp"])


def one(jobs: dict, rule: str) -> dict:
    (job,) = jobs[rule]
    return job


# The resource settings of two plans that must give the same parameters and stamps.
RESOURCES_A = {
    "train": {"gpus": 2, "nodes": 1, "loader_threads": 2, "loader_workers": 3, "keep_states": 0},
    "extract": {"gpus_per_job": 2, "jobs_per_gpu": 1},
    "evaluate": {"gpus": 1},
    "regenerate": {"enabled": True, "gpus": 2, "workers": 2},
}
RESOURCES_B = {
    "train": {"gpus": 4, "nodes": 2, "loader_threads": 1, "loader_workers": 0, "keep_states": 2},
    "extract": {"gpus_per_job": 1, "jobs_per_gpu": 2},
    "evaluate": {"gpus": 0},
    "regenerate": {"enabled": True, "gpus": 0, "workers": 1},
}


def test_resources_change_no_parameter_or_stamp_and_reach_their_jobs(plan):
    """GPU counts, train.nodes, the loader's threads and workers, train.keep_states,
    extract.jobs_per_gpu and regenerate.workers are resources: two configs differing only in
    them give every job the same parameters and stamp (so they rerun nothing), while each job's
    resources and command carry its own values: on one node the train job asks for its GPUs
    as `gpu`, on several for none there and `gres` gpu:N per node, one srun task per node;
    its threads are (1 + loader threads, or 1 + workers) per GPU; extract jobs that share a
    GPU ask snakemake for none."""
    a, b = plan(**RESOURCES_A), plan(**RESOURCES_B)
    for rule in a:
        if rule == "all":
            continue
        for job_a, job_b in zip(a[rule], b[rule], strict=True):
            # the JSON parameters and the stamp
            for flag in (f for f, value in job_a["options"].items() if "{" in value):
                assert job_a["options"][flag] == job_b["options"][flag], (rule, flag)

    train_a, train_b = one(a, "train"), one(b, "train")
    assert train_a["resources"] | {"tmpdir": ""} == {
        "tmpdir": "", "nodes": "1", "node_gpus": "2", "loader_threads": "2",
        "loader_workers": "3", "keep_states": "0", "gpu": "2",
    }  # fmt: skip
    assert train_b["resources"] | {"tmpdir": ""} == {
        "tmpdir": "", "nodes": "2", "node_gpus": "4", "loader_threads": "1",
        "loader_workers": "0", "keep_states": "2", "gpu": "0", "mpi": "srun", "tasks": "2",
        "tasks_per_gpu": "0", "gres": "gpu:4",
    }  # fmt: skip
    assert train_a["threads"] == str(2 * (1 + 3)) and train_b["threads"] == str(4 * (1 + 1))
    for job, keep in ((train_a, "0"), (train_b, "2")):
        assert job["options"]["--keep-states"] == keep
        assert job["options"]["--node-gpus"] == job["resources"]["node_gpus"]
    assert {j["resources"]["gpu"] for j in a["extract"]} == {"2"}
    assert {j["resources"]["gpu"] for j in b["extract"]} == {"0"}  # shared: leases decide
    assert one(a, "regenerate")["resources"]["workers"] == "2"
    assert one(b, "regenerate")["options"]["--workers"] == "1"
    assert one(a, "evaluate")["resources"]["gpu"] == "1"

    cpu_only = plan(train={"gpus": 0, "nodes": 2, "loader_threads": 3})
    train = one(cpu_only, "train")
    assert "gres" not in train["resources"] and train["threads"] == "4"  # one process


def test_defaults_stay_out_of_the_parameters_and_other_values_go_in(plan):
    """Keys whose defaults runs made before them had are left out of the rules' parameters
    and stamps while at the default (compile off, regenerate.dtype auto, no synthetic prompts,
    train.newton_schulz gram, train.graph_step auto, data.train.dedupe off, no extra training
    files), and put in when set; the prepare job's data never holds the eval sets' names and
    prompt counts (evaluate's do), and the regeneration's data only train, max_length and
    on_invalid_record (and extra_train when given)."""
    evals = {"path": str(plan.files["eval"]), "max_prompts": 3}
    second = {"path": str(plan.files["eval2"]), "name": "second", "max_prompts": 1}
    train = {"path": str(plan.files["train"]), "max_samples": 5}
    defaults = plan(
        regenerate={"enabled": True},
        data={"train": train, "eval": evals, "extra_eval": [second], "max_length": 128},
    )
    regenerate = one(defaults, "regenerate")
    assert set(param(regenerate, "--regenerate")) == {
        "backend", "batch_size", "chunk_size", "concurrency", "kv_cache", "max_new_tokens",
        "max_turns", "seed", "temperature", "top_p",
    }  # fmt: skip
    assert param(regenerate, "--data") == {
        "max_length": 128,
        "on_invalid_record": "error",
        "train": {"allow_truncated_json": False, "max_samples": 5, "path": train["path"]},
    }
    assert stamp(regenerate)["config"]["regenerate"] == param(regenerate, "--regenerate")
    # an hf regeneration: no vLLM settings either, so that serve_check's vllm section (its
    # max_model_len, say) never reruns it
    assert regenerate["options"]["--vllm"] == "{}"
    assert regenerate["options"]["--vllm-python"] == "none"
    assert stamp(regenerate)["config"]["vllm"] == {}
    assert set(stamp(regenerate)["files"]) == {"data.train.path"}
    extract = defaults["extract"][0]
    assert "compile" not in param(extract, "--extract")
    assert "jobs_per_gpu" not in param(extract, "--extract")
    # an hf extraction: no vLLM settings, so that they never rerun it
    assert extract["options"]["--vllm"] == "{}" and extract["options"]["--vllm-python"] == "none"
    assert stamp(extract)["config"]["vllm"] == {}
    train_job = one(defaults, "train")
    assert not {"newton_schulz", "graph_step"} & set(param(train_job, "--train"))
    prepare = one(defaults, "prepare")
    data = param(prepare, "--data")
    assert data["eval"] == {"path": evals["path"]}
    assert data["extra_eval"] == [{"path": second["path"]}]
    assert "extra_train" not in data and "dedupe" not in data["train"]
    assert data["train"]["max_samples"] == 5  # one regenerated file, cut as data.train says
    assert set(stamp(prepare)["files"]) == {"data.eval.path", "data.extra_eval[0].path"}
    assert prepare["inputs"][1] == "results/t/regenerated/conversations.jsonl"
    assert one(defaults, "report")["options"]["--regenerated"] == (
        "results/t/regenerated/regenerate.json"
    )

    changed = plan(
        regenerate={
            "enabled": True, "compile": True, "dtype": "float32", "synthetic_prompts": 4,
            "synthetic_system_prompts": ["Be brief."],
        },
        extract={"compile": True},
        train={"newton_schulz": "standard", "graph_step": True},
        data={
            "train": {**train, "dedupe": True}, "eval": evals, "max_length": 128,
            "extra_train": [{"path": str(plan.files["extra"])}],
        },
    )  # fmt: skip
    regenerate = one(changed, "regenerate")
    section = param(regenerate, "--regenerate")
    assert section["compile"] is True and section["dtype"] == "float32"
    assert section["synthetic_prompts"] == 4
    assert section["synthetic_system_prompts"] == ["Be brief."]
    assert {"gpus", "workers", "enabled"}.isdisjoint(section)
    assert param(regenerate, "--data")["extra_train"] == [
        {"path": str(plan.files["extra"]), "max_samples": None, "allow_truncated_json": False}
    ]
    assert set(stamp(regenerate)["files"]) == {"data.train.path", "data.extra_train[0].path"}
    assert param(changed["extract"][0], "--extract")["compile"] is True
    section = param(one(changed, "train"), "--train")
    assert section["newton_schulz"] == "standard" and section["graph_step"] is True
    data = param(one(changed, "prepare"), "--data")
    # regenerated with extra files and synthetic prompts: that file is cut by nobody's cap
    assert data["train"]["max_samples"] is None and data["train"]["dedupe"] is True
    assert "extra_train" not in data  # the regenerated file holds them
    assert set(stamp(one(changed, "prepare"))["files"]) == {"data.eval.path"}

    synthetic_only = plan(
        regenerate={"enabled": True, "synthetic_prompts": 4},
        data={"train": train, "eval": evals, "max_length": 128},
    )
    regenerate = one(synthetic_only, "regenerate")
    section = param(regenerate, "--regenerate")
    assert section["synthetic_prompts"] == 4 and "synthetic_system_prompts" not in section
    # regenerated with synthetic prompts besides data.train's: that file is cut by no cap
    assert param(one(synthetic_only, "prepare"), "--data")["train"]["max_samples"] is None
    assert set(one(synthetic_only, "train")["inputs"]) >= {
        f"results/t/hidden_states/shard-{i}.safetensors" for i in range(2)
    }


def test_without_regeneration_prepare_reads_every_training_file_and_the_report_no_vllm(plan):
    """Without regeneration prepare reads data.train's and data.extra_train's files (inputs,
    stamped by their keys) and keeps their caps; without serve_check neither the report nor
    the default target asks for vLLM's acceptance, and the report reads the GPU records and
    benchmarks of the jobs that run, in the job table's order."""
    train = {"path": str(plan.files["train"]), "max_samples": 5}
    extra = {"path": str(plan.files["extra"]), "max_samples": 2}
    jobs = plan(
        data={
            "train": train, "eval": {"path": str(plan.files["eval"])}, "max_length": 128,
            "extra_train": [extra],
        },
        extract={"shards": 3},
    )  # fmt: skip
    assert "regenerate" not in jobs and "serve_check" not in jobs
    prepare = one(jobs, "prepare")
    assert prepare["options"]["--train"] == f"{train['path']} {extra['path']}"
    data = param(prepare, "--data")
    assert data["train"]["max_samples"] == 5
    assert data["extra_train"] == [{**extra, "allow_truncated_json": False}]
    assert set(stamp(prepare)["files"]) == {
        "data.train.path", "data.extra_train[0].path", "data.eval.path",
    }  # fmt: skip
    verifier = one(jobs, "verifier")  # a local folder: its config.json is an input, stamped
    assert str(plan.verifier / "config.json") in verifier["inputs"]
    assert set(stamp(verifier)["files"]) == {"verifier.path config.json"}
    # vocab: draft_vocab_size only, so that other train settings rerun no vocab job
    assert stamp(one(jobs, "vocab"))["config"] == {"train": {"draft_vocab_size": 256}}
    report = one(jobs, "report")["options"]
    assert report["--vllm-acceptance"] == "" and report["--regenerated"] == ""
    gpu = [f"extract-{i}" for i in range(3)] + ["train", "evaluate"]
    assert report["--gpu"].split() == [f"results/t/gpu/{n}.json" for n in gpu]
    bench = ["verifier", "prepare", *(f"extract-{i}" for i in range(3)), "vocab", "train"]
    assert report["--benchmarks"].split() == [
        f"results/t/benchmarks/{n}.tsv" for n in [*bench, "evaluate"]
    ]
    targets = one(jobs, "all")["inputs"]
    assert "results/t/reports/vllm_acceptance.json" not in targets
    for i in range(3):
        assert f"results/t/hidden_states/shard-{i}.safetensors" in targets
        assert f"results/t/hidden_states/shard-{i}.json" in targets


def test_evaluation_settings_reach_evaluate_and_serve_check_as_documented(plan):
    """evaluate gets every eval set (data.eval first, names and prompt counts) and stamps
    them; serve_check the first k, max_new_tokens, dtype and data.eval's path and prompt
    count; the report's gate normalised ({set: {"k": float}}, sorted); an hf extraction gets
    no vLLM settings, a vllm one (and a vllm regeneration) the section and its interpreter;
    the default target holds vLLM's acceptance when serve_check runs."""
    evals = {"path": str(plan.files["eval"]), "max_prompts": 3}
    second = {"path": str(plan.files["eval2"]), "name": "second", "max_prompts": 1}
    vllm = {"python": sys.executable, "startup_timeout": 60}
    jobs = plan(
        data={"train": {"path": str(plan.files["train"])}, "eval": evals,
              "extra_eval": [second], "max_length": 128},
        evaluate={"k": [2, 4], "max_new_tokens": 12, "dtype": "float32"},
        serve_check={"enabled": True},
        extract={"backend": "vllm", "dtype": "float32"},
        regenerate={"enabled": True, "backend": "vllm"},
        vllm=vllm,
        validate={"min_acceptance_length": {"second": {4: 1.5, 2: 1}, "eval": {"2": 1.2}}},
    )  # fmt: skip
    evaluate = one(jobs, "evaluate")
    sets = [
        {"name": "eval", "path": evals["path"], "max_prompts": 3},
        {"name": "second", "path": second["path"], "max_prompts": 1},
    ]
    assert param(evaluate, "--eval-sets") == sets
    assert stamp(evaluate)["config"]["eval_sets"] == {
        "data.eval": evals | {"name": "eval"}, "data.extra_eval[0]": second,
    }  # fmt: skip
    assert "gpus" not in param(evaluate, "--evaluate")
    serve = one(jobs, "serve_check")
    assert param(serve, "--evaluate") == {"k": 2, "max_new_tokens": 12, "dtype": "float32"}
    assert serve["options"]["--max-prompts"] == "3"
    assert stamp(serve)["config"]["data.eval"] == {"path": evals["path"], "max_prompts": 3}
    assert set(stamp(serve)["files"]) == {"data.eval.path"}
    gate = one(jobs, "report")["options"]["--min-acceptance-length"]  # its text: a parameter
    assert gate == '{"eval": {"2": 1.2}, "second": {"2": 1.0, "4": 1.5}}'
    extract = jobs["extract"][0]
    assert param(extract, "--vllm")["startup_timeout"] == 60
    assert extract["options"]["--vllm-python"] == sys.executable
    assert stamp(extract)["config"]["vllm"] == param(extract, "--vllm")
    regenerate = one(jobs, "regenerate")  # a vllm regeneration: the same section, stamped
    assert param(regenerate, "--vllm") == param(extract, "--vllm")
    assert regenerate["options"]["--vllm-python"] == sys.executable
    assert stamp(regenerate)["config"]["vllm"] == param(regenerate, "--vllm")
    assert "results/t/reports/vllm_acceptance.json" in one(jobs, "all")["inputs"]
    report = one(jobs, "report")["options"]
    assert report["--vllm-acceptance"] == "results/t/reports/vllm_acceptance.json"


def test_the_samples_prepare_made_count_only_while_they_are_current(plan, tmp_path):
    """extract.shards is checked against the samples a current prepare made (samples.json):
    more shards than those stops planning in one line; once the verifier is newer than the
    samples, or the config has changed what prepare makes, prepare runs again and its old
    count no longer counts. (A prepare that has run is faked: its record holds the stamp the
    plan printed.)"""
    import os

    from eagle3lib.provenance import sha256_json

    run = tmp_path / "results" / "t"
    current = stamp(one(plan(), "prepare"))
    for folder in ("verifier", "prepared"):
        (run / folder).mkdir(parents=True)
    (run / "verifier" / "verifier.json").write_text("{}")
    info = run / "prepared" / "samples.json"
    info.write_text(json.dumps({"samples": 1}))
    record = run / "prepared" / "provenance-prepare.json"
    record.write_text(json.dumps({"stamp": {**current, "sha256": sha256_json(current)}}))
    os.utime(run / "verifier" / "verifier.json", (1e9, 1e9))  # older than the samples

    def refusal(**sections):
        config = tiny.write_config(
            tmp_path / "config.yaml", "t", plan.verifier, plan.files["train"],
            plan.files["eval"], **sections,
        )  # fmt: skip
        proc = run_snakemake(tmp_path, config, "-n", check=False)
        return [line for line in proc.stderr.splitlines() if line.startswith("error:")]

    assert refusal() == [
        "error: config key extract.shards: 2 shards for the 1 samples prepare made leaves a "
        "shard empty; use at most 1 shards"
    ]
    assert refusal(data={"max_length": 64}) == []  # stale: prepare runs again
    os.utime(run / "verifier" / "verifier.json")  # a verifier newer than the samples
    assert refusal() == []
    # two eval sets of one name: their results would be mixed up in the report
    twice = {"path": str(plan.files["eval2"]), "name": "eval"}
    assert refusal(data={"extra_eval": [twice]}) == [
        "error: config key data.extra_eval[0].name: 'eval' is used twice; give each set its "
        "own name"
    ]


def test_with_regeneration_the_prepared_count_counts_only_while_regeneration_is_current(
    plan, tmp_path
):
    """With regeneration, prepare's stamp leaves out the training files (regenerate's holds
    them): the samples the old prepare made hold extract.shards only while regenerate's record
    is current and its conversations are older than the samples; a training file grown since
    (regenerate, then prepare, read it again), or conversations regenerated since (prepare
    reads them again), let planning go on. (Both jobs are faked: their records hold the
    stamps the plan printed.)"""
    import os

    from eagle3lib.provenance import sha256_json

    run = tmp_path / "results" / "t"
    regen = {"enabled": True}
    jobs = plan(regenerate=regen)
    for folder in ("verifier", "prepared", "regenerated"):
        (run / folder).mkdir(parents=True)
    for job, folder in (("prepare", "prepared"), ("regenerate", "regenerated")):
        current = stamp(one(jobs, job))
        record = run / folder / f"provenance-{job}.json"
        record.write_text(json.dumps({"stamp": {**current, "sha256": sha256_json(current)}}))
    (run / "verifier" / "verifier.json").write_text("{}")
    conversations = run / "regenerated" / "conversations.jsonl"
    conversations.write_text("")
    for older in (run / "verifier" / "verifier.json", conversations):
        os.utime(older, (1e9, 1e9))
    (run / "prepared" / "samples.json").write_text(json.dumps({"samples": 1}))

    def plan_errors():
        config = tiny.write_config(
            tmp_path / "config.yaml", "t", plan.verifier, plan.files["train"],
            plan.files["eval"], regenerate=regen,
        )  # fmt: skip
        proc = run_snakemake(tmp_path, config, "-n", check=False)
        return proc, [line for line in proc.stderr.splitlines() if line.startswith("error:")]

    _, errors = plan_errors()
    assert errors == [
        "error: config key extract.shards: 2 shards for the 1 samples prepare made leaves a "
        "shard empty; use at most 1 shards"
    ]
    os.utime(conversations)  # regenerated since the samples were made
    proc, errors = plan_errors()
    assert errors == [] and proc.returncode == 0, proc.stderr
    os.utime(conversations, (1e9, 1e9))
    tiny.write_jsonl(plan.files["train"], tiny.conversations(30, seed=3))  # grown
    proc, errors = plan_errors()
    assert errors == [] and proc.returncode == 0, proc.stderr
    assert "provenance-regenerate.json: made with other settings" in proc.stderr


# Catches: ~ left as written in any of the path settings (a data file "does not exist", a
# verifier folder taken for a hub id), or expanded only where one check reads it
def test_paths_starting_with_a_tilde_name_the_home_folder(plan, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "verifier").symlink_to(plan.verifier)
    python = tmp_path / "bin" / "python"
    jobs = plan(
        verifier="~/verifier",
        data={
            "train": {"path": "~/train.jsonl"}, "eval": {"path": "~/eval.jsonl"},
            "extra_train": [{"path": "~/extra.jsonl"}],
            "extra_eval": [{"name": "second", "path": "~/eval2.jsonl"}],
        },
        serve_check={"enabled": True}, vllm={"python": "~/bin/python"},
    )  # fmt: skip
    files = plan.files
    prepare = one(jobs, "prepare")["options"]
    assert prepare["--train"] == f"{files['train']} {files['extra']}"
    assert prepare["--eval"] == f"{files['eval']} {files['eval2']}"
    assert str(tmp_path / "verifier" / "config.json") in one(jobs, "verifier")["inputs"]
    assert param(one(jobs, "verifier"), "--verifier")["path"] == str(tmp_path / "verifier")
    assert str(python) in " ".join(one(jobs, "serve_check")["options"].values())
