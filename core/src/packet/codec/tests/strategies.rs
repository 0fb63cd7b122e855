//! proptest strategies for packets that are valid for a given version: in
//! 3.1.x, fields the version cannot carry stay at their defaults.
//!
//! The allowed-property lists here are written out from MQTT 5 §2.2.2.2
//! (table 2-4) independently of the codec's bit table.

use bytes::Bytes;
use bytestring::ByteString;
use proptest::collection::vec;
use proptest::option::of;
use proptest::prelude::*;

use crate::packet::{
    Auth, ConnAck, Connect, Disconnect, Packet, PacketId, Properties, ProtocolVersion, PubResponse,
    Publish, QoS, ReasonCode, RetainHandling, SubAck, Subscribe, SubscriptionOptions, UnsubAck,
    Unsubscribe, Will,
};

/// A short UTF-8 string, with multi-byte characters, never U+0000.
pub(super) fn string() -> impl Strategy<Value = ByteString> {
    "[a-z0-9/+#$ é€😀]{0,12}".prop_map(ByteString::from)
}

pub(super) fn binary() -> impl Strategy<Value = Bytes> {
    vec(any::<u8>(), 0..24).prop_map(Bytes::from)
}

pub(super) fn packet_id() -> impl Strategy<Value = PacketId> {
    (1..=u16::MAX).prop_map(|v| PacketId::new(v).expect("non-zero"))
}

pub(super) fn qos() -> impl Strategy<Value = QoS> {
    prop_oneof![
        Just(QoS::AtMostOnce),
        Just(QoS::AtLeastOnce),
        Just(QoS::ExactlyOnce)
    ]
}

fn flag() -> impl Strategy<Value = Option<u8>> {
    of(0..=1u8)
}

/// Every property set at random with a valid value; [`restrict`] then keeps
/// those the packet may carry.
fn any_properties() -> impl Strategy<Value = Properties> {
    let a = (
        flag(),
        of(any::<u32>()),
        of(string()),
        of(string()),
        of(binary()),
        vec(1..=268_435_455u32, 0..3),
        of(any::<u32>()),
        of(string()),
        of(any::<u16>()),
        of(string()),
        of(binary()),
        flag(),
    );
    let b = (
        of(any::<u32>()),
        flag(),
        of(string()),
        of(string()),
        of(string()),
        of(1..=u16::MAX),
        of(any::<u16>()),
        of(any::<u16>()),
        flag(),
        flag(),
        vec((string(), string()), 0..3),
        of(1..=u32::MAX),
    );
    let c = (flag(), flag(), flag());
    (a, b, c).prop_map(|(a, b, c)| Properties {
        payload_format_indicator: a.0,
        message_expiry_interval: a.1,
        content_type: a.2,
        response_topic: a.3,
        correlation_data: a.4,
        subscription_identifiers: a.5,
        session_expiry_interval: a.6,
        assigned_client_identifier: a.7,
        server_keep_alive: a.8,
        authentication_method: a.9,
        authentication_data: a.10,
        request_problem_information: a.11,
        will_delay_interval: b.0,
        request_response_information: b.1,
        response_information: b.2,
        server_reference: b.3,
        reason_string: b.4,
        receive_maximum: b.5,
        topic_alias_maximum: b.6,
        topic_alias: b.7,
        maximum_qos: b.8,
        retain_available: b.9,
        user_properties: b.10,
        maximum_packet_size: b.11,
        wildcard_subscription_available: c.0,
        subscription_identifier_available: c.1,
        shared_subscription_available: c.2,
    })
}

/// The packets (or the Will) a property list can belong to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum On {
    Connect,
    ConnAck,
    Publish,
    Will,
    PubResponse,
    Subscribe,
    SubAck,
    Unsubscribe,
    UnsubAck,
    Disconnect,
    Auth,
}

/// Keeps only the properties MQTT 5 §2.2.2.2 allows on `on`.
pub(super) fn restrict(p: Properties, on: On) -> Properties {
    let keep = |ons: &[On]| ons.contains(&on);
    use On::*;
    let message = [Publish, Will];
    let auth = [Connect, ConnAck, Auth];
    let reason = [ConnAck, PubResponse, SubAck, UnsubAck, Disconnect, Auth];
    let mut out = Properties {
        user_properties: p.user_properties,
        ..Properties::default()
    };
    macro_rules! copy {
        ($($field:ident: $ons:expr;)*) => {$(
            if keep(&$ons) {
                out.$field = p.$field;
            }
        )*};
    }
    copy! {
        payload_format_indicator: message;
        message_expiry_interval: message;
        content_type: message;
        response_topic: message;
        correlation_data: message;
        session_expiry_interval: [Connect, ConnAck, Disconnect];
        assigned_client_identifier: [ConnAck];
        server_keep_alive: [ConnAck];
        authentication_method: auth;
        authentication_data: auth;
        request_problem_information: [Connect];
        will_delay_interval: [Will];
        request_response_information: [Connect];
        response_information: [ConnAck];
        server_reference: [ConnAck, Disconnect];
        reason_string: reason;
        receive_maximum: [Connect, ConnAck];
        topic_alias_maximum: [Connect, ConnAck];
        topic_alias: [Publish];
        maximum_qos: [ConnAck];
        retain_available: [ConnAck];
        maximum_packet_size: [Connect, ConnAck];
        wildcard_subscription_available: [ConnAck];
        subscription_identifier_available: [ConnAck];
        shared_subscription_available: [ConnAck];
    }
    match on {
        Publish => out.subscription_identifiers = p.subscription_identifiers,
        Subscribe => {
            out.subscription_identifiers = p.subscription_identifiers.into_iter().take(1).collect()
        }
        _ => {}
    }
    // Authentication Data without a Method is a Protocol Error in CONNECT
    // (§3.1.2.11.10).
    if on == Connect && out.authentication_data.is_some() && out.authentication_method.is_none() {
        out.authentication_method = Some(ByteString::from_static("SCRAM-SHA-1"));
    }
    out
}

/// Properties valid on `on` in MQTT 5, empty in 3.1.x.
pub(super) fn properties(v: ProtocolVersion, on: On) -> BoxedStrategy<Properties> {
    if v.is_v5() {
        any_properties().prop_map(move |p| restrict(p, on)).boxed()
    } else {
        Just(Properties::default()).boxed()
    }
}

/// A reason code from `codes` in MQTT 5; `default` in 3.1.x.
fn reason(
    v: ProtocolVersion,
    codes: &'static [u8],
    default: ReasonCode,
) -> BoxedStrategy<ReasonCode> {
    if v.is_v5() {
        proptest::sample::select(codes).prop_map(ReasonCode).boxed()
    } else {
        Just(default).boxed()
    }
}

fn will(v: ProtocolVersion) -> impl Strategy<Value = Will> {
    (
        string(),
        binary(),
        qos(),
        any::<bool>(),
        properties(v, On::Will),
    )
        .prop_map(|(topic, payload, qos, retain, properties)| Will {
            topic,
            payload,
            qos,
            retain,
            properties: properties.into(),
        })
}

fn connect(v: ProtocolVersion) -> impl Strategy<Value = Packet> {
    let fields = (
        any::<bool>(),
        any::<u16>(),
        string(),
        of(will(v)),
        of(string()),
        of(binary()),
    );
    (fields, properties(v, On::Connect)).prop_map(
        move |((clean_start, keep_alive, client_id, will, username, password), properties)| {
            // 3.1.x: a password needs a user name [MQTT-3.1.2-22].
            let username = match (&username, &password) {
                (None, Some(_)) if !v.is_v5() => Some(ByteString::from_static("user")),
                _ => username,
            };
            Packet::Connect(Box::new(Connect {
                protocol: v,
                clean_start,
                keep_alive,
                client_id,
                will,
                username,
                password,
                properties: properties.into(),
            }))
        },
    )
}

fn connack(v: ProtocolVersion) -> impl Strategy<Value = Packet> {
    let codes: &'static [u8] = if v.is_v5() {
        &[
            0x00, 0x80, 0x81, 0x82, 0x83, 0x84, 0x85, 0x86, 0x87, 0x88, 0x89, 0x8A, 0x8C, 0x90,
            0x95, 0x97, 0x99, 0x9A, 0x9B, 0x9C, 0x9D, 0x9F,
        ]
    } else {
        // The reason codes that 3.1.1 return codes 0..=5 map back to.
        &[0x00, 0x84, 0x85, 0x88, 0x86, 0x87]
    };
    let reason = proptest::sample::select(codes).prop_map(ReasonCode);
    (any::<bool>(), reason, properties(v, On::ConnAck)).prop_map(
        |(session_present, reason, properties)| {
            Packet::ConnAck(ConnAck {
                session_present,
                reason,
                properties: properties.into(),
            })
        },
    )
}

fn publish(v: ProtocolVersion) -> impl Strategy<Value = Packet> {
    (
        qos(),
        any::<bool>(),
        any::<bool>(),
        string(),
        packet_id(),
        properties(v, On::Publish),
        binary(),
    )
        .prop_map(|(qos, dup, retain, topic, id, properties, payload)| {
            let qos0 = qos == QoS::AtMostOnce;
            Packet::Publish(Publish {
                dup: dup && !qos0,
                qos,
                retain,
                topic,
                packet_id: (!qos0).then_some(id),
                properties: properties.into(),
                payload,
            })
        })
}

fn response(v: ProtocolVersion, kind: u8) -> impl Strategy<Value = Packet> {
    let codes: &'static [u8] = if kind <= 5 {
        &[0x00, 0x10, 0x80, 0x83, 0x87, 0x90, 0x91, 0x97, 0x99]
    } else {
        &[0x00, 0x92]
    };
    (
        packet_id(),
        reason(v, codes, ReasonCode::SUCCESS),
        properties(v, On::PubResponse),
    )
        .prop_map(move |(packet_id, reason, properties)| {
            let r = PubResponse {
                packet_id,
                reason,
                properties: properties.into(),
            };
            match kind {
                4 => Packet::PubAck(r),
                5 => Packet::PubRec(r),
                6 => Packet::PubRel(r),
                _ => Packet::PubComp(r),
            }
        })
}

fn options(v: ProtocolVersion) -> BoxedStrategy<SubscriptionOptions> {
    let handling = prop_oneof![
        Just(RetainHandling::SendAtSubscribe),
        Just(RetainHandling::SendIfNew),
        Just(RetainHandling::DoNotSend)
    ];
    if v.is_v5() {
        (qos(), any::<bool>(), any::<bool>(), handling)
            .prop_map(
                |(qos, no_local, retain_as_published, retain_handling)| SubscriptionOptions {
                    qos,
                    no_local,
                    retain_as_published,
                    retain_handling,
                },
            )
            .boxed()
    } else {
        qos()
            .prop_map(|qos| SubscriptionOptions {
                qos,
                ..SubscriptionOptions::default()
            })
            .boxed()
    }
}

fn subscribe(v: ProtocolVersion) -> impl Strategy<Value = Packet> {
    (
        packet_id(),
        properties(v, On::Subscribe),
        vec((string(), options(v)), 1..4),
    )
        .prop_map(|(packet_id, properties, filters)| {
            Packet::Subscribe(Subscribe {
                packet_id,
                properties: properties.into(),
                filters,
            })
        })
}

fn suback(v: ProtocolVersion) -> impl Strategy<Value = Packet> {
    let codes: &'static [u8] = if v.is_v5() {
        &[
            0x00, 0x01, 0x02, 0x80, 0x83, 0x87, 0x8F, 0x91, 0x97, 0x9E, 0xA1, 0xA2,
        ]
    } else {
        &[0x00, 0x01, 0x02, 0x80]
    };
    let reasons = vec(proptest::sample::select(codes).prop_map(ReasonCode), 1..4);
    (packet_id(), properties(v, On::SubAck), reasons).prop_map(
        |(packet_id, properties, reasons)| {
            Packet::SubAck(SubAck {
                packet_id,
                properties: properties.into(),
                reasons,
            })
        },
    )
}

fn unsubscribe(v: ProtocolVersion) -> impl Strategy<Value = Packet> {
    (
        packet_id(),
        properties(v, On::Unsubscribe),
        vec(string(), 1..4),
    )
        .prop_map(|(packet_id, properties, filters)| {
            Packet::Unsubscribe(Unsubscribe {
                packet_id,
                properties: properties.into(),
                filters,
            })
        })
}

fn unsuback(v: ProtocolVersion) -> impl Strategy<Value = Packet> {
    let reasons = if v.is_v5() {
        vec(
            proptest::sample::select(&[0x00u8, 0x11, 0x80, 0x83, 0x87, 0x8F, 0x91][..])
                .prop_map(ReasonCode),
            1..4,
        )
        .boxed()
    } else {
        Just(Vec::new()).boxed()
    };
    (packet_id(), properties(v, On::UnsubAck), reasons).prop_map(
        |(packet_id, properties, reasons)| {
            Packet::UnsubAck(UnsubAck {
                packet_id,
                properties: properties.into(),
                reasons,
            })
        },
    )
}

fn disconnect(v: ProtocolVersion) -> impl Strategy<Value = Packet> {
    let codes: &'static [u8] = &[
        0x00, 0x04, 0x80, 0x81, 0x82, 0x83, 0x87, 0x89, 0x8B, 0x8D, 0x8E, 0x8F, 0x90, 0x93, 0x94,
        0x95, 0x96, 0x97, 0x98, 0x99, 0x9A, 0x9B, 0x9C, 0x9D, 0x9E, 0x9F, 0xA0, 0xA1, 0xA2,
    ];
    (
        reason(v, codes, ReasonCode::NORMAL_DISCONNECTION),
        properties(v, On::Disconnect),
    )
        .prop_map(|(reason, properties)| Packet::Disconnect(Disconnect { reason, properties: properties.into() }))
}

fn auth() -> impl Strategy<Value = Packet> {
    (
        reason(
            ProtocolVersion::V5,
            &[0x00, 0x18, 0x19],
            ReasonCode::SUCCESS,
        ),
        properties(ProtocolVersion::V5, On::Auth),
    )
        .prop_map(|(reason, properties)| Packet::Auth(Auth { reason, properties: properties.into() }))
}

/// Any packet valid in `v`: every packet type, every property it may carry.
pub(super) fn packet(v: ProtocolVersion) -> BoxedStrategy<Packet> {
    let mut arms = vec![
        connect(v).boxed(),
        connack(v).boxed(),
        publish(v).boxed(),
        response(v, 4).boxed(),
        response(v, 5).boxed(),
        response(v, 6).boxed(),
        response(v, 7).boxed(),
        subscribe(v).boxed(),
        suback(v).boxed(),
        unsubscribe(v).boxed(),
        unsuback(v).boxed(),
        Just(Packet::PingReq).boxed(),
        Just(Packet::PingResp).boxed(),
        disconnect(v).boxed(),
    ];
    if v.is_v5() {
        arms.push(auth().boxed());
    }
    proptest::strategy::Union::new(arms).boxed()
}
