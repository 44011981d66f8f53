"""The report's validation (eagle3lib/report.py problems_of): the acceptance regression gate
(validate.min_acceptance_length) and the agreement of vLLM's acceptance (serve_check) with the
offline evaluator's, on records built here; and the per-set leakage counts of the summary."""

import copy

import pytest

from eagle3lib import report, report_text
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
