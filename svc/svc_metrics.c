/* svc_metrics.c -- Common service metrics and their scrape-time collectors (see
 * svc_metrics.h). Counters that the engine or kvtransfer keep themselves are copied into
 * the registry at each scrape, so that nothing is counted twice. */
#include "svc/svc_metrics.h"
#include "svc/svc_metrics_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "common/log.h"
#include "svc/svc_http.h"

#ifndef PD_VERSION
#define PD_VERSION "unknown"
#endif

void svc_metrics_flag_add(int64_t *port, pd_flag *flags, int *n)
{
    pd_flag f = {"metrics-port", PD_FLAG_INT, port,
                 "Prometheus /metrics HTTP port on the --listen host (-1 = off, 0 = any free port)",
                 -1, 65535};
    flags[(*n)++] = f;
}

const char *svc_outcome_name(int code)
{
    static const char *const names[N_OUTCOMES] = {
        "ok", "cancelled", "unknown", "invalid_argument", "deadline_exceeded", "not_found",
        "already_exists", "permission_denied", "resource_exhausted", "failed_precondition",
        "aborted", "out_of_range", "unimplemented", "internal", "unavailable", "data_loss",
        "unauthenticated"};
    return code >= 0 && code < N_OUTCOMES ? names[code] : "unknown";
}

/* The process_* families: what Prometheus client libraries export for their process, under
 * the same names, so that the usual dashboards and alerts work on pdserve's services too. */
static void process_families(svc_metrics *sm)
{
    pd_metrics *m = sm->reg;
    sm->proc_cpu = pd_metrics_counter(m, "process_cpu_seconds_total", NULL,
                                      "user and system CPU time of the process, seconds");
    sm->proc_rss = pd_metrics_gauge(m, "process_resident_memory_bytes", NULL,
                                    "resident memory of the process, bytes");
    sm->proc_vsize = pd_metrics_gauge(m, "process_virtual_memory_bytes", NULL,
                                      "virtual memory of the process, bytes");
    sm->proc_fds = pd_metrics_gauge(m, "process_open_fds", NULL, "open file descriptors");
    sm->proc_max_fds = pd_metrics_gauge(m, "process_max_fds", NULL,
                                        "most file descriptors the process may open (RLIMIT_NOFILE)");
    sm->proc_start = pd_metrics_gauge(m, "process_start_time_seconds", NULL,
                                      "start time of the process, seconds since the Unix epoch");
}

/* Samples the process_* families; a figure that cannot be read keeps its last value (the
 * first failure is logged once). */
static void process_collect(svc_metrics *sm)
{
    svc_process_stats ps;
    char err[PD_ERR_LEN];
    if (svc_process_stats_read(&ps, err) < 0 && !atomic_exchange(&sm->proc_warned, true))
        PD_LOGW("process metrics: %s", err);
    if (ps.cpu_seconds > 0) pd_metric_set(sm->proc_cpu, ps.cpu_seconds);
    if (ps.resident_bytes > 0) pd_metric_set(sm->proc_rss, ps.resident_bytes);
    if (ps.virtual_bytes > 0) pd_metric_set(sm->proc_vsize, ps.virtual_bytes);
    if (ps.open_fds > 0) pd_metric_set(sm->proc_fds, ps.open_fds);
    if (ps.max_fds > 0) pd_metric_set(sm->proc_max_fds, ps.max_fds);
    if (ps.start_time_seconds > 0) pd_metric_set(sm->proc_start, ps.start_time_seconds);
}

static void collect(pd_metrics *m, void *arg)
{
    svc_metrics *sm = arg;
    process_collect(sm);
    if (sm->draining) pd_metric_set(sm->draining_g, *sm->draining ? 1 : 0);
    if (sm->inst_collect) sm->inst_collect(sm);
    if (sm->server) {
        rpc_server_stats rs;
        rpc_server_stats_get(sm->server, &rs);
        pd_metric_set(sm->calls, (double)rs.calls_started);
        pd_metric_set(sm->calls_cancelled, (double)rs.calls_cancelled);
        pd_metric_set(sm->calls_live, (double)rpc_server_live_calls(sm->server));
    }
    if (sm->user_fn) sm->user_fn(m, sm->user_arg);
}

int svc_metrics_create(const svc_metrics_params *p, svc_metrics **out, char *err)
{
    *out = NULL;
    svc_metrics *sm = calloc(1, sizeof *sm);
    if (!sm || pd_metrics_create(&sm->reg) < 0) {
        free(sm);
        return pd_errf(err, PD_ENOMEM, "out of memory");
    }
    sm->p = *p;
    snprintf(sm->role, sizeof sm->role, "%s", p->role ? p->role : "");
    snprintf(sm->dir, sizeof sm->dir, "%s", p->kv_direction ? p->kv_direction : "");
    /* The host part of --listen ("0.0.0.0:50051", "[::1]:0", "127.0.0.1:0"). */
    const char *l = p->listen ? p->listen : "";
    const char *colon = strrchr(l, ':');
    snprintf(sm->host, sizeof sm->host, "%.*s", colon ? (int)(colon - l) : (int)strlen(l), l);
    sm->p.role = sm->role;
    sm->p.kv_direction = sm->dir;
    sm->p.listen = NULL;
    pd_metrics *m = sm->reg;
    char lb[128] = "";
    pd_metrics_label(lb, sizeof lb, "version", PD_VERSION);
    pd_metrics_label(lb, sizeof lb, "role", sm->role);
    pd_metric_set(pd_metrics_gauge(m, "pdserve_build_info", lb, "pdserve version and role (always 1)"), 1);
    sm->draining_g = pd_metrics_gauge(m, "pdserve_draining", NULL,
                                      "1 once SIGTERM was received and the service drains");
    pd_mfamily *req = pd_metrics_family(m, PD_METRIC_COUNTER, "pdserve_requests_total",
                                        "finished calls of the service's main RPC (router: Generate; "
                                        "prefill: Prefill; decode: Decode) by outcome (ok or the "
                                        "gRPC status, lower case)", NULL, 0);
    /* The usual outcomes exist from the start (at 0) so that rate() sees their first one. */
    static const int shown[] = {0, 1, 3, 4, 8, 13, 14};
    for (size_t i = 0; i < sizeof shown / sizeof shown[0]; i++) {
        char o[64] = "";
        pd_metrics_label(o, sizeof o, "outcome", svc_outcome_name(shown[i]));
        sm->requests[shown[i]] = pd_mfamily_series(req, o);
    }
    if (strcmp(sm->role, "router") != 0) {
        sm->queue_time = pd_metrics_histogram(m, "pdserve_request_queue_time_seconds", NULL,
                                              "time a request waited before the engine first scheduled it "
                                              "(decode-only: from the KV's arrival)",
                                              pd_metrics_latency_buckets, pd_metrics_n_latency_buckets);
        sm->running = pd_metrics_gauge(m, "pdserve_sequences_running", NULL, "sequences in the running batch");
        sm->waiting = pd_metrics_gauge(m, "pdserve_sequences_waiting", NULL, "sequences waiting to be scheduled");
        sm->kv_used = pd_metrics_gauge(m, "pdserve_kv_cache_used_blocks", NULL, "KV cache blocks in use");
        sm->kv_free = pd_metrics_gauge(m, "pdserve_kv_cache_free_blocks", NULL, "KV cache blocks free");
        sm->kv_cap = pd_metrics_gauge(m, "pdserve_kv_cache_capacity_blocks", NULL, "KV cache blocks in all");
        sm->kv_usage = pd_metrics_gauge(m, "pdserve_kv_cache_usage_ratio", NULL,
                                        "KV cache blocks in use / capacity (0..1)");
        sm->queued = pd_metrics_gauge(m, "pdserve_prefill_queued_tokens", NULL,
                                      "prompt tokens submitted and not computed yet");
        sm->steps = pd_metrics_counter(m, "pdserve_engine_steps_total", NULL, "engine steps that ran a forward");
        sm->step_fail = pd_metrics_counter(m, "pdserve_engine_step_failures_total", NULL,
                                           "engine steps that failed (the instance then reports "
                                           "NOT_SERVING: a failed step usually means a broken device)");
        sm->step_time = pd_metrics_histogram(m, "pdserve_engine_step_duration_seconds", NULL,
                                             "wall time of one engine step (schedule, forward, sample)",
                                             pd_metrics_step_buckets, pd_metrics_n_step_buckets);
        sm->batch = pd_metrics_histogram(m, "pdserve_engine_batch_sequences", NULL,
                                         "sequences in one engine step's batch",
                                         pd_metrics_batch_buckets, pd_metrics_n_batch_buckets);
        sm->prompt_tok = pd_metrics_counter(m, "pdserve_engine_prompt_tokens_total", NULL,
                                            "prompt (and recomputed) tokens run through the model");
        sm->gen_tok = pd_metrics_counter(m, "pdserve_engine_generation_tokens_total", NULL,
                                         "tokens computed as single-token decode steps");
        sm->preempt = pd_metrics_counter(m, "pdserve_engine_preemptions_total", NULL,
                                         "sequences preempted (recomputed later) for lack of KV blocks");
        sm->forks = pd_metrics_counter(m, "pdserve_engine_forks_total", NULL,
                                       "requests of n > 1 choices forked after their prompt (its "
                                       "full KV blocks shared by the choices)");
        sm->fork_copies = pd_metrics_counter(m, "pdserve_engine_fork_copied_blocks_total", NULL,
                                             "partial prompt KV blocks copied for forked choices "
                                             "(copy on write)");
        sm->choices_ended = pd_metrics_counter(m, "pdserve_engine_choices_ended_total", NULL,
                                               "choices of n > 1 requests ended early while the "
                                               "others went on (the router matched a stop "
                                               "string: Decode.EndChoice); their blocks freed");
        sm->model_s = pd_metrics_counter(m, "pdserve_engine_model_seconds_total", NULL,
                                         "time spent in the model's forward passes");
        sm->hit = pd_metrics_counter(m, "pdserve_prefix_cache_hit_tokens_total", NULL,
                                     "prompt tokens served from the prefix cache");
        sm->query = pd_metrics_counter(m, "pdserve_prefix_cache_query_tokens_total", NULL,
                                       "prompt tokens of admitted sequences (looked up in the prefix cache)");
        sm->hit_ratio = pd_metrics_gauge(m, "pdserve_prefix_cache_hit_ratio", NULL,
                                         "hit tokens / query tokens since start (use rate() of the "
                                         "counters for a window)");
        if (!strcmp(sm->dir, "recv")) {
            sm->reuse = pd_metrics_counter(m, "pdserve_kv_prefix_reused_tokens_total", NULL,
                                           "prompt tokens of KV reservations whose KV the decode "
                                           "instance already held (its prefix cache): not "
                                           "transferred");
            sm->reuse_query = pd_metrics_counter(m, "pdserve_kv_reserved_prompt_tokens_total",
                                                 NULL, "prompt tokens of KV reservations");
        }
    }
    if (sm->dir[0]) {
        char d[32] = "";
        pd_metrics_label(d, sizeof d, "direction", sm->dir);
        sm->kv_bytes = pd_metrics_counter(m, "pdserve_kv_transfer_bytes_total", d,
                                          "KV payload bytes of finished transfers");
        sm->kv_ok = pd_metrics_counter(m, "pdserve_kv_transfers_total", d, "KV transfers finished");
        sm->kv_fail = pd_metrics_counter(m, "pdserve_kv_transfer_failures_total", d,
                                         "KV transfers failed (peer gone, deadline, cancel, mismatch)");
        sm->kv_time = pd_metrics_histogram(m, "pdserve_kv_transfer_duration_seconds", d,
                                           "duration of one finished KV transfer (send: begin to "
                                           "acknowledgement; recv: first byte to done)",
                                           pd_metrics_step_buckets, pd_metrics_n_step_buckets);
        if (!strcmp(sm->dir, "send"))
            sm->kv_tail = pd_metrics_histogram(m, "pdserve_kv_transfer_exposed_tail_seconds", NULL,
                                               "the part of a KV transfer that does not overlap "
                                               "the prompt's computation: from the forward that "
                                               "completed the prompt to the decode side's "
                                               "acknowledgement that every block landed",
                                               pd_metrics_step_buckets, pd_metrics_n_step_buckets);
        sm->kv_active = pd_metrics_gauge(m, "pdserve_kv_transfers_active", d,
                                         "KV transfers in progress (recv: reservations)");
        sm->kv_ring = pd_metrics_gauge(m, "pdserve_kv_staging_slots", NULL,
                                       "slots of the staged KV path's ring of pinned host memory "
                                       "(--kv-staging-mb; 0 when the KV is host memory)");
        sm->kv_ring_used = pd_metrics_gauge(m, "pdserve_kv_staging_slots_in_use", NULL,
                                            "staging ring slots holding KV in flight");
        sm->kv_ring_wait = pd_metrics_gauge(m, "pdserve_kv_staging_waiting", NULL,
                                            "incoming KV messages waiting for a free staging slot "
                                            "(persistently > 0: raise --kv-staging-mb)");
        sm->kv_peers = pd_metrics_family(m, PD_METRIC_GAUGE, "pdserve_kv_transfer_peers",
                                         "live kvtransfer connections by UCX transport kind", NULL, 0);
        sm->kv_info = pd_metrics_family(m, PD_METRIC_GAUGE, "pdserve_kv_transport_info",
                                        "the UCX transport of the most recent kvtransfer connection "
                                        "(always 1; watch for tcp where shm or rdma is expected)", NULL, 0);
    }
    sm->calls = pd_metrics_counter(m, "pdserve_grpc_calls_total", NULL, "gRPC calls received (every method)");
    sm->calls_cancelled = pd_metrics_counter(m, "pdserve_grpc_calls_cancelled_total", NULL,
                                             "gRPC calls cancelled before they finished");
    sm->calls_live = pd_metrics_gauge(m, "pdserve_grpc_calls_in_flight", NULL, "gRPC calls alive now");
    process_families(sm);
    pd_metrics_set_collector(m, collect, sm);
    *out = sm;
    return 0;
}

pd_metrics *svc_metrics_registry(svc_metrics *sm) { return sm->reg; }

void svc_metrics_watch_server(svc_metrics *sm, rpc_server *server, const volatile int *draining)
{
    sm->server = server;
    sm->draining = draining;
}

void svc_metrics_set_collector(svc_metrics *sm, pd_metrics_collect_fn fn, void *arg)
{
    sm->user_fn = fn;
    sm->user_arg = arg;
}

int svc_metrics_start(svc_metrics *sm, char *err)
{
    if (sm->p.port < 0) return 0;
    int rc = svc_http_start(sm->reg, sm->host, (int)sm->p.port, &sm->http, err);
    if (rc < 0) return rc;
    PD_LOGI("metrics on http://%s:%d/metrics", sm->host[0] ? sm->host : "0.0.0.0",
            svc_http_port(sm->http));
    return 0;
}

void svc_metrics_announce(const svc_metrics *sm)
{
    if (!sm || !sm->http) return;
    printf("METRICS_PORT %d\n", svc_http_port(sm->http));
    fflush(stdout);
}

int svc_metrics_port(const svc_metrics *sm) { return sm && sm->http ? svc_http_port(sm->http) : -1; }

void svc_metrics_stop(svc_metrics *sm)
{
    if (!sm) return;
    svc_http_stop(sm->http);
    sm->http = NULL;
}

void svc_metrics_destroy(svc_metrics *sm)
{
    if (!sm) return;
    svc_metrics_stop(sm);
    pd_metrics_destroy(sm->reg);
    free(sm);
}

void svc_metrics_request(svc_metrics *sm, int code)
{
    if (!sm) return;
    if (code < 0 || code >= N_OUTCOMES) code = RPC_STATUS_UNKNOWN;
    pd_metric *s = sm->requests[code];
    if (!s) {
        char o[64] = "";
        pd_metrics_label(o, sizeof o, "outcome", svc_outcome_name(code));
        s = pd_metrics_counter(sm->reg, "pdserve_requests_total", o, NULL);
    }
    pd_metric_add(s, 1);
}

void svc_metrics_queue_time(svc_metrics *sm, double seconds)
{
    if (sm) pd_metric_observe(sm->queue_time, seconds);
}

void svc_metrics_kv_transfer(svc_metrics *sm, double seconds)
{
    if (sm) pd_metric_observe(sm->kv_time, seconds);
}

void svc_metrics_on_step(void *arg, double seconds, int32_t n_seqs)
{
    svc_metrics *sm = arg;
    if (!sm) return;
    pd_metric_observe(sm->step_time, seconds);
    pd_metric_observe(sm->batch, n_seqs);
}

void svc_metrics_kv_path(svc_metrics *sm, const char *path)
{
    if (!sm || !sm->dir[0]) return;
    char l[64] = "";
    pd_metrics_label(l, sizeof l, "path", path);
    pd_metric_add(pd_metrics_counter(sm->reg, "pdserve_kv_transfers_by_path_total", l,
                                     "KV transfers finished, by data path (device: device to "
                                     "device; put, am: through host memory)"), 1);
}

void svc_metrics_kv_tail(svc_metrics *sm, double seconds)
{
    if (sm) pd_metric_observe(sm->kv_tail, seconds);
}
