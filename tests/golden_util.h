/* golden_util.h -- Test helpers: load a model directory on the CPU backend, read golden.json
 * cases (HF transformers outputs) with jansson. Header-only, for test executables. */
#ifndef PD_GOLDEN_UTIL_H
#define PD_GOLDEN_UTIL_H

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "common/json_util.h"
#include "engine/generate.h"
#include "engine/model.h"
#include "engine/model_runner.h"
#include "kernels/backend.h"
#include "tests/test_util.h"

typedef struct {
    pd_backend *be;
    pd_model *m;
    mr *r;
} tg_model;

/* Loads dir's weights onto be (owned by t from here on, also on failure: tg_close frees it)
 * and creates a runner with mp. Returns 0 or an error with err. */
/* tg_open_on with --quantization quant (NULL: the checkpoint's). */
static inline int tg_open_quant(const char *dir, const char *quant, const mr_params *mp,
                                pd_backend *be, tg_model *t, char *err)
{
    mc_config cfg;
    memset(t, 0, sizeof *t);
    t->be = be;
    int rc;
    if ((rc = mc_load(dir, &cfg, err)) < 0 ||
        (quant && (rc = mc_set_quantization(&cfg, quant, err)) < 0) ||
        (rc = pd_model_load(&cfg, dir, PD_LOAD_SAFETENSORS, 0, be, &t->m, err)) < 0 ||
        (rc = mr_create(mp, t->m, &t->r, err)) < 0)
        return rc;
    return 0;
}

static inline int tg_open_on(const char *dir, const mr_params *mp, pd_backend *be, tg_model *t,
                             char *err)
{
    return tg_open_quant(dir, NULL, mp, be, t, err);
}

static inline int tg_open(const char *dir, const mr_params *mp, tg_model *t)
{
    char err[PD_ERR_LEN];
    pd_backend *be = NULL;
    memset(t, 0, sizeof *t);
    if (pd_backend_create("cpu", NULL, &be, err) < 0 || tg_open_on(dir, mp, be, t, err) < 0) {
        fprintf(stderr, "cannot open %s: %s\n", dir, err);
        return -1;
    }
    return 0;
}

static inline void tg_close(tg_model *t)
{
    mr_destroy(t->r);
    pd_model_destroy(t->m);
    pd_backend_destroy(t->be);
    memset(t, 0, sizeof *t);
}

/* Copies a JSON array of integers into a new int32 array (caller frees); returns length. */
static inline int32_t tg_ids(const json_t *arr, int32_t **out)
{
    int32_t n = (int32_t)json_array_size(arr);
    *out = malloc((size_t)(n ? n : 1) * sizeof(int32_t));
    for (int32_t i = 0; i < n; i++) (*out)[i] = (int32_t)json_integer_value(json_array_get(arr, (size_t)i));
    return n;
}

/* Greedy request with the given prompt. */
static inline gen_request tg_greedy(const int32_t *prompt, int32_t n, int32_t max_tokens)
{
    gen_request q;
    memset(&q, 0, sizeof q);
    q.prompt = prompt;
    q.n_prompt = n;
    q.sampling = smp_default_params();
    q.sampling.temperature = 0;
    q.max_tokens = max_tokens;
    q.ignore_eos = true;
    return q;
}

/* Golden case cs's greedy tokens by the margin rule: each step's token equals the
 * reference's while the reference's margin (top-1 over top-2 logit) is at least margin_min; a
 * smaller margin ends the comparison (another argmax is as valid there). Returns the tokens
 * compared. */
static inline int tg_check_greedy(tg_model *t, const json_t *cs, const char *name, int ci,
                                  double margin_min)
{
    int32_t *prompt, *ref;
    const int32_t n = tg_ids(json_object_get(cs, "prompt_ids"), &prompt);
    const int32_t nref = tg_ids(json_object_get(cs, "greedy_ids"), &ref);
    const json_t *margins = json_object_get(cs, "greedy_margins");
    gen_request q = tg_greedy(prompt, n, nref);
    gen_result res;
    char err[PD_ERR_LEN];
    int compared = 0;
    const int rc = gen_run(t->r, t->m, &q, 1, &res, NULL, err);
    CHECK_MSG(rc == 0, "%s case %d: %s", name, ci, err);
    if (rc == 0) {
        CHECK_EQ_INT(res.n_tokens, nref);
        for (int32_t i = 0; i < nref && i < res.n_tokens; i++) {
            if (json_number_value(json_array_get(margins, (size_t)i)) < margin_min) break;
            CHECK_MSG(res.tokens[i] == ref[i], "%s case %d step %d: got %d, reference %d", name,
                      ci, i, res.tokens[i], ref[i]);
            compared++;
            if (res.tokens[i] != ref[i]) break;
        }
        gen_results_free(&res, 1);
    }
    free(prompt);
    free(ref);
    return compared;
}

#endif
