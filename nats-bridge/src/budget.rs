//! What waits for NATS, bounded (DESIGN.md §3: "a bounded queue ...
//! credit-based backpressure"): retained writes take a [`Ticket`] from the
//! bridge's [`Budget`] before they are queued, and give it back when
//! their wait ends (written or refused); the undo of a refused write that
//! may still land takes one from a budget of its own.
//!
//! The request queue alone bounded only how many requests wait to be
//! *taken*; each one taken became a task of its own, and a task waits for
//! NATS for as long as `cluster.session_log_append_wait` and then some
//! (async-nats' own acknowledgement window of 5,000 publishes is awaited
//! with no deadline). With every NATS server stopped, a client flooding
//! retained QoS 0 values on distinct topics made 80,000 such tasks a
//! second (a debug build), about 4 KiB each with their records: 4.3 GiB
//! in 25 s, and the bridge thread, busy with them, fenced the replica
//! after 24 s instead of ~12 (perf/RESULTS.md, s36). Claims, wills and
//! releases need no ticket: one per CONNECT or connection end, bounded by
//! the connection limits.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

/// Retained writes that may wait for NATS at once (queued or in flight):
/// far more than a round trip of a few milliseconds needs to keep
/// JetStream busy; at 2 s (DESIGN.md §6: "full service") ~2,000 writes a
/// second.
pub const RETAINED_WAITING_MAX: usize = 4_096;

/// Bytes of retained records (and their topics) that may wait for NATS at
/// once: 32 MiB, room for 32 values of NATS' default `max_payload`
/// (1 MiB).
pub const RETAINED_WAITING_BYTES: usize = 32 << 20;

/// Undos of refused retained writes that may look for their write at
/// once (each for up to a minute, `retained.rs`): apart from the writes'
/// bound, so that the undos an outage leaves behind do not refuse the
/// writes that follow once NATS answers again.
pub const RETAINED_UNDOS_MAX: usize = 4_096;

/// Bytes the undos may hold at once (topics and the values they put
/// back): 8 MiB.
pub const RETAINED_UNDOS_BYTES: usize = 8 << 20;

/// Ingest appends (`store.kind = "jetstream"`) that may wait for NATS at
/// once, queued or in flight: the window of publish acknowledgements is
/// async-nats' (5,000); beyond it they wait in the bridge. A backstop:
/// each shard pauses a publisher with 256 values unanswered, and all its
/// publishers past 64 MiB of them (`shards/src/shard/held.rs`).
pub const INGEST_WAITING_MAX: usize = 65_536;

/// Bytes of ingest appends (payloads, headers, and 1 KiB each) that may
/// wait for NATS at once: 256 MiB.
pub const INGEST_WAITING_BYTES: usize = 256 << 20;

/// What a write costs beyond its record and topic (its task on the
/// bridge thread, its request, async-nats' command), bytes: counted so
/// that many small writes are bounded by the bytes too.
const PER_WRITE_BYTES: usize = 1_024;

/// Retained writes (or undos) waiting for NATS: how many and how many
/// bytes, and their bounds.
#[derive(Debug)]
pub(crate) struct Budget {
    count: AtomicUsize,
    bytes: AtomicUsize,
    max_count: usize,
    max_bytes: usize,
    /// Tickets refused so far.
    pub(crate) refused: AtomicU64,
}

/// A retained write's share of the [`Budget`], given back when dropped.
#[derive(Debug)]
pub struct Ticket {
    budget: Arc<Budget>,
    bytes: usize,
}

impl Budget {
    /// The retained writes' budget: [`RETAINED_WAITING_MAX`],
    /// [`RETAINED_WAITING_BYTES`].
    pub(crate) fn writes() -> Budget {
        Budget::new(RETAINED_WAITING_MAX, RETAINED_WAITING_BYTES)
    }

    /// The ingest appends' budget: [`INGEST_WAITING_MAX`],
    /// [`INGEST_WAITING_BYTES`].
    pub(crate) fn ingest() -> Budget {
        Budget::new(INGEST_WAITING_MAX, INGEST_WAITING_BYTES)
    }

    /// The undos' budget: [`RETAINED_UNDOS_MAX`], [`RETAINED_UNDOS_BYTES`].
    pub(crate) fn undos() -> Budget {
        Budget::new(RETAINED_UNDOS_MAX, RETAINED_UNDOS_BYTES)
    }

    fn new(max_count: usize, max_bytes: usize) -> Budget {
        Budget {
            count: AtomicUsize::new(0),
            bytes: AtomicUsize::new(0),
            max_count,
            max_bytes,
            refused: AtomicU64::new(0),
        }
    }

    /// A ticket for a write of `size` bytes (record and topic), or `None`
    /// when the bound's count or bytes already wait.
    pub(crate) fn take(self: &Arc<Self>, size: usize) -> Option<Ticket> {
        let bytes = size + PER_WRITE_BYTES;
        let count = self.count.fetch_add(1, Ordering::AcqRel);
        let before = self.bytes.fetch_add(bytes, Ordering::AcqRel);
        // One write always fits an empty budget (a value of up to NATS
        // max_payload is refused later, by size, as before).
        if count >= self.max_count || (count > 0 && before + bytes > self.max_bytes) {
            self.count.fetch_sub(1, Ordering::AcqRel);
            self.bytes.fetch_sub(bytes, Ordering::AcqRel);
            self.refused.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        Some(Ticket { budget: self.clone(), bytes })
    }

    /// Writes waiting now.
    pub(crate) fn count(&self) -> usize {
        self.count.load(Ordering::Relaxed)
    }

    /// Bytes waiting now (with [`PER_WRITE_BYTES`] each).
    pub(crate) fn bytes(&self) -> usize {
        self.bytes.load(Ordering::Relaxed)
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.budget.count.fetch_sub(1, Ordering::AcqRel);
        self.budget.bytes.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tickets_are_refused_past_the_count_and_given_back_when_dropped() {
        let budget = Arc::new(Budget::writes());
        let tickets: Vec<_> = (0..RETAINED_WAITING_MAX).map(|_| budget.take(10).expect("room")).collect();
        assert!(budget.take(10).is_none());
        assert_eq!(budget.refused.load(Ordering::Relaxed), 1);
        drop(tickets);
        assert_eq!((budget.count(), budget.bytes()), (0, 0));
        assert!(budget.take(10).is_some());
    }

    #[test]
    fn tickets_are_refused_past_the_bytes_but_one_write_always_fits() {
        let budget = Arc::new(Budget::writes());
        let big = budget.take(RETAINED_WAITING_BYTES * 2).expect("alone, it fits");
        assert!(budget.take(1).is_none());
        drop(big);
        let half = budget.take(RETAINED_WAITING_BYTES / 2).expect("room");
        assert!(budget.take(RETAINED_WAITING_BYTES / 2).is_none());
        assert!(budget.take(1_000).is_some());
        drop(half);
    }
}
