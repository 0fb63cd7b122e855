//! Known wire vectors, hand-assembled byte for byte from the MQTT 3.1,
//! 3.1.1 and 5.0 specifications: each decodes to the expected packet, and
//! that packet encodes back to the same bytes.

use bytes::{Bytes, BytesMut};
use bytestring::ByteString;

use super::{hex, V3_1_1, V5};
use crate::packet::codec::{decode, encode};
use crate::packet::{
    ConnAck, Connect, Packet, PacketId, Properties, ProtocolVersion, PubResponse, Publish, QoS,
    ReasonCode, SubAck, Subscribe, SubscriptionOptions, Will,
};

/// 3.1.1 CONNECT as `mosquitto_pub -i mosq-test` sends it: "MQTT" level 4,
/// Clean Session, Keep Alive 60 (3.1.1 §3.1.2.10 example).
const CONNECT_311_MOSQUITTO_PUB: &str =
    "10 15 00 04 4d 51 54 54 04 02 00 3c 00 09 6d 6f 73 71 2d 74 65 73 74";

/// 3.1 CONNECT: "MQIsdp" level 3, Clean Session, Keep Alive 60, client "ab".
const CONNECT_31: &str = "10 10 00 06 4d 51 49 73 64 70 03 02 00 3c 00 02 61 62";

/// 3.1.1 CONNECT with every flag: user name, password, Will Retain, Will
/// QoS 1, Will, Clean Session (flags 0xEE), Keep Alive 10.
const CONNECT_311_ALL_FLAGS: &str =
    "10 19 00 04 4d 51 54 54 04 ee 00 0a 00 01 63 00 01 77 00 01 6d 00 01 75 00 01 70";

/// MQTT 5 CONNECT with Receive Maximum 20 and an empty client identifier.
const CONNECT_5_RECEIVE_MAXIMUM: &str = "10 10 00 04 4d 51 54 54 05 02 00 3c 03 21 00 14 00 00";

/// 3.1.1 CONNACK: session present, accepted.
const CONNACK_311_SESSION_PRESENT: &str = "20 02 01 00";

/// MQTT 5 CONNACK: Success, no properties.
const CONNACK_5: &str = "20 03 00 00 00";

/// MQTT 5 PUBLISH QoS 1 to "a/b", packet id 10, no properties, payload "hi".
const PUBLISH_5_QOS1: &str = "32 0a 00 03 61 2f 62 00 0a 00 68 69";

/// 3.1.1 PUBREL for packet id 10 (flags 0010).
const PUBREL_311: &str = "62 02 00 0a";

/// 3.1.1 SUBSCRIBE id 1 to "a/#" at QoS 1.
const SUBSCRIBE_311: &str = "82 08 00 01 00 03 61 2f 23 01";

/// MQTT 5 SUBACK id 1, no properties, Granted QoS 1.
const SUBACK_5: &str = "90 04 00 01 00 01";

fn id(v: u16) -> PacketId {
    PacketId::new(v).unwrap()
}

fn connect(protocol: ProtocolVersion, client_id: &'static str) -> Connect {
    Connect {
        protocol,
        clean_start: true,
        keep_alive: 60,
        client_id: ByteString::from_static(client_id),
        will: None,
        username: None,
        password: None,
        properties: Properties::default().into(),
    }
}

/// Decodes `wire` (one packet), compares with `expected`, and encodes
/// `expected` back to `wire`.
fn check(wire: &str, version: Option<ProtocolVersion>, expected: Packet) {
    let bytes = hex(wire);
    let mut buf = BytesMut::from(&bytes[..]);
    assert_eq!(
        decode(&mut buf, version, usize::MAX).unwrap(),
        Some(expected.clone()),
        "decoding {wire}"
    );
    assert!(buf.is_empty());
    let v = match &expected {
        Packet::Connect(c) => c.protocol,
        _ => version.unwrap(),
    };
    let mut out = BytesMut::new();
    encode(&expected, v, &mut out).unwrap();
    assert_eq!(&out[..], &bytes[..], "encoding {expected:?}");
}

#[test]
fn a_311_connect_from_mosquitto_pub() {
    check(
        CONNECT_311_MOSQUITTO_PUB,
        None,
        Packet::Connect(Box::new(connect(ProtocolVersion::V3_1_1, "mosq-test"))),
    );
}

#[test]
fn a_31_connect_with_protocol_name_mqisdp() {
    check(
        CONNECT_31,
        None,
        Packet::Connect(Box::new(connect(ProtocolVersion::V3_1, "ab"))),
    );
}

#[test]
fn a_311_connect_with_will_user_name_and_password() {
    let mut c = connect(ProtocolVersion::V3_1_1, "c");
    c.keep_alive = 10;
    c.will = Some(Will {
        topic: "w".into(),
        payload: Bytes::from_static(b"m"),
        qos: QoS::AtLeastOnce,
        retain: true,
        properties: Properties::default().into(),
    });
    c.username = Some("u".into());
    c.password = Some(Bytes::from_static(b"p"));
    check(CONNECT_311_ALL_FLAGS, None, Packet::Connect(Box::new(c)));
}

#[test]
fn an_mqtt5_connect_with_receive_maximum() {
    let mut c = connect(ProtocolVersion::V5, "");
    c.properties.receive_maximum = Some(20);
    check(
        CONNECT_5_RECEIVE_MAXIMUM,
        None,
        Packet::Connect(Box::new(c)),
    );
}

#[test]
fn connacks_in_311_and_mqtt5() {
    let present = ConnAck {
        session_present: true,
        ..ConnAck::default()
    };
    check(
        CONNACK_311_SESSION_PRESENT,
        V3_1_1,
        Packet::ConnAck(present),
    );
    check(CONNACK_5, V5, Packet::ConnAck(ConnAck::default()));
}

#[test]
fn an_mqtt5_qos1_publish() {
    let p = Publish {
        dup: false,
        qos: QoS::AtLeastOnce,
        retain: false,
        topic: "a/b".into(),
        packet_id: Some(id(10)),
        properties: Properties::default().into(),
        payload: Bytes::from_static(b"hi"),
    };
    check(PUBLISH_5_QOS1, V5, Packet::Publish(p));
}

#[test]
fn a_311_pubrel() {
    check(
        PUBREL_311,
        V3_1_1,
        Packet::PubRel(PubResponse::success(id(10))),
    );
}

#[test]
fn a_311_subscribe_and_an_mqtt5_suback() {
    let s = Subscribe {
        packet_id: id(1),
        properties: Properties::default().into(),
        filters: vec![(
            "a/#".into(),
            SubscriptionOptions {
                qos: QoS::AtLeastOnce,
                ..Default::default()
            },
        )],
    };
    check(SUBSCRIBE_311, V3_1_1, Packet::Subscribe(s));
    let a = SubAck {
        packet_id: id(1),
        properties: Properties::default().into(),
        reasons: vec![ReasonCode::GRANTED_QOS_1],
    };
    check(SUBACK_5, V5, Packet::SubAck(a));
}

#[test]
fn pingreq_and_pingresp() {
    check("c0 00", V3_1_1, Packet::PingReq);
    check("d0 00", V5, Packet::PingResp);
}
