#!/usr/bin/env python3
"""test_layers.py -- The folders are the layers (issue #40): a source file includes headers of
its own folder or of lower ones, never of a higher one. The order, lowest first:
  common (and the headers generated from proto/: pdserve/..., grpc/...) < text < kernels
  < engine < kvtransfer < svc < router, prefill_svc, decode_svc < tools
(the three services are one level: none includes another). tests/ may include anything.
And pdserve-router's sources reach no engine, kvtransfer or kernels header, followed through
every header they include (svc/svc_core.h, not svc/svc.h).
usage: test_layers.py SOURCE_DIR"""
import os, re, sys

ROOT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..")
LEVEL = {"common": 0, "pdserve": 0, "grpc": 0, "text": 1, "kernels": 2, "engine": 3,
         "kvtransfer": 4, "svc": 5, "router": 6, "prefill_svc": 6, "decode_svc": 6, "tools": 7}
EXTS = (".c", ".h", ".cu", ".cuh")
INC = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def includes(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        return INC.findall(f.read())


def sources(folder):
    for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
        for name in sorted(files):
            if name.endswith(EXTS):
                yield os.path.join(dirpath, name)


bad = []
for folder, lvl in LEVEL.items():
    if folder in ("pdserve", "grpc"):
        continue
    for path in sources(folder):
        for inc in includes(path):
            top = inc.split("/", 1)[0]
            if "/" not in inc or top not in LEVEL:
                continue  # a header beside the file, or a system / dependency header
            if LEVEL[top] > lvl or (LEVEL[top] == lvl == 6 and top != folder):
                bad.append("%s includes %s (%s is above %s)" % (os.path.relpath(path, ROOT), inc,
                                                                 top, folder))

# The router: every repository header its sources reach.
FORBIDDEN = ("engine/", "kvtransfer/", "kernels/")
seen, stack = {}, [(os.path.relpath(p, ROOT), None) for p in sources("router")]
while stack:
    rel, via = stack.pop()
    if rel in seen:
        continue
    seen[rel] = via
    full = os.path.join(ROOT, rel)
    if not os.path.exists(full):
        continue  # generated (pdserve/..., grpc/...) or a dependency's
    for inc in includes(full):
        if os.path.exists(os.path.join(ROOT, inc)):
            stack.append((inc, rel))
for rel, via in sorted(seen.items()):
    if rel.startswith(FORBIDDEN):
        chain, r = [rel], via
        while r:
            chain.append(r)
            r = seen.get(r)
        bad.append("the router reaches %s (%s)" % (rel, " <- ".join(chain[1:])))

for b in bad:
    print("FAIL", b)
n_files = sum(1 for f in LEVEL if f not in ("pdserve", "grpc") for _ in sources(f))
print("test_layers: %d files checked, %d router headers followed, %d violations"
      % (n_files, len(seen), len(bad)))
sys.exit(1 if bad else 0)
