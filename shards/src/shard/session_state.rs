//! Persistent sessions in `mqtt-session-state` (cluster mode; DESIGN.md
//! §4, §6; issue 24): the shard writes each change of a persistent
//! session's record (its connection attached or ended, a subscription
//! added or removed) and deletes it when the session ends here, and takes
//! a session up from its record when its client comes back here after it
//! was served by another replica.
//!
//! The SUBACK or UNSUBACK of a change waits for the record the way it
//! waits for its route (see [`super::wanted`], at most its 2 s); the
//! CONNACK does not wait (a session with no subscription owes nothing
//! yet). The values a session is owed while it is away are not in the
//! record (the session log, issue 24's other part).
//!
//! [`Saved`] keeps one shard from writing over another replica's newer
//! record: a session whose client another replica claimed since is
//! `MovedAway` and is never written again here; it goes once its
//! connection (if any) has closed.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use bytestring::ByteString;
use fleetmq_core::cluster::sessions::SessionRecord;
use fleetmq_core::packet::ReasonCode;
use fleetmq_core::store::Record;
use fleetmq_core::topic::parse_shared;


use super::wanted::RouteWait;
use super::{Shard, Slot, State, Subscriber};

/// Whether a session's record is in `mqtt-session-state` as this shard
/// knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) enum Saved {
    /// Not written (not persistent, alone, or not yet).
    #[default]
    No,
    /// Written (or on its way): deleted when the session ends here.
    Yes,
    /// Another replica claimed the client since: the record is that
    /// replica's now; nothing is written here any more, and the session
    /// goes once its connection has closed.
    MovedAway,
}

impl Shard {
    /// Write the record of the session on `slot` as it is now, if it is
    /// persistent (cluster mode). With `waits`, the acknowledgement of the
    /// packet being handled waits for it (pushed as a route wait).
    pub(super) fn save_session(&self, st: &mut State, slot: Slot, waits: Option<&mut Vec<RouteWait>>) {
        if !self.store.clustered() {
            return;
        }
        let client = &mut st.clients[slot as usize];
        if client.saved == Saved::MovedAway {
            return;
        }
        let expiry = client.session.session_expiry();
        if expiry == 0 {
            // Ends with its connection: the record goes then (remove_client).
            return;
        }
        client.saved = Saved::Yes;
        let offline_since_ms =
            client.offline_since.map(|since| crate::store::unix_ms().saturating_sub(since.elapsed().as_millis() as u64));
        let session = &client.session;
        let qos = session.subscriptions().iter().map(|(f, s)| (&**f, s.options.qos as u8));
        crate::cluster::set_interest(session.client_id(), Some(fleetmq_core::cluster::session_log::logged_filters(qos)));
        let subscriptions = session.subscriptions().iter().map(|(f, s)| (&**f, s));
        let make = |replica: &str| {
            SessionRecord::new(
                session.client_id(),
                client.owner.0.as_deref(),
                &client.owner.1,
                session.protocol().level(),
                expiry,
                replica,
                offline_since_ms,
                subscriptions,
            )
        };
        let (landed, answer) = tokio::sync::oneshot::channel();
        let sent = crate::cluster::save_session(session.client_id(), Some(make), waits.is_some().then_some(landed));
        if let (true, Some(waits)) = (sent, waits) {
            waits.push(super::wanted::RouteWait::Saved(answer));
        }
    }

    /// The session on `slot` ends here: its record goes too, if this shard
    /// wrote one.
    pub(super) fn session_ended(&self, st: &mut State, slot: Slot) {
        let client = &mut st.clients[slot as usize];
        if client.saved == Saved::Yes {
            client.saved = Saved::No;
            crate::cluster::set_interest(client.session.client_id(), None);
            crate::cluster::save_session(client.session.client_id(), None::<fn(&str) -> SessionRecord>, None);
            crate::cluster::purge_qos2(client.session.client_id());
        }
    }

    /// Another replica claimed `client_id` (at a revision later than any
    /// connection's here): its session here is that replica's now (taken
    /// up from the record, or ended with Clean Start). It is never written
    /// here again, and goes now when offline, else once its connection
    /// (asked to close) has ended.
    pub(crate) fn moved_away(&self, client_id: &str) {
        let mut guard = self.state.borrow_mut();
        let st = &mut *guard;
        let Some(slot) = st.by_id.get(&st.clients, client_id) else { return };
        let client = &mut st.clients[slot as usize];
        client.saved = Saved::MovedAway;
        // Its cursor is that replica's too: never written here again.
        self.reader_ended(st, slot, true);
        let client = &mut st.clients[slot as usize];
        if client.conn.is_none() && client.pending_will.is_none() {
            self.remove_client(st, slot);
        }
    }

    /// Whether `client_id`'s session lives on this shard (or would): its
    /// home shard, and not moved to another one (see [`super::placement`]).
    pub(crate) fn holds_home(&self, client_id: &str) -> bool {
        let st = self.state.borrow();
        st.by_id.get(&st.clients, client_id).is_some()
            || (super::owner_of(client_id, self.shards) == self.id && !st.moved.contains_key(client_id))
    }

    /// Take up the session of `record` (read from `mqtt-session-state`: its
    /// client was served by another replica since this shard last saw it)
    /// before its CONNECT (Clean Start 0) attaches: a session of that
    /// client here is older and is replaced, its connection (if one is
    /// still attached) taken over. The session is restored offline with the
    /// record's subscriptions; the attach finds it (CONNACK Session Present
    /// 1, `[MQTT-3.2.2-2]`) and checks its identity.
    ///
    /// `own`: this replica wrote the record (an earlier process of it,
    /// before a restart): a session of the client here, restored from the
    /// local store with the values it was owed, is at least as new and is
    /// kept.
    ///
    /// Returns the routes its subscriptions need written (and announced
    /// over the mesh): the CONNACK waits for them, as a SUBACK does, so
    /// a value published on another replica once the client holds its
    /// CONNACK reaches it.
    ///
    /// `resume`: its cursor, read with the record: the session reads its
    /// log from there, and the deliveries it lists as unacknowledged are
    /// sent again with DUP (or PUBREL) by the attach `[MQTT-4.4.0-1]`.
    /// `inbound_qos2`: the packet identifiers of its open inbound QoS 2
    /// flows (`mqtt-session-qos2`), open in the session again, each with
    /// its value's message ID: the first PUBLISH of one its client sends
    /// again is appended again under that ID (stored once whether or not
    /// the replica it left stored it), later ones get PUBREC and are not
    /// forwarded `[MQTT-4.3.3-10]` (see `Shard::handle_packet`).
    pub(crate) fn take_up(
        &self,
        record: &SessionRecord,
        own: bool,
        resume: Option<&super::Resume>,
        inbound_qos2: &[(u16, String)],
        now: Instant,
    ) -> super::wanted::RouteWaits {
        let mut waits = Vec::new();
        let Some(subscriptions) = record.restored_subscriptions() else { return super::wanted::RouteWaits(waits) };
        let mut guard = self.state.borrow_mut();
        let st = &mut *guard;
        if let Some(slot) = st.by_id.get(&st.clients, &record.client_id) {
            if own {
                return super::wanted::RouteWaits(waits);
            }
            st.clients[slot as usize].saved = Saved::MovedAway;
            if let Some(old) = st.clients[slot as usize].conn.take() {
                old.request_close(Some(ReasonCode::SESSION_TAKEN_OVER), false);
                self.connection_ended(st, slot, true, now);
            }
            // Still here (offline, kept): replaced by the record's.
            if let Some(slot) = st.by_id.get(&st.clients, &record.client_id) {
                st.clients[slot as usize].pending_will = None;
                self.remove_client(st, slot);
            }
        }
        let client_id = ByteString::from(record.client_id.as_str());
        let mut session = self.offline_session(&client_id, record.protocol, record.expiry_s, &record.workspace);
        let durable = self.store.is_durable();
        if durable {
            // The local store keeps it too, subscriptions after the session.
            self.store.log(Record::Session {
                client_id: client_id.clone(),
                username: record.username.as_deref().map(ByteString::from),
                workspace: ByteString::from(record.workspace.as_str()),
                expiry: record.expiry_s,
                protocol: record.protocol,
            });
            for (filter, subscription) in &subscriptions {
                self.store.log_subscription(&client_id, filter, Some(*subscription));
            }
        }
        session.set_logged(durable);
        let key = fleetmq_core::session::client_key(&client_id);
        let sent = match resume.filter(|_| self.reads_logs()) {
            Some(resume) => Self::resumed_deliveries(resume, key, &subscriptions),
            None => Vec::new(),
        };
        session.restore(subscriptions.clone(), inbound_qos2.iter().map(|(id, _)| *id), sent, Vec::new());
        let owner = (record.username.as_deref().map(Arc::from), Arc::from(record.workspace.as_str()));
        let slot = self.insert_client(st, session, owner);
        let client = &mut st.clients[slot as usize];
        client.saved = Saved::Yes;
        client.offline_since = Some(now);
        let reopened: std::collections::HashMap<u16, Box<str>> =
            inbound_qos2.iter().filter(|(_, id)| !id.is_empty()).map(|(pid, id)| (*pid, Box::from(id.as_str()))).collect();
        client.reopened = (!reopened.is_empty()).then(|| Box::new(reopened));
        if let Some(resume) = resume.filter(|_| self.reads_logs()) {
            let workspace = client.owner.1.clone();
            let mode = super::session_log::Mode::Offline;
            client.log = Some(super::session_log::Reader::new(workspace, Some(resume.position), mode));
        }
        self.global.offline_sessions.fetch_add(1, Ordering::Relaxed);
        let client_id = st.clients[slot as usize].session.client_id().clone();
        for (filter, subscription) in subscriptions {
            self.want_route(st, &filter, true, &mut waits);
            if parse_shared(&filter).is_some() {
                // A member again here, offline until its CONNACK (the
                // attach turns it online: `shared_presence`).
                let member = fleetmq_core::shared::Member { client_id: client_id.clone(), shard: self.id, subscription, online: false };
                self.group_op(st, super::groups::GroupOp::Join { key: filter, member }, now);
                continue;
            }
            if !st.trie.has_filter(&filter) {
                self.route_change(st, &filter, true);
            }
            st.trie.insert(&filter, Subscriber::Session(slot), subscription);
        }
        drop(guard);
        self.try_flush();
        super::wanted::RouteWaits(waits)
    }
}
