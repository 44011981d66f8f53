"""The draft's chain proposals at evaluation: incremental drafting with the draft's own KV
cache (``decode``) and speculators' teacher-forced forward (``replay``)."""

from __future__ import annotations

import torch


class Drafter:
    """Chain proposals from a speculators EAGLE-3 draft.

    ``propose`` runs the draft incrementally: its step-0 keys and values of the context stay in
    a KV cache from one verifier step to the next (only the newly accepted positions are
    computed), and each further proposal is one single-position pass attending to that cache
    and to the earlier proposals' keys, as speculators' TTT attention mask does in training.
    k proposals cost k draft passes. The draft's own layers, norms, rotary embedding and heads
    compute every pass; ``predict_all`` (replay) runs speculators' ``forward`` itself.
    """

    def __init__(self, draft):
        self.draft = draft
        self.d2t = getattr(draft, "d2t", None)
        self.dtype = next(draft.parameters()).dtype  # the verifier's states are cast to it
        self.attention = draft.config.transformer_layer_config._attn_implementation  # noqa: SLF001
        if self.attention not in ("sdpa", "eager"):
            raise ValueError(
                f"incremental drafting needs sdpa or eager attention, not {self.attention}"
            )
        self.reset()

    def reset(self) -> None:
        """Forget the cached context (a new prompt)."""
        from transformers import DynamicCache

        self.cache = DynamicCache()
        self.ids: torch.Tensor | None = None  # token ids of the cached positions

    def vocabulary(self) -> set[int] | None:
        """The verifier token ids this draft can propose; None: all of them (no d2t map)."""
        if self.d2t is None:
            return None
        return set(
            self.to_verifier_ids(torch.arange(len(self.d2t), device=self.d2t.device)).tolist()
        )

    def to_verifier_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        if self.d2t is None:
            return draft_ids
        return draft_ids + self.d2t[draft_ids]

    def _cached_positions(self, ids: torch.Tensor) -> int:
        """Positions of ``ids`` whose step-0 keys are cached and still valid (a prefix); the
        last position is always recomputed (its output starts the chain)."""
        known = 0 if self.ids is None else min(len(self.ids), len(ids) - 1)
        if known and not torch.equal(self.ids[:known], ids[:known]):
            known = 0  # another sequence: start over
        self._keep(known)
        return known

    def _keep(self, n: int) -> None:
        """Drop the cached keys and values after the first ``n`` positions, by transformers'
        ``crop`` with a negative count (positions to remove), as transformers 4 and 5 read it.
        Its positive form (the length to keep) is deprecated in transformers 5, which
        takes 0 as nothing to remove, so a new sequence kept the old one's cache."""
        extra = self.cache.get_seq_length() - n
        if extra > 0:
            self.cache.crop(-extra)

    def _mask(self, queries: torch.Tensor, n: int, extra: int) -> dict[bool, torch.Tensor]:
        """Attention masks (per sliding-window flag) of query positions over the cache: the
        step-0 keys of positions 0..n-1 (causal, within the sliding window) and ``extra``
        keys of earlier TTT steps at the query's own position (the diagonal)."""
        keys = torch.arange(n, device=queries.device)
        causal = keys[None, :] <= queries[:, None]
        masks = {}
        for windowed in (False, True):
            allowed = causal
            if windowed and self.draft.sliding_window is not None:
                allowed = causal & (keys[None, :] > queries[:, None] - self.draft.sliding_window)
            allowed = torch.cat([allowed, allowed.new_ones(len(queries), extra)], dim=1)
            if self.attention == "eager":  # additive, as speculators' create_float_mask
                allowed = torch.zeros(
                    allowed.shape, dtype=self.dtype, device=queries.device
                ).masked_fill_(~allowed, float("-inf"))
            masks[windowed] = allowed[None, None]
        return masks

    def _pass(
        self, ids: torch.Tensor, hidden: torch.Tensor, queries: torch.Tensor, n: int, step: int
    ):
        """One draft pass (speculators' TTT step ``step``) of the query positions: appends
        their keys to the cache; returns (hidden states for the next step, logits)."""
        draft = self.draft
        x = torch.cat([draft.embed_tokens(ids), hidden], dim=-1)[None]
        position_ids = (1 + step + queries)[None]  # speculators' positions start at 1
        cached = self.cache.get_seq_length()
        masks = self._mask(queries, n, cached - n + len(queries) if step else 0)
        cache_position = torch.arange(cached, cached + len(queries), device=ids.device)
        embeddings = draft.rotary_emb(x, position_ids)
        for i, layer in enumerate(draft.layers):
            x = layer(
                x,
                attention_mask=masks[i in draft.sliding_window_indices],
                position_ids=position_ids,
                past_key_values=self.cache,
                cache_position=cache_position,
                position_embeddings=embeddings,
            )
        if draft.config.norm_output:
            x = draft.norm(x)
            logits = draft.lm_head(x)
        else:
            logits = draft.lm_head(draft.norm(x))
        return x[0], logits[0]

    @torch.no_grad()
    def propose(self, aux: torch.Tensor, tokens: torch.Tensor, k: int) -> list[int]:
        """k proposals after ``tokens`` (x_0..x_n) given aux states of x_0..x_{n-1}.

        aux: [n, n_aux * hidden]; tokens: [n + 1]. Calls for one prompt extend the same
        sequence; ``reset`` starts another.
        """
        draft = self.draft
        n = aux.shape[0]
        ids = tokens[1:]  # draft index i pairs aux state i with token i+1
        known = self._cached_positions(ids)
        hidden = aux[known:]
        if draft.input_norm is not None:
            hidden = draft.input_norm(hidden)
        if draft.fc_norm is not None:
            chunks = hidden.chunk(len(draft.fc_norm), dim=-1)
            hidden = torch.cat([norm(c) for norm, c in zip(draft.fc_norm, chunks, strict=True)], -1)
        hidden = draft.fc(hidden)
        queries = torch.arange(known, n, device=aux.device)
        x, logits = self._pass(ids[known:], hidden, queries, n, 0)
        self.ids = ids.clone()
        last = queries[-1:]
        nxt = self.to_verifier_ids(logits[-1].argmax())
        proposals = [int(nxt)]
        for step in range(1, k):
            x, logits = self._pass(nxt.view(1), x[-1:], last, n, step)
            nxt = self.to_verifier_ids(logits[-1].argmax())
            proposals.append(int(nxt))
        self._keep(n)  # the proposals' keys were for this position only
        return proposals

    @torch.no_grad()
    def predict_all(self, aux: torch.Tensor, tokens: torch.Tensor, steps: int) -> torch.Tensor:
        """[steps, n]: step j's proposal at every position of a known sequence, teacher-forced.

        aux: [n, n_aux * hidden] for x_0..x_{n-1}; tokens: x_0..x_n. Row j, column i is the
        proposal for x_{i+2+j} after context x_0..x_{i+1}, given that x_{i+2}..x_{i+1+j} were
        proposed before it (what ``propose`` computes when those were accepted).

        Eagerly, though speculators compiles ``forward`` wherever CUDA is available: replay
        calls it once per prompt, each of its own length, so torch.compile would compile it
        twice (static shapes, then dynamic) for calls that take milliseconds without it.
        """
        n = aux.shape[0]
        with torch.compiler.set_stance("force_eager"):
            draft_tokens = self.draft(
                hidden_states=aux[None],
                input_ids=tokens[1:][None],
                document_ids=torch.zeros(1, n, dtype=torch.long, device=aux.device),
                ttt_steps=steps,
            )
        return torch.stack([self.to_verifier_ids(t[0]) for t in draft_tokens])
