#!/usr/bin/env bash
# Runs every cargo-fuzz target in fuzz/ (its own workspace, outside the main
# one) for FUZZ_SECONDS seconds each (default 60).
#
#   perf/fuzz.sh                  # all targets, 60 s each
#   FUZZ_SECONDS=600 perf/fuzz.sh decode
#
# cargo-fuzz needs a nightly compiler (-Z flags, sanitizers). The script uses
# the rustup nightly toolchain when it has one or can install it, and
# otherwise the stable toolchain with RUSTC_BOOTSTRAP=1. Crashes land in
# fuzz/artifacts/<target>/, the growing corpus in fuzz/corpus/<target>/
# (both ignored by git).
set -euo pipefail

cd "$(dirname "$0")/../fuzz"
FUZZ_SECONDS="${FUZZ_SECONDS:-60}"

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "installing cargo-fuzz" >&2
    cargo install cargo-fuzz --locked
fi

if rustup run nightly rustc --version >/dev/null 2>&1 \
    || rustup toolchain install nightly --profile minimal >/dev/null 2>&1; then
    cargo_cmd=(cargo +nightly)
else
    echo "no nightly toolchain: using stable with RUSTC_BOOTSTRAP=1" >&2
    export RUSTC_BOOTSTRAP=1
    cargo_cmd=(cargo)
fi

targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    mapfile -t targets < <("${cargo_cmd[@]}" fuzz list)
fi

for target in "${targets[@]}"; do
    echo "fuzzing $target for ${FUZZ_SECONDS}s" >&2
    "${cargo_cmd[@]}" fuzz run "$target" -- -max_total_time="$FUZZ_SECONDS" -max_len=4096
done
