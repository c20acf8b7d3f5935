/* cuda_copy_rows.cu -- The copyq_rows op: strided block copies on a copy queue's stream, the
 * gather and scatter of a tensor-parallel rank's KV heads between its cache and the
 * whole-layout slots of kvtransfer's staging ring (pinned host memory, mapped).
 *
 * Why a kernel: a rank's share of a block is block_size short runs (its heads' bytes of each
 * token row), and a slot holds up to 64 blocks; one cudaMemcpy2DAsync per block costs
 * microseconds of launch each, while one launch moves the slot. The block lists ride in the
 * kernel's parameters, as copyq_blocks' do. PDSERVE_KV_COPY=memcpy uses one
 * cudaMemcpy2DAsync per block instead (for comparison). */
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_common.cuh"

#define CR_MAX_PAIRS 1024 /* blocks per launch: 8 KiB of ids in the parameters */
#define CR_THREADS 256

typedef struct {
    char *dst;
    const char *src;
    uint64_t dst_block, src_block;  /* bytes from one block to the next */
    uint64_t dst_pitch, src_pitch;  /* bytes from one row to the next */
    uint64_t dst_off, src_off;      /* row 0's offset in a block */
    uint32_t rows, row_words;       /* rows a block, words of W a row */
    int32_t n;
    int32_t dst_ids[CR_MAX_PAIRS];
    int32_t src_ids[CR_MAX_PAIRS];
} cr_args;

/* One CUDA block per copied block: its rows in words of W (the widest that every address,
 * size, pitch and offset is a multiple of). */
template <typename W>
static __global__ void cr_kernel(const __grid_constant__ cr_args a)
{
    const int i = (int)blockIdx.x;
    const char *s = a.src + (size_t)a.src_ids[i] * a.src_block + a.src_off;
    char *d = a.dst + (size_t)a.dst_ids[i] * a.dst_block + a.dst_off;
    const size_t total = (size_t)a.rows * a.row_words;
    for (size_t k = threadIdx.x; k < total; k += blockDim.x) {
        const size_t t = k / a.row_words, w = k % a.row_words;
        ((W *)(d + t * a.dst_pitch))[w] = ((const W *)(s + t * a.src_pitch))[w];
    }
}

/* Launches the copy of a->n blocks (at most CR_MAX_PAIRS) in words of `word` bytes. */
static cudaError_t cr_launch(const cr_args *a, size_t word, cudaStream_t stream)
{
    const dim3 grid((unsigned)a->n), block(CR_THREADS);
    switch (word) {
    case 16: cr_kernel<uint4><<<grid, block, 0, stream>>>(*a); break;
    case 8: cr_kernel<uint2><<<grid, block, 0, stream>>>(*a); break;
    case 4: cr_kernel<uint32_t><<<grid, block, 0, stream>>>(*a); break;
    case 2: cr_kernel<uint16_t><<<grid, block, 0, stream>>>(*a); break;
    default: cr_kernel<uint8_t><<<grid, block, 0, stream>>>(*a); break;
    }
    return cudaGetLastError();
}

/* The widest word (16, 8, 4, 2 or 1 bytes) dividing every address, size, pitch and offset. */
static size_t word_of(const pd_copy_rows *a)
{
    const uint64_t all = (uint64_t)(uintptr_t)a->dst | (uint64_t)(uintptr_t)a->src |
                         a->row_bytes | a->dst_block_bytes | a->src_block_bytes | a->dst_pitch |
                         a->src_pitch | a->dst_offset | a->src_offset;
    size_t w = 16;
    while (w > 1 && all % w) w /= 2;
    return w;
}

extern "C" int pd_cuda__copyq_rows(void *ctx, void *qv, void *after, const pd_copy_rows *a,
                                   void **done)
{
    (void)pd_cuda__ctx(ctx);
    pd_copyq *q = (pd_copyq *)qv;
    if (!q || !done || !pd_copy_rows_valid(a) || a->rows > (1u << 30)) return PD_EINVAL;
    for (int32_t i = 0; i < a->n; i++)
        if (a->dst_ids[i] < 0 || a->src_ids[i] < 0) return PD_EINVAL;
    const size_t word = word_of(a);
    if (a->row_bytes / word > (1u << 30)) return PD_EINVAL;
    if (after) PD_CUDA_CHECK(cudaStreamWaitEvent(q->stream, (cudaEvent_t)after, 0));
    if (q->use_memcpy) {
        for (int32_t i = 0; i < a->n; i++)
            PD_CUDA_CHECK(cudaMemcpy2DAsync(
                (char *)a->dst + (size_t)a->dst_ids[i] * a->dst_block_bytes + a->dst_offset,
                a->dst_pitch,
                (const char *)a->src + (size_t)a->src_ids[i] * a->src_block_bytes + a->src_offset,
                a->src_pitch, a->row_bytes, a->rows, cudaMemcpyDefault, q->stream));
    } else if (a->n > 0) {
        cr_args *k = (cr_args *)malloc(sizeof *k); /* 8 KiB: not on the stack */
        if (!k) return PD_ENOMEM;
        k->dst = (char *)a->dst;
        k->src = (const char *)a->src;
        k->dst_block = a->dst_block_bytes;
        k->src_block = a->src_block_bytes;
        k->dst_pitch = a->dst_pitch;
        k->src_pitch = a->src_pitch;
        k->dst_off = a->dst_offset;
        k->src_off = a->src_offset;
        k->rows = (uint32_t)a->rows;
        k->row_words = (uint32_t)(a->row_bytes / word);
        for (int32_t i0 = 0; i0 < a->n; i0 += CR_MAX_PAIRS) {
            const int32_t m = a->n - i0 < CR_MAX_PAIRS ? a->n - i0 : CR_MAX_PAIRS;
            k->n = m;
            memcpy(k->dst_ids, a->dst_ids + i0, (size_t)m * sizeof(int32_t));
            memcpy(k->src_ids, a->src_ids + i0, (size_t)m * sizeof(int32_t));
            cudaError_t e = cr_launch(k, word, q->stream);
            if (e != cudaSuccess) {
                free(k);
                PD_CUDA_CHECK(e);
            }
        }
        free(k);
    }
    return pd_cuda__copyq_done(q, done);
}
