# perf/common.sh — sourced by the perf scripts: build, start fleetmq pinned,
# run a loadgen scenario pinned, clean up on exit.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
BROKER_CPU=${BROKER_CPU:-0}
LOAD_CPU=${LOAD_CPU:-1}
FLEETMQ_SHARDS=${FLEETMQ_SHARDS:-1}
OUT=${OUT:-$TARGET/perf/$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT"
BROKER_PID=""
PERF_PID=""
perf_cleanup() {
    for p in $PERF_PID $BROKER_PID; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
}
trap perf_cleanup EXIT
trap 'exit 130' INT TERM

# build: the release binaries; FLEETMQ=<binary> measures that broker
# instead (an earlier build, for a before/after), as bench/compare.sh does.
build() {
    cargo build --release -q -p fleetmq-shards -p fleetmq-loadgen --manifest-path "$ROOT/Cargo.toml"
    FLEETMQ=${FLEETMQ:-$TARGET/release/fleetmq}
    LOADGEN=$TARGET/release/fleetmq-loadgen
}

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'
}

# start_fleetmq [WRAPPER...]: fleetmq pinned to BROKER_CPU (under WRAPPER, e.g.
# valgrind), sets PORT and BROKER_PID, waits for "fleetmq: ready".
start_fleetmq() {
    PORT=$(free_port)
    RUST_LOG=warn taskset -c "$BROKER_CPU" "$@" "$FLEETMQ" serve --listen "127.0.0.1:$PORT" --admin "" \
        --shards "$FLEETMQ_SHARDS" --set store.kind=none >"$OUT/broker.out" 2>"$OUT/broker.err" &
    BROKER_PID=$!
    for _ in $(seq 600); do
        grep -q '^fleetmq: ready' "$OUT/broker.out" 2>/dev/null && return 0
        kill -0 "$BROKER_PID" 2>/dev/null || { cat "$OUT/broker.err" >&2; return 1; }
        sleep 0.1
    done
    echo "fleetmq did not get ready" >&2
    return 1
}

# The scenario: SCENARIO_ARGS, default fan-in 10 → 1, QoS 0, 64 B; the
# scripts add the offered rate (`--rate`), so SCENARIO_ARGS must not.
SCENARIO_ARGS=${SCENARIO_ARGS:-"fan-in --publishers 10 --subscribers 1 --qos 0 --payload-size 64"}
DURATION=${DURATION:-10s}
run_load() { # extra loadgen args...
    # shellcheck disable=SC2086
    taskset -c "$LOAD_CPU" "$LOADGEN" run $SCENARIO_ARGS --cpu "$LOAD_CPU" --url "mqtt://127.0.0.1:$PORT" \
        --duration "$DURATION" "$@"
}
