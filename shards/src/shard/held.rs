//! A publisher's values held behind a retained value of its own that the
//! cluster has not stored yet (DESIGN.md §7; see
//! [`crate::cluster::Retained::Held`]).
//!
//! In cluster mode a QoS 1/2 retained value reaches live subscribers only
//! once `mqtt-retained` has it, and never if the write is refused (the
//! client sends a refused PUBLISH again, MQTT 5 §3.4.2.1). What the same
//! client published after it waits behind it, so that subscribers get a
//! publisher's values in the order it sent them `[MQTT-4.6.0-5]`, while
//! the connection goes on reading: its later values, retained ones
//! included, are written to the bucket meanwhile (pipelined), and only
//! their delivery waits. A queue longer than [`HELD_MAX`] pauses the
//! connection's reading until it is shorter again (QoS 1/2 are bounded by
//! the Receive Maximum anyway; this bounds QoS 0).

use std::collections::{HashMap, VecDeque};
use std::rc::Rc;
use std::sync::Arc;
use std::time::Instant;

use fleetmq_core::session::Message;

use super::{Shard, State};
use super::ConnShared;

/// Values one publisher may have held before its connection stops
/// reading until the cluster answers. They go out at once when it does:
/// well under the 1,000 writes a QoS 0 subscriber may have pending
/// (`limits.max_client_writes_pending`'s default), so that the burst
/// alone does not make a subscriber of this one publisher drop any.
pub(crate) const HELD_MAX: usize = 256;

/// Bytes of held values one shard keeps, over all its publishers: past
/// it, every publisher with values held stops reading until the cluster
/// answers and they are fewer (a publisher with nothing held reads on:
/// its values go out at once). [`HELD_MAX`] bounds the count per
/// publisher; this bounds their size, up to `limits.max_packet_size`
/// each (a fresh-user pass took a replica to 2.4 GB with four
/// connections sending 1 MB retained values while NATS was down).
pub(crate) const HELD_BYTES_MAX: usize = 64 << 20;

/// What a held value counts against [`HELD_BYTES_MAX`]: its topic and
/// payload, and a little for the rest.
fn held_bytes(message: &Message) -> usize {
    message.topic.len() + message.payload.len() + 128
}

/// One held value.
struct Entry {
    message: Arc<Message>,
    /// The retained write it waits for (`Some`), or ready to go once
    /// everything before it went (`None`).
    waits_for: Option<u64>,
}

/// The values of one publisher (by its client key, `Message::origin`),
/// in the order it published them.
#[derive(Default)]
struct Queue {
    entries: VecDeque<Entry>,
    /// An MQTT 3.1.1 publisher: a refusal closes its connection and
    /// acknowledges nothing it sent after (the client sends those again),
    /// so none of them is delivered either.
    refusal_ends_all: bool,
    /// The connection paused because the queue was full: woken when it
    /// is not.
    paused: Option<Rc<ConnShared>>,
}

/// Every publisher's held values on one shard.
#[derive(Default)]
pub(super) struct Held {
    queues: HashMap<u64, Queue>,
    next_write: u64,
    /// What the held values count, [`held_bytes`].
    bytes: usize,
}

impl Held {
    /// A number for a retained write whose delivery waits (passed back to
    /// [`Shard::written`]).
    pub(super) fn next_write(&mut self) -> u64 {
        self.next_write += 1;
        self.next_write
    }

    /// Whether values of `origin` wait: a value of it must wait behind
    /// them.
    pub(super) fn holds(&self, origin: u64) -> bool {
        self.queues.contains_key(&origin)
    }

    /// Hold `message` of `origin` behind its earlier held values, waiting
    /// for the retained write `waits_for` too when it is one. `v5`: from
    /// an MQTT 5 connection (`None`: not from a connection, a will).
    pub(super) fn push(&mut self, origin: u64, message: Arc<Message>, waits_for: Option<u64>, v5: Option<bool>) {
        let queue = self.queues.entry(origin).or_default();
        if let Some(v5) = v5 {
            queue.refusal_ends_all = !v5;
        }
        self.bytes += held_bytes(&message);
        queue.entries.push_back(Entry { message, waits_for });
    }

    /// Whether publisher `origin` must stop reading: it has values held,
    /// and [`HELD_MAX`] of them or the shard [`HELD_BYTES_MAX`].
    fn full(&self, origin: u64) -> bool {
        self.queues
            .get(&origin)
            .is_some_and(|q| q.entries.len() >= HELD_MAX || self.bytes >= HELD_BYTES_MAX)
    }
}

impl Held {
    /// The retained write `write` of publisher `origin` ended: stored
    /// (its value is delivered in its turn) or refused (dropped, with all
    /// that came after it for an MQTT 3.1.1 publisher). Returns the
    /// values that no longer wait, in the publisher's order, and its
    /// paused connection when the queue is no longer full.
    fn resolve(&mut self, origin: u64, write: u64, stored: bool) -> (Vec<Arc<Message>>, Vec<Rc<ConnShared>>) {
        let was_over = self.bytes >= HELD_BYTES_MAX;
        let Some(queue) = self.queues.get_mut(&origin) else { return (Vec::new(), Vec::new()) };
        let mut gone = 0;
        if let Some(i) = queue.entries.iter().position(|e| e.waits_for == Some(write)) {
            if stored {
                queue.entries[i].waits_for = None;
            } else if queue.refusal_ends_all {
                gone += queue.entries.drain(i..).map(|e| held_bytes(&e.message)).sum::<usize>();
            } else {
                gone += queue.entries.remove(i).map_or(0, |e| held_bytes(&e.message));
            }
        }
        let mut ready = Vec::new();
        while queue.entries.front().is_some_and(|e| e.waits_for.is_none()) {
            if let Some(e) = queue.entries.pop_front() {
                gone += held_bytes(&e.message);
                ready.push(e.message);
            }
        }
        self.bytes -= gone;
        let over = self.bytes >= HELD_BYTES_MAX;
        let mut waiters = Vec::new();
        // An empty queue goes: its publisher reads on whatever the shard holds.
        if queue.entries.is_empty() || (queue.entries.len() < HELD_MAX && !over) {
            waiters.extend(queue.paused.take());
        }
        if queue.entries.is_empty() {
            self.queues.remove(&origin);
        }
        if was_over && !over {
            // The shard holds less than its bound again: every publisher
            // that paused on it (and not on its own count) reads on.
            for q in self.queues.values_mut().filter(|q| q.entries.len() < HELD_MAX) {
                waiters.extend(q.paused.take());
            }
        }
        (ready, waiters)
    }
}

impl Shard {
    /// The retained write `write` of publisher `origin` ended: stored
    /// (`stored`: delivered in its turn) or refused (dropped). Delivers
    /// the publisher's held values that no longer wait, in order, and
    /// wakes its connection if it paused on a full queue.
    pub(crate) fn written(&self, origin: u64, write: u64, stored: bool) {
        let mut guard = self.state.borrow_mut();
        let st = &mut *guard;
        let (ready, waiters) = st.held.resolve(origin, write, stored);
        let now = Instant::now();
        for message in ready {
            self.dispatch(st, message, now);
        }
        drop(guard);
        for conn in waiters {
            conn.wake();
        }
        self.try_flush();
    }

    /// Whether the connection `conn` of the client in `slot` must stop
    /// reading: its publisher has [`HELD_MAX`] values held, or some while
    /// the shard holds [`HELD_BYTES_MAX`]. It is woken when that is no
    /// longer so (then [`Shard::held_full`] says `false`).
    pub(crate) fn pause_publisher(&self, slot: u32, conn: &Rc<ConnShared>) -> Option<u64> {
        let mut st = self.state.borrow_mut();
        let st = &mut *st;
        if st.held.queues.is_empty() {
            return None;
        }
        let origin = st.clients.get(slot as usize)?.key;
        if !st.held.full(origin) {
            return None;
        }
        st.held.queues.get_mut(&origin)?.paused = Some(conn.clone());
        Some(origin)
    }

    /// Whether publisher `origin` must still not read
    /// ([`Shard::pause_publisher`]).
    pub(crate) fn held_full(&self, origin: u64) -> bool {
        self.state.borrow().held.full(origin)
    }
}

/// When a message's live subscribers may get it, as far as the retained
/// store is concerned (see [`Shard::keep_retained`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Delivery {
    /// In its publisher's order: now, unless values of the publisher are
    /// held.
    Now,
    /// Once the cluster stored its retained write with this number
    /// ([`Shard::written`]).
    After(u64),
    /// Never: the cluster refused it.
    Never,
}

/// Route `message` (its [`Delivery`] given), or hold it behind its
/// publisher's held values: what [`Shard::route`] does past the retained
/// store. `v5`: whether its publisher's connection speaks MQTT 5 (`None`:
/// not from a connection). Returns the shards it went to (none when
/// held).
pub(super) fn route_after(
    shard: &Shard,
    st: &mut State,
    message: Arc<Message>,
    delivery: Delivery,
    v5: Option<bool>,
    now: Instant,
) -> u64 {
    match delivery {
        Delivery::Never => 0,
        Delivery::After(write) => {
            st.held.push(message.origin, message, Some(write), v5);
            0
        }
        Delivery::Now if st.held.holds(message.origin) => {
            st.held.push(message.origin, message, None, v5);
            0
        }
        Delivery::Now => shard.dispatch(st, message, now),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use bytestring::ByteString;
    use fleetmq_core::packet::{Props, QoS};
    use proptest::prelude::*;

    use super::*;

    fn value(n: u32) -> Arc<Message> {
        Arc::new(Message {
            topic: ByteString::from(format!("t/{n}")),
            payload: bytes::Bytes::from(n.to_be_bytes().to_vec()),
            qos: QoS::AtLeastOnce,
            retain: true,
            properties: Props::default(),
            received_at: Instant::now(),
            origin: 7,
            stored: 0,
            from_mesh: false,
            groups: fleetmq_core::session::GroupPick::ALL,
        })
    }

    fn number(m: &Message) -> u32 {
        u32::from_be_bytes(m.payload[..4].try_into().unwrap())
    }

    #[test]
    fn a_publisher_with_values_held_stops_reading_past_the_shards_bytes_and_one_without_reads_on() {
        let mut held = Held::default();
        let big = |n: u32| {
            let mut m = (*value(n)).clone();
            m.payload = bytes::Bytes::from(vec![0u8; 1 << 20]);
            m.origin = u64::from(n % 2);
            Arc::new(m)
        };
        // Publisher 0 waits for one retained write, then holds 1 MiB values.
        let w = held.next_write();
        held.push(0, big(0), Some(w), Some(true));
        let mut n = 2;
        while !held.full(0) {
            held.push(0, big(n), None, Some(true));
            n += 2;
        }
        assert!(held.queues[&0].entries.len() < HELD_MAX, "stopped by the bytes, not the count");
        assert!(held.bytes >= HELD_BYTES_MAX && held.bytes < HELD_BYTES_MAX + (2 << 20));
        assert!(!held.full(1), "a publisher with nothing held reads on");
        let (ready, _) = held.resolve(0, w, true);
        assert_eq!(ready.len(), n as usize / 2);
        assert_eq!(held.bytes, 0);
        assert!(!held.full(0));
    }

    proptest! {
        /// Whatever order the cluster answers in, a publisher's values
        /// reach subscribers in the order it sent them [MQTT-4.6.0-5],
        /// none before an earlier one that waits, a refused retained value
        /// never, and for MQTT 3.1.1 nothing after a refused one (the
        /// connection closes; the client sends them again); every stored
        /// value goes out once all answers are in.
        #[test]
        fn held_values_go_out_in_publish_order_and_a_refusal_drops_what_it_must(
            values in proptest::collection::vec((any::<bool>(), any::<bool>()), 1..40),
            answers in proptest::collection::vec((any::<prop::sample::Index>(), any::<bool>()), 0..60),
            v5 in any::<bool>(),
        ) {
            let mut held = Held::default();
            // (value number, its write if it waits for one)
            let mut writes = Vec::new();
            let mut out = Vec::new();
            for (n, (waits, _)) in values.iter().enumerate() {
                let n = n as u32;
                if *waits {
                    let w = held.next_write();
                    writes.push((n, w));
                    held.push(7, value(n), Some(w), Some(v5));
                } else if held.holds(7) {
                    held.push(7, value(n), None, Some(v5));
                } else {
                    out.push(n);
                }
            }
            // The cluster answers each write once, in any order: the
            // answers drawn, then those not drawn yet.
            let mut answered = HashSet::new();
            let mut refused = HashSet::new();
            let mut order: Vec<(usize, bool)> = answers
                .iter()
                .filter(|_| !writes.is_empty())
                .map(|(i, stored)| (i.index(writes.len()), *stored))
                .collect();
            order.extend((0..writes.len()).map(|i| (i, values[writes[i].0 as usize].1)));
            for (i, stored) in order {
                let (n, w) = writes[i];
                if !answered.insert(w) {
                    continue;
                }
                if !stored {
                    refused.insert(n);
                }
                let (ready, _) = held.resolve(7, w, stored);
                for m in ready {
                    let k = number(&m);
                    // Nothing before it still waits.
                    for (m_n, m_w) in &writes {
                        if *m_n < k {
                            prop_assert!(answered.contains(m_w), "{} out before {} was answered", k, m_n);
                        }
                    }
                    out.push(k);
                }
            }
            prop_assert!(!held.holds(7), "values left held after every answer");
            prop_assert_eq!(held.bytes, 0, "held bytes not given back");
            let first_refused = refused.iter().min().copied();
            let expected: Vec<u32> = (0..values.len() as u32)
                .filter(|n| !refused.contains(n))
                .filter(|n| v5 || first_refused.is_none_or(|r| *n < r))
                .collect();
            prop_assert_eq!(out, expected);
        }
    }
}
