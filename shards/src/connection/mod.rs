//! A client connection: accept, limits, TLS/WebSocket handshakes, CONNECT,
//! sign-in, hand-off to the owner shard, then one task that reads and
//! writes the connection, sharing the shard's [`ConnShared`] (the task: [`task`]).

use std::net::IpAddr;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd};
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use bytes::Buf;
use bytes::{Bytes, BytesMut};
use fleetmq_core::packet::codec::{connect_protocol_level, decode, encode, DecodeError};
use fleetmq_core::packet::{ConnAck, Connect, Packet, ProtocolVersion, ReasonCode};
use fleetmq_core::session::{negotiate, AuthorizeCache, ConnectLimits, Negotiated, Refusal};
use futures_lite::future::or;
use futures_lite::io::AsyncWriteExt;
use futures_lite::AsyncWrite;
use glommio::net::{TcpStream, UnixStream};
use glommio::timer::sleep;
use std::pin::Pin;
use std::task::{Context, Poll};
use tracing::debug;

use crate::arrival::FirstRead;
use crate::access::AclAuthorizer;
use crate::auth::{AuthError, Authenticator, Credentials, Identity};
use crate::closing::{self, Linger, REFUSED_IDLE};
use crate::limits::{Gate, ShardGate, Slot as LimitSlot};
use crate::metrics::RefuseReason;
use crate::park::Parked;
use crate::pending::PendingGuard;
use crate::signin::{SignInQueue, TURN_WAIT_MAX};
use crate::shard::{
    owner_of, AttachError, ConnShared, Feeding, Handoff, HandoffStream, Mover, Route, Shard, ShardMsg,
};
use crate::tls::TlsConfig;
use crate::transport::{self, bridge, ListenerKind, Transport};

mod task;
use task::{drive, serve};

/// What connections need from the settings, derived once.
#[derive(Clone)]
pub(crate) struct ConnSettings {
    pub(crate) connect: ConnectLimits,
    pub(crate) max_connect_packet_bytes: usize,
    pub(crate) connect_timeout: Duration,
    pub(crate) max_clients: usize,
    pub(crate) auth: Arc<Authenticator>,
    pub(crate) tls: Option<Arc<TlsConfig>>,
    pub(crate) gate: Arc<Gate>,
    pub(crate) acl_cache: AuthorizeCache,
    /// The replica's cluster, `None` on a single node.
    pub(crate) cluster: Option<Arc<crate::cluster::Node>>,
}

/// A signed-in client: who it is and the limit slots it holds until it
/// disconnects.
pub(crate) struct Admission {
    pub(crate) identity: Identity,
    /// Held, not read: dropping them gives the limit slots back.
    #[allow(dead_code)]
    pub(crate) slots: Vec<LimitSlot>,
    /// The cluster claim on the client identifier (cluster mode), given
    /// up when the connection ends. Boxed: a parked connection keeps its
    /// admission, and on a single node this is always `None` (8 bytes).
    pub(crate) claim: Option<Box<crate::cluster::Claim>>,
}

/// Above this capacity, an emptied buffer is released rather than kept, so
/// a connection that once received a burst costs nothing while idle.
const BUFFER_KEEP: usize = 16 * 1024;

/// How long a closing connection may take to flush what is queued for it.
const CLOSE_FLUSH: Duration = Duration::from_secs(2);

enum ReadOutcome {
    Data(usize),
    Closed,
}

/// Read what the stream has into `buf`, through the shard's scratch buffer.
///
/// glommio's non-buffered `poll_read` copies from the socket synchronously
/// (a non-blocking `recv`) or, when nothing is there, waits for readiness
/// without holding the caller's buffer; TLS and WebSocket streams copy out
/// of their own buffers. So one scratch buffer per shard serves every
/// connection, borrowed only inside each poll, and a waiting connection
/// holds no read buffer: only the bytes of an incomplete packet stay with
/// it (DESIGN.md §3: idle connections should cost ≤ 1 KiB).
async fn read_some<R: futures_lite::AsyncRead + Unpin>(
    reader: &mut R,
    buf: &mut BytesMut,
    scratch: &std::cell::RefCell<Vec<u8>>,
) -> ReadOutcome {
    std::future::poll_fn(|cx| poll_read_some(cx, reader, buf, scratch)).await
}

/// Poll form of [`read_some`]: `Ready` with what one read gave.
fn poll_read_some<R: futures_lite::AsyncRead + Unpin>(
    cx: &mut Context<'_>,
    reader: &mut R,
    buf: &mut BytesMut,
    scratch: &std::cell::RefCell<Vec<u8>>,
) -> Poll<ReadOutcome> {
    let mut scratch = scratch.borrow_mut();
    // glommio's poll of this socket lives while the connection waits to
    // read and goes when it parks: made aside (crate::alloc).
    let read = crate::alloc::aside(|| Pin::new(&mut *reader).poll_read(cx, &mut scratch[..]));
    match read {
        Poll::Ready(Ok(n)) if n > 0 => {
            buf.extend_from_slice(&scratch[..n]);
            Poll::Ready(ReadOutcome::Data(n))
        }
        Poll::Ready(_) => Poll::Ready(ReadOutcome::Closed),
        Poll::Pending => Poll::Pending,
    }
}

/// Why a connection ended before its CONNECT was accepted.
enum Early {
    Handshake(String),
    /// The CONNECT's fixed header announced `size` bytes, more than
    /// `max_connect_packet_bytes`, of which `buffered` were read; `v5`: its
    /// protocol level is 5.
    TooLarge { size: usize, buffered: usize, v5: bool },
    Decode(DecodeError),
    /// A CONNECT of protocol level 5 that does not decode: it is answered
    /// with a CONNACK holding the error's reason code.
    MalformedV5(DecodeError),
    NotConnect,
    Closed,
}

async fn open_and_read_connect(
    shard: &Shard,
    settings: &ConnSettings,
    pending: &PendingGuard,
    kind: ListenerKind,
    stream: TcpStream,
    first: BytesMut,
) -> Result<(Transport, Option<String>, Box<Connect>, BytesMut), (Option<Transport>, Early)> {
    if kind != ListenerKind::Tcp {
        // A handshake's first byte, left for the handshake to read: until
        // it comes the connection is silent, the first to give way
        // (`crate::pending`).
        let _ = stream.peek(&mut [0u8; 1]).await;
        pending.handshaking(Instant::now());
    }
    let (mut transport, tls_identity) = transport::open(kind, stream, settings.tls.as_deref())
        .await
        .map_err(|e| (None, Early::Handshake(e)))?;
    // What the accept loop read already (plain TCP only: `crate::arrival`).
    let mut buf = first;
    if kind != ListenerKind::Tcp || !buf.is_empty() {
        pending.connect_read(&buf, Instant::now());
    }
    loop {
        // Read before `decode`, which takes the packet out of `buf`.
        let v5 = buf.first().is_some_and(|b| b >> 4 == 1) && connect_protocol_level(&buf) == Some(5);
        match decode(&mut buf, None, settings.max_connect_packet_bytes) {
            Ok(Some(Packet::Connect(connect))) => {
                pending.complete(Instant::now());
                return Ok((transport, tls_identity, connect, buf))
            }
            Ok(Some(_)) => return Err((Some(transport), Early::NotConnect)),
            Ok(None) => {}
            Err(DecodeError::TooLarge { size, .. }) => {
                // The fixed header alone may have come: read on to the
                // protocol level (at most 14 bytes in), which says whether
                // the refusal can be a CONNACK 0x95.
                // A client that sends no more within REFUSED_IDLE is not
                // waited for.
                while connect_protocol_level(&buf).is_none() && buf.len() < 16 {
                    let read = or(
                        async { Some(read_some(&mut transport, &mut buf, &shard.scratch).await) },
                        async {
                            sleep(REFUSED_IDLE).await;
                            None
                        },
                    )
                    .await;
                    match read {
                        Some(ReadOutcome::Data(n)) => {
                            shard.metrics.bytes_in.inc_by(n as u64);
                        }
                        Some(ReadOutcome::Closed) | None => break,
                    }
                }
                let v5 = connect_protocol_level(&buf) == Some(5);
                return Err((Some(transport), Early::TooLarge { size, buffered: buf.len(), v5 }));
            }
            Err(e) => {
                let early = match e {
                    DecodeError::UnsupportedProtocolVersion(_) => Early::Decode(e),
                    e if v5 => Early::MalformedV5(e),
                    e => Early::Decode(e),
                };
                return Err((Some(transport), early));
            }
        }
        match read_some(&mut transport, &mut buf, &shard.scratch).await {
            ReadOutcome::Data(n) => {
                shard.metrics.bytes_in.inc_by(n as u64);
                pending.connect_read(&buf, Instant::now());
            }
            ReadOutcome::Closed => return Err((Some(transport), Early::Closed)),
        }
    }
}

/// Answer a refused MQTT 5 CONNECT with a CONNACK holding `reason` (none
/// for 3.1.x, which has no code for it), then end the connection reading
/// the `expected` rest of it (see [`crate::closing`]).
async fn refuse_connect(shard: &Shard, transport: &mut Transport, reason: Option<ReasonCode>, expected: usize) {
    if let Some(reason) = reason {
        let connack = ConnAck {
            reason,
            ..ConnAck::default()
        };
        write_packet(shard, transport, &Packet::ConnAck(connack), ProtocolVersion::V5).await;
    }
    closing::close(transport, Linger::refused(expected)).await;
}

/// Count a refusal for `reason` and log it (at most every 10 s per reason).
pub(crate) fn refused(shard: &Shard, settings: &ConnSettings, reason: RefuseReason) {
    shard.metrics.connect_refused(reason);
    settings.gate.log_refusal(reason.as_str());
}

/// A freshly accepted socket of a `kind` listener, from `peer`, and the
/// slots the accept loop took for it before anything was read
/// (`crate::acceptor`; DESIGN.md §9): its source address's, if counted,
/// and its pending one.
pub(crate) struct Admitted {
    pub(crate) stream: TcpStream,
    pub(crate) peer: IpAddr,
    pub(crate) kind: ListenerKind,
    pub(crate) source_slot: Option<LimitSlot>,
    pub(crate) pending: PendingGuard,
    /// What the accept loop read of it already.
    pub(crate) first: FirstRead,
}

/// Serve an [`Admitted`] connection (`TCP_NODELAY` already set:
/// `crate::acceptor`): the TLS / WebSocket handshake and a complete
/// CONNECT within `connect_timeout`, sign-in, then serve it here or hand it
/// to the shard that owns its client identifier.
pub(crate) async fn accepted(
    shard: Rc<Shard>,
    settings: Rc<ConnSettings>,
    doors: Rc<ShardGate>,
    admitted: Admitted,
) {
    let Admitted { stream, peer, kind, source_slot, pending, first } = admitted;
    let opened = match first {
        FirstRead::Connect(connect, rest) => {
            pending.complete(Instant::now());
            Some(Ok((Transport::Tcp(stream), None, connect, rest)))
        }
        FirstRead::Bytes(first) => {
            or(
                async { Some(open_and_read_connect(&shard, &settings, &pending, kind, stream, first).await) },
                async {
                    or(pending.connect_deadline(settings.connect_timeout), pending.evicted()).await;
                    None
                },
            )
            .await
        }
    };
    let connect_at = Instant::now();
    let (mut transport, tls_identity, connect, buf) = match opened {
        Some(Ok(opened)) => opened,
        Some(Err((
            Some(mut transport),
            Early::Decode(DecodeError::UnsupportedProtocolVersion(level)),
        ))) => {
            // [MQTT-3.1.2-2]: CONNACK return code 1 (0x84), then close.
            debug!(target: "broker", level, "unsupported protocol name or level");
            let connack = ConnAck {
                reason: ReasonCode::UNSUPPORTED_PROTOCOL_VERSION,
                ..ConnAck::default()
            };
            write_packet(
                &shard,
                &mut transport,
                &Packet::ConnAck(connack),
                ProtocolVersion::V3_1_1,
            )
            .await;
            Box::pin(closing::close(&mut transport, Linger::refused(0))).await;
            return refused(&shard, &settings, RefuseReason::UnsupportedProtocolVersion);
        }
        Some(Err((Some(mut transport), Early::TooLarge { size, buffered, v5 }))) => {
            // MQTT 5 has a reason code for it (§3.2.2.2, 0x95 Packet too
            // large); MQTT 3.1.1 has none: the connection is only closed.
            let reason = v5.then_some(ReasonCode::PACKET_TOO_LARGE);
            Box::pin(refuse_connect(&shard, &mut transport, reason, size.saturating_sub(buffered))).await;
            return refused(&shard, &settings, RefuseReason::MaxConnectPacketBytes);
        }
        Some(Err((Some(mut transport), Early::MalformedV5(e)))) => {
            // MQTT 5 §4.13.1: an error in a CONNECT may be answered with a
            // CONNACK holding its reason code (0x81 Malformed Packet, 0x82
            // Protocol Error) before the close [MQTT-3.1.4-1]. The rest of
            // the packet is read first, so that the close does not reset
            // the connection under the CONNACK.
            debug!(target: "broker", error = %e, "malformed MQTT 5 CONNECT");
            let expected = settings.max_connect_packet_bytes;
            Box::pin(refuse_connect(&shard, &mut transport, Some(e.reason_code()), expected)).await;
            return refused(&shard, &settings, RefuseReason::MalformedConnect);
        }
        Some(Err((_, early))) => {
            // A failed handshake, a malformed 3.1.x CONNECT, another packet
            // first [MQTT-3.1.0-1], or EOF: close without CONNACK.
            let reason = match early {
                Early::Handshake(e) => {
                    debug!(target: "broker", error = %e, "handshake failed");
                    RefuseReason::HandshakeFailed
                }
                Early::TooLarge { .. } => RefuseReason::MaxConnectPacketBytes,
                Early::Decode(_) | Early::MalformedV5(_) | Early::NotConnect => RefuseReason::MalformedConnect,
                Early::Closed => RefuseReason::ClosedBeforeConnect,
            };
            return refused(&shard, &settings, reason);
        }
        None if pending.was_evicted() => return refused(&shard, &settings, RefuseReason::PendingEvicted),
        None => return refused(&shard, &settings, RefuseReason::ConnectTimeout),
    };
    let refuse_with = |reason: ReasonCode, detail: &'static str| Refusal { reason, detail };
    if shard.global.connected.load(Ordering::Relaxed) >= settings.max_clients {
        Box::pin(refuse(
            &shard,
            &mut transport,
            &connect,
            refuse_with(ReasonCode::SERVER_BUSY, "too many clients"),
        ))
        .await;
        return refused(&shard, &settings, RefuseReason::MaxClients);
    }
    // Boxed, like the other rare or large steps below: this task's state is
    // held by every connection until its CONNECT is answered.
    let identity = match Box::pin(sign_in(&settings, &doors.sign_in, &connect, peer, tls_identity)).await {
        Ok(identity) => identity,
        Err((reason, why)) => {
            Box::pin(refuse(
                &shard,
                &mut transport,
                &connect,
                refuse_with(reason, why.as_str()),
            ))
            .await;
            return refused(&shard, &settings, why);
        }
    };
    let mut slots: Vec<LimitSlot> = source_slot.into_iter().collect();
    if let Some(user) = &identity.username {
        match settings.gate.credential(user) {
            Some(slot) => slots.push(slot),
            None => {
                let refusal = refuse_with(
                    ReasonCode::QUOTA_EXCEEDED,
                    "too many connections for this user",
                );
                Box::pin(refuse(&shard, &mut transport, &connect, refusal)).await;
                return refused(&shard, &settings, RefuseReason::MaxConnectionsPerCredential);
            }
        }
    }
    let negotiated = match negotiate(&connect, &settings.connect, || shard.assign_client_id()) {
        Ok(n) => n,
        Err(refusal) => {
            Box::pin(refuse(&shard, &mut transport, &connect, refusal)).await;
            return refused(&shard, &settings, RefuseReason::ConnectRefused);
        }
    };
    if let Some(will) = &connect.will {
        // A will is a publish the broker makes for the client: the rules of
        // the client's own PUBLISH, checked before anything is claimed or
        // stored (MQTT 5 CONNACK 0x87, 3.1.1 return code 5).
        let acl = AclAuthorizer::for_client(&settings.auth, &identity, &negotiated.client_id);
        if !fleetmq_core::session::client_may_publish(acl.as_deref(), &will.topic) {
            let refusal = refuse_with(ReasonCode::NOT_AUTHORIZED, "the Will Topic may not be published to");
            Box::pin(refuse(&shard, &mut transport, &connect, refusal)).await;
            return refused(&shard, &settings, RefuseReason::NotAuthorized);
        }
    }
    // The CONNECT is complete and signed in: from here the connection is
    // bounded by its credential's and source's slots and by
    // `cluster.connect_budget`, not by `max_pending_connections`. Held
    // through the cluster claim, a storm of signed-in CONNECTs waiting on
    // JetStream filled the pending limit, and the connections behind them
    // were refused or evicted (perf/RESULTS.md, issue 23).
    drop(pending);
    let claim = match &settings.cluster {
        Some(node) => match Box::pin(node.admit(&negotiated.client_id, connect_at, &connect, negotiated.session_expiry, &identity)).await {
            Ok(claim) => Some(Box::new(claim)),
            Err((reason, why)) => {
                debug!(target: "cluster", client_id = %negotiated.client_id, why, "cluster: CONNECT refused");
                let refusal = refuse_with(ReasonCode::SERVER_UNAVAILABLE, why);
                Box::pin(refuse(&shard, &mut transport, &connect, refusal)).await;
                return refused(&shard, &settings, reason);
            }
        },
        None => None,
    };
    let admission = Admission { identity, slots, claim };
    let owner = owner_of(&negotiated.client_id, shard.shards);
    let handoff = Connecting {
        transport,
        unread: buf.freeze(),
        connect,
        negotiated,
        admission,
    };
    if owner == shard.id {
        // A task of its own, so this task's state (sized for the
        // handshakes) is freed now rather than held for the connection's life.
        // Aside, as every connection task (crate::alloc): it ends when the
        // connection parks.
        crate::alloc::spawn_aside(serve(shard, settings, handoff, None));
        return;
    }
    shard.metrics.handed_over_at_sign_in.inc();
    Box::pin(hand_off(&shard, owner, Route::Fresh, handoff)).await;
}

/// A signed-in connection on its way to its session: what a [`Handoff`]
/// carries, with the transport still open.
struct Connecting {
    transport: Transport,
    /// Bytes read after the CONNECT.
    unread: Bytes,
    connect: Box<Connect>,
    negotiated: Negotiated,
    admission: Admission,
}

/// Hand `connecting` to shard `peer`: a TCP socket or a local socket (a
/// TLS or WebSocket connection handed over before) itself; a TLS or
/// WebSocket connection accepted here through a local socket pair whose
/// other end stays here, bridged to the client. Sent in order with this
/// shard's other messages for `peer` (see `shard::placement`).
async fn hand_off(shard: &Rc<Shard>, peer: usize, route: Route, connecting: Connecting) {
    let Connecting {
        transport,
        unread,
        connect,
        negotiated,
        admission,
    } = connecting;
    let stream = match transport {
        Transport::Tcp(stream) => dup(&stream).map(HandoffStream::Tcp),
        outer => match std::os::unix::net::UnixStream::pair() {
            Ok((near, far)) => {
                // SAFETY: into_raw_fd hands over a descriptor only we own.
                let near = unsafe { UnixStream::from_raw_fd(near.into_raw_fd()) };
                // The shard's stop waits for its bridges too
                // (`live_connections`): what the owner shard writes last
                // (a DISCONNECT 0x8B) still crosses them.
                shard.live_connections.set(shard.live_connections.get() + 1);
                let bridging = shard.clone();
                glommio::spawn_local(async move {
                    bridge(outer, near).await;
                    bridging.live_connections.set(bridging.live_connections.get() - 1);
                })
                .detach();
                Some(HandoffStream::Unix(OwnedFd::from(far)))
            }
            Err(_) => None,
        },
    };
    let Some(stream) = stream else { return };
    let handoff = Handoff {
        stream,
        unread,
        connect,
        negotiated,
        admission,
        route,
    };
    // Made here, freed on `peer`: aside, so a burst of hand-offs leaves no
    // page of this shard's main heap behind (crate::alloc).
    let boxed = crate::alloc::aside(|| Box::new(handoff));
    shard.send_ordered(peer, ShardMsg::Handoff(boxed)).await;
}

/// A new descriptor for the socket behind `stream`; dropping `stream`
/// then closes only its own.
fn dup<S: AsRawFd>(stream: &S) -> Option<OwnedFd> {
    // SAFETY: dup returns a fresh descriptor (checked for -1) that only the
    // OwnedFd owns.
    let fd = unsafe { libc::dup(stream.as_raw_fd()) };
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Check the CONNECT's credentials (DESIGN.md §9): the failed sign-in
/// guard decides on the shard (cheap), and a password or JWT is checked
/// off the shard thread: argon2 takes milliseconds, which would stall
/// every connection here. Such a check first waits for its turn in the
/// shard's `queue` (`crate::signin`, `max_connects_authenticating`); the
/// cheap ones run at once.
async fn sign_in(
    settings: &ConnSettings,
    queue: &Rc<SignInQueue>,
    connect: &Connect,
    peer: IpAddr,
    tls_identity: Option<String>,
) -> Result<Identity, (ReasonCode, RefuseReason)> {
    let creds = Credentials {
        username: connect.username.as_deref(),
        password: connect.password.as_deref(),
        client_id: &connect.client_id,
        peer,
        tls_identity: tls_identity.as_deref(),
    };
    let auth = &settings.auth;
    let result = match auth.admit(&creds, SystemTime::now()) {
        Ok(admitted) if !admitted.is_costly() => auth.check_admitted(&creds, admitted, SystemTime::now()),
        Ok(admitted) => {
            let user = connect.username.as_deref();
            let turn = queue.turn(&settings.gate, peer, user, admitted.is_known_device());
            let Some(_turn) = or(turn, async {
                sleep(TURN_WAIT_MAX).await;
                None
            })
            .await
            else {
                auth.abandon(admitted, SystemTime::now());
                return Err((ReasonCode::SERVER_BUSY, RefuseReason::MaxConnectsAuthenticating));
            };
            let auth = auth.clone();
            let username = connect.username.as_ref().map(|u| u.to_string());
            let password = connect.password.clone();
            let client_id = connect.client_id.to_string();
            let check = move || {
                let creds = Credentials {
                    username: username.as_deref(),
                    password: password.as_deref(),
                    client_id: &client_id,
                    peer,
                    tls_identity: tls_identity.as_deref(),
                };
                auth.check_admitted(&creds, admitted, SystemTime::now())
            };
            glommio::executor().spawn_blocking(check).await
        }
        Err(e) => Err(e),
    };
    result.map_err(|e| match e {
        AuthError::BadCredentials => (ReasonCode::BAD_USER_NAME_OR_PASSWORD, RefuseReason::BadCredentials),
        AuthError::Throttled => (ReasonCode::NOT_AUTHORIZED, RefuseReason::AuthThrottled),
        AuthError::Busy => (ReasonCode::SERVER_BUSY, RefuseReason::AuthCheckRatePerCredential),
        _ => (ReasonCode::NOT_AUTHORIZED, RefuseReason::NotAuthorized),
    })
}

/// Serve a parked connection again: it became readable, or the shard has
/// something for it (see [`crate::park`]).
/// `buf` holds bytes already read (empty for a parked connection).
pub(crate) fn resume(shard: Rc<Shard>, settings: Rc<ConnSettings>, parked: Parked, buf: BytesMut) {
    shard.metrics.connections_parked.dec();
    respawn(shard, settings, parked, buf);
}

/// A new task for the connection in `parked`.
fn respawn(shard: Rc<Shard>, settings: Rc<ConnSettings>, parked: Parked, buf: BytesMut) {
    let transport = Transport::Tcp(tcp_stream(parked.fd));
    crate::alloc::spawn_aside(drive(
        shard,
        settings,
        transport,
        parked.conn,
        parked.slot,
        parked.admission,
        buf,
        true,
    ));
}

/// Take a connection handed over by another shard.
pub(crate) async fn handed_over(shard: Rc<Shard>, settings: Rc<ConnSettings>, handoff: Handoff) {
    let transport = match handoff.stream {
        HandoffStream::Tcp(fd) => Transport::Tcp(tcp_stream(fd)),
        // SAFETY: the OwnedFd owned the descriptor alone and gives it up.
        HandoffStream::Unix(fd) => Transport::Unix(unsafe { UnixStream::from_raw_fd(fd.into_raw_fd()) }),
    };
    let via = match handoff.route {
        Route::ViaHome(generation) => Some(generation),
        Route::Fresh | Route::NotHere(_) => None,
    };
    let connecting = Connecting {
        transport,
        unread: handoff.unread,
        connect: handoff.connect,
        negotiated: handoff.negotiated,
        admission: handoff.admission,
    };
    serve(shard, settings, connecting, via).await;
}

/// Serve a connection moved here with its session by another shard (see
/// `shard::placement`): `moved` is what [`Shard::move_in`] returned.
pub(crate) fn moved_in(
    shard: Rc<Shard>,
    settings: Rc<ConnSettings>,
    moved: (Rc<ConnShared>, crate::shard::Slot, OwnedFd, Bytes, Admission),
) {
    let (conn, slot, fd, unread, admission) = moved;
    spawn_attached(shard, settings, Transport::Tcp(tcp_stream(fd)), conn, slot, admission, &unread);
}

/// A glommio stream for the TCP socket `fd` (one that parked, was handed
/// over or moved here), made aside with the poll of its socket that comes
/// with it: both live while the connection is awake (crate::alloc).
fn tcp_stream(fd: OwnedFd) -> TcpStream {
    // SAFETY: the OwnedFd owned the descriptor alone and gives it up.
    crate::alloc::aside(|| unsafe { TcpStream::from_raw_fd(fd.into_raw_fd()) })
}

/// Serve a connection just attached to its session (or moved here with it)
/// in a task of its own; `unread`: bytes read past its last packet.
fn spawn_attached(
    shard: Rc<Shard>,
    settings: Rc<ConnSettings>,
    transport: Transport,
    conn: Rc<ConnShared>,
    slot: crate::shard::Slot,
    admission: Admission,
    unread: &[u8],
) {
    let buf = BytesMut::from(unread);
    crate::alloc::spawn_aside(drive(shard, settings, transport, conn, slot, admission, buf, false));
}

async fn write_packet(
    shard: &Shard,
    transport: &mut Transport,
    packet: &Packet,
    protocol: ProtocolVersion,
) {
    let mut out = BytesMut::new();
    let _ = encode(packet, protocol, &mut out);
    shard.metrics.bytes_out.inc_by(out.len() as u64);
    let _ = transport.write_all(&out).await;
    let _ = transport.flush().await;
}

async fn refuse(shard: &Shard, transport: &mut Transport, connect: &Connect, refusal: Refusal) {
    debug!(target: "broker", reason = ?refusal.reason, detail = refusal.detail, "CONNECT refused");
    if !connect.protocol.is_v5() && refusal.reason == ReasonCode::TOPIC_NAME_INVALID {
        // 3.1.1 has no return code for a bad Will Topic: it is a protocol
        // violation, and the connection is closed without CONNACK
        // `[MQTT-3.1.3-11]`, 3.1.1 §4.8.
        return;
    }
    write_packet(
        shard,
        transport,
        &Packet::ConnAck(refusal.connack(connect.protocol)),
        connect.protocol,
    )
    .await;
    closing::close(transport, Linger::refused(0)).await;
}

