//! Encode → decode gives the packet back, for every packet type and
//! property in each version; any bytes decode without panicking, and what
//! decodes re-encodes to the same packet.

use bytes::BytesMut;
use proptest::prelude::*;

use super::strategies::packet;
use crate::packet::codec::{decode, encode, encoded_len};
use crate::packet::{Packet, ProtocolVersion};

fn round_trip(p: &Packet, v: ProtocolVersion) -> Result<(), TestCaseError> {
    let mut out = BytesMut::new();
    encode(p, v, &mut out).map_err(|e| TestCaseError::fail(format!("encode: {e}")))?;
    prop_assert_eq!(
        out.len(),
        encoded_len(p, v),
        "encoded_len disagrees with encode"
    );
    let decoded = decode(&mut out, Some(v), usize::MAX)
        .map_err(|e| TestCaseError::fail(format!("decode: {e}")))?;
    prop_assert_eq!(decoded.as_ref(), Some(p));
    prop_assert!(out.is_empty(), "decode left bytes behind");
    Ok(())
}

/// Decodes packets from `bytes` until more are needed or an error; each
/// decoded packet must re-encode and decode to itself.
fn decode_stream(
    bytes: &[u8],
    mut version: Option<ProtocolVersion>,
    max: usize,
) -> Result<(), TestCaseError> {
    let mut buf = BytesMut::from(bytes);
    while let Ok(Some(p)) = decode(&mut buf, version, max) {
        let v = match &p {
            Packet::Connect(c) => c.protocol,
            _ => version.expect("only CONNECT decodes without a version"),
        };
        version = Some(v);
        round_trip(&p, v)?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn every_mqtt5_packet_round_trips_with_all_its_properties(p in packet(ProtocolVersion::V5)) {
        round_trip(&p, ProtocolVersion::V5)?;
    }

    #[test]
    fn every_mqtt311_packet_round_trips(p in packet(ProtocolVersion::V3_1_1)) {
        round_trip(&p, ProtocolVersion::V3_1_1)?;
    }

    #[test]
    fn every_mqtt31_packet_round_trips(p in packet(ProtocolVersion::V3_1)) {
        round_trip(&p, ProtocolVersion::V3_1)?;
    }

    #[test]
    fn a_connect_decodes_before_the_version_is_known(p in packet(ProtocolVersion::V5)) {
        // Only CONNECT is accepted first [MQTT-3.1.0-1].
        let mut out = BytesMut::new();
        encode(&p, ProtocolVersion::V5, &mut out).unwrap();
        let decoded = decode(&mut out, None, usize::MAX);
        match p {
            Packet::Connect(_) => prop_assert_eq!(decoded, Ok(Some(p))),
            _ => prop_assert!(decoded.is_err()),
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic_and_what_decodes_re_encodes(
        bytes in proptest::collection::vec(any::<u8>(), 0..300),
        max in prop_oneof![Just(16usize), Just(300), Just(usize::MAX)],
    ) {
        for version in [None, Some(ProtocolVersion::V3_1), Some(ProtocolVersion::V3_1_1), Some(ProtocolVersion::V5)] {
            decode_stream(&bytes, version, max)?;
        }
    }

    #[test]
    fn mutated_valid_packets_never_panic_and_what_decodes_re_encodes(
        p in packet(ProtocolVersion::V5),
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
    ) {
        // Random bytes rarely get past the fixed header; flipping bytes of
        // a valid packet reaches the property and payload parsers.
        let mut bytes = BytesMut::new();
        encode(&p, ProtocolVersion::V5, &mut bytes).unwrap();
        for (at, value) in flips {
            let i = at.index(bytes.len());
            bytes[i] ^= value;
        }
        for version in [Some(ProtocolVersion::V3_1_1), Some(ProtocolVersion::V5)] {
            decode_stream(&bytes, version, usize::MAX)?;
        }
    }
}
