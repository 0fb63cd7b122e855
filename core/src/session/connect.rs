//! CONNECT negotiation: what the server answers to a CONNECT and the
//! parameters the connection then runs with (MQTT 5 §3.1–§3.2, 3.1.1 §3.1).

use bytestring::ByteString;

use crate::packet::{ConnAck, Connect, Properties, ProtocolVersion, ReasonCode};
use crate::topic::{validate_topic_name, TopicLimits};

/// The server-side limits a CONNECT is negotiated against (DESIGN.md §9).
#[derive(Debug, Clone)]
pub struct ConnectLimits {
    /// Receive Maximum we announce: QoS 1/2 PUBLISHes a client may have
    /// unacknowledged towards us (default 1000).
    pub receive_maximum: u16,
    /// Largest packet we accept, bytes (default 1 MiB).
    pub max_packet_size: usize,
    /// Largest Keep Alive we accept, seconds (default 900). MQTT 5 clients
    /// asking for more (or for 0) get Server Keep Alive; 3.1.x clients asking
    /// for more are refused with return code 2, as Mosquitto does.
    pub max_keep_alive: u16,
    /// Largest Session Expiry Interval, seconds (default 3600). 3.1.x
    /// sessions with Clean Session 0 expire after this long offline.
    pub max_session_expiry: u32,
    /// Topic limits, applied to the Will Topic.
    pub topic: TopicLimits,
    /// Topic Alias Maximum we announce: aliases a client may set towards
    /// us (default 64; 0 disables inbound aliases).
    pub topic_alias_maximum: u16,
}

impl Default for ConnectLimits {
    fn default() -> Self {
        ConnectLimits {
            receive_maximum: 1000,
            max_packet_size: 1024 * 1024,
            max_keep_alive: 900,
            max_session_expiry: 3600,
            topic: TopicLimits::default(),
            topic_alias_maximum: 64,
        }
    }
}

/// What a successful negotiation settles for the connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Negotiated {
    /// The client identifier in use (assigned when the client sent none).
    pub client_id: ByteString,
    /// Keep Alive in force, seconds; 0 disables the timeout.
    pub keep_alive: u16,
    /// Session Expiry Interval in force, seconds; 0 ends the session with
    /// the connection, `u32::MAX` never (MQTT 5 §3.1.2.11.2).
    pub session_expiry: u32,
    /// The client's Receive Maximum: our QoS 1/2 PUBLISHes it accepts
    /// unacknowledged (default 65,535).
    pub client_receive_maximum: u16,
    /// The client's Maximum Packet Size, bytes (default: no limit beyond the
    /// protocol's 268,435,460).
    pub client_max_packet_size: usize,
    /// The client's Topic Alias Maximum: aliases we may set towards it
    /// (default 0: none).
    pub client_topic_alias_maximum: u16,
    /// The CONNACK to send; the caller sets `session_present`.
    pub connack: ConnAck,
}

/// Why a CONNECT is refused: the CONNACK reason code (mapped to a 3.1.1
/// return code for 3.1.x) and a reason string for logs and MQTT 5 clients.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The CONNACK reason code.
    pub reason: ReasonCode,
    /// Why, for logs and for the MQTT 5 Reason String.
    pub detail: &'static str,
}

impl Refusal {
    /// The CONNACK that carries this refusal.
    pub fn connack(&self, protocol: ProtocolVersion) -> ConnAck {
        let mut properties = Properties::default();
        if protocol.is_v5() {
            properties.reason_string = Some(ByteString::from_static(self.detail));
        }
        ConnAck { session_present: false, reason: self.reason, properties: properties.into() }
    }
}

/// The largest packet the protocol can express: 268,435,455 bytes of
/// remaining length plus a 5-byte fixed header.
pub const PROTOCOL_MAX_PACKET_SIZE: usize = 268_435_460;

/// Negotiate a CONNECT against `limits`. `assign_id` makes a client
/// identifier when the client sent an empty one and may have one
/// (`[MQTT-3.1.3-6]`, `[MQTT-3.1.3-7]`).
///
/// # Errors
/// A [`Refusal`] when the server must answer with a failing CONNACK:
/// empty client identifier with Clean Session 0 on 3.1.1 or with any flags
/// on 3.1 (0x85, return code 2, `[MQTT-3.1.3-8]`); a Keep Alive above the
/// maximum on 3.1.x (0x85, return code 2); an Authentication Method, as no
/// extended authentication method is supported (0x8C); an invalid Will
/// Topic (0x90, `[MQTT-3.1.3-11]`).
pub fn negotiate(
    connect: &Connect,
    limits: &ConnectLimits,
    assign_id: impl FnOnce() -> String,
) -> Result<Negotiated, Refusal> {
    let v5 = connect.protocol.is_v5();
    let mut props = Properties::default();

    if connect.properties.authentication_method.is_some() {
        return Err(Refusal {
            reason: ReasonCode::BAD_AUTHENTICATION_METHOD,
            detail: "no extended authentication method is supported",
        });
    }
    if let Some(will) = &connect.will {
        if validate_topic_name(&will.topic, &limits.topic).is_err() {
            return Err(Refusal {
                reason: ReasonCode::TOPIC_NAME_INVALID,
                detail: "the Will Topic is not a valid topic name",
            });
        }
        // The server MAY check a Will Payload said to be UTF-8 (MQTT 5
        // §3.1.3.2.3); PUBLISH payloads are checked, so wills are too.
        if v5 && will.properties.payload_format_indicator == Some(1) && std::str::from_utf8(&will.payload).is_err() {
            return Err(Refusal {
                reason: ReasonCode::PAYLOAD_FORMAT_INVALID,
                detail: "the Will Payload is not UTF-8 though its Payload Format Indicator says so",
            });
        }
    }

    let client_id = if connect.client_id.is_empty() {
        let allowed = match connect.protocol {
            ProtocolVersion::V3_1 => false,
            ProtocolVersion::V3_1_1 => connect.clean_start,
            ProtocolVersion::V5 => true,
        };
        if !allowed {
            return Err(Refusal {
                reason: ReasonCode::CLIENT_IDENTIFIER_NOT_VALID,
                detail: "an empty client identifier needs a clean session",
            });
        }
        let id = ByteString::from(assign_id());
        if v5 {
            props.assigned_client_identifier = Some(id.clone());
        }
        id
    } else {
        connect.client_id.clone()
    };

    let mut keep_alive = connect.keep_alive;
    if keep_alive > limits.max_keep_alive || (v5 && keep_alive == 0) {
        if !v5 && keep_alive > limits.max_keep_alive {
            return Err(Refusal {
                reason: ReasonCode::CLIENT_IDENTIFIER_NOT_VALID,
                detail: "keep alive above the server's maximum",
            });
        }
        if v5 {
            keep_alive = limits.max_keep_alive;
            props.server_keep_alive = Some(keep_alive);
        }
    }

    let session_expiry = if v5 {
        let asked = connect.properties.session_expiry_interval.unwrap_or(0);
        if asked > limits.max_session_expiry {
            props.session_expiry_interval = Some(limits.max_session_expiry);
            limits.max_session_expiry
        } else {
            asked
        }
    } else if connect.clean_start {
        0
    } else {
        limits.max_session_expiry
    };

    if v5 {
        if limits.receive_maximum != u16::MAX {
            props.receive_maximum = Some(limits.receive_maximum);
        }
        if limits.topic_alias_maximum > 0 {
            props.topic_alias_maximum = Some(limits.topic_alias_maximum);
        }
        if limits.max_packet_size < PROTOCOL_MAX_PACKET_SIZE {
            props.maximum_packet_size = Some(limits.max_packet_size as u32);
        }
    }

    Ok(Negotiated {
        client_id,
        keep_alive,
        session_expiry,
        client_receive_maximum: connect.properties.receive_maximum.unwrap_or(u16::MAX),
        client_topic_alias_maximum: if v5 { connect.properties.topic_alias_maximum.unwrap_or(0) } else { 0 },
        client_max_packet_size: connect
            .properties
            .maximum_packet_size
            .map_or(PROTOCOL_MAX_PACKET_SIZE, |m| m as usize),
        connack: ConnAck { session_present: false, reason: ReasonCode::SUCCESS, properties: props.into() },
    })
}
