//! Fuzz target for the records a replica reads back from JetStream
//! (core::cluster): any bytes, decoded as each record kind, must never
//! panic; a record that decodes re-encodes to bytes that decode to the
//! same record; a retained or will record turns into a message (or
//! `None`) without panicking, whatever its fields hold. A value of
//! `mqtt-retained` in either layout (format 1 JSON, format 2 binary) that
//! reads back writes to bytes that read back to the same record. A route
//! key (`mqtt-routes`) that parses is made again to a key that parses the same.
//! A session record (`mqtt-session-state`) gives its subscriptions or `None`;
//! a cursor (`mqtt-session-cursor`) says whether it is valid; an inbound
//! QoS 2 flow (`mqtt-session-qos2`) says whose it is, and a key gives its
//! packet identifier (1..=65,535) or `None`.
#![no_main]

use std::time::Instant;

use fleetmq_core::cluster::cursor::CursorRecord;
use fleetmq_core::cluster::qos2::{packet_id_of_key, Qos2Record};
use fleetmq_core::cluster::records::{client_id_of_key, FloorRecord, MemberRecord, OwnerRecord, Record};
use fleetmq_core::cluster::retained::{topic_of_retained_key, RetainedRecord};
use fleetmq_core::cluster::routes::{parse_route_key, route_key, RouteRecord};
use fleetmq_core::cluster::sessions::SessionRecord;
use fleetmq_core::cluster::wills::WillRecord;
use libfuzzer_sys::fuzz_target;

fn round_trip<R: Record + PartialEq + std::fmt::Debug>(data: &[u8]) -> Option<R> {
    let record = R::decode(data).ok()?;
    let again = R::decode(&record.encode()).expect("an encoded record decodes");
    assert_eq!(again, record, "re-encoding changed the record");
    Some(record)
}

fuzz_target!(|data: &[u8]| {
    round_trip::<MemberRecord>(data);
    round_trip::<OwnerRecord>(data);
    round_trip::<RouteRecord>(data);
    if let Some(s) = round_trip::<SessionRecord>(data) {
        let _ = s.restored_subscriptions();
        let _ = s.expired(u64::MAX);
    }
    if let Some(c) = round_trip::<CursorRecord>(data) {
        let _ = (c.valid(), c.read_from());
    }
    if let Some(q) = round_trip::<Qos2Record>(data) {
        let _ = q.belongs_to(&q.client_id, q.packet_id);
    }
    let _ = FloorRecord::decode(data);
    if let Some(r) = round_trip::<RetainedRecord>(data) {
        let _ = r.message(Instant::now(), u64::MAX / 2);
    }
    if let Ok(r) = RetainedRecord::from_value(data) {
        let again = RetainedRecord::from_value(&r.to_value()).expect("a written value reads back");
        assert_eq!(again, r, "re-writing changed the retained record");
        let _ = r.message(Instant::now(), u64::MAX / 2);
    }
    if let Some(w) = round_trip::<WillRecord>(data) {
        let _ = w.will();
    }
    if let Ok(key) = std::str::from_utf8(data) {
        let _ = client_id_of_key(key);
        let _ = topic_of_retained_key(key);
        if let Some(id) = packet_id_of_key("c.", key) {
            assert_ne!(id, 0, "packet identifier 0 from a key");
        }
        if let Some((replica, Some(filter))) = parse_route_key(key) {
            let again = route_key(replica, &filter);
            assert_eq!(parse_route_key(&again), Some((replica, Some(filter))), "a route key reads back");
        }
    }
});
