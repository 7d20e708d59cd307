"""Plain-torch paged KV write and paged attention: the CPU path and the oracle for the Triton kernels.

KV pool layout per layer: [2, num_blocks, block_size, num_kv_heads, head_dim] (K then V);
slot = block_id * block_size + offset.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.kernels.checks import check_sinks, check_softcap, check_window


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dim of `x` in transformers' LlamaRMSNorm's order (fp32 variance, the normalized
    values cast to x's dtype before the weight multiplies them). With `residual`: of `residual + x`, which
    `residual` then holds (updated in place, as the fused kernels update it)."""
    if residual is not None:
        x = residual.add_(x)
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def rotate_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D] and k [T, Hkv, D] rotated by the rotary embedding (cos/sin [T, 1, R], halves duplicated),
    as new tensors: transformers' `x * cos + rotate_half(x) * sin` (the non-interleaved layout) over each head's
    first R dims, the rest passed through (a partial rotary embedding: R < D)."""
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        return torch.cat([_rotate(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]], dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos + rotated * sin


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Scatter key/value [T, Hkv, D] into kv_cache [2, N, B, Hkv, D] at slot_mapping [T] (-1: skip)."""
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    flat = kv_cache.view(2, num_blocks * block_size, *kv_cache.shape[3:])
    if bool((slot_mapping < 0).any()):  # only padded batches skip slots: mask just then (it costs 3 gathers)
        keep = slot_mapping >= 0
        slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
    flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    max_context_len: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each row's new queries over its paged context.

    query [T, Hq, D]; cu_seqlens_q [R + 1]; context_lens [R] (cached prefix + new tokens);
    block_tables [R, max_blocks] (entries past a row's length are ignored). Row r's query i
    sits at position p = context_len - num_q + i and sees keys 0..p (causal among the new tokens,
    full over the prefix); with a sliding `window`, only keys p - window + 1 .. p (transformers'
    `sliding_window`: at most `window` keys, its own included). With a `softcap` (Gemma's
    attn_logit_softcapping), each scaled score s becomes softcap * tanh(s / softcap) before the mask. With
    `sinks` [Hq] (gpt-oss's attention sinks), head h's softmax has exp(sinks[h]) added to its denominator: a logit
    beside the keys' that attends to no value. Returns [T, Hq, D] in query's dtype.
    The max_* hints are for the Triton backend (launch shapes without a device sync); the reference
    reads the lists.
    """
    check_window(window)
    check_softcap(softcap)
    check_sinks(sinks, query.shape[1])
    out = torch.empty_like(query)
    cu = cu_seqlens_q.tolist()
    lens = context_lens.tolist()
    q_lens = [cu[r + 1] - cu[r] for r in range(len(lens))]
    decode_rows = [r for r, n in enumerate(q_lens) if n == 1]
    if len(decode_rows) > 1:
        _decode_rows(query, kv_cache, cu, lens, block_tables, scale, decode_rows, out, window, softcap, sinks)
    else:
        decode_rows = []
    skip = set(decode_rows)
    attend_rows(query, kv_cache, cu, lens, block_tables, scale, [r for r in range(len(lens)) if r not in skip], out,
                window, softcap, sinks)
    return out


def attend_rows(query: torch.Tensor, kv_cache: torch.Tensor, cu: list[int], lens: list[int],
                block_tables: torch.Tensor, scale: float, rows: list[int], out: torch.Tensor,
                window: int | None = None, softcap: float | None = None, sinks: torch.Tensor | None = None) -> None:
    """Row by row: gather the row's K/V and run one causal SDPA over its new queries, into `out`."""
    for r in rows:
        num_q = cu[r + 1] - cu[r]
        if num_q == 0:
            continue
        k, v = gather_kv(kv_cache, block_tables[r], lens[r])  # [L, Hkv, D] each
        q = query[cu[r]:cu[r + 1]].transpose(0, 1)  # [Hq, nq, D]
        start = lens[r] - num_q
        if start == 0 and window is None and softcap is None and sinks is None:  # plain causal: SDPA skips tiles
            mask = None
        else:
            keys = torch.arange(lens[r], device=query.device)[None, :]
            positions = start + torch.arange(num_q, device=query.device)[:, None]
            mask = keys <= positions
            if window is not None:
                mask &= keys > positions - window
            mask = mask[None, None]  # [1, 1, nq, L]
        # 4-D inputs: on CPU, 3-D ones fall back to SDPA's math path (~100x slower here).
        o = _attention(q[None], k.transpose(0, 1)[None].to(q.dtype), v.transpose(0, 1)[None].to(q.dtype), mask,
                       scale, softcap, sinks)
        out[cu[r]:cu[r + 1]] = o[0].transpose(0, 1)


def _decode_rows(query, kv_cache, cu, lens, block_tables, scale, rows, out, window=None, softcap=None,
                 sinks=None) -> None:
    """One batched SDPA for all single-token rows: gather padded K/V and mask by length."""
    block_size = kv_cache.shape[2]
    max_len = max(lens[r] for r in rows)
    num_blocks = -(-max_len // block_size)
    idx = torch.tensor(rows, device=query.device)
    tables = block_tables[idx, :num_blocks].clamp(min=0)  # [R, nb]; padding points at block 0, masked
    k = kv_cache[0][tables].flatten(1, 2)[:, :max_len]  # [R, max_len, Hkv, D]
    v = kv_cache[1][tables].flatten(1, 2)[:, :max_len]
    token_idx = torch.tensor([cu[r] for r in rows], device=query.device)
    q = query[token_idx].unsqueeze(2)  # [R, Hq, 1, D]
    row_lens = torch.tensor([lens[r] for r in rows], device=query.device)
    keys = torch.arange(max_len, device=query.device)[None, :]
    mask = keys < row_lens[:, None]  # [R, max_len]
    if window is not None:
        mask &= keys >= row_lens[:, None] - window
    mask = mask[:, None, None, :]
    o = _attention(q, k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype), mask, scale, softcap, sinks)
    out[token_idx] = o.squeeze(2)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
               softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, nq, D] over k, v [B, Hkv, L, D] (GQA: Hq a multiple of Hkv), where the bool `mask` [B or 1, 1, nq, L]
    allows (None: causal, nq == L). Without a soft cap or sinks one SDPA; else transformers' eager attention: the
    scaled scores capped, then masked, each head's sink logit appended as one more column, softmax in fp32, the
    sink's column dropped."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                              enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, Hq, nq, L]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)
    sink = sinks.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:-1], 1)  # [B, Hq, nq, 1]
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=torch.float32)[..., :-1]
    return torch.matmul(probs.to(q.dtype), v)


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [length, Hkv, D] of one sequence, read through its block table."""
    block_size = kv_cache.shape[2]
    blocks = block_table[: -(-length // block_size)]
    k = kv_cache[0][blocks].flatten(0, 1)[:length]
    v = kv_cache[1][blocks].flatten(0, 1)[:length]
    return k, v
