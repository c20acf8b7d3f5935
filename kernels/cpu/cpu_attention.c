/* cpu_attention.c -- Paged causal attention for a batch of sequences of different lengths,
 * reading keys and values through block tables. One routine serves prefill chunks (with or
 * without a cached prefix) and decode steps: a decode step is a chunk of one query. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "kernels/cpu/cpu_backend.h"

/* A key or value row of hd elements at element offset off of cache: the f32 row itself, or an
 * e4m3 row dequantized into buf. */
static inline const float *kv_row_at(const void *cache, size_t off, int32_t hd, bool fp8,
                                     float scale, float *buf)
{
    if (!fp8) return (const float *)cache + off;
    const uint8_t *b = (const uint8_t *)cache + off;
    for (int32_t j = 0; j < hd; j++) buf[j] = pd_e4m3_to_f32(b[j]) * scale;
    return buf;
}

static int attention(void *ctx, const pd_attn_args *a, bool fp8)
{
    pd_cpu_ctx *c = ctx;
    const int32_t bs = a->block_size;
    const int32_t hd = a->head_dim, group = a->n_heads / a->n_kv_heads;
    const int64_t kv_row = (int64_t)a->n_kv_heads * hd;
    const int64_t out_row = (int64_t)a->n_heads * hd;
    /* max_ctx_len 0: not given (a replayed decode graph); the contexts are host memory here. */
    int32_t max_ctx = a->max_ctx_len;
    if (max_ctx == 0)
        for (int32_t s = 0; s < a->n_seqs; s++)
            if (a->ctx_lens[s] > max_ctx) max_ctx = a->ctx_lens[s];
    size_t need = (size_t)(max_ctx > 0 ? max_ctx : 1) + (size_t)hd;
    if (need > c->scratch_cap) {
        float *p = realloc(c->scratch, need * sizeof(float));
        if (!p) return PD_ENOMEM;
        c->scratch = p;
        c->scratch_cap = need;
    }
    float *scores = c->scratch, *acc = c->scratch + (need - (size_t)hd);
    const void *kc = a->k_cache, *vc = a->v_cache;
    const float *qb = a->q;
    float row_buf[512];
    if (fp8 && hd > 512) return PD_EUNSUPPORTED;
    float *ob = a->out;
    for (int32_t s = 0; s < a->n_seqs; s++) {
        const int32_t q0 = a->cu_q[s], q_len = a->cu_q[s + 1] - q0, ctx_len = a->ctx_lens[s];
        const int32_t *bt = a->block_tables + (size_t)s * a->max_blocks_per_seq;
        if (ctx_len > max_ctx) return PD_EINVAL; /* scratch is sized by max_ctx */
        if (ctx_len == 0) { /* a padding row (backend.h): zeros */
            for (int32_t i = 0; i < q_len; i++)
                memset(ob + (size_t)(q0 + i) * out_row, 0, (size_t)out_row * sizeof(float));
            continue;
        }
        for (int32_t i = 0; i < q_len; i++) {
            const int32_t pos = ctx_len - q_len + i;
            int32_t start = 0;
            if (a->sliding_window > 0 && pos - a->sliding_window + 1 > 0)
                start = pos - a->sliding_window + 1;
            const float *qrow = qb + (size_t)(q0 + i) * a->q_row_stride;
            float *orow = ob + (size_t)(q0 + i) * out_row;
            for (int32_t h = 0; h < a->n_heads; h++) {
                const float *q = qrow + (size_t)h * hd;
                const int32_t kvh = h / group;
                float mx = -INFINITY;
                /* Walk the context block by block: no division per key. */
                for (int32_t p0 = start - start % bs; p0 <= pos; p0 += bs) {
                    const size_t base = (size_t)bt[p0 / bs] * bs;
                    const int32_t lo = p0 < start ? start : p0;
                    const int32_t hi = p0 + bs - 1 < pos ? p0 + bs - 1 : pos;
                    for (int32_t p = lo; p <= hi; p++) {
                        const float *k = kv_row_at(kc, (base + (size_t)(p - p0)) * kv_row +
                                                   (size_t)kvh * hd, hd, fp8, a->k_scale, row_buf);
                        float d = 0;
                        for (int32_t j = 0; j < hd; j++) d += q[j] * k[j];
                        d *= a->scale;
                        scores[p - start] = d;
                        if (d > mx) mx = d;
                    }
                }
                double sum = 0;
                for (int32_t p = start; p <= pos; p++) {
                    float e = expf(scores[p - start] - mx);
                    scores[p - start] = e;
                    sum += e;
                }
                memset(acc, 0, (size_t)hd * sizeof(float));
                for (int32_t p0 = start - start % bs; p0 <= pos; p0 += bs) {
                    const size_t base = (size_t)bt[p0 / bs] * bs;
                    const int32_t lo = p0 < start ? start : p0;
                    const int32_t hi = p0 + bs - 1 < pos ? p0 + bs - 1 : pos;
                    for (int32_t p = lo; p <= hi; p++) {
                        const float *v = kv_row_at(vc, (base + (size_t)(p - p0)) * kv_row +
                                                   (size_t)kvh * hd, hd, fp8, a->v_scale, row_buf);
                        const float w = scores[p - start];
                        for (int32_t j = 0; j < hd; j++) acc[j] += w * v[j];
                    }
                }
                float inv = (float)(1.0 / sum);
                for (int32_t j = 0; j < hd; j++) orow[(size_t)h * hd + j] = acc[j] * inv;
            }
        }
    }
    return 0;
}

int pd_cpu__attention(void *ctx, const pd_attn_args *a) { return attention(ctx, a, false); }

int pd_cpu__attention_fp8(void *ctx, const pd_attn_args *a) { return attention(ctx, a, true); }
