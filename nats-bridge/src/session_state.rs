//! `mqtt-session-state` (DESIGN.md §4; issue 24): this replica's writes of
//! its persistent sessions' records, and the read of a session another
//! replica served, to take it up.
//!
//! Shards send each change of a session as its whole record
//! ([`Request::SessionPut`](crate::Request::SessionPut), `None` to delete)
//! in the order they happen, written newest first, one write in flight
//! per client identifier ([`crate::newest`]). A waiter (a SUBACK, an
//! UNSUBACK) hears `true` once a write of its record or a newer one
//! landed; the shard bounds its wait.
//!
//! Every write is a compare-and-set on the revision this process last
//! wrote (none known: the key must have no entry). A conflict means
//! another process wrote the record since: when this process still owns
//! the client identifier in `mqtt-sessions`, it reads the revision and
//! writes again (its record is the session's); otherwise the write is
//! stale — the late "offline" write of a replica the client left, which
//! would replace the new owner's record — and is dropped (counted in
//! `session_records_stale`). A delete that lands (the session ended
//! here) also deletes the session's open inbound QoS 2 flows in
//! `mqtt-session-qos2` ([`crate::expiry::end_qos2_flows`]).

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::message::PublishMessage;
use bytes::Bytes;
use fleetmq_core::cluster::records::{bucket, client_key, OwnerRecord, Record as _};
use tokio::sync::oneshot;
use tracing::debug;

use crate::bridge::Shared;

/// The first pause after a failed write; doubled up to 5 s.
const FIRST_BACKOFF: Duration = Duration::from_millis(100);

/// This replica's session records on their way to the bucket (bridge
/// thread only).
pub(crate) struct Writer {
    shared: Arc<Shared>,
    keys: crate::newest::Newest,
    /// The revision of each client identifier's record as this process
    /// last wrote it (or read it, owning the identifier): what its next
    /// write expects. At most [`REVISIONS_MAX`], forgotten all at once
    /// when full (a forgotten one costs a conflict and a read).
    revisions: HashMap<String, u64>,
}

/// Revisions [`Writer::revisions`] holds at most.
const REVISIONS_MAX: usize = 1 << 18;

/// The writer, shared by the bridge's loop and its write tasks.
pub(crate) type Writers = Rc<RefCell<Writer>>;

impl Writer {
    /// Nothing written yet.
    pub(crate) fn new(shared: Arc<Shared>) -> Writers {
        Rc::new(RefCell::new(Writer { shared, keys: Default::default(), revisions: HashMap::new() }))
    }
}

/// `client_id`'s record is now `record` (`None`: the session ended);
/// `landed` hears `true` once it (or a newer one) is in the bucket,
/// `false` if the bridge stops first.
pub(crate) fn request(writers: &Writers, client_id: String, record: Option<Bytes>, landed: Option<oneshot::Sender<bool>>) {
    let start = writers.borrow_mut().keys.put(&client_id, record, landed);
    if start {
        tokio::task::spawn_local(write_key(writers.clone(), client_id));
    }
}

/// Write `client_id`'s newest record until the newest landed (or was
/// found stale). Counted in flight, so that the bridge's stop waits for
/// it (at most its drain): the records written when a stop closes the
/// connections are the ones a replica taking the sessions up reads. At
/// the stop a write that fails is not tried again.
async fn write_key(writers: Writers, client_id: String) {
    let shared = writers.borrow().shared.clone();
    let _in_flight = crate::stats::InFlight::new(&shared.status.stats);
    let mut backoff = FIRST_BACKOFF;
    let mut gave_up = false;
    loop {
        let (record, number, expected) = {
            let mut w = writers.borrow_mut();
            let expected = w.revisions.get(&client_id).copied().unwrap_or(0);
            let Some((record, number)) = w.keys.next(&client_id, gave_up) else { return };
            (record, number, expected)
        };
        let started = std::time::Instant::now();
        let deleted = record.is_none();
        let outcome = write(&shared, &client_id, record, expected).await;
        shared.status.stats.record(crate::OpKind::Session, started.elapsed());
        let stale = match outcome {
            Ok(revision) => {
                backoff = FIRST_BACKOFF;
                let mut w = writers.borrow_mut();
                if w.revisions.len() >= REVISIONS_MAX {
                    w.revisions.clear();
                }
                match deleted {
                    // Its delete marker goes after DELETED_TTL: the next
                    // write (a new session) expects none, and a conflict
                    // with the marker costs a read.
                    true => w.revisions.remove(&client_id),
                    false => w.revisions.insert(client_id.clone(), revision),
                };
                if deleted {
                    // The session ended here: its open inbound QoS 2 flows
                    // go too, as when the sweeper ends one (`expiry.rs`).
                    let (shared, client_id) = (shared.clone(), client_id.clone());
                    tokio::task::spawn_local(async move {
                        if let Err(e) = crate::expiry::end_qos2_flows(&shared, &client_id).await {
                            debug!(target: "cluster", %client_id, error = %e, "cluster: QoS 2 flows of an ended session not deleted");
                        }
                    });
                }
                false
            }
            Err(Failed::Conflict) => match owned_revision(&shared, &client_id).await {
                // Still this process's: its record is the session's.
                Ok(Some(revision)) => {
                    writers.borrow_mut().revisions.insert(client_id.clone(), revision);
                    continue;
                }
                Ok(None) => true,
                Err(e) => {
                    debug!(target: "cluster", %client_id, error = %e, "cluster: session record conflict not resolved, trying again");
                    gave_up = shared.stopping.load(Ordering::Acquire);
                    if !gave_up {
                        tokio::time::sleep(backoff).await;
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                    continue;
                }
            },
            Err(Failed::Other(e)) => {
                debug!(target: "cluster", %client_id, error = %e, "cluster: session record not written, trying again");
                gave_up = shared.stopping.load(Ordering::Acquire);
                if !gave_up {
                    tokio::time::sleep(backoff).await;
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        if stale {
            shared.status.stats.session_records_stale.fetch_add(1, Ordering::Relaxed);
            debug!(target: "cluster", %client_id, "cluster: session record not written: another replica wrote it since and owns the client identifier");
        }
        let mut w = writers.borrow_mut();
        if stale {
            w.revisions.remove(&client_id);
        }
        w.keys.ended(&client_id, number, !stale);
    }
}

/// Why a write did not land.
enum Failed {
    /// The record's revision was not the one expected: another process
    /// wrote it.
    Conflict,
    /// JetStream did not take it (the text of its error).
    Other(String),
}

/// Put `record` as `client_id`'s, or delete it (`None`, with a marker
/// that goes after [`crate::setup::DELETED_TTL`]), if the record's
/// revision is still `expected` (0: no entry); the new revision.
async fn write(shared: &Shared, client_id: &str, record: Option<Bytes>, expected: u64) -> Result<u64, Failed> {
    let subject = format!("$KV.{}.{}", bucket::SESSION_STATE, client_key(client_id));
    let publish = match record {
        Some(record) => PublishMessage::build().payload(record),
        None => crate::setup::delete_marker(),
    };
    let publish = publish.expected_last_subject_sequence(expected);
    let failed = |e: async_nats::jetstream::context::PublishError| match crate::ownership::is_conflict(&e) {
        true => Failed::Conflict,
        false => Failed::Other(e.to_string()),
    };
    let ack = shared.state.send_publish(subject, publish).await.map_err(failed)?;
    ack.await.map(|ack| ack.sequence).map_err(failed)
}

/// The revision of `client_id`'s record now (0: no entry), when this
/// process owns the client identifier in `mqtt-sessions`; `None` when
/// another process does, or none (it was released: a later writer of the
/// record did so after this process's client left).
///
/// # Errors
/// JetStream did not answer (the text of its error).
async fn owned_revision(shared: &Shared, client_id: &str) -> Result<Option<u64>, String> {
    let owner = shared.sessions.entry(client_key(client_id)).await.map_err(|e| e.to_string())?;
    let owned = owner
        .filter(|e| e.operation == async_nats::jetstream::kv::Operation::Put)
        .and_then(|e| OwnerRecord::decode(&e.value).ok())
        .is_some_and(|r| r.instance == shared.config.instance && r.client_id == client_id);
    if !owned {
        return Ok(None);
    }
    let entry = shared.session_state.entry(client_key(client_id)).await.map_err(|e| e.to_string())?;
    Ok(Some(entry.map_or(0, |e| e.revision)))
}

/// `client_id`'s record as the bucket's leader holds it (`None`: none,
/// or deleted; see [`crate::setup::leader_value`]).
///
/// # Errors
/// JetStream did not answer (the text of its error).
pub(crate) async fn get(shared: &Shared, client_id: &str) -> Result<Option<Bytes>, String> {
    crate::setup::leader_value(&shared.session_state, &client_key(client_id)).await
}
