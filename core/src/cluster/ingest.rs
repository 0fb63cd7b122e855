//! The ingest stream of `store.kind = "jetstream"` (DESIGN.md §7): one
//! stream message per accepted QoS 1/2 PUBLISH, appended before its
//! PUBACK/PUBREC, for downstream consumers (historians, database writers)
//! reading it with a durable pull consumer. The contract with those
//! consumers is /work/coord/ingest-contract.md (README "The ingest
//! stream"); this module is its encoder: the subject and headers of a
//! value. Pure: the bridge publishes what it returns.

use std::borrow::Cow;

use base64::Engine as _;

use crate::packet::Props;

/// A stream message's headers, `(name, value)` in order (a name may come
/// more than once), `Nats-Msg-Id` excepted. What is known in advance (the
/// contract's header names, `1` and `2`) is borrowed, so that a value
/// costs no allocation for it on the publish path.
pub type Headers = Vec<(Cow<'static, str>, Cow<'static, str>)>;

/// The stream's name.
pub const STREAM: &str = "mqtt-ingest";

/// The stream's subjects: `mqtt-ingest.<workspace token>`.
pub const SUBJECTS: &str = "mqtt-ingest.>";

/// The workspace token of the default workspace (none, `""` or
/// `"default"`).
pub const DEFAULT_WORKSPACE_TOKEN: &str = "_";

/// Header: the idempotency key (see the bridge's `ingest.rs` for what it
/// is made of).
pub const MSG_ID: &str = "Nats-Msg-Id";
/// Header: the topic name, after topic-alias resolution, without the
/// broker's workspace prefix.
pub const TOPIC: &str = "Mqtt-Topic";
/// Header: `1` or `2`.
pub const QOS: &str = "Mqtt-Qos";
/// Header: the publishing client's identifier.
pub const CLIENT_ID: &str = "Mqtt-Client-Id";
/// Header: `1` when RETAIN was set (absent otherwise).
pub const RETAIN: &str = "Mqtt-Retain";
/// Header: the workspace (absent for the default one).
pub const WORKSPACE: &str = "Mqtt-Workspace";
/// Suffix of a header whose value is base64 (standard alphabet, padded)
/// because the text cannot travel as a NATS header value as it is (see
/// [`header_safe`]): `Mqtt-Topic-B64` in place of `Mqtt-Topic`.
pub const B64_SUFFIX: &str = "-B64";

/// One accepted value, as the ingest stream records it (borrowed from the
/// PUBLISH and its session while its headers are made).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IngestValue<'a> {
    /// The publisher's workspace (`""` or `"default"`: the default one).
    pub workspace: &'a str,
    /// The topic name as the client sees it (no workspace prefix).
    pub topic: &'a str,
    /// The publishing client's identifier.
    pub client_id: &'a str,
    /// 1 or 2.
    pub qos: u8,
    /// RETAIN was set.
    pub retain: bool,
    /// The MQTT 5 properties of the PUBLISH (empty for 3.1.1).
    pub properties: &'a Props,
}

/// Whether `workspace` names the default workspace.
fn is_default(workspace: &str) -> bool {
    workspace.is_empty() || workspace == "default"
}

/// The subject token of `workspace`: [`DEFAULT_WORKSPACE_TOKEN`] for the
/// default one; else the name with every byte outside `[A-Za-z0-9_-]`
/// written `%XX` (upper-case hex; a name `_` too), so that any name is
/// one valid NATS token (no `.`, `*`, `>`, white space) and distinct
/// names give distinct tokens.
pub fn workspace_token(workspace: &str) -> String {
    if is_default(workspace) {
        return DEFAULT_WORKSPACE_TOKEN.to_owned();
    }
    let mut out = String::with_capacity(workspace.len());
    for b in workspace.bytes() {
        if (b.is_ascii_alphanumeric() || b == b'-' || b == b'_') && workspace != DEFAULT_WORKSPACE_TOKEN {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The subject of the default workspace's values.
const DEFAULT_SUBJECT: &str = "mqtt-ingest._";

/// The subject a value of `workspace` is appended on:
/// `mqtt-ingest.<workspace token>` ([`workspace_token`]); borrowed for
/// the default workspace.
pub fn subject(workspace: &str) -> Cow<'static, str> {
    if is_default(workspace) {
        return Cow::Borrowed(DEFAULT_SUBJECT);
    }
    Cow::Owned(format!("{STREAM}.{}", workspace_token(workspace)))
}

/// Whether `value` can be a NATS header value as it is: no control
/// character (a CR or LF would end the header; nats-server reads the
/// headers as MIME ones) and no leading or trailing space or tab (which
/// readers trim).
pub fn header_safe(value: &str) -> bool {
    !value.chars().any(|c| c.is_control()) && value.trim_matches([' ', '\t']).len() == value.len()
}

/// A header name a user property may take: `Mqtt-User-<name>` with
/// `<name>` of ASCII letters, digits, `-`, `_` and `.` only, and not
/// `B64` in any case (that header is [`USER_B64`]'s: a property of that
/// name goes base64 too, so it cannot pass for an escaped one).
fn user_name_safe(name: &str) -> bool {
    !name.is_empty()
        && !name.eq_ignore_ascii_case("B64")
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// Push header `name` with `value`: as it is when [`header_safe`], else
/// base64 under `name` + [`B64_SUFFIX`].
pub fn push_text(out: &mut Headers, name: &'static str, value: &str) {
    if header_safe(value) {
        out.push((Cow::Borrowed(name), Cow::Owned(value.to_owned())));
    } else {
        let encoded = base64::engine::general_purpose::STANDARD.encode(value.as_bytes());
        out.push((Cow::Owned(format!("{name}{B64_SUFFIX}")), Cow::Owned(encoded)));
    }
}

/// The text of a QoS of a stored value (1 or 2).
pub fn qos_text(qos: u8) -> Cow<'static, str> {
    match qos {
        1 => Cow::Borrowed("1"),
        2 => Cow::Borrowed("2"),
        other => Cow::Owned(other.to_string()),
    }
}

/// The headers of `value`, `Nats-Msg-Id` excepted (the bridge adds it):
/// `Mqtt-Topic`, `Mqtt-Qos`, `Mqtt-Client-Id`, then `Mqtt-Retain` and
/// `Mqtt-Workspace` when they apply, then the MQTT 5 properties present
/// (`Mqtt-Content-Type`, `Mqtt-Response-Topic`, `Mqtt-Correlation-Data`
/// in base64, `Mqtt-Payload-Format` `1` for UTF-8, and
/// `Mqtt-User-<name>` per user property whose name is
/// `[A-Za-z0-9._-]+` and whose value is [`header_safe`], [`USER_B64`]
/// for any other, each in order: MQTT 5 §3.3.2.3.7 lets a name come more
/// than once). A text that is not [`header_safe`] goes base64 under the
/// name with [`B64_SUFFIX`]. Header names may repeat (user properties,
/// [`may_repeat`]): the bridge appends those, never replaces them.
pub fn headers(value: &IngestValue<'_>) -> Headers {
    let mut out = Vec::with_capacity(4);
    push_text(&mut out, TOPIC, value.topic);
    out.push((Cow::Borrowed(QOS), qos_text(value.qos)));
    push_text(&mut out, CLIENT_ID, value.client_id);
    if value.retain {
        out.push((Cow::Borrowed(RETAIN), Cow::Borrowed("1")));
    }
    if !is_default(value.workspace) {
        push_text(&mut out, WORKSPACE, value.workspace);
    }
    let p = value.properties;
    if let Some(content_type) = &p.content_type {
        push_text(&mut out, "Mqtt-Content-Type", content_type);
    }
    if let Some(response_topic) = &p.response_topic {
        push_text(&mut out, "Mqtt-Response-Topic", response_topic);
    }
    if let Some(data) = &p.correlation_data {
        out.push((Cow::Borrowed("Mqtt-Correlation-Data"), Cow::Owned(base64::engine::general_purpose::STANDARD.encode(data))));
    }
    if p.payload_format_indicator == Some(1) {
        out.push((Cow::Borrowed("Mqtt-Payload-Format"), Cow::Borrowed("1")));
    }
    for (name, v) in &p.user_properties {
        if user_name_safe(name) && header_safe(v) {
            out.push((Cow::Owned(format!("{USER_PREFIX}{name}")), Cow::Owned(v.to_string())));
        } else {
            let b64 = &base64::engine::general_purpose::STANDARD;
            let both = format!("{}:{}", b64.encode(name.as_bytes()), b64.encode(v.as_bytes()));
            out.push((Cow::Borrowed(USER_B64), Cow::Owned(both)));
        }
    }
    out
}

/// Whether a header `name` of [`headers`] may come more than once: a
/// user property's (`Mqtt-User-<name>`, [`USER_B64`]; MQTT 5
/// §3.3.2.3.7); the others come once at most, so the bridge may put them
/// rather than append them.
pub fn may_repeat(name: &str) -> bool {
    name.starts_with(USER_PREFIX)
}

/// The prefix of a user property's header.
const USER_PREFIX: &str = "Mqtt-User-";

/// The header of a user property whose name cannot be a header name's
/// end (`[A-Za-z0-9._-]+`) or whose value is not [`header_safe`]:
/// `<name in base64>:<value in base64>` (standard alphabet, so the `:` is
/// unambiguous), one header per such property, in order.
pub const USER_B64: &str = "Mqtt-User-B64";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::packet::Properties;
    use proptest::prelude::*;

    /// What a consumer does with a text header: the value as it is, or
    /// its `-B64` twin decoded.
    fn read(headers: &Headers, name: &str) -> Option<String> {
        if let Some((_, v)) = headers.iter().find(|(n, _)| n == name) {
            return Some(v.to_string());
        }
        let b64 = format!("{name}{B64_SUFFIX}");
        let (_, v) = headers.iter().find(|(n, _)| *n == b64)?;
        String::from_utf8(base64::engine::general_purpose::STANDARD.decode(v.as_bytes()).ok()?).ok()
    }

    static NO_PROPERTIES: std::sync::LazyLock<Props> = std::sync::LazyLock::new(Props::default);

    fn value<'a>(topic: &'a str, client_id: &'a str, workspace: &'a str) -> IngestValue<'a> {
        IngestValue { workspace, topic, client_id, qos: 1, retain: false, properties: &NO_PROPERTIES }
    }

    #[test]
    fn a_plain_value_has_the_contracts_first_headers_as_they_are() {
        let h = headers(&value("sensors/t1", "dev-1", ""));
        let names: Vec<_> = h.iter().map(|(n, v)| format!("{n}={v}")).collect();
        assert_eq!(names, ["Mqtt-Topic=sensors/t1", "Mqtt-Qos=1", "Mqtt-Client-Id=dev-1"]);
        assert_eq!(subject(""), "mqtt-ingest._");
        assert_eq!(subject("default"), format!("{STREAM}.{DEFAULT_WORKSPACE_TOKEN}"));
        assert_eq!(subject("default"), "mqtt-ingest._");
        assert_eq!(subject("acme"), "mqtt-ingest.acme");
        assert_eq!(subject("a.b *>"), "mqtt-ingest.a%2Eb%20%2A%3E");
        assert_eq!(subject("_"), "mqtt-ingest.%5F");
    }

    #[test]
    fn retain_workspace_and_mqtt5_properties_become_headers() {
        let mut v = value("a", "c", "acme");
        v.retain = true;
        v.qos = 2;
        let properties = Props::from(Properties {
            content_type: Some("application/json".into()),
            correlation_data: Some(bytes::Bytes::from_static(b"\x00\x01")),
            payload_format_indicator: Some(1),
            user_properties: vec![("site".into(), "north".into()), ("bad name".into(), "x".into())],
            ..Properties::default()
        });
        v.properties = &properties;
        let h = headers(&v);
        let repeatable: Vec<&str> = h.iter().filter(|(n, _)| may_repeat(n)).map(|(n, _)| &**n).collect();
        assert_eq!(repeatable, ["Mqtt-User-site", USER_B64], "only user properties may repeat");
        assert_eq!(read(&h, RETAIN).as_deref(), Some("1"));
        assert_eq!(read(&h, QOS).as_deref(), Some("2"));
        assert_eq!(read(&h, WORKSPACE).as_deref(), Some("acme"));
        assert_eq!(read(&h, "Mqtt-Content-Type").as_deref(), Some("application/json"));
        assert_eq!(read(&h, "Mqtt-Correlation-Data").as_deref(), Some("AAE="));
        assert_eq!(read(&h, "Mqtt-Payload-Format").as_deref(), Some("1"));
        assert_eq!(read(&h, "Mqtt-User-site").as_deref(), Some("north"));
        assert!(!h.iter().any(|(n, _)| n.contains("bad")), "a user property whose name cannot be a header is not a header of its name");
        let b64 = &base64::engine::general_purpose::STANDARD;
        assert_eq!(read(&h, USER_B64), Some(format!("{}:{}", b64.encode("bad name"), b64.encode("x"))), "it goes base64, name and value");
        assert!(!user_name_safe("b64") && !user_name_safe("B64"), "a property named B64 cannot pass for an escaped one");
    }

    proptest! {
        /// Whatever the topic, client identifier and workspace (any
        /// UTF-8: MQTT allows line breaks and spaces in them), every header
        /// can travel as a NATS header (name printable ASCII without `:`,
        /// value without control characters or edge blanks) and a
        /// consumer reads back exactly what the client sent; the subject
        /// is `mqtt-ingest.` and one valid token, distinct per workspace.
        #[test]
        fn every_value_travels_and_reads_back(topic in ".{1,40}", client_id in ".{0,30}", ws in ".{0,12}", ws2 in ".{0,12}") {
            let v = value(&topic, &client_id, &ws);
            let h = headers(&v);
            for (name, value) in &h {
                prop_assert!(name.bytes().all(|b| b.is_ascii_graphic() && b != b':'), "header name {name:?}");
                prop_assert!(header_safe(value), "header value {value:?}");
            }
            prop_assert_eq!(read(&h, TOPIC), Some(topic.clone()));
            prop_assert_eq!(read(&h, CLIENT_ID), Some(client_id.clone()));
            let expected_ws = (!is_default(&ws)).then(|| ws.clone());
            prop_assert_eq!(read(&h, WORKSPACE), expected_ws);
            let s = subject(&ws);
            let token = s.strip_prefix("mqtt-ingest.").unwrap();
            prop_assert!(!token.is_empty() && token.bytes().all(|b| b.is_ascii_graphic() && b != b'.' && b != b'*' && b != b'>'));
            if is_default(&ws) != is_default(&ws2) || (!is_default(&ws) && ws != ws2) {
                prop_assert_ne!(s, subject(&ws2));
            }
        }
    }
}
