//! PUBLISH (§3.3) and its acknowledgements PUBACK, PUBREC, PUBREL and
//! PUBCOMP (§3.4–3.7). This is the hot path: no allocation beyond the
//! model's (properties that are present), no copy of the payload.

use bytes::{BufMut, BytesMut};

use super::data::{binary_len, put_string, Reader};
use super::properties::{self, Scope};
use super::{reason, DecodeError, EncodeError};
use crate::packet::{Props, ProtocolVersion, PubResponse, Publish, QoS, ReasonCode};

/// PUBACK and PUBREC reason codes (MQTT 5 §3.4.2.1, §3.5.2.1).
pub(super) const ACK_REASONS: &[u8] = &[0x00, 0x10, 0x80, 0x83, 0x87, 0x90, 0x91, 0x97, 0x99];

/// PUBREL and PUBCOMP reason codes (MQTT 5 §3.6.2.1, §3.7.2.1).
pub(super) const REL_REASONS: &[u8] = &[0x00, 0x92];

const DUP: u8 = 0b1000;
const RETAIN: u8 = 0b0001;

/// Checks PUBLISH fixed-header flags: QoS 3 `[MQTT-3.3.1-4]` and DUP with
/// QoS 0 `[MQTT-3.3.1-2]` are Malformed.
pub(super) fn check_flags(flags: u8) -> Result<(), DecodeError> {
    match (flags >> 1) & 0b11 {
        3 => Err(DecodeError::Malformed("PUBLISH QoS 3 [MQTT-3.3.1-4]")),
        0 if flags & DUP != 0 => Err(DecodeError::Malformed(
            "PUBLISH DUP with QoS 0 [MQTT-3.3.1-2]",
        )),
        _ => Ok(()),
    }
}

/// The fixed-header flags of `p`.
pub(super) fn flags(p: &Publish) -> u8 {
    let mut flags = (p.qos as u8) << 1;
    if p.dup {
        flags |= DUP;
    }
    if p.retain {
        flags |= RETAIN;
    }
    flags
}

/// Decodes a PUBLISH body; `first` is the fixed header's first byte, whose
/// flags [`check_flags`] already accepted.
pub(super) fn decode_publish(
    first: u8,
    r: &mut Reader,
    v: ProtocolVersion,
) -> Result<Publish, DecodeError> {
    let qos = QoS::from_u8((first >> 1) & 0b11)
        .ok_or(DecodeError::Malformed("PUBLISH QoS 3 [MQTT-3.3.1-4]"))?;
    let topic = r.string()?;
    let packet_id = if qos == QoS::AtMostOnce {
        None
    } else {
        Some(r.packet_id()?)
    };
    let properties = if v.is_v5() {
        properties::decode(r, Scope::Publish)?
    } else {
        Props::default()
    };
    Ok(Publish {
        dup: first & DUP != 0,
        qos,
        retain: first & RETAIN != 0,
        topic,
        packet_id,
        properties,
        payload: r.rest(),
    })
}

pub(super) fn publish_len(p: &Publish, v: ProtocolVersion) -> usize {
    let mut len = binary_len(p.topic.as_bytes()) + p.payload.len();
    if p.packet_id.is_some() {
        len += 2;
    }
    if v.is_v5() {
        len += properties::encoded_len(&p.properties, Scope::Publish);
    }
    len
}

pub(super) fn encode_publish(
    p: &Publish,
    v: ProtocolVersion,
    out: &mut BytesMut,
) -> Result<(), EncodeError> {
    put_string(out, &p.topic)?;
    match (p.qos, p.packet_id) {
        (QoS::AtMostOnce, None) => {}
        (QoS::AtLeastOnce | QoS::ExactlyOnce, Some(id)) => out.put_u16(id.get()),
        _ => {
            return Err(EncodeError::Invalid(
                "PUBLISH packet identifier must be present exactly when QoS > 0 [MQTT-2.2.1-2]",
            ))
        }
    }
    if v.is_v5() {
        properties::encode(&p.properties, Scope::Publish, out)?;
    }
    out.put_slice(&p.payload);
    Ok(())
}

/// Decodes PUBACK, PUBREC, PUBREL or PUBCOMP; `allowed` lists the reason
/// codes of that packet. MQTT 5 short forms: Remaining Length 2 means
/// Success with no properties, 3 a reason code with no properties
/// (§3.4.2.1, §3.4.2.2.1). 3.1.x carries only the packet identifier.
pub(super) fn decode_response(
    r: &mut Reader,
    v: ProtocolVersion,
    allowed: &[u8],
) -> Result<PubResponse, DecodeError> {
    let packet_id = r.packet_id()?;
    if !v.is_v5() || r.is_empty() {
        return Ok(PubResponse::success(packet_id));
    }
    let reason = reason(r, allowed)?;
    let properties = if r.is_empty() {
        Props::default()
    } else {
        properties::decode(r, Scope::PubResponse)?
    };
    Ok(PubResponse {
        packet_id,
        reason,
        properties,
    })
}

/// True when the 2-byte MQTT 5 short form applies.
fn is_short(p: &PubResponse, v: ProtocolVersion) -> bool {
    !v.is_v5()
        || (p.reason == ReasonCode::SUCCESS
            && properties::is_empty_in(&p.properties, Scope::PubResponse))
}

pub(super) fn response_len(p: &PubResponse, v: ProtocolVersion) -> usize {
    if is_short(p, v) {
        2
    } else {
        3 + properties::encoded_len(&p.properties, Scope::PubResponse)
    }
}

pub(super) fn encode_response(
    p: &PubResponse,
    v: ProtocolVersion,
    out: &mut BytesMut,
) -> Result<(), EncodeError> {
    out.put_u16(p.packet_id.get());
    if is_short(p, v) {
        return Ok(());
    }
    out.put_u8(p.reason.0);
    properties::encode(&p.properties, Scope::PubResponse, out)
}
