//! Acknowledgements waiting for the store (see [`super`]).

use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;

use fleetmq_core::packet::{Packet, ReasonCode};

use super::Token;
use crate::shard::ConnShared;

/// One parked acknowledgement.
struct Parked {
    token: Token,
    conn: Rc<ConnShared>,
    packet: Packet,
}

/// A shard's acknowledgements waiting for the store, oldest first. Tokens
/// are parked in increasing order, so one queue keeps every connection's
/// acknowledgements in order and costs an idle connection nothing.
#[derive(Default)]
pub(crate) struct AckQueue {
    parked: RefCell<VecDeque<Parked>>,
}

impl AckQueue {
    /// Park `packet` for `conn` until the store is durable up to `token`
    /// (not below any token parked before).
    pub(crate) fn park(&self, token: Token, conn: &Rc<ConnShared>, packet: Packet) {
        let mut parked = self.parked.borrow_mut();
        debug_assert!(parked.back().is_none_or(|p| p.token <= token));
        parked.push_back(Parked { token, conn: conn.clone(), packet });
    }

    /// Acknowledgements parked and not yet written.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.parked.borrow().len()
    }

    /// The store is durable up to `token`: write every acknowledgement
    /// parked with a token at or below it, in order. A connection that
    /// closed meanwhile gets its bytes written to a buffer nobody reads.
    pub(crate) fn complete(&self, token: Token) {
        while let Some(p) = self.pop_upto(token) {
            p.conn.send(&p.packet);
        }
    }

    /// The store could not make what lies up to `token` durable (disk full,
    /// a write error): refuse, never acknowledge (DESIGN.md §7). MQTT 5:
    /// PUBACK/PUBREC carry 0x97 Quota exceeded; anything else (SUBACK,
    /// UNSUBACK, CONNACK), and every acknowledgement of a 3.1.1 client,
    /// closes the connection after what it was already acknowledged (MQTT
    /// 5: DISCONNECT 0x97).
    pub(crate) fn fail(&self, token: Token) {
        while let Some(p) = self.pop_upto(token) {
            refuse(&p.conn, p.packet);
        }
    }

    fn pop_upto(&self, token: Token) -> Option<Parked> {
        let mut parked = self.parked.borrow_mut();
        if parked.front().is_some_and(|p| p.token <= token) {
            parked.pop_front()
        } else {
            None
        }
    }
}

/// Refuse `packet`, an acknowledgement the store could not cover (see
/// [`AckQueue::fail`]).
pub(crate) fn refuse(conn: &ConnShared, packet: Packet) {
    let v5 = conn.protocol.is_v5();
    match packet {
        Packet::PubAck(mut ack) if v5 && !ack.reason.is_error() => {
            ack.reason = ReasonCode::QUOTA_EXCEEDED;
            conn.send(&Packet::PubAck(ack));
        }
        Packet::PubRec(mut rec) if v5 && !rec.reason.is_error() => {
            rec.reason = ReasonCode::QUOTA_EXCEEDED;
            conn.send(&Packet::PubRec(rec));
        }
        packet @ (Packet::PubAck(_) | Packet::PubRec(_)) if v5 => conn.send(&packet),
        _ => conn.request_close(Some(ReasonCode::QUOTA_EXCEEDED), true),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use fleetmq_core::packet::codec::decode;
    use fleetmq_core::packet::{ProtocolVersion, PubResponse};

    use super::*;

    fn conn(protocol: ProtocolVersion) -> Rc<ConnShared> {
        Rc::new(ConnShared::new(1, protocol, 0, None, Instant::now()))
    }

    fn puback(id: u16) -> Packet {
        Packet::PubAck(PubResponse::success(std::num::NonZeroU16::new(id).unwrap()))
    }

    /// The packets written to `conn` so far.
    fn written(conn: &ConnShared) -> Vec<Packet> {
        let mut out = conn.out.borrow_mut().split();
        let mut packets = Vec::new();
        while let Ok(Some(packet)) = decode(&mut out, Some(conn.protocol), usize::MAX) {
            packets.push(packet);
        }
        packets
    }

    #[test]
    fn acknowledgements_wait_for_their_token_and_leave_in_order() {
        let q = AckQueue::default();
        let c = conn(ProtocolVersion::V5);
        q.park(1, &c, puback(1));
        q.park(2, &c, puback(2));
        q.park(2, &c, puback(3));
        q.park(5, &c, puback(4));
        assert!(written(&c).is_empty());
        q.complete(2);
        assert_eq!(written(&c), vec![puback(1), puback(2), puback(3)]);
        assert_eq!(q.len(), 1);
        q.complete(4);
        assert!(written(&c).is_empty());
        q.complete(5);
        assert_eq!(written(&c), vec![puback(4)]);
        assert_eq!(q.len(), 0);
    }

    #[test]
    fn a_failed_store_refuses_with_quota_exceeded_on_mqtt5() {
        let q = AckQueue::default();
        let c = conn(ProtocolVersion::V5);
        q.park(1, &c, puback(1));
        q.park(2, &c, puback(2));
        q.complete(1);
        q.fail(2);
        let mut refused = PubResponse::success(std::num::NonZeroU16::new(2).unwrap());
        refused.reason = ReasonCode::QUOTA_EXCEEDED;
        assert_eq!(written(&c), vec![puback(1), Packet::PubAck(refused)]);
        assert!(!c.is_closing());
    }

    #[test]
    fn a_failed_store_closes_a_3_1_1_connection_after_what_was_acknowledged() {
        let q = AckQueue::default();
        let c = conn(ProtocolVersion::V3_1_1);
        q.park(1, &c, puback(1));
        q.park(2, &c, puback(2));
        q.complete(1);
        q.fail(2);
        assert_eq!(written(&c), vec![puback(1)]);
        assert!(c.is_closing());
    }
}
