/* svc.c -- Model setup, the KV pool, server flags, LoadReport, the engine and kvt threads of
 * the instances (the conversions and signals the router shares are in svc_proto.c). */
#include "svc/svc.h"

#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/env.h"
#include "common/error.h"
#include "common/log.h"
#include "svc/svc_metrics.h"

void svc_model_flags_init(svc_model_flags *f)
{
    memset(f, 0, sizeof *f);
    f->model = "../shared/models/stories260k";
    f->model_name = "";
    f->backend = "auto";
    f->load_format = "safetensors";
    f->block_size = 16;
    f->kv_cache_mb = 0;
    f->gpu_memory_utilization = 0.9;
    f->max_num_seqs = 256;
    f->max_num_batched_tokens = 2048;
    f->max_graph_batch = 256;
    f->tensor_parallel = 1;
    f->quantization = "auto";
    f->kv_cache_dtype = "auto";
}

void svc_model_flags_add(svc_model_flags *f, pd_flag *fl, int *n)
{
    pd_flag add[] = {
        {"model", PD_FLAG_STRING, &f->model, "HuggingFace model directory", 1, 0},
        {"model-name", PD_FLAG_STRING, &f->model_name, "name served in GetModelInfo (default: directory name)", 1, 0},
        {"backend", PD_FLAG_STRING, &f->backend, "compute backend: auto, cpu, cuda", 1, 0},
        {"load-format", PD_FLAG_STRING, &f->load_format, "safetensors, or dummy (random weights)", 1, 0},
        {"threads", PD_FLAG_INT, &f->threads, "CPU threads for matrix products (0 = all)", 0, 1024},
        {"block-size", PD_FLAG_INT, &f->block_size, "tokens per KV block (same on prefill and decode)", 1, 1024},
        {"kv-cache-mb", PD_FLAG_INT, &f->kv_cache_mb, "KV cache size in MiB (0 = auto: from --gpu-memory-utilization on a GPU, 256 on the CPU)", 0, 1 << 24},
        {"gpu-memory-utilization", PD_FLAG_DOUBLE, &f->gpu_memory_utilization, "share of the GPU's memory this process may fill (weights, workspace, KV cache) when --kv-cache-mb is 0, (0, 1]", 0.001, 1},
        {"max-num-seqs", PD_FLAG_INT, &f->max_num_seqs, "sequences per engine step", 1, 65536},
        {"max-num-batched-tokens", PD_FLAG_INT, &f->max_num_batched_tokens, "tokens per engine step", 16, 1 << 20},
        {"max-model-len", PD_FLAG_INT, &f->max_model_len, "longest sequence (0 = the model's)", 0, 1 << 24},
        {"no-prefix-cache", PD_FLAG_BOOL, &f->no_prefix_cache, "disable prefix caching", 1, 0},
        {"no-chunked-prefill", PD_FLAG_BOOL, &f->no_chunked_prefill, "disable chunked prefill", 1, 0},
        {"max-graph-batch", PD_FLAG_INT, &f->max_graph_batch, "decode steps of up to this many sequences replay CUDA graphs captured at start (0 = none)", 0, 65536},
        {"enforce-eager", PD_FLAG_BOOL, &f->enforce_eager, "run every step op by op (no CUDA graphs; for debugging)", 1, 0},
        {"device", PD_FLAG_INT, &f->device, "GPU ordinal for --backend cuda (instances that see every GPU can move KV device to device; see --kv-transport)", 0, 1023},
        {"quantization", PD_FLAG_STRING, &f->quantization, "weights: auto (the checkpoint's quantization_config: FP8 compressed-tensors or block-wise fp8), none, or fp8 (an unquantized checkpoint's linears quantized per channel at load, activations per token); docs/quantization.md", 1, 0},
        {"kv-cache-dtype", PD_FLAG_STRING, &f->kv_cache_dtype, "KV cache element type: auto (fp8 when the checkpoint has a kv_cache_scheme, else bf16), bf16 (the backend's own: f32 on the CPU), or fp8 (e4m3 with the checkpoint's k/v scales, else 1); prefill and decode instances must agree", 1, 0},
        {"tensor-parallel", PD_FLAG_INT, &f->tensor_parallel, "ranks the model is split over (one thread a rank; on cuda GPUs --device .. --device + N - 1, NCCL between them); the attention heads and the MLP must divide", 1, 64},
    };
    for (size_t i = 0; i < sizeof add / sizeof add[0]; i++) fl[(*n)++] = add[i];
}

int svc_model_open(const svc_model_flags *f, eng_mode mode, svc_model *m, char *err)
{
    memset(m, 0, sizeof *m);
    int rc;
    pd_load_format fmt;
    if (!strcmp(f->load_format, "safetensors")) fmt = PD_LOAD_SAFETENSORS;
    else if (!strcmp(f->load_format, "dummy")) fmt = PD_LOAD_DUMMY;
    else return pd_errf(err, PD_EINVAL, "unknown --load-format '%s' (safetensors, dummy)", f->load_format);
    if ((rc = mc_load(f->model, &m->cfg, err)) < 0) return rc;
    if ((rc = mc_set_quantization(&m->cfg, f->quantization, err)) < 0) return rc;
    mr_kv_type kvt;
    if (mr_kv_dtype_parse(f->kv_cache_dtype, &kvt) < 0)
        return pd_errf(err, PD_EINVAL, "unknown --kv-cache-dtype '%s' (auto, bf16, fp8)",
                       f->kv_cache_dtype);
    pd_backend_params bp = pd_backend_default_params();
    bp.n_threads = (int32_t)f->threads;
    bp.device = (int32_t)f->device;
    /* "auto" picks cuda where present (pd_backend_create decides). GPU KV reaches kvtransfer
     * device to device or through a ring of pinned host slots (svc_kv_pool_create). */
    const char *backend = f->backend;
    /* One backend and one weight shard a rank (--tensor-parallel; one rank: the whole model);
     * m->be and m->model are rank 0's. */
    tp_group_params gp = {.backend = backend, .bp = bp, .n_ranks = (int32_t)f->tensor_parallel,
                          .cfg = &m->cfg, .dir = f->model, .fmt = fmt, .seed = 1234};
    if ((rc = tp_group_load(&gp, &m->tp, err)) < 0) goto fail;
    m->be = m->tp->be[0];
    m->model = m->tp->models[0];
    mr_params mp = mr_default_params();
    mp.block_size = (int32_t)f->block_size;
    mp.kv_dtype = kvt;
    /* --kv-cache-mb 0: on a backend that reports device memory the runner sizes the pool from
     * it after the weights and its workspace are allocated; 256 MiB elsewhere. */
    if (f->kv_cache_mb > 0) mp.kv_cache_bytes = f->kv_cache_mb << 20;
    else mp.kv_cache_bytes = m->be->ops->mem_info ? 0 : 256ll << 20;
    mp.gpu_memory_utilization = f->gpu_memory_utilization;
    mp.max_num_seqs = (int32_t)f->max_num_seqs;
    mp.max_num_batched_tokens = (int32_t)f->max_num_batched_tokens;
    /* A prefill instance never runs a decode step: no graphs to capture. */
    mp.max_graph_batch = f->enforce_eager || mode == ENG_MODE_PREFILL ? 0
                                                                      : (int32_t)f->max_graph_batch;
    if ((rc = mr_create_tp(&mp, (const pd_model *const *)m->tp->models, m->tp->n_ranks,
                           m->tp->comm, &m->runner, err)) < 0)
        goto fail;
    m->ep = eng_default_params(m->runner);
    m->ep.mode = mode;
    m->ep.max_model_len = (int32_t)f->max_model_len;
    m->ep.enable_prefix_cache = !f->no_prefix_cache;
    m->ep.enable_chunked_prefill = !f->no_chunked_prefill;
    if (f->model_name && f->model_name[0]) {
        snprintf(m->model_name, sizeof m->model_name, "%s", f->model_name);
    } else {
        const char *base = f->model;
        size_t len = strlen(base);
        while (len > 1 && base[len - 1] == '/') len--;
        size_t start = len;
        while (start > 0 && base[start - 1] != '/') start--;
        snprintf(m->model_name, sizeof m->model_name, "%.*s", (int)(len - start), base + start);
    }
    m->fingerprint = svc_model_fingerprint(f->model, f->load_format, mr_kv_dtype(m->runner),
                                           m->cfg.quant.name);
    {
        void *kv_base;
        size_t kv_bytes;
        mr_kv_pool(m->runner, &kv_base, &kv_bytes);
        PD_LOGI("model %s (%s, %.1fM params, %.1f MiB of weights%s%s) on %s: %d KV blocks of "
                "%d tokens (%s, %.1f MiB)", m->model_name, m->cfg.arch_name,
                (double)m->model->n_params / 1e6, (double)m->model->weight_bytes / 1048576.0,
                m->model->quantized ? ", quantized: " : "",
                m->model->quantized ? m->cfg.quant.name : "", m->be->ops->name,
                mr_n_blocks(m->runner), mr_block_size(m->runner),
                pd_dtype_name(mr_kv_dtype(m->runner)), (double)kv_bytes / 1048576.0);
    }
    return 0;
fail:
    svc_model_close(m);
    return rc;
}

void svc_model_info_metric(const svc_model *m, void *reg)
{
    char lb[512] = "", tp[16];
    snprintf(tp, sizeof tp, "%d", mr_n_ranks(m->runner));
    pd_metrics_label(lb, sizeof lb, "model", m->model_name);
    pd_metrics_label(lb, sizeof lb, "backend", m->be->ops->name);
    pd_metrics_label(lb, sizeof lb, "quantization",
                     m->model->quantized ? m->cfg.quant.name : "none");
    pd_metrics_label(lb, sizeof lb, "kv_cache_dtype", pd_dtype_name(mr_kv_dtype(m->runner)));
    pd_metrics_label(lb, sizeof lb, "tensor_parallel", tp);
    pd_metric_set(pd_metrics_gauge(reg, "pdserve_model_info", lb,
                                   "the served model: name, backend, weight quantization, KV "
                                   "cache element type, tensor-parallel degree"), 1);
}

void svc_model_close(svc_model *m)
{
    mr_destroy(m->runner);
    tp_group_destroy(m->tp); /* m->model and m->be with it */
    memset(m, 0, sizeof *m);
}

void svc_kv_layout(const svc_model *m, kvt_layout *out)
{
    memset(out, 0, sizeof *out);
    snprintf(out->model_id, sizeof out->model_id, "%.40s-%016llx", m->model_name,
             (unsigned long long)m->fingerprint);
    out->dtype = mr_kv_dtype(m->runner);
    out->n_layers = m->cfg.n_layers;
    out->block_size = mr_block_size(m->runner);
    /* the whole layout: with tensor parallelism too, every KV head in model order is what
     * moves (each rank's heads are gathered into it and scattered from it: svc_kvdev.c) */
    out->n_kv_heads = m->cfg.n_kv_heads;
    out->head_dim = m->cfg.head_dim;
}

void svc_kv_layout_to_proto(const svc_model *m, Pdserve__Internal__V1__KvLayout *out)
{
    pdserve__internal__v1__kv_layout__init(out);
    out->block_size = (uint32_t)mr_block_size(m->runner);
    switch (mr_kv_dtype(m->runner)) {
    case PD_DTYPE_F32: out->dtype = PDSERVE__INTERNAL__V1__KV_DTYPE__KV_DTYPE_F32; break;
    case PD_DTYPE_F16: out->dtype = PDSERVE__INTERNAL__V1__KV_DTYPE__KV_DTYPE_F16; break;
    case PD_DTYPE_BF16: out->dtype = PDSERVE__INTERNAL__V1__KV_DTYPE__KV_DTYPE_BF16; break;
    case PD_DTYPE_F8E4M3: out->dtype = PDSERVE__INTERNAL__V1__KV_DTYPE__KV_DTYPE_F8E4M3; break;
    default: out->dtype = PDSERVE__INTERNAL__V1__KV_DTYPE__KV_DTYPE_UNSPECIFIED; break;
    }
    out->num_layers = (uint32_t)m->cfg.n_layers;
    out->num_kv_heads = (uint32_t)m->cfg.n_kv_heads;
    out->head_dim = (uint32_t)m->cfg.head_dim;
    out->model_fingerprint = m->fingerprint;
    int32_t n = mr_n_ranks(m->runner), h0, nh;
    out->tensor_parallel = (uint32_t)n;
    out->kv_heads_per_rank = kvt_tp_heads(m->cfg.n_kv_heads, n, 0, &h0, &nh) == 0 ? (uint32_t)nh : 0;
}

int svc_kv_layout_check_peer(const Pdserve__Internal__V1__KvLayout *l, char *msg, size_t n)
{
    /* 0 from a peer that predates tensor parallelism: one rank with every head */
    uint32_t tp = l->tensor_parallel ? l->tensor_parallel : 1;
    uint32_t per = l->kv_heads_per_rank ? l->kv_heads_per_rank : l->num_kv_heads;
    int32_t h0, nh;
    if (tp > KVT_TP_MAX || l->num_kv_heads == 0 || l->num_kv_heads > INT32_MAX ||
        kvt_tp_heads((int32_t)l->num_kv_heads, (int32_t)tp, 0, &h0, &nh) < 0 ||
        per != (uint32_t)nh) {
        snprintf(msg, n, "KV layout: tensor parallel degree %u with %u of %u KV heads per rank "
                 "is not a head mapping this instance can convert (the degree must divide the "
                 "KV heads, or they it, each rank holding KV heads / degree of them, at least "
                 "one)", l->tensor_parallel, l->kv_heads_per_rank, l->num_kv_heads);
        return PD_EMISMATCH;
    }
    return 0;
}

const char *svc_kv_dtype_name(int d)
{
    switch (d) {
    case PDSERVE__INTERNAL__V1__KV_DTYPE__KV_DTYPE_F32: return "f32";
    case PDSERVE__INTERNAL__V1__KV_DTYPE__KV_DTYPE_F16: return "f16";
    case PDSERVE__INTERNAL__V1__KV_DTYPE__KV_DTYPE_BF16: return "bf16";
    case PDSERVE__INTERNAL__V1__KV_DTYPE__KV_DTYPE_F8E4M3: return "fp8_e4m3";
    default: return "unspecified";
    }
}

static int64_t g_kv_staging_mb = 256; /* --kv-staging-mb (svc_server_flags_apply) */

bool svc_kv_staged(const svc_model *m)
{
    /* PDSERVE_KV_STAGING=1 takes the staging path on the CPU too (tests: the backend's copy
     * queue is then a memcpy). */
    /* tensor parallelism: the ranks' heads are gathered / scattered through the ring */
    if (mr_n_ranks(m->runner) > 1) return true;
    return strcmp(m->be->ops->name, "cpu") != 0 || pd_env_bool("PDSERVE_KV_STAGING");
}

int svc_kv_pool_create(kvt_ctx *ctx, svc_model *m, kvt_pool **out, char *err)
{
    *out = NULL;
    kvt_pool_params pp = kvt_pool_default_params();
    svc_kv_layout(m, &pp.layout);
    pp.n_blocks = mr_n_blocks(m->runner);
    pp.mem_type = KVT_MEM_HOST;
    int32_t L = m->cfg.n_layers;
    int rc;
    if (!svc_kv_staged(m)) {
        void **k = calloc((size_t)L, sizeof *k), **v = calloc((size_t)L, sizeof *v);
        if (!k || !v) {
            rc = pd_errf(err, PD_ENOMEM, "out of memory");
        } else {
            for (int32_t l = 0; l < L; l++) mr_kv_cache(m->runner, l, &k[l], &v[l]);
            pp.k_base = k;
            pp.v_base = v;
            rc = kvt_pool_create(ctx, &pp, out, err);
        }
        free(k);
        free(v);
        return rc;
    }
    const bool tp = mr_n_ranks(m->runner) > 1;
    if (tp && (!svc_kv_stage_ops(m) || !m->kvdev))
        return pd_errf(err, PD_EUNSUPPORTED, "--tensor-parallel %d on the %s backend: moving a "
                       "tensor-parallel instance's KV needs the backend's copy queue with "
                       "strided copies (event_*, copyq_* and copyq_rows ops), which it lacks "
                       "(use --colocated)", mr_n_ranks(m->runner), m->be->ops->name);
    if (!svc_kv_stage_ops(m) || !m->kvdev)
        return pd_errf(err, PD_EUNSUPPORTED, "the %s backend has no copy queue (event_* and "
                       "copyq_* ops), which moving its KV needs", m->be->ops->name);
    /* A UCX that moves CUDA memory itself (cuda_ipc, gdr_copy, RDMA with GPUDirect: the
     * cross-host GPU path) registers the device cache as the pool; otherwise the device cache
     * is staged, reached through a bounded ring of pinned host slots. Either way a sender
     * that can map the device export goes device to device. PDSERVE_KV_UCX_CUDA=0 keeps the
     * ring where UCX has CUDA support. A tensor-parallel instance always takes the ring (its
     * ranks' caches are not the whole layout that moves). */
    bool ucx_cuda = (kvt_ctx_mem_types(ctx) & (1u << KVT_MEM_CUDA)) && strcmp(m->be->ops->name, "cpu") &&
                    pd_env_bool("PDSERVE_KV_UCX_CUDA") && !tp;
    void **k = NULL, **v = NULL;
    if (ucx_cuda) {
        k = calloc((size_t)L, sizeof *k);
        v = calloc((size_t)L, sizeof *v);
        if (!k || !v) {
            free(k);
            free(v);
            return pd_errf(err, PD_ENOMEM, "out of memory");
        }
        for (int32_t l = 0; l < L; l++) mr_kv_cache(m->runner, l, &k[l], &v[l]);
        pp.k_base = k;
        pp.v_base = v;
        pp.mem_type = KVT_MEM_CUDA;
        PD_LOGI("KV transfer: UCX moves CUDA memory here: the device KV cache is registered "
                "with UCX (no staging ring)");
    } else {
        pp.staged = true;
        pp.stage_ring_bytes = (size_t)g_kv_staging_mb << 20;
    }
    void *dev = NULL;
    size_t dev_len = 0;
    if ((rc = svc_kv_device_export(m, &dev, &dev_len, err)) < 0) {
        free(k);
        free(v);
        return rc;
    }
    pp.device_export = dev;
    pp.device_export_len = dev_len;
    rc = kvt_pool_create(ctx, &pp, out, err);
    free(dev);
    free(k);
    free(v);
    return rc;
}

void svc_kv_pool_destroy(svc_model *m, kvt_pool *pool)
{
    (void)m;
    kvt_pool_destroy(pool);
}

void svc_server_flags_init(svc_server_flags *f, const char *default_listen)
{
    memset(f, 0, sizeof *f);
    f->listen = default_listen;
    f->port = -1;
    f->instance_id = "";
    f->log_level = "info";
    f->default_max_tokens = 256;
    f->grpc_threads = 2;
    f->shutdown_grace_ms = 30000;
    f->health_drain_ms = 0;
    f->kv_secret_file = "";
    f->kv_transport = "auto";
    f->kv_staging_mb = 256;
    rpc_server_tls_flags_init(&f->tls);
}

void svc_server_flags_add(svc_server_flags *f, pd_flag *fl, int *n, const char *role)
{
    static char id_help[96];
    snprintf(id_help, sizeof id_help, "instance id in load reports (default %s@<listen>)", role);
    pd_flag add[] = {
        {"listen", PD_FLAG_STRING, &f->listen, "gRPC listen address (host:port; port 0 = any)", 1, 0},
        {"port", PD_FLAG_INT, &f->port, "listen on 0.0.0.0:PORT (overrides --listen; 0 = any)", 0, 65535},
        {"instance-id", PD_FLAG_STRING, &f->instance_id, id_help, 1, 0},
        {"default-max-tokens", PD_FLAG_INT, &f->default_max_tokens, "max_tokens when a request sets none", 1, 1 << 24},
        {"grpc-threads", PD_FLAG_INT, &f->grpc_threads, "gRPC worker threads", 1, 64},
        {"shutdown-grace-ms", PD_FLAG_INT, &f->shutdown_grace_ms, "SIGTERM: time in-flight requests get to finish", 0, 3600000},
        {"health-drain-ms", PD_FLAG_INT, &f->health_drain_ms, "SIGTERM: time health says NOT_SERVING before the listener closes", 0, 600000},
        {"log-level", PD_FLAG_STRING, &f->log_level, "error, warn, info, debug", 1, 0},
        {"kv-secret-file", PD_FLAG_STRING, &f->kv_secret_file, "file with the shared secret that authenticates KV transfers between prefill and decode (same file on both; empty = unauthenticated)", 1, 0},
        {"kv-transport", PD_FLAG_STRING, &f->kv_transport, "KV data path between GPU instances: auto (device to device where the peer's GPU is reachable, else host memory), device (required: a transfer that cannot go device to device fails), host", 1, 0},
        {"kv-staging-mb", PD_FLAG_INT, &f->kv_staging_mb, "host memory (MiB, pinned) through which GPU KV moves when it cannot go device to device: a ring of 1 MiB slots pipelined with the network, never a copy of the whole KV cache", 4, 1 << 20},
    };
    for (size_t i = 0; i < sizeof add / sizeof add[0]; i++) fl[(*n)++] = add[i];
    rpc_server_tls_flags_add(&f->tls, fl, n);
}

static const char *g_kv_secret_file; /* --kv-secret-file, for svc_kvt_start */
const char *svc__kv_transport = "auto"; /* --kv-transport, for svc_kvdev.c */

void svc_server_flags_apply(svc_server_flags *f)
{
    g_kv_secret_file = f->kv_secret_file && f->kv_secret_file[0] ? f->kv_secret_file : NULL;
    if (f->kv_transport) svc__kv_transport = f->kv_transport;
    if (f->kv_staging_mb > 0) g_kv_staging_mb = f->kv_staging_mb;
    pd_log_level lv;
    if (pd_log_parse_level(f->log_level, &lv) == 0) pd_log_set_level(lv);
    if (f->port >= 0) {
        snprintf(f->listen_buf, sizeof f->listen_buf, "0.0.0.0:%lld", (long long)f->port);
        f->listen = f->listen_buf;
    }
}

static void load_report(rpc_call *call, const ProtobufCMessage *req, void *user)
{
    (void)req;
    svc_instance *inst = user;
    ew_load l;
    ew_load_get(inst->worker, &l);
    Pdserve__Internal__V1__LoadReportResponse r = PDSERVE__INTERNAL__V1__LOAD_REPORT_RESPONSE__INIT;
    Pdserve__Internal__V1__KvLayout layout;
    svc_kv_layout_to_proto(inst->model, &layout);
    r.instance_id = inst->instance_id;
    r.role = inst->role;
    r.model_name = (char *)inst->model->model_name;
    r.kv_layout = &layout;
    r.free_blocks = (uint32_t)l.n_free_blocks;
    r.total_blocks = (uint32_t)l.n_blocks;
    r.running_seqs = (uint32_t)l.n_running;
    r.waiting_seqs = (uint32_t)l.n_waiting;
    r.queued_prefill_tokens = (uint64_t)l.queued_prompt_tokens;
    r.prefill_tokens_per_second = l.prefill_tok_per_s;
    r.steps = (uint64_t)l.stats.steps;
    /* Reservations wait for their KV: they are queued work the router must see. */
    int64_t nres = atomic_load(&inst->reservations);
    r.waiting_seqs = (uint32_t)(l.n_waiting + (nres > 0 ? nres : 0));
    int64_t rb = atomic_load(&inst->reserved_blocks);
    r.reserved_blocks = (uint32_t)(rb > 0 ? rb : 0);
    r.failed = atomic_load(&inst->failed) != 0;
    r.draining = inst->draining != 0 || r.failed; /* routers that predate `failed` stop too */
    rpc_call_reply(call, &r.base);
}

bool svc_instance_refuse_failed(svc_instance *inst, rpc_call *call)
{
    if (!atomic_load(&inst->failed)) return false;
    rpc_stream_finish(call, RPC_STATUS_UNAVAILABLE, "this instance's engine failed; it reports "
                      "NOT_SERVING until restarted");
    return true;
}

void svc_instance_on_step(void *arg, double seconds, int32_t n_seqs)
{
    svc_instance *inst = arg;
    if (inst->metrics) svc_metrics_on_step(inst->metrics, seconds, n_seqs);
}

void svc_instance_on_step_failed(void *arg, const char *msg)
{
    svc_instance *inst = arg;
    if (atomic_exchange(&inst->failed, 1) == 0)
        PD_LOGE("%s: the engine failed a step (%s): reporting NOT_SERVING from now on; "
                "restart the instance", inst->instance_id[0] ? inst->instance_id : "instance", msg);
    rpc_server *s = atomic_load(&inst->server);
    if (s) rpc_server_set_serving(s, false);
}

int svc_instance_register(rpc_server *s, svc_instance *inst, char *err)
{
    return rpc_server_register(s, &pdserve__internal__v1__instance__descriptor, "LoadReport",
                               RPC_UNARY, load_report, inst, err);
}

/* ---- an instance's engine thread and KV-transfer thread ---- */

/* Fault injection for tests (PDSERVE_FAULT_FAIL_STEPS_AFTER=N): the executor runs N forwards,
 * then fails every later one as a sticky device error would. PDSERVE_FAULT_STEP_DELAY_MS=M:
 * every forward takes M ms longer (a slow instance: backlogs on the CPU). One per process. */
static struct {
    eng_executor real;
    atomic_llong left;
    bool failing;
    long delay_ms;
} g_fault;

static bool fault_fires(char *err)
{
    if (g_fault.delay_ms > 0) {
        struct timespec ts = {g_fault.delay_ms / 1000, (g_fault.delay_ms % 1000) * 1000000};
        nanosleep(&ts, NULL);
    }
    if (!g_fault.failing) return false;
    if (atomic_fetch_sub(&g_fault.left, 1) > 0) return false;
    atomic_store(&g_fault.left, 0);
    pd_errf(err, PD_EBACKEND, "injected device failure (PDSERVE_FAULT_FAIL_STEPS_AFTER)");
    return true;
}

static int fault_forward(void *ctx, const mr_batch *b, float *logits, char *err)
{
    if (fault_fires(err)) return PD_EBACKEND;
    return g_fault.real.forward(ctx, b, logits, err);
}

static int fault_forward_sample(void *ctx, const mr_batch *b, const mr_sampling *smp, char *err)
{
    if (fault_fires(err)) return PD_EBACKEND;
    return g_fault.real.forward_sample(ctx, b, smp, err);
}

static int fault_launch(void *ctx, const mr_batch *b, const mr_sampling *smp, bool ids_from_last,
                        char *err)
{
    if (fault_fires(err)) return PD_EBACKEND;
    return g_fault.real.launch(ctx, b, smp, ids_from_last, err);
}

static eng_executor maybe_faulty(eng_executor x)
{
    const int64_t after = pd_env_int("PDSERVE_FAULT_FAIL_STEPS_AFTER");
    g_fault.failing = after >= 0;
    g_fault.delay_ms = (long)pd_env_int("PDSERVE_FAULT_STEP_DELAY_MS");
    if (!g_fault.failing && g_fault.delay_ms <= 0) return x;
    g_fault.real = x;
    if (g_fault.failing) {
        atomic_store(&g_fault.left, (long long)after);
        PD_LOGW("PDSERVE_FAULT_FAIL_STEPS_AFTER=%lld: every forward after the first %lld fails "
                "(testing)", (long long)after, (long long)after);
    }
    if (g_fault.delay_ms > 0)
        PD_LOGW("PDSERVE_FAULT_STEP_DELAY_MS=%ld: every forward takes that much longer (testing)",
                g_fault.delay_ms);
    x.forward = fault_forward;
    if (x.forward_sample) x.forward_sample = fault_forward_sample;
    if (x.launch) x.launch = fault_launch;
    return x;
}

int svc_engine_start(svc_model *m, eng_mode mode, const eng_kv_listener *kl,
                     const ew_callbacks *cb, ew **worker, char *err)
{
    eng *e = NULL;
    m->ep.mode = mode;
    int rc = eng_create(&m->ep, &m->cfg, maybe_faulty(eng_executor_runner(m->runner)), &e, err);
    if (rc < 0) return rc;
    if (kl) eng_set_kv_listener(e, kl);
    if ((rc = ew_create(e, cb, worker)) < 0) {
        eng_destroy(e);
        return pd_errf(err, rc, "cannot start the engine thread");
    }
    return 0;
}

typedef struct {
    svc_model *m;
    kvt_pool **pool;
    int rc;
    char err[PD_ERR_LEN];
} pool_box;

static void pool_setup(kvt_ctx *ctx, void *arg)
{
    pool_box *b = arg;
    b->rc = svc_kv_pool_create(ctx, b->m, b->pool, b->err);
}

static void pool_teardown(kvt_ctx *ctx, void *arg)
{
    (void)ctx;
    pool_box *b = arg;
    svc_kv_pool_destroy(b->m, *b->pool);
    *b->pool = NULL;
}

int svc_kvt_start(const char *name, kvt_event_fn on_event, void *arg, svc_model *m,
                  svc_kvt **kvt, kvt_pool **pool, char *err)
{
    kvt_params kp = kvt_default_params();
    kp.name = name;
    kp.on_event = on_event;
    kp.on_event_arg = arg;
    kp.secret_file = g_kv_secret_file;
    if (strcmp(svc__kv_transport, "auto") && strcmp(svc__kv_transport, "device") &&
        strcmp(svc__kv_transport, "host"))
        return pd_errf(err, PD_EINVAL, "--kv-transport %s: give auto, device or host",
                       svc__kv_transport);
    if (!strcmp(svc__kv_transport, "device") && mr_n_ranks(m->runner) > 1)
        return pd_errf(err, PD_EUNSUPPORTED, "--kv-transport device: a tensor-parallel "
                       "instance's KV moves through the staging ring (the device-to-device "
                       "path takes single-rank instances only)");
    if (!strcmp(svc__kv_transport, "device") && !svc_kv_device_on(m))
        return pd_errf(err, PD_EUNSUPPORTED, "--kv-transport device: the %s backend cannot move "
                       "KV device to device", m->be->ops->name);
    svc_kv_device_params(m, &kp);
    char e2[PD_ERR_LEN];
    int rc = svc_kvt_create(&kp, kvt, e2);
    if (rc < 0) return pd_errf(err, rc, "kvtransfer: %s", e2);
    pool_box b = {m, pool, 0, ""};
    if ((rc = svc_kvt_call(*kvt, pool_setup, &b)) < 0)
        return pd_errf(err, rc, "KV pool: the kvt thread is stopping");
    if (b.rc < 0) return pd_errf(err, b.rc, "KV pool: %s", b.err);
    return 0;
}

void svc_kvt_stop(svc_kvt *kvt, svc_model *m, kvt_pool **pool)
{
    if (!kvt) return;
    if (*pool) {
        pool_box b = {m, pool, 0, ""};
        svc_kvt_call(kvt, pool_teardown, &b);
    }
    svc_kvt_destroy(kvt);
    svc_kv_device_free(m);
}
