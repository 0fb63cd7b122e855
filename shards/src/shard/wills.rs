//! Wills on a single node (MQTT 5 §3.1.2.5, §3.1.3.2.2): kept with the
//! connection, pending through their Will Delay Interval once it ends
//! abnormally, published or discarded. With the local store each step is
//! logged (see [`crate::store`]), so the wills of connections open at a
//! crash are sent at restart, after their delay, unless the client is back
//! first: [`Record::Will`] before the CONNACK, [`Record::WillDue`] when the
//! delay starts, [`Record::WillEnd`] when the will is discarded or after it
//! was published.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytestring::ByteString;
use fleetmq_core::packet::Will;
use fleetmq_core::session::timing::will_due_at;
use fleetmq_core::session::Message;
use fleetmq_core::store::{Record, RecoveredWill, StoredMessage};

use super::{Shard, Slot, State};

impl Shard {
    /// Log the will of the connection just attached on `slot`, if it has
    /// one (before its CONNACK, which waits for the store).
    pub(super) fn log_will(&self, st: &State, slot: Slot) {
        let client = &st.clients[slot as usize];
        let Some(will) = client.will.as_deref() else {
            return;
        };
        if !self.store.is_durable() {
            return;
        }
        let message = StoredMessage {
            topic: will.topic.clone(),
            payload: will.payload.clone(),
            qos: will.qos,
            retain: will.retain,
            properties: will.properties.clone(),
            received_ms: crate::store::unix_ms(),
            origin: u64::MAX,
        };
        let delay = will.properties.will_delay_interval.unwrap_or(0);
        let expiry = client.session.session_expiry();
        self.store.log(Record::Will {
            client_id: client.session.client_id().clone(),
            message,
            delay,
            expiry,
        });
    }

    /// The client on `slot` is back within its will's delay: the will is
    /// not sent `[MQTT-3.1.3-9]`.
    pub(super) fn client_back_within_will_delay(&self, st: &mut State, slot: Slot) {
        let client = &mut st.clients[slot as usize];
        if client.pending_will.take().is_some() {
            self.store.log(Record::WillEnd {
                client_id: client.session.client_id().clone(),
            });
        }
    }

    /// The connection on `slot` ended (`publish_will`: abnormally, or with
    /// DISCONNECT 0x04): its will is discarded `[MQTT-3.14.4-3]`, waits
    /// for its delay (capped by the Session Expiry Interval), or is
    /// returned to publish now.
    pub(super) fn will_at_end(
        &self,
        st: &mut State,
        slot: Slot,
        publish_will: bool,
        now: Instant,
    ) -> Option<Will> {
        let client = &mut st.clients[slot as usize];
        let will = client.will.take()?;
        let client_id = client.session.client_id().clone();
        if !publish_will {
            self.store.log(Record::WillEnd { client_id });
            return None;
        }
        let delay = will.properties.will_delay_interval.unwrap_or(0);
        let due = will_due_at(now, delay, client.session.session_expiry());
        if due <= now {
            return Some(*will);
        }
        let due_ms = crate::store::unix_ms()
            .saturating_add(due.saturating_duration_since(now).as_millis() as u64);
        self.store.log(Record::WillDue { client_id, due_ms });
        client.pending_will = Some(Box::new((due, *will)));
        None
    }

    /// Publish the will of `client_id` (its delay ran out, or its session
    /// ended) and log that it is gone (`None`: a will the cluster kept).
    pub(super) fn publish_will(
        &self,
        st: &mut State,
        client_id: Option<&ByteString>,
        will: Will,
        now: Instant,
    ) {
        let mut properties = will.properties;
        properties.will_delay_interval = None;
        let mut message = Message {
            topic: will.topic,
            payload: will.payload,
            qos: will.qos,
            retain: will.retain,
            properties,
            received_at: now,
            origin: u64::MAX,
            stored: 0,
            from_mesh: false,
            groups: fleetmq_core::session::GroupPick::ALL,
        };
        self.store.log_value(&mut message, now);
        if let Some(client_id) = client_id {
            self.store.log(Record::WillEnd {
                client_id: client_id.clone(),
            });
        }
        self.route(st, Arc::new(message), now);
    }

    /// Take the wills the store recovered for client identifiers this shard
    /// owns: a restored session holds its will until it is due; a will due
    /// already (no delay, or its session ended, which ends the delay) is
    /// published at the first tick.
    pub(super) fn restore_wills(
        &self,
        st: &mut State,
        wills: &[(&ByteString, &RecoveredWill)],
        now: Instant,
        now_ms: u64,
    ) {
        for (client_id, w) in wills {
            let m = &w.message;
            let will = Will {
                topic: m.topic.clone(),
                payload: m.payload.clone(),
                qos: m.qos,
                retain: m.retain,
                properties: m.properties.clone(),
            };
            let due_ms = w.due_ms.unwrap_or(now_ms);
            // Its due time is logged, so that another restart keeps it.
            self.store.log(Record::WillDue { client_id: (*client_id).clone(), due_ms });
            let wait = Duration::from_millis(due_ms.saturating_sub(now_ms));
            // Due already (no delay left, or no session): sent whoever
            // connects; else held by its session until due, unless the
            // client is back first.
            match st
                .by_id
                .get(&st.clients, client_id)
                .filter(|_| !wait.is_zero())
            {
                Some(slot) => {
                    st.clients[slot as usize].pending_will = Some(Box::new((now + wait, will)))
                }
                None => st.restored_wills.push(((*client_id).clone(), will)),
            }
        }
    }
}
