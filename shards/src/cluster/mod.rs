//! The cluster as the shards see it (DESIGN.md §3–§5): a [`Node`] per
//! process over the NATS bridge, and per shard a task that acts on the
//! bridge's events (fencing, client identifiers taken over by another
//! replica) plus the claims this shard's connections hold.
//!
//! The hooks are narrow and enqueue-only: the only awaited cluster call is
//! the client identifier claim a connection task makes before its CONNACK,
//! with no shard state borrowed.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use fleetmq_core::packet::ReasonCode;
use fleetmq_core::settings::Settings;
use fleetmq_nats_bridge::{Bridge, BridgeConfig, ClaimError, ClusterStatus, Event, Request};
use futures_lite::future::or;
use glommio::timer::sleep;
use fleetmq_core::cluster::sessions::SessionRecord;
use tracing::{debug, info};

use crate::metrics::RefuseReason;
use crate::shard::Shard;

mod ingest;
mod parked;
mod qos2;
mod report;
mod retained;
mod session_log;
mod sessions;
mod wills;

pub(crate) use ingest::{append_ingest, wants_log, IngestRecord};
pub(crate) use qos2::{flow as qos2_flow, purge as purge_qos2, release as release_qos2};
pub(crate) use retained::{publish_retained, Retained};
pub(crate) use session_log::{count_missed, node, save_cursor, shard_weak};
pub(crate) use sessions::{save_session, set_interest};

/// How long a client identifier lost to another replica is remembered, to
/// refuse a late attach of the losing connection. (A client identifier
/// that flaps between replicas is slowed down by the claim itself: see
/// [`fleetmq_nats_bridge::FLAP_DELAY`].)
const LOST_MEMORY: Duration = Duration::from_secs(10);

/// How often a shard looks after its delayed wills in `mqtt-session-will`
/// when no event wakes it.
const RECONCILE_EVERY: Duration = Duration::from_secs(1);

/// How long the start waits for the shards to apply the initial retained
/// load before it prints `fleetmq: ready` anyway (`/health/ready` says
/// "loading retained messages" until they have).
const RETAINED_APPLY_WAIT: Duration = Duration::from_secs(15);

/// Lost client identifiers remembered per shard at most.
const LOST_MAX: usize = 100_000;

/// This process as a replica: the bridge, and the numbering of its
/// connections' claims.
#[derive(Debug)]
pub(crate) struct Node {
    bridge: Bridge,
    next_conn: AtomicU64,
    /// `cluster.connect_budget`.
    pub(crate) connect_budget: Duration,
    /// `cluster.session_log_append_wait`: how long a QoS 1/2 retained
    /// value waits for `mqtt-retained` before it is refused.
    append_wait: Duration,
    /// The mesh, when certificates are configured.
    pub(crate) mesh: Option<Arc<crate::mesh::Mesh>>,
    /// The least time a claim stays parked after its connection ended
    /// (see `parked`): `cluster.will_stop_grace` after a lost replica is
    /// taken for gone, which is at most 2 × `cluster.member_ttl` after its
    /// last write (DESIGN.md §5).
    parks_at_least: Duration,
    /// This replica's ID (`cluster.replica_id`, or the host name).
    replica_id: String,
}

impl Node {
    /// Start the bridge for `settings.cluster` with `shards` shards (the
    /// replica ID defaults to the host name).
    ///
    /// # Errors
    /// NATS cannot be reached, or a start-up check refused (API level,
    /// buckets, format floor, `member_ttl`): the broker does not start.
    pub(crate) fn start(settings: &Settings, shards: usize) -> anyhow::Result<Arc<Node>> {
        let cluster = settings.cluster.clone().expect("called with a [cluster] section");
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        let replica_id = cluster.replica_id_or(host.trim());
        // Bound before the bridge starts: the member record carries the
        // port (port 0 included).
        let mesh = crate::mesh::Mesh::start(settings, &replica_id, shards)?;
        let started_at_ms = crate::store::unix_ms();
        let config = BridgeConfig {
            cluster: cluster.clone(),
            replica_id: replica_id.clone(),
            instance: format!("{:016x}", rand::random::<u64>()),
            started_at_ms,
            shards,
            owner_of: crate::shard::owner_of,
            mesh: mesh.as_ref().map(|m| m.advertise.clone()).unwrap_or_default(),
            mesh_versions: crate::mesh::spoken().to_vec(),
            ingest: (settings.store.kind == fleetmq_core::settings::StoreKind::Jetstream).then(|| settings.store.clone()),
            session_log_max_age: settings.limits.max_session_expiry,
        };
        let bridge = Bridge::start(config).with_context(|| format!("cluster: replica {replica_id}"))?;
        info!(target: "cluster", replica = %replica_id, "cluster: joined");
        Ok(Arc::new(Node {
            bridge,
            next_conn: AtomicU64::new(1),
            connect_budget: cluster.connect_budget,
            append_wait: cluster.session_log_append_wait,
            parks_at_least: cluster.will_stop_grace + 2 * cluster.member_ttl,
            mesh,
            replica_id,
        }))
    }

    /// The cluster's status (fenced, members, bridge counters).
    pub(crate) fn status(&self) -> &Arc<ClusterStatus> {
        self.bridge.status()
    }

    /// Requests queued for the bridge.
    pub(crate) fn queue_depth(&self) -> usize {
        self.bridge.queue_depth()
    }

    /// Claim `client_id` for a new connection, within `budget`.
    ///
    /// # Errors
    /// The refusal to send (CONNACK 0x88 Server unavailable; MQTT 3.1.1
    /// return code 3): the replica is fenced, JetStream did not take the
    /// claim, or the budget ran out.
    /// `clean_start`: the CONNECT's Clean Start flag (recorded with the
    /// claim, for the will of the connection it takes over).
    async fn claim(self: &Arc<Self>, client_id: &str, clean_start: bool, budget: Duration) -> Result<Claim, Refused> {
        if self.status().is_fenced() {
            return Err(FENCED);
        }
        let conn = self.next_conn.fetch_add(1, Ordering::Relaxed);
        let (reply, outcome) = tokio::sync::oneshot::channel();
        let request = Request::Claim { client_id: client_id.to_owned(), conn, clean_start, reply };
        if self.bridge.send(request).is_err() {
            return Err(unavailable("cluster bridge queue full"));
        }
        let mut outcome = outcome;
        let claim = |claimed: fleetmq_nats_bridge::Claimed| Claim {
            node: self.clone(),
            client_id: client_id.to_owned(),
            revision: claimed.revision,
            will: None,
            epoch: self.status().epoch(),
            parks_for: None,
            moved: claimed.moved,
            taken_up: None,
            resume: None,
            inbound_qos2: Vec::new(),
        };
        match within(budget, &mut outcome).await {
            Some(Ok(Ok(claimed))) => {
                if let Some(previous) = &claimed.previous {
                    debug!(target: "cluster", client_id, %previous, "cluster: client identifier taken over from another replica");
                }
                Ok(claim(claimed))
            }
            Some(Ok(Err(ClaimError::Fenced))) => Err(FENCED),
            Some(Ok(Err(_))) | Some(Err(_)) => Err(unavailable("cluster store unavailable")),
            None => {
                // Refused: a claim that lands from now on is given up by
                // the bridge; one that landed just now is given up here.
                outcome.close();
                if let Ok(Ok(claimed)) = outcome.try_recv() {
                    drop(claim(claimed));
                }
                Err(unavailable("connect budget exceeded"))
            }
        }
    }

    /// Start this shard's part of the mesh (its listener), if there is one.
    pub(crate) fn start_mesh(&self, shard: &Rc<Shard>) {
        if let Some(mesh) = &self.mesh {
            if let Some(fd) = mesh.take_listener(shard.id) {
                crate::mesh::incoming::spawn_acceptor(shard, mesh, fd);
            }
        }
    }

    /// Stop the bridge (drains, then joins); later calls do nothing.
    pub(crate) fn stop(&self) {
        self.bridge.stop();
    }
}

/// Print `fleetmq: ready` once the replica is not a duplicate: a process
/// started with a replica ID that another live process runs says so
/// instead (`fleetmq: not ready: duplicate replica id ...`, and in the log
/// and on `/health/ready`), and prints `fleetmq: ready` only once that
/// process is gone (DESIGN.md §12).
pub(crate) fn announce_when_ready(node: &Arc<Node>) {
    let status = node.status().clone();
    // The shards apply the initial retained load from their mailboxes
    // (the bridge has all of it by now): ready once every shard has it.
    let applied_by = Instant::now() + RETAINED_APPLY_WAIT;
    while !status.retained_applied() && Instant::now() < applied_by {
        std::thread::sleep(Duration::from_millis(2));
    }
    if !status.is_duplicate() {
        crate::server::announce(format_args!("fleetmq: ready"));
        return;
    }
    let why = status.not_ready().unwrap_or_else(|| "duplicate replica id".to_owned());
    tracing::warn!(target: "cluster", "cluster: not ready: {why}");
    crate::server::announce(format_args!("fleetmq: not ready: {why}"));
    let spawned = std::thread::Builder::new().name("fleetmq-ready".into()).spawn(move || {
        // Ready once the other process is gone and this one purged the
        // routes left under its replica ID.
        while status.is_duplicate() || !status.routes_purged() {
            std::thread::sleep(Duration::from_millis(200));
        }
        info!(target: "cluster", "cluster: the other process of this replica ID is gone: ready");
        crate::server::announce(format_args!("fleetmq: ready"));
    });
    if let Err(e) = spawned {
        tracing::warn!(target: "cluster", error = %e, "cluster: cannot watch the duplicate replica id");
    }
}

/// Why the cluster refused a CONNECT (CONNACK 0x88): the reason counted
/// in `fleetmq_connect_refused_total` and the detail logged.
pub(crate) type Refused = (RefuseReason, &'static str);

const FENCED: Refused = (RefuseReason::Fenced, "replica fenced");

fn unavailable(why: &'static str) -> Refused {
    (RefuseReason::ClusterUnavailable, why)
}

impl Node {
    /// Admit a signed-in CONNECT that arrived at `connect_at` (DESIGN.md
    /// §8): claim its client identifier and store its will, within what is
    /// left of `cluster.connect_budget`. A client identifier that another
    /// replica claimed less than a second ago waits out that second first
    /// (in the claim: [`fleetmq_nats_bridge::FLAP_DELAY`]).
    ///
    /// # Errors
    /// The refusal: the replica is fenced, or the claim or the will did not
    /// land in time.
    pub(crate) async fn admit(
        self: &Arc<Self>,
        client_id: &str,
        connect_at: Instant,
        connect: &fleetmq_core::packet::Connect,
        session_expiry: u32,
        identity: &crate::auth::Identity,
    ) -> Result<Claim, Refused> {
        if self.status().is_fenced() {
            return Err(FENCED);
        }
        let budget = |now: Instant| self.connect_budget.saturating_sub(now.duration_since(connect_at));
        let mut claim = self.claim(client_id, connect.clean_start, budget(Instant::now())).await?;
        if claim.moved {
            // Served by another replica before (DESIGN.md §6): its
            // persistent session goes on here, or Clean Start ends it.
            if connect.clean_start {
                save_session(client_id, None::<fn(&str) -> SessionRecord>, None);
                purge_qos2(client_id);
            } else {
                claim.taken_up = self.session_to_take_up(client_id, budget(Instant::now())).await?;
                if claim.taken_up.is_some() {
                    claim.resume = self.resume_of(client_id, budget(Instant::now())).await?;
                    claim.inbound_qos2 = self.qos2_of(client_id, budget(Instant::now())).await?;
                }
            }
        }
        if let Some(will) = &connect.will {
            // Stored as the shard keeps it: the topic with the workspace prefix.
            let mut will = will.clone();
            let namespace = fleetmq_core::session::workspace_namespace(&identity.workspace);
            if !namespace.is_empty() {
                will.topic = format!("{namespace}{}", will.topic).into();
            }
            claim.store_will(&will, identity, (session_expiry, connect.clean_start), budget(Instant::now())).await?;
        }
        // A persistent session outlives its connection here: so does its
        // claim (see `parked`). A claim taken from another replica stays
        // at least until the sweeper could send the will of a connection
        // that replica had for this client (were it lost): it reads the
        // claim as "the client came back". Set last:
        // a CONNECT refused here (its will not stored in time) gives the
        // claim up at once.
        claim.parks_for = parks_for(session_expiry, if claim.moved { self.parks_at_least } else { Duration::ZERO });
        Ok(claim)
    }
}

/// How long a claim stays parked once its connection ended: the session
/// expiry interval (seconds), and at least `grace`; `None` (released at
/// once) when both are zero.
fn parks_for(session_expiry: u32, grace: Duration) -> Option<Duration> {
    let parked = Duration::from_secs(u64::from(session_expiry)).max(grace);
    (!parked.is_zero()).then_some(parked)
}

/// `future`'s output, or `None` when `budget` runs out first.
async fn within<T>(budget: Duration, future: impl std::future::Future<Output = T>) -> Option<T> {
    or(async { Some(future.await) }, async {
        sleep(budget).await;
        None
    })
    .await
}

/// A connection's claim on its client identifier: released (if still the
/// latest claim) when the connection ends and this is dropped, and with it
/// the connection's will in `mqtt-session-will` — unless the shard hands
/// its wills to the cluster (fenced, stopping), when the will stays for
/// the sweeper.
pub(crate) struct Claim {
    node: Arc<Node>,
    pub(crate) client_id: String,
    pub(crate) revision: u64,
    /// The revision of the connection's will in `mqtt-session-will`.
    will: Option<u64>,
    /// The replica's epoch when the claim was made: a connection that ends
    /// at a later one lived through a fence, which handed its will over.
    epoch: u64,
    /// A persistent session's expiry interval: when the connection ends,
    /// the claim is parked this long instead of released (see `parked`).
    parks_for: Option<Duration>,
    /// The client identifier was another replica's before this claim.
    moved: bool,
    /// The persistent session to take up (Clean Start 0, the client
    /// identifier another replica's before): its record in
    /// `mqtt-session-state`, not expired.
    pub(crate) taken_up: Option<Box<fleetmq_core::cluster::sessions::SessionRecord>>,
    /// With `taken_up`: its cursor and unacknowledged values (see
    /// `session_log`).
    pub(crate) resume: Option<Box<crate::shard::Resume>>,
    /// With `taken_up`: the packet identifiers of its open inbound QoS 2
    /// flows in `mqtt-session-qos2`, each with its value's message ID
    /// (see `qos2`).
    pub(crate) inbound_qos2: Vec<(u16, String)>,
}

impl Drop for Claim {
    fn drop(&mut self) {
        // This shard's table forgets the claim, unless a newer one of the
        // same client identifier replaced it.
        let _ = SHARD.try_with(|sc| {
            let mut claims = sc.claims.borrow_mut();
            if claims.get(&self.client_id) == Some(&self.revision) {
                claims.remove(&self.client_id);
            }
        });
        if let Some(revision) = self.will {
            // Closed by a fence (even one over by now: the epoch moved on)
            // or a stop: the will stays for the sweeper.
            let handed_over = SHARD.try_with(|sc| sc.handing_over.get()).unwrap_or(false)
                || self.node.status().epoch() != self.epoch;
            if !handed_over {
                wills::connection_ended(&self.node, &self.client_id, (revision, self.revision));
            }
        }
        if let Some(expiry) = self.parks_for {
            // Not at a fence or a stop: the release goes out as before.
            let now = Instant::now();
            let until = now.checked_add(expiry).unwrap_or(now + parked::FOREVER);
            let parked = SHARD
                .try_with(|sc| {
                    // A newer claim, here (a take-over on this replica) or
                    // by another replica, makes this one moot.
                    let moot = sc.claims.borrow().get(&self.client_id).is_some_and(|r| *r > self.revision)
                        || sc.lost.borrow().get(&self.client_id).is_some_and(|(r, _, _)| *r > self.revision);
                    !sc.handing_over.get()
                        && (moot || sc.parked.borrow_mut().park(&self.client_id, self.revision, until))
                })
                .unwrap_or(false);
            if parked {
                return;
            }
        }
        let request = Request::Release { client_id: std::mem::take(&mut self.client_id), revision: self.revision };
        // A full queue loses only the release: the entry stays until the
        // next claim replaces it.
        let _ = self.node.bridge.send_quietly(request);
    }
}

/// Tell the bridge that shard `shard` gained its first subscriber of
/// `filter` (`add`) or lost its last (see `crate::shard::wanted`);
/// `landed` hears when the route is written. False when not sent (alone,
/// the shard's cluster task not started yet, or the bridge's queue full:
/// counted in `fleetmq_bridge_queue_full_total`).
pub(crate) fn want_route(filter: &str, shard: usize, add: bool, landed: Option<tokio::sync::oneshot::Sender<Option<u64>>>) -> bool {
    let Some(node) = shard_state(|sc| sc.node.borrow().clone()) else { return false };
    let waits = landed.is_some();
    let request = Request::Route { filter: filter.to_owned(), shard, add, landed };
    // Nobody waits for a delete: taken on the bridge's next turn.
    let sent = if waits { node.bridge.send(request) } else { node.bridge.send_quietly(request) };
    if sent.is_err() {
        debug!(target: "cluster", filter, add, "cluster: route not sent: the bridge's queue is full");
    }
    sent.is_ok()
}

/// Announce over the mesh (protocol version 3) that this replica wants
/// (`present`) or no longer wants `filter`, as its write at `revision` of
/// `mqtt-routes` says, on this shard's links: one answer per peer linked
/// with version 3, heard once that peer applied it on every shard. None
/// without a mesh.
pub(crate) fn announce_route(filter: &str, revision: u64, present: bool) -> Vec<tokio::sync::oneshot::Receiver<()>> {
    let Some(node) = shard_state(|sc| sc.node.borrow().clone()) else { return Vec::new() };
    if node.mesh.is_none() {
        return Vec::new();
    }
    let Some(shard) = shard_state(|sc| sc.shard.borrow().as_ref().and_then(std::rc::Weak::upgrade)) else { return Vec::new() };
    shard.links.announce(&node.status().instance, filter, revision, present)
}

/// A peer's route announce read on a mesh link of this shard: merged into
/// the route table, applied on every shard; the answer resolves when all
/// took it (see [`fleetmq_nats_bridge::Bridge::announced`]). `None` alone.
pub(crate) fn route_announced(announce: fleetmq_nats_bridge::Announce) -> Option<tokio::sync::oneshot::Receiver<()>> {
    let node = shard_state(|sc| sc.node.borrow().clone())?;
    Some(node.bridge.announced(announce))
}

/// A SUBACK went without its route written within 2 s
/// (`fleetmq_routes_late_total`).
pub(crate) fn route_late() {
    if let Some(node) = shard_state(|sc| sc.node.borrow().clone()) {
        node.status().stats.routes_late.fetch_add(1, Ordering::Relaxed);
    }
}

thread_local! {
    /// The cluster state of the shard running on this thread.
    static SHARD: ShardCluster = ShardCluster::default();
}

/// Run `f` with this shard's [`ShardCluster`].
pub(crate) fn shard_state<R>(f: impl FnOnce(&ShardCluster) -> R) -> R {
    SHARD.with(f)
}

/// A shard's part of the cluster: the claims of the connections attached
/// here (each removed when its [`Claim`] is dropped, on this thread), and
/// the client identifiers other replicas took from it.
#[derive(Default)]
pub(crate) struct ShardCluster {
    /// The replica's node, set when the shard's event task starts.
    node: RefCell<Option<Arc<Node>>>,
    /// Connections closing now hand their wills to the cluster (the
    /// replica is fenced or stopping): their wills stay in
    /// `mqtt-session-will` for the sweeper.
    handing_over: std::cell::Cell<bool>,
    /// Client identifier → revision of the claim of the connection served
    /// here.
    claims: RefCell<HashMap<String, u64>>,
    /// Client identifier → (revision of another replica's claim, when,
    /// whether that claim had Clean Start 1).
    lost: RefCell<HashMap<String, (u64, Instant, bool)>>,
    /// The shard on this thread, set when its event task starts.
    shard: RefCell<Option<std::rc::Weak<Shard>>>,
    /// The delayed wills of this shard's ended connections in
    /// `mqtt-session-will` (see `wills`).
    delayed: wills::Delayed,
    /// Claims of persistent sessions whose connection ended (see `parked`).
    parked: RefCell<parked::Parked>,
    /// The ingest appends waiting for their batched answer (see
    /// `ingest.rs`).
    appends: ingest::Appends,
}

impl ShardCluster {
    /// Whether a connection of this replica whose claim of the same client
    /// identifier landed after `claim` attached here first: claims of one
    /// client identifier run side by side in the bridge, and the later
    /// claim's CONNECT may reach the shard first. The CONNECT of `claim`
    /// is then refused before it attaches (it would take the later one
    /// over): the one whose claim landed last stays, as across replicas.
    pub(crate) fn superseded(&self, claim: &Claim) -> bool {
        self.claims.borrow().get(&claim.client_id).is_some_and(|r| *r > claim.revision)
    }

    /// A connection holding `claim` attached here. `false`: another
    /// replica's later claim arrived first, and the connection must be
    /// closed as taken over.
    pub(crate) fn attached(&self, claim: &Claim) -> bool {
        if let Some((revision, _, _)) = self.lost.borrow().get(&claim.client_id) {
            if *revision > claim.revision {
                return false;
            }
        }
        self.parked.borrow_mut().remove(&claim.client_id);
        self.claims.borrow_mut().insert(claim.client_id.clone(), claim.revision);
        true
    }

    /// Whether a connection here holds a claim of `client_id` later than
    /// `revision`.
    fn holds_newer(&self, client_id: &str, revision: u64) -> bool {
        self.claims.borrow().get(client_id).is_some_and(|mine| *mine > revision)
    }

    /// Another replica claimed `client_id` at `revision` (with Clean Start
    /// 1 when `clean_start`): whether a connection here holds an older
    /// claim (and must close).
    fn lost_to(&self, client_id: &str, (revision, clean_start): (u64, bool), now: Instant) -> bool {
        let mut lost = self.lost.borrow_mut();
        if lost.len() >= LOST_MAX {
            // Bounded: the oldest are forgotten.
            lost.retain(|_, (_, at, _)| now.saturating_duration_since(*at) < LOST_MEMORY);
            if lost.len() >= LOST_MAX {
            // Bounded: the oldest are forgotten.
                lost.clear();
            }
        }
        lost.insert(client_id.to_owned(), (revision, now, clean_start));
        self.parked.borrow_mut().remove(client_id);
        let mut claims = self.claims.borrow_mut();
        match claims.get(client_id) {
            Some(mine) if *mine < revision => {
                claims.remove(client_id);
                true
            }
            _ => false,
        }
    }
}

/// The shard stops: the wills of the connections it closes now are
/// handed to the cluster (DESIGN.md §5: they wait `will_stop_grace`).
pub(crate) fn hand_over_wills() {
    shard_state(|sc| sc.handing_over.set(true));
}

/// Run `shard`'s cluster events until the shard stops: fencing closes
/// every connection (MQTT 5: DISCONNECT 0x8B); a client identifier claimed
/// by another replica closes its connection here (0x8E).
pub(crate) fn spawn_events(shard: Rc<Shard>, node: Arc<Node>) {
    let mailbox = node.bridge.mailbox(shard.id);
    shard_state(|sc| {
        *sc.node.borrow_mut() = Some(node.clone());
        *sc.shard.borrow_mut() = Some(Rc::downgrade(&shard));
    });
    node.start_mesh(&shard);
    shard.announce_routes();
    {
        // Catching-up sessions read on and cursors are written.
        let shard = shard.clone();
        glommio::spawn_local(async move {
            loop {
                let stop = or(async { sleep(crate::shard::CURSOR_EVERY).await; false }, async {
                    shard.stop_signal.wait().await;
                    true
                });
                if stop.await {
                    break;
                }
                shard.log_tick();
            }
        })
        .detach();
    }
    glommio::spawn_local(async move {
        let mut events = Vec::new();
        loop {
            let woken = or(async { mailbox.ready().await; Some(true) }, async {
                shard.stop_signal.wait().await;
                Some(false)
            });
            // Delayed wills are looked after once a second as well.
            let woken = or(woken, async {
                sleep(RECONCILE_EVERY).await;
                None
            });
            match woken.await {
                Some(false) => {
                    shard.links.stop();
                    break;
                }
                Some(true) => {}
                None => {
                    wills::reconcile(&node, &shard);
                    parked::release_due(&node);
                    ingest::give_up_overdue(Instant::now());
                    continue;
                }
            }
            mailbox.drain(&mut events);
            let now = Instant::now();
            let mut retained = 0;
            for event in events.drain(..) {
                match event {
                    Event::Fenced(_) => {
                        shard_state(|sc| sc.handing_over.set(true));
                        shard.close_connections(ReasonCode::SERVER_SHUTTING_DOWN);
                        wills::hand_over(&shard);
                    }
                    Event::Unfenced => shard_state(|sc| sc.handing_over.set(false)),
                    Event::Routes(changes) => shard.apply_routes(&changes),
                    // In order after the changes it follows.
                    Event::Applied(applied) => applied.shard_done(),
                    Event::RouteDeleted { filter, revision } => {
                        // Nobody waits: the answers are dropped.
                        drop(announce_route(&filter, revision, false));
                    }
                    Event::Peers(peers) => {
                        if let Some(mesh) = &node.mesh {
                            shard.links.set_peers(&shard, mesh, &peers);
                        }
                    }
                    Event::PublishWill { will } => shard.publish_cluster_will(will, now),
                    Event::Retained { revision, message } => {
                        shard.apply_retained(revision, message, now);
                        retained += 1;
                    }
                    Event::LogValues { workspace, through, values } => shard.log_values(&workspace, through, &values),
                    Event::Appended(answers) => ingest::answered(answers),
                    Event::TakenOver { client_id, revision, replica, clean_start } => {
                        let newer_here = shard_state(|sc| sc.holds_newer(&client_id, revision));
                        if shard_state(|sc| sc.lost_to(&client_id, (revision, clean_start), now)) {
                            debug!(target: "cluster", %client_id, %replica, "cluster: taken over by another replica");
                            shard.close_client(&client_id, ReasonCode::SESSION_TAKEN_OVER);
                        }
                        if !newer_here {
                            // Its session is that replica's now.
                            shard.moved_away(&client_id);
                        }
                    }
                    _ => {}
                }
            }
            if retained > 0 {
                node.status().applied_retained(shard.id, retained);
            }
            wills::reconcile(&node, &shard);
            parked::release_due(&node);
            ingest::give_up_overdue(now);
            shard.try_flush();
        }
    })
    .detach();
}

#[cfg(test)]
mod tests {
    use super::parks_for;
    use std::time::Duration;

    #[test]
    fn a_claim_stays_parked_for_its_session_expiry_and_at_least_the_will_grace() {
        let grace = Duration::from_secs(30);
        assert_eq!(parks_for(0, grace), Some(grace), "a clean session's claim outlives it by the grace");
        assert_eq!(parks_for(10, grace), Some(grace));
        assert_eq!(parks_for(3600, grace), Some(Duration::from_secs(3600)));
        assert_eq!(parks_for(0, Duration::ZERO), None, "no grace, no session: released at once");
        assert_eq!(parks_for(5, Duration::ZERO), Some(Duration::from_secs(5)));
    }
}
