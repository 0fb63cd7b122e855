//! The lean MQTT client: CONNECT/SUBSCRIBE handshakes with deadlines, a
//! PUBLISH template patched in place per message (no allocation per
//! message), all encoding and decoding through `fleetmq_core`'s codec.

use std::num::NonZeroU16;
use std::time::Duration;

use bytes::BytesMut;
use bytestring::ByteString;
use fleetmq_core::packet::codec::{decode, encode, peek_publish, DecodeError, Peeked};
use fleetmq_core::topic::{validate_topic_name, TopicLimits};
use fleetmq_core::packet::{
    Connect, Packet, PacketId, Properties, Props, ProtocolVersion, PubResponse, Publish, QoS, Subscribe,
    SubscriptionOptions,
};
use futures_lite::future::or;
use futures_lite::io::{AsyncReadExt, AsyncWriteExt};
use glommio::timer::sleep;

use crate::options::{BrokerUrl, PAYLOAD_HEADER_BYTES};
use crate::transport::async_stream::{self, Stream};
use crate::transport::TransportOptions;

/// Largest packet any run accepts from the broker, bytes (MQTT's largest:
/// a Remaining Length of 268,435,455 plus the fixed header).
pub const MAX_PACKET_BYTES: usize = 256 * 1024 * 1024 + 1024;

/// The largest packet a run with `payload_size`-byte payloads accepts from
/// the broker, bytes: the payload, the longest Topic Name (65,535 bytes and
/// its length), and 1 KiB for the fixed header, Packet Identifier and
/// properties; at most [`MAX_PACKET_BYTES`]. A broker announcing a larger
/// packet fails the connection at its fixed header ("packet too large")
/// instead of having the loadgen buffer up to 256 MiB per connection. MQTT 5
/// CONNECTs announce it as Maximum Packet Size (MQTT 5 §3.1.2.11.4), so a
/// compliant broker never sends one.
pub fn max_packet_for(payload_size: usize) -> usize {
    payload_size
        .saturating_add(2 + 65_535 + 1024)
        .min(MAX_PACKET_BYTES)
}

/// Bytes read from the socket at most per read.
const READ_CHUNK: usize = 64 * 1024;

/// Why a client failed; [`ClientError::kind`] names the error count.
#[derive(Debug)]
pub enum ClientError {
    /// The TCP connect failed (refused, unreachable, timed out).
    Connect(std::io::Error),
    /// The TLS handshake failed (unknown CA, a certificate not valid for
    /// the URL's host, a client certificate refused, not a TLS server), or
    /// the TLS session failed later; the text is rustls's reason.
    Tls(String),
    /// The WebSocket upgrade was refused (the text names the HTTP status)
    /// or broke the protocol (e.g. no `mqtt` subprotocol in the answer).
    WebSocket(String),
    /// The broker answered CONNACK with a failure reason code.
    Refused(String),
    /// A SUBSCRIBE was refused in its SUBACK.
    SubscribeRefused(String),
    /// No answer within the deadline; the text names what was awaited.
    Timeout(&'static str),
    /// The broker closed the connection.
    Closed,
    /// A socket read or write failed.
    Io(std::io::Error),
    /// The broker sent bytes the codec refused.
    Decode(DecodeError),
    /// The broker sent a PUBLISH whose Topic Name breaks the specification
    /// (not UTF-8, empty, U+0000, a wildcard; MQTT 5 §4.7.3).
    BadTopic(String),
    /// The broker sent a packet that makes no sense here.
    Unexpected(&'static str),
}

impl std::error::Error for ClientError {}

impl std::fmt::Display for ClientError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ClientError::Connect(e) => write!(f, "TCP connect failed: {e}"),
            ClientError::Tls(e) => write!(f, "TLS handshake failed: {e}"),
            ClientError::WebSocket(e) => write!(f, "WebSocket upgrade failed: {e}"),
            ClientError::Refused(r) => write!(f, "CONNACK refused the connection: {r}"),
            ClientError::SubscribeRefused(r) => write!(f, "SUBACK refused the subscription: {r}"),
            ClientError::Timeout(what) => write!(f, "timed out waiting for {what}"),
            ClientError::Closed => write!(f, "the broker closed the connection"),
            ClientError::Io(e) => write!(f, "socket error: {e}"),
            ClientError::Decode(e) => write!(f, "bad packet from the broker: {e}"),
            ClientError::BadTopic(why) => write!(f, "bad PUBLISH Topic Name from the broker: {why}"),
            ClientError::Unexpected(what) => write!(f, "unexpected packet: {what}"),
        }
    }
}

impl ClientError {
    /// A short, stable name for counting errors by kind.
    pub fn kind(&self) -> &'static str {
        match self {
            ClientError::Connect(_) => "connect failed",
            ClientError::Tls(_) => "tls failed",
            ClientError::WebSocket(_) => "websocket upgrade failed",
            ClientError::Refused(_) => "connack refused",
            ClientError::SubscribeRefused(_) => "suback refused",
            ClientError::Timeout(_) => "timeout",
            ClientError::Closed => "closed by broker",
            ClientError::Io(_) => "socket error",
            ClientError::Decode(_) | ClientError::BadTopic(_) => "malformed packet",
            ClientError::Unexpected(_) => "unexpected packet",
        }
    }
}

/// A SUBSCRIBE (packet identifier 1) for one `filter` at `qos`.
pub fn subscribe_packet(filter: &str, qos: QoS) -> Packet {
    Packet::Subscribe(Subscribe {
        packet_id: PacketId::MIN,
        properties: Props::default(),
        filters: vec![(
            ByteString::from(filter),
            SubscriptionOptions {
                qos,
                ..Default::default()
            },
        )],
    })
}

/// What every CONNECT carries.
#[derive(Debug, Clone)]
pub struct ConnectOptions {
    /// Protocol version.
    pub version: ProtocolVersion,
    /// Keep Alive, seconds; 0 disables it.
    pub keep_alive: u16,
    /// User name.
    pub username: Option<String>,
    /// Password.
    pub password: Option<String>,
    /// Deadline for the TCP connect, for the TLS handshake and WebSocket
    /// upgrade, and for the CONNACK, each.
    pub timeout: Duration,
    /// TLS configuration and WebSocket path for non-`mqtt://` URLs.
    pub transport: TransportOptions,
    /// Largest packet accepted from the broker, bytes (see
    /// [`max_packet_for`]).
    pub max_packet_size: usize,
}

/// A connected client: the stream, what was read but not yet decoded, and
/// what the broker announced.
pub struct Conn {
    /// The stream (TCP, TLS or WebSocket), TCP_NODELAY set.
    pub stream: Stream,
    /// Bytes read and not yet decoded.
    pub buf: BytesMut,
    scratch: Vec<u8>,
    /// The protocol version.
    pub version: ProtocolVersion,
    /// Largest packet accepted from the broker, bytes.
    pub max_packet_size: usize,
    /// Receive Maximum announced by the broker (MQTT 5), else 65,535.
    pub receive_maximum: u16,
}

impl Conn {
    /// Opens a connection to `url` (TCP, then TLS and the WebSocket upgrade
    /// as its scheme says), sends CONNECT and waits for a successful
    /// CONNACK.
    ///
    /// # Errors
    /// [`ClientError::Connect`], [`ClientError::Tls`],
    /// [`ClientError::WebSocket`], [`ClientError::Refused`],
    /// [`ClientError::Timeout`] or any read error.
    pub async fn connect(
        url: &BrokerUrl,
        client_id: &str,
        o: &ConnectOptions,
    ) -> Result<Conn, ClientError> {
        Self::connect_session(url, client_id, o, true, None).await
    }

    /// As [`Conn::connect`], with the CONNECT's Clean Start (MQTT 3.1.1:
    /// Clean Session) flag `clean_start` and, on MQTT 5, the Session
    /// Expiry Interval `session_expiry` in seconds when given.
    ///
    /// # Errors
    /// As [`Conn::connect`].
    pub async fn connect_session(
        url: &BrokerUrl,
        client_id: &str,
        o: &ConnectOptions,
        clean_start: bool,
        session_expiry: Option<u32>,
    ) -> Result<Conn, ClientError> {
        let stream = async_stream::open(url, &o.transport, o.timeout).await?;
        let mut conn = Conn {
            stream,
            buf: BytesMut::with_capacity(256),
            scratch: vec![0; 512],
            version: o.version,
            max_packet_size: o.max_packet_size,
            receive_maximum: u16::MAX,
        };
        let connect = Connect {
            protocol: o.version,
            clean_start,
            keep_alive: o.keep_alive,
            client_id: ByteString::from(client_id),
            will: None,
            username: o.username.as_deref().map(ByteString::from),
            password: o
                .password
                .as_ref()
                .map(|p| bytes::Bytes::from(p.clone().into_bytes())),
            properties: connect_properties(o, session_expiry),
        };
        conn.send(&Packet::Connect(Box::new(connect))).await?;
        match conn.next_packet_within(o.timeout, "CONNACK").await? {
            Packet::ConnAck(ack) if ack.reason.is_error() => {
                Err(ClientError::Refused(format!("{}", ack.reason)))
            }
            Packet::ConnAck(ack) => {
                if let Some(max) = ack.properties.receive_maximum {
                    conn.receive_maximum = max;
                }
                Ok(conn)
            }
            _ => Err(ClientError::Unexpected("expected CONNACK")),
        }
    }

    /// Subscribes to `filter` at `qos` and waits for a successful SUBACK.
    ///
    /// # Errors
    /// [`ClientError::SubscribeRefused`], [`ClientError::Timeout`] or any
    /// read or write error.
    pub async fn subscribe(
        &mut self,
        filter: &str,
        qos: QoS,
        timeout: Duration,
    ) -> Result<(), ClientError> {
        self.send(&subscribe_packet(filter, qos)).await?;
        match self.next_packet_within(timeout, "SUBACK").await? {
            Packet::SubAck(ack) => match ack.reasons.first() {
                Some(r) if !r.is_error() => Ok(()),
                Some(r) => Err(ClientError::SubscribeRefused(format!("{filter}: {r}"))),
                None => Err(ClientError::Unexpected("SUBACK without reason codes")),
            },
            _ => Err(ClientError::Unexpected("expected SUBACK")),
        }
    }

    /// Encodes and writes one packet.
    ///
    /// # Errors
    /// [`ClientError::Io`] (or [`ClientError::Tls`]) when the write fails.
    pub async fn send(&mut self, packet: &Packet) -> Result<(), ClientError> {
        let mut out = BytesMut::new();
        encode(packet, self.version, &mut out)
            .map_err(|_| ClientError::Unexpected("cannot encode"))?;
        self.write(&out).await
    }

    /// Writes `bytes` and flushes them (TLS and WebSocket buffer until a
    /// flush; on TCP it costs nothing).
    ///
    /// # Errors
    /// [`ClientError::Io`] (or [`ClientError::Tls`]) when the write fails.
    pub async fn write(&mut self, bytes: &[u8]) -> Result<(), ClientError> {
        let flush = self.stream.needs_flush();
        write_flushed(&mut self.stream, bytes, flush).await
    }

    /// Waits for the next packet for at most `timeout`.
    ///
    /// # Errors
    /// [`ClientError::Timeout`] naming `what`, or any read error.
    pub async fn next_packet_within(
        &mut self,
        timeout: Duration,
        what: &'static str,
    ) -> Result<Packet, ClientError> {
        or(self.next_packet(), async {
            sleep(timeout).await;
            Err(ClientError::Timeout(what))
        })
        .await
    }

    /// Waits for the next packet.
    ///
    /// # Errors
    /// [`ClientError::Closed`], [`ClientError::Io`] or
    /// [`ClientError::Decode`].
    pub async fn next_packet(&mut self) -> Result<Packet, ClientError> {
        loop {
            if let Some(p) = decode(&mut self.buf, Some(self.version), self.max_packet_size)
                .map_err(ClientError::Decode)?
            {
                return Ok(p);
            }
            self.fill().await?;
        }
    }

    /// Reads once from the socket into `buf`; returns the bytes read.
    ///
    /// # Errors
    /// [`ClientError::Closed`] on end of stream, [`ClientError::Timeout`]
    /// when a read timeout set on the socket expires, [`ClientError::Io`].
    pub async fn fill(&mut self) -> Result<usize, ClientError> {
        match self.stream.read(&mut self.scratch).await {
            Ok(0) => Err(ClientError::Closed),
            Ok(n) => {
                self.buf.extend_from_slice(&self.scratch[..n]);
                // A full read means traffic: read in big chunks from now on.
                if n == self.scratch.len() && n < READ_CHUNK {
                    self.scratch.resize(READ_CHUNK, 0);
                }
                Ok(n)
            }
            Err(e) => Err(crate::transport::tls::classify_io(e)),
        }
    }

    /// Reads the packet at the front of `buf` in place: a PUBLISH's
    /// fields, or only that another packet (decode it with
    /// [`Conn::decode_buffered`]) or more bytes are needed. The caller
    /// advances `buf` past a PUBLISH ([`PublishView::len`]).
    ///
    /// # Errors
    /// [`ClientError::Decode`].
    ///
    /// [`PublishView::len`]: fleetmq_core::packet::codec::PublishView::len
    pub fn peek_publish(&self) -> Result<Peeked<'_>, ClientError> {
        let peeked = peek_publish(&self.buf, self.version, self.max_packet_size).map_err(ClientError::Decode)?;
        if let Peeked::Publish(p) = &peeked {
            check_topic(p.topic)?;
            if !p.properties.is_empty() {
                check_properties(&self.buf[..p.len], self.version)?;
            }
        }
        Ok(peeked)
    }

    /// Decodes the next complete packet already in `buf`, if any.
    ///
    /// # Errors
    /// [`ClientError::Decode`].
    pub fn decode_buffered(&mut self) -> Result<Option<Packet>, ClientError> {
        decode(&mut self.buf, Some(self.version), self.max_packet_size).map_err(ClientError::Decode)
    }
}

/// The CONNECT properties of a loadgen client: on MQTT 5, Maximum Packet
/// Size from `o` and `session_expiry` (seconds) when given; none on 3.1.x.
pub fn connect_properties(o: &ConnectOptions, session_expiry: Option<u32>) -> Props {
    let mut properties = Properties::default();
    if o.version.is_v5() {
        properties.maximum_packet_size = Some(u32::try_from(o.max_packet_size).unwrap_or(u32::MAX));
        properties.session_expiry_interval = session_expiry;
    }
    properties.into()
}

/// Checks a received Topic Name as MQTT requires (UTF-8, not empty, no
/// U+0000, no wildcard, at most 65,535 bytes; MQTT 5 §4.7.3, §1.5.4); the
/// in-place read leaves that to the client. Empty is an error too: the
/// loadgen allows no Topic Alias, so a PUBLISH must name its topic.
///
/// # Errors
/// [`ClientError::BadTopic`] saying which rule.
pub fn check_topic(topic: &[u8]) -> Result<(), ClientError> {
    let name = std::str::from_utf8(topic)
        .map_err(|_| ClientError::BadTopic("not UTF-8 [MQTT-1.5.4-1]".into()))?;
    let limits = TopicLimits { max_levels: usize::MAX, max_bytes: usize::from(u16::MAX) };
    validate_topic_name(name, &limits).map_err(|e| ClientError::BadTopic(e.to_string()))
}

/// Checks the properties of one whole MQTT 5 PUBLISH `packet`, which the
/// in-place read leaves unparsed: the full decoder's checks (identifiers
/// allowed on PUBLISH, no repeats, lengths), and no Topic Alias, since the
/// loadgen's CONNECT announces no Topic Alias Maximum, so 0 `[MQTT-3.1.2-26]`.
/// Decodes a copy of the packet: only PUBLISH packets with properties pay.
///
/// # Errors
/// [`ClientError::Decode`], or [`ClientError::Unexpected`] for a Topic
/// Alias.
pub fn check_properties(packet: &[u8], version: ProtocolVersion) -> Result<(), ClientError> {
    let mut one = BytesMut::from(packet);
    match decode(&mut one, Some(version), packet.len()).map_err(ClientError::Decode)? {
        Some(Packet::Publish(p)) if p.properties.topic_alias.is_some() => Err(ClientError::Unexpected(
            "a PUBLISH with a Topic Alias, which the loadgen's CONNECT does not allow (Topic Alias Maximum 0) [MQTT-3.1.2-26]",
        )),
        _ => Ok(()),
    }
}

/// Writes all of `bytes` to `w`, then flushes it when `flush` (TLS and
/// WebSocket buffer until a flush; a TCP stream has nothing to flush, so
/// the hot path of `mqtt://` skips it, see [`Stream::needs_flush`]).
///
/// # Errors
/// [`ClientError::Io`] (or [`ClientError::Tls`]) when the write fails.
///
/// # Cancel safety
/// Not cancel safe: part of `bytes` may have been written.
pub async fn write_flushed<W: futures_lite::AsyncWrite + Unpin>(
    w: &mut W,
    bytes: &[u8],
    flush: bool,
) -> Result<(), ClientError> {
    use crate::transport::tls::classify_io;
    w.write_all(bytes).await.map_err(classify_io)?;
    if flush {
        w.flush().await.map_err(classify_io)?;
    }
    Ok(())
}

/// Appends the acknowledgement `packet` (PUBACK, PUBREC, PUBREL, PUBCOMP)
/// for `id` to `out`.
pub fn put_response(
    out: &mut BytesMut,
    version: ProtocolVersion,
    id: PacketId,
    kind: fn(PubResponse) -> Packet,
) {
    // A success response with no properties always encodes.
    let _ = encode(&kind(PubResponse::success(id)), version, out);
}

/// A PUBLISH encoded once by the codec; each message copies it and patches
/// the timestamp, sequence and packet identifier in place.
#[derive(Debug, Clone)]
pub struct PublishTemplate {
    bytes: Vec<u8>,
    payload_at: usize,
    packet_id_at: Option<usize>,
}

impl PublishTemplate {
    /// A PUBLISH of `payload_size` bytes (≥ 16) to `topic` at `qos`.
    ///
    /// # Panics
    /// When the codec refuses the packet (a topic over 65,535 bytes).
    pub fn new(
        topic: &str,
        qos: QoS,
        payload_size: usize,
        version: ProtocolVersion,
    ) -> PublishTemplate {
        PublishTemplate::with_retain(topic, qos, payload_size, version, false)
    }

    /// [`PublishTemplate::new`] with the RETAIN flag `retain`.
    ///
    /// # Panics
    /// As [`PublishTemplate::new`].
    pub fn with_retain(
        topic: &str,
        qos: QoS,
        payload_size: usize,
        version: ProtocolVersion,
        retain: bool,
    ) -> PublishTemplate {
        assert!(payload_size >= PAYLOAD_HEADER_BYTES);
        let publish = Publish {
            dup: false,
            qos,
            retain,
            topic: ByteString::from(topic),
            packet_id: (qos != QoS::AtMostOnce).then_some(PacketId::MIN),
            properties: Props::default(),
            payload: bytes::Bytes::from(vec![0x5A; payload_size]),
        };
        let mut out = BytesMut::new();
        encode(&Packet::Publish(publish), version, &mut out).expect("the PUBLISH template encodes");
        let payload_at = out.len() - payload_size;
        // Packet identifier, then (MQTT 5) a zero Property Length byte.
        let props = usize::from(version.is_v5());
        let packet_id_at = (qos != QoS::AtMostOnce).then(|| payload_at - props - 2);
        PublishTemplate {
            bytes: out.to_vec(),
            payload_at,
            packet_id_at,
        }
    }

    /// Encoded size of one message, bytes.
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    /// Always false: a PUBLISH has a fixed header.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// Appends one message stamped with `time_ns` and `seq`.
    pub fn put(&self, out: &mut BytesMut, time_ns: u64, seq: u64, packet_id: Option<NonZeroU16>) {
        let start = out.len();
        out.extend_from_slice(&self.bytes);
        let msg = &mut out[start..];
        msg[self.payload_at..self.payload_at + 8].copy_from_slice(&time_ns.to_le_bytes());
        msg[self.payload_at + 8..self.payload_at + 16].copy_from_slice(&seq.to_le_bytes());
        if let (Some(at), Some(id)) = (self.packet_id_at, packet_id) {
            msg[at..at + 2].copy_from_slice(&id.get().to_be_bytes());
        }
    }
}

/// The send time and sequence at the front of a payload, if it is long enough.
pub fn stamp(payload: &[u8]) -> Option<(u64, u64)> {
    let t = u64::from_le_bytes(payload.get(..8)?.try_into().ok()?);
    let s = u64::from_le_bytes(payload.get(8..16)?.try_into().ok()?);
    Some((t, s))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(version: ProtocolVersion) -> ConnectOptions {
        ConnectOptions {
            version,
            keep_alive: 60,
            username: None,
            password: None,
            timeout: Duration::from_secs(1),
            transport: TransportOptions::default(),
            max_packet_size: max_packet_for(64),
        }
    }

    fn v5_publish(properties: Properties) -> BytesMut {
        let publish = Publish {
            dup: false,
            qos: QoS::AtMostOnce,
            retain: false,
            topic: ByteString::from("a/b"),
            packet_id: None,
            properties: properties.into(),
            payload: bytes::Bytes::from_static(&[0x5A; 16]),
        };
        let mut buf = BytesMut::new();
        encode(&Packet::Publish(publish), ProtocolVersion::V5, &mut buf).unwrap();
        buf
    }

    #[test]
    fn a_received_topic_alias_is_refused_as_the_connect_allowed_none() {
        // [MQTT-3.1.2-26]: no Topic Alias Maximum in CONNECT means 0.
        let with_alias = v5_publish(Properties { topic_alias: Some(1), ..Properties::default() });
        let err = check_properties(&with_alias, ProtocolVersion::V5).unwrap_err();
        assert!(err.to_string().contains("Topic Alias"), "{err}");
        assert_eq!(err.kind(), "unexpected packet");
        let expiry = v5_publish(Properties { message_expiry_interval: Some(5), ..Properties::default() });
        check_properties(&expiry, ProtocolVersion::V5).unwrap();
    }

    #[test]
    fn malformed_publish_properties_are_reported() {
        // Message Expiry Interval twice: a Protocol Error (MQTT 5 §2.2.2.2).
        let mut bad = v5_publish(Properties::default());
        // Fixed header (2) + topic (2 + 3); the Property Length byte is 0.
        assert_eq!(bad[7], 0);
        let props = [0x02, 0, 0, 0, 5, 0x02, 0, 0, 0, 5];
        bad[7] = props.len() as u8;
        let tail = bad.split_off(8);
        bad.extend_from_slice(&props);
        bad.extend_from_slice(&tail);
        bad[1] += props.len() as u8;
        let err = check_properties(&bad, ProtocolVersion::V5).unwrap_err();
        assert_eq!(err.kind(), "malformed packet", "{err}");
    }

    #[test]
    fn the_packet_limit_covers_payload_longest_topic_and_headers_and_is_capped() {
        assert_eq!(max_packet_for(64), 64 + 2 + 65_535 + 1024);
        assert_eq!(max_packet_for(usize::MAX), MAX_PACKET_BYTES);
    }

    #[test]
    fn mqtt5_connects_announce_the_limit_as_maximum_packet_size() {
        // MQTT 5 §3.1.2.11.4: the broker must not send a larger packet.
        let p = connect_properties(&options(ProtocolVersion::V5), Some(30));
        assert_eq!(p.maximum_packet_size, Some((64 + 2 + 65_535 + 1024) as u32));
        assert_eq!(p.session_expiry_interval, Some(30));
        // MQTT 3.1.1 has no properties.
        assert!(connect_properties(&options(ProtocolVersion::V3_1_1), Some(30)).is_empty());
    }

    fn decode_one(buf: &mut BytesMut, v: ProtocolVersion) -> Publish {
        match decode(buf, Some(v), MAX_PACKET_BYTES).unwrap().unwrap() {
            Packet::Publish(p) => p,
            other => panic!("expected PUBLISH, got {other:?}"),
        }
    }

    #[test]
    fn patched_templates_decode_with_their_stamp_and_packet_id() {
        for v in [ProtocolVersion::V3_1_1, ProtocolVersion::V5] {
            for qos in [QoS::AtMostOnce, QoS::AtLeastOnce, QoS::ExactlyOnce] {
                let t = PublishTemplate::new("lg/7", qos, 64, v);
                let mut out = BytesMut::new();
                let id = NonZeroU16::new(0xBEEF);
                t.put(&mut out, 123_456_789, 42, id);
                t.put(&mut out, 5, 6, NonZeroU16::new(2));
                let p = decode_one(&mut out, v);
                assert_eq!(&p.topic[..], "lg/7");
                assert_eq!(p.payload.len(), 64);
                assert_eq!(stamp(&p.payload), Some((123_456_789, 42)));
                let expect_id = if qos == QoS::AtMostOnce { None } else { id };
                assert_eq!(p.packet_id, expect_id, "{v:?} {qos:?}");
                assert_eq!(stamp(&decode_one(&mut out, v).payload), Some((5, 6)));
                assert!(out.is_empty());
            }
        }
    }
}
