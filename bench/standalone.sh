# bench/standalone.sh — the prelude of the cluster benchmarks run on their
# own (bench/resume.sh, bench/suback.sh): their settings' defaults, the
# helpers bench/cluster.sh expects of compare.sh (log, median, nats_bin),
# bench/cluster.sh itself, and the cleanup at exit. Sourced with ROOT set
# and SCRIPT the sourcing script's name (its log prefix and scratch dir).
RUNS=${RUNS:-3}
BROKER_CPU=${BROKER_CPU:-0}
LOAD_CPU=${LOAD_CPU:-1}
FLEETMQ_SHARDS=${FLEETMQ_SHARDS:-1}
FLEETMQ_ARGS=${FLEETMQ_ARGS:-}
KEEP_ALIVE=${KEEP_ALIVE:-600}
MESH_WAIT=${MESH_WAIT:-15}
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
WORK=$(mktemp -d "/tmp/fleetmq-$SCRIPT.XXXXXX")
log() { printf '%s.sh: %s\n' "$SCRIPT" "$*" >&2; }
median() { sort -g | awk '{a[NR]=$1} END {if (NR==0) print "nan"; else if (NR%2) print a[(NR+1)/2]; else print (a[NR/2]+a[NR/2+1])/2}'; }
nats_bin() {
    local b=${FLEETMQ_NATS_SERVER:-}
    [[ -n $b ]] || { [[ -x $TARGET/nats-venv/bin/nats-server ]] && b=$TARGET/nats-venv/bin/nats-server; } ||
        b=$(command -v nats-server) || return 1
    [[ -x "$b" ]] && echo "$b"
}
# shellcheck source=bench/cluster.sh
source "$ROOT/bench/cluster.sh"
cleanup() { cluster_stop; rm -rf "$WORK"; }
# release_binaries: builds them unless BUILD=0; sets FLEETMQ and LOADGEN
# (each kept when given).
release_binaries() {
    if [[ ${BUILD:-1} != 0 ]]; then
        log "building release binaries"
        cargo build --release -q -p fleetmq-shards -p fleetmq-loadgen
    fi
    FLEETMQ=${FLEETMQ:-$TARGET/release/fleetmq}
    LOADGEN=${LOADGEN:-$TARGET/release/fleetmq-loadgen}
}
trap cleanup EXIT
trap 'exit 130' INT TERM
