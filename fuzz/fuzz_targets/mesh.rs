//! Fuzz target for mesh frames (core::mesh): any bytes, read as a stream
//! of frames, must never panic; a frame that decodes re-encodes to bytes
//! that decode to the same frame.
#![no_main]

use bytes::BytesMut;
use fleetmq_core::mesh::{decode, encode};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut buf = BytesMut::from(data);
    while let Ok(Some(frame)) = decode(&mut buf, 1 << 16) {
        let mut again = BytesMut::new();
        encode(&frame, fleetmq_core::mesh::FIRST_VERSION, &mut again);
        let back = decode(&mut again, 1 << 20).expect("an encoded frame decodes");
        assert_eq!(back.as_ref(), Some(&frame), "re-encoding changed the frame");
    }
});
