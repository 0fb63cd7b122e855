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

/// The values of one link: numbered from 1, kept from the oldest not
/// acknowledged on.
pub(crate) struct Queue {
    /// Each value, and the shared groups the peer was picked for.
    values: VecDeque<(Arc<Message>, Groups)>,
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

    /// Keep `m`; returns how many of the oldest were dropped to make room.
    pub(super) fn push(&mut self, m: Arc<Message>, groups: Option<Arc<[ByteString]>>) -> u64 {
        self.bytes += Self::cost(&m);
        self.values.push_back((m, groups));
        let mut dropped = 0;
        while self.bytes > self.limit && self.values.len() > 1 {
            self.pop_front();
            dropped += 1;
        }
        dropped
    }

    fn pop_front(&mut self) {
        if let Some((m, _)) = self.values.pop_front() {
            self.bytes -= Self::cost(&m);
            self.front += 1;
            // A value dropped before it was sent leaves a gap the
            // receiver skips.
            self.sent = self.sent.max(self.front - 1);
        }
    }

    /// The receiver delivered every value up to `delivered`.
    pub(super) fn acked(&mut self, delivered: u64) {
        while self.front <= delivered && !self.values.is_empty() {
            self.pop_front();
        }
    }

    /// A new connection, whose receiver delivered up to `delivered`: send
    /// from the one after it (or the oldest kept).
    pub(super) fn restart(&mut self, delivered: u64) {
        self.acked(delivered);
        self.sent = delivered.max(self.front - 1);
    }

    /// The next Values frame: the kept values not sent on this connection
    /// yet, as many as fit in `max_frame`; `None` when all were sent.
    pub(super) fn next_frame(&mut self, max_frame: usize, version: u16, now: Instant, out: &mut BytesMut) -> Option<usize> {
        let first = self.sent + 1;
        let skip = (first - self.front) as usize;
        if skip >= self.values.len() {
            return None;
        }
        let mut size = mesh::HEADER_BYTES + 12;
        let mut n = 0;
        for (m, groups) in self.values.iter().skip(skip) {
            let bound = value_ref(m, groups, now).encoded_len_bound();
            if n > 0 && size + bound > max_frame {
                break;
            }
            size += bound;
            n += 1;
        }
        let values = self.values.iter().skip(skip).take(n).map(|(m, groups)| value_ref(m, groups, now));
        mesh::encode_values(first, version, values, out);
        self.sent = first + n as u64 - 1;
        Some(n)
    }
}

fn value_ref<'a>(m: &'a Message, groups: &'a Option<Arc<[ByteString]>>, now: Instant) -> ValueRef<'a> {
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
            q.push(message(10), None);
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
        assert_eq!((0..5).map(|_| q.push(message(100), None)).sum::<u64>(), 2);
        assert_eq!(q.front, 3);
        q.restart(0);
        assert_eq!(firsts(&mut q), [(3, 3)]);
    }

    #[test]
    fn a_frame_holds_what_fits() {
        let mut q = Queue::new(1 << 30);
        (0..3).for_each(|_| {
            q.push(message(400_000), None);
        });
        let mut out = BytesMut::new();
        assert_eq!(q.next_frame(mesh::max_frame(1 << 20) - (1 << 16) + 1000, 2, Instant::now(), &mut out), Some(2));
    }
}
