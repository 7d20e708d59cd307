"""RMSNorm in one Triton kernel, with the residual add before it fused in.

Eager torch computes a decoder layer's RMSNorm in eight kernels (upcast, square, mean, add, rsqrt, scale,
downcast, weight) and the residual add before it in a ninth: for a small model decoding a few hundred rows,
each is a few microseconds of launch-bound GPU time, and two norms a layer add up to most of a step. Here
one program normalizes one row, in the same order of operations and roundings as transformers'
`LlamaRMSNorm` (fp32 variance, the normalized row cast to the input's dtype before the weight multiplies it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr,
    stride_x, stride_r, stride_o, eps,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if ADD:
        # The residual stream gains x, rounded to its dtype as torch's add rounds it, in place.
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(residual_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * stride_r + offs, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, 0) / HIDDEN
    normed = (xf * tl.math.rsqrt(variance + eps)).to(x.dtype)  # the input's dtype, as transformers casts it
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of each row of `x` [T, H] (of `residual + x` when `residual` is given: `residual` then holds
    that sum afterwards, updated in place). The output has the dtype `weight * x` would have."""
    if x.dim() != 2 or x.stride(-1) != 1 or weight.shape != (x.shape[1],):
        raise ValueError(f"rms_norm needs rows [T, H] contiguous in H and a weight [H]: got x {tuple(x.shape)} "
                         f"(strides {x.stride()}), weight {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1):
        raise ValueError(f"rms_norm: residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)  # [T, H]
    if x.shape[0] == 0:
        return out
    hidden = x.shape[1]
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(x.shape[0],)](
        x, residual if residual is not None else x, weight, out,
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0), eps,
        HIDDEN=hidden, BLOCK=block, ADD=residual is not None,
        num_warps=min(max(block // 256, 1), 8),
    )
    return out
