/* A decoder layer's small fp32 operations on the CPU, one call each: the RMSNorm (with the residual add before
 * it), the rotary embedding of q and k, the scatter of new K/V into the paged pool, and the MLP's SiLU gate.
 *
 * In eager torch the norm is eight small ops, the rotation ten and the write five; at a decode step of a few
 * sequences their dispatch, not their arithmetic, is the cost. Built without -ffast-math and with
 * -ffp-contract=off: the rotation and the write round every product and sum as torch's ops do, so both give
 * torch's bits. The norm's mean of squares and the gate's exp are computed in ways of their own, the same for
 * every row and column on every build, so a row's bits do not depend on the other rows, as the attention
 * and linear kernels' do not.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* Eight lanes on any x86 build (AVX2 or AVX-512), so that the sum's order does not follow the vector width. */
typedef float v8 __attribute__((vector_size(8 * sizeof(float))));

/* One vector r of dim values: o = weight * (r * (1 / sqrt(mean(r * r) + eps))), as transformers' LlamaRMSNorm
 * in fp32. The squares are summed in 8 lanes (lane i: elements i, i + 8, ...), the lanes in order, then the
 * tail. o may be r (each value is read before it is written). */
static inline void norm_vector(const float *r, const float *weight, float eps, int64_t dim, float *o) {
    const int64_t body = dim / 8 * 8;
    v8 lanes = {0};
    for (int64_t i = 0; i < body; i += 8) {
        v8 v;
        memcpy(&v, r + i, sizeof v);
        lanes += v * v;
    }
    float sum = 0.0f;
    for (int i = 0; i < 8; i++) sum += lanes[i];
    for (int64_t i = body; i < dim; i++) sum += r[i] * r[i];
    const float inv = 1.0f / sqrtf(sum / (float)dim + eps);
    for (int64_t i = 0; i < dim; i++) o[i] = weight[i] * (r[i] * inv);
}

/* Each row of x [rows, dim], or of residual + x (which residual then holds, rounded as torch adds). */
void rms_norm_f32(const float *x, int64_t stride_x, float *residual, int64_t stride_r, const float *weight,
                  float eps, float *out, int64_t stride_o, int64_t rows, int64_t dim, int num_threads) {
    #pragma omp parallel for if (rows >= 64) num_threads(num_threads)
    for (int64_t t = 0; t < rows; t++) {
        const float *xt = x + t * stride_x;
        float *r = residual ? residual + t * stride_r : (float *)xt;
        if (residual) {
            for (int64_t i = 0; i < dim; i++) r[i] += xt[i];
        }
        norm_vector(r, weight, eps, dim, out + t * stride_o);
    }
}

/* Each head of x [rows, heads, dim] into out [rows, heads, dim] (row and head strides in floats; out may be x):
 * the per-head q/k norms of Qwen3's attention. */
void rms_norm_heads_f32(const float *x, int64_t stride_t, int64_t stride_h, const float *weight, float eps,
                        float *out, int64_t out_stride_t, int64_t out_stride_h, int64_t rows, int64_t heads,
                        int64_t dim) {
    for (int64_t t = 0; t < rows; t++)
        for (int64_t h = 0; h < heads; h++)
            norm_vector(x + t * stride_t + h * stride_h, weight, eps, dim, out + t * out_stride_t + h * out_stride_h);
}

/* The first dim values of each head of x [rows, heads, >= dim] (strides in floats) rotated in place by cos/sin
 * [rows, dim] (row strides; dim below the head's size for a partial rotary embedding):
 * x * cos + rotate_half(x) * sin, each product and the sum rounded, as transformers computes it. */
static void rotate(float *x, int64_t stride_t, int64_t stride_h, int64_t heads, const float *cos, int64_t stride_c,
                   const float *sin, int64_t stride_s, int64_t rows, int64_t dim) {
    const int64_t half = dim / 2;
    for (int64_t t = 0; t < rows; t++) {
        const float *c = cos + t * stride_c, *s = sin + t * stride_s;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + t * stride_t + h * stride_h;
            for (int64_t i = 0; i < half; i++) {
                const float a = v[i], b = v[i + half];
                const float lo_c = a * c[i], lo_s = b * s[i];
                const float hi_c = b * c[i + half], hi_s = a * s[i + half];
                v[i] = lo_c - lo_s;
                v[i + half] = hi_c + hi_s;
            }
        }
    }
}

void rotate_qk_f32(float *q, int64_t stride_qt, int64_t stride_qh, int64_t q_heads, float *k, int64_t stride_kt,
                   int64_t stride_kh, int64_t k_heads, const float *cos, int64_t stride_c, const float *sin,
                   int64_t stride_s, int64_t rows, int64_t dim) {
    rotate(q, stride_qt, stride_qh, q_heads, cos, stride_c, sin, stride_s, rows, dim);
    rotate(k, stride_kt, stride_kh, k_heads, cos, stride_c, sin, stride_s, rows, dim);
}

/* key/value [rows, heads, dim] (row and head strides in floats; dim contiguous) into the pool's K and V planes
 * [slots, heads * dim] at slot_mapping[t] (negative: skipped). Returns 0, or -1 if a slot is past the pool
 * (nothing written then). */
int write_kv_f32(const float *key, int64_t stride_kt, int64_t stride_kh, const float *value, int64_t stride_vt,
                 int64_t stride_vh, float *k_plane, float *v_plane, const int64_t *slot_mapping, int64_t rows,
                 int64_t heads, int64_t dim, int64_t num_slots) {
    for (int64_t t = 0; t < rows; t++) {
        if (slot_mapping[t] >= num_slots) return -1;
    }
    const size_t bytes = (size_t)dim * sizeof(float);
    for (int64_t t = 0; t < rows; t++) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        float *kd = k_plane + slot * heads * dim, *vd = v_plane + slot * heads * dim;
        for (int64_t h = 0; h < heads; h++) {
            memcpy(kd + h * dim, key + t * stride_kt + h * stride_kh, bytes);
            memcpy(vd + h * dim, value + t * stride_vt + h * stride_vh, bytes);
        }
    }
    return 0;
}

/* The gate's lanes: 16 (two registers on an AVX2 build). Its arithmetic is lane by lane, so the width does not
 * change a value's bits. */
typedef float v16 __attribute__((vector_size(16 * sizeof(float))));
typedef int32_t v16i __attribute__((vector_size(16 * sizeof(int32_t))));

/* Lane i: a[i] where mask[i] (all ones), else b[i]. */
static inline v16 select16(v16i mask, v16 a, v16 b) {
    v16i ai, bi;
    memcpy(&ai, &a, sizeof ai);
    memcpy(&bi, &b, sizeof bi);
    const v16i r = (ai & mask) | (bi & ~mask);
    v16 out;
    memcpy(&out, &r, sizeof out);
    return out;
}

/* exp(x) lane by lane: x = n ln 2 + r with |r| <= ln 2 / 2 (ln 2 in two parts, so n ln 2 is exact), a degree-6
 * Taylor polynomial of exp(r) (relative error under 2e-7), scaled by 2^n through the exponent bits. x is
 * clamped to [-87, 88]: exp(-87) is still normal, exp(88) still finite. */
static inline v16 exp16(v16 x) {
    const v16 lo = (v16){0} - 87.0f, hi = (v16){0} + 88.0f;
    x = select16(x < lo, lo, x);
    x = select16(x > hi, hi, x);
    const v16 round = x * 1.44269504088896341f + 12582912.0f;  /* 1.5 * 2^23: the sum rounds to an integer */
    const v16 n = round - 12582912.0f;
    const v16 r = (x - n * 0.693145751953125f) - n * 1.428606765330187045e-6f;
    v16 p = r * (1.0f / 720) + (1.0f / 120);
    p = p * r + (1.0f / 24);
    p = p * r + (1.0f / 6);
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const v16i bits = (__builtin_convertvector(n, v16i) + 127) << 23;
    v16 scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* out [rows, n] = silu(gate) * up for x [rows, 2n] = [gate | up] (row strides in floats), silu(g) =
 * g / (1 + exp(-g)): every element through the same lane-wise code (the last ones of a row padded), so a
 * value's bits depend on it alone. */
void silu_mul_f32(const float *x, int64_t stride_x, float *out, int64_t stride_o, int64_t rows, int64_t n,
                  int num_threads) {
    const int64_t body = n / 16 * 16;
    #pragma omp parallel for if (rows >= 16) num_threads(num_threads)
    for (int64_t t = 0; t < rows; t++) {
        const float *gate = x + t * stride_x, *up = gate + n;
        float *o = out + t * stride_o;
        v16 g, u, y;
        for (int64_t i = 0; i < body; i += 16) {
            memcpy(&g, gate + i, sizeof g);
            memcpy(&u, up + i, sizeof u);
            y = g / (1.0f + exp16(-g)) * u;
            memcpy(o + i, &y, sizeof y);
        }
        if (body < n) {
            const size_t tail = (size_t)(n - body) * sizeof(float);
            g = (v16){0};
            u = (v16){0};
            memcpy(&g, gate + body, tail);
            memcpy(&u, up + body, tail);
            y = g / (1.0f + exp16(-g)) * u;
            memcpy(o + body, &y, tail);
        }
    }
}

/* A mixture of experts' routing for rows of router logits [T, E]: the softmax over all experts (the maximum
 * subtracted, expf, the sum in order), the k largest (ties to the lower expert id) in descending order, divided by
 * their sum (in order) where `renormalize`. Its exp is libm's: within an ulp of torch's, the same for every row in
 * any batch. */
void route_topk_f32(const float *logits, int64_t T, int64_t E, int64_t k, int renormalize, float *weights,
                    int64_t *ids) {
    for (int64_t t = 0; t < T; t++) {
        const float *l = logits + t * E;
        float m = l[0], sum = 0.0f;
        for (int64_t e = 1; e < E; e++) m = l[e] > m ? l[e] : m;
        for (int64_t e = 0; e < E; e++) sum += expf(l[e] - m);
        float *w = weights + t * k;
        int64_t *id = ids + t * k;
        for (int64_t j = 0; j < k; j++) {  /* k passes: k is a few, E at most a few hundred */
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++) {
                int taken = 0;
                for (int64_t i = 0; i < j; i++) taken |= id[i] == e;
                if (!taken && (best < 0 || l[e] > l[best])) best = e;
            }
            id[j] = best;
            w[j] = expf(l[best] - m) / sum;
        }
        if (renormalize) {
            float total = 0.0f;
            for (int64_t j = 0; j < k; j++) total += w[j];
            for (int64_t j = 0; j < k; j++) w[j] = w[j] / total;
        }
    }
}
