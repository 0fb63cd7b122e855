//! What a shard takes from the local store at start (see
//! [`crate::store`]): every retained message (each shard keeps a copy),
//! and the persistent sessions whose client identifiers it owns, offline,
//! with their subscriptions, inbound QoS 2 identifiers and the values they
//! still have to deliver, in log order (those already sent with their
//! packet identifiers), and the wills of those client identifiers.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytestring::ByteString;
use fleetmq_core::packet::{ConnAck, PacketId, ProtocolVersion};
use fleetmq_core::session::{workspace_namespace, Delivery, Message, Negotiated, Session};
use fleetmq_core::store::{Recovered, RecoveredSession, StoredMessage};
use fleetmq_core::topic::{matches, parse_shared};

use super::{owner_of, Shard, State, Subscriber};

/// `m` (log sequence `lsn`) as the broker routes it; its Message Expiry
/// Interval keeps counting from when it was received, in wall-clock time.
fn message(lsn: u64, m: &StoredMessage, now: Instant, now_ms: u64) -> Arc<Message> {
    let age = Duration::from_millis(now_ms.saturating_sub(m.received_ms));
    Arc::new(Message {
        topic: m.topic.clone(),
        payload: m.payload.clone(),
        qos: m.qos,
        retain: m.retain,
        properties: m.properties.clone(),
        received_at: now.checked_sub(age).unwrap_or(now),
        origin: m.origin,
        stored: lsn,
        from_mesh: false,
        groups: fleetmq_core::session::GroupPick::ALL,
    })
}

impl Shard {
    /// Take what the local store recovered: every retained message, and
    /// the sessions this shard owns. Called once, before connections.
    pub(crate) fn restore(&self, recovered: &Recovered, now_ms: u64) {
        let now = Instant::now();
        let mut st = self.state.borrow_mut();
        let st = &mut *st;
        for (lsn, m) in recovered.retained.values() {
            let seq = self.global.retain_seq.fetch_add(1, Ordering::Relaxed);
            st.retained.apply(seq, message(*lsn, m, now, now_ms), now);
        }
        let mut values = HashMap::new();
        for (client_id, rs) in &recovered.sessions {
            if owner_of(client_id, self.shards) == self.id {
                let deliveries = rs.pending.iter().filter_map(|(lsn, qos)| {
                    let m = values.entry(*lsn).or_insert_with(|| recovered.values.get(lsn).map(|m| message(*lsn, m, now, now_ms)));
                    let message = m.clone()?;
                    let subscription_ids = rs
                        .subscriptions
                        .iter()
                        .filter(|(f, _)| parse_shared(f).is_none() && matches(f, &message.topic))
                        .filter_map(|(_, s)| s.identifier)
                        .collect();
                    Some((*lsn, Delivery { message, qos: *qos, retain: false, subscription_ids, group: None }))
                });
                let (mut sent, mut queue) = (Vec::new(), Vec::new());
                for (lsn, delivery) in deliveries {
                    match rs.sent.get(&lsn).and_then(|&(pid, released)| Some((PacketId::new(pid)?, released))) {
                        Some((packet_id, released)) => sent.push((delivery, packet_id, released)),
                        None => queue.push(delivery),
                    }
                }
                self.restore_session(st, client_id, rs, (sent, queue), now, now_ms);
            }
        }
        let wills: Vec<_> = recovered.wills.iter().filter(|(id, _)| owner_of(id, self.shards) == self.id).collect();
        self.restore_wills(st, &wills, now, now_ms);
    }

    /// A session of `client_id` with no connection, as stored: protocol
    /// level 3, 4 or 5, Session Expiry Interval `expiry` (seconds), in
    /// `workspace`. Its connection's figures come with its next CONNECT.
    pub(super) fn offline_session(&self, client_id: &ByteString, protocol: u8, expiry: u32, workspace: &str) -> Session {
        let protocol = match protocol {
            3 => ProtocolVersion::V3_1,
            4 => ProtocolVersion::V3_1_1,
            _ => ProtocolVersion::V5,
        };
        let negotiated = Negotiated {
            client_id: client_id.clone(),
            keep_alive: 0,
            session_expiry: expiry,
            client_receive_maximum: u16::MAX,
            client_max_packet_size: usize::MAX,
            client_topic_alias_maximum: 0,
            connack: ConnAck::default(),
        };
        let mut session = Session::new(protocol, &negotiated, self.limits.session.clone());
        session.set_namespace(workspace_namespace(workspace));
        session
    }

    fn restore_session(
        &self,
        st: &mut State,
        client_id: &ByteString,
        rs: &RecoveredSession,
        (sent, queue): (Vec<(Delivery, PacketId, bool)>, Vec<Delivery>),
        now: Instant,
        now_ms: u64,
    ) {
        let mut session = self.offline_session(client_id, rs.protocol, rs.expiry, &rs.workspace);
        session.set_logged(true);
        let subscriptions: HashMap<_, _> =
            rs.subscriptions.iter().filter(|(f, _)| parse_shared(f).is_none()).map(|(f, s)| (f.clone(), *s)).collect();
        session.restore(subscriptions.clone(), rs.inbound_qos2.iter().copied(), sent, queue);
        let owner = (rs.username.as_deref().map(Arc::from), Arc::from(&*rs.workspace));
        let slot = self.insert_client(st, session, owner);
        let offline_for = Duration::from_millis(rs.offline_since_ms.map_or(0, |since| now_ms.saturating_sub(since)));
        st.clients[slot as usize].offline_since = Some(now.checked_sub(offline_for).unwrap_or(now));
        self.global.offline_sessions.fetch_add(1, Ordering::Relaxed);
        for (filter, subscription) in subscriptions {
            if self.store.clustered() {
                // Told to the bridge once the shard's cluster task runs.
                self.want_route(st, &filter, true, &mut Vec::new());
            }
            if !st.trie.has_filter(&filter) {
                self.route_change(st, &filter, true);
            }
            st.trie.insert(&filter, Subscriber::Session(slot), subscription);
        }
    }
}
