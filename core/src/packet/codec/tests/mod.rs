//! Codec tests, by area:
//! - `round_trip`: proptest encode → decode for every packet and property,
//!   and arbitrary bytes never panic;
//! - `incremental`: prefixes need more bytes, packets back to back, sizes;
//! - `malformed`: every rejection, with its variant and reason code;
//! - `forms`: short forms, 3.1.x mappings, encode errors;
//! - `vectors`: byte-for-byte packets assembled from the specifications;
//! - `peek`: `peek_publish` agrees with `decode` on every PUBLISH it accepts.

mod forms;
mod incremental;
mod malformed;
mod peek;
mod round_trip;
mod strategies;
mod vectors;

use bytes::{BufMut, BytesMut};

use super::{decode, encode, DecodeError};
use crate::packet::{Packet, ProtocolVersion};

const V3_1: Option<ProtocolVersion> = Some(ProtocolVersion::V3_1);
const V3_1_1: Option<ProtocolVersion> = Some(ProtocolVersion::V3_1_1);
const V5: Option<ProtocolVersion> = Some(ProtocolVersion::V5);

/// Bytes from hex digits; whitespace is ignored.
fn hex(s: &str) -> Vec<u8> {
    let digits: Vec<u8> = s.bytes().filter(|b| !b.is_ascii_whitespace()).collect();
    assert_eq!(digits.len() & 1, 0, "odd number of hex digits in {s:?}");
    digits
        .chunks(2)
        .map(|pair| u8::from_str_radix(std::str::from_utf8(pair).unwrap(), 16).unwrap())
        .collect()
}

/// A packet: `first` byte, the Remaining Length computed from `body` (hex),
/// then `body`.
fn packet(first: u8, body: &str) -> BytesMut {
    let body = hex(body);
    let mut out = BytesMut::new();
    out.put_u8(first);
    super::data::put_varint(&mut out, body.len());
    out.put_slice(&body);
    out
}

/// Decodes exactly one packet from `buf`, which must hold nothing else.
fn decode_one(mut buf: BytesMut, version: Option<ProtocolVersion>) -> Result<Packet, DecodeError> {
    let packet = decode(&mut buf, version, usize::MAX)?.expect("a whole packet");
    assert!(buf.is_empty(), "bytes left after the packet: {buf:?}");
    Ok(packet)
}

/// The error decoding `buf` gives.
fn decode_err(mut buf: BytesMut, version: Option<ProtocolVersion>) -> DecodeError {
    match decode(&mut buf, version, usize::MAX) {
        Err(e) => e,
        Ok(p) => panic!("expected an error, decoded {p:?}"),
    }
}

fn assert_malformed(buf: BytesMut, version: Option<ProtocolVersion>) {
    let e = decode_err(buf, version);
    assert!(
        matches!(e, DecodeError::Malformed(_)),
        "expected Malformed, got {e:?}"
    );
    assert_eq!(e.reason_code().0, 0x81);
}

fn assert_protocol_error(buf: BytesMut, version: Option<ProtocolVersion>) {
    let e = decode_err(buf, version);
    assert!(
        matches!(e, DecodeError::Protocol(_)),
        "expected Protocol, got {e:?}"
    );
    assert_eq!(e.reason_code().0, 0x82);
}

/// `packet` encoded in `version`.
fn encoded(packet: &Packet, version: ProtocolVersion) -> Vec<u8> {
    let mut out = BytesMut::new();
    encode(packet, version, &mut out).expect("encodes");
    out.to_vec()
}
