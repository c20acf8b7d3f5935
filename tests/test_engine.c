/* test_engine.c -- Property test of the engine's bookkeeping with a fake model that reads the
 * KV cache: every token's "KV" records (token, position) at its slot, and each sampled token is
 * a hash of the whole context read back through the block table. A request that ever sees a
 * block of another request, a stale block, or a lost one produces different tokens than when
 * run alone. Random interleavings of add / step / abort over small pools (forcing preemption),
 * with prefix cache and chunked prefill on and off; refcounts and free lists checked after
 * every step; no block left in use at the end. Some requests ask for logprobs with 0..20
 * alternatives: the same values by every path (host sampler, forward_sample, pipelined) as
 * alone, the pick's entry in its list equal to its logprob, a greedy pick first. */
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "engine/engine.h"
#include "tests/test_util.h"

#include "tests/fake_model.h"

typedef struct {
    int32_t prompt[64];
    int32_t n_prompt;
    eng_request rq;
    int32_t out[64];
    int32_t n_out;
    float lp[64];
    int32_t n_top[64];
    pd_top_logprob top[64][PD_MAX_TOP_LOGPROBS];
    seq_finish finish;
    bool added, aborted, done;
} req;

static uint64_t rng_next(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

/* Keeps output o of r (token, logprobs) at r's next place. */
static void keep(req *r, const eng_output *o)
{
    const int32_t k = r->n_out++;
    r->out[k] = o->token;
    r->lp[k] = o->logprob;
    r->n_top[k] = o->n_top;
    if (o->n_top > 0) memcpy(r->top[k], o->top, (size_t)o->n_top * sizeof *o->top);
}

/* Runs one request alone on a roomy engine (host sampling): the reference. */
static void run_alone(const eng_request *rq, req *ref)
{
    mc_config cfg = fake_cfg();
    fake f = {calloc(256 * 4, sizeof(int64_t)), 256 * 4, 0, 0};
    eng_params p = {ENG_MODE_COLOCATED, 256, 4, 512, 8, 0, false, true, false};
    eng *e;
    char err[PD_ERR_LEN];
    eng_executor x = {fake_forward, &f, NULL, NULL, NULL, NULL};
    CHECK(eng_create(&p, &cfg, x, &e, err) == 0);
    CHECK_MSG(eng_add_request(e, rq, err) == 0, "%s", err);
    ref->n_out = 0;
    while (eng_has_work(e)) {
        const eng_output *o;
        int32_t k;
        CHECK(eng_step(e, &o, &k, err) == 0);
        for (int32_t j = 0; j < k; j++) {
            if (o[j].token >= 0) keep(ref, &o[j]);
            if (o[j].finish) ref->finish = o[j].finish;
        }
    }
    CHECK_EQ_INT(f.corrupt, 0);
    eng_destroy(e);
    free(f.kv);
}

static int64_t g_preemptions, g_cached, g_launches, g_chained;

static int run_case(uint64_t seed)
{
    uint64_t rs = seed * 0x9e3779b97f4a7c15ull + 1;
    const int n_req = 4 + (int)(rng_next(&rs) % 28);
    req *rq = calloc((size_t)n_req, sizeof *rq);
    eng_params p = {
        .mode = ENG_MODE_COLOCATED,
        .n_blocks = 16 + (int32_t)(rng_next(&rs) % 24),
        .block_size = 4,
        .max_num_batched_tokens = 8 + (int32_t)(rng_next(&rs) % 60),
        .max_num_seqs = 1 + (int32_t)(rng_next(&rs) % 8),
        .max_model_len = 0,
        .enable_prefix_cache = rng_next(&rs) % 4 != 0,
        .enable_chunked_prefill = rng_next(&rs) % 4 != 0,
    };
    /* Prompts from a few shared stems, so that prefixes repeat. */
    int32_t stems[3][40];
    for (int s = 0; s < 3; s++)
        for (int i = 0; i < 40; i++) stems[s][i] = 1 + (int32_t)(rng_next(&rs) % (V - 1));
    for (int i = 0; i < n_req; i++) {
        req *r = &rq[i];
        int stem = (int)(rng_next(&rs) % 3), shared = (int)(rng_next(&rs) % 30);
        r->n_prompt = 1 + (int32_t)(rng_next(&rs) % 40);
        for (int j = 0; j < r->n_prompt; j++)
            r->prompt[j] = j < shared ? stems[stem][j] : 1 + (int32_t)(rng_next(&rs) % (V - 1));
        if (!p.enable_chunked_prefill && r->n_prompt > p.max_num_batched_tokens)
            r->n_prompt = p.max_num_batched_tokens;
        r->rq.id = 1000 + (uint64_t)i;
        r->rq.prompt = r->prompt;
        r->rq.n_prompt = r->n_prompt;
        r->rq.sampling = smp_default_params();
        if (rng_next(&rs) % 2) r->rq.sampling.temperature = 0;
        smp_params *sp = &r->rq.sampling;
        switch (rng_next(&rs) % 6) { /* filters and penalties now and then */
        case 0: sp->top_k = 1 + (int32_t)(rng_next(&rs) % 10); sp->top_p = 0.8f; break;
        case 1: sp->min_p = 0.2f; sp->repetition_penalty = 1.3f; break;
        case 2: sp->presence_penalty = 0.5f; sp->frequency_penalty = 0.4f; break;
        case 3: sp->repetition_penalty = 0.8f; sp->frequency_penalty = -0.3f; break;
        default: break;
        }
        r->rq.sampling.seed = rng_next(&rs);
        r->rq.sampling.has_seed = true;
        /* a quarter asks for logprobs (from the seed's bits: the other draws stay as they were) */
        r->rq.logprobs = (r->rq.sampling.seed & 3) == 0;
        r->rq.top_logprobs = r->rq.logprobs ? (int32_t)((r->rq.sampling.seed >> 2) % 21) : 0;
        r->rq.stop.max_tokens = 1 + (int32_t)(rng_next(&rs) % 24);
        r->rq.stop.ignore_eos = rng_next(&rs) % 2;
        /* A request must fit the pool on its own (the engine rejects it otherwise). */
        while ((r->n_prompt + r->rq.stop.max_tokens + 3) / 4 > p.n_blocks) r->rq.stop.max_tokens--;
    }
    mc_config cfg = fake_cfg();
    fake f = {calloc((size_t)p.n_blocks * 4, sizeof(int64_t)), (int64_t)p.n_blocks * 4, 0, 0};
    eng *e;
    char err[PD_ERR_LEN];
    /* Odd seeds sample through the executor's forward_sample, as with a backend that samples
     * where the logits are; the reference (run_alone) samples on the host. */
    eng_executor x = {fake_forward, &f, NULL, seed % 2 ? fake_forward_sample : NULL, NULL, NULL};
    /* Seeds 3 mod 4 pipeline their decode steps (launch / collect). */
    fake_pipe fp = {0};
    fp.f = &f;
    if (seed % 4 == 3) {
        x = (eng_executor){fake_pipe_forward, &fp, NULL, fake_pipe_forward_sample,
                           fake_pipe_launch, fake_pipe_collect};
        p.async_steps = true;
    }
    int fails_before = pd_test_failures;
    CHECK(eng_create(&p, &cfg, x, &e, err) == 0);
    int added = 0, steps = 0;
    while (added < n_req || eng_has_work(e)) {
        uint64_t act = rng_next(&rs) % 10;
        if (added < n_req && act < 3) {
            CHECK_MSG(eng_add_request(e, &rq[added].rq, err) == 0, "%s", err);
            rq[added++].added = true;
        } else if (act == 3 && added > 0) {
            req *r = &rq[rng_next(&rs) % (uint64_t)added];
            int rc = eng_abort(e, r->rq.id);
            if (!r->done && !r->aborted) CHECK_EQ_INT(rc, 0);
            else CHECK_EQ_INT(rc, PD_ENOTFOUND);
            if (rc == 0) r->aborted = true;
        } else {
            const eng_output *o;
            int32_t k;
            CHECK(eng_step(e, &o, &k, err) == 0);
            steps++;
            for (int32_t j = 0; j < k; j++) {
                req *r = &rq[o[j].id - 1000];
                CHECK(!r->done && !r->aborted);
                if (o[j].token >= 0) keep(r, &o[j]);
                if (o[j].finish) {
                    r->finish = o[j].finish;
                    r->done = true;
                }
            }
        }
        if (eng_check(e) != 0) {
            CHECK_MSG(0, "seed %llu: engine invariants broken after %d steps",
                      (unsigned long long)seed, steps);
            break;
        }
        if (steps > 20000) {
            CHECK_MSG(0, "seed %llu: no progress", (unsigned long long)seed);
            break;
        }
    }
    CHECK_EQ_INT(bm_n_used(eng_block_manager(e)), 0);
    CHECK_EQ_INT(f.corrupt, 0);
    CHECK_EQ_INT((int)fp.misuse, 0);
    g_launches += fp.launches;
    g_chained += fp.chained;
    for (int i = 0; i < n_req; i++) {
        req *r = &rq[i];
        if (r->aborted) continue;
        CHECK(r->done);
        static req ref;
        memset(&ref, 0, sizeof ref);
        run_alone(&r->rq, &ref);
        const int32_t n_ref = ref.n_out;
        CHECK_EQ_INT(r->n_out, n_ref);
        CHECK_MSG(r->n_out == n_ref && memcmp(r->out, ref.out, (size_t)n_ref * 4) == 0 &&
                  r->finish == ref.finish, "seed %llu request %d: tokens differ from running alone",
                  (unsigned long long)seed, i);
        for (int32_t k = 0; k < r->n_out && k < n_ref; k++) {
            const int32_t want_top = r->rq.logprobs ? r->rq.top_logprobs : 0;
            CHECK_MSG(r->lp[k] == ref.lp[k] && r->n_top[k] == ref.n_top[k] &&
                      r->n_top[k] == want_top &&
                      memcmp(r->top[k], ref.top[k], (size_t)r->n_top[k] * sizeof ref.top[k][0]) == 0,
                      "seed %llu request %d token %d: logprob %g (%d alternatives), alone %g (%d)",
                      (unsigned long long)seed, i, k, (double)r->lp[k], r->n_top[k],
                      (double)ref.lp[k], ref.n_top[k]);
            if (!r->rq.logprobs) {
                CHECK(r->lp[k] == 0.0f);
                continue;
            }
            CHECK(r->lp[k] <= 0.0f);
            for (int32_t j = 0; j < r->n_top[k]; j++) {
                if (j) CHECK(r->top[k][j].logprob <= r->top[k][j - 1].logprob);
                if (r->top[k][j].token == r->out[k]) CHECK(r->top[k][j].logprob == r->lp[k]);
            }
            const smp_params *sp = &r->rq.sampling;
            if (sp->temperature == 0 && !smp_penalized(sp) && r->n_top[k] > 0)
                CHECK_MSG(r->top[k][0].token == r->out[k], "greedy pick %d, top-1 %d",
                          r->out[k], r->top[k][0].token);
        }
    }
    g_preemptions += eng_stats_get(e)->preemptions;
    g_cached += eng_stats_get(e)->cached_tokens;
    eng_destroy(e);
    free(f.kv);
    free(rq);
    return pd_test_failures == fails_before ? 0 : -1;
}

/* Decode-only and prefill-only modes: reserve/admit/release bookkeeping. */
static void test_modes(void)
{
    mc_config cfg = fake_cfg();
    char err[PD_ERR_LEN];
    /* Prefill-only: the request finishes with PREFILLED after one token and keeps its blocks
     * until released. */
    fake f = {calloc(64 * 4, sizeof(int64_t)), 64 * 4, 0, 0};
    eng_params p = {ENG_MODE_PREFILL, 64, 4, 64, 4, 0, true, true, false};
    eng *e;
    CHECK(eng_create(&p, &cfg, (eng_executor){fake_forward, &f, NULL, NULL, NULL, NULL}, &e, err) == 0);
    int32_t prompt[10] = {5, 6, 7, 8, 9, 10, 11, 12, 13, 14};
    eng_request rq = {.id = 7, .prompt = prompt, .n_prompt = 10, .sampling = smp_default_params()};
    rq.sampling.temperature = 0;
    rq.stop.max_tokens = 16;
    rq.logprobs = true; /* the first token's logprobs come with the PREFILLED output */
    rq.top_logprobs = 3;
    CHECK(eng_add_request(e, &rq, err) == 0);
    rq.logprobs = false;
    rq.top_logprobs = 0;
    const eng_output *o;
    int32_t k;
    CHECK(eng_step(e, &o, &k, err) == 0);
    CHECK_EQ_INT(k, 1);
    CHECK_EQ_INT(o[0].finish, SEQ_FINISH_PREFILLED);
    CHECK_EQ_INT(o[0].n_top, 3);
    CHECK(o[0].n_top == 3 && o[0].top[0].token == o[0].token && o[0].top[0].logprob == o[0].logprob &&
          o[0].logprob < 0.0f && o[0].top[1].logprob <= o[0].top[0].logprob);
    CHECK_EQ_INT(o[0].n_blocks, 3);
    int32_t prefill_tok = o[0].token;
    CHECK(bm_n_used(eng_block_manager(e)) >= 3);
    CHECK(!eng_has_work(e));
    CHECK_EQ_INT(eng_release(e, 7), 0);
    CHECK_EQ_INT(eng_release(e, 7), PD_ENOTFOUND);
    CHECK_EQ_INT(bm_n_used(eng_block_manager(e)), 0);
    CHECK(eng_check(e) == 0);
    eng_destroy(e);

    /* Decode-only: reserve, fill the KV "from outside", admit with the first token; the tokens
     * after it match a colocated run. */
    p.mode = ENG_MODE_DECODE;
    memset(f.kv, 0, 64 * 4 * sizeof(int64_t));
    CHECK(eng_create(&p, &cfg, (eng_executor){fake_forward, &f, NULL, NULL, NULL, NULL}, &e, err) == 0);
    const int32_t *blocks;
    int32_t nb, nc;
    CHECK(eng_reserve(e, &rq, &blocks, &nb, &nc, err) == 0);
    CHECK_EQ_INT(nb, 3);
    CHECK_EQ_INT(nc, 0); /* nothing cached yet */
    int32_t first_blocks[3];
    memcpy(first_blocks, blocks, sizeof first_blocks);
    for (int32_t i = 0; i < 10; i++) f.kv[blocks[i / 4] * 4 + i % 4] = ((int64_t)i << 16 | prompt[i]) + 1;
    CHECK_EQ_INT(eng_admit(e, 99, prefill_tok, err), PD_ENOTFOUND);
    CHECK_EQ_INT(eng_admit(e, 7, V + 5, err), PD_EINVAL);
    CHECK(eng_admit(e, 7, prefill_tok, err) == 0);
    int32_t got[32], n = 1;
    got[0] = prefill_tok;
    while (eng_has_work(e)) {
        CHECK(eng_step(e, &o, &k, err) == 0);
        for (int32_t j = 0; j < k; j++) if (o[j].token >= 0) got[n++] = o[j].token;
        CHECK(eng_check(e) == 0);
    }
    static req alone;
    memset(&alone, 0, sizeof alone);
    run_alone(&rq, &alone);
    const int32_t n_ref = alone.n_out;
    const int32_t *ref = alone.out;
    CHECK_EQ_INT(n, n_ref);
    CHECK(memcmp(got, ref, (size_t)n_ref * 4) == 0);
    CHECK_EQ_INT(bm_n_used(eng_block_manager(e)), 0);
    /* Decode-side prefix reuse: the same prompt again shares its 2 cached full blocks (not the
     * last, partial one); only block 2 is written from outside, and the tokens are the same. */
    rq.id = 8;
    CHECK(eng_reserve(e, &rq, &blocks, &nb, &nc, err) == 0);
    CHECK_EQ_INT(nb, 3);
    CHECK_EQ_INT(nc, 2);
    CHECK_EQ_INT(blocks[0], first_blocks[0]);
    CHECK_EQ_INT(blocks[1], first_blocks[1]);
    CHECK_EQ_INT(eng_stats_get(e)->reserved_cached_tokens, 8);
    for (int32_t i = 8; i < 10; i++) f.kv[blocks[i / 4] * 4 + i % 4] = ((int64_t)i << 16 | prompt[i]) + 1;
    CHECK(eng_admit(e, 8, prefill_tok, err) == 0);
    n = 1;
    while (eng_has_work(e)) {
        CHECK(eng_step(e, &o, &k, err) == 0);
        for (int32_t j = 0; j < k; j++) if (o[j].token >= 0) got[n++] = o[j].token;
        CHECK(eng_check(e) == 0);
    }
    CHECK_EQ_INT(n, n_ref);
    CHECK(memcmp(got, ref, (size_t)n_ref * 4) == 0);
    rq.id = 7;
    /* Reserve then abort frees at once; a pool that is too full says ENOSPC. */
    CHECK(eng_reserve(e, &rq, &blocks, &nb, &nc, err) == 0);
    CHECK(bm_n_used(eng_block_manager(e)) > 0);
    CHECK_EQ_INT(eng_abort(e, 7), 0);
    CHECK_EQ_INT(bm_n_used(eng_block_manager(e)), 0);
    int ok = 0, rc = 0;
    int32_t other[10];
    memcpy(other, prompt, sizeof other);
    rq.prompt = other; /* a prompt of its own each: nothing shared */
    for (uint64_t id = 100; id < 200 && rc == 0; id++) {
        rq.id = id;
        other[0] = (int32_t)id % V;
        const int32_t *bl;
        rc = eng_reserve(e, &rq, &bl, &nb, &nc, err);
        if (rc == 0) ok++;
    }
    CHECK_EQ_INT(rc, PD_ENOSPC);
    CHECK_EQ_INT(ok, 64 / 3);
    eng_destroy(e); /* frees the reservations too (ASan checks) */
    free(f.kv);
}

/* Bad requests are refused with a message. */
/* Pipelined steps: a step stays launched between eng_step calls (eng_has_work says so); an
 * abort of a sequence it holds keeps its blocks until the step is collected; destroying the
 * engine with a step launched collects it (no buffer left for the executor to write). */
static void test_pipelined_lifecycle(void)
{
    mc_config cfg = fake_cfg();
    char err[PD_ERR_LEN];
    fake f = {calloc(64 * 4, sizeof(int64_t)), 64 * 4, 0, 0};
    fake_pipe fp = {0};
    fp.f = &f;
    eng_params p = {ENG_MODE_COLOCATED, 64, 4, 64, 4, 0, true, true, true};
    eng *e;
    CHECK(eng_create(&p, &cfg, (eng_executor){fake_pipe_forward, &fp, NULL, fake_pipe_forward_sample,
                                              fake_pipe_launch, fake_pipe_collect}, &e, err) == 0);
    int32_t prompt[5] = {1, 2, 3, 4, 5};
    eng_request rq = {.id = 1, .prompt = prompt, .n_prompt = 5, .sampling = smp_default_params()};
    rq.sampling.temperature = 0.0f;
    rq.stop.max_tokens = 20;
    rq.stop.ignore_eos = true;
    CHECK(eng_add_request(e, &rq, err) == 0);
    rq.id = 2;
    CHECK(eng_add_request(e, &rq, err) == 0);
    const eng_output *o;
    int32_t k, got = 0;
    for (int i = 0; i < 4; i++) { /* the prompts, then decode steps: one launched ahead */
        CHECK(eng_step(e, &o, &k, err) == 0);
        got += k;
    }
    CHECK_EQ_INT(fp.n_out, 1);
    CHECK(fp.chained > 0);
    const int32_t used = bm_n_used(eng_block_manager(e));
    CHECK(eng_abort(e, 1) == 0);
    CHECK_EQ_INT(eng_abort(e, 1), PD_ENOTFOUND);
    CHECK_EQ_INT(bm_n_used(eng_block_manager(e)), used); /* held for the launched step */
    CHECK(eng_check(e) == 0);
    CHECK(eng_has_work(e));
    CHECK(eng_step(e, &o, &k, err) == 0); /* collects it: request 2's token only */
    for (int32_t j = 0; j < k; j++) CHECK(o[j].id == 2);
    CHECK(bm_n_used(eng_block_manager(e)) < used);
    CHECK(eng_check(e) == 0);
    CHECK(eng_step(e, &o, &k, err) == 0);
    CHECK_EQ_INT(fp.n_out, 1); /* request 2 alone, pipelined again */
    eng_destroy(e);
    CHECK_EQ_INT(fp.n_out, 0);
    CHECK_EQ_INT((int)fp.misuse, 0);
    (void)got;
    free(f.kv);
}

static void test_bad_requests(void)
{
    mc_config cfg = fake_cfg();
    char err[PD_ERR_LEN];
    fake f = {calloc(16 * 4, sizeof(int64_t)), 16 * 4, 0, 0};
    eng_params p = {ENG_MODE_COLOCATED, 16, 4, 32, 4, 0, true, false, false};
    eng *e;
    CHECK(eng_create(&p, &cfg, (eng_executor){fake_forward, &f, NULL, NULL, NULL, NULL}, &e, err) == 0);
    int32_t prompt[40] = {1, 2, 3};
    eng_request rq = {.id = 1, .prompt = prompt, .n_prompt = 3, .sampling = smp_default_params()};
    rq.stop.max_tokens = 4;
    CHECK(eng_add_request(e, &rq, err) == 0);
    CHECK_EQ_INT(eng_add_request(e, &rq, err), PD_EINVAL);
    CHECK_STR_CONTAINS(err, "already in use");
    rq.id = 2;
    rq.n_prompt = 0;
    CHECK_EQ_INT(eng_add_request(e, &rq, err), PD_EINVAL);
    rq.n_prompt = 3;
    prompt[1] = V;
    CHECK_EQ_INT(eng_add_request(e, &rq, err), PD_EINVAL);
    CHECK_STR_CONTAINS(err, "out of range");
    prompt[1] = 2;
    rq.stop.max_tokens = 0;
    CHECK_EQ_INT(eng_add_request(e, &rq, err), PD_EINVAL);
    rq.stop.max_tokens = 62; /* 65 tokens > 16 blocks of 4 */
    CHECK_EQ_INT(eng_add_request(e, &rq, err), PD_ERANGE);
    CHECK_STR_CONTAINS(err, "KV blocks");
    rq.stop.max_tokens = 300;
    CHECK_EQ_INT(eng_add_request(e, &rq, err), PD_ERANGE);
    CHECK_STR_CONTAINS(err, "maximum length");
    rq.stop.max_tokens = 4;
    rq.stop.min_tokens = 5;
    CHECK_EQ_INT(eng_add_request(e, &rq, err), PD_EINVAL);
    rq.stop.min_tokens = 0;
    rq.logprobs = true;
    rq.top_logprobs = PD_MAX_TOP_LOGPROBS + 1;
    CHECK_EQ_INT(eng_add_request(e, &rq, err), PD_EINVAL);
    CHECK_STR_CONTAINS(err, "top logprobs");
    rq.top_logprobs = -1;
    CHECK_EQ_INT(eng_add_request(e, &rq, err), PD_EINVAL);
    rq.logprobs = false;
    rq.top_logprobs = 0;
    rq.n_prompt = 40; /* > 32 tokens per step with chunked prefill off */
    CHECK_EQ_INT(eng_add_request(e, &rq, err), PD_ERANGE);
    rq.n_prompt = 3;
    rq.sampling.top_p = 0;
    CHECK_EQ_INT(eng_add_request(e, &rq, err), PD_EINVAL);
    CHECK_STR_CONTAINS(err, "top_p");
    CHECK_EQ_INT(eng_abort(e, 12345), PD_ENOTFOUND);
    eng_destroy(e);
    free(f.kv);
}

int main(int argc, char **argv)
{
    int n_seeds = argc > 1 ? atoi(argv[1]) : 2000;
    int bad = 0;
    for (int s = 0; s < n_seeds; s++)
        if (run_case((uint64_t)s) < 0 && ++bad > 3) break;
    fprintf(stderr, "test_engine: %d random cases, %lld preemptions, %lld prompt tokens from "
            "the prefix cache, %lld pipelined launches (%lld chained)\n", n_seeds,
            (long long)g_preemptions, (long long)g_cached, (long long)g_launches,
            (long long)g_chained);
    CHECK(g_preemptions > 500); /* the pools are small enough to force preemption */
    CHECK(g_cached > 100);      /* and prompts share prefixes */
    CHECK(g_chained > 1000);    /* and pipelined steps do chain (the cases 3 mod 4) */
    test_modes();
    test_pipelined_lifecycle();
    test_bad_requests();
    return pd_test_result("test_engine");
}
