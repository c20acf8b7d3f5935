#!/usr/bin/python3
"""test_internal_ports.py -- The internal ports are not an open door (issue #26). Driven with
Python grpcio straight at the instances, as anyone who can reach the ports could:
  - an internal Decode with out-of-range token ids is refused with INVALID_ARGUMENT (it was a
    use after free in the handler's log line);
  - a flood of internal Decode reservations from one caller is bounded: with
    --max-reserved-share-per-caller 0.25 the caller's reservations hold at most a quarter of
    the pool (plus one request), later calls get RESOURCE_EXHAUSTED naming the flag; the load
    report counts the reservations (reserved_blocks, waiting_seqs) and /metrics shows them;
  - that flood cannot starve the router (issue #38 item 7): every instance and the router share
    --kv-secret-file, the router signs its calls with it and so has a reservation share of
    its own; while the flood holds its share, requests through the router still succeed;
  - a reservation nobody fills expires after --reservation-timeout-ms and its blocks are free;
  - a Prefill call with a corrupted KV descriptor (bytes flipped in the decode instance's real
    descriptor) is refused and the prefill instance keeps serving;
  - EndChoice ends a choice only when named by the end_key its own Decode call carried: a
    wrong key is not found (nothing ends), an index out of range is INVALID_ARGUMENT; the
    right one ends that choice (its last burst CANCELLED, early) while the other runs to
    max_tokens, and once the call ended the key finds nothing;
  - after all that, the stack still generates through the router.

usage: test_internal_ports.py BIN_DIR SHARED_DIR PROTO_DIR"""
import os, sys, threading, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e_util as eu

H = eu.Harness(sys.argv)
pb, pbg, check, load = H.pb, H.pbg, H.check, H.load
import grpc
from pdserve.internal.v1 import decode_pb2 as dpb, decode_pb2_grpc as dpbg
from pdserve.internal.v1 import prefill_pb2 as ppb, prefill_pb2_grpc as ppbg

def dreq(ids, max_tokens=4):
    return dpb.DecodeRequest(request_id="probe", prompt_token_ids=ids,
                             sampling=pb.SamplingParams(temperature=0),
                             stopping=pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True))

try:
    MODEL = H.model
    secret = os.path.join(H.tmp, "kv.secret")
    with open(secret, "w") as f:
        f.write("a shared secret of this deployment, 48 bytes ok\n")
    common = ["--model", MODEL, "--listen", "127.0.0.1:0", "--metrics-port", "0",
              "--kv-secret-file", secret]
    # 8 MiB of KV for stories260k: 16-token blocks; the pool size is read from the load report.
    dec = H.start("pdserve-decode", *common, "--kv-cache-mb", "8", "--max-reserved-share-per-caller",
                "0.25", "--reservation-timeout-ms", "3000", tag="decode")
    pre = H.start("pdserve-prefill", *common, tag="prefill")
    rtr = H.start("pdserve-router", "--model", MODEL, "--listen", "127.0.0.1:0", "--metrics-port", "0",
                "--prefill", "127.0.0.1:%d" % pre.port, "--decode", "127.0.0.1:%d" % dec.port,
                "--kv-secret-file", secret, tag="router")
    dch = grpc.insecure_channel("127.0.0.1:%d" % dec.port)
    dstub = dpbg.DecodeStub(dch)
    vocab = 512

    # 1. Out-of-range token ids.
    try:
        list(dstub.Decode(dreq([1, 5, vocab + 7]), timeout=5))
        check(False, "Decode with an out-of-range token id is refused")
    except grpc.RpcError as e:
        check(e.code() == grpc.StatusCode.INVALID_ARGUMENT and "out of range" in e.details(),
              "Decode with an out-of-range token id: INVALID_ARGUMENT (%s: %s)" % (e.code().name, e.details()))
    check(dec.p.poll() is None, "the decode instance is alive")
    # The public API's limits hold at the internal ports too (issue #38 item 7: 100,000 stop
    # strings and a 10 KB request_id were accepted, and held calls grew the RSS by gigabytes).
    pstub = ppbg.PrefillStub(grpc.insecure_channel("127.0.0.1:%d" % pre.port))
    # Prefill checks the prompt with the same validator (svc_request_check), before anything
    # else of the request.
    for ids, want in (([1, 5, vocab + 7], "out of range"), ([], "prompt_token_ids is empty"),
                      ([1] * 100000, "maximum length")):
        try:
            pstub.Prefill(ppb.PrefillRequest(prompt_token_ids=ids), timeout=10)
            check(False, "Prefill with %s is refused" % want)
        except grpc.RpcError as e:
            check(e.code() == grpc.StatusCode.INVALID_ARGUMENT and want in e.details(),
                  "Prefill, %s: INVALID_ARGUMENT (%s: %s)" % (want, e.code().name, e.details()))
    for what, req, want in (
            ("a 10 KB request_id", dict(request_id="x" * 10240), "request_id: at most 128 bytes"),
            ("100,000 stop strings", dict(stop=["s%d" % i for i in range(100000)]), "at most 16 stop strings"),
            ("a 1 KB stop string", dict(stop=["y" * 1024]), "at most 256 bytes"),
            ("logprobs 21", dict(logprobs=21), "logprobs: at most 20"),
            ("n 17", dict(n=17), "n: at most 16 choices")):
        for side, call in (("Decode", lambda r: list(dstub.Decode(r, timeout=10))),
                           ("Prefill", lambda r: pstub.Prefill(r, timeout=10))):
            base = dreq([1, 5, 9]) if side == "Decode" else ppb.PrefillRequest(
                request_id="probe", prompt_token_ids=[1, 5, 9], sampling=pb.SamplingParams(temperature=0))
            if "request_id" in req: base.request_id = req["request_id"]
            if "stop" in req: base.stopping.stop.extend(req["stop"])
            if "logprobs" in req: base.logprobs = req["logprobs"]
            if "n" in req: base.n = req["n"]
            if side == "Prefill":  # past the KV target's checks to the request's own
                base.kv_target.kv_descriptor = b"\0" * 64
                base.kv_target.block_ids.extend([0])
                base.kv_target.layout.CopyFrom(load(pre).kv_layout)
            try:
                call(base)
                code, det = "OK", ""
            except grpc.RpcError as e:
                code, det = e.code().name, e.details()
            check(code == "INVALID_ARGUMENT" and want in det,
                  "internal %s with %s: INVALID_ARGUMENT (%s: %s)" % (side, what, code, det[:100]))
    check(dec.p.poll() is None and pre.p.poll() is None, "both instances are alive")

    # 2. A reservation flood from one caller.
    l0 = load(dec)
    total = l0.total_blocks
    prompt = [1] + [(7 * i) % 400 + 3 for i in range(60)]   # 61 tokens: 4 blocks of 16 each
    calls, first_msgs, refused = [], [], []
    lock = threading.Lock()
    def reserve():
        call = dstub.Decode(dreq(prompt), timeout=60)
        try:
            m = next(call)
            with lock:
                calls.append(call)
                first_msgs.append(m)
        except grpc.RpcError as e:
            with lock:
                refused.append((e.code(), e.details()))
    ths = [threading.Thread(target=reserve) for _ in range(64)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    held = len(first_msgs)
    l1 = load(dec)
    print("pool %d blocks; %d reservations held, %d refused; load report: reserved_blocks %d, "
          "waiting %d, free %d" % (total, held, len(refused), l1.reserved_blocks, l1.waiting_seqs,
                                   l1.free_blocks))
    check(held > 0 and all(m.HasField("reservation") for m in first_msgs),
          "reservations answered with a KV target")
    check(l1.reserved_blocks <= total // 4 + 4, "one caller holds at most a quarter of the pool "
          "(+ one request) in reservations (%d of %d)" % (l1.reserved_blocks, total))
    check(len(refused) > 0 and all(c == grpc.StatusCode.RESOURCE_EXHAUSTED for c, _ in refused),
          "the rest are RESOURCE_EXHAUSTED")
    check(any("max-reserved-share-per-caller" in d for _, d in refused),
          "the refusal names the flag (%s)" % (refused[0][1] if refused else ""))
    check(l1.reserved_blocks == held * 4 and l1.waiting_seqs >= held,
          "the load report counts them (reserved_blocks %d, waiting_seqs %d)" % (l1.reserved_blocks, l1.waiting_seqs))
    m = eu.Scrape(dec.mport)
    check(m.get("pdserve_kv_reservations") == held and m.get("pdserve_kv_reservations_refused_total") >= len(refused),
          "/metrics shows the reservations and the refusals")

    # The router's own share: requests through it succeed while the flood holds its own.
    rstub = pbg.GenerationStub(grpc.insecure_channel("127.0.0.1:%d" % rtr.port))
    outs = []
    for k in range(6):
        try:
            ids = eu.generate(pb, rstub, timeout=30, prompt_token_ids=[1] + [(11 * j + k) % 400 + 3 for j in range(60)],
                              sampling=pb.SamplingParams(temperature=0),
                              stopping=pb.StoppingCriteria(max_tokens=4, ignore_eos=True))[0]
            outs.append("OK" if len(ids) == 4 else "short")
        except grpc.RpcError as e:
            outs.append("%s: %s" % (e.code().name, e.details()))
    check(outs == ["OK"] * 6, "while a third process holds its share in reservations, requests "
          "through the router (signed with the shared secret: a share of its own) succeed (%s)" % outs[:2])
    check(load(dec).reserved_blocks == held * 4, "and the flood's reservations are still held")

    # 3. A corrupted descriptor at the prefill port (taken from a real reservation).
    kv = first_msgs[0].reservation.kv_target
    pch = grpc.insecure_channel("127.0.0.1:%d" % pre.port)
    pstub = ppbg.PrefillStub(pch)
    desc = bytearray(kv.kv_descriptor)
    outcomes = []
    for pos in sorted({len(desc) // 3, len(desc) // 2, len(desc) - 5, 40, 80}):
        if pos >= len(desc):
            continue
        bad = bytearray(desc)
        bad[pos] ^= 0x5a
        t = ppb.PrefillRequest()
        t.kv_target.CopyFrom(kv)
        t.kv_target.kv_descriptor = bytes(bad)
        t.request_id = "evil"
        t.prompt_token_ids.extend(prompt)
        t.sampling.temperature = 0
        try:
            pstub.Prefill(t, timeout=20)
            outcomes.append("OK")
        except grpc.RpcError as e:
            outcomes.append(e.code().name)
        if pre.p.poll() is not None:
            break
    print("corrupted descriptors: %s" % outcomes)
    check(pre.p.poll() is None, "the prefill instance survived %d corrupted descriptors" % len(outcomes))
    check("OK" not in outcomes, "none of them was accepted")

    # 4. Unfilled reservations expire; their blocks come back.
    check(eu.wait_until(lambda: load(dec).reserved_blocks == 0, 10),
          "unfilled reservations expire after --reservation-timeout-ms")
    ends = []
    for c in calls:
        try:
            for _ in c:
                pass
            ends.append("OK")
        except grpc.RpcError as e:
            ends.append(e.code().name)
    check(all(e != "OK" for e in ends), "each expired reservation's stream ended with an error (%s)"
          % sorted(set(ends)))
    check(eu.wait_until(lambda: eu.Scrape(dec.mport).get("pdserve_kv_cache_used_blocks") == 0, 10),
          "every KV block is free again")

    # 5. EndChoice, straight at the decode port: n = 2, the prompt computed there.
    key = 0x5eed1234abcd
    call = dstub.Decode(dpb.DecodeRequest(
        request_id="ends", prompt_token_ids=[1, 400, 300, 200], n=2, end_key=key,
        local_prefill=True,
        sampling=pb.SamplingParams(temperature=0.8, seed=3),
        stopping=pb.StoppingCriteria(max_tokens=480, ignore_eos=True)), timeout=60)
    got, fins = {0: 0, 1: 0}, {}
    def take(m):
        if m.HasField("tokens"):
            got[m.tokens.index] += len(m.tokens.token_ids)
            if m.tokens.finish_reason:
                fins[m.tokens.index] = m.tokens.finish_reason
    take(next(call))
    wrong = dstub.EndChoice(dpb.EndChoiceRequest(end_key=key + 1, index=1), timeout=5)
    try:
        dstub.EndChoice(dpb.EndChoiceRequest(end_key=key, index=2), timeout=5)
        bad_index = "OK"
    except grpc.RpcError as e:
        bad_index = e.code().name
    right = dstub.EndChoice(dpb.EndChoiceRequest(end_key=key, index=1), timeout=5)
    for m in call:
        take(m)
    after = dstub.EndChoice(dpb.EndChoiceRequest(end_key=key, index=0), timeout=5)
    check(not wrong.found and bad_index == "INVALID_ARGUMENT" and right.found and not after.found,
          "EndChoice: a wrong key is not found, index 2 of 2 choices is INVALID_ARGUMENT (%s), the "
          "right key is, and after the call ended it is not" % bad_index)
    check(fins.get(1) == pb.FINISH_REASON_CANCELLED and got[1] < 480 and
          fins.get(0) == pb.FINISH_REASON_LENGTH and got[0] == 480,
          "EndChoice ended choice 1 after %d tokens (CANCELLED); choice 0 ran its 480" % got[1])

    # 6. The stack still serves.
    stub = pbg.GenerationStub(grpc.insecure_channel("127.0.0.1:%d" % rtr.port))
    ids, text, fin, usage = eu.generate(pb, stub, timeout=20, prompt="Once upon a time",
                                        sampling=pb.SamplingParams(temperature=0),
                                        stopping=pb.StoppingCriteria(max_tokens=8))
    check(len(ids) == 8, "the router still generates (%d tokens)" % len(ids))
    check(all(p.p.poll() is None for p in H.procs), "no process died")
    H.stop()
finally:
    H.kill_all()
H.finish()
