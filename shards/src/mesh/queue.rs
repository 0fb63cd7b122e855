//! The values of one mesh link ([`Queue`]): numbered from 1, kept from
//! the oldest the peer has not acknowledged, and encoded into Values
//! frames (DESIGN.md §3, §6 "mesh cut").

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use bytes::BytesMut;
use bytestring::ByteString;
use fleetmq_core::mesh::{self, ValueRef};
use fleetmq_core::session::Message;

/// What a value costs in a buffer beyond its topic and payload.
pub(super) const VALUE_COST: usize = 64;

/// The shared subscription groups a value was sent to a peer for.
pub(super) type Groups = Option<Arc<[ByteString]>>;

/// One numbered value of a link.
struct Kept {
    /// The value; `None` once it is for no one there (its groups went to
    /// another member and the peer has no plain subscription for it): not
    /// sent, the receiver skips its number as a gap.
    message: Option<Arc<Message>>,
    /// The shared groups the peer was picked for.
    groups: Groups,
    /// Whether the peer has a plain subscription it goes to.
    plain: bool,
}

/// The values of one link: numbered from 1, kept from the oldest not
/// acknowledged on.
pub(crate) struct Queue {
    /// Each value (or gap), numbered from `front` on.
    values: VecDeque<Kept>,
    /// The sequence number of `values[0]` (the next one's when empty).
    pub(super) front: u64,
    /// The highest sequence number written on the current connection.
    pub(super) sent: u64,
    /// What the kept values cost.
    pub(super) bytes: usize,
    /// The most `bytes` may reach before the oldest are dropped
    /// (`cluster.mesh_buffer` split over the shards).
    limit: usize,
}

impl Queue {
    /// An empty queue that keeps values up to `limit` bytes (their
    /// topic, payload and [`VALUE_COST`] each).
    pub(super) fn new(limit: usize) -> Queue {
        Queue { values: VecDeque::new(), front: 1, sent: 0, bytes: 0, limit }
    }

    fn cost(m: &Message) -> usize {
        m.topic.len() + m.payload.len() + VALUE_COST
    }

    /// Keep `m`, for the peer's plain subscriptions (`plain`) and the
    /// shared `groups` it was picked for; returns how many of the oldest
    /// were dropped to make room.
    pub(super) fn push(&mut self, m: Arc<Message>, groups: Groups, plain: bool) -> u64 {
        self.bytes += Self::cost(&m);
        self.values.push_back(Kept { message: Some(m), groups, plain });
        let mut dropped = 0;
        while self.bytes > self.limit && self.values.len() > 1 {
            dropped += u64::from(self.pop_front());
        }
        dropped
    }

    /// Drop the oldest; whether it was a value (not a gap).
    fn pop_front(&mut self) -> bool {
        let Some(kept) = self.values.pop_front() else { return false };
        self.front += 1;
        // A value dropped before it was sent leaves a gap the
        // receiver skips.
        self.sent = self.sent.max(self.front - 1);
        let Some(m) = kept.message else { return false };
        self.bytes -= Self::cost(&m);
        true
    }

    /// Drop the gaps at the front: nothing before them waits.
    fn trim(&mut self) {
        while self.values.front().is_some_and(|k| k.message.is_none()) {
            self.pop_front();
        }
    }

    /// The receiver delivered every value up to `delivered`.
    pub(super) fn acked(&mut self, delivered: u64) {
        while self.front <= delivered && !self.values.is_empty() {
            self.pop_front();
        }
        self.trim();
    }

    /// A new connection, whose receiver delivered up to `delivered`: send
    /// from the one after it (or the oldest kept).
    pub(super) fn restart(&mut self, delivered: u64) {
        self.acked(delivered);
        self.sent = delivered.max(self.front - 1);
    }

    /// The values kept that the peer was picked for some shared group
    /// for, each with its sequence number and those groups.
    pub(super) fn group_picks(&self) -> Vec<(u64, Arc<Message>, Arc<[ByteString]>)> {
        let kept = self.values.iter().zip(self.front..);
        kept.filter_map(|(k, seq)| Some((seq, k.message.clone()?, k.groups.clone()?))).collect()
    }

    /// The value numbered `seq` now goes to the groups `left` of those it
    /// was picked for (the others went to another member): with none left
    /// and no plain subscription it is for no one there and becomes a gap.
    pub(super) fn keep_groups(&mut self, seq: u64, left: Vec<ByteString>) {
        let Some(kept) = seq.checked_sub(self.front).and_then(|at| self.values.get_mut(at as usize)) else { return };
        kept.groups = (!left.is_empty()).then(|| left.into());
        if kept.groups.is_none() && !kept.plain {
            if let Some(m) = kept.message.take() {
                self.bytes -= Self::cost(&m);
            }
        }
        self.trim();
    }

    /// The values kept (gaps left out).
    pub(super) fn len(&self) -> usize {
        self.values.iter().filter(|k| k.message.is_some()).count()
    }

    /// The next Values frame: the kept values not sent on this connection
    /// yet, as many as fit in `max_frame` up to the next gap; `None` when
    /// all were sent.
    pub(super) fn next_frame(&mut self, max_frame: usize, version: u16, now: Instant, out: &mut BytesMut) -> Option<usize> {
        let mut skip = (self.sent + 1 - self.front) as usize;
        // A gap is not sent: the frame after it starts past it.
        while self.values.get(skip).is_some_and(|k| k.message.is_none()) {
            skip += 1;
        }
        if skip >= self.values.len() {
            return None;
        }
        let first = self.front + skip as u64;
        let mut size = mesh::HEADER_BYTES + 12;
        let mut n = 0;
        for kept in self.values.iter().skip(skip) {
            let Some(m) = &kept.message else { break };
            let bound = value_ref(m, &kept.groups, kept.plain, now).encoded_len_bound();
            if n > 0 && size + bound > max_frame {
                break;
            }
            size += bound;
            n += 1;
        }
        // The `n` counted above stop before the first gap.
        let values = self.values.iter().skip(skip).take(n).map(|k| {
            let m = k.message.as_ref().expect("no gap among the values counted");
            value_ref(m, &k.groups, k.plain, now)
        });
        mesh::encode_values(first, version, values, out);
        self.sent = first + n as u64 - 1;
        Some(n)
    }
}

/// `m` as the mesh sends it, for `groups` and for the peer's plain
/// subscriptions too when `plain` (else for the groups only).
fn value_ref<'a>(m: &'a Message, groups: &'a Option<Arc<[ByteString]>>, plain: bool, now: Instant) -> ValueRef<'a> {
    ValueRef {
        topic: &m.topic,
        payload: &m.payload,
        qos: m.qos,
        retain: m.retain,
        properties: &m.properties,
        expiry_left: m.expiry_left(now),
        origin: m.origin,
        groups: groups.as_deref().unwrap_or(&[]),
        logged: m.stored == crate::shard::LOGGED,
        groups_only: !plain,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fleetmq_core::mesh::Frame;

    fn message(n: usize) -> Arc<Message> {
        Arc::new(Message {
            topic: "t".into(),
            payload: vec![0; n].into(),
            qos: fleetmq_core::packet::QoS::AtMostOnce,
            retain: false,
            properties: Default::default(),
            received_at: Instant::now(),
            origin: 1,
            stored: 0,
            from_mesh: false,
            groups: fleetmq_core::session::GroupPick::ALL,
        })
    }

    fn firsts(q: &mut Queue) -> Vec<(u64, usize)> {
        let mut out = BytesMut::new();
        let mut got = Vec::new();
        while q.next_frame(1 << 20, 2, Instant::now(), &mut out).is_some() {
            let Some(Frame::Values { first, values }) = mesh::decode(&mut out, 1 << 20).unwrap() else { panic!() };
            got.push((first, values.len()));
        }
        got
    }

    #[test]
    fn a_reconnect_sends_from_what_the_receiver_delivered() {
        let mut q = Queue::new(1 << 20);
        (0..5).for_each(|_| {
            q.push(message(10), None, true);
        });
        assert_eq!(firsts(&mut q), [(1, 5)]);
        q.acked(2);
        q.restart(3);
        assert_eq!(firsts(&mut q), [(4, 2)], "4 and 5 again, not 1..3");
        q.restart(5);
        assert!(firsts(&mut q).is_empty() && q.values.is_empty() && q.bytes == 0);
    }

    #[test]
    fn a_full_buffer_drops_the_oldest_and_the_receiver_sees_a_gap() {
        let mut q = Queue::new(3 * (1 + 100 + VALUE_COST));
        assert_eq!((0..5).map(|_| q.push(message(100), None, true)).sum::<u64>(), 2);
        assert_eq!(q.front, 3);
        q.restart(0);
        assert_eq!(firsts(&mut q), [(3, 3)]);
    }

    fn group(name: &str) -> Groups {
        Some(Arc::from([ByteString::from(name)]))
    }

    #[test]
    fn a_value_whose_group_went_to_another_member_is_a_gap_the_frames_skip() {
        let mut q = Queue::new(1 << 20);
        q.push(message(10), None, true);
        q.push(message(10), group("g"), false);
        q.push(message(10), group("g"), true);
        q.push(message(10), None, true);
        q.push(message(10), group("g"), false);
        let picks: Vec<u64> = q.group_picks().iter().map(|(seq, _, _)| *seq).collect();
        assert_eq!(picks, [2, 3, 5]);
        let bytes = q.bytes;
        for seq in picks {
            q.keep_groups(seq, Vec::new());
        }
        assert_eq!(q.bytes, bytes - 2 * (1 + 10 + VALUE_COST), "the two for the group only no longer count");
        assert_eq!(q.len(), 3);
        assert!(q.group_picks().is_empty(), "the third stays, for its plain subscription only");
        // 1 alone, then 3 and 4: the receiver skips 2 and 5.
        assert_eq!(firsts(&mut q), [(1, 1), (3, 2)]);
        q.acked(4);
        assert!(q.values.is_empty() && q.bytes == 0, "the gap at the end goes with the ack before it");
        q.push(message(10), None, true);
        assert_eq!(firsts(&mut q), [(6, 1)]);
    }

    #[test]
    fn a_gap_at_the_front_is_dropped_at_once() {
        let mut q = Queue::new(1 << 20);
        q.push(message(10), group("g"), false);
        q.push(message(10), None, true);
        q.keep_groups(1, Vec::new());
        assert_eq!((q.front, q.values.len()), (2, 1));
        q.restart(0);
        assert_eq!(firsts(&mut q), [(2, 1)]);
    }

    #[test]
    fn a_frame_holds_what_fits() {
        let mut q = Queue::new(1 << 30);
        (0..3).for_each(|_| {
            q.push(message(400_000), None, true);
        });
        let mut out = BytesMut::new();
        assert_eq!(q.next_frame(mesh::max_frame(1 << 20) - (1 << 16) + 1000, 2, Instant::now(), &mut out), Some(2));
    }
}
