#!/usr/bin/python3
"""test_tp_transfer.py -- KV transfer between tensor-parallel degrees (issue #29 step 5):
pdserve-prefill at --tensor-parallel p pushes to pdserve-decode at --tensor-parallel d behind a
router, on the CPU backend with stories260k (4 KV heads), for (p, d) in (2, 1), (1, 2), (2, 2),
(1, 4), (4, 2):
  - greedy from [1] reproduces the golden story (token ids and text);
  - six prompts sent at once (greedy and seeded) give the tokens of a colocated TP 1 instance;
  - the load reports carry each instance's degree and KV heads per rank; every block is free
    afterwards on both sides;
  - a Prefill call whose decode layout has a head mapping no instance can convert (degree 3 of
    4 KV heads; 4 heads per rank at degree 2) is refused FAILED_PRECONDITION, naming it;
  - SIGTERM: every instance exits 0.

usage: test_tp_transfer.py BIN_DIR SHARED_DIR PROTO_DIR"""
import os, sys, threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e_util as eu

H = eu.Harness(sys.argv)
pb, pbg, ipb, check, load = H.pb, H.pbg, H.ipb, H.check, H.load
import grpc, json
from pdserve.internal.v1 import prefill_pb2 as ppb, prefill_pb2_grpc as ppbg

COMMON = ["--model", H.model, "--backend", "cpu", "--listen", "127.0.0.1:0", "--metrics-port", "0",
          "--kv-cache-mb", "16"]

def batch(stub):
    """Six requests at once; returns their token ids in order."""
    out = [None] * 6
    def one(k):
        sp = pb.SamplingParams(temperature=0) if k < 4 else pb.SamplingParams(temperature=0.8, seed=7 + k)
        ids, _, _, _ = eu.generate(pb, stub, timeout=60,
                                   prompt_token_ids=[1] + [(37 * k + 11 * i) % 500 + 3 for i in range(5 + 13 * k)],
                                   sampling=sp, stopping=pb.StoppingCriteria(max_tokens=24, ignore_eos=True))
        out[k] = ids
    ts = [threading.Thread(target=one, args=(k,)) for k in range(6)]
    for t in ts: t.start()
    for t in ts: t.join()
    return out

def router(tag, **kw):
    args = ["--model", H.model, "--listen", "127.0.0.1:0", "--metrics-port", "0", "--load-poll-ms", "100"]
    for k, p in kw.items():
        args += ["--" + k, "127.0.0.1:%d" % p.port]
    r = H.start("pdserve-router", *args, tag=tag)
    return r, pbg.GenerationStub(grpc.insecure_channel("127.0.0.1:%d" % r.port))

try:
    golden = json.load(open(os.path.join(H.model, "golden.json")))["cases"][0]
    col = H.start("pdserve-decode", *COMMON, "--colocated", tag="colocated-tp1")
    rc, sc = router("router-colocated", decode=col)
    want = batch(sc)
    check(all(len(x) == 24 for x in want), "colocated TP 1: six requests of 24 tokens")
    H.stop([rc, col])
    for p, d in ((2, 1), (1, 2), (2, 2), (1, 4), (4, 2)):
        pre = H.start("pdserve-prefill", *COMMON, "--tensor-parallel", str(p), tag="prefill-tp%d-%d" % (p, d))
        dec = H.start("pdserve-decode", *COMMON, "--tensor-parallel", str(d), tag="decode-tp%d-%d" % (d, p))
        r, s = router("router-%d-%d" % (p, d), prefill=pre, decode=dec)
        ids, text, fin, _ = eu.generate(pb, s, timeout=60, prompt_token_ids=[1],
                                        sampling=pb.SamplingParams(temperature=0),
                                        stopping=pb.StoppingCriteria(max_tokens=400))
        check(ids == golden["greedy_ids"] and text == golden["greedy_text"],
              "prefill TP %d -> decode TP %d: greedy from [1] is the golden story (%d tokens)" % (p, d, len(ids)))
        got = batch(s)
        check(got == want, "prefill TP %d -> decode TP %d: six concurrent requests give colocated TP 1's tokens" % (p, d))
        lp, ld = load(pre), load(dec)
        check(lp.kv_layout.tensor_parallel == p and lp.kv_layout.kv_heads_per_rank == 4 // p and
              ld.kv_layout.tensor_parallel == d and ld.kv_layout.kv_heads_per_rank == 4 // d and
              lp.kv_layout.num_kv_heads == ld.kv_layout.num_kv_heads == 4,
              "prefill TP %d -> decode TP %d: the load reports carry degree and heads per rank" % (p, d))
        check(eu.wait_until(lambda: load(pre).free_blocks == lp.total_blocks and
                            load(dec).free_blocks == ld.total_blocks, 5),
              "prefill TP %d -> decode TP %d: every KV block free afterwards" % (p, d))
        if (p, d) == (2, 2):
            # the decode side's head mapping, as the prefill instance receives it
            pstub = ppbg.PrefillStub(grpc.insecure_channel("127.0.0.1:%d" % pre.port))
            for tp, per, name in ((3, 1, "degree 3"), (2, 4, "degree 2 with 4")):
                t = ppb.PrefillRequest(request_id="bad-map", prompt_token_ids=[1, 5, 9])
                t.sampling.temperature = 0
                t.kv_target.kv_descriptor = b"\0" * 64
                t.kv_target.block_ids.extend([0])
                t.kv_target.layout.CopyFrom(ld.kv_layout)
                t.kv_target.layout.tensor_parallel = tp
                t.kv_target.layout.kv_heads_per_rank = per
                try:
                    pstub.Prefill(t, timeout=20)
                    code, det = "OK", ""
                except grpc.RpcError as e:
                    code, det = e.code().name, e.details()
                check(code == "FAILED_PRECONDITION" and ("tensor parallel %s" % name) in det,
                      "a decode layout of %s KV heads per rank at degree %d is refused (%s: %s)" % (per, tp, code, det))
            check(pre.p.poll() is None, "the prefill instance survives the refusals")
        H.stop([r, pre, dec])
except Exception:
    H.kill_all()
    raise
H.finish()
