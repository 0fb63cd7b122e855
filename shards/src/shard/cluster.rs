//! What the cluster asks of a shard (DESIGN.md §5): close every
//! connection when the replica fences, close one whose client identifier
//! another replica took over.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use fleetmq_core::packet::ReasonCode;
use fleetmq_core::session::Message;

use super::inbox::Control;
use crate::cluster::Retained;
use super::held::Delivery;
use super::{Shard, State};

impl Shard {
    /// Keep `message` (RETAIN set) as its topic's retained message: in
    /// cluster mode it is written to `mqtt-retained` and applied when the
    /// bucket's watch brings it back, on every replica in revision order
    /// ([`Shard::apply_retained`]; its acknowledgement waits for the
    /// bucket: [`crate::cluster::publish_retained`]); alone, it is applied
    /// here and sent to the other shards now. When live subscribers get
    /// it: [`Delivery`] (see [`super::held`]).
    pub(super) fn keep_retained(&self, st: &mut State, message: &Arc<Message>, now: Instant) -> Delivery {
        let previous = || st.retained.get(&message.topic);
        let write = st.held.next_write();
        match crate::cluster::publish_retained(message, previous, &self.store, write) {
            Retained::Held => return Delivery::After(write),
            Retained::Refused => return Delivery::Never,
            Retained::Written => return Delivery::Now,
            Retained::Local => {}
        }
        let seq = self.global.retain_seq.fetch_add(1, Ordering::Relaxed);
        st.retained.apply(seq, message.clone(), now);
        self.broadcast(Control::Retain { seq, message: message.clone() });
        Delivery::Now
    }

    /// Publish the will of a gone replica's connection (this replica is the
    /// sweeper), as a will of its own would be.
    pub(crate) fn publish_cluster_will(&self, will: fleetmq_core::packet::Will, now: Instant) {
        let mut st = self.state.borrow_mut();
        self.publish_will(&mut st, None, will, now);
        drop(st);
        self.try_flush();
    }

    /// A retained change from `mqtt-retained` at `revision` (cluster mode).
    pub(crate) fn apply_retained(&self, revision: u64, message: Arc<Message>, now: Instant) {
        self.state.borrow_mut().retained.apply(revision, message, now);
    }

    /// Other replicas' changes of `mqtt-routes`, in bucket order.
    pub(crate) fn apply_routes(&self, changes: &[fleetmq_core::cluster::peers::RouteChange]) {
        let mut st = self.state.borrow_mut();
        for change in changes {
            st.remote_routes.apply(change);
        }
        // A group's member may have just appeared elsewhere.
        self.retry_strays(&mut st, Instant::now());
    }

    /// Ask every connection of this shard to close with `reason` (MQTT 5:
    /// a DISCONNECT with it), wills not published here: the replica is
    /// fenced and hands them over to the cluster.
    pub(crate) fn close_connections(&self, reason: ReasonCode) {
        let st = self.state.borrow();
        for (_, client) in st.clients.iter() {
            if let Some(conn) = &client.conn {
                conn.request_close(Some(reason), false);
            }
        }
    }

    /// Ask the connection of `client_id`, if one is served here, to close
    /// with `reason`, its will following the usual rules as for a take-over
    /// on this replica (sent unless its delay holds it); `true` if there
    /// was one.
    pub(crate) fn close_client(&self, client_id: &str, reason: ReasonCode) -> bool {
        let st = self.state.borrow();
        let Some(slot) = st.by_id.get(&st.clients, client_id) else {
            return false;
        };
        match &st.clients[slot as usize].conn {
            Some(conn) => {
                conn.request_close(Some(reason), true);
                true
            }
            None => false,
        }
    }
}

/// Delayed wills, as the cluster hands them over (DESIGN.md §5): a will
/// waiting for its delay is in `mqtt-session-will` too, with when it is
/// due, so that the sweeper sends it if this replica goes away first.
impl Shard {
    /// When the will of `client_id`'s ended connection is due here, if one
    /// waits for its delay (None too while the state is borrowed).
    pub(crate) fn pending_will_due(&self, client_id: &str) -> Option<Instant> {
        let st = self.state.try_borrow().ok()?;
        let slot = st.by_id.get(&st.clients, client_id)?;
        st.clients[slot as usize].pending_will.as_ref().map(|p| p.0)
    }

    /// `client_id`'s client came back on another replica while its
    /// delayed will waited here: with `clean_start` that ended the session
    /// and the will is published now (MQTT 5 §3.1.2.5: "until the Will
    /// Delay Interval has passed or the Session ends, whichever happens
    /// first"); else the session goes on there and the will is forgotten
    /// `[MQTT-3.1.3-9]`.
    pub(crate) fn end_pending_will(&self, client_id: &str, clean_start: bool) {
        let mut guard = self.state.borrow_mut();
        let st = &mut *guard;
        let Some(slot) = st.by_id.get(&st.clients, client_id) else { return };
        let Some(pending) = st.clients[slot as usize].pending_will.take() else { return };
        let client_id = st.clients[slot as usize].session.client_id().clone();
        if clean_start {
            self.publish_will(st, Some(&client_id), pending.1, Instant::now());
        } else {
            self.store.log(fleetmq_core::store::Record::WillEnd { client_id });
        }
        if st.clients[slot as usize].saved == super::session_state::Saved::MovedAway && st.clients[slot as usize].conn.is_none() {
            // The session is the other replica's: nothing keeps it here now.
            self.remove_client(st, slot);
        }
        drop(guard);
        self.try_flush();
    }

    /// Forget every delayed will: the replica fenced, and they are the
    /// cluster's now (the sweeper sends them when they are due).
    pub(crate) fn hand_over_pending_wills(&self) {
        let mut st = self.state.borrow_mut();
        for (_, client) in st.clients.iter_mut() {
            client.pending_will = None;
        }
    }
}
