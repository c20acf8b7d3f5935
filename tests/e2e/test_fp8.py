#!/usr/bin/python3
"""test_fp8.py -- FP8 through the services (issue #37) on the CPU backend with stories260k:
  - a colocated instance with --quantization fp8 --kv-cache-dtype fp8 serves six requests
    (greedy and seeded); its load report says its KV dtype is fp8_e4m3;
  - disaggregated, prefill and decode both FP8 (every prompt through the prefill instance, the
    FP8 KV bytes pushed over UCX), the same six requests give the colocated FP8 tokens; and at
    tensor parallel degree 2 on both sides, a colocated FP8 instance at TP 2's tokens (each
    rank quantizes its own part of o_proj's and down's inputs, so TP 2 is not TP 1's bits);
  - an FP8-KV prefill instance refuses a decode instance's bf16 (here f32) KV layout with
    FAILED_PRECONDITION naming both dtypes, and a router over that pair fails the request with
    a message, never garbage tokens; every block is free afterwards;
  - --quantization / --kv-cache-dtype with a bad value: the instance exits 2 naming it.

usage: test_fp8.py BIN_DIR SHARED_DIR PROTO_DIR"""
import os, subprocess, sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e_util as eu

H = eu.Harness(sys.argv)
pb, pbg, ipb, check, load = H.pb, H.pbg, H.ipb, H.check, H.load
import grpc
from pdserve.internal.v1 import prefill_pb2 as ppb, prefill_pb2_grpc as ppbg
from pdserve.internal.v1 import kv_pb2

COMMON = ["--model", H.model, "--backend", "cpu", "--listen", "127.0.0.1:0", "--metrics-port", "0",
          "--kv-cache-mb", "16"]
FP8 = ["--quantization", "fp8", "--kv-cache-dtype", "fp8"]

def batch(stub):
    """Six requests, one after another; returns their token ids in order. Not at once: FP8
    quantizes each row's activations, and which rows share a step (timing) moves the f32 sums
    by an ulp that a quantization step can turn into another token; alone, each request's
    steps are the same computation colocated and disaggregated, which is what is compared.
    (Concurrent requests through FP8 instances: test_plan, the storms.)"""
    out = [None] * 6
    def one(k):
        sp = pb.SamplingParams(temperature=0) if k < 4 else pb.SamplingParams(temperature=0.8, seed=7 + k)
        ids, _, _, _ = eu.generate(pb, stub, timeout=60,
                                   prompt_token_ids=[1] + [(37 * k + 11 * i) % 500 + 3 for i in range(5 + 13 * k)],
                                   sampling=sp, stopping=pb.StoppingCriteria(max_tokens=24, ignore_eos=True))
        out[k] = ids
    for k in range(6):
        one(k)
    return out

def router(tag, *extra, **kw):
    args = ["--model", H.model, "--listen", "127.0.0.1:0", "--metrics-port", "0", "--load-poll-ms", "100"]
    for k, p in kw.items():
        args += ["--" + k, "127.0.0.1:%d" % p.port]
    r = H.start("pdserve-router", *args, *extra, tag=tag)
    return r, pbg.GenerationStub(grpc.insecure_channel("127.0.0.1:%d" % r.port))

F8 = kv_pb2.KvDtype.Value("KV_DTYPE_F8E4M3")
try:
    # bad values are refused at start
    for flag, val in (("--quantization", "int4"), ("--kv-cache-dtype", "fp4")):
        p = subprocess.run([os.path.join(H.bin, "pdserve-decode"), *COMMON, "--colocated", flag, val],
                           capture_output=True, text=True, timeout=60)
        check(p.returncode != 0 and val in p.stderr,
              "%s %s: the instance exits (%d) naming it: %s" % (flag, val, p.returncode, p.stderr.strip()[-160:]))

    want = {}
    for d in (1, 2):
        col = H.start("pdserve-decode", *COMMON, *FP8, "--colocated", "--tensor-parallel", str(d),
                      tag="colocated-fp8-tp%d" % d)
        rc, sc = router("router-colocated-%d" % d, decode=col)
        want[d] = batch(sc)
        check(all(x is not None and len(x) == 24 for x in want[d]),
              "colocated FP8 at TP %d: six requests of 24 tokens" % d)
        lc = load(col)
        check(lc.kv_layout.dtype == F8, "colocated FP8: the load report's KV dtype is fp8_e4m3 (%d)" % lc.kv_layout.dtype)
        H.stop([rc, col])

    for d in (1, 2):
        pre = H.start("pdserve-prefill", *COMMON, *FP8, "--tensor-parallel", str(d), tag="prefill-fp8-tp%d" % d)
        dec = H.start("pdserve-decode", *COMMON, *FP8, "--tensor-parallel", str(d), tag="decode-fp8-tp%d" % d)
        r, s = router("router-fp8-%d" % d, "--prefill-policy", "remote", prefill=pre, decode=dec)
        got = batch(s)
        check(got == want[d], "prefill FP8 -> decode FP8 at TP %d: the colocated FP8 tokens" % d)
        lp, ld = load(pre), load(dec)
        check(lp.kv_layout.dtype == F8 and ld.kv_layout.dtype == F8,
              "prefill and decode report fp8_e4m3 KV layouts")
        check(eu.wait_until(lambda: load(pre).free_blocks == lp.total_blocks and
                            load(dec).free_blocks == ld.total_blocks, 5),
              "FP8 at TP %d: every KV block free afterwards" % d)
        H.stop([r, pre, dec])

    # an FP8-KV prefill instance and a decode instance with the backend's own KV
    pre = H.start("pdserve-prefill", *COMMON, *FP8, tag="prefill-fp8-mixed")
    dec = H.start("pdserve-decode", *COMMON, "--quantization", "fp8", tag="decode-native-kv")
    ld = load(dec)
    check(ld.kv_layout.dtype != F8, "a decode instance without --kv-cache-dtype keeps its native KV")
    pstub = ppbg.PrefillStub(grpc.insecure_channel("127.0.0.1:%d" % pre.port))
    t = ppb.PrefillRequest(request_id="dtype-mismatch", prompt_token_ids=[1, 5, 9])
    t.sampling.temperature = 0
    t.kv_target.kv_descriptor = b"\0" * 64
    t.kv_target.block_ids.extend([0])
    t.kv_target.layout.CopyFrom(ld.kv_layout)
    try:
        pstub.Prefill(t, timeout=20)
        code, det = "OK", ""
    except grpc.RpcError as e:
        code, det = e.code().name, e.details()
    check(code == "FAILED_PRECONDITION" and "fp8_e4m3" in det and "f32" in det and "--kv-cache-dtype" in det,
          "FP8-KV prefill refuses a f32 KV layout (%s: %s)" % (code, det))
    r, s = router("router-mixed", "--prefill-policy", "remote", prefill=pre, decode=dec)
    try:
        eu.generate(pb, s, timeout=30, prompt_token_ids=[1, 5, 9, 11],
                    sampling=pb.SamplingParams(temperature=0), stopping=pb.StoppingCriteria(max_tokens=4))
        code, det = "OK", ""
    except grpc.RpcError as e:
        code, det = e.code().name, e.details()
    check(code == "FAILED_PRECONDITION" and "KV_DTYPE_F8E4M3" in det and "KV_DTYPE_F32" in det,
          "a router over a mismatched pair fails the request saying why (%s: %s)" % (code, det))
    lp = load(pre)
    check(eu.wait_until(lambda: load(pre).free_blocks == lp.total_blocks and
                        load(dec).free_blocks == ld.total_blocks, 5),
          "mismatched pair: every KV block free afterwards")
    check(pre.p.poll() is None and dec.p.poll() is None, "both instances survive the refusals")
    H.stop([r, pre, dec])
except Exception:
    H.kill_all()
    raise
H.finish()
