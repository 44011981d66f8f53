"""Planning's checks (eagle3lib/preflight.py) value by value, where tests/test_edge_cases.py
finds only a part of a line or only one side of a limit: each message about the verifier ends
by naming the file its facts were read from, a fact the verifier's files do not give is not
checked (and never a crash), the settings and their neighbours at each boundary, folders that
cannot be entered, and which problem comes first. Calls the functions directly on config.yaml
with keys set (schema-valid, defaults filled, as rules/common.smk hands it over); no model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from test_edge_cases import FACTS, settings  # config.yaml's verifier's facts; config.yaml

from eagle3lib import preflight

WHERE = "(verifier: model/config.json)"


# ---- every message about the verifier names where its facts came from ----------------------

VERIFIER_LINES = {
    "aux-layer-beyond-the-verifier": (
        dict(extract__aux_layers=[2, 4, 30]),
        "config key extract.aux_layers: layer id(s) [30] out of range [0, 29]",
    ),
    "max-length-beyond-the-context": (
        dict(data__max_length=8193),
        "config key data.max_length: 8193 is longer than the verifier's context "
        "(max_position_embeddings 8192); use at most 8192",
    ),
    "eval-new-tokens-fill-the-context": (
        dict(evaluate__max_new_tokens=8192, evaluate__k=3),
        "config key evaluate.max_new_tokens: 8192 new tokens leave no room for the prompt in "
        "the verifier's context (max_position_embeddings 8192); use fewer than 8192",
    ),
}


@pytest.mark.parametrize("name", VERIFIER_LINES)
def test_a_problem_with_the_verifier_names_the_file_its_facts_came_from(name):
    """A setting at odds with the verifier is one line that starts with the config key and ends
    with ``(verifier: <file>)``, so a user can tell a wrong setting from a wrong model file."""
    dotted, start = VERIFIER_LINES[name]
    [line] = preflight.setting_problems(settings(**dotted), FACTS)
    assert line.startswith(start), line
    assert line.endswith(f" {WHERE}"), line


def test_a_verifier_without_decoder_layers_is_named_with_its_file():
    """A verifier of 0 layers (nothing to learn from) is named with the file that says so."""
    facts = preflight.VerifierFacts("model/config.json", 0, 576, 49152, 8192)
    assert preflight.setting_problems(settings(), facts) == [
        f"the verifier has num_hidden_layers 0 {WHERE}; a draft learns from its decoder "
        "layers' states: fix num_hidden_layers in its config, or use another model"
    ]


# ---- a fact that is not known is not checked --------------------------------------------------


def test_facts_the_verifier_files_do_not_give_are_not_checked():
    """A config.json may lack any fact (an unusual spelling: facts_from_config gives None):
    planning then checks the settings against the facts it has, and only those, without an
    error of its own. Every setting here is at odds with the verifier of FACTS."""
    config = settings(
        extract__aux_layers=[2, 4, 40],
        train__draft_vocab_size=60000,
        data__max_length=9000,
        evaluate__max_new_tokens=9000,
        extract__backend="vllm",
        extract__gpus_per_job=1,
        vllm__max_model_len=16384,
    )
    assert preflight.setting_problems(config, preflight.VerifierFacts("c.json")) == []
    vocab_only = preflight.VerifierFacts("c.json", vocab_size=49152)
    [line] = preflight.setting_problems(config, vocab_only)
    assert line.startswith("config key train.draft_vocab_size: 60000 is larger")
    layers_only = preflight.VerifierFacts("c.json", num_hidden_layers=30)
    [line] = preflight.setting_problems(config, layers_only)
    assert line.startswith("config key extract.aux_layers: layer id(s) [40] out of range")


# ---- the verifier's facts ----------------------------------------------------------------------


def test_transformers_own_name_of_a_fact_wins_over_an_older_spelling():
    """A config.json holding both spellings of a fact (MPT-style max_seq_len beside
    max_position_embeddings, a num_layers of another meaning beside num_hidden_layers) gives
    transformers' own: the value the loaded model uses."""
    config = {"model_type": "x", "num_hidden_layers": 24, "num_layers": 2, "hidden_size": 1024,
              "d_model": 64, "vocab_size": 32000, "max_position_embeddings": 4096,
              "max_seq_len": 2048}  # fmt: skip
    assert preflight.facts_from_config(config, "c.json") == preflight.VerifierFacts(
        "c.json", 24, 1024, 32000, 4096
    )


# ---- the settings at a boundary, on the side the existing tables leave out ---------------------


def test_synthetic_prompts_do_not_count_while_regeneration_is_off():
    """regenerate.synthetic_prompts adds samples only when regeneration runs: with it off the
    shards are checked against data.train.max_samples alone, and the line does not name the
    synthetic prompts; its remedy is the number of samples, not one shard fewer."""
    config = settings(
        data__train={"path": "t.jsonl", "max_samples": 3},
        regenerate__enabled=False,
        regenerate__synthetic_prompts=10,
        extract__shards=10,
    )
    assert preflight.setting_problems(config, None) == [
        "config key extract.shards: 10 shards for at most 3 samples (data.train.max_samples) "
        "leaves a shard empty; use at most 3 shards"
    ]


def test_more_shards_than_prepared_samples_names_the_sample_count_as_the_remedy():
    """Against the samples prepare made, the remedy is that number of shards."""
    assert preflight.setting_problems(settings(extract__shards=8), None, samples=5) == [
        "config key extract.shards: 8 shards for the 5 samples prepare made leaves a shard "
        "empty; use at most 5 shards"
    ]


def test_explicit_flex_attention_on_a_gpu_needs_a_multiple_of_128():
    """train.attention: simple_flex_attention on a GPU needs the block mask's multiple as auto
    does, and the line names the attention set."""
    config = settings(train__gpus=1, train__attention="simple_flex_attention",
                      train__total_seq_len=200)  # fmt: skip
    assert preflight.setting_problems(config, None) == [
        "config key train.total_seq_len: 200 is not a multiple of 128, which flex attention's "
        "block mask needs (train.attention: simple_flex_attention on a GPU); use e.g. 256, or "
        "train.attention: sdpa"
    ]


@pytest.mark.parametrize("total_seq_len", [128, 384, 1152])
def test_any_multiple_of_128_is_a_pack_length_flex_attention_takes(total_seq_len):
    """128 is the block size: its multiples pass on a GPU, odd multiples (384) included."""
    config = settings(train__gpus=1, train__total_seq_len=total_seq_len)
    assert preflight.setting_problems(config, None) == []


# ---- result folders ---------------------------------------------------------------------------


def test_a_folder_this_user_cannot_enter_stops_planning(tmp_path, monkeypatch):
    """Writing into a folder needs both write and search (execute) permission: a results
    folder without the search bit is not writable either. The tests run as root, so os.access
    in preflight is a stand-in that refuses X_OK on that one folder."""
    results = tmp_path / "results"
    results.mkdir()
    real = os.access
    monkeypatch.setattr(
        preflight.os,
        "access",
        lambda p, m: not (Path(p) == results and m & os.X_OK) and real(p, m),
    )
    assert preflight.output_path_problems(results / "t") == [
        f"{results}: not writable by this user; make it writable, or run from a working "
        "directory where results/ can be written"
    ]


def test_a_dangling_symlink_where_the_results_folder_should_be(tmp_path):
    """results/ as a symbolic link to a folder that is gone (a cleaned scratch space) is no
    folder the run can write into (Snakemake would stop at the first job with "Failed to
    create output directory"): planning names the link and its target and says what to do,
    as it does for a file there; the same for a run folder's stage folder."""
    gone = tmp_path / "scratch-gone"
    (tmp_path / "results").symlink_to(gone)
    assert preflight.output_path_problems(tmp_path / "results" / "t") == [
        f"{tmp_path / 'results'}: a symbolic link to {gone}, which does not exist, is where a "
        f"folder of {tmp_path / 'results' / 't'} should be; create the folder it points to, or "
        "move or delete the link"
    ]
    gone.mkdir()  # the link works again: no problem
    assert preflight.output_path_problems(tmp_path / "results" / "t") == []
    run = tmp_path / "results" / "t"
    run.mkdir()
    (run / "hidden_states").symlink_to(tmp_path / "disk-gone")
    [line] = preflight.output_path_problems(run)
    assert line.startswith(f"{run / 'hidden_states'}: a symbolic link to ")
    assert "is where a folder the run writes should be;" in line


# ---- which problem comes first -----------------------------------------------------------------


def test_an_empty_eval_file_is_named_as_an_input_file_before_its_prompts_are_read(tmp_path):
    """The input files (each of them, not only data.train.path) are checked before the eval
    prompts are read, so an empty eval file gives the input file's line with its config key."""
    train, evals = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text('{"conversations": [{"from": "human", "value": "hi"}]}\n')
    evals.write_text("")
    problems, facts = preflight.planning_problems(
        settings(verifier__path="org/model"),
        tmp_path / "results" / "t" / "verifier" / "verifier.json",
        {"data.train.path": train, "data.eval.path": evals},
        [{"key": "data.eval", "path": evals}],
        None,
    )
    assert problems[0] == (
        f"config key data.eval.path: file '{evals}' is empty; point data.eval.path at a file of "
        "records"
    )
    assert facts is None


# ---- warnings ----------------------------------------------------------------------------------


def test_the_dtype_warning_resolves_auto_by_the_device_of_each_job_separately():
    """extract.dtype auto on a CPU extract job is float32 while evaluate.dtype auto on a GPU
    evaluate job is bfloat16: one warning naming both keys; with both jobs on one kind of
    device, auto agrees with itself."""
    config = settings(extract__dtype="auto", extract__gpus_per_job=0, evaluate__dtype="auto",
                      evaluate__gpus=1)  # fmt: skip
    [line] = preflight.setting_warnings(config)
    assert line.startswith(
        "config keys extract.dtype (auto) and evaluate.dtype (auto): the verifier's states are "
        "extracted in float32 but acceptance is measured with it in bfloat16"
    )
    assert line.endswith("set both to the same dtype")
    config["extract"]["gpus_per_job"] = 1
    assert preflight.setting_warnings(config) == []
