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
pub(crate) mod health;
mod log;
mod open;

use std::rc::Rc;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Instant;

use bytestring::ByteString;
use fleetmq_core::packet::{Packet, QoS};
use fleetmq_core::session::{Message, SessionChange, Subscription};
use fleetmq_core::store::{Record, StoredMessage};

use crate::shard::ConnShared;
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
        let health = health::Health::new(metrics.store.clone(), shards, settings.max_bytes as u64, opened.snapshot_bytes);
        let health = Arc::new(health);
        metrics.set_store_health(health.clone());
        Arc::new(LocalStart { lsn: Arc::new(AtomicU64::new(opened.next_lsn)), health, settings: settings.clone(), opened })
    }
}

/// A shard's store.
pub(crate) enum ShardStore {
    /// `store.kind = "none"`: acknowledged on receipt.
    None,
    /// `store.kind = "local"`: this shard's log.
    Local(Rc<ShardLog>),
}

impl ShardStore {
    /// Shard `shard`'s store: its log of the local store `local`, or none.
    pub(crate) fn new(shard: usize, local: Option<&LocalStart>) -> ShardStore {
        match local {
            None => ShardStore::None,
            Some(l) => {
                let dir = l.opened.dir.clone();
                ShardStore::Local(Rc::new(ShardLog::new(shard, dir, &l.settings, l.lsn.clone(), l.health.clone())))
            }
        }
    }

    /// Start the log's committer task on the current executor.
    pub(crate) fn start(&self) -> Option<glommio::task::JoinHandle<()>> {
        match self {
            ShardStore::None => None,
            ShardStore::Local(log) => Some(glommio::spawn_local(log.clone().run()).detach()),
        }
    }

    /// True when acknowledgements wait for a store; false for `none`,
    /// whose acknowledgements the caller writes at once.
    pub(crate) fn is_durable(&self) -> bool {
        matches!(self, ShardStore::Local(_))
    }

    /// The token of the newest append (0 without a log): taken before a
    /// packet is handled, it tells [`ShardStore::acknowledge`] whether the
    /// packet appended anything.
    pub(crate) fn appended(&self) -> Token {
        match self {
            ShardStore::None => 0,
            ShardStore::Local(log) => log.appended(),
        }
    }

    /// Write `packets`, the acknowledgements of one packet from `conn`,
    /// once everything appended so far is durable, in order with the
    /// connection's earlier acknowledgements. While the store refuses,
    /// PUBACK and PUBREC are refused at once (see `AckQueue::fail`); the
    /// others are written at once if the packet appended nothing since
    /// `since` ([`ShardStore::appended`]), else refused too.
    pub(crate) fn acknowledge(&self, conn: &Rc<ConnShared>, packets: &mut Vec<Packet>, since: Token) {
        let ShardStore::Local(log) = self else {
            for packet in packets.drain(..) {
                conn.send(&packet);
            }
            return;
        };
        if log.refusing() {
            let appended = log.appended() != since;
            for packet in packets.drain(..) {
                match packet {
                    Packet::PubAck(_) | Packet::PubRec(_) => acks::refuse(conn, packet),
                    packet if appended => acks::refuse(conn, packet),
                    packet => conn.send(&packet),
                }
            }
        } else if log.all_durable() {
            for packet in packets.drain(..) {
                conn.send(&packet);
            }
        } else {
            let token = log.appended();
            for packet in packets.drain(..) {
                log.acks.park(token, conn, packet);
            }
        }
    }

    /// Log a value a client (or a will) published, once, before it is
    /// routed: QoS 1/2 and retained ones. Sets its [`Message::stored`].
    pub(crate) fn log_value(&self, message: &mut Message, now: Instant) {
        let ShardStore::Local(log) = self else { return };
        if (message.qos == QoS::AtMostOnce && !message.retain) || log.refusing() {
            return;
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
    }

    /// Log a record about a persistent session.
    pub(crate) fn log(&self, record: Record) {
        if let ShardStore::Local(log) = self {
            log.append(&record);
        }
    }

    /// Log a change a logged session returned.
    pub(crate) fn log_change(&self, client_id: &ByteString, change: SessionChange) {
        let client_id = client_id.clone();
        self.log(match change {
            SessionChange::Done { value } => Record::Done { client_id, value },
            SessionChange::InboundQos2 { packet_id, open } => Record::InboundQos2 { client_id, packet_id, open },
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
        if let ShardStore::Local(log) = self {
            log.stop();
        }
    }
}
