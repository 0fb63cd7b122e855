//! Recovery: the broker's durable state rebuilt from the records of every
//! shard's log, applied in log sequence order.
//!
//! A value is logged once (by the shard that received it); which sessions
//! wanted it is not logged but derived here, the way the broker derived it
//! live: every persistent session whose subscriptions (as logged before
//! the value) match it gets it, at min(publish QoS, subscription QoS),
//! unless No Local excludes it `[MQTT-3.8.3-3]` or the session logged it
//! [`Record::Done`]. Shared subscriptions (`$share/...`) are not
//! recovered: their values go to the group's online members.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use bytestring::ByteString;

use super::record::{Record, StoredMessage};
use crate::packet::QoS;
use crate::session::{client_key, Subscription};
use crate::topic::{matches, parse_shared};

/// A persistent session as recovered.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecoveredSession {
    /// User name of the identity that holds it.
    pub username: Option<ByteString>,
    /// Workspace of that identity.
    pub workspace: ByteString,
    /// Session Expiry Interval, seconds.
    pub expiry: u32,
    /// Protocol level of its last connection.
    pub protocol: u8,
    /// Subscriptions by topic filter (as the broker keeps them).
    pub subscriptions: HashMap<ByteString, Subscription>,
    /// When it went offline (Unix ms); `None`: it was online at the crash,
    /// and counts as offline from the restart.
    pub offline_since_ms: Option<u64>,
    /// Values it still has to deliver (or complete), by log sequence
    /// number, oldest first, with the QoS of the delivery.
    pub pending: BTreeMap<u64, QoS>,
    /// Inbound QoS 2 packet identifiers between PUBREC and PUBREL.
    pub inbound_qos2: BTreeSet<u16>,
    /// Of the values in `pending`, those already sent: by log sequence
    /// number, the packet identifier they went out with and whether their
    /// PUBREC came back (PUBREL sent) ([`Record::Outbound`]).
    pub sent: BTreeMap<u64, (u16, bool)>,
}

/// A Will Message of a connection that was open, or whose delay was
/// running, when the broker stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecoveredWill {
    /// The message to publish.
    pub message: StoredMessage,
    /// Will Delay Interval, seconds.
    pub delay: u32,
    /// Session Expiry Interval of its connection, seconds.
    pub expiry: u32,
    /// When it is due, Unix milliseconds: logged when the connection ended
    /// before the stop; otherwise (the connection was open, so it ended
    /// with the stop) set by [`Recovered::wills_due`] to the restart plus
    /// min(Will Delay Interval, Session Expiry Interval), and to the
    /// restart itself when its session did not survive `[MQTT-3.1.3-9]`.
    pub due_ms: Option<u64>,
}

/// Everything recovered.
#[derive(Debug, Default)]
pub struct Recovered {
    /// Retained messages by topic.
    pub retained: HashMap<ByteString, (u64, Arc<StoredMessage>)>,
    /// Persistent sessions by client identifier.
    pub sessions: HashMap<ByteString, RecoveredSession>,
    /// Values some session still wants, by log sequence number.
    pub values: BTreeMap<u64, Arc<StoredMessage>>,
    /// Wills still to send, by client identifier.
    pub wills: HashMap<ByteString, RecoveredWill>,
    /// The highest log sequence number seen (the next one to hand out is
    /// one more).
    pub last_lsn: u64,
    /// Every value read so far, for [`Record::Queued`] (a snapshot's
    /// values come before its sessions); emptied by [`Recovered::finish`].
    written: HashMap<u64, Arc<StoredMessage>>,
    /// Reading a snapshot (see [`Recovered::reading_snapshot`]).
    snapshot: bool,
}

impl Recovered {
    /// The records applied from now on come from a snapshot (true) or a
    /// log (false): a snapshot's values are kept for its
    /// [`Record::Queued`] records.
    pub fn reading_snapshot(&mut self, snapshot: bool) {
        self.snapshot = snapshot;
    }

    /// Apply `record`, logged with sequence `lsn`. Records must come in
    /// increasing `lsn` order.
    pub fn apply(&mut self, lsn: u64, record: Record) {
        self.last_lsn = self.last_lsn.max(lsn);
        match record {
            Record::Header { .. } => {}
            Record::Value(message) => self.value(lsn, message),
            Record::Session { client_id, username, workspace, expiry, protocol } => {
                let s = self.sessions.entry(client_id).or_default();
                s.username = username;
                s.workspace = workspace;
                s.expiry = expiry;
                s.protocol = protocol;
                s.offline_since_ms = None;
            }
            Record::SessionEnd { client_id } => {
                self.sessions.remove(&client_id);
            }
            Record::Offline { client_id, at_ms, expiry } => {
                if let Some(s) = self.sessions.get_mut(&client_id) {
                    s.offline_since_ms = Some(at_ms);
                    s.expiry = expiry;
                }
            }
            Record::Subscribe { client_id, filter, subscription } => {
                if let Some(s) = self.sessions.get_mut(&client_id) {
                    s.subscriptions.insert(filter, subscription);
                }
            }
            Record::Unsubscribe { client_id, filter } => {
                if let Some(s) = self.sessions.get_mut(&client_id) {
                    s.subscriptions.remove(&filter);
                }
            }
            Record::Done { client_id, value } => {
                if let Some(s) = self.sessions.get_mut(&client_id) {
                    s.pending.remove(&value);
                    s.sent.remove(&value);
                }
            }
            Record::Outbound { client_id, value, packet_id, released } => {
                if let Some(s) = self.sessions.get_mut(&client_id) {
                    if s.pending.contains_key(&value) {
                        // An identifier is reused once its value is done;
                        // until then one value holds it.
                        s.sent.retain(|_, (pid, _)| *pid != packet_id);
                        s.sent.insert(value, (packet_id, released));
                    }
                }
            }
            Record::Will { client_id, message, delay, expiry } => {
                self.wills.insert(client_id, RecoveredWill { message, delay, expiry, due_ms: None });
            }
            Record::WillDue { client_id, due_ms } => {
                if let Some(w) = self.wills.get_mut(&client_id) {
                    w.due_ms = Some(due_ms);
                }
            }
            Record::WillEnd { client_id } => {
                self.wills.remove(&client_id);
            }
            Record::Queued { client_id, value, qos } => {
                if let (Some(s), Some(m)) = (self.sessions.get_mut(&client_id), self.written.get(&value)) {
                    s.pending.insert(value, qos);
                    self.values.insert(value, m.clone());
                }
            }
            Record::InboundQos2 { client_id, packet_id, open } => {
                if let Some(s) = self.sessions.get_mut(&client_id) {
                    if open {
                        s.inbound_qos2.insert(packet_id);
                    } else {
                        s.inbound_qos2.remove(&packet_id);
                    }
                }
            }
        }
    }

    fn value(&mut self, lsn: u64, message: StoredMessage) {
        let message = Arc::new(message);
        if message.retain {
            if message.payload.is_empty() {
                self.retained.remove(&message.topic);
            } else {
                self.retained.insert(message.topic.clone(), (lsn, message.clone()));
            }
        }
        if message.qos == QoS::AtMostOnce {
            return;
        }
        if self.snapshot {
            self.written.insert(lsn, message.clone());
        }
        let mut wanted = false;
        for (client_id, session) in &mut self.sessions {
            if let Some(qos) = wanted_by(client_id, &session.subscriptions, &message) {
                session.pending.insert(lsn, qos);
                wanted = true;
            }
        }
        if wanted {
            self.values.insert(lsn, message);
        }
    }

    /// Drop what is gone by `now_ms`: sessions whose Session Expiry
    /// Interval ran out while offline (counted in wall-clock time across
    /// the restart), expired values and retained messages, and values no
    /// session wants any more.
    pub fn finish(&mut self, now_ms: u64) {
        self.written = HashMap::new();
        self.snapshot = false;
        // A session online at the crash counts as offline from the restart.
        self.sessions.retain(|_, s| {
            s.expiry > 0
                && s.offline_since_ms.is_none_or(|since| since.saturating_add(u64::from(s.expiry) * 1000) > now_ms)
        });
        self.retained.retain(|_, (_, m)| !m.expired(now_ms));
        // A value whose onward delivery started is not expired for that
        // delivery `[MQTT-3.3.2-5]`, `[MQTT-4.3.3-7]`.
        let started: BTreeSet<u64> = self.sessions.values().flat_map(|s| s.sent.keys().copied()).collect();
        self.values.retain(|lsn, m| started.contains(lsn) || !m.expired(now_ms));
        let values = &self.values;
        let mut live = BTreeSet::new();
        for s in self.sessions.values_mut() {
            s.pending.retain(|lsn, _| values.contains_key(lsn) && (!values[lsn].expired(now_ms) || s.sent.contains_key(lsn)));
            let pending = &s.pending;
            s.sent.retain(|lsn, _| pending.contains_key(lsn));
            live.extend(s.pending.keys().copied());
        }
        self.values.retain(|lsn, _| live.contains(lsn));
    }

    /// At a restart (after [`Recovered::finish`]): give every will its due
    /// time (see [`RecoveredWill::due_ms`]). Not for a compaction: the
    /// connection of a will without a due time is still open then.
    pub fn wills_due(&mut self, now_ms: u64) {
        for (client_id, will) in &mut self.wills {
            let due = match (will.due_ms, self.sessions.get(client_id)) {
                // The session ended while the broker was down: the will
                // goes now, whatever its delay.
                (_, None) => now_ms,
                (Some(due), Some(_)) => due,
                (None, Some(_)) => now_ms.saturating_add(u64::from(will.delay.min(will.expiry)) * 1000),
            };
            will.due_ms = Some(due.min(will.due_ms.unwrap_or(u64::MAX)));
        }
    }
}

impl Recovered {
    /// The records of a snapshot of this state, all at or below `cut`:
    /// every value still wanted (retained or pending) once, with its own
    /// log sequence number (which the sessions' later [`Record::Done`]
    /// records name), then each session with its subscriptions, offline
    /// time, inbound QoS 2 identifiers, [`Record::Queued`] values and the
    /// packet identifiers of those sent ([`Record::Outbound`]), then the
    /// wills, numbered `cut`. Replayed (with
    /// [`Recovered::reading_snapshot`] on), they give this state back.
    ///
    /// # Panics
    /// Debug builds, when a value's number is above `cut` (the state was
    /// built from records beyond the cut).
    pub fn snapshot(&self, cut: u64) -> Vec<(u64, Record)> {
        let mut out = Vec::new();
        let push = |out: &mut Vec<(u64, Record)>, record| out.push((cut, record));
        let retained = self.retained.values().map(|(lsn, m)| (*lsn, m));
        let mut values: Vec<(u64, &Arc<StoredMessage>)> = self.values.iter().map(|(l, m)| (*l, m)).chain(retained).collect();
        values.sort_by_key(|(lsn, _)| *lsn);
        values.dedup_by_key(|(lsn, _)| *lsn);
        for (lsn, m) in values {
            debug_assert!(lsn <= cut, "value {lsn} beyond the cut {cut}");
            out.push((lsn, Record::Value((**m).clone())));
        }
        let mut ids: Vec<&ByteString> = self.sessions.keys().collect();
        ids.sort();
        for client_id in ids {
            let s = &self.sessions[client_id];
            let client_id = client_id.clone();
            push(&mut out, Record::Session {
                client_id: client_id.clone(),
                username: s.username.clone(),
                workspace: s.workspace.clone(),
                expiry: s.expiry,
                protocol: s.protocol,
            });
            for (filter, subscription) in &s.subscriptions {
                let (filter, subscription) = (filter.clone(), *subscription);
                push(&mut out, Record::Subscribe { client_id: client_id.clone(), filter, subscription });
            }
            if let Some(at_ms) = s.offline_since_ms {
                push(&mut out, Record::Offline { client_id: client_id.clone(), at_ms, expiry: s.expiry });
            }
            for &packet_id in &s.inbound_qos2 {
                push(&mut out, Record::InboundQos2 { client_id: client_id.clone(), packet_id, open: true });
            }
            for (&value, qos) in &s.pending {
                push(&mut out, Record::Queued { client_id: client_id.clone(), value, qos: *qos });
                if let Some(&(packet_id, released)) = s.sent.get(&value) {
                    push(&mut out, Record::Outbound { client_id: client_id.clone(), value, packet_id, released });
                }
            }
        }
        let mut wills: Vec<(&ByteString, &RecoveredWill)> = self.wills.iter().collect();
        wills.sort_by_key(|(id, _)| *id);
        for (client_id, w) in wills {
            let (message, delay, expiry) = (w.message.clone(), w.delay, w.expiry);
            push(&mut out, Record::Will { client_id: client_id.clone(), message, delay, expiry });
            if let Some(due_ms) = w.due_ms {
                push(&mut out, Record::WillDue { client_id: client_id.clone(), due_ms });
            }
        }
        out
    }
}

/// The QoS at which the session `client_id` with `subscriptions` gets
/// `message`, if it wants it at QoS 1 or 2.
fn wanted_by(client_id: &str, subscriptions: &HashMap<ByteString, Subscription>, message: &StoredMessage) -> Option<QoS> {
    let mut best = None;
    for (filter, sub) in subscriptions {
        if parse_shared(filter).is_some() || !matches(filter, &message.topic) {
            continue;
        }
        if sub.options.no_local && client_key(client_id) == message.origin {
            continue;
        }
        best = best.max(Some(sub.options.qos));
    }
    best.map(|q| q.min(message.qos)).filter(|&q| q != QoS::AtMostOnce)
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;
    use crate::packet::{Props, Properties, SubscriptionOptions};

    fn session(id: &str, expiry: u32) -> Record {
        Record::Session { client_id: id.into(), username: None, workspace: "default".into(), expiry, protocol: 5 }
    }

    fn subscribe(id: &str, filter: &str, qos: QoS) -> Record {
        let options = SubscriptionOptions { qos, ..SubscriptionOptions::default() };
        Record::Subscribe { client_id: id.into(), filter: filter.into(), subscription: Subscription { options, identifier: None } }
    }

    fn value(topic: &str, qos: QoS, retain: bool, payload: &'static [u8]) -> Record {
        Record::Value(StoredMessage {
            topic: topic.into(),
            payload: Bytes::from_static(payload),
            qos,
            retain,
            properties: Props::default(),
            received_ms: 1_000,
            origin: 0,
        })
    }

    fn replay(records: Vec<Record>, now_ms: u64) -> Recovered {
        let mut r = Recovered::default();
        for (i, record) in records.into_iter().enumerate() {
            r.apply(i as u64 + 1, record);
        }
        r.finish(now_ms);
        r
    }

    #[test]
    fn a_subscribed_session_gets_later_values_it_did_not_finish_in_order() {
        let r = replay(
            vec![
                value("a/1", QoS::AtLeastOnce, false, b"before"),
                session("s", 60),
                subscribe("s", "a/+", QoS::ExactlyOnce),
                value("a/1", QoS::AtLeastOnce, false, b"one"),
                value("b/1", QoS::AtLeastOnce, false, b"other topic"),
                value("a/2", QoS::ExactlyOnce, false, b"two"),
                value("a/3", QoS::AtMostOnce, false, b"qos 0"),
                value("a/4", QoS::AtLeastOnce, false, b"four"),
                Record::Done { client_id: "s".into(), value: 6 },
            ],
            2_000,
        );
        let s = &r.sessions["s"];
        assert_eq!(s.pending.iter().map(|(l, q)| (*l, *q)).collect::<Vec<_>>(), vec![(4, QoS::AtLeastOnce), (8, QoS::AtLeastOnce)]);
        assert_eq!(r.values.keys().copied().collect::<Vec<_>>(), vec![4, 8], "values nobody wants are dropped");
        assert_eq!(r.values[&8].payload, Bytes::from_static(b"four"));
        assert_eq!(r.last_lsn, 9);
    }

    #[test]
    fn no_local_shared_and_unsubscribed_filters_want_nothing() {
        let mut no_local = SubscriptionOptions { qos: QoS::AtLeastOnce, ..SubscriptionOptions::default() };
        no_local.no_local = true;
        let mut own = value("n", QoS::AtLeastOnce, false, b"own");
        if let Record::Value(m) = &mut own {
            m.origin = client_key("s");
        }
        let r = replay(
            vec![
                session("s", 60),
                Record::Subscribe { client_id: "s".into(), filter: "n".into(), subscription: Subscription { options: no_local, identifier: None } },
                subscribe("s", "$share/g/x", QoS::AtLeastOnce),
                subscribe("s", "u", QoS::AtLeastOnce),
                Record::Unsubscribe { client_id: "s".into(), filter: "u".into() },
                own,
                value("x", QoS::AtLeastOnce, false, b"shared"),
                value("u", QoS::AtLeastOnce, false, b"unsubscribed"),
            ],
            2_000,
        );
        assert!(r.sessions["s"].pending.is_empty());
        assert!(r.values.is_empty());
    }

    #[test]
    fn sessions_expire_in_wall_clock_time_and_end_for_good() {
        let r = replay(
            vec![
                session("gone", 10),
                Record::Offline { client_id: "gone".into(), at_ms: 1_000, expiry: 10 },
                session("kept", 10),
                Record::Offline { client_id: "kept".into(), at_ms: 5_000, expiry: 10 },
                session("online", 1),
                session("ended", 100),
                Record::SessionEnd { client_id: "ended".into() },
                session("qos2", 100),
                Record::InboundQos2 { client_id: "qos2".into(), packet_id: 7, open: true },
                Record::InboundQos2 { client_id: "qos2".into(), packet_id: 8, open: true },
                Record::InboundQos2 { client_id: "qos2".into(), packet_id: 7, open: false },
            ],
            11_000,
        );
        let mut ids: Vec<&str> = r.sessions.keys().map(|k| &**k).collect();
        ids.sort();
        assert_eq!(ids, ["kept", "online", "qos2"]);
        assert_eq!(r.sessions["qos2"].inbound_qos2.iter().copied().collect::<Vec<_>>(), vec![8]);
    }

    #[test]
    fn a_snapshot_queues_values_for_the_sessions_it_names_only() {
        let mut r = Recovered::default();
        r.reading_snapshot(true);
        r.apply(1, value("a", QoS::ExactlyOnce, false, b"v"));
        r.apply(2, session("s", 60));
        r.apply(3, subscribe("s", "a", QoS::AtLeastOnce));
        r.apply(4, session("t", 60));
        r.apply(5, subscribe("t", "a", QoS::AtLeastOnce));
        r.apply(6, Record::Queued { client_id: "s".into(), value: 1, qos: QoS::ExactlyOnce });
        r.apply(7, Record::Queued { client_id: "s".into(), value: 99, qos: QoS::AtLeastOnce });
        r.reading_snapshot(false);
        r.apply(8, value("a", QoS::AtLeastOnce, false, b"w"));
        r.finish(2_000);
        assert_eq!(r.sessions["s"].pending.keys().copied().collect::<Vec<_>>(), vec![1, 8]);
        assert_eq!(r.sessions["t"].pending.keys().copied().collect::<Vec<_>>(), vec![8]);
        assert_eq!(r.sessions["s"].pending[&1], QoS::ExactlyOnce);
    }

    #[test]
    fn a_snapshot_replays_to_the_same_state() {
        let records = vec![
            value("r", QoS::AtLeastOnce, true, b"retained and queued"),
            session("s", 60),
            subscribe("s", "#", QoS::ExactlyOnce),
            value("r", QoS::AtLeastOnce, true, b"retained and queued 2"),
            value("x", QoS::ExactlyOnce, false, b"queued"),
            value("x", QoS::AtLeastOnce, false, b"done"),
            Record::Done { client_id: "s".into(), value: 6 },
            Record::InboundQos2 { client_id: "s".into(), packet_id: 3, open: true },
            Record::Offline { client_id: "s".into(), at_ms: 1_500, expiry: 60 },
            session("t", 60),
        ];
        let before = replay(records, 2_000);
        let mut after = Recovered::default();
        after.reading_snapshot(true);
        for (lsn, record) in before.snapshot(100) {
            after.apply(lsn, record);
        }
        after.reading_snapshot(false);
        after.finish(2_000);
        assert_eq!(after.sessions.len(), 2);
        assert_eq!(after.sessions["t"], before.sessions["t"]);
        let (a, b) = (&after.sessions["s"], &before.sessions["s"]);
        assert_eq!((&a.subscriptions, a.offline_since_ms, &a.inbound_qos2), (&b.subscriptions, b.offline_since_ms, &b.inbound_qos2));
        let payloads = |r: &Recovered, s: &RecoveredSession| -> Vec<(Bytes, QoS)> {
            s.pending.iter().map(|(l, q)| (r.values[l].payload.clone(), *q)).collect()
        };
        assert_eq!(payloads(&after, a), payloads(&before, b));
        assert_eq!(payloads(&after, a).len(), 2);
        assert_eq!(after.retained["r"].1, before.retained["r"].1);
    }

    fn outbound(id: &str, value: u64, packet_id: u16, released: bool) -> Record {
        Record::Outbound { client_id: id.into(), value, packet_id, released }
    }

    #[test]
    fn values_sent_keep_their_packet_identifiers_until_done_also_through_a_snapshot() {
        let mut expiring = value("a", QoS::ExactlyOnce, false, b"expired but sent");
        if let Record::Value(m) = &mut expiring {
            m.properties = Props::from(Properties { message_expiry_interval: Some(1), ..Properties::default() });
        }
        let records = vec![
            session("s", 60),
            subscribe("s", "a", QoS::ExactlyOnce),
            value("a", QoS::ExactlyOnce, false, b"released"),
            value("a", QoS::AtLeastOnce, false, b"sent"),
            value("a", QoS::ExactlyOnce, false, b"done"),
            value("a", QoS::ExactlyOnce, false, b"queued"),
            expiring,
            outbound("s", 3, 10, false),
            outbound("s", 4, 11, false),
            outbound("s", 5, 12, false),
            outbound("s", 3, 10, true),
            Record::Done { client_id: "s".into(), value: 5 },
            outbound("s", 7, 12, false),
            outbound("s", 99, 13, false),
        ];
        let before = replay(records, 5_000);
        let s = &before.sessions["s"];
        assert_eq!(s.pending.keys().copied().collect::<Vec<_>>(), vec![3, 4, 6, 7]);
        assert_eq!(s.sent.iter().map(|(l, p)| (*l, *p)).collect::<Vec<_>>(), vec![(3, (10, true)), (4, (11, false)), (7, (12, false))]);
        let mut after = Recovered::default();
        after.reading_snapshot(true);
        for (lsn, record) in before.snapshot(100) {
            after.apply(lsn, record);
        }
        after.reading_snapshot(false);
        after.finish(5_000);
        let t = &after.sessions["s"];
        let sent: Vec<(Bytes, (u16, bool))> = t.sent.iter().map(|(l, p)| (after.values[l].payload.clone(), *p)).collect();
        assert_eq!(sent, vec![
            (Bytes::from_static(b"released"), (10, true)),
            (Bytes::from_static(b"sent"), (11, false)),
            (Bytes::from_static(b"expired but sent"), (12, false)),
        ]);
        assert_eq!(t.pending.len(), 4);
    }

    fn will(id: &str, delay: u32, expiry: u32) -> Record {
        let Record::Value(message) = value("will/t", QoS::AtLeastOnce, true, b"gone") else { unreachable!() };
        Record::Will { client_id: id.into(), message, delay, expiry }
    }

    #[test]
    fn wills_are_due_after_their_delay_capped_by_the_session_and_ended_ones_are_gone() {
        let r = replay(
            vec![
                // Connection open at the stop, session kept: the delay
                // counts from the restart.
                session("open", 100),
                will("open", 30, 100),
                // Capped by the Session Expiry Interval [MQTT-3.1.3-9].
                session("capped", 10),
                will("capped", 30, 10),
                // No session: sent at the restart.
                will("clean", 30, 0),
                // Ended before the stop, delay running: its logged time.
                session("waiting", 100),
                will("waiting", 30, 100),
                Record::Offline { client_id: "waiting".into(), at_ms: 1_000, expiry: 100 },
                Record::WillDue { client_id: "waiting".into(), due_ms: 31_000 },
                // Discarded (DISCONNECT 0x00) or published.
                will("ended", 30, 0),
                Record::WillEnd { client_id: "ended".into() },
            ],
            20_000,
        );
        let mut r = r;
        r.wills_due(20_000);
        let due = |id: &str| r.wills[id].due_ms;
        assert_eq!(r.wills.len(), 4);
        assert_eq!(due("open"), Some(50_000));
        assert_eq!(due("capped"), Some(30_000));
        assert_eq!(due("clean"), Some(20_000));
        assert_eq!(due("waiting"), Some(31_000));
        assert_eq!(r.wills["open"].message.payload, Bytes::from_static(b"gone"));
        let mut again = Recovered::default();
        again.reading_snapshot(true);
        for (lsn, record) in r.snapshot(1) {
            again.apply(lsn, record);
        }
        again.reading_snapshot(false);
        again.finish(20_500);
        assert_eq!(again.wills, r.wills, "a snapshot keeps the wills and their due times");
    }

    #[test]
    fn the_last_retained_value_of_a_topic_wins_and_an_empty_one_deletes() {
        let mut expiring = value("e", QoS::AtMostOnce, true, b"expires");
        if let Record::Value(m) = &mut expiring {
            m.properties = Props::from(Properties { message_expiry_interval: Some(1), ..Properties::default() });
        }
        let r = replay(
            vec![
                value("t", QoS::AtMostOnce, true, b"first"),
                value("t", QoS::AtLeastOnce, true, b"second"),
                value("d", QoS::AtMostOnce, true, b"deleted"),
                value("d", QoS::AtMostOnce, true, b""),
                expiring,
            ],
            2_500,
        );
        assert_eq!(r.retained.len(), 1);
        assert_eq!(r.retained["t"].1.payload, Bytes::from_static(b"second"));
    }
}
