//! Log framing: how records sit in a segment file, and reading a segment
//! back with its damage found (DESIGN.md §7, `store.kind = "local"`).
//!
//! A frame is `len: u32 LE`, `crc: u32 LE`, then `len` bytes of body; `crc`
//! is the CRC-32 (IEEE) of the four length bytes followed by the body, so a
//! flipped bit anywhere in a frame is found. `len` is at least 1 and at
//! most [`MAX_FRAME_BODY`]. After the last frame a segment holds zeros (a
//! direct-I/O writer pads its last block): a length of 0 ends the frames.
//!
//! Reading ([`scan`]) stops at the first frame that is not whole and
//! correct. What follows decides what that was:
//! - nothing but zeros, or no other correct frame: the **torn tail** of a
//!   write the process did not finish; [`Scan::valid_len`] is where the
//!   caller truncates the file, and nothing of the torn frame is read;
//! - a correct frame further on: **corruption** in the middle of the log,
//!   [`Corrupt`] with the offset of the bad frame, which a caller must not
//!   skip silently (acknowledged values may lie beyond it).

use bytes::{BufMut, Bytes, BytesMut};

/// Bytes of a frame header: length and checksum.
pub const FRAME_HEADER: usize = 8;

/// The largest frame body: a message at the largest `limits.max_packet_size`
/// (256 MiB) with its fields.
pub const MAX_FRAME_BODY: usize = 256 * 1024 * 1024 + 64 * 1024;

/// A frame that is not correct and is followed by a correct one: the log
/// is damaged in the middle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Corrupt {
    /// Byte offset of the bad frame in the segment.
    pub offset: u64,
    /// Byte offset of the next correct frame found after it.
    pub next_good: u64,
}

/// A segment read back: its frames, and where its correct part ends.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Scan {
    /// Each correct frame's offset and body, in order.
    pub frames: Vec<(u64, Bytes)>,
    /// Length of the correct part: the end of the last correct frame.
    pub valid_len: u64,
    /// True when bytes other than zeros follow `valid_len`: a torn tail
    /// (the caller truncates the file to `valid_len`).
    pub torn: bool,
}

/// Append the frame of `body` to `out`.
///
/// # Panics
/// When `body` is empty or longer than [`MAX_FRAME_BODY`] (the record
/// encoder never produces either).
pub fn put_frame(out: &mut BytesMut, body: &[u8]) {
    assert!(!body.is_empty() && body.len() <= MAX_FRAME_BODY, "frame body of {} bytes", body.len());
    let len = (body.len() as u32).to_le_bytes();
    let mut crc = crc32fast::Hasher::new();
    crc.update(&len);
    crc.update(body);
    out.reserve(FRAME_HEADER + body.len());
    out.put_slice(&len);
    out.put_u32_le(crc.finalize());
    out.put_slice(body);
}

/// The body of a correct frame starting at `at`, if there is one.
fn frame_at(data: &[u8], at: usize) -> Option<&[u8]> {
    let header = data.get(at..at.checked_add(FRAME_HEADER)?)?;
    let len = u32::from_le_bytes(header[0..4].try_into().expect("4 bytes")) as usize;
    if len == 0 || len > MAX_FRAME_BODY {
        return None;
    }
    let want = u32::from_le_bytes(header[4..8].try_into().expect("4 bytes"));
    let body = data.get(at + FRAME_HEADER..at + FRAME_HEADER + len)?;
    let mut crc = crc32fast::Hasher::new();
    crc.update(&header[0..4]);
    crc.update(body);
    (crc.finalize() == want).then_some(body)
}

/// Read the frames of one segment.
///
/// # Errors
/// [`Corrupt`] when a bad frame is followed by a correct one (see the
/// module documentation). Searching for that costs O(bytes after the bad
/// frame), only when there is one.
pub fn scan(data: &Bytes) -> Result<Scan, Corrupt> {
    let mut frames = Vec::new();
    let mut at = 0usize;
    while let Some(body) = frame_at(data, at) {
        let start = at + FRAME_HEADER;
        frames.push((at as u64, data.slice(start..start + body.len())));
        at = start + body.len();
    }
    let rest = &data[at..];
    let torn = rest.iter().any(|&b| b != 0);
    if torn {
        // A correct frame further on means this is not the end of the log.
        if let Some(next) = (at + 1..data.len()).find(|&i| data[i] != 0 && frame_at(data, i).is_some()) {
            return Err(Corrupt { offset: at as u64, next_good: next as u64 });
        }
    }
    Ok(Scan { frames, valid_len: at as u64, torn })
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn log(bodies: &[Vec<u8>]) -> BytesMut {
        let mut out = BytesMut::new();
        for body in bodies {
            put_frame(&mut out, body);
        }
        out
    }

    fn bodies() -> impl Strategy<Value = Vec<Vec<u8>>> {
        prop::collection::vec(prop::collection::vec(any::<u8>(), 1..200), 1..12)
    }

    #[test]
    fn zeros_after_the_last_frame_are_padding_not_damage() {
        let mut data = log(&[b"one".to_vec(), b"two".to_vec()]);
        let end = data.len() as u64;
        data.put_bytes(0, 4096);
        let scan = scan(&data.freeze()).unwrap();
        assert_eq!(scan.frames.len(), 2);
        assert_eq!((scan.valid_len, scan.torn), (end, false));
    }

    proptest! {
        #[test]
        fn frames_read_back_as_written(bodies in bodies()) {
            let data = log(&bodies).freeze();
            let scan = scan(&data).unwrap();
            let read: Vec<Vec<u8>> = scan.frames.iter().map(|(_, b)| b.to_vec()).collect();
            prop_assert_eq!(read, bodies);
            prop_assert_eq!(scan.valid_len, data.len() as u64);
            prop_assert!(!scan.torn);
        }

        /// The last frame cut at any byte is a torn tail: the frames before
        /// it are read, nothing of it is.
        #[test]
        fn a_last_frame_cut_anywhere_is_a_torn_tail(bodies in bodies(), cut in any::<prop::sample::Index>()) {
            let data = log(&bodies);
            let last_start = data.len() - FRAME_HEADER - bodies.last().unwrap().len();
            let cut = last_start + cut.index(data.len() - last_start);
            let scan = scan(&data.freeze().slice(..cut)).unwrap();
            prop_assert_eq!(scan.frames.len(), bodies.len() - 1);
            prop_assert_eq!(scan.valid_len, last_start as u64);
        }

        /// A flipped bit in any frame but the last is found and named.
        #[test]
        fn a_flipped_bit_before_the_last_frame_is_corruption(bodies in bodies(), bit in any::<prop::sample::Index>()) {
            prop_assume!(bodies.len() >= 2);
            let mut data = log(&bodies);
            let last_start = data.len() - FRAME_HEADER - bodies.last().unwrap().len();
            let bit = bit.index(last_start * 8);
            data[bit / 8] ^= 1 << (bit % 8);
            let starts: Vec<usize> = bodies.iter().scan(0, |at, b| { let s = *at; *at += FRAME_HEADER + b.len(); Some(s) }).collect();
            let hit = *starts.iter().rfind(|&&s| s <= bit / 8).unwrap();
            match scan(&data.freeze()) {
                Err(corrupt) => prop_assert_eq!(corrupt.offset, hit as u64),
                Ok(scan) => prop_assert!(false, "not found: {:?}", scan.valid_len),
            }
        }

        /// Any bytes at all: an answer, never a panic.
        #[test]
        fn any_bytes_give_an_answer(data in prop::collection::vec(any::<u8>(), 0..600)) {
            let _ = scan(&Bytes::from(data));
        }
    }
}
