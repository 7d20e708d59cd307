"""The CPU attention backend: decode rows read the paged pool in place through a native kernel
(csrc/paged_decode.c); rows with several new tokens (prefill, chunked prefill) go through the
reference's per-row SDPA, whose K/V gather is small beside its O(new tokens x context) compute.

Same contract as kernels/reference.py, which stays the oracle it is tested against.
"""

from __future__ import annotations

import ctypes

import torch

from pagedserve.kernels import reference
from pagedserve.kernels.native import paged_decode_library
from pagedserve.kernels.reference import attend_rows, write_kv_cache

__all__ = ["available", "paged_attention", "write_kv_cache"]

_KV_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def available() -> bool:
    """Whether the native kernel could be built on this machine."""
    return paged_decode_library() is not None


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
) -> torch.Tensor:
    """See reference.paged_attention. Returns [T, Hq, D] in query's dtype."""
    lib = paged_decode_library()
    num_q_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    if (lib is None or kv_cache.dtype not in _KV_DTYPES or kv_cache.device.type != "cpu"
            or not lib.paged_decode_supports(num_q_heads, num_kv_heads, head_dim, block_size)):
        return reference.paged_attention(query, kv_cache, cu_seqlens_q, context_lens, block_tables, scale)

    cu_seqlens_q = cu_seqlens_q.to(torch.int64).contiguous()  # the kernel reads int64
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]  # [R]
    if max_query_len == 1:
        decode_rows = torch.arange(len(q_lens))
        other_rows: list[int] = []
    else:
        is_decode = q_lens == 1
        decode_rows = is_decode.nonzero().flatten()  # [Rd]
        other_rows = (~is_decode).nonzero().flatten().tolist()

    fp32 = query.dtype == torch.float32
    q32 = query.contiguous() if fp32 else query.float().contiguous()  # [T, Hq, D]
    out32 = torch.empty_like(q32)
    if len(decode_rows):
        context_lens = context_lens.to(torch.int64).contiguous()
        block_tables = block_tables.to(torch.int64).contiguous()
        kv_cache = kv_cache.contiguous()
        status = lib.paged_decode_attention(
            q32.data_ptr(), kv_cache.data_ptr(), _KV_DTYPES[kv_cache.dtype], out32.data_ptr(),
            decode_rows.data_ptr(), len(decode_rows), cu_seqlens_q.data_ptr(), context_lens.data_ptr(),
            block_tables.data_ptr(), block_tables.stride(0), num_q_heads, num_kv_heads, head_dim, block_size,
            kv_cache.shape[1], ctypes.c_float(scale), torch.get_num_threads())
        if status == -2:
            raise ValueError("block_tables name a block outside the KV pool "
                             f"(num_blocks={kv_cache.shape[1]})")
        if status != 0:
            raise RuntimeError(f"paged_decode_attention failed with status {status}")
    out = out32 if fp32 else out32.to(query.dtype)
    if other_rows:
        attend_rows(query, kv_cache, cu_seqlens_q.tolist(), context_lens.tolist(), block_tables, scale, other_rows,
                    out)
    return out
