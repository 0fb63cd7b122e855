//! The shard's side of `store.kind = "jetstream"` (DESIGN.md §7): an
//! accepted QoS 1/2 PUBLISH is appended to the ingest stream
//! `mqtt-ingest` through the bridge (pipelined there, `ingest.rs` of the
//! bridge), and its PUBACK/PUBREC waits for JetStream's acknowledgement.
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
use fleetmq_core::packet::ReasonCode;
use fleetmq_core::session::Message;
use fleetmq_nats_bridge::{IngestError, Request};

use super::shard_state;
use crate::store::Outcome;

/// Append `message` (QoS 1/2, from a client) to the ingest stream as
/// `value` describes it, its acknowledgement waiting for the answer
/// through a [`Write`](crate::store::Write) of `store` (joined with a
/// retained write of the same value, if any). `held`: the write number
/// its delivery already waits for (a retained value); else a new one
/// from `next_write`. Returns the write number its delivery waits for
/// (see [`crate::shard::Shard::written`]), or `None` when the shard is
/// not a cluster's (nothing appended: delivered now).
pub(crate) fn append_ingest(
    message: &Arc<Message>,
    value: &IngestValue,
    store: &crate::store::ShardStore,
    held: Option<u64>,
    next_write: impl FnOnce() -> u64,
) -> Option<u64> {
    let (node, shard) = shard_state(|sc| Some((sc.node.borrow().clone()?, sc.shard.borrow().clone()?)))?;
    let (reply, outcome) = tokio::sync::oneshot::channel();
    let request = Request::IngestAppend {
        subject: subject(&value.workspace),
        headers: headers(value),
        payload: message.payload.clone(),
        wait: node.append_wait,
        reply,
    };
    let write = store.expect_write(message.origin);
    let write_no = match held {
        Some(write_no) => write_no,
        None => {
            let write_no = next_write();
            let origin = message.origin;
            write.then(move |stored| {
                if let Some(shard) = shard.upgrade() {
                    shard.written(origin, write_no, stored);
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
                Ok(Ok(_)) => Outcome::Done,
                Ok(Err(IngestError::Unavailable(_))) | Err(_) => Outcome::Refused(ReasonCode::UNSPECIFIED_ERROR),
                Ok(Err(_)) => Outcome::Refused(ReasonCode::QUOTA_EXCEEDED),
            }
        };
        write.resolve(outcome);
    })
    .detach();
    Some(write_no)
}
