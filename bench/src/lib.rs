//! Benchmarks live in benches/; see bench/README.md.
