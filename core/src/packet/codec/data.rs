//! MQTT data representation (MQTT 5 §1.5, 3.1.1 §1.5): integers, Variable
//! Byte Integers, UTF-8 strings and binary data, read from a received packet
//! body and written to an output buffer.
//!
//! Reading never copies: strings and binary data are [`Bytes`] slices of the
//! packet body, which is itself a slice of the connection's receive buffer.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use bytestring::ByteString;

use super::{DecodeError, EncodeError};
use crate::packet::PacketId;

/// The largest value a Variable Byte Integer can carry (four bytes,
/// MQTT 5 §1.5.5): 268,435,455.
pub(crate) const VARINT_MAX: usize = 268_435_455;

const TRUNCATED: DecodeError = DecodeError::Malformed("packet shorter than its fields announce");

/// A cursor over one packet body (everything after the fixed header).
pub(super) struct Reader {
    buf: Bytes,
}

impl Reader {
    /// A reader over `body`.
    pub(super) fn new(body: Bytes) -> Reader {
        Reader { buf: body }
    }

    /// Bytes not read yet.
    pub(super) fn remaining(&self) -> usize {
        self.buf.len()
    }

    /// True when every byte was read.
    pub(super) fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    /// Fails with Malformed when bytes are left over: every packet's fields
    /// must account for its whole Remaining Length (MQTT 5 §2.1.4).
    pub(super) fn finish(&self) -> Result<(), DecodeError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(DecodeError::Malformed(
                "trailing bytes after the last field",
            ))
        }
    }

    /// One byte.
    pub(super) fn u8(&mut self) -> Result<u8, DecodeError> {
        if self.buf.is_empty() {
            return Err(TRUNCATED);
        }
        Ok(self.buf.get_u8())
    }

    /// A Two Byte Integer, big-endian (§1.5.2).
    pub(super) fn u16(&mut self) -> Result<u16, DecodeError> {
        if self.buf.len() < 2 {
            return Err(TRUNCATED);
        }
        Ok(self.buf.get_u16())
    }

    /// A Four Byte Integer, big-endian (§1.5.3).
    pub(super) fn u32(&mut self) -> Result<u32, DecodeError> {
        if self.buf.len() < 4 {
            return Err(TRUNCATED);
        }
        Ok(self.buf.get_u32())
    }

    /// A Variable Byte Integer (§1.5.5): at most four bytes, in the minimal
    /// encoding `[MQTT-1.5.5-1]`.
    pub(super) fn varint(&mut self) -> Result<u32, DecodeError> {
        let mut value = 0u32;
        for i in 0..4 {
            let byte = self.u8()?;
            value |= u32::from(byte & 0x7F) << (7 * i);
            if byte & 0x80 == 0 {
                if i > 0 && byte == 0 {
                    return Err(DecodeError::Malformed(
                        "Variable Byte Integer not in its minimal encoding [MQTT-1.5.5-1]",
                    ));
                }
                return Ok(value);
            }
        }
        Err(DecodeError::Malformed(
            "Variable Byte Integer longer than 4 bytes",
        ))
    }

    /// The next `n` bytes as a slice of the body.
    pub(super) fn take(&mut self, n: usize) -> Result<Bytes, DecodeError> {
        if self.buf.len() < n {
            return Err(TRUNCATED);
        }
        Ok(self.buf.split_to(n))
    }

    /// Everything not read yet (a PUBLISH payload, §3.3.3).
    pub(super) fn rest(&mut self) -> Bytes {
        std::mem::take(&mut self.buf)
    }

    /// Binary Data: a Two Byte length then that many bytes (§1.5.6).
    pub(super) fn binary(&mut self) -> Result<Bytes, DecodeError> {
        let len = self.u16()?;
        self.take(usize::from(len))
    }

    /// A UTF-8 Encoded String (§1.5.4): well-formed UTF-8 with no surrogate
    /// code points `[MQTT-1.5.4-1]` and no U+0000 `[MQTT-1.5.4-2]`.
    pub(super) fn string(&mut self) -> Result<ByteString, DecodeError> {
        let bytes = self.binary()?;
        utf8(bytes)
    }

    /// A non-zero Packet Identifier `[MQTT-2.2.1-3]`.
    pub(super) fn packet_id(&mut self) -> Result<PacketId, DecodeError> {
        PacketId::new(self.u16()?)
            .ok_or(DecodeError::Malformed("packet identifier 0 [MQTT-2.2.1-3]"))
    }
}

/// Validates `bytes` as an MQTT UTF-8 string and wraps it without copying.
fn utf8(bytes: Bytes) -> Result<ByteString, DecodeError> {
    // `from_utf8` rejects ill-formed sequences, including encoded surrogates
    // (U+D800..U+DFFF) [MQTT-1.5.4-1]. In valid UTF-8 a 0x00 byte can only be
    // U+0000 [MQTT-1.5.4-2].
    if std::str::from_utf8(&bytes).is_err() {
        return Err(DecodeError::Malformed(
            "string is not valid UTF-8 [MQTT-1.5.4-1]",
        ));
    }
    if bytes.contains(&0) {
        return Err(DecodeError::Malformed(
            "string contains U+0000 [MQTT-1.5.4-2]",
        ));
    }
    // SAFETY: checked just above that `bytes` is valid UTF-8.
    Ok(unsafe { ByteString::from_bytes_unchecked(bytes) })
}

/// Bytes a Variable Byte Integer takes for `value` (4 for anything larger
/// than three bytes can carry, including values over [`VARINT_MAX`]).
pub(super) fn varint_len(value: usize) -> usize {
    match value {
        0..=127 => 1,
        128..=16_383 => 2,
        16_384..=2_097_151 => 3,
        _ => 4,
    }
}

/// Writes a Variable Byte Integer in its minimal form; `value` must be at
/// most [`VARINT_MAX`] (callers check).
pub(super) fn put_varint(out: &mut BytesMut, value: usize) {
    debug_assert!(value <= VARINT_MAX);
    let mut value = value;
    loop {
        let byte = (value & 0x7F) as u8;
        value >>= 7;
        if value == 0 {
            out.put_u8(byte);
            return;
        }
        out.put_u8(byte | 0x80);
    }
}

/// Bytes a UTF-8 string or Binary Data field takes: a two-byte length then
/// the bytes.
pub(super) fn binary_len(data: &[u8]) -> usize {
    2 + data.len()
}

/// Writes Binary Data (or a UTF-8 string's bytes) with its two-byte length.
///
/// # Errors
/// [`EncodeError::Invalid`] when `data` is longer than 65,535 bytes.
pub(super) fn put_binary(out: &mut BytesMut, data: &[u8]) -> Result<(), EncodeError> {
    let len = u16::try_from(data.len())
        .map_err(|_| EncodeError::Invalid("string or binary field longer than 65,535 bytes"))?;
    out.put_u16(len);
    out.put_slice(data);
    Ok(())
}

/// Writes a UTF-8 string with its two-byte length; see [`put_binary`].
pub(super) fn put_string(out: &mut BytesMut, s: &str) -> Result<(), EncodeError> {
    put_binary(out, s.as_bytes())
}
