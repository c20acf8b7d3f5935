#!/usr/bin/python3
"""bench_stack.py -- TTFT / TPOT / throughput of the stack on one machine with a Python grpcio
client: through the router to a prefill + decode pair (disaggregated), through the router to a
colocated decode instance, and straight to the colocated instance's internal Decode RPC (no
router), so the router's overhead per request shows. Not a test: prints a table.

usage: bench_stack.py BIN_DIR MODEL_DIR [N_REQUESTS] [MAX_TOKENS] [CONCURRENCY]"""
import os, statistics, subprocess, sys, tempfile, threading, time

BIN, MODEL = sys.argv[1], sys.argv[2]
N = int(sys.argv[3]) if len(sys.argv) > 3 else 50
MAXT = int(sys.argv[4]) if len(sys.argv) > 4 else 64
CONC = int(sys.argv[5]) if len(sys.argv) > 5 else 16
import grpc
TMP = tempfile.mkdtemp(prefix="pdserve-bench-")
PROTO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "proto")
subprocess.check_call(["protoc", "-I" + PROTO, "--python_out=" + TMP, "--grpc_python_out=" + TMP,
                       "--plugin=protoc-gen-grpc_python=" + subprocess.check_output(["which", "grpc_python_plugin"]).decode().strip(),
                       "pdserve/v1/generation.proto", "pdserve/internal/v1/kv.proto",
                       "pdserve/internal/v1/decode.proto"], cwd=PROTO)
sys.path.insert(0, TMP)
from pdserve.v1 import generation_pb2 as pb, generation_pb2_grpc as pbg
from pdserve.internal.v1 import decode_pb2 as dpb, decode_pb2_grpc as dpbg

ENV = dict(os.environ, UCX_WARN_UNUSED_ENV_VARS="n", PDSERVE_LOG_LEVEL="warn")
procs = []
def start(name, *args):
    p = subprocess.Popen([os.path.join(BIN, name)] + list(args), stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, env=ENV, text=True)
    procs.append(p)
    return int(p.stdout.readline().split()[1])

def timed(stream_fn):
    t0 = time.perf_counter(); times = []
    for r in stream_fn():
        n = len(r.token_ids) if hasattr(r, "token_ids") else len(r.tokens.token_ids)
        if n:
            times += [time.perf_counter()] * n
    return t0, times

def stats(runs):
    ttft = [t[0] - t0 for t0, t in runs if t]
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for t0, t in runs if len(t) > 1]
    e2e = [t[-1] - t0 for t0, t in runs if t]
    p = lambda v, q: sorted(v)[min(len(v) - 1, int(q * len(v)))] * 1000
    return "TTFT p50 %.2f ms p90 %.2f ms | TPOT p50 %.3f ms | E2E p50 %.1f ms" % (p(ttft, .5), p(ttft, .9), statistics.median(tpot) * 1000, p(e2e, .5))

def run(name, fn):
    fn()  # warm-up
    seq = [timed(fn) for _ in range(N)]
    t0 = time.perf_counter(); out = []
    def w():
        for _ in range(N // CONC or 1):
            out.append(timed(fn))
    th = [threading.Thread(target=w) for _ in range(CONC)]
    [x.start() for x in th]; [x.join() for x in th]
    el = time.perf_counter() - t0
    toks = sum(len(t) for _, t in out)
    print("%-34s sequential: %s" % (name, stats(seq)))
    print("%-34s %d concurrent: %.1f req/s, %.0f output tok/s, %s" % ("", CONC, len(out) / el, toks / el, stats(out)))

try:
    common = ["--model", MODEL, "--listen", "127.0.0.1:0"]
    pp = start("pdserve-prefill", *common)
    dp = start("pdserve-decode", *common)
    cp = start("pdserve-decode", *(common + ["--colocated"]))
    rp = start("pdserve-router", "--model", MODEL, "--listen", "127.0.0.1:0", "--prefill", "127.0.0.1:%d" % pp, "--decode", "127.0.0.1:%d" % dp)
    rp2 = start("pdserve-router", "--model", MODEL, "--listen", "127.0.0.1:0", "--decode", "127.0.0.1:%d" % cp)
    g1 = pbg.GenerationStub(grpc.insecure_channel("127.0.0.1:%d" % rp))
    g2 = pbg.GenerationStub(grpc.insecure_channel("127.0.0.1:%d" % rp2))
    d2 = dpbg.DecodeStub(grpc.insecure_channel("127.0.0.1:%d" % cp))
    prompt = [1] + [300 + (j * 13) % 200 for j in range(63)]   # 64 prompt tokens
    samp = pb.SamplingParams(temperature=0)
    stop = pb.StoppingCriteria(max_tokens=MAXT, ignore_eos=True)
    print("stories-style model %s: prompt 64 tokens, %d output tokens, %d requests each" % (os.path.basename(MODEL), MAXT, N))
    run("router -> prefill + decode", lambda: g1.Generate(pb.GenerateRequest(prompt_token_ids=prompt, sampling=samp, stopping=stop)))
    run("router -> colocated decode", lambda: g2.Generate(pb.GenerateRequest(prompt_token_ids=prompt, sampling=samp, stopping=stop)))
    run("colocated decode, no router", lambda: d2.Decode(dpb.DecodeRequest(prompt_token_ids=prompt, sampling=samp, stopping=stop, local_prefill=True)))
finally:
    for p in procs:
        p.kill(); p.wait()
