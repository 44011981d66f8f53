"""The checkpoint contract's smaller promises (eagle3lib/checkpoint.py): the bytes export writes,
what check reports for a checkpoint it cannot reload, the model card's table and header.

No draft is trained here: the checkpoints are built from the shapes their config implies
(zeros, a valid vocab map) and the verifier is a stand-in, its config.json only (check reads
the verifier's config before anything else; none of these checkpoints gets as far as reloading
it)."""

import contextlib
import copy
import json

import pytest
import torch
import yaml
from safetensors import SafetensorError
from safetensors.torch import save_file

from eagle3lib import checkpoint
from eagle3lib.errors import UserError

# A tiny draft's config.json as speculators writes it (trimmed to what building it reads)
DRAFT_CONFIG = {
    "architectures": ["Eagle3DraftModel"],
    "draft_vocab_size": 256,
    "dtype": "bfloat16",
    "eagle_aux_hidden_state_layer_ids": [2, 4, 5],
    "norm_before_residual": True,
    "speculators_config": {
        "algorithm": "eagle3",
        "default_proposal_method": "greedy",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
        "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": "tiny-llama"},
    },
    "speculators_model_type": "eagle3",
    "transformer_layer_config": {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_hidden_layers": 1,
        "vocab_size": 400,
        "max_position_embeddings": 2048,
    },
}


@pytest.fixture(scope="module")
def stand_in_record(tmp_path_factory):
    """A verifier record whose folder holds only a Llama config.json (hidden 64, vocab 400)."""
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("verifier") / "tiny-llama"
    LlamaConfig(
        vocab_size=400,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
    ).save_pretrained(folder)
    return {
        "name": "tiny-llama",
        "load_path": str(folder),
        "trust_remote_code": False,
        "hidden_size": 64,
        "vocab_size": 400,
    }


def write_checkpoint(folder, config=DRAFT_CONFIG):
    """config.json and a bf16 model.safetensors of the shapes DRAFT_CONFIG implies (zeros),
    with a vocab map of the first 256 verifier ids."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(DRAFT_CONFIG))
    expected, problems = checkpoint._expected_shapes(folder)
    assert problems == []
    tensors = {k: torch.zeros(s, dtype=torch.bfloat16) for k, s in expected.items()}
    tensors |= {"d2t": torch.zeros(256, dtype=torch.long), "t2d": torch.arange(400) < 256}
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


# catches these mutations: config.json written without sort_keys, without indent, without its
# final newline; "dtype" added to a config that only had "torch_dtype"
def test_export_writes_config_json_as_indented_sorted_json_and_adds_no_keys(tmp_path):
    """export's config.json is the same bytes wherever it runs: two-space indented, keys sorted,
    one final newline; only the dtype keys the config has are rewritten (none is added)."""
    epoch = tmp_path / "epoch"
    epoch.mkdir()
    config = {
        "torch_dtype": "float32",
        "transformer_layer_config": {"hidden_size": 8, "_name_or_path": "/home/me/tiny"},
        "speculators_config": {"verifier": {"name_or_path": "/home/me/tiny"}},
        "draft_vocab_size": 4,
    }
    (epoch / "config.json").write_text(json.dumps(config))
    save_file({"fc.weight": torch.ones(2, 3)}, str(epoch / "model.safetensors"))
    checkpoint.export(epoch, tmp_path / "out", "org/tiny")
    assert (tmp_path / "out" / "config.json").read_text() == (
        "{\n"
        '  "draft_vocab_size": 4,\n'
        '  "speculators_config": {\n'
        '    "verifier": {\n'
        '      "name_or_path": "org/tiny"\n'
        "    }\n"
        "  },\n"
        '  "torch_dtype": "bfloat16",\n'
        '  "transformer_layer_config": {\n'
        '    "hidden_size": 8\n'
        "  }\n"
        "}\n"
    )


# catches these mutations: export writing config.json before the weights
def test_export_writes_no_config_when_the_weights_cannot_be_read(tmp_path):
    """config.json is written last: an epoch whose weights do not parse leaves no config.json
    (nor a temporary) that would look like a checkpoint."""
    epoch = tmp_path / "epoch"
    epoch.mkdir()
    config = {"speculators_config": {"verifier": {}}, "transformer_layer_config": {}}
    (epoch / "config.json").write_text(json.dumps(config))
    (epoch / "model.safetensors").write_bytes(b"\x40\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(SafetensorError):
        checkpoint.export(epoch, tmp_path / "out", "org/tiny")
    assert list((tmp_path / "out").iterdir()) == []


# catches these mutations: load_draft not checking the files first (speculators' own error)
def test_load_draft_names_unreadable_weights_in_one_line(tmp_path):
    """load_draft checks the files before speculators reads them: weights cut short are the
    one-line UserError naming them and what to do."""
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"\x40\x00\x00\x00")
    with pytest.raises(UserError, match=r"model.safetensors: unreadable checkpoint weights \("):
        checkpoint.load_draft(tmp_path, {}, "sdpa", torch.float32)


# catches these mutations: the reloaded draft left in training mode; the verifier's path or the
# attention implementation not handed to speculators
def test_load_draft_hands_the_verifier_and_attention_and_returns_the_draft_in_eval_mode(
    tmp_path, monkeypatch
):
    """load_draft reads the config, points its verifier at the record's load_path (where the
    verifier's norm and LM head are), sets the attention implementation, and returns the draft
    in eval mode. speculators' from_pretrained is a stand-in that records what it is given and
    returns a module in training mode; the verifier's tensors are not read."""
    from speculators.models.eagle3 import Eagle3DraftModel

    from eagle3lib import lm_weights

    given = {}

    def from_pretrained(path, config, dtype):
        given.update(path=path, config=config, dtype=dtype)
        return torch.nn.Linear(1, 1)

    monkeypatch.setattr(Eagle3DraftModel, "from_pretrained", from_pretrained)
    monkeypatch.setattr(lm_weights, "speculators_reads", lambda record: contextlib.nullcontext())
    ckpt = write_checkpoint(tmp_path / "ckpt")
    record = {"load_path": "/models/tiny-llama"}
    draft = checkpoint.load_draft(ckpt, record, "eager", torch.bfloat16)
    assert draft.training is False
    assert (given["path"], given["dtype"]) == (str(ckpt), torch.bfloat16)
    assert given["config"].speculators_config.verifier.name_or_path == "/models/tiny-llama"
    assert given["config"].transformer_layer_config._attn_implementation == "eager"


# catches these mutations: check not registering a custom-code verifier's config class
def test_check_registers_a_custom_code_verifiers_config_for_speculators(tmp_path):
    """speculators reads the verifier's config without trust_remote_code: check registers a
    trusted custom-code verifier's config class first (even for a checkpoint it then finds
    unreadable), so that AutoConfig reads that folder without it. The verifier is a stand-in:
    a folder with a config.json and its configuration module, no weights."""
    from transformers import AutoConfig

    folder = tmp_path / "custom-verifier"
    folder.mkdir()
    (folder / "configuration_audit.py").write_text(
        "from transformers import PretrainedConfig\n\n\n"
        "class AuditTinyConfig(PretrainedConfig):\n"
        '    model_type = "audit_tiny_custom"\n'
    )
    auto_map = {"AutoConfig": "configuration_audit.AuditTinyConfig"}
    config = {"model_type": "audit_tiny_custom", "auto_map": auto_map, "hidden_size": 64}
    (folder / "config.json").write_text(json.dumps(config))
    record = {"load_path": str(folder), "trust_remote_code": True}
    report = checkpoint.check(tmp_path / "no-checkpoint", record, [2, 4, 5])
    assert report["valid"] is False
    assert type(AutoConfig.from_pretrained(folder)).__name__ == "AuditTinyConfig"


# catches these mutations: the draft reloaded while other problems are known; the report's
# tensor dtypes not read from the file; the report not naming the checkpoint
def test_check_reloads_nothing_once_a_problem_is_found_and_lists_every_tensor(
    tmp_path, stand_in_record
):
    """A checkpoint whose only fault is a hidden size other than the verifier's has that one
    problem: no reload is tried (the report has no reload_forward). The report names the
    checkpoint and lists every tensor of the file with its shape and safetensors dtype."""
    ckpt = write_checkpoint(tmp_path / "ckpt")
    report = checkpoint.check(ckpt, {**stand_in_record, "hidden_size": 32}, [2, 4, 5])
    assert report["problems"] == ["hidden_size 64 != verifier 32"]
    assert report["valid"] is False and "reload_forward" not in report
    assert report["checkpoint"] == str(ckpt)
    tensors = report["tensors"]
    assert list(tensors) == sorted(tensors) and len(tensors) == 16
    assert tensors["d2t"] == {"shape": [256], "dtype": "I64"}
    assert tensors["t2d"] == {"shape": [400], "dtype": "BOOL"}
    assert tensors["fc.weight"] == {"shape": [64, 3 * 64], "dtype": "BF16"}


# catches these mutations: a config that does not build not reported; every tensor then
# reported as unexpected
def test_check_reports_a_config_that_does_not_build_a_draft_once(tmp_path, stand_in_record):
    """A config speculators rejects (a transformer layer of an unknown model type) is one
    problem, not one per tensor: without the shapes it implies, no tensor is unexpected."""
    config = copy.deepcopy(DRAFT_CONFIG)
    config["transformer_layer_config"]["model_type"] = "no-such-model"
    ckpt = write_checkpoint(tmp_path / "ckpt", config)
    report = checkpoint.check(ckpt, stand_in_record, [2, 4, 5])
    assert report["valid"] is False
    assert len(report["problems"]) == 1, report["problems"]
    assert report["problems"][0].startswith("config does not build an Eagle3DraftModel: ")


# catches these mutations: check raising (TypeError) for a config without proposal methods
def test_check_reports_a_config_without_proposal_methods(tmp_path, stand_in_record):
    """A config.json without speculators_config.proposal_methods is a finding (the report's k
    is None), not an exception."""
    config = copy.deepcopy(DRAFT_CONFIG)
    del config["speculators_config"]["proposal_methods"]
    report = checkpoint.check(write_checkpoint(tmp_path / "ckpt", config), stand_in_record, [2])
    assert report["valid"] is False and report["speculative_tokens"] is None


# catches these mutations: the forward given 3 aux layers' states whatever the layer ids; no
# TTT step (int(None)) when the config names no speculative tokens
def test_reload_forward_feeds_one_hidden_state_per_aux_layer(monkeypatch):
    """The forward's input holds one verifier hidden state per aux layer (2 layers of hidden 4:
    8 wide), and it runs one TTT step where the config gives no k. The draft is a stand-in that
    records its arguments."""
    calls = []

    def draft(**kwargs):
        calls.append(kwargs)
        return [torch.tensor([[1, 2]])]

    monkeypatch.setattr(checkpoint, "load_draft", lambda *a: draft)
    report = {"speculative_tokens": None, "draft_vocab_size": 10}
    problems = checkpoint._reload_forward(
        None, {"hidden_size": 4, "vocab_size": 20}, [3, 7], report
    )
    assert problems == []
    assert calls[0]["hidden_states"].shape == (1, 8, 8) and calls[0]["ttt_steps"] == 1
    assert report["reload_forward"] == {"ttt_steps": 1, "shape": [1, 2]}


def test_no_vocab_map_is_right_for_a_draft_of_the_verifiers_vocab():
    """A draft whose vocab is the verifier's needs no d2t/t2d: their absence is no problem."""
    assert checkpoint._vocab_map_problems(None, None, 400, 400) == []


CARD_CONFIG = {
    "draft_vocab_size": 256,
    "eagle_aux_hidden_state_layer_ids": [2, 4, 5],
    "speculators_config": {"proposal_methods": [{"speculative_tokens": 3}]},
    "transformer_layer_config": {
        "num_hidden_layers": 1,
        "model_type": "llama",
        "hidden_size": 64,
        "vocab_size": 400,
    },
}


# catches these mutations: the config hash cut to 8 characters; draft and verifier vocab
# swapped; epochs and samples swapped; aux layers left out
def test_model_card_table_says_what_the_draft_is_and_how_it_was_trained():
    """The card's table: draft layers (and type), hidden size, draft vocab of the verifier's,
    aux layers, k, and the training's epochs, samples and device; the verifier's config hash
    is named by its first 16 hex digits."""
    record = {"name": "org/tiny", "config_sha256": "0123456789abcdef" + "f" * 48, "kind": "hub"}
    stats = {"epochs": 2, "train_samples": 36, "device": "cpu"}
    card = checkpoint.model_card(CARD_CONFIG, record, stats)
    assert "(config sha256 `0123456789abcdef…`)" in card
    table = [line for line in card.splitlines() if line.startswith("| ")]
    assert table == [
        "| field | value |",
        "| draft layers | 1 (llama) |",
        "| hidden size | 64 |",
        "| draft vocab | 256 of 400 |",
        "| aux layers | [2, 4, 5] |",
        "| speculative tokens (TTT steps) | 3 |",
        "| training | 2 epochs, 36 samples, cpu |",
    ]


# catches these mutations: hub ids that start with a digit, or have a one-character part, not
# taken as hub ids
@pytest.mark.parametrize("name", ["01-ai/Yi-6B", "X/y"])
def test_model_card_header_takes_hub_ids_of_digits_and_single_characters(name):
    """Hub ids as HUB_ID describes them (owner/name, each starting with a letter or digit):
    one starting with a digit, or of one character each, is the card's base_model."""
    record = {"name": name, "config_sha256": "0" * 64, "kind": "hub"}
    card = checkpoint.model_card(CARD_CONFIG, record, {})
    assert yaml.safe_load(card.split("---\n")[1])["base_model"] == name


# catches these mutations: a GGUF record without its file's name raising KeyError/TypeError
def test_model_card_of_a_gguf_verifier_without_a_file_name():
    """A GGUF verifier's record without the file's name: the card says 'a GGUF file'."""
    record = {"name": "org/tiny", "config_sha256": "0" * 64, "kind": "gguf", "gguf": None}
    card = checkpoint.model_card(CARD_CONFIG, record, {})
    assert "The hidden states came from `a GGUF file`, converted" in card
