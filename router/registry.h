/* registry.h -- The router's view of prefill and decode instances: addresses from flags or
 * DNS names (re-resolved periodically: a Kubernetes headless service gives one address per
 * pod), one gRPC channel each, load reports polled in the background, and the routing policy
 * (decode: most free KV blocks; prefill: least queued prompt tokens, with prefix affinity). */
#ifndef PD_ROUTER_REGISTRY_H
#define PD_ROUTER_REGISTRY_H

#include <stdbool.h>
#include <stdint.h>

#include "common/rpc/rpc.h"
#include "pdserve/internal/v1/instance.pb-c.h"

typedef struct rtr_registry rtr_registry;
typedef struct rtr_instance rtr_instance; /* reference counted; valid while referenced */

#define RTR_ADDR_LEN 128          /* "ip:port" and "host:port" strings, NUL included */

/* Resolves host (a DNS name or a literal address, IPv6 without brackets) and port into at
 * most max addresses written to out as "ip:port" ("[v6]:port"). Returns how many (>= 0), or a
 * negative error with err (PD_ERR_LEN) saying why; the registry then keeps the addresses the
 * name had. Runs on the registry's poller thread (and in rtr_registry_create) with no lock
 * held; it may block (DNS). */
typedef int (*rtr_resolve_fn)(void *arg, const char *host, const char *port,
                              char (*out)[RTR_ADDR_LEN], int max, char *err);

typedef struct {
    const char *prefill;          /* comma-separated host:port list (names re-resolved) */
    const char *decode;           /* the same for decode (or colocated) instances */
    int64_t poll_ms;              /* load report period */
    int64_t resolve_ms;           /* DNS re-resolution period */
    int64_t report_timeout_ms;    /* a load report slower than this marks the instance down */
    int64_t stall_ms;             /* no progress this long (a report asked for did not come
                                     back, or reports show its engine steps standing still
                                     with sequences running): the instance is stalled, picked
                                     last until it progresses again (0 = never) */
    rpc_client_tls tls;           /* TLS of the channels to instances (strings borrowed, must
                                     outlive the registry); ca_file unset = plaintext. Without
                                     server_name, each channel expects the host as written in
                                     the list (the DNS name, not the address it resolved to) */
    rtr_resolve_fn resolve;       /* NULL = getaddrinfo (tests inject a fake) */
    void *resolve_arg;            /* passed to resolve; borrowed, must outlive the registry */
    void (*on_poll)(void *arg);   /* optional: called on the poller thread after each round of
                                     load reports (no lock held), e.g. to update health */
    void *on_poll_arg;
} rtr_registry_params;

/* Defaults: no instances, poll 500 ms, resolve 10 s, report timeout 2 s, stall 1.4 s,
 * getaddrinfo. */
rtr_registry_params rtr_registry_default_params(void);

int rtr_registry_create(const rtr_registry_params *p, rtr_registry **out, char *err);
void rtr_registry_destroy(rtr_registry *r); /* NULL is a no-op */

/* Picks a decode instance (healthy, not draining, most free blocks net of what the router
 * has in flight there; a stalled one only when no other is up) and takes a reference on it;
 * NULL when none can serve. exclude (may be NULL) is skipped. */
rtr_instance *rtr_pick_decode(rtr_registry *r, const rtr_instance *exclude);
/* Picks a prefill instance whose KV layout equals layout (may be NULL: any), preferring the
 * one that last served the same prefix key when it is not much busier; NULL when none. */
/* After rtr_pick_prefill found none: true (and msg says which dtypes, block sizes and models
 * differ) when a healthy prefill instance was passed over only because its KV layout is not
 * layout. */
bool rtr_prefill_layout_mismatch(rtr_registry *r, const Pdserve__Internal__V1__KvLayout *layout,
                                 char *msg, size_t n);
rtr_instance *rtr_pick_prefill(rtr_registry *r, const Pdserve__Internal__V1__KvLayout *layout,
                               uint64_t prefix_key, int32_t n_prompt, const rtr_instance *exclude);
/* Remembers that prefix_key was prefilled on inst (by its id: inst may leave the registry
 * and be freed afterwards; the entry then matches nothing). inst NULL is a no-op. */
void rtr_note_prefix(rtr_registry *r, uint64_t prefix_key, rtr_instance *inst);
/* True when at least one prefill instance is configured (else decode computes prompts). */
bool rtr_has_prefill(rtr_registry *r);

void rtr_instance_ref(rtr_instance *i);
void rtr_instance_unref(rtr_instance *i);
rpc_channel *rtr_instance_channel(const rtr_instance *i);
const char *rtr_instance_addr(const rtr_instance *i);
bool rtr_instance_colocated(const rtr_instance *i);
/* Local in-flight accounting (routing uses it between load reports). */
void rtr_instance_add_load(rtr_instance *i, int64_t blocks, int64_t prompt_tokens);
/* Counts a failed call (marks the instance down until its next good load report). */
void rtr_instance_failed(rtr_instance *i);

/* Lookups that failed since start (each kept the name's last known addresses). */
int64_t rtr_registry_resolve_failures(rtr_registry *r);

/* Whether i made no progress for stall_ms (see rtr_registry_params): its requests should
 * move elsewhere. */
bool rtr_instance_stalled(rtr_registry *r, rtr_instance *i);
/* Instances stalled now (logs each one's changes). */
int rtr_registry_stalled(rtr_registry *r);

/* Decode (or colocated) instances other than exclude (may be NULL) that can take a request
 * now. */
int rtr_decode_usable(rtr_registry *r, const rtr_instance *exclude);
/* Prefill instances that can take a prompt now (up, healthy, not draining). */
int rtr_prefill_usable(rtr_registry *r);

/* Instances known (for logs and metrics): prefill, decode, and how many are up (reports
 * get through, not draining; stalled ones count: they may only be slow). */
void rtr_registry_counts(rtr_registry *r, int *n_prefill, int *n_decode, int *healthy);

/* One instance's state as the router sees it (metrics). */
typedef struct {
    char addr[128];               /* "ip:port" */
    const char *role;             /* "prefill", "decode" or "colocated" (static string) */
    bool up;                      /* last load report succeeded and no call failed since */
    bool draining;                /* the instance said so in its last report */
    int64_t free_blocks, total_blocks, running, waiting, queued_tokens; /* last report */
    int64_t routed;               /* requests (and retries) routed to it */
    int64_t errors;               /* failed calls and failed load reports */
    double prefill_rate;          /* prompt tokens/s in its last report (0 = none yet) */
} rtr_instance_info;

/* Copies the state of at most max instances into out; returns how many were copied. */
int rtr_registry_snapshot(rtr_registry *r, rtr_instance_info *out, int max);

/* Prompt tokens queued at i: its last report plus what was routed to it since. */
int64_t rtr_instance_backlog(rtr_registry *r, const rtr_instance *i);
/* The smallest prompt-token backlog of the usable prefill instances (INT64_MAX: none). */
int64_t rtr_prefill_backlog_min(rtr_registry *r);
/* The shortest time a prompt sent now would wait at a usable prefill instance: over those
 * instances, (its backlog as in rtr_prefill_backlog_min + extra_tokens) / the prefill rate
 * it reported, in seconds. -1 when there is none, or when one has not reported a rate yet
 * (a fresh instance, or one that predates the field): the caller falls back to tokens. */
double rtr_prefill_wait_min(rtr_registry *r, int64_t extra_tokens);
/* The TPOT (seconds) of a request that i decoded, into i's moving average (weight 0.2). */
void rtr_instance_note_tpot(rtr_registry *r, rtr_instance *i, double tpot);
/* i's moving average of TPOT in seconds (0 = no request finished on it yet). */
double rtr_instance_tpot(rtr_registry *r, const rtr_instance *i);

#endif
