//! Fuzz target for mesh frames (core::mesh): any bytes, read as a stream
//! of frames, must never panic; a frame that decodes re-encodes to bytes
//! that decode to the same frame.
#![no_main]

use bytes::BytesMut;
use fleetmq_core::mesh::{decode, encode, VERSIONS};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut buf = BytesMut::from(data);
    while let Ok(Some(frame)) = decode(&mut buf, 1 << 16) {
        let mut again = BytesMut::new();
        // The newest version reads every kind of frame (a route
        // announce is malformed before version 3).
        encode(&frame, VERSIONS[VERSIONS.len() - 1], &mut again);
        let back = decode(&mut again, 1 << 20).expect("an encoded frame decodes");
        assert_eq!(back.as_ref(), Some(&frame), "re-encoding changed the frame");
    }
});
