/* net.c -- Listening addresses for the services' HTTP endpoints (see net.h). */
#include "common/net.h"

#include <arpa/inet.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>

#include "common/error.h"

int pd_net_listen_addr(const char *host, int port, struct addrinfo **out, char *err)
{
    *out = NULL;
    if (port < 0 || port > 65535) return pd_errf(err, PD_EINVAL, "bad port %d", port);
    struct addrinfo hints;
    memset(&hints, 0, sizeof hints);
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    const char *hh = host && *host && strcmp(host, "0.0.0.0") ? host : NULL;
    char v6[INET6_ADDRSTRLEN + 2];
    const size_t len = hh ? strlen(hh) : 0;
    if (len >= 2 && hh[0] == '[' && hh[len - 1] == ']') { /* [v6] as in host:port strings */
        snprintf(v6, sizeof v6, "%.*s", (int)len - 2, hh + 1);
        hh = v6;
    }
    if (!hh) hints.ai_family = AF_INET; /* every IPv4 address, as gRPC's 0.0.0.0 */
    struct addrinfo *res = NULL;
    const int grc = getaddrinfo(hh, ps, &hints, &res);
    if (grc != 0 || !res) {
        if (res) freeaddrinfo(res);
        return pd_errf(err, PD_EINVAL, "%s", grc ? gai_strerror(grc) : "no address");
    }
    *out = res;
    return 0;
}
