#!/usr/bin/env bash
# test_up.sh -- pdserve-up (issue #30's launcher papercuts): a router that refuses its flags
# makes pdserve-up exit non-zero (it exited 0); --router-args reach the router; the /metrics
# ports are printed; SIGTERM stops the stack with exit 0.
# usage: test_up.sh BIN_DIR SHARED_DIR
set -uo pipefail
BIN=$1 SHARED=$2
MODEL=$SHARED/models/stories260k
[ -d "$MODEL" ] || { echo "no shared data: skip"; exit 77; }
TMP=$(mktemp -d /tmp/pdserve-up-test.XXXXXX)
trap 'rm -rf "$TMP"' EXIT
export UCX_WARN_UNUSED_ENV_VARS=n PDSERVE_LOG_LEVEL=warn
fail=0
check() { if eval "$1"; then echo "ok   $2"; else echo "FAIL $2"; fail=1; fi; }

PDSERVE_LOG_DIR=$TMP/bad timeout 60 "$BIN/pdserve-up" --model "$MODEL" --port 0 --colocated \
    --router-args "--no-such-flag" -- --backend cpu >"$TMP/bad.out" 2>"$TMP/bad.err"
rc=$?
check "[ $rc -ne 0 ] && [ $rc -ne 124 ]" "a router that does not start: pdserve-up exits non-zero (got $rc)"
check "grep -q 'router did not start' '$TMP/bad.err'" "and says which process"

PDSERVE_LOG_DIR=$TMP/good "$BIN/pdserve-up" --model "$MODEL" --port 0 --colocated \
    --router-args "--metrics-port 0 --slo-ttft-ms 123" -- --backend cpu --metrics-port 0 \
    >"$TMP/good.out" 2>"$TMP/good.err" &
up=$!
for _ in $(seq 300); do grep -q '^METRICS ' "$TMP/good.out" 2>/dev/null && break; sleep 0.1; done
cat "$TMP/good.out"
check "grep -q '^ROUTER 127.0.0.1:' '$TMP/good.out'" "the router's address is printed"
check "grep -Eq '^METRICS .*decode-0 127.0.0.1:[0-9]+' '$TMP/good.out' && grep -Eq '^METRICS .*router 127.0.0.1:[0-9]+' '$TMP/good.out'" "the /metrics ports are printed"
mport=$(grep -o 'router 127.0.0.1:[0-9]*' "$TMP/good.out" | head -1 | sed 's/.*://')
check "python3 -c 'import sys,urllib.request; t=urllib.request.urlopen(\"http://127.0.0.1:%s/metrics\" % sys.argv[1], timeout=5).read().decode(); assert \"pdserve_slo_ttft_seconds 0.123\" in t' '$mport'" "--router-args reach the router (--slo-ttft-ms 123)"
kill -TERM $up
wait $up
rc=$?
check "[ $rc -eq 0 ]" "SIGTERM: the stack stops, exit 0 (got $rc)"
exit $fail
