/* svc_auth.c -- Caller identities for the internal ports (svc_auth.h). HMAC-SHA256 from
 * libcrypto; tokens compared in constant time. */
#include "svc/svc_auth.h"

#include <openssl/crypto.h>
#include <openssl/hmac.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "common/error.h"

static unsigned char g_key[4096];
static size_t g_key_len; /* 0 = no secret */

int svc_auth_load_secret(const char *path, char *err)
{
    OPENSSL_cleanse(g_key, sizeof g_key);
    g_key_len = 0;
    if (!path || !path[0]) return 0;
    FILE *f = fopen(path, "rb");
    if (!f) return pd_errf(err, PD_EIO, "cannot read the secret file %s", path);
    size_t n = fread(g_key, 1, sizeof g_key, f);
    int more = fgetc(f) != EOF;
    fclose(f);
    if (more) return pd_errf(err, PD_EINVAL, "the secret file %s is over %zu bytes", path, sizeof g_key);
    if (n > 0 && g_key[n - 1] == '\n') n--;
    if (n > 0 && g_key[n - 1] == '\r') n--;
    if (n < 16) {
        OPENSSL_cleanse(g_key, sizeof g_key);
        return pd_errf(err, PD_EINVAL, "the secret in %s has %zu bytes; at least 16 are needed",
                       path, n);
    }
    g_key_len = n;
    return 0;
}

/* HMAC-SHA256(secret, "pdserve-caller\0" name[0..nlen)) as 64 hex digits into hex[65]. */
static int mac_hex(const char *name, size_t nlen, char hex[65])
{
    static const char tag[] = "pdserve-caller"; /* with its NUL: the domain of these MACs */
    unsigned char msg[sizeof tag + 64], md[32];
    unsigned int mlen = 0;
    if (nlen > 64) return PD_EINVAL;
    memcpy(msg, tag, sizeof tag);
    memcpy(msg + sizeof tag, name, nlen);
    if (!HMAC(EVP_sha256(), g_key, (int)g_key_len, msg, sizeof tag + nlen, md, &mlen) || mlen != 32)
        return PD_EIO;
    for (int i = 0; i < 32; i++) snprintf(hex + 2 * i, 3, "%02x", md[i]);
    return 0;
}

static bool name_ok(const char *name, size_t n)
{
    if (n == 0 || n > 64) return false;
    for (size_t i = 0; i < n; i++)
        if (name[i] <= ' ' || name[i] > '~' || name[i] == ':') return false;
    return true;
}

int svc_auth_caller_token(const char *name, char *out, size_t len)
{
    if (!g_key_len) return PD_ENOTFOUND;
    const size_t n = name ? strlen(name) : 0;
    if (!name_ok(name, n) || len < n + 1 + 64 + 1) return PD_EINVAL;
    char hex[65];
    int rc = mac_hex(name, n, hex);
    if (rc < 0) return rc;
    snprintf(out, len, "%s:%s", name, hex);
    return 0;
}

void svc_auth_identity(const rpc_call *call, char *out, size_t len)
{
    char buf[SVC_IDENTITY_LEN];
    if (rpc_call_peer_identity(call, buf, sizeof buf) > 0) {
        snprintf(out, len, "cert:%s", buf);
        return;
    }
    char tok[64 + 1 + 64 + 8];
    const char *colon;
    int tl;
    if (g_key_len && (tl = rpc_call_metadata(call, SVC_CALLER_MD, tok, sizeof tok)) > 0 &&
        (size_t)tl < sizeof tok &&
        (colon = strchr(tok, ':')) && name_ok(tok, (size_t)(colon - tok)) && strlen(colon + 1) == 64) {
        char hex[65];
        if (mac_hex(tok, (size_t)(colon - tok), hex) == 0 && CRYPTO_memcmp(hex, colon + 1, 64) == 0) {
            snprintf(out, len, "caller:%.*s", (int)(colon - tok), tok);
            return;
        }
    }
    if (rpc_call_peer(call, buf, sizeof buf) < 0) snprintf(buf, sizeof buf, "?");
    snprintf(out, len, "addr:%s", buf);
}
