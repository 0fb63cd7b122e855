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
