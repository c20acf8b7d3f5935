/* test_engine_golden.c -- The engine on real models gives the same tokens whatever its
 * scheduling: prefix cache on/off, chunked prefill with a small chunk on/off, and a KV pool so
 * small that sequences are preempted and recomputed. Plus the shared-prefix workload: 32
 * requests sharing a 200-token prefix compute it once. */
#include "tests/golden_util.h"
#include "tests/test_util.h"

typedef struct {
    const char *name;
    bool prefix, chunked;
    int32_t chunk;    /* max_num_batched_tokens, 0 = default */
    int32_t n_blocks; /* KV pool, 0 = roomy */
} variant;

static int run_variant(const char *dir, const variant *v, int32_t **prompts, int32_t *lens, int n,
                       int32_t max_tokens, gen_result *res, gen_stats *st)
{
    mr_params mp = mr_default_params();
    mp.n_blocks = v->n_blocks ? v->n_blocks : 512;
    tg_model t;
    if (tg_open(dir, &mp, &t) < 0) return -1;
    gen_request q[64];
    for (int i = 0; i < n; i++) q[i] = tg_greedy(prompts[i], lens[i], max_tokens);
    gen_options o = gen_default_options();
    o.enable_prefix_cache = v->prefix;
    o.enable_chunked_prefill = v->chunked;
    o.max_num_batched_tokens = v->chunk;
    char err[PD_ERR_LEN];
    int rc = gen_run_opts(t.r, t.m, q, n, &o, res, st, err);
    if (rc < 0) fprintf(stderr, "%s: %s\n", v->name, err);
    tg_close(&t);
    return rc;
}

static void compare_variants(const char *label, const char *dir, int32_t **prompts, int32_t *lens,
                             int n, int32_t max_tokens, int32_t small_pool)
{
    const variant vs[] = {
        {"baseline (no cache, no chunking)", false, false, 0, 0},
        {"prefix cache", true, false, 0, 0},
        {"chunked prefill, chunk 29", false, true, 29, 0},
        {"prefix cache + chunk 29", true, true, 29, 0},
        {"forced preemption", true, true, 64, small_pool},
    };
    gen_result base[64];
    gen_stats st;
    if (run_variant(dir, &vs[0], prompts, lens, n, max_tokens, base, &st) < 0) {
        CHECK_MSG(0, "%s: baseline failed", label);
        return;
    }
    for (size_t k = 1; k < sizeof vs / sizeof vs[0]; k++) {
        gen_result res[64];
        if (run_variant(dir, &vs[k], prompts, lens, n, max_tokens, res, &st) < 0) {
            CHECK_MSG(0, "%s: %s failed", label, vs[k].name);
            continue;
        }
        for (int i = 0; i < n; i++) {
            CHECK_MSG(res[i].n_tokens == base[i].n_tokens &&
                      memcmp(res[i].tokens, base[i].tokens, (size_t)base[i].n_tokens * 4) == 0,
                      "%s, %s: prompt %d differs from the baseline", label, vs[k].name, i);
        }
        if (vs[k].n_blocks)
            CHECK_MSG(st.eng.preemptions > 0, "%s: the small pool caused no preemption", label);
        fprintf(stderr, "%s, %s: %d prompts identical (%lld preemptions, %lld cached tokens)\n",
                label, vs[k].name, n, (long long)st.eng.preemptions, (long long)st.eng.cached_tokens);
        gen_results_free(res, n);
    }
    gen_results_free(base, n);
}

static void golden_model(const char *name)
{
    char dir[1024], path[1100], err[PD_ERR_LEN];
    snprintf(dir, sizeof dir, "%s/testdata/golden/%s", pd_test_shared_dir(), name);
    snprintf(path, sizeof path, "%s/golden.json", dir);
    json_t *g;
    if (pd_json_load_file(path, &g, err) < 0) { CHECK_MSG(0, "%s", err); return; }
    json_t *cases = json_object_get(g, "cases");
    int32_t *prompts[16], lens[16];
    int n = 0;
    for (size_t i = 0; i < json_array_size(cases); i++, n++)
        lens[n] = tg_ids(json_object_get(json_array_get(cases, i), "prompt_ids"), &prompts[n]);
    /* Twice each prompt, so that the prefix cache has something to share. */
    for (int i = 0; i < n; i++) {
        prompts[n + i] = prompts[i];
        lens[n + i] = lens[i];
    }
    compare_variants(name, dir, prompts, lens, 2 * n, 24, 24);
    for (int i = 0; i < n; i++) free(prompts[i]);
    json_decref(g);
}

static void stories(void)
{
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/models/stories260k", pd_test_shared_dir());
    /* Shared-prefix workload: a 200-token prefix (a greedy story) + 8 distinct tokens each. */
    int32_t base[1] = {1}, *prompts[32], lens[32];
    gen_result story;
    gen_stats st;
    variant v0 = {"story", false, false, 0, 0};
    int32_t *bp = base;
    int32_t one = 1;
    if (run_variant(dir, &v0, &bp, &one, 1, 199, &story, &st) < 0 || story.n_tokens < 199) {
        CHECK_MSG(0, "could not make the shared prefix");
        return;
    }
    for (int i = 0; i < 32; i++) {
        prompts[i] = malloc(208 * sizeof(int32_t));
        prompts[i][0] = 1;
        memcpy(prompts[i] + 1, story.tokens, 199 * sizeof(int32_t));
        for (int j = 0; j < 8; j++) prompts[i][200 + j] = 300 + (i * 7 + j * 13) % 200;
        lens[i] = 208;
    }
    gen_results_free(&story, 1);
    gen_result with[32], without[32];
    variant on = {"prefix cache on", true, true, 0, 0}, off = {"prefix cache off", false, true, 0, 0};
    int rc = run_variant(dir, &on, prompts, lens, 32, 16, with, &st);
    CHECK(rc == 0);
    int64_t cached = st.eng.cached_tokens, computed = st.eng.prompt_tokens_computed;
    rc |= run_variant(dir, &off, prompts, lens, 32, 16, without, &st);
    CHECK(rc == 0);
    if (rc == 0) {
        /* 200 shared tokens = 12 full blocks of 16: every request after the first reuses 192. */
        CHECK_EQ_INT(cached, 31 * 192);
        CHECK_EQ_INT(computed, 32 * 208 - 31 * 192);
        for (int i = 0; i < 32; i++)
            CHECK_MSG(with[i].n_tokens == without[i].n_tokens &&
                      memcmp(with[i].tokens, without[i].tokens, (size_t)with[i].n_tokens * 4) == 0,
                      "shared prefix: request %d differs with the prefix cache", i);
        fprintf(stderr, "shared prefix: %lld of %d prompt tokens from the cache (hit rate %.1f%%)\n",
                (long long)cached, 32 * 208, 100.0 * (double)cached / (32 * 208));
        gen_results_free(with, 32);
        gen_results_free(without, 32);
    }
    /* The golden stories under all variants. */
    compare_variants("stories260k", dir, prompts, lens, 8, 40, 30);
    for (int i = 0; i < 32; i++) free(prompts[i]);
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
    golden_model("qwen3-tiny");
    golden_model("llama-tiny");
    golden_model("qwen2-tiny");
    stories();
    return pd_test_result("test_engine_golden");
}
