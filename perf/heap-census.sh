#!/usr/bin/env bash
# perf/heap-census.sh — where an idle broker's memory goes: fleetmq built
# with the `heap-census` feature (shards/src/census.rs) walks each shard's
# mimalloc heaps before and while IDLE_CONNECTIONS idle connections are held,
# and this script prints, per block size, what the connections added (KiB
# resident, live blocks) and the census totals.
#
#   perf/heap-census.sh                      # --shards 1, 10,000 connections
#   FLEETMQ_SHARDS=2 perf/heap-census.sh
#
# Columns of the totals: `resident_kib` is memory of the pages' blocks that
# is resident; `beyond_kib` is resident memory of a page past the blocks it
# has handed out (memory the page was made from, still resident from an
# earlier use); `outside` is resident memory of the main heap's arena in no
# page of either heap (mimalloc's own bitmaps, freed memory not purged yet).
#
# Environment: FLEETMQ_SHARDS [1], IDLE_CONNECTIONS [10000], BROKER_CPU [0],
# LOAD_CPU [1], CENSUS_AT ["1.9,8.8"]: seconds after start of the two
# censuses (before the connections, and while they are held).
source "$(dirname "$0")/common.sh"
IDLE_CONNECTIONS=${IDLE_CONNECTIONS:-10000}
CENSUS_AT=${CENSUS_AT:-1.9,8.8}

cargo build --release -q -p fleetmq-shards --features heap-census --manifest-path "$ROOT/Cargo.toml"
cp "$TARGET/release/fleetmq" "$OUT/fleetmq-census"
cargo build --release -q -p fleetmq-shards -p fleetmq-loadgen --manifest-path "$ROOT/Cargo.toml"
FLEETMQ=$OUT/fleetmq-census
LOADGEN=$TARGET/release/fleetmq-loadgen

export FLEETMQ_HEAP_CENSUS=$CENSUS_AT
start_fleetmq
sleep 2
taskset -c "$LOAD_CPU" "$LOADGEN" run idle --url "mqtt://127.0.0.1:$PORT" \
    --connections "$IDLE_CONNECTIONS" --connect-rate 5000 --connect-timeout 30s --duration 5s \
    --keep-alive 600 --cpu "$LOAD_CPU" --broker-pid "$BROKER_PID" | grep 'broker RSS'
kill "$BROKER_PID"
wait "$BROKER_PID" 2>/dev/null || true
BROKER_PID=""

grep '^census' "$OUT/broker.err" >"$OUT/census.txt" || { echo "no census in $OUT/broker.err" >&2; exit 1; }
grep -E 'total|outside|aside-whole' "$OUT/census.txt" | cut -c1-200
python3 - "$OUT/census.txt" <<'EOF'
import sys
# Per block size, over the whole main heap: what the second census has
# that the first has not.
seen = {0: {}, 1: {}}
for line in open(sys.argv[1]):
    if "heap=whole" not in line or "total" in line:
        continue
    kv = dict(x.split("=", 1) for x in line.split()[1:])
    n = int(kv["n"])
    if n in seen:
        seen[n][int(kv["block"])] = (float(kv["resident_kib"]), int(kv["live"]))
print(f"{'block B':>10} {'resident KiB':>13} {'live blocks':>12}")
total = 0.0
for block in sorted(set(seen[0]) | set(seen[1])):
    r0, l0 = seen[0].get(block, (0.0, 0))
    r1, l1 = seen[1].get(block, (0.0, 0))
    total += r1 - r0
    if r1 != r0 or l1 != l0:
        print(f"{block:>10} {r1 - r0:>+13.0f} {l1 - l0:>+12}")
print(f"{'all':>10} {total:>+13.0f}")
EOF
echo "census lines: $OUT/census.txt"
