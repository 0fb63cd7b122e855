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

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

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

/// How long a cleared retained topic remembers the sequence number of its
/// clear, so that an older set arriving late cannot resurrect it. Changes
/// are pushed to all inboxes back to back, so reordering spans
/// microseconds; a second is ample.
const TOMBSTONE_LIFETIME: Duration = Duration::from_secs(1);

/// A shard's copy of the retained messages. Concurrent changes to one topic
/// from different shards converge everywhere to the one with the highest
/// process-wide sequence number (last writer wins).
#[derive(Default)]
pub(crate) struct Retained {
    messages: HashMap<ByteString, (u64, Arc<Message>)>,
    cleared: HashMap<ByteString, (u64, Instant)>,
}

impl Retained {
    /// Apply change `seq` for `message.topic` unless a newer one is known.
    /// An empty payload clears the topic `[MQTT-3.3.1-6]`.
    pub(crate) fn apply(&mut self, seq: u64, message: Arc<Message>, now: Instant) {
        let newest = self
            .messages
            .get(&message.topic)
            .map(|(s, _)| *s)
            .max(self.cleared.get(&message.topic).map(|(s, _)| *s));
        if newest.is_some_and(|n| n > seq) {
            return;
        }
        if message.payload.is_empty() {
            self.messages.remove(&message.topic);
            self.cleared.insert(message.topic.clone(), (seq, now));
        } else {
            self.cleared.remove(&message.topic);
            self.messages.insert(message.topic.clone(), (seq, message));
        }
    }

    /// Forget clears older than [`TOMBSTONE_LIFETIME`].
    pub(crate) fn prune(&mut self, now: Instant) {
        self.cleared.retain(|_, (_, at)| now.duration_since(*at) < TOMBSTONE_LIFETIME);
    }

    /// Retained messages whose topic `keep` accepts.
    pub(crate) fn matching(&self, mut keep: impl FnMut(&str) -> bool) -> Vec<Arc<Message>> {
        self.messages.values().filter(|(_, m)| keep(&m.topic)).map(|(_, m)| m.clone()).collect()
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use fleetmq_core::packet::{Properties, QoS};

    use super::*;

    fn retained(topic: &str, payload: &'static [u8]) -> Arc<Message> {
        Arc::new(Message {
            topic: topic.into(),
            payload: Bytes::from_static(payload),
            qos: QoS::AtMostOnce,
            retain: true,
            properties: Properties::default().into(),
            received_at: Instant::now(),
            origin: 0,
            stored: 0,
        })
    }

    fn payloads(r: &Retained) -> Vec<String> {
        let mut v: Vec<String> =
            r.matching(|_| true).iter().map(|m| String::from_utf8_lossy(&m.payload).into_owned()).collect();
        v.sort();
        v
    }

    #[test]
    fn shards_that_see_two_sets_in_different_orders_keep_the_same_one() {
        let now = Instant::now();
        let (mut x, mut y) = (Retained::default(), Retained::default());
        x.apply(1, retained("t", b"a"), now);
        x.apply(2, retained("t", b"b"), now);
        y.apply(2, retained("t", b"b"), now);
        y.apply(1, retained("t", b"a"), now);
        assert_eq!(payloads(&x), vec!["b"]);
        assert_eq!(payloads(&y), vec!["b"]);
    }

    #[test]
    fn a_late_older_set_does_not_undo_a_clear() {
        let now = Instant::now();
        let mut r = Retained::default();
        r.apply(5, retained("t", b""), now);
        r.apply(4, retained("t", b"old"), now);
        assert!(payloads(&r).is_empty());
        r.prune(now + Duration::from_secs(2));
        r.apply(6, retained("t", b"new"), now);
        assert_eq!(payloads(&r), vec!["new"]);
    }

    #[test]
    fn inbox_counts_what_was_pushed() {
        let inbox = Inbox::new();
        inbox.push(Control::Route { filter: "a".into(), shard: 1, add: true });
        assert_eq!(inbox.pushed(), 1);
        assert!(matches!(inbox.pop(), Some(Control::Route { add: true, .. })));
        assert!(inbox.pop().is_none());
    }
}
