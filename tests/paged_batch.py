"""Paged attention batches for the kernel tests: shuffled block tables over a pool poisoned outside them."""

from __future__ import annotations

import itertools
import math

import torch

# One mixed batch, rows deliberately not sorted by kind: (new tokens, context length).
MIXED_ROWS = [
    (1, 37),   # decode, context not a multiple of the block size
    (9, 70),   # chunked prefill: 61 cached tokens + 9 new
    (1, 100),  # decode
    (16, 48),  # prefix hit: 32 cached tokens (whole blocks at block_size 16) + 16 new
    (21, 21),  # fresh prefill
    (1, 1),    # decode of a one-token context
    (1, 64),   # decode, context a multiple of the block size
]


def make_batch(rows: list[tuple[int, int]], num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
               dtype: torch.dtype, seed: int = 0, spare_blocks: int = 3, spare_columns: int = 2):
    """A paged batch with shuffled block tables; returns (query, clean kv, poisoned kv, cu, ctx, tables).

    The poisoned pool holds NaN in every block no row owns and in the slots past each row's length,
    so reading a padding entry or an unwritten slot shows up as NaN in the output.
    """
    gen = torch.Generator().manual_seed(seed)
    q_lens = [n for n, _ in rows]
    ctx_lens = [c for _, c in rows]
    blocks_per_row = [math.ceil(c / block_size) for c in ctx_lens]
    num_blocks = sum(blocks_per_row) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen)  # rows get scattered, out-of-order blocks
    max_blocks = max(blocks_per_row) + spare_columns
    tables = torch.full((len(rows), max_blocks), -1, dtype=torch.long)  # [R, max_blocks], -1 padding
    kv = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)  # [2, N, B, Hkv, D]
    poisoned = torch.full_like(kv, float("nan"))
    used = 0
    for r, (nb, ctx) in enumerate(zip(blocks_per_row, ctx_lens, strict=True)):
        ids = perm[used:used + nb]
        used += nb
        tables[r, :nb] = ids
        for j, b in enumerate(ids.tolist()):
            valid = min(block_size, ctx - j * block_size)
            poisoned[:, b, :valid] = kv[:, b, :valid]
    num_tokens = sum(q_lens)
    query = torch.randn(num_tokens, num_q_heads, head_dim, generator=gen)  # [T, Hq, D]
    cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.long)  # [R + 1]
    ctx = torch.tensor(ctx_lens, dtype=torch.long)  # [R]
    return query.to(dtype), kv.to(dtype), poisoned.to(dtype), cu, ctx, tables
