/* svc_serve.c -- See svc_serve.h. */
#include "svc/svc_serve.h"

#include <stdio.h>

#include "common/error.h"
#include "common/log.h"

int svc_serve(const svc_serve_params *p, svc_instance *inst, svc_metrics *sm, svc_kvt *kvt,
              rpc_server **server, char *err)
{
    const svc_server_flags *sf = p->sf;
    rpc_server_params sp = rpc_server_default_params();
    sp.listen_addr = sf->listen;
    sp.n_threads = (int)sf->grpc_threads;
    sp.shutdown_grace_ms = (int)sf->shutdown_grace_ms;
    sp.health_drain_ms = (int)sf->health_drain_ms;
    rpc_server_tls_flags_apply(&sf->tls, &sp);
    if (p->stream_queue_max > 0) sp.stream_queue_max = p->stream_queue_max;
    int rc;
    if ((rc = rpc_server_create(&sp, server, err)) < 0 ||
        (rc = rpc_server_register(*server, p->service, p->method, p->kind, p->handler, NULL,
                                  err)) < 0 ||
        (p->unary_method && (rc = rpc_server_register(*server, p->service, p->unary_method,
                                                       RPC_UNARY, p->unary_handler, NULL,
                                                       err)) < 0) ||
        (rc = svc_instance_register(*server, inst, err)) < 0 ||
        (rc = rpc_server_start(*server, err)) < 0)
        return rc;
    if (sf->instance_id[0])
        snprintf(inst->instance_id, sizeof inst->instance_id, "%s", sf->instance_id);
    else
        snprintf(inst->instance_id, sizeof inst->instance_id, "%s@%s", p->role, sf->listen);
    PD_LOGI("pdserve-%s %s listening on port %d%s%s%s", p->role, inst->instance_id,
            rpc_server_port(*server), p->mode ? " (" : "", p->mode ? p->mode : "",
            p->mode ? ")" : "");
    atomic_store(&inst->server, *server);
    if (atomic_load(&inst->failed)) rpc_server_set_serving(*server, false); /* failed before */
    svc_metrics_watch(sm, *server, inst->worker, kvt, &inst->draining);
    if ((rc = svc_metrics_start(sm, err)) < 0) return rc;
    /* Ready: every listener is up (a metrics port clash fails before this line). */
    printf("PORT %d\n", rpc_server_port(*server));
    fflush(stdout);
    svc_metrics_announce(sm);
    int sig = svc_wait_signal();
    PD_LOGI("signal %d: draining (grace %lld ms)", sig, (long long)sf->shutdown_grace_ms);
    inst->draining = 1;
    int cancelled = rpc_server_shutdown(*server);
    PD_LOGI("drained; %d calls cancelled", cancelled);
    return 0;
}
