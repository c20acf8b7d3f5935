#!/usr/bin/python3
"""test_logprobs.py -- The chosen token's log-probability reaches the client (issue #30: the
router dropped it): one TokenLogprob per token id in every GenerateResponse when the request
asks for logprobs, none when it does not; the same values whether the prompt was computed by
a prefill instance (first token from prefill, the rest from decode) or on the decode instance;
finite and <= 0; logprobs above 20 refused with INVALID_ARGUMENT.

usage: test_logprobs.py BIN_DIR SHARED_DIR PROTO_DIR"""
import math, os, sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e_util as eu

H = eu.Harness(sys.argv)
pb, pbg, check = H.pb, H.pbg, H.check
import grpc

def run(router, logprobs, temperature=0.0):
    stub = pbg.GenerationStub(grpc.insecure_channel("127.0.0.1:%d" % router.port))
    ids, lps, bad = [], [], 0
    for r in stub.Generate(pb.GenerateRequest(prompt="Once upon a time", logprobs=logprobs,
                                              sampling=pb.SamplingParams(temperature=temperature, seed=5),
                                              stopping=pb.StoppingCriteria(max_tokens=20, ignore_eos=True)),
                           timeout=30):
        if logprobs and (len(r.logprobs) != len(r.token_ids) or
                         any(lp.token_id != t for lp, t in zip(r.logprobs, r.token_ids))):
            bad += 1
        ids += list(r.token_ids)
        lps += [lp.logprob for lp in r.logprobs]
    return ids, lps, bad

try:
    common = ["--model", H.model, "--listen", "127.0.0.1:0", "--metrics-port", "0"]
    dec = H.start("pdserve-decode", *common, tag="decode")
    pre = H.start("pdserve-prefill", *common, tag="prefill")
    inst = ["--prefill", "127.0.0.1:%d" % pre.port, "--decode", "127.0.0.1:%d" % dec.port]
    remote = H.start("pdserve-router", *common, *inst, "--prefill-policy", "remote", tag="router-remote")
    local = H.start("pdserve-router", *common, *inst, "--prefill-policy", "local", tag="router-local")
    for temp in (0.0, 0.8):
        r_ids, r_lps, r_bad = run(remote, 2, temp)
        l_ids, l_lps, l_bad = run(local, 2, temp)
        check(len(r_ids) == 20 and len(r_lps) == 20 and r_bad == 0,
              "T=%.1f remote prefill: one logprob per token, in every message (%d of %d)" % (temp, len(r_lps), len(r_ids)))
        check(len(l_lps) == 20 and l_bad == 0, "T=%.1f local prefill: the same" % temp)
        check(all(math.isfinite(x) and x <= 1e-6 for x in r_lps), "T=%.1f: finite and <= 0" % temp)
        check(r_ids == l_ids and all(abs(a - b) < 1e-4 for a, b in zip(r_lps, l_lps)),
              "T=%.1f: the same tokens and logprobs wherever the prompt was computed" % temp)
    ids, lps, _ = run(remote, 0)
    check(len(ids) == 20 and lps == [], "logprobs 0: none sent")
    try:
        run(remote, 21)
        check(False, "logprobs 21 is refused")
    except grpc.RpcError as e:
        check(e.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 20" in e.details(),
              "logprobs 21: INVALID_ARGUMENT (%s)" % e.details())
    H.stop()
finally:
    H.kill_all()
H.finish()
