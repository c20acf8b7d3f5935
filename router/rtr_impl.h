/* rtr_impl.h -- What router_main.c (flags, setup, metrics, main) and rtr_request.c (a
 * request's life: the public call, its internal calls, the prefill gate, migration and the
 * stall watch) share: the router's state (one per process, g) and the request side's entry
 * points. Internal to router/. */
#ifndef PD_RTR_IMPL_H
#define PD_RTR_IMPL_H

/* The headers both files use; each includes only what it needs beyond these. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "common/log.h"
#include "common/metrics.h"
#include "common/rpc/rpc.h"
#include "router/registry.h"
#include "svc/svc_auth.h"
#include "svc/svc_core.h"
#include "svc/svc_metrics.h"
#include "text/chat_template.h"
#include "text/model_config.h"
#include "text/tokenizer.h"

/* GenerateRequest.n at most (the engine's ENG_MAX_CHOICES). */
#define RTR_MAX_CHOICES 16

typedef struct {
    mc_config cfg;
    tok_tokenizer *tok;
    char model_name[128];
    rtr_registry *reg;
    rpc_server *server;
    void *chat;                      /* chat_template * (GenerateRequest.messages), or NULL */
    int64_t default_max_tokens;
    int64_t max_pending;
    int64_t call_timeout_ms;
    atomic_int_fast64_t pending;
    atomic_uint_fast64_t next_id;
    volatile int draining;
    double slo_ttft_s, slo_tpot_s;   /* 0 = no objective */
    int prefill_policy;              /* PREFILL_AUTO / _REMOTE / _LOCAL (--prefill-policy) */
    int64_t local_max_tokens;        /* auto: prompts this short prefill on the decode side */
    int64_t prefill_busy_tokens;     /* auto: prefill backlog from which the decode side
                                        prefills when its own backlog is far smaller */
    int64_t prefill_queue_tokens;    /* reserve late: prompt tokens admitted per prefill
                                        instance (0 = no gate) */
    double busy_tpot_fraction;       /* auto: the busy rule only while the decode instance's
                                        TPOT is below this fraction of --slo-tpot-ms */
    double busy_ttft_fraction;       /* auto, with --slo-ttft-ms: the prefill pool is busy when
                                        a prompt would wait there this fraction of the TTFT
                                        objective (0: --prefill-busy-tokens decides) */
    pd_metric *m_gate_waiting, *m_gate_admitted, *m_gate_wait;
    pd_mfamily *m_where;             /* prefill decisions by where and why */
    svc_metrics *metrics;
    pd_metric *m_ttft, *m_tpot, *m_e2e, *m_prompt, *m_completion, *m_slo, *m_in_flight;
    pd_metric *m_retry_prefill, *m_retry_decode, *m_dns_fail;
    int64_t max_migrations;          /* --max-migrations: restarts of one request elsewhere */
    char caller_token[160];          /* x-pdserve-caller of the internal calls ("" = none) */
    pd_mfamily *m_migrations;        /* pdserve_router_migrations_total{reason} */
    pd_mfamily *m_success;           /* by finish_reason */
    pd_mfamily *m_inst[10];           /* per-instance families (collector) */
} router;


/* --prefill-policy */
enum { PREFILL_AUTO = 0, PREFILL_REMOTE, PREFILL_LOCAL };

extern router g;

/* The public API's handlers (registered by main on the Generation service). */
void rtr_handle_generate(rpc_call *call, const ProtobufCMessage *msg, void *user);
void rtr_handle_tokenize(rpc_call *call, const ProtobufCMessage *msg, void *user);
void rtr_handle_model_info(rpc_call *call, const ProtobufCMessage *msg, void *user);

/* Starts the request side's threads: the prefill gate's dispatcher (when
 * g.prefill_queue_tokens > 0) and the stall watcher. Returns 0, or PD_ENOMEM with err. */
int rtr_requests_start(char *err);
/* Stops them (after the server drained: every waiting call was admitted or cancelled).
 * Idempotent; also after a failed or no start. */
void rtr_requests_stop(void);
/* The prefill gate's requests waiting and prompt tokens admitted (metrics, at scrape time). */
void rtr_gate_counts(int64_t *waiting, int64_t *admitted);

#endif
