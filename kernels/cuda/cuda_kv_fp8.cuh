/* cuda_kv_fp8.cuh -- Internal to the .cu files of the FP8 KV cache's ops (the kv_fp8 op set):
 * the cache element type the kernels are templates on (bf16 or pd_fp8), and the e4m3fn
 * conversions they use (the FP8 weights' activation quantization too: pd_e4m3x2_div). Kept
 * out of cuda_common.cuh so that the files without an FP8 variant do not depend on it. */
#ifndef PD_CUDA_KV_FP8_CUH
#define PD_CUDA_KV_FP8_CUH

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "kernels/cuda/cuda_common.cuh"

/* One element of an FP8 KV cache: an e4m3fn byte (1 sign, 4 exponent bits of bias 7, 3
 * mantissa bits; no infinities). A type of its own so that kernels can be templates on the
 * cache's element type. */
struct pd_fp8 {
    uint8_t x;
};

/* e4m3 byte -> f32 (exact: every e4m3 value is a half). */
static __device__ __forceinline__ float pd_ld(const pd_fp8 *p)
{
    const __half_raw h = __nv_cvt_fp8_to_halfraw(p->x, __NV_E4M3);
    return __half2float(__half(h));
}

/* Two e4m3 bytes (the low byte first) -> two bf16 packed as a 32-bit word (the low element in
 * the low half), exact: e4m3 has 3 mantissa bits, bf16 7, and bf16's exponent range holds
 * e4m3's subnormals as normals. */
static __device__ __forceinline__ uint32_t pd_e4m3x2_to_bf16x2(uint16_t v)
{
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(v, __NV_E4M3);
    const float2 f = __half22float2(__half2(h));
    const __nv_bfloat162 b = __floats2bfloat162_rn(f.x, f.y);
    return *reinterpret_cast<const uint32_t *>(&b);
}

/* Eight e4m3 bytes (8 bytes) -> eight bf16 (16 bytes), in order. */
static __device__ __forceinline__ uint4 pd_e4m3x8_to_bf16x8(uint2 v)
{
    return make_uint4(pd_e4m3x2_to_bf16x2((uint16_t)(v.x & 0xffffu)),
                      pd_e4m3x2_to_bf16x2((uint16_t)(v.x >> 16)),
                      pd_e4m3x2_to_bf16x2((uint16_t)(v.y & 0xffffu)),
                      pd_e4m3x2_to_bf16x2((uint16_t)(v.y >> 16)));
}

/* f32 -> e4m3 byte, round to nearest even, saturating at +-448 (NaN stays NaN): bit for bit
 * pd_f32_to_e4m3 (common/dtype.h). */
static __device__ __forceinline__ uint8_t pd_f32_to_e4m3_dev(float x)
{
    return (uint8_t)__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
}

/* e4m3(a / s) and e4m3(b / s) (low byte a's), bit for bit what pd_f32_to_e4m3_dev(__fdiv_rn(x,
 * s)) gives each, from r = __frcp_rn(s) and mostly without the division: x * r is within 2 ulp
 * of the rounded quotient, the conversion is monotonic, so where the codes of x * r moved by
 * 2^-20 either way agree, they are the quotient's code too; only a quotient next to one of
 * e4m3's rounding midpoints (rare, the exact ties among them: docs/perf-history.md, "FP8
 * batch-1 decode: where the step goes") takes the division. Signs, zeros, infinities, NaN and
 * the saturation behave as the division's (test_cuda_fp8 checks every bf16 and random floats
 * over thousands of scales). */
static __device__ __noinline__ uint32_t pd_e4m3x2_div_slow(float a, float b, float s)
{
    return __nv_cvt_float2_to_fp8x2(make_float2(__fdiv_rn(a, s), __fdiv_rn(b, s)), __NV_SATFINITE,
                                    __NV_E4M3);
}

static __device__ __forceinline__ uint32_t pd_e4m3x2_div(float a, float b, float s, float r)
{
    const float qa = __fmul_rn(a, r), qb = __fmul_rn(b, r);
    const float dn = 1.0f - 0x1p-20f, up = 1.0f + 0x1p-20f;
    const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(__fmul_rn(qa, dn), __fmul_rn(qb, dn)),
                                                 __NV_SATFINITE, __NV_E4M3);
    const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(__fmul_rn(qa, up), __fmul_rn(qb, up)),
                                                 __NV_SATFINITE, __NV_E4M3);
    return lo == hi ? lo : pd_e4m3x2_div_slow(a, b, s); /* out of line: the rare case */
}

/* A 16-byte chunk of 8 bf16 (v) to their 8 codes, e4m3(x / s) each as pd_e4m3x2_div. */
static __device__ __forceinline__ uint2 pd_e4m3x8_div(uint4 v, float s, float r)
{
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
    uint32_t o[2];
#pragma unroll
    for (int i = 0; i < 2; i++)
        o[i] = pd_e4m3x2_div(pd_bf16_lo(w[2 * i]), pd_bf16_hi(w[2 * i]), s, r) |
               pd_e4m3x2_div(pd_bf16_lo(w[2 * i + 1]), pd_bf16_hi(w[2 * i + 1]), s, r) << 16;
    return make_uint2(o[0], o[1]);
}

/* 8 bytes global -> shared (cp.async through L1: .cg takes only 16); with ok false nothing is
 * read and zeros land. */
static __device__ __forceinline__ void pd_cp8(void *dst, const void *src, bool ok)
{
    const unsigned s = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(s), "l"(src),
                 "r"(ok ? 8 : 0));
}

#endif
