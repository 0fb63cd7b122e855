//! The shard's side of `store.kind = "jetstream"` (DESIGN.md §7) and of
//! the session logs (issue 24): an accepted QoS 1/2 PUBLISH is appended
//! to the ingest stream `mqtt-ingest` and, when a persistent session of
//! the cluster wants it ([`wants_log`]), to its workspace's session log
//! `LOG_mqtt-sessions-<workspace>`, through the bridge (one request,
//! both appends pipelined there, `ingest.rs` and `session_log.rs` of the
//! bridge), and its PUBACK/PUBREC waits for JetStream's
//! acknowledgements: a refusal of either refuses the value.
//!
//! The acknowledgement waits through the machinery the cluster's retained
//! writes use: a [`Write`](crate::store::Write) of the shard's store,
//! resolved when the bridge answers, holds the connection's
//! acknowledgements from that one on (they leave in the order they were
//! parked, `[MQTT-4.6.0-2]` `[MQTT-4.6.0-3]`); the value's delivery to
//! live subscribers waits too ([`crate::shard::Shard::written`]), so that
//! a refused value was delivered to nobody (the client sends it again:
//! MQTT 5 §3.4.2.1; at QoS 2 a resend is never a second copy). A
//! publisher with 256 values unanswered, or any while its shard holds
//! 64 MiB of them, stops being read until JetStream answers
//! (`shard/held.rs`): memory stays bounded while NATS is slow or away.
//!
//! Refusals: not in the stream within `cluster.session_log_append_wait`
//! → 0x80 Unspecified error; the stream full (`store.max_bytes`, discard
//! new) or too many appends waiting for NATS → 0x97 Quota exceeded. MQTT
//! 3.1.1 has no refusal code: the connection is closed after the
//! acknowledgements of what came before (DESIGN.md §7; 3.1.1 §4.5: the
//! client sends the unacknowledged PUBLISH again after it reconnects).
//! Never acknowledged and then lost.

use std::sync::Arc;

use fleetmq_core::cluster::ingest::{headers, subject, IngestValue};
use fleetmq_core::cluster::session_log;
use fleetmq_core::packet::ReasonCode;
use fleetmq_core::session::Message;
use fleetmq_nats_bridge::{IngestError, LogAppend, Qos2Flow, Request, StreamMessage};

use super::shard_state;
use crate::store::Outcome;

/// Whether a QoS 1/2 value on `topic` (with its workspace prefix) goes to
/// its workspace's session log: a persistent session of the cluster
/// wants it (see [`session_log::Interest`]). One read lock on the publish
/// path of QoS 1/2 values in cluster mode only; none when no persistent
/// session wants anything.
pub(crate) fn wants_log(topic: &str) -> bool {
    shard_state(|sc| {
        let node = sc.node.borrow();
        let interest = node.as_ref()?.bridge.interest().read().ok()?;
        Some(!interest.is_empty() && interest.wants(topic))
    })
    .unwrap_or(false)
}

/// Append `message` (QoS 1/2, from a client) to the ingest stream as
/// `ingest` describes it and/or to the session log of `workspace`, its
/// acknowledgement waiting for the answer (both) through a
/// [`Write`](crate::store::Write) of `store` (joined with a retained write
/// of the same value, if any). `qos2`: a QoS 2 value of a persistent
/// session, its flow recorded in `mqtt-session-qos2` once the appends
/// landed (see `qos2.rs`; with nothing to append, only that). `held`: the write number its delivery
/// already waits for (a retained value); else a new one from
/// `next_write`. Returns the write number its delivery waits for (see
/// [`crate::shard::Shard::written`]), or `None` when the shard is not a
/// cluster's or there is nothing to append (delivered now).
pub(crate) fn append_ingest(
    message: &Arc<Message>,
    ingest: Option<&IngestValue>,
    workspace: Option<&str>,
    qos2: Option<Box<Qos2Flow>>,
    store: &crate::store::ShardStore,
    held: Option<u64>,
    next_write: impl FnOnce() -> u64,
) -> Option<u64> {
    let (node, shard) = shard_state(|sc| Some((sc.node.borrow().clone()?, sc.shard.borrow().clone()?)))?;
    let ingest = ingest.map(|value| {
        Box::new(StreamMessage { subject: subject(&value.workspace), headers: headers(value), payload: message.payload.clone() })
    });
    let session_log = workspace.and_then(|workspace| {
        let encoded = session_log::encode(workspace, message, crate::store::unix_ms())?;
        let message = StreamMessage { subject: encoded.subject, headers: encoded.headers, payload: encoded.payload };
        Some(Box::new(LogAppend { workspace: workspace.to_owned(), message }))
    });
    if ingest.is_none() && session_log.is_none() && qos2.is_none() {
        return None;
    }
    let (reply, outcome) = tokio::sync::oneshot::channel();
    let request = Request::IngestAppend { ingest, session_log, qos2, wait: node.append_wait, reply };
    let write = store.expect_write(message.origin);
    // Not handed on when JetStream had it already: a flow another replica
    // recorded and stored (see `qos2.rs`), which handed it on then.
    let hand_on = std::rc::Rc::new(std::cell::Cell::new(true));
    let write_no = match held {
        Some(write_no) => write_no,
        None => {
            let write_no = next_write();
            let origin = message.origin;
            let hand_on = hand_on.clone();
            write.then(move |stored| {
                if let Some(shard) = shard.upgrade() {
                    shard.written(origin, write_no, stored && hand_on.get());
                }
            });
            write_no
        }
    };
    // Refused before NATS (the bridge counted and logged it): 0x97, as
    // a full stream.
    let sent = node.bridge.send(request).is_ok();
    glommio::spawn_local(async move {
        // glommio runs a task it spawns at once: the shard's state is
        // borrowed until the caller is done (the write's `then` delivers).
        futures_lite::future::yield_now().await;
        let outcome = if !sent {
            Outcome::Refused(ReasonCode::QUOTA_EXCEEDED)
        } else {
            match outcome.await {
                Ok(Ok(appended)) => {
                    hand_on.set(!appended.duplicate);
                    Outcome::Done
                }
                Ok(Err(IngestError::Unavailable(_))) | Err(_) => Outcome::Refused(ReasonCode::UNSPECIFIED_ERROR),
                Ok(Err(_)) => Outcome::Refused(ReasonCode::QUOTA_EXCEEDED),
            }
        };
        write.resolve(outcome);
    })
    .detach();
    Some(write_no)
}
