"""e2e_util.py -- Helpers shared by the end-to-end tests written after test_stack.py: compile
the protos for grpcio, start pdserve processes and read their "PORT n" / "METRICS_PORT n"
lines, generate through the public API, and scrape /metrics into a dict (parsed by
prometheus_client's text parser when it is installed, a parser nobody here wrote)."""
import os, re, subprocess, sys, tempfile, urllib.request

def skip(why):
    print(why + ": skip")
    sys.exit(77)

def setup(proto_dir):
    """Compiles the protos into a temp dir; returns (tmp, pb, pbg, ipb, ipbg, hpb)."""
    try:
        import grpc  # noqa: F401
    except ImportError:
        skip("python3-grpcio missing")
    tmp = tempfile.mkdtemp(prefix="pdserve-e2e-")
    plugin = subprocess.check_output(["which", "grpc_python_plugin"]).decode().strip()
    subprocess.check_call(["protoc", "-I" + proto_dir, "--python_out=" + tmp, "--grpc_python_out=" + tmp,
                           "--plugin=protoc-gen-grpc_python=" + plugin,
                           "pdserve/v1/generation.proto", "pdserve/internal/v1/kv.proto",
                           "pdserve/internal/v1/instance.proto", "pdserve/internal/v1/decode.proto",
                           "pdserve/internal/v1/prefill.proto", "grpc/health/v1/health.proto"], cwd=proto_dir)
    sys.path.insert(0, tmp)
    from pdserve.v1 import generation_pb2 as pb, generation_pb2_grpc as pbg
    from pdserve.internal.v1 import instance_pb2 as ipb, instance_pb2_grpc as ipbg
    import importlib.util
    spec = importlib.util.spec_from_file_location("pd_health_pb2", os.path.join(tmp, "grpc/health/v1/health_pb2.py"))
    hpb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hpb)  # "grpc.health" would clash with grpcio's package
    return tmp, pb, pbg, ipb, ipbg, hpb

class Proc:
    """A started service: .p (Popen), .port, .mport (metrics port or None), .log (path)."""
    def __init__(self, p, port, mport, log):
        self.p, self.port, self.mport, self.log = p, port, mport, log

def start(bin_dir, tmp, name, args, env, tag=None, want_metrics=False):
    log = os.path.join(tmp, (tag or name) + ".log")
    p = subprocess.Popen([os.path.join(bin_dir, name)] + list(args), stdout=subprocess.PIPE,
                         stderr=open(log, "w"), env=env, text=True)
    line = p.stdout.readline()
    if not line.startswith("PORT "):
        raise SystemExit("%s did not start: %s" % (name, open(log).read()[-2000:]))
    port, mport = int(line.split()[1]), None
    if want_metrics:
        line = p.stdout.readline()
        if not line.startswith("METRICS_PORT "):
            raise SystemExit("%s printed no METRICS_PORT: %r %s" % (name, line, open(log).read()[-2000:]))
        mport = int(line.split()[1])
    return Proc(p, port, mport, log)

def generate(pb, stub, timeout=60, **kw):
    """Returns (token ids, text, finish reason, usage)."""
    ids, text, fin, usage = [], "", 0, None
    for r in stub.Generate(pb.GenerateRequest(**kw), timeout=timeout):
        ids += list(r.token_ids)
        text += r.text
        if r.finish_reason:
            fin, usage = r.finish_reason, r.usage
    return ids, text, fin, usage

def http_get(port, path="/metrics", host="127.0.0.1"):
    """Returns (status, content type, body text)."""
    try:
        with urllib.request.urlopen("http://%s:%d%s" % (host, port, path), timeout=10) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read().decode()

_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

def parse(text):
    """Parses the exposition text into {(sample name, frozenset(labels.items())): value} and
    {family: type}; raises ValueError on a malformed line."""
    samples, types = {}, {}
    for line in text.splitlines():
        if not line:
            continue
        if line.startswith("# TYPE "):
            _, _, name, t = line.split(" ", 3)
            types[name] = t
            continue
        if line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            raise ValueError("malformed sample line: %r" % line)
        labels = frozenset(_LABEL.findall(m.group(3) or ""))
        key = (m.group(1), labels)
        if key in samples:
            raise ValueError("duplicate series: %r" % line)
        samples[key] = float(m.group(4))
    try:  # a second opinion from the Prometheus project's own parser
        from prometheus_client.parser import text_string_to_metric_families
        n = sum(len(f.samples) for f in text_string_to_metric_families(text))
        if n != len(samples):
            raise ValueError("prometheus_client parsed %d samples, we %d" % (n, len(samples)))
    except ImportError:
        pass
    return samples, types

class Scrape:
    """One scrape of a service: .get(name, **labels) sums the matching samples."""
    def __init__(self, port, host="127.0.0.1"):
        status, ctype, body = http_get(port, "/metrics", host)
        if status != 200:
            raise ValueError("GET /metrics -> %d" % status)
        self.ctype, self.text = ctype, body
        self.samples, self.types = parse(body)

    def get(self, name, **labels):
        want = set(labels.items())
        return sum(v for (n, l), v in self.samples.items() if n == name and want <= set(l))

    def has(self, name, **labels):
        want = set(labels.items())
        return any(n == name and want <= set(l) for (n, l) in self.samples)

    def series(self, name):
        return [(dict(l), v) for (n, l), v in self.samples.items() if n == name]

class Harness:
    """What the end-to-end tests of a stack share: argv (BIN_DIR SHARED_DIR PROTO_DIR), the
    stories260k model (skip without it), the compiled protos, the started processes, and the
    check / finish reporting. h.pb, h.pbg, h.ipb, h.ipbg, h.hpb are the generated modules."""
    def __init__(self, argv, log_level="info"):
        self.bin, self.shared, self.proto = argv[1], argv[2], argv[3]
        self.model = os.path.join(self.shared, "models", "stories260k")
        if not os.path.isdir(self.model):
            skip("no shared data")
        self.tmp, self.pb, self.pbg, self.ipb, self.ipbg, self.hpb = setup(self.proto)
        # Routers send every prompt to a prefill instance (the transfer path under test), even
        # short ones, which --prefill-policy auto would compute on the decode instance.
        self.env = dict(os.environ, UCX_WARN_UNUSED_ENV_VARS="n", PDSERVE_LOG_LEVEL=log_level,
                        PDSERVE_PREFILL_POLICY="remote")
        self.procs, self.failures = [], 0

    def check(self, cond, what):
        print(("ok   " if cond else "FAIL ") + what, flush=True)
        if not cond:
            self.failures += 1

    def start(self, name, *args, tag=None, env=None):
        """Starts a service with /metrics (pass --metrics-port 0 in args)."""
        p = start(self.bin, self.tmp, name, list(args), env or self.env, tag=tag, want_metrics=True)
        self.procs.append(p)
        return p

    def load(self, p):
        import grpc
        with grpc.insecure_channel("127.0.0.1:%d" % p.port) as ch:
            return self.ipbg.InstanceStub(ch).LoadReport(self.ipb.LoadReportRequest(), timeout=5)

    def health(self, p):
        import grpc
        with grpc.insecure_channel("127.0.0.1:%d" % p.port) as ch:
            h = ch.unary_unary("/grpc.health.v1.Health/Check",
                               request_serializer=self.hpb.HealthCheckRequest.SerializeToString,
                               response_deserializer=self.hpb.HealthCheckResponse.FromString)
            return h(self.hpb.HealthCheckRequest(service=""), timeout=2).status

    def stop(self, ps=None):
        """SIGTERM, then each must exit 0 (under ASan a leak or memory error makes it not)."""
        ps = self.procs if ps is None else ps
        for p in ps:
            if p.p.poll() is None:
                p.p.terminate()
        for p in ps:
            try:
                rc = p.p.wait(timeout=60)
            except Exception:
                p.p.kill()
                rc = "hung"
            self.check(rc == 0, "%s exits 0 after SIGTERM (got %s)" % (os.path.basename(p.log), rc))

    def kill_all(self):
        for p in self.procs:
            if p.p.poll() is None:
                p.p.kill()
                p.p.wait()

    def finish(self):
        print("%d failures" % self.failures)
        sys.exit(1 if self.failures else 0)

def wait_until(cond, seconds):
    """Polls cond (exceptions count as False) until it holds or seconds pass."""
    import time
    t0 = time.time()
    while time.time() - t0 < seconds:
        try:
            if cond():
                return True
        except Exception:
            pass
        time.sleep(0.05)
    try:
        return cond()
    except Exception:
        return False
