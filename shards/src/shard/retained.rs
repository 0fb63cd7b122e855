//! Retained messages: the shard's copy of them ([`Retained`]), and their
//! delivery to a new subscription, paced ([`Feeds`]).
//!
//! A SUBSCRIBE may match more retained messages than a subscriber's queue
//! holds (80,000 for a `#` subscriber, issue 27). They are not copied into
//! its queue: the subscription gets a [`Feed`], a cursor into the store
//! (the topic it reached), and its connection's task asks for the next
//! batch when its socket has drained ([`Shard::feed_retained`]): QoS 0
//! messages go out as fast as the client reads, QoS 1 and 2 ones as its
//! Receive Maximum window opens. Live messages keep their own queue and
//! bounds meanwhile, and a batch is small, so neither other clients nor
//! the shard wait for a feed.
//!
//! Order: each retained message is read from the store when its turn
//! comes, so a feed never sends a value older than one the subscriber
//! already got live on that topic; it may send the current value again,
//! with RETAIN=1 `[MQTT-3.3.1-9]`.
//!
//! The store is behind the narrow interface a cluster-wide store can take
//! over (`apply`, `prune`, `scan`): topics in order, read in pages from a
//! cursor, so a SUBSCRIBE reads only the topics under its filter's literal
//! prefix.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ops::Bound;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytestring::ByteString;
use fleetmq_core::packet::QoS;
use fleetmq_core::session::{Delivery, Message, Subscription};
use fleetmq_core::topic::matches;

use super::{ConnShared, Shard, Slot, State};

/// How long a cleared retained topic remembers the sequence number of its
/// clear, so that an older set arriving late cannot resurrect it. Changes
/// are pushed to all inboxes back to back, so reordering spans
/// microseconds; a second is ample.
const TOMBSTONE_LIFETIME: Duration = Duration::from_secs(1);

/// A shard's copy of the retained messages, in topic order. Concurrent
/// changes to one topic from different shards converge everywhere to the
/// one with the highest process-wide sequence number (last writer wins).
#[derive(Default)]
pub(crate) struct Retained {
    messages: BTreeMap<ByteString, (u64, Arc<Message>)>,
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

    /// The retained message of `topic`, if any.
    pub(crate) fn get(&self, topic: &str) -> Option<Arc<Message>> {
        self.messages.get(topic).map(|(_, message)| message.clone())
    }

    /// Forget clears older than [`TOMBSTONE_LIFETIME`].
    pub(crate) fn prune(&mut self, now: Instant) {
        self.cleared
            .retain(|_, (_, at)| now.duration_since(*at) < TOMBSTONE_LIFETIME);
    }

    /// Append to `out`, in topic order, at most `max` retained messages
    /// that `filter` matches and whose topic sorts after `after` (all of
    /// them when `None`). Returns true when no more are left after those.
    pub(crate) fn scan(
        &self,
        filter: &str,
        after: Option<&str>,
        max: usize,
        out: &mut Vec<Arc<Message>>,
    ) -> bool {
        let prefix = literal_prefix(filter);
        let start = match after {
            Some(after) if after >= prefix => Bound::Excluded(after),
            _ => Bound::Included(prefix),
        };
        let mut taken = 0;
        for (topic, (_, message)) in self.messages.range::<str, _>((start, Bound::Unbounded)) {
            if !topic.starts_with(prefix) {
                break;
            }
            if !matches(filter, topic) {
                continue;
            }
            if taken == max {
                return false;
            }
            out.push(message.clone());
            taken += 1;
        }
        true
    }
}

/// The part of `filter` before its first wildcard level, without the
/// separator before it: every topic it matches starts with this (`a/#`
/// matches `a` itself, MQTT 5 §4.7.1.2).
fn literal_prefix(filter: &str) -> &str {
    let end = filter.find(['+', '#']).unwrap_or(filter.len());
    filter[..end].strip_suffix('/').unwrap_or(&filter[..end])
}

/// Where a connection stands with the retained messages its
/// subscriptions still have to receive (see [`Shard::feed_retained`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Feeding {
    /// Nothing to send.
    Idle,
    /// More to send as soon as the socket has drained.
    Ready,
    /// More to send, once the client acknowledges a QoS 1 or 2 message.
    Blocked,
}

/// Retained messages a subscription still has to receive.
pub(crate) struct Feed {
    filter: ByteString,
    subscription: Subscription,
    /// The scan resumes after this topic.
    after: Option<ByteString>,
}

/// Each session's feeds, oldest subscription first. A feed lives with
/// its session: a persistent session that reconnects gets the rest.
#[derive(Default)]
pub(crate) struct Feeds(HashMap<Slot, VecDeque<Feed>>);

impl Feeds {
    /// The session on `slot` ended: its feeds go.
    pub(crate) fn remove(&mut self, slot: Slot) {
        self.0.remove(&slot);
    }
}

/// At most this many retained messages per batch.
const FEED_MESSAGES: usize = 256;

/// A batch stops once this many bytes wait for the socket.
const FEED_BYTES: usize = 64 << 10;

impl Shard {
    /// Send the retained messages that `filter` matches to the session on
    /// `slot`, paced (see the module docs).
    pub(super) fn start_feed(
        &self,
        st: &mut State,
        slot: Slot,
        filter: ByteString,
        subscription: Subscription,
    ) {
        let feed = Feed {
            filter,
            subscription,
            after: None,
        };
        st.feeds.0.entry(slot).or_default().push_back(feed);
        if let Some(conn) = &st.clients[slot as usize].conn {
            conn.feeding.set(Feeding::Ready);
            conn.wake();
        }
    }

    /// A connection attached to the session on `slot`: a resumed session
    /// goes on with its feeds, a new one has none.
    pub(super) fn attach_feeds(
        &self,
        st: &mut State,
        slot: Slot,
        conn: &ConnShared,
        resumed: bool,
    ) {
        if !resumed {
            st.feeds.remove(slot);
        } else if st.feeds.0.contains_key(&slot) {
            conn.feeding.set(Feeding::Ready);
        }
    }

    /// Send the next batch of retained messages to the session on `slot`,
    /// whose connection `conn` has drained its socket: at most
    /// [`FEED_MESSAGES`], until [`FEED_BYTES`] wait to be written, and QoS
    /// 1 and 2 ones only while its Receive Maximum has room. Sets
    /// `conn.feeding` to what comes next.
    pub(crate) fn feed_retained(&self, slot: Slot, conn: &ConnShared, now: Instant) {
        let mut guard = self.state.borrow_mut();
        let st = &mut *guard;
        self.catch_up(st);
        let mut budget = FEED_MESSAGES;
        let mut batch = Vec::new();
        let next = loop {
            let attached = st.clients.get(slot as usize).and_then(|c| c.conn.as_ref());
            if attached.is_none_or(|c| c.key != conn.key) {
                break Feeding::Idle;
            }
            let Some(mut feed) = st.feeds.0.get_mut(&slot).and_then(VecDeque::pop_front) else {
                st.feeds.remove(slot);
                break Feeding::Idle;
            };
            if !st.clients[slot as usize].session.subscriptions().contains_key(&feed.filter) {
                // Unsubscribed: nothing more for it `[MQTT-3.10.4-2]`.
                continue;
            }
            batch.clear();
            let done = st
                .retained
                .scan(&feed.filter, feed.after.as_deref(), budget, &mut batch);
            let mut stopped = None;
            for message in &batch {
                let qos = message.qos.min(feed.subscription.options.qos);
                if conn.out.borrow().len() >= FEED_BYTES {
                    stopped = Some(Feeding::Ready);
                } else if qos != QoS::AtMostOnce
                    && !st.clients[slot as usize].session.may_send_now()
                {
                    stopped = Some(Feeding::Blocked);
                }
                if stopped.is_some() {
                    break;
                }
                feed.after = Some(message.topic.clone());
                let delivery = Delivery {
                    message: message.clone(),
                    qos,
                    // Sent for a subscribe: RETAIN=1 `[MQTT-3.3.1-9]`.
                    retain: true,
                    subscription_ids: feed.subscription.identifier.into_iter().collect(),
                    group: None,
                };
                let mut outputs = std::mem::take(&mut st.outputs);
                st.clients[slot as usize]
                    .session
                    .deliver(delivery, now, &mut outputs);
                self.write_deliveries(st, slot, &mut outputs, now, false);
                st.outputs = outputs;
                budget -= 1;
            }
            if stopped.is_some() || !done {
                st.feeds.0.entry(slot).or_default().push_front(feed);
            }
            if let Some(stopped) = stopped {
                break stopped;
            }
            if budget == 0 {
                break Feeding::Ready;
            }
        };
        conn.feeding.set(next);
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use fleetmq_core::packet::Properties;
    use proptest::prelude::*;

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
            from_mesh: false,
            groups: fleetmq_core::session::GroupPick::ALL,
        })
    }

    fn payloads(r: &Retained) -> Vec<String> {
        let mut out = Vec::new();
        r.scan("#", None, usize::MAX, &mut out);
        let mut v: Vec<String> = out
            .iter()
            .map(|m| String::from_utf8_lossy(&m.payload).into_owned())
            .collect();
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
    fn literal_prefixes_stop_at_the_first_wildcard_level() {
        assert_eq!(literal_prefix("a/b/#"), "a/b");
        assert_eq!(literal_prefix("a/+/c"), "a");
        assert_eq!(literal_prefix("#"), "");
        assert_eq!(literal_prefix("+/x"), "");
        assert_eq!(literal_prefix("a/b"), "a/b");
    }

    /// Topics from a small alphabet, so that filters match some.
    fn topic() -> impl Strategy<Value = String> {
        let level = proptest::sample::select(vec!["a", "b", "ab", "", "$s"]);
        proptest::collection::vec(level, 1..4).prop_map(|l| l.join("/"))
    }

    fn filter() -> impl Strategy<Value = String> {
        let level = proptest::sample::select(vec!["a", "b", "ab", "", "+", "$s"]);
        (proptest::collection::vec(level, 0..3), any::<bool>()).prop_map(|(mut levels, hash)| {
            if hash || levels.is_empty() {
                levels.push("#");
            }
            levels.join("/")
        })
    }

    proptest! {
        /// Read in pages of any size from the cursor, a scan yields exactly
        /// the retained messages the filter matches, each once, in topic
        /// order, however the store changes between pages (`[MQTT-4.7.1]`
        /// matching, `[MQTT-4.7.2-1]` for `$` topics).
        #[test]
        fn paged_scans_yield_what_the_filter_matches(
            topics in proptest::collection::btree_set(topic(), 0..40),
            later in proptest::collection::vec(topic(), 0..10),
            filter in filter(),
            page in 1usize..7,
        ) {
            let now = Instant::now();
            let mut r = Retained::default();
            for (seq, t) in topics.iter().enumerate() {
                r.apply(seq as u64, retained(t, b"v"), now);
            }
            let mut seen: Vec<String> = Vec::new();
            let mut after: Option<String> = None;
            let mut added = Vec::new();
            loop {
                let mut out = Vec::new();
                let done = r.scan(&filter, after.as_deref(), page, &mut out);
                prop_assert!(out.len() <= page);
                seen.extend(out.iter().map(|m| m.topic.to_string()));
                if let Some(last) = out.last() {
                    after = Some(last.topic.to_string());
                }
                // A topic set between pages, ahead of the cursor, is seen too.
                if let Some(t) = later.get(added.len()) {
                    r.apply(1000 + added.len() as u64, retained(t, b"w"), now);
                    added.push(t.clone());
                }
                if done {
                    break;
                }
            }
            let mut sorted = seen.clone();
            sorted.sort();
            sorted.dedup();
            prop_assert_eq!(&sorted, &seen, "in order, each once");
            for t in &topics {
                prop_assert_eq!(seen.contains(t), matches(&filter, t), "{} against {}", t, filter);
            }
            for t in &added {
                prop_assert!(!seen.contains(t) || matches(&filter, t), "{} does not match {}", t, filter);
            }
        }
    }
}
