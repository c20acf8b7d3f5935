/* registry.c -- Instance discovery (getaddrinfo, periodic), load-report polling on a
 * background thread, and instance selection (see registry.h). */
#include "router/registry.h"

#include <arpa/inet.h>
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
    char addr[128];               /* "ip:port" */
    bool prefill;                 /* from the --prefill list */
    rpc_channel *ch;
    /* guarded by the registry mutex */
    bool present;                 /* still resolved */
    bool healthy;                 /* last load report succeeded */
    bool draining;
    Pdserve__Internal__V1__Role role;
    Pdserve__Internal__V1__KvLayout layout;
    bool has_layout;
    int64_t free_blocks, total_blocks, running, waiting, queued_tokens;
    int64_t local_blocks, local_tokens; /* routed since the last report */
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
    rtr_instance *aff_inst[AFFINITY_SLOTS]; /* weak: compared by pointer while present */
    bool has_prefill;
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
    rpc_channel_destroy(i->ch);
    free(i);
}

rpc_channel *rtr_instance_channel(const rtr_instance *i) { return i->ch; }
const char *rtr_instance_addr(const rtr_instance *i) { return i->addr; }
bool rtr_instance_colocated(const rtr_instance *i)
{
    return i->role == PDSERVE__INTERNAL__V1__ROLE__ROLE_COLOCATED;
}

/* Resolves every "host:port" of list into ip:port strings; calls add(addr) for each. */
static void resolve_list(rtr_registry *r, const char *list, bool prefill, bool *seen)
{
    if (!list || !*list) return;
    char *copy = strdup(list);
    if (!copy) return;
    char *save = NULL;
    for (char *tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        while (*tok == ' ') tok++;
        char *colon = strrchr(tok, ':');
        if (!colon || colon == tok) {
            PD_LOGW("instance address '%s' has no port; ignored", tok);
            continue;
        }
        *colon = 0;
        const char *host = tok, *port = colon + 1;
        char hostbuf[128];
        if (host[0] == '[') { /* [v6]:port */
            snprintf(hostbuf, sizeof hostbuf, "%.*s", (int)strlen(host) - 2, host + 1);
            host = hostbuf;
        }
        struct addrinfo hints, *res = NULL;
        memset(&hints, 0, sizeof hints);
        hints.ai_socktype = SOCK_STREAM;
        int rc = getaddrinfo(host, port, &hints, &res);
        if (rc != 0) {
            PD_LOGW("cannot resolve %s: %s", host, gai_strerror(rc));
            continue;
        }
        for (struct addrinfo *a = res; a; a = a->ai_next) {
            char ip[INET6_ADDRSTRLEN], addr[128];
            if (a->ai_family == AF_INET)
                inet_ntop(AF_INET, &((struct sockaddr_in *)a->ai_addr)->sin_addr, ip, sizeof ip);
            else if (a->ai_family == AF_INET6)
                inet_ntop(AF_INET6, &((struct sockaddr_in6 *)a->ai_addr)->sin6_addr, ip, sizeof ip);
            else
                continue;
            snprintf(addr, sizeof addr, a->ai_family == AF_INET6 ? "[%s]:%s" : "%s:%s", ip, port);
            int k = -1;
            for (int i = 0; i < r->n_inst; i++)
                if (r->inst[i]->prefill == prefill && !strcmp(r->inst[i]->addr, addr)) k = i;
            if (k >= 0) {
                seen[k] = true;
                continue;
            }
            if (r->n_inst == MAX_INST) continue;
            rtr_instance *in = calloc(1, sizeof *in);
            if (!in) continue;
            atomic_init(&in->refs, 1);
            atomic_init(&in->routed, 0);
            atomic_init(&in->errors, 0);
            snprintf(in->addr, sizeof in->addr, "%s", addr);
            in->prefill = prefill;
            in->present = true;
            rpc_channel_params cp = rpc_channel_default_params();
            cp.target = in->addr;
            char err[PD_ERR_LEN];
            if (rpc_channel_create(&cp, &in->ch, err) < 0) {
                free(in);
                continue;
            }
            PD_LOGI("%s instance %s added", prefill ? "prefill" : "decode", addr);
            seen[r->n_inst] = true;
            r->inst[r->n_inst++] = in;
        }
        freeaddrinfo(res);
    }
    free(copy);
}

static void resolve(rtr_registry *r)
{
    bool seen[MAX_INST] = {false};
    pthread_mutex_lock(&r->mu);
    int before = r->n_inst;
    resolve_list(r, r->p.prefill, true, seen);
    resolve_list(r, r->p.decode, false, seen);
    /* Instances no longer resolved leave the registry (calls in flight keep theirs). */
    int j = 0;
    for (int i = 0; i < r->n_inst; i++) {
        if (seen[i] || i >= before) {
            r->inst[j++] = r->inst[i];
        } else {
            PD_LOGI("instance %s removed (no longer resolved)", r->inst[i]->addr);
            for (int a = 0; a < AFFINITY_SLOTS; a++)
                if (r->aff_inst[a] == r->inst[i]) r->aff_inst[a] = NULL;
            rtr_instance_unref(r->inst[i]);
        }
    }
    r->n_inst = j;
    pthread_mutex_unlock(&r->mu);
}

static void poll_one(rtr_registry *r, rtr_instance *in)
{
    Pdserve__Internal__V1__LoadReportRequest q = PDSERVE__INTERNAL__V1__LOAD_REPORT_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    rpc_status st;
    int rc = rpc_unary_call(in->ch, "/pdserve.internal.v1.Instance/LoadReport", &q.base,
                            &pdserve__internal__v1__load_report_response__descriptor,
                            r->p.report_timeout_ms, &resp, &st);
    pthread_mutex_lock(&r->mu);
    bool was = in->healthy;
    if (rc == 0 && resp) {
        const Pdserve__Internal__V1__LoadReportResponse *l = (const void *)resp;
        in->healthy = true;
        in->draining = l->draining;
        in->role = l->role;
        in->free_blocks = l->free_blocks;
        in->total_blocks = l->total_blocks;
        in->running = l->running_seqs;
        in->waiting = l->waiting_seqs;
        in->queued_tokens = (int64_t)l->queued_prefill_tokens;
        in->local_blocks = in->local_tokens = 0;
        if (l->kv_layout) {
            in->layout = *l->kv_layout;
            in->layout.base.descriptor = &pdserve__internal__v1__kv_layout__descriptor;
            in->has_layout = true;
        }
    } else {
        in->healthy = false;
        atomic_fetch_add(&in->errors, 1);
    }
    bool now = in->healthy;
    pthread_mutex_unlock(&r->mu);
    if (was != now)
        PD_LOGI("instance %s is %s%s%s", in->addr, now ? "up" : "down", now ? "" : ": ",
                now ? "" : st.details);
    if (resp) protobuf_c_message_free_unpacked(resp, NULL);
}

static void *poller(void *arg)
{
    rtr_registry *r = arg;
    int64_t next_resolve = now_ms() + r->p.resolve_ms;
    for (;;) {
        pthread_mutex_lock(&r->mu);
        if (r->stop) {
            pthread_mutex_unlock(&r->mu);
            break;
        }
        int n = r->n_inst;
        rtr_instance *snap[MAX_INST];
        for (int i = 0; i < n; i++) {
            snap[i] = r->inst[i];
            rtr_instance_ref(snap[i]);
        }
        pthread_mutex_unlock(&r->mu);
        for (int i = 0; i < n; i++) {
            pthread_mutex_lock(&r->mu);
            bool stop = r->stop;
            pthread_mutex_unlock(&r->mu);
            if (!stop) poll_one(r, snap[i]); /* stopping: skip, an instance may be draining */
            rtr_instance_unref(snap[i]);
        }
        if (now_ms() >= next_resolve) {
            resolve(r);
            next_resolve = now_ms() + r->p.resolve_ms;
        }
        pthread_mutex_lock(&r->mu);
        if (!r->stop) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += (long)(r->p.poll_ms % 1000) * 1000000;
            ts.tv_sec += r->p.poll_ms / 1000 + ts.tv_nsec / 1000000000;
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
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
    r->has_prefill = p->prefill && *p->prefill;
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
    for (int i = 0; i < r->n_inst; i++) rtr_instance_unref(r->inst[i]);
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv);
    free(r);
}

static bool usable(const rtr_instance *i) { return i->present && i->healthy && !i->draining; }

rtr_instance *rtr_pick_decode(rtr_registry *r, const rtr_instance *exclude)
{
    pthread_mutex_lock(&r->mu);
    rtr_instance *best = NULL;
    int64_t best_score = INT64_MIN;
    for (int i = 0; i < r->n_inst; i++) {
        rtr_instance *in = r->inst[i];
        if (in->prefill || !usable(in) || in == exclude) continue;
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
    rtr_instance *best = NULL;
    int64_t best_load = INT64_MAX;
    for (int i = 0; i < r->n_inst; i++) {
        rtr_instance *in = r->inst[i];
        if (!in->prefill || !usable(in) || in == exclude) continue;
        if (layout && in->has_layout && !same_layout(layout, &in->layout)) continue;
        int64_t load = in->queued_tokens + in->local_tokens;
        if (load < best_load) {
            best_load = load;
            best = in;
        }
    }
    /* Prefix affinity: the instance that computed this prefix last has it in its cache; take
     * it unless it is busier than the best by more than the work the cache saves. */
    rtr_instance *aff = key ? r->aff_inst[key % AFFINITY_SLOTS] : NULL;
    if (aff && r->aff_key[key % AFFINITY_SLOTS] == key && aff != best && aff != exclude && usable(aff) &&
        (!layout || !aff->has_layout || same_layout(layout, &aff->layout)) &&
        aff->queued_tokens + aff->local_tokens <= best_load + n_prompt)
        best = aff;
    if (best) rtr_instance_ref(best);
    pthread_mutex_unlock(&r->mu);
    return best;
}

void rtr_note_prefix(rtr_registry *r, uint64_t key, rtr_instance *inst)
{
    if (!key) return;
    pthread_mutex_lock(&r->mu);
    r->aff_key[key % AFFINITY_SLOTS] = key;
    r->aff_inst[key % AFFINITY_SLOTS] = inst;
    pthread_mutex_unlock(&r->mu);
}

bool rtr_has_prefill(rtr_registry *r) { return r->has_prefill; }

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
    }
    pthread_mutex_unlock(&r->mu);
    return n;
}

void rtr_registry_counts(rtr_registry *r, int *n_prefill, int *n_decode, int *healthy)
{
    pthread_mutex_lock(&r->mu);
    *n_prefill = *n_decode = *healthy = 0;
    for (int i = 0; i < r->n_inst; i++) {
        if (r->inst[i]->prefill) (*n_prefill)++; else (*n_decode)++;
        if (usable(r->inst[i])) (*healthy)++;
    }
    pthread_mutex_unlock(&r->mu);
}
