//! The shard's side of `mqtt-session-qos2` (DESIGN.md §4, §7; issue 24;
//! the record is [`fleetmq_core::cluster::qos2`], the writes the bridge's
//! `qos2.rs`): a persistent session's inbound QoS 2 flows, so that a
//! PUBLISH its client sends again after moving to another replica is not
//! forwarded a second time.
//!
//! - Opened with the value's appends ([`super::append_ingest`] with a
//!   [`Qos2Flow`]): recorded with the value's message ID before it is
//!   stored, and the PUBREC waits for both; a refused value's flow is
//!   deleted again.
//! - Released by the PUBREL ([`release`]): its PUBCOMP waits for the
//!   delete; not deleted within `cluster.session_log_append_wait`, the
//!   PUBCOMP is not sent and the connection closes (MQTT 5: DISCONNECT
//!   0x80), so the client sends the PUBREL again after it reconnects,
//!   rather than reuse a packet identifier another replica would still
//!   find open.
//! - Read at a take-up ([`super::Node::qos2_of`]) and opened in the session
//!   (`Session::restore`): the first PUBLISH of one its client sends
//!   again is appended again under the recorded message ID, which
//!   JetStream drops if the replica the session left had stored it
//!   (then it is not handed on again either `[MQTT-4.3.3-10]`; else it
//!   is stored and handed on now: that replica died before); later ones
//!   get PUBREC only; its PUBREL gets PUBCOMP `[MQTT-4.3.3-12]`.
//! - Purged when the session ends ([`purge`]).

use std::time::Duration;

use fleetmq_core::packet::ReasonCode;
use fleetmq_nats_bridge::{Qos2Flow, Request};
use tracing::debug;

use super::{shard_state, unavailable, within, Node, Refused};
use crate::store::Outcome;

/// The flow of `client_id`'s QoS 2 PUBLISH `packet_id`, when the session
/// is persistent (`session_expiry` above 0) in cluster mode.
pub(crate) fn flow(clustered: bool, session_expiry: u32, client_id: &str, packet_id: u16) -> Option<Box<Qos2Flow>> {
    (clustered && session_expiry > 0).then(|| Box::new(Qos2Flow { client_id: client_id.to_owned(), packet_id, message_id: None }))
}

/// Delete `flow` (its PUBREL came), the acknowledgement of the packet
/// being handled (the PUBCOMP) waiting for it through a
/// [`Write`](crate::store::Write) of `store`; `origin` is the client's
/// key. Not deleted in time, or the bridge's queue full: refused (the
/// connection closes, see the module documentation).
pub(crate) fn release(flow: Box<Qos2Flow>, store: &crate::store::ShardStore, origin: u64) {
    let Some(node) = shard_state(|sc| sc.node.borrow().clone()) else { return };
    let (reply, outcome) = tokio::sync::oneshot::channel();
    let write = store.expect_write(origin);
    let sent = node.bridge.send(Request::Qos2Release { flow, wait: node.append_wait, reply }).is_ok();
    glommio::spawn_local(async move {
        // The shard's state is borrowed until the caller is done.
        futures_lite::future::yield_now().await;
        let outcome = match sent {
            true => match outcome.await {
                Ok(Ok(())) => Outcome::Done,
                Ok(Err(e)) => {
                    debug!(target: "cluster", error = %e, "cluster: an inbound QoS 2 flow not released in time");
                    Outcome::Refused(ReasonCode::UNSPECIFIED_ERROR)
                }
                Err(_) => Outcome::Refused(ReasonCode::UNSPECIFIED_ERROR),
            },
            false => Outcome::Refused(ReasonCode::UNSPECIFIED_ERROR),
        };
        write.resolve(outcome);
    })
    .detach();
}

/// Remove every flow of `client_id`: its session ended (nobody waits).
pub(crate) fn purge(client_id: &str) {
    let Some(node) = shard_state(|sc| sc.node.borrow().clone()) else { return };
    if node.bridge.send(Request::Qos2Purge { client_id: client_id.to_owned() }).is_err() {
        debug!(target: "cluster", client_id, "cluster: QoS 2 flows not purged: the bridge's queue is full");
    }
}

impl Node {
    /// The packet identifiers of the open inbound QoS 2 flows of
    /// `client_id`'s session (taken up from another replica), each with
    /// the message ID of its value (empty: nothing to append), read
    /// within `budget`.
    ///
    /// # Errors
    /// JetStream did not answer within `budget`.
    pub(super) async fn qos2_of(&self, client_id: &str, budget: Duration) -> Result<Vec<(u16, String)>, Refused> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        if self.bridge.send(Request::Qos2List { client_id: client_id.to_owned(), reply }).is_err() {
            return Err(unavailable("cluster bridge queue full"));
        }
        match within(budget, answer).await {
            Some(Ok(Ok(open))) => Ok(open),
            Some(_) => Err(unavailable("cluster store unavailable")),
            None => Err(unavailable("connect budget exceeded")),
        }
    }
}
