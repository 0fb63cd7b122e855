//! MQTT 5 properties on the wire (MQTT 5 §2.2.2): the Property Length, then
//! (identifier, value) pairs, checked against the table of which packet may
//! carry which property (§2.2.2.2, table 2-4).
//!
//! Decode rules:
//! - an unknown identifier, or one not allowed on the packet: Malformed
//!   Packet (§2.2.2.2);
//! - a property other than User Property (and, on PUBLISH, Subscription
//!   Identifier) included twice: Protocol Error (each property's section,
//!   e.g. §3.1.2.11.2 "It is a Protocol Error to include the Session Expiry
//!   Interval more than once");
//! - out-of-range values the spec calls a Protocol Error: Receive Maximum 0
//!   (§3.1.2.11.3), Maximum Packet Size 0 (§3.1.2.11.4), Subscription
//!   Identifier 0 (§3.8.2.1.2), and the one-byte flags (Payload Format
//!   Indicator, Request Problem / Response Information, Maximum QoS, Retain
//!   Available, the three *Available properties) outside 0..=1.
//!
//! Topic Alias 0 on PUBLISH is decoded as `Some(0)`: the session layer
//! answers it with DISCONNECT 0x94 (§3.3.2.3.4).

use bytes::{BufMut, BytesMut};

use super::data::{binary_len, put_binary, put_varint, varint_len, Reader, VARINT_MAX};
use super::{DecodeError, EncodeError};
use crate::packet::properties::id;
use crate::packet::{Properties, Props};

/// Which packet (or the Will) a property list belongs to: selects the
/// allowed-property set of MQTT 5 §2.2.2.2.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Scope {
    Connect,
    ConnAck,
    Publish,
    Will,
    /// PUBACK, PUBREC, PUBREL and PUBCOMP.
    PubResponse,
    Subscribe,
    SubAck,
    Unsubscribe,
    UnsubAck,
    Disconnect,
    Auth,
}

const fn bit(id: u8) -> u64 {
    1 << id
}

/// The properties allowed in `scope` as a bit set over identifiers (all
/// identifiers are below 64).
const fn allowed(scope: Scope) -> u64 {
    let user = bit(id::USER_PROPERTY);
    let reason = bit(id::REASON_STRING);
    let message = bit(id::PAYLOAD_FORMAT_INDICATOR)
        | bit(id::MESSAGE_EXPIRY_INTERVAL)
        | bit(id::CONTENT_TYPE)
        | bit(id::RESPONSE_TOPIC)
        | bit(id::CORRELATION_DATA);
    let auth = bit(id::AUTHENTICATION_METHOD) | bit(id::AUTHENTICATION_DATA);
    match scope {
        Scope::Connect => {
            user | auth
                | bit(id::SESSION_EXPIRY_INTERVAL)
                | bit(id::REQUEST_PROBLEM_INFORMATION)
                | bit(id::REQUEST_RESPONSE_INFORMATION)
                | bit(id::RECEIVE_MAXIMUM)
                | bit(id::TOPIC_ALIAS_MAXIMUM)
                | bit(id::MAXIMUM_PACKET_SIZE)
        }
        Scope::ConnAck => {
            user | auth
                | reason
                | bit(id::SESSION_EXPIRY_INTERVAL)
                | bit(id::ASSIGNED_CLIENT_IDENTIFIER)
                | bit(id::SERVER_KEEP_ALIVE)
                | bit(id::RESPONSE_INFORMATION)
                | bit(id::SERVER_REFERENCE)
                | bit(id::RECEIVE_MAXIMUM)
                | bit(id::TOPIC_ALIAS_MAXIMUM)
                | bit(id::MAXIMUM_QOS)
                | bit(id::RETAIN_AVAILABLE)
                | bit(id::MAXIMUM_PACKET_SIZE)
                | bit(id::WILDCARD_SUBSCRIPTION_AVAILABLE)
                | bit(id::SUBSCRIPTION_IDENTIFIER_AVAILABLE)
                | bit(id::SHARED_SUBSCRIPTION_AVAILABLE)
        }
        Scope::Publish => user | message | bit(id::SUBSCRIPTION_IDENTIFIER) | bit(id::TOPIC_ALIAS),
        Scope::Will => user | message | bit(id::WILL_DELAY_INTERVAL),
        Scope::PubResponse | Scope::SubAck | Scope::UnsubAck => user | reason,
        Scope::Subscribe => user | bit(id::SUBSCRIPTION_IDENTIFIER),
        Scope::Unsubscribe => user,
        Scope::Disconnect => {
            user | reason | bit(id::SESSION_EXPIRY_INTERVAL) | bit(id::SERVER_REFERENCE)
        }
        Scope::Auth => user | auth | reason,
    }
}

/// Reads a Property Length and the properties it covers; a zero Property
/// Length takes no allocation (see [`Props`]).
pub(super) fn decode(r: &mut Reader, scope: Scope) -> Result<Props, DecodeError> {
    let len = r.varint()? as usize;
    let mut r = Reader::new(r.take(len)?);
    if r.is_empty() {
        return Ok(Props::default());
    }
    let mask = allowed(scope);
    let mut seen = 0u64;
    let mut p = Box::<Properties>::default();
    while !r.is_empty() {
        // The identifier is a Variable Byte Integer (§2.2.2.2); every
        // assigned one fits in a single byte.
        let ident = r.varint()?;
        let ident = match u8::try_from(ident) {
            Ok(i) if i < 64 && mask & bit(i) != 0 => i,
            _ => {
                return Err(DecodeError::Malformed(
                    "property not allowed on this packet",
                ))
            }
        };
        let repeatable = ident == id::USER_PROPERTY
            || (ident == id::SUBSCRIPTION_IDENTIFIER && scope == Scope::Publish);
        if !repeatable {
            if seen & bit(ident) != 0 {
                return Err(DecodeError::Protocol("property included more than once"));
            }
            seen |= bit(ident);
        }
        decode_one(&mut r, ident, &mut p)?;
    }
    Ok(Props::from(p))
}

/// A one-byte property that may only be 0 or 1.
fn flag(r: &mut Reader, what: &'static str) -> Result<Option<u8>, DecodeError> {
    match r.u8()? {
        v @ (0 | 1) => Ok(Some(v)),
        _ => Err(DecodeError::Protocol(what)),
    }
}

fn decode_one(r: &mut Reader, ident: u8, p: &mut Properties) -> Result<(), DecodeError> {
    match ident {
        id::PAYLOAD_FORMAT_INDICATOR => {
            p.payload_format_indicator = flag(r, "Payload Format Indicator not 0 or 1")?
        }
        id::MESSAGE_EXPIRY_INTERVAL => p.message_expiry_interval = Some(r.u32()?),
        id::CONTENT_TYPE => p.content_type = Some(r.string()?),
        id::RESPONSE_TOPIC => p.response_topic = Some(r.string()?),
        id::CORRELATION_DATA => p.correlation_data = Some(r.binary()?),
        id::SUBSCRIPTION_IDENTIFIER => {
            let v = r.varint()?;
            if v == 0 {
                return Err(DecodeError::Protocol("Subscription Identifier 0"));
            }
            p.subscription_identifiers.push(v);
        }
        id::SESSION_EXPIRY_INTERVAL => p.session_expiry_interval = Some(r.u32()?),
        id::ASSIGNED_CLIENT_IDENTIFIER => p.assigned_client_identifier = Some(r.string()?),
        id::SERVER_KEEP_ALIVE => p.server_keep_alive = Some(r.u16()?),
        id::AUTHENTICATION_METHOD => p.authentication_method = Some(r.string()?),
        id::AUTHENTICATION_DATA => p.authentication_data = Some(r.binary()?),
        id::REQUEST_PROBLEM_INFORMATION => {
            p.request_problem_information = flag(r, "Request Problem Information not 0 or 1")?
        }
        id::WILL_DELAY_INTERVAL => p.will_delay_interval = Some(r.u32()?),
        id::REQUEST_RESPONSE_INFORMATION => {
            p.request_response_information = flag(r, "Request Response Information not 0 or 1")?
        }
        id::RESPONSE_INFORMATION => p.response_information = Some(r.string()?),
        id::SERVER_REFERENCE => p.server_reference = Some(r.string()?),
        id::REASON_STRING => p.reason_string = Some(r.string()?),
        id::RECEIVE_MAXIMUM => match r.u16()? {
            0 => return Err(DecodeError::Protocol("Receive Maximum 0")),
            v => p.receive_maximum = Some(v),
        },
        id::TOPIC_ALIAS_MAXIMUM => p.topic_alias_maximum = Some(r.u16()?),
        id::TOPIC_ALIAS => p.topic_alias = Some(r.u16()?),
        id::MAXIMUM_QOS => p.maximum_qos = flag(r, "Maximum QoS not 0 or 1")?,
        id::RETAIN_AVAILABLE => p.retain_available = flag(r, "Retain Available not 0 or 1")?,
        id::USER_PROPERTY => {
            let key = r.string()?;
            let value = r.string()?;
            p.user_properties.push((key, value));
        }
        id::MAXIMUM_PACKET_SIZE => match r.u32()? {
            0 => return Err(DecodeError::Protocol("Maximum Packet Size 0")),
            v => p.maximum_packet_size = Some(v),
        },
        id::WILDCARD_SUBSCRIPTION_AVAILABLE => {
            p.wildcard_subscription_available =
                flag(r, "Wildcard Subscription Available not 0 or 1")?
        }
        id::SUBSCRIPTION_IDENTIFIER_AVAILABLE => {
            p.subscription_identifier_available =
                flag(r, "Subscription Identifier Available not 0 or 1")?
        }
        id::SHARED_SUBSCRIPTION_AVAILABLE => {
            p.shared_subscription_available = flag(r, "Shared Subscription Available not 0 or 1")?
        }
        // `decode` only passes identifiers from the allowed set.
        _ => return Err(DecodeError::Malformed("unknown property identifier")),
    }
    Ok(())
}

/// One property value to encode, borrowed from [`Properties`].
enum Prop<'a> {
    Byte(u8, u8),
    Two(u8, u16),
    Four(u8, u32),
    Var(u8, u32),
    Str(u8, &'a [u8]),
    Pair(u8, &'a [u8], &'a [u8]),
}

impl Prop<'_> {
    fn len(&self) -> usize {
        1 + match self {
            Prop::Byte(..) => 1,
            Prop::Two(..) => 2,
            Prop::Four(..) => 4,
            Prop::Var(_, v) => varint_len(*v as usize),
            Prop::Str(_, s) => binary_len(s),
            Prop::Pair(_, k, v) => binary_len(k) + binary_len(v),
        }
    }

    fn put(&self, out: &mut BytesMut) -> Result<(), EncodeError> {
        match *self {
            Prop::Byte(i, v) => {
                out.put_u8(i);
                out.put_u8(v);
            }
            Prop::Two(i, v) => {
                out.put_u8(i);
                out.put_u16(v);
            }
            Prop::Four(i, v) => {
                out.put_u8(i);
                out.put_u32(v);
            }
            Prop::Var(i, v) => {
                if v == 0 || v as usize > VARINT_MAX {
                    return Err(EncodeError::Invalid(
                        "Subscription Identifier outside 1..=268,435,455",
                    ));
                }
                out.put_u8(i);
                put_varint(out, v as usize);
            }
            Prop::Str(i, s) => {
                out.put_u8(i);
                put_binary(out, s)?;
            }
            Prop::Pair(i, k, v) => {
                out.put_u8(i);
                put_binary(out, k)?;
                put_binary(out, v)?;
            }
        }
        Ok(())
    }
}

/// Calls `f` with every property of `p` that `scope` allows, in identifier
/// order. Properties the packet cannot carry are skipped, so the encoder
/// never emits what the decoder would reject; SUBSCRIBE carries only the
/// first Subscription Identifier (§3.8.2.1.2).
fn visit<E>(
    p: &Properties,
    scope: Scope,
    mut f: impl FnMut(Prop<'_>) -> Result<(), E>,
) -> Result<(), E> {
    let mask = allowed(scope);
    let mut emit = |prop: Prop<'_>, ident: u8| {
        if mask & bit(ident) != 0 {
            f(prop)
        } else {
            Ok(())
        }
    };
    macro_rules! opt {
        ($field:ident, bytes, $ident:expr) => {
            if let Some(v) = &p.$field {
                emit(Prop::Str($ident, AsRef::<[u8]>::as_ref(v)), $ident)?;
            }
        };
        ($field:ident, $variant:ident, $ident:expr) => {
            if let Some(v) = p.$field {
                emit(Prop::$variant($ident, v), $ident)?;
            }
        };
    }
    opt!(payload_format_indicator, Byte, id::PAYLOAD_FORMAT_INDICATOR);
    opt!(message_expiry_interval, Four, id::MESSAGE_EXPIRY_INTERVAL);
    opt!(content_type, bytes, id::CONTENT_TYPE);
    opt!(response_topic, bytes, id::RESPONSE_TOPIC);
    opt!(correlation_data, bytes, id::CORRELATION_DATA);
    let sub_ids = match scope {
        Scope::Publish => &p.subscription_identifiers[..],
        _ => p.subscription_identifiers.get(..1).unwrap_or_default(),
    };
    for &v in sub_ids {
        emit(
            Prop::Var(id::SUBSCRIPTION_IDENTIFIER, v),
            id::SUBSCRIPTION_IDENTIFIER,
        )?;
    }
    opt!(session_expiry_interval, Four, id::SESSION_EXPIRY_INTERVAL);
    opt!(
        assigned_client_identifier,
        bytes,
        id::ASSIGNED_CLIENT_IDENTIFIER
    );
    opt!(server_keep_alive, Two, id::SERVER_KEEP_ALIVE);
    opt!(authentication_method, bytes, id::AUTHENTICATION_METHOD);
    opt!(authentication_data, bytes, id::AUTHENTICATION_DATA);
    opt!(
        request_problem_information,
        Byte,
        id::REQUEST_PROBLEM_INFORMATION
    );
    opt!(will_delay_interval, Four, id::WILL_DELAY_INTERVAL);
    opt!(
        request_response_information,
        Byte,
        id::REQUEST_RESPONSE_INFORMATION
    );
    opt!(response_information, bytes, id::RESPONSE_INFORMATION);
    opt!(server_reference, bytes, id::SERVER_REFERENCE);
    opt!(reason_string, bytes, id::REASON_STRING);
    opt!(receive_maximum, Two, id::RECEIVE_MAXIMUM);
    opt!(topic_alias_maximum, Two, id::TOPIC_ALIAS_MAXIMUM);
    opt!(topic_alias, Two, id::TOPIC_ALIAS);
    opt!(maximum_qos, Byte, id::MAXIMUM_QOS);
    opt!(retain_available, Byte, id::RETAIN_AVAILABLE);
    for (k, v) in &p.user_properties {
        emit(
            Prop::Pair(id::USER_PROPERTY, k.as_bytes(), v.as_bytes()),
            id::USER_PROPERTY,
        )?;
    }
    opt!(maximum_packet_size, Four, id::MAXIMUM_PACKET_SIZE);
    opt!(
        wildcard_subscription_available,
        Byte,
        id::WILDCARD_SUBSCRIPTION_AVAILABLE
    );
    opt!(
        subscription_identifier_available,
        Byte,
        id::SUBSCRIPTION_IDENTIFIER_AVAILABLE
    );
    opt!(
        shared_subscription_available,
        Byte,
        id::SHARED_SUBSCRIPTION_AVAILABLE
    );
    Ok(())
}

/// The Property Length value: bytes of the properties of `p` that `scope`
/// carries, without the length field itself.
fn content_len(p: &Properties, scope: Scope) -> usize {
    let mut len = 0;
    let _ = visit(p, scope, |prop| {
        len += prop.len();
        Ok::<(), std::convert::Infallible>(())
    });
    len
}

/// Bytes the properties take on the wire, Property Length included.
pub(super) fn encoded_len(p: &Properties, scope: Scope) -> usize {
    let len = content_len(p, scope);
    varint_len(len) + len
}

/// True when `p` carries nothing `scope` would encode (the short forms of
/// PUBACK, DISCONNECT and AUTH apply).
pub(super) fn is_empty_in(p: &Properties, scope: Scope) -> bool {
    content_len(p, scope) == 0
}

/// Writes the Property Length and the properties `scope` carries.
///
/// # Errors
/// [`EncodeError::Invalid`] for a string over 65,535 bytes or a
/// Subscription Identifier outside 1..=268,435,455;
/// [`EncodeError::TooLarge`] when the properties exceed 268,435,455 bytes.
pub(super) fn encode(p: &Properties, scope: Scope, out: &mut BytesMut) -> Result<(), EncodeError> {
    let len = content_len(p, scope);
    if len > VARINT_MAX {
        return Err(EncodeError::TooLarge {
            size: len,
            max: VARINT_MAX,
        });
    }
    put_varint(out, len);
    visit(p, scope, |prop| prop.put(out))
}
