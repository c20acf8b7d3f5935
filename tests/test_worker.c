/* test_worker.c -- The engine thread: requests submitted from several threads while others
 * abort, each request (a quarter of them with n = 2 choices) gets exactly one terminal callback
 * (its last choice's output, `done`) and the same tokens as when run alone; a thread ends
 * choice 1 of half the n = 2 requests (ew_end_choice, racing their end and the aborts): it
 * ends once, with a prefix of its tokens alone; decode-only reserve/admit through the worker;
 * shutdown with live requests. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/worker.h"
#include "tests/fake_model.h"
#include "tests/test_util.h"

#define N_THREADS 4
#define PER_THREAD 60
#define N_REQ (N_THREADS * PER_THREAD)

typedef struct {
    eng_request rq;
    int32_t prompt[32];
    int32_t out[2][256];     /* per choice */
    atomic_int n_out[2];
    atomic_int finishes;     /* choices that ended */
    atomic_int terminal;     /* terminal callbacks seen */
    atomic_int aborted;
    atomic_int errored;
    atomic_int cancelled;    /* choices that ended CANCELLED (ew_end_choice) */
    int32_t reserved_blocks[16];
    atomic_int n_reserved;
} item;

static item g_items[N_REQ];
static ew *g_w;

static void on_output(void *user, const eng_output *o)
{
    item *it = user;
    const int c = o->choice == 1 ? 1 : 0;
    if (o->token >= 0) it->out[c][atomic_fetch_add(&it->n_out[c], 1)] = o->token;
    if (o->finish != SEQ_FINISH_NONE) atomic_fetch_add(&it->finishes, 1);
    if (o->finish == SEQ_FINISH_CANCELLED) atomic_fetch_add(&it->cancelled, 1);
    if (o->done) {
        atomic_fetch_add(&it->terminal, 1);
        if (o->finish == SEQ_FINISH_ABORTED) atomic_store(&it->aborted, 1);
    }
}

static void on_error(void *user, int code, const char *msg)
{
    item *it = user;
    (void)code;
    (void)msg;
    atomic_fetch_add(&it->terminal, 1);
    atomic_store(&it->errored, 1);
}

static void on_reserved(void *user, const int32_t *ids, int32_t n, int32_t n_cached)
{
    item *it = user;
    (void)n_cached;
    for (int32_t i = 0; i < n && i < 16; i++) it->reserved_blocks[i] = ids[i];
    atomic_store(&it->n_reserved, n);
}

static void *submitter(void *arg)
{
    int t = (int)(intptr_t)arg;
    for (int i = 0; i < PER_THREAD; i++) {
        item *it = &g_items[t * PER_THREAD + i];
        CHECK(ew_submit(g_w, &it->rq, it) == 0);
        if (i % 7 == 3) usleep(100);
    }
    return NULL;
}

static void *aborter(void *arg)
{
    (void)arg;
    /* Abort every fifth request once it has produced a token (or finished). */
    for (int i = 0; i < N_REQ; i += 5) {
        for (int s = 0; s < 2000 && atomic_load(&g_items[i].n_out[0]) == 0 &&
                        atomic_load(&g_items[i].terminal) == 0; s++)
            usleep(100);
        ew_abort(g_w, g_items[i].rq.id);
    }
    return NULL;
}

/* Choice 1 of every other n = 2 request is ended once it has a token (or at once, or after the
 * request ended: a few of each). */
static bool ends_choice(int i) { return i % 8 == 1; }

static void *ender(void *arg)
{
    (void)arg;
    for (int i = 1; i < N_REQ; i += 8) {
        for (int s = 0; s < 2000 && i % 3 != 0 && atomic_load(&g_items[i].n_out[1]) == 0 &&
                        atomic_load(&g_items[i].terminal) == 0; s++)
            usleep(100);
        CHECK(ew_end_choice(g_w, g_items[i].rq.id, 1) == 0);
    }
    CHECK_EQ_INT(ew_end_choice(g_w, 1, ENG_MAX_CHOICES), PD_EINVAL);
    return NULL;
}

static void run_alone(const eng_request *rq, int32_t *out, int32_t *n)
{
    mc_config cfg = fake_cfg();
    fake f = {calloc(64 * 4, sizeof(int64_t)), 64 * 4, 0, 0};
    eng_params p = {ENG_MODE_COLOCATED, 64, 4, 256, 8, 0, false, true, false};
    eng *e;
    char err[PD_ERR_LEN];
    CHECK(eng_create(&p, &cfg, (eng_executor){fake_forward, &f, NULL, NULL, NULL, NULL, fake_clone_blocks}, &e, err) == 0);
    CHECK(eng_add_request(e, rq, err) == 0);
    *n = 0;
    while (eng_has_work(e)) {
        const eng_output *o;
        int32_t k;
        CHECK(eng_step(e, &o, &k, err) == 0);
        for (int32_t j = 0; j < k; j++) if (o[j].token >= 0) out[(*n)++] = o[j].token;
    }
    eng_destroy(e);
    free(f.kv);
}

static void test_concurrent(void)
{
    uint64_t rs = 12345;
    for (int i = 0; i < N_REQ; i++) {
        item *it = &g_items[i];
        memset(it, 0, sizeof *it);
        int32_t n = 1 + (int32_t)((rs = rs * 6364136223846793005ull + 1442695040888963407ull) >> 59);
        for (int32_t j = 0; j < n; j++) it->prompt[j] = 1 + (int32_t)((i * 31 + j * 7) % 40);
        it->rq.id = 500 + (uint64_t)i;
        it->rq.prompt = it->prompt;
        it->rq.n_prompt = n;
        it->rq.sampling = smp_default_params();
        it->rq.sampling.seed = (uint64_t)i;
        it->rq.sampling.has_seed = true;
        it->rq.stop.max_tokens = i % 5 == 0 ? 60 : 1 + i % 30;
        it->rq.stop.ignore_eos = i % 2;
        if (i % 4 == 1) it->rq.n = 2; /* two choices sharing the prompt's blocks */
    }
    /* The 13th request is invalid (token out of range): it must get on_error. */
    g_items[13].prompt[0] = V + 1;
    mc_config cfg = fake_cfg();
    fake f = {calloc(48 * 4, sizeof(int64_t)), 48 * 4, 0, 200};
    eng_params p = {ENG_MODE_COLOCATED, 48, 4, 64, 16, 0, true, true, false};
    eng *e;
    char err[PD_ERR_LEN];
    CHECK(eng_create(&p, &cfg, (eng_executor){fake_forward, &f, NULL, NULL, NULL, NULL, fake_clone_blocks}, &e, err) == 0);
    ew_callbacks cb = {.on_output = on_output, .on_error = on_error, .on_reserved = on_reserved};
    CHECK(ew_create(e, &cb, &g_w) == 0);
    pthread_t th[N_THREADS + 2];
    for (int t = 0; t < N_THREADS; t++) pthread_create(&th[t], NULL, submitter, (void *)(intptr_t)t);
    pthread_create(&th[N_THREADS], NULL, aborter, NULL);
    pthread_create(&th[N_THREADS + 1], NULL, ender, NULL);
    for (int t = 0; t <= N_THREADS + 1; t++) pthread_join(th[t], NULL);
    /* Wait for every terminal callback. */
    for (int spins = 0; spins < 2000; spins++) {
        int done = 0;
        for (int i = 0; i < N_REQ; i++) done += atomic_load(&g_items[i].terminal) > 0;
        if (done == N_REQ) break;
        usleep(5000);
    }
    ew_load load;
    ew_load_get(g_w, &load);
    CHECK_EQ_INT(load.n_running + load.n_waiting, 0);
    CHECK_EQ_INT(load.n_free_blocks, 48);
    ew_destroy(g_w);
    CHECK_EQ_INT(f.corrupt, 0);
    int n_aborted = 0, n_compared = 0, n_cancelled = 0;
    for (int i = 0; i < N_REQ; i++) {
        item *it = &g_items[i];
        CHECK_MSG(atomic_load(&it->terminal) == 1, "request %d: %d terminal callbacks", i,
                  atomic_load(&it->terminal));
        if (i == 13) {
            CHECK(atomic_load(&it->errored));
            continue;
        }
        CHECK(!atomic_load(&it->errored));
        if (atomic_load(&it->aborted)) {
            n_aborted++;
            continue;
        }
        const int nc = it->rq.n > 1 ? it->rq.n : 1;
        CHECK_EQ_INT(atomic_load(&it->finishes), nc);
        const int cancelled = atomic_load(&it->cancelled);
        CHECK(cancelled == 0 || (cancelled == 1 && ends_choice(i)));
        n_cancelled += cancelled;
        for (int c = 0; c < nc; c++) { /* choice c = the request alone with seed + c */
            int32_t ref[64], nr;
            eng_request one = it->rq;
            one.n = 1;
            one.sampling.seed += (uint64_t)c;
            run_alone(&one, ref, &nr);
            if (c == 1 && cancelled) { /* ended: a prefix of its tokens alone */
                const int32_t got = atomic_load(&it->n_out[c]);
                CHECK_MSG(got <= nr, "request %d: ended choice 1 has %d tokens, %d alone", i, got,
                          nr);
                if (got < nr) nr = got;
            }
            CHECK_EQ_INT(atomic_load(&it->n_out[c]), nr);
            CHECK_MSG(memcmp(it->out[c], ref, (size_t)nr * 4) == 0, "request %d choice %d: tokens "
                      "differ", i, c);
        }
        n_compared++;
    }
    fprintf(stderr, "test_worker: %d requests compared, %d aborted, %d choices ended early\n",
            n_compared, n_aborted, n_cancelled);
    CHECK(n_compared > N_REQ / 2);
    CHECK(n_cancelled > 3);
    CHECK(n_aborted > 10);
    free(f.kv);
}

/* ew_admit_ex's hook: writes the landed KV on the engine thread (as decode's staging copy). */
typedef struct {
    fake *f;
    item *it;
    atomic_int calls;
    int fail;
} admit_hook;

static int write_kv(void *arg, eng *e, char *err)
{
    admit_hook *h = arg;
    CHECK(e != NULL);
    atomic_fetch_add(&h->calls, 1);
    if (h->fail) return pd_errf(err, PD_EBACKEND, "copy failed");
    for (int i = 0; i < 9; i++)
        h->f->kv[h->it->reserved_blocks[i / 4] * 4 + i % 4] = ((int64_t)i << 16 | h->it->prompt[i]) + 1;
    return 0;
}

static void test_decode_and_shutdown(void)
{
    mc_config cfg = fake_cfg();
    fake f = {calloc(64 * 4, sizeof(int64_t)), 64 * 4, 0, 2000};
    eng_params p = {ENG_MODE_DECODE, 64, 4, 64, 8, 0, true, true, false};
    eng *e;
    char err[PD_ERR_LEN];
    CHECK(eng_create(&p, &cfg, (eng_executor){fake_forward, &f, NULL, NULL, NULL, NULL, fake_clone_blocks}, &e, err) == 0);
    ew_callbacks cb = {.on_output = on_output, .on_error = on_error, .on_reserved = on_reserved};
    CHECK(ew_create(e, &cb, &g_w) == 0);
    item *a = &g_items[0], *b = &g_items[1], *c = &g_items[2];
    memset(a, 0, sizeof *a);
    memset(b, 0, sizeof *b);
    memset(c, 0, sizeof *c);
    for (int j = 0; j < 9; j++) a->prompt[j] = b->prompt[j] = 3 + j;
    a->rq = (eng_request){.id = 1, .prompt = a->prompt, .n_prompt = 9, .sampling = smp_default_params()};
    a->rq.sampling.temperature = 0;
    a->rq.stop.max_tokens = 12;
    a->rq.stop.ignore_eos = true;
    b->rq = a->rq;
    b->rq.id = 2;
    b->rq.prompt = b->prompt;
    b->rq.stop.max_tokens = 200; /* never finishes before the shutdown */
    for (int j = 0; j < 9; j++) c->prompt[j] = 3 + j;
    c->rq = a->rq;
    c->rq.id = 3;
    c->rq.prompt = c->prompt;
    CHECK(ew_reserve(g_w, &a->rq, a) == 0);
    CHECK(ew_reserve(g_w, &b->rq, b) == 0);
    CHECK(ew_reserve(g_w, &c->rq, c) == 0);
    for (int s = 0; s < 400 && (!atomic_load(&a->n_reserved) || !atomic_load(&b->n_reserved) ||
                                !atomic_load(&c->n_reserved)); s++) usleep(5000);
    CHECK_EQ_INT(atomic_load(&a->n_reserved), 3);
    /* The prefill side writes the prompt's KV, then the first token arrives; for a, the KV is
     * written by the admission hook on the engine thread (ew_admit_ex). */
    int32_t ref[64], nr;
    run_alone(&a->rq, ref, &nr);
    for (int i = 0; i < 9; i++)
        f.kv[b->reserved_blocks[i / 4] * 4 + i % 4] = ((int64_t)i << 16 | b->prompt[i]) + 1;
    admit_hook ha = {&f, a, 0, 0}, hc = {&f, c, 0, 1};
    CHECK(ew_admit_ex(g_w, 1, ref[0], write_kv, &ha) == 0);
    CHECK(ew_admit(g_w, 2, ref[0]) == 0);
    CHECK(ew_admit_ex(g_w, 3, ref[0], write_kv, &hc) == 0); /* the hook fails: on_error */
    CHECK(ew_admit_ex(g_w, 99, ref[0], write_kv, &hc) == 0); /* unknown id: no hook call */
    for (int s = 0; s < 400 && (!atomic_load(&a->terminal) || !atomic_load(&c->terminal)); s++) usleep(5000);
    CHECK_EQ_INT(atomic_load(&ha.calls), 1);
    CHECK_EQ_INT(atomic_load(&hc.calls), 1);
    CHECK_EQ_INT(atomic_load(&a->n_out[0]), nr - 1);
    CHECK(memcmp(a->out[0], ref + 1, (size_t)(nr - 1) * 4) == 0);
    CHECK_EQ_INT(atomic_load(&c->terminal), 1);
    CHECK(atomic_load(&c->errored));
    CHECK_EQ_INT(atomic_load(&c->n_out[0]), 0);
    ew_destroy(g_w); /* b is still running: it gets on_error */
    CHECK_EQ_INT(atomic_load(&b->terminal), 1);
    CHECK(atomic_load(&b->errored));
    free(f.kv);
}

/* A forward that fails from the n-th call on, as a sticky device error does. */
typedef struct {
    fake f;
    atomic_int calls, fail_from;
} failing;

static int failing_forward(void *ctx, const mr_batch *b, float *logits, char *err)
{
    failing *x = ctx;
    if (atomic_fetch_add(&x->calls, 1) >= atomic_load(&x->fail_from))
        return pd_errf(err, PD_EBACKEND, "device lost (test)");
    return fake_forward(&x->f, b, logits, err);
}

static atomic_int g_step_failed;
static char g_step_failed_msg[PD_ERR_LEN];

static void on_step_failed(void *arg, const char *msg)
{
    (void)arg;
    snprintf(g_step_failed_msg, sizeof g_step_failed_msg, "%s", msg);
    atomic_fetch_add(&g_step_failed, 1);
}

/* A failed step: its requests end with on_error(PD_EBACKEND) (an error, not an abort), the
 * failure hook runs and the load snapshot counts it; a request submitted later fails the same
 * way (the device stays broken) and nothing hangs. */
static void test_step_failure(void)
{
    mc_config cfg = fake_cfg();
    failing x = {.f = {calloc(64 * 4, sizeof(int64_t)), 64 * 4, 0, 0}};
    atomic_init(&x.calls, 0);
    atomic_init(&x.fail_from, 3);
    eng_params p = {ENG_MODE_COLOCATED, 64, 4, 256, 8, 0, false, true, false};
    eng *e;
    char err[PD_ERR_LEN];
    CHECK(eng_create(&p, &cfg, (eng_executor){failing_forward, &x, NULL, NULL, NULL, NULL, NULL}, &e, err) == 0);
    ew_callbacks cb = {.on_output = on_output, .on_error = on_error,
                       .on_step_failed = on_step_failed, .step_arg = NULL};
    ew *w;
    CHECK(ew_create(e, &cb, &w) == 0);
    memset(g_items, 0, 2 * sizeof g_items[0]);
    for (int k = 0; k < 2; k++) {
        item *it = &g_items[k];
        for (int j = 0; j < 5; j++) it->prompt[j] = 3 + j + k;
        it->rq.id = 900 + (uint64_t)k;
        it->rq.prompt = it->prompt;
        it->rq.n_prompt = 5;
        it->rq.sampling = smp_default_params();
        it->rq.stop.max_tokens = 50;
        it->rq.stop.ignore_eos = true;
        CHECK(ew_submit(w, &it->rq, it) == 0);
        for (int t = 0; t < 2000 && !atomic_load(&it->terminal); t++) usleep(1000);
        CHECK_EQ_INT(atomic_load(&it->terminal), 1);
        CHECK(atomic_load(&it->errored));
        CHECK(!atomic_load(&it->aborted));
    }
    CHECK(atomic_load(&g_step_failed) >= 2);
    CHECK(strstr(g_step_failed_msg, "device lost") != NULL);
    ew_load l;
    ew_load_get(w, &l);
    CHECK(l.n_step_failures >= 2);
    CHECK_EQ_INT(l.n_running, 0);
    ew_destroy(w);
    free(x.f.kv);
}

int main(void)
{
    test_concurrent();
    test_decode_and_shutdown();
    test_step_failure();
    return pd_test_result("test_worker");
}
