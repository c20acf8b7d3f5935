/* cuda_linear.cu -- linear: out[n][m] = x[n][k] . w[m][k]^T (+ bias[m]), bf16 operands, fp32
 * accumulation, bf16 result; and linear_fused, the same with the input RMSNorm, SwiGLU or the
 * residual add around it (kernels/backend.h). Small n goes to a weight-streaming kernel below
 * that also does the fusions in its one launch (see gemv_takes / gemv_fused_takes for which
 * products), everything else to cuBLAS, with the fusions as launches of their own.
 * PDSERVE_CUDA_GEMV_MAX_N=N moves the crossover in n (0 = always cuBLAS, for A/B runs; at most
 * GEMV_MAX_N). */
#include <stdlib.h>

#include "kernels/cuda/cuda_common.cuh"

/* ---- small n: weight streaming on the tensor cores ----
 * At n <= 32 a product is bound by reading the weights (2 m k bytes against n m k
 * multiply-adds). This kernel streams every weight byte once with 16-byte loads, several in
 * flight per lane, in one launch (where cuBLAS splits k of an m = 1024 product over two), and
 * uses each for all n rows of x, which are re-read from L1 (they are small and every block
 * reads them).
 *
 * The arithmetic is mma.m16n8k16 (bf16 in, fp32 accumulate) with x as the 16-row A operand and
 * 8 weight rows as the B operand, so a block owns 8 output columns and the tensor core does
 * the n rows at once (CUDA cores would need 8 n fp32 FMAs per 16-byte load: compute-bound from
 * n of about 8 on). A dot product does not care in which order k is summed, as long as A and B
 * agree on it: lane (g = lane / 4, t = lane % 4) loads 8 consecutive k of weight row g and of x
 * rows g and g + 8 (16 bytes each) and feeds the first 4 to one mma and the last 4 to a
 * second, in the fragment slots k = 2t, 2t+1, 2t+8, 2t+9 that both operands give this lane. A
 * warp step so covers 32 k of 8 weight rows (512 bytes). The warps of a block split k into
 * contiguous ranges and their partial sums are added in warp order through shared memory, then
 * the bias, in fp32, rounded once. The k split depends on k alone, so the summation order, and
 * with it every bit of a row's result, is the same whatever n is (batch-invariant) and from run
 * to run (no atomics). */

#define GEMV_ROWS 8          /* weight rows (output columns) per block: the n8 of the mma */
#define GEMV_UNROLL 8        /* steps (32 k each) whose weight loads a lane issues at once;
                              * twice that where a warp has more steps and n <= 16 (k = 3072:
                              * one round of latency, not two; more registers, so only then) */
#define GEMV_STEPS_PER_WARP 8 /* at least this many steps per warp before k is split further */
#define GEMV_MAX_WARPS 8     /* warps splitting k in a block */
#define GEMV_MAX_N 32        /* rows of x the kernels take (two 16-row A tiles) */
/* The crossover in n to cuBLAS, 32 (docs/perf-history.md, "Kernel benchmarks"), is
 * PDSERVE_CUDA_GEMV_MAX_N's default in common/env.c. */
#define GEMV_MAX_M 2048      /* products the kernel takes: m <= this and weights <=
                              * PDSERVE_CUDA_GEMV_MAX_MB (see gemv_takes) */

/* A 16-byte load of streamed data: read once, so not kept in L1 (where x lives); the L2 fetches
 * the rest of the 256-byte segment that the next steps of the same row read. */
static __device__ __forceinline__ uint4 ld_stream(const uint4 *p)
{
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

/* What a GEMV launch fuses (pd_linear_args): the input RMSNorm's weights (the kernel multiplies
 * x by them on the way in and scales each row's sums by 1 / rms at the end: rms is a sum over
 * k, which the block's lanes cover once between them), SwiGLU (a block takes 4 gate rows and
 * the 4 up rows of the same columns), the residual add. */
struct gemv_fuse {
    const bf16 *norm_w; /* [k] or NULL */
    float norm_eps;
    bool swiglu;        /* w is [2m][k]: gate rows, then up rows */
    bool accumulate;    /* out += */
};

/* 8 bf16 times 8 bf16, each product rounded to bf16 (x times the norm weight, as the composed
 * path's normalised row is rounded, before the 1 / rms that moves to the end). */
static __device__ __forceinline__ uint4 mul8(uint4 a, uint4 b)
{
    uint4 r;
    const __nv_bfloat162 *pa = reinterpret_cast<const __nv_bfloat162 *>(&a);
    const __nv_bfloat162 *pb = reinterpret_cast<const __nv_bfloat162 *>(&b);
    __nv_bfloat162 *pr = reinterpret_cast<__nv_bfloat162 *>(&r);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float2 fa = __bfloat1622float2(pa[i]), fb = __bfloat1622float2(pb[i]);
        pr[i] = __floats2bfloat162_rn(fa.x * fb.x, fa.y * fb.y);
    }
    return r;
}

/* NG = groups of 8 x rows the kernel holds: 1 (n <= 8), 2 (n <= 16) or 4 (n <= 32); NORM: the
 * input norm is fused. Block: blockDim.x / 32 warps over k, steps_per_warp steps of 32 k each;
 * grid: one block per GEMV_ROWS weight rows (with SwiGLU per 4 output columns). x and w are
 * 16-byte aligned and k % 8 == 0 (the host checks). With PDL the block loads its first weights
 * before it waits for the previous kernel (weights never depend on it). */
template <int NG, bool NORM, int U>
static __global__ void __launch_bounds__(GEMV_MAX_WARPS * 32, 2)
gemv_kernel(const bf16 *__restrict__ x, const bf16 *__restrict__ w,
            const bf16 *__restrict__ bias, bf16 *__restrict__ out, int32_t n, int32_t k,
            int32_t m, int32_t steps_per_warp, gemv_fuse fz)
{
    constexpr int NA = (NG + 1) / 2; /* 16-row A tiles */
    /* [warp][tile][fragment slot][lane]: a warp's stores of one slot hit 32 banks */
    __shared__ float part[GEMV_MAX_WARPS][NA][4][32];
    __shared__ float ssq[GEMV_MAX_WARPS][NG * 8];
    __shared__ float res[NA * 16][GEMV_ROWS + 1];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    /* weight row of lane group g: 8 consecutive rows, or gate / up rows of 4 columns */
    const int64_t col0 = fz.swiglu ? (int64_t)blockIdx.x * 4 : (int64_t)blockIdx.x * GEMV_ROWS;
    const int64_t wr = fz.swiglu ? (g & 4 ? m : 0) + col0 + (g & 3) : col0 + g;
    const bool w_ok = (fz.swiglu ? col0 + (g & 3) : wr) < m;
    const int32_t kc = k >> 3;                   /* 16-byte chunks per row */
    const int32_t steps = (kc + 3) >> 2;
    const int32_t s_begin = warp * steps_per_warp;
    const int32_t s_end = min(s_begin + steps_per_warp, steps);
    const uint4 *wrow = reinterpret_cast<const uint4 *>(w + (w_ok ? wr : 0) * (int64_t)k);
    const uint4 *nw = reinterpret_cast<const uint4 *>(fz.norm_w);
    const uint4 zero = make_uint4(0, 0, 0, 0);

    uint4 wv[U];
    auto load_w = [&](int32_t s0) {
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int32_t c = (s0 + u) * 4 + t;
            wv[u] = (w_ok && s0 + u < s_end && c < kc) ? ld_stream(wrow + c) : zero;
        }
    };
    load_w(s_begin);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    pd_pdl_wait();

    const uint4 *xrow[NG];
    bool x_ok[NG];
#pragma unroll
    for (int q = 0; q < NG; q++) {
        const int r = 8 * q + g;
        x_ok[q] = r < n;
        xrow[q] = reinterpret_cast<const uint4 *>(x + (x_ok[q] ? r : 0) * (int64_t)k);
    }
    float acc[NA][4], ss[NG];
#pragma unroll
    for (int a = 0; a < NA; a++)
        for (int i = 0; i < 4; i++) acc[a][i] = 0.0f;
#pragma unroll
    for (int q = 0; q < NG; q++) ss[q] = 0.0f;

    for (int32_t s0 = s_begin; s0 < s_end; s0 += U) {
        if (s0 != s_begin) load_w(s0);
#pragma unroll
        for (int u = 0; u < U; u++) {
            if (s0 + u >= s_end) break; /* uniform over the warp, as mma.sync needs */
            const int32_t c = (s0 + u) * 4 + t;
            uint4 xv[NG];
#pragma unroll
            for (int q = 0; q < NG; q++) xv[q] = (x_ok[q] && c < kc) ? __ldg(xrow[q] + c) : zero;
            if (NORM) {
                const uint4 nv = c < kc ? __ldg(nw + c) : zero;
#pragma unroll
                for (int q = 0; q < NG; q++) {
                    ss[q] += pd_sumsq8(xv[q]);
                    xv[q] = mul8(xv[q], nv);
                }
            }
#pragma unroll
            for (int a = 0; a < NA; a++) {
                const uint4 lo = xv[2 * a], hi = 2 * a + 1 < NG ? xv[2 * a + 1] : zero;
                mma_bf16(acc[a], lo.x, hi.x, lo.y, hi.y, wv[u].x, wv[u].y);
                mma_bf16(acc[a], lo.z, hi.z, lo.w, hi.w, wv[u].z, wv[u].w);
            }
        }
    }

#pragma unroll
    for (int a = 0; a < NA; a++)
        for (int i = 0; i < 4; i++) part[warp][a][i][lane] = acc[a][i];
    if (NORM) { /* lanes g share x row 8q + g over their chunks t: sum over t, then warps */
#pragma unroll
        for (int q = 0; q < NG; q++) {
            float v = ss[q];
            v += __shfl_xor_sync(0xffffffffu, v, 1);
            v += __shfl_xor_sync(0xffffffffu, v, 2);
            if (t == 0) ssq[warp][8 * q + g] = v;
        }
    }
    __syncthreads();
    /* Slot i of lane l of tile a is x row 16 a + l / 4 (+ 8 for i >= 2) and the block's
     * weight row 2 (l % 4) (+ 1 for odd i); the warps' partial sums are added in warp order,
     * then 1 / rms and the bias. */
    for (int e = threadIdx.x; e < NA * 4 * 32; e += blockDim.x) {
        const int a = e >> 7, i = (e >> 5) & 3, l = e & 31;
        const int32_t r = 16 * a + (l >> 2) + (i & 2 ? 8 : 0);
        const int jj = 2 * (l & 3) + (i & 1);
        float v = part[0][a][i][l];
        for (int q = 1; q < n_warps; q++) v += part[q][a][i][l];
        if (NORM && r < n) {
            float sq = 0.0f;
            for (int q = 0; q < n_warps; q++) sq += ssq[q][r];
            v *= rsqrtf(sq / (float)k + fz.norm_eps);
        }
        const int64_t j = fz.swiglu ? (jj & 4 ? m : 0) + col0 + (jj & 3) : col0 + jj;
        if (bias && (fz.swiglu ? col0 + (jj & 3) : j) < m) v += pd_ld(bias + j);
        res[r][jj] = v;
    }
    __syncthreads();
    const int n_cols = fz.swiglu ? 4 : GEMV_ROWS;
    for (int e = threadIdx.x; e < NA * 16 * n_cols; e += blockDim.x) {
        const int32_t r = e / n_cols;
        const int c = e % n_cols;
        const int64_t j = col0 + c;
        if (r >= n || j >= m) continue;
        float v = res[r][c];
        if (fz.swiglu) {
            /* the rounding the composed path has: gate and up products in bf16 first */
            const float gt = __bfloat162float(__float2bfloat16_rn(v));
            const float up = __bfloat162float(__float2bfloat16_rn(res[r][c + 4]));
            v = gt / (1.0f + __expf(-gt)) * up;
        }
        bf16 *o = out + (int64_t)r * m + j;
        if (fz.accumulate) v += pd_ld(o);
        pd_st(o, v);
    }
}

static cudaError_t launch_gemv(const bf16 *x, const bf16 *w, const bf16 *bias, bf16 *out,
                               int32_t n, int32_t k, int32_t m, const gemv_fuse &fz,
                               cudaStream_t stream)
{
    /* Warps over k: enough steps each to keep GEMV_UNROLL loads in flight, up to 8 warps
     * (small m gets its parallelism from k). From k alone: see the batch invariance above.
     * (Choosing fewer warps where that fits all blocks on the device at once was tried:
     * slower on Llama-3-8B's m = 4096 products, docs/perf-history.md.) */
    const int32_t steps = (k / 8 + 3) / 4;
    int32_t warps = steps / GEMV_STEPS_PER_WARP;
    if (warps < 1) warps = 1;
    if (warps > GEMV_MAX_WARPS) warps = GEMV_MAX_WARPS;
    const int32_t per_warp = (steps + warps - 1) / warps;
    const int32_t cols = fz.swiglu ? 4 : GEMV_ROWS;
    const unsigned blocks = (unsigned)((m + cols - 1) / cols);
    const unsigned threads = (unsigned)warps * 32;
    typedef void (*kfn)(const bf16 *, const bf16 *, const bf16 *, bf16 *, int32_t, int32_t,
                        int32_t, int32_t, gemv_fuse);
    const bool wide = per_warp > GEMV_UNROLL && n <= 16;
    kfn kernel;
    if (fz.norm_w) {
        if (wide) kernel = n <= 8 ? gemv_kernel<1, true, 2 * GEMV_UNROLL>
                                  : gemv_kernel<2, true, 2 * GEMV_UNROLL>;
        else kernel = n <= 8 ? gemv_kernel<1, true, GEMV_UNROLL>
                    : n <= 16 ? gemv_kernel<2, true, GEMV_UNROLL>
                              : gemv_kernel<4, true, GEMV_UNROLL>;
    } else {
        if (wide) kernel = n <= 8 ? gemv_kernel<1, false, 2 * GEMV_UNROLL>
                                  : gemv_kernel<2, false, 2 * GEMV_UNROLL>;
        else kernel = n <= 8 ? gemv_kernel<1, false, GEMV_UNROLL>
                    : n <= 16 ? gemv_kernel<2, false, GEMV_UNROLL>
                              : gemv_kernel<4, false, GEMV_UNROLL>;
    }
    return pd_cuda__launch(kernel, dim3(blocks), dim3(threads), 0, stream, x, w, bias, out, n, k,
                           m, per_warp, fz);
}

/* The crossover, read once per process (a function-local static: initialised thread-safely). */
static int gemv_max_n(void)
{
    static const int v = [] {
        const int64_t x = pd_env_int("PDSERVE_CUDA_GEMV_MAX_N"); /* default 32 */
        return (int)(x < 0 ? 0 : x > GEMV_MAX_N ? GEMV_MAX_N : x);
    }();
    return v;
}

/* Whether the streaming kernel takes this product: small n, rows of whole 16-byte chunks,
 * aligned operands, the mma (compute capability 8.0 and up), and a small m. For n <= 32,
 * cuBLAS 13.0 runs the m >= 4096 products of Qwen3-0.6B (qkv, gate_up, lm_head) and
 * Llama-3-8B about as fast as this kernel or faster, but splits k of an m = 1024 product
 * (Qwen3's o_proj and down) over a second kernel, where this one is faster at every n up to
 * 32 (docs/perf-history.md, "Kernel benchmarks"). So the kernel takes
 * the products of m <= 2048 up to 8 MiB (gemv_takes); gemv_can is the rest of the test. */
static bool gemv_can(const pd_cuda_ctx *c, const void *x, const void *w, int32_t n, int32_t k)
{
    return n <= gemv_max_n() && k % 8 == 0 && (((uintptr_t)x | (uintptr_t)w) & 15) == 0 &&
           c->cc_major >= 8;
}

static bool gemv_takes(const pd_cuda_ctx *c, const void *x, const void *w, int32_t n, int32_t k,
                       int32_t m)
{
    static const size_t max_bytes = (size_t)pd_env_int("PDSERVE_CUDA_GEMV_MAX_MB") << 20;
    return gemv_can(c, x, w, n, k) && m <= GEMV_MAX_M &&
           (size_t)m * (size_t)k * sizeof(bf16) <= max_bytes;
}

/* ---- the rest: cuBLAS ----
 * Row-major to column-major: the row-major [n][m] result is the column-major m x n matrix
 * W . X^T, where the row-major weight [m][k] read column-major is the k x m matrix W^T (so op
 * T, lda k) and the row-major x [n][k] is the k x n matrix X^T (op N, ldb k). */

/* out[i][j] += bias[j], in fp32, rounded once. */
static __global__ void bias_kernel(bf16 *out, const bf16 *bias, size_t total, int32_t m)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x)
        pd_st(out + i, pd_ld(out + i) + pd_ld(bias + i % m));
}

static cudaError_t launch_bias(bf16 *out, const bf16 *bias, int32_t n, int32_t m,
                               cudaStream_t stream)
{
    const size_t total = (size_t)n * m;
    bias_kernel<<<pd_cuda__blocks(total, 256), 256, 0, stream>>>(out, bias, total, m);
    return cudaGetLastError();
}

/* out = x . w^T (+ out with beta 1) through cuBLAS, then the bias. */
static int cublas_linear(pd_cuda_ctx *c, const void *x, const void *w, const void *bias,
                         int32_t n, int32_t k, int32_t m, void *out, float beta)
{
    const float alpha = 1.0f;
    PD_CUBLAS_CHECK(cublasGemmEx(c->cublas, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &alpha, w,
                                 CUDA_R_16BF, k, x, CUDA_R_16BF, k, &beta, out, CUDA_R_16BF, m,
                                 CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    if (bias) PD_CUDA_CHECK(launch_bias((bf16 *)out, (const bf16 *)bias, n, m, c->stream));
    return 0;
}

extern "C" int pd_cuda__linear(void *ctx, const void *x, const void *w, const void *bias,
                               int32_t n, int32_t k, int32_t m, void *out)
{
    pd_cuda_ctx *c = pd_cuda__ctx(ctx);
    if (n == 0) return 0;
    if (n < 0 || k <= 0 || m <= 0 || !x || !w || !out) return PD_EINVAL;
    if (gemv_takes(c, x, w, n, k, m)) {
        const gemv_fuse none = {NULL, 0.0f, false, false};
        PD_CUDA_CHECK(launch_gemv((const bf16 *)x, (const bf16 *)w, (const bf16 *)bias,
                                  (bf16 *)out, n, k, m, none, c->stream));
        return 0;
    }
    return cublas_linear(c, x, w, bias, n, k, m, out, 0.0f);
}

/* Whether one GEMV launch takes a whole fused product: what gemv_takes takes, and, where a
 * norm or SwiGLU would otherwise cost launches of their own, larger products at n <= 8 up to
 * PDSERVE_CUDA_GEMV_FUSED_MAX_MB (for these cuBLAS is about as fast as the kernel at n = 1 and
 * the fused kernel saves one or two launches; past that size the norm and cuBLAS win:
 * docs/perf-history.md, "MoE decode: the routing in registers, launches overlapped"). */
#define GEMV_FUSED_MAX_N 8
static bool gemv_fused_takes(const pd_cuda_ctx *c, const pd_linear_args *a, int32_t mw)
{
    static const size_t max_bytes = (size_t)pd_env_int("PDSERVE_CUDA_GEMV_FUSED_MAX_MB") << 20;
    if (((uintptr_t)a->norm_w & 15) != 0) return false;
    if (gemv_takes(c, a->x, a->w, a->n, a->k, mw)) return true;
    return (a->norm_w || a->swiglu) && a->n <= GEMV_FUSED_MAX_N &&
           (size_t)mw * (size_t)a->k * sizeof(bf16) <= max_bytes &&
           gemv_can(c, a->x, a->w, a->n, a->k);
}

extern "C" int pd_cuda__linear_fused(void *ctx, const pd_linear_args *a)
{
    pd_cuda_ctx *c = pd_cuda__ctx(ctx);
    if (!a || a->n < 0 || a->k <= 0 || a->m <= 0 || !a->x || !a->w || !a->out ||
        (a->norm_w && !a->tmp_x) || (a->swiglu && (!a->tmp_out || a->accumulate)) ||
        (a->swiglu && a->m > INT32_MAX / 2))
        return PD_EINVAL;
    if (a->n == 0) return 0;
    const int32_t n = a->n, k = a->k, m = a->m, mw = a->swiglu ? 2 * m : m;
    if (gemv_fused_takes(c, a, mw)) {
        const gemv_fuse fz = {(const bf16 *)a->norm_w, a->norm_eps, a->swiglu, a->accumulate};
        PD_CUDA_CHECK(launch_gemv((const bf16 *)a->x, (const bf16 *)a->w, (const bf16 *)a->bias,
                                  (bf16 *)a->out, n, k, m, fz, c->stream));
        return 0;
    }
    /* composed: norm, product, SwiGLU as separate launches */
    const void *x = a->x;
    int rc;
    if (a->norm_w) {
        rc = pd_cuda__rmsnorm(ctx, x, NULL, a->norm_w, n, k, a->norm_eps, a->tmp_x);
        if (rc < 0) return rc;
        x = a->tmp_x;
    }
    if (a->swiglu) {
        rc = pd_cuda__linear(ctx, x, a->w, a->bias, n, k, mw, a->tmp_out);
        return rc < 0 ? rc : pd_cuda__swiglu(ctx, a->tmp_out, n, m, a->out);
    }
    if (!a->accumulate) return pd_cuda__linear(ctx, x, a->w, a->bias, n, k, m, a->out);
    if (gemv_takes(c, x, a->w, n, k, m)) {
        const gemv_fuse acc = {NULL, 0.0f, false, true};
        PD_CUDA_CHECK(launch_gemv((const bf16 *)x, (const bf16 *)a->w, (const bf16 *)a->bias,
                                  (bf16 *)a->out, n, k, m, acc, c->stream));
        return 0;
    }
    return cublas_linear(c, x, a->w, a->bias, n, k, m, a->out, 1.0f);
}
