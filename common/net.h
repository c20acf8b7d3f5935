/* net.h -- The address a listening TCP socket binds, resolved the one way every HTTP endpoint
 * of the services does it (the metrics endpoint, the router's OpenAI-compatible front): a host
 * as the flags give it, bracketed IPv6 included, and "every address" as gRPC's 0.0.0.0. */
#ifndef PD_NET_H
#define PD_NET_H

#include <netdb.h>

/* Resolves host and port for a passive TCP socket into *out (the first of getaddrinfo's list;
 * caller frees with freeaddrinfo). host: a numeric IPv4 or IPv6 address, bracketed or not
 * ("[::1]"), or a name; NULL, "" and "0.0.0.0" mean every IPv4 address. port: 0 .. 65535 (0 =
 * any free port). Returns 0, or PD_EINVAL with getaddrinfo's reason in err (the caller names
 * the flag). */
int pd_net_listen_addr(const char *host, int port, struct addrinfo **out, char *err);

#endif
