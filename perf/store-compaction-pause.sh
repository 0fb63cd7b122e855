#!/usr/bin/env bash
# perf/store-compaction-pause.sh — what online compaction of the local store
# costs the hot path: p99 publish-to-PUBACK of QoS 1 fan-in at RATE msg/s
# with compactions running through the run (store.max_bytes = SMALL: one is
# due every SMALL/8 of log) against none running (store.max_bytes = 1GiB),
# runs interleaved. A persistent session that was away keeps LIVE values
# queued, so that each compaction also rewrites that much live data.
#
# Environment [defaults]: RATE [20000]; DURATION [10s]; RUNS [3];
# SMALL [32MiB]; LIVE [40000] (about; a second of 50,000/s) values of 64 B kept live; BROKER_CPU [0];
# LOAD_CPU [1]; FLEETMQ, LOADGEN [target/release/...].
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
FLEETMQ=${FLEETMQ:-$TARGET/release/fleetmq}
LOADGEN=${LOADGEN:-$TARGET/release/fleetmq-loadgen}
RATE=${RATE:-20000}
DURATION=${DURATION:-10s}
RUNS=${RUNS:-3}
SMALL=${SMALL:-32MiB}
LIVE=${LIVE:-40000}
BROKER_CPU=${BROKER_CPU:-0}
LOAD_CPU=${LOAD_CPU:-1}
DIR=$(mktemp -d /tmp/fleetmq-pause.XXXXXX)
PID=""
cleanup() { [[ -n $PID ]] && kill -9 "$PID" 2>/dev/null; rm -rf "$DIR"; }
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

run() { # MAX_BYTES RUN
    local max=$1 port admin data=$DIR/data-$2-$1
    port=$(free_port); admin=$(free_port)
    RUST_LOG=warn taskset -c "$BROKER_CPU" "$FLEETMQ" serve --listen "127.0.0.1:$port" --admin "127.0.0.1:$admin" \
        --shards 1 --set store.kind=local --set "store.dir=$data" --set "store.max_bytes=$max" \
        --set limits.max_subscriber_queue=10000000 >"$DIR/out" 2>"$DIR/err" &
    PID=$!
    until grep -q "fleetmq: ready" "$DIR/out" 2>/dev/null; do sleep 0.05; done
    # The live values: queued for a persistent session that went away.
    mosquitto_sub -h 127.0.0.1 -p "$port" -c -i pause-keep -q 1 -t 'keep/+' -W 1 >/dev/null 2>&1 || true
    taskset -c "$LOAD_CPU" "$LOADGEN" run fan-in --url "mqtt://127.0.0.1:$port" --publishers 10 --subscribers 1 --qos 1 \
        --rate 50000 --duration "$(( LIVE / 50000 + 1 ))s" --warmup 0s --topic-prefix keep >/dev/null 2>&1
    local before
    before=$(curl -s "http://127.0.0.1:$admin/metrics" | awk '/^fleetmq_store_compactions_total/ {print $2}')
    taskset -c "$LOAD_CPU" "$LOADGEN" run fan-in --url "mqtt://127.0.0.1:$port" --publishers 100 --subscribers 1 --qos 1 \
        --rate "$RATE" --duration "$DURATION" --warmup 1s --json "$DIR/r.json" >"$DIR/lg.out" 2>&1 \
        || { echo "loadgen failed:"; tail -5 "$DIR/lg.out"; }
    local after p50 p99 max_us
    after=$(curl -s "http://127.0.0.1:$admin/metrics" | awk '/^fleetmq_store_compactions_total/ {print $2}')
    p50=$(jq -r '.ack_latency_us.p50' "$DIR/r.json"); p99=$(jq -r '.ack_latency_us.p99' "$DIR/r.json")
    max_us=$(jq -r '.ack_latency_us.max' "$DIR/r.json")
    printf '%-8s run %s: compactions during the run %s; publish->PUBACK p50 %s us, p99 %s us, max %s us; received %s/s\n' \
        "$max" "$2" "$(( ${after%.*} - ${before%.*} ))" "$p50" "$p99" "$max_us" "$(jq -r '.received_per_s|floor' "$DIR/r.json")"
    kill -9 "$PID"; wait "$PID" 2>/dev/null || true; PID=""
}

echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
for r in $(seq "$RUNS"); do
    run "$SMALL" "$r"
    run 1GiB "$r"
done
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
