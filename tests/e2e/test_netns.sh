#!/usr/bin/env bash
# test_netns.sh -- the stack across "hosts": router, two prefill and two decode instances, each
# in its own network namespace, joined by veth pairs to a bridge in a hub namespace; UCX over
# tcp (namespaces do not isolate shared memory). Requests must succeed; then one decode
# instance's link is cut: requests routed there fail cleanly within their deadline and the
# others keep being served. The test creates and removes everything itself; it skips (77)
# where network namespaces cannot be made (not root, no veth/bridge support).
# usage: test_netns.sh BIN_DIR SHARED_DIR
set -u
BIN=$1
SHARED=$2
MODEL=$SHARED/models/stories260k
[ -d "$MODEL" ] || { echo "no shared data: skip"; exit 77; }
P=pdn$$                                # namespace prefix, unique per run
NODES=(r p1 p2 d1 d2)
declare -A IP=([r]=10.89.0.1 [p1]=10.89.0.11 [p2]=10.89.0.12 [d1]=10.89.0.21 [d2]=10.89.0.22)
TMP=$(mktemp -d)
PIDS=()
cleanup() {
    for pid in "${PIDS[@]}"; do kill -KILL "$pid" 2>/dev/null; done
    wait 2>/dev/null
    for n in "${NODES[@]}" hub; do ip netns del "$P-$n" 2>/dev/null; done
    rm -rf "$TMP"
}
trap cleanup EXIT
if ! ip netns add "$P-hub" 2>/dev/null; then echo "cannot create network namespaces: skip"; exit 77; fi
ip -n "$P-hub" link add br0 type bridge || { echo "no bridge support: skip"; exit 77; }
ip -n "$P-hub" link set br0 up
for n in "${NODES[@]}"; do
    ip netns add "$P-$n"
    ip link add "v$P$n" type veth peer name "h$P$n" || { echo "no veth support: skip"; exit 77; }
    ip link set "v$P$n" netns "$P-$n"
    ip link set "h$P$n" netns "$P-hub"
    ip -n "$P-$n" link set "v$P$n" name eth0
    ip -n "$P-$n" addr add "${IP[$n]}/24" dev eth0
    ip -n "$P-$n" link set eth0 up
    ip -n "$P-$n" link set lo up
    ip -n "$P-hub" link set "h$P$n" master br0
    ip -n "$P-hub" link set "h$P$n" up
done
export UCX_TLS=tcp UCX_NET_DEVICES=eth0 UCX_WARN_UNUSED_ENV_VARS=n PDSERVE_PREFILL_POLICY=remote PDSERVE_LOG_LEVEL=warn

# start NODE NAME ARGS...: runs NAME inside the node's namespace; waits for "PORT n".
start() {
    local node=$1 name=$2; shift 2
    ip netns exec "$P-$node" "$BIN/$name" "$@" >"$TMP/$node.out" 2>"$TMP/$node.log" &
    PIDS+=("$!")
    for _ in $(seq 300); do
        grep -q '^PORT ' "$TMP/$node.out" && return 0
        sleep 0.1
    done
    echo "FAIL $name in $node did not start:"; cat "$TMP/$node.log"; exit 1
}
for n in p1 p2; do start $n pdserve-prefill --model "$MODEL" --listen "${IP[$n]}:7001" --kv-cache-mb 32; done
for n in d1 d2; do start $n pdserve-decode --model "$MODEL" --listen "${IP[$n]}:7002" --kv-cache-mb 32; done
start r pdserve-router --model "$MODEL" --listen "${IP[r]}:7000" --load-poll-ms 200 \
    --request-timeout-ms 4000 --prefill "${IP[p1]}:7001,${IP[p2]}:7001" --decode "${IP[d1]}:7002,${IP[d2]}:7002"
fails=0
WANT=$(python3 -c "import json; print(json.load(open('$MODEL/golden.json'))['cases'][1]['greedy_text'].strip())")
gen() { ip netns exec "$P-r" "$BIN/pdserve-cli" generate --addr "${IP[r]}:7000" --temperature 0 --max-tokens 80 --timeout-ms 8000 --json "Once upon a time"; }
ok=0
for i in $(seq 8); do
    out=$(gen 2>>"$TMP/cli.err") && [ "$(python3 -c "import json,sys; print(json.loads(sys.argv[1])['text'].strip())" "$out")" = "$WANT" ] && ok=$((ok+1))
done
if [ $ok -eq 8 ]; then echo "ok   8 requests across namespaces over tcp, golden text"; else echo "FAIL only $ok of 8 requests right"; cat "$TMP/cli.err"; fails=$((fails+1)); fi
grep -h "tcp" "$TMP"/p1.log "$TMP"/d1.log | head -2

# Cut d1's link: its requests fail within the deadline, the rest keep being served.
ip -n "$P-hub" link set "h${P}d1" down
t0=$(date +%s)
good=0 bad=0
for i in $(seq 8); do
    if out=$(gen 2>>"$TMP/cli.err"); then good=$((good+1)); else bad=$((bad+1)); fi
done
t1=$(date +%s)
echo "after the cut: $good served, $bad failed, in $((t1-t0)) s"
if [ $good -ge 6 ] && [ $((t1-t0)) -le 40 ]; then echo "ok   link cut: requests fail cleanly, others continue"; else echo "FAIL link cut handling"; tail -5 "$TMP/r.log"; fails=$((fails+1)); fi
alive=0
for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && alive=$((alive+1)); done
if [ $alive -eq 5 ]; then echo "ok   every process still up"; else echo "FAIL only $alive of 5 processes alive"; fails=$((fails+1)); fi
if [ $fails -ne 0 ]; then echo "$fails failures"; exit 1; fi
echo "all netns checks passed"
