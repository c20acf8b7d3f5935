/* cuda_fp8_moe.cu -- The FP8 op set's experts (pd_wq_ops.moe_experts; cuda_fp8_linear.cu
 * checks the arguments and launches): every expert's gate/up rows stacked in one FP8 weight,
 * its down rows in another, and a row-streaming kernel over moe_route's groups, read from
 * device memory (no host in the step, so decode steps are captured in graphs).
 *
 * A block takes up to R rows of one expert's group (pd_moe_find_tile) and FM_WARPS * 4 of
 * the expert's weight rows: each warp streams its 4 rows once, 16 e4m3 codes a lane a step (the
 * next step's loads issued before this step's arithmetic), against every row of the tile. The
 * input rows are quantized in the block's shared memory as the weight's act says, by
 * pd_fp8_quant_row's rule (the same codes and scales as the op set's quantization kernels
 * make), so neither product needs a quantization launch of its own; weight-only weights take
 * the bf16 rows. Each 16-element chunk's dot product (f32) is scaled by its group's weight and
 * input scales, as cuda_fp8_gemv_rows.cu's. The gate/up product's SwiGLU rounds both to bf16
 * first (linear_fused's rule).
 *
 * Many rows an expert (prefill) with quantized input rows take grouped GEMMs on wgmma's e4m3
 * products instead (sm_90a): the rows quantized beforehand (pd_cuda__fp8_launch_quant), tiles
 * of 64 or 128 token rows x 256 weight rows, K in 128-code steps through a ring of cp.async
 * stages, the layout of cuda_moe.cu's bf16 GEMMs byte for byte. A scale a row: the f32 sums of
 * the whole row scaled once by the token's and the weight row's scales; groups of 128
 * (block-wise checkpoints, 64-row tiles): each 128-code step's products summed apart and added
 * to the row's total times that group's two scales. */
#include <atomic>

#include "kernels/cuda/cuda_fp8.cuh"
#include "kernels/cuda/cuda_fp8_moe.cuh"
#include "kernels/cuda/cuda_moe.cuh"
#include "kernels/cuda/cuda_wgmma.cuh"

#define FM_WARPS 8
#define FM_R 8                            /* token rows a block at most */
#define FM_COLS(SWIGLU) ((SWIGLU) ? 2 : 4) /* output columns a warp: 4 weight rows */

/* Eight bf16 (a 16-byte chunk) to their codes at scale sc (pd_fp8_quant1 each). */
static __device__ __forceinline__ uint2 fm_quant8(uint4 v, float sc)
{
    const uint32_t u[4] = {v.x, v.y, v.z, v.w};
    uint32_t q[2] = {0, 0};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const uint32_t lo = pd_fp8_quant1(pd_bf16_lo(u[i]), sc);
        const uint32_t hi = pd_fp8_quant1(pd_bf16_hi(u[i]), sc);
        q[i / 2] |= (lo | hi << 8) << (16 * (i % 2));
    }
    return make_uint2(q[0], q[1]);
}

/* x rows (gathered by rows, or the group's own rows r0 .. when rows is NULL) of K columns
 * into shared memory: XQ, codes xq[R][K] and scales xs[R][ng] (pd_fp8_quant_row's rule,
 * group columns a scale; a scale a row: the block's threads over each row, else a warp a
 * (row, group)); else the bf16 rows xb[R][K]. Every thread of the block calls it. */
template <bool XQ>
static __device__ __forceinline__ void fm_load_rows(const bf16 *__restrict__ x,
                                                    const int32_t *__restrict__ rows, int32_t r0,
                                                    int32_t nr, int32_t K, int32_t group,
                                                    int32_t ng, bool dynamic, float in_scale,
                                                    uint8_t *xq, float *xs, bf16 *xb)
{
    const int warp = (int)threadIdx.x / 32, lane = (int)threadIdx.x % 32;
    if constexpr (!XQ) {
        const int32_t K8 = K / 8;
        for (int32_t i = threadIdx.x; i < nr * K8; i += blockDim.x) {
            const int32_t r = i / K8, c = i - r * K8;
            const int64_t src = rows ? rows[r0 + r] : r0 + r;
            reinterpret_cast<uint4 *>(xb)[i] = reinterpret_cast<const uint4 *>(x + src * K)[c];
        }
    } else if (ng == 1) {
        /* a scale a row: the whole block finds each row's largest magnitude, then quantizes */
        __shared__ float s_part[FM_WARPS][FM_R];
        const int32_t K8 = K / 8;
        if (dynamic) {
            for (int32_t r = 0; r < nr; r++) {
                const int64_t src = rows ? rows[r0 + r] : r0 + r;
                const uint4 *xr = reinterpret_cast<const uint4 *>(x + src * K);
                float amax = 0.0f;
                for (int32_t c = threadIdx.x; c < K8; c += blockDim.x)
                    amax = pd_bf16x8_amax(xr[c], amax);
                amax = pd_warp_max(amax);
                if (lane == 0) s_part[warp][r] = amax;
            }
            __syncthreads();
        }
        if ((int32_t)threadIdx.x < nr) {
            float amax = 0.0f;
            for (int w = 0; dynamic && w < (int)blockDim.x / 32; w++)
                amax = fmaxf(amax, s_part[w][threadIdx.x]);
            xs[threadIdx.x] = dynamic ? pd_fp8_dyn_scale(amax) : in_scale;
        }
        __syncthreads();
        for (int32_t i = threadIdx.x; i < nr * K8; i += blockDim.x) {
            const int32_t r = i / K8, c = i - r * K8;
            const int64_t src = rows ? rows[r0 + r] : r0 + r;
            const uint4 v = reinterpret_cast<const uint4 *>(x + src * K)[c];
            const float sc = xs[r];
            reinterpret_cast<uint2 *>(xq)[i] = fm_quant8(v, sc);
        }
    } else {
        for (int32_t p = warp; p < nr * ng; p += (int32_t)blockDim.x / 32) {
            const int32_t r = p / ng, g = p - r * ng;
            const int64_t src = rows ? rows[r0 + r] : r0 + r;
            const bf16 *xr = x + src * K;
            const int32_t j0 = g * group, j1 = min(K, j0 + group);
            float sc = in_scale;
            if (dynamic) {
                float amax = 0.0f;
                for (int32_t j = j0 + lane * 8; j < j1; j += 256)
                    amax = pd_bf16x8_amax(*reinterpret_cast<const uint4 *>(xr + j), amax);
                sc = pd_fp8_dyn_scale(pd_warp_max(amax));
            }
            for (int32_t j = j0 + lane * 8; j < j1; j += 256) {
                *reinterpret_cast<uint2 *>(xq + (int64_t)r * K + j) =
                    fm_quant8(*reinterpret_cast<const uint4 *>(xr + j), sc);
            }
            if (lane == 0) xs[r * ng + g] = sc;
        }
    }
}

/* The 16 values of chunk c of fm_load_rows' row r as f32 (XQ: codes; else bf16), and the
 * scale of their group g (1 for bf16 rows). */
template <bool XQ>
static __device__ __forceinline__ float fm_row16(const uint8_t *xq, const float *xs,
                                                 const bf16 *xb, int32_t r, int32_t K,
                                                 int32_t ng, int32_t c, int32_t g,
                                                 float (&xf)[16])
{
    if (XQ) {
        pd_e4m3x16_f32(reinterpret_cast<const uint4 *>(xq + (size_t)r * K)[c], xf);
        return xs[r * ng + g];
    }
    const uint4 *p = reinterpret_cast<const uint4 *>(xb + (size_t)r * K + c * 16);
    const uint4 a = p[0], b = p[1];
    const uint32_t h[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
    for (int i = 0; i < 8; i++) {
        xf[2 * i] = pd_bf16_lo(h[i]);
        xf[2 * i + 1] = pd_bf16_hi(h[i]);
    }
    return 1.0f;
}

/* Grid (row tile, column tile). W [E * (SWIGLU ? 2M : M)][K] e4m3 with scales ws [..][ng]
 * (expert e's gate rows, then its up rows, from row 2Me with SWIGLU); out [choices][M] in the
 * grouped order. K % 16 == 0, group % 16 == 0, 16-byte aligned rows. One row a tile (batch-1
 * decode: a few hundred blocks of little work each) at 3 blocks an SM, so that the grid is
 * one wave (docs/perf-history.md, "FP8 experts on CUDA"). */
template <bool SWIGLU, int RT, bool XQ>
static __global__ void __launch_bounds__(FM_WARPS * 32, RT == 1 ? 3 : 1)
fp8_moe_gemv_kernel(const bf16 *__restrict__ x, const int32_t *__restrict__ rows,
                    const int32_t *__restrict__ off, int32_t E, int32_t R,
                    const uint8_t *__restrict__ W, const float *__restrict__ ws, int32_t group,
                    int32_t ng, bool dynamic, float in_scale, int32_t M, int32_t K,
                    bf16 *__restrict__ out)
{
    extern __shared__ uint4 fm_smem[];
    pd_pdl_enter();
    int32_t sub;
    const int32_t e = pd_moe_find_tile(off, E, R, (int32_t)blockIdx.x, &sub);
    if (e < 0) return;
    const int32_t r0 = off[e] + sub * R, nr = min(R, off[e + 1] - r0), K16 = K / 16;
    const int warp = (int)threadIdx.x / 32, lane = (int)threadIdx.x % 32;
    const int32_t i0 = ((int32_t)blockIdx.y * FM_WARPS + warp) * FM_COLS(SWIGLU);
    constexpr int NW = 4; /* weight rows a warp streams */
    const int64_t base = (int64_t)e * (SWIGLU ? 2 : 1) * M;
    int64_t wr[NW];
    bool ok[NW];
#pragma unroll
    for (int q = 0; q < NW; q++) {
        const int32_t col = i0 + (SWIGLU ? (q & 1) : q);
        ok[q] = col < M;
        wr[q] = base + (SWIGLU && q >= 2 ? M : 0) + (ok[q] ? col : 0);
    }
    const uint4 zero = make_uint4(0, 0, 0, 0);
    /* the weights' first loads before the rows' (they need only the expert) */
    uint4 wv[NW];
#pragma unroll
    for (int q = 0; q < NW; q++)
        wv[q] = ok[q] && lane < K16 ? pd_fp8_ld_stream16(W + wr[q] * K + lane * 16) : zero;
    uint8_t *xq = reinterpret_cast<uint8_t *>(fm_smem);
    float *xs = reinterpret_cast<float *>(xq + (size_t)R * K);
    bf16 *xb = reinterpret_cast<bf16 *>(fm_smem);
    fm_load_rows<XQ>(x, rows, r0, nr, K, group, ng, dynamic, in_scale, xq, xs, xb);
    __syncthreads();
    if (i0 >= M) return;
    float acc[NW][RT];
#pragma unroll
    for (int q = 0; q < NW; q++)
#pragma unroll
        for (int r = 0; r < RT; r++) acc[q][r] = 0.0f;
    for (int32_t c = lane; c < K16; c += 32) { /* (the next step's loads before this one's sums) */
        uint4 nx[NW];
#pragma unroll
        for (int q = 0; q < NW; q++)
            nx[q] = ok[q] && c + 32 < K16 ? pd_fp8_ld_stream16(W + wr[q] * K + (c + 32) * 16)
                                          : zero;
        const int32_t g = c * 16 / group;
        float wf[NW][16], sw[NW];
#pragma unroll
        for (int q = 0; q < NW; q++) {
            pd_e4m3x16_f32(wv[q], wf[q]);
            sw[q] = ok[q] ? __ldg(ws + wr[q] * ng + g) : 0.0f;
        }
#pragma unroll
        for (int r = 0; r < RT; r++) {
            if (r >= nr) break;
            float xf[16];
            const float sx = fm_row16<XQ>(xq, xs, xb, r, K, ng, c, g, xf);
#pragma unroll
            for (int q = 0; q < NW; q++) {
                float d = 0.0f;
#pragma unroll
                for (int i = 0; i < 16; i++) d = fmaf(wf[q][i], xf[i], d);
                acc[q][r] = fmaf(d, sw[q] * sx, acc[q][r]);
            }
        }
#pragma unroll
        for (int q = 0; q < NW; q++) wv[q] = nx[q];
    }
    pd_moe_gv_store<SWIGLU, RT>(acc, ok, nr, lane, i0, r0, M, out);
}

/* The down products of a one-row step and their combination in one launch (moe_experts with
 * out at n = 1; cuda_moe.cu's moe_down_combine_kernel for FP8 weights): the block quantizes the
 * k SwiGLU rows (act[pos[j]]) as the row-streaming kernel does; block b takes output columns
 * FM_DC b ..; warp w the choices w, w + 8, ..: each streams its expert's FM_DC down rows
 * against the choice's row, summed as fp8_moe_gemv_kernel sums and rounded to bf16 as y
 * would be; then the combination's sum over the choices in their order, added to out and
 * rounded once: the bits of the two launches. k <= FM_R. */
#define FM_DC 4
template <bool XQ>
static __global__ void __launch_bounds__(FM_WARPS * 32)
fp8_moe_down_combine_kernel(const bf16 *__restrict__ act, const int32_t *__restrict__ ids,
                            const int32_t *__restrict__ pos, const float *__restrict__ wts,
                            int32_t k, const uint8_t *__restrict__ W,
                            const float *__restrict__ ws, int32_t group, int32_t ng,
                            bool dynamic, float in_scale, int32_t M, int32_t K,
                            bool accumulate, bf16 *__restrict__ out)
{
    extern __shared__ uint4 fm_smem[];
    pd_pdl_enter();
    uint8_t *xq = reinterpret_cast<uint8_t *>(fm_smem);
    float *xs = reinterpret_cast<float *>(xq + (size_t)k * K);
    bf16 *xb = reinterpret_cast<bf16 *>(fm_smem);
    float *dc = XQ ? xs + k * ng : reinterpret_cast<float *>(xb + (size_t)k * K);
    const int warp = (int)threadIdx.x / 32, lane = (int)threadIdx.x % 32;
    const int32_t c0 = (int32_t)blockIdx.x * FM_DC, K16 = K / 16;
    fm_load_rows<XQ>(act, pos, 0, k, K, group, ng, dynamic, in_scale, xq, xs, xb);
    __syncthreads();
    for (int32_t j = warp; j < k; j += FM_WARPS) {
        int64_t wr[FM_DC];
        bool ok[FM_DC];
        float acc[FM_DC];
#pragma unroll
        for (int q = 0; q < FM_DC; q++) {
            ok[q] = c0 + q < M;
            wr[q] = (int64_t)ids[j] * M + (ok[q] ? c0 + q : 0);
            acc[q] = 0.0f;
        }
        for (int32_t c = lane; c < K16; c += 32) {
            const int32_t g = c * 16 / group;
            float xf[16];
            const float sx = fm_row16<XQ>(xq, xs, xb, j, K, ng, c, g, xf);
#pragma unroll
            for (int q = 0; q < FM_DC; q++) {
                if (!ok[q]) continue;
                float wf[16];
                pd_e4m3x16_f32(pd_fp8_ld_stream16(W + wr[q] * K + c * 16), wf);
                float d = 0.0f;
#pragma unroll
                for (int i = 0; i < 16; i++) d = fmaf(wf[i], xf[i], d);
                acc[q] = fmaf(d, __ldg(ws + wr[q] * ng + g) * sx, acc[q]);
            }
        }
#pragma unroll
        for (int q = 0; q < FM_DC; q++) {
            acc[q] = pd_warp_sum(acc[q]);
            if (lane == 0) dc[j * FM_DC + q] = __bfloat162float(__float2bfloat16_rn(acc[q]));
        }
    }
    __syncthreads();
    const int q = (int)threadIdx.x;
    if (q < FM_DC && c0 + q < M) {
        float s = 0.0f;
        for (int32_t j = 0; j < k; j++) s += wts[j] * dc[j * FM_DC + q];
        bf16 *o = out + c0 + q;
        pd_st(o, accumulate ? pd_ld(o) + s : s);
    }
}

template <bool SWIGLU, bool XQ>
static cudaError_t launch_t(const pd_fp8_weight *w, const bf16 *x, const int32_t *rows,
                            const int32_t *off, int32_t E, int32_t n, int64_t nk, int32_t M,
                            bf16 *out, cudaStream_t stream)
{
    const int32_t K = w->k;
    /* rows a block: a group holds at most n (a row chooses an expert once) */
    const int RT = n <= 1 ? 1 : n <= 2 ? 2 : n <= 4 ? 4 : FM_R;
    const size_t row_bytes = XQ ? (size_t)K + (size_t)w->ng * sizeof(float) : (size_t)K * 2;
    int32_t R = (int32_t)((48 * 1024) / row_bytes);
    if (R > RT) R = RT;
    if (R < 1) return cudaErrorInvalidValue;
    const int64_t busy = nk < E ? nk : E; /* experts with rows, at most */
    const int64_t tiles = R == 1 ? nk : (nk + R - 1) / R + busy;
    const int32_t per = FM_WARPS * FM_COLS(SWIGLU);
    const dim3 grid((unsigned)tiles, (unsigned)((M + per - 1) / per));
    typedef void (*kfn)(const bf16 *, const int32_t *, const int32_t *, int32_t, int32_t,
                        const uint8_t *, const float *, int32_t, int32_t, bool, float, int32_t,
                        int32_t, bf16 *);
    const kfn kernel = RT == 1   ? fp8_moe_gemv_kernel<SWIGLU, 1, XQ>
                       : RT == 2 ? fp8_moe_gemv_kernel<SWIGLU, 2, XQ>
                       : RT == 4 ? fp8_moe_gemv_kernel<SWIGLU, 4, XQ>
                                 : fp8_moe_gemv_kernel<SWIGLU, FM_R, XQ>;
    return pd_cuda__launch(kernel, grid, dim3(FM_WARPS * 32), (size_t)R * row_bytes, stream, x,
                           rows, off, E, R, (const uint8_t *)w->w8, (const float *)w->scale,
                           w->group, w->ng, w->act == PD_ACT_DYNAMIC, w->in_scale, M, K, out);
}

cudaError_t pd_cuda__fp8_launch_moe_down_combine(const pd_fp8_weight *w, const bf16 *act,
                                                 const int32_t *ids, const int32_t *pos,
                                                 const float *wts, int32_t k, int32_t M,
                                                 bool accumulate, bf16 *out, cudaStream_t stream)
{
    const bool xq = w->act != PD_ACT_NONE;
    const size_t smem = xq ? (size_t)k * (w->k + w->ng * sizeof(float) + FM_DC * sizeof(float))
                           : (size_t)k * (w->k * sizeof(bf16) + FM_DC * sizeof(float));
    if (k > FM_R || smem > 48 * 1024) return cudaErrorInvalidValue;
    const dim3 grid((unsigned)((M + FM_DC - 1) / FM_DC));
    return pd_cuda__launch(xq ? fp8_moe_down_combine_kernel<true>
                              : fp8_moe_down_combine_kernel<false>,
                           grid, dim3(FM_WARPS * 32), smem, stream, act, ids, pos, wts, k,
                           (const uint8_t *)w->w8, (const float *)w->scale, w->group, w->ng,
                           w->act == PD_ACT_DYNAMIC, w->in_scale, M, w->k, accumulate, out);
}

cudaError_t pd_cuda__fp8_launch_moe(const pd_fp8_weight *w, const bf16 *x, const int32_t *rows,
                                    const int32_t *off, int32_t E, int32_t n, int64_t nk,
                                    int32_t M, bool swiglu, bf16 *out, cudaStream_t stream)
{
    const bool xq = w->act != PD_ACT_NONE;
    if (swiglu)
        return xq ? launch_t<true, true>(w, x, rows, off, E, n, nk, M, out, stream)
                  : launch_t<true, false>(w, x, rows, off, E, n, nk, M, out, stream);
    return xq ? launch_t<false, true>(w, x, rows, off, E, n, nk, M, out, stream)
              : launch_t<false, false>(w, x, rows, off, E, n, nk, M, out, stream);
}

/* ---- grouped GEMMs on e4m3 wgmma (prefill) ---- */

#if defined(PD_CUDA_SM90A)
#define FG_BN 256 /* weight rows a tile (SWIGLU: the gate rows of 128 columns and their ups) */
#define FG_BK 128 /* codes a step: one 128-byte swizzled row */
#define FG_STAGES 4
#define FG_STAGE_BYTES(BM) (((BM) + FG_BN) * FG_BK)
#define FG_SMEM(BM) (FG_STAGES * FG_STAGE_BYTES(BM) + 1024)

/* Byte offset of 16-byte chunk c of row r in a tile of 128-byte swizzled rows. */
static __device__ __forceinline__ int fg_swz(int r, int c)
{
    return r * FG_BK + ((c ^ (r & 7)) << 4);
}

/* Grid (row tile, column tile), as cuda_moe.cu's moe_gemm_kernel: a block takes up to BM rows
 * of one expert's group (codes xq [..][K] gathered by rows, or the group's own rows; their
 * scales xs [ng][nx]) and FG_BN rows of the expert's weight (pd_moe_gm_wrow). GROUP: groups
 * of 128 (BM 64 only: two accumulators a warpgroup), else a scale a row. */
template <bool SWIGLU, int BM, bool GROUP>
static __global__ void __launch_bounds__(256, 1)
fp8_moe_gemm_kernel(const uint8_t *__restrict__ xq, const float *__restrict__ xs, int32_t nx,
                    const int32_t *__restrict__ rows, const int32_t *__restrict__ off,
                    int32_t E, const uint8_t *__restrict__ W, const float *__restrict__ ws,
                    int32_t ng, int32_t M, int32_t K, bf16 *__restrict__ out)
{
    static_assert(!GROUP || BM == 64, "groups of 128 take 64-row tiles");
    constexpr int NB = BM == 128 ? 2 : 1; /* accumulators (64 x 128 each) a warpgroup */
    constexpr int NT = GROUP ? NB : 1;    /* totals kept apart from them */
    constexpr int SB = FG_STAGE_BYTES(BM);
    extern __shared__ uint8_t fg_raw[];
    uint8_t *sm = reinterpret_cast<uint8_t *>(((uintptr_t)fg_raw + 1023) & ~(uintptr_t)1023);
    pd_pdl_enter();
    int32_t sub;
    const int32_t e = pd_moe_find_tile(off, E, BM, (int32_t)blockIdx.x, &sub);
    if (e < 0) return;
    const int32_t r0 = off[e] + sub * BM, nr = min(BM, off[e + 1] - r0);
    const int tid = (int)threadIdx.x, wg = tid / 128, warp = tid / 32, lane = tid % 32;
    const int32_t c0 = (int32_t)blockIdx.y * (SWIGLU ? FG_BN / 2 : FG_BN);
    const int64_t base = (int64_t)e * (SWIGLU ? 2 : 1) * M;
    const int ch = tid % 8, rb = tid / 8;
    const uint8_t *src_a[BM / 32];
    bool ok_a[BM / 32];
#pragma unroll
    for (int j = 0; j < BM / 32; j++) {
        const int32_t r = rb + 32 * j;
        ok_a[j] = r < nr;
        const int64_t src = !ok_a[j] ? 0 : rows ? rows[r0 + r] : r0 + r;
        src_a[j] = xq + src * K;
    }
    const uint8_t *src_b[FG_BN / 32];
    bool ok_b[FG_BN / 32];
#pragma unroll
    for (int j = 0; j < FG_BN / 32; j++) {
        int32_t col;
        const int32_t wr = pd_moe_gm_wrow<SWIGLU, BM>(rb + 32 * j, c0, M, &col);
        ok_b[j] = col < M;
        src_b[j] = W + (base + (ok_b[j] ? wr : 0)) * K;
    }
    const int32_t KT = (K + FG_BK - 1) / FG_BK;
    auto load = [&](int32_t kt) {
        uint8_t *sa = sm + (kt % FG_STAGES) * SB, *sb = sa + BM * FG_BK;
        const int32_t kc = kt * FG_BK + ch * 16;
        const bool kin = kc < K;
#pragma unroll
        for (int j = 0; j < BM / 32; j++)
            pd_cp16(sa + fg_swz(rb + 32 * j, ch), src_a[j] + (kin ? kc : 0), ok_a[j] && kin);
#pragma unroll
        for (int j = 0; j < FG_BN / 32; j++)
            pd_cp16(sb + fg_swz(rb + 32 * j, ch), src_b[j] + (kin ? kc : 0), ok_b[j] && kin);
    };
#pragma unroll
    for (int s = 0; s < FG_STAGES - 2; s++) {
        if (s < KT) load(s);
        pd_cp_commit();
    }
    /* this thread's accumulator elements: tile rows g, g + 8 of its warp's 16; weight rows
     * (B rows) 8 j + 2 q (+ 1) of accumulator b's 128 */
    const int g = lane / 4, q = lane % 4;
    const int32_t trow0 = (BM == 128 ? wg * 64 : 0) + (warp & 3) * 16 + g;
    auto b_row = [&](int b, int j, int u) {
        return (BM == 128 ? 128 * b : 128 * wg) + 8 * j + 2 * q + u;
    };
    float d[NB][16][4], t[NT][16][4];
#pragma unroll
    for (int b = 0; b < NB; b++)
#pragma unroll
        for (int j = 0; j < 16; j++)
#pragma unroll
            for (int v = 0; v < 4; v++) d[b][j][v] = 0.0f;
#pragma unroll
    for (int b = 0; b < NT; b++)
#pragma unroll
        for (int j = 0; j < 16; j++)
#pragma unroll
            for (int v = 0; v < 4; v++) t[b][j][v] = 0.0f;
    /* the token rows' scales (GROUP: of the step's group, reloaded each step) */
    int64_t srow[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int32_t i = trow0 + 8 * h;
        srow[h] = i >= nr ? -1 : rows ? rows[r0 + i] : r0 + i;
    }
    /* group g's token and weight-row scales on the sums d: added into the totals t (GROUP),
     * else d scaled in place */
    auto apply_scales = [&](int32_t g) {
        float sx[2];
#pragma unroll
        for (int h = 0; h < 2; h++)
            sx[h] = srow[h] < 0 ? 0.0f : __ldg(xs + (int64_t)g * nx + srow[h]);
#pragma unroll
        for (int b = 0; b < NB; b++)
#pragma unroll
            for (int j = 0; j < 16; j++)
#pragma unroll
                for (int u = 0; u < 2; u++) {
                    int32_t col;
                    const int32_t wr = pd_moe_gm_wrow<SWIGLU, BM>(b_row(b, j, u), c0, M, &col);
                    const float sw = col < M ? __ldg(ws + (base + wr) * ng + g) : 0.0f;
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        float &v = d[b][j][2 * h + u];
                        if (GROUP)
                            t[b][j][2 * h + u] = fmaf(v, sw * sx[h], t[b][j][2 * h + u]);
                        else
                            v *= sw * sx[h];
                    }
                }
    };
    const int a_off = (BM == 128 ? wg * 64 : 0) * FG_BK;
    const int b_off = BM * FG_BK + (BM == 128 ? 0 : wg * 128 * FG_BK);
    for (int32_t kt = 0; kt < KT; kt++) {
        pd_cp_wait<FG_STAGES - 3>();
        pd_fence_proxy_async();
        __syncthreads(); /* tile kt landed for all; tile kt - 2's products done by both */
        if (kt + FG_STAGES - 2 < KT) load(kt + FG_STAGES - 2);
        pd_cp_commit();
        const uint8_t *st = sm + (kt % FG_STAGES) * SB;
        pd_wg_fence();
#pragma unroll
        for (int kk = 0; kk < FG_BK / 32; kk++) {
            const uint64_t da = pd_wg_desc(st + a_off + kk * 32, 16, 1024);
#pragma unroll
            for (int b = 0; b < NB; b++)
                pd_wgmma_n128_ss_e4m3(d[b], da,
                                      pd_wg_desc(st + b_off + b * 128 * FG_BK + kk * 32, 16, 1024),
                                      GROUP ? kk > 0 : 1);
        }
        pd_wg_commit();
        if (!GROUP) {
            pd_wg_wait<1>();
            continue;
        }
        /* this step's group: its sums into the totals, times the group's two scales */
        pd_wg_wait<0>();
#pragma unroll
        for (int b = 0; b < NB; b++) pd_wg_hold(d[b]);
        apply_scales(kt);
    }
    pd_cp_wait<0>();
    pd_wg_wait<0>();
#pragma unroll
    for (int b = 0; b < NB; b++) pd_wg_hold(d[b]);
    if (!GROUP) apply_scales(0); /* a scale a row: the sums scaled once */
    if constexpr (GROUP)
        pd_moe_gm_store<SWIGLU, BM>(t, wg, warp, lane, nr, r0, c0, M, out);
    else
        pd_moe_gm_store<SWIGLU, BM>(d, wg, warp, lane, nr, r0, c0, M, out);
}

/* The GEMM's shared memory (past 48 KiB: allowed per device) set once a device, before any
 * graph capture can hold the launch. */
template <bool SWIGLU, int BM, bool GROUP>
static cudaError_t gemm_smem_allowed(void)
{
    static std::atomic<unsigned long long> done{0};
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess) return e;
    const unsigned long long bit = dev >= 0 && dev < 64 ? 1ull << dev : 0;
    if (bit && (done.load() & bit)) return cudaSuccess;
    e = cudaFuncSetAttribute(fp8_moe_gemm_kernel<SWIGLU, BM, GROUP>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, FG_SMEM(BM));
    if (e == cudaSuccess) done.fetch_or(bit);
    return e;
}

template <bool SWIGLU, int BM, bool GROUP>
static cudaError_t launch_gemm_t(const pd_fp8_weight *w, const uint8_t *xq, const float *xs,
                                 int32_t nx, const int32_t *rows, const int32_t *off, int32_t E,
                                 int64_t nk, int32_t M, bf16 *out, cudaStream_t stream)
{
    cudaError_t e = gemm_smem_allowed<SWIGLU, BM, GROUP>();
    if (e != cudaSuccess) return e;
    const int64_t busy = nk < E ? nk : E;
    const int64_t tiles = (nk + BM - 1) / BM + busy;
    const int32_t per = SWIGLU ? FG_BN / 2 : FG_BN;
    return pd_cuda__launch(fp8_moe_gemm_kernel<SWIGLU, BM, GROUP>,
                           dim3((unsigned)tiles, (unsigned)((M + per - 1) / per)), dim3(256),
                           (size_t)FG_SMEM(BM), stream, xq, xs, nx, rows, off, E,
                           (const uint8_t *)w->w8, (const float *)w->scale, w->ng, M, w->k, out);
}

template <bool SWIGLU>
static cudaError_t launch_gemm_s(const pd_fp8_weight *w, const uint8_t *xq, const float *xs,
                                 int32_t nx, const int32_t *rows, const int32_t *off, int32_t E,
                                 int64_t nk, int32_t M, bf16 *out, cudaStream_t stream)
{
    if (w->ng > 1)
        return launch_gemm_t<SWIGLU, 64, true>(w, xq, xs, nx, rows, off, E, nk, M, out, stream);
    /* 128-row tiles when the groups average 64 rows or more (half the weight traffic) */
    return nk >= 64 * (int64_t)E
               ? launch_gemm_t<SWIGLU, 128, false>(w, xq, xs, nx, rows, off, E, nk, M, out, stream)
               : launch_gemm_t<SWIGLU, 64, false>(w, xq, xs, nx, rows, off, E, nk, M, out, stream);
}
#endif

bool pd_cuda__fp8_moe_gemm_can(const pd_cuda_ctx *c, const pd_fp8_weight *w)
{
#if defined(PD_CUDA_SM90A)
    return c->cc_major == 9 && c->cc_minor == 0 && w->act != PD_ACT_NONE &&
           (w->ng == 1 || w->group == 128);
#else
    (void)c;
    (void)w;
    return false;
#endif
}

cudaError_t pd_cuda__fp8_launch_moe_gemm(const pd_fp8_weight *w, const uint8_t *xq,
                                         const float *xs, int32_t nx, const int32_t *rows,
                                         const int32_t *off, int32_t E, int64_t nk, int32_t M,
                                         bool swiglu, bf16 *out, cudaStream_t stream)
{
#if defined(PD_CUDA_SM90A)
    return swiglu ? launch_gemm_s<true>(w, xq, xs, nx, rows, off, E, nk, M, out, stream)
                  : launch_gemm_s<false>(w, xq, xs, nx, rows, off, E, nk, M, out, stream);
#else
    (void)w; (void)xq; (void)xs; (void)nx; (void)rows; (void)off; (void)E; (void)nk; (void)M;
    (void)swiglu; (void)out; (void)stream;
    return cudaErrorNotSupported;
#endif
}
