/* test_metrics.c -- The metrics registry (common/metrics.h) and its HTTP endpoint
 * (svc/svc_http.h): names and types checked, exact text exposition for counters,
 * gauges, labels with escaping and histograms, hidden series, concurrent updates from
 * several threads, and GET /metrics, / and a 404 over a real socket on loopback; the
 * process_* figures (svc_process_stats_read) following what this process does, and in the
 * service metrics set's text. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "common/error.h"
#include "common/metrics.h"
#include "svc/svc_http.h"
#include "svc/svc_metrics.h"
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

static double cpu_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* The value of the series line "name value" in text, or -1 when absent. */
static double rendered(const char *text, const char *name)
{
    char key[128];
    snprintf(key, sizeof key, "\n%s ", name);
    const char *p = strstr(text, key);
    return p ? strtod(p + strlen(key), NULL) : -1;
}

/* process_*: each figure follows what the process does (descriptors opened, limit lowered,
 * memory touched, CPU burnt), and the service metrics set exports them (counter and gauges,
 * Prometheus's names). Run before any other thread exists, so that descriptors are ours. */
static void test_process(void)
{
    char err[PD_ERR_LEN] = "";
    svc_process_stats a, b;
    CHECK_MSG(svc_process_stats_read(&a, err) == 0, "%s", err);
    CHECK_MSG(a.open_fds >= 3, "open fds %g", a.open_fds);
    int fds[3];
    for (int i = 0; i < 3; i++) fds[i] = open("/dev/null", O_RDONLY);
    CHECK_EQ_INT(svc_process_stats_read(&b, err), 0);
    CHECK_MSG(b.open_fds == a.open_fds + 3, "open fds %g after opening 3, %g before", b.open_fds, a.open_fds);
    for (int i = 0; i < 3; i++) close(fds[i]);
    CHECK_EQ_INT(svc_process_stats_read(&b, err), 0);
    CHECK_MSG(b.open_fds == a.open_fds, "open fds %g after closing them, %g before", b.open_fds, a.open_fds);

    struct rlimit rl, low;
    CHECK_EQ_INT(getrlimit(RLIMIT_NOFILE, &rl), 0);
    CHECK_MSG(a.max_fds == (double)rl.rlim_cur, "max fds %g, RLIMIT_NOFILE %g", a.max_fds, (double)rl.rlim_cur);
    low = rl;
    low.rlim_cur = 200;
    CHECK_EQ_INT(setrlimit(RLIMIT_NOFILE, &low), 0);
    CHECK_EQ_INT(svc_process_stats_read(&b, err), 0);
    CHECK_MSG(b.max_fds == 200, "max fds %g after lowering the soft limit to 200", b.max_fds);
    CHECK_EQ_INT(setrlimit(RLIMIT_NOFILE, &rl), 0);

    CHECK_MSG(a.resident_bytes > 0 && a.virtual_bytes >= a.resident_bytes, "rss %g, vsize %g",
              a.resident_bytes, a.virtual_bytes);
    size_t big = 64u << 20;
    char *mem = malloc(big);
    CHECK(mem != NULL);
    if (mem) memset(mem, 1, big);
    CHECK_EQ_INT(svc_process_stats_read(&b, err), 0);
    CHECK_MSG(b.resident_bytes >= a.resident_bytes + 48.0 * (1 << 20) &&
              b.virtual_bytes >= a.virtual_bytes + 60.0 * (1 << 20),
              "64 MiB touched: rss %g -> %g, vsize %g -> %g", a.resident_bytes, b.resident_bytes,
              a.virtual_bytes, b.virtual_bytes);
    /* CPU: burn 0.3 s of this process's CPU time (the kernel's count, not the wall clock). */
    volatile double x = 0;
    for (double t0 = cpu_now(); cpu_now() - t0 < 0.3;)
        for (int i = 0; i < 100000; i++) x += mem ? mem[i % big] : 1;
    free(mem);
    CHECK_EQ_INT(svc_process_stats_read(&b, err), 0);
    CHECK_MSG(b.cpu_seconds >= a.cpu_seconds + 0.25, "cpu %g -> %g after 0.3 s of work", a.cpu_seconds,
              b.cpu_seconds);
    double now = (double)time(NULL);
    CHECK_MSG(a.start_time_seconds > now - 3600 && a.start_time_seconds <= now + 1,
              "start time %.2f, now %.0f", a.start_time_seconds, now);

    /* The service metrics set (the router's: no engine) exports them. */
    svc_metrics_params p = {.role = "router", .listen = "127.0.0.1:0", .port = -1};
    svc_metrics *sm = NULL;
    CHECK_EQ_INT(svc_metrics_create(&p, &sm, err), 0);
    char *text = NULL;
    size_t len = 0;
    CHECK_EQ_INT(pd_metrics_render(svc_metrics_registry(sm), &text, &len), 0);
    CHECK_STR_CONTAINS(text, "# TYPE process_cpu_seconds_total counter\n");
    static const char *const gauges[] = {"process_resident_memory_bytes", "process_virtual_memory_bytes",
                                         "process_open_fds", "process_max_fds", "process_start_time_seconds"};
    for (size_t i = 0; i < sizeof gauges / sizeof gauges[0]; i++) {
        char t[128];
        snprintf(t, sizeof t, "# TYPE %s gauge\n", gauges[i]);
        CHECK_STR_CONTAINS(text, t);
        CHECK_MSG(rendered(text, gauges[i]) > 0, "%s: %g", gauges[i], rendered(text, gauges[i]));
    }
    CHECK_MSG(rendered(text, "process_cpu_seconds_total") >= b.cpu_seconds, "rendered cpu %g, read %g",
              rendered(text, "process_cpu_seconds_total"), b.cpu_seconds);
    CHECK_MSG(rendered(text, "process_max_fds") == (double)rl.rlim_cur, "rendered max fds %g",
              rendered(text, "process_max_fds"));
    CHECK_MSG(fabs(rendered(text, "process_start_time_seconds") - a.start_time_seconds) < 0.5,
              "rendered start time %.2f, read %.2f", rendered(text, "process_start_time_seconds"),
              a.start_time_seconds);
    free(text);
    svc_metrics_destroy(sm);
}

int main(void)
{
    test_process();
    test_names();
    test_render();
    test_threads();
    test_http();
    return pd_test_result("test_metrics");
}
