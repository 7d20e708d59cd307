"""The experts of a mixture-of-experts layer in two grouped GEMMs (Triton), as vLLM's fused_moe computes them.

Token-expert pairs are sorted by expert and each expert's run padded to a multiple of BLOCK_M, so that every
BLOCK_M rows of the sorted order belong to one expert: one program computes such a block against one tile of
that expert's weights, reading its tokens' rows of x where they lie (no gathered copy). The first GEMM gives
each pair's gate and up projections, the second its down projection, stored at the pair's own index.

Every size is a bound known from the token count alone (pairs + experts x (BLOCK_M - 1) rows), and the sorting is
done on the device: nothing waits for the host, so decode steps of a mixture-of-experts model can be captured in
CUDA graphs, which the loop over experts (`workers/models/moe.py`), reading each expert's token count on the
host, cannot.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BLOCK_M = 16  # rows of one expert per program: decode steps route a few tokens to each expert


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, sorted_pairs_ptr, block_experts_ptr,
    num_pairs, N, K, top_k,
    stride_am, stride_be, stride_bn, stride_cm,
    A_SORTED: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """C[row] = A[row's input] @ B[e]^T for the BLOCK_M sorted rows of program 0's block and BLOCK_N columns
    of program 1's tile. A's row is the pair's token (pair // top_k) or, with A_SORTED, the sorted row itself
    (the first GEMM's output); C's row is the sorted row, or the pair where A_SORTED (the second GEMM's)."""
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    if expert < 0:  # past the last expert's padded run
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + rows)
    valid = pairs < num_pairs  # padding rows hold num_pairs
    if A_SORTED:
        a_rows = rows.to(tl.int64)
        c_rows = pairs.to(tl.int64)
    else:
        a_rows = (pairs // top_k).to(tl.int64)
        c_rows = rows.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a = a_ptr + a_rows[:, None] * stride_am + ks[None, :]
    b = b_ptr + expert.to(tl.int64) * stride_be + cols[None, :].to(tl.int64) * stride_bn + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = ks + k0 < K
        a_tile = tl.load(a, mask=valid[:, None] & k_ok[None, :], other=0.0)
        b_tile = tl.load(b, mask=k_ok[:, None] & (cols[None, :] < N), other=0.0)
        if UPCAST:  # exact fp32 products (never TF32), as the loop over experts computes them
            acc = tl.dot(a_tile.to(tl.float32), b_tile.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a_tile, b_tile, acc)
        a += BLOCK_K
        b += BLOCK_K
    c = c_ptr + c_rows[:, None] * stride_cm + cols[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (cols[None, :] < N))


def align_pairs(experts: torch.Tensor, num_experts: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-expert pairs (experts [T, k], pair p = token p // k's choice p % k) in expert order, each expert's
    run padded to a multiple of `block_m`: (sorted_pairs [R], the pair at each row or T * k for padding;
    block_experts [R / block_m], each block's expert or -1 past the last run). R = T * k + E * (block_m - 1)
    rounded up to `block_m`: a bound that depends on T alone, so the result has the same shape in every step of a
    CUDA graph. Computed on the device, with no host sync."""
    flat = experts.reshape(-1)
    num_pairs = flat.numel()
    rows = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m
    # scatter_add, not bincount: bincount reads the largest id on the host to size its output, a sync that a
    # CUDA graph's capture refuses
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    padded_end = torch.cumsum(padded, 0)  # [E]
    order = torch.argsort(flat, stable=True)  # pair indices in expert order  [P]
    sorted_experts = flat[order]
    rank = torch.arange(num_pairs, device=flat.device) - (torch.cumsum(counts, 0) - counts)[sorted_experts]
    dest = padded_end[sorted_experts] - padded[sorted_experts] + rank  # each sorted pair's row  [P]
    sorted_pairs = torch.full((rows,), num_pairs, dtype=torch.int32, device=flat.device)  # [R]
    sorted_pairs[dest] = order.to(torch.int32)
    block_starts = torch.arange(0, rows, block_m, device=flat.device)  # [R / block_m]
    block_experts = torch.searchsorted(padded_end, block_starts, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1).to(torch.int32)
    return sorted_pairs, block_experts


def _grouped_gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, sorted_pairs: torch.Tensor,
                  block_experts: torch.Tensor, num_pairs: int, top_k: int, a_sorted: bool) -> None:
    n, k = b.shape[1], b.shape[2]
    block_n = 64 if n >= 64 else triton.next_power_of_2(max(n, 16))
    block_k = 64 if k >= 64 else triton.next_power_of_2(max(k, 16))
    grid = (block_experts.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, b, out, sorted_pairs, block_experts, num_pairs, n, k, top_k,
        a.stride(0), b.stride(0), b.stride(1), out.stride(0),
        # fp32 dots for fp32 weights, and for bf16 in the interpreter (which mishandles bf16 arithmetic; its fp16
        # is right, so fp16 tests run the GPU's 16-bit path)
        A_SORTED=a_sorted, UPCAST=b.dtype == torch.float32 or (b.dtype == torch.bfloat16 and not b.is_cuda),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
    )


def fused_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor, gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                  activation: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """`workers.models.moe.grouped_experts` in two grouped GEMMs: x [T, H], weights and experts [T, k],
    gate_up [E, 2I, H], down [E, H, I], their biases [E, 2I] and [E, H] where given, the activation of [gate | up]
    rows (None: SiLU(gate) * up) -> the weighted sum of each token's experts' outputs [T, H] (x's dtype)."""
    for name, t in (("x", x), ("gate_up", gate_up), ("down", down)):
        if t.stride(-1) != 1:
            raise ValueError(f"fused_experts: {name} {tuple(t.shape)} must be contiguous in its last dimension")
    num_tokens, top_k = experts.shape
    num_pairs = num_tokens * top_k
    inter = down.shape[2]
    sorted_pairs, block_experts = align_pairs(experts, gate_up.shape[0])
    gate_up_out = torch.empty(sorted_pairs.numel(), 2 * inter, dtype=x.dtype, device=x.device)  # [R, 2I]
    _grouped_gemm(x, gate_up, gate_up_out, sorted_pairs, block_experts, num_pairs, top_k, a_sorted=False)
    if gate_up_bias is not None:  # each sorted row's expert's (a block's expert; padding blocks' -1 read expert 0)
        gate_up_out += gate_up_bias[block_experts.clamp(min=0).repeat_interleave(BLOCK_M)]
    if activation is None:
        gate, up = gate_up_out.chunk(2, dim=-1)
        act = F.silu(gate) * up
    else:
        act = activation(gate_up_out)
    act = act.contiguous()  # [R, I]; padding rows hold garbage that no store reads back
    out = torch.empty(num_pairs, down.shape[1], dtype=x.dtype, device=x.device)  # [T * k, H] in pair order
    _grouped_gemm(act, down, out, sorted_pairs, block_experts, num_pairs, top_k, a_sorted=True)
    if down_bias is not None:
        out += down_bias[experts.reshape(-1)]
    # weighted and summed over each token's k pairs as grouped_experts does (in the weights' dtype where wider)
    return (out * weights.reshape(-1, 1)).view(num_tokens, top_k, -1).sum(dim=1).to(x.dtype)
