/* cuda_fp8_quant.cu -- The FP8 weight op set's element-wise kernels: the activation
 * quantization (pd_fp8_quant_row's rule, bit for bit: bf16 rows to e4m3 codes and f32 scales),
 * its expansion back to values (for tests), the weight's dequantization to bf16 (the
 * weight-only product of large n) and the bias add. */
#include <math.h>

#include "kernels/cuda/cuda_fp8.cuh"
#include "kernels/cuda/cuda_kv_fp8.cuh"

static __device__ __forceinline__ float e4m3_val(uint8_t b)
{
    return __half2float(__half(__nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)b, __NV_E4M3)));
}

/* The quantization kernels come between a decode step's products: launched with PDL (when it
 * is on) and letting their successor be scheduled at once, so that the next small-n product
 * streams its weight while they run (it waits for them before it reads the codes). */

/* Small groups (group 128): one warp per (row, group); warp w of the grid takes row w / ng,
 * group w % ng. */
static __global__ void quant_warp_kernel(const bf16 *x, int32_t n, int32_t k, int32_t group,
                                         int32_t ng, bool dynamic, float in_scale, uint8_t *q,
                                         float *s)
{
    pd_pdl_enter();
    const int lane = threadIdx.x & 31;
    const int64_t wid = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (wid >= (int64_t)n * ng) return;
    const int32_t r = (int32_t)(wid / ng), g = (int32_t)(wid % ng);
    const int32_t j0 = g * group, j1 = min(k, j0 + group);
    const bf16 *xr = x + (int64_t)r * k;
    float sc = in_scale;
    if (dynamic) {
        float amax = 0.0f;
        for (int32_t j = j0 + lane; j < j1; j += 32) amax = fmaxf(amax, fabsf(pd_ld(xr + j)));
        sc = pd_fp8_dyn_scale(pd_warp_max(amax));
    }
    uint8_t *qr = q + (int64_t)r * k;
    for (int32_t j = j0 + lane; j < j1; j += 32) qr[j] = pd_fp8_quant1(pd_ld(xr + j), sc);
    if (lane == 0) s[(int64_t)g * n + r] = sc;
}

/* Groups of 128 (block-wise checkpoints), k a multiple of 128 and the rows 16-byte aligned:
 * the warp kernel's rule, a lane's four elements in one 8-byte load and one 4-byte store. */
static __global__ void quant_warp128_kernel(const bf16 *x, int32_t n, int32_t k, int32_t ng,
                                            bool dynamic, float in_scale, uint8_t *q, float *s)
{
    pd_pdl_enter();
    const int lane = threadIdx.x & 31;
    const int64_t wid = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (wid >= (int64_t)n * ng) return;
    const int32_t r = (int32_t)(wid / ng), g = (int32_t)(wid % ng);
    const int64_t at = (int64_t)r * k + g * 128 + lane * 4;
    const uint2 v = *reinterpret_cast<const uint2 *>(x + at);
    const float e[4] = {pd_bf16_lo(v.x), pd_bf16_hi(v.x), pd_bf16_lo(v.y), pd_bf16_hi(v.y)};
    float sc = in_scale;
    if (dynamic)
        sc = pd_fp8_dyn_scale(pd_warp_max(fmaxf(fmaxf(fabsf(e[0]), fabsf(e[1])),
                                         fmaxf(fabsf(e[2]), fabsf(e[3])))));
    uint32_t o = 0;
#pragma unroll
    for (int i = 0; i < 4; i++) o |= (uint32_t)pd_fp8_quant1(e[i], sc) << (8 * i);
    *reinterpret_cast<uint32_t *>(q + at) = o;
    if (lane == 0) s[(int64_t)g * n + r] = sc;
}

/* Large groups (group k: a scale a row): one block per (row, group). */
#define QUANT_THREADS 256
static __global__ void __launch_bounds__(QUANT_THREADS)
quant_block_kernel(const bf16 *x, int32_t n, int32_t k, int32_t group, int32_t ng, bool dynamic,
                   float in_scale, uint8_t *q, float *s)
{
    __shared__ float part[QUANT_THREADS / 32];
    pd_pdl_enter();
    const int32_t r = blockIdx.x / ng, g = blockIdx.x % ng;
    const int32_t j0 = g * group, j1 = min(k, j0 + group);
    const bf16 *xr = x + (int64_t)r * k;
    float sc = in_scale;
    if (dynamic) {
        float amax = 0.0f;
        for (int32_t j = j0 + threadIdx.x; j < j1; j += blockDim.x)
            amax = fmaxf(amax, fabsf(pd_ld(xr + j)));
        amax = pd_warp_max(amax);
        if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = amax;
        __syncthreads();
        amax = 0.0f;
        for (int i = 0; i < (int)(blockDim.x >> 5); i++) amax = fmaxf(amax, part[i]);
        sc = pd_fp8_dyn_scale(amax);
    }
    uint8_t *qr = q + (int64_t)r * k;
    for (int32_t j = j0 + threadIdx.x; j < j1; j += blockDim.x)
        qr[j] = pd_fp8_quant1(pd_ld(xr + j), sc);
    if (threadIdx.x == 0) s[(int64_t)g * n + r] = sc;
}

/* A row's eight elements x[0..7] (a 16-byte chunk) to their codes (8 bytes), pd_fp8_quant1's bits
 * from the scale's reciprocal rc = __frcp_rn(sc) (pd_e4m3x8_div). */
static __device__ __forceinline__ uint2 quant8(uint4 v, float sc, float rc)
{
    return pd_e4m3x8_div(v, sc, rc);
}

/* The largest of every thread's amax over a block of QUANT_THREADS threads (all of them call
 * it once; part is QUANT_THREADS / 32 floats of shared memory). */
static __device__ __forceinline__ float block_amax(float amax, float *part)
{
    amax = pd_warp_max(amax);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = amax;
    __syncthreads();
    amax = 0.0f;
#pragma unroll
    for (int i = 0; i < QUANT_THREADS / 32; i++) amax = fmaxf(amax, part[i]);
    return amax;
}

/* A scale a row (group k), k a multiple of 8 and the rows 16-byte aligned: the same rule in
 * 16-byte loads and 8-byte stores, the row's first QV_REGS chunks a thread kept in registers
 * between the two passes (rows up to QUANT_THREADS x 8 x QV_REGS elements are read once). */
#define QV_REGS 8
static __global__ void __launch_bounds__(QUANT_THREADS)
quant_row_vec_kernel(const bf16 *x, int32_t n, int32_t k, bool dynamic, float in_scale,
                     uint8_t *q, float *s)
{
    __shared__ float part[QUANT_THREADS / 32];
    pd_pdl_enter();
    const int32_t r = blockIdx.x, nc = k / 8;
    const uint4 *xr = reinterpret_cast<const uint4 *>(x + (int64_t)r * k);
    uint4 keep[QV_REGS];
    float sc = in_scale;
    if (dynamic) {
        float amax = 0.0f;
#pragma unroll
        for (int i = 0; i < QV_REGS; i++) {
            const int32_t c = (int32_t)threadIdx.x + i * QUANT_THREADS;
            keep[i] = c < nc ? xr[c] : make_uint4(0, 0, 0, 0);
            amax = pd_bf16x8_amax(keep[i], amax);
        }
        for (int32_t c = (int32_t)threadIdx.x + QV_REGS * QUANT_THREADS; c < nc; c += QUANT_THREADS)
            amax = pd_bf16x8_amax(xr[c], amax);
        sc = pd_fp8_dyn_scale(block_amax(amax, part));
    } else {
#pragma unroll
        for (int i = 0; i < QV_REGS; i++) {
            const int32_t c = (int32_t)threadIdx.x + i * QUANT_THREADS;
            keep[i] = c < nc ? xr[c] : make_uint4(0, 0, 0, 0);
        }
    }
    uint2 *qr = reinterpret_cast<uint2 *>(q + (int64_t)r * k);
    const float rc = __frcp_rn(sc);
#pragma unroll
    for (int i = 0; i < QV_REGS; i++) {
        const int32_t c = (int32_t)threadIdx.x + i * QUANT_THREADS;
        if (c < nc) qr[c] = quant8(keep[i], sc, rc);
    }
    for (int32_t c = (int32_t)threadIdx.x + QV_REGS * QUANT_THREADS; c < nc; c += QUANT_THREADS)
        qr[c] = quant8(xr[c], sc, rc);
    if (threadIdx.x == 0) s[r] = sc;
}

/* ---- the quantization fused into the kernel that makes its rows ----
 * A block a row, QUANT_THREADS threads; the row's n8 16-byte chunks made in registers, chunk
 * j = threadIdx.x + i * QUANT_THREADS in y[i] (zeros past the row's end), then quantized as
 * launch_quant's kernels quantize the same bf16 row (the same codes and scales, bit for bit):
 * a scale a row, or (g128) groups of 128, a group being the 16 chunks of 16 consecutive
 * threads (n8 % 16 == 0: no group straddles the row's end or a warp's halves). */
template <int V>
static __device__ __forceinline__ void quant_kept(const uint4 (&y)[V], int32_t n8, int32_t n,
                                                  bool g128, bool dynamic, float in_scale,
                                                  uint8_t *q, float *s)
{
    __shared__ float part[QUANT_THREADS / 32];
    const int32_t r = blockIdx.x;
    uint2 *qr = reinterpret_cast<uint2 *>(q + (int64_t)r * n8 * 8);
    if (g128) {
#pragma unroll
        for (int i = 0; i < V; i++) {
            const int32_t j = (int32_t)threadIdx.x + i * QUANT_THREADS;
            float sc = in_scale;
            if (dynamic) { /* every lane shuffles: a half-warp is all in or all out */
                float a = pd_bf16x8_amax(y[i], 0.0f);
#pragma unroll
                for (int o = 8; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
                sc = pd_fp8_dyn_scale(a);
            }
            if (j < n8) {
                qr[j] = quant8(y[i], sc, __frcp_rn(sc));
                if ((j & 15) == 0) s[(int64_t)(j >> 4) * n + r] = sc;
            }
        }
        return;
    }
    float sc = in_scale;
    if (dynamic) {
        float amax = 0.0f;
#pragma unroll
        for (int i = 0; i < V; i++) amax = pd_bf16x8_amax(y[i], amax);
        sc = pd_fp8_dyn_scale(block_amax(amax, part));
    }
    const float rc = __frcp_rn(sc);
#pragma unroll
    for (int i = 0; i < V; i++) {
        const int32_t j = (int32_t)threadIdx.x + i * QUANT_THREADS;
        if (j < n8) qr[j] = quant8(y[i], sc, rc);
    }
    if (threadIdx.x == 0) s[r] = sc;
}

/* RMSNorm (no residual) then the quantization: the norm as cuda_rmsnorm.cu's vector kernel
 * computes it (the same thread layout and reduction: PD_RMSNORM_THREADS == QUANT_THREADS),
 * its bf16 values never stored. */
template <int V>
static __global__ void __launch_bounds__(QUANT_THREADS)
norm_quant_kernel(const bf16 *x, const bf16 *w, int32_t n, int32_t dim, float eps, bool g128,
                  bool dynamic, float in_scale, uint8_t *q, float *s)
{
    pd_pdl_enter();
    const int32_t n8 = dim / 8;
    const uint4 *xr = reinterpret_cast<const uint4 *>(x + (size_t)blockIdx.x * dim);
    const uint4 *wr = reinterpret_cast<const uint4 *>(w);
    uint4 v[V], wv[V];
#pragma unroll
    for (int i = 0; i < V; i++) {
        const int32_t j = (int32_t)threadIdx.x + i * QUANT_THREADS;
        v[i] = wv[i] = make_uint4(0u, 0u, 0u, 0u);
        if (j < n8) {
            v[i] = xr[j];
            wv[i] = __ldg(wr + j);
        }
    }
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < V; i++) ss += pd_sumsq8(v[i]);
    const float r = pd_rms_inv(ss, dim, eps);
#pragma unroll
    for (int i = 0; i < V; i++)
        if ((int32_t)threadIdx.x + i * QUANT_THREADS < n8) v[i] = pd_rmsnorm8(v[i], wv[i], r);
    quant_kept<V>(v, n8, n, g128, dynamic, in_scale, q, s);
}

/* SwiGLU of gate_up [n][2f] (gate columns, then up) then the quantization of its [n][f] rows. */
template <int V>
static __global__ void __launch_bounds__(QUANT_THREADS)
swiglu_quant_kernel(const bf16 *gate_up, int32_t n, int32_t f, bool g128, bool dynamic,
                    float in_scale, uint8_t *q, float *s)
{
    pd_pdl_enter();
    const int32_t f8 = f / 8;
    const uint4 *row = reinterpret_cast<const uint4 *>(gate_up + (size_t)blockIdx.x * 2 * f);
    uint4 y[V];
#pragma unroll
    for (int i = 0; i < V; i++) {
        const int32_t j = (int32_t)threadIdx.x + i * QUANT_THREADS;
        y[i] = j < f8 ? pd_swiglu8(row[j], row[f8 + j]) : make_uint4(0u, 0u, 0u, 0u);
    }
    quant_kept<V>(y, f8, n, g128, dynamic, in_scale, q, s);
}

static_assert(PD_RMSNORM_THREADS == QUANT_THREADS, "the fused norm must reduce as the norm does");

/* The chunks a thread keeps for rows of k: 1, 2, 4, 8 or 16 (k <= PD_FP8_FUSED_MAX_K). */
static int kept_chunks(int32_t k)
{
    const int32_t per = 8 * QUANT_THREADS;
    return k <= per ? 1 : k <= 2 * per ? 2 : k <= 4 * per ? 4 : k <= 8 * per ? 8 : 16;
}

bool pd_cuda__fp8_fused_quant_fits(int32_t k, int32_t group, const void *rows, const void *q)
{
    const int32_t ng = (k + group - 1) / group;
    return k % 8 == 0 && k <= PD_FP8_FUSED_MAX_K && (ng == 1 || (group == 128 && k % 128 == 0)) &&
           (((uintptr_t)rows | (uintptr_t)q) & 15) == 0;
}

#define FUSED_LAUNCH(kern, V, ...)                                                            \
    pd_cuda__launch(kern<V>, dim3((unsigned)n), dim3(QUANT_THREADS), 0, stream, __VA_ARGS__)
#define FUSED_DISPATCH(kern, kc, ...)                                                         \
    ((kc) == 1   ? FUSED_LAUNCH(kern, 1, __VA_ARGS__)                                         \
     : (kc) == 2 ? FUSED_LAUNCH(kern, 2, __VA_ARGS__)                                         \
     : (kc) == 4 ? FUSED_LAUNCH(kern, 4, __VA_ARGS__)                                         \
     : (kc) == 8 ? FUSED_LAUNCH(kern, 8, __VA_ARGS__)                                         \
                 : FUSED_LAUNCH(kern, 16, __VA_ARGS__))

cudaError_t pd_cuda__fp8_launch_norm_quant(const bf16 *x, const bf16 *w, int32_t n, int32_t k,
                                           float eps, int32_t group, pd_act_quant act,
                                           float in_scale, uint8_t *q, float *s,
                                           cudaStream_t stream)
{
    const bool g128 = (k + group - 1) / group > 1, dynamic = act == PD_ACT_DYNAMIC;
    const int kc = kept_chunks(k);
    if (kc > 8) return cudaErrorInvalidValue; /* the norm kernel's rows: pd_rmsnorm_vec_fits */
    return FUSED_DISPATCH(norm_quant_kernel, kc, x, w, n, k, eps, g128, dynamic, in_scale, q, s);
}

cudaError_t pd_cuda__fp8_launch_swiglu_quant(const bf16 *gate_up, int32_t n, int32_t f,
                                             int32_t group, pd_act_quant act, float in_scale,
                                             uint8_t *q, float *s, cudaStream_t stream)
{
    const bool g128 = (f + group - 1) / group > 1, dynamic = act == PD_ACT_DYNAMIC;
    return FUSED_DISPATCH(swiglu_quant_kernel, kept_chunks(f), gate_up, n, f, g128, dynamic,
                          in_scale, q, s);
}

cudaError_t pd_cuda__fp8_launch_quant(const bf16 *x, int32_t n, int32_t k, int32_t group,
                                      pd_act_quant act, float in_scale, uint8_t *q, float *s,
                                      cudaStream_t stream)
{
    const int32_t ng = (k + group - 1) / group;
    const bool dynamic = act == PD_ACT_DYNAMIC;
    const int64_t units = (int64_t)n * ng;
    if (group == 128 && k % 128 == 0 && ((uintptr_t)x & 15) == 0 && ((uintptr_t)q & 15) == 0) {
        const int warps = 8;
        const unsigned blocks = (unsigned)((units + warps - 1) / warps);
        return pd_cuda__launch(quant_warp128_kernel, dim3(blocks), dim3(warps * 32), 0, stream,
                               x, n, k, ng, dynamic, in_scale, q, s);
    }
    if (group <= 512) {
        const int warps = 8;
        const unsigned blocks = (unsigned)((units + warps - 1) / warps);
        return pd_cuda__launch(quant_warp_kernel, dim3(blocks), dim3(warps * 32), 0, stream, x,
                               n, k, group, ng, dynamic, in_scale, q, s);
    }
    if (ng == 1 && k % 8 == 0 && ((uintptr_t)x & 15) == 0 && ((uintptr_t)q & 15) == 0)
        return pd_cuda__launch(quant_row_vec_kernel, dim3((unsigned)n), dim3(QUANT_THREADS), 0,
                               stream, x, n, k, dynamic, in_scale, q, s);
    return pd_cuda__launch(quant_block_kernel, dim3((unsigned)units), dim3(QUANT_THREADS), 0,
                           stream, x, n, k, group, ng, dynamic, in_scale, q, s);
}

static __global__ void expand_kernel(const uint8_t *q, const float *s, int32_t n, int32_t k,
                                     int32_t group, float *out)
{
    const size_t total = (size_t)n * k;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        const int32_t r = (int32_t)(i / k), j = (int32_t)(i % k);
        out[i] = e4m3_val(q[i]) * s[(int64_t)(j / group) * n + r];
    }
}

cudaError_t pd_cuda__fp8_launch_expand(const uint8_t *q, const float *s, int32_t n, int32_t k,
                                       int32_t group, float *out, cudaStream_t stream)
{
    expand_kernel<<<pd_cuda__blocks((size_t)n * k, 256), 256, 0, stream>>>(q, s, n, k, group,
                                                                           out);
    return cudaGetLastError();
}

static __global__ void dequant_kernel(const uint8_t *w8, const float *scale, int32_t m,
                                      int32_t k, int32_t group, int32_t ng, bf16 *out)
{
    const size_t total = (size_t)m * k;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / (size_t)k;
        const int32_t j = (int32_t)(i - r * (size_t)k);
        pd_st(out + i, e4m3_val(w8[i]) * scale[r * ng + j / group]);
    }
}

cudaError_t pd_cuda__fp8_launch_dequant(const pd_fp8_weight *w, bf16 *out, cudaStream_t stream)
{
    dequant_kernel<<<pd_cuda__blocks((size_t)w->m * w->k, 256), 256, 0, stream>>>(
        w->w8, w->scale, w->m, w->k, w->group, w->ng, out);
    return cudaGetLastError();
}

static __global__ void bias_kernel(bf16 *out, const bf16 *bias, size_t total, int32_t m)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x)
        pd_st(out + i, pd_ld(out + i) + pd_ld(bias + i % m));
}

cudaError_t pd_cuda__fp8_launch_bias(bf16 *out, const bf16 *bias, int32_t n, int32_t m,
                                     cudaStream_t stream)
{
    const size_t total = (size_t)n * m;
    bias_kernel<<<pd_cuda__blocks(total, 256), 256, 0, stream>>>(out, bias, total, m);
    return cudaGetLastError();
}

extern "C" int pd_cuda__fp8_quant_rows_f32(void *ctx, const void *x, int32_t n, int32_t k,
                                           int32_t group, pd_act_quant act, float in_scale,
                                           float *out)
{
    pd_cuda_ctx *c = pd_cuda__ctx(ctx);
    if (n == 0) return 0;
    if (n < 0 || k <= 0 || group <= 0 || !x || !out || act == PD_ACT_NONE ||
        (act != PD_ACT_DYNAMIC && act != PD_ACT_STATIC) ||
        (act == PD_ACT_STATIC && !(in_scale > 0.0f && isfinite(in_scale))))
        return PD_EINVAL;
    const int32_t ng = (k + group - 1) / group;
    uint8_t *q = NULL;
    float *s = NULL;
    int rc = 0;
    cudaError_t e = cudaMallocAsync((void **)&q, (size_t)n * k, c->stream);
    if (e == cudaSuccess) e = cudaMallocAsync((void **)&s, (size_t)n * ng * sizeof(float), c->stream);
    if (e == cudaSuccess)
        e = pd_cuda__fp8_launch_quant((const bf16 *)x, n, k, group, act, in_scale, q, s,
                                      c->stream);
    if (e == cudaSuccess) e = pd_cuda__fp8_launch_expand(q, s, n, k, group, out, c->stream);
    if (e != cudaSuccess) {
        pd_cuda__report("pd_cuda__fp8_quant_rows_f32", cudaGetErrorString(e), __FILE__, __LINE__);
        rc = e == cudaErrorMemoryAllocation ? PD_ENOMEM : PD_EBACKEND;
    }
    if (q) (void)cudaFreeAsync(q, c->stream);
    if (s) (void)cudaFreeAsync(s, c->stream);
    return rc;
}

/* ---- pd_e4m3x2_div against the division, for tests ---- */

/* Every bf16 pattern h as x, and x2 a float of h's high half with low bits from a hash, each
 * over every scale: a mismatch of either code with e4m3(__fdiv_rn(x, s)) counts. */
static __global__ void div_check_kernel(const float *scales, int32_t n_s,
                                        unsigned long long *bad)
{
    const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (int64_t)n_s * 65536) return;
    const int32_t si = (int32_t)(t >> 16);
    const uint32_t h = (uint32_t)(t & 0xffff);
    uint32_t z = h * 0x9e3779b9u ^ (uint32_t)si * 0x85ebca6bu;
    z ^= z >> 15;
    z *= 0x2c1b3c6du;
    z ^= z >> 12;
    const float s = scales[si], r = __frcp_rn(s);
    const float x = __uint_as_float(h << 16), x2 = __uint_as_float(h << 16 | (z & 0xffffu));
    const uint32_t got = pd_e4m3x2_div(x, x2, s, r);
    const uint32_t want = pd_f32_to_e4m3_dev(__fdiv_rn(x, s)) |
                          (uint32_t)pd_f32_to_e4m3_dev(__fdiv_rn(x2, s)) << 8;
    if (got != want) atomicAdd(bad, (unsigned long long)((got & 0xffu) != (want & 0xffu)) +
                                        ((got >> 8) != (want >> 8)));
}

extern "C" int pd_cuda__fp8_div_check(void *ctx, const float *scales, int32_t n_s,
                                      uint64_t *mismatches)
{
    pd_cuda_ctx *c = pd_cuda__ctx(ctx);
    if (n_s <= 0 || !scales || !mismatches) return PD_EINVAL;
    float *ds = NULL;
    unsigned long long *dbad = NULL, bad = 0;
    cudaError_t e = cudaMallocAsync((void **)&ds, (size_t)n_s * sizeof(float), c->stream);
    if (e == cudaSuccess) e = cudaMallocAsync((void **)&dbad, sizeof bad, c->stream);
    if (e == cudaSuccess)
        e = cudaMemcpyAsync(ds, scales, (size_t)n_s * sizeof(float), cudaMemcpyHostToDevice,
                            c->stream);
    if (e == cudaSuccess) e = cudaMemsetAsync(dbad, 0, sizeof bad, c->stream);
    if (e == cudaSuccess) {
        const int64_t total = (int64_t)n_s * 65536;
        div_check_kernel<<<(unsigned)((total + 255) / 256), 256, 0, c->stream>>>(ds, n_s, dbad);
        e = cudaGetLastError();
    }
    if (e == cudaSuccess)
        e = cudaMemcpyAsync(&bad, dbad, sizeof bad, cudaMemcpyDeviceToHost, c->stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(c->stream);
    if (ds) (void)cudaFreeAsync(ds, c->stream);
    if (dbad) (void)cudaFreeAsync(dbad, c->stream);
    if (e != cudaSuccess) {
        pd_cuda__report("pd_cuda__fp8_div_check", cudaGetErrorString(e), __FILE__, __LINE__);
        return PD_EBACKEND;
    }
    *mismatches = bad;
    return 0;
}
