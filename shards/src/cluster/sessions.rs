//! A shard's side of `mqtt-session-state` in the node (DESIGN.md §4;
//! issue 24): the read of a session another replica served, at CONNECT,
//! and the writes of this replica's persistent sessions' records (see
//! `crate::shard::session_state` for when they are made).

use std::time::Duration;

use fleetmq_core::cluster::records::Record as _;
use fleetmq_core::cluster::sessions::SessionRecord;
use fleetmq_nats_bridge::Request;
use tracing::{debug, warn};

use super::{shard_state, unavailable, within, Claim, Node, Refused};

impl Node {
    /// `client_id`'s session in `mqtt-session-state`, if it has one that
    /// has not expired (an expired one is deleted). A record this build
    /// cannot read is logged and left: the client starts a new session.
    ///
    /// # Errors
    /// The refusal: JetStream did not answer within `budget`.
    pub(super) async fn session_to_take_up(&self, client_id: &str, budget: Duration) -> Result<Option<Box<SessionRecord>>, Refused> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        if self.bridge.send(Request::SessionGet { client_id: client_id.to_owned(), reply }).is_err() {
            return Err(unavailable("cluster bridge queue full"));
        }
        let bytes = match within(budget, answer).await {
            Some(Ok(Ok(bytes))) => bytes,
            Some(Ok(Err(_))) | Some(Err(_)) => return Err(unavailable("cluster store unavailable")),
            None => return Err(unavailable("connect budget exceeded")),
        };
        let Some(bytes) = bytes else { return Ok(None) };
        match SessionRecord::decode(&bytes) {
            Ok(record) if record.client_id != client_id || !record.protocol_known() => {
                warn!(target: "cluster", client_id, "cluster: a session record of another client or protocol under this key; not taken up");
                Ok(None)
            }
            Ok(record) if record.expired(crate::store::unix_ms()) => {
                save_session(client_id, None::<fn(&str) -> SessionRecord>, None);
                Ok(None)
            }
            Ok(record) => {
                debug!(target: "cluster", client_id, from = %record.replica, "cluster: persistent session taken up from another replica");
                Ok(Some(Box::new(record)))
            }
            Err(e) => {
                warn!(target: "cluster", client_id, error = %e, "cluster: session record not readable; the client starts a new session");
                Ok(None)
            }
        }
    }
}

/// Write `client_id`'s persistent session record, made by `make` (given
/// this replica's ID), to `mqtt-session-state`, or delete it (`None`);
/// `landed` hears `true` once it is in the bucket. False when not sent
/// (alone, the shard's cluster task not started yet, or the bridge's
/// queue full: counted in `fleetmq_bridge_queue_full_total`).
pub(crate) fn save_session<F: FnOnce(&str) -> SessionRecord>(
    client_id: &str,
    make: Option<F>,
    landed: Option<tokio::sync::oneshot::Sender<bool>>,
) -> bool {
    let Some(node) = shard_state(|sc| sc.node.borrow().clone()) else { return false };
    let record = make.map(|make| {
        let mut record = make(&node.replica_id);
        record.format = node.status().write_format();
        record.instance = Some(node.status().instance.clone());
        bytes::Bytes::from(record.encode())
    });
    let request = Request::SessionPut { client_id: client_id.to_owned(), record, landed };
    let sent = node.bridge.send(request);
    if sent.is_err() {
        debug!(target: "cluster", client_id, "cluster: session record not sent: the bridge's queue is full");
    }
    sent.is_ok()
}

/// What this replica's persistent session `client_id` wants from the
/// session log now (`Some`: the filters of its QoS 1/2 subscriptions, see
/// [`fleetmq_core::cluster::session_log::logged_filters`]), or that it
/// ended here (`None`): set at once in the replica's
/// [`Interest`](fleetmq_core::cluster::session_log::Interest), so that a
/// value published here after the SUBACK is logged. Nothing alone.
pub(crate) fn set_interest(client_id: &str, filters: Option<Vec<bytestring::ByteString>>) {
    let Some(node) = shard_state(|sc| sc.node.borrow().clone()) else { return };
    let Ok(mut interest) = node.bridge.interest().write() else { return };
    let key = fleetmq_core::cluster::session_log::interest_key(client_id);
    match filters {
        Some(filters) => interest.set(key, filters, true),
        None => interest.remove(key, true),
    }
}

impl Claim {
    /// Whether this replica wrote `record` (an earlier process of it).
    pub(crate) fn is_own(&self, record: &SessionRecord) -> bool {
        record.replica == self.node.replica_id
    }
}
