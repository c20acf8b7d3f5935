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
 * first (linear_fused's rule). Prefill's many rows an expert run the same kernel, 8 rows a
 * tile (a grouped FP8 GEMM is not written yet: docs/quantization.md). */
#include "kernels/cuda/cuda_fp8.cuh"
#include "kernels/cuda/cuda_moe.cuh"

#define FM_WARPS 8
#define FM_R 8                            /* token rows a block at most */
#define FM_COLS(SWIGLU) ((SWIGLU) ? 2 : 4) /* output columns a warp: 4 weight rows */

/* x rows (gathered by rows, or the group's own rows r0 .. when rows is NULL) of K columns
 * into shared memory: XQ, codes xq[R][K] and scales xs[R][ng] (pd_fp8_quant_row's rule,
 * group columns a scale), a warp a (row, group); else the bf16 rows xb[R][K]. */
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
                const uint4 v = *reinterpret_cast<const uint4 *>(xr + j);
                const uint32_t u[4] = {v.x, v.y, v.z, v.w};
                uint32_t q[2] = {0, 0};
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const uint32_t lo = pd_fp8_quant1(pd_bf16_lo(u[i]), sc);
                    const uint32_t hi = pd_fp8_quant1(pd_bf16_hi(u[i]), sc);
                    q[i / 2] |= (lo | hi << 8) << (16 * (i % 2));
                }
                *reinterpret_cast<uint2 *>(xq + (int64_t)r * K + j) = make_uint2(q[0], q[1]);
            }
            if (lane == 0) xs[r * ng + g] = sc;
        }
    }
}

/* Grid (row tile, column tile). W [E * (SWIGLU ? 2M : M)][K] e4m3 with scales ws [..][ng]
 * (expert e's gate rows, then its up rows, from row 2Me with SWIGLU); out [choices][M] in the
 * grouped order. K % 16 == 0, group % 16 == 0, 16-byte aligned rows. */
template <bool SWIGLU, int RT, bool XQ>
static __global__ void __launch_bounds__(FM_WARPS * 32)
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
    for (int32_t c = lane; c < K16; c += 32) {
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
            float xf[16], sx = 1.0f;
            if (XQ) {
                pd_e4m3x16_f32(reinterpret_cast<const uint4 *>(xq + (size_t)r * K)[c], xf);
                sx = xs[r * ng + g];
            } else {
                const uint4 *p = reinterpret_cast<const uint4 *>(xb + (size_t)r * K + c * 16);
                const uint4 a = p[0], b = p[1];
                const uint32_t u[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    xf[2 * i] = pd_bf16_lo(u[i]);
                    xf[2 * i + 1] = pd_bf16_hi(u[i]);
                }
            }
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
#pragma unroll
    for (int r = 0; r < RT; r++) {
        if (r >= nr) break;
#pragma unroll
        for (int q = 0; q < NW; q++) acc[q][r] = pd_warp_sum(acc[q][r]);
        if (lane != 0) continue;
        bf16 *o = out + (size_t)(r0 + r) * M;
#pragma unroll
        for (int q = 0; q < FM_COLS(SWIGLU); q++) {
            if (!ok[q]) continue;
            if (SWIGLU)
                pd_st(o + i0 + q, pd_moe_swiglu_rounded(acc[q][r], acc[q + 2][r]));
            else
                pd_st(o + i0 + q, acc[q][r]);
        }
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
