//! The format floor after start (DESIGN.md §4, §6 "rolling upgrade"):
//! replicas write only formats all members read, and the leader raises the
//! floor when the last old one is gone.
//!
//! Every replica follows the `floor` key of `mqtt-cluster-floor` and writes
//! the format it names from then on ([`crate::ClusterStatus::write_format`]);
//! the elected sweeper raises it, with a compare-and-set on the revision it
//! read, to the newest format every live member reads (each member's entry
//! in `mqtt-members` carries the formats it reads,
//! [`MemberRecord::reads`](fleetmq_core::cluster::records::MemberRecord::reads)).
//! A replica that cannot read the floor refuses to start
//! ([`crate::setup::check_floor`]).

use std::sync::Arc;

use async_nats::jetstream::kv::Operation;
use async_nats::jetstream::message::PublishMessage;
use fleetmq_core::cluster::records::{
    bucket, floor_readable, raised_floor, FloorRecord, Record, FLOOR_KEY, FORMAT, FORMATS_READ,
};
use tracing::{info, warn};

use crate::bridge::Shared;
use crate::watch::{follow, Seen, Start};

/// Follow the floor until the bridge stops: a floor above the one this
/// replica writes at moves its writes up to it (never down).
pub(crate) async fn watch(shared: Arc<Shared>) {
    follow(&shared, bucket::FLOOR, Start::History, None, |seen| {
        let Seen::Entry(entry) = seen else { return };
        if entry.key != FLOOR_KEY || entry.operation != Operation::Put {
            return;
        }
        let Ok(record) = FloorRecord::decode(&entry.value) else { return };
        if !floor_readable(record.floor) {
            warn!(target: "cluster", floor = record.floor,
                "cluster: the format floor is {} but this build reads formats {}..={}: upgrade it", record.floor,
                FORMATS_READ.start(), FORMATS_READ.end());
        }
        if shared.status.raise_floor(record.floor) {
            info!(target: "cluster", floor = record.floor, writes = shared.status.write_format(),
                "cluster: format floor raised, records written in format {}", shared.status.write_format());
        }
    })
    .await;
}

/// The formats each live member reads (this replica's included); `None`
/// while the entry of a live member was not read yet.
fn members_read(shared: &Shared) -> Option<Vec<[u16; 2]>> {
    let live: Vec<String> = shared.live.lock().ok()?.keys().cloned().collect();
    let reads = shared.member_reads.lock().ok()?;
    let mut members = vec![[*FORMATS_READ.start(), *FORMATS_READ.end()]];
    for replica in live.iter().filter(|r| **r != shared.config.replica_id) {
        members.push(*reads.get(replica)?);
    }
    Some(members)
}

/// Called by the sweeper while it decides for others: raise the floor to
/// the newest format every live member reads, if that is above it (see
/// [`raised_floor`]), with a compare-and-set on the floor's revision, so a
/// floor another replica wrote meanwhile is never overwritten.
pub(crate) async fn raise(shared: &Shared) {
    let floor = shared.status.floor();
    let Some(target) = members_read(shared).and_then(|members| raised_floor(floor, &members))
    else {
        return;
    };
    let Ok(kv) = shared.state.get_key_value(bucket::FLOOR).await else {
        return;
    };
    let (revision, current) = match kv.entry(FLOOR_KEY).await {
        Ok(Some(e)) if e.operation == Operation::Put => (
            e.revision,
            FloorRecord::decode(&e.value).map_or(floor, |r| r.floor),
        ),
        Ok(Some(e)) => (e.revision, floor),
        Ok(None) => (0, floor),
        Err(_) => return,
    };
    if current >= target {
        shared.status.raise_floor(current);
        return;
    }
    let record = FloorRecord {
        format: FORMAT,
        floor: target,
    };
    let subject = format!("$KV.{}.{FLOOR_KEY}", bucket::FLOOR);
    let publish = PublishMessage::build()
        .payload(record.encode().into())
        .expected_last_subject_sequence(revision);
    let landed = match shared.state.send_publish(subject, publish).await {
        Ok(ack) => ack.await.is_ok(),
        Err(_) => false,
    };
    if landed {
        info!(target: "cluster", from = current, to = target, "cluster: every live member reads format {target}: format floor raised");
        shared.status.raise_floor(target);
    }
}
