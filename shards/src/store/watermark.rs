//! How far the local store is durable across every shard's log, in log
//! sequence numbers (the node-wide order of [`fleetmq_core::store::Record`]s).
//!
//! A shard's own acknowledgements wait for its own log (a [`super::Token`]).
//! A PUBLISH to a logged session also depends on another shard's log: the
//! value it carries was logged by the shard that received it. Writing it to
//! the subscriber before that record is durable would let a crash take the
//! value back after the subscriber saw it, and the publisher's resend would
//! then reach the subscriber a second time under a new packet identifier
//! (QoS 2 exactly once broken, DESIGN.md §7). So such a PUBLISH also waits
//! until [`Watermark::durable`] reaches its log sequence number.
//!
//! Each shard publishes the sequence number of its oldest record not yet
//! durable (`u64::MAX`: none). Within a shard sequence numbers increase, so
//! every record below the minimum over the shards is durable. A shard
//! publishes its oldest before it routes anything that record carries, so
//! a value seen on another shard is never taken for durable too early.

use std::sync::atomic::{AtomicU64, Ordering};

/// Every shard's oldest record not yet durable.
pub(crate) struct Watermark {
    oldest: Vec<AtomicU64>,
}

impl Watermark {
    /// Nothing pending on any of `shards` shards.
    pub(crate) fn new(shards: usize) -> Watermark {
        Watermark {
            oldest: (0..shards).map(|_| AtomicU64::new(u64::MAX)).collect(),
        }
    }

    /// Shard `shard`'s oldest record not yet durable is `lsn` (`None`:
    /// everything it appended is durable).
    pub(crate) fn set_oldest(&self, shard: usize, lsn: Option<u64>) {
        self.oldest[shard].store(lsn.unwrap_or(u64::MAX), Ordering::Release);
    }

    /// Every record with a sequence number up to this one is durable.
    pub(crate) fn durable(&self) -> u64 {
        self.oldest
            .iter()
            .map(|o| o.load(Ordering::Acquire))
            .min()
            .unwrap_or(u64::MAX)
            .saturating_sub(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_durable_mark_is_below_the_oldest_pending_record_of_any_shard() {
        let w = Watermark::new(3);
        assert_eq!(w.durable(), u64::MAX - 1);
        w.set_oldest(1, Some(10));
        w.set_oldest(2, Some(7));
        assert_eq!(w.durable(), 6);
        w.set_oldest(2, None);
        assert_eq!(w.durable(), 9);
        w.set_oldest(1, None);
        assert_eq!(w.durable(), u64::MAX - 1);
    }
}
