#!/usr/bin/env bash
# perf/cluster-connect.sh — CONNECT rate in cluster mode (issue 23): one
# fleetmq replica backed by a 3-server NATS JetStream cluster, against
# nats-server's own MQTT on the same 3-server cluster, in one run.
#
#   FLEETMQ=target/release/fleetmq LOADGEN=target/release/fleetmq-loadgen \
#   NATS=nats-server RUNS=3 CONNECTIONS=5000 RATE=50000 \
#   bash perf/cluster-connect.sh
#
# Each round: a connect-storm of MQTT 3.1.1 clean sessions (Clean
# Session 1), then of MQTT 3.1.1 persistent sessions (Clean Session 0,
# new client identifiers each round: a new session each), against each
# broker in turn (the order alternates by round). nats-server's MQTT
# speaks 3.1.1 only, so both kinds are 3.1.1. KINDS="clean persistent"
# chooses the kinds; BROKERS="fleetmq nats" the brokers (one alone: to
# profile it; add "single" for the same fleetmq binary as a single node,
# no NATS, in the same run: the rate this machine allows without the
# cluster).
#
# FLEETMQ_ARGS: more `fleetmq serve` arguments (e.g. "--shards 1").
# Pinning (taskset CPU lists; empty: unpinned): FLEETMQ_CPUS, NATS_CPUS,
# LOADGEN_CPUS. HOLD=DURATION (e.g. 5s): loadgen's `idle` scenario instead
# of `connect-storm`: the same storm, then every connection held for
# DURATION and the broker's RSS read (fleetmq's process; for nats, the
# server whose MQTT port the clients use): RSS per connection (issue 24:
# 10,000 persistent sessions beside as many clean ones). KEEP=DIR keeps the logs, each run's loadgen report and
# the broker's refusal counters there.
#
# Prints which NATS server has fleetmq's state connection and which leads
# KV_mqtt-sessions, then one JSON line per run to $OUT (default
# target/cluster-connect.jsonl): CONNACKs per second, CONNACK p50/p99,
# failed CONNECTs with loadgen's error kinds, fleetmq's refusals by
# reason, the CPU seconds fleetmq's bridge thread, fleetmq and the NATS
# servers used during the storm (and SETTLE[1] s after it), what the NATS
# servers did per CONNECT (messages in and out, JetStream API requests,
# writes per stream: from their monitoring ports), and the load average;
# then a summary of the medians.
set -euo pipefail
cd "$(dirname "$0")/.."
FLEETMQ=${FLEETMQ:-target/release/fleetmq}
LOADGEN=${LOADGEN:-target/release/fleetmq-loadgen}
NATS=${NATS:-$(command -v nats-server)}
KINDS=${KINDS:-clean persistent}
BROKERS=${BROKERS:-fleetmq nats}
FLEETMQ_CPUS=${FLEETMQ_CPUS:-}
NATS_CPUS=${NATS_CPUS:-}
LOADGEN_CPUS=${LOADGEN_CPUS:-}
KEEP=${KEEP:-}
HOLD=${HOLD:-}
FLEETMQ_ARGS=${FLEETMQ_ARGS:-}
# Loadgen threads: one thread caps a storm at ~12k CONNACK/s on these
# machines (a single node reached 11.9k with 1, 14–20k with 2:
# perf/RESULTS.md, issue 23, wt-23c), below what fleetmq answers.
LOADGEN_THREADS=${LOADGEN_THREADS:-2}
RUNS=${RUNS:-3}
CONNECTIONS=${CONNECTIONS:-5000}
RATE=${RATE:-100000}
OUT=${OUT:-target/cluster-connect.jsonl}
WORK=$(mktemp -d)
PIDS=()
cleanup() {
    for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; done
    if [ -n "$KEEP" ]; then mkdir -p "$KEEP"; cp "$WORK"/*.log "$WORK"/*.out "$KEEP"/ 2>/dev/null || true; fi
    rm -rf "$WORK"
}
pin() { # cpus command...: exec the command, pinned when cpus is set (run with &: $! is its PID)
    local cpus=$1; shift
    if [ -n "$cpus" ]; then exec taskset -c "$cpus" "$@"; else exec "$@"; fi
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# Three NATS servers (client, route and MQTT ports of their own).
source perf/nats-cluster.sh
start_nats_cluster

MQTT_PORT=$(free_port)
ADMIN_PORT=$(free_port)
pin "$FLEETMQ_CPUS" "$FLEETMQ" serve --listen "127.0.0.1:$MQTT_PORT" --admin "127.0.0.1:$ADMIN_PORT" \
    --set cluster.replica_id=perf1 \
    --set "cluster.nats_urls=$URLS" \
    --set cluster.nats_replicas=3 --set limits.max_connections_per_credential=1000000 $FLEETMQ_ARGS \
    >"$WORK/fleetmq.out" 2>"$WORK/fleetmq.log" &
FLEETMQ_PID=$!
PIDS+=($FLEETMQ_PID)
NATS_PIDS="${PIDS[0]} ${PIDS[1]} ${PIDS[2]}"
for _ in $(seq 1 100); do grep -q "fleetmq: ready" "$WORK/fleetmq.out" && break; sleep 0.2; done
grep -q "fleetmq: ready" "$WORK/fleetmq.out" || { echo "fleetmq did not start:"; cat "$WORK/fleetmq.log"; exit 1; }
# Where fleetmq's claims go (a state connection away from the
# KV_mqtt-sessions leader relays every claim and watch delivery).
python3 perf/cluster_connect_row.py --placement "${HPORT[@]}" || true
# "single" in BROKERS: the same fleetmq binary as a single node (no
# [cluster], the default local store) beside them, for the CONNECT rate
# without NATS on the same machine in the same run.
SINGLE_PORT=$(free_port)
SINGLE_PID=
case " $BROKERS " in *" single "*)
    pin "$FLEETMQ_CPUS" "$FLEETMQ" serve --listen "127.0.0.1:$SINGLE_PORT" --admin "" \
        --set "store.dir=$WORK/single" --set limits.max_connections_per_credential=1000000 $FLEETMQ_ARGS \
        >"$WORK/single.out" 2>"$WORK/single.log" &
    SINGLE_PID=$!
    PIDS+=($SINGLE_PID)
    for _ in $(seq 1 100); do grep -q "fleetmq: ready" "$WORK/single.out" && break; sleep 0.2; done
    grep -q "fleetmq: ready" "$WORK/single.out" || { echo "single fleetmq did not start:"; cat "$WORK/single.log"; exit 1; }
    ;;
esac

: >"$OUT"
[ -n "$KEEP" ] && mkdir -p "$KEEP"
cpu_s() { # pids...: CPU seconds (user + system) of these processes
    local t=0 p
    for p in "$@"; do t=$((t + $(awk '{print $14 + $15}' "/proc/$p/stat" 2>/dev/null || echo 0))); done
    echo "$t"
}
bridge_cpu_s() { # pid: its fleetmq-bridge thread's CPU ticks
    local t
    for t in /proc/"$1"/task/*; do
        if [ "$(cat "$t/comm" 2>/dev/null)" = fleetmq-bridge ]; then awk '{print $14 + $15}' "$t/stat"; return; fi
    done
    echo 0
}
refusals() { curl -s "http://127.0.0.1:$ADMIN_PORT/metrics" | grep '^fleetmq_connect_refused_total' | grep -v ' 0$' || true; }
storm() { # broker url kind round
    local name=$1 url=$2 kind=$3 round=$4 extra=()
    if [ "$kind" = persistent ]; then extra=(--keep-session); fi
    local before_f before_b before_n load pid=$FLEETMQ_PID scenario=connect-storm
    if [ "$name" = single ]; then pid=$SINGLE_PID; fi
    if [ -n "$HOLD" ]; then
        local rss_pid=$pid
        if [ "$name" = nats ]; then rss_pid=${PIDS[0]}; fi
        scenario=idle extra+=(--duration "$HOLD" --broker-pid "$rss_pid")
    fi
    before_f=$(cpu_s "$pid"); before_b=$(bridge_cpu_s "$pid"); before_n=$(cpu_s $NATS_PIDS)
    refusals >"$WORK/refused.before"
    python3 perf/cluster_connect_row.py --nats-counts "${HPORT[@]}" >"$WORK/nats.before"
    load=$(cut -d' ' -f1 /proc/loadavg)
    local loadgen=("$LOADGEN")
    if [ -n "$LOADGEN_CPUS" ]; then loadgen=(taskset -c "$LOADGEN_CPUS" "$LOADGEN"); fi
    rm -f "$WORK/run.json"
    # A run with failed CONNECTs exits non-zero and still writes its report.
    "${loadgen[@]}" run "$scenario" --threads "$LOADGEN_THREADS" --url "$url" --connections "$CONNECTIONS" --connect-rate "$RATE" \
        --client-id-prefix "r${round}${kind:0:1}$name" "${extra[@]}" --json "$WORK/run.json" >"$WORK/run.txt" 2>"$WORK/loadgen.err" ||
        echo "$name $kind round $round: $(tail -1 "$WORK/loadgen.err")"
    [ -s "$WORK/run.json" ] || { echo "$name $kind round $round: no report"; return 0; }
    local tick
    tick=$(getconf CLK_TCK)
    # What the storm left queued (releases at the disconnects) is its work too.
    sleep "${SETTLE:-1}"
    refusals >"$WORK/refused.after"
    python3 perf/cluster_connect_row.py --nats-counts "${HPORT[@]}" >"$WORK/nats.after"
    CPU_FLEETMQ=$(( $(cpu_s "$pid") - before_f )) CPU_BRIDGE=$(( $(bridge_cpu_s "$pid") - before_b )) \
    CPU_NATS=$(( $(cpu_s $NATS_PIDS) - before_n )) TICK=$tick LOAD=$load \
    NATS_BEFORE="$WORK/nats.before" NATS_AFTER="$WORK/nats.after" \
        python3 perf/cluster_connect_row.py "$WORK/run.json" "$name" "$kind" "$round" \
        "$WORK/refused.before" "$WORK/refused.after" >>"$OUT"
    if [ -n "$KEEP" ]; then cp "$WORK/run.json" "$KEEP/r$round-$kind-$name.json"; cp "$WORK/refused.after" "$KEEP/r$round-$kind-$name.refused"; fi
}
for round in $(seq 1 "$RUNS"); do
    order=("fleetmq mqtt://127.0.0.1:$MQTT_PORT" "nats mqtt://127.0.0.1:${MPORT[0]}")
    if [ $((round % 2)) -eq 0 ]; then order=("${order[1]}" "${order[0]}"); fi
    order+=("single mqtt://127.0.0.1:$SINGLE_PORT")
    for kind in $KINDS; do
        for entry in "${order[@]}"; do
            set -- $entry
            case " $BROKERS " in *" $1 "*) ;; *) continue ;; esac
            storm "$1" "$2" "$kind" "$round"
            sleep 1
        done
    done
done
python3 perf/cluster_connect_row.py --summary "$OUT"
echo "raw results: $OUT"
