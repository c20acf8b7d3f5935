/* cuda_decode_layers_kernel.cuh -- The persistent decode kernel's device code (described at
 * the top of cuda_decode_layers.cu) and dl_launch, included only by the translation units
 * CMake generates from cuda_decode_layers_inst.cu.in (one a head size and weight kind). */
#ifndef PD_CUDA_DECODE_LAYERS_KERNEL_CUH
#define PD_CUDA_DECODE_LAYERS_KERNEL_CUH

#include "kernels/cuda/cuda_decode_layers.cuh"
#include "kernels/cuda/cuda_kv_fp8.cuh"

/* The consumer warps' own barrier (the producer warp never joins one). */
static __device__ __forceinline__ void cons_sync(void)
{
    asm volatile("bar.sync 1, %0;" ::"n"(DL_CW * 32) : "memory");
}

/* The stage outputs go from block to block as flagged lines (NCCL's LL protocol): 16 bytes of
 * two (bf16 pair, flag) halves, each half written by one 8-byte store, so a reader that sees
 * a half's flag equal to the stage's sees its data. No fence, counter or barrier: a reader
 * polls the lines it needs and goes on once they carry this stage's flag (a grid barrier's
 * fence waited behind the weight stream's loads: docs/perf-history.md, issue #8's sixth pass).
 * Flags are (launch epoch << 10) + stage, never 0: the zeroed lines of a new context and the
 * last launch's lines never match. A line is rewritten a layer later, when every block is
 * past reading it (each layer's stages need every block's output of the one before). */
static __device__ __forceinline__ void ll_store(uint4 *line, uint32_t d01, uint32_t d23,
                                                uint32_t flag)
{
    pd_st_volatile4(line, make_uint4(d01, flag, d23, flag));
}

/* A line as it is now: (pair, flag, pair, flag). */
static __device__ __forceinline__ uint4 ll_issue4(const uint4 *line)
{
    return pd_ld_volatile4(line);
}

/* The 4 bf16 of a line (as two pairs) loaded as v, polled until both halves carry flag. */
static __device__ __forceinline__ uint2 ll_finish4(const uint4 *line, uint4 v, uint32_t flag)
{
    while (v.y != flag || v.w != flag) v = ll_issue4(line);
    return make_uint2(v.x, v.z);
}

static __device__ __forceinline__ uint2 ll_load(const uint4 *line, uint32_t flag)
{
    return ll_finish4(line, ll_issue4(line), flag);
}

/* Flagged lines [0, lines) of src to dst (their 4 bf16, 8 bytes a line), spread over the
 * consumer threads, 4 loads of a thread in flight; with sumsq, the thread's sum of the squares
 * of its values. Lines loaded before their writer stored them are polled again all together,
 * one round trip a round (polling them one after the other cost a round trip each after the
 * first had arrived). */
static __device__ __forceinline__ float ll_copy(const uint4 *src, uint32_t flag, int32_t lines,
                                                uint2 *dst, bool sumsq)
{
    constexpr int32_t T = DL_CW * 32;
    float ss = 0.0f;
    for (int32_t b = threadIdx.x; b < lines; b += 4 * T) {
        uint4 v[4];
#pragma unroll
        for (int k = 0; k < 4; k++)
            if (b + k * T < lines) v[k] = ll_issue4(src + b + k * T);
        for (;;) {
            bool ready = true;
#pragma unroll
            for (int k = 0; k < 4; k++)
                if (b + k * T < lines && (v[k].y != flag || v[k].w != flag)) ready = false;
            if (ready) break;
#pragma unroll
            for (int k = 0; k < 4; k++)
                if (b + k * T < lines && (v[k].y != flag || v[k].w != flag))
                    v[k] = ll_issue4(src + b + k * T);
        }
#pragma unroll
        for (int k = 0; k < 4; k++) {
            if (b + k * T >= lines) break;
            dst[b + k * T] = make_uint2(v[k].x, v[k].z);
            if (sumsq) {
                const float a0 = pd_bf16_lo(v[k].x), a1 = pd_bf16_hi(v[k].x);
                const float a2 = pd_bf16_lo(v[k].z), a3 = pd_bf16_hi(v[k].z);
                ss += a0 * a0 + a1 * a1 + a2 * a2 + a3 * a3;
            }
        }
    }
    return ss;
}

/* Debug bit 16: stage st's (layer * 5 + stage) mark k of this block (0 start, 1 after the
 * prologue, 2 after the products / attention, 3 at the barrier), in globaltimer ns. */
static __device__ __forceinline__ unsigned long long dl_now(void)
{
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

static __device__ __forceinline__ void dl_put(const dl_params &p, int32_t st, int k,
                                              unsigned long long v)
{
    p.ts[((size_t)st * gridDim.x + blockIdx.x) * 8 + k] = v;
}

static __device__ __forceinline__ void dl_mark(const dl_params &p, int32_t st, int k)
{
    if (DL_TIMED(p) && threadIdx.x == 0) dl_put(p, st, k, dl_now());
}

/* ---- the weight schedule, walked identically by producer and consumers ---- */

/* A position in the ring: the slot, and in the top bit the parity of its current round (one
 * register). */
struct dl_ring_pos {
    uint32_t v = 0;
    __device__ __forceinline__ uint32_t slot() const { return v & 0x7fffffffu; }
    __device__ __forceinline__ uint32_t ph() const { return v >> 31; }
    __device__ __forceinline__ void next(int32_t n_slots)
    {
        v = slot() + 1 == (uint32_t)n_slots ? (v & 0x80000000u) ^ 0x80000000u : v + 1;
    }
};

struct dl_stage {
    const void *w;      /* bf16, or e4m3 bytes (stage_of's esz) */
    int32_t k, m;       /* row length, output columns */
    bool swiglu;        /* w is [2m][k]: a group takes 4 gate rows and the matching up rows */
    int32_t c0, c1;     /* this block's output columns */
    int32_t cpg;        /* output columns per group of 8 weight rows: 8, or 4 with SwiGLU */
    int32_t kslice;     /* k per slot: the 8 rows' slices fill one (a multiple of 256) */
};

/* This block's columns of stage st, in 8s (whole flagged lines of 4), the last block to the
 * end: made once a launch into shared memory (two 64-bit divisions each, which stage_of
 * otherwise paid at every stage's start, on its critical path). */
static __device__ __forceinline__ int2 stage_cols(const dl_params &p, int st, int32_t hd)
{
    const int32_t m = stage_m(p, st, hd);
    const int32_t c0 = 8 * (int32_t)((int64_t)(m / 8) * blockIdx.x / gridDim.x);
    const int32_t c1 = blockIdx.x + 1 == gridDim.x
                           ? m
                           : 8 * (int32_t)((int64_t)(m / 8) * (blockIdx.x + 1) / gridDim.x);
    return make_int2(c0, c1);
}

/* Stage st of layer l (the head: l any), with this block's columns from cols (stage_cols);
 * esz the bytes of a weight element (1: the FP8 layers' stages, never the head's). */
static __device__ __forceinline__ dl_stage stage_of(const dl_params &p, int32_t l, int st,
                                                    int32_t hd, const int2 *cols, int esz = 2)
{
    const dl_layer &L = p.layer[l];
    dl_stage s;
    s.swiglu = st == 2;
    switch (st) {
    case 0: s.w = L.qkv; break;
    case 1: s.w = L.o; break;
    case 2: s.w = L.gate_up; break;
    case 3: s.w = L.down; break;
    default: s.w = p.lm_head; break;
    }
    s.k = stage_k(p, st, hd);
    s.m = stage_m(p, st, hd);
    s.c0 = cols[st].x;
    s.c1 = cols[st].y;
    s.cpg = s.swiglu ? 4 : 8;
    s.kslice = slot_k(p, s.k, esz);
    return s;
}

/* Weight row of unit j (0..7) of the group at column c: rows c.., or with SwiGLU gate rows
 * c..c+3 then up rows m+c..; units past the stage's columns repeat a valid row (their sums are
 * dropped). */
static __device__ __forceinline__ int64_t unit_row(const dl_stage &s, int32_t c, int j)
{
    const int32_t col = min(c + (s.swiglu ? (j & 3) : j), s.c1 - 1);
    return s.swiglu && j >= 4 ? (int64_t)s.m + col : col;
}

/* ---- producer ---- */

template <int HD, int WQ>
static __device__ void produce(const dl_params &p, char *ring, uint64_t *full, uint64_t *empty,
                               const int2 *cols)
{
    /* where the next slot is issued; the oldest slot issued and not yet seen full, and how
     * many are in flight from there (counted with inflight set, in the layers) */
    dl_ring_pos pos, fpos;
    int32_t flying = 0;
    /* debug 32: the A/B without the evict-first policy */
    const uint64_t pol = p.debug & 32 ? pd_policy_evict_normal() : pd_policy_evict_first();
    for (int32_t l = 0; l < p.n_layers; l++) {
        const int stages = l + 1 == p.n_layers && p.lm_head ? 5 : 4; /* the head after the last */
        for (int st = 0; st < stages; st++) {
            const int esz = WQ != DL_W_BF16 && st < 4 ? 1 : 2; /* the head is bf16 */
            const dl_stage s = stage_of(p, l, st, HD, cols, esz);
            unsigned long long waited = 0, t_last = 0;
            for (int32_t c = s.c0; c < s.c1; c += s.cpg)
                for (int32_t k0 = 0; k0 < s.k; k0 += s.kslice, pos.next(p.n_slots)) {
                    const uint32_t len = (uint32_t)min(s.kslice, s.k - k0) * esz;
                    const unsigned long long tw = DL_TIMED(p) ? dl_now() : 0;
                    pd_mbar_wait(&empty[pos.slot()], pos.ph() ^ 1);
                    if (p.inflight > 0 && st < 4) { /* paced: see pace_of */
                        while (flying >= p.inflight) { /* at once if the oldest is full */
                            pd_mbar_wait(&full[fpos.slot()], fpos.ph());
                            fpos.next(p.n_slots);
                            flying--;
                        }
                        flying++;
                    }
                    if (DL_TIMED(p)) {
                        t_last = dl_now();
                        waited += t_last - tw;
                    }
                    char *dst = ring + (size_t)pos.slot() * p.slot_bytes;
                    pd_mbar_expect_tx(&full[pos.slot()], 8 * len);
                    for (int j = 0; j < 8; j++)
                        pd_bulk_load_hint(dst + (size_t)j * len,
                                          static_cast<const char *>(s.w) +
                                              (unit_row(s, c, j) * s.k + k0) * esz,
                                          len, &full[pos.slot()], pol);
                }
            if (DL_TIMED(p)) {
                const int32_t mst = st == 4 ? p.n_layers * 5 : l * 5 + (st ? st + 1 : 0);
                dl_put(p, mst, 6, waited);
                dl_put(p, mst, 7, t_last);
            }
        }
    }
}

/* ---- consumers: products ---- */

/* The 128-byte lines of v (bytes long) into L2, spread over the consumer threads. */
static __device__ __forceinline__ void prefetch_lines(const void *v, int32_t bytes)
{
    if (!v) return;
    for (int32_t i = threadIdx.x; i < (bytes + 127) / 128; i += DL_CW * 32)
        pd_prefetch_l2(static_cast<const char *>(v) + (size_t)i * 128);
}

/* The small vectors a layer's stages read after its first (the head norms, the output bias,
 * the MLP norm) and the next layer's first ones, from HBM into L2 ahead of their stages: the
 * weight stream evicts them every step, and a stage's first loads are on its critical path.
 * One block a layer issues them (L2 is shared). */
static __device__ void prefetch_small(const dl_params &p, int32_t l, int32_t hd)
{
    const dl_layer &L = p.layer[l];
    const int32_t h2 = p.hidden * 2;
    prefetch_lines(L.q_norm, hd * 2);
    prefetch_lines(L.k_norm, hd * 2);
    prefetch_lines(L.o_bias, h2);
    prefetch_lines(L.mlp_norm, h2);
    if (l + 1 < p.n_layers) {
        const dl_layer &N = p.layer[l + 1];
        prefetch_lines(N.attn_norm, h2);
        prefetch_lines(N.qkv_bias, (p.n_heads + 2 * p.n_kv_heads) * hd * 2);
    } else {
        prefetch_lines(p.final_norm, h2);
    }
}

enum { DL_STORE, DL_ADD, DL_SWIGLU };

/* The greedy pick's order in one 64-bit key: the logit (as stored, in bf16; -0 as +0) above,
 * the lower id winning among equals below; 0 for what never wins (NaN, -inf). The same pick as
 * the sample op's greedy kernel. */
static __device__ __forceinline__ unsigned long long pick_key(float v, int32_t id)
{
    if (!(v > -INFINITY)) return 0ull;
    const uint32_t u = __float_as_uint(v == 0.0f ? 0.0f : v);
    const uint32_t o = u & 0x80000000u ? ~u : u | 0x80000000u;
    return (unsigned long long)o << 32 | (uint32_t)~(uint32_t)id;
}

/* Where a stage's outputs go: flagged lines ([n][m / 4], m the stage's columns) and / or plain
 * rows `ld` apart; with DL_ADD the old values are the block's own columns of the residual
 * stream, kept in shared memory (own, [column - c0][NMAX]) and updated there. */
struct dl_out {
    int mode;
    const bf16 *bias;
    uint4 *ll;
    uint32_t flag;
    bf16 *plain;
    int32_t ld;
    float *own;
    int tp_st;          /* DL_ADD under tensor parallelism: 0 S3, 1 S5 (tp_sum); -1 none */
};

/* A rank that waits this long for another's sums traps (its CUDA context is lost, the forward
 * fails): better than a GPU spinning forever behind a rank that never launched. */
#define DL_TP_TIMEOUT_NS 20000000000ull

/* Tensor parallelism: this rank's partial sums r[4] of row q, columns col0 .. col0 + 3 (S3's
 * or S5's product, before the residual add), to every other rank's receive area; then the
 * ranks' sums added in rank order (this rank's own from r), in float, into r: every rank gets
 * the same bits. A line carries two floats, each half with the stage's flag (ll_store), as
 * NCCL's LL protocol does over NVLink. The lines of (stage kind, source rank) are rewritten a
 * layer later, when every rank is past reading them: a rank's next stage of that kind needs
 * its norm of the whole residual stream after the stage between, hence every rank's sums of
 * that one, which each rank sends only after it read these. Polls until the lines come or the
 * communicator is aborted (then r is garbage: the forward fails anyway). */
static __device__ __forceinline__ void tp_sum(const dl_params &p, int st, int32_t q, int32_t col0,
                                           uint32_t flag, float (&r)[4])
{
    const int32_t N = p.tp_n, me = p.tp_rank;
    const size_t per_src = (size_t)p.n * (p.hidden / 2);
    const size_t line = ((size_t)st * N * p.n + q) * (p.hidden / 2) + col0 / 2;
    for (int32_t d = 1; d < N; d++) {
        const int32_t peer = me + d < N ? me + d : me + d - N;
        uint4 *dst = p.tp_recv[peer] + line + (size_t)me * per_src;
        ll_store(dst, __float_as_uint(r[0]), __float_as_uint(r[1]), flag);
        ll_store(dst + 1, __float_as_uint(r[2]), __float_as_uint(r[3]), flag);
    }
    /* the sources one after the other (two lines live: holding every source's cost the
     * kernel's consumers their registers, and spills); the first wait takes the link's
     * latency and the ranks' skew, the later ones mostly a load each */
    const uint4 *in = p.tp_recv[me] + line;
    float sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 1
    for (int32_t s = 0; s < N; s++) {
        if (s == me) {
#pragma unroll
            for (int e = 0; e < 4; e++) sum[e] += r[e];
            continue;
        }
        const uint4 *l = in + (size_t)s * per_src;
        uint4 v0 = ll_issue4(l), v1 = ll_issue4(l + 1);
        unsigned spins = 0;
        unsigned long long t0 = 0;
        while (v0.y != flag || v0.w != flag || v1.y != flag || v1.w != flag) {
            if (v0.y != flag || v0.w != flag) v0 = ll_issue4(l);
            if (v1.y != flag || v1.w != flag) v1 = ll_issue4(l + 1);
            if ((++spins & 1023u) == 0) {
                if (*p.tp_abort) break;
                const unsigned long long t = dl_now();
                if (!t0) t0 = t;
                else if (t - t0 > DL_TP_TIMEOUT_NS) __trap();
            }
        }
        sum[0] += __uint_as_float(v0.x);
        sum[1] += __uint_as_float(v0.z);
        sum[2] += __uint_as_float(v1.x);
        sum[3] += __uint_as_float(v1.z);
    }
#pragma unroll
    for (int e = 0; e < 4; e++) r[e] = sum[e];
}

/* Four e4m3 codes (the lowest byte first) as two bf16 pairs, exactly (every e4m3 value is a
 * bf16 value): each byte sign-extended into a 16-bit half (prmt), its 7 magnitude bits moved
 * under the bf16 exponent's low 4 bits and the sign kept, which is the value times 2^-120
 * (a bf16 subnormal for the e4m3 subnormals), then multiplied by 2^120 (exact). */
static __device__ __forceinline__ uint2 e4m3x4_bf16(uint32_t w)
{
    uint32_t lo, hi;
    asm("prmt.b32 %0, %2, 0, 0x9180;\n\tprmt.b32 %1, %2, 0, 0xB3A2;" : "=r"(lo), "=r"(hi) : "r"(w));
    lo = (lo << 4) & 0x87f087f0u;
    hi = (hi << 4) & 0x87f087f0u;
    asm("mul.rn.bf16x2 %0, %0, %2;\n\tmul.rn.bf16x2 %1, %1, %2;"
        : "+r"(lo), "+r"(hi)
        : "r"(0x7b807b80u)); /* 2^120 in each half */
    return make_uint2(lo, hi);
}

/* The weight kind's 4 codes as two 16-bit pairs and its m16n8k16 mma: DL_W_F8 f16
 * (pd_e4m3x4_f16; xs holds the quantized rows as f16, quant_rows), DL_W_F8W bf16 (xs the bf16
 * rows). */
template <int WQ> static __device__ __forceinline__ uint2 f8_widen(uint32_t w)
{
    return WQ == DL_W_F8 ? pd_e4m3x4_f16(w) : e4m3x4_bf16(w);
}

template <int WQ>
static __device__ __forceinline__ void f8_mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                              uint32_t a3, uint32_t b0, uint32_t b1)
{
    mma_16816<WQ == DL_W_F8>(d, a0, a1, a2, a3, b0, b1);
}

/* consume's products of one slot of FP8 weights (len bytes of each of the 8 rows, at k0 of
 * rows of k; FULL: len makes DL_SLOT_STEPS steps a warp) into the warp's chains d, the
 * layouts of the bf16 ones (below) with a lane's 16 bytes for 16 k: the codes widened to 16
 * bits (f8_widen) and twice the 16-bit mma a step up to 4 x rows (four from 5), on xs's 16-bit
 * rows (f16 of the codes for DL_W_F8, bf16 for DL_W_F8W). */
template <int NMAX, int WQ, int NCH, bool FULL>
static __device__ __forceinline__ void dl_products_f8(float (&d)[NCH][4],
                                                      const char *slot, const bf16 *xs,
                                                      int32_t len, int32_t k0, int32_t k,
                                                      int32_t n)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int32_t per = len / (64 * DL_CW), L = len / 16;
    const uint4 *wrow = reinterpret_cast<const uint4 *>(slot) + (size_t)g * L + t;
    /* up to 4 x rows, four chains: a step's two mma go to two of them (fewer dependent mma
     * a slot); with more, a step's four mma to one of two (the registers) */
    constexpr int c1 = NCH == 4 ? 1 : 0, c2 = NCH == 4 ? 2 : 1;
    uint4 wv[DL_SLOT_STEPS];
#pragma unroll
    for (int i = 0; i < DL_SLOT_STEPS; i++)
        if (FULL || i < per) wv[i] = wrow[(warp + i * DL_CW) * 4];
    if constexpr (NMAX <= 4) {
        /* mma 1: row g takes k 0 - 3 of the lane's 16, row g + 8 k 8 - 11; mma 2: 4 - 7
         * and 12 - 15; x column 2q + h x row q's k 8h .. 8h + 7 */
        const uint4 *xh = reinterpret_cast<const uint4 *>(xs + (size_t)min(g >> 1, n - 1) * k) +
                          k0 / 8 + 2 * t + (g & 1);
        uint4 xv[DL_SLOT_STEPS];
#pragma unroll
        for (int i = 0; i < DL_SLOT_STEPS; i++)
            if (FULL || i < per)
                xv[i] = g < 2 * n ? xh[(warp + i * DL_CW) * 8] : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
        for (int i = 0; i < DL_SLOT_STEPS; i++)
            if (FULL || i < per) {
                const uint2 p0 = f8_widen<WQ>(wv[i].x), p1 = f8_widen<WQ>(wv[i].y);
                const uint2 p2 = f8_widen<WQ>(wv[i].z), p3 = f8_widen<WQ>(wv[i].w);
                f8_mma<WQ>(d[c2 * (i & 1)], p0.x, p2.x, p0.y, p2.y, xv[i].x, xv[i].y);
                f8_mma<WQ>(d[c2 * (i & 1) + c1], p1.x, p3.x, p1.y, p3.y, xv[i].z, xv[i].w);
            }
    } else {
        const uint4 *xr =
            reinterpret_cast<const uint4 *>(xs + (size_t)min(g, n - 1) * k) + k0 / 8 + 2 * t;
        uint4 xa[DL_SLOT_STEPS], xb[DL_SLOT_STEPS];
#pragma unroll
        for (int i = 0; i < DL_SLOT_STEPS; i++)
            if (FULL || i < per) {
                xa[i] = xr[(warp + i * DL_CW) * 8];
                xb[i] = xr[(warp + i * DL_CW) * 8 + 1];
            }
#pragma unroll
        for (int i = 0; i < DL_SLOT_STEPS; i++)
            if (FULL || i < per) {
                const uint2 p0 = f8_widen<WQ>(wv[i].x), p1 = f8_widen<WQ>(wv[i].y);
                const uint2 p2 = f8_widen<WQ>(wv[i].z), p3 = f8_widen<WQ>(wv[i].w);
                f8_mma<WQ>(d[c2 * (i & 1)], xa[i].x, 0u, xa[i].y, 0u, p0.x, p0.y);
                f8_mma<WQ>(d[c2 * (i & 1) + c1], xa[i].z, 0u, xa[i].w, 0u, p1.x, p1.y);
                f8_mma<WQ>(d[c2 * (i & 1)], xb[i].x, 0u, xb[i].y, 0u, p2.x, p2.y);
                f8_mma<WQ>(d[c2 * (i & 1) + c1], xb[i].z, 0u, xb[i].w, 0u, p3.x, p3.y);
            }
    }
}

/* One stage's products for this block: the slots of its columns as the producer filled them.
 * On the tensor cores: a warp step covers 32 k of the 8 weight rows, lane (g, t) holding 8
 * consecutive k of row g (16 bytes). Up to 4 x rows the weights are mma.m16n8k16's A, one mma
 * a step: A row g takes 4 of the lane's k, row g + 8 the other 4, and x is B, its column 2q + h
 * x row q's matching 4 k (loaded by lane 2q + h alone), so D[g][2q] + D[g + 8][2q + 1] is unit
 * g's sum for x row q (half the mma of the pair below, and a faster step: docs/perf-history.md,
 * issue #8's ninth pass). With more x rows,
 * as the GEMV kernel of cuda_linear.cu does it: an mma pair, the weights as B and the n <= 8 x
 * rows as A rows g (rows past n feed outputs that are dropped). A slot's steps (at most DL_SLOT_STEPS a warp) are spread over the consumer warps, each
 * loaded before any is multiplied, into accumulators of their own (no chain of dependent
 * mma). Each warp stores its sums of a group in its own part of wred ([warp][unit][NMAX]: no
 * atomics, which contended 8 ways); after a chunk of groups (all of a layer's stage, the head
 * in pieces) the threads add the warps' parts and finish one (column, x row) each. x is [n][k]
 * in shared memory (k % 256 == 0); out rows are `ld` apart. (fp32 FMAs with one conversion
 * per element were instruction-bound well below the bandwidth: docs/perf-history.md, issue #8's
 * fourth pass.)
 * FP8 weights (WQ, dl_layer): a lane's 16 bytes of a row are 16 k, a warp step 64 k, as many
 * steps a slot, each code widened to 16 bits and twice the 16-bit mma a step
 * (dl_products_f8). DL_W_F8: xs holds the rows' quantized values [n][k] as f16 (quant_rows)
 * and the codes become f16; DL_W_F8W: xs is bf16 and the codes become bf16. The sums
 * are then scaled once per (column, row): by the row's weight scale (ws, staged into wsc at the
 * stage's start: [columns], then the up rows' with SwiGLU) times, for DL_W_F8, the x row's
 * scale (xsc), as the FP8 op set's linear_fused scales them. */
template <int NMAX, bool PICK = false, bool TP_SUM = false, int WQ = DL_W_BF16>
static __device__ void consume(const dl_params &p, const dl_stage &s, const bf16 *xs,
                               const dl_out &o, char *ring, float *wred, uint64_t *full,
                               uint64_t *empty, dl_ring_pos &pos, int32_t mst,
                               const float *ws = nullptr, float *wsc = nullptr,
                               const float *xsc = nullptr)
{
    constexpr int32_t CH = DL_WRED_FLOATS / (DL_CW * NMAX); /* units a chunk */
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int32_t kc = s.k / 8, n = p.n, chunk = s.swiglu ? CH / 2 : CH;
    const uint4 *xrow = reinterpret_cast<const uint4 *>(xs) + (size_t)min(g, n - 1) * kc + t;
    /* NMAX <= 4: lane (g, t) with g < 2n: x row g / 2, the half g % 2 of its 8 k (uint2s) */
    const uint2 *xh = reinterpret_cast<const uint2 *>(xs) + (size_t)min(g >> 1, n - 1) * 2 * kc +
                      2 * t + (g & 1);
    float *wmine = wred + (size_t)warp * CH * NMAX;
    unsigned long long waited = 0, n_wait = 0;
    /* PICK (the head): the thread's best key of each row, then the block's (sbest) */
    unsigned long long best[NMAX];
    __shared__ unsigned long long sbest[NMAX];
    if constexpr (PICK) {
#pragma unroll
        for (int q = 0; q < NMAX; q++) best[q] = 0ull;
        if (threadIdx.x < NMAX) sbest[threadIdx.x] = 0ull; /* before the first cons_sync */
    }
    if constexpr (WQ != DL_W_BF16) { /* read after the first chunk's cons_sync */
        const int32_t nc = s.c1 - s.c0;
        for (int32_t i = threadIdx.x; i < (s.swiglu ? 2 * nc : nc); i += DL_CW * 32)
            wsc[i] = __ldg(ws + (i < nc ? s.c0 + i : s.m + s.c0 + i - nc));
    }
    for (int32_t cb = s.c0; cb < s.c1; cb += chunk) {
        const int32_t ncols = min(chunk, s.c1 - cb);
        for (int32_t c = cb; c < cb + ncols; c += s.cpg) {
            const int32_t vc = min(s.cpg, s.c1 - c); /* valid columns of the group */
            /* two chains, alternating steps (FP8 up to 4 x rows: four, dl_products_f8) */
            constexpr int NCH = WQ != DL_W_BF16 && NMAX <= 4 ? 4 : 2;
            float d[NCH][4] = {};
            for (int32_t k0 = 0; k0 < s.k; k0 += s.kslice, pos.next(p.n_slots)) {
                const int32_t len = min(s.kslice, s.k - k0), per = len / (32 * DL_CW);
                const unsigned long long tw = DL_TIMED(p) && threadIdx.x == 0 ? dl_now() : 0;
                if (!(p.debug & 8)) pd_mbar_wait(&full[pos.slot()], pos.ph());
                if (DL_TIMED(p) && threadIdx.x == 0) {
                    waited += dl_now() - tw;
                    n_wait++;
                }
                if constexpr (WQ != DL_W_BF16) {
                    /* a whole slot (every warp DL_SLOT_STEPS steps): without the steps' guards,
                     * so that the compiler schedules the steps together */
                    const char *slot = ring + (size_t)pos.slot() * p.slot_bytes;
                    if (p.debug & 9) {
                    } else if (len == DL_SLOT_STEPS * 64 * DL_CW) {
                        dl_products_f8<NMAX, WQ, NCH, true>(d, slot, xs, len, k0, s.k, n);
                    } else {
                        dl_products_f8<NMAX, WQ, NCH, false>(d, slot, xs, len, k0, s.k, n);
                    }
                } else if (!(p.debug & 9)) {
                    const uint4 *wrow = reinterpret_cast<const uint4 *>(
                                            ring + (size_t)pos.slot() * p.slot_bytes) +
                                        (size_t)g * (len / 8) + t;
                    if constexpr (NMAX <= 4) {
                        /* the weight rows as A: rows g (k-half 0: 4 of the lane's 8 k) and
                         * g + 8 (the other 4); x as B, column 2q + h holding x row q's
                         * matching half (lanes 2q + h load those 4 k, the others zeros):
                         * one mma a step, D[g][2q] + D[g + 8][2q + 1] the sum */
                        uint4 wv[DL_SLOT_STEPS];
                        uint2 xv[DL_SLOT_STEPS];
#pragma unroll
                        for (int i = 0; i < DL_SLOT_STEPS; i++)
                            if (i < per) {
                                wv[i] = wrow[(warp + i * DL_CW) * 4];
                                xv[i] = g < 2 * n ? xh[k0 / 4 + (warp + i * DL_CW) * 8]
                                                  : make_uint2(0u, 0u);
                            }
#pragma unroll
                        for (int i = 0; i < DL_SLOT_STEPS; i++)
                            if (i < per)
                                mma_bf16(d[i & 1], wv[i].x, wv[i].z, wv[i].y, wv[i].w, xv[i].x,
                                         xv[i].y);
                    } else {
                        const uint4 *xr = xrow + k0 / 8;
                        uint4 wv[DL_SLOT_STEPS], xv[DL_SLOT_STEPS];
#pragma unroll
                        for (int i = 0; i < DL_SLOT_STEPS; i++)
                            if (i < per) {
                                wv[i] = wrow[(warp + i * DL_CW) * 4];
                                xv[i] = xr[(warp + i * DL_CW) * 4];
                            }
#pragma unroll
                        for (int i = 0; i < DL_SLOT_STEPS; i++)
                            if (i < per) {
                                mma_bf16(d[i & 1], xv[i].x, 0u, xv[i].y, 0u, wv[i].x, wv[i].y);
                                mma_bf16(d[i & 1], xv[i].z, 0u, xv[i].w, 0u, wv[i].z, wv[i].w);
                            }
                    }
                }
                __syncwarp();
                if (lane == 0 && !(p.debug & 8)) pd_mbar_arrive(&empty[pos.slot()]); /* free */
            }
            if constexpr (NMAX <= 4) { /* lane (g, t): unit g of the group, x row t */
                float v = 0.0f;
#pragma unroll
                for (int ch = 0; ch < NCH; ch++) v += d[ch][0] + d[ch][3];
                const int col = s.swiglu ? (g & 3) : g;
                if (t < n && col < vc)
                    wmine[((s.swiglu && g >= 4 ? ncols : 0) + c - cb + col) * NMAX + t] = v;
            } else { /* lane (g, t): x row g, units 2t and 2t + 1 of the group */
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    float v = 0.0f;
#pragma unroll
                    for (int ch = 0; ch < NCH; ch++) v += d[ch][j];
                    const int u = 2 * t + j, col = s.swiglu ? (u & 3) : u;
                    if (g < n && col < vc)
                        wmine[((s.swiglu && u >= 4 ? ncols : 0) + c - cb + col) * NMAX + g] = v;
                }
            }
        }
        if (cb + ncols >= s.c1) {
            dl_mark(p, mst, 2);
            if (DL_TIMED(p) && threadIdx.x == 0) {
                dl_put(p, mst, 4, waited);
                dl_put(p, mst, 5, n_wait);
            }
        }
        cons_sync();
        /* a thread a (row, 4 columns): one flagged line (chunks start at multiples of 8) */
        for (int32_t i = threadIdx.x; i < (ncols + 3) / 4 * n; i += DL_CW * 32) {
            const int32_t j0 = NMAX == 1 ? 4 * i : i / n * 4, q = NMAX == 1 ? 0 : i % n;
            const int32_t col0 = cb + j0;
            float r[4];
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int32_t j = min(j0 + e, ncols - 1), col = cb + j;
                float v = 0.0f;
#pragma unroll
                for (int w = 0; w < DL_CW; w++) v += wred[((size_t)w * CH + j) * NMAX + q];
                /* FP8: the weight row's scale times the x row's (1 weight-only) */
                if constexpr (WQ != DL_W_BF16)
                    v *= wsc[col - s.c0] * (WQ == DL_W_F8 ? xsc[q] : 1.0f);
                if (o.mode == DL_SWIGLU) {
                    float u = 0.0f;
#pragma unroll
                    for (int w = 0; w < DL_CW; w++)
                        u += wred[((size_t)w * CH + ncols + j) * NMAX + q];
                    if constexpr (WQ != DL_W_BF16)
                        u *= wsc[s.c1 - s.c0 + col - s.c0] * (WQ == DL_W_F8 ? xsc[q] : 1.0f);
                    const float bg = o.bias ? pd_ld(o.bias + col) : 0.0f;
                    const float bu = o.bias ? pd_ld(o.bias + s.m + col) : 0.0f;
                    const float gt = __bfloat162float(__float2bfloat16_rn(v + bg));
                    u = __bfloat162float(__float2bfloat16_rn(u + bu));
                    v = gt / (1.0f + expf(-gt)) * u;
                } else if (o.bias) {
                    v += pd_ld(o.bias + col);
                }
                r[e] = v;
            }
            /* only in the tensor-parallel kernel's residual stages */
            if constexpr (TP_SUM)
                if (o.mode == DL_ADD && o.tp_st >= 0) tp_sum(p, o.tp_st, q, col0, o.flag, r);
            if (o.mode == DL_ADD)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    if (j0 + e < ncols) {
                        float *w = o.own + (size_t)(col0 + e - s.c0) * NMAX + q;
                        r[e] = __bfloat162float(__float2bfloat16_rn(r[e] + *w));
                        *w = r[e];
                    }
            if constexpr (PICK) {
#pragma unroll
                for (int e = 0; e < 4; e++)
                    if (j0 + e < ncols) {
                        const unsigned long long k =
                            pick_key(__bfloat162float(__float2bfloat16_rn(r[e])), col0 + e);
#pragma unroll
                        for (int qq = 0; qq < NMAX; qq++)
                            if (qq == q) best[qq] = max(best[qq], k);
                    }
            }
            if (o.ll)
                ll_store(o.ll + ((size_t)q * s.m + col0) / 4, pd_pack_bf16(r[0], r[1]),
                         pd_pack_bf16(r[2], r[3]), o.flag);
            if (o.plain)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    if (j0 + e < ncols) pd_st(o.plain + (size_t)q * o.ld + col0 + e, r[e]);
        }
        if (cb + ncols < s.c1) cons_sync(); /* wred is the next chunk's */
    }
    if constexpr (PICK) { /* the block's best of each row into the grid's (pick_best) */
#pragma unroll
        for (int q = 0; q < NMAX; q++) {
            unsigned long long v = best[q];
#pragma unroll
            for (int sh = 16; sh; sh >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, sh));
            if (lane == 0 && v) atomicMax(&sbest[q], v);
        }
        cons_sync();
        if (p.pick_best && (int32_t)threadIdx.x < n && sbest[threadIdx.x]) {
            atomicMax(p.pick_best + threadIdx.x, sbest[threadIdx.x]);
            __threadfence(); /* before the block counts itself done */
        }
    }
}

/* 1 / sqrt(mean square + eps), the norms' scale, in float. The ops (and the CPU) take it in
 * double, rounded once to float; here it sits on the chain of every norm of every layer (the two
 * row norms and the q / k head norms, every thread of the block waiting for it), and the double
 * divide, square root and reciprocal were a visible share of a Qwen3-0.6B step
 * (docs/perf-history.md, issue #8's fourteenth pass). The float one differs from it by an ulp or
 * two of the scale, before the bf16 rounding of the product it scales. */
static __device__ __forceinline__ float norm_scale(float ss, float inv_len, float eps)
{
    return rsqrtf(fmaf(ss, inv_len, eps));
}

/* Row q of the step's input: the embedding of its token, or the residual stream's. */
static __device__ __forceinline__ const bf16 *in_row(const dl_params &p, int32_t q)
{
    return p.embed ? p.embed + (size_t)__ldg(p.ids + q) * p.hidden : p.resid + (size_t)q * p.hidden;
}

/* xs = rmsnorm(resid) * nw for the n rows, rounded as the rmsnorm op rounds: the rows to
 * shared memory 16 bytes a thread at a time with their sums of squares, then in place. The norm
 * weights load with the rows (one round trip from L2, not two) into xs after them (the host
 * sizes xs for n + 1 rows of hidden). The scale is rsqrt in float (norm_scale), where the op
 * takes 1 / sqrt in double. */
template <int NMAX>
static __device__ void norm_rows(const dl_params &p, const bf16 *nw, const uint4 *src_ll,
                                 uint32_t flag, bf16 *xs)
{
    __shared__ float red[NMAX][DL_CW];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int32_t hc = p.hidden / 8;
    uint4 *x4 = reinterpret_cast<uint4 *>(xs), *w4 = x4 + (size_t)p.n * hc;
    for (int32_t i = threadIdx.x; i < hc; i += DL_CW * 32)
        w4[i] = __ldg(reinterpret_cast<const uint4 *>(nw) + i);
#pragma unroll
    for (int q = 0; q < NMAX; q++) {
        if (q >= p.n) break;
        float ss = 0.0f;
        if (src_ll) {
            ss = ll_copy(src_ll + (size_t)q * 2 * hc, flag, 2 * hc,
                         reinterpret_cast<uint2 *>(x4 + (size_t)q * hc), true);
        } else { /* the step's input */
            const uint4 *row = reinterpret_cast<const uint4 *>(in_row(p, q));
            for (int32_t i = threadIdx.x; i < hc; i += DL_CW * 32) {
                const uint4 v = __ldcg(row + i);
                x4[(size_t)q * hc + i] = v;
                ss += pd_sumsq8(v);
            }
        }
        ss = pd_warp_sum(ss);
        if (lane == 0) red[q][warp] = ss;
    }
    cons_sync();
    for (int32_t q = 0; q < p.n; q++) {
        float ss = 0.0f;
        for (int v = 0; v < DL_CW; v++) ss += red[q][v];
        const float rr = norm_scale(ss, p.inv_hidden, p.eps);
        for (int32_t i = threadIdx.x; i < hc; i += DL_CW * 32) {
            uint4 &xv = x4[(size_t)q * hc + i];
            const uint4 wv = w4[i];
            const uint32_t xu[4] = {xv.x, xv.y, xv.z, xv.w}, wu[4] = {wv.x, wv.y, wv.z, wv.w};
            uint32_t o[4];
#pragma unroll
            for (int e = 0; e < 4; e++)
                o[e] = pd_pack_bf16(pd_bf16_lo(wu[e]) * (pd_bf16_lo(xu[e]) * rr),
                                    pd_bf16_hi(wu[e]) * (pd_bf16_hi(xu[e]) * rr));
            xv = make_uint4(o[0], o[1], o[2], o[3]);
        }
    }
    cons_sync();
}

/* xs = the n rows of a stage's output ([n][k] in flagged lines), 16 bytes at a time. */
static __device__ void copy_rows(const uint4 *src_ll, uint32_t flag, int32_t n, int32_t k,
                                 bf16 *xs)
{
    ll_copy(src_ll, flag, n * k / 4, reinterpret_cast<uint2 *>(xs), false);
    cons_sync();
}

/* FP8 with PD_ACT_DYNAMIC: the n bf16 rows xs [n][k] (as the op path's bf16 buffer holds
 * them: normed and rounded) quantized per token as pd_fp8_quant_row does, in place: each row's
 * scale s = max(amax / 448, PD_FP8_MIN_SCALE) into xsc[row], its codes e4m3(x / s) (IEEE
 * division's bits, RNE, satfinite: pd_e4m3x8_div) into xs as the f16 values the products
 * take (pd_e4m3x4_f16), [n][k] where the bf16 were: each thread
 * writes the 16 bytes it read, so one pass and no barrier between the reads and the writes.
 * The amax is a pass over the rows in shared memory. (The rows kept in registers between the
 * two passes made the step slower: docs/perf-history.md, "FP8 batch-1 decode: where the step
 * goes".) */
template <int NMAX>
static __device__ void quant_rows(const dl_params &p, int32_t k, bf16 *xs, float *xsc)
{
    constexpr int32_t T = DL_CW * 32;
    __shared__ float red[NMAX][DL_CW];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int32_t kc = k / 8, n = p.n;
    uint4 *x4 = reinterpret_cast<uint4 *>(xs);
#pragma unroll
    for (int q = 0; q < NMAX; q++) {
        if (q >= n) break;
        float m = 0.0f;
        for (int32_t i = threadIdx.x; i < kc; i += T) {
            const uint4 v = x4[(size_t)q * kc + i];
            const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int e = 0; e < 4; e++)
                m = fmaxf(m, fmaxf(fabsf(pd_bf16_lo(u[e])), fabsf(pd_bf16_hi(u[e]))));
        }
        m = pd_warp_max(m);
        if (lane == 0) red[q][warp] = m;
    }
    cons_sync();
    float sc[NMAX];
#pragma unroll
    for (int q = 0; q < NMAX; q++) {
        float m = 0.0f;
#pragma unroll
        for (int w = 0; w < DL_CW; w++) m = fmaxf(m, q < n ? red[q][w] : 0.0f);
        float v = m / PD_FP8_MAX; /* a NaN takes the floor, as the op's */
        if (!(v >= PD_FP8_MIN_SCALE)) v = PD_FP8_MIN_SCALE;
        sc[q] = v;
        if (threadIdx.x == q) xsc[q] = v; /* read after the closing cons_sync */
    }
    const int32_t total = n * kc;
    for (int32_t i = threadIdx.x; i < total; i += T) {
        const int32_t q = i / kc;
        float sv = sc[0];
#pragma unroll
        for (int qq = 1; qq < NMAX; qq++)
            if (qq == q) sv = sc[qq];
        const uint2 c = pd_e4m3x8_div(x4[i], sv, __frcp_rn(sv));
        const uint2 lo = pd_e4m3x4_f16(c.x), hi = pd_e4m3x4_f16(c.y);
        x4[i] = make_uint4(lo.x, lo.y, hi.x, hi.y);
    }
    cons_sync();
}

/* ---- consumers: attention (S2) ---- */

/* Head j of unit (s, h): j < G the query heads, G the KV head's key, G + 1 its value. Norm and
 * RoPE as rope_store_kv does them (rounded to bf16 where it stores; the norm's scale in float,
 * norm_scale), into shared memory (q scaled for exp2); split 0 stores the new key and value in
 * the cache. */
template <int HD>
static __device__ void prep_heads(const dl_params &p, const dl_layer &L, int32_t s, int32_t h,
                                  int32_t G, bool store, uint32_t qflag, const float2 *rope,
                                  float *qs, float *kn, float *vn, float *stg)
{
    constexpr int NR = HD / 32, NP = NR / 2, HALF = HD / 2;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int32_t qkv_dim = (p.n_heads + 2 * p.n_kv_heads) * HD;
    const int32_t slot = p.slots[s];
    const int64_t kv_off = (int64_t)slot * p.n_kv_heads * HD + (int64_t)h * HD;
    stg += warp * HD; /* the warp's row of the head, as read in lines of 4 */
    for (int32_t j = warp; j < G + 2; j += DL_CW) {
        const int32_t col = (j < G    ? h * G + j
                             : j == G ? p.n_heads + h
                                      : p.n_heads + p.n_kv_heads + h) * HD;
        const bf16 *nw = j < G ? L.q_norm : j == G ? L.k_norm : NULL;
        float x[NR], wv[NR];
        float2 cn[NP];
#pragma unroll
        for (int r = 0; r < NR; r++) wv[r] = nw ? pd_ld(nw + lane + 32 * r) : 0.0f;
#pragma unroll
        for (int r = 0; r < NP; r++)
            cn[r] = j <= G ? rope[s * HALF + lane + 32 * r] : make_float2(0.0f, 0.0f);
        __syncwarp(); /* the last head's reads of the row are done */
        if (lane < HD / 4) {
            const uint2 v = ll_load(p.ll_qkv + ((size_t)s * qkv_dim + col) / 4 + lane, qflag);
            stg[4 * lane] = pd_bf16_lo(v.x);
            stg[4 * lane + 1] = pd_bf16_hi(v.x);
            stg[4 * lane + 2] = pd_bf16_lo(v.y);
            stg[4 * lane + 3] = pd_bf16_hi(v.y);
        }
        __syncwarp();
#pragma unroll
        for (int r = 0; r < NR; r++) x[r] = stg[lane + 32 * r];
        if (j == G + 1) {
#pragma unroll
            for (int r = 0; r < NR; r++) {
                vn[lane + 32 * r] = x[r];
                if (store && slot >= 0) pd_st(L.v_cache + kv_off + lane + 32 * r, x[r]);
            }
            continue;
        }
        if (nw) {
            float ss = 0.0f;
#pragma unroll
            for (int r = 0; r < NR; r++) ss += x[r] * x[r];
            ss = pd_warp_sum(ss);
            const float rr = norm_scale(ss, 1.0f / HD, p.eps);
#pragma unroll
            for (int r = 0; r < NR; r++)
                x[r] = __bfloat162float(__float2bfloat16_rn(wv[r] * (x[r] * rr)));
        }
        float o[NR];
#pragma unroll
        for (int r = 0; r < NP; r++) {
            const float cs = cn[r].x, sn = cn[r].y;
            o[r] = __bfloat162float(__float2bfloat16_rn(x[r] * cs - x[r + NP] * sn));
            o[r + NP] = __bfloat162float(__float2bfloat16_rn(x[r + NP] * cs + x[r] * sn));
        }
#pragma unroll
        for (int r = 0; r < NR; r++) {
            const int i = lane + 32 * r;
            if (j < G) {
                qs[j * HD + i] = o[r] * p.scale_log2;
            } else {
                kn[i] = o[r];
                if (store && slot >= 0) pd_st(L.k_cache + kv_off + i, o[r]);
            }
        }
    }
    cons_sync();
}

/* Element e of a lane's E keys' or values' elements, kept as bf16 pairs (E / 2 words: half the
 * registers of floats, and no conversion between a load and its use). */
template <int E>
static __device__ __forceinline__ float kv_at(const uint32_t (&w)[E / 2], int e)
{
    return e & 1 ? pd_bf16_hi(w[e >> 1]) : pd_bf16_lo(w[e >> 1]);
}

/* The attention output of unit (s, h), G * HD values in res (NULL: zeros), as flagged lines;
 * also into p.attn when plain (the last layer: the op's scratch holds it, as op by op). */
template <int HD>
static __device__ void emit_attn(const dl_params &p, int32_t s, int32_t h, int32_t G,
                                 const float *res, uint32_t flag, bool plain)
{
    const int32_t nq = p.n_heads * HD, c0 = h * G * HD;
    for (int32_t i = threadIdx.x; i < G * HD / 4; i += DL_CW * 32) {
        float v[4];
#pragma unroll
        for (int e = 0; e < 4; e++) v[e] = res ? res[4 * i + e] : 0.0f;
        ll_store(p.ll_attn + ((size_t)s * nq + c0) / 4 + i, pd_pack_bf16(v[0], v[1]),
                 pd_pack_bf16(v[2], v[3]), flag);
        if (plain)
#pragma unroll
            for (int e = 0; e < 4; e++) pd_st(p.attn + (size_t)s * nq + c0 + 4 * i + e, v[e]);
    }
}

/* Unit u of S2: sequence s, KV head h, split sp of the sequence's keys [kb, ke) (used splits
 * in all; a unit past them has nothing to do). */
struct dl_unit {
    int32_t s, h, sp, ctx, kb, ke, used;
};

static __device__ __forceinline__ dl_unit unit_of(const dl_params &p, int32_t u)
{
    dl_unit a;
    a.sp = u % p.splits;
    a.h = (u / p.splits) % p.n_kv_heads;
    a.s = u / (p.splits * p.n_kv_heads);
    a.ctx = p.ctx_lens[a.s];
    const int32_t k_start =
        p.sliding_window > 0 && a.ctx > p.sliding_window ? a.ctx - p.sliding_window : 0;
    const int32_t n_keys = a.ctx - k_start;
    a.used = a.ctx > 0 ? min(p.splits, max(1, n_keys / DL_MIN_CHUNK)) : 1;
    const int32_t chunk = a.ctx > 0 ? (n_keys + a.used - 1) / a.used : 0;
    /* no split without keys: 520 keys in 32 splits of 17 would leave the last empty (31) */
    if (chunk > 0) a.used = (n_keys + chunk - 1) / chunk;
    a.kb = k_start + a.sp * chunk;
    a.ke = min(a.kb + chunk, a.ctx);
    return a;
}

/* The cache offsets (elements, layer-independent) of this lane's part of keys j0 .. j0 +
 * DL_KEYS_PER_WARP - 1 of unit a; -1 for a key past the split (weight 0) or the new token (its
 * K / V come from shared memory, stored in S2 by split 0). */
template <int E>
static __device__ __forceinline__ void key_offsets(const dl_params &p, const dl_unit &a,
                                                   int32_t j0, int64_t (&off)[DL_KEYS_PER_WARP])
{
    constexpr int HD = E * 32;
    const int lane = threadIdx.x & 31;
    const int32_t *table = p.block_tables + (size_t)a.s * p.max_blocks_per_seq;
    const int64_t kv_row = (int64_t)p.n_kv_heads * HD;
#pragma unroll
    for (int i = 0; i < DL_KEYS_PER_WARP; i++) {
        const int32_t j = j0 + i;
        off[i] = j >= a.ke || j == a.ctx - 1
                     ? -1
                     : ((int64_t)table[j / p.block_size] * p.block_size + j % p.block_size) *
                               kv_row + (int64_t)a.h * HD + lane * E;
    }
}

/* The keys and values at those offsets, into registers as bf16 pairs (zeros at -1). */
template <int E>
static __device__ __forceinline__ void kv_load(const dl_layer &L,
                                               const int64_t (&off)[DL_KEYS_PER_WARP],
                                               uint32_t (&kv)[DL_KEYS_PER_WARP][2][E / 2])
{
#pragma unroll
    for (int i = 0; i < DL_KEYS_PER_WARP; i++) {
        if (off[i] < 0) {
#pragma unroll
            for (int w = 0; w < E / 2; w++) kv[i][0][w] = kv[i][1][w] = 0u;
            continue;
        }
        if constexpr (E == 4) {
            const uint2 k = *reinterpret_cast<const uint2 *>(L.k_cache + off[i]);
            const uint2 v = *reinterpret_cast<const uint2 *>(L.v_cache + off[i]);
            kv[i][0][0] = k.x;
            kv[i][0][E / 2 - 1] = k.y;
            kv[i][1][0] = v.x;
            kv[i][1][E / 2 - 1] = v.y;
        } else {
            kv[i][0][0] = *reinterpret_cast<const uint32_t *>(L.k_cache + off[i]);
            kv[i][1][0] = *reinterpret_cast<const uint32_t *>(L.v_cache + off[i]);
        }
    }
}

/* One unit: attention of its G query heads over the split's keys; the result, or a partial
 * merged by split 0. kv0 holds this warp's first dl_pf<MAXG>() batches of keys and values, as
 * the caller loaded them before the q / k / v preparation (their offsets are the same every
 * layer: the kernel makes the first unit's once a launch, so those loads depend on no other
 * load, and issues them during S1's products where dl_early); later batches load after the
 * one before. sm is scratch of DL_CW * G * (HD + 2) floats after the q / k / v vectors. */
template <int HD, int MAXG>
static __device__ void attend_unit(const dl_params &p, const dl_layer &L, const dl_unit &a,
                                   uint32_t (&kv0)[dl_pf<MAXG>()][DL_KEYS_PER_WARP][2][HD / 64],
                                   float *sm,
                                   const float2 *rope, uint32_t qflag, uint32_t aflag,
                                   bool plain, int32_t mst)
{
    constexpr int E = HD / 32;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int32_t G = p.n_heads / p.n_kv_heads, ctx = a.ctx, s = a.s, h = a.h, sp = a.sp;
    if (ctx <= 0) { /* padding row */
        if (sp == 0) emit_attn<HD>(p, s, h, G, NULL, aflag, plain);
        return;
    }
    const int32_t used = a.used;
    if (sp >= used) return;
    const int32_t kb = a.kb, ke = a.ke;
    float *qs = sm, *kn = qs + DL_MAX_G * HD, *vn = kn + HD, *scr = vn + HD;
    constexpr int PF = dl_pf<MAXG>(); /* batches loaded ahead */
    prep_heads<HD>(p, L, s, h, G, sp == 0, qflag, rope, qs, kn, vn, scr);
    dl_mark(p, mst, 1);

    float acc[MAXG][E], m[MAXG], l[MAXG]; /* q stays in shared memory */
#pragma unroll
    for (int g = 0; g < MAXG; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
#pragma unroll
        for (int e = 0; e < E; e++) acc[g][e] = 0.0f;
    }
    /* one batch of keys j0.. in kv: the new token's from shared memory, then online softmax */
    auto batch = [&](int32_t j0, uint32_t (&kv)[DL_KEYS_PER_WARP][2][E / 2]) {
#pragma unroll
        for (int i = 0; i < DL_KEYS_PER_WARP; i++)
            if (j0 + i == ctx - 1) /* bf16 values: packing them back is exact */
#pragma unroll
                for (int w = 0; w < E / 2; w++) {
                    kv[i][0][w] = pd_pack_bf16(kn[lane * E + 2 * w], kn[lane * E + 2 * w + 1]);
                    kv[i][1][w] = pd_pack_bf16(vn[lane * E + 2 * w], vn[lane * E + 2 * w + 1]);
                }
        /* every score of the batch first (independent shuffle chains), then one rescale */
        float sc[DL_KEYS_PER_WARP][MAXG];
#pragma unroll
        for (int i = 0; i < DL_KEYS_PER_WARP; i++)
#pragma unroll
            for (int g = 0; g < MAXG; g++) {
                if (g >= G) break;
                float v = 0.0f;
#pragma unroll
                for (int e = 0; e < E; e++)
                    v = fmaf(qs[g * HD + lane * E + e], kv_at<E>(kv[i][0], e), v);
                sc[i][g] = v;
            }
#pragma unroll
        for (int i = 0; i < DL_KEYS_PER_WARP; i++)
#pragma unroll
            for (int g = 0; g < MAXG; g++) {
                if (g >= G) break;
                sc[i][g] = j0 + i < ke ? pd_warp_sum(sc[i][g]) : -INFINITY;
            }
#pragma unroll
        for (int g = 0; g < MAXG; g++) {
            if (g >= G) break;
            float mn = m[g];
#pragma unroll
            for (int i = 0; i < DL_KEYS_PER_WARP; i++) mn = fmaxf(mn, sc[i][g]);
            const float corr = exp2f(m[g] - mn); /* j0 < ke: mn is finite */
            m[g] = mn;
            float ls = l[g] * corr;
#pragma unroll
            for (int e = 0; e < E; e++) acc[g][e] *= corr;
#pragma unroll
            for (int i = 0; i < DL_KEYS_PER_WARP; i++) {
                const float pr = exp2f(sc[i][g] - mn); /* 0 for a key past ke */
                ls += pr;
#pragma unroll
                for (int e = 0; e < E; e++) acc[g][e] = fmaf(pr, kv_at<E>(kv[i][1], e), acc[g][e]);
            }
            l[g] = ls;
        }
    };
    const int32_t j0w = kb + warp * DL_KEYS_PER_WARP;
#pragma unroll
    for (int r = 0; r < PF; r++) {
        const int32_t jr = j0w + r * DL_CW * DL_KEYS_PER_WARP;
        if (jr >= ke) break;
        batch(jr, kv0[r]);
    }
    for (int32_t j0 = j0w + PF * DL_CW * DL_KEYS_PER_WARP; j0 < ke;
         j0 += DL_CW * DL_KEYS_PER_WARP) {
        uint32_t kv[DL_KEYS_PER_WARP][2][E / 2];
        int64_t off[DL_KEYS_PER_WARP];
        key_offsets<E>(p, a, j0, off);
        kv_load<E>(L, off, kv);
        batch(j0, kv);
    }
    /* merge the warps: scr[w][g] = (max, sum), then [w][g][HD] outputs */
    float *wml = scr, *wacc = scr + 2 * DL_CW * G;
#pragma unroll
    for (int g = 0; g < MAXG; g++) {
        if (g >= G) break;
        if (lane == 0) {
            wml[2 * (warp * G + g)] = m[g];
            wml[2 * (warp * G + g) + 1] = l[g];
        }
#pragma unroll
        for (int e = 0; e < E; e++) wacc[(warp * G + g) * HD + lane * E + e] = acc[g][e];
    }
    cons_sync();
    /* The splits' partials go to split 0 as flagged lines, one an output element: (the
     * element of the split's own normalized output, flag, the split's log2 weight m +
     * log2(l), flag). No fence or counter (each block has at most one unit when there are
     * splits: units = n x KV heads x splits <= grid); the merge takes everything it needs of
     * a split in one load. Split 0 keeps its own in shared memory (outputs in qs, the queries
     * being read by now; log2 weights in mine) and merges. */
    __shared__ float mine[DL_MAX_G];
    const int32_t head0 = h * G;
    uint4 *pl = reinterpret_cast<uint4 *>(p.part);
    for (int32_t i = threadIdx.x; i < G * HD; i += DL_CW * 32) {
        const int32_t g = i / HD, d = i % HD;
        float M = -INFINITY;
        for (int w = 0; w < DL_CW; w++) M = fmaxf(M, wml[2 * (w * G + g)]);
        float Ls = 0.0f, O = 0.0f;
        for (int w = 0; w < DL_CW; w++) {
            const float mw = wml[2 * (w * G + g)];
            if (mw == -INFINITY) continue;
            const float f = exp2f(mw - M);
            Ls = fmaf(wml[2 * (w * G + g) + 1], f, Ls);
            O = fmaf(wacc[(w * G + g) * HD + d], f, O);
        }
        /* a split has keys (unit_of), so Ls >= 1; a split without would weigh 0 */
        const float on = Ls > 0.0f ? O / Ls : 0.0f, lw = Ls > 0.0f ? M + log2f(Ls) : -INFINITY;
        if (used == 1 || sp == 0) {
            qs[i] = on;
            if (d == 0) mine[g] = lw;
        } else {
            const size_t item = ((size_t)s * p.n_heads + head0 + g) * p.splits + sp;
            ll_store(pl + item * HD + d, __float_as_uint(on), __float_as_uint(lw), aflag);
        }
    }
    dl_mark(p, mst, 2);
    cons_sync();
    if (used > 1 && sp == 0) {
        /* The merge: each thread loads its element's lines of DL_MERGE_BATCH splits at once,
         * polls again all together those loaded before their writer stored them, and folds
         * them in with a running largest log2 weight. */
        for (int32_t i = threadIdx.x; i < G * HD; i += DL_CW * 32) {
            const int32_t g = i / HD, d = i % HD;
            const uint4 *pk = pl + ((size_t)s * p.n_heads + head0 + g) * p.splits * HD + d;
            float lw = mine[g], S = 1.0f, O = qs[i];
            for (int32_t j0 = 1; j0 < used; j0 += DL_MERGE_BATCH) {
                const int32_t nj = min(DL_MERGE_BATCH, used - j0);
                uint4 v[DL_MERGE_BATCH];
#pragma unroll
                for (int k = 0; k < DL_MERGE_BATCH; k++)
                    v[k] = k < nj ? ll_issue4(pk + (size_t)(j0 + k) * HD)
                                  : make_uint4(0u, aflag, __float_as_uint(-INFINITY), aflag);
                for (;;) {
                    bool ready = true;
#pragma unroll
                    for (int k = 0; k < DL_MERGE_BATCH; k++)
                        ready = ready && v[k].y == aflag && v[k].w == aflag;
                    if (ready) break;
#pragma unroll
                    for (int k = 0; k < DL_MERGE_BATCH; k++)
                        if (v[k].y != aflag || v[k].w != aflag)
                            v[k] = ll_issue4(pk + (size_t)(j0 + k) * HD);
                }
                float mx = lw;
#pragma unroll
                for (int k = 0; k < DL_MERGE_BATCH; k++) mx = fmaxf(mx, __uint_as_float(v[k].z));
                const float corr = exp2f(lw - mx);
                S *= corr;
                O *= corr;
                lw = mx;
#pragma unroll
                for (int k = 0; k < DL_MERGE_BATCH; k++) {
                    const float w = exp2f(__uint_as_float(v[k].z) - lw); /* 0 past nj */
                    S += w;
                    O = fmaf(w, __uint_as_float(v[k].x), O);
                }
            }
            qs[i] = O / S;
        }
    }
    if (used == 1 || sp == 0) {
        cons_sync();
        emit_attn<HD>(p, s, h, G, qs, aflag, plain);
    }
    cons_sync(); /* the scratch is the next unit's */
}

/* ---- the kernel ---- */

/* FP8 (the tail of shared memory after the block's residual columns, as the host sizes it):
 * the x rows' scales (DL_MAX_N floats, quant_rows), then a stage's weight-row scales (consume's
 * wsc). */
template <int NMAX>
static __device__ __forceinline__ float *f8_xsc(const dl_params &p, float *own)
{
    return own + (size_t)8 * ((p.hidden / 8 + gridDim.x - 1) / gridDim.x) * NMAX;
}

template <int NMAX>
static __device__ __forceinline__ float *f8_wsc(const dl_params &p, float *own)
{
    return f8_xsc<NMAX>(p, own) + DL_MAX_N;
}

/* TP: the tensor-parallel instance (tp_sum in the residual stages), apart so that the
 * single-GPU one keeps its registers (tp_sum held live beside the attention stage's key
 * offsets spilled some and slowed a Qwen3-0.6B shape step: docs/perf-history.md, issue #29's
 * fused decode steps). WQ: the layers' weights (DL_W_*;
 * the FP8 ones single-GPU only), instances apart for the same reason. */
template <int HD, int NMAX, int MAXG, bool TP, int WQ>
static __global__ void __launch_bounds__(DL_THREADS, 1)
decode_layers_kernel(const __grid_constant__ dl_params p)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    extern __shared__ __align__(128) char smem[];
    __shared__ __align__(8) uint64_t bars[2 * 64];
    __shared__ int2 cols[5]; /* stage_cols of the 5 stage kinds */
    uint64_t *full = bars, *empty = bars + 64;
    if (threadIdx.x < 5) cols[threadIdx.x] = stage_cols(p, threadIdx.x, HD);
    char *ring = smem;
    char *xsb = smem + (size_t)p.n_slots * p.slot_bytes;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (threadIdx.x == 0) {
        for (int i = 0; i < p.n_slots; i++) {
            pd_mbar_init(&full[i], 1);
            pd_mbar_init(&empty[i], DL_CW);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (warp >= DL_CW) { /* the producer: one thread of the last warpgroup */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(DL_PROD_REGS));
        if (warp == DL_CW && lane == 0 && !(p.debug & 8)) produce<HD, WQ>(p, ring, full, empty, cols);
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(DL_CONS_REGS));
    bf16 *xs = reinterpret_cast<bf16 *>(xsb);
    float *red = reinterpret_cast<float *>(xsb + p.x_bytes);
    float2 *rope = reinterpret_cast<float2 *>(xsb + p.x_bytes + DL_WRED_FLOATS * sizeof(float));
    float *own = reinterpret_cast<float *>(rope + p.n * HD / 2);
    float *sm = reinterpret_cast<float *>(xsb);
    dl_ring_pos pos;
    /* this launch's flags: stage i of the step has flag base + i + 1 */
    const uint32_t epoch = __ldcv(p.bar + 1) + 1, base = epoch << 10;
    /* the rotation of each sequence's position, for every layer: cos and sin taken in double
     * and rounded once, as rope_store_kv does (each block its own, in shared memory) */
    for (int32_t i = threadIdx.x; i < p.n * HD / 2; i += DL_CW * 32) {
        const int32_t sq = i / (HD / 2), f = i % (HD / 2);
        double sd, cd;
        sincos((double)((float)p.positions[sq] * p.inv_freq[f]), &sd, &cd);
        rope[i] = make_float2((float)cd * p.attn_factor, (float)sd * p.attn_factor);
    }
    const int32_t units = p.n * p.n_kv_heads * p.splits;
    /* this block's first S2 unit and its warp's first keys' offsets: the same in every layer
     * (kept in registers) */
    dl_unit u0 = {};
    constexpr int PF = dl_pf<MAXG>();
    int64_t off0[PF][DL_KEYS_PER_WARP];
#pragma unroll
    for (int r = 0; r < PF; r++)
#pragma unroll
        for (int i = 0; i < DL_KEYS_PER_WARP; i++) off0[r][i] = -1;
    if ((int32_t)blockIdx.x < units) {
        u0 = unit_of(p, blockIdx.x);
#pragma unroll
        for (int r = 0; r < PF; r++)
            key_offsets<HD / 32>(p, u0, u0.kb + (warp + r * DL_CW) * DL_KEYS_PER_WARP, off0[r]);
    }
    {   /* this block's columns of the residual stream (the same in S3 and S5) */
        const dl_stage so = stage_of(p, 0, 1, HD, cols);
        for (int32_t i = threadIdx.x; i < (so.c1 - so.c0) * p.n; i += DL_CW * 32) {
            const int32_t j = i / p.n, q = i % p.n;
            own[j * NMAX + q] = __bfloat162float(__ldcg(in_row(p, q) + so.c0 + j));
        }
    }
    cons_sync(); /* the rotations, the residual columns */
    constexpr int ESZ = WQ == DL_W_BF16 ? 2 : 1; /* the layers' weight bytes an element */
    for (int32_t l = 0; l < p.n_layers; l++) {
        const dl_layer &L = p.layer[l];
        const bool last = l + 1 == p.n_layers;
        const int32_t m0 = l * 5;
        const uint32_t f0 = base + m0 + 1; /* S1's flag; S2 .. S5: f0 + 1 .. f0 + 4 */
        dl_stage s;
        dl_out o = {};
        /* S1 */
        s = stage_of(p, l, 0, HD, cols, ESZ);
        dl_mark(p, m0, 0);
        if ((int32_t)blockIdx.x == l % (int32_t)gridDim.x && !(p.debug & 128))
            prefetch_small(p, l, HD);
        norm_rows<NMAX>(p, L.attn_norm, l ? p.ll_r5 : NULL, f0 - 1, xs);
        if constexpr (WQ == DL_W_F8)
            if (!(p.debug & 2)) quant_rows<NMAX>(p, p.hidden, xs, f8_xsc<NMAX>(p, own));
        dl_mark(p, m0, 1);
        /* the first S2 unit's first key batches, loaded during this stage's products */
        uint32_t kvp[PF][DL_KEYS_PER_WARP][2][HD / 64];
        if constexpr (dl_early<NMAX, MAXG, WQ>())
#pragma unroll
            for (int r = 0; r < PF; r++) kv_load<HD / 32>(L, off0[r], kvp[r]);
        o = {DL_STORE, L.qkv_bias, p.ll_qkv, f0, last ? p.qkv : NULL, s.m, NULL, -1};
        if constexpr (WQ == DL_W_BF16)
            consume<NMAX>(p, s, xs, o, ring, red, full, empty, pos, m0);
        else
            consume<NMAX, false, false, WQ>(p, s, xs, o, ring, red, full, empty, pos, m0,
                                            L.qkv_s, f8_wsc<NMAX>(p, own), f8_xsc<NMAX>(p, own));
        dl_mark(p, m0, 3);
        dl_mark(p, m0 + 1, 0);
        /* S2 */
        for (int32_t u = blockIdx.x; u < units; u += gridDim.x) {
            dl_unit a = u0;
            if (!dl_early<NMAX, MAXG, WQ>() && u == blockIdx.x)
#pragma unroll
                for (int r = 0; r < PF; r++) kv_load<HD / 32>(L, off0[r], kvp[r]);
            if (u != blockIdx.x) {
                a = unit_of(p, u);
#pragma unroll
                for (int r = 0; r < PF; r++) {
                    int64_t off[DL_KEYS_PER_WARP];
                    key_offsets<HD / 32>(p, a, a.kb + (warp + r * DL_CW) * DL_KEYS_PER_WARP, off);
                    kv_load<HD / 32>(L, off, kvp[r]);
                }
            }
            attend_unit<HD, MAXG>(p, L, a, kvp, sm, rope, f0, f0 + 1, last, m0 + 1);
        }
        dl_mark(p, m0 + 1, 3);
        /* S3 */
        s = stage_of(p, l, 1, HD, cols, ESZ);
        dl_mark(p, m0 + 2, 0);
        copy_rows(p.ll_attn, f0 + 1, p.n, s.k, xs);
        if constexpr (WQ == DL_W_F8)
            if (!(p.debug & 2)) quant_rows<NMAX>(p, s.k, xs, f8_xsc<NMAX>(p, own));
        dl_mark(p, m0 + 2, 1);
        o = {DL_ADD, L.o_bias, p.ll_r3, f0 + 2, NULL, p.hidden, own, TP ? 0 : -1};
        if constexpr (WQ == DL_W_BF16)
            consume<NMAX, false, TP>(p, s, xs, o, ring, red, full, empty, pos, m0 + 2);
        else
            consume<NMAX, false, false, WQ>(p, s, xs, o, ring, red, full, empty, pos, m0 + 2,
                                            L.o_s, f8_wsc<NMAX>(p, own), f8_xsc<NMAX>(p, own));
        dl_mark(p, m0 + 2, 3);
        /* S4 */
        s = stage_of(p, l, 2, HD, cols, ESZ);
        dl_mark(p, m0 + 3, 0);
        norm_rows<NMAX>(p, L.mlp_norm, p.ll_r3, f0 + 2, xs);
        if constexpr (WQ == DL_W_F8)
            if (!(p.debug & 2)) quant_rows<NMAX>(p, p.hidden, xs, f8_xsc<NMAX>(p, own));
        dl_mark(p, m0 + 3, 1);
        o = {DL_SWIGLU, NULL, p.ll_act, f0 + 3, last ? p.act : NULL, p.inter, NULL, -1};
        if constexpr (WQ == DL_W_BF16)
            consume<NMAX>(p, s, xs, o, ring, red, full, empty, pos, m0 + 3);
        else
            consume<NMAX, false, false, WQ>(p, s, xs, o, ring, red, full, empty, pos, m0 + 3,
                                            L.gate_up_s, f8_wsc<NMAX>(p, own),
                                            f8_xsc<NMAX>(p, own));
        dl_mark(p, m0 + 3, 3);
        /* S5 */
        s = stage_of(p, l, 3, HD, cols, ESZ);
        dl_mark(p, m0 + 4, 0);
        copy_rows(p.ll_act, f0 + 3, p.n, p.inter, xs);
        if constexpr (WQ == DL_W_F8)
            if (!(p.debug & 2)) quant_rows<NMAX>(p, p.inter, xs, f8_xsc<NMAX>(p, own));
        dl_mark(p, m0 + 4, 1);
        o = {DL_ADD, NULL, p.ll_r5, f0 + 4, last ? p.resid : NULL, p.hidden, own, TP ? 1 : -1};
        if constexpr (WQ == DL_W_BF16)
            consume<NMAX, false, TP>(p, s, xs, o, ring, red, full, empty, pos, m0 + 4);
        else
            consume<NMAX, false, false, WQ>(p, s, xs, o, ring, red, full, empty, pos, m0 + 4,
                                            L.down_s, f8_wsc<NMAX>(p, own), f8_xsc<NMAX>(p, own));
        dl_mark(p, m0 + 4, 3);
    }
    if (p.lm_head) { /* S6: logits = rmsnorm(resid) * final_norm . lm_head^T */
        const dl_stage s = stage_of(p, p.n_layers - 1, 4, HD, cols);
        const int32_t mh = p.n_layers * 5;
        dl_mark(p, mh, 0);
        norm_rows<NMAX>(p, p.final_norm, p.ll_r5, base + mh, xs);
        dl_mark(p, mh, 1);
        const dl_out o = {DL_STORE, NULL, NULL, 0, p.logits, p.vocab, NULL, -1};
        consume<NMAX, true>(p, s, xs, o, ring, red, full, empty, pos, mh);
        dl_mark(p, mh, 3);
    }
    /* the last block out resets the counter and moves the epoch for the next launch (every
     * block has read the epoch once it counts itself done) */
    cons_sync();
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(&p.bar[0], 1u) == gridDim.x - 1) {
            if (p.pick_best) { /* every block's best is in: the picks */
                __threadfence();
                const int32_t slot = *p.pick_slot;
                for (int32_t q = 0; q < p.n; q++) {
                    const unsigned long long k = atomicExch(p.pick_best + q, 0ull);
                    const int32_t t = k ? (int32_t)~(uint32_t)k : 0; /* none: 0, as sampling */
                    p.pick_ids[q] = t;
                    if (slot >= 0 && slot < PD_PICK_SLOTS) p.pick_host[slot * PD_PICK_ROWS + q] = t;
                }
            }
            p.bar[0] = 0;
            p.bar[1] = epoch;
            __threadfence();
        }
    }
#else
    __trap(); /* the host launches it on compute capability 9.0 and up only */
#endif
}

template <int HD, int NMAX, int MAXG, bool TP, int WQ>
static cudaError_t dl_launch_one(const dl_params &p, int grid, size_t smem, cudaStream_t stream)
{
    auto k = decode_layers_kernel<HD, NMAX, MAXG, TP, WQ>;
    cudaError_t e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)smem);
    if (e != cudaSuccess) return e;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeCooperative; /* every block resident: the grid barriers */
    attr[0].val.cooperative = 1;
    return pd_cuda__launch_attrs(k, dim3((unsigned)grid), dim3(DL_THREADS), smem, stream, attr,
                                 1u, p);
}

/* Instantiations a (HD, TP, WQ): x rows up to 1, 4, 8 (nmax_of; two rows take the 4-row
 * instance: batches above 1 are fused only when PDSERVE_CUDA_FUSED_DECODE raises its default
 * of 1, and 2-row instances of every kind lengthened the build: docs/perf-history.md, "The
 * CUDA backend's build time"), query heads per KV head up to 2, 4, 8 (the attention stage's
 * registers are sized by the last). */
template <int HD, int MAXG, bool TP, int WQ>
static cudaError_t dl_launch_g(const dl_params &p, int grid, size_t smem, cudaStream_t stream)
{
    if (p.n <= 1) return dl_launch_one<HD, 1, MAXG, TP, WQ>(p, grid, smem, stream);
    if (p.n <= 4) return dl_launch_one<HD, 4, MAXG, TP, WQ>(p, grid, smem, stream);
    return dl_launch_one<HD, 8, MAXG, TP, WQ>(p, grid, smem, stream);
}

template <int HD, bool TP, int WQ>
cudaError_t dl_launch(const dl_params &p, int grid, size_t smem, cudaStream_t stream)
{
    const int32_t G = p.n_heads / p.n_kv_heads;
    if (G <= 2) return dl_launch_g<HD, 2, TP, WQ>(p, grid, smem, stream);
    if (G <= 4) return dl_launch_g<HD, 4, TP, WQ>(p, grid, smem, stream);
    return dl_launch_g<HD, 8, TP, WQ>(p, grid, smem, stream);
}

#endif
