#!/usr/bin/env python3
"""gpu_tpkv.py -- The `tpkv` mode of tools/gpu_run.sh: KV transfer between tensor-parallel
degrees on GPUs (docs/kvtransfer.md, "Tensor-parallel instances"). On stories260k (4 KV heads)
with --backend cuda, a router (--prefill-policy remote: every prompt goes through a prefill
instance) in front of pdserve-prefill at --tensor-parallel p and pdserve-decode at
--tensor-parallel d, for (p, d) = (2, 1), (1, 2), (2, 2) and, with 4 GPUs, (1, 4), (4, 2); both
instances from --device 0 (they share the GPUs: small --kv-cache-mb). The references are
colocated instances on the GPUs at TP 1 and at each decode degree. For each pair:
  - greedy from BOS gives at least the golden story's first MIN_SAME tokens;
  - that and three longer prompts sent at once (one step's requests share each layer's
    events) give the tokens of the colocated instance of the decode side's degree for at
    least their first MIN_SAME (its decode steps are the same computation; only the prompt's
    KV comes from another degree);
  - the prefill instance's /metrics counts a finished KV transfer for every request.
Why not 64 tokens everywhere: in bf16 the partial sums cross the all-reduce rounded, so greedy
tokens part from the fp32 golden story (or from another degree's) where its margin is small
(pdserve-generate at TP 4 on stories260k at token 20: gpu_run.sh tp); a KV transfer that
moved wrong bytes spoils the tokens from the first decode step on. The counts are printed.
Prints a line per pair (ok / DIFFERS); logs in OUT/tpkv-*/. Exit 0 when every pair is ok.

usage: gpu_tpkv.py BIN_DIR MODEL_DIR OUT_DIR N_GPUS   (PD_LIBS: LD_LIBRARY_PATH of the binaries;
TPKV_BACKEND=cpu: the same on the CPU backend, a dry run without a GPU)"""
import json, os, re, signal, subprocess, sys, threading, time, urllib.request

BIN, MODEL, OUT, NGPU = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
ENV = dict(os.environ, LD_LIBRARY_PATH=os.environ.get("PD_LIBS", ""), NCCL_NVLS_ENABLE="0")
MIN_SAME = 16
N_TOKENS = 64
STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in "
         "the park with her friends. One day, she saw a big red ball under a tree. ")
PROMPTS = ["Tom had a small dog called Max.",
           STORY * 2 + "Lily ran to the ball and",
           STORY * 5 + "Then her mom called her home and"]
# TPKV_BACKEND=cpu runs the same on the CPU backend (a dry run of the script without a GPU).
COMMON = ["--model", MODEL, "--backend", os.environ.get("TPKV_BACKEND", "cuda"), "--device", "0",
          "--listen", "127.0.0.1:0",
          "--metrics-port", "0", "--kv-cache-mb", "64", "--kv-staging-mb", "64"]


class Proc:
    def __init__(self, logs, tag, name, args):
        self.tag, self.out = tag, os.path.join(logs, tag + ".out")
        self.log = os.path.join(logs, tag + ".log")
        self.p = subprocess.Popen([os.path.join(BIN, name)] + args, env=ENV,
                                  stdout=open(self.out, "w"), stderr=open(self.log, "w"))
        self.port = self.mport = None
        for _ in range(1200):  # CUDA and NCCL start: up to two minutes
            text = open(self.out).read()
            m, mm = re.search(r"^PORT (\d+)", text, re.M), re.search(r"^METRICS_PORT (\d+)", text, re.M)
            if m and mm:
                self.port, self.mport = int(m.group(1)), int(mm.group(1))
                return
            if self.p.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError("%s did not start: %s" % (tag, open(self.log).read()[-600:].strip()))

    def addr(self):
        return "127.0.0.1:%d" % self.port

    def metrics(self):
        with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % self.mport, timeout=10) as r:
            return r.read().decode()

    def stop(self):
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(30)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()


def generate(addr, prompt, logs, tag):
    """Greedy token ids of a prompt through the router (retried while the router has no
    instance's load report yet)."""
    cmd = [os.path.join(BIN, "pdserve-cli"), "generate", "--addr", addr, "--temperature", "0",
           "--max-tokens", str(N_TOKENS), "--ignore-eos", "--json", "--prompt", prompt]
    for _ in range(60):
        r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=120)
        open(os.path.join(logs, tag + ".json"), "w").write(r.stdout + r.stderr)
        if r.returncode == 0:
            return json.loads(r.stdout)["token_ids"]
        time.sleep(0.5)
    raise RuntimeError("%s: %s" % (tag, r.stderr.strip()[-300:]))


def run_prompts(addr, logs):
    """The golden prompt alone, then the three long ones at once."""
    golden = generate(addr, "", logs, "golden")
    out = [None] * len(PROMPTS)
    def one(k):
        try:
            out[k] = generate(addr, PROMPTS[k], logs, "prompt%d" % k)
        except Exception as e:  # reported as a difference
            out[k] = str(e)
    ts = [threading.Thread(target=one, args=(k,)) for k in range(len(PROMPTS))]
    for t in ts: t.start()
    for t in ts: t.join()
    return golden, out


def same(a, b):
    if not isinstance(a, list) or not isinstance(b, list):
        return 0
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def stack(tag, instances):
    """Starts the instances (tag, binary, args) and a router over them; returns (procs, router)."""
    logs = os.path.join(OUT, "tpkv-" + tag)
    os.makedirs(logs, exist_ok=True)
    procs = []
    try:
        for t, name, args, role in instances:
            procs.append((role, Proc(logs, t, name, args)))
        rargs = ["--model", MODEL, "--listen", "127.0.0.1:0", "--metrics-port", "0",
                 "--load-poll-ms", "100", "--prefill-policy", "remote"]
        for role, p in procs:
            rargs += ["--" + role, p.addr()]
        procs.append(("router", Proc(logs, "router", "pdserve-router", rargs)))
    except Exception:
        for _, p in procs: p.stop()
        raise
    return logs, procs


def transfers(text):
    return sum(float(v) for v in re.findall(r"^pdserve_kv_transfers_by_path_total\{[^}]*\} (\S+)$", text, re.M))


want_golden = json.load(open(os.path.join(MODEL, "golden.json")))["cases"][0]["greedy_ids"][:N_TOKENS]
pairs = [(2, 1), (1, 2), (2, 2)] + ([(1, 4), (4, 2)] if NGPU >= 4 else [])
rc = 0
refs = {}  # decode degree -> (tokens from BOS, the long prompts' tokens), colocated
for d in sorted({1} | {d for _, d in pairs}):
    name = "colocated TP %d (reference)" % d
    try:
        logs, procs = stack("colocated-tp%d" % d, [
            ("colocated", "pdserve-decode", COMMON + ["--colocated", "--tensor-parallel", str(d)],
             "decode")])
        try:
            refs[d] = run_prompts(procs[-1][1].addr(), logs)
        finally:
            for _, p in reversed(procs): p.stop()
    except Exception as e:
        print("tpkv %s: did not run: %s" % (name, e))
        rc = 1
        continue
    g, ref = refs[d]
    ok = same(g, want_golden) >= MIN_SAME and all(isinstance(x, list) and len(x) == N_TOKENS for x in ref)
    print("tpkv %s: %s (golden %d/%d; prompts same as colocated TP 1 for %s of %d tokens)" %
          ("colocated TP %d" % d, "ok" if ok else "DIFFERS", same(g, want_golden), N_TOKENS,
           ", ".join(str(same(a, b)) for a, b in zip(ref, refs[1][1])) if 1 in refs else "-",
           N_TOKENS))
    if not ok:
        rc = 1
for p, d in pairs:
    name = "prefill TP %d -> decode TP %d" % (p, d)
    if d not in refs:
        print("tpkv %s: DIFFERS (no colocated TP %d reference)" % (name, d))
        rc = 1
        continue
    try:
        logs, procs = stack("%d-%d" % (p, d), [
            ("prefill", "pdserve-prefill", COMMON + ["--tensor-parallel", str(p)], "prefill"),
            ("decode", "pdserve-decode", COMMON + ["--tensor-parallel", str(d)], "decode")])
    except Exception as e:
        print("tpkv %s: DIFFERS (did not start: %s)" % (name, e))
        rc = 1
        continue
    try:
        g, got = run_prompts(procs[-1][1].addr(), logs)
        n_xfer = transfers(procs[0][1].metrics())
    except Exception as e:
        g, got, n_xfer = None, [str(e)] * len(PROMPTS), 0
    finally:
        for _, pr in reversed(procs): pr.stop()
    rg, rp = refs[d]
    s = [same(g, rg)] + [same(a, b) for a, b in zip(got, rp)]
    ok = same(g, want_golden) >= MIN_SAME and min(s) >= MIN_SAME and n_xfer >= 1 + len(PROMPTS)
    print("tpkv %s: %s (golden %d/%d; BOS and prompts same as colocated TP %d for %s of %d "
          "tokens; %d KV transfers)" % (name, "ok" if ok else "DIFFERS", same(g, want_golden),
                                        N_TOKENS, d, ", ".join(map(str, s)), N_TOKENS, n_xfer))
    if not ok:
        rc = 1
        for x in got:
            if not isinstance(x, list):
                print("  error: %s" % x[-300:])
        for f in ("prefill.log", "decode.log"):
            for line in open(os.path.join(logs, f), errors="replace"):
                if re.search(r" E |error|failed", line):
                    print("  %s: %s" % (f, line.strip()[:200]))
                    break
sys.exit(rc)
