import json
import shutil

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eagle3lib import checkpoint
from eagle3lib.errors import UserError


def test_exported_checkpoint_is_portable_and_valid(pipeline):
    ckpt = pipeline["checkpoint"]
    config = json.loads((ckpt / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["speculators_config"]["verifier"]["name_or_path"] == "tiny-llama"
    assert checkpoint.absolute_paths(config) == []
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert config["draft_vocab_size"] == 256
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    tensors = load_file(str(ckpt / "model.safetensors"))
    assert torch.equal(tensors["d2t"], pipeline["vocab_map"]["d2t"])
    assert torch.equal(tensors["t2d"], pipeline["vocab_map"]["t2d"])
    assert (
        tensors["fc.weight"].shape == (64, 3 * 64) and tensors["fc.weight"].dtype == torch.bfloat16
    )
    assert tensors["lm_head.weight"].shape == (256, 64)

    report = checkpoint.check(ckpt, pipeline["record"], [2, 4, 5])
    assert report["problems"] == [] and report["valid"] is True
    assert report["reload_forward"] == {"ttt_steps": 3, "shape": [1, 8]}


@pytest.fixture
def broken(pipeline, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(pipeline["checkpoint"], ckpt)
    return ckpt


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (lambda c: [], "config.json holds a JSON list, not an object"),
        (lambda c: {**c, "speculators_config": None},
         "speculators_config.verifier.name_or_path is empty (vLLM requires it)"),
        (lambda c: {**c, "transformer_layer_config": [1]}, "hidden_size None != verifier 64"),
    ],
    ids=["list", "null-section", "list-section"],
)  # fmt: skip
def test_check_reports_a_config_of_the_wrong_shape(broken, pipeline, damage, problem):
    """Valid JSON of the wrong shape (a list, a section null or a list) is a problem in the
    report, not an exception (check never raises for a bad checkpoint)."""
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps(damage(config)))
    report = checkpoint.check(broken, pipeline["record"], [2, 4, 5])
    assert report["valid"] is False
    assert problem in report["problems"]


def rewrite_tensors(ckpt, fn):
    tensors = load_file(str(ckpt / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(ckpt / "model.safetensors"))


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (lambda t: t.pop("fc.weight"), "tensor fc.weight missing"),
        (lambda t: t.update({"norm.weight": t["norm.weight"].float()}), "norm.weight is F32"),
        (
            lambda t: t.update({"lm_head.weight": torch.zeros(10, 64, dtype=torch.bfloat16)}),
            "lm_head.weight has shape [10, 64]",
        ),
        (lambda t: t.update({"d2t": t["d2t"].flip(0)}), "d2t does not map"),
        (lambda t: t.update({"t2d": torch.zeros_like(t["t2d"])}), "t2d marks 0 tokens"),
    ],
)
def test_damaged_tensors_are_reported(broken, pipeline, damage, problem):
    rewrite_tensors(broken, damage)
    report = checkpoint.check(broken, pipeline["record"], [2, 4, 5])
    assert report["valid"] is False
    assert any(problem in p for p in report["problems"]), report["problems"]


def test_non_finite_weights_are_reported(broken, pipeline):
    """A diverged training's weights (NaN, infinity) make the checkpoint invalid, naming each
    tensor and how many of its values; d2t/t2d (integers) are not floats to check."""

    def diverge(tensors):
        tensors["fc.weight"][0, :3] = float("nan")
        tensors["norm.weight"][1] = float("-inf")

    rewrite_tensors(broken, diverge)
    report = checkpoint.check(broken, pipeline["record"], [2, 4, 5])
    assert report["valid"] is False and "reload_forward" not in report
    assert [p.split(" (")[0] for p in report["problems"]] == [
        "tensor fc.weight: 3 of 12288 values are NaN or infinite",
        "tensor norm.weight: 1 of 64 values are NaN or infinite",
    ]
    assert report["problems"][0].endswith("see train/state/metrics.jsonl; lower train.lr)")


def test_config_problems_are_reported(broken, pipeline):
    config = json.loads((broken / "config.json").read_text())
    config["speculators_config"]["verifier"]["name_or_path"] = "/home/me/models/tiny"
    (broken / "config.json").write_text(json.dumps(config))
    report = checkpoint.check(broken, pipeline["record"], [1, 2, 3])
    assert any("absolute path" in p for p in report["problems"])
    assert any("!= extraction layers [1, 2, 3]" in p for p in report["problems"])


def test_truncated_weights_are_reported(broken, pipeline):
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    report = checkpoint.check(broken, pipeline["record"], [2, 4, 5])
    assert report["valid"] is False
    assert report["problems"][0].startswith("model.safetensors unreadable")


def test_model_card_has_the_vllm_command(pipeline):
    config = json.loads((pipeline["checkpoint"] / "config.json").read_text())
    card = checkpoint.model_card(
        config, pipeline["record"], {"epochs": 2, "train_samples": 36, "device": "cpu"}
    )
    spec = '{"method": "eagle3", "model": "<this folder>", "num_speculative_tokens": 3}'
    assert f"\nvllm serve tiny-llama --speculative-config '{spec}'\n" in card
    assert "(offline, and in vLLM where `serve_check` ran)" in card
    # a verifier that needs its own code: vLLM needs the flag too (as serve_check's command)
    trusted = {**pipeline["record"], "trust_remote_code": True}
    assert "\nvllm serve tiny-llama --trust-remote-code --speculative-config '{" in (
        checkpoint.model_card(config, trusted, {})
    )
    assert "set `VLLM_CPU_KVCACHE_SPACE`" in card and "reports/summary.md" in card
    # a local folder named by its folder's name: the card says what to give vllm serve
    local = {**pipeline["record"], "kind": "local", "path": "/models/tiny-llama"}
    assert "`tiny-llama` is the verifier folder's name" in checkpoint.model_card(config, local, {})
    named = {**local, "name": "org/tiny-llama"}
    assert "folder's name" not in checkpoint.model_card(config, named, {})
    gguf = {**local, "kind": "gguf", "gguf": {"file": "tiny.Q4_1.gguf"}, "name": "org/tiny"}
    assert "The hidden states came from `tiny.Q4_1.gguf`" in checkpoint.model_card(config, gguf, {})


def test_model_card_header_names_a_hub_verifier_as_base_model(pipeline):
    """The YAML header the Hub reads: the verifier as base_model only where its name is a hub
    id; a folder's name would link to a model that is not it."""
    config = json.loads((pipeline["checkpoint"] / "config.json").read_text())

    def header(record):
        card = checkpoint.model_card(config, record, {})
        assert card.startswith("---\n")
        return yaml.safe_load(card.split("---\n")[1])

    tags = ["speculative-decoding", "eagle3", "speculators", "vllm"]
    assert header(pipeline["record"]) == {"tags": tags}  # tiny-llama: a folder's name
    named = {**pipeline["record"], "name": "org-1/tiny_llama.v2"}
    assert header(named) == {"base_model": "org-1/tiny_llama.v2", "tags": tags}
    for not_an_id in ("org/tiny llama", "a/b/c", "/models/tiny", "org/"):
        assert header({**pipeline["record"], "name": not_an_id}) == {"tags": tags}, not_an_id


def rewrite_config(ckpt, fn):
    config = json.loads((ckpt / "config.json").read_text())
    fn(config)
    (ckpt / "config.json").write_text(json.dumps(config))


# catches these mutations: ~ not flagged, drive check obj[1:2], lists not searched
def test_absolute_paths_finds_home_drive_and_nested_list_paths():
    """Every string that starts with '/' or '~', or a Windows drive ('C:\\'), at any depth of
    dicts and lists, named by its dotted/indexed path; relative paths and hub ids pass."""
    config = {
        "name": "org/model",
        "rel": "models/tiny",
        "home": "~/models/tiny",
        "win": "C:\\models\\tiny",
        "nested": {"files": ["ok.json", "/data/x.json"], "deep": [{"p": "~x"}]},
        "num": 3,
        "colon": "a:b",
    }
    assert checkpoint.absolute_paths(config) == [
        "home=~/models/tiny",
        "win=C:\\models\\tiny",
        "nested.files[1]=/data/x.json",
        "nested.deep[0].p=~x",
    ]


def fake_epoch(tmp_path, config):
    """An epoch folder as speculators saves it: config.json and fp32 model.safetensors."""
    epoch = tmp_path / "epoch"
    epoch.mkdir()
    (epoch / "config.json").write_text(json.dumps(config))
    save_file(
        {"fc.weight": torch.ones(2, 3), "d2t": torch.arange(4), "t2d": torch.ones(5, dtype=bool)},
        str(epoch / "model.safetensors"),
        metadata={"format": "pt"},
    )
    return epoch


def epoch_config(**changes):
    config = {
        "dtype": "float32",
        "torch_dtype": "float32",
        "speculators_config": {"verifier": {"name_or_path": "/home/me/models/tiny"}},
        "transformer_layer_config": {"_name_or_path": "/home/me/models/tiny", "hidden_size": 8},
    }
    return config | changes


# catches these mutations: only torch_dtype rewritten, dtype set to "float32", metadata dropped
def test_export_writes_a_bf16_checkpoint_and_says_so_in_its_config(tmp_path):
    """export: the verifier becomes the portable name, the local _name_or_path goes, both
    dtype keys say bfloat16; float tensors become bf16, integer/bool ones (the vocab map) and
    the safetensors metadata are kept as they are."""
    out = tmp_path / "out"
    returned = checkpoint.export(fake_epoch(tmp_path, epoch_config()), out, "org/tiny")
    written = json.loads((out / "config.json").read_text())
    assert (
        returned
        == written
        == {
            "dtype": "bfloat16",
            "torch_dtype": "bfloat16",
            "speculators_config": {"verifier": {"name_or_path": "org/tiny"}},
            "transformer_layer_config": {"hidden_size": 8},
        }
    )
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    assert {k: t.dtype for k, t in tensors.items()} == {
        "fc.weight": torch.bfloat16,
        "d2t": torch.int64,
        "t2d": torch.bool,
    }
    assert tensors["d2t"].tolist() == [0, 1, 2, 3]


# catches these mutations: export no longer refuses a config that carries machine paths
def test_export_refuses_a_config_with_machine_paths_and_writes_nothing(tmp_path):
    """A machine path left anywhere in the config (here a tokenizer path) is a UserError naming
    it, raised before anything is written."""
    epoch = fake_epoch(tmp_path, epoch_config(tokenizer="/home/me/tok"))
    with pytest.raises(UserError, match=r"would carry machine paths: tokenizer=/home/me/tok$"):
        checkpoint.export(epoch, tmp_path / "out", "org/tiny")
    assert not (tmp_path / "out").exists()


# catches these mutations: check_readable catches OSError only: a config.json that is not JSON
# escapes, a missing file's detail as first_line: "[Errno 2] ...: '<path>'", the path twice
def test_check_readable_reports_a_config_that_is_not_json(tmp_path):
    """A missing config.json is one line naming it once with the OS's reason; one that does
    not parse, or parses to something other than an object, is the same UserError; weights
    that do not parse are the weights' one."""
    redo = f"delete {tmp_path} and rerun the workflow to retrain it"
    with pytest.raises(UserError) as missing:
        checkpoint.check_readable(tmp_path)
    assert str(missing.value) == (
        f"{tmp_path / 'config.json'}: unreadable checkpoint config (No such file or directory); "
        f"{redo}"
    )
    (tmp_path / "config.json").write_text('{"speculators_model_type": "eag')
    with pytest.raises(UserError, match=r"config.json: unreadable checkpoint config \("):
        checkpoint.check_readable(tmp_path)
    (tmp_path / "config.json").write_text("[]")  # JSON, but what speculators cannot load
    with pytest.raises(UserError) as not_an_object:
        checkpoint.check_readable(tmp_path)
    assert str(not_an_object.value) == (
        f"{tmp_path / 'config.json'}: unreadable checkpoint config (a JSON list, not an "
        f"object); {redo}"
    )
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(UserError, match=r"model.safetensors: unreadable checkpoint weights"):
        checkpoint.check_readable(tmp_path)


# catches these mutations: check() catches OSError only: a damaged config.json raises instead of a
# report
def test_check_reports_a_config_that_is_not_json(broken, pipeline):
    """check never raises for a bad checkpoint: a config.json cut short is its one problem."""
    (broken / "config.json").write_text('{"speculators_model_type": "eag')
    report = checkpoint.check(broken, pipeline["record"], [2, 4, 5])
    assert report["valid"] is False
    assert len(report["problems"]) == 1
    assert report["problems"][0].startswith("config.json unreadable: ")


# catches these mutations: REQUIRED_FIELDS[1:], norm_before_residual not required
@pytest.mark.parametrize(
    "field",
    [  # spelled out: a field dropped from REQUIRED_FIELDS must fail here
        "speculators_model_type",
        "transformer_layer_config",
        "draft_vocab_size",
        "norm_before_residual",
        "eagle_aux_hidden_state_layer_ids",
        "speculators_config",
    ],
)
def test_every_required_config_field_is_checked(broken, pipeline, field):
    """A config.json without one of the fields vLLM and speculators read is reported by name."""
    rewrite_config(broken, lambda c: c.pop(field))
    report = checkpoint.check(broken, pipeline["record"], [2, 4, 5])
    assert report["valid"] is False
    assert f"config.json lacks {field}" in report["problems"]


# catches these mutations: type not checked, empty verifier name, aux ids order-insensitive,
# hidden_size not checked, vocab_size not checked
@pytest.mark.parametrize(
    ("damage", "record_changes", "aux", "problem"),
    [
        (
            lambda c: c.update(speculators_model_type="eagle"),
            {}, [2, 4, 5], "speculators_model_type is 'eagle'",
        ),
        (
            lambda c: c["speculators_config"]["verifier"].update(name_or_path=""),
            {}, [2, 4, 5], "speculators_config.verifier.name_or_path is empty (vLLM requires it)",
        ),
        (None, {}, [5, 4, 2], "eagle_aux_hidden_state_layer_ids [2, 4, 5] != extraction layers [5, 4, 2]"),
        (None, {"hidden_size": 32}, [2, 4, 5], "hidden_size 64 != verifier 32"),
        (None, {"vocab_size": 300}, [2, 4, 5], "vocab_size 400 != verifier 300"),
    ],
)  # fmt: skip
def test_config_mismatches_are_reported(broken, pipeline, damage, record_changes, aux, problem):
    """Each config.json field that does not fit speculators, vLLM or the verifier (its type, an
    empty verifier name, the aux layers in another order, hidden or vocab size) is a problem
    of its own, in these words."""
    if damage:
        rewrite_config(broken, damage)
    report = checkpoint.check(broken, {**pipeline["record"], **record_changes}, aux)
    assert report["valid"] is False
    assert problem in report["problems"], report["problems"]


# catches these mutations: unexpected tensors not reported, d2t without t2d: check raises
# TypeError, missing map condition inverted
@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (
            lambda t: t.update({"extra.weight": torch.zeros(2, dtype=torch.bfloat16)}),
            "unexpected tensor extra.weight",
        ),
        (lambda t: t.pop("t2d"), "d2t/t2d missing although draft_vocab_size != verifier vocab"),
        (lambda t: t.pop("d2t"), "d2t/t2d missing although draft_vocab_size != verifier vocab"),
        (lambda t: t.update(d2t=t["d2t"][0]), "d2t has shape [], t2d"),  # len() would raise
    ],
)
def test_extra_tensors_and_a_half_vocab_map_are_reported(broken, pipeline, damage, problem):
    """A tensor the config does not imply, a vocab map with only one of d2t/t2d while the
    draft vocab is smaller than the verifier's, or a d2t that is not 1-D makes the checkpoint
    invalid."""
    rewrite_tensors(broken, damage)
    report = checkpoint.check(broken, pipeline["record"], [2, 4, 5])
    assert report["valid"] is False
    assert [p for p in report["problems"] if p.startswith(problem)], report["problems"]


# catches these mutations: the report's draft_vocab_size taken from
# transformer_layer_config.vocab_size
def test_check_report_summarises_the_config(broken, pipeline):
    """The report's facts are config.json's: k, draft vocab, aux layers, verifier name."""
    rewrite_tensors(broken, lambda t: t.pop("fc.weight"))  # invalid: no reload, facts only
    report = checkpoint.check(broken, pipeline["record"], [2, 4, 5])
    assert {k: report[k] for k in ("speculative_tokens", "draft_vocab_size", "aux_layer_ids", "verifier")} == {
        "speculative_tokens": 3,
        "draft_vocab_size": 256,
        "aux_layer_ids": [2, 4, 5],
        "verifier": "tiny-llama",
    }  # fmt: skip


# catches these mutations: (t < k) -> (t <= k): a proposal equal to the draft vocab size accepted
@pytest.mark.parametrize(("proposed", "ok"), [(9, True), (0, True), (10, False), (-1, False)])
def test_reload_forward_flags_proposals_outside_the_draft_vocab(monkeypatch, proposed, ok):
    """Proposed ids must lie in [0, draft_vocab_size): id 10 of a 10-token draft vocab, or a
    negative id, is the problem; the report records the forward's TTT steps and shape."""
    calls = []

    def draft(**kwargs):
        calls.append(kwargs)
        return [torch.tensor([[1, 2]]), torch.tensor([[3, proposed]])]

    monkeypatch.setattr(checkpoint, "load_draft", lambda *a: draft)
    report = {"speculative_tokens": 2, "draft_vocab_size": 10}
    record = {"hidden_size": 4, "vocab_size": 20}
    problems = checkpoint._reload_forward(None, record, [1, 2, 3], report)
    assert problems == ([] if ok else ["reloaded draft proposes ids outside the draft vocab"])
    assert report["reload_forward"] == {"ttt_steps": 2, "shape": [1, 2]}
    assert calls[0]["hidden_states"].shape == (1, 8, 12) and calls[0]["ttt_steps"] == 2


# catches these mutations: hub id regex loosened to [\w.-]+/[\w.-]+
def test_model_card_header_takes_no_relative_path_for_a_hub_id(pipeline):
    """'./tiny', '../tiny' and names starting with '-', '.' or '_' are not hub ids: no
    base_model in the card's header."""
    config = json.loads((pipeline["checkpoint"] / "config.json").read_text())
    for name in ("./tiny", "../tiny", "-org/tiny", "org/.tiny", "_org/tiny"):
        card = checkpoint.model_card(config, {**pipeline["record"], "name": name}, {})
        assert "base_model" not in yaml.safe_load(card.split("---\n")[1]), name
