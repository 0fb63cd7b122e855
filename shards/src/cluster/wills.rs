//! Wills in `mqtt-session-will` as a shard keeps them (DESIGN.md §5): a
//! connection's will is stored before its CONNACK; when the connection
//! ends it is deleted, unless the will waits for its delay here, when the
//! record learns when it is due (so that the sweeper sends it if this
//! replica is gone by then), and it is deleted once this shard sent it or
//! its client came back. A fence or a stop hands every will over: the
//! records stay for the sweeper.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fleetmq_core::cluster::records::Record as _;
use fleetmq_core::cluster::wills::WillRecord;
use fleetmq_nats_bridge::Request;
use tokio::sync::oneshot;

use super::{shard_state, unavailable, within, Claim, Node, Refused};

/// A rewrite of a delayed will in flight: its client identifier, when its
/// connection ended, and the bridge's answer (the new revision).
type Rewrite = (String, Instant, oneshot::Receiver<Result<u64, String>>);

/// A shard's delayed wills in `mqtt-session-will`.
#[derive(Default)]
pub(crate) struct Delayed {
    /// Rewrites not answered yet.
    rewrites: RefCell<Vec<Rewrite>>,
    /// Client identifier → (revision of its delayed will's record, when
    /// its connection ended).
    stored: RefCell<HashMap<String, (u64, Instant)>>,
}

impl Claim {
    /// Store the connection's `will` (its topic with the workspace prefix)
    /// in `mqtt-session-will`, within `budget`, before the CONNACK;
    /// `session_expiry` is the connection's Session Expiry Interval in
    /// force (seconds); `clean_start` its CONNECT's Clean Start flag (a
    /// delayed will of another replica's connection whose session it ends
    /// is kept for the sweeper: see `Request::WillPut`).
    ///
    /// # Errors
    /// Why the will was not stored: the CONNECT is refused (0x88), and a
    /// will that lands afterwards is deleted again (no will for a refused
    /// device, DESIGN.md §6).
    pub(super) async fn store_will(
        &mut self,
        will: &fleetmq_core::packet::Will,
        identity: &crate::auth::Identity,
        (session_expiry, clean_start): (u32, bool),
        budget: Duration,
    ) -> Result<(), Refused> {
        let status = self.node.status();
        let server = (
            status.replica_id.as_str(),
            status.instance.as_str(),
            status.epoch(),
        );
        let record = WillRecord::of(
            will,
            &self.client_id,
            identity.username.as_deref(),
            &identity.workspace,
            server,
            session_expiry,
            crate::store::unix_ms(),
        );
        let record = WillRecord { format: status.write_format(), ..record };
        let (reply, mut outcome) = oneshot::channel();
        let request = Request::WillPut {
            client_id: self.client_id.clone(),
            record: record.encode().into(),
            clean_start,
            reply,
        };
        if self.node.bridge.send(request).is_err() {
            return Err(unavailable("cluster bridge queue full"));
        }
        match within(budget, &mut outcome).await {
            Some(Ok(Ok(revision))) => {
                self.will = Some(revision);
                Ok(())
            }
            Some(_) => Err(unavailable("cluster store unavailable")),
            None => {
                // From now on the bridge deletes what lands; what landed
                // just now goes with this claim.
                outcome.close();
                if let Ok(Ok(revision)) = outcome.try_recv() {
                    self.will = Some(revision);
                }
                Err(unavailable("connect budget exceeded"))
            }
        }
    }
}

/// The connection that stored `client_id`'s will at `revision` and held
/// the claim at `claimed` ended (the shard has detached it): its record is
/// deleted, unless the shard keeps the will for its delay, when the record
/// is told when it is due. A connection closed because another replica
/// claimed its client identifier since ends the delay at once: with Clean
/// Start 1 that ended the session and the will is sent now (MQTT 5
/// §3.1.2.5), else the session goes on there and it is not sent
/// `[MQTT-3.1.3-9]`, as a take-over on one replica does.
pub(super) fn connection_ended(node: &Arc<Node>, client_id: &str, (revision, claimed): (u64, u64)) {
    let shard = shard_state(|sc| sc.shard.borrow().as_ref().and_then(std::rc::Weak::upgrade));
    let taken = shard_state(|sc| sc.lost.borrow().get(client_id).filter(|(by, _, _)| *by > claimed).map(|l| l.2));
    if let (Some(shard), Some(clean_start)) = (&shard, taken) {
        shard.end_pending_will(client_id, clean_start);
    }
    let due = shard.and_then(|shard| shard.pending_will_due(client_id));
    let Some(due) = due else {
        let request = Request::WillDelete {
            client_id: client_id.to_owned(),
            revision,
        };
        let _ = node.bridge.send(request);
        return;
    };
    let left = due.saturating_duration_since(Instant::now());
    let due_at_ms = crate::store::unix_ms() + left.as_millis() as u64;
    let (reply, outcome) = oneshot::channel();
    let request = Request::WillDelayed {
        client_id: client_id.to_owned(),
        revision,
        due_at_ms,
        reply,
    };
    if node.bridge.send(request).is_ok() {
        let ended = Instant::now();
        shard_state(|sc| {
            sc.delayed
                .rewrites
                .borrow_mut()
                .push((client_id.to_owned(), ended, outcome))
        });
    }
}

/// Once a second, and at each event: delete the records of the delayed
/// wills this shard no longer holds (sent when due, or their session
/// resumed here), and cancel those whose client another replica claimed.
pub(super) fn reconcile(node: &Node, shard: &crate::shard::Shard) {
    shard_state(|sc| {
        let mut stored = sc.delayed.stored.borrow_mut();
        sc.delayed
            .rewrites
            .borrow_mut()
            .retain_mut(|(client_id, ended, outcome)| match outcome.try_recv() {
                Ok(Ok(revision)) => {
                    stored.insert(std::mem::take(client_id), (revision, *ended));
                    false
                }
                Err(oneshot::error::TryRecvError::Empty) => true,
                _ => false,
            });
        if stored.is_empty() {
            return;
        }
        let lost = sc.lost.borrow();
        stored.retain(|client_id, (revision, ended)| {
            // Back on another replica since: with Clean Start 1 the
            // session ended and the will goes now, else it is not sent (as
            // for the sweeper).
            if let Some((_, _, clean_start)) = lost.get(client_id).filter(|(_, at, _)| at >= ended) {
                shard.end_pending_will(client_id, *clean_start);
            }
            if shard.pending_will_due(client_id).is_some() {
                return true;
            }
            let request = Request::WillDelete {
                client_id: client_id.clone(),
                revision: *revision,
            };
            let _ = node.bridge.send(request);
            false
        });
    });
}

/// The replica fenced: the delayed wills are the cluster's now (their
/// records stay; the sweeper sends them when due).
pub(super) fn hand_over(shard: &crate::shard::Shard) {
    shard.hand_over_pending_wills();
    shard_state(|sc| {
        sc.delayed.rewrites.borrow_mut().clear();
        sc.delayed.stored.borrow_mut().clear();
    });
}
