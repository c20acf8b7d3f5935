/* kvt_desc.c -- The strict descriptor parser, the structural checks of the UCX blobs a
 * descriptor carries, and the shared-secret primitives (see kvt_desc.h). Every byte here may
 * come from the network: each read is bounds-checked, and nothing is handed to UCX. Also the
 * layout's block size and fingerprint, which the parser checks (so that this file links
 * without UCX: the fuzz target uses it alone). */
#include "kvtransfer/kvt_desc.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/params.h>
#include <openssl/rand.h>
#include <xxhash.h>

#include "common/error.h"

/* ---------------------------------------------------------------- layout */

size_t kvt_layout_block_bytes(const kvt_layout *l)
{
    if (l->block_size <= 0 || l->n_kv_heads <= 0 || l->head_dim <= 0) return 0;
    return (size_t)l->block_size * (size_t)l->n_kv_heads * (size_t)l->head_dim *
           pd_dtype_size(l->dtype);
}

static void le32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

uint64_t kvt_layout_fingerprint(const kvt_layout *l)
{
    uint8_t buf[64 + 20];
    memset(buf, 0, sizeof buf);
    size_t n = strnlen(l->model_id, sizeof l->model_id);
    memcpy(buf, l->model_id, n < 64 ? n : 64);
    le32(buf + 64, (uint32_t)l->dtype);
    le32(buf + 68, (uint32_t)l->n_layers);
    le32(buf + 72, (uint32_t)l->block_size);
    le32(buf + 76, (uint32_t)l->n_kv_heads);
    le32(buf + 80, (uint32_t)l->head_dim);
    return XXH64(buf, sizeof buf, 0x6b7674);
}

/* ---------------------------------------------------------------- shared secret */

int kvt__secret_load(const char *path, kvt__secret *out, char *err)
{
    memset(out, 0, sizeof *out);
    FILE *f = fopen(path, "rb");
    if (!f) return pd_errf(err, PD_EIO, "kvt: KV secret file %s: %s", path, strerror(errno));
    size_t n = fread(out->key, 1, sizeof out->key, f);
    int more = fgetc(f) != EOF, bad = ferror(f);
    fclose(f);
    if (bad) {
        kvt__secret_wipe(out);
        return pd_errf(err, PD_EIO, "kvt: KV secret file %s: read error", path);
    }
    if (n > 0 && out->key[n - 1] == '\n') n--;
    if (n > 0 && out->key[n - 1] == '\r') n--;
    if (more || n < KVT_SECRET_MIN) {
        kvt__secret_wipe(out);
        return pd_errf(err, PD_EINVAL, "kvt: KV secret file %s must hold %d to %d bytes (e.g. "
                       "`openssl rand -hex 32`)", path, KVT_SECRET_MIN, KVT_SECRET_MAX);
    }
    out->len = n;
    return 0;
}

void kvt__secret_wipe(kvt__secret *s)
{
    OPENSSL_cleanse(s->key, sizeof s->key);
    s->len = 0;
}

int kvt__hmac(const kvt__secret *s, int n, const void *const *parts, const size_t *lens,
              uint8_t out[KVT_MAC_LEN])
{
    EVP_MAC *mac = EVP_MAC_fetch(NULL, "HMAC", NULL);
    EVP_MAC_CTX *c = mac ? EVP_MAC_CTX_new(mac) : NULL;
    OSSL_PARAM prm[] = {
        OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, (char *)"SHA256", 0),
        OSSL_PARAM_construct_end(),
    };
    size_t olen = 0;
    int ok = c && EVP_MAC_init(c, s->key, s->len, prm);
    for (int i = 0; ok && i < n; i++) ok = EVP_MAC_update(c, parts[i], lens[i]);
    ok = ok && EVP_MAC_final(c, out, &olen, KVT_MAC_LEN) && olen == KVT_MAC_LEN;
    EVP_MAC_CTX_free(c);
    EVP_MAC_free(mac);
    if (!ok) {
        memset(out, 0, KVT_MAC_LEN);
        return PD_EIO;
    }
    return 0;
}

bool kvt__mac_equal(const uint8_t a[KVT_MAC_LEN], const uint8_t b[KVT_MAC_LEN])
{
    return CRYPTO_memcmp(a, b, KVT_MAC_LEN) == 0;
}

int kvt__random(void *buf, size_t n)
{
    return RAND_bytes(buf, (int)n) == 1 ? 0 : PD_EIO;
}

int kvt__desc_mac(const kvt__secret *s, const void *body, size_t len, uint8_t out[KVT_MAC_LEN])
{
    static const char label[] = "pdserve-kvt-descriptor-v2";
    const void *parts[] = {label, body};
    size_t lens[] = {sizeof label, len};
    return kvt__hmac(s, 2, parts, lens, out);
}

/* ---------------------------------------------------------------- bounded reader */

typedef struct {
    const uint8_t *p;
    size_t len, off;
    bool bad;
} rd;

static const uint8_t *rd_bytes(rd *b, size_t n)
{
    if (b->bad || b->len - b->off < n) {
        b->bad = true;
        return NULL;
    }
    const uint8_t *q = b->p + b->off;
    b->off += n;
    return q;
}
static uint8_t rd_u8(rd *b)
{
    const uint8_t *q = rd_bytes(b, 1);
    return q ? q[0] : 0;
}
static uint32_t rd_u32(rd *b)
{
    const uint8_t *q = rd_bytes(b, 4);
    if (!q) return 0;
    return (uint32_t)q[0] | (uint32_t)q[1] << 8 | (uint32_t)q[2] << 16 | (uint32_t)q[3] << 24;
}
static uint64_t rd_u64(rd *b)
{
    uint64_t lo = rd_u32(b);
    return lo | (uint64_t)rd_u32(b) << 32;
}
static uint64_t le64_at(const uint8_t *q)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = v << 8 | q[i];
    return v;
}

/* ---------------------------------------------------------------- UCX packed rkey */

enum { UCX_MEM_HOST = 0, UCX_MEM_CUDA = 1 }; /* ucs_memory_type_t, stable since 1.9 */

int kvt__ucx_rkey_check(const uint8_t *p, size_t len, bool cuda, char *err)
{
    rd b = {.p = p, .len = len};
    uint64_t md_map = rd_u64(&b);
    uint8_t mem_type = rd_u8(&b);
    if (b.bad)
        return pd_errf(err, PD_EFORMAT, "kvt: remote key of %zu bytes is shorter than its "
                       "header (UCX 1.13-1.16 format)", len);
    if (mem_type != (cuda ? UCX_MEM_CUDA : UCX_MEM_HOST))
        return pd_errf(err, PD_EFORMAT, "kvt: remote key has memory type %u, the descriptor "
                       "says %s memory", mem_type, cuda ? "CUDA" : "host");
    for (int i = 0; i < 64; i++) {
        if (!(md_map >> i & 1)) continue;
        uint8_t n = rd_u8(&b);
        rd_bytes(&b, n);
        if (b.bad)
            return pd_errf(err, PD_EFORMAT, "kvt: remote key component of memory domain %d runs "
                           "past the key's %zu bytes (UCX 1.13-1.16 format)", i, len);
    }
    if (b.off != len)
        return pd_errf(err, PD_EFORMAT, "kvt: remote key has %zu bytes after its components "
                       "(md_map %#llx; not the UCX 1.13-1.16 ucp_rkey_pack format)",
                       len - b.off, (unsigned long long)md_map);
    return 0;
}

/* ---------------------------------------------------------------- UCX packed worker address */

/* Constants of src/ucp/wireup/address.c (identical in 1.13 and 1.16). */
#define UA_VERSION_V1 0u           /* UCP_OBJECT_VERSION_V1, low nibble of the first byte */
#define UA_VERSION_V2 1u
#define UA_HDR_DEBUG_INFO 0x1u
#define UA_HDR_WORKER_UUID 0x2u
#define UA_HDR_CLIENT_ID 0x4u
#define UA_HDR_AM_ONLY 0x8u
#define UA_NULL_RESOURCE 0xffu
#define UA_FLAG_LAST 0x80u
#define UA_FLAG_HAS_EP_ADDR 0x40u  /* iface length byte */
#define UA_FLAG_NUM_PATHS 0x40u    /* device length byte */
#define UA_FLAG_SYS_DEVICE 0x20u   /* device length byte */
#define UA_MD_EMPTY_DEV 0x80u
#define UA_MD_MASK_V1 0x1fu
#define UA_MD_MASK_V2 0x7fu
#define UA_DEV_LEN_MASK 0x1fu
#define UA_IFACE_LEN_MASK 0x3fu
#define UA_IFACE_ATTR_V1 16u       /* ucp_address_packed_iface_attr_t: 3 floats + u32 */
#define UA_IFACE_ATTR_V2 8u        /* ucp_address_v2_packed_iface_attr_t */
#define UA_MAX_RESOURCES 128u      /* UCP_MAX_RESOURCES */

/* ucp_address_unpack_byte_extended: a value under a mask, and in v2 a mask-valued one is
 * followed by the real value in a full byte. */
static uint8_t ua_ext(rd *b, uint8_t mask, bool v2)
{
    uint8_t v = rd_u8(b) & mask;
    if (v2 && v == mask) v = rd_u8(b);
    return v;
}

static float ua_f32(const uint8_t *q)
{
    float f;
    memcpy(&f, q, sizeof f);
    return f;
}

/* ucs_crc16_string (CRC-16-CCITT, reflected), which names a transport in an address. */
static uint16_t ua_crc16(const char *s)
{
    uint16_t crc = UINT16_MAX;
    for (; *s; s++) {
        crc ^= (uint8_t)*s;
        for (int bit = 0; bit < 8; bit++) crc = (uint16_t)((crc >> 1) ^ (-(int)(crc & 1) & 0x8408u));
    }
    return (uint16_t)~crc;
}

int kvt__ucx_addr_check(const uint8_t *p, size_t len, uint64_t *sysv_mds, char *err)
{
#define UA_BAD(...) pd_errf(err, PD_EFORMAT, "kvt: worker address: " __VA_ARGS__)
    rd b = {.p = p, .len = len};
    uint16_t sysv_csum = ua_crc16("sysv");
    if (sysv_mds) *sysv_mds = 0;
    uint8_t h0 = rd_u8(&b);
    uint8_t version = h0 & 0xf, flags;
    if (b.bad) return UA_BAD("empty");
    if (version == UA_VERSION_V1) flags = h0 >> 4;
    else if (version == UA_VERSION_V2) flags = rd_u8(&b);
    else
        return UA_BAD("header version %u is not a UCX 1.13-1.16 format (v1 = 0, v2 = 1)",
                      version);
    bool v2 = version == UA_VERSION_V2;
    if (flags & ~(UA_HDR_DEBUG_INFO | UA_HDR_WORKER_UUID | UA_HDR_CLIENT_ID | UA_HDR_AM_ONLY))
        return UA_BAD("unknown header flags %#x", flags);
    /* ucp_worker_query always packs the uuid (and 1.12+ flag it); without the flag a v1
     * unpacker would still read 8 bytes, so the walk would not match UCX's. */
    if (!(flags & UA_HDR_WORKER_UUID)) return UA_BAD("no worker uuid (not from ucp_worker_query)");
    rd_bytes(&b, 8);
    if (flags & UA_HDR_CLIENT_ID) rd_bytes(&b, 8);
    if (flags & UA_HDR_DEBUG_INFO) rd_bytes(&b, rd_u8(&b)); /* worker name */
    if (b.bad) return UA_BAD("truncated in the header (%zu bytes)", len);
    if (b.off < len && b.p[b.off] == UA_NULL_RESOURCE) {
        b.off++;
        if (b.off != len) return UA_BAD("%zu bytes after an empty device list", len - b.off);
        return 0;
    }
    unsigned n_tl = 0, n_dev = 0;
    for (bool last_dev = false; !last_dev;) {
        if (b.off >= len) return UA_BAD("truncated before device %u", n_dev);
        bool empty = (b.p[b.off] & UA_MD_EMPTY_DEV) != 0;
        uint8_t md = ua_ext(&b, v2 ? UA_MD_MASK_V2 : UA_MD_MASK_V1, v2); /* any value is safe */
        if (b.bad) return UA_BAD("truncated in device %u", n_dev);
        uint8_t dflags = b.off < len ? b.p[b.off] : 0;
        last_dev = (dflags & UA_FLAG_LAST) != 0;
        uint8_t dev_len = ua_ext(&b, UA_DEV_LEN_MASK, v2);
        if (dflags & UA_FLAG_NUM_PATHS) {
            uint8_t paths = rd_u8(&b);
            if (!b.bad && paths == 0) return UA_BAD("device %u has 0 paths", n_dev);
        }
        if (dflags & UA_FLAG_SYS_DEVICE) rd_u8(&b);
        rd_bytes(&b, dev_len);
        if (b.bad) return UA_BAD("device %u runs past the address's %zu bytes", n_dev, len);
        for (bool last_tl = empty; !last_tl;) {
            if (++n_tl > UA_MAX_RESOURCES) return UA_BAD("more than %u transports", UA_MAX_RESOURCES);
            const uint8_t *cs = rd_bytes(&b, 2); /* transport name checksum */
            if (cs && (uint16_t)(cs[0] | cs[1] << 8) == sysv_csum && md < 64 && sysv_mds)
                *sysv_mds |= 1ull << md;
            const uint8_t *attr = rd_bytes(&b, v2 ? UA_IFACE_ATTR_V2 : UA_IFACE_ATTR_V1);
            if (b.bad) return UA_BAD("transport %u of device %u is truncated", n_tl, n_dev);
            if (!v2) {
                float ovh = ua_f32(attr), bw = ua_f32(attr + 4), lat = ua_f32(attr + 8);
                if (!isfinite(ovh) || !isfinite(bw) || bw == 0 || !isfinite(lat))
                    return UA_BAD("transport %u has invalid performance values", n_tl);
            } else if ((attr[4] | attr[5]) == 0) {
                return UA_BAD("transport %u has a zero segment size", n_tl);
            }
            uint8_t tflags = b.off < len ? b.p[b.off] : 0;
            last_tl = (tflags & UA_FLAG_LAST) != 0;
            if (tflags & UA_FLAG_HAS_EP_ADDR)
                return UA_BAD("transport %u carries endpoint addresses (never in a worker "
                              "address)", n_tl);
            uint8_t if_len = ua_ext(&b, UA_IFACE_LEN_MASK, v2);
            rd_bytes(&b, if_len);
            if (b.bad) return UA_BAD("transport %u runs past the address's %zu bytes", n_tl, len);
        }
        n_dev++;
    }
    if (b.off != len)
        return UA_BAD("%zu bytes after the last device (not the UCX 1.13-1.16 format, or "
                      "UCX_UNIFIED_MODE=y, which kvtransfer does not support)", len - b.off);
    return 0;
#undef UA_BAD
}

size_t kvt__ucx_rkey_filter_sysv(const uint8_t *p, size_t len, uint64_t sysv_mds,
                                 bool (*is_valid)(uint32_t shmid, void *arg), void *arg,
                                 uint8_t *out)
{
    uint64_t md_map = le64_at(p), keep = md_map;
    size_t off = 9, o = 9;
    for (int i = 0; i < 64; i++) {
        if (!(md_map >> i & 1)) continue;
        uint8_t n = p[off];
        const uint8_t *c = p + off + 1;
        /* uct_sysv_packed_rkey_t: u32 shmid | u64 owner address */
        bool drop = (sysv_mds >> i & 1) &&
                    (n != 12 || !is_valid((uint32_t)c[0] | (uint32_t)c[1] << 8 |
                                              (uint32_t)c[2] << 16 | (uint32_t)c[3] << 24,
                                          arg));
        if (drop) {
            keep &= ~(1ull << i);
        } else {
            memcpy(out + o, p + off, 1u + n);
            o += 1u + n;
        }
        off += 1u + n;
    }
    for (int i = 0; i < 8; i++) out[i] = (uint8_t)(keep >> (8 * i));
    out[8] = p[8];
    (void)len;
    return o;
}

/* ---------------------------------------------------------------- descriptor */

void kvt__desc_free(kvt__desc *d)
{
    if (!d) return;
    free(d->rkey_off);
    free(d->rkey_len);
    d->rkey_off = NULL;
    d->rkey_len = NULL;
}

void kvt__desc_region(const kvt__desc *d, int32_t r, uint64_t *base, int32_t *rkey)
{
    const uint8_t *q = d->buf + d->regions_off + (size_t)r * 12;
    *base = le64_at(q);
    *rkey = (int32_t)((uint32_t)q[8] | (uint32_t)q[9] << 8 | (uint32_t)q[10] << 16 |
                      (uint32_t)q[11] << 24);
}

/* The layout's block bytes, or 0 when a field is out of range or the product overflows. */
static uint64_t block_bytes_checked(const kvt_layout *l)
{
    if (l->block_size <= 0 || l->n_kv_heads <= 0 || l->head_dim <= 0 || (int)l->dtype < 0 ||
        l->dtype > PD_DTYPE_F8E4M3)
        return 0;
    uint64_t v = (uint64_t)l->block_size;
    if (__builtin_mul_overflow(v, (uint64_t)l->n_kv_heads, &v) ||
        __builtin_mul_overflow(v, (uint64_t)l->head_dim, &v) ||
        __builtin_mul_overflow(v, (uint64_t)pd_dtype_size(l->dtype), &v))
        return 0;
    return v;
}

typedef struct {
    uint64_t lo, hi;
} span;

static int cmp_span(const void *a, const void *b)
{
    const span *x = a, *y = b;
    return x->lo < y->lo ? -1 : x->lo > y->lo;
}

static int desc_parse(const void *buf, size_t len, const kvt__secret *secret, kvt__desc *out,
                      char *err)
{
#define D_BAD(...) (rc = pd_errf(err, PD_EFORMAT, "kvt: descriptor: " __VA_ARGS__))
    int rc = 0;
    const uint8_t *p = buf;
    /* Fixed header (172 bytes up to the address) plus counts and the checksum. */
    if (!buf || len < 16) return D_BAD("%zu bytes is too short", len);
    rd b = {.p = p, .len = len};
    if (rd_u32(&b) != KVT_DESC_MAGIC) return D_BAD("bad magic (not a kvtransfer descriptor)");
    if (XXH64(p, len - 8, 0) != le64_at(p + len - 8))
        return D_BAD("corrupt (checksum mismatch over %zu bytes)", len);
    uint32_t ver = rd_u32(&b);
    uint32_t flags = ver >> 16;
    if ((ver & 0xffff) != KVT_DESC_VERSION)
        return D_BAD("version %u, this build speaks %u (prefill and decode builds differ)",
                     ver & 0xffff, KVT_DESC_VERSION);
    if (flags & ~KVT_DESC_FLAGS_KNOWN) return D_BAD("unknown flags %#x", flags);
    size_t body = len - 8; /* bytes before the checksum */
    bool has_secret = secret && secret->len > 0;
    if (flags & KVT_DESC_SIGNED) {
        if (!has_secret)
            return pd_errf(err, PD_EPERM, "kvt: the descriptor is signed (the decode side has a "
                           "KV secret) but this side has none: configure the same "
                           "--kv-secret-file on both");
        if (body < 8 + KVT_MAC_LEN) return D_BAD("too short for its MAC");
        body -= KVT_MAC_LEN;
        uint8_t mac[KVT_MAC_LEN];
        if (kvt__desc_mac(secret, p, body, mac) < 0)
            return pd_errf(err, PD_EIO, "kvt: HMAC-SHA256 failed (libcrypto)");
        if (!kvt__mac_equal(mac, p + body))
            return pd_errf(err, PD_EPERM, "kvt: the descriptor's MAC does not verify: the KV "
                           "secrets of this side and of the decode side differ (or it was "
                           "tampered with)");
    } else if (has_secret) {
        return pd_errf(err, PD_EPERM, "kvt: the descriptor is not signed but this side has a KV "
                       "secret: the decode side runs without --kv-secret-file (or the "
                       "descriptor was forged)");
    }
    b.len = body; /* nothing below may read the MAC or the checksum */
    out->flags = flags;
    out->buf = p;
    out->remote_ctx = rd_u64(&b);
    out->pool_id = rd_u64(&b);
    const uint8_t *boot = rd_bytes(&b, 40);
    const uint8_t *mid = rd_bytes(&b, sizeof out->layout.model_id);
    if (b.bad) return D_BAD("truncated in the header (%zu bytes)", len);
    if (!memchr(boot, 0, 40)) return D_BAD("boot id is not NUL-terminated");
    memcpy(out->boot_id, boot, 40);
    if (!memchr(mid, 0, sizeof out->layout.model_id))
        return D_BAD("model id is not NUL-terminated");
    memcpy(out->layout.model_id, mid, sizeof out->layout.model_id);
    uint32_t dtype = rd_u32(&b), nl = rd_u32(&b), bs = rd_u32(&b), kvh = rd_u32(&b),
             hd = rd_u32(&b);
    out->fingerprint = rd_u64(&b);
    uint32_t nb = rd_u32(&b);
    out->block_bytes = rd_u64(&b);
    if (b.bad) return D_BAD("truncated in the layout (%zu bytes)", len);
    if (dtype > (uint32_t)PD_DTYPE_F8E4M3 || nl == 0 || nl > KVT_DESC_MAX_LAYERS || bs == 0 ||
        bs > INT32_MAX || kvh == 0 || kvh > INT32_MAX || hd == 0 || hd > INT32_MAX || nb == 0 ||
        nb > INT32_MAX)
        return D_BAD("layout out of range (dtype %u, layers %u, block size %u, kv heads %u, "
                     "head dim %u, blocks %u)", dtype, nl, bs, kvh, hd, nb);
    out->layout.dtype = (pd_dtype)dtype;
    out->layout.n_layers = (int32_t)nl;
    out->layout.block_size = (int32_t)bs;
    out->layout.n_kv_heads = (int32_t)kvh;
    out->layout.head_dim = (int32_t)hd;
    out->n_blocks = (int32_t)nb;
    uint64_t bb = block_bytes_checked(&out->layout), pool_bytes;
    if (bb == 0 || bb != out->block_bytes)
        return D_BAD("block bytes %llu do not match the layout (%llu)",
                     (unsigned long long)out->block_bytes, (unsigned long long)bb);
    if (__builtin_mul_overflow(bb, (uint64_t)nb, &pool_bytes) ||
        __builtin_mul_overflow(pool_bytes, 2ull * nl, &pool_bytes) ||
        pool_bytes > KVT_DESC_MAX_POOL)
        return D_BAD("pool of %u blocks x %llu bytes x %u regions is too large", nb,
                     (unsigned long long)bb, 2 * nl);
    if (out->fingerprint != kvt_layout_fingerprint(&out->layout))
        return D_BAD("layout fingerprint does not match its fields");
    /* The worker address. */
    uint32_t al = rd_u32(&b);
    if (b.bad || al == 0 || al > KVT_DESC_MAX_ADDR)
        return D_BAD("worker address length %u out of range (1..%d)", al, KVT_DESC_MAX_ADDR);
    out->addr = rd_bytes(&b, al);
    out->addr_len = al;
    if (b.bad) return D_BAD("worker address of %u bytes runs past the end", al);
    if ((rc = kvt__ucx_addr_check(out->addr, al, &out->sysv_mds, err)) < 0) return rc;
    /* Remote keys. */
    int32_t nr = 2 * (int32_t)nl;
    uint32_t nrk = rd_u32(&b);
    if (flags & KVT_DESC_STAGED) {
        /* Device blocks behind a ring: nothing to put into, so no keys and no regions. */
        if (b.bad || nrk != 0 || (flags & (KVT_DESC_ALLOCATED | KVT_DESC_CUDA)))
            return D_BAD("a staged pool with %u remote keys or flags %#x", nrk, flags);
        nr = 0;
    } else if (b.bad || nrk == 0 || nrk > (uint32_t)nr ||
               ((flags & KVT_DESC_ALLOCATED) && nrk != 1))
        return D_BAD("%u remote keys for %d regions%s", nrk, nr,
                     (flags & KVT_DESC_ALLOCATED) ? " of one allocation" : "");
    /* Each key needs at least 4 + 9 bytes and each region 12: check before allocating. */
    if ((b.len - b.off) < (size_t)nrk * 13 + (size_t)nr * 12)
        return D_BAD("%u remote keys and %d regions cannot fit in %zu bytes", nrk, nr,
                     b.len - b.off);
    out->n_rkeys = (int32_t)nrk;
    /* (at least one element each: a staged pool has none, and calloc(0) may be NULL) */
    out->rkey_off = calloc(nrk + 1, sizeof *out->rkey_off);
    out->rkey_len = calloc(nrk + 1, sizeof *out->rkey_len);
    span *sp = calloc((size_t)nr + 1, sizeof *sp);
    bool *used = calloc(nrk + 1, sizeof *used);
    if (!out->rkey_off || !out->rkey_len || !sp || !used) {
        rc = pd_errf(err, PD_ENOMEM, "kvt: out of memory");
        goto done;
    }
    for (uint32_t i = 0; i < nrk; i++) {
        uint32_t kl = rd_u32(&b);
        if (b.bad || kl == 0 || kl > KVT_DESC_MAX_RKEY) {
            D_BAD("remote key %u: length %u out of range (1..%d)", i, kl, KVT_DESC_MAX_RKEY);
            goto done;
        }
        out->rkey_off[i] = b.off;
        out->rkey_len[i] = kl;
        const uint8_t *k = rd_bytes(&b, kl);
        if (b.bad) {
            D_BAD("remote key %u of %u bytes runs past the end", i, kl);
            goto done;
        }
        if ((rc = kvt__ucx_rkey_check(k, kl, (flags & KVT_DESC_CUDA) != 0, err)) < 0) goto done;
    }
    /* Regions: rkey index in range, every key used, inside the address space, disjoint. */
    out->n_regions = nr;
    out->regions_off = b.off;
    uint64_t rlen = bb * nb;
    for (int32_t r = 0; r < nr; r++) {
        uint64_t base = rd_u64(&b);
        uint32_t k = rd_u32(&b);
        if (b.bad) {
            D_BAD("region table truncated at region %d", r);
            goto done;
        }
        if (k >= nrk) {
            D_BAD("region %d uses remote key %u of %u", r, k, nrk);
            goto done;
        }
        if (base == 0 || base > UINT64_MAX - rlen) {
            D_BAD("region %d at %#llx (+%llu bytes) is outside the address space", r,
                  (unsigned long long)base, (unsigned long long)rlen);
            goto done;
        }
        used[k] = true;
        sp[r] = (span){base, base + rlen};
    }
    for (uint32_t i = 0; i < nrk; i++)
        if (!used[i]) {
            D_BAD("remote key %u is used by no region", i);
            goto done;
        }
    qsort(sp, (size_t)nr, sizeof *sp, cmp_span);
    for (int32_t r = 1; r < nr; r++)
        if (sp[r].lo < sp[r - 1].hi) {
            D_BAD("regions at %#llx and %#llx overlap", (unsigned long long)sp[r - 1].lo,
                  (unsigned long long)sp[r].lo);
            goto done;
        }
    if (flags & KVT_DESC_DEVICE) {
        uint32_t dl = rd_u32(&b);
        if (b.bad || dl == 0 || dl > KVT_DESC_MAX_DEVICE) {
            D_BAD("device export length %u out of range (1..%d)", dl, KVT_DESC_MAX_DEVICE);
            goto done;
        }
        out->device = rd_bytes(&b, dl);
        out->device_len = dl;
        if (b.bad) {
            D_BAD("device export of %u bytes runs past the end", dl);
            goto done;
        }
    }
    if (b.off != b.len) D_BAD("%zu bytes after the region table", b.len - b.off);
done:
    free(sp);
    free(used);
    return rc;
#undef D_BAD
}

int kvt__desc_parse(const void *buf, size_t len, const kvt__secret *secret, kvt__desc *out,
                    char *err)
{
    memset(out, 0, sizeof *out);
    int rc = desc_parse(buf, len, secret, out, err);
    if (rc < 0) {
        kvt__desc_free(out);
        memset(out, 0, sizeof *out);
    }
    return rc;
}
