//! MQTT 5 reason codes (MQTT 5 §2.4) and their 3.1.1 equivalents.
//!
//! A reason code is one byte; several names share a value (0x00 is Success,
//! Normal disconnection and Granted QoS 0), so the type is a newtype over
//! `u8` with named constants rather than an enum. Values below 0x80 report
//! success, 0x80 and above failure.

use std::fmt;

/// An MQTT 5 reason code (MQTT 5 §2.4, table 2-6).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct ReasonCode(pub u8);

macro_rules! reason_codes {
    ($($name:ident = $value:expr, $text:expr;)*) => {
        impl ReasonCode {
            $(
                #[doc = concat!("`", stringify!($value), "` ", $text, ".")]
                pub const $name: ReasonCode = ReasonCode($value);
            )*

            /// The specification's name for this code (the first name when
            /// several share the value), or `None` for an unassigned value.
            pub fn name(self) -> Option<&'static str> {
                match self.0 {
                    $($value => Some($text),)*
                    #[allow(unreachable_patterns)]
                    _ => None,
                }
            }
        }
    };
}

reason_codes! {
    SUCCESS = 0x00, "Success";
    GRANTED_QOS_1 = 0x01, "Granted QoS 1";
    GRANTED_QOS_2 = 0x02, "Granted QoS 2";
    DISCONNECT_WITH_WILL = 0x04, "Disconnect with Will Message";
    NO_MATCHING_SUBSCRIBERS = 0x10, "No matching subscribers";
    NO_SUBSCRIPTION_EXISTED = 0x11, "No subscription existed";
    CONTINUE_AUTHENTICATION = 0x18, "Continue authentication";
    RE_AUTHENTICATE = 0x19, "Re-authenticate";
    UNSPECIFIED_ERROR = 0x80, "Unspecified error";
    MALFORMED_PACKET = 0x81, "Malformed Packet";
    PROTOCOL_ERROR = 0x82, "Protocol Error";
    IMPLEMENTATION_SPECIFIC_ERROR = 0x83, "Implementation specific error";
    UNSUPPORTED_PROTOCOL_VERSION = 0x84, "Unsupported Protocol Version";
    CLIENT_IDENTIFIER_NOT_VALID = 0x85, "Client Identifier not valid";
    BAD_USER_NAME_OR_PASSWORD = 0x86, "Bad User Name or Password";
    NOT_AUTHORIZED = 0x87, "Not authorized";
    SERVER_UNAVAILABLE = 0x88, "Server unavailable";
    SERVER_BUSY = 0x89, "Server busy";
    BANNED = 0x8A, "Banned";
    SERVER_SHUTTING_DOWN = 0x8B, "Server shutting down";
    BAD_AUTHENTICATION_METHOD = 0x8C, "Bad authentication method";
    KEEP_ALIVE_TIMEOUT = 0x8D, "Keep Alive timeout";
    SESSION_TAKEN_OVER = 0x8E, "Session taken over";
    TOPIC_FILTER_INVALID = 0x8F, "Topic Filter invalid";
    TOPIC_NAME_INVALID = 0x90, "Topic Name invalid";
    PACKET_IDENTIFIER_IN_USE = 0x91, "Packet Identifier in use";
    PACKET_IDENTIFIER_NOT_FOUND = 0x92, "Packet Identifier not found";
    RECEIVE_MAXIMUM_EXCEEDED = 0x93, "Receive Maximum exceeded";
    TOPIC_ALIAS_INVALID = 0x94, "Topic Alias invalid";
    PACKET_TOO_LARGE = 0x95, "Packet too large";
    MESSAGE_RATE_TOO_HIGH = 0x96, "Message rate too high";
    QUOTA_EXCEEDED = 0x97, "Quota exceeded";
    ADMINISTRATIVE_ACTION = 0x98, "Administrative action";
    PAYLOAD_FORMAT_INVALID = 0x99, "Payload format invalid";
    RETAIN_NOT_SUPPORTED = 0x9A, "Retain not supported";
    QOS_NOT_SUPPORTED = 0x9B, "QoS not supported";
    USE_ANOTHER_SERVER = 0x9C, "Use another server";
    SERVER_MOVED = 0x9D, "Server moved";
    SHARED_SUBSCRIPTIONS_NOT_SUPPORTED = 0x9E, "Shared Subscriptions not supported";
    CONNECTION_RATE_EXCEEDED = 0x9F, "Connection rate exceeded";
    MAXIMUM_CONNECT_TIME = 0xA0, "Maximum connect time";
    SUBSCRIPTION_IDENTIFIERS_NOT_SUPPORTED = 0xA1, "Subscription Identifiers not supported";
    WILDCARD_SUBSCRIPTIONS_NOT_SUPPORTED = 0xA2, "Wildcard Subscriptions not supported";
}

impl ReasonCode {
    /// 0x00 in a DISCONNECT.
    pub const NORMAL_DISCONNECTION: ReasonCode = ReasonCode(0x00);
    /// 0x00 in a SUBACK.
    pub const GRANTED_QOS_0: ReasonCode = ReasonCode(0x00);

    /// True for 0x80 and above: the request failed.
    pub fn is_error(self) -> bool {
        self.0 >= 0x80
    }

    /// The MQTT 3.1.1 CONNACK return code for this CONNACK reason code
    /// (MQTT 3.1.1 §3.2.2.3): 0 accepted, 1 unacceptable protocol version,
    /// 2 identifier rejected, 3 server unavailable, 4 bad user name or
    /// password, 5 not authorized.
    pub fn to_v3_connack(self) -> u8 {
        match self {
            ReasonCode::SUCCESS => 0,
            ReasonCode::UNSUPPORTED_PROTOCOL_VERSION => 1,
            ReasonCode::CLIENT_IDENTIFIER_NOT_VALID => 2,
            ReasonCode::BAD_USER_NAME_OR_PASSWORD | ReasonCode::BAD_AUTHENTICATION_METHOD => 4,
            ReasonCode::NOT_AUTHORIZED | ReasonCode::BANNED => 5,
            _ => 3,
        }
    }

    /// The reason code for an MQTT 3.1.1 CONNACK return code; `None` for
    /// values above 5 (reserved).
    pub fn from_v3_connack(code: u8) -> Option<ReasonCode> {
        Some(match code {
            0 => ReasonCode::SUCCESS,
            1 => ReasonCode::UNSUPPORTED_PROTOCOL_VERSION,
            2 => ReasonCode::CLIENT_IDENTIFIER_NOT_VALID,
            3 => ReasonCode::SERVER_UNAVAILABLE,
            4 => ReasonCode::BAD_USER_NAME_OR_PASSWORD,
            5 => ReasonCode::NOT_AUTHORIZED,
            _ => return None,
        })
    }
}

impl fmt::Debug for ReasonCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(name) => write!(f, "0x{:02X} ({name})", self.0),
            None => write!(f, "0x{:02X}", self.0),
        }
    }
}

impl fmt::Display for ReasonCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}
