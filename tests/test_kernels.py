"""Triton KV-write and paged-attention kernels against the plain-torch reference.

Off-GPU they run under the Triton interpreter (TRITON_INTERPRET=1, set in conftest.py), so shapes
stay small; the interpreter uses small tiles (attention.INTERPRETER_TILES) so that these short
sequences still cross query-tile, KV-tile and pool-block boundaries. One slow case runs the GPU
tile sizes.
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch
import triton

from pagedserve.kernels import reference as ref
from pagedserve.kernels.gpu import attention
from pagedserve.kernels.gpu.attention import paged_attention
from pagedserve.kernels.gpu.cache import write_kv_cache
from tests.paged_batch import MIXED_ROWS
from tests.paged_batch import make_batch as make_cpu_batch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Output tolerance vs the fp32 reference: output rounding (the interpreter rounds bf16 by
# truncation, so up to one ulp) plus 16-bit storage of the probabilities on the GPU.
ATOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
ULP = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}



def make_batch(*args, **kwargs):
    return tuple(t.to(DEVICE) for t in make_cpu_batch(*args, **kwargs))


def reference_fp32(query, kv, cu, ctx, tables, scale):
    return ref.paged_attention(query.float(), kv.float(), cu, ctx, tables, scale)


def run_triton(query, kv, cu, ctx, tables, scale, **kwargs):
    # Deterministic mode fills fresh tensors with NaN: an output element the kernels never write shows.
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        return paged_attention(query, kv, cu, ctx, tables, scale, **kwargs)
    finally:
        torch.use_deterministic_algorithms(False)


def assert_close(actual, expected, dtype):
    assert actual.dtype == dtype
    assert torch.isfinite(actual).all(), "NaN/inf in the output: a padding entry or unwritten slot was read"
    torch.testing.assert_close(actual.float(), expected.float(), atol=ATOL[dtype], rtol=ATOL[dtype])


# --- write_kv_cache -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (80, 32)])
def test_write_kv_cache_matches_reference(dtype, head_dim, block_size):
    gen = torch.Generator().manual_seed(1)
    num_tokens, num_kv_heads, num_q_heads, num_blocks = 13, 3, 6, 5
    # K and V as strided views into a fused QKV projection, as the model produces them.
    qkv = torch.randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    _, key, value = qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    key = key.view(num_tokens, num_kv_heads, head_dim).to(DEVICE)  # [T, Hkv, D], non-contiguous
    value = value.view(num_tokens, num_kv_heads, head_dim).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 7, 12]] = -1  # skipped tokens
    slots = slots.to(DEVICE)
    sentinel = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), 7.0, dtype=dtype, device=DEVICE)
    expected = sentinel.clone()
    ref.write_kv_cache(key, value, expected, slots)
    cache = sentinel.clone()
    write_kv_cache(key, value, cache, slots)
    assert torch.equal(cache, expected)  # a copy in the same dtype is exact
    written = set(slots[slots >= 0].tolist())
    flat = cache.view(2, -1, num_kv_heads, head_dim)
    untouched = [s for s in range(num_blocks * block_size) if s not in written]
    assert (flat[:, untouched] == 7.0).all()


def test_write_kv_cache_converts_dtype():
    gen = torch.Generator().manual_seed(2)
    key = torch.randn(6, 2, 64, generator=gen).to(DEVICE)  # fp32 into a bf16 pool
    value = torch.randn(6, 2, 64, generator=gen).to(DEVICE)
    slots = torch.tensor([5, -1, 0, 31, 17, 2], device=DEVICE)
    expected = torch.zeros(2, 2, 16, 2, 64, dtype=torch.bfloat16, device=DEVICE)
    cache = expected.clone()
    ref.write_kv_cache(key, value, expected, slots)
    write_kv_cache(key, value, cache, slots)
    # The interpreter rounds fp32 -> bf16 by truncation, torch to nearest: one ulp apart at most.
    torch.testing.assert_close(cache.float(), expected.float(), atol=0, rtol=2 ** -7)


def test_write_kv_cache_empty_step():
    cache = torch.zeros(2, 1, 16, 1, 64, device=DEVICE)
    write_kv_cache(torch.empty(0, 1, 64, device=DEVICE), torch.empty(0, 1, 64, device=DEVICE), cache,
                   torch.empty(0, dtype=torch.long, device=DEVICE))
    assert (cache == 0).all()


# --- paged_attention ----------------------------------------------------------------------------

# (Hq, Hkv, head_dim, block_size, dtype): each GQA ratio 1/2/7, head_dim 64/80, block 16/32 and
# dtype appear several times in different combinations (pairwise rather than the full product).
MIXED_CASES = [
    (4, 4, 64, 16, torch.float32),
    (8, 4, 80, 32, torch.float32),
    (7, 1, 64, 32, torch.float16),
    (14, 2, 80, 16, torch.bfloat16),
    (8, 4, 64, 16, torch.bfloat16),
    (7, 1, 80, 16, torch.float32),
    (4, 4, 80, 32, torch.float16),
    (14, 2, 64, 32, torch.float32),
    (4, 4, 64, 32, torch.bfloat16),
    (8, 4, 80, 16, torch.float16),
    (32, 1, 64, 16, torch.float16),  # a head group wider than the decode kernel's 16-row minimum
]


@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim,block_size,dtype", MIXED_CASES,
                         ids=lambda v: str(v).replace("torch.", ""))
def test_mixed_batch_matches_reference(num_q_heads, num_kv_heads, head_dim, block_size, dtype):
    query, kv, poisoned, cu, ctx, tables = make_batch(MIXED_ROWS, num_q_heads, num_kv_heads, head_dim, block_size,
                                                      dtype)
    scale = head_dim ** -0.5
    expected = reference_fp32(query, kv, cu, ctx, tables, scale)
    no_split = run_triton(query, poisoned, cu, ctx, tables, scale, split_kv=False)
    assert_close(no_split, expected, dtype)
    split = run_triton(query, poisoned, cu, ctx, tables, scale, split_kv=True)
    assert_close(split, expected, dtype)
    # Split-KV only changes the order of fp32 sums: the same up to output rounding.
    torch.testing.assert_close(split.float(), no_split.float(), atol=ULP[dtype], rtol=ULP[dtype])


@pytest.mark.parametrize("seed", range(8))
def test_random_batches(seed):
    """Random row mixes and lengths; configuration drawn from the same axes as above."""
    gen = torch.Generator().manual_seed(100 + seed)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    num_q_heads, num_kv_heads = pick([(4, 4), (8, 4), (7, 1), (14, 2)])
    head_dim, block_size = pick([64, 80, 96]), pick([16, 32])
    dtype = pick([torch.float32, torch.float16, torch.bfloat16])
    rows = []
    for _ in range(int(torch.randint(2, 7, (1,), generator=gen))):
        new = pick([1, 1, int(torch.randint(2, 40, (1,), generator=gen))])
        prefix = pick([0, int(torch.randint(1, 120, (1,), generator=gen))])
        rows.append((new, prefix + new))
    query, kv, poisoned, cu, ctx, tables = make_batch(rows, num_q_heads, num_kv_heads, head_dim, block_size, dtype,
                                                      seed=seed)
    expected = reference_fp32(query, kv, cu, ctx, tables, head_dim ** -0.5)
    for split_kv in (False, True):
        assert_close(run_triton(query, poisoned, cu, ctx, tables, head_dim ** -0.5, split_kv=split_kv), expected,
                     dtype)
    # The prefill query tiles launched last first compute the same.
    heavy_first = replace(attention.INTERPRETER_TILES, prefill_heavy_first=True)
    assert_close(run_triton(query, poisoned, cu, ctx, tables, head_dim ** -0.5, tiles=heavy_first), expected, dtype)


def test_default_call_allocates_output_in_query_dtype():
    query, kv, _, cu, ctx, tables = make_batch(MIXED_ROWS[:4], 8, 2, 64, 16, torch.float16, seed=3)
    out = paged_attention(query, kv, cu, ctx, tables, 0.125)
    assert out.shape == query.shape and out.dtype == torch.float16
    assert_close(out, reference_fp32(query, kv, cu, ctx, tables, 0.125), torch.float16)


def test_decode_only_batch_with_hints():
    rows = [(1, 45), (1, 3), (1, 130), (1, 16)]
    query, kv, poisoned, cu, ctx, tables = make_batch(rows, 8, 2, 64, 16, torch.float32, seed=4)
    expected = reference_fp32(query, kv, cu, ctx, tables, 0.125)
    for split_kv in (None, False, True):
        out = run_triton(query, poisoned, cu, ctx, tables, 0.125, split_kv=split_kv, max_query_len=1,
                         max_context_len=130)
        assert_close(out, expected, torch.float32)
    # Each row is cut into the step's slices by its own length: a bound far above every row (a CUDA graph's,
    # max_model_len) or below the longest still covers each row's keys exactly once.
    for bound in (1 << 15, 40):
        out = run_triton(query, poisoned, cu, ctx, tables, 0.125, split_kv=True, max_query_len=1,
                         max_context_len=bound)
        assert_close(out, expected, torch.float32)


def test_prefill_only_batch_and_rows_without_new_tokens():
    rows = [(5, 40), (0, 17), (33, 33), (2, 2)]  # a row with no new tokens computes nothing
    query, kv, poisoned, cu, ctx, tables = make_batch(rows, 7, 1, 64, 32, torch.float32, seed=5)
    expected = reference_fp32(query, kv, cu, ctx, tables, 0.125)
    assert_close(run_triton(query, poisoned, cu, ctx, tables, 0.125), expected, torch.float32)


def test_empty_batch():
    query = torch.empty(0, 4, 64, device=DEVICE)
    kv = torch.zeros(2, 1, 16, 2, 64, device=DEVICE)
    empty = torch.empty(0, dtype=torch.long, device=DEVICE)
    out = paged_attention(query, kv, torch.zeros(1, dtype=torch.long, device=DEVICE), empty,
                          torch.empty(0, 1, dtype=torch.long, device=DEVICE), 0.125)
    assert out.shape == (0, 4, 64)


def test_split_heuristic():
    cpu = torch.device("cpu")  # off-GPU the heuristic assumes an H100's 132 SMs
    splits = attention.num_kv_splits
    assert splits(8, 8, 32768, 64, cpu) > 1  # few long decodes: split
    assert splits(64, 8, 4096, 64, cpu) == 1  # 512 programs already fill the GPU
    assert splits(4, 2, 512, 64, cpu) == 1  # too short to be worth a merge
    assert splits(8, 8, 32768, 64, cpu, split_kv=False) == 1
    assert splits(64, 8, 4096, 64, cpu, split_kv=True) >= 2
    assert splits(1, 1, 16, 16, cpu, split_kv=True) == 1  # one tile cannot be split
    n = splits(1, 1, 1 << 20, 64, cpu)
    assert 1 < n <= attention.SPLIT_MAX


def test_tile_overrides_and_split_counts_match_reference():
    """Other block shapes and exact split counts, as the tuning sweep (benchmarks/kernels.py --sweep) times
    them, compute the same attention: tiles narrower and wider than a pool block, prefill tiles launched in
    either order, split counts from one to more than the row has tiles."""
    rows = [(1, 150), (20, 70), (1, 33), (5, 5), (1, 1)]
    query, kv, poisoned, cu, ctx, tables = make_batch(rows, 4, 2, 64, 16, torch.float16, seed=11)
    expected = reference_fp32(query, kv, cu, ctx, tables, 0.125)
    for tiles in (attention.Tiles(prefill_m=16, prefill_n=64, prefill_warps=2, prefill_stages=3,
                                  decode_n=64, decode_warps=2, decode_stages=3),
                  attention.Tiles(prefill_m=64, prefill_n=32, prefill_warps=8, prefill_stages=1,
                                  decode_n=32, decode_warps=8, decode_stages=2, prefill_heavy_first=True)):
        for num_splits in (None, 1, 3, 100):
            assert_close(run_triton(query, poisoned, cu, ctx, tables, 0.125, tiles=tiles, num_splits=num_splits),
                         expected, torch.float16)


def test_more_slices_than_the_merge_takes_at_once():
    """A row cut into more slices than the merge kernel reads in one pass (its slice block is fixed, so that
    the step's count of slices never compiles a new variant) is merged over several passes, exactly."""
    rows = [(1, 700), (1, 290), (1, 5)]
    query, kv, poisoned, cu, ctx, tables = make_batch(rows, 4, 2, 64, 16, torch.float32, seed=12)
    expected = reference_fp32(query, kv, cu, ctx, tables, 0.125)
    assert attention._MERGE_BLOCK_S < 40
    for num_splits in (40, 44):  # 22 and 44 slices of the 700-token row: two and three passes
        out = run_triton(query, poisoned, cu, ctx, tables, 0.125, num_splits=num_splits, max_query_len=1)
        assert_close(out, expected, torch.float32)


def test_bad_tiles_and_split_counts_are_named():
    with pytest.raises(ValueError, match="decode_n must be a power of two of at least 16, got 48"):
        replace(attention.GPU_TILES, decode_n=48)
    with pytest.raises(ValueError, match="prefill_m .* got 8"):
        replace(attention.GPU_TILES, prefill_m=8)
    with pytest.raises(ValueError, match="prefill_warps .* got 3"):
        replace(attention.GPU_TILES, prefill_warps=3)
    with pytest.raises(ValueError, match="decode_stages must be at least 1, got 0"):
        replace(attention.GPU_TILES, decode_stages=0)
    query, kv, _, cu, ctx, tables = make_batch([(1, 20)], 4, 2, 64, 16, torch.float16)
    for kwargs in ({"num_splits": 0}, {"num_splits": 2, "split_kv": True}):
        with pytest.raises(ValueError, match="num_splits"):
            paged_attention(query, kv, cu, ctx, tables, 0.125, **kwargs)


def test_tuning_sweep_times_every_point_and_checks_it():
    """The sweep run on the GPU: each point is checked against the reference before it is timed, decode
    shapes then try each split count with their fastest tiles, and the time budget cuts it short."""
    from benchmarks import kernels as bench

    shapes = [bench.DecodeShape(2, 40, 4, 2, 64), bench.PrefillShape(1, 24, 16, 4, 2, 64)]
    decode_points = bench.grid(decode_n=(16, 32), decode_warps=(4,), decode_stages=(1,))
    rows = bench.sweep(shapes[:1], DEVICE, True, decode_points, (1, 2), time.monotonic() + 600)
    assert [(r["point"]["decode_n"], r["splits"]) for r in rows] == [(16, None), (32, None), (rows[2]["point"][
        "decode_n"], 1), (rows[2]["point"]["decode_n"], 2)]
    assert all(r["err"] < bench.MAX_REL_ERR and r["us"] > 0 and r["rate"] > 0 for r in rows)
    assert rows[2]["point"] == min(rows[:2], key=lambda r: r["us"])["point"]
    prefill_points = bench.grid(prefill_m=(32,), prefill_n=(16,), prefill_warps=(4,), prefill_stages=(1,))
    rows += bench.sweep(shapes[1:], DEVICE, True, prefill_points, (1, 2), time.monotonic() + 600)
    assert rows[-1]["splits"] is None and rows[-1]["err"] < bench.MAX_REL_ERR  # no split counts for prefill
    pick = bench.closest_to_fastest(rows[:4])
    assert pick is not None and pick[0] == rows[2]["point"] and pick[1] == 1.0
    late = bench.sweep(shapes, DEVICE, True, decode_points, (1,), time.monotonic() - 1)
    assert [r["failed"] for r in late] == ["skipped: past the time budget"] * 2 * len(decode_points)


@pytest.mark.slow
def test_gpu_tile_sizes_under_interpreter(monkeypatch):
    """The H100 tile configuration (BLOCK_M 128, BLOCK_N 64) on sequences long enough to use it."""
    if DEVICE.type != "cpu":
        pytest.skip("on a GPU the GPU tiles are used by every test")
    monkeypatch.setattr(attention, "INTERPRETER_TILES", attention.GPU_TILES)
    rows = [(1, 300), (70, 200), (1, 65), (130, 130), (1, 129)]
    query, kv, poisoned, cu, ctx, tables = make_batch(rows, 14, 2, 64, 16, torch.bfloat16, seed=6)
    expected = reference_fp32(query, kv, cu, ctx, tables, 0.125)
    for split_kv in (False, True):
        assert_close(run_triton(query, poisoned, cu, ctx, tables, 0.125, split_kv=split_kv), expected,
                     torch.bfloat16)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_larger_mixed_batch(dtype):
    """More rows, longer contexts, GQA 2 and head_dim 128; split-KV left to the heuristic and forced."""
    gen = torch.Generator().manual_seed(7)
    rows = [(1, int(torch.randint(1, 260, (1,), generator=gen))) for _ in range(6)]
    rows += [(11, 150), (40, 40), (25, 90)]
    order = torch.randperm(len(rows), generator=gen).tolist()
    rows = [rows[i] for i in order]
    query, kv, poisoned, cu, ctx, tables = make_batch(rows, 4, 2, 128, 32, dtype, seed=8, spare_blocks=6)
    expected = reference_fp32(query, kv, cu, ctx, tables, 128 ** -0.5)
    for split_kv in (None, True):
        assert_close(run_triton(query, poisoned, cu, ctx, tables, 128 ** -0.5, split_kv=split_kv), expected, dtype)


# --- sliding window -----------------------------------------------------------------------------

# Every row kind: a long decode (split over several KV slices even under a small window), a short decode, a
# one-token decode, a fresh prefill over several query tiles, a chunk after a cached prefix, and a short chunk
# after a long prefix.
WINDOW_ROWS = [(1, 150), (23, 23), (1, 7), (20, 90), (1, 1), (3, 130)]


def windowed_sdpa(query, kv, cu, ctx, tables, scale, window):
    """fp32 SDPA per row over its gathered K/V, masked as transformers' sliding window: q - window < kv <= q."""
    block_size, num_kv_heads = kv.shape[2], kv.shape[3]
    group = query.shape[1] // num_kv_heads
    out = torch.empty(query.shape, dtype=torch.float32)
    for r, c in enumerate(ctx.tolist()):
        start, end = cu[r].item(), cu[r + 1].item()
        if start == end:
            continue
        blocks = tables[r, :triton.cdiv(c, block_size)].cpu()
        # [c, Hq, D] each: the row's keys and values in position order, each KV head repeated for its group.
        k, v = (kv[i, blocks].float().cpu().flatten(0, 1)[:c].repeat_interleave(group, 1) for i in (0, 1))
        pos_q = torch.arange(c - (end - start), c)[:, None]
        pos_k = torch.arange(c)[None, :]
        mask = (pos_k <= pos_q) & (pos_k > pos_q - window)  # [nq, c]
        q = query[start:end].float().cpu()
        out[start:end] = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale).transpose(0, 1)
    return out.to(query.device)


def poison_before_window(poisoned, cu, ctx, tables, window):
    """Each row's keys before all of its queries' windows made NaN, and its table entries for blocks wholly
    before them pointed at a NaN block no row owns: a kernel that reads a key outside the window shows."""
    poisoned, tables = poisoned.clone(), tables.clone()
    block_size = poisoned.shape[2]
    spare = sorted(set(range(poisoned.shape[1])) - set(tables[tables >= 0].tolist()))[0]
    for r, c in enumerate(ctx.tolist()):
        first = max(0, c - (cu[r + 1] - cu[r]).item() - window + 1)  # the row's earliest visible key
        for j in range(first // block_size):
            tables[r, j] = spare
        poisoned[:, tables[r, first // block_size], :first % block_size] = float("nan")
    return poisoned, tables


@pytest.mark.parametrize("window", [1, 5, "block", 40, 1 << 20])
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim,block_size,dtype",
                         [(8, 2, 64, 16, torch.float32), (14, 2, 80, 32, torch.bfloat16)],
                         ids=lambda v: str(v).replace("torch.", ""))
def test_sliding_window_matches_masked_sdpa(window, num_q_heads, num_kv_heads, head_dim, block_size, dtype):
    """Windows of one key, less than a pool block, one block, several blocks and past every context, over every
    row kind, with and without split-KV; keys before each row's window are never read."""
    window = block_size if window == "block" else window
    query, kv, poisoned, cu, ctx, tables = make_batch(WINDOW_ROWS, num_q_heads, num_kv_heads, head_dim, block_size,
                                                      dtype, seed=13)
    scale = head_dim ** -0.5
    expected = windowed_sdpa(query, kv, cu, ctx, tables, scale, window)
    poisoned, tables = poison_before_window(poisoned, cu, ctx, tables, window)
    no_split = run_triton(query, poisoned, cu, ctx, tables, scale, split_kv=False, window=window)
    assert_close(no_split, expected, dtype)
    split = run_triton(query, poisoned, cu, ctx, tables, scale, split_kv=True, window=window)
    assert_close(split, expected, dtype)
    torch.testing.assert_close(split.float(), no_split.float(), atol=ULP[dtype], rtol=ULP[dtype])
    if window > 1000:  # past every context: full causal attention
        full = run_triton(query, kv, cu, ctx, tables, scale, split_kv=True)
        torch.testing.assert_close(split.float(), full.float(), atol=ULP[dtype], rtol=ULP[dtype])


def test_sliding_window_decode_with_graph_hints_and_split_counts():
    """Decode rows as a CUDA graph launches them (max_* hints, a context bound far above every row) and exact
    split counts, including more slices than the window's span has KV tiles: empty slices add nothing."""
    rows = [(1, 300), (1, 45), (1, 3), (1, 129)]
    query, kv, poisoned, cu, ctx, tables = make_batch(rows, 8, 2, 64, 16, torch.float32, seed=14)
    window = 50
    expected = windowed_sdpa(query, kv, cu, ctx, tables, 0.125, window)
    poisoned, tables = poison_before_window(poisoned, cu, ctx, tables, window)
    for kwargs in ({"split_kv": True, "max_context_len": 1 << 15}, {"split_kv": None, "max_context_len": 40},
                   {"num_splits": 2}, {"num_splits": 100}):
        out = run_triton(query, poisoned, cu, ctx, tables, 0.125, max_query_len=1, window=window, **kwargs)
        assert_close(out, expected, torch.float32)


def test_sliding_window_prefill_tiles_launched_heavy_first_and_bad_window():
    rows = [(40, 40), (17, 60), (2, 2)]
    query, kv, poisoned, cu, ctx, tables = make_batch(rows, 4, 1, 64, 16, torch.float16, seed=15)
    window = 24
    expected = windowed_sdpa(query, kv, cu, ctx, tables, 0.125, window)
    poisoned, tables = poison_before_window(poisoned, cu, ctx, tables, window)
    tiles = replace(attention.INTERPRETER_TILES, prefill_heavy_first=True, prefill_n=32)
    assert_close(run_triton(query, poisoned, cu, ctx, tables, 0.125, tiles=tiles, window=window), expected,
                 torch.float16)
    with pytest.raises(ValueError, match="window=0 must be at least 1"):
        paged_attention(query, kv, cu, ctx, tables, 0.125, window=0)


# --- attention sinks (gpt-oss's), and below the soft cap (Gemma 2's) -----------------------------------------------


def test_the_references_sinks_are_transformers_eager_attention():
    """The oracle itself: the reference's attention with sinks equals transformers' gpt-oss eager attention (the
    sink logit a column beside the scaled scores, dropped after the softmax), with and without a window."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    query, kv, _, cu, ctx, tables = make_cpu_batch([(30, 30)], 4, 2, 16, 16, torch.float32, seed=18)
    k, v = ref.gather_kv(kv, tables[0], 30)  # [30, Hkv, D] each
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = 2, False
    module.sinks = torch.tensor([-3.0, 0.0, 1.5, 4.0])
    for window in (None, 7):
        keys, positions = torch.arange(30)[None, :], torch.arange(30)[:, None]
        allowed = (keys <= positions) & ((keys > positions - window) if window else True)
        mask = torch.zeros(30, 30).masked_fill(~allowed, float("-inf"))[None, None]  # transformers' additive mask
        expected, _ = eager_attention_forward(module, query.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                              v.transpose(0, 1)[None], mask, scaling=0.3)
        out = ref.paged_attention(query, kv, cu, ctx, tables, 0.3, window=window, sinks=module.sinks)
        torch.testing.assert_close(out, expected[0], atol=1e-6, rtol=1e-6)


# --- attention-logit soft cap (Gemma 2's) -------------------------------------------------------------------


def test_the_references_soft_cap_is_transformers_eager_attention():
    """The oracle itself: the reference's capped attention equals transformers' Gemma 2 eager attention (scores
    scaled, capped, masked, softmax in fp32), for a fresh prompt with and without a window."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    query, kv, _, cu, ctx, tables = make_cpu_batch([(30, 30)], 4, 2, 16, 16, torch.float32, seed=16)
    k, v = ref.gather_kv(kv, tables[0], 30)  # [30, Hkv, D] each
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = 2, False
    for window in (None, 7):
        keys, positions = torch.arange(30)[None, :], torch.arange(30)[:, None]
        allowed = (keys <= positions) & ((keys > positions - window) if window else True)
        mask = torch.zeros(30, 30).masked_fill(~allowed, float("-inf"))[None, None]  # transformers' additive mask
        expected, _ = eager_attention_forward(module, query.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                              v.transpose(0, 1)[None], mask, scaling=0.3, softcap=2.0)
        out = ref.paged_attention(query, kv, cu, ctx, tables, 0.3, window=window, softcap=2.0)
        torch.testing.assert_close(out, expected[0], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("scores", ["softcap", "sinks"])
@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim,block_size,dtype",
                         [(8, 2, 64, 16, torch.float32), (14, 2, 80, 32, torch.float16)],
                         ids=lambda v: str(v).replace("torch.", ""))
def test_capped_scores_and_sinks_match_the_reference(scores, window, num_q_heads, num_kv_heads, head_dim, block_size,
                                                     dtype):
    """Every row kind, with and without split-KV (whose merge adds a sink once) and a window (keys before it
    poisoned): a soft cap that bites (Gemma 2's), or attention sinks above and below the scores (gpt-oss's)."""
    query, kv, poisoned, cu, ctx, tables = make_batch(WINDOW_ROWS, num_q_heads, num_kv_heads, head_dim, block_size,
                                                      dtype, seed=17)
    option = {"softcap": 1.5} if scores == "softcap" else {"sinks": torch.linspace(-4.0, 6.0, num_q_heads)}
    expected = ref.paged_attention(query.float().cpu(), kv.float().cpu(), cu.cpu(), ctx.cpu(), tables.cpu(), 0.25,
                                   window=window, **option).to(DEVICE)
    option = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in option.items()}
    if window is not None:
        poisoned, tables = poison_before_window(poisoned, cu, ctx, tables, window)
    for split_kv in (False, True):
        out = run_triton(query, poisoned, cu, ctx, tables, 0.25, split_kv=split_kv, window=window, **option)
        assert_close(out, expected, dtype)
    plain = run_triton(query, poisoned, cu, ctx, tables, 0.25, window=window)
    assert not torch.allclose(out.float(), plain.float(), atol=1e-2), f"the {scores} changed nothing"
