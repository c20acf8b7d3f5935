/* backend.c -- Backend selection by name. */
#include "kernels/backend.h"

#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "common/log.h"
#ifdef PD_WITH_CUDA
#include "kernels/cuda/cuda_backend.h"
#endif

pd_backend_params pd_backend_default_params(void)
{
    pd_backend_params p = {.n_threads = 0, .device = 0};
    return p;
}

int pd_backend_create(const char *name, const pd_backend_params *p, pd_backend **out, char *err)
{
    *out = NULL;
    if (!name || strcmp(name, "auto") == 0) {
#ifdef PD_WITH_CUDA
        if (pd_backend_cuda_device_count() > 0) return pd_backend_cuda_create(p, out, err);
        PD_LOGI("backend auto: no CUDA device found, using cpu");
#endif
        return pd_backend_cpu_create(p, out, err);
    }
    if (strcmp(name, "cpu") == 0) return pd_backend_cpu_create(p, out, err);
    if (strcmp(name, "cuda") == 0) {
#ifdef PD_WITH_CUDA
        return pd_backend_cuda_create(p, out, err);
#else
        return pd_errf(err, PD_ENOTFOUND,
                       "backend \"cuda\" is not built in (configure with -DPD_CUDA=ON); use "
                       "--backend cpu");
#endif
    }
    return pd_errf(err, PD_ENOTFOUND, "unknown backend \"%s\" (known: auto, cpu, cuda)", name);
}

void pd_backend_destroy(pd_backend *b)
{
    if (!b) return;
    if (b->ops && b->ops->destroy) b->ops->destroy(b->ctx);
    free(b);
}
