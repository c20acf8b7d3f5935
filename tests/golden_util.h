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

typedef struct {
    pd_backend *be;
    pd_model *m;
    mr *r;
} tg_model;

/* Loads dir's weights onto be (owned by t from here on, also on failure: tg_close frees it)
 * and creates a runner with mp. Returns 0 or an error with err. */
static inline int tg_open_on(const char *dir, const mr_params *mp, pd_backend *be, tg_model *t,
                             char *err)
{
    mc_config cfg;
    memset(t, 0, sizeof *t);
    t->be = be;
    int rc;
    if ((rc = mc_load(dir, &cfg, err)) < 0 ||
        (rc = pd_model_load(&cfg, dir, PD_LOAD_SAFETENSORS, 0, be, &t->m, err)) < 0 ||
        (rc = mr_create(mp, t->m, &t->r, err)) < 0)
        return rc;
    return 0;
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

#endif
