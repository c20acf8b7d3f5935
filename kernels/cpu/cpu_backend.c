/* cpu_backend.c -- The reference backend: fp32 host buffers, BLAS for matrix products, plain
 * loops for everything else. It is the oracle every other backend is tested against, so it
 * favours clarity and accumulates reductions in double where that is cheap. */
#include "kernels/cpu/cpu_backend.h"

#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"

static void cpu_destroy(void *ctx)
{
    pd_cpu_ctx *c = ctx;
    if (!c) return;
    free(c->scratch);
    free(c->qx);
    free(c->moe);
    free(c->moe_x);
    free(c);
}

static int cpu_alloc(void *ctx, pd_dtype dtype, size_t n, void **out)
{
    (void)ctx;
    *out = NULL;
    if (dtype != PD_DTYPE_F32 && dtype != PD_DTYPE_I32 && dtype != PD_DTYPE_F8E4M3)
        return PD_EINVAL;
    size_t bytes = (n ? n : 1) * pd_dtype_size(dtype);
    bytes = (bytes + 63) & ~(size_t)63;
    void *p = NULL;
    if (posix_memalign(&p, 64, bytes) != 0) return PD_ENOMEM;
    memset(p, 0, bytes);
    *out = p;
    return 0;
}

static void cpu_free(void *ctx, void *buf)
{
    (void)ctx;
    free(buf);
}

static int cpu_upload(void *ctx, void *dst, pd_dtype dst_type, size_t dst_off, const void *src,
                      pd_dtype src_type, size_t n)
{
    (void)ctx;
    if (dst_type == PD_DTYPE_I32) {
        if (src_type != PD_DTYPE_I32) return PD_EINVAL;
        memcpy((int32_t *)dst + dst_off, src, n * sizeof(int32_t));
        return 0;
    }
    if (dst_type != PD_DTYPE_F32) return PD_EINVAL;
    pd_convert_to_f32((float *)dst + dst_off, src, src_type, n);
    return 0;
}

static int cpu_download_f32(void *ctx, float *dst, const void *src, pd_dtype src_type,
                            size_t src_off, size_t n)
{
    (void)ctx;
    if (src_type == PD_DTYPE_F32) memcpy(dst, (const float *)src + src_off, n * sizeof(float));
    else if (src_type == PD_DTYPE_I32) pd_convert_to_f32(dst, (const int32_t *)src + src_off, src_type, n);
    else return PD_EINVAL;
    return 0;
}

static uint64_t splitmix64(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static int cpu_fill_uniform(void *ctx, void *dst, pd_dtype dtype, size_t n, uint64_t seed,
                            float lo, float hi)
{
    (void)ctx;
    if (dtype != PD_DTYPE_F32) return PD_EINVAL;
    float *d = dst;
    uint64_t s = seed;
    const float scale = (hi - lo) / 16777216.0f; /* 24-bit mantissa draws */
    const float top = nextafterf(hi, lo); /* lo + u * scale can round up to hi: keep [lo, hi) */
    for (size_t i = 0; i < n; i += 2) {
        uint64_t r = splitmix64(&s);
        d[i] = fminf(lo + (float)(r & 0xffffff) * scale, top);
        if (i + 1 < n) d[i + 1] = fminf(lo + (float)((r >> 32) & 0xffffff) * scale, top);
    }
    return 0;
}

static int cpu_sync(void *ctx)
{
    (void)ctx;
    return 0;
}

static int cpu_embedding(void *ctx, const int32_t *ids, int32_t n, const void *table, int32_t dim,
                         void *out)
{
    (void)ctx;
    const float *t = table;
    float *o = out;
    for (int32_t i = 0; i < n; i++)
        memcpy(o + (size_t)i * dim, t + (size_t)ids[i] * dim, (size_t)dim * sizeof(float));
    return 0;
}

static void rmsnorm_row(const float *x, const float *w, int32_t dim, float eps, float *out)
{
    double ss = 0;
    for (int32_t j = 0; j < dim; j++) ss += (double)x[j] * x[j];
    float r = (float)(1.0 / sqrt(ss / dim + eps));
    for (int32_t j = 0; j < dim; j++) out[j] = w[j] * (x[j] * r);
}

int pd_cpu__rmsnorm(void *ctx, const void *x, void *residual, const void *w, int32_t n,
                    int32_t dim, float eps, void *out)
{
    (void)ctx;
    const float *xf = x;
    float *rf = residual, *of = out;
    for (int32_t i = 0; i < n; i++) {
        const float *xi = xf + (size_t)i * dim;
        float *oi = of + (size_t)i * dim;
        if (rf) {
            float *ri = rf + (size_t)i * dim;
            for (int32_t j = 0; j < dim; j++) ri[j] += xi[j];
            rmsnorm_row(ri, w, dim, eps, oi);
        } else {
            rmsnorm_row(xi, w, dim, eps, oi);
        }
    }
    return 0;
}

static int cpu_head_rmsnorm(void *ctx, void *x, int32_t n, int64_t row_stride, int32_t n_heads,
                            int32_t head_dim, const void *w, float eps)
{
    (void)ctx;
    float *xf = x;
    for (int32_t i = 0; i < n; i++)
        for (int32_t h = 0; h < n_heads; h++) {
            float *v = xf + (size_t)i * row_stride + (size_t)h * head_dim;
            rmsnorm_row(v, w, head_dim, eps, v);
        }
    return 0;
}

/* out = x . w^T + beta out (+ bias): [n][k] x [m][k] -> [n][m]. */
static void product(const float *x, const float *w, const float *bias, int32_t n, int32_t k,
                    int32_t m, float beta, float *o)
{
    if (n == 1)
        cblas_sgemv(CblasRowMajor, CblasNoTrans, m, k, 1.0f, w, k, x, 1, beta, o, 1);
    else
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, m, k, 1.0f, x, k, w, k, beta, o, m);
    if (bias)
        for (int32_t i = 0; i < n; i++)
            for (int32_t j = 0; j < m; j++) o[(size_t)i * m + j] += bias[j];
}

static int cpu_linear(void *ctx, const void *x, const void *w, const void *bias, int32_t n,
                      int32_t k, int32_t m, void *out)
{
    (void)ctx;
    product(x, w, bias, n, k, m, 0.0f, out);
    return 0;
}

static int cpu_swiglu(void *ctx, const void *gate_up, int32_t n, int32_t f, void *out);

/* The fused linear composed: the norm into tmp_x, the product (sgemm with beta 1 when it
 * accumulates), the bias, SwiGLU out of tmp_out. */
int pd_cpu__linear_fused(void *ctx, const pd_linear_args *a)
{
    if (!a || a->n < 0 || a->k <= 0 || a->m <= 0 || !a->x || !a->w || !a->out ||
        (a->norm_w && !a->tmp_x) || (a->swiglu && (!a->tmp_out || a->accumulate)))
        return PD_EINVAL;
    if (a->n == 0) return 0;
    const int32_t n = a->n, k = a->k, mw = a->swiglu ? 2 * a->m : a->m;
    const float *x = a->x;
    if (a->norm_w) {
        (void)pd_cpu__rmsnorm(ctx, x, NULL, a->norm_w, n, k, a->norm_eps, a->tmp_x);
        x = a->tmp_x;
    }
    product(x, a->w, a->bias, n, k, mw, a->accumulate ? 1.0f : 0.0f,
            a->swiglu ? a->tmp_out : a->out);
    if (a->swiglu) (void)cpu_swiglu(ctx, a->tmp_out, n, a->m, a->out);
    return 0;
}

static void rotate(float *v, const float *cs, const float *sn, int32_t half)
{
    for (int32_t i = 0; i < half; i++) {
        float x1 = v[i], x2 = v[i + half];
        v[i] = x1 * cs[i] - x2 * sn[i];
        v[i + half] = x2 * cs[i] + x1 * sn[i];
    }
}

int pd_cpu__rope_store(void *ctx, const pd_rope_args *a, bool fp8)
{
    const int32_t hd = a->head_dim, half = hd / 2;
    const int64_t row = (int64_t)(a->n_heads + 2 * a->n_kv_heads) * hd;
    if (a->q_norm) {
        if (!a->k_norm) return PD_EINVAL;
        int rc = cpu_head_rmsnorm(ctx, a->qkv, a->n_tokens, row, a->n_heads, hd, a->q_norm,
                                  a->norm_eps);
        if (rc == 0)
            rc = cpu_head_rmsnorm(ctx, (float *)a->qkv + (size_t)a->n_heads * hd, a->n_tokens,
                                  row, a->n_kv_heads, hd, a->k_norm, a->norm_eps);
        if (rc < 0) return rc;
    }
    const int64_t kv_row = (int64_t)a->n_kv_heads * hd;
    float cs[512], sn[512];
    if (half > 512) return PD_EUNSUPPORTED;
    float *qkv = a->qkv;
    for (int32_t t = 0; t < a->n_tokens; t++) {
        /* Angles in fp32 as transformers computes them, cos/sin rounded once. */
        float pos = (float)a->positions[t];
        for (int32_t i = 0; i < half; i++) {
            float ang = pos * a->inv_freq[i];
            cs[i] = (float)cos((double)ang) * a->attn_factor;
            sn[i] = (float)sin((double)ang) * a->attn_factor;
        }
        float *q = qkv + (size_t)t * row;
        float *k = q + (size_t)a->n_heads * hd;
        float *v = k + kv_row;
        for (int32_t h = 0; h < a->n_heads; h++) rotate(q + (size_t)h * hd, cs, sn, half);
        for (int32_t h = 0; h < a->n_kv_heads; h++) rotate(k + (size_t)h * hd, cs, sn, half);
        int32_t slot = a->slot_mapping[t];
        if (slot < 0) continue;
        if (fp8) { /* e4m3(k / k_scale), e4m3(v / v_scale) */
            uint8_t *kc = (uint8_t *)a->k_cache + (size_t)slot * kv_row;
            uint8_t *vc = (uint8_t *)a->v_cache + (size_t)slot * kv_row;
            for (int64_t j = 0; j < kv_row; j++) {
                kc[j] = pd_f32_to_e4m3(k[j] / a->k_scale);
                vc[j] = pd_f32_to_e4m3(v[j] / a->v_scale);
            }
            continue;
        }
        memcpy((float *)a->k_cache + (size_t)slot * kv_row, k, (size_t)kv_row * sizeof(float));
        memcpy((float *)a->v_cache + (size_t)slot * kv_row, v, (size_t)kv_row * sizeof(float));
    }
    return 0;
}

static int cpu_rope_store_kv(void *ctx, const pd_rope_args *a)
{
    return pd_cpu__rope_store(ctx, a, false);
}

static int cpu_swiglu(void *ctx, const void *gate_up, int32_t n, int32_t f, void *out)
{
    (void)ctx;
    const float *gu = gate_up;
    float *o = out;
    for (int32_t i = 0; i < n; i++) {
        const float *g = gu + (size_t)i * 2 * f, *u = g + f;
        float *oi = o + (size_t)i * f;
        for (int32_t j = 0; j < f; j++) oi[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
    }
    return 0;
}

static int cpu_gather_rows(void *ctx, const void *x, const int32_t *idx, int32_t n_idx,
                           int32_t dim, void *out)
{
    (void)ctx;
    for (int32_t i = 0; i < n_idx; i++)
        memcpy((float *)out + (size_t)i * dim, (const float *)x + (size_t)idx[i] * dim,
               (size_t)dim * sizeof(float));
    return 0;
}

static int cpu_kv_to_host(void *ctx, const void *cache, const int32_t *ids, int32_t n,
                          size_t block_elems, float *host)
{
    (void)ctx;
    for (int32_t i = 0; i < n; i++)
        memcpy(host + (size_t)i * block_elems, (const float *)cache + (size_t)ids[i] * block_elems,
               block_elems * sizeof(float));
    return 0;
}

static int cpu_kv_from_host(void *ctx, void *cache, const int32_t *ids, int32_t n,
                            size_t block_elems, const float *host)
{
    (void)ctx;
    for (int32_t i = 0; i < n; i++)
        memcpy((float *)cache + (size_t)ids[i] * block_elems, host + (size_t)i * block_elems,
               block_elems * sizeof(float));
    return 0;
}

static int cpu_kv_copy(void *ctx, void *cache, const int32_t *ids, int32_t n, size_t block_bytes,
                       void *host, bool to_host)
{
    (void)ctx;
    if (n < 0 || (n > 0 && (!cache || !ids || !host || block_bytes == 0))) return PD_EINVAL;
    for (int32_t i = 0; i < n; i++)
        if (ids[i] < 0) return PD_EINVAL;
    for (int32_t i = 0; i < n; i++) {
        uint8_t *c = (uint8_t *)cache + (size_t)ids[i] * block_bytes;
        uint8_t *h = (uint8_t *)host + (size_t)ids[i] * block_bytes;
        if (c == h) continue; /* the mirror is the cache itself */
        if (to_host) memcpy(h, c, block_bytes);
        else memcpy(c, h, block_bytes);
    }
    return 0;
}

static int cpu_kv_clone(void *ctx, void *pool, size_t region_bytes, int32_t n_regions,
                        const int32_t *src, const int32_t *dst, int32_t n, size_t block_bytes)
{
    (void)ctx;
    if (n < 0 || n_regions < 0 ||
        (n > 0 && (!pool || !src || !dst || block_bytes == 0 || region_bytes < block_bytes)))
        return PD_EINVAL;
    const size_t per_region = region_bytes / (block_bytes ? block_bytes : 1);
    for (int32_t i = 0; i < n; i++) {
        if (src[i] < 0 || dst[i] < 0 || (size_t)src[i] >= per_region ||
            (size_t)dst[i] >= per_region)
            return PD_EINVAL;
        for (int32_t j = 0; j < n; j++)
            if (dst[i] == src[j]) return PD_EINVAL;
    }
    for (int32_t r = 0; r < n_regions; r++) {
        uint8_t *base = (uint8_t *)pool + (size_t)r * region_bytes;
        for (int32_t i = 0; i < n; i++)
            memcpy(base + (size_t)dst[i] * block_bytes, base + (size_t)src[i] * block_bytes,
                   block_bytes);
    }
    return 0;
}

static int cpu_host_register(void *ctx, void *p, size_t bytes)
{
    (void)ctx;
    (void)p;
    (void)bytes;
    return 0;
}

static int cpu_host_unregister(void *ctx, void *p)
{
    (void)ctx;
    (void)p;
    return 0;
}

/* The copy queue and events (staged KV transfer, PDSERVE_KV_STAGING=1 in tests): every op
 * of this backend completes before it returns, so a copy is a memcpy done at once and every
 * event has already happened (one static handle stands for all of them). */
static char g_cpu_done;

static int cpu_event_record(void *ctx, void **ev)
{
    (void)ctx;
    *ev = &g_cpu_done;
    return 0;
}

static int cpu_event_query(void *ctx, void *ev)
{
    (void)ctx;
    return ev == &g_cpu_done ? 1 : PD_EINVAL;
}

static void cpu_event_release(void *ctx, void *ev)
{
    (void)ctx;
    (void)ev;
}

static int cpu_copyq_create(void *ctx, void **q)
{
    (void)ctx;
    *q = &g_cpu_done;
    return 0;
}

static void cpu_copyq_destroy(void *ctx, void *q)
{
    (void)ctx;
    (void)q;
}

static int cpu_copyq_blocks(void *ctx, void *q, void *after, void *const *dst,
                            const void *const *src, int32_t n_regions, const int32_t *dst_ids,
                            const int32_t *src_ids, int32_t n, size_t block_bytes, void **done)
{
    (void)ctx;
    (void)after;
    if (!q || !done || n < 0 || n_regions < 1 || block_bytes == 0) return PD_EINVAL;
    for (int32_t r = 0; r < n_regions; r++)
        for (int32_t i = 0; i < n; i++) {
            if (dst_ids[i] < 0 || src_ids[i] < 0) return PD_EINVAL;
            memcpy((char *)dst[r] + (size_t)dst_ids[i] * block_bytes,
                   (const char *)src[r] + (size_t)src_ids[i] * block_bytes, block_bytes);
        }
    *done = &g_cpu_done;
    return 0;
}

/* The rows of pd_copy_rows, done at once (the reference for the CUDA kernel). */
static int cpu_copyq_rows(void *ctx, void *q, void *after, const pd_copy_rows *a, void **done)
{
    (void)ctx;
    (void)after;
    if (!q || !done || !pd_copy_rows_valid(a)) return PD_EINVAL;
    for (int32_t i = 0; i < a->n; i++)
        if (a->dst_ids[i] < 0 || a->src_ids[i] < 0) return PD_EINVAL;
    for (int32_t i = 0; i < a->n; i++) {
        char *d = (char *)a->dst + (size_t)a->dst_ids[i] * a->dst_block_bytes + a->dst_offset;
        const char *s = (const char *)a->src + (size_t)a->src_ids[i] * a->src_block_bytes +
                        a->src_offset;
        for (size_t t = 0; t < a->rows; t++)
            memcpy(d + t * a->dst_pitch, s + t * a->src_pitch, a->row_bytes);
    }
    *done = &g_cpu_done;
    return 0;
}

/* The ranks are threads of this process: the communicator needs only their number. */
static int cpu_comm_create(pd_backend *const *ranks, int32_t n_ranks, pd_comm **out, char *err)
{
    (void)ranks;
    return pd_comm_cpu_create(n_ranks, out, err);
}

static const pd_backend_ops k_cpu_ops = {
    .name = "cpu",
    .act_dtype = PD_DTYPE_F32,
    .destroy = cpu_destroy,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .upload = cpu_upload,
    .download_f32 = cpu_download_f32,
    .fill_uniform = cpu_fill_uniform,
    .sync = cpu_sync,
    .embedding = cpu_embedding,
    .rmsnorm = pd_cpu__rmsnorm,
    .head_rmsnorm = cpu_head_rmsnorm,
    .linear = cpu_linear,
    .rope_store_kv = cpu_rope_store_kv,
    .attention_prefill = pd_cpu__attention,
    .attention_decode = pd_cpu__attention,
    .swiglu = cpu_swiglu,
    .linear_fused = pd_cpu__linear_fused,
    .gather_rows = cpu_gather_rows,
    .moe_route = pd_cpu__moe_route,
    .moe_combine = pd_cpu__moe_combine,
    .moe_experts = pd_cpu__moe_experts,
    .kv_blocks_to_host = cpu_kv_to_host,
    .kv_blocks_from_host = cpu_kv_from_host,
    .kv_blocks_copy = cpu_kv_copy,
    .kv_blocks_clone = cpu_kv_clone,
    .host_register = cpu_host_register,
    .host_unregister = cpu_host_unregister,
    .event_record = cpu_event_record,
    .event_query = cpu_event_query,
    .event_release = cpu_event_release,
    .copyq_create = cpu_copyq_create,
    .copyq_destroy = cpu_copyq_destroy,
    .copyq_blocks = cpu_copyq_blocks,
    .copyq_rows = cpu_copyq_rows,
    .comm_create = cpu_comm_create,
    .fp8 = &pd_cpu__fp8_ops,
    .kv_fp8 = &pd_cpu__kv_fp8_ops,
};

int pd_backend_cpu_create(const pd_backend_params *p, pd_backend **out, char *err)
{
    *out = NULL;
    pd_backend *b = calloc(1, sizeof *b);
    pd_cpu_ctx *c = calloc(1, sizeof *c);
    if (!b || !c) {
        free(b);
        free(c);
        return pd_errf(err, PD_ENOMEM, "out of memory creating the cpu backend");
    }
    c->n_threads = p ? p->n_threads : 0;
    if (c->n_threads > 0) openblas_set_num_threads(c->n_threads);
    b->ops = &k_cpu_ops;
    b->ctx = c;
    *out = b;
    return 0;
}
