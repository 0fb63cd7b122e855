//! Subscription packets: SUBSCRIBE (§3.8), SUBACK (§3.9), UNSUBSCRIBE
//! (§3.10) and UNSUBACK (§3.11).

use bytes::{BufMut, BytesMut};

use super::data::{binary_len, put_string, Reader};
use super::properties::{self, Scope};
use super::{reason, DecodeError, EncodeError};
use crate::packet::{
    Properties, Props, ProtocolVersion, QoS, ReasonCode, RetainHandling, SubAck, Subscribe,
    SubscriptionOptions, UnsubAck, Unsubscribe,
};

/// SUBACK reason codes (MQTT 5 §3.9.3).
const SUBACK_REASONS: &[u8] = &[
    0x00, 0x01, 0x02, 0x80, 0x83, 0x87, 0x8F, 0x91, 0x97, 0x9E, 0xA1, 0xA2,
];

/// SUBACK return codes of 3.1.x (3.1.1 §3.9.3, `[MQTT-3.9.3-2]`).
const SUBACK_V3_RETURN_CODES: &[u8] = &[0x00, 0x01, 0x02, 0x80];

/// UNSUBACK reason codes (MQTT 5 §3.11.3).
const UNSUBACK_REASONS: &[u8] = &[0x00, 0x11, 0x80, 0x83, 0x87, 0x8F, 0x91];

// Subscription Options bits (MQTT 5 §3.8.3.1).
const NO_LOCAL: u8 = 0x04;
const RETAIN_AS_PUBLISHED: u8 = 0x08;
const RETAIN_HANDLING_SHIFT: u8 = 4;

/// Decodes one Subscription Options byte (MQTT 5 §3.8.3.1; 3.1.1
/// §3.8.3: only the QoS bits, the others must be 0 `[MQTT-3.8.3-4]`).
fn decode_options(byte: u8, v: ProtocolVersion) -> Result<SubscriptionOptions, DecodeError> {
    let qos = QoS::from_u8(byte & 0b11).ok_or(DecodeError::Malformed("subscription QoS 3"))?;
    if !v.is_v5() {
        if byte & !0b11 != 0 {
            return Err(DecodeError::Malformed(
                "SUBSCRIBE reserved option bits set (3.1.1) [MQTT-3.8.3-4]",
            ));
        }
        return Ok(SubscriptionOptions {
            qos,
            ..SubscriptionOptions::default()
        });
    }
    if byte & 0xC0 != 0 {
        return Err(DecodeError::Malformed(
            "SUBSCRIBE reserved option bits 6-7 set [MQTT-3.8.3-5]",
        ));
    }
    let retain_handling = match (byte >> RETAIN_HANDLING_SHIFT) & 0b11 {
        0 => RetainHandling::SendAtSubscribe,
        1 => RetainHandling::SendIfNew,
        2 => RetainHandling::DoNotSend,
        _ => return Err(DecodeError::Protocol("Retain Handling 3")),
    };
    Ok(SubscriptionOptions {
        qos,
        no_local: byte & NO_LOCAL != 0,
        retain_as_published: byte & RETAIN_AS_PUBLISHED != 0,
        retain_handling,
    })
}

fn encode_options(o: &SubscriptionOptions, v: ProtocolVersion) -> u8 {
    let mut byte = o.qos as u8;
    if v.is_v5() {
        if o.no_local {
            byte |= NO_LOCAL;
        }
        if o.retain_as_published {
            byte |= RETAIN_AS_PUBLISHED;
        }
        byte |= (o.retain_handling as u8) << RETAIN_HANDLING_SHIFT;
    }
    byte
}

/// Reads Property Length and properties in MQTT 5, nothing in 3.1.x.
fn decode_properties(
    r: &mut Reader,
    v: ProtocolVersion,
    scope: Scope,
) -> Result<Props, DecodeError> {
    if v.is_v5() {
        properties::decode(r, scope)
    } else {
        Ok(Props::default())
    }
}

fn properties_len(p: &Properties, v: ProtocolVersion, scope: Scope) -> usize {
    if v.is_v5() {
        properties::encoded_len(p, scope)
    } else {
        0
    }
}

fn encode_properties(
    p: &Properties,
    v: ProtocolVersion,
    scope: Scope,
    out: &mut BytesMut,
) -> Result<(), EncodeError> {
    if v.is_v5() {
        properties::encode(p, scope, out)
    } else {
        Ok(())
    }
}

/// Decodes SUBSCRIBE; an empty filter list is a Protocol Error
/// `[MQTT-3.8.3-2]` (3.1.1 `[MQTT-3.8.3-3]`).
pub(super) fn decode_subscribe(
    r: &mut Reader,
    v: ProtocolVersion,
) -> Result<Subscribe, DecodeError> {
    let packet_id = r.packet_id()?;
    let properties = decode_properties(r, v, Scope::Subscribe)?;
    let mut filters = Vec::new();
    while !r.is_empty() {
        let filter = r.string()?;
        let options = decode_options(r.u8()?, v)?;
        filters.push((filter, options));
    }
    if filters.is_empty() {
        return Err(DecodeError::Protocol(
            "SUBSCRIBE without topic filters [MQTT-3.8.3-2]",
        ));
    }
    Ok(Subscribe {
        packet_id,
        properties,
        filters,
    })
}

pub(super) fn subscribe_len(s: &Subscribe, v: ProtocolVersion) -> usize {
    let filters: usize = s
        .filters
        .iter()
        .map(|(f, _)| binary_len(f.as_bytes()) + 1)
        .sum();
    2 + properties_len(&s.properties, v, Scope::Subscribe) + filters
}

pub(super) fn encode_subscribe(
    s: &Subscribe,
    v: ProtocolVersion,
    out: &mut BytesMut,
) -> Result<(), EncodeError> {
    if s.filters.is_empty() {
        return Err(EncodeError::Invalid(
            "SUBSCRIBE without topic filters [MQTT-3.8.3-2]",
        ));
    }
    out.put_u16(s.packet_id.get());
    encode_properties(&s.properties, v, Scope::Subscribe, out)?;
    for (filter, options) in &s.filters {
        put_string(out, filter)?;
        out.put_u8(encode_options(options, v));
    }
    Ok(())
}

/// Decodes SUBACK: one reason code per remaining byte.
pub(super) fn decode_suback(r: &mut Reader, v: ProtocolVersion) -> Result<SubAck, DecodeError> {
    let packet_id = r.packet_id()?;
    let properties = decode_properties(r, v, Scope::SubAck)?;
    let allowed = if v.is_v5() {
        SUBACK_REASONS
    } else {
        SUBACK_V3_RETURN_CODES
    };
    // The capacity is bounded by bytes already received.
    let mut reasons = Vec::with_capacity(r.remaining());
    while !r.is_empty() {
        reasons.push(reason(r, allowed)?);
    }
    Ok(SubAck {
        packet_id,
        properties,
        reasons,
    })
}

pub(super) fn suback_len(s: &SubAck, v: ProtocolVersion) -> usize {
    2 + properties_len(&s.properties, v, Scope::SubAck) + s.reasons.len()
}

pub(super) fn encode_suback(
    s: &SubAck,
    v: ProtocolVersion,
    out: &mut BytesMut,
) -> Result<(), EncodeError> {
    out.put_u16(s.packet_id.get());
    encode_properties(&s.properties, v, Scope::SubAck, out)?;
    for &code in &s.reasons {
        let byte = match code {
            _ if v.is_v5() => code.0,
            ReasonCode(0x00..=0x02) => code.0,
            _ => ReasonCode::UNSPECIFIED_ERROR.0,
        };
        out.put_u8(byte);
    }
    Ok(())
}

/// Decodes UNSUBSCRIBE; an empty filter list is a Protocol Error
/// `[MQTT-3.10.3-2]`.
pub(super) fn decode_unsubscribe(
    r: &mut Reader,
    v: ProtocolVersion,
) -> Result<Unsubscribe, DecodeError> {
    let packet_id = r.packet_id()?;
    let properties = decode_properties(r, v, Scope::Unsubscribe)?;
    let mut filters = Vec::new();
    while !r.is_empty() {
        filters.push(r.string()?);
    }
    if filters.is_empty() {
        return Err(DecodeError::Protocol(
            "UNSUBSCRIBE without topic filters [MQTT-3.10.3-2]",
        ));
    }
    Ok(Unsubscribe {
        packet_id,
        properties,
        filters,
    })
}

pub(super) fn unsubscribe_len(u: &Unsubscribe, v: ProtocolVersion) -> usize {
    let filters: usize = u.filters.iter().map(|f| binary_len(f.as_bytes())).sum();
    2 + properties_len(&u.properties, v, Scope::Unsubscribe) + filters
}

pub(super) fn encode_unsubscribe(
    u: &Unsubscribe,
    v: ProtocolVersion,
    out: &mut BytesMut,
) -> Result<(), EncodeError> {
    if u.filters.is_empty() {
        return Err(EncodeError::Invalid(
            "UNSUBSCRIBE without topic filters [MQTT-3.10.3-2]",
        ));
    }
    out.put_u16(u.packet_id.get());
    encode_properties(&u.properties, v, Scope::Unsubscribe, out)?;
    for filter in &u.filters {
        put_string(out, filter)?;
    }
    Ok(())
}

/// Decodes UNSUBACK: in MQTT 5 one reason code per remaining byte, in
/// 3.1.x only the packet identifier.
pub(super) fn decode_unsuback(r: &mut Reader, v: ProtocolVersion) -> Result<UnsubAck, DecodeError> {
    let packet_id = r.packet_id()?;
    if !v.is_v5() {
        return Ok(UnsubAck {
            packet_id,
            properties: Props::default(),
            reasons: Vec::new(),
        });
    }
    let properties = properties::decode(r, Scope::UnsubAck)?;
    let mut reasons = Vec::with_capacity(r.remaining());
    while !r.is_empty() {
        reasons.push(reason(r, UNSUBACK_REASONS)?);
    }
    Ok(UnsubAck {
        packet_id,
        properties,
        reasons,
    })
}

pub(super) fn unsuback_len(u: &UnsubAck, v: ProtocolVersion) -> usize {
    if v.is_v5() {
        2 + properties::encoded_len(&u.properties, Scope::UnsubAck) + u.reasons.len()
    } else {
        2
    }
}

pub(super) fn encode_unsuback(
    u: &UnsubAck,
    v: ProtocolVersion,
    out: &mut BytesMut,
) -> Result<(), EncodeError> {
    out.put_u16(u.packet_id.get());
    if v.is_v5() {
        properties::encode(&u.properties, Scope::UnsubAck, out)?;
        for code in &u.reasons {
            out.put_u8(code.0);
        }
    }
    Ok(())
}
