/* test_metrics.c -- The metrics registry (common/metrics.h) and its HTTP endpoint
 * (svc/svc_http.h): names and types checked, exact text exposition for counters,
 * gauges, labels with escaping and histograms, hidden series, concurrent updates from
 * several threads, and GET /metrics, / and a 404 over a real socket on loopback. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/error.h"
#include "common/metrics.h"
#include "svc/svc_http.h"
#include "tests/test_util.h"

static void test_names(void)
{
    pd_metrics *m;
    CHECK_EQ_INT(pd_metrics_create(&m), 0);
    CHECK(pd_metrics_family(m, PD_METRIC_COUNTER, "x_requests", "no _total", NULL, 0) == NULL);
    CHECK(pd_metrics_family(m, PD_METRIC_GAUGE, "9bad", "", NULL, 0) == NULL);
    CHECK(pd_metrics_family(m, PD_METRIC_GAUGE, "bad-name", "", NULL, 0) == NULL);
    double b[] = {1, 0.5};
    CHECK(pd_metrics_family(m, PD_METRIC_HISTOGRAM, "h_seconds", "", b, 2) == NULL);
    pd_mfamily *f = pd_metrics_family(m, PD_METRIC_GAUGE, "g_blocks", "", NULL, 0);
    CHECK(f != NULL);
    CHECK(pd_metrics_family(m, PD_METRIC_GAUGE, "g_blocks", "", NULL, 0) == f);
    CHECK(pd_metrics_family(m, PD_METRIC_COUNTER, "g_blocks", "", NULL, 0) == NULL);
    CHECK(pd_mfamily_series(f, "a=\"1\"") == pd_mfamily_series(f, "a=\"1\""));
    char l[32] = "";
    CHECK_EQ_INT(pd_metrics_label(l, sizeof l, "k", "a\"b\\c\nd"), 0);
    CHECK(!strcmp(l, "k=\"a\\\"b\\\\c\\nd\""));
    CHECK_EQ_INT(pd_metrics_label(l, sizeof l, "addr", "0123456789"), PD_ERANGE);
    CHECK(!strcmp(l, "k=\"a\\\"b\\\\c\\nd\""));
    pd_metrics_destroy(m);
    pd_metrics_destroy(NULL);
}

static int n_collect;
static void collector(pd_metrics *m, void *arg)
{
    (void)arg;
    n_collect++;
    pd_metric_set(pd_metrics_gauge(m, "test_sampled_ratio", NULL, "set at scrape"), 0.25);
}

static void test_render(void)
{
    pd_metrics *m;
    CHECK_EQ_INT(pd_metrics_create(&m), 0);
    pd_metric *c = pd_metrics_counter(m, "test_requests_total", "outcome=\"ok\"", "requests\nby outcome");
    pd_metric *c2 = pd_metrics_counter(m, "test_requests_total", "outcome=\"cancelled\"", NULL);
    pd_metric_add(c, 2);
    pd_metric_add(c, 1);
    pd_metric_add(c, -5); /* counters never go down */
    pd_metric_add(c2, 0);
    double b[] = {0.1, 0.5, 1};
    pd_metric *h = pd_metrics_histogram(m, "test_latency_seconds", NULL, "latency", b, 3);
    pd_metric_observe(h, 0.05);
    pd_metric_observe(h, 0.1); /* le is inclusive */
    pd_metric_observe(h, 0.7);
    pd_metric_observe(h, 3);
    pd_mfamily *dyn = pd_metrics_family(m, PD_METRIC_GAUGE, "test_instance_up", "per instance", NULL, 0);
    pd_metric_set(pd_mfamily_series(dyn, "addr=\"a\""), 1);
    pd_metric_set(pd_mfamily_series(dyn, "addr=\"b\""), 0);
    pd_mfamily_hide_all(dyn);
    pd_metric_set(pd_mfamily_series(dyn, "addr=\"b\""), 1);
    pd_metrics_family(m, PD_METRIC_GAUGE, "test_empty", "no series: not rendered", NULL, 0);
    pd_metrics_set_collector(m, collector, NULL);
    CHECK_NEAR(pd_metric_value(c), 3, 0);
    CHECK_NEAR(pd_metric_value(h), 4, 0);
    char *text;
    size_t len;
    CHECK_EQ_INT(pd_metrics_render(m, &text, &len), 0);
    CHECK_EQ_INT(n_collect, 1);
    const char *want =
        "# HELP test_requests_total requests\\nby outcome\n"
        "# TYPE test_requests_total counter\n"
        "test_requests_total{outcome=\"ok\"} 3\n"
        "test_requests_total{outcome=\"cancelled\"} 0\n"
        "# HELP test_latency_seconds latency\n"
        "# TYPE test_latency_seconds histogram\n"
        "test_latency_seconds_bucket{le=\"0.1\"} 2\n"
        "test_latency_seconds_bucket{le=\"0.5\"} 2\n"
        "test_latency_seconds_bucket{le=\"1\"} 3\n"
        "test_latency_seconds_bucket{le=\"+Inf\"} 4\n"
        "test_latency_seconds_sum 3.8500000000000001\n"
        "test_latency_seconds_count 4\n"
        "# HELP test_instance_up per instance\n"
        "# TYPE test_instance_up gauge\n"
        "test_instance_up{addr=\"b\"} 1\n"
        "# HELP test_sampled_ratio set at scrape\n"
        "# TYPE test_sampled_ratio gauge\n"
        "test_sampled_ratio 0.25\n";
    CHECK_MSG(!strcmp(text, want), "got:\n%s\nwant:\n%s", text, want);
    CHECK_EQ_INT(len, strlen(text));
    free(text);
    pd_metrics_destroy(m);
}

typedef struct {
    pd_metric *c, *h;
} hammer_arg;

static void *hammer(void *p)
{
    hammer_arg *a = p;
    for (int i = 0; i < 20000; i++) {
        pd_metric_add(a->c, 1);
        pd_metric_observe(a->h, (i % 4) * 0.25);
    }
    return NULL;
}

static void test_threads(void)
{
    pd_metrics *m;
    CHECK_EQ_INT(pd_metrics_create(&m), 0);
    double b[] = {0.1, 0.3};
    hammer_arg a = {pd_metrics_counter(m, "t_total", NULL, ""),
                    pd_metrics_histogram(m, "t_seconds", "x=\"1\"", "", b, 2)};
    pthread_t th[4];
    for (int i = 0; i < 4; i++) pthread_create(&th[i], NULL, hammer, &a);
    for (int i = 0; i < 4; i++) pthread_join(th[i], NULL);
    CHECK_NEAR(pd_metric_value(a.c), 80000, 0);
    char *text;
    size_t len;
    CHECK_EQ_INT(pd_metrics_render(m, &text, &len), 0);
    CHECK_STR_CONTAINS(text, "t_seconds_bucket{x=\"1\",le=\"0.1\"} 20000\n");
    CHECK_STR_CONTAINS(text, "t_seconds_bucket{x=\"1\",le=\"0.3\"} 40000\n");
    CHECK_STR_CONTAINS(text, "t_seconds_count{x=\"1\"} 80000\n");
    CHECK_STR_CONTAINS(text, "t_seconds_sum{x=\"1\"} 30000\n");
    free(text);
    pd_metrics_destroy(m);
}

/* One HTTP/1.0 GET on loopback; returns the whole response (caller frees). */
static char *http_get(int port, const char *path)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa;
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_port = htons((uint16_t)port);
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) < 0) {
        close(fd);
        return NULL;
    }
    char req[256];
    int n = snprintf(req, sizeof req, "GET %s HTTP/1.0\r\nHost: x\r\n\r\n", path);
    if (write(fd, req, (size_t)n) != n) {
        close(fd);
        return NULL;
    }
    size_t cap = 4096, len = 0;
    char *buf = malloc(cap);
    ssize_t r;
    while (buf && (r = read(fd, buf + len, cap - len - 1)) > 0) {
        len += (size_t)r;
        if (cap - len < 2) {
            char *nb = realloc(buf, cap *= 2);
            if (!nb) {
                free(buf);
                buf = NULL;
            }
            buf = nb;
        }
    }
    if (buf) buf[len] = 0;
    close(fd);
    return buf;
}

static void test_http(void)
{
    pd_metrics *m;
    CHECK_EQ_INT(pd_metrics_create(&m), 0);
    pd_metric_add(pd_metrics_counter(m, "pdserve_x_total", NULL, "x"), 7);
    svc_http *h = NULL;
    char err[PD_ERR_LEN] = "";
    CHECK_EQ_INT(svc_http_start(m, "127.0.0.1", 0, &h, err), 0);
    int port = svc_http_port(h);
    CHECK(port > 0);
    char *r = http_get(port, "/metrics");
    CHECK_STR_CONTAINS(r, " 200 OK\r\n");
    CHECK_STR_CONTAINS(r, "Content-Type: text/plain; version=0.0.4");
    CHECK_STR_CONTAINS(r, "\r\n\r\n# HELP pdserve_x_total x\n# TYPE pdserve_x_total counter\npdserve_x_total 7\n");
    free(r);
    r = http_get(port, "/nope");
    CHECK_STR_CONTAINS(r, " 404 ");
    free(r);
    r = http_get(port, "/");
    CHECK_STR_CONTAINS(r, " 200 ");
    free(r);
    /* The same port again: in use. */
    svc_http *h2 = NULL;
    CHECK_EQ_INT(svc_http_start(m, "127.0.0.1", port, &h2, err), PD_EIO);
    CHECK(h2 == NULL);
    CHECK_EQ_INT(svc_http_start(m, "no.such.host.invalid", 0, &h2, err), PD_EINVAL);
    svc_http_stop(h);
    svc_http_stop(NULL);
    CHECK(http_get(port, "/metrics") == NULL);
    pd_metrics_destroy(m);
}

int main(void)
{
    test_names();
    test_render();
    test_threads();
    test_http();
    return pd_test_result("test_metrics");
}
