/* rtr_http.h -- The router's OpenAI-compatible HTTP front (--http-listen): POST /v1/completions,
 * POST /v1/chat/completions (JSON or server-sent events), GET /v1/models, GET /health.
 * Each generation is a call of the router's own public Generate RPC over a loopback gRPC
 * channel, so validation, chat templates, routing, stop strings and detokenization are the
 * gRPC path's.
 * libmicrohttpd serves it from an event loop on n_threads threads; a connection waiting for
 * tokens is suspended (it holds a socket, no thread); a client that goes away cancels its
 * calls. Connections that do not send a complete request by a deadline, idle ones, and those
 * over the limits (in all, per client address) are closed, so that slow or idle clients
 * cannot starve the others. docs/api.md describes the endpoints. */
#ifndef PD_ROUTER_RTR_HTTP_H
#define PD_ROUTER_RTR_HTTP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/metrics.h"
#include "text/tokenizer.h"

typedef struct rtr_http rtr_http; /* opaque */

typedef struct {
    const char *listen;           /* "host:port" to serve HTTP on (port 0 = any free port;
                                     "[v6]:port" for IPv6); required */
    const char *grpc_target;      /* the router's public gRPC address as a client reaches it
                                     over loopback ("127.0.0.1:50051"); required */
    const char *model_name;       /* the served name (responses' model, /v1/models); copied */
    const char *system_fingerprint; /* responses' and stream chunks' system_fingerprint
                                     (rtr_http_system_fingerprint); copied, at most
                                     RTR_HTTP_FINGERPRINT_LEN - 1 bytes; NULL or "" = null */
    const tok_tokenizer *tok;     /* the router's tokenizer (the text of logprobs' tokens);
                                     borrowed, must outlive rtr_http_stop; NULL = none */
    int32_t max_model_len;        /* shown in /v1/models */
    int64_t timeout_ms;           /* deadline of a request's Generate calls, ms, >= 1 (a
                                     shorter X-Stainless-Timeout header wins) */
    int64_t max_body_bytes;       /* largest request body, bytes (larger: 413); default 4 MiB */
    int max_connections;          /* open connections at most (each holds a descriptor: lowered
                                     to RLIMIT_NOFILE less 256); default 4096 */
    int per_ip_connections;       /* open connections from one client address at most, 0 = no
                                     limit; default 1024 */
    int n_threads;                /* libmicrohttpd's event-loop threads, >= 1; default 2 */
    int idle_timeout_s;           /* a connection with no traffic this long is closed (one
                                     waiting for tokens is not idle), >= 1; default 30 */
    int request_timeout_s;        /* a request's headers and body must be in this long after
                                     the connection opened (on a kept-alive connection: after
                                     the previous response plus idle_timeout_s), else the
                                     connection is closed; 0 = no deadline; default 10 */
    int max_choices;              /* prompts x n per request, at most; default 16 */
    /* Optional: the number of decode instances that are up (/health says 503 at 0). */
    int (*instances_up)(void *user);
    void *user;                   /* passed to instances_up; borrowed */
    pd_metrics *metrics;          /* registry for pdserve_http_* families; borrowed, NULL =
                                     none */
} rtr_http_params;

rtr_http_params rtr_http_default_params(void);

/* Room for a system_fingerprint, NUL included. */
#define RTR_HTTP_FINGERPRINT_LEN 64

/* The system_fingerprint of the OpenAI responses for the model in model_dir:
 * "pdserve-<version>-<16 hex digits>", the digits an XXH64 of the model fingerprint
 * (svc_model_fingerprint: config.json and the weights' identity) and of tokenizer.json,
 * tokenizer_config.json (the chat template), chat_template.jinja and generation_config.json
 * where present. The same build and model files give the same string on every router (the
 * directory's path does not count); another pdserve version, config, tokenizer, template or
 * weights give another. Writes it into out (len >= RTR_HTTP_FINGERPRINT_LEN). Reads the files;
 * call it once at startup. */
void rtr_http_system_fingerprint(const char *model_dir, char *out, size_t len);

/* Opens the loopback channel and starts serving. p is copied. Returns 0, PD_EINVAL (bad listen address or params), PD_EIO (cannot
 * bind: address in use), PD_ENOMEM; err (PD_ERR_LEN) says why. */
int rtr_http_start(const rtr_http_params *p, rtr_http **out, char *err);

/* The bound port. */
int rtr_http_port(const rtr_http *h);

/* From now on new generation requests and /health answer 503 (the router drains); requests
 * in progress go on. Thread-safe. */
void rtr_http_drain(rtr_http *h);

/* Closes every connection (their calls are cancelled), waits for the server's threads and
 * the calls, and frees everything. Call it after the gRPC server has drained. NULL is a
 * no-op. */
void rtr_http_stop(rtr_http *h);

/* Parses "host:port" ("[v6]:port", ":port" = every address) into host (without brackets;
 * "" for every address) and port. Returns 0 or PD_EINVAL. */
int rtr_http_split_hostport(const char *s, char *host, size_t host_len, int *port);

/* The address that reaches, over loopback, a gRPC server listening on grpc_listen
 * ("0.0.0.0:50051", "[::]:0", "10.0.0.5:7000") with bound port: "127.0.0.1:PORT", "[::1]:PORT"
 * or the listen host itself. Returns 0 or PD_EINVAL. */
int rtr_http_loopback_target(const char *grpc_listen, int port, char *out, size_t len);

#endif
