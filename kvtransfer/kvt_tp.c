/* kvt_tp.c -- The KV head mapping of tensor-parallel instances (kvtransfer.h, "tensor
 * parallelism"): the KV heads each rank holds, and the gather / scatter between the ranks'
 * blocks and the whole-layout blocks that move on the wire. */
#include <string.h>

#include "common/error.h"
#include "kvtransfer/kvtransfer.h"

int kvt_tp_heads(int32_t n_kv_heads, int32_t n_ranks, int32_t rank, int32_t *head0,
                 int32_t *n_heads)
{
    if (n_kv_heads < 1 || n_ranks < 1 || n_ranks > KVT_TP_MAX || rank < 0 || rank >= n_ranks)
        return PD_EINVAL;
    if (n_ranks <= n_kv_heads) {
        if (n_kv_heads % n_ranks) return PD_EINVAL;
        *n_heads = n_kv_heads / n_ranks;
        *head0 = rank * *n_heads;
    } else {
        if (n_ranks % n_kv_heads) return PD_EINVAL;
        *n_heads = 1;
        *head0 = rank / (n_ranks / n_kv_heads);
    }
    return 0;
}

/* Moves blocks ids[0..n) between the ranks' regions and host (n whole-layout blocks). Gather
 * (out) reads each head from the first rank that holds it; scatter writes every rank, the
 * replicas too. */
static int tp_move(const kvt_layout *l, int32_t n_ranks, void *const *rank_region,
                   int32_t n_blocks, const int32_t *ids, int32_t n, void *host, bool out)
{
    if (!l || !rank_region || !ids || !host || n < 0 || n_blocks < 1 || l->block_size < 1 ||
        l->head_dim < 1 || pd_dtype_size(l->dtype) == 0)
        return PD_EINVAL;
    const int32_t H = l->n_kv_heads, T = l->block_size;
    const size_t head = (size_t)l->head_dim * pd_dtype_size(l->dtype);
    const size_t whole = kvt_layout_block_bytes(l);
    for (int32_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= n_blocks) return PD_EINVAL;
    for (int32_t r = 0; r < n_ranks; r++) {
        int32_t h0, nh;
        int rc = kvt_tp_heads(H, n_ranks, r, &h0, &nh);
        if (rc < 0) return rc;
        if (!rank_region[r]) return PD_EINVAL;
        if (out && n_ranks > H && r % (n_ranks / H)) continue; /* a replica: read the first */
        const size_t part = (size_t)nh * head, rblock = (size_t)T * part;
        for (int32_t i = 0; i < n; i++) {
            uint8_t *rb = (uint8_t *)rank_region[r] + (size_t)ids[i] * rblock;
            uint8_t *hb = (uint8_t *)host + (size_t)i * whole + (size_t)h0 * head;
            for (int32_t t = 0; t < T; t++) {
                if (out) memcpy(hb + (size_t)t * H * head, rb + (size_t)t * part, part);
                else memcpy(rb + (size_t)t * part, hb + (size_t)t * H * head, part);
            }
        }
    }
    return 0;
}

int kvt_tp_gather(const kvt_layout *l, int32_t n_ranks, const void *const *rank_region,
                  int32_t n_blocks, const int32_t *ids, int32_t n, void *host)
{
    return tp_move(l, n_ranks, (void *const *)rank_region, n_blocks, ids, n, host, true);
}

int kvt_tp_scatter(const kvt_layout *l, int32_t n_ranks, void *const *rank_region,
                   int32_t n_blocks, const int32_t *ids, int32_t n, const void *host)
{
    return tp_move(l, n_ranks, rank_region, n_blocks, ids, n, (void *)host, false);
}
