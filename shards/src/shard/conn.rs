//! The part of a connection the shard writes into ([`ConnShared`]): its
//! outgoing bytes, its signals and its close request ([`CloseRequest`]).

use std::cell::{Cell, RefCell};
use std::time::Instant;

use bytes::BytesMut;
use fleetmq_core::packet::codec::encode;
use fleetmq_core::packet::{Disconnect, Packet, Props, ProtocolVersion, ReasonCode};
use fleetmq_core::session::timing::keep_alive_deadline;

use super::Feeding;
use crate::signal::Signal;

/// Why a connection is being closed by the broker.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CloseRequest {
    /// Publish the will of the connection.
    pub(crate) publish_will: bool,
    /// The reason code of the DISCONNECT an MQTT 5 client gets (`None`:
    /// none, MQTT 3.1.1 or a client that is gone). The connection's task
    /// writes it last, after the acknowledgements that wait for the store
    /// (`crate::connection`), since nothing may follow it
    /// `[MQTT-3.14.4-1]`.
    pub(crate) disconnect: Option<ReasonCode>,
}

/// The part of a connection that the shard writes into: its outgoing bytes
/// and the signals to its tasks.
pub(crate) struct ConnShared {
    pub(crate) key: u64,
    pub(crate) protocol: ProtocolVersion,
    pub(crate) out: RefCell<BytesMut>,
    /// Packets appended since the writer last took the buffer.
    pub(crate) pending: Cell<usize>,
    /// The buffer starts with a CONNACK the store does not cover yet: not
    /// written until it does (see `ShardStore::hold_until_durable`).
    pub(crate) held: Cell<bool>,
    /// Wakes the connection's task: bytes to write, or a close request.
    /// Use [`ConnShared::wake`], which also unparks.
    pub(crate) write_signal: Signal,
    /// The connection's token while it is parked (see [`crate::park`]).
    pub(crate) parked: Cell<Option<u32>>,
    /// Traffic either way since the shard last looked (see [`Shard::expire`]).
    pub(crate) active: Cell<bool>,
    /// The shard asks the connection's task to park.
    pub(crate) park_requested: Cell<bool>,
    /// The connection can park (plain TCP; set by its task).
    pub(crate) parkable: Cell<bool>,
    pub(crate) close: Cell<Option<CloseRequest>>,
    /// Once the DISCONNECT is queued: how many bytes of `out` may still be
    /// written (those up to its end). Nothing may follow it
    /// `[MQTT-3.14.4-1]`, not even an acknowledgement the store covers
    /// late. See [`ConnShared::after_disconnect_dropped`].
    sealed_at: Cell<Option<usize>>,
    /// The connection may not move to another shard (see [`placement`]).
    pub(crate) unmovable: Cell<bool>,
    /// Retained messages for its subscriptions wait (see [`retained`]).
    pub(crate) feeding: Cell<Feeding>,
    /// When the last complete Control Packet from the client was read
    /// (at CONNECT, the connection's start). Keep Alive counts packets,
    /// not bytes: a client that sends a packet a byte at a time is still
    /// closed 1.5 × Keep Alive after its last whole packet
    /// `[MQTT-3.1.2-22]` (3.1.1: `[MQTT-3.1.2-24]`).
    pub(crate) last_packet: Cell<Instant>,
    pub(super) keep_alive: u16,
    /// When the client's credential expires (JWT `exp`).
    pub(super) expires_at: Option<Instant>,
}

impl ConnShared {
    pub(crate) fn new(
        key: u64,
        protocol: ProtocolVersion,
        keep_alive: u16,
        expires_at: Option<Instant>,
        now: Instant,
    ) -> ConnShared {
        ConnShared {
            key,
            protocol,
            out: RefCell::new(BytesMut::new()),
            pending: Cell::new(0),
            held: Cell::new(false),
            write_signal: Signal::default(),
            parked: Cell::new(None),
            active: Cell::new(true),
            park_requested: Cell::new(false),
            parkable: Cell::new(false),
            close: Cell::new(None),
            sealed_at: Cell::new(None),
            unmovable: Cell::new(false),
            feeding: Cell::new(Feeding::Idle),
            last_packet: Cell::new(now),
            keep_alive,
            expires_at,
        }
    }

    /// The next time the connection's clocks must be checked.
    pub(crate) fn next_deadline(&self) -> Option<Instant> {
        let keep_alive = keep_alive_deadline(self.last_packet.get(), self.keep_alive);
        match (keep_alive, self.expires_at) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Close the connection when its keep alive or credential ran out.
    pub(crate) fn check_deadlines(&self, now: Instant) {
        if self.expires_at.is_some_and(|at| at <= now) {
            self.request_close(Some(ReasonCode::MAXIMUM_CONNECT_TIME), true);
        } else if keep_alive_deadline(self.last_packet.get(), self.keep_alive)
            .is_some_and(|at| at <= now)
        {
            self.request_close(Some(ReasonCode::KEEP_ALIVE_TIMEOUT), true);
        }
    }

    /// Encode `packet` into the write buffer and wake the writer.
    pub(crate) fn send(&self, packet: &Packet) {
        let mut out = self.out.borrow_mut();
        // Only packets we build ourselves reach here; they always encode.
        // The bytes wait only until the connection's task writes them:
        // aside (crate::alloc), like the task.
        let _ = crate::alloc::aside(|| encode(packet, self.protocol, &mut out));
        self.pending.set(self.pending.get() + 1);
        self.wake();
    }

    /// Wake the connection's task (bytes to write, a close request), and
    /// unpark the connection if it is parked.
    pub(crate) fn wake(&self) {
        self.write_signal.notify();
        if let Some(token) = self.parked.get() {
            crate::park::wake(token);
        }
    }

    /// Ask the connection to close: MQTT 5 clients get DISCONNECT with
    /// `reason` as its last packet, after what is queued for it and the
    /// acknowledgements that wait for the store. The first request wins.
    pub(crate) fn request_close(&self, reason: Option<ReasonCode>, publish_will: bool) {
        if self.close.get().is_some() {
            return;
        }
        let disconnect = reason.filter(|_| self.protocol.is_v5());
        self.close.set(Some(CloseRequest { publish_will, disconnect }));
        self.wake();
    }

    /// Queue the DISCONNECT of the close request, if it has one.
    pub(crate) fn send_disconnect(&self) {
        if let Some(reason) = self.close.get().and_then(|c| c.disconnect) {
            self.send(&Packet::Disconnect(Disconnect {
                reason,
                properties: Props::default(),
            }));
            self.sealed_at.set(Some(self.out.borrow().len()));
        }
    }

    /// Drop from `out` (this connection's `out`, borrowed by the writer)
    /// what was queued after the DISCONNECT ([`ConnShared::send_disconnect`]):
    /// the writer calls it before it takes the buffer, and once the
    /// DISCONNECT is taken nothing more is written.
    pub(crate) fn after_disconnect_dropped(&self, out: &mut BytesMut) {
        if let Some(end) = self.sealed_at.get() {
            out.truncate(end);
            // What the writer takes now ends with the DISCONNECT.
            self.sealed_at.set(Some(0));
        }
    }

    pub(crate) fn is_closing(&self) -> bool {
        self.close.get().is_some()
    }
}
