"""The CPU backend's native attention kernel against the plain-torch reference, on pools poisoned with NaN
outside each row's blocks and past each row's length (a read there shows up as NaN)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import reference as ref
from pagedserve.kernels.backend import get_attention_backend
from pagedserve.kernels.cpu import ops as cpu
from tests.paged_batch import MIXED_ROWS, make_batch

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C compiler: the native CPU kernel cannot be built")

ATOL = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def check(rows, num_q_heads, num_kv_heads, head_dim, block_size, dtype, seed=0, **hints):
    query, kv, poisoned, cu, ctx, tables = make_batch(rows, num_q_heads, num_kv_heads, head_dim, block_size, dtype,
                                                      seed=seed)
    scale = head_dim ** -0.5
    expected = ref.paged_attention(query.float(), kv.float(), cu, ctx, tables, scale)
    out = cpu.paged_attention(query, poisoned, cu, ctx, tables, scale, **hints)
    assert out.dtype == dtype and out.shape == query.shape
    assert torch.isfinite(out).all(), "NaN in the output: a padding entry or an unwritten slot was read"
    torch.testing.assert_close(out.float(), expected, atol=ATOL[dtype], rtol=ATOL[dtype])


# (Hq, Hkv, head_dim, block_size): GQA ratios 1/3/7/32, head dims 64/80/128, blocks 1/16/32.
SHAPES = [(9, 3, 64, 16), (8, 4, 80, 32), (7, 1, 128, 16), (32, 1, 64, 16), (4, 4, 64, 1), (14, 2, 64, 32)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_mixed_batch_matches_reference(shape, dtype):
    check(MIXED_ROWS, *shape, dtype)


@pytest.mark.parametrize("seed", range(6))
def test_decode_only_batches(seed):
    gen = torch.Generator().manual_seed(seed)
    rows = [(1, int(torch.randint(1, 300, (1,), generator=gen))) for _ in range(int(torch.randint(1, 20, (1,))))]
    check(rows, 9, 3, 64, 16, torch.float32, seed=seed, max_query_len=1)
    check(rows, 9, 3, 64, 16, torch.float32, seed=seed)  # without the hint: found from cu_seqlens_q


@pytest.mark.parametrize("threads", [2, 4])
@pytest.mark.parametrize("rows", [[(1, 1100)], [(1, 700), (1, 20)], [(1, 5)], [(1, 33), (1, 1)]],
                         ids=["one-long", "long-and-short", "shorter-than-its-slices", "two-short"])
def test_few_rows_cut_each_context_into_slices(rows, threads):
    """Fewer work items than twice the threads: each head's context is cut into slices of whole blocks and
    merged; slices past a short row's end are empty."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check(rows, 9, 3, 64, 16, torch.float32, max_query_len=1)
        check(rows, 8, 1, 128, 16, torch.float32, max_query_len=1)
        check(rows, 8, 2, 64, 16, torch.bfloat16, max_query_len=1)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_a_row_gets_the_same_bits_in_any_batch(threads):
    """A row's output does not depend on the other rows of the step, nor on how the work was spread over the
    threads (its slices as items of their own, or one after another): a sequence decodes to the same tokens
    whatever else shares its steps."""
    rows = [(1, 1100), (1, 20), (1, 300), (1, 513), (1, 512), (1, 700), (1, 1)] * 2  # 1-3 slices of 512
    query, _, kv, cu, ctx, tables = make_batch(rows, 9, 3, 64, 16, torch.float32)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = cpu.paged_attention(query, kv, cu, ctx, tables, 0.125, max_query_len=1)
        for i in range(len(rows)):
            alone = cpu.paged_attention(query[i:i + 1], kv, torch.tensor([0, 1]), ctx[i:i + 1], tables[i:i + 1],
                                        0.125, max_query_len=1)
            assert torch.equal(alone, together[i:i + 1]), rows[i]
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("row", [(40, 40), (700, 1100), (30, 530)], ids=["fresh", "long-chunk", "across-a-slice"])
def test_a_prefill_token_gets_the_bits_of_a_decode_row(row, threads):
    """Each new token of a prefill (or a chunk of one) gets the bits a decode row whose context ends at it
    gets, and so do the same tokens cut into other chunks: a sequence's K/V and outputs do not depend on how
    its tokens were scheduled (in one prefill, in chunks, recomputed after a preemption)."""
    num_q, ctx_len = row
    query, _, kv, cu, ctx, tables = make_batch([row], 9, 3, 64, 16, torch.float32)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        prefill = cpu.paged_attention(query, kv, cu, ctx, tables, 0.125)
        start = ctx_len - num_q
        for i in range(num_q):
            decode = cpu.paged_attention(query[i:i + 1], kv, torch.tensor([0, 1]), torch.tensor([start + i + 1]),
                                         tables, 0.125, max_query_len=1)
            assert torch.equal(decode, prefill[i:i + 1]), i
        cut = num_q // 3  # the same tokens as two chunks, in one batch of two rows
        chunks = cpu.paged_attention(query, kv, torch.tensor([0, cut, num_q]), torch.tensor([start + cut, ctx_len]),
                                     tables.expand(2, -1), 0.125)
        assert torch.equal(chunks, prefill)
    finally:
        torch.set_num_threads(before)


def test_more_new_tokens_than_context_is_an_error():
    query, kv, _, _, _, tables = make_batch([(4, 20)], 4, 2, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="more new tokens"):
        cpu.paged_attention(query, kv, torch.tensor([0, 4]), torch.tensor([3]), tables, 0.125)


def test_rows_without_new_tokens_and_a_single_decode_row():
    check([(0, 17), (1, 33), (5, 40)], 8, 2, 64, 16, torch.float32)


def test_block_outside_the_pool_is_an_error_not_a_read():
    query, kv, _, cu, ctx, tables = make_batch([(1, 20), (1, 5)], 4, 2, 64, 16, torch.float32)
    tables[0, 1] = kv.shape[1] + 1000
    with pytest.raises(ValueError, match="outside the KV pool"):
        cpu.paged_attention(query, kv, cu, ctx, tables, 0.125, max_query_len=1)


def windowed_sdpa(query, kv, cu, ctx, tables, scale, window):
    """The oracle for a sliding window, in plain torch: each row's K/V gathered, one SDPA with key kv visible to
    the query at position q iff q - window < kv <= q (transformers' sliding_window mask)."""
    out = torch.empty(query.shape)  # [T, Hq, D] fp32
    for r in range(ctx.shape[0]):
        first, last, length = int(cu[r]), int(cu[r + 1]), int(ctx[r])
        if first == last:
            continue
        k, v = ref.gather_kv(kv.float(), tables[r], length)  # [L, Hkv, D] each
        pos = torch.arange(length - (last - first), length)[:, None]  # [nq, 1]
        keys = torch.arange(length)[None, :]  # [1, L]
        mask = (keys <= pos) & (keys > pos - window)  # [nq, L]
        o = torch.nn.functional.scaled_dot_product_attention(
            query[first:last].float().transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            attn_mask=mask[None, None], scale=scale, enable_gqa=True)  # [1, Hq, nq, D]
        out[first:last] = o[0].transpose(0, 1)
    return out


def hide_before_windows(poisoned, cu, ctx, tables, window):
    """NaN in every slot before the window of each row's first new token (the earliest its tokens see), and the
    block tables' entries for the blocks wholly before it pointed outside the pool: a kernel that reads a key
    there shows NaN in the output, one that visits such a block fails. Returns those tables."""
    num_blocks, block_size = poisoned.shape[1], poisoned.shape[2]
    hidden = tables.clone()
    for r in range(ctx.shape[0]):
        first_pos = int(ctx[r]) - int(cu[r + 1] - cu[r])
        start = max(0, first_pos - window + 1)
        for position in range(start):
            poisoned[:, tables[r, position // block_size], position % block_size] = float("nan")
        hidden[r, :start // block_size] = num_blocks + 1000
    return hidden


# Rows of every kind, the long ones cut into several slices of 512 tokens by the kernel.
WINDOW_ROWS = [*MIXED_ROWS, (1, 1100), (24, 1100), (5, 530), (0, 40)]
# 1; smaller than a block; a block; several blocks; across a slice's boundary; longer than every context.
WINDOWS = [1, 7, 16, 40, 600, 5000]


def check_window(rows, window, num_q_heads, num_kv_heads, head_dim, block_size, dtype, seed=0):
    query, kv, poisoned, cu, ctx, tables = make_batch(rows, num_q_heads, num_kv_heads, head_dim, block_size, dtype,
                                                      seed=seed)
    hidden = hide_before_windows(poisoned, cu, ctx, tables, window)
    scale = head_dim ** -0.5
    expected = windowed_sdpa(query, kv, cu, ctx, tables, scale, window)
    out = cpu.paged_attention(query, poisoned, cu, ctx, hidden, scale, window=window)
    assert out.dtype == dtype and out.shape == query.shape
    assert torch.isfinite(out).all(), "NaN in the output: a key outside a token's window was read"
    torch.testing.assert_close(out.float(), expected, atol=ATOL[dtype], rtol=ATOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("window", WINDOWS)
def test_sliding_window_matches_masked_attention(window, dtype):
    """Decode rows, prefills with and without a cached prefix, long contexts cut into slices; GQA."""
    check_window(WINDOW_ROWS, window, 9, 3, 64, 16, dtype)


@pytest.mark.parametrize("window", [1, 7, 40, 600])
@pytest.mark.parametrize("shape", [(8, 4, 80, 32), (7, 1, 128, 16), (4, 4, 64, 1)], ids=str)
def test_sliding_window_in_other_shapes(shape, window):
    check_window(WINDOW_ROWS, window, *shape, torch.float32)


@pytest.mark.parametrize("threads", [2, 4])
@pytest.mark.parametrize("rows", [[(1, 1100)], [(1, 1100), (3, 700)], [(1, 5)]],
                         ids=["one-long", "long-and-chunk", "short"])
def test_sliding_window_with_few_rows_in_slices(rows, threads):
    """Few work items: each slice of a head is an item of its own, only those the window reaches."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for window in (3, 40, 600):
            check_window(rows, window, 9, 3, 64, 16, torch.float32)
            check_window(rows, window, 8, 2, 64, 16, torch.bfloat16)
    finally:
        torch.set_num_threads(before)


def test_a_window_past_every_context_gets_the_bits_of_full_attention():
    query, _, kv, cu, ctx, tables = make_batch(WINDOW_ROWS, 9, 3, 64, 16, torch.float32)
    full = cpu.paged_attention(query, kv, cu, ctx, tables, 0.125)
    assert torch.equal(cpu.paged_attention(query, kv, cu, ctx, tables, 0.125, window=1100), full)


def test_a_window_under_one_is_an_error():
    query, kv, _, cu, ctx, tables = make_batch([(1, 20)], 4, 2, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="window"):
        cpu.paged_attention(query, kv, cu, ctx, tables, 0.125, window=0)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("window", [7, 40, 600])
def test_with_a_window_a_row_gets_the_same_bits_in_any_batch(window, threads):
    rows = [(1, 1100), (1, 20), (1, 513), (1, 700), (1, 1), (1, 600), (1, 1111)] * 2
    query, _, kv, cu, ctx, tables = make_batch(rows, 9, 3, 64, 16, torch.float32)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = cpu.paged_attention(query, kv, cu, ctx, tables, 0.125, max_query_len=1, window=window)
        for i in range(len(rows)):
            alone = cpu.paged_attention(query[i:i + 1], kv, torch.tensor([0, 1]), ctx[i:i + 1], tables[i:i + 1],
                                        0.125, max_query_len=1, window=window)
            assert torch.equal(alone, together[i:i + 1]), rows[i]
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("row", "window"), [((40, 40), 7), ((30, 530), 40), ((200, 1100), 600), ((64, 1100), 16)],
                         ids=["fresh", "across-a-slice", "window-across-slices", "window-of-a-block"])
def test_with_a_window_a_prefill_token_gets_the_bits_of_a_decode_row(row, window, threads):
    """With a window, a token's bits follow from its own position and window: the same in a prefill, a decode
    row, and chunks of any size (tiles then start at other tokens)."""
    num_q, ctx_len = row
    query, _, kv, cu, ctx, tables = make_batch([row], 9, 3, 64, 16, torch.float32)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        prefill = cpu.paged_attention(query, kv, cu, ctx, tables, 0.125, window=window)
        start = ctx_len - num_q
        for i in range(num_q):
            decode = cpu.paged_attention(query[i:i + 1], kv, torch.tensor([0, 1]), torch.tensor([start + i + 1]),
                                         tables, 0.125, max_query_len=1, window=window)
            assert torch.equal(decode, prefill[i:i + 1]), i
        for size in (num_q // 3, 7):  # the same tokens as chunks, each a row of one batch
            cuts = [*range(0, num_q, size), num_q]
            chunks = cpu.paged_attention(query, kv, torch.tensor(cuts), torch.tensor([start + c for c in cuts[1:]]),
                                         tables.expand(len(cuts) - 1, -1), 0.125, window=window)
            assert torch.equal(chunks, prefill), size
    finally:
        torch.set_num_threads(before)


def test_auto_backend_on_cpu_is_the_native_one():
    backend = get_attention_backend("auto", torch.device("cpu"))
    assert backend.paged_attention is cpu.paged_attention and backend.write_kv_cache is cpu.write_kv_cache
    assert backend.rms_norm is cpu.rms_norm and backend.rotate_qk is cpu.rotate_qk
    assert backend.silu_mul is cpu.silu_mul and backend.rms_norm_heads is cpu.rms_norm_heads
    assert get_attention_backend("reference", torch.device("cpu")).paged_attention is ref.paged_attention
    with pytest.raises(ValueError, match="attention_backend='cpu'"):
        get_attention_backend("cpu", torch.device("meta"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)  # native, and the reference's
def test_kv_write_matches_reference(dtype):
    """K and V as views of one projection's output (strided rows), padding slots (-1) skipped."""
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(5, (4 + 2 * 2) * 64, generator=gen).to(dtype)  # [T, (Hq + 2 Hkv) D]
    _, k, v = qkv.split([4 * 64, 2 * 64, 2 * 64], dim=-1)
    k, v = k.view(5, 2, 64), v.view(5, 2, 64)
    slots = torch.tensor([17, -1, 3, 40, -1])
    pool = torch.full((2, 4, 16, 2, 64), float("nan"), dtype=dtype)  # [2, N, B, Hkv, D]
    expected = pool.clone()
    ref.write_kv_cache(k, v, expected, slots)
    cpu.write_kv_cache(k, v, pool, slots)
    assert torch.equal(pool.nan_to_num(7.0), expected.nan_to_num(7.0))


def test_kv_write_past_the_pool_is_an_error_and_writes_nothing():
    k = v = torch.ones(2, 2, 64)
    pool = torch.zeros(2, 4, 16, 2, 64)
    with pytest.raises(IndexError, match="past the KV pool"):
        cpu.write_kv_cache(k, v, pool, torch.tensor([5, 64]))
    assert not pool.any()


def test_without_a_compiler_auto_falls_back_to_the_reference(monkeypatch):
    from pagedserve.kernels.cpu import native

    monkeypatch.setenv("CC", "no-such-compiler")
    native.paged_attention_library.cache_clear()
    try:
        assert not cpu.available()
        assert get_attention_backend("auto", torch.device("cpu")).paged_attention is ref.paged_attention
        with pytest.raises(ValueError, match="needs a C compiler"):
            get_attention_backend("cpu", torch.device("cpu"))
    finally:
        monkeypatch.undo()
        native.paged_attention_library.cache_clear()
    assert cpu.available()


# --- attention-logit soft cap (Gemma 2's) ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window", [None, 7, 40, 600])
@pytest.mark.parametrize("softcap", [0.5, 3.0])
def test_soft_capped_scores_match_the_reference(softcap, window, dtype):
    """Every row kind, long contexts cut into slices, GQA; caps that bite (scores here reach about +-4) and one
    that all but flattens them; with and without a window (keys before it poisoned)."""
    query, kv, poisoned, cu, ctx, tables = make_batch(WINDOW_ROWS, 9, 3, 64, 16, dtype)
    hidden = tables if window is None else hide_before_windows(poisoned, cu, ctx, tables, window)
    expected = ref.paged_attention(query.float(), kv.float(), cu, ctx, tables, 0.125, window=window, softcap=softcap)
    out = cpu.paged_attention(query, poisoned, cu, ctx, hidden, 0.125, window=window, softcap=softcap)
    assert torch.isfinite(out).all()
    # A tight cap flattens the softmax: each output averages ~1000 values, whose fp32 sums differ by order
    tol = max(ATOL[dtype], 2e-5)
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
    uncapped = cpu.paged_attention(query, poisoned, cu, ctx, hidden, 0.125, window=window)
    assert not torch.allclose(out, uncapped, atol=1e-3), "the cap changed nothing: it was not applied"


@pytest.mark.parametrize("window", [None, 40])
def test_with_a_soft_cap_a_prefill_token_gets_the_bits_of_a_decode_row(window):
    num_q, ctx_len = 200, 1100
    query, _, kv, cu, ctx, tables = make_batch([(num_q, ctx_len)], 9, 3, 64, 16, torch.float32)
    prefill = cpu.paged_attention(query, kv, cu, ctx, tables, 0.125, window=window, softcap=2.0)
    start = ctx_len - num_q
    for i in range(0, num_q, 13):
        decode = cpu.paged_attention(query[i:i + 1], kv, torch.tensor([0, 1]), torch.tensor([start + i + 1]),
                                     tables, 0.125, max_query_len=1, window=window, softcap=2.0)
        assert torch.equal(decode, prefill[i:i + 1]), i


def test_a_soft_cap_under_zero_is_an_error():
    query, kv, _, cu, ctx, tables = make_batch([(1, 20)], 4, 2, 64, 16, torch.float32)
    for backend in (cpu, ref):
        with pytest.raises(ValueError, match="softcap=-1.0 must be positive"):
            backend.paged_attention(query, kv, cu, ctx, tables, 0.125, softcap=-1.0)


# --- attention sinks (gpt-oss's) --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window", [None, 7, 600])
def test_attention_sinks_match_the_reference(window, dtype):
    """Every row kind, long contexts cut into slices (the sink joins the merge of a token's slices once), GQA;
    sinks both above and below the scores, so that some heads give the keys little of their weight."""
    query, kv, poisoned, cu, ctx, tables = make_batch(WINDOW_ROWS, 9, 3, 64, 16, dtype)
    hidden = tables if window is None else hide_before_windows(poisoned, cu, ctx, tables, window)
    sinks = torch.linspace(-4.0, 6.0, 9)
    expected = ref.paged_attention(query.float(), kv.float(), cu, ctx, tables, 0.125, window=window, sinks=sinks)
    out = cpu.paged_attention(query, poisoned, cu, ctx, hidden, 0.125, window=window, sinks=sinks)
    torch.testing.assert_close(out.float(), expected, atol=max(ATOL[dtype], 2e-5), rtol=max(ATOL[dtype], 2e-5))
    without = cpu.paged_attention(query, poisoned, cu, ctx, hidden, 0.125, window=window)
    assert not torch.allclose(out, without, atol=1e-3), "the sinks changed nothing: they were not applied"


def test_with_sinks_a_prefill_token_gets_the_bits_of_a_decode_row():
    num_q, ctx_len = 200, 1100
    query, _, kv, cu, ctx, tables = make_batch([(num_q, ctx_len)], 9, 3, 64, 16, torch.float32)
    sinks = torch.linspace(-2.0, 3.0, 9)
    prefill = cpu.paged_attention(query, kv, cu, ctx, tables, 0.125, sinks=sinks)
    start = ctx_len - num_q
    for i in range(0, num_q, 13):
        decode = cpu.paged_attention(query[i:i + 1], kv, torch.tensor([0, 1]), torch.tensor([start + i + 1]),
                                     tables, 0.125, max_query_len=1, sinks=sinks)
        assert torch.equal(decode, prefill[i:i + 1]), i


def test_sinks_not_one_fp32_logit_per_query_head_are_an_error():
    query, kv, _, cu, ctx, tables = make_batch([(1, 20)], 4, 2, 64, 16, torch.float32)
    for backend in (cpu, ref):
        for sinks in (torch.zeros(2), torch.zeros(4, dtype=torch.bfloat16)):
            with pytest.raises(ValueError, match=r"sinks must be fp32 \[4\]"):
                backend.paged_attention(query, kv, cu, ctx, tables, 0.125, sinks=sinks)
