/* test_kvdev.c -- The staged KV copies of tensor-parallel instances (svc/svc_kvdev.c)
 * on the CPU backend: the backend's strided copy (copyq_rows) driven by svc_kv_tp_rows gives
 * exactly kvt_tp_gather / kvt_tp_scatter for divided and replicated heads; a stories260k
 * instance at TP 2 and 4 stages a layer out of and into its ranks' caches as they say; and
 * in a forward's layer hook every rank's event of the layer is there (svc_kv_layer_ready,
 * one set shared by a step's requests) and orders a gather. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "svc/svc.h"
#include "tests/svc_tp_util.h"
#include "tests/test_util.h"

#define NB 9 /* blocks of a region in the op tests */

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;

static void fill_random(void *p, size_t n) { svc_tp_fill_random(p, n, &g_rng); }

/* kvt_tp_part_of on a replicated mapping: 2 KV heads on 8 ranks. */
static void test_part_of(void)
{
    kvt_layout l = {.dtype = PD_DTYPE_BF16, .n_layers = 1, .block_size = 4, .n_kv_heads = 2,
                    .head_dim = 8};
    kvt_tp_part p;
    CHECK_EQ_INT(kvt_tp_part_of(&l, 8, 5, &p), 0);
    CHECK_EQ_INT(p.head0, 1);
    CHECK_EQ_INT(p.n_heads, 1);
    CHECK(!p.gathered); /* rank 4 holds head 1 first */
    CHECK_EQ_INT((int)p.row_bytes, 16);
    CHECK_EQ_INT((int)p.whole_pitch, 32);
    CHECK_EQ_INT((int)p.whole_offset, 16);
    CHECK_EQ_INT((int)p.rank_block_bytes, 64);
    CHECK_EQ_INT((int)p.whole_block_bytes, 128);
    CHECK_EQ_INT(kvt_tp_part_of(&l, 8, 4, &p), 0);
    CHECK(p.gathered);
    CHECK_EQ_INT(kvt_tp_part_of(&l, 3, 0, &p), PD_EINVAL); /* 3 ranks, 2 heads */
    CHECK_EQ_INT(kvt_tp_part_of(&l, 8, 8, &p), PD_EINVAL);
}

/* One mapping: the CPU op over every rank against kvt_tp_gather / kvt_tp_scatter. */
static void check_mapping(pd_backend *be, void *q, pd_dtype dt, int32_t H, int32_t N, int32_t T,
                          int32_t hd)
{
    kvt_layout l = {.dtype = dt, .n_layers = 1, .block_size = T, .n_kv_heads = H, .head_dim = hd};
    const int32_t ids[5] = {7, 2, 5, 0, 8};
    const int32_t n = 5;
    const size_t whole = kvt_layout_block_bytes(&l);
    void *reg[8], *ref[8];
    size_t reg_bytes[8];
    for (int32_t r = 0; r < N; r++) {
        kvt_tp_part p;
        CHECK_EQ_INT(kvt_tp_part_of(&l, N, r, &p), 0);
        reg_bytes[r] = NB * p.rank_block_bytes;
        reg[r] = malloc(reg_bytes[r]);
        ref[r] = malloc(reg_bytes[r]);
        fill_random(reg[r], reg_bytes[r]);
        memcpy(ref[r], reg[r], reg_bytes[r]);
    }
    uint8_t *got = malloc(n * whole), *want = malloc(n * whole);
    /* gather */
    memset(got, 0xab, n * whole);
    memset(want, 0xcd, n * whole);
    CHECK_EQ_INT(kvt_tp_gather(&l, N, (const void *const *)reg, NB, ids, n, want), 0);
    for (int32_t r = 0; r < N; r++) {
        kvt_tp_part p;
        kvt_tp_part_of(&l, N, r, &p);
        if (!p.gathered) continue;
        pd_copy_rows a = svc_kv_tp_rows(&p, reg[r], ids, got, n, true);
        void *done = NULL;
        CHECK_EQ_INT(be->ops->copyq_rows(be->ctx, q, NULL, &a, &done), 0);
        CHECK_EQ_INT(be->ops->event_query(be->ctx, done), 1);
        be->ops->event_release(be->ctx, done);
    }
    CHECK_MSG(!memcmp(got, want, n * whole), "gather of %d heads on %d ranks (T %d, head %d x "
              "%zu bytes) differs from kvt_tp_gather", H, N, T, hd, pd_dtype_size(dt));
    /* scatter: every rank, the replicas too; the other blocks untouched */
    fill_random(got, n * whole);
    CHECK_EQ_INT(kvt_tp_scatter(&l, N, ref, NB, ids, n, got), 0);
    for (int32_t r = 0; r < N; r++) {
        kvt_tp_part p;
        kvt_tp_part_of(&l, N, r, &p);
        pd_copy_rows a = svc_kv_tp_rows(&p, reg[r], ids, got, n, false);
        void *done = NULL;
        CHECK_EQ_INT(be->ops->copyq_rows(be->ctx, q, NULL, &a, &done), 0);
        be->ops->event_release(be->ctx, done);
        CHECK_MSG(!memcmp(reg[r], ref[r], reg_bytes[r]), "scatter of %d heads on %d ranks: rank "
                  "%d differs from kvt_tp_scatter", H, N, r);
    }
    for (int32_t r = 0; r < N; r++) {
        free(reg[r]);
        free(ref[r]);
    }
    free(got);
    free(want);
}

/* copyq_rows on the CPU: every mapping kvt_tp_heads allows for 1..8 heads on 1..8 ranks, and
 * its refusals. */
static void test_copy_rows(void)
{
    char err[PD_ERR_LEN];
    pd_backend *be;
    pd_backend_params bp = pd_backend_default_params();
    bp.n_threads = 1;
    CHECK_EQ_INT(pd_backend_cpu_create(&bp, &be, err), 0);
    void *q;
    CHECK_EQ_INT(be->ops->copyq_create(be->ctx, &q), 0);
    int32_t mappings = 0;
    const int32_t heads[] = {1, 2, 3, 4, 8}, ranks[] = {1, 2, 4, 8};
    for (size_t hi = 0; hi < 5; hi++)
        for (size_t ri = 0; ri < 4; ri++) {
            const int32_t H = heads[hi], N = ranks[ri];
            int32_t h0, nh;
            if (kvt_tp_heads(H, N, 0, &h0, &nh) < 0) continue;
            check_mapping(be, q, PD_DTYPE_BF16, H, N, 16, 8);
            check_mapping(be, q, PD_DTYPE_F32, H, N, 3, 5);
            check_mapping(be, q, PD_DTYPE_BF16, H, N, 1, 64);
            mappings++;
        }
    CHECK_EQ_INT(mappings, 17);
    /* rows outside their block, a negative id */
    uint8_t a8[256], b8[256];
    const int32_t one = 1, neg = -1;
    pd_copy_rows a = {.dst = a8, .src = b8, .dst_ids = &one, .src_ids = &one, .n = 1, .rows = 4,
                      .row_bytes = 8, .dst_block_bytes = 64, .src_block_bytes = 32,
                      .dst_pitch = 16, .src_pitch = 8};
    void *done = NULL;
    CHECK_EQ_INT(be->ops->copyq_rows(be->ctx, q, NULL, &a, &done), 0);
    a.dst_offset = 9; /* 9 + 3 * 16 + 8 = 65 > 64 */
    CHECK_EQ_INT(be->ops->copyq_rows(be->ctx, q, NULL, &a, &done), PD_EINVAL);
    a.dst_offset = 8;
    a.src_pitch = 4; /* < row_bytes */
    CHECK_EQ_INT(be->ops->copyq_rows(be->ctx, q, NULL, &a, &done), PD_EINVAL);
    a.src_pitch = 8;
    a.src_ids = &neg;
    CHECK_EQ_INT(be->ops->copyq_rows(be->ctx, q, NULL, &a, &done), PD_EINVAL);
    be->ops->copyq_destroy(be->ctx, q);
    pd_backend_destroy(be);
}

typedef struct {
    svc_model *m;
    const kvt_device_ops *ops;
    int32_t calls;
    int32_t bad;
} hook_state;

/* The layer hook: the layer's handles for three requests (one set), a gather ordered after
 * one of them equal to kvt_tp_gather of the ranks' caches, the events taken only once. */
static void hook(void *arg, int32_t layer)
{
    hook_state *h = arg;
    svc_model *m = h->m;
    h->calls++;
    void *after[3];
    if (svc_kv_layer_ready(m, layer, 3, after) != 0 || !after[0] || after[0] != after[1] ||
        after[1] != after[2]) {
        h->bad++;
        return;
    }
    void *again[8];
    if (mr_layer_events(m->runner, layer, again) != PD_EBACKEND) h->bad++;
    kvt_layout l;
    svc_kv_layout(m, &l);
    const int32_t ids[2] = {0, 1};
    const size_t whole = kvt_layout_block_bytes(&l);
    uint8_t *got = malloc(2 * whole), *want = malloc(2 * whole);
    void *reg[8];
    size_t bytes[8];
    svc_tp_regions(m, layer, 1, reg, bytes);
    void *tok = NULL;
    if (h->ops->stage_out(h->ops->arg, layer, 1, ids, 2, after[0], got, &tok) != 0 ||
        h->ops->poll(h->ops->arg, tok) != 1)
        h->bad++;
    h->ops->release(h->ops->arg, tok);
    h->ops->release(h->ops->arg, after[0]); /* (kvt releases what it was given) */
    svc_kv_ready_release(m, after[1]);
    svc_kv_ready_release(m, after[2]);
    kvt_tp_gather(&l, mr_n_ranks(m->runner), (const void *const *)reg, mr_n_blocks(m->runner),
                  ids, 2, want);
    if (memcmp(got, want, 2 * whole)) h->bad++;
    free(got);
    free(want);
}

/* stories260k at TP n_tp on the CPU: the staged pool's stage_out / stage_in against
 * kvt_tp_gather / kvt_tp_scatter, then a forward's layer hook. */
static void test_instance(int32_t n_tp)
{
    char err[PD_ERR_LEN];
    svc_model m;
    int rc = svc_tp_open_stories("cpu", n_tp, 2, 1, &m, err);
    CHECK_MSG(rc == 0, "TP %d: %s", n_tp, err);
    if (rc < 0) return;
    CHECK(svc_kv_staged(&m));
    CHECK(svc_kv_stage_ops(&m));
    CHECK(!svc_kv_device_on(&m)); /* tensor parallelism: the ring only */
    kvt_params kp = kvt_default_params();
    svc_kv_device_params(&m, &kp);
    const kvt_device_ops *ops = kp.device;
    CHECK(ops && ops->stage_out && ops->stage_in && !ops->copy_layer);
    kvt_layout l;
    svc_kv_layout(&m, &l);
    CHECK_EQ_INT(l.n_kv_heads, 4);
    const int32_t nb = mr_n_blocks(m.runner), L = l.n_layers;
    const int32_t ids[4] = {nb - 1, 3, 0, 7};
    const size_t whole = kvt_layout_block_bytes(&l);
    uint8_t *slot = malloc(4 * whole), *want = malloc(4 * whole);
    void *reg[8], *ref[8];
    size_t bytes[8];
    for (int32_t layer = 0; ops && layer < L; layer += L - 1)
        for (int kv = 0; kv < 2; kv++) {
            svc_tp_regions(&m, layer, kv, reg, bytes);
            for (int32_t r = 0; r < n_tp; r++) fill_random(reg[r], bytes[r]);
            void *tok = NULL;
            CHECK_EQ_INT(ops->stage_out(ops->arg, layer, kv, ids, 4, NULL, slot, &tok), 0);
            CHECK_EQ_INT(ops->poll(ops->arg, tok), 1);
            ops->release(ops->arg, tok);
            kvt_tp_gather(&l, n_tp, (const void *const *)reg, nb, ids, 4, want);
            CHECK_MSG(!memcmp(slot, want, 4 * whole), "TP %d layer %d %s: stage_out differs "
                      "from kvt_tp_gather", n_tp, layer, kv ? "V" : "K");
            fill_random(slot, 4 * whole);
            for (int32_t r = 0; r < n_tp; r++) {
                ref[r] = malloc(bytes[r]);
                memcpy(ref[r], reg[r], bytes[r]);
            }
            kvt_tp_scatter(&l, n_tp, ref, nb, ids, 4, slot);
            CHECK_EQ_INT(ops->stage_in(ops->arg, layer, kv, ids, 4, slot, &tok), 0);
            CHECK_EQ_INT(ops->poll(ops->arg, tok), 1);
            ops->release(ops->arg, tok);
            for (int32_t r = 0; r < n_tp; r++) {
                CHECK_MSG(!memcmp(reg[r], ref[r], bytes[r]), "TP %d layer %d %s: stage_in of "
                          "rank %d differs from kvt_tp_scatter", n_tp, layer, kv ? "V" : "K", r);
                free(ref[r]);
            }
            const int32_t bad = nb;
            CHECK_EQ_INT(ops->stage_in(ops->arg, layer, kv, &bad, 1, slot, &tok), PD_EINVAL);
        }
    /* a forward of 20 tokens with the hook */
    void *ev[8];
    CHECK_EQ_INT(mr_layer_events(m.runner, 0, ev), PD_EINVAL); /* outside a hook */
    hook_state hs = {.m = &m, .ops = ops};
    mr_set_layer_hook(m.runner, hook, &hs);
    enum { NT = 20 };
    int32_t tok_ids[NT], pos[NT], slots[NT], cu[2] = {0, NT}, ctx[1] = {NT}, bt[2] = {0, 1};
    int32_t rows[1] = {NT - 1};
    for (int32_t i = 0; i < NT; i++) {
        tok_ids[i] = (i * 37 + 5) % m.cfg.vocab_size;
        pos[i] = i;
        slots[i] = i; /* blocks 0 and 1 (block size 16) */
    }
    mr_batch b = {NT, tok_ids, pos, slots, 1, cu, ctx, bt, 2, 1, rows};
    float *logits = malloc((size_t)m.cfg.vocab_size * sizeof *logits);
    rc = mr_forward(m.runner, &b, logits, err);
    CHECK_MSG(rc == 0, "TP %d forward: %s", n_tp, err);
    mr_set_layer_hook(m.runner, NULL, NULL);
    CHECK_EQ_INT(hs.calls, L);
    CHECK_EQ_INT(hs.bad, 0);
    free(logits);
    free(slot);
    free(want);
    svc_kv_device_free(&m);
    svc_model_close(&m);
}

int main(void)
{
    test_part_of();
    test_copy_rows();
    test_instance(2);
    test_instance(4);
    return pd_test_result("test_kvdev");
}
