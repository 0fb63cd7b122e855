//! Links other replicas dialed to this one: the accept loop of a shard's
//! mesh listener, the checks (certificate, Hello, version) and the
//! delivery of what arrives to this replica's subscribers.

use std::net::SocketAddr;
use std::os::fd::{FromRawFd, IntoRawFd, OwnedFd};
use std::cell::Cell;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use fleetmq_core::mesh::{self, Accepted, Frame, Refusal};
use futures_lite::future::or;
use futures_lite::{AsyncReadExt, AsyncWriteExt};
use glommio::net::{TcpListener, TcpStream};
use glommio::timer::sleep;
use tracing::{debug, warn};

use super::outgoing::read_frame;
use super::{Mesh, ReceivedRef, RefusedFor, KEEPALIVE_DEAD};
use crate::shard::Shard;

/// How long a route announce may take to be applied on every shard
/// before it goes unanswered (the announcing SUBACK waits as long).
const ANNOUNCE_APPLY_WAIT: Duration = crate::shard::ROUTE_WAIT;

/// How long a dialer has for the TLS handshake and its Hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// TLS handshakes (with their Hello) in progress on one listener shard at
/// most; a connection past it is closed at once and counted
/// `reason="busy"`, so a flood of silent connections holds at most this
/// many handshakes' memory for [`HELLO_TIMEOUT`] each.
pub(crate) const HANDSHAKES_MAX: usize = 64;

/// Counts a handshake in progress while it lives.
struct InProgress(Rc<Cell<usize>>);

impl Drop for InProgress {
    fn drop(&mut self) {
        self.0.set(self.0.get() - 1);
    }
}

/// Accept mesh links on this shard's listener until the shard stops.
pub(crate) fn spawn_acceptor(shard: &Rc<Shard>, mesh: &Arc<Mesh>, fd: OwnedFd) {
    // SAFETY: a listening socket we own; the listener owns it now.
    let listener = unsafe { TcpListener::from_raw_fd(fd.into_raw_fd()) };
    let (shard, mesh) = (shard.clone(), mesh.clone());
    let handshakes = Rc::new(Cell::new(0usize));
    glommio::spawn_local(async move {
        loop {
            let accepted = or(async { Some(listener.accept().await) }, async {
                shard.stop_signal.wait().await;
                None
            })
            .await;
            match accepted {
                None => break,
                Some(Ok(stream)) => {
                    let peer = stream.peer_addr().ok();
                    if handshakes.get() >= HANDSHAKES_MAX {
                        mesh.stats.refused(RefusedFor::Busy);
                        let ip = peer.map(|p| p.ip().to_string()).unwrap_or_default();
                        if mesh.log_due(format!("busy {ip}")) {
                            warn!(target: "mesh", peer = %ip, "mesh: refused a link: {HANDSHAKES_MAX} TLS handshakes in progress on this shard already (closed at once; counted reason=\"busy\")");
                        }
                        drop(stream);
                        continue;
                    }
                    handshakes.set(handshakes.get() + 1);
                    let guard = InProgress(handshakes.clone());
                    glommio::spawn_local(serve(shard.clone(), mesh.clone(), stream, peer, guard)).detach();
                }
                Some(Err(e)) => {
                    debug!(target: "mesh", error = %e, "mesh: accept failed");
                    sleep(Duration::from_millis(50)).await;
                }
            }
        }
    })
    .detach();
}

async fn serve(shard: Rc<Shard>, mesh: Arc<Mesh>, stream: TcpStream, peer: Option<SocketAddr>, guard: InProgress) {
    let _ = stream.set_nodelay(true);
    let ip = peer.map(|p| p.ip().to_string()).unwrap_or_default();
    let hello = or(async { Some(handshake(&mesh, stream, &ip).await) }, async {
        sleep(HELLO_TIMEOUT).await;
        None
    })
    .await;
    drop(guard);
    let Some(Some(link)) = hello else {
        if hello.is_none() {
            mesh.stats.refused(RefusedFor::Protocol);
        }
        return;
    };
    mesh.stats.links_in.fetch_add(1, Ordering::Relaxed);
    let replica = link.replica.clone();
    if let Err(why) = receive(&shard, &mesh, link).await {
        debug!(target: "mesh", peer = %replica, "mesh: incoming link ended: {why}");
    }
    mesh.stats.links_in.fetch_sub(1, Ordering::Relaxed);
}

type ServerTls = futures_rustls::server::TlsStream<TcpStream>;

/// A link accepted: the TLS stream after the Hello, whose link it is,
/// and the version agreed.
struct Link {
    tls: ServerTls,
    replica: String,
    received: ReceivedRef,
    generation: u64,
    version: u16,
}

/// TLS, the Hello and its answer; `None` when the link was refused
/// (counted, and logged at most once a minute per source and reason).
async fn handshake(mesh: &Arc<Mesh>, stream: TcpStream, ip: &str) -> Option<Link> {
    let acceptor = futures_rustls::TlsAcceptor::from(mesh.tls.server.clone());
    let mut tls = match acceptor.accept(stream).await {
        Ok(tls) => tls,
        Err(e) => {
            let Some(why) = super::tls::refused_for(&e) else {
                // Not a TLS refusal: the dialer went away.
                debug!(target: "mesh", peer = %ip, error = %e, "mesh: incoming link closed in its handshake");
                return None;
            };
            // A certificate refused (here, or ours by the dialer: its
            // alert), or not TLS at all (plaintext, HTTP).
            mesh.stats.refused(why);
            if mesh.log_due(format!("tls-in {ip} {}", why.as_str())) {
                let what = match why {
                    RefusedFor::Certificate => "a certificate refused: not from cluster.mesh_ca, none, or ours refused by the dialer",
                    _ => "not a TLS 1.3 client",
                };
                warn!(target: "mesh", peer = %ip, error = %e, reason = why.as_str(), "mesh: refused a link: TLS handshake failed ({what})");
            }
            return None;
        }
    };
    let mut buf = BytesMut::new();
    let hello = read_frame(&mut tls, &mut buf, mesh.max_frame).await;
    let Ok(Frame::Hello { versions, replica, instance, link }) = hello else {
        mesh.stats.refused(RefusedFor::Protocol);
        if mesh.log_due(format!("hello {ip}")) {
            warn!(target: "mesh", peer = %ip, "mesh: refused a link: no Hello after the TLS handshake");
        }
        return None;
    };
    let cert = tls.get_ref().1.peer_certificates().and_then(|c| c.first().cloned());
    let version = mesh::choose_version(super::spoken(), &versions);
    let refusal = if !cert.is_some_and(|c| super::tls::names_replica(&c, &replica)) {
        // A valid certificate of another replica: a certificate problem.
        Some((Refusal::NameMismatch, RefusedFor::Certificate))
    } else if replica == mesh.replica {
        Some((Refusal::Myself, RefusedFor::Name))
    } else if version.is_none() {
        Some((Refusal::NoCommonVersion, RefusedFor::Version))
    } else {
        None
    };
    let mut out = BytesMut::new();
    if let Some((refusal, counted)) = refusal {
        mesh.stats.refused(counted);
        if mesh.log_due(format!("refused-in {replica} {ip} {}", refusal.as_str())) {
            warn!(target: "mesh", peer = %replica, %ip, reason = refusal.as_str(), ?versions,
                  "mesh: refused a link (this build speaks versions {:?})", super::spoken());
        }
        mesh::encode(&Frame::HelloAck(Err(refusal)), mesh::FIRST_VERSION, &mut out);
        let _ = tls.write_all(&out).await;
        let _ = tls.flush().await;
        return None;
    }
    let version = version.unwrap_or(mesh::FIRST_VERSION);
    let received = mesh.received(&instance, link);
    let (delivered, generation) = {
        let mut r = received.lock().unwrap_or_else(|e| e.into_inner());
        r.generation += 1;
        (r.delivered, r.generation)
    };
    mesh::encode(&Frame::HelloAck(Ok(Accepted { version, delivered })), mesh::FIRST_VERSION, &mut out);
    tls.write_all(&out).await.ok()?;
    tls.flush().await.ok()?;
    Some(Link { tls, replica, received, generation, version })
}

/// Deliver what arrives on the link and acknowledge it, until it breaks,
/// a newer connection of the same link replaces it, or (version 2)
/// nothing is read for [`KEEPALIVE_DEAD`]. A route announce (version 3)
/// is merged into the replica's route table and answered once every
/// shard applied it (at most [`ANNOUNCE_APPLY_WAIT`]; past it, no answer:
/// the announcing replica counts its SUBACK late).
async fn receive(shard: &Rc<Shard>, mesh: &Arc<Mesh>, link: Link) -> Result<(), String> {
    let Link { mut tls, replica: peer, received, generation, version } = link;
    let keepalive = version >= mesh::KEEPALIVE_VERSION;
    let mut buf = BytesMut::with_capacity(16 << 10);
    let mut out = BytesMut::new();
    let mut chunk = vec![0u8; 64 << 10];
    loop {
        let Some(read) = super::or_dead(keepalive, tls.read(&mut chunk)).await else {
            return Err(format!("nothing read for {} s (the dialer stopped or froze)", KEEPALIVE_DEAD.as_secs()));
        };
        let n = read.map_err(|e| e.to_string())?;
        if n == 0 {
            return Err("closed by the peer".into());
        }
        mesh.stats.bytes_in.fetch_add(n as u64, Ordering::Relaxed);
        buf.extend_from_slice(&chunk[..n]);
        let mut ack = None;
        let mut announced = Vec::new();
        loop {
            let frame = match mesh::decode(&mut buf, mesh.max_frame) {
                Ok(Some(frame)) => frame,
                Ok(None) => break,
                Err(e) => {
                    // A peer with a valid certificate sending what is not
                    // a frame of this version: refused, counted, logged.
                    mesh.stats.refused(RefusedFor::Protocol);
                    if mesh.log_due(format!("bad-frame {peer}")) {
                        warn!(target: "mesh", %peer, error = %e, "mesh: link closed: a malformed or oversized frame");
                    }
                    return Err(e.to_string());
                }
            };
            let (first, values) = match frame {
                Frame::Values { first, values } => (first, values),
                Frame::Route { id, revision, present, instance, filter } => {
                    let announce = fleetmq_nats_bridge::Announce { replica: peer.clone(), instance, filter, revision, present };
                    if let Some(applied) = crate::cluster::route_announced(announce) {
                        announced.push((id, applied));
                    }
                    continue;
                }
                _ => continue,
            };
            // Each value once: what an earlier connection of this link
            // delivered already is skipped. An empty frame (the
            // keepalive) is answered with what was delivered.
            let skip = {
                let mut r = received.lock().unwrap_or_else(|e| e.into_inner());
                if r.generation != generation {
                    return Err("replaced by a newer connection".into());
                }
                if values.is_empty() {
                    ack = Some(r.delivered);
                    continue;
                }
                let last = first.saturating_add(values.len() as u64 - 1);
                let skip = r.delivered.saturating_add(1).saturating_sub(first);
                r.delivered = r.delivered.max(last);
                ack = Some(r.delivered);
                skip
            };
            let values: Vec<_> = values.into_iter().skip(skip as usize).collect();
            mesh.stats.values_in.fetch_add(values.len() as u64, Ordering::Relaxed);
            shard.deliver_from_mesh(values);
        }
        shard.flush_soon().await;
        out.clear();
        if let Some(delivered) = ack {
            mesh::encode(&Frame::Ack { delivered }, version, &mut out);
        }
        if !announced.is_empty() {
            let by = std::time::Instant::now() + ANNOUNCE_APPLY_WAIT;
            for (id, applied) in announced {
                let left = by.saturating_duration_since(std::time::Instant::now());
                let applied = or(async { applied.await.is_ok() }, async {
                    sleep(left).await;
                    false
                });
                if applied.await {
                    mesh::encode(&Frame::RouteAck { id }, version, &mut out);
                }
            }
        }
        if !out.is_empty() {
            tls.write_all(&out).await.map_err(|e| e.to_string())?;
            tls.flush().await.map_err(|e| e.to_string())?;
        }
    }
}
