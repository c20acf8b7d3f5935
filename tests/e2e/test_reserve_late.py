#!/usr/bin/python3
"""test_reserve_late.py -- Reserve late (issue #28): under a prefill overload the router admits
at most --prefill-queue-tokens prompt tokens per prefill instance (decode blocks reserved, sent
to prefill) that are not yet prefilled; the rest wait in the router holding nothing, so the
decode instance's blocks held by reservations whose KV has not come (LoadReport.reserved_blocks)
stay bounded, while without the gate every queued prompt strands its blocks. A slow prefill
instance (PDSERVE_FAULT_STEP_DELAY_MS, one prompt a step) and 24 concurrent 200-token prompts
through the real services on loopback (stories260k); the same tokens either way; a request
whose deadline passes while it waits ends DEADLINE_EXCEEDED holding nothing; a storm of
deadlines and cancels while requests wait; afterwards nothing waits and nothing is held.

usage: test_reserve_late.py BIN_DIR SHARED_DIR PROTO_DIR"""
import os, random, sys, threading, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e_util as eu

H = eu.Harness(sys.argv)
pb, pbg, check = H.pb, H.pbg, H.check
import grpc

N, LEN, BS = 24, 200, 16
rng = random.Random(7)
PROMPTS = [[rng.randrange(3, 500) for _ in range(LEN)] for _ in range(N)]

def flood(router, dec):
    """N concurrent requests; returns (outputs, statuses, peak reserved blocks on dec, peak
    waiting requests at the router)."""
    stub = pbg.GenerationStub(grpc.insecure_channel("127.0.0.1:%d" % router.port))
    outs, codes = [None] * N, [None] * N
    def one(i):
        try:
            ids, _, _, _ = eu.generate(pb, stub, timeout=120, prompt_token_ids=PROMPTS[i],
                                       sampling=pb.SamplingParams(temperature=0),
                                       stopping=pb.StoppingCriteria(max_tokens=4, ignore_eos=True))
            outs[i], codes[i] = ids, "OK"
        except grpc.RpcError as e:
            codes[i] = e.code().name
    ts = [threading.Thread(target=one, args=(i,)) for i in range(N)]
    for t in ts:
        t.start()
    peak, waiting = 0, 0
    while any(t.is_alive() for t in ts):
        try:
            peak = max(peak, H.load(dec).reserved_blocks)
            if router.mport:
                waiting = max(waiting, eu.Scrape(router.mport).get("pdserve_router_prefill_waiting_requests"))
        except Exception:
            pass
        time.sleep(0.01)
    for t in ts:
        t.join()
    return outs, codes, peak, waiting

try:
    common = ["--model", H.model, "--listen", "127.0.0.1:0", "--metrics-port", "0"]
    dec = H.start("pdserve-decode", *common, tag="decode")
    slow = dict(H.env, PDSERVE_FAULT_STEP_DELAY_MS="40")
    pre = H.start("pdserve-prefill", *common, "--max-num-batched-tokens", "256", tag="prefill",
                  env=slow)
    inst = ["--prefill", "127.0.0.1:%d" % pre.port, "--decode", "127.0.0.1:%d" % dec.port,
            "--prefill-policy", "remote", "--load-poll-ms", "50"]
    gated = H.start("pdserve-router", *common, *inst, "--prefill-queue-tokens", "400", tag="router-gated")
    open_ = H.start("pdserve-router", *common, *inst, "--prefill-queue-tokens", "0", tag="router-open")
    per = (LEN + 1 + BS - 1) // BS  # blocks one reservation holds
    out_g, codes_g, peak_g, wait_g = flood(gated, dec)
    check(codes_g == ["OK"] * N, "gated: all %d requests OK (%s)" % (N, sorted(set(codes_g))))
    # Admitted: while fewer than 400 tokens are admitted one more may go: at most 3 prompts.
    check(peak_g <= 3 * per, "gated: at most %d decode blocks held by reservations waiting for "
          "their KV (peak %d)" % (3 * per, peak_g))
    check(wait_g > 0, "gated: requests waited in the router (peak %d)" % wait_g)
    out_o, codes_o, peak_o, _ = flood(open_, dec)
    check(codes_o == ["OK"] * N, "ungated: all %d requests OK" % N)
    check(peak_o >= 2 * max(peak_g, per), "ungated: the prefill backlog strands decode blocks "
          "(peak %d, gated %d)" % (peak_o, peak_g))
    check(out_g == out_o, "the same tokens with and without the gate")
    # A deadline that passes while the request waits: DEADLINE_EXCEEDED, nothing held.
    stub = pbg.GenerationStub(grpc.insecure_channel("127.0.0.1:%d" % gated.port))
    bg = threading.Thread(target=flood, args=(gated, dec))
    bg.start()
    time.sleep(0.1)
    try:
        eu.generate(pb, stub, timeout=0.2, prompt_token_ids=PROMPTS[0],
                    stopping=pb.StoppingCriteria(max_tokens=4))
        code = "OK"
    except grpc.RpcError as e:
        code = e.code().name
    bg.join()
    check(code == "DEADLINE_EXCEEDED", "a deadline passed while waiting: %s" % code)
    # A storm of deadlines and cancels while most requests wait in the router.
    def stormer(i):
        r = random.Random(i)
        try:
            call = stub.Generate(pb.GenerateRequest(prompt_token_ids=PROMPTS[i % N],
                                                    stopping=pb.StoppingCriteria(max_tokens=4)),
                                 timeout=r.uniform(0.02, 0.4))
            if r.random() < 0.5:
                threading.Timer(r.uniform(0.0, 0.2), call.cancel).start()
            for _ in call:
                pass
        except grpc.RpcError:
            pass
    ts = [threading.Thread(target=stormer, args=(i,)) for i in range(150)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    check(gated.p.poll() is None and dec.p.poll() is None and pre.p.poll() is None,
          "a storm of 150 deadlines and cancels while waiting: every process alive")
    eu.wait_until(lambda: eu.Scrape(gated.mport).get("pdserve_router_prefill_admitted_tokens") == 0, 10)
    s = eu.Scrape(gated.mport)
    check(s.get("pdserve_router_prefill_waiting_requests") == 0 and
          s.get("pdserve_router_prefill_admitted_tokens") == 0,
          "afterwards nothing waits in the router and no token is admitted")
    check(s.get("pdserve_router_prefill_wait_seconds_count") > 0, "waits are measured")
    ok = eu.wait_until(lambda: H.load(dec).reserved_blocks == 0 and
                       all(H.load(p).free_blocks == H.load(p).total_blocks for p in (dec, pre)), 5)
    check(ok, "every block free on prefill and decode")
    H.stop()
finally:
    H.kill_all()
H.finish()
