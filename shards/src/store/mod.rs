//! Where accepted values become durable (DESIGN.md §7), as a shard sees it:
//! the store and the acknowledgements that wait for it.
//!
//! A connection's PUBACK, PUBREC, PUBCOMP, SUBACK, UNSUBACK and the CONNACK
//! of a persistent session (core's
//! [`Output::Acknowledge`](fleetmq_core::session::Output::Acknowledge)) may
//! be written only once what the packet caused is durable. The shard asks
//! its [`ShardStore`] for a [`Token`] covering everything appended so far
//! and parks the acknowledgement in an [`acks::AckQueue`]; the store completes
//! tokens in order as its syncs finish, and the queue then writes the
//! acknowledgements in the order they were parked (so in order per
//! connection). With `store.kind = "none"` there is nothing to wait for:
//! the acknowledgement is written at once, as before this module existed.
//!
//! The interface is store-agnostic: a store hands out increasing tokens
//! and reports "durable up to T" (`AckQueue::complete`) or "failed up to
//! T" (`AckQueue::fail`); the local store ([`log`]) is the first.

mod acks;
mod compact;
pub(crate) mod health;
mod log;
mod open;
mod watermark;

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Instant;

use bytestring::ByteString;
use fleetmq_core::packet::{Packet, QoS, ReasonCode};
use fleetmq_core::session::{Message, SessionChange, Subscription};
use fleetmq_core::store::{Record, StoredMessage};

use crate::shard::ConnShared;
pub(crate) use acks::{Answering, Outcome, Write};
pub(crate) use compact::Compactor;
pub(crate) use log::ShardLog;
pub(crate) use open::{open, unix_ms, Opened};

/// A position in a shard's store: an acknowledgement parked with token `t`
/// is written once the store is durable up to `t`. Tokens of one shard
/// increase.
pub(crate) type Token = u64;

/// What every shard of a local store shares.
pub(crate) struct LocalStart {
    pub(crate) opened: Opened,
    pub(crate) lsn: Arc<AtomicU64>,
    pub(crate) health: Arc<health::Health>,
    pub(crate) settings: fleetmq_core::settings::Store,
    /// The compactor's roll requests to the shards' logs.
    pub(crate) roll: Arc<compact::Roll>,
    /// Every shard's oldest record not yet durable.
    pub(crate) watermark: Arc<watermark::Watermark>,
}

/// Open and recover the local store when `store.kind = "local"`.
///
/// # Errors
/// See [`open`]: the directory is held by another process, damaged, or
/// cannot be read or written.
pub(crate) fn open_if_local(settings: &fleetmq_core::settings::Store) -> anyhow::Result<Option<Opened>> {
    if settings.kind != fleetmq_core::settings::StoreKind::Local {
        return Ok(None);
    }
    open(&settings.dir, settings.truncate_corrupt).map(Some)
}

impl LocalStart {
    /// What the shards of a store opened as `opened` share; its health is
    /// reported through `metrics` (series and readiness).
    pub(crate) fn new(
        opened: Opened,
        settings: &fleetmq_core::settings::Store,
        metrics: &crate::metrics::Metrics,
        shards: usize,
    ) -> Arc<LocalStart> {
        let max = settings.max_bytes as u64;
        let health = health::Health::new(metrics.store.clone(), shards, max, opened.snapshot_bytes, &opened.segment_bytes);
        let health = Arc::new(health);
        metrics.set_store_health(health.clone());
        Arc::new(LocalStart {
            lsn: Arc::new(AtomicU64::new(opened.next_lsn)),
            health,
            settings: settings.clone(),
            roll: Arc::new(compact::Roll::new(shards)),
            watermark: Arc::new(watermark::Watermark::new(shards)),
            opened,
        })
    }

    /// Start compacting the log while the broker serves, until `shutdown`
    /// (see [`compact`]).
    ///
    /// # Errors
    /// The compactor thread cannot be made.
    pub(crate) fn start_compactor(&self, shutdown: crate::shutdown::Shutdown) -> std::io::Result<Compactor> {
        Compactor::start(compact::CompactorContext {
            dir: self.opened.dir.clone(),
            lsn: self.lsn.clone(),
            roll: self.roll.clone(),
            health: self.health.clone(),
            shutdown,
        })
    }
}

/// A shard's store: its log (`store.kind = "local"`), and the
/// acknowledgements that wait for it or for writes to the cluster.
pub(crate) struct ShardStore {
    /// This shard's log; `None` for `store.kind = "none"` (acknowledged
    /// on receipt).
    log: Option<Rc<ShardLog>>,
    acks: Rc<acks::AckQueue>,
    /// Cluster mode: a retained value is acknowledged once
    /// `mqtt-retained` has it ([`ShardStore::expect_write`]).
    clustered: bool,
    /// `store.kind = "jetstream"`: a QoS 1/2 value is acknowledged once
    /// the ingest stream has it ([`crate::cluster::append_ingest`]).
    ingest: bool,
    /// The write the next acknowledgement of a connection (by key) waits
    /// for: set while the packet that caused it is handled, taken by
    /// [`ShardStore::acknowledge`].
    next_write: RefCell<Option<Rc<Write>>>,
}

impl ShardStore {
    /// Shard `shard`'s store: its log of the local store `local`, or none;
    /// `clustered` in cluster mode; `ingest` with `store.kind =
    /// "jetstream"` (cluster mode).
    pub(crate) fn new(shard: usize, local: Option<&LocalStart>, clustered: bool, ingest: bool) -> ShardStore {
        let acks = Rc::new(acks::AckQueue::new(local.map(|l| l.watermark.clone())));
        let log = local.map(|l| Rc::new(ShardLog::new(shard, l, acks.clone())));
        ShardStore { log, acks, clustered, ingest: clustered && ingest, next_write: RefCell::new(None) }
    }

    /// True with `store.kind = "jetstream"`: accepted QoS 1/2 values go to
    /// the ingest stream before their acknowledgement.
    pub(crate) fn ingests(&self) -> bool {
        self.ingest
    }

    /// Start the log's committer task on the current executor.
    pub(crate) fn start(&self) -> Option<glommio::task::JoinHandle<()>> {
        self.log.as_ref().map(|log| glommio::spawn_local(log.clone().run()).detach())
    }

    /// True when acknowledgements wait for a local store; false for
    /// `none`.
    pub(crate) fn is_durable(&self) -> bool {
        self.log.is_some()
    }

    /// True while the local store refuses QoS 1/2 publishes (failing, or
    /// over `store.max_bytes`): the session answers them with a refusal
    /// (`Session::set_store_refusing`).
    pub(crate) fn refusing(&self) -> bool {
        self.log.as_ref().is_some_and(|log| log.refusing())
    }

    /// True in cluster mode.
    pub(crate) fn clustered(&self) -> bool {
        self.clustered
    }

    /// True when acknowledgements may have to wait (a local store, or
    /// cluster mode); false when the caller writes them at once.
    pub(crate) fn defers(&self) -> bool {
        self.log.is_some() || self.clustered
    }

    /// The token of the newest append (0 without a log): taken before a
    /// packet is handled, it tells [`ShardStore::acknowledge`] whether the
    /// packet appended anything.
    pub(crate) fn appended(&self) -> Token {
        self.log.as_ref().map_or(0, |log| log.appended())
    }

    /// Start handling a packet: a write left by anything else (a will) is
    /// forgotten. Returns [`ShardStore::appended`], for
    /// [`ShardStore::acknowledge`].
    pub(crate) fn begin_packet(&self) -> Token {
        self.next_write.borrow_mut().take();
        self.appended()
    }

    /// A write that the acknowledgement of the packet being handled waits
    /// for, a publish from the client whose key is `origin`
    /// ([`fleetmq_core::session::Message::origin`]); the caller resolves
    /// it ([`Write::resolve`]) when the other store answers.
    ///
    /// A second call for the same packet and `origin` (a retained value
    /// that is ingested too) returns the same write, waiting for one more
    /// answer ([`Write::add_part`]).
    pub(crate) fn expect_write(&self, origin: u64) -> Rc<Write> {
        let mut next = self.next_write.borrow_mut();
        if let Some(write) = next.as_ref().filter(|w| w.origin() == origin && !w.is_resolved()) {
            write.add_part();
            return write.clone();
        }
        let write = self.acks.write(origin);
        *next = Some(write.clone());
        write
    }

    /// Write `packets`, the acknowledgements of one packet from `conn`,
    /// once everything appended so far is durable and the write the
    /// packet caused (if any: [`ShardStore::expect_write`] for the client
    /// key in `origin`) is done, in order with the connection's earlier
    /// acknowledgements. `origin` names the session whose packet they
    /// answer: a refused PUBREC frees its identifier there (see
    /// [`ShardStore::take_forgotten`]). While the store refuses (failing, or full:
    /// `store.max_bytes`), PUBACK and PUBREC are refused (see
    /// `AckQueue::fail`), MQTT 5 in order too. While it fails, the others
    /// are written if the packet appended nothing since `since`
    /// ([`ShardStore::begin_packet`]), else refused too; while it is only
    /// full they wait for their records as usual (sessions can still
    /// resume and take their values, which frees space).
    pub(crate) fn acknowledge(&self, conn: &Rc<ConnShared>, packets: &mut Vec<Packet>, since: Token, origin: Option<Answering>) {
        let write = match origin {
            Some(origin) => self.next_write.borrow_mut().take_if(|w| w.origin() == origin.client),
            None => None,
        };
        if let Some(write) = &write {
            write.attach(conn.key);
        }
        let held = write.is_some() || self.acks.is_held(conn.key);
        let Some(log) = &self.log else {
            for packet in packets.drain(..) {
                if held {
                    self.acks.hold(0, conn, (packet, origin), write.clone(), None);
                } else {
                    conn.send(&packet);
                }
            }
            return;
        };
        let refusing = log.refusing();
        let failing = refusing && log.failing();
        let appended = log.appended();
        for packet in packets.drain(..) {
            let is_pub = matches!(packet, Packet::PubAck(_) | Packet::PubRec(_));
            // A subscriber's QoS 2 flow goes on while writes fail: its
            // record is written once the disk has room again.
            let is_pubrel = matches!(packet, Packet::PubRel(_));
            let refused = (refusing && is_pub) || (failing && !is_pubrel && appended != since);
            // While the store fails, a packet that appended nothing waits
            // for nothing of it.
            let token = if failing && !refused { 0 } else { appended };
            if held {
                let refused = refused.then_some(ReasonCode::QUOTA_EXCEEDED);
                self.acks.hold(token, conn, (packet, origin), write.clone(), refused);
            } else if refused {
                // MQTT 5: the refusal leaves behind what waits before it.
                self.acks.forget(origin, conn, &packet, false);
                match acks::refusal(conn, packet, ReasonCode::QUOTA_EXCEEDED) {
                    Ok(refusal) if self.acks.waiting_for(conn.key) => self.acks.park(appended, conn, refusal, None),
                    Ok(refusal) => conn.send(&refusal),
                    Err(packet) => drop(acks::refuse(conn, packet, ReasonCode::QUOTA_EXCEEDED)),
                }
            } else if failing || (log.all_durable() && self.acks.is_empty()) {
                conn.send(&packet);
            } else {
                self.acks.park(token, conn, packet, origin);
            }
        }
    }

    /// True while an acknowledgement of `conn` waits for a write to the
    /// cluster (a retained value's, a SUBSCRIBE's routes): what the
    /// connection would send besides (retained messages for a new
    /// subscription) waits too, so that they follow the SUBACK.
    pub(crate) fn acks_held(&self, conn: &ConnShared) -> bool {
        self.acks.is_held(conn.key)
    }

    /// How many packets for `conn` wait in its chain (0: none): QoS 0
    /// deliveries behind them are bounded as the connection's writes are.
    pub(crate) fn held_len(&self, conn: &ConnShared) -> usize {
        self.acks.chain_len(conn.key)
    }

    /// A write that packets for connection `conn` will wait for, resolved
    /// by its maker (a QoS 2 PUBLISH or PUBREL to a session reading its
    /// session log waits for the session's cursor: DESIGN.md §7, issue 24).
    pub(crate) fn gate(&self, origin: u64, conn: u64) -> Rc<Write> {
        let write = self.acks.write(origin);
        write.attach(conn);
        write
    }

    /// Write the encoded PUBLISH `frame` to `conn` once `write` (if any)
    /// is done, after everything already held for `conn`.
    pub(crate) fn hold_publish(&self, conn: &Rc<ConnShared>, frame: bytes::Bytes, write: Option<Rc<Write>>) {
        self.acks.hold_publish(conn, frame, write);
    }

    /// Write `packet` to `conn` once `write` (if any) is done, after
    /// everything already held for `conn`.
    pub(crate) fn hold_packet(&self, conn: &Rc<ConnShared>, packet: Packet, write: Option<Rc<Write>>) {
        self.acks.hold(0, conn, (packet, None), write, None);
    }

    /// True while acknowledgements for `conn` wait for the store: a
    /// closing connection drains them before it closes, and it does not
    /// move to another shard meanwhile.
    pub(crate) fn acks_waiting(&self, conn: &ConnShared) -> bool {
        self.acks.waiting_for(conn.key)
    }

    /// Log a value a client (or a will) published, once, before it is
    /// routed: QoS 1/2 and retained ones. Sets its [`Message::stored`].
    /// False when the store refuses it: a client's publish is then not
    /// routed either (its PUBACK/PUBREC is refused, see
    /// [`ShardStore::acknowledge`]); a will is routed anyway.
    pub(crate) fn log_value(&self, message: &mut Message, now: Instant) -> bool {
        let Some(log) = &self.log else { return true };
        if message.qos == QoS::AtMostOnce && !message.retain {
            return true;
        }
        if log.refusing() {
            return false;
        }
        let age = now.saturating_duration_since(message.received_at).as_millis() as u64;
        let stored = StoredMessage {
            topic: message.topic.clone(),
            payload: message.payload.clone(),
            qos: message.qos,
            retain: message.retain,
            properties: message.properties.clone(),
            received_ms: unix_ms().saturating_sub(age),
            origin: message.origin,
        };
        message.stored = log.append(&Record::Value(stored));
        true
    }

    /// `conn`'s buffer starts with the CONNACK of a connection whose
    /// attach appended records since `since` (the session, its will):
    /// hold the buffer (the CONNACK and whatever the session sends after
    /// it `[MQTT-3.2.0-1]`) until the store covers them, so Session
    /// Present never promises a session a crash can take back. While the
    /// store's writes fail, a CONNACK that needed it is refused (see
    /// `acks::refuse_connack`).
    pub(crate) fn hold_until_durable(&self, conn: &Rc<ConnShared>, since: Token) {
        let Some(log) = &self.log else { return };
        if log.refusing() && log.failing() {
            if log.appended() != since {
                acks::refuse_connack(conn);
            }
        } else if !(log.all_durable() && self.acks.is_empty()) {
            self.acks.park_release(log.appended(), conn);
        }
    }

    /// True when a PUBLISH at `qos` to the logged session on `conn` must
    /// wait (see [`ShardStore::park_publish`]) rather than be written now.
    ///
    /// QoS 2 (exactly once) waits until the store covers, on every shard,
    /// the value it carries (log sequence number `value`) and the record
    /// of its packet identifier: written earlier, a crash could take the
    /// value back after the subscriber saw it, and the publisher's resend
    /// would reach it again under a new identifier. So it waits while
    /// something this shard appended is not durable, something parked
    /// before it would be overtaken, or another shard is not durable up
    /// to `value`.
    ///
    /// QoS 1 (at least once) does not wait for the store: a delivery whose
    /// records a crash takes back is sent again after the restart (the
    /// value from the log, or, when the value itself was lost, from the
    /// publisher, which was not acknowledged and resends), a duplicate
    /// that QoS 1 allows; nothing acknowledged is lost, since a PUBACK
    /// still waits for its value. It waits only behind what is parked for
    /// `conn` already, so it never overtakes an earlier PUBLISH
    /// `[MQTT-4.6.0-6]`. (QoS 0 deliveries carry no identifier and never
    /// come here.)
    pub(crate) fn publish_must_wait(&self, conn: &ConnShared, qos: QoS, value: u64) -> bool {
        let Some(log) = &self.log else { return false };
        if qos != QoS::ExactlyOnce {
            return self.acks.waiting_for(conn.key);
        }
        !(log.all_durable() && self.acks.is_empty() && log.durable_lsn() >= value)
    }

    /// Write the encoded PUBLISH `frame` to `conn` (a logged session) once
    /// everything appended so far is durable, on every shard: the value it
    /// carries (log sequence `value`) and the record of its packet
    /// identifier ([`Record::Outbound`]). So a crash never takes back a
    /// value a subscriber saw, and a restart resends it with the same
    /// identifier.
    pub(crate) fn park_publish(&self, conn: &Rc<ConnShared>, value: u64, frame: bytes::Bytes) {
        if let Some(log) = &self.log {
            self.acks.park_publish(log.appended(), log.last_lsn().max(value), conn, frame);
        }
    }

    /// Inbound QoS 2 identifiers whose PUBREC was refused since the last
    /// call, for their sessions to forget (see [`acks::Forgotten`]).
    pub(crate) fn take_forgotten(&self) -> Vec<acks::Forgotten> {
        self.acks.take_forgotten()
    }

    /// Log a record about a persistent session.
    pub(crate) fn log(&self, record: Record) {
        if let Some(log) = &self.log {
            log.append(&record);
        }
    }

    /// Log a change a logged session returned.
    pub(crate) fn log_change(&self, client_id: &ByteString, change: SessionChange) {
        let client_id = client_id.clone();
        self.log(match change {
            SessionChange::Done { value } => Record::Done { client_id, value },
            SessionChange::InboundQos2 { packet_id, open } => Record::InboundQos2 { client_id, packet_id, open },
            SessionChange::Outbound { value, packet_id, released } => {
                Record::Outbound { client_id, value, packet_id, released }
            }
        })
    }

    /// Log a subscription change of a logged session (shared ones are not
    /// kept across a restart).
    pub(crate) fn log_subscription(&self, client_id: &ByteString, filter: &ByteString, subscription: Option<Subscription>) {
        if !self.is_durable() || fleetmq_core::topic::parse_shared(filter).is_some() {
            return;
        }
        let (client_id, filter) = (client_id.clone(), filter.clone());
        self.log(match subscription {
            Some(subscription) => Record::Subscribe { client_id, filter, subscription },
            None => Record::Unsubscribe { client_id, filter },
        })
    }

    /// Ask the log's committer to write what is pending and end.
    pub(crate) fn stop(&self) {
        if let Some(log) = &self.log {
            log.stop();
        }
    }
}
