//! The MQTT packet model: one set of types for MQTT 3.1 (protocol level 3),
//! 3.1.1 (level 4) and 5.0 (level 5).
//!
//! Fields that exist only in MQTT 5 (properties, reason codes other than the
//! 3.1.1 return codes) are carried for every version and ignored by the
//! 3.1.x encoder; the 3.1.x decoder leaves them at their defaults.
//!
//! Strings are [`ByteString`] (UTF-8 validated, reference counted) and
//! payloads [`Bytes`]: decoding a PUBLISH slices the input buffer and never
//! copies the payload.
//!
//! Decoding and encoding live in [`codec`]; the MQTT 5 properties in
//! [`properties`] and the reason codes in [`reason`].

pub mod codec;
pub mod properties;
pub mod reason;

use std::num::NonZeroU16;

use bytes::Bytes;
use bytestring::ByteString;

pub use properties::{Properties, Props, UserProperty};
pub use reason::ReasonCode;

/// A packet identifier: never 0 on the wire `[MQTT-2.2.1-3]`.
pub type PacketId = NonZeroU16;

/// The protocol level announced in CONNECT (MQTT 5 §3.1.2.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ProtocolVersion {
    /// MQTT 3.1: protocol name `MQIsdp`, level 3.
    V3_1,
    /// MQTT 3.1.1: protocol name `MQTT`, level 4.
    V3_1_1,
    /// MQTT 5.0: protocol name `MQTT`, level 5.
    V5,
}

impl ProtocolVersion {
    /// The protocol level byte of CONNECT.
    pub fn level(self) -> u8 {
        match self {
            ProtocolVersion::V3_1 => 3,
            ProtocolVersion::V3_1_1 => 4,
            ProtocolVersion::V5 => 5,
        }
    }

    /// True for MQTT 5, the only version with properties and reason codes.
    pub fn is_v5(self) -> bool {
        self == ProtocolVersion::V5
    }
}

/// Quality of service of a PUBLISH or a subscription (MQTT 5 §4.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum QoS {
    /// QoS 0: at most once.
    #[default]
    AtMostOnce = 0,
    /// QoS 1: at least once.
    AtLeastOnce = 1,
    /// QoS 2: exactly once.
    ExactlyOnce = 2,
}

impl QoS {
    /// The QoS for a wire value 0..=2; `None` for 3 (malformed `[MQTT-3.3.1-4]`).
    pub fn from_u8(v: u8) -> Option<QoS> {
        match v {
            0 => Some(QoS::AtMostOnce),
            1 => Some(QoS::AtLeastOnce),
            2 => Some(QoS::ExactlyOnce),
            _ => None,
        }
    }
}

/// Every MQTT control packet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Packet {
    /// CONNECT (type 1), client to server.
    Connect(Box<Connect>),
    /// CONNACK (type 2), server to client.
    ConnAck(ConnAck),
    /// PUBLISH (type 3), both ways.
    Publish(Publish),
    /// PUBACK (type 4): QoS 1 acknowledgement.
    PubAck(PubResponse),
    /// PUBREC (type 5): QoS 2, part 1.
    PubRec(PubResponse),
    /// PUBREL (type 6): QoS 2, part 2.
    PubRel(PubResponse),
    /// PUBCOMP (type 7): QoS 2, part 3.
    PubComp(PubResponse),
    /// SUBSCRIBE (type 8).
    Subscribe(Subscribe),
    /// SUBACK (type 9).
    SubAck(SubAck),
    /// UNSUBSCRIBE (type 10).
    Unsubscribe(Unsubscribe),
    /// UNSUBACK (type 11).
    UnsubAck(UnsubAck),
    /// PINGREQ (type 12).
    PingReq,
    /// PINGRESP (type 13).
    PingResp,
    /// DISCONNECT (type 14); in 3.1.x it has no body.
    Disconnect(Disconnect),
    /// AUTH (type 15), MQTT 5 only.
    Auth(Auth),
}

impl Packet {
    /// The control packet type name, for logs and metrics labels.
    pub fn name(&self) -> &'static str {
        match self {
            Packet::Connect(_) => "CONNECT",
            Packet::ConnAck(_) => "CONNACK",
            Packet::Publish(_) => "PUBLISH",
            Packet::PubAck(_) => "PUBACK",
            Packet::PubRec(_) => "PUBREC",
            Packet::PubRel(_) => "PUBREL",
            Packet::PubComp(_) => "PUBCOMP",
            Packet::Subscribe(_) => "SUBSCRIBE",
            Packet::SubAck(_) => "SUBACK",
            Packet::Unsubscribe(_) => "UNSUBSCRIBE",
            Packet::UnsubAck(_) => "UNSUBACK",
            Packet::PingReq => "PINGREQ",
            Packet::PingResp => "PINGRESP",
            Packet::Disconnect(_) => "DISCONNECT",
            Packet::Auth(_) => "AUTH",
        }
    }
}

/// CONNECT (MQTT 5 §3.1, 3.1.1 §3.1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Connect {
    /// Protocol name and level.
    pub protocol: ProtocolVersion,
    /// Clean Start (5) / Clean Session (3.1.x).
    pub clean_start: bool,
    /// Keep Alive in seconds; 0 disables it.
    pub keep_alive: u16,
    /// Client Identifier; may be empty (§3.1.3.1).
    pub client_id: ByteString,
    /// The Will Message, when the Will Flag is set.
    pub will: Option<Will>,
    /// User Name, when its flag is set.
    pub username: Option<ByteString>,
    /// Password, when its flag is set (binary data).
    pub password: Option<Bytes>,
    /// CONNECT properties (MQTT 5 only; default otherwise).
    pub properties: Props,
}

/// The Will Message of a CONNECT.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Will {
    /// Will Topic: a topic name, no wildcards `[MQTT-3.1.3-11]`.
    pub topic: ByteString,
    /// Will Payload.
    pub payload: Bytes,
    /// Will QoS.
    pub qos: QoS,
    /// Will Retain.
    pub retain: bool,
    /// Will properties (MQTT 5): Will Delay Interval, Message Expiry, ...
    pub properties: Props,
}

/// CONNACK (MQTT 5 §3.2).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ConnAck {
    /// Session Present flag.
    pub session_present: bool,
    /// Connect Reason Code (5); encoded as the 3.1.1 return code for 3.1.x
    /// with [`ReasonCode::to_v3_connack`].
    pub reason: ReasonCode,
    /// CONNACK properties (MQTT 5 only).
    pub properties: Props,
}

/// PUBLISH (MQTT 5 §3.3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Publish {
    /// DUP flag: this is a redelivery.
    pub dup: bool,
    /// QoS level.
    pub qos: QoS,
    /// RETAIN flag.
    pub retain: bool,
    /// Topic Name; may be empty in MQTT 5 when a Topic Alias is given.
    pub topic: ByteString,
    /// Packet Identifier: present exactly when QoS > 0.
    pub packet_id: Option<PacketId>,
    /// PUBLISH properties (MQTT 5 only).
    pub properties: Props,
    /// Application payload, a slice of the receive buffer.
    pub payload: Bytes,
}

/// PUBACK, PUBREC, PUBREL and PUBCOMP share one shape (MQTT 5 §3.4–3.7).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PubResponse {
    /// The Packet Identifier being acknowledged.
    pub packet_id: PacketId,
    /// Reason Code (MQTT 5; `SUCCESS` on 3.1.x).
    pub reason: ReasonCode,
    /// Properties (MQTT 5): Reason String, User Properties.
    pub properties: Props,
}

impl PubResponse {
    /// A successful response for `packet_id` with no properties.
    pub fn success(packet_id: PacketId) -> PubResponse {
        PubResponse { packet_id, reason: ReasonCode::SUCCESS, properties: Props::default() }
    }
}

/// Retain Handling subscription option (MQTT 5 §3.8.3.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum RetainHandling {
    /// 0: send retained messages at the time of the subscribe.
    #[default]
    SendAtSubscribe = 0,
    /// 1: send retained messages only if the subscription did not exist.
    SendIfNew = 1,
    /// 2: do not send retained messages.
    DoNotSend = 2,
}

/// Subscription options of one topic filter (MQTT 5 §3.8.3.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct SubscriptionOptions {
    /// Maximum QoS.
    pub qos: QoS,
    /// No Local (MQTT 5).
    pub no_local: bool,
    /// Retain As Published (MQTT 5).
    pub retain_as_published: bool,
    /// Retain Handling (MQTT 5).
    pub retain_handling: RetainHandling,
}

/// SUBSCRIBE (MQTT 5 §3.8).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subscribe {
    /// Packet Identifier.
    pub packet_id: PacketId,
    /// Properties (MQTT 5): Subscription Identifier, User Properties.
    pub properties: Props,
    /// At least one (topic filter, options) pair `[MQTT-3.8.3-2]`.
    pub filters: Vec<(ByteString, SubscriptionOptions)>,
}

/// SUBACK (MQTT 5 §3.9).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubAck {
    /// Packet Identifier of the SUBSCRIBE.
    pub packet_id: PacketId,
    /// Properties (MQTT 5).
    pub properties: Props,
    /// One reason code per filter, in order; 3.1.x encodes granted QoS 0–2
    /// and failure as 0x80.
    pub reasons: Vec<ReasonCode>,
}

/// UNSUBSCRIBE (MQTT 5 §3.10).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unsubscribe {
    /// Packet Identifier.
    pub packet_id: PacketId,
    /// Properties (MQTT 5): User Properties.
    pub properties: Props,
    /// At least one topic filter `[MQTT-3.10.3-2]`.
    pub filters: Vec<ByteString>,
}

/// UNSUBACK (MQTT 5 §3.11). 3.1.x carries only the packet identifier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnsubAck {
    /// Packet Identifier of the UNSUBSCRIBE.
    pub packet_id: PacketId,
    /// Properties (MQTT 5).
    pub properties: Props,
    /// One reason code per filter (MQTT 5 only; empty for 3.1.x).
    pub reasons: Vec<ReasonCode>,
}

/// DISCONNECT (MQTT 5 §3.14).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Disconnect {
    /// Disconnect Reason Code (MQTT 5; `NORMAL_DISCONNECTION` on 3.1.x).
    pub reason: ReasonCode,
    /// Properties (MQTT 5): Session Expiry Interval, Reason String, ...
    pub properties: Props,
}

/// AUTH (MQTT 5 §3.15).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Auth {
    /// Authenticate Reason Code.
    pub reason: ReasonCode,
    /// Properties: Authentication Method and Data, Reason String, ...
    pub properties: Props,
}
