/* test_kvt_unit.c -- kvtransfer in one process: parameter checks, descriptors (round trip,
 * corruption, truncation), the layout-mismatch refusal, slot reservations, a loopback
 * transfer between two contexts, misuse of a transfer's calls, CUDA refusal on a host-only
 * UCX, destroying contexts with transfers in flight, and the tensor-parallel head mapping
 * (kvt_tp_*: transfers between degrees land each rank's heads in its blocks). */
#include <sys/resource.h>
#include <unistd.h>

#include "kvt_test.h"

static kt_events ev_a, ev_b;

static void pump2(kvt_ctx *a, kvt_ctx *b, int ms)
{
    double end = kvh_ms() + ms;
    while (kvh_ms() < end) {
        kvt_progress(a);
        kvt_progress(b);
    }
}

/* Progresses both until cond holds or 10 s pass: a loaded machine may be slow, so what must
 * happen is waited for, never given a fixed time. */
#define PUMP_UNTIL(a, b, cond)                   \
    do {                                         \
        double end_ = kvh_ms() + 10000;          \
        while (!(cond) && kvh_ms() < end_) {     \
            kvt_progress(a);                     \
            kvt_progress(b);                     \
        }                                        \
    } while (0)

static kvt_target_info target_info(kvt_target *t)
{
    kvt_target_info i;
    kvt_target_info_get(t, &i);
    return i;
}

static int32_t ring_free(const kvt_pool *p)
{
    int32_t n_slots, n_free;
    kvt_pool_ring(p, &n_slots, &n_free);
    return n_free;
}

static int32_t ring_slots(const kvt_pool *p)
{
    int32_t n_slots, n_free;
    kvt_pool_ring(p, &n_slots, &n_free);
    return n_slots;
}

/* Progresses both until events of a reach na and of b reach nb (or 10 s pass). */
static void pump_until(kvt_ctx *a, kvt_ctx *b, int na, int nb)
{
    double end = kvh_ms() + 10000;
    while ((ev_a.n < na || ev_b.n < nb) && kvh_ms() < end) {
        kvt_progress(a);
        kvt_progress(b);
    }
    if (ev_a.n < na || ev_b.n < nb) KT_FAIL("events: %d of %d and %d of %d", ev_a.n, na, ev_b.n, nb);
}

static kvt_pool *make_pool(kvt_ctx *ctx, kvt_layout l, int32_t n_blocks)
{
    kvt_pool_params pp = kvt_pool_default_params();
    pp.layout = l;
    pp.n_blocks = n_blocks;
    kvt_pool *pool;
    char err[PD_ERR_LEN];
    KT_OK(kvt_pool_create(ctx, &pp, &pool, err), err);
    return pool;
}

/* Expects a transfer of n blocks on dst (block ids dsts) and begins its send through t from
 * srcs, with default parameters otherwise; returns the send. */
static kvt_send *start_transfer(kvt_pool *dst, kvt_target *t, uint64_t req_id, int32_t n,
                                const int32_t *srcs, const int32_t *dsts)
{
    char err[PD_ERR_LEN];
    kvt_recv_params rp = kvt_recv_default_params();
    rp.req_id = req_id;
    rp.n_blocks = n;
    rp.block_ids = dsts;
    KT_OK(kvt_recv_expect(dst, &rp, err), err);
    kvt_send_params sp = kvt_send_default_params();
    sp.req_id = req_id;
    sp.n_blocks = n;
    sp.src_ids = srcs;
    sp.dst_ids = dsts;
    kvt_send *s;
    KT_OK(kvt_send_begin(t, &sp, &s, err), err);
    return s;
}

static void test_params(void)
{
    char err[PD_ERR_LEN];
    kvt_ctx *ctx;
    kvt_params p = kvt_default_params();
    KT_EQ(kvt_ctx_create(&p, &ctx, err), PD_EINVAL); /* no on_event */
    p = kt_params("bad", &ev_a);
    p.window = 0;
    KT_EQ(kvt_ctx_create(&p, &ctx, err), PD_EINVAL);
    p = kt_params("bad", &ev_a);
    p.am_max_kib = 0;
    KT_EQ(kvt_ctx_create(&p, &ctx, err), PD_EINVAL);
    kvt_ctx_destroy(NULL);
    kvt_pool_destroy(NULL);
    kvt_target_close(NULL);
    kvt_send_destroy(NULL);
}

static void test_descriptor_and_mismatch(void)
{
    char err[PD_ERR_LEN];
    kvt_params pa = kt_params("recv", &ev_a), pb = kt_params("send", &ev_b);
    kvt_ctx *a, *b;
    KT_OK(kvt_ctx_create(&pa, &a, err), err);
    KT_OK(kvt_ctx_create(&pb, &b, err), err);
    kvt_layout l = kt_layout();
    kvt_pool *dst = make_pool(a, l, 32);
    KT_EQ(kvt_pool_n_free(dst), 32);
    KT_EQ(kvt_pool_block_bytes(dst), 16 * 2 * 64 * 2);
    KT_CHECK((char *)kvt_pool_region(dst, 0, 1) ==
             (char *)kvt_pool_region(dst, 0, 0) + 32 * kvt_pool_block_bytes(dst));
    KT_CHECK(kvt_pool_region(dst, 4, 0) == NULL && kvt_pool_region(dst, 0, 2) == NULL);
    void *desc;
    size_t len;
    KT_OK(kvt_pool_export(dst, &desc, &len, err), err);

    /* Corrupt, truncated and foreign descriptors are refused before anything is sent. */
    kvt_pool *src = make_pool(b, l, 16);
    kvt_target *t;
    uint8_t *bad = malloc(len);
    memcpy(bad, desc, len);
    bad[len / 2] ^= 0x40;
    KT_EQ(kvt_target_open(b, src, bad, len, &t, err), PD_EFORMAT);
    KT_EQ(kvt_target_open(b, src, desc, len - 1, &t, err), PD_EFORMAT);
    KT_EQ(kvt_target_open(b, src, "hello", 5, &t, err), PD_EFORMAT);
    free(bad);

    /* A different layout: refused with every differing field named. */
    kvt_layout l2 = l;
    l2.head_dim = 128;
    l2.dtype = PD_DTYPE_F16;
    kvt_pool *src2 = make_pool(b, l2, 16);
    KT_EQ(kvt_target_open(b, src2, desc, len, &t, err), PD_EMISMATCH);
    fprintf(stderr, "mismatch error: %s\n", err);
    KT_CHECK(strstr(err, "head_dim 128 vs 64") && strstr(err, "dtype F16 vs BF16"));
    KT_CHECK(!strstr(err, "block_size"));
    pump2(a, b, 50);
    kvt_stats st;
    kvt_ctx_stats(a, &st);
    KT_EQ(st.peers, 0); /* nothing reached the receiver */
    kvt_ctx_stats(b, &st);
    KT_EQ(st.peers, 0);

    /* The matching one connects, and is cached. */
    KT_OK(kvt_target_open(b, src, desc, len, &t, err), err);
    kvt_target *t2;
    KT_OK(kvt_target_open(b, src, desc, len, &t2, err), err);
    KT_CHECK(t == t2);
    kvt_target_close(t2);
    double end = kvh_ms() + 5000;
    kvt_target_info info;
    do {
        pump2(a, b, 5);
        kvt_target_info_get(t, &info);
    } while (!info.connected && kvh_ms() < end);
    KT_CHECK(info.connected && !info.failed);
    fprintf(stderr, "transport %s (%s), path %s, native put %d\n", info.transport_name,
            kvt_transport_name(info.transport), kvt_path_name(info.path), info.put_native);
    kvt_ctx_stats(b, &st);
    KT_EQ(st.peers, 1);
    KT_CHECK(st.last_transport != KVT_TRANSPORT_UNKNOWN);
    KT_EQ(st.peers_by_transport[st.last_transport], 1);
    /* Closed by every caller, the target stays cached with its connection and keys. */
    kvt_target_close(t);
    KT_OK(kvt_target_open(b, src, desc, len, &t2, err), err);
    KT_CHECK(t == t2);
    kvt_target_close(t);
    free(desc);
    kvt_pool_destroy(src2);
    kvt_ctx_destroy(b);
    kvt_ctx_destroy(a);
}

static void test_reservations(void)
{
    char err[PD_ERR_LEN];
    kvt_params pa = kt_params("recv", &ev_a);
    kvt_ctx *a;
    KT_OK(kvt_ctx_create(&pa, &a, err), err);
    kvt_pool *pool = make_pool(a, kt_layout(), 8);
    kvt_recv_params rp = kvt_recv_default_params();
    int32_t dup[] = {3, 5, 3}, ok[] = {1, 2}, clash[] = {7, 2}, out_of_range[] = {8};
    rp.req_id = 1;
    rp.n_blocks = 3;
    rp.block_ids = dup;
    KT_EQ(kvt_recv_expect(pool, &rp, err), PD_EINVAL);
    KT_CHECK(strstr(err, "twice"));
    KT_EQ(kvt_pool_n_free(pool), 8); /* nothing stays marked after a refusal */
    rp.n_blocks = 1;
    rp.block_ids = out_of_range;
    KT_EQ(kvt_recv_expect(pool, &rp, err), PD_EINVAL);
    rp.n_blocks = 2;
    rp.block_ids = ok;
    KT_OK(kvt_recv_expect(pool, &rp, err), err);
    KT_EQ(kvt_recv_expect(pool, &rp, err), PD_ESTATE); /* same request id */
    rp.req_id = 2;
    rp.block_ids = clash;
    KT_EQ(kvt_recv_expect(pool, &rp, err), PD_ESTATE);
    KT_CHECK(strstr(err, "held by request 1"));
    KT_EQ(kvt_pool_n_free(pool), 6);
    rp.block_ids = NULL; /* kvt picks */
    rp.n_blocks = 7;
    KT_EQ(kvt_recv_expect(pool, &rp, err), PD_ENOSPC);
    rp.n_blocks = 6;
    KT_OK(kvt_recv_expect(pool, &rp, err), err);
    int32_t n;
    const int32_t *ids = kvt_recv_block_ids(pool, 2, &n);
    KT_EQ(n, 6);
    for (int i = 0; i < n; i++) KT_CHECK(ids[i] != 1 && ids[i] != 2);
    KT_EQ(kvt_pool_n_free(pool), 0);
    KT_EQ(kvt_pool_n_reservations(pool), 2);
    /* Cancelling before any sender: RECV_FAILED(ECANCELED), slots free again. */
    int n0 = ev_a.n;
    KT_EQ(kvt_recv_release(pool, 2), 0);
    KT_EQ(kvt_recv_release(pool, 99), PD_ENOTFOUND);
    KT_EQ(kt_wait_event(a, &ev_a, n0, -1, 2000), 1);
    KT_EQ(ev_a.ev[n0].type, KVT_EV_RECV_FAILED);
    KT_EQ(ev_a.ev[n0].status, PD_ECANCELED);
    KT_EQ(kvt_pool_n_free(pool), 6);
    /* A reservation nobody starts expires on its own deadline. */
    rp.req_id = 3;
    rp.n_blocks = 2;
    rp.block_ids = NULL;
    rp.start_timeout_ms = 150;
    KT_OK(kvt_recv_expect(pool, &rp, err), err);
    double t0 = kvh_ms();
    n0 = ev_a.n;
    KT_EQ(kt_wait_event(a, &ev_a, n0, -1, 3000), 1);
    KT_EQ(ev_a.ev[n0].status, PD_ETIMEDOUT);
    KT_CHECK(kvh_ms() - t0 < 1500);
    KT_EQ(kvt_pool_n_free(pool), 6);
    KT_EQ(kvt_recv_release(pool, 1), 0); /* cancels request 1 */
    KT_EQ(kt_wait_event(a, &ev_a, ev_a.n, -1, 2000), 1);
    KT_EQ(kvt_pool_n_free(pool), 8);
    KT_EQ(kvt_pool_n_reservations(pool), 0);
    /* CUDA memory with a host-only UCX is refused with a clear error. */
    if (!(kvt_ctx_mem_types(a) & (1u << KVT_MEM_CUDA))) {
        kvt_pool_params pp = kvt_pool_default_params();
        pp.layout = kt_layout();
        pp.n_blocks = 4;
        pp.mem_type = KVT_MEM_CUDA;
        kvt_pool *cp;
        KT_EQ(kvt_pool_create(a, &pp, &cp, err), PD_EUNSUPPORTED);
        KT_CHECK(strstr(err, "staging"));
    }
    kvt_ctx_destroy(a); /* destroys the pool too */
}

/* Caller-provided regions (as the CPU backend's KV cache: one allocation per layer and kind). */
static kvt_pool *user_pool(kvt_ctx *ctx, void **k, void **v, int32_t nb)
{
    kvt_layout l = kt_layout();
    size_t rlen = (size_t)nb * kvt_layout_block_bytes(&l);
    for (int i = 0; i < l.n_layers; i++) {
        k[i] = calloc(1, rlen);
        v[i] = calloc(1, rlen);
    }
    kvt_pool_params pp = kvt_pool_default_params();
    pp.layout = l;
    pp.n_blocks = nb;
    pp.k_base = k;
    pp.v_base = v;
    kvt_pool *pool;
    char err[PD_ERR_LEN];
    KT_OK(kvt_pool_create(ctx, &pp, &pool, err), err);
    return pool;
}

static void test_loopback(bool user_mem)
{
    char err[PD_ERR_LEN];
    ev_a.n = ev_b.n = 0;
    kvt_params pa = kt_params("recv", &ev_a), pb = kt_params("send", &ev_b);
    kvt_ctx *a, *b;
    KT_OK(kvt_ctx_create(&pa, &a, err), err);
    KT_OK(kvt_ctx_create(&pb, &b, err), err);
    kvt_layout l = kt_layout();
    void *uk[4], *uv[4];
    kvt_pool *dst = user_mem ? user_pool(a, uk, uv, 40) : make_pool(a, l, 40);
    kvt_pool *src = make_pool(b, l, 24);
    kvh_fill_pool(src, 7);
    void *desc;
    size_t len;
    KT_OK(kvt_pool_export(dst, &desc, &len, err), err);
    kvt_target *t;
    KT_OK(kvt_target_open(b, src, desc, len, &t, err), err);
    free(desc);
    size_t bb = kvt_pool_block_bytes(dst);
    for (int r = 0; r < 3; r++) {
        int32_t n = 5 + 4 * r, srcs[24], dsts[40];
        kvh_permute(dsts, 40, 100 + (uint64_t)r);
        kvh_permute(srcs, 24, 200 + (uint64_t)r);
        kvt_recv_params rp = kvt_recv_default_params();
        rp.req_id = 10 + (uint64_t)r;
        rp.n_blocks = n;
        rp.block_ids = dsts;
        KT_OK(kvt_recv_expect(dst, &rp, err), err);
        kvt_send_params sp = kvt_send_default_params();
        sp.req_id = rp.req_id;
        sp.n_blocks = n;
        sp.src_ids = srcs;
        sp.dst_ids = dsts;
        sp.checksum_data = r != 1;
        kvt_send *s;
        KT_OK(kvt_send_begin(t, &sp, &s, err), err);
        KT_EQ(kvt_send_finish(s, 5), PD_ESTATE); /* layers missing */
        for (int32_t layer = l.n_layers - 1; layer >= 0; layer--) { /* any order */
            KT_EQ(kvt_send_layer_ready(s, layer), 0);
            pump2(a, b, 1);
        }
        KT_EQ(kvt_send_layer_ready(s, 0), PD_EINVAL); /* twice */
        KT_EQ(kvt_send_layer_ready(s, 9), PD_EINVAL);
        int na = ev_a.n, nb = ev_b.n;
        /* round 2 hands over three first tokens (a request of n = 3 choices) */
        const int32_t firsts[3] = {1000 + r, 7, 9};
        KT_EQ(kvt_send_finish_n(s, firsts, 0), PD_EINVAL);
        KT_EQ(kvt_send_finish_n(s, firsts, KVT_MAX_FIRST_TOKENS + 1), PD_EINVAL);
        if (r == 2) KT_EQ(kvt_send_finish_n(s, firsts, 3), 0);
        else KT_EQ(kvt_send_finish(s, 1000 + r), 0);
        pump_until(a, b, na + 1, nb + 1);
        KT_EQ(ev_a.ev[na].type, KVT_EV_RECV_DONE);
        KT_EQ(ev_a.ev[na].first_token, 1000 + r);
        KT_EQ(ev_a.ev[na].n_first_tokens, r == 2 ? 3 : 1);
        KT_EQ(ev_b.ev[nb].n_first_tokens, r == 2 ? 3 : 1);
        if (r == 2) {
            KT_EQ(ev_a.ev[na].first_tokens[1], 7);
            KT_EQ(ev_a.ev[na].first_tokens[2], 9);
        }
        KT_EQ(ev_b.ev[nb].type, KVT_EV_SEND_DONE);
        KT_CHECK(ev_b.ev[nb].send == s);
        KT_EQ(kvt_send_layer_ready(s, 1), PD_ESTATE); /* ended */
        for (int32_t layer = 0; layer < l.n_layers; layer++)
            for (int kv = 0; kv < 2; kv++)
                for (int32_t i = 0; i < n; i++) {
                    const uint8_t *p = (uint8_t *)kvt_pool_region(dst, layer, kv) + (size_t)dsts[i] * bb;
                    long off = kvh_check(p, bb, 7, layer, kv, srcs[i]);
                    if (off >= 0) KT_FAIL("request %d layer %d kv %d block %d byte %ld", r, layer, kv, i, off);
                }
        KT_EQ(kvt_recv_release(dst, rp.req_id), 0);
        kvt_send_destroy(s);
    }
    KT_EQ(kvt_pool_n_free(dst), 40);
    /* Idle with a live connection: no deadline, and waiting costs no CPU. */
    pump2(a, b, 20);
    KT_EQ(kvt_timeout_ms(a), -1);
    KT_EQ(kvt_timeout_ms(b), -1);
    struct rusage ru0, ru1;
    getrusage(RUSAGE_SELF, &ru0);
    double t0 = kvh_ms();
    while (kvh_ms() - t0 < 500) kvt_wait(a, 100), kvt_wait(b, 100);
    getrusage(RUSAGE_SELF, &ru1);
    double cpu_ms = (double)(ru1.ru_utime.tv_sec - ru0.ru_utime.tv_sec) * 1e3 +
                    (double)(ru1.ru_utime.tv_usec - ru0.ru_utime.tv_usec) / 1e3 +
                    (double)(ru1.ru_stime.tv_sec - ru0.ru_stime.tv_sec) * 1e3 +
                    (double)(ru1.ru_stime.tv_usec - ru0.ru_stime.tv_usec) / 1e3;
    fprintf(stderr, "idle: %.1f ms of CPU in %.0f ms\n", cpu_ms, kvh_ms() - t0);
    KT_CHECK(cpu_ms < 100);
    kvt_stats st;
    kvt_ctx_stats(b, &st);
    KT_EQ(st.sends_done, 3);
    KT_EQ(st.ops_in_flight, 0);
    KT_EQ(st.sends_active, 0);
    kvt_ctx_stats(a, &st);
    KT_EQ(st.recvs_done, 3);
    KT_EQ(st.recvs_active, 0);

    /* Destroying both contexts with a transfer in flight releases everything. */
    int32_t ids[4] = {0, 1, 2, 3};
    kvt_send *s = start_transfer(dst, t, 77, 4, ids, ids);
    KT_EQ(kvt_send_layer_ready(s, 0), 0);
    pump2(a, b, 20);
    kvt_target_close(t);
    kvt_ctx_destroy(b);
    kvt_ctx_destroy(a);
    if (user_mem)
        for (int i = 0; i < 4; i++) free(uk[i]), free(uv[i]);
}

/* ---- the device path with a fake device engine ----
 * "Device memory" is plain memory of this process: the receiver's device pool is an array of
 * 2 L regions, its export the array's address; the sender's is another array. A copy queued
 * by copy_layer runs only once its `after` handle is ready (as a CUDA copy waits for its
 * event) and then lands after a few polls (as a copy on a stream finishes later). */
typedef struct {
    int ready_after;   /* polls until an `after` handle is ready */
    int pending;       /* copies queued and not landed */
    int live_handles;  /* tokens and `after` handles not yet released */
    int opens, closes;
    int fail_open;     /* open answers PD_EUNSUPPORTED */
    int gate_closed;   /* `after` handles stay unready (a layer still computing) */
    uint8_t *src;      /* [2 L][n_src][bb] */
    size_t bb;
    int32_t n_src, n_dst;
} fake_dev;

typedef struct {
    int kind;          /* 1 = after, 2 = token */
    int polls;         /* after: polls left until ready */
    struct fdev_token *next;
} fdev_after;

typedef struct fdev_token {
    int kind;
    fdev_after *after;
    int polls;         /* polls left after `after` is ready */
    uint8_t *dst;
    int32_t layer, n;
    int32_t *src_ids, *dst_ids;
} fdev_token;

static fake_dev g_fd;

/* The fake export: the device pointer, then a pattern up to the size of an 80-layer model's
 * export (Llama-3-70B: 1,408 bytes, more than the 1,024 once allowed), every byte checked. */
#define FDEV_EXPORT_LEN 1408
static uint8_t fdev_pattern(size_t i) { return (uint8_t)(i * 7 + 3); }

static int fdev_open(void *arg, const void *blob, size_t len, void **remote, char *err)
{
    fake_dev *f = arg;
    if (f->fail_open) return pd_errf(err, PD_EUNSUPPORTED, "fake: no peer access");
    if (len != FDEV_EXPORT_LEN) return pd_errf(err, PD_EINVAL, "fake: bad export length %zu", len);
    for (size_t i = sizeof(void *); i < len; i++)
        if (((const uint8_t *)blob)[i] != fdev_pattern(i))
            return pd_errf(err, PD_EINVAL, "fake: export byte %zu changed", i);
    memcpy(remote, blob, sizeof(void *));
    f->opens++;
    return 0;
}

static void fdev_close(void *arg, void *remote)
{
    (void)remote;
    ((fake_dev *)arg)->closes++;
}

static int fdev_copy(void *arg, void *remote, int32_t layer, const int32_t *src_ids,
                     const int32_t *dst_ids, int32_t n, void *after, void **token)
{
    fake_dev *f = arg;
    fdev_token *t = calloc(1, sizeof *t);
    t->kind = 2;
    t->polls = 3;
    t->dst = remote;
    t->layer = layer;
    t->n = n;
    t->src_ids = malloc((size_t)n * sizeof(int32_t));
    t->dst_ids = malloc((size_t)n * sizeof(int32_t));
    memcpy(t->src_ids, src_ids, (size_t)n * sizeof(int32_t));
    memcpy(t->dst_ids, dst_ids, (size_t)n * sizeof(int32_t));
    if (after) { /* the token waits on it: keep it alive (the caller releases its handle) */
        fdev_after *a = after;
        KT_EQ(a->kind, 1);
        t->after = calloc(1, sizeof *t->after);
        *t->after = *a;
    }
    f->pending++;
    f->live_handles++;
    *token = t;
    return 0;
}

static int fdev_poll(void *arg, void *tok)
{
    fake_dev *f = arg;
    if (*(int *)tok == 1) { /* a layer's readiness polled itself (a path UCX reads from) */
        fdev_after *a = tok;
        if (f->gate_closed) return 0;
        if (a->polls > 0) return a->polls--, 0;
        return 1;
    }
    fdev_token *t = tok;
    if (t->after && (t->after->polls > 0 || f->gate_closed)) {
        if (t->after->polls > 0) t->after->polls--;
        return 0;
    }
    if (t->polls-- > 0) return 0;
    if (t->n >= 0) { /* lands now */
        for (int kv = 0; kv < 2; kv++) {
            int r = 2 * t->layer + kv;
            for (int32_t i = 0; i < t->n; i++)
                memcpy(t->dst + ((size_t)r * f->n_dst + (size_t)t->dst_ids[i]) * f->bb,
                       f->src + ((size_t)r * f->n_src + (size_t)t->src_ids[i]) * f->bb, f->bb);
        }
        t->n = -1;
        f->pending--;
    }
    return 1;
}

static void fdev_release(void *arg, void *h)
{
    fake_dev *f = arg;
    int kind = *(int *)h;
    if (kind == 2) {
        fdev_token *t = h;
        if (t->n >= 0) f->pending--; /* released unlanded: kvt gave up on it */
        free(t->after);
        free(t->src_ids);
        free(t->dst_ids);
    }
    free(h);
    f->live_handles--;
}

static fdev_after *fdev_after_new(int polls)
{
    fdev_after *a = calloc(1, sizeof *a);
    a->kind = 1;
    a->polls = polls;
    g_fd.live_handles++;
    return a;
}

/* Device path end to end in one process: START / DONE over UCX, the bytes through the device
 * engine into the receiver's device memory (the kvt pool stays untouched), RECV_DONE naming
 * the path; a receiver's cancel while copies wait for their layer: RECV_FAILED only after the
 * sender's last copy landed; an engine that cannot open the export: the host path, or an
 * error with device_required; every handle released. */
static void test_device_path(void)
{
    char err[PD_ERR_LEN];
    ev_a.n = ev_b.n = 0;
    kvt_layout l = kt_layout();
    const int32_t n_dst = 40, n_src = 24;
    memset(&g_fd, 0, sizeof g_fd);
    g_fd.bb = kvt_layout_block_bytes(&l);
    g_fd.n_src = n_src;
    g_fd.n_dst = n_dst;
    g_fd.src = malloc(2 * (size_t)l.n_layers * n_src * g_fd.bb);
    uint8_t *dev = calloc(2 * (size_t)l.n_layers * n_dst, g_fd.bb);
    for (int32_t layer = 0; layer < l.n_layers; layer++)
        for (int kv = 0; kv < 2; kv++)
            for (int32_t b = 0; b < n_src; b++)
                kvh_fill(g_fd.src + ((size_t)(2 * layer + kv) * n_src + (size_t)b) * g_fd.bb,
                         g_fd.bb, 9, layer, kv, b);
    kvt_device_ops ops = {.open = fdev_open, .close = fdev_close, .copy_layer = fdev_copy,
                          .poll = fdev_poll, .release = fdev_release, .arg = &g_fd};
    kvt_params pa = kt_params("recv", &ev_a), pb = kt_params("send", &ev_b);
    pb.device = &ops;
    kvt_ctx *a, *b;
    KT_OK(kvt_ctx_create(&pa, &a, err), err);
    KT_OK(kvt_ctx_create(&pb, &b, err), err);
    kvt_pool_params pp = kvt_pool_default_params();
    pp.layout = l;
    pp.n_blocks = n_dst;
    uint8_t exp[FDEV_EXPORT_LEN];
    memcpy(exp, &dev, sizeof dev);
    for (size_t i = sizeof dev; i < sizeof exp; i++) exp[i] = fdev_pattern(i);
    pp.device_export = exp;
    pp.device_export_len = sizeof exp;
    kvt_pool *dst;
    KT_OK(kvt_pool_create(a, &pp, &dst, err), err);
    kvt_pool *src = make_pool(b, l, n_src);
    void *desc;
    size_t len;
    KT_OK(kvt_pool_export(dst, &desc, &len, err), err);
    kvt_target *t;
    KT_OK(kvt_target_open(b, src, desc, len, &t, err), err);
    KT_EQ(g_fd.opens, 1);
    PUMP_UNTIL(a, b, target_info(t).connected); /* the HELLO exchange settles the path */
    kvt_target_info ti = target_info(t);
    KT_EQ(ti.path, KVT_PATH_DEVICE);
    int32_t srcs[24], dsts[40];
    kvh_permute(dsts, n_dst, 31);
    kvh_permute(srcs, n_src, 32);
    /* 1. A whole transfer; layers signalled in reverse order, each ready a few polls later. */
    const int32_t n = 9;
    kvt_recv_params rp = kvt_recv_default_params();
    rp.req_id = 500;
    rp.n_blocks = n;
    rp.block_ids = dsts;
    KT_OK(kvt_recv_expect(dst, &rp, err), err);
    kvt_send_params sp = kvt_send_default_params();
    sp.req_id = 500;
    sp.n_blocks = n;
    sp.src_ids = srcs;
    sp.dst_ids = dsts;
    kvt_send *s;
    KT_OK(kvt_send_begin(t, &sp, &s, err), err);
    for (int32_t layer = l.n_layers - 1; layer >= 0; layer--)
        KT_EQ(kvt_send_layer_ready_after(s, layer, fdev_after_new(5)), 0);
    KT_EQ(kvt_send_finish(s, 42), 0);
    pump_until(a, b, 1, 1);
    KT_EQ(ev_a.ev[0].type, KVT_EV_RECV_DONE);
    KT_EQ(ev_a.ev[0].path, KVT_PATH_DEVICE);
    KT_EQ(ev_a.ev[0].first_token, 42);
    KT_EQ(ev_b.ev[0].type, KVT_EV_SEND_DONE);
    KT_EQ(g_fd.pending, 0);
    for (int32_t layer = 0; layer < l.n_layers; layer++)
        for (int kv = 0; kv < 2; kv++)
            for (int32_t i = 0; i < n; i++) {
                long off = kvh_check(dev + ((size_t)(2 * layer + kv) * n_dst + (size_t)dsts[i]) * g_fd.bb,
                                     g_fd.bb, 9, layer, kv, srcs[i]);
                if (off >= 0) KT_FAIL("device path: layer %d kv %d block %d byte %ld", layer, kv, i, off);
            }
    const uint8_t *host = kvt_pool_region(dst, 0, 0);
    KT_EQ(host[(size_t)dsts[0] * g_fd.bb], 0); /* the host pool was not written */
    KT_EQ(kvt_recv_release(dst, 500), 0);
    kvt_send_destroy(s);
    /* 2. The receiver cancels while the copies wait for their layers: its slots come back
     *    (RECV_FAILED) only after the sender's last copy landed. */
    rp.req_id = 501;
    KT_OK(kvt_recv_expect(dst, &rp, err), err);
    sp.req_id = 501;
    KT_OK(kvt_send_begin(t, &sp, &s, err), err);
    g_fd.gate_closed = 1;
    for (int32_t layer = 0; layer < l.n_layers; layer++)
        KT_EQ(kvt_send_layer_ready_after(s, layer, fdev_after_new(2)), 0);
    pump2(a, b, 5);
    KT_EQ(g_fd.pending, l.n_layers);
    KT_EQ(kvt_recv_cancel(dst, 501), 0);
    int na = ev_a.n, nb = ev_b.n;
    pump2(a, b, 50); /* the sender hears of it, but its copies cannot land yet */
    KT_EQ(ev_a.n, na);
    KT_EQ(g_fd.pending, l.n_layers);
    g_fd.gate_closed = 0; /* the layers are computed */
    double end = kvh_ms() + 10000;
    while (ev_a.n == na && kvh_ms() < end) {
        kvt_progress(a);
        kvt_progress(b);
        if (ev_a.n > na) KT_EQ(g_fd.pending, 0); /* no copy in flight when the slots come back */
    }
    KT_EQ(ev_a.ev[na].type, KVT_EV_RECV_FAILED);
    KT_EQ(ev_a.ev[na].status, PD_ECANCELED);
    pump_until(a, b, na + 1, nb + 1);
    KT_EQ(ev_b.ev[nb].type, KVT_EV_SEND_FAILED);
    kvt_send_destroy(s);
    KT_EQ(kvt_pool_n_free(dst), n_dst);
    kvt_target_close(t);
    /* 3. An engine that cannot open the export: the host path, or an error when required. */
    g_fd.fail_open = 1;
    kvt_target *t2;
    kvt_ctx *c;
    kvt_params pc = kt_params("send2", &ev_b);
    pc.device = &ops;
    KT_OK(kvt_ctx_create(&pc, &c, err), err);
    kvt_pool *src2 = make_pool(c, l, n_src);
    KT_OK(kvt_target_open(c, src2, desc, len, &t2, err), err);
    for (int i = 0; i < 200; i++) kvt_progress(a), kvt_progress(c);
    kvt_target_info_get(t2, &ti);
    KT_CHECK(ti.path != KVT_PATH_DEVICE);
    /* On that path UCX reads the source itself: a layer goes only once its readiness is
     * complete (polled, as for a CUDA pool registered with UCX). */
    {
        uint8_t *sk[8], *sv[8];
        for (int32_t layer = 0; layer < l.n_layers; layer++) {
            sk[layer] = kvt_pool_region(src2, layer, 0);
            sv[layer] = kvt_pool_region(src2, layer, 1);
            for (int32_t b2 = 0; b2 < n_src; b2++) {
                kvh_fill(sk[layer] + (size_t)b2 * g_fd.bb, g_fd.bb, 23, layer, 0, b2);
                kvh_fill(sv[layer] + (size_t)b2 * g_fd.bb, g_fd.bb, 23, layer, 1, b2);
            }
        }
        rp.req_id = 503;
        KT_OK(kvt_recv_expect(dst, &rp, err), err);
        sp.req_id = 503;
        kvt_send *s3;
        KT_OK(kvt_send_begin(t2, &sp, &s3, err), err);
        g_fd.gate_closed = 1;
        for (int32_t layer = 0; layer < l.n_layers; layer++)
            KT_EQ(kvt_send_layer_ready_after(s3, layer, fdev_after_new(3)), 0);
        KT_EQ(kvt_send_finish(s3, 5), 0);
        int na3 = ev_a.n, nb3 = ev_b.n;
        for (int i = 0; i < 300; i++) kvt_progress(a), kvt_progress(c);
        KT_EQ(ev_a.n, na3); /* nothing may move before the layers are ready */
        KT_EQ(ev_b.n, nb3);
        g_fd.gate_closed = 0;
        double end3 = kvh_ms() + 10000;
        while ((ev_a.n == na3 || ev_b.n == nb3) && kvh_ms() < end3) kvt_progress(a), kvt_progress(c);
        KT_EQ(ev_a.ev[na3].type, KVT_EV_RECV_DONE);
        KT_EQ(ev_b.ev[nb3].type, KVT_EV_SEND_DONE);
        for (int32_t layer = 0; layer < l.n_layers; layer++)
            for (int kv = 0; kv < 2; kv++)
                for (int32_t i = 0; i < n; i++) {
                    const uint8_t *reg = kvt_pool_region(dst, layer, kv);
                    long off = kvh_check(reg + (size_t)dsts[i] * g_fd.bb, g_fd.bb, 23, layer, kv, srcs[i]);
                    if (off >= 0) KT_FAIL("gated host path: layer %d kv %d block %d byte %ld", layer, kv, i, off);
                }
        KT_EQ(kvt_recv_release(dst, 503), 0);
        kvt_send_destroy(s3);
    }
    kvt_target_close(t2);
    kvt_ctx_destroy(c);
    pc.device_required = true;
    KT_OK(kvt_ctx_create(&pc, &c, err), err);
    src2 = make_pool(c, l, n_src);
    KT_EQ(kvt_target_open(c, src2, desc, len, &t2, err), PD_EUNSUPPORTED);
    KT_CHECK(strstr(err, "required") != NULL);
    kvt_ctx_destroy(c);
    free(desc);
    kvt_ctx_destroy(b);
    kvt_ctx_destroy(a);
    KT_EQ(g_fd.live_handles, 0);
    KT_EQ(g_fd.opens, g_fd.closes);
    free(g_fd.src);
    free(dev);
}

/* ---- staged pools: "device" memory behind a ring of host slots ----
 * A fake copy engine per context: its device memory is a plain array [2 L][n_blocks][bb];
 * stage_out / stage_in copy only when their token is polled complete (after `delay` polls,
 * never while the gate is closed), so that kvt must keep a ring slot until the copy that uses
 * it completed and until the message sent from it was fetched. */
typedef struct {
    uint8_t *dev;
    int32_t n_blocks;
    size_t bb;
    int delay, gate_closed;
    int pending, live, pins;
    int stage_outs, stage_ins;
} fake_stage;

typedef struct {
    int kind; /* 3 */
    fake_stage *fs;
    int32_t layer, kv, n, ids[64];
    uint8_t *host;
    bool out, done;
    int polls;
} fstage_token;

static int fstage_mk(fake_stage *fs, int32_t layer, int kv, const int32_t *ids, int32_t n,
                     const void *host, bool out, void **token)
{
    KT_CHECK(n >= 1 && n <= 64);
    fstage_token *t = calloc(1, sizeof *t);
    *t = (fstage_token){.kind = 3, .fs = fs, .layer = layer, .kv = kv, .n = n,
                        .host = (uint8_t *)host, .out = out, .polls = fs->delay};
    memcpy(t->ids, ids, (size_t)n * sizeof *ids);
    fs->pending++;
    fs->live++;
    if (out) fs->stage_outs++;
    else fs->stage_ins++;
    *token = t;
    return 0;
}

static int fstage_out(void *arg, int32_t layer, int kv, const int32_t *ids, int32_t n,
                      void *after, void *host, void **token)
{
    (void)after;
    return fstage_mk(arg, layer, kv, ids, n, host, true, token);
}

static int fstage_in(void *arg, int32_t layer, int kv, const int32_t *ids, int32_t n,
                     const void *host, void **token)
{
    return fstage_mk(arg, layer, kv, ids, n, host, false, token);
}

static int fstage_poll(void *arg, void *tok)
{
    fake_stage *fs = arg;
    fstage_token *t = tok;
    if (t->done) return 1;
    if (fs->gate_closed || t->polls-- > 0) return 0;
    for (int32_t i = 0; i < t->n; i++) {
        uint8_t *d = fs->dev + ((size_t)(2 * t->layer + t->kv) * fs->n_blocks + (size_t)t->ids[i]) * fs->bb;
        if (t->out) memcpy(t->host + (size_t)i * fs->bb, d, fs->bb);
        else memcpy(d, t->host + (size_t)i * fs->bb, fs->bb);
    }
    t->done = true;
    fs->pending--;
    return 1;
}

static void fstage_release(void *arg, void *h)
{
    fake_stage *fs = arg;
    fstage_token *t = h;
    if (t->kind == 3 && !t->done) fs->pending--; /* released unfinished: kvt gave up on it */
    if (t->kind == 3) fs->live--;
    free(h);
}

static int fstage_pin(void *arg, void *p, size_t bytes)
{
    (void)p, (void)bytes;
    ((fake_stage *)arg)->pins++;
    return 0;
}

static void fstage_unpin(void *arg, void *p)
{
    (void)p;
    ((fake_stage *)arg)->pins--;
}

static kvt_pool *staged_pool(kvt_ctx *ctx, kvt_layout l, int32_t n_blocks, size_t ring_bytes)
{
    kvt_pool_params pp = kvt_pool_default_params();
    pp.layout = l;
    pp.n_blocks = n_blocks;
    pp.staged = true;
    pp.stage_ring_bytes = ring_bytes;
    kvt_pool *pool;
    char err[PD_ERR_LEN];
    KT_OK(kvt_pool_create(ctx, &pp, &pool, err), err);
    KT_CHECK(kvt_pool_region(pool, 0, 0) == NULL);
    return pool;
}

static void staged_check(const fake_stage *dst, const int32_t *dsts, int32_t n, int seed,
                         const int32_t *srcs, int32_t layers, const char *what)
{
    for (int32_t layer = 0; layer < layers; layer++)
        for (int kv = 0; kv < 2; kv++)
            for (int32_t i = 0; i < n; i++) {
                long off = kvh_check(dst->dev + ((size_t)(2 * layer + kv) * dst->n_blocks +
                                                 (size_t)dsts[i]) * dst->bb,
                                     dst->bb, seed, layer, kv, srcs[i]);
                if (off >= 0) KT_FAIL("%s: layer %d kv %d block %d byte %ld", what, layer, kv, i, off);
            }
}

/* Staged pools on both sides (GPU to GPU through host memory): a request larger than both
 * rings (wrap-around; the receiver's ring smaller, so block messages wait for a slot) lands
 * byte for byte with slow copies on both sides; every slot comes back; a receiver's cancel
 * while its scatters cannot finish: RECV_FAILED only once none runs, the sender ends, the
 * rings are whole again; a sender's cancel mid-ring; puts refused; every handle released. */
static void test_staged_ring(void)
{
    char err[PD_ERR_LEN];
    ev_a.n = ev_b.n = 0;
    kvt_layout l = kt_layout();
    const int32_t nb = 400;
    size_t bb = kvt_layout_block_bytes(&l);
    int32_t slot_blocks = kvt_stage_slot_blocks(bb);
    KT_EQ(slot_blocks, 64); /* 4 KiB blocks: 64 a slot (the cap) */
    KT_EQ(kvt_stage_slot_blocks(4u << 20), 1);
    KT_EQ(kvt_stage_slot_blocks(64u << 10), 16);
    fake_stage fa = {.n_blocks = nb, .bb = bb, .delay = 3}, fb = {.n_blocks = nb, .bb = bb, .delay = 2};
    fa.dev = calloc(2 * (size_t)l.n_layers * nb, bb);
    fb.dev = malloc(2 * (size_t)l.n_layers * nb * bb);
    for (int32_t layer = 0; layer < l.n_layers; layer++)
        for (int kv = 0; kv < 2; kv++)
            for (int32_t b = 0; b < nb; b++)
                kvh_fill(fb.dev + ((size_t)(2 * layer + kv) * nb + (size_t)b) * bb, bb, 17, layer,
                         kv, b);
    kvt_device_ops oa = {.poll = fstage_poll, .release = fstage_release, .stage_out = fstage_out,
                         .stage_in = fstage_in, .host_pin = fstage_pin, .host_unpin = fstage_unpin,
                         .arg = &fa};
    kvt_device_ops ob = oa;
    ob.arg = &fb;
    kvt_params pa = kt_params("recv", &ev_a), pb = kt_params("send", &ev_b);
    pa.device = &oa;
    pb.device = &ob;
    kvt_ctx *a, *b;
    KT_OK(kvt_ctx_create(&pa, &a, err), err);
    KT_OK(kvt_ctx_create(&pb, &b, err), err);
    /* A staged pool needs the copy engine. */
    kvt_params pc = kt_params("plain", &ev_b);
    kvt_ctx *c;
    KT_OK(kvt_ctx_create(&pc, &c, err), err);
    kvt_pool_params pp = kvt_pool_default_params();
    pp.layout = l;
    pp.n_blocks = nb;
    pp.staged = true;
    kvt_pool *bad;
    KT_EQ(kvt_pool_create(c, &pp, &bad, err), PD_EINVAL);
    kvt_ctx_destroy(c);
    kvt_pool *dst = staged_pool(a, l, nb, 1);        /* the minimum: 4 slots */
    kvt_pool *src = staged_pool(b, l, nb, 6 * bb * 64); /* 6 slots */
    int32_t rs, rf;
    kvt_pool_ring(dst, &rs, &rf);
    KT_EQ(rs, 4);
    KT_EQ(rf, 4);
    kvt_pool_ring(src, &rs, &rf);
    KT_EQ(rs, 6);
    KT_EQ(fa.pins, 1);
    void *desc;
    size_t len;
    KT_OK(kvt_pool_export(dst, &desc, &len, err), err);
    kvt_target *t;
    KT_OK(kvt_target_open(b, src, desc, len, &t, err), err);
    PUMP_UNTIL(a, b, target_info(t).connected);
    kvt_target_info ti = target_info(t);
    KT_EQ(ti.path, KVT_PATH_AM); /* no put into (or out of) device memory */
    static int32_t srcs[400], dsts[400];
    kvh_permute(srcs, nb, 41);
    kvh_permute(dsts, nb, 42);
    /* 1. 150 blocks x 4 layers x K, V: 24 messages of up to 64 blocks through 6 and 4 slots. */
    const int32_t n = 150;
    kvt_recv_params rp = kvt_recv_default_params();
    rp.req_id = 700;
    rp.n_blocks = n;
    rp.block_ids = dsts;
    KT_OK(kvt_recv_expect(dst, &rp, err), err);
    kvt_send_params sp = kvt_send_default_params();
    sp.req_id = 700;
    sp.n_blocks = n;
    sp.src_ids = srcs;
    sp.dst_ids = dsts;
    sp.checksum_data = true; /* not with staged memory */
    kvt_send *s;
    KT_EQ(kvt_send_begin(t, &sp, &s, err), PD_EUNSUPPORTED);
    sp.checksum_data = false;
    KT_OK(kvt_send_begin(t, &sp, &s, err), err);
    for (int32_t layer = 0; layer < l.n_layers; layer++) KT_EQ(kvt_send_layer_ready(s, layer), 0);
    KT_EQ(kvt_send_finish(s, 7), 0);
    pump_until(a, b, 1, 1);
    KT_EQ(ev_a.ev[0].type, KVT_EV_RECV_DONE);
    KT_EQ(ev_a.ev[0].path, KVT_PATH_AM);
    KT_EQ(ev_a.ev[0].first_token, 7);
    KT_EQ(ev_b.ev[0].type, KVT_EV_SEND_DONE);
    KT_EQ(fb.stage_outs, 24);
    KT_EQ(fa.stage_ins, 24);
    KT_EQ(fa.pending, 0);
    staged_check(&fa, dsts, n, 17, srcs, l.n_layers, "staged ring");
    kvt_pool_ring(dst, &rs, &rf);
    KT_EQ(rf, rs);
    kvt_pool_ring(src, &rs, &rf);
    KT_EQ(rf, rs);
    KT_EQ(kvt_recv_release(dst, 700), 0);
    kvt_send_destroy(s);
    /* 2. The receiver cancels while its scatters cannot finish (and more messages wait for a
     *    slot): RECV_FAILED only when no copy into its blocks runs any more. */
    rp.req_id = 701;
    KT_OK(kvt_recv_expect(dst, &rp, err), err);
    sp.req_id = 701;
    KT_OK(kvt_send_begin(t, &sp, &s, err), err);
    fa.gate_closed = 1;
    for (int32_t layer = 0; layer < l.n_layers; layer++) KT_EQ(kvt_send_layer_ready(s, layer), 0);
    PUMP_UNTIL(a, b, fa.pending > 0 && ring_free(dst) == 0);
    KT_CHECK(fa.pending > 0);
    KT_EQ(ring_free(dst), 0); /* every slot holds a landed message */
    KT_EQ(kvt_recv_cancel(dst, 701), 0);
    int na = ev_a.n, nbv = ev_b.n;
    pump2(a, b, 100);
    KT_EQ(ev_a.n, na); /* scatters still run: the blocks stay reserved */
    fa.gate_closed = 0;
    double end = kvh_ms() + 10000;
    while (ev_a.n == na && kvh_ms() < end) {
        kvt_progress(a);
        kvt_progress(b);
        if (ev_a.n > na) KT_EQ(fa.pending, 0);
    }
    KT_EQ(ev_a.ev[na].type, KVT_EV_RECV_FAILED);
    KT_EQ(ev_a.ev[na].status, PD_ECANCELED);
    pump_until(a, b, na + 1, nbv + 1);
    KT_EQ(ev_b.ev[nbv].type, KVT_EV_SEND_FAILED);
    kvt_send_destroy(s);
    PUMP_UNTIL(a, b, ring_free(dst) == ring_slots(dst) && ring_free(src) == ring_slots(src));
    KT_EQ(ring_free(dst), ring_slots(dst));
    KT_EQ(ring_free(src), ring_slots(src));
    KT_EQ(kvt_pool_n_free(dst), nb);
    /* 3. The sender cancels mid-ring (its gathers held back): both sides end, rings whole. */
    rp.req_id = 702;
    KT_OK(kvt_recv_expect(dst, &rp, err), err);
    sp.req_id = 702;
    KT_OK(kvt_send_begin(t, &sp, &s, err), err);
    fb.gate_closed = 1;
    for (int32_t layer = 0; layer < l.n_layers; layer++) KT_EQ(kvt_send_layer_ready(s, layer), 0);
    PUMP_UNTIL(a, b, fb.pending > 0);
    KT_CHECK(fb.pending > 0);
    na = ev_a.n, nbv = ev_b.n;
    kvt_send_cancel(s);
    pump2(a, b, 50);
    KT_EQ(ev_b.n, nbv); /* its gathers still run */
    fb.gate_closed = 0;
    pump_until(a, b, na + 1, nbv + 1);
    KT_EQ(ev_b.ev[nbv].type, KVT_EV_SEND_FAILED);
    KT_EQ(ev_b.ev[nbv].status, PD_ECANCELED);
    KT_EQ(ev_a.ev[na].type, KVT_EV_RECV_FAILED);
    kvt_send_destroy(s);
    PUMP_UNTIL(a, b, ring_free(src) == ring_slots(src) && kvt_pool_n_free(dst) == nb);
    KT_EQ(ring_free(src), ring_slots(src));
    KT_EQ(kvt_pool_n_free(dst), nb);
    KT_EQ(fb.pending, 0);
    kvt_target_close(t);
    free(desc);
    kvt_ctx_destroy(b);
    kvt_ctx_destroy(a);
    KT_EQ(fa.live, 0);
    KT_EQ(fb.live, 0);
    KT_EQ(fa.pins, 0);
    KT_EQ(fb.pins, 0);
    free(fa.dev);
    free(fb.dev);
}

/* ---- tensor parallelism: the head mapping (kvt_tp_*) ----
 * A sender of p ranks and a receiver of d ranks, each rank's KV a plain array per (layer, kv)
 * of [n_blocks][block_size][its heads][head_dim], behind staged pools whose stage_out /
 * stage_in are kvt_tp_gather / kvt_tp_scatter (done at once, as on the CPU backend). */
typedef struct {
    kvt_layout l;
    int32_t n_ranks, n_blocks;
    uint8_t *reg[8][8]; /* [rank][2 layer + kv] */
    int outs, ins;
} tp_side;

static char g_tp_done;

static int tp_stage(tp_side *s, int32_t layer, int kv, const int32_t *ids, int32_t n, void *host,
                    bool out, void **token)
{
    void *r[8];
    for (int32_t k = 0; k < s->n_ranks; k++) r[k] = s->reg[k][2 * layer + kv];
    int rc = out ? kvt_tp_gather(&s->l, s->n_ranks, (const void *const *)r, s->n_blocks, ids, n, host)
                 : kvt_tp_scatter(&s->l, s->n_ranks, r, s->n_blocks, ids, n, host);
    if (out) s->outs++;
    else s->ins++;
    *token = &g_tp_done;
    return rc;
}

static int tp_out(void *arg, int32_t layer, int kv, const int32_t *ids, int32_t n, void *after,
                  void *host, void **token)
{
    (void)after;
    return tp_stage(arg, layer, kv, ids, n, host, true, token);
}

static int tp_in(void *arg, int32_t layer, int kv, const int32_t *ids, int32_t n,
                 const void *host, void **token)
{
    return tp_stage(arg, layer, kv, ids, n, (void *)host, false, token);
}

static int tp_poll(void *arg, void *tok)
{
    (void)arg;
    return tok == &g_tp_done ? 1 : PD_EINVAL;
}

static void tp_release(void *arg, void *h)
{
    (void)arg, (void)h;
}

/* The value of element (layer, kv, block, token, head, dim) in the whole layout. */
static uint32_t tp_val(int32_t layer, int kv, int32_t b, int32_t t, int32_t h, int32_t d)
{
    return (((((uint32_t)layer * 2 + (uint32_t)kv) * 64 + (uint32_t)b) * 8 + (uint32_t)t) * 8 +
            (uint32_t)h) * 8 + (uint32_t)d + 1;
}

/* Rank regions of a side; the sender's hold tp_val of their heads (replicas other than the
 * first hold 0xEE, so that a gather reading them shows), the receiver's 0. */
static void tp_side_init(tp_side *s, kvt_layout l, int32_t n_ranks, int32_t n_blocks, bool src)
{
    memset(s, 0, sizeof *s);
    s->l = l;
    s->n_ranks = n_ranks;
    s->n_blocks = n_blocks;
    for (int32_t r = 0; r < n_ranks; r++) {
        int32_t h0, nh;
        KT_EQ(kvt_tp_heads(l.n_kv_heads, n_ranks, r, &h0, &nh), 0);
        bool replica = n_ranks > l.n_kv_heads && r % (n_ranks / l.n_kv_heads);
        for (int32_t i = 0; i < 2 * l.n_layers; i++) {
            uint32_t *p = calloc((size_t)n_blocks * l.block_size * nh * l.head_dim, 4);
            s->reg[r][i] = (uint8_t *)p;
            if (!src) continue;
            for (int32_t b = 0; b < n_blocks; b++)
                for (int32_t t = 0; t < l.block_size; t++)
                    for (int32_t h = 0; h < nh; h++)
                        for (int32_t d = 0; d < l.head_dim; d++)
                            *p++ = replica ? 0xEEEEEEEEu : tp_val(i / 2, i % 2, b, t, h0 + h, d);
        }
    }
}

static void tp_side_free(tp_side *s)
{
    for (int32_t r = 0; r < s->n_ranks; r++)
        for (int32_t i = 0; i < 2 * s->l.n_layers; i++) free(s->reg[r][i]);
}

/* Moves blocks srcs -> dsts from a sender of p ranks to a receiver of d ranks through kvt and
 * checks every byte of every receiver rank: exactly its heads of the source block. */
static void tp_transfer(int32_t p, int32_t d)
{
    char err[PD_ERR_LEN];
    ev_a.n = ev_b.n = 0;
    kvt_layout l = {.model_id = "kvt-tp-model", .dtype = PD_DTYPE_F32, .n_layers = 2,
                    .block_size = 4, .n_kv_heads = 4, .head_dim = 8};
    const int32_t nb = 40, n = 13;
    tp_side tx, rx;
    tp_side_init(&tx, l, p, nb, true);
    tp_side_init(&rx, l, d, nb, false);
    kvt_device_ops oa = {.poll = tp_poll, .release = tp_release, .stage_out = tp_out,
                         .stage_in = tp_in, .arg = &rx};
    kvt_device_ops ob = oa;
    ob.arg = &tx;
    kvt_params pa = kt_params("recv", &ev_a), pb = kt_params("send", &ev_b);
    pa.device = &oa;
    pb.device = &ob;
    kvt_ctx *a, *b;
    KT_OK(kvt_ctx_create(&pa, &a, err), err);
    KT_OK(kvt_ctx_create(&pb, &b, err), err);
    kvt_pool *dst = staged_pool(a, l, nb, 1), *src = staged_pool(b, l, nb, 1);
    void *desc;
    size_t len;
    KT_OK(kvt_pool_export(dst, &desc, &len, err), err);
    kvt_target *t;
    KT_OK(kvt_target_open(b, src, desc, len, &t, err), err);
    int32_t srcs[13], dsts[13];
    for (int32_t i = 0; i < n; i++) srcs[i] = (7 * i + 3) % nb, dsts[i] = (11 * i + 5) % nb;
    kvt_send *s = start_transfer(dst, t, 900, n, srcs, dsts);
    for (int32_t layer = 0; layer < l.n_layers; layer++) KT_EQ(kvt_send_layer_ready(s, layer), 0);
    KT_EQ(kvt_send_finish(s, 5), 0);
    pump_until(a, b, 1, 1);
    KT_EQ(ev_a.ev[0].type, KVT_EV_RECV_DONE);
    KT_EQ(ev_b.ev[0].type, KVT_EV_SEND_DONE);
    KT_CHECK(tx.outs > 0 && rx.ins > 0);
    for (int32_t r = 0; r < d; r++) {
        int32_t h0, nh;
        KT_EQ(kvt_tp_heads(l.n_kv_heads, d, r, &h0, &nh), 0);
        for (int32_t i = 0; i < 2 * l.n_layers; i++) {
            const uint32_t *q = (const uint32_t *)rx.reg[r][i];
            for (int32_t blk = 0; blk < nb; blk++) {
                int32_t k = -1;
                for (int32_t j = 0; j < n; j++)
                    if (dsts[j] == blk) k = j;
                for (int32_t tk = 0; tk < l.block_size; tk++)
                    for (int32_t h = 0; h < nh; h++)
                        for (int32_t dd = 0; dd < l.head_dim; dd++) {
                            uint32_t want = k < 0 ? 0 : tp_val(i / 2, i % 2, srcs[k], tk, h0 + h, dd);
                            uint32_t got = *q++;
                            if (got != want)
                                KT_FAIL("TP %d -> %d: rank %d region %d block %d token %d head "
                                        "%d dim %d: %u, want %u", p, d, r, i, blk, tk, h0 + h, dd,
                                        got, want);
                        }
            }
        }
    }
    KT_EQ(kvt_recv_release(dst, 900), 0);
    kvt_send_destroy(s);
    kvt_target_close(t);
    free(desc);
    kvt_ctx_destroy(b);
    kvt_ctx_destroy(a);
    tp_side_free(&tx);
    tp_side_free(&rx);
}

/* The head mapping: which heads each rank holds (divided, replicated, refused), the gather /
 * scatter's checks, and transfers between degrees landing each rank's heads in its blocks. */
static void test_tp_mapping(void)
{
    int32_t h0, nh;
    KT_EQ(kvt_tp_heads(4, 1, 0, &h0, &nh), 0);
    KT_EQ(h0, 0);
    KT_EQ(nh, 4);
    KT_EQ(kvt_tp_heads(4, 2, 1, &h0, &nh), 0);
    KT_EQ(h0, 2);
    KT_EQ(nh, 2);
    KT_EQ(kvt_tp_heads(4, 8, 5, &h0, &nh), 0); /* replicated on 2 ranks each */
    KT_EQ(h0, 2);
    KT_EQ(nh, 1);
    KT_EQ(kvt_tp_heads(1, 4, 3, &h0, &nh), 0);
    KT_EQ(h0, 0);
    KT_EQ(kvt_tp_heads(4, 3, 0, &h0, &nh), PD_EINVAL);
    KT_EQ(kvt_tp_heads(6, 4, 0, &h0, &nh), PD_EINVAL);
    KT_EQ(kvt_tp_heads(4, 2, 2, &h0, &nh), PD_EINVAL);
    KT_EQ(kvt_tp_heads(4, 0, 0, &h0, &nh), PD_EINVAL);
    KT_EQ(kvt_tp_heads(0, 1, 0, &h0, &nh), PD_EINVAL);
    KT_EQ(kvt_tp_heads(4, KVT_TP_MAX + 4, 0, &h0, &nh), PD_EINVAL);
    kvt_layout l = {.model_id = "m", .dtype = PD_DTYPE_F32, .n_layers = 1, .block_size = 2,
                    .n_kv_heads = 4, .head_dim = 2};
    float r0[4 * 2 * 2 * 2] = {0}, r1[4 * 2 * 2 * 2] = {0}, host[2 * 4 * 2 * 2];
    void *regs[2] = {r0, r1};
    int32_t ids[2] = {1, 3}, bad[1] = {4};
    KT_EQ(kvt_tp_gather(&l, 2, (const void *const *)regs, 4, bad, 1, host), PD_EINVAL);
    KT_EQ(kvt_tp_scatter(&l, 2, regs, 4, bad, 1, host), PD_EINVAL);
    KT_EQ(kvt_tp_scatter(&l, 3, regs, 4, ids, 2, host), PD_EINVAL);
    for (int i = 0; i < 32; i++) host[i] = (float)i;
    KT_EQ(kvt_tp_scatter(&l, 2, regs, 4, ids, 2, host), 0);
    /* block 1 of rank 1: host block 0, tokens 0 and 1, heads 2 and 3 */
    KT_CHECK(r1[8] == 4 && r1[11] == 7 && r1[12] == 12 && r1[15] == 15 && r0[8] == 0 && r0[12] == 8);
    float back[32];
    KT_EQ(kvt_tp_gather(&l, 2, (const void *const *)regs, 4, ids, 2, back), 0);
    KT_CHECK(!memcmp(back, host, sizeof back));
    static const int32_t pairs[][2] = {{2, 1}, {1, 2}, {2, 2}, {1, 4}, {4, 2}, {8, 4}, {2, 8}, {1, 1}};
    for (size_t i = 0; i < sizeof pairs / sizeof pairs[0]; i++) tp_transfer(pairs[i][0], pairs[i][1]);
}

int main(void)
{
    setenv("UCX_LOG_FILE", "stderr", 0);
    test_params();
    test_descriptor_and_mismatch();
    test_reservations();
    test_loopback(false);
    test_loopback(true);
    test_device_path();
    test_staged_ring();
    test_tp_mapping();
    fprintf(stderr, "test_kvt_unit: all passed\n");
    return 0;
}
