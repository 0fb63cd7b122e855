#!/usr/bin/env bash
# perf/cluster-connect.sh — CONNECT rate in cluster mode (issue 23): one
# fleetmq replica backed by a 3-server NATS JetStream cluster, against
# nats-server's own MQTT on the same 3-server cluster, in one run.
#
#   FLEETMQ=target/release/fleetmq LOADGEN=target/release/fleetmq-loadgen \
#   NATS=target/nats-venv/bin/nats-server RUNS=3 CONNECTIONS=5000 \
#   bash perf/cluster-connect.sh
#
# Each round: connect-storm with MQTT 3.1.1 clean sessions, then MQTT 5
# with a Session Expiry Interval (persistent), against each broker in
# turn (the order alternates by round). Prints one JSON line per run
# (loadgen --json) to $OUT (default target/cluster-connect.jsonl) and a
# summary of CONNACKs per second and CONNACK p99.
set -euo pipefail
cd "$(dirname "$0")/.."
FLEETMQ=${FLEETMQ:-target/release/fleetmq}
LOADGEN=${LOADGEN:-target/release/fleetmq-loadgen}
NATS=${NATS:-target/nats-venv/bin/nats-server}
RUNS=${RUNS:-3}
CONNECTIONS=${CONNECTIONS:-5000}
RATE=${RATE:-100000}
OUT=${OUT:-target/cluster-connect.jsonl}
WORK=$(mktemp -d)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; done; rm -rf "$WORK"; }
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# Three NATS servers: client, route, MQTT and monitor ports of their own.
declare -a CPORT RPORT MPORT
for i in 0 1 2; do CPORT[$i]=$(free_port); RPORT[$i]=$(free_port); MPORT[$i]=$(free_port); done
routes=""
for i in 0 1 2; do routes+="nats-route://127.0.0.1:${RPORT[$i]},"; done
for i in 0 1 2; do
    mkdir -p "$WORK/n$i"
    cat >"$WORK/n$i.conf" <<EOF
server_name: n$i
listen: 127.0.0.1:${CPORT[$i]}
jetstream { store_dir: "$WORK/n$i" }
cluster { name: perf, listen: 127.0.0.1:${RPORT[$i]}, routes: [${routes%,}] }
mqtt { listen: 127.0.0.1:${MPORT[$i]} }
EOF
    "$NATS" -c "$WORK/n$i.conf" >"$WORK/n$i.log" 2>&1 &
    PIDS+=($!)
done
sleep 3

MQTT_PORT=$(free_port)
ADMIN_PORT=$(free_port)
"$FLEETMQ" serve --listen "127.0.0.1:$MQTT_PORT" --admin "127.0.0.1:$ADMIN_PORT" \
    --set cluster.replica_id=perf1 \
    --set "cluster.nats_urls=[\"nats://127.0.0.1:${CPORT[0]}\",\"nats://127.0.0.1:${CPORT[1]}\",\"nats://127.0.0.1:${CPORT[2]}\"]" \
    --set cluster.nats_replicas=3 --set limits.max_connections_per_credential=1000000 \
    >"$WORK/fleetmq.out" 2>"$WORK/fleetmq.log" &
PIDS+=($!)
for _ in $(seq 1 100); do grep -q "fleetmq: ready" "$WORK/fleetmq.out" && break; sleep 0.2; done
grep -q "fleetmq: ready" "$WORK/fleetmq.out" || { echo "fleetmq did not start:"; cat "$WORK/fleetmq.log"; exit 1; }

: >"$OUT"
storm() { # broker url kind round
    local name=$1 url=$2 kind=$3 round=$4 extra=()
    if [ "$kind" = persistent ]; then extra=(--protocol 5 --session-expiry 3600); fi
    "$LOADGEN" run connect-storm --url "$url" --connections "$CONNECTIONS" --connect-rate "$RATE" \
        --client-id-prefix "r${round}${kind:0:1}$name" "${extra[@]}" --json "$WORK/run.json" >/dev/null 2>"$WORK/loadgen.err" || {
        echo "$name $kind round $round failed: $(tail -3 "$WORK/loadgen.err")"; return 0; }
    python3 perf/cluster_connect_row.py "$WORK/run.json" "$name" "$kind" "$round" >>"$OUT"
}
for round in $(seq 1 "$RUNS"); do
    order=("fleetmq mqtt://127.0.0.1:$MQTT_PORT" "nats mqtt://127.0.0.1:${MPORT[0]}")
    if [ $((round % 2)) -eq 0 ]; then order=("${order[1]}" "${order[0]}"); fi
    for kind in clean persistent; do
        for entry in "${order[@]}"; do
            set -- $entry
            storm "$1" "$2" "$kind" "$round"
            sleep 2
        done
    done
done
python3 perf/cluster_connect_row.py --summary "$OUT"
echo "raw results: $OUT"
