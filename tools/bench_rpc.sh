#!/usr/bin/env bash
# bench_rpc.sh -- Benchmark of the gRPC layer on loopback: starts pdserve-rpc-testserver, runs
# pdserve-rpc-bench (our C client) for unary calls/s at several client thread counts and for
# small-message stream msgs/s, then stops the server. Figures go to docs/perf-history.md ("gRPC
# layer"). usage: tools/bench_rpc.sh [BIN_DIR (default build-rel/bin)] [SECONDS (default 5)]
set -euo pipefail
BIN=${1:-build-rel/bin}
SECS=${2:-5}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$BIN/pdserve-rpc-testserver" --port-file "$work/port" >/dev/null 2>"$work/server.log" &
pid=$!
for _ in $(seq 100); do [ -s "$work/port" ] && break; sleep 0.1; done
target="127.0.0.1:$(cat "$work/port")"
echo "# $(date -u +%Y-%m-%dT%H:%MZ) $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
for t in 1 4 8 16; do
  "$BIN/pdserve-rpc-bench" --target "$target" --mode unary --threads "$t" --seconds "$SECS"
done
for k in 1 4; do
  "$BIN/pdserve-rpc-bench" --target "$target" --mode stream --streams "$k" --tokens $((800000 / k))
done
kill -TERM "$pid"
wait "$pid"
tail -n 1 "$work/server.log"
