//! Decoding from a stream: a prefix needs more bytes and leaves the buffer
//! untouched, packets back to back come out one at a time, and the size
//! limit is checked from the fixed header.

use bytes::{Bytes, BytesMut};
use bytestring::ByteString;

use super::{hex, V3_1_1, V5};
use crate::packet::codec::{decode, encode, DecodeError};
use crate::packet::{
    Connect, Packet, PacketId, Properties, ProtocolVersion, Publish, QoS, Subscribe,
    SubscriptionOptions, Will,
};

fn samples() -> Vec<Packet> {
    let mut props = Properties {
        session_expiry_interval: Some(60),
        receive_maximum: Some(10),
        ..Properties::default()
    };
    props.user_properties.push(("k".into(), "v".into()));
    let will = Will {
        topic: "dev/1/status".into(),
        payload: Bytes::from_static(b"offline"),
        qos: QoS::AtLeastOnce,
        retain: true,
        properties: Properties {
            will_delay_interval: Some(5),
            ..Properties::default()
        }.into(),
    };
    vec![
        Packet::Connect(Box::new(Connect {
            protocol: ProtocolVersion::V5,
            clean_start: true,
            keep_alive: 30,
            client_id: "dev-1".into(),
            will: Some(will),
            username: Some("u".into()),
            password: Some(Bytes::from_static(b"p")),
            properties: props.into(),
        })),
        Packet::Publish(Publish {
            dup: false,
            qos: QoS::ExactlyOnce,
            retain: false,
            topic: "a/b".into(),
            packet_id: PacketId::new(7),
            properties: Properties {
                topic_alias: Some(3),
                ..Properties::default()
            }.into(),
            // Over 127 bytes: a two-byte Remaining Length.
            payload: Bytes::from(vec![0xAB; 300]),
        }),
        Packet::Subscribe(Subscribe {
            packet_id: PacketId::new(1).unwrap(),
            properties: Properties {
                subscription_identifiers: vec![200_000],
                ..Properties::default()
            }.into(),
            filters: vec![(
                ByteString::from("a/#"),
                SubscriptionOptions {
                    qos: QoS::AtLeastOnce,
                    ..Default::default()
                },
            )],
        }),
        Packet::PingReq,
    ]
}

#[test]
fn every_strict_prefix_of_a_packet_needs_more_bytes_and_leaves_the_buffer_untouched() {
    for p in samples() {
        let mut whole = BytesMut::new();
        encode(&p, ProtocolVersion::V5, &mut whole).unwrap();
        for n in 0..whole.len() {
            let mut prefix = BytesMut::from(&whole[..n]);
            let version = if matches!(p, Packet::Connect(_)) {
                None
            } else {
                V5
            };
            assert_eq!(
                decode(&mut prefix, version, usize::MAX),
                Ok(None),
                "{} prefix of {n} bytes",
                p.name()
            );
            assert_eq!(&prefix[..], &whole[..n], "the buffer was modified");
        }
        let decoded = decode(&mut whole, V5, usize::MAX).unwrap();
        assert_eq!(decoded, Some(p));
        assert!(whole.is_empty());
    }
}

#[test]
fn packets_back_to_back_decode_one_at_a_time() {
    let packets = samples();
    let mut buf = BytesMut::new();
    for p in &packets {
        encode(p, ProtocolVersion::V5, &mut buf).unwrap();
    }
    // Half of a next packet stays in the buffer.
    buf.extend_from_slice(&hex("30 0a 00 03"));
    for p in &packets {
        assert_eq!(decode(&mut buf, V5, usize::MAX).unwrap().as_ref(), Some(p));
    }
    assert_eq!(decode(&mut buf, V5, usize::MAX), Ok(None));
    assert_eq!(&buf[..], &hex("30 0a 00 03")[..]);
}

#[test]
fn a_packet_of_exactly_the_maximum_size_is_accepted() {
    let mut buf = BytesMut::from(&hex("30 05 00 01 61 68 69")[..]);
    assert!(decode(&mut buf, V3_1_1, 7).unwrap().is_some());
}

#[test]
fn a_packet_one_byte_over_the_maximum_is_too_large() {
    let mut buf = BytesMut::from(&hex("30 05 00 01 61 68 69")[..]);
    let e = decode(&mut buf, V3_1_1, 6).unwrap_err();
    assert_eq!(e, DecodeError::TooLarge { size: 7, max: 6 });
    assert_eq!(e.reason_code().0, 0x95);
}

#[test]
fn too_large_is_reported_from_the_fixed_header_before_the_body_arrives() {
    // Remaining Length 0x3FFF (16,383): only the fixed header is buffered.
    let mut buf = BytesMut::from(&hex("30 ff 7f")[..]);
    let e = decode(&mut buf, V5, 1024).unwrap_err();
    assert_eq!(
        e,
        DecodeError::TooLarge {
            size: 3 + 16_383,
            max: 1024
        }
    );
    assert_eq!(e.reason_code().0, 0x95);
}

#[test]
fn decoded_payloads_and_strings_share_the_receive_buffer() {
    let mut buf = BytesMut::new();
    encode(&samples()[1], ProtocolVersion::V5, &mut buf).unwrap();
    let range = buf.as_ptr_range();
    let Some(Packet::Publish(p)) = decode(&mut buf, V5, usize::MAX).unwrap() else {
        panic!("a PUBLISH")
    };
    assert!(range.contains(&p.payload.as_ptr()), "payload was copied");
    assert!(range.contains(&p.topic.as_ptr()), "topic was copied");
}
