//! `mqtt-session-qos2` (DESIGN.md §4, §7; issue 24): the open inbound
//! QoS 2 flows of persistent sessions, one key per flow
//! ([`fleetmq_core::cluster::qos2`]).
//!
//! - Opened after the value's appends landed and before its PUBREC, in
//!   the same request ([`open`] from `request.rs` after
//!   `ingest::append_both`): a flow is never recorded for a value that is
//!   not stored, and the PUBREC waits for both. Pipelined as the appends
//!   are (each request a task of its own on the bridge thread).
//! - Released (a delete marker) by the PUBREL before its PUBCOMP
//!   ([`release`]).
//! - Read by a replica taking a session up ([`list`]: one batched direct
//!   get per 1,024 keys, from any replica of the stream), and purged when
//!   the session ends ([`purge`]).
//!
//! Every write is retried within its wait with the same content: a put or
//! delete that lands twice is the same state (notes/jetstream.md §2.3.4).

use std::sync::atomic::Ordering;
use std::time::Duration;

use async_nats::jetstream::message::PublishMessage;
use bytes::Bytes;
use fleetmq_core::cluster::qos2::{key, packet_id_of_key, prefix, Qos2Record};
use fleetmq_core::cluster::records::{bucket, Record as _, FORMAT};
use futures_util::StreamExt as _;
use tokio::time::Instant;
use tracing::{debug, warn};

use crate::bridge::Shared;

/// A failed write is tried again after this pause, while its wait lasts.
const RETRY_PAUSE: Duration = Duration::from_millis(100);

/// Keys asked for per direct get batch (the server's cap for a batch
/// is higher; this bounds one answer).
const LIST_BATCH: usize = 1_024;

/// How long a direct get answer may take before the read fails.
const READ_WAIT: Duration = Duration::from_secs(5);

/// The subject of `client_id`'s flow `packet_id`.
fn subject(client_id: &str, packet_id: u16) -> String {
    format!("$KV.{}.{}", bucket::SESSION_QOS2, key(client_id, packet_id))
}

/// Put `record` (or a delete marker) on `subject` by `deadline`,
/// retrying.
///
/// # Errors
/// Not acknowledged by the deadline (the text of the last error).
async fn write(shared: &Shared, subject: &str, record: Option<&Bytes>, deadline: Instant) -> Result<(), String> {
    let mut why = String::from("the broker is stopping");
    while Instant::now() < deadline && !shared.stopping.load(Ordering::Acquire) {
        let publish = match record {
            Some(record) => PublishMessage::build().payload(record.clone()),
            None => crate::setup::delete_marker(),
        };
        match shared.publish_by(subject, publish, deadline).await {
            Ok(ack) => match tokio::time::timeout_at(deadline, std::future::IntoFuture::into_future(ack)).await {
                Ok(Ok(_)) => return Ok(()),
                Ok(Err(e)) => why = e.to_string(),
                Err(_) => why = "no acknowledgement from JetStream in time".to_owned(),
            },
            Err(e) => why = e,
        }
        let left = deadline.saturating_duration_since(Instant::now());
        tokio::time::sleep(RETRY_PAUSE.min(left)).await;
    }
    Err(why)
}

/// Record `client_id`'s flow `packet_id`, whose value was appended with
/// `message_id` (empty: nothing appended), by `deadline`.
///
/// # Errors
/// Not recorded by the deadline: the PUBREC is refused (the client sends
/// the PUBLISH again).
pub(crate) async fn open(shared: &Shared, client_id: &str, packet_id: u16, message_id: &str, deadline: Instant) -> Result<(), String> {
    let record = Qos2Record { format: FORMAT, client_id: client_id.to_owned(), packet_id, message_id: message_id.to_owned() };
    write(shared, &subject(client_id, packet_id), Some(&Bytes::from(record.encode())), deadline).await
}

/// Delete `client_id`'s flow `packet_id` within `wait`.
///
/// # Errors
/// Not deleted in time: the PUBCOMP is not sent (the connection closes
/// and the client sends the PUBREL again).
pub(crate) async fn release(shared: &Shared, client_id: &str, packet_id: u16, wait: Duration) -> Result<(), String> {
    write(shared, &subject(client_id, packet_id), None, Instant::now() + wait).await
}

/// One entry of `mqtt-session-qos2` as a direct get answered it.
pub(crate) struct Flow {
    /// Its subject, `$KV.mqtt-session-qos2.<key>`.
    pub(crate) subject: String,
    /// Its stream sequence: the revision a compare-and-set expects.
    pub(crate) seq: u64,
    /// Its value (a [`Qos2Record`]).
    pub(crate) payload: Bytes,
}

/// Every open flow of `client_id` in `mqtt-session-qos2` (no delete or
/// purge marker, nor the server's expiry marker), read with direct get
/// batches (`next_by_subj` = the client's keys, paginated; one request
/// when there is none), in stream order.
///
/// # Errors
/// JetStream did not answer in time, or answered with an error.
pub(crate) async fn flows(shared: &Shared, client_id: &str) -> Result<Vec<Flow>, String> {
    let filter = fleetmq_core::cluster::records::qos2_keys_of(client_id);
    let stream = format!("KV_{}", bucket::SESSION_QOS2);
    let client = &shared.state_client;
    let mut found = Vec::new();
    let mut from = 1u64;
    loop {
        let inbox = client.new_inbox();
        let mut answers = client.subscribe(inbox.clone()).await.map_err(|e| e.to_string())?;
        let request = serde_json::json!({ "seq": from, "batch": LIST_BATCH, "next_by_subj": filter });
        client
            .publish_with_reply(format!("$JS.API.DIRECT.GET.{stream}"), inbox, request.to_string().into())
            .await
            .map_err(|e| e.to_string())?;
        let mut got = 0;
        let mut end = false;
        loop {
            let Ok(Some(m)) = tokio::time::timeout(READ_WAIT, answers.next()).await else {
                return Err(format!("no answer from {stream} in time"));
            };
            match m.status.map(|s| s.as_u16()) {
                Some(204) => break,
                Some(404) => {
                    end = true;
                    break;
                }
                Some(code) => return Err(format!("direct get answered {code} {}", m.description.clone().unwrap_or_default())),
                None => {}
            }
            let header = |name: &str| m.headers.as_ref().and_then(|h| h.get(name)).map(|v| v.as_str().to_owned());
            let (Some(subject), Some(seq)) = (header("Nats-Subject"), header("Nats-Sequence").and_then(|v| v.parse::<u64>().ok()))
            else {
                continue;
            };
            got += 1;
            from = from.max(seq + 1);
            // A released flow (delete marker), a purge, or the server's
            // expiry marker.
            if header("KV-Operation").is_none() && header("Nats-Marker-Reason").is_none() {
                found.push(Flow { subject, seq, payload: m.payload.clone() });
            }
        }
        let _ = answers.unsubscribe().await;
        if end || got < LIST_BATCH {
            return Ok(found);
        }
    }
}

/// The packet identifiers of `client_id`'s open flows, ascending, each
/// with the message ID its value was (or was to be) appended under.
///
/// # Errors
/// JetStream did not answer in time.
pub(crate) async fn list(shared: &Shared, client_id: &str) -> Result<Vec<(u16, String)>, String> {
    let prefix = prefix(client_id);
    // The newest record of a key wins (stream order).
    let mut open = std::collections::BTreeMap::new();
    for flow in flows(shared, client_id).await? {
        let Some(key) = flow.subject.split_once(&format!("{}.", bucket::SESSION_QOS2)).map(|(_, k)| k.to_owned()) else {
            continue;
        };
        let Some(packet_id) = packet_id_of_key(&prefix, &key) else { continue };
        match Qos2Record::decode(&flow.payload) {
            Ok(r) if r.belongs_to(client_id, packet_id) => {
                open.insert(packet_id, r.message_id);
            }
            Ok(_) => warn!(target: "cluster", client_id, packet_id, "cluster: a QoS 2 flow of another client under this key; not used"),
            Err(e) => warn!(target: "cluster", client_id, packet_id, error = %e, "cluster: QoS 2 flow not readable; not used"),
        }
    }
    debug!(target: "cluster", client_id, open = open.len(), "cluster: open QoS 2 flows read");
    Ok(open.into_iter().collect())
}

/// Remove every flow of `client_id` (its session ended), trying for at
/// most `wait`. Nobody waits: a flow left behind is found only by a
/// take-up of a later session of the same client identifier, whose
/// client then reuses that packet identifier with DUP 0 at once (MQTT
/// 5 §4.3.3: a new PUBLISH); logged.
pub(crate) async fn purge(shared: &Shared, client_id: &str, wait: Duration) {
    let stream = format!("KV_{}", bucket::SESSION_QOS2);
    let filter = format!("$KV.{}.{}>", bucket::SESSION_QOS2, prefix(client_id));
    let body = serde_json::json!({ "filter": filter }).to_string();
    let deadline = Instant::now() + wait;
    let mut why = String::from("the broker is stopping");
    while Instant::now() < deadline && !shared.stopping.load(Ordering::Acquire) {
        let asked = shared.state_client.request(format!("$JS.API.STREAM.PURGE.{stream}"), body.clone().into());
        match tokio::time::timeout_at(deadline, asked).await {
            Ok(Ok(answer)) => {
                let text = String::from_utf8_lossy(&answer.payload);
                if text.contains("\"success\":true") {
                    return;
                }
                why = text.into_owned();
            }
            Ok(Err(e)) => why = e.to_string(),
            Err(_) => why = "no answer in time".to_owned(),
        }
        tokio::time::sleep(RETRY_PAUSE).await;
    }
    warn!(target: "cluster", client_id, error = %why, "cluster: QoS 2 flows of an ended session not purged");
}
