# perf/nats-cluster.sh — sourced by the cluster perf scripts: a 3-server
# NATS JetStream cluster on free loopback ports, with MQTT listeners.
# Needs: $NATS (the nats-server binary), $WORK (a scratch dir), the array
# PIDS (each server's PID is appended; the caller kills them), and
# free_port. Optional: $NATS_CPUS (taskset CPU list for the servers).
# Sets CPORT[i] (client), RPORT[i] (route), MPORT[i] (MQTT), HPORT[i]
# (monitoring: /varz, /jsz) and URLS (the
# TOML array of the three client URLs, for cluster.nats_urls).
start_nats_cluster() {
    declare -ga CPORT RPORT MPORT HPORT
    local i routes=""
    for i in 0 1 2; do CPORT[$i]=$(free_port); RPORT[$i]=$(free_port); MPORT[$i]=$(free_port); HPORT[$i]=$(free_port); done
    for i in 0 1 2; do routes+="nats-route://127.0.0.1:${RPORT[$i]},"; done
    for i in 0 1 2; do
        mkdir -p "$WORK/n$i"
        cat >"$WORK/n$i.conf" <<EOF
server_name: n$i
listen: 127.0.0.1:${CPORT[$i]}
http: 127.0.0.1:${HPORT[$i]}
jetstream { store_dir: "$WORK/n$i" }
cluster { name: perf, listen: 127.0.0.1:${RPORT[$i]}, routes: [${routes%,}] }
mqtt { listen: 127.0.0.1:${MPORT[$i]} }
EOF
        if [ -n "${NATS_CPUS:-}" ]; then
            taskset -c "$NATS_CPUS" "$NATS" -c "$WORK/n$i.conf" >"$WORK/n$i.log" 2>&1 &
        else
            "$NATS" -c "$WORK/n$i.conf" >"$WORK/n$i.log" 2>&1 &
        fi
        PIDS+=($!)
    done
    sleep 3
    URLS="[\"nats://127.0.0.1:${CPORT[0]}\",\"nats://127.0.0.1:${CPORT[1]}\",\"nats://127.0.0.1:${CPORT[2]}\"]"
}
