//! Session scenarios driven with a fake clock (a fixed `Instant` plus
//! offsets): no test sleeps.

use std::num::NonZeroU16;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use bytestring::ByteString;

use super::*;
use crate::packet::{Connect, Properties, Will};

fn pid(n: u16) -> PacketId {
    NonZeroU16::new(n).unwrap()
}

fn connect(protocol: ProtocolVersion, client_id: &str, clean: bool) -> Connect {
    Connect {
        protocol,
        clean_start: clean,
        keep_alive: 60,
        client_id: ByteString::from(client_id),
        will: None,
        username: None,
        password: None,
        properties: Properties::default().into(),
    }
}

fn session_with(protocol: ProtocolVersion, receive_maximum: u16, limits: SessionLimits) -> Session {
    let mut c = connect(protocol, "c1", false);
    c.properties.receive_maximum = Some(receive_maximum);
    let n = negotiate(&c, &ConnectLimits::default(), || unreachable!()).unwrap();
    Session::new(protocol, &n, Arc::new(limits))
}

fn message(topic: &str, qos: QoS, t: Instant) -> Arc<Message> {
    Arc::new(Message {
        topic: ByteString::from(topic),
        payload: Bytes::from_static(b"x"),
        qos,
        retain: false,
        properties: Properties::default().into(),
        received_at: t,
        origin: 7,
        stored: 0,
        from_mesh: false,
        groups: GroupPick::ALL,
    })
}

fn delivery(m: &Arc<Message>, qos: QoS) -> Delivery {
    Delivery { message: m.clone(), qos, retain: false, subscription_ids: vec![], group: None }
}

fn delivered_ids(out: &[Output]) -> Vec<(Option<u16>, bool)> {
    out.iter()
        .filter_map(|o| match o {
            Output::Deliver { packet_id, dup, .. } => Some((packet_id.map(|p| p.get()), *dup)),
            _ => None,
        })
        .collect()
}

fn publish(topic: &str, qos: QoS, packet_id: Option<u16>) -> Packet {
    Packet::Publish(Publish {
        dup: false,
        qos,
        retain: false,
        topic: ByteString::from(topic),
        packet_id: packet_id.map(pid),
        properties: Properties::default().into(),
        payload: Bytes::from_static(b"hello"),
    })
}

#[test]
fn qos1_deliveries_stop_at_the_clients_receive_maximum_and_resume_on_puback() {
    let t0 = Instant::now();
    let mut s = session_with(ProtocolVersion::V5, 2, SessionLimits::default());
    let m = message("a", QoS::AtLeastOnce, t0);
    let mut out = vec![];
    for _ in 0..3 {
        s.deliver(delivery(&m, QoS::AtLeastOnce), t0, &mut out);
    }
    // [MQTT-4.9.0-2]: no more than Receive Maximum unacknowledged PUBLISHes.
    assert_eq!(delivered_ids(&out), vec![(Some(1), false), (Some(2), false)]);
    assert_eq!(s.queued(), 1);
    out.clear();
    s.handle(Packet::PubAck(PubResponse::success(pid(1))), t0, &mut out);
    assert_eq!(delivered_ids(&out), vec![(Some(3), false)]);
    assert_eq!(s.inflight(), 2);
}

#[test]
fn offline_session_queues_qos1_drops_qos0_and_drops_oldest_when_full() {
    let t0 = Instant::now();
    let limits = SessionLimits { max_queue: 2, ..SessionLimits::default() };
    let mut s = session_with(ProtocolVersion::V3_1_1, 10, limits);
    s.go_offline();
    let mut out = vec![];
    let msgs: Vec<_> = (0..3).map(|i| message(&format!("t/{i}"), QoS::AtLeastOnce, t0)).collect();
    s.deliver(delivery(&message("q0", QoS::AtMostOnce, t0), QoS::AtMostOnce), t0, &mut out);
    for m in &msgs {
        s.deliver(delivery(m, QoS::AtLeastOnce), t0, &mut out);
    }
    assert!(out.is_empty());
    assert_eq!(s.queued(), 2);
    assert_eq!(s.take_drops().queue_full, 1);
    let n = negotiate(&connect(ProtocolVersion::V3_1_1, "c1", false), &ConnectLimits::default(), || unreachable!()).unwrap();
    s.resume(ProtocolVersion::V3_1_1, &n, t0, &mut out);
    let topics: Vec<_> = out
        .iter()
        .filter_map(|o| match o {
            Output::Deliver { delivery, .. } => Some(delivery.message.topic.to_string()),
            _ => None,
        })
        .collect();
    assert_eq!(topics, vec!["t/1", "t/2"], "oldest dropped, order kept");
}

#[test]
fn resume_resends_unacknowledged_publishes_with_dup_then_pubrels_in_order() {
    // [MQTT-4.4.0-1]: resend unacknowledged PUBLISH (DUP=1) and PUBREL in
    // their original order.
    let t0 = Instant::now();
    let mut s = session_with(ProtocolVersion::V5, 10, SessionLimits::default());
    let m1 = message("a", QoS::ExactlyOnce, t0);
    let m2 = message("b", QoS::AtLeastOnce, t0);
    let mut out = vec![];
    s.deliver(delivery(&m1, QoS::ExactlyOnce), t0, &mut out);
    s.deliver(delivery(&m2, QoS::AtLeastOnce), t0, &mut out);
    s.handle(Packet::PubRec(PubResponse::success(pid(1))), t0, &mut out);
    assert_eq!(out.last(), Some(&Output::Send(Packet::PubRel(PubResponse::success(pid(1))))));
    s.go_offline();
    out.clear();
    let mut c = connect(ProtocolVersion::V5, "c1", false);
    c.properties.session_expiry_interval = Some(100);
    let n = negotiate(&c, &ConnectLimits::default(), || unreachable!()).unwrap();
    s.resume(ProtocolVersion::V5, &n, t0, &mut out);
    assert_eq!(out[0], Output::Send(Packet::PubRel(PubResponse::success(pid(1)))));
    assert_eq!(delivered_ids(&out), vec![(Some(2), true)]);
    out.clear();
    s.handle(Packet::PubComp(PubResponse::success(pid(1))), t0, &mut out);
    s.handle(Packet::PubAck(PubResponse::success(pid(2))), t0, &mut out);
    assert_eq!(s.inflight(), 0);
}

#[test]
fn inbound_qos2_is_forwarded_once_even_when_the_publish_is_resent() {
    // [MQTT-4.3.3-10]: a resent PUBLISH with the same packet id before
    // PUBREL is not delivered again.
    let t0 = Instant::now();
    let mut s = session_with(ProtocolVersion::V3_1_1, 10, SessionLimits::default());
    let mut out = vec![];
    s.handle(publish("a/b", QoS::ExactlyOnce, Some(9)), t0, &mut out);
    s.handle(publish("a/b", QoS::ExactlyOnce, Some(9)), t0, &mut out);
    let forwarded = out.iter().filter(|o| matches!(o, Output::Publish(_))).count();
    let pubrecs = out.iter().filter(|o| matches!(o, Output::Acknowledge(Packet::PubRec(_)))).count();
    assert_eq!((forwarded, pubrecs), (1, 2));
    out.clear();
    s.handle(Packet::PubRel(PubResponse::success(pid(9))), t0, &mut out);
    assert_eq!(out, vec![Output::Acknowledge(Packet::PubComp(PubResponse::success(pid(9))))]);
    // After PUBCOMP the packet id is free: a new message with it is new.
    out.clear();
    s.handle(publish("a/b", QoS::ExactlyOnce, Some(9)), t0, &mut out);
    assert!(out.iter().any(|o| matches!(o, Output::Publish(_))));
}

#[test]
fn a_qos2_identifier_whose_pubrec_was_refused_is_free_and_its_reuse_is_a_new_message() {
    // MQTT 5 §4.3.3: the identifier is available for reuse once the sender
    // has received a PUBREC with a reason code of 0x80 or greater; the
    // refusal came after the session opened it (the store failed later).
    let t0 = Instant::now();
    for logged in [false, true] {
        let mut s = session_with(ProtocolVersion::V5, 10, SessionLimits::default());
        s.set_logged(logged);
        let mut out = vec![];
        s.handle(publish("a/b", QoS::ExactlyOnce, Some(9)), t0, &mut out);
        out.clear();
        assert!(s.forget_inbound_qos2(9, &mut out));
        let released = vec![Output::Log(SessionChange::InboundQos2 { packet_id: 9, open: false })];
        assert_eq!(out, if logged { released } else { vec![] }, "logged: {logged}");
        // Forgetting twice (or an identifier never opened) changes nothing.
        out.clear();
        assert!(!s.forget_inbound_qos2(9, &mut out) && !s.forget_inbound_qos2(10, &mut out));
        assert!(out.is_empty());
        s.handle(publish("a/b", QoS::ExactlyOnce, Some(9)), t0, &mut out);
        let forwarded = out.iter().filter(|o| matches!(o, Output::Publish(_))).count();
        assert_eq!(forwarded, 1, "the reused identifier carries a new message");
    }
}

#[test]
fn a_publish_the_store_refuses_is_not_forwarded_and_keeps_no_qos2_packet_id() {
    // DESIGN.md §7: refused, never acknowledged and then lost. MQTT 5: the
    // flow ends at an error PUBREC, so the identifier is free again.
    let t0 = Instant::now();
    for protocol in [ProtocolVersion::V5, ProtocolVersion::V3_1_1] {
        let mut s = session_with(protocol, 10, SessionLimits::default());
        s.set_logged(true);
        s.set_store_refusing(true);
        let mut out = vec![];
        s.handle(publish("a/b", QoS::ExactlyOnce, Some(9)), t0, &mut out);
        s.handle(publish("a/b", QoS::AtLeastOnce, Some(10)), t0, &mut out);
        let expected = if protocol.is_v5() { ReasonCode::QUOTA_EXCEEDED } else { ReasonCode::SUCCESS };
        let mut rec = PubResponse::success(pid(9));
        rec.reason = expected;
        let mut ack = PubResponse::success(pid(10));
        ack.reason = expected;
        assert_eq!(out, vec![Output::Acknowledge(Packet::PubRec(rec)), Output::Acknowledge(Packet::PubAck(ack))], "{protocol:?}");
        // Once the store takes values again, the same identifier is a new
        // message (or, 3.1.1, the one sent again after the close).
        s.set_store_refusing(false);
        out.clear();
        s.handle(publish("a/b", QoS::ExactlyOnce, Some(9)), t0, &mut out);
        assert!(out.iter().any(|o| matches!(o, Output::Publish(_))), "{protocol:?}: {out:?}");
    }
}

#[test]
fn client_exceeding_our_receive_maximum_gets_disconnect_0x93() {
    // [MQTT-3.3.4-9]
    let t0 = Instant::now();
    let limits = SessionLimits { receive_maximum: 2, ..SessionLimits::default() };
    let mut s = session_with(ProtocolVersion::V5, 10, limits);
    let mut out = vec![];
    for id in 1..=3 {
        s.handle(publish("a", QoS::ExactlyOnce, Some(id)), t0, &mut out);
    }
    assert_eq!(
        out.last(),
        Some(&Output::Close { reason: Some(ReasonCode::RECEIVE_MAXIMUM_EXCEEDED), publish_will: true })
    );
}

#[test]
fn a_3_1_1_client_is_held_to_no_receive_maximum_and_may_open_every_packet_identifier() {
    // MQTT 3.1/3.1.1 has no Receive Maximum: the CONNACK announces none,
    // so a client that sends its whole backlog at once (paho-mqtt after a
    // reconnect) is not closed for it; each value is forwarded once and
    // PUBREC'd [MQTT-4.3.3-8]; a resend of an open one is not forwarded
    // again [MQTT-4.3.3-10].
    let t0 = Instant::now();
    for protocol in [ProtocolVersion::V3_1_1, ProtocolVersion::V3_1] {
        let limits = SessionLimits { receive_maximum: 2, ..SessionLimits::default() };
        let mut s = session_with(protocol, 10, limits);
        let mut out = vec![];
        for id in 1..=u16::MAX {
            s.handle(publish("a", QoS::ExactlyOnce, Some(id)), t0, &mut out);
        }
        s.handle(publish("a", QoS::ExactlyOnce, Some(7)), t0, &mut out);
        let forwarded = out.iter().filter(|o| matches!(o, Output::Publish(_))).count();
        let pubrecs = out.iter().filter(|o| matches!(o, Output::Acknowledge(Packet::PubRec(_)))).count();
        assert_eq!((forwarded, pubrecs), (65_535, 65_536), "{protocol:?}");
        assert!(!out.iter().any(|o| matches!(o, Output::Close { .. })), "{protocol:?}");
    }
}

#[test]
fn qos1_publish_is_forwarded_then_acknowledged() {
    let t0 = Instant::now();
    let mut s = session_with(ProtocolVersion::V5, 10, SessionLimits::default());
    let mut out = vec![];
    s.handle(publish("x/y", QoS::AtLeastOnce, Some(5)), t0, &mut out);
    assert!(matches!(&out[0], Output::Publish(m) if m.topic == "x/y" && m.received_at == t0));
    assert_eq!(out[1], Output::Acknowledge(Packet::PubAck(PubResponse::success(pid(5)))));
}

#[test]
fn publish_to_a_wildcard_topic_closes_the_connection() {
    // [MQTT-3.3.2-2]: the Topic Name must not contain wildcards.
    let t0 = Instant::now();
    for (protocol, reason) in
        [(ProtocolVersion::V5, Some(ReasonCode::TOPIC_NAME_INVALID)), (ProtocolVersion::V3_1_1, None)]
    {
        let mut s = session_with(protocol, 10, SessionLimits::default());
        let mut out = vec![];
        s.handle(publish("a/+", QoS::AtMostOnce, None), t0, &mut out);
        assert_eq!(out, vec![Output::Close { reason, publish_will: true }]);
    }
}

#[test]
fn second_connect_is_a_protocol_error() {
    // [MQTT-3.1.0-2]
    let t0 = Instant::now();
    let mut s = session_with(ProtocolVersion::V5, 10, SessionLimits::default());
    let mut out = vec![];
    s.handle(Packet::Connect(Box::new(connect(ProtocolVersion::V5, "c1", true))), t0, &mut out);
    assert_eq!(out, vec![Output::Close { reason: Some(ReasonCode::PROTOCOL_ERROR), publish_will: true }]);
}

#[test]
fn normal_disconnect_discards_the_will_and_0x04_publishes_it() {
    // [MQTT-3.14.4-3]; MQTT 5 §3.14.2.1 reason 0x04.
    let t0 = Instant::now();
    let mut s = session_with(ProtocolVersion::V5, 10, SessionLimits::default());
    let mut out = vec![];
    s.handle(Packet::Disconnect(Disconnect::default()), t0, &mut out);
    assert_eq!(out, vec![Output::Close { reason: None, publish_will: false }]);
    out.clear();
    let d = Disconnect { reason: ReasonCode::DISCONNECT_WITH_WILL, properties: Properties::default().into() };
    s.handle(Packet::Disconnect(d), t0, &mut out);
    assert_eq!(out, vec![Output::Close { reason: None, publish_will: true }]);
}

#[test]
fn session_expiry_cannot_go_from_zero_to_non_zero_at_disconnect() {
    // [MQTT-3.14.2-2]
    let t0 = Instant::now();
    let mut s = session_with(ProtocolVersion::V5, 10, SessionLimits::default());
    assert_eq!(s.session_expiry(), 0);
    let props = Properties { session_expiry_interval: Some(30), ..Properties::default() };
    let mut out = vec![];
    s.handle(Packet::Disconnect(Disconnect { reason: ReasonCode::SUCCESS, properties: props.into() }), t0, &mut out);
    assert_eq!(out, vec![Output::Close { reason: Some(ReasonCode::PROTOCOL_ERROR), publish_will: true }]);
}

#[test]
fn subscribe_grants_requested_qos_and_rejects_invalid_filters() {
    let t0 = Instant::now();
    let mut s = session_with(ProtocolVersion::V5, 10, SessionLimits::default());
    let opts = |q| SubscriptionOptions { qos: q, ..SubscriptionOptions::default() };
    let sub = Subscribe {
        packet_id: pid(3),
        properties: Properties::default().into(),
        filters: vec![
            (ByteString::from("a/#"), opts(QoS::ExactlyOnce)),
            (ByteString::from("a/#/b"), opts(QoS::AtMostOnce)),
            (ByteString::from("$share/g/a"), opts(QoS::AtMostOnce)),
        ],
    };
    let mut out = vec![];
    s.handle(Packet::Subscribe(sub), t0, &mut out);
    let Output::Acknowledge(Packet::SubAck(ack)) = &out[0] else { panic!("SUBACK first: {out:?}") };
    assert_eq!(ack.reasons, vec![ReasonCode::GRANTED_QOS_2, ReasonCode::TOPIC_FILTER_INVALID, ReasonCode::GRANTED_QOS_0]);
    assert!(matches!(&out[1], Output::Subscribed { filter, existed: false, .. } if filter == "a/#"));
    assert!(matches!(&out[2], Output::Subscribed { filter, .. } if filter == "$share/g/a"));
    assert_eq!(out.len(), 3);
}

#[test]
fn subscriptions_beyond_the_limit_get_quota_exceeded() {
    let t0 = Instant::now();
    let limits = SessionLimits { max_subscriptions: 1, ..SessionLimits::default() };
    let mut s = session_with(ProtocolVersion::V5, 10, limits);
    let mut out = vec![];
    let filters = vec![("a".into(), SubscriptionOptions::default()), ("b".into(), SubscriptionOptions::default())];
    s.handle(Packet::Subscribe(Subscribe { packet_id: pid(1), properties: Properties::default().into(), filters }), t0, &mut out);
    let Output::Acknowledge(Packet::SubAck(ack)) = &out[0] else { panic!() };
    assert_eq!(ack.reasons, vec![ReasonCode::GRANTED_QOS_0, ReasonCode::QUOTA_EXCEEDED]);
}

/// A `protocol` session subscribed to `a`, then sent UNSUBSCRIBE for
/// `filters`: the session and what it output.
fn unsubscribed(protocol: ProtocolVersion, filters: &[&str]) -> (Session, Vec<Output>) {
    let t0 = Instant::now();
    let mut s = session_with(protocol, 10, SessionLimits::default());
    let mut out = vec![];
    let subscribe = vec![("a".into(), SubscriptionOptions::default())];
    s.handle(Packet::Subscribe(Subscribe { packet_id: pid(1), properties: Properties::default().into(), filters: subscribe }), t0, &mut out);
    out.clear();
    let filters = filters.iter().map(|&f| f.into()).collect();
    s.handle(Packet::Unsubscribe(Unsubscribe { packet_id: pid(2), properties: Properties::default().into(), filters }), t0, &mut out);
    (s, out)
}

/// An UNSUBSCRIBE filter the spec forbids (`#` not last, `[MQTT-4.7.1-2]`):
/// v5 answers 0x8F for it and handles the others; 3.1.1 closes the
/// connection (a protocol violation, 3.1.1 §4.8) without an UNSUBACK.
#[test]
fn unsubscribe_of_an_invalid_filter_is_0x8f_in_v5_and_closes_in_3_1_1() {
    let (_, out) = unsubscribed(ProtocolVersion::V5, &["a/#/b", "a"]);
    assert_eq!(out[0], Output::Unsubscribed { filter: "a".into() });
    let Output::Acknowledge(Packet::UnsubAck(ack)) = &out[1] else { panic!("{out:?}") };
    assert_eq!(ack.reasons, vec![ReasonCode::TOPIC_FILTER_INVALID, ReasonCode::SUCCESS]);

    let (s, out) = unsubscribed(ProtocolVersion::V3_1_1, &["a", "a/#/b"]);
    assert_eq!(out, vec![Output::Close { reason: None, publish_will: true }]);
    // Nothing was unsubscribed: the session and the shard's routes agree.
    assert!(s.subscriptions().contains_key("a"));
}

#[test]
fn unsubscribe_reports_which_subscriptions_existed() {
    let (_, out) = unsubscribed(ProtocolVersion::V5, &["a", "b"]);
    assert_eq!(out[0], Output::Unsubscribed { filter: "a".into() });
    let Output::Acknowledge(Packet::UnsubAck(ack)) = &out[1] else { panic!() };
    assert_eq!(ack.reasons, vec![ReasonCode::SUCCESS, ReasonCode::NO_SUBSCRIPTION_EXISTED]);
}

#[test]
fn expired_messages_are_never_sent() {
    let t0 = Instant::now();
    let mut s = session_with(ProtocolVersion::V5, 10, SessionLimits::default());
    s.go_offline();
    let mut m = (*message("a", QoS::AtLeastOnce, t0)).clone();
    m.properties.message_expiry_interval = Some(5);
    let m = Arc::new(m);
    let mut out = vec![];
    s.deliver(delivery(&m, QoS::AtLeastOnce), t0, &mut out);
    let n = negotiate(&connect(ProtocolVersion::V5, "c1", false), &ConnectLimits::default(), || unreachable!()).unwrap();
    s.resume(ProtocolVersion::V5, &n, t0 + Duration::from_secs(6), &mut out);
    assert!(out.is_empty());
    assert_eq!(s.take_drops().expired, 1);
    assert_eq!(m.expiry_left(t0 + Duration::from_secs(2)), Some(3));
}

#[test]
fn empty_client_id_with_persistent_session_is_refused_on_3_1_1() {
    // [MQTT-3.1.3-8]: return code 2 (identifier rejected).
    let r = negotiate(&connect(ProtocolVersion::V3_1_1, "", false), &ConnectLimits::default(), || "x".into());
    assert_eq!(r.unwrap_err().reason.to_v3_connack(), 2);
    let ok = negotiate(&connect(ProtocolVersion::V3_1_1, "", true), &ConnectLimits::default(), || "gen".into()).unwrap();
    assert_eq!(ok.client_id, "gen");
}

#[test]
fn empty_client_id_on_mqtt5_gets_an_assigned_client_identifier() {
    // [MQTT-3.2.2-16]
    let n = negotiate(&connect(ProtocolVersion::V5, "", true), &ConnectLimits::default(), || "auto-1".into()).unwrap();
    assert_eq!(n.connack.properties.assigned_client_identifier.as_deref(), Some("auto-1"));
}

#[test]
fn keep_alive_above_the_maximum_becomes_server_keep_alive_on_mqtt5_and_is_refused_on_3_1_1() {
    let limits = ConnectLimits { max_keep_alive: 100, ..ConnectLimits::default() };
    let mut c = connect(ProtocolVersion::V5, "c", true);
    c.keep_alive = 500;
    let n = negotiate(&c, &limits, || unreachable!()).unwrap();
    // [MQTT-3.2.2-21]: the client must use the Server Keep Alive.
    assert_eq!((n.keep_alive, n.connack.properties.server_keep_alive), (100, Some(100)));
    c.protocol = ProtocolVersion::V3_1_1;
    assert!(negotiate(&c, &limits, || unreachable!()).is_err());
}

#[test]
fn session_expiry_is_clamped_to_the_maximum_and_announced() {
    let limits = ConnectLimits { max_session_expiry: 60, ..ConnectLimits::default() };
    let mut c = connect(ProtocolVersion::V5, "c", false);
    c.properties.session_expiry_interval = Some(u32::MAX);
    let n = negotiate(&c, &limits, || unreachable!()).unwrap();
    assert_eq!((n.session_expiry, n.connack.properties.session_expiry_interval), (60, Some(60)));
    // 3.1.1 clean session 0 lasts the maximum; clean session 1 ends at once.
    let n = negotiate(&connect(ProtocolVersion::V3_1_1, "c", false), &limits, || unreachable!()).unwrap();
    assert_eq!(n.session_expiry, 60);
    let n = negotiate(&connect(ProtocolVersion::V3_1_1, "c", true), &limits, || unreachable!()).unwrap();
    assert_eq!(n.session_expiry, 0);
}

#[test]
fn invalid_will_topic_is_refused() {
    let mut c = connect(ProtocolVersion::V5, "c", true);
    c.will = Some(Will {
        topic: "a/#".into(),
        payload: Bytes::new(),
        qos: QoS::AtMostOnce,
        retain: false,
        properties: Properties::default().into(),
    });
    assert_eq!(negotiate(&c, &ConnectLimits::default(), || unreachable!()).unwrap_err().reason, ReasonCode::TOPIC_NAME_INVALID);
}

/// A Will Payload that is not UTF-8 while its Payload Format Indicator
/// says it is: CONNACK 0x99 (MQTT 5 §3.1.3.2.3, "MAY validate"), as for
/// PUBLISH; with indicator 0 or none, any bytes go.
#[test]
fn a_will_payload_not_utf8_though_marked_so_is_refused_with_0x99() {
    let will = |protocol, indicator: Option<u8>| {
        let mut c = connect(protocol, "c", true);
        let properties = Properties { payload_format_indicator: indicator, ..Properties::default() };
        c.will = Some(Will {
            topic: "a".into(),
            payload: Bytes::from_static(b"\xff\xfe"),
            qos: QoS::AtMostOnce,
            retain: false,
            properties: properties.into(),
        });
        negotiate(&c, &ConnectLimits::default(), || unreachable!()).map(|_| ()).map_err(|r| r.reason)
    };
    assert_eq!(will(ProtocolVersion::V5, Some(1)), Err(ReasonCode::PAYLOAD_FORMAT_INVALID));
    assert_eq!(will(ProtocolVersion::V5, Some(0)), Ok(()));
    assert_eq!(will(ProtocolVersion::V5, None), Ok(()));
}

#[test]
fn authentication_method_is_refused_with_0x8c() {
    let mut c = connect(ProtocolVersion::V5, "c", true);
    c.properties.authentication_method = Some("SCRAM-SHA-1".into());
    let r = negotiate(&c, &ConnectLimits::default(), || unreachable!()).unwrap_err();
    assert_eq!(r.reason, ReasonCode::BAD_AUTHENTICATION_METHOD);
}

fn publish_with_alias(topic: &str, alias: u16) -> Packet {
    let Packet::Publish(mut p) = publish(topic, QoS::AtMostOnce, None) else { unreachable!() };
    p.properties.topic_alias = Some(alias);
    Packet::Publish(p)
}

#[test]
fn inbound_topic_alias_is_set_by_a_publish_with_topic_and_used_by_one_without() {
    // MQTT 5 §3.3.2.3.4
    let t0 = Instant::now();
    let mut s = session_with(ProtocolVersion::V5, 10, SessionLimits::default());
    let mut out = vec![];
    s.handle(publish_with_alias("a/b", 3), t0, &mut out);
    s.handle(publish_with_alias("", 3), t0, &mut out);
    let topics: Vec<_> = out
        .iter()
        .map(|o| match o {
            Output::Publish(m) => {
                assert_eq!(m.properties.topic_alias, None, "aliases are not forwarded");
                m.topic.to_string()
            }
            other => panic!("unexpected {other:?}"),
        })
        .collect();
    assert_eq!(topics, vec!["a/b", "a/b"]);
}

#[test]
fn topic_alias_zero_or_above_our_maximum_gets_disconnect_0x94() {
    // [MQTT-3.3.2-8], [MQTT-3.3.2-9]
    let t0 = Instant::now();
    let limits = SessionLimits { topic_alias_maximum: 4, ..SessionLimits::default() };
    for alias in [0, 5] {
        let mut s = session_with(ProtocolVersion::V5, 10, limits.clone());
        let mut out = vec![];
        s.handle(publish_with_alias("a", alias), t0, &mut out);
        assert_eq!(out, vec![Output::Close { reason: Some(ReasonCode::TOPIC_ALIAS_INVALID), publish_will: true }]);
    }
}

#[test]
fn an_alias_never_set_with_an_empty_topic_is_a_protocol_error() {
    let t0 = Instant::now();
    let mut s = session_with(ProtocolVersion::V5, 10, SessionLimits::default());
    let mut out = vec![];
    s.handle(publish_with_alias("", 2), t0, &mut out);
    assert_eq!(out, vec![Output::Close { reason: Some(ReasonCode::PROTOCOL_ERROR), publish_will: true }]);
    // And an empty topic with no alias at all [MQTT-3.3.2-1].
    let mut s = session_with(ProtocolVersion::V5, 10, SessionLimits::default());
    out.clear();
    s.handle(publish("", QoS::AtMostOnce, None), t0, &mut out);
    assert_eq!(out, vec![Output::Close { reason: Some(ReasonCode::PROTOCOL_ERROR), publish_will: true }]);
}

#[test]
fn outbound_aliases_are_assigned_per_topic_up_to_the_clients_maximum_and_reset_on_reconnect() {
    let t0 = Instant::now();
    let mut c = connect(ProtocolVersion::V5, "c1", false);
    c.properties.topic_alias_maximum = Some(2);
    c.properties.session_expiry_interval = Some(60);
    let n = negotiate(&c, &ConnectLimits::default(), || unreachable!()).unwrap();
    let mut s = Session::new(ProtocolVersion::V5, &n, Arc::default());
    let (a, b, x) = (ByteString::from("a"), ByteString::from("b"), ByteString::from("x"));
    assert_eq!(s.outbound_topic_alias(&a), Some((1, true)));
    assert_eq!(s.outbound_topic_alias(&a), Some((1, false)));
    assert_eq!(s.outbound_topic_alias(&b), Some((2, true)));
    assert_eq!(s.outbound_topic_alias(&x), None, "beyond the client's Topic Alias Maximum");
    s.go_offline();
    s.resume(ProtocolVersion::V5, &n, t0, &mut vec![]);
    assert_eq!(s.outbound_topic_alias(&b), Some((1, true)), "aliases last one connection");
}

#[test]
fn an_alias_undone_after_a_dropped_publish_is_handed_out_again() {
    let mut c = connect(ProtocolVersion::V5, "c1", true);
    c.properties.topic_alias_maximum = Some(5);
    let n = negotiate(&c, &ConnectLimits::default(), || unreachable!()).unwrap();
    let mut s = Session::new(ProtocolVersion::V5, &n, Arc::default());
    let a = ByteString::from("a");
    assert_eq!(s.outbound_topic_alias(&a), Some((1, true)));
    s.forget_outbound_topic_alias(&a);
    assert_eq!(s.outbound_topic_alias(&a), Some((1, true)));
}

#[test]
fn no_local_on_a_shared_subscription_is_a_protocol_error() {
    // [MQTT-3.8.3-4]
    let t0 = Instant::now();
    let mut s = session_with(ProtocolVersion::V5, 10, SessionLimits::default());
    let options = SubscriptionOptions { no_local: true, ..SubscriptionOptions::default() };
    let filters = vec![(ByteString::from("$share/g/a"), options)];
    let mut out = vec![];
    s.handle(Packet::Subscribe(Subscribe { packet_id: pid(1), properties: Properties::default().into(), filters }), t0, &mut out);
    assert_eq!(out, vec![Output::Close { reason: Some(ReasonCode::PROTOCOL_ERROR), publish_will: true }]);
}

#[test]
fn shared_deliveries_not_yet_acknowledged_are_taken_back_in_order_when_going_offline() {
    let t0 = Instant::now();
    let mut s = session_with(ProtocolVersion::V5, 1, SessionLimits::default());
    let mut out = vec![];
    let shared = |topic: &str| Delivery { group: Some("$share/g/#".into()), ..delivery(&message(topic, QoS::AtLeastOnce, t0), QoS::AtLeastOnce) };
    s.deliver(shared("s1"), t0, &mut out);
    s.deliver(delivery(&message("own", QoS::AtLeastOnce, t0), QoS::AtLeastOnce), t0, &mut out);
    s.deliver(shared("s2"), t0, &mut out);
    s.go_offline();
    let taken: Vec<_> = s.take_shared_deliveries().into_iter().map(|d| d.message.topic.to_string()).collect();
    assert_eq!(taken, vec!["s1", "s2"]);
    assert_eq!((s.inflight(), s.queued()), (0, 1), "the session's own delivery stays");
}

#[test]
fn shared_qos2_deliveries_in_flight_stay_with_the_member() {
    // [MQTT-4.8.2-4], [MQTT-4.8.2-5]: a QoS 2 delivery already sent is
    // completed with the same client, never given to another member.
    let t0 = Instant::now();
    let mut s = session_with(ProtocolVersion::V5, 10, SessionLimits::default());
    let mut out = vec![];
    let m = message("s", QoS::ExactlyOnce, t0);
    let d = Delivery { group: Some("$share/g/#".into()), ..delivery(&m, QoS::ExactlyOnce) };
    s.deliver(d, t0, &mut out);
    s.go_offline();
    assert!(s.take_shared_deliveries().is_empty());
    assert_eq!(s.inflight(), 1);
}

#[test]
fn clients_may_not_publish_into_sys() {
    // `$SYS/` belongs to the broker (MQTT 5 §4.7.2): MQTT 5 gets PUBACK
    // 0x87, 3.1.1 an acknowledgement without forwarding.
    let t0 = Instant::now();
    for (protocol, reason) in [(ProtocolVersion::V5, ReasonCode::NOT_AUTHORIZED), (ProtocolVersion::V3_1_1, ReasonCode::SUCCESS)] {
        let mut s = session_with(protocol, 10, SessionLimits::default());
        let mut out = vec![];
        s.handle(publish("$SYS/broker/version", QoS::AtLeastOnce, Some(1)), t0, &mut out);
        let Output::Acknowledge(Packet::PubAck(ack)) = &out[0] else { panic!("{out:?}") };
        assert_eq!(ack.reason, reason);
        assert_eq!(out.len(), 1, "nothing forwarded");
        assert_eq!(s.take_drops().not_authorized, 1);
    }
}

#[test]
fn a_response_topic_with_wildcards_is_a_protocol_error() {
    // [MQTT-3.3.2-14]
    let t0 = Instant::now();
    let mut s = session_with(ProtocolVersion::V5, 10, SessionLimits::default());
    let Packet::Publish(mut p) = publish("req", QoS::AtMostOnce, None) else { unreachable!() };
    p.properties.response_topic = Some("reply/#".into());
    let mut out = vec![];
    s.handle(Packet::Publish(p), t0, &mut out);
    assert_eq!(out, vec![Output::Close { reason: Some(ReasonCode::PROTOCOL_ERROR), publish_will: true }]);
}

#[test]
fn an_invalid_filter_closes_a_3_1_1_connection() {
    // 3.1.1 §4.8: a protocol violation closes the connection (no SUBACK).
    let t0 = Instant::now();
    let mut s = session_with(ProtocolVersion::V3_1_1, 10, SessionLimits::default());
    let filters = vec![(ByteString::from("a/#/b"), SubscriptionOptions::default())];
    let mut out = vec![];
    s.handle(Packet::Subscribe(Subscribe { packet_id: pid(1), properties: Properties::default().into(), filters }), t0, &mut out);
    assert_eq!(out, vec![Output::Close { reason: None, publish_will: true }]);
}

#[test]
fn a_malformed_share_that_is_a_legal_3_1_1_filter_gets_suback_0x80_and_a_misplaced_wildcard_closes() {
    // 3.1.1 has no shared subscriptions: `$share//t` and `$share/g` are
    // legal filters there, refused with 0x80 Failure [MQTT-3.9.3-2]; a
    // `+` inside a level is a protocol violation [MQTT-4.7.1-3] (3.1.1
    // §4.8: the connection closes), `$share` or not.
    let t0 = Instant::now();
    let mut s = session_with(ProtocolVersion::V3_1_1, 10, SessionLimits::default());
    let filters = vec![
        (ByteString::from("$share//t"), SubscriptionOptions::default()),
        (ByteString::from("$share/g"), SubscriptionOptions::default()),
        (ByteString::from("ok"), SubscriptionOptions::default()),
    ];
    let mut out = vec![];
    s.handle(Packet::Subscribe(Subscribe { packet_id: pid(1), properties: Properties::default().into(), filters }), t0, &mut out);
    let Some(Output::Acknowledge(Packet::SubAck(ack))) = out.iter().find(|o| matches!(o, Output::Acknowledge(_))) else { panic!("{out:?}") };
    assert_eq!(ack.reasons, vec![ReasonCode::UNSPECIFIED_ERROR, ReasonCode::UNSPECIFIED_ERROR, ReasonCode::GRANTED_QOS_0]);
    let filters = vec![(ByteString::from("$share/g+/t"), SubscriptionOptions::default())];
    let mut out = vec![];
    s.handle(Packet::Subscribe(Subscribe { packet_id: pid(2), properties: Properties::default().into(), filters }), t0, &mut out);
    assert_eq!(out, vec![Output::Close { reason: None, publish_will: true }]);
}

mod properties {
    //! Property tests: whatever the interleaving of deliveries and
    //! acknowledgements, the session never exceeds the client's Receive
    //! Maximum, never loses a QoS 1 message it did not drop for a counted
    //! reason, and never reuses a packet identifier in flight.
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Step {
        Deliver,
        AckOldest,
        AckNewest,
        Reconnect,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            4 => Just(Step::Deliver),
            2 => Just(Step::AckOldest),
            1 => Just(Step::AckNewest),
            1 => Just(Step::Reconnect),
        ]
    }

    proptest! {
        #[test]
        fn qos1_flow_respects_receive_maximum_and_loses_nothing(
            receive_max in 1u16..5, max_queue in 1usize..8, steps in proptest::collection::vec(step(), 1..200)
        ) {
            let t0 = Instant::now();
            let limits = SessionLimits { max_queue, ..SessionLimits::default() };
            let mut s = session_with(ProtocolVersion::V5, receive_max, limits);
            let mut unacked: Vec<u16> = vec![];
            let (mut sent, mut acked) = (0u64, 0u64);
            for st in steps {
                let mut out = vec![];
                match st {
                    Step::Deliver => {
                        sent += 1;
                        s.deliver(delivery(&message("t", QoS::AtLeastOnce, t0), QoS::AtLeastOnce), t0, &mut out);
                    }
                    Step::AckOldest | Step::AckNewest if !unacked.is_empty() => {
                        let p = if matches!(st, Step::AckOldest) { unacked.remove(0) } else { unacked.pop().unwrap() };
                        acked += 1;
                        s.handle(Packet::PubAck(PubResponse::success(pid(p))), t0, &mut out);
                    }
                    Step::Reconnect => {
                        s.go_offline();
                        unacked.clear();
                        let mut c = connect(ProtocolVersion::V5, "c1", false);
                        c.properties.receive_maximum = Some(receive_max);
                        let n = negotiate(&c, &ConnectLimits::default(), || unreachable!()).unwrap();
                        s.resume(ProtocolVersion::V5, &n, t0, &mut out);
                    }
                    _ => {}
                }
                for (p, _dup) in delivered_ids(&out) {
                    let p = p.unwrap();
                    prop_assert!(!unacked.contains(&p), "packet id {} reused while in flight", p);
                    unacked.push(p);
                }
                prop_assert!(unacked.len() <= usize::from(receive_max));
                prop_assert_eq!(unacked.len(), s.inflight());
            }
            let dropped = s.take_drops().queue_full;
            prop_assert_eq!(sent, acked + s.inflight() as u64 + s.queued() as u64 + dropped);
        }
    }
}

#[test]
fn a_session_keeps_its_own_copy_of_the_client_identifier() {
    // The decoder hands out the client identifier as a slice of the
    // CONNECT's buffer; the session must not keep that buffer alive.
    let frame = Bytes::from_static(b"\x00\x04MQTTconnect-frame-with-device-17");
    let id = ByteString::try_from(frame.slice(18..)).unwrap();
    let mut c = connect(ProtocolVersion::V5, "x", false);
    c.client_id = id.clone();
    let n = negotiate(&c, &ConnectLimits::default(), || unreachable!()).unwrap();
    let s = Session::new(ProtocolVersion::V5, &n, Arc::default());
    assert_eq!(s.client_id(), &id);
    let (kept, frame_bytes) = (s.client_id().as_bytes().as_ptr_range(), frame.as_ptr_range());
    assert!(kept.end <= frame_bytes.start || kept.start >= frame_bytes.end, "the session points into the CONNECT");
}

#[test]
fn drop_counters_start_at_zero_and_reset_when_taken() {
    let t = Instant::now();
    let mut s = session_with(ProtocolVersion::V5, 10, SessionLimits { max_queue: 1, ..SessionLimits::default() });
    assert_eq!(s.take_drops(), DropCounts::default());
    s.go_offline();
    let mut out = vec![];
    for _ in 0..3 {
        s.deliver(delivery(&message("a/b", QoS::AtLeastOnce, t), QoS::AtLeastOnce), t, &mut out);
    }
    assert_eq!(s.take_drops().queue_full, 2);
    assert_eq!(s.take_drops(), DropCounts::default());
}

#[test]
fn a_logged_session_logs_what_it_finished_and_its_inbound_qos2_identifiers() {
    let t0 = Instant::now();
    let mut s = session_with(ProtocolVersion::V5, 10, SessionLimits { max_queue: 1, ..SessionLimits::default() });
    let logs = |out: &[Output]| -> Vec<SessionChange> {
        out.iter().filter_map(|o| if let Output::Log(c) = o { Some(*c) } else { None }).collect()
    };
    let stored = |n: u64| {
        let mut m = (*message("a", QoS::AtLeastOnce, t0)).clone();
        m.stored = n;
        Arc::new(m)
    };
    let mut out = vec![];
    // Not logged: nothing to log.
    s.deliver(delivery(&stored(1), QoS::AtLeastOnce), t0, &mut out);
    s.handle(Packet::PubAck(PubResponse::success(pid(1))), t0, &mut out);
    assert!(logs(&out).is_empty());
    s.set_logged(true);
    out.clear();
    s.deliver(delivery(&stored(2), QoS::AtLeastOnce), t0, &mut out);
    s.deliver(delivery(&message("a", QoS::AtLeastOnce, t0), QoS::AtLeastOnce), t0, &mut out);
    s.handle(Packet::PubAck(PubResponse::success(pid(2))), t0, &mut out);
    s.handle(Packet::PubAck(PubResponse::success(pid(3))), t0, &mut out);
    assert_eq!(
        logs(&out),
        vec![SessionChange::Outbound { value: 2, packet_id: 2, released: false }, SessionChange::Done { value: 2 }],
        "unstored messages are not logged"
    );
    // The packet identifier is logged before the PUBLISH goes out.
    let sent = out.iter().position(|o| matches!(o, Output::Log(SessionChange::Outbound { .. }))).unwrap();
    assert!(matches!(out[sent + 1], Output::Deliver { .. }));
    // Dropped from a full queue: done too.
    s.go_offline();
    out.clear();
    s.deliver(delivery(&stored(4), QoS::AtLeastOnce), t0, &mut out);
    s.deliver(delivery(&stored(5), QoS::AtLeastOnce), t0, &mut out);
    assert_eq!(logs(&out), vec![SessionChange::Done { value: 4 }]);
    out.clear();
    s.handle(publish("q", QoS::ExactlyOnce, Some(9)), t0, &mut out);
    s.handle(Packet::PubRel(PubResponse::success(pid(9))), t0, &mut out);
    assert_eq!(
        logs(&out),
        vec![
            SessionChange::InboundQos2 { packet_id: 9, open: true },
            SessionChange::InboundQos2 { packet_id: 9, open: false }
        ]
    );
    // The PUBCOMP waits for the release to be logged.
    assert!(matches!(out.last(), Some(Output::Acknowledge(Packet::PubComp(_)))));
}

#[test]
fn a_restored_session_starts_offline_with_its_subscriptions_identifiers_and_queue() {
    let t0 = Instant::now();
    let mut s = session_with(ProtocolVersion::V5, 10, SessionLimits::default());
    let m = message("a", QoS::AtLeastOnce, t0);
    let subscription = Subscription { options: SubscriptionOptions { qos: QoS::AtLeastOnce, ..Default::default() }, identifier: Some(4) };
    s.restore(HashMap::from([(ByteString::from("a"), subscription)]), [7], [], [delivery(&m, QoS::AtLeastOnce), delivery(&m, QoS::AtLeastOnce)]);
    assert!(!s.is_online());
    assert_eq!((s.queued(), s.subscriptions().len()), (2, 1));
    let mut out = vec![];
    // A resent PUBLISH with the open identifier is not forwarded again.
    s.handle(publish("q", QoS::ExactlyOnce, Some(7)), t0, &mut out);
    assert!(!out.iter().any(|o| matches!(o, Output::Publish(_))));
    out.clear();
    let mut c = connect(ProtocolVersion::V5, "c1", false);
    c.properties.receive_maximum = Some(10);
    let n = negotiate(&c, &ConnectLimits::default(), || unreachable!()).unwrap();
    s.resume(ProtocolVersion::V5, &n, t0, &mut out);
    assert_eq!(delivered_ids(&out), vec![(Some(1), false), (Some(2), false)]);
}

#[test]
fn a_restored_session_resends_what_it_had_sent_with_the_same_identifiers_and_dup_then_pubrel() {
    // [MQTT-4.4.0-1]: unacknowledged PUBLISH packets resent with their
    // original packet identifiers; [MQTT-4.3.3-6]: never the PUBLISH again
    // once its PUBREL was sent.
    let t0 = Instant::now();
    let mut s = session_with(ProtocolVersion::V5, 10, SessionLimits::default());
    s.set_logged(true);
    let stored = |n: u64, qos: QoS| {
        let mut m = (*message("a", qos, t0)).clone();
        m.stored = n;
        Arc::new(m)
    };
    let sent = [
        (delivery(&stored(3, QoS::ExactlyOnce), QoS::ExactlyOnce), pid(40), true),
        (delivery(&stored(4, QoS::ExactlyOnce), QoS::ExactlyOnce), pid(41), false),
        (delivery(&stored(5, QoS::AtLeastOnce), QoS::AtLeastOnce), pid(42), false),
        // Its identifier is taken: it waits in the queue.
        (delivery(&stored(6, QoS::AtLeastOnce), QoS::AtLeastOnce), pid(42), false),
    ];
    s.restore(HashMap::new(), [], sent, [delivery(&stored(7, QoS::AtLeastOnce), QoS::AtLeastOnce)]);
    assert_eq!((s.inflight(), s.queued()), (3, 2));
    let mut out = vec![];
    let n = negotiate(&connect(ProtocolVersion::V5, "c1", false), &ConnectLimits::default(), || unreachable!()).unwrap();
    s.resume(ProtocolVersion::V5, &n, t0, &mut out);
    assert!(matches!(&out[0], Output::Send(Packet::PubRel(r)) if r.packet_id == pid(40)), "{:?}", out[0]);
    let ids = delivered_ids(&out);
    assert_eq!(&ids[..2], &[(Some(41), true), (Some(42), true)]);
    assert_eq!(ids.len(), 4, "then the queue, as new deliveries: {ids:?}");
    assert!(ids[2..].iter().all(|(id, dup)| !dup && ![40, 41, 42].contains(&id.unwrap())));
    // PUBREC of the resent QoS 2 delivery: logged, and the PUBREL waits.
    out.clear();
    s.handle(Packet::PubRec(PubResponse::success(pid(41))), t0, &mut out);
    assert_eq!(out[0], Output::Log(SessionChange::Outbound { value: 4, packet_id: 41, released: true }));
    assert!(matches!(&out[1], Output::Acknowledge(Packet::PubRel(r)) if r.packet_id == pid(41)));
    out.clear();
    s.handle(Packet::PubComp(PubResponse::success(pid(40))), t0, &mut out);
    assert_eq!(out[0], Output::Log(SessionChange::Done { value: 3 }));
}

/// `$SYS/` is the broker's (MQTT 5 §4.7.2): `$SYS` and what is under it
/// are refused to clients, other `$` topics and look-alikes are not.
#[test]
fn clients_may_not_publish_into_sys_but_may_elsewhere() {
    use super::client_may_publish;
    assert!(!client_may_publish(None, "$SYS"));
    assert!(!client_may_publish(None, "$SYS/broker/uptime"));
    assert!(client_may_publish(None, "$SYSX/x"));
    assert!(client_may_publish(None, "$sys/x"));
    assert!(client_may_publish(None, "$foo/x"));
    assert!(client_may_publish(None, "plant/boiler"));
}

/// A `Message` is moved by value on the publish path; past 128 bytes each
/// move is a `memcpy` call (see [`super::GroupPick`]).
#[test]
fn a_message_fits_in_128_bytes() {
    assert!(std::mem::size_of::<Message>() <= 128, "{} bytes", std::mem::size_of::<Message>());
}

/// [`super::GroupPick`]: all, only some, all but some.
#[test]
fn a_group_pick_allows_what_it_names() {
    use super::GroupPick;
    assert!(GroupPick::ALL.allows("g") && GroupPick::ALL.is_all());
    let only = GroupPick::only(vec!["a".into()]);
    assert!(only.allows("a") && !only.allows("b") && !only.is_all());
    let except = GroupPick::except(vec!["a".into()]);
    assert!(!except.allows("a") && except.allows("b") && !except.is_all());
}
