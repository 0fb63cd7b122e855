//! The glommio byte stream under [`crate::client::Conn`]: [`Stream`], an
//! enum over TCP, TLS (futures-rustls) and WebSocket (async-tungstenite,
//! over TCP or TLS), opened by [`open`].
//!
//! - `mqtt://` is the bare `glommio::net::TcpStream`: reads, writes and
//!   read timeouts go straight to it (one `match` more per call, nothing
//!   allocated).
//! - TLS buffers: a write may leave bytes in rustls until the next write
//!   or flush, so callers flush after each batch (as for any `AsyncWrite`).
//!   Read timeouts are the socket's own (a timed-out read leaves rustls
//!   intact).
//! - WebSocket: each write is one binary message, sent on flush; reads
//!   concatenate binary messages, a close ends the stream, a text message
//!   fails the read (`InvalidData`) [MQTT-6.0.0-1]. async-tungstenite ends
//!   a stream after any error, so the socket gets no read timeout: it is
//!   kept here, with one reusable glommio timer per connection.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use async_tungstenite::tungstenite::Message;
use async_tungstenite::WebSocketStream;
use bytes::Bytes;
use futures_lite::future::or;
use futures_lite::{AsyncRead, AsyncWrite};
use futures_rustls::client::TlsStream;
use futures_util::{Sink, Stream as _};
use glommio::net::TcpStream;
use glommio::timer::{sleep, Timer};

use super::tls::server_name;
use super::url::{BrokerUrl, Scheme};
use super::{ws_config, ws_error, ws_request, TransportOptions};
use crate::client::ClientError;

/// A connected byte stream to the broker, whatever the URL's scheme.
#[derive(Debug)]
pub enum Stream {
    /// `mqtt://`.
    Tcp(TcpStream),
    /// `mqtts://` (boxed: the TLS state is large).
    Tls(Box<TlsStream<TcpStream>>),
    /// `ws://` and `wss://`.
    Ws(Box<WsStream>),
}

/// Opens a connection to `url`: TCP connect (TCP_NODELAY set), then the
/// TLS handshake and the WebSocket upgrade its scheme needs, each within
/// `timeout`.
///
/// # Errors
/// [`ClientError::Connect`] when the TCP connect fails or times out,
/// [`ClientError::Tls`] when the handshake fails (unknown CA, wrong name,
/// client certificate refused), [`ClientError::WebSocket`] when the
/// upgrade is refused (HTTP status) or malformed, [`ClientError::Timeout`]
/// when the handshake or upgrade does not finish in time.
///
/// # Cancel safety
/// Not cancel safe: a dropped future drops the half-open connection.
pub async fn open(
    url: &BrokerUrl,
    transport: &TransportOptions,
    timeout: Duration,
) -> Result<Stream, ClientError> {
    let tcp = TcpStream::connect_timeout(url.addr, timeout)
        .await
        .map_err(|e| ClientError::Connect(e.into()))?;
    tcp.set_nodelay(true)
        .map_err(|e| ClientError::Io(e.into()))?;
    match url.scheme {
        Scheme::Mqtt => Ok(Stream::Tcp(tcp)),
        Scheme::Mqtts => {
            let tls = or(
                tls_handshake(tcp, url, transport),
                deadline(timeout, "TLS handshake"),
            )
            .await?;
            Ok(Stream::Tls(Box::new(tls)))
        }
        Scheme::Ws => {
            let ws = or(
                ws_upgrade(Layer::Plain(tcp), url, transport),
                deadline(timeout, "WebSocket upgrade"),
            )
            .await?;
            Ok(Stream::Ws(Box::new(ws)))
        }
        Scheme::Wss => {
            let ws = or(
                async {
                    let tls = tls_handshake(tcp, url, transport).await?;
                    ws_upgrade(Layer::Tls(Box::new(tls)), url, transport).await
                },
                deadline(timeout, "TLS handshake and WebSocket upgrade"),
            )
            .await?;
            Ok(Stream::Ws(Box::new(ws)))
        }
    }
}

/// Fails with [`ClientError::Timeout`] naming `what` after `timeout`.
async fn deadline<T>(timeout: Duration, what: &'static str) -> Result<T, ClientError> {
    sleep(timeout).await;
    Err(ClientError::Timeout(what))
}

async fn tls_handshake(
    tcp: TcpStream,
    url: &BrokerUrl,
    transport: &TransportOptions,
) -> Result<TlsStream<TcpStream>, ClientError> {
    let config = transport
        .tls
        .clone()
        .ok_or_else(|| ClientError::Tls("no TLS configuration loaded".into()))?;
    futures_rustls::TlsConnector::from(config)
        .connect(server_name(&url.host)?, tcp)
        .await
        .map_err(|e| match e.kind() {
            io::ErrorKind::TimedOut => ClientError::Timeout("TLS handshake"),
            // A rustls error, an alert, or the broker hanging up on us.
            _ => ClientError::Tls(e.to_string()),
        })
}

async fn ws_upgrade(
    layer: Layer,
    url: &BrokerUrl,
    transport: &TransportOptions,
) -> Result<WsStream, ClientError> {
    let request = ws_request(url, &transport.ws_path)?;
    let (inner, _response) =
        async_tungstenite::client_async_with_config(request, layer, Some(ws_config()))
            .await
            .map_err(ws_error)?;
    Ok(WsStream {
        inner,
        pending: Bytes::new(),
        read_timeout: None,
        timer: None,
        armed: false,
    })
}

impl Stream {
    /// False for TCP, whose writes go straight to the socket; true for TLS
    /// and WebSocket, which hold written bytes until a flush.
    pub fn needs_flush(&self) -> bool {
        !matches!(self, Stream::Tcp(_))
    }

    /// Makes a read that waits longer than `timeout` fail with
    /// `io::ErrorKind::TimedOut` (the stream stays usable); `None` waits
    /// forever.
    ///
    /// # Errors
    /// When the socket refuses the value (zero).
    pub fn set_read_timeout(&mut self, timeout: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_read_timeout(timeout).map_err(Into::into),
            Stream::Tls(s) => s.get_ref().0.set_read_timeout(timeout).map_err(Into::into),
            Stream::Ws(s) => {
                if timeout == Some(Duration::ZERO) {
                    return Err(io::Error::from(io::ErrorKind::InvalidInput));
                }
                s.read_timeout = timeout;
                Ok(())
            }
        }
    }
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
            Stream::Ws(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
            Stream::Ws(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_flush(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
            Stream::Ws(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_close(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_close(cx),
            Stream::Ws(s) => Pin::new(s.as_mut()).poll_close(cx),
        }
    }
}

/// What a WebSocket runs over.
#[derive(Debug)]
pub enum Layer {
    /// `ws://`.
    Plain(TcpStream),
    /// `wss://`.
    Tls(Box<TlsStream<TcpStream>>),
}

impl AsyncRead for Layer {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Layer::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Layer::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Layer {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Layer::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Layer::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Layer::Plain(s) => Pin::new(s).poll_flush(cx),
            Layer::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Layer::Plain(s) => Pin::new(s).poll_close(cx),
            Layer::Tls(s) => Pin::new(s.as_mut()).poll_close(cx),
        }
    }
}

/// A client WebSocket seen as a byte stream (see the module docs).
#[derive(Debug)]
pub struct WsStream {
    inner: WebSocketStream<Layer>,
    /// Unread rest of the last binary message.
    pending: Bytes,
    read_timeout: Option<Duration>,
    /// Created on the first read that waits with a timeout set, then reset
    /// for each later one.
    timer: Option<Timer>,
    /// True while `timer` runs for the read now waiting.
    armed: bool,
}

fn ws_io_error(e: async_tungstenite::tungstenite::Error) -> io::Error {
    use async_tungstenite::tungstenite::Error;
    match e {
        Error::Io(e) => e,
        Error::ConnectionClosed | Error::AlreadyClosed => {
            io::Error::new(io::ErrorKind::BrokenPipe, "WebSocket closed")
        }
        other => io::Error::new(io::ErrorKind::InvalidData, other),
    }
}

impl WsStream {
    fn poll_read_bytes(&mut self, cx: &mut Context<'_>, buf: &mut [u8]) -> Poll<io::Result<usize>> {
        loop {
            if !self.pending.is_empty() {
                let n = buf.len().min(self.pending.len());
                buf[..n].copy_from_slice(&self.pending.split_to(n));
                return Poll::Ready(Ok(n));
            }
            match ready!(Pin::new(&mut self.inner).poll_next(cx)) {
                None | Some(Ok(Message::Close(_))) => return Poll::Ready(Ok(0)),
                Some(Ok(Message::Binary(data))) => self.pending = data,
                Some(Ok(Message::Text(_))) => {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "text WebSocket message: MQTT uses binary messages [MQTT-6.0.0-1]",
                    )))
                }
                // Pings are answered by tungstenite itself.
                Some(Ok(_)) => {}
                Some(Err(e)) => return Poll::Ready(Err(ws_io_error(e))),
            }
        }
    }
}

impl AsyncRead for WsStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if let Poll::Ready(r) = this.poll_read_bytes(cx, buf) {
            this.armed = false;
            return Poll::Ready(r);
        }
        let Some(timeout) = this.read_timeout else {
            return Poll::Pending;
        };
        let timer = this.timer.get_or_insert_with(|| Timer::new(timeout));
        if !this.armed {
            timer.reset(timeout);
            this.armed = true;
        }
        match Pin::new(timer).poll(cx) {
            Poll::Ready(_) => {
                this.armed = false;
                Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "WebSocket read timed out",
                )))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl AsyncWrite for WsStream {
    /// Queues `buf` as one binary message; [`AsyncWrite::poll_flush`] sends it.
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let mut inner = Pin::new(&mut self.get_mut().inner);
        ready!(inner.as_mut().poll_ready(cx)).map_err(ws_io_error)?;
        inner
            .as_mut()
            .start_send(Message::Binary(Bytes::copy_from_slice(buf)))
            .map_err(ws_io_error)?;
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner)
            .poll_flush(cx)
            .map_err(ws_io_error)
    }

    /// Sends a close frame, then closes the connection.
    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner)
            .poll_close(cx)
            .map_err(ws_io_error)
    }
}
