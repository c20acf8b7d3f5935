/* test_kvt_desc.c -- Descriptors from the network: real exported descriptors truncated at every
 * byte, every length and count field bumped, every bit of every remote-key and address byte
 * flipped (checksum recomputed each time), huge counts, bytes inserted into the address or a
 * key, unknown UCX formats, and signed descriptors with wrong, missing or tampered MACs. Each
 * must be refused (PD_EFORMAT, or PD_EPERM for authentication) without a crash, both by the
 * pure parser and by kvt_target_open before UCX sees the bytes. Run it under ASan too. */
#include <unistd.h>
#include <xxhash.h>

#include "kvt_test.h"
#include "kvtransfer/kvt_desc.h"

static kt_events ev_a, ev_b;

/* Offsets of the fixed header (kvt_desc.h). */
enum { OFF_VER = 4, OFF_CTX = 8, OFF_NL = 132, OFF_BS = 136, OFF_KVH = 140, OFF_HD = 144,
       OFF_NB = 156, OFF_BB = 160, OFF_AL = 168, OFF_ADDR = 172 };

static uint32_t rd32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static void wr32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static void wr64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
/* Recomputes the trailing checksum (what an attacker who knows the format does). */
static void fix(uint8_t *d, size_t len) { wr64(d + len - 8, XXH64(d, len - 8, 0)); }

/* Where the pieces of an unsigned descriptor are. */
typedef struct {
    size_t addr, addr_len, nrk_off;
    int nrk;
    size_t rk_off[64], rk_len[64]; /* packed key bytes (after each u32 length) */
} layout_of;

static layout_of locate(const uint8_t *d)
{
    layout_of o = {.addr = OFF_ADDR, .addr_len = rd32(d + OFF_AL)};
    o.nrk_off = o.addr + o.addr_len;
    o.nrk = (int)rd32(d + o.nrk_off);
    size_t off = o.nrk_off + 4;
    for (int i = 0; i < o.nrk && i < 64; i++) {
        o.rk_len[i] = rd32(d + off);
        o.rk_off[i] = off + 4;
        off += 4 + o.rk_len[i];
    }
    return o;
}

static int parse(const uint8_t *d, size_t len, const kvt__secret *s)
{
    kvt__desc out;
    char err[PD_ERR_LEN] = "";
    int rc = kvt__desc_parse(d, len, s, &out, err);
    if (rc == 0) kvt__desc_free(&out);
    return rc;
}

/* A copy of d with n bytes inserted at `at` and the u32 length field at len_off grown by n. */
static uint8_t *insert(const uint8_t *d, size_t len, size_t at, size_t n, size_t len_off,
                       size_t *out_len)
{
    uint8_t *c = calloc(1, len + n);
    memcpy(c, d, at);
    memset(c + at, 0x5a, n);
    memcpy(c + at + n, d + at, len - at);
    wr32(c + len_off, rd32(c + len_off) + (uint32_t)n);
    *out_len = len + n;
    fix(c, *out_len);
    return c;
}

static kvt_pool *make_pool(kvt_ctx *ctx, int32_t n_blocks, void **k, void **v)
{
    kvt_pool_params pp = kvt_pool_default_params();
    pp.layout = kt_layout();
    pp.n_blocks = n_blocks;
    pp.k_base = k;
    pp.v_base = v;
    kvt_pool *pool;
    char err[PD_ERR_LEN];
    KT_OK(kvt_pool_create(ctx, &pp, &pool, err), err);
    return pool;
}

/* Structural attacks on one unsigned descriptor, through the parser and kvt_target_open. */
static void attack(kvt_ctx *b, kvt_pool *src, const uint8_t *desc, size_t len, bool allocated)
{
    char err[PD_ERR_LEN];
    kvt_target *t;
    uint8_t *m = malloc(len + 64);
    layout_of o = locate(desc);
    fprintf(stderr, "descriptor: %zu bytes, address %zu bytes, %d remote keys (%zu bytes "
            "first)\n", len, o.addr_len, o.nrk, o.rk_len[0]);
    KT_EQ(parse(desc, len, NULL), 0);
    KT_EQ(kvt__ucx_addr_check(desc + o.addr, o.addr_len, NULL, err), 0);
    for (int i = 0; i < o.nrk; i++) KT_EQ(kvt__ucx_rkey_check(desc + o.rk_off[i], o.rk_len[i], false, err), 0);

    /* Truncated at every byte: as received (checksum fails) and re-checksummed. */
    for (size_t l = 0; l < len; l++) {
        memcpy(m, desc, l);
        KT_EQ(parse(m, l, NULL), PD_EFORMAT);
        if (l >= 16) {
            memcpy(m, desc, l - 8);
            fix(m, l);
            if (parse(m, l, NULL) != PD_EFORMAT) KT_FAIL("truncated to %zu bytes: accepted", l);
        }
    }
    /* Every length and count field bumped (+1, -1, huge), re-checksummed. */
    size_t fields[80];
    int nf = 0;
    fields[nf++] = OFF_AL;
    fields[nf++] = o.nrk_off;
    for (int i = 0; i < o.nrk; i++) fields[nf++] = o.rk_off[i] - 4;
    size_t layout_fields[] = {OFF_NL, OFF_BS, OFF_KVH, OFF_HD, OFF_BB, OFF_BB + 4};
    for (size_t i = 0; i < sizeof layout_fields / sizeof *layout_fields; i++)
        fields[nf++] = layout_fields[i];
    if (allocated) fields[nf++] = OFF_NB; /* one allocation: more blocks make regions overlap */
    uint32_t deltas[] = {1, (uint32_t)-1, 0x7fffffffu, 0x80000000u, 0x10000u};
    for (int f = 0; f < nf; f++)
        for (size_t k = 0; k < sizeof deltas / sizeof *deltas; k++) {
            memcpy(m, desc, len);
            uint32_t v = rd32(m + fields[f]);
            if (fields[f] == OFF_BB + 4 && k != 4) continue; /* high half of the u64 */
            if (fields[f] == OFF_NB && k == 1) continue;     /* fewer blocks: still consistent */
            wr32(m + fields[f], v + deltas[k]);
            fix(m, len);
            if (parse(m, len, NULL) != PD_EFORMAT)
                KT_FAIL("field at %zu bumped by %d: accepted", fields[f], (int)deltas[k]);
            KT_EQ(kvt_target_open(b, src, m, len, &t, err), PD_EFORMAT);
        }
    /* Every bit of every address and remote-key byte flipped, re-checksummed: the parser
     * refuses (structure) or accepts (a payload byte UCX interprets); never a crash. Bytes that
     * carry structure must be refused. */
    int refused = 0, flips = 0;
    for (size_t i = 0; i < o.addr_len; i++)
        for (int bit = 0; bit < 8; bit++) {
            memcpy(m, desc, len);
            m[o.addr + i] ^= (uint8_t)(1u << bit);
            fix(m, len);
            int rc = parse(m, len, NULL);
            KT_CHECK(rc == 0 || rc == PD_EFORMAT);
            refused += rc != 0, flips++;
            if (i == 0 && bit < 4 && rc == 0) KT_FAIL("address version flipped: accepted");
        }
    for (int r = 0; r < o.nrk; r++)
        for (size_t i = 0; i < o.rk_len[r]; i++) {
            bool structural = i < 9; /* md_map and memory type */
            size_t c = 9; /* component size bytes */
            uint64_t md_map = 0;
            for (int j = 7; j >= 0; j--) md_map = md_map << 8 | desc[o.rk_off[r] + (size_t)j];
            for (int md = 0; md < 64 && c < o.rk_len[r]; md++)
                if (md_map >> md & 1) {
                    if (i == c) structural = true;
                    c += 1 + desc[o.rk_off[r] + c];
                }
            for (int bit = 0; bit < 8; bit++) {
                memcpy(m, desc, len);
                m[o.rk_off[r] + i] ^= (uint8_t)(1u << bit);
                fix(m, len);
                int rc = parse(m, len, NULL);
                KT_CHECK(rc == 0 || rc == PD_EFORMAT);
                refused += rc != 0, flips++;
                if (structural && rc == 0)
                    KT_FAIL("key %d byte %zu bit %d (structure): accepted", r, i, bit);
                if (rc == 0 && !structural) {
                    /* A payload byte: UCX gets it, padded; the open must end cleanly. */
                    int orc = kvt_target_open(b, src, m, len, &t, err);
                    KT_CHECK(orc == 0 || orc == PD_EFORMAT || orc == PD_EUNAVAILABLE);
                    if (orc == 0) kvt_target_close(t);
                }
            }
        }
    fprintf(stderr, "bit flips: %d of %d refused by the parser\n", refused, flips);
    /* Huge counts and lengths (no huge allocation may follow). */
    memcpy(m, desc, len);
    wr32(m + o.nrk_off, 0xffffffffu);
    fix(m, len);
    KT_EQ(parse(m, len, NULL), PD_EFORMAT);
    memcpy(m, desc, len);
    wr32(m + o.nrk_off, (uint32_t)(2 * kt_layout().n_layers + 1));
    fix(m, len);
    KT_EQ(parse(m, len, NULL), PD_EFORMAT);
    /* Bytes the old parser let through to UCX: an address or a key with a trailing byte, an
     * unknown address version (an assertion abort inside UCX), a key of another memory type. */
    size_t l2;
    uint8_t *c = insert(desc, len, o.addr + o.addr_len, 1, OFF_AL, &l2);
    KT_EQ(kvt_target_open(b, src, c, l2, &t, err), PD_EFORMAT);
    fprintf(stderr, "address + 1 byte: %s\n", err);
    KT_CHECK(strstr(err, "worker address"));
    free(c);
    c = insert(desc, len, o.rk_off[0] + o.rk_len[0], 3, o.rk_off[0] - 4, &l2);
    KT_EQ(kvt_target_open(b, src, c, l2, &t, err), PD_EFORMAT);
    fprintf(stderr, "key + 3 bytes: %s\n", err);
    KT_CHECK(strstr(err, "remote key"));
    free(c);
    memcpy(m, desc, len);
    m[o.addr] = (uint8_t)((m[o.addr] & 0xf0) | 5);
    fix(m, len);
    KT_EQ(kvt_target_open(b, src, m, len, &t, err), PD_EFORMAT);
    fprintf(stderr, "address version 5: %s\n", err);
    memcpy(m, desc, len);
    m[o.rk_off[0] + 8] = 200;
    fix(m, len);
    KT_EQ(kvt_target_open(b, src, m, len, &t, err), PD_EFORMAT);
    /* Unknown flags, a model id without its NUL. */
    memcpy(m, desc, len);
    m[OFF_VER + 2] |= 0x80;
    fix(m, len);
    KT_EQ(parse(m, len, NULL), PD_EFORMAT);
    memcpy(m, desc, len);
    memset(m + 64, 'x', 64);
    fix(m, len);
    KT_EQ(parse(m, len, NULL), PD_EFORMAT);
    free(m);
    /* The intact descriptor still opens and connects afterwards. */
    KT_OK(kvt_target_open(b, src, desc, len, &t, err), err);
    kvt_target_close(t);
}

static void write_file(const char *path, const char *s)
{
    FILE *f = fopen(path, "w");
    KT_CHECK(f != NULL);
    fputs(s, f);
    fclose(f);
}

/* Secrets: loading, signed descriptors, wrong / missing MACs, every bit flip of a signed one. */
static void test_signed(void)
{
    char err[PD_ERR_LEN];
    char f1[] = "/tmp/kvt_desc_s1_XXXXXX", f2[] = "/tmp/kvt_desc_s2_XXXXXX";
    close(mkstemp(f1));
    close(mkstemp(f2));
    kvt__secret s1, s2, tmp;
    write_file(f1, "short\n");
    KT_EQ(kvt__secret_load(f1, &tmp, err), PD_EINVAL);
    KT_CHECK(!strstr(err, "short"));
    KT_EQ(kvt__secret_load("/nonexistent/kvt", &tmp, err), PD_EIO);
    write_file(f1, "0123456789abcdef0123456789abcdef\n");
    write_file(f2, "fedcba9876543210fedcba9876543210");
    KT_OK(kvt__secret_load(f1, &s1, err), err);
    KT_EQ(s1.len, 32);
    KT_OK(kvt__secret_load(f2, &s2, err), err);

    kvt_params pa = kt_params("recv", &ev_a), pb = kt_params("send", &ev_b), pc = pb;
    pa.secret_file = f1;
    pb.secret_file = f2;
    pc.secret_file = NULL;
    kvt_params pbad = pa;
    pbad.secret_file = "/nonexistent/kvt";
    kvt_ctx *a, *b, *c, *x;
    KT_EQ(kvt_ctx_create(&pbad, &x, err), PD_EIO);
    KT_OK(kvt_ctx_create(&pa, &a, err), err);
    KT_OK(kvt_ctx_create(&pb, &b, err), err);
    KT_OK(kvt_ctx_create(&pc, &c, err), err);
    kvt_pool *dst = make_pool(a, 16, NULL, NULL);
    kvt_pool *src_b = make_pool(b, 8, NULL, NULL), *src_c = make_pool(c, 8, NULL, NULL);
    void *dv;
    size_t len;
    KT_OK(kvt_pool_export(dst, &dv, &len, err), err);
    uint8_t *desc = dv;
    KT_EQ(parse(desc, len, &s1), 0);
    KT_EQ(parse(desc, len, &s2), PD_EPERM);
    KT_EQ(parse(desc, len, NULL), PD_EPERM);
    kvt_target *t;
    KT_EQ(kvt_target_open(b, src_b, desc, len, &t, err), PD_EPERM);
    fprintf(stderr, "other secret: %s\n", err);
    KT_CHECK(strstr(err, "secrets") && strstr(err, "differ"));
    KT_EQ(kvt_target_open(c, src_c, desc, len, &t, err), PD_EPERM);
    fprintf(stderr, "no secret here: %s\n", err);
    /* Every single-bit change anywhere (checksum recomputed) is refused. */
    uint8_t *m = malloc(len);
    for (size_t i = 0; i < len - 8; i++)
        for (int bit = 0; bit < 8; bit++) {
            memcpy(m, desc, len);
            m[i] ^= (uint8_t)(1u << bit);
            fix(m, len);
            int rc = parse(m, len, &s1);
            if (rc != PD_EPERM && rc != PD_EFORMAT) KT_FAIL("byte %zu bit %d: %d", i, bit, rc);
        }
    /* The MAC stripped and the flag cleared: an unsigned descriptor, refused with a secret. */
    memcpy(m, desc, len);
    m[OFF_VER + 2] &= (uint8_t)~KVT_DESC_SIGNED;
    memmove(m + len - 8 - KVT_MAC_LEN, m + len - 8, 8);
    fix(m, len - KVT_MAC_LEN);
    KT_EQ(parse(m, len - KVT_MAC_LEN, NULL), 0);
    KT_EQ(parse(m, len - KVT_MAC_LEN, &s1), PD_EPERM);
    free(m);
    /* An unsigned descriptor is refused by a side that has a secret. */
    void *uv;
    size_t ulen;
    kvt_pool *udst = make_pool(c, 16, NULL, NULL);
    KT_OK(kvt_pool_export(udst, &uv, &ulen, err), err);
    KT_EQ(kvt_target_open(b, src_b, uv, ulen, &t, err), PD_EPERM);
    fprintf(stderr, "unsigned: %s\n", err);
    free(uv);
    free(desc);
    kvt_ctx_destroy(c);
    kvt_ctx_destroy(b);
    kvt_ctx_destroy(a);
    kvt__secret_wipe(&s1);
    kvt__secret_wipe(&s2);
    unlink(f1);
    unlink(f2);
}

int main(void)
{
    setenv("UCX_LOG_FILE", "stderr", 0);
    char err[PD_ERR_LEN];
    kvt_params pa = kt_params("recv", &ev_a), pb = kt_params("send", &ev_b);
    kvt_ctx *a, *b;
    KT_OK(kvt_ctx_create(&pa, &a, err), err);
    KT_OK(kvt_ctx_create(&pb, &b, err), err);
    kvt_pool *src = make_pool(b, 8, NULL, NULL);
    /* A UCX-allocated landing pool (one key) and one in caller memory (a key per region). */
    kvt_pool *alloc = make_pool(a, 32, NULL, NULL);
    void *k[4], *v[4];
    size_t rlen = 32 * kvt_layout_block_bytes(&(kvt_layout){.dtype = PD_DTYPE_BF16, .block_size = 16, .n_kv_heads = 2, .head_dim = 64});
    for (int i = 0; i < 4; i++) k[i] = calloc(1, rlen), v[i] = calloc(1, rlen);
    kvt_pool *user = make_pool(a, 32, k, v);
    for (int w = 0; w < 2; w++) {
        void *d;
        size_t len;
        KT_OK(kvt_pool_export(w ? user : alloc, &d, &len, err), err);
        attack(b, src, d, len, w == 0);
        free(d);
    }
    kvt_ctx_destroy(b);
    kvt_ctx_destroy(a);
    for (int i = 0; i < 4; i++) free(k[i]), free(v[i]);
    test_signed();
    fprintf(stderr, "test_kvt_desc: all passed\n");
    return 0;
}
