/* test_moe_golden.c -- Mixture-of-experts models on the CPU backend against HF transformers
 * (float64) references (tests/data/golden-moe: Qwen3-MoE with a dense layer and renormalised
 * top 4, Qwen3-MoE with decoder_sparse_step 2 and tied embeddings, Mixtral top 2). Per model:
 * every prompt position's logits (and the last one's) within 2e-3 of HF's; greedy tokens equal
 * up to the first step whose reference top-1/top-2 margin is under 0.01 (test_golden's margin
 * rule); every sparse layer's router logits within 1e-4 and its top-k experts per position
 * equal to the reference's, in its order, including the planted tie between experts 0 and 1
 * (counted: positions where the tie decided which of the two is in the top k); all prompts in
 * one batch, also chunked over forwards, giving the tokens each gives alone. Also: FP8 at load
 * (the experts through the per-linear FP8 op set) close to HF; a backend without the
 * mixture-of-experts ops refused at load, naming them; checkpoints that do not match their
 * config refused naming the tensor. */
#include <jansson.h>
#include <math.h>
#include <string.h>
#include <unistd.h>

#include "tests/golden_util.h"
#include "tests/test_util.h"

#define LOGIT_TOL 2e-3
#define ROUTER_TOL 1e-4
#define MARGIN_MIN 0.01
#define MAX_SPARSE 8

static const char *k_models[] = {"qwen3-moe-tiny", "qwen3-moe-tiny-step2", "mixtral-tiny"};

/* What the router hook saw in one forward: each sparse layer's logits and choices. */
typedef struct {
    int32_t n_layers;
    struct {
        int32_t layer, n, n_experts, k;
        float *logits;
        int32_t *ids;
    } l[MAX_SPARSE];
} routing;

static void routing_clear(routing *rt)
{
    for (int32_t i = 0; i < rt->n_layers; i++) {
        free(rt->l[i].logits);
        free(rt->l[i].ids);
    }
    memset(rt, 0, sizeof *rt);
}

static void on_route(void *arg, int32_t layer, int32_t n, int32_t n_experts, int32_t k,
                     const float *logits, const int32_t *ids)
{
    routing *rt = arg;
    if (rt->n_layers == MAX_SPARSE) return;
    const size_t ne = (size_t)n * (size_t)n_experts, nk = (size_t)n * (size_t)k;
    rt->l[rt->n_layers].layer = layer;
    rt->l[rt->n_layers].n = n;
    rt->l[rt->n_layers].n_experts = n_experts;
    rt->l[rt->n_layers].k = k;
    rt->l[rt->n_layers].logits = malloc(ne * sizeof(float));
    rt->l[rt->n_layers].ids = malloc(nk * sizeof(int32_t));
    memcpy(rt->l[rt->n_layers].logits, logits, ne * sizeof(float));
    memcpy(rt->l[rt->n_layers].ids, ids, nk * sizeof(int32_t));
    rt->n_layers++;
}

typedef struct {
    double logit_err, router_err;
    int32_t positions, ties, greedy;
} stats;

static void golden_dir(const char *name, char *dir, size_t cap)
{
    snprintf(dir, cap, "%s/tests/data/golden-moe/%s", PD_SOURCE_DIR, name);
}

/* One prompt as one sequence in blocks 0.., the logits of every row (all) or of the last. */
static int prompt_logits(mr *r, const int32_t *ids, int32_t n, bool all, float *out, char *err)
{
    const int32_t width = mr_max_blocks_per_seq(r);
    int32_t *pos = malloc((size_t)n * 4), *rows = malloc((size_t)n * 4);
    int32_t *bt = calloc((size_t)width, 4);
    for (int32_t i = 0; i < width; i++) bt[i] = i;
    for (int32_t i = 0; i < n; i++) pos[i] = rows[i] = i;
    int32_t cu[2] = {0, n}, ctx = n, last = n - 1;
    mr_batch b = {n, ids, pos, pos, 1, cu, &ctx, bt, width, all ? n : 1, all ? rows : &last};
    int rc = mr_forward(r, &b, out, err);
    free(pos);
    free(rows);
    free(bt);
    return rc;
}

static double row_diff(const float *got, const json_t *ref, int32_t n)
{
    double m = 0;
    for (int32_t v = 0; v < n; v++) {
        const double d = fabs(got[v] - json_number_value(json_array_get(ref, (size_t)v)));
        if (d > m || d != d) m = d != d ? INFINITY : d;
    }
    return m;
}

/* One sparse layer's routing against its reference entry: the logits within ROUTER_TOL, the
 * top k per position equal; ties counts the positions where exactly one of the tied experts
 * 0 and 1 made the top k (the tie decided which). */
static void check_layer_routing(const routing *rt, const json_t *ref, const char *name, int ci,
                                stats *st)
{
    const int32_t layer = (int32_t)json_integer_value(json_object_get(ref, "layer"));
    const json_t *lg = json_object_get(ref, "logits"), *tk = json_object_get(ref, "topk");
    int32_t i = 0;
    while (i < rt->n_layers && rt->l[i].layer != layer) i++;
    CHECK_MSG(i < rt->n_layers, "%s case %d: layer %d was not routed", name, ci, layer);
    if (i == rt->n_layers) return;
    const int32_t n = rt->l[i].n, E = rt->l[i].n_experts, k = rt->l[i].k;
    CHECK_EQ_INT(n, (int32_t)json_array_size(lg));
    for (int32_t t = 0; t < n && t < (int32_t)json_array_size(lg); t++) {
        const double d = row_diff(rt->l[i].logits + (size_t)t * E, json_array_get(lg, (size_t)t), E);
        CHECK_MSG(d <= ROUTER_TOL, "%s case %d layer %d position %d: router logits off by %.3g",
                  name, ci, layer, t, d);
        if (d > st->router_err) st->router_err = d;
        const json_t *want = json_array_get(tk, (size_t)t);
        const int32_t *got = rt->l[i].ids + (size_t)t * k;
        bool same = (int32_t)json_array_size(want) == k, has0 = false, has1 = false;
        for (int32_t j = 0; j < k && same; j++) {
            same = got[j] == (int32_t)json_integer_value(json_array_get(want, (size_t)j));
            has0 |= got[j] == 0;
            has1 |= got[j] == 1;
        }
        CHECK_MSG(same, "%s case %d layer %d position %d: experts %d %d ... differ from the "
                  "reference's %d %d ...", name, ci, layer, t, got[0], k > 1 ? got[1] : -1,
                  (int)json_integer_value(json_array_get(want, 0)),
                  k > 1 ? (int)json_integer_value(json_array_get(want, 1)) : -1);
        st->positions++;
        if (has0 != has1 && rt->l[i].logits[(size_t)t * E] == rt->l[i].logits[(size_t)t * E + 1])
            st->ties++;
    }
}

/* A case's logits (every row where all_logits is given) and routing. */
static void check_logits_case(tg_model *t, const json_t *cs, const char *name, int ci, stats *st)
{
    const int32_t V = t->m->cfg.vocab_size;
    int32_t *prompt;
    const int32_t n = tg_ids(json_object_get(cs, "prompt_ids"), &prompt);
    const json_t *all = json_object_get(cs, "all_logits");
    const json_t *last = json_object_get(cs, "last_logits");
    const bool rows = json_is_array(all);
    float *logits = malloc((size_t)(rows ? n : 1) * V * sizeof(float));
    routing rt = {0};
    char err[PD_ERR_LEN];
    CHECK(mr_set_router_hook(t->r, on_route, &rt) == 0);
    int rc = prompt_logits(t->r, prompt, n, rows, logits, err);
    CHECK_MSG(rc == 0, "%s case %d: %s", name, ci, err);
    for (int32_t r = 0; rc == 0 && r < (rows ? n : 1); r++) {
        const double d = row_diff(logits + (size_t)r * V, rows ? json_array_get(all, (size_t)r)
                                                                : last, V);
        CHECK_MSG(d <= LOGIT_TOL, "%s case %d (%d tokens) row %d: max |logit - HF| %.3g > %g",
                  name, ci, n, r, d, LOGIT_TOL);
        if (d > st->logit_err) st->logit_err = d;
    }
    if (rc == 0 && rows) { /* the last row against last_logits too */
        const double d = row_diff(logits + (size_t)(n - 1) * V, last, V);
        CHECK_MSG(d <= LOGIT_TOL, "%s case %d: last row %.3g from last_logits", name, ci, d);
    }
    const json_t *router = json_object_get(cs, "router");
    for (size_t i = 0; rc == 0 && i < json_array_size(router); i++)
        check_layer_routing(&rt, json_array_get(router, i), name, ci, st);
    CHECK(mr_set_router_hook(t->r, NULL, NULL) == 0);
    routing_clear(&rt);
    free(prompt);
    free(logits);
}


/* Every case's prompt in one gen_run against each alone, with the default token budget and
 * with 37 (prompts chunked over forwards, sharing them with others' decode steps). */
static void check_batch(const char *dir, const json_t *cases, const char *name)
{
    enum { MAXC = 8 };
    int32_t *prompts[MAXC], lens[MAXC];
    const int n = (int)(json_array_size(cases) < MAXC ? json_array_size(cases) : MAXC);
    for (int i = 0; i < n; i++)
        lens[i] = tg_ids(json_object_get(json_array_get(cases, (size_t)i), "prompt_ids"),
                         &prompts[i]);
    char err[PD_ERR_LEN];
    for (int budget = 0; budget < 2; budget++) {
        mr_params mp = mr_default_params();
        mp.n_blocks = 256;
        if (budget) mp.max_num_batched_tokens = 37;
        tg_model t;
        if (tg_open(dir, &mp, &t) < 0) {
            CHECK(0);
            tg_close(&t);
            break;
        }
        gen_request q[MAXC];
        gen_result single[MAXC], batch[MAXC];
        for (int i = 0; i < n; i++) q[i] = tg_greedy(prompts[i], lens[i], 24);
        int rc = 0;
        for (int i = 0; i < n && rc == 0; i++) {
            rc = gen_run(t.r, t.m, &q[i], 1, &single[i], NULL, err);
            CHECK_MSG(rc == 0, "%s: %s", name, err);
            if (rc < 0) gen_results_free(single, i);
        }
        const int rb = rc == 0 ? gen_run(t.r, t.m, q, n, batch, NULL, err) : rc;
        CHECK_MSG(rb == 0, "%s: %s", name, err);
        for (int i = 0; rb == 0 && i < n; i++) {
            CHECK_EQ_INT(batch[i].n_tokens, single[i].n_tokens);
            CHECK_MSG(memcmp(batch[i].tokens, single[i].tokens,
                             sizeof(int32_t) * (size_t)single[i].n_tokens) == 0,
                      "%s budget %d: prompt %d differs in a batch", name, budget, i);
        }
        if (rb == 0) gen_results_free(batch, n);
        if (rc == 0) gen_results_free(single, n);
        tg_close(&t);
    }
    for (int i = 0; i < n; i++) free(prompts[i]);
}

static void run_model(const char *name)
{
    char dir[1024], path[1100], err[PD_ERR_LEN];
    golden_dir(name, dir, sizeof dir);
    snprintf(path, sizeof path, "%s/golden.json", dir);
    json_t *g = NULL;
    if (pd_json_load_file(path, &g, err) < 0) {
        CHECK_MSG(0, "%s", err);
        return;
    }
    mr_params mp = mr_default_params();
    mp.n_blocks = 64;
    tg_model t;
    if (tg_open(dir, &mp, &t) < 0) {
        CHECK(0);
        tg_close(&t);
        json_decref(g);
        return;
    }
    const json_t *cases = json_object_get(g, "cases");
    stats st = {0};
    for (size_t i = 0; i < json_array_size(cases); i++) {
        check_logits_case(&t, json_array_get(cases, i), name, (int)i, &st);
        st.greedy += tg_check_greedy(&t, json_array_get(cases, i), name, (int)i, MARGIN_MIN);
    }
    fprintf(stderr, "%s: %zu cases, max |logit - HF| = %.2e, max |router logit - HF| = %.2e, "
            "top-k equal at %d positions (%d decided by the planted tie), %d greedy tokens "
            "compared\n", name, json_array_size(cases), st.logit_err, st.router_err,
            st.positions, st.ties, st.greedy);
    CHECK(st.positions > 0 && st.ties > 0 && st.greedy > 0);
    tg_close(&t);
    check_batch(dir, cases, name);
    json_decref(g);
}

/* --quantization fp8 (per channel at load, activations per token): every expert's linears go
 * through the FP8 op set, stacked into two weights a layer that its moe_experts runs; the
 * logits stay near HF's (docs/quantization.md's W8A8 bound: 0.6 of the logits' standard
 * deviation) and equal, bit for bit, those of the same model loaded on an op set without
 * moe_experts (each expert's linears their own weights, run expert by expert). */
static void test_fp8_at_load(void)
{
    char dir[1024], path[1100], err[PD_ERR_LEN];
    golden_dir("qwen3-moe-tiny", dir, sizeof dir);
    snprintf(path, sizeof path, "%s/golden.json", dir);
    json_t *g = NULL;
    mc_config cfg;
    pd_backend *be = NULL;
    pd_model *m = NULL, *m1 = NULL;
    mr *r = NULL, *r1 = NULL;
    mr_params mp = mr_default_params();
    mp.n_blocks = 64;
    int rc;
    pd_backend_ops ops1;
    pd_wq_ops wq1;
    pd_backend be1;
    if ((rc = pd_json_load_file(path, &g, err)) < 0 || (rc = mc_load(dir, &cfg, err)) < 0 ||
        (rc = mc_set_quantization(&cfg, "fp8", err)) < 0 ||
        (rc = pd_backend_create("cpu", NULL, &be, err)) < 0 ||
        (rc = pd_model_load(&cfg, dir, PD_LOAD_SAFETENSORS, 0, be, &m, err)) < 0 ||
        (rc = mr_create(&mp, m, &r, err)) < 0) {
        CHECK_MSG(0, "fp8 at load: %s", err);
        goto out;
    }
    CHECK(m->quantized && m->layers[0].experts && m->layers[0].experts_gate_up &&
          m->layers[0].experts_down && m->layers[0].experts_ops == be->ops->fp8 &&
          !m->layers[0].experts[3].gate_up && !m->layers[1].experts);
    /* the same backend whose FP8 op set has no moe_experts: each expert's own weights */
    ops1 = *be->ops;
    wq1 = *be->ops->fp8;
    wq1.moe_experts = NULL;
    ops1.fp8 = &wq1;
    be1 = (pd_backend){.ops = &ops1, .ctx = be->ctx};
    if ((rc = pd_model_load(&cfg, dir, PD_LOAD_SAFETENSORS, 0, &be1, &m1, err)) < 0 ||
        (rc = mr_create(&mp, m1, &r1, err)) < 0) {
        CHECK_MSG(0, "fp8 at load, expert by expert: %s", err);
        goto out;
    }
    CHECK(!m1->layers[0].experts_gate_up && m1->layers[0].experts[3].gate_up_ops == &wq1 &&
          m1->layers[0].experts[3].down_ops == &wq1);
    const json_t *cases = json_object_get(g, "cases");
    const int32_t V = cfg.vocab_size;
    float *logits = malloc((size_t)V * sizeof(float)), *logits1 = malloc((size_t)V * sizeof(float));
    double worst = 0;
    for (size_t c = 0; c < json_array_size(cases); c++) {
        const json_t *cs = json_array_get(cases, c), *last = json_object_get(cs, "last_logits");
        int32_t *ids;
        const int32_t n = tg_ids(json_object_get(cs, "prompt_ids"), &ids);
        rc = prompt_logits(r, ids, n, false, logits, err);
        CHECK_MSG(rc == 0, "fp8 case %zu: %s", c, err);
        const int rc1 = prompt_logits(r1, ids, n, false, logits1, err);
        CHECK_MSG(rc1 == 0, "fp8 case %zu, expert by expert: %s", c, err);
        CHECK_MSG(rc != 0 || rc1 != 0 || memcmp(logits, logits1, (size_t)V * sizeof(float)) == 0,
                  "fp8 case %zu: the stacked experts' logits differ from expert by expert's", c);
        double mean = 0, var = 0;
        for (int32_t v = 0; v < V; v++) mean += json_number_value(json_array_get(last, (size_t)v));
        mean /= V;
        for (int32_t v = 0; v < V; v++) {
            const double d = json_number_value(json_array_get(last, (size_t)v)) - mean;
            var += d * d;
        }
        const double rel = row_diff(logits, last, V) / sqrt(var / V);
        if (rc == 0 && rel > worst) worst = rel;
        free(ids);
    }
    fprintf(stderr, "qwen3-moe-tiny fp8 at load: max |logit - HF| / std = %.3f\n", worst);
    CHECK_MSG(worst <= 0.6, "fp8 at load: %.3f of the logits' std from HF", worst);
    free(logits);
    free(logits1);
out:
    mr_destroy(r1);
    pd_model_destroy(m1);
    mr_destroy(r);
    pd_model_destroy(m);
    pd_backend_destroy(be);
    json_decref(g);
}

/* A backend without moe_route / moe_combine (the CUDA backend today): refused at load. */
static void test_backend_refused(void)
{
    char dir[1024], err[PD_ERR_LEN] = "";
    golden_dir("mixtral-tiny", dir, sizeof dir);
    pd_backend *cpu = NULL;
    mc_config cfg;
    if (pd_backend_create("cpu", NULL, &cpu, err) < 0 || mc_load(dir, &cfg, err) < 0) {
        CHECK_MSG(0, "%s", err);
        pd_backend_destroy(cpu);
        return;
    }
    pd_backend_ops ops = *cpu->ops;
    ops.name = "nomoe";
    ops.moe_route = NULL;
    ops.moe_combine = NULL;
    pd_backend fake = {.ops = &ops, .ctx = cpu->ctx};
    pd_model *m = NULL;
    const int rc = pd_model_load(&cfg, dir, PD_LOAD_SAFETENSORS, 0, &fake, &m, err);
    CHECK_EQ_INT(rc, PD_EUNSUPPORTED);
    CHECK(m == NULL);
    CHECK_STR_CONTAINS(err, "MixtralForCausalLM");
    CHECK_STR_CONTAINS(err, "nomoe backend has no mixture-of-experts ops");
    pd_backend_destroy(cpu);
}

/* A config.json that does not match the checkpoint (copied next to its safetensors with one
 * key changed): the loader names the tensor. */
static void expect_load_error(const char *model, const char *key, int value, const char *want)
{
    char src[1024], dir[] = "/tmp/pd_moe_XXXXXX", path[1200], link_to[1200], err[PD_ERR_LEN];
    golden_dir(model, src, sizeof src);
    if (!mkdtemp(dir)) {
        CHECK_MSG(0, "mkdtemp failed");
        return;
    }
    snprintf(path, sizeof path, "%s/config.json", src);
    json_t *c = NULL;
    CHECK(pd_json_load_file(path, &c, err) == 0);
    json_object_set_new(c, key, json_integer(value));
    snprintf(path, sizeof path, "%s/config.json", dir);
    CHECK(json_dump_file(c, path, 0) == 0);
    json_decref(c);
    snprintf(link_to, sizeof link_to, "%s/model.safetensors", src);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    CHECK(symlink(link_to, path) == 0);
    mc_config cfg;
    pd_backend *be = NULL;
    pd_model *m = NULL;
    int rc = mc_load(dir, &cfg, err);
    CHECK_MSG(rc == 0, "%s", err);
    if (rc == 0 && pd_backend_create("cpu", NULL, &be, err) == 0) {
        rc = pd_model_load(&cfg, dir, PD_LOAD_SAFETENSORS, 0, be, &m, err);
        CHECK_EQ_INT(rc, PD_EFORMAT);
        CHECK_STR_CONTAINS(err, want);
    }
    pd_model_destroy(m);
    pd_backend_destroy(be);
    unlink(path);
    snprintf(path, sizeof path, "%s/config.json", dir);
    unlink(path);
    rmdir(dir);
}

static void test_load_errors(void)
{
    /* a ninth expert: the router's shape is the first thing wrong */
    expect_load_error("qwen3-moe-tiny", "num_experts", 9,
                      "model.layers.0.mlp.gate.weight in");
    expect_load_error("mixtral-tiny", "intermediate_size", 80,
                      "model.layers.0.block_sparse_moe.experts.0.w1.weight in");
    expect_load_error("qwen3-moe-tiny", "moe_intermediate_size", 40,
                      "model.layers.0.mlp.experts.0.gate_proj.weight in");
    /* layer 1 sparse too: its experts are missing */
    expect_load_error("qwen3-moe-tiny-step2", "decoder_sparse_step", 1,
                      "tensor model.layers.0.mlp.gate.weight is missing");
}

int main(void)
{
    char probe[1200];
    golden_dir("mixtral-tiny", probe, sizeof probe);
    strncat(probe, "/golden.json", sizeof probe - strlen(probe) - 1);
    if (access(probe, R_OK) != 0) {
        fprintf(stderr, "test_moe_golden: %s not found, skipping\n", probe);
        return 77;
    }
    for (size_t i = 0; i < sizeof k_models / sizeof k_models[0]; i++) run_model(k_models[i]);
    test_fp8_at_load();
    test_backend_refused();
    test_load_errors();
    return pd_test_result("test_moe_golden");
}
