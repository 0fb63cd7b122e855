//! Retained messages as stored in `mqtt-retained` (DESIGN.md §4): one
//! record per topic, the message with its MQTT 5 properties and its expiry
//! in wall-clock time, so that a replica that loads it later counts the
//! Message Expiry Interval from the original publish (MQTT 5 §3.3.2.3.3).

use std::sync::Arc;
use std::time::Instant;

use base64::Engine as _;
use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::cluster::records::{Record, FORMAT};
use crate::packet::{Properties, QoS};
use crate::session::Message;

const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

/// A retained message in `mqtt-retained` (key: [`retained_key`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RetainedRecord {
    /// Record format ([`FORMAT`]).
    pub format: u16,
    /// The topic, with its workspace prefix.
    pub topic: String,
    /// The payload, base64.
    pub payload: String,
    /// The QoS it was published with.
    pub qos: u8,
    /// When it expires, Unix milliseconds (from its Message Expiry
    /// Interval); `None`: never.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at_ms: Option<u64>,
    /// Payload Format Indicator.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payload_format_indicator: Option<u8>,
    /// Content Type.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content_type: Option<String>,
    /// Response Topic.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_topic: Option<String>,
    /// Correlation Data, base64.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub correlation_data: Option<String>,
    /// User Properties, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub user_properties: Vec<(String, String)>,
}

impl Record for RetainedRecord {
    fn format(&self) -> u16 {
        self.format
    }
}

impl RetainedRecord {
    /// The record of `message`, received at `now_ms` (Unix milliseconds).
    pub fn of(message: &Message, now_ms: u64) -> RetainedRecord {
        let p = &message.properties;
        RetainedRecord {
            format: FORMAT,
            topic: message.topic.to_string(),
            payload: B64.encode(&message.payload),
            qos: message.qos as u8,
            expires_at_ms: p.message_expiry_interval.map(|s| now_ms + u64::from(s) * 1000),
            payload_format_indicator: p.payload_format_indicator,
            content_type: p.content_type.as_ref().map(|s| s.to_string()),
            response_topic: p.response_topic.as_ref().map(|s| s.to_string()),
            correlation_data: p.correlation_data.as_ref().map(|d| B64.encode(d)),
            user_properties: p.user_properties.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        }
    }

    /// The message to keep as retained, received `now` (`now_ms` on the
    /// wall clock) with what is left of its expiry; `None` when it has
    /// expired or its bytes are not valid.
    pub fn message(&self, now: Instant, now_ms: u64) -> Option<Arc<Message>> {
        let payload = Bytes::from(B64.decode(&self.payload).ok()?);
        let mut properties = Properties {
            payload_format_indicator: self.payload_format_indicator,
            content_type: self.content_type.as_deref().map(Into::into),
            response_topic: self.response_topic.as_deref().map(Into::into),
            user_properties: self.user_properties.iter().map(|(k, v)| (k.as_str().into(), v.as_str().into())).collect(),
            ..Properties::default()
        };
        if let Some(data) = &self.correlation_data {
            properties.correlation_data = Some(Bytes::from(B64.decode(data).ok()?));
        }
        if let Some(at) = self.expires_at_ms {
            let left_ms = at.checked_sub(now_ms).filter(|ms| *ms > 0)?;
            properties.message_expiry_interval = Some(left_ms.div_ceil(1000).min(u64::from(u32::MAX)) as u32);
        }
        Some(Arc::new(Message {
            topic: self.topic.as_str().into(),
            payload,
            qos: QoS::from_u8(self.qos)?,
            retain: true,
            properties: properties.into(),
            received_at: now,
            origin: u64::MAX,
            stored: 0,
        }))
    }
}

/// The KV key of a retained topic: `t.` and the topic's bytes in base64url
/// without padding.
pub fn retained_key(topic: &str) -> String {
    format!("t.{}", base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(topic))
}

/// The topic of a key made by [`retained_key`], `None` for any other key.
pub fn topic_of_retained_key(key: &str) -> Option<String> {
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(key.strip_prefix("t.")?).ok()?;
    String::from_utf8(bytes).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(expiry: Option<u32>) -> Message {
        let mut properties = Properties { content_type: Some("text/plain".into()), ..Properties::default() };
        properties.message_expiry_interval = expiry;
        properties.user_properties.push(("k".into(), "v".into()));
        properties.correlation_data = Some(Bytes::from_static(b"\x00\x01"));
        Message {
            topic: "ws1/p/1".into(),
            payload: Bytes::from_static(b"\xff\x00payload"),
            qos: QoS::AtLeastOnce,
            retain: true,
            properties: properties.into(),
            received_at: Instant::now(),
            origin: 7,
            stored: 0,
        }
    }

    #[test]
    fn a_retained_message_reads_back_with_its_properties() {
        let now = Instant::now();
        let record = RetainedRecord::of(&message(None), 1_000);
        let back = RetainedRecord::decode(&record.encode()).unwrap().message(now, 5_000).unwrap();
        let original = message(None);
        assert_eq!(back.topic, original.topic);
        assert_eq!(back.payload, original.payload);
        assert_eq!(back.qos, original.qos);
        assert_eq!(*back.properties, *original.properties);
    }

    #[test]
    fn the_expiry_counts_from_the_original_publish_in_wall_clock_time() {
        let record = RetainedRecord::of(&message(Some(60)), 1_000_000);
        let now = Instant::now();
        let later = record.message(now, 1_000_000 + 20_500).unwrap();
        assert_eq!(later.properties.message_expiry_interval, Some(40));
        assert!(record.message(now, 1_000_000 + 60_000).is_none(), "expired");
    }

    #[test]
    fn retained_keys_are_kv_keys() {
        let key = retained_key("$share/a b/#");
        assert!(key.starts_with("t.") && key[2..].bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'));
        assert_eq!(topic_of_retained_key(&key).as_deref(), Some("$share/a b/#"));
    }
}
