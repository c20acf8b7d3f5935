/* test_kv_copy.c -- The backend's raw KV block copy (kv_blocks_copy) between a KV cache region
 * and a host mirror indexed by the same block ids, the host pinning ops and the copy of blocks
 * within the pool (kv_blocks_clone), on the CPU backend (the CUDA one: tests/test_cuda_backend.c). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "kernels/backend.h"
#include "test_util.h"

static void fill_pattern(uint8_t *p, size_t n, uint32_t seed)
{
    for (size_t i = 0; i < n; i++) {
        seed = seed * 1664525u + 1013904223u;
        p[i] = (uint8_t)(seed >> 24);
    }
}

static void test_roundtrip(pd_backend *be)
{
    const pd_backend_ops *o = be->ops;
    CHECK(o->kv_blocks_copy != NULL);
    CHECK(o->host_register != NULL && o->host_unregister != NULL);
    if (!o->kv_blocks_copy || !o->host_register || !o->host_unregister) return;
    enum { NB = 12, BLOCK_ELEMS = 20, N = 5 };
    const size_t bb = BLOCK_ELEMS * sizeof(float), total = (size_t)NB * bb;
    void *cache = NULL;
    CHECK_EQ_INT(o->alloc(be->ctx, PD_DTYPE_F32, (size_t)NB * BLOCK_ELEMS, &cache), 0);
    if (!cache) return;
    uint8_t *init = malloc(total), *host = malloc(total), *want = malloc(total);
    fill_pattern(init, total, 7);
    memcpy(cache, init, total); /* CPU backend memory is host memory */
    memset(host, 0xAB, total);
    CHECK_EQ_INT(o->host_register(be->ctx, host, total), 0);
    /* cache -> mirror: a run of consecutive ids, unordered ones, the last block */
    const int32_t ids[N] = {3, 4, 5, 0, 11};
    CHECK_EQ_INT(o->kv_blocks_copy(be->ctx, cache, ids, N, bb, host, true), 0);
    memset(want, 0xAB, total);
    for (int i = 0; i < N; i++) memcpy(want + (size_t)ids[i] * bb, init + (size_t)ids[i] * bb, bb);
    CHECK_MSG(memcmp(host, want, total) == 0, "to_host: wrong bytes, or other blocks written");
    /* mirror -> cache: new content in some mirror blocks; only those blocks change */
    fill_pattern(host + 7 * bb, bb, 99);
    fill_pattern(host + 8 * bb, bb, 98);
    fill_pattern(host + 2 * bb, bb, 97);
    const int32_t back[3] = {7, 8, 2};
    CHECK_EQ_INT(o->kv_blocks_copy(be->ctx, cache, back, 3, bb, host, false), 0);
    memcpy(want, init, total);
    for (int i = 0; i < 3; i++) memcpy(want + (size_t)back[i] * bb, host + (size_t)back[i] * bb, bb);
    CHECK_MSG(memcmp(cache, want, total) == 0, "from_host: wrong bytes, or other blocks written");
    /* nothing to copy; bad arguments */
    CHECK_EQ_INT(o->kv_blocks_copy(be->ctx, cache, NULL, 0, bb, host, true), 0);
    const int32_t neg[1] = {-1};
    CHECK_EQ_INT(o->kv_blocks_copy(be->ctx, cache, neg, 1, bb, host, true), PD_EINVAL);
    CHECK_EQ_INT(o->kv_blocks_copy(be->ctx, cache, ids, N, 0, host, true), PD_EINVAL);
    CHECK_EQ_INT(o->kv_blocks_copy(be->ctx, cache, ids, -1, bb, host, true), PD_EINVAL);
    CHECK_EQ_INT(o->kv_blocks_copy(be->ctx, cache, ids, N, bb, NULL, false), PD_EINVAL);
    /* the mirror may be the cache itself (nothing moves) */
    memcpy(want, cache, total);
    CHECK_EQ_INT(o->kv_blocks_copy(be->ctx, cache, ids, N, bb, cache, true), 0);
    CHECK(memcmp(cache, want, total) == 0);
    CHECK_EQ_INT(o->host_unregister(be->ctx, host), 0);
    o->free(be->ctx, cache);
    free(init);
    free(host);
    free(want);
}

/* kv_blocks_clone: block src[i] over dst[i] in every region, nothing else touched; bad ids. */
static void test_clone(pd_backend *be)
{
    const pd_backend_ops *o = be->ops;
    CHECK(o->kv_blocks_clone != NULL);
    if (!o->kv_blocks_clone) return;
    enum { NB = 10, NR = 4, BB = 24 };
    const size_t region = (size_t)NB * BB, total = region * NR;
    uint8_t *pool = malloc(total), *want = malloc(total);
    fill_pattern(pool, total, 5);
    memcpy(want, pool, total);
    const int32_t src[3] = {2, 2, 7}, dst[3] = {5, 9, 0};
    for (int r = 0; r < NR; r++)
        for (int i = 0; i < 3; i++)
            memcpy(want + r * region + (size_t)dst[i] * BB, pool + r * region + (size_t)src[i] * BB, BB);
    CHECK_EQ_INT(o->kv_blocks_clone(be->ctx, pool, region, NR, src, dst, 3, BB), 0);
    CHECK_MSG(memcmp(pool, want, total) == 0, "clone: wrong bytes, or other blocks written");
    CHECK_EQ_INT(o->kv_blocks_clone(be->ctx, pool, region, NR, src, dst, 0, BB), 0);
    const int32_t self[1] = {2}, big[1] = {NB}, neg[1] = {-1};
    CHECK_EQ_INT(o->kv_blocks_clone(be->ctx, pool, region, NR, src, self, 1, BB), PD_EINVAL);
    CHECK_EQ_INT(o->kv_blocks_clone(be->ctx, pool, region, NR, src, big, 1, BB), PD_EINVAL);
    CHECK_EQ_INT(o->kv_blocks_clone(be->ctx, pool, region, NR, neg, dst, 1, BB), PD_EINVAL);
    CHECK_EQ_INT(o->kv_blocks_clone(be->ctx, pool, region, NR, src, dst, 1, 0), PD_EINVAL);
    CHECK(memcmp(pool, want, total) == 0);
    free(pool);
    free(want);
}

int main(void)
{
    char err[PD_ERR_LEN] = "";
    pd_backend *be = NULL;
    if (pd_backend_create("cpu", NULL, &be, err) != 0) {
        fprintf(stderr, "cannot create the cpu backend: %s\n", err);
        return 1;
    }
    test_roundtrip(be);
    test_clone(be);
    pd_backend_destroy(be);
    return pd_test_result("test_kv_copy");
}
