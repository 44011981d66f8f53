"""Offline acceptance: greedy chain speculative decoding with the HF verifier and the draft.

Per verifier step the draft proposes k tokens, the verifier scores [last token, proposals]
in one forward, the longest agreeing prefix is accepted and the verifier's own next token is
added (the bonus). Acceptance length = 1 + accepted / steps (vLLM's definition); per-position
acceptance j = steps whose first j proposals were all accepted / steps. A step ends at an
accepted end-of-sequence token (later proposals are not counted) and decoding stops there.

Two methods give the same counts:
- ``decode`` runs that loop, one prompt at a time, and checks the text against plain greedy
  decoding (the output of greedy speculative decoding is the verifier's greedy text).
- ``replay`` uses that fact: it decodes all prompts greedily with the verifier (batched
  ``generate``), runs one teacher-forced verifier forward and one draft forward of max(k) TTT
  steps per prompt, and replays the loop on the result. The draft's step-j proposal at a
  position only matters when its proposals 1..j-1 were accepted, i.e. equal to the verifier's
  tokens, which is exactly what teacher forcing feeds it; so every k costs one pass. It reports
  how often the teacher-forced verifier argmax agrees with the generated tokens (numerics).

Both also report the draft's per-token accuracy on the greedy text (``per_token_accuracy``):
at every generated position, teacher-forced, whether its first j + 1 proposals are right, as
training's validation counts ``full_acc_j``. Per-position acceptance counts the same events
only at the positions where a verifier step starts, which follow a rejected proposal (or k
accepted ones); where hard tokens cluster those positions are harder than the average one,
so per-position acceptance can be well below per-token accuracy on the same text.

Draft proposals: ``decode`` runs the draft incrementally (its own KV cache, one pass per
proposal: k passes per verifier step), ``replay`` runs speculators' own
``Eagle3DraftModel.forward`` with teacher forcing; both compute what the draft computes in
training (tested equal).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from eagle3lib.config import RegenerateConfig
from eagle3lib.data import eos_ids, until_eos
from eagle3lib.drafter import Drafter
from eagle3lib.errors import UserError
from eagle3lib.hidden_states import Capture, input_device
from eagle3lib.regenerate import RAW_LOGITS, hf_generate
from eagle3lib.report import fmt


@torch.no_grad()
def greedy_reference(model, prompt: list[int], max_new_tokens: int, eos: set[int]) -> list[int]:
    """Plain greedy decoding with the verifier (HF generate)."""
    device = input_device(model)  # a multimodal verifier's first parameter may be its vision tower
    out = model.generate(
        torch.tensor([prompt], device=device),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=sorted(eos) or None,
        pad_token_id=sorted(eos)[0] if eos else 0,
        **RAW_LOGITS,
    )
    return until_eos(out[0, len(prompt) :].tolist(), eos, max_new_tokens)


@torch.no_grad()
def speculative_decode(
    model,
    capture: Capture,
    drafter: Drafter,
    prompt: list[int],
    k: int,
    max_new_tokens: int,
    eos: set[int],
) -> dict[str, Any]:
    """Greedy chain speculative decoding of one prompt; per-step acceptance counts."""
    from transformers import DynamicCache

    device = input_device(model)
    getattr(drafter, "reset", lambda: None)()  # the draft's cache holds another prompt
    cache = DynamicCache(config=model.config)
    ids = torch.tensor([prompt], device=device)
    logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
    aux = capture.stacked()[0, :, :-1].flatten(1)  # [n, n_aux*H] for x_0..x_{n-1}
    tokens = torch.tensor(prompt + [int(logits[0, -1].argmax())], device=device)
    accepted_per_step: list[int] = []
    out: list[int] = [int(tokens[-1])]
    done = out[-1] in eos
    while len(out) < max_new_tokens and not done:
        proposals = drafter.propose(aux.to(drafter.dtype), tokens, k)
        block = torch.tensor([[int(tokens[-1]), *proposals]], device=device)
        logits = model(input_ids=block, past_key_values=cache, use_cache=True).logits[0]
        verified = logits.argmax(-1).tolist()  # verifier's token after each block position
        states = capture.stacked()[0, :, :-1].flatten(1)
        a = 0
        while a < k and proposals[a] == verified[a] and (a == 0 or proposals[a - 1] not in eos):
            a += 1
        accepted_per_step.append(a)
        new = proposals[:a] + [verified[a]]
        aux = torch.cat([aux, states[: a + 1]])  # states of x_n, p_1..p_a are correct
        if a < k:  # drop the rejected proposals (a negative crop removes that many)
            cache.crop(a - k)
        tokens = torch.cat([tokens, torch.tensor(new, device=device)])
        out += new
        done = any(t in eos for t in new)
    return {"tokens": until_eos(out, eos, max_new_tokens), "accepted": accepted_per_step}


def chain_runs(predictions: torch.Tensor, tokens: torch.Tensor, eos: set[int]) -> list[int]:
    """Accepted proposals at every position: the leading steps j whose proposal equals the
    verifier's token x_{i+2+j}, ending after an accepted end-of-sequence token.

    predictions: [k, n] from ``Drafter.predict_all``; tokens: x_0..x_n (n + 1 ids).
    """
    k, n = predictions.shape
    padded = torch.cat([tokens, tokens.new_full((k + 1,), -1)])  # past the end nothing matches
    target = torch.stack([padded[j + 2 : j + 2 + n] for j in range(k)])
    ok = predictions == target
    if eos:
        is_eos = torch.isin(padded, torch.tensor(sorted(eos), device=padded.device))
        for j in range(1, k):  # step j counts only if step j-1's accepted token was not EOS
            ok[j] &= ~is_eos[j + 1 : j + 1 + n]
    return ok.int().cumprod(0).sum(0).tolist()


def token_accuracy(runs: list[int], prompt_len: int, new_tokens: int, steps: int) -> list[int]:
    """Per-token counterpart of per-position acceptance: for each step j < ``steps``, the
    positions whose first j + 1 proposals are all right (speculators' ``full_acc_j``), out of
    ``token_positions(new_tokens, j)``.

    runs: ``chain_runs`` over a prompt and its greedy continuation (``new_tokens`` long, to
    its end-of-sequence token). Position i's step-j proposal is x_{i+2+j}; the positions
    counted are those whose step-0 proposal is a generated token that the draft proposes in
    decoding (the first one comes from the prompt's forward: i from prompt_len - 1) and whose
    step-j proposal is still a generated token.
    """
    start = prompt_len - 1
    return [
        sum(1 for r in runs[start : start + token_positions(new_tokens, j)] if r > j)
        for j in range(steps)
    ]


def token_positions(new_tokens: int, step: int) -> int:
    """Positions counted by ``token_accuracy`` at ``step``: those whose step-``step``
    proposal is one of tokens 2..new_tokens of the greedy continuation."""
    return max(new_tokens - 1 - step, 0)


def replay_steps(
    runs: list[int], tokens: list[int], prompt_len: int, k: int, max_new_tokens: int, eos: set[int]
) -> tuple[list[int], list[int]]:
    """The decode loop replayed on a known greedy sequence: (accepted per step, output tokens).

    runs: ``chain_runs`` of max(k) steps; tokens: the prompt and at least max_new_tokens + k + 1
    greedy tokens (or up to the first end-of-sequence token).
    """
    out = [tokens[prompt_len]]
    i = prompt_len - 1  # the draft position whose proposals follow the newest token
    accepted: list[int] = []
    done = out[-1] in eos
    while len(out) < max_new_tokens and not done:
        a = min(runs[i], k)
        accepted.append(a)
        new = tokens[i + 2 : i + 3 + a]
        out += new
        i += a + 1
        done = any(t in eos for t in new)
    return accepted, until_eos(out, eos, max_new_tokens)


@torch.no_grad()
def replay_prompt(
    model, capture: Capture, drafter: Drafter, tokens: list[int], prompt_len: int, steps: int
) -> tuple[torch.Tensor, int, int]:
    """One teacher-forced verifier forward and one draft forward over a greedy sequence.

    Returns (the draft's predictions [steps, n], positions where the verifier's argmax differs
    from the given tokens, positions compared).
    """
    device = input_device(model)
    x = torch.tensor(tokens, device=device)
    logits = model(input_ids=x[None, :-1]).logits[0]
    aux = capture.stacked()[0, :, :-1].flatten(1)
    argmax = logits[prompt_len - 1 :].argmax(-1)
    disagree = int((argmax != x[prompt_len:]).sum())
    predictions = drafter.predict_all(aux.to(drafter.dtype), x, steps)
    return predictions, disagree, len(tokens) - prompt_len


def acceptance_stats(
    accepted: list[int], k: int, correct: list[int] = (), positions: list[int] = ()
) -> dict[str, Any]:
    """vLLM's acceptance figures of the verifier steps' ``accepted`` counts, and the per-token
    accuracy of ``token_accuracy``'s counts summed over prompts (``correct`` of ``positions``
    per step; None where no position was counted)."""
    steps = len(accepted)
    per_position = [sum(1 for a in accepted if a > j) / steps if steps else 0.0 for j in range(k)]
    return {
        "k": k,
        "steps": steps,
        "accepted_tokens": sum(accepted),
        "acceptance_length": 1 + sum(accepted) / steps if steps else None,
        "per_position_acceptance": per_position,
        "per_token_accuracy": [
            c / n if n else None for c, n in zip(correct, positions, strict=True)
        ],
    }


def by_category(
    prompts: list[dict[str, Any]], accepted: list[list[int]], k: int
) -> dict[str, dict[str, Any]] | None:
    """Acceptance per prompt category (MT-bench's eight: its records' ``category``), pooled
    over the verifier steps of each category's prompts (``accepted``: each prompt's accepted
    counts per step), in the order categories first appear; None where no prompt has one."""
    groups: dict[str, list[list[int]]] = {}
    for prompt, prompt_accepted in zip(prompts, accepted, strict=True):
        if prompt.get("category") is not None:
            groups.setdefault(prompt["category"], []).append(prompt_accepted)
    result = {}
    for category, group in groups.items():
        stats = acceptance_stats(_pooled(group), k)
        result[category] = {
            "prompts": len(group),
            "steps": stats["steps"],
            "acceptance_length": stats["acceptance_length"],
        }
    return result or None


class TokenCounts:
    """``token_accuracy`` counts summed over prompts, for steps 0..steps-1."""

    def __init__(self, steps: int) -> None:
        self.correct, self.positions = [0] * steps, [0] * steps

    def add(self, runs: list[int], prompt_len: int, new_tokens: int) -> None:
        right = token_accuracy(runs, prompt_len, new_tokens, len(self.correct))
        for j, c in enumerate(right):
            self.correct[j] += c
            self.positions[j] += token_positions(new_tokens, j)

    def first(self, k: int) -> tuple[list[int], list[int]]:
        """(correct, positions) of steps 0..k-1."""
        return self.correct[:k], self.positions[:k]


def _decode_set(model, capture, drafter, prompts, k, cfg, eos, log) -> dict[str, Any]:
    per_prompt, accepted, mismatches = [], [], 0  # accepted: each prompt's counts per step
    counts = TokenCounts(k)
    for n, prompt in enumerate(prompts, 1):
        t = time.perf_counter()
        result = speculative_decode(
            model, capture, drafter, prompt["token_ids"], k, cfg.max_new_tokens, eos
        )
        spec_seconds = time.perf_counter() - t
        capture.states.clear()
        reference = greedy_reference(model, prompt["token_ids"], cfg.max_new_tokens, eos)
        capture.states.clear()
        match = result["tokens"] == reference
        mismatches += not match
        text = prompt["token_ids"] + result["tokens"]
        predictions, _, _ = replay_prompt(
            model, capture, drafter, text, len(prompt["token_ids"]), k
        )
        runs = chain_runs(predictions, torch.tensor(text, device=predictions.device), eos)
        counts.add(runs, len(prompt["token_ids"]), len(result["tokens"]))
        stats = acceptance_stats(result["accepted"], k)
        accepted.append(result["accepted"])
        per_prompt.append(
            {
                "id": prompt["id"],
                "new_tokens": len(result["tokens"]),
                "matches_verifier": match,
                "seconds": round(spec_seconds, 3),
                **{key: stats[key] for key in ("steps", "acceptance_length")},
                "tokens": result["tokens"],
            }
        )
        log(
            f"evaluate: k={k} prompt {n}/{len(prompts)} id={prompt['id']} "
            f"acceptance_length={fmt(stats['acceptance_length'])} match={match}"
        )
    return {
        **acceptance_stats(_pooled(accepted), k, *counts.first(k)),
        "text_matches_verifier": mismatches == 0,
        "mismatched_prompts": mismatches,
        **_category_field(prompts, accepted, k),
        "per_prompt": per_prompt,
    }


def _pooled(accepted: list[list[int]]) -> list[int]:
    """Every prompt's accepted counts per step, one list (the set's verifier steps)."""
    return [a for prompt_accepted in accepted for a in prompt_accepted]


def _category_field(prompts, accepted_per_prompt, k) -> dict[str, Any]:
    """``{"by_category": ...}`` where the prompts have categories, else nothing."""
    categories = by_category(prompts, accepted_per_prompt, k)
    return {"by_category": categories} if categories else {}


def _replay_set(model, tokenizer, capture, drafter, prompts, ks, cfg, eos, log) -> list[dict]:
    steps = max(ks)
    t = time.perf_counter()
    generate = hf_generate(
        model,
        tokenizer,
        RegenerateConfig(max_new_tokens=cfg.max_new_tokens + steps + 1, batch_size=cfg.batch_size),
    )
    generated = generate([p["token_ids"] for p in prompts])
    capture.states.clear()
    log(f"evaluate: greedy decoding of {len(prompts)} prompts in {time.perf_counter() - t:.1f} s")
    accepted: dict[int, list[list[int]]] = {k: [] for k in ks}  # per prompt, per step
    per_prompt, disagree, compared = [], 0, 0
    counts = TokenCounts(steps)
    for n, (prompt, new) in enumerate(zip(prompts, generated, strict=True), 1):
        tokens = prompt["token_ids"] + new
        predictions, wrong, total = replay_prompt(
            model, capture, drafter, tokens, len(prompt["token_ids"]), steps
        )
        disagree, compared = disagree + wrong, compared + total
        runs = chain_runs(predictions, torch.tensor(tokens, device=predictions.device), eos)
        record = {"id": prompt["id"], "argmax_disagreements": wrong}
        for k in ks:
            steps_k, out = replay_steps(
                runs, tokens, len(prompt["token_ids"]), k, cfg.max_new_tokens, eos
            )
            accepted[k].append(steps_k)
            stats = acceptance_stats(steps_k, k)
            record[f"k{k}"] = {
                "steps": stats["steps"],
                "acceptance_length": stats["acceptance_length"],
            }
        record |= {"new_tokens": len(out), "tokens": out}
        counts.add(runs, len(prompt["token_ids"]), len(out))
        per_prompt.append(record)
        if n % 20 == 0 or n == len(prompts):
            log(f"evaluate: replayed {n}/{len(prompts)} prompts")
    results = []
    for k in ks:
        results.append(
            {
                **acceptance_stats(_pooled(accepted[k]), k, *counts.first(k)),
                "text_matches_verifier": None,  # greedy by construction: not checked
                "mismatched_prompts": None,
                "argmax_agreement": 1 - disagree / compared if compared else None,
                **_category_field(prompts, accepted[k], k),
                "per_prompt": [
                    {
                        "id": r["id"],
                        **r[f"k{k}"],
                        "new_tokens": r["new_tokens"],
                        "argmax_disagreements": r["argmax_disagreements"],
                        "tokens": r["tokens"],
                    }
                    for r in per_prompt
                ],
            }
        )
    return results


def evaluate(
    model, draft, tokenizer, eval_sets: list[dict[str, Any]], cfg, aux_layers, log=print
) -> dict[str, Any]:
    """Acceptance for every eval set and every k (``cfg.k_values``).

    eval_sets: [{"name", "prompts": [{"id", "token_ids", ...}]}]. The first set at the first k
    is the headline: its fields are also at the top level, with its per-prompt records.
    """
    from eagle3lib.verifier import decoder_layers

    eos = eos_ids(tokenizer.eos_token_id, model.generation_config.eos_token_id)
    capture = Capture(decoder_layers(model), aux_layers)
    drafter = Drafter(draft)
    ks = cfg.k_values
    results = []
    t0 = time.perf_counter()
    try:
        for eval_set in eval_sets:
            t = time.perf_counter()
            runs = _set_runs(model, tokenizer, capture, drafter, eval_set, ks, cfg, eos, log)
            seconds = round(time.perf_counter() - t, 2)
            for run in runs:
                results.append(_set_result(eval_set, run, seconds))
                log(_run_line(eval_set["name"], run))
    finally:
        capture.remove()
    headline, per_prompt = _headline(results, tokenizer)
    return {
        **headline,
        "method": cfg.method,
        "max_new_tokens": cfg.max_new_tokens,
        "seconds": round(time.perf_counter() - t0, 2),
        "results": [{k: v for k, v in r.items() if k != "per_prompt"} for r in results],
        "per_prompt": per_prompt,
    }


def check_prompt_lengths(eval_sets: list[dict[str, Any]], context: int | None, cfg) -> None:
    """Refuse a prompt whose tokens, with the answer evaluation generates for it (max_new_tokens,
    and the largest k + 1 that replay's reference runs past it), pass the verifier's context:
    the verifier would be run past the positions it was trained on, and the prompt would count
    anyway. ``context`` None: the verifier states none."""
    if context is None:
        return
    after = cfg.max_new_tokens + max(cfg.k_values) + 1
    for eval_set in eval_sets:
        for prompt in eval_set["prompts"]:
            n = len(prompt["token_ids"])
            if n + after > context:
                raise UserError(
                    f"{eval_set['path']}: the prompt with id {prompt['id']!r} is {n} tokens; with "
                    f"the {after} evaluation adds (evaluate.max_new_tokens, the largest k + 1) "
                    f"it passes the verifier's context of {context} positions; shorten or "
                    "remove the prompt, or lower evaluate.max_new_tokens"
                )


def out_of_draft_vocab(texts: list[list[int]], vocabulary: set[int] | None) -> float | None:
    """The share of the verifier's generated tokens the draft cannot propose (not in its
    vocabulary): positions where a proposal is rejected whatever the draft learnt."""
    tokens = [t for text in texts for t in text]
    if not tokens:
        return None
    if vocabulary is None:
        return 0.0
    return sum(t not in vocabulary for t in tokens) / len(tokens)


def _set_runs(model, tokenizer, capture, drafter, eval_set, ks, cfg, eos, log) -> list[dict]:
    """One eval set's results, one per k, by ``cfg.method``, with the share of its generated
    tokens outside the draft's vocabulary."""
    prompts = eval_set["prompts"]
    if cfg.method == "replay":
        runs = _replay_set(model, tokenizer, capture, drafter, prompts, ks, cfg, eos, log)
    else:
        runs = [_decode_set(model, capture, drafter, prompts, k, cfg, eos, log) for k in ks]
    vocabulary = drafter.vocabulary()
    for run in runs:
        texts = [record["tokens"] for record in run["per_prompt"]]
        run["out_of_draft_vocab"] = out_of_draft_vocab(texts, vocabulary)
    return runs


def _set_result(eval_set: dict[str, Any], run: dict[str, Any], seconds: float) -> dict[str, Any]:
    """The record of one eval set at one k: its name and size, the run's fields, and the set's
    time, every k of it together (one pass over the set serves all its k)."""
    return {
        "eval_set": eval_set["name"],
        "prompts": len(eval_set["prompts"]),
        **run,
        "seconds": seconds,
    }


def _run_line(name: str, run: dict[str, Any]) -> str:
    """The log line of one eval set's result at one k."""
    return (
        f"evaluate: {name} k={run['k']} acceptance_length="
        f"{fmt(run['acceptance_length'])} per position "
        + ", ".join(f"{p:.3f}" for p in run["per_position_acceptance"])
        + " per token (teacher-forced) "
        + ", ".join(fmt(p, 3) for p in run["per_token_accuracy"])
        + f" out of the draft's vocabulary {fmt(run['out_of_draft_vocab'], 3)}"
    )


def _headline(results: list[dict[str, Any]], tokenizer) -> tuple[dict[str, Any], list[dict]]:
    """(the first result without its per-prompt records, those records): the first prompt's
    tokens decoded to its text, the others' tokens dropped (the records are changed)."""
    headline = dict(results[0])
    per_prompt = headline.pop("per_prompt")
    for record in per_prompt[1:]:
        record.pop("tokens")
    if per_prompt:
        per_prompt[0]["text"] = tokenizer.decode(
            per_prompt[0].pop("tokens"), skip_special_tokens=True
        )
    return headline, per_prompt
