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

# Tensor parallelism: each instance at TP 2 (the CPU backend's ranks are threads), a completion
# streams through prefill and decode, and each instance says it runs 2 ranks.
PDSERVE_LOG_DIR=$TMP/tp "$BIN/pdserve-up" --model "$MODEL" --port 0 --tensor-parallel 2 \
    --router-args "--prefill-policy remote" -- --backend cpu --threads 1 --metrics-port 0 \
    >"$TMP/tp.out" 2>"$TMP/tp.err" &
up=$!
for _ in $(seq 600); do grep -q '^METRICS ' "$TMP/tp.out" 2>/dev/null && break; sleep 0.1; done
raddr=$(awk '/^ROUTER /{print $2; exit}' "$TMP/tp.out")
timeout 60 "$BIN/pdserve-cli" generate --addr "$raddr" --max-tokens 8 --temperature 0 "Once upon a time" \
    >"$TMP/tp.gen" 2>&1
check "[ $? -eq 0 ] && [ -s '$TMP/tp.gen' ]" "TP 2: a completion streams ($(head -c 80 "$TMP/tp.gen" | tr '\n' ' '))"
for inst in prefill-0 decode-0; do
    p=$(grep -o "$inst 127.0.0.1:[0-9]*" "$TMP/tp.out" | head -1 | sed 's/.*://')
    check "python3 -c 'import sys,urllib.request; t=urllib.request.urlopen(\"http://127.0.0.1:%s/metrics\" % sys.argv[1], timeout=5).read().decode(); assert \"tensor_parallel=\\\"2\\\"\" in t, t[:300]' '$p'" "TP 2: $inst runs 2 ranks (pdserve_model_info)"
done
kill -TERM $up
wait $up
check "[ $? -eq 0 ]" "TP 2: SIGTERM stops the stack"

# Placement with --gpus (--dry-run: the command lines, nothing started): each TP instance takes
# the next T consecutive GPUs; a list that cannot give them, or too few GPUs, is refused.
"$BIN/pdserve-up" --model "$MODEL" --gpus 0,1,2,3 --prefill-tp 2 --decode-tp 2 --dry-run >"$TMP/dry.out" 2>&1
check "[ $? -eq 0 ] && grep -Eq '^prefill-0: .* --device 0 --tensor-parallel 2' '$TMP/dry.out' && grep -Eq '^decode-0: .* --device 2 --tensor-parallel 2' '$TMP/dry.out'" "--dry-run: prefill on GPUs 0-1, decode on 2-3"
"$BIN/pdserve-up" --model "$MODEL" --gpus 0,1,2,3 --prefill 2 --decode-tp 2 --dry-run >"$TMP/dry2.out" 2>&1
check "[ $? -eq 0 ] && grep -Eq '^prefill-1: .* --device 1\$' '$TMP/dry2.out' && grep -Eq '^decode-0: .* --device 2 --tensor-parallel 2' '$TMP/dry2.out'" "--dry-run: 2 prefill at TP 1 on GPUs 0, 1, decode at TP 2 on 2-3"
"$BIN/pdserve-up" --model "$MODEL" --gpus 0,2,1,3 --tensor-parallel 2 --dry-run >"$TMP/dry3.out" 2>&1
check "[ $? -eq 2 ] && grep -q 'consecutive' '$TMP/dry3.out'" "GPUs that are not consecutive for a TP instance are refused"
"$BIN/pdserve-up" --model "$MODEL" --gpus 0,1 --tensor-parallel 2 --dry-run >"$TMP/dry4.out" 2>&1
check "[ $? -eq 2 ] && grep -q 'need 4' '$TMP/dry4.out'" "too few GPUs for the degrees is refused"

# Papercuts (issue #40): a flag without its value is named; an HTTP port clash is reported as the
# router failing to start, with its reason, and no ROUTER line; a clean stop removes the log
# folder it made; SIGKILL of the launcher takes its servers down too.
"$BIN/pdserve-up" --model >"$TMP/noval.out" 2>&1
check "[ $? -eq 2 ] && grep -q -- '--model needs a value' '$TMP/noval.out'" "--model without a value is named (no bash error)"
python3 -c 'import socket, sys, time
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(1)
print(s.getsockname()[1], flush=True); time.sleep(120)' >"$TMP/held.port" &
holder=$!
# (python's start on two busy cores under ASan can take seconds: wait for the port as long as
# it takes, up to the test's own timeout, never for a fixed while)
for _ in $(seq 1800); do [ -s "$TMP/held.port" ] && break; sleep 0.1; done
hport=$(head -1 "$TMP/held.port")
check "[ -n '$hport' ]" "a port held by another process ($hport)"
PDSERVE_LOG_DIR=$TMP/clash timeout 60 "$BIN/pdserve-up" --model "$MODEL" --port 0 --colocated \
    --router-args "--http-listen 127.0.0.1:$hport" -- --backend cpu >"$TMP/clash.out" 2>"$TMP/clash.err"
rc=$?
kill $holder 2>/dev/null; wait $holder 2>/dev/null
check "[ $rc -eq 1 ] && grep -q 'router did not start' '$TMP/clash.err' && grep -q 'address in use' '$TMP/clash.err' && ! grep -q '^ROUTER' '$TMP/clash.out'" "an HTTP port clash: the router did not start, with its reason, no ROUTER line (rc $rc)"
grep -q 'address in use' "$TMP/clash.err" || sed 's/^/  clash.err: /' "$TMP/clash.err" | tail -n 25

"$BIN/pdserve-up" --model "$MODEL" --port 0 --colocated -- --backend cpu >"$TMP/own.out" 2>"$TMP/own.err" &
up=$!
for _ in $(seq 900); do grep -q '^ROUTER ' "$TMP/own.out" 2>/dev/null && break; sleep 0.1; done
logdir=$(grep -o 'logs in [^)]*' "$TMP/own.out" | sed 's/^logs in //')
check "[ -n '$logdir' ] && [ -d '$logdir' ]" "without PDSERVE_LOG_DIR the logs go to $logdir"
kill -TERM $up; wait $up
check "[ $? -eq 0 ] && [ ! -e '$logdir' ]" "a clean stop removes that folder"

if command -v setpriv >/dev/null 2>&1; then
    PDSERVE_LOG_DIR=$TMP/k9 "$BIN/pdserve-up" --model "$MODEL" --port 0 -- --backend cpu \
        >"$TMP/k9.out" 2>"$TMP/k9.err" &
    up=$!
    for _ in $(seq 900); do grep -q '^ROUTER ' "$TMP/k9.out" 2>/dev/null && break; sleep 0.1; done
    kids=$(pgrep -P $up | tr '\n' ' ')
    kill -KILL $up; wait $up 2>/dev/null
    left=$kids
    for _ in $(seq 300); do # bounded: the servers drain (SIGTERM) and exit
        left=""
        for k in $kids; do kill -0 "$k" 2>/dev/null && left+="$k "; done
        [ -z "$left" ] && break
        sleep 0.1
    done
    check "[ -n '$kids' ] && [ -z '$left' ]" "SIGKILL of pdserve-up: its servers ($kids) exit too"
    for k in $left; do kill -KILL "$k" 2>/dev/null; done
else
    echo "note: no setpriv here: the SIGKILL case is not checked"
fi
exit $fail
