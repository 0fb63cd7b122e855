//! A checked-flow publisher's unacknowledged QoS 1/2 publishes, kept across
//! its connections so that they can be sent again after a reconnect, as
//! MQTT asks of a client that keeps its session: PUBLISH with DUP set and
//! its original packet identifier, or PUBREL once its PUBREC came, in the
//! order they were first sent `[MQTT-4.4.0-1]` `[MQTT-3.3.1-1]`
//! `[MQTT-4.6.0-1]`.
//!
//! Also: which sequence numbers the broker acknowledged (PUBACK at QoS 1,
//! PUBREC at QoS 2: the point where the broker has the value), so the
//! checker can count acknowledged values that never arrived.

use std::collections::{BTreeMap, BTreeSet};
use std::num::NonZeroU16;

use bytes::BytesMut;
use fleetmq_core::packet::{Packet, ProtocolVersion, PubResponse};

use crate::client::PublishTemplate;

/// The DUP flag in a PUBLISH's first byte `[MQTT-3.3.1-1]`.
const DUP: u8 = 0x08;

/// One publish sent and not yet completed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Outstanding {
    /// Its sequence number (per publisher).
    k: u64,
    /// The time stamp its payload carries, ns.
    stamp: u64,
    /// QoS 2: its PUBREC came and PUBREL was sent.
    released: bool,
}

/// What an acknowledgement did to the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Acked {
    /// An identifier not in flight (a late or repeated answer): nothing.
    Unknown,
    /// The broker has the value with sequence number `k` now (PUBACK, or
    /// the first PUBREC); `completed` when the flow ended (PUBACK).
    Value {
        /// The value's sequence number.
        k: u64,
        /// True when its flow ended too (PUBACK).
        completed: bool,
    },
    /// A PUBREC for a value already acknowledged: PUBREL again.
    Again,
    /// The QoS 2 flow ended (PUBCOMP).
    Completed,
}

/// Unacknowledged publishes by packet identifier.
#[derive(Debug, Default)]
pub struct InflightTable {
    by_id: BTreeMap<u16, Outstanding>,
    next_id: u16,
}

impl InflightTable {
    /// Publishes in flight (sent, flow not completed).
    pub fn len(&self) -> u64 {
        self.by_id.len() as u64
    }

    /// True when nothing is in flight.
    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    /// A packet identifier not in flight, for message `k` stamped `stamp`,
    /// now in flight. At most 65,535 can be in flight; the caller bounds
    /// it far below (Receive Maximum).
    pub fn send(&mut self, k: u64, stamp: u64) -> NonZeroU16 {
        loop {
            self.next_id = self.next_id.checked_add(1).unwrap_or(1);
            if !self.by_id.contains_key(&self.next_id) {
                break;
            }
        }
        let o = Outstanding {
            k,
            stamp,
            released: false,
        };
        self.by_id.insert(self.next_id, o);
        NonZeroU16::new(self.next_id).unwrap_or(NonZeroU16::MIN)
    }

    /// A PUBACK for `id`.
    pub fn puback(&mut self, id: u16) -> Acked {
        match self.by_id.remove(&id) {
            Some(o) => Acked::Value {
                k: o.k,
                completed: true,
            },
            None => Acked::Unknown,
        }
    }

    /// A PUBREC for `id`: the caller answers PUBREL unless it is unknown.
    pub fn pubrec(&mut self, id: u16) -> Acked {
        match self.by_id.get_mut(&id) {
            Some(o) if o.released => Acked::Again,
            Some(o) => {
                o.released = true;
                Acked::Value {
                    k: o.k,
                    completed: false,
                }
            }
            None => Acked::Unknown,
        }
    }

    /// A PUBCOMP for `id`.
    pub fn pubcomp(&mut self, id: u16) -> Acked {
        match self.by_id.remove(&id) {
            Some(_) => Acked::Completed,
            None => Acked::Unknown,
        }
    }

    /// Everything in flight encoded into `out` as a resend, in the order
    /// first sent: PUBLISH with DUP and its identifier (from `template`),
    /// or PUBREL for those whose PUBREC came. Returns how many.
    pub fn resend(
        &self,
        template: &PublishTemplate,
        version: ProtocolVersion,
        seq_base: u64,
        out: &mut BytesMut,
    ) -> u64 {
        let mut order: Vec<(u16, Outstanding)> = self.by_id.iter().map(|(i, o)| (*i, *o)).collect();
        order.sort_by_key(|(_, o)| o.k);
        for (id, o) in &order {
            let id = NonZeroU16::new(*id).unwrap_or(NonZeroU16::MIN);
            if o.released {
                let pubrel = Packet::PubRel(PubResponse::success(id));
                let _ = fleetmq_core::packet::codec::encode(&pubrel, version, out);
            } else {
                let start = out.len();
                template.put(out, o.stamp, seq_base | o.k, Some(id));
                out[start] |= DUP;
            }
        }
        order.len() as u64
    }
}

/// Sequence numbers of one publisher: everything below `contiguous`, plus
/// the set above it (small unless there are real gaps, so hours-long runs
/// are fine).
#[derive(Debug, Default, Clone)]
pub struct SeqSet {
    contiguous: u64,
    ahead: BTreeSet<u64>,
}

impl SeqSet {
    /// Adds `k`; false when it was there already.
    pub fn insert(&mut self, k: u64) -> bool {
        if k < self.contiguous || !self.ahead.insert(k) {
            return false;
        }
        while self.ahead.remove(&self.contiguous) {
            self.contiguous += 1;
        }
        true
    }

    /// Whether `k` is in.
    pub fn contains(&self, k: u64) -> bool {
        k < self.contiguous || self.ahead.contains(&k)
    }

    /// How many below `n`.
    pub fn count_below(&self, n: u64) -> u64 {
        self.contiguous.min(n) + self.ahead.range(..n).count() as u64
    }

    /// Numbers below the highest one in that are not in.
    pub fn holes(&self) -> u64 {
        self.ahead.last().map_or(0, |&max| {
            max + 1 - self.contiguous - self.ahead.len() as u64
        })
    }

    /// How many of `self` are not in `other`.
    pub fn not_in(&self, other: &SeqSet) -> u64 {
        let below = self.contiguous - other.count_below(self.contiguous);
        below + self.ahead.iter().filter(|&&k| !other.contains(k)).count() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fleetmq_core::packet::codec::decode;
    use fleetmq_core::packet::QoS;

    #[test]
    fn identifiers_in_flight_are_not_reused_and_wrap_past_65535() {
        let mut t = InflightTable::default();
        let first = t.send(0, 0);
        assert_eq!(first.get(), 1);
        for k in 1..65_535 {
            t.send(k, 0);
        }
        assert_eq!(t.len(), 65_535);
        assert_eq!(
            t.puback(7),
            Acked::Value {
                k: 6,
                completed: true
            }
        );
        assert_eq!(t.send(99_999, 0).get(), 7, "the only free identifier");
        assert_eq!(
            t.puback(7),
            Acked::Value {
                k: 99_999,
                completed: true
            }
        );
        assert_eq!(
            t.puback(7),
            Acked::Unknown,
            "a repeated PUBACK does nothing"
        );
    }

    #[test]
    fn a_qos2_flow_is_acknowledged_at_pubrec_and_completed_at_pubcomp() {
        let mut t = InflightTable::default();
        let id = t.send(5, 0).get();
        assert_eq!(
            t.pubrec(id),
            Acked::Value {
                k: 5,
                completed: false
            }
        );
        assert_eq!(
            t.pubrec(id),
            Acked::Again,
            "a resent PUBREC gets PUBREL again"
        );
        assert_eq!(t.len(), 1);
        assert_eq!(t.pubcomp(id), Acked::Completed);
        assert!(t.is_empty());
        assert_eq!(t.pubcomp(id), Acked::Unknown);
    }

    #[test]
    fn a_resend_is_in_sent_order_with_dup_and_original_identifiers_or_pubrel() {
        // [MQTT-4.4.0-1], [MQTT-3.3.1-1], [MQTT-4.6.0-1]
        let version = ProtocolVersion::V3_1_1;
        let template = PublishTemplate::new("t/0", QoS::ExactlyOnce, 16, version);
        let mut t = InflightTable::default();
        let a = t.send(10, 1);
        let b = t.send(11, 2);
        let c = t.send(12, 3);
        t.pubrec(b.get());
        t.pubcomp(b.get());
        t.pubrec(c.get());
        let mut out = BytesMut::new();
        assert_eq!(t.resend(&template, version, 3 << 40, &mut out), 2);
        match decode(&mut out, Some(version), usize::MAX)
            .unwrap()
            .unwrap()
        {
            Packet::Publish(p) => {
                assert!(p.dup);
                assert_eq!(p.packet_id, Some(a));
                let (stamp, seq) = crate::client::stamp(&p.payload).unwrap();
                assert_eq!((stamp, seq), (1, 3 << 40 | 10));
            }
            other => panic!("expected PUBLISH, got {other:?}"),
        }
        match decode(&mut out, Some(version), usize::MAX)
            .unwrap()
            .unwrap()
        {
            Packet::PubRel(r) => assert_eq!(r.packet_id, c),
            other => panic!("expected PUBREL, got {other:?}"),
        }
        assert!(out.is_empty());
    }

    #[test]
    fn acknowledged_numbers_never_received_are_counted() {
        let (mut acked, mut got) = (SeqSet::default(), SeqSet::default());
        for k in [0, 1, 2, 3, 5, 9] {
            acked.insert(k);
        }
        for k in [0, 2, 3, 4, 9, 12] {
            got.insert(k);
        }
        assert_eq!(acked.not_in(&got), 2, "1 and 5");
        assert_eq!(got.holes(), 7, "1, 5..=8, 10 and 11");
        assert!(!acked.insert(3));
        assert_eq!(acked.count_below(4), 4);
    }
}
