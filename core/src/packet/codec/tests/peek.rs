//! `peek_publish` reads every PUBLISH that `decode` accepts the same way,
//! never consumes or panics, and refuses what framing cannot survive.

use bytes::BytesMut;
use proptest::prelude::*;

use super::strategies::packet;
use crate::packet::codec::{connect_protocol_level, decode, encode, packet_size, peek_publish, DecodeError, Peeked};
use crate::packet::{Packet, ProtocolVersion};

const VERSIONS: [ProtocolVersion; 3] =
    [ProtocolVersion::V3_1, ProtocolVersion::V3_1_1, ProtocolVersion::V5];

/// What `peek_publish` says of the front of `bytes`, checked against
/// `decode` of the same bytes.
fn agree(bytes: &[u8], v: ProtocolVersion, max: usize) -> Result<(), TestCaseError> {
    let peeked = peek_publish(bytes, v, max);
    let mut buf = BytesMut::from(bytes);
    let decoded = decode(&mut buf, Some(v), max);
    match (&peeked, &decoded) {
        (Ok(Peeked::Publish(view)), Ok(Some(Packet::Publish(p)))) => {
            prop_assert_eq!(view.len, bytes.len() - buf.len());
            prop_assert_eq!((view.dup, view.qos, view.retain), (p.dup, p.qos, p.retain));
            prop_assert_eq!(view.packet_id, p.packet_id);
            prop_assert_eq!(view.topic, p.topic.as_bytes());
            prop_assert_eq!(view.payload, &p.payload[..]);
        }
        // Less checking than decode: a PUBLISH decode refuses for its
        // topic or properties may still read in place.
        (Ok(Peeked::Publish(_)), Err(DecodeError::Malformed(_) | DecodeError::Protocol(_))) => {}
        (Ok(Peeked::Other), Ok(Some(p))) => prop_assert!(!matches!(p, Packet::Publish(_))),
        (Ok(Peeked::Other), Err(_)) => {} // another packet type decode refuses
        (Ok(Peeked::Incomplete), Ok(None)) => {}
        (Err(a), Err(b)) => {
            // Framing errors are found by both, and the same way.
            if matches!(a, DecodeError::TooLarge { .. }) {
                prop_assert_eq!(a, b);
            }
        }
        _ => prop_assert!(false, "peek {:?} but decode {:?}", peeked, decoded),
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn every_encoded_packet_peeks_as_it_decodes(
        (v, p) in prop::sample::select(VERSIONS.to_vec()).prop_flat_map(|v| (Just(v), packet(v)))
    ) {
        let mut out = BytesMut::new();
        encode(&p, v, &mut out).map_err(|e| TestCaseError::fail(format!("encode: {e}")))?;
        agree(&out, v, usize::MAX)?;
        if let Packet::Connect(c) = &p {
            prop_assert_eq!(connect_protocol_level(&out), Some(c.protocol.level()));
        }
        // The size the fixed header announces is the packet's.
        prop_assert_eq!(packet_size(&out), Some(out.len()));
        prop_assert_eq!(packet_size(&out[..1]), None);
        // Every proper prefix needs more bytes, as for decode.
        for cut in [0, 1, out.len() / 2, out.len() - 1] {
            prop_assert_eq!(peek_publish(&out[..cut], v, usize::MAX), Ok(Peeked::Incomplete));
        }
        if let Packet::Publish(_) = p {
            prop_assert!(matches!(peek_publish(&out, v, usize::MAX), Ok(Peeked::Publish(_))));
        }
    }

    #[test]
    fn arbitrary_bytes_peek_without_panicking_and_agree_with_decode(
        bytes in prop::collection::vec(any::<u8>(), 0..64),
        publish_first in any::<bool>(),
        max in prop::sample::select(vec![8usize, 64, usize::MAX]),
    ) {
        let mut bytes = bytes;
        if publish_first && !bytes.is_empty() {
            bytes[0] = 0x30 | (bytes[0] & 0x0F);
        }
        for v in VERSIONS {
            agree(&bytes, v, max)?;
        }
    }
}

/// Packet Identifier 0 is Malformed `[MQTT-2.2.1-3]`; a Topic Name longer
/// than the packet is Malformed, not a read past its end.
#[test]
fn packet_identifier_zero_and_a_topic_past_the_end_are_malformed() {
    let v = ProtocolVersion::V3_1_1;
    // QoS 1, topic "a", packet id 0.
    let zero_id = [0x32, 5, 0, 1, b'a', 0, 0];
    assert!(matches!(peek_publish(&zero_id, v, usize::MAX), Err(DecodeError::Malformed(_))));
    // Topic length 9 in a 3-byte body.
    let long_topic = [0x30, 3, 0, 9, b'a'];
    assert!(matches!(peek_publish(&long_topic, v, usize::MAX), Err(DecodeError::Malformed(_))));
    // Fixed header announcing more than the limit: refused before the body.
    assert_eq!(
        peek_publish(&[0x30, 0x80, 0x01], v, 100),
        Err(DecodeError::TooLarge { size: 131, max: 100 })
    );
}

#[test]
fn the_protocol_level_is_read_from_a_connect_prefix() {
    // Remaining Length 200,000 (3 bytes), "MQTT", level 5.
    let v5 = [0x10, 0xC0, 0x9A, 0x0C, 0x00, 0x04, b'M', b'Q', b'T', b'T', 0x05, 0x02];
    assert_eq!(connect_protocol_level(&v5), Some(5));
    // MQTT 3.1: "MQIsdp", level 3.
    let v31 = [0x10, 0x7F, 0x00, 0x06, b'M', b'Q', b'I', b's', b'd', b'p', 0x03];
    assert_eq!(connect_protocol_level(&v31), Some(3));
    // Not there yet, or a malformed Remaining Length.
    assert_eq!(connect_protocol_level(&v5[..10]), None);
    assert_eq!(connect_protocol_level(&[0x10, 0x80, 0x80, 0x80, 0x80, 0x01]), None);
    assert_eq!(connect_protocol_level(&[]), None);
}

#[test]
fn the_packet_size_is_read_from_the_fixed_header_alone() {
    // Remaining Length 200,000 in 3 bytes: 4 bytes of fixed header.
    assert_eq!(packet_size(&[0x10, 0xC0, 0x9A, 0x0C]), Some(200_004));
    assert_eq!(packet_size(&[0x10, 0xC0, 0x9A]), None, "the Remaining Length goes on");
    assert_eq!(packet_size(&[0x10]), None);
    assert_eq!(packet_size(&[]), None);
    assert_eq!(packet_size(&[0x10, 0x80, 0x80, 0x80, 0x80]), None, "malformed: 5 bytes");
}
