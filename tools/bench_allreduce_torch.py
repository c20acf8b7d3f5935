#!/usr/bin/env python3
"""bench_allreduce_torch.py -- the reference for pdserve-bench-kernels --all-reduce: NCCL's
all-reduce as PyTorch calls it (torch.distributed, one process a GPU, torch's own NCCL), timed
as nccl-tests times it: bf16 sum of the same sizes, after warm-up, median over batches of
calls, bus bandwidth = bytes x 2(N-1)/N / time. Prints one JSON line a size (rank 0) and ends
with a table. Usage: bench_allreduce_torch.py --ranks N [--json]"""
import argparse, json, os, statistics, sys, time

SIZES = [4096, 8192, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864, 268435456]
REPEATS = 7


def worker(rank, n, port, out_q):
    import torch
    import torch.distributed as dist
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=n, device_id=torch.device("cuda", rank))
    buf = torch.rand(SIZES[-1] // 2, device="cuda", dtype=torch.bfloat16)
    rows = []
    for size in SIZES:
        x = buf[: size // 2]
        calls = max(20, min(200, (1 << 30) // size))
        ts = []
        for r in range(-1, REPEATS):
            torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                dist.all_reduce(x)
            torch.cuda.synchronize()
            if r >= 0:
                ts.append((time.perf_counter() - t0) / calls)
        t = torch.tensor([statistics.median(ts)], device="cuda", dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank, as the C bench reports
        rows.append((size, t.item() * 1e6))
    if rank == 0:
        out_q.put((torch.__version__, ".".join(map(str, torch.cuda.nccl.version())), rows))
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, required=True)
    ap.add_argument("--port", type=int, default=29533)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=worker, args=(r, a.ranks, a.port, q)) for r in range(a.ranks)]
    for p in ps:
        p.start()
    tv, nv, rows = q.get(timeout=600)
    for p in ps:
        p.join()
    f = 2.0 * (a.ranks - 1) / a.ranks
    if a.json:
        for size, us in rows:
            print(json.dumps({"bench": "all_reduce_torch", "ranks": a.ranks, "bytes": size,
                              "us": round(us, 2), "busbw_gbps": round(f * size / us / 1e3, 2)}))
    print("## torch %s, NCCL %s: dist.all_reduce bf16, %d ranks (slowest rank's median)" %
          (tv, nv, a.ranks))
    print("%10s %12s %12s" % ("bytes", "us", "busbw GB/s"))
    for size, us in rows:
        print("%10d %12.2f %12.2f" % (size, us, f * size / us / 1e3))
    return 0 if all(p.exitcode == 0 for p in ps) else 1


if __name__ == "__main__":
    sys.exit(main())
