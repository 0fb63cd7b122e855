//! Connections handed to the shard that owns their client identifier
//! before the shard that accepted them builds anything for them
//! (DESIGN.md §3: `owner_of(client id)`; issue 27, "Connect rate").
//!
//! With more than one shard, the kernel spreads connections over the
//! shards' listening sockets (`SO_REUSEPORT`) by their addresses, so about
//! half of them (with two shards) are accepted on a shard that does not own
//! their client identifier. Handed over after sign-in, such a connection
//! cost the accepting shard a glommio stream, a task, the sign-in, a `dup`
//! and a close, and the owner a second stream and task: a CONNECT cost the
//! 2-shard broker 1.3–1.5 × the CPU of the 1-shard one (perf/RESULTS.md,
//! 2026-12-05, "connect storms at the pending limit").
//!
//! Now, right after `accept4`, the accept loop of a plain TCP listener
//! tries one `recv` ([`first_read`]). When the whole CONNECT is there (the
//! usual case in a reconnect storm, where the shard is behind) and names a
//! client identifier another shard owns, the socket, the decoded CONNECT
//! and the connection's limit slots go to that shard as an [`Arrival`];
//! nothing else is made here. Arrivals for one shard queued in one turn of
//! the accepting shard travel as one channel message
//! ([`crate::shard::Shard::queue_arrival`]): one wake-up of the owner per
//! turn, not per connection. The owner serves an arrival as a connection
//! it accepted itself whose CONNECT it has just read: the same limits,
//! sign-in, refusals and answers. A connection whose CONNECT is not
//! complete in that first read, or is malformed, or is not a CONNECT, is
//! served by the accepting shard as before, with the bytes already read
//! (a CONNECT decoded here goes with it too, so it is decoded once).
//!
//! A CONNECT with a password or a JWT to check stays too, and is handed
//! over after sign-in as before: its check waits in the accepting shard's
//! queue (`crate::signin`), whose eviction at the process-wide
//! `limits.max_connects_authenticating` relies on the kernel spreading a
//! flood over the shards. Handed to the owner at accept, a flood of wrong
//! passwords under one client identifier queued every check on one
//! shard, and a device of the other shard found no check there to evict
//! and was refused busy (e2e `floods::a_flood_of_wrong_passwords_...`).
//! Such sign-ins cost milliseconds of argon2, next to which the hand-over
//! after sign-in is small.
//!
//! The pending slot (`limits.max_pending_connections`) travels with the
//! arrival: the connection leaves the accepting shard's pending set and
//! joins the owner's as complete ([`crate::pending::PendingSet::adopt`]),
//! so the process-wide count never drops while it crosses.

use std::net::IpAddr;
use std::os::fd::{AsRawFd, IntoRawFd, OwnedFd};
use std::rc::Rc;
use std::time::Instant;

use bytes::BytesMut;
use fleetmq_core::packet::codec::decode;
use fleetmq_core::packet::{Connect, Packet};
use glommio::net::TcpStream;

use crate::auth::Credentials;
use crate::connection::{accepted, Admitted, ConnSettings};
use crate::limits::{ShardGate, Slot};
use crate::pending::PendingGuard;
use crate::shard::{owner_of, Shard};
use crate::transport::ListenerKind;

/// A plain TCP connection whose complete CONNECT the accepting shard read,
/// on its way to the shard that owns its client identifier.
pub(crate) struct Arrival {
    fd: OwnedFd,
    peer: IpAddr,
    connect: Box<Connect>,
    /// Bytes read after the CONNECT.
    unread: BytesMut,
    /// Its `max_connections_per_source` slot, if counted.
    source_slot: Option<Slot>,
    /// Its process-wide `max_pending_connections` slot.
    pending_slot: Option<Slot>,
}

/// A just-accepted plain TCP connection and what the accept loop took for
/// it: its socket, its peer's address and its limit slots.
pub(crate) struct Fresh {
    pub(crate) socket: socket2::Socket,
    pub(crate) peer: IpAddr,
    pub(crate) source_slot: Option<Slot>,
    pub(crate) pending: PendingGuard,
}

/// Read what has arrived of `fresh`'s CONNECT with one non-blocking `recv`
/// and, when it is a whole CONNECT whose client identifier shard `owner`
/// other than this one owns, queue it for that shard (`None`: handed
/// over). Otherwise the connection stays here, with what was read:
/// nothing (not there yet, or the socket's end or error, which its stream
/// sees again), some bytes, or the decoded CONNECT and the bytes after it;
/// its pending entry is told what was read (`PendingGuard::connect_read`,
/// `PendingGuard::complete`), as its task would have.
pub(crate) fn first_read(
    shard: &Shard,
    settings: &ConnSettings,
    fresh: Fresh,
) -> Option<(Fresh, FirstRead)> {
    let mut buf = BytesMut::new();
    {
        let mut scratch = shard.scratch.borrow_mut();
        // SAFETY: `scratch` is writable for its length; `socket` is open.
        let n = unsafe {
            libc::recv(
                fresh.socket.as_raw_fd(),
                scratch.as_mut_ptr().cast(),
                scratch.len(),
                libc::MSG_DONTWAIT,
            )
        };
        let Ok(n @ 1..) = usize::try_from(n) else {
            return Some((fresh, FirstRead::Bytes(buf)));
        };
        shard.metrics.bytes_in.inc_by(n as u64);
        buf.extend_from_slice(&scratch[..n]);
    }
    let whole = buf.clone();
    let connect = match decode(&mut buf, None, settings.max_connect_packet_bytes) {
        Ok(Some(Packet::Connect(connect))) => connect,
        // Incomplete, malformed or another packet: the stream's path
        // answers it, from the bytes read. Its progress is told now:
        // the bytes are out of the socket, where an eviction's
        // `FIONREAD` would have seen them (`crate::pending`), and its
        // task has not run yet.
        _ => {
            fresh.pending.connect_read(&whole, Instant::now());
            return Some((fresh, FirstRead::Bytes(whole)));
        }
    };
    // An empty client identifier gets one this shard owns (negotiate); a
    // password or JWT is checked here (see the module docs).
    let owner = (!connect.client_id.is_empty() && !verifies_secret(settings, &connect, fresh.peer))
        .then(|| owner_of(&connect.client_id, shard.shards));
    match owner {
        Some(owner) if owner != shard.id => {
            let Fresh {
                socket,
                peer,
                source_slot,
                pending,
            } = fresh;
            let arrival = Arrival {
                fd: OwnedFd::from(socket),
                peer,
                connect,
                unread: buf,
                source_slot,
                pending_slot: pending.hand_over(),
            };
            shard.queue_arrival(owner, arrival);
            shard.metrics.handed_over_at_accept.inc();
            None
        }
        _ => {
            // Complete: never evicted from here on (as above, its task
            // has not run yet).
            fresh.pending.complete(Instant::now());
            Some((fresh, FirstRead::Connect(connect, buf)))
        }
    }
}

/// Whether signing `connect` in from `peer` checks a password or a JWT.
fn verifies_secret(settings: &ConnSettings, connect: &Connect, peer: IpAddr) -> bool {
    settings.auth.verifies_secret(&Credentials {
        username: connect.username.as_deref(),
        password: connect.password.as_deref(),
        client_id: &connect.client_id,
        peer,
        tls_identity: None,
    })
}

/// Serve an [`Arrival`] another shard handed here, as a connection this
/// shard accepted and read the CONNECT of (see the module docs). A
/// stopping shard closes it unanswered.
pub(crate) fn arrived(
    shard: &Rc<Shard>,
    settings: &Rc<ConnSettings>,
    doors: &Rc<ShardGate>,
    arrival: Arrival,
) {
    if shard.stopping.get() {
        return;
    }
    let Arrival {
        fd,
        peer,
        connect,
        unread,
        source_slot,
        pending_slot,
    } = arrival;
    let pending = doors
        .pending
        .adopt(&settings.gate, pending_slot, Instant::now());
    // The stream's state is aside, as that of every connection
    // (crate::alloc).
    // SAFETY: the OwnedFd owned the descriptor alone and gives it up.
    let stream = crate::alloc::aside(|| unsafe {
        <TcpStream as std::os::fd::FromRawFd>::from_raw_fd(fd.into_raw_fd())
    });
    let admitted = Admitted {
        stream,
        peer,
        kind: ListenerKind::Tcp,
        source_slot,
        pending,
        first: FirstRead::Connect(connect, unread),
    };
    crate::alloc::spawn_aside(accepted(
        shard.clone(),
        settings.clone(),
        doors.clone(),
        admitted,
    ));
}

/// What was read of a connection before its task began (`crate::arrival`).
pub(crate) enum FirstRead {
    /// Bytes of its CONNECT (possibly none yet, or not a CONNECT at all).
    Bytes(BytesMut),
    /// Its whole CONNECT, decoded, and the bytes read after it.
    Connect(Box<Connect>, BytesMut),
}
