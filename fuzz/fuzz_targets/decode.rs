//! Fuzz target for the MQTT codec: any bytes, read as a stream of packets
//! in each protocol version (and before CONNECT), must never panic; every
//! packet that decodes must re-encode to `encoded_len` bytes and decode
//! back to itself; `peek_publish` reads every PUBLISH `decode` accepts
//! the same way, and never panics.
#![no_main]

use bytes::BytesMut;
use fleetmq_core::packet::codec::{connect_protocol_level, decode, encode, encoded_len, peek_publish, Peeked};
use fleetmq_core::packet::{Packet, ProtocolVersion};
use libfuzzer_sys::fuzz_target;

/// A small limit, so that the TooLarge path is exercised too (bytes).
const MAX_PACKET_SIZE: usize = 1024;

const VERSIONS: [Option<ProtocolVersion>; 4] = [
    None,
    Some(ProtocolVersion::V3_1),
    Some(ProtocolVersion::V3_1_1),
    Some(ProtocolVersion::V5),
];

fuzz_target!(|data: &[u8]| {
    for start in VERSIONS {
        let mut version = start;
        let mut buf = BytesMut::from(data);
        loop {
            // What peek_publish reads, owned, before decode consumes it.
            let peeked = version.map(|v| match peek_publish(&buf, v, MAX_PACKET_SIZE) {
                Ok(Peeked::Publish(view)) => Seen::Publish {
                    len: view.len,
                    topic: view.topic.to_vec(),
                    payload: view.payload.to_vec(),
                    packet_id: view.packet_id,
                },
                Ok(Peeked::Other) => Seen::Other,
                Ok(Peeked::Incomplete) => Seen::Incomplete,
                Err(_) => Seen::Refused,
            });
            let before = buf.len();
            let level = connect_protocol_level(&buf);
            let Ok(Some(packet)) = decode(&mut buf, version, MAX_PACKET_SIZE) else {
                break;
            };
            if let Packet::Connect(c) = &packet {
                assert_eq!(level, Some(c.protocol.level()), "connect_protocol_level disagrees with decode");
            }
            match (&peeked, &packet) {
                (None, _) => {}
                (Some(Seen::Publish { len, topic, payload, packet_id }), Packet::Publish(p)) => {
                    assert_eq!(*len, before - buf.len(), "peek and decode disagree on the length");
                    assert_eq!(&payload[..], &p.payload[..], "peek and decode disagree on the payload");
                    assert_eq!(&topic[..], p.topic.as_bytes(), "peek and decode disagree on the topic");
                    assert_eq!(*packet_id, p.packet_id, "peek and decode disagree on the packet id");
                }
                (Some(Seen::Other), p) if !matches!(p, Packet::Publish(_)) => {}
                (Some(seen), _) => panic!("decode gave {packet:?} but peek {seen:?}"),
            }
            // A CONNECT sets the version, as the session would.
            let v = match &packet {
                Packet::Connect(c) => c.protocol,
                _ => version.expect("only a CONNECT decodes before the version is known"),
            };
            version = Some(v);
            let mut out = BytesMut::new();
            encode(&packet, v, &mut out).expect("a decoded packet re-encodes");
            assert_eq!(out.len(), encoded_len(&packet, v), "encoded_len disagrees");
            let again = decode(&mut out, Some(v), usize::MAX)
                .expect("a re-encoded packet decodes")
                .expect("a re-encoded packet is whole");
            assert_eq!(again, packet, "re-encoding changed the packet");
            assert!(out.is_empty(), "re-encoding left trailing bytes");
        }
    }
});

/// What `peek_publish` read, owned.
#[derive(Debug)]
enum Seen {
    Publish { len: usize, topic: Vec<u8>, payload: Vec<u8>, packet_id: Option<fleetmq_core::packet::PacketId> },
    Other,
    Incomplete,
    Refused,
}
