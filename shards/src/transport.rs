//! The byte streams MQTT runs over: TCP, TLS, WebSocket and WebSocket over
//! TLS (DESIGN.md §11), and the local socket pair that carries a TLS or
//! WebSocket connection's plain MQTT bytes to the shard that owns its
//! client identifier.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures_lite::future::or;
use futures_lite::{AsyncRead, AsyncWrite};
use futures_rustls::server::TlsStream;
use glommio::net::{TcpStream, UnixStream};

use crate::closing::Linger;
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
/// owner shard) until either side ends; then close `outer` as the owner
/// closed its end (see [`crate::closing`]): lingering after the owner's
/// last packet, at once after the client's end.
pub(crate) async fn bridge(mut outer: Transport, mut inner: UnixStream) {
    let (mut up, mut down) = (Pipe::new(), Pipe::new());
    let ended = std::future::poll_fn(|cx| {
        if let Poll::Ready(end) = up.poll(cx, &mut outer, &mut inner) {
            return Poll::Ready((true, end));
        }
        if let Poll::Ready(end) = down.poll(cx, &mut inner, &mut outer) {
            return Poll::Ready((false, end));
        }
        Poll::Pending
    })
    .await;
    let client_ended = match ended {
        // The client ended, or the owner failed to take its bytes: the
        // owner closed its end while the client was still writing. What
        // the owner wrote last (its DISCONNECT) still goes to the client,
        // up to the end of the owner's stream (bounded: the owner closes
        // at once).
        (true, End::Write) => {
            or(
                std::future::poll_fn(|cx| down.poll(cx, &mut inner, &mut outer)),
                async {
                    glommio::timer::sleep(crate::closing::LINGER_TIME).await;
                    End::Read
                },
            )
            .await;
            false
        }
        (true, End::Read) => true,
        // The owner ended (after its last packet), or the client is gone.
        (false, End::Read) => false,
        (false, End::Write) => true,
    };
    drop((up, down));
    // The owner sees the end of its local socket: EOF when the client
    // ended, the end of its own linger otherwise.
    drop(inner);
    let linger = if client_ended {
        Linger::NONE
    } else {
        Linger::AFTER_DISCONNECT
    };
    crate::closing::close(&mut outer, linger).await;
}

/// How one direction of a [`bridge`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    /// The side it reads from ended (EOF) or failed.
    Read,
    /// The side it writes to failed.
    Write,
}

/// One direction of a [`bridge`]: a buffer of bytes read from one side
/// and not yet all written to the other.
struct Pipe {
    buf: Box<[u8]>,
    /// `buf[start..end]` is still to be written.
    start: usize,
    end: usize,
    /// Written since the last flush: a TLS or WebSocket writer holds
    /// bytes until flushed.
    unflushed: bool,
}

impl Pipe {
    fn new() -> Pipe {
        Pipe {
            buf: vec![0; 16 * 1024].into_boxed_slice(),
            start: 0,
            end: 0,
            unflushed: false,
        }
    }

    /// Move bytes from `from` to `to` until one of them would block,
    /// flushing `to` whenever `from` has nothing more for now. Ready when
    /// `from` ended or either side failed, saying which.
    fn poll<R, W>(&mut self, cx: &mut Context<'_>, from: &mut R, to: &mut W) -> Poll<End>
    where
        R: AsyncRead + Unpin,
        W: AsyncWrite + Unpin,
    {
        loop {
            while self.start < self.end {
                match Pin::new(&mut *to).poll_write(cx, &self.buf[self.start..self.end]) {
                    Poll::Ready(Ok(n)) if n > 0 => {
                        self.start += n;
                        self.unflushed = true;
                    }
                    Poll::Ready(_) => return Poll::Ready(End::Write),
                    Poll::Pending => return Poll::Pending,
                }
            }
            match Pin::new(&mut *from).poll_read(cx, &mut self.buf) {
                Poll::Ready(Ok(0)) | Poll::Ready(Err(_)) => return Poll::Ready(End::Read),
                Poll::Ready(Ok(n)) => (self.start, self.end) = (0, n),
                Poll::Pending => {
                    if self.unflushed {
                        match Pin::new(&mut *to).poll_flush(cx) {
                            Poll::Ready(Ok(())) => self.unflushed = false,
                            Poll::Ready(Err(_)) => return Poll::Ready(End::Write),
                            Poll::Pending => {}
                        }
                    }
                    return Poll::Pending;
                }
            }
        }
    }
}
