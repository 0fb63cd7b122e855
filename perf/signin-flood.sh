#!/usr/bin/env bash
# perf/signin-flood.sh — a device against a flood of wrong passwords (issue
# 29), fleetmq builds and Mosquitto in one run. Each broker in turn, pinned
# to BROKER_CPU, with a password file holding dev:right; the clients (python3,
# raw MQTT 5 CONNECTs, pinned to LOAD_CPU) bind distinct 127.0.0.x source
# addresses:
#   nat   ATTACKERS threads send wrong passwords for 8 other user names from
#         the device's own address 127.0.0.2 (a shared NAT)
#   user  ATTACKERS threads send wrong passwords for the device's user name
#         from 127.0.0.3 (the device signed in once before the flood)
#   quiet no flood: the device's sign-in alone (its password check's cost)
# Meanwhile the device (127.0.0.2, client identifier device-1, the right
# password) reconnects every 200 ms (DEVICE=0: not at all). Printed, one
# JSON line per (run, scenario, broker): the device's successful sign-ins
# (of its attempts) and
# their p50 / max latency, the flood's CONNECTs per second and the verified
# answers it got per second (0x86: the password was checked and found wrong;
# 0x87 / 0x89 are fleetmq's refusals without a check; Mosquitto has no
# throttle, so every answer it gives is verified).
#
# Environment: BROKERS ["fleetmq mosquitto"]; a name "fleetmq=PATH" runs the
# fleetmq binary PATH under that label (e.g. "before=/tmp/fleetmq-old");
# FLEETMQ [target/release/fleetmq]; SCENARIOS ["nat user quiet"]; RUNS [3];
# DURATION [10] seconds; ATTACKERS [4] threads; BROKER_CPU [0]; LOAD_CPU [1].
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
FLEETMQ=${FLEETMQ:-$TARGET/release/fleetmq}
BROKERS=${BROKERS:-"fleetmq mosquitto"}
SCENARIOS=${SCENARIOS:-"nat user quiet"}
DEVICE=${DEVICE:-1}
RUNS=${RUNS:-3}
DURATION=${DURATION:-10}
ATTACKERS=${ATTACKERS:-4}
BROKER_CPU=${BROKER_CPU:-0}
LOAD_CPU=${LOAD_CPU:-1}
OUT=$(mktemp -d /tmp/signin-flood.XXXXXX)
BROKER_PID=""
cleanup() {
    [ -n "$BROKER_PID" ] && { kill "$BROKER_PID" 2>/dev/null || true; wait "$BROKER_PID" 2>/dev/null || true; }
    rm -rf "$OUT"
}
trap cleanup EXIT

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'
}

wait_port() {
    for _ in $(seq 200); do
        python3 -c "import socket,sys; s=socket.socket(); sys.exit(s.connect_ex(('127.0.0.1',$1)))" && return 0
        kill -0 "$BROKER_PID" 2>/dev/null || { cat "$OUT/broker.err" >&2; return 1; }
        sleep 0.05
    done
    return 1
}

# start NAME: the broker NAME on a free port (sets PORT, BROKER_PID).
start() {
    PORT=$(free_port)
    case "$1" in
    mosquitto)
        rm -f "$OUT/mosquitto.pw"
        mosquitto_passwd -c -b "$OUT/mosquitto.pw" dev right 2>/dev/null
        # Started as root, Mosquitto drops to its own user before reading it.
        chmod 755 "$OUT" && chmod 644 "$OUT/mosquitto.pw"
        printf 'listener %s 127.0.0.1\nallow_anonymous false\npassword_file %s\n' \
            "$PORT" "$OUT/mosquitto.pw" >"$OUT/mosquitto.conf"
        taskset -c "$BROKER_CPU" mosquitto -c "$OUT/mosquitto.conf" >"$OUT/broker.out" 2>"$OUT/broker.err" &
        ;;
    *)
        local bin=$FLEETMQ
        [[ "$1" == *=* ]] && bin=${1#*=}
        [ -f "$OUT/fleetmq.pw" ] || echo right | "$bin" passwd "$OUT/fleetmq.pw" dev --password-stdin 2>/dev/null
        RUST_LOG=warn taskset -c "$BROKER_CPU" "$bin" serve --listen "127.0.0.1:$PORT" --admin "" \
            --shards 1 --set store.kind=none --set "auth.password_file=\"$OUT/fleetmq.pw\"" --set auth.allow_anonymous=false \
            >"$OUT/broker.out" 2>"$OUT/broker.err" &
        ;;
    esac
    BROKER_PID=$!
    wait_port "$PORT"
}

stop() {
    kill "$BROKER_PID" 2>/dev/null || true
    wait "$BROKER_PID" 2>/dev/null || true
    BROKER_PID=""
}

# flood SCENARIO: one run against PORT; prints one JSON line.
flood() {
    taskset -c "$LOAD_CPU" python3 - "$PORT" "$1" "$DURATION" "$ATTACKERS" "$DEVICE" <<'EOF'
import json, socket, struct, sys, threading, time
port, scenario, duration = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
attackers = 0 if scenario == "quiet" else int(sys.argv[4])
with_device = sys.argv[5] == "1"

def s(b): return struct.pack(">H", len(b)) + b
def connect(cid, user, pw):
    body = s(b"MQTT") + bytes([5, 0xC2]) + struct.pack(">H", 60) + b"\0" + s(cid) + s(user) + s(pw)
    n, rl = len(body), b""
    while True:
        d, n = n % 128, n // 128
        rl += bytes([d | (0x80 if n else 0)])
        if not n: break
    return b"\x10" + rl + body

def attempt(source, cid, user, pw):
    """The CONNACK reason code, or None if the broker closed first."""
    sock = socket.socket()
    try:
        # IP_BIND_ADDRESS_NO_PORT: the port is picked at connect, where
        # TIME_WAIT pairs of earlier runs can be reused; bound at bind, a
        # few seconds of flood would run out of ports.
        sock.setsockopt(socket.IPPROTO_IP, 24, 1)
        sock.bind((source, 0)); sock.settimeout(30)
        sock.connect(("127.0.0.1", port)); sock.sendall(connect(cid, user, pw))
        got = b""
        while len(got) < 4:
            chunk = sock.recv(64)
            if not chunk: return None
            got += chunk
        return got[3]
    except OSError:
        return None
    finally:
        sock.close()

stop, codes, lock, n = time.monotonic() + duration, {}, threading.Lock(), [0]
def attacker(t):
    i = 0
    while time.monotonic() < stop:
        i += 1
        if scenario == "nat":
            rc = attempt("127.0.0.2", b"a%d-%d" % (t, i), b"other-%d" % (i % 8), b"wrong")
        else:
            rc = attempt("127.0.0.3", b"a%d-%d" % (t, i), b"dev", b"wrong")
        with lock:
            codes[rc] = codes.get(rc, 0) + 1

assert attempt("127.0.0.2", b"device-1", b"dev", b"right") == 0, "the device signs in before the flood"
started = time.monotonic()
threads = [threading.Thread(target=attacker, args=(t,)) for t in range(attackers)]
for th in threads: th.start()
device, latencies = [], []
time.sleep(1)  # the flood takes hold first
while with_device and time.monotonic() < stop:
    t0 = time.monotonic()
    device.append(attempt("127.0.0.2", b"device-1", b"dev", b"right"))
    latencies.append(time.monotonic() - t0)
    time.sleep(0.2)
for th in threads: th.join()
elapsed = time.monotonic() - started
latencies.sort()
ms = lambda i: round(latencies[i] * 1000, 1) if latencies else None
print(json.dumps({
    "device_ok": device.count(0), "device_tries": len(device),
    "device_p50_ms": ms(len(latencies) // 2), "device_max_ms": ms(-1),
    "flood_per_s": round(sum(codes.values()) / elapsed) if codes else 0,
    "codes": {str(k): v for k, v in codes.items()},
    "elapsed": elapsed,
}))
EOF
}

printf 'broker\tscenario\trun\tresult\n'
for run in $(seq "$RUNS"); do
    for scenario in $SCENARIOS; do
        for broker in $BROKERS; do
            start "$broker"
            printf '%s\t%s\t%s\t%s\n' "${broker%%=*}" "$scenario" "$run" "$(flood "$scenario")"
            stop
        done
    done
done
