//! Client identifier ownership in `mqtt-sessions` (DESIGN.md §3 "Session
//! ownership", §4): a claim is a create or a compare-and-set on the
//! revision read; every replica watches the bucket, and a claim by another
//! replica reaches the shard that serves that client identifier as
//! [`Event::TakenOver`].

use std::sync::Arc;
use std::time::Instant;

use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::kv::Operation;
use async_nats::jetstream::message::PublishMessage;
use fleetmq_core::cluster::records::{bucket, client_id_of_key, client_key, OwnerRecord, Record};
use tracing::debug;

use crate::bridge::{ClaimError, Claimed, Event, Shared};
use crate::membership::unix_ms;
use crate::stats::OpKind;
use crate::watch::{follow, Seen, Start};

/// Compare-and-set attempts before a claim gives up (each conflict means
/// another replica claimed in between; the last claim wins).
const CLAIM_ATTEMPTS: usize = 8;

fn subject(key: &str) -> String {
    format!("$KV.{}.{key}", bucket::SESSIONS)
}

/// Whether a publish failed on its expected last subject sequence (10071,
/// or 10164 on replicated streams: notes/jetstream.md §2.3).
fn is_conflict(e: &async_nats::jetstream::context::PublishError) -> bool {
    e.kind() == PublishErrorKind::WrongLastSequence || e.to_string().contains("10164")
}

/// Claim `client_id` for connection `conn`: read the key, then write this
/// replica's record expecting the revision read; repeat on a conflict.
///
/// # Errors
/// [`ClaimError::Unavailable`] when JetStream does not answer or keeps
/// conflicting.
pub(crate) async fn claim(shared: &Shared, client_id: &str, conn: u64) -> Result<Claimed, ClaimError> {
    let started = Instant::now();
    let key = client_key(client_id);
    let record = OwnerRecord {
        format: shared.status.write_format(),
        client_id: client_id.to_owned(),
        replica: shared.config.replica_id.clone(),
        instance: shared.config.instance.clone(),
        conn,
        claimed_at_ms: unix_ms(),
    };
    let payload: bytes::Bytes = record.encode().into();
    let kv = &shared.sessions;
    for _ in 0..CLAIM_ATTEMPTS {
        let entry = kv.entry(&key).await.map_err(|e| ClaimError::Unavailable(e.to_string()))?;
        let (expected, previous) = match &entry {
            None => (0, None),
            Some(e) => {
                let previous = (e.operation == Operation::Put)
                    .then(|| OwnerRecord::decode(&e.value).ok())
                    .flatten()
                    .filter(|r| r.instance != shared.config.instance)
                    .map(|r| r.replica);
                (e.revision, previous)
            }
        };
        let publish = PublishMessage::build().payload(payload.clone()).expected_last_subject_sequence(expected);
        let outcome = match shared.state.send_publish(subject(&key), publish).await {
            Ok(ack) => ack.await,
            Err(e) => Err(e),
        };
        match outcome {
            Ok(ack) => {
                shared.status.stats.record(OpKind::Claim, started.elapsed());
                return Ok(Claimed { revision: ack.sequence, previous });
            }
            Err(e) if is_conflict(&e) => continue,
            Err(e) => return Err(ClaimError::Unavailable(e.to_string())),
        }
    }
    Err(ClaimError::Unavailable(format!("{CLAIM_ATTEMPTS} conflicting claims in a row")))
}

/// Delete the claim on `client_id` if `revision` is still the latest (a
/// delete marker expecting that revision); a later claim elsewhere stays.
pub(crate) async fn release(shared: &Shared, client_id: &str, revision: u64) {
    let started = Instant::now();
    let publish = PublishMessage::build()
        .header("KV-Operation", "DEL")
        .expected_last_subject_sequence(revision);
    let outcome = match shared.state.send_publish(subject(&client_key(client_id)), publish).await {
        Ok(ack) => ack.await.map(|_| ()),
        Err(e) => Err(e),
    };
    shared.status.stats.record(OpKind::Release, started.elapsed());
    if let Err(e) = outcome {
        debug!(target: "cluster", client_id, error = %e, "cluster: release not written (claimed again, or store unavailable)");
    }
}

/// Watch `mqtt-sessions` from its current end and turn every claim by
/// another process into [`Event::TakenOver`] for the shard that serves
/// the client identifier.
pub(crate) async fn watch(shared: Arc<Shared>) {
    follow(&shared, bucket::SESSIONS, Start::New, None, |seen| {
        let Seen::Entry(entry) = seen else { return };
        if entry.operation != Operation::Put {
            return;
        }
        let Ok(record) = OwnerRecord::decode(&entry.value) else { return };
        if record.instance == shared.config.instance {
            return;
        }
        let Some(client_id) = client_id_of_key(&entry.key) else { return };
        let shard = (shared.config.owner_of)(&client_id, shared.mailboxes.len());
        shared.send_event(shard, Event::TakenOver { client_id, revision: entry.revision, replica: record.replica });
    })
    .await;
}
