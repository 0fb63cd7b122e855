//! The session state machine (MQTT 5 §4.1, §4.3, §4.4, §4.6).
//!
//! A [`Session`] holds what MQTT calls the session state on the server: the
//! subscriptions, the QoS 1/2 messages sent to the client and not yet
//! acknowledged, the messages waiting for the client (offline, or beyond its
//! Receive Maximum), and the packet identifiers of inbound QoS 2 messages
//! between PUBREC and PUBREL.
//!
//! It does no I/O and reads no clock: the caller feeds it decoded packets
//! ([`Session::handle`]) and messages to deliver ([`Session::deliver`]) with
//! the current time, and carries out the [`Output`]s it returns, in order.
//! Routing, the subscription trie, retained messages and wills belong to the
//! caller (the shard).

pub mod connect;
pub mod timing;

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::num::NonZeroU16;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use bytestring::ByteString;

use crate::packet::{
    Disconnect, Packet, PacketId, Props, ProtocolVersion, PubResponse, Publish, QoS,
    ReasonCode, SubAck, Subscribe, SubscriptionOptions, UnsubAck, Unsubscribe,
};
use crate::topic::{parse_shared, validate_topic_filter, validate_topic_name, violates_3_1_1, TopicLimits};

pub use connect::{negotiate, ConnectLimits, Negotiated, Refusal};

/// An application message as the broker routes it: immutable and shared
/// (`Arc`) by every shard and subscriber that receives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// The topic name.
    pub topic: ByteString,
    /// The payload, never copied per subscriber.
    pub payload: Bytes,
    /// The QoS it was published with.
    pub qos: QoS,
    /// The RETAIN flag it was published with.
    pub retain: bool,
    /// Properties forwarded to subscribers unchanged (MQTT 5 §3.3.2.3):
    /// Payload Format Indicator, Message Expiry Interval, Content Type,
    /// Response Topic, Correlation Data, User Properties. Topic Alias and
    /// Subscription Identifiers are never kept here.
    pub properties: Props,
    /// When the broker received it; the Message Expiry Interval counts from
    /// here (MQTT 5 §3.3.2.3.3).
    pub received_at: Instant,
    /// A hash of the publisher's client identifier ([`client_key`]), for No
    /// Local `[MQTT-3.8.3-3]` and the `hash_client_id` shared strategy;
    /// `u64::MAX` for messages the broker itself publishes ($SYS).
    pub origin: u64,
    /// Its log sequence number in the local store (`store::Record::Value`),
    /// 0 when it was not stored (QoS 0, `store.kind = "none"`).
    pub stored: u64,
    /// It came from another replica over the mesh (DESIGN.md §3, §11):
    /// delivered to this replica's subscribers only, never forwarded to
    /// another replica again, and, retained, not stored here (the
    /// publishing replica stored it in `mqtt-retained`).
    pub from_mesh: bool,
    /// Which of this replica's shared subscription groups get it: the mesh
    /// gives a value to one member replica per group (DESIGN.md §13).
    pub groups: GroupPick,
}

/// Which shared subscription groups of this replica a message is for.
///
/// One pointer wide ([`GroupPick::ALL`] is `None`), so that a [`Message`]
/// stays within 128 bytes: it is moved by value on the publish path (into
/// `Output::Publish`, into its `Arc`), and past 128 bytes each move is a
/// `memcpy` call (perf/RESULTS.md, 2026-12-07, session 40).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GroupPick(Option<Arc<Pick>>);

/// The groups a [`GroupPick`] names, and what it does with them.
#[derive(Debug, PartialEq, Eq)]
enum Pick {
    /// Only the groups named.
    Only(Box<[ByteString]>),
    /// Every group but those named.
    Except(Box<[ByteString]>),
}

impl GroupPick {
    /// Every group (no other replica has members of a group it matches).
    pub const ALL: GroupPick = GroupPick(None);

    /// Only the groups `names` (a value from the mesh: those the
    /// publishing replica picked this one for; none for a value sent for
    /// plain subscriptions only).
    pub fn only(names: impl Into<Box<[ByteString]>>) -> GroupPick {
        GroupPick(Some(Arc::new(Pick::Only(names.into()))))
    }

    /// Every group but `names` (a value published here whose groups went
    /// to a member on another replica).
    pub fn except(names: impl Into<Box<[ByteString]>>) -> GroupPick {
        GroupPick(Some(Arc::new(Pick::Except(names.into()))))
    }

    /// Whether every group gets it ([`GroupPick::ALL`]).
    pub fn is_all(&self) -> bool {
        self.0.is_none()
    }

    /// Whether the group named `group` (the share name) gets it.
    pub fn allows(&self, group: &str) -> bool {
        match self.0.as_deref() {
            None => true,
            Some(Pick::Only(names)) => names.iter().any(|g| g == group),
            Some(Pick::Except(names)) => !names.iter().any(|g| g == group),
        }
    }
}

impl Message {
    /// Seconds of the Message Expiry Interval left at `now`: `None` when the
    /// message has no expiry, `Some(0)` once it has expired.
    pub fn expiry_left(&self, now: Instant) -> Option<u32> {
        let interval = self.properties.message_expiry_interval?;
        let waited = now.saturating_duration_since(self.received_at).as_secs();
        Some(u64::from(interval).saturating_sub(waited) as u32)
    }
}

/// One subscription of a session (MQTT 5 §3.8.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Subscription {
    /// The subscription options.
    pub options: SubscriptionOptions,
    /// The Subscription Identifier, 1..=268,435,455 (MQTT 5 §3.8.2.1.2).
    pub identifier: Option<u32>,
}

/// A message on its way to one session: the shared message and what this
/// session's subscriptions make of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivery {
    /// The message.
    pub message: Arc<Message>,
    /// min(published QoS, subscription QoS) `[MQTT-3.8.4-8]`.
    pub qos: QoS,
    /// The RETAIN flag to send (Retain As Published, or a retained message
    /// sent because of a subscribe `[MQTT-3.3.1-8]`, `[MQTT-3.3.1-9]`).
    pub retain: bool,
    /// Subscription Identifiers of the matching subscriptions (MQTT 5).
    pub subscription_ids: Vec<u32>,
    /// The shared subscription (`$share/{group}/{filter}`) it came through,
    /// if any: such a delivery goes back to its group when this session
    /// goes offline before acknowledging it.
    pub group: Option<ByteString>,
}

/// A delivery of a session log value sent and not yet acknowledged (see
/// [`Session::log_position`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogSent {
    /// Its log sequence ([`Message::stored`]).
    pub seq: u64,
    /// The packet identifier it went out with.
    pub packet_id: u16,
    /// The QoS it went out with.
    pub qos: QoS,
    /// QoS 2: its PUBREC came, PUBREL sent.
    pub released: bool,
}

/// The key of a client identifier carried in [`Message::origin`]: a stable
/// 64-bit hash.
pub fn client_key(client_id: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    client_id.hash(&mut h);
    h.finish() & (u64::MAX >> 1)
}

/// What the caller must do, in order, after a call into the session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Output {
    /// Write this packet to the client.
    Send(Packet),
    /// Write this acknowledgement (PUBACK, PUBREC, SUBACK, UNSUBACK) once
    /// what the caller did for this packet's other outputs (the message
    /// routed and stored, the subscription changed) is durable in the store
    /// (DESIGN.md §7): at once with `store.kind = "none"`, after the sync
    /// that covers them with a durable store. Acknowledgements of one
    /// connection are written in the order they were returned.
    Acknowledge(Packet),
    /// Write a PUBLISH for `delivery` with this packet identifier (QoS > 0)
    /// and DUP flag.
    Deliver {
        /// The message and how to send it.
        delivery: Delivery,
        /// Present exactly when `delivery.qos` > 0.
        packet_id: Option<PacketId>,
        /// True when this is a redelivery `[MQTT-3.3.1-1]`.
        dup: bool,
    },
    /// Route this message, published by the client, to its subscribers.
    Publish(Message),
    /// Add (or replace) this subscription in the routing structures, then
    /// send matching retained messages per its Retain Handling.
    Subscribed {
        /// The topic filter.
        filter: ByteString,
        /// Its options and identifier.
        subscription: Subscription,
        /// True when the subscription replaced an existing one (Retain
        /// Handling 1 then sends nothing).
        existed: bool,
    },
    /// Remove this subscription from the routing structures.
    Unsubscribed {
        /// The topic filter.
        filter: ByteString,
    },
    /// Log this change of the session's durable state (only for a session
    /// marked with [`Session::set_logged`]), before the acknowledgements
    /// returned after it.
    Log(SessionChange),
    /// Close the connection. MQTT 5 clients first get DISCONNECT with
    /// `reason` when it is `Some`.
    Close {
        /// Reason code of the server's DISCONNECT (MQTT 5), or `None` when
        /// no DISCONNECT is sent (the client disconnected, or 3.1.x).
        reason: Option<ReasonCode>,
        /// Whether the Will Message is published (MQTT 5 §3.1.2.5).
        publish_will: bool,
    },
}

/// A change of a logged session's state that the store records (see
/// [`Output::Log`]; the records are `store::Record::Done` and
/// `store::Record::InboundQos2`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionChange {
    /// The session is done with the stored message `value` (its
    /// [`Message::stored`]): acknowledged by the client, or dropped.
    Done {
        /// The message's log sequence number.
        value: u64,
    },
    /// An inbound QoS 2 packet identifier was opened (before PUBREC) or
    /// released (before PUBCOMP).
    InboundQos2 {
        /// The packet identifier.
        packet_id: u16,
        /// Opened (true) or released.
        open: bool,
    },
    /// The stored message `value` goes out with `packet_id` (returned
    /// before its [`Output::Deliver`]), or its PUBREC came back (`released`,
    /// returned before the PUBREL, which is then an [`Output::Acknowledge`]:
    /// written once this is durable, so a restart never sends the PUBLISH
    /// again after the PUBREL `[MQTT-4.3.3-6]`).
    Outbound {
        /// The message's log sequence number.
        value: u64,
        /// The packet identifier it goes out with.
        packet_id: u16,
        /// PUBREC received, PUBREL sent.
        released: bool,
    },
}

/// What a client may do: the broker's access control, asked by the session
/// on PUBLISH, SUBSCRIBE and each delivery (DESIGN.md §9). Topics and
/// filters are as the client sees them (without workspace prefix).
/// `Send + Sync`: a session may move to another shard with its authorizer.
pub trait Authorize: Send + Sync {
    /// May the client publish to `topic`?
    fn may_publish(&self, topic: &str) -> bool;
    /// May the client subscribe to `filter`?
    fn may_subscribe(&self, filter: &str) -> bool;
    /// May the client receive a message on `topic`?
    fn may_receive(&self, topic: &str) -> bool;
}

/// Whether a client whose access control is `authorizer` (`None`: no
/// ACL) may publish to `topic`, by PUBLISH or through its will: never into
/// `$SYS/`, which belongs to the broker (MQTT 5 §4.7.2; clients may read
/// it), and only where the ACL allows.
pub fn client_may_publish(authorizer: Option<&dyn Authorize>, topic: &str) -> bool {
    let broker_owned = topic == "$SYS" || topic.starts_with("$SYS/");
    !broker_owned && authorizer.is_none_or(|a| a.may_publish(topic))
}

/// How long a delivery decision of [`Authorize::may_receive`] is reused
/// per topic (`auth.acl_cache_ttl`), and how many topics are remembered.
#[derive(Debug, Clone, Copy)]
pub struct AuthorizeCache {
    /// Reuse a decision this long (default 60 s).
    pub ttl: std::time::Duration,
    /// Remember at most this many topics per session (default 1024).
    pub max_topics: usize,
}

impl Default for AuthorizeCache {
    fn default() -> Self {
        AuthorizeCache { ttl: std::time::Duration::from_secs(60), max_topics: 1024 }
    }
}

/// Limits a session enforces (DESIGN.md §9).
#[derive(Debug, Clone)]
pub struct SessionLimits {
    /// Our Receive Maximum: inbound QoS 2 flows open at once before an
    /// MQTT 5 client gets DISCONNECT 0x93 (default 1000). MQTT 3.1/3.1.1
    /// has no Receive Maximum: such a client may keep every packet
    /// identifier open (65,535 at most).
    pub receive_maximum: u16,
    /// Messages waiting per session before the oldest is dropped (default
    /// 10,000).
    pub max_queue: usize,
    /// Subscriptions per session (default 1000).
    pub max_subscriptions: usize,
    /// Topic name and filter limits.
    pub topic: TopicLimits,
    /// Our own cap on QoS 1/2 PUBLISHes in flight to one client, below the
    /// client's Receive Maximum (default 1000, `maxClientWritesPending`): it
    /// bounds what one connection can hold in the broker's write buffers.
    pub max_inflight: u16,
    /// Topic Alias Maximum we announced (0: inbound aliases refused).
    pub topic_alias_maximum: u16,
}

impl Default for SessionLimits {
    fn default() -> Self {
        SessionLimits {
            receive_maximum: 1000,
            max_queue: 10_000,
            max_subscriptions: 1000,
            topic: TopicLimits::default(),
            max_inflight: 1000,
            topic_alias_maximum: 64,
        }
    }
}

/// Counters a session keeps for metrics; the caller reads and resets them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DropCounts {
    /// Dropped because the queue was full (oldest first).
    pub queue_full: u64,
    /// Dropped because the Message Expiry Interval ran out in the queue.
    pub expired: u64,
    /// Dropped because the message exceeds the client's Maximum Packet Size
    /// `[MQTT-3.1.2-25]`.
    pub too_large: u64,
    /// Dropped because the access control refused it (publish at QoS 0, or
    /// delivery).
    pub not_authorized: u64,
}

// The names are the packet each state waits for.
#[allow(clippy::enum_variant_names)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum InflightState {
    /// PUBLISH QoS 1 sent, waiting for PUBACK.
    AwaitPubAck,
    /// PUBLISH QoS 2 sent, waiting for PUBREC.
    AwaitPubRec,
    /// PUBREL sent, waiting for PUBCOMP.
    AwaitPubComp,
}

/// A session's messages on their way: in flight to the client, queued,
/// and inbound QoS 2 flows.
#[derive(Debug, Default)]
struct Flight {
    inflight: HashMap<u16, Inflight>,
    inflight_order: BTreeMap<u64, u16>,
    queue: VecDeque<Delivery>,
    inbound_qos2: HashSet<u16>,
}

#[derive(Debug, Clone)]
struct Inflight {
    seq: u64,
    delivery: Delivery,
    state: InflightState,
}

/// Topic aliases of one connection (MQTT 5 §3.3.2.3.4).
#[derive(Default)]
struct Aliases {
    /// Set by the client towards us.
    inbound: HashMap<u16, ByteString>,
    /// Set by us towards the client.
    outbound: HashMap<ByteString, u16>,
}

/// The authorizer and its cache of delivery decisions.
struct Access {
    authorizer: Arc<dyn Authorize>,
    cache: AuthorizeCache,
    receive_decisions: HashMap<ByteString, (bool, Instant)>,
}

/// The server-side state of one MQTT session.
pub struct Session {
    client_id: ByteString,
    protocol: ProtocolVersion,
    /// The broker's limits, shared by every session of a shard.
    limits: Arc<SessionLimits>,
    online: bool,
    /// Session Expiry Interval in force, seconds.
    session_expiry: u32,
    client_receive_maximum: u16,
    client_max_packet_size: usize,
    subscriptions: HashMap<ByteString, Subscription>,
    next_packet_id: u16,
    next_seq: u64,
    /// QoS 1/2 state and queued messages, allocated on first use: a
    /// session that never receives a message holds none (DESIGN.md §3).
    flight: Option<Box<Flight>>,
    /// Messages dropped since the broker last took the counts, allocated on
    /// the first drop.
    drops: Option<Box<DropCounts>>,
    /// Topic aliases of this connection, allocated on first use: most
    /// clients use none, and an idle session should cost little.
    aliases: Option<Box<Aliases>>,
    client_topic_alias_maximum: u16,
    /// Access control, present only when an ACL is configured.
    access: Option<Box<Access>>,
    /// Prefix of every topic inside the broker for this client's workspace
    /// (empty for the default workspace). It starts with U+0000, which no
    /// client can send, so no topic or filter of one workspace can name
    /// another's (DESIGN.md §9).
    namespace: ByteString,
    /// Changes of durable state are returned as [`Output::Log`].
    logged: bool,
    /// The store refuses QoS 1/2 publishes (disk full, `store.max_bytes`).
    store_refusing: bool,
}

/// The topic prefix of workspace `workspace`: empty for `"default"`, else
/// U+0000, the name and `/`.
pub fn workspace_namespace(workspace: &str) -> ByteString {
    if workspace.is_empty() || workspace == "default" {
        ByteString::new()
    } else {
        ByteString::from(format!("\u{0}{workspace}/"))
    }
}

/// `filter` as the broker keeps it for a client whose workspace prefix is
/// `namespace`; a shared filter keeps its `$share/{group}/` in front.
pub fn internal_filter(namespace: &str, filter: &ByteString) -> ByteString {
    if namespace.is_empty() {
        return filter.clone();
    }
    match parse_shared(filter) {
        Some((group, inner)) => ByteString::from(format!("$share/{group}/{namespace}{inner}")),
        None => ByteString::from(format!("{namespace}{filter}")),
    }
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("client_id", &self.client_id)
            .field("protocol", &self.protocol)
            .field("online", &self.online)
            .field("subscriptions", &self.subscriptions.len())
            .field("inflight", &self.inflight())
            .field("queued", &self.queued())
            .finish_non_exhaustive()
    }
}

impl Session {
    /// A new, empty session for a connection that negotiated `negotiated`,
    /// under `limits` (one `Arc` for every session of a shard). It starts
    /// online.
    pub fn new(
        protocol: ProtocolVersion,
        negotiated: &Negotiated,
        limits: Arc<SessionLimits>,
    ) -> Session {
        Session {
            // A copy: the negotiated identifier is usually a slice of the
            // CONNECT's read buffer, which it would keep alive (with the
            // buffer's shared header) for as long as the session lives.
            // (`From<&str>` copies into an allocation of exactly its length,
            // which `Bytes` then owns with no separate header.)
            client_id: ByteString::from(&*negotiated.client_id),
            protocol,
            limits,
            online: true,
            session_expiry: negotiated.session_expiry,
            client_receive_maximum: negotiated.client_receive_maximum,
            client_max_packet_size: negotiated.client_max_packet_size,
            subscriptions: HashMap::new(),
            next_packet_id: 1,
            next_seq: 0,
            flight: None,
            drops: None,
            aliases: None,
            client_topic_alias_maximum: negotiated.client_topic_alias_maximum,
            access: None,
            namespace: ByteString::new(),
            logged: false,
            store_refusing: false,
        }
    }

    /// Whether the store refuses QoS 1/2 publishes now (DESIGN.md §7),
    /// set by the caller before each packet: such a publish is not
    /// forwarded, MQTT 5 gets PUBACK/PUBREC 0x97 Quota exceeded, and a
    /// QoS 2 packet identifier is not kept, so that the publish sent again
    /// (MQTT 3.1.1, whose connection the caller closes) or a new one with
    /// that identifier is taken once the store takes values again.
    pub fn set_store_refusing(&mut self, refusing: bool) {
        self.store_refusing = refusing;
    }

    /// The MQTT 5 PUBREC of the inbound QoS 2 `packet_id` was refused
    /// after this session opened it (reason 0x80 or above: the store or the
    /// cluster did not take the value): the identifier is free again, so a PUBLISH that reuses it
    /// is a new message, stored and forwarded (MQTT 5 §4.3.3: "available
    /// for reuse once the sender has received ... a PUBREC with a Reason
    /// Code of 0x80 or greater"). A logged session returns the release as
    /// [`Output::Log`], so a restart does not find it open. Returns
    /// whether the identifier was open.
    pub fn forget_inbound_qos2(&mut self, packet_id: u16, out: &mut Vec<Output>) -> bool {
        let Some(fl) = self.flight.as_deref_mut() else { return false };
        let known = fl.inbound_qos2.remove(&packet_id);
        if known && self.logged {
            out.push(Output::Log(SessionChange::InboundQos2 { packet_id, open: false }));
        }
        known
    }

    /// Return changes of this session's durable state as [`Output::Log`]
    /// from now on (a persistent session with a durable store), or stop.
    pub fn set_logged(&mut self, logged: bool) {
        self.logged = logged;
    }

    /// True when changes are returned as [`Output::Log`].
    pub fn is_logged(&self) -> bool {
        self.logged
    }

    /// Restore what the local store recovered (`store::RecoveredSession`):
    /// subscriptions, inbound QoS 2 packet identifiers, the deliveries that
    /// were sent and not completed, in order, each with its packet
    /// identifier and whether its PUBREC came back (resent with DUP, or as
    /// PUBREL, by [`Session::resume`] `[MQTT-4.4.0-1]`), and messages to
    /// deliver, in order, which wait in the queue (the session starts
    /// offline). A sent delivery whose identifier another one already
    /// holds waits in the queue. Call on a session made with
    /// [`Session::new`].
    pub fn restore(
        &mut self,
        subscriptions: HashMap<ByteString, Subscription>,
        inbound_qos2: impl IntoIterator<Item = u16>,
        sent: impl IntoIterator<Item = (Delivery, PacketId, bool)>,
        queue: impl IntoIterator<Item = Delivery>,
    ) {
        self.online = false;
        self.subscriptions = subscriptions;
        let mut next_seq = self.next_seq;
        let fl = self.fl();
        fl.inbound_qos2.extend(inbound_qos2);
        for (delivery, packet_id, released) in sent {
            if delivery.qos == QoS::AtMostOnce || fl.inflight.contains_key(&packet_id.get()) {
                fl.queue.push_back(delivery);
                continue;
            }
            let state = match (delivery.qos, released) {
                (QoS::AtLeastOnce, _) => InflightState::AwaitPubAck,
                (_, false) => InflightState::AwaitPubRec,
                (_, true) => InflightState::AwaitPubComp,
            };
            fl.inflight.insert(packet_id.get(), Inflight { seq: next_seq, delivery, state });
            fl.inflight_order.insert(next_seq, packet_id.get());
            next_seq += 1;
        }
        fl.queue.extend(queue);
        self.next_seq = next_seq;
    }

    /// A logged session is done with `delivery`'s stored message.
    fn done_with(&self, delivery: &Delivery, out: &mut Vec<Output>) {
        if self.logged && delivery.message.stored != 0 {
            out.push(Output::Log(SessionChange::Done { value: delivery.message.stored }));
        }
    }

    /// Check PUBLISH, SUBSCRIBE and deliveries with `authorizer` from now
    /// on (none: everything allowed).
    pub fn set_authorizer(&mut self, authorizer: Option<Arc<dyn Authorize>>, cache: AuthorizeCache) {
        self.access = authorizer.map(|authorizer| Box::new(Access { authorizer, cache, receive_decisions: HashMap::new() }));
    }

    /// Keep this session's topics inside workspace prefix `namespace`
    /// ([`workspace_namespace`]). Set once, before the first packet.
    pub fn set_namespace(&mut self, namespace: ByteString) {
        self.namespace = namespace;
    }

    /// The workspace prefix of this session's topics.
    pub fn namespace(&self) -> &ByteString {
        &self.namespace
    }

    /// May this client receive a message on the internal `topic`? Asks the
    /// authorizer at most once per `ttl` per topic.
    fn may_receive(&mut self, topic: &ByteString, now: Instant) -> bool {
        let Some(access) = &mut self.access else { return true };
        if let Some((allowed, at)) = access.receive_decisions.get(topic) {
            if now.saturating_duration_since(*at) < access.cache.ttl {
                return *allowed;
            }
        }
        let visible = topic.strip_prefix(&*self.namespace).unwrap_or(topic);
        let allowed = access.authorizer.may_receive(visible);
        if access.receive_decisions.len() >= access.cache.max_topics {
            access.receive_decisions.clear();
        }
        access.receive_decisions.insert(topic.clone(), (allowed, now));
        allowed
    }

    /// The client identifier.
    pub fn client_id(&self) -> &ByteString {
        &self.client_id
    }

    /// The protocol version of the current (or last) connection.
    pub fn protocol(&self) -> ProtocolVersion {
        self.protocol
    }

    /// The Session Expiry Interval in force, seconds.
    pub fn session_expiry(&self) -> u32 {
        self.session_expiry
    }

    /// True while a connection is attached.
    pub fn is_online(&self) -> bool {
        self.online
    }

    /// The subscriptions, by topic filter.
    pub fn subscriptions(&self) -> &HashMap<ByteString, Subscription> {
        &self.subscriptions
    }

    /// Messages waiting (offline, or beyond the client's Receive Maximum).
    pub fn queued(&self) -> usize {
        self.flight.as_ref().map_or(0, |f| f.queue.len())
    }

    /// QoS 1/2 messages sent and not yet fully acknowledged.
    pub fn inflight(&self) -> usize {
        self.flight.as_ref().map_or(0, |f| f.inflight.len())
    }

    /// Where this session stands with the values it got from a session
    /// log (those whose [`Message::stored`] holds their log sequence, in
    /// cluster mode): its unacknowledged deliveries of them, in the order
    /// sent, as (log sequence, packet identifier, QoS, PUBREC received),
    /// and the log sequence of the first such value still queued.
    pub fn log_position(&self) -> (Vec<LogSent>, Option<u64>) {
        let Some(fl) = self.flight.as_deref() else { return (Vec::new(), None) };
        let sent = fl
            .inflight_order
            .values()
            .filter_map(|pid| {
                let e = fl.inflight.get(pid)?;
                let stored = e.delivery.message.stored;
                (stored != 0 && e.delivery.group.is_none()).then_some(LogSent {
                    seq: stored,
                    packet_id: *pid,
                    qos: e.delivery.qos,
                    released: e.state == InflightState::AwaitPubComp,
                })
            })
            .collect();
        let queued = fl.queue.iter().find(|d| d.message.stored != 0 && d.group.is_none()).map(|d| d.message.stored);
        (sent, queued)
    }

    /// True when a QoS 1 or 2 delivery would be sent now rather than
    /// queued: the client is connected, nothing is queued before it and
    /// its Receive Maximum has room. A caller with deliveries of its own
    /// to pace (retained messages for a SUBSCRIBE) offers one only then.
    pub fn may_send_now(&self) -> bool {
        self.online && self.queued() == 0 && self.has_send_quota()
    }

    /// The session's [`Flight`], allocated on first use.
    fn fl(&mut self) -> &mut Flight {
        self.flight.get_or_insert_with(Box::default)
    }

    /// Take the drop counters, resetting them.
    pub fn take_drops(&mut self) -> DropCounts {
        self.drops.as_deref_mut().map(std::mem::take).unwrap_or_default()
    }

    /// The drop counters, allocated on the first drop.
    fn dropped(&mut self) -> &mut DropCounts {
        self.drops.get_or_insert_with(Box::default)
    }

    /// The connection went away. The session keeps its state for the
    /// caller to expire after the Session Expiry Interval.
    pub fn go_offline(&mut self) {
        self.online = false;
    }

    /// Take back the deliveries that came through a shared subscription and
    /// are not yet acknowledged, in order, so the group can give them to
    /// another member (MQTT 5 §4.8.2): QoS 1 ones in flight, and every one
    /// still queued. QoS 2 ones already sent stay, to be completed with
    /// this client when it returns `[MQTT-4.8.2-4]`, `[MQTT-4.8.2-5]`.
    /// Called when the session goes offline.
    pub fn take_shared_deliveries(&mut self) -> Vec<Delivery> {
        let mut taken = Vec::new();
        let order = std::mem::take(&mut self.fl().inflight_order);
        for (seq, pid) in order {
            let entry = &self.fl().inflight[&pid];
            if entry.delivery.group.is_some() && entry.state == InflightState::AwaitPubAck {
                let entry = self.fl().inflight.remove(&pid).expect("present");
                taken.push(entry.delivery);
            } else {
                self.fl().inflight_order.insert(seq, pid);
            }
        }
        let queue = std::mem::take(&mut self.fl().queue);
        for delivery in queue {
            if delivery.group.is_some() {
                taken.push(delivery);
            } else {
                self.fl().queue.push_back(delivery);
            }
        }
        taken
    }

    /// A new connection resumes this session (Clean Start 0 and the session
    /// existed): adopt the connection's parameters, resend unacknowledged
    /// PUBLISHes with DUP set and PUBRELs, in their original order
    /// `[MQTT-4.4.0-1]`, then send queued messages up to the client's Receive
    /// Maximum.
    pub fn resume(&mut self, protocol: ProtocolVersion, negotiated: &Negotiated, now: Instant, out: &mut Vec<Output>) {
        self.protocol = protocol;
        self.online = true;
        self.session_expiry = negotiated.session_expiry;
        self.client_receive_maximum = negotiated.client_receive_maximum;
        self.client_max_packet_size = negotiated.client_max_packet_size;
        // Topic aliases last as long as one connection `[MQTT-3.3.2-10]`.
        self.aliases = None;
        self.client_topic_alias_maximum = negotiated.client_topic_alias_maximum;
        let fl = self.flight.get_or_insert_with(Box::default);
        for pid in fl.inflight_order.values() {
            let entry = &fl.inflight[pid];
            let packet_id = NonZeroU16::new(*pid).expect("packet ids are never 0");
            match entry.state {
                InflightState::AwaitPubAck | InflightState::AwaitPubRec => out.push(Output::Deliver {
                    delivery: entry.delivery.clone(),
                    packet_id: Some(packet_id),
                    dup: true,
                }),
                InflightState::AwaitPubComp => out.push(Output::Send(Packet::PubRel(PubResponse::success(packet_id)))),
            }
        }
        self.pump(now, out);
    }

    /// Deliver a message matched by this session's subscriptions. QoS 0 goes
    /// out at once when online and is dropped when offline; QoS 1/2 goes out
    /// when online and within the client's Receive Maximum, else waits in
    /// the queue (oldest dropped beyond `max_queue`).
    pub fn deliver(&mut self, delivery: Delivery, now: Instant, out: &mut Vec<Output>) {
        if delivery.message.expiry_left(now) == Some(0) {
            self.dropped().expired += 1;
            return;
        }
        if !self.may_receive(&delivery.message.topic, now) {
            self.dropped().not_authorized += 1;
            return;
        }
        if delivery.qos == QoS::AtMostOnce {
            if self.online {
                out.push(Output::Deliver { delivery, packet_id: None, dup: false });
            }
            return;
        }
        if self.online && self.fl().queue.is_empty() && self.has_send_quota() {
            self.send_new(delivery, out);
            return;
        }
        if self.fl().queue.len() >= self.limits.max_queue {
            if let Some(oldest) = self.fl().queue.pop_front() {
                self.done_with(&oldest, out);
            }
            self.dropped().queue_full += 1;
        }
        self.fl().queue.push_back(delivery);
    }

    /// Count a delivery the caller dropped because, encoded, it exceeds the
    /// client's Maximum Packet Size `[MQTT-3.1.2-25]`. Returns that size.
    pub fn client_max_packet_size(&self) -> usize {
        self.client_max_packet_size
    }

    /// Record that the caller dropped a message too large for the client.
    /// For a QoS 1/2 delivery already given a packet identifier, the
    /// identifier is released, as the spec asks (MQTT 5 §3.1.2.11.4: the
    /// server acts as if it completed sending).
    pub fn dropped_too_large(&mut self, packet_id: Option<PacketId>, now: Instant, out: &mut Vec<Output>) {
        self.dropped().too_large += 1;
        if let Some(pid) = packet_id {
            if let Some(entry) = self.fl().inflight.remove(&pid.get()) {
                self.fl().inflight_order.remove(&entry.seq);
                self.done_with(&entry.delivery, out);
            }
            self.pump(now, out);
        }
    }

    /// The Topic Alias to use for a PUBLISH on `topic` to this client:
    /// `None` when the client accepts no aliases or all are taken; `Some((alias,
    /// true))` when this PUBLISH establishes the alias (send the topic too);
    /// `Some((alias, false))` when the alias is known to the client (send an
    /// empty topic) (MQTT 5 §3.3.2.3.4).
    pub fn outbound_topic_alias(&mut self, topic: &ByteString) -> Option<(u16, bool)> {
        if self.client_topic_alias_maximum == 0 {
            return None;
        }
        let outbound = &mut self.aliases.get_or_insert_with(Default::default).outbound;
        if let Some(alias) = outbound.get(topic) {
            return Some((*alias, false));
        }
        let next = outbound.len() + 1;
        if next > usize::from(self.client_topic_alias_maximum) {
            return None;
        }
        let alias = next as u16;
        outbound.insert(topic.clone(), alias);
        Some((alias, true))
    }

    /// Undo an alias just established by [`Session::outbound_topic_alias`]
    /// when the PUBLISH carrying it was not sent after all.
    pub fn forget_outbound_topic_alias(&mut self, topic: &ByteString) {
        // Aliases are handed out in order, so only the newest can be undone.
        if let Some(aliases) = &mut self.aliases {
            if aliases.outbound.get(topic).is_some_and(|a| usize::from(*a) == aliases.outbound.len()) {
                aliases.outbound.remove(topic);
            }
        }
    }

    /// True when deliveries to this client may carry a Topic Alias, so the
    /// caller cannot share one encoding with other subscribers.
    pub fn uses_outbound_aliases(&self) -> bool {
        self.client_topic_alias_maximum > 0
    }

    fn has_send_quota(&self) -> bool {
        self.inflight() < usize::from(self.client_receive_maximum.min(self.limits.max_inflight))
    }

    /// Send queued messages while the client's Receive Maximum allows.
    fn pump(&mut self, now: Instant, out: &mut Vec<Output>) {
        while self.online && self.has_send_quota() {
            let Some(delivery) = self.fl().queue.pop_front() else { break };
            if delivery.message.expiry_left(now) == Some(0) {
                self.dropped().expired += 1;
                continue;
            }
            self.send_new(delivery, out);
        }
    }

    fn send_new(&mut self, delivery: Delivery, out: &mut Vec<Output>) {
        let pid = self.allocate_packet_id();
        let seq = self.next_seq;
        self.next_seq += 1;
        let state = if delivery.qos == QoS::AtLeastOnce {
            InflightState::AwaitPubAck
        } else {
            InflightState::AwaitPubRec
        };
        self.fl().inflight.insert(pid.get(), Inflight { seq, delivery: delivery.clone(), state });
        self.fl().inflight_order.insert(seq, pid.get());
        if self.logged && delivery.message.stored != 0 && delivery.group.is_none() {
            let change = SessionChange::Outbound { value: delivery.message.stored, packet_id: pid.get(), released: false };
            out.push(Output::Log(change));
        }
        out.push(Output::Deliver { delivery, packet_id: Some(pid), dup: false });
    }

    /// The next free packet identifier; the caller guarantees one is free
    /// (at most 65,535 are in flight, bounded by Receive Maximum).
    fn allocate_packet_id(&mut self) -> PacketId {
        loop {
            let candidate = self.next_packet_id;
            self.next_packet_id = self.next_packet_id.checked_add(1).unwrap_or(1);
            if !self.fl().inflight.contains_key(&candidate) {
                return NonZeroU16::new(candidate).expect("packet ids wrap past 0");
            }
        }
    }

    fn complete(&mut self, pid: u16, expected: InflightState, now: Instant, out: &mut Vec<Output>) -> bool {
        match self.fl().inflight.get(&pid) {
            Some(entry) if entry.state == expected => {
                let seq = entry.seq;
                let entry = self.fl().inflight.remove(&pid).expect("present");
                self.done_with(&entry.delivery, out);
                self.fl().inflight_order.remove(&seq);
                self.pump(now, out);
                true
            }
            _ => false,
        }
    }

    /// Clamp a Session Expiry Interval set at DISCONNECT to the server
    /// maximum (the caller applies the maximum it announced).
    pub fn clamp_session_expiry(&mut self, max: u32) {
        self.session_expiry = self.session_expiry.min(max);
    }
}

mod inbound;

#[cfg(test)]
mod tests;
