//! A PUBLISH read in place (MQTT 5 §3.3), for clients that only count and
//! time what they receive (fleetmq-loadgen's subscribers): no [`Packet`]
//! is built, nothing is allocated or copied, and the buffer is not
//! consumed.
//!
//! [`peek_publish`] checks what framing needs — the fixed header as
//! [`decode`] does, the Remaining Length, the packet size limit, a Topic
//! Name, Packet Identifier and property length that fit in the packet,
//! Packet Identifier not 0 — and leaves the rest unchecked: the Topic Name
//! is not validated as UTF-8 and the properties are not parsed. So every
//! PUBLISH that [`decode`] accepts reads the same here, and some that it
//! refuses (a topic that is not UTF-8, a bad property) read here too.
//!
//! [`Packet`]: crate::packet::Packet
//! [`decode`]: super::decode

use super::{check_first_byte, kind, remaining_length, DecodeError};
use crate::packet::{PacketId, ProtocolVersion, QoS};

/// What is at the front of a receive buffer, per [`peek_publish`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Peeked<'a> {
    /// No whole packet yet: read more bytes.
    Incomplete,
    /// A whole PUBLISH, read in place.
    Publish(PublishView<'a>),
    /// A whole packet of another type: decode it with [`super::decode`].
    Other,
}

/// A PUBLISH borrowed from the receive buffer (MQTT 5 §3.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PublishView<'a> {
    /// Bytes of the whole packet, fixed header included: how far to
    /// advance the buffer past it.
    pub len: usize,
    /// DUP flag.
    pub dup: bool,
    /// QoS level.
    pub qos: QoS,
    /// RETAIN flag.
    pub retain: bool,
    /// Packet Identifier: present exactly when QoS > 0.
    pub packet_id: Option<PacketId>,
    /// Topic Name bytes (not checked for UTF-8).
    pub topic: &'a [u8],
    /// MQTT 5 property bytes, not parsed (empty before MQTT 5).
    pub properties: &'a [u8],
    /// Application payload.
    pub payload: &'a [u8],
}

const PAST_END: DecodeError = DecodeError::Malformed("PUBLISH field runs past the end of the packet");

/// Reads the packet at the front of `buf` (a connection of protocol
/// `version`, after CONNECT) without consuming it: a PUBLISH in place, or
/// only whether another packet is whole.
///
/// # Errors
/// [`DecodeError::Malformed`] for a bad fixed header (as [`super::decode`]),
/// a Topic Name, Packet Identifier or property length running past the
/// packet, or Packet Identifier 0 `[MQTT-2.2.1-3]`;
/// [`DecodeError::TooLarge`] when the fixed header announces more than
/// `max_packet_size` bytes.
pub fn peek_publish(
    buf: &[u8],
    version: ProtocolVersion,
    max_packet_size: usize,
) -> Result<Peeked<'_>, DecodeError> {
    let Some(&first) = buf.first() else {
        return Ok(Peeked::Incomplete);
    };
    check_first_byte(first, Some(version))?;
    let Some((remaining, header_len)) = remaining_length(buf)? else {
        return Ok(Peeked::Incomplete);
    };
    let len = header_len + remaining;
    if len > max_packet_size {
        return Err(DecodeError::TooLarge { size: len, max: max_packet_size });
    }
    if buf.len() < len {
        return Ok(Peeked::Incomplete);
    }
    if first >> 4 != kind::PUBLISH {
        return Ok(Peeked::Other);
    }
    let body = &buf[header_len..len];
    let qos = QoS::from_u8((first >> 1) & 0b11)
        .ok_or(DecodeError::Malformed("PUBLISH QoS 3 [MQTT-3.3.1-4]"))?;
    let topic_len = usize::from(u16::from_be_bytes(two(body, 0)?));
    let topic = body.get(2..2 + topic_len).ok_or(PAST_END)?;
    let mut at = 2 + topic_len;
    let packet_id = if qos == QoS::AtMostOnce {
        None
    } else {
        let id = u16::from_be_bytes(two(body, at)?);
        at += 2;
        Some(PacketId::new(id).ok_or(DecodeError::Malformed("packet identifier 0 [MQTT-2.2.1-3]"))?)
    };
    let properties: &[u8] = if version.is_v5() {
        let (n, used) = property_length(&body[at..])?;
        at += used;
        let properties = body.get(at..at + n).ok_or(PAST_END)?;
        at += n;
        properties
    } else {
        &[]
    };
    Ok(Peeked::Publish(PublishView {
        len,
        dup: first & 0b1000 != 0,
        qos,
        retain: first & 0b0001 != 0,
        packet_id,
        topic,
        properties,
        payload: &body[at..],
    }))
}

/// The two bytes of `body` at `at`.
fn two(body: &[u8], at: usize) -> Result<[u8; 2], DecodeError> {
    match body.get(at..at + 2) {
        Some(&[a, b]) => Ok([a, b]),
        _ => Err(PAST_END),
    }
}

/// The Property Length (a Variable Byte Integer, MQTT 5 §1.5.5) at the
/// front of `bytes`: (value, bytes it takes).
fn property_length(bytes: &[u8]) -> Result<(usize, usize), DecodeError> {
    let mut value = 0usize;
    for i in 0..4 {
        let &byte = bytes.get(i).ok_or(PAST_END)?;
        value |= usize::from(byte & 0x7F) << (7 * i);
        if byte & 0x80 == 0 {
            if i > 0 && byte == 0 {
                return Err(DecodeError::Malformed(
                    "Variable Byte Integer not in its minimal encoding [MQTT-1.5.5-1]",
                ));
            }
            return Ok((value, i + 1));
        }
    }
    Err(DecodeError::Malformed("Variable Byte Integer longer than 4 bytes"))
}
