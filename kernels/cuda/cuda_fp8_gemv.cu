/* cuda_fp8_gemv.cu -- The FP8 weight op set's own product kernels: the small-n kernel of decode
 * steps (the weight streamed once in 16-byte loads, the products on the tensor cores, the
 * fusions of linear_fused in its one launch) and an any-shape tiled kernel, the fallback for the
 * products cuBLASLt does not take (odd shapes, scale modes it refuses). Both accumulate in f32
 * and apply the weight's scale per group, and the input's per (row, group) when it is
 * quantized. */
#include "kernels/cuda/cuda_fp8.cuh"

/* ---- small n ----
 * A decode step's product is bound by reading the weight (1 byte an element here, plus 4 bytes
 * of scale per row and group). The kernel follows cuda_linear.cu's gemv_kernel: a block per 8
 * weight rows (the n8 of an mma; with SwiGLU the gate and up rows of 4 output columns), its
 * warps splitting k into contiguous ranges, each lane keeping U 16-byte streaming loads of its
 * weight row in flight, the products on the tensor cores with the x rows as the A operand (row
 * g of x in lane group g, the upper 8 rows zero: n <= 8), the warps' partial sums added in warp
 * order through shared memory, then the scales (per channel), bias, SwiGLU or the residual add,
 * rounded once. Lane (g = lane / 4, t = lane % 4) loads 16 consecutive k of weight row g and
 * of x row g; a dot product does not care in which order k is summed as long as both operands
 * agree, so these fill the fragment slots that A and B give the lane. A warp step covers 64 k
 * of 8 rows (512 weight bytes).
 *   Quantized x (codes): the FP8 mma (m16n8k32, e4m3 x e4m3, f32 accumulation) takes both
 * codes as they are, two mmas a step.
 *   Weight-only (bf16 x): the codes are widened to bf16 in registers (exact: cvt e4m3x2 ->
 * f16x2, the f16 bits moved into a bf16's fields, which leaves every value times 2^-112 and
 * normal, then one exact bf16 multiply by 2^112), four m16n8k16 bf16 mmas a step.
 * The mma sums are moved into f32 accumulators every pair of steps (128 k): with group 128 (or
 * any multiple of 128) times that group's weight scale x x's scale, per channel as they are
 * (the scales once at the end); it also bounds what the tensor core adds in its own
 * accumulator. The k split depends on k alone, and a row's sums on that row alone, so every
 * bit of a result is the same whatever n is and from run to run (no atomics). */
#define GV_ROWS 8            /* weight rows a block: the n8 of the mma */
#define GV_UNROLL 8          /* steps (64 k each) whose weight loads a lane issues at once;
                              * weight-only: twice that where a warp has more steps (k = 14336:
                              * two rounds of latency, not four) */
#define GV_STEPS_PER_WARP 8  /* at least this many steps a warp before k is split further */
#define GV_MAX_WARPS 8       /* warps splitting k in a block */
#define GV_PAIR_K 128        /* k between the moves into the f32 accumulators (two steps) */

/* A 16-byte load of the weight, which is read once: not kept in L1 (x lives there); the L2
 * fetches the rest of the 256-byte segment that the next steps of the same row read. */
static __device__ __forceinline__ uint4 ld_stream16(const void *p)
{
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

/* d += A . B, A 16x32 e4m3 with rows 8-15 zero (row g's k 4t..4t+3 in a0, 16+4t.. in a2), B
 * 32x8 e4m3 (column g's same k in b0, b1). */
static __device__ __forceinline__ void mma_e4m3(float (&d)[4], uint32_t a0, uint32_t a2,
                                                uint32_t b0, uint32_t b1)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    asm("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));
#else
    (void)d; (void)a0; (void)a2; (void)b0; (void)b1;
    __trap(); /* below 8.9 the kernel widens the codes instead (fp8_gemv_step) */
#endif
}

/* Four e4m3 codes (one 32-bit word, element 0 in the lowest byte) as two bf16x2 words
 * (elements 0, 1 and 2, 3, the lower element in the lower half), exactly. e4m3 -> f16 is
 * exact and lands on normal f16 values (2^-9 .. 448); the f16 exponent and top mantissa bits
 * shifted into a bf16's fields give the value times 2^(15 - 127), a normal bf16 (zero stays
 * zero), which the multiply by 2^112 puts back. */
static __device__ __forceinline__ void e4m3x4_bf16(uint32_t u, uint32_t &lo, uint32_t &hi)
{
    uint32_t h0, h1;
    asm("{\n.reg .b16 l, u;\nmov.b32 {l, u}, %2;\ncvt.rn.f16x2.e4m3x2 %0, l;\n"
        "cvt.rn.f16x2.e4m3x2 %1, u;\n}"
        : "=r"(h0), "=r"(h1)
        : "r"(u));
    const uint32_t b0 = ((h0 >> 3) & 0x0fff0fffu) | (h0 & 0x80008000u);
    const uint32_t b1 = ((h1 >> 3) & 0x0fff0fffu) | (h1 & 0x80008000u);
    const __nv_bfloat162 s = __halves2bfloat162(__ushort_as_bfloat16((unsigned short)0x7780u),
                                                __ushort_as_bfloat16((unsigned short)0x7780u));
    __nv_bfloat162 v0 = *reinterpret_cast<const __nv_bfloat162 *>(&b0);
    __nv_bfloat162 v1 = *reinterpret_cast<const __nv_bfloat162 *>(&b1);
    v0 = __hmul2(v0, s);
    v1 = __hmul2(v1, s);
    lo = *reinterpret_cast<const uint32_t *>(&v0);
    hi = *reinterpret_cast<const uint32_t *>(&v1);
}

/* One step of a lane: its 16 weight codes wv times x row g's 16 elements at chunk c, into d.
 * XQ: xrow is the row's codes; else its bf16 elements. */
template <bool XQ>
static __device__ __forceinline__ void fp8_gemv_step(float (&d)[4], uint4 wv, const uint4 *xrow,
                                                     int32_t c, bool x_ok)
{
    const uint4 zero = make_uint4(0, 0, 0, 0);
    if (XQ) {
        const uint4 xv = x_ok ? __ldg(xrow + c) : zero;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
        mma_e4m3(d, xv.x, xv.y, wv.x, wv.y);
        mma_e4m3(d, xv.z, xv.w, wv.z, wv.w);
#else
        const uint32_t xw[4] = {xv.x, xv.y, xv.z, xv.w}, ww[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            uint32_t x0, x1, w0, w1;
            e4m3x4_bf16(xw[i], x0, x1);
            e4m3x4_bf16(ww[i], w0, w1);
            mma_bf16(d, x0, 0u, x1, 0u, w0, w1);
        }
#endif
    } else {
        const uint4 xa = x_ok ? __ldg(xrow + 2 * c) : zero;
        const uint4 xb = x_ok ? __ldg(xrow + 2 * c + 1) : zero;
        const uint32_t xw[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
        const uint32_t ww[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            uint32_t w0, w1;
            e4m3x4_bf16(ww[i], w0, w1);
            mma_bf16(d, xw[2 * i], 0u, xw[2 * i + 1], 0u, w0, w1);
        }
    }
}

/* XQ: x is codes xq with scales xs ([ng][n]), else bf16 xb; U: steps a lane loads at once.
 * Block: blockDim.x / 32 warps over k, steps_per_warp steps each (even: a pair of steps never
 * straddles a group); grid: one block per GV_ROWS weight rows (4 output columns with SwiGLU).
 * group is k's (ng == 1: per channel) or a multiple of GV_PAIR_K; k % 16 == 0, w8 and x
 * 16-byte aligned (the host checks). With PDL the block loads its first weights and their
 * scales before it waits for the previous kernel (they never depend on it). */
template <bool XQ, int U>
static __global__ void __launch_bounds__(GV_MAX_WARPS * 32, 2)
fp8_gemv_kernel(const uint8_t *__restrict__ w8, const float *__restrict__ wscale, int32_t k,
                int32_t group, int32_t ng, const uint8_t *__restrict__ xq,
                const float *__restrict__ xs, const bf16 *__restrict__ xb,
                const bf16 *__restrict__ bias, bf16 *__restrict__ out, int32_t n, int32_t m,
                int32_t steps_per_warp, bool swiglu, bool accumulate)
{
    constexpr int P = U / 2; /* pairs of steps a load round */
    __shared__ float part[GV_MAX_WARPS][2][32];
    __shared__ float res[8][GV_ROWS + 1];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const bool grouped = ng > 1;
    /* weight row of lane group g: 8 consecutive rows, or gate / up rows of 4 columns */
    const int64_t col0 = swiglu ? (int64_t)blockIdx.x * 4 : (int64_t)blockIdx.x * GV_ROWS;
    const int64_t wr = swiglu ? (g & 4 ? m : 0) + col0 + (g & 3) : col0 + g;
    const bool w_ok = (swiglu ? col0 + (g & 3) : wr) < m;
    /* the weight rows of the lane's sums d[0], d[1]: the block's rows 2t, 2t + 1 */
    int64_t srow[2];
    bool s_ok[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int jj = 2 * t + i;
        const int64_t c = swiglu ? col0 + (jj & 3) : col0 + jj;
        s_ok[i] = c < m;
        srow[i] = s_ok[i] ? (swiglu ? (jj & 4 ? m : 0) + c : c) * (int64_t)ng : 0;
    }
    const int32_t kc = k >> 4; /* 16-byte chunks of a weight row */
    const int32_t steps = (kc + 3) >> 2;
    const int32_t s_begin = warp * steps_per_warp;
    const int32_t s_end = min(s_begin + steps_per_warp, steps);
    const uint4 *wrow = reinterpret_cast<const uint4 *>(w8 + (w_ok ? wr : 0) * (int64_t)k);
    const uint4 zero = make_uint4(0, 0, 0, 0);

    uint4 wv[U];
    float ws[P][2], xsc[P];
    auto load_w = [&](int32_t s0) {
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int32_t c = (s0 + u) * 4 + t;
            wv[u] = (w_ok && s0 + u < s_end && c < kc) ? ld_stream16(wrow + c) : zero;
        }
        if (grouped) {
#pragma unroll
            for (int p = 0; p < P; p++) {
                const int32_t s = s0 + 2 * p, gi = s * 64 / group;
#pragma unroll
                for (int i = 0; i < 2; i++)
                    ws[p][i] = s_ok[i] && s < s_end ? __ldg(wscale + srow[i] + gi) : 0.0f;
            }
        }
    };
    /* x's scales of the pairs' groups (after the wait: the previous kernel writes them) */
    auto load_xs = [&](int32_t s0) {
#pragma unroll
        for (int p = 0; p < P; p++) {
            const int32_t s = s0 + 2 * p, gi = s * 64 / group;
            xsc[p] = XQ && grouped && g < n && s < s_end ? __ldg(xs + (int64_t)gi * n + g) : 1.0f;
        }
    };
    load_w(s_begin);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    pd_pdl_wait();

    const bool x_ok = g < n;
    const uint4 *xrow = XQ ? reinterpret_cast<const uint4 *>(xq + (x_ok ? g : 0) * (int64_t)k)
                           : reinterpret_cast<const uint4 *>(xb + (x_ok ? g : 0) * (int64_t)k);
    float acc[2] = {0.0f, 0.0f};
    for (int32_t s0 = s_begin; s0 < s_end; s0 += U) {
        if (s0 != s_begin) load_w(s0);
        load_xs(s0);
#pragma unroll
        for (int p = 0; p < P; p++) {
            if (s0 + 2 * p >= s_end) break; /* uniform over the warp, as mma.sync needs */
            float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int32_t c = (s0 + 2 * p + h) * 4 + t;
                fp8_gemv_step<XQ>(d, wv[2 * p + h], xrow, c, x_ok && c < kc);
            }
            if (grouped) {
                acc[0] = fmaf(d[0], ws[p][0] * xsc[p], acc[0]);
                acc[1] = fmaf(d[1], ws[p][1] * xsc[p], acc[1]);
            } else {
                acc[0] += d[0];
                acc[1] += d[1];
            }
        }
    }

    part[warp][0][lane] = acc[0];
    part[warp][1][lane] = acc[1];
    __syncthreads();
    /* Slot i of lane l is x row l / 4 and the block's weight row 2 (l % 4) + i; the warps'
     * partial sums are added in warp order, then the per-channel scales and the bias. */
    for (int e = threadIdx.x; e < 64; e += blockDim.x) {
        const int i = e >> 5, l = e & 31;
        const int r = l >> 2, jj = 2 * (l & 3) + i;
        float v = part[0][i][l];
        for (int q = 1; q < n_warps; q++) v += part[q][i][l];
        const int64_t c = swiglu ? col0 + (jj & 3) : col0 + jj;
        const int64_t j = swiglu ? (jj & 4 ? m : 0) + c : c;
        if (r < n && c < m) {
            if (!grouped) v *= __ldg(wscale + j) * (XQ ? __ldg(xs + r) : 1.0f);
            if (bias) v += pd_ld(bias + j);
        }
        res[r][jj] = v;
    }
    __syncthreads();
    const int n_cols = swiglu ? 4 : GV_ROWS;
    for (int e = threadIdx.x; e < 8 * n_cols; e += blockDim.x) {
        const int32_t r = e / n_cols;
        const int c = e % n_cols;
        const int64_t j = col0 + c;
        if (r >= n || j >= m) continue;
        float v = res[r][c];
        if (swiglu) {
            /* the composed path's roundings: gate and up products in bf16 first */
            const float gt = __bfloat162float(__float2bfloat16_rn(v));
            const float up = __bfloat162float(__float2bfloat16_rn(res[r][c + 4]));
            v = gt / (1.0f + expf(-gt)) * up;
        }
        bf16 *o = out + (int64_t)r * m + j;
        if (accumulate) v += pd_ld(o);
        pd_st(o, v);
    }
}

bool pd_cuda__fp8_gemv_can(const pd_cuda_ctx *c, const pd_fp8_weight *w,
                           const pd_fp8_input *in, int32_t n)
{
    const uintptr_t xp = in->xq ? (uintptr_t)in->xq : (uintptr_t)in->xb;
    return n >= 1 && n <= PD_FP8_GEMV_MAX_N && c->cc_major >= 8 && w->k % 16 == 0 &&
           (w->ng == 1 || w->group % GV_PAIR_K == 0) && ((xp | (uintptr_t)w->w8) & 15) == 0;
}

template <bool XQ>
static cudaError_t launch_gemv_t(const pd_fp8_weight *w, const pd_fp8_input *in,
                                 const bf16 *bias, bf16 *out, int32_t n, int32_t m, bool swiglu,
                                 bool accumulate, cudaStream_t stream)
{
    /* Warps over k: enough steps each to keep GV_UNROLL loads in flight, up to GV_MAX_WARPS
     * (small m gets its parallelism from k), an even count each (pairs of steps). From k
     * alone: see the batch invariance above. */
    const int32_t steps = (w->k / 16 + 3) / 4;
    int32_t warps = steps / GV_STEPS_PER_WARP;
    if (warps < 1) warps = 1;
    if (warps > GV_MAX_WARPS) warps = GV_MAX_WARPS;
    int32_t per_warp = (steps + warps - 1) / warps;
    per_warp += per_warp & 1;
    const int32_t cols = swiglu ? 4 : GV_ROWS;
    const unsigned blocks = (unsigned)((m + cols - 1) / cols);
    typedef void (*kfn)(const uint8_t *, const float *, int32_t, int32_t, int32_t,
                        const uint8_t *, const float *, const bf16 *, const bf16 *, bf16 *,
                        int32_t, int32_t, int32_t, bool, bool);
    kfn kernel = fp8_gemv_kernel<XQ, GV_UNROLL>;
    if constexpr (!XQ) { /* 16 steps of codes and x's elements would spill with XQ */
        if (per_warp > GV_UNROLL) kernel = fp8_gemv_kernel<XQ, 2 * GV_UNROLL>;
    }
    return pd_cuda__launch(kernel, dim3(blocks), dim3((unsigned)warps * 32), 0, stream, w->w8,
                           w->scale, w->k, w->group, w->ng, in->xq, in->xs, in->xb, bias, out,
                           n, m, per_warp, swiglu, accumulate);
}

cudaError_t pd_cuda__fp8_launch_gemv(const pd_fp8_weight *w, const pd_fp8_input *in,
                                     const bf16 *bias, bf16 *out, int32_t n, int32_t m,
                                     bool swiglu, bool accumulate, cudaStream_t stream)
{
    if (n <= PD_FP8_GEMV_ROWS_MAX_N) /* one or two rows: the whole-row kernel is faster */
        return pd_cuda__fp8_launch_gemv_rows(w, in, bias, out, n, m, swiglu, accumulate, stream);
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
