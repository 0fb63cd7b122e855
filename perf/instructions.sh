#!/usr/bin/env bash
# perf/instructions.sh — instructions the broker executes per delivered
# message (repeatable on this noisy machine, unlike wall time).
#
#   perf/instructions.sh                    # fan-in 10 → 1, QoS 0, 20k msg/s, 5 s
#   SCENARIO_ARGS="fan-in --qos 1" RATE=10000 perf/instructions.sh
#
# With hardware counters: `perf stat -e instructions` on the broker while the
# scenario runs. Without them (VMs: "<not supported>"), or when METHOD=callgrind:
# `valgrind --tool=callgrind` on the broker, at a lower fixed rate, counting
# everything from start to stop; the idle cost (start, CONNECTs, stop) is
# measured by a second run with 1/10 of the load and subtracted, so the figure
# is the marginal cost per delivered message.
source "$(dirname "$0")/common.sh"
build
RATE=${RATE:-20000}
DURATION=${DURATION:-5s}
METHOD=${METHOD:-auto}
if [[ $METHOD == auto ]]; then
    if perf stat -e instructions -x, -- true 2>&1 | grep -q '^[0-9]'; then METHOD=perf; else METHOD=callgrind; fi
fi
delivered() { jq -r '.received + 0' "$1"; }

if [[ $METHOD == perf ]]; then
    start_fleetmq
    perf stat -e instructions -x, -p "$BROKER_PID" -o "$OUT/perf-stat.csv" &
    PERF_PID=$!
    run_load --warmup 0s --rate "$RATE" --json "$OUT/load.json" >"$OUT/loadgen.txt"
    kill -INT "$PERF_PID"; wait "$PERF_PID" 2>/dev/null || true; PERF_PID=""
    instr=$(grep instructions "$OUT/perf-stat.csv" | cut -d, -f1)
    n=$(delivered "$OUT/load.json")
    echo "method perf stat; instructions $instr; delivered $n (includes idle cost over the run)"
    awk -v i="$instr" -v n="$n" 'BEGIN { printf "instructions per delivered message: %.0f\n", i/n }'
else
    # Callgrind runs the broker ~50x slower: keep the offered rate modest.
    RATE=${CALLGRIND_RATE:-2000}
    measure() { # RATE -> "instructions delivered"
        start_fleetmq valgrind --tool=callgrind --callgrind-out-file="$OUT/callgrind.$1.out"
        run_load --warmup 0s --rate "$1" --json "$OUT/load.$1.json" >"$OUT/loadgen.$1.txt" || true
        kill -TERM "$BROKER_PID"; wait "$BROKER_PID" 2>/dev/null || true; BROKER_PID=""
        local ir
        ir=$(grep -E '^(summary|totals):' "$OUT/callgrind.$1.out" | tail -n 1 | awk '{print $2}')
        echo "$ir $(delivered "$OUT/load.$1.json")"
    }
    read -r hi_ir hi_n < <(measure "$RATE")
    read -r lo_ir lo_n < <(measure $((RATE / 10)))
    echo "method callgrind; at $RATE msg/s: $hi_ir instructions, $hi_n delivered; at $((RATE / 10)) msg/s: $lo_ir, $lo_n"
    awk -v a="$hi_ir" -v b="$lo_ir" -v n="$hi_n" -v m="$lo_n" \
        'BEGIN { if (n > m) printf "instructions per delivered message (marginal): %.0f\n", (a-b)/(n-m); else print "no messages delivered" }'
fi
echo "details in $OUT"
