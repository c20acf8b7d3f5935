/* test_batch.c -- Serving-shaped forward passes give the same results as one-at-a-time runs:
 * all golden prompts in one batch (also with prompts chunked over several forwards), a prompt
 * whose first blocks are reused from the cache, a decode and a prompt chunk in one forward,
 * non-contiguous block tables, and seeded sampling independent of batch company. */
#include "tests/golden_util.h"
#include "tests/test_util.h"

static const char *k_models[] = {"qwen3-tiny", "llama-tiny", "qwen2-tiny"};

/* Loads every case's prompt of a golden model. Returns the count. */
static int load_prompts(const char *name, int32_t **prompts, int32_t *lens, int max)
{
    char path[1100], err[PD_ERR_LEN];
    snprintf(path, sizeof path, "%s/testdata/golden/%s/golden.json", pd_test_shared_dir(), name);
    json_t *g;
    if (pd_json_load_file(path, &g, err) < 0) return 0;
    json_t *cases = json_object_get(g, "cases");
    int n = 0;
    for (size_t i = 0; i < json_array_size(cases) && n < max; i++, n++)
        lens[n] = tg_ids(json_object_get(json_array_get(cases, i), "prompt_ids"), &prompts[n]);
    json_decref(g);
    return n;
}

/* All prompts in one gen_run vs each alone; then again with a small token budget so prompts
 * are split over several forwards and share forwards with others. */
static void test_batch_equals_single(const char *name)
{
    char dir[1024], err[PD_ERR_LEN];
    snprintf(dir, sizeof dir, "%s/testdata/golden/%s", pd_test_shared_dir(), name);
    int32_t *prompts[8], lens[8];
    int n = load_prompts(name, prompts, lens, 8);
    CHECK(n >= 6);
    for (int budget = 0; budget < 2; budget++) {
        mr_params mp = mr_default_params();
        mp.n_blocks = 256;
        if (budget) mp.max_num_batched_tokens = 37; /* odd size: chunks straddle blocks */
        tg_model t;
        if (tg_open(dir, &mp, &t) < 0) { CHECK(0); break; }
        gen_request q[8];
        gen_result single[8], batch[8];
        for (int i = 0; i < n; i++) q[i] = tg_greedy(prompts[i], lens[i], 24);
        for (int i = 0; i < n; i++) {
            int rc = gen_run(t.r, t.m, &q[i], 1, &single[i], NULL, err);
            CHECK_MSG(rc == 0, "%s", err);
        }
        int rc = gen_run(t.r, t.m, q, n, batch, NULL, err);
        CHECK_MSG(rc == 0, "%s", err);
        for (int i = 0; rc == 0 && i < n; i++) {
            CHECK_EQ_INT(batch[i].n_tokens, single[i].n_tokens);
            CHECK_MSG(memcmp(batch[i].tokens, single[i].tokens,
                             sizeof(int32_t) * (size_t)single[i].n_tokens) == 0,
                      "%s budget %d: prompt %d differs in a batch", name, budget, i);
        }
        if (rc == 0) gen_results_free(batch, n);
        gen_results_free(single, n);
        tg_close(&t);
    }
    for (int i = 0; i < n; i++) free(prompts[i]);
}

/* A small manual driver over the runner: one sequence = a block table + its tokens. */
typedef struct {
    int32_t bt[64];
    int32_t n_blocks;
} seqtab;

static int32_t argmax(const float *x, int32_t n)
{
    int32_t b = 0;
    for (int32_t i = 1; i < n; i++) if (x[i] > x[b]) b = i;
    return b;
}

/* Forward of tokens [from, to) of ids for one sequence; last-row logits into out. */
static int fwd1(mr *r, const seqtab *s, const int32_t *ids, int32_t from, int32_t to, float *out)
{
    int32_t n = to - from, bs = mr_block_size(r);
    int32_t *pos = malloc((size_t)n * 4), *slot = malloc((size_t)n * 4);
    for (int32_t i = 0; i < n; i++) {
        int32_t p = from + i;
        pos[i] = p;
        slot[i] = s->bt[p / bs] * bs + p % bs;
    }
    int32_t cu[2] = {0, n}, ctx = to, row = n - 1;
    mr_batch b = {n, ids + from, pos, slot, 1, cu, &ctx, s->bt, 64, 1, &row};
    char err[PD_ERR_LEN];
    int rc = mr_forward(r, &b, out, err);
    if (rc < 0) fprintf(stderr, "forward: %s\n", err);
    free(pos);
    free(slot);
    return rc;
}

/* Prefix reuse: sequence B shares A's first full blocks (same block ids) and computes only the
 * rest of the prompt; its logits and greedy continuation must match a full recompute. */
static void test_prefix_reuse(const char *name)
{
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/testdata/golden/%s", pd_test_shared_dir(), name);
    int32_t *prompts[8], lens[8];
    int n = load_prompts(name, prompts, lens, 8);
    int big = 0;
    for (int i = 0; i < n; i++) if (lens[i] > lens[big]) big = i;
    mr_params mp = mr_default_params();
    mp.n_blocks = 200;
    mp.block_size = 16;
    tg_model t;
    if (tg_open(dir, &mp, &t) < 0) { CHECK(0); goto out; }
    const int32_t V = t.m->cfg.vocab_size, L = lens[big], steps = 16;
    int32_t *ids_a = malloc((size_t)(L + steps + 2) * 4), *ids_b = malloc((size_t)(L + steps + 2) * 4);
    memcpy(ids_a, prompts[big], (size_t)L * 4);
    memcpy(ids_b, prompts[big], (size_t)L * 4);
    float *la = malloc((size_t)V * 4), *lb = malloc((size_t)V * 4);
    seqtab A = {{0}, 0}, B = {{0}, 0};
    /* A: blocks 100.. descending (non-contiguous order); B: A's first 7 blocks, then its own. */
    for (int i = 0; i < 64; i++) A.bt[i] = 199 - i * 2;
    const int shared = 7; /* 112 tokens of prefix */
    for (int i = 0; i < 64; i++) B.bt[i] = i < shared ? A.bt[i] : 10 + i;
    int rc = fwd1(t.r, &A, ids_a, 0, L, la);
    rc |= fwd1(t.r, &B, ids_b, shared * 16, L, lb);
    CHECK(rc == 0);
    double md = 0;
    for (int32_t v = 0; v < V; v++) if (fabs(la[v] - lb[v]) > md) md = fabs(la[v] - lb[v]);
    CHECK_MSG(md < 1e-4, "%s: prefix-reuse logits differ by %g", name, md);
    int same = 1;
    for (int s = 0; s < steps && rc == 0; s++) {
        ids_a[L + s] = argmax(la, V);
        ids_b[L + s] = argmax(lb, V);
        if (ids_a[L + s] != ids_b[L + s]) same = 0;
        rc |= fwd1(t.r, &A, ids_a, L + s, L + s + 1, la);
        rc |= fwd1(t.r, &B, ids_b, L + s, L + s + 1, lb);
    }
    CHECK_MSG(same, "%s: greedy tokens differ with a reused prefix", name);
    /* Mixed forward: B decodes one token while C prefills the prompt from scratch. */
    seqtab C;
    for (int i = 0; i < 64; i++) C.bt[i] = 120 + i;
    {
        int32_t nb = L + 1, bs = 16;
        int32_t *ids = malloc((size_t)nb * 4), *pos = malloc((size_t)nb * 4), *slot = malloc((size_t)nb * 4);
        int32_t p_b = L + steps; /* B's next position */
        ids_b[p_b] = argmax(lb, V);
        ids[0] = ids_b[p_b];
        pos[0] = p_b;
        slot[0] = B.bt[p_b / bs] * bs + p_b % bs;
        for (int32_t i = 0; i < L; i++) {
            ids[1 + i] = prompts[big][i];
            pos[1 + i] = i;
            slot[1 + i] = C.bt[i / bs] * bs + i % bs;
        }
        int32_t cu[3] = {0, 1, 1 + L}, ctx[2] = {p_b + 1, L}, rows[2] = {0, L};
        int32_t bt2[128];
        memcpy(bt2, B.bt, sizeof B.bt);
        memcpy(bt2 + 64, C.bt, sizeof C.bt);
        float *lm = malloc((size_t)2 * V * 4);
        mr_batch b = {nb, ids, pos, slot, 2, cu, ctx, bt2, 64, 2, rows};
        char err[PD_ERR_LEN];
        CHECK_MSG(mr_forward(t.r, &b, lm, err) == 0, "%s", err);
        /* Reference for B: A's next step (same tokens); for C: A's prompt logits. */
        ids_a[p_b] = ids_b[p_b];
        float *ref = malloc((size_t)V * 4);
        rc = fwd1(t.r, &A, ids_a, p_b, p_b + 1, ref);
        double d1 = 0, d2 = 0;
        for (int32_t v = 0; v < V; v++) if (fabs(lm[v] - ref[v]) > d1) d1 = fabs(lm[v] - ref[v]);
        seqtab D;
        for (int i = 0; i < 64; i++) D.bt[i] = 60 + i;
        rc |= fwd1(t.r, &D, prompts[big], 0, L, ref);
        for (int32_t v = 0; v < V; v++) if (fabs(lm[V + v] - ref[v]) > d2) d2 = fabs(lm[V + v] - ref[v]);
        CHECK(rc == 0);
        CHECK_MSG(d1 < 1e-4 && d2 < 1e-4, "%s: mixed decode+prefill forward differs (%g, %g)",
                  name, d1, d2);
        free(ids); free(pos); free(slot); free(lm); free(ref);
    }
    free(ids_a); free(ids_b); free(la); free(lb);
    tg_close(&t);
out:
    for (int i = 0; i < n; i++) free(prompts[i]);
}

/* Seeded sampling: a request gets the same tokens alone and among others. */
static void test_seed_batch_invariance(void)
{
    char dir[1024], err[PD_ERR_LEN];
    snprintf(dir, sizeof dir, "%s/models/stories260k", pd_test_shared_dir());
    mr_params mp = mr_default_params();
    mp.n_blocks = 256;
    tg_model t;
    if (tg_open(dir, &mp, &t) < 0) { CHECK(0); return; }
    int32_t p0[] = {1}, p1[] = {1, 403, 407, 261}, p2[] = {1, 450, 300, 301, 302, 303};
    gen_request q[3] = {tg_greedy(p0, 1, 60), tg_greedy(p1, 4, 60), tg_greedy(p2, 6, 60)};
    for (int i = 0; i < 3; i++) {
        q[i].sampling.temperature = 0.9f;
        q[i].sampling.top_p = 0.95f;
        q[i].sampling.top_k = 40;
        q[i].sampling.seed = 1000 + (uint64_t)i;
        q[i].sampling.has_seed = true;
    }
    gen_result alone, together[3], reseeded;
    CHECK(gen_run(t.r, t.m, &q[0], 1, &alone, NULL, err) == 0);
    CHECK(gen_run(t.r, t.m, q, 3, together, NULL, err) == 0);
    CHECK_EQ_INT(alone.n_tokens, together[0].n_tokens);
    CHECK(memcmp(alone.tokens, together[0].tokens, (size_t)alone.n_tokens * 4) == 0);
    /* A different seed must change the sample (60 tokens at temperature 0.9). */
    q[0].sampling.seed = 7;
    CHECK(gen_run(t.r, t.m, &q[0], 1, &reseeded, NULL, err) == 0);
    CHECK(reseeded.n_tokens != alone.n_tokens ||
          memcmp(reseeded.tokens, alone.tokens, (size_t)alone.n_tokens * 4) != 0);
    gen_results_free(&alone, 1);
    gen_results_free(together, 3);
    gen_results_free(&reseeded, 1);
    tg_close(&t);
}

int main(void)
{
    char probe[1024];
    snprintf(probe, sizeof probe, "%s/testdata/golden/qwen3-tiny/golden.json", pd_test_shared_dir());
    FILE *f = fopen(probe, "r");
    if (!f) {
        fprintf(stderr, "shared test data not found: skipping\n");
        return 77;
    }
    fclose(f);
    for (size_t i = 0; i < sizeof k_models / sizeof k_models[0]; i++) {
        test_batch_equals_single(k_models[i]);
        test_prefix_reuse(k_models[i]);
    }
    test_seed_batch_invariance();
    return pd_test_result("test_batch");
}
