//! Delivery from the session logs (DESIGN.md §4, §6, §7; issue 24): in
//! cluster mode (without a local store), a persistent session gets its
//! QoS 1/2 values from its workspace's session log, in log order, never
//! from the live path; QoS 0 values stay live.
//!
//! # How a session reads its log
//! Each persistent session has a [`Reader`]: its `position` (every log
//! value of sequence ≤ it was dealt with: it did not match, or it was
//! delivered or queued) and its mode:
//! - **tailing**: it takes the values this replica's one tail of the
//!   workspace's log brings ([`Shard::log_values`]; one ordered consumer
//!   per workspace per replica, on the bridge), those of sequence above
//!   its position;
//! - **catching up**: it reads the log from `position + 1` with batched
//!   direct gets of its own, one batch at a time while its queue is short
//!   (flow control: the client's Receive Maximum and the session's queue,
//!   as live delivery), and ignores the tail meanwhile; once a read
//!   reaches the log's end at sequence L and the tail has brought nothing
//!   past L to this shard, it switches to tailing: what the tail brings
//!   next is above L, and what it brings of L or below is dropped (no gap,
//!   no duplicate). A tailing session whose queue grows long goes back
//!   to catching up (it is never made to drop a value);
//! - **offline**: nothing (its connection ended); catching up again when
//!   its client comes back (here, or on another replica from its cursor);
//! - **starting**: a new session whose workspace this shard does not
//!   follow yet: its position is where the tail starts, and its SUBACKs
//!   wait for that.
//!
//! The live path skips QoS 1/2 deliveries to a reading session of values
//! that went to a session log (marked [`LOGGED`]; from the mesh, when the
//! publishing replica says it logged them: mesh version 4, and always
//! from an older peer), so that nothing comes twice. A value the
//! publishing replica did not log (it did not know of the session's
//! interest yet, moments after its SUBACK) is delivered live.
//!
//! # The cursor
//! `mqtt-session-cursor` keeps each session's
//! [`CursorRecord`](fleetmq_core::cluster::cursor::CursorRecord): the
//! position as far as values were sent (a queued value is not) and the
//! unacknowledged deliveries, written at most every [`CURSOR_EVERY`]
//! while it changes and when the connection ends, one write in flight per
//! session (the bridge's writer), deleted when the session ends. A replica
//! taking the session up resends the unacknowledged deliveries with DUP
//! and reads the log from the position on; values dropped from the log
//! before the session read them are counted
//! (`fleetmq_session_log_values_missed_total`).
//!
//! A QoS 2 value's PUBLISH from the log, and later its PUBREL, wait for
//! a cursor that lists them (`super::cursor_gate`): exactly once across
//! a replica's death.

use std::collections::{HashMap, HashSet};
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fleetmq_core::cluster::cursor::{CursorRecord, Unacked};
use fleetmq_core::cluster::records::{Record as _, FORMAT};
use fleetmq_core::packet::QoS;
use fleetmq_core::session::{Delivery, Message};
use fleetmq_core::topic::matches;
use fleetmq_nats_bridge::{LogBatch, LogEntry, Request};

use super::{Shard, Slot, State};
use crate::store::Write;

/// [`Message::stored`] of a live value that went to a session log: a
/// reading session gets it from there, not live. (A value from a session
/// log carries its sequence there instead.)
pub(crate) const LOGGED: u64 = u64::MAX;

/// Values one catching-up read asks for.
const READ_BATCH: usize = 256;

/// A session catches up only while fewer values than this wait in its
/// queue.
const QUEUE_LOW: usize = 256;

/// A tailing session whose queue reaches this goes back to catching up.
const QUEUE_HIGH: usize = 2_048;

/// Values of the tail a shard keeps for sessions switching to it.
const RECENT_MAX: usize = 1_024;

/// A session's cursor is written at most this often while it changes.
pub(crate) const CURSOR_EVERY: Duration = Duration::from_millis(100);

/// How a session reads its log (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    Starting,
    Tailing,
    CatchingUp { reading: bool },
    Offline,
}

/// A persistent session's place in its workspace's session log.
#[derive(Debug)]
pub(super) struct Reader {
    workspace: Arc<str>,
    position: u64,
    pub(super) mode: Mode,
    /// Changed since the cursor was last written.
    dirty: bool,
    /// The cursor last written (position, unacknowledged).
    written: Option<(u64, Vec<Unacked>)>,
    written_at: Option<Instant>,
    /// The write that QoS 2 packets held for this session's cursor wait
    /// for, until the cursor write that covers them is made (see
    /// `super::cursor_gate`).
    pub(super) gate: Option<Rc<Write>>,
}

impl Reader {
    /// A reader of `workspace`'s log at `position` (`None`: a new session,
    /// starting where the tail starts).
    pub(super) fn new(workspace: Arc<str>, position: Option<u64>, mode_if_known: Mode) -> Box<Reader> {
        Box::new(Reader {
            workspace,
            position: position.unwrap_or(0),
            mode: if position.is_some() { mode_if_known } else { Mode::Starting },
            dirty: true,
            written: None,
            written_at: None,
            gate: None,
        })
    }
}

/// What a shard knows of one workspace's tail.
#[derive(Default)]
pub(super) struct Tail {
    /// The tail brought every value up to this sequence (`None`: not
    /// started yet).
    through: Option<u64>,
    /// Asked the bridge to follow the workspace.
    requested: bool,
    /// The sessions reading this workspace's log.
    readers: HashSet<Slot>,
    /// SUBACKs of starting sessions waiting for the tail's start.
    waiters: Vec<tokio::sync::oneshot::Sender<bool>>,
    /// The last values the tail brought (at most [`RECENT_MAX`]): a
    /// session whose read reached the log's end just before them takes
    /// them from here as it switches to the tail.
    recent: std::collections::VecDeque<LogEntry>,
    /// `recent` holds every value the tail brought after this sequence.
    recent_after: u64,
}

/// Per shard: the tails of the workspaces its sessions read.
pub(super) type Tails = HashMap<Arc<str>, Tail>;

/// The values a resumed session had sent and not had acknowledged when
/// its last replica wrote its cursor, and its position: what
/// [`Shard::take_up`] restores.
#[derive(Debug, Clone)]
pub(crate) struct Resume {
    pub(crate) position: u64,
    /// Each unacknowledged delivery and its value (`None`: dropped from
    /// the log since).
    pub(crate) sent: Vec<(Unacked, Option<Arc<Message>>)>,
}

impl Shard {
    /// Whether persistent sessions read session logs here: cluster mode
    /// without a local store (whose own log keeps what sessions are owed).
    pub(super) fn reads_logs(&self) -> bool {
        self.store.clustered() && !self.store.is_durable()
    }

    /// The session on `slot` is persistent and attached (new, resumed,
    /// or taken up with `reader` already set): it reads its log, catching
    /// up from its position unless it is new. Asks the bridge to follow
    /// its workspace on first need.
    pub(super) fn reader_attached(&self, st: &mut State, slot: Slot) {
        if !self.reads_logs() {
            return;
        }
        let client = &mut st.clients[slot as usize];
        if client.session.session_expiry() == 0 {
            return;
        }
        let workspace = client.owner.1.clone();
        let through = st.tails.get(&workspace).and_then(|t| t.through);
        let reader = client.log.get_or_insert_with(|| Reader::new(workspace.clone(), through, Mode::Tailing));
        reader.mode = match reader.mode {
            Mode::Offline => Mode::CatchingUp { reading: false },
            other => other,
        };
        reader.dirty = true;
        self.follow(st, &workspace).readers.insert(slot);
        self.catch_up_log(st, slot);
    }

    /// `workspace`'s tail on this shard, asked of the bridge on first need.
    fn follow<'a>(&self, st: &'a mut State, workspace: &Arc<str>) -> &'a mut Tail {
        let tail = st.tails.entry(workspace.clone()).or_default();
        if !tail.requested {
            tail.requested = true;
            let request = Request::LogTail { workspace: workspace.to_string() };
            if let Some(node) = crate::cluster::node() {
                let _ = node.bridge_send(request);
            }
        }
        tail
    }

    /// The connection of the session on `slot` ended: it stops reading,
    /// its cursor is written now (unless another replica has it).
    pub(super) fn reader_detached(&self, st: &mut State, slot: Slot) {
        let client = &mut st.clients[slot as usize];
        let Some(reader) = client.log.as_mut() else { return };
        if reader.mode != Mode::Starting {
            reader.mode = Mode::Offline;
        }
        reader.dirty = true;
        if client.saved != super::session_state::Saved::MovedAway {
            self.write_cursor(st, slot, true, None);
        }
    }

    /// The session on `slot` ends here (or another replica has it now:
    /// `moved`): it stops reading; its cursor is deleted unless moved.
    pub(super) fn reader_ended(&self, st: &mut State, slot: Slot, moved: bool) {
        let client = &mut st.clients[slot as usize];
        let Some(reader) = client.log.take() else { return };
        if let Some(tail) = st.tails.get_mut(&reader.workspace) {
            tail.readers.remove(&slot);
        }
        if !moved {
            crate::cluster::save_cursor(st.clients[slot as usize].session.client_id(), None, None);
        }
    }

    /// Whether the SUBACK of the session on `slot` must wait for its
    /// workspace's tail to start (a new session: its position is where the
    /// tail starts); the wait is pushed to `waits`.
    pub(super) fn log_start_wait(&self, st: &mut State, slot: Slot, waits: &mut Vec<super::wanted::RouteWait>) {
        let Some(reader) = st.clients[slot as usize].log.as_ref() else { return };
        if reader.mode != Mode::Starting {
            return;
        }
        let workspace = reader.workspace.clone();
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.follow(st, &workspace).waiters.push(tx);
        waits.push(super::wanted::RouteWait::LogStarted(rx));
    }

    /// Whether a live delivery of `message` at `qos` to the session on
    /// `slot` is left out: the session reads it from its log.
    pub(super) fn log_skips(st: &State, slot: Slot, message: &Message, qos: QoS) -> bool {
        qos != QoS::AtMostOnce
            && message.stored == LOGGED
            && st.clients[slot as usize].log.as_ref().is_some_and(|r| r.mode != Mode::Starting)
    }

    /// Values of `workspace`'s log from this replica's tail: every value
    /// of sequence up to `through` (after the previous event's).
    pub(crate) fn log_values(&self, workspace: &Arc<str>, through: u64, values: &[LogEntry]) {
        let now = Instant::now();
        let mut guard = self.state.borrow_mut();
        let st = &mut *guard;
        let tail = st.tails.entry(workspace.clone()).or_default();
        let started = tail.through.is_none();
        if started {
            tail.recent_after = through;
        }
        tail.through = Some(tail.through.map_or(through, |t| t.max(through)));
        for entry in values {
            if tail.recent.len() >= RECENT_MAX {
                if let Some(old) = tail.recent.pop_front() {
                    tail.recent_after = old.seq;
                }
            }
            tail.recent.push_back(entry.clone());
        }
        let readers: Vec<Slot> = tail.readers.iter().copied().collect();
        if started {
            for waiter in std::mem::take(&mut tail.waiters) {
                let _ = waiter.send(true);
            }
            for &slot in &readers {
                if let Some(r) = st.clients.get_mut(slot as usize).and_then(|c| c.log.as_mut()) {
                    if r.mode == Mode::Starting {
                        r.position = through;
                        r.mode = Mode::Tailing;
                    }
                }
            }
        }
        for entry in values {
            let mut matched = Vec::new();
            st.trie.for_each_match(&entry.message.topic, |subscriber, sub| {
                if let super::Subscriber::Session(slot) = subscriber {
                    matched.push((*slot, *sub));
                }
            });
            matched.sort_unstable_by_key(|(slot, _)| *slot);
            let mut i = 0;
            while i < matched.len() {
                let slot = matched[i].0;
                let mut j = i;
                while j < matched.len() && matched[j].0 == slot {
                    j += 1;
                }
                let subs: Vec<_> = matched[i..j].iter().map(|(_, s)| *s).collect();
                i = j;
                let Some(client) = st.clients.get_mut(slot as usize) else { continue };
                let Some(reader) = client.log.as_mut() else { continue };
                if reader.mode != Mode::Tailing || &reader.workspace != workspace || entry.seq <= reader.position {
                    continue;
                }
                if client.session.queued() >= QUEUE_HIGH {
                    // Too far behind to take more from the tail: reads
                    // its log at its pace from where it is.
                    reader.mode = Mode::CatchingUp { reading: false };
                    continue;
                }
                reader.position = entry.seq;
                reader.dirty = true;
                let key = client.key;
                if let Some(delivery) = delivery_for(&entry.message, key, subs.iter()) {
                    self.log_deliver(st, slot, delivery, now);
                }
            }
        }
        // Every tailing session dealt with everything up to `through`.
        for &slot in &readers {
            if let Some(r) = st.clients.get_mut(slot as usize).and_then(|c| c.log.as_mut()) {
                if r.mode == Mode::Tailing && r.position < through {
                    r.position = through;
                }
            }
        }
        drop(guard);
        self.try_flush();
    }

    /// Deliver `delivery` (a value from the log) to the session on `slot`.
    fn log_deliver(&self, st: &mut State, slot: Slot, delivery: Delivery, now: Instant) {
        let mut outputs = std::mem::take(&mut st.outputs);
        st.clients[slot as usize].session.deliver(delivery, now, &mut outputs);
        self.write_deliveries(st, slot, &mut outputs, now, false);
        st.outputs = outputs;
    }

    /// Ask for the next batch of the log of the session on `slot`, if it
    /// catches up, is online, reads nothing now and its queue is short.
    fn catch_up_log(&self, st: &mut State, slot: Slot) {
        let client = &mut st.clients[slot as usize];
        let Some(reader) = client.log.as_mut() else { return };
        if reader.mode != (Mode::CatchingUp { reading: false }) || client.conn.is_none() || client.session.queued() >= QUEUE_LOW {
            return;
        }
        let Some(node) = crate::cluster::node() else { return };
        let (reply, answer) = tokio::sync::oneshot::channel();
        let request = Request::LogRead { workspace: reader.workspace.to_string(), from: reader.position.saturating_add(1), max: READ_BATCH, reply };
        if node.bridge_send(request).is_err() {
            return;
        }
        reader.mode = Mode::CatchingUp { reading: true };
        let key = client.key;
        let shard = crate::cluster::shard_weak();
        glommio::spawn_local(async move {
            // glommio runs a task it spawns at once: when the answer is
            // already there (the bridge dropped the reply), the shard's
            // state is still borrowed by the caller.
            futures_lite::future::yield_now().await;
            let batch = answer.await.ok().and_then(Result::ok);
            if let Some(shard) = shard.and_then(|s| s.upgrade()) {
                shard.log_read(slot, key, batch);
            }
        })
        .detach();
    }

    /// A catching-up read of the session on `slot` (client key `key`)
    /// answered (`None`: it failed; tried again at the next tick).
    fn log_read(&self, slot: Slot, key: u64, batch: Option<LogBatch>) {
        let now = Instant::now();
        let mut guard = self.state.borrow_mut();
        let st = &mut *guard;
        let Some(client) = st.clients.get_mut(slot as usize).filter(|c| c.key == key) else { return };
        let Some(reader) = client.log.as_mut() else { return };
        if reader.mode != (Mode::CatchingUp { reading: true }) {
            return;
        }
        reader.mode = Mode::CatchingUp { reading: false };
        let Some(batch) = batch else { return };
        let from = reader.position.saturating_add(1);
        if let Some(first) = batch.values.first() {
            if first.seq > from && reader.position > 0 {
                // Dropped from the log (its size or age) before this
                // session read them.
                crate::cluster::count_missed(first.seq - from);
            }
        }
        let end = batch.end;
        let workspace = reader.workspace.clone();
        for entry in &batch.values {
            let client = &mut st.clients[slot as usize];
            let Some(reader) = client.log.as_mut() else { break };
            if entry.seq <= reader.position {
                continue;
            }
            reader.position = entry.seq;
            reader.dirty = true;
            let subs = client.session.subscriptions().iter().filter(|(f, _)| matches(f, &entry.message.topic)).map(|(_, s)| *s);
            let subs: Vec<_> = subs.collect();
            if let Some(delivery) = delivery_for(&entry.message, client.key, subs.iter()) {
                self.log_deliver(st, slot, delivery, now);
            }
        }
        if end {
            self.switch_to_tail(st, slot, &workspace, now);
        }
        self.catch_up_log(st, slot);
        drop(guard);
        self.try_flush();
    }

    /// The catching-up session on `slot` read its log to the end: it
    /// takes the tail from here when the tail has brought nothing past
    /// its position to this shard, or when what it brought past it is
    /// still in the shard's recent values (delivered now): what the tail
    /// brings next is what comes after (no gap), and what it brings of
    /// the position or before is dropped (no duplicate). Else it reads on.
    fn switch_to_tail(&self, st: &mut State, slot: Slot, workspace: &Arc<str>, now: Instant) {
        let Some(tail) = st.tails.get(workspace) else { return };
        let Some(through) = tail.through else { return };
        let Some(position) = st.clients[slot as usize].log.as_ref().map(|r| r.position) else { return };
        if through > position && tail.recent_after > position {
            return;
        }
        let missing: Vec<LogEntry> = tail.recent.iter().filter(|e| e.seq > position).cloned().collect();
        for entry in missing {
            let client = &mut st.clients[slot as usize];
            let subs: Vec<_> =
                client.session.subscriptions().iter().filter(|(f, _)| matches(f, &entry.message.topic)).map(|(_, s)| *s).collect();
            if let Some(delivery) = delivery_for(&entry.message, client.key, subs.iter()) {
                self.log_deliver(st, slot, delivery, now);
            }
        }
        if let Some(reader) = st.clients[slot as usize].log.as_mut() {
            reader.position = reader.position.max(through);
            reader.mode = Mode::Tailing;
            reader.dirty = true;
        }
    }

    /// Every [`CURSOR_EVERY`]: catching-up sessions read on, and the
    /// cursors that changed are written.
    pub(crate) fn log_tick(&self) {
        let mut guard = self.state.borrow_mut();
        let st = &mut *guard;
        if st.tails.is_empty() {
            return;
        }
        let slots: Vec<Slot> = st.tails.values().flat_map(|t| t.readers.iter().copied()).collect();
        for slot in slots {
            if st.clients.get(slot as usize).is_none_or(|c| c.log.is_none()) {
                continue;
            }
            self.catch_up_log(st, slot);
            self.write_cursor(st, slot, false, None);
        }
        drop(guard);
        self.try_flush();
    }

    /// Something of the session on `slot` changed (a packet from its
    /// client): its cursor is looked at again at the next tick.
    pub(super) fn log_touched(st: &mut State, slot: Slot) {
        if let Some(r) = st.clients.get_mut(slot as usize).and_then(|c| c.log.as_mut()) {
            r.dirty = true;
        }
    }

    /// Write the cursor of the session on `slot` if it changed (and, unless
    /// `now_anyway`, was not written within [`CURSOR_EVERY`]); with
    /// `landed`, write it now whatever it was, `landed` hearing once it
    /// is in the bucket (a starting session has no cursor yet: `true` at
    /// once).
    pub(super) fn write_cursor(&self, st: &mut State, slot: Slot, now_anyway: bool, landed: Option<tokio::sync::oneshot::Sender<bool>>) {
        let client = &mut st.clients[slot as usize];
        let Some(reader) = client.log.as_mut() else { return };
        if reader.mode == Mode::Starting {
            if let Some(landed) = landed {
                let _ = landed.send(true);
            }
            return;
        }
        let forced = landed.is_some();
        if !forced && !reader.dirty {
            return;
        }
        if !forced && !now_anyway && reader.written_at.is_some_and(|at| at.elapsed() < CURSOR_EVERY) {
            return;
        }
        reader.dirty = false;
        let (sent, queued) = client.session.log_position();
        let position = match queued {
            Some(first) => reader.position.min(first.saturating_sub(1)),
            None => reader.position,
        };
        let unacked: Vec<Unacked> = sent
            .into_iter()
            .filter(|s| s.seq != LOGGED)
            .map(|s| Unacked { seq: s.seq, packet_id: s.packet_id, qos: s.qos as u8, released: s.released })
            .collect();
        if !forced && reader.written.as_ref().is_some_and(|(p, u)| *p == position && *u == unacked) {
            return;
        }
        reader.written = Some((position, unacked.clone()));
        reader.written_at = Some(Instant::now());
        let record = CursorRecord {
            format: FORMAT,
            client_id: client.session.client_id().to_string(),
            workspace: reader.workspace.to_string(),
            position,
            unacked,
        };
        crate::cluster::save_cursor(client.session.client_id(), Some(bytes::Bytes::from(record.encode())), landed);
    }

    /// The deliveries `resume` lists, made for a session of
    /// `subscriptions` with client key `key`, in the order sent.
    pub(super) fn resumed_deliveries(
        resume: &Resume,
        key: u64,
        subscriptions: &HashMap<bytestring::ByteString, fleetmq_core::session::Subscription>,
    ) -> Vec<(Delivery, fleetmq_core::packet::PacketId, bool)> {
        let mut out = Vec::new();
        for (unacked, message) in &resume.sent {
            let Some(message) = message else {
                crate::cluster::count_missed(1);
                continue;
            };
            let Some(packet_id) = std::num::NonZeroU16::new(unacked.packet_id) else { continue };
            let subs: Vec<_> = subscriptions.iter().filter(|(f, _)| matches(f, &message.topic)).map(|(_, s)| *s).collect();
            let qos = if unacked.qos == 2 { QoS::ExactlyOnce } else { QoS::AtLeastOnce };
            let mut delivery = delivery_for(message, key, subs.iter()).unwrap_or(Delivery {
                message: message.clone(),
                qos,
                retain: false,
                subscription_ids: Vec::new(),
                group: None,
            });
            delivery.qos = qos;
            out.push((delivery, packet_id, unacked.released));
        }
        out
    }
}

/// The delivery of `message` (from a session log) to a session whose
/// client key is `key` and whose matching subscriptions are `subs`: at
/// the highest QoS they grant and at most the value's `[MQTT-3.8.4-8]`,
/// with every Subscription Identifier, No Local `[MQTT-3.8.3-3]` and
/// Retain As Published applied; `None` when none is left, or at QoS 0
/// (live only).
fn delivery_for<'a>(message: &Arc<Message>, key: u64, subs: impl Iterator<Item = &'a fleetmq_core::session::Subscription>) -> Option<Delivery> {
    let mut qos = None;
    let mut retain = false;
    let mut ids = Vec::new();
    for sub in subs {
        if sub.options.no_local && key == message.origin {
            continue;
        }
        qos = qos.max(Some(sub.options.qos));
        retain |= sub.options.retain_as_published && message.retain;
        ids.extend(sub.identifier);
    }
    let qos = qos?.min(message.qos);
    (qos != QoS::AtMostOnce).then(|| Delivery { message: message.clone(), qos, retain, subscription_ids: ids, group: None })
}
