#!/usr/bin/python3
"""test_tls_node.py -- The Node.js client of docs/api.md (@grpc/grpc-js + @grpc/proto-loader,
keepCase: true, grpc.credentials.createSsl(ca)) generates through the router's TLS port of the
stack (mutual TLS inside); the same client in plaintext, or trusting another CA, fails. The
packages come from tests/e2e/node/package-lock.json (npm ci into tests/e2e/node/node_modules,
git-ignored) the first time; without node, npm or the registry the test skips (77) and says
why.

usage: test_tls_node.py BIN_DIR SHARED_DIR PROTO_DIR"""
import json, os, shutil, subprocess, sys, tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import e2e_util, tls_util

BIN, SHARED, PROTO = sys.argv[1], sys.argv[2], sys.argv[3]
MODEL = os.path.join(SHARED, "models", "stories260k")
NODE_DIR = os.path.join(HERE, "node")
if not os.path.isdir(MODEL):
    e2e_util.skip("no shared data")
node, npm = shutil.which("node"), shutil.which("npm")
if not node or not npm:
    e2e_util.skip("node or npm missing (Debian: apt-get install nodejs npm)")

def packages_ok():
    r = subprocess.run([node, "-e", "require('@grpc/grpc-js'); require('@grpc/proto-loader')"],
                       cwd=NODE_DIR, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return r.returncode == 0

if not packages_ok():
    r = subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--ignore-scripts"], cwd=NODE_DIR,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    if r.returncode != 0 or not packages_ok():
        last = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else "no output"
        e2e_util.skip("npm ci of @grpc/grpc-js and @grpc/proto-loader failed (offline?): " + last)

ENV = dict(os.environ, UCX_WARN_UNUSED_ENV_VARS="n", PDSERVE_LOG_LEVEL="warn",
           PDSERVE_PREFILL_POLICY="remote")  # the transfer path even for short prompts
failures = 0

def check(cond, what):
    global failures
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        failures += 1

def node_generate(port, ca, max_tokens=8):
    r = subprocess.run([node, os.path.join(NODE_DIR, "client.js"), "127.0.0.1:%d" % port, PROTO,
                        ca or "-", "Once upon a time", str(max_tokens)], cwd=NODE_DIR,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=60)
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        print("  node: exit %d\n%s\n%s" % (r.returncode, r.stdout, r.stderr[-2000:]))
        return {"ok": False, "code": -1}

TMP = tempfile.mkdtemp(prefix="pdserve-e2e-node-")
certs = tls_util.make_certs(os.path.join(TMP, "pki"))
stack = None
try:
    stack = tls_util.Stack(BIN, TMP, MODEL, certs, ENV)
    out = node_generate(stack.rport, certs["ca"])
    check(out["ok"] and len(out["token_ids"]) == 8 and out["text"] and out["finish_reason"] == "FINISH_REASON_LENGTH",
          "Node grpc-js over TLS generates through the router: %r" % out.get("text"))
    # The same greedy tokens as the C client (pdserve-cli) over TLS.
    r = subprocess.run([os.path.join(BIN, "pdserve-cli"), "generate", "--addr", "127.0.0.1:%d" % stack.rport,
                        "--tls-ca", certs["ca"], "--temperature", "0", "--max-tokens", "8", "--json",
                        "Once upon a time"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=60)
    cli = json.loads(r.stdout) if r.returncode == 0 else {}
    check(cli.get("token_ids") == [int(t) for t in out.get("token_ids", [])],
          "Node and pdserve-cli get the same greedy tokens")
    out = node_generate(stack.rport, None)
    check(not out["ok"] and out["code"] == 14, "Node in plaintext on the TLS port fails with UNAVAILABLE (%s)" % out["code"])
    out = node_generate(stack.rport, certs["ca2"])
    check(not out["ok"] and out["code"] == 14, "Node trusting an unrelated CA fails with UNAVAILABLE (%s)" % out["code"])
finally:
    if stack:
        stack.stop()
print("%d failures" % failures)
sys.exit(1 if failures else 0)
