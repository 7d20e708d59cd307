/* y = x @ W^T (+ bias) on the CPU, with W kept in a GGUF checkpoint's own blocks (Q4_0, Q4_1, Q8_0, K-types, IQ4) and
 * dequantized in the kernel: decode steps stream 2.6 to 8.5 bits per weight instead of fp32's 32. Q4_K's
 * 256-value super-blocks come as 32-value ones, each with its sub-block's 6-bit scale and min as bytes, and the
 * super-block's fp16 d and dmin in a header region after the panel's blocks; a block's fp32 scale and min are
 * formed in registers (d * scale, -(dmin * min): exact products): 4.6 bits per weight. Q6_K's come as 32-value
 * blocks of 6-bit quants (q - 32 in two's complement) with the int8 scales of their two 16-value halves, and the
 * fp16 d in the header: 6.6 bits. Q5_K's as Q4_K's, with 5-bit quants: 5.6 bits. Q3_K's as Q6_K's, with 3-bit
 * quants (q - 4 where its high bit is clear): 3.6 bits. IQ4_NL's blocks are Q4_0's whose quants index a table of 16
 * values (`IQ4_VALUES`) instead of being less 8; IQ4_XS's come as IQ4_NL's with an int8 sub-block scale instead of
 * the fp16 d, which is in the header: 4.3 bits. Q2_K's as Q3_K's with 2-bit quants and, for each half, a byte of
 * a 4-bit scale and a 4-bit min, as the file holds them: 2.6 bits, the file's own size. Q5_1's as Q4_1's with 5-bit
 * quants packed, its fp16 d and m after them (`FIELDS_AT`): 6 bits, the file's own size. (Q5_0 comes as Q8_0: its
 * quants less 16, a byte each.)
 * Plain weights (any other checkpoint's) go through the same panels and tiles with d = 1, so that every fp32 layer on
 * the CPU computes a row the same way in any batch, which oneDNN's GEMM does not: as fp32 (F32), or as the
 * bf16 or fp16 values they hold when each weight is one exactly (BF16, F16: a 16-bit checkpoint's weights,
 * widened on load). A 16-bit panel widens to the same floats, so it gives F32's bits from half the bytes.
 *
 * The weights are the fp32 weights the GGUF converter writes (d * q + m per 32-value block), with each block's
 * scale factored out of its sum: per row, column and block, s = sum of x[k] * q[k] over the block's 32 k
 * (in k order, fused multiply-adds from zero), then acc = d * s + acc, and for Q4_1 acc = m * sum(x over the
 * block) + acc, both fused. So the vector work per weight is a conversion and one multiply-add, not three
 * operations more to form the weight first (a one-sequence decode step's linear layers took 1.3x as long).
 * The result is the product with those weights, rounded in another order than a GEMM over them; read back
 * through an identity matrix (workers/models/quant_linear.py, `dequantize`) it gives gguf's dequantized
 * weights bit for bit. Built without -ffast-math and with -ffp-contract=off, so that the compiler keeps
 * every rounding where it is written.
 *
 * Weights are repacked once at load time (workers/models/quant_linear.py) into panels of 16 output rows:
 * per panel and 32-wide K block, the 16 rows' fp16 scales (and mins; the K-types' 8-bit ones), then for each of
 * the 32 k the 16 rows' quants side by side (4-bit: byte j holds row j in its low nibble and row j + 8 in its high
 * one; 6- and 5-bit: row r at bits 6r or 5r on of 12 or 10 bytes); after a K-type panel's blocks, per 256-value
 * super-block,
 * the 16 rows' fp16 d (and dmin).
 * The first rows of x (up to 4) run against a panel straight from its blocks, converting each k's 16 quants
 * in registers and storing them to a K x 16 fp32 scratch that stays in L1/L2; the other rows run against
 * that scratch in tiles of 6 rows x 16 columns (the classic AVX2 GEMM tile). So each quant is converted once
 * per call, in the same pass that first uses it; with no rows after the first ones (a decode step of up to 4
 * sequences) nothing is stored. Built for a CPU with AVX-512, both tiles hold a panel's 16 columns in one
 * register, the register tile 12 rows; and where a work item holds two panels, the later rows run against both
 * at once, 6 rows x 32 columns.
 *
 * Every row, in any tile and either build, does the same operations in the same order: a row's output does
 * not depend on the other rows of the call nor on the CPU's vector width, so a sequence decodes to the same
 * bits whatever else shares its step (the seeded sampling and the tests rely on it).
 *
 * The blocks are read with software prefetches PREFETCH_BLOCKS ahead: with few rows a block's arithmetic
 * is short, and the hardware prefetcher alone left the loop waiting on memory (one sequence's decode step
 * read its weights at a quarter of the memory's bandwidth; prefetched, its linear layers take half the time).
 * Only the passes that stream a panel in prefetch: a tile over a panel already in the caches would spend load
 * slots on them. Work items are groups of panels, spread over torch's OpenMP threads.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* F32, BF16, F16: plain weights in the same panels (d = 1), as fp32 or as 16-bit values each exactly is */
enum { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2, F32 = 3, BF16 = 4, F16 = 5, Q4_K = 6, Q6_K = 7, Q5_K = 8, Q3_K = 9, IQ4_NL = 10,
       IQ4_XS = 11, Q2_K = 12, Q5_1 = 13 };
#define PLAIN(qtype) ((qtype) == F32 || (qtype) == BF16 || (qtype) == F16)
/* w = d q + m: x's block sums (Q2_K: its two halves' sums, for a min each: `SUMS`) */
#define HAS_MIN(qtype) ((qtype) == Q4_1 || (qtype) == Q4_K || (qtype) == Q5_K || (qtype) == Q2_K || (qtype) == Q5_1)
#define SUMS(qtype) ((qtype) == Q2_K ? 2 : 1)  /* x's sums per block and row */
/* The K-types: per block, the 16 rows' 8-bit sub-block scales (Q4_K, Q5_K: then their mins; Q6_K, Q3_K: one for each
 * 16-value half, `HALVES`; Q2_K: for each half a 4-bit scale and, in the byte's high nibble, a 4-bit min; IQ4_XS: a
 * signed one), their super-block's fp16 d (and dmin) in the panel's header region, one per 256 values. */
#define K_TYPE(qtype) \
    ((qtype) == Q4_K || (qtype) == Q5_K || (qtype) == Q6_K || (qtype) == Q3_K || (qtype) == IQ4_XS || (qtype) == Q2_K)
#define HALVES(qtype) ((qtype) == Q6_K || (qtype) == Q3_K || (qtype) == Q2_K)
/* int8 sub-block scales; Q4_K's and Q5_K's unsigned bytes, Q2_K's nibbles */
#define SIGNED_SCALES(qtype) ((qtype) == Q6_K || (qtype) == Q3_K || (qtype) == IQ4_XS)
/* IQ4_NL's and IQ4_XS's 4-bit quants index this table of values (llama.cpp's kvalues_iq4nl) */
#define IQ4_VALUES -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113
#define LOOKUP(qtype) ((qtype) == IQ4_NL || (qtype) == IQ4_XS)
/* Where a block's fp16 d (and m) lie: first, but Q5_1's after its packed quants, so that the 16-byte read of its last
 * k's record (`PACKED_QUANTS`) stays inside the block (the K-types' reads end in the panel's header region) */
#define FIELDS_AT(qtype) ((qtype) == Q5_1 ? QK * NR * 5 / 8 : 0)
/* Where a block's quants start: after its scale fields (the 16 rows' fp16 d, Q4_1's m too, or the K-types' 8-bit
 * fields: IQ4_XS's one, the others' two), at its start for plain types and for Q5_1 */
#define QUANTS_AT(qtype) \
    (PLAIN(qtype) || (qtype) == Q5_1 ? 0 : (qtype) == IQ4_XS ? NR : (qtype) == Q4_1 ? 4 * NR : 2 * NR)

#define QK 32  /* values per GGUF block */
#define NR 16  /* output rows per panel */
#define MR 6   /* rows of x per register tile */
/* Rows of the tile that dequantizes as it goes: with AVX2 4 (4 x 2 accumulators + the scales), with AVX-512 8 (8 x
 * 2 + the scales of 32), so that a step verifying up to 7 proposed tokens of one sequence reads each block once and
 * stores nothing (a fifth row run against the scratch took a 5-row call from 1.5x a row's time to 2x) */
#if defined(__AVX512F__)
#define MR_FUSED 8
#else
#define MR_FUSED 4
#endif
#define MB 48  /* rows of x per block */
#define MAX_GROUP 8
#define PREFETCH_BLOCKS 32  /* quantized blocks: 10-17 KiB ahead; past a panel's end it reads the next one's */
#define PREFETCH_PLAIN_BYTES 16384  /* F32's 2 KiB blocks, BF16's and F16's 1 KiB (64 KiB streamed ~20% slower) */
#define L2_FLOATS (96 * 1024)  /* 384 KiB of fp32 */

int quant_linear_panel_rows(void) { return NR; }

/* Bytes of one (panel, K block) in the repacked layout; 0 for an unknown type. */
int64_t quant_linear_panel_block_bytes(int qtype) {
    switch (qtype) {
    case Q4_0: return 2 * NR + QK * NR / 2;
    case Q4_1: return 4 * NR + QK * NR / 2;
    case Q5_1: return 4 * NR + QK * NR * 5 / 8;  /* 5-bit quants, then the 16 rows' d and m */
    case Q8_0: return 2 * NR + QK * NR;
    case Q4_K: return 2 * NR + QK * NR / 2;  /* the 16 rows' 6-bit scales, their mins, then Q4_1's quants */
    case Q6_K: return 2 * NR + QK * NR * 6 / 8;  /* the 16 rows' int8 scales of each half, then 6-bit quants */
    case Q5_K: return 2 * NR + QK * NR * 5 / 8;  /* the 16 rows' 6-bit scales, their mins, then 5-bit quants */
    case Q3_K: return 2 * NR + QK * NR * 3 / 8;  /* Q6_K's with 3-bit quants */
    case Q2_K: return 2 * NR + QK * NR * 2 / 8;  /* the 16 rows' scale and min of each half, then 2-bit quants */
    case IQ4_NL: return 2 * NR + QK * NR / 2;  /* Q4_0's, the quants indexing `iq4_values` */
    case IQ4_XS: return NR + QK * NR / 2;  /* the 16 rows' int8 scales, then IQ4_NL's quants */
    case F32: return QK * NR * (int64_t)sizeof(float);
    case BF16:
    case F16: return QK * NR * 2;
    default: return 0;
    }
}

/* Bytes of a panel's header for one 256-value super-block of a K-type: the 16 rows' fp16 d (then their dmin), after
 * all of the panel's blocks; 0 for the other types. */
int64_t quant_linear_panel_header_bytes(int qtype) {
    return HAS_MIN(qtype) && K_TYPE(qtype) ? 4 * NR : K_TYPE(qtype) ? 2 * NR : 0;
}

/* 0 where the kernel reads panels of `qtype` over K inputs; -1 when K is not a multiple of 32 (of 256 for the
 * K-types), -2 for an unknown type. */
static int panel_shape_error(int qtype, int64_t K) {
    if (K % QK || (K_TYPE(qtype) && K % 256)) return -1;
    return quant_linear_panel_block_bytes(qtype) ? 0 : -2;
}

/* Bytes of one panel of K inputs: its blocks, then (K-types) its super-blocks' headers. */
int64_t quant_linear_panel_bytes(int qtype, int64_t K) {
    return K / QK * quant_linear_panel_block_bytes(qtype) + K / 256 * quant_linear_panel_header_bytes(qtype);
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

int quant_linear_supported(void) { return 1; }

static inline float half_at(const uint8_t *p) { return _cvtsh_ss((unsigned short)(p[0] | (p[1] << 8))); }

static inline __m256 half8(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* The cache lines of the (panel, K block) PREFETCH_BLOCKS after the one at p, of `bytes` bytes each, or of the
 * one PREFETCH_PLAIN_BYTES ahead for plain weights (their blocks are the largest). */
static inline void prefetch_ahead(const uint8_t *p, int64_t bytes) {
    const int64_t ahead = bytes >= QK * NR * 2 ? PREFETCH_PLAIN_BYTES : PREFETCH_BLOCKS * bytes;
    for (int64_t c = 0; c < bytes; c += 64) _mm_prefetch((const char *)p + ahead + c, _MM_HINT_T0);
}

/* The sum of 32 values (a block's x), or of 16 (a half's), in one fixed order, on every build: the same wherever a
 * row is summed. */
static inline float sum8(__m256 s) {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
}
static inline float block_sum(const float *x) {
    return sum8(_mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(x + 8)),
                              _mm256_add_ps(_mm256_loadu_ps(x + 16), _mm256_loadu_ps(x + 24))));
}
static inline float half_sum(const float *x) {
    return sum8(_mm256_add_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(x + 8)));
}

/* ROWS_n(X): X(0) ... X(n - 1), so each tile below is written once for every row count. One function per row
 * count keeps the sums in named variables the compiler holds in registers (an indexed array of them gets
 * spilled every iteration). */
#define ROWS_1(X) X(0)
#define ROWS_2(X) ROWS_1(X) X(1)
#define ROWS_3(X) ROWS_2(X) X(2)
#define ROWS_4(X) ROWS_3(X) X(3)
#define ROWS_5(X) ROWS_4(X) X(4)
#define ROWS_6(X) ROWS_5(X) X(5)
#define ROWS_7(X) ROWS_6(X) X(6)
#define ROWS_8(X) ROWS_7(X) X(7)
#define ROWS_9(X) ROWS_8(X) X(8)
#define ROWS_10(X) ROWS_9(X) X(9)
#define ROWS_11(X) ROWS_10(X) X(10)
#define ROWS_12(X) ROWS_11(X) X(11)

/* Every tile, for each row and each of its 16 columns: per K block, s = sum of x[k] * q[k] over the block's 32 k
 * in order from zero (q the quant as a float; Q4_0: q - 8; IQ4: the table's value; plain types: the weight, d = 1),
 * then acc = fma(d, s, acc), and for Q4_1, Q4_K and Q5_K acc = fma(m, sum(x over the block), acc) (`block_sum`, once
 * per row and block: `sx`). Q6_K's, Q3_K's and Q2_K's blocks have a d for each half: acc = fma(d of the first half, s,
 * acc) after the 16th k, and s starts again from zero (`HALF_END`); Q2_K's a min for each half too: after the d term,
 * acc = fma(m of the first half, its sum of x, acc), then the same for the second (`half_sum`, `half_mins16`). */
/* Q6_K's, Q5_K's, Q3_K's and Q2_K's quants packed: a k's 16 rows side by side in 12, 10, 6 or 4 bytes, row r's at bits
 * 6r to 6r + 5 (Q6_K: q - 32 in two's complement), 5r to 5r + 4 (Q5_K: q), 3r to 3r + 2 (Q3_K: two's complement) or
 * 2r and 2r + 1 (Q2_K: q). Each lane r picks the two bytes that hold its quant into its top half (PACKED_PICK: byte
 * shuffle indices), shifts it left until its top bit is the lane's (PACKED_SHIFT), and back by 32 less the bits
 * (arithmetically for the signed ones): the quant, in four operations with the conversion to float. A k's record is
 * read 16 bytes at a time: past the last k's lie the next block or the panel's header region (K-types), or the
 * block's own d and m (Q5_1, `FIELDS_AT`). Q5_1's quants are 5r to 5r + 4 as Q5_K's. */
#define PACKED_RECORD(bits) (NR * (bits) / 8)
#define PACKED_PICK(bits, r) (((bits) * (r) / 8) * 0x00010101 + ((bits) * (r) / 8 + 1) * 0x01000000)
#define PACKED_SHIFT(bits, r) (16 - (bits) - (bits) * (r) % 8)

#if defined(__AVX512F__)
/* With AVX-512 (a build for a CPU that has it): a panel's 16 columns are one register, and 32 registers hold
 * 12 rows' sums and accumulators. Each column's arithmetic is the 8-wide build's, so are its bits. */
#define MR_TILE 12
static inline __m512 half16(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
#define ACC_INIT(i) __m512 a##i = _mm512_setzero_ps();
#define SUM_INIT(i) __m512 s##i = _mm512_setzero_ps();
#define SUM_STEP(i) s##i = _mm512_fmadd_ps(_mm512_set1_ps(x[(i) * ldx + k]), q0, s##i);
#define BLOCK_END(i)                                                                   \
    a##i = _mm512_fmadd_ps(d0, s##i, a##i);                                            \
    if (sx) a##i = _mm512_fmadd_ps(m0, _mm512_set1_ps(sx[((i) * nb + b) * ns]), a##i);  \
    if (ns == 2) a##i = _mm512_fmadd_ps(n0, _mm512_set1_ps(sx[((i) * nb + b) * 2 + 1]), a##i);
#define ACC_STORE(i) _mm512_storeu_ps(out + (i) * NR, a##i);
/* 16 bytes as floats: unsigned, or (`sign`) int8 */
static inline __m512 bytes16(const uint8_t *p, int sign) {
    const __m128i v = _mm_loadu_si128((const __m128i *)p);
    return _mm512_cvtepi32_ps(sign ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v));
}
/* The low (or `high`) nibbles of 16 bytes as floats */
static inline __m512 nibbles16(const uint8_t *p, int high) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm512_cvtepi32_ps(high ? _mm512_srli_epi32(v, 4) : _mm512_and_si512(v, _mm512_set1_epi32(15)));
}
static inline __m512 neg16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32((int)0x80000000)));
}
/* A block's 16 scales and mins (rows 0-15): fp16 in GGUF's own types; in the K-types' the exact fp32 products of the
 * super-block's d (at hd) and the block's 8-bit scale (`HALVES`: of its second half; `halves16`: of its first), and
 * -(dmin * the 6-bit min); 1 and 0 for plain ones. */
static inline __m512 scales16(const uint8_t *p, const uint8_t *hd, int qtype) {
    return PLAIN(qtype) ? _mm512_set1_ps(1.0f) : K_TYPE(qtype)
         ? _mm512_mul_ps(half16(hd), qtype == Q2_K ? nibbles16(p + NR, 0)
                                     : bytes16(p + (HALVES(qtype) ? NR : 0), SIGNED_SCALES(qtype)))
         : half16(p + FIELDS_AT(qtype));
}
static inline __m512 halves16(const uint8_t *p, const uint8_t *hd, int qtype) {
    return HALVES(qtype) ? _mm512_mul_ps(half16(hd), qtype == Q2_K ? nibbles16(p, 0) : bytes16(p, 1))
                         : _mm512_setzero_ps();
}
/* (Q2_K: its first half's min; `half_mins16`: its second's) */
static inline __m512 mins16(const uint8_t *p, const uint8_t *hd, int qtype) {
    return qtype == Q4_1 || qtype == Q5_1 ? half16(p + FIELDS_AT(qtype) + 2 * NR)
         : HAS_MIN(qtype)
         ? neg16(_mm512_mul_ps(half16(hd + 2 * NR), qtype == Q2_K ? nibbles16(p, 1) : bytes16(p + NR, 0)))
         : _mm512_setzero_ps();
}
static inline __m512 half_mins16(const uint8_t *p, const uint8_t *hd, int qtype) {
    return qtype == Q2_K ? neg16(_mm512_mul_ps(half16(hd + 2 * NR), nibbles16(p + NR, 1))) : _mm512_setzero_ps();
}
#define SCALES const __m512 d0 = scales16(p, hd, qtype), m0 = mins16(p, hd, qtype), e0 = halves16(p, hd, qtype), \
                            n0 = half_mins16(p, hd, qtype);
#define HALF_END(i) a##i = _mm512_fmadd_ps(e0, s##i, a##i); s##i = _mm512_setzero_ps();
/* A k's 16 quants as floats (rows 0-15 in order: Q8_0's bytes; Q4's low nibbles, rows 0-7, then high). */
#if defined(__AVX512VBMI__)
/* A k's 4-bit quants are one 8-byte word: each row's nibble moved to the low bits of its lane by one multishift
 * (a byte from any bit offset of the word), then looked up as a float in a 16-entry table (a permute reads an
 * index's low 4 bits only, so the bits above it need no masking): two operations where the zero-extend-and-
 * convert took seven, which left Q4 layers bounded by the arithmetic rather than the memory. */
#define NIBBLE_SHIFTS _mm512_setr_epi32(0, 8, 16, 24, 32, 40, 48, 56, 4, 12, 20, 28, 36, 44, 52, 60)
#define NIBBLES_AS(k, ...) \
    const __m512 q0 = _mm512_permutexvar_ps( \
        _mm512_multishift_epi64_epi8(NIBBLE_SHIFTS, _mm512_set1_epi64(*(const int64_t *)(q + NR / 2 * (k)))), \
        _mm512_setr_ps(__VA_ARGS__));
#define QUANTS_Q40(k) NIBBLES_AS(k, -8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7)
#define QUANTS_Q41(k) NIBBLES_AS(k, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
#define QUANTS_IQ4(k) NIBBLES_AS(k, IQ4_VALUES)
#else
#define NIBBLES(k) \
    const __m128i v_ = _mm_loadl_epi64((const __m128i *)(q + NR / 2 * (k))); \
    const __m128i n_ = _mm_unpacklo_epi64(_mm_and_si128(v_, low4), _mm_and_si128(_mm_srli_epi16(v_, 4), low4));
#define QUANTS_Q40(k) NIBBLES(k) \
    const __m512 q0 = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(n_), _mm512_set1_epi32(8)));
#define QUANTS_Q41(k) NIBBLES(k) const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(n_));
/* IQ4's values looked up by a byte shuffle */
#define QUANTS_IQ4(k) NIBBLES(k) \
    const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_shuffle_epi8(_mm_setr_epi8(IQ4_VALUES), n_)));
#endif
/* A k's record in every 128-bit lane (a byte shuffle reads its own lane) */
#define PACKED_QUANTS(k, bits, shift_back) \
    const __m512i v_ = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(q + PACKED_RECORD(bits) * (k)))); \
    const __m512i picked_ = _mm512_shuffle_epi8(v_, _mm512_setr_epi32( \
        PACKED_PICK(bits, 0), PACKED_PICK(bits, 1), PACKED_PICK(bits, 2), PACKED_PICK(bits, 3), \
        PACKED_PICK(bits, 4), PACKED_PICK(bits, 5), PACKED_PICK(bits, 6), PACKED_PICK(bits, 7), \
        PACKED_PICK(bits, 8), PACKED_PICK(bits, 9), PACKED_PICK(bits, 10), PACKED_PICK(bits, 11), \
        PACKED_PICK(bits, 12), PACKED_PICK(bits, 13), PACKED_PICK(bits, 14), PACKED_PICK(bits, 15))); \
    const __m512 q0 = _mm512_cvtepi32_ps(shift_back(_mm512_sllv_epi32(picked_, _mm512_setr_epi32( \
        PACKED_SHIFT(bits, 0), PACKED_SHIFT(bits, 1), PACKED_SHIFT(bits, 2), PACKED_SHIFT(bits, 3), \
        PACKED_SHIFT(bits, 4), PACKED_SHIFT(bits, 5), PACKED_SHIFT(bits, 6), PACKED_SHIFT(bits, 7), \
        PACKED_SHIFT(bits, 8), PACKED_SHIFT(bits, 9), PACKED_SHIFT(bits, 10), PACKED_SHIFT(bits, 11), \
        PACKED_SHIFT(bits, 12), PACKED_SHIFT(bits, 13), PACKED_SHIFT(bits, 14), PACKED_SHIFT(bits, 15))), 32 - (bits)));
#define QUANTS_Q6(k) PACKED_QUANTS(k, 6, _mm512_srai_epi32)
#define QUANTS_Q5(k) PACKED_QUANTS(k, 5, _mm512_srli_epi32)
#define QUANTS_Q3(k) PACKED_QUANTS(k, 3, _mm512_srai_epi32)
#define QUANTS_Q2(k) PACKED_QUANTS(k, 2, _mm512_srli_epi32)
#define QUANTS_Q8(k) \
    const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + NR * (k)))));
#define QUANTS_F32(k) const __m512 q0 = _mm512_loadu_ps((const float *)q + NR * (k));
/* bf16 is the top half of an fp32: widened by a shift, exactly */
#define QUANTS_BF16(k) const __m512 q0 = _mm512_castsi512_ps(_mm512_slli_epi32( \
    _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(q + 2 * NR * (k)))), 16));
#define QUANTS_F16(k) const __m512 q0 = half16(q + 2 * NR * (k));
#define STORE_QUANTS(k) _mm512_storeu_ps(wt + (k) * NR, q0);
#define LOAD_QUANTS(k) const __m512 q0 = _mm512_loadu_ps(wt + (k) * NR);
#else
/* With AVX2: a row's 16 columns are two registers (columns 0-7 and 8-15), 6 rows' sums in 12 of the 16. */
#define MR_TILE MR
#define ACC_INIT(i) __m256 a##i##0 = _mm256_setzero_ps(), a##i##1 = _mm256_setzero_ps();
#define SUM_INIT(i) __m256 s##i##0 = _mm256_setzero_ps(), s##i##1 = _mm256_setzero_ps();
#define SUM_STEP(i)                                                                    \
    {                                                                                  \
        const __m256 xb = _mm256_broadcast_ss(x + (i) * ldx + k);                      \
        s##i##0 = _mm256_fmadd_ps(xb, q0, s##i##0);                                    \
        s##i##1 = _mm256_fmadd_ps(xb, q1, s##i##1);                                    \
    }
#define BLOCK_END(i)                                                                   \
    a##i##0 = _mm256_fmadd_ps(d0, s##i##0, a##i##0);                                   \
    a##i##1 = _mm256_fmadd_ps(d1, s##i##1, a##i##1);                                   \
    if (sx) {                                                                          \
        const __m256 xs = _mm256_broadcast_ss(sx + ((i) * nb + b) * ns);               \
        a##i##0 = _mm256_fmadd_ps(m0, xs, a##i##0);                                    \
        a##i##1 = _mm256_fmadd_ps(m1, xs, a##i##1);                                    \
    }                                                                                  \
    if (ns == 2) {                                                                     \
        const __m256 xs = _mm256_broadcast_ss(sx + ((i) * nb + b) * 2 + 1);            \
        a##i##0 = _mm256_fmadd_ps(n0, xs, a##i##0);                                    \
        a##i##1 = _mm256_fmadd_ps(n1, xs, a##i##1);                                    \
    }
#define ACC_STORE(i) _mm256_storeu_ps(out + (i) * NR, a##i##0); _mm256_storeu_ps(out + (i) * NR + 8, a##i##1);
/* 8 bytes as floats: unsigned, or (`sign`) int8 */
static inline __m256 bytes8(const uint8_t *p, int sign) {
    const __m128i v = _mm_loadl_epi64((const __m128i *)p);
    return _mm256_cvtepi32_ps(sign ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v));
}
/* The low (or `high`) nibbles of 8 bytes as floats */
static inline __m256 nibbles8(const uint8_t *p, int high) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    return _mm256_cvtepi32_ps(high ? _mm256_srli_epi32(v, 4) : _mm256_and_si256(v, _mm256_set1_epi32(15)));
}
static inline __m256 neg8(__m256 v) { return _mm256_xor_ps(v, _mm256_set1_ps(-0.0f)); }
/* Rows 8 h to 8 h + 7 of a block's scales and mins, as `scales16` and the others form them. */
static inline __m256 scales8(const uint8_t *p, const uint8_t *hd, int qtype, int h) {
    return PLAIN(qtype) ? _mm256_set1_ps(1.0f) : K_TYPE(qtype)
         ? _mm256_mul_ps(half8(hd + 16 * h), qtype == Q2_K ? nibbles8(p + NR + 8 * h, 0)
                                             : bytes8(p + (HALVES(qtype) ? NR : 0) + 8 * h, SIGNED_SCALES(qtype)))
         : half8(p + FIELDS_AT(qtype) + 16 * h);
}
static inline __m256 halves8(const uint8_t *p, const uint8_t *hd, int qtype, int h) {
    return HALVES(qtype)
         ? _mm256_mul_ps(half8(hd + 16 * h), qtype == Q2_K ? nibbles8(p + 8 * h, 0) : bytes8(p + 8 * h, 1))
         : _mm256_setzero_ps();
}
static inline __m256 mins8(const uint8_t *p, const uint8_t *hd, int qtype, int h) {
    return qtype == Q4_1 || qtype == Q5_1 ? half8(p + FIELDS_AT(qtype) + 2 * NR + 16 * h)
         : HAS_MIN(qtype) ? neg8(_mm256_mul_ps(half8(hd + 2 * NR + 16 * h),
                                               qtype == Q2_K ? nibbles8(p + 8 * h, 1) : bytes8(p + NR + 8 * h, 0)))
         : _mm256_setzero_ps();
}
static inline __m256 half_mins8(const uint8_t *p, const uint8_t *hd, int qtype, int h) {
    return qtype == Q2_K ? neg8(_mm256_mul_ps(half8(hd + 2 * NR + 16 * h), nibbles8(p + NR + 8 * h, 1)))
                         : _mm256_setzero_ps();
}
#define SCALES                                                                         \
    const __m256 d0 = scales8(p, hd, qtype, 0), d1 = scales8(p, hd, qtype, 1);         \
    const __m256 m0 = mins8(p, hd, qtype, 0), m1 = mins8(p, hd, qtype, 1);             \
    const __m256 e0 = halves8(p, hd, qtype, 0), e1 = halves8(p, hd, qtype, 1);         \
    const __m256 n0 = half_mins8(p, hd, qtype, 0), n1 = half_mins8(p, hd, qtype, 1);
#define HALF_END(i)                                                                    \
    a##i##0 = _mm256_fmadd_ps(e0, s##i##0, a##i##0);                                   \
    a##i##1 = _mm256_fmadd_ps(e1, s##i##1, a##i##1);                                   \
    s##i##0 = _mm256_setzero_ps();                                                     \
    s##i##1 = _mm256_setzero_ps();
/* A k's 16 quants as floats: q0 rows 0-7, q1 rows 8-15 (Q4: byte j holds row j low, row j + 8 high). */
#define QUANTS_Q8(k) \
    const __m128i v_ = _mm_loadu_si128((const __m128i *)(q + NR * (k))); \
    const __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v_)); \
    const __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v_, 8)));
#define QUANTS_Q40(k) \
    const __m128i v_ = _mm_loadl_epi64((const __m128i *)(q + NR / 2 * (k))); \
    const __m256 q0 = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_and_si128(v_, low4)), \
                                                          _mm256_set1_epi32(8))); \
    const __m256 q1 = _mm256_cvtepi32_ps(_mm256_sub_epi32( \
        _mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v_, 4), low4)), _mm256_set1_epi32(8)));
#define QUANTS_Q41(k) \
    const __m128i v_ = _mm_loadl_epi64((const __m128i *)(q + NR / 2 * (k))); \
    const __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(v_, low4))); \
    const __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v_, 4), low4)));
/* IQ4's values looked up by a byte shuffle */
#define QUANTS_IQ4(k) \
    const __m128i v_ = _mm_loadl_epi64((const __m128i *)(q + NR / 2 * (k))); \
    const __m128i i_ = _mm_shuffle_epi8(_mm_setr_epi8(IQ4_VALUES), \
                                        _mm_unpacklo_epi64(_mm_and_si128(v_, low4), \
                                                           _mm_and_si128(_mm_srli_epi16(v_, 4), low4))); \
    const __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(i_)); \
    const __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(i_, 8)));
#define PACKED_HALF(v, bits, r, shift_back) _mm256_cvtepi32_ps(shift_back(_mm256_sllv_epi32( \
    _mm256_shuffle_epi8(v, _mm256_setr_epi32(PACKED_PICK(bits, r), PACKED_PICK(bits, r + 1), \
        PACKED_PICK(bits, r + 2), PACKED_PICK(bits, r + 3), PACKED_PICK(bits, r + 4), PACKED_PICK(bits, r + 5), \
        PACKED_PICK(bits, r + 6), PACKED_PICK(bits, r + 7))), \
    _mm256_setr_epi32(PACKED_SHIFT(bits, r), PACKED_SHIFT(bits, r + 1), PACKED_SHIFT(bits, r + 2), \
        PACKED_SHIFT(bits, r + 3), PACKED_SHIFT(bits, r + 4), PACKED_SHIFT(bits, r + 5), PACKED_SHIFT(bits, r + 6), \
        PACKED_SHIFT(bits, r + 7))), 32 - (bits)))
#define PACKED_QUANTS(k, bits, shift_back) \
    const __m256i v_ = _mm256_broadcastsi128_si256( \
        _mm_loadu_si128((const __m128i *)(q + PACKED_RECORD(bits) * (k)))); \
    const __m256 q0 = PACKED_HALF(v_, bits, 0, shift_back), q1 = PACKED_HALF(v_, bits, 8, shift_back);
#define QUANTS_Q6(k) PACKED_QUANTS(k, 6, _mm256_srai_epi32)
#define QUANTS_Q5(k) PACKED_QUANTS(k, 5, _mm256_srli_epi32)
#define QUANTS_Q3(k) PACKED_QUANTS(k, 3, _mm256_srai_epi32)
#define QUANTS_Q2(k) PACKED_QUANTS(k, 2, _mm256_srli_epi32)
#define QUANTS_F32(k) \
    const __m256 q0 = _mm256_loadu_ps((const float *)q + NR * (k)); \
    const __m256 q1 = _mm256_loadu_ps((const float *)q + NR * (k) + 8);
#define QUANTS_BF16(k) \
    const __m256i v_ = _mm256_loadu_si256((const __m256i *)(q + 2 * NR * (k))); \
    const __m256 q0 = _mm256_castsi256_ps( \
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(v_)), 16)); \
    const __m256 q1 = _mm256_castsi256_ps( \
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(v_, 1)), 16));
#define QUANTS_F16(k) const __m256 q0 = half8(q + 2 * NR * (k)), q1 = half8(q + 2 * NR * (k) + 16);
#define STORE_QUANTS(k) _mm256_storeu_ps(wt + (k) * NR, q0); _mm256_storeu_ps(wt + (k) * NR + 8, q1);
#define LOAD_QUANTS(k) const __m256 q0 = _mm256_loadu_ps(wt + (k) * NR), q1 = _mm256_loadu_ps(wt + (k) * NR + 8);
#endif

/* The header of block b's super-block (K-types; unread by the others) */
#define HEADER const uint8_t *const hd = headers + b / 8 * hbytes;

/* out[0:n][0:16] = x[0:n, :] @ W^T for the first rows of x against a panel still in its blocks (at p): each k's
 * 16 quants are converted in registers, used at once, and stored to wt (K x 16 floats) for the rows that
 * follow, when there are any (one pass over the blocks instead of two). sx: the rows' block sums (`HAS_MIN`). */
#define HALF_LOOP(QUANTS, STEP, FROM) \
    for (int kk = FROM; kk < FROM + QK / 2; kk++) { \
        const int64_t k = b * QK + kk; \
        QUANTS(kk) \
        if (wt) { STORE_QUANTS(k) } \
        STEP \
    }
/* Two loops over a block's halves, so that the `HALVES` types' step between them leaves the others' loops whole. */
#define BLOCK_LOOP(QUANTS, STEP, HALF) \
    HALF_LOOP(QUANTS, STEP, 0) \
    if (HALVES(qtype)) { HALF } \
    HALF_LOOP(QUANTS, STEP, QK / 2)
#define TILE_FUSED(n) \
    static void tile_fused_##n(const float *x, int64_t ldx, const uint8_t *p, int qtype, int64_t K, \
                               const float *sx, float *wt, float *out) { \
        const int64_t nb = K / QK, bytes = quant_linear_panel_block_bytes(qtype); \
        const uint8_t *const headers = p + nb * bytes; /* the K-types' super-block d and dmin */ \
        const int64_t hbytes = quant_linear_panel_header_bytes(qtype); \
        const __m128i low4 = _mm_set1_epi8(0x0F); \
        const int ns = SUMS(qtype); \
        ROWS_##n(ACC_INIT) \
        for (int64_t b = 0; b < nb; b++, p += bytes) { \
            prefetch_ahead(p, bytes); \
            HEADER \
            SCALES \
            ROWS_##n(SUM_INIT) \
            const uint8_t *const q = p + QUANTS_AT(qtype); \
            if (qtype == Q8_0) { \
                BLOCK_LOOP(QUANTS_Q8, ROWS_##n(SUM_STEP), ROWS_##n(HALF_END)) \
            } else if (qtype == Q6_K) { \
                BLOCK_LOOP(QUANTS_Q6, ROWS_##n(SUM_STEP), ROWS_##n(HALF_END)) \
            } else if (qtype == Q5_K || qtype == Q5_1) { \
                BLOCK_LOOP(QUANTS_Q5, ROWS_##n(SUM_STEP), ROWS_##n(HALF_END)) \
            } else if (qtype == Q3_K) { \
                BLOCK_LOOP(QUANTS_Q3, ROWS_##n(SUM_STEP), ROWS_##n(HALF_END)) \
            } else if (qtype == Q2_K) { \
                BLOCK_LOOP(QUANTS_Q2, ROWS_##n(SUM_STEP), ROWS_##n(HALF_END)) \
            } else if (LOOKUP(qtype)) { \
                BLOCK_LOOP(QUANTS_IQ4, ROWS_##n(SUM_STEP), ROWS_##n(HALF_END)) \
            } else if (HAS_MIN(qtype)) { \
                BLOCK_LOOP(QUANTS_Q41, ROWS_##n(SUM_STEP), ROWS_##n(HALF_END)) \
            } else if (qtype == F32) { \
                BLOCK_LOOP(QUANTS_F32, ROWS_##n(SUM_STEP), ROWS_##n(HALF_END)) \
            } else if (qtype == BF16) { \
                BLOCK_LOOP(QUANTS_BF16, ROWS_##n(SUM_STEP), ROWS_##n(HALF_END)) \
            } else if (qtype == F16) { \
                BLOCK_LOOP(QUANTS_F16, ROWS_##n(SUM_STEP), ROWS_##n(HALF_END)) \
            } else { \
                BLOCK_LOOP(QUANTS_Q40, ROWS_##n(SUM_STEP), ROWS_##n(HALF_END)) \
            } \
            ROWS_##n(BLOCK_END) \
        } \
        ROWS_##n(ACC_STORE) \
    }
/* The same for rows after those, against the quants the first rows stored to wt (the scales from the blocks), or
 * for F32 against the panel itself (wt = its blocks). */
#define TILE(n) \
    static void tile_##n(const float *x, int64_t ldx, const uint8_t *p, int qtype, int64_t K, const float *sx, \
                         const float *wt, int stream, float *out) { \
        const int64_t nb = K / QK, bytes = quant_linear_panel_block_bytes(qtype); \
        const uint8_t *const headers = p + nb * bytes; \
        const int64_t hbytes = quant_linear_panel_header_bytes(qtype); \
        const int ns = SUMS(qtype); \
        ROWS_##n(ACC_INIT) \
        for (int64_t b = 0; b < nb; b++, p += bytes) { \
            if (stream) prefetch_ahead(p, bytes); /* wt is this panel, read from memory */ \
            HEADER \
            SCALES \
            ROWS_##n(SUM_INIT) \
            for (int kk = 0; kk < QK / 2; kk++) { \
                const int64_t k = b * QK + kk; \
                LOAD_QUANTS(k) \
                ROWS_##n(SUM_STEP) \
            } \
            if (HALVES(qtype)) { ROWS_##n(HALF_END) } \
            for (int kk = QK / 2; kk < QK; kk++) { \
                const int64_t k = b * QK + kk; \
                LOAD_QUANTS(k) \
                ROWS_##n(SUM_STEP) \
            } \
            ROWS_##n(BLOCK_END) \
        } \
        ROWS_##n(ACC_STORE) \
    }
#if defined(__AVX512F__)
/* With AVX-512, the rows after the first ones also run against two panels at once (6 rows x 32 columns): per k,
 * two panel loads and six broadcasts feed twelve multiply-adds, where a 12 x 16 tile needs twelve broadcasts
 * and a load for as many (up to 6% faster at 256-1,024 rows). Each column's arithmetic is the tile's above,
 * so are its bits. */
#define MR_PAIR 6
#define ACC2_INIT(i) __m512 a##i = _mm512_setzero_ps(), c##i = _mm512_setzero_ps();
#define SUM2_INIT(i) __m512 s##i = _mm512_setzero_ps(), t##i = _mm512_setzero_ps();
#define SUM2_STEP(i)                                                                   \
    {                                                                                  \
        const __m512 xb = _mm512_set1_ps(x[(i) * ldx + k]);                            \
        s##i = _mm512_fmadd_ps(xb, q0, s##i);                                          \
        t##i = _mm512_fmadd_ps(xb, q1, t##i);                                          \
    }
#define BLOCK2_END(i)                                                                  \
    a##i = _mm512_fmadd_ps(d0, s##i, a##i);                                            \
    c##i = _mm512_fmadd_ps(d1, t##i, c##i);                                            \
    if (sx) {                                                                          \
        const __m512 xs = _mm512_set1_ps(sx[((i) * nb + b) * ns]);                     \
        a##i = _mm512_fmadd_ps(m0, xs, a##i);                                          \
        c##i = _mm512_fmadd_ps(m1, xs, c##i);                                          \
    }                                                                                  \
    if (ns == 2) {                                                                     \
        const __m512 xs = _mm512_set1_ps(sx[((i) * nb + b) * 2 + 1]);                  \
        a##i = _mm512_fmadd_ps(n0, xs, a##i);                                          \
        c##i = _mm512_fmadd_ps(n1, xs, c##i);                                          \
    }
#define HALF2_END(i)                                                                   \
    a##i = _mm512_fmadd_ps(e0, s##i, a##i);                                            \
    c##i = _mm512_fmadd_ps(e1, t##i, c##i);                                            \
    s##i = _mm512_setzero_ps();                                                        \
    t##i = _mm512_setzero_ps();
#define ACC2_STORE(i) _mm512_storeu_ps(out + (i) * 2 * NR, a##i); _mm512_storeu_ps(out + (i) * 2 * NR + NR, c##i);
#define TILE_PAIR(n) \
    static void tile_pair_##n(const float *x, int64_t ldx, const uint8_t *p, const uint8_t *p2, int qtype, int64_t K, \
                              const float *sx, const float *wt, const float *wt2, int stream, float *out) { \
        const int64_t nb = K / QK, bytes = quant_linear_panel_block_bytes(qtype); \
        const uint8_t *const headers = p + nb * bytes, *const headers2 = p2 + nb * bytes; \
        const int64_t hbytes = quant_linear_panel_header_bytes(qtype); \
        const int ns = SUMS(qtype); \
        ROWS_##n(ACC2_INIT) \
        for (int64_t b = 0; b < nb; b++, p += bytes, p2 += bytes) { \
            if (stream) { prefetch_ahead(p, bytes); prefetch_ahead(p2, bytes); } \
            const uint8_t *const hd = headers + b / 8 * hbytes, *const hd2 = headers2 + b / 8 * hbytes; \
            const __m512 d0 = scales16(p, hd, qtype), d1 = scales16(p2, hd2, qtype); \
            const __m512 m0 = mins16(p, hd, qtype), m1 = mins16(p2, hd2, qtype); \
            const __m512 e0 = halves16(p, hd, qtype), e1 = halves16(p2, hd2, qtype); \
            const __m512 n0 = half_mins16(p, hd, qtype), n1 = half_mins16(p2, hd2, qtype); \
            ROWS_##n(SUM2_INIT) \
            for (int kk = 0; kk < QK / 2; kk++) { \
                const int64_t k = b * QK + kk; \
                const __m512 q0 = _mm512_loadu_ps(wt + k * NR), q1 = _mm512_loadu_ps(wt2 + k * NR); \
                ROWS_##n(SUM2_STEP) \
            } \
            if (HALVES(qtype)) { ROWS_##n(HALF2_END) } \
            for (int kk = QK / 2; kk < QK; kk++) { \
                const int64_t k = b * QK + kk; \
                const __m512 q0 = _mm512_loadu_ps(wt + k * NR), q1 = _mm512_loadu_ps(wt2 + k * NR); \
                ROWS_##n(SUM2_STEP) \
            } \
            ROWS_##n(BLOCK2_END) \
        } \
        ROWS_##n(ACC2_STORE) \
    }
typedef void (*pair_fn)(const float *, int64_t, const uint8_t *, const uint8_t *, int, int64_t, const float *,
                        const float *, const float *, int, float *);
TILE_PAIR(1) TILE_PAIR(2) TILE_PAIR(3) TILE_PAIR(4) TILE_PAIR(5) TILE_PAIR(6)
static const pair_fn PAIRS[MR_PAIR + 1] = {0, tile_pair_1, tile_pair_2, tile_pair_3, tile_pair_4, tile_pair_5,
                                           tile_pair_6};
#endif
typedef void (*fused_fn)(const float *, int64_t, const uint8_t *, int, int64_t, const float *, float *, float *);
typedef void (*tile_fn)(const float *, int64_t, const uint8_t *, int, int64_t, const float *, const float *, int,
                        float *);
TILE_FUSED(1) TILE_FUSED(2) TILE_FUSED(3) TILE_FUSED(4)
TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6)
#if defined(__AVX512F__)
TILE(7) TILE(8) TILE(9) TILE(10) TILE(11) TILE(12)
static const tile_fn TILES[MR_TILE + 1] = {0, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6, tile_7, tile_8, tile_9,
                                           tile_10, tile_11, tile_12};
#else
static const tile_fn TILES[MR_TILE + 1] = {0, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6};
#endif
#if defined(__AVX512F__)
TILE_FUSED(5) TILE_FUSED(6) TILE_FUSED(7) TILE_FUSED(8)
static const fused_fn FUSED[MR_FUSED + 1] = {0, tile_fused_1, tile_fused_2, tile_fused_3, tile_fused_4, tile_fused_5,
                                             tile_fused_6, tile_fused_7, tile_fused_8};
#else
static const fused_fn FUSED[MR_FUSED + 1] = {0, tile_fused_1, tile_fused_2, tile_fused_3, tile_fused_4};
#endif

/* Rows i .. i + mr of y, columns n0 .. n0 + nr: a tile's out (rows `stride` floats apart), plus the bias. */
static inline void store_rows(float *y, int64_t ldy, int64_t i, int mr, int64_t n0, int nr, const float *out,
                              int stride, const float *bias) {
    for (int r = 0; r < mr; r++) {
        float *dst = y + (i + r) * ldy + n0;
        if (bias) {
            for (int j = 0; j < nr; j++) dst[j] = out[r * stride + j] + bias[n0 + j];
        } else {
            memcpy(dst, out + r * stride, (size_t)nr * sizeof(float));
        }
    }
}

/* x [M, K] with row stride ldx; w the repacked panels of W [N, K]; y [M, N] with row stride ldy.
 * Returns 0, or -1 when K is not a multiple of 32, -2 for an unknown type, -3 when out of memory. */
int quant_linear(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w, int qtype, int64_t N,
                 const float *bias, float *y, int64_t ldy, int num_threads) {
    const int error = panel_shape_error(qtype, K);
    if (error) return error;
    const int64_t panel_bytes = quant_linear_panel_bytes(qtype, K);
    const int64_t n_panels = (N + NR - 1) / NR;
    /* A work item is a group of panels, dequantized once and run against every row of x, 48 rows at a time:
     * each weight is dequantized once per call, and each 48-row block of x is reused across the group
     * while it sits in L2. Groups sized so the group's fp32 panels and a block of x fit in ~384 KiB. */
    int64_t group = 1;
    if (M > MB) {
        group = (L2_FLOATS - MB * K) / (K * NR);
        if (group < 1) group = 1;
        if (group > MAX_GROUP) group = MAX_GROUP;
        int64_t per_thread = (n_panels + num_threads - 1) / num_threads;  /* keep every thread busy */
        if (group > per_thread) group = per_thread;
    }
    const int64_t n_groups = (n_panels + group - 1) / group, nb = K / QK, ns = SUMS(qtype);
    /* The m term (`HAS_MIN`): each row's block sums (or its halves'), once per call. */
    float *sx = HAS_MIN(qtype) ? malloc(sizeof(float) * (size_t)(M * nb * ns > 0 ? M * nb * ns : 1)) : NULL;
    if (HAS_MIN(qtype) && !sx) return -3;
    int failed = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        if (sx) {
            #pragma omp for schedule(static)
            for (int64_t r = 0; r < M; r++)
                for (int64_t b = 0; b < nb; b++) {
                    const float *xb = x + r * ldx + b * QK;
                    if (ns == 2) {
                        sx[(r * nb + b) * 2] = half_sum(xb);
                        sx[(r * nb + b) * 2 + 1] = half_sum(xb + QK / 2);
                    } else {
                        sx[r * nb + b] = block_sum(xb);
                    }
                }
        }
        /* The converted quants' scratch: calls of up to MR_FUSED rows read the blocks alone, and F32 panels
         * are laid out as the scratch is (K x 16 floats), so the later rows read them in place. */
        const int scratch = M > MR_FUSED && qtype != F32;
        float *wt = scratch ? aligned_alloc(64, (size_t)(group * K * NR * sizeof(float))) : NULL;  /* K: 32k */
        float out[MR_TILE * NR];
        if (scratch && !wt) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t g = 0; g < n_groups; g++) {
            if (scratch && !wt) continue;
            const int64_t p0 = g * group, p1 = p0 + group < n_panels ? p0 + group : n_panels;
            for (int64_t i0 = 0; i0 < M; i0 += MB) {
                const int64_t iend = i0 + MB < M ? i0 + MB : M;
                for (int64_t p = p0; p < p1;) {
#if defined(__AVX512F__)
                    const int pair = p + 1 < p1;  /* this panel and the next in one tile, for the later rows */
#else
                    const int pair = 0;
#endif
                    const int64_t n0 = p * NR;
                    const int nr = (int)(N - n0 < NR ? N - n0 : NR);
                    const int nr2 = pair ? (int)(N - n0 - NR < NR ? N - n0 - NR : NR) : 0;
                    float *panel = scratch ? wt + (p - p0) * K * NR : NULL;
                    float *panel2 = scratch && pair ? panel + K * NR : NULL;
                    const float *later = qtype == F32 ? (const float *)(w + p * panel_bytes) : panel;
                    const float *later2 = qtype == F32 ? (const float *)(w + (p + 1) * panel_bytes) : panel2;
                    int64_t i = i0;
                    /* F32 tiles read the panel in memory: the call's first tile over it streams it in, prefetched;
                     * the later ones find it in the caches (prefetches there only take load slots). */
                    const int first = qtype == F32 && i0 == 0;
                    /* The panel's first rows convert its quants as they go, for the rows after them. F32 panels
                     * need no converting: past 4 rows, all the rows run in register tiles straight off them (one
                     * pass over the panel in memory, not one for 4 rows and another). */
                    if (i0 == 0 && (qtype != F32 || iend <= MR_FUSED)) {
                        const int mr = (int)(iend < MR_FUSED ? iend : MR_FUSED);
                        /* panel NULL: no rows come after these, nothing is stored */
                        FUSED[mr](x, ldx, w + p * panel_bytes, qtype, K, sx, panel, out);
                        store_rows(y, ldy, 0, mr, n0, nr, out, NR, bias);
                        if (pair) {
                            FUSED[mr](x, ldx, w + (p + 1) * panel_bytes, qtype, K, sx, panel2, out);
                            store_rows(y, ldy, 0, mr, n0 + NR, nr2, out, NR, bias);
                        }
                        i = mr;
                    }
                    while (i < iend) {
                        int mr;
#if defined(__AVX512F__)
                        if (pair) {
                            mr = (int)(iend - i < MR_PAIR ? iend - i : MR_PAIR);
                            PAIRS[mr](x + i * ldx, ldx, w + p * panel_bytes, w + (p + 1) * panel_bytes, qtype, K,
                                      sx ? sx + i * nb * ns : NULL, later, later2, first && i == 0, out);
                            store_rows(y, ldy, i, mr, n0, nr, out, 2 * NR, bias);
                            store_rows(y, ldy, i, mr, n0 + NR, nr2, out + NR, 2 * NR, bias);
                            i += mr;
                            continue;
                        }
#endif
                        mr = (int)(iend - i < MR_TILE ? iend - i : MR_TILE);
                        TILES[mr](x + i * ldx, ldx, w + p * panel_bytes, qtype, K, sx ? sx + i * nb * ns : NULL, later,
                                  first && i == 0, out);
                        store_rows(y, ldy, i, mr, n0, nr, out, NR, bias);
                        i += mr;
                    }
                    p += pair ? 2 : 1;
                }
            }
        }
        free(wt);
    }
    free(sx);
    return failed ? -3 : 0;
}

static inline float float_at(const uint8_t *p) { float f; memcpy(&f, p, sizeof f); return f; }

/* Row r's weight k (of 32) in the (panel, K block) at p (hd: its super-block's header, K-types): the fp32 weight
 * the products above are taken with, as gguf's dequantization forms it (d * q, or d * q + m; d * q is exact, and so
 * is a K-type's d * sc, so there is one rounding at most). */
static const int8_t iq4_values[16] = {IQ4_VALUES};
static inline int nibble_at(const uint8_t *q, int r, int k) {  /* row r's 4-bit quant k in packed quants q */
    return (q[NR / 2 * k + r % (NR / 2)] >> (r < NR / 2 ? 0 : 4)) & 15;
}
static inline float weight_at(const uint8_t *p, const uint8_t *hd, int qtype, int r, int k) {
    const uint8_t *const q = p + QUANTS_AT(qtype);
    switch (qtype) {
    case Q4_0: return half_at(p + 2 * r) * (float)(nibble_at(q, r, k) - 8);
    case Q4_1: return half_at(p + 2 * r) * (float)nibble_at(q, r, k) + half_at(p + 2 * NR + 2 * r);
    case Q8_0: return half_at(p + 2 * r) * (float)(int8_t)q[NR * k + r];
    case Q4_K:
        return half_at(hd + 2 * r) * (float)p[r] * (float)nibble_at(q, r, k)
             + -(half_at(hd + 2 * NR + 2 * r) * (float)p[NR + r]);
    case Q5_K:
    case Q5_1: {
        const uint8_t *record = q + PACKED_RECORD(5) * k + 5 * r / 8;
        const int q5 = ((record[0] | record[1] << 8) >> (5 * r % 8)) & 31;
        if (qtype == Q5_1)
            return half_at(p + FIELDS_AT(Q5_1) + 2 * r) * (float)q5 + half_at(p + FIELDS_AT(Q5_1) + 2 * NR + 2 * r);
        return half_at(hd + 2 * r) * (float)p[r] * (float)q5 + -(half_at(hd + 2 * NR + 2 * r) * (float)p[NR + r]);
    }
    case Q6_K:
    case Q3_K: {
        const int bits = qtype == Q6_K ? 6 : 3;
        const uint8_t *record = q + PACKED_RECORD(bits) * k + bits * r / 8;
        const int qb = ((record[0] | record[1] << 8) >> (bits * r % 8)) & ((1 << bits) - 1);  /* two's complement */
        return half_at(hd + 2 * r) * (float)(int8_t)p[(k < QK / 2 ? 0 : NR) + r]
             * (float)(qb < 1 << (bits - 1) ? qb : qb - (1 << bits));
    }
    case Q2_K: {
        const int h = k < QK / 2 ? 0 : 1, q2 = (q[PACKED_RECORD(2) * k + r / 4] >> (2 * (r % 4))) & 3;
        return half_at(hd + 2 * r) * (float)(p[h * NR + r] & 15) * (float)q2
             + -(half_at(hd + 2 * NR + 2 * r) * (float)(p[h * NR + r] >> 4));
    }
    case IQ4_NL: return half_at(p + 2 * r) * (float)iq4_values[nibble_at(q, r, k)];
    case IQ4_XS: return half_at(hd + 2 * r) * (float)(int8_t)p[r] * (float)iq4_values[nibble_at(q, r, k)];
    case F32: return float_at(p + 4 * (NR * k + r));
    case BF16: {
        const uint32_t bits = (uint32_t)(p[2 * (NR * k + r)] | (p[2 * (NR * k + r) + 1] << 8)) << 16;
        float f;
        memcpy(&f, &bits, sizeof f);
        return f;
    }
    default: return half_at(p + 2 * (NR * k + r));  /* F16 */
    }
}

/* out [n, K] = rows ids[0 .. n) of W [N, K] from its panels w: an embedding table looked up where it is held,
 * the same floats as the fp32 table. Returns 0, -1 when K is not a multiple of 32 (of 256 for the K-types), -2 for
 * an unknown type, -4 when an id is outside [0, N). */
int quant_linear_rows(const uint8_t *w, int qtype, int64_t N, int64_t K, const int64_t *ids, int64_t n, float *out) {
    const int error = panel_shape_error(qtype, K);
    if (error) return error;
    const int64_t block_bytes = quant_linear_panel_block_bytes(qtype);
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= N) return -4;
    const int64_t nb = K / QK, hbytes = quant_linear_panel_header_bytes(qtype);
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *p = w + ids[i] / NR * quant_linear_panel_bytes(qtype, K), *headers = p + nb * block_bytes;
        const int r = (int)(ids[i] % NR);
        for (int64_t b = 0; b < nb; b++, p += block_bytes)
            for (int k = 0; k < QK; k++) out[i * K + b * QK + k] = weight_at(p, headers + b / 8 * hbytes, qtype, r, k);
    }
    return 0;
}

#else  /* no AVX2/FMA/F16C: the caller keeps the fp32 weights */

int quant_linear_supported(void) { return 0; }

int quant_linear(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w, int qtype, int64_t N,
                 const float *bias, float *y, int64_t ldy, int num_threads) {
    return -4;
}

int quant_linear_rows(const uint8_t *w, int qtype, int64_t N, int64_t K, const int64_t *ids, int64_t n, float *out) {
    return -2;
}

#endif
