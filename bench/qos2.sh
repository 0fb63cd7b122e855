#!/usr/bin/env bash
# bench/qos2.sh — QoS 2 to a persistent session across replicas (issue 24):
# the loadgen's `persistent` scenario at QoS 2 (QOS), PUBLISHERS (10)
# persistent publishers on replica/server 1 and one persistent subscriber
# (MQTT 3.1.1, PROTOCOL: nats-server speaks no MQTT 5; Clean Session 0,
# Session Expiry 600 s with MQTT 5; never
# disconnecting) on replica/server 2, --rate max bounded by a window of
# WINDOW (1,000) values, for DURATION after WARMUP. Delivered msg/s and p99
# publish-to-delivery (medians over RUNS). Each delivery is a QoS 2
# handshake with the subscriber; in fleetmq the value comes from the
# workspace's session log, and its PUBLISH and PUBREL wait for the
# session's cursor in JetStream (exactly once across a SIGKILL of the
# subscriber's replica). Systems, fresh per run, every broker process on
# BROKER_CPU, the loadgen on LOAD_CPU:
#   fleetmq-mesh  two fleetmq replicas a, b (store.kind = none, the mesh)
#                 on a local 3-server NATS cluster
#   nats          a 2-server nats-server MQTT cluster (JetStream; stores
#                 each QoS 1/2 value before the PUBREC)
#
#   bash bench/qos2.sh                               # builds release binaries
#   BUILD=0 FLEETMQ=/path/to/fleetmq LOADGEN=/path/to/fleetmq-loadgen RUNS=1 bash bench/qos2.sh
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
SYSTEMS=${SYSTEMS:-"fleetmq-mesh nats"}
QOS=${QOS:-2}
PUBLISHERS=${PUBLISHERS:-10}
WINDOW=${WINDOW:-1000}
DURATION=${DURATION:-10s}
WARMUP=${WARMUP:-2s}
PROTOCOL=${PROTOCOL:-3.1.1}
SCRIPT=qos2
# shellcheck source=bench/standalone.sh
source "$ROOT/bench/standalone.sh"

release_binaries

printf '%-14s %12s %10s %s\n' system msg_per_s p99_us notes
for system in $SYSTEMS; do
    : >"$WORK/$system.rows"
    for ((run = 1; run <= RUNS; run++)); do
        case "$system" in
        fleetmq-mesh) start_system fleetmq-mesh || { log "$system did not start"; cluster_stop; continue; } ;;
        nats) start_system nats || { log "$system did not start"; cluster_stop; continue; } ;;
        *) log "unknown system $system"; continue ;;
        esac
        json=$WORK/$system.$run.json
        taskset -c "$LOAD_CPU" "$LOADGEN" run persistent --pub-url "$PUB_URL" --sub-url "$SUB_URL" --protocol "$PROTOCOL" \
            --qos "$QOS" --publishers "$PUBLISHERS" --subscribers 1 --rate max --window "$WINDOW" \
            --reconnect-every 1h --session-expiry 600 --duration "$DURATION" --warmup "$WARMUP" \
            --keep-alive "$KEEP_ALIVE" --connect-timeout 30s --json "$json" >"$WORK/$system.$run.txt" 2>&1 ||
            log "$system run $run: loadgen: $(tail -n 2 "$WORK/$system.$run.txt")"
        if [[ -s $json ]]; then
            jq -r '"\(.throughput_per_s // "nan") \(.latency_us.p99 // "nan") \(.verify.lost_acknowledged // 0) \(.verify.duplicates // 0)"' "$json" >>"$WORK/$system.rows"
            log "$system run $run: $(tail -n 1 "$WORK/$system.rows")"
        fi
        cluster_stop
    done
    printf '%-14s %12s %10s %s\n' "$system" "$(awk '{print $1}' "$WORK/$system.rows" | median)" \
        "$(awk '{print $2}' "$WORK/$system.rows" | median)" "runs $(wc -l <"$WORK/$system.rows"), lost (acknowledged) $(awk '{s+=$3} END {print s+0}' "$WORK/$system.rows"), duplicates $(awk '{s+=$4} END {print s+0}' "$WORK/$system.rows")"
done
