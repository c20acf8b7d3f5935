#!/usr/bin/env python3
"""test_env_doc.py -- The environment knobs stay in one table (common/env.c, issue #40):
  1. docs/env.md is what `pdserve-env --markdown` prints (regenerate it when this fails:
     build/bin/pdserve-env --markdown > docs/env.md);
  2. no source reads a PDSERVE_* variable with getenv() but common/env.c (use pd_env_bool /
     _int / _str from common/env.h, and add the knob to the table);
  3. every PDSERVE_* name the docs, READMEs, scripts and deployment files mention is a knob,
     a command-line flag's environment name (PDSERVE_<FLAG>), or one of the script variables
     listed in SCRIPT_VARS;
  4. every pd_env_bool / _int / _double / _str / _raw / _set call in the sources names a knob
     of the table, of that type.
usage: test_env_doc.py PATH_OF_pdserve-env SOURCE_DIR"""
import difflib, os, re, subprocess, sys

BIN, ROOT = sys.argv[1], sys.argv[2]
SRC_EXTS = (".c", ".h", ".cu", ".cuh", ".cc", ".cpp")
DOC_EXTS = (".md", ".sh", ".py", ".yaml", ".yml", ".txt")
# Variables of the scripts themselves, not read by any program.
SCRIPT_VARS = {"PDSERVE_LOG_DIR", "PDSERVE_DEVICE", "PDSERVE_UP_START_S"}
failures = []


def walk(exts):
    for dirpath, dirs, files in os.walk(ROOT):
        rel = os.path.relpath(dirpath, ROOT)
        dirs[:] = [d for d in dirs if not d.startswith((".", "build")) and
                   not (rel == "." and d in ("shared", "third_party"))]
        for name in sorted(files):
            if name.endswith(exts) or name == "Dockerfile":
                yield os.path.join(dirpath, name)


def read(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


# 1. docs/env.md current
out = subprocess.run([BIN, "--markdown"], check=True, capture_output=True, text=True).stdout
doc_path = os.path.join(ROOT, "docs", "env.md")
doc = read(doc_path) if os.path.exists(doc_path) else ""
if out != doc:
    diff = "".join(difflib.unified_diff(doc.splitlines(True), out.splitlines(True),
                                        "docs/env.md", "pdserve-env --markdown"))
    failures.append("docs/env.md is stale; regenerate it: build/bin/pdserve-env --markdown > "
                    "docs/env.md\n" + diff)
knobs = set(re.findall(r"^\| `(PDSERVE_[A-Z0-9_]+)` \|", out, re.M))
if len(knobs) < 10:
    failures.append("pdserve-env --markdown lists %d knobs: the table did not parse" % len(knobs))

# 2. getenv("PDSERVE_...") only in common/env.c; flag names from the flag tables on the way
GETENV = re.compile(r'getenv\(\s*"PDSERVE_')
FLAG = re.compile(r'\{\s*"([a-z0-9][a-z0-9-]*)",\s*PD_FLAG_[A-Z]+')
flags = set()
for path in walk(SRC_EXTS):
    rel = os.path.relpath(path, ROOT)
    text = read(path)
    flags.update("PDSERVE_" + f.upper().replace("-", "_") for f in FLAG.findall(text))
    if rel == os.path.join("common", "env.c"):
        continue
    for m in GETENV.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        failures.append("%s:%d reads a PDSERVE_ variable with getenv(): use common/env.h "
                        "(and add the knob to common/env.c's table)" % (rel, line))
if len(flags) < 10:
    failures.append("found %d command-line flags: the flag tables did not parse" % len(flags))

# 3. every name mentioned is known, or the start of known ones (PDSERVE_TP_DEBUG_*,
# PDSERVE_TLS); PDSERVE__... are protobuf-c's identifiers
known = knobs | flags | SCRIPT_VARS
NAME = re.compile(r"\bPDSERVE_(?!_)[A-Z0-9_]*")
for path in walk(DOC_EXTS):
    rel = os.path.relpath(path, ROOT)
    if rel.startswith(os.path.join("docs", "perf-history")):
        continue  # the log of past passes names knobs that have gone
    for m in NAME.finditer(read(path)):
        name = m.group(0)
        stem = name if name.endswith("_") else name + "_"
        ok = name in known or any(k.startswith(stem) for k in known)
        if not ok:
            line = read(path).count("\n", 0, m.start()) + 1
            failures.append("%s:%d mentions %s: neither a knob (docs/env.md), a flag's "
                            "environment name nor a script variable" % (rel, line, name))

# 4. every pd_env_<type>("PDSERVE_...") in the sources names a knob of the table, of that type
# (a wrong one aborts at run time, perhaps only on a GPU path that CI never runs)
TYPES = dict(re.findall(r'\{\s*"(PDSERVE_[A-Z0-9_]+)",\s*PD_ENV_([A-Z]+)',
                        read(os.path.join(ROOT, "common", "env.c"))))
if len(TYPES) != len(knobs):
    failures.append("common/env.c's table parsed as %d knobs, docs list %d" % (len(TYPES), len(knobs)))
WANT = {"bool": "BOOL", "int": "INT", "double": "DOUBLE", "str": "STRING"}
CALL = re.compile(r'pd_env_(bool|int|double|str|raw|set)\(\s*"(PDSERVE_[A-Z0-9_]+)"')
for path in walk(SRC_EXTS):
    rel = os.path.relpath(path, ROOT)
    if rel == os.path.join("tests", "test_env.c"):
        continue  # it calls wrong names and types on purpose
    text = read(path)
    for m in CALL.finditer(text):
        fn, name = m.groups()
        line = text.count("\n", 0, m.start()) + 1
        if name not in TYPES:
            failures.append("%s:%d: pd_env_%s(\"%s\"): no such knob in common/env.c" % (rel, line, fn, name))
        elif fn in WANT and TYPES[name] != WANT[fn]:
            failures.append("%s:%d: pd_env_%s(\"%s\"): the knob is %s" % (rel, line, fn, name, TYPES[name]))

for f in failures:
    print("FAIL:", f)
print("test_env_doc: %d knobs, %d flag names; %s" %
      (len(knobs), len(flags), "%d failures" % len(failures) if failures else "all checks passed"))
sys.exit(1 if failures else 0)
