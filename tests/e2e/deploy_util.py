"""deploy_util.py -- Reading deploy/k8s for the deploy tests: every manifest document of the
kustomize base (and the example overlay rendered by `kubectl kustomize` where kubectl is
installed), and the environment a container gets, resolved as the kubelet does it (envFrom
ConfigMaps first, then env in order, $(VAR) references expanded, fieldRef metadata.name and
status.podIP filled in)."""
import os, re, shutil, subprocess, sys

def load_yaml():
    try:
        import yaml
        return yaml
    except ImportError:
        print("python3-yaml missing (tools/install_deps.sh installs it): skip")
        sys.exit(77)

def read_dir(d):
    """All documents of the kustomization in d, in its resources order (base only: plain files)."""
    yaml = load_yaml()
    k = yaml.safe_load(open(os.path.join(d, "kustomization.yaml")))
    docs = []
    for r in k.get("resources", []):
        p = os.path.join(d, r)
        if os.path.isdir(p):
            docs += read_dir(p)
        else:
            docs += [x for x in yaml.safe_load_all(open(p)) if x]
    return docs

def render_overlay(path):
    """The overlay rendered by kubectl kustomize, or None when kubectl is not installed."""
    kubectl = shutil.which("kubectl")
    if not kubectl:
        return None
    out = subprocess.run([kubectl, "kustomize", path], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError("kubectl kustomize %s: %s" % (path, out.stderr))
    return [x for x in load_yaml().safe_load_all(out.stdout) if x]

def by_kind(docs, kind):
    return [d for d in docs if d.get("kind") == kind]

def find(docs, kind, name):
    for d in docs:
        if d.get("kind") == kind and d["metadata"]["name"] == name:
            return d
    return None

def container_env(docs, container, pod_name="pod-0", pod_ip="10.0.0.1"):
    """The container's environment as a dict (kubelet order and $(VAR) expansion)."""
    env = {}
    for src in container.get("envFrom", []):
        cm = src.get("configMapRef")
        if cm:
            m = find(docs, "ConfigMap", cm["name"])
            if m is None:
                raise KeyError("envFrom names ConfigMap %s, which is not in the manifests" % cm["name"])
            env.update({k: str(v) for k, v in m.get("data", {}).items()})
    for e in container.get("env", []):
        if "value" in e:
            v = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), str(e["value"]))
        else:
            path = e["valueFrom"]["fieldRef"]["fieldPath"]
            v = {"metadata.name": pod_name, "status.podIP": pod_ip}[path]
        env[e["name"]] = v
    return env

def selector_matches(sel, labels):
    return bool(sel) and all(labels.get(k) == v for k, v in sel.items())

def help_env_vars(bin_dir, binary):
    """The PDSERVE_* variables a binary's --help lists."""
    out = subprocess.run([os.path.join(bin_dir, binary), "--help"], capture_output=True, text=True,
                         env={"PATH": os.environ.get("PATH", "")})
    if out.returncode != 0:
        raise RuntimeError("%s --help exited %d" % (binary, out.returncode))
    return set(re.findall(r"\[(PDSERVE_[A-Z0-9_]+)\]", out.stdout + out.stderr))
