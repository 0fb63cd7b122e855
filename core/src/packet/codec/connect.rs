//! Connection packets: CONNECT (§3.1), CONNACK (§3.2), DISCONNECT (§3.14)
//! and AUTH (§3.15).

use bytes::{BufMut, BytesMut};

use super::data::{binary_len, put_binary, put_string, Reader};
use super::properties::{self, Scope};
use super::{reason, DecodeError, EncodeError};
use crate::packet::{
    Auth, ConnAck, Connect, Disconnect, Properties, Props, ProtocolVersion, QoS, ReasonCode, Will,
};

/// CONNACK reason codes (MQTT 5 §3.2.2.2).
const CONNACK_REASONS: &[u8] = &[
    0x00, 0x80, 0x81, 0x82, 0x83, 0x84, 0x85, 0x86, 0x87, 0x88, 0x89, 0x8A, 0x8C, 0x90, 0x95, 0x97,
    0x99, 0x9A, 0x9B, 0x9C, 0x9D, 0x9F,
];

/// DISCONNECT reason codes (MQTT 5 §3.14.2.1).
const DISCONNECT_REASONS: &[u8] = &[
    0x00, 0x04, 0x80, 0x81, 0x82, 0x83, 0x87, 0x89, 0x8B, 0x8D, 0x8E, 0x8F, 0x90, 0x93, 0x94, 0x95,
    0x96, 0x97, 0x98, 0x99, 0x9A, 0x9B, 0x9C, 0x9D, 0x9E, 0x9F, 0xA0, 0xA1, 0xA2,
];

/// AUTH reason codes (MQTT 5 §3.15.2.1).
const AUTH_REASONS: &[u8] = &[0x00, 0x18, 0x19];

// Connect Flags bits (MQTT 5 §3.1.2.3).
const RESERVED: u8 = 0x01;
const CLEAN_START: u8 = 0x02;
const WILL: u8 = 0x04;
const WILL_QOS_SHIFT: u8 = 3;
const WILL_RETAIN: u8 = 0x20;
const PASSWORD: u8 = 0x40;
const USERNAME: u8 = 0x80;

/// Protocol name and level of a CONNECT (§3.1.2.1, §3.1.2.2).
fn protocol_name(v: ProtocolVersion) -> &'static [u8] {
    match v {
        ProtocolVersion::V3_1 => b"MQIsdp",
        ProtocolVersion::V3_1_1 | ProtocolVersion::V5 => b"MQTT",
    }
}

/// Decodes a CONNECT body, in the version its protocol name and level give.
pub(super) fn decode_connect(r: &mut Reader) -> Result<Connect, DecodeError> {
    let name = r.binary()?;
    let level = r.u8()?;
    let protocol = match (&name[..], level) {
        (b"MQIsdp", 3) => ProtocolVersion::V3_1,
        (b"MQTT", 4) => ProtocolVersion::V3_1_1,
        (b"MQTT", 5) => ProtocolVersion::V5,
        _ => return Err(DecodeError::UnsupportedProtocolVersion(level)),
    };
    let flags = r.u8()?;
    if flags & RESERVED != 0 {
        return Err(DecodeError::Malformed(
            "CONNECT reserved flag set [MQTT-3.1.2-3]",
        ));
    }
    let will_qos = (flags >> WILL_QOS_SHIFT) & 0b11;
    let will_retain = flags & WILL_RETAIN != 0;
    let will_qos = QoS::from_u8(will_qos)
        .ok_or(DecodeError::Malformed("CONNECT Will QoS 3 [MQTT-3.1.2-12]"))?;
    if flags & WILL == 0 && (will_qos != QoS::AtMostOnce || will_retain) {
        return Err(DecodeError::Malformed(
            "Will QoS or Retain without Will Flag [MQTT-3.1.2-11] [MQTT-3.1.2-13]",
        ));
    }
    if !protocol.is_v5() && flags & PASSWORD != 0 && flags & USERNAME == 0 {
        return Err(DecodeError::Malformed(
            "Password Flag without User Name Flag [MQTT-3.1.2-22]",
        ));
    }
    let keep_alive = r.u16()?;
    let properties = if protocol.is_v5() {
        let p = properties::decode(r, Scope::Connect)?;
        if p.authentication_data.is_some() && p.authentication_method.is_none() {
            return Err(DecodeError::Protocol(
                "Authentication Data without Authentication Method",
            ));
        }
        p
    } else {
        Props::default()
    };
    let client_id = r.string()?;
    let will = if flags & WILL != 0 {
        let properties = if protocol.is_v5() {
            properties::decode(r, Scope::Will)?
        } else {
            Props::default()
        };
        let topic = r.string()?;
        let payload = r.binary()?;
        Some(Will {
            topic,
            payload,
            qos: will_qos,
            retain: will_retain,
            properties,
        })
    } else {
        None
    };
    let username = if flags & USERNAME != 0 {
        Some(r.string()?)
    } else {
        None
    };
    let password = if flags & PASSWORD != 0 {
        Some(r.binary()?)
    } else {
        None
    };
    Ok(Connect {
        protocol,
        clean_start: flags & CLEAN_START != 0,
        keep_alive,
        client_id,
        will,
        username,
        password,
        properties,
    })
}

pub(super) fn connect_len(c: &Connect) -> usize {
    let v5 = c.protocol.is_v5();
    let mut len = binary_len(protocol_name(c.protocol)) + 1 + 1 + 2;
    if v5 {
        len += properties::encoded_len(&c.properties, Scope::Connect);
    }
    len += binary_len(c.client_id.as_bytes());
    if let Some(w) = &c.will {
        if v5 {
            len += properties::encoded_len(&w.properties, Scope::Will);
        }
        len += binary_len(w.topic.as_bytes()) + binary_len(&w.payload);
    }
    if let Some(u) = &c.username {
        len += binary_len(u.as_bytes());
    }
    if let Some(p) = &c.password {
        len += binary_len(p);
    }
    len
}

pub(super) fn encode_connect(c: &Connect, out: &mut BytesMut) -> Result<(), EncodeError> {
    let v5 = c.protocol.is_v5();
    put_binary(out, protocol_name(c.protocol))?;
    out.put_u8(c.protocol.level());
    let mut flags = 0;
    if c.clean_start {
        flags |= CLEAN_START;
    }
    if let Some(w) = &c.will {
        flags |= WILL | (w.qos as u8) << WILL_QOS_SHIFT;
        if w.retain {
            flags |= WILL_RETAIN;
        }
    }
    if c.username.is_some() {
        flags |= USERNAME;
    }
    if c.password.is_some() {
        if !v5 && c.username.is_none() {
            return Err(EncodeError::Invalid(
                "3.1.x password without user name [MQTT-3.1.2-22]",
            ));
        }
        flags |= PASSWORD;
    }
    out.put_u8(flags);
    out.put_u16(c.keep_alive);
    if v5 {
        properties::encode(&c.properties, Scope::Connect, out)?;
    }
    put_string(out, &c.client_id)?;
    if let Some(w) = &c.will {
        if v5 {
            properties::encode(&w.properties, Scope::Will, out)?;
        }
        put_string(out, &w.topic)?;
        put_binary(out, &w.payload)?;
    }
    if let Some(u) = &c.username {
        put_string(out, u)?;
    }
    if let Some(p) = &c.password {
        put_binary(out, p)?;
    }
    Ok(())
}

/// Decodes CONNACK (§3.2). Acknowledge flags bits 7–1 are reserved
/// `[MQTT-3.2.2-1]`; 3.1.x carries a return code 0–5 (3.1.1 §3.2.2.3).
pub(super) fn decode_connack(r: &mut Reader, v: ProtocolVersion) -> Result<ConnAck, DecodeError> {
    let flags = r.u8()?;
    if flags & !1 != 0 {
        return Err(DecodeError::Malformed(
            "CONNACK reserved flags set [MQTT-3.2.2-1]",
        ));
    }
    let session_present = flags & 1 != 0;
    if !v.is_v5() {
        let reason = ReasonCode::from_v3_connack(r.u8()?)
            .ok_or(DecodeError::Malformed("CONNACK return code above 5"))?;
        return Ok(ConnAck {
            session_present,
            reason,
            properties: Props::default(),
        });
    }
    let reason = reason(r, CONNACK_REASONS)?;
    let properties = properties::decode(r, Scope::ConnAck)?;
    Ok(ConnAck {
        session_present,
        reason,
        properties,
    })
}

pub(super) fn connack_len(c: &ConnAck, v: ProtocolVersion) -> usize {
    if v.is_v5() {
        2 + properties::encoded_len(&c.properties, Scope::ConnAck)
    } else {
        2
    }
}

pub(super) fn encode_connack(
    c: &ConnAck,
    v: ProtocolVersion,
    out: &mut BytesMut,
) -> Result<(), EncodeError> {
    out.put_u8(u8::from(c.session_present));
    if v.is_v5() {
        out.put_u8(c.reason.0);
        properties::encode(&c.properties, Scope::ConnAck, out)
    } else {
        out.put_u8(c.reason.to_v3_connack());
        Ok(())
    }
}

/// Decodes DISCONNECT (§3.14). 3.1.x has no body; MQTT 5 may omit the
/// Property Length (Remaining Length 1) or everything (Remaining Length 0:
/// Normal disconnection) (§3.14.2.1, §3.14.2.2.1).
pub(super) fn decode_disconnect(
    r: &mut Reader,
    v: ProtocolVersion,
) -> Result<Disconnect, DecodeError> {
    if !v.is_v5() || r.is_empty() {
        return Ok(Disconnect::default());
    }
    let reason = reason(r, DISCONNECT_REASONS)?;
    let properties = if r.is_empty() {
        Props::default()
    } else {
        properties::decode(r, Scope::Disconnect)?
    };
    Ok(Disconnect { reason, properties })
}

pub(super) fn disconnect_len(d: &Disconnect, v: ProtocolVersion) -> usize {
    if !v.is_v5() || short_form(d.reason, &d.properties, Scope::Disconnect) {
        0
    } else {
        1 + properties::encoded_len(&d.properties, Scope::Disconnect)
    }
}

pub(super) fn encode_disconnect(
    d: &Disconnect,
    v: ProtocolVersion,
    out: &mut BytesMut,
) -> Result<(), EncodeError> {
    if !v.is_v5() || short_form(d.reason, &d.properties, Scope::Disconnect) {
        return Ok(());
    }
    out.put_u8(d.reason.0);
    properties::encode(&d.properties, Scope::Disconnect, out)
}

/// Decodes AUTH (§3.15, MQTT 5 only). Remaining Length 0 means Success
/// with no properties; 1 means a reason code with no properties.
pub(super) fn decode_auth(r: &mut Reader) -> Result<Auth, DecodeError> {
    if r.is_empty() {
        return Ok(Auth::default());
    }
    let reason = reason(r, AUTH_REASONS)?;
    let properties = if r.is_empty() {
        Props::default()
    } else {
        properties::decode(r, Scope::Auth)?
    };
    Ok(Auth { reason, properties })
}

pub(super) fn auth_len(a: &Auth) -> usize {
    if short_form(a.reason, &a.properties, Scope::Auth) {
        0
    } else {
        1 + properties::encoded_len(&a.properties, Scope::Auth)
    }
}

pub(super) fn encode_auth(a: &Auth, out: &mut BytesMut) -> Result<(), EncodeError> {
    if short_form(a.reason, &a.properties, Scope::Auth) {
        return Ok(());
    }
    out.put_u8(a.reason.0);
    properties::encode(&a.properties, Scope::Auth, out)
}

/// True when a reason code 0x00 with no properties lets the body be
/// omitted.
fn short_form(reason: ReasonCode, p: &Properties, scope: Scope) -> bool {
    reason == ReasonCode::SUCCESS && properties::is_empty_in(p, scope)
}
