"""Prompt-lookup proposals (vLLM's `ngram` method): the tokens that followed an earlier occurrence of the context's
last n tokens.

The n-gram is the longest suffix of the context, between `min_n` and `max_n` tokens, that occurred before (overlapping
the suffix itself allowed, but not the suffix alone); of its occurrences, the earliest. The proposal is the up to `k`
tokens that followed it, as vLLM's `NgramProposer` picks them, so acceptance rates compare across the two.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose_ngram(tokens: Sequence[int], k: int, min_n: int, max_n: int, max_len: int | None = None) -> list[int]:
    """Up to `k` proposed next tokens for `tokens` (the prompt and the output so far); none where no n-gram of
    `min_n` to `max_n` tokens recurs. `max_len`: the sequence's cap (max_model_len): nothing is proposed past it."""
    if not 1 <= min_n <= max_n:
        raise ValueError(f"prompt_lookup_min={min_n} and prompt_lookup_max={max_n}: 1 <= min <= max")
    total = len(tokens)
    if max_len is not None:
        k = min(k, max_len - total)
    if k <= 0 or total <= min_n:
        return []
    t = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        # every start s < total - n whose n tokens are the suffix's: windows [total - n, n] over all but the suffix
        windows = np.lib.stride_tricks.sliding_window_view(t[:total - 1], n)  # [total - n, n]
        starts = np.flatnonzero((windows == t[total - n:]).all(axis=1))
        if starts.size:
            follow = int(starts[0]) + n
            return t[follow:follow + k].tolist()
    return []
