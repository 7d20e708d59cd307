/* y = x @ W^T (+ bias) on the CPU, with W kept in a GGUF checkpoint's own blocks (Q4_0, Q4_1, Q8_0) and
 * dequantized in the kernel: decode steps stream 4.5 to 8.5 bits per weight instead of fp32's 32.
 *
 * Exact against the fp32 weights the GGUF converter writes: each weight is formed as gguf's dequantize
 * forms it (d * q + m, rounded after the multiply and after the add), and the product accumulates in fp32
 * with fused multiply-adds along K, like any fp32 GEMM. This file is built without -ffast-math and with
 * -ffp-contract=off so that the compiler neither fuses the dequantization nor reorders it.
 *
 * Weights are repacked once at load time (workers/models/quant_linear.py) into panels of 16 output rows:
 * per panel and 32-wide K block, the 16 rows' fp16 scales (and mins), then for each of the 32 k the 16
 * rows' quants side by side (4-bit: byte j holds row j in its low nibble and row j + 8 in its high one).
 * A panel is dequantized into a K x 16 fp32 scratch that stays in L1/L2 and serves every row of x in
 * the step; tiles of 6 rows x 16 columns keep 12 accumulators in registers (the classic AVX2 GEMM tile).
 * Work items are (block of 48 rows of x, panel) pairs spread over torch's OpenMP threads.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2 };

#define QK 32  /* values per GGUF block */
#define NR 16  /* output rows per panel */
#define MR 6   /* rows of x per register tile */
#define MB 48  /* rows of x per work item */

int quant_linear_panel_rows(void) { return NR; }

/* Bytes of one (panel, K block) in the repacked layout; 0 for an unknown type. */
int64_t quant_linear_panel_block_bytes(int qtype) {
    switch (qtype) {
    case Q4_0: return 2 * NR + QK * NR / 2;
    case Q4_1: return 4 * NR + QK * NR / 2;
    case Q8_0: return 2 * NR + QK * NR;
    default: return 0;
    }
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

int quant_linear_supported(void) { return 1; }

static inline __m256 half8(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* A panel's K values for its 16 rows into wt[k][16]. */
static void dequant_panel(const uint8_t *p, int qtype, int64_t K, float *wt) {
    const int64_t nb = K / QK, bytes = quant_linear_panel_block_bytes(qtype);
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m256i eight = _mm256_set1_epi32(8);
    for (int64_t b = 0; b < nb; b++, p += bytes) {
        float *o = wt + b * QK * NR;
        const __m256 d0 = half8(p), d1 = half8(p + 16);
        if (qtype == Q8_0) {
            const uint8_t *q = p + 2 * NR;
            for (int k = 0; k < QK; k++) {
                __m128i v = _mm_loadu_si128((const __m128i *)(q + NR * k));
                __m256 f0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
                __m256 f1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)));
                _mm256_storeu_ps(o + k * NR, _mm256_mul_ps(f0, d0));
                _mm256_storeu_ps(o + k * NR + 8, _mm256_mul_ps(f1, d1));
            }
            continue;
        }
        const int with_min = qtype == Q4_1;
        const __m256 m0 = with_min ? half8(p + 32) : _mm256_setzero_ps();
        const __m256 m1 = with_min ? half8(p + 48) : _mm256_setzero_ps();
        const uint8_t *q = p + (with_min ? 4 : 2) * NR;
        for (int k = 0; k < QK; k++) {
            __m128i v = _mm_loadl_epi64((const __m128i *)(q + NR / 2 * k));
            __m256i i0 = _mm256_cvtepu8_epi32(_mm_and_si128(v, low4));
            __m256i i1 = _mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), low4));
            if (with_min) {
                _mm256_storeu_ps(o + k * NR, _mm256_add_ps(_mm256_mul_ps(d0, _mm256_cvtepi32_ps(i0)), m0));
                _mm256_storeu_ps(o + k * NR + 8, _mm256_add_ps(_mm256_mul_ps(d1, _mm256_cvtepi32_ps(i1)), m1));
            } else {  /* Q4_0: (q - 8) * d */
                _mm256_storeu_ps(o + k * NR, _mm256_mul_ps(d0, _mm256_cvtepi32_ps(_mm256_sub_epi32(i0, eight))));
                _mm256_storeu_ps(o + k * NR + 8, _mm256_mul_ps(d1, _mm256_cvtepi32_ps(_mm256_sub_epi32(i1, eight))));
            }
        }
    }
}

/* out[0:n][0:16] = x[0:n, :] @ wt (K x 16). One function per row count so the accumulators are named
 * variables the compiler keeps in registers (an indexed array of them gets spilled every iteration). */
#define ACC_INIT(i) __m256 a##i##0 = _mm256_setzero_ps(), a##i##1 = _mm256_setzero_ps();
#define ACC_STEP(i)                                                       \
    {                                                                     \
        const __m256 xb = _mm256_broadcast_ss(x + (i) * ldx + k);         \
        a##i##0 = _mm256_fmadd_ps(xb, w0, a##i##0);                       \
        a##i##1 = _mm256_fmadd_ps(xb, w1, a##i##1);                       \
    }
#define ACC_STORE(i) _mm256_storeu_ps(out + (i) * NR, a##i##0); _mm256_storeu_ps(out + (i) * NR + 8, a##i##1);
#define TILE(n, INIT, STEP, STORE)                                                                       \
    static void tile_##n(const float *x, int64_t ldx, const float *wt, int64_t K, float *out) {          \
        INIT                                                                                             \
        for (int64_t k = 0; k < K; k++) {                                                                \
            const __m256 w0 = _mm256_loadu_ps(wt + k * NR), w1 = _mm256_loadu_ps(wt + k * NR + 8);      \
            STEP                                                                                         \
        }                                                                                                \
        STORE                                                                                            \
    }
TILE(1, ACC_INIT(0), ACC_STEP(0), ACC_STORE(0))
TILE(2, ACC_INIT(0) ACC_INIT(1), ACC_STEP(0) ACC_STEP(1), ACC_STORE(0) ACC_STORE(1))
TILE(3, ACC_INIT(0) ACC_INIT(1) ACC_INIT(2), ACC_STEP(0) ACC_STEP(1) ACC_STEP(2),
     ACC_STORE(0) ACC_STORE(1) ACC_STORE(2))
TILE(4, ACC_INIT(0) ACC_INIT(1) ACC_INIT(2) ACC_INIT(3), ACC_STEP(0) ACC_STEP(1) ACC_STEP(2) ACC_STEP(3),
     ACC_STORE(0) ACC_STORE(1) ACC_STORE(2) ACC_STORE(3))
TILE(5, ACC_INIT(0) ACC_INIT(1) ACC_INIT(2) ACC_INIT(3) ACC_INIT(4),
     ACC_STEP(0) ACC_STEP(1) ACC_STEP(2) ACC_STEP(3) ACC_STEP(4),
     ACC_STORE(0) ACC_STORE(1) ACC_STORE(2) ACC_STORE(3) ACC_STORE(4))
TILE(6, ACC_INIT(0) ACC_INIT(1) ACC_INIT(2) ACC_INIT(3) ACC_INIT(4) ACC_INIT(5),
     ACC_STEP(0) ACC_STEP(1) ACC_STEP(2) ACC_STEP(3) ACC_STEP(4) ACC_STEP(5),
     ACC_STORE(0) ACC_STORE(1) ACC_STORE(2) ACC_STORE(3) ACC_STORE(4) ACC_STORE(5))

typedef void (*tile_fn)(const float *, int64_t, const float *, int64_t, float *);
static const tile_fn TILES[MR + 1] = {0, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6};

/* x [M, K] with row stride ldx; w the repacked panels of W [N, K]; y [M, N] with row stride ldy.
 * Returns 0, or -1 when K is not a multiple of 32, -2 for an unknown type, -3 when out of memory. */
int quant_linear(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w, int qtype, int64_t N,
                 const float *bias, float *y, int64_t ldy, int num_threads) {
    if (K % QK) return -1;
    const int64_t block_bytes = quant_linear_panel_block_bytes(qtype);
    if (!block_bytes) return -2;
    const int64_t panel_bytes = K / QK * block_bytes;
    const int64_t n_panels = (N + NR - 1) / NR, n_mb = (M + MB - 1) / MB, items = n_panels * n_mb;
    int failed = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        float *wt = aligned_alloc(64, (size_t)(K * NR * sizeof(float)));  /* K is a multiple of 32 */
        float out[MR * NR];
        if (!wt) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (int64_t it = 0; it < items; it++) {
            if (!wt) continue;
            const int64_t mb = it / n_panels, p = it % n_panels, n0 = p * NR;
            const int nr = (int)(N - n0 < NR ? N - n0 : NR);
            dequant_panel(w + p * panel_bytes, qtype, K, wt);
            const int64_t iend = (mb + 1) * MB < M ? (mb + 1) * MB : M;
            for (int64_t i = mb * MB; i < iend; i += MR) {
                const int mr = (int)(iend - i < MR ? iend - i : MR);
                TILES[mr](x + i * ldx, ldx, wt, K, out);
                for (int r = 0; r < mr; r++) {
                    float *dst = y + (i + r) * ldy + n0;
                    if (bias) {
                        for (int j = 0; j < nr; j++) dst[j] = out[r * NR + j] + bias[n0 + j];
                    } else {
                        memcpy(dst, out + r * NR, (size_t)nr * sizeof(float));
                    }
                }
            }
        }
        free(wt);
    }
    return failed ? -3 : 0;
}

/* The fp32 weights W [N, K] the kernel computes with, for tests. */
int quant_linear_dequantize(const uint8_t *w, int qtype, int64_t N, int64_t K, float *out) {
    if (K % QK) return -1;
    const int64_t block_bytes = quant_linear_panel_block_bytes(qtype);
    if (!block_bytes) return -2;
    float *wt = aligned_alloc(64, (size_t)(K * NR * sizeof(float)));
    if (!wt) return -3;
    for (int64_t p = 0; p * NR < N; p++) {
        dequant_panel(w + p * (K / QK * block_bytes), qtype, K, wt);
        for (int64_t j = 0; j < NR && p * NR + j < N; j++)
            for (int64_t k = 0; k < K; k++) out[(p * NR + j) * K + k] = wt[k * NR + j];
    }
    free(wt);
    return 0;
}

#else  /* no AVX2/FMA/F16C: the caller keeps the fp32 weights */

int quant_linear_supported(void) { return 0; }

int quant_linear(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w, int qtype, int64_t N,
                 const float *bias, float *y, int64_t ldy, int num_threads) {
    return -4;
}

int quant_linear_dequantize(const uint8_t *w, int qtype, int64_t N, int64_t K, float *out) { return -4; }

#endif
