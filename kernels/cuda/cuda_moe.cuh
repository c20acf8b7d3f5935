/* cuda_moe.cuh -- Internal to the mixture-of-experts kernels (cuda_moe.cu: bf16 experts;
 * cuda_fp8_moe.cu: the FP8 op set's): the grid's walk over the experts' groups, the SwiGLU
 * rounding, the row-streaming kernels' and the grouped GEMMs' stores they share. Never
 * included by C code. */
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

/* A row-streaming kernel's warp's outputs (cuda_moe.cu's and cuda_fp8_moe.cu's: 4 weight rows
 * a warp, ok[q] whether row q is in range; SWIGLU, rows 0, 1 the gates and 2, 3 the ups of
 * columns i0, i0 + 1, else the four columns from i0) for the tile's nr rows, summed over
 * the warp and stored by lane 0 into out's rows r0 ... */
template <bool SWIGLU, int RT>
static __device__ __forceinline__ void pd_moe_gv_store(float (&acc)[4][RT], const bool (&ok)[4],
                                                       int32_t nr, int lane, int32_t i0,
                                                       int32_t r0, int32_t M, bf16 *out)
{
#pragma unroll
    for (int r = 0; r < RT; r++) {
        if (r >= nr) break;
#pragma unroll
        for (int q = 0; q < 4; q++) acc[q][r] = pd_warp_sum(acc[q][r]);
        if (lane != 0) continue;
        bf16 *o = out + (size_t)(r0 + r) * M;
#pragma unroll
        for (int q = 0; q < (SWIGLU ? 2 : 4); q++) {
            if (!ok[q]) continue;
            if (SWIGLU)
                pd_st(o + i0 + q, pd_moe_swiglu_rounded(acc[q][r], acc[q + 2][r]));
            else
                pd_st(o + i0 + q, acc[q][r]);
        }
    }
}

/* A grouped GEMM's outputs (cuda_moe.cu's and cuda_fp8_moe.cu's tiles: NB 64 x 128
 * accumulators a warpgroup, laid out as wgmma leaves them) into out's rows r0 .. r0 + nr,
 * columns from c0: SWIGLU, each column's gate and up (pd_moe_gm_wrow's pairing) as
 * pd_moe_swiglu_rounded; else the sums, rounded to bf16. */
template <bool SWIGLU, int BM, int NB>
static __device__ __forceinline__ void pd_moe_gm_store(const float (&d)[NB][16][4], int wg,
                                                       int warp, int lane, int32_t nr,
                                                       int32_t r0, int32_t c0, int32_t M,
                                                       bf16 *out)
{
    const int g = lane / 4, q = lane % 4;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int32_t i = (BM == 128 ? wg * 64 : 0) + (warp & 3) * 16 + g + 8 * h; /* tile row */
        if (i >= nr) continue;
        bf16 *o = out + (size_t)(r0 + i) * M;
        if (SWIGLU) {
            /* gate from d[0][j] and up from d[1][j] (BM 128), or d[0][j] and d[0][j + 8] */
            constexpr int NJ = BM == 128 ? 16 : 8;
#pragma unroll
            for (int j = 0; j < NJ; j++) {
                const int32_t col = c0 + (BM == 128 ? 0 : 64 * wg) + 8 * j + 2 * q;
                if (col >= M) continue;
                const float *gv = d[0][j], *uv = BM == 128 ? d[NB - 1][j] : d[0][j + NJ];
                float v[2];
#pragma unroll
                for (int u = 0; u < 2; u++)
                    v[u] = pd_moe_swiglu_rounded(gv[2 * h + u], uv[2 * h + u]);
                if (col + 1 < M)
                    *reinterpret_cast<unsigned *>(o + col) = pd_pack_bf16(v[0], v[1]);
                else
                    pd_st(o + col, v[0]);
            }
        } else {
#pragma unroll
            for (int b = 0; b < NB; b++)
#pragma unroll
                for (int j = 0; j < 16; j++) {
                    const int32_t col = c0 + 128 * (BM == 128 ? b : wg) + 8 * j + 2 * q;
                    const float *dv = d[b][j];
                    if (col + 1 < M)
                        *reinterpret_cast<unsigned *>(o + col) =
                            pd_pack_bf16(dv[2 * h], dv[2 * h + 1]);
                    else if (col < M)
                        pd_st(o + col, dv[2 * h]);
                }
        }
    }
}

#endif
