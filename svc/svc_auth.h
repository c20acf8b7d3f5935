/* svc_auth.h -- Who calls an internal port: the identity that reservation admission (and any
 * per-caller limit) is keyed by. In order of strength: the verified client certificate of a
 * mutual-TLS call ("cert:<SAN or CN>"); a caller token signed with the deployment's shared
 * secret (--kv-secret-file, the file that already authenticates KV transfers), sent by the
 * router as request metadata x-pdserve-caller ("caller:<name>"); else the peer's host address
 * ("addr:<host>"), which every process on that host shares. A process without the secret or
 * the certificate therefore never lands in the router's slot, whatever host it runs on. */
#ifndef PD_SVC_AUTH_H
#define PD_SVC_AUTH_H

#include <stddef.h>

#include "common/rpc/rpc.h"

#define SVC_CALLER_MD "x-pdserve-caller"
#define SVC_IDENTITY_LEN 160

/* Loads the shared secret from path for caller tokens (the whole file less one trailing
 * newline, at least 16 bytes; the rules of kvtransfer's secret). NULL or "" clears it.
 * Call once at start, before any other thread uses this module. Returns 0, PD_EIO (cannot
 * read it) or PD_EINVAL (too short), with err. */
int svc_auth_load_secret(const char *path, char *err);

/* The caller token for name (printable, no ':'; at most 64 bytes) into out: "<name>:<64 hex
 * digits of HMAC-SHA256(secret, "pdserve-caller\0" name)>". Returns 0, PD_ENOTFOUND (no
 * secret loaded), PD_EINVAL (bad name or out too small) or PD_EIO. */
int svc_auth_caller_token(const char *name, char *out, size_t len);

/* The identity of call's caller into out (SVC_IDENTITY_LEN bytes): see the top. A token that
 * does not verify (or any token while no secret is loaded) counts as none. */
void svc_auth_identity(const rpc_call *call, char *out, size_t len);

#endif
