//! The local store's health and metrics, shared by every shard's log and
//! read by the admin server (readiness) and `/metrics`.
//!
//! Series (all with a `shard` label):
//!
//! | name | type | what |
//! | --- | --- | --- |
//! | `fleetmq_store_fsync_seconds` | histogram | one write + `fdatasync` of a group commit |
//! | `fleetmq_store_syncs_total` | counter | group commits (writes, with `fdatasync` unless `store.fsync = "never"`) |
//! | `fleetmq_store_log_bytes` | gauge | bytes in the shard's log since start (shard 0 also counts the snapshot) |
//! | `fleetmq_store_failures_total` | counter | commits that failed (disk full, I/O error) |

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tracing::{error, info};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ShardLabel {
    shard: usize,
}

fn fsync_histogram() -> Histogram {
    // 50 µs .. ~0.8 s.
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(50e-6, 2.0, 15))
}

/// The store's series (registered whatever the store kind, at zero).
#[derive(Clone, Debug)]
pub(crate) struct StoreMetrics {
    fsync_seconds: Family<ShardLabel, Histogram, fn() -> Histogram>,
    syncs: Family<ShardLabel, Counter>,
    log_bytes: Family<ShardLabel, Gauge>,
    failures: Family<ShardLabel, Counter>,
}

impl StoreMetrics {
    /// The series, registered in `registry`, present for shards `0..shards`.
    pub(crate) fn register(registry: &mut Registry, shards: usize) -> StoreMetrics {
        let m = StoreMetrics {
            fsync_seconds: Family::new_with_constructor(fsync_histogram as fn() -> Histogram),
            syncs: Family::default(),
            log_bytes: Family::default(),
            failures: Family::default(),
        };
        registry.register("store_fsync_seconds", "Seconds of one group commit: write and fdatasync", m.fsync_seconds.clone());
        registry.register("store_syncs", "Group commits of the local store", m.syncs.clone());
        registry.register("store_log_bytes", "Bytes in the shard's log since start", m.log_bytes.clone());
        registry.register("store_failures", "Group commits that failed (disk full, I/O error)", m.failures.clone());
        for shard in 0..shards {
            let label = ShardLabel { shard };
            drop(m.fsync_seconds.get_or_create(&label));
            drop(m.syncs.get_or_create(&label));
            drop(m.log_bytes.get_or_create(&label));
            drop(m.failures.get_or_create(&label));
        }
        m
    }
}

/// Whether the store takes publishes, and why not.
#[derive(Debug)]
pub(crate) struct Health {
    metrics: StoreMetrics,
    /// Each shard's reason for failing, if it fails.
    failing: Mutex<Vec<Option<String>>>,
    /// Any shard failing, or the log over `store.max_bytes`.
    refusing: AtomicBool,
    bytes: AtomicU64,
    max_bytes: u64,
}

impl Health {
    /// Health of a store of `shards` logs refusing beyond `max_bytes`, of
    /// which `base_bytes` (the snapshot) are already used.
    pub(crate) fn new(metrics: StoreMetrics, shards: usize, max_bytes: u64, base_bytes: u64) -> Health {
        metrics.log_bytes.get_or_create(&ShardLabel { shard: 0 }).set(base_bytes as i64);
        let h = Health {
            metrics,
            failing: Mutex::new(vec![None; shards]),
            refusing: AtomicBool::new(false),
            bytes: AtomicU64::new(base_bytes),
            max_bytes,
        };
        h.update();
        h
    }

    /// True while publishes are refused.
    pub(crate) fn refusing(&self) -> bool {
        self.refusing.load(Ordering::Relaxed)
    }

    /// Why the store refuses, for readiness: `None` while it serves.
    pub(crate) fn problem(&self) -> Option<String> {
        if !self.refusing() {
            return None;
        }
        let failing = self.failing.lock().unwrap_or_else(|e| e.into_inner());
        let reasons: Vec<String> = failing
            .iter()
            .enumerate()
            .filter_map(|(shard, r)| r.as_ref().map(|r| format!("shard {shard}: {r}")))
            .collect();
        if !reasons.is_empty() {
            return Some(format!("store failing, publishes refused: {}", reasons.join("; ")));
        }
        Some(format!(
            "store full: {} bytes of log, store.max_bytes = {}; publishes refused until a restart compacts the log",
            self.bytes.load(Ordering::Relaxed),
            self.max_bytes
        ))
    }

    /// Shard `shard` committed `bytes` in `took`.
    pub(crate) fn synced(&self, shard: usize, bytes: u64, took: Duration) {
        let label = ShardLabel { shard };
        self.metrics.fsync_seconds.get_or_create(&label).observe(took.as_secs_f64());
        self.metrics.syncs.get_or_create(&label).inc();
        self.metrics.log_bytes.get_or_create(&label).inc_by(bytes as i64);
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
        if self.bytes.load(Ordering::Relaxed) > self.max_bytes {
            self.update();
        }
    }

    /// Shard `shard`'s log fails: publishes are refused until it recovers.
    pub(crate) fn fail(&self, shard: usize, reason: String) {
        self.metrics.failures.get_or_create(&ShardLabel { shard }).inc();
        let mut failing = self.failing.lock().unwrap_or_else(|e| e.into_inner());
        if failing[shard].is_none() {
            error!(target: "store", shard, %reason, "store failing: publishes refused until it recovers");
        }
        failing[shard] = Some(reason);
        drop(failing);
        self.update();
    }

    /// Shard `shard`'s log committed: if it was failing, it serves again.
    pub(crate) fn recovered(&self, shard: usize) {
        if !self.refusing() {
            return;
        }
        let mut failing = self.failing.lock().unwrap_or_else(|e| e.into_inner());
        if failing[shard].take().is_some() {
            info!(target: "store", shard, "store writes again: publishes accepted");
        }
        drop(failing);
        self.update();
    }

    fn update(&self) {
        let failing = self.failing.lock().unwrap_or_else(|e| e.into_inner()).iter().any(Option::is_some);
        let full = self.bytes.load(Ordering::Relaxed) > self.max_bytes;
        self.refusing.store(failing || full, Ordering::Relaxed);
    }
}
