/* cuda_moe.cu -- The CUDA backend's mixture-of-experts ops (backend.h's moe_route, moe_combine
 * and moe_experts):
 *   - the routing of each token row on the device: the softmax in double and the top k, equal
 *     to kernels/moe_select.h's choice (the CPU backend's definition): the plain top k when
 *     the k + 1 largest probabilities are distinct, else that file's replay of torch's
 *     selection, its partitions made by the whole warp;
 *   - the choices' grouping by expert, on the device (a counting sort, rows ascending within
 *     an expert), with the groups' bounds copied to the host only when the caller asks;
 *   - the experts' MLPs over the groups in two launches, all experts at once, the groups
 *     read from device memory: a row-streaming kernel that reads each chosen expert's
 *     weights once for up to GV_R of its rows (decode), or grouped GEMMs on wgmma (prefill);
 *   - the weighted sum of the experts' outputs back into token order. */
#include <stdlib.h>

#include <atomic>

#include "common/env.h"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_moe.cuh"
#include "kernels/cuda/cuda_wgmma.cuh"
#include "kernels/moe_select.h"

#define ROUTE_THREADS 32

/* ---- moe_select.h's replay, with its partitions made by the whole warp ----
 * __unguarded_partition(c, a, b, pivot c[pv]) stops its left scan at the elements not before
 * the pivot and its right scan at those the pivot is not before. Before the pointers cross,
 * each scan only meets elements as they were (a swap puts the element it moves behind the
 * other scan), so iteration i swaps L[i], the i-th left stopper of the original range from
 * the left, with R[i], the i-th right stopper from the right, for every i < m, m the first i
 * with L[i] >= R[i]; it returns L[0] when m is 0, else min(L[m], R[m - 1]) (the left scan
 * then meets the element the last swap put at R[m - 1]). So the stoppers are ranked with
 * ballots, the m disjoint swaps made at once, and the result is pd_moe_partition's, swap for
 * swap. Lp, Rp: shared scratch of b - a positions each. Every lane calls it. */
static __device__ int32_t warp_partition(pd_moe_cand *c, int32_t a, int32_t b, int32_t pv,
                                         int32_t *Lp, int32_t *Rp)
{
    const int lane = (int)threadIdx.x % 32;
    const unsigned below = (1u << lane) - 1u;
    const pd_moe_cand P = c[pv];
    int32_t nL = 0, nR = 0;
    for (int32_t o = 0; o < b - a; o += 32) {
        const int32_t i = o + lane;
        const bool in = i < b - a;
        const bool sl = in && !pd_moe_before(&c[a + i], &P);     /* left stopper at a + i */
        const bool sr = in && !pd_moe_before(&P, &c[b - 1 - i]); /* right stopper at b-1-i */
        const unsigned ml = __ballot_sync(0xffffffffu, sl), mr = __ballot_sync(0xffffffffu, sr);
        if (sl) Lp[nL + __popc(ml & below)] = a + i;
        if (sr) Rp[nR + __popc(mr & below)] = b - 1 - i;
        nL += __popc(ml);
        nR += __popc(mr);
    }
    __syncwarp();
    const int32_t np = min(nL, nR);
    int32_t m = np;
    for (int32_t o = 0; o < np; o += 32) {
        const int32_t i = o + lane;
        const unsigned stop = __ballot_sync(0xffffffffu, i < np && Lp[i] >= Rp[i]);
        if (stop) {
            m = o + __ffs(stop) - 1;
            break;
        }
    }
    int32_t cut;
    if (m == 0) cut = Lp[0];
    else cut = m < nL ? min(Lp[m], Rp[m - 1]) : Rp[m - 1];
    __syncwarp();
    for (int32_t i = lane; i < m; i += 32) pd_moe_swap(c, Lp[i], Rp[i]);
    __syncwarp();
    return cut;
}

/* pd_moe_route_pick on the nth_element path (k * 64 > E, k < 32), the partitions by the warp
 * (warp_partition), the pivots and the last few elements on lane 0, then the sort of the first
 * k - 1 by the warp: libstdc++'s insertion sort is stable and pd_moe_before a strict weak
 * order, so each element's place is the number before it in that order plus the equal ones
 * ahead of it. The choices also into picks (shared) for the grouping. Every lane calls it. */
static __device__ void warp_route_pick(pd_moe_cand *c, int32_t E, int32_t k, bool renorm,
                                       int32_t *ids, float *w, int32_t *Lp, int32_t *Rp,
                                       int32_t *picks)
{
    const int lane = (int)threadIdx.x % 32;
    const int32_t nth = k - 1;
    int32_t f = 0, l = E, depth = 2 * pd_moe_floor_log2(E);
    bool done = false;
    while (l - f > 3) {
        if (depth == 0) {
            if (lane == 0) {
                pd_moe_heap_select(c + f, nth + 1 - f, l - f);
                pd_moe_swap(c, f, nth);
            }
            done = true;
            break;
        }
        depth--;
        if (lane == 0) pd_moe_median_to_first(c, f, f + 1, f + (l - f) / 2, l - 1);
        __syncwarp();
        const int32_t cut = warp_partition(c, f + 1, l, f, Lp, Rp);
        if (cut <= nth) f = cut;
        else l = cut;
    }
    if (lane == 0 && !done) pd_moe_insertion_sort(c, f, l);
    __syncwarp();
    pd_moe_cand mine = {0.0, 0};
    int32_t rank = 0;
    if (lane < k - 1) {
        mine = c[lane];
        for (int32_t i = 0; i < k - 1; i++) {
            const pd_moe_cand o = c[i];
            rank += i != lane &&
                    (pd_moe_before(&o, &mine) || (i < lane && !pd_moe_before(&mine, &o)));
        }
    }
    __syncwarp();
    if (lane < k - 1) c[rank] = mine;
    __syncwarp();
    double top = 0;
    for (int32_t j = 0; j < k; j++) top += c[j].p; /* (in the choice's order) */
    if (lane < k) {
        const pd_moe_cand x = c[lane];
        ids[lane] = x.e;
        w[lane] = (float)(renorm ? x.p / top : x.p);
        picks[lane] = x.e;
    }
    __syncwarp();
}

/* One row's k choices grouped by expert (pd_moe_group's result for n = 1: each expert chosen
 * at most once), by the warp: offsets[e] = the choices of experts below e, each choice at its
 * expert's rank among the k. ids: the choices, in shared or global memory the warp wrote
 * before a __syncwarp. */
static __device__ void group_one_row(const int32_t *ids, int32_t k, int32_t E, int32_t *off,
                                     int32_t *rows, int32_t *pos)
{
    const int lane = (int)threadIdx.x % 32;
    for (int32_t e = lane; e <= E; e += 32) {
        int32_t below = 0;
        for (int32_t j = 0; j < k; j++) below += ids[j] < e;
        off[e] = below;
    }
    for (int32_t j = lane; j < k; j += 32) {
        int32_t below = 0;
        for (int32_t i = 0; i < k; i++) below += ids[i] < ids[j];
        pos[j] = below;
        rows[below] = 0;
    }
}

#define ROUTE_RK_MAX 16 /* logits a lane holds at most: the register path's E <= 512 */

static __device__ __forceinline__ unsigned warp_max_u32(unsigned v)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    return __reduce_max_sync(0xffffffffu, v);
#else
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
#endif
}

/* A logit's selection key: its bf16 bits mapped to an unsigned order (larger logit, larger
 * key), the expert's complement below them (the lower expert first among equal bits). Any
 * order would do for correctness: the choice is checked on the probabilities after. */
static __device__ __forceinline__ unsigned route_key(unsigned short bits, int32_t e)
{
    const unsigned u = (bits & 0x8000u) ? (~(unsigned)bits & 0xFFFFu) : (bits | 0x8000u);
    return u << 16 | (0xFFFFu - (unsigned)e);
}

/* A block (one warp) a row: the E logits in registers, RK a lane (E <= 32 RK).
 *   1. The k largest by their keys (route_key): k rounds of a warp max, no memory.
 *   2. The softmax as the reference computes it: exp(logit - max) in double, each lane its
 *      own, the sum in expert order (every lane the same sequential sum from shared memory,
 *      so that the probabilities are the reference's bits), each divided by it.
 *   3. The choice checked on those probabilities: the k picks strictly decreasing and every
 *      other expert strictly below the k-th. Then no tie can change the choice or its order
 *      and the picks are the answer; else (equal probabilities at or above the k-th) the
 *      replay of moe_select.h's selection over the candidates in expert order, its
 *      partitions by the warp.
 * A NaN logit, k of 32 or more, or more than 32 * RK experts: one thread's whole
 * routing (pd_moe_route_row). For a step of one row (off not NULL) the grouping follows
 * (group_one_row): the grouping's launch spared.
 * Shared: E candidates, E logits, 2 E partition positions. */
template <int RK>
static __global__ void __launch_bounds__(ROUTE_THREADS)
route_kernel(const bf16 *logits, int32_t E, int32_t k, bool renorm, int32_t *ids, float *w,
             int32_t *off, int32_t *rows, int32_t *pos)
{
    extern __shared__ double smem_d[]; /* (double alignment for the candidates) */
    pd_moe_cand *c = reinterpret_cast<pd_moe_cand *>(smem_d);
    float *lg = reinterpret_cast<float *>(c + E);
    int32_t *Lp = reinterpret_cast<int32_t *>(lg + E), *Rp = Lp + E;
    __shared__ int32_t s_e[ROUTE_THREADS];
    pd_pdl_enter();
    const int lane = (int)threadIdx.x;
    const size_t t = blockIdx.x;
    const bf16 *row = logits + t * E;
    ids += t * k;
    w += t * k;
    const bool regs = E <= 32 * RK && k < ROUTE_THREADS;
    unsigned key[RK];
    float v[RK];
    bool bad = false;
    float mx = -INFINITY;
    if (regs) {
#pragma unroll
        for (int i = 0; i < RK; i++) {
            const int32_t e = lane + 32 * i;
            key[i] = 0; /* (below every expert's key) */
            v[i] = 0.f;
            if (e < E) {
                const bf16 b = row[e];
                v[i] = __bfloat162float(b);
                key[i] = route_key(__bfloat16_as_ushort(b), e);
                bad |= isnan(v[i]);
                mx = fmaxf(mx, v[i]);
            }
        }
    }
    bad = __any_sync(0xffffffffu, bad);
    if (!regs || bad) {
        for (int32_t e = lane; e < E; e += ROUTE_THREADS) lg[e] = pd_ld(row + e);
        __syncwarp();
        if (lane == 0) pd_moe_route_row(lg, E, k, renorm, c, ids, w);
        if (!off) return;
        __syncwarp(); /* (the ids lane 0 wrote, visible to the warp) */
        group_one_row(ids, k, E, off, rows, pos);
        return;
    }
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    /* 1. the k largest keys */
    unsigned sel[RK], best = 0, last = 0;
#pragma unroll
    for (int i = 0; i < RK; i++) {
        sel[i] = key[i];
        best = max(best, key[i]);
    }
    for (int32_t j = 0; j < k; j++) {
        last = warp_max_u32(best);
        if (lane == 0) s_e[j] = (int32_t)(0xFFFFu - (last & 0xFFFFu));
        best = 0;
#pragma unroll
        for (int i = 0; i < RK; i++) {
            sel[i] = sel[i] == last ? 0u : sel[i];
            best = max(best, sel[i]);
        }
    }
    /* 2. the softmax */
    double x[RK];
#pragma unroll
    for (int i = 0; i < RK; i++) {
        const int32_t e = lane + 32 * i;
        x[i] = 0;
        if (e < E) {
            x[i] = exp((double)v[i] - (double)mx);
            c[e].p = x[i];
            c[e].e = e;
        }
    }
    __syncwarp();
    double sum = 0;
    for (int32_t e = 0; e < E; e++) sum += c[e].p; /* (in expert order, as the reference) */
    __syncwarp();
#pragma unroll
    for (int i = 0; i < RK; i++) {
        const int32_t e = lane + 32 * i;
        if (e < E) {
            x[i] /= sum;
            c[e].p = x[i];
        }
    }
    __syncwarp();
    /* 3. the check */
    const double pk = c[s_e[k - 1]].p;
    bool ok = lane + 1 >= k || c[s_e[lane]].p > c[s_e[lane + 1]].p;
#pragma unroll
    for (int i = 0; i < RK; i++)
        if (lane + 32 * i < E && key[i] < last) ok &= x[i] < pk;
    if (__all_sync(0xffffffffu, ok)) {
        double top = 0;
        for (int32_t j = 0; j < k; j++) top += c[s_e[j]].p; /* (in the choice's order) */
        if (lane < k) {
            const double p = c[s_e[lane]].p;
            ids[lane] = s_e[lane];
            w[lane] = (float)(renorm ? p / top : p);
        }
        if (off) group_one_row(s_e, k, E, off, rows, pos);
        return;
    }
    /* a tie: the replay, over the candidates as the reference lays them out */
    if ((int64_t)k * 64 > E) {
        warp_route_pick(c, E, k, renorm, ids, w, Lp, Rp, s_e);
        if (off) group_one_row(s_e, k, E, off, rows, pos);
        return;
    }
    if (lane == 0) pd_moe_route_pick(c, E, k, renorm, ids, w);
    if (!off) return;
    __syncwarp(); /* (the ids lane 0 wrote, visible to the warp) */
    group_one_row(ids, k, E, off, rows, pos);
}

/* The n * k choices grouped by expert (pd_moe_group's order: experts ascending, rows
 * ascending within one), by one block: the groups' sizes by shared atomics, their offsets,
 * then the choices in rounds of the block's size, each choice's place = its expert's cursor
 * + the same expert's choices before it in the round (earlier warps' counts, then its own
 * warp's lanes below it). Shared: E cursors, [warps][E] counts. */
static __global__ void __launch_bounds__(1024)
group_kernel(const int32_t *ids, int32_t nk, int32_t k, int32_t E, int32_t *off, int32_t *rows,
             int32_t *pos)
{
    extern __shared__ int32_t sg[];
    pd_pdl_enter();
    const int nw = (int)blockDim.x / 32, warp = (int)threadIdx.x / 32, lane = (int)threadIdx.x % 32;
    int32_t *cur = sg, *wc = sg + E;
    for (int32_t e = threadIdx.x; e < E; e += blockDim.x) cur[e] = 0;
    __syncthreads();
    for (int32_t i = threadIdx.x; i < nk; i += blockDim.x) atomicAdd(&cur[ids[i]], 1);
    __syncthreads();
    if (threadIdx.x == 0) {
        int32_t run = 0;
        for (int32_t e = 0; e < E; e++) {
            const int32_t c = cur[e];
            off[e] = run;
            cur[e] = run;
            run += c;
        }
        off[E] = run;
    }
    __syncthreads();
    for (int32_t base = 0; base < nk; base += blockDim.x) {
        const int32_t i = base + (int32_t)threadIdx.x;
        const bool valid = i < nk;
        const int32_t e = valid ? ids[i] : -1;
        for (int32_t x = threadIdx.x; x < nw * E; x += blockDim.x) wc[x] = 0;
        __syncthreads();
        const unsigned peers = __match_any_sync(0xffffffffu, e);
        const int32_t lower = __popc(peers & ((1u << lane) - 1u));
        if (valid && lower == 0) wc[warp * E + e] = __popc(peers);
        __syncthreads();
        for (int32_t x = threadIdx.x; x < E; x += blockDim.x) {
            int32_t run = cur[x];
            for (int w = 0; w < nw; w++) {
                const int32_t c = wc[w * E + x];
                wc[w * E + x] = run;
                run += c;
            }
            cur[x] = run;
        }
        __syncthreads();
        if (valid) {
            const int32_t p = wc[warp * E + e] + lower;
            rows[p] = i / k;
            pos[i] = p;
        }
        __syncthreads();
    }
}

/* ---- the experts' products, rows streamed (decode) ---- */

#define GV_WARPS 8
#define GV_R 8 /* token rows a block at most (RT: 1, 2, 4 or 8 by the step's rows) */
#define GV_COLS(SWIGLU) ((SWIGLU) ? 2 : 4) /* output columns a warp: 4 weight rows */

/* 8 products of bf16 pairs summed into acc. */
static __device__ __forceinline__ float dot8(uint4 a, uint4 b, float acc)
{
    const uint32_t x[4] = {a.x, a.y, a.z, a.w}, y[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        acc = fmaf(pd_bf16_lo(x[i]), pd_bf16_lo(y[i]), acc);
        acc = fmaf(pd_bf16_hi(x[i]), pd_bf16_hi(y[i]), acc);
    }
    return acc;
}

/* Grid (row tile, column tile): a block takes up to R <= RT rows of one expert's group
 * (pd_moe_find_tile), their x rows (gathered by rows, or the group's own rows when rows is
 * NULL) in shared memory, and GV_WARPS * GV_COLS output columns: each warp streams its 4
 * weight rows once (SWIGLU: the gate and up rows of two columns, W [E][2M][K]; else four rows,
 * W [E][M][K]) against every row. out
 * [choices][M] in the grouped order. K % 8 == 0. */
template <bool SWIGLU, int RT>
static __global__ void __launch_bounds__(GV_WARPS * 32)
moe_gemv_kernel(const bf16 *__restrict__ x, const int32_t *__restrict__ rows,
                const int32_t *__restrict__ off, int32_t E, int32_t R,
                const bf16 *__restrict__ W, int32_t M, int32_t K, bf16 *__restrict__ out)
{
    extern __shared__ uint4 xs[]; /* [R][K / 8] */
    pd_pdl_enter();
    int32_t sub;
    const int32_t e = pd_moe_find_tile(off, E, R, (int32_t)blockIdx.x, &sub);
    if (e < 0) return;
    const int32_t r0 = off[e] + sub * R, nr = min(R, off[e + 1] - r0), K8 = K / 8;
    const int warp = (int)threadIdx.x / 32, lane = (int)threadIdx.x % 32;
    const int32_t i0 = ((int32_t)blockIdx.y * GV_WARPS + warp) * GV_COLS(SWIGLU);
    constexpr int NW = 4; /* weight rows a warp streams */
    const bf16 *We = W + (size_t)e * (SWIGLU ? 2 : 1) * (size_t)M * K;
    const uint4 *wr[NW];
    bool ok[NW];
#pragma unroll
    for (int q = 0; q < NW; q++) {
        const int32_t col = i0 + (SWIGLU ? (q & 1) : q);
        ok[q] = col < M;
        wr[q] = reinterpret_cast<const uint4 *>(We + (size_t)((SWIGLU && q >= 2 ? M : 0) +
                                                              (ok[q] ? col : 0)) * K);
    }
    /* the weights' first loads before the x rows' (they need only the expert) */
    uint4 wv[NW];
#pragma unroll
    for (int q = 0; q < NW; q++)
        wv[q] = ok[q] && lane < K8 ? __ldg(wr[q] + lane) : make_uint4(0, 0, 0, 0);
    for (int32_t i = threadIdx.x; i < nr * K8; i += blockDim.x) {
        const int32_t r = i / K8, c = i - r * K8;
        const int64_t src = rows ? rows[r0 + r] : r0 + r;
        xs[i] = reinterpret_cast<const uint4 *>(x + src * K)[c];
    }
    __syncthreads();
    if (i0 >= M) return;
    float acc[NW][RT];
#pragma unroll
    for (int q = 0; q < NW; q++)
#pragma unroll
        for (int r = 0; r < RT; r++) acc[q][r] = 0.0f;
    for (int32_t c = lane; c < K8; c += 32) { /* (the next step's loads before this one's sums) */
        uint4 nx[NW];
#pragma unroll
        for (int q = 0; q < NW; q++)
            nx[q] = ok[q] && c + 32 < K8 ? __ldg(wr[q] + c + 32) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int r = 0; r < RT; r++) {
            if (r >= nr) break;
            const uint4 xv = xs[r * K8 + c];
#pragma unroll
            for (int q = 0; q < NW; q++) acc[q][r] = dot8(wv[q], xv, acc[q][r]);
        }
#pragma unroll
        for (int q = 0; q < NW; q++) wv[q] = nx[q];
    }
    pd_moe_gv_store<SWIGLU, RT>(acc, ok, nr, lane, i0, r0, M, out);
}

/* The down products of a one-row step and their combination, in one launch (moe_experts with
 * out at n = 1): block b takes output columns DC_COLS b ..; warp w the choices w, w + 8, ..:
 * each streams its expert's DC_COLS down rows against the choice's SwiGLU row, summed as
 * moe_gemv_kernel sums (lane-strided chunks, then the warp) and rounded to bf16 as y would be;
 * then combine_kernel's sum over the choices in their order, added to out and rounded once.
 * So out is what the two launches make, bit for bit. Shared: [k][DC_COLS] floats. */
#define DC_COLS 4
static __global__ void __launch_bounds__(GV_WARPS * 32)
moe_down_combine_kernel(const bf16 *__restrict__ act, const int32_t *__restrict__ ids,
                        const int32_t *__restrict__ pos, const float *__restrict__ wts, int32_t k,
                        const bf16 *__restrict__ W, int32_t M, int32_t K, bool accumulate,
                        bf16 *__restrict__ out)
{
    extern __shared__ float dc[]; /* [k][DC_COLS] */
    pd_pdl_enter();
    const int warp = (int)threadIdx.x / 32, lane = (int)threadIdx.x % 32;
    const int32_t c0 = (int32_t)blockIdx.x * DC_COLS, K8 = K / 8;
    for (int32_t j = warp; j < k; j += GV_WARPS) {
        const uint4 *xr = reinterpret_cast<const uint4 *>(act + (size_t)pos[j] * K);
        const bf16 *We = W + (size_t)ids[j] * M * K;
        const uint4 *wr[DC_COLS];
        bool ok[DC_COLS];
        float acc[DC_COLS];
#pragma unroll
        for (int q = 0; q < DC_COLS; q++) {
            ok[q] = c0 + q < M;
            wr[q] = reinterpret_cast<const uint4 *>(We + (size_t)(ok[q] ? c0 + q : 0) * K);
            acc[q] = 0.0f;
        }
        for (int32_t c = lane; c < K8; c += 32) {
            uint4 wv[DC_COLS];
#pragma unroll
            for (int q = 0; q < DC_COLS; q++)
                wv[q] = ok[q] ? __ldg(wr[q] + c) : make_uint4(0, 0, 0, 0);
            const uint4 xv = xr[c];
#pragma unroll
            for (int q = 0; q < DC_COLS; q++) acc[q] = dot8(wv[q], xv, acc[q]);
        }
#pragma unroll
        for (int q = 0; q < DC_COLS; q++) {
            acc[q] = pd_warp_sum(acc[q]);
            if (lane == 0) dc[j * DC_COLS + q] = __bfloat162float(__float2bfloat16_rn(acc[q]));
        }
    }
    __syncthreads();
    const int q = (int)threadIdx.x;
    if (q < DC_COLS && c0 + q < M) {
        float s = 0.0f;
        for (int32_t j = 0; j < k; j++) s += wts[j] * dc[j * DC_COLS + q];
        bf16 *o = out + c0 + q;
        pd_st(o, accumulate ? pd_ld(o) + s : s);
    }
}

/* ---- the experts' products as grouped GEMMs on wgmma (prefill) ---- */

#define GM_BN 256   /* weight rows a tile (SWIGLU: the gate rows of 128 columns and their up
                     * rows: 128 outputs) */
#define GM_BK 64    /* one 128-byte swizzled row of bf16 */
#define GM_STAGES 4
#define GM_STAGE_ELEMS(BM) (((BM) + GM_BN) * GM_BK)
#define GM_SMEM(BM) (GM_STAGES * GM_STAGE_ELEMS(BM) * 2 + 1024)

/* Element offset of 16-byte chunk c of row r in a tile of 64-element rows, 128-byte swizzled
 * (cuda_wgmma.cuh's layout; the tile starts on a 1024-byte boundary). */
static __device__ __forceinline__ int gm_swz(int r, int c)
{
    return r * GM_BK + ((c ^ (r & 7)) << 3);
}

/* Grid (row tile, column tile): a block takes up to BM rows of one expert's group (x rows
 * gathered by rows, or the group's own when rows is NULL; BM 64 or 128) and GM_BN weight rows
 * (pd_moe_gm_wrow; 128 outputs with SWIGLU, else 256), K in steps of 64 through a ring of
 * GM_STAGES tiles loaded by cp.async (two in flight ahead of the one the products read). Each
 * warpgroup computes 64 x 256 (BM 128: its own 64 rows, two 64 x 128 products) or 64 x 128
 * (BM 64: the same 64 rows, its half of the weight rows) on wgmma, A and B in shared memory. */
template <bool SWIGLU, int BM>
static __global__ void __launch_bounds__(256, 1)
moe_gemm_kernel(const bf16 *__restrict__ x, const int32_t *__restrict__ rows,
                const int32_t *__restrict__ off, int32_t E, const bf16 *__restrict__ W, int32_t M,
                int32_t K, bf16 *__restrict__ out)
{
    constexpr int NB = BM == 128 ? 2 : 1; /* accumulators (64 x 128 each) a warpgroup */
    constexpr int SE = GM_STAGE_ELEMS(BM);
    extern __shared__ uint8_t gm_raw[];
    bf16 *sm = reinterpret_cast<bf16 *>(((uintptr_t)gm_raw + 1023) & ~(uintptr_t)1023);
    int32_t sub;
    const int32_t e = pd_moe_find_tile(off, E, BM, (int32_t)blockIdx.x, &sub);
    if (e < 0) return;
    const int32_t r0 = off[e] + sub * BM, nr = min(BM, off[e + 1] - r0);
    const int tid = (int)threadIdx.x, wg = tid / 128, warp = tid / 32, lane = tid % 32;
    const int32_t c0 = (int32_t)blockIdx.y * (SWIGLU ? GM_BN / 2 : GM_BN);
    const bf16 *We = W + (size_t)e * (SWIGLU ? 2 : 1) * (size_t)M * K;
    /* this thread's copies: chunk tid % 8 of A rows tid / 8 + 32 j and B rows likewise */
    const int ch = tid % 8, rb = tid / 8;
    const bf16 *src_a[BM / 32];
    bool ok_a[BM / 32];
#pragma unroll
    for (int j = 0; j < BM / 32; j++) {
        const int32_t r = rb + 32 * j;
        ok_a[j] = r < nr;
        const int64_t src = !ok_a[j] ? 0 : rows ? rows[r0 + r] : r0 + r;
        src_a[j] = x + src * K;
    }
    const bf16 *src_b[GM_BN / 32];
    bool ok_b[GM_BN / 32];
#pragma unroll
    for (int j = 0; j < GM_BN / 32; j++) {
        int32_t col;
        const int32_t wr = pd_moe_gm_wrow<SWIGLU, BM>(rb + 32 * j, c0, M, &col);
        ok_b[j] = col < M;
        src_b[j] = We + (size_t)(ok_b[j] ? wr : 0) * K;
    }
    const int32_t KT = (K + GM_BK - 1) / GM_BK;
    auto load = [&](int32_t kt) {
        bf16 *sa = sm + (kt % GM_STAGES) * SE, *sb = sa + BM * GM_BK;
        const int32_t kc = kt * GM_BK + ch * 8;
        const bool kin = kc < K;
#pragma unroll
        for (int j = 0; j < BM / 32; j++)
            pd_cp16(sa + gm_swz(rb + 32 * j, ch), src_a[j] + (kin ? kc : 0), ok_a[j] && kin);
#pragma unroll
        for (int j = 0; j < GM_BN / 32; j++)
            pd_cp16(sb + gm_swz(rb + 32 * j, ch), src_b[j] + (kin ? kc : 0), ok_b[j] && kin);
    };
#pragma unroll
    for (int s = 0; s < GM_STAGES - 2; s++) {
        if (s < KT) load(s);
        pd_cp_commit();
    }
    float d[NB][16][4];
#pragma unroll
    for (int b = 0; b < NB; b++)
#pragma unroll
        for (int j = 0; j < 16; j++)
#pragma unroll
            for (int v = 0; v < 4; v++) d[b][j][v] = 0.0f;
    /* this warpgroup's A rows and B rows in a stage */
    const int a_off = (BM == 128 ? wg * 64 : 0) * GM_BK;
    const int b_off = BM * GM_BK + (BM == 128 ? 0 : wg * 128 * GM_BK);
    for (int32_t kt = 0; kt < KT; kt++) {
        pd_cp_wait<GM_STAGES - 3>();
        pd_fence_proxy_async();
        __syncthreads(); /* tile kt landed for all; tile kt - 2's products done by both */
        if (kt + GM_STAGES - 2 < KT) load(kt + GM_STAGES - 2);
        pd_cp_commit();
        /* (a warpgroup past the group's rows computes zeros: a branch around wgmma would
         * serialise it) */
        const bf16 *st = sm + (kt % GM_STAGES) * SE;
        pd_wg_fence();
#pragma unroll
        for (int kk = 0; kk < GM_BK / 16; kk++) {
            const uint64_t da = pd_wg_desc(st + a_off + kk * 16, 16, 1024);
#pragma unroll
            for (int b = 0; b < NB; b++)
                pd_wgmma_n128_ss(d[b], da,
                                 pd_wg_desc(st + b_off + b * 128 * GM_BK + kk * 16, 16, 1024), 1);
        }
        pd_wg_commit();
        pd_wg_wait<1>();
    }
    pd_cp_wait<0>();
    pd_wg_wait<0>();
#pragma unroll
    for (int b = 0; b < NB; b++) pd_wg_hold(d[b]);
    pd_moe_gm_store<SWIGLU, BM>(d, wg, warp, lane, nr, r0, c0, M, out);
}

/* out[t][d] = (out[t][d] +) sum over j of w[t][j] * y[pos[t][j]][d], the sum in f32 in j
 * order, then added to out and rounded once. V elements a thread (8: 16-byte accesses, for
 * dim % 8 == 0 and aligned buffers; else 1). */
template <int V>
static __global__ void combine_kernel(const bf16 *y, const int32_t *pos, const float *w,
                                      int32_t n, int32_t k, int32_t dim, bool accumulate,
                                      bf16 *out)
{
    pd_pdl_enter();
    const int32_t dv = dim / V;
    const size_t total = (size_t)n * dv;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t t = i / (size_t)dv, d = (i - t * (size_t)dv) * V;
        float s[V];
#pragma unroll
        for (int v = 0; v < V; v++) s[v] = 0.0f;
        for (int32_t j = 0; j < k; j++) {
            const float wj = w[t * k + j];
            const bf16 *yr = y + (size_t)pos[t * k + j] * dim + d;
            if (V == 8) {
                const uint4 u = *reinterpret_cast<const uint4 *>(yr);
                const uint32_t a[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
                for (int v = 0; v < 4; v++) {
                    s[2 * v] += wj * pd_bf16_lo(a[v]);
                    s[2 * v + 1] += wj * pd_bf16_hi(a[v]);
                }
            } else {
                s[0] += wj * pd_ld(yr);
            }
        }
        bf16 *o = out + t * (size_t)dim + d;
        if (V == 8) {
            uint4 r = make_uint4(0, 0, 0, 0);
            if (accumulate) r = *reinterpret_cast<const uint4 *>(o);
            uint32_t a[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
            for (int v = 0; v < 4; v++)
                a[v] = accumulate ? pd_pack_bf16(pd_bf16_lo(a[v]) + s[2 * v],
                                                 pd_bf16_hi(a[v]) + s[2 * v + 1])
                                  : pd_pack_bf16(s[2 * v], s[2 * v + 1]);
            *reinterpret_cast<uint4 *>(o) = make_uint4(a[0], a[1], a[2], a[3]);
        } else {
            pd_st(o, accumulate ? pd_ld(o) + s[0] : s[0]);
        }
    }
}

extern "C" int pd_cuda__moe_route(void *ctx, const pd_moe_route_args *a)
{
    pd_cuda_ctx *c = pd_cuda__ctx(ctx);
    if (!a || a->n < 0 || a->n_experts < 1 || a->k < 1 || a->k > a->n_experts ||
        (!a->offsets && !a->dev_offsets) ||
        (a->n > 0 && (!a->logits || !a->ids || !a->weights || !a->rows || !a->pos)))
        return PD_EINVAL;
    const int32_t n = a->n, E = a->n_experts, k = a->k;
    const size_t smem = (size_t)E * (sizeof(pd_moe_cand) + sizeof(float) + 2 * sizeof(int32_t));
    if (smem > 48 * 1024 || (int64_t)n * k > INT32_MAX)
        return PD_EINVAL; /* (thousands of experts: not a model we know) */
    if (n == 0) {
        for (int32_t e = 0; a->offsets && e <= E; e++) a->offsets[e] = 0;
        if (a->dev_offsets)
            PD_CUDA_CHECK(cudaMemsetAsync(a->dev_offsets, 0, (size_t)(E + 1) * sizeof(int32_t),
                                          c->stream));
        return 0;
    }
    int32_t *doff = a->dev_offsets;
    if (!doff) { /* (the host's copy only: the context's scratch on the device) */
        if (c->moe_off_n < (size_t)E + 1) {
            if (c->moe_off) PD_CUDA_CHECK(cudaFree(c->moe_off));
            c->moe_off = NULL;
            c->moe_off_n = 0;
            PD_CUDA_CHECK(cudaMalloc(&c->moe_off, ((size_t)E + 1) * sizeof(int32_t)));
            c->moe_off_n = (size_t)E + 1;
        }
        doff = c->moe_off;
    }
    /* a step of one row (batch-1 decode) is grouped by the routing kernel itself */
    void (*route)(const bf16 *, int32_t, int32_t, bool, int32_t *, float *, int32_t *,
                  int32_t *, int32_t *) = E <= 128   ? route_kernel<4>
                                          : E <= 256 ? route_kernel<8>
                                                     : route_kernel<ROUTE_RK_MAX>;
    PD_CUDA_CHECK(pd_cuda__launch(route, dim3((unsigned)n), dim3(ROUTE_THREADS), smem, c->stream,
                                  (const bf16 *)a->logits, E, k, a->renormalize, a->ids,
                                  a->weights, n == 1 ? doff : NULL, a->rows, a->pos));
    if (n > 1) {
        /* the grouping: one block, as many warps as the choices need (up to 32) and its
         * shared counts allow */
        const int32_t nk = n * k;
        int nw = (nk + 31) / 32;
        if (nw > 32) nw = 32;
        const int fit = (int)((size_t)c->smem_optin / (4 * (size_t)E)) - 1;
        if (nw > fit) nw = fit;
        if (nw < 1) return PD_EINVAL;
        const size_t gsmem = (size_t)(1 + nw) * E * sizeof(int32_t);
        if (gsmem > 48 * 1024)
            PD_CUDA_CHECK(cudaFuncSetAttribute(group_kernel,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               (int)gsmem));
        PD_CUDA_CHECK(pd_cuda__launch(group_kernel, dim3(1), dim3((unsigned)(nw * 32)), gsmem,
                                      c->stream, a->ids, nk, k, E, doff, a->rows, a->pos));
    }
    if (a->offsets) { /* the caller sizes the experts' products by them: synchronous */
        PD_CUDA_CHECK(cudaMemcpyAsync(a->offsets, doff, (size_t)(E + 1) * sizeof(int32_t),
                                      cudaMemcpyDeviceToHost, c->stream));
        PD_CUDA_CHECK(cudaStreamSynchronize(c->stream));
    }
    return 0;
}

/* Whether the grouped GEMMs run: wgmma (an sm_90a build on compute capability 9.0) and the
 * choices averaging PDSERVE_CUDA_MOE_GEMM_ROWS rows an expert or more (0: never). */
static bool use_gemm(const pd_cuda_ctx *c, int64_t nk, int32_t E)
{
#if defined(PD_CUDA_SM90A)
    static const int64_t rows = pd_env_int("PDSERVE_CUDA_MOE_GEMM_ROWS");
    return c->cc_major == 9 && c->cc_minor == 0 && rows > 0 && nk >= rows * (int64_t)E;
#else
    (void)c;
    (void)nk;
    (void)E;
    return false;
#endif
}

#if defined(PD_CUDA_SM90A)
/* The GEMM's shared memory (past 48 KiB: allowed per device) set once a device, before any
 * graph capture can hold the launch (the first prefill runs eagerly). */
template <bool SWIGLU, int BM>
static cudaError_t gemm_smem_allowed(void)
{
    static std::atomic<unsigned long long> done{0};
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess) return e;
    const unsigned long long bit = dev >= 0 && dev < 64 ? 1ull << dev : 0;
    if (bit && (done.load() & bit)) return cudaSuccess;
    e = cudaFuncSetAttribute(moe_gemm_kernel<SWIGLU, BM>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, GM_SMEM(BM));
    if (e == cudaSuccess) done.fetch_or(bit);
    return e;
}

/* A grouped GEMM of BM-row tiles over every group. */
template <bool SWIGLU, int BM>
static int launch_gemm(pd_cuda_ctx *c, const bf16 *x, const int32_t *rows, const int32_t *off,
                       int32_t E, int64_t nk, int64_t busy, const bf16 *W, int32_t M, int32_t K,
                       bf16 *out)
{
    const int64_t tiles = (nk + BM - 1) / BM + busy;
    const int32_t per = SWIGLU ? GM_BN / 2 : GM_BN;
    PD_CUDA_CHECK((gemm_smem_allowed<SWIGLU, BM>()));
    moe_gemm_kernel<SWIGLU, BM><<<dim3((unsigned)tiles, (unsigned)((M + per - 1) / per)), 256,
                                  GM_SMEM(BM), c->stream>>>(x, rows, off, E, W, M, K, out);
    PD_CUDA_CHECK(cudaGetLastError());
    return 0;
}
#endif

/* One of the two products over every group: out[choices][M] from x's rows (gathered by rows,
 * or the groups' own when rows is NULL) and each expert's W. */
template <bool SWIGLU>
static int experts_product(pd_cuda_ctx *c, bool gemm, const bf16 *x, const int32_t *rows,
                           const int32_t *off, int32_t E, int32_t n, int64_t nk, const bf16 *W,
                           int32_t M, int32_t K, bf16 *out)
{
    const int64_t busy = nk < E ? nk : E; /* experts with rows, at most */
#if defined(PD_CUDA_SM90A)
    if (gemm) {
        /* tiles of 128 rows when the groups average 64 rows or more (prefill: half the
         * weight traffic a product of 64-row tiles makes), else 64 (decode batches: fewer
         * padded rows); PDSERVE_CUDA_MOE_GEMM_BM picks one for A/B runs */
        static const int64_t bm_env = pd_env_int("PDSERVE_CUDA_MOE_GEMM_BM");
        const bool tall = bm_env == 128 || (bm_env != 64 && nk >= 64 * (int64_t)E);
        return tall ? launch_gemm<SWIGLU, 128>(c, x, rows, off, E, nk, busy, W, M, K, out)
                    : launch_gemm<SWIGLU, 64>(c, x, rows, off, E, nk, busy, W, M, K, out);
    }
#else
    (void)gemm;
#endif
    /* rows a block: a group holds at most n (a row chooses an expert once), so the kernel's
     * accumulators are sized by n (RT), and as many as 48 KiB of shared memory holds */
    const int RT = n <= 1 ? 1 : n <= 2 ? 2 : n <= 4 ? 4 : GV_R;
    int32_t R = (int32_t)((48 * 1024) / ((size_t)K * sizeof(bf16)));
    if (R > RT) R = RT;
    if (R < 1) return PD_EINVAL;
    /* tiles: sum over experts of ceil(n_e / R): nk when R is 1, else at most nk / R + busy */
    const int64_t tiles = R == 1 ? nk : (nk + R - 1) / R + busy;
    const int32_t per = GV_WARPS * GV_COLS(SWIGLU);
    const dim3 grid((unsigned)tiles, (unsigned)((M + per - 1) / per));
    const size_t smem = (size_t)R * K * sizeof(bf16);
    void (*kernel)(const bf16 *, const int32_t *, const int32_t *, int32_t, int32_t,
                   const bf16 *, int32_t, int32_t, bf16 *) =
        RT == 1 ? moe_gemv_kernel<SWIGLU, 1>
        : RT == 2 ? moe_gemv_kernel<SWIGLU, 2>
        : RT == 4 ? moe_gemv_kernel<SWIGLU, 4>
                  : moe_gemv_kernel<SWIGLU, GV_R>;
    PD_CUDA_CHECK(pd_cuda__launch(kernel, grid, dim3(GV_WARPS * 32), smem, c->stream, x, rows, off,
                                  E, R, W, M, K, out));
    return 0;
}

/* combine_kernel over n rows (V 8: 16-byte accesses where dim and the buffers allow). */
static cudaError_t launch_combine(cudaStream_t stream, const bf16 *y, const int32_t *pos,
                                  const float *w, int32_t n, int32_t k, int32_t dim,
                                  bool accumulate, bf16 *out)
{
    const bool vec = dim % 8 == 0 && (((uintptr_t)y | (uintptr_t)out) & 15) == 0;
    const size_t total = (size_t)n * dim / (vec ? 8 : 1);
    return pd_cuda__launch(vec ? combine_kernel<8> : combine_kernel<1>,
                           dim3(pd_cuda__blocks(total, 256)), dim3(256), 0, stream, y, pos, w, n,
                           k, dim, accumulate, out);
}

extern "C" int pd_cuda__moe_experts(void *ctx, const pd_moe_experts_args *a)
{
    pd_cuda_ctx *c = pd_cuda__ctx(ctx);
    if (!a || a->n < 0 || a->k < 1 || a->n_experts < 1 || a->hidden < 8 || a->inter < 8 ||
        a->hidden % 8 != 0 || a->inter % 8 != 0 ||
        (a->n > 0 && (!a->x || !a->rows || !a->offsets || !a->gate_up || !a->down || !a->act ||
                      !a->y)) ||
        (a->n > 0 && a->out && (!a->ids || !a->pos || !a->weights)))
        return PD_EINVAL;
    const uintptr_t bits = (uintptr_t)a->x | (uintptr_t)a->gate_up | (uintptr_t)a->down |
                           (uintptr_t)a->act | (uintptr_t)a->y;
    if (bits & 15) return PD_EINVAL; /* (16-byte rows: the kernels' loads) */
    if (a->n == 0) return 0;
    const int64_t nk = (int64_t)a->n * a->k;
    if (nk > INT32_MAX || (int64_t)a->n_experts * 2 * a->inter > INT32_MAX) return PD_EINVAL;
    const bool gemm = use_gemm(c, nk, a->n_experts);
    int rc = experts_product<true>(c, gemm, (const bf16 *)a->x, a->rows, a->offsets,
                                   a->n_experts, a->n, nk, (const bf16 *)a->gate_up, a->inter,
                                   a->hidden, (bf16 *)a->act);
    if (rc < 0) return rc;
    if (a->out && a->n == 1 && !gemm && (size_t)a->k * DC_COLS * sizeof(float) <= 48 * 1024) {
        /* a one-row step: the down products and the combination in one launch */
        const dim3 grid((unsigned)((a->hidden + DC_COLS - 1) / DC_COLS));
        PD_CUDA_CHECK(pd_cuda__launch(moe_down_combine_kernel, grid, dim3(GV_WARPS * 32),
                                      (size_t)a->k * DC_COLS * sizeof(float), c->stream,
                                      (const bf16 *)a->act, a->ids, a->pos, a->weights, a->k,
                                      (const bf16 *)a->down, a->hidden, a->inter,
                                      a->accumulate, (bf16 *)a->out));
        return 0;
    }
    rc = experts_product<false>(c, gemm, (const bf16 *)a->act, NULL, a->offsets, a->n_experts,
                                a->n, nk, (const bf16 *)a->down, a->hidden, a->inter,
                                (bf16 *)a->y);
    if (rc < 0 || !a->out) return rc;
    PD_CUDA_CHECK(launch_combine(c->stream, (const bf16 *)a->y, a->pos, a->weights, a->n, a->k,
                                 a->hidden, a->accumulate, (bf16 *)a->out));
    return 0;
}

extern "C" int pd_cuda__moe_combine(void *ctx, const pd_moe_combine_args *a)
{
    pd_cuda_ctx *c = pd_cuda__ctx(ctx);
    if (!a || a->n < 0 || a->k < 1 || a->dim < 1 ||
        (a->n > 0 && (!a->y || !a->pos || !a->weights || !a->out)))
        return PD_EINVAL;
    if (a->n == 0) return 0;
    PD_CUDA_CHECK(launch_combine(c->stream, (const bf16 *)a->y, a->pos, a->weights, a->n, a->k,
                                 a->dim, a->accumulate, (bf16 *)a->out));
    return 0;
}
