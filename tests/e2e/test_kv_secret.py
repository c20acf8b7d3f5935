#!/usr/bin/python3
"""test_kv_secret.py -- --kv-secret-file through the router (issue #26): prefill and decode
with the same secret generate the same greedy tokens as without one, with the KV really moved
(transfers counted on both sides); with different secrets the request fails with an error (not
a hang), no KV block stays held, and both instances keep serving.

usage: test_kv_secret.py BIN_DIR SHARED_DIR PROTO_DIR"""
import os, sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e_util as eu

H = eu.Harness(sys.argv, log_level="warn")
pb, pbg, check = H.pb, H.pbg, H.check
import grpc

def gen(router):
    stub = pbg.GenerationStub(grpc.insecure_channel("127.0.0.1:%d" % router.port))
    ids, _, _, _ = eu.generate(pb, stub, timeout=20, prompt="Once upon a time",
                               sampling=pb.SamplingParams(temperature=0),
                               stopping=pb.StoppingCriteria(max_tokens=16, ignore_eos=True))
    return ids

def stack(tag, pre_secret, dec_secret):
    common = ["--model", H.model, "--listen", "127.0.0.1:0", "--metrics-port", "0"]
    sec = lambda f: ["--kv-secret-file", f] if f else []
    dec = H.start("pdserve-decode", *common, *sec(dec_secret), tag="decode-" + tag)
    pre = H.start("pdserve-prefill", *common, *sec(pre_secret), tag="prefill-" + tag)
    rtr = H.start("pdserve-router", *common, "--prefill", "127.0.0.1:%d" % pre.port,
                  "--decode", "127.0.0.1:%d" % dec.port, tag="router-" + tag)
    return dec, pre, rtr

try:
    for name, data in (("a", b"correct horse battery staple 1234"), ("b", b"another secret, also 32 bytes!!")):
        with open(os.path.join(H.tmp, name), "wb") as f:
            f.write(data)
    a, b = os.path.join(H.tmp, "a"), os.path.join(H.tmp, "b")
    d0, p0, r0 = stack("none", None, None)
    want = gen(r0)
    d1, p1, r1 = stack("same", a, a)
    got = gen(r1)
    check(got == want and len(got) == 16, "same secret: the same greedy tokens as without one")
    check(eu.Scrape(p1.mport).get("pdserve_kv_transfers_total", direction="send") == 1 and
          eu.Scrape(d1.mport).get("pdserve_kv_transfers_total", direction="recv") == 1,
          "same secret: the KV moved (one transfer on each side)")
    d2, p2, r2 = stack("diff", a, b)
    try:
        gen(r2)
        check(False, "different secrets: the request fails")
    except grpc.RpcError as e:
        check(e.code() != grpc.StatusCode.OK, "different secrets: the request fails with %s (%s)"
              % (e.code().name, e.details()))
    check(eu.wait_until(lambda: eu.Scrape(d2.mport).get("pdserve_kv_cache_used_blocks") == 0 and
                        eu.Scrape(p2.mport).get("pdserve_kv_cache_used_blocks") == 0, 15),
          "different secrets: every KV block is free on both sides")
    check(gen(r1) == want, "the authenticated stack still serves")
    H.stop()
finally:
    H.kill_all()
H.finish()
