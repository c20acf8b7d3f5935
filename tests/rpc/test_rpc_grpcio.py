#!/usr/bin/python3
"""test_rpc_grpcio.py -- Python grpcio (a client nobody here wrote) against
pdserve-rpc-testserver: unary and streaming calls, cancellation, deadlines, unknown methods,
empty and malformed payloads, oversized messages, 1,000 concurrent streams, health, shutdown
under load, and bidirectional streams (the test service's Echo: order, half-close, cancel,
deadline, bad messages, concurrency, shutdown with one open). The server runs as a subprocess (ASan build in CI); every server must exit 0 with no
live call and no sanitizer report.

usage: test_rpc_grpcio.py --server PATH --stubs DIR   (exit 77 = skipped: no grpcio)
"""
import argparse
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest

try:
    import grpc
except ImportError:
    print("SKIP: python3-grpcio is not installed (run with /usr/bin/python3?)")
    sys.exit(77)

ARGS = None
pb = pbg = health_pb2 = rpctest_pb2 = None

SANITIZER_RE = re.compile(r"AddressSanitizer|LeakSanitizer|UndefinedBehaviorSanitizer|"
                          r"runtime error:")


class Server:
    """A pdserve-rpc-testserver subprocess on a port it picks itself."""

    def __init__(self, *extra):
        self.errf = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([ARGS.server, "--listen", "127.0.0.1:0", *extra],
                                     stdout=subprocess.PIPE, stderr=self.errf, text=True)
        line = self.proc.stdout.readline()
        m = re.match(r"PORT (\d+)", line)
        if not m:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError("server did not start: %r %s" % (line, self.stderr()))
        self.port = int(m.group(1))
        self.target = "127.0.0.1:%d" % self.port

    def stderr(self):
        self.errf.seek(0)
        return self.errf.read()

    def stop(self, timeout=60):
        """SIGTERM, wait; returns (exit code, stderr)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            rc = "hung"
        self.proc.stdout.close()
        err = self.stderr()
        self.errf.close()
        return rc, err


def check_clean_exit(tc, rc, err):
    tc.assertEqual(rc, 0, "server exit code %r; stderr:\n%s" % (rc, err[-4000:]))
    tc.assertIn("live_calls=0", err)
    tc.assertIsNone(SANITIZER_RE.search(err), "sanitizer report:\n" + err[-4000:])


def raw_unary(ch, path):
    return ch.unary_unary(path)  # bytes in, bytes out


def raw_stream(ch, path):
    return ch.unary_stream(path)


def stats_fn(ch):
    return ch.unary_unary("/pdserve.rpctest.v1.RpcTest/Stats",
                          request_serializer=rpctest_pb2.StatsRequest.SerializeToString,
                          response_deserializer=rpctest_pb2.StatsResponse.FromString)


def echo_fn(ch):
    return ch.stream_stream("/pdserve.rpctest.v1.RpcTest/Echo",
                            request_serializer=rpctest_pb2.EchoRequest.SerializeToString,
                            response_deserializer=rpctest_pb2.EchoResponse.FromString)


def queue_iter(q):
    """Request iterator fed by q; None ends it (the client half-closes)."""
    while True:
        item = q.get()
        if item is None:
            return
        yield item


def health_fn(ch):
    return ch.unary_unary("/grpc.health.v1.Health/Check",
                          request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                          response_deserializer=health_pb2.HealthCheckResponse.FromString)


class Common(unittest.TestCase):
    """Cases on one shared server."""

    @classmethod
    def setUpClass(cls):
        cls.srv = Server()
        cls.ch = grpc.insecure_channel(cls.srv.target)
        cls.stub = pbg.GenerationStub(cls.ch)
        cls.stats = stats_fn(cls.ch)

    @classmethod
    def tearDownClass(cls):
        cls.ch.close()
        rc, err = cls.srv.stop()
        check_clean_exit(cls("test_unary_model_info"), rc, err)

    def wait_idle(self, **expect):
        """Polls Stats until no job is left and live_calls is 1 (the Stats call itself) and
        every counter in expect is at least its value; returns the last stats."""
        deadline = time.time() + 10
        while True:
            st = self.stats(rpctest_pb2.StatsRequest(), timeout=5)
            ok = st.live_calls == 1 and st.jobs_active == 0
            ok = ok and all(getattr(st, k) >= v for k, v in expect.items())
            if ok:
                return st
            if time.time() > deadline:
                self.fail("server not idle: %s (want %s)" % (st, expect))
            time.sleep(0.02)

    def test_unary_model_info(self):
        r = self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        self.assertEqual(r.model_name, "pdserve-rpc-testserver")
        self.assertEqual(list(r.eos_token_ids), [0, 2])
        self.assertTrue(r.HasField("bos_token_id"))
        self.assertEqual(r.vocab_size, 256)

    def test_unary_tokenize(self):
        r = self.stub.Tokenize(pb.TokenizeRequest(text="héllo"), timeout=10)
        self.assertEqual(list(r.token_ids), list("héllo".encode()))
        r = self.stub.Tokenize(pb.TokenizeRequest(text="a", add_special_tokens=True), timeout=10)
        self.assertEqual(list(r.token_ids), [1, 97])
        # Reply from the worker thread after a delay.
        r = self.stub.Tokenize(pb.TokenizeRequest(text="xy"), timeout=10,
                               metadata=[("x-delay-ms", "50")])
        self.assertEqual(list(r.token_ids), [120, 121])

    def test_stream_echo_ids(self):
        ids = [5, 6, 7, 100000]
        msgs = list(self.stub.Generate(pb.GenerateRequest(request_id="r1", prompt_token_ids=ids),
                                       timeout=10))
        self.assertEqual([list(m.token_ids) for m in msgs], [[i] for i in ids])
        self.assertTrue(all(m.request_id == "r1" for m in msgs))
        self.assertTrue(all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED for m in msgs[:-1]))
        self.assertEqual(msgs[-1].finish_reason, pb.FINISH_REASON_EOS)
        self.assertEqual(msgs[-1].usage.prompt_tokens, 4)
        self.assertFalse(msgs[0].HasField("usage"))

    def test_stream_counter_with_presence_fields(self):
        req = pb.GenerateRequest(prompt="abc", logprobs=2,
                                 sampling=pb.SamplingParams(temperature=0.0, seed=7),
                                 stopping=pb.StoppingCriteria(max_tokens=300))
        self.assertTrue(req.sampling.HasField("temperature"))  # 0.0 but present
        msgs = list(self.stub.Generate(req, timeout=30))
        self.assertEqual([t for m in msgs for t in m.token_ids], list(range(300)))
        self.assertEqual("".join(m.text for m in msgs), "".join("%d " % i for i in range(300)))
        self.assertEqual(len(msgs[5].logprobs), 1)
        self.assertEqual(len(msgs[5].logprobs[0].top), 2)
        self.assertEqual(msgs[-1].finish_reason, pb.FINISH_REASON_LENGTH)
        self.assertEqual(msgs[-1].usage.completion_tokens, 300)
        self.assertTrue(msgs[-1].request_id.startswith("req-"))
        # max_tokens = 0 is present (not unset): one final message without tokens.
        msgs = list(self.stub.Generate(pb.GenerateRequest(
            prompt="abc", stopping=pb.StoppingCriteria(max_tokens=0)), timeout=10))
        self.assertEqual(len(msgs), 1)
        self.assertEqual(list(msgs[0].token_ids), [])
        self.assertEqual(msgs[0].finish_reason, pb.FINISH_REASON_LENGTH)

    def test_stream_validation_errors(self):
        for req in (pb.GenerateRequest(),
                    pb.GenerateRequest(prompt="x", prompt_token_ids=[1]),
                    pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(temperature=-1))):
            with self.assertRaises(grpc.RpcError) as cm:
                list(self.stub.Generate(req, timeout=10))
            self.assertEqual(cm.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
            self.assertTrue(cm.exception.details())

    def test_client_cancel_mid_stream(self):
        before = self.wait_idle()
        it = self.stub.Generate(pb.GenerateRequest(prompt="p", stopping=pb.StoppingCriteria(
            max_tokens=100000)), timeout=30, metadata=[("x-delay-ms", "5")])
        got = [next(it).token_ids[0] for _ in range(3)]
        self.assertEqual(got, [0, 1, 2])
        it.cancel()
        with self.assertRaises(grpc.RpcError) as cm:
            next(it)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.CANCELLED)
        # The server saw the cancel (callback ran) and freed the call.
        self.wait_idle(calls_cancelled=before.calls_cancelled + 1,
                       cancel_callbacks=before.cancel_callbacks + 1)

    def test_deadline_exceeded(self):
        before = self.wait_idle()
        t0 = time.time()
        with self.assertRaises(grpc.RpcError) as cm:
            for _ in self.stub.Generate(pb.GenerateRequest(prompt_token_ids=[1] * 1000),
                                        timeout=0.3, metadata=[("x-delay-ms", "10")]):
                pass
        self.assertEqual(cm.exception.code(), grpc.StatusCode.DEADLINE_EXCEEDED)
        self.assertLess(time.time() - t0, 5)
        # A unary call answered later by the worker thread: its deadline passes first.
        with self.assertRaises(grpc.RpcError) as cm:
            self.stub.Tokenize(pb.TokenizeRequest(text="x"), timeout=0.2,
                               metadata=[("x-delay-ms", "3000")])
        self.assertEqual(cm.exception.code(), grpc.StatusCode.DEADLINE_EXCEEDED)
        self.wait_idle(calls_cancelled=before.calls_cancelled + 2,
                       cancel_callbacks=before.cancel_callbacks + 2)

    def test_unknown_method(self):
        for path in ("/pdserve.v1.Generation/NoSuchMethod", "/no.such.Service/Call"):
            with self.assertRaises(grpc.RpcError) as cm:
                raw_unary(self.ch, path)(b"", timeout=10)
            self.assertEqual(cm.exception.code(), grpc.StatusCode.UNIMPLEMENTED)
            self.assertIn(path, cm.exception.details())
        with self.assertRaises(grpc.RpcError) as cm:
            list(raw_stream(self.ch, "/grpc.health.v1.Health/Watch")(b"", timeout=10))
        self.assertEqual(cm.exception.code(), grpc.StatusCode.UNIMPLEMENTED)

    def test_empty_payload(self):
        r = raw_unary(self.ch, "/pdserve.v1.Generation/Tokenize")(b"", timeout=10)
        self.assertEqual(r, b"")  # empty TokenizeResponse
        r = raw_unary(self.ch, "/pdserve.v1.Generation/GetModelInfo")(b"", timeout=10)
        self.assertEqual(pb.GetModelInfoResponse.FromString(r).max_model_len, 4096)
        with self.assertRaises(grpc.RpcError) as cm:
            list(raw_stream(self.ch, "/pdserve.v1.Generation/Generate")(b"", timeout=10))
        self.assertEqual(cm.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)

    def test_invalid_protobuf(self):
        before = self.wait_idle()
        for junk in (b"\xff\xff\xff\xff", b"\x0a\x05ab", b"\x08"):
            with self.assertRaises(grpc.RpcError) as cm:
                raw_unary(self.ch, "/pdserve.v1.Generation/Tokenize")(junk, timeout=10)
            self.assertEqual(cm.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn("not a valid pdserve.v1.TokenizeRequest", cm.exception.details())
        with self.assertRaises(grpc.RpcError) as cm:
            list(raw_stream(self.ch, "/pdserve.v1.Generation/Generate")(b"\xff", timeout=10))
        self.assertEqual(cm.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.wait_idle(calls_bad_request=before.calls_bad_request + 4)

    def test_invalid_strings(self):
        """Strings are checked on the wire before decoding: invalid UTF-8 and NUL bytes are
        INVALID_ARGUMENT naming the field (grpcio refuses to build such str fields, so the
        bytes are made by hand and sent raw)."""
        before = self.wait_idle()
        # TokenizeRequest{text = "a\0b"}: protobuf-c would hand the handler "a".
        with self.assertRaises(grpc.RpcError) as cm:
            raw_unary(self.ch, "/pdserve.v1.Generation/Tokenize")(b"\x0a\x03a\x00b", timeout=10)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertEqual(cm.exception.details(), "text: contains a NUL byte at offset 1")
        # TokenizeRequest{text = "\xed\xa0\x80"} (an encoded surrogate).
        with self.assertRaises(grpc.RpcError) as cm:
            raw_unary(self.ch, "/pdserve.v1.Generation/Tokenize")(b"\x0a\x03\xed\xa0\x80",
                                                                  timeout=10)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("text: not valid UTF-8", cm.exception.details())
        # GenerateRequest{request_id "id", prompt "hi", stopping{stop ["ok", "\xc3("]}}: a
        # nested repeated string, on a streaming method.
        stopping = b"\x1a\x02ok" + b"\x1a\x02\xc3("
        req = b"\x0a\x02id" + b"\x12\x02hi" + b"\x2a" + bytes([len(stopping)]) + stopping
        gen = self.ch.unary_stream("/pdserve.v1.Generation/Generate",
                                   request_serializer=lambda b: b,
                                   response_deserializer=pb.GenerateResponse.FromString)
        with self.assertRaises(grpc.RpcError) as cm:
            list(gen(req, timeout=10))
        self.assertEqual(cm.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertEqual(cm.exception.details(),
                         "stopping.stop[1]: not valid UTF-8 (at byte offset 0)")
        # The same request with valid strings goes through.
        stopping = b"\x1a\x02ok" + b"\x1a\x02\xc3\xa9"
        req = b"\x0a\x02id" + b"\x12\x02hi" + b"\x2a" + bytes([len(stopping)]) + stopping
        out = list(gen(req, timeout=10))
        self.assertEqual([r.request_id for r in out[:1]], ["id"])
        self.wait_idle(calls_bad_request=before.calls_bad_request + 3)

    def test_oversized_message(self):
        with self.assertRaises(grpc.RpcError) as cm:
            self.stub.Tokenize(pb.TokenizeRequest(text="a" * (5 << 20)), timeout=30)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.RESOURCE_EXHAUSTED)
        with self.assertRaises(grpc.RpcError) as cm:
            list(self.stub.Generate(pb.GenerateRequest(prompt_token_ids=[300] * (3 << 20)),
                                    timeout=30))
        self.assertEqual(cm.exception.code(), grpc.StatusCode.RESOURCE_EXHAUSTED)
        # The connection and the server are fine afterwards.
        self.assertEqual(len(self.stub.Tokenize(pb.TokenizeRequest(text="ok"),
                                                timeout=10).token_ids), 2)
        self.wait_idle()

    def test_health(self):
        check = health_fn(self.ch)
        SERVING = health_pb2.HealthCheckResponse.SERVING
        for name in ("", "pdserve.v1.Generation", "grpc.health.v1.Health"):
            self.assertEqual(check(health_pb2.HealthCheckRequest(service=name),
                                   timeout=10).status, SERVING, name)
        with self.assertRaises(grpc.RpcError) as cm:
            check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.NOT_FOUND)

    def test_concurrent_1000_streams(self):
        n = 1000
        chans = [grpc.insecure_channel(self.srv.target,
                                       options=[("grpc.use_local_subchannel_pool", 1)])
                 for _ in range(4)]
        stubs = [pbg.GenerationStub(c) for c in chans]
        its = [stubs[i % 4].Generate(pb.GenerateRequest(request_id="c%d" % i,
                                                        prompt_token_ids=[i, i + 1, i + 2]),
                                     timeout=60,
                                     metadata=[("x-delay-ms", "10"), ("x-barrier", str(n))])
               for i in range(n)]
        try:
            for i, it in enumerate(its):
                msgs = list(it)
                self.assertEqual([t for m in msgs for t in m.token_ids], [i, i + 1, i + 2])
                self.assertEqual(msgs[-1].request_id, "c%d" % i)
        finally:
            for c in chans:
                c.close()
        st = self.wait_idle()
        self.assertGreaterEqual(st.live_calls_peak, n)

    def test_bidi_echo(self):
        echo = echo_fn(self.ch)
        reqs = [rpctest_pb2.EchoRequest(text="m%d" % i, pad_bytes=i * 1000) for i in range(20)]
        call = echo(iter(reqs), timeout=10)
        self.assertEqual([(r.text, r.seq, len(r.pad)) for r in call],
                         [("m%d" % i, i, i * 1000) for i in range(20)])
        self.assertEqual(call.code(), grpc.StatusCode.OK)
        self.assertEqual(call.details(), "echoed 20")
        # Interleaved: each request goes out only after the answer to the one before.
        q = queue.Queue()
        call = echo(queue_iter(q), timeout=10)
        for i in range(5):
            q.put(rpctest_pb2.EchoRequest(text="i%d" % i))
            r = next(call)
            self.assertEqual((r.text, r.seq), ("i%d" % i, i))
        q.put(None)
        self.assertEqual(list(call), [])
        self.assertEqual(call.details(), "echoed 5")
        # No request at all.
        call = echo(iter([]), timeout=10)
        self.assertEqual(list(call), [])
        self.assertEqual(call.details(), "echoed 0")
        self.wait_idle()

    def test_bidi_cancel_and_deadline(self):
        before = self.wait_idle()
        echo = echo_fn(self.ch)
        q = queue.Queue()
        call = echo(queue_iter(q), timeout=30)
        for i in range(2):
            q.put(rpctest_pb2.EchoRequest(text="c"))
            self.assertEqual(next(call).seq, i)
        call.cancel()
        with self.assertRaises(grpc.RpcError) as cm:
            next(call)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.CANCELLED)
        q.put(None)
        q = queue.Queue()
        call = echo(queue_iter(q), timeout=0.3)
        q.put(rpctest_pb2.EchoRequest(text="d"))
        self.assertEqual(next(call).text, "d")
        with self.assertRaises(grpc.RpcError) as cm:
            next(call)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.DEADLINE_EXCEEDED)
        q.put(None)
        self.wait_idle(calls_cancelled=before.calls_cancelled + 2,
                       cancel_callbacks=before.cancel_callbacks + 2)

    def test_bidi_bad_message(self):
        before = self.wait_idle()
        raw = self.ch.stream_stream("/pdserve.rpctest.v1.RpcTest/Echo")  # bytes in and out
        # EchoRequest{text "a"}, then field 1 as a varint; then a string that is not UTF-8.
        for reqs, n_ok, why in (([b"\x0a\x01a", b"\x08\x01"], 1,
                                 "not a valid pdserve.rpctest.v1.EchoRequest"),
                                ([b"\x0a\x01\xff"], 0, "text: not valid UTF-8")):
            call = raw(iter(reqs), timeout=10)
            got = []
            with self.assertRaises(grpc.RpcError) as cm:
                for r in call:
                    got.append(r)
            self.assertEqual(cm.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn(why, cm.exception.details())
            self.assertEqual(len(got), n_ok)
        # A request over --max-recv-bytes (4 MiB) mid-stream.
        call = echo_fn(self.ch)(iter([rpctest_pb2.EchoRequest(text="a"),
                                      rpctest_pb2.EchoRequest(text="b" * (5 << 20))]), timeout=30)
        with self.assertRaises(grpc.RpcError) as cm:
            list(call)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.RESOURCE_EXHAUSTED)
        self.wait_idle(calls_bad_request=before.calls_bad_request + 2)

    def test_bidi_concurrent(self):
        echo = echo_fn(self.ch)
        n = 200
        calls = [echo(iter([rpctest_pb2.EchoRequest(text="%d.%d" % (i, k)) for k in range(10)]),
                      timeout=60) for i in range(n)]
        for i, call in enumerate(calls):
            self.assertEqual([r.text for r in call], ["%d.%d" % (i, k) for k in range(10)])
            self.assertEqual(call.details(), "echoed 10")
        self.wait_idle()


class Shutdown(unittest.TestCase):
    """Servers of their own, stopped while busy."""

    def test_shutdown_under_load(self):
        srv = Server("--grace-ms", "1000", "--health-drain-ms", "500")
        ch = grpc.insecure_channel(srv.target)
        stop = threading.Event()
        unary_codes = []
        stub = pbg.GenerationStub(ch)

        def hammer():
            while not stop.is_set():
                try:
                    stub.Tokenize(pb.TokenizeRequest(text="load"), timeout=5)
                    unary_codes.append(grpc.StatusCode.OK)
                except grpc.RpcError as e:
                    unary_codes.append(e.code())
                    time.sleep(0.01)

        th = threading.Thread(target=hammer, daemon=True)
        try:
            check = health_fn(ch)
            longs = [stub.Generate(pb.GenerateRequest(prompt="x", stopping=pb.StoppingCriteria(
                max_tokens=100000)), timeout=60, metadata=[("x-delay-ms", "5")])
                for _ in range(40)]
            shorts = [stub.Generate(pb.GenerateRequest(prompt_token_ids=list(range(20))),
                                    timeout=60, metadata=[("x-delay-ms", "30")])
                      for _ in range(40)]
            th.start()
            for it in longs:
                next(it)
            t0 = time.time()
            srv.proc.send_signal(signal.SIGTERM)
            # During the drain window health says NOT_SERVING while calls still work.
            seen = []
            while time.time() - t0 < 5:
                seen.append(check(health_pb2.HealthCheckRequest(), timeout=5).status)
                if seen[-1] == health_pb2.HealthCheckResponse.NOT_SERVING:
                    break
                time.sleep(0.01)
            self.assertEqual(seen[-1], health_pb2.HealthCheckResponse.NOT_SERVING, seen)
            short_tokens = [[t for m in it for t in m.token_ids] for it in shorts]
            self.assertEqual(short_tokens, [list(range(20))] * 40)  # finished within the grace
            for it in longs:
                with self.assertRaises(grpc.RpcError) as cm:
                    for _ in it:
                        pass
                self.assertEqual(cm.exception.code(), grpc.StatusCode.UNAVAILABLE)
        finally:
            rc, err = srv.stop()
            elapsed = time.time() - t0
            stop.set()
            if th.is_alive():
                th.join()
            ch.close()
        check_clean_exit(self, rc, err)
        self.assertIn(grpc.StatusCode.OK, unary_codes)
        self.assertLess(elapsed, 10)
        n_cancelled = int(re.search(r"cancelled_at_shutdown=(\d+)", err).group(1))
        self.assertTrue(40 <= n_cancelled <= 45, err[-2000:])

    def test_shutdown_bidi_open(self):
        srv = Server("--grace-ms", "300")
        ch = grpc.insecure_channel(srv.target)
        q = queue.Queue()
        try:
            call = echo_fn(ch)(queue_iter(q), timeout=60)
            q.put(rpctest_pb2.EchoRequest(text="open"))
            self.assertEqual(next(call).text, "open")
            srv.proc.send_signal(signal.SIGTERM)
            with self.assertRaises(grpc.RpcError) as cm:
                next(call)
            self.assertEqual(cm.exception.code(), grpc.StatusCode.UNAVAILABLE)
        finally:
            q.put(None)
            rc, err = srv.stop()
            ch.close()
        check_clean_exit(self, rc, err)
        self.assertIn("cancelled_at_shutdown=1", err)

    def test_idle_shutdown_and_port_reuse(self):
        a = Server()
        # SO_REUSEPORT is off: a second server on the same port must fail, not share it.
        p = subprocess.run([ARGS.server, "--listen", a.target], capture_output=True, text=True,
                           timeout=60)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("cannot listen", p.stderr)
        check_clean_exit(self, *a.stop())


def main():
    global ARGS, pb, pbg, health_pb2, rpctest_pb2
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--stubs", required=True)
    ARGS, rest = ap.parse_known_args()
    sys.path.insert(0, ARGS.stubs)
    # The health stubs live under grpc/health/v1, which must not shadow the grpc package.
    sys.path.insert(0, os.path.join(ARGS.stubs, "grpc", "health", "v1"))
    from pdserve.v1 import generation_pb2, generation_pb2_grpc
    import health_pb2 as h
    import rpctest_pb2 as r
    pb, pbg, health_pb2, rpctest_pb2 = generation_pb2, generation_pb2_grpc, h, r
    prog = unittest.main(argv=[sys.argv[0], "-v", *rest], exit=False)
    sys.exit(0 if prog.result.wasSuccessful() else 1)


if __name__ == "__main__":
    main()
