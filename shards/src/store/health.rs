//! The local store's health and metrics, shared by every shard's log and
//! read by the admin server (readiness) and `/metrics`.
//!
//! Series (all with a `shard` label):
//!
//! | name | type | what |
//! | --- | --- | --- |
//! | `fleetmq_store_fsync_seconds` | histogram | one write + `fdatasync` of a group commit |
//! | `fleetmq_store_syncs_total` | counter | group commits (writes, with `fdatasync` unless `store.fsync = "never"`) |
//! | `fleetmq_store_log_bytes` | gauge | bytes in the shard's log segments (what compaction has not yet replaced) |
//! | `fleetmq_store_failures_total` | counter | commits that failed (disk full, I/O error) |
//!
//! and, for the whole store (no label): `fleetmq_store_snapshot_bytes`
//! (gauge: the newest snapshot, what was live at the last compaction),
//! `fleetmq_store_compacting` (gauge: 1 while a compaction runs),
//! `fleetmq_store_compactions_total` (counter) and
//! `fleetmq_store_compaction_seconds` (histogram: one compaction, from
//! the roll to the removal of what it replaced, off the shards' threads).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tracing::{error, info, warn};

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
    snapshot_bytes: Gauge,
    compacting: Gauge,
    compactions: Counter,
    compaction_seconds: Histogram,
}

impl StoreMetrics {
    /// The series, registered in `registry`, present for shards `0..shards`.
    pub(crate) fn register(registry: &mut Registry, shards: usize) -> StoreMetrics {
        let m = StoreMetrics {
            fsync_seconds: Family::new_with_constructor(fsync_histogram as fn() -> Histogram),
            syncs: Family::default(),
            log_bytes: Family::default(),
            failures: Family::default(),
            snapshot_bytes: Gauge::default(),
            compacting: Gauge::default(),
            compactions: Counter::default(),
            // 1 ms .. ~65 s.
            compaction_seconds: Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(1e-3, 2.0, 17)),
        };
        registry.register("store_fsync_seconds", "Seconds of one group commit: write and fdatasync", m.fsync_seconds.clone());
        registry.register("store_syncs", "Group commits of the local store", m.syncs.clone());
        registry.register("store_log_bytes", "Bytes in the shard's log segments", m.log_bytes.clone());
        registry.register("store_failures", "Group commits that failed (disk full, I/O error)", m.failures.clone());
        registry.register("store_snapshot_bytes", "Bytes of the newest snapshot of the local store", m.snapshot_bytes.clone());
        registry.register("store_compactions", "Compactions of the local store", m.compactions.clone());
        registry.register("store_compacting", "1 while a compaction of the local store runs", m.compacting.clone());
        registry.register("store_compaction_seconds", "Seconds of one compaction of the local store", m.compaction_seconds.clone());
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

/// Whether the store takes publishes, and why not; how big the log is.
#[derive(Debug)]
pub(crate) struct Health {
    metrics: StoreMetrics,
    /// Each shard's reason for failing, if it fails.
    failing: Mutex<Vec<Option<String>>>,
    /// Any shard failing, or the log over `store.max_bytes`.
    refusing: AtomicBool,
    /// Any shard failing.
    any_failing: AtomicBool,
    /// Bytes of the log: the snapshot and every segment.
    bytes: AtomicU64,
    /// Bytes of the newest snapshot.
    snapshot_bytes: AtomicU64,
    /// Bytes of records committed since the start (not segment headers:
    /// a compaction's roll writes those, and they free nothing).
    records: AtomicU64,
    max_bytes: u64,
    /// The compactor thread, woken when a compaction becomes due.
    compactor: std::sync::OnceLock<std::thread::Thread>,
}

impl Health {
    /// Health of a store of `shards` logs refusing beyond `max_bytes`,
    /// holding a snapshot of `snapshot_bytes` and, per shard directory
    /// index, `segment_bytes` of segments.
    pub(crate) fn new(
        metrics: StoreMetrics,
        shards: usize,
        max_bytes: u64,
        snapshot_bytes: u64,
        segment_bytes: &[(usize, u64)],
    ) -> Health {
        metrics.snapshot_bytes.set(snapshot_bytes as i64);
        for &(shard, bytes) in segment_bytes {
            metrics.log_bytes.get_or_create(&ShardLabel { shard }).inc_by(bytes as i64);
        }
        let total = snapshot_bytes + segment_bytes.iter().map(|(_, b)| b).sum::<u64>();
        let h = Health {
            metrics,
            failing: Mutex::new(vec![None; shards]),
            refusing: AtomicBool::new(false),
            any_failing: AtomicBool::new(false),
            bytes: AtomicU64::new(total),
            snapshot_bytes: AtomicU64::new(snapshot_bytes),
            records: AtomicU64::new(0),
            max_bytes,
            compactor: std::sync::OnceLock::new(),
        };
        h.update();
        h
    }

    /// Bytes of the log (snapshot and segments).
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// Bytes of the newest snapshot.
    pub(crate) fn snapshot_bytes(&self) -> u64 {
        self.snapshot_bytes.load(Ordering::Relaxed)
    }

    /// Bytes of records the shards committed since the broker started
    /// (segment headers, which every compaction's roll writes, not
    /// counted): the compactor retries a full store only when this moved.
    pub(crate) fn records(&self) -> u64 {
        self.records.load(Ordering::Relaxed)
    }

    /// `store.max_bytes`.
    pub(crate) fn max_bytes(&self) -> u64 {
        self.max_bytes
    }

    /// Wake `compactor` when a compaction becomes due as the log grows.
    pub(crate) fn wake_on_growth(&self, compactor: std::thread::Thread) {
        let _ = self.compactor.set(compactor);
    }

    /// True while publishes are refused.
    pub(crate) fn refusing(&self) -> bool {
        self.refusing.load(Ordering::Relaxed)
    }

    /// True while a shard's writes fail.
    pub(crate) fn failing(&self) -> bool {
        self.any_failing.load(Ordering::Relaxed)
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
            "store full: {} bytes of log ({} live at the last compaction), store.max_bytes = {}; publishes refused \
             until compaction brings the log under it",
            self.bytes(),
            self.snapshot_bytes(),
            self.max_bytes
        ))
    }

    /// Shard `shard` committed `bytes` in `took`.
    pub(crate) fn synced(&self, shard: usize, bytes: u64, took: Duration) {
        let label = ShardLabel { shard };
        self.metrics.fsync_seconds.get_or_create(&label).observe(took.as_secs_f64());
        self.metrics.syncs.get_or_create(&label).inc();
        self.records.fetch_add(bytes, Ordering::Relaxed);
        self.grew(shard, bytes);
    }

    /// Shard `shard`'s log grew by `bytes` (records or a segment header).
    pub(crate) fn grew(&self, shard: usize, bytes: u64) {
        self.metrics.log_bytes.get_or_create(&ShardLabel { shard }).inc_by(bytes as i64);
        let now = self.bytes.fetch_add(bytes, Ordering::Relaxed) + bytes;
        if now > self.max_bytes && !self.refusing() {
            self.update();
        }
        if super::compact::due(now, self.snapshot_bytes(), self.max_bytes, false) {
            if let Some(compactor) = self.compactor.get() {
                compactor.unpark();
            }
        }
    }

    /// A compaction starts (`true`) or ends.
    pub(crate) fn compacting(&self, running: bool) {
        self.metrics.compacting.set(i64::from(running));
    }

    /// A compaction of `took` wrote a snapshot of `snapshot` bytes and
    /// removed the previous one (`old_snapshot` bytes) and, per shard
    /// directory index, `removed` bytes of segments: publishes are taken
    /// again if the log is back under `store.max_bytes`.
    pub(crate) fn compacted(&self, removed: &[(usize, u64)], old_snapshot: u64, snapshot: u64, took: Duration) {
        let mut freed = old_snapshot;
        for &(shard, bytes) in removed {
            self.metrics.log_bytes.get_or_create(&ShardLabel { shard }).dec_by(bytes as i64);
            freed += bytes;
        }
        let _ = self.bytes.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| Some(b.saturating_sub(freed) + snapshot));
        self.snapshot_bytes.store(snapshot, Ordering::Relaxed);
        self.metrics.snapshot_bytes.set(snapshot as i64);
        self.metrics.compactions.inc();
        self.metrics.compaction_seconds.observe(took.as_secs_f64());
        let was = self.refusing();
        self.update();
        if was && !self.refusing() {
            info!(target: "store", bytes = self.bytes(), max_bytes = self.max_bytes, "store under store.max_bytes again: publishes accepted");
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
        let full = self.bytes() > self.max_bytes;
        self.any_failing.store(failing, Ordering::Relaxed);
        let was = self.refusing.swap(failing || full, Ordering::Relaxed);
        if full && !was {
            warn!(
                target: "store",
                bytes = self.bytes(),
                live = self.snapshot_bytes(),
                max_bytes = self.max_bytes,
                "store full (store.max_bytes): publishes refused until compaction brings the log under it"
            );
        }
    }
}
