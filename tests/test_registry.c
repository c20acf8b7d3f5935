/* test_registry.c -- The router's instance registry (router/registry.h) against in-process
 * LoadReport servers on loopback, with an injected resolver that answers, fails or blocks on
 * demand: a failed lookup keeps the name's instances; a lookup that hangs does not block
 * rtr_pick_decode / rtr_pick_prefill; an instance that DNS removes while a request still holds
 * it leaves no dangling prefix-affinity entry (rtr_note_prefix after the removal). */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "common/log.h"
#include "common/rpc/rpc.h"
#include "pdserve/internal/v1/instance.pb-c.h"
#include "router/registry.h"
#include "tests/test_util.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void sleep_ms(int ms)
{
    struct timespec t = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}

/* ---- fake instances: a LoadReport server each ---- */

typedef struct {
    Pdserve__Internal__V1__Role role;
    uint32_t free_blocks;
    atomic_llong queued;          /* queued_prefill_tokens it reports */
    atomic_llong rate;            /* prefill_tokens_per_second it reports */
    rpc_server *srv;
    char addr[RTR_ADDR_LEN];
} fake_inst;

static void on_load_report(rpc_call *call, const ProtobufCMessage *req, void *user)
{
    (void)req;
    const fake_inst *f = user;
    Pdserve__Internal__V1__LoadReportResponse r = PDSERVE__INTERNAL__V1__LOAD_REPORT_RESPONSE__INIT;
    r.role = f->role;
    r.free_blocks = f->free_blocks;
    r.total_blocks = 1000;
    r.queued_prefill_tokens = (uint64_t)atomic_load(&f->queued);
    r.prefill_tokens_per_second = (double)atomic_load(&f->rate);
    rpc_call_reply(call, &r.base);
}

static int fake_start(fake_inst *f, Pdserve__Internal__V1__Role role, uint32_t free_blocks)
{
    char err[PD_ERR_LEN];
    f->role = role;
    f->free_blocks = free_blocks;
    atomic_init(&f->queued, 0);
    atomic_init(&f->rate, 0);
    rpc_server_params p = rpc_server_default_params();
    p.listen_addr = "127.0.0.1:0";
    p.n_threads = 1;
    p.shutdown_grace_ms = 100;
    if (rpc_server_create(&p, &f->srv, err) < 0 ||
        rpc_server_register(f->srv, &pdserve__internal__v1__instance__descriptor, "LoadReport",
                            RPC_UNARY, on_load_report, f, err) < 0 ||
        rpc_server_start(f->srv, err) < 0) {
        fprintf(stderr, "fake instance: %s\n", err);
        return -1;
    }
    snprintf(f->addr, sizeof f->addr, "127.0.0.1:%d", rpc_server_port(f->srv));
    return 0;
}

/* ---- the injected resolver ---- */

enum { RES_OK, RES_FAIL, RES_BLOCK };

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int mode;                     /* RES_* */
    bool blocked;                 /* a lookup waits in RES_BLOCK */
    const char *pre[4], *dec[4];  /* addresses of "pre.test" and "dec.test" */
    int n_pre, n_dec;
    int calls;
} fake_dns;

static fake_dns g_dns = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, RES_OK, false,
                         {NULL}, {NULL}, 0, 0, 0};

static int fake_resolve(void *arg, const char *host, const char *port, char (*out)[RTR_ADDR_LEN],
                        int max, char *err)
{
    (void)port;
    fake_dns *d = arg;
    pthread_mutex_lock(&d->mu);
    d->calls++;
    while (d->mode == RES_BLOCK) { /* a DNS server that does not answer */
        d->blocked = true;
        pthread_cond_broadcast(&d->cv);
        pthread_cond_wait(&d->cv, &d->mu);
    }
    d->blocked = false;
    int n = 0;
    if (d->mode == RES_FAIL) {
        n = pd_errf(err, PD_ENOTFOUND, "Temporary failure in name resolution (test)");
    } else {
        bool pre = !strcmp(host, "pre.test");
        const char **a = pre ? d->pre : d->dec;
        int na = pre ? d->n_pre : d->n_dec;
        for (int i = 0; i < na && n < max; i++) snprintf(out[n++], RTR_ADDR_LEN, "%s", a[i]);
    }
    pthread_cond_broadcast(&d->cv);
    pthread_mutex_unlock(&d->mu);
    return n;
}

static void dns_set(int mode)
{
    pthread_mutex_lock(&g_dns.mu);
    g_dns.mode = mode;
    pthread_cond_broadcast(&g_dns.cv);
    pthread_mutex_unlock(&g_dns.mu);
}

/* Releases a blocked lookup after a while, so that a registry that resolves under its mutex
 * makes the test fail on timing instead of hanging it. */
static void *watchdog(void *arg)
{
    (void)arg;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += 3;
    pthread_mutex_lock(&g_dns.mu);
    while (g_dns.mode == RES_BLOCK)
        if (pthread_cond_timedwait(&g_dns.cv, &g_dns.mu, &ts) != 0) break; /* timed out */
    g_dns.mode = RES_OK;
    pthread_cond_broadcast(&g_dns.cv);
    pthread_mutex_unlock(&g_dns.mu);
    return NULL;
}

/* ---- helpers ---- */

static int count_up(rtr_registry *r, const char *addr)
{
    rtr_instance_info v[16];
    int n = rtr_registry_snapshot(r, v, 16), up = 0;
    for (int i = 0; i < n; i++)
        if ((!addr || !strcmp(v[i].addr, addr)) && v[i].up) up++;
    return up;
}

static bool listed(rtr_registry *r, const char *addr)
{
    rtr_instance_info v[16];
    int n = rtr_registry_snapshot(r, v, 16);
    for (int i = 0; i < n; i++)
        if (!strcmp(v[i].addr, addr)) return true;
    return false;
}

int main(void)
{
    pd_log_set_level(PD_LOG_WARN);
    fake_inst d1, d2, p1, p2;
    if (fake_start(&d1, PDSERVE__INTERNAL__V1__ROLE__ROLE_DECODE, 100) < 0 ||
        fake_start(&d2, PDSERVE__INTERNAL__V1__ROLE__ROLE_DECODE, 50) < 0 ||
        fake_start(&p1, PDSERVE__INTERNAL__V1__ROLE__ROLE_PREFILL, 10) < 0 ||
        fake_start(&p2, PDSERVE__INTERNAL__V1__ROLE__ROLE_PREFILL, 10) < 0)
        return 1;
    g_dns.dec[0] = d1.addr;
    g_dns.dec[1] = d2.addr;
    g_dns.n_dec = 2;
    g_dns.pre[0] = p1.addr;
    g_dns.n_pre = 1;

    rtr_registry_params rp = rtr_registry_default_params();
    rp.prefill = "pre.test:50071";
    rp.decode = "dec.test:50061";
    rp.poll_ms = 20;
    rp.resolve_ms = 50;
    rp.report_timeout_ms = 2000;
    rp.resolve = fake_resolve;
    rp.resolve_arg = &g_dns;
    rtr_registry *r = NULL;
    char err[PD_ERR_LEN];
    CHECK_EQ_INT(rtr_registry_create(&rp, &r, err), 0);
    if (!r) return 1;
    int np, nd, nh;
    rtr_registry_counts(r, &np, &nd, &nh);
    CHECK_EQ_INT(np, 1);
    CHECK_EQ_INT(nd, 2);
    CHECK_EQ_INT(nh, 3);
    rtr_instance *i = rtr_pick_decode(r, NULL);
    CHECK(i && !strcmp(rtr_instance_addr(i), d1.addr)); /* most free blocks */
    rtr_instance_unref(i);

    /* 1. Lookups fail (a DNS outage): every instance stays and routing goes on. */
    dns_set(RES_FAIL);
    int64_t f0 = rtr_registry_resolve_failures(r);
    for (int t = 0; t < 400 && rtr_registry_resolve_failures(r) < f0 + 4; t++) sleep_ms(10);
    CHECK(rtr_registry_resolve_failures(r) >= f0 + 4); /* two rounds, both names */
    rtr_registry_counts(r, &np, &nd, &nh);
    CHECK_EQ_INT(np, 1);
    CHECK_EQ_INT(nd, 2);
    CHECK_EQ_INT(nh, 3);
    i = rtr_pick_decode(r, NULL);
    CHECK(i != NULL);
    rtr_instance_unref(i);
    i = rtr_pick_prefill(r, NULL, 0, 10, NULL);
    CHECK(i && !strcmp(rtr_instance_addr(i), p1.addr));
    rtr_instance_unref(i);

    /* 2. A lookup hangs: picking does not wait for it. */
    dns_set(RES_BLOCK);
    pthread_mutex_lock(&g_dns.mu);
    for (int t = 0; t < 100 && !g_dns.blocked; t++) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 50000000;
        if (ts.tv_nsec >= 1000000000) ts.tv_sec++, ts.tv_nsec -= 1000000000;
        pthread_cond_timedwait(&g_dns.cv, &g_dns.mu, &ts);
    }
    bool blocked = g_dns.blocked;
    pthread_mutex_unlock(&g_dns.mu);
    CHECK(blocked);
    pthread_t wd;
    pthread_create(&wd, NULL, watchdog, NULL);
    double t0 = now_s();
    rtr_instance *a = rtr_pick_decode(r, NULL);
    double t_dec = now_s() - t0;
    t0 = now_s();
    rtr_instance *b = rtr_pick_prefill(r, NULL, 0, 10, NULL);
    double t_pre = now_s() - t0;
    t0 = now_s();
    rtr_registry_counts(r, &np, &nd, &nh);
    double t_cnt = now_s() - t0;
    CHECK_MSG(a && t_dec < 0.5, "rtr_pick_decode took %.3f s during a hung lookup", t_dec);
    CHECK_MSG(b && t_pre < 0.5, "rtr_pick_prefill took %.3f s during a hung lookup", t_pre);
    CHECK_MSG(t_cnt < 0.5, "rtr_registry_counts took %.3f s during a hung lookup", t_cnt);
    rtr_instance_unref(a);
    rtr_instance_unref(b);
    dns_set(RES_OK);
    pthread_join(wd, NULL);

    /* 3. DNS moves the prefill name from p1 to p2 while a request holds p1 and notes its
     * prefix on it afterwards (the order a request and the poller can take); once that request
     * drops p1 it is freed, and the affinity entry must not lead to it. */
    for (int t = 0; t < 500 && count_up(r, NULL) < 3; t++) sleep_ms(10);
    rtr_instance *held = rtr_pick_prefill(r, NULL, 0, 10, NULL);
    CHECK(held && !strcmp(rtr_instance_addr(held), p1.addr));
    pthread_mutex_lock(&g_dns.mu);
    g_dns.pre[0] = p2.addr;
    pthread_mutex_unlock(&g_dns.mu);
    for (int t = 0; t < 500 && (listed(r, p1.addr) || count_up(r, p2.addr) < 1); t++) sleep_ms(10);
    CHECK(!listed(r, p1.addr));
    CHECK_EQ_INT(count_up(r, p2.addr), 1);
    const uint64_t key = 0x1234567890abcdefull;
    rtr_note_prefix(r, key, held); /* after its removal */
    rtr_instance_unref(held);      /* the last reference: p1's instance is freed */
    rtr_instance *q = rtr_pick_prefill(r, NULL, key, 10, NULL); /* ASan: no use after free */
    CHECK(q && !strcmp(rtr_instance_addr(q), p2.addr));
    /* Affinity still works for a live instance. */
    rtr_note_prefix(r, key, q);
    rtr_instance_unref(q);
    q = rtr_pick_prefill(r, NULL, key, 10, NULL);
    CHECK(q && !strcmp(rtr_instance_addr(q), p2.addr));
    rtr_instance_unref(q);
    /* 4. The prefill wait estimate: backlog (+ extra tokens) over the reported rate; none
     * (-1) while the instance has not reported a rate. */
    CHECK(rtr_prefill_wait_min(r, 0) < 0);
    atomic_store(&p2.queued, 6000);
    atomic_store(&p2.rate, 20000);
    double w = -1;
    for (int t = 0; t < 500; t++) {
        w = rtr_prefill_wait_min(r, 0);
        if (w > 0.29) break;
        sleep_ms(10);
    }
    CHECK_MSG(w > 0.299 && w < 0.301, "wait %.4f s, want 6000 / 20000 = 0.3", w);
    w = rtr_prefill_wait_min(r, 2000);
    CHECK_MSG(w > 0.399 && w < 0.401, "wait %.4f s with 2000 more tokens, want 0.4", w);
    atomic_store(&p2.rate, 0);
    for (int t = 0; t < 500 && rtr_prefill_wait_min(r, 0) >= 0; t++) sleep_ms(10);
    CHECK(rtr_prefill_wait_min(r, 0) < 0);
    rtr_instance_info v[16];
    int nv = rtr_registry_snapshot(r, v, 16);
    bool seen = false;
    for (int k = 0; k < nv; k++)
        if (!strcmp(v[k].addr, p2.addr)) seen = v[k].prefill_rate == 0;
    CHECK(seen);

    /* A decode address that goes away on a good lookup is removed too. */
    pthread_mutex_lock(&g_dns.mu);
    g_dns.n_dec = 1;
    pthread_mutex_unlock(&g_dns.mu);
    for (int t = 0; t < 500 && listed(r, d2.addr); t++) sleep_ms(10);
    CHECK(!listed(r, d2.addr));
    CHECK(listed(r, d1.addr));

    rtr_registry_destroy(r);
    rpc_server_destroy(d1.srv);
    rpc_server_destroy(d2.srv);
    rpc_server_destroy(p1.srv);
    rpc_server_destroy(p2.srv);
    return pd_test_result("test_registry");
}
