//! The MQTT wire codec: [`decode`] one packet from the front of a receive
//! buffer, [`encode`] one packet into a send buffer, in the format of MQTT
//! 3.1 (protocol level 3), 3.1.1 (level 4) or 5.0 (level 5).
//!
//! The codec is sans-I/O: it never reads a socket, and "need more bytes"
//! (`Ok(None)`) is an ordinary result, distinct from a malformed packet
//! (STYLE.md habit 2). Decoding slices the receive buffer, so payloads and
//! strings are never copied.
//!
//! One file per packet family: `connect` (CONNECT, CONNACK, DISCONNECT,
//! AUTH), `publish` (PUBLISH and its acknowledgements),
//! `subscribe` (SUBSCRIBE, SUBACK, UNSUBSCRIBE, UNSUBACK); `properties`
//! holds the MQTT 5 property table and `data` the primitive types of §1.5;
//! `peek` reads a PUBLISH in place, for clients that only count what they
//! receive.

mod connect;
mod data;
mod peek;
mod properties;
mod publish;
mod subscribe;

#[cfg(test)]
mod tests;

use bytes::{Buf, BufMut, BytesMut};

use super::{Packet, ProtocolVersion, ReasonCode};
use data::{put_varint, varint_len, Reader, VARINT_MAX};
pub use peek::{peek_publish, Peeked, PublishView};

/// Why [`decode`] refused the bytes. After any of these the connection must
/// be closed (MQTT 5 §4.13); [`DecodeError::reason_code`] gives the reason
/// code for the CONNACK or DISCONNECT sent before closing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// Malformed Packet (0x81): the bytes cannot be parsed as the packet
    /// they announce. Remaining Length or another Variable Byte Integer
    /// longer than 4 bytes, reserved fixed-header flag bits wrong
    /// `[MQTT-2.1.3-1]`, PUBLISH QoS 3 or QoS 0 with DUP `[MQTT-3.3.1-2]`,
    /// packet type 0 or (3.1.x) 15, a string that is not UTF-8 or contains
    /// U+0000 `[MQTT-1.5.4-1]` `[MQTT-1.5.4-2]`, packet identifier 0
    /// `[MQTT-2.2.1-3]`, a property unknown or not allowed on the packet
    /// (§2.2.2.2), a reason code not allowed on the packet (§2.4), a field
    /// running past the end of the packet, trailing bytes, bad CONNECT or
    /// SUBSCRIBE flag bits. The text says which.
    #[error("malformed packet: {0}")]
    Malformed(&'static str),
    /// Protocol Error (0x82): the packet parses but breaks a rule the spec
    /// calls a Protocol Error: a packet other than CONNECT first
    /// `[MQTT-3.1.0-1]`, a property included twice, Receive Maximum,
    /// Maximum Packet Size or Subscription Identifier 0, a 0-or-1 property
    /// with another value, Authentication Data without a Method, Retain
    /// Handling 3, SUBSCRIBE or UNSUBSCRIBE without a topic filter
    /// `[MQTT-3.8.3-2]` `[MQTT-3.10.3-2]`.
    #[error("protocol error: {0}")]
    Protocol(&'static str),
    /// Packet too large (0x95): the fixed header announces a packet of
    /// `size` bytes (fixed header plus Remaining Length), more than the
    /// caller's `max` bytes. Detected from the fixed header alone, before
    /// the body is buffered.
    #[error("packet of {size} bytes exceeds the maximum of {max} bytes")]
    TooLarge {
        /// Size of the whole packet in bytes, as announced.
        size: usize,
        /// The `max_packet_size` given to [`decode`], in bytes.
        max: usize,
    },
    /// A CONNECT with an unknown protocol name or level (the level byte is
    /// carried): the server answers CONNACK 0x84 (3.1.1: return code 1) and
    /// closes `[MQTT-3.1.2-2]`.
    #[error("unsupported protocol version {0}")]
    UnsupportedProtocolVersion(u8),
}

impl DecodeError {
    /// The MQTT 5 reason code for this error: 0x81, 0x82, 0x95 or 0x84.
    pub fn reason_code(&self) -> ReasonCode {
        match self {
            DecodeError::Malformed(_) => ReasonCode::MALFORMED_PACKET,
            DecodeError::Protocol(_) => ReasonCode::PROTOCOL_ERROR,
            DecodeError::TooLarge { .. } => ReasonCode::PACKET_TOO_LARGE,
            DecodeError::UnsupportedProtocolVersion(_) => ReasonCode::UNSUPPORTED_PROTOCOL_VERSION,
        }
    }
}

/// Why [`encode`] refused a packet. Nothing is appended when it fails.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EncodeError {
    /// The Remaining Length would be `size` bytes, above the `max` of
    /// 268,435,455 a Variable Byte Integer can carry (§2.1.4).
    #[error("packet body of {size} bytes exceeds the maximum of {max} bytes")]
    TooLarge {
        /// The Remaining Length in bytes.
        size: usize,
        /// The largest allowed Remaining Length in bytes.
        max: usize,
    },
    /// The packet does not exist in the target version (AUTH on 3.1.x).
    #[error("not in this protocol version: {0}")]
    NotInVersion(&'static str),
    /// A field holds a value the wire format cannot carry: a string or
    /// binary field over 65,535 bytes, a Subscription Identifier outside
    /// 1..=268,435,455, a PUBLISH whose packet identifier does not match its
    /// QoS `[MQTT-2.2.1-2]`, a SUBSCRIBE or UNSUBSCRIBE without filters.
    #[error("invalid packet: {0}")]
    Invalid(&'static str),
}

/// Control packet type numbers (MQTT 5 §2.1.2).
mod kind {
    pub(super) const CONNECT: u8 = 1;
    pub(super) const CONNACK: u8 = 2;
    pub(super) const PUBLISH: u8 = 3;
    pub(super) const PUBACK: u8 = 4;
    pub(super) const PUBREC: u8 = 5;
    pub(super) const PUBREL: u8 = 6;
    pub(super) const PUBCOMP: u8 = 7;
    pub(super) const SUBSCRIBE: u8 = 8;
    pub(super) const SUBACK: u8 = 9;
    pub(super) const UNSUBSCRIBE: u8 = 10;
    pub(super) const UNSUBACK: u8 = 11;
    pub(super) const PINGREQ: u8 = 12;
    pub(super) const PINGRESP: u8 = 13;
    pub(super) const DISCONNECT: u8 = 14;
    pub(super) const AUTH: u8 = 15;
}

/// Decodes one packet from the front of `buf`.
///
/// - `version`: `None` until a CONNECT was accepted; then only a CONNECT is
///   decoded, anything else fails with [`DecodeError::Protocol`]
///   `[MQTT-3.1.0-1]`. `Some(v)` afterwards: packets are decoded per `v`
///   (3.1 and 3.1.1 share one encoding). A CONNECT is always decoded per
///   its own protocol level; rejecting a second one is the session's job.
/// - `max_packet_size`: the largest whole packet accepted, in bytes.
///
/// Returns `Ok(None)` when `buf` holds only a prefix of a packet (`buf` is
/// untouched), `Ok(Some(packet))` with `buf` advanced past exactly that
/// packet. Payloads and strings are slices of `buf`'s memory.
///
/// # Errors
/// Any [`DecodeError`]; the connection must then be closed, and `buf` is in
/// an unspecified state. Bad first bytes, a 5-byte Remaining Length and
/// [`DecodeError::TooLarge`] are reported as soon as the fixed header shows
/// them, without waiting for the body.
pub fn decode(
    buf: &mut BytesMut,
    version: Option<ProtocolVersion>,
    max_packet_size: usize,
) -> Result<Option<Packet>, DecodeError> {
    let Some(&first) = buf.first() else {
        return Ok(None);
    };
    check_first_byte(first, version)?;
    let Some((remaining, header_len)) = remaining_length(buf)? else {
        return Ok(None);
    };
    let size = header_len + remaining;
    if size > max_packet_size {
        return Err(DecodeError::TooLarge {
            size,
            max: max_packet_size,
        });
    }
    if buf.len() < size {
        return Ok(None);
    }
    buf.advance(header_len);
    let mut r = Reader::new(buf.split_to(remaining).freeze());
    let packet = decode_body(first, &mut r, version)?;
    r.finish()?;
    Ok(Some(packet))
}

/// Checks the packet type and its fixed-header flags (MQTT 5 §2.1.3).
fn check_first_byte(first: u8, version: Option<ProtocolVersion>) -> Result<(), DecodeError> {
    let (ty, flags) = (first >> 4, first & 0x0F);
    let Some(version) = version else {
        if ty != kind::CONNECT {
            return Err(DecodeError::Protocol(
                "first packet must be CONNECT [MQTT-3.1.0-1]",
            ));
        }
        return check_flags(flags, 0);
    };
    match ty {
        0 => Err(DecodeError::Malformed("reserved packet type 0")),
        kind::AUTH if !version.is_v5() => Err(DecodeError::Malformed(
            "packet type 15 is reserved before MQTT 5",
        )),
        kind::PUBLISH => publish::check_flags(flags),
        kind::PUBREL | kind::SUBSCRIBE | kind::UNSUBSCRIBE => check_flags(flags, 0b0010),
        _ => check_flags(flags, 0),
    }
}

fn check_flags(flags: u8, expected: u8) -> Result<(), DecodeError> {
    if flags == expected {
        Ok(())
    } else {
        Err(DecodeError::Malformed(
            "reserved fixed header flags [MQTT-2.1.3-1]",
        ))
    }
}

/// The protocol level of the CONNECT at the front of `buf` (MQTT 5
/// §3.1.2.2: 4 for 3.1.1, 5 for MQTT 5; after the fixed header and the
/// Protocol Name), when that much has arrived: how to answer a CONNECT
/// refused before it is whole, such as one over the size limit
/// ([`DecodeError::TooLarge`]). `None` when the bytes are not there yet or
/// the fixed header is malformed.
pub fn connect_protocol_level(buf: &[u8]) -> Option<u8> {
    let (_, header_len) = remaining_length(buf).ok()??;
    let name = buf.get(header_len..header_len + 2)?;
    let name_len = usize::from(u16::from_be_bytes([name[0], name[1]]));
    buf.get(header_len + 2 + name_len).copied()
}

/// The whole size, in bytes, of the packet at the front of `buf` (fixed
/// header and Remaining Length, MQTT 5 §2.1.4) once its fixed header has
/// arrived: how far a connection is from a complete CONNECT. `None` when
/// the fixed header is not all there yet or is malformed.
pub fn packet_size(buf: &[u8]) -> Option<usize> {
    let (remaining, header_len) = remaining_length(buf).ok()??;
    Some(header_len + remaining)
}

/// Parses the Remaining Length (MQTT 5 §2.1.4) after the first byte:
/// `Some((remaining length, fixed header length))`, or `None` when more
/// bytes are needed. A fourth byte with the continuation bit is Malformed at
/// once, without waiting for a fifth; so is a non-minimal encoding.
fn remaining_length(buf: &[u8]) -> Result<Option<(usize, usize)>, DecodeError> {
    let mut value = 0usize;
    for i in 0..4 {
        let Some(&byte) = buf.get(1 + i) else {
            return Ok(None);
        };
        value |= usize::from(byte & 0x7F) << (7 * i);
        if byte & 0x80 == 0 {
            if i > 0 && byte == 0 {
                // `[MQTT-1.5.5-1]`: the minimum number of bytes.
                return Err(DecodeError::Malformed("Remaining Length not in its minimal encoding [MQTT-1.5.5-1]"));
            }
            return Ok(Some((value, 2 + i)));
        }
    }
    Err(DecodeError::Malformed(
        "Remaining Length longer than 4 bytes",
    ))
}

fn decode_body(
    first: u8,
    r: &mut Reader,
    version: Option<ProtocolVersion>,
) -> Result<Packet, DecodeError> {
    let ty = first >> 4;
    if ty == kind::CONNECT {
        return Ok(Packet::Connect(Box::new(connect::decode_connect(r)?)));
    }
    // `check_first_byte` let only a CONNECT through without a version.
    let v = version.ok_or(DecodeError::Protocol(
        "first packet must be CONNECT [MQTT-3.1.0-1]",
    ))?;
    Ok(match ty {
        kind::CONNACK => Packet::ConnAck(connect::decode_connack(r, v)?),
        kind::PUBLISH => Packet::Publish(publish::decode_publish(first, r, v)?),
        kind::PUBACK => Packet::PubAck(publish::decode_response(r, v, publish::ACK_REASONS)?),
        kind::PUBREC => Packet::PubRec(publish::decode_response(r, v, publish::ACK_REASONS)?),
        kind::PUBREL => Packet::PubRel(publish::decode_response(r, v, publish::REL_REASONS)?),
        kind::PUBCOMP => Packet::PubComp(publish::decode_response(r, v, publish::REL_REASONS)?),
        kind::SUBSCRIBE => Packet::Subscribe(subscribe::decode_subscribe(r, v)?),
        kind::SUBACK => Packet::SubAck(subscribe::decode_suback(r, v)?),
        kind::UNSUBSCRIBE => Packet::Unsubscribe(subscribe::decode_unsubscribe(r, v)?),
        kind::UNSUBACK => Packet::UnsubAck(subscribe::decode_unsuback(r, v)?),
        kind::PINGREQ => Packet::PingReq,
        kind::PINGRESP => Packet::PingResp,
        kind::DISCONNECT => Packet::Disconnect(connect::decode_disconnect(r, v)?),
        kind::AUTH => Packet::Auth(connect::decode_auth(r)?),
        _ => return Err(DecodeError::Malformed("reserved packet type 0")),
    })
}

/// Appends `packet` to `out` in the wire format of `version`.
///
/// - A CONNECT is written in the format of its own `protocol` field (it
///   announces the version), whatever `version` says.
/// - 3.1.x: properties are omitted; CONNACK carries
///   [`ReasonCode::to_v3_connack`]; SUBACK keeps 0x00..=0x02 and writes any
///   other code as 0x80; PUBACK/PUBREC/PUBREL/PUBCOMP carry only the packet
///   identifier, UNSUBACK has no payload and DISCONNECT no body.
/// - MQTT 5 short forms: PUBACK/PUBREC/PUBREL/PUBCOMP with Success and no
///   properties are 2 bytes of packet identifier (§3.4.2.1); DISCONNECT
///   with Normal disconnection and AUTH with Success and no properties have
///   Remaining Length 0 (§3.14.2.1, §3.15.2.1).
/// - Properties a packet cannot carry (MQTT 5 §2.2.2.2) are left out.
///
/// `out` grows by exactly [`encoded_len`] bytes, reserved up front.
///
/// # Errors
/// [`EncodeError`]; nothing is appended to `out` then.
pub fn encode(
    packet: &Packet,
    version: ProtocolVersion,
    out: &mut BytesMut,
) -> Result<(), EncodeError> {
    if matches!(packet, Packet::Auth(_)) && !version.is_v5() {
        return Err(EncodeError::NotInVersion("AUTH exists only in MQTT 5"));
    }
    let remaining = body_len(packet, version);
    if remaining > VARINT_MAX {
        return Err(EncodeError::TooLarge {
            size: remaining,
            max: VARINT_MAX,
        });
    }
    let start = out.len();
    out.reserve(1 + varint_len(remaining) + remaining);
    out.put_u8(first_byte(packet));
    put_varint(out, remaining);
    if let Err(e) = encode_body(packet, version, out) {
        out.truncate(start);
        return Err(e);
    }
    debug_assert_eq!(out.len() - start, 1 + varint_len(remaining) + remaining);
    Ok(())
}

/// The number of bytes [`encode`] appends for `packet` in `version`: lets
/// the caller check a client's Maximum Packet Size (MQTT 5 §3.1.2.11.4)
/// before encoding. For a packet `encode` rejects the value is meaningless.
pub fn encoded_len(packet: &Packet, version: ProtocolVersion) -> usize {
    let remaining = body_len(packet, version);
    1 + varint_len(remaining) + remaining
}

fn first_byte(packet: &Packet) -> u8 {
    let (ty, flags) = match packet {
        Packet::Connect(_) => (kind::CONNECT, 0),
        Packet::ConnAck(_) => (kind::CONNACK, 0),
        Packet::Publish(p) => (kind::PUBLISH, publish::flags(p)),
        Packet::PubAck(_) => (kind::PUBACK, 0),
        Packet::PubRec(_) => (kind::PUBREC, 0),
        Packet::PubRel(_) => (kind::PUBREL, 0b0010),
        Packet::PubComp(_) => (kind::PUBCOMP, 0),
        Packet::Subscribe(_) => (kind::SUBSCRIBE, 0b0010),
        Packet::SubAck(_) => (kind::SUBACK, 0),
        Packet::Unsubscribe(_) => (kind::UNSUBSCRIBE, 0b0010),
        Packet::UnsubAck(_) => (kind::UNSUBACK, 0),
        Packet::PingReq => (kind::PINGREQ, 0),
        Packet::PingResp => (kind::PINGRESP, 0),
        Packet::Disconnect(_) => (kind::DISCONNECT, 0),
        Packet::Auth(_) => (kind::AUTH, 0),
    };
    ty << 4 | flags
}

/// The Remaining Length of `packet` in `version`.
fn body_len(packet: &Packet, v: ProtocolVersion) -> usize {
    match packet {
        Packet::Connect(c) => connect::connect_len(c),
        Packet::ConnAck(c) => connect::connack_len(c, v),
        Packet::Publish(p) => publish::publish_len(p, v),
        Packet::PubAck(p) | Packet::PubRec(p) | Packet::PubRel(p) | Packet::PubComp(p) => {
            publish::response_len(p, v)
        }
        Packet::Subscribe(s) => subscribe::subscribe_len(s, v),
        Packet::SubAck(s) => subscribe::suback_len(s, v),
        Packet::Unsubscribe(u) => subscribe::unsubscribe_len(u, v),
        Packet::UnsubAck(u) => subscribe::unsuback_len(u, v),
        Packet::PingReq | Packet::PingResp => 0,
        Packet::Disconnect(d) => connect::disconnect_len(d, v),
        Packet::Auth(a) => connect::auth_len(a),
    }
}

fn encode_body(packet: &Packet, v: ProtocolVersion, out: &mut BytesMut) -> Result<(), EncodeError> {
    match packet {
        Packet::Connect(c) => connect::encode_connect(c, out),
        Packet::ConnAck(c) => connect::encode_connack(c, v, out),
        Packet::Publish(p) => publish::encode_publish(p, v, out),
        Packet::PubAck(p) | Packet::PubRec(p) | Packet::PubRel(p) | Packet::PubComp(p) => {
            publish::encode_response(p, v, out)
        }
        Packet::Subscribe(s) => subscribe::encode_subscribe(s, v, out),
        Packet::SubAck(s) => subscribe::encode_suback(s, v, out),
        Packet::Unsubscribe(u) => subscribe::encode_unsubscribe(u, v, out),
        Packet::UnsubAck(u) => subscribe::encode_unsuback(u, v, out),
        Packet::PingReq | Packet::PingResp => Ok(()),
        Packet::Disconnect(d) => connect::encode_disconnect(d, v, out),
        Packet::Auth(a) => connect::encode_auth(a, out),
    }
}

/// Reads a one-byte MQTT 5 reason code and checks it is one `allowed` on
/// this packet (MQTT 5 §2.4 and each packet's Reason Code section);
/// another value is a Malformed Packet.
fn reason(r: &mut Reader, allowed: &[u8]) -> Result<ReasonCode, DecodeError> {
    let code = r.u8()?;
    if allowed.contains(&code) {
        Ok(ReasonCode(code))
    } else {
        Err(DecodeError::Malformed(
            "reason code not allowed on this packet",
        ))
    }
}

/// Append PUBLISH properties `p` as MQTT 5 encodes them (a Variable Byte
/// Integer length, then the properties; Topic Alias and Subscription
/// Identifiers included when set): the form the local store keeps them in.
///
/// # Errors
/// [`EncodeError`] when they exceed what a Variable Byte Integer can count.
pub fn encode_publish_properties(p: &super::Props, out: &mut BytesMut) -> Result<(), EncodeError> {
    properties::encode(p, properties::Scope::Publish, out)
}

/// Read PUBLISH properties written by [`encode_publish_properties`] from
/// the front of `bytes`; returns them and the bytes after them.
///
/// # Errors
/// [`DecodeError`] for bytes that are not properties a PUBLISH may carry.
pub fn decode_publish_properties(bytes: bytes::Bytes) -> Result<(super::Props, bytes::Bytes), DecodeError> {
    let mut r = Reader::new(bytes);
    let p = properties::decode(&mut r, properties::Scope::Publish)?;
    Ok((p, r.rest()))
}
