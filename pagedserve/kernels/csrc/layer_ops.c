/* A decoder layer's small fp32 operations on the CPU, one call each: the rotary embedding of q and k, and the
 * scatter of new K/V into the paged pool.
 *
 * In eager torch the rotation is ten small ops and the write five; at a decode step of a few sequences their
 * dispatch, not their arithmetic, is the cost. Built without -ffast-math and with -ffp-contract=off: every
 * product and sum is rounded as torch's op for op rounds it, so both give torch's bits. (The RMSNorm stays
 * torch's: its mean of squares, summed in another order, changed last bits, and with them sampled tokens
 * at near-ties between runs that must agree.)
 */
#include <stdint.h>
#include <string.h>

/* x [rows, heads, dim] (strides in floats) rotated in place by cos/sin [rows, dim] (row strides):
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
