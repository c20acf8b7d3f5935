/* rpc_tls.c -- Transport security of the gRPC layer: reads and checks PEM files (with
 * OpenSSL, so that a bad file is reported by name and reason before gRPC sees it), builds the
 * server's SSL credentials on a certificate-config fetcher that re-reads the files when they
 * change, and the client's SSL channel credentials. */
#include "common/rpc/rpc_impl.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <grpc/grpc_security.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include "common/log.h"

#define TLS_FILE_MAX (1 << 20) /* PEM files larger than this are refused */

static bool set(const char *s) { return s && *s; }

/* ---- files ---- */

/* What identifies one version of a file: a Kubernetes Secret update swaps a symlink (new
 * inode), cert-manager or a copy rewrites in place (new mtime or size). */
typedef struct {
    dev_t dev;
    ino_t ino;
    off_t size;
    struct timespec mtime;
} file_stamp;

static int stamp_of(const char *path, file_stamp *st)
{
    struct stat sb;
    memset(st, 0, sizeof *st);
    if (!path) return 0;
    if (stat(path, &sb) != 0) return -1;
    st->dev = sb.st_dev;
    st->ino = sb.st_ino;
    st->size = sb.st_size;
    st->mtime = sb.st_mtim;
    return 0;
}

static bool stamp_eq(const file_stamp *a, const file_stamp *b)
{
    return a->dev == b->dev && a->ino == b->ino && a->size == b->size &&
           a->mtime.tv_sec == b->mtime.tv_sec && a->mtime.tv_nsec == b->mtime.tv_nsec;
}

/* Reads path (what names it in errors) into a NUL-terminated buffer the caller frees.
 * Returns 0, PD_EIO (cannot open or read), PD_EFORMAT (empty or too large), PD_ENOMEM. */
static int read_file(const char *path, const char *what, char **out, char *err)
{
    *out = NULL;
    FILE *f = fopen(path, "rb");
    if (!f) return pd_errf(err, PD_EIO, "TLS %s file '%s': %s", what, path, strerror(errno));
    char *buf = malloc(TLS_FILE_MAX + 1);
    if (!buf) {
        fclose(f);
        return pd_errf(err, PD_ENOMEM, "TLS %s file '%s': out of memory", what, path);
    }
    size_t n = fread(buf, 1, TLS_FILE_MAX + 1, f);
    int rerr = ferror(f) ? errno : 0;
    fclose(f);
    int rc = 0;
    if (rerr)
        rc = pd_errf(err, PD_EIO, "TLS %s file '%s': %s", what, path, strerror(rerr));
    else if (n == 0)
        rc = pd_errf(err, PD_EFORMAT, "TLS %s file '%s' is empty", what, path);
    else if (n > TLS_FILE_MAX)
        rc = pd_errf(err, PD_EFORMAT, "TLS %s file '%s' is larger than %d bytes", what, path,
                     TLS_FILE_MAX);
    if (rc) {
        free(buf);
        return rc;
    }
    buf[n] = '\0';
    *out = buf;
    return 0;
}

/* OpenSSL's reason for the last failure ("" when it gave none); clears its error queue. */
static const char *ssl_reason(char *buf, size_t len)
{
    unsigned long e = ERR_peek_last_error();
    buf[0] = '\0';
    if (e) {
        const char *r = ERR_reason_error_string(e);
        snprintf(buf, len, ": %s", r ? r : "unknown OpenSSL error");
    }
    ERR_clear_error();
    return buf;
}

/* Never prompts for a passphrase (OpenSSL's default would read the terminal). */
static int no_passphrase(char *buf, int size, int rwflag, void *u)
{
    (void)buf, (void)size, (void)rwflag, (void)u;
    return -1;
}

/* Parses the certificates of a PEM text; *leaf (may be NULL) receives the first one (caller
 * frees with X509_free). Returns 0 or PD_EFORMAT with err. */
static int check_certs(const char *pem, const char *path, const char *what, X509 **leaf,
                       char *err)
{
    if (leaf) *leaf = NULL;
    BIO *b = BIO_new_mem_buf(pem, -1);
    if (!b) return pd_errf(err, PD_ENOMEM, "TLS %s file '%s': out of memory", what, path);
    int n = 0;
    X509 *x;
    while ((x = PEM_read_bio_X509(b, NULL, no_passphrase, NULL)) != NULL) {
        if (n++ == 0 && leaf)
            *leaf = x;
        else
            X509_free(x);
    }
    BIO_free(b);
    char why[256];
    /* The loop ends on "no start line" after the last certificate: only a failure when no
     * certificate came before it, or when a later block did not parse. */
    unsigned long e = ERR_peek_last_error();
    bool clean_end = ERR_GET_REASON(e) == PEM_R_NO_START_LINE;
    if (n == 0 || !clean_end) {
        ssl_reason(why, sizeof why);
        if (leaf && *leaf) {
            X509_free(*leaf);
            *leaf = NULL;
        }
        if (n == 0)
            return pd_errf(err, PD_EFORMAT,
                           "TLS %s file '%s' holds no PEM certificate (\"-----BEGIN "
                           "CERTIFICATE-----\")%s", what, path, clean_end ? "" : why);
        return pd_errf(err, PD_EFORMAT, "TLS %s file '%s': certificate %d does not parse%s",
                       what, path, n + 1, why);
    }
    ERR_clear_error();
    return 0;
}

/* Checks a certificate chain and its key: both parse and the key belongs to the leaf. Warns
 * about a leaf outside its validity period (handshakes will fail). */
static int check_pair(const char *cert_pem, const char *cert_path, const char *key_pem,
                      const char *key_path, char *err)
{
    X509 *leaf = NULL;
    int rc = check_certs(cert_pem, cert_path, "certificate", &leaf, err);
    if (rc) return rc;
    char why[256];
    BIO *b = BIO_new_mem_buf(key_pem, -1);
    EVP_PKEY *k = b ? PEM_read_bio_PrivateKey(b, NULL, no_passphrase, NULL) : NULL;
    BIO_free(b);
    if (!k) {
        ssl_reason(why, sizeof why);
        X509_free(leaf);
        return pd_errf(err, PD_EFORMAT,
                       "TLS key file '%s' holds no usable PEM private key (encrypted keys are "
                       "not supported)%s", key_path, why);
    }
    if (X509_check_private_key(leaf, k) != 1) {
        ERR_clear_error();
        EVP_PKEY_free(k);
        X509_free(leaf);
        return pd_errf(err, PD_EFORMAT,
                       "TLS key file '%s' does not belong to the certificate in '%s'", key_path,
                       cert_path);
    }
    if (X509_cmp_current_time(X509_get0_notAfter(leaf)) < 0)
        PD_LOGW("TLS certificate '%s' has expired: peers will refuse it", cert_path);
    else if (X509_cmp_current_time(X509_get0_notBefore(leaf)) > 0)
        PD_LOGW("TLS certificate '%s' is not valid yet: peers will refuse it", cert_path);
    EVP_PKEY_free(k);
    X509_free(leaf);
    return 0;
}

/* ---- server ---- */

struct rpc__tls_server {
    char *cert_file, *key_file, *ca_file;   /* owned; ca_file NULL when none */
    bool require_client_cert;
    pthread_mutex_t mu;                     /* guards the fields below (fetches may overlap) */
    grpc_ssl_server_certificate_config *first; /* made by load, handed to core at the first
                                               fetch */
    file_stamp cur[3];                      /* cert, key, CA of the files in use */
    file_stamp bad[3];                      /* of files that failed to load (warned once) */
    bool have_bad;
    atomic_llong reloads;
};

static char *dup_opt(const char *s)
{
    return set(s) ? strdup(s) : NULL;
}

int rpc__tls_server_create(const rpc_server_tls *p, rpc__tls_server **out, char *err)
{
    *out = NULL;
    if (!set(p->cert_file)) {
        if (set(p->key_file) || set(p->client_ca_file) || p->require_client_cert)
            return pd_errf(err, PD_EINVAL, "rpc server: TLS key or client CA without a "
                                           "certificate file");
        return 0;
    }
    if (!set(p->key_file))
        return pd_errf(err, PD_EINVAL, "rpc server: TLS certificate '%s' without a key file",
                       p->cert_file);
    if (p->require_client_cert && !set(p->client_ca_file))
        return pd_errf(err, PD_EINVAL, "rpc server: client certificates required without a "
                                       "client CA file to verify them");
    rpc__tls_server *t = calloc(1, sizeof *t);
    if (!t) return pd_errf(err, PD_ENOMEM, "rpc server: out of memory");
    t->cert_file = strdup(p->cert_file);
    t->key_file = strdup(p->key_file);
    t->ca_file = dup_opt(p->client_ca_file);
    t->require_client_cert = p->require_client_cert;
    pthread_mutex_init(&t->mu, NULL);
    atomic_init(&t->reloads, 0);
    if (!t->cert_file || !t->key_file || (set(p->client_ca_file) && !t->ca_file)) {
        rpc__tls_server_free(t);
        return pd_errf(err, PD_ENOMEM, "rpc server: out of memory");
    }
    *out = t;
    return 0;
}

void rpc__tls_server_free(rpc__tls_server *t)
{
    if (!t) return;
    if (t->first) grpc_ssl_server_certificate_config_destroy(t->first);
    free(t->cert_file);
    free(t->key_file);
    free(t->ca_file);
    pthread_mutex_destroy(&t->mu);
    free(t);
}

int64_t rpc__tls_server_reloads(const rpc__tls_server *t)
{
    return t ? atomic_load(&((rpc__tls_server *)t)->reloads) : 0;
}

/* Reads and checks the files (their stamps, taken before reading, into st) and makes a
 * certificate config of them. Returns 0 or an error with err. */
static int load_config(rpc__tls_server *t, file_stamp st[3],
                       grpc_ssl_server_certificate_config **cfg, char *err)
{
    *cfg = NULL;
    const char *paths[3] = {t->cert_file, t->key_file, t->ca_file};
    for (int i = 0; i < 3; i++)
        if (stamp_of(paths[i], &st[i]) != 0)
            return pd_errf(err, PD_EIO, "TLS %s file '%s': %s",
                           i == 0 ? "certificate" : i == 1 ? "key" : "client CA", paths[i],
                           strerror(errno));
    char *cert = NULL, *key = NULL, *ca = NULL;
    int rc;
    if ((rc = read_file(t->cert_file, "certificate", &cert, err)) ||
        (rc = read_file(t->key_file, "key", &key, err)) ||
        (t->ca_file && (rc = read_file(t->ca_file, "client CA", &ca, err))) ||
        (rc = check_pair(cert, t->cert_file, key, t->key_file, err)) ||
        (ca && (rc = check_certs(ca, t->ca_file, "client CA", NULL, err))))
        goto out;
    grpc_ssl_pem_key_cert_pair pair = {key, cert};
    /* gRPC 1.51 asserts that a fetched config has roots even when client certificates are
     * not requested (ssl_security_connector.cc): without a client CA, hand it the server's
     * own chain, which is never used since no client certificate is asked for. */
    *cfg = grpc_ssl_server_certificate_config_create(ca ? ca : cert, &pair, 1); /* copies */
    if (!*cfg) rc = pd_errf(err, PD_ENOMEM, "TLS: gRPC refused the certificate config");
out:
    if (key) OPENSSL_cleanse(key, strlen(key));
    free(cert);
    free(key);
    free(ca);
    return rc;
}

/* Called by gRPC core before every handshake (serialized by core; our mutex too): hands over
 * the first config, then a new one whenever the files changed and load cleanly. */
static grpc_ssl_certificate_config_reload_status
fetch_config(void *user, grpc_ssl_server_certificate_config **config)
{
    rpc__tls_server *t = user;
    grpc_ssl_certificate_config_reload_status r = GRPC_SSL_CERTIFICATE_CONFIG_RELOAD_UNCHANGED;
    *config = NULL;
    pthread_mutex_lock(&t->mu);
    if (t->first) {
        *config = t->first; /* core takes ownership */
        t->first = NULL;
        r = GRPC_SSL_CERTIFICATE_CONFIG_RELOAD_NEW;
        goto out;
    }
    file_stamp now[3];
    const char *paths[3] = {t->cert_file, t->key_file, t->ca_file};
    bool same = true, same_bad = t->have_bad;
    for (int i = 0; i < 3; i++) {
        if (stamp_of(paths[i], &now[i]) != 0) memset(&now[i], 0xff, sizeof now[i]);
        same = same && stamp_eq(&now[i], &t->cur[i]);
        same_bad = same_bad && stamp_eq(&now[i], &t->bad[i]);
    }
    if (same || same_bad) goto out;
    char err[PD_ERR_LEN];
    file_stamp st[3];
    grpc_ssl_server_certificate_config *cfg;
    if (load_config(t, st, &cfg, err) != 0) {
        /* Often a rotation caught halfway (certificate written, key not yet): keep serving
         * with the files in use and look again at the next connection. */
        PD_LOGW("%s; keeping the certificate in use", err);
        memcpy(t->bad, now, sizeof t->bad);
        t->have_bad = true;
        goto out;
    }
    memcpy(t->cur, st, sizeof t->cur);
    t->have_bad = false;
    atomic_fetch_add(&t->reloads, 1);
    PD_LOGI("TLS: certificate '%s' changed; new connections use the new one", t->cert_file);
    *config = cfg;
    r = GRPC_SSL_CERTIFICATE_CONFIG_RELOAD_NEW;
out:
    pthread_mutex_unlock(&t->mu);
    return r;
}

int rpc__tls_server_creds(rpc__tls_server *t, grpc_server_credentials **creds, char *err)
{
    *creds = NULL;
    pthread_mutex_lock(&t->mu);
    int rc = load_config(t, t->cur, &t->first, err);
    pthread_mutex_unlock(&t->mu);
    if (rc) return rc;
    grpc_ssl_client_certificate_request_type req =
        !t->ca_file              ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
        : t->require_client_cert ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                                 : GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY;
    grpc_ssl_server_credentials_options *o =
        grpc_ssl_server_credentials_create_options_using_config_fetcher(req, fetch_config, t);
    *creds = o ? grpc_ssl_server_credentials_create_with_options(o) : NULL; /* takes o */
    if (!*creds) return pd_errf(err, PD_ENOMEM, "TLS: gRPC refused the server credentials");
    PD_LOGI("TLS: certificate '%s'%s%s%s", t->cert_file,
            t->ca_file ? (t->require_client_cert ? ", client certificates required from CA '"
                                                 : ", client certificates verified by CA '")
                       : "",
            t->ca_file ? t->ca_file : "", t->ca_file ? "'" : "");
    return 0;
}

/* ---- client ---- */

int rpc__tls_channel_creds(const rpc_client_tls *p, grpc_channel_credentials **creds, char *err)
{
    *creds = NULL;
    if (!set(p->ca_file)) {
        if (set(p->cert_file) || set(p->key_file) || set(p->server_name))
            return pd_errf(err, PD_EINVAL, "rpc channel: TLS client certificate or server "
                                           "name without a CA file");
        *creds = grpc_insecure_credentials_create();
        return 0;
    }
    if (set(p->cert_file) != set(p->key_file))
        return pd_errf(err, PD_EINVAL, "rpc channel: a TLS client certificate needs both a "
                                       "certificate and a key file");
    char *ca = NULL, *cert = NULL, *key = NULL;
    int rc;
    if ((rc = read_file(p->ca_file, "CA", &ca, err)) ||
        (rc = check_certs(ca, p->ca_file, "CA", NULL, err)))
        goto out;
    if (set(p->cert_file) &&
        ((rc = read_file(p->cert_file, "certificate", &cert, err)) ||
         (rc = read_file(p->key_file, "key", &key, err)) ||
         (rc = check_pair(cert, p->cert_file, key, p->key_file, err))))
        goto out;
    grpc_ssl_pem_key_cert_pair pair = {key, cert};
    *creds = grpc_ssl_credentials_create_ex(ca, cert ? &pair : NULL, NULL, NULL); /* copies */
    if (!*creds) rc = pd_errf(err, PD_ENOMEM, "TLS: gRPC refused the channel credentials");
out:
    if (key) OPENSSL_cleanse(key, strlen(key));
    free(ca);
    free(cert);
    free(key);
    return rc;
}
