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
        tie_word_embeddings=False,
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
