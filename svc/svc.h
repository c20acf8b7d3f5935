/* svc.h -- The instances' glue (prefill and decode): model and engine setup from flags, the
 * KV layout and pool, the server flags, the Instance service, the engine and KV-transfer
 * threads and the KV's device path; with svc_core.h (what the router shares) included.
 * Protobuf types stop here: nothing below the services sees them. */
#ifndef PD_SVC_H
#define PD_SVC_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "common/flags.h"
#include "common/rpc/rpc.h"
#include "engine/engine.h"
#include "engine/model.h"
#include "engine/model_runner.h"
#include "engine/tp.h"
#include "engine/worker.h"
#include "kvtransfer/kvtransfer.h"
#include "pdserve/internal/v1/instance.pb-c.h"
#include "pdserve/internal/v1/kv.pb-c.h"
#include "pdserve/v1/generation.pb-c.h"
#include "svc/svc_core.h"
#include "svc/svc_kvt.h"
#include "svc/svc_metrics.h"

/* ---- model and engine from flags ---- */

typedef struct {
    const char *model;          /* model directory */
    const char *model_name;     /* served name; default: the directory's last component */
    const char *backend;        /* auto | cpu | cuda */
    const char *load_format;    /* safetensors | dummy */
    int64_t threads;            /* CPU threads, 0 = all */
    int64_t block_size;         /* tokens per KV block */
    int64_t kv_cache_mb;        /* KV pool size; 0 = auto: gpu_memory_utilization on a backend
                                 * that reports device memory (CUDA), 256 MiB otherwise */
    double gpu_memory_utilization; /* auto KV sizing: share of the device's memory (0, 1] */
    int64_t max_num_seqs;
    int64_t max_num_batched_tokens;
    int64_t max_model_len;      /* 0 = the model's */
    bool no_prefix_cache;
    bool no_chunked_prefill;
    int64_t max_graph_batch;    /* decode steps up to this batch replay CUDA graphs; 0 = eager */
    bool enforce_eager;         /* same as max_graph_batch 0 */
    int64_t device;             /* GPU ordinal (cuda); with every GPU visible, the KV can go
                                 * device to device between instances (--kv-transport) */
    const char *quantization;   /* auto | none | fp8 (mc_set_quantization) */
    const char *kv_cache_dtype; /* auto | bf16 | fp8 (mr_kv_dtype_parse) */
    int64_t tensor_parallel;    /* ranks (one thread, on cuda one GPU from device on, each);
                                 * 1 = none (docs/tensor-parallel.md) */
} svc_model_flags;

/* Defaults, and the flag table entries (appended at flags[*n], at most 19). */
void svc_model_flags_init(svc_model_flags *f);
void svc_model_flags_add(svc_model_flags *f, pd_flag *flags, int *n);

typedef struct {
    mc_config cfg;
    tp_group *tp;               /* the ranks' backends and shards (one rank without TP) */
    pd_backend *be;             /* rank 0's (tp's) */
    pd_model *model;            /* rank 0's shard (tp's) */
    mr *runner;
    eng_params ep;
    char model_name[128];
    uint64_t fingerprint;       /* of config + weights identity (KV compatibility) */
    void *kvdev;                /* the device path's sender state (svc_kvdev.c), or NULL */
} svc_model;

/* Loads backend, weights and runner; fills ep for mode. Returns 0 or an error with err. */
int svc_model_open(const svc_model_flags *f, eng_mode mode, svc_model *out, char *err);
void svc_model_close(svc_model *m);
/* Registers pdserve_model_info{model, backend, quantization, kv_cache_dtype, tensor_parallel}
 * = 1 in reg (a pd_metrics registry: svc_metrics_registry). */
void svc_model_info_metric(const svc_model *m, void *reg);

/* The KV layout of the model (for kvtransfer and for the KvLayout message). */
void svc_kv_layout(const svc_model *m, kvt_layout *out);
/* Fills a KvLayout message (no allocation). */
void svc_kv_layout_to_proto(const svc_model *m, Pdserve__Internal__V1__KvLayout *out);
/* Checks the tensor-parallel fields of a peer's KvLayout (network input): the degree and KV
 * heads per rank must be a head mapping kvt_tp_heads knows. 0, or PD_EMISMATCH with msg. */
int svc_kv_layout_check_peer(const Pdserve__Internal__V1__KvLayout *l, char *msg, size_t n);
/* The name of a KvLayout dtype ("f32", "bf16", ...). */
const char *svc_kv_dtype_name(int proto_dtype);

/* ---- the KV pool that kvtransfer moves ---- */

/* Whether the KV cache lives outside host memory (the backend is not "cpu"): kvtransfer then
 * moves the device cache itself, device to device where the peer can map it, else through a
 * bounded ring of pinned host slots (--kv-staging-mb) with the backend's copy queue; on the
 * CPU the cache itself is registered (zero copy). The environment variable
 * PDSERVE_KV_STAGING=1 forces the staged path on the CPU (for tests). A tensor-parallel
 * instance's pool is always staged, on every backend: its copies gather the ranks' KV heads
 * into the whole layout and scatter them back, each rank with its own backend's copy queue
 * (copyq_rows; the layout of kvt_tp_gather / kvt_tp_scatter). */
bool svc_kv_staged(const svc_model *m);
/* kvt thread (during setup, before the engine runs; after svc_kv_device_params): creates
 * the kvtransfer pool of m's KV: the engine's cache itself (CPU), or when staged a staged
 * pool over the device cache (kvt_pool_params.staged) with its device export. Returns 0 or
 * an error with err. */
int svc_kv_pool_create(kvt_ctx *ctx, svc_model *m, kvt_pool **out, char *err);
/* kvt thread: destroys the pool (the engine thread must be stopped). NULL is a no-op. */
void svc_kv_pool_destroy(svc_model *m, kvt_pool *pool);

/* ---- server flags shared by prefill and decode ---- */

typedef struct {
    const char *listen;         /* gRPC listen address host:port */
    int64_t port;               /* >= 0: listen on 0.0.0.0:port instead */
    const char *instance_id;    /* "" = <role>@<listen> */
    const char *log_level;      /* error, warn, info, debug */
    int64_t default_max_tokens; /* max_tokens when a request sets none */
    int64_t grpc_threads;
    int64_t shutdown_grace_ms;  /* SIGTERM: time in-flight requests get */
    int64_t health_drain_ms;    /* SIGTERM: NOT_SERVING time before the listener closes */
    char listen_buf[64];        /* holds the address made from port */
    rpc_server_tls_flags tls;   /* --tls-cert, --tls-key, --tls-client-ca, handshake timeout */
    const char *kv_secret_file; /* shared secret of the internal KV (UCX) port; "" = none */
    const char *kv_transport;   /* auto | device | host: the KV's data path between GPUs */
    int64_t kv_staging_mb;      /* the staged path's ring of pinned host slots */
} svc_server_flags;

/* Defaults (default_listen e.g. "0.0.0.0:50061"), and the flag table entries (appended at
 * flags[*n], 14 of them). role names the instance in --instance-id's help. */
void svc_server_flags_init(svc_server_flags *f, const char *default_listen);
void svc_server_flags_add(svc_server_flags *f, pd_flag *flags, int *n, const char *role);
/* After parsing: applies --log-level, turns --port into the listen address, and keeps
 * --kv-secret-file for svc_kvt_start. */
void svc_server_flags_apply(svc_server_flags *f);

/* ---- the Instance service (LoadReport), served by prefill and decode ---- */

typedef struct {
    char instance_id[128];
    Pdserve__Internal__V1__Role role;
    const svc_model *model;   /* borrowed */
    ew *worker;               /* borrowed; must outlive the server */
    volatile int draining;    /* set on SIGTERM */
    void *metrics;            /* svc_metrics (borrowed, may be NULL): step times go there */
    _Atomic(rpc_server *) server; /* set by svc_serve once started (health) */
    atomic_int failed;        /* the engine failed a step: health NOT_SERVING from then on,
                                 load reports say failed (the router stops routing here) */
    atomic_int_fast64_t reserved_blocks; /* decode: blocks of reservations waiting for KV */
    atomic_int_fast64_t reservations;    /* decode: those reservations */
} svc_instance;

/* Registers /pdserve.internal.v1.Instance/LoadReport answering from inst (borrowed; must
 * outlive the server). Returns 0 or an rpc_server_register error. */
int svc_instance_register(rpc_server *s, svc_instance *inst, char *err);

/* When inst's engine failed, finishes call with UNAVAILABLE (a broken engine takes no new
 * work; the router retries elsewhere) and returns true; else false. For a handler's start. */
bool svc_instance_refuse_failed(svc_instance *inst, rpc_call *call);

/* ew_callbacks.on_step with step_arg = the svc_instance: step time and batch size to its
 * metrics. */
void svc_instance_on_step(void *inst, double seconds, int32_t n_seqs);
/* ew_callbacks.on_step_failed with step_arg = the svc_instance: marks the instance failed
 * (sticky): health reports NOT_SERVING for every service name, so that Kubernetes' probes
 * restart it, and load reports say failed, so that routers stop sending work here. */
void svc_instance_on_step_failed(void *inst, const char *msg);

/* ---- an instance's engine thread and KV-transfer thread ---- */

/* Creates the engine over m's runner with m->ep in mode `mode`, sets the KV listener kl (NULL:
 * none) and starts the engine thread with cb. Returns 0 or an error with err. */
int svc_engine_start(svc_model *m, eng_mode mode, const eng_kv_listener *kl,
                     const ew_callbacks *cb, ew **worker, char *err);
/* Starts the kvt thread (named, with the event callback on_event(arg, ...)) and creates the
 * kvtransfer pool of m's KV on it (svc_kv_pool_create). Returns 0 or an error with err. */
int svc_kvt_start(const char *name, kvt_event_fn on_event, void *arg, svc_model *m,
                  svc_kvt **kvt, kvt_pool **pool, char *err);
/* Destroys *pool on the kvt thread (then NULL), then the thread; after the engine thread
 * stopped. kvt NULL is a no-op. */
void svc_kvt_stop(svc_kvt *kvt, svc_model *m, kvt_pool **pool);

/* ---- the instance's metrics ---- */

/* Sources sampled at each scrape (any may be NULL; all borrowed, and must stay valid until
 * svc_metrics_stop). draining reads 1 once the service drains. Before svc_metrics_start. */
void svc_metrics_watch(svc_metrics *sm, rpc_server *server, ew *worker, svc_kvt *kvt,
                       const volatile int *draining);

/* ---- the KV's device path (svc/svc_kvdev.c) ----
 * With a backend that offers the dev_* / copyq ops (CUDA) and --kv-transport auto or device,
 * the decode pool carries an export of the device KV cache (CUDA IPC), and a prefill instance
 * that can map it writes each layer's blocks straight into the reserved device blocks, on a
 * copy stream ordered after the layer's event: no host copy, no wait on the engine thread.
 * Otherwise (CPU, other host, no peer access, --kv-transport host) the host pool moves it. */

/* Whether the backend has the copy queue (event_* and copyq_* ops) staged pools need; a
 * tensor-parallel instance's also needs copyq_rows (each rank's KV heads of a block). */
bool svc_kv_stage_ops(const svc_model *m);
/* Engine thread, in the layer hook of a prefill forward whose KV moves through the device
 * path or the staging ring (svc_kv_staged): fills after[0..n) with n handles of layer's
 * readiness for kvt_send_layer_ready_after, one for each request of the step. One rank: an
 * event recorded on the compute stream now, each. Tensor parallelism: one set of the events
 * every rank recorded on its own stream right after its store of the layer
 * (mr_layer_events), shared by the n handles; each rank's copies wait for its own. kvt
 * releases a handle it was given; svc_kv_ready_release releases one that was not. Returns
 * how many handles are NULL (could not be made; logged): their transfers then fail by their
 * deadlines. */
int svc_kv_layer_ready(svc_model *m, int32_t layer, int32_t n, void **after);
/* Releases a handle of svc_kv_layer_ready. NULL is a no-op. */
void svc_kv_ready_release(svc_model *m, void *h);
/* The strided copy (a backend's copyq_rows) that moves a tensor-parallel rank's heads of its
 * blocks ids[0..n) (p: kvt_tp_part_of) between its region (a layer's K or V) and a slot of n
 * whole-layout blocks (block i at slot + i * whole block bytes): slot <- region (gather) or
 * region <- slot. n <= 64 (a larger n gives a copy the op refuses). The staged pool's copies
 * on each rank; public for tests. */
pd_copy_rows svc_kv_tp_rows(const kvt_tp_part *p, void *region, const int32_t *ids, void *slot,
                            int32_t n, bool gather);
/* Whether the device path is on for m (backend ops present and --kv-transport not host). */
bool svc_kv_device_on(const svc_model *m);
/* Fills kvt_params.device (the copy queue is made on the kvt thread at first use): the device
 * path (sender) when it is on, the staged pool's copies when staged; and device_required
 * (--kv-transport device). Nothing when neither applies. */
void svc_kv_device_params(svc_model *m, kvt_params *kp);
/* The decode pool's device export for kvt_pool_params (malloc'ed; caller frees), or NULL
 * when the path is off. Returns 0 or an error with err. */
int svc_kv_device_export(const svc_model *m, void **blob, size_t *len, char *err);
/* Releases what svc_kv_device_params made (after the kvt ctx is destroyed). */
void svc_kv_device_free(svc_model *m);

#endif
