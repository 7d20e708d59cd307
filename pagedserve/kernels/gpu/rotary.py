"""Rotary embedding of a step's queries and keys in one Triton kernel, in place.

Eager torch rotates each of q and k in five kernels (negate, concatenate, two products, a sum): ten a
layer, each a few microseconds of launch-bound GPU time in a small model's decode step. Here one program
rotates every head of one token, rounding each product and the sum to the tensors' dtype as transformers'
`q * cos + rotate_half(q) * sin` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.checks import check_rotation


@triton.jit
def _rotate_heads(x_ptr, row, stride_t, stride_h, num_heads, c1, c2, s1, s2, offs_h, offs_d, mask_d,
                  HALF: tl.constexpr):
    mask = (offs_h[:, None] < num_heads) & mask_d[None, :]
    lo = x_ptr + row * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]  # [BLOCK_H, BLOCK_HALF]
    x1 = tl.load(lo, mask=mask, other=0.0)
    x2 = tl.load(lo + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    # rotate_half(x) is (-x2, x1); each product and the sum rounded to x's dtype.
    out1 = ((x1.to(tl.float32) * c1).to(dtype).to(tl.float32) - (x2.to(tl.float32) * s1).to(dtype).to(tl.float32))
    out2 = ((x2.to(tl.float32) * c2).to(dtype).to(tl.float32) + (x1.to(tl.float32) * s2).to(dtype).to(tl.float32))
    tl.store(lo, out1.to(dtype), mask=mask)
    tl.store(lo + HALF, out2.to(dtype), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ct, stride_st,
    num_q_heads, num_kv_heads,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < HALF
    c1 = tl.load(cos_ptr + row * stride_ct + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + row * stride_ct + HALF + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + row * stride_st + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + row * stride_st + HALF + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(q_ptr, row, stride_qt, stride_qh, num_q_heads, c1, c2, s1, s2, tl.arange(0, BLOCK_HQ), offs_d,
                  mask_d, HALF)
    _rotate_heads(k_ptr, row, stride_kt, stride_kh, num_kv_heads, c1, c2, s1, s2, tl.arange(0, BLOCK_HK), offs_d,
                  mask_d, HALF)


def rotate_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place by cos/sin [T, 1, R]: each head's first R dims (see
    `backend.RotateQK`); the rest are not touched."""
    check_rotation(q, k, cos, sin)
    num_tokens, num_q_heads, _ = q.shape
    if num_tokens == 0:
        return
    half = cos.shape[-1] // 2
    _rope_kernel[(num_tokens,)](
        q, k, cos, sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
        num_q_heads, k.shape[1],
        HALF=half, BLOCK_HALF=triton.next_power_of_2(half), BLOCK_HQ=triton.next_power_of_2(num_q_heads),
        BLOCK_HK=triton.next_power_of_2(k.shape[1]),
        num_warps=4,
        # No fused multiply-adds: they would round a product once with the sum, where transformers rounds
        # each on its own. (LLVM also narrows 16-bit arithmetic done in fp32 to the 16-bit type, where a
        # fused multiply-add again drops the product's rounding.)
        enable_fp_fusion=False,
    )
