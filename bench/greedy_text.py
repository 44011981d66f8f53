"""What the draft of a regenerated SmolLM2 run trains and is validated on, against what it is
evaluated on (BENCHMARKS.md, "Where acceptance is lost"): three checks that need no draft.

- repeats: among the first ``--conversations`` usable conversations of the packaged ShareGPT
  file, how many repeat an earlier one's first prompt (conversations.first_prompt_key, what
  ``data.train.dedupe`` drops), and how many of the last ``--val-fraction`` of them (about
  what training's validation holds out) repeat one before them.
- regenerated: with ``--regenerated`` (a run's regenerated/conversations.jsonl[.gz]), how
  repetitive its answers are (the share of tokens closing a 4-gram of token ids already seen in
  the same answer) and how many stop at ``--max-new-tokens``, all of them and those of the
  last ``--val-fraction`` of the conversations.
- greedy: the verifier's greedy answers (fp32) to MT-bench's first turns and to held-out
  ShareGPT first turns (usable conversations after the first ``--conversations``), the same
  figures, per prompt in ``--json``.

    python bench/greedy_text.py --verifier results/smollm2-gpu/verifier/verifier.json \
        --conversations 17000 --regenerated regenerated.jsonl.gz --prompts 80 --json g.json

With ``--synthetic N``: N user prompts sampled from the verifier as regeneration samples them
(``regenerate.synthetic_prompts``, seed 0), how many are kept, their length, and the verifier's
greedy answers to the first ``--prompts`` of them as a third set; ``--system`` samples them
under system prompts (``regenerate.synthetic_system_prompts``), and ``code_share`` is the
share of each set's prompts that name code (a word match).

With ``--acceptance`` (a run's reports/acceptance.json, whose headline set is MT-bench): that
run's acceptance length pooled over the MT-bench answers with at least 30 % repeated 4-grams
and over the others, from the greedy answers decoded here or read back with ``--greedy-json``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from acceptance_gap import MTBENCH, SHAREGPT, repeated_4gram_share  # noqa: E402

from eagle3lib import data, verifier  # noqa: E402
from eagle3lib import regenerate as rg  # noqa: E402
from eagle3lib.config import RegenerateConfig, resolve_package_path  # noqa: E402
from eagle3lib.conversations import (  # noqa: E402
    InvalidRecord,
    first_prompt_key,
    normalize_conversation,
    read_eval_prompts,
    read_records,
)
from eagle3lib.regenerate import hf_generate  # noqa: E402

CODE_WORDS = re.compile(
    r"\b(python|code|function|script|program|def|class|javascript|java|sql|html|css|regex)\b",
    re.IGNORECASE,
)


def text_figures(answers: list[list[int]], limit: int) -> dict:
    shares = [repeated_4gram_share(a) for a in answers]
    return {
        "answers": len(answers),
        "mean_new_tokens": round(statistics.mean(map(len, answers)), 1),
        "repeated_4gram_share": round(statistics.mean(shares), 3),
        "answers_at_least_0.3_repeated": round(sum(s >= 0.3 for s in shares) / len(shares), 3),
        "answers_at_the_limit": round(sum(len(a) >= limit - 1 for a in answers) / len(answers), 3),
    }


def usable_conversations() -> list[list[dict[str, str]]]:
    """The packaged file's conversations with a user turn, in file order."""
    out = []
    for _, record in read_records(resolve_package_path(SHAREGPT), allow_truncated_json=True):
        try:
            messages = normalize_conversation(record)
        except InvalidRecord:
            continue
        if first_prompt_key(messages) is not None:
            out.append(messages)
    return out


def repeats(conversations, n: int, val_fraction: float) -> dict:
    keys = [first_prompt_key(c) for c in conversations[:n]]
    n_val = round(len(keys) * val_fraction)
    before = set(keys[:-n_val])
    return {
        "conversations": len(keys),
        "repeating_an_earlier_first_prompt": len(keys) - len(set(keys)),
        "validation_tail": n_val,
        "validation_tail_repeating_one_before_it": sum(k in before for k in keys[-n_val:]),
    }


def regenerated(path: Path, tokenizer, limit: int, val_fraction: float) -> dict:
    records = [r for _, r in read_records(path)]
    n_val = round(len(records) * val_fraction)

    def answers(rs):
        texts = [m["content"] for r in rs for m in r["messages"] if m["role"] == "assistant"]
        return tokenizer(texts, add_special_tokens=False)["input_ids"]

    return {
        "conversations": len(records),
        "all": text_figures(answers(records), limit),
        "validation_tail": text_figures(answers(records[-n_val:]), limit),
    }


def acceptance_by_repetition(answers: list[list[int]], acceptance: dict) -> dict:
    """The run's headline acceptance pooled over verifier steps, split by the repetition of
    the greedy answers decoded here (the same prompts, in the same order)."""
    rows = acceptance["per_prompt"]
    if acceptance["eval_set"] != "mtbench" or len(rows) != len(answers):
        raise SystemExit("--acceptance: the run's headline set must be these MT-bench prompts")

    def pooled(group):
        steps = sum(r["steps"] for r in group)
        accepted = sum((r["acceptance_length"] - 1) * r["steps"] for r in group)
        return {"prompts": len(group), "acceptance_length": round(1 + accepted / steps, 3)}

    shares = [repeated_4gram_share(a) for a in answers]
    return {
        "k": acceptance["k"],
        "same_new_tokens": sum(
            len(a) == r["new_tokens"] for a, r in zip(answers, rows, strict=True)
        ),
        "at_least_0.3_repeated": pooled([r for r, x in zip(rows, shares, strict=True) if x >= 0.3]),
        "others": pooled([r for r, x in zip(rows, shares, strict=True) if x < 0.3]),
        "correlation": round(
            statistics.correlation(shares, [r["acceptance_length"] for r in rows]), 2
        ),
    }


def synthetic_figures(model, tokenizer, a, sets) -> dict:
    """``a.synthetic`` prompts sampled as regeneration does, what is kept of them, and the
    prompt lengths (chat template included) of the kept ones beside the other sets'."""
    cfg = RegenerateConfig(
        batch_size=a.batch_size, synthetic_prompts=a.synthetic, synthetic_max_tokens=128
    )
    said = []
    systems = [None if s == "default" else s for s in a.system or ["default"]]
    prefixes = [rg.user_turn_prefix(tokenizer, s) for s in systems]
    t = time.perf_counter()
    kept = rg.synthetic_conversations(
        hf_generate(model, tokenizer, rg.sampling(cfg)),
        prefixes,
        cfg,
        lambda ids: rg.answer_text(tokenizer, ids),
        rg.turn_ends(tokenizer),
        log=said.append,
    )
    texts = [c["turns"][0]["content"] for c in kept]

    def mean_tokens(xs):
        return round(statistics.mean(len(data.prompt_token_ids(tokenizer, x)) for x in xs), 1)

    def under(conversation):  # the system prompt of synthetic-<i>
        return int(conversation["id"].removeprefix("synthetic-")) % len(systems)

    def code_share(xs):  # prompts that ask about code, by a crude word match
        return round(sum(bool(CODE_WORDS.search(x)) for x in xs) / len(xs), 3)

    figures = {
        "sampled": a.synthetic,
        "kept": len(kept),
        "log": said[0],
        "seconds": round(time.perf_counter() - t, 1),
        "mean_prompt_tokens": {n: mean_tokens(x) for n, x in [*sets, ("synthetic", texts)]},
        "code_share": {n: code_share(x) for n, x in [*sets, ("synthetic", texts)]},
        "per_system_prompt": [  # prompt i was sampled under system prompt i mod their number
            {
                "system": system,
                "kept": len(xs),
                "code_share": code_share(xs) if xs else None,
                "examples": xs[:3],
            }
            for j, system in enumerate(systems)
            for xs in [[c["turns"][0]["content"] for c in kept if under(c) == j]]
        ],
        "examples": texts[:8],
    }
    print(json.dumps(figures, ensure_ascii=False), flush=True)
    return {**figures, "texts": texts}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--verifier", type=Path, required=True, help="results/<run>/verifier/verifier.json"
    )
    p.add_argument("--conversations", type=int, default=17000, help="usable ones the run used")
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--regenerated", type=Path, help="a run's regenerated conversations")
    p.add_argument("--prompts", type=int, default=80, help="per set; 0: no greedy decoding")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=40)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--synthetic", type=int, default=0, help="synthetic prompts to sample")
    p.add_argument(
        "--system",
        action="append",
        help="a system prompt to sample synthetic prompts under (regenerate."
        "synthetic_system_prompts; repeat for several; 'default': the template's own)",
    )
    p.add_argument("--acceptance", type=Path, help="a run's reports/acceptance.json")
    p.add_argument("--greedy-json", type=Path, help="this script's --json of an earlier call")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    record = verifier.read_record(a.verifier)
    tokenizer = verifier.load_tokenizer(record)
    conversations = usable_conversations()
    out = {"repeats": repeats(conversations, a.conversations, a.val_fraction)}
    print(json.dumps(out["repeats"]), flush=True)
    if a.regenerated:
        out["regenerated"] = regenerated(a.regenerated, tokenizer, a.max_new_tokens, a.val_fraction)
        print(json.dumps(out["regenerated"]), flush=True)
    if a.greedy_json:
        out["greedy"] = json.loads(a.greedy_json.read_text())["greedy"]
    elif a.prompts:
        device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
        model = verifier.load_model(record, torch.float32).to(device)
        generate = hf_generate(
            model,
            tokenizer,
            RegenerateConfig(max_new_tokens=a.max_new_tokens, batch_size=a.batch_size),
        )
        mtbench = [q["text"] for q in read_eval_prompts(resolve_package_path(MTBENCH), a.prompts)]
        heldout = []
        for c in conversations[a.conversations :]:
            text = next(m["content"] for m in c if m["role"] == "user")
            if len(data.prompt_token_ids(tokenizer, text)) <= a.max_prompt_tokens:
                heldout.append(text)
            if len(heldout) == a.prompts:
                break
        sets = [("mtbench", mtbench), ("sharegpt_heldout", heldout)]
        if a.synthetic:
            out["synthetic"] = synthetic_figures(model, tokenizer, a, sets)
            sets.append(("synthetic", out["synthetic"].pop("texts")[: a.prompts]))
        out["greedy"] = {}
        for name, texts in sets:
            t = time.perf_counter()
            new = generate([data.prompt_token_ids(tokenizer, x) for x in texts])
            figures = text_figures(new, a.max_new_tokens)
            figures["seconds"] = round(time.perf_counter() - t, 1)
            print(name, json.dumps(figures), flush=True)
            out["greedy"][name] = {**figures, "per_prompt": new}
    if a.acceptance:
        mtbench = out["greedy"]["mtbench"]["per_prompt"]
        acceptance = json.loads(a.acceptance.read_text())
        out["acceptance_by_repetition"] = acceptance_by_repetition(mtbench, acceptance)
        print(json.dumps(out["acceptance_by_repetition"]), flush=True)
    if a.json:
        a.json.write_text(json.dumps(out))


if __name__ == "__main__":
    main()
