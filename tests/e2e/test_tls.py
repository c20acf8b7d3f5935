#!/usr/bin/python3
"""test_tls.py -- Transport security end to end, with Python grpcio as the client (nobody
here wrote it) and certificates made by the openssl command at test time: the stack with TLS
on the router's public port and mutual TLS on the instances' ports streams a completion to a
client that trusts the CA; a plaintext client and one trusting another CA fail; the internal
ports refuse a client without a certificate and one with a certificate of another CA; the
router's certificate files replaced by a new certificate (same CA, new serial) are seen by the
next connection without a restart; bad TLS files stop a service at startup with an error that
names the file; and a connection that never sends a byte is closed after the handshake
timeout, plaintext and TLS.

usage: test_tls.py BIN_DIR SHARED_DIR PROTO_DIR"""
import os, shutil, subprocess, sys, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e_util, tls_util

BIN, SHARED, PROTO = sys.argv[1], sys.argv[2], sys.argv[3]
MODEL = os.path.join(SHARED, "models", "stories260k")
if not os.path.isdir(MODEL):
    e2e_util.skip("no shared data")
TMP, pb, pbg, ipb, ipbg, hpb = e2e_util.setup(PROTO)
import grpc

ENV = dict(os.environ, UCX_WARN_UNUSED_ENV_VARS="n", PDSERVE_LOG_LEVEL="info",
           PDSERVE_PREFILL_POLICY="remote")  # the transfer path even for short prompts
failures = 0

def check(cond, what):
    global failures
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        failures += 1

def code_of(fn):
    try:
        fn()
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()

def stub_for(port, ca=None, client=None, name=None):
    if ca is None:
        ch = grpc.insecure_channel("127.0.0.1:%d" % port)
    else:
        creds = grpc.ssl_channel_credentials(
            root_certificates=tls_util.read(ca),
            private_key=tls_util.read(client[1]) if client else None,
            certificate_chain=tls_util.read(client[0]) if client else None)
        opts = [("grpc.ssl_target_name_override", name)] if name else []
        ch = grpc.secure_channel("127.0.0.1:%d" % port, creds, options=opts)
    return ch

def gen(ch, max_tokens=8):
    return e2e_util.generate(pb, pbg.GenerationStub(ch), timeout=30, prompt="Once upon a time",
                             sampling=pb.SamplingParams(temperature=0),
                             stopping=pb.StoppingCriteria(max_tokens=max_tokens))

def load_report(ch):
    return ipbg.InstanceStub(ch).LoadReport(ipb.LoadReportRequest(), timeout=5)

def fails_at_startup(name, args, want):
    """Starts a service that must exit non-zero at once with every string of want in stderr."""
    r = subprocess.run([os.path.join(BIN, name)] + args, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, env=ENV, timeout=60)
    ok = r.returncode not in (0, None) and all(w in r.stderr for w in want)
    if not ok:
        print("  exit %s, stderr: %s" % (r.returncode, r.stderr[-1500:]))
    return ok

certs = tls_util.make_certs(os.path.join(TMP, "pki"))
stack = None
try:
    stack = tls_util.Stack(BIN, TMP, MODEL, certs, ENV)
    rport, pport, dport = stack.rport, stack.pport, stack.dport
    golden = None

    # The public port: TLS, verified with the CA.
    ch = stub_for(rport, certs["ca"])
    ids, text, fin, usage = gen(ch)
    check(len(ids) == 8 and text and fin == pb.FINISH_REASON_LENGTH,
          "TLS client streams a completion through router + prefill + decode (%r)" % text)
    ids2, text2, _, _ = gen(stub_for(rport, certs["ca"], name="localhost"))
    check(ids2 == ids, "the certificate's DNS name (localhost) verifies as well as its IP address")
    ch.close()

    # A plaintext client, a client trusting another CA, a name the certificate lacks.
    c = code_of(lambda: gen(stub_for(rport)))
    check(c == grpc.StatusCode.UNAVAILABLE, "plaintext client on the TLS port fails (%s)" % c)
    c = code_of(lambda: gen(stub_for(rport, certs["ca2"])))
    check(c == grpc.StatusCode.UNAVAILABLE, "client trusting an unrelated CA fails (%s)" % c)
    c = code_of(lambda: gen(stub_for(rport, certs["ca"], name="not-the-server.example")))
    check(c == grpc.StatusCode.UNAVAILABLE, "client expecting another server name fails (%s)" % c)

    # The internal ports: mutual TLS.
    for role, port in (("prefill", pport), ("decode", dport)):
        c = code_of(lambda: load_report(stub_for(port, certs["ca"])))
        check(c == grpc.StatusCode.UNAVAILABLE, "%s port refuses a TLS client without a certificate (%s)" % (role, c))
        c = code_of(lambda: load_report(stub_for(port, certs["ca"], (certs["client2"], certs["client2_key"]))))
        check(c == grpc.StatusCode.UNAVAILABLE, "%s port refuses a client certificate of another CA (%s)" % (role, c))
        c = code_of(lambda: load_report(stub_for(port)))
        check(c == grpc.StatusCode.UNAVAILABLE, "%s port refuses a plaintext client (%s)" % (role, c))
        r = load_report(stub_for(port, certs["ca"], (certs["client"], certs["client_key"])))
        check(r.total_blocks > 0, "%s port answers a client with a certificate of the CA" % role)

    # Certificate reload: new files, same CA, new serial; no restart.
    check(tls_util.peer_serial(rport, certs["ca"]) == 1001, "the router presents serial 1001")
    # Written the way a careless operator would (certificate first, key a moment later): the
    # connection in between must still work with the old pair.
    shutil.copy(certs["server2"], stack.pub_cert + ".new")
    os.replace(stack.pub_cert + ".new", stack.pub_cert)
    ids3, _, _, _ = gen(stub_for(rport, certs["ca"]))
    check(ids3 == ids and tls_util.peer_serial(rport, certs["ca"]) == 1001,
          "certificate replaced but key not yet: the old pair stays in use, calls work")
    shutil.copy(certs["server2_key"], stack.pub_key + ".new")
    os.replace(stack.pub_key + ".new", stack.pub_key)
    serial = tls_util.peer_serial(rport, certs["ca"])
    check(serial == 1002, "a new connection sees the new certificate (serial %d) without a restart" % serial)
    ids4, _, _, _ = gen(stub_for(rport, certs["ca"]))
    check(ids4 == ids, "a TLS client streams through the reloaded certificate")
    check(stack.rtr.p.poll() is None, "the router kept running")
    log = open(stack.rtr.log).read()
    check("keeping the certificate in use" in log and "changed; new connections use the new one" in log,
          "the router logged the half-written pair and the reload")

    # Handshake timeout (default 10 s here; the raw connection sends nothing).
    t = tls_util.idle_close_seconds(rport, 20)
    check(t is not None and 8 <= t <= 13, "idle raw TCP on the TLS port closed at the 10 s default (%s s)" % t)

    # Bad files: a clear error at startup, naming the file.
    missing = os.path.join(TMP, "pki", "nope.pem")
    garbage = os.path.join(TMP, "pki", "garbage.pem")
    with open(garbage, "w") as f:
        f.write("not a certificate\n")
    base = ["--model", MODEL, "--listen", "127.0.0.1:0", "--kv-cache-mb", "16"]
    check(fails_at_startup("pdserve-decode", base + ["--tls-cert", missing, "--tls-key", certs["server_key"]],
                           [missing, "No such file"]),
          "decode: a missing certificate file is named at startup")
    check(fails_at_startup("pdserve-prefill", base + ["--tls-cert", garbage, "--tls-key", certs["server_key"]],
                           [garbage, "no PEM certificate"]),
          "prefill: a file that is not a certificate is named at startup")
    check(fails_at_startup("pdserve-decode", base + ["--tls-cert", certs["server"], "--tls-key", certs["client_key"]],
                           [certs["client_key"], "does not belong"]),
          "decode: a key of another certificate is refused at startup")
    check(fails_at_startup("pdserve-decode", base + ["--tls-cert", certs["server"]], ["without a key"]),
          "decode: --tls-cert without --tls-key is refused")
    check(fails_at_startup("pdserve-router", ["--model", MODEL, "--listen", "127.0.0.1:0",
                                              "--decode", "127.0.0.1:%d" % dport, "--internal-tls-ca", garbage],
                           [garbage, "no PEM certificate"]),
          "router: a bad --internal-tls-ca is named at startup")
    check(fails_at_startup("pdserve-cli", ["info", "--addr", "127.0.0.1:%d" % rport, "--tls-ca", missing],
                           [missing]), "cli: a missing --tls-ca is named")

    # The C client (pdserve-cli) over TLS, and refused without it.
    r = subprocess.run([os.path.join(BIN, "pdserve-cli"), "generate", "--addr", "127.0.0.1:%d" % rport,
                        "--tls-ca", certs["ca"], "--temperature", "0", "--max-tokens", "8", "--json",
                        "Once upon a time"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=60)
    check(r.returncode == 0 and '"finish_reason": "length"' in r.stdout, "pdserve-cli --tls-ca generates")
    r = subprocess.run([os.path.join(BIN, "pdserve-cli"), "health", "--addr", "127.0.0.1:%d" % rport],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=60)
    check(r.returncode != 0, "pdserve-cli without --tls-ca cannot talk to the TLS port")

    r = subprocess.run([os.path.join(BIN, "pdserve-cli"), "health", "--addr", "127.0.0.1:%d" % dport,
                        "--tls-ca", certs["ca"], "--tls-cert", certs["client"], "--tls-key", certs["client_key"],
                        "--tls-server-name", "localhost"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=60)
    check(r.returncode == 0 and "SERVING" in r.stdout,
          "pdserve-cli health with a client certificate on the mTLS decode port (the Kubernetes probe)")

    # Handshake timeout on a plaintext server set by flag.
    fast = e2e_util.start(BIN, TMP, "pdserve-decode", base + ["--handshake-timeout-ms", "1500"], ENV, tag="hs-decode")
    stack.procs.append(fast.p)
    t = tls_util.idle_close_seconds(fast.port, 10)
    check(t is not None and 1.0 <= t <= 4.0, "idle raw TCP on a plaintext port closed after --handshake-timeout-ms 1500 (%s s)" % t)
    h = stub_for(fast.port).unary_unary("/grpc.health.v1.Health/Check",
                                        request_serializer=hpb.HealthCheckRequest.SerializeToString,
                                        response_deserializer=hpb.HealthCheckResponse.FromString)
    check(h(hpb.HealthCheckRequest(), timeout=5).status == hpb.HealthCheckResponse.SERVING,
          "the plaintext server still serves real clients")

    codes = stack.terminate()
    check(codes == [0] * len(codes), "SIGTERM: every service drains and exits 0 (leak-free under ASan) %s" % codes)
finally:
    if stack:
        stack.stop()
print("%d failures" % failures)
sys.exit(1 if failures else 0)
