# bench/cluster.sh — the cross-replica scenarios of `bench/compare.sh --cluster`
# (issue 25). Sourced by compare.sh after its helpers (log, free_port,
# nats_bin, median, scenario_args, FLEETMQ, LOADGEN, WORK, OUT); not run alone.
#
# Systems (CLUSTER_SYSTEMS, default all three), each started fresh per run:
#   fleetmq-mesh  two fleetmq replicas a and b (--shards FLEETMQ_SHARDS,
#                 store.kind = none) of one cluster on a local 3-server NATS
#                 cluster with JetStream, linked by the mesh (certificates of
#                 `fleetmq cert --names a,b`, mesh_listen 127.0.0.1:<free>);
#                 publishers on a, subscribers on b (fan-out: spread a, b)
#   fleetmq-one   one fleetmq replica a of such a cluster, every client on it
#   fleetmq-js1   fleetmq-one with store.kind = jetstream (the ingest stream,
#                 PUBACK after JetStream's ack), cluster.nats_replicas = 1
#   fleetmq-js3   the same with cluster.nats_replicas = 3 (R3)
#   nats          a 2-server nats-server MQTT cluster (JetStream, routes);
#                 publishers on server 1, subscribers on server 2 (fan-out:
#                 spread over 1 and 2)
# Scenarios (CLUSTER_SCENARIOS):
#   x-fanin-q0   fan-in FANIN_PUBLISHERS → 1, QoS 0, --rate max
#   x-fanin-q1   the same at QoS 1
#   x-fanout-q0  fan-out 1 → FANOUT_SUBSCRIBERS, QoS 0, --rate max
#   x-p99        fan-in at QoS 0, P99_RATE (20,000) msg/s offered (open loop)
#   x-ingest-q1  fan-in at QoS 1, --rate max (as x-fanin-q1); its p99 is
#                publish-to-PUBACK (ack_latency_us), not delivery: for
#                fleetmq-js1/js3 against nats (both store before PUBACK)
# Every broker process (fleetmq replicas, their NATS servers, nats-server
# MQTT) runs on BROKER_CPU, the loadgen on LOAD_CPU. The table: delivered
# msg/s and p99 µs (medians), fleetmq-mesh / nats and fleetmq-mesh /
# fleetmq-one, the cross-replica deliveries of fleetmq-mesh (0 while the
# mesh forwards nothing), and the bars of issue 25.

CLUSTER_SYSTEMS=${CLUSTER_SYSTEMS:-"fleetmq-mesh fleetmq-one nats"}
CLUSTER_SCENARIOS=${CLUSTER_SCENARIOS:-"x-fanin-q0 x-fanin-q1 x-fanout-q0 x-p99"}
# How long to wait for the mesh link after both replicas are ready.
MESH_WAIT=${MESH_WAIT:-15}
CLUSTER_PIDS=()

# cluster_spawn LOG CMD...: starts CMD pinned to BROKER_CPU, output to LOG;
# its PID joins CLUSTER_PIDS (stopped by cluster_stop and at exit).
cluster_spawn() {
    local log=$1
    shift
    taskset -c "$BROKER_CPU" "$@" >"$log" 2>&1 &
    CLUSTER_PIDS+=($!)
}

# cluster_stop: SIGTERM to every process started, 5 s, then SIGKILL.
cluster_stop() {
    local pid
    ((${#CLUSTER_PIDS[@]})) || return 0
    for pid in "${CLUSTER_PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    for _ in $(seq 50); do
        local alive=0
        for pid in "${CLUSTER_PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        ((alive)) || break
        sleep 0.1
    done
    for pid in "${CLUSTER_PIDS[@]}"; do
        kill -9 "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    CLUSTER_PIDS=()
}

# cluster_died: the processes started that are gone (a name list), empty when all live.
cluster_died() {
    local pid
    for pid in "${CLUSTER_PIDS[@]}"; do kill -0 "$pid" 2>/dev/null || printf '%s ' "$pid"; done
}

# free_ports N: N distinct free loopback ports, one a line.
free_ports() {
    python3 - "$1" <<'PY'
import socket, sys
held = []
for _ in range(int(sys.argv[1])):
    s = socket.socket(); s.bind(("127.0.0.1", 0)); held.append(s)
for s in held:
    print(s.getsockname()[1])
PY
}

# http_status URL: the HTTP status (000 when nothing answers).
http_status() { curl -s -o /dev/null -m 2 -w '%{http_code}' "$1" 2>/dev/null || true; }

# wait_http URL WHAT SECONDS: until URL answers 200.
wait_http() {
    local i
    for ((i = 0; i < $3 * 10; i++)); do
        [[ $(http_status "$1") == 200 ]] && return 0
        [[ -z $(cluster_died) ]] || { log "$2: a process exited (PIDs $(cluster_died))"; return 1; }
        sleep 0.1
    done
    log "$2: $1 not 200 within $3 s"
    return 1
}

# nats_config NAME DIR CLIENT ROUTE MONITOR ROUTES CLUSTER [MQTT]: a JetStream
# server's config file (printed); routes a comma list of route ports.
nats_config() {
    local name=$1 dir=$2 client=$3 route=$4 monitor=$5 routes=$6 cluster=$7 mqtt=${8:-} list=() p
    IFS=, read -ra ports <<<"$routes"
    for p in "${ports[@]}"; do list+=("\"nats-route://127.0.0.1:$p\""); done
    cat <<EOF
server_name: $name
listen: "127.0.0.1:$client"
http: "127.0.0.1:$monitor"
jetstream { store_dir: "$dir/$name-js", max_memory_store: 1G, max_file_store: 4G }
cluster {
  name: "$cluster"
  listen: "127.0.0.1:$route"
  no_advertise: true
  routes: [$(IFS=,; echo "${list[*]}")]
}
EOF
    [[ -z $mqtt ]] || printf 'mqtt { listen: "127.0.0.1:%s" }\n' "$mqtt"
}

# start_nats_cluster DIR N CLUSTER [MQTT]: N JetStream servers in one cluster;
# with MQTT=1 each also serves MQTT. Sets NATS_URLS (client URLs, TOML
# array) and NATS_MQTT_PORTS (array). Waits for /healthz on each.
start_nats_cluster() {
    local dir=$1 n=$2 cluster=$3 mqtt=${4:-0} i j
    local -a p
    mapfile -t p < <(free_ports $((4 * n)))
    local urls=() routes
    NATS_MQTT_PORTS=()
    for ((i = 0; i < n; i++)); do
        routes=""
        for ((j = 0; j < n; j++)); do ((j == i)) || routes+="${routes:+,}${p[4 * j + 1]}"; done
        local mq=""
        ((mqtt)) && { mq=${p[4 * i + 3]}; NATS_MQTT_PORTS+=("$mq"); }
        nats_config "n$i" "$dir" "${p[4 * i]}" "${p[4 * i + 1]}" "${p[4 * i + 2]}" "$routes" "$cluster" "$mq" >"$dir/n$i.conf"
        cluster_spawn "$dir/n$i.log" "$(nats_bin)" -c "$dir/n$i.conf"
        urls+=("\"nats://127.0.0.1:${p[4 * i]}\"")
    done
    NATS_URLS="[$(IFS=,; echo "${urls[*]}")]"
    for ((i = 0; i < n; i++)); do
        wait_http "http://127.0.0.1:${p[4 * i + 2]}/healthz" "nats-server n$i" 60 || {
            tail -n 20 "$dir/n$i.log" >&2
            return 1
        }
    done
}

# start_replica DIR ID: a fleetmq replica of the cluster on NATS_URLS with
# the mesh certificates in DIR/certs; sets MQTT_PORT_<ID> and ADMIN_<ID>.
start_replica() {
    local dir=$1 id=$2 mqtt admin mesh
    read -r mqtt admin mesh < <(free_ports 3 | tr '\n' ' ')
    cluster_spawn "$dir/$id.log" env RUST_LOG=warn "$FLEETMQ" serve --listen "127.0.0.1:$mqtt" \
        --admin "127.0.0.1:$admin" --shards "$FLEETMQ_SHARDS" \
        --set "store.kind=${REPLICA_STORE:-none}" \
        --set "cluster.replica_id=$id" --set "cluster.nats_urls=$NATS_URLS" --set "cluster.nats_replicas=${REPLICA_NATS_REPLICAS:-3}" \
        --set "cluster.mesh_listen=127.0.0.1:$mesh" \
        --set "cluster.mesh_cert=$dir/certs/$id.pem" --set "cluster.mesh_key=$dir/certs/$id.key" \
        --set "cluster.mesh_ca=$dir/certs/ca.pem" $FLEETMQ_ARGS
    printf -v "MQTT_PORT_$id" '%s' "$mqtt"
    printf -v "ADMIN_$id" '%s' "$admin"
}

# mesh_links ADMIN_PORT: the replica's mesh links up (0 when not reported).
mesh_links() {
    curl -s -m 2 "http://127.0.0.1:$1/api/v1/status" 2>/dev/null |
        jq -r '[.. | objects | .mesh_links_up? // empty] | max // 0' 2>/dev/null || echo 0
}

# start_system SYSTEM: starts it fresh; sets PUB_URL, SUB_URL (fan-in) and
# SPREAD_URL (fan-out subscribers), and SYSTEM_DIR.
start_system() {
    local system=$1
    SYSTEM_DIR=$(mktemp -d "$WORK/$system.XXXX")
    ADMIN_a="" ADMIN_b=""
    REPLICA_STORE=none REPLICA_NATS_REPLICAS=3
    case "$system" in
    fleetmq-js1 | fleetmq-js3)
        REPLICA_STORE=jetstream REPLICA_NATS_REPLICAS=${system#fleetmq-js}
        "$FLEETMQ" cert --out "$SYSTEM_DIR/certs" --names a,b >"$SYSTEM_DIR/cert.log" 2>&1 ||
            { log "fleetmq cert failed: $(tail -n 1 "$SYSTEM_DIR/cert.log")"; return 1; }
        start_nats_cluster "$SYSTEM_DIR" 3 "fleetmq-bench" || return 1
        start_replica "$SYSTEM_DIR" a
        wait_http "http://127.0.0.1:$ADMIN_a/health/ready" "replica a" 60 || { tail -n 20 "$SYSTEM_DIR/a.log" >&2; return 1; }
        PUB_URL=mqtt://127.0.0.1:$MQTT_PORT_a SUB_URL=mqtt://127.0.0.1:$MQTT_PORT_a SPREAD_URL=mqtt://127.0.0.1:$MQTT_PORT_a
        ;;
    fleetmq-mesh | fleetmq-one)
        "$FLEETMQ" cert --out "$SYSTEM_DIR/certs" --names a,b >"$SYSTEM_DIR/cert.log" 2>&1 ||
            { log "fleetmq cert failed: $(tail -n 1 "$SYSTEM_DIR/cert.log")"; return 1; }
        start_nats_cluster "$SYSTEM_DIR" 3 "fleetmq-bench" || return 1
        start_replica "$SYSTEM_DIR" a
        [[ $system == fleetmq-one ]] || start_replica "$SYSTEM_DIR" b
        wait_http "http://127.0.0.1:$ADMIN_a/health/ready" "replica a" 60 || { tail -n 20 "$SYSTEM_DIR/a.log" >&2; return 1; }
        PUB_URL=mqtt://127.0.0.1:$MQTT_PORT_a
        if [[ $system == fleetmq-one ]]; then
            SUB_URL=$PUB_URL
            SPREAD_URL=$PUB_URL
            return 0
        fi
        wait_http "http://127.0.0.1:$ADMIN_b/health/ready" "replica b" 60 || { tail -n 20 "$SYSTEM_DIR/b.log" >&2; return 1; }
        SUB_URL=mqtt://127.0.0.1:$MQTT_PORT_b
        SPREAD_URL=$PUB_URL,$SUB_URL
        local i
        for ((i = 0; i < MESH_WAIT * 10; i++)); do
            (($(mesh_links "$ADMIN_a") >= 1 && $(mesh_links "$ADMIN_b") >= 1)) && return 0
            sleep 0.1
        done
        log "fleetmq-mesh: no mesh link up between a and b within $MESH_WAIT s (status mesh_links_up: a $(mesh_links "$ADMIN_a"), b $(mesh_links "$ADMIN_b")); measuring anyway"
        ;;
    nats)
        start_nats_cluster "$SYSTEM_DIR" 2 "mqtt-bench" 1 || return 1
        PUB_URL=mqtt://127.0.0.1:${NATS_MQTT_PORTS[0]}
        SUB_URL=mqtt://127.0.0.1:${NATS_MQTT_PORTS[1]}
        SPREAD_URL=$PUB_URL,$SUB_URL
        # JetStream's MQTT streams are made at the first CONNECT: one
        # client on each server before measuring (its own 30 s budget).
        local url
        for url in "$PUB_URL" "$SUB_URL"; do
            taskset -c "$LOAD_CPU" "$LOADGEN" run fan-in --url "$url" --publishers 1 --subscribers 1 --rate 100 \
                --duration 200ms --warmup 0s --connect-timeout 30s --keep-alive "$KEEP_ALIVE" \
                >"$SYSTEM_DIR/prime.txt" 2>&1 || true
        done
        ;;
    *) log "unknown cluster system $system"; return 1 ;;
    esac
}

# cluster_args SCENARIO: the loadgen's scenario arguments and URLs.
cluster_args() {
    local base
    case "$1" in
    x-fanin-q0) base=fanin-q0 ;;
    x-fanin-q1 | x-ingest-q1) base=fanin-q1 ;;
    x-fanout-q0) base=fanout-q0 ;;
    x-p99) base=fanin-p99 ;;
    *) return 1 ;;
    esac
    scenario_args "$base" || return 1
    if [[ $1 == x-fanout-q0 ]]; then
        echo --pub-url "$PUB_URL" --sub-url "$SPREAD_URL"
    else
        echo --pub-url "$PUB_URL" --sub-url "$SUB_URL"
    fi
}

# fleetmq_drops PREFIX: keeps each replica's /metrics after a run as
# PREFIX.<replica>.metrics and prints the values it dropped by reason
# (fleetmq_messages_dropped_total, summed over shards) and mesh values
# lost, e.g. "drops a: queue_full=1500; b: none". A QoS 0 loss the loadgen
# reports is then placed: in the broker (and why) or not.
fleetmq_drops() {
    local prefix=$1 id port out=""
    for id in a b; do
        port=$(eval "echo \${ADMIN_$id:-}")
        [[ -n $port ]] || continue
        curl -s -m 2 "http://127.0.0.1:$port/metrics" >"$prefix.$id.metrics" 2>/dev/null || true
        out+="$id: $(awk '/^fleetmq_messages_dropped_total\{/ || /^fleetmq_mesh_values_lost_total/ {
                r = $1; if (match(r, /reason="[^"]*"/)) r = substr(r, RSTART + 8, RLENGTH - 9); else sub(/\{.*/, "", r)
                n[r] += $2 } END { for (k in n) if (n[k] > 0) { printf "%s%s=%d", sep, k, n[k]; sep = "," }
                if (!sep) printf "none" }' "$prefix.$id.metrics"); "
    done
    printf 'drops %s' "${out:-none}"
}

# cross_deliveries JSON: the measured deliveries to subscribers on another
# broker than the publishers' (by_url rows without publishers).
cross_deliveries() { jq -r '[.by_url[]? | select(.publishers == 0) | .received] | add // 0' "$1"; }

cluster_main() {
    local -A THROUGHPUT=() P99=() CROSS=()
    local -a systems=()
    local s b r
    for b in $CLUSTER_SYSTEMS; do
        case "$b" in
        nats | fleetmq-mesh | fleetmq-one | fleetmq-js1 | fleetmq-js3)
            # fleetmq's cluster runs on nats-server too.
            ensure_peer nats || { log "SKIPPED $b: no nats-server 2.15 (see $WORK/install-nats.log)"; continue; } ;;
        *) log "unknown cluster system $b"; continue ;;
        esac
        systems+=("$b")
    done
    ((${#systems[@]})) || { log "no system to measure"; return 1; }
    log "cluster mode: ${systems[*]}; load average $(cut -d' ' -f1-3 /proc/loadavg)"
    local load_before
    load_before=$(cut -d' ' -f1-3 /proc/loadavg)
    for s in $CLUSTER_SCENARIOS; do
        PUB_URL=x SUB_URL=x SPREAD_URL=x
        cluster_args "$s" >/dev/null || { log "unknown cluster scenario $s"; continue; }
        local -A TP=() LAT=() XD=()
        for r in $(seq "$RUNS"); do
            RUN=$r
            local n=${#systems[@]} k=$(((r - 1) % ${#systems[@]}))
            for b in "${systems[@]:k}" "${systems[@]:0:k}"; do
                if ! start_system "$b"; then
                    log "$b $s run $r: did not start (logs: $SYSTEM_DIR)"
                    cluster_stop
                    continue
                fi
                local json=$OUT/$b/$s-$r.json args
                mkdir -p "$OUT/$b"
                # shellcheck disable=SC2207
                args=($(cluster_args "$s"))
                if taskset -c "$LOAD_CPU" "$LOADGEN" run "${args[@]}" --json "$json" >"$OUT/$b/$s-$r.txt" 2>&1 || [[ -s $json ]]; then
                    local tp p99 xd
                    tp=$(jq -r '.received_per_s' "$json")
                    # Nothing delivered: no latency to show.
                    if [[ $s == x-ingest-q1 ]]; then
                        # publish-to-PUBACK
                        p99=$(jq -r '.ack_latency_us.p99 // "nan"' "$json")
                    else
                        p99=$(jq -r 'if .received > 0 then .latency_us.p99 else "nan" end' "$json")
                    fi
                    xd=$(cross_deliveries "$json")
                    TP[$b]+="$tp"$'\n'
                    LAT[$b]+="$p99"$'\n'
                    XD[$b]+="$xd"$'\n'
                    log "$b $s run $r: $tp msg/s, p99 $p99 µs, cross-broker deliveries $xd ($(jq -r .check "$json"))"
                else
                    log "$b $s run $r: loadgen failed: $(tail -n 1 "$OUT/$b/$s-$r.txt")"
                fi
                [[ $b == fleetmq-* ]] && log "$b $s run $r: $(fleetmq_drops "$OUT/$b/$s-$r")"
                [[ -z $(cluster_died) ]] || log "$b $s run $r: A PROCESS DIED (PIDs $(cluster_died); logs: $SYSTEM_DIR)"
                cluster_stop
                # Keep the logs of the last run of each system.
                rm -rf "$OUT/$b/logs" && cp -r "$SYSTEM_DIR" "$OUT/$b/logs" 2>/dev/null || true
                rm -rf "$SYSTEM_DIR"
            done
        done
        for b in "${systems[@]}"; do
            THROUGHPUT[$b,$s]=$(printf '%s' "${TP[$b]:-}" | { grep -v -e '^$' -e '^nan$' -e '^null$' || true; } | median)
            P99[$b,$s]=$(printf '%s' "${LAT[$b]:-}" | { grep -v -e '^$' -e '^nan$' -e '^null$' || true; } | median)
            CROSS[$b,$s]=$(printf '%s' "${XD[$b]:-}" | { grep -v -e '^$' || true; } | median)
        done
        unset TP LAT XD
    done

    ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b+0 > 0 && a == a+0) printf "%.2f", a/b; else print "n/a" }'; }
    has() { [[ " ${systems[*]} " == *" $1 "* ]]; }
    {
        printf '%-12s %-6s' scenario figure
        for b in "${systems[@]}"; do printf ' %13s' "$b"; done
        has fleetmq-mesh && has nats && printf ' %18s' "fleetmq-mesh/nats"
        has fleetmq-mesh && has fleetmq-one && printf ' %18s' "mesh/one"
        printf '\n'
        for s in $CLUSTER_SCENARIOS; do
            cluster_args "$s" >/dev/null 2>&1 || continue
            local f
            for f in msg/s p99µs; do
                printf '%-12s %-6s' "$s" "$f"
                for b in "${systems[@]}"; do
                    local v
                    if [[ $f == msg/s ]]; then v=${THROUGHPUT[$b,$s]:-nan}; else v=${P99[$b,$s]:-nan}; fi
                    printf ' %13s' "$(printf '%.0f' "$v" 2>/dev/null || echo nan)"
                done
                local m n o
                if [[ $f == msg/s ]]; then m=${THROUGHPUT[fleetmq-mesh,$s]:-nan} n=${THROUGHPUT[nats,$s]:-nan} o=${THROUGHPUT[fleetmq-one,$s]:-nan}
                else m=${P99[fleetmq-mesh,$s]:-nan} n=${P99[nats,$s]:-nan} o=${P99[fleetmq-one,$s]:-nan}; fi
                has fleetmq-mesh && has nats && printf ' %18s' "$(ratio "$m" "$n")"
                has fleetmq-mesh && has fleetmq-one && printf ' %18s' "$(ratio "$m" "$o")"
                printf '\n'
            done
        done
        printf '(medians of %s runs, %s each, payload %s B; brokers (and fleetmq'"'"'s NATS servers) on CPU %s, loadgen on CPU %s (%s threads); fleetmq --shards %s per replica; load average %s before, %s after; ratios: higher is better for msg/s, lower for p99)\n' \
            "$RUNS" "$DURATION" "$PAYLOAD" "$BROKER_CPU" "$LOAD_CPU" "$LOAD_THREADS" "$FLEETMQ_SHARDS" "$load_before" "$(cut -d' ' -f1-3 /proc/loadavg)"
        local js
        for js in fleetmq-js1 fleetmq-js3; do
            [[ -n ${THROUGHPUT[$js,x-ingest-q1]:-} ]] && has nats || continue
            printf 'x-ingest-q1: %s / nats msg/s %s, p99 publish-to-PUBACK %s µs vs %s µs (bar for js1: at least 2.00)\n' "$js" \
                "$(ratio "${THROUGHPUT[$js,x-ingest-q1]}" "${THROUGHPUT[nats,x-ingest-q1]:-nan}")" \
                "${P99[$js,x-ingest-q1]:-nan}" "${P99[nats,x-ingest-q1]:-nan}"
        done
        if has fleetmq-mesh; then
            printf 'fleetmq-mesh deliveries to subscribers on replica b (median per run):'
            for s in $CLUSTER_SCENARIOS; do printf ' %s %s' "$s" "${CROSS[fleetmq-mesh,$s]:-n/a}"; done
            printf '\n'
            # verdict SCENARIO VALUE ge|le LIMIT: pass / not met, or why there is no figure.
            verdict() {
                local crossed=${CROSS[fleetmq-mesh,$1]:-nan}
                if ! awk -v c="$crossed" 'BEGIN { exit !(c == c+0 && c > 0) }'; then
                    echo "no figure: nothing reached replica b (no mesh forwarding)"
                else
                    awk -v v="$2" -v op="$3" -v l="$4" \
                        'BEGIN { ok = (v == v+0) && (op == "ge" ? v+0 >= l : v+0 <= l); print ok ? "pass" : "not met" }'
                fi
            }
            for s in x-fanin-q0 x-fanin-q1; do
                [[ -n ${THROUGHPUT[fleetmq-mesh,$s]:-} ]] && has nats || continue
                local r
                r=$(ratio "${THROUGHPUT[fleetmq-mesh,$s]}" "${THROUGHPUT[nats,$s]:-nan}")
                printf 'bar %s: fleetmq-mesh / nats %s (issue 25: at least 2.00): %s\n' "$s" "$r" "$(verdict "$s" "$r" ge 2)"
            done
            if [[ -n ${P99[fleetmq-mesh,x-p99]:-} ]]; then
                local p=${P99[fleetmq-mesh,x-p99]}
                printf 'bar x-p99: fleetmq-mesh p99 %s µs at %s msg/s cross-replica (issue 25: at most 1000 µs): %s\n' \
                    "$p" "$P99_RATE" "$(verdict x-p99 "$p" le 1000)"
            fi
        fi
    } | tee "$OUT/summary.txt"
    log "results in $OUT"
}
