/* rpc_flags.c -- The TLS command-line flags that servers and clients share (see rpc.h), so
 * that every program spells and documents them the same way. */
#include "common/rpc/rpc.h"

#include <string.h>

void rpc_server_tls_flags_init(rpc_server_tls_flags *f)
{
    f->cert = "";
    f->key = "";
    f->client_ca = "";
    f->handshake_timeout_ms = rpc_server_default_params().handshake_timeout_ms;
}

void rpc_server_tls_flags_add(rpc_server_tls_flags *f, pd_flag *flags, int *n)
{
    pd_flag add[] = {
        {"tls-cert", PD_FLAG_STRING, &f->cert, "TLS: PEM certificate chain of this server (re-read when the file changes; unset = plaintext)", 1, 0},
        {"tls-key", PD_FLAG_STRING, &f->key, "TLS: PEM private key of --tls-cert", 1, 0},
        {"tls-client-ca", PD_FLAG_STRING, &f->client_ca, "TLS: require client certificates signed by this PEM CA (mutual TLS)", 1, 0},
        {"handshake-timeout-ms", PD_FLAG_INT, &f->handshake_timeout_ms, "close connections that have not finished the TLS/HTTP2 handshake by then", 1, 3600000},
    };
    for (size_t i = 0; i < sizeof add / sizeof add[0]; i++) flags[(*n)++] = add[i];
}

void rpc_server_tls_flags_apply(const rpc_server_tls_flags *f, rpc_server_params *p)
{
    p->tls.cert_file = f->cert;
    p->tls.key_file = f->key;
    p->tls.client_ca_file = f->client_ca;
    p->tls.require_client_cert = f->client_ca && *f->client_ca;
    p->handshake_timeout_ms = (int)f->handshake_timeout_ms;
}

void rpc_client_tls_flags_add(rpc_client_tls *t, pd_flag *flags, int *n, bool internal)
{
    if (!t->ca_file) t->ca_file = "";
    if (!t->cert_file) t->cert_file = "";
    if (!t->key_file) t->key_file = "";
    if (!t->server_name) t->server_name = "";
    pd_flag pub[] = {
        {"tls-ca", PD_FLAG_STRING, &t->ca_file, "TLS: connect with TLS, verifying the server with this PEM CA (unset = plaintext)", 1, 0},
        {"tls-cert", PD_FLAG_STRING, &t->cert_file, "TLS: PEM client certificate for servers that require one", 1, 0},
        {"tls-key", PD_FLAG_STRING, &t->key_file, "TLS: PEM private key of --tls-cert", 1, 0},
        {"tls-server-name", PD_FLAG_STRING, &t->server_name, "TLS: name the server certificate must carry (default: the address's host)", 1, 0},
    };
    pd_flag in[] = {
        {"internal-tls-ca", PD_FLAG_STRING, &t->ca_file, "TLS to the instances, verified with this PEM CA (unset = plaintext)", 1, 0},
        {"internal-tls-cert", PD_FLAG_STRING, &t->cert_file, "TLS to the instances: PEM client certificate (for --tls-client-ca instances)", 1, 0},
        {"internal-tls-key", PD_FLAG_STRING, &t->key_file, "TLS to the instances: PEM private key of --internal-tls-cert", 1, 0},
        {"internal-tls-server-name", PD_FLAG_STRING, &t->server_name, "TLS to the instances: name their certificates carry (default: the host named in --prefill/--decode)", 1, 0},
    };
    const pd_flag *add = internal ? in : pub;
    for (size_t i = 0; i < 4; i++) flags[(*n)++] = add[i];
}
