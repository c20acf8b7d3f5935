#!/usr/bin/python3
"""test_docs_examples.py -- docs/api.md's client examples run as written against the README's
model (stories260k) through a router (issue #40: the Python example crashed on token 4996 of a
512-token vocabulary and on the chat call, the Node example needed a ca.crt): the stub
generation command of its "Python client (grpcio)" section, that section's Python program and
the n > 1 program before it, and the Node.js client (the plaintext one), each with only the
address replaced by the test stack's. The Node part needs @grpc/grpc-js and
@grpc/proto-loader (tests/e2e/node, npm ci the first time); without them it is skipped and
said so.

usage: test_docs_examples.py BIN_DIR SHARED_DIR PROTO_DIR"""
import os, re, shutil, subprocess, sys, tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import e2e_util

BIN, SHARED, PROTO = sys.argv[1], sys.argv[2], sys.argv[3]
MODEL = os.path.join(SHARED, "models", "stories260k")
DOC = os.path.join(HERE, "..", "..", "docs", "api.md")
NODE_DIR = os.path.join(HERE, "node")
if not os.path.isdir(MODEL):
    e2e_util.skip("no shared data")
try:
    import grpc  # noqa: F401
except ImportError:
    e2e_util.skip("python3-grpcio missing")

failures = 0


def check(cond, what):
    global failures
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        failures += 1


def blocks(text, lang, after):
    """The ```lang blocks of the section whose heading is `after`, in order."""
    sec = text[text.index(after):]
    nxt = re.search(r"\n## ", sec[len(after):])
    if nxt:
        sec = sec[:len(after) + nxt.start()]
    return re.findall(r"```%s\n(.*?)```" % lang, sec, re.S)


doc = open(DOC, encoding="utf-8").read()
TMP = tempfile.mkdtemp(prefix="pdserve-e2e-docs-")
os.symlink(os.path.abspath(PROTO), os.path.join(TMP, "proto"))
ENV = dict(os.environ, UCX_WARN_UNUSED_ENV_VARS="n", PDSERVE_LOG_LEVEL="warn")
procs = []
try:
    dec = e2e_util.start(BIN, TMP, "pdserve-decode", ["--model", MODEL, "--listen", "127.0.0.1:0",
                                                      "--colocated", "--backend", "cpu",
                                                      "--kv-cache-mb", "64"], ENV)
    procs.append(dec)
    rtr = e2e_util.start(BIN, TMP, "pdserve-router", ["--model", MODEL, "--listen", "127.0.0.1:0",
                                                      "--decode", "127.0.0.1:%d" % dec.port], ENV)
    procs.append(rtr)
    addr = "localhost:%d" % rtr.port

    # The stub generation command, as written (the protoc plugin path is Debian's).
    sh = blocks(doc, "sh", "## Python client (grpcio)")[0]
    os.makedirs(os.path.join(TMP, "stubs"))
    r = subprocess.run(["bash", "-c", sh], cwd=TMP, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=120)
    check(r.returncode == 0, "the stub command of docs/api.md runs (%s)" % r.stdout.strip()[-200:])

    # The Python program, then the n > 1 program (which uses its stub and pb).
    prog = blocks(doc, "python", "## Python client (grpcio)")[0].replace("localhost:50051", addr)
    nprog = [b for b in re.findall(r"```python\n(.*?)```", doc, re.S) if "n=3" in b][0]
    with open(os.path.join(TMP, "client.py"), "w") as f:
        f.write(prog + "\n" + nprog)
    r = subprocess.run([sys.executable, "client.py"], cwd=TMP, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, timeout=120)
    out = r.stdout
    check(r.returncode == 0, "the Python example runs to its end (exit %d%s)"
          % (r.returncode, (": " + r.stderr.strip()[-300:]) if r.returncode else ""))
    check(re.search(r"\[FINISH_REASON_(LENGTH|STOP|EOS)\] \d+ prompt \+ \d+ completion tokens", out) is not None,
          "it streamed a completion with its finish reason and usage")
    check("failed:" not in out, "no call of it failed")
    check(re.search(r"^\d+ -?\d+\.\d+", out, re.M) is not None, "it printed token ids with their logprobs")
    check("chat: FAILED_PRECONDITION" in out, "the chat call says FAILED_PRECONDITION (no template), not a crash")
    check(re.search(r"^\[\d+(, \d+)*\]$", out, re.M) is not None, "Tokenize printed token ids")
    check(re.search(r"\{0: '.*', 1: '.*', 2: '.*'\}", out) is not None, "the n = 3 program printed three texts")

    # The Node.js client (plaintext), from this checkout's root (here: TMP with proto/).
    node, npm = shutil.which("node"), shutil.which("npm")

    def packages_ok():
        r = subprocess.run([node, "-e", "require('@grpc/grpc-js'); require('@grpc/proto-loader')"],
                           cwd=NODE_DIR, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        return r.returncode == 0

    if not node or not npm:
        print("note: node or npm missing: the Node example is not run")
    else:
        if not packages_ok():
            subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--ignore-scripts"], cwd=NODE_DIR,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600)
        if not packages_ok():
            print("note: @grpc/grpc-js and @grpc/proto-loader unavailable (offline?): the Node example is not run")
        else:
            js = blocks(doc, "js", "## Node.js client (@grpc/grpc-js)")[0].replace("localhost:50051", addr)
            with open(os.path.join(TMP, "client.js"), "w") as f:
                f.write(js)
            r = subprocess.run([node, "client.js"], cwd=TMP, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, timeout=120,
                               env=dict(os.environ, NODE_PATH=os.path.join(NODE_DIR, "node_modules")))
            check(r.returncode == 0 and len(r.stdout) > 0 and "failed:" not in r.stderr,
                  "the Node example streams a completion (%r%s)" % (r.stdout[:60], r.stderr[-200:] if r.returncode else ""))
            check(not re.search(r"warn", r.stderr, re.I), "and prints no warning")
finally:
    for p in reversed(procs):
        p.p.terminate()
        try:
            p.p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.p.kill()
    shutil.rmtree(TMP, ignore_errors=True)
print("%d failures" % failures)
sys.exit(1 if failures else 0)
