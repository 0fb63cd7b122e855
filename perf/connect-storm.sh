#!/usr/bin/env bash
# perf/connect-storm.sh — `fleetmq-loadgen run connect-storm` against
# fleetmq builds and Mosquitto, interleaved rounds (issue 27, "Connect
# rate"): connections/s, CONNACK p50/p99, and the CPU time the broker
# used per CONNECT, in one run.
#
#   LOADGEN=target/release/fleetmq-loadgen RUNS=4 \
#   BROKERS="before:1=/tmp/before/fleetmq before:2=/tmp/before/fleetmq \
#            after:1=target/release/fleetmq after:2=target/release/fleetmq mosquitto" \
#   BROKER_CPUS=0,1 LOADGEN_CPUS=0,1 \
#   bash perf/connect-storm.sh --connections 10000 --protocol 3.1.1 --connect-window 50 --threads 2
#
# BROKERS: `LABEL:SHARDS=BINARY` (fleetmq with `--shards SHARDS`, pinned to
# the first SHARDS CPUs of BROKER_CPUS) or `mosquitto` (pinned to the
# first CPU of BROKER_CPUS). Each round runs every broker once, the
# order rotating by round. The arguments go to `run connect-storm`
# (the script adds `--url`, `--json` and, with LOADGEN_CPUS, `--cpu`).
#
# Per run, one JSON line to $OUT (default target/connect-storm.jsonl):
# connected, connections/s, CONNACK p50/p99 (ms), the broker's CPU time
# (sum of its threads' run time from /proc/PID/task/*/schedstat) per
# connection in µs, the 1-minute load average at the start, and for
# fleetmq its refusals and hand-overs (`fleetmq_connect_refused_total`,
# `fleetmq_connections_handed_over_total`, from the admin port); then a
# summary of the medians by broker. KEEP=DIR keeps the logs and reports.
set -euo pipefail
cd "$(dirname "$0")/.."
LOADGEN=${LOADGEN:-target/release/fleetmq-loadgen}
BROKERS=${BROKERS:-"fleetmq:1=target/release/fleetmq fleetmq:2=target/release/fleetmq mosquitto"}
BROKER_CPUS=${BROKER_CPUS:-0,1}
LOADGEN_CPUS=${LOADGEN_CPUS:-}
RUNS=${RUNS:-3}
OUT=${OUT:-target/connect-storm.jsonl}
KEEP=${KEEP:-}
WORK=$(mktemp -d)
BROKER_PID=""
cleanup() {
    [ -n "$BROKER_PID" ] && { kill -9 "$BROKER_PID" 2>/dev/null || true; wait "$BROKER_PID" 2>/dev/null || true; }
    if [ -n "$KEEP" ]; then mkdir -p "$KEEP"; cp -r "$WORK"/. "$KEEP"/ 2>/dev/null || true; fi
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
first_cpus() { echo "$BROKER_CPUS" | tr ',' '\n' | head -n "$1" | paste -sd,; }
# The run time of every thread of PID so far, in ns.
cpu_ns() { cat /proc/"$1"/task/*/schedstat 2>/dev/null | awk '{s += $1} END {printf "%d\n", s}'; }

# start LABEL SHARDS BINARY RUN_DIR: sets BROKER_PID, PORT, ADMIN.
start() {
    local label=$1 shards=$2 bin=$3 dir=$4
    PORT=$(free_port)
    ADMIN=""
    if [ "$label" = mosquitto ]; then
        cat >"$dir/mosquitto.conf" <<EOF
listener $PORT 127.0.0.1
allow_anonymous true
persistence false
set_tcp_nodelay true
log_dest none
EOF
        chmod -R a+rX "$dir"
        taskset -c "$(first_cpus 1)" "$(command -v mosquitto || echo /usr/sbin/mosquitto)" -c "$dir/mosquitto.conf" \
            >"$dir/broker.log" 2>&1 &
        BROKER_PID=$!
        for _ in $(seq 100); do
            python3 -c "import socket; socket.create_connection(('127.0.0.1', $PORT), 0.2).close()" 2>/dev/null && return 0
            sleep 0.1
        done
    else
        ADMIN=$(free_port)
        RUST_LOG=warn taskset -c "$(first_cpus "$shards")" "$bin" serve --listen "127.0.0.1:$PORT" \
            --admin "127.0.0.1:$ADMIN" --shards "$shards" --set store.kind=none >"$dir/broker.out" 2>"$dir/broker.log" &
        BROKER_PID=$!
        for _ in $(seq 100); do
            grep -q '^fleetmq: ready' "$dir/broker.out" 2>/dev/null && return 0
            sleep 0.1
        done
    fi
    echo "$label did not start:" >&2
    cat "$dir/broker.log" >&2
    return 1
}

stop() {
    kill "$BROKER_PID" 2>/dev/null || true
    wait "$BROKER_PID" 2>/dev/null || true
    BROKER_PID=""
}

read -r -a ENTRIES <<<"$BROKERS"
mkdir -p "$(dirname "$OUT")"
: >"$OUT"
for round in $(seq 1 "$RUNS"); do
    n=${#ENTRIES[@]}
    for i in $(seq 0 $((n - 1))); do
        entry=${ENTRIES[$(((i + round - 1) % n))]}
        if [ "$entry" = mosquitto ]; then label=mosquitto shards=1 bin=""
        else label=${entry%%=*} bin=${entry#*=} shards=${label##*:}; fi
        dir="$WORK/r$round-${label//:/-}"
        mkdir -p "$dir"
        start "$label" "$shards" "$bin" "$dir" || continue
        sleep 0.5
        load=$(cut -d' ' -f1 /proc/loadavg)
        cpu0=$(cpu_ns "$BROKER_PID")
        cpu=()
        [ -n "$LOADGEN_CPUS" ] && cpu=(--cpu "$LOADGEN_CPUS")
        set +e
        ${LOADGEN_CPUS:+taskset -c "$LOADGEN_CPUS"} "$LOADGEN" run connect-storm --url "mqtt://127.0.0.1:$PORT" \
            --json "$dir/report.json" "${cpu[@]}" "$@" >"$dir/loadgen.out" 2>&1
        set -e
        cpu1=$(cpu_ns "$BROKER_PID")
        metrics=""
        if [ -n "$ADMIN" ]; then
            metrics=$(python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:$ADMIN/metrics', timeout=5).read().decode())" 2>/dev/null || true)
        fi
        stop
        printf '%s' "$metrics" >"$dir/metrics.txt"
        python3 - "$dir/report.json" "$label" "$round" "$load" "$cpu0" "$cpu1" "$dir/metrics.txt" >>"$OUT" <<'EOF'
import json, re, sys
path, label, rnd, load, cpu0, cpu1, metrics = sys.argv[1:]
row = {"broker": label, "round": int(rnd), "load": float(load)}
try:
    r = json.load(open(path))
    r = r.get("report", r)
    c = r.get("connections") or {}
    lat = r.get("latency_us") or {}
    row.update(connected=c.get("connected"), failed=c.get("failed"),
               connect_per_s=round(c.get("connect_per_s") or 0),
               connack_p50_ms=(lat.get("p50") or 0) / 1000, connack_p99_ms=(lat.get("p99") or 0) / 1000,
               errors=r.get("errors"))
    if c.get("connected"):
        row["cpu_us_per_connect"] = round((int(cpu1) - int(cpu0)) / 1000 / c["connected"], 1)
except (OSError, ValueError) as e:
    row["error"] = str(e)
sums = {}
for line in open(metrics):
    m = re.match(r'fleetmq_(connect_refused_total|connections_handed_over_total)\{([^}]*)\} (\S+)', line)
    if m:
        key = m.group(1) + "{" + ",".join(p for p in m.group(2).split(",") if not p.startswith("shard=")) + "}"
        sums[key] = sums.get(key, 0) + float(m.group(3))
row["counters"] = {k: v for k, v in sums.items() if v}
print(json.dumps(row))
EOF
        tail -n 1 "$OUT"
    done
done

python3 - "$OUT" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
by = {}
for r in rows:
    by.setdefault(r["broker"], []).append(r)
print("broker | runs | connections/s (median) | CONNACK p99 ms (median) | CPU µs per CONNECT (median) | load")
for b, rs in by.items():
    ok = [r for r in rs if r.get("connect_per_s")]
    med = lambda k: statistics.median(r[k] for r in ok if r.get(k) is not None) if ok else None
    print(f"{b} | {len(rs)} | {[r.get('connect_per_s') for r in rs]} ({med('connect_per_s')}) | "
          f"{[r.get('connack_p99_ms') for r in rs]} ({med('connack_p99_ms')}) | "
          f"{[r.get('cpu_us_per_connect') for r in rs]} ({med('cpu_us_per_connect')}) | "
          f"{[r['load'] for r in rs]}")
EOF
