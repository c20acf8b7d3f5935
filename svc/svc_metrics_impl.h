/* svc_metrics_impl.h -- The metrics set's state, shared by svc_metrics.c (what every service
 * has, the router included) and svc_metrics_inst.c (the engine's and kvtransfer's counters,
 * which only the instances link). Not a public header. */
#ifndef PD_SVC_METRICS_IMPL_H
#define PD_SVC_METRICS_IMPL_H

#include <stdatomic.h>

#include "svc/svc_http.h"
#include "svc/svc_metrics.h"

#define N_OUTCOMES 17 /* gRPC status codes 0..16 */

struct svc_metrics {
    svc_metrics_params p;
    char role[32], dir[8], host[128];
    pd_metrics *reg;
    svc_http *http;
    /* sources (borrowed) */
    rpc_server *server;
    struct ew *worker;       /* the engine thread (svc_metrics_inst.c; opaque here) */
    struct svc_kvt *kvt;     /* the kvt thread (likewise) */
    void (*inst_collect)(svc_metrics *sm); /* the engine's and kvtransfer's counters
                                              (svc_metrics_inst.c), or NULL */
    const volatile int *draining;
    pd_metrics_collect_fn user_fn;
    void *user_arg;
    /* pushed from the services */
    pd_metric *requests[N_OUTCOMES];
    pd_metric *queue_time, *step_time, *batch, *kv_time, *kv_tail;
    /* sampled */
    pd_metric *draining_g, *running, *waiting, *kv_used, *kv_free, *kv_cap, *kv_usage, *queued;
    pd_metric *steps, *step_fail, *prompt_tok, *gen_tok, *preempt, *model_s, *hit, *query, *hit_ratio;
    pd_metric *forks, *fork_copies; /* n > 1 requests forked, partial blocks copied for them */
    pd_metric *choices_ended;       /* choices ended early by their caller (EndChoice) */
    pd_metric *reuse, *reuse_query;
    pd_metric *kv_bytes, *kv_ok, *kv_fail, *kv_active, *kv_ring, *kv_ring_used, *kv_ring_wait;
    pd_mfamily *kv_peers, *kv_info;
    pd_metric *calls, *calls_cancelled, *calls_live;
    pd_metric *proc_cpu, *proc_rss, *proc_vsize, *proc_fds, *proc_max_fds, *proc_start;
    atomic_bool proc_warned; /* a process figure could not be read (logged once) */
};

#endif
