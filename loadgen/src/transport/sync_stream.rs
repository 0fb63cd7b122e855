//! The std byte stream under the checked flows' blocking client
//! ([`crate::verify::SyncConn`]): [`SyncStream`], over TCP, TLS (rustls)
//! or WebSocket (tungstenite, over TCP or TLS), opened by [`open`].
//!
//! Sockets stay in blocking mode, so writes block as on plain TCP. Reads
//! wait with `ppoll` (precise, unlike `SO_RCVTIMEO`, which rounds up to a
//! jiffy). Under TLS and WebSocket, bytes may already sit decoded in
//! rustls or tungstenite while the socket is empty, so those layers read
//! the socket with `MSG_DONTWAIT`: [`SyncStream::read_within`] first takes
//! what is buffered, and waits on the socket only when every layer says
//! `WouldBlock`.

use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::time::Duration;

use async_tungstenite::tungstenite::handshake::HandshakeError;
use async_tungstenite::tungstenite::{self, Message, WebSocket};
use bytes::Bytes;
use rustls::ClientConnection;

use super::tls::server_name;
use super::url::{BrokerUrl, Scheme};
use super::{ws_config, ws_error, ws_request, TransportOptions};
use crate::client::ClientError;
use crate::runtime::now_ns;

/// A connected blocking byte stream to the broker, whatever the scheme.
#[derive(Debug)]
pub enum SyncStream {
    /// `mqtt://`.
    Tcp(std::net::TcpStream),
    /// `mqtts://`.
    Tls(Box<TlsSocket>),
    /// `ws://` and `wss://`.
    Ws(Box<SyncWs>),
}

/// Opens a connection to `url`: TCP connect (TCP_NODELAY set), then the TLS
/// handshake and WebSocket upgrade its scheme needs, all within `timeout`
/// after the connect.
///
/// # Errors
/// [`ClientError::Connect`], [`ClientError::Tls`] (unknown CA, wrong name,
/// refused client certificate), [`ClientError::WebSocket`] (upgrade
/// refused, with its HTTP status), [`ClientError::Timeout`] naming the
/// stage, or [`ClientError::Io`].
pub fn open(
    url: &BrokerUrl,
    transport: &TransportOptions,
    timeout: Duration,
) -> Result<SyncStream, ClientError> {
    let sock =
        std::net::TcpStream::connect_timeout(&url.addr, timeout).map_err(ClientError::Connect)?;
    sock.set_nodelay(true).map_err(ClientError::Io)?;
    let deadline = now_ns() + timeout.as_nanos() as u64;
    let handshakes = url.scheme != Scheme::Mqtt;
    if handshakes {
        // No handshake write may block past the timeout either.
        sock.set_write_timeout(Some(timeout))
            .map_err(ClientError::Io)?;
    }
    let stream = match url.scheme {
        Scheme::Mqtt => SyncStream::Tcp(sock),
        Scheme::Mqtts => SyncStream::Tls(Box::new(tls_handshake(sock, url, transport, deadline)?)),
        Scheme::Ws => SyncStream::Ws(Box::new(ws_upgrade(
            WsLayer::Plain(sock),
            url,
            transport,
            deadline,
        )?)),
        Scheme::Wss => {
            let tls = tls_handshake(sock, url, transport, deadline)?;
            SyncStream::Ws(Box::new(ws_upgrade(
                WsLayer::Tls(Box::new(tls)),
                url,
                transport,
                deadline,
            )?))
        }
    };
    if handshakes {
        stream
            .socket()
            .set_write_timeout(None)
            .map_err(ClientError::Io)?;
    }
    Ok(stream)
}

impl SyncStream {
    fn socket(&self) -> &std::net::TcpStream {
        match self {
            SyncStream::Tcp(s) => s,
            SyncStream::Tls(t) => &t.sock,
            SyncStream::Ws(w) => w.ws.get_ref().socket(),
        }
    }

    /// Reads what is there, waiting at most `timeout`: `Some(n)` bytes
    /// (`Some(0)`: the broker closed the connection), `None` when nothing
    /// came in time or a signal interrupted the wait.
    ///
    /// # Errors
    /// Socket errors; under TLS, a TLS failure (wrapping a
    /// `rustls::Error`); under WebSocket, a protocol violation or a text
    /// message (`InvalidData`).
    pub fn read_within(&mut self, buf: &mut [u8], timeout: Duration) -> io::Result<Option<usize>> {
        if let SyncStream::Tcp(sock) = self {
            if !wait_readable(sock.as_raw_fd(), timeout) {
                return Ok(None);
            }
            return match sock.read(buf) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(None),
                r => r.map(Some),
            };
        }
        match self.read_buffered(buf) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            r => return r.map(Some),
        }
        if !wait_readable(self.socket().as_raw_fd(), timeout) {
            return Ok(None);
        }
        match self.read_buffered(buf) {
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                ) =>
            {
                Ok(None)
            }
            r => r.map(Some),
        }
    }

    /// TLS and WebSocket: reads without waiting (`WouldBlock` when every
    /// layer is empty).
    fn read_buffered(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            SyncStream::Tcp(s) => s.read(buf),
            SyncStream::Tls(t) => t.read(buf),
            SyncStream::Ws(w) => w.read(buf),
        }
    }

    /// Writes all of `bytes` (WebSocket: as one binary message), blocking
    /// until the socket took them.
    ///
    /// # Errors
    /// Socket errors, or a WebSocket already closed (`BrokenPipe`).
    pub fn write_all(&mut self, bytes: &[u8]) -> io::Result<()> {
        match self {
            SyncStream::Tcp(s) => s.write_all(bytes),
            SyncStream::Tls(t) => t.write_all(bytes),
            SyncStream::Ws(w) => {
                w.ws.send(Message::Binary(Bytes::copy_from_slice(bytes)))
                    .map_err(ws_io_error)
            }
        }
    }

    /// Closes the connection, ignoring errors: TLS sends close_notify,
    /// WebSocket a close frame, then the socket is shut down both ways.
    pub fn shutdown(&mut self) {
        match self {
            SyncStream::Tcp(_) => {}
            SyncStream::Tls(t) => t.close_notify(),
            SyncStream::Ws(w) => {
                let _ = w.ws.close(None);
                let _ = w.ws.flush();
                if let WsLayer::Tls(t) = w.ws.get_mut() {
                    t.close_notify();
                }
            }
        }
        let _ = self.socket().shutdown(std::net::Shutdown::Both);
    }
}

/// Waits until `fd` is readable, at most `timeout`; false on timeout or a
/// signal.
fn wait_readable(fd: RawFd, timeout: Duration) -> bool {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: libc::c_long::from(timeout.subsec_nanos() as i32),
    };
    // SAFETY: one valid pollfd, a valid timespec, no signal mask.
    let ready = unsafe { libc::ppoll(&mut pfd, 1, &ts, std::ptr::null()) };
    ready > 0
}

/// Reads from a blocking socket without waiting: `WouldBlock` when empty.
struct DontWait<'a>(&'a std::net::TcpStream);

impl Read for DontWait<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        // SAFETY: `buf` is valid for `buf.len()` bytes of writes; the fd is
        // an open socket borrowed for the call.
        let n = unsafe {
            libc::recv(
                self.0.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                libc::MSG_DONTWAIT,
            )
        };
        if n < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(n as usize)
        }
    }
}

/// A rustls client connection over a blocking socket read with
/// `MSG_DONTWAIT`: reads give `WouldBlock` when nothing is decoded and the
/// socket is empty; writes block until the socket took the records.
#[derive(Debug)]
pub struct TlsSocket {
    conn: ClientConnection,
    sock: std::net::TcpStream,
}

impl TlsSocket {
    /// Writes every pending TLS record.
    fn flush_tls(&mut self) -> io::Result<()> {
        while self.conn.wants_write() {
            self.conn.write_tls(&mut self.sock)?;
        }
        Ok(())
    }

    /// Reads once from the socket without waiting and decodes; `Ok(0)` at
    /// the end of the stream.
    fn pull(&mut self) -> io::Result<usize> {
        let n = self.conn.read_tls(&mut DontWait(&self.sock))?;
        if let Err(e) = self.conn.process_new_packets() {
            // Tell the broker why (the alert rustls queued), then fail.
            let _ = self.flush_tls();
            return Err(io::Error::new(io::ErrorKind::InvalidData, e));
        }
        self.flush_tls()?;
        Ok(n)
    }

    fn close_notify(&mut self) {
        self.conn.send_close_notify();
        let _ = self.flush_tls();
    }
}

impl Read for TlsSocket {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            match self.conn.reader().read(buf) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                r => return r,
            }
            if self.pull()? == 0 {
                // End of stream: rustls now says clean close or not.
                return match self.conn.reader().read(buf) {
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(0),
                    r => r,
                };
            }
        }
    }
}

impl Write for TlsSocket {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.conn.writer().write(buf)?;
        self.flush_tls()?;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.conn.writer().flush()?;
        self.flush_tls()
    }
}

fn tls_handshake(
    sock: std::net::TcpStream,
    url: &BrokerUrl,
    transport: &TransportOptions,
    deadline: u64,
) -> Result<TlsSocket, ClientError> {
    let config: Arc<rustls::ClientConfig> = transport
        .tls
        .clone()
        .ok_or_else(|| ClientError::Tls("no TLS configuration loaded".into()))?;
    let conn = ClientConnection::new(config, server_name(&url.host)?)
        .map_err(|e| ClientError::Tls(e.to_string()))?;
    let mut t = TlsSocket { conn, sock };
    let failed = |e: io::Error| match e.kind() {
        // A handshake write blocked past the timeout.
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
            ClientError::Timeout("TLS handshake")
        }
        // A rustls error, an alert, or the broker hanging up on us.
        _ => ClientError::Tls(e.to_string()),
    };
    while t.conn.is_handshaking() {
        t.flush_tls().map_err(failed)?;
        if !t.conn.is_handshaking() {
            break;
        }
        // Our flight is out: wait for the broker's.
        let left = deadline.saturating_sub(now_ns());
        if left == 0 || !wait_readable(t.sock.as_raw_fd(), Duration::from_nanos(left)) {
            if now_ns() >= deadline {
                return Err(ClientError::Timeout("TLS handshake"));
            }
            continue;
        }
        match t.pull() {
            Ok(0) => {
                return Err(ClientError::Tls(
                    "the broker closed the connection during the handshake".into(),
                ))
            }
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(failed(e)),
        }
    }
    t.flush_tls().map_err(failed)?;
    Ok(t)
}

/// What a blocking WebSocket runs over.
#[derive(Debug)]
pub enum WsLayer {
    /// `ws://`: the socket, read with `MSG_DONTWAIT`.
    Plain(std::net::TcpStream),
    /// `wss://`.
    Tls(Box<TlsSocket>),
}

impl WsLayer {
    fn socket(&self) -> &std::net::TcpStream {
        match self {
            WsLayer::Plain(s) => s,
            WsLayer::Tls(t) => &t.sock,
        }
    }
}

impl Read for WsLayer {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            WsLayer::Plain(s) => DontWait(s).read(buf),
            WsLayer::Tls(t) => t.read(buf),
        }
    }
}

impl Write for WsLayer {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            WsLayer::Plain(s) => s.write(buf),
            WsLayer::Tls(t) => t.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            WsLayer::Plain(s) => s.flush(),
            WsLayer::Tls(t) => t.flush(),
        }
    }
}

/// A blocking client WebSocket seen as a byte stream: reads concatenate
/// binary messages, each write is one binary message.
#[derive(Debug)]
pub struct SyncWs {
    ws: WebSocket<WsLayer>,
    /// Unread rest of the last binary message.
    pending: Bytes,
}

fn ws_io_error(e: tungstenite::Error) -> io::Error {
    match e {
        tungstenite::Error::Io(e) => e,
        tungstenite::Error::ConnectionClosed | tungstenite::Error::AlreadyClosed => {
            io::Error::new(io::ErrorKind::BrokenPipe, "WebSocket closed")
        }
        other => io::Error::new(io::ErrorKind::InvalidData, other),
    }
}

impl Read for SyncWs {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            if !self.pending.is_empty() {
                let n = buf.len().min(self.pending.len());
                buf[..n].copy_from_slice(&self.pending.split_to(n));
                return Ok(n);
            }
            match self.ws.read() {
                Ok(Message::Binary(data)) => self.pending = data,
                Ok(Message::Close(_)) => return Ok(0),
                Ok(Message::Text(_)) => {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "text WebSocket message: MQTT uses binary messages [MQTT-6.0.0-1]",
                    ))
                }
                // Pings are answered by tungstenite itself.
                Ok(_) => {}
                Err(tungstenite::Error::ConnectionClosed | tungstenite::Error::AlreadyClosed) => {
                    return Ok(0)
                }
                Err(e) => return Err(ws_io_error(e)),
            }
        }
    }
}

fn ws_upgrade(
    layer: WsLayer,
    url: &BrokerUrl,
    transport: &TransportOptions,
    deadline: u64,
) -> Result<SyncWs, ClientError> {
    let fd = layer.socket().as_raw_fd();
    let request = ws_request(url, &transport.ws_path)?;
    let mut attempt = tungstenite::client::client_with_config(request, layer, Some(ws_config()));
    loop {
        match attempt {
            Ok((ws, _response)) => {
                return Ok(SyncWs {
                    ws,
                    pending: Bytes::new(),
                })
            }
            Err(HandshakeError::Failure(e)) => return Err(ws_error(e)),
            Err(HandshakeError::Interrupted(mid)) => {
                let left = deadline.saturating_sub(now_ns());
                if left == 0 {
                    return Err(ClientError::Timeout("WebSocket upgrade"));
                }
                wait_readable(fd, Duration::from_nanos(left));
                attempt = mid.handshake();
            }
        }
    }
}
