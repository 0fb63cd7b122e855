//! Retained messages in `mqtt-retained` (DESIGN.md §4): every replica
//! writes its retained publishes there and keeps its shards' copies
//! current through one watch, loaded in bulk at start (the watch's initial
//! snapshot of the last value per key, not one get per topic).
//!
//! Every change, this replica's own included, reaches the shards in the
//! bucket's revision order, with the revision as its sequence: all
//! replicas converge on the last write JetStream took.

use std::collections::HashMap;
use std::future::IntoFuture as _;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::kv::Operation;
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::stream::DirectGetErrorKind;
use bytes::Bytes;
use fleetmq_core::cluster::records::bucket;
use fleetmq_core::cluster::retained::{
    is_hashed_retained_key, is_retained_key_of, retained_key, topic_of_retained_key, RetainedRecord,
};
use fleetmq_core::packet::QoS;
use fleetmq_core::session::Message;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::bridge::{Event, Shared};
use crate::{RetainedError, Ticket};
use crate::membership::unix_ms;
use crate::watch::{follow, Seen, Start};

/// A watch that brings nothing for this long has delivered its snapshot.
const LOAD_QUIET: Duration = Duration::from_secs(1);

/// The header naming the write a retained record came from,
/// `<instance>.<n>`: a refused write found in the bucket later is known by
/// it.
const WRITE_HEADER: &str = "Fleetmq-Write";

/// Room left in `max_payload` for the headers of a write.
const HEADER_ROOM: usize = 512;

/// A write JetStream refused is tried again after this pause (while the
/// wait lasts).
const RETRY_PAUSE: Duration = Duration::from_millis(100);

/// How long a refused write is looked for in the bucket, to be undone if
/// it landed after all.
const UNDO_FOR: Duration = Duration::from_secs(60);

/// Longest pause between two looks for a refused write.
const UNDO_PAUSE_MAX: Duration = Duration::from_secs(4);

/// Failed writes logged at most once per this period (the others are
/// counted and their number logged with the next).
const WARN_EVERY: Duration = Duration::from_secs(1);

/// A retained write (see [`crate::Request::RetainedPut`]).
pub(crate) struct Put {
    pub(crate) topic: String,
    pub(crate) record: Option<Bytes>,
    pub(crate) previous: Option<Arc<Message>>,
    pub(crate) wait: Duration,
    /// The publisher waits for the outcome: a refusal is undone.
    pub(crate) waited: bool,
}

/// What became of one attempt at a write.
enum Fate {
    /// JetStream has it, at this revision.
    Landed(u64),
    /// JetStream answered that it did not store it.
    Rejected(String),
    /// No answer: it may land later.
    Unknown(String),
}

fn subject(topic: &str) -> String {
    format!("$KV.{}.{}", bucket::RETAINED, retained_key(topic))
}

/// Write `put.record` for its topic, or clear it (`None`: a delete
/// marker), within `put.wait`; returns the revision written. `ticket`, the
/// write's share of what may wait for NATS (see `budget.rs`), is given
/// back when this returns; an undo that follows takes one of the undos'
/// budget (none left: not undone, counted and logged).
///
/// # Errors
/// [`RetainedError::TooLarge`] when the record cannot fit the server's
/// `max_payload`; [`RetainedError::Unavailable`] when JetStream did not
/// take it within the wait (a write that may still land is undone, if
/// the publisher waited: see [`undo`]).
pub(crate) async fn put(shared: &Arc<Shared>, put: &Put, ticket: Option<Ticket>) -> Result<u64, RetainedError> {
    let size = put.record.as_ref().map_or(0, Bytes::len);
    let limit = shared.state_client.max_payload();
    if size + HEADER_ROOM > limit {
        return Err(RetainedError::TooLarge { size, limit: limit.saturating_sub(HEADER_ROOM) });
    }
    let id = format!("{}.{}", shared.status.instance, shared.writes.fetch_add(1, Ordering::Relaxed));
    let subject = subject(&put.topic);
    let deadline = Instant::now() + put.wait;
    loop {
        match attempt(shared, &subject, put.record.clone(), &id, deadline).await {
            Fate::Landed(revision) => return Ok(revision),
            Fate::Rejected(why) if Instant::now() + RETRY_PAUSE < deadline => {
                debug!(target: "cluster", topic = %put.topic, %why, "cluster: retained write rejected, trying again");
                tokio::time::sleep(RETRY_PAUSE).await;
            }
            Fate::Rejected(why) => return Err(RetainedError::Unavailable(why)),
            Fate::Unknown(why) => {
                // The write's wait is over; its undo has a bound of its own.
                drop(ticket);
                if put.waited {
                    let size = put.topic.len() + put.previous.as_ref().map_or(0, |m| m.payload.len());
                    match shared.undos.take(size) {
                        Some(ticket) => {
                            tokio::task::spawn_local(undo(shared.clone(), put.topic.clone(), id, put.previous.clone(), ticket));
                        }
                        None => {
                            shared.status.stats.retained_not_undone.fetch_add(1, Ordering::Relaxed);
                            let error = RetainedError::Unavailable(format!(
                                "{} undos already look for refused writes: should this one land late, it stays",
                                crate::budget::RETAINED_UNDOS_MAX
                            ));
                            warn_limited(shared, &put.topic, &error, true);
                        }
                    }
                }
                return Err(RetainedError::Unavailable(why));
            }
        }
    }
}

/// One publish of the write `id` to `subject`, and what became of it by
/// `deadline`.
async fn attempt(shared: &Shared, subject: &str, record: Option<Bytes>, id: &str, deadline: Instant) -> Fate {
    let publish = match record {
        Some(value) => PublishMessage::build().payload(value),
        None => crate::setup::delete_marker(),
    }
    .header(WRITE_HEADER, id);
    let ack = match shared.publish_by(subject, publish, deadline).await {
        Ok(ack) => ack,
        Err(e) => return Fate::Rejected(e),
    };
    let left = deadline.saturating_duration_since(Instant::now());
    match tokio::time::timeout(left, ack.into_future()).await {
        Ok(Ok(ack)) => Fate::Landed(ack.sequence),
        Ok(Err(e)) => match e.kind() {
            // An answer that it was not stored.
            PublishErrorKind::StreamNotFound
            | PublishErrorKind::WrongLastSequence
            | PublishErrorKind::WrongLastMessageId
            | PublishErrorKind::MaxPayloadExceeded
            | PublishErrorKind::Other => Fate::Rejected(e.to_string()),
            // No answer: look for it until the deadline.
            _ => look(shared, subject, id, deadline).await,
        },
        Err(_) => Fate::Unknown("no acknowledgement from JetStream in time".to_owned()),
    }
}

/// The revision of the last entry of `subject` when it is the write `id`;
/// `Ok(None)` when the last entry is another or there is none.
async fn last_is(shared: &Shared, subject: &str, id: &str) -> Result<Option<u64>, String> {
    let stream = shared.state.get_stream_no_info(format!("KV_{}", bucket::RETAINED)).await.map_err(|e| e.to_string())?;
    match stream.direct_get_last_for_subject(subject).await {
        Ok(message) => {
            let ours = message.headers.get(WRITE_HEADER).is_some_and(|v| v.as_str() == id);
            Ok(ours.then_some(message.sequence))
        }
        Err(e) if e.kind() == DirectGetErrorKind::NotFound => Ok(None),
        Err(e) => Err(e.to_string()),
    }
}

/// Look for the write `id` in the bucket until `deadline` (its
/// acknowledgement was lost).
async fn look(shared: &Shared, subject: &str, id: &str, deadline: Instant) -> Fate {
    let mut why = "no acknowledgement from JetStream".to_owned();
    while Instant::now() < deadline {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, last_is(shared, subject, id)).await {
            Ok(Ok(Some(revision))) => return Fate::Landed(revision),
            Ok(Ok(None)) => {}
            Ok(Err(e)) => why = e,
            Err(_) => break,
        }
        tokio::time::sleep(RETRY_PAUSE.min(deadline.saturating_duration_since(Instant::now()))).await;
    }
    Fate::Unknown(why)
}

/// The write `id` of `topic` was refused to its publisher but may land
/// later: for [`UNDO_FOR`], look for it as the topic's last entry and, if
/// it is, put `previous` back (a delete marker when `None`) with a
/// compare-and-set on its revision, so that a write that followed it is
/// never undone. Every replica follows the bucket, so all of them end
/// with what it holds: the refused value may be seen between its landing
/// and its undoing, never after. Its `ticket` (of the undos' budget) is
/// held until then.
async fn undo(shared: Arc<Shared>, topic: String, id: String, previous: Option<Arc<Message>>, ticket: Ticket) {
    let _ticket = ticket;
    let subject = subject(&topic);
    let until = Instant::now() + UNDO_FOR;
    let mut pause = RETRY_PAUSE;
    while Instant::now() < until && !shared.stopping.load(Ordering::Acquire) {
        if let Ok(Some(revision)) = last_is(&shared, &subject, &id).await {
            let publish = match &previous {
                Some(message) => {
                    let received_ms = unix_ms().saturating_sub(message.received_at.elapsed().as_millis() as u64);
                    let record = RetainedRecord::of(message, received_ms).with_format(shared.status.write_format());
                    PublishMessage::build().payload(record.to_value().into())
                }
                None => crate::setup::delete_marker(),
            }
            .header(WRITE_HEADER, format!("{id}.undo"))
            .expected_last_subject_sequence(revision);
            let outcome = match shared.state.send_publish(subject.clone(), publish).await {
                Ok(ack) => ack.await.map_err(|e| e.kind()),
                Err(_) => Err(PublishErrorKind::Other),
            };
            match outcome {
                Ok(_) => {
                    shared.status.stats.retained_undone.fetch_add(1, Ordering::Relaxed);
                    info!(target: "cluster", %topic, revision, "cluster: a refused retained write landed late and was undone");
                    return;
                }
                // Another write followed it: that one stands.
                Err(PublishErrorKind::WrongLastSequence) => return,
                Err(_) => {}
            }
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(UNDO_PAUSE_MAX);
    }
}

/// Count and log (at most once per [`WARN_EVERY`], with how many were not
/// logged) a retained write that failed.
pub(crate) fn failed(shared: &Shared, put: &Put, error: &RetainedError) {
    let stats = &shared.status.stats;
    let counter = if put.waited { &stats.retained_refused } else { &stats.retained_failed };
    counter.fetch_add(1, Ordering::Relaxed);
    warn_limited(shared, &put.topic, error, put.waited);
}

/// Count and log (as [`failed`]) a retained write not queued because
/// [`crate::RETAINED_WAITING_MAX`] writes or
/// [`crate::RETAINED_WAITING_BYTES`] bytes already wait for NATS: one
/// nobody waits for (QoS 0, a will) is dropped, one its publisher waits
/// for is refused (MQTT 5: 0x97 Quota exceeded).
pub(crate) fn over_budget(shared: &Shared, topic: &str, waited: bool, budget: &crate::budget::Budget) {
    let stats = &shared.status.stats;
    let counter = if waited { &stats.retained_refused } else { &stats.retained_dropped };
    counter.fetch_add(1, Ordering::Relaxed);
    let error = RetainedError::Unavailable(format!(
        "{} retained writes ({} bytes) already wait for NATS, at most {} ({} bytes)",
        budget.count(),
        budget.bytes(),
        crate::RETAINED_WAITING_MAX,
        crate::RETAINED_WAITING_BYTES
    ));
    warn_limited(shared, topic, &error, waited);
}

/// Log a retained write that was not stored, at most once per
/// [`WARN_EVERY`] (with how many were not logged since).
fn warn_limited(shared: &Shared, topic: &str, error: &RetainedError, waited: bool) {
    let Ok(mut warned) = shared.warned.lock() else { return };
    let now = std::time::Instant::now();
    if warned.0.is_some_and(|at| now.duration_since(at) < WARN_EVERY) {
        warned.1 += 1;
        return;
    }
    let unlogged = std::mem::take(&mut warned.1);
    warned.0 = Some(now);
    let qos = if waited { "QoS 1/2 (refused to the publisher)" } else { "QoS 0 or will (lost)" };
    warn!(target: "cluster", %topic, %error, qos, unlogged, "cluster: retained message not stored");
}

/// Watch `mqtt-retained` from its start and hand every change to every
/// shard; set the status's "retained loaded" once the snapshot is in.
pub(crate) async fn watch(shared: Arc<Shared>) {
    if let Ok(mut stream) = shared.state.get_stream(format!("KV_{}", bucket::RETAINED)).await {
        if stream.info().await.is_ok_and(|i| i.state.messages == 0) {
            shared.status.set_retained_loaded(0);
        }
    }
    let mut loaded = 0u64;
    let loaded_now = |loaded: u64| {
        if !shared.status.retained_loaded() {
            shared.status.set_retained_loaded(loaded);
            info!(target: "cluster", loaded, "cluster: retained messages loaded");
        }
    };
    // The snapshot's end is the entry with delta 0 (the watch starts with
    // the last value of every key, delete markers included); a quiet second
    // also ends the load (NumPending can be wrong, notes/jetstream.md §2.3).
    // The topics of hashed keys with a record in the bucket (long topics
    // only: a few at most).
    let mut hashed_topics: HashMap<String, String> = HashMap::new();
    follow(&shared, bucket::RETAINED, Start::History, Some(LOAD_QUIET), |seen| {
        let entry = match seen {
            Seen::Quiet => return loaded_now(loaded),
            Seen::Entry(entry) => entry,
        };
        let now = std::time::Instant::now();
        // A record whose topic does not make its key is not trusted.
        let record = match entry.operation {
            Operation::Put => {
                RetainedRecord::from_value(&entry.value).ok().filter(|r| is_retained_key_of(&entry.key, &r.topic))
            }
            Operation::Delete | Operation::Purge => None,
        };
        // A long topic's key is a hash: its clear (a delete marker, or the
        // server's expiry marker) names no topic, so the topic is kept
        // from the record until then.
        let hashed_topic = match (is_hashed_retained_key(&entry.key), &record) {
            (false, _) => None,
            (true, Some(r)) => {
                hashed_topics.insert(entry.key.clone(), r.topic.clone());
                None
            }
            (true, None) if entry.operation == Operation::Put => hashed_topics.get(&entry.key).cloned(),
            (true, None) => hashed_topics.remove(&entry.key),
        };
        let topic = record.as_ref().map(|r| r.topic.clone());
        let message = record.and_then(|r| r.message(now, unix_ms()));
        // A clear (or an expired or unreadable record) is an empty
        // retained message: the shards drop the topic.
        let message = match message {
            Some(m) => m,
            None => match topic.or(hashed_topic).or_else(|| topic_of_retained_key(&entry.key)) {
                Some(topic) => Arc::new(Message {
                    topic: topic.as_str().into(),
                    payload: Bytes::new(),
                    qos: QoS::AtMostOnce,
                    retain: true,
                    properties: Default::default(),
                    received_at: now,
                    origin: u64::MAX,
                    stored: 0,
                    from_mesh: false,
                    groups: fleetmq_core::session::GroupPick::ALL,
                }),
                None => return,
            },
        };
        shared.broadcast(Event::Retained { revision: entry.revision, message });
        loaded += 1;
        if entry.delta == 0 {
            loaded_now(loaded);
        }
    })
    .await;
}
