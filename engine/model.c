/* model.c -- Weight loading: maps HuggingFace tensor names onto pd_model's fused layout,
 * checking every shape, and uploads (converting) into backend memory. */
#include "engine/model.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/error.h"
#include "common/log.h"
#include "engine/safetensors.h"

typedef struct {
    const pd_model *m;
    const st_model *st;       /* NULL for dummy weights */
    uint64_t seed;
    char *err;
} loader;

static int alloc_w(pd_model *m, size_t n, void **out, char *err)
{
    int rc = m->be->ops->alloc(m->be->ctx, m->be->ops->act_dtype, n, out);
    if (rc < 0) return pd_errf(err, rc, "cannot allocate %zu weight elements on the %s backend",
                               n, m->be->ops->name);
    m->n_params += (int64_t)n;
    m->weight_bytes += (int64_t)(n * pd_dtype_size(m->be->ops->act_dtype));
    return 0;
}

/* A window of a tensor: rows [r0, r0 + nr) and columns [c0, c0 + nc) of the rows x cols
 * tensor (cols 0: a vector, c0 = 0 and nc = 0), the part a shard holds. */
typedef struct {
    int64_t r0, nr, c0, nc;
} window;

static window whole(int64_t rows, int64_t cols) { return (window){0, rows, 0, cols}; }

/* Copies the window w of tensor `name` (expected shape rows x cols; cols = 0 for a vector)
 * into dst at row offset row_off (rows of w.nc elements), or fills those rows randomly for
 * dummy weights (around `center`; a part of a split tensor from a stream of its own). */
static int put_part(pd_model *m, const loader *L, const char *name, int64_t rows, int64_t cols,
                    window w, void *dst, int64_t row_off, float center)
{
    const int64_t width = cols ? w.nc : 1;
    const size_t n = (size_t)(w.nr * width);
    pd_backend *be = m->be;
    const bool part = w.nr != rows || (cols && w.nc != cols);
    if (!L->st) {
        /* Dummy: a different stream per tensor, derived from its name (and for a part of a
         * split tensor from the part); replicated tensors are the same on every rank. */
        uint64_t h = L->seed ^ 0xcbf29ce484222325ull;
        for (const char *p = name; *p; p++) h = (h ^ (uint8_t)*p) * 0x100000001b3ull;
        if (part) h = (h ^ (uint64_t)(w.r0 * 131 + w.c0 + 1)) * 0x100000001b3ull;
        char *base = (char *)dst + (size_t)(row_off * width) * pd_dtype_size(be->ops->act_dtype);
        int rc = be->ops->fill_uniform(be->ctx, base, be->ops->act_dtype, n, h, center - 0.02f,
                                       center + 0.02f);
        return rc < 0 ? pd_errf(L->err, rc, "cannot fill dummy tensor %s", name) : 0;
    }
    const st_tensor *t = st_find(L->st, name);
    if (!t) return pd_errf(L->err, PD_EFORMAT, "tensor %s is missing from the checkpoint", name);
    bool ok = cols ? (t->n_dims == 2 && t->shape[0] == rows && t->shape[1] == cols)
                   : (t->n_dims == 1 && t->shape[0] == rows);
    if (!ok) {
        char got[128] = "", *p = got;
        for (int i = 0; i < t->n_dims && p < got + sizeof got - 24; i++)
            p += sprintf(p, "%s%lld", i ? ", " : "", (long long)t->shape[i]);
        if (cols)
            return pd_errf(L->err, PD_EFORMAT, "tensor %s in %s has shape [%s], expected [%lld, %lld]",
                           name, t->file, got, (long long)rows, (long long)cols);
        return pd_errf(L->err, PD_EFORMAT, "tensor %s in %s has shape [%s], expected [%lld]", name,
                       t->file, got, (long long)rows);
    }
    if (t->dtype == PD_DTYPE_F8E4M3)
        return pd_errf(L->err, PD_EFORMAT, "tensor %s in %s is F8_E4M3, but %s", name, t->file,
                       m->cfg.quant.method == MC_QUANT_NONE
                           ? "config.json has no quantization_config (FP8 needs its scales)"
                           : "the quantization_config leaves it unquantized (ignore list)");
    const size_t es = pd_dtype_size(t->dtype), full = (size_t)(cols ? cols : 1);
    const char *src = (const char *)t->data + (size_t)w.r0 * full * es + (size_t)w.c0 * es;
    void *tmp = NULL;
    if (cols && w.nc != cols) { /* a column window: gather its rows into one upload */
        tmp = malloc(n * es);
        if (!tmp) return pd_errf(L->err, PD_ENOMEM, "out of memory");
        for (int64_t i = 0; i < w.nr; i++)
            memcpy((char *)tmp + (size_t)i * (size_t)w.nc * es, src + (size_t)i * full * es,
                   (size_t)w.nc * es);
        src = tmp;
    }
    int rc = be->ops->upload(be->ctx, dst, be->ops->act_dtype, (size_t)(row_off * width), src,
                             t->dtype, n);
    free(tmp);
    if (rc < 0) return pd_errf(L->err, rc, "cannot upload tensor %s to the %s backend", name,
                               be->ops->name);
    return 0;
}

/* A whole tensor. */
static int put(pd_model *m, const loader *L, const char *name, int64_t rows, int64_t cols,
               void *dst, int64_t row_off, float center)
{
    return put_part(m, L, name, rows, cols, whole(rows, cols), dst, row_off, center);
}

/* ---- quantized linears (docs/quantization.md) ---- */

/* One part of a fused linear: its module ("model.layers.3.self_attn.q_proj"), its whole
 * shape, and the window of it this shard holds. */
typedef struct {
    char module[160];
    int64_t rows, cols;
    window w;
} lin_part;

static uint64_t splitmix(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* A one-element or n-element scale tensor of any float dtype, as f32 into out[n] (one element
 * is repeated). Every value must be finite and > 0. */
static int read_scales(const loader *L, const char *name, int64_t n_want, bool one_ok, float *out,
                       int64_t n_out_max)
{
    const st_tensor *t = st_find(L->st, name);
    if (!t) return pd_errf(L->err, PD_EFORMAT, "tensor %s is missing from the checkpoint", name);
    if (t->dtype != PD_DTYPE_F32 && t->dtype != PD_DTYPE_BF16 && t->dtype != PD_DTYPE_F16)
        return pd_errf(L->err, PD_EFORMAT, "tensor %s in %s has dtype %s (a scale is F32, BF16 "
                       "or F16)", name, t->file, pd_dtype_name(t->dtype));
    if (t->n_elems != n_want && !(one_ok && t->n_elems == 1))
        return pd_errf(L->err, PD_EFORMAT, "tensor %s in %s has %lld elements, expected %lld%s",
                       name, t->file, (long long)t->n_elems, (long long)n_want,
                       one_ok ? " or 1" : "");
    if (t->n_elems > n_out_max) return pd_errf(L->err, PD_EFORMAT, "tensor %s: too many", name);
    pd_convert_to_f32(out, t->data, t->dtype, (size_t)t->n_elems);
    for (int64_t i = 0; i < t->n_elems; i++)
        if (!(out[i] > 0) || !isfinite(out[i]))
            return pd_errf(L->err, PD_EFORMAT, "tensor %s in %s: element %lld is %g (scales "
                           "must be finite and > 0)", name, t->file, (long long)i, out[i]);
    for (int64_t i = t->n_elems; i < n_want && t->n_elems == 1; i++) out[i] = out[0];
    return 0;
}

/* Dummy FP8 weights: n random e4m3 codes (never a NaN code) into w8, chunk c of DUMMY_CHUNK
 * bytes from a stream of its own (seed, c), so the bytes do not depend on how many threads
 * write them. Threads: one thread took minutes for a 70B model (docs/perf-history.md,
 * "Llama-3-70B, FP8 vs bf16 on 4 GPUs"). */
#define DUMMY_CHUNK ((int64_t)1 << 22)
typedef struct {
    uint8_t *w8;
    int64_t n;
    uint64_t seed;
    int32_t t, n_threads;
} dummy_job;

static void dummy_chunk(uint8_t *w8, int64_t n, uint64_t seed, int64_t c)
{
    uint64_t st = seed ^ ((uint64_t)(c + 1) * 0x9e3779b97f4a7c15ull);
    const int64_t i0 = c * DUMMY_CHUNK, i1 = i0 + DUMMY_CHUNK < n ? i0 + DUMMY_CHUNK : n;
    for (int64_t i = i0; i < i1; i += 8) {
        uint64_t v = splitmix(&st);
        for (int64_t b = 0; b < 8 && i + b < i1; b++, v >>= 8) {
            uint8_t code = (uint8_t)v;
            w8[i + b] = (code & 0x7f) == 0x7f ? (uint8_t)(code - 1) : code;
        }
    }
}

static void *dummy_thread(void *arg)
{
    const dummy_job *j = arg;
    const int64_t n_chunks = (j->n + DUMMY_CHUNK - 1) / DUMMY_CHUNK;
    for (int64_t c = j->t; c < n_chunks; c += j->n_threads) dummy_chunk(j->w8, j->n, j->seed, c);
    return NULL;
}

static void dummy_e4m3(uint8_t *w8, int64_t n, uint64_t seed)
{
    enum { MAX_THREADS = 32 };
    if (n <= 0) return;
    const int64_t n_chunks = (n + DUMMY_CHUNK - 1) / DUMMY_CHUNK;
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    int32_t n_threads = (int32_t)(cpus < 1 ? 1 : cpus > MAX_THREADS ? MAX_THREADS : cpus);
    if (n_threads > n_chunks) n_threads = (int32_t)n_chunks;
    pthread_t th[MAX_THREADS];
    dummy_job jobs[MAX_THREADS];
    int32_t started = 0;
    for (int32_t t = 1; t < n_threads; t++) { /* thread 0's chunks: this one */
        jobs[t] = (dummy_job){.w8 = w8, .n = n, .seed = seed, .t = t, .n_threads = n_threads};
        if (pthread_create(&th[t], NULL, dummy_thread, &jobs[t]) != 0) break;
        started = t;
    }
    /* chunks of threads that did not start are done here */
    for (int32_t t = started + 1; t < n_threads; t++) {
        jobs[t] = (dummy_job){.w8 = w8, .n = n, .seed = seed, .t = t, .n_threads = n_threads};
        dummy_thread(&jobs[t]);
    }
    jobs[0] = (dummy_job){.w8 = w8, .n = n, .seed = seed, .t = 0, .n_threads = n_threads};
    dummy_thread(&jobs[0]);
    for (int32_t t = 1; t <= started; t++) pthread_join(th[t], NULL);
}

/* Part p's rows of the fused matrix: e4m3 bytes into w8 (rows of K), scales into scale (rows of
 * G groups of `group` columns: K per channel, 128 block-wise), the static input scale into
 * *in_scale. */
static int quant_part(pd_model *m, const loader *L, const lin_part *pt, int32_t group, int32_t K,
                      int32_t G, uint8_t *w8, float *scale, float *in_scale)
{
    const mc_quant *q = &m->cfg.quant;
    const window w = pt->w;
    const int64_t nr = w.nr, nc = w.nc;
    char name[200];
    if (!L->st) { /* dummy: random e4m3 bytes (no NaN code) and scales of 0.02 / 448 */
        uint64_t st = L->seed ^ 0x51ed270b27ull;
        for (const char *c = pt->module; *c; c++) st = (st ^ (uint8_t)*c) * 0x100000001b3ull;
        st ^= (uint64_t)(w.r0 * 131 + w.c0 + 1);
        dummy_e4m3(w8, nr * nc, st);
        for (int64_t i = 0; i < nr * G; i++) scale[i] = 0.02f / PD_FP8_MAX;
        *in_scale = 1.0f;
        return 0;
    }
    snprintf(name, sizeof name, "%s.weight", pt->module);
    const st_tensor *t = st_find(L->st, name);
    if (!t) return pd_errf(L->err, PD_EFORMAT, "tensor %s is missing from the checkpoint", name);
    if (t->n_dims != 2 || t->shape[0] != pt->rows || t->shape[1] != pt->cols)
        return pd_errf(L->err, PD_EFORMAT, "tensor %s in %s has not the shape [%lld, %lld]", name,
                       t->file, (long long)pt->rows, (long long)pt->cols);
    if (q->method == MC_QUANT_FP8_AT_LOAD) {
        /* per output channel over the whole row (every shard of a row the same scale) */
        if (t->dtype == PD_DTYPE_F8E4M3)
            return pd_errf(L->err, PD_EFORMAT, "tensor %s is already F8_E4M3", name);
        float *row = malloc((size_t)pt->cols * sizeof *row);
        if (!row) return pd_errf(L->err, PD_ENOMEM, "out of memory");
        const size_t es = pd_dtype_size(t->dtype);
        for (int64_t i = 0; i < nr; i++) {
            pd_convert_to_f32(row, (const char *)t->data + (size_t)((w.r0 + i) * pt->cols) * es,
                              t->dtype, (size_t)pt->cols);
            float amax = 0;
            for (int64_t j = 0; j < pt->cols; j++) amax = fmaxf(amax, fabsf(row[j]));
            float s = amax / PD_FP8_MAX;
            if (!(s >= PD_FP8_MIN_SCALE)) s = PD_FP8_MIN_SCALE;
            for (int64_t j = 0; j < nc; j++)
                w8[i * K + j] = pd_f32_to_e4m3(row[w.c0 + j] / s);
            scale[i * G] = s;
        }
        free(row);
        *in_scale = 1.0f;
        return 0;
    }
    if (t->dtype != PD_DTYPE_F8E4M3)
        return pd_errf(L->err, PD_EFORMAT, "tensor %s in %s is %s, but the %s quantization_config "
                       "says it is FP8 (F8_E4M3)", name, t->file, pd_dtype_name(t->dtype), q->name);
    for (int64_t i = 0; i < nr; i++)
        memcpy(w8 + i * K, (const uint8_t *)t->data + (w.r0 + i) * pt->cols + w.c0, (size_t)nc);
    const bool inv = q->method == MC_QUANT_FP8_BLOCK;
    snprintf(name, sizeof name, "%s.%s", pt->module, inv ? "weight_scale_inv" : "weight_scale");
    int rc;
    if (q->weight_group) { /* block-wise (group is then the block size, 128) */
        const int64_t br = (pt->rows + 127) / 128, bc = (pt->cols + 127) / 128;
        float *bs = malloc((size_t)(br * bc) * sizeof *bs);
        if (!bs) return pd_errf(L->err, PD_ENOMEM, "out of memory");
        if ((rc = read_scales(L, name, br * bc, false, bs, br * bc)) < 0) {
            free(bs);
            return rc;
        }
        for (int64_t i = 0; i < nr; i++)
            for (int32_t g = 0; g < G; g++)
                scale[i * G + g] = bs[(w.r0 + i) / 128 * bc + (w.c0 + (int64_t)g * 128) / 128];
        free(bs);
    } else {
        float *cs = malloc((size_t)pt->rows * sizeof *cs);
        if (!cs) return pd_errf(L->err, PD_ENOMEM, "out of memory");
        rc = read_scales(L, name, q->weight_per_tensor ? 1 : pt->rows, !q->weight_per_tensor, cs,
                         pt->rows);
        if (rc == 0 && q->weight_per_tensor)
            for (int64_t i = 1; i < pt->rows; i++) cs[i] = cs[0];
        for (int64_t i = 0; rc == 0 && i < nr; i++) scale[i * G] = cs[w.r0 + i];
        free(cs);
        if (rc < 0) return rc;
    }
    *in_scale = 1.0f;
    if (q->act == PD_ACT_STATIC) {
        snprintf(name, sizeof name, "%s.input_scale", pt->module);
        if ((rc = read_scales(L, name, 1, true, in_scale, 1)) < 0) return rc;
    }
    return 0;
}

/* A linear made of n_parts stacked along its rows (q, k, v; gate, up; experts > 0: that many
 * experts' rows for moe_experts, pd_qweight_desc.experts), this shard's windows: into *dst
 * either act_dtype rows as put_part writes them (*ops NULL; into the buffer *dst already
 * points to when it is not NULL, else a new one), or one quantized weight of the backend's op
 * set (*ops). The parts are quantized alike or not at all. */
static int put_linear_x(pd_model *m, const loader *L, const lin_part *parts, int n_parts,
                        int32_t experts, void **dst, const pd_wq_ops **ops)
{
    const mc_quant *q = &m->cfg.quant;
    const bool quant = !mc_quant_ignored(q, parts[0].module);
    int64_t M = 0;
    const int64_t K = parts[0].w.nc;
    int rc;
    for (int i = 0; i < n_parts; i++) {
        if (!mc_quant_ignored(q, parts[i].module) != quant)
            return pd_errf(L->err, PD_EUNSUPPORTED, "%s and %s are fused, but the %s "
                           "quantization_config quantizes one of them only", parts[0].module,
                           parts[i].module, q->name);
        M += parts[i].w.nr;
    }
    *ops = NULL;
    if (!quant) {
        if (!*dst && (rc = alloc_w(m, (size_t)(M * K), dst, L->err)) < 0) return rc;
        char name[200];
        for (int i = 0, off = 0; i < n_parts; off += (int)parts[i].w.nr, i++) {
            snprintf(name, sizeof name, "%s.weight", parts[i].module);
            if ((rc = put_part(m, L, name, parts[i].rows, parts[i].cols, parts[i].w, *dst, off,
                               0)) < 0)
                return rc;
        }
        return 0;
    }
    const pd_wq_ops *fp8 = m->be->ops->fp8;
    if (!fp8)
        return pd_errf(L->err, PD_EUNSUPPORTED, "the %s backend has no FP8 weight ops (the "
                       "checkpoint is %s FP8)", m->be->ops->name, q->name);
    const int32_t group = q->weight_group ? q->weight_group : (int32_t)K;
    const int32_t G = (int32_t)((K + group - 1) / group);
    /* block-wise: each group of 128 of this shard's columns (its activations' groups) must lie
     * in one of the checkpoint's 128-column blocks */
    for (int64_t g0 = 0, c0 = parts[0].w.c0; q->weight_group && g0 < K; g0 += group) {
        const int64_t g1 = g0 + group < K ? g0 + group : K;
        if ((c0 + g0) / group != (c0 + g1 - 1) / group)
            return pd_errf(L->err, PD_EUNSUPPORTED, "%s: this shard's columns %lld .. %lld are "
                           "not on a block of %d of the checkpoint's (a tensor-parallel degree "
                           "whose column split misses the blocks)", parts[0].module,
                           (long long)(c0 + g0), (long long)(c0 + g1 - 1), group);
    }
    uint8_t *w8 = malloc((size_t)(M * K));
    float *scale = malloc((size_t)(M * G) * sizeof *scale);
    if (!w8 || !scale) {
        free(w8);
        free(scale);
        return pd_errf(L->err, PD_ENOMEM, "out of memory");
    }
    float in_scale = 0;
    int64_t off = 0;
    rc = 0;
    for (int i = 0; i < n_parts && rc == 0; off += parts[i].w.nr, i++) {
        float s = 1.0f;
        rc = quant_part(m, L, &parts[i], group, (int32_t)K, G, w8 + off * K, scale + off * G, &s);
        in_scale = fmaxf(in_scale, s); /* fused parts share their input: the largest scale */
    }
    if (rc == 0) {
        const pd_qweight_desc d = {.w8 = w8, .scale = scale, .m = (int32_t)M, .k = (int32_t)K,
                                   .group = group, .act = q->act, .in_scale = in_scale,
                                   .experts = experts};
        rc = fp8->weight_create(m->be->ctx, &d, dst);
        if (rc < 0) {
            pd_errf(L->err, rc, "%s backend: cannot make the FP8 weight of %s [%lld x %lld]",
                    m->be->ops->name, parts[0].module, (long long)M, (long long)K);
        } else {
            *ops = fp8;
            m->quantized = true;
            m->n_params += M * K;
            m->weight_bytes += (int64_t)fp8->weight_bytes(m->be->ctx, *dst);
        }
    }
    free(w8);
    free(scale);
    return rc;
}

static int put_linear(pd_model *m, const loader *L, const lin_part *parts, int n_parts,
                      void **dst, const pd_wq_ops **ops)
{
    return put_linear_x(m, L, parts, n_parts, 0, dst, ops);
}

/* An FP8 KV cache's scale of layer li (kv_cache_scheme: self_attn.k_scale / v_scale), else 1. */
static int kv_scale(const pd_model *m, const loader *L, int32_t li, const char *which, float *out)
{
    *out = 1.0f;
    if (!L->st || !m->cfg.quant.kv_scales) return 0;
    char name[160];
    snprintf(name, sizeof name, "model.layers.%d.self_attn.%s", li, which);
    return read_scales(L, name, 1, true, out, 1);
}

int pd_shard_of(const mc_config *c, int32_t rank, int32_t n_ranks, pd_shard *out, char *err)
{
    memset(out, 0, sizeof *out);
    if (n_ranks < 1 || rank < 0 || rank >= n_ranks)
        return pd_errf(err, PD_EINVAL, "tensor parallel: rank %d of %d", rank, n_ranks);
    if (c->n_heads % n_ranks != 0)
        return pd_errf(err, PD_EINVAL, "tensor parallel %d: the model's %d attention heads do "
                       "not divide among %d ranks", n_ranks, c->n_heads, n_ranks);
    if (c->n_kv_heads % n_ranks != 0 && n_ranks % c->n_kv_heads != 0)
        return pd_errf(err, PD_EINVAL, "tensor parallel %d: the model's %d KV heads neither "
                       "divide among %d ranks nor divide them (for replication)", n_ranks,
                       c->n_kv_heads, n_ranks);
    if (c->intermediate_size % n_ranks != 0)
        return pd_errf(err, PD_EINVAL, "tensor parallel %d: the model's intermediate size %d "
                       "does not divide among %d ranks", n_ranks, c->intermediate_size, n_ranks);
    if (c->n_experts > 0 && c->moe_intermediate % n_ranks != 0)
        return pd_errf(err, PD_EINVAL, "tensor parallel %d: the model's expert intermediate "
                       "size %d does not divide among %d ranks", n_ranks, c->moe_intermediate,
                       n_ranks);
    out->rank = rank;
    out->n_ranks = n_ranks;
    out->n_heads = c->n_heads / n_ranks;
    out->q_head0 = rank * out->n_heads;
    if (c->n_kv_heads >= n_ranks) {
        out->n_kv_heads = c->n_kv_heads / n_ranks;
        out->kv_head0 = rank * out->n_kv_heads;
    } else { /* replicated: n_ranks / n_kv_heads ranks share each KV head */
        out->n_kv_heads = 1;
        out->kv_head0 = rank / (n_ranks / c->n_kv_heads);
    }
    out->intermediate = c->intermediate_size / n_ranks;
    out->ff0 = rank * out->intermediate;
    out->moe_intermediate = c->n_experts > 0 ? c->moe_intermediate / n_ranks : 0;
    out->moe_ff0 = rank * out->moe_intermediate;
    return 0;
}

/* A sparse layer's router (whole) and experts (this shard's columns of each), under the
 * published checkpoints' names: Qwen3-MoE's mlp.gate and mlp.experts.E.{gate,up,down}_proj,
 * Mixtral's block_sparse_moe.gate and block_sparse_moe.experts.E.{w1,w3,w2}. */
/* Quantized experts as two weights of the FP8 op set (pd_wq_ops.moe_experts): every expert's
 * gate and up rows stacked, [n_experts * 2 inter][hidden], and the down rows, [n_experts *
 * hidden][inter], this shard's columns. */
static int load_experts_stacked(pd_model *m, const loader *L, int32_t li, const char *blk,
                                const char *const *proj, pd_layer_weights *w, char *err)
{
    const mc_config *c = &m->cfg;
    const int64_t h = c->hidden_size, f = c->moe_intermediate, nx = c->n_experts;
    const window wf = {m->shard.moe_ff0, m->shard.moe_intermediate, 0, h};
    lin_part *pp = calloc((size_t)(3 * nx), sizeof *pp);
    if (!pp) return pd_errf(err, PD_ENOMEM, "out of memory");
    for (int64_t e = 0; e < nx; e++) {
        lin_part *part[3] = {&pp[2 * e], &pp[2 * e + 1], &pp[2 * nx + e]};
        for (int i = 0; i < 3; i++) {
            *part[i] = i < 2 ? (lin_part){.rows = f, .cols = h, .w = wf}
                             : (lin_part){.rows = h, .cols = f, .w = {0, h, wf.r0, wf.nr}};
            snprintf(part[i]->module, sizeof part[i]->module, "model.layers.%d.%s.experts.%d.%s",
                     li, blk, (int)e, proj[i]);
        }
    }
    const pd_wq_ops *down_ops = NULL;
    int rc = put_linear_x(m, L, pp, (int)(2 * nx), (int32_t)nx, &w->experts_gate_up,
                          &w->experts_ops);
    if (rc == 0)
        rc = put_linear_x(m, L, pp + 2 * nx, (int)nx, (int32_t)nx, &w->experts_down, &down_ops);
    free(pp);
    if (rc == 0 && (!w->experts_ops || down_ops != w->experts_ops))
        rc = pd_errf(err, PD_EUNSUPPORTED, "layer %d: the experts' gate/up and down projections "
                     "are quantized differently", li);
    return rc;
}

static int load_experts(pd_model *m, const loader *L, int32_t li, pd_layer_weights *w, char *err)
{
    static const char *const k_proj[2][3] = {{"gate_proj", "up_proj", "down_proj"},
                                             {"w1", "w3", "w2"}};
    const mc_config *c = &m->cfg;
    const int mixtral = c->arch == MC_ARCH_MIXTRAL;
    const char *blk = mixtral ? "block_sparse_moe" : "mlp";
    const int64_t h = c->hidden_size, f = c->moe_intermediate;
    const window wf = {m->shard.moe_ff0, m->shard.moe_intermediate, 0, h};
    char name[256];
    int rc;
    snprintf(name, sizeof name, "model.layers.%d.%s.gate.weight", li, blk);
    if ((rc = alloc_w(m, (size_t)c->n_experts * (size_t)h, &w->router, err)) < 0 ||
        (rc = put(m, L, name, c->n_experts, h, w->router, 0, 0)) < 0)
        return rc;
    w->experts = calloc((size_t)c->n_experts, sizeof *w->experts);
    if (!w->experts) return pd_errf(err, PD_ENOMEM, "out of memory");
    /* Unquantized experts go into one buffer each for gate_up and down (the backend's
     * moe_experts runs them all in one op). Quantized ones go into one weight each, stacked
     * the same way, where the op set has a moe_experts of its own and their input rows are
     * quantized alike (static activations have a scale an expert); else each linear is its
     * own weight, run expert by expert. */
    int n_ignored = 0;
    for (int32_t e = 0; e < c->n_experts; e++)
        for (int i = 0; i < 3; i++) {
            snprintf(name, sizeof name, "model.layers.%d.%s.experts.%d.%s", li, blk, e,
                     k_proj[mixtral][i]);
            n_ignored += mc_quant_ignored(&c->quant, name);
        }
    const bool slab = n_ignored == 3 * c->n_experts;
    const pd_wq_ops *fp8 = m->be->ops->fp8;
    if (n_ignored == 0 && fp8 && fp8->moe_experts && c->quant.act != PD_ACT_STATIC)
        return load_experts_stacked(m, L, li, blk, k_proj[mixtral], w, err);
    const size_t fl = (size_t)m->shard.moe_intermediate;
    const size_t es = pd_dtype_size(m->be->ops->act_dtype), nx = (size_t)c->n_experts;
    if (slab && ((rc = alloc_w(m, nx * 2 * fl * (size_t)h, &w->experts_gate_up, err)) < 0 ||
                 (rc = alloc_w(m, nx * (size_t)h * fl, &w->experts_down, err)) < 0))
        return rc;
    for (int32_t e = 0; e < c->n_experts; e++) {
        pd_expert *x = &w->experts[e];
        lin_part gu[2] = {{.rows = f, .cols = h, .w = wf}, {.rows = f, .cols = h, .w = wf}};
        lin_part dn = {.rows = h, .cols = f, .w = {0, h, wf.r0, wf.nr}};
        lin_part *parts[3] = {&gu[0], &gu[1], &dn};
        for (int i = 0; i < 3; i++)
            snprintf(parts[i]->module, sizeof parts[i]->module, "model.layers.%d.%s.experts.%d.%s",
                     li, blk, e, k_proj[mixtral][i]);
        if (slab) {
            x->gate_up = (char *)w->experts_gate_up + (size_t)e * 2 * fl * (size_t)h * es;
            x->down = (char *)w->experts_down + (size_t)e * (size_t)h * fl * es;
        }
        if ((rc = put_linear(m, L, gu, 2, &x->gate_up, &x->gate_up_ops)) < 0 ||
            (rc = put_linear(m, L, &dn, 1, &x->down, &x->down_ops)) < 0)
            return rc;
    }
    return 0;
}

static int load_layer(pd_model *m, const loader *L, int32_t li, char *err)
{
    const mc_config *c = &m->cfg;
    const pd_shard *sh = &m->shard;
    pd_layer_weights *w = &m->layers[li];
    const int64_t h = c->hidden_size, hd = c->head_dim, f = c->intermediate_size;
    const int64_t nq = (int64_t)c->n_heads * hd, nkv = (int64_t)c->n_kv_heads * hd;
    /* this rank's rows of q, k and v, and columns of the MLP */
    const int64_t q0 = (int64_t)sh->q_head0 * hd, nql = (int64_t)sh->n_heads * hd;
    const int64_t k0 = (int64_t)sh->kv_head0 * hd, nkl = (int64_t)sh->n_kv_heads * hd;
    const int64_t f0 = sh->ff0, fl = sh->intermediate;
    const window wq = {q0, nql, 0, h}, wk = {k0, nkl, 0, h}, wf = {f0, fl, 0, h};
    const window bq = {q0, nql, 0, 0}, bk = {k0, nkl, 0, 0};
    char name[256];
    int rc;
#define NAME(suffix) (snprintf(name, sizeof name, "model.layers.%d." suffix, li), name)
    if ((rc = alloc_w(m, (size_t)h, &w->attn_norm, err)) < 0 ||
        (rc = put(m, L, NAME("input_layernorm.weight"), h, 0, w->attn_norm, 0, 1.0f)) < 0)
        return rc;
    lin_part qkv[3] = {{.rows = nq, .cols = h, .w = wq}, {.rows = nkv, .cols = h, .w = wk},
                       {.rows = nkv, .cols = h, .w = wk}};
    snprintf(qkv[0].module, sizeof qkv[0].module, "model.layers.%d.self_attn.q_proj", li);
    snprintf(qkv[1].module, sizeof qkv[1].module, "model.layers.%d.self_attn.k_proj", li);
    snprintf(qkv[2].module, sizeof qkv[2].module, "model.layers.%d.self_attn.v_proj", li);
    if ((rc = put_linear(m, L, qkv, 3, &w->qkv, &w->qkv_ops)) < 0 ||
        (rc = kv_scale(m, L, li, "k_scale", &w->k_scale)) < 0 ||
        (rc = kv_scale(m, L, li, "v_scale", &w->v_scale)) < 0)
        return rc;
    if (c->qkv_bias) {
        if ((rc = alloc_w(m, (size_t)(nql + 2 * nkl), &w->qkv_bias, err)) < 0 ||
            (rc = put_part(m, L, NAME("self_attn.q_proj.bias"), nq, 0, bq, w->qkv_bias, 0, 0)) < 0 ||
            (rc = put_part(m, L, NAME("self_attn.k_proj.bias"), nkv, 0, bk, w->qkv_bias, nql, 0)) < 0 ||
            (rc = put_part(m, L, NAME("self_attn.v_proj.bias"), nkv, 0, bk, w->qkv_bias, nql + nkl,
                           0)) < 0)
            return rc;
    }
    if (c->qk_norm) {
        if ((rc = alloc_w(m, (size_t)hd, &w->q_norm, err)) < 0 ||
            (rc = put(m, L, NAME("self_attn.q_norm.weight"), hd, 0, w->q_norm, 0, 1.0f)) < 0 ||
            (rc = alloc_w(m, (size_t)hd, &w->k_norm, err)) < 0 ||
            (rc = put(m, L, NAME("self_attn.k_norm.weight"), hd, 0, w->k_norm, 0, 1.0f)) < 0)
            return rc;
    }
    lin_part o = {.rows = h, .cols = nq, .w = {0, h, q0, nql}};
    snprintf(o.module, sizeof o.module, "model.layers.%d.self_attn.o_proj", li);
    if ((rc = put_linear(m, L, &o, 1, &w->o_proj, &w->o_ops)) < 0) return rc;
    if (c->o_bias && sh->rank == 0) { /* the sum of the ranks' products adds it once */
        if ((rc = alloc_w(m, (size_t)h, &w->o_bias, err)) < 0 ||
            (rc = put(m, L, NAME("self_attn.o_proj.bias"), h, 0, w->o_bias, 0, 0)) < 0)
            return rc;
    }
    if ((rc = alloc_w(m, (size_t)h, &w->mlp_norm, err)) < 0 ||
        (rc = put(m, L, NAME("post_attention_layernorm.weight"), h, 0, w->mlp_norm, 0, 1.0f)) < 0)
        return rc;
    if (mc_layer_sparse(c, li)) return load_experts(m, L, li, w, err);
    lin_part gu[2] = {{.rows = f, .cols = h, .w = wf}, {.rows = f, .cols = h, .w = wf}};
    lin_part dn = {.rows = h, .cols = f, .w = {0, h, f0, fl}};
    snprintf(gu[0].module, sizeof gu[0].module, "model.layers.%d.mlp.gate_proj", li);
    snprintf(gu[1].module, sizeof gu[1].module, "model.layers.%d.mlp.up_proj", li);
    snprintf(dn.module, sizeof dn.module, "model.layers.%d.mlp.down_proj", li);
    if ((rc = put_linear(m, L, gu, 2, &w->gate_up, &w->gate_up_ops)) < 0 ||
        (rc = put_linear(m, L, &dn, 1, &w->down, &w->down_ops)) < 0)
        return rc;
#undef NAME
    return 0;
}

int pd_model_load(const mc_config *cfg, const char *dir, pd_load_format fmt, uint64_t seed,
                  pd_backend *be, pd_model **out, char *err)
{
    return pd_model_load_shard(cfg, dir, fmt, seed, be, 0, 1, out, err);
}

int pd_model_load_shard(const mc_config *cfg, const char *dir, pd_load_format fmt, uint64_t seed,
                        pd_backend *be, int32_t rank, int32_t n_ranks, pd_model **out,
                        char *err)
{
    *out = NULL;
    int rc;
    st_model *st = NULL;
    pd_shard shard;
    if ((rc = pd_shard_of(cfg, rank, n_ranks, &shard, err)) < 0) return rc;
    if (cfg->n_experts > 0 && (!be->ops->moe_route || !be->ops->moe_combine))
        return pd_errf(err, PD_EUNSUPPORTED, "%s is a mixture-of-experts model, and the %s "
                       "backend has no mixture-of-experts ops (moe_route, moe_combine) yet: "
                       "run it on --backend cpu", cfg->arch_name, be->ops->name);
    pd_model *m = calloc(1, sizeof *m);
    if (!m) return pd_errf(err, PD_ENOMEM, "out of memory");
    m->cfg = *cfg;
    m->shard = shard;
    m->be = be;
    m->layers = calloc((size_t)cfg->n_layers, sizeof *m->layers);
    if (!m->layers) {
        rc = pd_errf(err, PD_ENOMEM, "out of memory");
        goto fail;
    }
    if (fmt == PD_LOAD_SAFETENSORS && (rc = st_open(dir, &st, err)) < 0) goto fail;
    loader L = {.m = m, .st = st, .seed = seed, .err = err};
    const int64_t h = cfg->hidden_size, v = cfg->vocab_size;
    if ((rc = alloc_w(m, (size_t)(v * h), &m->embed, err)) < 0 ||
        (rc = put(m, &L, "model.embed_tokens.weight", v, h, m->embed, 0, 0)) < 0)
        goto fail;
    for (int32_t i = 0; i < cfg->n_layers; i++)
        if ((rc = load_layer(m, &L, i, err)) < 0) goto fail;
    if ((rc = alloc_w(m, (size_t)h, &m->final_norm, err)) < 0 ||
        (rc = put(m, &L, "model.norm.weight", h, 0, m->final_norm, 0, 1.0f)) < 0)
        goto fail;
    m->head_row0 = 0;
    m->head_rows = (int32_t)v;
    if (cfg->tie_word_embeddings) {
        m->lm_head = m->embed;
    } else if (n_ranks > 1 && v % n_ranks == 0) {
        /* split by vocabulary rows: each rank makes its part of every row's logits and the
         * parts are gathered (docs/tensor-parallel.md) */
        m->head_rows = (int32_t)(v / n_ranks);
        m->head_row0 = rank * m->head_rows;
        const window wh = {m->head_row0, m->head_rows, 0, h};
        if ((rc = alloc_w(m, (size_t)m->head_rows * (size_t)h, &m->lm_head, err)) < 0 ||
            (rc = put_part(m, &L, "lm_head.weight", v, h, wh, m->lm_head, 0, 0)) < 0)
            goto fail;
    } else if (rank > 0) {
        m->lm_head = NULL; /* rank 0 computes the logits */
    } else if ((rc = alloc_w(m, (size_t)(v * h), &m->lm_head, err)) < 0 ||
               (rc = put(m, &L, "lm_head.weight", v, h, m->lm_head, 0, 0)) < 0) {
        goto fail;
    }
    st_close(st);
    *out = m;
    return 0;
fail:
    st_close(st);
    pd_model_destroy(m);
    return rc;
}

void pd_model_destroy(pd_model *m)
{
    if (!m) return;
    pd_backend *be = m->be;
#define FREE(p) be->ops->free(be->ctx, (p))
    if (m->layers) {
        for (int32_t i = 0; i < m->cfg.n_layers; i++) {
            pd_layer_weights *w = &m->layers[i];
#define WFREE(p, ops) ((ops) ? (ops)->weight_destroy(be->ctx, (p)) : FREE(p))
            FREE(w->attn_norm); WFREE(w->qkv, w->qkv_ops); FREE(w->qkv_bias); FREE(w->q_norm);
            FREE(w->k_norm); WFREE(w->o_proj, w->o_ops); FREE(w->o_bias); FREE(w->mlp_norm);
            WFREE(w->gate_up, w->gate_up_ops); WFREE(w->down, w->down_ops);
            FREE(w->router);
            for (int32_t e = 0; w->experts && !w->experts_gate_up && e < m->cfg.n_experts; e++) {
                WFREE(w->experts[e].gate_up, w->experts[e].gate_up_ops);
                WFREE(w->experts[e].down, w->experts[e].down_ops);
            }
            WFREE(w->experts_gate_up, w->experts_ops);
            WFREE(w->experts_down, w->experts_ops);
            free(w->experts);
#undef WFREE
        }
        free(m->layers);
    }
    if (m->lm_head && m->lm_head != m->embed) FREE(m->lm_head);
    FREE(m->embed);
    FREE(m->final_norm);
#undef FREE
    free(m);
}
