/* test_sampler.c -- Checks the host sampler: validation, greedy ties, each penalty's exact
 * effect, top-k/top-p/min-p filtering against brute force, that seeded draws follow the
 * softmax of the temperature-scaled logits and walk the kept set in token id order, and the
 * sample op's row and penalty list built for a backend. */
#include <stdint.h>

#include "common/error.h"
#include "engine/sampler.h"
#include "tests/sampler_ref.h"
#include "tests/test_util.h"

#define MAX_VOCAB 50000

static float g_work[MAX_VOCAB];
static const int32_t g_zeros[512]; /* an output of n token-0s, for draws at position n */

/* Samples from a copy of base, so that base survives the in-place penalties and scaling. */
static int32_t sample_copy(const smp_params *p, const float *base, int32_t vocab,
                           const int32_t *prompt, int32_t n_prompt, const int32_t *output,
                           int32_t n_output, smp_scratch *s, float *logprob)
{
    memcpy(g_work, base, (size_t)vocab * sizeof *base);
    return smp_sample(p, g_work, vocab, prompt, n_prompt, output, n_output, s, logprob);
}

/* Fills probs with softmax(logits / temperature), computed in double. */
static void softmax_ref(const float *logits, int32_t n, double temperature, double *probs)
{
    double m = -INFINITY, sum = 0.0;
    for (int32_t i = 0; i < n; i++)
        if (logits[i] / temperature > m) m = logits[i] / temperature;
    for (int32_t i = 0; i < n; i++) sum += probs[i] = exp(logits[i] / temperature - m);
    for (int32_t i = 0; i < n; i++) probs[i] /= sum;
}

/* Draws n_draws tokens (seed d, position 7) and returns Pearson's chi-square statistic of the
 * counts against probs; tokens with zero expected probability must never appear. */
static double chi_square(const smp_params *base_p, const float *logits, int32_t vocab,
                         const double *probs, int n_draws, smp_scratch *s)
{
    int counts[64] = {0};
    int32_t out[8] = {0};
    smp_params p = *base_p;
    for (int d = 0; d < n_draws; d++) {
        p.seed = (uint64_t)d * 7919u + 13u;
        int32_t t = sample_copy(&p, logits, vocab, NULL, 0, out, 7, s, NULL);
        if (t < 0 || t >= vocab) return INFINITY;
        counts[t]++;
    }
    double chi = 0.0;
    for (int32_t i = 0; i < vocab; i++) {
        double e = probs[i] * n_draws;
        if (e == 0.0) {
            if (counts[i]) return INFINITY;
            continue;
        }
        chi += (counts[i] - e) * (counts[i] - e) / e;
    }
    return chi;
}

static void test_defaults_and_validate(void)
{
    char err[PD_ERR_LEN];
    smp_params d = smp_default_params();
    CHECK_NEAR(d.temperature, 1.0, 0);
    CHECK_NEAR(d.top_p, 1.0, 0);
    CHECK_EQ_INT(d.top_k, 0);
    CHECK_NEAR(d.min_p, 0.0, 0);
    CHECK_NEAR(d.repetition_penalty, 1.0, 0);
    CHECK_NEAR(d.presence_penalty, 0.0, 0);
    CHECK_NEAR(d.frequency_penalty, 0.0, 0);
    CHECK_EQ_INT(d.seed, 0);
    CHECK(!d.has_seed);
    CHECK_EQ_INT(smp_validate(&d, err), 0);

    /* Edges that must be accepted. */
    smp_params p = d;
    p.temperature = 0.0f;
    p.top_k = -1;
    p.min_p = 1.0f;
    p.presence_penalty = -2.0f;
    p.frequency_penalty = 2.0f;
    p.repetition_penalty = 0.01f;
    CHECK_EQ_INT(smp_validate(&p, err), 0);

#define BAD(field, value, needle)                                 \
    do {                                                          \
        smp_params b_ = d;                                        \
        b_.field = (value);                                       \
        err[0] = 0;                                               \
        CHECK_EQ_INT(smp_validate(&b_, err), PD_EINVAL);          \
        CHECK_STR_CONTAINS(err, needle);                          \
        CHECK_EQ_INT(smp_validate(&b_, NULL), PD_EINVAL);         \
    } while (0)
    BAD(temperature, -1.0f, "temperature must be >= 0 and finite (got -1)");
    BAD(temperature, NAN, "temperature");
    BAD(temperature, INFINITY, "temperature");
    BAD(top_p, 0.0f, "top_p must be in (0, 1] (got 0)");
    BAD(top_p, 1.5f, "top_p must be in (0, 1] (got 1.5)");
    BAD(top_p, NAN, "top_p");
    BAD(top_k, -2, "top_k must be >= -1");
    BAD(top_k, -2, "(got -2)");
    BAD(min_p, 1.5f, "min_p must be in [0, 1] (got 1.5)");
    BAD(min_p, -0.1f, "min_p");
    BAD(min_p, NAN, "min_p");
    BAD(repetition_penalty, 0.0f, "repetition_penalty must be > 0");
    BAD(repetition_penalty, -1.0f, "repetition_penalty");
    BAD(repetition_penalty, NAN, "repetition_penalty");
    BAD(presence_penalty, 3.0f, "presence_penalty must be in [-2, 2] (got 3)");
    BAD(presence_penalty, -2.5f, "presence_penalty");
    BAD(presence_penalty, NAN, "presence_penalty");
    BAD(frequency_penalty, -3.0f, "frequency_penalty must be in [-2, 2] (got -3)");
    BAD(frequency_penalty, NAN, "frequency_penalty");
#undef BAD
}

static void test_scratch(void)
{
    smp_scratch *s = (smp_scratch *)&s; /* must be reset to NULL on failure */
    CHECK_EQ_INT(smp_scratch_create(0, &s), PD_EINVAL);
    CHECK(s == NULL);
    CHECK_EQ_INT(smp_scratch_create(-5, &s), PD_EINVAL);
    smp_scratch_destroy(NULL);
}

static void test_greedy(smp_scratch *s)
{
    const float l[5] = {1.0f, 3.0f, 2.0f, 3.0f, -INFINITY};
    smp_params p = smp_default_params();
    float lp = 1.0f;
    p.temperature = 0.0f;
    CHECK_EQ_INT(sample_copy(&p, l, 5, NULL, 0, NULL, 0, s, &lp), 1); /* tie: lowest id */
    double want = -log(exp(-2.0) + 1.0 + exp(-1.0) + 1.0);
    CHECK_NEAR(lp, want, 1e-6);
    p.temperature = 5e-6f; /* below the greedy threshold */
    for (uint64_t seed = 0; seed < 20; seed++) {
        p.seed = seed;
        CHECK_EQ_INT(sample_copy(&p, l, 5, NULL, 0, NULL, 0, s, NULL), 1);
    }
    /* Greedy does not scale the logits. */
    memcpy(g_work, l, sizeof l);
    smp_sample(&p, g_work, 5, NULL, 0, NULL, 0, s, NULL);
    CHECK_NEAR(g_work[2], 2.0, 0);
    /* NaN never wins. */
    const float nanl[3] = {NAN, 0.5f, 0.25f};
    CHECK_EQ_INT(sample_copy(&p, nanl, 3, NULL, 0, NULL, 0, s, NULL), 1);
}

static void test_top_k_one_is_greedy(smp_scratch *s)
{
    float l[100];
    uint64_t x = 12345;
    for (int i = 0; i < 100; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        l[i] = (float)((x >> 40) % 1000) / 100.0f;
    }
    smp_params g = smp_default_params();
    g.temperature = 0.0f;
    int32_t want = sample_copy(&g, l, 100, NULL, 0, NULL, 0, s, NULL);
    smp_params p = smp_default_params();
    p.top_k = 1;
    p.temperature = 1.7f;
    for (uint64_t seed = 0; seed < 200; seed++) {
        float lp = -1.0f;
        p.seed = seed;
        CHECK_EQ_INT(sample_copy(&p, l, 100, NULL, 0, NULL, 0, s, &lp), want);
        CHECK_NEAR(lp, 0.0, 0);
    }
}

static void test_penalties(smp_scratch *s)
{
    const float base[6] = {2.0f, -2.0f, 1.0f, 0.5f, 3.0f, -1.0f};
    smp_params p = smp_default_params();
    p.temperature = 0.0f;

    /* Repetition 2: once per distinct token of prompt or output, HF sign rule. */
    p.repetition_penalty = 2.0f;
    const int32_t prompt[4] = {0, 0, 1, 99};
    const int32_t out_rep[4] = {1, 1, 2, -3}; /* out-of-range ids are ignored */
    memcpy(g_work, base, sizeof base);
    smp_sample(&p, g_work, 6, prompt, 4, out_rep, 4, s, NULL);
    CHECK_NEAR(g_work[0], 1.0, 0);
    CHECK_NEAR(g_work[1], -4.0, 0);
    CHECK_NEAR(g_work[2], 0.5, 0);
    CHECK_NEAR(g_work[3], 0.5, 0);
    CHECK_NEAR(g_work[4], 3.0, 0);
    CHECK_NEAR(g_work[5], -1.0, 0);

    /* Frequency 0.5: per occurrence, output only. */
    p = smp_default_params();
    p.temperature = 0.0f;
    p.frequency_penalty = 0.5f;
    const int32_t out_freq[5] = {2, 2, 4, 2, 5};
    memcpy(g_work, base, sizeof base);
    smp_sample(&p, g_work, 6, prompt, 4, out_freq, 5, s, NULL);
    CHECK_NEAR(g_work[0], 2.0, 0);
    CHECK_NEAR(g_work[2], -0.5, 0);
    CHECK_NEAR(g_work[4], 2.5, 0);
    CHECK_NEAR(g_work[5], -1.5, 0);
    CHECK_NEAR(g_work[3], 0.5, 0);

    /* Presence 1: once per distinct output token. */
    p.frequency_penalty = 0.0f;
    p.presence_penalty = 1.0f;
    memcpy(g_work, base, sizeof base);
    smp_sample(&p, g_work, 6, prompt, 4, out_freq, 5, s, NULL);
    CHECK_NEAR(g_work[2], 0.0, 0);
    CHECK_NEAR(g_work[4], 2.0, 0);
    CHECK_NEAR(g_work[5], -2.0, 0);
    CHECK_NEAR(g_work[0], 2.0, 0);
    /* Negative presence rewards. */
    p.presence_penalty = -1.5f;
    memcpy(g_work, base, sizeof base);
    smp_sample(&p, g_work, 6, NULL, 0, out_freq, 5, s, NULL);
    CHECK_NEAR(g_work[2], 2.5, 0);

    /* All three, repetition first: 2 -> 1 (rep) -> 0 (freq 0.5 x 2) -> -0.25 (presence). */
    p = smp_default_params();
    p.temperature = 0.0f;
    p.repetition_penalty = 2.0f;
    p.frequency_penalty = 0.5f;
    p.presence_penalty = 0.25f;
    const int32_t out_all[3] = {0, 3, 0};
    memcpy(g_work, base, sizeof base);
    smp_sample(&p, g_work, 6, NULL, 0, out_all, 3, s, NULL);
    CHECK_NEAR(g_work[0], -0.25, 0);
    CHECK_NEAR(g_work[3], 0.25 - 0.5 - 0.25, 1e-7);
    CHECK_NEAR(g_work[1], -2.0, 0);

    /* Repeated use of one scratch: marks from earlier calls must not leak into this one. */
    for (int rep = 0; rep < 3; rep++) {
        const int32_t out_one[1] = {4};
        memcpy(g_work, base, sizeof base);
        smp_sample(&p, g_work, 6, NULL, 0, out_one, 1, s, NULL);
        CHECK_NEAR(g_work[0], 2.0, 0);
        CHECK_NEAR(g_work[3], 0.5, 0);
        CHECK_NEAR(g_work[4], 1.5 - 0.5 - 0.25, 0);
    }

    /* A penalty changes the greedy pick. */
    const float two[2] = {1.0f, 0.9f};
    const int32_t out0[1] = {0};
    p = smp_default_params();
    p.temperature = 0.0f;
    CHECK_EQ_INT(sample_copy(&p, two, 2, NULL, 0, out0, 1, s, NULL), 0);
    p.presence_penalty = 0.5f;
    CHECK_EQ_INT(sample_copy(&p, two, 2, NULL, 0, out0, 1, s, NULL), 1);
}

static void test_top_p_and_min_p(smp_scratch *s)
{
    const float l[4] = {0.0f, 2.0f, 1.0f, -1.0f};
    smp_params p = smp_default_params();
    p.top_p = 0.01f;
    for (uint64_t seed = 0; seed < 200; seed++) {
        float lp = -1.0f;
        p.seed = seed;
        CHECK_EQ_INT(sample_copy(&p, l, 4, NULL, 0, NULL, 0, s, &lp), 1);
        CHECK_NEAR(lp, 0.0, 0);
    }

    /* probs {0.5, 0.3, 0.15, 0.05}: top_p 0.75 keeps {0, 1}, renormalized to {0.625, 0.375}. */
    const float q[4] = {logf(0.5f), logf(0.3f), logf(0.15f), logf(0.05f)};
    double want[4] = {0.625, 0.375, 0.0, 0.0};
    p = smp_default_params();
    p.top_p = 0.75f;
    double chi = chi_square(&p, q, 4, want, 4000, s);
    CHECK_MSG(chi < 16.0, "top_p chi-square %g", chi);
    float lp = 0.0f;
    p.seed = 3;
    int32_t t = sample_copy(&p, q, 4, NULL, 0, NULL, 0, s, &lp);
    CHECK(t == 0 || t == 1);
    CHECK_NEAR(lp, log(want[t]), 1e-5);

    /* min_p 0.2: threshold 0.1 drops only token 3; kept mass 0.95. */
    p = smp_default_params();
    p.min_p = 0.2f;
    double want_m[4] = {0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0};
    chi = chi_square(&p, q, 4, want_m, 4000, s);
    CHECK_MSG(chi < 20.0, "min_p chi-square %g", chi);
    /* min_p 1 keeps only the most likely token. */
    p.min_p = 1.0f;
    for (uint64_t seed = 0; seed < 50; seed++) {
        p.seed = seed;
        CHECK_EQ_INT(sample_copy(&p, q, 4, NULL, 0, NULL, 0, s, &lp), 0);
        CHECK_NEAR(lp, 0.0, 0);
    }

    /* top_k 2 with a three-way tie at the threshold keeps the two lowest ids. */
    const float tie[4] = {1.0f, 2.0f, 2.0f, 2.0f};
    double want_t[4] = {0.0, 0.5, 0.5, 0.0};
    p = smp_default_params();
    p.top_k = 2;
    chi = chi_square(&p, tie, 4, want_t, 2000, s);
    CHECK_MSG(chi < 16.0, "top_k tie chi-square %g", chi);

    /* top_p measures mass after top_k renormalizes: {0.4, 0.3} -> {4/7, 3/7}, and 4/7 alone
     * reaches 0.5 (against the full vocabulary 0.4 would not). */
    const float r[4] = {logf(0.4f), logf(0.3f), logf(0.2f), logf(0.1f)};
    p = smp_default_params();
    p.top_k = 2;
    p.top_p = 0.5f;
    for (uint64_t seed = 0; seed < 100; seed++) {
        p.seed = seed;
        CHECK_EQ_INT(sample_copy(&p, r, 4, NULL, 0, NULL, 0, s, NULL), 0);
    }
}

static void test_distribution(smp_scratch *s)
{
    const float l[8] = {0.3f, -1.2f, 1.5f, 0.0f, 2.0f, -0.5f, 0.9f, 1.1f};
    const double temps[4] = {1.0, 0.5, 2.0, 0.7};
    for (int i = 0; i < 4; i++) {
        double want[8];
        softmax_ref(l, 8, temps[i], want);
        smp_params p = smp_default_params();
        p.temperature = (float)temps[i];
        /* 7 degrees of freedom: 24.3 is the 0.1% critical value. */
        double chi = chi_square(&p, l, 8, want, 20000, s);
        CHECK_MSG(chi < 24.3, "temperature %g chi-square %g", temps[i], chi);
        /* The logits are scaled in place and logprob is the log of the scaled softmax. */
        float lp = 0.0f;
        p.seed = 99;
        int32_t t = sample_copy(&p, l, 8, NULL, 0, NULL, 0, s, &lp);
        CHECK_NEAR(lp, log(want[t]), 1e-5);
        CHECK_NEAR(g_work[4], 2.0 / temps[i], 1e-6);
    }
    /* Scaling must matter: at temperature 0.5 token 4 is drawn more often than at 2. */
    double hot[8], cold[8];
    softmax_ref(l, 8, 2.0, hot);
    softmax_ref(l, 8, 0.5, cold);
    smp_params p = smp_default_params();
    p.temperature = 0.5f;
    double chi = chi_square(&p, l, 8, hot, 5000, s);
    CHECK_MSG(chi > 200.0, "temperature 0.5 matched the temperature 2 law (chi %g)", chi);
    CHECK(cold[4] > hot[4] + 0.2);
}

static int cmp_desc(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x < y) - (x > y);
}

/* Large vocabulary: the heap selection and the full ranking agree with a brute-force sort. */
static void test_large_vocab(smp_scratch *s)
{
    static float l[MAX_VOCAB], sorted[MAX_VOCAB];
    uint64_t x = 777;
    for (int i = 0; i < MAX_VOCAB; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        l[i] = (float)((x >> 33) % 1000000) / 100000.0f; /* distinct enough, in [0, 10) */
    }
    memcpy(sorted, l, sizeof l);
    qsort(sorted, MAX_VOCAB, sizeof *sorted, cmp_desc);

    smp_params p = smp_default_params();
    p.top_k = 50;
    double mass = 0.0;
    for (int i = 0; i < 50; i++) mass += exp((double)sorted[i] - sorted[0]);
    for (int n = 0; n < 300; n++) {
        float lp = 0.0f;
        p.seed = 42;
        int32_t t = sample_copy(&p, l, MAX_VOCAB, NULL, 0, g_zeros, n, s, &lp);
        CHECK_MSG(l[t] >= sorted[49], "token %d logit %g below the 50th %g", t, l[t], sorted[49]);
        CHECK_NEAR(lp, (double)l[t] - sorted[0] - log(mass), 1e-4);
    }

    /* top_p 0.5 alone: the kept set is the best-first prefix reaching half the mass. */
    double total = 0.0, cum = 0.0;
    for (int i = 0; i < MAX_VOCAB; i++) total += exp((double)sorted[i] - sorted[0]);
    int keep = 0;
    while (cum < 0.5 * total) cum += exp((double)sorted[keep++] - sorted[0]);
    p = smp_default_params();
    p.top_p = 0.5f;
    for (int n = 0; n < 100; n++) {
        float lp = 0.0f;
        p.seed = 5;
        int32_t t = sample_copy(&p, l, MAX_VOCAB, NULL, 0, g_zeros, n, s, &lp);
        CHECK_MSG(l[t] >= sorted[keep - 1], "top_p kept token %d (%g < %g)", t, l[t],
                  sorted[keep - 1]);
        CHECK_NEAR(lp, (double)l[t] - sorted[0] - log(cum), 1e-3);
    }
}

static void test_determinism(smp_scratch *s)
{
    float flat[16];
    for (int i = 0; i < 16; i++) flat[i] = 0.0f;
    smp_params p = smp_default_params();
    p.seed = 1234;
    p.has_seed = true;
    int32_t a = sample_copy(&p, flat, 16, NULL, 0, g_zeros, 5, s, NULL);
    int32_t b = sample_copy(&p, flat, 16, NULL, 0, g_zeros, 5, s, NULL);
    CHECK_EQ_INT(a, b);
    CHECK(smp_uniform(1234, 5) == smp_uniform(1234, 5));
    CHECK(smp_uniform(1234, 5) != smp_uniform(1234, 6));
    CHECK(smp_uniform(1234, 5) != smp_uniform(1235, 5));

    int seen[16] = {0}, distinct = 0;
    for (int n = 0; n < 100; n++) {
        int32_t t = sample_copy(&p, flat, 16, NULL, 0, g_zeros, n, s, NULL);
        if (!seen[t]++) distinct++;
    }
    CHECK_MSG(distinct >= 12, "only %d distinct tokens over 100 positions", distinct);

    double sum = 0.0, lo = 1.0, hi = 0.0;
    for (int64_t n = 0; n < 100000; n++) {
        double u = smp_uniform(7, n);
        CHECK(u >= 0.0 && u < 1.0);
        sum += u;
        lo = u < lo ? u : lo;
        hi = u > hi ? u : hi;
    }
    CHECK_NEAR(sum / 100000.0, 0.5, 0.005);
    CHECK(lo < 1e-3 && hi > 1.0 - 1e-3);
}

/* Brute force of the whole draw: rank by (value desc, id asc), top-k, top-p on the best-first
 * prefix, min-p, then the inverse CDF over the kept tokens in ascending id order, with
 * smp_sample's float probabilities and double sums. */
static int32_t draw_ref(const smp_params *p, const float *logits, int32_t vocab, int32_t n_out,
                        float *logprob)
{
    static float v[512];
    static int32_t idx[512];
    static unsigned char kept[512];
    for (int32_t i = 0; i < vocab; i++) {
        v[i] = logits[i] / p->temperature;
        if (isnan(v[i])) v[i] = -INFINITY;
    }
    float m;
    ref_kept_set(p, v, vocab, idx, kept, &m);
    double total = 0.0;
    for (int32_t t = 0; t < vocab; t++)
        if (kept[t]) total += expf(v[t] - m);
    double target = smp_uniform(p->seed, n_out) * total, cum = 0.0;
    int32_t pick = -1;
    for (int32_t t = 0; t < vocab; t++) {
        if (!kept[t]) continue;
        float pr = expf(v[t] - m);
        if (pr > 0.0f) pick = t;
        cum += pr;
        if (target < cum) break;
    }
    *logprob = (float)((double)v[pick] - (double)m - log(total));
    return pick;
}

/* The draw walks the kept candidates in id order, however they were ranked. */
static void test_id_order_walk(smp_scratch *s)
{
    /* probs {0.2, 0.5, 0.3}: top_p 0.99 ranks them (1, 2, 0) but keeps all three; in id order
     * u < 0.2 picks token 0, where a best-first walk would pick token 1. */
    const float three[3] = {logf(0.2f), logf(0.5f), logf(0.3f)};
    smp_params p = smp_default_params();
    p.top_p = 0.99f;
    int low = 0, high = 0;
    for (uint64_t seed = 0; seed < 400; seed++) {
        p.seed = seed;
        double u = smp_uniform(seed, 0);
        int32_t want = u < 0.2 ? 0 : u < 0.7 ? 1 : 2;
        CHECK_EQ_INT(sample_copy(&p, three, 3, NULL, 0, NULL, 0, s, NULL), want);
        low += u < 0.2;
        high += u >= 0.7;
    }
    CHECK(low > 40 && high > 60);

    /* Random rows (with ties, -inf and NaN) under every filter, against brute force. */
    static float l[512];
    const smp_params sets[] = {
        {.temperature = 1.0f, .top_p = 1.0f, .top_k = 0},
        {.temperature = 0.7f, .top_p = 1.0f, .top_k = 7},
        {.temperature = 1.3f, .top_p = 0.6f, .top_k = 0},
        {.temperature = 1.0f, .top_p = 0.9f, .top_k = 50},
        {.temperature = 0.9f, .top_p = 1.0f, .top_k = 0, .min_p = 0.05f},
        {.temperature = 1.1f, .top_p = 0.8f, .top_k = 300, .min_p = 0.1f},
        {.temperature = 1.0f, .top_p = 0.3f, .top_k = 511},
    };
    for (int rep = 0; rep < 40; rep++) {
        const int32_t vocab = rep % 2 ? 512 : 97 + rep;
        uint64_t x = 1000 + (uint64_t)rep;
        for (int32_t i = 0; i < vocab; i++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            l[i] = (float)((int)((x >> 33) % 64) - 32) / 8.0f; /* many ties */
        }
        l[rep % vocab] = -INFINITY;
        l[(rep * 7 + 3) % vocab] = NAN;
        for (size_t k = 0; k < sizeof sets / sizeof sets[0]; k++) {
            smp_params q = sets[k];
            q.repetition_penalty = 1.0f;
            for (int32_t n = 0; n < 30; n++) {
                q.seed = (uint64_t)rep * 131u + k;
                float lp = 0.0f, lp_ref = 0.0f;
                int32_t want = draw_ref(&q, l, vocab, n, &lp_ref);
                int32_t got = sample_copy(&q, l, vocab, NULL, 0, g_zeros, n, s, &lp);
                CHECK_MSG(got == want, "rep %d set %zu n %d: token %d, brute force %d", rep, k,
                          n, got, want);
                CHECK_NEAR(lp, lp_ref, 0);
            }
        }
    }
}

/* apply_penalties as the sample op reads a penalty list (kernels/cuda/cuda_sample.cu). */
static void apply_list(const smp_params *p, float *l, const pd_penalty_tok *pen, int32_t n)
{
    for (int32_t i = 0; i < n; i++) {
        float v = l[pen[i].token];
        if (p->repetition_penalty != 1.0f)
            v = v > 0.0f ? v / p->repetition_penalty : v * p->repetition_penalty;
        if ((p->frequency_penalty != 0.0f || p->presence_penalty != 0.0f) && pen[i].count > 0) {
            v -= p->frequency_penalty * (float)pen[i].count;
            v -= p->presence_penalty;
        }
        l[pen[i].token] = v;
    }
}

static void test_penalty_list(smp_scratch *s)
{
    const int32_t prompt[7] = {3, 9, 3, 400, -1, 9, 12};
    const int32_t output[8] = {9, 5, 5, 77, 5, 3, 1000, 9};
    pd_penalty_tok pen[16];
    smp_params p = smp_default_params();
    CHECK_EQ_INT(smp_penalty_list(&p, prompt, 7, output, 8, 100, s, pen), 0);

    /* Repetition only: prompt and output tokens once each, output first; ids outside
     * [0, vocab) skipped. */
    p.repetition_penalty = 1.5f;
    int32_t n = smp_penalty_list(&p, prompt, 7, output, 8, 100, s, pen);
    const int32_t want_tok[6] = {9, 5, 77, 3, 12, -1};
    const int32_t want_cnt[6] = {2, 3, 1, 1, 0, -1};
    CHECK_EQ_INT(n, 5);
    for (int i = 0; i < 5 && i < n; i++) {
        CHECK_EQ_INT(pen[i].token, want_tok[i]);
        CHECK_EQ_INT(pen[i].count, want_cnt[i]);
    }
    /* Frequency only: prompt-only tokens change nothing and are left out. */
    p = smp_default_params();
    p.frequency_penalty = 0.5f;
    n = smp_penalty_list(&p, prompt, 7, output, 8, 100, s, pen);
    CHECK_EQ_INT(n, 4);
    for (int i = 0; i < n; i++) CHECK(pen[i].count > 0);

    /* With every penalty, applying the list equals smp_sample's penalties bit for bit. */
    float base[100], got[100];
    uint64_t x = 99;
    for (int i = 0; i < 100; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        base[i] = (float)((int)((x >> 33) % 2000) - 1000) / 137.0f;
    }
    const float reps[3] = {1.3f, 0.7f, 1.0f};
    for (int k = 0; k < 3; k++) {
        p = smp_default_params();
        p.temperature = 0.0f; /* greedy leaves the penalized logits in place */
        p.repetition_penalty = reps[k];
        p.frequency_penalty = 0.3f;
        p.presence_penalty = -0.7f;
        for (int rep = 0; rep < 2; rep++) { /* the scratch's marks must not leak */
            n = smp_penalty_list(&p, prompt, 7, output, 8, 100, s, pen);
            CHECK_EQ_INT(n, k < 2 ? 5 : 4);
            memcpy(got, base, sizeof base);
            apply_list(&p, got, pen, n);
            memcpy(g_work, base, sizeof base);
            smp_sample(&p, g_work, 100, prompt, 7, output, 8, s, NULL);
            CHECK(memcmp(got, g_work, sizeof got) == 0);
        }
    }

    p = smp_default_params();
    p.temperature = 0.6f;
    p.top_p = 0.9f;
    p.top_k = 40;
    p.min_p = 0.05f;
    p.repetition_penalty = 1.1f;
    p.presence_penalty = 0.2f;
    p.frequency_penalty = -0.3f;
    p.seed = 0x123456789abcdefull;
    pd_sample_row r = smp_sample_row(&p, 17, 5, 9);
    CHECK_NEAR(r.temperature, 0.6f, 0);
    CHECK_NEAR(r.top_p, 0.9f, 0);
    CHECK_EQ_INT(r.top_k, 40);
    CHECK_NEAR(r.min_p, 0.05f, 0);
    CHECK_NEAR(r.repetition_penalty, 1.1f, 0);
    CHECK_NEAR(r.presence_penalty, 0.2f, 0);
    CHECK_NEAR(r.frequency_penalty, -0.3f, 0);
    CHECK(r.seed == 0x123456789abcdefull);
    CHECK_EQ_INT(r.n_output, 17);
    CHECK_EQ_INT(r.pen_off, 5);
    CHECK_EQ_INT(r.pen_n, 9);
}

/* Sorts ids by (logit descending, id ascending) for the brute-force top-n. */
static const float *g_cmp_l;
static int cmp_rank(const void *a, const void *b)
{
    const int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    const float lx = g_cmp_l[x], ly = g_cmp_l[y];
    if (lx != ly) return lx > ly ? -1 : 1;
    return (x > y) - (x < y);
}

/* smp_logprobs against a brute force written differently: log(exp(l) / sum exp) of every
 * finite token in long double, a full sort for the top, on flat, peaked, tied, tiny and
 * -inf / NaN-strewn rows; n_top 0..20; tokens in and out of the top; and it reads the row
 * only (the raw distribution whatever the sampler does to its own copy). */
static void test_logprobs(smp_scratch *s)
{
    static float l[5000];
    static int32_t ids[5000];
    int checked = 0;
    uint64_t x = 12345;
    for (int c = 0; c < 60; c++) {
        const int32_t V = c % 5 == 4 ? 3 : 5000 - 79 * c;
        for (int32_t i = 0; i < V; i++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            const double u = (double)(x >> 11) * 0x1.0p-53;
            switch (c % 4) {
            case 0: l[i] = (float)(u * 6.0 - 3.0); break;                 /* flat */
            case 1: l[i] = (float)(u * 2.0) + (i % 97 == 5 ? 12.0f : 0.0f); break; /* peaked */
            case 2: l[i] = (float)(int)(u * 4.0) * 0.5f; break;          /* many ties */
            default: l[i] = (float)(u * 40.0 - 20.0); break;             /* wide */
            }
            if (c % 3 == 1 && i % 11 == 3) l[i] = -INFINITY;
            if (c % 3 == 2 && i % 13 == 7) l[i] = NAN;
        }
        long double m = -INFINITY, sum = 0.0L;
        for (int32_t i = 0; i < V; i++)
            if (l[i] > -INFINITY && (long double)l[i] > m) m = l[i];
        for (int32_t i = 0; i < V; i++)
            if (l[i] > -INFINITY) sum += expl((long double)l[i] - m);
        int32_t n_fin = 0;
        for (int32_t i = 0; i < V; i++)
            if (l[i] > -INFINITY) ids[n_fin++] = i;
        g_cmp_l = l;
        qsort(ids, (size_t)n_fin, sizeof *ids, cmp_rank);
        for (int32_t k = 0; k <= PD_MAX_TOP_LOGPROBS; k += (c % 2 ? 1 : 7)) {
            pd_top_logprob top[PD_MAX_TOP_LOGPROBS];
            memset(top, 0x5a, sizeof top);
            const int32_t tok = (c + k) % 2 ? ids[0] : ids[n_fin - 1]; /* best or worst finite */
            float lp = 1.0f;
            memcpy(g_work, l, (size_t)V * sizeof *l);
            const int32_t n = smp_logprobs(g_work, V, tok, k, &lp, top);
            CHECK(memcmp(g_work, l, (size_t)V * sizeof *l) == 0);
            const int32_t want_n = k < n_fin ? k : n_fin;
            CHECK_EQ_INT(n, want_n);
            const long double want_lp = (long double)l[tok] - m - logl(sum);
            CHECK_NEAR((double)lp, (double)want_lp, 1e-5);
            for (int32_t j = 0; j < n && j < want_n; j++) {
                CHECK_MSG(top[j].token == ids[j], "case %d n %d: top %d is %d, want %d", c, k, j,
                          top[j].token, ids[j]);
                CHECK_NEAR((double)top[j].logprob,
                           (double)((long double)l[ids[j]] - m - logl(sum)), 1e-5);
                if (j > 0) CHECK(top[j].logprob <= top[j - 1].logprob);
                if (top[j].token == tok) CHECK(top[j].logprob == lp);
            }
            checked++;
        }
    }
    /* Everything -inf or NaN: -inf and an empty list; a NaN token: -inf. */
    for (int32_t i = 0; i < 10; i++) l[i] = i % 2 ? NAN : -INFINITY;
    pd_top_logprob top[4];
    float lp = 0.0f;
    CHECK_EQ_INT(smp_logprobs(l, 10, 3, 4, &lp, top), 0);
    CHECK(isinf(lp) && lp < 0);
    l[4] = 1.0f;
    CHECK_EQ_INT(smp_logprobs(l, 10, 3, 4, &lp, top), 1);
    CHECK(isinf(lp) && lp < 0 && top[0].token == 4 && top[0].logprob == 0.0f);
    CHECK_EQ_INT(smp_logprobs(l, 10, 4, 0, &lp, NULL), 0);
    CHECK(lp == 0.0f);
    /* the raw distribution is not the sampler's: with temperature and penalties the same row
     * gives the same logprobs (the engine reads a copy taken before smp_sample) */
    for (int32_t i = 0; i < 100; i++) l[i] = (float)(i % 10) * 0.3f;
    smp_params p = smp_default_params();
    p.temperature = 0.5f;
    p.repetition_penalty = 2.0f;
    p.has_seed = true;
    const int32_t prompt[2] = {9, 19};
    memcpy(g_work, l, 100 * sizeof *l);
    const int32_t t = smp_sample(&p, g_work, 100, prompt, 2, NULL, 0, s, NULL);
    float lp1 = 0.0f, lp2 = 0.0f;
    (void)smp_logprobs(l, 100, t, 0, &lp1, NULL);
    CHECK(memcmp(g_work, l, 100 * sizeof *l) != 0); /* the sampler changed its row */
    double z = 0.0;
    for (int32_t i = 0; i < 100; i++) z += exp((double)l[i]);
    lp2 = (float)((double)l[t] - log(z));
    CHECK_NEAR((double)lp1, (double)lp2, 1e-6);
    printf("smp_logprobs: %d cases against brute force\n", checked);
}

int main(void)
{
    smp_scratch *s = NULL;
    CHECK_EQ_INT(smp_scratch_create(MAX_VOCAB, &s), 0);
    if (!s) return pd_test_result("test_sampler");
    test_defaults_and_validate();
    test_scratch();
    test_greedy(s);
    test_top_k_one_is_greedy(s);
    test_penalties(s);
    test_top_p_and_min_p(s);
    test_distribution(s);
    test_large_vocab(s);
    test_determinism(s);
    test_id_order_walk(s);
    test_penalty_list(s);
    test_logprobs(s);
    smp_scratch_destroy(s);
    return pd_test_result("test_sampler");
}
