#!/usr/bin/python3
"""test_deploy.py -- deploy/k8s checked offline against the real binaries: every document
well-formed for its kind; Deployment selectors match their pod labels; each container runs
one of the three binaries, and every PDSERVE_* variable it gets (env and envFrom ConfigMaps)
is one that binary's --help lists, with a value its flag parser accepts (the binary is run
with that environment and --help); ports agree with --listen / --metrics-port; gRPC probes
(startup, readiness, liveness) hit the gRPC port; terminationGracePeriodSeconds covers the
health drain plus the shutdown grace; GPU requests on prefill and decode only; Services,
headless Services, PodDisruptionBudgets, HPAs and the ServiceMonitor point at what exists;
the router's --prefill/--decode name the headless Services; the HPAs' custom metrics are
served by the prometheus-adapter rules. The example and TLS overlays are checked the same way
after `kubectl kustomize` where kubectl is installed (their files are parsed either way). The
tensor-parallel decode overlay is merged onto the base here (and must equal kubectl's
rendering where kubectl is installed) and checked the same way, plus: nvidia.com/gpu =
--tensor-parallel on every prefill and decode pod, the degree > 1 on decode only, the KV pool,
CPU, memory and /dev/shm scaled up, the decode HPA within the base's GPUs.

usage: test_deploy.py BIN_DIR DEPLOY_DIR"""
import os, re, subprocess, sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deploy_util as du

BIN, DEPLOY = sys.argv[1], sys.argv[2]
yaml = du.load_yaml()
failures = 0

def check(cond, what):
    global failures
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        failures += 1

KINDS = {("v1", "ConfigMap"), ("v1", "Service"), ("v1", "Namespace"), ("v1", "PersistentVolumeClaim"),
         ("apps/v1", "Deployment"), ("policy/v1", "PodDisruptionBudget"),
         ("autoscaling/v2", "HorizontalPodAutoscaler"), ("monitoring.coreos.com/v1", "ServiceMonitor")}
DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
ROLES = {"pdserve-router": "router", "pdserve-prefill": "prefill", "pdserve-decode": "decode"}
HELP = {b: du.help_env_vars(BIN, b) for b in ROLES}
check(all(len(v) > 15 for v in HELP.values()), "--help of the three binaries lists their variables (%s)" %
      ", ".join("%s %d" % (b, len(v)) for b, v in HELP.items()))

adapter = yaml.safe_load(open(os.path.join(DEPLOY, "k8s", "monitoring", "prometheus-adapter-rules.yaml")))
def series_name(q):
    return re.match(r"\s*'?([a-zA-Z_:][a-zA-Z0-9_:]*)", q).group(1)
ADAPTER_PODS = {series_name(r["seriesQuery"]) for r in adapter.get("rules", [])}
ADAPTER_EXT = {r["name"]["as"] for r in adapter.get("externalRules", [])}

CLI_FLAGS = set(re.findall(r"^  (--[a-z-]+)", subprocess.run([os.path.join(BIN, "pdserve-cli"), "generate", "--help"],
                                                            capture_output=True, text=True).stdout, re.M))

def as_int(v):
    try:
        return int(v)
    except (TypeError, ValueError):
        return None

def gib(q):
    """A memory quantity (Ki, Mi, Gi, Ti or bytes) in GiB."""
    m = re.match(r"^(\d+)(Ki|Mi|Gi|Ti)?$", str(q))
    return int(m.group(1)) * {"Ki": 2**-20, "Mi": 2**-10, "Gi": 1, "Ti": 2**10, None: 2**-30}[m.group(2)]

def probe_port(p, pd, c):
    """The gRPC port a probe checks: a gRPC probe (plaintext only: Kubernetes' gRPC probes
    cannot speak TLS), or with TLS an exec of pdserve-cli health --addr 127.0.0.1:PORT whose
    TLS flags exist and whose files the container mounts; None otherwise."""
    if "grpc" in p:
        return None if pd.get("PDSERVE_TLS_CERT") else p["grpc"].get("port")
    cmd = p.get("exec", {}).get("command", [])
    if not pd.get("PDSERVE_TLS_CERT") or cmd[:2] != ["/usr/local/bin/pdserve-cli", "health"] or "--addr" not in cmd:
        return None
    flags = [a for a in cmd[2:] if a.startswith("--")]
    vals = dict(zip(cmd[2::2], cmd[3::2]))
    mounts = [m["mountPath"].rstrip("/") + "/" for m in c.get("volumeMounts", [])]
    files = [vals[f] for f in ("--tls-ca", "--tls-cert", "--tls-key") if f in vals]
    if not set(flags) <= CLI_FLAGS or "--tls-ca" not in vals or not all(any(f.startswith(m) for m in mounts) for f in files):
        return None
    if pd.get("PDSERVE_TLS_CLIENT_CA") and "--tls-cert" not in vals:
        return None  # mutual TLS: the probe needs a client certificate
    return int(vals["--addr"].rsplit(":", 1)[1])

def check_set(docs, what):
    kinds = {(d.get("apiVersion"), d.get("kind")) for d in docs}
    check(kinds <= KINDS, "%s: %d documents of known kinds %s" % (what, len(docs), sorted(k for _, k in kinds - KINDS) or ""))
    names = [(d["kind"], d["metadata"]["name"]) for d in docs]
    check(len(names) == len(set(names)) and all(DNS1123.match(n) and len(n) <= 63 for _, n in names),
          "%s: names unique and DNS-1123" % what)
    deps = du.by_kind(docs, "Deployment")
    svcs = du.by_kind(docs, "Service")
    check(sorted(d["metadata"]["name"] for d in deps) == ["pdserve-decode", "pdserve-prefill", "pdserve-router"],
          "%s: router, prefill and decode Deployments" % what)
    images = set()
    pod_of = {}  # deployment name -> (pod labels, container, env)
    for d in deps:
        n = d["metadata"]["name"]
        spec = d["spec"]
        tpl = spec["template"]
        labels = tpl["metadata"]["labels"]
        check(du.selector_matches(spec["selector"]["matchLabels"], labels), "%s %s: selector matches its pod labels" % (what, n))
        cs = tpl["spec"]["containers"]
        check(len(cs) == 1, "%s %s: one container" % (what, n))
        c = cs[0]
        images.add(c["image"])
        binary = os.path.basename(c["command"][0])
        check(binary in ROLES and c["command"][0] == "/usr/local/bin/" + binary and n == binary,
              "%s %s: runs %s from the image" % (what, n, c["command"][0]))
        env = du.container_env(docs, c, pod_name=n + "-0")
        pd = {k: v for k, v in env.items() if k.startswith("PDSERVE_")}
        unknown = sorted(set(pd) - HELP.get(binary, set()))
        check(not unknown, "%s %s: all %d PDSERVE_* variables are flags of %s %s" % (what, n, len(pd), binary, unknown or ""))
        run = subprocess.run([os.path.join(BIN, binary), "--help"], env=dict(pd, PATH=os.environ.get("PATH", "")),
                             capture_output=True, text=True)
        check(run.returncode == 0, "%s %s: %s accepts every value (%s)" % (what, n, binary,
              (run.stderr.strip().splitlines() or ["ok"])[-1][:120]))
        ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
        listen_port = int(pd.get("PDSERVE_LISTEN", ":0").rsplit(":", 1)[1])
        check(ports.get("grpc") == listen_port and ports.get("metrics") == int(pd.get("PDSERVE_METRICS_PORT", -1)),
              "%s %s: ports grpc %s = --listen, metrics %s = --metrics-port" % (what, n, ports.get("grpc"), ports.get("metrics")))
        if binary == "pdserve-router" and pd.get("PDSERVE_HTTP_LISTEN"):
            hport = int(pd["PDSERVE_HTTP_LISTEN"].rsplit(":", 1)[1])
            check(ports.get("http") == hport and not pd.get("PDSERVE_TLS_CERT"),
                  "%s %s: the OpenAI HTTP API (--http-listen) is port http %s, without TLS on gRPC"
                  % (what, n, ports.get("http")))
        probes = [c.get(k) for k in ("startupProbe", "readinessProbe", "livenessProbe")]
        check(all(p and probe_port(p, pd, c) == ports.get("grpc") for p in probes),
              "%s %s: startup, readiness and liveness probes are gRPC health checks on %s%s" % (
                  what, n, ports.get("grpc"), " (pdserve-cli over TLS)" if pd.get("PDSERVE_TLS_CERT") else ""))
        tls_files = [v for k, v in pd.items() if k.startswith(("PDSERVE_TLS_", "PDSERVE_INTERNAL_TLS_")) and k != "PDSERVE_TLS_SERVER_NAME"]
        secret_mounts = {m["mountPath"] for m in c.get("volumeMounts", []) for vol in tpl["spec"].get("volumes", [])
                         if vol["name"] == m["name"] and "secret" in vol}
        check(all(any(f.startswith(m.rstrip("/") + "/") for m in secret_mounts) for f in tls_files),
              "%s %s: TLS files %s are on mounted Secrets" % (what, n, tls_files or "(none)"))
        drain_s = (int(pd.get("PDSERVE_HEALTH_DRAIN_MS", 0)) + int(pd.get("PDSERVE_SHUTDOWN_GRACE_MS", 30000))) / 1000
        tgp = tpl["spec"].get("terminationGracePeriodSeconds", 30)
        check(tgp >= drain_s + 5, "%s %s: terminationGracePeriodSeconds %d >= drain %.0f s + 5" % (what, n, tgp, drain_s))
        res = c.get("resources", {})
        gpu = res.get("limits", {}).get("nvidia.com/gpu"), res.get("requests", {}).get("nvidia.com/gpu")
        if ROLES[binary] == "router":
            check(gpu == (None, None), "%s %s: no GPU" % (what, n))
        else:
            # the ranks take GPUs --device .. --device + N - 1: exactly the pod's GPUs
            tp = as_int(pd.get("PDSERVE_TENSOR_PARALLEL", "1"))
            check(gpu[0] is not None and gpu[0] == gpu[1] and as_int(gpu[0]) == tp and
                  as_int(pd.get("PDSERVE_DEVICE", "0")) == 0 and pd.get("PDSERVE_BACKEND") == "auto",
                  "%s %s: nvidia.com/gpu %s requested = limited = --tensor-parallel %s from --device 0, --backend auto" % (
                      what, n, gpu[0], tp))
        mounts = {m["mountPath"] for m in c.get("volumeMounts", [])}
        check(any(pd.get("PDSERVE_MODEL", "").startswith(m.rstrip("/") + "/") for m in mounts),
              "%s %s: --model %s is on a mounted volume" % (what, n, pd.get("PDSERVE_MODEL")))
        pod_of[n] = (labels, c, pd, ports)
    check(len(images) == 1, "%s: one image for every role %s" % (what, sorted(images)))

    # Services select exactly one Deployment's pods and name its ports.
    svc_target = {}
    for s in svcs:
        n = s["metadata"]["name"]
        hits = [dn for dn, (labels, _, _, _) in pod_of.items() if du.selector_matches(s["spec"].get("selector"), labels)]
        ok = len(hits) == 1 and all(p.get("targetPort") in pod_of[hits[0]][3] for p in s["spec"]["ports"])
        check(ok, "%s Service %s: selects %s, its target ports exist" % (what, n, hits))
        if len(hits) == 1:
            svc_target[n] = hits[0]
    for role in ("prefill", "decode"):
        s = du.find(docs, "Service", "pdserve-" + role)
        check(s is not None and s["spec"].get("clusterIP") == "None", "%s: pdserve-%s Service is headless" % (what, role))
    # The router finds the pools through those Services, at their gRPC ports.
    renv = pod_of["pdserve-router"][2]
    for flag, role in (("PDSERVE_PREFILL", "prefill"), ("PDSERVE_DECODE", "decode")):
        ok = True
        for addr in renv.get(flag, "").split(","):
            host, port = addr.rsplit(":", 1)
            s = du.find(docs, "Service", host)
            sp = [p for p in (s or {}).get("spec", {}).get("ports", []) if p["port"] == int(port)]
            ok = ok and s is not None and svc_target.get(host) == "pdserve-" + role and len(sp) == 1 and \
                sp[0]["targetPort"] == "grpc"
        check(ok and renv.get(flag), "%s router: %s=%s names the headless %s Service's gRPC port" % (what, flag, renv.get(flag), role))

    for p in du.by_kind(docs, "PodDisruptionBudget"):
        hits = [dn for dn, v in pod_of.items() if du.selector_matches(p["spec"]["selector"]["matchLabels"], v[0])]
        check(len(hits) == 1 and ("maxUnavailable" in p["spec"]) != ("minAvailable" in p["spec"]),
              "%s PDB %s: covers %s" % (what, p["metadata"]["name"], hits))
    check(len(du.by_kind(docs, "PodDisruptionBudget")) == 3, "%s: a PDB per Deployment" % what)

    hpas = {h["spec"]["scaleTargetRef"]["name"]: h for h in du.by_kind(docs, "HorizontalPodAutoscaler")}
    check(sorted(hpas) == ["pdserve-decode", "pdserve-prefill"], "%s: HPAs for prefill and decode only" % what)
    for tname, h in hpas.items():
        sp = h["spec"]
        pods = [m["pods"]["metric"]["name"] for m in sp["metrics"] if m["type"] == "Pods"]
        ext = [m["external"]["metric"]["name"] for m in sp["metrics"] if m["type"] == "External"]
        check(tname in pod_of and sp["scaleTargetRef"]["kind"] == "Deployment" and 1 <= sp["minReplicas"] <= sp["maxReplicas"]
              and set(pods) <= ADAPTER_PODS and set(ext) <= ADAPTER_EXT and pods,
              "%s HPA %s: metrics %s served by the adapter rules" % (what, tname, pods + ext))
    check(any("queued" in m for m in [x["pods"]["metric"]["name"] for x in hpas["pdserve-prefill"]["spec"]["metrics"] if x["type"] == "Pods"])
          and {"pdserve_kv_cache_usage_ratio", "pdserve_sequences_running"} <= {x["pods"]["metric"]["name"]
          for x in hpas["pdserve-decode"]["spec"]["metrics"] if x["type"] == "Pods"},
          "%s: prefill scales on queued tokens (+ TTFT), decode on KV usage and running sequences" % what)

    sms = du.by_kind(docs, "ServiceMonitor")
    check(len(sms) == 1, "%s: one ServiceMonitor" % what)
    for sm in sms:
        sel = [s for s in svcs if du.selector_matches(sm["spec"]["selector"]["matchLabels"], s["metadata"].get("labels", {}))]
        ports = {e["port"] for e in sm["spec"]["endpoints"]}
        ok = len(sel) == 3 and all(ports <= {p["name"] for p in s["spec"]["ports"]} for s in sel) and \
            all(e.get("path") == "/metrics" for e in sm["spec"]["endpoints"])
        check(ok, "%s ServiceMonitor: scrapes %s on port %s" % (what, [s["metadata"]["name"] for s in sel], ports))

base = du.read_dir(os.path.join(DEPLOY, "k8s", "base"))
check_set(base, "base")
ov_dir = os.path.join(DEPLOY, "k8s", "overlays", "example")
ov_files = [f for f in os.listdir(ov_dir) if f.endswith(".yaml")]
check(all(list(yaml.safe_load_all(open(os.path.join(ov_dir, f)))) for f in ov_files),
      "overlay: %d files parse" % len(ov_files))
rendered = du.render_overlay(ov_dir)
if rendered is None:
    print("kubectl not installed: the overlay is not rendered (its files parsed only)")
else:
    check_set(rendered, "overlay")
    check(all(d["metadata"].get("namespace") == "pdserve" for d in rendered if d["kind"] != "Namespace"),
          "overlay: every object in namespace pdserve")
    env = du.container_env(rendered, du.find(rendered, "Deployment", "pdserve-router")["spec"]["template"]["spec"]["containers"][0])
    check(env.get("PDSERVE_SLO_TTFT_MS") == "500" and env.get("PDSERVE_PREFILL") == "pdserve-prefill:50071",
          "overlay: the SLO patch merged into the router's env")

# The TLS overlay: TLS on the public port, mutual TLS inside, one Secret per pool.
tls_dir = os.path.join(DEPLOY, "k8s", "overlays", "tls")
tls_files = [f for f in os.listdir(tls_dir) if f.endswith(".yaml")]
check(all(list(yaml.safe_load_all(open(os.path.join(tls_dir, f)))) for f in tls_files),
      "tls overlay: %d files parse" % len(tls_files))
rendered = du.render_overlay(tls_dir)
if rendered is None:
    print("kubectl not installed: the tls overlay is not rendered (its files parsed only)")
else:
    check_set(rendered, "tls overlay")
    envs = {n: du.container_env(rendered, du.find(rendered, "Deployment", n)["spec"]["template"]["spec"]["containers"][0])
            for n in ROLES}
    check(all(envs[n].get("PDSERVE_TLS_CLIENT_CA") for n in ("pdserve-prefill", "pdserve-decode")) and
          all(envs["pdserve-router"].get("PDSERVE_INTERNAL_TLS_" + k) for k in ("CA", "CERT", "KEY")) and
          envs["pdserve-router"].get("PDSERVE_TLS_CERT") and not envs["pdserve-router"].get("PDSERVE_TLS_CLIENT_CA"),
          "tls overlay: public TLS on the router, mutual TLS between the router and both pools")
    base_env = {n: du.container_env(base, du.find(base, "Deployment", n)["spec"]["template"]["spec"]["containers"][0]) for n in ROLES}
    check(not any(k.startswith(("PDSERVE_TLS", "PDSERVE_INTERNAL_TLS")) for e in base_env.values() for k in e),
          "base: no TLS (plaintext, as before)")

# The tensor-parallel decode overlay: merged here (resources and strategic-merge patches), so it
# is checked where kubectl is not installed too; where it is, its rendering must be the same.
tp_dir = os.path.join(DEPLOY, "k8s", "overlays", "tp-decode")
tp_docs = du.merge_overlay(tp_dir)
check_set(tp_docs, "tp-decode overlay")
key = lambda d: (d["kind"], d["metadata"]["name"])
rendered = du.render_overlay(tp_dir)
if rendered is None:
    print("kubectl not installed: the tp-decode overlay is merged here only")
else:
    check(sorted(rendered, key=key) == sorted(tp_docs, key=key), "tp-decode overlay: kubectl kustomize gives what the offline merge gives")
base_m = {key(d): d for d in du.merge_overlay(os.path.join(DEPLOY, "k8s", "base"))}
changed = sorted(k for k in set(base_m) | {key(d) for d in tp_docs} if base_m.get(k) not in [d for d in tp_docs if key(d) == k])
check(changed == [("Deployment", "pdserve-decode"), ("HorizontalPodAutoscaler", "pdserve-decode")],
      "tp-decode overlay: only the decode Deployment and its HPA differ from the base (prefill at TP 1) %s" % changed)
dec, bdec = [x["spec"]["template"]["spec"] for x in (du.find(tp_docs, "Deployment", "pdserve-decode"), base_m[("Deployment", "pdserve-decode")])]
env, benv = [du.container_env(tp_docs, x["containers"][0]) for x in (dec, bdec)]
tp = as_int(env.get("PDSERVE_TENSOR_PARALLEL"))
check(tp is not None and tp > 1, "tp-decode overlay: pdserve-decode at --tensor-parallel %s" % tp)
# --kv-cache-mb is the pool over all ranks: scaled up from the base's one GPU, yet no more a GPU
kv, bkv = as_int(env.get("PDSERVE_KV_CACHE_MB")), as_int(benv.get("PDSERVE_KV_CACHE_MB"))
check(tp and kv and bkv < kv <= bkv * tp, "tp-decode overlay: --kv-cache-mb %s over %s ranks (base %s on one GPU)" % (kv, tp, bkv))
shm, bshm = [gib([v for v in x["volumes"] if v["name"] == "dshm"][0]["emptyDir"]["sizeLimit"]) for x in (dec, bdec)]
res, bres = [x["containers"][0]["resources"] for x in (dec, bdec)]
check(shm > bshm and gib(res["requests"]["memory"]) + shm <= gib(res["limits"]["memory"]) and
      gib(res["requests"]["memory"]) > gib(bres["requests"]["memory"]) and as_int(res["requests"]["cpu"]) > as_int(bres["requests"]["cpu"]),
      "tp-decode overlay: more CPU and memory than the base, /dev/shm %g GiB (base %g) within the memory limit beside the request" % (shm, bshm))
hpa = du.find(tp_docs, "HorizontalPodAutoscaler", "pdserve-decode")["spec"]
check(tp and hpa["maxReplicas"] * tp <= base_m[("HorizontalPodAutoscaler", "pdserve-decode")]["spec"]["maxReplicas"],
      "tp-decode overlay: decode HPA at most %d pods = %d GPUs, no more than the base's" % (hpa["maxReplicas"], hpa["maxReplicas"] * (tp or 0)))

# Prefill and decode agree on --quantization and --kv-cache-dtype in the base and in every
# overlay that can be merged here (their KV layouts must match); the fp8 overlay sets both
# pools to fp8 and changes nothing else.
def engine_flags(docs):
    out = {}
    for n in ("pdserve-prefill", "pdserve-decode"):
        e = du.container_env(docs, du.find(docs, "Deployment", n)["spec"]["template"]["spec"]["containers"][0])
        out[n] = (e.get("PDSERVE_QUANTIZATION", "auto"), e.get("PDSERVE_KV_CACHE_DTYPE", "auto"))
    return out
for name in ("base", "tp-decode", "fp8"):
    d = os.path.join(DEPLOY, "k8s", "base" if name == "base" else os.path.join("overlays", name))
    f = engine_flags(du.merge_overlay(d))
    check(f["pdserve-prefill"] == f["pdserve-decode"],
          "%s: prefill and decode run the same --quantization and --kv-cache-dtype %s" % (name, f))
fp8_dir = os.path.join(DEPLOY, "k8s", "overlays", "fp8")
fp8_docs = du.merge_overlay(fp8_dir)
check_set(fp8_docs, "fp8 overlay")
check(engine_flags(fp8_docs)["pdserve-decode"] == ("fp8", "fp8"), "fp8 overlay: --quantization fp8 --kv-cache-dtype fp8")
changed = sorted(k for k in set(base_m) | {key(d) for d in fp8_docs} if base_m.get(k) not in [d for d in fp8_docs if key(d) == k])
check(changed == [("Deployment", "pdserve-decode"), ("Deployment", "pdserve-prefill")],
      "fp8 overlay: only the prefill and decode Deployments differ from the base %s" % changed)
rendered = du.render_overlay(fp8_dir)
if rendered is not None:
    check(sorted(rendered, key=key) == sorted(fp8_docs, key=key), "fp8 overlay: kubectl kustomize gives what the offline merge gives")

df = open(os.path.join(DEPLOY, "Dockerfile")).read()
check(re.search(r"^FROM nvidia/cuda:\S+-devel\S* AS build$", df, re.M) and re.search(r"^FROM nvidia/cuda:\S+-runtime", df, re.M)
      and all(b in df for b in ROLES), "Dockerfile: CUDA devel build stage, CUDA runtime stage, the three binaries")
build_stage, _, run_stage = df.partition("\nFROM nvidia/cuda:${CUDA_VERSION}-runtime")
check("nccl.h" in build_stage and "libnccl2" in run_stage,
      "Dockerfile: NCCL (tensor parallelism): nccl.h in the build stage, libnccl2 in the runtime stage")
print("%d failures" % failures)
sys.exit(1 if failures else 0)
