#!/usr/bin/python3
"""test_prefix_reuse.py -- Decode-side prefix reuse (issue #28): a decode instance with its
prefix cache on reserves a prompt's cached full blocks as they are, and the prefill instance
sends only the blocks after them (KvTarget.cached_blocks). Through the real services on
loopback (stories260k): the same prompt again, and the same prefix with another ending, give
the same greedy tokens as a decode instance without a prefix cache; the second transfer moves
fewer bytes (pdserve_kv_transfer_bytes_total) by the reused blocks, which
pdserve_kv_prefix_reused_tokens_total counts; afterwards no block is held anywhere.

usage: test_prefix_reuse.py BIN_DIR SHARED_DIR PROTO_DIR"""
import os, sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e_util as eu

H = eu.Harness(sys.argv)
pb, pbg, check = H.pb, H.pbg, H.check
import grpc

STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in "
         "the park with her friends. One day, she saw a big red ball under a tree. She ran to "
         "the ball and picked it up. It was shiny and new.")

def run(router, prompt):
    stub = pbg.GenerationStub(grpc.insecure_channel("127.0.0.1:%d" % router.port))
    ids, _, _, usage = eu.generate(pb, stub, prompt=prompt,
                                   sampling=pb.SamplingParams(temperature=0),
                                   stopping=pb.StoppingCriteria(max_tokens=24, ignore_eos=True))
    return ids, usage.prompt_tokens if usage else 0

def recv_bytes(p):
    return eu.Scrape(p.mport).get("pdserve_kv_transfer_bytes_total")

def reused(p):
    return eu.Scrape(p.mport).get("pdserve_kv_prefix_reused_tokens_total")

try:
    common = ["--model", H.model, "--listen", "127.0.0.1:0", "--metrics-port", "0"]
    dec = H.start("pdserve-decode", *common, tag="decode")
    ref = H.start("pdserve-decode", *common, "--no-prefix-cache", tag="decode-nocache")
    pre = H.start("pdserve-prefill", *common, tag="prefill")
    ra = H.start("pdserve-router", *common, "--prefill", "127.0.0.1:%d" % pre.port,
                 "--decode", "127.0.0.1:%d" % dec.port, "--prefill-policy", "remote", tag="router")
    rb = H.start("pdserve-router", *common, "--prefill", "127.0.0.1:%d" % pre.port,
                 "--decode", "127.0.0.1:%d" % ref.port, "--prefill-policy", "remote",
                 tag="router-nocache")
    bs = 16  # the services' default --block-size
    want1, n1 = run(rb, STORY)
    b0, u0 = recv_bytes(dec), reused(dec)
    got1, _ = run(ra, STORY)
    b1, u1 = recv_bytes(dec), reused(dec)
    check(got1 == want1 and len(got1) == 24, "first request: the same tokens as without a cache")
    check(u1 == u0 == 0, "first request: nothing to reuse (%d tokens)" % u1)
    got2, _ = run(ra, STORY)
    b2, u2 = recv_bytes(dec), reused(dec)
    full = (n1 - 1) // bs  # cached full blocks the reservation may share (never the last)
    check(got2 == want1, "the same prompt again: the same tokens")
    check(u2 - u1 == full * bs, "the same prompt again: %d of %d prompt tokens reused (%d full "
          "blocks)" % (u2 - u1, n1, full))
    per_block = (b1 - b0) / ((n1 + bs - 1) // bs)
    check(full > 0 and abs((b2 - b1) - (b1 - b0) + full * per_block) < 1,
          "the same prompt again: %.0f bytes moved instead of %.0f (%d blocks fewer)" %
          (b2 - b1, b1 - b0, full))
    # The same prefix with another ending: the shared full blocks are reused, the rest moves.
    other = STORY[:120] + " Then a dog came and barked at the tall green trees."
    want3, n3 = run(rb, other)
    got3, _ = run(ra, other)
    u3 = reused(dec)
    check(got3 == want3, "another ending: the same tokens as without a cache")
    check(0 < u3 - u2 < n3, "another ending: %d of %d prompt tokens reused" % (u3 - u2, n3))
    check(reused(ref) == 0, "the instance without a prefix cache reuses nothing")
    # Nothing held afterwards (cached blocks are free: only referenced blocks count).
    ok = eu.wait_until(lambda: all(H.load(p).free_blocks == H.load(p).total_blocks
                                   for p in (dec, ref, pre)), 5)
    check(ok, "every block free on prefill and both decode instances")
    H.stop()
finally:
    H.kill_all()
H.finish()
