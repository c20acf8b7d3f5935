/* cuda_fp8_gemv_rows.cu -- The FP8 op set's product for one or two input rows (batch-1 and 2
 * decode steps): a warp streams 4 whole weight rows, 16 e4m3 bytes a lane a step (the next
 * step's loads issued before this step's arithmetic), codes widened to f32, each 16-element
 * chunk's dot product times its group's weight and input scales, the lanes' sums added across
 * the warp; bias, residual add and SwiGLU in the same launch. It reads Llama-3-8B's products
 * faster at n = 1 than the k-split tensor-core kernel of cuda_fp8_gemv.cu, which takes n >= 3
 * (docs/perf-history.md, the FP8 weights and KV cache of issue #37). Needs what
 * pd_cuda__fp8_gemv_can says (k % 16 == 0, a group of k or a multiple of 128, aligned rows). */
#include "kernels/cuda/cuda_fp8.cuh"

#define GV_WARPS 4 /* warps a block */
#define GV_ROWS 4  /* weight rows a warp */
/* NR: rows of x the kernel holds (n <= NR); XQ: x is codes xq with scales xs ([ng][n]), else
 * bf16 xb. Grid: one warp per GV_ROWS weight rows, GV_WARPS warps a block. */

/* 16 bf16 (two 16-byte loads) as f32. */
static __device__ __forceinline__ void bf16x16(const bf16 *p, float (&f)[16])
{
    const uint4 a = __ldg(reinterpret_cast<const uint4 *>(p));
    const uint4 b = __ldg(reinterpret_cast<const uint4 *>(p) + 1);
    const uint32_t u[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
    for (int i = 0; i < 8; i++) {
        f[2 * i] = pd_bf16_lo(u[i]);
        f[2 * i + 1] = pd_bf16_hi(u[i]);
    }
}

/* NR: rows of x the kernel holds (n <= NR); XQ: x is codes xq with scales xs ([ng][n]), else
 * bf16 xb. Grid: one warp per GV_ROWS weight rows, GV_WARPS warps a block. */
template <int NR, bool XQ>
static __global__ void __launch_bounds__(GV_WARPS * 32)
fp8_gemv_rows_kernel(const uint8_t *__restrict__ w8, const float *__restrict__ wscale, int32_t k,
                int32_t group, int32_t ng, const uint8_t *__restrict__ xq,
                const float *__restrict__ xs, const bf16 *__restrict__ xb,
                const bf16 *__restrict__ bias, bf16 *__restrict__ out, int32_t n, int32_t m,
                bool swiglu, bool accumulate)
{
    const int lane = threadIdx.x & 31;
    const int64_t wid = (int64_t)blockIdx.x * GV_WARPS + (threadIdx.x >> 5);
    const int cols = swiglu ? 2 : GV_ROWS;
    const int64_t j0 = wid * cols;
    if (j0 >= m) return; /* the whole warp */
    int64_t wr[GV_ROWS];
    bool ok[GV_ROWS];
#pragma unroll
    for (int q = 0; q < GV_ROWS; q++) {
        const int64_t j = swiglu ? j0 + (q & 1) : j0 + q;
        ok[q] = j < m;
        wr[q] = ok[q] ? (swiglu && q >= 2 ? m + j : j) : 0;
    }
    const int32_t kc = k >> 4;
    const uint4 zero = make_uint4(0, 0, 0, 0);
    float acc[GV_ROWS][NR];
#pragma unroll
    for (int q = 0; q < GV_ROWS; q++)
#pragma unroll
        for (int r = 0; r < NR; r++) acc[q][r] = 0.0f;

    uint4 cur[GV_ROWS];
#pragma unroll
    for (int q = 0; q < GV_ROWS; q++)
        cur[q] = ok[q] && lane < kc ? pd_fp8_ld_stream16(w8 + wr[q] * k + lane * 16) : zero;
    for (int32_t c = lane; c < kc; c += 32) {
        uint4 nxt[GV_ROWS];
#pragma unroll
        for (int q = 0; q < GV_ROWS; q++)
            nxt[q] = ok[q] && c + 32 < kc ? pd_fp8_ld_stream16(w8 + wr[q] * k + (c + 32) * 16)
                                          : zero;
        const int32_t g = (c * 16) / group;
        float wf[GV_ROWS][16], sw[GV_ROWS];
#pragma unroll
        for (int q = 0; q < GV_ROWS; q++) {
            pd_e4m3x16_f32(cur[q], wf[q]);
            sw[q] = ok[q] ? __ldg(wscale + wr[q] * ng + g) : 0.0f;
        }
#pragma unroll
        for (int r = 0; r < NR; r++) {
            if (r >= n) break; /* uniform over the warp */
            float xf[16], sx = 1.0f;
            if (XQ) {
                pd_e4m3x16_f32(__ldg(reinterpret_cast<const uint4 *>(xq + (int64_t)r * k) + c), xf);
                sx = __ldg(xs + (int64_t)g * n + r);
            } else {
                bf16x16(xb + (int64_t)r * k + c * 16, xf);
            }
#pragma unroll
            for (int q = 0; q < GV_ROWS; q++) {
                float d = 0.0f;
#pragma unroll
                for (int e = 0; e < 16; e++) d = fmaf(wf[q][e], xf[e], d);
                acc[q][r] = fmaf(d, sw[q] * sx, acc[q][r]);
            }
        }
#pragma unroll
        for (int q = 0; q < GV_ROWS; q++) cur[q] = nxt[q];
    }
#pragma unroll
    for (int q = 0; q < GV_ROWS; q++)
#pragma unroll
        for (int r = 0; r < NR; r++) acc[q][r] = pd_warp_sum(acc[q][r]);
    if (lane != 0) return;
#pragma unroll
    for (int r = 0; r < NR; r++) {
        if (r >= n) break;
        bf16 *o = out + (int64_t)r * m;
        if (swiglu) {
#pragma unroll
            for (int q = 0; q < 2; q++) {
                const int64_t j = j0 + q;
                if (j >= m) continue;
                /* the composed path's roundings: gate and up products in bf16 first */
                float gt = acc[q][r] + (bias ? pd_ld(bias + j) : 0.0f);
                float up = acc[q + 2][r] + (bias ? pd_ld(bias + m + j) : 0.0f);
                gt = __bfloat162float(__float2bfloat16_rn(gt));
                up = __bfloat162float(__float2bfloat16_rn(up));
                pd_st(o + j, gt / (1.0f + expf(-gt)) * up);
            }
        } else {
#pragma unroll
            for (int q = 0; q < GV_ROWS; q++) {
                const int64_t j = j0 + q;
                if (j >= m) continue;
                float v = acc[q][r] + (bias ? pd_ld(bias + j) : 0.0f);
                if (accumulate) v += pd_ld(o + j);
                pd_st(o + j, v);
            }
        }
    }
}

template <bool XQ>
static cudaError_t launch_gemv_rows_t(const pd_fp8_weight *w, const pd_fp8_input *in,
                                      const bf16 *bias, bf16 *out, int32_t n, int32_t m,
                                      bool swiglu, bool accumulate, cudaStream_t stream)
{
    typedef void (*kfn)(const uint8_t *, const float *, int32_t, int32_t, int32_t,
                        const uint8_t *, const float *, const bf16 *, const bf16 *, bf16 *,
                        int32_t, int32_t, bool, bool);
    if (n > PD_FP8_GEMV_ROWS_MAX_N) return cudaErrorInvalidValue;
    const kfn kernel = n <= 1 ? fp8_gemv_rows_kernel<1, XQ> : fp8_gemv_rows_kernel<2, XQ>;
    const int64_t warps = (m + (swiglu ? 2 : GV_ROWS) - 1) / (swiglu ? 2 : GV_ROWS);
    const unsigned blocks = (unsigned)((warps + GV_WARPS - 1) / GV_WARPS);
    kernel<<<blocks, GV_WARPS * 32, 0, stream>>>(w->w8, w->scale, w->k, w->group, w->ng, in->xq,
                                                 in->xs, in->xb, bias, out, n, m, swiglu,
                                                 accumulate);
    return cudaGetLastError();
}

cudaError_t pd_cuda__fp8_launch_gemv_rows(const pd_fp8_weight *w, const pd_fp8_input *in,
                                          const bf16 *bias, bf16 *out, int32_t n, int32_t m,
                                          bool swiglu, bool accumulate, cudaStream_t stream)
{
    return in->xq ? launch_gemv_rows_t<true>(w, in, bias, out, n, m, swiglu, accumulate, stream)
                  : launch_gemv_rows_t<false>(w, in, bias, out, n, m, swiglu, accumulate, stream);
}

