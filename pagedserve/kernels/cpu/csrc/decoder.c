/* A decoder's layers on the CPU in one call per step: the same kernel calls, in the same order and on the same
 * values, as the model's modules make through the CPU backend (workers/models/llama.py), without the Python
 * and torch dispatch between them, which at a decode step of a few sequences costs a third of the step.
 *
 * This file does no arithmetic of its own but a MoE layer's weighted sum of its experts' outputs (in the modules'
 * order): every other value is computed by the kernels it is handed (the GGUF-block linear layer, the RMSNorm, the
 * rotary embedding, the K/V write, the paged attention, the SiLU gate, the routing), so the
 * outputs are the modules' bits (tests/test_native_forward.py checks it). It covers what those kernels cover:
 * Llama / Qwen2 / Qwen3 layers (biases, q/k norms) whose four projections run on the GGUF-block kernel (GGUF
 * blocks, in parts of different types too, or plain panels), and Mixtral's and Qwen3-MoE's MoE layers (the
 * router, the routing kernel, each expert on its own layers), fp32, one rank; the modules run every other model.
 */
#include <stdint.h>
#include <string.h>

typedef int (*quant_linear_fn)(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w, int qtype,
                               int64_t N, const float *bias, float *y, int64_t ldy, int num_threads);
typedef int (*attention_fn)(const float *query, const void *kv, int kv_dtype, float *out, int64_t num_rows,
                            const int64_t *cu_seqlens_q, const int64_t *context_lens, const int64_t *block_tables,
                            int64_t table_stride, int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
                            int64_t block_size, int64_t num_blocks, float scale, int num_threads);
typedef void (*rms_norm_fn)(const float *x, int64_t stride_x, float *residual, int64_t stride_r,
                            const float *weight, float eps, float *out, int64_t stride_o, int64_t rows, int64_t dim,
                            int num_threads);
typedef void (*rotate_fn)(float *q, int64_t stride_qt, int64_t stride_qh, int64_t q_heads, float *k,
                          int64_t stride_kt, int64_t stride_kh, int64_t k_heads, const float *cos, int64_t stride_c,
                          const float *sin, int64_t stride_s, int64_t rows, int64_t dim);
typedef int (*write_kv_fn)(const float *key, int64_t stride_kt, int64_t stride_kh, const float *value,
                           int64_t stride_vt, int64_t stride_vh, float *k_plane, float *v_plane,
                           const int64_t *slot_mapping, int64_t rows, int64_t heads, int64_t dim, int64_t num_slots);
typedef void (*rms_norm_heads_fn)(const float *x, int64_t stride_t, int64_t stride_h, const float *weight,
                                  float eps, float *out, int64_t out_stride_t, int64_t out_stride_h, int64_t rows,
                                  int64_t heads, int64_t dim);
typedef void (*silu_mul_fn)(const float *x, int64_t stride_x, float *out, int64_t stride_o, int64_t rows, int64_t n,
                            int num_threads);
typedef void (*route_fn)(const float *logits, int64_t T, int64_t E, int64_t k, int renormalize, float *weights,
                         int64_t *ids);

typedef struct {
    quant_linear_fn quant_linear;
    attention_fn attention;
    rms_norm_fn rms_norm;
    rotate_fn rotate;
    write_kv_fn write_kv;
    silu_mul_fn silu_mul;
    rms_norm_heads_fn rms_norm_heads;
    route_fn route;
} kernels_t;

#define MAX_PARTS 3
/* A linear layer's output columns in parts of one weight type each: one part, or a fused q/k/v or gate/up
 * projection whose parts a GGUF holds in different types (ConcatQuantLinear). */
typedef struct {
    const uint8_t *panels;  /* the repacked blocks (workers/models/quant_linear.py) */
    const float *bias;      /* [n] or NULL */
    int64_t qtype, n;
} part_t;

typedef struct {
    part_t parts[MAX_PARTS];
    int64_t num_parts, k;
} linear_t;

/* A mixture-of-experts layer's experts: each one's gate|up and down layers. */
typedef struct {
    const linear_t *gate_up, *down;  /* [E] each */
    int64_t num_experts, hidden, intermediate;
} experts_t;

typedef struct {
    const float *input_norm, *post_norm;  /* [hidden] */
    const float *q_norm, *k_norm;         /* [head_dim] each, or NULL */
    linear_t qkv, o, gate_up, down;       /* gate_up and down unused on a MoE layer */
    /* A MoE layer's router and experts (NULL on a dense layer): the softmax's top_k experts, renormalized or not. */
    const linear_t *router;
    const experts_t *experts;
    int64_t top_k, renormalize;
} layer_t;

typedef struct {
    int64_t num_layers, hidden, num_q_heads, num_kv_heads, head_dim, intermediate;
    float eps, scale;
    const float *final_norm;  /* [hidden] */
    const layer_t *layers;
} model_t;

typedef struct {
    int64_t num_tokens, num_rows;
    const int64_t *cu_seqlens_q, *context_lens, *block_tables, *slot_mapping;
    int64_t table_stride;
    const float *cos, *sin;  /* [T, 1, D] */
    int64_t cos_stride, sin_stride;
    float *kv;  /* [L, 2, N, B, Hkv, D] fp32 */
    int64_t num_blocks, block_size;
    int num_threads;
} step_t;

/* Scratch of the step's shapes, and `hidden` [T, H]: the embeddings in, the final norm's output out. A MoE model's
 * too: router logits [T, E], routing weights and ids [T, k], the experts' scratch (see moe_experts). */
typedef struct {
    float *hidden, *residual, *normed, *qkv, *query, *attn, *gate_up, *act;
    float *router_logits, *route_weights;
    int64_t *route_ids;
    float *moe_scratch;
    int64_t *moe_order;
} buffers_t;

static int moe_experts_impl(const kernels_t *kern, const experts_t *e, const float *x, int64_t T, int64_t top_k,
                            const int64_t *ids, const float *weights, float *out, float *scratch, int64_t *order,
                            int threads);

/* y [T, ldy] = x [T, l->k] @ W^T (+ bias): each part's kernel call writes its own columns. */
static int linear(const kernels_t *kern, const linear_t *l, const float *x, int64_t T, float *y, int64_t ldy,
                  int threads) {
    int64_t col = 0;
    for (int64_t p = 0; p < l->num_parts; p++) {
        const part_t *part = &l->parts[p];
        const int status = kern->quant_linear(x, T, l->k, l->k, part->panels, (int)part->qtype, part->n, part->bias,
                                              y + col, ldy, threads);
        if (status) return status;
        col += part->n;
    }
    return 0;
}

/* Returns 0; else the failing kernel's status plus an offset naming it: 100 the linear layer, 200 the K/V
 * write, 300 the attention; 400: a route named an expert outside the layer's. */
int decoder_forward(const kernels_t *kern, const model_t *m, const step_t *s, const buffers_t *b) {
    const int64_t T = s->num_tokens, H = m->hidden, D = m->head_dim, Hq = m->num_q_heads, Hkv = m->num_kv_heads;
    const int64_t q_size = Hq * D, kv_size = Hkv * D, qkv_size = q_size + 2 * kv_size, I = m->intermediate;
    const int64_t plane = s->num_blocks * s->block_size * kv_size, num_slots = s->num_blocks * s->block_size;
    const int threads = s->num_threads;
    int status;
    if (T == 0) return 0;
    /* The first layer's residual stream is the embeddings; each later add is done by the norm after it. */
    memcpy(b->residual, b->hidden, sizeof(float) * (size_t)(T * H));
    for (int64_t i = 0; i < m->num_layers; i++) {
        const layer_t *L = &m->layers[i];
        float *k_plane = s->kv + i * 2 * plane, *v_plane = k_plane + plane;
        kern->rms_norm(b->hidden, H, i ? b->residual : NULL, H, L->input_norm, m->eps, b->normed, H, T, H, threads);
        if ((status = linear(kern, &L->qkv, b->normed, T, b->qkv, qkv_size, threads)))
            return 100 - status;
        float *q = b->qkv, *k = b->qkv + q_size, *v = k + kv_size;
        if (L->q_norm) {  /* in place: the modules' new tensors hold the same values */
            kern->rms_norm_heads(q, qkv_size, D, L->q_norm, m->eps, q, qkv_size, D, T, Hq, D);
            kern->rms_norm_heads(k, qkv_size, D, L->k_norm, m->eps, k, qkv_size, D, T, Hkv, D);
        }
        kern->rotate(q, qkv_size, D, Hq, k, qkv_size, D, Hkv, s->cos, s->cos_stride, s->sin, s->sin_stride, T, D);
        if ((status = kern->write_kv(k, qkv_size, D, v, qkv_size, D, k_plane, v_plane, s->slot_mapping, T, Hkv, D,
                                     num_slots)))
            return 200 - status;
        for (int64_t t = 0; t < T; t++) memcpy(b->query + t * q_size, q + t * qkv_size, sizeof(float) * (size_t)q_size);
        if ((status = kern->attention(b->query, k_plane, 0, b->attn, s->num_rows, s->cu_seqlens_q, s->context_lens,
                                      s->block_tables, s->table_stride, Hq, Hkv, D, s->block_size, s->num_blocks,
                                      m->scale, threads)))
            return 300 - status;
        /* o_proj's output lands in `hidden` (free until the next layer's norm reads it). */
        if ((status = linear(kern, &L->o, b->attn, T, b->hidden, H, threads)))
            return 100 - status;
        kern->rms_norm(b->hidden, H, b->residual, H, L->post_norm, m->eps, b->normed, H, T, H, threads);
        if (L->experts) {  /* the router's logits, the route, the experts' weighted sum into `hidden` */
            const int64_t E = L->experts->num_experts;
            if ((status = linear(kern, L->router, b->normed, T, b->router_logits, E, threads)))
                return 100 - status;
            kern->route(b->router_logits, T, E, L->top_k, (int)L->renormalize, b->route_weights, b->route_ids);
            status = moe_experts_impl(kern, L->experts, b->normed, T, L->top_k, b->route_ids, b->route_weights,
                                      b->hidden, b->moe_scratch, b->moe_order, threads);
            if (status == -1) return 400;
            if (status) return 100 - (status + 100);
            continue;
        }
        if ((status = linear(kern, &L->gate_up, b->normed, T, b->gate_up, 2 * I, threads)))
            return 100 - status;
        kern->silu_mul(b->gate_up, 2 * I, b->act, I, T, I, threads);
        if ((status = linear(kern, &L->down, b->act, T, b->hidden, H, threads)))
            return 100 - status;
    }
    kern->rms_norm(b->hidden, H, b->residual, H, m->final_norm, m->eps, b->normed, H, T, H, threads);
    memcpy(b->hidden, b->normed, sizeof(float) * (size_t)(T * H));
    return 0;
}

/* A mixture-of-experts layer's SiLU-gated experts over T tokens in one call: each expert's gate|up and down
 * projections (`gate_up[e]`, `down[e]`: the CPU kernel's layers) over the tokens routed to it, as the modules'
 * loop over experts computes them (workers/models/moe.py `grouped_experts` with the backend's SiLU gate): pairs
 * (token t's j-th choice, p = t * top_k + j) grouped by expert in pair order, each group's rows gathered, the
 * two projections and the SiLU gate by the kernels. Its own arithmetic is the routing weights' and the modules':
 * each pair's output times its weight, then a token's k products added in choice order. */
/* x [T, H] -> out [T, H]; ids and weights [T, top_k]; scratch: T * top_k * (2 H + 3 I) floats and T * top_k
 * int64. Returns 0, -1 for an expert id outside [0, E), or the linear kernel's status minus 100. */
int moe_experts(const kernels_t *kern, const experts_t *e, const float *x, int64_t T, int64_t top_k,
                const int64_t *ids, const float *weights, float *out, float *scratch, int64_t *order, int threads) {
    return moe_experts_impl(kern, e, x, T, top_k, ids, weights, out, scratch, order, threads);
}

static int moe_experts_impl(const kernels_t *kern, const experts_t *e, const float *x, int64_t T, int64_t top_k,
                            const int64_t *ids, const float *weights, float *out, float *scratch, int64_t *order,
                            int threads) {
    const int64_t P = T * top_k, H = e->hidden, I = e->intermediate;
    float *rows = scratch, *pair_out = rows + P * H, *gate_up = pair_out + P * H, *act = gate_up + P * 2 * I;
    int status;
    for (int64_t p = 0; p < P; p++)
        if (ids[p] < 0 || ids[p] >= e->num_experts) return -1;
    int64_t start = 0;
    for (int64_t expert = 0; expert < e->num_experts; expert++) {
        int64_t n = 0;
        for (int64_t p = 0; p < P; p++)
            if (ids[p] == expert) order[start + n++] = p;
        if (!n) continue;
        for (int64_t r = 0; r < n; r++)
            memcpy(rows + r * H, x + order[start + r] / top_k * H, sizeof(float) * (size_t)H);
        if ((status = linear(kern, &e->gate_up[expert], rows, n, gate_up, 2 * I, threads))) return status - 100;
        kern->silu_mul(gate_up, 2 * I, act, I, n, I, threads);
        if ((status = linear(kern, &e->down[expert], act, n, rows, H, threads))) return status - 100;
        for (int64_t r = 0; r < n; r++)
            memcpy(pair_out + order[start + r] * H, rows + r * H, sizeof(float) * (size_t)H);
        start += n;
    }
    for (int64_t t = 0; t < T; t++) {
        float *o = out + t * H;
        for (int64_t j = 0; j < top_k; j++) {
            const float w = weights[t * top_k + j], *y = pair_out + (t * top_k + j) * H;
            if (j == 0)
                for (int64_t c = 0; c < H; c++) o[c] = y[c] * w;
            else
                for (int64_t c = 0; c < H; c++) o[c] = o[c] + y[c] * w;
        }
    }
    return 0;
}
