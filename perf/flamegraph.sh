#!/usr/bin/env bash
# perf/flamegraph.sh — a flame graph of the fleetmq broker (one shard, pinned
# to BROKER_CPU) under a loadgen scenario (pinned to LOAD_CPU).
#
#   perf/flamegraph.sh                      # fan-in 10 → 1, QoS 0, max, 10 s
#   SCENARIO_ARGS="fan-out --qos 0" DURATION=5s perf/flamegraph.sh
#
# Uses `perf record -g` (event cpu-clock, which works in VMs without hardware
# counters) and inferno (installed with `cargo install inferno` into
# target/peers when missing). Without perf it falls back to
# `valgrind --tool=callgrind` (much slower: the load is cut to a fixed rate)
# and writes callgrind output plus an annotated text profile instead.
# Output: $OUT/flamegraph.svg (or callgrind.out), the loadgen summary.
source "$(dirname "$0")/common.sh"
build
INFERNO=$TARGET/peers/bin
if command -v perf >/dev/null 2>&1 && perf record -q -o /dev/null -e cpu-clock -- true 2>/dev/null; then
    [[ -x $INFERNO/inferno-flamegraph ]] || command -v inferno-flamegraph >/dev/null || {
        echo "installing inferno (cargo install inferno)" >&2
        cargo install inferno --root "$TARGET/peers" >&2
    }
    PATH=$INFERNO:$PATH
    start_fleetmq
    perf record -q -F 999 -e cpu-clock -g --call-graph dwarf,16384 -p "$BROKER_PID" -o "$OUT/perf.data" 2>"$OUT/perf.err" &
    PERF_PID=$!
    sleep 0.5
    run_load --warmup 1s --rate max | tee "$OUT/loadgen.txt"
    kill -INT "$PERF_PID"; wait "$PERF_PID" 2>/dev/null || true; PERF_PID=""
    perf script -i "$OUT/perf.data" 2>/dev/null | inferno-collapse-perf >"$OUT/stacks.folded"
    inferno-flamegraph --title "fleetmq: $SCENARIO_ARGS" <"$OUT/stacks.folded" >"$OUT/flamegraph.svg"
    echo "top frames (self time):"
    perf report -i "$OUT/perf.data" --no-children --stdio --percent-limit 2 2>/dev/null | grep -E '^ +[0-9]' | head -25
    echo "flame graph: $OUT/flamegraph.svg"
else
    echo "perf is unavailable here: falling back to valgrind --tool=callgrind" >&2
    command -v valgrind >/dev/null || { echo "neither perf nor valgrind is installed" >&2; exit 1; }
    start_fleetmq valgrind --tool=callgrind --callgrind-out-file="$OUT/callgrind.out"
    run_load --warmup 1s --rate 2000 | tee "$OUT/loadgen.txt"
    kill -TERM "$BROKER_PID"; wait "$BROKER_PID" 2>/dev/null || true; BROKER_PID=""
    callgrind_annotate "$OUT/callgrind.out" 2>/dev/null | head -40
    echo "callgrind profile: $OUT/callgrind.out (open with kcachegrind)"
fi
