/* svc_http.c -- /metrics over HTTP with libmicrohttpd (see svc_http.h). */
#include "svc/svc_http.h"

#include <microhttpd.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "common/error.h"
#include "common/net.h"

struct svc_http {
    struct MHD_Daemon *d;
    pd_metrics *m;
    int port;
};

static enum MHD_Result reply(struct MHD_Connection *c, unsigned code, const char *type,
                             char *body, size_t len, bool owned)
{
    struct MHD_Response *r = MHD_create_response_from_buffer(
        len, body, owned ? MHD_RESPMEM_MUST_FREE : MHD_RESPMEM_PERSISTENT);
    if (!r) {
        if (owned) free(body);
        return MHD_NO;
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, type);
    enum MHD_Result rc = MHD_queue_response(c, code, r);
    MHD_destroy_response(r);
    return rc;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url,
                                  const char *method, const char *version,
                                  const char *upload_data, size_t *upload_size, void **state)
{
    (void)version;
    (void)upload_data;
    svc_http *h = cls;
    static int first;
    if (*state == NULL) { /* headers only so far; the body (none for GET) comes next */
        *state = &first;
        return MHD_YES;
    }
    *upload_size = 0;
    if (strcmp(method, MHD_HTTP_METHOD_GET) && strcmp(method, MHD_HTTP_METHOD_HEAD))
        return reply(c, MHD_HTTP_METHOD_NOT_ALLOWED, "text/plain", "GET only\n", 9, false);
    if (!strcmp(url, "/metrics")) {
        char *body;
        size_t len;
        if (pd_metrics_render(h->m, &body, &len) < 0)
            return reply(c, MHD_HTTP_INTERNAL_SERVER_ERROR, "text/plain", "out of memory\n", 14, false);
        return reply(c, MHD_HTTP_OK, PD_METRICS_CONTENT_TYPE, body, len, true);
    }
    if (!strcmp(url, "/")) {
        static char idx[] = "pdserve metrics endpoint: GET /metrics (Prometheus text format)\n";
        return reply(c, MHD_HTTP_OK, "text/plain", idx, sizeof idx - 1, false);
    }
    static char nf[] = "not found; try /metrics\n";
    return reply(c, MHD_HTTP_NOT_FOUND, "text/plain", nf, sizeof nf - 1, false);
}

int svc_http_start(pd_metrics *m, const char *host, int port, svc_http **out, char *err)
{
    *out = NULL;
    if (port < 0 || port > 65535) return pd_errf(err, PD_EINVAL, "bad metrics port %d", port);
    struct addrinfo *res = NULL;
    char why[PD_ERR_LEN];
    if (pd_net_listen_addr(host, port, &res, why) < 0)
        return pd_errf(err, PD_EINVAL, "metrics address %s: %s", host ? host : "", why);
    svc_http *h = calloc(1, sizeof *h);
    if (!h) {
        freeaddrinfo(res);
        return pd_errf(err, PD_ENOMEM, "out of memory");
    }
    h->m = m;
    unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_POLL;
    if (res->ai_family == AF_INET6) flags |= MHD_USE_IPv6;
    h->d = MHD_start_daemon(flags, (uint16_t)port, NULL, NULL, on_request, h,
                            MHD_OPTION_SOCK_ADDR, res->ai_addr,
                            MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)30,
                            MHD_OPTION_CONNECTION_LIMIT, (unsigned)64,
                            MHD_OPTION_END);
    freeaddrinfo(res);
    if (!h->d) {
        free(h);
        return pd_errf(err, PD_EIO, "cannot serve metrics on %s:%d (address in use?)",
                       host && *host ? host : "0.0.0.0", port);
    }
    const union MHD_DaemonInfo *info = MHD_get_daemon_info(h->d, MHD_DAEMON_INFO_BIND_PORT);
    h->port = info ? info->port : port;
    *out = h;
    return 0;
}

int svc_http_port(const svc_http *h) { return h ? h->port : 0; }

void svc_http_stop(svc_http *h)
{
    if (!h) return;
    MHD_stop_daemon(h->d);
    free(h);
}
