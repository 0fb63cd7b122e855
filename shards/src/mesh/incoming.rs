//! Links other replicas dialed to this one: the accept loop of a shard's
//! mesh listener, the checks (certificate, Hello, version) and the
//! delivery of what arrives to this replica's subscribers.

use std::net::SocketAddr;
use std::os::fd::{FromRawFd, IntoRawFd, OwnedFd};
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use fleetmq_core::mesh::{self, Accepted, Frame, Refusal, VERSIONS};
use futures_lite::future::or;
use futures_lite::{AsyncReadExt, AsyncWriteExt};
use glommio::net::{TcpListener, TcpStream};
use glommio::timer::sleep;
use tracing::{debug, warn};

use super::outgoing::read_frame;
use super::{Mesh, ReceivedRef, RefusedFor};
use crate::shard::Shard;

/// How long a dialer has for the TLS handshake and its Hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// Accept mesh links on this shard's listener until the shard stops.
pub(crate) fn spawn_acceptor(shard: &Rc<Shard>, mesh: &Arc<Mesh>, fd: OwnedFd) {
    // SAFETY: a listening socket we own; the listener owns it now.
    let listener = unsafe { TcpListener::from_raw_fd(fd.into_raw_fd()) };
    let (shard, mesh) = (shard.clone(), mesh.clone());
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
                    glommio::spawn_local(serve(shard.clone(), mesh.clone(), stream, peer)).detach();
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

async fn serve(shard: Rc<Shard>, mesh: Arc<Mesh>, stream: TcpStream, peer: Option<SocketAddr>) {
    let _ = stream.set_nodelay(true);
    let ip = peer.map(|p| p.ip().to_string()).unwrap_or_default();
    let hello = or(async { Some(handshake(&mesh, stream, &ip).await) }, async {
        sleep(HELLO_TIMEOUT).await;
        None
    })
    .await;
    let Some(Some((tls, replica, received, generation))) = hello else {
        if hello.is_none() {
            mesh.stats.refused(RefusedFor::Protocol);
        }
        return;
    };
    mesh.stats.links_in.fetch_add(1, Ordering::Relaxed);
    if let Err(why) = receive(&shard, &mesh, tls, &replica, &received, generation).await {
        debug!(target: "mesh", peer = %replica, "mesh: incoming link ended: {why}");
    }
    mesh.stats.links_in.fetch_sub(1, Ordering::Relaxed);
}

type ServerTls = futures_rustls::server::TlsStream<TcpStream>;

/// TLS, the Hello and its answer; `None` when the link was refused
/// (counted and logged once per peer).
async fn handshake(mesh: &Arc<Mesh>, stream: TcpStream, ip: &str) -> Option<(ServerTls, String, ReceivedRef, u64)> {
    let acceptor = futures_rustls::TlsAcceptor::from(mesh.tls.server.clone());
    let mut tls = match acceptor.accept(stream).await {
        Ok(tls) => tls,
        Err(e) if e.kind() != std::io::ErrorKind::InvalidData => {
            // Not a TLS refusal: the dialer went away.
            debug!(target: "mesh", peer = %ip, error = %e, "mesh: incoming link closed in its handshake");
            return None;
        }
        Err(e) => {
            // A certificate refused, or not TLS at all (plaintext, HTTP).
            let why = e.to_string();
            let certificate = why.contains("certificate");
            mesh.stats.refused(if certificate { RefusedFor::Certificate } else { RefusedFor::Protocol });
            if mesh.first_time(format!("tls-in {ip} {certificate}")) {
                let what = if certificate { "no certificate from cluster.mesh_ca" } else { "not a TLS 1.3 client" };
                warn!(target: "mesh", peer = %ip, error = %e, "mesh: refused a link: TLS handshake failed ({what})");
            }
            return None;
        }
    };
    let mut buf = BytesMut::new();
    let Ok(Frame::Hello { versions, replica, instance, link }) = read_frame(&mut tls, &mut buf, mesh.max_frame).await else {
        mesh.stats.refused(RefusedFor::Protocol);
        return None;
    };
    let cert = tls.get_ref().1.peer_certificates().and_then(|c| c.first().cloned());
    let refusal = if !cert.is_some_and(|c| super::tls::names_replica(&c, &replica)) {
        Some((Refusal::NameMismatch, RefusedFor::Name))
    } else if replica == mesh.replica {
        Some((Refusal::Myself, RefusedFor::Name))
    } else if mesh::choose_version(VERSIONS, &versions).is_none() {
        Some((Refusal::NoCommonVersion, RefusedFor::Version))
    } else {
        None
    };
    let mut out = BytesMut::new();
    if let Some((refusal, counted)) = refusal {
        mesh.stats.refused(counted);
        if mesh.first_time(format!("refused-in {replica} {ip}")) {
            warn!(target: "mesh", peer = %replica, %ip, reason = refusal.as_str(), ?versions,
                  "mesh: refused a link (this build speaks versions {VERSIONS:?})");
        }
        mesh::encode(&Frame::HelloAck(Err(refusal)), &mut out);
        let _ = tls.write_all(&out).await;
        let _ = tls.flush().await;
        return None;
    }
    let version = mesh::choose_version(VERSIONS, &versions).unwrap_or(mesh::VERSION);
    let received = mesh.received(&instance, link);
    let (delivered, generation) = {
        let mut r = received.lock().unwrap_or_else(|e| e.into_inner());
        r.generation += 1;
        (r.delivered, r.generation)
    };
    mesh::encode(&Frame::HelloAck(Ok(Accepted { version, delivered })), &mut out);
    tls.write_all(&out).await.ok()?;
    tls.flush().await.ok()?;
    Some((tls, replica, received, generation))
}

/// Deliver what arrives on the link and acknowledge it, until it breaks
/// or a newer connection of the same link replaces it.
async fn receive(
    shard: &Rc<Shard>,
    mesh: &Arc<Mesh>,
    mut tls: ServerTls,
    peer: &str,
    received: &ReceivedRef,
    generation: u64,
) -> Result<(), String> {
    let mut buf = BytesMut::with_capacity(16 << 10);
    let mut out = BytesMut::new();
    let mut chunk = vec![0u8; 64 << 10];
    loop {
        let n = tls.read(&mut chunk).await.map_err(|e| e.to_string())?;
        if n == 0 {
            return Err("closed by the peer".into());
        }
        mesh.stats.bytes_in.fetch_add(n as u64, Ordering::Relaxed);
        buf.extend_from_slice(&chunk[..n]);
        let mut ack = None;
        loop {
            let frame = match mesh::decode(&mut buf, mesh.max_frame) {
                Ok(Some(frame)) => frame,
                Ok(None) => break,
                Err(e) => {
                    // A peer with a valid certificate sending what is not
                    // a frame of this version: refused, counted, logged.
                    mesh.stats.refused(RefusedFor::Protocol);
                    if mesh.first_time(format!("bad-frame {peer}")) {
                        warn!(target: "mesh", %peer, error = %e, "mesh: link closed: a malformed or oversized frame");
                    }
                    return Err(e.to_string());
                }
            };
            let Frame::Values { first, values } = frame else { continue };
            if values.is_empty() {
                continue;
            }
            let last = first.saturating_add(values.len() as u64 - 1);
            // Each value once: what an earlier connection of this link
            // delivered already is skipped.
            let skip = {
                let mut r = received.lock().unwrap_or_else(|e| e.into_inner());
                if r.generation != generation {
                    return Err("replaced by a newer connection".into());
                }
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
        if let Some(delivered) = ack {
            out.clear();
            mesh::encode(&Frame::Ack { delivered }, &mut out);
            tls.write_all(&out).await.map_err(|e| e.to_string())?;
            tls.flush().await.map_err(|e| e.to_string())?;
        }
    }
}
