/* test_cuda_kv_fp8.c -- The CUDA backend's FP8 KV-cache op set (pd_backend_ops.kv_fp8) against
 * the CPU backend's (the oracle, kernels/cpu/cpu_fp8.c). rope_store_kv must store the same
 * e4m3 bytes as the CPU from the same bf16-representable inputs; the attention ops, run on the
 * same cache bytes (copied across), must agree within bf16 tolerance, on every decode kernel
 * (the tensor-core one and the CUDA-core ones behind PDSERVE_CUDA_DECODE_MMA / _STAGES), the
 * tensor-core prefill and the general kernel, inside a CUDA graph too; and the FP8 cache's
 * attention must stay within a stated bound of the bf16 cache's on the same keys and values.
 * Exits 77 (skipped) when the CUDA backend is not built in or no device is present. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/dtype.h"
#include "common/error.h"
#include "kernels/backend.h"
#include "tests/test_util.h"
#define PD_TEST_SEED 0x452821e638d01377ull
#include "tests/test_rand.h"

#define TOL_BF16 1e-2  /* relative L2 error of an attention output rounded to bf16 */
/* FP8 against bf16 keys and values (per-tensor scales max|x| / 448): the e4m3 rounding (3
 * mantissa bits, a relative step of 1/16) gives about 3.3% relative L2 error on these data in
 * an f64 simulation, at every context from 1 to 9000 keys; the bound leaves room for bf16. */
#define TOL_FP8_VS_BF16 5e-2

static pd_backend *g_cpu, *g_gpu;

/* n values of magnitude [0.1, 1) * amp with random signs, rounded to bf16. */
static float *hrand(size_t n, double amp)
{
    float *x = xmalloc(n * sizeof *x);
    for (size_t i = 0; i < n; i++) {
        const double m = (0.1 + 0.9 * urand()) * amp;
        x[i] = bf16_round((float)(urand() < 0.5 ? -m : m));
    }
    return x;
}

static void *alloc_on(pd_backend *be, pd_dtype t, size_t n)
{
    void *b = NULL;
    const int rc = be->ops->alloc(be->ctx, t, n, &b);
    if (rc != 0 || !b) {
        fprintf(stderr, "alloc of %zu elements of %s on %s failed: %d\n", n, pd_dtype_name(t),
                be->ops->name, rc);
        abort();
    }
    return b;
}

/* A buffer on both backends: f32 (or I32) on the CPU, bf16 (or I32) on the GPU, same values. */
typedef struct {
    void *c, *g;
    size_t n;
} pair;

static pair pair_f(const float *host, size_t n)
{
    pair p = {alloc_on(g_cpu, PD_DTYPE_F32, n), alloc_on(g_gpu, PD_DTYPE_BF16, n), n};
    CHECK_EQ_INT(g_cpu->ops->upload(g_cpu->ctx, p.c, PD_DTYPE_F32, 0, host, PD_DTYPE_F32, n), 0);
    CHECK_EQ_INT(g_gpu->ops->upload(g_gpu->ctx, p.g, PD_DTYPE_BF16, 0, host, PD_DTYPE_F32, n), 0);
    return p;
}

static pair pair_f32(const float *host, size_t n) /* f32 on both (inv_freq) */
{
    pair p = {alloc_on(g_cpu, PD_DTYPE_F32, n), alloc_on(g_gpu, PD_DTYPE_F32, n), n};
    CHECK_EQ_INT(g_cpu->ops->upload(g_cpu->ctx, p.c, PD_DTYPE_F32, 0, host, PD_DTYPE_F32, n), 0);
    CHECK_EQ_INT(g_gpu->ops->upload(g_gpu->ctx, p.g, PD_DTYPE_F32, 0, host, PD_DTYPE_F32, n), 0);
    return p;
}

static pair pair_i32(const int32_t *host, size_t n)
{
    pair p = {alloc_on(g_cpu, PD_DTYPE_I32, n), alloc_on(g_gpu, PD_DTYPE_I32, n), n};
    CHECK_EQ_INT(g_cpu->ops->upload(g_cpu->ctx, p.c, PD_DTYPE_I32, 0, host, PD_DTYPE_I32, n), 0);
    CHECK_EQ_INT(g_gpu->ops->upload(g_gpu->ctx, p.g, PD_DTYPE_I32, 0, host, PD_DTYPE_I32, n), 0);
    return p;
}

/* An FP8 cache of n bytes on both, holding bytes (NULL: the zeros alloc gives). The CPU
 * backend's buffers are host memory; the GPU's take raw e4m3 bytes through upload. */
static pair pair_fp8(const uint8_t *bytes, size_t n)
{
    pair p = {alloc_on(g_cpu, PD_DTYPE_F8E4M3, n), alloc_on(g_gpu, PD_DTYPE_F8E4M3, n), n};
    if (bytes) {
        memcpy(p.c, bytes, n);
        CHECK_EQ_INT(g_gpu->ops->upload(g_gpu->ctx, p.g, PD_DTYPE_F8E4M3, 0, bytes,
                                        PD_DTYPE_F8E4M3, n), 0);
    }
    return p;
}

static void pair_free(pair *p)
{
    g_cpu->ops->free(g_cpu->ctx, p->c);
    g_gpu->ops->free(g_gpu->ctx, p->g);
}

static int sync_both(void)
{
    const int rc = g_gpu->ops->sync(g_gpu->ctx);
    return rc < 0 ? rc : g_cpu->ops->sync(g_cpu->ctx);
}

/* The GPU's FP8 cache bytes, raw (kv_blocks_copy: one block of all of them). */
static uint8_t *gpu_bytes(const pair *p)
{
    uint8_t *h = xmalloc(p->n);
    const int32_t id0 = 0;
    CHECK_EQ_INT(g_gpu->ops->kv_blocks_copy(g_gpu->ctx, p->g, &id0, 1, p->n, h, true), 0);
    return h;
}

/* Relative L2 error of got against ref (n values), printed; NaN anywhere fails. */
static double rel_l2(const char *what, const float *got, const float *ref, size_t n, double tol)
{
    double num = 0, den = 0, max_abs = 0;
    size_t nan = 0;
    for (size_t i = 0; i < n; i++) {
        if (isnan(got[i]) || isnan(ref[i])) {
            nan++;
            continue;
        }
        const double d = (double)got[i] - ref[i];
        num += d * d;
        den += (double)ref[i] * ref[i];
        if (fabs(d) > max_abs) max_abs = fabs(d);
    }
    const double rel = den > 0 ? sqrt(num / den) : sqrt(num);
    printf("  %-58s n=%-8zu rel_l2 %.2e max_abs %.2e (tol %.0e)\n", what, n, rel, max_abs, tol);
    CHECK_MSG(nan == 0, "%s: %zu NaN values", what, nan);
    CHECK_MSG(rel <= tol, "%s: relative L2 error %.3g > %.3g (max abs %.3g)", what, rel, tol,
              max_abs);
    return rel;
}

/* Both backends' versions of a pair, as f32 host arrays (caller frees). */
static void pair_get(const pair *p, float **c, float **g)
{
    *c = xmalloc(p->n * sizeof(float));
    *g = xmalloc(p->n * sizeof(float));
    CHECK_EQ_INT(g_cpu->ops->download_f32(g_cpu->ctx, *c, p->c, PD_DTYPE_F32, 0, p->n), 0);
    CHECK_EQ_INT(g_gpu->ops->download_f32(g_gpu->ctx, *g, p->g, PD_DTYPE_BF16, 0, p->n), 0);
}

/* ---- rope_store_kv ---- */

typedef struct {
    int32_t n_heads, n_kv_heads, head_dim;
    bool norm;
} rope_shape;

/* n_tokens rows at positions up to 9000, every third row not stored (slot -1), the others to
 * scattered slots of a cache of n_slots; both backends' bytes must be equal. */
static void run_rope(const rope_shape *sh, int32_t n_tokens, float k_scale, float v_scale)
{
    const int32_t H = sh->n_heads, KVH = sh->n_kv_heads, HD = sh->head_dim;
    const int64_t row = (int64_t)(H + 2 * KVH) * HD;
    const int32_t n_slots = 2 * n_tokens + 7;
    float *qkv = hrand((size_t)n_tokens * row, 2.0), *inv = xmalloc((size_t)HD / 2 * sizeof *inv);
    float *qn = hrand((size_t)HD, 1.2), *kn = hrand((size_t)HD, 1.2);
    int32_t *pos = xmalloc((size_t)n_tokens * 4), *slot = xmalloc((size_t)n_tokens * 4);
    for (int32_t i = 0; i < HD / 2; i++) inv[i] = (float)pow(1e6, -2.0 * i / HD);
    for (int32_t t = 0; t < n_tokens; t++) {
        pos[t] = (int32_t)(urand() * 9000);
        slot[t] = t % 3 == 2 ? -1 : (int32_t)((t * 7 + 3) % n_slots);
    }
    /* distinct slots: t * 7 + 3 mod n_slots repeats only past n_slots / gcd tokens */
    const size_t cache = (size_t)n_slots * KVH * HD;
    pair pq = pair_f(qkv, (size_t)n_tokens * row), pinv = pair_f32(inv, (size_t)HD / 2);
    pair pqn = pair_f(qn, (size_t)HD), pkn = pair_f(kn, (size_t)HD);
    pair ppos = pair_i32(pos, (size_t)n_tokens), pslot = pair_i32(slot, (size_t)n_tokens);
    pair kc = pair_fp8(NULL, cache), vc = pair_fp8(NULL, cache);
    pd_rope_args a = {.n_tokens = n_tokens, .n_heads = H, .n_kv_heads = KVH, .head_dim = HD,
                      .attn_factor = 1.0f, .norm_eps = 1e-6f, .k_scale = k_scale,
                      .v_scale = v_scale};
    a.qkv = pq.c; a.positions = ppos.c; a.slot_mapping = pslot.c; a.inv_freq = pinv.c;
    a.k_cache = kc.c; a.v_cache = vc.c;
    a.q_norm = sh->norm ? pqn.c : NULL; a.k_norm = sh->norm ? pkn.c : NULL;
    CHECK_EQ_INT(g_cpu->ops->kv_fp8->rope_store_kv(g_cpu->ctx, &a), 0);
    a.qkv = pq.g; a.positions = ppos.g; a.slot_mapping = pslot.g; a.inv_freq = pinv.g;
    a.k_cache = kc.g; a.v_cache = vc.g;
    a.q_norm = sh->norm ? pqn.g : NULL; a.k_norm = sh->norm ? pkn.g : NULL;
    CHECK_EQ_INT(g_gpu->ops->kv_fp8->rope_store_kv(g_gpu->ctx, &a), 0);
    CHECK_EQ_INT(sync_both(), 0);

    char name[160];
    snprintf(name, sizeof name, "rope_store_kv H=%d/%d HD=%d norm=%d scales %g/%g", H, KVH, HD,
             sh->norm, k_scale, v_scale);
    const pair *caches[2] = {&kc, &vc};
    for (int w = 0; w < 2; w++) {
        uint8_t *g = gpu_bytes(caches[w]);
        const uint8_t *c = caches[w]->c;
        size_t bad = 0, first = 0, sat = 0;
        for (size_t i = 0; i < cache; i++) {
            if ((c[i] & 0x7f) == 0x7e) sat++;
            if (c[i] != g[i] && bad++ == 0) first = i;
        }
        printf("  %-58s %s bytes %zu, different %zu (saturated %zu)\n", name, w ? "v" : "k",
               cache, bad, sat);
        CHECK_MSG(bad == 0, "%s: %s cache: %zu of %zu bytes differ, first at %zu: cpu 0x%02x "
                  "gpu 0x%02x", name, w ? "v" : "k", bad, cache, first, c[first], g[first]);
        free(g);
    }
    /* q (rotated, normed) in the qkv rows: bf16 rounding apart */
    float *c, *g;
    pair_get(&pq, &c, &g);
    snprintf(name, sizeof name, "rope_store_kv qkv H=%d/%d HD=%d norm=%d", H, KVH, HD, sh->norm);
    rel_l2(name, g, c, pq.n, TOL_BF16);
    free(c); free(g);
    pair_free(&pq); pair_free(&pinv); pair_free(&pqn); pair_free(&pkn);
    pair_free(&ppos); pair_free(&pslot); pair_free(&kc); pair_free(&vc);
    free(qkv); free(inv); free(qn); free(kn); free(pos); free(slot);
}

static void test_rope(void)
{
    /* the warp kernel's head sizes (64, 128, 256), with and without Qwen3's head norm; the
     * block kernel's (80, 32), without (its norm is the bf16 head_rmsnorm op's) */
    const rope_shape shapes[] = {
        {16, 8, 128, false}, {16, 8, 128, true}, {8, 1, 64, false}, {8, 1, 64, true},
        {32, 4, 128, true},  {4, 4, 256, true},  {6, 2, 80, false}, {4, 2, 32, false},
    };
    /* the scales: 1 (values well inside e4m3), the usual (max |k| / 448), and small ones that
     * push values past 448 (saturation) and below 2^-6 (subnormals) */
    const float scales[3][2] = {{1.0f, 1.0f}, {0.0123f, 0.0071f}, {0.0013f, 0.37f}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (int k = 0; k < 3; k++) run_rope(&shapes[s], 61, scales[k][0], scales[k][1]);
    run_rope(&shapes[1], 1, 0.02f, 0.01f); /* a decode step */
}

/* ---- attention ---- */

typedef struct {
    int32_t n_heads, n_kv_heads, head_dim, block_size, window;
} attn_shape;

/* A batch's block tables over a shuffled pool (a block per block_size positions of each
 * context; rows of context 0 get none), its cache bytes (random e4m3 of k / k_scale and
 * v / v_scale for k, v in bf16 of amplitude 1.5 and 1), q, and both backends' outputs. mode:
 * 0 prefill (the n_decode hint set), 1 decode, 2 decode with the longest context unknown (as
 * in a graph), 3 the same captured in a graph and replayed. Returns the relative L2 error. */
static double run_attention(const char *what, const attn_shape *sh, int n_seqs,
                            const int32_t *q_lens, const int32_t *ctx_lens, int mode,
                            float k_scale, float v_scale)
{
    const int32_t H = sh->n_heads, KVH = sh->n_kv_heads, HD = sh->head_dim, BS = sh->block_size;
    int32_t n_tokens = 0, max_q = 0, max_ctx = 0, n_blocks = 3; /* 3 spare blocks */
    for (int s = 0; s < n_seqs; s++) {
        n_tokens += q_lens[s];
        if (q_lens[s] > max_q) max_q = q_lens[s];
        if (ctx_lens[s] > max_ctx) max_ctx = ctx_lens[s];
        n_blocks += (ctx_lens[s] + BS - 1) / BS;
    }
    const int32_t mbps = (max_ctx + BS - 1) / BS + 1;
    int32_t *perm = xmalloc((size_t)n_blocks * 4), *bt = xmalloc((size_t)n_seqs * mbps * 4);
    int32_t *cu = xmalloc((size_t)(n_seqs + 1) * 4);
    for (int i = 0; i < n_blocks; i++) perm[i] = i;
    for (int i = n_blocks - 1; i > 0; i--) {
        const int j = (int)(urand() * (i + 1));
        const int32_t t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    int next = 0;
    cu[0] = 0;
    for (int s = 0; s < n_seqs; s++) {
        cu[s + 1] = cu[s] + q_lens[s];
        const int need = (ctx_lens[s] + BS - 1) / BS;
        for (int b = 0; b < mbps; b++) bt[s * mbps + b] = b < need ? perm[next++] : -1;
    }
    const int64_t qstride = (int64_t)(H + 2 * KVH) * HD;
    const size_t cache = (size_t)n_blocks * BS * KVH * HD;
    uint8_t *kb = xmalloc(cache), *vb = xmalloc(cache);
    for (size_t i = 0; i < cache; i++) {
        const double km = (0.1 + 0.9 * urand()) * 1.5, vm = 0.1 + 0.9 * urand();
        kb[i] = pd_f32_to_e4m3(bf16_round((float)(urand() < 0.5 ? -km : km)) / k_scale);
        vb[i] = pd_f32_to_e4m3(bf16_round((float)(urand() < 0.5 ? -vm : vm)) / v_scale);
    }
    float *q = hrand((size_t)n_tokens * qstride, 1.5);
    pair pq = pair_f(q, (size_t)n_tokens * qstride), pk = pair_fp8(kb, cache);
    pair pv = pair_fp8(vb, cache);
    const size_t n_out = (size_t)n_tokens * H * HD;
    pair out = {alloc_on(g_cpu, PD_DTYPE_F32, n_out), alloc_on(g_gpu, PD_DTYPE_BF16, n_out), n_out};
    pair pcu = pair_i32(cu, (size_t)n_seqs + 1), pctx = pair_i32(ctx_lens, (size_t)n_seqs);
    pair pbt = pair_i32(bt, (size_t)n_seqs * mbps);
    {   /* the GPU's output poisoned with NaN (bf16 0x7fc0): an unwritten row fails */
        uint16_t *nan = xmalloc(out.n * 2);
        for (size_t i = 0; i < out.n; i++) nan[i] = 0x7fc0;
        CHECK_EQ_INT(g_gpu->ops->upload(g_gpu->ctx, out.g, PD_DTYPE_BF16, 0, nan, PD_DTYPE_BF16,
                                        out.n), 0);
        free(nan);
    }
    pd_attn_args a = {.q_row_stride = qstride, .n_seqs = n_seqs, .n_tokens = n_tokens,
                      .max_q_len = max_q, .max_ctx_len = mode >= 2 ? 0 : max_ctx,
                      .max_blocks_per_seq = mbps, .n_heads = H, .n_kv_heads = KVH,
                      .head_dim = HD, .block_size = BS, .sliding_window = sh->window,
                      .scale = (float)(1.0 / sqrt((double)HD)), .k_scale = k_scale,
                      .v_scale = v_scale};
    a.q = pq.c; a.k_cache = pk.c; a.v_cache = pv.c; a.out = out.c;
    a.cu_q = pcu.c; a.ctx_lens = pctx.c; a.block_tables = pbt.c;
    const pd_kv_ops *kc = g_cpu->ops->kv_fp8, *kg = g_gpu->ops->kv_fp8;
    CHECK_EQ_INT((mode ? kc->attention_decode : kc->attention_prefill)(g_cpu->ctx, &a), 0);
    a.q = pq.g; a.k_cache = pk.g; a.v_cache = pv.g; a.out = out.g;
    a.cu_q = pcu.g; a.ctx_lens = pctx.g; a.block_tables = pbt.g;
    if (mode == 0) /* the leading one-row sequences, as the model runner tells them */
        while (a.n_decode < n_seqs && q_lens[a.n_decode] == 1) a.n_decode++;
    if (mode == 3) {
        void *graph = NULL;
        CHECK_EQ_INT(g_gpu->ops->graph_begin(g_gpu->ctx), 0);
        CHECK_EQ_INT(kg->attention_decode(g_gpu->ctx, &a), 0);
        CHECK_EQ_INT(g_gpu->ops->graph_end(g_gpu->ctx, &graph), 0);
        CHECK_EQ_INT(g_gpu->ops->graph_launch(g_gpu->ctx, graph), 0);
        CHECK_EQ_INT(g_gpu->ops->sync(g_gpu->ctx), 0);
        g_gpu->ops->graph_destroy(g_gpu->ctx, graph);
    } else {
        CHECK_EQ_INT((mode ? kg->attention_decode : kg->attention_prefill)(g_gpu->ctx, &a), 0);
    }
    CHECK_EQ_INT(sync_both(), 0);
    char name[200];
    snprintf(name, sizeof name, "%s H=%d/%d HD=%d bs=%d win=%d", what, H, KVH, HD, BS,
             sh->window);
    float *c, *g;
    pair_get(&out, &c, &g);
    const double rel = rel_l2(name, g, c, out.n, TOL_BF16);
    free(c); free(g);
    pair_free(&pq); pair_free(&pk); pair_free(&pv); pair_free(&out);
    pair_free(&pcu); pair_free(&pctx); pair_free(&pbt);
    free(q); free(kb); free(vb); free(perm); free(bt); free(cu);
    return rel;
}

static const attn_shape k_shapes[] = {
    {16, 8, 128, 16, 0},   /* Qwen3-0.6B: 2 query heads per KV head */
    {8, 8, 64, 32, 0},     /* no GQA, block size 32 */
    {16, 4, 128, 32, 0},   /* 4 per KV head */
    {8, 1, 64, 16, 0},     /* 8 per KV head */
    {32, 4, 128, 16, 1000},/* 8 per KV head, sliding window */
    {8, 2, 64, 32, 100},   /* 4 per KV head, short window */
};
#define N_SHAPES (int)(sizeof k_shapes / sizeof k_shapes[0])

/* Decode batches on the backend in g_gpu: contexts 1 .. 9000 around the kernels' tiles, with
 * padding rows (context 0) when the longest context is not given. */
static void decode_cases(const char *kern)
{
    const int32_t dq[8] = {1, 1, 1, 1, 1, 1, 1, 1};
    const int32_t dc[8] = {1, 15, 16, 17, 300, 2900, 9000, 64};
    const int32_t pad[8] = {5, 0, 1000, 0, 9000, 0, 33, 0};
    char what[64];
    for (int s = 0; s < N_SHAPES; s++) {
        snprintf(what, sizeof what, "decode %s", kern);
        run_attention(what, &k_shapes[s], 8, dq, dc, 1, 0.0123f, 0.0071f);
        snprintf(what, sizeof what, "decode %s padding", kern);
        run_attention(what, &k_shapes[s], 8, dq, pad, 2, 0.0123f, 0.0071f);
    }
    /* one long sequence (many splits) and a batch of 64 */
    const int32_t lc[1] = {9000};
    snprintf(what, sizeof what, "decode %s long", kern);
    run_attention(what, &k_shapes[0], 1, dq, lc, 1, 0.005f, 0.003f);
    enum { NB = 64 };
    int32_t bq[NB], bc[NB];
    for (int s = 0; s < NB; s++) {
        bq[s] = 1;
        bc[s] = 8192 - 127 * s;
    }
    snprintf(what, sizeof what, "decode %s batch 64", kern);
    run_attention(what, &k_shapes[2], NB, bq, bc, 1, 0.0123f, 0.0071f);
}

/* Every decode kernel: the default backend's (the tensor-core one on sm_90), then backends
 * made with the other kernels switched on, as test_cuda_backend's test_decode_kernels does. */
static void test_decode(void)
{
    decode_cases("default");
    const int32_t dq[3] = {1, 1, 1}, dc[3] = {700, 0, 4000};
    run_attention("decode graph", &k_shapes[0], 3, dq, dc, 3, 0.0123f, 0.0071f);
    run_attention("decode graph", &k_shapes[4], 3, dq, dc, 3, 0.0123f, 0.0071f);
    /* the general kernel: more query heads per KV head than the split kernels take, and a
     * head size they do not */
    const attn_shape other[2] = {{32, 2, 128, 16, 0}, {12, 4, 80, 16, 0}};
    const int32_t oc[3] = {3, 250, 1100};
    for (int s = 0; s < 2; s++)
        run_attention("decode general", &other[s], 3, dq, oc, 1, 0.0123f, 0.0071f);

    static const char *const kern[][2] = {{"3", "2"}, {"4", "2"}, {"0", "0"}, {"0", "2"},
                                          {"0", "4"}};
    pd_backend *saved = g_gpu;
    for (size_t i = 0; i < sizeof kern / sizeof kern[0]; i++) {
        char err[PD_ERR_LEN] = "", name[64];
        pd_backend_params p = pd_backend_default_params();
        pd_backend *b = NULL;
        pd_env_set("PDSERVE_CUDA_DECODE_MMA", kern[i][0]);
        pd_env_set("PDSERVE_CUDA_DECODE_STAGES", kern[i][1]);
        const int rc = pd_backend_create("cuda", &p, &b, err);
        pd_env_set("PDSERVE_CUDA_DECODE_MMA", NULL);
        pd_env_set("PDSERVE_CUDA_DECODE_STAGES", NULL);
        CHECK_EQ_INT(rc, 0);
        if (rc != 0) continue;
        g_gpu = b;
        snprintf(name, sizeof name, "mma=%s stages=%s", kern[i][0], kern[i][1]);
        decode_cases(name);
        g_gpu = saved;
        pd_backend_destroy(b);
    }
}

static void test_prefill(void)
{
    /* a one-token prompt, a prompt of several tiles, chunks after cached prefixes (up to
     * 9000), a prompt one row past a tile, an exact tile */
    const int32_t q[6] = {1, 500, 33, 2, 129, 64}, c[6] = {1, 500, 100, 9000, 129, 101};
    for (int s = 0; s < N_SHAPES; s++)
        run_attention("prefill", &k_shapes[s], 6, q, c, 0, 0.0123f, 0.0071f);
    /* running decodes first (the decode kernel takes them), then prompts */
    const int32_t xq[5] = {1, 1, 1, 300, 70}, xc[5] = {700, 5, 2000, 300, 170};
    run_attention("prefill mixed", &k_shapes[0], 5, xq, xc, 0, 0.0123f, 0.0071f);
    run_attention("prefill mixed", &k_shapes[4], 5, xq, xc, 0, 0.0123f, 0.0071f);
    /* enough rows for the 128-row tiles: 36 sequences of 20 to 169 new tokens */
    enum { NM = 36 };
    int32_t mq[NM], mc[NM];
    for (int s = 0; s < NM; s++) {
        mq[s] = 20 + (s * 37) % 150;
        mc[s] = mq[s] + (s % 3 ? 0 : 11 * s);
    }
    run_attention("prefill many", &k_shapes[0], NM, mq, mc, 0, 1.0f / 64, 1.0f / 128);
    /* the general kernel: head sizes the tensor-core kernel does not take, 16 per KV head */
    const attn_shape other[3] = {{6, 2, 32, 16, 0}, {12, 4, 80, 32, 37}, {32, 2, 128, 16, 0}};
    const int32_t gq[3] = {45, 20, 1}, gc[3] = {45, 83, 9};
    for (int s = 0; s < 3; s++)
        run_attention("prefill general", &other[s], 3, gq, gc, 0, 0.0123f, 0.0071f);
}

/* ---- FP8 against bf16 ---- */

/* The same keys and values in a bf16 cache and (per-tensor scales max |x| / 448) an FP8 one
 * on the GPU, the same queries: the FP8 decode output within TOL_FP8_VS_BF16 of the bf16
 * one. */
static void test_fp8_vs_bf16(void)
{
    const attn_shape sh = {16, 8, 128, 16, 0};
    enum { NS = 4 };
    const int32_t ctx[NS] = {1, 300, 2900, 9000};
    int32_t n_blocks = 0, mbps = 0;
    for (int s = 0; s < NS; s++) {
        n_blocks += (ctx[s] + sh.block_size - 1) / sh.block_size;
        if ((ctx[s] + sh.block_size - 1) / sh.block_size > mbps)
            mbps = (ctx[s] + sh.block_size - 1) / sh.block_size;
    }
    int32_t *bt = xmalloc((size_t)NS * mbps * 4), cu[NS + 1] = {0, 1, 2, 3, 4}, next = 0;
    for (int s = 0; s < NS; s++)
        for (int b = 0; b < mbps; b++)
            bt[s * mbps + b] = b < (ctx[s] + sh.block_size - 1) / sh.block_size ? next++ : -1;
    const size_t cache = (size_t)n_blocks * sh.block_size * sh.n_kv_heads * sh.head_dim;
    const int64_t qstride = (int64_t)(sh.n_heads + 2 * sh.n_kv_heads) * sh.head_dim;
    float *k = hrand(cache, 1.5), *v = hrand(cache, 1.0), *q = hrand((size_t)NS * qstride, 1.5);
    float km = 0, vm = 0;
    for (size_t i = 0; i < cache; i++) {
        if (fabsf(k[i]) > km) km = fabsf(k[i]);
        if (fabsf(v[i]) > vm) vm = fabsf(v[i]);
    }
    const float ks = km / PD_FP8_MAX, vs = vm / PD_FP8_MAX;
    uint8_t *kb = xmalloc(cache), *vb = xmalloc(cache);
    for (size_t i = 0; i < cache; i++) {
        kb[i] = pd_f32_to_e4m3(k[i] / ks);
        vb[i] = pd_f32_to_e4m3(v[i] / vs);
    }
    pair pq = pair_f(q, (size_t)NS * qstride), pk = pair_f(k, cache), pv = pair_f(v, cache);
    pair k8 = pair_fp8(kb, cache), v8 = pair_fp8(vb, cache);
    pair pcu = pair_i32(cu, NS + 1), pctx = pair_i32(ctx, NS);
    pair pbt = pair_i32(bt, (size_t)NS * mbps);
    const size_t n_out = (size_t)NS * sh.n_heads * sh.head_dim;
    void *o16 = alloc_on(g_gpu, PD_DTYPE_BF16, n_out), *o8 = alloc_on(g_gpu, PD_DTYPE_BF16, n_out);
    pd_attn_args a = {.q = pq.g, .q_row_stride = qstride, .k_cache = pk.g, .v_cache = pv.g,
                      .out = o16, .cu_q = pcu.g, .ctx_lens = pctx.g, .block_tables = pbt.g,
                      .n_seqs = NS, .n_tokens = NS, .max_q_len = 1, .max_ctx_len = 9000,
                      .max_blocks_per_seq = mbps, .n_heads = sh.n_heads,
                      .n_kv_heads = sh.n_kv_heads, .head_dim = sh.head_dim,
                      .block_size = sh.block_size, .scale = (float)(1.0 / sqrt(128.0)),
                      .k_scale = ks, .v_scale = vs};
    CHECK_EQ_INT(g_gpu->ops->attention_decode(g_gpu->ctx, &a), 0);
    a.k_cache = k8.g;
    a.v_cache = v8.g;
    a.out = o8;
    CHECK_EQ_INT(g_gpu->ops->kv_fp8->attention_decode(g_gpu->ctx, &a), 0);
    float *r16 = xmalloc(n_out * sizeof(float)), *r8 = xmalloc(n_out * sizeof(float));
    CHECK_EQ_INT(g_gpu->ops->download_f32(g_gpu->ctx, r16, o16, PD_DTYPE_BF16, 0, n_out), 0);
    CHECK_EQ_INT(g_gpu->ops->download_f32(g_gpu->ctx, r8, o8, PD_DTYPE_BF16, 0, n_out), 0);
    for (int s = 0; s < NS; s++) {
        char name[96];
        const size_t per = (size_t)sh.n_heads * sh.head_dim;
        snprintf(name, sizeof name, "fp8 cache vs bf16 cache, decode ctx %d", ctx[s]);
        rel_l2(name, r8 + s * per, r16 + s * per, per, TOL_FP8_VS_BF16);
    }
    free(r16); free(r8);
    g_gpu->ops->free(g_gpu->ctx, o16);
    g_gpu->ops->free(g_gpu->ctx, o8);
    pair_free(&pq); pair_free(&pk); pair_free(&pv); pair_free(&k8); pair_free(&v8);
    pair_free(&pcu); pair_free(&pctx); pair_free(&pbt);
    free(k); free(v); free(q); free(kb); free(vb); free(bt);
}

/* Scales that are not positive and finite are refused, nothing queued. */
static void test_errors(void)
{
    const pd_kv_ops *kg = g_gpu->ops->kv_fp8;
    pd_attn_args a = {0};
    a.k_scale = 0.0f;
    a.v_scale = 1.0f;
    CHECK_EQ_INT(kg->attention_decode(g_gpu->ctx, &a), PD_EINVAL);
    CHECK_EQ_INT(kg->attention_prefill(g_gpu->ctx, &a), PD_EINVAL);
    pd_rope_args r = {0};
    r.k_scale = 1.0f;
    r.v_scale = -1.0f;
    CHECK_EQ_INT(kg->rope_store_kv(g_gpu->ctx, &r), PD_EINVAL);
    void *b = NULL;
    CHECK_EQ_INT(g_gpu->ops->alloc(g_gpu->ctx, PD_DTYPE_F8E4M3, 1000, &b), 0);
    g_gpu->ops->free(g_gpu->ctx, b);
}

int main(void)
{
    char err[PD_ERR_LEN] = "";
    pd_backend_params p = pd_backend_default_params();
    int rc = pd_backend_create("cuda", &p, &g_gpu, err);
    if (rc < 0) {
        fprintf(stderr, "test_cuda_kv_fp8: skipped: %s\n", err);
        return 77;
    }
    if (pd_backend_cpu_create(&p, &g_cpu, err) < 0) {
        fprintf(stderr, "cpu backend: %s\n", err);
        pd_backend_destroy(g_gpu);
        return 1;
    }
    CHECK(g_gpu->ops->kv_fp8 && g_cpu->ops->kv_fp8);
    if (!g_gpu->ops->kv_fp8 || !g_cpu->ops->kv_fp8) {
        pd_backend_destroy(g_cpu);
        pd_backend_destroy(g_gpu);
        return pd_test_result("test_cuda_kv_fp8");
    }
    CHECK_EQ_INT(g_gpu->ops->kv_fp8->dtype, PD_DTYPE_F8E4M3);
    printf("test_cuda_kv_fp8: the FP8 KV-cache ops on cuda against cpu\n");
    test_errors();
    test_rope();
    test_decode();
    test_prefill();
    test_fp8_vs_bf16();
    pd_backend_destroy(g_cpu);
    pd_backend_destroy(g_gpu);
    return pd_test_result("test_cuda_kv_fp8");
}
