/* cuda_decode_layers.cuh -- What the persistent decode kernel (cuda_decode_layers.cu, whose
 * opening comment describes it) shares between its host code and the translation units that
 * instantiate it: the limits, the kernel's parameters (dl_params) and the stage shapes. The
 * kernel's device code is cuda_decode_layers_kernel.cuh; CMake makes one translation unit a
 * (head size, weights) pair from cuda_decode_layers_inst.cu.in, each instantiating
 * dl_launch<HD, TP, WQ> for every row-count bound (1, 4, 8) and GQA group bound (2, 4, 8), so
 * that they compile in parallel (one file of all the kernels kept one core busy for most of
 * the backend's build: docs/perf-history.md, "The CUDA backend's build time"). */
#ifndef PD_CUDA_DECODE_LAYERS_CUH
#define PD_CUDA_DECODE_LAYERS_CUH
#include "kernels/cuda/cuda_fp8.cuh"

/* Built with -DPD_DL_TIMING=1, PDSERVE_CUDA_DL_DEBUG=16 prints where the stages' time goes
 * (ts_report); otherwise the timing code is not compiled in (it costs registers). */
#ifndef PD_DL_TIMING
#define PD_DL_TIMING 0
#endif
#define DL_TIMED(p) (PD_DL_TIMING && ((p).debug & 16))

#define DL_MAX_LAYERS 128  /* layer table in the kernel parameters (128 B a layer) */
#define DL_MAX_N 8         /* sequences a launch takes */
#define DL_MAX_G 8         /* query heads per KV head */
#define DL_CW 8            /* consumer warps */
#define DL_THREADS ((DL_CW + 4) * 32) /* plus the producer's warpgroup */
/* Registers a thread after the split (setmaxnreg): 12 warps start with 168 (the most for 3
 * warps on one SM sub-partition); the producer's warpgroup gives back all but DL_PROD_REGS and
 * the consumers take them (2 x 232 + 40 per lane of a sub-partition's 64 KiB). */
#define DL_PROD_REGS 40
#define DL_CONS_REGS 232
#define DL_SLOT_BYTES (16 << 10) /* ring slot: 8 weight rows' slices of k */
#define DL_MIN_SLOTS 4
#define DL_KEYS_PER_WARP 4 /* keys a warp loads at once in S2 */
#define DL_PF_ROUNDS 4     /* a unit's rounds of keys (DL_CW x DL_KEYS_PER_WARP each) whose
                            * offsets are made once a launch and whose K / V load before the
                            * q / k / v preparation: 4 up to 4 query heads a KV head, then 2
                            * (the registers: 4 spilled with 8) */
template <int MAXG> static constexpr __host__ __device__ int dl_pf() { return MAXG <= 4 ? DL_PF_ROUNDS : 2; }
/* Whether those batches load during S1's products rather than at S2's start (their bytes then
 * arrive while the block multiplies, not while it polls for q / k / v: docs/perf-history.md,
 * issue #8's fourteenth pass); not with 3 - 4 query heads a KV head, or 8
 * sequences at 2, where the registers held through S1 spill; nor with FP8 weights (WQ), whose
 * products need more registers (held through them, the batches spilled 28 - 180 bytes). */
template <int NMAX, int MAXG, int WQ = 0> static constexpr __host__ __device__ bool dl_early()
{
    return WQ == 0 && MAXG != 4 && !(NMAX == 8 && MAXG == 2);
}
#define DL_MIN_CHUNK 16    /* keys of a split, at least: more splits of one key batch each (faster
                            * than 32 at batch 1 after short prompts, 8 no better: issue #8's
                            * seventh pass in docs/perf-history.md) */
#define DL_MAX_SPLITS 32
#define DL_MERGE_BATCH 16 /* splits' lines a thread of the merge loads at once */
#define DL_SLOT_STEPS (DL_SLOT_BYTES / (8 * 2 * 32 * DL_CW)) /* a warp's mma steps a slot */
#define DL_WRED_FLOATS 4096 /* the warps' partial sums of a chunk of output columns (16 KiB) */

/* The layers' weights (the kernel's WQ): bf16; FP8 (e4m3 bytes, a f32 scale per output row:
 * pd_fp8_weight with group k) with each product's input rows quantized per token
 * (PD_ACT_DYNAMIC); FP8 weight-only (PD_ACT_NONE: the bf16 rows times the weights). A slot
 * holds as many bytes either way, so FP8 streams twice the k a slot. The head stays bf16. */
enum { DL_W_BF16, DL_W_F8, DL_W_F8W };

struct dl_layer {
    const bf16 *attn_norm;
    const void *qkv;         /* bf16, or FP8's e4m3 bytes (the WQ of the launch) */
    const bf16 *qkv_bias, *q_norm, *k_norm;
    const void *o;
    const bf16 *o_bias, *mlp_norm;
    const void *gate_up, *down;
    bf16 *k_cache, *v_cache;
    const float *qkv_s, *o_s, *gate_up_s, *down_s; /* FP8: the rows' scales [m]; else NULL */
};

struct dl_params {
    bf16 *resid, *qkv, *attn, *act;
    float *part;             /* split partials: flagged lines (output, log2 weight) */
    unsigned *bar;           /* [0] blocks done (reset at exit), [1] launches (the epoch) */
    uint4 *ll_qkv, *ll_attn, *ll_r3, *ll_r5, *ll_act; /* flagged lines of the stage outputs */
    const int32_t *positions, *slots, *ctx_lens, *block_tables;
    const int32_t *ids;      /* with embed: the rows start as embed[ids[q]], not resid */
    const bf16 *embed;
    const float *inv_freq;
    const bf16 *final_norm, *lm_head; /* the head stage, when lm_head is set */
    bf16 *logits;
    int32_t vocab;
    /* with the head: each row's greedy pick (pd_decode_args' pick_ids), made in pick_best (a
     * key a row, zero between launches: pick_key) and taken by the last block out into
     * pick_ids and pick_host's slot *pick_slot; pick_best NULL: none */
    unsigned long long *pick_best;
    int32_t *pick_ids, *pick_host;
    const int32_t *pick_slot;
    int32_t n, hidden, inter, n_heads, n_kv_heads, n_layers;
    int32_t max_blocks_per_seq, block_size, sliding_window, splits;
    float eps, attn_factor, scale_log2;
    float inv_hidden;        /* 1 / hidden: the row norms' mean square */
    int32_t slot_bytes, n_slots, x_bytes; /* shared memory: ring, then x / attention scratch, */
                                          /* the warps' sums (DL_WRED_FLOATS), RoPE's
                                           * [n][head_dim / 2] (cos, sin) pairs, then the
                                           * block's residual columns */
    int32_t debug;                        /* PDSERVE_CUDA_DL_DEBUG bits (timing only) */
    int32_t inflight;                     /* the layers' slots in flight at most (0: the ring;
                                           * pace_of) */
    unsigned long long *ts;               /* debug 16: [stage][block][8] marks and waits */
    /* tensor parallelism (tp_n > 1, pd_cuda_tp): S3's and S5's partial sums go to every
     * rank's receive area, tp_sum */
    int32_t tp_rank, tp_n;
    uint4 *tp_recv[PD_CUDA_TP_MAX];
    const volatile uint32_t *tp_abort;
    dl_layer layer[DL_MAX_LAYERS];
};

/* Output columns of stage st (0 QKV, 1 O, 2 gate / up, 3 down, 4 lm_head). */
static __host__ __device__ __forceinline__ int32_t stage_m(const dl_params &p, int st, int32_t hd)
{
    return st == 0 ? (p.n_heads + 2 * p.n_kv_heads) * hd
           : st == 2 ? p.inter
           : st == 4 ? p.vocab
                     : p.hidden;
}

/* Row length of stage st, and the k of it a slot holds (the 8 rows' slices fill one, a
 * multiple of 256). */
static __host__ __device__ __forceinline__ int32_t stage_k(const dl_params &p, int st, int32_t hd)
{
    return st == 1 ? p.n_heads * hd : st == 3 ? p.inter : p.hidden;
}

static __host__ __device__ __forceinline__ int32_t slot_k(const dl_params &p, int32_t k,
                                                          int esz = 2)
{
    /* bf16: a multiple of 256 (a warp step 32 k, 8 warps); e4m3 (esz 1): of 512 (64 k) */
    const int32_t q = esz == 1 ? 512 : 256;
    return min(k, (p.slot_bytes / (8 * esz)) / q * q);
}


/* Launches the kernel of head size HD, tensor-parallel sums TP and weights WQ for p (its n and
 * GQA group pick the instance) on a cooperative grid of `grid` blocks with smem bytes of
 * dynamic shared memory. Defined in cuda_decode_layers_kernel.cuh, instantiated for
 * (HD, TP, WQ) in {64, 128} x {(false, DL_W_BF16), (true, DL_W_BF16), (false, DL_W_F8),
 * (false, DL_W_F8W)} by the generated translation units, 9 kernels each. */
template <int HD, bool TP, int WQ>
cudaError_t dl_launch(const dl_params &p, int grid, size_t smem, cudaStream_t stream);

#endif
