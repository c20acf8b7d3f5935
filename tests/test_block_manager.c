/* test_block_manager.c -- Unit tests for the paged KV block allocator: the chained block hash
 * against an independently built byte layout, allocation accounting, the prefix cache (hits,
 * limits, sharing, LRU eviction), capacity checks, growth, and a random stress run against a
 * shadow model of every block's KV contents. */
#include <stdbool.h>
#include <stdint.h>
#include <xxhash.h>

#include "common/error.h"
#include "engine/block_manager.h"
#include "test_util.h"

#define T_CAP 64  /* token capacity of a test sequence */
#define T_MAXB 64 /* block table capacity of a test sequence */

/* A hand-built sequence: pd_seq plus the storage it points into. Never copied after init. */
typedef struct {
    pd_seq s;
    int32_t tok[T_CAP];
    int32_t bt[T_MAXB];
} tseq;

static void tseq_init(tseq *t, const int32_t *tokens, int32_t n, int32_t max_blocks)
{
    memset(t, 0, sizeof *t);
    if (n > 0) memcpy(t->tok, tokens, (size_t)n * sizeof(int32_t));
    for (int32_t i = 0; i < T_MAXB; i++) t->bt[i] = -7;
    t->s.tokens = t->tok;
    t->s.block_table = t->bt;
    t->s.n_tokens = n;
    t->s.n_prompt = n;
    t->s.cap = T_CAP;
    t->s.max_blocks = max_blocks;
    t->s.status = SEQ_WAITING;
}

static bm *make_bm(int32_t n_blocks, int32_t block_size, bool cache)
{
    bm_params p = bm_default_params();
    p.n_blocks = n_blocks;
    p.block_size = block_size;
    p.enable_prefix_cache = cache;
    bm *m = NULL;
    int rc = bm_create(&p, &m);
    CHECK_EQ_INT(rc, 0);
    CHECK(m != NULL);
    return m;
}

/* The documented hash, built here byte by byte: le64(prev) || le32(t[0]) || ... */
static uint64_t ref_hash(uint64_t prev, const int32_t *t, int32_t bs)
{
    size_t n = 8 + 4 * (size_t)bs;
    uint8_t *b = malloc(n);
    if (!b) abort();
    for (int i = 0; i < 8; i++) b[i] = (uint8_t)((prev >> (8 * i)) & 0xff);
    for (int32_t j = 0; j < bs; j++) {
        uint32_t u = (uint32_t)t[j];
        b[8 + 4 * j + 0] = (uint8_t)(u & 0xff);
        b[8 + 4 * j + 1] = (uint8_t)((u >> 8) & 0xff);
        b[8 + 4 * j + 2] = (uint8_t)((u >> 16) & 0xff);
        b[8 + 4 * j + 3] = (uint8_t)((u >> 24) & 0xff);
    }
    uint64_t h = XXH64(b, n, 0);
    free(b);
    return h;
}

/* Chained reference hash of the first n_full blocks of t. */
static uint64_t ref_chain(const int32_t *t, int32_t n_full, int32_t bs)
{
    uint64_t h = 0;
    for (int32_t i = 0; i < n_full; i++) h = ref_hash(h, t + (size_t)i * bs, bs);
    return h;
}

#define CHECK_BM(m) CHECK_EQ_INT(bm_check(m), 0)

/* ---- hash ---- */

static void test_hash(void)
{
    /* The library is XXH64 (published test vectors). */
    CHECK(XXH64("", 0, 0) == 0xEF46DB3751D8E999ULL);
    CHECK(XXH64("abc", 3, 0) == 0x44BC2CF5AD770999ULL);

    /* A fixed vector: bytes written out by hand, no helper involved. */
    const int32_t t[4] = {1, 2, 0x01020304, -1};
    const uint8_t bytes[24] = {0xef, 0xcd, 0xab, 0x89, 0x67, 0x45, 0x23, 0x01, /* prev, LE */
                               0x01, 0x00, 0x00, 0x00, 0x02, 0x00, 0x00, 0x00,
                               0x04, 0x03, 0x02, 0x01, 0xff, 0xff, 0xff, 0xff};
    const uint64_t prev = 0x0123456789abcdefULL;
    uint64_t want = XXH64(bytes, sizeof bytes, 0);
    CHECK(want == 0x700dcff63f4b4961ULL); /* pinned: the cross-service block id must not drift */
    CHECK(pd_block_hash(prev, t, 4) == want);
    CHECK(ref_hash(prev, t, 4) == want);

    /* First block: prev = 0 is 8 zero bytes. */
    const int32_t t1[2] = {7, 300};
    const uint8_t b1[16] = {0, 0, 0, 0, 0, 0, 0, 0, 7, 0, 0, 0, 0x2c, 0x01, 0, 0};
    CHECK(pd_block_hash(0, t1, 2) == XXH64(b1, sizeof b1, 0));

    /* The example of docs/kv-blocks.md: tokens 1..9, B = 4, two full blocks. */
    const int32_t t9[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9};
    uint8_t d0[24] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 4, 0, 0, 0};
    uint64_t h0 = XXH64(d0, sizeof d0, 0);
    uint8_t d1[24] = {0, 0, 0, 0, 0, 0, 0, 0, 5, 0, 0, 0, 6, 0, 0, 0, 7, 0, 0, 0, 8, 0, 0, 0};
    for (int i = 0; i < 8; i++) d1[i] = (uint8_t)((h0 >> (8 * i)) & 0xff);
    uint64_t h1 = XXH64(d1, sizeof d1, 0);
    CHECK(pd_block_hash(0, t9, 4) == h0);
    CHECK(pd_block_hash(h0, t9 + 4, 4) == h1);
    CHECK(ref_chain(t9, 2, 4) == h1);

    /* Chaining: the same block under a different prefix hashes differently. */
    uint64_t a = pd_block_hash(0, t, 4), b = pd_block_hash(1, t, 4), c = pd_block_hash(a, t, 4);
    CHECK(a != b);
    CHECK(a != c);
    CHECK(b != c);
    CHECK(c == ref_hash(ref_hash(0, t, 4), t, 4));
    /* Order and content matter. */
    const int32_t t2[4] = {2, 1, 0x01020304, -1};
    CHECK(pd_block_hash(0, t2, 4) != a);

    /* Many block sizes, including the heap path above 256 tokens. */
    static int32_t big[1024];
    for (int32_t i = 0; i < 1024; i++) big[i] = (int32_t)(i * 2654435761u);
    const int32_t sizes[] = {1, 3, 16, 255, 256, 257, 1000, 1024};
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
        uint64_t p = 0x9e3779b97f4a7c15ULL * (k + 1);
        CHECK_MSG(pd_block_hash(p, big, sizes[k]) == ref_hash(p, big, sizes[k]),
                  "block size %d", sizes[k]);
    }
}

/* ---- create / params ---- */

static void test_create(void)
{
    bm_params p = bm_default_params();
    CHECK(p.n_blocks > 0);
    CHECK(p.block_size > 0);
    bm *m = (bm *)1;
    p.n_blocks = 0;
    CHECK_EQ_INT(bm_create(&p, &m), PD_EINVAL);
    CHECK(m == NULL);
    p = bm_default_params();
    p.block_size = 0;
    CHECK_EQ_INT(bm_create(&p, &m), PD_EINVAL);
    bm_destroy(NULL);

    m = make_bm(10, 4, true);
    CHECK_EQ_INT(bm_n_blocks(m), 10);
    CHECK_EQ_INT(bm_block_size(m), 4);
    CHECK_EQ_INT(bm_n_free(m), 10);
    CHECK_EQ_INT(bm_n_used(m), 0);
    CHECK_EQ_INT(bm_n_cached_blocks(m), 0);
    for (int32_t i = 0; i < 10; i++) CHECK_EQ_INT(bm_ref(m, i), 0);
    CHECK_BM(m);
    bm_destroy(m);
}

/* ---- allocate / free ---- */

static void test_alloc_free(void)
{
    bm *m = make_bm(8, 4, true);
    int32_t toks[40];
    for (int32_t i = 0; i < 40; i++) toks[i] = 1000 + i;
    static tseq a, b, c, d;

    /* 10 tokens -> 3 blocks. */
    tseq_init(&a, toks, 10, 16);
    CHECK_EQ_INT(bm_can_allocate(m, &a.s, 10), 0);
    CHECK_EQ_INT(bm_allocate(m, &a.s, 10), 0);
    CHECK_BM(m);
    CHECK_EQ_INT(a.s.n_blocks, 3);
    CHECK_EQ_INT(a.s.n_computed, 0);
    CHECK_EQ_INT(a.s.n_cached, 0);
    CHECK_EQ_INT(a.s.n_hashed, 0);
    CHECK_EQ_INT(bm_n_free(m), 5);
    CHECK_EQ_INT(bm_n_used(m), 3);
    for (int32_t i = 0; i < 3; i++) {
        CHECK(a.bt[i] >= 0 && a.bt[i] < 8);
        CHECK_EQ_INT(bm_ref(m, a.bt[i]), 1);
        for (int32_t j = 0; j < i; j++) CHECK(a.bt[i] != a.bt[j]);
    }
    CHECK_EQ_INT(a.bt[3], -7); /* nothing written past n_blocks */

    /* n_reserve below n_tokens is raised to n_tokens; above reserves more blocks. */
    tseq_init(&b, toks, 5, 16);
    CHECK_EQ_INT(bm_can_allocate(m, &b.s, 0), 0);
    CHECK_EQ_INT(bm_allocate(m, &b.s, 17), 0);
    CHECK_BM(m);
    CHECK_EQ_INT(b.s.n_blocks, 5);
    CHECK_EQ_INT(bm_n_free(m), 0);
    CHECK_EQ_INT(bm_n_used(m), 8);

    /* Pool empty: ENOSPC, nothing changed. */
    tseq_init(&c, toks, 1, 16);
    CHECK_EQ_INT(bm_can_allocate(m, &c.s, 1), PD_ENOSPC);
    CHECK_EQ_INT(bm_allocate(m, &c.s, 1), PD_ENOSPC);
    CHECK_EQ_INT(c.s.n_blocks, 0);
    CHECK_EQ_INT(c.bt[0], -7);
    CHECK_EQ_INT(bm_n_free(m), 0);
    CHECK_BM(m);

    bm_free(m, &a.s);
    CHECK_BM(m);
    CHECK_EQ_INT(a.s.n_blocks, 0);
    CHECK_EQ_INT(bm_n_free(m), 3);
    CHECK_EQ_INT(bm_n_used(m), 5);

    /* 4 blocks wanted, 3 free: ENOSPC and nothing changed; 3 blocks fit exactly. */
    tseq_init(&d, toks, 13, 16);
    CHECK_EQ_INT(bm_can_allocate(m, &d.s, 13), PD_ENOSPC);
    CHECK_EQ_INT(bm_allocate(m, &d.s, 13), PD_ENOSPC);
    CHECK_EQ_INT(d.s.n_blocks, 0);
    CHECK_EQ_INT(d.s.n_computed, 0);
    CHECK_EQ_INT(bm_n_free(m), 3);
    CHECK_BM(m);
    CHECK_EQ_INT(bm_can_allocate(m, &d.s, 12), PD_ENOSPC); /* n_reserve < n_tokens: 13 */
    CHECK_EQ_INT(bm_can_allocate(m, &c.s, 12), 0); /* 1 token, 12 reserved: 3 blocks */
    CHECK_EQ_INT(bm_can_allocate(m, &c.s, 13), PD_ENOSPC);
    d.s.n_tokens = 12;
    CHECK_EQ_INT(bm_can_allocate(m, &d.s, 12), 0);
    CHECK_EQ_INT(bm_allocate(m, &d.s, 12), 0);
    CHECK_EQ_INT(d.s.n_blocks, 3);
    CHECK_EQ_INT(bm_n_free(m), 0);
    CHECK_BM(m);

    /* More blocks than the sequence's table holds: PD_EINVAL, nothing changed. */
    bm_free(m, &b.s);
    bm_free(m, &d.s);
    CHECK_EQ_INT(bm_n_free(m), 8);
    tseq_init(&c, toks, 9, 2);
    CHECK_EQ_INT(bm_can_allocate(m, &c.s, 9), PD_EINVAL);
    CHECK_EQ_INT(bm_allocate(m, &c.s, 9), PD_EINVAL);
    CHECK_EQ_INT(c.s.n_blocks, 0);
    CHECK_EQ_INT(bm_can_allocate(m, &c.s, 8), PD_EINVAL); /* n_tokens wins over n_reserve */
    c.s.n_tokens = 8;
    CHECK_EQ_INT(bm_allocate(m, &c.s, 8), 0);
    CHECK_EQ_INT(c.s.n_blocks, 2);
    bm_free(m, &c.s);
    /* An empty sequence needs no block. */
    tseq_init(&c, toks, 0, 4);
    CHECK_EQ_INT(bm_allocate(m, &c.s, 0), 0);
    CHECK_EQ_INT(c.s.n_blocks, 0);
    bm_free(m, &c.s);
    CHECK_EQ_INT(bm_n_free(m), 8);
    CHECK_EQ_INT(bm_n_used(m), 0);
    CHECK_BM(m);
    bm_destroy(m);
}

/* ---- prefix cache ---- */

static void test_prefix_cache(void)
{
    const int32_t bs = 4;
    bm *m = make_bm(16, bs, true);
    int32_t ta[14], tb[13];
    for (int32_t i = 0; i < 14; i++) ta[i] = 10 + i;
    memcpy(tb, ta, 8 * sizeof(int32_t));
    for (int32_t i = 8; i < 13; i++) tb[i] = 500 + i; /* third block differs */
    static tseq a, b, c, x;

    /* A: 3 full blocks + 2 tokens. */
    tseq_init(&a, ta, 14, 16);
    CHECK_EQ_INT(bm_allocate(m, &a.s, 14), 0);
    int32_t a_ids[4];
    memcpy(a_ids, a.bt, sizeof a_ids);
    a.s.n_computed = 14;
    bm_commit(m, &a.s, 14);
    CHECK_BM(m);
    CHECK_EQ_INT(a.s.n_hashed, 3);
    CHECK(a.s.last_hash == ref_chain(ta, 3, bs));
    CHECK_EQ_INT(bm_n_cached_blocks(m), 3);
    bm_commit(m, &a.s, 14); /* idempotent */
    CHECK_EQ_INT(bm_n_cached_blocks(m), 3);
    CHECK_EQ_INT(a.s.n_hashed, 3);
    bm_free(m, &a.s);
    CHECK_BM(m);
    CHECK_EQ_INT(a.s.n_hashed, 0);
    CHECK(a.s.last_hash == 0);
    CHECK_EQ_INT(bm_n_cached_blocks(m), 3); /* cached blocks survive their last user */
    CHECK_EQ_INT(bm_n_free(m), 16);
    for (int32_t i = 0; i < 4; i++) CHECK_EQ_INT(bm_ref(m, a_ids[i]), 0);

    /* B shares A's first two blocks. */
    tseq_init(&b, tb, 13, 16);
    CHECK_EQ_INT(bm_can_allocate(m, &b.s, 13), 2 * bs);
    CHECK_EQ_INT(bm_allocate(m, &b.s, 13), 2 * bs);
    CHECK_BM(m);
    CHECK_EQ_INT(b.s.n_blocks, 4);
    CHECK_EQ_INT(b.bt[0], a_ids[0]);
    CHECK_EQ_INT(b.bt[1], a_ids[1]);
    CHECK(b.bt[2] != a_ids[2]); /* A's cached third block is not evicted while others are free */
    CHECK(b.bt[3] != a_ids[2]);
    CHECK_EQ_INT(b.s.n_computed, 2 * bs);
    CHECK_EQ_INT(b.s.n_cached, 2 * bs);
    CHECK_EQ_INT(b.s.n_hashed, 2);
    CHECK(b.s.last_hash == ref_chain(ta, 2, bs));
    CHECK_EQ_INT(bm_ref(m, a_ids[0]), 1);
    CHECK_EQ_INT(bm_n_cached_blocks(m), 3);
    CHECK_EQ_INT(bm_n_free(m), 12);
    CHECK_EQ_INT(bm_n_used(m), 4);

    /* While B lives, C = A's tokens shares all 3 of A's full blocks (2 of them with B). */
    tseq_init(&c, ta, 14, 16);
    CHECK_EQ_INT(bm_allocate(m, &c.s, 14), 3 * bs);
    CHECK_BM(m);
    CHECK_EQ_INT(c.bt[0], a_ids[0]);
    CHECK_EQ_INT(c.bt[1], a_ids[1]);
    CHECK_EQ_INT(c.bt[2], a_ids[2]);
    CHECK_EQ_INT(bm_ref(m, a_ids[0]), 2);
    CHECK_EQ_INT(bm_ref(m, a_ids[1]), 2);
    CHECK_EQ_INT(bm_ref(m, a_ids[2]), 1);
    CHECK_EQ_INT(bm_ref(m, c.bt[3]), 1);
    CHECK_EQ_INT(bm_n_used(m), 6); /* 4 of B + A's third block + C's fresh last block */
    CHECK(c.s.last_hash == ref_chain(ta, 3, bs));
    bm_free(m, &c.s);
    CHECK_BM(m);
    CHECK_EQ_INT(bm_ref(m, a_ids[0]), 1);
    CHECK_EQ_INT(bm_ref(m, a_ids[2]), 0);
    bm_free(m, &b.s);
    CHECK_BM(m);

    /* Hits stop at (n_tokens - 1) / bs so that one token is always computed. */
    for (int32_t n = 1; n <= 14; n++) {
        tseq_init(&x, ta, n, 16);
        int32_t want = ((n - 1) / bs) * bs;
        if (want > 3 * bs) want = 3 * bs;
        CHECK_MSG(bm_can_allocate(m, &x.s, n) == want, "n_tokens %d", n);
    }
    tseq_init(&x, ta, 8, 16); /* exactly 2 full blocks, both cached: only 1 reused */
    CHECK_EQ_INT(bm_allocate(m, &x.s, 8), bs);
    CHECK_EQ_INT(x.s.n_blocks, 2);
    CHECK_EQ_INT(x.bt[0], a_ids[0]);
    CHECK(x.bt[1] != a_ids[1]);
    CHECK_EQ_INT(x.s.n_computed, bs);
    CHECK_EQ_INT(x.s.n_hashed, 1);
    CHECK_BM(m);
    bm_free(m, &x.s);

    /* skip_prefix_cache: no hits, and the cached blocks are not touched. */
    tseq_init(&x, ta, 14, 16);
    x.s.skip_prefix_cache = true;
    CHECK_EQ_INT(bm_can_allocate(m, &x.s, 14), 0);
    CHECK_EQ_INT(bm_allocate(m, &x.s, 14), 0);
    CHECK_EQ_INT(x.s.n_computed, 0);
    CHECK_EQ_INT(x.s.n_hashed, 0);
    CHECK(x.s.last_hash == 0);
    for (int32_t i = 0; i < 4; i++)
        for (int32_t j = 0; j < 3; j++) CHECK(x.bt[i] != a_ids[j]);
    CHECK_EQ_INT(bm_n_cached_blocks(m), 3);
    CHECK_BM(m);
    bm_free(m, &x.s);

    /* Content: a different first block, or the same blocks in another order, never hit. */
    int32_t td[14];
    memcpy(td, ta, sizeof td);
    td[0] = 9999;
    tseq_init(&x, td, 14, 16); /* blocks 1 and 2 equal A's, but under another prefix */
    CHECK_EQ_INT(bm_can_allocate(m, &x.s, 14), 0);
    int32_t te[14];
    memcpy(te, ta + 4, 4 * sizeof(int32_t));
    memcpy(te + 4, ta, 4 * sizeof(int32_t));
    memcpy(te + 8, ta + 8, 6 * sizeof(int32_t));
    tseq_init(&x, te, 14, 16);
    CHECK_EQ_INT(bm_can_allocate(m, &x.s, 14), 0);
    memcpy(td, ta, sizeof td);
    td[6] = -5; /* one token of the second block differs: only the first block hits */
    tseq_init(&x, td, 14, 16);
    CHECK_EQ_INT(bm_can_allocate(m, &x.s, 14), bs);
    memcpy(td, ta, sizeof td);
    td[11] = -5; /* last token of the third block differs */
    tseq_init(&x, td, 14, 16);
    CHECK_EQ_INT(bm_can_allocate(m, &x.s, 14), 2 * bs);
    CHECK_EQ_INT(bm_n_free(m), 16);
    CHECK_BM(m);
    bm_destroy(m);

    /* Prefix cache disabled: commit registers nothing, nothing hits. */
    m = make_bm(16, bs, false);
    tseq_init(&a, ta, 14, 16);
    CHECK_EQ_INT(bm_allocate(m, &a.s, 14), 0);
    a.s.n_computed = 14;
    bm_commit(m, &a.s, 14);
    CHECK_EQ_INT(bm_n_cached_blocks(m), 0);
    CHECK_BM(m);
    tseq_init(&c, ta, 14, 16);
    CHECK_EQ_INT(bm_can_allocate(m, &c.s, 14), 0);
    CHECK_EQ_INT(bm_allocate(m, &c.s, 14), 0); /* while A still holds its blocks */
    for (int32_t i = 0; i < 4; i++) CHECK_EQ_INT(bm_ref(m, c.bt[i]), 1);
    bm_free(m, &a.s);
    bm_free(m, &c.s);
    tseq_init(&c, ta, 14, 16);
    CHECK_EQ_INT(bm_can_allocate(m, &c.s, 14), 0);
    CHECK_EQ_INT(bm_n_free(m), 16);
    CHECK_BM(m);
    bm_destroy(m);
}

/* ---- commit ---- */

static void test_commit(void)
{
    const int32_t bs = 4;
    bm *m = make_bm(16, bs, true);
    int32_t t[14];
    for (int32_t i = 0; i < 14; i++) t[i] = 3 * i + 1;
    static tseq a, b, x;

    /* n_ready ahead of n_computed: only the full blocks within n_ready. */
    tseq_init(&a, t, 14, 16);
    CHECK_EQ_INT(bm_allocate(m, &a.s, 14), 0);
    bm_commit(m, &a.s, 3);
    CHECK_EQ_INT(bm_n_cached_blocks(m), 0);
    CHECK_EQ_INT(a.s.n_hashed, 0);
    bm_commit(m, &a.s, 5);
    CHECK_EQ_INT(bm_n_cached_blocks(m), 1);
    CHECK_EQ_INT(a.s.n_hashed, 1);
    CHECK(a.s.last_hash == ref_chain(t, 1, bs));
    CHECK_EQ_INT(a.s.n_computed, 0); /* commit does not move n_computed */
    bm_commit(m, &a.s, 7);
    CHECK_EQ_INT(bm_n_cached_blocks(m), 1);
    bm_commit(m, &a.s, 8);
    CHECK_EQ_INT(bm_n_cached_blocks(m), 2);
    CHECK_EQ_INT(a.s.n_hashed, 2);
    CHECK(a.s.last_hash == ref_chain(t, 2, bs));
    bm_commit(m, &a.s, 4); /* going back changes nothing */
    CHECK_EQ_INT(bm_n_cached_blocks(m), 2);
    CHECK_EQ_INT(a.s.n_hashed, 2);
    CHECK_BM(m);
    /* Registered blocks are visible to another sequence while A still holds them. */
    tseq_init(&x, t, 14, 16);
    CHECK_EQ_INT(bm_can_allocate(m, &x.s, 14), 2 * bs);
    bm_commit(m, &a.s, 14);
    CHECK_EQ_INT(bm_n_cached_blocks(m), 3);
    CHECK_EQ_INT(a.s.n_hashed, 3);
    CHECK_EQ_INT(bm_can_allocate(m, &x.s, 14), 3 * bs);
    CHECK_BM(m);

    /* B computed the same content independently (allocated before A registered anything):
     * its blocks are not registered twice, but its chain state advances so that its own next
     * block registers under the right hash. */
    int32_t tb[16];
    memcpy(tb, t, 12 * sizeof(int32_t));
    tb[12] = 77; tb[13] = 78; tb[14] = 79; tb[15] = 80;
    tseq_init(&b, tb, 16, 16);
    b.s.skip_prefix_cache = true; /* force fresh blocks although A's are cached */
    CHECK_EQ_INT(bm_allocate(m, &b.s, 17), 0);
    CHECK_EQ_INT(b.s.n_blocks, 5);
    bm_commit(m, &b.s, 12);
    CHECK_EQ_INT(bm_n_cached_blocks(m), 3);
    CHECK_EQ_INT(b.s.n_hashed, 3);
    CHECK(b.s.last_hash == ref_chain(t, 3, bs));
    CHECK_BM(m);
    bm_commit(m, &b.s, 16);
    CHECK_EQ_INT(bm_n_cached_blocks(m), 4);
    CHECK_EQ_INT(b.s.n_hashed, 4);
    CHECK(b.s.last_hash == ref_chain(tb, 4, bs));
    CHECK_BM(m);
    /* n_hashed never passes n_blocks. */
    tseq_init(&x, t, 14, 16);
    x.s.skip_prefix_cache = true;
    CHECK_EQ_INT(bm_allocate(m, &x.s, 4), 0); /* n_reserve raised to n_tokens */
    CHECK_EQ_INT(x.s.n_blocks, 4);
    CHECK_EQ_INT(bm_n_used(m), 4 + 5 + 4);
    x.s.n_blocks = 1; /* as if the table were shorter than the tokens */
    bm_commit(m, &x.s, 12);
    CHECK_EQ_INT(x.s.n_hashed, 1);
    x.s.n_blocks = 4;
    bm_free(m, &x.s);
    CHECK_EQ_INT(bm_n_used(m), 4 + 5);

    /* A sequence with B's 17 tokens hits A's three blocks and B's fourth. */
    int32_t tz[17];
    memcpy(tz, tb, sizeof tb);
    tz[16] = 5;
    tseq_init(&x, tz, 17, 16);
    CHECK_EQ_INT(bm_allocate(m, &x.s, 17), 4 * bs);
    CHECK_EQ_INT(x.bt[0], a.bt[0]);
    CHECK_EQ_INT(x.bt[1], a.bt[1]);
    CHECK_EQ_INT(x.bt[2], a.bt[2]);
    CHECK_EQ_INT(x.bt[3], b.bt[3]);
    CHECK(x.s.last_hash == ref_chain(tz, 4, bs));
    CHECK_BM(m);
    bm_free(m, &x.s);
    bm_free(m, &a.s);
    bm_free(m, &b.s);
    CHECK_EQ_INT(bm_n_free(m), 16);
    CHECK_EQ_INT(bm_n_cached_blocks(m), 4);
    CHECK_BM(m);
    bm_destroy(m);
}

/* ---- LRU and eviction ---- */

static void test_lru(void)
{
    const int32_t bs = 2;
    bm *m = make_bm(6, bs, true);
    const int32_t ta[5] = {1, 2, 3, 4, 5};
    const int32_t tb[3] = {20, 21, 22};
    int32_t tc[8];
    for (int32_t i = 0; i < 8; i++) tc[i] = 40 + i;
    const int32_t te[1] = {60};
    static tseq a, b, c, e, x;

    /* A: blocks {0,1,2}; 0 and 1 cached. */
    tseq_init(&a, ta, 5, 8);
    CHECK_EQ_INT(bm_allocate(m, &a.s, 5), 0);
    CHECK_EQ_INT(a.bt[0], 0);
    CHECK_EQ_INT(a.bt[1], 1);
    CHECK_EQ_INT(a.bt[2], 2);
    bm_commit(m, &a.s, 5);
    CHECK_EQ_INT(bm_n_cached_blocks(m), 2);
    bm_free(m, &a.s);
    CHECK_BM(m);

    /* B (distinct): the uncached freed block 2 is reused first, then never-used ones. */
    tseq_init(&b, tb, 3, 8);
    CHECK_EQ_INT(bm_allocate(m, &b.s, 3), 0);
    CHECK_EQ_INT(b.bt[0], 2);
    CHECK_EQ_INT(b.bt[1], 3);
    CHECK_EQ_INT(bm_n_cached_blocks(m), 2);
    bm_commit(m, &b.s, 3); /* block 2 now cached under B's first block */
    CHECK_EQ_INT(bm_n_cached_blocks(m), 3);
    bm_free(m, &b.s);
    CHECK_BM(m);

    /* C needs 4 fresh blocks: 3 and the never-used 4, 5, then one eviction. The least recently
     * freed cached blocks are A's, and of a sequence the tail goes first: block 1. */
    tseq_init(&c, tc, 8, 8);
    CHECK_EQ_INT(bm_allocate(m, &c.s, 8), 0);
    CHECK_EQ_INT(c.bt[0], 3);
    CHECK_EQ_INT(c.bt[1], 4);
    CHECK_EQ_INT(c.bt[2], 5);
    CHECK_EQ_INT(c.bt[3], 1);
    CHECK_EQ_INT(bm_n_cached_blocks(m), 2);
    CHECK_BM(m);
    tseq_init(&x, ta, 5, 8);
    CHECK_EQ_INT(bm_can_allocate(m, &x.s, 5), PD_ENOSPC); /* 2 free, 3 needed */
    CHECK_EQ_INT(bm_can_allocate(m, &x.s, 0), PD_ENOSPC);
    tseq_init(&x, ta, 3, 8);
    CHECK_EQ_INT(bm_can_allocate(m, &x.s, 3), bs); /* block 0 still hits; block 1 is gone */
    tseq_init(&x, tb, 3, 8);
    CHECK_EQ_INT(bm_can_allocate(m, &x.s, 3), bs);

    /* One more fresh block: A's head (block 0) goes before B's more recently freed block 2. */
    tseq_init(&e, te, 1, 8);
    CHECK_EQ_INT(bm_allocate(m, &e.s, 1), 0);
    CHECK_EQ_INT(e.bt[0], 0);
    CHECK_EQ_INT(bm_n_cached_blocks(m), 1);
    CHECK_BM(m);
    bm_free(m, &c.s); /* room to ask again */
    tseq_init(&x, ta, 3, 8);
    CHECK_EQ_INT(bm_can_allocate(m, &x.s, 3), 0);
    tseq_init(&x, tb, 3, 8);
    CHECK_EQ_INT(bm_can_allocate(m, &x.s, 3), bs);
    bm_free(m, &e.s);
    CHECK_EQ_INT(bm_n_free(m), 6);
    CHECK_BM(m);
    bm_destroy(m);

    /* Reuse refreshes recency: P freed before Q, then P hit and freed again; eviction now
     * takes Q's block first. */
    m = make_bm(4, bs, true);
    const int32_t tp[3] = {1, 1, 9}, tq[3] = {2, 2, 9};
    static tseq p, q;
    tseq_init(&p, tp, 3, 8);
    tseq_init(&q, tq, 3, 8);
    CHECK_EQ_INT(bm_allocate(m, &p.s, 3), 0);
    CHECK_EQ_INT(bm_allocate(m, &q.s, 3), 0);
    bm_commit(m, &p.s, 2);
    bm_commit(m, &q.s, 2);
    int32_t p0 = p.bt[0], q0 = q.bt[0];
    bm_free(m, &p.s);
    bm_free(m, &q.s);
    CHECK_EQ_INT(bm_n_cached_blocks(m), 2);
    tseq_init(&p, tp, 3, 8);
    CHECK_EQ_INT(bm_allocate(m, &p.s, 3), bs);
    CHECK_EQ_INT(p.bt[0], p0);
    bm_free(m, &p.s);
    CHECK_BM(m);
    int32_t tf[6] = {7, 7, 7, 7, 7, 7};
    tseq_init(&x, tf, 6, 8); /* 3 fresh: 2 uncached, then the oldest cached: Q's */
    CHECK_EQ_INT(bm_allocate(m, &x.s, 6), 0);
    CHECK_EQ_INT(x.bt[2], q0);
    CHECK_EQ_INT(bm_n_cached_blocks(m), 1);
    bm_free(m, &x.s);
    tseq_init(&p, tp, 3, 8);
    CHECK_EQ_INT(bm_can_allocate(m, &p.s, 3), bs);
    tseq_init(&q, tq, 3, 8);
    CHECK_EQ_INT(bm_can_allocate(m, &q.s, 3), 0); /* no longer a hit */
    CHECK_BM(m);
    bm_destroy(m);
}

/* ---- capacity with cached free blocks ---- */

static void test_capacity_with_hits(void)
{
    const int32_t bs = 2;
    bm *m = make_bm(4, bs, true);
    const int32_t ta[5] = {1, 2, 3, 4, 5};
    static tseq a, y, x;
    tseq_init(&a, ta, 5, 8);
    CHECK_EQ_INT(bm_allocate(m, &a.s, 5), 0);
    bm_commit(m, &a.s, 4); /* blocks 0 and 1 cached */
    bm_free(m, &a.s);
    CHECK_EQ_INT(bm_n_free(m), 4);
    CHECK_EQ_INT(bm_n_cached_blocks(m), 2);

    /* 4 free blocks, 2 of them the cached hits: 2 hits + 2 fresh fits exactly. */
    const int32_t tx[7] = {1, 2, 3, 4, 8, 8, 8};
    tseq_init(&x, tx, 7, 8);
    CHECK_EQ_INT(bm_can_allocate(m, &x.s, 7), 2 * bs);

    /* Y takes one (uncached) block; 3 free. X needs 4 blocks: 2 hits, which are free and count
     * against the 3 free blocks, + 2 fresh = 4 > 3. */
    const int32_t ty[1] = {50};
    tseq_init(&y, ty, 1, 8);
    CHECK_EQ_INT(bm_allocate(m, &y.s, 1), 0);
    CHECK_EQ_INT(bm_n_free(m), 3);
    CHECK_EQ_INT(bm_n_cached_blocks(m), 2); /* Y got the uncached block */
    CHECK_EQ_INT(bm_can_allocate(m, &x.s, 7), PD_ENOSPC);
    CHECK_EQ_INT(bm_allocate(m, &x.s, 7), PD_ENOSPC);
    CHECK_EQ_INT(x.s.n_blocks, 0);
    CHECK_EQ_INT(x.s.n_computed, 0);
    CHECK_EQ_INT(bm_n_free(m), 3);
    CHECK_EQ_INT(bm_n_cached_blocks(m), 2);
    for (int32_t i = 0; i < 2; i++) CHECK_EQ_INT(bm_ref(m, i), 0);
    CHECK_BM(m);
    /* The same prompt reserving only 3 blocks (2 hits + 1 fresh) fits exactly. */
    const int32_t tx2[5] = {1, 2, 3, 4, 8};
    tseq_init(&x, tx2, 5, 8);
    CHECK_EQ_INT(bm_can_allocate(m, &x.s, 7), PD_ENOSPC);
    CHECK_EQ_INT(bm_can_allocate(m, &x.s, 6), 2 * bs);
    CHECK_EQ_INT(bm_can_allocate(m, &x.s, 5), 2 * bs);
    CHECK_EQ_INT(bm_allocate(m, &x.s, 5), 2 * bs);
    CHECK_EQ_INT(bm_n_free(m), 0);
    CHECK_EQ_INT(bm_n_cached_blocks(m), 2);
    CHECK_EQ_INT(x.bt[0], 0);
    CHECK_EQ_INT(x.bt[1], 1);
    CHECK_BM(m);

    /* Hits on blocks held by a live sequence cost no free capacity: W shares X's two blocks
     * and needs just one fresh block, which exists once Y is freed. */
    static tseq w;
    tseq_init(&w, tx2, 5, 8);
    CHECK_EQ_INT(bm_can_allocate(m, &w.s, 5), PD_ENOSPC);
    bm_free(m, &y.s);
    CHECK_EQ_INT(bm_n_free(m), 1);
    CHECK_EQ_INT(bm_can_allocate(m, &w.s, 5), 2 * bs);
    CHECK_EQ_INT(bm_allocate(m, &w.s, 5), 2 * bs);
    CHECK_EQ_INT(bm_ref(m, 0), 2);
    CHECK_EQ_INT(bm_ref(m, 1), 2);
    CHECK_EQ_INT(bm_n_free(m), 0);
    CHECK_BM(m);
    bm_free(m, &w.s);
    bm_free(m, &x.s);
    CHECK_EQ_INT(bm_n_free(m), 4);
    CHECK_BM(m);
    bm_destroy(m);
}

/* ---- append ---- */

static void test_append(void)
{
    const int32_t bs = 4;
    bm *m = make_bm(6, bs, true);
    int32_t t[24];
    for (int32_t i = 0; i < 24; i++) t[i] = i;
    static tseq a, b;
    tseq_init(&a, t, 3, 4); /* at most 4 blocks = 16 tokens */
    CHECK_EQ_INT(bm_allocate(m, &a.s, 3), 0);
    CHECK_EQ_INT(a.s.n_blocks, 1);
    CHECK(bm_can_append(m, &a.s, 4));
    CHECK_EQ_INT(bm_append(m, &a.s, 4), 0);
    CHECK_EQ_INT(a.s.n_blocks, 1);
    CHECK(bm_can_append(m, &a.s, 2)); /* shrinking is a no-op */
    CHECK_EQ_INT(bm_append(m, &a.s, 2), 0);
    CHECK_EQ_INT(a.s.n_blocks, 1);
    CHECK_EQ_INT(bm_append(m, &a.s, 5), 0);
    CHECK_EQ_INT(a.s.n_blocks, 2);
    CHECK_EQ_INT(bm_n_free(m), 4);
    CHECK_EQ_INT(bm_ref(m, a.bt[1]), 1);
    CHECK(a.bt[1] != a.bt[0]);
    CHECK_BM(m);
    CHECK_EQ_INT(bm_append(m, &a.s, 16), 0); /* two blocks at once */
    CHECK_EQ_INT(a.s.n_blocks, 4);
    CHECK_EQ_INT(bm_n_free(m), 2);
    CHECK_BM(m);
    /* Beyond max_blocks: refused, nothing changed, although blocks are free. */
    CHECK(!bm_can_append(m, &a.s, 17));
    CHECK(bm_append(m, &a.s, 17) < 0);
    CHECK_EQ_INT(a.s.n_blocks, 4);
    CHECK_EQ_INT(bm_n_free(m), 2);
    CHECK_EQ_INT(a.bt[4], -7);
    CHECK_BM(m);

    /* Pool exhaustion. */
    tseq_init(&b, t, 1, 16);
    CHECK_EQ_INT(bm_allocate(m, &b.s, 1), 0);
    CHECK(bm_can_append(m, &b.s, 8));
    CHECK(!bm_can_append(m, &b.s, 9));
    CHECK_EQ_INT(bm_append(m, &b.s, 9), PD_ENOSPC);
    CHECK_EQ_INT(b.s.n_blocks, 1);
    CHECK_EQ_INT(bm_n_free(m), 1);
    CHECK_EQ_INT(bm_append(m, &b.s, 8), 0);
    CHECK_EQ_INT(bm_n_free(m), 0);
    CHECK(bm_can_append(m, &b.s, 8));
    CHECK(!bm_can_append(m, &b.s, 9));
    CHECK_BM(m);

    /* Appending evicts cached free blocks when nothing else is free. */
    bm_free(m, &b.s);
    memcpy(a.tok, t, 16 * sizeof(int32_t));
    a.s.n_tokens = 16;
    a.s.n_computed = 16;
    bm_commit(m, &a.s, 16);
    CHECK_EQ_INT(bm_n_cached_blocks(m), 4);
    bm_free(m, &a.s); /* 4 cached + 2 uncached free */
    tseq_init(&b, t + 8, 1, 16);
    CHECK_EQ_INT(bm_allocate(m, &b.s, 1), 0);
    CHECK_EQ_INT(bm_append(m, &b.s, 12), 0); /* 2 uncached + 1 eviction */
    CHECK_EQ_INT(bm_n_cached_blocks(m), 3);
    CHECK_EQ_INT(bm_append(m, &b.s, 24), 0); /* 3 more evictions */
    CHECK_EQ_INT(b.s.n_blocks, 6);
    CHECK_EQ_INT(bm_n_cached_blocks(m), 0);
    CHECK_EQ_INT(bm_n_free(m), 0);
    CHECK_BM(m);
    bm_free(m, &b.s);
    CHECK_EQ_INT(bm_n_free(m), 6);
    CHECK_BM(m);
    bm_destroy(m);
}

/* ---- drop cache ---- */

static void test_drop_cache(void)
{
    const int32_t bs = 4;
    bm *m = make_bm(12, bs, true);
    int32_t t[13];
    for (int32_t i = 0; i < 13; i++) t[i] = 100 - i;
    static tseq a, b, x;
    tseq_init(&a, t, 13, 8);
    CHECK_EQ_INT(bm_allocate(m, &a.s, 13), 0);
    bm_commit(m, &a.s, 12);
    tseq_init(&b, t, 13, 8);
    CHECK_EQ_INT(bm_allocate(m, &b.s, 13), 3 * bs);
    bm_free(m, &a.s); /* a's last block free, three shared ones held by b */
    CHECK_EQ_INT(bm_n_cached_blocks(m), 3);
    int32_t n_free = bm_n_free(m);

    bm_drop_cache(m);
    CHECK_EQ_INT(bm_n_cached_blocks(m), 0);
    CHECK_EQ_INT(bm_n_free(m), n_free);
    CHECK_EQ_INT(bm_ref(m, b.bt[0]), 1);
    CHECK_BM(m);
    tseq_init(&x, t, 13, 8);
    CHECK_EQ_INT(bm_can_allocate(m, &x.s, 13), 0);
    bm_drop_cache(m); /* twice is harmless */
    CHECK_EQ_INT(bm_n_cached_blocks(m), 0);
    CHECK_BM(m);

    /* The cache works again afterwards for newly computed blocks. */
    tseq_init(&a, t, 13, 8);
    a.s.skip_prefix_cache = true;
    CHECK_EQ_INT(bm_allocate(m, &a.s, 13), 0);
    bm_commit(m, &a.s, 13);
    CHECK_EQ_INT(bm_n_cached_blocks(m), 3);
    CHECK_EQ_INT(bm_can_allocate(m, &x.s, 13), 3 * bs);
    bm_free(m, &a.s);
    bm_free(m, &b.s);
    CHECK_EQ_INT(bm_n_free(m), 12);
    CHECK_BM(m);
    bm_destroy(m);
}

/* ---- random stress with a shadow model of KV contents ---- */

#define S_SEQS 20
#define S_BLOCKS 48
#define S_BS 3
#define S_CAP 30 /* tokens per sequence; max_blocks = 10 */

static uint64_t rng_state = 0x853c49e6748fea9bULL;

static uint32_t rnd(uint32_t n)
{
    rng_state = rng_state * 6364136223846793005ULL + 1442695040888963407ULL;
    return (uint32_t)(rng_state >> 33) % n;
}

/* Fingerprint of a whole prefix t[0..p]: what the KV of position p depends on. */
static uint64_t fp_step(uint64_t prev, int32_t tok)
{
    uint64_t z = prev ^ ((uint64_t)(uint32_t)tok + 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return (z ^ (z >> 31)) | 1; /* never 0: 0 marks an unwritten slot */
}

typedef struct {
    uint64_t kv[S_BLOCKS][S_BS]; /* prefix fingerprint stored at each slot; 0 = unwritten */
} shadow;

static void prefix_fps(const pd_seq *s, int32_t n, uint64_t *fp)
{
    uint64_t h = 0;
    for (int32_t p = 0; p < n; p++) fp[p] = h = fp_step(h, s->tokens[p]);
}

/* Every live sequence's block references, counted independently of the block manager. */
static void check_refs(const bm *m, tseq *seqs, const bool *live)
{
    int32_t ref[S_BLOCKS] = {0}, used = 0;
    for (int32_t i = 0; i < S_SEQS; i++)
        if (live[i])
            for (int32_t j = 0; j < seqs[i].s.n_blocks; j++) ref[seqs[i].bt[j]]++;
    for (int32_t b = 0; b < S_BLOCKS; b++) {
        CHECK_MSG(bm_ref(m, b) == ref[b], "block %d ref %d, counted %d", b, bm_ref(m, b), ref[b]);
        used += ref[b] > 0;
    }
    CHECK_EQ_INT(bm_n_used(m), used);
    CHECK_EQ_INT(bm_n_free(m), S_BLOCKS - used);
}

static void test_stress(void)
{
    bm *m = make_bm(S_BLOCKS, S_BS, true);
    static tseq seqs[S_SEQS];
    static shadow sh;
    bool live[S_SEQS] = {false};
    uint64_t fp[T_CAP];
    int n_alloc = 0, n_hit_tokens = 0, n_nospc = 0, n_evict = 0;
    memset(&sh, 0, sizeof sh);
    for (int32_t i = 0; i < S_SEQS; i++) tseq_init(&seqs[i], NULL, 0, S_CAP / S_BS);

    for (int op = 0; op < 2000; op++) {
        int32_t i = (int32_t)rnd(S_SEQS);
        tseq *t = &seqs[i];
        pd_seq *s = &t->s;
        uint32_t kind = rnd(10);
        if (!live[i]) {
            /* Allocate a fresh prompt over a 2-letter alphabet, mostly sharing a start. */
            int32_t n = 1 + (int32_t)rnd(S_CAP - 4);
            int32_t toks[S_CAP];
            for (int32_t p = 0; p < n; p++) toks[p] = rnd(4) ? (p % 2) : (int32_t)rnd(2);
            tseq_init(t, toks, n, S_CAP / S_BS);
            s->skip_prefix_cache = rnd(16) == 0;
            int32_t reserve = n + (int32_t)rnd(6);
            if (reserve > S_CAP) reserve = S_CAP;
            int64_t cached_before = bm_n_cached_blocks(m);
            int32_t free_before = bm_n_free(m);
            int can = bm_can_allocate(m, s, reserve);
            int got = bm_allocate(m, s, reserve);
            CHECK_EQ_INT(can, got);
            if (got == PD_ENOSPC) {
                n_nospc++;
                CHECK_EQ_INT(s->n_blocks, 0);
                CHECK_EQ_INT(bm_n_free(m), free_before);
                CHECK_EQ_INT(bm_n_cached_blocks(m), cached_before);
            } else {
                CHECK(got >= 0);
                if (got < 0) break;
                n_alloc++;
                n_hit_tokens += got;
                live[i] = true;
                int32_t hits = got / S_BS;
                CHECK_EQ_INT(got % S_BS, 0);
                CHECK(got < n);
                if (s->skip_prefix_cache) CHECK_EQ_INT(got, 0);
                CHECK_EQ_INT(s->n_computed, got);
                CHECK_EQ_INT(s->n_cached, got);
                CHECK_EQ_INT(s->n_hashed, hits);
                CHECK(s->last_hash == ref_chain(s->tokens, hits, S_BS));
                CHECK_EQ_INT(s->n_blocks, (reserve + S_BS - 1) / S_BS);
                if (bm_n_cached_blocks(m) < cached_before) n_evict++;
                /* Every hit block really holds this prefix's KV. */
                prefix_fps(s, n, fp);
                for (int32_t p = 0; p < got; p++)
                    CHECK_MSG(sh.kv[s->block_table[p / S_BS]][p % S_BS] == fp[p],
                              "op %d: false hit at position %d", op, p);
                /* Fresh blocks are unwritten. */
                for (int32_t j = hits; j < s->n_blocks; j++) {
                    CHECK_EQ_INT(bm_ref(m, s->block_table[j]), 1);
                    for (int32_t k = 0; k < S_BS; k++) sh.kv[s->block_table[j]][k] = 0;
                }
            }
        } else if (kind < 4) {
            /* Compute some tokens (KV written into this sequence's own, unshared blocks),
             * registering full blocks, sometimes ahead of the write as the scheduler does. */
            int32_t room = s->n_tokens - s->n_computed;
            if (room <= 0) continue;
            int32_t k = 1 + (int32_t)rnd((uint32_t)room);
            int32_t ready = s->n_computed + k;
            bm_commit(m, s, ready);
            CHECK_EQ_INT(s->n_hashed, ready / S_BS < s->n_blocks ? ready / S_BS : s->n_blocks);
            CHECK(s->last_hash == ref_chain(s->tokens, s->n_hashed, S_BS));
            prefix_fps(s, ready, fp);
            for (int32_t p = s->n_computed; p < ready; p++) {
                int32_t b = s->block_table[p / S_BS];
                CHECK_MSG(bm_ref(m, b) == 1, "op %d: writing into shared block %d", op, b);
                sh.kv[b][p % S_BS] = fp[p];
            }
            s->n_computed = ready;
        } else if (kind < 7) {
            /* Decode-like growth: one new token, blocks for it. */
            if (s->n_tokens >= S_CAP || s->n_computed < s->n_tokens) continue;
            int32_t n_blocks = s->n_blocks, free_before = bm_n_free(m);
            bool can = bm_can_append(m, s, s->n_tokens + 1);
            int rc = bm_append(m, s, s->n_tokens + 1);
            CHECK_EQ_INT(rc, can ? 0 : PD_ENOSPC);
            if (rc == 0) {
                s->tokens[s->n_tokens++] = (int32_t)rnd(2);
                CHECK(s->n_blocks * S_BS >= s->n_tokens);
                for (int32_t j = n_blocks; j < s->n_blocks; j++) {
                    CHECK_EQ_INT(bm_ref(m, s->block_table[j]), 1);
                    for (int32_t k = 0; k < S_BS; k++) sh.kv[s->block_table[j]][k] = 0;
                }
            } else {
                CHECK_EQ_INT(s->n_blocks, n_blocks);
                CHECK_EQ_INT(bm_n_free(m), free_before);
            }
        } else {
            bm_free(m, s);
            CHECK_EQ_INT(s->n_blocks, 0);
            live[i] = false;
        }
        int rc = bm_check(m);
        CHECK_MSG(rc == 0, "op %d", op);
        if (rc) break;
        check_refs(m, seqs, live);
        if (rnd(400) == 0) bm_drop_cache(m);
    }
    for (int32_t i = 0; i < S_SEQS; i++) {
        if (live[i]) bm_free(m, &seqs[i].s);
        live[i] = false;
    }
    CHECK_BM(m);
    CHECK_EQ_INT(bm_n_free(m), S_BLOCKS);
    CHECK_EQ_INT(bm_n_used(m), 0);
    for (int32_t b = 0; b < S_BLOCKS; b++) CHECK_EQ_INT(bm_ref(m, b), 0);
    /* The run must have exercised the interesting paths. */
    CHECK_MSG(n_alloc > 100, "%d allocations", n_alloc);
    CHECK_MSG(n_hit_tokens > 100, "%d hit tokens", n_hit_tokens);
    CHECK_MSG(n_nospc > 0, "%d ENOSPC", n_nospc);
    CHECK_MSG(n_evict > 0, "%d evicting allocations", n_evict);
    fprintf(stderr, "stress: %d allocations, %d hit tokens, %d ENOSPC, %d evicting\n", n_alloc,
            n_hit_tokens, n_nospc, n_evict);
    bm_destroy(m);
}

int main(void)
{
    test_hash();
    test_create();
    test_alloc_free();
    test_prefix_cache();
    test_commit();
    test_lru();
    test_capacity_with_hits();
    test_append();
    test_drop_cache();
    test_stress();
    return pd_test_result("test_block_manager");
}
