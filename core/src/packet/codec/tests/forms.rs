//! MQTT 5 short forms, the 3.1.x mappings of MQTT 5 fields, and encode
//! errors.

use bytes::{Bytes, BytesMut};

use super::{decode_one, encoded, hex, packet, V3_1_1, V5};
use crate::packet::codec::{encode, encoded_len, DecodeError, EncodeError};
use crate::packet::{
    Auth, ConnAck, Disconnect, Packet, PacketId, Properties, ProtocolVersion, PubResponse, Publish,
    QoS, ReasonCode, SubAck, UnsubAck,
};

fn id(v: u16) -> PacketId {
    PacketId::new(v).unwrap()
}

fn puback(reason: ReasonCode) -> Packet {
    Packet::PubAck(PubResponse {
        packet_id: id(1),
        reason,
        properties: Properties::default().into(),
    })
}

#[test]
fn mqtt5_puback_with_success_and_no_properties_is_only_the_packet_id_mqtt_3_4_2_1() {
    assert_eq!(
        encoded(&puback(ReasonCode::SUCCESS), ProtocolVersion::V5),
        hex("40 02 00 01")
    );
}

#[test]
fn mqtt5_puback_with_a_failure_carries_the_reason_and_a_property_length() {
    let p = puback(ReasonCode::NO_MATCHING_SUBSCRIBERS);
    assert_eq!(encoded(&p, ProtocolVersion::V5), hex("40 04 00 01 10 00"));
}

#[test]
fn mqtt5_puback_of_two_bytes_decodes_as_success() {
    assert_eq!(
        decode_one(packet(0x40, "00 01"), V5).unwrap(),
        puback(ReasonCode::SUCCESS)
    );
}

#[test]
fn mqtt5_puback_of_three_bytes_decodes_without_properties_mqtt_3_4_2_2_1() {
    let p = decode_one(packet(0x40, "00 01 10"), V5).unwrap();
    assert_eq!(p, puback(ReasonCode::NO_MATCHING_SUBSCRIBERS));
}

#[test]
fn mqtt5_normal_disconnect_without_properties_has_no_body() {
    let d = Packet::Disconnect(Disconnect::default());
    assert_eq!(encoded(&d, ProtocolVersion::V5), hex("e0 00"));
    assert_eq!(decode_one(packet(0xE0, ""), V5).unwrap(), d);
}

#[test]
fn mqtt5_disconnect_of_one_byte_is_a_reason_code_without_properties() {
    let d = Disconnect {
        reason: ReasonCode::DISCONNECT_WITH_WILL,
        properties: Properties::default().into(),
    };
    assert_eq!(
        decode_one(packet(0xE0, "04"), V5).unwrap(),
        Packet::Disconnect(d)
    );
}

#[test]
fn mqtt5_auth_success_without_properties_has_no_body() {
    assert_eq!(
        encoded(&Packet::Auth(Auth::default()), ProtocolVersion::V5),
        hex("f0 00")
    );
    let a = Auth {
        reason: ReasonCode::CONTINUE_AUTHENTICATION,
        properties: Properties::default().into(),
    };
    assert_eq!(decode_one(packet(0xF0, "18"), V5).unwrap(), Packet::Auth(a));
}

#[test]
fn a_non_minimal_remaining_length_is_malformed_mqtt_1_5_5_1() {
    for wire in ["c0 80 00", "c0 80 80 80 00"] {
        assert!(matches!(
            decode_one(BytesMut::from(&hex(wire)[..]), V5),
            Err(DecodeError::Malformed(_))
        ));
    }
}

#[test]
fn a_connect_is_decoded_per_its_own_protocol_level() {
    let p = decode_one(packet(0x10, "00 04 4d 51 54 54 04 02 00 3c 00 00"), V5).unwrap();
    let Packet::Connect(c) = p else {
        panic!("a CONNECT")
    };
    assert_eq!(c.protocol, ProtocolVersion::V3_1_1);
}

#[test]
fn properties_a_packet_cannot_carry_are_not_encoded() {
    let mut p = PubResponse::success(id(1));
    p.properties.topic_alias = Some(3);
    assert_eq!(
        encoded(&Packet::PubAck(p), ProtocolVersion::V5),
        hex("40 02 00 01")
    );
}

// 3.1.x mappings.

#[test]
fn a_311_connack_carries_the_return_code_of_its_reason() {
    let c = |reason| {
        Packet::ConnAck(ConnAck {
            session_present: false,
            reason,
            properties: Properties::default().into(),
        })
    };
    assert_eq!(
        encoded(&c(ReasonCode::BANNED), ProtocolVersion::V3_1_1),
        hex("20 02 00 05")
    );
    assert_eq!(
        encoded(&c(ReasonCode::SERVER_BUSY), ProtocolVersion::V3_1_1),
        hex("20 02 00 03")
    );
    assert_eq!(
        encoded(
            &c(ReasonCode::UNSUPPORTED_PROTOCOL_VERSION),
            ProtocolVersion::V3_1
        ),
        hex("20 02 00 01")
    );
}

#[test]
fn a_311_suback_keeps_granted_qos_and_writes_any_failure_as_0x80() {
    let s = Packet::SubAck(SubAck {
        packet_id: id(1),
        properties: Properties {
            reason_string: Some("no".into()),
            ..Properties::default()
        }.into(),
        reasons: vec![
            ReasonCode::GRANTED_QOS_1,
            ReasonCode::QUOTA_EXCEEDED,
            ReasonCode::NO_SUBSCRIPTION_EXISTED,
        ],
    });
    assert_eq!(
        encoded(&s, ProtocolVersion::V3_1_1),
        hex("90 05 00 01 01 80 80")
    );
}

#[test]
fn a_311_puback_is_only_the_packet_id() {
    assert_eq!(
        encoded(
            &puback(ReasonCode::NO_MATCHING_SUBSCRIBERS),
            ProtocolVersion::V3_1_1
        ),
        hex("40 02 00 01")
    );
}

#[test]
fn a_311_unsuback_has_no_payload() {
    let u = Packet::UnsubAck(UnsubAck {
        packet_id: id(1),
        properties: Properties::default().into(),
        reasons: vec![ReasonCode::NO_SUBSCRIPTION_EXISTED],
    });
    assert_eq!(encoded(&u, ProtocolVersion::V3_1_1), hex("b0 02 00 01"));
}

#[test]
fn a_311_disconnect_has_no_body() {
    let d = Packet::Disconnect(Disconnect {
        reason: ReasonCode::SERVER_SHUTTING_DOWN,
        properties: Properties::default().into(),
    });
    assert_eq!(encoded(&d, ProtocolVersion::V3_1_1), hex("e0 00"));
    assert_eq!(
        decode_one(packet(0xE0, ""), V3_1_1).unwrap(),
        Packet::Disconnect(Disconnect::default())
    );
}

#[test]
fn a_311_publish_leaves_out_properties() {
    let p = Packet::Publish(Publish {
        dup: false,
        qos: QoS::AtMostOnce,
        retain: true,
        topic: "t".into(),
        packet_id: None,
        properties: Properties {
            message_expiry_interval: Some(10),
            ..Properties::default()
        }.into(),
        payload: Bytes::from_static(b"x"),
    });
    assert_eq!(
        encoded(&p, ProtocolVersion::V3_1_1),
        hex("31 04 00 01 74 78")
    );
}

// Encode errors: nothing is appended.

#[test]
fn auth_cannot_be_encoded_before_mqtt5() {
    let mut out = BytesMut::new();
    let e = encode(
        &Packet::Auth(Auth::default()),
        ProtocolVersion::V3_1_1,
        &mut out,
    )
    .unwrap_err();
    assert!(matches!(e, EncodeError::NotInVersion(_)));
    assert!(out.is_empty());
}

#[test]
fn a_qos1_publish_without_a_packet_id_is_refused_and_nothing_is_appended() {
    let p = Packet::Publish(Publish {
        dup: false,
        qos: QoS::AtLeastOnce,
        retain: false,
        topic: "t".into(),
        packet_id: None,
        properties: Properties::default().into(),
        payload: Bytes::new(),
    });
    let mut out = BytesMut::from(&b"before"[..]);
    assert!(matches!(
        encode(&p, ProtocolVersion::V5, &mut out),
        Err(EncodeError::Invalid(_))
    ));
    assert_eq!(&out[..], b"before");
}

#[test]
fn a_string_over_65535_bytes_is_refused() {
    let mut p = PubResponse::success(id(1));
    p.reason = ReasonCode::UNSPECIFIED_ERROR;
    p.properties.reason_string = Some("x".repeat(65_536).into());
    let mut out = BytesMut::new();
    assert!(matches!(
        encode(&Packet::PubAck(p), ProtocolVersion::V5, &mut out),
        Err(EncodeError::Invalid(_))
    ));
    assert!(out.is_empty());
}

#[test]
fn a_body_over_268435455_bytes_is_too_large() {
    // calloc'd: the pages are never touched.
    let payload = Bytes::from(vec![0u8; 268_435_456]);
    let p = Packet::Publish(Publish {
        dup: false,
        qos: QoS::AtMostOnce,
        retain: false,
        topic: "t".into(),
        packet_id: None,
        properties: Properties::default().into(),
        payload,
    });
    let mut out = BytesMut::new();
    let e = encode(&p, ProtocolVersion::V3_1_1, &mut out).unwrap_err();
    assert_eq!(
        e,
        EncodeError::TooLarge {
            size: 268_435_456 + 3,
            max: 268_435_455
        }
    );
    assert!(out.is_empty());
    assert_eq!(
        encoded_len(&p, ProtocolVersion::V3_1_1),
        1 + 4 + 268_435_459
    );
}
