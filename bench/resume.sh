#!/usr/bin/env bash
# bench/resume.sh — resume of a persistent session owed RESUME_VALUES (10,000)
# QoS 1 values on another replica (issue 24): a subscriber (MQTT 3.1.1,
# Clean Session 0) subscribes to resume/# on replica/server 1 and leaves;
# a publisher on 1 publishes the values (each PUBACK awaited); the
# subscriber connects again on replica/server 2 and the time from that
# CONNECT to its last value is measured (bench/resume.py). Systems, fresh
# per run, every broker process on BROKER_CPU, the client on LOAD_CPU:
#   fleetmq-mesh  two fleetmq replicas a, b (store.kind = none, the mesh)
#                 on a local 3-server NATS cluster: the session log read
#                 with batched direct gets at b
#   nats          a 3-server nats-server MQTT cluster (JetStream; one
#                 durable consumer per QoS 1 subscription)
# JetStream requests of the resume: the sum over the NATS servers of
# /jsz api.total (JetStream API requests) and, for fleetmq, of the
# messages replica b's NATS connections sent (/connz in_msgs: direct gets,
# KV writes and reads), each as after the resume minus before it.
# Bar (issue 24): last value within 2 s on loopback — with release builds;
# a debug build (FLEETMQ=target/debug/fleetmq BUILD=0) is much slower.
#
#   bash bench/resume.sh                             # builds release binaries
#   BUILD=0 FLEETMQ=/path/to/fleetmq RUNS=1 SYSTEMS=fleetmq-mesh bash bench/resume.sh
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"

# monitors DIR: the NATS servers' monitoring ports (from their configs).
monitors() { sed -n 's/^http: "127.0.0.1:\([0-9]*\)"/\1/p' "$1"/n*.conf; }

# js_counts DIR: "api_total b_in_msgs" summed over the servers.
js_counts() {
    local port api=0 msgs=0 a m
    for port in $(monitors "$1"); do
        a=$(curl -s -m 2 "http://127.0.0.1:$port/jsz" | jq -r '.api.total // 0')
        m=$(curl -s -m 2 "http://127.0.0.1:$port/connz?limit=1024" |
            jq -r '[.connections[]? | select((.name // "") | startswith("fleetmq-b-")) | .in_msgs] | add // 0')
        api=$((api + a)) msgs=$((msgs + m))
    done
    echo "$api $msgs"
}

# `resume.sh counts DIR`: the counts now (bench/resume.py's --between hook).
if [[ ${1:-} == counts ]]; then
    js_counts "$2"
    exit 0
fi
RESUME_VALUES=${RESUME_VALUES:-10000}
SYSTEMS=${SYSTEMS:-"fleetmq-mesh nats"}
SCRIPT=resume
# shellcheck source=bench/standalone.sh
source "$ROOT/bench/standalone.sh"

if [[ ${BUILD:-1} != 0 ]]; then
    log "building release binaries"
    cargo build --release -q -p fleetmq-shards
fi
FLEETMQ=${FLEETMQ:-$TARGET/release/fleetmq}

printf '%-14s %10s %10s %10s %12s %12s %s\n' system last_s first_s connack_s js_api b_nats_msgs notes
for system in $SYSTEMS; do
    : >"$WORK/$system.rows"
    for ((run = 1; run <= RUNS; run++)); do
        case "$system" in
        fleetmq-mesh) start_system fleetmq-mesh || { log "$system did not start"; cluster_stop; continue; }
            ONE=$PUB_URL TWO=$SUB_URL ;;
        nats) SYSTEM_DIR=$(mktemp -d "$WORK/nats.XXXX")
            start_nats_cluster "$SYSTEM_DIR" 3 "mqtt-bench" 1 || { log "nats did not start"; cluster_stop; continue; }
            ONE=mqtt://127.0.0.1:${NATS_MQTT_PORTS[0]} TWO=mqtt://127.0.0.1:${NATS_MQTT_PORTS[1]} ;;
        esac
        before=$WORK/$system.$run.before
        out=$(taskset -c "$LOAD_CPU" python3 "$ROOT/bench/resume.py" --sub-url "$ONE" --pub-url "$ONE" --resume-url "$TWO" \
            --values "$RESUME_VALUES" --between "bash $ROOT/bench/resume.sh counts $SYSTEM_DIR > $before" \
            2>"$WORK/$system.err") || log "$system run $run: $(tail -n 2 "$WORK/$system.err")"
        read -r api0 msgs0 <"$before" || { api0=0 msgs0=0; }
        read -r api1 msgs1 < <(js_counts "$SYSTEM_DIR")
        echo "$out $((api1 - api0)) $((msgs1 - msgs0))" >>"$WORK/$system.rows"
        log "$system run $run: $out js_api=$((api1 - api0)) b_nats_msgs=$((msgs1 - msgs0))"
        cluster_stop
    done
    col() { while read -r json rest; do echo "$json" | jq -r ".$1 // \"nan\""; done <"$WORK/$system.rows" | median; }
    num() { awk -v i="$1" '{print $(NF - 2 + i)}' "$WORK/$system.rows" | median; }
    printf '%-14s %10s %10s %10s %12s %12s %s\n' "$system" "$(col last_s)" "$(col first_s)" "$(col connack_s)" "$(num 1)" "$(num 2)" \
        "runs $(wc -l <"$WORK/$system.rows"), received $(col received)/$RESUME_VALUES, again $(col again), in order $(col in_order)"
done
