//! Prometheus metrics (DESIGN.md §12).
//!
//! One [`Metrics`] per process holds the registry; each shard takes its own
//! [`ShardMetrics`] once at start and increments plain atomics on the hot
//! path. Every series carries a `shard="<n>"` label, and every counter and
//! gauge sits in its own 128-byte aligned allocation, so two shards never
//! write to the same cache line.
//!
//! Series:
//!
//! | name | type | labels |
//! | --- | --- | --- |
//! | `fleetmq_clients_connected` | gauge | shard |
//! | `fleetmq_connections_parked` | gauge | shard |
//! | `fleetmq_publishers_moved_total` | counter | shard (the one it left) |
//! | `fleetmq_connections_handed_over_total` | counter | shard (the one that accepted), at (`accept`, `sign_in`) |
//! | `fleetmq_messages_in_total` | counter | shard |
//! | `fleetmq_messages_out_total` | counter | shard |
//! | `fleetmq_messages_dropped_total` | counter | shard, reason ([`DropReason`]) |
//! | `fleetmq_bytes_in_total` | counter | shard |
//! | `fleetmq_bytes_out_total` | counter | shard |
//! | `fleetmq_connect_refused_total` | counter | shard, reason ([`RefuseReason`]) |
//! | `fleetmq_auth_backoff_total` | counter | decision ([`BackoffDecision`]) |
//! | `fleetmq_auth_throttle_entries` | gauge | table ([`ThrottleTable`]) |
//! | `fleetmq_uptime_seconds` | gauge | — |

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::{counter, gauge};
use prometheus_client::registry::Registry;

/// HTTP `Content-Type` of [`Metrics::render`]'s output (OpenMetrics text,
/// which Prometheus scrapes natively).
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// A `u64` counter cell alone on its cache line (128 bytes covers adjacent
/// line prefetch on x86).
#[derive(Debug, Default)]
#[repr(align(128))]
pub struct PaddedU64(AtomicU64);

impl counter::Atomic<u64> for PaddedU64 {
    fn inc(&self) -> u64 {
        self.inc_by(1)
    }

    fn inc_by(&self, v: u64) -> u64 {
        self.0.fetch_add(v, Ordering::Relaxed)
    }

    fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// An `i64` gauge cell alone on its cache line.
#[derive(Debug, Default)]
#[repr(align(128))]
pub struct PaddedI64(AtomicI64);

impl gauge::Atomic<i64> for PaddedI64 {
    fn inc(&self) -> i64 {
        self.inc_by(1)
    }

    fn inc_by(&self, v: i64) -> i64 {
        self.0.fetch_add(v, Ordering::Relaxed)
    }

    fn dec(&self) -> i64 {
        self.dec_by(1)
    }

    fn dec_by(&self, v: i64) -> i64 {
        self.0.fetch_sub(v, Ordering::Relaxed)
    }

    fn set(&self, v: i64) -> i64 {
        self.0.swap(v, Ordering::Relaxed)
    }

    fn get(&self) -> i64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// A monotonic counter handle: cloning it is an `Arc` clone, `inc()` one
/// relaxed atomic add.
pub type Counter = counter::Counter<u64, PaddedU64>;

/// A gauge handle: cloning it is an `Arc` clone; `inc()`/`dec()`/`set()` are
/// one relaxed atomic operation.
pub type Gauge = gauge::Gauge<i64, PaddedI64>;

/// Why a message was dropped instead of delivered
/// (`fleetmq_messages_dropped_total{reason}`). A publish that no one
/// subscribes to is not a drop and is not counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DropReason {
    /// A subscriber's queue was full (`limits.max_subscriber_queue`); the
    /// oldest value was dropped.
    QueueFull,
    /// The packet would exceed the receiver's Maximum Packet Size
    /// [MQTT-3.1.2-25].
    PacketTooLarge,
    /// The message expiry interval ran out before delivery.
    Expired,
    /// The ACL refused the delivery.
    NotAuthorized,
    /// The bounded channel to another shard was full.
    ShardChannelFull,
    /// A shared subscription group's value kept for its members here when
    /// the last of them left, with no member on another replica to take
    /// it (MQTT 5 §4.8.2).
    NoMember,
}

impl DropReason {
    /// Every reason, in label order.
    pub const ALL: [DropReason; 6] = [
        DropReason::QueueFull,
        DropReason::PacketTooLarge,
        DropReason::Expired,
        DropReason::NotAuthorized,
        DropReason::ShardChannelFull,
        DropReason::NoMember,
    ];

    /// The `reason` label value, snake_case, e.g. `"queue_full"`.
    pub fn as_str(self) -> &'static str {
        match self {
            DropReason::QueueFull => "queue_full",
            DropReason::PacketTooLarge => "packet_too_large",
            DropReason::Expired => "expired",
            DropReason::NotAuthorized => "not_authorized",
            DropReason::ShardChannelFull => "shard_channel_full",
            DropReason::NoMember => "no_member",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Why a connection was refused before or at its CONNECT
/// (`fleetmq_connect_refused_total{reason}`; DESIGN.md §9 and the
/// `limits.*` settings). Every reason's series exists from the start, at 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RefuseReason {
    /// `limits.max_pending_connections` sockets were already waiting for
    /// their CONNECT, and every one of this shard's was progressing.
    MaxPendingConnections,
    /// A pending connection that had made the least progress was closed
    /// to make room for a new one at `limits.max_pending_connections`
    /// (see `crate::pending`).
    PendingEvicted,
    /// `limits.max_connections_per_source` from this address.
    MaxConnectionsPerSource,
    /// The CONNECT named a protocol level other than 3, 4 or 5
    /// [MQTT-3.1.2-2].
    UnsupportedProtocolVersion,
    /// The CONNECT was larger than `limits.max_connect_packet_bytes`.
    MaxConnectPacketBytes,
    /// The first packet was not a well-formed CONNECT [MQTT-3.1.0-1].
    MalformedConnect,
    /// The TLS or WebSocket handshake failed.
    HandshakeFailed,
    /// The client closed before its CONNECT was complete.
    ClosedBeforeConnect,
    /// No complete CONNECT within `limits.connect_timeout`.
    ConnectTimeout,
    /// `limits.max_clients` clients were connected (Server busy).
    MaxClients,
    /// `limits.max_connects_authenticating` sign-ins were in progress or
    /// waiting and none could make room (see `crate::signin`), or a
    /// waiting one was evicted to make room for another.
    MaxConnectsAuthenticating,
    /// Wrong user name or password.
    BadCredentials,
    /// The user name (or, with `limits.trust_client_addresses`, the
    /// address) backs off after failed sign-ins, and this combination of
    /// user name and client identifier did not sign in recently; or it
    /// did, and backs off itself. Not checked: 0x87 (3.1.1: 5).
    AuthThrottled,
    /// The user name spent its `limits.auth_check_rate_per_credential`
    /// budget of failing checks. Not checked: 0x89 Server busy (3.1.1: 3).
    AuthCheckRatePerCredential,
    /// Authentication refused the client (no credentials, bad token, ...).
    NotAuthorized,
    /// `limits.max_connections_per_credential` for this user name.
    MaxConnectionsPerCredential,
    /// The CONNECT's fields could not be accepted (client identifier,
    /// Session Expiry Interval, Will, ...): its CONNACK names the reason code.
    ConnectRefused,
    /// Another connection holds the client identifier and may not be taken
    /// over.
    ClientIdInUse,
    /// The replica is fenced (DESIGN.md §5): CONNACK 0x88.
    Fenced,
    /// The cluster did not take the client identifier claim within
    /// `cluster.connect_budget` (DESIGN.md §8): CONNACK 0x88.
    ClusterUnavailable,
}

impl RefuseReason {
    /// Every reason, in label order.
    pub const ALL: [RefuseReason; 20] = [
        RefuseReason::MaxPendingConnections,
        RefuseReason::PendingEvicted,
        RefuseReason::MaxConnectionsPerSource,
        RefuseReason::UnsupportedProtocolVersion,
        RefuseReason::MaxConnectPacketBytes,
        RefuseReason::MalformedConnect,
        RefuseReason::HandshakeFailed,
        RefuseReason::ClosedBeforeConnect,
        RefuseReason::ConnectTimeout,
        RefuseReason::MaxClients,
        RefuseReason::MaxConnectsAuthenticating,
        RefuseReason::BadCredentials,
        RefuseReason::AuthThrottled,
        RefuseReason::AuthCheckRatePerCredential,
        RefuseReason::NotAuthorized,
        RefuseReason::MaxConnectionsPerCredential,
        RefuseReason::ConnectRefused,
        RefuseReason::ClientIdInUse,
        RefuseReason::Fenced,
        RefuseReason::ClusterUnavailable,
    ];

    /// The `reason` label value, snake_case, e.g. `"max_clients"`.
    pub fn as_str(self) -> &'static str {
        match self {
            RefuseReason::MaxPendingConnections => "max_pending_connections",
            RefuseReason::PendingEvicted => "pending_evicted",
            RefuseReason::MaxConnectionsPerSource => "max_connections_per_source",
            RefuseReason::UnsupportedProtocolVersion => "unsupported_protocol_version",
            RefuseReason::MaxConnectPacketBytes => "max_connect_packet_bytes",
            RefuseReason::MalformedConnect => "malformed_connect",
            RefuseReason::HandshakeFailed => "handshake_failed",
            RefuseReason::ClosedBeforeConnect => "closed_before_connect",
            RefuseReason::ConnectTimeout => "connect_timeout",
            RefuseReason::MaxClients => "max_clients",
            RefuseReason::MaxConnectsAuthenticating => "max_connects_authenticating",
            RefuseReason::BadCredentials => "bad_credentials",
            RefuseReason::AuthThrottled => "auth_throttled",
            RefuseReason::AuthCheckRatePerCredential => "auth_check_rate_per_credential",
            RefuseReason::NotAuthorized => "not_authorized",
            RefuseReason::MaxConnectionsPerCredential => "max_connections_per_credential",
            RefuseReason::ConnectRefused => "connect_refused",
            RefuseReason::ClientIdInUse => "client_id_in_use",
            RefuseReason::Fenced => "fenced",
            RefuseReason::ClusterUnavailable => "cluster_unavailable",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// What the failed sign-in guard decided about a sign-in
/// (`fleetmq_auth_backoff_total{decision}`; [`crate::auth::guard`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum BackoffDecision {
    /// The user name or address backed off, but this device (user name,
    /// client identifier, trusted address) signed in before: checked.
    RecognisedChecked,
    /// Of those checked, the credentials were right: signed in.
    RecognisedAccepted,
    /// The device signed in before but backs off after failures of its
    /// own: refused unchecked.
    RecognisedBackingOff,
    /// The user name or address backed off and the combination was new:
    /// refused unchecked, whatever the password.
    UnrecognisedRefused,
    /// The user name's check budget was spent: refused unchecked.
    OverBudget,
}

impl BackoffDecision {
    /// Every decision, in label order.
    pub const ALL: [BackoffDecision; 5] = [
        BackoffDecision::RecognisedChecked,
        BackoffDecision::RecognisedAccepted,
        BackoffDecision::RecognisedBackingOff,
        BackoffDecision::UnrecognisedRefused,
        BackoffDecision::OverBudget,
    ];

    /// The `decision` label value, e.g. `"recognised_checked"`.
    pub fn as_str(self) -> &'static str {
        match self {
            BackoffDecision::RecognisedChecked => "recognised_checked",
            BackoffDecision::RecognisedAccepted => "recognised_accepted",
            BackoffDecision::RecognisedBackingOff => "recognised_backing_off",
            BackoffDecision::UnrecognisedRefused => "unrecognised_refused",
            BackoffDecision::OverBudget => "over_budget",
        }
    }
}

/// A table of the failed sign-in guard
/// (`fleetmq_auth_throttle_entries{table}`), each bounded by
/// `limits.auth_throttle_max_entries` (known devices by
/// `limits.auth_known_devices`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ThrottleTable {
    /// User names and trusted addresses with recent failures.
    Failures,
    /// Recognised devices with recent failures of their own.
    DeviceFailures,
    /// Devices that signed in successfully.
    KnownDevices,
    /// User names whose check budget is not full.
    Budgets,
}

impl ThrottleTable {
    /// Every table, in label order.
    pub const ALL: [ThrottleTable; 4] = [
        ThrottleTable::Failures,
        ThrottleTable::DeviceFailures,
        ThrottleTable::KnownDevices,
        ThrottleTable::Budgets,
    ];

    /// The `table` label value, e.g. `"known_devices"`.
    pub fn as_str(self) -> &'static str {
        match self {
            ThrottleTable::Failures => "failures",
            ThrottleTable::DeviceFailures => "device_failures",
            ThrottleTable::KnownDevices => "known_devices",
            ThrottleTable::Budgets => "budgets",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EncodeLabelSet)]
struct DecisionLabel {
    decision: &'static str,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EncodeLabelSet)]
struct TableLabel {
    table: &'static str,
}

/// The failed sign-in guard's series. Process-wide, not per shard: the
/// guard is shared by every shard and runs on their blocking threads.
/// Cloning shares the series.
#[derive(Debug, Clone, Default)]
pub struct SignInMetrics {
    decisions: Family<DecisionLabel, Counter>,
    entries: Family<TableLabel, Gauge>,
}

impl SignInMetrics {
    /// Counts one `decision` (`fleetmq_auth_backoff_total{decision}`).
    pub fn count(&self, decision: BackoffDecision) {
        self.decisions
            .get_or_create(&DecisionLabel {
                decision: decision.as_str(),
            })
            .inc();
    }

    /// Sets the size of `table` (`fleetmq_auth_throttle_entries{table}`).
    pub fn set_entries(&self, table: ThrottleTable, entries: usize) {
        let entries = i64::try_from(entries).unwrap_or(i64::MAX);
        self.entries
            .get_or_create(&TableLabel {
                table: table.as_str(),
            })
            .set(entries);
    }

    fn register(&self, registry: &mut Registry) {
        for decision in BackoffDecision::ALL {
            drop(self.decisions.get_or_create(&DecisionLabel {
                decision: decision.as_str(),
            }));
        }
        for table in ThrottleTable::ALL {
            drop(self.entries.get_or_create(&TableLabel {
                table: table.as_str(),
            }));
        }
        registry.register(
            "auth_backoff",
            "Sign-ins the failed sign-in guard let through or refused unchecked, by decision",
            self.decisions.clone(),
        );
        registry.register(
            "auth_throttle_entries",
            "Entries in the failed sign-in guard's bounded tables",
            self.entries.clone(),
        );
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ShardLabel {
    shard: usize,
}

/// A shard and the step a connection was handed over at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ShardStep {
    shard: usize,
    at: &'static str,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ShardReason {
    shard: usize,
    reason: &'static str,
}

/// The process's metrics registry; shared between shards and the admin
/// thread through an `Arc` (it is `Send + Sync`).
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    clients_connected: Family<ShardLabel, Gauge>,
    connections_parked: Family<ShardLabel, Gauge>,
    publishers_moved: Family<ShardLabel, Counter>,
    handed_over: Family<ShardStep, Counter>,
    messages_in: Family<ShardLabel, Counter>,
    messages_out: Family<ShardLabel, Counter>,
    bytes_in: Family<ShardLabel, Counter>,
    bytes_out: Family<ShardLabel, Counter>,
    dropped: Family<ShardReason, Counter>,
    connect_refused: Family<ShardReason, Counter>,
    uptime_seconds: Gauge,
    started: Instant,
    shards: usize,
    /// The local store's series (see [`crate::store::health`]).
    pub(crate) store: crate::store::health::StoreMetrics,
    /// The local store's health, when there is one.
    store_health: std::sync::OnceLock<Arc<crate::store::health::Health>>,
    /// The replica's cluster, set once at start in cluster mode.
    cluster: std::sync::OnceLock<Arc<crate::cluster::Node>>,
}

/// Node-wide sums of the per-shard series, for the `$SYS/broker/...`
/// topics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Totals {
    /// Clients connected.
    pub clients_connected: i64,
    /// PUBLISH packets received.
    pub messages_in: u64,
    /// PUBLISH packets sent.
    pub messages_out: u64,
    /// Messages dropped, all reasons.
    pub messages_dropped: u64,
    /// Bytes read.
    pub bytes_in: u64,
    /// Bytes written.
    pub bytes_out: u64,
    /// Seconds since start.
    pub uptime_seconds: u64,
}

impl Metrics {
    /// Creates the registry with every per-shard series of shards
    /// `0..shards` present (at zero), so dashboards see them before the
    /// first event, and sign-in series of their own.
    pub fn new(shards: usize) -> Arc<Metrics> {
        Metrics::with_sign_in(shards, &SignInMetrics::default())
    }

    /// [`Metrics::new`] rendering `sign_in` (the authenticator's,
    /// [`crate::auth::Authenticator::sign_in_metrics`]) too.
    pub fn with_sign_in(shards: usize, sign_in: &SignInMetrics) -> Arc<Metrics> {
        let mut registry = Registry::with_prefix("fleetmq");
        let store = crate::store::health::StoreMetrics::register(&mut registry, shards);
        let m = Metrics {
            registry: Registry::default(),
            clients_connected: Family::default(),
            connections_parked: Family::default(),
            publishers_moved: Family::default(),
            handed_over: Family::default(),
            messages_in: Family::default(),
            messages_out: Family::default(),
            bytes_in: Family::default(),
            bytes_out: Family::default(),
            dropped: Family::default(),
            connect_refused: Family::default(),
            uptime_seconds: Gauge::default(),
            started: Instant::now(),
            shards,
            store,
            store_health: std::sync::OnceLock::new(),
            cluster: std::sync::OnceLock::new(),
        };
        let r = &mut registry;
        r.register(
            "clients_connected",
            "MQTT clients connected (CONNACK sent, not yet closed)",
            m.clients_connected.clone(),
        );
        r.register(
            "connections_parked",
            "Idle TCP connections parked in the shard's epoll set (no task, no io_uring poll)",
            m.connections_parked.clone(),
        );
        r.register(
            "publishers_moved",
            "Publishers moved from this shard to the shard of their subscribers",
            m.publishers_moved.clone(),
        );
        r.register(
            "connections_handed_over",
            "Connections this shard accepted and handed to the shard that owns their client identifier, \
             at accept (the whole CONNECT in the first read) or after sign-in",
            m.handed_over.clone(),
        );
        r.register(
            "messages_in",
            "PUBLISH packets received from clients",
            m.messages_in.clone(),
        );
        r.register(
            "messages_out",
            "PUBLISH packets sent to clients",
            m.messages_out.clone(),
        );
        r.register(
            "messages_dropped",
            "Messages dropped instead of delivered, by reason",
            m.dropped.clone(),
        );
        r.register(
            "bytes_in",
            "Bytes read from MQTT connections",
            m.bytes_in.clone(),
        );
        r.register(
            "bytes_out",
            "Bytes written to MQTT connections",
            m.bytes_out.clone(),
        );
        r.register(
            "connect_refused",
            "Connections refused before or at CONNACK, by reason",
            m.connect_refused.clone(),
        );
        sign_in.register(r);
        r.register(
            "uptime_seconds",
            "Seconds since the process started its metrics",
            m.uptime_seconds.clone(),
        );
        let m = Metrics { registry, ..m };
        for shard in 0..shards {
            drop(m.shard(shard));
        }
        Arc::new(m)
    }

    /// Report the local store's health from now on (readiness).
    pub(crate) fn set_store_health(&self, health: Arc<crate::store::health::Health>) {
        let _ = self.store_health.set(health);
    }

    /// Why the store refuses publishes (disk full, a write error, the log
    /// over `store.max_bytes`), or `None` while it takes them.
    pub fn store_problem(&self) -> Option<String> {
        self.store_health.get().and_then(|h| h.problem())
    }

    /// The handles shard `shard` increments. Calling it again for the same
    /// shard returns handles to the same series; a shard number beyond the
    /// one given to [`Metrics::new`] adds its series.
    pub fn shard(&self, shard: usize) -> ShardMetrics {
        let label = ShardLabel { shard };
        let dropped = DropReason::ALL.map(|reason| {
            self.dropped
                .get_or_create(&ShardReason {
                    shard,
                    reason: reason.as_str(),
                })
                .clone()
        });
        let connect_refused = RefuseReason::ALL.map(|reason| {
            self.connect_refused
                .get_or_create(&ShardReason {
                    shard,
                    reason: reason.as_str(),
                })
                .clone()
        });
        // One statement each: the family's guard lives to the end of its
        // statement, and a second `get_or_create` within it would deadlock.
        let handed_over_at_accept = self.handed_over.get_or_create(&ShardStep { shard, at: "accept" }).clone();
        let handed_over_at_sign_in = self.handed_over.get_or_create(&ShardStep { shard, at: "sign_in" }).clone();
        ShardMetrics {
            clients_connected: self.clients_connected.get_or_create(&label).clone(),
            connections_parked: self.connections_parked.get_or_create(&label).clone(),
            publishers_moved: self.publishers_moved.get_or_create(&label).clone(),
            handed_over_at_accept,
            handed_over_at_sign_in,
            messages_in: self.messages_in.get_or_create(&label).clone(),
            messages_out: self.messages_out.get_or_create(&label).clone(),
            bytes_in: self.bytes_in.get_or_create(&label).clone(),
            bytes_out: self.bytes_out.get_or_create(&label).clone(),
            dropped,
            connect_refused,
            shard,
        }
    }

    /// Sums over every shard (each read is a relaxed load, so the figures
    /// are each exact but not a snapshot of one instant).
    pub fn totals(&self) -> Totals {
        let mut t = Totals { uptime_seconds: self.started.elapsed().as_secs(), ..Totals::default() };
        for shard in 0..self.shards {
            let label = ShardLabel { shard };
            t.clients_connected += self.clients_connected.get_or_create(&label).get();
            t.messages_in += self.messages_in.get_or_create(&label).get();
            t.messages_out += self.messages_out.get_or_create(&label).get();
            t.bytes_in += self.bytes_in.get_or_create(&label).get();
            t.bytes_out += self.bytes_out.get_or_create(&label).get();
            for reason in DropReason::ALL {
                t.messages_dropped += self.dropped.get_or_create(&ShardReason { shard, reason: reason.as_str() }).get();
            }
        }
        t
    }

    /// Every series in the OpenMetrics text format (served with
    /// [`CONTENT_TYPE`]), ending with `# EOF`.
    pub fn render(&self) -> String {
        let uptime = i64::try_from(self.started.elapsed().as_secs()).unwrap_or(i64::MAX);
        self.uptime_seconds.set(uptime);
        let mut out = String::with_capacity(4096);
        // Writing into a String cannot fail; an error here would be a bug in
        // a metric's encoder.
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("encoding metrics into a String");
        if let Some(node) = self.cluster.get() {
            if let Some(body) = out.strip_suffix("# EOF\n").map(str::len) {
                out.truncate(body);
                node.render_metrics(&mut out);
                out.push_str("# EOF\n");
            }
        }
        out
    }

    /// Attach the replica's cluster: its series join [`Metrics::render`],
    /// its fence and status join readiness and `/api/v1/status`.
    pub(crate) fn set_cluster(&self, node: Arc<crate::cluster::Node>) {
        let _ = self.cluster.set(node);
    }

    /// Why the broker is not ready beyond starting (DESIGN.md §12: fenced,
    /// a duplicate replica ID), `None` when nothing holds it back.
    pub fn not_ready(&self) -> Option<String> {
        self.cluster.get().and_then(|node| node.not_ready())
    }

    /// The `/api/v1/status` document: replica, shards, connections, and
    /// the cluster's fields in cluster mode (DESIGN.md §12).
    pub fn status_json(&self) -> String {
        let totals = self.totals();
        let mut doc = serde_json::json!({
            "shards": self.shards,
            "connections": totals.clients_connected,
            "uptime_seconds": totals.uptime_seconds,
            "cluster": null,
        });
        if let Some(node) = self.cluster.get() {
            doc["cluster"] = node.status_json();
            doc["replica"] = doc["cluster"]["replica"].clone();
            doc["fenced"] = doc["cluster"]["fenced"].clone();
            doc["members"] = doc["cluster"]["members"].clone();
        }
        doc.to_string()
    }
}

/// One shard's metric handles. Take it once per shard and keep it (or clones
/// of its fields) in the shard's state; increments are single relaxed atomic
/// operations on memory no other shard writes.
#[derive(Debug, Clone)]
pub struct ShardMetrics {
    /// `fleetmq_clients_connected{shard}`: inc at CONNACK, dec at close.
    pub clients_connected: Gauge,
    /// `fleetmq_connections_parked{shard}`: inc when a connection parks,
    /// dec when it wakes.
    pub connections_parked: Gauge,
    /// `fleetmq_publishers_moved_total{shard}`: publishers this shard moved
    /// to the shard of their subscribers.
    pub publishers_moved: Counter,
    /// `fleetmq_connections_handed_over_total{shard,at="accept"}`:
    /// connections this shard accepted and handed, with their whole
    /// CONNECT read at accept, to the shard that owns their client
    /// identifier (`crate::arrival`).
    pub handed_over_at_accept: Counter,
    /// `fleetmq_connections_handed_over_total{shard,at="sign_in"}`: the
    /// same, handed over after this shard signed them in (their CONNECT
    /// came later, over TLS or WebSocket, or with a password or JWT to
    /// check: `crate::arrival`).
    pub handed_over_at_sign_in: Counter,
    /// `fleetmq_messages_in_total{shard}`: PUBLISH packets received.
    pub messages_in: Counter,
    /// `fleetmq_messages_out_total{shard}`: PUBLISH packets sent.
    pub messages_out: Counter,
    /// `fleetmq_bytes_in_total{shard}`: bytes read from MQTT connections.
    pub bytes_in: Counter,
    /// `fleetmq_bytes_out_total{shard}`: bytes written to MQTT connections.
    pub bytes_out: Counter,
    dropped: [Counter; DropReason::ALL.len()],
    connect_refused: [Counter; RefuseReason::ALL.len()],
    shard: usize,
}

impl ShardMetrics {
    /// Counts one message dropped for `reason`
    /// (`fleetmq_messages_dropped_total{shard,reason}`); one atomic add.
    pub fn dropped(&self, reason: DropReason) {
        self.dropped[reason.index()].inc();
    }

    /// Counts one connection refused for `reason`
    /// (`fleetmq_connect_refused_total{shard,reason}`); one atomic add.
    pub fn connect_refused(&self, reason: RefuseReason) {
        self.connect_refused[reason.index()].inc();
    }

    /// The shard these handles belong to.
    pub fn shard(&self) -> usize {
        self.shard
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_series_of_every_shard_is_rendered_from_the_start() {
        let m = Metrics::new(2);
        let text = m.render();
        for name in [
            "fleetmq_clients_connected{shard=\"1\"} 0",
            "fleetmq_messages_in_total{shard=\"0\"} 0",
            "fleetmq_messages_out_total{shard=\"1\"} 0",
            "fleetmq_bytes_in_total{shard=\"0\"} 0",
            "fleetmq_bytes_out_total{shard=\"1\"} 0",
            "fleetmq_messages_dropped_total{shard=\"0\",reason=\"queue_full\"} 0",
            "fleetmq_connect_refused_total{shard=\"1\",reason=\"max_clients\"} 0",
            "fleetmq_connect_refused_total{shard=\"0\",reason=\"client_id_in_use\"} 0",
            "fleetmq_auth_backoff_total{decision=\"recognised_checked\"} 0",
            "fleetmq_auth_throttle_entries{table=\"known_devices\"} 0",
            "fleetmq_uptime_seconds ",
        ] {
            assert!(text.contains(name), "missing {name} in\n{text}");
        }
        assert!(text.ends_with("# EOF\n"));
    }

    #[test]
    fn increments_show_under_their_shard_and_reason() {
        let m = Metrics::new(2);
        let s1 = m.shard(1);
        s1.clients_connected.inc();
        s1.messages_in.inc_by(3);
        s1.bytes_out.inc_by(100);
        s1.dropped(DropReason::ShardChannelFull);
        s1.connect_refused(RefuseReason::MaxClients);
        s1.connect_refused(RefuseReason::MaxClients);
        let again = m.shard(1);
        again.messages_in.inc();
        let text = m.render();
        for line in [
            "fleetmq_clients_connected{shard=\"1\"} 1",
            "fleetmq_clients_connected{shard=\"0\"} 0",
            "fleetmq_messages_in_total{shard=\"1\"} 4",
            "fleetmq_bytes_out_total{shard=\"1\"} 100",
            "fleetmq_messages_dropped_total{shard=\"1\",reason=\"shard_channel_full\"} 1",
            "fleetmq_connect_refused_total{shard=\"1\",reason=\"max_clients\"} 2",
        ] {
            assert!(text.contains(line), "missing {line} in\n{text}");
        }
    }

    #[test]
    fn counter_cells_fill_whole_cache_lines() {
        assert_eq!(std::mem::align_of::<PaddedU64>(), 128);
        assert_eq!(std::mem::align_of::<PaddedI64>(), 128);
    }

    #[test]
    fn metrics_are_shareable_between_threads() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<Metrics>();
        assert_send_sync::<ShardMetrics>();
    }
}
