#!/usr/bin/env python3
"""ncu_summary.py -- The kernels of an `ncu --metrics gpu__time_duration.sum --print-summary
per-kernel` log, by total GPU time, largest first (the 18 largest, then the total):
kernel name, calls, total microseconds. Used by tools/gpu_fp8.sh and tools/gpu_moe.sh.

Usage: ncu_summary.py NCU_LOG [TOP]"""
import re, sys
rows, name, calls = [], None, 0
for line in open(sys.argv[1], errors="replace"):
    m = re.match(r"\s{2}(\S.*?) \(\d+, \d+, \d+\)x\(\d+, \d+, \d+\)", line)
    if m: name = m.group(1)[:60]
    m = re.search(r"Invocations\s+(\d+)", line) or re.search(r"^\s*(\d+) invocations", line)
    if m and name: calls = int(m.group(1))
    m = re.match(r"\s+gpu__time_duration.sum\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)", line)
    if m and name:
        unit, avg = m.group(1), float(m.group(3).replace(",", ""))
        f = {"ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "nsecond": 1e-3}.get(unit, 1.0)
        rows.append((avg * f * max(calls, 1), calls, name)); name = None
rows.sort(reverse=True)
tot = sum(r[0] for r in rows)
top = int(sys.argv[2]) if len(sys.argv) > 2 else 18
for t, c, n in rows[:top]: print("%-60s %6d %10.0f" % (n, c, t))
print("%-60s %6s %10.0f" % ("total", "", tot))
