//! Retained messages in cluster mode (DESIGN.md §4, §7): written to
//! `mqtt-retained` and applied from the bucket's watch on every replica;
//! a QoS 1/2 retained value is acknowledged, and delivered to live
//! subscribers, only once the bucket has it.

use std::sync::Arc;

use fleetmq_core::cluster::retained::RetainedRecord;
use fleetmq_core::packet::{QoS, ReasonCode};
use fleetmq_core::session::Message;
use fleetmq_nats_bridge::{Request, RetainedError};

use super::shard_state;
use crate::store::Outcome;

/// The origin of the broker's own messages (wills, `$SYS`): no client
/// waits for their acknowledgement.
const BROKER_ORIGIN: u64 = u64::MAX;

/// What became of a retained message (see [`publish_retained`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Retained {
    /// Not the cluster's: a single node, or a `$SYS` topic (each
    /// replica's own). The shard keeps it itself.
    Local,
    /// A value its publisher waits for that was not written (the retained
    /// writes waiting for NATS are at their bound,
    /// [`fleetmq_nats_bridge::RETAINED_WAITING_MAX`] and
    /// [`fleetmq_nats_bridge::RETAINED_WAITING_BYTES`], or the bridge's
    /// queue is full): its acknowledgement is refused (MQTT 5: 0x97 Quota
    /// exceeded), and it is delivered to nobody.
    Refused,
    /// Written to `mqtt-retained`, or dropped when the retained writes
    /// waiting for NATS are at their bound (counted:
    /// `fleetmq_cluster_retained_dropped_total`); nobody waits for it (QoS
    /// 0, a will): delivered to live subscribers now.
    Written,
    /// Written to `mqtt-retained`, and its publisher waits: delivered to
    /// live subscribers (by [`crate::shard::Shard::written`]) once the
    /// bucket has it, never if refused. What its publisher sent after it
    /// is delivered after it, so its values stay in order
    /// `[MQTT-4.6.0-5]` (the shard holds them meanwhile).
    Held,
}

/// In cluster mode, write `message` (RETAIN set; an empty payload clears
/// the topic `[MQTT-3.3.1-6]`) to `mqtt-retained`: the bucket's watch
/// applies it, on every replica in revision order. [`Retained::Local`]
/// alone, and for the broker's own `$SYS` topics, which are each
/// replica's own.
///
/// A QoS 1 or 2 value from a client is acknowledged only once the bucket
/// has it (DESIGN.md §7): its PUBACK or PUBREC waits for a [`Write`] of
/// `store`, resolved when the bridge answers — refused with 0x80 when
/// JetStream did not take it within `cluster.session_log_append_wait`
/// (the bridge then undoes it should it land later, putting `previous`
/// back), 0x97 when it cannot fit NATS `max_payload`. A refusal (a
/// reason code of 0x80 or above) means the broker did not accept the
/// PUBLISH (MQTT 5 §2.4, §3.4.2.1): the client sends it again, so a
/// refused value must not have been delivered — its live delivery waits
/// for the write too ([`Retained::Held`]: `write` numbers it for
/// [`crate::shard::Shard::written`]), and at QoS 2 a resend is never a
/// second copy. This replica applies the value only from the watch, as
/// every other does, so a refused or failed write leaves no replica with
/// a value the others lack.
///
/// [`Write`]: crate::store::Write
pub(crate) fn publish_retained(
    message: &Arc<Message>,
    previous: impl FnOnce() -> Option<Arc<Message>>,
    store: &crate::store::ShardStore,
    write_no: u64,
) -> Retained {
    let Some((node, shard)) = shard_state(|sc| Some((sc.node.borrow().clone()?, sc.shard.borrow().clone()?))) else {
        return Retained::Local;
    };
    if message.topic.starts_with("$SYS") {
        return Retained::Local;
    }
    let record = (!message.payload.is_empty()).then(|| {
        let now_ms = crate::store::unix_ms();
        RetainedRecord::of(message, now_ms)
            .with_format(node.status().write_format())
            .to_value()
            .into()
    });
    let waits = message.qos != QoS::AtMostOnce;
    let (reply, outcome) = match waits {
        true => {
            let (reply, outcome) = tokio::sync::oneshot::channel();
            (Some(reply), Some(outcome))
        }
        false => (None, None),
    };
    let previous = if waits { previous() } else { None };
    let request = Request::RetainedPut {
        topic: message.topic.to_string(),
        record,
        previous,
        wait: node.append_wait,
        reply,
    };
    let write = waits.then(|| store.expect_write(message.origin));
    let held = waits && message.origin != BROKER_ORIGIN;
    // Refused when what waits for NATS is at its bound (the bridge counts
    // and logs it): a QoS 0 value is dropped (delivered live, not
    // retained), a QoS 1/2 one refused with 0x97 Quota exceeded, like a
    // full local store's (3.1.1: closed after what came before).
    if node.bridge.send(request).is_err() {
        if let Some(write) = write {
            write.resolve(Outcome::Refused(ReasonCode::QUOTA_EXCEEDED));
        }
        // Refused: delivered to nobody (nothing would release it).
        return if held { Retained::Refused } else { Retained::Written };
    }
    if let (Some(write), Some(outcome)) = (write, outcome) {
        let origin = message.origin;
        // Delivered (with what its publisher sent after it) before it is
        // acknowledged, once every store it waits for has it (the ingest
        // stream too: `ingest.rs`).
        if held {
            write.then(move |stored| {
                if let Some(shard) = shard.upgrade() {
                    shard.written(origin, write_no, stored);
                }
            });
        }
        glommio::spawn_local(async move {
            // glommio runs a task it spawns at once: the shard's state is
            // borrowed until the caller is done.
            futures_lite::future::yield_now().await;
            let outcome = match outcome.await {
                Ok(Ok(_)) => Outcome::Done,
                Ok(Err(RetainedError::TooLarge { .. })) => Outcome::Refused(ReasonCode::QUOTA_EXCEEDED),
                Ok(Err(_)) | Err(_) => Outcome::Refused(ReasonCode::UNSPECIFIED_ERROR),
            };
            write.resolve(outcome);
        })
        .detach();
    }
    if held {
        Retained::Held
    } else {
        Retained::Written
    }
}
