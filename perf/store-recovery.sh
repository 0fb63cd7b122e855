#!/usr/bin/env bash
# perf/store-recovery.sh — how long fleetmq takes to start after SIGKILL
# with values queued in its durable local store (store.kind = local).
#
# A persistent MQTT 3.1.1 session (mosquitto_sub -c) subscribes to
# `rec/+` and goes away; fleetmq-loadgen publishes at QoS 1 for LOAD_FOR
# (every value is queued for the session and kept in the log); the broker
# is killed with SIGKILL and started again on the same store.dir. Prints
# the values queued (fleetmq_store_* metrics), the log's size, the
# broker's own `store recovered ... elapsed_ms` and the time from exec to
# `fleetmq: ready`, then the session resumes and counts what it gets.
#
# Environment [defaults]: PAYLOAD [64] bytes; PUBLISHERS [10]; RATE [max]
# (loadgen --rate); LOAD_FOR [5s]; SHARDS [1]; DIR [/tmp/fleetmq-recovery]
# (removed first and at the end); FLEETMQ, LOADGEN [target/release/...];
# MAX_BYTES [4GiB] (store.max_bytes); BROKER_CPU [0], LOAD_CPU [1]; KEEP [0]:
# 1 keeps DIR (to start the broker on it again by hand).
# Example: 100,000 queued values: RATE=20000 LOAD_FOR=5s perf/store-recovery.sh
#          about 1 GiB of log:    PAYLOAD=1000 LOAD_FOR=12s perf/store-recovery.sh
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
FLEETMQ=${FLEETMQ:-$TARGET/release/fleetmq}
LOADGEN=${LOADGEN:-$TARGET/release/fleetmq-loadgen}
PAYLOAD=${PAYLOAD:-64}
PUBLISHERS=${PUBLISHERS:-10}
RATE=${RATE:-max}
LOAD_FOR=${LOAD_FOR:-5s}
SHARDS=${SHARDS:-1}
DIR=${DIR:-/tmp/fleetmq-recovery}
MAX_BYTES=${MAX_BYTES:-4GiB}
BROKER_CPU=${BROKER_CPU:-0}
LOAD_CPU=${LOAD_CPU:-1}
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
ADMIN=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
rm -rf "$DIR"
mkdir -p "$DIR"
PID=""
cleanup() { [[ -n $PID ]] && kill -9 "$PID" 2>/dev/null; [[ ${KEEP:-0} == 1 ]] || rm -rf "$DIR"; }
trap cleanup EXIT

start() { # LOG: starts the broker, waits for `fleetmq: ready`, sets PID and READY_MS
    local log=$1 t0
    t0=$(date +%s%N)
    RUST_LOG=info taskset -c "$BROKER_CPU" "$FLEETMQ" serve --listen "127.0.0.1:$PORT" --admin "127.0.0.1:$ADMIN" \
        --shards "$SHARDS" --set store.kind=local --set "store.dir=$DIR/data" --set "store.max_bytes=$MAX_BYTES" \
        --set limits.max_subscriber_queue=10000000 >"$log.out" 2>"$log.err" &
    PID=$!
    until grep -q "fleetmq: ready" "$log.out" 2>/dev/null; do
        kill -0 "$PID" 2>/dev/null || { cat "$log.err" >&2; exit 1; }
        sleep 0.01
    done
    READY_MS=$(( ($(date +%s%N) - t0) / 1000000 ))
}
metric() { curl -s "http://127.0.0.1:$ADMIN/metrics" | awk -v m="$1" '$1 ~ "^"m {s+=$2} END {printf "%d", s}'; }

start "$DIR/first"
mosquitto_sub -h 127.0.0.1 -p "$PORT" -c -i rec-keep -q 1 -t 'rec/+' -W 1 >/dev/null 2>&1 || true
taskset -c "$LOAD_CPU" "$LOADGEN" run fan-in --url "mqtt://127.0.0.1:$PORT" --publishers "$PUBLISHERS" --subscribers 1 \
    --qos 1 --rate "$RATE" --payload-size "$PAYLOAD" --duration "$LOAD_FOR" --warmup 0s --topic-prefix rec \
    --json "$DIR/load.json" >/dev/null 2>"$DIR/load.err" || { cat "$DIR/load.err" >&2; exit 1; }
acked=$(jq -r '.acked_total' "$DIR/load.json" 2>/dev/null || echo "?")
echo "acknowledged (PUBACK) at QoS 1: $acked values of $PAYLOAD B, each queued for the session; syncs $(metric fleetmq_store_syncs_total), compactions $(metric fleetmq_store_compactions_total)"
sleep 1
kill -9 "$PID"; wait "$PID" 2>/dev/null || true; PID=""
echo "log after SIGKILL: $(du -sb "$DIR/data" | cut -f1) bytes ($(ls "$DIR"/data/shard-*/ | wc -l) segment files, $(ls "$DIR"/data/snapshot-* 2>/dev/null | wc -l) snapshot)"
sync
start "$DIR/second"
grep -o 'store recovered.*' "$DIR/second.err" | sed 's/\x1b\[[0-9;]*m//g'
echo "exec to 'fleetmq: ready': $READY_MS ms; RSS $(awk '/VmRSS/ {print $2, $3}' /proc/$PID/status)"
got=$(timeout 300 mosquitto_sub -h 127.0.0.1 -p "$PORT" -c -i rec-keep -q 1 -t 'rec/+' -W 5 2>/dev/null | wc -l || true)
echo "the session resumed and got $got values"
