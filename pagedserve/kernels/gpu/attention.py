"""Triton paged attention for a mixed batch of decode, prefill and chunked-prefill rows.

Same interface and semantics as reference.paged_attention. Two kernels share one inner loop:

- `_prefill_kernel`, grid (query tiles, Hkv): rows with >= 2 new tokens. A program owns
  BLOCK_Q query tokens x the G = Hq/Hkv query heads of one KV head, flattened into the
  M = BLOCK_M rows of its tl.dot, so each K/V tile is loaded once per head group (GQA).
  KV tiles strictly before the tile's first query position run without any mask; only the
  diagonal tiles apply the causal mask.
- `_decode_kernel`, grid (R, Hkv, splits): rows with one new token. M = the G query heads of
  the KV head, padded to 16 for tl.dot. With splits > 1 (flash-decoding) each program covers
  one slice of the context and writes its normalised partial output and log-sum-exp;
  `_merge_kernel`, grid (R, Hq), combines them.

Both kernels are launched over every row and return at once for rows that are not theirs, so
nothing is read back to the host: grid sizes come from tensor shapes only (an upper bound on
query tiles, as in vLLM's unified attention), which also keeps the call CUDA-graph friendly.
KV tiles are BLOCK_N keys wide, independent of the pool's block size: each key's physical
block is gathered from the block table, and table entries past a row's length are never
loaded. Math is fp32 (scores in log2 units, exp2); the output is in the query's dtype.

Sliding window (`window`, a constexpr WINDOW; 0 is full causal attention): a query at position p sees
keys max(0, p - window + 1) .. p. Each prefill query tile and each decode row starts its key loop at
its earliest visible key rounded down to a KV tile, so a long context costs only its window; keys
before the window are masked within that first tile and never loaded. Decode splits cut the window's
span, not the whole context, so no slice is empty of visible keys.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from pagedserve.kernels.checks import check_sinks, check_softcap, check_window

_LOG2E = 1.4426950408889634


@triton.jit
def _attend_tile(
    acc, l_i, m_i, q, kv_ptr, table_ptr, start_n, ctx_len, q_pos, key_lo, lo_pos,
    head_off, stride_kv, stride_block, stride_slot, scale_log2, offs_d, mask_d,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    MASK_LEN: tl.constexpr, CAUSAL: tl.constexpr, MASK_WIN: tl.constexpr, UPCAST: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """One online-softmax step over keys [start_n, start_n + BLOCK_N) of one row and KV head.

    MASK_WIN: a tile that holds keys before some query's window: query row m sees keys >= lo_pos[m] only,
    and keys before key_lo (the least lo_pos) and from ctx_len on are not loaded at all.
    """
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if MASK_WIN:
        # Keys before the window are never read, so their blocks may already be gone from the table.
        mask_n = (offs_n >= key_lo) & (offs_n < ctx_len)
    elif MASK_LEN:
        mask_n = offs_n < ctx_len
    if MASK_LEN or MASK_WIN:
        # Masked so that table entries past the row's context (stale or padding) are never read.
        block = tl.load(table_ptr + offs_n // BLOCK_SIZE, mask=mask_n, other=0)
        mask_k = mask_d[:, None] & mask_n[None, :]
        mask_v = mask_n[:, None] & mask_d[None, :]
    else:
        block = tl.load(table_ptr + offs_n // BLOCK_SIZE)
        mask_k = mask_d[:, None]
        mask_v = mask_d[None, :]
    key_off = block.to(tl.int64) * stride_block + (offs_n % BLOCK_SIZE) * stride_slot + head_off  # [BLOCK_N]
    k = tl.load(kv_ptr + key_off[None, :] + offs_d[:, None], mask=mask_k, other=0.0)  # [BLOCK_D, BLOCK_N]
    if UPCAST:  # fp32 operands, exact fp32 dots (never TF32) to match the reference
        k = k.to(tl.float32)
        s = tl.dot(q, k, input_precision="ieee")
    else:
        s = tl.dot(q, k)
    s = s * scale_log2  # [BLOCK_M, BLOCK_N]
    if SOFTCAP > 0:
        # cap * tanh(s / cap) with s and the cap both in log2 units (SOFTCAP: the cap times log2(e)), before the
        # masks; tanh(x) = 1 - 2 / (e^2x + 1), which saturates to +-1 without a NaN
        s = SOFTCAP * (1.0 - 2.0 / (tl.exp2(s * (2.8853900817779268 / SOFTCAP)) + 1.0))  # 2 log2(e) / SOFTCAP
    if CAUSAL:
        s = tl.where((offs_n[None, :] <= q_pos[:, None]) & (offs_n[None, :] < ctx_len), s, float("-inf"))
    elif MASK_LEN or MASK_WIN:
        s = tl.where(mask_n[None, :], s, float("-inf"))
    if MASK_WIN:
        s = tl.where(offs_n[None, :] >= lo_pos[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASK_WIN:
        # A query may see no key of this tile nor of any before it (its window starts later): its max is still
        # -inf, and exp2(-inf - -inf) would be NaN. Against 0 instead, its p and alpha are 0.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
    else:
        # Without a window every row sees key 0 (or its split's first key) in its first tile: m_new is finite.
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(kv_ptr + stride_kv + key_off[:, None] + offs_d[None, :], mask=mask_v, other=0.0)  # [BLOCK_N, BLOCK_D]
    if UPCAST:
        v = v.to(tl.float32)
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return acc, l_i, m_new


@triton.jit
def _find_row(cu_q_ptr, tile, num_rows, BLOCK_Q: tl.constexpr):
    """Row r owning query tile `tile`: the last r with cu_q[r] // BLOCK_Q + r <= tile."""
    lo: tl.int32 = 0  # typed: loop-carried, and num_rows may arrive specialised as a constant
    hi = num_rows
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(cu_q_ptr + mid) // BLOCK_Q + mid
        if start <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# The kernels' `do_not_specialize` name their integer arguments that change from step to step. Triton would
# otherwise compile a variant of a kernel for each of their values that is 1 or a multiple of 16 (and one for
# the rest), mid-run: on an H100 those compilations cost seconds of the first minute's throughput.
@triton.jit(do_not_specialize=["num_rows", "stride_table"])
def _prefill_kernel(
    q_ptr, kv_ptr, cu_q_ptr, ctx_ptr, table_ptr, out_ptr, sinks_ptr,
    scale_log2, num_rows,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kv, stride_block, stride_slot, stride_kh, stride_table,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, HEAVY_FIRST: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
):
    tile = tl.program_id(0)
    if HEAVY_FIRST:
        # Programs start in launch order: reversed, each row's last query tiles (which see the most keys
        # under the causal mask) start before its first ones, and the grid's last wave holds light tiles.
        tile = tl.num_programs(0) - 1 - tile
    kv_head = tl.program_id(1)
    row = _find_row(cu_q_ptr, tile, num_rows, BLOCK_Q)
    q_start = tl.load(cu_q_ptr + row).to(tl.int32)
    num_q = tl.load(cu_q_ptr + row + 1).to(tl.int32) - q_start
    if num_q < 2:  # single-token rows belong to the decode kernel
        return
    tok0 = (tile - (q_start // BLOCK_Q + row)) * BLOCK_Q
    if tok0 >= num_q:  # spare program from the grid's upper bound
        return
    ctx_len = tl.load(ctx_ptr + row).to(tl.int32)
    table_row = table_ptr + row.to(tl.int64) * stride_table

    offs_m = tl.arange(0, BLOCK_M)
    tok = tok0 + offs_m // G  # [BLOCK_M]: row m of the dot is (token m // G, head m % G)
    head = kv_head * G + offs_m % G
    mask_m = (offs_m < BLOCK_Q * G) & (tok < num_q)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = ctx_len - num_q + tok  # absolute position of each query row

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    head_off = kv_head * stride_kh
    first_pos = ctx_len - num_q + tok0
    last_pos = tl.minimum(first_pos + BLOCK_Q - 1, ctx_len - 1)
    # Keys below first_pos + 1 are visible to every query of the tile: no mask at all there.
    full_end = ((first_pos + 1) // BLOCK_N) * BLOCK_N
    if WINDOW > 0:
        lo_pos = q_pos - WINDOW + 1  # [BLOCK_M]: each query row's first visible key (may be negative)
        key_lo = tl.maximum(first_pos - WINDOW + 1, 0)  # the tile's earliest visible key
        # Keys from win_full on are inside every query's window; the tiles before it (from the one holding
        # key_lo) mask by the window, and the diagonal tiles by both the window and the causal mask.
        win_full = tl.minimum(tl.cdiv(tl.maximum(last_pos - WINDOW + 1, 0), BLOCK_N) * BLOCK_N, full_end)
        for start_n in range((key_lo // BLOCK_N) * BLOCK_N, win_full, BLOCK_N):
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, kv_ptr, table_row, start_n, ctx_len, q_pos, key_lo, lo_pos,
                head_off, stride_kv, stride_block, stride_slot, scale_log2, offs_d, mask_d,
                BLOCK_N, BLOCK_SIZE, False, False, True, UPCAST, SOFTCAP)
        for start_n in range(win_full, full_end, BLOCK_N):
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, kv_ptr, table_row, start_n, ctx_len, q_pos, key_lo, lo_pos,
                head_off, stride_kv, stride_block, stride_slot, scale_log2, offs_d, mask_d,
                BLOCK_N, BLOCK_SIZE, False, False, False, UPCAST, SOFTCAP)
        for start_n in range(full_end, last_pos + 1, BLOCK_N):
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, kv_ptr, table_row, start_n, ctx_len, q_pos, key_lo, lo_pos,
                head_off, stride_kv, stride_block, stride_slot, scale_log2, offs_d, mask_d,
                BLOCK_N, BLOCK_SIZE, True, True, True, UPCAST, SOFTCAP)
    else:
        for start_n in range(0, full_end, BLOCK_N):
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, kv_ptr, table_row, start_n, ctx_len, q_pos, 0, q_pos,
                head_off, stride_kv, stride_block, stride_slot, scale_log2, offs_d, mask_d,
                BLOCK_N, BLOCK_SIZE, False, False, False, UPCAST, SOFTCAP)
        for start_n in range(full_end, last_pos + 1, BLOCK_N):
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, kv_ptr, table_row, start_n, ctx_len, q_pos, 0, q_pos,
                head_off, stride_kv, stride_block, stride_slot, scale_log2, offs_d, mask_d,
                BLOCK_N, BLOCK_SIZE, True, True, False, UPCAST, SOFTCAP)

    if SINKS:  # each head's sink logit joins the denominator, in the scores' log2 units, relative to m_i
        l_i += tl.exp2(tl.load(sinks_ptr + head, mask=mask_m, other=0.0) * 1.4426950408889634 - m_i)
    out = acc / l_i[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


@triton.jit
def _split_len(ctx_len, num_splits, BLOCK_N: tl.constexpr):
    """Keys per slice of a row's context cut into `num_splits` (whole KV tiles; at least one tile): each row
    is cut by its own length, not the batch's bound, so a long row of a batch bounded by max_model_len (a
    CUDA graph's) still spreads over every slice, and a short one over a few."""
    return tl.maximum(tl.cdiv(tl.cdiv(ctx_len, BLOCK_N), num_splits), 1) * BLOCK_N


@triton.jit(do_not_specialize=["stride_table"])
def _decode_kernel(
    q_ptr, kv_ptr, cu_q_ptr, ctx_ptr, table_ptr, out_ptr, part_out_ptr, part_lse_ptr, sinks_ptr,
    scale_log2, num_q_heads,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kv, stride_block, stride_slot, stride_kh, stride_table,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr, UPCAST: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + row).to(tl.int32)
    if tl.load(cu_q_ptr + row + 1).to(tl.int32) - q_start != 1:  # prefill rows belong to the prefill kernel
        return
    ctx_len = tl.load(ctx_ptr + row).to(tl.int32)
    if WINDOW > 0:
        key_lo = tl.maximum(ctx_len - WINDOW, 0)  # the query (at ctx_len - 1) sees keys key_lo .. ctx_len - 1
        base = (key_lo // BLOCK_N) * BLOCK_N
    else:
        key_lo = 0
        base = 0
    if SPLIT:
        # The slices cut the window's span [base, ctx_len) (the whole context without a window), so that each
        # holds visible keys: only the first slice's first tile holds keys before the window.
        per_split = _split_len(ctx_len - base, tl.num_programs(2), BLOCK_N)
        lo = base + split * per_split
        if lo >= ctx_len:  # the merge ignores splits past the row's length
            return
        hi = tl.minimum(lo + per_split, ctx_len)
    else:
        lo = base
        hi = ctx_len
    table_row = table_ptr + row.to(tl.int64) * stride_table

    offs_g = tl.arange(0, BLOCK_G)
    head = kv_head * G + offs_g
    mask_g = offs_g < G
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q_row = q_start.to(tl.int64)
    q = tl.load(q_ptr + q_row * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)

    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    head_off = kv_head * stride_kh
    lo_pos = tl.zeros([BLOCK_G], dtype=tl.int32) + key_lo  # [BLOCK_G]: every head's query sits at one position
    if WINDOW > 0:
        if lo < key_lo:  # the window's first tile, which holds keys before it (and may be the row's last tile)
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, kv_ptr, table_row, lo, hi, offs_g, key_lo, lo_pos,
                head_off, stride_kv, stride_block, stride_slot, scale_log2, offs_d, mask_d,
                BLOCK_N, BLOCK_SIZE, True, False, True, UPCAST, SOFTCAP)
            lo = tl.minimum(lo + BLOCK_N, hi)
    # A split boundary is a multiple of BLOCK_N, so only the row's last tile needs a length mask.
    full_end = lo + ((hi - lo) // BLOCK_N) * BLOCK_N
    for start_n in range(lo, full_end, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, kv_ptr, table_row, start_n, ctx_len, offs_g, key_lo, lo_pos,
            head_off, stride_kv, stride_block, stride_slot, scale_log2, offs_d, mask_d,
            BLOCK_N, BLOCK_SIZE, False, False, False, UPCAST, SOFTCAP)
    if full_end < hi:
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, kv_ptr, table_row, full_end, hi, offs_g, key_lo, lo_pos,
            head_off, stride_kv, stride_block, stride_slot, scale_log2, offs_d, mask_d,
            BLOCK_N, BLOCK_SIZE, True, False, False, UPCAST, SOFTCAP)

    if SPLIT:
        # part_out [R, Hq, S, BLOCK_D], part_lse [R, Hq, S]; lse in log2 units.
        num_splits = tl.num_programs(2)
        part = (row * num_q_heads + head).to(tl.int64) * num_splits + split  # [BLOCK_G]
        tl.store(part_out_ptr + part[:, None] * BLOCK_D + offs_d[None, :], acc / l_i[:, None],
                 mask=mask_g[:, None])
        tl.store(part_lse_ptr + part, m_i + tl.log2(l_i), mask=mask_g)
    else:
        if SINKS:  # the merge adds the sinks where the context is split
            l_i += tl.exp2(tl.load(sinks_ptr + head, mask=mask_g, other=0.0) * 1.4426950408889634 - m_i)
        out = acc / l_i[:, None]
        tl.store(out_ptr + q_row * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])


# Slices of a row merged at a time: fixed, so the count of slices (which follows each step's batch) never
# compiles a new variant of the kernel mid-run; more slices take more passes of the loops.
_MERGE_BLOCK_S = 16


@triton.jit(do_not_specialize=["num_splits"])
def _merge_kernel(
    cu_q_ptr, ctx_ptr, out_ptr, part_out_ptr, part_lse_ptr, sinks_ptr,
    num_splits, num_q_heads, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    WINDOW: tl.constexpr, SINKS: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(cu_q_ptr + row)
    if tl.load(cu_q_ptr + row + 1) - q_start != 1:
        return
    ctx_len = tl.load(ctx_ptr + row).to(tl.int32)
    if WINDOW > 0:  # the decode kernel's slices cut the window's span (from its first tile), as here
        span = ctx_len - (tl.maximum(ctx_len - WINDOW, 0) // BLOCK_N) * BLOCK_N
    else:
        span = ctx_len
    used = tl.cdiv(span, _split_len(span, num_splits, BLOCK_N))  # splits that saw keys
    first = (row * num_q_heads + head).to(tl.int64) * num_splits  # this (row, head)'s first slice
    offs_d = tl.arange(0, BLOCK_D)
    # Two passes over the slices' log-sum-exps: their largest, then the weighted sum of their outputs.
    largest = tl.full([BLOCK_S], float("-inf"), dtype=tl.float32)
    for s0 in range(0, used, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        lse = tl.load(part_lse_ptr + first + offs_s, mask=offs_s < used, other=float("-inf"))
        largest = tl.maximum(largest, lse)
    m = tl.max(largest, 0)
    weights = tl.zeros([BLOCK_S], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s0 in range(0, used, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        mask_s = offs_s < used
        lse = tl.load(part_lse_ptr + first + offs_s, mask=mask_s, other=float("-inf"))
        weight = tl.exp2(lse - m)  # [BLOCK_S]; 0 for masked slices
        part_out = tl.load(part_out_ptr + (first + offs_s)[:, None] * BLOCK_D + offs_d[None, :],
                           mask=mask_s[:, None], other=0.0)  # [BLOCK_S, BLOCK_D]
        acc += tl.sum(part_out * weight[:, None], 0)
        weights += weight
    total = tl.sum(weights, 0)
    if SINKS:  # the head's sink logit (log2 units), relative to the largest slice's
        total += tl.exp2(tl.load(sinks_ptr + head) * 1.4426950408889634 - m)
    out = acc / total  # [BLOCK_D]
    tl.store(out_ptr + q_start.to(tl.int64) * stride_ot + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


@dataclass(frozen=True)
class Tiles:
    """Block shapes and launch options of the two attention kernels (tuned per device and head size)."""

    prefill_m: int  # (query token, head) rows per prefill program
    prefill_n: int  # keys per prefill KV tile
    prefill_warps: int
    prefill_stages: int
    decode_n: int  # keys per decode KV tile
    decode_warps: int
    decode_stages: int
    # Launch the prefill query tiles last first: the heaviest of each row (the most keys) start earliest.
    prefill_heavy_first: bool = False

    def __post_init__(self) -> None:
        # tl.dot needs every dimension a power of two of at least 16; warps are a power of two too.
        for name in ("prefill_m", "prefill_n", "decode_n"):
            _check_power_of_two(name, getattr(self, name), 16)
        for name in ("prefill_warps", "decode_warps"):
            _check_power_of_two(name, getattr(self, name), 1)
        for name in ("prefill_stages", "decode_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"Tiles.{name} must be at least 1, got {getattr(self, name)}")


def _check_power_of_two(name: str, value: int, least: int) -> None:
    if value < least or value & (value - 1):
        raise ValueError(f"Tiles.{name} must be a power of two of at least {least}, got {value}")


# Timed on an H100 (benchmarks/kernels.py --sweep, bf16): the one point closest to the fastest on every
# shape of the sweep. head_dim > 128 halves the tiles (not timed); fp32 storage (a debugging path) uses
# exact fp32 FMA dots, which need far more registers than tensor-core bf16/fp16 dots.
GPU_TILES = Tiles(prefill_m=128, prefill_n=32, prefill_warps=4, prefill_stages=3,
                  decode_n=128, decode_warps=2, decode_stages=2)
GPU_TILES_LARGE_D = Tiles(prefill_m=64, prefill_n=32, prefill_warps=4, prefill_stages=2,
                          decode_n=32, decode_warps=4, decode_stages=2)
GPU_TILES_FP32 = Tiles(prefill_m=32, prefill_n=32, prefill_warps=8, prefill_stages=2,
                       decode_n=16, decode_warps=8, decode_stages=2)
# Cards whose own sweep picked other decode tiles (16-bit, head_dim <= 128); any other card takes GPU_TILES.
# On an H200 (hinted calls against SDPA on the same K/V): GPU_TILES' decode 0.89-0.97x, this point 0.93-1.00x.
GPU_TILES_BY_NAME = {"NVIDIA H200": replace(GPU_TILES, decode_n=64, decode_warps=2, decode_stages=3)}
# The interpreter (CPU tests) uses small tiles so that short test sequences still span several
# query tiles and KV tiles, and tiles narrower than a pool block.
INTERPRETER_TILES = Tiles(prefill_m=32, prefill_n=16, prefill_warps=4, prefill_stages=1,
                          decode_n=16, decode_warps=4, decode_stages=1)

# Split-KV heuristic knobs: split only when the decode grid alone would leave SMs idle and the
# contexts are long enough that each split still streams a useful amount of K/V.
SPLIT_MIN_CONTEXT = 1024
SPLIT_MIN_TOKENS = 256
SPLIT_TARGET_WAVES = 4  # aim for ~this many programs per SM across all splits
SPLIT_MAX = 64
_DEFAULT_SMS = 132  # H100 SXM; used off-GPU so the heuristic behaves as it would there


@functools.cache
def _device_properties(device_index: int):  # torch's CUDA device properties, asked for once
    return torch.cuda.get_device_properties(device_index)


def _tiles(device: torch.device, head_dim: int, fp32_dot: bool) -> Tiles:
    if device.type != "cuda":
        return INTERPRETER_TILES
    if fp32_dot:
        return GPU_TILES_FP32
    if head_dim > 128:
        return GPU_TILES_LARGE_D
    return GPU_TILES_BY_NAME.get(_device_properties(device.index or 0).name, GPU_TILES)


def num_kv_splits(num_rows: int, num_kv_heads: int, max_context: int, block_n: int, device: torch.device,
                  split_kv: bool | None = None) -> int:
    """How many slices each decode row's context is cut into (1: no split-KV).

    Decided from host-side sizes only (no device sync): num_rows counts every row of the batch and
    max_context is an upper bound, so mixed batches lean towards not splitting.
    """
    if split_kv is False:
        return 1
    max_tiles = triton.cdiv(max_context, block_n)
    sms = _device_properties(device.index or 0).multi_processor_count if device.type == "cuda" else _DEFAULT_SMS
    base = max(1, num_rows * num_kv_heads)
    if split_kv is None and (base >= sms or max_context < SPLIT_MIN_CONTEXT):
        return 1
    splits = min(triton.cdiv(SPLIT_TARGET_WAVES * sms, base), SPLIT_MAX,
                 max(1, triton.cdiv(max_context, SPLIT_MIN_TOKENS)))
    if split_kv:  # forced (tests): at least two slices whenever there are two tiles
        splits = max(splits, 2)
    return max(1, min(splits, max_tiles))


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    *,
    split_kv: bool | None = None,
    max_query_len: int | None = None,
    max_context_len: int | None = None,
    tiles: Tiles | None = None,
    num_splits: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each row's new queries over its paged context (see reference.paged_attention).

    query [T, Hq, D]; kv_cache [2, N, block_size, Hkv, D]; cu_seqlens_q [R + 1]; context_lens [R];
    block_tables [R, max_blocks] (entries past a row's blocks are never read). Returns [T, Hq, D] in query's dtype.
    split_kv: None picks split-KV for decode rows by a heuristic; True/False forces it.
    max_query_len / max_context_len: optional host-side upper bounds the caller may already know;
    max_query_len == 1 skips the prefill launch (so it must be exact), max_context_len sharpens the
    split choice (default: block_tables.shape[1] * block_size). Nothing is read back from the device.
    tiles / num_splits: for tuning (benchmarks/kernels.py --sweep): block shapes instead of the device's
    defaults, and an exact count of decode slices instead of the heuristic's (capped at one per KV tile).
    window: sliding-window attention (transformers' `sliding_window`): a query at position p sees keys
    max(0, p - window + 1) .. p only; None is full causal attention. The window is a compile-time constant of
    the kernels (one variant per distinct value, which a model fixes per layer: at most two), so full attention
    runs exactly the code it ran without the argument, and a CUDA graph captures each layer's variant as is.
    softcap: Gemma's attention-logit soft cap (scores s -> softcap * tanh(s / softcap) before the mask), a
    compile-time constant as the window is; None compiles the uncapped kernels unchanged.
    sinks: gpt-oss's attention sinks, fp32 [Hq]: each head's logit joins its softmax's denominator where a row's
    output is normalized (its whole context's, or the merge of its slices'); None compiles the kernels unchanged.
    """
    if num_splits is not None and (split_kv is not None or num_splits < 1):
        raise ValueError(f"num_splits={num_splits} must be at least 1, and split_kv={split_kv} left unset with it")
    check_window(window)
    check_softcap(softcap)
    num_tokens, num_q_heads, head_dim = query.shape
    check_sinks(sinks, num_q_heads)
    _, _, block_size, num_kv_heads, kv_head_dim = kv_cache.shape
    num_rows = context_lens.shape[0]
    assert kv_head_dim == head_dim and num_q_heads % num_kv_heads == 0
    assert kv_cache.stride(-1) == 1, "kv_cache must be contiguous in head_dim"
    out = torch.empty_like(query, memory_format=torch.contiguous_format)  # [T, Hq, D]
    if num_tokens == 0 or num_rows == 0:
        return out
    if query.stride(-1) != 1:
        query = query.contiguous()
    group = num_q_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    # 16-bit tensor-core dots with fp32 accumulation when query and cache share a 16-bit dtype; fp32
    # dots when the storage is fp32 or the dtypes differ, and for bf16 in the interpreter (which
    # mishandles bf16 arithmetic; its fp16 is right, so fp16 tests run the GPU's 16-bit path).
    fp32_dot = (query.dtype != kv_cache.dtype or kv_cache.dtype == torch.float32
                or (query.device.type != "cuda" and kv_cache.dtype == torch.bfloat16))
    tiles = tiles or _tiles(query.device, head_dim, fp32_dot)
    common = dict(
        stride_qt=query.stride(0), stride_qh=query.stride(1), stride_ot=out.stride(0), stride_oh=out.stride(1),
        stride_kv=kv_cache.stride(0), stride_block=kv_cache.stride(1), stride_slot=kv_cache.stride(2),
        stride_kh=kv_cache.stride(3), stride_table=block_tables.stride(0),
        G=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_D=block_d, UPCAST=fp32_dot,
        # 0: full attention. A window past any context is clamped so that position arithmetic stays in int32.
        WINDOW=min(window or 0, 1 << 30),
        # 0.0: no soft cap, the code uncapped models always ran; else the cap in the scores' log2 units
        SOFTCAP=0.0 if softcap is None else softcap * _LOG2E,
        SINKS=sinks is not None,
    )
    sinks_arg = query if sinks is None else sinks  # never read without sinks
    scale_log2 = scale * _LOG2E

    # T == R does not rule out prefill rows (a row may have no new tokens), hence T >= 2.
    if num_tokens >= 2 and (max_query_len is None or max_query_len > 1):
        block_m = max(tiles.prefill_m, triton.next_power_of_2(group))
        block_q = block_m // group
        # Upper bound on sum_r ceil(nq_r / block_q) without reading cu_seqlens back.
        grid = (num_tokens // block_q + num_rows, num_kv_heads)
        _prefill_kernel[grid](
            query, kv_cache, cu_seqlens_q, context_lens, block_tables, out, sinks_arg, scale_log2, num_rows,
            BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=tiles.prefill_n, HEAVY_FIRST=tiles.prefill_heavy_first,
            num_warps=tiles.prefill_warps, num_stages=tiles.prefill_stages, **common,
        )

    max_context = max_context_len if max_context_len is not None else block_tables.shape[1] * block_size
    if window is not None:
        # A decode row reads its window's span only: from the KV tile holding its first visible key.
        max_context = min(max_context, window + tiles.decode_n - 1)
    if num_splits is None:
        splits = num_kv_splits(num_rows, num_kv_heads, max_context, tiles.decode_n, query.device, split_kv)
    else:
        splits = min(num_splits, triton.cdiv(max_context, tiles.decode_n))
    # Slices that the longest row (at most max_context) would leave empty are dropped; each row is then cut
    # into that many by its own length (`_split_len`, as the longest row is cut here).
    longest_per_split = triton.cdiv(triton.cdiv(max_context, tiles.decode_n), splits) * tiles.decode_n
    splits = max(1, triton.cdiv(max_context, longest_per_split))
    if splits > 1:
        part_out = torch.empty(num_rows, num_q_heads, splits, block_d, dtype=torch.float32, device=query.device)
        part_lse = torch.empty(num_rows, num_q_heads, splits, dtype=torch.float32, device=query.device)
    else:
        part_out = part_lse = out  # unused
    _decode_kernel[(num_rows, num_kv_heads, splits)](
        query, kv_cache, cu_seqlens_q, context_lens, block_tables, out, part_out, part_lse, sinks_arg,
        scale_log2, num_q_heads,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=tiles.decode_n, SPLIT=splits > 1,
        num_warps=tiles.decode_warps, num_stages=tiles.decode_stages, **common,
    )
    if splits > 1:
        _merge_kernel[(num_rows, num_q_heads)](
            cu_seqlens_q, context_lens, out, part_out, part_lse, sinks_arg,
            splits, num_q_heads, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_S=_MERGE_BLOCK_S, BLOCK_D=block_d,
            BLOCK_N=tiles.decode_n, WINDOW=common["WINDOW"], SINKS=common["SINKS"],
            num_warps=1 if block_d <= 64 else 2,
        )
    return out
