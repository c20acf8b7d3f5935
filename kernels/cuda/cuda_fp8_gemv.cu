/* cuda_fp8_gemv.cu -- The FP8 weight op set's own product kernels: the small-n kernel of decode
 * steps (the weight streamed once, 16 e4m3 bytes a load, the fusions of linear_fused in its one
 * launch) and an any-shape tiled kernel, the fallback for the products cuBLASLt does not take
 * (odd shapes, scale modes it refuses). Both accumulate in f32 and apply the weight's scale per
 * group, and the input's per (row, group) when it is quantized. */
#include "kernels/cuda/cuda_fp8.cuh"

/* ---- small n ----
 * A decode step's product is bound by reading the weight (1 byte an element here). Each warp
 * streams GV_ROWS weight rows (4 output columns, or with SwiGLU the gate and up rows of 2),
 * each lane 16 bytes of each row a step, the next step's loads issued before this step's
 * arithmetic; x rows (codes, or bf16 for weight-only) are small and re-read from L1. The codes
 * are widened to f32 (cvt e4m3x2 -> f16x2 -> f32, exact) and each 16-element chunk's dot
 * product (a chunk never straddles a group: group is k or a multiple of 16) is added to the
 * accumulator times the chunk's weight scale and, when quantized, x's scale. The lanes' sums
 * are added across the warp, then bias, SwiGLU or the residual add, rounded once. */
#define GV_WARPS 4 /* warps a block */
#define GV_ROWS 4  /* weight rows a warp */

/* A 16-byte load of the weight, which is read once: not kept in L1 (x lives there). */
static __device__ __forceinline__ uint4 ld_stream16(const uint8_t *p)
{
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

/* 16 e4m3 codes (element 0 in the lowest byte) as f32. */
static __device__ __forceinline__ void cvt16(uint4 v, float (&f)[16])
{
    const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const __half2_raw hr = __nv_cvt_fp8x2_to_halfraw2(
                (__nv_fp8x2_storage_t)((u[i] >> (16 * h)) & 0xffffu), __NV_E4M3);
            const float2 f2 = __half22float2(__half2(hr));
            f[4 * i + 2 * h] = f2.x;
            f[4 * i + 2 * h + 1] = f2.y;
        }
    }
}

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
fp8_gemv_kernel(const uint8_t *__restrict__ w8, const float *__restrict__ wscale, int32_t k,
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
        cur[q] = ok[q] && lane < kc ? ld_stream16(w8 + wr[q] * k + lane * 16) : zero;
    for (int32_t c = lane; c < kc; c += 32) {
        uint4 nxt[GV_ROWS];
#pragma unroll
        for (int q = 0; q < GV_ROWS; q++)
            nxt[q] = ok[q] && c + 32 < kc ? ld_stream16(w8 + wr[q] * k + (c + 32) * 16) : zero;
        const int32_t g = (c * 16) / group;
        float wf[GV_ROWS][16], sw[GV_ROWS];
#pragma unroll
        for (int q = 0; q < GV_ROWS; q++) {
            cvt16(cur[q], wf[q]);
            sw[q] = ok[q] ? __ldg(wscale + wr[q] * ng + g) : 0.0f;
        }
#pragma unroll
        for (int r = 0; r < NR; r++) {
            if (r >= n) break; /* uniform over the warp */
            float xf[16], sx = 1.0f;
            if (XQ) {
                cvt16(__ldg(reinterpret_cast<const uint4 *>(xq + (int64_t)r * k) + c), xf);
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

bool pd_cuda__fp8_gemv_can(const pd_fp8_weight *w, const pd_fp8_input *in, int32_t n)
{
    const uintptr_t xp = in->xq ? (uintptr_t)in->xq : (uintptr_t)in->xb;
    return n >= 1 && n <= PD_FP8_GEMV_MAX_N && w->k % 16 == 0 && (w->group % 16 == 0 || w->ng == 1) &&
           ((xp | (uintptr_t)w->w8) & 15) == 0;
}

template <bool XQ>
static cudaError_t launch_gemv_t(const pd_fp8_weight *w, const pd_fp8_input *in,
                                 const bf16 *bias, bf16 *out, int32_t n, int32_t m, bool swiglu,
                                 bool accumulate, cudaStream_t stream)
{
    typedef void (*kfn)(const uint8_t *, const float *, int32_t, int32_t, int32_t,
                        const uint8_t *, const float *, const bf16 *, const bf16 *, bf16 *,
                        int32_t, int32_t, bool, bool);
    const kfn kernel = n <= 1 ? fp8_gemv_kernel<1, XQ>
                     : n <= 2 ? fp8_gemv_kernel<2, XQ>
                     : n <= 4 ? fp8_gemv_kernel<4, XQ>
                              : fp8_gemv_kernel<8, XQ>;
    const int64_t warps = (m + (swiglu ? 2 : GV_ROWS) - 1) / (swiglu ? 2 : GV_ROWS);
    const unsigned blocks = (unsigned)((warps + GV_WARPS - 1) / GV_WARPS);
    kernel<<<blocks, GV_WARPS * 32, 0, stream>>>(w->w8, w->scale, w->k, w->group, w->ng, in->xq,
                                                 in->xs, in->xb, bias, out, n, m, swiglu,
                                                 accumulate);
    return cudaGetLastError();
}

cudaError_t pd_cuda__fp8_launch_gemv(const pd_fp8_weight *w, const pd_fp8_input *in,
                                     const bf16 *bias, bf16 *out, int32_t n, int32_t m,
                                     bool swiglu, bool accumulate, cudaStream_t stream)
{
    return in->xq ? launch_gemv_t<true>(w, in, bias, out, n, m, swiglu, accumulate, stream)
                  : launch_gemv_t<false>(w, in, bias, out, n, m, swiglu, accumulate, stream);
}

/* ---- any shape ----
 * 32 x 32 output tiles, 256 threads (4 outputs each), 32 columns of k a step through shared
 * memory, both operands as f32 values (code times its scale), so any group and any k work. */
#define TS 32

static __device__ __forceinline__ float e4m3_val(uint8_t b)
{
    return __half2float(__half(__nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)b, __NV_E4M3)));
}

static __global__ void __launch_bounds__(256)
fp8_tile_kernel(const uint8_t *__restrict__ w8, const float *__restrict__ wscale, int32_t k,
                int32_t group, int32_t ng, int32_t m, const uint8_t *__restrict__ xq,
                const float *__restrict__ xs, const bf16 *__restrict__ xb,
                const bf16 *__restrict__ bias, bf16 *__restrict__ out, int32_t n,
                bool accumulate)
{
    __shared__ float xt[TS][TS + 1], wt[TS][TS + 1];
    const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
    const int64_t r0 = (int64_t)blockIdx.y * TS, j0 = (int64_t)blockIdx.x * TS;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int32_t k0 = 0; k0 < k; k0 += TS) {
        const int32_t kk = k0 + tx, g = kk / group;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int row = ty + 8 * i;
            const int64_t r = r0 + row, j = j0 + row;
            float xv = 0.0f, wv = 0.0f;
            if (r < n && kk < k)
                xv = xq ? e4m3_val(xq[r * k + kk]) * xs[(int64_t)g * n + r] : pd_ld(xb + r * k + kk);
            if (j < m && kk < k) wv = e4m3_val(w8[j * k + kk]) * wscale[j * ng + g];
            xt[row][tx] = xv;
            wt[row][tx] = wv;
        }
        __syncthreads();
#pragma unroll 8
        for (int e = 0; e < TS; e++) {
            const float wv = wt[tx][e];
#pragma unroll
            for (int i = 0; i < 4; i++) acc[i] = fmaf(xt[ty + 8 * i][e], wv, acc[i]);
        }
        __syncthreads();
    }
    const int64_t j = j0 + tx;
    if (j >= m) return;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int64_t r = r0 + ty + 8 * i;
        if (r >= n) continue;
        float v = acc[i] + (bias ? pd_ld(bias + j) : 0.0f);
        bf16 *o = out + r * m + j;
        if (accumulate) v += pd_ld(o);
        pd_st(o, v);
    }
}

cudaError_t pd_cuda__fp8_launch_tile(const pd_fp8_weight *w, const pd_fp8_input *in,
                                     const bf16 *bias, bf16 *out, int32_t n, bool accumulate,
                                     cudaStream_t stream)
{
    if ((n + TS - 1) / TS > 65535) return cudaErrorInvalidConfiguration;
    const dim3 grid((unsigned)((w->m + TS - 1) / TS), (unsigned)((n + TS - 1) / TS));
    fp8_tile_kernel<<<grid, 256, 0, stream>>>(w->w8, w->scale, w->k, w->group, w->ng, w->m,
                                              in->xq, in->xs, in->xb, bias, out, n, accumulate);
    return cudaGetLastError();
}
