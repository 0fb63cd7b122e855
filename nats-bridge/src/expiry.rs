//! The sweeper's end of expired sessions (DESIGN.md §4, §5; issue 24): a
//! persistent session is held by the process that last wrote its record
//! in `mqtt-session-state` ([`SessionRecord::instance`]); while that
//! process is a live member it ends the session itself when it expires
//! (the shard's expiry deletes the record, the cursor and the interest).
//! Once that process is gone (killed, stopped, replaced by a new process
//! of its replica ID, or cut off for longer than it takes to be taken for
//! gone), nobody would: the sweeper ends it once its Session Expiry
//! Interval has passed since its connection ended — the record's
//! [`offline_since_ms`](SessionRecord::offline_since_ms) when the process
//! wrote one, else when this replica took the process for gone (or first
//! saw its record orphaned, and never before this replica serves).
//!
//! Ending a session deletes, in this order, each with a compare-and-set
//! on the revision read, so that a client that reconnected meanwhile
//! keeps its session:
//! 1. its record (the revision the watch brought): every replica's watch
//!    then drops the session's interest, so its workspace log stops
//!    taking values for it;
//! 2. its cursor in `mqtt-session-cursor`;
//! 3. its open inbound QoS 2 flows in `mqtt-session-qos2`
//!    ([`qos2_key`](fleetmq_core::cluster::records::qos2_key)).
//!
//! Before 1, and again between 1 and 2, the client identifier's entry in
//! `mqtt-sessions` is read: a claim by a live process means the client is
//! back (its claim comes before its read of the record), and the session
//! is left to it — after 1, the new owner's record write conflicts with
//! the delete and writes again (`session_state.rs`), and its cursor and
//! flows stay.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::Instant;

use async_nats::jetstream::kv::Operation;
use fleetmq_core::cluster::records::{bucket, client_key, OwnerRecord, Record as _};
use fleetmq_core::cluster::sessions::SessionRecord;
use futures_util::StreamExt as _;
use tracing::{debug, info};

use crate::bridge::Shared;
use crate::membership::unix_ms;

/// A session record as the watch of `mqtt-session-state` brought it
/// ([`Shared::session_map`], by key): what the sweep needs of it.
#[derive(Debug, Clone)]
pub(crate) struct KnownSession {
    /// Its revision.
    revision: u64,
    /// The record without its subscriptions.
    record: SessionRecord,
}

/// The watch of `mqtt-session-state` brought `key` at `revision`:
/// `record`, or `None` (deleted, expired, or not readable by this build:
/// left alone).
pub(crate) fn seen(shared: &Shared, key: &str, revision: u64, record: Option<&SessionRecord>) {
    let Ok(mut sessions) = shared.session_map.lock() else { return };
    match record {
        Some(record) => {
            let record = SessionRecord { subscriptions: Vec::new(), ..record.clone() };
            sessions.insert(key.to_owned(), KnownSession { revision, record });
        }
        None => {
            sessions.remove(key);
        }
    }
}

/// Whether `client_id` has a session record (as the watch brought it)
/// that another process wrote: a claim of it here takes that session up
/// even when nobody holds the client identifier in `mqtt-sessions` any
/// more (its process gone and its claim swept, or released).
pub(crate) fn written_elsewhere(shared: &Shared, client_id: &str) -> bool {
    let Ok(sessions) = shared.session_map.lock() else { return false };
    sessions.get(&client_key(client_id)).is_some_and(|known| known.record.instance.as_ref() != Some(&shared.config.instance))
}

/// What the session sweep remembers between runs (reset when the leader
/// lock is lost, or this replica serves again after a fence): when each
/// session whose record has no disconnect time was first found
/// orphaned, in Unix milliseconds on this clock.
#[derive(Debug, Default)]
pub(crate) struct SessionSweep {
    orphaned: HashMap<String, u64>,
}

/// Whether the process that wrote `record` holds the session: a live
/// member (`live`: instances; `live_replicas`: replica IDs). A record
/// without its process (written by an older build) is held while its
/// replica ID is live.
fn held(record: &SessionRecord, live: &HashMap<String, u64>, live_replicas: &[String]) -> bool {
    match &record.instance {
        Some(instance) => live.contains_key(instance),
        None => live_replicas.contains(&record.replica),
    }
}

/// Sessions the sweep ends per turn at most.
const ENDS_PER_TURN: usize = 256;

/// Sessions it ends at once at most (each a few round trips).
const ENDS_WINDOW: usize = 32;

/// End every session whose process is gone and whose expiry has passed
/// (see the module's doc). `serving_since`: when this replica last began
/// to serve (a disconnect it cannot know of counts from no earlier).
pub(crate) async fn sweep(shared: &Shared, memory: &mut SessionSweep, serving_since: Instant) {
    let now_ms = unix_ms();
    let ttl_ms = shared.config.cluster.member_ttl.as_millis() as u64;
    // A process this replica never saw is taken for gone only once it has
    // watched the members for T (every live one writes each T/10).
    if now_ms.saturating_sub(shared.config.started_at_ms) <= ttl_ms {
        return;
    }
    let live = shared.live_instances();
    let mut live_replicas: Vec<String> = shared.live.lock().map(|l| l.keys().cloned().collect()).unwrap_or_default();
    live_replicas.push(shared.config.replica_id.clone());
    let serving_ms = now_ms.saturating_sub(serving_since.elapsed().as_millis() as u64);
    let due: Vec<(String, KnownSession)> = {
        let Ok(sessions) = shared.session_map.lock() else { return };
        memory.orphaned.retain(|key, _| sessions.contains_key(key));
        sessions
            .iter()
            .filter_map(|(key, known)| {
                let record = &known.record;
                if held(record, &live, &live_replicas) {
                    memory.orphaned.remove(key);
                    return None;
                }
                let ended_ms = match record.offline_since_ms {
                    Some(since) => since,
                    None => *memory.orphaned.entry(key.clone()).or_insert_with(|| {
                        let gone = record.instance.as_deref().and_then(|i| shared.gone_at(i));
                        let ago = gone.map_or(0, |at| at.elapsed().as_millis() as u64);
                        now_ms.saturating_sub(ago).max(serving_ms)
                    }),
                };
                let expired = record.expires_at_ms(ended_ms).is_some_and(|at| now_ms >= at);
                expired.then(|| (key.clone(), known.clone()))
            })
            .collect()
    };
    // Bounded per turn, a window at a time, so that the lease (renewed
    // by the same loop) never waits long: the rest go at the next turn.
    let ended: Vec<(String, KnownSession, Result<bool, String>)> = futures_util::stream::iter(due.into_iter().take(ENDS_PER_TURN))
        .map(|(key, known)| async move {
            // Each end is a decision for others: only while this
            // replica's own lease is current.
            let outcome = match shared.decides_for_others() {
                true => end(shared, &key, &known).await,
                false => Ok(false),
            };
            (key, known, outcome)
        })
        .buffer_unordered(ENDS_WINDOW)
        .collect()
        .await;
    for (key, known, outcome) in ended {
        match outcome {
            Ok(true) => {
                memory.orphaned.remove(&key);
                if let Ok(mut sessions) = shared.session_map.lock() {
                    if sessions.get(&key).is_some_and(|k| k.revision == known.revision) {
                        sessions.remove(&key);
                    }
                }
                shared.status.stats.sessions_swept.fetch_add(1, Ordering::Relaxed);
                info!(target: "cluster", client_id = %known.record.client_id, replica = %known.record.replica,
                    "cluster: session of a gone replica ended: its Session Expiry Interval passed");
            }
            Ok(false) => {}
            Err(e) => debug!(target: "cluster", client_id = %known.record.client_id, error = %e, "cluster: expired session not ended; trying again"),
        }
    }
}

/// End the session of `known` (at `key` in `mqtt-session-state`): `false`
/// when its client is back (claimed by a live process) or its record
/// changed since.
async fn end(shared: &Shared, key: &str, known: &KnownSession) -> Result<bool, String> {
    let client_id = &known.record.client_id;
    if claimed_by_live(shared, client_id).await? {
        return Ok(false);
    }
    let record_subject = format!("$KV.{}.{key}", bucket::SESSION_STATE);
    if delete(shared, record_subject, known.revision).await?.is_none() {
        return Ok(false);
    }
    // The record is gone. A client whose claim landed before that delete
    // read the record (and takes the session up): its cursor and flows
    // stay.
    if claimed_by_live(shared, client_id).await? {
        return Ok(false);
    }
    let cursor_key = client_key(client_id);
    if let Some(entry) = shared.cursors.entry(&cursor_key).await.map_err(|e| e.to_string())? {
        if entry.operation == Operation::Put {
            let subject = format!("$KV.{}.{cursor_key}", bucket::SESSION_CURSOR);
            delete(shared, subject, entry.revision).await?;
        }
    }
    end_qos2_flows(shared, client_id).await?;
    Ok(true)
}

/// Whether `client_id` is claimed in `mqtt-sessions` by a live process
/// (its client is connected there, or was lately).
async fn claimed_by_live(shared: &Shared, client_id: &str) -> Result<bool, String> {
    let entry = shared.sessions.entry(client_key(client_id)).await.map_err(|e| e.to_string())?;
    let owner = entry.filter(|e| e.operation == Operation::Put).and_then(|e| OwnerRecord::decode(&e.value).ok());
    Ok(owner.is_some_and(|o| shared.live_instances().get(&o.instance).is_some_and(|epoch| o.epoch >= *epoch)))
}

/// Write a delete marker on `subject` expecting `revision`: its revision,
/// `None` when the key changed since (a compare-and-set conflict).
///
/// # Errors
/// JetStream did not answer (the text of its error).
async fn delete(shared: &Shared, subject: String, revision: u64) -> Result<Option<u64>, String> {
    let publish = crate::setup::delete_marker().expected_last_subject_sequence(revision);
    let outcome = match shared.state.send_publish(subject, publish).await {
        Ok(ack) => ack.await,
        Err(e) => Err(e),
    };
    match outcome {
        Ok(ack) => Ok(Some(ack.sequence)),
        Err(e) if crate::ownership::is_conflict(&e) => Ok(None),
        Err(e) => Err(e.to_string()),
    }
}

/// Delete every open inbound QoS 2 flow of `client_id` in
/// `mqtt-session-qos2` ([`crate::qos2::flows`]), each with a
/// compare-and-set on the revision read. A flow written after its read
/// stays (a new session's). How many were deleted.
///
/// # Errors
/// JetStream did not answer (the text of its error).
pub(crate) async fn end_qos2_flows(shared: &Shared, client_id: &str) -> Result<usize, String> {
    let mut deleted = 0;
    for flow in crate::qos2::flows(shared, client_id).await? {
        if delete(shared, flow.subject, flow.seq).await?.is_some() {
            deleted += 1;
        }
    }
    Ok(deleted)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_is_held_while_the_process_that_wrote_it_is_live() {
        let mut r = SessionRecord::new("c", None, "", 5, 3, "ra", None, []);
        let live: HashMap<String, u64> = [("i-b".to_owned(), 0)].into();
        let replicas = ["ra".to_owned(), "rb".to_owned()];
        assert!(held(&r, &live, &replicas), "an older build's record: by its replica ID");
        assert!(!held(&r, &live, &replicas[1..]));
        r.instance = Some("i-a".into());
        assert!(!held(&r, &live, &replicas), "its replica ID runs a new process: not held by it");
        r.instance = Some("i-b".into());
        assert!(held(&r, &live, &[]));
    }
}
