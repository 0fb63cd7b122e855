//! Moving a publisher to the shard of its subscribers (DESIGN.md §3: a
//! cross-shard hop costs a wake-up of the receiving shard).
//!
//! A message published on one shard for a subscriber of another crosses a
//! channel, and when the receiving shard sleeps that costs an `eventfd`
//! write and an inter-processor interrupt: 27–35 µs at p50 on the 2-vCPU
//! Firecracker machines we measure on (perf/RESULTS.md). A publisher whose
//! every message goes to one other shard pays it on every message, for
//! nothing. Such a connection is moved, socket and session, to that shard.
//!
//! What moves: a plain TCP connection on its client identifier's home
//! shard (`owner_of(client id)`), whose session has no subscriptions and
//! nothing queued or in flight towards the client, and whose PUBLISH
//! packets since it connected all went to one and the same other shard and
//! to no subscriber of its own shard ([`Mover`], in fleetmq-core), at most
//! 1,000 messages/s over its last 64, while that shard was
//! busy less than half of the last tick ([`MOVE_MAX_LOAD`]). A faster
//! publisher stays: its messages cross in batches, to a shard that is
//! awake anyway, and moving it would pile the work of both shards onto one.
//! `server.move_publishers = false` turns moving off.
//!
//! Order: the move travels on the channel to the new shard after every
//! message the publisher sent there, so its messages keep their order
//! `[MQTT-4.6.0-6]`; none of them went to a third shard, whose channel
//! could be overtaken.
//!
//! Ownership stays explicit. The home shard keeps a forwarding entry
//! (client identifier → shard, generation); a connection for that client
//! identifier reaching the home shard is handed on to the session's shard
//! ([`Route::ViaHome`]), where take-over and resume happen as usual. When
//! the moved session ends, its shard tells the home shard to drop the
//! entry ([`Forget`]). A connection handed on to a shard that no longer
//! has the session (it ended meanwhile) comes back ([`Route::NotHere`]),
//! and the home shard, knowing the entry is stale, serves it. Every
//! message between two shards travels in order on one channel, which is
//! what makes each of these answers authoritative. A moved session never
//! moves again, and stays where it moved through take-overs and Clean
//! Start until it ends. A stopping shard moves nothing, and closes with
//! DISCONNECT 0x8B what is moved to it after it began to stop.

use std::os::fd::OwnedFd;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use bytestring::ByteString;
use fleetmq_core::packet::{ProtocolVersion, ReasonCode, Will};
use fleetmq_core::session::Session;
use tracing::{debug, warn};

pub(crate) use fleetmq_core::placement::Mover;

use super::{owner_of, ConnShared, Shard, ShardMsg, Slot, State};
use crate::arrival::Arrival;
use crate::connection::Admission;

/// A shard busier than this (per mille of the last tick, see
/// [`Shard::set_load`]) takes no publisher.
pub(crate) const MOVE_MAX_LOAD: u32 = 500;

/// How a connection handed to another shard got there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Route {
    /// From the shard that read its CONNECT to the home shard.
    Fresh,
    /// From the home shard, whose forwarding entry of this generation
    /// points here.
    ViaHome(u64),
    /// Back to the home shard: the session its forwarding entry of this
    /// generation pointed to is no longer there.
    NotHere(u64),
}

/// A connection and its session moving to another shard.
pub(crate) struct Move {
    pub(crate) fd: OwnedFd,
    /// Bytes read from the socket and not yet decoded.
    pub(crate) unread: Bytes,
    pub(crate) admission: Admission,
    session: Session,
    owner: (Option<Arc<str>>, Arc<str>),
    will: Option<Box<Will>>,
    /// Its record in `mqtt-session-state` (see `session_state`).
    saved: super::session_state::Saved,
    conn_key: u64,
    protocol: ProtocolVersion,
    keep_alive: u16,
    expires_at: Option<Instant>,
    last_packet: Instant,
    generation: u64,
}

/// A moved session ended: the home shard drops its forwarding entry, if it
/// is still of `generation`.
pub(crate) struct Forget {
    client_id: ByteString,
    generation: u64,
}

impl Shard {
    /// Record this shard's load over the last tick, in per mille of the
    /// tick spent running tasks, for the other shards' [`Shard::may_move_to`].
    pub(crate) fn set_load(&self, per_mille: u32) {
        self.global.load[self.id].store(per_mille, Ordering::Relaxed);
    }

    /// Whether a publisher may move to shard `to` now: `to` was busy less
    /// than [`MOVE_MAX_LOAD`] of the last tick. (Whether moving is on at
    /// all is settled once per connection, by [`Shard::is_home_of`].)
    pub(crate) fn may_move_to(&self, to: usize) -> bool {
        self.global.load.get(to).is_some_and(|load| load.load(Ordering::Relaxed) < MOVE_MAX_LOAD)
    }

    /// Whether the connection on `slot` may ever move: moving is on, and
    /// this shard is its client identifier's home (a moved session never
    /// moves again).
    pub(crate) fn is_home_of(&self, slot: Slot) -> bool {
        if !self.limits.move_publishers || self.shards == 1 {
            return false;
        }
        let st = self.state.borrow();
        st.clients
            .get(slot as usize)
            .is_some_and(|c| owner_of(c.session.client_id(), self.shards) == self.id)
    }

    /// Move the connection `conn` on `slot` (its socket `fd`, its unread
    /// bytes) and its session to shard `to`, leaving a forwarding entry.
    /// The move is queued after this shard's messages for `to`.
    ///
    /// # Errors
    /// The session cannot move (it has subscriptions, or messages queued
    /// or in flight to the client, the connection is closing or has bytes
    /// to write, or a message it sent since the decision went elsewhere):
    /// `fd` and `admission` come back, and the connection is marked
    /// unmovable.
    pub(crate) fn move_out(
        &self,
        slot: Slot,
        conn: &ConnShared,
        to: usize,
        fd: OwnedFd,
        unread: Bytes,
        admission: Admission,
    ) -> Result<(), (OwnedFd, Admission)> {
        let mut st = self.state.borrow_mut();
        let st = &mut *st;
        let movable = st.clients.get(slot as usize).is_some_and(|c| {
            c.conn.as_ref().is_some_and(|c| c.key == conn.key)
                && c.session.subscriptions().is_empty()
                && c.session.queued() == 0
                && c.session.inflight() == 0
                && c.pending_will.is_none()
        });
        // Acknowledgements waiting for the store are written to this
        // shard's connection: move once they are out (not now, not never).
        if self.store.acks_waiting(conn) {
            return Err((fd, admission));
        }
        // `unmovable`: a message since the decision went elsewhere.
        if !movable
            || self.stopping.get()
            || conn.unmovable.get()
            || conn.is_closing()
            || !conn.out.borrow().is_empty()
            || conn.feeding.get() != super::Feeding::Idle
        {
            conn.unmovable.set(true);
            return Err((fd, admission));
        }
        let client = st.clients.remove(slot as usize);
        let client_id = client.session.client_id();
        st.by_id.remove(client_id, slot);
        st.feeds.remove(slot);
        debug!(target: "broker", %client_id, from = self.id, to, "publisher moving");
        let generation = conn.key;
        st.moved.insert(client_id.clone(), (to, generation));
        let moving = Move {
            fd,
            unread,
            admission,
            session: client.session,
            owner: client.owner,
            will: client.will,
            saved: client.saved,
            conn_key: conn.key,
            protocol: conn.protocol,
            keep_alive: conn.keep_alive,
            expires_at: conn.expires_at,
            last_packet: conn.last_packet.get(),
            generation,
        };
        self.queue_ordered(st, to, ShardMsg::Move(Box::new(moving)));
        self.metrics.publishers_moved.inc();
        Ok(())
    }

    /// Take a connection and session moved here by shard `from`: the
    /// session goes into this shard's state, and the caller serves the
    /// connection with the returned [`ConnShared`] and slot (and the
    /// socket, unread bytes and admission taken from `moving`).
    pub(crate) fn move_in(
        &self,
        from: usize,
        moving: Move,
    ) -> Option<(Rc<ConnShared>, Slot, OwnedFd, Bytes, Admission)> {
        let mut st = self.state.borrow_mut();
        let st = &mut *st;
        if st.by_id.get(&st.clients, moving.session.client_id()).is_some() {
            // Cannot happen: a client identifier lives on one shard, and
            // its home forwards to this one only while it is here.
            warn!(target: "broker", client_id = %moving.session.client_id(), from, "a moved session is already here; closing the moved connection");
            return None;
        }
        let conn = Rc::new(ConnShared::new(
            moving.conn_key,
            moving.protocol,
            moving.keep_alive,
            moving.expires_at,
            moving.last_packet,
        ));
        conn.unmovable.set(true);
        if self.stopping.get() {
            conn.request_close(Some(ReasonCode::SERVER_SHUTTING_DOWN), false);
        }
        let slot = self.insert_client(st, moving.session, moving.owner);
        let client = &mut st.clients[slot as usize];
        client.conn = Some(conn.clone());
        client.will = moving.will;
        client.saved = moving.saved;
        if let Some(at) = conn.next_deadline() {
            super::push_deadline(&mut st.deadlines, std::cmp::Reverse((at, slot, conn.key)));
        }
        st.moved_in.insert(slot, moving.generation);
        let client_id = st.clients[slot as usize].session.client_id();
        debug!(target: "broker", %client_id, from, to = self.id, "publisher moved in");
        Some((conn, slot, moving.fd, moving.unread, moving.admission))
    }

    /// Drop the forwarding entry of `client_id` if it still points to
    /// `from` with `generation` (see [`Forget`] and [`Route::NotHere`]).
    pub(crate) fn forget_moved(&self, from: usize, client_id: &str, generation: u64) {
        let mut st = self.state.borrow_mut();
        if st.moved.get(client_id) == Some(&(from, generation)) {
            st.moved.remove(client_id);
        }
    }

    /// Handle a [`Forget`] from shard `from`.
    pub(crate) fn on_forget(&self, from: usize, forget: Forget) {
        self.forget_moved(from, &forget.client_id, forget.generation);
    }

    /// The session on `slot` leaves this shard for good: if it was moved
    /// here, tell its home shard to drop the forwarding entry.
    pub(super) fn moved_session_ends(&self, st: &mut State, slot: Slot, client_id: &ByteString) {
        if let Some(generation) = st.moved_in.remove(&slot) {
            let home = owner_of(client_id, self.shards);
            let forget = Forget {
                client_id: client_id.clone(),
                generation,
            };
            self.queue_ordered(st, home, ShardMsg::Forget(Box::new(forget)));
        }
    }

    /// Queue `msg` for shard `peer` after the deliveries batched for it,
    /// and have the flusher send it.
    pub(super) fn queue_ordered(&self, st: &mut State, peer: usize, msg: ShardMsg) {
        let batch = std::mem::take(&mut st.outbox[peer]);
        if !batch.is_empty() {
            st.control.push((peer, ShardMsg::Deliver(batch)));
        }
        st.control.push((peer, msg));
        self.flush_signal.notify();
    }

    /// Queue a connection accepted here for shard `peer`, which owns its
    /// client identifier (`crate::arrival`). It joins the arrivals already
    /// queued for `peer` when they are the last message queued for it, and
    /// the flusher sends them once the tasks ready now have run: one
    /// channel message, and at most one wake-up of `peer`, per turn of
    /// this shard. Arrivals are not ordered with other messages: the
    /// connection has no session yet.
    pub(crate) fn queue_arrival(&self, peer: usize, arrival: Arrival) {
        let mut st = self.state.borrow_mut();
        let st = &mut *st;
        if let Some((_, ShardMsg::Arrivals(arrivals))) = st.control.iter_mut().rev().find(|(p, _)| *p == peer) {
            arrivals.push(arrival);
            self.flush_signal.notify();
            return;
        }
        self.queue_ordered(st, peer, ShardMsg::Arrivals(vec![arrival]));
    }

    /// Queue `msg` for shard `peer` in order (see
    /// [`Shard::queue_ordered`]), then wait until it is sent.
    pub(crate) async fn send_ordered(&self, peer: usize, msg: ShardMsg) {
        {
            let mut st = self.state.borrow_mut();
            self.queue_ordered(&mut st, peer, msg);
        }
        self.flush().await;
    }
}
