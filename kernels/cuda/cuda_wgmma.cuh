/* cuda_wgmma.cuh -- Hopper's warpgroup matrix products (wgmma, sm_90a only): a warpgroup (4
 * warps, 128 threads) computes a 64 x N x 16 product, A from registers (each warp its 16 rows,
 * the layout of mma.sync's m16n8k16 A fragment) and B from shared memory through a matrix
 * descriptor, into fp32 accumulators laid out as mma.sync's m16n8 ones repeated over N / 8
 * column blocks (d[j][0..1]: row g, columns 8j + 2q, +1; d[j][2..3]: row g + 8). The
 * instructions run asynchronously: pd_wg_fence before them (after any write of the registers
 * they read or accumulate into), pd_wg_commit after, pd_wg_wait<0> before the accumulators are
 * read. Shared memory written by ordinary stores or cp.async is made visible to them by
 * pd_fence_proxy_async (each writing thread, before the barrier that publishes the tile).
 *
 * The layout this file's users give B: 128-byte swizzled rows. A region is [R rows][128 bytes]
 * (64 bf16), 1024-byte aligned; 16-byte chunk c of row r sits at chunk c ^ (r & 7) (pd_wg_swz).
 * Such a region read with rows as N and the bytes as K (K-major: B = K^T for S = Q K^T) takes
 * pd_wg_desc(start, 16, 1024), the start advanced 32 bytes per 16 of K; read with rows as K
 * and the bytes as N (MN-major, TRANS = 1: B = V for O = P V) it takes
 * pd_wg_desc(start, region stride, 1024), the start advanced 16 rows per 16 of K. */
#pragma once

#include <stdint.h>

/* Element offset of 16-byte chunk c (8 bf16) of row r in regions of R rows of 64 bf16: chunks
 * 8 .. 15 of a row go to the next region. */
template <int R>
static __device__ __forceinline__ int pd_wg_swz(int r, int c)
{
    return (c >> 3) * (R * 64) + r * 64 + (((c & 7) ^ (r & 7)) << 3);
}

/* A shared-memory matrix descriptor: 128-byte swizzle, the start address, the leading and
 * stride byte offsets (multiples of 16). */
static __device__ __forceinline__ uint64_t pd_wg_desc(const void *smem, uint32_t lbo,
                                                      uint32_t sbo)
{
    const uint32_t s = (uint32_t)__cvta_generic_to_shared(smem);
    return (uint64_t)((s & 0x3ffffu) >> 4) | ((uint64_t)((lbo >> 4) & 0x3fffu) << 16) |
           ((uint64_t)((sbo >> 4) & 0x3fffu) << 32) | (1ull << 62);
}

static __device__ __forceinline__ void pd_fence_proxy_async(void)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

static __device__ __forceinline__ void pd_wg_fence(void)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}

static __device__ __forceinline__ void pd_wg_commit(void)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}

template <int N>
static __device__ __forceinline__ void pd_wg_wait(void)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}

/* Keeps the compiler from moving reads or writes of accumulators across the asynchronous
 * products (an empty asm that "changes" them). */
template <int NB>
static __device__ __forceinline__ void pd_wg_hold(float (&d)[NB][4])
{
#pragma unroll
    for (int j = 0; j < NB; j++)
        asm volatile("" : "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])::"memory");
}

template <int N>
static __device__ __forceinline__ void pd_wg_hold_u(unsigned (&a)[N][4])
{
#pragma unroll
    for (int j = 0; j < N; j++)
        asm volatile("" : "+r"(a[j][0]), "+r"(a[j][1]), "+r"(a[j][2]), "+r"(a[j][3])::"memory");
}

/* d (+)= A . B, 64 x N x 16 bf16 products in fp32: scale_d 0 overwrites d, else accumulates;
 * TRANS 1 reads B MN-major. */
template <int TRANS>
static __device__ __forceinline__ void pd_wgmma_n64(float (&d)[8][4], const unsigned (&a)[4],
                                                 uint64_t desc, int scale_d)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
                 "}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
                 : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
                   "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
                   "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
                   "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
                   "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
                   "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
                   "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
                   "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d),
                   "n"(TRANS));
#else
    (void)d; (void)a; (void)desc; (void)scale_d;
    __trap(); /* the host takes this path only on sm_90a builds on compute capability 9.0 */
#endif
}

/* The 64 accumulator operands of a 64 x 128 product (d[16][4]) in an asm statement, and
 * their places in its template. */
#define PD_WG_D128_REGS                                                                    \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "               \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "     \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "     \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define PD_WG_D4(d, j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
#define PD_WG_D128(d)                                                                      \
    PD_WG_D4(d, 0), PD_WG_D4(d, 1), PD_WG_D4(d, 2), PD_WG_D4(d, 3), PD_WG_D4(d, 4),       \
        PD_WG_D4(d, 5), PD_WG_D4(d, 6), PD_WG_D4(d, 7), PD_WG_D4(d, 8), PD_WG_D4(d, 9),   \
        PD_WG_D4(d, 10), PD_WG_D4(d, 11), PD_WG_D4(d, 12), PD_WG_D4(d, 13),               \
        PD_WG_D4(d, 14), PD_WG_D4(d, 15)

template <int TRANS>
static __device__ __forceinline__ void pd_wgmma_n128(float (&d)[16][4], const unsigned (&a)[4],
                                                 uint64_t desc, int scale_d)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
                 PD_WG_D128_REGS
                 "}, {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
                 : PD_WG_D128(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d),
                   "n"(TRANS));
#else
    (void)d; (void)a; (void)desc; (void)scale_d;
    __trap(); /* the host takes this path only on sm_90a builds on compute capability 9.0 */
#endif
}

/* d (+)= A . B, 64 x 128 x 16 bf16 products in fp32 with A too from shared memory (a_desc:
 * 64 rows of K, K-major, laid out as B's K-major regions above) and B K-major; scale_d 0
 * overwrites d, else accumulates. Nothing in registers but the accumulators, so the next
 * products' operands may be loaded while these run. */
static __device__ __forceinline__ void pd_wgmma_n128_ss(float (&d)[16][4], uint64_t a_desc,
                                                     uint64_t b_desc, int scale_d)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
                 PD_WG_D128_REGS
                 "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : PD_WG_D128(d)
                 : "l"(a_desc), "l"(b_desc), "r"(scale_d));
#else
    (void)d; (void)a_desc; (void)b_desc; (void)scale_d;
    __trap(); /* the host takes this path only on sm_90a builds on compute capability 9.0 */
#endif
}

/* d (+)= A . B over 32 of K in e4m3 (both operands K-major in shared memory, descriptors as
 * pd_wgmma_n128_ss's: a 128-byte row holds 128 codes, the start advanced 32 bytes per step),
 * 64 x 128 products summed in fp32; scale_d 0 overwrites d. */
static __device__ __forceinline__ void pd_wgmma_n128_ss_e4m3(float (&d)[16][4], uint64_t a_desc,
                                                          uint64_t b_desc, int scale_d)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {"
                 PD_WG_D128_REGS
                 "}, %64, %65, p, 1, 1;\n}\n"
                 : PD_WG_D128(d)
                 : "l"(a_desc), "l"(b_desc), "r"(scale_d));
#else
    (void)d; (void)a_desc; (void)b_desc; (void)scale_d;
    __trap(); /* the host takes this path only on sm_90a builds on compute capability 9.0 */
#endif
}
