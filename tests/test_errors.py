"""Bad input through the real workflow: a one-line error naming the file, line or key, a
non-zero exit, and no partial artifact."""

import json

import pytest
import tiny
from conftest import run_snakemake

pytestmark = pytest.mark.slow


@pytest.fixture
def setup(tmp_path, verifier_dir):
    evals = tiny.write_jsonl(
        tmp_path / "eval.jsonl", [{"question_id": 1, "turns": ["Tell me something"]}]
    )

    def make(train_records=None, train_text=None, **overrides):
        train = tmp_path / "train.jsonl"
        if train_text is not None:
            train.write_text(train_text)
        else:
            tiny.write_jsonl(
                train, train_records if train_records is not None else tiny.conversations(6)
            )
        config = tiny.write_config(
            tmp_path / "config.yaml",
            "t",
            overrides.pop("verifier", verifier_dir),
            train,
            evals,
            **overrides,
        )
        return config

    return tmp_path, make


def one_error_line(text: str) -> str:
    assert "Traceback" not in text, text
    lines = [line for line in text.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, text
    return lines[0]


def assert_no_partial_artifacts(results):
    if results.exists():
        assert not [p for p in results.rglob("*") if ".tmp-" in p.name]


def run_target(tmp_path, config, target):
    proc = run_snakemake(tmp_path, config, target, check=False)
    assert proc.returncode != 0
    return proc


def test_malformed_json_line_names_file_and_line(setup):
    tmp_path, make = setup
    good = json.dumps(tiny.conversations(1)[0])
    config = make(train_text=f'{good}\n{good}\n{{"conversations": [}}\n')
    run_target(tmp_path, config, "results/t/prepared/samples.json")
    line = one_error_line((tmp_path / "results/t/logs/prepare.log").read_text())
    assert line.endswith("fix or remove the line")
    assert f"{tmp_path}/train.jsonl:3: invalid JSON" in line
    assert not (tmp_path / "results/t/prepared/samples.safetensors").exists()
    assert_no_partial_artifacts(tmp_path / "results")


@pytest.mark.parametrize(
    ("records", "message"),
    [
        ([], "no usable training samples (0 records read; dropped no records)"),
        (
            [{"messages": [{"role": "user", "content": "anyone there?"}]}] * 3,
            "dropped no_assistant_turn: 3",
        ),
    ],
)
def test_dataset_without_usable_samples(setup, records, message):
    tmp_path, make = setup
    config = make(train_records=records)
    run_target(tmp_path, config, "results/t/prepared/samples.json")
    line = one_error_line((tmp_path / "results/t/logs/prepare.log").read_text())
    assert message in line and "train.jsonl" in line
    assert not (tmp_path / "results/t/prepared").exists() or not any(
        (tmp_path / "results/t/prepared").iterdir()
    )


def test_unknown_config_key(setup):
    tmp_path, make = setup
    config = make(train={"lrr": 0.1})
    proc = run_target(tmp_path, config, "results/t/prepared/samples.json")
    line = one_error_line(proc.stderr)
    assert line.startswith("error: config key train.lrr: unknown key; allowed here: ")
    assert not (tmp_path / "results").exists()


def test_config_value_of_the_wrong_type(setup):
    tmp_path, make = setup
    config = make(extract={"shards": "two"})
    proc = run_target(tmp_path, config, "results/t/prepared/samples.json")
    assert one_error_line(proc.stderr).startswith(
        "error: config key extract.shards: 'two' is not of type 'integer'; "
    )


def test_missing_verifier_folder(setup):
    tmp_path, make = setup
    config = make(verifier=tmp_path / "no-such-model")
    proc = run_target(tmp_path, config, "results/t/prepared/samples.json")
    assert "config key verifier.path: folder" in one_error_line(proc.stderr)
    assert "no-such-model' does not exist" in proc.stderr


def test_aux_layer_out_of_range(setup):
    tmp_path, make = setup
    config = make(extract={"aux_layers": [1, 4, 9]})
    run_target(tmp_path, config, "results/t/hidden_states/shard-0.safetensors")
    line = one_error_line((tmp_path / "results/t/logs/extract-0.log").read_text())
    assert line == (
        "error: config key extract.aux_layers: layer id(s) [9] out of range [0, 7] for a "
        "verifier with 8 layers (the final layer is always added)"
    )
    assert not list((tmp_path / "results/t/hidden_states").glob("shard-0*"))
    assert_no_partial_artifacts(tmp_path / "results")


def test_draft_vocab_larger_than_the_verifier_vocab(setup):
    tmp_path, make = setup
    config = make(train={"draft_vocab_size": 100000})
    run_target(tmp_path, config, "results/t/vocab/vocab_map.safetensors")
    line = one_error_line((tmp_path / "results/t/logs/vocab.log").read_text())
    assert "config key train.draft_vocab_size: 100000 is larger than the verifier vocab" in line
    assert not (tmp_path / "results/t/vocab/vocab_map.safetensors").exists()
