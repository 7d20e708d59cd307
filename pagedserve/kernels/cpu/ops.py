"""The CPU attention backend: every query token reads the paged pool in place through a native kernel
(csrc/paged_attention.c), a prefill token exactly as a decode row whose context ends there. So a token's
attention does not depend on how the sequence's tokens were scheduled: alone or batched, prefilled in one
chunk or many, recomputed after a preemption, read from the prefix cache. In fp32, the K/V write, the rotary
embedding, the RMSNorm and the SiLU gate are one native call each (csrc/layer_ops.c); other dtypes, or where
no C compiler builds them, run the reference's torch ops.

Same contract as kernels/reference.py, which stays the oracle it is tested against.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from pagedserve.kernels import reference
from pagedserve.kernels.checks import check_rotation, check_sinks, check_softcap, check_window
from pagedserve.kernels.cpu.native import layer_ops_library, paged_attention_library

__all__ = ["available", "paged_attention", "rms_norm", "rms_norm_heads", "rotate_qk", "route_topk", "silu_mul",
           "supports_shape", "write_kv_cache"]

_KV_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def available() -> bool:
    """Whether the native kernel could be built on this machine."""
    return paged_attention_library() is not None


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
    """See reference.paged_attention. Returns [T, Hq, D] in query's dtype. With a `window`, each token reads
    only the blocks its window reaches."""
    check_window(window)
    check_softcap(softcap)
    check_sinks(sinks, query.shape[1])
    lib = paged_attention_library()
    num_q_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    if (lib is None or kv_cache.dtype not in _KV_DTYPES or kv_cache.device.type != "cpu"
            or not supports_shape(num_q_heads, num_kv_heads, head_dim, block_size)):
        return reference.paged_attention(query, kv_cache, cu_seqlens_q, context_lens, block_tables, scale,
                                         window=window, softcap=softcap, sinks=sinks)

    fp32 = query.dtype == torch.float32
    q32 = query.contiguous() if fp32 else query.float().contiguous()  # [T, Hq, D]
    out32 = torch.empty_like(q32)
    cu_seqlens_q = cu_seqlens_q.to(torch.int64).contiguous()  # the kernel reads int64
    context_lens = context_lens.to(torch.int64).contiguous()
    block_tables = block_tables.to(torch.int64).contiguous()
    kv_cache = kv_cache.contiguous()
    sinks = None if sinks is None else sinks.contiguous()
    status = lib.paged_attention_sinks(
        q32.data_ptr(), kv_cache.data_ptr(), _KV_DTYPES[kv_cache.dtype], out32.data_ptr(), context_lens.shape[0],
        cu_seqlens_q.data_ptr(), context_lens.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
        num_q_heads, num_kv_heads, head_dim, block_size, kv_cache.shape[1], ctypes.c_float(scale),
        torch.get_num_threads(), 0 if window is None else window, ctypes.c_float(softcap or 0.0),
        None if sinks is None else sinks.data_ptr())
    if status == -2:
        raise ValueError(f"block_tables name a block outside the KV pool (num_blocks={kv_cache.shape[1]})")
    if status == -3:
        raise MemoryError("paged_attention: no memory for its slices' partial sums")
    if status == -4:
        raise ValueError("context_lens: a row has more new tokens (cu_seqlens_q) than context")
    if status != 0:
        raise RuntimeError(f"paged_attention failed with status {status}")
    return out32 if fp32 else out32.to(query.dtype)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """See reference.write_kv_cache; a slot past the pool is an IndexError, as index_copy_ makes it."""
    lib = layer_ops_library()
    if (lib is None or not _f32(key, value, kv_cache) or key.stride(-1) != 1 or value.stride(-1) != 1
            or not kv_cache.is_contiguous() or slot_mapping.dtype != torch.int64):
        reference.write_kv_cache(key, value, kv_cache, slot_mapping)
        return
    slot_mapping = slot_mapping.contiguous()
    num_slots = kv_cache.shape[1] * kv_cache.shape[2]
    status = lib.write_kv_f32(key.data_ptr(), key.stride(0), key.stride(1), value.data_ptr(), value.stride(0),
                              value.stride(1), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(),
                              slot_mapping.data_ptr(), key.shape[0], key.shape[1], key.shape[2], num_slots)
    if status:
        raise IndexError(f"slot_mapping names a slot past the KV pool's {num_slots}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """See backend.RMSNormRows. In fp32 one native call, whose mean of squares is summed in an order of its own
    (the same for every row): the last bits differ from torch's, not from one row or batch to another."""
    if x.dim() != 2 or weight.shape != (x.shape[1],) or (residual is not None and residual.shape != x.shape):
        got = None if residual is None else tuple(residual.shape)
        raise ValueError(f"rms_norm needs x [T, H], weight [H] and residual [T, H]: got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}, residual {got}")
    lib = layer_ops_library()
    tensors = (x, weight) if residual is None else (x, weight, residual)
    if (lib is None or not _f32(*tensors) or x.stride(1) != 1 or not weight.is_contiguous()
            or (residual is not None and residual.stride(1) != 1)):
        return reference.rms_norm(x, weight, eps, residual)
    out = torch.empty(x.shape)  # [T, H]
    lib.rms_norm_f32(x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
                     0 if residual is None else residual.stride(0), weight.data_ptr(), ctypes.c_float(eps),
                     out.data_ptr(), out.stride(0), x.shape[0], x.shape[1], torch.get_num_threads())
    return out


def rms_norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """See backend.RMSNormHeads: `rms_norm`'s arithmetic on each head."""
    if x.dim() != 3 or weight.shape != (x.shape[2],):
        raise ValueError(f"rms_norm_heads needs x [T, heads, D] and weight [D]: got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")
    lib = layer_ops_library()
    if lib is None or not _f32(x, weight) or x.stride(2) != 1 or not weight.is_contiguous():
        return reference.rms_norm(x, weight, eps)
    out = torch.empty(x.shape)  # [T, heads, D]
    lib.rms_norm_heads_f32(x.data_ptr(), x.stride(0), x.stride(1), weight.data_ptr(), ctypes.c_float(eps),
                           out.data_ptr(), out.stride(0), out.stride(1), x.shape[0], x.shape[1], x.shape[2])
    return out


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """See backend.SiluMul. In fp32 one native call, whose exp is its own (within 2e-7 of torch's)."""
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"silu_mul needs x [T, 2 * I] (gate, then up): got {tuple(x.shape)}")
    lib = layer_ops_library()
    if lib is None or not _f32(x) or x.stride(1) != 1:
        gate, up = x.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up
    n = x.shape[1] // 2
    out = torch.empty(x.shape[0], n)  # [T, I]
    lib.silu_mul_f32(x.data_ptr(), x.stride(0), out.data_ptr(), n, x.shape[0], n, torch.get_num_threads())
    return out


def route_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """See backend.RouteTopK: one native call for fp32 CPU logits [T, E], else None (the caller routes with
    torch)."""
    lib = layer_ops_library()
    if lib is None or not _f32(logits) or logits.dim() != 2:
        return None
    logits = logits.contiguous()
    weights = torch.empty(logits.shape[0], top_k)  # [T, k]
    ids = torch.empty(logits.shape[0], top_k, dtype=torch.int64)
    lib.route_topk_f32(logits.data_ptr(), logits.shape[0], logits.shape[1], top_k, int(renormalize),
                       weights.data_ptr(), ids.data_ptr())
    return weights, ids


def rotate_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """See backend.RotateQK."""
    check_rotation(q, k, cos, sin)
    lib = layer_ops_library()
    if lib is None or not _f32(q, k, cos, sin):
        q_rotated, k_rotated = reference.rotate_qk(q, k, cos, sin)
        q.copy_(q_rotated)
        k.copy_(k_rotated)
        return
    lib.rotate_qk_f32(q.data_ptr(), q.stride(0), q.stride(1), q.shape[1], k.data_ptr(), k.stride(0), k.stride(1),
                      k.shape[1], cos.data_ptr(), cos.stride(0), sin.data_ptr(), sin.stride(0), q.shape[0],
                      cos.shape[-1])  # the dims rotated: each head's first R (all D but for a partial rotary)


@functools.cache
def supports_shape(num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> bool:
    """Whether the native attention kernel takes this shape (asked once per shape, not once per layer and step)."""
    return bool(paged_attention_library().paged_attention_supports(num_q_heads, num_kv_heads, head_dim, block_size))


def _f32(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.is_cpu for t in tensors)
