//! MQTT over WebSocket for the `ws` and `wss` listeners (DESIGN.md §11;
//! MQTT 5 §6, MQTT 3.1.1 §6).
//!
//! [`accept`] runs the HTTP upgrade on any `futures-io` stream (a glommio
//! `TcpStream`, or a TLS stream over one for WSS) with async-tungstenite:
//! only path `/mqtt` is served (404 otherwise) and the client must offer
//! the `mqtt` subprotocol, which is echoed (400 otherwise)
//! [MQTT-6.0.0-3]. The resulting [`WsStream`] is a plain byte stream for
//! the MQTT codec: reads concatenate the payloads of binary messages (an
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

use async_tungstenite::tungstenite::handshake::server::{ErrorResponse, Request, Response};
use async_tungstenite::tungstenite::http::{HeaderValue, StatusCode};
use async_tungstenite::tungstenite::protocol::WebSocketConfig;
use async_tungstenite::tungstenite::{self, Message};
use async_tungstenite::WebSocketStream;
use bytes::Bytes;
use futures_lite::{AsyncRead, AsyncWrite};
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
    /// The request was refused with this HTTP status: 404 for a path other
    /// than `/mqtt`, 400 without the `mqtt` subprotocol.
    #[error("WebSocket upgrade refused with HTTP {status}")]
    Refused {
        /// The HTTP status sent.
        status: u16,
    },
    /// Not a valid upgrade request, or the stream failed during it.
    #[error("WebSocket handshake failed: {0}")]
    Handshake(#[source] tungstenite::Error),
}

/// Accepts a WebSocket upgrade on `stream` with messages of at most
/// [`DEFAULT_MAX_MESSAGE_BYTES`].
///
/// # Errors
///
/// [`WsError::Refused`] after answering a wrong path or a missing
/// subprotocol; [`WsError::Handshake`] for a request that is not a
/// WebSocket upgrade or an I/O error.
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

/// As [`accept`], with messages (and frames) bounded by
/// `max_message_bytes`; a larger message fails the read.
///
/// # Errors
///
/// As [`accept`].
// The refusal type is tungstenite's `Callback` contract, not ours.
#[allow(clippy::result_large_err)]
pub async fn accept_with_limit<S>(
    stream: S,
    max_message_bytes: usize,
) -> Result<WsStream<S>, WsError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let config = WebSocketConfig::default()
        .read_buffer_size(WS_READ_BUFFER_BYTES)
        .max_message_size(Some(max_message_bytes))
        .max_frame_size(Some(max_message_bytes));
    let mut refused = None;
    let check = |request: &Request, response: Response| {
        let result = check_request(request, response);
        if let Err(e) = &result {
            refused = Some(e.status().as_u16());
        }
        result
    };
    match async_tungstenite::accept_hdr_async_with_config(stream, check, Some(config)).await {
        Ok(inner) => Ok(WsStream {
            inner,
            pending: Bytes::new(),
        }),
        Err(_) if refused.is_some() => Err(WsError::Refused {
            status: refused.unwrap_or_default(),
        }),
        Err(e) => Err(WsError::Handshake(e)),
    }
}

#[allow(clippy::result_large_err)] // tungstenite's `Callback` signature
fn check_request(request: &Request, mut response: Response) -> Result<Response, ErrorResponse> {
    let refuse = |status: StatusCode, why: &str| {
        let mut r = ErrorResponse::new(Some(why.to_owned()));
        *r.status_mut() = status;
        r
    };
    if request.uri().path() != PATH {
        return Err(refuse(StatusCode::NOT_FOUND, "MQTT is served on /mqtt\n"));
    }
    let offers_mqtt = request
        .headers()
        .get_all("sec-websocket-protocol")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|p| p.trim() == SUBPROTOCOL);
    if !offers_mqtt {
        return Err(refuse(
            StatusCode::BAD_REQUEST,
            "the WebSocket subprotocol must be mqtt\n",
        ));
    }
    response.headers_mut().insert(
        "sec-websocket-protocol",
        HeaderValue::from_static(SUBPROTOCOL),
    );
    Ok(response)
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
    use glommio::net::{TcpListener, TcpStream};

    use super::*;

    /// Runs `test` on a glommio executor with a listener on port 0.
    fn run<F, Fut>(test: F)
    where
        F: FnOnce(TcpListener) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + 'static,
    {
        glommio::LocalExecutorBuilder::default()
            .spawn(move || async move {
                let listener = TcpListener::bind("127.0.0.1:0").unwrap();
                test(listener).await
            })
            .unwrap()
            .join()
            .unwrap();
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

    #[test]
    fn a_plain_http_request_is_a_handshake_error() {
        run(|listener| async move {
            let addr = listener.local_addr().unwrap();
            let server = glommio::spawn_local(async move {
                let stream = listener.accept().await.unwrap();
                accept(stream).await.map(|_| ())
            });
            let mut c = TcpStream::connect(addr).await.unwrap();
            c.write_all(b"GET /mqtt HTTP/1.1\r\nHost: x\r\n\r\n")
                .await
                .unwrap();
            assert!(matches!(server.await, Err(WsError::Handshake(_))));
        });
    }
}
