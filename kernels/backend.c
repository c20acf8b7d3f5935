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

int pd_comm_create(pd_backend *const *ranks, int32_t n_ranks, pd_comm **out, char *err)
{
    *out = NULL;
    if (n_ranks < 1 || !ranks || !ranks[0])
        return pd_errf(err, PD_EINVAL, "communicator: %d ranks", n_ranks);
    for (int32_t r = 1; r < n_ranks; r++)
        if (!ranks[r] || ranks[r]->ops != ranks[0]->ops)
            return pd_errf(err, PD_EINVAL, "communicator: rank %d is not a %s backend", r,
                           ranks[0]->ops->name);
    if (!ranks[0]->ops->comm_create)
        return pd_errf(err, PD_EUNSUPPORTED, "the %s backend has no communicator (tensor "
                       "parallelism)", ranks[0]->ops->name);
    return ranks[0]->ops->comm_create(ranks, n_ranks, out, err);
}

void pd_comm_destroy(pd_comm *c)
{
    if (!c) return;
    if (c->ops && c->ops->destroy) c->ops->destroy(c->ctx);
    free(c);
}
