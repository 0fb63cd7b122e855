#!/usr/bin/env bash
# perf/cluster-retained-80k.sh — issue 23: "80,000 retained topics and a `#`
# subscriber: the SUBSCRIBE is answered within 2 s on any replica".
#
#   FLEETMQ=target/release/fleetmq LOADGEN=target/release/fleetmq-loadgen \
#   NATS=nats-server RUNS=3 COUNT=80000 bash perf/cluster-retained-80k.sh
#
# A 3-server NATS JetStream cluster (R3 buckets), replicas A, B and C
# (`[cluster]`, SHARDS[2] shards each). COUNT retained messages on
# `p/<i/1000>/<i>` (32-byte payloads) are published at QoS 1 on A (every
# PUBACK awaited: each is in `mqtt-retained`), B and C wait until the
# last one is in their copy; then, RUNS times on each of B and C, a new
# clean session subscribes to `#` and to `p/#` at QoS 0 and at QoS 1
# (MQTT 3.1.1; `RECEIVE_MAXIMUM=N`: MQTT 5 with that Receive Maximum) and
# loadgen `retained` reports the time from its SUBSCRIBE to the SUBACK
# and to the last of the COUNT values (each checked byte for byte). Then
# replica D is started RUNS times (a new process each time: its start
# loads `mqtt-retained` in bulk): its start-to-ready time, and the same
# subscriptions on it.
#
# Pinning (taskset CPU lists; empty: unpinned): FLEETMQ_CPUS, NATS_CPUS,
# LOADGEN_CPUS. Prints one JSON line per measurement to $OUT (default
# target/cluster-retained-80k.jsonl), then the medians.
set -euo pipefail
cd "$(dirname "$0")/.."
FLEETMQ=${FLEETMQ:-target/release/fleetmq}
LOADGEN=${LOADGEN:-target/release/fleetmq-loadgen}
NATS=${NATS:-$(command -v nats-server)}
RUNS=${RUNS:-3}
COUNT=${COUNT:-80000}
SHARDS=${SHARDS:-2}
RECEIVE_MAXIMUM=${RECEIVE_MAXIMUM:-}
FLEETMQ_CPUS=${FLEETMQ_CPUS:-}
NATS_CPUS=${NATS_CPUS:-}
LOADGEN_CPUS=${LOADGEN_CPUS:-}
OUT=${OUT:-target/cluster-retained-80k.jsonl}
WORK=$(mktemp -d)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; done; rm -rf "$WORK"; }
trap cleanup EXIT
pinned() { # cpus command...: exec the command, pinned when cpus is set (in a subshell or with &)
    local cpus=$1; shift
    if [ -n "$cpus" ]; then exec taskset -c "$cpus" "$@"; else exec "$@"; fi
}

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

source perf/nats-cluster.sh
start_nats_cluster

declare -A PORT PID ADMIN
start_replica() { # name: start it, wait for ready; sets READY_MS (start-to-ready)
    local name=$1 port t0
    port=$(free_port)
    PORT[$name]=$port
    ADMIN[$name]=$(free_port)
    t0=$(date +%s%N)
    RUST_LOG=info pinned "$FLEETMQ_CPUS" "$FLEETMQ" serve --listen "127.0.0.1:$port" --admin "127.0.0.1:${ADMIN[$name]}" --shards "$SHARDS" \
        --set cluster.replica_id="r$name" --set "cluster.nats_urls=$URLS" --set cluster.nats_replicas=3 \
        >"$WORK/$name.out" 2>"$WORK/$name.log" &
    PID[$name]=$!
    PIDS+=($!)
    for _ in $(seq 1 1200); do grep -qs "fleetmq: ready" "$WORK/$name.out" && break; sleep 0.05; done
    grep -qs "fleetmq: ready" "$WORK/$name.out" || { echo "replica $name did not start:" >&2; tail -5 "$WORK/$name.log" >&2; exit 1; }
    READY_MS=$(( ($(date +%s%N) - t0) / 1000000 ))
}
has_last() { # name: whether the replica retains the last of the COUNT topics
    local last=$((COUNT - 1))
    timeout 5 mosquitto_sub -h 127.0.0.1 -p "${PORT[$1]}" -t "p/$((last / 1000))/$last" -C 1 -W 2 --retained-only >/dev/null 2>&1
}
measure() { # name filter qos round [ready_ms]
    local name=$1 filter=$2 qos=$3 round=$4 ready=${5:-null} rm=() load
    [ -n "$RECEIVE_MAXIMUM" ] && rm=(--receive-maximum "$RECEIVE_MAXIMUM")
    load=$(cut -d' ' -f1 /proc/loadavg)
    local report
    report=$(pinned "$LOADGEN_CPUS" "$LOADGEN" retained --url "mqtt://127.0.0.1:${PORT[$name]}" --subscribe "$filter" \
        --qos "$qos" --expect "$COUNT" --timeout 60s "${rm[@]}" 2>"$WORK/loadgen.err") ||
        echo "replica $name $filter QoS $qos round $round: incomplete: $(tail -1 "$WORK/loadgen.err")" >&2
    [ -n "$report" ] || return 0
    python3 -c 'import json,sys; r=json.loads(sys.argv[1]); r.update(replica=sys.argv[2], filter=sys.argv[3], qos=int(sys.argv[4]), round=int(sys.argv[5]), ready_ms=json.loads(sys.argv[6]), load=float(sys.argv[7])); print(json.dumps(r))' \
        "$report" "$name" "$filter" "$qos" "$round" "$ready" "$load" | tee -a "$OUT"
}

mkdir -p "$(dirname "$OUT")"
: >"$OUT"
for r in A B C; do start_replica $r; echo "replica $r ready in $READY_MS ms (empty bucket)"; done
store=$(pinned "$LOADGEN_CPUS" "$LOADGEN" retained --url "mqtt://127.0.0.1:${PORT[A]}" --store "$COUNT" --window 1000 --timeout 60s)
echo "stored on A: $store"
for r in B C; do
    for _ in $(seq 1 120); do has_last $r && break; sleep 0.5; done
    has_last $r || { echo "replica $r never got the last retained message" >&2; exit 1; }
done
for round in $(seq 1 "$RUNS"); do
    for r in B C; do
        for filter in '#' 'p/#'; do
            for qos in 0 1; do measure $r "$filter" $qos "$round"; done
        done
    done
done
for round in $(seq 1 "$RUNS"); do
    start_replica D
    ready=$READY_MS
    echo "replica D ready in $ready ms with $COUNT retained: $(grep -o 'loaded=[0-9]*' "$WORK/D.log" | tail -1)"
    for filter in '#' 'p/#'; do
        for qos in 0 1; do measure D "$filter" $qos "$round" "$ready"; done
    done
    kill "${PID[D]}"; wait "${PID[D]}" 2>/dev/null || true
done
python3 - "$OUT" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
groups = {}
for r in rows:
    groups.setdefault((r["replica"] if r["replica"] == "D" else "B/C", r["filter"], r["qos"]), []).append(r)
med = lambda xs: statistics.median(xs) if xs else float("nan")
print("replica  filter  QoS  runs  SUBACK ms  last retained ms (median, max)  complete  before SUBACK")
for (rep, f, q), rs in sorted(groups.items()):
    last = [r["last_ms"] for r in rs if r["last_ms"] is not None]
    print(f"{rep:8} {f:7} {q:3} {len(rs):5} {med([r['suback_ms'] for r in rs]):10.1f} {med(last):12.1f} {max(last, default=float('nan')):10.1f}"
          f"  {sum(r['distinct'] == r['expected'] and r['mismatched'] == 0 for r in rs)}/{len(rs)}  {sum(r['before_suback'] for r in rs)}")
ready = sorted({r["ready_ms"] for r in rows if r["ready_ms"] is not None})
print("replica D start-to-ready ms:", ready)
EOF
