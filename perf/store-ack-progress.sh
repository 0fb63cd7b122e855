#!/usr/bin/env bash
# perf/store-ack-progress.sh — what the durable local store (store.kind =
# local, fsync batch) logs and syncs while QoS 1/2 publishers feed one
# online persistent subscriber: the subscriber's progress (the packet
# identifier each delivery goes out with, its PUBREC, its PUBACK/PUBCOMP)
# is logged with group commit, never one sync per acknowledgement.
#
# For each binary in FLEETMQ (space separated, e.g. a build before and
# after a change) and each QoS in QOS: a fresh store.dir, `fleetmq-loadgen
# run persistent` (PUBLISHERS → 1 subscriber with a session, online the
# whole run, --rate max under --window 1000) for DURATION, then the
# broker's /metrics: values delivered (fleetmq_messages_out_total), group
# commits (fleetmq_store_syncs_total) per second and per 1,000 deliveries,
# and log bytes (fleetmq_store_log_bytes, no compaction runs in so short a
# test) per delivery. One line per (binary, QoS); the loadgen's JSON and
# the broker's log stay in OUT.
#
# Environment [defaults]: FLEETMQ [target/release/fleetmq]; LOADGEN
# [target/release/fleetmq-loadgen]; QOS ["1 2"]; PUBLISHERS [10]; PAYLOAD
# [64]; DURATION [5s]; SHARDS [1]; BROKER_CPU [0]; LOAD_CPU [1]; OUT
# [/tmp/fleetmq-ack-progress].
# Example: FLEETMQ="/tmp/before/fleetmq target/release/fleetmq" perf/store-ack-progress.sh
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
FLEETMQ=${FLEETMQ:-$TARGET/release/fleetmq}
LOADGEN=${LOADGEN:-$TARGET/release/fleetmq-loadgen}
QOS=${QOS:-"1 2"}
PUBLISHERS=${PUBLISHERS:-10}
PAYLOAD=${PAYLOAD:-64}
DURATION=${DURATION:-5s}
SHARDS=${SHARDS:-1}
BROKER_CPU=${BROKER_CPU:-0}
LOAD_CPU=${LOAD_CPU:-1}
OUT=${OUT:-/tmp/fleetmq-ack-progress}
mkdir -p "$OUT"
PID=""
cleanup() { [[ -n $PID ]] && kill "$PID" 2>/dev/null; wait 2>/dev/null || true; rm -rf "$OUT"/data-*; }
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
metric() { # NAME: the sum of its series on the admin port
    curl -s "http://127.0.0.1:$ADMIN/metrics" | awk -v n="$1" '$1 ~ "^"n"({|$)" { s += $2 } END { printf "%.0f\n", s }'
}

printf '%-40s %3s %12s %10s %8s %10s %10s %s\n' binary qos delivered msg/s syncs syncs/s per1000 log-bytes/delivery
n=0
for bin in $FLEETMQ; do
    for q in $QOS; do
        n=$((n + 1))
        dir=$OUT/data-$n
        PORT=$(free_port)
        ADMIN=$(free_port)
        RUST_LOG=warn taskset -c "$BROKER_CPU" "$bin" serve --listen "127.0.0.1:$PORT" --admin "127.0.0.1:$ADMIN" \
            --shards "$SHARDS" --set store.kind=local --set "store.dir=$dir" >"$OUT/broker-$n.log" 2>&1 &
        PID=$!
        for _ in $(seq 200); do grep -q '^fleetmq: ready' "$OUT/broker-$n.log" && break; sleep 0.1; done
        started=$(date +%s.%N)
        taskset -c "$LOAD_CPU" "$LOADGEN" run persistent --url "mqtt://127.0.0.1:$PORT" --publishers "$PUBLISHERS" \
            --subscribers 1 --qos "$q" --rate max --window 1000 --reconnect-every 1h --session-expiry 600 \
            --payload-size "$PAYLOAD" --duration "$DURATION" --warmup 0s --cpu "$LOAD_CPU" \
            --json "$OUT/load-$n.json" >"$OUT/load-$n.txt" 2>&1 || true
        took=$(echo "$(date +%s.%N) - $started" | bc -l)
        out=$(metric fleetmq_messages_out_total)
        syncs=$(metric fleetmq_store_syncs_total)
        bytes=$(metric fleetmq_store_log_bytes)
        rate=$(jq -r '.received_per_s' "$OUT/load-$n.json" 2>/dev/null || echo nan)
        kill "$PID"; wait "$PID" 2>/dev/null || true; PID=""
        awk -v b="$bin" -v q="$q" -v o="$out" -v r="$rate" -v s="$syncs" -v t="$took" -v by="$bytes" 'BEGIN {
            printf "%-40s %3s %12d %10.0f %8d %10.0f %10.2f %.1f\n", b, q, o, r, s, s / t, (o > 0 ? 1000 * s / o : 0), (o > 0 ? by / o : 0) }'
        grep -E "lost|duplicat|problems" "$OUT/load-$n.txt" | head -3 || true
    done
done
