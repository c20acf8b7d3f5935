/* cpu_backend.h -- Internal declarations shared by the CPU backend's files. */
#ifndef PD_CPU_BACKEND_H
#define PD_CPU_BACKEND_H

#include "kernels/backend.h"

#include <stddef.h>

typedef struct {
    int32_t n_threads;   /* BLAS threads; 0 = library default */
    float *scratch;      /* attention scores + accumulator, grown on demand (rarely) */
    size_t scratch_cap;  /* elements in scratch */
} pd_cpu_ctx;

/* Paged causal attention on fp32 buffers; serves both prefill and decode batches. */
int pd_cpu__attention(void *ctx, const pd_attn_args *a);

#endif
