//! The node's side of the session logs (issue 24; see
//! `crate::shard::session_log` for how sessions read them): the cursor's
//! writes and its read at a take-up, with the values it lists as sent and
//! not acknowledged.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use fleetmq_core::cluster::cursor::CursorRecord;
use fleetmq_core::cluster::records::Record as _;
use fleetmq_nats_bridge::Request;
use tracing::{debug, warn};

use super::{shard_state, unavailable, within, Node, Refused};
use crate::shard::{Resume, Shard};

/// This shard's node (cluster mode, once its event task started).
pub(crate) fn node() -> Option<Arc<Node>> {
    shard_state(|sc| sc.node.borrow().clone())
}

/// This shard (once its event task started).
pub(crate) fn shard_weak() -> Option<std::rc::Weak<Shard>> {
    shard_state(|sc| sc.shard.borrow().clone())
}

/// Count `n` values a session had not read when its log dropped them
/// (`fleetmq_session_log_values_missed_total`).
pub(crate) fn count_missed(n: u64) {
    if let Some(node) = node() {
        node.status().stats.log_missed.fetch_add(n, Ordering::Relaxed);
    }
}

/// Write `client_id`'s cursor (`record`: a [`CursorRecord`] encoded), or
/// delete it (`None`), through the bridge's writer (one write in flight
/// per session, the newest next). `landed` hears `true` once it (or a
/// newer one) is in `mqtt-session-cursor`; it is dropped unanswered when
/// the bridge's queue is full.
pub(crate) fn save_cursor(client_id: &str, record: Option<bytes::Bytes>, landed: Option<tokio::sync::oneshot::Sender<bool>>) {
    let Some(node) = node() else { return };
    if node.bridge.send(Request::CursorPut { client_id: client_id.to_owned(), record, landed }).is_err() {
        debug!(target: "cluster", client_id, "cluster: cursor not sent: the bridge's queue is full");
    }
}

impl Node {
    /// Send `request` to the bridge.
    ///
    /// # Errors
    /// The bridge's queue is full: the request is handed back.
    pub(crate) fn bridge_send(&self, request: Request) -> Result<(), Request> {
        self.bridge.send(request)
    }

    /// The cursor of `client_id`'s session (taken up from another replica)
    /// and the values it lists as sent and not acknowledged, read within
    /// `budget`; `None` when it has none (a session that never read its
    /// log: it starts where this replica's tail is) or one this build
    /// cannot use.
    ///
    /// # Errors
    /// JetStream did not answer within `budget`.
    pub(super) async fn resume_of(&self, client_id: &str, budget: Duration) -> Result<Option<Box<Resume>>, Refused> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        if self.bridge.send(Request::CursorGet { client_id: client_id.to_owned(), reply }).is_err() {
            return Err(unavailable("cluster bridge queue full"));
        }
        let bytes = match within(budget, answer).await {
            Some(Ok(Ok(bytes))) => bytes,
            Some(_) => return Err(unavailable("cluster store unavailable")),
            None => return Err(unavailable("connect budget exceeded")),
        };
        let Some(bytes) = bytes else { return Ok(None) };
        let cursor = match CursorRecord::decode(&bytes) {
            Ok(c) if c.client_id == client_id && c.valid() => c,
            Ok(_) => {
                warn!(target: "cluster", client_id, "cluster: a cursor of another client, or out of range, under this key; not used");
                return Ok(None);
            }
            Err(e) => {
                warn!(target: "cluster", client_id, error = %e, "cluster: cursor not readable; not used");
                return Ok(None);
            }
        };
        let mut sent = Vec::with_capacity(cursor.unacked.len());
        for unacked in &cursor.unacked {
            let (reply, answer) = tokio::sync::oneshot::channel();
            let request = Request::LogRead { workspace: cursor.workspace.clone(), from: unacked.seq, max: 1, reply };
            if self.bridge.send(request).is_err() {
                return Err(unavailable("cluster bridge queue full"));
            }
            let batch = match within(budget, answer).await {
                Some(Ok(Ok(batch))) => batch,
                Some(_) => return Err(unavailable("cluster store unavailable")),
                None => return Err(unavailable("connect budget exceeded")),
            };
            let message = batch.values.into_iter().find(|e| e.seq == unacked.seq).map(|e| e.message);
            sent.push((*unacked, message));
        }
        debug!(target: "cluster", client_id, position = cursor.position, unacked = sent.len(), "cluster: cursor read");
        Ok(Some(Box::new(Resume { position: cursor.position, sent })))
    }
}
