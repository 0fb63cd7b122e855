//! What the bridge counts, for `/metrics` (DESIGN.md §12): the NATS round
//! trip per operation kind, the request queue, requests in flight and
//! reconnects.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use hdrhistogram::Histogram;

/// The kinds of JetStream operation whose round trips are measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum OpKind {
    /// A membership heartbeat (lease connection).
    Heartbeat,
    /// The store probe (`$JS.API.INFO`, state connection).
    Probe,
    /// A client identifier claim (read and compare-and-set).
    Claim,
    /// A client identifier release.
    Release,
    /// A retained message write.
    Retained,
    /// A write (put or delete) of this replica's entry in `mqtt-routes`.
    Route,
    /// A write (put or delete) of a persistent session's record in
    /// `mqtt-session-state`.
    Session,
    /// An append to the ingest stream (`store.kind = "jetstream"`), from
    /// its request to its acknowledgement (or refusal).
    Ingest,
}

impl OpKind {
    /// Every kind, in the order of [`OpKind::name`].
    pub const ALL: [OpKind; 8] = [
        OpKind::Heartbeat,
        OpKind::Probe,
        OpKind::Claim,
        OpKind::Release,
        OpKind::Retained,
        OpKind::Route,
        OpKind::Session,
        OpKind::Ingest,
    ];

    /// The `op` label value.
    pub fn name(self) -> &'static str {
        match self {
            OpKind::Heartbeat => "heartbeat",
            OpKind::Probe => "probe",
            OpKind::Claim => "claim",
            OpKind::Release => "release",
            OpKind::Retained => "retained",
            OpKind::Route => "route",
            OpKind::Session => "session",
            OpKind::Ingest => "ingest",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// The bridge's counters, shared with the admin thread.
#[derive(Debug)]
pub struct BridgeStats {
    /// Round trips per [`OpKind`], in microseconds.
    round_trips: Vec<Mutex<Histogram<u64>>>,
    /// Requests taken from the queue and not yet completed.
    pub in_flight: AtomicI64,
    /// Releases held while claims are in flight (see `releases.rs`).
    pub releases_held: AtomicU64,
    /// Times a NATS connection of the bridge (state, lease, ingest) was
    /// re-established, forced or not (counted by `liveness.rs` within
    /// member_ttl/10).
    pub reconnects: AtomicU64,
    /// Times the state connection was forced to reconnect to another
    /// server because the one it used went silent (see `liveness.rs`).
    pub reconnects_forced_state: AtomicU64,
    /// The same for the lease connection.
    pub reconnects_forced_lease: AtomicU64,
    /// The same for the ingest connection (`store.kind = "jetstream"`).
    pub reconnects_forced_ingest: AtomicU64,
    /// Times the ingest connection was moved to the ingest stream's
    /// leader (see `leader.rs`).
    pub ingest_connection_moves: AtomicU64,
    /// Requests refused because the queue was full.
    pub queue_full: AtomicU64,
    /// Wills of gone replicas' connections this replica sent as sweeper.
    pub wills_sent: AtomicU64,
    /// Such wills withheld because the client came back within the grace.
    pub wills_withheld: AtomicU64,
    /// Persistent sessions of gone replicas this replica ended as
    /// sweeper, their Session Expiry Interval passed (record, cursor and
    /// QoS 2 flows deleted).
    pub sessions_swept: AtomicU64,
    /// Retained writes whose publisher waited, refused (not stored within
    /// `session_log_append_wait`, or too large).
    pub retained_refused: AtomicU64,
    /// Retained writes nobody waited for (QoS 0, wills) that JetStream
    /// did not take.
    pub retained_failed: AtomicU64,
    /// Retained writes nobody waited for (QoS 0, wills) dropped before
    /// NATS because [`crate::RETAINED_WAITING_MAX`] writes or
    /// [`crate::RETAINED_WAITING_BYTES`] bytes already waited for it.
    pub retained_dropped: AtomicU64,
    /// Refused retained writes that may land late and are not looked for
    /// (no undo), because [`crate::RETAINED_UNDOS_MAX`] undos already
    /// were.
    pub retained_not_undone: AtomicU64,
    /// Refused retained writes that landed late and were undone.
    pub retained_undone: AtomicU64,
    /// Client identifier claims that waited before writing over another
    /// replica's claim made less than `FLAP_DELAY` ago (a flapping client
    /// identifier).
    pub claims_delayed: AtomicU64,
    /// Session records not written because another process wrote the
    /// client identifier's record since this one's last write and this
    /// process no longer owns the identifier (a late write of a replica
    /// the client left: it would have replaced the new owner's record).
    pub session_records_stale: AtomicU64,
    /// SUBACKs sent without their route written to `mqtt-routes` within
    /// 2 s (DESIGN.md §10), counted by the shards.
    pub routes_late: AtomicU64,
    /// Distinct filters this replica's clients want: its entries in
    /// `mqtt-routes` (once written).
    pub routes_local: AtomicU64,
    /// Other replicas' entries of `mqtt-routes` applied (their replica
    /// live, written by its live process).
    pub routes_remote: AtomicU64,
    /// Values appended to the ingest stream (acknowledged by JetStream).
    pub ingest_appended: AtomicU64,
    /// Ingest appends refused to their publisher: not taken within
    /// `cluster.session_log_append_wait` (MQTT 5: 0x80).
    pub ingest_refused_unavailable: AtomicU64,
    /// Ingest appends refused because the stream is full (`max_bytes`,
    /// discard new; MQTT 5: 0x97).
    pub ingest_refused_full: AtomicU64,
    /// Ingest appends refused before NATS: [`crate::INGEST_WAITING_MAX`]
    /// appends or [`crate::INGEST_WAITING_BYTES`] already waited, or the
    /// bridge's queue was full (MQTT 5: 0x97).
    pub ingest_refused_queue: AtomicU64,
    /// Ingest appends refused because the value with its headers does not
    /// fit one NATS message (`max_payload`; MQTT 5: 0x97).
    pub ingest_refused_too_large: AtomicU64,
    /// Values appended to a session log (acknowledged by JetStream).
    pub log_appended: AtomicU64,
    /// Values a persistent session had not read when its session log
    /// dropped them (its oldest, `cluster.session_log_max_bytes` or
    /// `limits.max_session_expiry`): found at a resume.
    pub log_missed: AtomicU64,
}

impl Default for BridgeStats {
    fn default() -> Self {
        BridgeStats {
            round_trips: OpKind::ALL
                .iter()
                .map(|_| Mutex::new(Histogram::new_with_bounds(1, 60_000_000, 2).expect("valid bounds")))
                .collect(),
            in_flight: AtomicI64::new(0),
            releases_held: AtomicU64::new(0),
            reconnects: AtomicU64::new(0),
            queue_full: AtomicU64::new(0),
            reconnects_forced_state: AtomicU64::new(0),
            reconnects_forced_lease: AtomicU64::new(0),
            reconnects_forced_ingest: AtomicU64::new(0),
            ingest_connection_moves: AtomicU64::new(0),
            wills_sent: AtomicU64::new(0),
            wills_withheld: AtomicU64::new(0),
            sessions_swept: AtomicU64::new(0),
            retained_refused: AtomicU64::new(0),
            retained_failed: AtomicU64::new(0),
            retained_dropped: AtomicU64::new(0),
            retained_not_undone: AtomicU64::new(0),
            retained_undone: AtomicU64::new(0),
            claims_delayed: AtomicU64::new(0),
            session_records_stale: AtomicU64::new(0),
            routes_late: AtomicU64::new(0),
            routes_local: AtomicU64::new(0),
            routes_remote: AtomicU64::new(0),
            ingest_appended: AtomicU64::new(0),
            ingest_refused_unavailable: AtomicU64::new(0),
            ingest_refused_full: AtomicU64::new(0),
            ingest_refused_too_large: AtomicU64::new(0),
            ingest_refused_queue: AtomicU64::new(0),
            log_appended: AtomicU64::new(0),
            log_missed: AtomicU64::new(0),
        }
    }
}

impl BridgeStats {
    /// Record one round trip of `kind`.
    pub fn record(&self, kind: OpKind, took: Duration) {
        let micros = (took.as_micros() as u64).clamp(1, 60_000_000);
        if let Ok(mut h) = self.round_trips[kind.index()].lock() {
            let _ = h.record(micros);
        }
    }

    /// The round trips of `kind` so far: (count, sum in seconds, and the
    /// cumulative count at or below each of `bounds_s`).
    pub fn round_trips(&self, kind: OpKind, bounds_s: &[f64]) -> (u64, f64, Vec<u64>) {
        let Ok(h) = self.round_trips[kind.index()].lock() else {
            return (0, 0.0, vec![0; bounds_s.len()]);
        };
        let sum: f64 = h.iter_recorded().map(|v| v.value_iterated_to() as f64 * v.count_at_value() as f64).sum();
        let below = bounds_s
            .iter()
            .map(|b| {
                let limit = (b * 1e6) as u64;
                h.iter_recorded().filter(|v| v.value_iterated_to() <= limit).map(|v| v.count_at_value()).sum()
            })
            .collect();
        (h.len(), sum / 1e6, below)
    }

    /// `quantile` (0..=1) of the round trips of `kind`, in microseconds.
    pub fn quantile_us(&self, kind: OpKind, quantile: f64) -> u64 {
        self.round_trips[kind.index()].lock().map(|h| h.value_at_quantile(quantile)).unwrap_or(0)
    }

    pub(crate) fn started(&self) {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn finished(&self) {
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Counts a task in [`BridgeStats::in_flight`] while it lives (the
/// bridge's stop waits for those, at most its drain).
pub(crate) struct InFlight<'a>(&'a BridgeStats);

impl<'a> InFlight<'a> {
    /// Counted from now.
    pub(crate) fn new(stats: &'a BridgeStats) -> Self {
        stats.started();
        InFlight(stats)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.finished();
    }
}
