/* svc_tp_util.h -- for the tests of a tensor-parallel instance's KV staging (test_kvdev on
 * the CPU, test_cuda_tpkv on GPUs): stories260k opened as a prefill instance at a degree, and
 * the ranks' regions of a layer's K or V. */
#ifndef PD_TESTS_SVC_TP_UTIL_H
#define PD_TESTS_SVC_TP_UTIL_H

#include <stdint.h>
#include <stdio.h>

#include "svc/svc.h"
#include "tests/test_util.h"

/* n random bytes at p from the generator state *rng (an LCG; the bytes its top bits). */
static inline void svc_tp_fill_random(void *p, size_t n, uint64_t *rng)
{
    uint8_t *b = (uint8_t *)p;
    for (size_t i = 0; i < n; i++) {
        *rng = *rng * 6364136223846793005ull + 1442695040888963407ull;
        b[i] = (uint8_t)(*rng >> 56);
    }
}

/* stories260k on `backend` at tensor parallel n_tp, a KV pool of kv_mb MiB (threads: CPU
 * threads, 0 = the default), as a prefill instance. Returns svc_model_open's result. */
static inline int svc_tp_open_stories(const char *backend, int32_t n_tp, int64_t kv_mb,
                                      int32_t threads, svc_model *m, char *err)
{
    char dir[512];
    snprintf(dir, sizeof dir, "%s/models/stories260k", pd_test_shared_dir());
    svc_model_flags f;
    svc_model_flags_init(&f);
    f.model = dir;
    f.backend = backend;
    if (threads > 0) f.threads = threads;
    f.kv_cache_mb = kv_mb;
    f.tensor_parallel = n_tp;
    return svc_model_open(&f, ENG_MODE_PREFILL, m, err);
}

/* The ranks' regions of layer's K (kv 0) or V (kv 1) and their sizes in bytes. */
static inline void svc_tp_regions(svc_model *m, int32_t layer, int kv, void **reg, size_t *bytes)
{
    kvt_layout l;
    svc_kv_layout(m, &l);
    const int32_t N = mr_n_ranks(m->runner);
    for (int32_t r = 0; r < N; r++) {
        void *c[2];
        kvt_tp_part p;
        mr_kv_cache_rank(m->runner, r, layer, &c[0], &c[1]);
        kvt_tp_part_of(&l, N, r, &p);
        reg[r] = c[kv];
        bytes[r] = (size_t)mr_n_blocks(m->runner) * p.rank_block_bytes;
    }
}

#endif
