//! One shard: the sessions whose client identifiers it owns, its
//! subscription trie, its copy of the route table and of the retained
//! messages, and the links to the other shards (DESIGN.md §3).
//!
//! Ownership: a client identifier belongs to `owner_of(client_id)`, its
//! home shard. A connection is accepted on whichever shard the kernel
//! picked, reads its CONNECT there, and is then handed (socket and unread
//! bytes) to the home shard, where it lives until it closes, with one
//! exception: a publisher whose messages all go to one other shard may move
//! there with its session, and the home shard then forwards its client
//! identifier's connections (see [`placement`]). Take-over, session
//! resume, will delay and session expiry are always local to the one shard
//! that holds the session. The route table and the
//! retained messages are copied on every shard and kept current through
//! lock-free inboxes (see [`inbox`]). Shared subscription groups belong to
//! `owner_of(shared filter)` (see [`groups`]).

mod durable;
mod cluster;
mod conn;
mod cursor_gate;
mod deliver;
mod groups;
mod held;
mod inbox;
mod packet;
mod index;
mod restore;
mod session_log;
mod session_state;
mod strays;
mod timers;
mod placement;
mod route;
mod retained;
mod wanted;
mod wills;

use std::cell::{Cell, RefCell};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::os::fd::OwnedFd;
use std::rc::Rc;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use bytestring::ByteString;
use fleetmq_core::packet::{
    Connect, Packet, Props, QoS, ReasonCode, RetainHandling, Will,
};
use fleetmq_core::route::{RemoteRoutes, RouteTable};
use fleetmq_core::session::timing::session_expires_at;
use fleetmq_core::session::{
    client_key, workspace_namespace, Authorize, AuthorizeCache, Delivery, Message, Negotiated,
    Output, Refusal, Session, SessionLimits, Subscription,
};
use fleetmq_core::settings::Shared;
use fleetmq_core::topic::parse_shared;
use fleetmq_core::trie::SubscriptionTrie;
use glommio::channels::channel_mesh::Senders;
use slab::Slab;

use crate::metrics::{DropReason, ShardMetrics};
use crate::outbound::{frame_for, FrameCache};
use crate::signal::Signal;
use crate::store::Answering;
use inbox::{Control, Inbox};
pub(crate) use retained::Feeding;
use retained::{Feeds, Retained};
use index::ClientIndex;

/// Size of a shard's read scratch buffer: the most one read takes from a
/// socket.
const SCRATCH_BYTES: usize = 64 * 1024;

/// Messages a shard may hold for its peers before a connection that adds
/// more waits for them to be sent (see [`Shard::flush_soon`]).
const DEFER_FLUSH_MAX: usize = 4096;

/// Payload bytes a shard may hold for its peers before a connection that
/// adds more waits for them to be sent (see [`Shard::flush_soon`]): a
/// publisher whose socket always has data never lets the flusher run, so
/// without this bound large messages would pile up (4096 × 500 KB = 2 GB).
const DEFER_FLUSH_BYTES: usize = 1 << 20;

/// Index of a client (session) in its shard's slab.
pub(crate) type Slot = u32;

/// Who a trie entry delivers to: a session of this shard, or a shared
/// subscription group this shard owns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Subscriber {
    Session(Slot),
    Group(u32),
}

pub(crate) use conn::ConnShared;
pub(crate) use session_log::{Resume, CURSOR_EVERY, LOGGED};
pub(crate) use groups::GroupOp;
pub(crate) use wanted::ROUTE_WAIT;
pub(crate) use placement::{Forget, Move, Mover, Route};

/// Counters shared by every shard of the process.
pub(crate) struct Global {
    /// Connections that completed CONNECT and are attached.
    pub(crate) connected: AtomicUsize,
    /// Persistent sessions with no connection.
    pub(crate) offline_sessions: AtomicUsize,
    /// Source of connection keys (unique per process).
    pub(crate) next_conn_key: AtomicU64,
    /// Source of retained-change sequence numbers.
    pub(crate) retain_seq: AtomicU64,
    /// One inbox per shard for changes to node-wide state.
    pub(crate) inboxes: Vec<Inbox>,
    /// Each shard's load over its last tick, per mille of the tick spent
    /// running tasks (see [`Shard::set_load`]).
    pub(crate) load: Vec<AtomicU32>,
}

impl Global {
    /// Counters at zero and an empty inbox for each of `shards` shards.
    pub(crate) fn new(shards: usize) -> Global {
        Global {
            connected: AtomicUsize::new(0),
            offline_sessions: AtomicUsize::new(0),
            next_conn_key: AtomicU64::new(0),
            retain_seq: AtomicU64::new(0),
            inboxes: (0..shards).map(|_| Inbox::new()).collect(),
            load: (0..shards).map(|_| AtomicU32::new(0)).collect(),
        }
    }
}

/// What crosses from one shard to another.
pub(crate) enum ShardMsg {
    /// Messages for the receiving shard's subscribers, in publish order.
    Deliver(Vec<Arc<Message>>),
    /// A connection whose client identifier the receiving shard owns.
    Handoff(Box<Handoff>),
    /// Connections accepted by the sending shard, whose client identifiers
    /// the receiving shard owns (`crate::arrival`).
    Arrivals(Vec<crate::arrival::Arrival>),
    /// A message a group chose a member (owned by the receiving shard)
    /// for. Boxed: it is rare and large, and every slot of a cross-shard
    /// channel is as large as the largest message (`SHARD_CHANNEL_CAPACITY`
    /// slots per channel, one channel per ordered pair of shards).
    DeliverShared(Box<SharedDelivery>),
    /// A publisher and its session moving to the receiving shard (see
    /// [`placement`]).
    Move(Box<Move>),
    /// A session moved to the sending shard ended (see [`placement`]).
    Forget(Box<Forget>),
}

/// A shared subscription's message for one member (see
/// [`ShardMsg::DeliverShared`]).
pub(crate) struct SharedDelivery {
    pub(crate) key: ByteString,
    pub(crate) client_id: ByteString,
    pub(crate) subscription: Subscription,
    pub(crate) message: Arc<Message>,
}

/// A connection moving to the shard that owns its client identifier.
pub(crate) struct Handoff {
    pub(crate) stream: HandoffStream,
    pub(crate) unread: Bytes,
    pub(crate) connect: Box<Connect>,
    pub(crate) negotiated: Negotiated,
    pub(crate) admission: crate::connection::Admission,
    /// How it got here (see [`placement`]).
    pub(crate) route: Route,
}

/// The socket of a hand-off: the client's TCP socket, or a local socket
/// carrying the plain MQTT bytes of a TLS or WebSocket connection.
pub(crate) enum HandoffStream {
    Tcp(OwnedFd),
    Unix(OwnedFd),
}

struct Client {
    session: Session,
    /// Who holds the client identifier: user name and workspace.
    owner: (Option<Arc<str>>, Arc<str>),
    /// [`client_key`] of the client identifier (No Local).
    key: u64,
    conn: Option<Rc<ConnShared>>,
    /// The Will of the current connection (boxed: most clients have none,
    /// and a `Will` is large).
    will: Option<Box<Will>>,
    /// A will waiting for its delay after the connection ended.
    pending_will: Option<Box<(Instant, Will)>>,
    /// When the session went offline.
    offline_since: Option<Instant>,
    /// Its record in `mqtt-session-state` (cluster mode).
    saved: session_state::Saved,
    /// Its place in its workspace's session log (a persistent session in
    /// cluster mode, see [`session_log`]).
    log: Option<Box<session_log::Reader>>,
    /// Inbound QoS 2 flows another replica recorded (taken up): packet
    /// identifier → the message ID its value was appended under there,
    /// until the client sends that PUBLISH again (appended again under
    /// it, see `Shard::handle_packet`) or its PUBREL.
    /// Boxed: one word in every client, most of which never have any.
    #[allow(clippy::box_collection)]
    reopened: Option<Box<std::collections::HashMap<u16, Box<str>>>>,
}

/// Limits the shard applies, derived once from the settings.
#[derive(Clone)]
pub(crate) struct ShardLimits {
    pub(crate) session: Arc<SessionLimits>,
    pub(crate) max_offline_sessions: usize,
    pub(crate) max_client_writes_pending: usize,
    /// Bytes queued for one client beyond which QoS 0 is dropped.
    pub(crate) max_client_write_bytes: usize,
    /// Shared subscription strategies.
    pub(crate) shared: Shared,
    /// Move publishers to their subscribers' shard (`server.move_publishers`,
    /// see [`placement`]).
    pub(crate) move_publishers: bool,
}

/// Drop the entries of connections that have ended from `deadlines` once
/// they are more than half of it, and give back the capacity they held.
/// An ended connection's entry otherwise stays until its keep-alive
/// deadline (1.5 × Keep Alive: 15 minutes at 600 s), so a broker whose
/// clients come and go would keep 32 bytes for every connection of the
/// last quarter hour (found by a fresh-user pass: RSS grew about 300 KiB
/// per 10,000 connections opened and closed). O(entries), at most once a
/// second (from [`Shard::expire`]).
///
/// `connected`: the clients in `clients` with a connection (counted by
/// the caller's own pass over them).
fn compact_deadlines(
    deadlines: &mut BinaryHeap<Reverse<(Instant, Slot, u64)>>,
    clients: &Slab<Client>,
    connected: usize,
) {
    if deadlines.len() <= 2 * connected + 64 {
        return;
    }
    deadlines.retain(|&Reverse((_, slot, key))| {
        clients.get(slot as usize).and_then(|c| c.conn.as_ref()).is_some_and(|c| c.key == key)
    });
    if deadlines.capacity() > 2 * deadlines.len() + 64 {
        crate::alloc::giving_back(|| deadlines.shrink_to_fit());
    }
}

/// Add `entry` to a shard's deadline heap, which grows with its
/// connections: its old blocks go back to the system (see
/// [`crate::alloc`]).
fn push_deadline(
    deadlines: &mut BinaryHeap<Reverse<(Instant, Slot, u64)>>,
    entry: Reverse<(Instant, Slot, u64)>,
) {
    crate::alloc::giving_back(|| deadlines.push(entry));
}

struct State {
    clients: Slab<Client>,
    by_id: ClientIndex,
    trie: SubscriptionTrie<Subscriber, Subscription>,
    groups: Slab<groups::GroupEntry>,
    group_ids: HashMap<ByteString, u32>,
    routes: RouteTable,
    /// The other replicas' routes (cluster mode: `mqtt-routes`), for the
    /// mesh; empty alone.
    remote_routes: RemoteRoutes,
    /// Cluster mode: the filters this shard's sessions subscribe to, as
    /// `mqtt-routes` must say (see [`wanted`]); empty alone.
    wanted: HashMap<ByteString, wanted::Want>,
    /// The shared subscriptions with members on this replica (any shard),
    /// as `RemoteRoutes` keeps them with [`groups::HERE`] for this
    /// replica: which groups of a topic this replica can serve, for the
    /// mesh's pick of one member replica per group.
    local_groups: RemoteRoutes,
    /// The keys (`$share/{group}/{filter}`) of the shared subscriptions
    /// in `local_groups`: where a value for one group goes on this
    /// replica when the mesh gives it back ([`Shard::redispatch_groups`]).
    local_group_keys: HashSet<ByteString>,
    retained: Retained,
    /// Retained messages subscriptions still have to receive, by session.
    feeds: Feeds,
    /// Inbox changes applied so far.
    applied: u64,
    /// Deliveries for other shards, batched per shard until the next flush.
    outbox: Vec<Vec<Arc<Message>>>,
    /// Payload bytes added to `outbox` since it was last sent.
    outbox_bytes: usize,
    /// Control messages for other shards, in order.
    control: Vec<(usize, ShardMsg)>,
    frames: FrameCache,
    matched: Vec<(Subscriber, Subscription)>,
    outputs: Vec<Output>,
    /// When each connection's keep alive or credential may run out, with
    /// its slot and connection key; see [`Shard::check_deadlines`].
    deadlines: BinaryHeap<Reverse<(Instant, Slot, u64)>>,
    /// Client identifiers of this shard moved to another: (shard,
    /// generation). See [`placement`].
    moved: HashMap<ByteString, (usize, u64)>,
    /// Sessions moved here from their home shard: slot → generation.
    moved_in: HashMap<Slot, u64>,
    /// Wills recovered without a session, published at the first tick.
    restored_wills: Vec<(ByteString, Will)>,
    /// Values held behind their publisher's retained value that the
    /// cluster has not stored yet (see [`held`]).
    held: held::Held,
    /// The session logs this shard's sessions read (see [`session_log`]).
    tails: session_log::Tails,
    /// Shared group values waiting for a member to appear (see
    /// [`strays`]).
    strays: strays::Strays,
}

/// Why [`Shard::attach`] did not attach a connection.
pub(crate) enum AttachError {
    /// Refused: the CONNACK carries the reason.
    Refused(Refusal),
    /// The session was moved to shard `to` (see [`placement`]): hand the
    /// connection on with [`Route::ViaHome`]`(generation)`.
    Elsewhere { to: usize, generation: u64 },
    /// This shard is not the client identifier's home and does not hold its
    /// session: hand the connection back to the home shard.
    NotHere,
}

/// A shard's state and links. Lives in an `Rc` on its executor.
pub(crate) struct Shard {
    pub(crate) id: usize,
    pub(crate) shards: usize,
    pub(crate) limits: ShardLimits,
    pub(crate) metrics: ShardMetrics,
    pub(crate) global: Arc<Global>,
    pub(crate) senders: Senders<ShardMsg>,
    /// Fires when the shard starts stopping: the accept loops end.
    pub(crate) stop_signal: Signal,
    /// The shard is stopping ([`Shard::close_all`] ran): a connection that
    /// arrives now (handed over, moved here) is closed at once.
    pub(crate) stopping: Cell<bool>,
    /// Wakes the shard's flusher task (see [`Shard::flush_soon`]).
    pub(crate) flush_signal: Signal,
    /// Connections currently served on this shard.
    pub(crate) live_connections: Cell<usize>,
    /// The buffer every connection of the shard reads into before keeping
    /// what it needs (see `connection::read_some`).
    pub(crate) scratch: RefCell<Vec<u8>>,
    /// Where accepted values become durable, and the acknowledgements
    /// waiting for it (see [`crate::store`]).
    pub(crate) store: crate::store::ShardStore,
    /// This shard's mesh links to the other replicas (cluster mode with a
    /// mesh; empty otherwise).
    pub(crate) links: crate::mesh::ShardLinks,
    state: RefCell<State>,
}

/// `message`, published by `client` (QoS 1/2), as the ingest stream
/// records it (`store.kind = "jetstream"`): its subject and headers
/// (its topic without the workspace prefix, the client's identifier and
/// workspace). `None` at QoS 0 (not stored).
fn ingest_value(client: &Client, message: &Message) -> Option<crate::cluster::IngestRecord> {
    if message.qos == QoS::AtMostOnce {
        return None;
    }
    let namespace = client.session.namespace();
    let value = fleetmq_core::cluster::ingest::IngestValue {
        workspace: &client.owner.1,
        topic: message.topic.strip_prefix(&**namespace).unwrap_or(&message.topic),
        client_id: client.session.client_id(),
        qos: message.qos as u8,
        retain: message.retain,
        properties: &message.properties,
    };
    Some(crate::cluster::IngestRecord::of(&value))
}

/// The shard that owns `key` among `shards` (stable for the process's life).
pub(crate) fn owner_of(key: &str, shards: usize) -> usize {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    key.hash(&mut h);
    (h.finish() % shards as u64) as usize
}

impl Shard {
    pub(crate) fn new(
        id: usize,
        shards: usize,
        limits: ShardLimits,
        metrics: ShardMetrics,
        global: Arc<Global>,
        senders: Senders<ShardMsg>,
        store: crate::store::ShardStore,
    ) -> Shard {
        Shard {
            id,
            shards,
            limits,
            metrics,
            global,
            senders,
            stop_signal: Signal::default(),
            stopping: Cell::new(false),
            flush_signal: Signal::default(),
            live_connections: Cell::new(0),
            scratch: RefCell::new(vec![0; SCRATCH_BYTES]),
            store,
            links: crate::mesh::ShardLinks::default(),
            state: RefCell::new(State {
                clients: Slab::new(),
                by_id: ClientIndex::default(),
                trie: SubscriptionTrie::new(),
                groups: Slab::new(),
                group_ids: HashMap::new(),
                routes: RouteTable::new(),
                remote_routes: RemoteRoutes::new(),
                wanted: HashMap::new(),
                local_groups: RemoteRoutes::new(),
                local_group_keys: HashSet::new(),
                retained: Retained::default(),
                feeds: Feeds::default(),
                applied: 0,
                outbox: (0..shards).map(|_| Vec::new()).collect(),
                outbox_bytes: 0,
                control: Vec::new(),
                frames: FrameCache::default(),
                matched: Vec::new(),
                outputs: Vec::new(),
                deadlines: BinaryHeap::new(),
                moved: HashMap::new(),
                moved_in: HashMap::new(),
                restored_wills: Vec::new(),
                held: held::Held::default(),
                tails: session_log::Tails::default(),
                strays: strays::Strays::default(),
            }),
        }
    }

    /// Attach a connection that negotiated `negotiated`: take over a
    /// connection holding the same client identifier `[MQTT-3.1.4-3]`,
    /// discard the old session on Clean Start `[MQTT-3.1.2-4]` or resume it
    /// `[MQTT-3.1.2-5]`, write the CONNACK and then whatever the resumed
    /// session sends.
    ///
    /// # Errors
    /// [`AttachError::Refused`]: the client identifier belongs to another
    /// identity (user name or workspace): CONNACK 0x85 (3.1.1: 2), DESIGN.md
    /// §9. [`AttachError::Elsewhere`], [`AttachError::NotHere`]: the session
    /// is on another shard (see [`placement`]); nothing was changed.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attach(
        &self,
        connect: &Connect,
        negotiated: &Negotiated,
        identity: &crate::auth::Identity,
        authorizer: Option<Arc<dyn Authorize>>,
        cache: AuthorizeCache,
        conn: &Rc<ConnShared>,
        now: Instant,
    ) -> Result<Slot, AttachError> {
        let mut st = self.state.borrow_mut();
        let st = &mut *st;
        let owner = (identity.username.clone(), identity.workspace.clone());
        let existing = st.by_id.get(&st.clients, &negotiated.client_id);
        if existing.is_none() {
            if let Some(&(to, generation)) = st.moved.get(&*negotiated.client_id) {
                return Err(AttachError::Elsewhere { to, generation });
            }
            if owner_of(&negotiated.client_id, self.shards) != self.id {
                return Err(AttachError::NotHere);
            }
        }
        if let Some(slot) = existing {
            if st.clients[slot as usize].owner != owner {
                return Err(AttachError::Refused(Refusal {
                    reason: ReasonCode::CLIENT_IDENTIFIER_NOT_VALID,
                    detail: "the client identifier is held by another identity",
                }));
            }
        }
        // A session moved here stays moved here, whatever happens to it
        // below (found by a fresh-user pass: a taken-over clean session
        // ended, told its home shard to forget the move, and the next
        // connection got a second session there).
        let moved = existing.and_then(|slot| st.moved_in.remove(&slot));
        if let Some(slot) = existing {
            if let Some(old) = st.clients[slot as usize].conn.take() {
                // Take-over: MQTT 5 gets DISCONNECT 0x8E; the old
                // connection's will follows the usual rules.
                old.request_close(Some(ReasonCode::SESSION_TAKEN_OVER), false);
                self.connection_ended(st, slot, true, now);
            }
        }
        let limits = self.limits.session.clone();
        let namespace = workspace_namespace(&identity.workspace);
        let mut session_present = false;
        let slot = match st.by_id.get(&st.clients, &negotiated.client_id) {
            Some(slot) if !connect.clean_start => {
                session_present = true;
                if st.clients[slot as usize].offline_since.take().is_some() {
                    self.global.offline_sessions.fetch_sub(1, Ordering::Relaxed);
                }
                // A reconnect within the Will Delay cancels the will
                // `[MQTT-3.1.3-9]`.
                self.client_back_within_will_delay(st, slot);
                slot
            }
            existing => {
                if let Some(slot) = existing {
                    // Clean Start ends the old session, and with it the
                    // wait of a delayed will: it is published now (MQTT 5
                    // §3.1.3.2.2: "until the Will Delay Interval has passed
                    // or the Session ends, whichever happens first").
                    if let Some(pending) = st.clients[slot as usize].pending_will.take() {
                        self.publish_will(st, Some(&negotiated.client_id), pending.1, now);
                    }
                    self.remove_client(st, slot);
                }
                let mut session = Session::new(connect.protocol, negotiated, limits);
                session.set_namespace(namespace.clone());
                self.insert_client(st, session, owner)
            }
        };
        if let Some(generation) = moved {
            st.moved_in.insert(slot, generation);
        }
        let client = &mut st.clients[slot as usize];
        client.session.set_authorizer(authorizer, cache);
        client.conn = Some(conn.clone());
        if let Some(at) = conn.next_deadline() {
            push_deadline(&mut st.deadlines, Reverse((at, slot, conn.key)));
        }
        client.will = connect.will.clone().map(|mut will| {
            if !namespace.is_empty() {
                will.topic = ByteString::from(format!("{namespace}{}", will.topic));
            }
            Box::new(will)
        });
        let mut connack = negotiated.connack.clone();
        connack.session_present = session_present;
        self.attach_logged(st, slot, conn, connect.protocol.level(), Packet::ConnAck(connack));
        self.save_session(st, slot, None);
        self.attach_feeds(st, slot, conn, session_present);
        if session_present {
            let mut outputs = std::mem::take(&mut st.outputs);
            st.clients[slot as usize].session.resume(
                connect.protocol,
                negotiated,
                now,
                &mut outputs,
            );
            self.write_deliveries(st, slot, &mut outputs, now, false);
            st.outputs = outputs;
            // Only now, online again, may its groups send to it.
            self.shared_presence(st, slot, true);
        }
        // After the resent deliveries: its log from where it was.
        self.reader_attached(st, slot);
        self.global.connected.fetch_add(1, Ordering::Relaxed);
        if self.stopping.get() {
            conn.request_close(Some(ReasonCode::SERVER_SHUTTING_DOWN), false);
        }
        Ok(slot)
    }

    fn insert_client(
        &self,
        st: &mut State,
        session: Session,
        owner: (Option<Arc<str>>, Arc<str>),
    ) -> Slot {
        let key = client_key(session.client_id());
        // Both tables grow with the shard's sessions: their old blocks go
        // back to the system (see crate::alloc).
        crate::alloc::giving_back(|| {
            let slot = st.clients.insert(Client {
                session,
                owner,
                key,
                conn: None,
                will: None,
                pending_will: None,
                offline_since: None,
                saved: session_state::Saved::No,
                log: None,
                reopened: None,
            });
            st.by_id.insert(&st.clients, slot as Slot);
            slot as Slot
        })
    }

    /// Remove a session and its subscriptions (and, for a session moved
    /// here, its home shard's forwarding entry).
    fn remove_client(&self, st: &mut State, slot: Slot) {
        let moved = st.clients[slot as usize].saved == session_state::Saved::MovedAway;
        self.reader_ended(st, slot, moved);
        self.session_ended(st, slot);
        let client = st.clients.remove(slot as usize);
        self.log_detached(&client.session, true);
        if client.offline_since.is_some() {
            self.global.offline_sessions.fetch_sub(1, Ordering::Relaxed);
        }
        st.by_id.remove(client.session.client_id(), slot);
        st.feeds.remove(slot);
        self.moved_session_ends(st, slot, client.session.client_id());
        for filter in client.session.subscriptions().keys() {
            self.unsubscribe(st, filter, slot, client.session.client_id());
        }
    }

    /// Remove one subscription of the session on `slot` from the trie, or
    /// its membership from a shared group.
    fn unsubscribe(&self, st: &mut State, filter: &ByteString, slot: Slot, client_id: &ByteString) {
        if self.store.clustered() {
            self.unwant_route(st, filter);
        }
        if parse_shared(filter).is_some() {
            self.group_op(
                st,
                GroupOp::Leave {
                    key: filter.clone(),
                    client_id: client_id.clone(),
                },
                Instant::now(),
            );
        } else {
            self.trie_remove(st, filter, Subscriber::Session(slot));
        }
    }

    fn trie_remove(&self, st: &mut State, filter: &str, subscriber: Subscriber) {
        st.trie.remove(filter, &subscriber);
        if !st.trie.has_filter(filter) {
            self.route_change(st, &ByteString::from(filter), false);
        }
    }

    fn route_change(&self, st: &mut State, filter: &ByteString, add: bool) {
        if add {
            st.routes.add(filter, self.id);
        } else {
            st.routes.remove(filter, self.id);
        }
        self.broadcast(Control::Route {
            filter: filter.clone(),
            shard: self.id,
            add,
        });
    }

    /// Push a change into every other shard's inbox.
    fn broadcast(&self, change: Control) {
        for (_, inbox) in self.global.inboxes.iter().enumerate().filter(|(peer, _)| *peer != self.id) {
            inbox.push(change.clone());
        }
    }

    /// Apply what other shards pushed into this shard's inbox (from the
    /// shard's periodic loop, so group changes land without traffic).
    pub(crate) fn poll_inbox(&self) {
        let mut st = self.state.borrow_mut();
        self.catch_up(&mut st);
    }

    /// Apply the changes other shards pushed into this shard's inbox. One
    /// atomic load when there are none.
    fn catch_up(&self, st: &mut State) {
        let inbox = &self.global.inboxes[self.id];
        if inbox.pushed() == st.applied {
            return;
        }
        let now = Instant::now();
        while let Some(change) = inbox.pop() {
            st.applied += 1;
            match change {
                Control::Route { filter, shard, add } => {
                    if add {
                        st.routes.add(&filter, shard);
                    } else {
                        st.routes.remove(&filter, shard);
                    }
                }
                Control::Retain { seq, message } => st.retained.apply(seq, message, now),
                Control::Group { from, op } => self.apply_group_op(st, op, from, now),
                Control::Shared { key, add } => groups::note_local_group(st, &key, add),
            }
        }
    }

    /// The connection on `slot` ended (`publish_will`: abnormally, or with
    /// DISCONNECT 0x04). Called once per connection, by whoever detaches it.
    pub(crate) fn detach(&self, slot: Slot, conn: &ConnShared, publish_will: bool, now: Instant) {
        let mut st = self.state.borrow_mut();
        let st = &mut *st;
        let Some(client) = st.clients.get_mut(slot as usize) else { return };
        if client.conn.as_ref().is_none_or(|c| c.key != conn.key) {
            return;
        }
        client.conn = None;
        self.connection_ended(st, slot, publish_will, now);
    }

    fn connection_ended(&self, st: &mut State, slot: Slot, publish_will: bool, now: Instant) {
        self.forget_refused_qos2(st);
        self.global.connected.fetch_sub(1, Ordering::Relaxed);
        st.clients[slot as usize].session.go_offline();
        self.reader_detached(st, slot);
        self.shared_presence(st, slot, false);
        let mut will_now = self.will_at_end(st, slot, publish_will, now);
        let client = &mut st.clients[slot as usize];
        let expiry = client.session.session_expiry();
        let client_id = client.session.client_id().clone();
        let over_limit = self.global.offline_sessions.load(Ordering::Relaxed)
            >= self.limits.max_offline_sessions;
        let moved_away = client.saved == session_state::Saved::MovedAway;
        if expiry == 0 || over_limit {
            if let Some(pending) = st.clients[slot as usize].pending_will.take() {
                will_now = Some(pending.1);
            }
            self.remove_client(st, slot);
        } else {
            self.log_detached(&client.session, false);
            client.offline_since = Some(now);
            self.global.offline_sessions.fetch_add(1, Ordering::Relaxed);
            self.save_session(st, slot, None);
            if moved_away && st.clients[slot as usize].pending_will.is_none() {
                // Another replica's now (a delayed will waits for the
                // cluster's word first: `end_pending_will`).
                self.remove_client(st, slot);
            }
        }
        if let Some(will) = will_now {
            self.publish_will(st, Some(&client_id), will, now);
        }
    }

    /// Handle a message from shard `from`.
    pub(crate) fn on_remote(&self, from: usize, msg: ShardMsg) {
        let msg = match msg {
            ShardMsg::Forget(forget) => return self.on_forget(from, *forget),
            msg => msg,
        };
        let now = Instant::now();
        let mut st = self.state.borrow_mut();
        let st = &mut *st;
        self.catch_up(st);
        match msg {
            ShardMsg::Deliver(messages) => {
                for message in &messages {
                    self.dispatch_local(st, message, from, now);
                }
            }
            ShardMsg::DeliverShared(shared) => {
                let SharedDelivery { key, client_id, subscription, message } = *shared;
                self.deliver_shared_local(st, key, &client_id, subscription, message, now);
            }
            ShardMsg::Handoff(_) | ShardMsg::Arrivals(_) | ShardMsg::Move(_) | ShardMsg::Forget(_) => {
                unreachable!("connections are taken by the shard's receiving task, Forget above")
            }
        }
    }

    /// Send what this shard batched for the others, waiting (and so
    /// slowing the calling connection) while a peer's channel is full.
    /// Only connection tasks call this; tasks that drain the channels call
    /// [`Shard::try_flush`], so two shards can never wait on each other.
    pub(crate) async fn flush(&self) {
        while !self.try_flush() {
            glommio::timer::sleep(std::time::Duration::from_micros(100)).await;
        }
    }

    /// Have what this shard batched for the others sent once the tasks
    /// that are ready now have run: the shard's flusher task (woken here)
    /// runs after them, so the batches of every connection served in this
    /// turn travel as one channel message per peer, and the peers wake
    /// once for them rather than once per connection. A connection whose
    /// shard already holds [`DEFER_FLUSH_MAX`] undelivered batches or
    /// messages, or [`DEFER_FLUSH_BYTES`] of payload, waits for the flush
    /// instead, which is the backpressure [`Shard::flush`] gives.
    pub(crate) async fn flush_soon(&self) {
        let (pending, bytes) = {
            let st = self.state.borrow();
            (st.control.len() + st.outbox.iter().map(Vec::len).sum::<usize>(), st.outbox_bytes)
        };
        if pending >= DEFER_FLUSH_MAX || bytes >= DEFER_FLUSH_BYTES {
            self.flush().await;
        } else if pending > 0 {
            self.flush_signal.notify();
        }
    }

    /// Send what fits into the peers' channels without waiting; keep the
    /// rest, in order, for the next flush. Returns true when all was sent.
    pub(crate) fn try_flush(&self) -> bool {
        let mut st = self.state.borrow_mut();
        let st = &mut *st;
        if st.control.is_empty() && st.outbox.iter().all(Vec::is_empty) {
            return true;
        }
        let mut batch: Vec<(usize, ShardMsg)> = std::mem::take(&mut st.control);
        for (peer, messages) in st.outbox.iter_mut().enumerate() {
            if !messages.is_empty() {
                batch.push((peer, ShardMsg::Deliver(std::mem::take(messages))));
            }
        }
        st.outbox_bytes = 0;
        let mut left = Vec::new();
        let mut blocked = [false; 64];
        for (peer, msg) in batch {
            // Keep per-peer order: once a peer is full, queue the rest for it.
            if blocked[peer] {
                left.push((peer, msg));
                continue;
            }
            match self.senders.try_send_to(peer, msg) {
                Ok(()) => {}
                Err(glommio::GlommioError::WouldBlock(glommio::ResourceType::Channel(msg))) => {
                    blocked[peer] = true;
                    left.push((peer, msg));
                }
                Err(_) => {} // the peer is stopping
            }
        }
        let done = left.is_empty();
        st.control = left;
        done
    }

    /// Close every connection with DISCONNECT 0x8B (server shutting down).
    pub(crate) fn close_all(&self) {
        self.stopping.set(true);
        self.close_connections(ReasonCode::SERVER_SHUTTING_DOWN);
    }

    /// Make up a client identifier that this shard owns, for a client that
    /// sent none `[MQTT-3.1.3-6]`.
    pub(crate) fn assign_client_id(&self) -> String {
        loop {
            let id = format!("fleetmq-{:016x}", rand::random::<u64>());
            if owner_of(&id, self.shards) == self.id {
                return id;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fleetmq_core::packet::ProtocolVersion;
    use fleetmq_core::session::{negotiate, ConnectLimits};

    fn client(client_id: &str) -> Client {
        let connect = Connect {
            protocol: ProtocolVersion::V5,
            clean_start: true,
            keep_alive: 60,
            client_id: ByteString::from(client_id),
            will: None,
            username: None,
            password: None,
            properties: Props::default(),
        };
        let negotiated = negotiate(&connect, &ConnectLimits::default(), || unreachable!()).unwrap();
        Client {
            session: Session::new(ProtocolVersion::V5, &negotiated, Arc::default()),
            owner: (None, crate::auth::workspace_name("default")),
            key: client_key(client_id),
            conn: None,
            will: None,
            pending_will: None,
            offline_since: None,
            saved: session_state::Saved::No,
            log: None,
            reopened: None,
        }
    }

    #[test]
    fn deadlines_of_ended_connections_are_dropped_once_they_are_most_of_the_heap() {
        let now = Instant::now();
        let mut clients = Slab::new();
        let mut deadlines = BinaryHeap::new();
        // 10 connected clients, each with its current entry.
        for i in 0..10u64 {
            let mut c = client(&format!("live-{i}"));
            c.conn = Some(Rc::new(ConnShared::new(i, ProtocolVersion::V5, 60, None, now)));
            let slot = clients.insert(c) as Slot;
            deadlines.push(Reverse((now, slot, i)));
        }
        // Entries of connections that ended: a slot reused by a later
        // connection (another key), and slots now empty.
        deadlines.push(Reverse((now, 0, 1000)));
        for slot in 10..60 {
            deadlines.push(Reverse((now, slot, 2000 + u64::from(slot))));
        }
        compact_deadlines(&mut deadlines, &clients, 10);
        assert_eq!(deadlines.len(), 61, "few stale entries are left alone");
        for slot in 60..500 {
            deadlines.push(Reverse((now, slot, 2000 + u64::from(slot))));
        }
        compact_deadlines(&mut deadlines, &clients, 10);
        let mut left: Vec<(Slot, u64)> = deadlines.iter().map(|Reverse((_, s, k))| (*s, *k)).collect();
        left.sort();
        assert_eq!(left, (0..10).map(|i| (i as Slot, i)).collect::<Vec<_>>());
        assert!(deadlines.capacity() <= 2 * deadlines.len() + 64, "capacity {}", deadlines.capacity());
    }

    #[test]
    fn a_cross_shard_message_fits_in_four_words() {
        // Each cross-shard channel holds SHARD_CHANNEL_CAPACITY of these.
        assert!(std::mem::size_of::<ShardMsg>() <= 32, "{}", std::mem::size_of::<ShardMsg>());
    }

    #[test]
    fn client_index_finds_inserted_sessions_and_forgets_removed_ones() {
        let mut clients = Slab::new();
        let mut index = ClientIndex::default();
        let ids: Vec<String> = (0..5000).map(|i| format!("device-{i}")).collect();
        for id in &ids {
            let slot = clients.insert(client(id)) as Slot;
            index.insert(&clients, slot);
        }
        for (i, id) in ids.iter().enumerate() {
            assert_eq!(index.get(&clients, id), Some(i as Slot), "{id}");
        }
        assert_eq!(index.get(&clients, "device-5000"), None);
        assert_eq!(index.get(&clients, ""), None);
        // Remove every other session the way the shard does: out of the
        // slab first, then out of the index.
        for (i, id) in ids.iter().enumerate().step_by(2) {
            let gone = clients.remove(i);
            index.remove(gone.session.client_id(), i as Slot);
            assert_eq!(index.get(&clients, id), None, "{id}");
        }
        for (i, id) in ids.iter().enumerate().skip(1).step_by(2) {
            assert_eq!(index.get(&clients, id), Some(i as Slot), "{id}");
        }
        // A slot reused by another client identifier is found under the
        // new one only.
        let slot = clients.insert(client("replacement")) as Slot;
        index.insert(&clients, slot);
        assert_eq!(index.get(&clients, "replacement"), Some(slot));
        assert_eq!(index.get(&clients, &ids[slot as usize]), None);
        assert_eq!(index.table.len(), ids.len() / 2 + 1);
    }
}
