//! Open inbound QoS 2 flows of persistent sessions, as stored in
//! `mqtt-session-qos2` (DESIGN.md §4, §7; issue 24): one key per flow,
//! [`key`] (the client identifier's [`client_key`] and the packet
//! identifier), written after the value is stored (the ingest stream
//! and/or the session log took it) and before the PUBREC, deleted by the
//! PUBREL before the PUBCOMP, and every key of a session purged when the
//! session ends.
//!
//! A replica that takes the session up reads the session's keys
//! ([`prefix`]) and opens those packet identifiers in the session, so a
//! PUBLISH the client sends again (DUP) is answered PUBREC and not
//! forwarded a second time `[MQTT-4.3.3-10]`, and its PUBREL gets its
//! PUBCOMP `[MQTT-4.3.3-12]`. The ingest stream's and the logs' duplicate
//! windows do not cover that: their `Nats-Msg-Id` is per broker process
//! and append (nats-bridge `ingest.rs`), so the same PUBLISH sent to
//! another replica would be a new message there, and a live subscriber
//! on the mesh would get it again either way.

use serde::{Deserialize, Serialize};

use crate::cluster::records::{client_key, Record};

/// One open inbound QoS 2 flow in `mqtt-session-qos2`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Qos2Record {
    /// Record format ([`crate::cluster::records::FORMAT`]).
    pub format: u16,
    /// The client identifier (checked against the key on read).
    pub client_id: String,
    /// The packet identifier, 1..=65,535.
    pub packet_id: u16,
    /// The `Nats-Msg-Id` of the value's appends (ingest stream, session
    /// log); empty when nothing was appended (`store.kind = "none"` and no
    /// persistent session wanted it).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message_id: String,
}

impl Record for Qos2Record {
    fn format(&self) -> u16 {
        self.format
    }
}

impl Qos2Record {
    /// Whether it is the record of `client_id`'s flow `packet_id` (the
    /// key it was found under says which): a record of another client
    /// (a hashed key's collision) or packet identifier 0 is not used.
    pub fn belongs_to(&self, client_id: &str, packet_id: u16) -> bool {
        self.packet_id != 0 && self.packet_id == packet_id && self.client_id == client_id
    }
}

/// The key of `client_id`'s flow `packet_id`: `<client key>.<packet id>`
/// in decimal ([`crate::cluster::records::qos2_key`], which the sweeper's
/// filter [`crate::cluster::records::qos2_keys_of`] selects).
pub fn key(client_id: &str, packet_id: u16) -> String {
    crate::cluster::records::qos2_key(client_id, packet_id)
}

/// What every key of `client_id`'s flows starts with: `<client key>.`
/// (a subject filter `$KV.mqtt-session-qos2.<prefix>*` selects them).
pub fn prefix(client_id: &str) -> String {
    format!("{}.", client_key(client_id))
}

/// The packet identifier of a key that starts with `prefix`, if it is
/// one: decimal 1..=65,535.
pub fn packet_id_of_key(prefix: &str, key: &str) -> Option<u16> {
    let rest = key.strip_prefix(prefix)?;
    if rest.is_empty() || rest.len() > 5 || !rest.bytes().all(|b| b.is_ascii_digit()) || rest.starts_with('0') {
        return None;
    }
    rest.parse().ok().filter(|&id| id != 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::records::FORMAT;
    use proptest::prelude::*;

    #[test]
    fn a_flow_reads_back_and_its_key_names_its_packet_identifier() {
        let r = Qos2Record { format: FORMAT, client_id: "dev-1".into(), packet_id: 7, message_id: "ab.i3".into() };
        assert_eq!(Qos2Record::decode(&r.encode()).unwrap(), r);
        assert!(r.belongs_to("dev-1", 7));
        assert!(!r.belongs_to("dev-1", 8) && !r.belongs_to("dev-2", 7));
        let p = prefix("dev-1");
        assert_eq!(packet_id_of_key(&p, &key("dev-1", 7)), Some(7));
        assert_eq!(packet_id_of_key(&p, &key("dev-1", 65535)), Some(65535));
        for bad in ["", "0", "07", "65536", "x", "1.2", "123456"] {
            assert_eq!(packet_id_of_key(&p, &format!("{p}{bad}")), None, "{bad:?}");
        }
        assert_eq!(packet_id_of_key(&prefix("dev-2"), &key("dev-1", 7)), None);
        let none = Qos2Record { message_id: String::new(), ..r };
        assert!(!String::from_utf8(none.encode()).unwrap().contains("message_id"));
    }

    proptest! {
        /// Any flow reads back as it was written, and its key gives its
        /// packet identifier back.
        #[test]
        fn any_flow_reads_back(client_id in ".{0,40}", packet_id in 1u16.., message_id in "[a-z0-9.]{0,30}") {
            let r = Qos2Record { format: FORMAT, client_id, packet_id, message_id };
            prop_assert_eq!(&Qos2Record::decode(&r.encode()).unwrap(), &r);
            prop_assert_eq!(packet_id_of_key(&prefix(&r.client_id), &key(&r.client_id, packet_id)), Some(packet_id));
        }
    }
}
