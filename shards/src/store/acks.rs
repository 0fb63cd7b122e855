//! Acknowledgements waiting for the store, and for writes to the cluster
//! (see [`super`]).
//!
//! Two conditions can hold an acknowledgement back: the local store's
//! token (durable up to T, completed in order) and a [`Write`] to another
//! store (a retained value to `mqtt-retained`, completed in any order,
//! each on its own). Acknowledgements of a connection leave in the order
//! they were parked `[MQTT-4.6.0-2]` `[MQTT-4.6.0-3]`: a connection with a
//! write pending gets its own queue (a *chain*) until that queue empties,
//! so one slow write holds up only its own connection; every other
//! acknowledgement waits only for the local store, in one queue for the
//! shard, which costs an idle connection nothing.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::rc::{Rc, Weak};

use std::sync::Arc;

use bytes::Bytes;
use fleetmq_core::packet::{Packet, ReasonCode};

use super::watermark::Watermark;
use super::Token;
use crate::shard::{ConnShared, Slot};

/// The session an acknowledgement answers a packet of: the shard's slot
/// and the [`crate::shard`] client key of its identifier (a slot is
/// reused once its session ends; the key tells them apart). A refused
/// PUBREC frees its packet identifier there (see [`AckQueue::take_forgotten`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Answering {
    /// The session's slot on the shard.
    pub(crate) slot: Slot,
    /// The client key of its client identifier.
    pub(crate) client: u64,
}

/// An inbound QoS 2 packet identifier whose MQTT 5 PUBREC was refused
/// (reason 0x80 or above): the session must forget it (MQTT 5 §4.3.3), see
/// `Session::forget_inbound_qos2`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Forgotten {
    /// The session that opened it.
    pub(crate) session: Answering,
    /// The packet identifier.
    pub(crate) packet_id: u16,
}

/// How a [`Write`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Not yet known.
    Pending,
    /// The other store has it: the acknowledgement may go.
    Done,
    /// The other store did not take it: the acknowledgement is refused
    /// with this reason (see [`refuse`]).
    Refused(ReasonCode),
}

/// What runs once a [`Write`] is final (`true`: done).
type AfterWrite = Box<dyn FnOnce(bool)>;

/// A write to another store that the acknowledgement of the packet that
/// caused it waits for (DESIGN.md §7: a retained value is in
/// `mqtt-retained` before its PUBACK or PUBREC). Made by
/// [`super::ShardStore::expect_write`], resolved once by whoever awaits
/// the other store.
pub(crate) struct Write {
    /// The key of the client that published.
    origin: u64,
    /// The key of the connection whose acknowledgement waits, once
    /// parked.
    conn: Cell<Option<u64>>,
    outcome: Cell<Outcome>,
    /// Stores it waits for that have not answered: a value can be both
    /// retained (`mqtt-retained`) and ingested (`mqtt-ingest`); it is
    /// done once every one has it, refused as soon as one refuses.
    parts: Cell<u32>,
    /// Called once with the final outcome (`true`: done), before the
    /// acknowledgements that wait are written: the delivery of a held
    /// value ([`crate::shard::Shard::written`]).
    after: RefCell<Option<AfterWrite>>,
    acks: Weak<AckQueue>,
}

impl std::fmt::Debug for Write {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Write").field("origin", &self.origin).field("outcome", &self.outcome.get()).finish_non_exhaustive()
    }
}

impl Write {
    /// The key of the client that published.
    pub(crate) fn origin(&self) -> u64 {
        self.origin
    }

    /// The acknowledgement of connection `conn` waits for it.
    pub(crate) fn attach(&self, conn: u64) {
        self.conn.set(Some(conn));
    }

    /// Whether it waits for no answer any more.
    pub(crate) fn is_resolved(&self) -> bool {
        self.outcome.get() != Outcome::Pending
    }

    /// It waits for the answer of one more store (see [`Write::resolve`]).
    pub(crate) fn add_part(&self) {
        self.parts.set(self.parts.get() + 1);
    }

    /// Call `after` once with the final outcome (`true`: done), before
    /// the acknowledgements that wait for it are written. Replaces an
    /// earlier one. Must not be called while the shard's state is
    /// borrowed: [`Write::resolve`] runs it.
    pub(crate) fn then(&self, after: impl FnOnce(bool) + 'static) {
        *self.after.borrow_mut() = Some(Box::new(after));
    }

    /// One of the stores it waits for answered `outcome`: once every one
    /// answered [`Outcome::Done`], or at the first refusal, its `after`
    /// runs and the acknowledgements of its connection that no longer
    /// wait are written, in order. Later calls do nothing.
    pub(crate) fn resolve(&self, outcome: Outcome) {
        if self.outcome.get() != Outcome::Pending {
            return;
        }
        if outcome == Outcome::Done && self.parts.get() > 1 {
            self.parts.set(self.parts.get() - 1);
            return;
        }
        self.outcome.set(outcome);
        let after = self.after.borrow_mut().take();
        if let Some(after) = after {
            after(outcome == Outcome::Done);
        }
        if let (Some(acks), Some(conn)) = (self.acks.upgrade(), self.conn.get()) {
            acks.release_chain(conn);
        }
    }
}

/// One parked acknowledgement.
struct Parked {
    /// The local store must be durable up to this.
    token: Token,
    /// A write it waits for too.
    write: Option<Rc<Write>>,
    /// The local store failed it: refused with this reason.
    refused: Option<ReasonCode>,
    /// The log sequence number every shard must be durable up to (see
    /// [`super::watermark`]); 0 for acknowledgements.
    lsn: u64,
    conn: Rc<ConnShared>,
    what: Waiting,
    /// The session whose packet it answers (for a PUBREC).
    answering: Option<Answering>,
}

/// What a [`Parked`] entry writes.
enum Waiting {
    /// An acknowledgement (PUBACK, PUBREC, PUBREL, PUBCOMP, SUBACK,
    /// UNSUBACK).
    Ack(Packet),
    /// An encoded PUBLISH to a logged session.
    Publish(Bytes),
    /// The connection's buffer, which starts with its CONNACK, may be
    /// written (see [`ConnShared::held`]).
    Release,
}

impl Parked {
    /// Whether nothing holds it back any more.
    fn ready(&self, durable: Token, durable_lsn: u64) -> bool {
        let local = self.refused.is_some() || (self.token <= durable && self.lsn <= durable_lsn);
        local && self.write.as_ref().is_none_or(|w| w.outcome.get() != Outcome::Pending)
    }

    /// Whether only other shards' logs hold it back.
    fn waits_for_others(&self, durable: Token, durable_lsn: u64) -> bool {
        self.refused.is_none() && self.token <= durable && self.lsn > durable_lsn
    }

    /// Write it, or its refusal; `true` when the refusal closes the
    /// connection (nothing after it may be acknowledged). A refused PUBREC
    /// goes to `queue`'s forgotten identifiers.
    fn release(self, queue: &AckQueue) -> bool {
        let refused = self.refused.or(match self.write.as_ref().map(|w| w.outcome.get()) {
            Some(Outcome::Refused(reason)) => Some(reason),
            _ => None,
        });
        match (self.what, refused) {
            (Waiting::Ack(packet), Some(reason)) => {
                // Refused by the other store (not the local one): the value
                // is not written again later.
                let undone = self.refused.is_none();
                queue.forget(self.answering, &self.conn, &packet, undone);
                refuse(&self.conn, packet, reason)
            }
            (Waiting::Ack(packet), None) => {
                self.conn.send(&packet);
                false
            }
            // The records it waited for stay pending and are written again;
            // holding it would stall the session until the disk has room.
            (Waiting::Publish(frame), _) => {
                write_publish(&self.conn, &frame);
                false
            }
            (Waiting::Release, Some(_)) => {
                refuse_connack(&self.conn);
                true
            }
            (Waiting::Release, None) => {
                self.conn.held.set(false);
                self.conn.wake();
                false
            }
        }
    }
}

/// A shard's acknowledgements waiting for the store or for writes, oldest
/// first (see the module documentation).
#[derive(Default)]
pub(crate) struct AckQueue {
    /// Acknowledgements of connections without a chain, in token order:
    /// one queue keeps each connection's in order.
    parked: RefCell<VecDeque<Parked>>,
    /// The local store is durable up to this token.
    durable: Cell<Token>,
    /// Every shard's oldest record not yet durable (none without a local
    /// store: nothing to wait for).
    watermark: Option<Arc<Watermark>>,
    /// Connection key → its acknowledgements in order, while one of them
    /// waits for a write.
    chains: RefCell<HashMap<u64, VecDeque<Parked>>>,
    /// Connection key → how many of its acknowledgements are in `parked`.
    per_conn: RefCell<HashMap<u64, u32>>,
    /// Inbound QoS 2 identifiers whose PUBREC was refused, for the shard
    /// to free in their sessions.
    forgotten: RefCell<Vec<Forgotten>>,
}

impl AckQueue {
    /// An empty queue whose PUBLISHes wait for `watermark` too.
    pub(crate) fn new(watermark: Option<Arc<Watermark>>) -> AckQueue {
        AckQueue { watermark, ..AckQueue::default() }
    }

    /// Every shard's log is durable up to this sequence number now (it is
    /// not monotonic: a shard with nothing pending counts as durable up to
    /// any number, until it appends again).
    fn durable_lsn(&self) -> u64 {
        self.watermark.as_ref().map_or(u64::MAX, |w| w.durable())
    }

    /// A write that an acknowledgement of a publish from client `origin`
    /// will wait for.
    pub(crate) fn write(self: &Rc<Self>, origin: u64) -> Rc<Write> {
        Rc::new(Write {
            origin,
            conn: Cell::new(None),
            outcome: Cell::new(Outcome::Pending),
            parts: Cell::new(1),
            after: RefCell::new(None),
            acks: Rc::downgrade(self),
        })
    }

    /// Whether acknowledgements of connection `conn` wait in a chain: a
    /// new one must queue behind them.
    pub(crate) fn is_held(&self, conn: u64) -> bool {
        !self.chains.borrow().is_empty() && self.chains.borrow().contains_key(&conn)
    }

    /// Park `packet` for `conn` until the store is durable up to `token`
    /// (not below any token parked before), behind the connection's
    /// chain if it has one.
    /// `answering`: the session whose packet it answers (see
    /// [`Answering`]).
    pub(crate) fn park(&self, token: Token, conn: &Rc<ConnShared>, packet: Packet, answering: Option<Answering>) {
        self.push(token, 0, conn, Waiting::Ack(packet), answering);
    }

    /// Park the encoded PUBLISH `frame` for `conn` until the store is
    /// durable up to `token` and every shard up to `lsn`.
    pub(crate) fn park_publish(&self, token: Token, lsn: u64, conn: &Rc<ConnShared>, frame: Bytes) {
        self.push(token, lsn, conn, Waiting::Publish(frame), None);
    }

    /// Hold `conn`'s writes, which start with its CONNACK, until the store
    /// is durable up to `token`.
    pub(crate) fn park_release(&self, token: Token, conn: &Rc<ConnShared>) {
        conn.held.set(true);
        self.push(token, 0, conn, Waiting::Release, None);
    }

    fn push(&self, token: Token, lsn: u64, conn: &Rc<ConnShared>, what: Waiting, answering: Option<Answering>) {
        let parked = Parked { token, write: None, refused: None, lsn, conn: conn.clone(), what, answering };
        if self.is_held(conn.key) {
            return self.chain(parked);
        }
        let mut queue = self.parked.borrow_mut();
        debug_assert!(queue.back().is_none_or(|p| p.token <= token));
        queue.push_back(parked);
        *self.per_conn.borrow_mut().entry(conn.key).or_default() += 1;
    }

    /// Whether acknowledgements (or PUBLISHes, a held CONNACK) of
    /// connection `conn` wait at all: it drains them before it closes, and
    /// does not move or park meanwhile.
    pub(crate) fn waiting_for(&self, conn: u64) -> bool {
        self.per_conn.borrow().contains_key(&conn) || self.is_held(conn)
    }

    /// True when nothing waits: what is written now cannot overtake.
    pub(crate) fn is_empty(&self) -> bool {
        self.parked.borrow().is_empty() && self.chains.borrow().is_empty()
    }

    /// Queue `packet` in `conn`'s chain: written once the store is
    /// durable up to `token` (or refused with `refused` when the store
    /// already failed it) and `write` is resolved, after everything
    /// queued for `conn` before it. `answering` as for [`AckQueue::park`].
    pub(crate) fn hold(
        &self,
        token: Token,
        conn: &Rc<ConnShared>,
        (packet, answering): (Packet, Option<Answering>),
        write: Option<Rc<Write>>,
        refused: Option<ReasonCode>,
    ) {
        let what = Waiting::Ack(packet);
        self.chain(Parked { token, write, refused, lsn: 0, conn: conn.clone(), what, answering });
    }

    /// Queue `parked` at the end of its connection's chain and write what
    /// no longer waits.
    fn chain(&self, parked: Parked) {
        let key = parked.conn.key;
        self.chains.borrow_mut().entry(key).or_default().push_back(parked);
        self.release_chain(key);
    }

    /// Queue the encoded PUBLISH `frame` in `conn`'s chain: written once
    /// `write` (if any) is resolved, whatever its outcome, after
    /// everything queued for `conn` before it.
    pub(crate) fn hold_publish(&self, conn: &Rc<ConnShared>, frame: Bytes, write: Option<Rc<Write>>) {
        self.chain(Parked { token: 0, write, refused: None, lsn: 0, conn: conn.clone(), what: Waiting::Publish(frame), answering: None });
    }

    /// How many packets wait in `conn`'s chain.
    pub(crate) fn chain_len(&self, conn: u64) -> usize {
        if self.chains.borrow().is_empty() {
            return 0;
        }
        self.chains.borrow().get(&conn).map_or(0, VecDeque::len)
    }

    /// Acknowledgements parked and not yet written.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.parked.borrow().len() + self.chains.borrow().values().map(VecDeque::len).sum::<usize>()
    }

    /// The store is durable up to `token`: write every acknowledgement
    /// parked with a token at or below it that waits for nothing else, in
    /// order. A connection that closed meanwhile gets its bytes written to
    /// a buffer nobody reads.
    ///
    /// A PUBLISH also waits for every shard to be durable up to its log
    /// sequence number (see [`super::watermark`]); what was parked after it
    /// waits with it. Returns true when something is left that only waits
    /// for other shards (the caller looks again soon).
    pub(crate) fn complete(&self, token: Token) -> bool {
        self.durable.set(self.durable.get().max(token));
        let (durable, durable_lsn) = (self.durable.get(), self.durable_lsn());
        while let Some(p) = self.pop_upto(durable, durable_lsn) {
            p.release(self);
        }
        self.release_chains();
        let waits = |p: Option<&Parked>| p.is_some_and(|p| p.waits_for_others(durable, durable_lsn));
        waits(self.parked.borrow().front()) || self.chains.borrow().values().any(|c| waits(c.front()))
    }

    /// The store could not make what lies up to `token` durable (disk full,
    /// a write error): refuse, never acknowledge (DESIGN.md §7). MQTT 5:
    /// PUBACK/PUBREC carry 0x97 Quota exceeded; anything else (SUBACK,
    /// UNSUBACK, CONNACK), and every acknowledgement of a 3.1.1 client,
    /// closes the connection after what it was already acknowledged (MQTT
    /// 5: DISCONNECT 0x97).
    ///
    /// A parked PUBLISH is written all the same (see `Parked::release`);
    /// a held CONNACK is refused (see [`refuse_connack`]).
    pub(crate) fn fail(&self, token: Token) {
        while let Some(mut p) = self.pop_upto(token, u64::MAX) {
            p.refused = Some(ReasonCode::QUOTA_EXCEEDED);
            let _ = p.release(self);
        }
        let durable = self.durable.get();
        for chain in self.chains.borrow_mut().values_mut() {
            for p in chain.iter_mut().filter(|p| p.token > durable && p.token <= token) {
                p.refused.get_or_insert(ReasonCode::QUOTA_EXCEEDED);
            }
        }
        self.release_chains();
    }

    /// `packet`, for `conn`, went out refused: if it is an MQTT 5 PUBREC
    /// answering `answering`, its identifier is forgotten there (see
    /// [`AckQueue::take_forgotten`]).
    ///
    /// MQTT 3.1.1 has no refusing PUBREC: the connection closes and the
    /// client sends the same message again, with DUP, after it reconnects.
    /// When the local store refused (`undone` false), the identifier stays
    /// open: the value was already forwarded and its records are written
    /// once the store can (see `ShardLog::failed`), and the resend's PUBREC
    /// waits for them, so it is stored and delivered once. When the other
    /// store refused (`undone`: a retained value `mqtt-retained` did not
    /// take, whose write is undone), it is forgotten too: the resend is
    /// stored again rather than acknowledged and lost (DESIGN.md §7).
    pub(crate) fn forget(&self, answering: Option<Answering>, conn: &ConnShared, packet: &Packet, undone: bool) {
        if !conn.protocol.is_v5() && !undone {
            return;
        }
        if let (Some(session), Packet::PubRec(rec)) = (answering, packet) {
            self.forgotten.borrow_mut().push(Forgotten { session, packet_id: rec.packet_id.get() });
        }
    }

    /// Take the inbound QoS 2 identifiers whose PUBREC was refused since
    /// the last call (see [`Forgotten`]); the shard frees them before it
    /// handles the next packet, so a PUBLISH that reuses one after the
    /// refusal is a new message.
    pub(crate) fn take_forgotten(&self) -> Vec<Forgotten> {
        if self.forgotten.borrow().is_empty() {
            return Vec::new();
        }
        std::mem::take(&mut *self.forgotten.borrow_mut())
    }

    fn pop_upto(&self, token: Token, durable_lsn: u64) -> Option<Parked> {
        let mut parked = self.parked.borrow_mut();
        if parked.front().is_none_or(|p| p.token > token || p.lsn > durable_lsn) {
            return None;
        }
        let p = parked.pop_front()?;
        let mut per_conn = self.per_conn.borrow_mut();
        if let Some(n) = per_conn.get_mut(&p.conn.key) {
            *n -= 1;
            if *n == 0 {
                per_conn.remove(&p.conn.key);
            }
        }
        Some(p)
    }

    /// Write what leads every chain and waits for nothing more.
    fn release_chains(&self) {
        if self.chains.borrow().is_empty() {
            return;
        }
        let keys: Vec<u64> = self.chains.borrow().keys().copied().collect();
        for key in keys {
            self.release_chain(key);
        }
    }

    /// Write what leads `conn`'s chain and waits for nothing more; forget
    /// the chain once it is empty.
    fn release_chain(&self, conn: u64) {
        let (durable, durable_lsn) = (self.durable.get(), self.durable_lsn());
        loop {
            let next = {
                let mut chains = self.chains.borrow_mut();
                let Some(chain) = chains.get_mut(&conn) else { return };
                match chain.front() {
                    Some(p) if p.ready(durable, durable_lsn) => chain.pop_front(),
                    Some(_) => return,
                    None => {
                        chains.remove(&conn);
                        return;
                    }
                }
            };
            // Written with no borrow held: a write may close the
            // connection, which may come back here. After a refusal that
            // closes it, nothing more is acknowledged: the client sends
            // the rest again.
            if next.is_some_and(|p| p.release(self)) {
                self.chains.borrow_mut().remove(&conn);
                return;
            }
        }
    }
}

/// Refuse the CONNACK at the head of `conn`'s held buffer (see
/// [`AckQueue::fail`]): nothing of it is written, the connection closes
/// (MQTT 5: DISCONNECT 0x97).
pub(crate) fn refuse_connack(conn: &ConnShared) {
    conn.out.borrow_mut().clear();
    conn.pending.set(0);
    conn.held.set(false);
    conn.request_close(Some(ReasonCode::QUOTA_EXCEEDED), true);
}

/// Write an encoded PUBLISH to `conn`.
fn write_publish(conn: &ConnShared, frame: &[u8]) {
    conn.out.borrow_mut().extend_from_slice(frame);
    conn.pending.set(conn.pending.get() + 1);
    conn.wake();
}

/// Refuse `packet`, an acknowledgement the store could not cover, with
/// `reason` (see [`AckQueue::fail`]; 0x80 Unspecified error when the
/// cluster did not take a retained value in time, 0x97 Quota exceeded when
/// it is too large or the local store is full). Returns `true` when it
/// closes the connection instead (MQTT 3.1.1, and packets other than
/// PUBACK and PUBREC).
pub(crate) fn refuse(conn: &ConnShared, packet: Packet, reason: ReasonCode) -> bool {
    match refusal(conn, packet, reason) {
        Ok(packet) => {
            conn.send(&packet);
            false
        }
        Err(_) => {
            conn.request_close(Some(reason), true);
            true
        }
    }
}

/// The MQTT 5 packet that refuses `packet` with `reason`: a PUBACK or
/// PUBREC carrying it (one that carries an error already, and a
/// DISCONNECT, as they are); `Err(packet)` when refusing it closes the
/// connection instead (MQTT 3.1.1, other packets).
pub(crate) fn refusal(conn: &ConnShared, packet: Packet, reason: ReasonCode) -> Result<Packet, Packet> {
    let v5 = conn.protocol.is_v5();
    match packet {
        Packet::PubAck(mut ack) if v5 && !ack.reason.is_error() => {
            ack.reason = reason;
            Ok(Packet::PubAck(ack))
        }
        Packet::PubRec(mut rec) if v5 && !rec.reason.is_error() => {
            rec.reason = reason;
            Ok(Packet::PubRec(rec))
        }
        packet @ (Packet::PubAck(_) | Packet::PubRec(_) | Packet::Disconnect(_)) if v5 => Ok(packet),
        packet => Err(packet),
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

    /// An acknowledgement the store covers after the DISCONNECT was
    /// queued is not written: nothing follows a DISCONNECT
    /// `[MQTT-3.14.4-1]`.
    #[test]
    fn nothing_queued_after_the_disconnect_is_written() {
        let c = conn(ProtocolVersion::V5);
        c.send(&puback(1));
        c.request_close(Some(ReasonCode::SERVER_SHUTTING_DOWN), true);
        c.send_disconnect();
        c.send(&puback(2));
        let mut out = c.out.borrow_mut().split();
        c.after_disconnect_dropped(&mut out);
        *c.out.borrow_mut() = out;
        let packets = written(&c);
        assert_eq!(packets.len(), 2, "{packets:?}");
        assert!(matches!(packets[1], Packet::Disconnect(_)), "{packets:?}");
        // Later ones are dropped too.
        c.send(&puback(3));
        let mut out = c.out.borrow_mut().split();
        c.after_disconnect_dropped(&mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn acknowledgements_wait_for_their_token_and_leave_in_order() {
        let q = AckQueue::default();
        let c = conn(ProtocolVersion::V5);
        q.park(1, &c, puback(1), None);
        q.park(2, &c, puback(2), None);
        q.park(2, &c, puback(3), None);
        q.park(5, &c, puback(4), None);
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
    fn a_publish_waits_for_every_shard_and_what_follows_waits_with_it() {
        let watermark = Arc::new(Watermark::new(2));
        let q = AckQueue::new(Some(watermark.clone()));
        let c = conn(ProtocolVersion::V5);
        let frame = {
            let mut out = bytes::BytesMut::new();
            fleetmq_core::packet::codec::encode(&puback(9), c.protocol, &mut out).unwrap();
            out.freeze()
        };
        q.park_publish(1, 50, &c, frame);
        q.park(1, &c, puback(1), None);
        watermark.set_oldest(1, Some(50));
        assert!(q.complete(1), "waits for another shard");
        assert!(written(&c).is_empty());
        watermark.set_oldest(1, Some(51));
        assert!(!q.complete(1));
        assert_eq!(written(&c), vec![puback(9), puback(1)]);
        assert!(q.is_empty());
    }

    #[test]
    fn a_failed_store_refuses_with_quota_exceeded_on_mqtt5() {
        let q = AckQueue::default();
        let c = conn(ProtocolVersion::V5);
        q.park(1, &c, puback(1), None);
        q.park(2, &c, puback(2), None);
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
        q.park(1, &c, puback(1), None);
        q.park(2, &c, puback(2), None);
        q.complete(1);
        q.fail(2);
        assert_eq!(written(&c), vec![puback(1)]);
        assert!(c.is_closing());
    }

    fn conn_keyed(key: u64, protocol: ProtocolVersion) -> Rc<ConnShared> {
        Rc::new(ConnShared::new(key, protocol, 0, None, Instant::now()))
    }

    /// Queue `packet` for `conn` behind a new pending write, which is
    /// returned.
    fn held(q: &Rc<AckQueue>, conn: &Rc<ConnShared>, token: Token, packet: Packet) -> Rc<Write> {
        let write = q.write(10);
        write.attach(conn.key);
        q.hold(token, conn, (packet, None), Some(write.clone()), None);
        write
    }

    fn refused(id: u16, reason: ReasonCode) -> Packet {
        let mut ack = PubResponse::success(std::num::NonZeroU16::new(id).unwrap());
        ack.reason = reason;
        Packet::PubAck(ack)
    }

    #[test]
    fn a_pending_write_holds_back_only_its_own_connection_and_keeps_its_order() {
        // [MQTT-4.6.0-2]: PUBACKs in the order the PUBLISHes came.
        let q = Rc::new(AckQueue::default());
        let (a, b) = (conn_keyed(1, ProtocolVersion::V5), conn_keyed(2, ProtocolVersion::V5));
        let write = held(&q, &a, 0, puback(1));
        q.park(0, &a, puback(2), None);
        q.park(0, &b, puback(7), None);
        q.complete(0);
        assert!(written(&a).is_empty(), "behind the pending write");
        assert_eq!(written(&b), vec![puback(7)], "another connection does not wait");
        write.resolve(Outcome::Done);
        assert_eq!(written(&a), vec![puback(1), puback(2)]);
        assert_eq!(q.len(), 0);
        assert!(!q.is_held(a.key), "the chain is gone once empty");
    }

    #[test]
    fn a_refused_write_answers_0x80_on_mqtt5_and_what_follows_still_goes_in_order() {
        let q = Rc::new(AckQueue::default());
        let a = conn_keyed(1, ProtocolVersion::V5);
        let write = held(&q, &a, 0, puback(1));
        q.park(0, &a, puback(2), None);
        write.resolve(Outcome::Refused(ReasonCode::UNSPECIFIED_ERROR));
        assert_eq!(written(&a), vec![refused(1, ReasonCode::UNSPECIFIED_ERROR), puback(2)]);
        assert!(!a.is_closing());
    }

    #[test]
    fn a_refused_write_closes_a_3_1_1_connection_and_acknowledges_nothing_after_it() {
        let q = Rc::new(AckQueue::default());
        let a = conn_keyed(1, ProtocolVersion::V3_1_1);
        q.park(5, &a, puback(1), None);
        let write = held(&q, &a, 5, puback(2));
        q.park(5, &a, puback(3), None);
        q.complete(5);
        assert_eq!(written(&a), vec![puback(1)], "what came before is acknowledged");
        write.resolve(Outcome::Refused(ReasonCode::UNSPECIFIED_ERROR));
        assert!(written(&a).is_empty(), "nothing after the refused one");
        assert!(a.is_closing());
        assert_eq!(q.len(), 0);
    }

    #[test]
    fn an_acknowledgement_waits_for_both_the_local_store_and_its_write() {
        let q = Rc::new(AckQueue::default());
        let a = conn_keyed(1, ProtocolVersion::V5);
        let write = held(&q, &a, 3, puback(1));
        write.resolve(Outcome::Done);
        assert!(written(&a).is_empty(), "the local store is not durable yet");
        q.complete(3);
        assert_eq!(written(&a), vec![puback(1)]);

        // The other way round: durable first, then the write.
        let write = held(&q, &a, 4, puback(2));
        q.complete(4);
        assert!(written(&a).is_empty(), "the write is pending");
        write.resolve(Outcome::Done);
        assert_eq!(written(&a), vec![puback(2)]);
    }

    #[test]
    fn a_local_store_failure_refuses_a_held_acknowledgement_in_its_turn() {
        let q = Rc::new(AckQueue::default());
        let a = conn_keyed(1, ProtocolVersion::V5);
        let write = held(&q, &a, 3, puback(1));
        q.fail(3);
        assert!(written(&a).is_empty(), "still waits for its write");
        write.resolve(Outcome::Done);
        assert_eq!(written(&a), vec![refused(1, ReasonCode::QUOTA_EXCEEDED)]);
    }

    fn pubrec(id: u16) -> Packet {
        Packet::PubRec(PubResponse::success(std::num::NonZeroU16::new(id).unwrap()))
    }

    #[test]
    fn a_refused_pubrec_frees_its_identifier_and_an_accepted_one_does_not() {
        // MQTT 5 §4.3.3: a PUBREC of 0x80 or above makes the identifier
        // available again; the session must learn which.
        let q = Rc::new(AckQueue::default());
        let a = conn_keyed(1, ProtocolVersion::V5);
        let session = Answering { slot: 3, client: 77 };
        q.park(1, &a, pubrec(5), Some(session));
        q.complete(1);
        assert_eq!(written(&a), vec![pubrec(5)]);
        assert!(q.take_forgotten().is_empty(), "accepted: still open until PUBREL");
        q.park(2, &a, pubrec(6), Some(session));
        q.park(2, &a, puback(7), Some(session));
        q.fail(2);
        assert_eq!(q.take_forgotten(), vec![Forgotten { session, packet_id: 6 }]);
        assert!(q.take_forgotten().is_empty(), "taken once");
        // A refused cluster write (undone: forgotten, a 3.1.1 connection
        // closed instead too); a local store failure on 3.1.1 keeps the
        // identifier for the resend that follows the reconnect (its records
        // are written once the disk has room).
        for protocol in [ProtocolVersion::V5, ProtocolVersion::V3_1_1] {
            let c = conn_keyed(2, protocol);
            let write = q.write(10);
            write.attach(c.key);
            q.hold(0, &c, (pubrec(8), Some(session)), Some(write.clone()), None);
            write.resolve(Outcome::Refused(ReasonCode::UNSPECIFIED_ERROR));
            assert_eq!(q.take_forgotten(), vec![Forgotten { session, packet_id: 8 }], "{protocol:?}");
            assert_eq!(c.is_closing(), protocol == ProtocolVersion::V3_1_1);
        }
        let old = conn_keyed(3, ProtocolVersion::V3_1_1);
        q.park(3, &old, pubrec(9), Some(session));
        q.fail(3);
        assert!(q.take_forgotten().is_empty(), "kept for the 3.1.1 resend");
        assert!(old.is_closing());
    }

    /// A QoS 2 PUBLISH held for a session's cursor (`hold_publish` with a
    /// write), a PUBREL held for a later cursor, and what comes for the
    /// connection meanwhile (held behind, with no write): nothing goes
    /// before the write it waits for, everything in order
    /// `[MQTT-4.6.0-6]`.
    #[test]
    fn publishes_held_for_a_cursor_go_in_order_once_it_landed() {
        let q = Rc::new(AckQueue::default());
        let c = conn_keyed(3, ProtocolVersion::V5);
        let (first, second) = (q.write(10), q.write(10));
        first.attach(c.key);
        second.attach(c.key);
        let frame = |pid: u16| {
            let publish = fleetmq_core::packet::Publish {
                dup: false,
                qos: fleetmq_core::packet::QoS::ExactlyOnce,
                retain: false,
                topic: bytestring::ByteString::from_static("t"),
                packet_id: std::num::NonZeroU16::new(pid),
                properties: Default::default(),
                payload: Bytes::from_static(b"v"),
            };
            let mut out = bytes::BytesMut::new();
            fleetmq_core::packet::codec::encode(&Packet::Publish(publish), c.protocol, &mut out).expect("encoded");
            out.freeze()
        };
        q.hold_publish(&c, frame(1), Some(first.clone()));
        q.hold(0, &c, (puback(5), None), None, None);
        let rel = Packet::PubRel(PubResponse::success(std::num::NonZeroU16::new(9).unwrap()));
        q.hold(0, &c, (rel.clone(), None), Some(second.clone()), None);
        assert_eq!(q.chain_len(c.key), 3);
        assert!(written(&c).is_empty(), "the PUBLISH waits for its cursor, the rest behind it");
        second.resolve(Outcome::Done);
        assert!(written(&c).is_empty(), "a later write does not let the PUBREL overtake");
        first.resolve(Outcome::Done);
        let out = written(&c);
        assert_eq!(out.len(), 3, "{out:?}");
        assert!(matches!(&out[0], Packet::Publish(p) if p.packet_id.map(|p| p.get()) == Some(1)));
        assert_eq!(out[1..], [puback(5), rel]);
        assert_eq!(q.chain_len(c.key), 0);
        assert!(!q.waiting_for(c.key));
    }
}
