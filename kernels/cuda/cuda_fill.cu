/* cuda_fill.cu -- fill_uniform on the device. The generator is the CPU backend's splitmix64
 * stream, evaluated counter-style (draw j uses state seed + (j + 1) * gamma), so that a bf16
 * buffer filled here holds exactly the CPU backend's f32 values rounded to bf16: dummy models
 * are the same model on both backends. */
#include <math.h>

#include "kernels/cuda/cuda_common.cuh"

#define GAMMA 0x9e3779b97f4a7c15ull

static __device__ __forceinline__ uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* One 64-bit draw gives two 24-bit values, for elements 2j and 2j + 1; the arithmetic is
 * rounded step by step (no fused multiply-add) to match the CPU's. */
template <typename T>
static __global__ void fill_kernel(T *dst, size_t n, uint64_t seed, float lo, float scale,
                                   float top)
{
    const size_t pairs = (n + 1) / 2;
    for (size_t j = blockIdx.x * (size_t)blockDim.x + threadIdx.x; j < pairs;
         j += (size_t)gridDim.x * blockDim.x) {
        const uint64_t r = mix64(seed + (j + 1) * GAMMA);
        const float a = fminf(__fadd_rn(lo, __fmul_rn((float)(r & 0xffffff), scale)), top);
        const float b = fminf(__fadd_rn(lo, __fmul_rn((float)((r >> 32) & 0xffffff), scale)), top);
        if constexpr (sizeof(T) == 2) {
            dst[2 * j] = __float2bfloat16_rn(a);
            if (2 * j + 1 < n) dst[2 * j + 1] = __float2bfloat16_rn(b);
        } else {
            dst[2 * j] = a;
            if (2 * j + 1 < n) dst[2 * j + 1] = b;
        }
    }
}

static cudaError_t launch_fill(void *dst, pd_dtype dtype, size_t n, uint64_t seed, float lo,
                               float hi, cudaStream_t stream)
{
    const float scale = (hi - lo) / 16777216.0f;
    const float top = nextafterf(hi, lo);
    const unsigned threads = 256, blocks = pd_cuda__blocks((n + 1) / 2, threads);
    if (dtype == PD_DTYPE_BF16)
        fill_kernel<bf16><<<blocks, threads, 0, stream>>>((bf16 *)dst, n, seed, lo, scale, top);
    else
        fill_kernel<float><<<blocks, threads, 0, stream>>>((float *)dst, n, seed, lo, scale, top);
    return cudaGetLastError();
}

extern "C" int pd_cuda__fill_uniform(void *ctx, void *dst, pd_dtype dtype, size_t n,
                                     uint64_t seed, float lo, float hi)
{
    pd_cuda_ctx *c = pd_cuda__ctx(ctx);
    if (n == 0) return 0;
    if (!dst || (dtype != PD_DTYPE_BF16 && dtype != PD_DTYPE_F32) || !(lo < hi)) return PD_EINVAL;
    PD_CUDA_CHECK(launch_fill(dst, dtype, n, seed, lo, hi, c->stream));
    return 0;
}
