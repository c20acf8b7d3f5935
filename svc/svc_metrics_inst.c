/* svc_metrics_inst.c -- The instances' part of the metrics set: the engine's counters (through
 * its worker) and kvtransfer's (through the kvt thread), sampled at each scrape. The router
 * does not link this file (it has neither). */
#include <string.h>

#include "svc/svc.h"
#include "svc/svc_metrics_impl.h"

static void collect_instance(svc_metrics *sm)
{
    if (sm->worker) {
        ew_load l;
        ew_load_get(sm->worker, &l);
        pd_metric_set(sm->running, l.n_running);
        pd_metric_set(sm->waiting, l.n_waiting);
        pd_metric_set(sm->kv_used, l.n_blocks - l.n_free_blocks);
        pd_metric_set(sm->kv_free, l.n_free_blocks);
        pd_metric_set(sm->kv_cap, l.n_blocks);
        pd_metric_set(sm->kv_usage, l.n_blocks ? (double)(l.n_blocks - l.n_free_blocks) / l.n_blocks : 0);
        pd_metric_set(sm->queued, (double)l.queued_prompt_tokens);
        const eng_stats *st = &l.stats;
        pd_metric_set(sm->steps, (double)st->steps);
        pd_metric_set(sm->step_fail, (double)l.n_step_failures);
        pd_metric_set(sm->prompt_tok, (double)st->prompt_tokens_computed);
        pd_metric_set(sm->gen_tok, (double)st->decode_tokens);
        pd_metric_set(sm->preempt, (double)st->preemptions);
        pd_metric_set(sm->forks, (double)st->forks);
        pd_metric_set(sm->fork_copies, (double)st->fork_cloned_blocks);
        pd_metric_set(sm->choices_ended, (double)st->choices_ended);
        pd_metric_set(sm->model_s, st->model_s);
        pd_metric_set(sm->hit, (double)st->cached_tokens);
        pd_metric_set(sm->query, (double)st->admitted_prompt_tokens);
        if (sm->reuse) {
            pd_metric_set(sm->reuse, (double)st->reserved_cached_tokens);
            pd_metric_set(sm->reuse_query, (double)st->reserved_prompt_tokens);
        }
        pd_metric_set(sm->hit_ratio, st->admitted_prompt_tokens
                                         ? (double)st->cached_tokens / (double)st->admitted_prompt_tokens
                                         : 0);
    }
    kvt_stats ks;
    if (sm->kvt && sm->dir[0] && svc_kvt_stats(sm->kvt, &ks) == 0) {
        bool send = !strcmp(sm->dir, "send");
        pd_metric_set(sm->kv_bytes, (double)(send ? ks.bytes_sent : ks.bytes_received));
        pd_metric_set(sm->kv_ok, (double)(send ? ks.sends_done : ks.recvs_done));
        pd_metric_set(sm->kv_fail, (double)(send ? ks.sends_failed : ks.recvs_failed));
        pd_metric_set(sm->kv_active, send ? ks.sends_active : ks.recvs_active);
        pd_metric_set(sm->kv_ring, ks.ring_slots);
        pd_metric_set(sm->kv_ring_used, ks.ring_slots - ks.ring_free);
        pd_metric_set(sm->kv_ring_wait, ks.ring_waiting);
        for (int t = 0; t < 5; t++) {
            char l[64] = "";
            pd_metrics_label(l, sizeof l, "transport", kvt_transport_name((kvt_transport)t));
            pd_metric_set(pd_mfamily_series(sm->kv_peers, l), ks.peers_by_transport[t]);
        }
        if (ks.last_transport != KVT_TRANSPORT_UNKNOWN) {
            char l[192] = "";
            pd_metrics_label(l, sizeof l, "transport", kvt_transport_name(ks.last_transport));
            pd_metrics_label(l, sizeof l, "resource", ks.last_transport_name);
            if (send) pd_metrics_label(l, sizeof l, "path", kvt_path_name(ks.last_path));
            pd_mfamily_hide_all(sm->kv_info);
            pd_metric_set(pd_mfamily_series(sm->kv_info, l), 1);
        }
    }
}

void svc_metrics_watch(svc_metrics *sm, rpc_server *server, ew *worker, svc_kvt *kvt,
                       const volatile int *draining)
{
    svc_metrics_watch_server(sm, server, draining);
    sm->worker = worker;
    sm->kvt = kvt;
    sm->inst_collect = collect_instance;
}
