/* cuda_attention_prefill.cu -- Paged causal attention for prefill batches on the tensor cores,
 * flash-attention style. A block takes a tile of M = 16 x warps query rows of one sequence and
 * one KV head, a row being a (token, query head) pair: the G query heads of the GQA group of
 * M / G consecutive tokens, so each K/V tile is read once for all of them. It walks the keys in
 * tiles of KT, gathered through the block table into shared memory with cp.async (16-byte
 * copies, STAGES buffers: the next two tiles load while one is computed); each warp computes
 * its 16 rows' S = Q K^T and O += P V with bf16 mma.sync (m16n8k16, fp32 accumulation) and
 * keeps an online softmax in fp32 registers (base 2, the scale folded in). Masks are applied only
 * on the tiles that need them (the causal diagonal, the sliding window's edge); no score
 * matrix leaves the registers. Head sizes 64 and 128 and up to 8 query heads per KV head are
 * handled; everything else, and PDSERVE_CUDA_FLASH_PREFILL=0, stays with the general kernel
 * (cuda_attention.cu, which routes here). With an FP8 cache (the kernel's KV = pd_fp8) the
 * tiles arrive as e4m3 bytes (half the copies) and are converted into one bf16 K/V tile
 * (exact) before the same mma code reads it; the key scale is folded into the softmax scale,
 * the value scale into the final normalisation.
 *
 * On a device of compute capability 9.0 (an sm_90a build) the 128-row tiles of head_dim 128
 * take the wgmma kernel instead (WG, PDSERVE_CUDA_FLASH_WGMMA=0 turns it off): each warpgroup
 * computes its 64 rows' products with wgmma, K and V read from shared memory in 128-byte
 * swizzled regions (cuda_wgmma.cuh) instead of per-warp ldmatrix copies, and the products are
 * pipelined: tile j + 1's scores run on the tensor cores during tile j's softmax, tile j's
 * O += P V during tile j + 1's loads (five K/V tiles in shared memory). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <type_traits>

#include "kernels/cuda/cuda_kv_fp8.cuh"
#include "kernels/cuda/cuda_wgmma.cuh"

#define KT 64   /* keys per K/V tile */
#define MAX_G 8 /* query heads per KV head handled here */

/* Element offset of 16-byte chunk c of row r in a [rows][HD] shared tile. The chunk index is
 * XORed with the row's low 3 bits, so the 8 rows an ldmatrix reads at one column fall in 8
 * different bank groups (unswizzled, rows of 128 or 256 bytes would all hit the same one). */
template <int HD>
static __device__ __forceinline__ int swz(int r, int c)
{
    return r * HD + ((c ^ (r & 7)) << 3);
}

/* K/V tiles in shared memory: two load while one is computed. The wgmma kernel (WG) keeps
 * five: tile j + 1's scores and tile j's O += P V read theirs while tile j - 1's O += P V may
 * still run and tiles j + 2 / j + 3 load; with an FP8 cache it converts into three bf16 tiles
 * (tiles j - 1, j, j + 1), the mma.sync kernel into one. */
template <bool WG>
static constexpr __host__ __device__ int prefill_stages(void)
{
    return WG ? 5 : 3;
}

template <bool WG>
static constexpr __host__ __device__ int prefill_converted(void)
{
    return WG ? 3 : 1;
}

/* Where chunk c of K/V tile row r lands: mma.sync reads the tile as swz lays it out; wgmma
 * (WG) reads it in 128-byte swizzled regions of 64 columns (pd_wg_swz), the layout its
 * descriptors take for K (K-major) and for V (MN-major) alike. */
template <int HD, bool WG>
static __device__ __forceinline__ int kv_at(int r, int c)
{
    return WG ? pd_wg_swz<KT>(r, c) : swz<HD>(r, c);
}

/* Copies K/V tile j (keys kb .. kb + KT - 1) of one KV head into shared memory. Keys past
 * last (the tile's newest query position) are not read: they are masked anyway and may lie
 * past the context, where the block table holds no block. bf16 lands swizzled (swz), e4m3
 * bytes as they are ([KT][HD] bytes; convert_kv makes the bf16 tile of them). */
template <typename KV, int HD, int NT, bool WG>
static __device__ __forceinline__ void load_kv(KV *sk, KV *sv, const KV *k_cache,
                                               const KV *v_cache, const int32_t *table,
                                               int32_t block_size, int64_t kv_row,
                                               int64_t head_col, int32_t kb, int32_t last)
{
    constexpr int EPC = 16 / (int)sizeof(KV), CH = HD / EPC; /* elements a chunk, chunks a row */
#pragma unroll
    for (int i = 0; i < KT * CH / NT; i++) {
        const int id = (int)threadIdx.x + i * NT, r = id / CH, c = id % CH;
        const int32_t p = kb + r;
        const bool ok = p <= last;
        int64_t off = 0;
        if (ok)
            off = ((int64_t)table[p / block_size] * block_size + p % block_size) * kv_row +
                  head_col + c * EPC;
        const int at = sizeof(KV) == 1 ? r * HD + c * EPC : kv_at<HD, WG>(r, c);
        pd_cp16(sk + at, k_cache + off, ok);
        pd_cp16(sv + at, v_cache + off, ok);
    }
}

/* An FP8 cache's tile ([KT][HD] e4m3 bytes of K and of V) into the bf16 tiles the mma code
 * reads (swizzled as load_kv lays out bf16), by the whole block. */
template <int HD, int NT, bool WG>
static __device__ __forceinline__ void convert_kv(bf16 *dk, bf16 *dv, const pd_fp8 *sk,
                                                  const pd_fp8 *sv)
{
    constexpr int CH = HD / 16; /* 16-byte chunks of e4m3 a row */
#pragma unroll
    for (int i = 0; i < KT * CH / NT; i++) {
        const int id = (int)threadIdx.x + i * NT, r = id / CH, c = id % CH;
        const uint4 k = *reinterpret_cast<const uint4 *>(sk + r * HD + c * 16);
        const uint4 v = *reinterpret_cast<const uint4 *>(sv + r * HD + c * 16);
        *reinterpret_cast<uint4 *>(dk + kv_at<HD, WG>(r, 2 * c)) =
            pd_e4m3x8_to_bf16x8(make_uint2(k.x, k.y));
        *reinterpret_cast<uint4 *>(dk + kv_at<HD, WG>(r, 2 * c + 1)) =
            pd_e4m3x8_to_bf16x8(make_uint2(k.z, k.w));
        *reinterpret_cast<uint4 *>(dv + kv_at<HD, WG>(r, 2 * c)) =
            pd_e4m3x8_to_bf16x8(make_uint2(v.x, v.y));
        *reinterpret_cast<uint4 *>(dv + kv_at<HD, WG>(r, 2 * c + 1)) =
            pd_e4m3x8_to_bf16x8(make_uint2(v.z, v.w));
    }
}

/* Shared memory of a block: the Q tile, the K/V ring, and with an FP8 cache the bf16 K/V tiles
 * it is converted into; for wgmma (WG) 1 KiB more, to start the tiles at a 1024-byte boundary
 * (the swizzle's). */
template <typename KV, int HD, int NW, bool WG>
static constexpr size_t prefill_smem(void)
{
    return (size_t)NW * 16 * HD * sizeof(bf16) +
           (size_t)2 * prefill_stages<WG>() * KT * HD * sizeof(KV) +
           (sizeof(KV) == 1 ? (size_t)2 * prefill_converted<WG>() * KT * HD * sizeof(bf16) : 0) +
           (WG ? 1024 : 0);
}

/* Scale a tile's scores S (16 rows x KT keys a warp, the mma layout) to base 2, mask keys past
 * a row's position or before its window (only when masked: some row has such keys), and fold
 * them into the online softmax: m, l (this lane's share; the quad is summed at the end) and O
 * rescaled, S replaced by P. The four lanes of a quad share a row. A row that has seen no key
 * yet (max -inf) takes 0 as its base, so that its p are 0, not NaN. */
template <int HD>
static __device__ __forceinline__ void softmax_tile(float (&sc)[KT / 8][4], float (&o)[HD / 8][4],
                                                    float (&m)[2], float (&l)[2], bool masked,
                                                    int32_t kb, const int32_t (&pos)[2],
                                                    const int32_t (&wstart)[2], int qd,
                                                    float scale_log2)
{
#pragma unroll
    for (int n = 0; n < KT / 8; n++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            float v = sc[n][e] * scale_log2;
            if (masked) {
                const int32_t key = kb + n * 8 + qd * 2 + (e & 1);
                if (key > pos[e >> 1] || key < wstart[e >> 1]) v = -INFINITY;
            }
            sc[n][e] = v;
        }
    }
#pragma unroll
    for (int h = 0; h < 2; h++) {
        float mx = m[h];
#pragma unroll
        for (int n = 0; n < KT / 8; n++) mx = fmaxf(mx, fmaxf(sc[n][2 * h], sc[n][2 * h + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float base = mx == -INFINITY ? 0.0f : mx;
        const float corr = pd_exp2(m[h] - base); /* 0 while m is -inf */
        m[h] = mx;
        float sum = 0.0f;
#pragma unroll
        for (int n = 0; n < KT / 8; n++) {
            sc[n][2 * h] = pd_exp2(sc[n][2 * h] - base);
            sc[n][2 * h + 1] = pd_exp2(sc[n][2 * h + 1] - base);
            sum += sc[n][2 * h] + sc[n][2 * h + 1];
        }
        l[h] = l[h] * corr + sum;
#pragma unroll
        for (int n = 0; n < HD / 8; n++) {
            o[n][2 * h] *= corr;
            o[n][2 * h + 1] *= corr;
        }
    }
}

/* P (the S accumulators after softmax_tile) as bf16 A fragments of O += P V, 16 keys each. */
static __device__ __forceinline__ void p_frags(unsigned (&pa)[KT / 16][4],
                                               const float (&sc)[KT / 8][4])
{
#pragma unroll
    for (int kk = 0; kk < KT / 16; kk++) {
        pa[kk][0] = pd_pack_bf16(sc[2 * kk][0], sc[2 * kk][1]);
        pa[kk][1] = pd_pack_bf16(sc[2 * kk][2], sc[2 * kk][3]);
        pa[kk][2] = pd_pack_bf16(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
        pa[kk][3] = pd_pack_bf16(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
    }
}

/* wgmma: issues S = Q K^T for the warpgroup's 64 rows x KT keys (K read K-major, 16 columns =
 * 32 bytes a step; head_dim 128 = two 64-column regions) as one group. */
[[maybe_unused]] static __device__ __forceinline__ void
wg_scores(float (&sc)[KT / 8][4], const unsigned (&qf)[8][4], const bf16 *kt)
{
    pd_wg_fence();
#pragma unroll
    for (int kk = 0; kk < 8; kk++) /* the first step overwrites sc (scale_d 0) */
        pd_wgmma_n64<0>(sc, qf[kk], pd_wg_desc(kt + (kk >> 2) * KT * 64 + (kk & 3) * 16, 16, 1024),
                        kk);
    pd_wg_commit();
}

/* wgmma: issues O += P V (V read MN-major: 16 keys = rows a step, the head's two 64-column
 * regions LBO apart) as one group. The holds keep every write of the registers the products
 * use before the fence. */
[[maybe_unused]] static __device__ __forceinline__ void
wg_values(float (&o)[16][4], unsigned (&pa)[KT / 16][4], const bf16 *vt)
{
    pd_wg_hold_u(pa);
    pd_wg_hold(o);
    pd_wg_fence();
#pragma unroll
    for (int kk = 0; kk < KT / 16; kk++)
        pd_wgmma_n128<1>(o, pa[kk], pd_wg_desc(vt + kk * 16 * 64, KT * 64 * 2, 1024), 1);
    pd_wg_commit();
}

/* Grid (query tile, KV head). Tiles are numbered per sequence from cu_q[s] / TQ + s (TQ = M / G
 * tokens a tile), which leaves each sequence at least as many numbers as it has tiles; a block
 * whose number falls past its sequence's last tile exits. Blocks run in reverse: the last
 * tiles of a sequence see the most keys and should start first. WG (head_dim 128 only): the
 * products on wgmma, pipelined so that the tensor cores compute tile j + 1's scores during tile
 * j's softmax and tile j's O += P V during tile j + 1's loads and scores. */
template <typename KV, int HD, int NW, bool WG>
static __global__ void __launch_bounds__(NW * 32, 1)
flash_prefill_kernel(const bf16 *__restrict__ q, int64_t q_row_stride,
                     const KV *__restrict__ k_cache, const KV *__restrict__ v_cache,
                     bf16 *__restrict__ out, const int32_t *__restrict__ cu_q,
                     const int32_t *__restrict__ ctx_lens, const int32_t *__restrict__ block_tables,
                     int32_t n_seqs, int32_t max_blocks_per_seq, int32_t n_heads,
                     int32_t n_kv_heads, int32_t G, int32_t block_size, int32_t sliding_window,
                     float scale_log2, float v_scale)
{
#if __CUDA_ARCH__ >= 800
    static_assert(!WG || HD == 128, "the wgmma kernel takes head_dim 128");
    constexpr bool FP8 = sizeof(KV) == 1;
    constexpr int M = NW * 16, CH = HD / 8, NT = NW * 32;
    constexpr int STAGES = prefill_stages<WG>(), CONV = prefill_converted<WG>();
    extern __shared__ __align__(16) unsigned char smem_raw[];
    unsigned char *smem = smem_raw;
    if constexpr (WG) smem += (1024 - ((unsigned)__cvta_generic_to_shared(smem_raw) & 1023)) & 1023;
    bf16 *sq = reinterpret_cast<bf16 *>(smem); /* [M][HD]; later the output staging */
    KV *sk = reinterpret_cast<KV *>(sq + M * HD);  /* [STAGES][KT][HD] */
    KV *sv = sk + STAGES * KT * HD;                /* [STAGES][KT][HD] */
    bf16 *ck = reinterpret_cast<bf16 *>(sv + STAGES * KT * HD); /* FP8: [CONV][KT][HD] */
    bf16 *cv = ck + CONV * KT * HD;                             /* FP8: [CONV][KT][HD] */
    (void)ck;
    (void)cv;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int kvh = blockIdx.y;
    const int32_t tile = (int32_t)(gridDim.x - 1 - blockIdx.x);
    const int32_t tq = M / G;

    /* The tile's sequence: the last s whose first tile number is <= tile. */
    int32_t lo = 0, hi = n_seqs - 1;
    while (lo < hi) {
        const int32_t mid = (lo + hi + 1) >> 1;
        if (cu_q[mid] / tq + mid <= tile) lo = mid;
        else hi = mid - 1;
    }
    const int32_t s = lo, q0 = cu_q[s], q_len = cu_q[s + 1] - q0;
    const int32_t t0 = (tile - (q0 / tq + s)) * tq;
    /* the whole block, before any barrier: past the sequence's rows, or before the batch's
     * first (a mixed batch's decode rows, which the decode kernel takes) */
    if (t0 < 0 || t0 >= q_len) return;
    const int32_t n_tok = min(tq, q_len - t0), n_rows = n_tok * G;
    const int32_t pos_lo = ctx_lens[s] - q_len + t0, pos_hi = pos_lo + n_tok - 1;
    const int32_t kstart = sliding_window > 0 ? max(0, pos_lo - sliding_window + 1) : 0;
    const int32_t start_hi = sliding_window > 0 ? max(0, pos_hi - sliding_window + 1) : 0;
    const int32_t n_tiles = (pos_hi - kstart) / KT + 1;
    const int32_t *table = block_tables + (size_t)s * max_blocks_per_seq;
    const int64_t kv_row = (int64_t)n_kv_heads * HD, head_col = (int64_t)kvh * HD;

    /* Q rows (token t0 + r / G, head kvh * G + r % G); rows past the tile's tokens read zeros. */
#pragma unroll
    for (int i = 0; i < M * CH / NT; i++) {
        const int id = tid + i * NT, r = id / CH, c = id % CH;
        const bool ok = r < n_rows;
        const bf16 *src = q;
        if (ok)
            src = q + (size_t)(q0 + t0 + r / G) * q_row_stride +
                  (size_t)(kvh * G + r % G) * HD + c * 8;
        pd_cp16(sq + swz<HD>(r, c), src, ok);
    }
    load_kv<KV, HD, NT, WG>(sk, sv, k_cache, v_cache, table, block_size, kv_row, head_col, kstart,
                        pos_hi);
    pd_cp_commit();
    if (n_tiles > 1)
        load_kv<KV, HD, NT, WG>(sk + KT * HD, sv + KT * HD, k_cache, v_cache, table, block_size,
                            kv_row, head_col, kstart + KT, pos_hi);
    pd_cp_commit(); /* one group per tile, empty or not: the wait below counts groups */

    /* This thread's two rows in the mma layout: g and g + 8 of the warp's 16. Padding rows
     * take the last token's position (their Q is zero; they are never stored). */
    const int g = lane >> 2, qd = lane & 3;
    int32_t pos[2], wstart[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int r = warp * 16 + g + 8 * h;
        pos[h] = pos_lo + min(r / G, n_tok - 1);
        wstart[h] = sliding_window > 0 ? max(0, pos[h] - sliding_window + 1) : 0;
    }

    unsigned qf[HD / 16][4];
    float o[HD / 8][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
#pragma unroll
    for (int n = 0; n < HD / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;

    if constexpr (WG) {
        float sc[KT / 8][4] = {}, sn[KT / 8][4] = {}; /* tile j's scores, tile j + 1's */
        unsigned pa[KT / 16][4];
        /* Q and tile 0 have landed; tile 2's copies start; tile 0's scores */
        pd_cp_wait<1>();
        pd_fence_proxy_async(); /* the copies, to the products' proxy */
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < HD / 16; kk++)
            pd_ldsm4(qf[kk], sq + swz<HD>(warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8,
                                          2 * kk + (lane >> 4)));
        if (n_tiles > 2)
            load_kv<KV, HD, NT, WG>(sk + 2 * KT * HD, sv + 2 * KT * HD, k_cache, v_cache, table,
                                    block_size, kv_row, head_col, kstart + 2 * KT, pos_hi);
        pd_cp_commit();
        if constexpr (FP8) {
            convert_kv<HD, NT, WG>(ck, cv, sk, sv);
            pd_fence_proxy_async();
            __syncthreads();
            wg_scores(sc, qf, ck);
        } else {
            wg_scores(sc, qf, sk);
        }
        pd_wg_wait<0>();
        pd_wg_hold(sc);
        /* Tile j with its scores in cur, tile j + 1's computed into nxt: two calls a round
         * with the arrays swapped, so that no register of the scores in flight is read (a copy
         * would let the allocator merge the two and serialize the products). */
        auto step = [&](auto more_c, int32_t j, float (&cur)[KT / 8][4],
                        float (&nxt)[KT / 8][4]) {
            constexpr bool more = decltype(more_c)::value; /* j + 1 < n_tiles */
            if constexpr (more) {
                /* Tile j + 1 has landed, and every thread is past tile j - 1's waits: tile
                 * j - 2's O += P V is complete, its buffer takes tile j + 3 (and, FP8, its
                 * converted tiles tile j + 1's). */
                pd_cp_wait<1>();
                pd_fence_proxy_async();
                __syncthreads();
                if (j + 3 < n_tiles) {
                    const int nb = (j + 3) % STAGES;
                    load_kv<KV, HD, NT, WG>(sk + nb * KT * HD, sv + nb * KT * HD, k_cache,
                                            v_cache, table, block_size, kv_row, head_col,
                                            kstart + (j + 3) * KT, pos_hi);
                }
                pd_cp_commit();
                const int b1 = (j + 1) % STAGES;
                if constexpr (FP8) {
                    const int c1 = (j + 1) % CONV;
                    convert_kv<HD, NT, WG>(ck + c1 * KT * HD, cv + c1 * KT * HD, sk + b1 * KT * HD,
                                           sv + b1 * KT * HD);
                    pd_fence_proxy_async();
                    __syncthreads();
                    wg_scores(nxt, qf, ck + c1 * KT * HD);
                } else {
                    wg_scores(nxt, qf, sk + b1 * KT * HD);
                }
                pd_wg_wait<1>(); /* tile j - 1's O += P V; tile j + 1's scores run on */
            } else {
                pd_wg_wait<0>();
            }
            pd_wg_hold(o);
            const int32_t kb = kstart + j * KT;
            softmax_tile<HD>(cur, o, m, l, kb + KT - 1 > pos_lo || kb < start_hi, kb, pos,
                             wstart, qd, scale_log2);
            p_frags(pa, cur);
            if constexpr (FP8) wg_values(o, pa, cv + (j % CONV) * KT * HD);
            else wg_values(o, pa, sv + (j % STAGES) * KT * HD);
            if constexpr (more) {
                pd_wg_wait<1>(); /* tile j + 1's scores; this tile's O += P V runs on */
                pd_wg_hold(nxt);
            }
        };
        /* the last tile apart: a wgmma issued on one path only would merge its accumulators
         * with the other path's registers (a copy while it runs: serialized products) */
        const std::true_type on;
        const std::false_type last;
        int32_t j = 0;
        for (; j + 2 < n_tiles; j += 2) {
            step(on, j, sc, sn);
            step(on, j + 1, sn, sc);
        }
        if (j + 1 < n_tiles) {
            step(on, j, sc, sn);
            step(last, j + 1, sn, sc);
        } else {
            step(last, j, sc, sn);
        }
        pd_wg_wait<0>();
        pd_wg_hold(o);
    } else {
        for (int32_t j = 0; j < n_tiles; j++) {
            /* Tile j has landed (only tile j + 1 may still be in flight), and every warp is
             * done with tile j - 1, whose buffer the copy of tile j + 2 overwrites. */
            pd_cp_wait<1>();
            __syncthreads();
            if (j == 0) {
#pragma unroll
                for (int kk = 0; kk < HD / 16; kk++)
                    pd_ldsm4(qf[kk], sq + swz<HD>(warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8,
                                                  2 * kk + (lane >> 4)));
            }
            const int32_t kb = kstart + j * KT;
            if (j + 2 < n_tiles) {
                const int nb = (j + 2) % STAGES;
                load_kv<KV, HD, NT, WG>(sk + nb * KT * HD, sv + nb * KT * HD, k_cache, v_cache,
                                        table, block_size, kv_row, head_col, kb + 2 * KT, pos_hi);
            }
            pd_cp_commit();
            const int cb = j % STAGES;
            const bf16 *kt, *vt;
            if constexpr (FP8) {
                /* every warp is past tile j - 1's bf16 tiles (the barrier above) */
                convert_kv<HD, NT, WG>(ck, cv, sk + cb * KT * HD, sv + cb * KT * HD);
                __syncthreads();
                kt = ck;
                vt = cv;
            } else {
                kt = sk + cb * KT * HD;
                vt = sv + cb * KT * HD;
            }

            /* S = Q K^T: 16 rows x KT keys per warp. */
            float sc[KT / 8][4];
#pragma unroll
            for (int n = 0; n < KT / 8; n++) sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < HD / 16; kk++) {
#pragma unroll
                for (int nn = 0; nn < KT / 16; nn++) {
                    unsigned b[4];
                    pd_ldsm4(b, kt + swz<HD>(nn * 16 + (lane & 7) + (lane >> 4) * 8,
                                             2 * kk + ((lane >> 3) & 1)));
                    pd_mma16816(sc[2 * nn], qf[kk], b[0], b[1]);
                    pd_mma16816(sc[2 * nn + 1], qf[kk], b[2], b[3]);
                }
            }
            softmax_tile<HD>(sc, o, m, l, kb + KT - 1 > pos_lo || kb < start_hi, kb, pos, wstart,
                             qd, scale_log2);

            /* O += P V: P goes from the S accumulators straight into A fragments. */
            unsigned pa[KT / 16][4];
            p_frags(pa, sc);
#pragma unroll
            for (int kk = 0; kk < KT / 16; kk++) {
#pragma unroll
                for (int dn = 0; dn < HD / 16; dn++) {
                    unsigned b[4];
                    pd_ldsm4t(b, vt + swz<HD>(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8,
                                              2 * dn + (lane >> 4)));
                    pd_mma16816(o[2 * dn], pa[kk], b[0], b[1]);
                    pd_mma16816(o[2 * dn + 1], pa[kk], b[2], b[3]);
                }
            }
        }
    }

    /* Normalise, stage the warp's 16 rows in its own rows of sq (only this warp read them),
     * then write them out in 16-byte pieces. Every row has seen its own key: l > 0. */
    __syncwarp();
#pragma unroll
    for (int h = 0; h < 2; h++) {
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
        const float inv = FP8 ? v_scale / l[h] : 1.0f / l[h];
        const int r = warp * 16 + g + 8 * h;
#pragma unroll
        for (int n = 0; n < HD / 8; n++)
            *reinterpret_cast<unsigned *>(sq + swz<HD>(r, n) + qd * 2) =
                pd_pack_bf16(o[n][2 * h] * inv, o[n][2 * h + 1] * inv);
    }
    __syncwarp();
    const int64_t out_row = (int64_t)n_heads * HD;
#pragma unroll
    for (int i = 0; i < 16 * CH / 32; i++) {
        const int id = lane + i * 32, r = warp * 16 + id / CH, c = id % CH;
        if (r < n_rows) {
            bf16 *dst = out + (size_t)(q0 + t0 + r / G) * out_row +
                        (size_t)(kvh * G + r % G) * HD + c * 8;
            *reinterpret_cast<uint4 *>(dst) = *reinterpret_cast<const uint4 *>(sq + swz<HD>(r, c));
        }
    }
#endif
}

template <typename KV, int HD, int NW, bool WG>
static cudaError_t launch_hw(const pd_attn_args *a, cudaStream_t stream)
{
    constexpr int M = NW * 16;
    constexpr bool FP8 = sizeof(KV) == 1;
    /* 128 KiB at most (head_dim 128, 8 warps); 112 KiB with 4 warps, two blocks an SM. FP8:
     * 112 and 96 KiB. */
    constexpr size_t smem = prefill_smem<KV, HD, NW, WG>();
    const int32_t G = a->n_heads / a->n_kv_heads;
    const unsigned n_tiles = (unsigned)(a->n_tokens / (M / G) + a->n_seqs);
    /* Above 48 KiB a kernel's dynamic shared memory must be allowed explicitly (per device,
     * hence on every launch: it costs about as much as the launch's own checks). */
    cudaError_t e = cudaFuncSetAttribute(flash_prefill_kernel<KV, HD, NW, WG>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return e;
    const dim3 grid(n_tiles, (unsigned)a->n_kv_heads);
    const float scale_log2 = a->scale * 1.4426950408889634f; /* a bf16 cache's scales unread */
    flash_prefill_kernel<KV, HD, NW, WG><<<grid, NW * 32, smem, stream>>>(
        (const bf16 *)a->q, a->q_row_stride, (const KV *)a->k_cache, (const KV *)a->v_cache,
        (bf16 *)a->out, a->cu_q, a->ctx_lens, a->block_tables, a->n_seqs, a->max_blocks_per_seq,
        a->n_heads, a->n_kv_heads, G, a->block_size, a->sliding_window,
        FP8 ? scale_log2 * a->k_scale : scale_log2, FP8 ? a->v_scale : 1.0f);
    return cudaGetLastError();
}

/* tall: 8 warps (128 rows a tile), else 4. head_dim is 64 or 128; wg (tall, head_dim 128, a
 * device of compute capability 9.0 and an sm_90a build): the products on wgmma, else mma.sync. */
template <typename KV>
static cudaError_t launch_flash(const pd_attn_args *a, bool tall, bool wg, cudaStream_t stream)
{
#if defined(PD_CUDA_SM90A)
    if (wg) return launch_hw<KV, 128, 8, true>(a, stream);
#else
    (void)wg;
#endif
    if (a->head_dim == 64)
        return tall ? launch_hw<KV, 64, 8, false>(a, stream)
                    : launch_hw<KV, 64, 4, false>(a, stream);
    return tall ? launch_hw<KV, 128, 8, false>(a, stream)
                : launch_hw<KV, 128, 4, false>(a, stream);
}

/* Whether the tensor-core kernel is on: PDSERVE_CUDA_FLASH_PREFILL=0 (or false, no) turns it
 * off for A/B runs. Read once per process (a function-local static: initialised thread-safely). */
static bool flash_enabled(void)
{
    static const bool on = pd_env_bool("PDSERVE_CUDA_FLASH_PREFILL");
    return on;
}

/* Whether a device of compute capability major.minor takes the wgmma kernels: exactly 9.0
 * (sm_90a code runs nowhere else), an sm_90a build, PDSERVE_CUDA_FLASH_WGMMA not 0. */
static bool wgmma_on(int major, int minor)
{
#if defined(PD_CUDA_SM90A)
    static const bool on = pd_env_bool("PDSERVE_CUDA_FLASH_WGMMA");
    return on && major == 9 && minor == 0;
#else
    (void)major;
    (void)minor;
    return false;
#endif
}

/* Runs a prefill batch on the tensor-core kernel when it fits: head_dim 64 or 128, at most
 * MAX_G query heads per KV head, 16-byte aligned q, caches and output with q rows a whole
 * number of 16-byte chunks apart, compute capability 8.0 or later, the switch on. Called by
 * pd_cuda__attention once it has validated the arguments. Returns 0 when launched, 1 when the
 * batch is not one it takes (the caller runs the general kernel), PD_EBACKEND. KV: the cache's
 * element type (bf16; pd_fp8 for pd_cuda__attention_fp8, which validated the scales). */
template <typename KV>
static int attention_prefill(void *ctx, const pd_attn_args *a)
{
    pd_cuda_ctx *c = pd_cuda__ctx(ctx);
    const int32_t hd = a->head_dim, G = a->n_heads / a->n_kv_heads;
    const uintptr_t addr_bits = (uintptr_t)a->q | (uintptr_t)a->k_cache |
                                (uintptr_t)a->v_cache | (uintptr_t)a->out;
    if (!flash_enabled() || (hd != 64 && hd != 128) || G > MAX_G || (addr_bits & 15) != 0 ||
        a->q_row_stride % 8 != 0 || a->n_kv_heads > 65535 ||
        (int64_t)a->n_tokens + (int64_t)a->n_seqs * 8 > INT32_MAX || c->cc_major < 8)
        return 1;

    /* Tile height: 128 rows (8 warps) when the grid has enough such blocks to spread over the
     * SMs (causal tiles differ in work: a few blocks per SM even it out) and the sequences are
     * long enough to fill them; else 64 rows (4 warps), twice the blocks, half the longest one.
     * The wgmma kernel is 128 rows (two warpgroups) and wins from one block per SM; below that
     * the 4-warp mma.sync kernel is faster than it (docs/perf-history.md, "Prefill attention on
     * wgmma"). */
    const int64_t blocks128 =
        ((int64_t)a->n_tokens * G / 128 + a->n_seqs) * (int64_t)a->n_kv_heads;
    const bool wgmma = hd == 128 && wgmma_on(c->cc_major, c->cc_minor);
    static const int64_t rows = pd_env_int("PDSERVE_CUDA_FLASH_ROWS"); /* A/B: 64, 128 */
    const bool tall = rows == 128 || (rows != 64 && (int64_t)a->max_q_len * G > 64 &&
                                      blocks128 >= (wgmma ? 1 : 4) * (int64_t)c->sm_count);
    PD_CUDA_CHECK(launch_flash<KV>(a, tall, wgmma && tall, c->stream));
    return 0;
}

extern "C" int pd_cuda__attention_prefill(void *ctx, const pd_attn_args *a)
{
    return attention_prefill<bf16>(ctx, a);
}

extern "C" int pd_cuda__attention_prefill_fp8(void *ctx, const pd_attn_args *a)
{
    return attention_prefill<pd_fp8>(ctx, a);
}
