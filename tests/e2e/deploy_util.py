"""deploy_util.py -- Reading deploy/k8s for the deploy tests: every manifest document of the
kustomize base (and the overlays rendered by `kubectl kustomize` where kubectl is installed, or
merged here: an overlay of resources and strategic-merge patches only), and the environment a
container gets, resolved as the kubelet does it (envFrom ConfigMaps first, then env in order,
$(VAR) references expanded, fieldRef metadata.name and status.podIP filled in)."""
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

# Strategic merge, the part of it the overlays use: maps merge key by key (null deletes a key);
# the lists below merge item by item on their merge key (Kubernetes' patchMergeKey: an item of
# the patch updates the base's item with its key, or is new; kustomize puts the patch's items
# first, in its order, then the base's others); any other list is replaced.
MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name", "volumes": "name",
              "volumeMounts": "mountPath"}

def strategic_merge(base, patch, key=None):
    if isinstance(patch, dict) and isinstance(base, dict):
        if any(k.startswith("$") for k in patch):
            raise NotImplementedError("strategic-merge directive %s" % sorted(k for k in patch if k.startswith("$")))
        out = dict(base)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            else:
                out[k] = strategic_merge(out[k], v, k) if k in out else v
        return out
    if isinstance(patch, list) and isinstance(base, list) and key in MERGE_KEYS:
        mk = MERGE_KEYS[key]
        keys = [item.get(mk) for item in patch]
        merged = []
        for item in patch:
            same = [b for b in base if b.get(mk) == item.get(mk)]
            merged.append(strategic_merge(same[0], item, None) if same else item)
        return merged + [b for b in base if b.get(mk) not in keys]
    return patch

def merge_overlay(d):
    """The kustomization in d as kustomize builds it, for kustomizations of `resources` (files or
    kustomization directories), strategic-merge `patches` (each a file of one object, matched
    by kind and name) and `images` (newName / newTag). Anything else in a kustomization.yaml
    raises NotImplementedError."""
    yaml = load_yaml()
    k = yaml.safe_load(open(os.path.join(d, "kustomization.yaml")))
    other = set(k) - {"apiVersion", "kind", "resources", "patches", "images"}
    if other:
        raise NotImplementedError("%s: kustomization fields %s" % (d, sorted(other)))
    docs = []
    for r in k.get("resources", []):
        p = os.path.join(d, r)
        docs += merge_overlay(p) if os.path.isdir(p) else [x for x in yaml.safe_load_all(open(p)) if x]
    for pt in k.get("patches", []):
        if set(pt) != {"path"}:
            raise NotImplementedError("%s: patch %s (only {path: FILE})" % (d, pt))
        patches = [x for x in yaml.safe_load_all(open(os.path.join(d, pt["path"]))) if x]
        if len(patches) != 1:
            raise NotImplementedError("%s: %d objects in one patch file" % (pt["path"], len(patches)))
        at = [i for i, x in enumerate(docs) if x.get("kind") == patches[0]["kind"] and
              x["metadata"]["name"] == patches[0]["metadata"]["name"]]
        if len(at) != 1:
            raise KeyError("%s patches %s %s, which is not in the resources" % (pt["path"], patches[0]["kind"], patches[0]["metadata"]["name"]))
        docs[at[0]] = strategic_merge(docs[at[0]], patches[0])
    for im in k.get("images", []):
        if set(im) - {"name", "newName", "newTag"}:
            raise NotImplementedError("%s: image %s" % (d, im))
        for x in by_kind(docs, "Deployment"):
            for c in x["spec"]["template"]["spec"]["containers"]:
                name, tag = re.match(r"^(.*?)(?::([^:/]*))?$", c["image"]).groups()
                if name == im["name"]:
                    tag = im.get("newTag", tag)
                    c["image"] = im.get("newName", name) + (":" + tag if tag else "")
    return docs

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
