//! Node-wide state every shard keeps a copy of — the route table and the
//! retained messages — and the lock-free inboxes that keep the copies
//! current (DESIGN.md §3).
//!
//! A change is pushed into every other shard's inbox (a crossbeam channel
//! plus a counter) *before* the client that caused it is answered. A shard
//! checks its counter (one atomic load) before routing a publish or reading
//! retained messages for a subscribe, and applies what is waiting first. So
//! once a SUBACK or PUBACK has left, every shard's next publish or subscribe
//! sees the change: no window where a new subscription or a retained message
//! is unknown to another shard, and no lock on the publish path.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytestring::ByteString;
use crossbeam_channel::{Receiver, Sender};
use fleetmq_core::session::Message;

/// A change to node-wide state.
#[derive(Clone)]
pub(crate) enum Control {
    /// Shard `shard` gained (`add`) or lost its last subscriber on `filter`.
    Route { filter: ByteString, shard: usize, add: bool },
    /// A retained message was set, or cleared (empty payload), as the
    /// `seq`-th retained change of the process.
    Retain { seq: u64, message: Arc<Message> },
    /// A change to a shared subscription group that the receiving shard
    /// owns, from shard `from`.
    Group { from: usize, op: super::GroupOp },
    /// A shared subscription `key` (`$share/<group>/<filter>`) gained
    /// (`add`) its first member on this replica, or lost its last.
    Shared { key: ByteString, add: bool },
}

/// One shard's inbox of [`Control`] changes from the other shards.
pub(crate) struct Inbox {
    tx: Sender<Control>,
    rx: Receiver<Control>,
    pushed: AtomicU64,
}

impl Inbox {
    pub(crate) fn new() -> Inbox {
        let (tx, rx) = crossbeam_channel::unbounded();
        Inbox { tx, rx, pushed: AtomicU64::new(0) }
    }

    /// Queue a change (any thread).
    pub(crate) fn push(&self, change: Control) {
        // The receiver lives as long as the inbox, so send cannot fail.
        let _ = self.tx.send(change);
        self.pushed.fetch_add(1, Ordering::Release);
    }

    /// Changes pushed so far (the owner compares with what it applied).
    pub(crate) fn pushed(&self) -> u64 {
        self.pushed.load(Ordering::Acquire)
    }

    /// The next waiting change, if any (owner shard only).
    pub(crate) fn pop(&self) -> Option<Control> {
        self.rx.try_recv().ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inbox_counts_what_was_pushed() {
        let inbox = Inbox::new();
        inbox.push(Control::Route { filter: "a".into(), shard: 1, add: true });
        assert_eq!(inbox.pushed(), 1);
        assert!(matches!(inbox.pop(), Some(Control::Route { add: true, .. })));
        assert!(inbox.pop().is_none());
    }
}
