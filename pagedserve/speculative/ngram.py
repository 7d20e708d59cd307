"""Prompt-lookup proposals (vLLM's `ngram` method): the tokens that followed an earlier occurrence of the context's
last n tokens.

The n-gram is the longest suffix of the context, between `min_n` and `max_n` tokens, that occurred before (overlapping
the suffix itself allowed, but not the suffix alone); of its occurrences, the earliest. The proposal is the up to `k`
tokens that followed it, as vLLM's `NgramProposer` picks them, so acceptance rates compare across the two.

A sequence keeps an index of where each n-gram first occurs (`NgramIndex`), extended by the tokens a step adds: a
proposal costs a few dictionary lookups however long the context, not a search over it.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    """The first start of every n-gram of `min_n` to `max_n` tokens in a growing token list."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"prompt_lookup_min={min_n} and prompt_lookup_max={max_n}: 1 <= min <= max")
        self.min_n, self.max_n = min_n, max_n
        self.first: dict[tuple[int, ...], int] = {}
        self.num_indexed = 0  # tokens whose n-grams (those ending at them) are in `first`

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to `k` proposed next tokens for `tokens`, which must extend the tokens indexed before (the prompt
        and the output so far); none where no n-gram recurs."""
        self._extend(tokens)
        total = len(tokens)
        if k <= 0:
            return []
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            start = self.first.get(tuple(tokens[total - n:]))
            if start is not None and start < total - n:  # an occurrence before the suffix itself
                return list(tokens[start + n:start + n + k])
        return []

    def _extend(self, tokens: Sequence[int]) -> None:
        first = self.first
        for end in range(self.num_indexed + 1, len(tokens) + 1):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                first.setdefault(tuple(tokens[end - n:end]), end - n)
        self.num_indexed = len(tokens)


def propose_ngram(tokens: Sequence[int], k: int, min_n: int, max_n: int, max_len: int | None = None) -> list[int]:
    """Up to `k` proposed next tokens for `tokens` (the prompt and the output so far), from a fresh index.
    `max_len`: the sequence's cap (max_model_len): nothing is proposed past it."""
    index = NgramIndex(min_n, max_n)
    if max_len is not None:
        k = min(k, max_len - len(tokens))
    return index.propose(tokens, k)
