#!/usr/bin/env bash
# bench_kvt.sh -- Measures the KV transfer (pdserve-kvt-bench) against ucx_perftest on the same
# transports in the same run, plus the memcpy ceiling of the machine, and prints the figures
# for docs/perf-history.md ("KV transfer"). Rounds alternate perftest and kvt so that load from
# other processes hits both alike; the median over rounds is reported, with the best in brackets.
#
#   tools/bench_kvt.sh [ROUNDS]        (default 5; needs ucx-utils for ucx_perftest)
#
# Environment: BUILD (release build dir, default build-kvt-rel), CPUS ("0,1": receiver and
# sender / perftest server and client), ITERS (kvt transfers per round, default 10),
# IDLE_WAIT (seconds to wait for an idle machine before each round, default 60).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-5}
BUILD=${BUILD:-build-kvt-rel}
CPUS=${CPUS:-0,1}
ITERS=${ITERS:-10}
C0=${CPUS%,*}
C1=${CPUS#*,}
PORT=$((20000 + $$ % 10000))

command -v ucx_perftest >/dev/null || { echo "ucx_perftest not found (apt install ucx-utils)" >&2; exit 1; }
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$BUILD" -j"$(nproc)" --target pdserve-kvt-bench >/dev/null
BENCH=$BUILD/bin/pdserve-kvt-bench
export UCX_WARN_UNUSED_ENV_VARS=n UCX_LOG_FILE=stderr

# Busy share of all CPUs over one second, in percent (other sessions may share the machine).
busy() {
  local a b c d u n s i w q sq st
  read -r _ u n s i w q sq st _ </proc/stat; a=$((u + n + s + q + sq + st)); b=$((i + w))
  sleep 1
  read -r _ u n s i w q sq st _ </proc/stat; c=$((u + n + s + q + sq + st)); d=$((i + w))
  echo $(((c - a) * 100 / ((c - a) + (d - b) + 1)))
}

# perftest TEST SIZE: prints GB/s (10^9 B/s; perftest's "MB/s" is MiB/s), "overall" column.
perftest() {
  local test=$1 size=$2 out
  taskset -c "$C0" ucx_perftest -p "$PORT" >/dev/null 2>&1 &
  local srv=$!
  sleep 0.5
  out=$(taskset -c "$C1" ucx_perftest localhost -p "$PORT" -t "$test" -s "$size" -n 200 -w 20 2>/dev/null |
        awk '/^Final:/ {print $7}')
  wait "$srv" 2>/dev/null || true
  PORT=$((PORT + 1))
  awk -v m="${out:-0}" 'BEGIN {printf "%.2f", m * 1048576 / 1e9}'
}

# kvt ARGS...: prints the median GB/s of the run's transfers (sender: begin -> ACK).
kvt() {
  "$BENCH" --cpus "$CPUS" --iters "$ITERS" "$@" 2>/dev/null | awk '/^RESULT/ {
    for (i = 2; i <= NF; i++) { split($i, kv, "="); if (kv[1] == "gbps_median") print kv[2] } }'
}

stats() { # median [best] of the numbers on stdin
  sort -g | awk '{v[NR] = $1} END {printf "%.2f [%.2f]", v[int((NR + 1) / 2)], v[NR]}'
}

echo "# KV transfer benchmark, $(date -u +%Y-%m-%d)"
echo "# CPU: $(lscpu | awk -F: '/Model name/ {gsub(/^ +/, "", $2); print $2}'), $(nproc) cores;" \
     "UCX $(ucx_info -v | awk '/# Version/ {print $3}')"
echo "# pattern: 32 layers x 64 blocks x (16 tok x 8 heads x 128 dim, bf16) x {K,V} = 128 MiB" \
     "per transfer into permuted slots of a 512 MiB pool (16 MiB rows: 8 blocks into an 8-block" \
     "pool, like perftest's one reused buffer); rounds: $ROUNDS, busy before: $(busy)%"

declare -A R
memcpy() { # memcpy ARGS...: GB/s of the local copy of the same pattern
  "$BENCH" --memcpy --cpus "$CPUS" --iters "$ITERS" "$@" | awk '/^RESULT/ {
    for (i = 2; i <= NF; i++) { split($i, kv, "="); if (kv[1] == "gbps_median") print kv[2] } }'
}
# 16 MiB into the same slots every time, like perftest's reused buffer; not verified (the
# receiver reading the slots would pull them into its core's cache, which perftest never does;
# the 128 MiB rows and the tests verify every byte).
SMALL="--blocks 8 --pool-blocks 8 --iters $((ITERS * 4)) --no-verify"
# Waits (at most IDLE_WAIT s) for the machine to be idle before a round.
quiet() {
  local t=0 b
  while (( t < ${IDLE_WAIT:-60} )); do b=$(busy); (( b <= 15 )) && return; t=$((t + 1)); done
  echo "# round $r starts busy ($b%)" >&2
}
for ((r = 1; r <= ROUNDS; r++)); do
  quiet
  R[memcpy]+="$(memcpy) "
  R[memcpy_16m]+="$(memcpy $SMALL) "
  export UCX_TLS=sysv,cma UCX_MM_ERROR_HANDLING=y
  R[pt_put_shm]+="$(perftest ucp_put_bw 16777216) "
  R[kvt_shm]+="$(kvt) "
  R[kvt_shm_16m]+="$(kvt $SMALL) "
  R[kvt_shm_16m_contig]+="$(kvt $SMALL --contiguous) "
  unset UCX_MM_ERROR_HANDLING
  export UCX_TLS=tcp UCX_NET_DEVICES=lo
  R[pt_am_tcp]+="$(perftest ucp_am_bw 16777216) "
  R[pt_am_tcp_1m]+="$(perftest ucp_am_bw 1048576) "
  R[kvt_tcp]+="$(kvt) "
  R[kvt_tcp_16m]+="$(kvt $SMALL) "
  unset UCX_TLS UCX_NET_DEVICES
  echo "# round $r done" >&2
done

med() { tr ' ' '\n' <<<"$1" | grep -v '^$' | sort -g | awk '{v[NR] = $1} END {print v[int((NR + 1) / 2)]}'; }
row() { printf "| %-66s | %s |\n" "$1" "$(tr ' ' '\n' <<<"$2" | grep -v '^$' | stats)"; }
ratio() { awk -v a="$(med "$1")" -v b="$(med "$2")" 'BEGIN {printf "%.0f%%", 100 * a / b}'; }
echo
echo "| shm (UCX_TLS=sysv,cma), GB/s = 10^9 B/s, median [best] of $ROUNDS rounds | GB/s |"
echo "|---|---|"
row "memcpy, 128 MiB pattern, one core (the ceiling of the row below)" "${R[memcpy]}"
row "pdserve-kvt-bench, 128 MiB pattern (put path), verified" "${R[kvt_shm]}"
row "memcpy, 16 MiB permuted, cache-resident" "${R[memcpy_16m]}"
row "pdserve-kvt-bench, 16 MiB permuted, cache-resident, unverified" "${R[kvt_shm_16m]}"
row "pdserve-kvt-bench, 16 MiB contiguous slots (1 MiB copies), unverified" "${R[kvt_shm_16m_contig]}"
row "ucx_perftest ucp_put_bw 16 MiB (one buffer, cache-resident)" "${R[pt_put_shm]}"
echo
echo "| tcp (UCX_TLS=tcp, UCX_NET_DEVICES=lo) | GB/s |"
echo "|---|---|"
row "ucx_perftest ucp_am_bw 16 MiB" "${R[pt_am_tcp]}"
row "ucx_perftest ucp_am_bw 1 MiB" "${R[pt_am_tcp_1m]}"
row "pdserve-kvt-bench, 128 MiB pattern (AM path), verified" "${R[kvt_tcp]}"
row "pdserve-kvt-bench, 16 MiB permuted, unverified" "${R[kvt_tcp_16m]}"
echo
echo "# ratios of medians: shm 128 MiB kvt/memcpy $(ratio "${R[kvt_shm]}" "${R[memcpy]}")," \
     "shm 16 MiB kvt/perftest put $(ratio "${R[kvt_shm_16m]}" "${R[pt_put_shm]}") (permuted)," \
     "$(ratio "${R[kvt_shm_16m_contig]}" "${R[pt_put_shm]}") (contiguous);" \
     "tcp kvt/perftest am 16 MiB $(ratio "${R[kvt_tcp]}" "${R[pt_am_tcp]}") (128 MiB)," \
     "$(ratio "${R[kvt_tcp_16m]}" "${R[pt_am_tcp]}") (16 MiB)"
echo "# busy after: $(busy)%"
