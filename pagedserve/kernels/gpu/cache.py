"""Triton scatter of a step's K/V into the paged KV pool (see reference.write_kv_cache)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kv, stride_block, stride_slot, stride_ch,
    num_heads,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    CAST: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # padding token or a slot the scheduler chose not to write
        return
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    # head_dim need not be a power of two: the padded lanes are masked off.
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < HEAD_DIM)
    dst = (cache_ptr + (slot // BLOCK_SIZE) * stride_block + (slot % BLOCK_SIZE) * stride_slot
           + offs_h[:, None] * stride_ch + offs_d[None, :])
    k = tl.load(key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    if CAST:
        # Through fp32: the interpreter mishandles direct bf16 conversions.
        k = k.to(tl.float32).to(cache_ptr.dtype.element_ty)
        v = v.to(tl.float32).to(cache_ptr.dtype.element_ty)
    tl.store(dst, k, mask=mask)
    tl.store(dst + stride_kv, v, mask=mask)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Scatter key/value [T, Hkv, D] into kv_cache [2, N, B, Hkv, D] at slot_mapping [T] (-1: skip).

    One launch, one program per (token, group of heads); key/value may be strided views
    (e.g. slices of a fused QKV projection) as long as the last dim is contiguous.
    """
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    assert kv_cache.stride(-1) == 1, "kv_cache must be contiguous in head_dim"
    block_d = triton.next_power_of_2(head_dim)
    # Cap a program's tile at ~4K elements so wide models still get several programs per token.
    block_h = min(triton.next_power_of_2(num_heads), max(1, 4096 // block_d))
    grid = (num_tokens, triton.cdiv(num_heads, block_h))
    _write_kv_kernel[grid](
        key, value, kv_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        num_heads,
        BLOCK_SIZE=kv_cache.shape[2], HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d,
        CAST=key.dtype != kv_cache.dtype or value.dtype != kv_cache.dtype,
        num_warps=4 if block_h * block_d >= 1024 else 1,
    )
