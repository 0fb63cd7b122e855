//! Wills as stored in `mqtt-session-will` (DESIGN.md §4, §5): each live
//! connection's will, with the identity that declared it and the process
//! that serves it, so that the elected sweeper can send the wills of a
//! stopped, fenced or gone replica's connections once their grace is over.

use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::cluster::records::{Record, FORMAT};
use crate::cluster::retained::RetainedRecord;
use crate::packet::Will;
use crate::session::Message;

/// A connection's will in `mqtt-session-will` (key: the client
/// identifier's `client_key`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WillRecord {
    /// Record format ([`FORMAT`]).
    pub format: u16,
    /// The client identifier that declared it.
    pub client_id: String,
    /// Its user name, if it signed in with one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub username: Option<String>,
    /// Its workspace.
    pub workspace: String,
    /// The replica that serves the connection.
    pub replica: String,
    /// The process that serves it (`MemberRecord::instance`).
    pub instance: String,
    /// The Will Delay Interval, seconds (MQTT 5 §3.1.3.2.2).
    pub delay_s: u32,
    /// The Will Retain flag.
    pub retain: bool,
    /// The will's Message Expiry Interval, seconds, counted from its
    /// publication.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expiry_s: Option<u32>,
    /// Topic (with its workspace prefix), payload, QoS and properties.
    pub message: RetainedRecord,
}

impl Record for WillRecord {
    fn format(&self) -> u16 {
        self.format
    }
}

impl WillRecord {
    /// The record of `will` (its topic already with the workspace
    /// prefix), declared at `now_ms` (Unix milliseconds).
    #[allow(clippy::too_many_arguments)]
    pub fn of(
        will: &Will,
        client_id: &str,
        username: Option<&str>,
        workspace: &str,
        replica: &str,
        instance: &str,
        now_ms: u64,
    ) -> WillRecord {
        let message = Message {
            topic: will.topic.clone(),
            payload: will.payload.clone(),
            qos: will.qos,
            retain: will.retain,
            properties: will.properties.clone(),
            received_at: Instant::now(),
            origin: u64::MAX,
            stored: 0,
        };
        let mut message = RetainedRecord::of(&message, now_ms);
        // The Message Expiry Interval of a will counts from its
        // publication, not its declaration.
        message.expires_at_ms = None;
        WillRecord {
            format: FORMAT,
            client_id: client_id.to_owned(),
            username: username.map(str::to_owned),
            workspace: workspace.to_owned(),
            replica: replica.to_owned(),
            instance: instance.to_owned(),
            delay_s: will.properties.will_delay_interval.unwrap_or(0),
            retain: will.retain,
            expiry_s: will.properties.message_expiry_interval,
            message,
        }
    }

    /// The will to publish now; `None` when its bytes are not valid.
    pub fn will(&self) -> Option<Will> {
        let now = Instant::now();
        let message = self.message.message(now, 0)?;
        let mut properties = message.properties.clone();
        properties.message_expiry_interval = self.expiry_s;
        Some(Will {
            topic: message.topic.clone(),
            payload: message.payload.clone(),
            qos: message.qos,
            retain: self.retain,
            properties,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::packet::{Properties, QoS};
    use bytes::Bytes;

    #[test]
    fn a_will_reads_back_as_declared() {
        let properties = Properties { will_delay_interval: Some(5), content_type: Some("t".into()), ..Properties::default() };
        let will = Will {
            topic: "ws/devices/7/status".into(),
            payload: Bytes::from_static(b"offline"),
            qos: QoS::AtLeastOnce,
            retain: true,
            properties: properties.into(),
        };
        let record = WillRecord::of(&will, "7", Some("dev"), "ws", "r1", "abc", 1_000);
        let back = WillRecord::decode(&record.encode()).unwrap();
        assert_eq!(back.delay_s, 5);
        let again = back.will().unwrap();
        assert_eq!((again.topic.as_ref(), &again.payload[..], again.qos, again.retain), ("ws/devices/7/status", &b"offline"[..], QoS::AtLeastOnce, true));
        assert_eq!(again.properties.content_type.as_deref(), Some("t"));
    }
}
