/* Paged attention on the CPU: every query token of every row attends to its context (the row's cached tokens
 * and its new ones up to itself), read in place through the block table (no gather into a contiguous copy).
 * In a sliding-window layer a token at position p sees positions max(0, p - window + 1) .. p only; the blocks
 * before its window are not read at all, so a long context costs what its window holds.
 *
 * A prefill token is computed exactly as a decode row whose context ends at that token: the same code, the
 * same slices, the same merge. So a token's output does not depend on how it was scheduled (alone, in a
 * batch, in a prefill chunk of any size, recomputed after a preemption): a sequence gets the same bits
 * whatever else shares its steps. With a window the same holds: a token's slices and blocks follow from its own
 * position and window alone. A soft cap (Gemma's attn_logit_softcapping: each scaled score s becomes
 * cap * tanh(s / cap) before the softmax) is applied to each score where it is computed, in the one copy of
 * attend_block every token goes through, so it changes no path's bits but its own.
 *
 * A work item is a tile of up to 16 consecutive new tokens of one row (a decode row is a tile of one), or a
 * tile's single KV head when tiles are few. Each block's K and V are read once for the tile's tokens and
 * every query head of their GQA group, and each token goes through them as it would alone. Online softmax
 * block by block; math in fp32 whatever the pool's dtype. The next block's K/V lines are prefetched while
 * the current one is computed: blocks sit anywhere in the pool, so the hardware prefetcher cannot guess
 * them.
 *
 * SIMD through GCC/Clang vector extensions (any target: -march=native picks the width's instructions).
 * q.k for eight tokens at a time keeps eight independent FMA chains in flight; the p.v sum keeps a 64-wide
 * slice of the output in registers. Built with -O3 -ffast-math -fopenmp: expf vectorizes through glibc's
 * libmvec, and the loop over work items runs on the OpenMP runtime torch already loaded (the same
 * libgomp.so.1), on as many threads as torch uses.
 */
#include <float.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <omp.h>

enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2 };

/* Bounds on the per-thread scratch (on the stack): query heads per KV head x head_dim, and x block_size. */
#define MAX_GROUP_DIM 8192
#define MAX_GROUP 256
#define MAX_BLOCK_DIM 16384 /* block_size x head_dim: one block of converted (bf16/fp16) K or V */
/* A tile's scaled queries: tokens x the query heads of a work item (at least one token). */
#define MAX_TILE_DIM 16384
#define TILE_TOKENS 16

#define LANES 8
typedef float vf __attribute__((vector_size(LANES * sizeof(float))));

static inline vf loadv(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void storev(float *p, vf v) { memcpy(p, &v, sizeof v); }
static inline float hsum(vf v) {
    float s = 0.0f;
    for (int i = 0; i < LANES; i++) s += v[i];
    return s;
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        u = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        u = sign;
    } else {  /* subnormal: normalise */
        exp = 113;
        while (!(man & 0x400)) { man <<= 1; exp--; }
        u = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* n token vectors of D values, `stride` elements apart from element `index` of the pool: the pool itself
 * when it is fp32 (*out_stride = stride), else converted into `scratch` (*out_stride = D). */
static inline const float *tokens_f32(const void *pool, int dtype, int64_t index, int64_t stride, int64_t n,
                                      int64_t D, float *scratch, int64_t *out_stride) {
    if (dtype == KV_F32) {
        *out_stride = stride;
        return (const float *)pool + index;
    }
    for (int64_t t = 0; t < n; t++) {
        const uint16_t *src = (const uint16_t *)pool + index + t * stride;
        float *dst = scratch + t * D;
        if (dtype == KV_BF16) {
            #pragma omp simd
            for (int64_t d = 0; d < D; d++) dst[d] = bf16_to_f32(src[d]);
        } else {
            for (int64_t d = 0; d < D; d++) dst[d] = f16_to_f32(src[d]);
        }
    }
    *out_stride = D;
    return scratch;
}

static inline void prefetch_tokens(const void *pool, int64_t elem_size, int64_t index, int64_t stride, int64_t n,
                                   int64_t D) {
    const char *p = (const char *)pool + index * elem_size;
    for (int64_t t = 0; t < n; t++)
        for (int64_t off = 0; off < D * elem_size; off += 64) __builtin_prefetch(p + t * stride * elem_size + off);
}

/* s[t] = q . k_t for t < n. */
static inline void dot_tokens(const float *q, const float *k, int64_t kstride, int64_t n, int64_t D, float *s) {
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
        const float *k0 = k + t * kstride;
        vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
        for (int64_t d = 0; d < D; d += LANES) {
            const vf qv = loadv(q + d);
            a0 += qv * loadv(k0 + d);
            a1 += qv * loadv(k0 + kstride + d);
            a2 += qv * loadv(k0 + 2 * kstride + d);
            a3 += qv * loadv(k0 + 3 * kstride + d);
            a4 += qv * loadv(k0 + 4 * kstride + d);
            a5 += qv * loadv(k0 + 5 * kstride + d);
            a6 += qv * loadv(k0 + 6 * kstride + d);
            a7 += qv * loadv(k0 + 7 * kstride + d);
        }
        s[t] = hsum(a0); s[t + 1] = hsum(a1); s[t + 2] = hsum(a2); s[t + 3] = hsum(a3);
        s[t + 4] = hsum(a4); s[t + 5] = hsum(a5); s[t + 6] = hsum(a6); s[t + 7] = hsum(a7);
    }
    for (; t < n; t++) {
        vf a = {0};
        for (int64_t d = 0; d < D; d += LANES) a += loadv(q + d) * loadv(k + t * kstride + d);
        s[t] = hsum(a);
    }
}

/* acc[0:D] += sum_t p[t] * v_t, 64 columns at a time held in registers. */
static inline void accumulate_tokens(float *acc, const float *p, const float *v, int64_t vstride, int64_t n,
                                     int64_t D) {
    int64_t c = 0;
    for (; c + 8 * LANES <= D; c += 8 * LANES) {
        vf a[8];
        for (int i = 0; i < 8; i++) a[i] = loadv(acc + c + i * LANES);
        for (int64_t t = 0; t < n; t++) {
            const float *vt = v + t * vstride + c;
            const float pt = p[t];
            for (int i = 0; i < 8; i++) a[i] += pt * loadv(vt + i * LANES);
        }
        for (int i = 0; i < 8; i++) storev(acc + c + i * LANES, a[i]);
    }
    for (; c < D; c += LANES) {
        vf a = loadv(acc + c);
        for (int64_t t = 0; t < n; t++) a += p[t] * loadv(v + t * vstride + c);
        storev(acc + c, a);
    }
}

/* The first key visible to a token whose context holds `ctx` keys (itself the last): transformers' sliding
 * window, at most `window` keys, its own included; 0 for a window of 0 (none) or longer than the context. */
static inline int64_t window_start(int64_t ctx, int64_t window) {
    return window > 0 && ctx > window ? ctx - window : 0;
}

/* 1 when the kernel's fixed per-thread scratch holds this shape. */
int paged_attention_supports(int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size) {
    const int64_t group = num_q_heads / num_kv_heads;
    return num_kv_heads > 0 && num_q_heads % num_kv_heads == 0 && head_dim % LANES == 0 && group <= MAX_GROUP
        && group * head_dim <= MAX_GROUP_DIM && group * block_size <= MAX_GROUP_DIM
        && block_size * head_dim <= MAX_BLOCK_DIM;
}

/* One block's n tokens (K and V `kstride`/`vstride` floats apart) for one query token's `group` heads of one KV
 * head: their scores (soft-capped when softcap > 0), the online-softmax update of acc [group, D], m and l
 * [group], and the p.v sum. Every token of every row goes through this one compiled copy, whatever tile it is
 * computed in: its bits follow from its own query and context alone. */
__attribute__((noinline)) static void attend_block(const float *q, const float *k, int64_t kstride, const float *v,
                                                   int64_t vstride, int64_t n, int64_t group, int64_t D, int64_t B,
                                                   float softcap, float *scores, float *acc, float *m, float *l) {
    for (int64_t j = 0; j < group; j++) dot_tokens(q + j * D, k, kstride, n, D, scores + j * B);
    if (softcap > 0.0f)
        for (int64_t j = 0; j < group; j++)
            for (int64_t t = 0; t < n; t++) scores[j * B + t] = softcap * tanhf(scores[j * B + t] / softcap);
    for (int64_t j = 0; j < group; j++) {
        float *s = scores + j * B, block_max = -FLT_MAX, sum = 0.0f;
        for (int64_t t = 0; t < n; t++) block_max = s[t] > block_max ? s[t] : block_max;
        const float new_max = block_max > m[j] ? block_max : m[j];
        const float correction = expf(m[j] - new_max);
        #pragma omp simd reduction(+:sum)
        for (int64_t t = 0; t < n; t++) { s[t] = expf(s[t] - new_max); sum += s[t]; }
        l[j] = l[j] * correction + sum;
        m[j] = new_max;
        float *a = acc + j * D;
        #pragma omp simd
        for (int64_t d = 0; d < D; d++) a[d] *= correction;
    }
    for (int64_t j = 0; j < group; j++) accumulate_tokens(acc + j * D, scores + j * B, v, vstride, n, D);
}

/* Attention of `count` consecutive query tokens of one row (token i: query q_in + i * q_stride, context
 * ctx0 + i) over their tokens from t0 (a multiple of B) to t1, or to their own context's end where it comes
 * first; with a window (> 0), from their own window's start where it comes later: token i sees
 * window_start(ctx0 + i, window) onwards. KV heads h0 .. h0 + heads - 1. Each block's K and V are read once
 * for all the tokens, from the first token's window start (the earliest: the blocks before it are skipped). A
 * token enters a block at its own first visible key, so what it computes depends on its own range only. Token i's
 * unnormalised sum acc, running maximum m and sum l per query head (query head h0 * group + j at j) go to
 * parts + i * stride. Returns 0, or -2 when the block table names a block outside the pool (then stops). */
static int attend_range(const float *q_in, int64_t q_stride, int64_t count, int64_t ctx0, const void *kv,
                        int kv_dtype, int64_t elem_size, const int64_t *table, int64_t t0, int64_t t1, int64_t h0,
                        int64_t heads, int64_t group, int64_t D, int64_t B, int64_t token_stride, int64_t v_offset,
                        int64_t num_blocks, float scale, int64_t window, float softcap, float *parts,
                        int64_t stride) {
    const int64_t hg = heads * group, hgd = hg * D;
    const int64_t end = ctx0 + count - 1 < t1 ? ctx0 + count - 1 : t1;  /* the last token's */
    const int64_t lo = window_start(ctx0, window), from = lo > t0 ? lo / B * B : t0;  /* the first token's */
    /* Sized by the shapes (bounded by paged_attention_supports and the tile): small stacks suffice. */
    float q[count * hgd], scores[group * B];
    float k_scratch[kv_dtype == KV_F32 ? 1 : B * D], v_scratch[kv_dtype == KV_F32 ? 1 : B * D];
    for (int64_t i = 0; i < count; i++) {
        for (int64_t x = 0; x < hgd; x++) q[i * hgd + x] = q_in[i * q_stride + x] * scale;
        float *part = parts + i * stride;
        memset(part, 0, sizeof(float) * hgd);
        for (int64_t j = 0; j < hg; j++) { part[hgd + j] = -FLT_MAX; part[hgd + hg + j] = 0.0f; }
    }
    for (int64_t start = from; start < end; start += B) {
        const int64_t blk = table[start / B], n = end - start < B ? end - start : B;
        /* The tile's first visible key of this block: the tokens before it are neither converted nor read. */
        const int64_t skip = lo > start ? lo - start : 0;
        if (blk < 0 || blk >= num_blocks) return -2;
        if (start + B < end) {
            const int64_t next = table[start / B + 1];
            if (next >= 0 && next < num_blocks) {
                const int64_t nn = end - start - B < B ? end - start - B : B, at = next * B * token_stride + h0 * D;
                prefetch_tokens(kv, elem_size, at, token_stride, nn, heads * D);
                prefetch_tokens(kv, elem_size, v_offset + at, token_stride, nn, heads * D);
            }
        }
        for (int64_t h = 0; h < heads; h++) {
            /* k and v point at the block's token `skip`. */
            const int64_t base = (blk * B + skip) * token_stride + (h0 + h) * D;
            int64_t kstride, vstride;
            const float *k = tokens_f32(kv, kv_dtype, base, token_stride, n - skip, D, k_scratch, &kstride);
            const float *v = tokens_f32(kv, kv_dtype, v_offset + base, token_stride, n - skip, D, v_scratch,
                                        &vstride);
            for (int64_t i = 0; i < count; i++) {
                const int64_t own_end = ctx0 + i < t1 ? ctx0 + i : t1, own = own_end - start < n ? own_end - start : n;
                const int64_t own_lo = window_start(ctx0 + i, window), before = own_lo > start ? own_lo - start : 0;
                /* This block lies past token i's context, or before its window. */
                if (own <= before) continue;
                float *part = parts + i * stride;
                attend_block(q + i * hgd + h * group * D, k + (before - skip) * kstride, kstride,
                             v + (before - skip) * vstride, vstride, own - before, group, D, B, softcap, scores,
                             part + h * group * D, part + hgd + h * group, part + hgd + hg + h * group);
            }
        }
    }
    return 0;
}

/* A row's context is cut into slices of SLICE_TOKENS (whole blocks) at fixed positions (0, SLICE_TOKENS, ...),
 * each attended on its own and merged: a token's slices are the ones its visible keys fall in, from its
 * window's start (or 0) to itself, so the cut depends on the token's own position and window only, and a token
 * gets the same bits whatever else is in the step and whichever tile or chunk computes it. A window never
 * moves the cut (cut from the window's start, it would differ between the tokens of one tile): it only leaves
 * out the slices and blocks before the window. */
/* One sequence, 3 KV heads on 2 threads: 1.3-1.6x at 2-4k tokens, even at 1k; 256 was slower at 1k. */
#define SLICE_TOKENS 512

static inline int64_t num_slices(int64_t ctx, int64_t slice) { return ctx > slice ? (ctx + slice - 1) / slice : 1; }

/* o [hg, D] = the slices' sums, each rescaled from its own maximum to their common one, normalised. `parts`
 * holds `count` slices of acc [hg * D], m [hg], l [hg], `stride` floats apart. `sinks` (NULL: none): each head's
 * attention-sink logit, whose exponential joins the denominator only (it attends to no value). One compiled copy
 * for every caller: with -ffast-math, two inlined copies could sum in different orders. */
__attribute__((noinline)) static void merge_slices(const float *parts, int64_t count, int64_t stride, int64_t hg,
                                                   int64_t D, const float *sinks, float *o) {
    const int64_t hgd = hg * D;
    for (int64_t j = 0; j < hg; j++) {
        float top = -FLT_MAX, total = 0.0f;
        for (int64_t sp = 0; sp < count; sp++) {
            const float mj = parts[sp * stride + hgd + j];
            top = mj > top ? mj : top;
        }
        float acc[D];
        for (int64_t d = 0; d < D; d++) acc[d] = 0.0f;
        for (int64_t sp = 0; sp < count; sp++) {
            const float *part = parts + sp * stride;
            const float w = expf(part[hgd + j] - top);
            total += part[hgd + hg + j] * w;
            for (int64_t d = 0; d < D; d++) acc[d] += part[j * D + d] * w;
        }
        if (sinks) total += expf(sinks[j] - top);
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;
        for (int64_t d = 0; d < D; d++) o[j * D + d] = acc[d] * inv;
    }
}

/* Returns 0; -1 for a shape paged_attention_supports refuses; -2 when a block table names a block
 * outside the pool (nothing outside the pool is read; the output is then not valid); -3 when out of memory;
 * -4 when a row has more new tokens than context. `window` > 0: each token sees the last `window` positions
 * up to itself only (a sliding-window layer); 0: its whole context. `softcap` > 0: each scaled score s is
 * softcap * tanh(s / softcap); 0: scores as they are. `sinks` [Hq] (NULL: none): each query head's sink logit, in
 * its softmax's denominator. */
int paged_attention_sinks(
    const float *query,          /* [T, Hq, D] fp32, contiguous */
    const void *kv,              /* [2, N, B, Hkv, D] one layer's pool, contiguous, of kv_dtype */
    int kv_dtype,
    float *out,                  /* [T, Hq, D] fp32 */
    int64_t num_rows,            /* R */
    const int64_t *cu_seqlens_q, /* [R + 1]: row r's new tokens are cu_seqlens_q[r] .. cu_seqlens_q[r + 1] - 1 */
    const int64_t *context_lens, /* [R]: cached tokens + new tokens */
    const int64_t *block_tables, /* [R, table_stride] */
    int64_t table_stride,
    int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t num_blocks,
    float scale,
    int num_threads,              /* torch.get_num_threads(): the kernel follows torch's setting */
    int64_t window,               /* > 0: the sliding window's length; 0: none */
    float softcap,                /* > 0: the scores' soft cap; 0: none */
    const float *sinks)           /* [Hq] fp32, or NULL */
{
    const int64_t group = num_q_heads / num_kv_heads, D = head_dim, B = block_size, Hkv = num_kv_heads;
    if (!paged_attention_supports(num_q_heads, num_kv_heads, head_dim, block_size)) return -1;
    const int64_t token_stride = Hkv * D;                 /* elements between tokens of one block */
    const int64_t v_offset = num_blocks * B * token_stride; /* V follows K */
    const int64_t elem_size = kv_dtype == KV_F32 ? 4 : 2;
    const int64_t slice = (SLICE_TOKENS + B - 1) / B * B;
    /* A tile: up to `tile` consecutive new tokens of one row, which read each block of their context once. */
    const int64_t fit = MAX_TILE_DIM / (num_q_heads * D);
    const int64_t tile = fit > TILE_TOKENS ? TILE_TOKENS : fit < 1 ? 1 : fit;
    int64_t num_tiles = 0, max_slices = 1;
    for (int64_t r = 0; r < num_rows; r++) {
        const int64_t n = cu_seqlens_q[r + 1] - cu_seqlens_q[r];
        if (n > context_lens[r]) return -4;
        num_tiles += (n + tile - 1) / tile;
    }
    /* Each tile's row, first token, token count, its first token's context (token i of a row with n new tokens
     * sees its first ctx - n + i + 1) and its first slice: the one its first token's window starts in (0
     * without a window). Its slices run from there to its last token's last; max_slices is the most a tile
     * spans. */
    int64_t *tile_row = malloc(sizeof(int64_t) * (size_t)(5 * (num_tiles > 0 ? num_tiles : 1)));
    if (!tile_row) return -3;
    int64_t *tile_first = tile_row + num_tiles, *tile_count = tile_first + num_tiles;
    int64_t *tile_ctx = tile_count + num_tiles, *tile_slice = tile_ctx + num_tiles;
    for (int64_t r = 0, t = 0; r < num_rows; r++)
        for (int64_t first = cu_seqlens_q[r]; first < cu_seqlens_q[r + 1]; first += tile, t++) {
            tile_row[t] = r;
            tile_first[t] = first;
            tile_count[t] = cu_seqlens_q[r + 1] - first < tile ? cu_seqlens_q[r + 1] - first : tile;
            tile_ctx[t] = context_lens[r] - cu_seqlens_q[r + 1] + first + 1;
            tile_slice[t] = window_start(tile_ctx[t], window) / slice;
            const int64_t span = num_slices(tile_ctx[t] + tile_count[t] - 1, slice) - tile_slice[t];
            max_slices = span > max_slices ? span : max_slices;
        }
    /* A work item is a tile's KV heads `heads` at a time: all of them when there are tiles enough to keep the
     * threads busy, so that each block's K and V are read as two contiguous runs; one when there are few.
     * With fewer such units than twice the threads (one or two sequences decoding), each slice of a unit is
     * an item of its own, merged after the loop: otherwise 3 KV heads on 2 threads leave one thread idle a
     * third of the time, and one head on many threads all but one. Else a unit's slices run one after another
     * in its item. The same slices and the same merge either way. */
    const int64_t heads = num_tiles >= 2 * num_threads && tile * num_q_heads * D <= MAX_TILE_DIM ? Hkv : 1;
    const int64_t chunks = Hkv / heads, hg = heads * group, hgd = hg * D, stride = hgd + 2 * hg;
    const int64_t units = num_tiles * chunks, tile_parts = tile * max_slices * stride;
    const int spread = units < 2 * num_threads;
    const int64_t items = spread ? units * max_slices : units;
    /* Each unit's partial sums (spread), else each thread's own for one unit at a time: per token of the tile,
     * per slice from the tile's first. */
    float *parts = malloc(sizeof(float) * (size_t)((spread ? units : num_threads) * tile_parts));
    if (!parts) { free(tile_row); return -3; }
    int bad_block = 0;

    #pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = 0; item < items; item++) {
        const int64_t unit = spread ? item / max_slices : item, t = unit / chunks, h0 = (unit % chunks) * heads;
        const int64_t r = tile_row[t], count = tile_count[t], first_token = tile_first[t], ctx0 = tile_ctx[t];
        const int64_t s0 = tile_slice[t], n = num_slices(ctx0 + count - 1, slice);
        const int64_t first = spread ? s0 + item % max_slices : s0, last = spread ? first + 1 : n;
        if (first >= n) continue;  /* a slice past every token's context */
        float *own = parts + (spread ? unit : (int64_t)omp_get_thread_num()) * tile_parts;
        const int64_t at = (first_token * num_q_heads + h0 * group) * D;
        for (int64_t sp = first; sp < last; sp++) {
            /* Slice sp of token i at own + ((sp - s0) * tile + i) * stride: a token's slices `tile` strides
             * apart. */
            if (attend_range(query + at, num_q_heads * D, count, ctx0, kv, kv_dtype, elem_size,
                             block_tables + r * table_stride, sp * slice, (sp + 1) * slice, h0, heads, group, D, B,
                             token_stride, v_offset, num_blocks, scale, window, softcap,
                             own + (sp - s0) * tile * stride, stride)) {
                #pragma omp atomic write
                bad_block = 1;
            }
        }
        if (!spread)
            for (int64_t i = 0; i < count; i++) {
                /* Token i's own slices only: from its window's (a later token's can start a slice later). */
                const int64_t own_first = window_start(ctx0 + i, window) / slice;
                merge_slices(own + ((own_first - s0) * tile + i) * stride, num_slices(ctx0 + i, slice) - own_first,
                             tile * stride, hg, D, sinks ? sinks + h0 * group : NULL, out + at + i * num_q_heads * D);
            }
    }
    for (int64_t unit = 0; spread && unit < units; unit++) {
        const int64_t t = unit / chunks, h0 = (unit % chunks) * heads;
        const float *unit_sinks = sinks ? sinks + h0 * group : NULL;
        for (int64_t i = 0; i < tile_count[t]; i++) {
            const int64_t own_first = window_start(tile_ctx[t] + i, window) / slice;
            merge_slices(parts + unit * tile_parts + ((own_first - tile_slice[t]) * tile + i) * stride,
                         num_slices(tile_ctx[t] + i, slice) - own_first, tile * stride, hg, D, unit_sinks,
                         out + ((tile_first[t] + i) * num_q_heads + h0 * group) * D);
        }
    }
    free(parts);
    free(tile_row);
    return bad_block ? -2 : 0;
}

/* Full attention (no window, no soft cap, no sinks): the entry the one-call decoder calls through its function pointer,
 * whose signature stays as it was. */
int paged_attention(const float *query, const void *kv, int kv_dtype, float *out, int64_t num_rows,
                    const int64_t *cu_seqlens_q, const int64_t *context_lens, const int64_t *block_tables,
                    int64_t table_stride, int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
                    int64_t block_size, int64_t num_blocks, float scale, int num_threads) {
    return paged_attention_sinks(query, kv, kv_dtype, out, num_rows, cu_seqlens_q, context_lens, block_tables,
                                 table_stride, num_q_heads, num_kv_heads, head_dim, block_size, num_blocks, scale,
                                 num_threads, 0, 0.0f, NULL);
}
