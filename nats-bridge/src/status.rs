//! [`ClusterStatus`]: what the admin endpoints and the CONNECT path read
//! of the cluster, written by the bridge thread.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use fleetmq_core::cluster::membership::FenceReason;

use crate::stats::BridgeStats;

/// What the admin endpoints and the CONNECT path read of the cluster.
#[derive(Debug)]
pub struct ClusterStatus {
    /// This replica's ID.
    pub replica_id: String,
    /// This process's instance ID.
    pub instance: String,
    fenced: AtomicBool,
    reason: Mutex<Option<String>>,
    members: Mutex<Vec<String>>,
    /// Retained messages of the initial load, once it is complete.
    retained_loaded: std::sync::atomic::AtomicU64,
    /// Per shard, the retained changes it applied (see
    /// [`ClusterStatus::applied_retained`]).
    retained_applied: Vec<std::sync::atomic::AtomicU64>,
    /// The cluster's format floor, read at start and followed since.
    floor: std::sync::atomic::AtomicU16,
    /// How many times this process came back from a fence.
    epoch: std::sync::atomic::AtomicU64,
    /// Another process runs this replica ID.
    duplicate: AtomicBool,
    /// This replica's entries of an earlier process in `mqtt-routes` were
    /// purged (tried): not ready before.
    routes_purged: AtomicBool,
    /// What the bridge counts.
    pub stats: BridgeStats,
}

impl ClusterStatus {
    pub(crate) fn new(replica_id: String, instance: String, shards: usize) -> ClusterStatus {
        ClusterStatus {
            replica_id,
            instance,
            fenced: AtomicBool::new(true),
            reason: Mutex::new(Some(FenceReason::Starting.as_str().to_owned())),
            members: Mutex::new(Vec::new()),
            retained_loaded: std::sync::atomic::AtomicU64::new(u64::MAX),
            retained_applied: (0..shards).map(|_| std::sync::atomic::AtomicU64::new(0)).collect(),
            floor: std::sync::atomic::AtomicU16::new(*fleetmq_core::cluster::records::FORMATS_READ.start()),
            epoch: std::sync::atomic::AtomicU64::new(0),
            duplicate: AtomicBool::new(false),
            routes_purged: AtomicBool::new(false),
            stats: BridgeStats::default(),
        }
    }

    /// Whether the replica is fenced (or not yet a member): CONNECT is
    /// refused with 0x88.
    pub fn is_fenced(&self) -> bool {
        self.fenced.load(Ordering::Acquire)
    }

    /// Why the replica is not ready, `None` when it is: fenced, starting,
    /// a duplicate replica ID, the retained messages still loading
    /// (until every shard applied the initial load), or the routes of an
    /// earlier process of this replica ID not yet purged.
    pub fn not_ready(&self) -> Option<String> {
        let reason = self.reason.lock().ok().and_then(|r| r.clone());
        reason
            .or_else(|| (!self.retained_applied()).then(|| "loading retained messages".to_owned()))
            .or_else(|| (!self.routes_purged()).then(|| "purging the routes of an earlier process".to_owned()))
    }

    /// Whether this replica's leftover entries in `mqtt-routes` were
    /// purged (see [`ClusterStatus::not_ready`]).
    pub fn routes_purged(&self) -> bool {
        self.routes_purged.load(Ordering::Acquire)
    }

    pub(crate) fn set_routes_purged(&self) {
        self.routes_purged.store(true, Ordering::Release);
    }

    /// Shard `shard` applied `n` more retained changes ([`crate::Event::Retained`]).
    pub fn applied_retained(&self, shard: usize, n: u64) {
        if let Some(applied) = self.retained_applied.get(shard) {
            applied.fetch_add(n, Ordering::Release);
        }
    }

    /// Whether every shard applied the initial load of `mqtt-retained`: a
    /// SUBSCRIBE on any shard is answered from all of it. Changes reach
    /// each shard in order, the load first, so a shard that applied as
    /// many changes as the load held has applied the load.
    pub fn retained_applied(&self) -> bool {
        let loaded = self.retained_loaded.load(Ordering::Acquire);
        loaded != u64::MAX && self.retained_applied.iter().all(|a| a.load(Ordering::Acquire) >= loaded)
    }

    /// The cluster's format floor as this replica last read it.
    pub fn floor(&self) -> u16 {
        self.floor.load(Ordering::Acquire)
    }

    /// The floor is `floor` now: raise this replica's to it (never lower);
    /// true when it moved.
    pub(crate) fn raise_floor(&self, floor: u16) -> bool {
        self.floor.fetch_max(floor, Ordering::AcqRel) < floor
    }

    /// The record format to write: the cluster's format floor, which every
    /// member reads ([`fleetmq_core::cluster::records::write_format`]).
    pub fn write_format(&self) -> u16 {
        fleetmq_core::cluster::records::write_format(self.floor.load(Ordering::Acquire))
    }

    /// This process's epoch: how many times it came back from a fence.
    /// Wills and claims are written with it; those of an older epoch were
    /// handed over to the cluster at a fence (`MemberRecord::epoch`).
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// Whether another process runs this replica ID: this one stays not
    /// ready (DESIGN.md §12) until that one is gone.
    pub fn is_duplicate(&self) -> bool {
        self.duplicate.load(Ordering::Acquire)
    }

    pub(crate) fn set_duplicate(&self, duplicate: bool) {
        self.duplicate.store(duplicate, Ordering::Release);
    }

    pub(crate) fn next_epoch(&self) -> u64 {
        self.epoch.fetch_add(1, Ordering::AcqRel) + 1
    }

    /// Whether the initial load of `mqtt-retained` is complete.
    pub fn retained_loaded(&self) -> bool {
        self.retained_loaded.load(Ordering::Acquire) != u64::MAX
    }

    pub(crate) fn set_retained_loaded(&self, count: u64) {
        self.retained_loaded.store(count, Ordering::Release);
    }

    /// The live replicas (this one included when serving), sorted.
    pub fn members(&self) -> Vec<String> {
        self.members.lock().map(|m| m.clone()).unwrap_or_default()
    }

    pub(crate) fn set_fenced(&self, fenced: bool, reason: Option<String>) {
        if let Ok(mut r) = self.reason.lock() {
            *r = reason;
        }
        self.fenced.store(fenced, Ordering::Release);
    }

    pub(crate) fn set_members(&self, members: Vec<String>) {
        if let Ok(mut m) = self.members.lock() {
            *m = members;
        }
    }
}
