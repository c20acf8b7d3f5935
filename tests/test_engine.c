/* test_engine.c -- Property test of the engine's bookkeeping with a fake model that reads the
 * KV cache: every token's "KV" records (token, position) at its slot, and each sampled token is
 * a hash of the whole context read back through the block table. A request that ever sees a
 * block of another request, a stale block, or a lost one produces different tokens than when
 * run alone. Random interleavings of add / step / abort over small pools (forcing preemption),
 * with prefix cache and chunked prefill on and off; refcounts and free lists checked after
 * every step; no block left in use at the end. Some requests ask for logprobs with 0..20
 * alternatives: the same values by every path (host sampler, forward_sample, pipelined) as
 * alone, the pick's entry in its list equal to its logprob, a greedy pick first. Some ask for
 * n > 1 choices: choice c equals the request alone with seed + c, logprobs included. Now and
 * then a random choice is ended (eng_end_choice, before or after the fork, also while a
 * pipelined step holds it): it ends once, CANCELLED, with a prefix of its tokens alone, and
 * the others are unchanged. */
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "engine/engine.h"
#include "tests/test_util.h"

#include "tests/fake_model.h"

/* One choice's outputs. */
typedef struct {
    int32_t out[64];
    int32_t n_out;
    float lp[64];
    int32_t n_top[64];
    pd_top_logprob top[64][PD_MAX_TOP_LOGPROBS];
    seq_finish finish;
} chout;

typedef struct {
    int32_t prompt[64];
    int32_t n_prompt;
    eng_request rq;
    chout ch[4];          /* per choice */
    uint32_t ended;       /* choices ended with eng_end_choice (bit c) */
    bool added, aborted, done;
} req;

/* Choice c of rq alone: one choice with seed + c (what the engine promises it equals). */
static eng_request choice_alone(const eng_request *rq, int32_t c)
{
    eng_request one = *rq;
    one.n = 1;
    one.sampling.seed += (uint64_t)c;
    return one;
}

static uint64_t rng_next(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

/* Keeps output o of a choice (token, logprobs) at r's next place. */
static void keep(chout *r, const eng_output *o)
{
    const int32_t k = r->n_out++;
    r->out[k] = o->token;
    r->lp[k] = o->logprob;
    r->n_top[k] = o->n_top;
    if (o->n_top > 0) memcpy(r->top[k], o->top, (size_t)o->n_top * sizeof *o->top);
}

/* Runs one request (of one choice) alone on a roomy engine (host sampling): the reference. */
static void run_alone(const eng_request *rq, chout *ref)
{
    mc_config cfg = fake_cfg();
    fake f = {calloc(256 * 4, sizeof(int64_t)), 256 * 4, 0, 0};
    eng_params p = {ENG_MODE_COLOCATED, 256, 4, 512, 8, 0, false, true, false};
    eng *e;
    char err[PD_ERR_LEN];
    eng_executor x = {fake_forward, &f, NULL, NULL, NULL, NULL, fake_clone_blocks};
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

/* run_alone's tokens and finish only. */
static void run_alone_tokens(const eng_request *rq, int32_t *out, int32_t *n_out, seq_finish *fin)
{
    static chout ref;
    memset(&ref, 0, sizeof ref);
    run_alone(rq, &ref);
    memcpy(out, ref.out, (size_t)ref.n_out * sizeof *out);
    *n_out = ref.n_out;
    *fin = ref.finish;
}

/* Whether a choice's tokens (and, with check_fin, its finish) are those of choice c run alone
 * (seed + c). */
static bool same_as_alone(const eng_request *rq, int32_t c, const int32_t *got, int32_t n_got,
                          seq_finish fin, bool check_fin)
{
    int32_t ref[64], n_ref;
    seq_finish rf;
    eng_request one = choice_alone(rq, c);
    run_alone_tokens(&one, ref, &n_ref, &rf);
    return n_got == n_ref && !memcmp(got, ref, (size_t)n_ref * 4) && (!check_fin || fin == rf);
}

static int64_t g_preemptions, g_cached, g_launches, g_chained, g_forks, g_fork_recomputed;
static int64_t g_ended, g_ended_pipe, g_ended_early; /* choices ended: in all, while pipelined,
                                                       before their first token */

static int run_case(uint64_t seed)
{
    uint64_t rs = seed * 0x9e3779b97f4a7c15ull + 1;
    uint64_t re = seed * 0xbf58476d1ce4e5b9ull + 7; /* eng_end_choice's draws */
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
        if (rng_next(&rs) % 4 == 0) /* n > 1: forked after the prompt, blocks shared */
            r->rq.n = 2 + (int32_t)(rng_next(&rs) % 3);
        if (r->rq.n > p.max_num_seqs) r->rq.n = 0;
        /* A request must fit the pool on its own (the engine rejects it otherwise). */
        while ((r->n_prompt + r->rq.stop.max_tokens + 3) / 4 > p.n_blocks) r->rq.stop.max_tokens--;
    }
    mc_config cfg = fake_cfg();
    fake f = {calloc((size_t)p.n_blocks * 4, sizeof(int64_t)), (int64_t)p.n_blocks * 4, 0, 0};
    eng *e;
    char err[PD_ERR_LEN];
    /* Odd seeds sample through the executor's forward_sample, as with a backend that samples
     * where the logits are; the reference (run_alone) samples on the host. */
    eng_executor x = {fake_forward, &f, NULL, seed % 2 ? fake_forward_sample : NULL, NULL, NULL,
                      fake_clone_blocks};
    /* Seeds 5 mod 8 have no clone op: forked choices recompute their context instead. */
    if (seed % 8 == 5) x.clone_blocks = NULL;
    /* Seeds 3 mod 4 pipeline their decode steps (launch / collect). */
    fake_pipe fp = {0};
    fp.f = &f;
    if (seed % 4 == 3) {
        x = (eng_executor){fake_pipe_forward, &fp, NULL, fake_pipe_forward_sample,
                           fake_pipe_launch, fake_pipe_collect, fake_pipe_clone_blocks};
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
        } else if (act == 4 && added > 0 && rng_next(&re) % 2) {
            req *r = &rq[rng_next(&re) % (uint64_t)added];
            const int32_t nc = r->rq.n > 1 ? r->rq.n : 1;
            const int32_t c = (int32_t)(rng_next(&re) % (uint64_t)nc);
            int rc = eng_end_choice(e, r->rq.id, c);
            /* a colocated engine reports every finish in the step that decides it */
            if (r->done || r->aborted || r->ch[c].finish || (r->ended >> c & 1))
                CHECK_EQ_INT(rc, PD_ENOTFOUND);
            else
                CHECK_EQ_INT(rc, 0);
            if (rc == 0) {
                r->ended |= 1u << c;
                g_ended_early += r->ch[c].n_out == 0;
            }
            CHECK_EQ_INT(eng_end_choice(e, r->rq.id, nc),
                         r->done || r->aborted ? PD_ENOTFOUND : PD_EINVAL);
        } else {
            const eng_output *o;
            int32_t k;
            CHECK(eng_step(e, &o, &k, err) == 0);
            steps++;
            for (int32_t j = 0; j < k; j++) {
                req *r = &rq[o[j].id - 1000];
                const int32_t c = o[j].choice;
                CHECK(!r->done && !r->aborted);
                CHECK(c >= 0 && c < (r->rq.n > 1 ? r->rq.n : 1) && !r->ch[c].finish);
                if (c < 0 || c > 3) continue;
                if (o[j].token >= 0) keep(&r->ch[c], &o[j]);
                if (o[j].finish) r->ch[c].finish = o[j].finish;
                if (o[j].finish == SEQ_FINISH_CANCELLED) {
                    CHECK(r->ended >> c & 1); /* only an ended choice */
                    g_ended++;
                    g_ended_pipe += seed % 4 == 3;
                }
                if (o[j].done) {
                    for (int32_t i = 0; i < (r->rq.n > 1 ? r->rq.n : 1); i++) CHECK(r->ch[i].finish);
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
        for (int32_t c = 0; c < (r->rq.n > 1 ? r->rq.n : 1); c++) {
            static chout ref;
            memset(&ref, 0, sizeof ref);
            const eng_request one = choice_alone(&r->rq, c);
            run_alone(&one, &ref);
            const chout *h = &r->ch[c];
            int32_t n_ref = ref.n_out;
            if (h->finish == SEQ_FINISH_CANCELLED) { /* ended: a prefix of its tokens alone */
                CHECK_MSG(h->n_out <= n_ref, "seed %llu request %d choice %d: ended after %d "
                          "tokens, %d alone", (unsigned long long)seed, i, c, h->n_out, n_ref);
                n_ref = h->n_out < n_ref ? h->n_out : n_ref;
                ref.finish = SEQ_FINISH_CANCELLED;
            }
            CHECK_EQ_INT(h->n_out, n_ref);
            CHECK_MSG(h->n_out == n_ref && memcmp(h->out, ref.out, (size_t)n_ref * 4) == 0 &&
                      h->finish == ref.finish, "seed %llu request %d choice %d of %d: tokens "
                      "differ from running alone", (unsigned long long)seed, i, c, r->rq.n);
            for (int32_t k = 0; k < h->n_out && k < n_ref; k++) {
                const int32_t want_top = r->rq.logprobs ? r->rq.top_logprobs : 0;
                CHECK_MSG(h->lp[k] == ref.lp[k] && h->n_top[k] == ref.n_top[k] &&
                          h->n_top[k] == want_top &&
                          memcmp(h->top[k], ref.top[k], (size_t)h->n_top[k] * sizeof ref.top[k][0]) == 0,
                          "seed %llu request %d choice %d token %d: logprob %g (%d alternatives), "
                          "alone %g (%d)", (unsigned long long)seed, i, c, k, (double)h->lp[k],
                          h->n_top[k], (double)ref.lp[k], ref.n_top[k]);
                if (!r->rq.logprobs) {
                    CHECK(h->lp[k] == 0.0f);
                    continue;
                }
                CHECK(h->lp[k] <= 0.0f);
                for (int32_t j = 0; j < h->n_top[k]; j++) {
                    if (j) CHECK(h->top[k][j].logprob <= h->top[k][j - 1].logprob);
                    if (h->top[k][j].token == h->out[k]) CHECK(h->top[k][j].logprob == h->lp[k]);
                }
                const smp_params *sp = &r->rq.sampling;
                if (sp->temperature == 0 && !smp_penalized(sp) && h->n_top[k] > 0)
                    CHECK_MSG(h->top[k][0].token == h->out[k], "greedy pick %d, top-1 %d",
                              h->out[k], h->top[k][0].token);
            }
        }
    }
    g_forks += eng_stats_get(e)->forks;
    g_fork_recomputed += eng_stats_get(e)->fork_recomputed;
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
    CHECK(eng_create(&p, &cfg, (eng_executor){fake_forward, &f, NULL, NULL, NULL, NULL, fake_clone_blocks}, &e, err) == 0);
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
    CHECK(eng_create(&p, &cfg, (eng_executor){fake_forward, &f, NULL, NULL, NULL, NULL, fake_clone_blocks}, &e, err) == 0);
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
    static chout alone;
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

/* Runs e until idle; collects each choice's tokens (after `have` already in got) and
 * finishes; checks the invariants every step. Returns the number of done outputs. */
static int drain_choices(eng *e, int32_t got[][64], int32_t *n_got, seq_finish *fin)
{
    const eng_output *o;
    int32_t k, done = 0;
    char err[PD_ERR_LEN];
    while (eng_has_work(e)) {
        CHECK(eng_step(e, &o, &k, err) == 0);
        for (int32_t j = 0; j < k; j++) {
            if (o[j].token >= 0) got[o[j].choice][n_got[o[j].choice]++] = o[j].token;
            if (o[j].finish) fin[o[j].choice] = o[j].finish;
            done += o[j].done;
        }
        CHECK(eng_check(e) == 0);
    }
    return done;
}

/* n > 1 choices: the prompt is computed once and its full blocks shared (reference counts),
 * the partial one copied per choice; choice c equals the request alone with seed + c, in the
 * colocated, prefill-only and decode-only modes; an abort frees every block once, also while
 * some choices have finished and others run; eng_end_choice ends one choice (before the fork,
 * while a reservation waits for its KV, mid-decode) and leaves the others as they were. */
static void test_choices(void)
{
    mc_config cfg = fake_cfg();
    char err[PD_ERR_LEN];
    fake f = {calloc(64 * 4, sizeof(int64_t)), 64 * 4, 0, 0};
    eng_params p = {ENG_MODE_COLOCATED, 64, 4, 64, 8, 0, true, true, false};
    eng_executor x = {fake_forward, &f, NULL, NULL, NULL, NULL, fake_clone_blocks};
    eng *e;
    int32_t prompt[10] = {5, 6, 7, 8, 9, 10, 11, 12, 13, 14};
    eng_request rq = {.id = 7, .prompt = prompt, .n_prompt = 10, .sampling = smp_default_params(),
                      .n = 3};
    rq.sampling.seed = 1234;
    rq.sampling.has_seed = true;
    rq.stop.max_tokens = 8;
    rq.stop.ignore_eos = true;
    for (int greedy = 0; greedy < 2; greedy++) {
        rq.sampling.temperature = greedy ? 0.0f : 1.0f;
        CHECK(eng_create(&p, &cfg, x, &e, err) == 0);
        CHECK(eng_add_request(e, &rq, err) == 0);
        const eng_output *o;
        int32_t k, got[3][64], n_got[3] = {0}, n_first = 0;
        seq_finish fin[3] = {0};
        CHECK(eng_step(e, &o, &k, err) == 0); /* the prompt, once: three first tokens */
        CHECK_EQ_INT(k, 3);
        for (int32_t j = 0; j < k; j++) {
            CHECK_EQ_INT(o[j].choice, j);
            CHECK_EQ_INT(o[j].n_choices, 3);
            CHECK(!o[j].done);
            got[j][n_got[j]++] = o[j].token;
            n_first++;
        }
        /* 3 prompt blocks (2 full, shared by all three choices) + 2 copies of the partial
         * one = 5 blocks, where three separate requests hold 9 */
        CHECK_EQ_INT(bm_n_used(eng_block_manager(e)), 5);
        int32_t n_ref3 = 0;
        for (int32_t b = 0; b < 64; b++) n_ref3 += bm_ref(eng_block_manager(e), b) == 3;
        CHECK_EQ_INT(n_ref3, 2);
        CHECK_EQ_INT(eng_stats_get(e)->prompt_tokens_computed, 10);
        CHECK_EQ_INT(eng_stats_get(e)->fork_cloned_blocks, 2);
        CHECK(eng_check(e) == 0);
        CHECK_EQ_INT(drain_choices(e, got, n_got, fin), 1);
        for (int32_t c = 0; c < 3; c++) {
            int32_t ref[64], n_ref;
            seq_finish rf;
            eng_request one = choice_alone(&rq, c);
            run_alone_tokens(&one, ref, &n_ref, &rf);
            CHECK_EQ_INT(n_got[c], n_ref);
            CHECK_MSG(n_got[c] == n_ref && !memcmp(got[c], ref, (size_t)n_ref * 4) && fin[c] == rf,
                      "choice %d (%s) differs from seed + %d alone", c, greedy ? "greedy" : "t=1", c);
            if (greedy) CHECK(!memcmp(got[c], got[0], (size_t)n_ref * 4)); /* all alike */
        }
        if (!greedy) CHECK(memcmp(got[0], got[1], 8 * 4) || memcmp(got[0], got[2], 8 * 4));
        CHECK_EQ_INT(bm_n_used(eng_block_manager(e)), 0);
        eng_destroy(e);
    }

    /* Colocated, choices 0 and 2 ended before the prompt ran: the fork ends them with their
     * first token (choice 0 is the prompt's own sequence: its blocks stay shared by choice
     * 1, which goes on as alone). */
    rq.sampling.temperature = 1.0f;
    CHECK(eng_create(&p, &cfg, x, &e, err) == 0);
    CHECK(eng_add_request(e, &rq, err) == 0);
    CHECK_EQ_INT(eng_end_choice(e, 7, 0), 0);
    CHECK_EQ_INT(eng_end_choice(e, 7, 2), 0);
    {
        const eng_output *o;
        int32_t k, got[3][64], n_got[3] = {0};
        seq_finish fin[3] = {0};
        CHECK(eng_step(e, &o, &k, err) == 0);
        CHECK_EQ_INT(k, 3);
        for (int32_t j = 0; j < k; j++) {
            got[o[j].choice][n_got[o[j].choice]++] = o[j].token;
            fin[o[j].choice] = o[j].finish;
            CHECK(!o[j].done);
        }
        CHECK(fin[0] == SEQ_FINISH_CANCELLED && fin[1] == SEQ_FINISH_NONE &&
              fin[2] == SEQ_FINISH_CANCELLED);
        CHECK_EQ_INT(bm_n_used(eng_block_manager(e)), 3); /* 2 full + choice 1's copy */
        CHECK(eng_check(e) == 0);
        CHECK_EQ_INT(drain_choices(e, got, n_got, fin), 1);
        CHECK_MSG(same_as_alone(&rq, 1, got[1], n_got[1], fin[1], true),
                  "choice 1 differs from seed + 1 alone after its siblings were ended");
        CHECK(n_got[0] == 1 && n_got[2] == 1);
        CHECK_EQ_INT(eng_stats_get(e)->choices_ended, 2);
        CHECK_EQ_INT(bm_n_used(eng_block_manager(e)), 0);
    }
    eng_destroy(e);

    /* Logprobs with 3 alternatives: each choice's tokens carry the logprobs and the lists of
     * the request alone with seed + c (its first token's too), sampled on the host and where
     * the logits are (forward_sample). */
    rq.sampling.temperature = 1.0f;
    rq.logprobs = true;
    rq.top_logprobs = 3;
    for (int on_backend = 0; on_backend < 2; on_backend++) {
        eng_executor xs = x;
        if (on_backend) xs.forward_sample = fake_forward_sample;
        CHECK(eng_create(&p, &cfg, xs, &e, err) == 0);
        CHECK(eng_add_request(e, &rq, err) == 0);
        static chout got[3], ref;
        memset(got, 0, sizeof got);
        while (eng_has_work(e)) {
            const eng_output *o;
            int32_t k;
            CHECK(eng_step(e, &o, &k, err) == 0);
            for (int32_t j = 0; j < k; j++) {
                if (o[j].token >= 0) keep(&got[o[j].choice], &o[j]);
                if (o[j].finish) got[o[j].choice].finish = o[j].finish;
            }
        }
        for (int32_t c = 0; c < 3; c++) {
            memset(&ref, 0, sizeof ref);
            const eng_request one = choice_alone(&rq, c);
            run_alone(&one, &ref);
            CHECK_EQ_INT(got[c].n_out, ref.n_out);
            bool same = got[c].n_out == ref.n_out && got[c].n_out == 8;
            for (int32_t t = 0; same && t < ref.n_out; t++)
                same = got[c].out[t] == ref.out[t] && got[c].lp[t] == ref.lp[t] &&
                       got[c].n_top[t] == 3 && ref.n_top[t] == 3 &&
                       !memcmp(got[c].top[t], ref.top[t], 3 * sizeof ref.top[t][0]);
            CHECK_MSG(same, "choice %d (%s): logprobs differ from seed + %d alone", c,
                      on_backend ? "forward_sample" : "host", c);
        }
        CHECK_EQ_INT(bm_n_used(eng_block_manager(e)), 0);
        eng_destroy(e);
    }
    rq.logprobs = false;
    rq.top_logprobs = 0;

    /* Abort while some choices finished and others run: stop ids end choices at different
     * steps; every block is freed exactly once (the block manager asserts on a double free). */
    rq.sampling.temperature = 1.0f;
    rq.stop.max_tokens = 20;
    rq.stop.n_stop_ids = 6;
    for (int32_t i = 0; i < 6; i++) rq.stop.stop_ids[i] = 1 + 7 * i;
    int mixed = 0;
    for (uint64_t sd = 0; sd < 64; sd++) {
        rq.sampling.seed = sd;
        CHECK(eng_create(&p, &cfg, x, &e, err) == 0);
        CHECK(eng_add_request(e, &rq, err) == 0);
        int32_t n_fin = 0, steps = 0;
        while (eng_has_work(e) && steps++ < 40) {
            const eng_output *o;
            int32_t k;
            CHECK(eng_step(e, &o, &k, err) == 0);
            for (int32_t j = 0; j < k; j++) n_fin += o[j].finish != SEQ_FINISH_NONE;
            if (n_fin > 0 && n_fin < 3) break;
        }
        if (n_fin > 0 && n_fin < 3) {
            mixed++;
            CHECK(bm_n_used(eng_block_manager(e)) > 0);
            CHECK_EQ_INT(eng_abort(e, 7), 0);
            CHECK_EQ_INT(eng_abort(e, 7), PD_ENOTFOUND);
            CHECK_EQ_INT(bm_n_used(eng_block_manager(e)), 0);
            CHECK(!eng_has_work(e));
            CHECK(eng_check(e) == 0);
        }
        eng_destroy(e);
    }
    CHECK(mixed > 3);
    rq.stop.n_stop_ids = 0;
    rq.stop.max_tokens = 8;

    /* Prefill-only: one PREFILLED output carrying every choice's first token, with its
     * logprob and alternatives (those of seed + c alone). */
    p.mode = ENG_MODE_PREFILL;
    rq.sampling.seed = 99;
    rq.logprobs = true;
    rq.top_logprobs = 3;
    CHECK(eng_create(&p, &cfg, x, &e, err) == 0);
    CHECK(eng_add_request(e, &rq, err) == 0);
    const eng_output *o;
    int32_t k, firsts[3];
    CHECK(eng_step(e, &o, &k, err) == 0);
    CHECK_EQ_INT(k, 1);
    CHECK_EQ_INT(o[0].finish, SEQ_FINISH_PREFILLED);
    CHECK(o[0].done && o[0].n_choices == 3 && o[0].choice_tokens && o[0].choice_logprobs &&
          o[0].choice_top && o[0].choice_n_top);
    CHECK_EQ_INT(o[0].n_blocks, 3);
    for (int32_t c = 0; c < 3 && o[0].choice_tokens && o[0].choice_top; c++) {
        firsts[c] = o[0].choice_tokens[c];
        static chout ref;
        memset(&ref, 0, sizeof ref);
        eng_request one = choice_alone(&rq, c);
        run_alone(&one, &ref);
        CHECK_EQ_INT(firsts[c], ref.out[0]);
        CHECK_EQ_INT(o[0].choice_n_top[c], 3);
        CHECK_MSG(o[0].choice_logprobs[c] == ref.lp[0] && o[0].choice_n_top[c] == 3 &&
                  !memcmp(o[0].choice_top + (size_t)c * PD_MAX_TOP_LOGPROBS, ref.top[0],
                          3 * sizeof ref.top[0][0]),
                  "prefill choice %d: first logprob %g, alone %g", c,
                  (double)o[0].choice_logprobs[c], (double)ref.lp[0]);
    }
    CHECK_EQ_INT(o[0].token, firsts[0]);
    CHECK(o[0].n_top == 3 && o[0].top && o[0].logprob == o[0].choice_logprobs[0]);
    CHECK_EQ_INT(eng_end_choice(e, 7, 1), PD_ESTATE); /* prefill-only: nothing to end */
    rq.logprobs = false;
    rq.top_logprobs = 0;
    CHECK_EQ_INT(eng_release(e, 7), 0);
    CHECK_EQ_INT(bm_n_used(eng_block_manager(e)), 0);
    eng_destroy(e);

    /* Decode-only: reserve, the KV "arrives", admission with the three first tokens forks. */
    p.mode = ENG_MODE_DECODE;
    memset(f.kv, 0, 64 * 4 * sizeof(int64_t));
    CHECK(eng_create(&p, &cfg, x, &e, err) == 0);
    const int32_t *blocks;
    int32_t nb, nc;
    CHECK(eng_reserve(e, &rq, &blocks, &nb, &nc, err) == 0);
    for (int32_t i = 0; i < 10; i++) f.kv[blocks[i / 4] * 4 + i % 4] = ((int64_t)i << 16 | prompt[i]) + 1;
    CHECK_EQ_INT(eng_admit(e, 7, firsts[0], err), PD_EINVAL); /* three choices, one token */
    CHECK_STR_CONTAINS(err, "3 choices");
    CHECK(eng_admit_n(e, 7, firsts, 3, err) == 0);
    CHECK_EQ_INT(bm_n_used(eng_block_manager(e)), 5);
    int32_t got[3][64], n_got[3] = {1, 1, 1};
    seq_finish fin[3] = {0};
    for (int32_t c = 0; c < 3; c++) got[c][0] = firsts[c];
    CHECK_EQ_INT(drain_choices(e, got, n_got, fin), 1);
    for (int32_t c = 0; c < 3; c++)
        CHECK_MSG(same_as_alone(&rq, c, got[c], n_got[c], fin[c], false),
                  "decode-only choice %d differs from seed + %d alone", c, c);
    CHECK_EQ_INT(bm_n_used(eng_block_manager(e)), 0);
    /* max_tokens 1: every choice ends with its first token at admission */
    rq.stop.max_tokens = 1;
    CHECK(eng_reserve(e, &rq, &blocks, &nb, &nc, err) == 0);
    CHECK(eng_admit_n(e, 7, firsts, 3, err) == 0);
    CHECK_EQ_INT(drain_choices(e, got, n_got, fin), 1);
    CHECK_EQ_INT(bm_n_used(eng_block_manager(e)), 0);
    rq.stop.max_tokens = 8;

    /* eng_end_choice on a decode-only engine: choice 1 ended while the reservation waits for
     * its KV (nothing it holds is touched) ends at the admission with no block of its own;
     * choice 2 ended mid-decode frees its copy at the next step; choice 0 goes on unchanged. */
    CHECK(eng_reserve(e, &rq, &blocks, &nb, &nc, err) == 0);
    CHECK_EQ_INT(eng_end_choice(e, 7, 1), 0);
    CHECK_EQ_INT(eng_end_choice(e, 7, 1), PD_ENOTFOUND); /* once */
    CHECK_EQ_INT(eng_end_choice(e, 7, 3), PD_EINVAL);
    CHECK_EQ_INT(eng_end_choice(e, 8, 0), PD_ENOTFOUND);
    CHECK_EQ_INT(bm_n_used(eng_block_manager(e)), 3); /* the reservation's, as they were */
    for (int32_t i = 0; i < 10; i++)
        f.kv[blocks[i / 4] * 4 + i % 4] = ((int64_t)i << 16 | prompt[i]) + 1;
    CHECK(eng_admit_n(e, 7, firsts, 3, err) == 0);
    CHECK_EQ_INT(bm_n_used(eng_block_manager(e)), 4); /* 3 prompt blocks + choice 2's copy */
    CHECK_EQ_INT(eng_stats_get(e)->choices_ended, 1);
    memset(fin, 0, sizeof fin);
    for (int32_t c = 0; c < 3; c++) {
        got[c][0] = firsts[c];
        n_got[c] = 1;
    }
    CHECK(eng_step(e, &o, &k, err) == 0);
    int32_t n_cancel = 0;
    for (int32_t j = 0; j < k; j++) {
        if (o[j].token >= 0) got[o[j].choice][n_got[o[j].choice]++] = o[j].token;
        if (o[j].finish) fin[o[j].choice] = o[j].finish;
        if (o[j].finish == SEQ_FINISH_CANCELLED) {
            n_cancel++;
            CHECK(o[j].choice == 1 && o[j].token < 0 && !o[j].done && o[j].n_output == 1);
        }
    }
    CHECK_EQ_INT(n_cancel, 1);
    CHECK(eng_check(e) == 0);
    const int32_t used2 = bm_n_used(eng_block_manager(e));
    CHECK_EQ_INT(eng_end_choice(e, 7, 1), PD_ENOTFOUND); /* reported: gone */
    CHECK_EQ_INT(eng_end_choice(e, 7, 2), 0);
    CHECK_EQ_INT(eng_end_choice(e, 7, 2), PD_ENOTFOUND); /* ending, not reported yet */
    CHECK(eng_step(e, &o, &k, err) == 0);
    for (int32_t j = 0; j < k; j++) {
        if (o[j].token >= 0) got[o[j].choice][n_got[o[j].choice]++] = o[j].token;
        if (o[j].finish) fin[o[j].choice] = o[j].finish;
        if (o[j].choice == 2)
            CHECK(o[j].finish == SEQ_FINISH_CANCELLED && o[j].token < 0 && !o[j].done);
    }
    CHECK_EQ_INT(fin[2], SEQ_FINISH_CANCELLED);
    CHECK_EQ_INT(bm_n_used(eng_block_manager(e)), used2 - 1); /* choice 2's copy went back */
    CHECK(eng_check(e) == 0);
    CHECK_EQ_INT(drain_choices(e, got, n_got, fin), 1);
    {
        CHECK_MSG(same_as_alone(&rq, 0, got[0], n_got[0], fin[0], true),
                  "decode-only: choice 0 changed when its siblings were ended");
        int32_t ref[64], n_ref;
        seq_finish rf;
        eng_request one = choice_alone(&rq, 2);
        run_alone_tokens(&one, ref, &n_ref, &rf);
        CHECK_MSG(n_got[2] >= 1 && n_got[2] < n_ref && !memcmp(got[2], ref, (size_t)n_got[2] * 4),
                  "decode-only: ended choice 2 has %d tokens, not a prefix of its %d alone",
                  n_got[2], n_ref);
    }
    CHECK_EQ_INT(eng_stats_get(e)->choices_ended, 2);
    CHECK_EQ_INT(bm_n_used(eng_block_manager(e)), 0);
    /* every choice ended before the admission: each ends there, the last one done */
    CHECK(eng_reserve(e, &rq, &blocks, &nb, &nc, err) == 0);
    for (int32_t c = 0; c < 3; c++) CHECK_EQ_INT(eng_end_choice(e, 7, c), 0);
    CHECK(eng_admit_n(e, 7, firsts, 3, err) == 0);
    memset(fin, 0, sizeof fin);
    CHECK_EQ_INT(drain_choices(e, got, n_got, fin), 1);
    CHECK(fin[0] == SEQ_FINISH_CANCELLED && fin[1] == SEQ_FINISH_CANCELLED &&
          fin[2] == SEQ_FINISH_CANCELLED);
    CHECK_EQ_INT(bm_n_used(eng_block_manager(e)), 0);
    /* a choice ended while waiting for its KV, then the whole request aborted */
    CHECK(eng_reserve(e, &rq, &blocks, &nb, &nc, err) == 0);
    CHECK_EQ_INT(eng_end_choice(e, 7, 0), 0);
    CHECK_EQ_INT(eng_abort(e, 7), 0);
    CHECK_EQ_INT(bm_n_used(eng_block_manager(e)), 0);
    CHECK(!eng_has_work(e));
    /* bounds */
    rq.n = ENG_MAX_CHOICES + 1;
    CHECK_EQ_INT(eng_add_request(e, &rq, err), PD_EINVAL);
    CHECK_STR_CONTAINS(err, "choices");
    rq.n = 9; /* more than max_num_seqs (8) */
    CHECK_EQ_INT(eng_add_request(e, &rq, err), PD_ERANGE);
    eng_destroy(e);
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
                                              fake_pipe_launch, fake_pipe_collect, fake_pipe_clone_blocks}, &e, err) == 0);
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
    CHECK(eng_create(&p, &cfg, (eng_executor){fake_forward, &f, NULL, NULL, NULL, NULL, fake_clone_blocks}, &e, err) == 0);
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

/* Resumed requests (eng_request.n_resume, the router's migration): a request cut after some
 * tokens of each choice and resumed, with a subset of its choices, on another engine (small
 * pools: preemption; prefix cache on and off; the host sampler, forward_sample and pipelined
 * steps) continues every resumed choice exactly as the request alone would have: the same
 * tokens, logprobs and finish, with penalties and min/max_tokens counting the tokens given.
 * Several resumed requests run at once; every block comes back. */
static void test_resume(int n_cases)
{
    int64_t resumed = 0, preempt = 0;
    for (int cs = 0; cs < n_cases; cs++) {
        uint64_t rs = (uint64_t)cs * 0x2545f4914f6cdd1dull + 3;
        eng_params p = {ENG_MODE_COLOCATED, 12 + (int32_t)(rng_next(&rs) % 20), 4,
                        8 + (int32_t)(rng_next(&rs) % 40), 1 + (int32_t)(rng_next(&rs) % 6), 0,
                        rng_next(&rs) % 2 == 0, true, false};
        enum { NR = 4 };
        static req rq[NR];
        static chout ref[NR][4];
        int32_t cut[NR][4], sel[NR][4], n_sel[NR], toks[NR][4 * 64], len[NR][4];
        memset(rq, 0, sizeof rq);
        for (int i = 0; i < NR; i++) {
            req *r = &rq[i];
            r->n_prompt = 1 + (int32_t)(rng_next(&rs) % 30);
            for (int j = 0; j < r->n_prompt; j++) r->prompt[j] = 1 + (int32_t)(rng_next(&rs) % (V - 1));
            r->rq = (eng_request){.id = 500 + (uint64_t)i, .prompt = r->prompt,
                                  .n_prompt = r->n_prompt, .sampling = smp_default_params()};
            smp_params *sp = &r->rq.sampling;
            if (rng_next(&rs) % 3 == 0) sp->temperature = 0;
            switch (rng_next(&rs) % 4) {
            case 0: sp->repetition_penalty = 1.3f; sp->top_k = 5; break;
            case 1: sp->presence_penalty = 0.5f; sp->frequency_penalty = 0.4f; break;
            default: break;
            }
            sp->seed = rng_next(&rs);
            sp->has_seed = true;
            r->rq.logprobs = rng_next(&rs) % 3 == 0;
            r->rq.top_logprobs = r->rq.logprobs ? (int32_t)(rng_next(&rs) % 6) : 0;
            r->rq.stop.max_tokens = 2 + (int32_t)(rng_next(&rs) % 20);
            r->rq.stop.min_tokens = (int32_t)(rng_next(&rs) % 3);
            r->rq.stop.ignore_eos = rng_next(&rs) % 2;
            r->rq.n = rng_next(&rs) % 2 ? 1 + (int32_t)(rng_next(&rs) % 4) : 0;
            if (r->rq.n > p.max_num_seqs) r->rq.n = p.max_num_seqs;
            while ((r->n_prompt + r->rq.stop.max_tokens + 3) / 4 > p.n_blocks) r->rq.stop.max_tokens--;
            const int32_t nc = r->rq.n > 1 ? r->rq.n : 1;
            n_sel[i] = 0;
            int32_t off = 0;
            for (int32_t c = 0; c < nc; c++) {
                memset(&ref[i][c], 0, sizeof ref[i][c]);
                eng_request one = choice_alone(&r->rq, c);
                run_alone(&one, &ref[i][c]);
                /* a choice that was still going after `cut` tokens may be resumed */
                if (ref[i][c].n_out < 1 || rng_next(&rs) % 4 == 0) continue;
                const int32_t k = n_sel[i]++;
                sel[i][k] = c;
                cut[i][k] = (int32_t)(rng_next(&rs) % (uint64_t)ref[i][c].n_out);
                len[i][k] = cut[i][k];
                memcpy(toks[i] + off, ref[i][c].out, (size_t)cut[i][k] * sizeof(int32_t));
                off += cut[i][k];
            }
            r->rq.n_resume = n_sel[i];
            r->rq.resume_choice = sel[i];
            r->rq.resume_len = len[i];
            r->rq.resume_tokens = toks[i];
        }
        mc_config cfg = fake_cfg();
        fake f = {calloc((size_t)p.n_blocks * 4, sizeof(int64_t)), (int64_t)p.n_blocks * 4, 0, 0};
        eng_executor x = {fake_forward, &f, NULL, cs % 2 ? fake_forward_sample : NULL, NULL,
                          NULL, fake_clone_blocks};
        fake_pipe fp = {0};
        fp.f = &f;
        if (cs % 4 == 3) {
            x = (eng_executor){fake_pipe_forward, &fp, NULL, fake_pipe_forward_sample,
                               fake_pipe_launch, fake_pipe_collect, fake_pipe_clone_blocks};
            p.async_steps = true;
        }
        eng *e;
        char err[PD_ERR_LEN];
        CHECK(eng_create(&p, &cfg, x, &e, err) == 0);
        static chout got[NR][4];
        memset(got, 0, sizeof got);
        int32_t done[NR] = {0};
        for (int i = 0; i < NR; i++)
            if (n_sel[i] > 0) CHECK_MSG(eng_add_request(e, &rq[i].rq, err) == 0, "%s", err);
        while (eng_has_work(e)) {
            const eng_output *o;
            int32_t k;
            CHECK(eng_step(e, &o, &k, err) == 0);
            for (int32_t j = 0; j < k; j++) {
                const int i = (int)(o[j].id - 500);
                if (o[j].token >= 0) keep(&got[i][o[j].choice], &o[j]);
                if (o[j].finish) got[i][o[j].choice].finish = o[j].finish;
                done[i] += o[j].done;
            }
            CHECK(eng_check(e) == 0);
        }
        preempt += eng_stats_get(e)->preemptions;
        for (int i = 0; i < NR; i++) {
            if (n_sel[i] == 0) continue;
            CHECK_EQ_INT(done[i], 1);
            for (int32_t k = 0; k < n_sel[i]; k++) {
                const int32_t c = sel[i][k], m = cut[i][k];
                const chout *a = &got[i][c], *b = &ref[i][c];
                bool same = a->n_out == b->n_out - m && a->finish == b->finish &&
                            !memcmp(a->out, b->out + m, (size_t)a->n_out * sizeof(int32_t));
                for (int32_t t = 0; same && rq[i].rq.logprobs && t < a->n_out; t++)
                    same = a->lp[t] == b->lp[m + t] && a->n_top[t] == b->n_top[m + t];
                CHECK_MSG(same, "case %d request %d choice %d resumed after %d of %d tokens: got "
                          "%d tokens (finish %d), want %d (finish %d)", cs, i, c, m, b->n_out,
                          a->n_out, a->finish, b->n_out - m, b->finish);
                resumed++;
            }
        }
        CHECK_EQ_INT(bm_n_free(eng_block_manager(e)), p.n_blocks);
        CHECK_EQ_INT(f.corrupt, 0);
        eng_destroy(e);
        free(f.kv);
    }
    fprintf(stderr, "test_engine: %lld choices resumed (%lld preemptions)\n", (long long)resumed,
            (long long)preempt);
    CHECK(resumed > n_cases);
    /* bad resumptions are refused, naming the problem */
    mc_config cfg = fake_cfg();
    fake f = {calloc(64 * 4, sizeof(int64_t)), 64 * 4, 0, 0};
    eng_params p = {ENG_MODE_COLOCATED, 64, 4, 64, 8, 0, true, true, false};
    eng *e;
    char err[PD_ERR_LEN];
    CHECK(eng_create(&p, &cfg, (eng_executor){fake_forward, &f, NULL, NULL, NULL, NULL, NULL}, &e, err) == 0);
    int32_t prompt[3] = {1, 2, 3}, ch[2] = {0, 1}, ln[2] = {1, 1}, tk[2] = {4, 5};
    eng_request q = {.id = 9, .prompt = prompt, .n_prompt = 3, .sampling = smp_default_params(),
                     .n = 2, .n_resume = 2, .resume_choice = ch, .resume_len = ln,
                     .resume_tokens = tk};
    q.stop.max_tokens = 4;
    ch[1] = 2;
    CHECK_EQ_INT(eng_add_request(e, &q, err), PD_EINVAL);
    CHECK_STR_CONTAINS(err, "choice 2");
    ch[1] = 0;
    CHECK_EQ_INT(eng_add_request(e, &q, err), PD_EINVAL);
    CHECK_STR_CONTAINS(err, "twice");
    ch[1] = 1;
    ln[1] = 4;
    CHECK_EQ_INT(eng_add_request(e, &q, err), PD_EINVAL);
    CHECK_STR_CONTAINS(err, "max_tokens");
    ln[1] = 1;
    tk[1] = V;
    CHECK_EQ_INT(eng_add_request(e, &q, err), PD_EINVAL);
    CHECK_STR_CONTAINS(err, "out of range");
    tk[1] = 5;
    CHECK(eng_add_request(e, &q, err) == 0);
    CHECK_EQ_INT(eng_n_waiting(e), 2);
    CHECK(eng_abort(e, 9) == 0);
    CHECK_EQ_INT(eng_n_waiting(e), 0);
    CHECK_EQ_INT(bm_n_free(eng_block_manager(e)), 64);
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
            "the prefix cache, %lld pipelined launches (%lld chained), %lld forks (%lld blocks "
            "copied, %lld choices recomputed)\n", n_seeds,
            (long long)g_preemptions, (long long)g_cached, (long long)g_launches,
            (long long)g_chained, (long long)g_forks, (long long)fake_clones,
            (long long)g_fork_recomputed);
    CHECK(g_forks > 300 && fake_clones > 300 && g_fork_recomputed > 20);
    fprintf(stderr, "test_engine: %lld choices ended early (%lld pipelined, %lld before their "
            "first token)\n", (long long)g_ended, (long long)g_ended_pipe,
            (long long)g_ended_early);
    CHECK(g_ended > 300 && g_ended_pipe > 50 && g_ended_early > 30);
    CHECK(g_preemptions > 500); /* the pools are small enough to force preemption */
    CHECK(g_cached > 100);      /* and prompts share prefixes */
    CHECK(g_chained > 1000);    /* and pipelined steps do chain (the cases 3 mod 4) */
    test_modes();
    test_choices();
    test_pipelined_lifecycle();
    test_bad_requests();
    test_resume(argc > 1 ? n_seeds / 4 + 1 : 400);
    return pd_test_result("test_engine");
}
