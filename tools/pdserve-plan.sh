#!/usr/bin/env bash
# pdserve-plan -- the placement planner: for N GPUs of one host, finds the goodput of every
# xPyD split (x prefill + y decode instances, x + y = N, one per GPU) and of N colocated
# instances for one workload and SLO, with pdserve-up --gpus and pdserve-bench
# --find-goodput, one deployment at a time, unattended; prints a table, writes an SVG bar chart
# and a JSON summary, and says which deployment to run. Installed as build/bin/pdserve-plan
# beside the binaries it starts.
set -uo pipefail
BIN=$(cd "$(dirname "$0")" && pwd)
MODEL="" GPUS="" SPLITS="" OUT="" BENCH_ARGS="" INST_ARGS="" ROUTER_ARGS="" COLOCATED=1
QUANT="auto" KV_DTYPE="auto" PTP=1 DTP=1
usage() {
    cat <<USAGE
usage: pdserve-plan --model DIR --gpus LIST [--splits P:D,...] [--no-colocated] [--out DIR]
                    [--bench-args "ARGS"] [--instance-args "ARGS"] [--router-args "ARGS"]
                    [--quantization auto|none|fp8] [--kv-cache-dtype auto|bf16|fp8]
                    [--tensor-parallel T | --prefill-tp T --decode-tp T]

For the GPUs in LIST (e.g. 0,1,2,3: N = 4), measures the goodput of each split P:D with
P + D = N (default all, 1:N-1 .. N-1:1) and of N colocated instances (unless
--no-colocated), each started with pdserve-up --gpus LIST and searched with pdserve-bench
--find-goodput. --bench-args go to every search (workload and SLO: e.g. "--input-len
1024:3072 --output-len 64:256 --slo-ttft-ms 1000 --slo-tpot-ms 10 --rate 8 --num-requests
120 --seed 1"); --instance-args to every instance (e.g. "--load-format dummy --kv-cache-mb
16384"). Results in --out (default ./pdserve-plan-<date>): one folder per deployment with the
search's JSON and plots, every instance's metrics after the search (metrics/), plan.json,
plan.svg; the table and the recommendation on stdout. --quantization and --kv-cache-dtype
(docs/quantization.md) go to every instance, prefill, decode and colocated alike (the KV
layouts of a split must match), and are recorded in plan.json. --prefill-tp and --decode-tp
(--tensor-parallel: both) run each prefill or decode instance over T consecutive GPUs of LIST
(pdserve-up's): a split P:D then takes P x T_prefill + D x T_decode GPUs (the default splits:
every P with the most decode instances that fit), colocated N / T_decode instances; the
deployments' names end in -tpP.D (e.g. 1P1D-tp2.2).
The router of each deployment runs with its defaults (conditional disaggregation on) and the
SLO of --bench-args (its --slo-ttft-ms and --slo-tpot-ms, which the busy rule uses), plus
--router-args; put PDSERVE_PREFILL_POLICY=remote in the environment (or --prefill-policy
remote in --router-args) to measure every prompt remote.
USAGE
}
while [ $# -gt 0 ]; do
    case "$1" in
        --model) MODEL=$2; shift 2 ;;
        --gpus) GPUS=$2; shift 2 ;;
        --splits) SPLITS=$2; shift 2 ;;
        --no-colocated) COLOCATED=0; shift ;;
        --out) OUT=$2; shift 2 ;;
        --bench-args) BENCH_ARGS=$2; shift 2 ;;
        --instance-args) INST_ARGS=$2; shift 2 ;;
        --router-args) ROUTER_ARGS=$2; shift 2 ;;
        --quantization) QUANT=$2; shift 2 ;;
        --kv-cache-dtype) KV_DTYPE=$2; shift 2 ;;
        --tensor-parallel) PTP=$2; DTP=$2; shift 2 ;;
        --prefill-tp) PTP=$2; shift 2 ;;
        --decode-tp) DTP=$2; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "pdserve-plan: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
    esac
done
[ -n "$MODEL" ] || { echo "pdserve-plan: --model DIR is required" >&2; exit 2; }
[ -n "$GPUS" ] || { echo "pdserve-plan: --gpus LIST is required (e.g. 0,1)" >&2; exit 2; }
IFS=, read -r -a GL <<<"$GPUS"
N=${#GL[@]}
for t in "$PTP" "$DTP"; do
    [[ $t =~ ^[1-9][0-9]*$ ]] || { echo "pdserve-plan: tensor-parallel degree '$t' is not a number >= 1" >&2; exit 2; }
done
[ "$N" -ge $((PTP + DTP)) ] ||
    { echo "pdserve-plan: a split needs at least $((PTP + DTP)) GPUs (a prefill instance at TP $PTP and a decode instance at TP $DTP)" >&2; exit 2; }
if [ -z "$SPLITS" ]; then # every split that fits: P prefill and D decode instances, GPUs P*PTP + D*DTP
    for ((p = 1; p * PTP + DTP <= N; p++)); do SPLITS+="${SPLITS:+,}$p:$(((N - p * PTP) / DTP))"; done
fi
DEPS=()
IFS=, read -r -a SL <<<"$SPLITS"
for s in "${SL[@]}"; do
    [[ $s =~ ^([0-9]+):([0-9]+)$ ]] || { echo "pdserve-plan: split '$s' is not P:D" >&2; exit 2; }
    [ $((BASH_REMATCH[1] * PTP + BASH_REMATCH[2] * DTP)) -le "$N" ] && [ "${BASH_REMATCH[1]}" -ge 1 ] &&
        [ "${BASH_REMATCH[2]}" -ge 1 ] ||
        { echo "pdserve-plan: split $s needs P, D >= 1 and P x $PTP + D x $DTP <= $N GPUs" >&2; exit 2; }
    DEPS+=("$s")
done
NCOL=$((N / DTP)) # colocated instances, each at the decode degree
[ "$COLOCATED" = 1 ] && DEPS+=("colocated")
TPS="" # the deployments' names carry the degrees when any is above 1
[ "$PTP" -gt 1 ] || [ "$DTP" -gt 1 ] && TPS="-tp$PTP.$DTP"
case "$QUANT" in auto|none|fp8) ;; *) echo "pdserve-plan: --quantization $QUANT: give auto, none or fp8" >&2; exit 2 ;; esac
case "$KV_DTYPE" in auto|bf16|fp8) ;; *) echo "pdserve-plan: --kv-cache-dtype $KV_DTYPE: give auto, bf16 or fp8" >&2; exit 2 ;; esac
OUT=${OUT:-./pdserve-plan-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
# shellcheck disable=SC2206
IA=($INST_ARGS --quantization "$QUANT" --kv-cache-dtype "$KV_DTYPE")
# shellcheck disable=SC2206
BA=($BENCH_ARGS)
# The routers get the searches' objectives (as deployed: the busy rule and the goodput metric
# use them).
RA=""
for ((k = 0; k + 1 < ${#BA[@]}; k++)); do
    case ${BA[k]} in --slo-ttft-ms|--slo-tpot-ms) RA+="${RA:+ }${BA[k]} ${BA[k + 1]}" ;; esac
done
RA+="${ROUTER_ARGS:+${RA:+ }$ROUTER_ARGS}"
echo "pdserve-plan: $N GPUs ($GPUS), deployments: ${DEPS[*]}; results in $OUT" >&2

# snapshot_metrics DIR: every instance's Prometheus text after the search (DIR/metrics/NAME.prom,
# from the "METRICS name host:port, ..." line of pdserve-up), and the router's prefill
# decisions (where each prompt was computed, and why) on stderr.
snapshot_metrics() {
    local d=$1 line item name hp
    line=$(awk '/^METRICS /{sub(/^METRICS /, ""); print; exit}' "$d/up.out" 2>/dev/null)
    [ -n "$line" ] || return 0
    mkdir -p "$d/metrics"
    IFS=, read -r -a items <<<"$line"
    for item in "${items[@]}"; do
        read -r name hp <<<"$item"
        [ -n "$hp" ] || continue
        if command -v curl >/dev/null; then
            curl -s -m 5 "http://$hp/metrics" >"$d/metrics/$name.prom" 2>/dev/null
        else
            python3 -c 'import sys, urllib.request
sys.stdout.write(urllib.request.urlopen("http://%s/metrics" % sys.argv[1], timeout=5).read().decode())' \
                "$hp" >"$d/metrics/$name.prom" 2>/dev/null
        fi
    done
    [ -f "$d/metrics/router.prom" ] &&
        awk '/^pdserve_router_prefill_decisions_total/ { gsub(/pdserve_router_prefill_decisions_total/, ""); printf "%s%s", (n++ ? ", " : "pdserve-plan:   prefill decisions: "), $0 } END { if (n) print "" }' \
            "$d/metrics/router.prom" >&2
    return 0
}

RESULTS=()
for dep in "${DEPS[@]}"; do
    if [ "$dep" = colocated ]; then
        name="colocated-x$NCOL${TPS:+-tp$DTP}" up=(--colocated --decode "$NCOL" --decode-tp "$DTP")
    else
        p=${dep%:*} d=${dep#*:}
        name="${p}P${d}D$TPS" up=(--prefill "$p" --decode "$d" --prefill-tp "$PTP" --decode-tp "$DTP")
    fi
    dir="$OUT/$name"
    mkdir -p "$dir"
    echo "pdserve-plan: $name: starting" >&2
    t0=$(date +%s)
    PDSERVE_LOG_DIR="$dir/logs" "$BIN/pdserve-up" --model "$MODEL" --port 0 --gpus "$GPUS" "${up[@]}" \
        ${RA:+--router-args "$RA"} \
        -- "${IA[@]}" >"$dir/up.out" 2>"$dir/up.err" &
    pid=$!
    addr=""
    for _ in $(seq $(( (${PDSERVE_UP_START_S:-120} * 2 + 60) * 10 ))); do # pdserve-up gives up on its own first
        addr=$(awk '/^ROUTER /{print $2; exit}' "$dir/up.out" 2>/dev/null)
        [ -n "$addr" ] && break
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    if [ -z "$addr" ]; then
        echo "pdserve-plan: $name did not start; see $dir/up.err and $dir/logs" >&2
        RESULTS+=("$name -1 0")
        kill -TERM "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
        continue
    fi
    "$BIN/pdserve-bench" --addr "$addr" --find-goodput "${BA[@]}" --json "$dir/result.json" \
        --plot-dir "$dir" >"$dir/bench.txt" 2>"$dir/bench.err"
    snapshot_metrics "$dir"
    kill -TERM "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
    g=$(awk '/^goodput/{print ($2 ~ /^[0-9.]+$/) ? $2 : ($2 == ">=" ? $3 : 0); exit}' "$dir/bench.txt")
    g=${g:-0}
    # ">= X": every probed rate passed (or the search was cut short): a lower bound.
    grep -q '^goodput *>=' "$dir/bench.txt" && g="$g+"
    echo "pdserve-plan: $name: goodput ${g} req/s ($(( $(date +%s) - t0 )) s)" >&2
    RESULTS+=("$name $g $(( $(date +%s) - t0 ))")
done

# The table, the recommendation, plan.json and plan.svg.
printf '%s\n' "${RESULTS[@]}" | awk -v n="$N" -v out="$OUT" -v quant="$QUANT" -v kvd="$KV_DTYPE" -v ptp="$PTP" -v dtp="$DTP" -v ncol="$NCOL" '
{ name[NR] = $1; g[NR] = $2 + 0; lb[NR] = ($2 ~ /\+$/); secs[NR] = $3; if ($1 ~ /^colocated/) col = $2 + 0 }
END {
    best = 1  # ties go to colocated: the same goodput with one kind of instance
    for (i = 1; i <= NR; i++)
        if (g[i] > g[best] || (g[i] == g[best] && name[i] ~ /^colocated/)) best = i
    printf "%-14s %12s %14s %8s\n", "deployment", "goodput", "vs colocated", "time"
    for (i = 1; i <= NR; i++) {
        rel = (col > 0 && g[i] >= 0) ? sprintf("%.2fx", g[i] / col) : "-"
        gs = g[i] < 0 ? "failed" : sprintf("%s%.2f req/s", lb[i] ? ">=" : "", g[i])
        printf "%-14s %12s %14s %7ss%s\n", name[i], gs, rel, secs[i], i == best ? "  <- best" : ""
    }
    if (g[best] <= 0) { print "deploy: no deployment met the SLO at any rate searched"; exit }
    for (i = 1; i <= NR; i++) if (lb[i]) { print "note: >= marks a lower bound (every probed rate met the SLO): raise --rate or --max-probes in --bench-args to compare"; break }
    printf "deploy: %s (goodput %.2f req/s", name[best], g[best]
    if (col > 0) printf ", %.2fx colocated x%d", g[best] / col, ncol
    printf ")\n"
    if (name[best] ~ /^[0-9]+P[0-9]+D/) {
        split(name[best], a, /[PD]/)
        printf "kubernetes: per %d-GPU host, prefill replicas %d and decode replicas %d (deploy/k8s: the prefill and decode Deployments), %s\n", n, a[1], a[2], (ptp == 1 && dtp == 1) ? "one GPU each" : sprintf("%d GPUs a prefill replica and %d a decode replica (--tensor-parallel)", ptp, dtp)
    } else {
        printf "kubernetes: %d colocated decode replicas (pdserve-decode --colocated, no prefill Deployment)%s\n", ncol, (dtp > 1 ? sprintf(", %d GPUs each (--tensor-parallel %d)", dtp, dtp) : "")
    }
    # plan.json
    f = out "/plan.json"
    printf "{\"gpus\": %d, \"quantization\": \"%s\", \"kv_cache_dtype\": \"%s\", \"tensor_parallel\": {\"prefill\": %d, \"decode\": %d}, \"deployments\": [", n, quant, kvd, ptp, dtp > f
    for (i = 1; i <= NR; i++)
        printf "%s{\"name\": \"%s\", \"goodput_rps\": %s, \"seconds\": %s}", (i > 1 ? ", " : ""), name[i], (g[i] < 0 ? "null" : g[i]), secs[i] > f
    printf "], \"best\": \"%s\"}\n", name[best] > f
    # plan.svg: one bar per deployment
    s = out "/plan.svg"; W = 120 * NR + 80; H = 320; top = g[best] > 0 ? g[best] * 1.15 : 1
    printf "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" font-family=\"sans-serif\" font-size=\"12\">\n", W, H > s
    printf "<text x=\"10\" y=\"18\" font-size=\"14\">goodput (req/s within the SLO) per deployment, %d GPUs</text>\n", n > s
    for (i = 1; i <= NR; i++) {
        h = g[i] > 0 ? 220 * g[i] / top : 0; x = 60 + 120 * (i - 1)
        printf "<rect x=\"%d\" y=\"%.1f\" width=\"80\" height=\"%.1f\" fill=\"%s\"/>\n", x, 270 - h, h, (name[i] ~ /^colocated/ ? "#999" : (i == best ? "#2a7" : "#58c")) > s
        printf "<text x=\"%d\" y=\"%.1f\" text-anchor=\"middle\">%s</text>\n", x + 40, 265 - h, (g[i] < 0 ? "failed" : sprintf("%.2f", g[i])) > s
        printf "<text x=\"%d\" y=\"290\" text-anchor=\"middle\">%s</text>\n", x + 40, name[i] > s
    }
    printf "<line x1=\"50\" y1=\"270\" x2=\"%d\" y2=\"270\" stroke=\"black\"/>\n</svg>\n", W - 20 > s
}' | tee "$OUT/plan.txt"
