//! Retained messages as stored in `mqtt-retained` (DESIGN.md §4): one
//! record per topic, the message with its MQTT 5 properties and its expiry
//! in wall-clock time, so that a replica that loads it later counts the
//! Message Expiry Interval from the original publish (MQTT 5 §3.3.2.3.3).
//!
//! The value in the bucket ([`RetainedRecord::to_value`]) has two layouts:
//! - format 1: the record as JSON, its payload in base64 (a third larger:
//!   a payload above ~780 kB did not fit NATS' 1 MiB `max_payload`);
//! - format 2: `format` (u16, big-endian), the length of the header (u32,
//!   big-endian), the header (the record as JSON with an empty payload),
//!   then the payload's bytes as they are.
//!
//! Both are read; a replica writes the one its cluster's format floor
//! allows ([`crate::cluster::records::write_format`]).

use std::sync::Arc;
use std::time::Instant;

use base64::Engine as _;
use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::cluster::records::{Record, RecordError, FORMAT, FORMATS_READ};
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
    /// The payload (base64 in JSON).
    #[serde(with = "base64_bytes")]
    pub payload: Bytes,
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
            payload: message.payload.clone(),
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
        let payload = self.payload.clone();
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
            from_mesh: false,
            groups: crate::session::GroupPick::ALL,
        }))
    }
}

/// Bytes before the header in format 2: the format and the header length.
const PREFIX: usize = 6;

impl RetainedRecord {
    /// The value to store in `mqtt-retained`: the layout of
    /// [`RetainedRecord::format`] (1: JSON, 2 and later: binary, see the
    /// module documentation).
    pub fn to_value(&self) -> Vec<u8> {
        if self.format < 2 {
            return self.encode();
        }
        let header = RetainedRecord { payload: Bytes::new(), ..self.clone() }.encode();
        let mut value = Vec::with_capacity(PREFIX + header.len() + self.payload.len());
        value.extend_from_slice(&self.format.to_be_bytes());
        value.extend_from_slice(&(header.len() as u32).to_be_bytes());
        value.extend_from_slice(&header);
        value.extend_from_slice(&self.payload);
        value
    }

    /// A value read back from `mqtt-retained`, of any format this build
    /// reads.
    ///
    /// # Errors
    /// [`RecordError::UnknownFormat`] for a format outside
    /// [`FORMATS_READ`]; [`RecordError::Malformed`] for bytes that are not
    /// a retained record (a header length past the end, a header that is
    /// not JSON or disagrees with the prefix).
    pub fn from_value(value: &[u8]) -> Result<RetainedRecord, RecordError> {
        if value.first() == Some(&b'{') {
            return RetainedRecord::decode(value);
        }
        let malformed = |why: &str| RecordError::Malformed(format!("retained record: {why}"));
        if value.len() < PREFIX {
            return Err(malformed("shorter than its prefix"));
        }
        let format = u16::from_be_bytes([value[0], value[1]]);
        if !FORMATS_READ.contains(&format) {
            return Err(RecordError::UnknownFormat(format));
        }
        if format < 2 {
            return Err(malformed("format 1 is JSON"));
        }
        let len = u32::from_be_bytes([value[2], value[3], value[4], value[5]]) as usize;
        let header = value.get(PREFIX..PREFIX.saturating_add(len)).ok_or_else(|| malformed("header past the end"))?;
        let mut record = RetainedRecord::decode(header)?;
        if record.format != format || !record.payload.is_empty() {
            return Err(malformed("header disagrees with its prefix"));
        }
        record.payload = Bytes::copy_from_slice(&value[PREFIX + len..]);
        Ok(record)
    }

    /// This record in format `format` (see [`RetainedRecord::to_value`]).
    pub fn with_format(mut self, format: u16) -> RetainedRecord {
        self.format = format;
        self
    }
}

/// Serde for a payload as base64 text.
mod base64_bytes {
    use base64::Engine as _;
    use bytes::Bytes;
    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(bytes: &Bytes, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&super::B64.encode(bytes))
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Bytes, D::Error> {
        let text = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        super::B64.decode(text.as_bytes()).map(Bytes::from).map_err(serde::de::Error::custom)
    }
}

/// The KV key of a retained topic: `t.` and the topic's
/// [`name_token`](crate::cluster::keys::name_token) (base64url without
/// padding, a hash for a topic over 768 bytes: see
/// [`crate::cluster::keys`]).
pub fn retained_key(topic: &str) -> String {
    format!("t.{}", crate::cluster::keys::name_token(topic))
}

/// The topic of a key made by [`retained_key`]; `None` for any other key,
/// and for a hashed one (a long topic: the record carries it,
/// [`RetainedRecord::topic`]; a reader checks [`is_retained_key_of`]).
pub fn topic_of_retained_key(key: &str) -> Option<String> {
    match crate::cluster::keys::read_token(key.strip_prefix("t.")?)? {
        crate::cluster::keys::Token::Plain(topic) => Some(topic),
        crate::cluster::keys::Token::Hashed => None,
    }
}

/// Whether `key` is [`retained_key`]`(topic)`.
pub fn is_retained_key_of(key: &str, topic: &str) -> bool {
    key.strip_prefix("t.").is_some_and(|token| token == crate::cluster::keys::name_token(topic))
}

/// Whether `key` was made by [`retained_key`] from a topic it does not
/// hold (a hash): the topic is known only from the record.
pub fn is_hashed_retained_key(key: &str) -> bool {
    key.strip_prefix("t.").and_then(crate::cluster::keys::read_token) == Some(crate::cluster::keys::Token::Hashed)
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
            groups: crate::session::GroupPick::ALL,
            from_mesh: false,
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
        assert!(is_retained_key_of(&key, "$share/a b/#") && !is_hashed_retained_key(&key));
        let long = format!("ws1/{}", "t".repeat(4_000));
        let hashed = retained_key(&long);
        assert_eq!(hashed.len(), 2 + crate::cluster::keys::HASHED_TOKEN_LEN);
        assert_eq!(topic_of_retained_key(&hashed), None, "the topic is in the record");
        assert!(is_hashed_retained_key(&hashed) && is_retained_key_of(&hashed, &long));
        assert!(!is_retained_key_of(&hashed, "ws1/t"));
    }

    #[test]
    fn format_2_carries_the_payload_as_it_is() {
        let mut m = message(Some(60));
        m.payload = Bytes::from((0..900_000u32).map(|i| (i * 7) as u8).collect::<Vec<u8>>());
        let record = RetainedRecord::of(&m, 1_000);
        assert_eq!(record.format, 2);
        let value = record.to_value();
        assert!(value.len() < 900_000 + 400, "{} bytes", value.len());
        assert_eq!(&value[..2], &[0, 2]);
        let back = RetainedRecord::from_value(&value).unwrap();
        assert_eq!(back, record);
        assert_eq!(back.message(Instant::now(), 5_000).unwrap().payload, m.payload);
    }

    #[test]
    fn a_format_1_value_is_still_read() {
        let record = RetainedRecord::of(&message(None), 1_000).with_format(1);
        let value = record.to_value();
        assert_eq!(value[0], b'{');
        assert!(String::from_utf8_lossy(&value).contains("\"payload\":\"/wBwYXlsb2Fk\""), "base64 in JSON");
        assert_eq!(RetainedRecord::from_value(&value).unwrap(), record);
        // As written before format 2 existed.
        let old = br#"{"format":1,"topic":"a/b","payload":"aGk=","qos":1}"#;
        let back = RetainedRecord::from_value(old).unwrap().message(Instant::now(), 0).unwrap();
        assert_eq!((&*back.topic, &back.payload[..]), ("a/b", &b"hi"[..]));
    }

    #[test]
    fn a_value_of_an_unknown_format_or_cut_short_is_refused() {
        let value = RetainedRecord::of(&message(None), 1_000).to_value();
        let mut future = value.clone();
        future[1] = 9;
        assert_eq!(RetainedRecord::from_value(&future), Err(RecordError::UnknownFormat(9)));
        for cut in [0, 1, 5, 6, 20] {
            assert!(matches!(RetainedRecord::from_value(&value[..cut]), Err(RecordError::Malformed(_))), "cut at {cut}");
        }
        let mut wrong = value.clone();
        wrong[2..6].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(matches!(RetainedRecord::from_value(&wrong), Err(RecordError::Malformed(_))));
    }

    proptest::proptest! {
        #[test]
        fn reading_any_value_never_panics(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..400)) {
            let _ = RetainedRecord::from_value(&bytes);
            let mut prefixed = vec![0, 2];
            prefixed.extend_from_slice(&bytes);
            let _ = RetainedRecord::from_value(&prefixed);
        }

        #[test]
        fn any_retained_message_reads_back_byte_exact_in_either_format(
            payload in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..2000),
            topic in "[a-z/]{1,40}",
            format in 1u16..=2,
            expiry in proptest::option::of(1u32..100_000),
        ) {
            let mut m = message(expiry);
            m.topic = topic.as_str().into();
            m.payload = Bytes::from(payload);
            let record = RetainedRecord::of(&m, 1_000).with_format(format);
            let back = RetainedRecord::from_value(&record.to_value()).unwrap();
            proptest::prop_assert_eq!(&back, &record);
            let now = Instant::now();
            proptest::prop_assert_eq!(back.message(now, 1_000).unwrap().payload.clone(), m.payload.clone());
        }
    }
}
