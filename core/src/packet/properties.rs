//! MQTT 5 properties (MQTT 5 §2.2.2.2): one struct for every packet.
//!
//! Every field is optional; the codec checks on decode that a property is
//! allowed on the packet that carries it and appears at most once (except
//! User Property and, on PUBLISH, Subscription Identifier), and treats a
//! violation as a Malformed Packet (0x81) or Protocol Error (0x82) as
//! MQTT 5 §2.2.2.2 specifies.

use bytes::Bytes;
use bytestring::ByteString;

/// A User Property: a UTF-8 string pair (identifier 0x26). May repeat, and
/// the order is kept `[MQTT-3.3.2-18]`.
pub type UserProperty = (ByteString, ByteString);

/// Property identifiers (MQTT 5 §2.2.2.2, table 2-4).
#[allow(missing_docs)]
pub mod id {
    pub const PAYLOAD_FORMAT_INDICATOR: u8 = 0x01;
    pub const MESSAGE_EXPIRY_INTERVAL: u8 = 0x02;
    pub const CONTENT_TYPE: u8 = 0x03;
    pub const RESPONSE_TOPIC: u8 = 0x08;
    pub const CORRELATION_DATA: u8 = 0x09;
    pub const SUBSCRIPTION_IDENTIFIER: u8 = 0x0B;
    pub const SESSION_EXPIRY_INTERVAL: u8 = 0x11;
    pub const ASSIGNED_CLIENT_IDENTIFIER: u8 = 0x12;
    pub const SERVER_KEEP_ALIVE: u8 = 0x13;
    pub const AUTHENTICATION_METHOD: u8 = 0x15;
    pub const AUTHENTICATION_DATA: u8 = 0x16;
    pub const REQUEST_PROBLEM_INFORMATION: u8 = 0x17;
    pub const WILL_DELAY_INTERVAL: u8 = 0x18;
    pub const REQUEST_RESPONSE_INFORMATION: u8 = 0x19;
    pub const RESPONSE_INFORMATION: u8 = 0x1A;
    pub const SERVER_REFERENCE: u8 = 0x1C;
    pub const REASON_STRING: u8 = 0x1F;
    pub const RECEIVE_MAXIMUM: u8 = 0x21;
    pub const TOPIC_ALIAS_MAXIMUM: u8 = 0x22;
    pub const TOPIC_ALIAS: u8 = 0x23;
    pub const MAXIMUM_QOS: u8 = 0x24;
    pub const RETAIN_AVAILABLE: u8 = 0x25;
    pub const USER_PROPERTY: u8 = 0x26;
    pub const MAXIMUM_PACKET_SIZE: u8 = 0x27;
    pub const WILDCARD_SUBSCRIPTION_AVAILABLE: u8 = 0x28;
    pub const SUBSCRIPTION_IDENTIFIER_AVAILABLE: u8 = 0x29;
    pub const SHARED_SUBSCRIPTION_AVAILABLE: u8 = 0x2A;
}

/// The properties of one MQTT 5 packet (or of a Will). Units: intervals in
/// seconds, sizes in bytes, as on the wire.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Properties {
    /// 0x01 Payload Format Indicator: 0 unspecified bytes, 1 UTF-8.
    pub payload_format_indicator: Option<u8>,
    /// 0x02 Message Expiry Interval, seconds.
    pub message_expiry_interval: Option<u32>,
    /// 0x03 Content Type.
    pub content_type: Option<ByteString>,
    /// 0x08 Response Topic.
    pub response_topic: Option<ByteString>,
    /// 0x09 Correlation Data.
    pub correlation_data: Option<Bytes>,
    /// 0x0B Subscription Identifier(s), 1..=268,435,455. SUBSCRIBE carries at
    /// most one; a PUBLISH to a client may carry several.
    pub subscription_identifiers: Vec<u32>,
    /// 0x11 Session Expiry Interval, seconds (0xFFFFFFFF: never).
    pub session_expiry_interval: Option<u32>,
    /// 0x12 Assigned Client Identifier.
    pub assigned_client_identifier: Option<ByteString>,
    /// 0x13 Server Keep Alive, seconds.
    pub server_keep_alive: Option<u16>,
    /// 0x15 Authentication Method.
    pub authentication_method: Option<ByteString>,
    /// 0x16 Authentication Data.
    pub authentication_data: Option<Bytes>,
    /// 0x17 Request Problem Information (0 or 1).
    pub request_problem_information: Option<u8>,
    /// 0x18 Will Delay Interval, seconds.
    pub will_delay_interval: Option<u32>,
    /// 0x19 Request Response Information (0 or 1).
    pub request_response_information: Option<u8>,
    /// 0x1A Response Information.
    pub response_information: Option<ByteString>,
    /// 0x1C Server Reference.
    pub server_reference: Option<ByteString>,
    /// 0x1F Reason String.
    pub reason_string: Option<ByteString>,
    /// 0x21 Receive Maximum, 1..=65535.
    pub receive_maximum: Option<u16>,
    /// 0x22 Topic Alias Maximum.
    pub topic_alias_maximum: Option<u16>,
    /// 0x23 Topic Alias, 1..=65535.
    pub topic_alias: Option<u16>,
    /// 0x24 Maximum QoS (0 or 1).
    pub maximum_qos: Option<u8>,
    /// 0x25 Retain Available (0 or 1).
    pub retain_available: Option<u8>,
    /// 0x26 User Properties, in order.
    pub user_properties: Vec<UserProperty>,
    /// 0x27 Maximum Packet Size, bytes, at least 1.
    pub maximum_packet_size: Option<u32>,
    /// 0x28 Wildcard Subscription Available (0 or 1).
    pub wildcard_subscription_available: Option<u8>,
    /// 0x29 Subscription Identifier Available (0 or 1).
    pub subscription_identifier_available: Option<u8>,
    /// 0x2A Shared Subscription Available (0 or 1).
    pub shared_subscription_available: Option<u8>,
}

impl Properties {
    /// True when no property is set (encodes as a zero Property Length).
    ///
    /// Field by field (every field named: a new one does not compile until
    /// it is here); comparing with `Properties::default()` built one and
    /// compared every field, a tenth of the publishing replica's time on
    /// the mesh's send path (perf/RESULTS.md, 2026-12-07 session 42).
    pub fn is_empty(&self) -> bool {
        let Properties {
            payload_format_indicator,
            message_expiry_interval,
            content_type,
            response_topic,
            correlation_data,
            subscription_identifiers,
            session_expiry_interval,
            assigned_client_identifier,
            server_keep_alive,
            authentication_method,
            authentication_data,
            request_problem_information,
            will_delay_interval,
            request_response_information,
            response_information,
            server_reference,
            reason_string,
            receive_maximum,
            topic_alias_maximum,
            topic_alias,
            maximum_qos,
            retain_available,
            user_properties,
            maximum_packet_size,
            wildcard_subscription_available,
            subscription_identifier_available,
            shared_subscription_available,
        } = self;
        payload_format_indicator.is_none()
            && message_expiry_interval.is_none()
            && content_type.is_none()
            && response_topic.is_none()
            && correlation_data.is_none()
            && subscription_identifiers.is_empty()
            && session_expiry_interval.is_none()
            && assigned_client_identifier.is_none()
            && server_keep_alive.is_none()
            && authentication_method.is_none()
            && authentication_data.is_none()
            && request_problem_information.is_none()
            && will_delay_interval.is_none()
            && request_response_information.is_none()
            && response_information.is_none()
            && server_reference.is_none()
            && reason_string.is_none()
            && receive_maximum.is_none()
            && topic_alias_maximum.is_none()
            && topic_alias.is_none()
            && maximum_qos.is_none()
            && retain_available.is_none()
            && user_properties.is_empty()
            && maximum_packet_size.is_none()
            && wildcard_subscription_available.is_none()
            && subscription_identifier_available.is_none()
            && shared_subscription_available.is_none()
    }
}

/// A packet's [`Properties`], kept out of line: one pointer (8 bytes) in the
/// packet, null when there are none, rather than 400 bytes inline.
///
/// Packets move by value through the decoder and the session state machine,
/// and most carry no property at all (every MQTT 3.1.x packet, most MQTT 5
/// PUBLISH packets), so keeping the properties inline made every move copy
/// them. Reading through `Deref` sees an empty [`Properties`] when there are
/// none; the first write through `DerefMut` allocates them.
#[derive(Clone, Default)]
pub struct Props(Option<Box<Properties>>);

impl From<Properties> for Props {
    /// Empty properties take no allocation.
    fn from(p: Properties) -> Props {
        if p.is_empty() {
            Props(None)
        } else {
            Props(Some(Box::new(p)))
        }
    }
}

impl From<Box<Properties>> for Props {
    fn from(p: Box<Properties>) -> Props {
        Props(Some(p))
    }
}

impl std::ops::Deref for Props {
    type Target = Properties;
    fn deref(&self) -> &Properties {
        static EMPTY: std::sync::LazyLock<Properties> = std::sync::LazyLock::new(Properties::default);
        self.0.as_deref().unwrap_or(&EMPTY)
    }
}

impl std::ops::DerefMut for Props {
    fn deref_mut(&mut self) -> &mut Properties {
        self.0.get_or_insert_with(Box::default)
    }
}

impl PartialEq for Props {
    fn eq(&self, other: &Props) -> bool {
        **self == **other
    }
}

impl Eq for Props {}

impl std::fmt::Debug for Props {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        (**self).fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::packet::{Packet, Publish};

    #[test]
    fn empty_properties_take_no_allocation_and_read_as_empty() {
        let p = Props::from(Properties::default());
        assert!(p.0.is_none());
        assert!(p.is_empty());
        assert_eq!(p.topic_alias, None);
        assert_eq!(*p, Properties::default());
    }

    #[test]
    // The assignments after `default()` are the point: they go through
    // `DerefMut`, which allocates.
    #[allow(clippy::field_reassign_with_default)]
    fn a_write_allocates_and_equality_ignores_where_they_live() {
        let mut p = Props::default();
        p.topic_alias = Some(3);
        assert!(p.0.is_some());
        assert_eq!(p.topic_alias, Some(3));
        let q = Props::from(Properties { topic_alias: Some(3), ..Properties::default() });
        assert_eq!(p, q);
        // Emptied in place (allocated) still equals never allocated.
        let mut r = Props::default();
        r.topic_alias = None;
        assert!(r.0.is_some());
        assert_eq!(r, Props::default());
        assert_eq!(format!("{r:?}"), format!("{:?}", Properties::default()));
    }

    #[test]
    fn packets_stay_small_enough_to_move_cheaply() {
        // Properties inline (400 bytes) made a PUBLISH 472 bytes; every move of a
        // decoded packet (decoder, session state machine) copied them.
        assert!(std::mem::size_of::<Publish>() <= 128, "{}", std::mem::size_of::<Publish>());
        assert!(std::mem::size_of::<Packet>() <= 136, "{}", std::mem::size_of::<Packet>());
    }
}
