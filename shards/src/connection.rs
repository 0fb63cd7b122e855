//! A client connection: accept, CONNECT, hand-off to the owner shard, then
//! a reader (this task) and a writer task sharing the shard's
//! [`ConnShared`].

use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd};
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use fleetmq_core::packet::codec::{decode, encode, DecodeError};
use fleetmq_core::packet::{ConnAck, Connect, Packet, ProtocolVersion, ReasonCode};
use fleetmq_core::session::{negotiate, ConnectLimits, Negotiated, Refusal};
use futures_lite::future::or;
use futures_lite::io::{split, AsyncWriteExt, WriteHalf};
use glommio::net::TcpStream;
use glommio::timer::sleep;
use tracing::debug;

use crate::shard::{owner_of, ConnShared, Handoff, Shard, ShardMsg};

/// Settings a connection needs, derived once from the settings.
#[derive(Clone)]
pub(crate) struct ConnSettings {
    pub(crate) connect: ConnectLimits,
    pub(crate) max_connect_packet_bytes: usize,
    pub(crate) connect_timeout: Duration,
    pub(crate) max_clients: usize,
}

/// Above this capacity, an emptied read buffer is released rather than
/// kept, so a connection that once received a burst goes back to costing
/// nothing while idle.
const READ_BUFFER_KEEP: usize = 16 * 1024;

/// How long a closing connection may take to flush what is queued for it.
const CLOSE_FLUSH: Duration = Duration::from_secs(2);

enum ReadOutcome {
    Data(usize),
    Closed,
    TimedOut,
    Error,
}

/// Read what the socket has into `buf`, through the shard's scratch buffer.
///
/// glommio's non-buffered `poll_read` copies from the socket synchronously
/// (a non-blocking `recv`) or, when nothing is there, waits for readiness
/// without holding the caller's buffer. So one scratch buffer per shard
/// serves every connection, borrowed only inside each poll, and a waiting
/// connection holds no read buffer at all: only the bytes of an incomplete
/// packet stay with it (DESIGN.md §3: idle connections cost ≤ 1 KiB).
async fn read_some<R: futures_lite::AsyncRead + Unpin>(
    reader: &mut R,
    buf: &mut BytesMut,
    scratch: &std::cell::RefCell<Vec<u8>>,
) -> ReadOutcome {
    let result = std::future::poll_fn(|cx| {
        let mut scratch = scratch.borrow_mut();
        match std::pin::Pin::new(&mut *reader).poll_read(cx, &mut scratch[..]) {
            std::task::Poll::Ready(Ok(n)) => {
                buf.extend_from_slice(&scratch[..n]);
                std::task::Poll::Ready(Ok(n))
            }
            other => other,
        }
    })
    .await;
    match result {
        Ok(0) => ReadOutcome::Closed,
        Ok(n) => ReadOutcome::Data(n),
        Err(e) if e.kind() == std::io::ErrorKind::TimedOut => ReadOutcome::TimedOut,
        Err(_) => ReadOutcome::Error,
    }
}

/// Serve a freshly accepted socket: read its CONNECT within the connect
/// timeout, negotiate, then serve it here or hand it to the owner shard.
pub(crate) async fn accepted(shard: Rc<Shard>, settings: Rc<ConnSettings>, mut stream: TcpStream) {
    let _ = stream.set_nodelay(true);
    let mut buf = BytesMut::new();
    let max = settings.max_connect_packet_bytes;
    let deadline = sleep(settings.connect_timeout);
    let read_connect = async {
        loop {
            match decode(&mut buf, None, max) {
                Ok(Some(Packet::Connect(connect))) => return Ok(connect),
                Ok(Some(_)) => return Err(None),
                Ok(None) => {}
                Err(e) => return Err(Some(e)),
            }
            match read_some(&mut stream, &mut buf, &shard.scratch).await {
                ReadOutcome::Data(n) => {
                    shard.metrics.bytes_in.inc_by(n as u64);
                }
                _ => return Err(None),
            }
        }
    };
    let connect = match or(read_connect, async {
        deadline.await;
        Err(None)
    })
    .await
    {
        Ok(connect) => connect,
        Err(Some(DecodeError::UnsupportedProtocolVersion(level))) => {
            // [MQTT-3.1.2-2]: CONNACK return code 1 (0x84), then close.
            debug!(target: "broker", level, "unsupported protocol level");
            let mut out = BytesMut::new();
            let _ = encode(
                &Packet::ConnAck(ConnAck { reason: ReasonCode::UNSUPPORTED_PROTOCOL_VERSION, ..ConnAck::default() }),
                ProtocolVersion::V3_1_1,
                &mut out,
            );
            let _ = stream.write_all(&out).await;
            shard.metrics.connect_refused("unsupported_protocol_version");
            return;
        }
        Err(e) => {
            // Malformed CONNECT, another packet first [MQTT-3.1.0-1],
            // timeout or EOF: close without CONNACK.
            debug!(target: "broker", error = ?e, "connection closed before CONNECT completed");
            shard.metrics.connect_refused(if e.is_some() { "malformed_connect" } else { "no_connect" });
            return;
        }
    };
    if shard.global.connected.load(Ordering::Relaxed) >= settings.max_clients {
        refuse(&shard, &mut stream, &connect, Refusal { reason: ReasonCode::SERVER_BUSY, detail: "too many clients" }).await;
        shard.metrics.connect_refused("max_clients");
        return;
    }
    let negotiated = match negotiate(&connect, &settings.connect, || shard.assign_client_id()) {
        Ok(n) => n,
        Err(refusal) => {
            shard.metrics.connect_refused("refused");
            refuse(&shard, &mut stream, &connect, refusal).await;
            return;
        }
    };
    let owner = owner_of(&negotiated.client_id, shard.shards);
    if owner != shard.id {
        // Hand the socket to the shard that owns the client identifier.
        // SAFETY: dup returns a new descriptor we own (or -1, checked);
        // dropping `stream` then closes only the original one.
        let fd = unsafe { libc::dup(stream.as_raw_fd()) };
        if fd < 0 {
            return;
        }
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        drop(stream);
        let handoff = Handoff { fd, unread: buf.freeze(), connect, negotiated };
        shard.send_to(owner, ShardMsg::Handoff(Box::new(handoff))).await;
        return;
    }
    serve(shard, settings, stream, connect, negotiated, buf.freeze()).await;
}

/// Take a connection handed over by another shard.
pub(crate) async fn handed_over(shard: Rc<Shard>, settings: Rc<ConnSettings>, handoff: Handoff) {
    // SAFETY: the descriptor came from `dup` on the accepting shard and is
    // owned by the hand-off alone.
    let stream = unsafe { TcpStream::from_raw_fd(handoff.fd.into_raw_fd()) };
    serve(shard, settings, stream, handoff.connect, handoff.negotiated, handoff.unread).await;
}

async fn refuse(shard: &Shard, stream: &mut TcpStream, connect: &Connect, refusal: Refusal) {
    debug!(target: "broker", reason = ?refusal.reason, detail = refusal.detail, "CONNECT refused");
    let mut out = BytesMut::new();
    let _ = encode(&Packet::ConnAck(refusal.connack(connect.protocol)), connect.protocol, &mut out);
    shard.metrics.bytes_out.inc_by(out.len() as u64);
    let _ = stream.write_all(&out).await;
}

async fn serve(
    shard: Rc<Shard>,
    settings: Rc<ConnSettings>,
    stream: TcpStream,
    connect: Box<Connect>,
    negotiated: Negotiated,
    unread: Bytes,
) {
    let protocol = connect.protocol;
    let key = shard.global.next_conn_key.fetch_add(1, Ordering::Relaxed);
    let conn = Rc::new(ConnShared::new(key, protocol));
    if negotiated.keep_alive > 0 {
        // [MQTT-3.1.2-22]: one and a half times the Keep Alive.
        let _ = stream.set_read_timeout(Some(Duration::from_millis(u64::from(negotiated.keep_alive) * 1500)));
    }
    let slot = shard.attach(&connect, &negotiated, &conn, Instant::now());
    drop(connect);
    shard.live_connections.set(shard.live_connections.get() + 1);
    shard.metrics.clients_connected.inc();
    shard.flush().await;

    let (mut reader, writer) = split(stream);
    let writer_task = glommio::spawn_local(write_loop(shard.clone(), conn.clone(), writer));
    let mut buf = BytesMut::from(&unread[..]);
    drop(unread);
    let max_packet = settings.connect.max_packet_size;
    let publish_will = 'conn: loop {
        loop {
            if let Some(close) = conn.close.get() {
                break 'conn close.publish_will;
            }
            match decode(&mut buf, Some(protocol), max_packet) {
                Ok(Some(packet)) => {
                    if let Some(close) = shard.handle_packet(slot, &conn, packet, Instant::now()) {
                        break 'conn close.publish_will;
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    // Malformed: MQTT 5 gets DISCONNECT 0x81/0x82/0x95;
                    // 3.1.1 a closed connection (MQTT 5 §4.13).
                    debug!(target: "broker", error = %e, "malformed packet");
                    conn.request_close(Some(e.reason_code()), true);
                    break 'conn true;
                }
            }
        }
        shard.flush().await;
        if let Some(close) = conn.close.get() {
            break close.publish_will;
        }
        if buf.is_empty() && buf.capacity() > READ_BUFFER_KEEP {
            buf = BytesMut::new();
        }
        let read = or(async { Some(read_some(&mut reader, &mut buf, &shard.scratch).await) }, async {
            conn.close_signal.wait().await;
            None
        })
        .await;
        match read {
            Some(ReadOutcome::Data(n)) => {
                shard.metrics.bytes_in.inc_by(n as u64);
            }
            Some(ReadOutcome::TimedOut) => {
                debug!(target: "broker", "keep alive timeout");
                conn.request_close(Some(ReasonCode::KEEP_ALIVE_TIMEOUT), true);
                break true;
            }
            Some(ReadOutcome::Closed) | Some(ReadOutcome::Error) => {
                // Closed without DISCONNECT: the will is published
                // `[MQTT-3.1.2-8]`.
                conn.request_close(None, true);
                break true;
            }
            None => {
                let close = conn.close.get().expect("close signal follows a close request");
                break close.publish_will;
            }
        }
    };
    shard.detach(slot, &conn, publish_will, Instant::now());
    shard.flush().await;
    conn.write_signal.notify();
    let _ = or(async { Some(writer_task.await) }, async {
        sleep(CLOSE_FLUSH).await;
        None
    })
    .await;
    shard.live_connections.set(shard.live_connections.get() - 1);
    shard.metrics.clients_connected.dec();
}

/// Write what the shard queued for the connection, one write per wake-up.
async fn write_loop(shard: Rc<Shard>, conn: Rc<ConnShared>, mut writer: WriteHalf<TcpStream>) {
    loop {
        conn.write_signal.wait().await;
        let chunk = {
            let mut out = conn.out.borrow_mut();
            let chunk = out.split();
            if out.capacity() > READ_BUFFER_KEEP {
                *out = BytesMut::new();
            }
            chunk
        };
        conn.pending.set(0);
        if !chunk.is_empty() {
            if writer.write_all(&chunk).await.is_err() {
                conn.request_close(None, true);
                break;
            }
            shard.metrics.bytes_out.inc_by(chunk.len() as u64);
        }
        if conn.is_closing() && conn.out.borrow().is_empty() {
            break;
        }
    }
    let _ = writer.close().await;
}
