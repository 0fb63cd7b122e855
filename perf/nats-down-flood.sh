#!/usr/bin/env bash
# perf/nats-down-flood.sh — a cluster replica's RSS while every NATS server
# is down and four MQTT 3.1.1 clients keep sending 1 MB values (the
# fresh-user pass of session 36: 2.4 GB before the retained budget and the
# held-bytes bound). MODE: retained (retained QoS 1 values on new topics) or
# held (one retained value, then QoS 0 values that wait behind it).
#
#   NATS=target/nats-venv/bin/nats-server bash perf/nats-down-flood.sh target/release/fleetmq held
set -euo pipefail
cd "$(dirname "$0")/.."
FLEETMQ=${1:-target/release/fleetmq}
MODE=${2:-retained}
NATS=${NATS:-$(command -v nats-server)}
WORK=$(mktemp -d)
PIDS=()
trap 'for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; done; rm -rf "$WORK"' EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
source perf/nats-cluster.sh
start_nats_cluster
NATS_PIDS="${PIDS[0]},${PIDS[1]},${PIDS[2]}"
PORT=$(free_port)
"$FLEETMQ" serve --listen "127.0.0.1:$PORT" --admin "" --set cluster.replica_id=flood1 \
    --set "cluster.nats_urls=$URLS" --set cluster.nats_replicas=3 >"$WORK/fleetmq.out" 2>"$WORK/fleetmq.log" &
PIDS+=($!)
for _ in $(seq 1 100); do grep -q "fleetmq: ready" "$WORK/fleetmq.out" && break; sleep 0.2; done
grep -q "fleetmq: ready" "$WORK/fleetmq.out" || { echo "fleetmq did not start:"; cat "$WORK/fleetmq.log"; exit 1; }
python3 perf/nats-down-flood.py "$PORT" "${PIDS[3]}" "$NATS_PIDS" "$MODE"
