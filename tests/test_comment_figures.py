#!/usr/bin/env python3
"""test_comment_figures.py -- No measurements in code comments (issue #40): a comment in the
sources says why the code is as it is and points to docs/perf-history.md for the figures,
which age with every pass, chip and toolkit. This fails on a comment that states a measured
figure: a rate (GB/s, TFLOP/s, tok/s, req/s), a time in microseconds, a time that went "from
X to Y", a signed percentage ("+6%"), a percentage faster or slower or of a step, a multiple
of a floor ("1.94x its floor"), or a chip it was seen on ("on an H200"). Limits, sizes,
defaults and counts (a 16 KiB slot, a 500 ms poll) are design facts and do not match.
Prints file:line and the comment line of each hit.
usage: test_comment_figures.py SOURCE_DIR"""
import os, re, sys

ROOT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..")
FOLDERS = ("common", "text", "kernels", "engine", "kvtransfer", "svc", "router", "prefill_svc",
           "decode_svc", "tools", "tests")
EXTS = (".c", ".h", ".cu", ".cuh", ".cu.in")
NUM = r"\d[\d,]*(?:\.\d+)?"
FIGURE = re.compile("|".join([
    NUM + r"\s*(?:[GMT]i?B/s|[GT]FLOP/s|TFLOPS|tok/s|tokens/s|req/s)",  # rates
    NUM + r"\s*(?:µs|us)\b",                                               # microseconds
    r"\bfrom " + NUM + r"\s*(?:ms|s|µs|us)? to " + NUM + r"\s*(?:ms|s|µs|us)\b",  # time moved
    r"(?<![\w.])[+−]" + NUM + r"(?:\s*[-–]\s*" + NUM + r")?\s*%",              # "+6%", "+4 - 6%"
    NUM + r"\s*%\s+(?:faster|slower|of (?:a|the|its) (?:step|floor|copy rate))",
    NUM + r"\s*[x×]\s+(?:its|the)\s+(?:[\w-]+\s+)?floor",                 # "1.94x its floor"
    r"\btook (?:over |about |~\s*)?" + NUM + r"\s*(?:ms|s|µs|us|min)\b",       # "took ~25 us"
    r"(?:about |~\s*)" + NUM + r"\s*[x×]\s+(?:faster|slower)",              # "about 3x slower"
    r"\bon (?:an?|the|one) (?:H100|H200|A100|B200|GH200)\b",              # a chip it ran on
    r"\bmeasured on\b",
]))


def comments(src):
    """Yields (line, text) for every line of every comment of C / CUDA source src, skipping
    string and character literals."""
    i, n, line = 0, len(src), 1
    while i < n:
        c = src[i]
        if c == "\n":
            line += 1
            i += 1
        elif src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            yield line, src[i:j]
            i = j
        elif src.startswith("/*", i):
            j = src.find("*/", i + 2)
            j = n if j < 0 else j + 2
            for k, text in enumerate(src[i:j].split("\n")):
                yield line + k, text
            line += src.count("\n", i, j)
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and src[j] != c and src[j] != "\n":
                j += 2 if src[j] == "\\" else 1
            i = j + 1
        else:
            i += 1


# The pattern itself: figures it must catch, design facts it must let through.
CAUGHT = ("near 3 TB/s", "went from 0.95 to 0.79 ms", "12.9 / 7.7 us", "batch 1 +4.7 - 6.0%",
          "1.94x its weight-bytes floor", "8% slower on uniform contexts", "on an H200 it made",
          "from 22.5 to 39 req/s", "took ~25 us", "measured on the H100")
PASSED = ("a 16 KiB slot", "poll 500 ms", "1 ms .. 80 s: TTFT", "232 registers", "128 layers",
          "default 1000; 0 = UCX default (20 s)", "every 10% into a log", "as many rows as SMs")
bad_pattern = ["misses %r" % s for s in CAUGHT if not FIGURE.search(s)] + \
              ["flags %r" % s for s in PASSED if FIGURE.search(s)]
for b in bad_pattern:
    print("FAIL the pattern", b)

hits, n_files = [], 0
for folder in FOLDERS:
    for dirpath, dirs, files in os.walk(os.path.join(ROOT, folder)):
        dirs[:] = sorted(d for d in dirs if not d.startswith("build"))
        for name in sorted(files):
            if not name.endswith(EXTS):
                continue
            path = os.path.join(dirpath, name)
            n_files += 1
            with open(path, encoding="utf-8", errors="replace") as f:
                src = f.read()
            for line, text in comments(src):
                if FIGURE.search(text):
                    hits.append("%s:%d: %s" % (os.path.relpath(path, ROOT), line, text.strip()))

for h in hits:
    print("FAIL", h)
if hits:
    print("move the figures to docs/perf-history.md and say there where the comment points")
print("test_comment_figures: %d files checked, %d comments with measured figures"
      % (n_files, len(hits)))
sys.exit(1 if hits or bad_pattern else 0)
