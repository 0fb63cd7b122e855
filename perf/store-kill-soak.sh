#!/usr/bin/env bash
# perf/store-kill-soak.sh — `fleetmq-loadgen soak --through-restarts` against
# the release broker with the durable local store (store.kind = local),
# killed with SIGKILL and started again on the same store.dir and address
# KILLS times under load. Publishers and persistent subscribers reconnect,
# publishers resend what is unacknowledged; prints the checker's counts
# (acknowledged values never received, duplicates at QoS 1 and QoS 2,
# order violations per publisher, missing) and its verdict, and exits with
# the loadgen's status (0: nothing acknowledged lost, order kept, no QoS 2
# duplicate, every session kept).
#
# Environment [defaults]: QOS [1]; PROTOCOL [5] (or 3.1.1); RATE [5000]
# msg/s in total (or max); PUBLISHERS [10]; SUBSCRIBERS [1]; PAYLOAD [64];
# KILLS [5]; EVERY [3] seconds between kills (the first after EVERY);
# SOAK_FOR [((KILLS+1)*EVERY+2) s]; FSYNC [batch] (store.fsync);
# DIR [/tmp/fleetmq-kill-soak] (removed first and at the end); BROKER_CPU
# [0], LOAD_CPU [1]; FLEETMQ_SHARDS [1]; FLEETMQ, LOADGEN
# [target/release/...]; OUT [target/perf/DATE]: the loadgen's JSON
# (soak.json) and the brokers' logs stay there.
# Example: QOS=2 KILLS=5 perf/store-kill-soak.sh
source "$(dirname "$0")/common.sh"
FLEETMQ=${FLEETMQ:-$TARGET/release/fleetmq}
LOADGEN=${LOADGEN:-$TARGET/release/fleetmq-loadgen}
QOS=${QOS:-1}
PROTOCOL=${PROTOCOL:-5}
RATE=${RATE:-5000}
PUBLISHERS=${PUBLISHERS:-10}
SUBSCRIBERS=${SUBSCRIBERS:-1}
PAYLOAD=${PAYLOAD:-64}
KILLS=${KILLS:-5}
EVERY=${EVERY:-3}
SOAK_FOR=${SOAK_FOR:-$(( (KILLS + 1) * EVERY + 2 ))s}
FSYNC=${FSYNC:-batch}
DIR=${DIR:-/tmp/fleetmq-kill-soak}
PORT=$(free_port)
rm -rf "$DIR"
mkdir -p "$DIR"
trap 'perf_cleanup; rm -rf "$DIR"' EXIT

start() { # N: starts the broker, waits for `fleetmq: ready`, sets BROKER_PID; prints the time to ready
    local n=$1 t0
    t0=$(date +%s%N)
    RUST_LOG=warn,store=info taskset -c "$BROKER_CPU" "$FLEETMQ" serve --listen "127.0.0.1:$PORT" --admin "" \
        --shards "$FLEETMQ_SHARDS" --set store.kind=local --set "store.dir=$DIR/data" --set "store.fsync=$FSYNC" \
        >"$OUT/broker-$n.out" 2>"$OUT/broker-$n.err" &
    BROKER_PID=$!
    until grep -q "fleetmq: ready" "$OUT/broker-$n.out" 2>/dev/null; do
        kill -0 "$BROKER_PID" 2>/dev/null || { cat "$OUT/broker-$n.err" >&2; exit 1; }
        sleep 0.01
    done
    echo "broker $n ready after $(( ($(date +%s%N) - t0) / 1000000 )) ms (pid $BROKER_PID)"
}

start 0
echo "soak: QoS $QOS, MQTT $PROTOCOL, $PUBLISHERS publishers -> $SUBSCRIBERS subscribers, rate $RATE, $SOAK_FOR, $KILLS SIGKILLs every ${EVERY}s, store.fsync=$FSYNC"
taskset -c "$LOAD_CPU" "$LOADGEN" soak --url "mqtt://127.0.0.1:$PORT" --qos "$QOS" --protocol "$PROTOCOL" \
    --rate "$RATE" --publishers "$PUBLISHERS" --subscribers "$SUBSCRIBERS" --payload-size "$PAYLOAD" \
    --duration "$SOAK_FOR" --report-every 1s --through-restarts --json "$OUT/soak.json" &
PERF_PID=$!
KILLED=0
for n in $(seq 1 "$KILLS"); do
    sleep "$EVERY"
    kill -0 "$PERF_PID" 2>/dev/null || break
    kill -9 "$BROKER_PID"
    wait "$BROKER_PID" 2>/dev/null || true
    echo "SIGKILL $n"
    KILLED=$n
    start "$n"
done
set +e
wait "$PERF_PID"
STATUS=$?
PERF_PID=""
set -e
python3 - "$OUT/soak.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
v = r["verify"]
print("checker: published %d, acknowledged %d, received %d distinct (%d deliveries)" % (v["published"], v["acked"], v["received_distinct"], v["deliveries"]))
print("         lost acknowledged %d, missing %d, duplicates QoS 1 %d, QoS 2 %d, order violations %d" % (v["lost_acknowledged"], v["missing"], v["duplicates_qos1"], v["duplicates_qos2"], v["order_violations"]))
print("         reconnects %d, sessions lost %d; check: %s" % (v["reconnects"], v["sessions_lost"], r["check"]))
PY
echo "broker killed $KILLED times under load; loadgen exit status $STATUS; JSON and logs in $OUT"
exit "$STATUS"
