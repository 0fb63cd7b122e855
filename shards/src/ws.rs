//! MQTT over WebSocket for the `ws` and `wss` listeners (DESIGN.md §11;
//! MQTT 5 §6, MQTT 3.1.1 §6).
//!
//! [`accept`] runs the HTTP upgrade on any `futures-io` stream (a glommio
//! `TcpStream`, or a TLS stream over one for WSS), then hands the stream
//! to async-tungstenite: only path `/mqtt` is served (404 otherwise) and
//! the client must offer the `mqtt` subprotocol, which is echoed (400
//! otherwise) [MQTT-6.0.0-3]. Any other request gets an HTTP error answer
//! too (RFC 6455 §4.2.1; see [`accept_with_limit`]). The resulting
//! [`WsStream`] is a plain byte stream for the MQTT codec: reads concatenate the payloads of binary messages (an
//! MQTT packet may span messages and a message may hold several packets
//! [MQTT-6.0.0-2]); each write sends its bytes as one binary message;
//! closing sends a WebSocket close frame. A text message is a protocol
//! error [MQTT-6.0.0-1]: the read fails with `InvalidData`.
//!
//! The handshake has no timeout of its own: the caller's `connect_timeout`
//! covers it.

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use async_tungstenite::tungstenite::error::{CapacityError, ProtocolError};
use async_tungstenite::tungstenite::handshake::derive_accept_key;
use async_tungstenite::tungstenite::handshake::machine::TryParse;
use async_tungstenite::tungstenite::handshake::server::{write_response, Request, Response};
use async_tungstenite::tungstenite::http::StatusCode;
use async_tungstenite::tungstenite::protocol::{Role, WebSocketConfig};
use async_tungstenite::tungstenite::{self, Message};
use async_tungstenite::WebSocketStream;
use bytes::Bytes;
use futures_lite::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use futures_util::{Sink, Stream};

/// The only path served.
pub const PATH: &str = "/mqtt";
/// The required subprotocol.
pub const SUBPROTOCOL: &str = "mqtt";
/// Default bound on one WebSocket message, in bytes (the default
/// `limits.max_packet_size` plus room for a few packets): 2 MiB.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 2 << 20;

/// Why a WebSocket upgrade failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WsError {
    /// The request was refused with this HTTP status, sent to the client:
    /// 404 for a path other than `/mqtt`, 400 without the `mqtt`
    /// subprotocol, and the others [`accept_with_limit`] lists.
    #[error("WebSocket upgrade refused with HTTP {status}")]
    Refused {
        /// The HTTP status sent.
        status: u16,
    },
    /// The stream failed or ended before the request was answered.
    #[error("WebSocket handshake failed: {0}")]
    Handshake(#[source] tungstenite::Error),
}

/// Accepts a WebSocket upgrade on `stream` with messages of at most
/// [`DEFAULT_MAX_MESSAGE_BYTES`].
///
/// # Errors
///
/// [`WsError::Refused`] after answering a request it does not upgrade
/// (a wrong path, no `mqtt` subprotocol, not a WebSocket upgrade: see
/// [`accept_with_limit`]); [`WsError::Handshake`] when the stream fails or
/// ends first.
///
/// # Cancel safety
///
/// Not cancel safe: dropping the future drops the stream.
pub async fn accept<S>(stream: S) -> Result<WsStream<S>, WsError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    accept_with_limit(stream, DEFAULT_MAX_MESSAGE_BYTES).await
}

/// Bytes tungstenite reads from a WebSocket connection's socket at a time
/// (its `read_buffer_size`; a larger frame is still read whole). Its
/// default, 128 KiB, is zero-filled before each read, so every open
/// WebSocket connection kept 128 KiB resident: 140 KiB per idle
/// connection against 0.6 for plain TCP (perf/RESULTS.md, 2026-12-02,
/// session 17). 4 KiB is what tungstenite suggests for many connections.
pub const WS_READ_BUFFER_BYTES: usize = 4 << 10;

/// The largest upgrade request read, head and headers, in bytes: 16 KiB
/// (a browser's request with cookies fits; nginx's default header buffers
/// hold as much). A larger one is answered 431.
pub const MAX_REQUEST_BYTES: usize = 16 << 10;

/// As [`accept`], with messages (and frames) bounded by
/// `max_message_bytes`; a larger message fails the read.
///
/// Every request that is not a WebSocket upgrade to `/mqtt` offering the
/// `mqtt` subprotocol gets an HTTP answer before the connection closes,
/// as RFC 6455 §4.2.1 requires of a server that refuses a handshake:
/// 400 for a request that does not parse, a wrong HTTP version, no or
/// two `Host` headers, no single valid `Sec-WebSocket-Key`, or no `mqtt`
/// subprotocol (matched exactly, as it is echoed); 404 for another path;
/// 405 (with `Allow: GET`, and no body for HEAD) for another method; 426
/// (with `Upgrade: websocket`) for a plain HTTP request; 426 with
/// `Sec-WebSocket-Version: 13` for another protocol version (§4.4); 431
/// for a request of more than [`MAX_REQUEST_BYTES`] or 124 headers. What
/// the client sends after a refused request is read for up to 1 s before
/// the close, so that the answer is not lost to a reset.
///
/// # Errors
///
/// As [`accept`].
pub async fn accept_with_limit<S>(
    mut stream: S,
    max_message_bytes: usize,
) -> Result<WsStream<S>, WsError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let config = WebSocketConfig::default()
        .read_buffer_size(WS_READ_BUFFER_BYTES)
        .max_message_size(Some(max_message_bytes))
        .max_frame_size(Some(max_message_bytes));
    let (request, leftover) = match read_request(&mut stream).await? {
        Ok(read) => read,
        Err(refusal) => return Err(refuse(&mut stream, refusal).await),
    };
    let response = match check_request(&request) {
        Ok(response) => response,
        Err(refusal) => return Err(refuse(&mut stream, refusal).await),
    };
    let mut head = Vec::new();
    write_response(&mut head, &response).map_err(WsError::Handshake)?;
    stream.write_all(&head).await.map_err(handshake_io)?;
    stream.flush().await.map_err(handshake_io)?;
    let inner = if leftover.is_empty() {
        WebSocketStream::from_raw_socket(stream, Role::Server, Some(config)).await
    } else {
        // Frames the client sent right behind its request.
        WebSocketStream::from_partially_read(stream, leftover, Role::Server, Some(config)).await
    };
    Ok(WsStream {
        inner,
        pending: Bytes::new(),
    })
}

/// An HTTP refusal of an upgrade request: status, extra header, body,
/// and whether the request was a HEAD, whose answer has no body (RFC 9110
/// §9.3.2).
struct Refusal {
    status: StatusCode,
    header: Option<(&'static str, &'static str)>,
    body: &'static str,
    head_only: bool,
}

impl Refusal {
    fn new(status: StatusCode, body: &'static str) -> Self {
        Self {
            status,
            header: None,
            body,
            head_only: false,
        }
    }

    fn with(mut self, name: &'static str, value: &'static str) -> Self {
        self.header = Some((name, value));
        self
    }
}

fn handshake_io(e: io::Error) -> WsError {
    WsError::Handshake(tungstenite::Error::Io(e))
}

/// Read the request head (up to [`MAX_REQUEST_BYTES`]); returns it and the
/// bytes read after it. The outer error is the stream's (EOF included),
/// the inner one a request to refuse.
async fn read_request<S: AsyncRead + Unpin>(
    stream: &mut S,
) -> Result<Result<(Request, Vec<u8>), Refusal>, WsError> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 1024];
    loop {
        let n = stream.read(&mut chunk).await.map_err(handshake_io)?;
        if n == 0 {
            return Err(handshake_io(io::ErrorKind::UnexpectedEof.into()));
        }
        buf.extend_from_slice(&chunk[..n]);
        let too_large = || {
            Refusal::new(
                StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                "the upgrade request is larger than 16 KiB or has more than 124 headers\n",
            )
        };
        let refusal = match Request::try_parse(&buf) {
            Ok(Some((len, request))) => return Ok(Ok((request, buf.split_off(len)))),
            Ok(None) if buf.len() >= MAX_REQUEST_BYTES => too_large(),
            Ok(None) => continue,
            Err(tungstenite::Error::Capacity(CapacityError::TooManyHeaders)) => too_large(),
            Err(tungstenite::Error::Protocol(ProtocolError::WrongHttpMethod)) => Refusal::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "a WebSocket upgrade is a GET\n",
            )
            .with("Allow", "GET"),
            Err(tungstenite::Error::Protocol(ProtocolError::WrongHttpVersion)) => Refusal::new(
                StatusCode::BAD_REQUEST,
                "a WebSocket upgrade needs HTTP/1.1\n",
            ),
            Err(_) => Refusal::new(StatusCode::BAD_REQUEST, "not an HTTP request\n"),
        };
        return Ok(Err(Refusal {
            head_only: buf.starts_with(b"HEAD "),
            ..refusal
        }));
    }
}

/// At most this much of what follows a refused request is read and
/// dropped before the close (by [`crate::closing::discard`], which also
/// stops after 200 ms without data or 2 s in all): closing with unread
/// bytes sends a reset, which can destroy the answer before the client
/// reads it (RFC 9112 §9.6).
const DRAIN_BYTES: usize = 64 << 10;

/// Send `refusal` (without its body for a HEAD request), drain what the
/// client still sends, and make the error [`accept`] returns for it.
async fn refuse<S: AsyncRead + AsyncWrite + Unpin>(stream: &mut S, refusal: Refusal) -> WsError {
    let mut head = format!(
        "HTTP/1.1 {}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n",
        refusal.status,
        refusal.body.len()
    );
    if let Some((name, value)) = refusal.header {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    if !refusal.head_only {
        head.push_str(refusal.body);
    }
    // The peer may be gone already; the refusal stands either way.
    if stream.write_all(head.as_bytes()).await.is_ok() && stream.flush().await.is_ok() {
        crate::closing::discard(stream, crate::closing::Linger::refused(DRAIN_BYTES)).await;
    }
    WsError::Refused {
        status: refusal.status.as_u16(),
    }
}

/// Whether `key` is a `Sec-WebSocket-Key`: base64 of 16 bytes, so 22
/// base64 characters and `==` (RFC 6455 §4.1, client requirement 7).
fn is_websocket_key(key: &[u8]) -> bool {
    key.len() == 24
        && key.ends_with(b"==")
        && key[..22].iter().all(|b| b.is_ascii_alphanumeric() || *b == b'+' || *b == b'/')
}

/// The 101 response to `request`, or why it is refused (see
/// [`accept_with_limit`]). Header names are case-insensitive, as are the
/// `Connection` and `Upgrade` tokens, which may come in lists or on
/// several lines; the subprotocol token is matched exactly (RFC 6455
/// §4.2.2 has the server echo a value the client sent).
fn check_request(request: &Request) -> Result<Response, Refusal> {
    let headers = request.headers();
    let tokens = |name: &'static str| {
        headers
            .get_all(name)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(str::trim)
    };
    let once = |name: &'static str| {
        let mut values = headers.get_all(name).iter();
        match (values.next(), values.next()) {
            (Some(value), None) => Some(value),
            _ => None,
        }
    };
    if request.uri().path() != PATH {
        return Err(Refusal::new(StatusCode::NOT_FOUND, "MQTT is served on /mqtt\n"));
    }
    if once("host").is_none() {
        // RFC 9112 §3.2: a request without, or with more than one, Host.
        return Err(Refusal::new(StatusCode::BAD_REQUEST, "one Host header is needed\n"));
    }
    if !tokens("connection").any(|t| t.eq_ignore_ascii_case("upgrade"))
        || !tokens("upgrade").any(|t| t.eq_ignore_ascii_case("websocket"))
    {
        return Err(
            Refusal::new(
                StatusCode::UPGRADE_REQUIRED,
                "MQTT is served over WebSocket here: send a WebSocket upgrade\n",
            )
            .with("Upgrade", "websocket"),
        );
    }
    if once("sec-websocket-version").is_none_or(|v| v != "13") {
        return Err(
            Refusal::new(StatusCode::UPGRADE_REQUIRED, "only WebSocket version 13 is served\n")
                .with("Sec-WebSocket-Version", "13"),
        );
    }
    let Some(key) = once("sec-websocket-key").filter(|k| is_websocket_key(k.as_bytes())) else {
        return Err(Refusal::new(
            StatusCode::BAD_REQUEST,
            "one Sec-WebSocket-Key of 16 base64 bytes is needed\n",
        ));
    };
    if !tokens("sec-websocket-protocol").any(|t| t == SUBPROTOCOL) {
        return Err(Refusal::new(
            StatusCode::BAD_REQUEST,
            "the WebSocket subprotocol must be mqtt\n",
        ));
    }
    Response::builder()
        .status(StatusCode::SWITCHING_PROTOCOLS)
        .version(request.version())
        .header("Connection", "Upgrade")
        .header("Upgrade", "websocket")
        .header("Sec-WebSocket-Accept", derive_accept_key(key.as_bytes()))
        .header("Sec-WebSocket-Protocol", SUBPROTOCOL)
        .body(())
        .map_err(|_| Refusal::new(StatusCode::BAD_REQUEST, "a bad upgrade request\n"))
}

/// A WebSocket connection seen as a byte stream (see the module docs).
#[derive(Debug)]
pub struct WsStream<S> {
    inner: WebSocketStream<S>,
    /// Unread rest of the last binary message.
    pending: Bytes,
}

impl<S: AsyncRead + AsyncWrite + Unpin> WsStream<S> {
    /// The underlying stream (e.g. for the peer address).
    pub fn get_ref(&self) -> &S {
        self.inner.get_ref()
    }

    /// The underlying stream, mutably: for reading what a client sends
    /// after the broker's Close frame, below the WebSocket framing.
    pub fn get_mut(&mut self) -> &mut S {
        self.inner.get_mut()
    }
}

fn io_error(e: tungstenite::Error) -> io::Error {
    match e {
        tungstenite::Error::Io(e) => e,
        tungstenite::Error::ConnectionClosed | tungstenite::Error::AlreadyClosed => {
            io::Error::new(io::ErrorKind::BrokenPipe, "WebSocket closed")
        }
        other => io::Error::new(io::ErrorKind::InvalidData, other),
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for WsStream<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        loop {
            if !this.pending.is_empty() {
                let n = buf.len().min(this.pending.len());
                buf[..n].copy_from_slice(&this.pending.split_to(n));
                return Poll::Ready(Ok(n));
            }
            match ready!(Pin::new(&mut this.inner).poll_next(cx)) {
                None | Some(Ok(Message::Close(_))) => return Poll::Ready(Ok(0)),
                Some(Ok(Message::Binary(data))) => this.pending = data,
                Some(Ok(Message::Text(_))) => {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "text WebSocket message: MQTT uses binary messages [MQTT-6.0.0-1]",
                    )))
                }
                // Pings are answered by tungstenite itself.
                Some(Ok(_)) => {}
                Some(Err(e)) => return Poll::Ready(Err(io_error(e))),
            }
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for WsStream<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let mut inner = Pin::new(&mut self.get_mut().inner);
        ready!(inner.as_mut().poll_ready(cx)).map_err(io_error)?;
        inner
            .as_mut()
            .start_send(Message::Binary(Bytes::copy_from_slice(buf)))
            .map_err(io_error)?;
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner)
            .poll_flush(cx)
            .map_err(io_error)
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner)
            .poll_close(cx)
            .map_err(io_error)
    }
}

#[cfg(test)]
mod tests {
    use async_tungstenite::tungstenite::client::IntoClientRequest;
    use futures_lite::{AsyncReadExt, AsyncWriteExt};
    use futures_util::StreamExt;
    use async_tungstenite::tungstenite::http::HeaderValue;
    use glommio::net::{TcpListener, TcpStream};

    use super::*;

    /// Runs `test` on a glommio executor with a listener on port 0.
    fn run<F, Fut, T>(test: F) -> T
    where
        F: FnOnce(TcpListener) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = T> + 'static,
        T: Send + 'static,
    {
        glommio::LocalExecutorBuilder::default()
            .spawn(move || async move {
                let listener = TcpListener::bind("127.0.0.1:0").unwrap();
                test(listener).await
            })
            .unwrap()
            .join()
            .unwrap()
    }

    async fn client(
        addr: std::net::SocketAddr,
        path: &str,
        protocol: Option<&str>,
    ) -> Result<WebSocketStream<TcpStream>, tungstenite::Error> {
        let mut request = format!("ws://localhost{path}")
            .into_client_request()
            .unwrap();
        if let Some(p) = protocol {
            request
                .headers_mut()
                .insert("sec-websocket-protocol", HeaderValue::from_str(p).unwrap());
        }
        let stream = TcpStream::connect(addr).await.unwrap();
        let (ws, response) = async_tungstenite::client_async(request, stream).await?;
        assert_eq!(
            response
                .headers()
                .get("sec-websocket-protocol")
                .map(|v| v.to_str().unwrap()),
            Some("mqtt")
        );
        Ok(ws)
    }

    #[test]
    fn packets_split_across_and_packed_into_messages_read_as_one_byte_stream() {
        run(|listener| async move {
            let addr = listener.local_addr().unwrap();
            let server = glommio::spawn_local(async move {
                let stream = listener.accept().await.unwrap();
                let mut ws = accept(stream).await.unwrap();
                let mut got = vec![0u8; 10];
                ws.read_exact(&mut got).await.unwrap();
                let mut rest = Vec::new();
                ws.read_to_end(&mut rest).await.unwrap();
                (got, rest)
            });
            let mut c = client(addr, "/mqtt", Some("mqtt")).await.unwrap();
            // A PINGREQ split over two messages, then two packets in one.
            c.send(Message::binary(vec![0xC0])).await.unwrap();
            c.send(Message::binary(vec![0x00])).await.unwrap();
            c.send(Message::binary(vec![
                0xE0, 0x00, 0x30, 0x04, 0x00, 0x01, b'a', b'x',
            ]))
            .await
            .unwrap();
            c.send(Message::binary(vec![0xC0, 0x00])).await.unwrap();
            c.close(None).await.unwrap();
            let (got, rest) = server.await;
            assert_eq!(
                got,
                [0xC0, 0x00, 0xE0, 0x00, 0x30, 0x04, 0x00, 0x01, b'a', b'x']
            );
            assert_eq!(rest, [0xC0, 0x00], "close ends the stream after the data");
        });
    }

    #[test]
    fn each_write_is_one_binary_message_and_close_sends_a_close_frame() {
        run(|listener| async move {
            let addr = listener.local_addr().unwrap();
            let server = glommio::spawn_local(async move {
                let stream = listener.accept().await.unwrap();
                let mut ws = accept(stream).await.unwrap();
                ws.write_all(&[0x20, 0x02, 0x00, 0x00]).await.unwrap();
                ws.write_all(&[0xD0, 0x00]).await.unwrap();
                ws.flush().await.unwrap();
                ws.close().await.unwrap();
            });
            let mut c = client(addr, "/mqtt", Some("mqttv3.1, mqtt")).await.unwrap();
            let first = c.next().await.unwrap().unwrap();
            assert_eq!(first, Message::binary(vec![0x20, 0x02, 0x00, 0x00]));
            let second = c.next().await.unwrap().unwrap();
            assert_eq!(second, Message::binary(vec![0xD0, 0x00]));
            assert!(matches!(c.next().await, Some(Ok(Message::Close(_)))));
            server.await;
        });
    }

    #[test]
    fn other_paths_get_404_and_missing_subprotocols_400() {
        run(|listener| async move {
            let addr = listener.local_addr().unwrap();
            let server = glommio::spawn_local(async move {
                let mut statuses = Vec::new();
                for _ in 0..2 {
                    let stream = listener.accept().await.unwrap();
                    match accept(stream).await {
                        Err(WsError::Refused { status }) => statuses.push(status),
                        other => panic!("expected a refusal, got {:?}", other.map(|_| ())),
                    }
                }
                statuses
            });
            let err = client(addr, "/other", Some("mqtt")).await.unwrap_err();
            assert!(
                matches!(&err, tungstenite::Error::Http(r) if r.status() == 404),
                "{err}"
            );
            let err = client(addr, "/mqtt", None).await.unwrap_err();
            assert!(
                matches!(&err, tungstenite::Error::Http(r) if r.status() == 400),
                "{err}"
            );
            assert_eq!(server.await, [404, 400]);
        });
    }

    #[test]
    fn a_text_message_is_a_protocol_error() {
        run(|listener| async move {
            let addr = listener.local_addr().unwrap();
            let server = glommio::spawn_local(async move {
                let stream = listener.accept().await.unwrap();
                let mut ws = accept(stream).await.unwrap();
                let mut buf = [0u8; 4];
                ws.read(&mut buf).await.unwrap_err().kind()
            });
            let mut c = client(addr, "/mqtt", Some("mqtt")).await.unwrap();
            c.send(Message::text("hello")).await.unwrap();
            assert_eq!(server.await, io::ErrorKind::InvalidData);
        });
    }

    /// Send `request` on a raw connection; the status the broker's side
    /// returned and the whole answer the client read.
    async fn answer_to(listener: TcpListener, request: Vec<u8>) -> (u16, String) {
        let addr = listener.local_addr().unwrap();
        let server = glommio::spawn_local(async move {
            let stream = listener.accept().await.unwrap();
            match accept(stream).await {
                Err(WsError::Refused { status }) => status,
                other => panic!("expected a refusal, got {:?}", other.map(|_| ())),
            }
        });
        let mut c = TcpStream::connect(addr).await.unwrap();
        c.write_all(&request).await.unwrap();
        c.shutdown(std::net::Shutdown::Write).await.unwrap();
        let mut answer = Vec::new();
        // A clean close (no reset): the broker read what it refused.
        c.read_to_end(&mut answer).await.unwrap();
        (server.await, String::from_utf8_lossy(&answer).into_owned())
    }

    /// The status line and headers of the answer to `request` on a
    /// connection the broker accepts.
    async fn upgrade_answer(listener: TcpListener, request: String) -> String {
        let addr = listener.local_addr().unwrap();
        let server = glommio::spawn_local(async move {
            let stream = listener.accept().await.unwrap();
            accept(stream).await.map(|_| ()).map_err(|e| e.to_string())
        });
        let mut c = TcpStream::connect(addr).await.unwrap();
        c.write_all(request.as_bytes()).await.unwrap();
        let mut answer = vec![0u8; 512];
        let n = c.read(&mut answer).await.unwrap();
        server.await.expect("upgraded");
        String::from_utf8_lossy(&answer[..n]).into_owned()
    }

    /// Header names and the Connection and Upgrade tokens are
    /// case-insensitive and may be lists or repeated lines (RFC 6455
    /// §4.2.1, RFC 9110 §5.3); the accept key is RFC 6455 §1.3's example.
    #[test]
    fn upgrades_with_token_lists_and_repeated_lines_are_accepted() {
        for headers in [
            "connection: keep-alive, UPGRADE\r\nupgrade: WebSocket\r\n",
            "Connection: keep-alive\r\nConnection: Upgrade\r\nUpgrade: h2c\r\nUpgrade: websocket\r\n",
            "Connection: Upgrade\r\nUpgrade: foo, websocket\r\n",
        ] {
            let request = format!(
                "GET /mqtt HTTP/1.1\r\nHost: x\r\n{headers}Sec-WebSocket-Version: 13\r\n\
                 Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Protocol: mqtt\r\n\r\n"
            );
            let answer = run(|listener| upgrade_answer(listener, request));
            assert!(answer.starts_with("HTTP/1.1 101"), "{headers}: {answer}");
            assert!(
                answer.contains("s3pPLMBiTxaQ9kYGzzhZRbK+xOo="),
                "{headers}: {answer}"
            );
        }
    }

    const UPGRADE: &str = "Connection: Upgrade\r\nUpgrade: websocket\r\n\
        Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n";

    /// RFC 6455 §4.2.1: a server that refuses a handshake returns "an HTTP
    /// response with an appropriate error code"; §4.4: for an unknown
    /// version, 426 with the versions it understands.
    #[test]
    fn every_refused_request_gets_an_http_answer() {
        let cases: Vec<(&str, Vec<u8>, u16, &str)> = vec![
            ("plain GET", b"GET /mqtt HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(), 426, "upgrade: websocket"),
            ("plain GET elsewhere", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(), 404, ""),
            (
                "POST",
                format!("POST /mqtt HTTP/1.1\r\nHost: x\r\n{UPGRADE}\r\n").into_bytes(),
                405,
                "allow: get",
            ),
            (
                "version 8",
                format!("GET /mqtt HTTP/1.1\r\nHost: x\r\n{}Sec-WebSocket-Protocol: mqtt\r\n\r\n",
                    UPGRADE.replace("Version: 13", "Version: 8")).into_bytes(),
                426,
                "sec-websocket-version: 13",
            ),
            (
                "bad key",
                format!("GET /mqtt HTTP/1.1\r\nHost: x\r\n{}Sec-WebSocket-Protocol: mqtt\r\n\r\n",
                    UPGRADE.replace("dGhlIHNhbXBsZSBub25jZQ==", "short")).into_bytes(),
                400,
                "",
            ),
            (
                "subprotocol in another case",
                format!("GET /mqtt HTTP/1.1\r\nHost: x\r\n{UPGRADE}Sec-WebSocket-Protocol: MQTT\r\n\r\n")
                    .into_bytes(),
                400,
                "",
            ),
            (
                "no Host",
                format!("GET /mqtt HTTP/1.1\r\n{UPGRADE}Sec-WebSocket-Protocol: mqtt\r\n\r\n").into_bytes(),
                400,
                "",
            ),
            (
                "two Hosts",
                format!("GET /mqtt HTTP/1.1\r\nHost: x\r\nHost: y\r\n{UPGRADE}Sec-WebSocket-Protocol: mqtt\r\n\r\n")
                    .into_bytes(),
                400,
                "",
            ),
            (
                "two keys",
                format!("GET /mqtt HTTP/1.1\r\nHost: x\r\n{UPGRADE}Sec-WebSocket-Key: AQIDBAUGBwgJCgsMDQ4PEA==\r\n\
                         Sec-WebSocket-Protocol: mqtt\r\n\r\n")
                    .into_bytes(),
                400,
                "",
            ),
            (
                "130 headers",
                format!(
                    "GET /mqtt HTTP/1.1\r\nHost: x\r\n{UPGRADE}{}\r\n",
                    (0..130).map(|i| format!("X-{i}: v\r\n")).collect::<String>()
                )
                .into_bytes(),
                431,
                "",
            ),
            (
                "POST with a 3,000-byte body",
                [b"POST /other HTTP/1.1\r\nHost: x\r\nContent-Length: 3000\r\n\r\n".as_slice(), &[b'x'; 3000]].concat(),
                405,
                "",
            ),
            ("HTTP/1.0", b"GET /mqtt HTTP/1.0\r\n\r\n".to_vec(), 400, ""),
            ("not HTTP", b"\x10\x0c\x00\x04MQTT\x04\x02\x00\x3c\r\n\r\n".to_vec(), 400, ""),
            (
                "17 KiB of headers",
                format!("GET /mqtt HTTP/1.1\r\nX-Big: {}\r\n", "a".repeat(17 << 10)).into_bytes(),
                431,
                "",
            ),
        ];
        for (what, request, status, header) in cases {
            let (got, answer) = run(|listener| answer_to(listener, request));
            assert_eq!(got, status, "{what}: {answer}");
            let first = answer.lines().next().unwrap_or_default();
            assert!(first.starts_with(&format!("HTTP/1.1 {status} ")), "{what}: {answer}");
            assert!(answer.to_ascii_lowercase().contains(header), "{what}: {answer}");
            assert!(answer.contains("Connection: close"), "{what}: {answer}");
        }
        // HEAD: the same refusal without its body (RFC 9110 §9.3.2).
        let (status, answer) = run(|listener| {
            answer_to(listener, format!("HEAD /mqtt HTTP/1.1\r\nHost: x\r\n{UPGRADE}\r\n").into_bytes())
        });
        assert_eq!(status, 405);
        assert!(answer.ends_with("\r\n\r\n"), "{answer}");
    }

    #[test]
    fn a_frame_sent_right_behind_the_request_is_read() {
        run(|listener| async move {
            let addr = listener.local_addr().unwrap();
            let server = glommio::spawn_local(async move {
                let stream = listener.accept().await.unwrap();
                let mut ws = accept(stream).await.unwrap();
                let mut got = [0u8; 2];
                ws.read_exact(&mut got).await.unwrap();
                got
            });
            let mut c = TcpStream::connect(addr).await.unwrap();
            // The request and a masked binary frame holding a PINGREQ, in one write.
            let mut request = format!(
                "GET /mqtt HTTP/1.1\r\nHost: x\r\n{UPGRADE}Sec-WebSocket-Protocol: mqtt\r\n\r\n"
            )
            .into_bytes();
            let mask = [1u8, 2, 3, 4];
            request.extend_from_slice(&[0x82, 0x82]);
            request.extend_from_slice(&mask);
            // PINGREQ is 0xC0 0x00, each byte XORed with its mask byte.
            request.extend_from_slice(&[0xC0 ^ mask[0], mask[1]]);
            c.write_all(&request).await.unwrap();
            assert_eq!(server.await, [0xC0, 0x00]);
            let mut head = [0u8; 12];
            c.read_exact(&mut head).await.unwrap();
            assert_eq!(&head, b"HTTP/1.1 101");
        });
    }
}
