/* worker.c -- Engine thread with a command queue (mutex + condition variable) and an id ->
 * user map for callbacks. Commands are applied in submission order between steps. */
#include "engine/worker.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/error.h"
#include "common/log.h"

typedef enum {
    CMD_SUBMIT, CMD_RESERVE, CMD_ADMIT, CMD_RELEASE, CMD_ABORT, CMD_END_CHOICE
} cmd_kind;

typedef struct cmd {
    cmd_kind kind;
    eng_request req;       /* SUBMIT/RESERVE: prompt points into the allocation after it */
    void *user;
    uint64_t id;
    int32_t token;         /* ADMIT: the first token; END_CHOICE: the choice */
    int32_t tokens[ENG_MAX_CHOICES]; /* ADMIT: each choice's first token ([0] = token) */
    int32_t n_tokens;                /* ADMIT: choices (>= 1) */
    ew_admit_fn admit_fn;  /* ADMIT: run before eng_admit (may be NULL) */
    void *admit_arg;
    struct cmd *next;
} cmd;

typedef struct {
    uint64_t *keys;
    void **vals;
    uint8_t *used;
    uint32_t mask, n;
} user_map;

struct ew {
    eng *e;
    ew_callbacks cb;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    cmd *head, *tail;     /* pending commands */
    bool stop;
    user_map users;       /* engine thread only */
    ew_load load;         /* guarded by mu */
    int64_t n_step_failures; /* guarded by mu */
    double pf_tok, pf_sec; /* engine thread only: decayed sums of the prompt tokens and the
                              seconds of steps that computed prompt tokens */
};

static uint32_t um_slot(uint64_t k, uint32_t mask)
{
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdull;
    k ^= k >> 33;
    return (uint32_t)k & mask;
}

static int um_init(user_map *m, uint32_t cap)
{
    m->keys = calloc(cap, sizeof *m->keys);
    m->vals = calloc(cap, sizeof *m->vals);
    m->used = calloc(cap, 1);
    m->mask = cap - 1;
    m->n = 0;
    return m->keys && m->vals && m->used ? 0 : PD_ENOMEM;
}

static void um_free(user_map *m)
{
    free(m->keys);
    free(m->vals);
    free(m->used);
}

static int32_t um_find(const user_map *m, uint64_t k)
{
    for (uint32_t i = um_slot(k, m->mask);; i = (i + 1) & m->mask) {
        if (!m->used[i]) return -1;
        if (m->keys[i] == k) return (int32_t)i;
    }
}

static int um_put(user_map *m, uint64_t k, void *v)
{
    if (2 * (m->n + 1) > m->mask + 1) {
        user_map g;
        if (um_init(&g, 2 * (m->mask + 1)) < 0) {
            um_free(&g);
            return PD_ENOMEM;
        }
        for (uint32_t i = 0; i <= m->mask; i++)
            if (m->used[i]) um_put(&g, m->keys[i], m->vals[i]);
        um_free(m);
        *m = g;
    }
    uint32_t i = um_slot(k, m->mask);
    while (m->used[i]) i = (i + 1) & m->mask;
    m->keys[i] = k;
    m->vals[i] = v;
    m->used[i] = 1;
    m->n++;
    return 0;
}

static void um_del(user_map *m, uint64_t k)
{
    int32_t f = um_find(m, k);
    if (f < 0) return;
    uint32_t hole = (uint32_t)f;
    for (uint32_t j = (hole + 1) & m->mask; m->used[j]; j = (j + 1) & m->mask) {
        uint32_t home = um_slot(m->keys[j], m->mask);
        bool between = hole <= j ? (home > hole && home <= j) : (home > hole || home <= j);
        if (!between) {
            m->keys[hole] = m->keys[j];
            m->vals[hole] = m->vals[j];
            hole = j;
        }
    }
    m->used[hole] = 0;
    m->n--;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void push(ew *w, cmd *c)
{
    pthread_mutex_lock(&w->mu);
    c->next = NULL;
    if (w->tail) w->tail->next = c; else w->head = c;
    w->tail = c;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

static cmd *cmd_with_request(cmd_kind kind, const eng_request *r, void *user)
{
    size_t n = (size_t)(r->n_prompt > 0 ? r->n_prompt : 0);
    size_t nr = (size_t)(r->n_resume > 0 ? r->n_resume : 0), nt = 0;
    for (size_t k = 0; k < nr; k++) nt += (size_t)(r->resume_len[k] > 0 ? r->resume_len[k] : 0);
    cmd *c = malloc(sizeof *c + (n + 2 * nr + nt) * sizeof(int32_t));
    if (!c) return NULL;
    memset(c, 0, sizeof *c);
    c->kind = kind;
    c->req = *r;
    int32_t *copy = (int32_t *)(c + 1);
    if (n) memcpy(copy, r->prompt, n * sizeof(int32_t));
    c->req.prompt = copy;
    if (nr) { /* the resumed choices (eng_request.n_resume) after the prompt */
        int32_t *rc = copy + n, *rl = rc + nr, *rt = rl + nr;
        memcpy(rc, r->resume_choice, nr * sizeof(int32_t));
        memcpy(rl, r->resume_len, nr * sizeof(int32_t));
        if (nt) memcpy(rt, r->resume_tokens, nt * sizeof(int32_t));
        c->req.resume_choice = rc;
        c->req.resume_len = rl;
        c->req.resume_tokens = rt;
    }
    c->user = user;
    c->id = r->id;
    return c;
}

int ew_submit(ew *w, const eng_request *r, void *user)
{
    cmd *c = cmd_with_request(CMD_SUBMIT, r, user);
    if (!c) return PD_ENOMEM;
    push(w, c);
    return 0;
}

int ew_reserve(ew *w, const eng_request *r, void *user)
{
    cmd *c = cmd_with_request(CMD_RESERVE, r, user);
    if (!c) return PD_ENOMEM;
    push(w, c);
    return 0;
}

static int simple(ew *w, cmd_kind kind, uint64_t id, int32_t token)
{
    cmd *c = calloc(1, sizeof *c);
    if (!c) return PD_ENOMEM;
    c->kind = kind;
    c->id = id;
    c->token = token;
    c->tokens[0] = token;
    c->n_tokens = 1;
    push(w, c);
    return 0;
}

int ew_admit(ew *w, uint64_t id, int32_t first_token) { return simple(w, CMD_ADMIT, id, first_token); }

int ew_admit_ex(ew *w, uint64_t id, int32_t first_token, ew_admit_fn fn, void *arg)
{
    cmd *c = calloc(1, sizeof *c);
    if (!c) return PD_ENOMEM;
    c->kind = CMD_ADMIT;
    c->id = id;
    c->token = first_token;
    c->tokens[0] = first_token;
    c->n_tokens = 1;
    c->admit_fn = fn;
    c->admit_arg = arg;
    push(w, c);
    return 0;
}

int ew_admit_n(ew *w, uint64_t id, const int32_t *first_tokens, int32_t n)
{
    if (n < 1 || n > ENG_MAX_CHOICES) return PD_EINVAL;
    cmd *c = calloc(1, sizeof *c);
    if (!c) return PD_ENOMEM;
    c->kind = CMD_ADMIT;
    c->id = id;
    c->token = first_tokens[0];
    memcpy(c->tokens, first_tokens, (size_t)n * sizeof *first_tokens);
    c->n_tokens = n;
    push(w, c);
    return 0;
}
int ew_release(ew *w, uint64_t id) { return simple(w, CMD_RELEASE, id, 0); }
int ew_abort(ew *w, uint64_t id) { return simple(w, CMD_ABORT, id, 0); }
int ew_end_choice(ew *w, uint64_t id, int32_t choice)
{
    if (choice < 0 || choice >= ENG_MAX_CHOICES) return PD_EINVAL;
    return simple(w, CMD_END_CHOICE, id, choice);
}

void ew_load_get(ew *w, ew_load *out)
{
    pthread_mutex_lock(&w->mu);
    *out = w->load;
    pthread_mutex_unlock(&w->mu);
}

/* Terminal notification: callback, then forget the user pointer. */
static void fail(ew *w, uint64_t id, void *user, int code, const char *msg)
{
    um_del(&w->users, id);
    if (w->cb.on_error) w->cb.on_error(user, code, msg);
}

static void apply(ew *w, cmd *c)
{
    char err[PD_ERR_LEN] = "";
    int rc;
    int32_t f;
    switch (c->kind) {
    case CMD_SUBMIT:
    case CMD_RESERVE:
        if (um_find(&w->users, c->id) >= 0) {
            if (w->cb.on_error) w->cb.on_error(c->user, PD_EINVAL, "request id already in use");
            break;
        }
        if (um_put(&w->users, c->id, c->user) < 0) {
            if (w->cb.on_error) w->cb.on_error(c->user, PD_ENOMEM, "out of memory");
            break;
        }
        if (c->kind == CMD_SUBMIT) {
            rc = eng_add_request(w->e, &c->req, err);
            if (rc < 0) fail(w, c->id, c->user, rc, err);
        } else {
            const int32_t *blocks;
            int32_t nb, nc;
            rc = eng_reserve(w->e, &c->req, &blocks, &nb, &nc, err);
            if (rc < 0) fail(w, c->id, c->user, rc, err);
            else if (w->cb.on_reserved) w->cb.on_reserved(c->user, blocks, nb, nc);
        }
        break;
    case CMD_ADMIT:
        if ((f = um_find(&w->users, c->id)) < 0) break;
        rc = c->admit_fn ? c->admit_fn(c->admit_arg, w->e, err) : 0;
        if (rc < 0 && !err[0]) snprintf(err, sizeof err, "admission refused");
        if (rc == 0) rc = eng_admit_n(w->e, c->id, c->tokens, c->n_tokens, err);
        if (rc < 0) {
            void *user = w->users.vals[f];
            eng_abort(w->e, c->id);
            fail(w, c->id, user, rc, err);
        }
        break;
    case CMD_RELEASE:
        eng_release(w->e, c->id);
        break;
    case CMD_ABORT:
        if ((f = um_find(&w->users, c->id)) < 0) break;
        if (eng_abort(w->e, c->id) == 0) {
            void *user = w->users.vals[f];
            eng_output o;
            memset(&o, 0, sizeof o);
            o.id = c->id;
            o.token = -1;
            o.finish = SEQ_FINISH_ABORTED;
            o.done = true; /* every choice of it */
            o.n_choices = 1;
            um_del(&w->users, c->id);
            if (w->cb.on_output) w->cb.on_output(user, &o);
        }
        break;
    case CMD_END_CHOICE:
        /* The choice's last output comes from the next step (or its first token). Unknown
         * requests and choices that ended meanwhile are ignored. */
        if (um_find(&w->users, c->id) < 0) break;
        rc = eng_end_choice(w->e, c->id, c->token);
        if (rc < 0 && rc != PD_ENOTFOUND)
            PD_LOGW("engine: cannot end choice %d of request %llu: %s", c->token,
                    (unsigned long long)c->id, pd_strerror(rc));
        break;
    }
}

/* The prefill rate the load report carries: a step that computed at least 64 prompt tokens
 * adds them and its seconds to sums that decay by 0.9 a step (a token-weighted moving
 * average over roughly the last ten such steps; shorter steps are mostly fixed overhead). */
static void note_prefill_rate(ew *w, int64_t tokens, double seconds)
{
    if (tokens < 64 || seconds <= 0) return;
    w->pf_tok = 0.9 * w->pf_tok + (double)tokens;
    w->pf_sec = 0.9 * w->pf_sec + seconds;
}

static void publish_load(ew *w)
{
    ew_load l;
    l.n_running = eng_n_running(w->e);
    l.n_waiting = eng_n_waiting(w->e);
    l.n_free_blocks = eng_n_free_blocks(w->e);
    l.n_blocks = bm_n_blocks(eng_block_manager(w->e));
    l.stats = *eng_stats_get(w->e);
    l.queued_prompt_tokens = eng_queued_prompt_tokens(w->e);
    l.prefill_tok_per_s = w->pf_sec > 0 ? w->pf_tok / w->pf_sec : 0.0;
    pthread_mutex_lock(&w->mu);
    l.n_step_failures = w->n_step_failures;
    w->load = l;
    pthread_mutex_unlock(&w->mu);
}

static void *loop(void *arg)
{
    ew *w = arg;
    char err[PD_ERR_LEN];
    for (;;) {
        pthread_mutex_lock(&w->mu);
        while (!w->stop && !w->head && !eng_has_work(w->e)) pthread_cond_wait(&w->cv, &w->mu);
        cmd *c = w->head;
        w->head = w->tail = NULL;
        bool stop = w->stop;
        pthread_mutex_unlock(&w->mu);
        while (c) {
            cmd *next = c->next;
            apply(w, c);
            free(c);
            c = next;
        }
        if (stop) break;
        if (!eng_has_work(w->e)) {
            publish_load(w);
            continue;
        }
        const eng_output *outs;
        int32_t n = 0;
        const eng_stats *st = eng_stats_get(w->e);
        int64_t steps0 = st->steps, seqs0 = st->batch_seqs_sum, ptok0 = st->prompt_tokens_computed;
        double t0 = now_s();
        int rc = eng_step(w->e, &outs, &n, err);
        double dt = now_s() - t0;
        if (w->cb.on_step && st->steps > steps0)
            w->cb.on_step(w->cb.step_arg, dt, (int32_t)(st->batch_seqs_sum - seqs0));
        note_prefill_rate(w, st->prompt_tokens_computed - ptok0, dt);
        char fail_msg[PD_ERR_LEN + 32] = "";
        if (rc < 0) {
            PD_LOGE("engine step failed: %s", err);
            snprintf(fail_msg, sizeof fail_msg, "the engine failed a step: %s", err);
            pthread_mutex_lock(&w->mu);
            w->n_step_failures++;
            pthread_mutex_unlock(&w->mu);
            if (w->cb.on_step_failed) w->cb.on_step_failed(w->cb.step_arg, err);
        }
        for (int32_t i = 0; i < n; i++) {
            int32_t f = um_find(&w->users, outs[i].id);
            if (f < 0) continue;
            void *user = w->users.vals[f];
            if (rc < 0 && outs[i].finish == SEQ_FINISH_ABORTED) {
                /* Lost with the failed step: an error, not a cancellation. */
                fail(w, outs[i].id, user, PD_EBACKEND, fail_msg);
                continue;
            }
            /* PREFILLED is terminal too: the blocks stay until ew_release, which finds the
             * request by id in the engine. A request of n choices ends with its last choice. */
            if (outs[i].done) um_del(&w->users, outs[i].id);
            if (w->cb.on_output) w->cb.on_output(user, &outs[i]);
        }
        publish_load(w);
    }
    /* Shutdown: every live request gets its terminal callback. */
    for (uint32_t i = 0; i <= w->users.mask; i++) {
        if (!w->users.used[i]) continue;
        eng_abort(w->e, w->users.keys[i]);
        if (w->cb.on_error) w->cb.on_error(w->users.vals[i], PD_ESTATE, "server shutting down");
    }
    return NULL;
}

int ew_create(eng *e, const ew_callbacks *cb, ew **out)
{
    *out = NULL;
    ew *w = calloc(1, sizeof *w);
    if (!w) return PD_ENOMEM;
    w->e = e;
    w->cb = *cb;
    if (um_init(&w->users, 256) < 0) {
        um_free(&w->users);
        free(w);
        return PD_ENOMEM;
    }
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    publish_load(w);
    if (pthread_create(&w->thread, NULL, loop, w) != 0) {
        pthread_mutex_destroy(&w->mu);
        pthread_cond_destroy(&w->cv);
        um_free(&w->users);
        free(w);
        return PD_EBACKEND;
    }
    *out = w;
    return 0;
}

void ew_destroy(ew *w)
{
    if (!w) return;
    pthread_mutex_lock(&w->mu);
    w->stop = true;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
    pthread_join(w->thread, NULL);
    for (cmd *c = w->head; c;) { /* commands that raced with the stop */
        cmd *next = c->next;
        if ((c->kind == CMD_SUBMIT || c->kind == CMD_RESERVE) && w->cb.on_error)
            w->cb.on_error(c->user, PD_ESTATE, "server shutting down");
        free(c);
        c = next;
    }
    um_free(&w->users);
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->cv);
    eng_destroy(w->e);
    free(w);
}
