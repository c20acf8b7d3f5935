#!/usr/bin/env bash
# pdserve-up -- starts a local pdserve stack on loopback: N prefill and M decode instances (or
# M colocated decode instances) and the router on --port; waits until every process answers
# its health check, prints where the router listens, and stops everything cleanly on Ctrl-C
# or SIGTERM (each process drains). Installed as build/bin/pdserve-up; it runs the binaries
# beside it.
set -uo pipefail
BIN=$(cd "$(dirname "$0")" && pwd)
MODEL=${PDSERVE_MODEL:-}
PORT=50051 N_PREFILL=1 N_DECODE=1 COLOCATED=0 EXTRA=() GPUS="" ROUTER_ARGS="" DRY_RUN=0
PREFILL_TP=1 DECODE_TP=1
usage() {
    cat <<USAGE
usage: pdserve-up --model DIR [--port P] [--colocated] [--prefill N] [--decode M]
                  [--gpus LIST] [--tensor-parallel T | --prefill-tp T --decode-tp T]
                  [--router-args "ARGS"] [--dry-run] [-- ARGS...]

Starts pdserve on loopback: N prefill instances (default 1) and M decode instances (default
1), or with --colocated M decode instances that also compute prompts, plus the router on
port P (default 50051; 0 = any free port). --gpus 0,1,... places the instances on those GPUs,
one per GPU in turn (prefill instances first, then decode), each with --device N and every
GPU visible, so that KV moves device to device between them (--kv-transport); each instance
then sizes its pool from --gpu-memory-utilization unless ARGS size it. --prefill-tp and
--decode-tp (--tensor-parallel: both) split each prefill or decode instance over T GPUs
(--tensor-parallel T): with --gpus it takes the next T of LIST, which must be consecutive
ordinals (the instance runs on --device D .. D + T - 1). --dry-run prints each process's
command line and exits. ARGS after -- go to
every instance (e.g. --kv-cache-mb 512 --backend cpu); --router-args to the router (e.g.
"--metrics-port 0 --http-listen 127.0.0.1:8000"). Prints where the router listens ("ROUTER
host:port"), for each process started with --metrics-port where its /metrics is, and with
--http-listen the OpenAI-compatible base URL ("HTTP http://..."). Ctrl-C or SIGTERM
stops the stack (exit 0); a process that fails to start or dies stops it too (exit 1).
Without PDSERVE_LOG_DIR the logs go to a fresh /tmp/pdserve-up.* folder, removed when the
stack stops cleanly and kept (its path printed) when something failed. The processes started
die with pdserve-up even when it is killed with SIGKILL (setpriv --pdeathsig, util-linux).
USAGE
}
while [ $# -gt 0 ]; do
    case "$1" in
        --model|--port|--prefill|--decode|--gpus|--router-args|--tensor-parallel|--prefill-tp|--decode-tp)
            [ $# -ge 2 ] || { echo "pdserve-up: $1 needs a value" >&2; usage >&2; exit 2; } ;;
    esac
    case "$1" in
        --model) MODEL=$2; shift 2 ;;
        --port) PORT=$2; shift 2 ;;
        --prefill) N_PREFILL=$2; shift 2 ;;
        --decode) N_DECODE=$2; shift 2 ;;
        --colocated) COLOCATED=1; shift ;;
        --gpus) GPUS=$2; shift 2 ;;
        --router-args) ROUTER_ARGS=$2; shift 2 ;;
        --tensor-parallel) PREFILL_TP=$2; DECODE_TP=$2; shift 2 ;;
        --prefill-tp) PREFILL_TP=$2; shift 2 ;;
        --decode-tp) DECODE_TP=$2; shift 2 ;;
        --dry-run) DRY_RUN=1; shift ;;
        -h|--help) usage; exit 0 ;;
        --) shift; EXTRA=("$@"); break ;;
        *) echo "pdserve-up: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
    esac
done
[ -n "$MODEL" ] || { echo "pdserve-up: --model DIR is required" >&2; exit 2; }
[ -f "$MODEL/config.json" ] || { echo "pdserve-up: $MODEL/config.json not found" >&2; exit 2; }
for n in "$N_PREFILL" "$N_DECODE" "$PORT" "$PREFILL_TP" "$DECODE_TP"; do
    [[ $n =~ ^[0-9]+$ ]] || { echo "pdserve-up: '$n' is not a number" >&2; exit 2; }
done
[ "$PREFILL_TP" -ge 1 ] && [ "$DECODE_TP" -ge 1 ] ||
    { echo "pdserve-up: a tensor-parallel degree is at least 1" >&2; exit 2; }
if [ "$COLOCATED" = 1 ]; then N_PREFILL=0; fi
IFS=, read -r -a GPU_LIST <<<"$GPUS"
for d in "${GPU_LIST[@]}"; do
    [[ $d =~ ^[0-9]+$ ]] || { echo "pdserve-up: --gpus: '$d' is not a GPU number" >&2; exit 2; }
done
# Several instances share this host (and its GPU): give each a fixed KV pool unless the caller
# sized it (a GPU instance otherwise takes --gpu-memory-utilization 0.9 of the card). With --gpus each instance has
# GPUs of its own (when there are as many as its instances need).
NEED_GPUS=$((N_PREFILL * PREFILL_TP + N_DECODE * DECODE_TP))
if [ ${#GPU_LIST[@]} -gt 0 ] && [ ${#GPU_LIST[@]} -lt "$NEED_GPUS" ] &&
    { [ "$PREFILL_TP" -gt 1 ] || [ "$DECODE_TP" -gt 1 ]; }; then
    echo "pdserve-up: --gpus $GPUS has ${#GPU_LIST[@]} GPUs; $N_PREFILL prefill at TP $PREFILL_TP and $N_DECODE decode at TP $DECODE_TP need $NEED_GPUS" >&2
    exit 2
fi
if [ ${#GPU_LIST[@]} -eq 0 ] || [ ${#GPU_LIST[@]} -lt "$NEED_GPUS" ]; then
    case " ${EXTRA[*]} " in
        *" --kv-cache-mb"*|*" --gpu-memory-utilization"*) ;;
        *) EXTRA=(--kv-cache-mb 256 "${EXTRA[@]}") ;;
    esac
fi
NEXT_GPU=0
gpu_args() { # gpu_args TP: sets DEV to the next instance's (--device N [--tensor-parallel TP])
    local tp=$1 first j
    DEV=()
    if [ ${#GPU_LIST[@]} -gt 0 ]; then
        first=${GPU_LIST[$((NEXT_GPU % ${#GPU_LIST[@]}))]}
        for ((j = 1; j < tp; j++)); do # a TP instance's GPUs: --device .. --device + TP - 1
            if [ "${GPU_LIST[$(((NEXT_GPU + j) % ${#GPU_LIST[@]}))]}" != $((first + j)) ]; then
                echo "pdserve-up: --gpus $GPUS: an instance at TP $tp takes $tp consecutive GPUs from $first (it runs on GPUs $first .. $((first + tp - 1)))" >&2
                exit 2
            fi
        done
        DEV=(--device "$first")
        NEXT_GPU=$((NEXT_GPU + tp))
    fi
    [ "$tp" -gt 1 ] && DEV+=(--tensor-parallel "$tp")
    return 0
}
gpus_of() { # where the instance of DEV runs, for the log
    [ ${#DEV[@]} -gt 0 ] && [ "${DEV[0]}" = --device ] || return 0
    local tp=1
    [ ${#DEV[@]} -ge 4 ] && tp=${DEV[3]}
    if [ "$tp" -gt 1 ]; then echo "GPUs ${DEV[1]} .. $((DEV[1] + tp - 1)) (TP $tp)"; else echo "GPU ${DEV[1]}"; fi
}
[ "$N_DECODE" -ge 1 ] || { echo "pdserve-up: at least one decode instance" >&2; exit 2; }

# Logs: PDSERVE_LOG_DIR, or a fresh folder under /tmp that a clean stop removes (a failure keeps
# it, and says where).
LOGS=${PDSERVE_LOG_DIR:-} OWN_LOGS=0
if [ "$DRY_RUN" = 0 ]; then
    [ -n "$LOGS" ] || { LOGS=$(mktemp -d /tmp/pdserve-up.XXXXXX); OWN_LOGS=1; }
    mkdir -p "$LOGS"
fi
# The servers die with this launcher, even when it is killed with SIGKILL (no trap runs then):
# each starts under setpriv --pdeathsig TERM where util-linux has it.
PDEATH=()
if command -v setpriv >/dev/null 2>&1 && setpriv --pdeathsig TERM true 2>/dev/null; then
    PDEATH=(setpriv --pdeathsig TERM --)
fi
export UCX_WARN_UNUSED_ENV_VARS=${UCX_WARN_UNUSED_ENV_VARS:-n}
PIDS=() NAMES=()
stopping=0
stop() { # stop [EXIT CODE]: stops every process, router first; exits with the code (0)
    [ $stopping = 1 ] && return
    stopping=1
    echo "pdserve-up: stopping (router first, then instances)" >&2
    for ((i=${#PIDS[@]}-1; i>=0; i--)); do kill -TERM "${PIDS[$i]}" 2>/dev/null; wait "${PIDS[$i]}" 2>/dev/null; done
    if [ "${1:-0}" = 0 ] && [ "$OWN_LOGS" = 1 ]; then
        rm -rf "$LOGS"
    elif [ -n "$LOGS" ]; then
        echo "pdserve-up: logs kept in $LOGS" >&2
    fi
    exit "${1:-0}"
}
trap 'stop 0' INT TERM

# launch NAME LOG ARGS...: runs NAME in the background (its pid in LAST_PID); --dry-run prints
# the command line instead. Instances start together (a large model's load takes each a while).
launch() {
    local name=$1 log=$2; shift 2
    LAST_PID=""
    if [ "$DRY_RUN" = 1 ]; then
        printf '%s' "$log:"; printf ' %q' "$BIN/$name" "$@"; printf '\n'
        return 0
    fi
    "${PDEATH[@]}" "$BIN/$name" "$@" >"$LOGS/$log.out" 2>"$LOGS/$log.log" &
    LAST_PID=$!
    PIDS+=("$LAST_PID")
    NAMES+=("$log")
}
# await_port LOG PID: PORT_OUT from the process's "PORT n" line, waited for until DEADLINE
# (SECONDS; PDSERVE_UP_START_S, default 120 s, after the launch: a 70B model with dummy FP8
# weights takes longer); a process that exits or misses it stops the stack.
await_port() {
    local log=$1 pid=$2
    if [ "$DRY_RUN" = 1 ]; then PORT_OUT="<$log-port>"; return 0; fi
    while [ "$SECONDS" -lt "$DEADLINE" ]; do
        if grep -q '^PORT ' "$LOGS/$log.out" 2>/dev/null; then
            PORT_OUT=$(awk '/^PORT /{print $2; exit}' "$LOGS/$log.out"); return 0
        fi
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    echo "pdserve-up: $log did not start (no PORT line within ${PDSERVE_UP_START_S:-120} s, or it exited; PDSERVE_UP_START_S waits longer); its log ($LOGS/$log.log):" >&2
    tail -20 "$LOGS/$log.log" >&2
    stop 1
}
PREFILLS="" DECODES="" P_PIDS=() D_PIDS=()
for ((i=0; i<N_PREFILL; i++)); do
    gpu_args "$PREFILL_TP"
    launch pdserve-prefill "prefill-$i" --model "$MODEL" --listen 127.0.0.1:0 --instance-id "prefill-$i" "${DEV[@]}" "${EXTRA[@]}"
    P_PIDS+=("$LAST_PID")
    where=$(gpus_of)
    [ -n "$where" ] && echo "pdserve-up: prefill-$i on $where" >&2
done
for ((i=0; i<N_DECODE; i++)); do
    if [ "$COLOCATED" = 1 ]; then col=(--colocated); else col=(); fi
    gpu_args "$DECODE_TP"
    launch pdserve-decode "decode-$i" --model "$MODEL" --listen 127.0.0.1:0 --instance-id "decode-$i" "${col[@]}" "${DEV[@]}" "${EXTRA[@]}"
    D_PIDS+=("$LAST_PID")
    where=$(gpus_of)
    [ -n "$where" ] && echo "pdserve-up: decode-$i on $where" >&2
done
DEADLINE=$((SECONDS + ${PDSERVE_UP_START_S:-120}))
for ((i=0; i<N_PREFILL; i++)); do
    await_port "prefill-$i" "${P_PIDS[$i]}"
    PREFILLS+="${PREFILLS:+,}127.0.0.1:$PORT_OUT"
done
for ((i=0; i<N_DECODE; i++)); do
    await_port "decode-$i" "${D_PIDS[$i]}"
    DECODES+="${DECODES:+,}127.0.0.1:$PORT_OUT"
done
ARGS=(--model "$MODEL" --listen "127.0.0.1:$PORT" --decode "$DECODES")
[ -n "$PREFILLS" ] && ARGS+=(--prefill "$PREFILLS")
# shellcheck disable=SC2206
[ -n "$ROUTER_ARGS" ] && ARGS+=($ROUTER_ARGS)
launch pdserve-router router "${ARGS[@]}"
DEADLINE=$((SECONDS + ${PDSERVE_UP_START_S:-120}))
await_port router "$LAST_PID"
[ "$DRY_RUN" = 1 ] && exit 0
ROUTER=$PORT_OUT
for _ in $(seq 100); do
    "$BIN/pdserve-cli" health --addr "127.0.0.1:$ROUTER" >/dev/null 2>&1 && break
    sleep 0.1
done
echo "pdserve-up: router listening on 127.0.0.1:$ROUTER (prefill: ${PREFILLS:-none}; decode: $DECODES${COLOCATED:+}; logs in $LOGS)"
echo "ROUTER 127.0.0.1:$ROUTER"
# Where each process serves /metrics (those started with --metrics-port print it after PORT).
sleep 0.2
MLINE=""
for f in "$LOGS"/*.out; do
    m=$(awk '/^METRICS_PORT /{print $2; exit}' "$f" 2>/dev/null)
    [ -n "$m" ] && MLINE+="${MLINE:+, }$(basename "$f" .out) 127.0.0.1:$m"
done
[ -n "$MLINE" ] && echo "METRICS $MLINE"
# The OpenAI-compatible HTTP API, when --router-args has --http-listen (printed after PORT).
if [[ " $ROUTER_ARGS " == *" --http-listen"* || -n "${PDSERVE_HTTP_LISTEN:-}" ]]; then
    for _ in $(seq 50); do grep -q '^HTTP_PORT ' "$LOGS/router.out" 2>/dev/null && break; sleep 0.1; done
fi
HP=$(awk '/^HTTP_PORT /{print $2; exit}' "$LOGS/router.out" 2>/dev/null)
[ -n "$HP" ] && echo "HTTP http://127.0.0.1:$HP/v1 (OpenAI-compatible)"
# Wait until a signal, or until any process dies.
while [ $stopping = 0 ]; do
    for i in "${!PIDS[@]}"; do
        if ! kill -0 "${PIDS[$i]}" 2>/dev/null; then
            wait "${PIDS[$i]}" 2>/dev/null
            echo "pdserve-up: ${NAMES[$i]} exited (pid ${PIDS[$i]}, status $?); its log ($LOGS/${NAMES[$i]}.log):" >&2
            tail -5 "$LOGS/${NAMES[$i]}.log" >&2
            stop 1
        fi
    done
    sleep 1 & wait $!
done
