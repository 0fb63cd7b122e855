#!/usr/bin/env bash
# perf/cluster-retained.sh — retained QoS 1 publishes in cluster mode (issue
# 23): the publish rate and the publish-to-PUBACK latency of one fleetmq
# replica backed by a 3-server NATS JetStream cluster (R3 buckets), for one
# or more fleetmq binaries in one run (e.g. before and after a change).
#
#   BINARIES="before=/tmp/fleetmq-before after=target/release/fleetmq" \
#   LOADGEN=target/release/fleetmq-loadgen NATS=target/nats-venv/bin/nats-server \
#   RUNS=3 bash perf/cluster-retained.sh
#
# An entry whose binary is `nats` (e.g. BINARIES="after=... nats=nats")
# runs the same load against nats-server's own MQTT listener on the same
# cluster (MQTT 3.1.1 there: loadgen speaks what it is told).
#
# Each round starts every binary in turn (the order alternates by round) on
# the same NATS cluster and runs loadgen fan-in with --retain at QoS 1:
# PUBLISHERS[10] publishers on their own topics → 1 subscriber, first open
# loop at RATE[2000] msg/s (the PUBACK p99), then closed loop (--rate max:
# msg/s). SETTLE[5] seconds between binaries. Prints one line per run and
# keeps the JSON in $OUT_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
BINARIES=${BINARIES:-"after=target/release/fleetmq"}
LOADGEN=${LOADGEN:-target/release/fleetmq-loadgen}
NATS=${NATS:-target/nats-venv/bin/nats-server}
RUNS=${RUNS:-3}
# nats-server's MQTT speaks 3.1.1 only: every entry uses PROTOCOL.
PROTOCOL=${PROTOCOL:-3.1.1}
PUBLISHERS=${PUBLISHERS:-10}
RATE=${RATE:-2000}
DURATION=${DURATION:-10s}
OUT_DIR=${OUT_DIR:-target/cluster-retained}
WORK=$(mktemp -d)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; done; rm -rf "$WORK"; }
trap cleanup EXIT
mkdir -p "$OUT_DIR"

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# Three NATS servers (client, route and MQTT ports of their own).
source perf/nats-cluster.sh
start_nats_cluster

run() { # label binary round ("nats" as the binary: nats-server's own MQTT, same cluster)
    local label=$1 bin=$2 round=$3 port admin pid
    if [ "$bin" = nats ]; then
        fan_in "$label" "$round" "${MPORT[0]}" ""
        sleep "${SETTLE:-5}"
        return 0
    fi
    port=$(free_port)
    admin=$(free_port)
    RUST_LOG=warn "$bin" serve --listen "127.0.0.1:$port" --admin "127.0.0.1:$admin" \
        --set cluster.replica_id="perf-$label-$round" --set "cluster.nats_urls=$URLS" --set cluster.nats_replicas=3 \
        >"$WORK/$label.out" 2>"$WORK/$label.log" &
    pid=$!
    for _ in $(seq 1 150); do grep -q "fleetmq: ready" "$WORK/$label.out" && break; sleep 0.2; done
    grep -q "fleetmq: ready" "$WORK/$label.out" || { echo "$label did not start:"; tail -5 "$WORK/$label.log"; kill -9 $pid; return 0; }
    fan_in "$label" "$round" "$port" "$admin"
    kill $pid
    wait $pid 2>/dev/null || true
    # Let NATS finish what the run left queued.
    sleep "${SETTLE:-5}"
}

fan_in() { # label round mqtt-port admin-port (empty: not fleetmq)
    local label=$1 round=$2 port=$3 admin=$4
    for mode in "$RATE" max; do
        local json="$OUT_DIR/$label-r$round-$mode.json"
        "$LOADGEN" run fan-in --protocol "$PROTOCOL" --url "mqtt://127.0.0.1:$port" --qos 1 --retain --publishers "$PUBLISHERS" --subscribers 1 \
            --rate "$mode" --duration "$DURATION" --warmup 2s --topic-prefix "perf/$label$round$mode" --json "$json" \
            >/dev/null 2>"$WORK/loadgen.err" || { echo "$label $mode round $round: loadgen failed: $(tail -2 "$WORK/loadgen.err")"; continue; }
        printf '%-8s round %s rate %-5s sent/s %8.0f received/s %8.0f  PUBACK p50 %6s µs p99 %7s µs  refused %s\n' "$label" "$round" "$mode" \
            "$(jq -r '.sent_per_s' "$json")" "$(jq -r '.received_per_s' "$json")" \
            "$(jq -r '.ack_latency_us.p50 // "nan"' "$json")" "$(jq -r '.ack_latency_us.p99 // "nan"' "$json")" \
            "$(if [ -n "$admin" ]; then curl -s "127.0.0.1:$admin/metrics" | awk '/^fleetmq_cluster_retained_refused_total/ {print $2}'; else echo -; fi)"
    done
}

read -r -a entries <<<"$BINARIES"
for round in $(seq 1 "$RUNS"); do
    order=("${entries[@]}")
    if [ $((round % 2)) -eq 0 ]; then
        mapfile -t order < <(printf '%s\n' "${entries[@]}" | tac)
    fi
    for entry in "${order[@]}"; do
        run "${entry%%=*}" "${entry#*=}" "$round"
    done
done
