/* kvt_bench.c -- pdserve-kvt-bench: a receiver (decode) process and a sender (prefill) process
 * (forked, joined by a socketpair standing in for the control plane) move a realistic KV
 * pattern -- every layer's K and V blocks of a request into permuted slots of the decode pool
 * -- many times, verify every byte outside the timed region, and print GB/s and per-transfer
 * latency (sender: begin -> ACK). */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/error.h"
#include "common/log.h"
#include "kvtransfer/kvt_harness.h"

enum { MSG_DESC = 1, MSG_REQ, MSG_SENT, MSG_QUIT };

typedef struct {
    kvt_layout layout;
    int32_t blocks, pool_blocks, iters, warmup, conc, layer_us, am_kib, max_op_kib, window;
    int32_t am_staging; /* -1 = default */
    int32_t spin_us;    /* -1 = default */
    kvt_path path;
    bool verify, checksum, src_ucx, dst_ucx, memcpy_only, contiguous, spin;
    int cpu_send, cpu_recv;
} bench_opts;

typedef struct {
    uint64_t req_id;
    int32_t n;
    int32_t ids[]; /* n source ids, then n destination ids */
} req_msg;

typedef struct {
    uint64_t req_id;
    int32_t status;
    int32_t pad;
    double ms;
} sent_msg;

/* ---------------------------------------------------------------- common */

typedef struct {
    kvt_send *s;
    double t_next;
    int32_t next_layer;
} live_send;

typedef struct {
    int sock;                 /* sender: where MSG_SENT goes */
    live_send live[256];      /* sender: transfers in progress */
    int n_live;
    int32_t n_req;            /* receiver: requests of the round */
    uint64_t req_base;
    int done[256];            /* receiver: 0 pending, 1 done, -1 failed */
    int n_failed;
} ev_state;

static void on_event(void *arg, const kvt_event *ev)
{
    ev_state *st = arg;
    if (ev->status != 0) {
        st->n_failed++;
        fprintf(stderr, "kvt-bench: %s of request %llu failed: %s (%s)\n",
                ev->type == KVT_EV_SEND_FAILED ? "send" : "receive",
                (unsigned long long)ev->req_id, ev->detail, pd_err_name(ev->status));
    }
    if (ev->send) {
        sent_msg sm = {.req_id = ev->req_id, .status = ev->status,
                       .ms = (double)ev->elapsed_ns / 1e6};
        kvh_send(st->sock, MSG_SENT, &sm, sizeof sm);
        for (int i = 0; i < st->n_live; i++)
            if (st->live[i].s == ev->send) {
                st->live[i] = st->live[--st->n_live];
                break;
            }
        kvt_send_destroy(ev->send);
    } else {
        uint64_t i = ev->req_id - st->req_base;
        if (i < (uint64_t)st->n_req) st->done[i] = ev->status == 0 ? 1 : -1;
    }
}

static void pin(int cpu)
{
    if (cpu < 0) return;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    if (sched_setaffinity(0, sizeof set, &set) != 0) perror("sched_setaffinity");
}

static kvt_ctx *make_ctx(const char *name, const bench_opts *o, ev_state *st)
{
    kvt_params p = kvt_default_params();
    p.name = name;
    p.on_event = on_event;
    p.on_event_arg = st;
    p.path = o->path;
    if (o->am_kib) p.am_max_kib = o->am_kib;
    if (o->max_op_kib) p.max_op_kib = o->max_op_kib;
    if (o->window) p.window = o->window;
    if (o->am_staging >= 0) p.am_staging_slots = o->am_staging;
    if (o->spin_us >= 0) p.spin_us = o->spin_us;
    kvt_ctx *ctx;
    char err[PD_ERR_LEN];
    if (kvt_ctx_create(&p, &ctx, err) < 0) {
        fprintf(stderr, "kvt-bench: %s\n", err);
        return NULL;
    }
    return ctx;
}

/* Host memory for a pool whose regions the caller owns (--*-mem host). */
static void **host_regions(const bench_opts *o, void ***v_out)
{
    size_t rlen = (size_t)o->pool_blocks * kvt_layout_block_bytes(&o->layout);
    void **k = calloc((size_t)o->layout.n_layers, sizeof *k);
    void **v = calloc((size_t)o->layout.n_layers, sizeof *v);
    if (!k || !v) exit(2);
    for (int l = 0; l < o->layout.n_layers; l++) {
        k[l] = aligned_alloc(4096, rlen);
        v[l] = aligned_alloc(4096, rlen);
        if (!k[l] || !v[l]) exit(2);
        memset(k[l], 0, rlen);
        memset(v[l], 0, rlen);
    }
    *v_out = v;
    return k;
}

static void free_regions(const bench_opts *o, void **k, void **v)
{
    for (int l = 0; k && l < o->layout.n_layers; l++) free(k[l]), free(v[l]);
    free(k);
    free(v);
}

static kvt_pool *make_pool(kvt_ctx *ctx, const bench_opts *o, bool ucx, void ***k, void ***v)
{
    kvt_pool_params pp = kvt_pool_default_params();
    pp.layout = o->layout;
    pp.n_blocks = o->pool_blocks;
    *k = *v = NULL;
    if (!ucx) {
        *k = host_regions(o, v);
        pp.k_base = (void *const *)*k;
        pp.v_base = (void *const *)*v;
    }
    kvt_pool *pool;
    char err[PD_ERR_LEN];
    if (kvt_pool_create(ctx, &pp, &pool, err) < 0) {
        fprintf(stderr, "kvt-bench: %s\n", err);
        return NULL;
    }
    return pool;
}

/* The event loop: sleep on the fds when idle, or (--spin) poll without sleeping. */
static int bench_loop(const bench_opts *o, kvt_ctx *ctx, int fd, int max_ms)
{
    if (!o->spin) return kvh_loop(ctx, fd, max_ms);
    kvt_progress(ctx);
    struct pollfd p = {.fd = fd, .events = POLLIN};
    return fd >= 0 && poll(&p, 1, 0) > 0;
}

/* ---------------------------------------------------------------- sender process */

static int run_sender(const bench_opts *o, int sock)
{
    pin(o->cpu_send);
    static ev_state st;
    st.sock = sock;
    kvt_ctx *ctx = make_ctx("prefill", o, &st);
    if (!ctx) return 2;
    void **k, **v;
    kvt_pool *src = make_pool(ctx, o, o->src_ucx, &k, &v);
    if (!src) return 2;
    kvh_fill_pool(src, 42);
    uint32_t type;
    void *msg;
    size_t len;
    if (kvh_recv(sock, &type, &msg, &len, 30000) != 0 || type != MSG_DESC) return 2;
    kvt_target *t;
    char err[PD_ERR_LEN];
    if (kvt_target_open(ctx, src, msg, len, &t, err) < 0) {
        fprintf(stderr, "kvt-bench: %s\n", err);
        return 2;
    }
    free(msg);
    int rc = 0;
    bool quit = false;
    while (!quit || st.n_live > 0) {
        int readable = bench_loop(o, ctx, quit ? -1 : sock, st.n_live ? 1 : 100);
        /* Layers become ready on a simulated compute schedule (--layer-us). */
        double now = kvh_ms();
        for (int i = 0; i < st.n_live; i++) {
            live_send *ls = &st.live[i];
            while (ls->next_layer < o->layout.n_layers && now >= ls->t_next) {
                kvt_send_layer_ready(ls->s, ls->next_layer++);
                ls->t_next += o->layer_us / 1000.0;
            }
            if (ls->next_layer == o->layout.n_layers) {
                kvt_send_finish(ls->s, 7);
                ls->next_layer++;
            }
        }
        if (!readable) continue;
        if (kvh_recv(sock, &type, &msg, &len, 1000) != 0) {
            rc = 2;
            break;
        }
        if (type == MSG_QUIT) {
            quit = true;
        } else if (type == MSG_REQ && st.n_live < 256) {
            req_msg *rq = msg;
            kvt_send_params sp = kvt_send_default_params();
            sp.req_id = rq->req_id;
            sp.n_blocks = rq->n;
            sp.src_ids = rq->ids;
            sp.dst_ids = rq->ids + rq->n;
            sp.checksum_data = o->checksum;
            kvt_send *s;
            if (kvt_send_begin(t, &sp, &s, err) < 0) {
                fprintf(stderr, "kvt-bench: %s\n", err);
                rc = 2;
                free(msg);
                break;
            }
            st.live[st.n_live++] = (live_send){.s = s, .t_next = kvh_ms(), .next_layer = 0};
        }
        free(msg);
    }
    kvt_target_close(t);
    kvt_ctx_destroy(ctx);
    free_regions(o, k, v);
    return rc;
}

/* ---------------------------------------------------------------- receiver process */

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static int run_receiver(const bench_opts *o, int sock, pid_t child)
{
    pin(o->cpu_recv);
    static ev_state st;
    kvt_ctx *ctx = make_ctx("decode", o, &st);
    if (!ctx) return 2;
    void **k, **v;
    kvt_pool *pool = make_pool(ctx, o, o->dst_ucx, &k, &v);
    if (!pool) return 2;
    void *desc;
    size_t dlen;
    char err[PD_ERR_LEN];
    if (kvt_pool_export(pool, &desc, &dlen, err) < 0 || kvh_send(sock, MSG_DESC, desc, dlen) < 0)
        return 2;
    free(desc);
    int32_t n = o->blocks, C = o->conc, L = o->layout.n_layers;
    size_t bb = kvt_pool_block_bytes(pool);
    uint64_t bytes = (uint64_t)n * (uint64_t)L * 2u * bb;
    int32_t *perm_dst = malloc(sizeof(int32_t) * (size_t)o->pool_blocks);
    int32_t *perm_src = malloc(sizeof(int32_t) * (size_t)o->pool_blocks);
    size_t rq_len = sizeof(req_msg) + sizeof(int32_t) * 2 * (size_t)n;
    req_msg *rq = malloc(rq_len);
    double *lat = calloc((size_t)(o->iters * C), sizeof *lat);
    if (!perm_dst || !perm_src || !rq || !lat) return 2;
    int n_lat = 0, n_verified = 0, rc = 0;
    double wall_sum = 0;
    uint64_t next_req = 1;
    for (int it = 0; it < o->warmup + o->iters && rc == 0; it++) {
        kvh_permute(perm_dst, o->pool_blocks, 1000 + (uint64_t)it);
        kvh_permute(perm_src, o->pool_blocks, 2000 + (uint64_t)it);
        if (o->contiguous) /* runs of consecutive blocks at a rotating offset */
            for (int32_t i = 0; i < o->pool_blocks; i++)
                perm_dst[i] = perm_src[i] = (i + it * n * C) % o->pool_blocks;
        st.req_base = next_req;
        st.n_req = C;
        memset(st.done, 0, sizeof st.done);
        /* Poison the slots so that stale bytes cannot pass verification. */
        for (int32_t c = 0; c < C && o->verify; c++)
            for (int32_t l = 0; l < L; l++)
                for (int kv = 0; kv < 2; kv++)
                    for (int32_t i = 0; i < n; i++)
                        memset((uint8_t *)kvt_pool_region(pool, l, kv) +
                                   (size_t)perm_dst[c * n + i] * bb, 0xee, bb);
        double t0 = kvh_ms();
        for (int32_t c = 0; c < C; c++) {
            kvt_recv_params rp = kvt_recv_default_params();
            rp.req_id = next_req + (uint64_t)c;
            rp.n_blocks = n;
            rp.block_ids = perm_dst + c * n;
            if (kvt_recv_expect(pool, &rp, err) < 0) {
                fprintf(stderr, "kvt-bench: %s\n", err);
                return 2;
            }
            rq->req_id = rp.req_id;
            rq->n = n;
            memcpy(rq->ids, perm_src + c * n, sizeof(int32_t) * (size_t)n);
            memcpy(rq->ids + n, perm_dst + c * n, sizeof(int32_t) * (size_t)n);
            kvh_send(sock, MSG_REQ, rq, rq_len);
        }
        int got_done = 0, got_sent = 0;
        while (got_done < C || got_sent < C) {
            if (bench_loop(o, ctx, sock, 100)) {
                uint32_t type;
                void *msg;
                size_t len;
                if (kvh_recv(sock, &type, &msg, &len, 1000) != 0) {
                    rc = 2;
                    break;
                }
                if (type == MSG_SENT) {
                    sent_msg *sm = msg;
                    if (sm->status != 0) rc = 1;
                    else if (it >= o->warmup) lat[n_lat++] = sm->ms;
                    got_sent++;
                }
                free(msg);
            }
            got_done = 0;
            for (int32_t c = 0; c < C; c++) got_done += st.done[c] != 0;
        }
        double wall = kvh_ms() - t0;
        if (it >= o->warmup) wall_sum += wall;
        for (int32_t c = 0; c < C && rc == 0; c++) {
            if (st.done[c] != 1) {
                rc = 1;
                break;
            }
            if (o->verify) {
                for (int32_t l = 0; l < L && rc == 0; l++)
                    for (int kv = 0; kv < 2 && rc == 0; kv++)
                        for (int32_t i = 0; i < n; i++) {
                            const uint8_t *p = (const uint8_t *)kvt_pool_region(pool, l, kv) +
                                               (size_t)perm_dst[c * n + i] * bb;
                            long off = kvh_check(p, bb, 42, l, kv, perm_src[c * n + i]);
                            if (off >= 0) {
                                fprintf(stderr, "kvt-bench: byte %ld of layer %d %c block %d "
                                        "(slot %d) is wrong\n", off, l, kv ? 'V' : 'K', i,
                                        perm_dst[c * n + i]);
                                rc = 1;
                                break;
                            }
                        }
                if (rc == 0) n_verified++;
            }
            kvt_recv_release(pool, st.req_base + (uint64_t)c);
        }
        next_req += (uint64_t)C;
    }
    kvh_send(sock, MSG_QUIT, NULL, 0);
    kvt_stats ks;
    kvt_ctx_stats(ctx, &ks);
    int status = 0;
    while (waitpid(child, &status, 0) < 0 && errno == EINTR) {}
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) rc = rc ? rc : 2;
    if (n_lat > 0) {
        qsort(lat, (size_t)n_lat, sizeof *lat, cmp_double);
        double med = lat[n_lat / 2], p90 = lat[(n_lat * 9) / 10 < n_lat ? (n_lat * 9) / 10 : n_lat - 1];
        double gb = (double)bytes / 1e9;
        printf("kvt-bench: %s, %d layers x %d blocks x %zu B x {K,V} = %.1f MiB per transfer, "
               "%d at a time\n", ks.last_transport_name, L, n, bb, (double)bytes / 1048576.0, C);
        printf("kvt-bench: %d transfers: latency median %.2f ms, p90 %.2f, min %.2f, max %.2f; "
               "%.2f GB/s at the median, %.2f best; aggregate %.2f GB/s; verified %d\n", n_lat,
               med, p90, lat[0], lat[n_lat - 1], gb / (med / 1e3), gb / (lat[0] / 1e3),
               gb * (double)n_lat / (wall_sum / 1e3), n_verified);
        printf("RESULT transport=%s kind=%s bytes=%llu transfers=%d conc=%d median_ms=%.3f "
               "min_ms=%.3f gbps_median=%.2f gbps_best=%.2f gbps_aggregate=%.2f verified=%d\n",
               ks.last_transport_name, kvt_transport_name(ks.last_transport),
               (unsigned long long)bytes, n_lat, C, med, lat[0], gb / (med / 1e3),
               gb / (lat[0] / 1e3), gb * (double)n_lat / (wall_sum / 1e3), n_verified);
    }
    free(perm_dst);
    free(perm_src);
    free(rq);
    free(lat);
    kvt_ctx_destroy(ctx);
    free_regions(o, k, v);
    return rc;
}

/* ---------------------------------------------------------------- memcpy ceiling */

/* The same pattern as a local copy in one process (the physical ceiling of a transfer):
 * every layer's K and V blocks of a request into permuted slots of a pool of the same size
 * as the receiver's. */
static int run_memcpy(const bench_opts *o)
{
    pin(o->cpu_send);
    size_t bb = kvt_layout_block_bytes(&o->layout);
    int32_t L = o->layout.n_layers, n = o->blocks, nb = o->pool_blocks;
    size_t rlen = (size_t)nb * bb;
    uint8_t *src = aligned_alloc(4096, rlen * 2 * (size_t)L);
    uint8_t *dst = aligned_alloc(4096, rlen * 2 * (size_t)L);
    int32_t *ps = malloc(sizeof(int32_t) * (size_t)nb), *pd = malloc(sizeof(int32_t) * (size_t)nb);
    double *lat = calloc((size_t)o->iters, sizeof *lat);
    if (!src || !dst || !ps || !pd || !lat) return 2;
    memset(src, 1, rlen * 2 * (size_t)L);
    memset(dst, 0, rlen * 2 * (size_t)L);
    for (int it = 0; it < o->warmup + o->iters; it++) {
        kvh_permute(ps, nb, 2000 + (uint64_t)it);
        kvh_permute(pd, nb, 1000 + (uint64_t)it);
        double t0 = kvh_ms();
        for (int32_t r = 0; r < 2 * L; r++)
            for (int32_t i = 0; i < n; i++)
                memcpy(dst + (size_t)r * rlen + (size_t)pd[i] * bb,
                       src + (size_t)r * rlen + (size_t)ps[i] * bb, bb);
        if (it >= o->warmup) lat[it - o->warmup] = kvh_ms() - t0;
    }
    qsort(lat, (size_t)o->iters, sizeof *lat, cmp_double);
    double gb = (double)n * L * 2 * (double)bb / 1e9;
    printf("kvt-bench memcpy: %d layers x %d blocks x %zu B x {K,V} into permuted slots of a "
           "%.0f MiB pool: median %.2f ms = %.2f GB/s, best %.2f GB/s\n", L, n, bb,
           (double)rlen * 2 * L / 1048576.0, lat[o->iters / 2], gb / (lat[o->iters / 2] / 1e3),
           gb / (lat[0] / 1e3));
    printf("RESULT memcpy median_ms=%.3f gbps_median=%.2f gbps_best=%.2f\n", lat[o->iters / 2],
           gb / (lat[o->iters / 2] / 1e3), gb / (lat[0] / 1e3));
    free(src), free(dst), free(ps), free(pd), free(lat);
    return 0;
}

/* ---------------------------------------------------------------- main */

static void usage(void)
{
    fprintf(stderr,
            "usage: pdserve-kvt-bench [options]\n"
            "  --layers N        layers (32)            --blocks N      blocks per request (64)\n"
            "  --block-size N    tokens per block (16)  --kv-heads N    KV heads (8)\n"
            "  --head-dim N      head dim (128)         --dtype T       bf16|f16|f32 (bf16)\n"
            "  --pool-blocks N   blocks per pool (4 x blocks x concurrency)\n"
            "  --iters N         timed transfers per concurrency slot (20)\n"
            "  --warmup N        untimed rounds first (2)\n"
            "  --concurrency N   requests in flight at once (1, at most 256)\n"
            "  --path P          auto|put|am (auto)     --layer-us N    compute gap per layer (0)\n"
            "  --src-mem M       ucx|host: UCX-allocated or malloc'ed source pool (ucx)\n"
            "  --dst-mem M       ucx|host: the same for the decode pool (ucx)\n"
            "  --checksum        xxh3 of every byte on both sides\n"
            "  --no-verify       skip the byte-for-byte check after each round\n"
            "  --cpus R,S        pin receiver and sender to these CPUs (0,1; -1 = no pinning)\n"
            "  --memcpy          measure the same pattern as a local memcpy (the ceiling)\n"
            "  --contiguous      consecutive slots instead of permuted ones\n"
            "  --spin            busy-poll instead of sleeping on the event fd\n"
            "  --spin-us N       kvt_params.spin_us (default 100)\n"
            "  --am-kib N --max-op-kib N --window N --am-staging N   kvt_params overrides\n"
            "UCX_TLS / UCX_NET_DEVICES select the transport (e.g. UCX_TLS=sysv,cma or\n"
            "UCX_TLS=tcp UCX_NET_DEVICES=lo).\n");
}

int main(int argc, char **argv)
{
    bench_opts o = {.blocks = 64, .iters = 20, .warmup = 2, .conc = 1, .path = KVT_PATH_AUTO,
                    .verify = true, .src_ucx = true, .dst_ucx = true, .cpu_recv = 0, .am_staging = -1,
                    .spin_us = -1,
                    .cpu_send = 1};
    o.layout = (kvt_layout){.model_id = "bench", .dtype = PD_DTYPE_BF16, .n_layers = 32,
                            .block_size = 16, .n_kv_heads = 8, .head_dim = 128};
    static const struct option lo[] = {
        {"layers", 1, 0, 'L'}, {"blocks", 1, 0, 'b'}, {"block-size", 1, 0, 's'},
        {"kv-heads", 1, 0, 'k'}, {"head-dim", 1, 0, 'd'}, {"dtype", 1, 0, 't'},
        {"pool-blocks", 1, 0, 'P'}, {"iters", 1, 0, 'i'}, {"warmup", 1, 0, 'w'},
        {"concurrency", 1, 0, 'c'}, {"path", 1, 0, 'p'}, {"layer-us", 1, 0, 'u'},
        {"src-mem", 1, 0, 'S'}, {"dst-mem", 1, 0, 'D'}, {"checksum", 0, 0, 'C'},
        {"no-verify", 0, 0, 'V'}, {"cpus", 1, 0, 'x'}, {"memcpy", 0, 0, 'M'},
        {"contiguous", 0, 0, 'G'}, {"am-kib", 1, 0, 'A'}, {"max-op-kib", 1, 0, 'O'},
        {"window", 1, 0, 'W'}, {"spin", 0, 0, 'Z'}, {"am-staging", 1, 0, 'T'},
        {"spin-us", 1, 0, 'U'},
        {"help", 0, 0, 'h'}, {0, 0, 0, 0}};
    int c;
    while ((c = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
        switch (c) {
        case 'L': o.layout.n_layers = atoi(optarg); break;
        case 'b': o.blocks = atoi(optarg); break;
        case 's': o.layout.block_size = atoi(optarg); break;
        case 'k': o.layout.n_kv_heads = atoi(optarg); break;
        case 'd': o.layout.head_dim = atoi(optarg); break;
        case 't':
            o.layout.dtype = !strcmp(optarg, "f32") ? PD_DTYPE_F32
                             : !strcmp(optarg, "f16") ? PD_DTYPE_F16 : PD_DTYPE_BF16;
            break;
        case 'P': o.pool_blocks = atoi(optarg); break;
        case 'i': o.iters = atoi(optarg); break;
        case 'w': o.warmup = atoi(optarg); break;
        case 'c': o.conc = atoi(optarg); break;
        case 'p':
            o.path = !strcmp(optarg, "put") ? KVT_PATH_PUT
                     : !strcmp(optarg, "am") ? KVT_PATH_AM : KVT_PATH_AUTO;
            break;
        case 'u': o.layer_us = atoi(optarg); break;
        case 'S': o.src_ucx = strcmp(optarg, "host") != 0; break;
        case 'D': o.dst_ucx = strcmp(optarg, "host") != 0; break;
        case 'C': o.checksum = true; break;
        case 'V': o.verify = false; break;
        case 'x': sscanf(optarg, "%d,%d", &o.cpu_recv, &o.cpu_send); break;
        case 'M': o.memcpy_only = true; break;
        case 'G': o.contiguous = true; break;
        case 'Z': o.spin = true; break;
        case 'T': o.am_staging = atoi(optarg); break;
        case 'U': o.spin_us = atoi(optarg); break;
        case 'A': o.am_kib = atoi(optarg); break;
        case 'O': o.max_op_kib = atoi(optarg); break;
        case 'W': o.window = atoi(optarg); break;
        default: usage(); return c == 'h' ? 0 : 2;
        }
    }
    if (o.conc < 1 || o.conc > 256 || o.blocks < 1 || o.iters < 1 || o.warmup < 0 ||
        o.layout.n_layers < 1) {
        usage();
        return 2;
    }
    if (o.pool_blocks == 0) o.pool_blocks = 4 * o.blocks * o.conc;
    if (o.pool_blocks < o.blocks * o.conc) {
        fprintf(stderr, "kvt-bench: --pool-blocks must hold blocks x concurrency\n");
        return 2;
    }
    if (o.memcpy_only) return run_memcpy(&o);
    if (!getenv("UCX_LOG_FILE")) setenv("UCX_LOG_FILE", "stderr", 0);
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) return 2;
    pid_t pid = fork();
    if (pid < 0) return 2;
    if (pid == 0) {
        close(sv[0]);
        _exit(run_sender(&o, sv[1]));
    }
    close(sv[1]);
    int rc = run_receiver(&o, sv[0], pid);
    close(sv[0]);
    return rc;
}
