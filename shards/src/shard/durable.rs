//! The shard's side of the local store (see [`crate::store`]): what a
//! persistent session logs when it attaches, subscribes, goes offline and
//! ends. A session is logged while its Session Expiry Interval is above 0
//! and the store is durable; its own changes (values done, inbound QoS 2
//! identifiers) come back from core as `Output::Log`.

use std::rc::Rc;

use bytestring::ByteString;
use fleetmq_core::packet::Packet;
use fleetmq_core::session::{Output, Session, Subscription};
use fleetmq_core::store::Record;

use super::{ConnShared, Shard, Slot, State};
use crate::store::Answering;

impl Shard {
    /// Log the session on `slot` as attached (persistent, or persistent
    /// until now) and its will, and write `connack`, new or resumed
    /// session alike, held with whatever the session sends after it
    /// `[MQTT-3.2.0-1]` until the store covers them (DESIGN.md §7).
    pub(super) fn attach_logged(&self, st: &mut State, slot: Slot, conn: &Rc<ConnShared>, protocol: u8, connack: Packet) {
        if !self.store.is_durable() {
            conn.send(&connack);
            return;
        }
        let since = self.store.appended();
        let client = &mut st.clients[slot as usize];
        let expiry = client.session.session_expiry();
        if expiry > 0 || client.session.is_logged() {
            self.store.log(Record::Session {
                client_id: client.session.client_id().clone(),
                username: client.owner.0.as_deref().map(ByteString::from),
                workspace: ByteString::from(&*client.owner.1),
                expiry,
                protocol,
            });
        }
        client.session.set_logged(expiry > 0);
        self.log_will(st, slot);
        conn.send(&connack);
        self.store.hold_until_durable(conn, since);
    }

    /// Log a subscription change of the session on `slot`, if it is logged.
    pub(super) fn log_subscription(&self, st: &State, slot: Slot, filter: &ByteString, subscription: Option<Subscription>) {
        let session = &st.clients[slot as usize].session;
        if session.is_logged() {
            self.store.log_subscription(session.client_id(), filter, subscription);
        }
    }

    /// Free in their sessions the inbound QoS 2 identifiers whose MQTT 5
    /// PUBREC was refused (MQTT 5 §4.3.3),
    /// logging the release of a logged session, so that a PUBLISH reusing
    /// one is stored and forwarded as a new message. Called before a
    /// packet is handled and when a connection ends: a refusal reaches the
    /// client before it can reuse the identifier.
    pub(super) fn forget_refused_qos2(&self, st: &mut State) {
        for forgotten in self.store.take_forgotten() {
            let Answering { slot, client } = forgotten.session;
            let Some(c) = st.clients.get_mut(slot as usize).filter(|c| c.key == client) else { continue };
            let mut out = Vec::new();
            c.session.forget_inbound_qos2(forgotten.packet_id, &mut out);
            for output in out {
                if let Output::Log(change) = output {
                    self.store.log_change(c.session.client_id(), change);
                }
            }
        }
    }

    /// The logged `session` went offline (kept) or ended.
    pub(super) fn log_detached(&self, session: &Session, ended: bool) {
        if !session.is_logged() {
            return;
        }
        let client_id = session.client_id().clone();
        self.store.log(if ended {
            Record::SessionEnd { client_id }
        } else {
            Record::Offline { client_id, at_ms: crate::store::unix_ms(), expiry: session.session_expiry() }
        });
    }
}
