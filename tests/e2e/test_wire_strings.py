#!/usr/bin/python3
"""test_wire_strings.py -- Request strings and seeds through the real stack (pdserve-prefill +
pdserve-decode + two pdserve-router replicas on loopback), driven by Python grpcio:

- strings grpcio will not send (invalid UTF-8, which its str fields refuse) are hand-built
  payloads sent raw; they and NUL bytes (which protobuf-c would cut the prompt at) are
  INVALID_ARGUMENT naming the field, on the public and on the internal services;
- request_id longer than 128 bytes and stop strings longer than 256 bytes are
  INVALID_ARGUMENT; 128 and 256 bytes pass, and a 128-byte multi-byte id is echoed whole;
- the first unseeded sampled request of fresh router processes (a restart, another replica)
  differs (seeds come from the OS, not from an unseeded rand()); a seeded request does not.

usage: test_wire_strings.py BIN_DIR SHARED_DIR PROTO_DIR"""
import os, sys, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e_util as U

H = U.Harness(sys.argv, log_level="warn")
MODEL, pb, pbg, check = H.model, H.pb, H.pbg, H.check
import grpc


def start(name, *args, tag=None):
    return H.start(name, *args, "--metrics-port", "0", tag=tag)


def varint(v):
    out = b""
    while v >= 0x80:
        out += bytes([v & 0x7F | 0x80])
        v >>= 7
    return out + bytes([v])


def ld(field, b):
    return varint(field << 3 | 2) + varint(len(b)) + b


def raw_generate(ch, payload):
    """Sends payload bytes as a GenerateRequest; returns (status code, details, responses)."""
    fn = ch.unary_stream("/pdserve.v1.Generation/Generate", request_serializer=lambda b: b,
                         response_deserializer=pb.GenerateResponse.FromString)
    try:
        out = list(fn(payload, timeout=30))
        return grpc.StatusCode.OK, "", out
    except grpc.RpcError as e:
        return e.code(), e.details(), []


def status_of(fn):
    try:
        fn()
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        return e.code(), e.details()


def sample(stub, seed=None, n=24):
    sp = pb.SamplingParams(temperature=1.0) if seed is None else pb.SamplingParams(temperature=1.0, seed=seed)
    ids, _, _, _ = U.generate(pb, stub, prompt="Once upon a time", sampling=sp,
                              stopping=pb.StoppingCriteria(max_tokens=n, ignore_eos=True))
    return ids


try:
    common = ["--model", MODEL, "--listen", "127.0.0.1:0", "--kv-cache-mb", "64"]
    pre = start("pdserve-prefill", *common)
    dec = start("pdserve-decode", *common)
    rargs = ["--model", MODEL, "--listen", "127.0.0.1:0", "--prefill", "127.0.0.1:%d" % pre.port,
             "--decode", "127.0.0.1:%d" % dec.port, "--load-poll-ms", "100"]
    r1 = start("pdserve-router", *rargs, tag="router1")
    r2 = start("pdserve-router", *rargs, tag="router2")
    ch1 = grpc.insecure_channel("127.0.0.1:%d" % r1.port)
    stub1, stub2 = pbg.GenerationStub(ch1), pbg.GenerationStub(grpc.insecure_channel("127.0.0.1:%d" % r2.port))
    time.sleep(0.3)  # first load reports

    # ---- strings on the wire ----
    code, det, _ = raw_generate(ch1, ld(1, b"id-\xff") + ld(2, b"Once upon a time"))
    check(code == grpc.StatusCode.INVALID_ARGUMENT and det.startswith("request_id: not valid UTF-8"),
          "request_id with a 0xff byte: %s %r" % (code, det))
    code, det, _ = raw_generate(ch1, ld(1, b"id") + ld(2, b"Once upon a time\x00 there was"))
    check(code == grpc.StatusCode.INVALID_ARGUMENT and det == "prompt: contains a NUL byte at offset 16",
          "prompt with a NUL byte: %s %r" % (code, det))
    stopping = ld(3, b"\n") + ld(3, b"\xed\xa0\x80")  # a UTF-8-encoded surrogate
    code, det, _ = raw_generate(ch1, ld(2, b"Once upon a time") + ld(5, stopping))
    check(code == grpc.StatusCode.INVALID_ARGUMENT and det.startswith("stopping.stop[1]: not valid UTF-8"),
          "surrogate in a stop string: %s %r" % (code, det))
    code, det, _ = raw_generate(ch1, ld(2, b"Once upon a time \xc0\xaf"))  # overlong '/'
    check(code == grpc.StatusCode.INVALID_ARGUMENT and det.startswith("prompt: not valid UTF-8"),
          "overlong encoding in the prompt: %s %r" % (code, det))
    code, det, out = raw_generate(ch1, ld(1, "id-é".encode()) + ld(2, "Once upon a time".encode()) +
                                  ld(5, varint(1 << 3) + varint(4)))
    check(code == grpc.StatusCode.OK and out and out[0].request_id == "id-é",
          "the same bytes with valid strings are served: %s %r" % (code, det))
    # The internal services check the same way (every server does, in the rpc layer).
    dch = grpc.insecure_channel("127.0.0.1:%d" % dec.port)
    fn = dch.unary_stream("/pdserve.internal.v1.Decode/Decode", request_serializer=lambda b: b,
                          response_deserializer=lambda b: b)
    code, det = status_of(lambda: list(fn(ld(1, b"r\xc3") + ld(2, b"\x01\x02"), timeout=10)))
    check(code == grpc.StatusCode.INVALID_ARGUMENT and det.startswith("request_id: not valid UTF-8"),
          "decode instance: bad request_id: %s %r" % (code, det))

    # ---- request_id and stop string limits ----
    long_id = "x" * 129
    code, det = status_of(lambda: U.generate(pb, stub1, request_id=long_id, prompt="Once"))
    check(code == grpc.StatusCode.INVALID_ARGUMENT and "request_id: at most 128 bytes (got 129)" in det,
          "129-byte request_id: %s %r" % (code, det))
    rid = "é" * 64  # 128 bytes, 2 per character: echoed whole, never cut in a character
    got = []
    for r in stub1.Generate(pb.GenerateRequest(request_id=rid, prompt="Once",
                                               stopping=pb.StoppingCriteria(max_tokens=2)), timeout=30):
        got.append(r.request_id)
    check(got and all(g == rid for g in got), "128-byte request_id echoed whole")
    code, det = status_of(lambda: U.generate(pb, stub1, prompt="Once",
                                             stopping=pb.StoppingCriteria(max_tokens=4, stop=["ok", "s" * 257])))
    check(code == grpc.StatusCode.INVALID_ARGUMENT and "stopping.stop[1]: at most 256 bytes (got 257)" in det,
          "257-byte stop string: %s %r" % (code, det))
    code, det = status_of(lambda: U.generate(pb, stub1, prompt="Once",
                                             stopping=pb.StoppingCriteria(max_tokens=4, stop=["s" * 256])))
    check(code == grpc.StatusCode.OK, "256-byte stop string accepted: %s %r" % (code, det))

    # ---- seeds ----
    # Fresh router processes (router 2, untouched so far, and router 2 restarted) are in the
    # same state: with seeds from an unseeded rand() their first unseeded requests would get
    # the same seed and the same tokens.
    first_r2 = sample(stub2)
    check(sample(stub1, seed=7) == sample(stub2, seed=7), "a seeded request is identical on two replicas")
    r2.p.kill()
    r2.p.wait()
    r2b = start("pdserve-router", *rargs, tag="router2b")
    stub2b = pbg.GenerationStub(grpc.insecure_channel("127.0.0.1:%d" % r2b.port))
    time.sleep(0.3)
    first_r2b = sample(stub2b)
    check(first_r2b != first_r2, "the first unseeded request differs across a router restart")
    r3 = start("pdserve-router", *rargs, tag="router3")
    stub3 = pbg.GenerationStub(grpc.insecure_channel("127.0.0.1:%d" % r3.port))
    time.sleep(0.3)
    check(sample(stub3) != first_r2b, "the first unseeded request differs between fresh replicas")
    check(sample(stub3, seed=7) == sample(stub2b, seed=7), "a seeded request is identical after a restart")
finally:
    H.kill_all()
H.finish()
