#!/usr/bin/python3
"""test_deploy_netns.py -- The Kubernetes manifests run as processes: each pod of the kustomize
base (router x1, prefill x2, decode x2) gets its own network namespace on a bridge, and its
container's command and environment exactly as the manifests give them (ConfigMap envFrom,
env, $(POD_NAME), fieldRefs), with these substitutions only: the image path /usr/local/bin
-> the build's bin/, PDSERVE_MODEL -> the shared tiny model, PDSERVE_BACKEND=cpu, a 32 MiB
KV cache, a 300 ms health drain, and UCX over tcp on eth0 (namespaces do not isolate shared
memory). Services become /etc/netns/<ns>/hosts entries: a headless Service resolves to every
pod of its Deployment, the router's ClusterIP Service to the router pod. Then, as a cluster
would: the startup probes (gRPC health on the probe port) pass, a client reaches the router
through its Service name and port and gets the golden text, Prometheus scrapes every pod on
the ServiceMonitor's port, the series the HPAs and the adapter rules need are there, the
router sees both pods of each headless Service, the KV transport is tcp, and SIGTERM ends
every pod with exit 0 within its terminationGracePeriodSeconds. Skips (77) where network
namespaces cannot be made.

usage: test_deploy_netns.py BIN_DIR DEPLOY_DIR SHARED_DIR"""
import json, os, shutil, signal, subprocess, sys, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deploy_util as du
import e2e_util as eu

BIN, DEPLOY, SHARED = sys.argv[1], sys.argv[2], sys.argv[3]
MODEL = os.path.join(SHARED, "models", "stories260k")
if not os.path.isdir(MODEL):
    eu.skip("no shared data")
yaml = du.load_yaml()
P = "pdk%d" % os.getpid()
REPLICAS = {"pdserve-router": 1, "pdserve-prefill": 2, "pdserve-decode": 2}
OVERRIDE = {"PDSERVE_MODEL": MODEL, "PDSERVE_BACKEND": "cpu", "PDSERVE_KV_CACHE_MB": "32",
            "PDSERVE_HEALTH_DRAIN_MS": "300", "UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0",
            "UCX_WARN_UNUSED_ENV_VARS": "n", "PDSERVE_PREFILL_POLICY": "remote"}
failures = 0
nss, procs = [], {}
TMP = None

def check(cond, what):
    global failures
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        failures += 1

def sh(*args, check_rc=True):
    r = subprocess.run(list(args), capture_output=True, text=True)
    if check_rc and r.returncode != 0:
        raise RuntimeError("%s: %s" % (" ".join(args), r.stderr.strip()))
    return r

def in_ns(ns, *args, timeout=30):
    return subprocess.run(["ip", "netns", "exec", ns] + list(args), capture_output=True, text=True, timeout=timeout)

def cleanup():
    for p, _ in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()
    for ns in nss:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        shutil.rmtree("/etc/netns/" + ns, ignore_errors=True)
    if TMP and not failures:
        shutil.rmtree(TMP, ignore_errors=True)

if os.geteuid() != 0 or subprocess.run(["ip", "netns", "add", P + "-hub"], capture_output=True).returncode != 0:
    eu.skip("cannot create network namespaces")
nss.append(P + "-hub")
try:
    import tempfile
    TMP = tempfile.mkdtemp(prefix="pdserve-deploy-")
    docs = du.read_dir(os.path.join(DEPLOY, "k8s", "base"))
    deps = {d["metadata"]["name"]: d for d in du.by_kind(docs, "Deployment")}
    # Pods and their addresses.
    pods = []  # (pod name, deployment name, ip)
    n = 0
    for dn in ("pdserve-prefill", "pdserve-decode", "pdserve-router"):
        for i in range(REPLICAS[dn]):
            n += 1
            pods.append(("%s-%d" % (dn, i), dn, "10.91.0.%d" % (10 + n)))
    client_ip = "10.91.0.200"
    if sh("ip", "-n", P + "-hub", "link", "add", "br0", "type", "bridge", check_rc=False).returncode != 0:
        eu.skip("no bridge support")
    sh("ip", "-n", P + "-hub", "link", "set", "br0", "up")
    # /etc/hosts of every namespace: Services as the cluster DNS would answer them.
    hosts = ["127.0.0.1 localhost"]
    for s in du.by_kind(docs, "Service"):
        for pn, dn, ip in pods:
            if du.selector_matches(s["spec"]["selector"], deps[dn]["spec"]["template"]["metadata"]["labels"]):
                hosts.append("%s %s" % (ip, s["metadata"]["name"]))
    for k, (name, ip) in enumerate([(p[0], p[2]) for p in pods] + [("client", client_ip)]):
        ns = "%s-%d" % (P, k)
        nss.append(ns)
        sh("ip", "netns", "add", ns)
        v, h = "v%s%d" % (P, k), "h%s%d" % (P, k)
        if sh("ip", "link", "add", v, "type", "veth", "peer", "name", h, check_rc=False).returncode != 0:
            eu.skip("no veth support")
        sh("ip", "link", "set", v, "netns", ns)
        sh("ip", "link", "set", h, "netns", P + "-hub")
        sh("ip", "-n", ns, "link", "set", v, "name", "eth0")
        sh("ip", "-n", ns, "addr", "add", ip + "/24", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", P + "-hub", "link", "set", h, "master", "br0")
        sh("ip", "-n", P + "-hub", "link", "set", h, "up")
        os.makedirs("/etc/netns/" + ns, exist_ok=True)
        with open("/etc/netns/%s/hosts" % ns, "w") as f:
            f.write("\n".join(hosts + ["%s %s" % (ip, name)]) + "\n")
    CLIENT = "%s-%d" % (P, len(pods))
    ns_of = {p[0]: "%s-%d" % (P, k) for k, p in enumerate(pods)}

    def health(ip, port):
        r = in_ns(CLIENT, os.path.join(BIN, "pdserve-cli"), "health", "--addr", "%s:%d" % (ip, port), timeout=10)
        return r.returncode == 0 and "NOT_SERVING" not in r.stdout and "SERVING" in r.stdout

    def start_pod(pn, dn, ip):
        c = deps[dn]["spec"]["template"]["spec"]["containers"][0]
        env = du.container_env(docs, c, pod_name=pn, pod_ip=ip)
        env.update(OVERRIDE)
        env["PATH"] = os.environ.get("PATH", "/usr/bin:/bin")
        cmd = [c["command"][0].replace("/usr/local/bin", BIN)] + c.get("args", [])
        log = open(os.path.join(TMP, pn + ".log"), "w")
        p = subprocess.Popen(["ip", "netns", "exec", ns_of[pn]] + cmd, env=env, stdout=subprocess.PIPE,
                             stderr=log, text=True)
        procs[pn] = (p, c)
        # The startup probe: gRPC health on the probe's port, every periodSeconds.
        sp = c["startupProbe"]
        t0 = time.time()
        limit = min(sp.get("periodSeconds", 10) * sp.get("failureThreshold", 3), 60)
        while time.time() - t0 < limit and p.poll() is None:
            if health(ip, sp["grpc"]["port"]):
                return True
            time.sleep(0.2)
        print(open(log.name).read()[-2000:])
        return False

    for pn, dn, ip in pods:  # prefill and decode first: the router resolves them at start
        check(start_pod(pn, dn, ip), "%s (%s): started from the manifest, startup probe passes" % (pn, ip))

    # A request through the router's Service, as a client in the cluster sends it.
    rs = du.find(docs, "Service", "pdserve-router")
    port = [p["port"] for p in rs["spec"]["ports"] if p["name"] == "grpc"][0]
    want = json.load(open(os.path.join(MODEL, "golden.json")))["cases"][1]["greedy_text"].strip()
    ok = 0
    for _ in range(4):
        r = in_ns(CLIENT, os.path.join(BIN, "pdserve-cli"), "generate", "--addr", "pdserve-router:%d" % port,
                  "--temperature", "0", "--max-tokens", "80", "--timeout-ms", "20000", "--json", "Once upon a time")
        if r.returncode == 0 and json.loads(r.stdout)["text"].strip() == want:
            ok += 1
        else:
            print(r.stdout[-300:], r.stderr[-500:])
    check(ok == 4, "4 requests through Service pdserve-router:%d give the golden text (%d ok)" % (port, ok))

    # Prometheus: every pod on the ServiceMonitor's port, through each Service's targetPort.
    sm = du.by_kind(docs, "ServiceMonitor")[0]
    ep = sm["spec"]["endpoints"][0]
    adapter = yaml.safe_load(open(os.path.join(DEPLOY, "k8s", "monitoring", "prometheus-adapter-rules.yaml")))
    hpa_metric = {h["spec"]["scaleTargetRef"]["name"]: [m["pods"]["metric"]["name"] for m in h["spec"]["metrics"]
                                                        if m["type"] == "Pods"]
                  for h in du.by_kind(docs, "HorizontalPodAutoscaler")}
    scrapes = {}
    for pn, dn, ip in pods:
        c = procs[pn][1]
        svc = [s for s in du.by_kind(docs, "Service")
               if du.selector_matches(s["spec"]["selector"], deps[dn]["spec"]["template"]["metadata"]["labels"])][0]
        tp = [p["targetPort"] for p in svc["spec"]["ports"] if p["name"] == ep["port"]][0]
        cport = [p["containerPort"] for p in c["ports"] if p["name"] == tp][0]
        r = in_ns(CLIENT, "/usr/bin/python3", "-c", "import urllib.request,sys; sys.stdout.write(urllib.request."
                  "urlopen('http://%s:%d%s', timeout=10).read().decode())" % (ip, cport, ep["path"]))
        try:
            scrapes[pn] = eu.parse(r.stdout)[0]
        except ValueError as e:
            scrapes[pn] = {}
            print(e)
        role = dn.split("-")[1]
        has = lambda name: any(k[0] == name for k in scrapes[pn])
        check(r.returncode == 0 and any(k[0] == "pdserve_build_info" and ("role", role) in k[1] for k in scrapes[pn]),
              "%s: /metrics on %s:%d (%d series, role %s)" % (pn, ip, cport, len(scrapes[pn]), role))
        need = hpa_metric.get(dn, [])
        if need:
            check(all(has(m) for m in need), "%s: the HPA's pod metrics %s are exported" % (pn, need))
    rt = scrapes["pdserve-router-0"]
    ups = [(dict(k[1]), v) for k, v in rt.items() if k[0] == "pdserve_router_instance_up"]
    check(len(ups) == 4 and all(v == 1 for _, v in ups),
          "router: both pods behind each headless Service are up (%s)" % sorted(l["addr"] for l, _ in ups))
    ext = [r["seriesQuery"].split("{")[0].strip("'") for r in adapter.get("externalRules", [])]
    check(all(any(k[0] == s for k in rt) for s in ext), "router: the adapter's external series %s exist" % ext)
    tr = [dict(k[1]).get("transport") for pn in ("pdserve-decode-0", "pdserve-decode-1")
          for k in scrapes[pn] if k[0] == "pdserve_kv_transport_info"]
    check(tr and all(t == "tcp" for t in tr), "decode pods: KV transport tcp across the namespaces %s" % tr)
    served = sum(v for pn in ("pdserve-decode-0", "pdserve-decode-1") for k, v in scrapes[pn].items()
                 if k[0] == "pdserve_requests_total" and ("outcome", "ok") in k[1])
    check(served == 4, "decode pods served the 4 requests between them (%d)" % served)

    # Termination: SIGTERM, exit 0 within terminationGracePeriodSeconds (router first).
    for pn in ["pdserve-router-0"] + [p[0] for p in pods if p[1] != "pdserve-router"]:
        p, c = procs[pn]
        dn = pn.rsplit("-", 1)[0]
        tgp = deps[dn]["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)
        t0 = time.time()
        p.send_signal(signal.SIGTERM)
        try:
            rc = p.wait(tgp)
        except subprocess.TimeoutExpired:
            rc = None
        check(rc == 0, "%s: SIGTERM -> exit %s in %.1f s (grace %d s)" % (pn, rc, time.time() - t0, tgp))
finally:
    cleanup()
    if failures and TMP:
        for f in sorted(os.listdir(TMP)):
            print("--- " + f)
            print(open(os.path.join(TMP, f)).read()[-2000:])

print("%d failures" % failures)
sys.exit(1 if failures else 0)
