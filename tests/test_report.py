"""The report's validation (eagle3lib/report.py problems_of): the acceptance regression gate
(validate.min_acceptance_length) and the agreement of vLLM's acceptance (serve_check) with the
offline evaluator's, on records built here; and the per-set leakage counts of the summary."""

import copy
import html
import re
import struct

import pytest

from eagle3lib import report, report_text
from eagle3lib.fileio import write_json
from eagle3lib.serve import compute_dtype


def offline_record():
    """reports/acceptance.json as evaluate writes it (headline: mtbench at k=3)."""
    results = [
        {"eval_set": "mtbench", "k": 3, "prompts": 80, "acceptance_length": 2.498,
         "per_position_acceptance": [0.676, 0.471, 0.351], "text_matches_verifier": None},
        {"eval_set": "mtbench", "k": 5, "prompts": 80, "acceptance_length": 2.854,
         "per_position_acceptance": [0.656, 0.441, 0.315, 0.244, 0.198],
         "text_matches_verifier": None},
        {"eval_set": "humaneval", "k": 3, "prompts": 164, "acceptance_length": 2.838,
         "per_position_acceptance": [0.771, 0.595, 0.472], "text_matches_verifier": None},
    ]  # fmt: skip
    return {**results[0], "method": "replay", "max_new_tokens": 256, "results": results}


def vllm_record(**changes):
    """reports/vllm_acceptance.json as serve_check writes it: here equal to the offline run."""
    record = {
        "k": 3, "prompts": 80, "max_new_tokens": 256, "drafts": 6972, "draft_tokens": 20916,
        "accepted_tokens": 10443, "acceptance_length": 2.498,
        "per_position_acceptance": [0.676, 0.471, 0.351], "text_matches_verifier": True,
        "mismatched_prompts": [], "serve_command": "vllm serve x", "vllm_version": "0.32.0",
    }  # fmt: skip
    return {**record, **changes}


def summary(vllm=None, gate=None, offline=None):
    offline = offline or offline_record()
    return {
        "checkpoint": {"problems": []},
        "gpu_memory": {},
        "acceptance_length": offline["acceptance_length"],
        "acceptance": offline,
        "vllm": report.vllm_summary(vllm, offline),
        "min_acceptance_length": gate or {},
    }


def test_a_build_that_agrees_and_passes_its_gate_is_valid():
    gate = {"mtbench": {"3": 2.398, "5": 2.754}, "humaneval": {"3": 2.738}}
    assert report.problems_of(summary(vllm_record(), gate)) == []
    v = report.vllm_summary(vllm_record(), offline_record())
    assert v["offline_vs_vllm_relative_difference"] == 0.0
    assert v["offline_vs_vllm_max_position_difference"] == 0.0


def test_the_gate_names_the_set_k_and_both_numbers():
    gate = {"mtbench": {"3": 2.5, "5": 2.754}, "humaneval": {"3": 2.9}}
    assert report.problems_of(summary(gate=gate)) == [
        "acceptance (mtbench k=3): acceptance length 2.4980 is below "
        "validate.min_acceptance_length 2.5",
        "acceptance (humaneval k=3): acceptance length 2.8380 is below "
        "validate.min_acceptance_length 2.9",
    ]
    [problem] = report.problems_of(summary(gate={"humaneval": {"5": 3.0}}))
    assert problem.startswith("acceptance (humaneval k=5): not measured")


@pytest.mark.parametrize("length", [0.5, 4.2])
def test_an_acceptance_length_no_decoding_gives_is_a_problem(length):
    """At k = 3 an acceptance length lies in [1, 4]; outside, the record was damaged or edited."""
    offline = offline_record()
    offline["results"][2]["acceptance_length"] = length
    assert report.problems_of(summary(offline=offline)) == [
        f"acceptance (humaneval k=3): acceptance length {length:.4f} is outside [1, 4], which "
        "no decoding gives: acceptance.json was damaged or edited; rerun evaluate (-R evaluate)"
    ]
    offline["results"][2]["acceptance_length"] = 4.0  # every draft token accepted: possible
    assert report.problems_of(summary(offline=offline)) == []


def test_a_checkpoint_marked_invalid_is_a_problem_even_without_one_named():
    s = summary()
    s["checkpoint_valid"] = False
    assert report.problems_of(s) == ["checkpoint: not valid, though no problem is recorded with it"]


def test_the_tolerances_pass_small_differences_and_catch_the_next_step():
    """3 % of the acceptance length and 0.05 of a position's rate: a vLLM run 2.9 % lower and
    0.049 lower at one position is valid; 3.1 % or 0.051 is not."""
    assert (report.VLLM_MAX_RELATIVE_DIFFERENCE, report.VLLM_MAX_POSITION_DIFFERENCE) == (
        0.03,
        0.05,
    )
    near = vllm_record(
        acceptance_length=2.498 / 1.029, per_position_acceptance=[0.676, 0.422, 0.351]
    )
    assert report.problems_of(summary(near)) == []
    [problem] = report.problems_of(summary(vllm_record(acceptance_length=2.498 / 1.031)))
    assert problem.startswith(
        "serve_check (k=3, 80 prompts): acceptance length offline 2.4980 vs vLLM 2.4229 differs "
        "by +3.1%, more than the 3% allowed"
    )
    [problem] = report.problems_of(
        summary(vllm_record(per_position_acceptance=[0.676, 0.420, 0.351]))
    )
    assert "differs by 0.051 at position 2, more than the 0.05 allowed" in problem


def test_a_draft_served_with_the_wrong_k_or_layers_is_flagged():
    # served with k=2 while evaluated at 3: nothing accepted at position 3, a shorter length
    wrong_k = vllm_record(acceptance_length=2.147, per_position_acceptance=[0.676, 0.471, 0.0])
    problems = report.problems_of(summary(wrong_k))
    assert len(problems) == 2
    assert "acceptance length offline 2.4980 vs vLLM 2.1470 differs by +16.3%" in problems[0]
    assert "differs by 0.351 at position 3" in problems[1]
    # served with a larger k: vLLM accepting more than the offline evaluator is flagged too
    # (the difference and each position's are compared by their absolute values)
    higher = vllm_record(acceptance_length=2.6, per_position_acceptance=[0.736, 0.471, 0.351])
    problems = report.problems_of(summary(higher))
    assert len(problems) == 2
    assert "acceptance length offline 2.4980 vs vLLM 2.6000 differs by -3.9%" in problems[0]
    assert "differs by 0.060 at position 1, more than the 0.05 allowed" in problems[1]
    # other aux layers: the draft's proposals are rarely accepted
    wrong_layers = vllm_record(acceptance_length=1.02, per_position_acceptance=[0.02, 0.0, 0.0])
    problems = report.problems_of(summary(wrong_layers))
    assert len(problems) == 2 and all("aux layers" in p for p in problems)
    # vLLM never ran the draft
    [problem] = report.problems_of(
        summary(vllm_record(drafts=0, acceptance_length=None, per_position_acceptance=[0.0] * 3))
    )
    assert problem.startswith("serve_check (k=3, 80 prompts): vLLM counted no draft step")


def test_records_of_another_k_or_prompt_count_do_not_compare():
    [problem] = report.problems_of(summary(vllm_record(k=5)))
    assert problem.startswith(
        "serve_check: vLLM measured k=5 on 80 prompts, the offline evaluator's headline k=3 on 80"
    )
    [problem] = report.problems_of(summary(vllm_record(prompts=6)))
    assert "on 6 prompts" in problem


def test_vllm_text_mismatch_is_still_a_problem():
    [problem] = report.problems_of(
        summary(vllm_record(text_matches_verifier=False, mismatched_prompts=[3]))
    )
    assert problem == (
        "serve_check: vLLM with the draft decoded 1 prompt(s) differently from vLLM without it"
    )


def test_eval_overlap_is_published_per_eval_set_name():
    prepare = {
        "samples": 9890,
        "dropped": {"eval_prompt_overlap": 1},
        "eval_overlap": {"ngram": 8, "min_containment": 0.7, "dropped_per_eval_file": [0, 1]},
    }
    data = report.data_summary(prepare, offline_record())
    assert data["eval_overlap"] == {
        "ngram": 8,
        "min_containment": 0.7,
        "dropped_per_eval_set": {"mtbench": 0, "humaneval": 1},
    }
    assert prepare["eval_overlap"]["dropped_per_eval_file"] == [0, 1]  # not changed in place
    [row] = report_text.overlap_row(data)
    assert row.endswith("(>= 70% of its word 8-grams) | mtbench 0, humaneval 1 |")
    deduped = report.data_summary(
        {**prepare, "dropped": {"eval_prompt_overlap": 1, "repeated_prompt": 875}},
        offline_record(),
    )
    assert report_text.overlap_row(deduped)[1] == (
        "| training conversations dropped as repeating a first prompt (dedupe) | 875 |"
    )
    assert report_text.sources_row(data) == []  # one training file
    sources = [{"path": "train.jsonl", "records_read": 31, "samples": 30},
               {"path": "extra.jsonl", "records_read": 4, "samples": 4}]  # fmt: skip
    assert report_text.sources_row({**data, "sources": sources}) == [
        "| training samples per file (of the records read) | train.jsonl 30 of 31, "
        "extra.jsonl 4 of 4 |"
    ]
    broken = copy.deepcopy(prepare)
    broken["eval_overlap"]["dropped_per_eval_file"] = [0, 1, 2]
    with pytest.raises(ValueError, match="with 3 eval file.*ran 2 eval set"):
        report.data_summary(broken, offline_record())


@pytest.mark.parametrize(
    ("engine", "evaluate", "cuda", "expected"),
    [
        (None, "auto", False, "float32"),
        (None, "auto", True, "bfloat16"),
        (None, "float32", True, "float32"),  # the SmolLM2 preset on a GPU: as evaluate
        ("float16", "float32", True, "float16"),  # vllm.dtype set: as given
    ],
)
def test_vllm_computes_in_the_offline_evaluators_dtype(engine, evaluate, cuda, expected):
    assert compute_dtype(engine, evaluate, cuda) == expected


def test_the_report_tabulates_acceptance_by_category_where_the_eval_set_has_them():
    def result(eval_set, k, categories=None):
        r = {"eval_set": eval_set, "k": k}
        return {**r, "by_category": categories} if categories else r

    def cat(prompts, length):
        return {"prompts": prompts, "steps": 100, "acceptance_length": length}

    results = [
        result("mtbench", 3, {"writing": cat(10, 2.5354), "math": cat(9, 2.51)}),
        result("mtbench", 5, {"writing": cat(10, 2.9), "math": cat(9, 3.0)}),
        result("humaneval", 3),
    ]
    summary = {"acceptance": {"results": results}}
    assert report_text.category_lines(summary) == [
        "## Acceptance length by category: mtbench (prompts per category in brackets)",
        "",
        "| k | writing (10) | math (9) |",
        "|---|---|---|",
        "| 3 | 2.535 | 2.510 |",
        "| 5 | 2.900 | 3.000 |",
        "",
    ]
    assert report_text.category_lines({"acceptance": {"results": results[2:]}}) == []


def test_the_acceptance_plot_adds_a_panel_of_categories_where_there_are_some(tmp_path):
    import struct

    from eagle3lib.report_plots import plot_acceptance

    def size(path):  # a PNG's width and height, from its IHDR chunk
        return struct.unpack(">II", path.read_bytes()[16:24])

    categories = {"writing": {"acceptance_length": 2.5}, "stem": {"acceptance_length": 2.4}}
    plot_acceptance([0.7, 0.5, 0.4], 3, tmp_path / "one.png")
    plot_acceptance([0.7, 0.5, 0.4], 3, tmp_path / "two.png", categories)
    assert size(tmp_path / "one.png") == (540, 360)  # 4.5 x 3 inches at 120 dpi
    assert size(tmp_path / "two.png") == (1200, 360)  # 10 x 3: the category panel beside it


def test_the_report_splits_the_training_time_by_phase():
    """summary.md's training time row: the train summary's seconds and phase_seconds, the first
    step inside the steps, what the phases leave, and torch.compile's time (none on a CPU,
    where nothing compiles); no row for a summary written before the phases were recorded."""
    training = {
        "seconds": 147.83, "first_step_seconds": 61.04, "compile_seconds": 48.26,
        "phase_seconds": {"best": 0.04, "saves": 21.46, "steps": 88.0, "validation": 30.0},
    }  # fmt: skip
    assert report_text.training_time_row(training) == [
        "| training time | 147.8 s: steps 88.0 s (the first 61.0 s), saves 21.5 s, validation "
        "30.0 s, marking the best epoch 0.0 s, set-up and the rest 8.3 s; torch.compile 48.3 s "
        "of it |"
    ]
    cpu = dict(training, compile_seconds=0.0, first_step_seconds=0.09)
    assert report_text.training_time(cpu) == (
        "steps 88.0 s (the first 0.1 s), saves 21.5 s, validation 30.0 s, marking the best "
        "epoch 0.0 s"
    )
    assert report_text.training_time_row({"seconds": 3.0}) == []


# ---- helpers: every stage's record as the report job reads them --------------------------


def reading(devices=None, pids=()):
    """An NVML reading as gpu.nvml_snapshot writes it ({index: used MiB}), or none on a host
    without NVIDIA devices (devices None)."""
    if devices is None:
        return {"available": False, "reason": "no NVIDIA device: NVML Shared Library Not Found"}
    return {
        "available": True,
        "device_count": 8,
        "devices": [
            {"index": i, "name": "NVIDIA H100 80GB HBM3", "used_mib": mib, "total_mib": 81559.0,
             "pids": list(pids)}
            for i, mib in devices.items()
        ],
    }  # fmt: skip


def gpu_job(rule, host, before, after, stray=False, **extra):
    """A gpu/<job>.json record of one host (gpu.run_job's)."""
    return {"rule": rule, "host": host, "gpus_requested": 1, "before": before, "after": after,
            "stray_processes": stray, "shared_by": 1, **extra}  # fmt: skip


def evaluated():
    """reports/acceptance.json: mtbench at k=3 (the headline, with categories) and 5, humaneval
    at 3; replayed, so no text check but an argmax agreement."""
    categories = {
        "writing": {"prompts": 10, "steps": 50, "acceptance_length": 2.61},
        "math": {"prompts": 9, "steps": 45, "acceptance_length": 2.2},
    }
    results = []
    for r, steps in zip(offline_record()["results"], (400, 350, 900), strict=True):
        results.append({**r, "steps": steps, "per_token_accuracy": [0.7, 0.5, 0.4, 0.3, 0.2][: r["k"]],
                        "out_of_draft_vocab": 0.0123, "argmax_agreement": 0.9987})  # fmt: skip
        if r["eval_set"] == "mtbench":
            results[-1]["by_category"] = categories
    return {**results[0], "method": "replay", "max_new_tokens": 256, "results": results,
            "per_prompt": [{"text": "Hello"}]}  # fmt: skip


def written(folder, records):
    """{job: path} of ``records`` ({job: gpu record}) written as folder/<job>.json."""
    paths = {job: folder / f"{job}.json" for job in records}
    for job, record in records.items():
        write_json(paths[job], record)
    return paths


def stage_records(tmp_path):
    """report.summarize's arguments for run `t`, its files written under tmp_path (which must
    be the working directory: disk_usage sizes results/t/)."""
    gpu = {
        "evaluate": gpu_job("evaluate", "gpu01", reading({0: 1000.0}), reading({0: 1100.0})),
        "extract-0": gpu_job("extract", "cpu01", reading(), reading()),
        "train": {
            "rule": "train", "nodes": 2, "hosts": ["gpu01", "gpu02"], "gpus_requested": 2,
            "stray_processes": False,
            "per_node": [
                gpu_job("train", "gpu01", reading({0: 500.0, 1: 500.0}), reading({0: 520.0, 1: 510.0})),
                gpu_job("train", "gpu02", reading({0: 0.0}), reading({0: 10.0})),
            ],
        },
    }  # fmt: skip
    gpu_records = written(tmp_path / "gpu", gpu)
    header = "s\th:m:s\tmax_rss\n"
    tsv = {"extract-0": header + "11.111\t0:00:11\t1\n12.3456\t0:00:12\t1\n",  # repeated: the last
           "evaluate": header + "3\t0:00:03\t1\n", "train": header}  # fmt: skip
    benchmarks = {}
    for job, text in tsv.items():
        benchmarks[job] = tmp_path / "benchmarks" / f"{job}.tsv"
        benchmarks[job].parent.mkdir(parents=True, exist_ok=True)
        benchmarks[job].write_text(text)
    run = tmp_path / "results" / "t"
    (run / "train" / "state").mkdir(parents=True, exist_ok=True)
    (run / "train" / "state" / "a.bin").write_bytes(b"x" * 1500)
    (run / "train" / "summary.json").write_bytes(b"x" * 500)
    (run / "checkpoint").mkdir(exist_ok=True)
    with open(run / "checkpoint" / "model.safetensors", "wb") as fh:
        fh.truncate(2_500_000)
    provenance = [
        {"job": "train", "config_sha256": "ab" * 32, "git": None, "packages": {"torch": "2.9"},
         "verifier": "tiny-llama", "seed": 0, "host": "cpu01", "gpus": [], "extra": 1},
        {"job": "evaluate", "config_sha256": "cd" * 32,
         "git": {"commit": "0123456789abcdef", "dirty": True}, "packages": {"torch": "2.9"},
         "verifier": "tiny-llama", "seed": 7, "host": "gpu01", "gpus": ["0"]},
    ]  # fmt: skip
    return dict(
        run="t",
        verifier={"name": "tiny-llama", "path": "/models/tiny-llama", "num_hidden_layers": 4,
                  "hidden_size": 64, "vocab_size": 512, "torch_dtype": "float32"},
        prepare={"records_read": 40, "samples": 30, "truncated": 3,
                 "dropped": {"eval_prompt_overlap": 1, "too_long": 4, "repeated_prompt": 0},
                 "eval_overlap": {"ngram": 8, "min_containment": 0.7,
                                  "dropped_per_eval_file": [1, 0]}},
        manifests=[
            {"tokens": 1200, "file": {"bytes": 1_234_567}, "layer_ids": [1, 2, 3], "rejected": ["s7"]},
            {"tokens": 800, "file": {"bytes": 765_433}, "layer_ids": [1, 2, 3], "rejected": []},
        ],
        vocab={"draft_vocab_size": 256, "token_coverage": 0.98765},
        training={"epochs": 2, "train_samples": 27, "val_samples": 3, "optimizers": ["adamw", "muon"],
                  "dtype": "float32", "device": "cpu", "seconds": 20.0, "first_step_seconds": 4.0,
                  "compile_seconds": 0.0,
                  "phase_seconds": {"steps": 12.0, "saves": 2.0, "validation": 3.0, "best": 0.5,
                                    "export": 1.5},
                  "val": [{"full_acc_0_epoch": 0.1, "full_acc_1_epoch": 0.05, "full_acc_2_epoch": 0.0},
                          {"full_acc_0_epoch": 0.6, "full_acc_1_epoch": 0.4, "full_acc_2_epoch": 0.25}]},
        checkpoint={"valid": True, "problems": [], "verifier": "tiny-llama",
                    "aux_layer_ids": [1, 2, 3], "draft_vocab_size": 256, "tensors": 12},
        acceptance=evaluated(),
        gpu_records=gpu_records,
        benchmarks=benchmarks,
        provenance=provenance,
        vllm=vllm_record(acceptance_length=2.478, per_position_acceptance=[0.676, 0.461, 0.341]),
        regenerated=None,
        min_acceptance_length=None,  # `validate.min_acceptance_length: null`
    )  # fmt: skip


def built(tmp_path, monkeypatch, **changes):
    """The summary of stage_records (with ``changes``), built in tmp_path."""
    monkeypatch.chdir(tmp_path)
    return report.summarize(**{**stage_records(tmp_path), **changes})


def html_table(page, title):
    """The rows (header first) of tables.html's table under the heading ``title``, each cell's
    text unescaped."""
    table = re.search(f"<h3>{re.escape(title)}</h3><table>(.*?)</table>", page).group(1)
    return [
        [html.unescape(c) for c in re.findall(r"<t[hd]>(.*?)</t[hd]>", row)]
        for row in re.findall(r"<tr>(.*?)</tr>", table)
    ]


# ---- summary.json ----------------------------------------------------------------------------


# Catches: reports/ sized by the report job before it writes its own files there
def test_disk_usage_sizes_the_stage_folders_but_the_reports(tmp_path):
    for folder, size in (("hidden_states", 300), ("checkpoint", 20), ("reports", 7)):
        (tmp_path / "t" / folder / "sub").mkdir(parents=True)
        (tmp_path / "t" / folder / "sub" / "f").write_bytes(b"x" * size)
    assert report.disk_usage("t", tmp_path) == {"hidden_states": 300, "checkpoint": 20}


# Catches: the summary's text check taken from the headline result alone (another set or k
# that decoded differently then read True in summary.md while validate failed)
def test_the_text_check_spans_every_eval_set_and_k():
    def acceptance(*found):
        rows = [{"text_matches_verifier": f} for f in found]
        return {"text_matches_verifier": found[0], "results": rows}

    assert report.text_matches_verifier(acceptance(True, True, False)) is False
    assert report.text_matches_verifier(acceptance(True, True)) is True
    assert report.text_matches_verifier(acceptance(None, None)) is None
    assert report.text_matches_verifier({"text_matches_verifier": True}) is True  # no results


# Catches: summarize dropping or filling a field (per_position_acceptance from another key,
# disk_bytes/seconds_per_job empty, min_acceptance_length None instead of {}, valid always
# True, acceptance keeping per_prompt, checkpoint without draft_vocab_size, verifier flags
# defaulting True); hidden_states_summary's sums (tokens of the first shard only, shards
# counted as rejected samples, another default state dtype); benchmark_seconds taking the first
# row, rounding to 1 digit, or failing on a TSV of no row; disk_usage counting directories,
# not recursing, or listing stages that have no folder; provenance_table unsorted or without
# seed; vllm_summary without serve_command, taking the smallest position difference.
def test_summarize_gathers_every_stage_record(tmp_path, monkeypatch):
    s = built(tmp_path, monkeypatch)
    assert s["verifier"] == {
        "name": "tiny-llama", "path": "/models/tiny-llama", "num_hidden_layers": 4,
        "hidden_size": 64, "vocab_size": 512, "trust_remote_code": False, "custom_code": False,
    }  # fmt: skip
    assert (s["k"], s["acceptance_length"]) == (3, 2.498)
    assert s["per_position_acceptance"] == [0.676, 0.471, 0.351]
    assert s["text_matches_verifier"] is None and s["checkpoint_valid"] is True
    assert "per_prompt" not in s["acceptance"] and s["acceptance"]["method"] == "replay"
    assert len(s["acceptance"]["results"]) == 3
    assert s["checkpoint"] == {"valid": True, "problems": [], "verifier": "tiny-llama",
                               "aux_layer_ids": [1, 2, 3], "draft_vocab_size": 256}  # fmt: skip
    assert s["data"]["eval_overlap"]["dropped_per_eval_set"] == {"mtbench": 1, "humaneval": 0}
    assert s["hidden_states"] == {"shards": 2, "tokens": 2000, "bytes": 2_000_000,
                                  "layer_ids": [1, 2, 3], "state_dtype": "bfloat16",
                                  "rejected_samples": 1}  # fmt: skip
    assert s["seconds_per_job"] == {"evaluate": 3.0, "extract-0": 12.35}  # train's TSV: no row
    assert s["disk_bytes"] == {"train": 2000, "checkpoint": 2_500_000}
    assert list(s["provenance"]) == ["evaluate", "train"]
    assert s["provenance"]["train"] == {
        "config_sha256": "ab" * 32, "git": None, "packages": {"torch": "2.9"},
        "verifier": "tiny-llama", "seed": 0, "host": "cpu01", "gpus": [],
    }  # fmt: skip
    assert s["vllm"] == {
        "k": 3, "prompts": 80, "acceptance_length": 2.478,
        "per_position_acceptance": [0.676, 0.461, 0.341], "drafts": 6972,
        "text_matches_verifier": True, "mismatched_prompts": [], "serve_command": "vllm serve x",
        "vllm_version": "0.32.0",
        "offline_vs_vllm_relative_difference": pytest.approx(2.498 / 2.478 - 1),
        "offline_vs_vllm_max_position_difference": pytest.approx(0.010),
    }  # fmt: skip
    assert s["regenerated"] is None
    assert s["min_acceptance_length"] == {}  # documented: {} when there is no gate
    assert s["problems"] == [] and s["valid"] is True


# Catches: problems_of without the checkpoint's problems, the GPU jobs' problems or the
# headline's "no verifier step"; gpu_problems without stray processes; gpu_memory_entry
# dropping a job's stray_processes; gpu_memory_table not marking node 0 of a job over several
# nodes whose srun step left processes; summary["valid"] always True; summary.md without its
# Problems section; tables.html not escaping a cell.
def test_every_problem_of_a_build_is_named_and_makes_it_invalid(tmp_path, monkeypatch):
    stray = gpu_job("evaluate", "gpu01", reading({0: 1000.0}), reading({0: 1100.0}), stray=True)
    leaky = gpu_job("train", "gpu02", reading({0: 100.0}), reading({0: 900.0}, pids=[4242]))
    train = {
        "rule": "train",
        "gpus_requested": 2,
        "stray_processes": True,  # srun's leftovers
        "per_node": [gpu_job("train", "gpu01", reading({0: 0.0}), reading({0: 0.0})), leaky],
    }
    gpu_records = written(tmp_path / "gpu-bad", {"evaluate": stray, "train": train})
    acceptance = evaluated()
    acceptance["results"][0].update(acceptance_length=None, steps=0)
    acceptance.update(acceptance_length=None, steps=0)
    problem = "tensor d2t has 255 entries, not the draft vocab size <256>"
    s = built(tmp_path, monkeypatch, acceptance=acceptance, gpu_records=gpu_records,
              checkpoint={"valid": False, "problems": [problem]})  # fmt: skip
    assert s["problems"] == [
        f"checkpoint: {problem}",
        "evaluate on gpu01: left processes running after it finished",
        "train node 0 on gpu01: left processes running after it finished",
        "train node 1 on gpu02: GPU 0: 800 MiB left behind (pids [4242])",
        "acceptance: no verifier step was measured (raise evaluate.max_new_tokens)",
    ]  # fmt: skip
    assert s["valid"] is False
    assert s["gpu_memory"]["train node 1"]["stray_processes"] is False
    lines = report_text.markdown(s, {}).splitlines()
    assert "| valid | NO (no acceptance gate set) |" in lines
    assert lines[lines.index("## Problems") + 2] == f"- checkpoint: {problem}"
    assert "<256>" not in report_text._table(["problem"], [[problem]])
    assert "&lt;256&gt;" in report_text._table(["problem"], [[problem]])


# ---- the validation rules ---------------------------------------------------------------------


# Catches: the gate failing a length equal to its minimum (<= for <); a gated result with no
# verifier step (acceptance length None) passing the gate.
def test_the_gate_passes_its_own_value_and_fails_a_set_without_a_verifier_step():
    assert report.problems_of(summary(gate={"mtbench": {"3": 2.498}})) == []
    offline = offline_record()
    offline["results"][2]["acceptance_length"] = None  # humaneval k=3: no verifier step
    no_step = (
        "acceptance (humaneval k=3): no verifier step was measured (raise "
        "evaluate.max_new_tokens, or give the set prompts that leave room to decode)"
    )
    assert report.problems_of(summary(gate={"humaneval": {"3": 2.0}}, offline=offline)) == [
        "acceptance (humaneval k=3): acceptance length n/a is below "
        "validate.min_acceptance_length 2.0",
        no_step,
    ]
    # without a gate a set other than the headline with no verifier step is named too
    assert report.problems_of(summary(offline=offline)) == [no_step]


# Catches: ARGMAX_AGREEMENT_MIN lowered (0.95) or compared with <= (99 % exactly flagged).
def test_argmax_agreement_of_99_percent_passes_and_just_below_does_not():
    def check(agreement):
        offline = offline_record()
        offline["results"][1]["argmax_agreement"] = agreement
        return report.problems_of(summary(offline=offline))

    assert check(0.99) == []
    assert check(0.985) == [
        "acceptance (mtbench k=5): the greedy tokens equal the verifier's argmax at only 98.5% "
        "of positions; a generation setting changes greedy decoding"
    ]


# Catches: vllm_problems dropping the text mismatch when the k or prompt count differs too
# (returning only the k problem).
def test_vllm_text_mismatch_and_another_k_are_both_reported():
    problems = report.problems_of(
        summary(vllm_record(k=5, text_matches_verifier=False, mismatched_prompts=[1, 4]))
    )
    assert [p.split(",")[0] for p in problems] == [
        "serve_check: vLLM with the draft decoded 2 prompt(s) differently from vLLM without it",
        "serve_check: vLLM measured k=5 on 80 prompts",
    ]


# ---- GPU memory: summary.json, summary.md, tables.html ------------------------------------------


# Catches: gpu_memory_entry reading after_mib from the before reading; gpu_memory_lines
# ignoring the host or swapping before and after; gpu_memory_rows dropping the row of a job
# without readings or writing no "none" for no leak; tables.html's GPU table.
def test_gpu_memory_is_reported_per_device_before_and_after(tmp_path, monkeypatch):
    s = built(tmp_path, monkeypatch)
    assert s["gpu_memory"]["evaluate"] == {
        "rule": "evaluate", "host": "gpu01", "gpus_requested": 1, "available": True,
        "devices": [{"index": 0, "name": "NVIDIA H100 80GB HBM3", "before_mib": 1000.0,
                     "after_mib": 1100.0}],
        "leaks": [], "stray_processes": False,
    }  # fmt: skip
    assert report_text.gpu_memory_lines(s["gpu_memory"]) == [
        "## GPU memory (NVML, before/after each GPU-capable job)",
        "",
        "- `evaluate` on gpu01: GPU 0 1000 → 1100 MiB",
        "- `extract-0` on cpu01: no NVIDIA device: NVML Shared Library Not Found",
        "- `train node 0` on gpu01: GPU 0 500 → 520 MiB; GPU 1 500 → 510 MiB",
        "- `train node 1` on gpu02: GPU 0 0 → 10 MiB",
    ]
    assert html_table(report_text.html_tables(s), "GPU memory (NVML, MiB before -> after)") == [
        ["job", "host", "GPU", "device / reason", "used MiB", "leaks"],
        ["evaluate", "gpu01", "0", "NVIDIA H100 80GB HBM3", "1000 -> 1100", "none"],
        ["extract-0", "cpu01", "-", "no NVIDIA device: NVML Shared Library Not Found", "-", "none"],
        ["train node 0", "gpu01", "0", "NVIDIA H100 80GB HBM3", "500 -> 520", "none"],
        ["train node 0", "gpu01", "1", "NVIDIA H100 80GB HBM3", "500 -> 510", "none"],
        ["train node 1", "gpu02", "0", "NVIDIA H100 80GB HBM3", "0 -> 10", "none"],
    ]  # fmt: skip


# ---- summary.md --------------------------------------------------------------------------------


# Catches: summary.md's headline rows (valid yes/NO and the gate note swapped, dropped samples
# counted as reasons, the truncation note dropped, bytes without thousands separators, the eval
# text's per-token accuracy replaced by the per-position rates, the replay note's agreement at
# 3 digits, optimizers joined by ", ", phases that PHASE_LABELS does not know dropped, a dedupe
# count of 0 hidden); the eval-set table (the length at 3 digits, prompts and steps swapped);
# the vLLM section (the sign of the difference, the run folder of the serve command, the
# whole section dropped); MB as MiB; provenance (dirty inverted, no "none" for no GPU); the
# plots' images; a Problems section on a valid build.
def test_summary_md_has_every_section_of_a_build(tmp_path, monkeypatch):
    s = built(tmp_path, monkeypatch)
    text = report_text.markdown(s, {"Training loss": "loss.png"})
    lines = text.splitlines()
    for line in [
        "# EAGLE-3 draft build `t`",
        "Verifier **tiny-llama** (4 layers, hidden 64).",
        "| valid | yes (no acceptance gate set) |",
        "| acceptance length (mtbench, k=3, replay) | 2.498 |",
        "| per-position acceptance | 0.676, 0.471, 0.351 |",
        "| draft accuracy per token of the eval text, teacher-forced (per TTT step) | "
        "0.700, 0.500, 0.400 |",
        "| draft accuracy per token of held-out training data (validation's full_acc) | "
        "0.600, 0.400, 0.250 |",
        "| prompts / verifier steps | 80 / 400 |",
        "| text equals verifier-only greedy | not checked (replay; verifier argmax agreement "
        "0.9987) |",
        "| checkpoint valid | True |",
        "| training samples kept / dropped | 30 / 5 (3 cut to data.max_length) |",
        "| training | 2 epochs on 27 samples (3 held out for validation), adamw and muon, "
        "float32 on cpu |",
        "| training time | 20.0 s: steps 12.0 s (the first 4.0 s), saves 2.0 s, validation 3.0 s, "
        "marking the best epoch 0.5 s, export 1.5 s, set-up and the rest 1.0 s |",
        "| training conversations dropped as repeating a first prompt (dedupe) | 0 |",
        "| hidden-state tokens / bytes | 2000 / 2,000,000 |",
        "| draft vocab coverage of supervised tokens | 0.988 |",
        "## Offline acceptance (replay)",
        "| mtbench | 3 | 2.4980 | 0.676, 0.471, 0.351 | 0.700, 0.500, 0.400 | 0.012 | 80 | 400 |",
        "| humaneval | 3 | 2.8380 | 0.771, 0.595, 0.472 | 0.700, 0.500, 0.400 | 0.012 | 164 | 900 |",
        "## Acceptance length by category: mtbench (prompts per category in brackets)",
        "## vLLM",
        "Acceptance length in vLLM 0.32.0: 2.478 (per position 0.676, 0.461, 0.341); offline "
        "evaluator vs vLLM: +0.8%, per position at most 0.010 apart (allowed: 3% and 0.05).",
        "Serve it from `results/t/`: `vllm serve x`",
        "- `evaluate`: 3.0",
        "- `extract-0`: 12.35",
        "- `train`: 0.0 MB",
        "- `checkpoint`: 2.5 MB",
        "| `evaluate` | `cdcdcdcdcdcd` | `0123456789 (dirty)` | gpu01 | 0 |",
        "| `train` | `abababababab` | `?` | cpu01 | none |",
        "## Training loss",
        "![Training loss](loss.png)",
    ]:
        assert line in lines, line
    assert "## Problems" not in lines
    assert text.endswith("![Training loss](loss.png)\n")
    with_gate = built(tmp_path, monkeypatch, min_acceptance_length={"mtbench": {"3": 2.0}})
    assert "| valid | yes |" in report_text.markdown(with_gate, {}).splitlines()


# Catches: eval_set_lines showing the table for the headline result alone (< 1 for <= 1).
def test_the_eval_set_table_needs_more_than_the_headline():
    results = evaluated()["results"]
    assert report_text.eval_set_lines({"acceptance": {"results": results[:1]}}) == []
    assert len(report_text.eval_set_lines({"acceptance": {"results": results[:2]}})) == 7


# Catches: validation_accuracy taking the first validation, not the last, or the steps in the
# order of the record's keys (summary files sort their keys: full_acc_10 before full_acc_2).
def test_validation_accuracy_is_the_last_validations_in_step_order():
    val = {f"full_acc_{j}_epoch": j / 20 for j in sorted(range(11), key=str)}
    training = {"val": [{"full_acc_0_epoch": 0.9}, val]}
    assert report_text.validation_accuracy(training) == [j / 20 for j in range(11)]
    assert report_text.validation_accuracy({"val": []}) == []


# Catches: fmt printing n/a for 0.0 (`not value` for `is None`); positions printing "" rather
# than n/a for no rates (a training without validation); text_check showing the replay note
# for a text that does not match (False).
def test_figures_show_zero_and_say_n_a_only_for_nothing():
    assert report.fmt(0.0) == "0.000" and report.fmt(None) == "n/a"
    assert report.fmt(2.49849, 4) == "2.4985"
    assert report_text.positions([0.0, 0.5]) == "0.000, 0.500"
    assert report_text.positions([]) == report_text.positions(None) == "n/a"
    assert report_text.text_check({"text_matches_verifier": False, "acceptance": {}}) == "False"
    assert report_text.text_check({"text_matches_verifier": True, "acceptance": {}}) == "True"


# ---- tables.html -------------------------------------------------------------------------------


# Catches: tables.html's headline table showing another rate list; the category tables, a
# benchmarked job, the MB conversion, the config hash's 16 characters or the "none" row of
# no problem going missing.
def test_tables_html_holds_the_summarys_tables(tmp_path, monkeypatch):
    page = report_text.html_tables(built(tmp_path, monkeypatch))
    assert page.startswith("<!doctype html>") and page.endswith("</html>\n")
    assert html_table(page, "Acceptance") == [
        ["eval set", "method", "k", "acceptance length", "per-position acceptance", "prompts",
         "steps", "text equals verifier"],
        ["mtbench", "replay", "3", "2.4980", "0.676, 0.471, 0.351", "80", "400",
         "not checked (replay; verifier argmax agreement 0.9987)"],
    ]  # fmt: skip
    assert len(html_table(page, "Offline acceptance per eval set and k")) == 4
    assert html_table(page, "Acceptance length by category: mtbench") == [
        ["k", "writing (10)", "math (9)"], ["3", "2.610", "2.200"], ["5", "2.610", "2.200"],
    ]  # fmt: skip
    assert html_table(page, "Seconds per job") == [
        ["job", "seconds"], ["evaluate", "3.0"], ["extract-0", "12.35"],
    ]  # fmt: skip
    assert html_table(page, "Disk per stage") == [["stage", "MB"], ["train", "0.0"],
                                                  ["checkpoint", "2.5"]]  # fmt: skip
    assert html_table(page, "Provenance") == [
        ["job", "config sha256", "commit", "host", "GPUs"],
        ["evaluate", "cd" * 8, "0123456789ab", "gpu01", "0"],
        ["train", "ab" * 8, "?", "cpu01", "none"],
    ]  # fmt: skip
    assert html_table(page, "Problems") == [["problem"], ["none"]]


# ---- plots ---------------------------------------------------------------------------------------


# Catches: plot_loss's figure size changed (and it failing at all: nothing else fast draws it).
def test_the_loss_plot_is_a_png_of_5_by_3_inches(tmp_path):
    from eagle3lib.report_plots import plot_loss

    plot_loss({"step": [1, 2, 3], "train_loss": [3.0, 2.5, 2.25]}, tmp_path / "loss.png")
    data = (tmp_path / "loss.png").read_bytes()
    assert data[:4] == b"\x89PNG" and struct.unpack(">II", data[16:24]) == (600, 360)


# Catches: train.max_steps left out where it cut the epochs short (the card and summary.md
# then claimed every configured epoch)
def test_the_training_length_names_max_steps_where_set():
    assert report_text.training_length({"epochs": 3}) == "3 epochs"
    assert report_text.training_length({"epochs": 3, "max_steps": 40}) == (
        "3 epochs (at most 40 steps: train.max_steps)"
    )
    row = report_text.training_row({"epochs": 2, "max_steps": 5, "train_samples": 9})
    assert row[0].startswith("| training | 2 epochs (at most 5 steps: train.max_steps) on 9 ")


# Catches: the plot's steps counted from 0 where the train job's log counts from 1; the
# validation loss left out, or put at an epoch's first step; a record without a loss plotted
def test_the_loss_plot_puts_each_validation_at_its_epochs_last_step():
    from eagle3lib.report_plots import loss_points

    curves = {
        "step": [0, 1, 2, 3, 4, 5],
        "train_loss": [3.0, 2.5, 2.2, 2.0, 1.9, 1.8],
        "step_epoch": [0, 0, 0, 1, 1, 1],
        "val": [
            {"epoch": 0, "loss_epoch": 2.4, "full_acc_0_epoch": 0.1},
            {"epoch": 1, "loss_epoch": 2.1},
            {"epoch": 2, "full_acc_0_epoch": 0.3},  # no loss, no step of its epoch
        ],
    }
    train, val = loss_points(curves)
    assert train == ([1, 2, 3, 4, 5, 6], [3.0, 2.5, 2.2, 2.0, 1.9, 1.8])
    assert val == ([3, 6], [2.4, 2.1])


# ---- bugs the audit found, fixed ----------------------------------------------------------------


# Catches: report_text.headline_table formatting acceptance_length with :.4f (the report job
# died with TypeError when evaluate measured no verifier step, the problem it is meant to name).
def test_tables_html_of_a_run_with_no_verifier_step_says_n_a(tmp_path, monkeypatch):
    acceptance = evaluated()
    acceptance["results"][0].update(acceptance_length=None, steps=0,
                                    per_position_acceptance=[0.0, 0.0, 0.0])  # fmt: skip
    acceptance.update(acceptance_length=None, steps=0, per_position_acceptance=[0.0, 0.0, 0.0])
    s = built(tmp_path, monkeypatch, acceptance=acceptance, vllm=None)
    assert s["problems"] == [
        "acceptance: no verifier step was measured (raise evaluate.max_new_tokens)"
    ]
    assert (
        "| acceptance length (mtbench, k=3, replay) | n/a |"
        in report_text.markdown(s, {}).splitlines()
    )
    page = report_text.html_tables(s)
    assert html_table(page, "Acceptance")[1][2:5] == ["3", "n/a", "0.000, 0.000, 0.000"]


# Catches: gpu_memory_entry checking only the reading before the job (when NVML failed after
# it, e.g. a driver that lost the GPU, the report job died with KeyError: 'devices').
def test_a_gpu_job_whose_reading_after_it_failed_has_no_readings(tmp_path):
    failed = {"available": False, "reason": "no NVIDIA device: GPU is lost"}
    entry = report.gpu_memory_entry(gpu_job("train", "gpu01", reading({0: 100.0}), failed))
    assert entry["available"] is False
    assert entry["reason"] == "after the job: no NVIDIA device: GPU is lost"
    assert entry["leaks"] == [] and "devices" not in entry
