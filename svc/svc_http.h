/* svc_http.h -- The metrics HTTP endpoint of a service (libmicrohttpd, one internal thread):
 * GET /metrics answers the registry in the Prometheus text format; GET / lists the paths;
 * anything else is 404 (405 for other methods). Kept out of common/ so that the core
 * library does not depend on libmicrohttpd. */
#ifndef PD_SVC_HTTP_H
#define PD_SVC_HTTP_H

#include "common/metrics.h"

typedef struct svc_http svc_http; /* opaque */

/* Starts serving m (borrowed; must outlive svc_http_stop) on host:port (host a numeric
 * IPv4/IPv6 address or a name; "" = every address; port 0 = any free port). Returns 0,
 * PD_EINVAL (bad host), PD_EIO (cannot bind: in use), PD_ENOMEM; err says why. */
int svc_http_start(pd_metrics *m, const char *host, int port, svc_http **out, char *err);
/* The bound port. */
int svc_http_port(const svc_http *h);
/* Stops the thread and closes the socket. NULL is a no-op. */
void svc_http_stop(svc_http *h);

#endif
