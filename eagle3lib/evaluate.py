"""Offline acceptance: greedy chain speculative decoding with the HF verifier and the draft.

Per verifier step the draft proposes k tokens, the verifier scores [last token, proposals]
in one forward, the longest agreeing prefix is accepted and the verifier's own next token is
added (the bonus). Acceptance length = 1 + accepted / steps (vLLM's definition); per-position
acceptance j = steps whose first j proposals were all accepted / steps. Output tokens are the
verifier's greedy tokens by construction, and are checked against plain greedy decoding.

Draft proposals come from speculators' own ``Eagle3DraftModel.forward``: call j (ttt_steps=j)
teacher-forces the proposals found so far, so the draft runs exactly as it was trained.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from eagle3lib.data import eos_ids, until_eos
from eagle3lib.hidden_states import Capture, input_device
from eagle3lib.report import fmt


class Drafter:
    """Chain proposals from a speculators EAGLE-3 draft."""

    def __init__(self, draft):
        self.draft = draft
        self.d2t = getattr(draft, "d2t", None)
        self.dtype = next(draft.parameters()).dtype  # the verifier's states are cast to it

    def to_verifier_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        if self.d2t is None:
            return draft_ids
        return draft_ids + self.d2t[draft_ids]

    @torch.no_grad()
    def propose(self, aux: torch.Tensor, tokens: torch.Tensor, k: int) -> list[int]:
        """k proposals after ``tokens`` (x_0..x_n) given aux states of x_0..x_{n-1}.

        aux: [n, n_aux * hidden]; tokens: [n + 1].
        """
        n = aux.shape[0]
        ids = tokens[1:].clone()  # draft index i pairs aux state i with token i+1
        proposals: list[int] = []
        for step in range(k):
            hidden = torch.cat([aux, aux.new_zeros(step, aux.shape[1])]) if step else aux
            draft_tokens = self.draft(
                hidden_states=hidden[None],
                input_ids=ids[None],
                document_ids=torch.zeros(1, n + step, dtype=torch.long, device=aux.device),
                ttt_steps=step + 1,
            )
            nxt = self.to_verifier_ids(draft_tokens[step][0, n - 1])
            proposals.append(int(nxt))
            ids = torch.cat([ids, nxt.view(1)])
        return proposals


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
    cache = DynamicCache(config=model.config)
    ids = torch.tensor([prompt], device=device)
    logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
    aux = capture.stacked()[0, :, :-1].flatten(1)  # [n, n_aux*H] for x_0..x_{n-1}
    tokens = torch.tensor(prompt + [int(logits[0, -1].argmax())], device=device)
    accepted_per_step: list[int] = []
    out: list[int] = [int(tokens[-1])]
    while len(out) < max_new_tokens and out[-1] not in eos:
        proposals = drafter.propose(aux.to(drafter.dtype), tokens, k)
        block = torch.tensor([[int(tokens[-1]), *proposals]], device=device)
        logits = model(input_ids=block, past_key_values=cache, use_cache=True).logits[0]
        verified = logits.argmax(-1).tolist()  # verifier's token after each block position
        states = capture.stacked()[0, :, :-1].flatten(1)
        a = 0
        while a < k and proposals[a] == verified[a]:
            a += 1
        accepted_per_step.append(a)
        new = proposals[:a] + [verified[a]]
        aux = torch.cat([aux, states[: a + 1]])  # states of x_n, p_1..p_a are correct
        if a < k:  # drop the rejected proposals (a negative crop removes that many)
            cache.crop(a - k)
        tokens = torch.cat([tokens, torch.tensor(new, device=device)])
        out += new
    return {"tokens": until_eos(out, eos, max_new_tokens), "accepted": accepted_per_step}


def acceptance_stats(accepted: list[int], k: int) -> dict[str, Any]:
    steps = len(accepted)
    per_position = [sum(1 for a in accepted if a > j) / steps if steps else 0.0 for j in range(k)]
    return {
        "k": k,
        "steps": steps,
        "accepted_tokens": sum(accepted),
        "acceptance_length": 1 + sum(accepted) / steps if steps else None,
        "per_position_acceptance": per_position,
    }


def evaluate(
    model, draft, tokenizer, prompts: list[dict[str, Any]], cfg, aux_layers, log=print
) -> dict[str, Any]:
    """Acceptance over all prompts, and whether the text equals verifier-only greedy output."""
    from eagle3lib.verifier import decoder_layers

    eos = eos_ids(tokenizer.eos_token_id, model.generation_config.eos_token_id)
    capture = Capture(decoder_layers(model), aux_layers)
    drafter = Drafter(draft)
    per_prompt, all_accepted, mismatches = [], [], 0
    t0 = time.perf_counter()
    try:
        for n, prompt in enumerate(prompts, 1):
            t = time.perf_counter()
            result = speculative_decode(
                model, capture, drafter, prompt["token_ids"], cfg.k, cfg.max_new_tokens, eos
            )
            spec_seconds = time.perf_counter() - t
            capture.states.clear()
            reference = greedy_reference(model, prompt["token_ids"], cfg.max_new_tokens, eos)
            capture.states.clear()
            match = result["tokens"] == reference
            mismatches += not match
            stats = acceptance_stats(result["accepted"], cfg.k)
            all_accepted += result["accepted"]
            per_prompt.append(
                {
                    "id": prompt["id"],
                    "new_tokens": len(result["tokens"]),
                    "matches_verifier": match,
                    "seconds": round(spec_seconds, 3),
                    **{key: stats[key] for key in ("steps", "acceptance_length")},
                }
            )
            log(
                f"evaluate: prompt {n}/{len(prompts)} id={prompt['id']} "
                f"acceptance_length={fmt(stats['acceptance_length'])} match={match}"
            )
            if n == 1:
                per_prompt[-1]["text"] = tokenizer.decode(
                    result["tokens"], skip_special_tokens=True
                )
    finally:
        capture.remove()
    total = acceptance_stats(all_accepted, cfg.k)
    return {
        **total,
        "prompts": len(prompts),
        "max_new_tokens": cfg.max_new_tokens,
        "text_matches_verifier": mismatches == 0,
        "mismatched_prompts": mismatches,
        "seconds": round(time.perf_counter() - t0, 2),
        "per_prompt": per_prompt,
    }
