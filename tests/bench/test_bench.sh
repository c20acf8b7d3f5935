#!/usr/bin/env bash
# test_bench.sh -- pdserve-bench against pdserve-bench-fakeserver, whose latencies are scripted,
# so every figure the tool reports has a known truth: per-request TTFT / TPOT / E2E, their
# percentiles, error counts (failed requests counted, never averaged in), SLO attainment,
# warm-up exclusion, closed-loop throughput, the goodput search against a K-slot queue whose
# SLO attainment at each rate is computed exactly here, Ctrl-C with a partial report, the
# progress line on a terminal, and bad options giving clear messages and a non-zero exit.
# Then a short goodput search against the real CPU stack (stories260k, colocated) with the
# shared-prefix workload. Exit 77 (skip) when the shared model is missing, after the parts
# that need no model passed.
# usage: test_bench.sh BIN_DIR SHARED_DIR
set -u
BIN=$1
SHARED=$2
BENCH=$BIN/pdserve-bench
FAKE=$BIN/pdserve-bench-fakeserver
for b in "$BENCH" "$FAKE"; do [ -x "$b" ] || { echo "FAIL: $b not built"; exit 1; }; done
PY=$(command -v python3) || { echo "no python3: skip"; exit 77; }
TMP=$(mktemp -d /tmp/test_bench.XXXXXX)
PIDS=()
cleanup() {
    for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null; wait "$p" 2>/dev/null; done
    rm -rf "$TMP"
}
trap cleanup EXIT
export PDSERVE_LOG_LEVEL=warn UCX_WARN_UNUSED_ENV_VARS=n PDSERVE_PREFILL_POLICY=remote
fails=0
ok() { echo "ok   $*"; }
fail() { echo "FAIL $*"; fails=$((fails + 1)); }

# try_twice NAME FUNC: FUNC runs pdserve-bench and checks its figures against the truth. Timing
# checks on a shared 2-core VM can meet a scheduling stall of tens of ms (other jobs, the
# hypervisor): a failure is retried once and said so; a wrong computation fails both times.
try_twice() {
    local name=$1; shift
    if "$@"; then ok "$name"; return; fi
    echo "     retrying once (a scheduling stall on the shared machine?)"
    if "$@"; then ok "$name (second try)"; else fail "$name"; fi
}

# sanitizer_clean FILE...: no ASan/UBSan/LSan report in the files.
sanitizer_clean() {
    if grep -lE "ERROR: (AddressSanitizer|LeakSanitizer)|runtime error:" "$@" 2>/dev/null; then
        fail "sanitizer report in the files above"; grep -hE -A12 "ERROR: |runtime error:" "$@" | head -40
    fi
}

# start_fake NAME ARGS...: starts the fake server, sets FAKE_ADDR.
start_fake() {
    local name=$1; shift
    "$FAKE" "$@" >"$TMP/$name.out" 2>"$TMP/$name.err" &
    PIDS+=($!)
    local pid=$!
    # until its PORT line or its exit (no fixed while: busy cores under ASan start slowly)
    for _ in $(seq 2400); do
        grep -q '^PORT ' "$TMP/$name.out" 2>/dev/null && break
        kill -0 $pid 2>/dev/null || break
        sleep 0.05
    done
    FAKE_ADDR=127.0.0.1:$(awk '/^PORT /{print $2}' "$TMP/$name.out")
    [ "$FAKE_ADDR" != "127.0.0.1:" ] || { echo "FAIL: the fake server did not start"; cat "$TMP/$name.err"; exit 1; }
}

# bench NAME ARGS...: runs pdserve-bench; output in $TMP/NAME.{out,err}, exit code in RC.
bench() {
    local name=$1; shift
    "$BENCH" --quiet "$@" >"$TMP/$name.out" 2>"$TMP/$name.err"
    RC=$?
}

# ---- A. scripted latencies and errors (dataset workload, one exact pass over 50 lines) ----
# Prompt length (bytes) -> TTFT ms, TPOT ms, outcome:
#   10 -> 30, 10, OK (8 tokens)     20 -> 60, 5, OK (16 tokens)     30 -> 120, 20, OK (4 tokens)
#   40 -> UNAVAILABLE after 200 ms  50 -> INTERNAL after 3 tokens at 15 ms + 2 ms each
start_fake fakeA --script "10:30:10,20:60:5,30:120:20,40:200:0:UNAVAILABLE,50:15:2:INTERNAL:3"
A=$FAKE_ADDR
"$PY" - "$TMP/ds.jsonl" <<'PY'
import json, sys
rows = [(10, 8)] * 15 + [(20, 16)] * 15 + [(30, 4)] * 10 + [(40, 8)] * 5 + [(50, 8)] * 5
with open(sys.argv[1], "w") as f:
    for i, (n, out) in enumerate(rows):
        f.write(json.dumps({"prompt": ("%02d" % (i % 100)) + "x" * (n - 2), "output_len": out}) + "\n")
        if i == 7:
            f.write("\n")   # blank lines are skipped
PY
cat >"$TMP/A.py" <<'PY'
import csv, json, sys
TOL_ABS, TOL_REL = 8.0, 0.10      # ms, share: a loaded 2-core VM under sanitizers
def close(got, want):
    return abs(got - want) <= TOL_ABS + TOL_REL * abs(want)
def pct(v, q):                    # linear interpolation between closest ranks, as the tool
    v = sorted(v); pos = q / 100 * (len(v) - 1); lo = int(pos)
    return v[-1] if lo >= len(v) - 1 else v[lo] + (v[lo + 1] - v[lo]) * (pos - lo)
script = {10: (30, 10, 8), 20: (60, 5, 16), 30: (120, 20, 4)}
classes = [10] * 15 + [20] * 15 + [30] * 10
j = json.load(open(sys.argv[1])); r = j["runs"][0]
errs = []
def check(name, got, want):
    if not close(got, want): errs.append("%s: got %.3f, want %.3f" % (name, got, want))
def at_least(name, got, want):   # the server never answers early: nothing may be below truth
    if got < want - 1.0: errs.append("%s: got %.3f, below the scripted %.3f" % (name, got, want))
assert r["requests"] == 50 and r["ok"] == 40 and r["errors"] == 10, r
assert r["errors_by_code"] == {"UNAVAILABLE": 5, "INTERNAL": 5}, r["errors_by_code"]
assert r["output_tokens"] == 15 * 8 + 15 * 16 + 10 * 4, r["output_tokens"]
assert r["input_tokens"] == 15 * 10 + 15 * 20 + 10 * 30, r["input_tokens"]
truth = {"ttft_ms": [script[c][0] for c in classes],
         "tpot_ms": [script[c][1] for c in classes],
         "e2e_ms": [script[c][0] + (script[c][2] - 1) * script[c][1] for c in classes]}
for m, vals in truth.items():
    assert r[m]["n"] == 40, (m, r[m]["n"])
    check(m + " mean", r[m]["mean"], sum(vals) / len(vals))
    for q in (50, 90, 95, 99):
        check("%s p%d" % (m, q), r[m]["p%d" % q], pct(vals, q))
    check(m + " min", r[m]["min"], min(vals)); check(m + " max", r[m]["max"], max(vals))
# The ITLs of a request add up to its decode time: their mean over all tokens is known.
itl = [script[c][1] for c in classes for _ in range(script[c][2] - 1)]
check("itl mean", r["itl_ms"]["mean"], sum(itl) / len(itl))
assert r["itl_ms"]["n"] == len(itl), r["itl_ms"]["n"]
# SLO TTFT <= 150, TPOT <= 15: len 10 and 20 meet both (30), len 30 only TTFT; errors miss.
assert r["slo_met"] == 30, r["slo_met"]
assert abs(r["slo_attainment"] - 0.6) < 1e-9 and abs(r["slo_attainment_ttft"] - 0.8) < 1e-9 \
    and abs(r["slo_attainment_tpot"] - 0.6) < 1e-9 and r["pass"] is True, r
# Per request, from the CSV.
rows = list(csv.DictReader(open(sys.argv[2])))
assert len(rows) == 50, len(rows)
for row in rows:
    if row["status"] != "OK":
        assert row["status"] in ("UNAVAILABLE", "INTERNAL") and row["slo_met"] == "0", row
        if row["status"] == "UNAVAILABLE": check("failed e2e", float(row["e2e_ms"]), 200)
        else: assert row["output_tokens"] == "3", row
        continue
    t, p, n = script[int(row["input_tokens"])]
    assert int(row["output_tokens"]) == n, row
    check("request %s ttft" % row["index"], float(row["ttft_ms"]), t)
    check("request %s tpot" % row["index"], float(row["tpot_ms"]), p)
    at_least("request %s ttft" % row["index"], float(row["ttft_ms"]), t)
    at_least("request %s e2e" % row["index"], float(row["e2e_ms"]), t + (n - 1) * p)
if errs:
    print("\n".join("     " + e for e in errs)); sys.exit(1)
PY
part_A() {
    bench A --addr "$A" --dataset "$TMP/ds.jsonl" --arrival poisson --rate 40 --num-requests 50 \
        --slo-ttft-ms 150 --slo-tpot-ms 15 --slo-attainment 0.5 --json "$TMP/A.json" --csv "$TMP/A.csv"
    [ $RC -eq 0 ] || { echo "     exit $RC"; cat "$TMP/A.err"; return 1; }
    "$PY" "$TMP/A.py" "$TMP/A.json" "$TMP/A.csv"
}
try_twice "A: TTFT/TPOT/E2E per request and percentiles match the script; errors counted by code, not averaged in; SLO attainment exact" part_A
grep -q "UNAVAILABLE 5" "$TMP/A.out" && grep -q "INTERNAL 5" "$TMP/A.out" \
    && ok "A: the table lists errors by status" || { fail "A: table lacks the error counts"; cat "$TMP/A.out"; }

# ---- B. warm-up excluded; random workload lengths; gamma arrivals ----
cat >"$TMP/B.py" <<'PY'
import csv, json, sys
r = json.load(open(sys.argv[1]))["runs"][0]
rows = list(csv.DictReader(open(sys.argv[2])))
assert r["requests"] == 30 and r["ok"] == 30, r
assert len(rows) == 36 and sum(row["warmup"] == "1" for row in rows) == 6, len(rows)
assert all(row["warmup"] == "1" for row in rows[:6]), "warm-up requests come first"
assert all(row["input_tokens"] == "10" and row["output_tokens"] == "8" for row in rows)
assert abs(r["ttft_ms"]["p50"] - 30) < 8 and abs(r["tpot_ms"]["p50"] - 10) < 2, r["ttft_ms"]
s = [float(row["sched_ms"]) for row in rows]
assert s == sorted(s) and 0.3 * 35 / 40 * 1000 < s[-1] < 3 * 35 / 40 * 1000, s[-1]
PY
part_B() {
    bench B --addr "$A" --input-len 10 --output-len 8 --arrival gamma --burstiness 0.5 --rate 40 \
        --num-requests 30 --warmup-requests 6 --json "$TMP/B.json" --csv "$TMP/B.csv"
    [ $RC -eq 0 ] || { echo "     exit $RC"; cat "$TMP/B.err"; return 1; }
    "$PY" "$TMP/B.py" "$TMP/B.json" "$TMP/B.csv"
}
try_twice "B: warm-up requests sent but excluded; random lengths exact (prompt_token_ids, max_tokens + ignore_eos); gamma arrivals" part_B

# ---- C. closed loop: throughput = concurrency / E2E ----
cat >"$TMP/C.py" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["runs"][0]
want = 4 / 0.080                     # TTFT 30 + 5 * TPOT 10 = 80 ms per request
assert r["ok"] == 40 and 0.8 * want < r["throughput"]["requests_per_s"] < 1.1 * want, r["throughput"]
PY
part_C() {
    bench C --addr "$A" --input-len 10 --output-len 6 --arrival closed --concurrency 4 \
        --num-requests 40 --json "$TMP/C.json"
    [ $RC -eq 0 ] || { echo "     exit $RC"; cat "$TMP/C.err"; return 1; }
    "$PY" "$TMP/C.py" "$TMP/C.json"
}
try_twice "C: closed loop keeps 4 in flight: throughput ~ 4 / 80 ms" part_C

# ---- D. shared-prefix workload: prompt = one of N prefixes + random suffix ----
bench D --addr "$A" --workload shared-prefix --prefix-groups 3 --prefix-len 24 --input-len 6 \
    --output-len 2 --rate 100 --num-requests 12 --csv "$TMP/D.csv"
[ $RC -eq 0 ] && awk -F, 'NR > 1 && $8 != 30 {bad = 1} END {exit bad}' "$TMP/D.csv" \
    && ok "D: shared-prefix prompts are prefix + suffix tokens long" || { fail "D: exit $RC"; cat "$TMP/D.err"; }

# ---- E. goodput search against a K-slot queue ----
# 4 slots; TTFT 20 ms, TPOT 10 ms, 9 tokens: each request holds a slot 100 ms (40 req/s).
# With constant arrivals at rate L, request i = 4m + r waits m * (100 - 4000 / L) ms; the
# TTFT SLO of 50 ms leaves 30 ms of wait. The script below replays that queue exactly.
# The band allows 4 ms of delivery overhead either way, and the queue is replayed from the
# times the client actually sent each request (CSV start_ms), so a client that fell behind
# is not blamed on the tool's arithmetic.
start_fake fakeE --slots 4 --ttft-ms 20 --tpot-ms 10
cat >"$TMP/E.py" <<'PY'
import csv, json, sys, os, xml.dom.minidom
N, K, S, TTFT, SLO, TARGET = 40, 4, 0.100, 0.020, 0.050, 0.9
MARGIN = 0.004   # delivery overhead and jitter: requests this close to the SLO may go either way
def attainment(arrivals, slo):
    free = [0.0] * K; met = 0
    for t in arrivals:
        k = min(range(K), key=lambda j: free[j])
        start = max(t, free[k]); free[k] = start + S
        met += (start - t) + TTFT <= slo + 1e-9
    return met / len(arrivals)
def ideal(rate): return [i / rate for i in range(N)]
def goodput(slo):  # the highest rate whose attainment reaches the target
    lo, hi = 1.0, 200.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if attainment(ideal(mid), slo) >= TARGET else (lo, mid)
    return lo
truth, t_lo, t_hi = goodput(SLO), goodput(SLO - MARGIN), goodput(SLO + MARGIN)
j = json.load(open(sys.argv[1])); g = j["goodput"]
sent = {}
for row in csv.DictReader(open(sys.argv[2])):
    sent.setdefault(int(row["run"]), []).append(float(row["start_ms"]) / 1000)
print("     exact goodput %.2f req/s (%.2f to %.2f within +-%g ms); found %.3f req/s, lowest "
      "failing %.3f; %d probes" % (truth, t_lo, t_hi, MARGIN * 1e3, g["rate_rps"],
      g["lowest_failing_rate_rps"], len(j["runs"])))
# A probe whose client fell behind (the tool's own lag figure) ran on a stalled machine: its
# attainment is not compared, and neither is a goodput that such a probe decided.
LAG_MAX = 20.0
bad, stalled = [], set()
for i, r in enumerate(j["runs"]):
    lo, hi = attainment(sent[i], SLO - MARGIN), attainment(sent[i], SLO + MARGIN)
    lag = r["client_lag_ms"]["max"]
    print("     rate %7.3f: attainment %.3f, exact %.3f (%.3f to %.3f); client lag max %.2f ms%s" % (
          r["rate_rps"], r["slo_attainment"], attainment(sent[i], SLO), lo, hi, lag,
          " (stalled: not compared)" if lag > LAG_MAX else ""))
    assert r["pass"] == (r["slo_attainment"] >= TARGET)
    if lag > LAG_MAX: stalled.add(r["rate_rps"]); continue
    if not lo - 1e-9 <= r["slo_attainment"] <= hi + 1e-9: bad.append(r["rate_rps"])
assert not bad, "attainment outside the exact band at %s" % bad
assert len(j["runs"]) - len(stalled) >= 4, "too many stalled probes to judge"
assert g["found"] and g["bracketed"]
assert (g["lowest_failing_rate_rps"] - g["rate_rps"]) <= 0.05 * g["lowest_failing_rate_rps"] + 1e-9
if not {g["rate_rps"], g["lowest_failing_rate_rps"]} & stalled:
    assert 0.94 * t_lo <= g["rate_rps"] <= t_hi * 1.001, (g, t_lo, t_hi)
    assert g["lowest_failing_rate_rps"] >= t_lo * 0.999, g
for f in ("slo_attainment_vs_rate.svg", "ttft_cdf.svg", "tpot_cdf.svg"):
    d = xml.dom.minidom.parse(os.path.join(sys.argv[3], f))
    assert d.documentElement.tagName == "svg" and d.getElementsByTagName("polyline"), f
PY
part_E() {
    bench E --addr "$FAKE_ADDR" --input-len 16 --output-len 9 --arrival constant --rate 20 \
        --num-requests 40 --find-goodput --slo-ttft-ms 50 --slo-tpot-ms 15 --slo-attainment 0.9 \
        --goodput-tolerance 0.05 --json "$TMP/E.json" --csv "$TMP/E.csv" --plot-dir "$TMP/plots"
    [ $RC -eq 0 ] || { echo "     exit $RC"; cat "$TMP/E.err"; return 1; }
    "$PY" "$TMP/E.py" "$TMP/E.json" "$TMP/E.csv" "$TMP/plots"
}
try_twice "E: every probe's attainment and the goodput match the queue's exact answer; SVG plots valid" part_E
grep -q "^probe  1: rate   20.000" "$TMP/E.out" && grep -q "^goodput " "$TMP/E.out" \
    && ok "E: each probe printed, then the goodput" || { fail "E: probe lines"; cat "$TMP/E.out"; }

# ---- F. Ctrl-C: a clean stop with a partial report ----
"$BENCH" --quiet --addr "$A" --input-len 10 --output-len 50 --rate 20 --num-requests 400 \
    --json "$TMP/F.json" >"$TMP/F.out" 2>"$TMP/F.err" &
BP=$!
sleep 1.5
kill -INT $BP
wait $BP
RC=$?
if [ $RC -eq 130 ] && grep -q "INTERRUPTED" "$TMP/F.out" && "$PY" - "$TMP/F.json" <<'PY'; then
import json, sys
j = json.load(open(sys.argv[1])); r = j["runs"][0]
assert j["interrupted"] is True and 5 < r["requests"] < 400 and r["interrupted"] > 0, r
assert r["errors"] == 0, "cancelled requests are not errors"
PY
    ok "F: Ctrl-C stops, cancels in-flight requests (not counted) and writes the partial report (exit 130)"
else
    fail "F: exit $RC"; cat "$TMP/F.out" "$TMP/F.err" | tail -20
fi

# ---- G. the progress line, only on a terminal ----
script -qec "$BENCH --addr $A --input-len 10 --output-len 4 --rate 50 --num-requests 25" \
    /dev/null >"$TMP/G.tty" 2>&1
"$BENCH" --addr "$A" --input-len 10 --output-len 4 --rate 50 --num-requests 25 \
    >"$TMP/G.out" 2>"$TMP/G.err"
if grep -q "sent 25/25" "$TMP/G.tty" && ! grep -q "sent " "$TMP/G.err"; then
    ok "G: progress line on a terminal, none when stderr is a file"
else
    fail "G: progress line"; tail -c 600 "$TMP/G.tty"
fi

# ---- H. bad options: a clear message and a non-zero exit ----
# expect_fail NAME SUBSTRING ARGS...
expect_fail() {
    local name=$1 want=$2; shift 2
    timeout 30 "$BENCH" "$@" >"$TMP/x.out" 2>"$TMP/x.err"
    local rc=$?
    if [ $rc -eq 0 ] || [ $rc -ge 124 ]; then
        fail "H $name: exit $rc (want a clean non-zero exit)"; cat "$TMP/x.err"; return
    fi
    grep -qF -- "$want" "$TMP/x.err" || { fail "H $name: stderr lacks '$want':"; cat "$TMP/x.err"; return; }
    ok "H $name (exit $rc): $(head -1 "$TMP/x.err")"
    cat "$TMP/x.err" >>"$TMP/H.err"
}
printf '{"prompt": "ok", "output_len": 3}\n{"prompt": "no length"}\n' >"$TMP/bad.jsonl"
expect_fail "negative rate" "--rate must be > 0" --addr "$A" --rate -1
expect_fail "zero rate" "--rate must be > 0" --addr "$A" --rate 0
expect_fail "attainment 0" "--slo-attainment must be in (0, 1]" --addr "$A" --slo-attainment 0
expect_fail "attainment 1.5" "--slo-attainment must be in (0, 1]" --addr "$A" --slo-attainment 1.5
expect_fail "missing dataset" "cannot read dataset '$TMP/nope.jsonl'" --addr "$A" --dataset "$TMP/nope.jsonl"
expect_fail "bad dataset line" "line 2: \"output_len\" must be an integer" --addr "$A" --dataset "$TMP/bad.jsonl"
expect_fail "unreachable server" "cannot reach a pdserve server at 127.0.0.1:1" --addr 127.0.0.1:1 --connect-timeout-ms 3000
expect_fail "goodput without SLO" "--find-goodput needs an SLO" --addr "$A" --find-goodput
expect_fail "goodput closed loop" "--find-goodput searches an open-loop rate" --addr "$A" --find-goodput --arrival closed --slo-ttft-ms 5
expect_fail "bad arrival" "--arrival must be poisson, gamma, constant or closed" --addr "$A" --arrival uniform
expect_fail "bad length" "--input-len and --output-len take N or MIN:MAX" --addr "$A" --input-len 9:3
expect_fail "too long for the model" "exceed the model's maximum length 4096" --addr "$A" --input-len 4000 --output-len 200
expect_fail "unknown flag" "unknown flag --rps" --addr "$A" --rps 3

# ---- I. the real CPU stack (stories260k, colocated): a short goodput search ----
STORIES=$SHARED/models/stories260k
skip_stack=0
if [ ! -f "$STORIES/config.json" ]; then
    echo "skip I: no shared model at $STORIES"; skip_stack=1
else
    "$BIN/pdserve-up" --model "$STORIES" --colocated --port 0 >"$TMP/up.out" 2>"$TMP/up.err" &
    UP=$!
    PIDS+=($UP)
    for _ in $(seq 1800); do grep -q '^ROUTER ' "$TMP/up.out" && break; kill -0 $UP 2>/dev/null || break; sleep 0.1; done
    R=$(awk '/^ROUTER /{print $2}' "$TMP/up.out")
    if [ -z "$R" ]; then fail "I: pdserve-up did not start"; cat "$TMP/up.err"; else
        bench I --addr "$R" --workload shared-prefix --prefix-groups 2 --prefix-len 32 \
            --input-len 8:16 --output-len 8 --rate 10 --num-requests 16 --warmup-requests 2 \
            --find-goodput --slo-ttft-ms 500 --slo-tpot-ms 100 --max-probes 3 --json "$TMP/I.json"
        if [ $RC -eq 0 ] && grep -q "^goodput " "$TMP/I.out" && "$PY" - "$TMP/I.json" <<'PY'; then
import json, sys
j = json.load(open(sys.argv[1]))
assert j["model"]["name"] and j["goodput"]["found"], j["goodput"]
assert any(r["cached_prompt_tokens"] > 0 for r in j["runs"]), "no prefix-cache hits reported"
assert all(r["errors"] == 0 and r["output_len"]["min"] == 8 for r in j["runs"])
PY
            ok "I: --find-goodput against the colocated stack: $(grep '^goodput ' "$TMP/I.out")"
        else
            fail "I: exit $RC"; cat "$TMP/I.out" "$TMP/I.err" | tail -30
        fi
    fi
fi

# Every process stops cleanly on SIGTERM (a leak report would make the fake servers exit 23).
for p in "${PIDS[@]}"; do
    kill -TERM "$p" 2>/dev/null; wait "$p"; rc=$?
    [ $rc -eq 0 ] || fail "process $p exited $rc after SIGTERM"
done
PIDS=()
sanitizer_clean "$TMP"/*.err
if [ $fails -ne 0 ]; then echo "$fails failure(s)"; exit 1; fi
[ $skip_stack -eq 1 ] && { echo "all fake-server checks passed; the stack part was skipped"; exit 77; }
echo "all ok"
