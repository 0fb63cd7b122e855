//! Session logs (DESIGN.md §4, §7; issue 24): per workspace, the stream
//! `LOG_mqtt-sessions-<workspace token>` holds every accepted QoS 1/2
//! value that at least one persistent session of that workspace wants (on
//! any replica, connected or not), appended before the publisher's
//! PUBACK/PUBREC. This module is pure: the stream's names, the encoding of
//! one value as a stream message and back, and [`Interest`], the index a
//! replica keeps of what persistent sessions want.
//!
//! # One value as a stream message
//! - subject `mqtt-sessions.<workspace token>` (the token of
//!   [`crate::cluster::ingest::workspace_token`]: one valid NATS token,
//!   distinct per workspace);
//! - headers `Mqtt-Topic` (the topic as the client sees it, without the
//!   broker's workspace prefix; base64 under `Mqtt-Topic-B64` when it
//!   cannot be a header value as it is), `Mqtt-Qos` (`1`/`2`),
//!   `Mqtt-Retain` (`1`, absent otherwise), `Mqtt-Origin` (the
//!   publisher's client key, decimal: No Local), `Mqtt-Received-Ms` (Unix
//!   milliseconds: the Message Expiry Interval counts from there), plus
//!   `Nats-Msg-Id` (the bridge's, the ingest append's ID: every retry of
//!   one value is stored once);
//! - payload: the PUBLISH properties as MQTT 5 encodes them
//!   ([`encode_publish_properties`]), then the MQTT payload unchanged, so
//!   every property comes back exactly (user properties that cannot be
//!   header values included).
//!
//! Not a public contract (the ingest stream is the one for downstream
//! readers): only replicas read it.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;

use base64::Engine as _;
use bytes::{Bytes, BytesMut};
use bytestring::ByteString;

use crate::cluster::ingest::{push_text, qos_text, workspace_token, Headers, B64_SUFFIX};
use crate::packet::codec::{decode_publish_properties, encode_publish_properties};
use crate::packet::QoS;
use crate::session::{workspace_namespace, GroupPick, Message};
use crate::trie::SubscriptionTrie;

/// The stream names' prefix: `LOG_mqtt-sessions-<workspace token>`.
pub const STREAM_PREFIX: &str = "LOG_mqtt-sessions-";

/// The subjects' prefix: `mqtt-sessions.<workspace token>`.
pub const SUBJECT_PREFIX: &str = "mqtt-sessions.";

/// Header: the topic (see the module documentation).
pub const TOPIC: &str = "Mqtt-Topic";
/// Header: `1` or `2`.
pub const QOS: &str = "Mqtt-Qos";
/// Header: `1` when RETAIN was set.
pub const RETAIN: &str = "Mqtt-Retain";
/// Header: the publisher's client key ([`Message::origin`]), decimal.
pub const ORIGIN: &str = "Mqtt-Origin";
/// Header: when the broker received the value, Unix milliseconds.
pub const RECEIVED_MS: &str = "Mqtt-Received-Ms";

/// The session log stream of `workspace`.
pub fn stream(workspace: &str) -> String {
    format!("{STREAM_PREFIX}{}", workspace_token(workspace))
}

/// The subject values of `workspace` are appended on.
pub fn subject(workspace: &str) -> String {
    format!("{SUBJECT_PREFIX}{}", workspace_token(workspace))
}

/// One value as its session log keeps it: [`encode`]'s output, which the
/// bridge publishes as it is (adding `Nats-Msg-Id`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Encoded {
    /// `mqtt-sessions.<workspace token>`.
    pub subject: String,
    /// The headers but `Nats-Msg-Id`.
    pub headers: Headers,
    /// Properties, then the payload.
    pub payload: Bytes,
}

/// `message` (QoS 1/2, its topic with the broker's workspace prefix) of
/// `workspace`, received at `received_ms` (Unix milliseconds), as a
/// session log message. `None` when its properties cannot be encoded
/// (larger than a Variable Byte Integer counts: no PUBLISH carries such).
pub fn encode(workspace: &str, message: &Message, received_ms: u64) -> Option<Encoded> {
    let namespace = workspace_namespace(workspace);
    let topic = message.topic.strip_prefix(&*namespace).unwrap_or(&message.topic);
    let mut headers = Vec::with_capacity(5);
    push_text(&mut headers, TOPIC, topic);
    headers.push((Cow::Borrowed(QOS), qos_text(message.qos as u8)));
    if message.retain {
        headers.push((Cow::Borrowed(RETAIN), Cow::Borrowed("1")));
    }
    headers.push((Cow::Borrowed(ORIGIN), Cow::Owned(message.origin.to_string())));
    headers.push((Cow::Borrowed(RECEIVED_MS), Cow::Owned(received_ms.to_string())));
    let mut payload = BytesMut::with_capacity(message.payload.len() + 16);
    encode_publish_properties(&message.properties, &mut payload).ok()?;
    payload.extend_from_slice(&message.payload);
    Some(Encoded { subject: subject(workspace), headers, payload: payload.freeze() })
}

/// One value read back from a session log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decoded {
    /// The message, its topic with the workspace prefix again,
    /// [`Message::stored`] 0 (the caller sets what it needs).
    pub message: Message,
    /// When the broker received it, Unix milliseconds.
    pub received_ms: u64,
}

/// Why a session log message could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("session log message: {0}")]
pub struct DecodeError(pub &'static str);

/// Read back a message [`encode`] made for `workspace` from its headers
/// (`header(name)`: the first value of that header) and payload; its
/// Message Expiry Interval counts from `received_at`, which the caller
/// computes from [`Decoded::received_ms`] (its clock).
///
/// # Errors
/// [`DecodeError`] naming what is missing or malformed.
pub fn decode<'a>(
    workspace: &str,
    header: impl Fn(&str) -> Option<&'a str>,
    payload: Bytes,
    received_at: std::time::Instant,
) -> Result<Decoded, DecodeError> {
    let topic = match header(TOPIC) {
        Some(t) => t.to_owned(),
        None => {
            let b64 = header(&format!("{TOPIC}{B64_SUFFIX}")).ok_or(DecodeError("no topic"))?;
            let raw = base64::engine::general_purpose::STANDARD.decode(b64).map_err(|_| DecodeError("topic not base64"))?;
            String::from_utf8(raw).map_err(|_| DecodeError("topic not UTF-8"))?
        }
    };
    let qos = match header(QOS) {
        Some("1") => QoS::AtLeastOnce,
        Some("2") => QoS::ExactlyOnce,
        _ => return Err(DecodeError("QoS not 1 or 2")),
    };
    let origin = header(ORIGIN).and_then(|o| o.parse().ok()).ok_or(DecodeError("no origin"))?;
    let received_ms = header(RECEIVED_MS).and_then(|o| o.parse().ok()).ok_or(DecodeError("no time received"))?;
    let (properties, payload) = decode_publish_properties(payload).map_err(|_| DecodeError("properties"))?;
    let namespace = workspace_namespace(workspace);
    Ok(Decoded {
        message: Message {
            topic: ByteString::from(format!("{namespace}{topic}")),
            payload,
            qos,
            retain: header(RETAIN) == Some("1"),
            properties,
            received_at,
            origin,
            stored: 0,
            from_mesh: false,
            groups: GroupPick::ALL,
        },
        received_ms,
    })
}

/// The key of `client_id`'s session in [`Interest`].
pub fn interest_key(client_id: &str) -> u64 {
    interest_key_of_record(&crate::cluster::records::client_key(client_id))
}

/// The key in [`Interest`] of the session whose record has the key
/// `record_key` in `mqtt-session-state`.
pub fn interest_key_of_record(record_key: &str) -> u64 {
    crate::session::client_key(record_key)
}

/// The filters of `subscriptions` a QoS 1/2 value goes to the session log
/// for: those of maximum QoS 1 or 2 (a QoS 0 subscription gets QoS 0,
/// live only), shared ones left out (as the session record does).
pub fn logged_filters<'a>(subscriptions: impl IntoIterator<Item = (&'a str, u8)>) -> Vec<ByteString> {
    subscriptions
        .into_iter()
        .filter(|(f, qos)| *qos > 0 && crate::topic::parse_shared(f).is_none())
        .map(|(f, _)| ByteString::from(f))
        .collect()
}

/// What the persistent sessions of the cluster want: the topic filters
/// (with their workspace prefix) of every persistent session's
/// subscriptions of QoS 1 or 2, per session. A QoS 1/2 value whose topic
/// one of them matches goes to its workspace's session log.
///
/// Kept by each replica from two sources: its own sessions, set at once
/// when their subscriptions change (before the SUBACK: a value published
/// here right after it is logged), and the records other replicas write
/// in `mqtt-session-state`, as the watch brings them (this replica's own
/// records are left out there: its local changes are newer). A delete
/// seen on the watch removes only an entry a record set.
#[derive(Default)]
pub struct Interest {
    sessions: HashMap<u64, Entry>,
    trie: SubscriptionTrie<u64, ()>,
}

/// One session's filters in [`Interest`].
struct Entry {
    filters: Arc<[ByteString]>,
    local: bool,
}

impl std::fmt::Debug for Interest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Interest").field("sessions", &self.sessions.len()).field("filters", &self.trie.len()).finish()
    }
}

impl Interest {
    /// Session `key` (any stable key per client identifier) wants
    /// `filters` now; `local`: this replica's own session, else a record
    /// seen on the watch (the caller leaves out this replica's own
    /// records: its local changes are newer).
    pub fn set(&mut self, key: u64, filters: Vec<ByteString>, local: bool) {
        self.remove_filters(key);
        for f in filters.iter() {
            self.trie.insert(f, key, ());
        }
        self.sessions.insert(key, Entry { filters: filters.into(), local });
    }

    /// Session `key` ended here (`local`), or its record was deleted (seen
    /// on the watch: removes only an entry another replica's record set,
    /// so that a delete seen late never removes a session that began here
    /// again since).
    pub fn remove(&mut self, key: u64, local: bool) {
        if !local && self.sessions.get(&key).is_some_and(|e| e.local) {
            return;
        }
        self.remove_filters(key);
        self.sessions.remove(&key);
    }

    fn remove_filters(&mut self, key: u64) {
        if let Some(old) = self.sessions.get(&key) {
            for f in old.filters.clone().iter() {
                self.trie.remove(f, &key);
            }
        }
    }

    /// Whether a persistent session wants a QoS 1/2 value on `topic` (with
    /// its workspace prefix).
    pub fn wants(&self, topic: &str) -> bool {
        let mut any = false;
        self.trie.for_each_match(topic, |_, _| any = true);
        any
    }

    /// Whether no session wants anything.
    pub fn is_empty(&self) -> bool {
        self.trie.is_empty()
    }

    /// Sessions with an entry.
    pub fn sessions(&self) -> usize {
        self.sessions.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::packet::{Properties, Props};
    use crate::cluster::ingest::header_safe;
    use proptest::prelude::*;
    use std::time::Instant;

    fn message(topic: &str, qos: QoS, retain: bool, properties: Props, payload: &[u8]) -> Message {
        Message {
            topic: ByteString::from(topic),
            payload: Bytes::copy_from_slice(payload),
            qos,
            retain,
            properties,
            received_at: Instant::now(),
            origin: 42,
            stored: 0,
            from_mesh: false,
            groups: GroupPick::ALL,
        }
    }

    fn read_back(ws: &str, e: &Encoded, at: Instant) -> Result<Decoded, DecodeError> {
        decode(ws, |name| e.headers.iter().find(|(n, _)| n == name).map(|(_, v)| &**v), e.payload.clone(), at)
    }

    #[test]
    fn names_are_per_workspace_tokens() {
        assert_eq!(stream(""), "LOG_mqtt-sessions-_");
        assert_eq!(stream("default"), "LOG_mqtt-sessions-_");
        assert_eq!(stream("acme"), "LOG_mqtt-sessions-acme");
        assert_eq!(subject("acme"), "mqtt-sessions.acme");
        assert_eq!(subject("a.b"), "mqtt-sessions.a%2Eb");
    }

    #[test]
    fn interest_follows_local_changes_and_records_and_a_late_delete_leaves_a_local_session() {
        let mut i = Interest::default();
        let f = |s: &str| vec![ByteString::from(s)];
        assert!(!i.wants("a/b"));
        i.set(1, f("a/#"), true);
        assert!(i.wants("a/b"));
        i.remove(1, false);
        assert!(i.wants("a/b"), "a delete seen on the watch leaves a local session");
        i.set(1, Vec::new(), true);
        assert!(!i.wants("a/b"));
        // Taken up elsewhere: the other replica's records decide.
        i.set(1, f("y/+"), false);
        assert!(i.wants("y/z") && !i.wants("a/b"));
        i.remove(1, false);
        assert!(i.is_empty() && i.sessions() == 0);
        i.set(2, f("#"), false);
        assert!(!i.wants("$SYS/x"), "[MQTT-4.7.2-1]");
        assert!(!i.wants("\u{0}ws/t"), "another workspace's topic");
        i.set(3, f("\u{0}ws/#"), false);
        assert!(i.wants("\u{0}ws/t"));
        i.remove(2, true);
        assert!(!i.wants("t"));
    }

    proptest! {
        /// Whatever the topic, workspace, properties and payload, a value
        /// reads back exactly as it was logged (topic with its prefix,
        /// QoS, RETAIN, origin, every property), and every header can
        /// travel as a NATS header.
        #[test]
        fn a_logged_value_reads_back_exactly(
            topic in "[^\u{0}#+]{1,30}",
            ws in prop_oneof![Just(String::new()), "[a-z.%]{1,8}"],
            qos2 in any::<bool>(),
            retain in any::<bool>(),
            // As a decoded PUBLISH can carry them: no U+0000 [MQTT-1.5.4-2].
            user in proptest::collection::vec(("[^\u{0}]{0,8}", "[^\u{0}]{0,8}"), 0..3),
            expiry in proptest::option::of(any::<u32>()),
            payload in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            let internal = format!("{}{topic}", workspace_namespace(&ws));
            let props = Props::from(Properties {
                user_properties: user.into_iter().map(|(k, v)| (k.into(), v.into())).collect(),
                message_expiry_interval: expiry,
                ..Properties::default()
            });
            let qos = if qos2 { QoS::ExactlyOnce } else { QoS::AtLeastOnce };
            let m = message(&internal, qos, retain, props, &payload);
            let e = encode(&ws, &m, 1_700_000_000_123).expect("encoded");
            prop_assert_eq!(&e.subject, &subject(&ws));
            for (name, value) in &e.headers {
                prop_assert!(name.bytes().all(|b| b.is_ascii_graphic() && b != b':'));
                prop_assert!(header_safe(value), "{:?}", value);
            }
            let at = Instant::now();
            let d = read_back(&ws, &e, at).expect("decoded");
            prop_assert_eq!(d.received_ms, 1_700_000_000_123);
            let mut want = m.clone();
            want.received_at = at;
            prop_assert_eq!(d.message, want);
        }
    }
}
