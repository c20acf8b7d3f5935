/* cuda_moe.cuh -- Internal to the mixture-of-experts kernels (cuda_moe.cu: bf16 experts;
 * cuda_fp8_moe.cu: the FP8 op set's): the grid's walk over the experts' groups, the SwiGLU
 * rounding and the grouped GEMMs' weight rows they share. Never included by C code. */
#ifndef PD_CUDA_MOE_CUH
#define PD_CUDA_MOE_CUH

#include "kernels/cuda/cuda_common.cuh"

/* Which expert, and which of its row tiles, grid index g names: expert e's group of ne rows
 * makes ceil(ne / unit) tiles, numbered expert by expert. Returns e (*sub the tile), or -1
 * past the last tile. Every thread of the block calls it (blockDim a multiple of 32). */
static __device__ int32_t pd_moe_find_tile(const int32_t *off, int32_t E, int32_t unit,
                                           int32_t g, int32_t *sub)
{
    __shared__ int32_t s_e, s_sub, s_tot[32];
    const int warp = (int)threadIdx.x / 32, lane = (int)threadIdx.x % 32, nw = (int)blockDim.x / 32;
    if (threadIdx.x == 0) s_e = -1;
    int32_t base = 0;
    for (int32_t e0 = 0; e0 < E; e0 += blockDim.x) {
        const int32_t e = e0 + (int32_t)threadIdx.x;
        const int32_t ne = e < E ? off[e + 1] - off[e] : 0;
        const int32_t c = (ne + unit - 1) / unit;
        int32_t v = c;
        for (int d = 1; d < 32; d <<= 1) {
            const int32_t y = __shfl_up_sync(0xffffffffu, v, d);
            if (lane >= d) v += y;
        }
        if (lane == 31) s_tot[warp] = v;
        __syncthreads();
        int32_t wbase = 0, total = 0;
        for (int w = 0; w < nw; w++) {
            wbase += w < warp ? s_tot[w] : 0;
            total += s_tot[w];
        }
        const int32_t excl = base + wbase + v - c;
        if (c > 0 && g >= excl && g < excl + c) {
            s_e = e;
            s_sub = g - excl;
        }
        base += total;
        __syncthreads();
    }
    *sub = s_sub;
    return s_e;
}

/* A gate and up product's SwiGLU as linear_fused computes it: both rounded to bf16 (its
 * gate/up rows), then pd_silu_mul. */
static __device__ __forceinline__ float pd_moe_swiglu_rounded(float g, float u)
{
    return pd_silu_mul(__bfloat162float(__float2bfloat16_rn(g)),
                       __bfloat162float(__float2bfloat16_rn(u)));
}

/* Weight row r (0 .. 256) of a grouped GEMM's tile whose first output column is c0: which
 * row of the expert's W it reads (*col its output column, >= M past the end). SWIGLU pairs
 * each column's gate and up rows in one warpgroup's 128 rows: BM 128, gate rows 0 .. 127 and
 * up rows 128 .. 255 (the two accumulators of each warpgroup); BM 64, warpgroup w's rows
 * 128 w .. + 63 the gates of columns 64 w .. + 63 and the next 64 their ups (one
 * accumulator). */
template <bool SWIGLU, int BM>
static __device__ __forceinline__ int32_t pd_moe_gm_wrow(int r, int32_t c0, int32_t M,
                                                        int32_t *col)
{
    if (!SWIGLU) {
        *col = c0 + r;
        return *col;
    }
    const bool up = BM == 128 ? r >= 128 : (r & 127) >= 64;
    *col = c0 + (BM == 128 ? (r & 127) : 64 * (r >> 7) + (r & 63));
    return (up ? M : 0) + *col;
}

#endif
