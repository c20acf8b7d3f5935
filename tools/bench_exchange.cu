/* bench_exchange.cu -- pdserve-bench-exchange: what a block-to-block exchange of a persistent
 * kernel costs on this GPU, for the design of decode_layers
 * (docs/perf-history.md, issue #8, eleventh pass).
 *
 * Every block of a grid shaped like decode_layers (one block an SM, 12 warps, ~200 KiB of
 * shared memory) runs rounds of an all-gather: each block publishes `lines` flagged 16-byte
 * lines and waits until it has read everyone else's of the same round. Three ways:
 *   l2       all blocks of the grid, through global memory (L2), as decode_layers does;
 *   l2-peer  only the blocks of the block's own cluster, through global memory;
 *   dsmem    only the blocks of the cluster, stored into each peer's shared memory
 *            (distributed shared memory, st.shared::cluster), polled there;
 *   relay    all blocks of the grid, each block of a cluster reading a C-th of the lines from
 *            global memory and forwarding them into its peers' shared memory: L2 traffic a
 *            C-th of l2's, the rest through distributed shared memory;
 *   atomic   an all-reduce instead of an all-gather: every block adds one contribution to each
 *            of --cols 64-bit sums (red.add; the count of contributions above bit 44, so the
 *            sum carries its own flag and needs no fence) and polls them all until each counts
 *            the whole grid: what a row-parallel split of the products (each block's partial
 *            sums of every output column) would exchange.
 * --stagger K keeps K polls of each l2 line in flight, first issued --delay cycles apart (does
 * a line that lands get seen sooner than a round trip later?).
 * With --stream, a producer thread in every block streams a large buffer through a ring of
 * 16 KiB shared-memory slots with bulk copies (cp.async.bulk, evict-first), the way
 * decode_layers streams its weights, at the full rate the memory gives. Also prints how many
 * clusters of each size can be resident at that footprint (a persistent grid needs them all).
 * Built with the CUDA backend only; sm_90. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_common.cuh" /* the backend's device helpers (no backend code) */

#define THREADS 384       /* 8 consumer warps + a producer warpgroup, as decode_layers */
#define CONSUMERS 256
#define SLOT (16 << 10)
#define MAX_LINES 8       /* lines a block publishes a round */
#define MAX_CLUSTER 16

#define CK(x)                                                                                  \
    do {                                                                                       \
        cudaError_t e_ = (x);                                                                  \
        if (e_ != cudaSuccess) {                                                               \
            fprintf(stderr, "pdserve-bench-exchange: %s: %s\n", #x, cudaGetErrorString(e_));   \
            exit(1);                                                                           \
        }                                                                                      \
    } while (0)

enum { MODE_L2, MODE_L2_PEER, MODE_DSMEM, MODE_RELAY, MODE_ATOMIC };

struct xargs {
    int mode, rounds, lines, cluster, stream;
    int stagger, delay;          /* l2: polls in flight a line, cycles between their first issues */
    uint4 *gl;                   /* [2][grid][lines] flagged lines (l2, l2-peer) */
    const char *big;             /* the streamed buffer */
    size_t big_bytes;
    volatile int *stop;          /* block 0 sets it when its rounds are done */
    unsigned long long *ns;      /* per block: its rounds' time */
    unsigned base;               /* this launch's flags: base + round */
    int slots;
    int inbox_off;               /* relay: [2][grid][lines] lines in dynamic shared memory here */
    unsigned long long *acc;     /* atomic: [cols] sums, the contributions counted above bit 44 */
    int cols;
};

static __device__ __forceinline__ unsigned long long now_ns(void)
{
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

static __device__ __forceinline__ void cons_sync(void)
{
    asm volatile("bar.sync 1, %0;" ::"n"(CONSUMERS) : "memory");
}

static __device__ __forceinline__ uint32_t cluster_rank(void)
{
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

static __device__ __forceinline__ void cluster_sync(void)
{
    asm volatile("barrier.cluster.arrive.aligned;\nbarrier.cluster.wait.aligned;" ::: "memory");
}

/* The producer: bulk copies of 16 KiB into the ring, each slot reused once its last copy
 * landed, until block 0 is done; then it waits for the copies still in flight. */
static __device__ __forceinline__ void slot_wait(uint64_t *full, int slots, unsigned long long m)
{ /* copy m (0-based) is its slot's (m / slots)-th completion */
    pd_mbar_wait(&full[m % slots], (uint32_t)((m / slots) & 1));
}

static __device__ void stream_loop(const xargs &a, char *ring, uint64_t *full)
{
    const uint64_t pol = pd_policy_evict_first();
    const size_t span = a.big_bytes / gridDim.x / SLOT * SLOT; /* this block's part */
    const char *src0 = a.big + (size_t)blockIdx.x * span;
    size_t off = 0;
    unsigned long long n = 0;
    for (;; n++) {
        const int s = (int)(n % a.slots);
        if (n >= (unsigned long long)a.slots) {
            slot_wait(full, a.slots, n - a.slots);
            if (*a.stop) break;
        }
        pd_mbar_expect_tx(&full[s], SLOT);
        pd_bulk_load_hint(ring + (size_t)s * SLOT, src0 + off, SLOT, &full[s], pol);
        off = off + SLOT >= span ? 0 : off + SLOT;
    }
    for (unsigned long long m = n - a.slots + 1; m < n; m++) slot_wait(full, a.slots, m); /* drain */
}

/* One round's lines of block b: (round flag, b, round flag, line index). */
static __device__ __forceinline__ bool line_ok(uint4 v, unsigned flag)
{
    return v.x == flag && v.z == flag;
}

/* v into cluster block `peer`'s shared memory, at the place of local (this block's address). */
static __device__ __forceinline__ void store_peer(const void *local, int peer, uint4 v)
{
    uint32_t remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
                 : "=r"(remote)
                 : "r"(pd_smem_u32(local)), "r"(peer));
    asm volatile("st.shared::cluster.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(remote), "r"(v.x),
                 "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

/* Polls a line of this block's shared memory until it carries flag. */
static __device__ __forceinline__ void wait_local(const uint4 *line, unsigned flag)
{
    const volatile uint4 *q = line;
    uint4 v;
    do {
        v.x = q->x;
        v.z = q->z;
    } while (!line_ok(v, flag));
}

/* Lines [0, n) at line(i), as decode_layers' ll_copy polls them: up to 4 a thread loaded at
 * once, those not there yet (ok(v) false) loaded again together (one round trip a round); each
 * line that has arrived is handed to got(i, v). */
template <typename A, typename O, typename G>
static __device__ __forceinline__ void gather_if(int n, O ok, A line, G got)
{
    for (int b = threadIdx.x; b < n; b += 4 * CONSUMERS) {
        uint4 v[4];
#pragma unroll
        for (int k = 0; k < 4; k++)
            if (b + k * CONSUMERS < n) v[k] = pd_ld_volatile4(line(b + k * CONSUMERS));
        for (;;) {
            bool ready = true;
#pragma unroll
            for (int k = 0; k < 4; k++)
                if (b + k * CONSUMERS < n && !ok(v[k])) ready = false;
            if (ready) break;
#pragma unroll
            for (int k = 0; k < 4; k++)
                if (b + k * CONSUMERS < n && !ok(v[k]))
                    v[k] = pd_ld_volatile4(line(b + k * CONSUMERS));
        }
#pragma unroll
        for (int k = 0; k < 4; k++)
            if (b + k * CONSUMERS < n) got(b + k * CONSUMERS, v[k]);
    }
}

/* gather_if for flagged lines of this round's flag. */
template <typename A, typename G>
static __device__ __forceinline__ void gather(int n, unsigned flag, A line, G got)
{
    gather_if(n, [=](uint4 v) { return line_ok(v, flag); }, line, got);
}

/* gather with K polls of each line in flight, first issued `delay` cycles apart so that
 * they stay staggered: a line that lands is seen about a K-th of a round trip later rather
 * than a whole one. */
template <int K, typename A>
static __device__ __forceinline__ void gather_staggered(int n, unsigned flag, A line, int delay)
{
    for (int b = threadIdx.x; b < n; b += 4 * CONSUMERS) {
        uint4 v[K][4];
        unsigned done = 0;
#pragma unroll
        for (int m = 0; m < 4; m++)
            if (b + m * CONSUMERS >= n) done |= 1u << m;
#pragma unroll
        for (int k = 0; k < K; k++) {
#pragma unroll
            for (int m = 0; m < 4; m++)
                if (!(done >> m & 1)) v[k][m] = pd_ld_volatile4(line(b + m * CONSUMERS));
            if (k + 1 < K) {
                const long long t0 = clock64();
                while (clock64() - t0 < delay) {
                }
            }
        }
        for (;;) {
#pragma unroll
            for (int k = 0; k < K; k++) {
#pragma unroll
                for (int m = 0; m < 4; m++)
                    if (!(done >> m & 1)) {
                        if (line_ok(v[k][m], flag)) done |= 1u << m;
                        else v[k][m] = pd_ld_volatile4(line(b + m * CONSUMERS));
                    }
                if (done == 15u) break;
            }
            if (done == 15u) break;
        }
    }
}

/* The consumer warps' rounds (see the top of the file). */
static __device__ void consume_rounds(const xargs &a, uint4 (*inbox)[MAX_CLUSTER][MAX_LINES],
                                      uint4 *relay)
{
    const int C = a.cluster, L = a.lines;
    const uint32_t rank = C > 1 ? cluster_rank() : 0;
    const int peer0 = (int)blockIdx.x - (int)rank; /* the cluster's first block */
    const int n_src = a.mode == MODE_L2 || a.mode == MODE_RELAY ? (int)gridDim.x : C;
    const int src0 = a.mode == MODE_L2 || a.mode == MODE_RELAY ? 0 : peer0;
    const unsigned long long t0 = now_ns();
    for (int r = 0; r < a.rounds; r++) {
        const unsigned flag = a.base + (unsigned)r;
        const int par = r & 1;
        /* publish */
        if (a.mode == MODE_DSMEM) {
            for (int i = threadIdx.x; i < C * L; i += CONSUMERS)
                store_peer(&inbox[par][rank][i % L], i / L,
                           make_uint4(flag, blockIdx.x, flag, (unsigned)(i % L)));
        } else {
            for (int k = threadIdx.x; k < L; k += CONSUMERS)
                pd_st_volatile4(a.gl + ((size_t)par * gridDim.x + blockIdx.x) * L + k,
                                make_uint4(flag, blockIdx.x, flag, (unsigned)k));
        }
        if (a.mode == MODE_RELAY) {
            /* this rank's sources (b % C == rank) from global memory, forwarded to every
             * peer's shared memory (its own copy included); then the rest from the peers */
            uint4 *mine = relay + (size_t)par * gridDim.x * L;
            const int n_mine = ((int)gridDim.x - (int)rank + C - 1) / C;
            gather(n_mine * L, flag,
                   [&](int i) {
                       return a.gl + ((size_t)par * gridDim.x + (int)rank + C * (i / L)) * L + i % L;
                   },
                   [&](int i, uint4 v) {
                       const int b = (int)rank + C * (i / L), k = i % L;
                       for (int p = 0; p < C; p++) store_peer(mine + (size_t)b * L + k, p, v);
                   });
            for (int i = threadIdx.x; i < (int)gridDim.x * L; i += CONSUMERS)
                wait_local(mine + i, flag);
            cons_sync();
            continue;
        }
        if (a.mode == MODE_ATOMIC) {
            /* every block adds one contribution to each of cols sums, then polls them all
             * until each counts every block's contribution of this round */
            const unsigned long long want = (unsigned long long)gridDim.x * (unsigned)(r + 1);
            for (int c = threadIdx.x; c < a.cols; c += CONSUMERS)
                asm volatile("red.relaxed.gpu.global.add.u64 [%0], %1;" ::"l"(a.acc + c),
                             "l"((1ull << 44) + (unsigned long long)(c & 7)) : "memory");
            /* a 16-byte line holds two sums, each count in its upper word's top 20 bits */
            const unsigned w20 = (unsigned)want;
            gather_if(a.cols / 2,
                      [=](uint4 v) { return (v.y >> 12) >= w20 && (v.w >> 12) >= w20; },
                      [&](int i) { return reinterpret_cast<const uint4 *>(a.acc) + i; },
                      [](int, uint4) {});
            cons_sync();
            continue;
        }
        /* gather */
        if (a.mode == MODE_DSMEM) {
            for (int i = threadIdx.x; i < n_src * L; i += CONSUMERS)
                wait_local(&inbox[par][i / L][i % L], flag);
        } else {
            auto at = [&](int i) { return a.gl + ((size_t)par * gridDim.x + src0 + i / L) * L + i % L; };
            if (a.stagger == 2) gather_staggered<2>(n_src * L, flag, at, a.delay);
            else if (a.stagger == 3) gather_staggered<3>(n_src * L, flag, at, a.delay);
            else if (a.stagger == 4) gather_staggered<4>(n_src * L, flag, at, a.delay);
            else gather(n_src * L, flag, at, [](int, uint4) {});
        }
        cons_sync();
    }
    const unsigned long long t1 = now_ns();
    if (threadIdx.x == 0) {
        a.ns[blockIdx.x] = t1 - t0;
        if (blockIdx.x == 0) {
            __threadfence();
            *a.stop = 1;
        }
    }
}

static __global__ void __launch_bounds__(THREADS, 1) xchg_kernel(const xargs a)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
    __trap(); /* main() runs it on compute capability 9.0 and up only */
#else
    extern __shared__ __align__(128) char smem[];
    __shared__ __align__(8) uint64_t full[16];
    __shared__ __align__(16) uint4 inbox[2][MAX_CLUSTER][MAX_LINES]; /* dsmem: peers' lines */
    const int warp = threadIdx.x >> 5;
    if (threadIdx.x < 16) pd_mbar_init(&full[threadIdx.x], 1);
    for (int i = threadIdx.x; i < 2 * MAX_CLUSTER * MAX_LINES; i += THREADS)
        (&inbox[0][0][0])[i] = make_uint4(0, 0, 0, 0);
    if (a.mode == MODE_RELAY)
        for (int i = threadIdx.x; i < 2 * (int)gridDim.x * a.lines; i += THREADS)
            reinterpret_cast<uint4 *>(smem + a.inbox_off)[i] = make_uint4(0, 0, 0, 0);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    __syncthreads();
    if (a.cluster > 1) cluster_sync(); /* every peer's inbox is zeroed before anyone stores */
    if (warp >= 8) {
        if (warp == 8 && (threadIdx.x & 31) == 0 && a.stream) stream_loop(a, smem, full);
        __syncwarp();
    } else {
        consume_rounds(a, inbox, reinterpret_cast<uint4 *>(smem + a.inbox_off));
    }
    __syncthreads();
    if (a.cluster > 1) cluster_sync(); /* no block leaves while a peer may store into it */
#endif
}
static void usage(FILE *f)
{
    fprintf(f,
        "usage: pdserve-bench-exchange [--rounds N] [--lines L] [--smem KIB] [--device N]\n"
        "                              [--cols N] [--stagger K] [--delay C]\n"
        "\n"
        "Times all-gather rounds between the blocks of a persistent grid (one block an SM, 384\n"
        "threads): through L2 across the whole grid (l2), through L2 within a cluster (l2-peer),\n"
        "through distributed shared memory within a cluster (dsmem), and across the whole grid\n"
        "with each block of a cluster reading a share from L2 and forwarding it to its peers\n"
        "(relay); an all-reduce by atomic adds (atomic); cluster sizes 2 .. 16, each with and\n"
        "without a bulk-copy stream of a large buffer in every block (decode_layers' weight\n"
        "stream).\n"
        "  --rounds N  rounds a measurement (default 2000)\n"
        "  --lines L   16-byte lines each block publishes a round (1 .. %d, default 2)\n"
        "  --smem KIB  dynamic shared memory a block (default 200: decode_layers' ring)\n"
        "  --device N  CUDA device (default 0)\n"
        "  --cols N    sums of the atomic all-reduce (even, default 1024)\n"
        "  --stagger K l2: polls of a line in flight (1 .. 4, default 1)\n"
        "  --delay C   cycles between a line's first K polls (default 300)\n",
        MAX_LINES);
}

/* Launches the kernel once, timed by its blocks; returns the slowest block's ns a round, or a
 * negative value when the launch is refused. */
static double run(const cudaDeviceProp &prop, int mode, int C, int stream, int rounds, int lines,
                  size_t smem, char *big, size_t big_bytes, uint4 *gl, int *stop,
                  unsigned long long *ns, unsigned *base, int *grid_out, bool *coop_out,
                  unsigned long long *acc, int cols, int stagger, int delay)
{
    int grid = prop.multiProcessorCount / C * C;
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[2];
    int na = 0;
    cfg.blockDim = dim3(THREADS);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = 0;
    attr[na].id = cudaLaunchAttributeClusterDimension;
    attr[na].val.clusterDim.x = (unsigned)C;
    attr[na].val.clusterDim.y = 1;
    attr[na].val.clusterDim.z = 1;
    na++;
    cfg.attrs = attr;
    cfg.numAttrs = na;
    cfg.gridDim = dim3((unsigned)grid);
    int active = 0;
    if (cudaOccupancyMaxActiveClusters(&active, xchg_kernel, &cfg) != cudaSuccess) {
        (void)cudaGetLastError();
        return -1.0;
    }
    if (active * C < grid) grid = active * C; /* every block resident: they poll each other */
    if (grid < C) return -1.0;
    cfg.gridDim = dim3((unsigned)grid);
    xargs a = {mode, rounds, lines, C, stream, stagger, delay, gl, big, big_bytes, stop, ns, *base, 0, 0, acc, cols};
    if (mode == MODE_ATOMIC) CK(cudaMemset(acc, 0, sizeof *acc * (size_t)cols));
    const size_t relay_bytes = (size_t)2 * grid * lines * sizeof(uint4);
    a.slots = (int)((smem - relay_bytes) / SLOT) < 16 ? (int)((smem - relay_bytes) / SLOT) : 16;
    a.inbox_off = a.slots * SLOT;
    *base += (unsigned)rounds + 1;
    CK(cudaMemset(stop, 0, sizeof(int)));
    /* cooperative when the driver takes it with clusters: the launch then guarantees
     * residency; else the grid above is at most the resident count */
    attr[na].id = cudaLaunchAttributeCooperative;
    attr[na].val.cooperative = 1;
    cfg.numAttrs = na + 1;
    cudaError_t e = cudaLaunchKernelEx(&cfg, xchg_kernel, a);
    *coop_out = e == cudaSuccess;
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        cfg.numAttrs = na;
        e = cudaLaunchKernelEx(&cfg, xchg_kernel, a);
    }
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return -1.0;
    }
    CK(cudaDeviceSynchronize());
    unsigned long long *h = (unsigned long long *)malloc(sizeof *h * (size_t)grid);
    if (!h) exit(1);
    CK(cudaMemcpy(h, ns, sizeof *h * (size_t)grid, cudaMemcpyDeviceToHost));
    unsigned long long worst = 0;
    for (int i = 0; i < grid; i++) worst = h[i] > worst ? h[i] : worst;
    free(h);
    *grid_out = grid;
    return (double)worst / rounds;
}

int main(int argc, char **argv)
{
    int rounds = 2000, lines = 2, dev = 0, cols = 1024, stagger = 1, delay = 300;
    size_t smem = (size_t)200 << 10;
    for (int i = 1; i < argc; i++) {
        const char *o = argv[i];
        if (!strcmp(o, "--help") || !strcmp(o, "-h")) {
            usage(stdout);
            return 0;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "pdserve-bench-exchange: unknown option or missing value: %s\n", o);
            usage(stderr);
            return 2;
        }
        const long v = strtol(argv[++i], NULL, 10);
        if (!strcmp(o, "--rounds") && v > 0 && v <= 1000000) rounds = (int)v;
        else if (!strcmp(o, "--lines") && v >= 1 && v <= MAX_LINES) lines = (int)v;
        else if (!strcmp(o, "--smem") && v >= 16 && v <= 220) smem = (size_t)v << 10;
        else if (!strcmp(o, "--device") && v >= 0) dev = (int)v;
        else if (!strcmp(o, "--cols") && v >= 2 && v <= 65536 && v % 2 == 0) cols = (int)v;
        else if (!strcmp(o, "--stagger") && v >= 1 && v <= 4) stagger = (int)v;
        else if (!strcmp(o, "--delay") && v >= 0 && v <= 100000) delay = (int)v;
        else {
            fprintf(stderr, "pdserve-bench-exchange: bad option or value: %s %s\n", o, argv[i]);
            usage(stderr);
            return 2;
        }
    }
    int n_dev = 0;
    if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
        fprintf(stderr, "pdserve-bench-exchange: no CUDA device\n");
        return 1;
    }
    if (dev >= n_dev) {
        fprintf(stderr, "pdserve-bench-exchange: no device %d (%d present)\n", dev, n_dev);
        return 2;
    }
    CK(cudaSetDevice(dev));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, dev));
    if (prop.major < 9) {
        fprintf(stderr, "pdserve-bench-exchange: needs compute capability 9.0 (clusters, bulk copies)\n");
        return 1;
    }
    CK(cudaFuncSetAttribute(xchg_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    CK(cudaFuncSetAttribute(xchg_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    const size_t big_bytes = (size_t)2 << 30;
    char *big = NULL;
    uint4 *gl = NULL;
    int *stop = NULL;
    unsigned long long *ns = NULL;
    CK(cudaMalloc((void **)&big, big_bytes));
    CK(cudaMemset(big, 1, big_bytes));
    CK(cudaMalloc((void **)&gl, sizeof(uint4) * 2 * (size_t)prop.multiProcessorCount * MAX_LINES));
    CK(cudaMemset(gl, 0, sizeof(uint4) * 2 * (size_t)prop.multiProcessorCount * MAX_LINES));
    CK(cudaMalloc((void **)&stop, sizeof(int)));
    unsigned long long *acc = NULL;
    CK(cudaMalloc((void **)&acc, sizeof *acc * (size_t)cols));
    CK(cudaMalloc((void **)&ns, sizeof(unsigned long long) * (size_t)prop.multiProcessorCount));
    printf("pdserve-bench-exchange: %s, %d SMs; %d rounds of %d lines a block, %zu KiB shared "
           "memory a block; ns a round (the slowest block)\n",
           prop.name, prop.multiProcessorCount, rounds, lines, smem >> 10);
    printf("%-8s %4s %5s %6s %10s %10s\n", "way", "C", "grid", "coop", "no stream", "stream");
    unsigned base = 1;
    static const char *names[5] = {"l2", "l2-peer", "dsmem", "relay", "atomic"};
    const int sizes[] = {1, 2, 4, 8, 16};
    for (int si = 0; si < 5; si++) {
        const int C = sizes[si];
        for (int mode = 0; mode < 5; mode++) {
            if ((C == 1) != (mode == MODE_L2 || mode == MODE_ATOMIC)) continue;
            double t[2];
            int grid = 0;
            bool coop = false;
            for (int s = 0; s < 2; s++)
                t[s] = run(prop, mode, C, s, rounds, lines, smem, big, big_bytes, gl, stop, ns,
                           &base, &grid, &coop, acc, cols, stagger, delay);
            if (t[0] < 0 || t[1] < 0) {
                printf("%-8s %4d %5s %6s %10s %10s\n", names[mode], C, "-", "-", "refused", "refused");
                continue;
            }
            printf("%-8s %4d %5d %6s %10.0f %10.0f\n", names[mode], C, grid, coop ? "yes" : "no",
                   t[0], t[1]);
        }
    }
    CK(cudaFree(big));
    CK(cudaFree(gl));
    CK(cudaFree(stop));
    CK(cudaFree(ns));
    CK(cudaFree(acc));
    return 0;
}
