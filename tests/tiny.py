"""A tiny random Llama verifier with a locally trained tokenizer and a ChatML template,
plus synthetic chat data: everything the tests need, built in seconds with no model hub."""

from __future__ import annotations

import json
import random
from pathlib import Path

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Like Qwen3: earlier assistant turns lose their <think> block, so history is not prefix-stable.
THINK_TEMPLATE = (
    "{% for message in messages %}"
    "{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' and not loop.last %}"
    "{% set content = content.split('</think>')[-1].lstrip() %}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + content + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

WORDS = (
    "the a an model draft token verifier speculative decoding fast slow train data hidden "
    "state layer shard vocab map check report python code write read list dict answer "
    "question please tell me about how why what when where is are was were be to of in "
    "on for with and or not yes no good bad small large number one two three four five "
    "six seven eight nine ten hello thanks sure here it this that you we they I explain"
).split()


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def conversations(n: int, seed: int = 0, fmt: str = "sharegpt") -> list[dict]:
    """n synthetic multi-turn conversations in ShareGPT or OpenAI format."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        turns = []
        for _ in range(rng.randint(1, 3)):
            turns.append(("user", sentence(rng, rng.randint(4, 12))))
            turns.append(
                ("assistant", " ".join(sentence(rng, rng.randint(5, 15)) for _ in range(2)))
            )
        if fmt == "sharegpt":
            role = {"user": "human", "assistant": "gpt"}
            out.append(
                {"id": f"c{i}", "conversations": [{"from": role[r], "value": t} for r, t in turns]}
            )
        else:
            out.append({"id": f"c{i}", "messages": [{"role": r, "content": t} for r, t in turns]})
    return out


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def build_tokenizer(path: Path, template: str = CHATML):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(1)
    corpus = [sentence(rng, 20) for _ in range(400)] + [" ".join(WORDS)] * 5
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = template
    fast.save_pretrained(path)
    return fast


def build_verifier(
    path: Path,
    seed: int = 0,
    layers: int = 8,
    template: str = CHATML,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    tie_word_embeddings: bool = False,
) -> Path:
    """A random LlamaForCausalLM saved as safetensors with its tokenizer.

    vLLM's CPU attention needs head_dim >= 32: use hidden=128, heads=2 for vLLM tests."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(path, template)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger weights than the default init: less uniform logits
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    model.save_pretrained(path)
    return path


def edit_weights(folder: Path, add: dict | None = None, drop: tuple[str, ...] = ()) -> Path:
    """Add tensors to (or drop tensors from) a verifier's model.safetensors, in place."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    for key in drop:
        del tensors[key]
    tensors.update(add or {})
    save_file(tensors, str(path), metadata={"format": "pt"})
    return folder


def write_config(
    path: Path, run: str, verifier: Path, train_path: Path, eval_path: Path, **overrides
) -> Path:
    """A workflow config for the tiny verifier; ``overrides`` are merged section by section."""
    import yaml

    config = {
        "run": run,
        "verifier": {"path": str(verifier)},
        "data": {
            "train": {"path": str(train_path)},
            "eval": {"path": str(eval_path), "max_prompts": 3},
            "max_length": 128,
        },
        "extract": {"shards": 2, "batch_tokens": 512},
        "train": {
            "epochs": 1,
            "total_seq_len": 256,
            "draft_vocab_size": 256,
            "optimizer": "adamw",
            "log_every": 1,
        },
        "evaluate": {"k": 3, "max_new_tokens": 12},
        # vLLM's CPU attention needs head_dim >= 32 (the default tiny verifier has 16):
        # tests/test_vllm.py turns it on with a vLLM-compatible tiny verifier.
        "serve_check": {"enabled": False},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):  # merged, not replaced
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


# ---- nested (multimodal) verifiers: the language model's config is the ``text_config`` ------


def _randomize(model, std: float = 0.08) -> None:
    """Larger weights than the default init (as build_verifier): less uniform logits."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, std)


def build_qwen_vl_verifier(
    path: Path, seed: int = 0, layers: int = 8, hidden: int = 64, heads: int = 4
) -> Path:
    """A random Qwen3-VL (vision tower + Qwen3 text model, config nests ``text_config``)
    saved as safetensors with the tiny tokenizer. transformers maps it to
    AutoModelForImageTextToText only (no causal-LM class), like the real Qwen-VL models."""
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(path)
    head_dim = hidden // heads
    config = Qwen3VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": hidden,
            "intermediate_size": 2 * hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": heads // 2,
            "head_dim": head_dim,
            "max_position_embeddings": 2048,
            # interleaved M-RoPE sections (temporal, height, width) over head_dim / 2
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [head_dim // 4, head_dim // 8, head_dim // 8],
                "mrope_interleaved": True,
            },
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
            "bos_token_id": None,
        },
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "patch_size": 4,
            "out_hidden_size": hidden,
            "num_position_embeddings": 16,
            "deepstack_visual_indexes": [0],
        },
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config)
    _randomize(model)
    model.save_pretrained(path)
    return path


KIMI_CONFIGURATION = '''"""Tiny stand-in for Kimi-K2.5's remote configuration code (tests only): a multimodal
config whose ``text_config`` is a DeepSeek-V3 config (MLA attention, MoE feed-forward)."""

from transformers import DeepseekV3Config, PretrainedConfig


class TinyKimiK25Config(PretrainedConfig):
    model_type = "tiny_kimi_k25"

    def __init__(self, text_config=None, vision_config=None, media_placeholder_token_id=None,
                 **kwargs):
        if isinstance(text_config, dict):
            text_config = DeepseekV3Config(**text_config)
        self.text_config = text_config if text_config is not None else DeepseekV3Config()
        self.vision_config = vision_config or {"hidden_size": 16, "patch_size": 4, "channels": 3}
        self.media_placeholder_token_id = media_placeholder_token_id
        super().__init__(**kwargs)
'''

KIMI_MODELING = '''"""Tiny stand-in for Kimi-K2.5's remote modeling code (tests only): a vision tower and a
projector around transformers' DeepseekV3ForCausalLM, stored as ``language_model`` (the
layout of the real checkpoint: language_model.model.layers.*, language_model.lm_head)."""

from torch import nn
from transformers import DeepseekV3ForCausalLM, GenerationMixin, PreTrainedModel

from .configuration_tiny_kimi_k25 import TinyKimiK25Config


class TinyVisionTower(nn.Module):
    def __init__(self, vision):
        super().__init__()
        width = vision["hidden_size"]
        self.patch_embed = nn.Linear(vision["channels"] * vision["patch_size"] ** 2, width)
        self.blocks = nn.ModuleList([nn.Linear(width, width)])
        self.final_layernorm = nn.LayerNorm(width)

    def forward(self, patches):
        x = self.patch_embed(patches)
        for block in self.blocks:
            x = x + block(x).relu()
        return self.final_layernorm(x)


class TinyKimiK25ForConditionalGeneration(PreTrainedModel, GenerationMixin):
    config_class = TinyKimiK25Config
    base_model_prefix = "language_model"
    _no_split_modules = ["DeepseekV3DecoderLayer"]
    _supports_sdpa = True

    def __init__(self, config):
        super().__init__(config)
        text_hidden = config.text_config.hidden_size
        self.vision_tower = TinyVisionTower(config.vision_config)
        self.mm_projector = nn.Sequential(
            nn.LayerNorm(config.vision_config["hidden_size"]),
            nn.Linear(config.vision_config["hidden_size"], text_hidden),
        )
        self.language_model = DeepseekV3ForCausalLM(config.text_config)
        self.post_init()

    def get_input_embeddings(self):
        return self.language_model.get_input_embeddings()

    def get_output_embeddings(self):
        return self.language_model.get_output_embeddings()

    def forward(self, input_ids=None, pixel_values=None, **kwargs):
        if pixel_values is not None:
            raise NotImplementedError("the tiny stand-in takes text only")
        return self.language_model(input_ids=input_ids, **kwargs)
'''


def deepseek_v3_text_config(tokenizer, layers: int, hidden: int, heads: int) -> dict:
    """A tiny DeepSeek-V3 text config (Kimi-K2.5's language model): MLA attention (q/kv LoRA
    ranks, split rope/nope heads) and MoE (routed + shared experts, top-2 routing), the first
    layer dense and the others MoE."""
    return {
        "model_type": "deepseek_v3",
        "vocab_size": len(tokenizer),
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "moe_intermediate_size": hidden // 2,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "q_lora_rank": hidden // 2,
        "kv_lora_rank": hidden // 4,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 16,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": None,
    }


def build_kimi_verifier(
    path: Path,
    seed: int = 0,
    layers: int = 8,
    hidden: int = 64,
    heads: int = 4,
    custom_code: bool = True,
) -> Path:
    """A random Kimi-K2.5-style verifier: an outer multimodal config nesting a DeepSeek-V3
    ``text_config`` (see deepseek_v3_text_config), a vision tower, and the language model.

    custom_code=True (the hub's form): config.json names the folder's own configuration and
    modeling files in ``auto_map`` under a model type transformers does not know, so loading
    needs trust_remote_code=True. custom_code=False: transformers' own Kimi_K25 classes
    (AutoModelForImageTextToText), as a transformers with Kimi-K2.5 support loads the hub
    checkpoint without custom code."""
    import torch

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(path)
    text_config = deepseek_v3_text_config(tokenizer, layers, hidden, heads)
    special = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    torch.manual_seed(seed)
    if custom_code:
        model = _custom_code_kimi(path, text_config, len(tokenizer), special)
    else:
        from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

        vision = {
            "num_hidden_layers": 1,
            "hidden_size": 32,
            "num_attention_heads": 2,
            "intermediate_size": 64,
            "patch_size": 4,
            "pos_emb_height": 4,
            "pos_emb_width": 4,
            "pos_emb_time": 1,
        }
        config = Kimi_K25Config(
            text_config=text_config,
            vision_config=vision,
            projection_hidden_size=32,
            tie_word_embeddings=False,
            **special,
        )
        model = Kimi_K25ForConditionalGeneration(config)
    _randomize(model)
    model.save_pretrained(path)
    return path


def _custom_code_kimi(path: Path, text_config: dict, vocab: int, special: dict):
    from transformers import AutoConfig, AutoModelForCausalLM

    (path / "configuration_tiny_kimi_k25.py").write_text(KIMI_CONFIGURATION)
    (path / "modeling_tiny_kimi_k25.py").write_text(KIMI_MODELING)
    config_json = {
        "model_type": "tiny_kimi_k25",
        "architectures": ["TinyKimiK25ForConditionalGeneration"],
        "auto_map": {
            "AutoConfig": "configuration_tiny_kimi_k25.TinyKimiK25Config",
            "AutoModel": "modeling_tiny_kimi_k25.TinyKimiK25ForConditionalGeneration",
            "AutoModelForCausalLM": "modeling_tiny_kimi_k25.TinyKimiK25ForConditionalGeneration",
        },
        "text_config": text_config,
        "vision_config": {"hidden_size": 16, "patch_size": 4, "channels": 3},
        "media_placeholder_token_id": vocab + 1000,  # never in text
        "tie_word_embeddings": False,
        **special,
    }
    (path / "config.json").write_text(json.dumps(config_json, indent=2))
    config = AutoConfig.from_pretrained(path, trust_remote_code=True)
    return AutoModelForCausalLM.from_config(config, trust_remote_code=True)


# ---- a GGUF verifier: the tiny Llama written as llama.cpp's converter writes it --------------

# Hugging Face Llama tensor names -> GGUF names (llama.cpp's convert_hf_to_gguf mapping).
_GGUF_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(key: str) -> str:
    stem = key.removesuffix(".weight")
    if stem in _GGUF_NAMES:
        return f"{_GGUF_NAMES[stem]}.weight"
    _, _, layer, rest = stem.split(".", 3)  # model.layers.<i>.<rest>
    return f"blk.{layer}.{_GGUF_NAMES[rest]}.weight"


def _permute_rope(weights, heads: int):
    """llama.cpp stores q/k rows interleaved for its RoPE (transformers reverses it on load)."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def build_gguf(path: Path, verifier: Path) -> Path:
    """The tiny Llama of ``verifier`` (build_verifier) as an f32 GGUF file with its byte-level
    BPE tokenizer and chat template, as llama.cpp's convert_hf_to_gguf lays one out."""
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((verifier / "config.json").read_text())
    tok = json.loads((verifier / "tokenizer.json").read_text())
    tok_config = json.loads((verifier / "tokenizer_config.json").read_text())
    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in tok["added_tokens"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    template = (verifier / "chat_template.jinja").read_text()

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(verifier.name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_dimension_count(config["hidden_size"] // config["num_attention_heads"])
    writer.add_rope_freq_base(float(config.get("rope_theta") or 10000.0))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(len(tokens))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    )
    writer.add_token_merges(merges)
    writer.add_eos_token_id(vocab[tok_config["eos_token"]])
    writer.add_pad_token_id(vocab[tok_config["pad_token"]])
    writer.add_add_bos_token(False)
    writer.add_chat_template(template)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    for key, value in load_file(str(verifier / "model.safetensors")).items():
        if key.endswith("q_proj.weight"):
            value = _permute_rope(value, heads)
        elif key.endswith("k_proj.weight"):
            value = _permute_rope(value, kv_heads)
        writer.add_tensor(_gguf_name(key), value.astype("float32"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
