/* cuda_fp8.cuh -- Internal to the FP8 weight op set's files (cuda_fp8_linear.cu: the op set
 * and its cuBLASLt products; cuda_fp8_quant.cu: the activation quantization and the weight
 * dequantization; cuda_fp8_gemv.cu: the small-n and the any-shape product kernels): the device
 * form of an FP8 weight and the launchers the files share. Never included by C code. */
#ifndef PD_CUDA_FP8_CUH
#define PD_CUDA_FP8_CUH

#include <cublasLt.h>
#include <cuda_fp8.h>

#include "kernels/cuda/cuda_common.cuh"

/* An FP8 weight as weight_create leaves it (pd_qweight_desc's matrix on the device). */
typedef struct {
    uint8_t *w8;           /* [m][k] e4m3fn bytes */
    float *scale;          /* [m][ng]: element (i, j) is e4m3(w8[i][j]) * scale[i][j / group] */
    float *blk_scale;      /* group 128 with equal scales on every 128-row band: the band's
                            * scales [ceil(m / 128)][ng] (cuBLASLt's BLK128x128_32F); else NULL */
    int32_t m, k;          /* rows, columns */
    int32_t group, ng;     /* columns a scale covers (> 0), scales a row = ceil(k / group) */
    pd_act_quant act;      /* how linear_fused quantizes its input rows */
    float in_scale;        /* PD_ACT_STATIC's scale */
    size_t bytes;          /* device bytes held (weight_bytes) */
    /* cuBLASLt's plan for the last n (linear_fused queries the heuristic when n or the
     * output's alignment changes) */
    bool lt_off;           /* cuBLASLt refused this weight's scale modes: the tile kernel */
    int32_t lt_n;          /* n of lt_algo, 0 = none */
    uint32_t lt_align;     /* the output's alignment it was chosen for */
    cublasLtMatmulAlgo_t lt_algo;
} pd_fp8_weight;

/* Four e4m3 codes (the lowest byte first) as two f16 pairs (codes 0, 1 and 2, 3, the lower in
 * the lower half), exactly (every e4m3 value is an f16 value): two conversions of a pair.
 *   The products of FP8 weights on compute capability 9.0 take these and the f16 mma:
 * mma.sync on e4m3 is not native there, the compiler widens both operands before every f16
 * mma, where a kernel can widen the input rows once (docs/perf-history.md, "FP8 batch-1
 * decode: the products on f16"). */
static __device__ __forceinline__ uint2 pd_e4m3x4_f16(uint32_t w)
{
    uint32_t lo, hi;
    asm("{\n.reg .b16 l, u;\nmov.b32 {l, u}, %2;\ncvt.rn.f16x2.e4m3x2 %0, l;\n"
        "cvt.rn.f16x2.e4m3x2 %1, u;\n}"
        : "=r"(lo), "=r"(hi)
        : "r"(w));
    return make_uint2(lo, hi);
}

/* A 16-byte load of the weight, which is read once: not kept in L1 (x lives there). */
static __device__ __forceinline__ uint4 pd_fp8_ld_stream16(const uint8_t *p)
{
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

/* 16 e4m3 codes (element 0 in the lowest byte) as f32. */
static __device__ __forceinline__ void pd_e4m3x16_f32(uint4 v, float (&f)[16])
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

/* One element of the rule: e4m3(x / s) with IEEE division (no fast math in this build),
 * round to nearest even, saturating at +-448 (pd_f32_to_e4m3). */
static __device__ __forceinline__ uint8_t pd_fp8_quant1(float x, float s)
{
    return (uint8_t)__nv_cvt_float_to_fp8(x / s, __NV_SATFINITE, __NV_E4M3);
}

/* The scale of a group with largest magnitude amax (pd_fp8_quant_row: f32 division, floor
 * PD_FP8_MIN_SCALE, which a NaN also takes). */
static __device__ __forceinline__ float pd_fp8_dyn_scale(float amax)
{
    float s = amax / PD_FP8_MAX;
    if (!(s >= PD_FP8_MIN_SCALE)) s = PD_FP8_MIN_SCALE;
    return s;
}

/* The largest magnitude of eight bf16 (a 16-byte chunk) and a. */
static __device__ __forceinline__ float pd_bf16x8_amax(uint4 v, float a)
{
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++)
        a = fmaxf(a, fmaxf(fabsf(pd_bf16_lo(w[i])), fabsf(pd_bf16_hi(w[i]))));
    return a;
}

/* The quantization of pd_fp8_quant_row on n bf16 rows x[n][k] (row stride k): e4m3 codes into
 * q[n][k] and each (row, group)'s scale into s[g * n + row] (group-major: cuBLASLt's
 * OUTER_VEC_32F for ng = 1, VEC128_32F for group 128). act must not be PD_ACT_NONE. */
cudaError_t pd_cuda__fp8_launch_quant(const bf16 *x, int32_t n, int32_t k, int32_t group,
                                      pd_act_quant act, float in_scale, uint8_t *q, float *s,
                                      cudaStream_t stream);

/* The quantization fused into the kernel that makes its input rows (cuda_fp8_quant.cu), the
 * same codes and scales as that kernel's bf16 rows through launch_quant: rows of k columns
 * fit when k % 8 == 0, k <= PD_FP8_FUSED_MAX_K, a scale a row or groups of 128 (k % 128 == 0),
 * and the rows and codes 16-byte aligned (pd_cuda__fp8_fused_quant_fits).
 *   norm_quant: RMSNorm of x [n][k] with weights w (no residual), for the rows where the norm
 *     op takes its vector kernel (pd_rmsnorm_vec_fits; k <= 16384), whose reduction it repeats;
 *   swiglu_quant: the SwiGLU of gate_up [n][2f] (the swiglu op's rule). */
#define PD_FP8_FUSED_MAX_K 32768
bool pd_cuda__fp8_fused_quant_fits(int32_t k, int32_t group, const void *rows, const void *q);
cudaError_t pd_cuda__fp8_launch_norm_quant(const bf16 *x, const bf16 *w, int32_t n, int32_t k,
                                           float eps, int32_t group, pd_act_quant act,
                                           float in_scale, uint8_t *q, float *s,
                                           cudaStream_t stream);
cudaError_t pd_cuda__fp8_launch_swiglu_quant(const bf16 *gate_up, int32_t n, int32_t f,
                                             int32_t group, pd_act_quant act, float in_scale,
                                             uint8_t *q, float *s, cudaStream_t stream);

/* out[r][j] = q[r][j] * s[(j / group) * n + r] in f32 (the quantized rows as values). */
cudaError_t pd_cuda__fp8_launch_expand(const uint8_t *q, const float *s, int32_t n, int32_t k,
                                       int32_t group, float *out, cudaStream_t stream);

/* The whole weight dequantized into bf16: out[i][j] = bf16(e4m3(w8[i][j]) * scale). */
cudaError_t pd_cuda__fp8_launch_dequant(const pd_fp8_weight *w, bf16 *out, cudaStream_t stream);

/* out[r][j] += bias[j] over [n][m], in f32, rounded once. */
cudaError_t pd_cuda__fp8_launch_bias(bf16 *out, const bf16 *bias, int32_t n, int32_t m,
                                     cudaStream_t stream);

/* The product's input rows: the quantized codes and scales (xq, xs as launch_quant writes
 * them) or, for PD_ACT_NONE, the bf16 rows xb. */
typedef struct {
    const uint8_t *xq;     /* [n][k] codes, or NULL: xb */
    const float *xs;       /* [ng][n] scales (with xq) */
    const bf16 *xb;        /* [n][k] bf16 rows (without xq) */
} pd_fp8_input;

/* Small n (<= PD_FP8_GEMV_MAX_N): out[n][m] = f(x . w^T + bias), the weight streamed once in
 * 16-byte loads, the products on the tensor cores; f as pd_linear_args (swiglu: w has 2m rows;
 * accumulate). Needs compute capability 8.0 and up, k % 16 == 0, a group of k (ng == 1) or a
 * multiple of 128, and 16-byte aligned rows (pd_cuda__fp8_gemv_can). */
#define PD_FP8_GEMV_MAX_N 8
bool pd_cuda__fp8_gemv_can(const pd_cuda_ctx *c, const pd_fp8_weight *w, const pd_fp8_input *in,
                           int32_t n);
cudaError_t pd_cuda__fp8_launch_gemv(const pd_fp8_weight *w, const pd_fp8_input *in,
                                     const bf16 *bias, bf16 *out, int32_t n, int32_t m,
                                     bool swiglu, bool accumulate, cudaStream_t stream);
/* n <= PD_FP8_GEMV_ROWS_MAX_N (cuda_fp8_gemv_rows.cu): a warp a 4 whole weight rows, faster at
 * one or two rows than the k-split kernel; pd_cuda__fp8_launch_gemv hands such n to it. */
#define PD_FP8_GEMV_ROWS_MAX_N 2
cudaError_t pd_cuda__fp8_launch_gemv_rows(const pd_fp8_weight *w, const pd_fp8_input *in,
                                          const bf16 *bias, bf16 *out, int32_t n, int32_t m,
                                          bool swiglu, bool accumulate, cudaStream_t stream);

/* One of moe_experts' two products over every group (cuda_fp8_moe.cu): out[choices][M] from
 * the bf16 rows x (gathered by rows, or the groups' own when rows is NULL; quantized in the
 * kernel as w->act says) and each expert's rows of the stacked weight w ([E * 2M][k] with
 * swiglu, else [E * M][k]); n: the step's token rows (a group's most), nk: the choices. Needs
 * k % 16 == 0, a group of k or a multiple of 16 and 16-byte aligned rows. */
cudaError_t pd_cuda__fp8_launch_moe(const pd_fp8_weight *w, const bf16 *x, const int32_t *rows,
                                    const int32_t *off, int32_t E, int32_t n, int64_t nk,
                                    int32_t M, bool swiglu, bf16 *out, cudaStream_t stream);

/* Whether the grouped e4m3 GEMMs of cuda_fp8_moe.cu take w (an sm_90a build on compute
 * capability 9.0; quantized input rows; a scale a row or groups of 128). */
bool pd_cuda__fp8_moe_gemm_can(const pd_cuda_ctx *c, const pd_fp8_weight *w);
/* One of moe_experts' two products as grouped GEMMs: out[choices][M] from the quantized rows
 * xq [nx][k] with scales xs [ng][nx] (gathered by rows, or the groups' own when rows is NULL)
 * and w as pd_cuda__fp8_launch_moe takes it. */
cudaError_t pd_cuda__fp8_launch_moe_gemm(const pd_fp8_weight *w, const uint8_t *xq,
                                         const float *xs, int32_t nx, const int32_t *rows,
                                         const int32_t *off, int32_t E, int64_t nk, int32_t M,
                                         bool swiglu, bf16 *out, cudaStream_t stream);

/* Any shape, any group (the fallback where cuBLASLt takes a product not): out[n][w->m] =
 * x . w^T (+ bias) (+ out when accumulate), f32 products of the dequantized values, rounded
 * once. */
cudaError_t pd_cuda__fp8_launch_tile(const pd_fp8_weight *w, const pd_fp8_input *in,
                                     const bf16 *bias, bf16 *out, int32_t n, bool accumulate,
                                     cudaStream_t stream);

#endif
