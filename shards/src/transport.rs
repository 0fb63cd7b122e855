//! The byte streams MQTT runs over: TCP, TLS, WebSocket and WebSocket over
//! TLS (DESIGN.md §11), and the local socket pair that carries a TLS or
//! WebSocket connection's plain MQTT bytes to the shard that owns its
//! client identifier.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures_lite::{AsyncRead, AsyncWrite};
use futures_rustls::server::TlsStream;
use glommio::net::{TcpStream, UnixStream};

use crate::tls::{peer_identity, TlsConfig};
use crate::ws::{self, WsStream};

/// What a listener speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ListenerKind {
    /// MQTT over TCP (`listeners.tcp`).
    Tcp,
    /// MQTT over TLS (`listeners.tls`).
    Tls,
    /// MQTT over WebSocket, path `/mqtt`, subprotocol `mqtt` (`listeners.ws`).
    Ws,
    /// MQTT over WebSocket over TLS (`listeners.wss`).
    Wss,
}

impl ListenerKind {
    /// The name used in logs and the `listening` line.
    pub(crate) fn name(self) -> &'static str {
        match self {
            ListenerKind::Tcp => "mqtt-tcp",
            ListenerKind::Tls => "mqtt-tls",
            ListenerKind::Ws => "mqtt-ws",
            ListenerKind::Wss => "mqtt-wss",
        }
    }
}

type Tls = TlsStream<TcpStream>;

/// A connected MQTT byte stream.
pub(crate) enum Transport {
    /// Plain TCP.
    Tcp(TcpStream),
    /// One end of a local socket pair whose other end is bridged to a TLS
    /// or WebSocket connection on another shard.
    Unix(UnixStream),
    /// TLS over TCP.
    Tls(Box<Tls>),
    /// WebSocket over TCP.
    Ws(Box<WsStream<TcpStream>>),
    /// WebSocket over TLS.
    Wss(Box<WsStream<Tls>>),
}

/// Complete the TLS and/or WebSocket handshakes a `kind` listener needs.
/// Returns the stream and, for TLS with a client certificate, its identity
/// (subject CN or SAN).
///
/// # Errors
/// A failed handshake, as text for the debug log.
pub(crate) async fn open(kind: ListenerKind, stream: TcpStream, tls: Option<&TlsConfig>) -> Result<(Transport, Option<String>), String> {
    match kind {
        ListenerKind::Tcp => Ok((Transport::Tcp(stream), None)),
        _ => handshakes(kind, stream, tls).await,
    }
}

/// What [`handshakes`] returns.
type Handshakes<'a> = Pin<Box<dyn std::future::Future<Output = Result<(Transport, Option<String>), String>> + 'a>>;

/// [`open`] for TLS and WebSocket listeners. Each handshake future is
/// boxed: they are many kilobytes (rustls and tungstenite state), and
/// unboxed they would size the future of every connection until its
/// CONNECT arrives, even for plain TCP. Built here, out of line, because a
/// boxed future is first made on the stack: inlined into [`open`], their
/// 29 KiB of stack was probed, so touched, on every connection's first
/// poll, and stayed resident on each shard's thread (perf/RESULTS.md,
/// 2026-12-02, session 16).
#[inline(never)]
fn handshakes(kind: ListenerKind, stream: TcpStream, tls: Option<&TlsConfig>) -> Handshakes<'_> {
    let handshake = move |stream: TcpStream| async move {
        let tls = tls.ok_or("TLS listener without a certificate")?;
        let stream = tls.acceptor().accept(stream).await.map_err(|e| format!("TLS handshake: {e}"))?;
        let identity = peer_identity(stream.get_ref().1);
        Ok::<_, String>((stream, identity))
    };
    Box::pin(async move {
        match kind {
            ListenerKind::Tcp => Ok((Transport::Tcp(stream), None)),
            ListenerKind::Tls => {
                let (stream, identity) = Box::pin(handshake(stream)).await?;
                Ok((Transport::Tls(Box::new(stream)), identity))
            }
            ListenerKind::Ws => {
                let stream = Box::pin(ws::accept(stream)).await.map_err(|e| format!("WebSocket handshake: {e}"))?;
                Ok((Transport::Ws(Box::new(stream)), None))
            }
            ListenerKind::Wss => {
                let (stream, identity) = Box::pin(handshake(stream)).await?;
                let stream = Box::pin(ws::accept(stream)).await.map_err(|e| format!("WebSocket handshake: {e}"))?;
                Ok((Transport::Wss(Box::new(stream)), identity))
            }
        }
    })
}

macro_rules! each {
    ($self:ident, $s:ident => $e:expr) => {
        match $self.get_mut() {
            Transport::Tcp($s) => $e,
            Transport::Unix($s) => $e,
            Transport::Tls($s) => $e,
            Transport::Ws($s) => $e,
            Transport::Wss($s) => $e,
        }
    };
}

impl AsyncRead for Transport {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut [u8]) -> Poll<io::Result<usize>> {
        each!(self, s => Pin::new(s).poll_read(cx, buf))
    }
}

impl AsyncWrite for Transport {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        each!(self, s => Pin::new(s).poll_write(cx, buf))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        each!(self, s => Pin::new(s).poll_flush(cx))
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        each!(self, s => Pin::new(s).poll_close(cx))
    }
}

/// Carry bytes both ways between `outer` (a TLS or WebSocket client) and
/// `inner` (the local socket whose peer end serves the MQTT session on the
/// owner shard) until either side closes.
pub(crate) async fn bridge(outer: Transport, inner: UnixStream) {
    let (outer_read, mut outer_write) = futures_lite::io::split(outer);
    let (inner_read, mut inner_write) = futures_lite::io::split(inner);
    let up = async {
        let _ = futures_lite::io::copy(outer_read, &mut inner_write).await;
    };
    let down = async {
        let _ = copy_flushing(inner_read, &mut outer_write).await;
    };
    futures_lite::future::or(up, down).await;
    let _ = futures_lite::AsyncWriteExt::close(&mut outer_write).await;
    let _ = futures_lite::AsyncWriteExt::close(&mut inner_write).await;
}

/// Like `futures_lite::io::copy`, but flushes after every read, so a TLS
/// or WebSocket writer sends each batch at once instead of holding it.
async fn copy_flushing<R, W>(mut reader: R, writer: &mut W) -> io::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    use futures_lite::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = reader.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        writer.write_all(&buf[..n]).await?;
        writer.flush().await?;
    }
}
