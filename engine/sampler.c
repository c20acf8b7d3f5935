/* sampler.c -- Host reference sampler: vLLM-style penalties, temperature, top-k, top-p and
 * min-p, then an inverse-CDF draw over the kept candidates in token id order, keyed only by
 * (seed, output position). Also builds the rows and penalty lists of a backend's sample op.
 * Every buffer lives in smp_scratch, so a step allocates nothing. */
#include "engine/sampler.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"

/* Temperatures below this sample greedily, as vLLM's _SAMPLING_EPS. */
#define SMP_GREEDY_EPS 1e-5f

struct smp_scratch {
    int32_t vocab;  /* capacity in tokens, > 0 */
    uint32_t gen;   /* current stamp; mark[t] == gen means t was already seen in this pass */
    uint32_t *mark; /* (vocab) last stamp that saw each token; 0 = never */
    int32_t *count; /* (vocab) occurrences in the output (smp_penalty_list: entry index);
                     * valid only where mark == gen; radix-sort space during the draw */
    int32_t *idx;   /* (vocab) candidate token ids, best first once ranked */
    float *prob;    /* (vocab) unnormalized probabilities exp(l - l_max), parallel to idx */
};


int smp_scratch_create(int32_t vocab, smp_scratch **out)
{
    *out = NULL;
    if (vocab <= 0) return PD_EINVAL;
    smp_scratch *s = calloc(1, sizeof *s);
    if (!s) return PD_ENOMEM;
    s->vocab = vocab;
    s->mark = calloc((size_t)vocab, sizeof *s->mark);
    if (!s->mark) goto fail;
    s->count = calloc((size_t)vocab, sizeof *s->count);
    if (!s->count) goto fail;
    s->idx = malloc((size_t)vocab * sizeof *s->idx);
    if (!s->idx) goto fail;
    s->prob = malloc((size_t)vocab * sizeof *s->prob);
    if (!s->prob) goto fail;
    *out = s;
    return 0;
fail:
    smp_scratch_destroy(s);
    return PD_ENOMEM;
}

void smp_scratch_destroy(smp_scratch *s)
{
    if (!s) return;
    free(s->mark);
    free(s->count);
    free(s->idx);
    free(s->prob);
    free(s);
}

/* splitmix64's output function: a bijective 64-bit mix. */
static uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

#define SMP_GOLDEN 0x9E3779B97F4A7C15ull

/* The value is output n + 1 of a splitmix64 stream whose state starts at splitmix64(seed), so
 * it can be computed for any n without stepping; the top 53 bits give a double in [0, 1). */
double smp_uniform(uint64_t seed, int64_t n)
{
    uint64_t state = mix64(seed + SMP_GOLDEN);
    uint64_t z = mix64(state + ((uint64_t)n + 1u) * SMP_GOLDEN);
    return (double)(z >> 11) * 0x1.0p-53;
}

/* Starts a new marking pass and returns its stamp. On the rare wrap of the 32-bit counter the
 * marks are cleared once, so stale stamps can never match. */
static uint32_t next_stamp(smp_scratch *s)
{
    if (++s->gen == 0) {
        memset(s->mark, 0, (size_t)s->vocab * sizeof *s->mark);
        s->gen = 1;
    }
    return s->gen;
}

/* Applies vLLM's penalties in its order: the repetition penalty once per distinct token of
 * prompt and output (HF rule: positive logits divided, others multiplied), then the frequency
 * penalty times the token's count in the output and the presence penalty once per distinct
 * output token. Token ids outside [0, vocab) are ignored. */
static void apply_penalties(const smp_params *p, float *logits, int32_t vocab,
                            const int32_t *prompt, int32_t n_prompt, const int32_t *output,
                            int32_t n_output, smp_scratch *s)
{
    float rep = p->repetition_penalty;
    if (rep != 1.0f) {
        uint32_t g = next_stamp(s);
        const int32_t *lists[2] = {prompt, output};
        int32_t lens[2] = {n_prompt, n_output};
        for (int l = 0; l < 2; l++) {
            for (int32_t i = 0; i < lens[l]; i++) {
                int32_t t = lists[l][i];
                if (t < 0 || t >= vocab || s->mark[t] == g) continue;
                s->mark[t] = g;
                logits[t] = logits[t] > 0.0f ? logits[t] / rep : logits[t] * rep;
            }
        }
    }
    if (p->frequency_penalty == 0.0f && p->presence_penalty == 0.0f) return;
    uint32_t g = next_stamp(s);
    for (int32_t i = 0; i < n_output; i++) {
        int32_t t = output[i];
        if (t < 0 || t >= vocab) continue;
        if (s->mark[t] != g) {
            s->mark[t] = g;
            s->count[t] = 0;
        }
        s->count[t]++;
    }
    for (int32_t i = 0; i < n_output; i++) {
        int32_t t = output[i];
        if (t < 0 || t >= vocab || s->count[t] == 0) continue;
        logits[t] -= p->frequency_penalty * (float)s->count[t];
        logits[t] -= p->presence_penalty;
        s->count[t] = 0; /* penalized; later occurrences skip it */
    }
}

/* True when token a ranks below token b: a smaller logit, or an equal one and a larger id. */
static inline bool ranks_below(const float *l, int32_t a, int32_t b)
{
    return l[a] < l[b] || (l[a] == l[b] && a > b);
}

/* Restores the heap property below position i of h[0..n), whose root is the lowest-ranked. */
static void sift_down(const float *l, int32_t *h, int32_t n, int32_t i)
{
    for (;;) {
        int32_t c = 2 * i + 1;
        if (c >= n) return;
        if (c + 1 < n && ranks_below(l, h[c + 1], h[c])) c++;
        if (!ranks_below(l, h[c], h[i])) return;
        int32_t tmp = h[i];
        h[i] = h[c];
        h[c] = tmp;
        i = c;
    }
}

/* Writes the k best-ranked token ids (1 <= k <= vocab) into h, best first, ties by ascending
 * id. A heap of the k best seen so far costs O(vocab log k); k == vocab is a full heapsort. */
static void select_top(const float *l, int32_t vocab, int32_t k, int32_t *h)
{
    for (int32_t t = 0; t < k; t++) h[t] = t;
    for (int32_t i = k / 2 - 1; i >= 0; i--) sift_down(l, h, k, i);
    for (int32_t t = k; t < vocab; t++) {
        if (ranks_below(l, h[0], t)) {
            h[0] = t;
            sift_down(l, h, k, 0);
        }
    }
    for (int32_t end = k - 1; end > 0; end--) {
        int32_t tmp = h[0];
        h[0] = h[end];
        h[end] = tmp;
        sift_down(l, h, end, 0);
    }
}

/* Greedy pick: the largest logit, lowest id on ties; NaN never wins. If logprob is not NULL it
 * receives the log-softmax of the pick over all logits. Every logit -inf or NaN gives token 0
 * with logprob -inf. */
static int32_t sample_greedy(const float *logits, int32_t vocab, float *logprob)
{
    int32_t best = -1;
    float m = -INFINITY;
    for (int32_t i = 0; i < vocab; i++) {
        if (logits[i] > m) {
            m = logits[i];
            best = i;
        }
    }
    if (best < 0) {
        if (logprob) *logprob = -INFINITY;
        return 0;
    }
    if (logprob) {
        double sum = 0.0;
        for (int32_t i = 0; i < vocab; i++)
            if (!isnan(logits[i])) sum += exp((double)logits[i] - (double)m);
        *logprob = (float)-log(sum);
    }
    return best;
}

/* Sorts ids[0..n) ascending (distinct ids in [0, vocab)): insertion sort for a few, else an
 * LSD radix sort on 11-bit digits through tmp[n]; O(n + 2048) per digit, no allocation. */
static void sort_ids(int32_t *ids, int32_t n, int32_t vocab, int32_t *tmp)
{
    if (n <= 32) {
        for (int32_t i = 1; i < n; i++) {
            int32_t v = ids[i], j = i;
            for (; j > 0 && ids[j - 1] > v; j--) ids[j] = ids[j - 1];
            ids[j] = v;
        }
        return;
    }
    int32_t bucket[2048];
    int32_t *src = ids, *dst = tmp;
    for (int shift = 0; shift < 31 && (vocab - 1) >> shift > 0; shift += 11) {
        memset(bucket, 0, sizeof bucket);
        for (int32_t i = 0; i < n; i++) bucket[(src[i] >> shift) & 2047]++;
        for (int32_t b = 0, sum = 0; b < 2048; b++) {
            int32_t c = bucket[b];
            bucket[b] = sum;
            sum += c;
        }
        for (int32_t i = 0; i < n; i++) dst[bucket[(src[i] >> shift) & 2047]++] = src[i];
        int32_t *t = src;
        src = dst;
        dst = t;
    }
    if (src != ids) memcpy(ids, src, (size_t)n * sizeof *ids);
}

/* Candidates are ranked (best first) only when top-k or top-p needs an order. Min-p keeps
 * p >= min_p * p_max, which depends only on l - l_max, so it is the same before or after the
 * other filters renormalize. The draw then walks the kept candidates in ascending id order
 * (ranked ones are sorted back), so that the pick depends only on the kept set and its
 * probabilities, not on how it was found: a backend may walk its vocabulary in id order with
 * a prefix sum and pick the same token. */
int32_t smp_sample(const smp_params *p, float *logits, int32_t vocab, const int32_t *prompt,
                   int32_t n_prompt, const int32_t *output, int32_t n_output, smp_scratch *s,
                   float *logprob)
{
    PD_ASSERT(p && logits && s && vocab > 0 && vocab <= s->vocab, "smp_sample: bad arguments");
    PD_ASSERT((n_prompt == 0 || prompt) && (n_output == 0 || output), "smp_sample: no tokens");
    apply_penalties(p, logits, vocab, prompt, n_prompt, output, n_output, s);
    if (!(p->temperature >= SMP_GREEDY_EPS)) return sample_greedy(logits, vocab, logprob);

    float m = -INFINITY;
    for (int32_t i = 0; i < vocab; i++) {
        float v = logits[i] / p->temperature;
        if (isnan(v)) v = -INFINITY;
        logits[i] = v;
        if (v > m) m = v;
    }
    if (m == -INFINITY) return sample_greedy(logits, vocab, logprob);

    int32_t *idx = s->idx;
    float *prob = s->prob;
    int32_t k = p->top_k > 0 && p->top_k < vocab ? p->top_k : vocab;
    int32_t n = k;
    if (k < vocab || p->top_p < 1.0f) {
        select_top(logits, vocab, k, idx);
    } else {
        for (int32_t i = 0; i < vocab; i++) idx[i] = i;
    }
    double total = 0.0;
    for (int32_t i = 0; i < n; i++) {
        prob[i] = expf(logits[idx[i]] - m);
        total += prob[i];
    }
    if (p->top_p < 1.0f) {
        /* Keep the shortest best-first prefix holding top_p of the (top-k) mass. */
        double cut = (double)p->top_p * total, cum = 0.0;
        for (int32_t i = 0; i < n; i++) {
            cum += prob[i];
            if (cum >= cut) {
                n = i + 1;
                break;
            }
        }
    }
    if (p->min_p > 0.0f) {
        /* The best candidate has prob exp(0) = 1, so min_p * p_max is min_p itself. */
        int32_t kept = 0;
        for (int32_t i = 0; i < n; i++) {
            if (prob[i] >= p->min_p) {
                idx[kept] = idx[i];
                prob[kept] = prob[i];
                kept++;
            }
        }
        n = kept;
    }

    if (n > 1 && (k < vocab || p->top_p < 1.0f)) {
        /* Back to id order; each probability is recomputed exactly as before. */
        sort_ids(idx, n, vocab, s->count);
        for (int32_t i = 0; i < n; i++) prob[i] = expf(logits[idx[i]] - m);
    }
    total = 0.0;
    for (int32_t i = 0; i < n; i++) total += prob[i];
    double target = smp_uniform(p->seed, n_output) * total, cum = 0.0;
    int32_t pick = 0;
    for (int32_t i = 0; i < n; i++) {
        if (prob[i] > 0.0f) pick = i; /* rounding fallback: the last candidate with mass */
        cum += prob[i];
        if (target < cum) break;
    }
    int32_t tok = idx[pick];
    if (logprob) *logprob = (float)((double)logits[tok] - (double)m - log(total));
    return tok;
}

/* True when (va, a) ranks above (vb, b): a larger value, or an equal one and a smaller id. */
static inline bool ranks_above(float va, int32_t a, float vb, int32_t b)
{
    return va > vb || (va == vb && a < b);
}

/* One pass: the maximum for the log-sum-exp and an insertion list of the n_top best, whose
 * last entry is the bar a token must pass (a later id never wins a tie). A second pass sums
 * exp(l - max) in double. */
int32_t smp_logprobs(const float *logits, int32_t vocab, int32_t token, int32_t n_top,
                     float *logprob, pd_top_logprob *top)
{
    PD_ASSERT(logits && vocab > 0 && n_top >= 0 && n_top <= PD_MAX_TOP_LOGPROBS &&
                  (n_top == 0 || top),
              "smp_logprobs: bad arguments");
    float m = -INFINITY;
    int32_t n = 0;
    for (int32_t i = 0; i < vocab; i++) {
        const float v = logits[i];
        if (!(v > -INFINITY)) continue; /* -inf and NaN: no mass, never listed */
        if (v > m) m = v;
        if (n_top == 0 || (n == n_top && !(v > top[n - 1].logprob))) continue;
        int32_t j = n < n_top ? n++ : n - 1;
        for (; j > 0 && ranks_above(v, i, top[j - 1].logprob, top[j - 1].token); j--)
            top[j] = top[j - 1];
        top[j].token = i;
        top[j].logprob = v;
    }
    if (m == -INFINITY) {
        if (logprob) *logprob = -INFINITY;
        return 0;
    }
    double sum = 0.0;
    for (int32_t i = 0; i < vocab; i++)
        if (logits[i] > -INFINITY) sum += exp((double)logits[i] - (double)m);
    const double lse = (double)m + log(sum);
    for (int32_t j = 0; j < n; j++) top[j].logprob = (float)((double)top[j].logprob - lse);
    if (logprob) {
        const float v = token >= 0 && token < vocab ? logits[token] : NAN;
        *logprob = v > -INFINITY ? (float)((double)v - lse) : -INFINITY;
    }
    return n;
}

pd_sample_row smp_sample_row(const smp_params *p, int32_t n_output, int32_t pen_off,
                             int32_t pen_n)
{
    pd_sample_row r;
    memset(&r, 0, sizeof r);
    r.temperature = p->temperature;
    r.top_p = p->top_p;
    r.min_p = p->min_p;
    r.repetition_penalty = p->repetition_penalty;
    r.presence_penalty = p->presence_penalty;
    r.frequency_penalty = p->frequency_penalty;
    r.top_k = p->top_k;
    r.n_output = n_output;
    r.seed = p->seed;
    r.pen_off = pen_off;
    r.pen_n = pen_n;
    r.n_top = -1;
    return r;
}

/* The list means what apply_penalties does: the repetition penalty for every entry, the
 * frequency and presence penalties for entries with count > 0. A prompt-only token changes
 * nothing unless the repetition penalty is on, so then it is left out. */
bool smp_penalized(const smp_params *p)
{
    return p->repetition_penalty != 1.0f || p->frequency_penalty != 0.0f ||
           p->presence_penalty != 0.0f;
}

int32_t smp_penalty_list(const smp_params *p, const int32_t *prompt, int32_t n_prompt,
                         const int32_t *output, int32_t n_output, int32_t vocab,
                         smp_scratch *s, pd_penalty_tok *out)
{
    PD_ASSERT(p && s && out && vocab > 0 && vocab <= s->vocab, "smp_penalty_list: bad arguments");
    if (!smp_penalized(p)) return 0;
    const bool rep = p->repetition_penalty != 1.0f;
    uint32_t g = next_stamp(s);
    int32_t n = 0;
    for (int32_t i = 0; i < n_output; i++) {
        int32_t t = output[i];
        if (t < 0 || t >= vocab) continue;
        if (s->mark[t] != g) {
            s->mark[t] = g;
            s->count[t] = n; /* the token's entry */
            out[n].token = t;
            out[n].count = 0;
            n++;
        }
        out[s->count[t]].count++;
    }
    for (int32_t i = 0; rep && i < n_prompt; i++) {
        int32_t t = prompt[i];
        if (t < 0 || t >= vocab || s->mark[t] == g) continue;
        s->mark[t] = g;
        out[n].token = t;
        out[n].count = 0;
        n++;
    }
    return n;
}
