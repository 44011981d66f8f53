"""Held-out eval prompts in the training data: copies, substrings and near-duplicates.

Texts are compared as words: lower-cased runs of letters, digits and underscores, so case,
punctuation and white space never matter. A training conversation overlaps an eval prompt when
at least ``MIN_CONTAINMENT`` (70 %) of the prompt's distinct word ``NGRAM``-grams (8-grams)
occur in the conversation's user turns: PaLM's contamination rule (Chowdhery et al. 2022: 70 %
of an example's 8-grams found in the training data), applied to one conversation at a time.
It catches
- a copy, also with other case, punctuation or spacing, inside a longer user turn, or spread
  over several user turns (100 %);
- a near-duplicate whose changes leave 70 % of the 8-grams: an edit at the prompt's start or end
  (the packaged ShareGPT holds an IFBench prompt with its last sentence changed: 91 %), or one
  changed word anywhere in a prompt of 34 words or more (one word is in up to 8 of the 8-grams);
and lets pass a conversation that shares a stock paragraph with a prompt but asks something
else (on the packaged ShareGPT such conversations hold at most 56 % of an IFBench prompt's
8-grams). A word changed in the middle of a shorter prompt (half of MT-bench's first turns
have 31 words or fewer) can take it below 70 % and is not caught. A prompt of fewer than 8
words is one n-gram of its own length: it must occur whole. Assistant turns are not searched:
the verifier answers the user turns, so an eval prompt there is what would make the draft
learn the eval answers.

The eval prompts' n-grams are put in one dict once; a conversation then costs one lookup per
word of its user turns (10,500 ShareGPT conversations against 538 prompts: about 1 s).
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from collections.abc import Iterable

NGRAM = 8
MIN_CONTAINMENT = 0.7

_WORD = re.compile(r"\w+")


def words(text: str) -> list[str]:
    """Lower-cased words of ``text`` (punctuation and white space dropped)."""
    return _WORD.findall(text.lower())


def ngrams(tokens: list[str], n: int) -> set[tuple[str, ...]]:
    """Distinct n-grams of ``tokens``; one shorter gram (all of them) when there are fewer."""
    n = min(n, len(tokens))
    return {tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)} if n else set()


@dataclasses.dataclass
class EvalPromptIndex:
    """The word n-grams of every eval prompt, each with the prompts and sets it comes from."""

    n: int = NGRAM
    min_containment: float = MIN_CONTAINMENT
    grams: dict[tuple[str, ...], list[int]] = dataclasses.field(default_factory=dict)
    sizes: list[int] = dataclasses.field(default_factory=list)  # distinct grams per prompt
    sets: list[int] = dataclasses.field(default_factory=list)  # eval set of each prompt
    n_sets: int = 0
    lengths: tuple[int, ...] = ()  # gram lengths present: n, and those of shorter prompts

    @classmethod
    def build(
        cls,
        eval_sets: list[list[str]],
        n: int = NGRAM,
        min_containment: float = MIN_CONTAINMENT,
    ) -> EvalPromptIndex:
        """eval_sets: the prompt texts of each eval set. A prompt without a word cannot overlap."""
        index = cls(n, min_containment, n_sets=len(eval_sets))
        grams: dict[tuple[str, ...], list[int]] = defaultdict(list)
        for eval_set, texts in enumerate(eval_sets):
            for text in texts:
                own = ngrams(words(text), n)
                if not own:
                    continue
                for gram in own:
                    grams[gram].append(len(index.sizes))
                index.sizes.append(len(own))
                index.sets.append(eval_set)
        index.grams = dict(grams)
        index.lengths = tuple(sorted({len(g) for g in grams}))
        return index

    def overlapping_sets(self, texts: Iterable[str]) -> set[int]:
        """The eval sets (indices) with a prompt of which ``texts`` (one conversation's user
        turns) hold at least ``min_containment`` of the n-grams."""
        found: dict[int, set[tuple[str, ...]]] = defaultdict(set)
        for text in texts:
            tokens = words(text)
            for n in self.lengths:
                for i in range(len(tokens) - n + 1):
                    gram = tuple(tokens[i : i + n])
                    for prompt in self.grams.get(gram, ()):
                        found[prompt].add(gram)
        return {
            self.sets[p]
            for p, seen in found.items()
            if len(seen) / self.sizes[p] >= self.min_containment
        }
