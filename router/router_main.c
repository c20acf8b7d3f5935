/* router_main.c -- pdserve-router's process: its flags, the setup of the tokenizer, chat
 * template, registry, gRPC server, metrics and the OpenAI-compatible HTTP front, health, the
 * drain on SIGTERM. What a request does is in rtr_request.c (rtr_impl.h: the state they
 * share). */
#include <errno.h>
#include <sys/resource.h>
#include <unistd.h>

#include "common/flags.h"
#include "pdserve/public_descriptors.h"
#include "router/rtr_http.h"

#include "router/rtr_impl.h"

router g;

/* ---- metrics ---- */

/* Scrape time: the router's view of every instance, from the registry. */
static void collect(pd_metrics *m, void *arg)
{
    (void)m;
    (void)arg;
    pd_metric_set(g.m_in_flight, (double)atomic_load(&g.pending));
    int64_t waiting, admitted;
    rtr_gate_counts(&waiting, &admitted);
    pd_metric_set(g.m_gate_waiting, (double)waiting);
    pd_metric_set(g.m_gate_admitted, (double)admitted);
    if (!g.reg) return;
    pd_metric_set(g.m_dns_fail, (double)rtr_registry_resolve_failures(g.reg));
    rtr_instance_info *v = calloc(256, sizeof *v);
    if (!v) return;
    int n = rtr_registry_snapshot(g.reg, v, 256);
    for (int k = 0; k < 10; k++) pd_mfamily_hide_all(g.m_inst[k]);
    for (int i = 0; i < n; i++) {
        char l[192] = "";
        pd_metrics_label(l, sizeof l, "role", v[i].role);
        pd_metrics_label(l, sizeof l, "addr", v[i].addr);
        double val[10] = {v[i].up, v[i].draining, (double)v[i].free_blocks, (double)v[i].total_blocks,
                          (double)v[i].running, (double)v[i].waiting, (double)v[i].queued_tokens,
                          (double)v[i].routed, (double)v[i].errors, v[i].prefill_rate};
        for (int k = 0; k < 10; k++) pd_metric_set(pd_mfamily_series(g.m_inst[k], l), val[k]);
    }
    free(v);
}

/* --http-listen: the OpenAI-compatible HTTP front, a loopback client of this server
 * (router/rtr_http.h). /health asks whether a decode instance can serve. */
static int http_decode_up(void *user)
{
    (void)user;
    rtr_instance *d = rtr_pick_decode(g.reg, NULL);
    rtr_instance_unref(d);
    return d != NULL;
}

/* gRPC health tells what HTTP /health tells: SERVING while a decode instance can serve (and
 * the router is not draining), NOT_SERVING otherwise; updated after each round of load
 * reports (the registry's poller thread). g_health_mu orders it with the drain: once draining
 * is set under it, no update turns health back to SERVING. */
static pthread_mutex_t g_health_mu = PTHREAD_MUTEX_INITIALIZER;
static bool g_health_on;       /* the server started: updates may set its health */
static int g_health_last = -1; /* what was last set: -1 none, 0 NOT_SERVING, 1 SERVING */

static void update_health(void *user)
{
    (void)user;
    pthread_mutex_lock(&g_health_mu);
    if (g_health_on && !g.draining) {
        const int up = http_decode_up(NULL);
        rpc_server_set_serving(g.server, up != 0);
        if (g_health_last >= 0 && up != g_health_last)
            PD_LOGI("health: %s (%s)", up ? "SERVING" : "NOT_SERVING",
                    up ? "a decode instance is up" : "no decode instance can serve");
        g_health_last = up;
    }
    pthread_mutex_unlock(&g_health_mu);
}

/* hp: the front door's limits from the flags; the rest is filled here (model: the --model
 * directory, for the responses' system_fingerprint). */
static int http_setup(rtr_http_params hp, const char *http_listen, const char *listen, bool tls,
                      const char *model, rtr_http **out, char *err)
{
    char target[300];
    if (tls)
        return pd_errf(err, PD_EINVAL, "--http-listen serves plain HTTP through the gRPC port, "
                       "which --tls-cert makes TLS-only: put a TLS proxy in front of the HTTP "
                       "port instead, or leave --http-listen unset");
    if (rtr_http_loopback_target(listen, rpc_server_port(g.server), target, sizeof target) < 0)
        return pd_errf(err, PD_EINVAL, "--listen %s: cannot tell a loopback address", listen);
    hp.listen = http_listen;
    hp.grpc_target = target;
    hp.model_name = g.model_name;
    char fingerprint[RTR_HTTP_FINGERPRINT_LEN];
    rtr_http_system_fingerprint(model, fingerprint, sizeof fingerprint);
    hp.system_fingerprint = fingerprint;
    hp.tok = g.tok;
    hp.max_model_len = g.cfg.max_position;
    hp.timeout_ms = g.call_timeout_ms;
    hp.instances_up = http_decode_up;
    hp.metrics = svc_metrics_registry(g.metrics);
    return rtr_http_start(&hp, out, err);
}

/* Raises the soft RLIMIT_NOFILE to the hard limit: every HTTP and gRPC connection holds a
 * descriptor, and the usual soft default (1024) is far below what a front door holds
 * (--http-max-connections). */
static void raise_nofile(void)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur >= rl.rlim_max) return;
    const unsigned long long was = (unsigned long long)rl.rlim_cur;
    rl.rlim_cur = rl.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &rl) == 0)
        PD_LOGI("RLIMIT_NOFILE: soft limit raised from %llu to the hard limit %llu", was,
                (unsigned long long)rl.rlim_max);
    else
        PD_LOGW("RLIMIT_NOFILE: cannot raise the soft limit %llu to %llu: %s", was,
                (unsigned long long)rl.rlim_max, strerror(errno));
}

static int metrics_setup(const char *listen, int64_t port, char *err)
{
    svc_metrics_params mp = {"router", NULL, listen, port};
    int rc = svc_metrics_create(&mp, &g.metrics, err);
    if (rc < 0) return rc;
    pd_metrics *m = svc_metrics_registry(g.metrics);
    g.m_success = pd_metrics_family(m, PD_METRIC_COUNTER, "pdserve_request_success_total",
                                    "Generate calls that ended OK, by finish reason", NULL, 0);
    g.m_slo = pd_metrics_counter(m, "pdserve_requests_within_slo_total", NULL,
                                 "Generate calls that ended OK within --slo-ttft-ms and --slo-tpot-ms "
                                 "(goodput)");
    pd_metric_set(pd_metrics_gauge(m, "pdserve_slo_ttft_seconds", NULL, "--slo-ttft-ms (0 = none)"), g.slo_ttft_s);
    pd_metric_set(pd_metrics_gauge(m, "pdserve_slo_tpot_seconds", NULL, "--slo-tpot-ms (0 = none)"), g.slo_tpot_s);
    g.m_in_flight = pd_metrics_gauge(m, "pdserve_requests_in_flight", NULL, "Generate calls in progress");
    g.m_ttft = pd_metrics_histogram(m, "pdserve_time_to_first_token_seconds", NULL,
                                    "arrival at the router to the first token sent (OK calls)",
                                    pd_metrics_latency_buckets, pd_metrics_n_latency_buckets);
    g.m_tpot = pd_metrics_histogram(m, "pdserve_time_per_output_token_seconds", NULL,
                                    "mean time between output tokens after the first, per call "
                                    "(OK calls with 2 or more tokens)",
                                    pd_metrics_token_buckets, pd_metrics_n_token_buckets);
    g.m_e2e = pd_metrics_histogram(m, "pdserve_e2e_request_latency_seconds", NULL,
                                   "arrival to the last message (OK calls)",
                                   pd_metrics_request_buckets, pd_metrics_n_request_buckets);
    g.m_prompt = pd_metrics_counter(m, "pdserve_prompt_tokens_total", NULL,
                                    "prompt tokens of Generate calls that passed validation");
    g.m_completion = pd_metrics_counter(m, "pdserve_completion_tokens_total", NULL,
                                        "output tokens sent to clients");
    pd_mfamily *retries = pd_metrics_family(m, PD_METRIC_COUNTER, "pdserve_router_retries_total",
                                            "internal calls retried on another instance", NULL, 0);
    g.m_retry_prefill = pd_mfamily_series(retries, "role=\"prefill\"");
    g.m_retry_decode = pd_mfamily_series(retries, "role=\"decode\"");
    g.m_migrations = pd_metrics_family(m, PD_METRIC_COUNTER, "pdserve_router_migrations_total",
                                       "Requests restarted on another instance after theirs "
                                       "failed, froze or drained: reason unavailable (gone or "
                                       "failed), cancelled (it ended the call: shutting down), "
                                       "stalled (no progress), prefill_failed, prefill_down",
                                       NULL, 0);
    g.m_where = pd_metrics_family(m, PD_METRIC_COUNTER, "pdserve_router_prefill_decisions_total",
                                  "where prompts were computed: local (on the decode instance) or "
                                  "remote (a prefill instance), and why", NULL, 0);
    g.m_gate_waiting = pd_metrics_gauge(m, "pdserve_router_prefill_waiting_requests", NULL,
                                        "requests waiting for room in the prefill pool before "
                                        "they reserve decode blocks (--prefill-queue-tokens)");
    g.m_gate_admitted = pd_metrics_gauge(m, "pdserve_router_prefill_admitted_tokens", NULL,
                                         "prompt tokens admitted to the prefill pool and not "
                                         "yet prefilled");
    g.m_gate_wait = pd_metrics_histogram(m, "pdserve_router_prefill_wait_seconds", NULL,
                                         "time a request waited for room in the prefill pool",
                                         pd_metrics_latency_buckets, pd_metrics_n_latency_buckets);
    g.m_dns_fail = pd_metrics_counter(m, "pdserve_router_resolve_failures_total", NULL,
                                      "failed DNS lookups of --prefill / --decode names (the "
                                      "last good addresses stay in use)");
    static const struct {
        const char *name, *help;
        pd_metric_type t;
    } inst[10] = {
        {"pdserve_router_instance_up", "1 while the instance answers load reports and calls", PD_METRIC_GAUGE},
        {"pdserve_router_instance_draining", "1 while the instance reports that it drains", PD_METRIC_GAUGE},
        {"pdserve_router_instance_free_kv_blocks", "free KV blocks in the last load report", PD_METRIC_GAUGE},
        {"pdserve_router_instance_capacity_kv_blocks", "KV blocks in all in the last load report", PD_METRIC_GAUGE},
        {"pdserve_router_instance_running_sequences", "running sequences in the last load report", PD_METRIC_GAUGE},
        {"pdserve_router_instance_waiting_sequences", "waiting sequences in the last load report", PD_METRIC_GAUGE},
        {"pdserve_router_instance_queued_prefill_tokens", "queued prompt tokens in the last load report", PD_METRIC_GAUGE},
        {"pdserve_router_routed_requests_total", "requests (and retries) routed to the instance", PD_METRIC_COUNTER},
        {"pdserve_router_instance_errors_total", "failed calls and load reports of the instance", PD_METRIC_COUNTER},
        {"pdserve_router_instance_prefill_tokens_per_second", "prompt tokens per second the instance measured (last load report; 0 = none yet)", PD_METRIC_GAUGE},
    };
    for (int k = 0; k < 10; k++) g.m_inst[k] = pd_metrics_family(m, inst[k].t, inst[k].name, inst[k].help, NULL, 0);
    svc_metrics_set_collector(g.metrics, collect, NULL);
    return 0;
}

int main(int argc, char **argv)
{
    svc_block_signals();
    const char *model = "../shared/models/stories260k", *model_name = "", *listen = "0.0.0.0:50051";
    const char *prefill = "", *decode = "", *log_level = "info";
    int64_t max_tokens = 256, max_pending = 4096, threads = 2, poll_ms = 500, resolve_ms = 10000;
    int64_t grace_ms = 30000, health_drain_ms = 0, timeout_ms = 600000, port = -1;
    int64_t metrics_port = -1;
    double slo_ttft_ms = 0, slo_tpot_ms = 0;
    const char *prefill_policy = "auto", *http_listen = "", *kv_secret_file = "", *caller_name = "";
    const rtr_http_params hd = rtr_http_default_params();
    int64_t http_max_conns = hd.max_connections, http_per_ip = hd.per_ip_connections;
    int64_t http_idle_s = hd.idle_timeout_s, http_request_s = hd.request_timeout_s;
    int64_t http_threads = hd.n_threads;
    /* Defaults from the measurements in docs/perf-history.md ("KV transfer device to device
     * (issue #27)", its conditional disaggregation): a 64-token prompt computed on the decode
     * instance answers sooner and moves no TPOT; with 4096 busy tokens the TPOT-loose workload
     * A gains much goodput and the TPOT-tight B loses some, both staying above colocated. */
    int64_t local_max_tokens = 64, prefill_busy_tokens = 4096, prefill_queue_tokens = 16384;
    int64_t max_migrations = 3, stall_ms = 1400;
    double busy_tpot_fraction = 0.8, busy_ttft_fraction = 0.5;
    pd_flag flags[] = {
        {"model", PD_FLAG_STRING, &model, "model directory (tokenizer.json, config.json)", 1, 0},
        {"model-name", PD_FLAG_STRING, &model_name, "name served in GetModelInfo (default: directory name)", 1, 0},
        {"listen", PD_FLAG_STRING, &listen, "public gRPC address (host:port; port 0 = any)", 1, 0},
        {"port", PD_FLAG_INT, &port, "listen on 0.0.0.0:PORT (overrides --listen; 0 = any)", 0, 65535},
        {"prefill", PD_FLAG_LIST, &prefill, "prefill instances host:port,... (DNS names re-resolved)", 1, 0},
        {"decode", PD_FLAG_LIST, &decode, "decode (or colocated) instances host:port,...", 1, 0},
        {"default-max-tokens", PD_FLAG_INT, &max_tokens, "max_tokens when a request sets none", 1, 1 << 24},
        {"max-pending", PD_FLAG_INT, &max_pending, "requests in flight before RESOURCE_EXHAUSTED", 1, 1 << 24},
        {"request-timeout-ms", PD_FLAG_INT, &timeout_ms, "deadline of the internal calls of a request", 100, 86400000},
        {"load-poll-ms", PD_FLAG_INT, &poll_ms, "load report period", 10, 600000},
        {"resolve-ms", PD_FLAG_INT, &resolve_ms, "DNS re-resolution period", 100, 3600000},
        {"grpc-threads", PD_FLAG_INT, &threads, "gRPC worker threads", 1, 64},
        {"shutdown-grace-ms", PD_FLAG_INT, &grace_ms, "SIGTERM: time in-flight requests get to finish", 0, 3600000},
        {"health-drain-ms", PD_FLAG_INT, &health_drain_ms, "SIGTERM: time health says NOT_SERVING first", 0, 600000},
        {"slo-ttft-ms", PD_FLAG_DOUBLE, &slo_ttft_ms, "goodput: time-to-first-token objective in ms (0 = none)", 0, 1e9},
        {"slo-tpot-ms", PD_FLAG_DOUBLE, &slo_tpot_ms, "goodput: time-per-output-token objective in ms (0 = none)", 0, 1e9},
        {"prefill-policy", PD_FLAG_STRING, &prefill_policy, "where prompts are computed with prefill instances present: auto (by --local-prefill-max-tokens and --prefill-busy-tokens), remote (always a prefill instance), local (always the decode instance)", 1, 0},
        {"local-prefill-max-tokens", PD_FLAG_INT, &local_max_tokens, "auto: prompts of at most this many tokens are computed on the decode instance (0 = none)", 0, 1 << 24},
        {"prefill-busy-tokens", PD_FLAG_INT, &prefill_busy_tokens, "auto: when every prefill instance has this many prompt tokens queued and the decode instance at most a quarter of that (this prompt included), the prompt is computed on the decode instance (0 = never; with --slo-ttft-ms, once every prefill instance measured its prefill rate, --prefill-busy-ttft-fraction says when the pool is busy instead)", 0, 1ll << 40},
        {"prefill-busy-ttft-fraction", PD_FLAG_DOUBLE, &busy_ttft_fraction, "auto, with --slo-ttft-ms: the prefill pool counts as busy (for the --prefill-busy-tokens rule) when a prompt sent now would wait this fraction of the TTFT objective at every prefill instance (its queued prompt tokens over the prefill rate it measured); 0 = by --prefill-busy-tokens alone", 0, 10},
        {"prefill-busy-tpot-fraction", PD_FLAG_DOUBLE, &busy_tpot_fraction, "auto, with --slo-tpot-ms: the --prefill-busy-tokens rule computes a prompt on a decode instance only while the TPOT of the requests it decoded (a moving average) is below this fraction of the objective", 0, 10},
        {"prefill-queue-tokens", PD_FLAG_INT, &prefill_queue_tokens, "reserve late: prompt tokens per prefill instance that may be admitted (decode blocks reserved, sent to prefill) and not yet prefilled; later requests wait in the router holding nothing (0 = admit at once)", 0, 1ll << 40},
        {"max-migrations", PD_FLAG_INT, &max_migrations, "times one request may be restarted on another instance after its instance died, froze, drained or failed a step (streams resume from the tokens sent, token-exact; 0 = never: the request fails)", 0, 100},
        {"stall-timeout-ms", PD_FLAG_INT, &stall_ms, "an instance with no progress this long (its load reports stop, or its engine steps stand still while it has running sequences) is stalled: no new work, and its requests move elsewhere (0 = off; keep it above the longest engine step)", 0, 3600000},
        {"kv-secret-file", PD_FLAG_STRING, &kv_secret_file, "the instances' shared secret (their --kv-secret-file): the router signs its internal calls with it, so that the decode instances give it a reservation share of its own that no other process can take (without it, or mutual TLS, shares are by host address)", 1, 0},
        {"caller-name", PD_FLAG_STRING, &caller_name, "with --kv-secret-file: this router's name in its signed calls (default: host name and process id); routers with one name share a reservation share", 1, 0},
        {"http-listen", PD_FLAG_STRING, &http_listen, "OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, /health) on host:port (port 0 = any free port, printed as HTTP_PORT; unset = off)", 1, 0},
        {"http-max-connections", PD_FLAG_INT, &http_max_conns, "HTTP: open connections at most (lowered to what RLIMIT_NOFILE allows, less 256; the router raises its soft limit to the hard one); more wait in the listen backlog", 16, 1 << 20},
        {"http-per-ip-connections", PD_FLAG_INT, &http_per_ip, "HTTP: open connections from one client address at most (more are closed at once; 0 = no limit; raise it behind a proxy that funnels clients through few addresses)", 0, 1 << 20},
        {"http-idle-timeout-s", PD_FLAG_INT, &http_idle_s, "HTTP: close a connection with no traffic for this long (one whose request waits for tokens is not idle)", 1, 86400},
        {"http-request-timeout-s", PD_FLAG_INT, &http_request_s, "HTTP: close a connection whose request (headers and body) is not in this long after it opened (kept alive: after the previous response plus --http-idle-timeout-s); 0 = no deadline", 0, 86400},
        {"http-threads", PD_FLAG_INT, &http_threads, "HTTP: event-loop threads (no thread per connection)", 1, 64},
        {"metrics-port", PD_FLAG_INT, &metrics_port, "Prometheus /metrics HTTP port on the --listen host (-1 = off, 0 = any free port)", -1, 65535},
        {"log-level", PD_FLAG_STRING, &log_level, "error, warn, info, debug", 1, 0},
    };
    /* TLS: the public server's flags and the instance channels' (--internal-tls-*). */
    rpc_server_tls_flags stls;
    rpc_server_tls_flags_init(&stls);
    rpc_client_tls itls = {0};
    pd_flag all[sizeof flags / sizeof flags[0] + 8];
    int n_all = 0;
    for (size_t i = 0; i < sizeof flags / sizeof flags[0]; i++) all[n_all++] = flags[i];
    rpc_server_tls_flags_add(&stls, all, &n_all);
    rpc_client_tls_flags_add(&itls, all, &n_all, true);
    int prc = pd_flags_parse(all, n_all, argc, argv, "pdserve-router",
                             "The public entry of pdserve: the pdserve.v1.Generation gRPC API, "
                             "routed over prefill and decode instances.");
    if (prc != 0) {
        pd_flags_free();
        return prc > 0 ? 0 : 2;
    }
    pd_log_level lv;
    if (pd_log_parse_level(log_level, &lv) == 0) pd_log_set_level(lv);
    raise_nofile();
    char err[PD_ERR_LEN], listen_buf[64];
    if (port >= 0) {
        snprintf(listen_buf, sizeof listen_buf, "0.0.0.0:%lld", (long long)port);
        listen = listen_buf;
    }
    int status = 1;
    rtr_http *http = NULL;
    g.default_max_tokens = max_tokens;
    g.max_pending = max_pending;
    g.max_migrations = max_migrations;
    if (svc_auth_load_secret(kv_secret_file, err) < 0) {
        fprintf(stderr, "pdserve-router: --kv-secret-file: %s\n", err);
        goto out;
    }
    if (kv_secret_file[0]) {
        char name[72];
        if (caller_name[0]) {
            snprintf(name, sizeof name, "%s", caller_name);
        } else {
            char host[48] = "router";
            gethostname(host, sizeof host);
            host[sizeof host - 1] = 0;
            for (char *p = host; *p; p++)
                if (*p <= ' ' || *p > '~' || *p == ':') *p = '_';
            snprintf(name, sizeof name, "%s-%ld", host, (long)getpid());
        }
        if (svc_auth_caller_token(name, g.caller_token, sizeof g.caller_token) < 0) {
            fprintf(stderr, "pdserve-router: --caller-name '%s': 1 to 64 printable characters "
                    "without spaces or ':'\n", name);
            goto out;
        }
        PD_LOGI("internal calls signed as caller %s (--kv-secret-file)", name);
    }
    g.call_timeout_ms = timeout_ms;
    g.slo_ttft_s = slo_ttft_ms / 1000.0;
    if (!strcmp(prefill_policy, "auto")) g.prefill_policy = PREFILL_AUTO;
    else if (!strcmp(prefill_policy, "remote")) g.prefill_policy = PREFILL_REMOTE;
    else if (!strcmp(prefill_policy, "local")) g.prefill_policy = PREFILL_LOCAL;
    else {
        fprintf(stderr, "pdserve-router: --prefill-policy %s: give auto, remote or local\n",
                prefill_policy);
        pd_flags_free();
        return 2;
    }
    g.local_max_tokens = local_max_tokens;
    g.prefill_busy_tokens = prefill_busy_tokens;
    g.prefill_queue_tokens = prefill_queue_tokens;
    g.busy_tpot_fraction = busy_tpot_fraction;
    g.busy_ttft_fraction = busy_ttft_fraction;
    g.slo_tpot_s = slo_tpot_ms / 1000.0;
    atomic_init(&g.pending, 0);
    atomic_init(&g.next_id, 1);
    if (metrics_setup(listen, metrics_port, err) < 0) {
        fprintf(stderr, "pdserve-router: %s\n", err);
        goto out;
    }
    if (mc_load(model, &g.cfg, err) < 0) {
        fprintf(stderr, "pdserve-router: %s\n", err);
        goto out;
    }
    char tpath[4096];
    snprintf(tpath, sizeof tpath, "%s/tokenizer.json", model);
    FILE *tf = fopen(tpath, "r");
    if (tf) {
        fclose(tf);
        if (tok_load(model, &g.tok, err) < 0) {
            fprintf(stderr, "pdserve-router: %s\n", err);
            goto out;
        }
    } else {
        PD_LOGW("%s has no tokenizer.json: only prompt_token_ids are accepted and responses "
                "carry token ids without text", model);
    }
    {
        chat_template *ct = NULL;
        char cerr[PD_ERR_LEN];
        int crc = chat_template_load(model, &ct, cerr);
        if (crc == 0) {
            g.chat = ct;
        } else {
            if (crc != PD_ENOTFOUND) PD_LOGW("the chat template cannot be used: %s", cerr);
            else PD_LOGI("%s: GenerateRequest.messages is refused", cerr);
        }
    }
    if (model_name[0]) {
        snprintf(g.model_name, sizeof g.model_name, "%s", model_name);
    } else {
        const char *b = strrchr(model, '/');
        snprintf(g.model_name, sizeof g.model_name, "%s", b && b[1] ? b + 1 : model);
    }
    if (!decode[0]) {
        fprintf(stderr, "pdserve-router: --decode host:port,... is required\n");
        goto out;
    }
    rtr_registry_params rp = rtr_registry_default_params();
    rp.prefill = prefill;
    rp.decode = decode;
    rp.poll_ms = poll_ms;
    rp.resolve_ms = resolve_ms;
    rp.tls = itls;
    rp.on_poll = update_health;
    rp.stall_ms = stall_ms;
    if (rtr_registry_create(&rp, &g.reg, err) < 0) {
        fprintf(stderr, "pdserve-router: %s\n", err);
        goto out;
    }
    rpc_server_params sp = rpc_server_default_params();
    sp.listen_addr = listen;
    sp.n_threads = (int)threads;
    sp.shutdown_grace_ms = (int)grace_ms;
    sp.health_drain_ms = (int)health_drain_ms;
    sp.stream_queue_max = 4096;
    rpc_server_tls_flags_apply(&stls, &sp);
    if (rpc_server_create(&sp, &g.server, err) < 0 ||
        rpc_server_register(g.server, &pdserve__v1__generation__descriptor, "Generate",
                            RPC_SERVER_STREAMING, rtr_handle_generate, NULL, err) < 0 ||
        rpc_server_register(g.server, &pdserve__v1__generation__descriptor, "Tokenize",
                            RPC_UNARY, rtr_handle_tokenize, NULL, err) < 0 ||
        rpc_server_register(g.server, &pdserve__v1__generation__descriptor, "GetModelInfo",
                            RPC_UNARY, rtr_handle_model_info, NULL, err) < 0 ||
        rpc_server_add_reflection(g.server, pd_public_descriptor_set,
                                  pd_public_descriptor_set_len, err) < 0 ||
        rpc_server_start(g.server, err) < 0) {
        fprintf(stderr, "pdserve-router: %s\n", err);
        goto out;
    }
    pthread_mutex_lock(&g_health_mu);
    g_health_on = true;
    pthread_mutex_unlock(&g_health_mu);
    update_health(NULL); /* from now on after every round of load reports */
    if (rtr_requests_start(err) < 0) {
        fprintf(stderr, "pdserve-router: %s\n", err);
        goto out;
    }
    int np, nd, nh;
    rtr_registry_counts(g.reg, &np, &nd, &nh);
    PD_LOGI("pdserve-router serving %s on port %d: %d prefill, %d decode instances (%d up)%s",
            g.model_name, rpc_server_port(g.server), np, nd, nh,
            np ? "" : "; decode instances compute prompts (no prefill instances)");
    svc_metrics_watch_server(g.metrics, g.server, &g.draining);
    if (svc_metrics_start(g.metrics, err) < 0) {
        fprintf(stderr, "pdserve-router: %s\n", err);
        goto out;
    }
    rtr_http_params hp = rtr_http_default_params();
    hp.max_connections = (int)http_max_conns;
    hp.per_ip_connections = (int)http_per_ip;
    hp.idle_timeout_s = (int)http_idle_s;
    hp.request_timeout_s = (int)http_request_s;
    hp.n_threads = (int)http_threads;
    if (http_listen[0] && http_setup(hp, http_listen, listen, stls.cert[0] != 0, model, &http, err) < 0) {
        fprintf(stderr, "pdserve-router: %s\n", err);
        goto out;
    }
    /* Ready: every listener is up (launchers wait for this line; a port clash on the metrics
     * or HTTP port fails before it, not after). */
    printf("PORT %d\n", rpc_server_port(g.server));
    fflush(stdout);
    svc_metrics_announce(g.metrics);
    if (http) {
        printf("HTTP_PORT %d\n", rtr_http_port(http));
        fflush(stdout);
    }
    int sig = svc_wait_signal();
    PD_LOGI("signal %d: draining (grace %lld ms)", sig, (long long)grace_ms);
    pthread_mutex_lock(&g_health_mu); /* no health update turns it back to SERVING */
    g.draining = 1;
    pthread_mutex_unlock(&g_health_mu);
    rtr_http_drain(http); /* new HTTP requests: 503 */
    int cancelled = rpc_server_shutdown(g.server);
    PD_LOGI("drained; %d calls cancelled", cancelled);
    status = 0;
out:
    svc_metrics_stop(g.metrics); /* before its sources go */
    rtr_requests_stop(); /* after the drain: every waiting call was admitted or cancelled */
    rtr_http_stop(http); /* after the drain: its calls ended */
    rpc_server_destroy(g.server);
    rtr_registry_destroy(g.reg); /* after the server: requests reference instances */
    svc_metrics_destroy(g.metrics); /* after the last request was accounted */
    tok_destroy(g.tok);
    chat_template_destroy(g.chat);
    pd_flags_free();
    return status;
}
