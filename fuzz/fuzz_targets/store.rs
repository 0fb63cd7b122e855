//! Fuzz target for the local store's log reader: any bytes, read as a
//! segment, must never panic; every frame read must decode as a record or
//! be refused with a `RecordError`, and every record that decodes must
//! re-encode to the same body; replaying them must never panic.
#![no_main]

use bytes::{Bytes, BytesMut};
use fleetmq_core::store::{scan, Record, Recovered};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let data = Bytes::copy_from_slice(data);
    // Each frame body as a record, and the whole input as one body too.
    let bodies: Vec<Bytes> = match scan(&data) {
        Ok(scan) => scan.frames.into_iter().map(|(_, body)| body).chain([data.clone()]).collect(),
        Err(_) => vec![data.clone()],
    };
    let mut recovered = Recovered::default();
    let mut last = 0;
    for body in bodies {
        if let Ok((lsn, record)) = Record::decode(body.clone()) {
            let mut again = BytesMut::new();
            record.encode(lsn, &mut again);
            assert_eq!(Record::decode(again.freeze()), Ok((lsn, record.clone())));
            if lsn >= last {
                last = lsn;
                recovered.apply(lsn, record);
            }
        }
    }
    recovered.finish(u64::MAX / 2);
});
