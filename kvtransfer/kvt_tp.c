/* kvt_tp.c -- The KV head mapping of tensor-parallel instances (kvtransfer.h, "tensor
 * parallelism"): the KV heads each rank holds, where they sit in its blocks and in a
 * whole-layout block, and the gather / scatter between the ranks' blocks and the whole-layout
 * blocks that move on the wire (the host reference of the backends' strided copies). */
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

int kvt_tp_part_of(const kvt_layout *l, int32_t n_ranks, int32_t rank, kvt_tp_part *out)
{
    if (!l || !out || l->block_size < 1 || l->head_dim < 1 || pd_dtype_size(l->dtype) == 0)
        return PD_EINVAL;
    int32_t h0, nh;
    int rc = kvt_tp_heads(l->n_kv_heads, n_ranks, rank, &h0, &nh);
    if (rc < 0) return rc;
    const size_t head = (size_t)l->head_dim * pd_dtype_size(l->dtype);
    *out = (kvt_tp_part){.head0 = h0, .n_heads = nh, .rows = (size_t)l->block_size,
                         .row_bytes = (size_t)nh * head,
                         .rank_block_bytes = (size_t)l->block_size * (size_t)nh * head,
                         .whole_block_bytes = kvt_layout_block_bytes(l),
                         .whole_pitch = (size_t)l->n_kv_heads * head,
                         .whole_offset = (size_t)h0 * head,
                         .gathered = n_ranks <= l->n_kv_heads ||
                                     rank % (n_ranks / l->n_kv_heads) == 0};
    return 0;
}

/* Moves blocks ids[0..n) between the ranks' regions and host (n whole-layout blocks). Gather
 * (out) reads each head from the first rank that holds it; scatter writes every rank, the
 * replicas too. */
static int tp_move(const kvt_layout *l, int32_t n_ranks, void *const *rank_region,
                   int32_t n_blocks, const int32_t *ids, int32_t n, void *host, bool out)
{
    if (!l || !rank_region || !ids || !host || n < 0 || n_blocks < 1 || n_ranks < 1)
        return PD_EINVAL;
    for (int32_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= n_blocks) return PD_EINVAL;
    for (int32_t r = 0; r < n_ranks; r++) {
        kvt_tp_part p;
        int rc = kvt_tp_part_of(l, n_ranks, r, &p);
        if (rc < 0) return rc;
        if (!rank_region[r]) return PD_EINVAL;
        if (out && !p.gathered) continue;
        for (int32_t i = 0; i < n; i++) {
            uint8_t *rb = (uint8_t *)rank_region[r] + (size_t)ids[i] * p.rank_block_bytes;
            uint8_t *hb = (uint8_t *)host + (size_t)i * p.whole_block_bytes + p.whole_offset;
            for (size_t t = 0; t < p.rows; t++) {
                if (out) memcpy(hb + t * p.whole_pitch, rb + t * p.row_bytes, p.row_bytes);
                else memcpy(rb + t * p.row_bytes, hb + t * p.whole_pitch, p.row_bytes);
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
