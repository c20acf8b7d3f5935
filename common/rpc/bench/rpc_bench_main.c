/* rpc_bench_main.c -- pdserve-rpc-bench: load generator for the gRPC layer with our C client
 * against pdserve-rpc-testserver. Measures unary calls/s (blocking calls from T threads,
 * Tokenize of a short text) and small-message server-stream msgs/s (K concurrent Generate
 * streams of N counter tokens, produced by the server's worker thread). A benchmark, not a
 * test; figures go to docs/perf-history.md ("gRPC layer"). */
#include <getopt.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/rpc/rpc.h"
#include "pdserve/v1/generation.pb-c.h"

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

typedef struct {
    rpc_channel *ch;
    double until;
    double *lat;        /* [cap] seconds per call */
    size_t n, cap;
    int64_t errors;
    /* stream mode */
    uint32_t n_tokens;
    int64_t msgs;
} worker;

static void *unary_main(void *arg)
{
    worker *w = arg;
    Pdserve__V1__TokenizeRequest req = PDSERVE__V1__TOKENIZE_REQUEST__INIT;
    req.text = "hello world";
    rpc_call_opts o = {.timeout_ms = 10000};
    while (now_s() < w->until) {
        ProtobufCMessage *m = NULL;
        double t0 = now_s();
        int rc = rpc_unary_call_opts(w->ch, "/pdserve.v1.Generation/Tokenize", &req.base,
                                &pdserve__v1__tokenize_response__descriptor, &o, &m, NULL);
        double dt = now_s() - t0;
        if (rc != 0) {
            w->errors++;
            continue;
        }
        protobuf_c_message_free_unpacked(m, NULL);
        if (w->n < w->cap) w->lat[w->n] = dt;
        w->n++;
    }
    return NULL;
}

static void *stream_main(void *arg)
{
    worker *w = arg;
    Pdserve__V1__StoppingCriteria sc = PDSERVE__V1__STOPPING_CRITERIA__INIT;
    sc.max_tokens_set_case = PDSERVE__V1__STOPPING_CRITERIA__MAX_TOKENS_SET_MAX_TOKENS;
    sc.max_tokens = w->n_tokens;
    Pdserve__V1__GenerateRequest req = PDSERVE__V1__GENERATE_REQUEST__INIT;
    req.prompt = "x";
    req.stopping = &sc;
    rpc_client_stream *s;
    char err[PD_ERR_LEN];
    rpc_call_opts o = {.timeout_ms = 600000};
    if (rpc_client_stream_open_opts(w->ch, "/pdserve.v1.Generation/Generate", &req.base,
                               &pdserve__v1__generate_response__descriptor, &o, &s, err) != 0) {
        w->errors++;
        return NULL;
    }
    ProtobufCMessage *m;
    while (rpc_client_stream_next(s, &m) == 1) {
        w->msgs++;
        protobuf_c_message_free_unpacked(m, NULL);
    }
    rpc_status st;
    if (rpc_client_stream_status(s, &st) != 0) {
        fprintf(stderr, "stream ended with %s: %s\n", rpc_status_name(st.code), st.details);
        w->errors++;
    }
    rpc_client_stream_close(s);
    return NULL;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static int run_unary(rpc_channel *ch, int threads, double seconds)
{
    worker *w = calloc((size_t)threads, sizeof *w);
    pthread_t *t = calloc((size_t)threads, sizeof *t);
    double t0 = now_s();
    for (int i = 0; i < threads; i++) {
        w[i].ch = ch;
        w[i].until = t0 + seconds;
        w[i].cap = 1 << 21;
        w[i].lat = malloc(w[i].cap * sizeof *w[i].lat);
        pthread_create(&t[i], NULL, unary_main, &w[i]);
    }
    size_t total = 0, kept = 0;
    int64_t errors = 0;
    for (int i = 0; i < threads; i++) {
        pthread_join(t[i], NULL);
        total += w[i].n;
        errors += w[i].errors;
    }
    double el = now_s() - t0;
    double *all = malloc((total ? total : 1) * sizeof *all);
    for (int i = 0; i < threads; i++) {
        size_t n = w[i].n < w[i].cap ? w[i].n : w[i].cap;
        memcpy(all + kept, w[i].lat, n * sizeof *all);
        kept += n;
        free(w[i].lat);
    }
    qsort(all, kept, sizeof *all, cmp_double);
    double p50 = kept ? all[kept / 2] : 0, p99 = kept ? all[(size_t)((double)kept * 0.99)] : 0;
    printf("unary: threads=%d calls=%zu errors=%" PRId64 " elapsed=%.2fs  %.0f calls/s  "
           "p50=%.0fus p99=%.0fus\n",
           threads, total, errors, el, (double)total / el, p50 * 1e6, p99 * 1e6);
    free(all);
    free(w);
    free(t);
    return errors ? 1 : 0;
}

static int run_stream(rpc_channel *ch, int streams, uint32_t n_tokens)
{
    worker *w = calloc((size_t)streams, sizeof *w);
    pthread_t *t = calloc((size_t)streams, sizeof *t);
    double t0 = now_s();
    for (int i = 0; i < streams; i++) {
        w[i].ch = ch;
        w[i].n_tokens = n_tokens;
        pthread_create(&t[i], NULL, stream_main, &w[i]);
    }
    int64_t msgs = 0, errors = 0;
    for (int i = 0; i < streams; i++) {
        pthread_join(t[i], NULL);
        msgs += w[i].msgs;
        errors += w[i].errors;
    }
    double el = now_s() - t0;
    printf("stream: streams=%d msgs=%" PRId64 " errors=%" PRId64 " elapsed=%.2fs  %.0f msgs/s\n",
           streams, msgs, errors, el, (double)msgs / el);
    free(w);
    free(t);
    return errors ? 1 : 0;
}

static void usage(FILE *f)
{
    fprintf(f, "usage: pdserve-rpc-bench --target HOST:PORT [options]\n"
               "  --mode unary|stream|both   (default both)\n"
               "  --threads T      unary client threads (default 8)\n"
               "  --seconds S      unary run time (default 5)\n"
               "  --streams K      concurrent streams (default 1)\n"
               "  --tokens N       messages per stream (default 200000)\n"
               "Start the server with: pdserve-rpc-testserver --port-file FILE\n");
}

int main(int argc, char **argv)
{
    const char *target = NULL, *mode = "both";
    int threads = 8, streams = 1;
    double seconds = 5;
    uint32_t tokens = 200000;
    static const struct option opts[] = {
        {"target", required_argument, 0, 'a'}, {"mode", required_argument, 0, 'm'},
        {"threads", required_argument, 0, 't'}, {"seconds", required_argument, 0, 's'},
        {"streams", required_argument, 0, 'k'}, {"tokens", required_argument, 0, 'n'},
        {"help", no_argument, 0, 'h'},          {0, 0, 0, 0}};
    int o;
    while ((o = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (o) {
        case 'a': target = optarg; break;
        case 'm': mode = optarg; break;
        case 't': threads = atoi(optarg); break;
        case 's': seconds = atof(optarg); break;
        case 'k': streams = atoi(optarg); break;
        case 'n': tokens = (uint32_t)strtoul(optarg, NULL, 10); break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
    }
    if (!target || threads < 1 || streams < 1) {
        usage(stderr);
        return 2;
    }
    rpc_channel_params cp = rpc_channel_default_params();
    cp.target = target;
    cp.wait_for_ready = true;
    rpc_channel *ch;
    char err[PD_ERR_LEN];
    if (rpc_channel_create(&cp, &ch, err) != 0) {
        fprintf(stderr, "pdserve-rpc-bench: %s\n", err);
        return 1;
    }
    int rc = 0;
    if (!strcmp(mode, "unary") || !strcmp(mode, "both")) rc |= run_unary(ch, threads, seconds);
    if (!strcmp(mode, "stream") || !strcmp(mode, "both")) rc |= run_stream(ch, streams, tokens);
    rpc_channel_destroy(ch);
    return rc;
}
