/* cuda_common.cuh -- Internal to the .cu files of the CUDA backend: the context behind the
 * op table's void *ctx, the check macros every CUDA and cuBLAS call goes through, and small
 * device helpers (bf16 conversion, warp and block sums). Never included by C code. */
#ifndef PD_CUDA_COMMON_CUH
#define PD_CUDA_COMMON_CUH

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

extern "C" {
#include "common/dtype.h"
#include "common/env.h"
#include "common/error.h"
#include "common/log.h"
}
#include "kernels/cuda/cuda_ops.h"

typedef __nv_bfloat16 bf16;

/* decode_layers' greedy picks (pd_decode_args' pick_ids / pick_slot): where a forward left
 * them, for the sample ops to take instead of sampling. */
#define PD_PICK_ROWS 8  /* rows a pick slot holds (decode_layers' most) */
#define PD_PICK_SLOTS 3 /* sample_launch's two, then the sample op's (PD_SAMPLE_SYNC_SLOT) */
typedef struct {
    bool on;
    const void *logits;    /* the logits they were picked from, */
    int32_t n, vocab;      /* their rows and width, */
    const int32_t *ids;    /* and where the picks went as the next step's ids */
} pd_cuda_pick;

typedef struct {
    int32_t device;        /* CUDA ordinal */
    cudaStream_t stream;   /* every op is queued here */
    cublasHandle_t cublas; /* bound to stream */
    void *staging;         /* pinned host memory for conversions on the way in and out */
    size_t staging_bytes;  /* size of staging */
    int sm_count;          /* multiprocessors (sizes the split-KV decode grid) */
    int cc_major;          /* compute capability major (the tensor-core kernels need 8+) */
    int cc_minor;          /* and minor (sm_90a code: exactly 9.0) */
    int smem_optin;        /* shared memory a block may opt in to, bytes */
    bool split_kv;         /* split-KV decode attention on (PDSERVE_CUDA_SPLIT_KV=0: off) */
    int decode_blocks_per_sm; /* the split count aims at this many blocks per SM
                               * (PDSERVE_CUDA_DECODE_BLOCKS_PER_SM; 0 = by kernel) */
    int decode_stages;     /* the decode kernel's cp.async ring (PDSERVE_CUDA_DECODE_STAGES:
                            * 0 = the register kernel, else 2 (default) or 4 slots) */
    int decode_mma_stages; /* the tensor-core decode kernel's ring on sm_90
                            * (PDSERVE_CUDA_DECODE_MMA: 2 - 4 slots, 0 = off) */
    float *attn_part;      /* split-KV decode workspace: partial outputs, maxima and sums */
    size_t attn_part_floats;
    int32_t *attn_count;   /* zeroed counters of the decode kernel's inline combine, one per
                            * (sequence, KV head) */
    size_t attn_count_n;
    unsigned *dl_counters; /* decode_layers' counters: [0] blocks done (zero between
                            * launches), [1] launches (the flags' epoch) */
    void *dl_ll;           /* decode_layers' flagged exchange lines (zeroed at creation) */
    unsigned long long *dl_best; /* decode_layers' picks in the making: a key a row (zero
                                  * between launches) */
    int32_t *pick_host;    /* [PD_PICK_SLOTS][PD_PICK_ROWS] picks by sample slot: pinned, */
    int32_t *pick_dev;     /* and as the device writes it (NULL: not mapped, no picks) */
    pd_cuda_pick pick;     /* the picks the last forward left (graph_launch, decode_layers;
                            * the uploads and the sample ops clear it) */
    pd_cuda_pick cap_pick; /* the picks the graph being captured leaves */
    size_t dl_ll_bytes;
    size_t free_at_create; /* the device's free memory once the context existed (mem_info) */
    void *cublas_ws;       /* cuBLAS's workspace, given explicitly so that captures need no
                            * allocation */
    void *sample_state;    /* cuda_sample.cu's buffers, made on first use (NULL until then) */
    void *fp8_state;       /* the FP8 weight op set's (cuda_fp8_linear.cu: cuBLASLt handle,
                            * workspaces), made by the first FP8 weight_create (NULL until
                            * then) */
    /* upload_rows_overlap (cuda_graph.cu), made on first use: the side stream its copies go
     * on, the event a copy records */
    cudaStream_t side;
    cudaEvent_t ev_upload;
    int32_t *moe_off;      /* moe_route's groups' bounds on the device when the caller
                            * wants the host's copy only (cuda_moe.cu), grown on demand */
    size_t moe_off_n;
} pd_cuda_ctx;

/* A copy queue (copyq_create, cuda_ipc.cu): its own stream, on the context's device; the
 * copyq_blocks and copyq_rows ops queue their copies on it. */
typedef struct {
    int device;
    cudaStream_t stream;
    bool use_memcpy;       /* PDSERVE_KV_COPY=memcpy: copy engine calls instead of kernels */
} pd_copyq;
/* Records an event on q after everything queued on it into *done (cuda_ipc.cu). Returns 0,
 * PD_EBACKEND. */
int pd_cuda__copyq_done(pd_copyq *q, void **done);

/* Tensor parallelism between the GPUs of this process (cuda_comm.cu makes one a rank when
 * every pair of the group's GPUs has peer access; decode_layers sums its partial products
 * through it, pd_decode_args.tp). Each rank's receive area lies on its GPU, zeroed at
 * creation, and every rank writes into the others' through peer memory: [2 stage kinds (o_proj,
 * down)][source rank][row][hidden / 2] flagged lines of two floats. */
#define PD_CUDA_TP_MAX 8
#define PD_CUDA_TP_MAX_ROWS 8       /* rows a step (decode_layers' most) */
#define PD_CUDA_TP_MAX_HIDDEN 16384 /* hidden size the areas are sized for */
typedef struct {
    int32_t rank, n;
    int sm_count;                   /* every rank's GPU has as many (decode_layers' grid) */
    void *recv[PD_CUDA_TP_MAX];     /* rank r's receive area, on its GPU */
    size_t recv_bytes;              /* each */
    const volatile uint32_t *abort; /* host memory mapped on every GPU: nonzero once the
                                     * communicator is aborted (the ops stop waiting) */
    const volatile uint32_t *abort_host; /* the same word, the host's address (the ops
                                          * refuse to launch once it is set) */
} pd_cuda_tp;

/* PDSERVE_CUDA_STEP_TIMING=1 (diagnostics): where a graph step's time goes, with events on the
 * stream at its points (PD_ST_*) and the host's clock around it; averages to stderr every 256
 * steps. mark records point k (PD_ST_START only when no step is open); end closes the step
 * after its final sync. Off: one branch each. */
enum { PD_ST_START, PD_ST_GRAPH, PD_ST_GRAPH_END, PD_ST_COPY, PD_ST_COPY_END, PD_ST_N };
void pd_cuda__steptime_mark(pd_cuda_ctx *c, int k);
void pd_cuda__steptime_end(pd_cuda_ctx *c);

/* Logs a failed CUDA or cuBLAS call with its text, the library's message, file and line. */
void pd_cuda__report(const char *call, const char *msg, const char *file, int line);

/* Runs a CUDA runtime call (or a launcher returning cudaError_t); on failure logs it and
 * returns PD_ENOMEM for an allocation failure, PD_EBACKEND otherwise, from the caller. */
#define PD_CUDA_CHECK(call)                                                            \
    do {                                                                               \
        cudaError_t e_ = (call);                                                       \
        if (e_ != cudaSuccess) {                                                       \
            pd_cuda__report(#call, cudaGetErrorString(e_), __FILE__, __LINE__);        \
            return e_ == cudaErrorMemoryAllocation ? PD_ENOMEM : PD_EBACKEND;          \
        }                                                                              \
    } while (0)

/* The same for cuBLAS calls. */
#define PD_CUBLAS_CHECK(call)                                                          \
    do {                                                                               \
        cublasStatus_t s_ = (call);                                                    \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                             \
            pd_cuda__report(#call, cublasGetStatusString(s_), __FILE__, __LINE__);     \
            return s_ == CUBLAS_STATUS_ALLOC_FAILED ? PD_ENOMEM : PD_EBACKEND;         \
        }                                                                              \
    } while (0)

/* The context behind an op's void *ctx, with its device made current on the calling thread:
 * the engine may run the ops on another thread than the one that created the backend, and
 * each thread starts on device 0. (A failure here resurfaces at the op's first CUDA call.) */
static inline pd_cuda_ctx *pd_cuda__ctx(void *ctx)
{
    pd_cuda_ctx *c = (pd_cuda_ctx *)ctx;
    (void)cudaSetDevice(c->device);
    return c;
}

/* Blocks of 1-D grids: enough to cover n items at `per_block` each, capped for grid-stride
 * loops (a kernel given this must loop). */
static inline unsigned pd_cuda__blocks(size_t n, unsigned per_block)
{
    size_t b = (n + per_block - 1) / per_block;
    if (b < 1) b = 1;
    if (b > 65535u * 16u) b = 65535u * 16u;
    return (unsigned)b;
}

/* Programmatic dependent launch (PDL), on unless PDSERVE_CUDA_PDL=0 (pd_cuda__pdl_on). The
 * kernels of a decode step are launched with pd_cuda__launch, which then lets the next kernel
 * in the stream be scheduled while this one still runs: each such kernel calls pd_pdl_enter()
 * (or pd_pdl_wait()) first, which lets its own successor be scheduled and then waits until its
 * predecessor has completed and its writes are visible; nothing before it may touch global
 * memory. Kernels that never call it are launched with <<<>>> (fully serialised). Without the
 * launch attribute, and on GPUs before sm_90, both are no-ops. */
static __device__ __forceinline__ void pd_pdl_enter(void)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

/* The wait alone, for kernels of several waves of blocks: their successor is scheduled only
 * when they end, so its waiting blocks never take the slots of their last wave. */
static __device__ __forceinline__ void pd_pdl_wait(void)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

bool pd_cuda__pdl_on(void); /* cuda_context.cu: PDSERVE_CUDA_PDL, read once */
/* cuda_context.cu: whether the on-by-default switch `name` is on (=0 turns it off), read once
 * into *cache (-1 before) */
bool pd_cuda__switch_on(const char *name, int *cache);

/* kernel<<<grid, block, smem, stream>>>(args...) with the launch attributes attrs[n_attrs].
 * pd_cuda__launch: the same with the programmatic-serialisation attribute when PDL is on and
 * the grid is small (PD_PDL_MAX_BLOCKS: the latency-bound launches of a
 * decode step; the successor of a grid of several waves would park its blocks in the slots
 * of the last wave: slower on the 256-request workload, docs/perf-history.md, the issue #8
 * benchmark suite after graphs). Returns the launch's error. */
#define PD_PDL_MAX_BLOCKS 1024
template <typename... KArgs, typename... Args>
static inline cudaError_t pd_cuda__launch_attrs(void (*kernel)(KArgs...), dim3 grid, dim3 block,
                                                size_t smem, cudaStream_t stream,
                                                cudaLaunchAttribute *attrs, unsigned n_attrs,
                                                Args... args)
{
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cfg.attrs = attrs;
    cfg.numAttrs = n_attrs;
    return cudaLaunchKernelEx(&cfg, kernel, static_cast<KArgs>(args)...);
}

template <typename... KArgs, typename... Args>
static inline cudaError_t pd_cuda__launch(void (*kernel)(KArgs...), dim3 grid, dim3 block,
                                          size_t smem, cudaStream_t stream, Args... args)
{
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    const bool pdl = pd_cuda__pdl_on() && (size_t)grid.x * grid.y * grid.z <= PD_PDL_MAX_BLOCKS;
    return pd_cuda__launch_attrs(kernel, grid, block, smem, stream, attr, pdl ? 1u : 0u,
                                 args...);
}

static __device__ __forceinline__ float pd_ld(const bf16 *p) { return __bfloat162float(*p); }
static __device__ __forceinline__ void pd_st(bf16 *p, float v) { *p = __float2bfloat16_rn(v); }

static __device__ __forceinline__ float pd_warp_sum(float v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

static __device__ __forceinline__ float pd_warp_max(float v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* Sum over the whole block (blockDim.x a multiple of 32, at most 1024); every thread gets the
 * result. Uses 33 floats of shared memory and two barriers. */
static __device__ __forceinline__ float pd_block_sum(float v)
{
    __shared__ float part[32];
    __shared__ float total;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = pd_warp_sum(v);
    if (lane == 0) part[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float s = lane < (int)(blockDim.x >> 5) ? part[lane] : 0.0f;
        s = pd_warp_sum(s);
        if (lane == 0) total = s;
    }
    __syncthreads();
    return total;
}

/* The two bf16 of a 32-bit word in fp32, as shifts (the bits are the high half): exact, and
 * cheaper than cvt. */
static __device__ __forceinline__ float pd_bf16_lo(uint32_t u) { return __uint_as_float(u << 16); }
static __device__ __forceinline__ float pd_bf16_hi(uint32_t u)
{
    return __uint_as_float(u & 0xffff0000u);
}

/* The sum of squares of 8 bf16 (16 bytes), in fp32. */
static __device__ __forceinline__ float pd_sumsq8(uint4 a)
{
    const uint32_t u[4] = {a.x, a.y, a.z, a.w};
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float lo = pd_bf16_lo(u[i]), hi = pd_bf16_hi(u[i]);
        s = fmaf(lo, lo, fmaf(hi, hi, s));
    }
    return s;
}

/* ---- tensor cores ---- */

/* d += A . B for a 16x16 A (rows g and g + 8 in a0/a2 and a1/a3) and a 16x8 B, both bf16
 * (F16 false) or both f16, in f32. */
#define PD_MMA16816(ty)                                                                        \
    asm("mma.sync.aligned.m16n8k16.row.col.f32." ty "." ty ".f32 {%0, %1, %2, %3}, "           \
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"                                        \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                       \
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1))
template <bool F16>
static __device__ __forceinline__ void mma_16816(float (&d)[4], uint32_t a0, uint32_t a1,
                                                 uint32_t a2, uint32_t a3, uint32_t b0,
                                                 uint32_t b1)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    if constexpr (F16) PD_MMA16816("f16");
    else PD_MMA16816("bf16");
#else
    (void)d; (void)a0; (void)a1; (void)a2; (void)a3; (void)b0; (void)b1;
    __trap(); /* the host takes this path only on compute capability 8.0 and up */
#endif
}
#undef PD_MMA16816

static __device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1,
                                                uint32_t a2, uint32_t a3, uint32_t b0,
                                                uint32_t b1)
{
    mma_16816<false>(d, a0, a1, a2, a3, b0, b1);
}

/* ---- cp.async (sm_80 and up): the K/V tiles of the attention kernels ---- */

/* 16 bytes global -> shared, bypassing L1; with ok false nothing is read and zeros land. */
static __device__ __forceinline__ void pd_cp16(void *dst, const void *src, bool ok)
{
    const unsigned s = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src),
                 "r"(ok ? 16 : 0));
}

static __device__ __forceinline__ void pd_cp_commit(void)
{
    asm volatile("cp.async.commit_group;\n" ::);
}

/* Waits until at most N of this thread's newest copy groups are still in flight. */
template <int N>
static __device__ __forceinline__ void pd_cp_wait(void)
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

/* ---- ldmatrix, exp2, packing (sm_80 and up): the tensor-core attention kernels ---- */

/* 2^x on the special-function unit (2^-inf = 0); the softmax needs no more precision than
 * the bf16 P it feeds. */
static __device__ __forceinline__ float pd_exp2(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

/* Four 8x8 b16 matrices from shared memory; lane l gives the address of row l % 8 of matrix
 * l / 8. With trans each matrix arrives transposed. */
static __device__ __forceinline__ void pd_ldsm4(unsigned r[4], const bf16 *p)
{
    const unsigned s = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

static __device__ __forceinline__ void pd_ldsm4t(unsigned r[4], const bf16 *p)
{
    const unsigned s = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

/* mma_bf16 with A's four registers in an array. */
static __device__ __forceinline__ void pd_mma16816(float (&d)[4], const unsigned (&a)[4],
                                                   unsigned b0, unsigned b1)
{
    mma_bf16(d, a[0], a[1], a[2], a[3], b0, b1);
}

static __device__ __forceinline__ unsigned pd_pack_bf16(float lo, float hi)
{
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const unsigned *>(&v);
}

/* The row-parallel RMSNorm (cuda_rmsnorm.cu's vector kernel: PD_RMSNORM_THREADS threads a row,
 * 16-byte chunks, chunk j of a row in thread j % PD_RMSNORM_THREADS) takes n rows of dim
 * when this holds and its buffers are 16-byte aligned; the FP8 op set's fused norm +
 * quantization runs exactly where it does, with the same reduction (the same bits). */
#define PD_RMSNORM_THREADS 256
static inline bool pd_rmsnorm_vec_fits(int32_t n, int32_t dim, int sm_count)
{
    return n >= sm_count && dim % 8 == 0 && dim <= 8 * PD_RMSNORM_THREADS * 8;
}

/* RMSNorm's element rule on 8 bf16 (16 bytes): bf16(w * (x * r)) each, r the row's
 * 1 / rms. The norm kernels and the FP8 op set's fused norm + quantization share it, so
 * the fused form writes the same bits. */
static __device__ __forceinline__ uint4 pd_rmsnorm8(uint4 x, uint4 w, float r)
{
    const uint32_t xa[4] = {x.x, x.y, x.z, x.w};
    const uint32_t wa[4] = {w.x, w.y, w.z, w.w};
    uint32_t o[4];
#pragma unroll
    for (int e = 0; e < 4; e++)
        o[e] = pd_pack_bf16(pd_bf16_lo(wa[e]) * (pd_bf16_lo(xa[e]) * r),
                            pd_bf16_hi(wa[e]) * (pd_bf16_hi(xa[e]) * r));
    return make_uint4(o[0], o[1], o[2], o[3]);
}

/* A row's 1 / rms from each thread's partial sum of squares (the whole block's threads
 * call it): the block sum, then 1 / sqrt(ss / dim + eps) in double. */
static __device__ __forceinline__ float pd_rms_inv(float ss_part, int32_t dim, float eps)
{
    const float ss = pd_block_sum(ss_part);
    return (float)(1.0 / sqrt((double)ss / dim + eps));
}

/* SwiGLU's element rule: silu(g) * u in fp32, with the hardware's exp2 and reciprocal
 * (__expf, __fdividef: a few ulp of fp32, far below the bf16 rounding of the result; g below
 * about -87 gives 0). The IEEE expf and division made a prefill's SwiGLU bound by its
 * instructions, not its bytes (docs/perf-history.md, "FP8 prefill: the quantization fused
 * into its producers"). */
static __device__ __forceinline__ float pd_silu_mul(float g, float u)
{
    return __fdividef(g, 1.0f + __expf(-g)) * u;
}

/* SwiGLU's element rule on 8 gate and 8 up values: bf16(pd_silu_mul(g, u)) each (the swiglu
 * op's; the FP8 op set's fused SwiGLU + quantization shares it). */
static __device__ __forceinline__ uint4 pd_swiglu8(uint4 gv, uint4 uv)
{
    const __nv_bfloat162 *g2 = reinterpret_cast<const __nv_bfloat162 *>(&gv);
    const __nv_bfloat162 *u2 = reinterpret_cast<const __nv_bfloat162 *>(&uv);
    uint4 ov;
    __nv_bfloat162 *o2 = reinterpret_cast<__nv_bfloat162 *>(&ov);
#pragma unroll
    for (int e = 0; e < 4; e++) {
        const float2 x = __bfloat1622float2(g2[e]), u = __bfloat1622float2(u2[e]);
        o2[e] = __floats2bfloat162_rn(pd_silu_mul(x.x, u.x), pd_silu_mul(x.y, u.y));
    }
    return ov;
}

/* A 16-byte line of global memory as it is now (a volatile load: polled until its writer's
 * flags show; decode_layers' exchanges). */
static __device__ __forceinline__ uint4 pd_ld_volatile4(const void *p)
{
    uint4 v;
    asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p)
                 : "memory");
    return v;
}

/* Its store: the 16 bytes of v at p in one volatile store. */
static __device__ __forceinline__ void pd_st_volatile4(void *p, uint4 v)
{
    asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x),
                 "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

/* ---- mbarriers and bulk copies (sm_90) ---- */

static __device__ __forceinline__ uint32_t pd_smem_u32(const void *p)
{
    return (uint32_t)__cvta_generic_to_shared(p);
}

static __device__ __forceinline__ void pd_mbar_init(uint64_t *b, uint32_t count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(pd_smem_u32(b)), "r"(count));
}

static __device__ __forceinline__ void pd_mbar_arrive(uint64_t *b)
{
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(pd_smem_u32(b)) : "memory");
}

static __device__ __forceinline__ void pd_mbar_expect_tx(uint64_t *b, uint32_t bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(pd_smem_u32(b)),
                 "r"(bytes) : "memory");
}

/* Waits until the phase of the given parity has completed. */
static __device__ __forceinline__ void pd_mbar_wait(uint64_t *b, uint32_t parity)
{
    asm volatile("{\n"
                 ".reg .pred p;\n"
                 "PD_WAIT:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
                 "@!p bra PD_WAIT;\n"
                 "}\n" ::"r"(pd_smem_u32(b)),
                 "r"(parity)
                 : "memory");
}

/* bytes (a multiple of 16, 16-byte aligned ends) global -> shared, counted on b. */
static __device__ __forceinline__ void pd_bulk_load(void *dst, const void *src, uint32_t bytes,
                                                    uint64_t *b)
{
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
                 "[%0], [%1], %2, [%3];" ::"r"(pd_smem_u32(dst)),
                 "l"(src), "r"(bytes), "r"(pd_smem_u32(b))
                 : "memory");
}

/* An L2 cache policy: lines it loads are the first evicted (a stream read once, that should
 * not push out what is read again). */
static __device__ __forceinline__ uint64_t pd_policy_evict_first(void)
{
    uint64_t pol;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    return pol;
}

/* The default L2 policy, as a policy operand (A/B runs against evict-first). */
static __device__ __forceinline__ uint64_t pd_policy_evict_normal(void)
{
    uint64_t pol;
    asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(pol));
    return pol;
}

/* pd_bulk_load under an L2 cache policy. */
static __device__ __forceinline__ void pd_bulk_load_hint(void *dst, const void *src,
                                                         uint32_t bytes, uint64_t *b, uint64_t pol)
{
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint "
                 "[%0], [%1], %2, [%3], %4;" ::"r"(pd_smem_u32(dst)),
                 "l"(src), "r"(bytes), "r"(pd_smem_u32(b)), "l"(pol)
                 : "memory");
}

/* Prefetches the line holding p into L2. */
static __device__ __forceinline__ void pd_prefetch_l2(const void *p)
{
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

#endif
