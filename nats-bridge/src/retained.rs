//! Retained messages in `mqtt-retained` (DESIGN.md §4): every replica
//! writes its retained publishes there and keeps its shards' copies
//! current through one watch, loaded in bulk at start (the watch's initial
//! snapshot of the last value per key, not one get per topic).
//!
//! Every change, this replica's own included, reaches the shards in the
//! bucket's revision order, with the revision as its sequence: all
//! replicas converge on the last write JetStream took.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::kv::Operation;
use async_nats::jetstream::message::PublishMessage;
use bytes::Bytes;
use fleetmq_core::cluster::records::{bucket, Record};
use fleetmq_core::cluster::retained::{retained_key, topic_of_retained_key, RetainedRecord};
use fleetmq_core::packet::QoS;
use fleetmq_core::session::Message;
use tracing::info;

use crate::bridge::{Event, Shared};
use crate::membership::unix_ms;
use crate::watch::{follow, Seen, Start};

/// A watch that brings nothing for this long has delivered its snapshot.
const LOAD_QUIET: Duration = Duration::from_secs(1);

/// Write `record` for its topic, or clear `topic` (`record` = `None`: a
/// delete marker).
///
/// # Errors
/// JetStream did not take the write; it may still land later (a retained
/// write is idempotent: the last one per topic wins).
pub(crate) async fn put(shared: &Shared, topic: &str, record: Option<Bytes>) -> Result<u64, String> {
    let subject = format!("$KV.{}.{}", bucket::RETAINED, retained_key(topic));
    let publish = match record {
        Some(value) => PublishMessage::build().payload(value),
        None => PublishMessage::build().header("KV-Operation", "DEL"),
    };
    let ack = shared.state.send_publish(subject, publish).await.map_err(|e| e.to_string())?;
    ack.await.map(|a| a.sequence).map_err(|e| e.to_string())
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
    follow(&shared, bucket::RETAINED, Start::History, Some(LOAD_QUIET), |seen| {
        let entry = match seen {
            Seen::Quiet => return loaded_now(loaded),
            Seen::Entry(entry) => entry,
        };
        let now = Instant::now();
        let message = match entry.operation {
            Operation::Put => RetainedRecord::decode(&entry.value).ok().and_then(|r| r.message(now, unix_ms())),
            Operation::Delete | Operation::Purge => None,
        };
        // A clear (or an expired or unreadable record) is an empty
        // retained message: the shards drop the topic.
        let message = match message {
            Some(m) => m,
            None => match topic_of_retained_key(&entry.key) {
                Some(topic) => Arc::new(Message {
                    topic: topic.as_str().into(),
                    payload: Bytes::new(),
                    qos: QoS::AtMostOnce,
                    retain: true,
                    properties: Default::default(),
                    received_at: now,
                    origin: u64::MAX,
                    stored: 0,
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
