/* test_kvt_proc.c -- kvtransfer between separate processes: a receiver (decode) and a sender
 * (prefill) forked by a parent that plays the control plane's and the operator's parts (a
 * socketpair carries the descriptor and block lists). One scenario per run:
 *   xfer            many concurrent transfers with interleaved layers, every byte verified
 *   kill-sender     SIGKILL of the sender mid-transfer: the receiver fails in time, frees all
 *   kill-receiver   SIGKILL of the receiver mid-transfer: the sender fails in time, frees all
 *   stop-sender     SIGSTOP of the sender: the receiver's deadline fires
 *   stop-receiver   SIGSTOP of the receiver: the sender's deadline fires
 *   cancel-recv     the receiver cancels mid-transfer; blocks freed; the next transfer works
 *   cancel-send     the sender cancels mid-transfer; likewise
 *   mismatch        the sender's KV layout differs: refused before any byte moves
 *   auth-xfer       both sides have the same KV secret: transfers as xfer
 *   auth-diff       the secrets differ: the sender refuses the descriptor (PD_EPERM)
 *   auth-none-send  only the receiver has a secret: likewise
 *   auth-none-recv  only the sender has one: likewise
 *   auth-forged     the secrets differ and the sender re-signs the descriptor with its own:
 *                   the handshake fails on both sides, the queued send fails with PD_EPERM
 *   auth-forged-none  a sender without a secret strips the signature: the receiver refuses
 *                   it in the handshake, the send fails with PD_EPERM
 *   netns           sender and receiver in two network namespaces joined by a veth pair:
 *                   transfers succeed, then `ip link set down` is caught by the deadlines
 * The transport comes from the environment (UCX_TLS ...). Exit 0 = pass, 77 = skipped. */
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <xxhash.h>

#include "kvt_test.h"
#include "kvtransfer/kvt_desc.h"

enum { M_DESC = 1, M_REQ, M_QUIT, M_MID, M_CANCEL, M_REFUSED, M_SENDER_DONE };
enum { X_DONE = 0, X_FAIL_PEER, X_CANCELED, X_TIMEDOUT };

#define KT_SRC_BLOCKS 64
#define KT_SEED 99

typedef struct {
    uint64_t req_id;
    int32_t n;
    int32_t gap_ms;      /* sender: time between layers (0 = interleave at random) */
    int32_t mid_after;   /* sender: report M_MID after signalling this layer (-1 = never) */
    int32_t cancel_after; /* sender: cancel after signalling this layer (-1 = never) */
    int32_t expect;      /* X_* outcome the sender must see */
    int32_t exit_after;  /* sender: exit once this transfer ended */
    int32_t checksum;
    int32_t ids[];       /* n source ids, then n destination ids */
} kt_req;

static const char *g_scn;
static kt_events g_ev;
static int g_rep = -1; /* child -> parent */

static bool scn(const char *s) { return strcmp(g_scn, s) == 0; }
static char g_sec1[64], g_sec2[64];               /* two different secret files */
static const char *g_sec_recv, *g_sec_send;       /* each side's, NULL = none */

/* Scenarios in which the sender must refuse the descriptor itself. */
static bool refused_at_open(void)
{
    return scn("auth-diff") || scn("auth-none-send") || scn("auth-none-recv");
}
static bool forged(void) { return scn("auth-forged") || scn("auth-forged-none"); }

static void wr_le(uint8_t *p, uint64_t v, int n)
{
    for (int i = 0; i < n; i++) p[i] = (uint8_t)(v >> (8 * i));
}

/* What an attacker holding another secret (or none) does with a descriptor it intercepted:
 * signs it with its own secret (or strips the signature) and fixes the checksum. */
static void *resign(const uint8_t *d, size_t *len, const char *secret_file)
{
    uint32_t ver = (uint32_t)d[4] | (uint32_t)d[5] << 8 | (uint32_t)d[6] << 16 |
                   (uint32_t)d[7] << 24;
    size_t body = *len - 8 - ((ver >> 16 & KVT_DESC_SIGNED) ? KVT_MAC_LEN : 0);
    uint8_t *out = malloc(body + KVT_MAC_LEN + 8);
    memcpy(out, d, body);
    ver &= ~((uint32_t)KVT_DESC_SIGNED << 16);
    if (secret_file) ver |= (uint32_t)KVT_DESC_SIGNED << 16;
    wr_le(out + 4, ver, 4);
    if (secret_file) {
        kvt__secret sec;
        char err[PD_ERR_LEN];
        KT_OK(kvt__secret_load(secret_file, &sec, err), err);
        KT_OK(kvt__desc_mac(&sec, out, body, out + body), "mac");
        kvt__secret_wipe(&sec);
        body += KVT_MAC_LEN;
    }
    wr_le(out + body, XXH64(out, body, 0), 8);
    *len = body + 8;
    return out;
}

static bool status_ok(int32_t expect, int status)
{
    switch (expect) {
    case X_DONE: return status == 0;
    case X_FAIL_PEER: return status == PD_EUNAVAILABLE || status == PD_ETIMEDOUT;
    case X_CANCELED: return status == PD_ECANCELED;
    case X_TIMEDOUT: return status == PD_ETIMEDOUT;
    }
    return false;
}

/* ---------------------------------------------------------------- sender */

typedef struct {
    kvt_send *s;
    kt_req *rq;
    int32_t next, order[64];
    double t_next;
    bool finished;
} sjob;

static int sender_main(int ctl)
{
    kvt_params p = kt_params("prefill", &g_ev);
    p.secret_file = g_sec_send;
    kvt_ctx *ctx;
    char err[PD_ERR_LEN];
    KT_OK(kvt_ctx_create(&p, &ctx, err), err);
    kvt_layout l = kt_layout();
    if (scn("mismatch")) l.head_dim = 128;
    kvt_pool_params pp = kvt_pool_default_params();
    pp.layout = l;
    pp.n_blocks = KT_SRC_BLOCKS;
    kvt_pool *src;
    KT_OK(kvt_pool_create(ctx, &pp, &src, err), err);
    kvh_fill_pool(src, KT_SEED);
    uint32_t type;
    void *msg;
    size_t len;
    KT_EQ(kvh_recv(ctl, &type, &msg, &len, 20000), 0);
    KT_EQ(type, M_DESC);
    kvt_target *t;
    if (forged()) {
        void *f = resign(msg, &len, g_sec_send);
        free(msg);
        msg = f;
    }
    int rc = kvt_target_open(ctx, src, msg, len, &t, err);
    free(msg);
    if (refused_at_open()) {
        KT_EQ(rc, PD_EPERM);
        fprintf(stderr, "sender refused the descriptor: %s\n", err);
        kvh_send(ctl, M_REFUSED, NULL, 0);
        kvt_ctx_destroy(ctx);
        return 0;
    }
    if (forged()) {
        /* The descriptor passes here; the receiver's handshake must not. A send queued on
         * the connection fails with PD_EPERM and releases everything. */
        KT_OK(rc, err);
        int32_t id0 = 0;
        kvt_send_params sp = kvt_send_default_params();
        sp.req_id = 1;
        sp.n_blocks = 1;
        sp.src_ids = sp.dst_ids = &id0;
        kvt_send *s;
        KT_OK(kvt_send_begin(t, &sp, &s, err), err);
        double until = kvh_ms() + 15000;
        while (g_ev.n == 0 && kvh_ms() < until) kvh_loop(ctx, -1, 10);
        KT_EQ(g_ev.n, 1);
        KT_EQ(g_ev.ev[0].type, KVT_EV_SEND_FAILED);
        KT_EQ(g_ev.ev[0].status, PD_EPERM);
        fprintf(stderr, "sender: send failed: %s\n", g_ev.ev[0].detail);
        kvt_stats st;
        kvt_ctx_stats(ctx, &st);
        KT_EQ(st.ops_in_flight, 0);
        KT_EQ(st.sends_active, 0);
        KT_EQ(st.peers, 0);
        kvt_target_info info;
        kvt_target_info_get(t, &info);
        KT_CHECK(info.failed && !info.connected);
        kvt_send_destroy(s);
        kvt_target_close(t);
        kvh_send(ctl, M_REFUSED, NULL, 0);
        kvt_ctx_destroy(ctx);
        return 0;
    }
    if (scn("mismatch")) {
        KT_EQ(rc, PD_EMISMATCH);
        fprintf(stderr, "sender refused: %s\n", err);
        KT_CHECK(strstr(err, "head_dim 128 vs 64"));
        kvh_send(ctl, M_REFUSED, NULL, 0);
        kvt_ctx_destroy(ctx);
        return 0;
    }
    KT_OK(rc, err);
    /* Connect before the first request, as a service would when it opens the target. */
    kvt_target_info info;
    double until = kvh_ms() + 10000;
    do {
        kvh_loop(ctx, -1, 10);
        kvt_target_info_get(t, &info);
    } while (!info.connected && !info.failed && kvh_ms() < until);
    KT_CHECK(info.connected);
    sjob jobs[64];
    int n_jobs = 0, n_seen = 0;
    bool quit = false, leave = false;
    uint64_t rnd = 12345;
    while (!leave && (!quit || n_jobs > 0)) {
        int readable = kvh_loop(ctx, quit ? -1 : ctl, 5);
        /* Ended transfers. */
        for (; n_seen < g_ev.n; n_seen++) {
            kvt_event *ev = &g_ev.ev[n_seen];
            for (int j = 0; j < n_jobs; j++) {
                if (jobs[j].s != ev->send) continue;
                if (!status_ok(jobs[j].rq->expect, ev->status))
                    KT_FAIL("sender: request %llu ended with %s, expected outcome %d: %s",
                            (unsigned long long)ev->req_id, pd_err_name(ev->status),
                            jobs[j].rq->expect, ev->detail);
                kvt_stats st;
                kvt_ctx_stats(ctx, &st);
                if (ev->status != 0 && jobs[j].rq->exit_after) {
                    /* The failed transfer released everything: nothing in flight. */
                    KT_EQ(st.ops_in_flight, 0);
                    KT_EQ(st.sends_active, n_jobs - 1);
                }
                if (jobs[j].rq->exit_after) leave = true;
                kvt_send_destroy(jobs[j].s);
                free(jobs[j].rq);
                jobs[j] = jobs[--n_jobs];
                break;
            }
        }
        /* Layers become ready: on a schedule, or interleaved at random across requests. */
        double now = kvh_ms();
        int pick = n_jobs ? (int)((rnd = rnd * 6364136223846793005ull + 1) >> 33) % n_jobs : 0;
        for (int j = 0; j < n_jobs; j++) {
            sjob *jb = &jobs[j];
            if (jb->finished) continue;
            bool due = jb->rq->gap_ms ? now >= jb->t_next : j == pick;
            if (!due) continue;
            if (jb->next < l.n_layers) {
                int32_t layer = jb->order[jb->next++];
                KT_EQ(kvt_send_layer_ready(jb->s, layer), 0);
                jb->t_next += jb->rq->gap_ms;
                if (jb->next - 1 == jb->rq->mid_after) kvh_send(g_rep, M_MID, NULL, 0);
                if (jb->next - 1 == jb->rq->cancel_after) {
                    kvt_send_cancel(jb->s);
                    jb->finished = true;
                }
            } else {
                KT_EQ(kvt_send_finish(jb->s, (int32_t)(jb->rq->req_id % 1000)), 0);
                jb->finished = true;
            }
        }
        if (!readable) continue;
        if (kvh_recv(ctl, &type, &msg, &len, 2000) != 0) {
            quit = true; /* the receiver is gone */
            continue;
        }
        if (type == M_QUIT) {
            quit = true;
            free(msg);
        } else if (type == M_REQ) {
            kt_req *rq = msg;
            sjob *jb = &jobs[n_jobs];
            memset(jb, 0, sizeof *jb);
            jb->rq = rq;
            kvt_send_params sp = kvt_send_default_params();
            sp.req_id = rq->req_id;
            sp.n_blocks = rq->n;
            sp.src_ids = rq->ids;
            sp.dst_ids = rq->ids + rq->n;
            sp.checksum_data = rq->checksum;
            KT_OK(kvt_send_begin(t, &sp, &jb->s, err), err);
            for (int32_t i = 0; i < l.n_layers; i++) jb->order[i] = i;
            if (!rq->gap_ms) kvh_permute(jb->order, l.n_layers, rq->req_id);
            jb->t_next = kvh_ms();
            n_jobs++;
        } else {
            free(msg);
        }
    }
    kvt_stats st;
    kvt_ctx_stats(ctx, &st);
    fprintf(stderr, "sender: %llu done, %llu failed, transport %s\n",
            (unsigned long long)st.sends_done, (unsigned long long)st.sends_failed,
            st.last_transport_name);
    kvt_target_close(t);
    kvt_ctx_destroy(ctx);
    return 0;
}

/* ---------------------------------------------------------------- receiver */
/* Up to 12 requests are live at once; sent[] keeps the last 64 (indexed by request). */

typedef struct {
    kvt_ctx *ctx;
    kvt_pool *pool;
    int ctl;
    int n_seen;
    uint64_t rnd;
    uint8_t busy[256]; /* slots this test has reserved */
} rstate;

static uint32_t rnd32(rstate *r)
{
    r->rnd = r->rnd * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)(r->rnd >> 33);
}

/* Reserves n slots (kvt picks them when pick, else random free ones in random order), draws
 * random source ids into src, and sends the request to the sender. */
static void post_req(rstate *rs, uint64_t req, int32_t n, bool pick, kt_req tmpl, int32_t *src)
{
    char err[PD_ERR_LEN];
    kvt_recv_params rp = kvt_recv_default_params();
    rp.req_id = req;
    rp.n_blocks = n;
    int32_t want[256], perm[256];
    if (!pick) {
        int32_t nb = kvt_pool_n_blocks(rs->pool), k = 0;
        kvh_permute(perm, nb, rnd32(rs));
        for (int32_t i = 0; i < nb && k < n; i++)
            if (!rs->busy[perm[i]]) want[k++] = perm[i];
        KT_EQ(k, n);
        rp.block_ids = want;
    }
    KT_OK(kvt_recv_expect(rs->pool, &rp, err), err);
    int32_t got;
    const int32_t *dst = kvt_recv_block_ids(rs->pool, req, &got);
    KT_EQ(got, n);
    for (int32_t i = 0; i < n; i++) {
        KT_CHECK(!rs->busy[dst[i]]);
        rs->busy[dst[i]] = 1;
    }
    size_t sz = sizeof(kt_req) + sizeof(int32_t) * 2 * (size_t)n;
    kt_req *rq = malloc(sz);
    *rq = tmpl;
    rq->req_id = req;
    rq->n = n;
    for (int32_t i = 0; i < n; i++) src[i] = rq->ids[i] = (int32_t)(rnd32(rs) % KT_SRC_BLOCKS);
    memcpy(rq->ids + n, dst, sizeof(int32_t) * (size_t)n);
    KT_EQ(kvh_send(rs->ctl, M_REQ, rq, sz), 0);
    free(rq);
}

/* Forgets the test's own marks of a request's slots (before kvt releases them). */
static void unmark(rstate *rs, uint64_t req)
{
    int32_t n;
    const int32_t *dst = kvt_recv_block_ids(rs->pool, req, &n);
    for (int32_t i = 0; dst && i < n; i++) rs->busy[dst[i]] = 0;
}

/* Verifies every byte of request req against the sender's pattern. */
static void verify(rstate *rs, uint64_t req, const int32_t *src_ids)
{
    int32_t n;
    const int32_t *dst = kvt_recv_block_ids(rs->pool, req, &n);
    KT_CHECK(dst != NULL);
    size_t bb = kvt_pool_block_bytes(rs->pool);
    for (int32_t l = 0; l < kt_layout().n_layers; l++)
        for (int kv = 0; kv < 2; kv++)
            for (int32_t i = 0; i < n; i++) {
                const uint8_t *p = (uint8_t *)kvt_pool_region(rs->pool, l, kv) + (size_t)dst[i] * bb;
                long off = kvh_check(p, bb, KT_SEED, l, kv, src_ids[i]);
                if (off >= 0)
                    KT_FAIL("request %llu layer %d %c block %d (slot %d): byte %ld differs",
                            (unsigned long long)req, l, kv ? 'V' : 'K', i, dst[i], off);
            }
}

/* Waits for the next transfer event (progressing), at most ms. */
static kvt_event *next_event(rstate *rs, int ms)
{
    double end = kvh_ms() + ms;
    while (rs->n_seen >= g_ev.n && kvh_ms() < end) kvh_loop(rs->ctx, -1, 20);
    if (rs->n_seen >= g_ev.n) KT_FAIL("receiver: no event within %d ms", ms);
    return &g_ev.ev[rs->n_seen++];
}

typedef struct {
    uint64_t req;
    int32_t n;
    int32_t src[256];
} kt_sent;

static int receiver_main(int ctl)
{
    kvt_params p = kt_params("decode", &g_ev);
    p.secret_file = g_sec_recv;
    char err[PD_ERR_LEN];
    rstate rs = {.ctl = ctl, .rnd = 777};
    KT_OK(kvt_ctx_create(&p, &rs.ctx, err), err);
    kvt_pool_params pp = kvt_pool_default_params();
    pp.layout = kt_layout();
    pp.n_blocks = 256;
    /* KVT_TEST_DST_MEM=host: the landing pool is the caller's memory, one allocation per layer
     * and kind (as the CPU backend's KV cache), instead of a UCX allocation. */
    void *kb[8] = {0}, *vb[8] = {0};
    const char *mem = getenv("KVT_TEST_DST_MEM");
    if (mem && !strcmp(mem, "host")) {
        size_t rlen = (size_t)pp.n_blocks * kvt_layout_block_bytes(&pp.layout);
        for (int l = 0; l < pp.layout.n_layers; l++) kb[l] = calloc(1, rlen), vb[l] = calloc(1, rlen);
        pp.k_base = kb;
        pp.v_base = vb;
    }
    KT_OK(kvt_pool_create(rs.ctx, &pp, &rs.pool, err), err);
    void *desc;
    size_t len;
    KT_OK(kvt_pool_export(rs.pool, &desc, &len, err), err);
    KT_EQ(kvh_send(ctl, M_DESC, desc, len), 0);
    free(desc);
    kt_req tmpl = {.gap_ms = 0, .mid_after = -1, .cancel_after = -1};
    uint32_t type;
    void *msg;
    if (scn("mismatch")) {
        KT_EQ(kvh_recv(ctl, &type, &msg, &len, 20000), 0);
        KT_EQ(type, M_REFUSED);
        for (int i = 0; i < 20; i++) kvh_loop(rs.ctx, -1, 10);
        kvt_stats st;
        kvt_ctx_stats(rs.ctx, &st);
        KT_EQ(st.peers, 0); /* no connection was even attempted */
        kvt_ctx_destroy(rs.ctx);
        return 0;
    }
    if (refused_at_open() || forged()) {
        /* A reservation waits for a sender that is refused; no connection ever becomes ready
         * here, and releasing the reservation frees every block. */
        kvt_recv_params rp = kvt_recv_default_params();
        rp.req_id = 1;
        rp.n_blocks = 16;
        KT_OK(kvt_recv_expect(rs.pool, &rp, err), err);
        double end = kvh_ms() + 20000;
        while (!kvh_loop(rs.ctx, ctl, 20) && kvh_ms() < end) {}
        KT_EQ(kvh_recv(ctl, &type, &msg, &len, 0), 0);
        KT_EQ(type, M_REFUSED);
        for (int i = 0; i < 10; i++) kvh_loop(rs.ctx, -1, 10);
        kvt_stats st;
        kvt_ctx_stats(rs.ctx, &st);
        KT_EQ(st.peers, 0);
        KT_EQ(kvt_recv_release(rs.pool, 1), 0);
        kvt_event *ev = next_event(&rs, 5000);
        KT_EQ(ev->type, KVT_EV_RECV_FAILED);
        KT_EQ(ev->status, PD_ECANCELED);
        KT_EQ(kvt_pool_n_free(rs.pool), 256);
        KT_EQ(kvt_pool_n_reservations(rs.pool), 0);
        kvt_ctx_destroy(rs.ctx);
        return 0;
    }
    if (scn("xfer") || scn("netns") || scn("auth-xfer")) {
        /* Many requests, up to 8 at a time, slots chosen both ways, half with checksums. */
        int total = scn("xfer") ? 96 : scn("auth-xfer") ? 24 : 6, posted = 0, finished = 0,
            live = 0;
        kt_sent sent[64];
        while (finished < total) {
            while (live < 12 && posted < total) {
                uint64_t req = 1000 + (uint64_t)posted;
                int32_t n = 1 + (int32_t)(rnd32(&rs) % 24);
                kt_req t2 = tmpl;
                t2.checksum = posted % 2;
                kt_sent *se = &sent[posted % 64];
                se->req = req;
                se->n = n;
                post_req(&rs, req, n, posted % 3 == 0, t2, se->src);
                posted++;
                live++;
            }
            kvt_event *ev = next_event(&rs, 15000);
            if (ev->type != KVT_EV_RECV_DONE)
                KT_FAIL("request %llu failed: %s (%s)", (unsigned long long)ev->req_id,
                        ev->detail, pd_err_name(ev->status));
            kt_sent *se = &sent[(ev->req_id - 1000) % 64];
            KT_EQ(se->req, ev->req_id);
            KT_EQ(ev->first_token, (int32_t)(ev->req_id % 1000));
            verify(&rs, ev->req_id, se->src);
            unmark(&rs, ev->req_id);
            KT_EQ(kvt_recv_release(rs.pool, ev->req_id), 0);
            finished++;
            live--;
        }
    } else if (scn("kill-sender") || scn("stop-sender") || scn("kill-receiver") ||
               scn("stop-receiver")) {
        kt_req t2 = tmpl;
        t2.gap_ms = 400;
        t2.mid_after = 1;
        t2.exit_after = 1;
        t2.expect = scn("stop-receiver") ? X_TIMEDOUT : X_FAIL_PEER;
        int32_t src[16];
        post_req(&rs, 1, 16, false, t2, src);
        kvt_event *ev = next_event(&rs, 20000); /* the receiver may be killed before this */
        KT_EQ(ev->type, KVT_EV_RECV_FAILED);
        if (scn("stop-sender")) KT_EQ(ev->status, PD_ETIMEDOUT);
        else KT_CHECK(status_ok(X_FAIL_PEER, ev->status));
    } else if (scn("cancel-recv") || scn("cancel-send")) {
        kt_req t2 = tmpl;
        t2.gap_ms = 200;
        t2.expect = X_CANCELED;
        if (scn("cancel-recv")) t2.mid_after = 1;
        else t2.cancel_after = 1;
        int32_t src[16];
        post_req(&rs, 1, 16, true, t2, src);
        unmark(&rs, 1);
        if (scn("cancel-recv")) {
            /* The parent says when (the sender is mid-transfer); keep progressing meanwhile. */
            double end = kvh_ms() + 20000;
            while (!kvh_loop(rs.ctx, g_rep, 50) && kvh_ms() < end) {}
            KT_EQ(kvh_recv(g_rep, &type, &msg, &len, 0), 0);
            KT_EQ(type, M_CANCEL);
            KT_EQ(kvt_recv_release(rs.pool, 1), 0);
        }
        kvt_event *ev = next_event(&rs, 10000);
        KT_EQ(ev->type, KVT_EV_RECV_FAILED);
        KT_EQ(ev->status, PD_ECANCELED);
        KT_EQ(kvt_pool_n_free(rs.pool), 256);
        /* The connection survives a cancellation: the next request goes through. */
        kt_req t3 = tmpl;
        t3.checksum = 1;
        post_req(&rs, 2, 8, true, t3, src);
        ev = next_event(&rs, 10000);
        KT_EQ(ev->type, KVT_EV_RECV_DONE);
        verify(&rs, 2, src);
        unmark(&rs, 2);
        KT_EQ(kvt_recv_release(rs.pool, 2), 0);
    }
    if (scn("netns")) {
        /* Then a partition (the parent downs the link after the MID report). */
        kt_req t2 = tmpl;
        t2.gap_ms = 400;
        t2.mid_after = 1;
        t2.exit_after = 1;
        t2.expect = X_TIMEDOUT;
        int32_t src[16];
        post_req(&rs, 9000, 16, false, t2, src);
        kvt_event *ev = next_event(&rs, 20000);
        KT_EQ(ev->type, KVT_EV_RECV_FAILED);
        KT_EQ(ev->status, PD_ETIMEDOUT);
    }
    /* Everything was released. */
    KT_EQ(kvt_pool_n_free(rs.pool), 256);
    KT_EQ(kvt_pool_n_reservations(rs.pool), 0);
    kvt_stats st;
    kvt_ctx_stats(rs.ctx, &st);
    KT_EQ(st.recvs_active, 0);
    fprintf(stderr, "receiver: %llu done, %llu failed, transport %s\n",
            (unsigned long long)st.recvs_done, (unsigned long long)st.recvs_failed,
            st.last_transport_name);
    kvh_send(ctl, M_QUIT, NULL, 0);
    kvt_ctx_destroy(rs.ctx);
    for (int l = 0; l < 8; l++) free(kb[l]), free(vb[l]);
    return 0;
}

/* ---------------------------------------------------------------- network namespaces */

static char g_ns[2][32]; /* receiver's and sender's namespace, when the scenario uses them */

static int sh(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int sh(const char *fmt, ...)
{
    char cmd[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    int rc = system(cmd);
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

static void netns_remove(void)
{
    for (int i = 0; i < 2; i++)
        if (g_ns[i][0]) sh("ip netns del %s 2>/dev/null", g_ns[i]), g_ns[i][0] = 0;
}

/* Two namespaces joined by a veth pair whose ends are both named kv0 (one UCX_NET_DEVICES for
 * both sides). Returns 0, or 77 when namespaces cannot be made here. */
static int netns_setup(void)
{
    int pid = (int)getpid();
    if (sh("ip netns add kvtr%d 2>/dev/null", pid) != 0) return 77;
    snprintf(g_ns[0], sizeof g_ns[0], "kvtr%d", pid);
    if (sh("ip netns add kvts%d", pid) != 0) return 77;
    snprintf(g_ns[1], sizeof g_ns[1], "kvts%d", pid);
    const char *ip[2] = {"10.77.0.1", "10.77.0.2"};
    if (sh("ip link add kvr%d type veth peer name kvs%d", pid, pid) != 0) return 77;
    for (int i = 0; i < 2; i++) {
        const char *end = i ? "kvs" : "kvr";
        if (sh("ip link set %s%d netns %s && ip -n %s link set %s%d name kv0 && "
               "ip -n %s addr add %s/24 dev kv0 && ip -n %s link set kv0 up && "
               "ip -n %s link set lo up", end, pid, g_ns[i], g_ns[i], end, pid, g_ns[i], ip[i],
               g_ns[i], g_ns[i]) != 0)
            return 77;
    }
    return 0;
}

/* Moves this process into namespace name, with a sysfs of its own (UCX lists network devices
 * from /sys/class/net), as `ip netns exec` does. */
static void netns_enter(const char *name)
{
    char path[128];
    snprintf(path, sizeof path, "/var/run/netns/%s", name);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0 || setns(fd, CLONE_NEWNET) != 0) KT_FAIL("setns %s: %s", name, strerror(errno));
    close(fd);
    if (unshare(CLONE_NEWNS) != 0 || mount("", "/", NULL, MS_SLAVE | MS_REC, NULL) != 0 ||
        umount2("/sys", MNT_DETACH) != 0 || mount(name, "/sys", "sysfs", 0, NULL) != 0)
        KT_FAIL("remounting /sys in %s: %s", name, strerror(errno));
}

/* ---------------------------------------------------------------- the parent */

static pid_t spawn(int (*role)(int), int ctl, int rep, int close_a, int close_b, int ns)
{
    pid_t pid = fork();
    if (pid < 0) KT_FAIL("fork: %s", strerror(errno));
    if (pid > 0) return pid;
    close(close_a);
    close(close_b);
    if (ns >= 0 && g_ns[ns][0]) netns_enter(g_ns[ns]);
    g_ns[0][0] = g_ns[1][0] = 0; /* the parent removes them */
    g_rep = rep;
    exit(role(ctl));
}

static char *g_devshm;

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: test_kvt_proc SCENARIO (see the file's header)\n");
        return 2;
    }
    g_scn = argv[1];
    setenv("UCX_LOG_FILE", "stderr", 0);
    if (!strncmp(g_scn, "auth-", 5)) {
        /* Two secrets, written before the fork; removed at the end. */
        const char *val[2] = {"kvt-test-secret-one-0123456789abcdef\n",
                              "kvt-test-secret-two-fedcba9876543210\n"};
        char *name[2] = {g_sec1, g_sec2};
        for (int i = 0; i < 2; i++) {
            snprintf(name[i], 64, "/tmp/kvt_secret%d_XXXXXX", i + 1);
            int fd = mkstemp(name[i]);
            if (fd < 0 || write(fd, val[i], strlen(val[i])) != (ssize_t)strlen(val[i]))
                KT_FAIL("cannot write %s", name[i]);
            close(fd);
        }
        g_sec_recv = scn("auth-none-recv") ? NULL : g_sec1;
        g_sec_send = scn("auth-xfer") ? g_sec1
                   : scn("auth-none-send") || scn("auth-forged-none") ? NULL : g_sec2;
    }
    if (scn("netns")) {
        atexit(netns_remove);
        int rc = netns_setup();
        if (rc) {
            fprintf(stderr, "test_kvt_proc: cannot create network namespaces here: skipped\n");
            netns_remove();
            return rc;
        }
    }
    g_devshm = kvh_devshm_list();
    int ctl[2], rep_r[2], rep_s[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, ctl) || socketpair(AF_UNIX, SOCK_STREAM, 0, rep_r) ||
        socketpair(AF_UNIX, SOCK_STREAM, 0, rep_s))
        KT_FAIL("socketpair");
    bool ns = scn("netns");
    pid_t pr = spawn(receiver_main, ctl[0], rep_r[1], ctl[1], rep_s[0], ns ? 0 : -1);
    pid_t ps = spawn(sender_main, ctl[1], rep_s[1], ctl[0], rep_r[0], ns ? 1 : -1);
    close(ctl[0]), close(ctl[1]), close(rep_r[1]), close(rep_s[1]);
    pid_t victim = 0, survivor = 0;
    int sig = 0;
    if (scn("kill-sender")) victim = ps, survivor = pr, sig = SIGKILL;
    if (scn("kill-receiver")) victim = pr, survivor = ps, sig = SIGKILL;
    if (scn("stop-sender")) victim = ps, survivor = pr, sig = SIGSTOP;
    if (scn("stop-receiver")) victim = pr, survivor = ps, sig = SIGSTOP;
    double t_act = 0, t_end = kvh_ms() + 45000;
    int st_r = -1, st_s = -1, mids = 0;
    while ((st_r < 0 || st_s < 0) && kvh_ms() < t_end) {
        uint32_t type;
        void *msg;
        size_t len;
        if (kvh_recv(rep_s[0], &type, &msg, &len, 20) == 0) {
            free(msg);
            if (type == M_MID && mids++ == 0) {
                t_act = kvh_ms();
                if (victim) {
                    fprintf(stderr, "parent: signal %d to pid %d mid-transfer\n", sig, (int)victim);
                    kill(victim, sig);
                } else if (scn("cancel-recv")) {
                    kvh_send(rep_r[0], M_CANCEL, NULL, 0);
                } else if (ns) {
                    fprintf(stderr, "parent: partition (kv0 down in %s)\n", g_ns[1]);
                    sh("ip -n %s link set kv0 down", g_ns[1]);
                }
            }
        }
        int status;
        pid_t w;
        while ((w = waitpid(-1, &status, WNOHANG)) > 0) {
            int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
            if (w == pr) st_r = code;
            if (w == ps) st_s = code;
            if (w == survivor) {
                double after = kvh_ms() - t_act;
                fprintf(stderr, "parent: survivor exited %d, %.0f ms after the signal\n", code, after);
                if (t_act == 0) KT_FAIL("the survivor ended before the victim was signalled");
                /* Its deadline is START + compute (3 s) + budget (1 s + bytes) + 1 s. */
                if (after > 8000) KT_FAIL("the survivor took %.0f ms to notice", after);
                if (sig == SIGSTOP) kill(victim, SIGKILL); /* stopped: end it now */
            }
        }
    }
    if (st_r < 0 || st_s < 0) {
        kill(pr, SIGKILL), kill(ps, SIGKILL);
        waitpid(pr, NULL, 0), waitpid(ps, NULL, 0);
        KT_FAIL("timed out (receiver %d, sender %d)", st_r, st_s);
    }
    fprintf(stderr, "parent: receiver exited %d, sender exited %d\n", st_r, st_s);
    if (victim != pr) KT_EQ(st_r, 0);
    if (victim != ps) KT_EQ(st_s, 0);
    pid_t pids[2] = {pr, ps};
    usleep(100000);
    KT_EQ(kvh_shm_leftovers(pids, 2, g_devshm), 0);
    free(g_devshm);
    if (g_sec1[0]) unlink(g_sec1), unlink(g_sec2);
    fprintf(stderr, "test_kvt_proc %s: passed\n", g_scn);
    return 0;
}
