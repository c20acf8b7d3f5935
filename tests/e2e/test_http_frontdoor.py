#!/usr/bin/python3
"""test_http_frontdoor.py -- The router's HTTP front door cannot be starved by slow or idle
clients (issue #38 item 5). A colocated decode instance on stories260k (10 ms more per step)
and two routers with --http-listen and small limits set by the flags:

  - router "idle" (--http-idle-timeout-s 1): a plain completion that waits 4 s for its tokens
    (its connection suspended, no byte flowing) is answered, not closed as idle; a kept-alive
    connection with nothing to do is closed by the idle timeout;
  - router "door" (--http-request-timeout-s 2, --http-per-ip-connections 150,
    --http-max-connections 1400, --http-threads 2, --http-idle-timeout-s 120): while 1000
    slow HTTP connections (from ten client addresses, 127.0.0.2 - 127.0.0.11: partial headers,
    a fifth of them sending a header byte a second, a tenth complete headers and a body byte a
    second; each reopened as soon as the router closes it) and 200 raw TCP connections to its
    gRPC port that send nothing are held, new /v1/completions requests and gRPC Generate calls (from 127.0.0.1) are answered
    with the greedy text of the quiet stack (10 s timeouts, no latency bound; p50 / p99 with
    and without the slow connections are printed, not checked); the router has fewer than 100
    threads and no more descriptors than --http-max-connections allows; every slow connection
    is closed by the request deadline, each within a generous 30 s of opening
    (pdserve_http_request_timeouts_total counts them); per client address: with 150 kept-alive
    connections from 127.0.0.12 (each answered once, so neither deadline closes them soon),
    the 151st from there is closed unanswered while one from 127.0.0.13 is answered; the silent
    gRPC connections are closed by the gRPC server's handshake timeout (10 s).
Afterwards the router's descriptors return to where they were and nothing is left in flight;
320 requests whose clients hang up at random times (streamed or not, FIN or reset, many while
their connection is suspended) leave nothing in flight and every KV block free; and every
process exits 0 after SIGTERM (leak-free under ASan), the door with 10 requests waiting for
tokens (--shutdown-grace-ms 0: suspended connections are resumed before libmicrohttpd stops). Nothing is timed tighter than
"within 30 s". usage: test_http_frontdoor.py BIN_DIR SHARED_DIR PROTO_DIR"""
import http.client, json, math, os, random, resource, selectors, socket, struct, sys, threading, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e_util as eu

H = eu.Harness(sys.argv, log_level="warn")
pb, pbg, check = H.pb, H.pbg, H.check
import grpc

PROMPT = "Once upon a time"
N_SLOW, N_GRPC_RAW, PER_IP, MAX_CONNS = 1000, 200, 150, 1400
WANT_FDS = N_SLOW + N_GRPC_RAW + PER_IP + 400

soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
if hard != resource.RLIM_INFINITY and hard < WANT_FDS:
    eu.skip("RLIMIT_NOFILE hard limit %d < %d" % (hard, WANT_FDS))
try:  # the slow clients come from other loopback addresses (the per-address limit)
    _l = socket.socket()
    _l.bind(("127.0.0.1", 0))
    _l.listen()
    _c = socket.socket()
    _c.bind(("127.0.0.2", 0))
    _c.connect(_l.getsockname())
    _c.close()
    _l.close()
except OSError as e:
    eu.skip("cannot connect from 127.0.0.2 (%s)" % e)
if soft != resource.RLIM_INFINITY and soft < 8192:
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(8192, hard) if hard != resource.RLIM_INFINITY else 8192, hard))


def start_router(*args, tag):
    p = H.start("pdserve-router", *args, tag=tag)
    line = p.p.stdout.readline()
    if not line.startswith("HTTP_PORT "):
        raise SystemExit("router printed no HTTP_PORT: %r %s" % (line, open(p.log).read()[-2000:]))
    p.hport = int(line.split()[1])
    return p


def completion(port, body, timeout=10):
    """POST /v1/completions from 127.0.0.1: (status, parsed body or text)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = c.getresponse()
    text = r.read().decode()
    c.close()
    try:
        return r.status, json.loads(text)
    except ValueError:
        return r.status, text


def read_response(s):
    """Reads one HTTP response with a Content-Length from socket s; returns its status, None
    when the connection closed (or broke) first, or "timeout" when neither happened within
    the socket's timeout."""
    got = b""
    try:
        while b"\r\n\r\n" not in got:
            d = s.recv(4096)
            if not d:
                return None
            got += d
        head, rest = got.split(b"\r\n\r\n", 1)
        n = 0
        for line in head.split(b"\r\n")[1:]:
            k, _, v = line.partition(b":")
            if k.strip().lower() == b"content-length":
                n = int(v)
        while len(rest) < n:
            d = s.recv(4096)
            if not d:
                return None
            rest += d
        return int(head.split()[1])
    except socket.timeout:
        return "timeout"
    except OSError:
        return None


def get_health(src, port, s=None):
    """GET /health (HTTP/1.1, kept alive) from address src; returns (socket, read_response's
    answer)."""
    try:
        if s is None:
            s = socket.socket()
            s.settimeout(30)
            s.bind((src, 0))
            s.connect(("127.0.0.1", port))
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    except OSError:
        return s, None
    return s, read_response(s)


def proc_threads(pid):
    for line in open("/proc/%d/status" % pid):
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return -1


def proc_fds(pid):
    return len(os.listdir("/proc/%d/fd" % pid))


def pct(xs, q):
    xs = sorted(xs)
    return xs[max(0, int(math.ceil(q * len(xs))) - 1)] if xs else float("nan")


class Attack(threading.Thread):
    """Holds slow connections: slot i is (source address, port, kind); kinds "hdr" (a partial
    header), "trickle" (a partial header, then a header byte a second), "body" (complete
    headers, then a body byte a second) and "raw" (nothing sent: the gRPC port). A slot whose
    connection the server closes is reopened at once. Records each connection's life."""

    def __init__(self, slots):
        super().__init__(daemon=True)
        self.slots, self.sel = slots, selectors.DefaultSelector()
        self.socks = [None] * len(slots)
        self.opened_at = [0.0] * len(slots)
        self.stop_ev, self.full = threading.Event(), threading.Event()
        self.lock = threading.Lock()
        self.lives = {"hdr": [], "trickle": [], "body": [], "raw": []}  # seconds, closed by the server
        self.first_closed = [False] * len(slots)  # the slot's first connection was closed
        self.opened, self.open_now, self.errors = 0, 0, 0

    def open_slot(self, i):
        src, port, kind = self.slots[i]
        s = socket.socket()
        s.settimeout(5)
        try:
            s.bind((src, 0))
            s.connect(("127.0.0.1", port))
            if kind in ("hdr", "trickle"):
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Slow: ")
            elif kind == "body":
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 100\r\n\r\n{")
        except OSError:
            s.close()
            with self.lock:
                self.errors += 1
            return
        s.setblocking(False)
        self.sel.register(s, selectors.EVENT_READ, i)
        with self.lock:
            self.socks[i] = s
            self.opened_at[i] = time.time()
            self.opened += 1
            self.open_now += 1

    def run(self):
        for i in range(len(self.slots)):
            self.open_slot(i)
        self.full.set()
        next_byte = time.time() + 1
        while not self.stop_ev.is_set():
            for key, _ in self.sel.select(timeout=0.2):
                i, s = key.data, key.fileobj
                try:
                    if s.recv(4096):
                        continue  # (the server said something: wait for the close)
                except BlockingIOError:
                    continue
                except OSError:
                    pass
                self.sel.unregister(s)
                s.close()
                with self.lock:
                    self.lives[self.slots[i][2]].append(time.time() - self.opened_at[i])
                    self.first_closed[i] = True
                    self.socks[i] = None
                    self.open_now -= 1
                if not self.stop_ev.is_set():
                    self.open_slot(i)
            if time.time() >= next_byte:
                next_byte += 1
                for i, s in enumerate(self.socks):
                    if s is not None and self.slots[i][2] in ("trickle", "body"):
                        try:
                            s.send(b"a")
                        except OSError:
                            pass
        for s in self.socks:
            if s is not None:
                self.sel.unregister(s)
                s.close()

    def oldest_open(self):
        """Seconds since the oldest open connection of an HTTP kind opened (0: none)."""
        now = time.time()
        with self.lock:
            return max([now - self.opened_at[i] for i, s in enumerate(self.socks)
                        if s is not None and self.slots[i][2] != "raw"] or [0])

    def closed_http(self):
        with self.lock:
            return sum(len(self.lives[k]) for k in ("hdr", "trickle", "body"))

    def first_all_closed(self, kinds):
        """Whether the first connection of every slot of these kinds was closed."""
        with self.lock:
            return all(c for c, sl in zip(self.first_closed, self.slots) if sl[2] in kinds)


def hang_up_storm(port, threads=16, per_thread=20):
    """Requests (streamed or not, n 1 or 2) whose clients hang up after 1 - 300 ms, half with
    a reset (SO_LINGER 0), many while their connection waits suspended."""
    def worker(k):
        rng = random.Random(k)
        for _ in range(per_thread):
            body = json.dumps({"prompt": PROMPT, "max_tokens": rng.randint(1, 64), "ignore_eos": True,
                               "stream": rng.random() < 0.6, "n": rng.choice([1, 1, 2])}).encode()
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=10)
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
                s.settimeout(10 ** rng.uniform(-3, -0.5))
                try:
                    while s.recv(65536):
                        pass
                except socket.timeout:
                    pass
                if rng.random() < 0.5:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.close()
            except OSError:
                pass
    ts = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def in_flight(router):
    return eu.Scrape(router.mport).get("pdserve_http_requests_in_flight")


def quiet(router):
    s = eu.Scrape(router.mport)
    return s.get("pdserve_requests_in_flight") == 0 and s.get("pdserve_http_requests_in_flight") == 0


attack = None
keep = []
try:
    common = ["--model", H.model, "--listen", "127.0.0.1:0", "--metrics-port", "0"]
    dec = H.start("pdserve-decode", *common, "--colocated", "--kv-cache-mb", "16", tag="decode",
                  env=dict(H.env, PDSERVE_FAULT_STEP_DELAY_MS="10"))
    inst = ["--decode", "127.0.0.1:%d" % dec.port]
    idle = start_router(*common, *inst, "--http-listen", "127.0.0.1:0", "--http-idle-timeout-s", "1", tag="router-idle")
    # (--http-idle-timeout-s 120: the kept-alive connections of the per-address check stay.)
    door = start_router(*common, *inst, "--http-listen", "127.0.0.1:0", "--http-request-timeout-s", "2",
                        "--http-idle-timeout-s", "120",
                        "--http-per-ip-connections", str(PER_IP), "--http-max-connections", str(MAX_CONNS),
                        "--http-threads", "2", "--shutdown-grace-ms", "0", tag="router-door")
    def health_ok(port):
        s, st = get_health("127.0.0.1", port)
        s.close()
        return st == 200
    for r in (idle, door):
        eu.wait_until(lambda: health_ok(r.hport), 20)
    stub = pbg.GenerationStub(grpc.insecure_channel("127.0.0.1:%d" % door.port))
    sampling = pb.SamplingParams(temperature=0.0)
    ref = eu.generate(pb, stub, timeout=30, prompt=PROMPT, sampling=sampling,
                      stopping=pb.StoppingCriteria(max_tokens=8))[1]
    req = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}

    # ---- the idle timeout spares a connection that waits for tokens ----
    t0 = time.time()
    st, v = completion(idle.hport, {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "temperature": 0}, timeout=120)
    dt = time.time() - t0
    check(st == 200 and isinstance(v, dict) and v["usage"]["completion_tokens"] == 400,
          "--http-idle-timeout-s 1: a plain completion waiting %.1f s for its 400 tokens is answered (%d)" % (dt, st))
    s, st = get_health("127.0.0.1", idle.hport)
    t0 = time.time()
    closed = st == 200 and read_response(s) is None  # (blocks until the server closes, at most 30 s)
    s.close()
    check(closed, "an idle kept-alive connection is closed by the idle timeout (after %.1f s)" % (time.time() - t0))

    # ---- the quiet door: reference latencies ----
    base_fds, base_threads = proc_fds(door.p.pid), proc_threads(door.p.pid)
    lat_http, lat_grpc = [], []
    for _ in range(20):
        t0 = time.time()
        st, v = completion(door.hport, req)
        lat_http.append(time.time() - t0)
        t0 = time.time()
        eu.generate(pb, stub, timeout=10, prompt=PROMPT, sampling=sampling, stopping=pb.StoppingCriteria(max_tokens=8))
        lat_grpc.append(time.time() - t0)
    print("quiet: HTTP p50 %.1f ms p99 %.1f ms; gRPC p50 %.1f ms p99 %.1f ms; router: %d threads, %d fds"
          % (pct(lat_http, .5) * 1e3, pct(lat_http, .99) * 1e3, pct(lat_grpc, .5) * 1e3, pct(lat_grpc, .99) * 1e3,
             base_threads, base_fds), flush=True)

    # ---- 1000 slow HTTP connections and 200 silent gRPC ones ----
    m0 = eu.Scrape(door.mport).get("pdserve_http_request_timeouts_total")
    slots = []
    for i in range(N_SLOW):
        kind = "body" if i % 10 == 0 else "trickle" if i % 5 == 1 else "hdr"
        slots.append(("127.0.0.%d" % (2 + i % 10), door.hport, kind))
    slots += [("127.0.0.14", door.port, "raw")] * N_GRPC_RAW
    attack = Attack(slots)
    attack.start()
    check(attack.full.wait(120), "the slow connections are open (%d opened, %d failed)" % (attack.opened, attack.errors))
    lat_http, lat_grpc, ok_http, ok_grpc, held, threads, fds, conns = [], [], 0, 0, [], [], [], []
    for k in range(30):
        held.append(attack.open_now)
        t0 = time.time()
        try:
            st, v = completion(door.hport, req)
            ok_http += st == 200 and v["choices"][0]["text"] == ref
        except (OSError, http.client.HTTPException, KeyError, TypeError) as e:
            print("HTTP request %d: %r" % (k, e))
        lat_http.append(time.time() - t0)
        t0 = time.time()
        try:
            ok_grpc += eu.generate(pb, stub, timeout=10, prompt=PROMPT, sampling=sampling,
                                   stopping=pb.StoppingCriteria(max_tokens=8))[1] == ref
        except grpc.RpcError as e:
            print("gRPC call %d: %s" % (k, e.code()))
        lat_grpc.append(time.time() - t0)
        threads.append(proc_threads(door.p.pid))
        fds.append(proc_fds(door.p.pid))
        conns.append(eu.Scrape(door.mport).get("pdserve_http_connections"))
    print("held (%d - %d slow connections open on the client side, the router's pdserve_http_connections %d - %d): "
          "HTTP p50 %.1f ms p99 %.1f ms; gRPC p50 %.1f ms p99 %.1f ms"
          % (min(held), max(held), min(conns), max(conns), pct(lat_http, .5) * 1e3, pct(lat_http, .99) * 1e3,
             pct(lat_grpc, .5) * 1e3, pct(lat_grpc, .99) * 1e3), flush=True)
    check(ok_http == 30, "while the slow connections are held: %d of 30 /v1/completions answered with the greedy text" % ok_http)
    check(ok_grpc == 30, "while the slow connections are held: %d of 30 gRPC Generate calls answered with the greedy text" % ok_grpc)
    check(max(threads) < 100, "the router has at most %d threads (< 100; %d before)" % (max(threads), base_threads))
    check(max(fds) <= base_fds + MAX_CONNS + N_GRPC_RAW + 16,
          "the router has at most %d descriptors (<= %d before + --http-max-connections %d + %d gRPC)"
          % (max(fds), base_fds, MAX_CONNS, N_GRPC_RAW))
    check(max(conns) <= MAX_CONNS, "pdserve_http_connections at most %d (<= %d)" % (max(conns), MAX_CONNS))

    # ---- per client address ----
    for _ in range(PER_IP):
        s, st = get_health("127.0.0.12", door.hport)
        keep.append(s)
        if st != 200:
            break
    check(len(keep) == PER_IP and st == 200, "%d kept-alive connections from 127.0.0.12 answered" % len(keep))
    s, st = get_health("127.0.0.12", door.hport)
    keep.append(s)
    check(st is None, "connection %d from 127.0.0.12: closed unanswered (--http-per-ip-connections %d)" % (PER_IP + 1, PER_IP))
    s, st = get_health("127.0.0.13", door.hport)
    keep.append(s)
    check(st == 200, "one from 127.0.0.13 meanwhile: 200")
    s, st = get_health("127.0.0.12", door.hport, keep[0])
    check(st == 200, "a kept-alive one from 127.0.0.12 still serves")

    # ---- the request deadline closed every slow connection ----
    ok = eu.wait_until(lambda: attack.first_all_closed(("hdr", "trickle", "body")), 60)
    oldest = attack.oldest_open()
    with attack.lock:
        lives = {k: list(v) for k, v in attack.lives.items()}
    longest = max(lives["hdr"] + lives["trickle"] + lives["body"] or [0])
    print("closed by the router: %d partial headers, %d header tricklers, %d body tricklers (lives %.1f - %.1f s, "
          "--http-request-timeout-s 2)" % (len(lives["hdr"]), len(lives["trickle"]), len(lives["body"]),
                                            min(lives["hdr"] + lives["trickle"] + lives["body"] or [0]), longest), flush=True)
    check(ok and len(lives["trickle"]) >= N_SLOW // 5 and len(lives["body"]) >= N_SLOW // 10,
          "every slow connection was closed by the router (%d in all)" % attack.closed_http())
    check(longest <= 30 and oldest <= 30, "each within 30 s of opening (longest %.1f s, oldest still open %.1f s)" % (longest, oldest))
    m = eu.Scrape(door.mport).get("pdserve_http_request_timeouts_total") - m0
    check(m >= N_SLOW, "pdserve_http_request_timeouts_total counts them (%d)" % m)
    ok = eu.wait_until(lambda: attack.first_all_closed(("raw",)), 60)
    with attack.lock:
        raw = list(attack.lives["raw"])
    check(ok, "the %d silent gRPC connections are closed by the gRPC server's handshake timeout (10 s; lives %.1f - %.1f s)"
          % (N_GRPC_RAW, min(raw or [0]), max(raw or [0])))
    attack.stop_ev.set()
    attack.join(30)
    for s in keep:
        s.close()
    keep = []
    check(eu.wait_until(lambda: proc_fds(door.p.pid) <= base_fds + 8, 30),
          "the connections gone, the router's descriptors are back (%d, %d before)" % (proc_fds(door.p.pid), base_fds))
    check(eu.wait_until(lambda: quiet(door) and quiet(idle), 10), "nothing in flight")
    st, v = completion(door.hport, req)
    check(st == 200 and v["choices"][0]["text"] == ref, "the door still answers")

    # ---- hang-ups by the hundred; SIGTERM with requests waiting for tokens ----
    hang_up_storm(door.hport)
    check(eu.wait_until(lambda: quiet(door), 10), "320 requests hung up at random times (streamed or not, FIN or "
          "reset): nothing left in flight")
    check(eu.wait_until(lambda: eu.Scrape(dec.mport).get("pdserve_kv_cache_used_blocks") == 0, 10),
          "the decode instance's KV blocks are free")
    for i in range(10):
        s = socket.create_connection(("127.0.0.1", door.hport), timeout=10)
        body = json.dumps({"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": i % 2 == 0}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        keep.append(s)
    check(eu.wait_until(lambda: in_flight(door) == 10, 10), "10 requests in flight when SIGTERM comes "
          "(--shutdown-grace-ms 0: their calls are cancelled, their suspended connections resumed and closed)")
    H.stop()
finally:
    if attack is not None:
        attack.stop_ev.set()
    for s in keep:
        s.close()
    H.kill_all()
H.finish()
