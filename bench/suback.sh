#!/usr/bin/env bash
# bench/suback.sh — SUBACK time and first values missed (issue 25): a
# subscriber subscribes to SUBACK_FILTERS fresh filters one at a time, and
# as soon as each SUBACK is read a publisher publishes one value on it
# (`fleetmq-loadgen suback`). Systems, each started fresh per run, brokers
# pinned to BROKER_CPU, the loadgen to LOAD_CPU:
#   mosquitto      one Mosquitto, both clients on it
#   fleetmq-one    one fleetmq replica (cluster on a local 3-server NATS)
#   fleetmq-v2     two fleetmq replicas a, b offering mesh versions 1,2
#                  only (FLEETMQ_MESH_VERSIONS: no route announce, the
#                  behaviour before it); subscriber on b, publisher on a
#   fleetmq-mesh   the same with version 3 (route announces)
#   nats           a 2-server nats-server MQTT cluster; subscriber on
#                  server 2, publisher on server 1
# Prints per system the medians over RUNS of: SUBACK median, p99, max (ms)
# and values missed out of SUBACK_FILTERS.
#
#   bash bench/suback.sh                       # builds release binaries
#   BUILD=0 RUNS=3 SUBACK_FILTERS=500 SYSTEMS="fleetmq-mesh nats" bash bench/suback.sh
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
SUBACK_FILTERS=${SUBACK_FILTERS:-500}
SYSTEMS=${SYSTEMS:-"mosquitto fleetmq-one fleetmq-v2 fleetmq-mesh nats"}
SCRIPT=suback
# shellcheck source=bench/standalone.sh
source "$ROOT/bench/standalone.sh"

release_binaries

# start SYSTEM: sets PUB_URL and SUB_URL.
start() {
    case "$1" in
    mosquitto)
        local port
        port=$(free_ports 1)
        printf 'listener %s 127.0.0.1\nallow_anonymous true\nset_tcp_nodelay true\n' "$port" >"$WORK/mosquitto.conf"
        cluster_spawn "$WORK/mosquitto.log" "$(command -v mosquitto || echo /usr/sbin/mosquitto)" -c "$WORK/mosquitto.conf"
        for _ in $(seq 100); do (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break; sleep 0.1; done
        PUB_URL=mqtt://127.0.0.1:$port SUB_URL=$PUB_URL ;;
    fleetmq-one) unset FLEETMQ_MESH_VERSIONS; start_system fleetmq-one ;;
    fleetmq-v2) export FLEETMQ_MESH_VERSIONS=1,2; start_system fleetmq-mesh; unset FLEETMQ_MESH_VERSIONS ;;
    fleetmq-mesh) unset FLEETMQ_MESH_VERSIONS; start_system fleetmq-mesh ;;
    nats) start_system nats ;;
    *) log "unknown system $1"; return 1 ;;
    esac
}

printf '%-14s %12s %12s %12s %10s\n' system suback_med suback_p99 suback_max missed
for system in $SYSTEMS; do
    : >"$WORK/$system.json"
    for ((run = 1; run <= RUNS; run++)); do
        start "$system" || { log "$system did not start"; cluster_stop; continue; }
        taskset -c "$LOAD_CPU" "$LOADGEN" suback --sub-url "$SUB_URL" --pub-url "$PUB_URL" \
            --filters "$SUBACK_FILTERS" >>"$WORK/$system.json" 2>"$WORK/$system.err" ||
            log "$system run $run: $(tail -n 1 "$WORK/$system.err")"
        cluster_stop
    done
    med() { jq -r ".$1" "$WORK/$system.json" | median; }
    printf '%-14s %12s %12s %12s %10s\n' "$system" "$(med suback_median_ms)" "$(med suback_p99_ms)" \
        "$(med suback_max_ms)" "$(med missed)/$SUBACK_FILTERS"
done
printf 'runs %s, filters %s, BROKER_CPU %s, LOAD_CPU %s, shards %s, load %s\n' "$RUNS" "$SUBACK_FILTERS" \
    "$BROKER_CPU" "$LOAD_CPU" "$FLEETMQ_SHARDS" "$(cut -d' ' -f1-3 /proc/loadavg)"
