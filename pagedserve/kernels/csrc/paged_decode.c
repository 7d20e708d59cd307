/* Paged decode attention on the CPU: rows with one new query token attend to their whole context,
 * read in place through the block table (no gather into a contiguous copy).
 *
 * One work item per (row, KV head): the item's K/V vectors are read once and serve every query head
 * of the GQA group. Online softmax block by block; math in fp32 whatever the pool's dtype.
 * Built with -O3 -ffast-math -fopenmp: the dot products and expf vectorize (expf through glibc's
 * libmvec), and the loop over work items runs on the OpenMP runtime torch already loaded
 * (the same libgomp.so.1), so it follows torch.set_num_threads.
 */
#include <float.h>
#include <stdint.h>
#include <string.h>
#include <math.h>

enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2 };

/* Per-thread scratch bounds (on the stack): query heads per KV head x head_dim, and x block_size. */
#define MAX_GROUP_DIM 8192
#define MAX_GROUP 256
#define MAX_HEAD_DIM 1024

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

/* Pointer to `n` fp32 values at element `index` of `base`: the pool itself when it is fp32, else
 * `scratch` filled by conversion. */
static inline const float *as_f32(const void *base, int dtype, int64_t index, int64_t n, float *scratch) {
    if (dtype == KV_F32) return (const float *)base + index;
    const uint16_t *src = (const uint16_t *)base + index;
    if (dtype == KV_BF16) {
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) scratch[i] = bf16_to_f32(src[i]);
    } else {
        for (int64_t i = 0; i < n; i++) scratch[i] = f16_to_f32(src[i]);
    }
    return scratch;
}

/* 1 when the kernel's fixed per-thread scratch holds this shape. */
int paged_decode_supports(int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size) {
    const int64_t group = num_q_heads / num_kv_heads;
    return num_kv_heads > 0 && num_q_heads % num_kv_heads == 0 && group <= MAX_GROUP && head_dim <= MAX_HEAD_DIM
        && group * head_dim <= MAX_GROUP_DIM && group * block_size <= MAX_GROUP_DIM;
}

/* Returns 0; -1 for a shape paged_decode_supports refuses; -2 when a block table names a block
 * outside the pool (nothing outside the pool is read; the output is then not valid). */
int paged_decode_attention(
    const float *query,          /* [T, Hq, D] fp32, contiguous */
    const void *kv,              /* [2, N, B, Hkv, D] one layer's pool, contiguous, of kv_dtype */
    int kv_dtype,
    float *out,                  /* [T, Hq, D] fp32: only the decode rows' tokens are written */
    const int64_t *rows,         /* [num_rows]: the batch rows to compute (each has one query token) */
    int64_t num_rows,
    const int64_t *cu_seqlens_q, /* [R + 1]: row r's query token is cu_seqlens_q[r] */
    const int64_t *context_lens, /* [R] */
    const int64_t *block_tables, /* [R, table_stride] */
    int64_t table_stride,
    int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t num_blocks,
    float scale)
{
    const int64_t group = num_q_heads / num_kv_heads, D = head_dim, B = block_size, Hkv = num_kv_heads;
    if (!paged_decode_supports(num_q_heads, num_kv_heads, head_dim, block_size)) return -1;
    const int64_t token_stride = Hkv * D;                 /* elements between tokens of one block */
    const int64_t v_offset = num_blocks * B * token_stride; /* V follows K */
    const int64_t items = num_rows * Hkv;
    int bad_block = 0;

    #pragma omp parallel for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; item++) {
        const int64_t r = rows[item / Hkv], h = item % Hkv;
        const int64_t ctx = context_lens[r], token = cu_seqlens_q[r];
        const int64_t *table = block_tables + r * table_stride;
        const float *q = query + (token * num_q_heads + h * group) * D;
        float acc[MAX_GROUP_DIM], scores[MAX_GROUP_DIM], m[MAX_GROUP], l[MAX_GROUP], scratch[MAX_HEAD_DIM];
        memset(acc, 0, sizeof(float) * group * D);
        for (int64_t j = 0; j < group; j++) { m[j] = -FLT_MAX; l[j] = 0.0f; }

        for (int64_t start = 0; start < ctx; start += B) {
            const int64_t blk = table[start / B], n = ctx - start < B ? ctx - start : B;
            if (blk < 0 || blk >= num_blocks) {
                #pragma omp atomic write
                bad_block = 1;
                break;
            }
            const int64_t base = (blk * B) * token_stride + h * D;
            for (int64_t t = 0; t < n; t++) {
                const float *k = as_f32(kv, kv_dtype, base + t * token_stride, D, scratch);
                for (int64_t j = 0; j < group; j++) {
                    const float *qj = q + j * D;
                    float dot = 0.0f;
                    #pragma omp simd reduction(+:dot)
                    for (int64_t d = 0; d < D; d++) dot += qj[d] * k[d];
                    scores[j * B + t] = dot * scale;
                }
            }
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
            for (int64_t t = 0; t < n; t++) {
                const float *v = as_f32(kv, kv_dtype, v_offset + base + t * token_stride, D, scratch);
                for (int64_t j = 0; j < group; j++) {
                    const float p = scores[j * B + t];
                    float *a = acc + j * D;
                    #pragma omp simd
                    for (int64_t d = 0; d < D; d++) a[d] += p * v[d];
                }
            }
        }
        float *o = out + (token * num_q_heads + h * group) * D;
        for (int64_t j = 0; j < group; j++) {
            const float inv = ctx > 0 ? 1.0f / l[j] : 0.0f;
            #pragma omp simd
            for (int64_t d = 0; d < D; d++) o[j * D + d] = acc[j * D + d] * inv;
        }
    }
    return bad_block ? -2 : 0;
}
