/* svc_metrics.h -- The metrics every pdserve service exports (docs/deploy.md lists them):
 * a registry with the common families (the process_* ones included), the /metrics HTTP endpoint on --metrics-port, and
 * collectors that sample, at each scrape, the engine's load snapshot (ew_load_get), the KV
 * transfer counters (svc_kvt_stats, read on the kvt thread) and the gRPC server's counters.
 * Services add their own families to svc_metrics_registry() and count request outcomes with
 * svc_metrics_request(). */
#ifndef PD_SVC_METRICS_H
#define PD_SVC_METRICS_H

#include <stdbool.h>
#include <stdint.h>

#include "common/flags.h"
#include "common/metrics.h"
#include "common/rpc/rpc.h"

typedef struct svc_metrics svc_metrics; /* opaque */

typedef struct {
    const char *role;           /* "router", "prefill", "decode" or "colocated" (build_info) */
    const char *kv_direction;   /* "send" (prefill) or "recv" (decode); NULL = no KV metrics */
    const char *listen;         /* the service's gRPC address: /metrics binds its host */
    int64_t port;               /* --metrics-port: -1 = no endpoint, 0 = any free port */
} svc_metrics_params;

/* The --metrics-port flag (appended at flags[*n]); *port's value is its default. */
void svc_metrics_flag_add(int64_t *port, pd_flag *flags, int *n);

/* Creates the registry with the common families (nothing is served yet). p is copied.
 * Returns 0 or PD_ENOMEM with err. */
int svc_metrics_create(const svc_metrics_params *p, svc_metrics **out, char *err);
/* The registry, for a service's own families (valid until svc_metrics_destroy). */
pd_metrics *svc_metrics_registry(svc_metrics *sm);

/* The same for a service without an engine (the router): only the server and draining;
 * part of the core that does not link the engine or kvtransfer. */
void svc_metrics_watch_server(svc_metrics *sm, rpc_server *server, const volatile int *draining);
/* A service's own collector, run at each scrape after the common ones (fn NULL: none). */
void svc_metrics_set_collector(svc_metrics *sm, pd_metrics_collect_fn fn, void *arg);

/* Starts the HTTP endpoint when the port is >= 0. Returns 0 (also when off), or PD_EIO /
 * PD_EINVAL with err. A service starts it before it says it is ready ("PORT <n>"), then
 * announces it. */
int svc_metrics_start(svc_metrics *sm, char *err);
/* Prints "METRICS_PORT <n>" on stdout when the endpoint runs (after the service's PORT line). */
void svc_metrics_announce(const svc_metrics *sm);
/* The bound port, or -1 when no endpoint runs. */
int svc_metrics_port(const svc_metrics *sm);
/* Stops the endpoint (the sources are not read after it returns). NULL / repeat: no-op. */
void svc_metrics_stop(svc_metrics *sm);
/* Stops and frees everything. NULL is a no-op. */
void svc_metrics_destroy(svc_metrics *sm);

/* The outcome label for a gRPC status: "ok", "cancelled", "deadline_exceeded", ... */
const char *svc_outcome_name(int rpc_code);
/* Counts one finished call of the service's main RPC in pdserve_requests_total{outcome}. */
void svc_metrics_request(svc_metrics *sm, int rpc_code);
/* The process's own figures, exported at every scrape as the process_* families of the
 * Prometheus client conventions (docs/deploy.md). */
typedef struct {
    double cpu_seconds;         /* user + system CPU time since the start, s */
    double resident_bytes;      /* resident set size, bytes */
    double virtual_bytes;       /* virtual memory size, bytes */
    double open_fds;            /* open file descriptors */
    double max_fds;             /* RLIMIT_NOFILE's soft limit (RLIM_INFINITY as it is) */
    double start_time_seconds;  /* when the process started, Unix seconds (clock ticks) */
} svc_process_stats;
/* Reads them from /proc/self/stat (CPU time, memory, start time after /proc/stat's btime),
 * /proc/self/fd and getrlimit. Returns 0, or PD_EIO with err naming what could not be read
 * (*out then holds what could). (svc_process.c) */
int svc_process_stats_read(svc_process_stats *out, char *err);

/* Observes one request's queue time (eng_output.queue_s) in seconds. */
void svc_metrics_queue_time(svc_metrics *sm, double seconds);
/* Observes one finished KV transfer's duration (kvt_event elapsed_ns) in seconds. */
void svc_metrics_kv_transfer(svc_metrics *sm, double seconds);
/* Observes one transfer's exposed tail in seconds (send side: the prompt's last forward done
 * to the decode side's acknowledgement). */
void svc_metrics_kv_tail(svc_metrics *sm, double seconds);
/* Counts one finished KV transfer by its data path ("device", "put", "am") in
 * pdserve_kv_transfers_by_path_total{path}. */
void svc_metrics_kv_path(svc_metrics *sm, const char *path);
/* ew_callbacks.on_step (step_arg = the svc_metrics): engine step time and batch size. */
void svc_metrics_on_step(void *sm, double seconds, int32_t n_seqs);

#endif
