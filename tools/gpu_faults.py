#!/usr/bin/env python3
"""gpu_faults.py -- The fault and interference scenarios of issue #27 that tools/gpu_kv.sh runs
(modes kill, storm, itl) against a stack that tools/pdserve-up.sh started. Standard library
only (the GPU machine has no grpcio): the load comes from the packed pdserve-bench and
pdserve-cli, the state from each process's /metrics (the "METRICS_PORT n" lines in
pdserve-up's log folder). Each scenario prints "== NAME: PASS|FAIL ..." with its numbers and
exits 0 when it passed, 1 when not. Every client process it starts is ended before it returns.

  kill   --victim prefill|decode: closed-loop load through the router, then kill -9 of the
         victim while a KV transfer is in flight on it (its pdserve_kv_transfers_active: send
         for prefill, recv for decode, polled); the survivor must stay alive and SERVING and
         come back to rest (KV blocks in use back to the pre-load value, no transfer,
         reservation, sequence or request left) within --settle-s of the last client's end;
         no request may hang (every one ends, none DEADLINE_EXCEEDED, the bench and the probes
         within their bounds); requests that ended before the kill are all OK, those started
         after it OK or UNAVAILABLE within --fast-s.
         The caller stops pdserve-up's watch loop first (kill -STOP), or it would stop the
         stack when the victim dies.
  storm  for --duration-s: pdserve-bench runs with short deadlines (--timeout-ms of 2 ms to
         1 s), pdserve-bench runs interrupted (SIGINT: every call cancelled) or killed
         (SIGKILL: connections dropped) at random times, and pdserve-cli calls with random
         deadlines or killed at random times; afterwards every client ended in time, every
         process is alive and SERVING, a request through the router succeeds, and everything
         comes to rest within --settle-s.
  itl    decode ITL of --streams long-output streams started at once (run A), and the same
         with a background of long prompts whose KV lands on the same decode instance (run
         B), alternately --rounds times; PASS when median p99(B) / median p99(A) <= --max-ratio.

The binaries get LD_LIBRARY_PATH from PD_LIBS (python3 itself runs without the packed
libraries)."""
import argparse, json, math, os, random, re, signal, subprocess, sys, threading, time
import urllib.request

ENV = dict(os.environ)
if "PD_LIBS" in os.environ:
    ENV["LD_LIBRARY_PATH"] = os.environ["PD_LIBS"]
CHILDREN = set()          # client processes alive, ended on exit whatever happens
CHILD_MU = threading.Lock()
STOP = threading.Event()  # set when ending: no client starts after it


LOG = []  # a file that gets a copy of every line (--log)


def log(msg):
    print(msg, flush=True)
    for f in LOG:
        f.write(msg + "\n")
        f.flush()


# ---- processes ----

def spawn(argv, **kw):
    with CHILD_MU:
        if STOP.is_set():
            raise SystemExit(143)
        p = subprocess.Popen(argv, env=ENV, **kw)
        CHILDREN.add(p)
    return p


def reap(p, timeout):
    """Waits up to timeout s; returns the exit code or None (still running)."""
    try:
        rc = p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    with CHILD_MU:
        CHILDREN.discard(p)
    return rc


def end_children():
    with CHILD_MU:
        STOP.set()
        ps = list(CHILDREN)
    for p in ps:
        if p.poll() is None:
            p.kill()
    for p in ps:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def pid_state(pid):
    """'R', 'S', ... from /proc, 'Z' for a zombie, None when gone."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def alive(pid):
    return pid_state(pid) not in (None, "Z", "X")


def children_named(ppid, name):
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % d) as f:
                s = f.read()
        except OSError:
            continue
        comm = s[s.index("(") + 1:s.rindex(")")]
        rest = s[s.rindex(")") + 2:].split()
        if comm == name[:15] and int(rest[1]) == ppid:
            out.append(int(d))
    return out


# ---- the stack ----

class Stack:
    """What pdserve-up started: per process (router, prefill-0, decode-0, ...) its gRPC port,
    its metrics port and its pid (children of pdserve-up by name)."""

    def __init__(self, logs, up_pid, bin_dir):
        self.bin = bin_dir
        self.procs = {}
        deadline = time.time() + 10
        while True:
            self.procs = {}
            missing = False
            for f in sorted(os.listdir(logs)):
                if not f.endswith(".out") or f == "up.out":
                    continue
                name = f[:-4]
                txt = open(os.path.join(logs, f)).read()
                port = re.search(r"^PORT (\d+)", txt, re.M)
                mport = re.search(r"^METRICS_PORT (\d+)", txt, re.M)
                if not port or not mport:
                    missing = True
                self.procs[name] = {"port": int(port.group(1)) if port else None,
                                    "mport": int(mport.group(1)) if mport else None,
                                    "log": os.path.join(logs, f[:-4] + ".log")}
            if not missing or time.time() > deadline:
                break
            time.sleep(0.2)
        kinds = {"router": "pdserve-router", "prefill": "pdserve-prefill", "decode": "pdserve-decode"}
        for kind, comm in kinds.items():
            names = sorted(n for n in self.procs if n.split("-")[0] == kind)
            pids = sorted(children_named(up_pid, comm))
            # pdserve-up starts them in name order: prefill-0, prefill-1, ...
            for n, pid in zip(names, pids):
                self.procs[n]["pid"] = pid
        for n, p in self.procs.items():
            if p["mport"] is None or "pid" not in p:
                raise SystemExit("gpu_faults: %s: no metrics port or pid found (%s)" % (n, p))

    def names(self, kind=None):
        return sorted(n for n in self.procs if kind is None or n.split("-")[0] == kind)

    def addr(self, name):
        return "127.0.0.1:%d" % self.procs[name]["port"]

    def scrape(self, name):
        return Scrape(self.procs[name]["mport"])

    def cli(self, *args):
        return [os.path.join(self.bin, "pdserve-cli")] + list(args)

    def bench(self, *args):
        return [os.path.join(self.bin, "pdserve-bench")] + list(args)

    def health(self, name):
        r = subprocess.run(self.cli("health", "--addr", self.addr(name)), env=ENV,
                           capture_output=True, text=True, timeout=20)
        return r.returncode == 0


class Scrape:
    LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")

    def __init__(self, port, timeout=5):
        body = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=timeout).read().decode()
        self.samples = []
        for line in body.splitlines():
            m = self.LINE.match(line)
            if not m or line.startswith("#"):
                continue
            labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
            try:
                self.samples.append((m.group(1), labels, float(m.group(3))))
            except ValueError:
                pass

    def get(self, name, **labels):
        return sum(v for n, l, v in self.samples
                   if n == name and all(l.get(k) == v2 for k, v2 in labels.items()))

    def has(self, name):
        return any(n == name for n, _, _ in self.samples)


# What must be back to rest on an instance: (metric, labels, bound) where bound "base" means
# the value before the load.
REST_INSTANCE = [("pdserve_kv_cache_used_blocks", {}, "base"), ("pdserve_kv_transfers_active", {}, 0),
                 ("pdserve_kv_reservations", {}, 0), ("pdserve_sequences_running", {}, 0),
                 ("pdserve_sequences_waiting", {}, 0), ("pdserve_requests_in_flight", {}, 0),
                 ("pdserve_kv_staging_slots_in_use", {}, 0), ("pdserve_kv_staging_waiting", {}, 0)]
REST_ROUTER = [("pdserve_requests_in_flight", {}, 0)]


def rest_state(stack, names, base):
    """(at rest?, description) over the processes named."""
    ok, parts = True, []
    for n in names:
        try:
            s = stack.scrape(n)
        except Exception as e:  # noqa: BLE001 (a dead process has no /metrics)
            return False, "%s: cannot scrape (%s)" % (n, e)
        vals = []
        for metric, labels, bound in (REST_ROUTER if n.startswith("router") else REST_INSTANCE):
            if not s.has(metric):
                continue
            v = s.get(metric, **labels)
            lim = base.get((n, metric), 0) if bound == "base" else bound
            if v > lim:
                ok = False
            short = metric.replace("pdserve_", "").replace("kv_cache_", "")
            vals.append("%s %g" % (short, v) + ("" if v <= lim else " (want <= %g)" % lim))
        parts.append("%s: %s" % (n, ", ".join(vals)))
    return ok, "; ".join(parts)


def baseline(stack, names):
    base = {}
    for n in names:
        s = stack.scrape(n)
        for metric, _, bound in REST_INSTANCE:
            if bound == "base":
                base[(n, metric)] = s.get(metric)
    return base


def wait_rest(stack, names, base, within_s):
    """Polls until at rest; returns (seconds it took or None, last description)."""
    t0 = time.monotonic()
    while True:
        ok, desc = rest_state(stack, names, base)
        if ok:
            return time.monotonic() - t0, desc
        if time.monotonic() - t0 > within_s:
            return None, desc
        time.sleep(0.1)


def cli_generate(stack, addr, max_tokens, timeout_ms, prompt="Once upon a time", temp="0"):
    """One pdserve-cli generate; returns (status name, seconds)."""
    t0 = time.monotonic()
    p = spawn(stack.cli("generate", "--addr", addr, "--max-tokens", str(max_tokens), "--ignore-eos",
                        "--temperature", temp, "--timeout-ms", str(timeout_ms), "--prompt", prompt),
              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _, err = p.communicate(timeout=timeout_ms / 1000.0 + 30)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        err = "HUNG"
    with CHILD_MU:
        CHILDREN.discard(p)
    dt = time.monotonic() - t0
    if p.returncode == 0:
        return "OK", dt
    m = re.search(r"pdserve-cli: ([A-Z_]+):", err or "")
    return (m.group(1) if m else ("HUNG" if err == "HUNG" else "EXIT%d" % p.returncode)), dt


def read_csv(path):
    rows = []
    if not os.path.exists(path):
        return rows
    with open(path) as f:
        head = f.readline().strip().split(",")
        for line in f:
            v = line.rstrip("\n").split(",")
            rows.append(dict(zip(head, v)))
    return rows


def fnum(s):
    try:
        return float(s)
    except (TypeError, ValueError):
        return float("nan")


def counts(items):
    out = {}
    for x in items:
        out[x] = out.get(x, 0) + 1
    return ", ".join("%s %d" % kv for kv in sorted(out.items())) or "none"


# ---- kill ----

def scenario_kill(a, stack):
    victim = a.victim + "-0"
    survivor = ("decode" if a.victim == "prefill" else "prefill") + "-0"
    router = "router"
    direction = "send" if a.victim == "prefill" else "recv"
    name = "kill-" + a.victim
    vpid, spid = stack.procs[victim]["pid"], stack.procs[survivor]["pid"]
    fails = []

    # Warm up (and check the stack serves), then the survivor's resting values.
    code, dt = cli_generate(stack, stack.addr(router), 16, 60000)
    if code != "OK":
        fails.append("warm-up request %s" % code)
    t, desc = wait_rest(stack, [survivor, victim], {}, 30)
    base = baseline(stack, [survivor])
    log("%s: before the load: %s" % (name, desc))

    def router_ok():
        try:
            return stack.scrape(router).get("pdserve_request_success_total")
        except Exception:  # noqa: BLE001
            return -1
    ok0 = router_ok()  # (the warm-up request counts there)
    csv, js = os.path.join(a.out, name + ".csv"), os.path.join(a.out, name + ".json")
    t_launch = time.monotonic()
    bench = spawn(stack.bench("--addr", stack.addr(router), "--arrival", "closed", "--concurrency",
                              str(a.concurrency), "--duration-s", str(a.duration_s), "--input-len",
                              a.input_len, "--output-len", a.output_len, "--timeout-ms",
                              str(a.timeout_ms), "--seed", "7", "--quiet", "--csv", csv, "--json", js),
                  stdout=open(os.path.join(a.out, name + "-bench.log"), "w"), stderr=subprocess.STDOUT)
    time.sleep(a.warm_s)
    # A slow build (ASan on two busy cores) may take longer for its first answers: wait
    # (bounded by half the load) until the router has finished one, so that the check of the
    # requests that ended before the kill has something to check.
    t_wait = t_launch + max(a.warm_s, a.duration_s / 2.0)
    while time.monotonic() < t_wait and ok0 >= 0 and router_ok() <= ok0:
        time.sleep(0.1)
    # Kill while a transfer is in flight on the victim (polled), else at the latest 1 s before
    # the load ends.
    seen, polls = 0.0, 0
    t_end = max(time.monotonic() + 0.5, t_launch + a.duration_s - 1.0)
    vport = stack.procs[victim]["mport"]
    while time.monotonic() < t_end:
        try:
            seen = Scrape(vport, timeout=2).get("pdserve_kv_transfers_active", direction=direction)
        except Exception:  # noqa: BLE001
            seen = 0
        polls += 1
        if seen > 0:
            break
    at_kill = {}
    os.kill(vpid, signal.SIGKILL)
    t_kill = time.monotonic()
    try:
        s = stack.scrape(survivor)
        at_kill = {"used": s.get("pdserve_kv_cache_used_blocks"),
                   "xfers": s.get("pdserve_kv_transfers_active"),
                   "running": s.get("pdserve_sequences_running")}
    except Exception as e:  # noqa: BLE001
        at_kill = {"scrape": str(e)}
    log("%s: kill -9 %s (pid %d) %.2f s into the load, with %g %s transfer(s) in flight on it "
        "(%d polls); %s then: %s" % (name, victim, vpid, t_kill - t_launch, seen, direction,
                                    polls, survivor, at_kill))
    if seen <= 0:
        log("%s: note: no transfer was seen in flight on %s at the kill" % (name, victim))
    # Probes after the kill: each must end (OK, or UNAVAILABLE without a prefill / decode
    # instance) within fast_s.
    time.sleep(0.5)
    probes = [cli_generate(stack, stack.addr(router), 8, 30000) for _ in range(3)]
    log("%s: probes after the kill: %s" % (name, ", ".join("%s in %.2f s" % p for p in probes)))
    for c, d in probes:
        if c not in ("OK", "UNAVAILABLE") or d > a.fast_s:
            fails.append("probe %s in %.1f s" % (c, d))
    bound = a.duration_s + a.timeout_ms / 1000.0 + 30 - (time.monotonic() - t_launch)
    brc = reap(bench, max(bound, 1))
    t_clients_end = time.monotonic()
    if brc is None:
        fails.append("pdserve-bench still running %.0f s after the load ended (hung)" %
                     (t_clients_end - t_launch - a.duration_s))
        bench.send_signal(signal.SIGINT)
        if reap(bench, 15) is None:
            bench.kill()
            reap(bench, 10)
    elif brc != 0:
        fails.append("pdserve-bench exit %d" % brc)

    # Requests: before the kill all OK; in flight at it: ended OK (moved elsewhere), or failed within
    # hang_s of the kill; started after it: OK or UNAVAILABLE within fast_s.
    rows = read_csv(csv)
    kill_ms = (t_kill - t_launch) * 1000.0  # bench's clock starts a little after t_launch
    before, during, after = [], [], []
    for r in rows:
        st, e2e, start = r["status"], fnum(r["e2e_ms"]), fnum(r["start_ms"])
        end = start + e2e if not math.isnan(e2e) else float("inf")
        if end < kill_ms - 500:
            before.append(r)
        elif start > kill_ms:
            after.append(r)
        else:
            during.append(r)
    bad_before = [r for r in before if r["status"] != "OK"]
    hung = [r for r in rows if r["status"] in ("DEADLINE_EXCEEDED", "IN_FLIGHT")]
    # A request in flight at the kill that completed OK moved to another instance (issue #38:
    # the prompt computed on the decode instance, a stream resumed): however long that took,
    # it is no hang (DEADLINE_EXCEEDED would be); one that failed must have failed promptly.
    late_during = [r for r in during if math.isnan(fnum(r["e2e_ms"])) or
                   (r["status"] != "OK" and
                    fnum(r["start_ms"]) + fnum(r["e2e_ms"]) - kill_ms > a.hang_s * 1000)]
    slow_after = [r for r in after if r["status"] not in ("OK", "UNAVAILABLE")
                  or not fnum(r["e2e_ms"]) <= a.fast_s * 1000]
    max_during = max([fnum(r["start_ms"]) + fnum(r["e2e_ms"]) - kill_ms for r in during] or [0])
    max_after = max([fnum(r["e2e_ms"]) for r in after] or [0])
    log("%s: requests: %d ended before the kill (%s); %d in flight at it (%s; the last ended "
        "%.2f s after the kill); %d started after it (%s; slowest %.0f ms)" %
        (name, len(before), counts(r["status"] for r in before), len(during),
         counts(r["status"] for r in during), max_during / 1000.0, len(after),
         counts(r["status"] for r in after), max_after))
    if not rows:
        fails.append("no per-request CSV from pdserve-bench")
    if len(before) == 0:  # (a slow build: the kill came before any answer; not a failure)
        log("%s: note: no request completed before the kill (a slow build; load too short?)" % name)
    if bad_before:
        fails.append("%d requests that ended before the kill failed" % len(bad_before))
    if hung:
        fails.append("%d requests hung (%s)" % (len(hung), counts(r["status"] for r in hung)))
    if late_during:
        fails.append("%d requests in flight at the kill failed more than %g s after it, or never "
                     "ended" % (len(late_during), a.hang_s))
    if slow_after:
        fails.append("%d requests started after the kill were not OK/UNAVAILABLE within %g s (%s)"
                     % (len(slow_after), a.fast_s, counts(r["status"] for r in slow_after)))

    # The survivor: alive, SERVING, back to rest.
    if not alive(spid):
        fails.append("%s died" % survivor)
    if alive(vpid):
        fails.append("%s still alive after kill -9" % victim)
    rest_s, desc = wait_rest(stack, [survivor], base, a.settle_s)
    log("%s: %s %s: %s" % (name, survivor, "at rest %.1f s after the last client ended (%.1f s "
                           "after the kill)" % (rest_s, t_clients_end - t_kill + rest_s)
                           if rest_s is not None else "NOT at rest %g s after the last client "
                           "ended" % a.settle_s, desc))
    if rest_s is None:
        fails.append("%s not at rest within %g s" % (survivor, a.settle_s))
    if alive(spid) and not stack.health(survivor):
        fails.append("%s not SERVING" % survivor)
    ok = not fails
    log("== %s: %s (kill at %.1f s with %g %s transfers in flight; %d requests: %d before OK, "
        "%d in flight -> %s, %d after -> %s; %s at rest %s)%s" %
        (name, "PASS" if ok else "FAIL", t_kill - t_launch, seen, direction, len(rows),
         len(before) - len(bad_before), len(during), counts(r["status"] for r in during) or "-",
         len(after), counts(r["status"] for r in after), survivor,
         "in %.1f s" % rest_s if rest_s is not None else "never",
         "" if ok else ": " + "; ".join(fails)))
    return 0 if ok else 1


# ---- storm ----

WORDS = ("once upon a time there was a little girl named lily she liked to play with her "
         "ball in the park one day a big dog came and they were happy the sun was shining "
         "tom wanted to find his toy car under the tree").split()


def scenario_storm(a, stack):
    name = "storm"
    router = "router"
    insts = stack.names("prefill") + stack.names("decode")
    fails = []
    code, _ = cli_generate(stack, stack.addr(router), 8, 60000)
    if code != "OK":
        fails.append("warm-up request %s" % code)
    wait_rest(stack, insts, {}, 30)
    base = baseline(stack, insts)
    rng = random.Random(a.seed)
    t0 = time.monotonic()
    t_stop = t0 + a.duration_s
    mu = threading.Lock()
    stats = {"cli": [], "cli_late": 0, "bench_int": 0, "bench_kill": 0, "bench_hung": 0,
             "bench_codes": {}, "bench_reqs": 0, "bench_bad": []}

    def add_codes(js):
        try:
            j = json.load(open(js))
        except (OSError, ValueError):
            return
        with mu:
            for run in j.get("runs", []):
                stats["bench_reqs"] += run.get("requests", 0)
                stats["bench_codes"]["OK"] = stats["bench_codes"].get("OK", 0) + run.get("ok", 0)
                if run.get("interrupted"):
                    stats["bench_codes"]["cancelled(SIGINT)"] = (
                        stats["bench_codes"].get("cancelled(SIGINT)", 0) + run["interrupted"])
                for c, n in (run.get("errors_by_code") or {}).items():
                    stats["bench_codes"][c] = stats["bench_codes"].get(c, 0) + n

    # Deadline runs: one pdserve-bench per deadline, closed loop.
    deadline_benches = []
    for i, tmo in enumerate(a.deadlines_ms):
        js = os.path.join(a.out, "storm-deadline-%dms.json" % tmo)
        p = spawn(stack.bench("--addr", stack.addr(router), "--arrival", "closed", "--concurrency",
                              str(a.bench_concurrency), "--duration-s", str(a.duration_s),
                              "--input-len", a.input_len, "--output-len", a.output_len,
                              "--timeout-ms", str(tmo), "--seed", str(a.seed + i), "--quiet",
                              "--json", js),
                  stdout=open(os.path.join(a.out, "storm-deadline-%dms.log" % tmo), "w"),
                  stderr=subprocess.STDOUT)
        deadline_benches.append((p, js, tmo))

    def bench_interrupter(k):
        r = random.Random(a.seed * 100 + k)
        j = 0
        while time.monotonic() < t_stop:
            js = os.path.join(a.out, "storm-int-%d-%d.json" % (k, j))
            p = spawn(stack.bench("--addr", stack.addr(router), "--arrival", "closed", "--concurrency",
                                  str(a.bench_concurrency * 2), "--num-requests", "100000",
                                  "--input-len", a.input_len, "--output-len", a.output_len,
                                  "--seed", str(1000 + 100 * k + j), "--quiet", "--json", js),
                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(math.exp(r.uniform(math.log(0.05), math.log(1.5))))
            sig = signal.SIGINT if r.random() < 0.5 else signal.SIGKILL
            p.send_signal(sig)
            rc = reap(p, 20)
            with mu:
                if rc is None:
                    stats["bench_hung"] += 1
                elif sig == signal.SIGINT:
                    stats["bench_int"] += 1
                else:
                    stats["bench_kill"] += 1
            if rc is None:
                p.kill()
                reap(p, 10)
            elif sig == signal.SIGINT:
                # 130: interrupted, every call cancelled; -SIGINT: the signal came before
                # pdserve-bench set its handler (it was still starting).
                if rc not in (0, 130, -signal.SIGINT):
                    with mu:
                        stats["bench_bad"].append(rc)
                add_codes(js)
            j += 1

    def cli_worker(k):
        r = random.Random(a.seed * 1000 + k)
        while time.monotonic() < t_stop:
            prompt = " ".join(r.choice(WORDS) for _ in range(r.randint(1, a.max_words)))
            mt = r.randint(1, 64)
            t = math.exp(r.uniform(math.log(0.001), math.log(a.span_ms / 1000.0)))
            how = "deadline" if r.random() < 0.5 else "kill"
            tmo = max(1, int(t * 1000)) if how == "deadline" else 30000
            ts = time.monotonic()
            p = spawn(stack.cli("generate", "--addr", stack.addr(router), "--max-tokens", str(mt),
                                "--ignore-eos", "--temperature", "0.8", "--timeout-ms", str(tmo),
                                "--prompt", prompt),
                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            if how == "kill":
                try:
                    p.wait(timeout=t)
                except subprocess.TimeoutExpired:
                    p.kill()
            try:
                _, err = p.communicate(timeout=tmo / 1000.0 + 10)
                rc = p.returncode
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate()
                err, rc = "", None
            with CHILD_MU:
                CHILDREN.discard(p)
            dt = time.monotonic() - ts
            if rc is None:
                c = "HUNG"
            elif rc == 0:
                c = "OK"
            elif rc < 0:
                c = "killed"
            else:
                m = re.search(r"pdserve-cli: ([A-Z_]+):", err or "")
                c = m.group(1) if m else "EXIT%d" % rc
            with mu:
                stats["cli"].append(c)
                if how == "deadline" and dt > tmo / 1000.0 + 5:
                    stats["cli_late"] += 1

    ths = [threading.Thread(target=bench_interrupter, args=(k,), daemon=True)
           for k in range(a.interrupters)]
    ths += [threading.Thread(target=cli_worker, args=(k,), daemon=True) for k in range(a.cli_workers)]
    for t in ths:
        t.start()
    # Sample the load while it runs: transfers in flight on the instances.
    peak = {n: 0.0 for n in insts}
    while time.monotonic() < t_stop:
        for n in insts:
            try:
                peak[n] = max(peak[n], stack.scrape(n).get("pdserve_kv_transfers_active"))
            except Exception:  # noqa: BLE001
                pass
        time.sleep(0.2)
    for t in ths:
        t.join(60)
    if any(t.is_alive() for t in ths):
        fails.append("a client thread did not end")
    for p, js, tmo in deadline_benches:
        rc = reap(p, 60 + tmo / 1000.0)
        if rc is None:
            stats["bench_hung"] += 1
            p.send_signal(signal.SIGINT)
            if reap(p, 15) is None:
                p.kill()
                reap(p, 10)
        elif rc != 0:
            stats["bench_bad"].append(rc)
        else:
            add_codes(js)
    t_end = time.monotonic()
    log("%s: %.1f s of load (peak KV transfers in flight: %s); pdserve-bench: %d requests "
        "reported (%s), %d runs interrupted by SIGINT, %d killed; pdserve-cli: %d calls (%s)" %
        (name, t_end - t0, ", ".join("%s %g" % kv for kv in sorted(peak.items())),
         stats["bench_reqs"], ", ".join("%s %d" % kv for kv in sorted(stats["bench_codes"].items())),
         stats["bench_int"], stats["bench_kill"], len(stats["cli"]), counts(stats["cli"])))
    if stats["bench_hung"]:
        fails.append("%d pdserve-bench runs did not end" % stats["bench_hung"])
    if stats["bench_bad"]:
        fails.append("pdserve-bench exit codes %s" % stats["bench_bad"])
    hung = [c for c in stats["cli"] if c == "HUNG"]
    if hung or stats["cli_late"]:
        fails.append("%d pdserve-cli calls hung, %d ended more than 5 s past their deadline" %
                     (len(hung), stats["cli_late"]))
    if stats["bench_reqs"] + len(stats["cli"]) == 0:
        fails.append("no request was sent")
    # Afterwards: alive, answering, at rest, SERVING, no block-ownership errors.
    dead = [n for n in stack.names() if not alive(stack.procs[n]["pid"])]
    if dead:
        fails.append("died: %s" % ", ".join(dead))
    code, dt = cli_generate(stack, stack.addr(router), 4, 10000)
    log("%s: a request through the router afterwards: %s in %.2f s" % (name, code, dt))
    if code != "OK" or dt > 5:
        fails.append("the request afterwards: %s in %.1f s" % (code, dt))
    rest_s, desc = wait_rest(stack, stack.names(), base, a.settle_s)
    log("%s: %s: %s" % (name, "at rest %.1f s after the last client ended" % rest_s
                        if rest_s is not None else "NOT at rest %g s after the last client ended"
                        % a.settle_s, desc))
    if rest_s is None:
        fails.append("not at rest within %g s" % a.settle_s)
    for n in insts:
        if not dead and not stack.health(n):
            fails.append("%s not SERVING" % n)
    for n in stack.names():
        try:
            if "is held by request" in open(stack.procs[n]["log"], errors="replace").read():
                fails.append("%s logged a block held by another request" % n)
        except OSError:
            pass
    ok = not fails
    n_req = stats["bench_reqs"] + len(stats["cli"])
    log("== storm: %s (%.0f s, %d requests reported + %d bench runs cancelled by signal; "
        "bench %s; cli %s; at rest %s)%s" %
        ("PASS" if ok else "FAIL", t_end - t0, n_req, stats["bench_int"] + stats["bench_kill"],
         ", ".join("%s %d" % kv for kv in sorted(stats["bench_codes"].items())) or "-",
         counts(stats["cli"]), "in %.1f s" % rest_s if rest_s is not None else "never",
         "" if ok else ": " + "; ".join(fails)))
    return 0 if ok else 1


# ---- itl ----

def scenario_itl(a, stack):
    router = "router"
    dec = stack.names("decode")[0]
    fails = []

    def streams(tag, out_len, n):
        js = os.path.join(a.out, "itl-%s.json" % tag)
        p = spawn(stack.bench("--addr", stack.addr(router), "--arrival", "closed", "--concurrency",
                              str(n), "--num-requests", str(n), "--input-len", str(a.prompt_len),
                              "--output-len", str(out_len), "--timeout-ms", str(a.timeout_ms),
                              "--seed", "11", "--quiet", "--json", js),
                  stdout=open(os.path.join(a.out, "itl-%s.log" % tag), "w"), stderr=subprocess.STDOUT)
        return p, js

    def background(tag, duration):
        js = os.path.join(a.out, "itl-%s-bg.json" % tag)
        p = spawn(stack.bench("--addr", stack.addr(router), "--arrival", "constant", "--rate",
                              str(a.bg_rate), "--duration-s", str(duration), "--input-len",
                              str(a.bg_prompt_len), "--output-len", str(a.bg_output_len),
                              "--timeout-ms", str(a.timeout_ms), "--seed", "13", "--quiet",
                              "--json", js),
                  stdout=open(os.path.join(a.out, "itl-%s-bg.log" % tag), "w"), stderr=subprocess.STDOUT)
        return p, js

    def recv(s):
        return (s.get("pdserve_kv_transfers_total", direction="recv"),
                s.get("pdserve_kv_transfer_bytes_total", direction="recv"))

    def run_json(js):
        try:
            return json.load(open(js))["runs"][-1]
        except (OSError, ValueError, KeyError, IndexError):
            return None

    # Warm-up: the streams' shape once (short), and a few long prompts.
    p, _ = streams("warmup", 32, a.streams)
    if reap(p, a.timeout_ms / 1000.0 + 60) is None:
        p.kill()
        reap(p, 10)
    p, _ = background("warmup", max(2.0, 3.0 / a.bg_rate))
    if reap(p, a.timeout_ms / 1000.0 + 60) is None:
        p.kill()
        reap(p, 10)
    wait_rest(stack, stack.names(), {}, 60)
    base = baseline(stack, stack.names("prefill") + stack.names("decode"))
    res = {"A": [], "B": []}
    for k in range(a.rounds):
        for cond in ("A", "B"):
            tag = "%s%d" % (cond, k + 1)
            # What the run before left (a cancelled background's transfers) lands first.
            if wait_rest(stack, stack.names(), base, 60)[0] is None:
                fails.append("%s: not at rest before the run" % tag)
            before = recv(stack.scrape(dec))
            bg = None
            if cond == "B":
                bg, bg_js = background(tag, 3600)
                time.sleep(a.bg_lead_s)
            t0 = time.monotonic()
            p, js = streams(tag, a.output_len, a.streams)
            rc = reap(p, a.timeout_ms / 1000.0 + 120)
            dt = time.monotonic() - t0
            if rc is None:
                fails.append("%s: the streams' pdserve-bench hung" % tag)
                p.kill()
                reap(p, 10)
            bg_note = ""
            if bg is not None:
                bg.send_signal(signal.SIGINT)  # stops sending; cancels what is in flight
                if reap(bg, 60) is None:
                    fails.append("%s: the background pdserve-bench did not stop" % tag)
                    bg.kill()
                    reap(bg, 10)
                b = run_json(bg_js)
                if b:
                    bg_note = "; background: %d requests, %d OK, TTFT p50 %.0f ms" % (
                        b.get("requests", 0), b.get("ok", 0), ((b.get("ttft_ms") or {}).get("p50") or 0))
            after = recv(stack.scrape(dec))
            r = run_json(js)
            if not r or not r.get("itl_ms"):
                fails.append("%s: no ITL from pdserve-bench" % tag)
                continue
            if r.get("ok", 0) != a.streams:
                fails.append("%s: %d of %d streams OK (%s)" % (tag, r.get("ok", 0), a.streams,
                                                               r.get("errors_by_code")))
            itl, tpot = r["itl_ms"], r.get("tpot_ms") or {}
            res[cond].append((itl["p50"], itl["p99"]))
            log("itl %s: %d streams in %.1f s: ITL p50 %.2f ms, p99 %.2f ms, max %.2f ms; TPOT p50 "
                "%.2f ms; KV transfers landed on %s: %d (%.2f GiB)%s" %
                (tag, a.streams, dt, itl["p50"], itl["p99"], itl["max"], tpot.get("p50") or 0, dec,
                 after[0] - before[0], (after[1] - before[1]) / 2**30, bg_note))
            if cond == "B" and after[0] - before[0] <= a.streams:
                fails.append("%s: no background transfer landed on %s" % (tag, dec))

    def med(xs):
        xs = sorted(xs)
        n = len(xs)
        return float("nan") if n == 0 else (xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2)

    a50, a99 = med([x[0] for x in res["A"]]), med([x[1] for x in res["A"]])
    b50, b99 = med([x[0] for x in res["B"]]), med([x[1] for x in res["B"]])
    ratio = b99 / a99 if a99 > 0 else float("nan")
    ok = not fails and ratio <= a.max_ratio
    log("== itl: %s (%d streams, %d in / %d out; median of %d rounds: A ITL p50 %.2f p99 %.2f ms; "
        "B (+ %g req/s of %d-token prompts) p50 %.2f p99 %.2f ms; p99 B/A %.3f, p50 B/A %.3f; "
        "goal <= %.2f)%s" %
        ("PASS" if ok else "FAIL", a.streams, a.prompt_len, a.output_len, a.rounds, a50, a99,
         a.bg_rate, a.bg_prompt_len, b50, b99, ratio, b50 / a50 if a50 > 0 else float("nan"),
         a.max_ratio, "" if not fails else ": " + "; ".join(fails)))
    return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("scenario", choices=["kill", "storm", "itl"])
    ap.add_argument("--bin", required=True, help="folder of pdserve-bench and pdserve-cli")
    ap.add_argument("--logs", required=True, help="pdserve-up's log folder (PDSERVE_LOG_DIR)")
    ap.add_argument("--up", type=int, required=True, help="pdserve-up's pid")
    ap.add_argument("--out", required=True, help="folder for the clients' logs and reports")
    ap.add_argument("--log", help="also write the report to this file")
    ap.add_argument("--victim", choices=["prefill", "decode"], default="prefill")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--duration-s", type=float, default=None)
    ap.add_argument("--warm-s", type=float, default=2.0)
    ap.add_argument("--input-len", default="128:384")
    ap.add_argument("--output-len", default="16:96")
    ap.add_argument("--timeout-ms", type=int, default=60000)
    ap.add_argument("--fast-s", type=float, default=5.0)
    ap.add_argument("--hang-s", type=float, default=10.0)
    ap.add_argument("--settle-s", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--deadlines-ms", default="2,10,30,100,300,1000")
    ap.add_argument("--bench-concurrency", type=int, default=4)
    ap.add_argument("--interrupters", type=int, default=2)
    ap.add_argument("--cli-workers", type=int, default=4)
    ap.add_argument("--span-ms", type=float, default=500.0)
    ap.add_argument("--max-words", type=int, default=60)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--bg-rate", type=float, default=4.0)
    ap.add_argument("--bg-prompt-len", type=int, default=2048)
    ap.add_argument("--bg-output-len", type=int, default=1)
    ap.add_argument("--bg-lead-s", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-ratio", type=float, default=1.10)
    a = ap.parse_args()
    if a.duration_s is None:
        a.duration_s = {"kill": 6.0, "storm": 20.0, "itl": 0}[a.scenario]
    if a.scenario == "itl" and "--output-len" not in sys.argv:
        a.output_len = 512
    a.output_len = int(a.output_len) if a.scenario == "itl" else a.output_len
    a.deadlines_ms = [int(x) for x in a.deadlines_ms.split(",") if x]
    os.makedirs(a.out, exist_ok=True)
    if a.log:
        LOG.append(open(a.log, "w"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    # A background job of a shell without job control starts with SIGINT ignored, and the
    # clients would inherit that (a pdserve-bench interrupted before it set its handler would
    # then run on): with a handler here, they start with the default.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        stack = Stack(a.logs, a.up, a.bin)
        log("%s: %s" % (a.scenario, ", ".join("%s pid %s port %s metrics %s" % (
            n, p.get("pid"), p["port"], p["mport"]) for n, p in sorted(stack.procs.items()))))
        return {"kill": scenario_kill, "storm": scenario_storm, "itl": scenario_itl}[a.scenario](a, stack)
    except KeyboardInterrupt:
        return 130
    finally:
        end_children()


if __name__ == "__main__":
    sys.exit(main())
