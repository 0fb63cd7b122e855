//! One stream message as one table row: the headers of the ingest
//! contract (/work/coord/ingest-contract.md, DESIGN.md §7) mapped to
//! columns.

use std::time::SystemTime;

use async_nats::HeaderMap;
use bytes::Bytes;

/// The idempotency key: the same accepted value appended again carries the
/// same ID.
pub const MSG_ID: &str = "Nats-Msg-Id";
/// The MQTT topic name, after topic-alias resolution.
pub const TOPIC: &str = "Mqtt-Topic";
/// `1` or `2`.
pub const QOS: &str = "Mqtt-Qos";
/// The publishing client's client identifier.
pub const CLIENT_ID: &str = "Mqtt-Client-Id";
/// `1` when the RETAIN flag was set; absent otherwise.
pub const RETAIN: &str = "Mqtt-Retain";
/// The publisher's workspace; absent for none/default.
pub const WORKSPACE: &str = "Mqtt-Workspace";

/// One row of the table.
///
/// A message that lacks a header the contract promises is still stored,
/// never dropped: a missing `Mqtt-Topic`, `Mqtt-Client-Id` or a missing or
/// unreadable `Mqtt-Qos` is NULL, and a missing `Nats-Msg-Id` is replaced
/// by `stream-seq:<stream sequence>` (unique within one stream; a stream
/// deleted and created again restarts its sequences, so such rows may then
/// be taken for duplicates).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    /// `Nats-Msg-Id` (the primary key).
    pub msg_id: String,
    /// The message's sequence in the stream.
    pub stream_seq: i64,
    /// The stream subject (`mqtt-ingest.<workspace>...`).
    pub subject: String,
    /// `Mqtt-Topic`.
    pub topic: Option<String>,
    /// `Mqtt-Qos`: 1 or 2.
    pub qos: Option<i16>,
    /// `Mqtt-Retain` is `1`.
    pub retain: bool,
    /// `Mqtt-Client-Id`.
    pub client_id: Option<String>,
    /// `Mqtt-Workspace` (None: the default workspace).
    pub workspace: Option<String>,
    /// The MQTT payload bytes, unchanged.
    pub payload: Bytes,
    /// When the stream stored the message (its timestamp).
    pub received_at: SystemTime,
}

impl Row {
    /// The row for a message with these parts, and whether every header the
    /// contract promises was there (false: see [`Row`] for what was put
    /// instead).
    pub fn from_parts(
        subject: &str,
        headers: Option<&HeaderMap>,
        payload: Bytes,
        stream_seq: u64,
        received_at: SystemTime,
    ) -> (Row, bool) {
        let raw = |name: &str| -> Option<String> { headers?.get(name).map(|value| value.as_str().to_owned()) };
        // A text that cannot travel as a header value (a line break, a
        // trailing space) comes base64 under the name with `-B64`.
        let header = |name: &str| -> Option<String> {
            raw(name).or_else(|| {
                use base64::Engine as _;
                let encoded = raw(&format!("{name}-B64"))?;
                String::from_utf8(base64::engine::general_purpose::STANDARD.decode(encoded).ok()?).ok()
            })
        };
        let msg_id = header(MSG_ID).filter(|id| !id.is_empty());
        let topic = header(TOPIC);
        let qos = header(QOS).and_then(|qos| match qos.as_str() {
            "1" => Some(1),
            "2" => Some(2),
            _ => None,
        });
        let client_id = header(CLIENT_ID);
        let complete = msg_id.is_some() && topic.is_some() && qos.is_some() && client_id.is_some();
        let row = Row {
            msg_id: msg_id.unwrap_or_else(|| format!("stream-seq:{stream_seq}")),
            // Sequences stay far below i64::MAX; saturate rather than wrap.
            stream_seq: i64::try_from(stream_seq).unwrap_or(i64::MAX),
            subject: subject.to_owned(),
            topic,
            qos,
            retain: header(RETAIN).as_deref() == Some("1"),
            client_id,
            workspace: header(WORKSPACE).filter(|w| !w.is_empty()),
            payload,
            received_at,
        };
        (row, complete)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.insert(*name, *value);
        }
        map
    }

    #[test]
    fn a_topic_and_client_identifier_sent_in_base64_are_decoded() {
        // "weird/line\nbreak" and "bad\tid " do not travel as header values.
        let map = headers(&[
            (MSG_ID, "s1:8"),
            ("Mqtt-Topic-B64", "d2VpcmQvbGluZQpicmVhaw=="),
            (QOS, "1"),
            ("Mqtt-Client-Id-B64", "YmFkCWlkIA=="),
        ]);
        let (row, complete) = Row::from_parts("mqtt-ingest._", Some(&map), Bytes::new(), 1, SystemTime::now());
        assert!(complete);
        assert_eq!(row.topic.as_deref(), Some("weird/line\nbreak"));
        assert_eq!(row.client_id.as_deref(), Some("bad\tid "));
        let bad = headers(&[(MSG_ID, "s1:9"), ("Mqtt-Topic-B64", "not base64!"), (QOS, "1"), (CLIENT_ID, "c")]);
        let (row, complete) = Row::from_parts("mqtt-ingest._", Some(&bad), Bytes::new(), 2, SystemTime::now());
        assert!(!complete && row.topic.is_none(), "unreadable: NULL, kept");
    }

    #[test]
    fn every_contract_header_becomes_its_column() {
        let map = headers(&[
            (MSG_ID, "s1:7"),
            (TOPIC, "plant/4/temp"),
            (QOS, "2"),
            (CLIENT_ID, "dev-9"),
            (RETAIN, "1"),
            (WORKSPACE, "acme"),
        ]);
        let now = SystemTime::now();
        let (row, complete) = Row::from_parts(
            "mqtt-ingest.acme.x",
            Some(&map),
            Bytes::from_static(b"\xff\x00"),
            42,
            now,
        );
        assert!(complete);
        assert_eq!(row.msg_id, "s1:7");
        assert_eq!(row.topic.as_deref(), Some("plant/4/temp"));
        assert_eq!(row.qos, Some(2));
        assert!(row.retain);
        assert_eq!(row.client_id.as_deref(), Some("dev-9"));
        assert_eq!(row.workspace.as_deref(), Some("acme"));
        assert_eq!(row.payload.as_ref(), b"\xff\x00");
        assert_eq!(row.stream_seq, 42);
        assert_eq!(row.subject, "mqtt-ingest.acme.x");
    }

    #[test]
    fn a_message_without_the_contract_headers_is_kept_with_nulls_and_a_sequence_key() {
        let (row, complete) = Row::from_parts(
            "mqtt-ingest._",
            None,
            Bytes::new(),
            9,
            SystemTime::UNIX_EPOCH,
        );
        assert!(!complete);
        assert_eq!(row.msg_id, "stream-seq:9");
        assert_eq!(
            (row.topic, row.qos, row.client_id, row.workspace),
            (None, None, None, None)
        );
        assert!(!row.retain);

        let map = headers(&[(MSG_ID, "a"), (TOPIC, "t"), (QOS, "0"), (CLIENT_ID, "c")]);
        let (row, complete) =
            Row::from_parts("s", Some(&map), Bytes::new(), 1, SystemTime::UNIX_EPOCH);
        assert!(!complete, "QoS 0 is not a stored QoS");
        assert_eq!(row.qos, None);
    }
}
