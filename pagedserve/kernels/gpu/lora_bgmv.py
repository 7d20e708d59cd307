"""LoRA's added products on the GPU (Triton), each token through its own adapter slot, as Punica's BGMV computes
them (vLLM's LoRA kernels): a shrink, `x A[slot]^T` for every token, then an expand that adds `shrunk B[slot]^T`
to the token's output row, each output column reading its own part's rank columns (the layout of
`kernels/lora_products.py`). A token of slot -1 (the base model's) is skipped.

The slots come as a tensor, read on the device: no grouping on the host, no size that depends on the step's
adapters, so a step with adapter rows could be captured in a CUDA graph as any other."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slots_ptr, out_ptr, N, K, stride_xt, stride_as, stride_an, stride_ot,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[t, n] = sum_k x[t, k] * A[slot[t], n, k] for the BLOCK_N columns n of program 1."""
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    if slot < 0:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    a_base = a_ptr + slot.to(tl.int64) * stride_as + cols[:, None].to(tl.int64) * stride_an
    for k0 in range(0, K, BLOCK_K):
        k_ok = ks + k0 < K
        x = tl.load(x_ptr + t.to(tl.int64) * stride_xt + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
        a = tl.load(a_base + k0 + ks[None, :], mask=(cols[:, None] < N) & k_ok[None, :], other=0.0)
        acc += tl.sum(a.to(tl.float32) * x[None, :], axis=1)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + cols, acc, mask=cols < N)


@triton.jit
def _expand_kernel(shrunk_ptr, b_ptr, slots_ptr, out_ptr, N, RANK, END0, END1, stride_st, stride_bs, stride_bn,
                   stride_ot, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """out[t, c] += sum_r shrunk[t, part(c) * RANK + r] * B[slot[t], c, r], part(c) = (c >= END0) + (c >= END1)."""
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    if slot < 0:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rs = tl.arange(0, BLOCK_R)
    ok = (cols[:, None] < N) & (rs[None, :] < RANK)
    part = (cols >= END0).to(tl.int32) + (cols >= END1).to(tl.int32)
    h = tl.load(shrunk_ptr + t.to(tl.int64) * stride_st + part[:, None] * RANK + rs[None, :], mask=ok, other=0.0)
    b = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + cols[:, None].to(tl.int64) * stride_bn + rs[None, :],
                mask=ok, other=0.0)
    delta = tl.sum(h * b.to(tl.float32), axis=1)
    o = out_ptr + t.to(tl.int64) * stride_ot + cols
    tl.store(o, (tl.load(o, mask=cols < N, other=0.0).to(tl.float32) + delta).to(out_ptr.dtype.element_ty),
             mask=cols < N)


def add_lora(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, parts: tuple[int, ...],
             token_slots: torch.Tensor) -> torch.Tensor:
    """out [T, out] += each token's LoRA products through slot token_slots[t] (x [T, in], A [S, parts * R, in],
    B [S, out, R]; -1: none), in place; returns `out`."""
    if len(parts) > 3 or out.stride(1) != 1:
        raise ValueError(f"a projection of {len(parts)} parts, output stride {out.stride(1)}: the kernel takes at "
                         "most 3 parts, and output rows contiguous")
    num_tokens, k = x.shape
    rank = b.shape[-1]
    n_shrunk = a.shape[1]
    x = x.contiguous()
    shrunk = torch.empty(num_tokens, n_shrunk, dtype=torch.float32, device=x.device)  # [T, parts * R]
    block_n = min(64, triton.next_power_of_2(n_shrunk))
    _shrink_kernel[(num_tokens, triton.cdiv(n_shrunk, block_n))](
        x, a, token_slots, shrunk, n_shrunk, k, x.stride(0), a.stride(0), a.stride(1), shrunk.stride(0),
        BLOCK_N=block_n, BLOCK_K=min(128, triton.next_power_of_2(k)))
    ends = [sum(parts[:i + 1]) for i in range(len(parts))] + [out.shape[1]] * (3 - len(parts))
    n = out.shape[1]
    block_out = min(128, triton.next_power_of_2(n))
    _expand_kernel[(num_tokens, triton.cdiv(n, block_out))](
        shrunk, b, token_slots, out, n, rank, ends[0], ends[1], shrunk.stride(0), b.stride(0), b.stride(1),
        out.stride(0), BLOCK_N=block_out, BLOCK_R=triton.next_power_of_2(rank))
    return out
