/* registry.c -- Instance discovery (getaddrinfo or an injected resolver, periodic, without
 * the routing mutex), load-report polling on a background thread, and instance selection
 * (see registry.h). */
#include "router/registry.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/error.h"
#include "common/log.h"

#define MAX_INST 256
#define AFFINITY_SLOTS 4096

struct rtr_instance {
    atomic_int refs;
    uint64_t id;                  /* unique in the registry, never reused (affinity keys) */
    char addr[RTR_ADDR_LEN];      /* "ip:port" */
    char name[RTR_ADDR_LEN];      /* the list entry it was resolved from ("host:port") */
    bool prefill;                 /* from the --prefill list */
    rpc_channel *ch;
    rpc_channel *rch;             /* load reports: a channel (and completion thread) of their
                                     own, so that a flood of token messages on ch never delays
                                     a report into a false stall */
    /* guarded by the registry mutex */
    bool present;                 /* still resolved */
    bool healthy;                 /* last load report succeeded */
    bool draining;
    Pdserve__Internal__V1__Role role;
    Pdserve__Internal__V1__KvLayout layout;
    bool has_layout;
    int64_t free_blocks, total_blocks, running, waiting, queued_tokens;
    int64_t local_blocks, local_tokens; /* routed since the last report */
    double tpot_ewma;             /* seconds; mean TPOT of the requests it decoded (0 = none) */
    double prefill_rate;          /* prompt tokens/s it reported (0 = not measured yet) */
    /* Stall detection (guarded by the registry mutex): */
    uint64_t steps;               /* engine steps in its last report */
    int64_t progress_ms;          /* when a report last showed progress: its steps advanced,
                                     or it held no running sequence (now_ms clock) */
    int64_t report_ms;            /* when its last report arrived */
    int64_t poll_started_ms;      /* when the report in flight (polling) was asked for */
    bool report_failed;           /* its last report failed (timed out, refused) */
    bool stalled;                 /* last seen stalled by rtr_registry_stalled (its log) */
    bool polling;                 /* a LoadReport call is in flight (the poller's) */
    int64_t next_poll_ms;         /* when the next one is due */
    atomic_llong routed, errors;  /* metrics */
};

struct rtr_registry {
    rtr_registry_params p;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t thread;
    bool stop, started;
    rtr_instance *inst[MAX_INST];
    int n_inst;
    uint64_t aff_key[AFFINITY_SLOTS];
    uint64_t aff_id[AFFINITY_SLOTS]; /* rtr_instance.id that last prefilled aff_key (an id,
                                        not a pointer: the instance may be gone and freed) */
    uint64_t last_id;             /* ids handed out (resolve only) */
    atomic_llong resolve_failures; /* lookups that failed (their names kept their instances) */
    bool has_prefill;
    int n_polls;                  /* LoadReport calls in flight (mu; destroy waits for 0) */
};

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

void rtr_instance_ref(rtr_instance *i) { atomic_fetch_add(&i->refs, 1); }

void rtr_instance_unref(rtr_instance *i)
{
    if (!i || atomic_fetch_sub(&i->refs, 1) != 1) return;
    rpc_channel_destroy(i->rch);
    rpc_channel_destroy(i->ch);
    free(i);
}

rpc_channel *rtr_instance_channel(const rtr_instance *i) { return i->ch; }
const char *rtr_instance_addr(const rtr_instance *i) { return i->addr; }
bool rtr_instance_colocated(const rtr_instance *i)
{
    return i->role == PDSERVE__INTERNAL__V1__ROLE__ROLE_COLOCATED;
}

/* The default resolver: getaddrinfo (see rtr_resolve_fn). */
static int resolve_getaddrinfo(void *arg, const char *host, const char *port,
                               char (*out)[RTR_ADDR_LEN], int max, char *err)
{
    (void)arg;
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_socktype = SOCK_STREAM;
    int rc = getaddrinfo(host, port, &hints, &res);
    if (rc != 0)
        return pd_errf(err, PD_ENOTFOUND, "%s", rc == EAI_SYSTEM ? strerror(errno) : gai_strerror(rc));
    int n = 0;
    for (struct addrinfo *a = res; a && n < max; a = a->ai_next) {
        char ip[INET6_ADDRSTRLEN];
        if (a->ai_family == AF_INET)
            inet_ntop(AF_INET, &((struct sockaddr_in *)a->ai_addr)->sin_addr, ip, sizeof ip);
        else if (a->ai_family == AF_INET6)
            inet_ntop(AF_INET6, &((struct sockaddr_in6 *)a->ai_addr)->sin6_addr, ip, sizeof ip);
        else
            continue;
        snprintf(out[n++], RTR_ADDR_LEN, a->ai_family == AF_INET6 ? "[%s]:%s" : "%s:%s", ip, port);
    }
    freeaddrinfo(res);
    return n;
}

/* One address a lookup gave. */
typedef struct {
    char addr[RTR_ADDR_LEN];      /* "ip:port" */
    char name[RTR_ADDR_LEN];      /* the list entry it came from ("host:port") */
    char host[RTR_ADDR_LEN];      /* its host as written (no brackets): the TLS server name */
    bool prefill;
} found_addr;

/* The outcome of one round of lookups (made without the registry mutex). */
typedef struct {
    found_addr a[MAX_INST];       /* addresses resolved, [n] */
    int n;
    struct {
        char name[RTR_ADDR_LEN];
        bool prefill;
    } failed[MAX_INST];           /* list entries whose lookup failed, [n_failed] */
    int n_failed;
    char tmp[MAX_INST][RTR_ADDR_LEN]; /* the resolver's output */
} lookup;

/* Looks up every "host:port" of list with the resolver into L. No lock held: DNS may take
 * seconds and must not stall routing. */
static void resolve_list(rtr_registry *r, const char *list, bool prefill, lookup *L)
{
    if (!list || !*list) return;
    char *copy = strdup(list);
    if (!copy) return;
    char *save = NULL;
    for (char *tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        while (*tok == ' ') tok++;
        char name[RTR_ADDR_LEN];
        snprintf(name, sizeof name, "%s", tok);
        char *colon = strrchr(tok, ':');
        if (!colon || colon == tok) {
            PD_LOGW("instance address '%s' has no port; ignored", tok);
            continue;
        }
        *colon = 0;
        const char *host = tok, *port = colon + 1;
        char hostbuf[RTR_ADDR_LEN];
        if (host[0] == '[') { /* [v6]:port */
            snprintf(hostbuf, sizeof hostbuf, "%.*s", (int)strlen(host) - 2, host + 1);
            host = hostbuf;
        }
        char err[PD_ERR_LEN] = "";
        int n = r->p.resolve(r->p.resolve_arg, host, port, L->tmp, MAX_INST, err);
        if (n < 0) {
            /* Keep what this name resolved to last time: a DNS hiccup must not drop every
             * instance behind it (the load reports still mark dead ones down). */
            atomic_fetch_add(&r->resolve_failures, 1);
            PD_LOGW("cannot resolve %s: %s; keeping its last known addresses", name, err);
            if (L->n_failed < MAX_INST) {
                snprintf(L->failed[L->n_failed].name, RTR_ADDR_LEN, "%s", name);
                L->failed[L->n_failed++].prefill = prefill;
            }
            continue;
        }
        for (int i = 0; i < n && L->n < MAX_INST; i++) {
            bool dup = false;
            for (int k = 0; k < L->n && !dup; k++)
                dup = L->a[k].prefill == prefill && !strcmp(L->a[k].addr, L->tmp[i]);
            if (dup) continue;
            found_addr *a = &L->a[L->n++];
            snprintf(a->addr, sizeof a->addr, "%s", L->tmp[i]);
            snprintf(a->name, sizeof a->name, "%s", name);
            snprintf(a->host, sizeof a->host, "%s", host);
            a->prefill = prefill;
        }
    }
    free(copy);
}

/* A new instance for a (its channel connects lazily); NULL on failure (logged). */
static rtr_instance *instance_new(rtr_registry *r, const found_addr *a)
{
    rtr_instance *in = calloc(1, sizeof *in);
    if (!in) return NULL;
    atomic_init(&in->refs, 1);
    atomic_init(&in->routed, 0);
    atomic_init(&in->errors, 0);
    in->id = ++r->last_id; /* the poller thread (or create) only */
    snprintf(in->addr, sizeof in->addr, "%s", a->addr);
    snprintf(in->name, sizeof in->name, "%s", a->name);
    in->prefill = a->prefill;
    in->present = true;
    in->progress_ms = in->report_ms = now_ms();
    rpc_channel_params cp = rpc_channel_default_params();
    cp.target = in->addr;
    cp.tls = r->p.tls;
    if (cp.tls.ca_file && *cp.tls.ca_file && !(cp.tls.server_name && *cp.tls.server_name))
        cp.tls.server_name = a->host; /* the name the certificate carries */
    char err[PD_ERR_LEN];
    if (rpc_channel_create(&cp, &in->ch, err) < 0 || rpc_channel_create(&cp, &in->rch, err) < 0) {
        PD_LOGE("instance %s: %s", a->addr, err);
        rpc_channel_destroy(in->ch);
        free(in);
        return NULL;
    }
    return in;
}

/* Re-resolves the lists and updates the instances: the lookups run without the mutex, which
 * is held only to edit the list (routing never waits for DNS). Addresses no longer resolved
 * leave (calls in flight keep their references); a name whose lookup failed keeps its
 * instances. Only one thread runs it at a time (create, then the poller), so the list changes
 * nowhere else between the steps. */
static void resolve(rtr_registry *r)
{
    lookup *L = calloc(1, sizeof *L);
    if (!L) return; /* keep everything as it is */
    resolve_list(r, r->p.prefill, true, L);
    resolve_list(r, r->p.decode, false, L);
    bool known[MAX_INST] = {false}; /* L->a[k] is an instance already */
    rtr_instance *gone[MAX_INST];
    int n_gone = 0;
    pthread_mutex_lock(&r->mu);
    int j = 0;
    for (int i = 0; i < r->n_inst; i++) {
        rtr_instance *in = r->inst[i];
        bool keep = false;
        for (int k = 0; k < L->n_failed && !keep; k++)
            keep = L->failed[k].prefill == in->prefill && !strcmp(L->failed[k].name, in->name);
        for (int k = 0; k < L->n; k++)
            if (L->a[k].prefill == in->prefill && !strcmp(L->a[k].addr, in->addr))
                keep = known[k] = true;
        if (keep) {
            r->inst[j++] = in;
        } else {
            in->present = false;
            gone[n_gone++] = in;
        }
    }
    r->n_inst = j;
    pthread_mutex_unlock(&r->mu);
    for (int i = 0; i < n_gone; i++) { /* unref may destroy a channel: not under the mutex */
        PD_LOGI("instance %s removed (no longer resolved)", gone[i]->addr);
        rtr_instance_unref(gone[i]);
    }
    for (int k = 0; k < L->n; k++) {
        if (known[k]) continue;
        rtr_instance *in = instance_new(r, &L->a[k]);
        if (!in) continue;
        pthread_mutex_lock(&r->mu);
        bool room = r->n_inst < MAX_INST;
        if (room) r->inst[r->n_inst++] = in;
        pthread_mutex_unlock(&r->mu);
        if (room) {
            PD_LOGI("%s instance %s added", in->prefill ? "prefill" : "decode", in->addr);
        } else {
            PD_LOGW("instance %s ignored: more than %d instances", in->addr, MAX_INST);
            rtr_instance_unref(in);
        }
    }
    free(L);
}

/* Applies one load report of in (resp NULL: the call failed, st says why). */
static void apply_report(rtr_registry *r, rtr_instance *in, const ProtobufCMessage *resp,
                         const rpc_status *st)
{
    pthread_mutex_lock(&r->mu);
    bool was = in->healthy;
    if (resp) {
        const Pdserve__Internal__V1__LoadReportResponse *l = (const void *)resp;
        in->healthy = true;
        in->report_failed = false;
        in->report_ms = now_ms();
        if (l->steps != in->steps || l->running_seqs == 0) in->progress_ms = in->report_ms;
        in->steps = l->steps;
        in->draining = l->draining;
        in->role = l->role;
        in->free_blocks = l->free_blocks;
        in->total_blocks = l->total_blocks;
        in->running = l->running_seqs;
        in->waiting = l->waiting_seqs;
        in->queued_tokens = (int64_t)l->queued_prefill_tokens;
        in->prefill_rate = l->prefill_tokens_per_second > 0 ? l->prefill_tokens_per_second : 0;
        in->local_blocks = in->local_tokens = 0;
        if (l->kv_layout) {
            in->layout = *l->kv_layout;
            in->layout.base.descriptor = &pdserve__internal__v1__kv_layout__descriptor;
            in->has_layout = true;
        }
    } else {
        in->healthy = false;
        in->report_failed = true;
        atomic_fetch_add(&in->errors, 1);
    }
    bool now = in->healthy;
    pthread_mutex_unlock(&r->mu);
    if (was != now)
        PD_LOGI("instance %s is %s%s%s", in->addr, now ? "up" : "down", now ? "" : ": ",
                now ? "" : st->details);
}

/* A blocking load report (rtr_registry_create's first round). */
static void poll_one(rtr_registry *r, rtr_instance *in)
{
    Pdserve__Internal__V1__LoadReportRequest q = PDSERVE__INTERNAL__V1__LOAD_REPORT_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    rpc_status st;
    int rc = rpc_unary_call(in->rch, "/pdserve.internal.v1.Instance/LoadReport", &q.base,
                            &pdserve__internal__v1__load_report_response__descriptor,
                            r->p.report_timeout_ms, &resp, &st);
    apply_report(r, in, rc == 0 ? resp : NULL, &st);
    if (resp) protobuf_c_message_free_unpacked(resp, NULL);
}

/* The poller's reports are asynchronous, one call per instance at a time, each on its own
 * schedule: an instance that does not answer (frozen, unreachable) delays nobody else's
 * reports, so the others never look stalled. A call holds a reference to its instance; the
 * registry is destroyed only once no call is in flight (n_polls). */
typedef struct {
    rtr_registry *r;
    rtr_instance *in;
    bool got;
} poll_ctx;

/* A report of in ended (answered or not): the next one is due a period later; drops the
 * call's reference to in. */
static void poll_end(rtr_registry *r, rtr_instance *in)
{
    pthread_mutex_lock(&r->mu);
    in->polling = false;
    in->next_poll_ms = now_ms() + r->p.poll_ms;
    r->n_polls--;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    rtr_instance_unref(in);
}

static void poll_on_message(rpc_client_call *c, ProtobufCMessage *msg, void *user)
{
    (void)c;
    poll_ctx *x = user;
    x->got = true;
    rpc_status ok = {RPC_STATUS_OK, ""};
    apply_report(x->r, x->in, msg, &ok);
    protobuf_c_message_free_unpacked(msg, NULL);
}

static void poll_on_done(rpc_client_call *c, const rpc_status *st, void *user)
{
    (void)c;
    poll_ctx *x = user;
    rtr_registry *r = x->r;
    if (!x->got) {
        rpc_status bad = *st;
        if (bad.code == RPC_STATUS_OK) bad.code = RPC_STATUS_INTERNAL; /* (no message) */
        apply_report(r, x->in, NULL, &bad);
    }
    poll_end(r, x->in);
    free(x);
}

/* Starts the reports that are due (no lock held). */
static void poll_due(rtr_registry *r)
{
    rtr_instance *due[MAX_INST];
    int n = 0;
    const int64_t t = now_ms();
    pthread_mutex_lock(&r->mu);
    for (int i = 0; i < r->n_inst && !r->stop; i++) {
        rtr_instance *in = r->inst[i];
        if (in->polling || t < in->next_poll_ms) continue;
        in->polling = true;
        in->poll_started_ms = t;
        r->n_polls++;
        rtr_instance_ref(in);
        due[n++] = in;
    }
    pthread_mutex_unlock(&r->mu);
    Pdserve__Internal__V1__LoadReportRequest q = PDSERVE__INTERNAL__V1__LOAD_REPORT_REQUEST__INIT;
    for (int i = 0; i < n; i++) {
        poll_ctx *x = calloc(1, sizeof *x);
        rpc_client_call *call = NULL;
        char err[PD_ERR_LEN] = "out of memory";
        int rc = PD_ENOMEM;
        if (x) {
            *x = (poll_ctx){r, due[i], false};
            rpc_client_callbacks cb = {poll_on_message, poll_on_done, x};
            rc = rpc_client_call_start(due[i]->rch, "/pdserve.internal.v1.Instance/LoadReport",
                                       &q.base, &pdserve__internal__v1__load_report_response__descriptor,
                                       r->p.report_timeout_ms, &cb, &call, err);
        }
        if (rc == 0) {
            rpc_client_call_release(call); /* it runs on; its callbacks clean up */
            continue;
        }
        rpc_status st = {RPC_STATUS_INTERNAL, ""};
        snprintf(st.details, sizeof st.details, "%s", err);
        apply_report(r, due[i], NULL, &st);
        poll_end(r, due[i]);
        free(x);
    }
}

static void *poller(void *arg)
{
    rtr_registry *r = arg;
    int64_t next_resolve = now_ms() + r->p.resolve_ms, next_round = now_ms();
    /* Wakes often enough to start each instance's report on time (and to notice stalls). */
    const int64_t tick = r->p.poll_ms < 50 ? r->p.poll_ms : 50;
    for (;;) {
        pthread_mutex_lock(&r->mu);
        bool stop = r->stop;
        pthread_mutex_unlock(&r->mu);
        if (stop) break;
        poll_due(r);
        if (now_ms() >= next_resolve) {
            resolve(r);
            next_resolve = now_ms() + r->p.resolve_ms;
        }
        if (r->p.on_poll && now_ms() >= next_round) {
            r->p.on_poll(r->p.on_poll_arg);
            next_round = now_ms() + r->p.poll_ms;
        }
        pthread_mutex_lock(&r->mu);
        if (!r->stop) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += (long)(tick % 1000) * 1000000;
            ts.tv_sec += tick / 1000 + ts.tv_nsec / 1000000000;
            ts.tv_nsec %= 1000000000;
            pthread_cond_timedwait(&r->cv, &r->mu, &ts);
        }
        pthread_mutex_unlock(&r->mu);
    }
    return NULL;
}

int rtr_registry_create(const rtr_registry_params *p, rtr_registry **out, char *err)
{
    *out = NULL;
    rtr_registry *r = calloc(1, sizeof *r);
    if (!r) return pd_errf(err, PD_ENOMEM, "out of memory");
    r->p = *p;
    if (!r->p.resolve) r->p.resolve = resolve_getaddrinfo;
    atomic_init(&r->resolve_failures, 0);
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
    r->has_prefill = p->prefill && *p->prefill;
    const rpc_client_tls *t = &p->tls;
    if ((t->ca_file && *t->ca_file) || (t->cert_file && *t->cert_file) ||
        (t->key_file && *t->key_file)) { /* bad TLS settings: fail now, naming the file */
        rpc_channel_params cp = rpc_channel_default_params();
        cp.target = "localhost:0";
        cp.tls = p->tls;
        rpc_channel *probe = NULL;
        int rc = rpc_channel_create(&cp, &probe, err);
        rpc_channel_destroy(probe);
        if (rc < 0) {
            rtr_registry_destroy(r);
            return rc;
        }
    }
    resolve(r);
    if (r->n_inst == 0 || !(p->decode && *p->decode)) {
        rtr_registry_destroy(r);
        return pd_errf(err, PD_EINVAL, "no decode instance could be resolved (--decode host:port,...)");
    }
    /* A first round of load reports before serving, so that routing has data. */
    for (int i = 0; i < r->n_inst; i++) poll_one(r, r->inst[i]);
    if (pthread_create(&r->thread, NULL, poller, r) != 0) {
        rtr_registry_destroy(r);
        return pd_errf(err, PD_EBACKEND, "cannot start the load-report thread");
    }
    r->started = true;
    *out = r;
    return 0;
}

void rtr_registry_destroy(rtr_registry *r)
{
    if (!r) return;
    pthread_mutex_lock(&r->mu);
    bool running = r->started;
    r->stop = true;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    if (running) pthread_join(r->thread, NULL);
    /* Reports in flight end within their deadline (report_timeout_ms). */
    pthread_mutex_lock(&r->mu);
    while (r->n_polls > 0) pthread_cond_wait(&r->cv, &r->mu);
    pthread_mutex_unlock(&r->mu);
    for (int i = 0; i < r->n_inst; i++) rtr_instance_unref(r->inst[i]);
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv);
    free(r);
}

/* No progress for stall_ms (mu held): the report asked for has not come back for that long,
 * or its reports have failed since a good one that long ago (frozen, unreachable), or its
 * reports show its engine's steps standing still that long while it had running sequences
 * (a stuck engine). Judged only from reports asked for, so a long --load-poll-ms never makes
 * an idle wait look like a stall. */
static bool stalled(const rtr_registry *r, const rtr_instance *i)
{
    if (r->p.stall_ms <= 0) return false;
    const int64_t t = now_ms();
    if (i->polling && t - i->poll_started_ms > r->p.stall_ms) return true;
    /* reports failing (timed out, refused) since the last good one, that long ago */
    if (i->report_failed && t - i->report_ms > r->p.stall_ms) return true;
    return i->report_ms - i->progress_ms > r->p.stall_ms;
}

/* Up: present, its reports get through, not draining (mu held). */
static bool up(const rtr_instance *i) { return i->present && i->healthy && !i->draining; }

/* Whether i can take work now (mu held): up and not stalled. */
static bool usable(const rtr_registry *r, const rtr_instance *i)
{
    return up(i) && !stalled(r, i);
}

bool rtr_instance_stalled(rtr_registry *r, rtr_instance *i)
{
    pthread_mutex_lock(&r->mu);
    bool s = stalled(r, i);
    pthread_mutex_unlock(&r->mu);
    return s;
}

int rtr_registry_stalled(rtr_registry *r)
{
    pthread_mutex_lock(&r->mu);
    int n = 0;
    for (int k = 0; k < r->n_inst; k++) {
        rtr_instance *i = r->inst[k];
        const bool s = stalled(r, i);
        n += s;
        if (s == i->stalled) continue;
        i->stalled = s; /* logged once per episode */
        if (s) PD_LOGW("instance %s made no progress for %lld ms: stalled (its requests move "
                       "elsewhere)", i->addr, (long long)r->p.stall_ms);
        else PD_LOGI("instance %s makes progress again", i->addr);
    }
    pthread_mutex_unlock(&r->mu);
    return n;
}

rtr_instance *rtr_pick_decode(rtr_registry *r, const rtr_instance *exclude)
{
    pthread_mutex_lock(&r->mu);
    rtr_instance *best = NULL;
    int64_t best_score = INT64_MIN;
    /* A stalled instance only when no other is up: a slow instance (its steps, or its
     * reports, late under load) still serves; a frozen one is soon down (its reports time
     * out). */
    for (int pass = 0; pass < 2 && !best; pass++)
        for (int i = 0; i < r->n_inst; i++) {
            rtr_instance *in = r->inst[i];
            if (in->prefill || !up(in) || in == exclude || (pass == 0 && stalled(r, in))) continue;
            if (in->role == PDSERVE__INTERNAL__V1__ROLE__ROLE_PREFILL) continue;
            int64_t score = (in->free_blocks - in->local_blocks) * 1024 - (in->running + in->waiting);
            if (score > best_score) {
                best_score = score;
                best = in;
            }
        }
    if (best) rtr_instance_ref(best);
    pthread_mutex_unlock(&r->mu);
    return best;
}

static bool same_layout(const Pdserve__Internal__V1__KvLayout *a, const Pdserve__Internal__V1__KvLayout *b)
{
    return a->block_size == b->block_size && a->dtype == b->dtype && a->num_layers == b->num_layers &&
           a->num_kv_heads == b->num_kv_heads && a->head_dim == b->head_dim &&
           a->model_fingerprint == b->model_fingerprint;
}

rtr_instance *rtr_pick_prefill(rtr_registry *r, const Pdserve__Internal__V1__KvLayout *layout,
                               uint64_t key, int32_t n_prompt, const rtr_instance *exclude)
{
    pthread_mutex_lock(&r->mu);
    rtr_instance *best = NULL, *aff = NULL;
    int64_t best_load = INT64_MAX;
    size_t slot = (size_t)(key % AFFINITY_SLOTS);
    uint64_t aff_id = key && r->aff_key[slot] == key ? r->aff_id[slot] : 0;
    for (int i = 0; i < r->n_inst; i++) {
        rtr_instance *in = r->inst[i];
        if (aff_id && in->id == aff_id) aff = in; /* still registered */
        if (!in->prefill || !usable(r, in) || in == exclude) continue;
        if (layout && in->has_layout && !same_layout(layout, &in->layout)) continue;
        int64_t load = in->queued_tokens + in->local_tokens;
        if (load < best_load) {
            best_load = load;
            best = in;
        }
    }
    /* Prefix affinity: the instance that computed this prefix last has it in its cache; take
     * it unless it is busier than the best by more than the work the cache saves. */
    if (aff && aff->prefill && aff != best && aff != exclude && usable(r, aff) &&
        (!layout || !aff->has_layout || same_layout(layout, &aff->layout)) &&
        aff->queued_tokens + aff->local_tokens <= best_load + n_prompt)
        best = aff;
    if (best) rtr_instance_ref(best);
    pthread_mutex_unlock(&r->mu);
    return best;
}

/* A KvDtype value's name as the proto spells it ("KV_DTYPE_F8E4M3"). */
static const char *dtype_name(int d)
{
    const ProtobufCEnumValue *v =
        protobuf_c_enum_descriptor_get_value(&pdserve__internal__v1__kv_dtype__descriptor, d);
    return v ? v->name : "KV_DTYPE_?";
}

bool rtr_prefill_layout_mismatch(rtr_registry *r, const Pdserve__Internal__V1__KvLayout *layout,
                                 char *msg, size_t n)
{
    if (!layout) return false;
    bool found = false;
    pthread_mutex_lock(&r->mu);
    for (int i = 0; i < r->n_inst && !found; i++) {
        const rtr_instance *in = r->inst[i];
        if (!in->prefill || !usable(r, in) || !in->has_layout || same_layout(layout, &in->layout))
            continue;
        found = true;
        snprintf(msg, n, "no prefill instance has the decode instance's KV layout (decode: %s, "
                 "block %u, model %016llx; prefill %s: %s, block %u, model %016llx): prefill and "
                 "decode must run the same model, --kv-cache-dtype, --quantization, --backend "
                 "and --block-size", dtype_name(layout->dtype), layout->block_size,
                 (unsigned long long)layout->model_fingerprint, in->addr,
                 dtype_name(in->layout.dtype), in->layout.block_size,
                 (unsigned long long)in->layout.model_fingerprint);
    }
    pthread_mutex_unlock(&r->mu);
    return found;
}

void rtr_note_prefix(rtr_registry *r, uint64_t key, rtr_instance *inst)
{
    if (!key || !inst) return;
    pthread_mutex_lock(&r->mu);
    r->aff_key[key % AFFINITY_SLOTS] = key;
    r->aff_id[key % AFFINITY_SLOTS] = inst->id;
    pthread_mutex_unlock(&r->mu);
}

bool rtr_has_prefill(rtr_registry *r) { return r->has_prefill; }

int64_t rtr_registry_resolve_failures(rtr_registry *r) { return atomic_load(&r->resolve_failures); }

rtr_registry_params rtr_registry_default_params(void)
{
    rtr_registry_params p;
    memset(&p, 0, sizeof p);
    p.prefill = "";
    p.decode = "";
    p.poll_ms = 500;
    p.resolve_ms = 10000;
    p.report_timeout_ms = 2000;
    p.stall_ms = 1400;
    return p;
}

void rtr_instance_add_load(rtr_instance *i, int64_t blocks, int64_t tokens)
{
    /* Benign race with the poller: these are hints between reports. */
    atomic_fetch_add(&i->routed, 1);
    i->local_blocks += blocks;
    i->local_tokens += tokens;
}

void rtr_instance_failed(rtr_instance *i)
{
    i->healthy = false;
    atomic_fetch_add(&i->errors, 1);
}

int rtr_registry_snapshot(rtr_registry *r, rtr_instance_info *out, int max)
{
    pthread_mutex_lock(&r->mu);
    int n = 0;
    for (int i = 0; i < r->n_inst && n < max; i++) {
        const rtr_instance *in = r->inst[i];
        rtr_instance_info *o = &out[n++];
        memset(o, 0, sizeof *o);
        snprintf(o->addr, sizeof o->addr, "%s", in->addr);
        o->role = in->prefill ? "prefill"
                  : in->role == PDSERVE__INTERNAL__V1__ROLE__ROLE_COLOCATED ? "colocated" : "decode";
        o->up = in->present && in->healthy;
        o->draining = in->draining;
        o->free_blocks = in->free_blocks;
        o->total_blocks = in->total_blocks;
        o->running = in->running;
        o->waiting = in->waiting;
        o->queued_tokens = in->queued_tokens;
        o->routed = atomic_load(&in->routed);
        o->errors = atomic_load(&in->errors);
        o->prefill_rate = in->prefill_rate;
    }
    pthread_mutex_unlock(&r->mu);
    return n;
}

int64_t rtr_instance_backlog(rtr_registry *r, const rtr_instance *i)
{
    pthread_mutex_lock(&r->mu);
    int64_t q = i->queued_tokens + i->local_tokens;
    pthread_mutex_unlock(&r->mu);
    return q;
}

void rtr_instance_note_tpot(rtr_registry *r, rtr_instance *i, double tpot)
{
    pthread_mutex_lock(&r->mu);
    i->tpot_ewma = i->tpot_ewma > 0 ? 0.8 * i->tpot_ewma + 0.2 * tpot : tpot;
    pthread_mutex_unlock(&r->mu);
}

double rtr_instance_tpot(rtr_registry *r, const rtr_instance *i)
{
    pthread_mutex_lock(&r->mu);
    double t = i->tpot_ewma;
    pthread_mutex_unlock(&r->mu);
    return t;
}

int64_t rtr_prefill_backlog_min(rtr_registry *r)
{
    pthread_mutex_lock(&r->mu);
    int64_t best = INT64_MAX;
    for (int i = 0; i < r->n_inst; i++) {
        const rtr_instance *in = r->inst[i];
        if (!in->prefill || !usable(r, in)) continue;
        int64_t load = in->queued_tokens + in->local_tokens;
        if (load < best) best = load;
    }
    pthread_mutex_unlock(&r->mu);
    return best;
}

double rtr_prefill_wait_min(rtr_registry *r, int64_t extra_tokens)
{
    pthread_mutex_lock(&r->mu);
    double best = -1.0;
    for (int i = 0; i < r->n_inst; i++) {
        const rtr_instance *in = r->inst[i];
        if (!in->prefill || !usable(r, in)) continue;
        if (!(in->prefill_rate > 0)) { /* one without a measured rate: no estimate */
            best = -1.0;
            break;
        }
        double w = (double)(in->queued_tokens + in->local_tokens + extra_tokens) / in->prefill_rate;
        if (best < 0 || w < best) best = w;
    }
    pthread_mutex_unlock(&r->mu);
    return best;
}

int rtr_decode_usable(rtr_registry *r, const rtr_instance *exclude)
{
    pthread_mutex_lock(&r->mu);
    int n = 0;
    for (int i = 0; i < r->n_inst; i++)
        n += !r->inst[i]->prefill && r->inst[i] != exclude && usable(r, r->inst[i]);
    pthread_mutex_unlock(&r->mu);
    return n;
}

int rtr_prefill_usable(rtr_registry *r)
{
    pthread_mutex_lock(&r->mu);
    int n = 0;
    for (int i = 0; i < r->n_inst; i++) n += r->inst[i]->prefill && usable(r, r->inst[i]);
    pthread_mutex_unlock(&r->mu);
    return n;
}

void rtr_registry_counts(rtr_registry *r, int *n_prefill, int *n_decode, int *healthy)
{
    pthread_mutex_lock(&r->mu);
    *n_prefill = *n_decode = *healthy = 0;
    for (int i = 0; i < r->n_inst; i++) {
        if (r->inst[i]->prefill) (*n_prefill)++; else (*n_decode)++;
        if (up(r->inst[i])) (*healthy)++;
    }
    pthread_mutex_unlock(&r->mu);
}
