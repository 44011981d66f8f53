"""Contract tests of eagle3lib/report.py that tests/test_report.py leaves open: the GPU table's
per-job facts (GPUs asked for, devices shared with other jobs, records without a host or a
stray-process field, job order), the summary's figures taken from the right record (the
headline's text check, checkpoint validity, the regeneration record, the first shard's layers
and dtype, every rejected sample), and the validation's edges (exact tolerances, an acceptance
length of exactly 1, a second result without a verifier step, a headline without an eval set,
prepare's overlap counts short of the eval sets). Records are built here, as in test_report."""

import pytest
from test_report import built, gpu_job, offline_record, reading, summary, vllm_record, written

from eagle3lib import report

# ---- GPU memory ----------------------------------------------------------------------------


# Catches: gpu_memory_entry writing a constant for gpus_requested; ignoring shared_by (naming
# another job's memory on a shared device as this job's leak).
def test_a_gpu_entry_keeps_the_gpus_asked_for_and_no_leak_on_a_shared_device():
    """A job that asked for 2 GPUs says so; a device shared with another job (shared_by 2)
    names no leak, though its memory grew; the same growth unshared is a leak."""
    grew = (reading({0: 100.0}), reading({0: 9000.0}, pids=[7]))
    shared = gpu_job("evaluate", "gpu01", *grew, gpus_requested=2, shared_by=2)
    entry = report.gpu_memory_entry(shared)
    assert entry["gpus_requested"] == 2
    assert entry["leaks"] == []
    alone = report.gpu_memory_entry(gpu_job("evaluate", "gpu01", *grew))
    assert alone["leaks"] == ["GPU 0: 8900 MiB left behind (pids [7])"]


# Catches: stray_processes defaulting to True for a record without the field; gpu_problems
# naming a job without a host "<job> on None".
def test_a_record_without_a_host_or_stray_field_is_named_by_its_job_alone():
    """A record with no host and no stray_processes field: its leak is named "<job>: ...", and
    no stray processes are assumed."""
    record = gpu_job("extract-0", None, reading({0: 0.0}), reading({0: 700.0}, pids=[3]))
    del record["host"], record["stray_processes"]
    entry = report.gpu_memory_entry(record)
    assert entry["host"] is None and entry["stray_processes"] is False
    assert report.gpu_problems({"extract-0": entry}) == [
        "extract-0: GPU 0: 700 MiB left behind (pids [3])"
    ]


# Catches: gpu_memory_table keeping the order its records came in (summary.json and the
# problems then list the jobs in an order that changes from run to run).
def test_the_gpu_table_and_its_problems_are_in_job_order(tmp_path):
    leak = (reading({0: 0.0}), reading({0: 900.0}, pids=[1]))
    paths = written(
        tmp_path,
        {
            "train": gpu_job("train", "gpu02", *leak),
            "evaluate": gpu_job("evaluate", "gpu01", *leak),
        },
    )
    table = report.gpu_memory_table(paths)
    assert list(table) == ["evaluate", "train"]
    assert report.gpu_problems(table) == [
        "evaluate on gpu01: GPU 0: 900 MiB left behind (pids [1])",
        "train on gpu02: GPU 0: 900 MiB left behind (pids [1])",
    ]


# ---- summary.json ----------------------------------------------------------------------------


# Catches: vllm_summary's max position difference taken without abs (a vLLM run accepting more
# at a position than the offline evaluator gives a negative or zero figure).
def test_the_vllm_block_gives_the_largest_position_difference_either_way():
    higher = vllm_record(acceptance_length=2.6, per_position_acceptance=[0.736, 0.471, 0.351])
    v = report.vllm_summary(higher, offline_record())
    assert v["offline_vs_vllm_max_position_difference"] == pytest.approx(0.06)
    assert v["offline_vs_vllm_relative_difference"] == pytest.approx(2.498 / 2.6 - 1)


# Catches: summarize's text_matches_verifier, checkpoint_valid or regenerated not taken from
# their records (the stand-in run of test_report is replayed, valid, and not regenerated, so
# constants pass it).
def test_summarize_takes_the_text_check_checkpoint_validity_and_regeneration_from_records(
    tmp_path, monkeypatch
):
    """A decoded run (text checked: True), a checkpoint marked invalid with no problem named,
    and a regeneration record: each shows in summary.json as given."""
    acceptance = built(tmp_path, monkeypatch)["acceptance"]
    rows = [{**r, "text_matches_verifier": True} for r in acceptance["results"]]
    acceptance = {**acceptance, "text_matches_verifier": True, "method": "decode", "results": rows}
    regenerated = {"samples": 30, "backend": "hf"}
    s = built(
        tmp_path,
        monkeypatch,
        acceptance=acceptance,
        checkpoint={"valid": False, "problems": []},
        regenerated=regenerated,
    )
    assert s["text_matches_verifier"] is True
    assert s["checkpoint_valid"] is False and s["checkpoint"] == {"valid": False, "problems": []}
    assert s["regenerated"] == regenerated
    assert s["problems"] == ["checkpoint: not valid, though no problem is recorded with it"]


# Catches: hidden_states_summary counting shards with a rejected sample rather than the
# samples, or taking the layers and dtype from the last shard (documented: the first's).
def test_hidden_states_count_every_rejected_sample_and_describe_the_first_shard():
    manifests = [
        {"tokens": 10, "file": {"bytes": 100}, "layer_ids": [1, 2, 3], "rejected": ["a", "b"],
         "state_dtype": "float16"},
        {"tokens": 5, "file": {"bytes": 50}, "layer_ids": [4, 5, 6], "rejected": []},
    ]  # fmt: skip
    assert report.hidden_states_summary(manifests) == {
        "shards": 2,
        "tokens": 15,
        "bytes": 150,
        "layer_ids": [1, 2, 3],
        "state_dtype": "float16",
        "rejected_samples": 2,
    }


# Catches: data_summary checking only for more overlap counts than eval sets (fewer failed
# later, in zip, with no word of what disagreed).
def test_fewer_overlap_counts_than_eval_sets_are_named():
    prepare = {"samples": 9, "eval_overlap": {"ngram": 8, "dropped_per_eval_file": [0]}}
    with pytest.raises(ValueError, match=r"with 1 eval file\(s\), evaluate ran 2 eval set\(s\)"):
        report.data_summary(prepare, offline_record())


# ---- validation ------------------------------------------------------------------------------


# Catches: problems_of ignoring the checkpoint block's own `valid` (only checkpoint_valid read).
def test_a_checkpoint_block_marked_invalid_is_a_problem():
    """validate judges summary.json again: a checkpoint block saying valid: false is a problem
    even where checkpoint_valid was left true."""
    s = summary()
    s["checkpoint"]["valid"] = False
    s["checkpoint_valid"] = True
    assert report.problems_of(s) == ["checkpoint: not valid, though no problem is recorded with it"]


# Catches: the lower bound of the acceptance length compared strictly (1 < length): a draft
# none of whose tokens were accepted gives exactly 1, which is possible.
def test_an_acceptance_length_of_exactly_one_is_possible():
    offline = offline_record()
    offline["results"][2]["acceptance_length"] = 1.0
    assert report.problems_of(summary(offline=offline)) == []


# Catches: "no verifier step" named only from the third result on (i > 1 for i > 0).
def test_the_second_result_without_a_verifier_step_is_named():
    offline = offline_record()
    offline["results"][1]["acceptance_length"] = None
    assert report.problems_of(summary(offline=offline)) == [
        "acceptance (mtbench k=5): no verifier step was measured (raise evaluate.max_new_tokens, "
        "or give the set prompts that leave room to decode)"
    ]


# Catches: problems_of naming a headline record without eval_set (acceptance.json without
# per-set results) otherwise than by its k.
def test_a_headline_without_an_eval_set_is_named_by_its_k():
    headline = {"k": 3, "prompts": 4, "acceptance_length": 5.0,
                "per_position_acceptance": [1.0, 1.0, 1.0], "text_matches_verifier": True}  # fmt: skip
    assert report.problems_of(summary(offline=headline)) == [
        "acceptance (k=3): acceptance length 5.0000 is outside [1, 4], which no decoding gives: "
        "acceptance.json was damaged or edited; rerun evaluate (-R evaluate)"
    ]


# Catches: the position tolerance compared with >= (a gap of exactly 0.05 flagged); the two
# rate lists swapped in the message.
def test_a_position_gap_of_exactly_the_tolerance_passes_and_more_names_both_lists():
    def check(vllm_rate):
        offline = offline_record()
        for r in (offline, offline["results"][0]):
            r["per_position_acceptance"] = [0.676, 0.1, 0.351]
        rates = [0.676, vllm_rate, 0.351]
        return report.problems_of(
            summary(vllm_record(per_position_acceptance=rates), offline=offline)
        )

    assert check(0.05) == []  # 0.1 - 0.05 == 0.05 exactly in floating point
    assert check(0.04) == [
        "serve_check (k=3, 80 prompts): per-position acceptance offline 0.676, 0.100, 0.351 vs "
        "vLLM 0.676, 0.040, 0.351 differs by 0.060 at position 2, more than the 0.05 allowed; "
        "vLLM does not serve the draft as it was evaluated (k, aux layers, vocab map, dtype)"
    ]


# Catches: the relative tolerance compared with >= (a summary whose difference is exactly 3 %
# flagged, though the message says "more than the 3% allowed").
def test_a_relative_difference_of_exactly_the_tolerance_passes():
    """The difference is set in the summary as validate reads it from summary.json (no two
    acceptance lengths give exactly 0.03 in floating point)."""
    s = summary(vllm_record())
    s["vllm"]["offline_vs_vllm_relative_difference"] = 0.03
    assert report.problems_of(s) == []
    s["vllm"]["offline_vs_vllm_relative_difference"] = -0.0301
    [problem] = report.problems_of(s)
    assert "differs by -3.0%, more than the 3% allowed" in problem
