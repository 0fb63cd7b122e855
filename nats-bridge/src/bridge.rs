//! The bridge thread: start-up, the request loop, events to the shards,
//! and the stop.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use async_nats::jetstream::{self, Context};
use crossbeam_channel::{bounded, Receiver, Sender, TrySendError};
use fleetmq_core::cluster::membership::FenceReason;
use tokio::sync::{oneshot, Notify};
use tracing::{info, warn};

use crate::config::{connect, JS_TIMEOUT};
use crate::mailbox::Mailbox;
use crate::stats::BridgeStats;
use crate::{membership, ownership, retained, setup, sweeper, BridgeConfig};

/// Requests queued for the bridge at most; beyond, [`Bridge::send`]
/// refuses (the caller answers as for an unavailable store).
const REQUEST_QUEUE: usize = 65_536;

/// Events queued per shard mailbox; beyond, the bridge holds them and
/// offers them again on its next turn.
const EVENT_QUEUE: usize = 16_384;

/// How long [`Bridge::start`] waits for NATS, the buckets and the first
/// membership write.
const START_WAIT: Duration = Duration::from_secs(30);

/// Why the bridge did not start; the broker refuses to start with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// A setting cannot be used (a file that cannot be read, a bad URL).
    #[error("{0}")]
    Config(String),
    /// NATS or JetStream did not answer.
    #[error("cannot reach NATS JetStream: {0}")]
    Connect(String),
    /// The server or a stream is not what fleetmq needs (API level, a
    /// stream's configuration, the format floor, `member_ttl`).
    #[error("{0}")]
    Incompatible(String),
}

/// A request from a shard.
#[derive(Debug)]
#[non_exhaustive]
pub enum Request {
    /// Claim `client_id` for connection `conn` of this process in
    /// `mqtt-sessions` (create, or compare-and-set on the revision read).
    Claim {
        /// The client identifier.
        client_id: String,
        /// The connection, unique for this process's life.
        conn: u64,
        /// The CONNECT has Clean Start 1 (see [`OwnerRecord::clean_start`]).
        ///
        /// [`OwnerRecord::clean_start`]: fleetmq_core::cluster::records::OwnerRecord::clean_start
        clean_start: bool,
        /// The outcome.
        reply: oneshot::Sender<Result<Claimed, ClaimError>>,
    },
    /// Write a retained message (`record`: a [`RetainedRecord`]
    /// encoded) for `topic`, or clear it (`None`), in `mqtt-retained`
    /// (DESIGN.md §7). With a `reply`, the publisher's acknowledgement
    /// waits: answered once JetStream has it, or refused after `wait`; a
    /// refused write that lands anyway is undone (the topic gets
    /// `previous` back) unless another write followed it.
    ///
    /// [`RetainedRecord`]: fleetmq_core::cluster::retained::RetainedRecord
    RetainedPut {
        /// The topic, with its workspace prefix.
        topic: String,
        /// The record, or `None` to clear.
        record: Option<bytes::Bytes>,
        /// The topic's retained message before this write, as this
        /// replica knows it (`None`: none).
        previous: Option<Arc<fleetmq_core::session::Message>>,
        /// How long the publisher waits (`cluster.session_log_append_wait`).
        wait: Duration,
        /// The revision written, or why not; `None`: nobody waits (QoS
        /// 0, wills): a failure is logged and counted.
        reply: Option<oneshot::Sender<Result<u64, RetainedError>>>,
    },
    /// Answered at once with the bridge's clock: measures the queue, the
    /// bridge's turn and the wake of the waiting task (no NATS involved).
    Ping {
        /// When the bridge answered.
        reply: oneshot::Sender<std::time::Instant>,
    },
    /// Store `client_id`'s will (`record`: a `WillRecord` encoded) in
    /// `mqtt-session-will`.
    WillPut {
        /// The client identifier.
        client_id: String,
        /// The record.
        record: bytes::Bytes,
        /// The revision written, or why not.
        reply: oneshot::Sender<Result<u64, String>>,
    },
    /// The connection that declared `client_id`'s will (stored at
    /// `revision`) ended with the will's delay still running: record when
    /// this replica sends it (`due_at_ms`, Unix milliseconds), so that the
    /// sweeper sends it then if this replica is gone by then.
    WillDelayed {
        /// The client identifier.
        client_id: String,
        /// The revision of the connection's will.
        revision: u64,
        /// When the will is due, Unix milliseconds.
        due_at_ms: u64,
        /// The revision rewritten, or why not (the will was replaced, or
        /// the store did not answer).
        reply: oneshot::Sender<Result<u64, String>>,
    },
    /// Delete `client_id`'s will if `revision` is still its latest.
    WillDelete {
        /// The client identifier.
        client_id: String,
        /// The revision of this connection's will.
        revision: u64,
    },
    /// Give `client_id` up if the claim at `revision` is still the latest.
    Release {
        /// The client identifier.
        client_id: String,
        /// The revision of this replica's claim.
        revision: u64,
    },
}

/// Why a retained write was refused (see [`Request::RetainedPut`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RetainedError {
    /// JetStream did not take it within the wait (MQTT 5: PUBACK or
    /// PUBREC 0x80 Unspecified error).
    #[error("not stored: {0}")]
    Unavailable(String),
    /// The record does not fit the server's `max_payload` (MQTT 5: 0x97
    /// Quota exceeded).
    #[error("a record of {size} bytes does not fit the NATS max_payload of {limit} bytes")]
    TooLarge {
        /// The record's size, bytes.
        size: usize,
        /// The server's `max_payload`, bytes.
        limit: usize,
    },
}

/// A claim that landed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claimed {
    /// The revision of the claim in `mqtt-sessions`: a later revision by
    /// another replica takes the client identifier over.
    pub revision: u64,
    /// The replica that owned the client identifier before, when another.
    pub previous: Option<String>,
}

/// Why a claim did not land.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ClaimError {
    /// This replica is fenced.
    #[error("replica fenced")]
    Fenced,
    /// JetStream did not take the claim.
    #[error("store unavailable: {0}")]
    Unavailable(String),
}

/// An event for a shard.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Event {
    /// The replica fenced: close every connection (MQTT 5: DISCONNECT
    /// 0x8B) and refuse CONNECT until [`Event::Unfenced`].
    Fenced(FenceReason),
    /// The replica serves again.
    Unfenced,
    /// Publish the will of a connection of a stopped, fenced or gone
    /// replica (this replica holds the leader lock and sends it once).
    PublishWill {
        /// The will, its topic with the workspace prefix.
        will: fleetmq_core::packet::Will,
    },
    /// A retained message changed (any replica's write, this one's
    /// included), at `revision` of `mqtt-retained`: apply it in that order
    /// (an empty payload clears the topic).
    Retained {
        /// The bucket revision: the sequence of the change.
        revision: u64,
        /// The message (empty payload: cleared).
        message: Arc<fleetmq_core::session::Message>,
    },
    /// Another replica claimed `client_id` at `revision`: a connection
    /// with that identifier here whose claim is older is taken over (MQTT
    /// 5: DISCONNECT 0x8E).
    TakenOver {
        /// The client identifier.
        client_id: String,
        /// The revision of the other replica's claim.
        revision: u64,
        /// The replica that claimed it.
        replica: String,
        /// The claim's CONNECT had Clean Start 1: the session ended here,
        /// and a delayed will waiting here is sent at once (MQTT 5
        /// §3.1.2.5); else the session goes on there and the will is not
        /// sent `[MQTT-3.1.3-9]`.
        clean_start: bool,
    },
}

/// What the admin endpoints and the CONNECT path read of the cluster.
#[derive(Debug)]
pub struct ClusterStatus {
    /// This replica's ID.
    pub replica_id: String,
    /// This process's instance ID.
    pub instance: String,
    fenced: AtomicBool,
    reason: Mutex<Option<String>>,
    members: Mutex<Vec<String>>,
    /// Retained messages of the initial load, once it is complete.
    retained_loaded: std::sync::atomic::AtomicU64,
    /// Per shard, the retained changes it applied (see
    /// [`ClusterStatus::applied_retained`]).
    retained_applied: Vec<std::sync::atomic::AtomicU64>,
    /// The cluster's format floor, read at start and followed since.
    floor: std::sync::atomic::AtomicU16,
    /// How many times this process came back from a fence.
    epoch: std::sync::atomic::AtomicU64,
    /// Another process runs this replica ID.
    duplicate: AtomicBool,
    /// What the bridge counts.
    pub stats: BridgeStats,
}

impl ClusterStatus {
    fn new(replica_id: String, instance: String, shards: usize) -> ClusterStatus {
        ClusterStatus {
            replica_id,
            instance,
            fenced: AtomicBool::new(true),
            reason: Mutex::new(Some(FenceReason::Starting.as_str().to_owned())),
            members: Mutex::new(Vec::new()),
            retained_loaded: std::sync::atomic::AtomicU64::new(u64::MAX),
            retained_applied: (0..shards).map(|_| std::sync::atomic::AtomicU64::new(0)).collect(),
            floor: std::sync::atomic::AtomicU16::new(*fleetmq_core::cluster::records::FORMATS_READ.start()),
            epoch: std::sync::atomic::AtomicU64::new(0),
            duplicate: AtomicBool::new(false),
            stats: BridgeStats::default(),
        }
    }

    /// Whether the replica is fenced (or not yet a member): CONNECT is
    /// refused with 0x88.
    pub fn is_fenced(&self) -> bool {
        self.fenced.load(Ordering::Acquire)
    }

    /// Why the replica is not ready, `None` when it is: fenced, starting,
    /// a duplicate replica ID, or the retained messages still loading
    /// (until every shard applied the initial load).
    pub fn not_ready(&self) -> Option<String> {
        let reason = self.reason.lock().ok().and_then(|r| r.clone());
        reason.or_else(|| (!self.retained_applied()).then(|| "loading retained messages".to_owned()))
    }

    /// Shard `shard` applied `n` more retained changes ([`Event::Retained`]).
    pub fn applied_retained(&self, shard: usize, n: u64) {
        if let Some(applied) = self.retained_applied.get(shard) {
            applied.fetch_add(n, Ordering::Release);
        }
    }

    /// Whether every shard applied the initial load of `mqtt-retained`: a
    /// SUBSCRIBE on any shard is answered from all of it. Changes reach
    /// each shard in order, the load first, so a shard that applied as
    /// many changes as the load held has applied the load.
    pub fn retained_applied(&self) -> bool {
        let loaded = self.retained_loaded.load(Ordering::Acquire);
        loaded != u64::MAX && self.retained_applied.iter().all(|a| a.load(Ordering::Acquire) >= loaded)
    }

    /// The cluster's format floor as this replica last read it.
    pub fn floor(&self) -> u16 {
        self.floor.load(Ordering::Acquire)
    }

    /// The floor is `floor` now: raise this replica's to it (never lower);
    /// true when it moved.
    pub(crate) fn raise_floor(&self, floor: u16) -> bool {
        self.floor.fetch_max(floor, Ordering::AcqRel) < floor
    }

    /// The record format to write: the cluster's format floor, which every
    /// member reads ([`fleetmq_core::cluster::records::write_format`]).
    pub fn write_format(&self) -> u16 {
        fleetmq_core::cluster::records::write_format(self.floor.load(Ordering::Acquire))
    }

    /// This process's epoch: how many times it came back from a fence.
    /// Wills and claims are written with it; those of an older epoch were
    /// handed over to the cluster at a fence (`MemberRecord::epoch`).
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// Whether another process runs this replica ID: this one stays not
    /// ready (DESIGN.md §12) until that one is gone.
    pub fn is_duplicate(&self) -> bool {
        self.duplicate.load(Ordering::Acquire)
    }

    pub(crate) fn set_duplicate(&self, duplicate: bool) {
        self.duplicate.store(duplicate, Ordering::Release);
    }

    pub(crate) fn next_epoch(&self) -> u64 {
        self.epoch.fetch_add(1, Ordering::AcqRel) + 1
    }

    /// Whether the initial load of `mqtt-retained` is complete.
    pub fn retained_loaded(&self) -> bool {
        self.retained_loaded.load(Ordering::Acquire) != u64::MAX
    }

    pub(crate) fn set_retained_loaded(&self, count: u64) {
        self.retained_loaded.store(count, Ordering::Release);
    }

    /// The live replicas (this one included when serving), sorted.
    pub fn members(&self) -> Vec<String> {
        self.members.lock().map(|m| m.clone()).unwrap_or_default()
    }

    pub(crate) fn set_fenced(&self, fenced: bool, reason: Option<String>) {
        if let Ok(mut r) = self.reason.lock() {
            *r = reason;
        }
        self.fenced.store(fenced, Ordering::Release);
    }

    pub(crate) fn set_members(&self, members: Vec<String>) {
        if let Ok(mut m) = self.members.lock() {
            *m = members;
        }
    }
}

/// What the tasks on the bridge thread share.
pub(crate) struct Shared {
    pub(crate) config: BridgeConfig,
    pub(crate) status: Arc<ClusterStatus>,
    /// The state connection's JetStream context.
    pub(crate) state: Context,
    /// The lease connection's JetStream context.
    pub(crate) lease: Context,
    pub(crate) state_client: async_nats::Client,
    /// `mqtt-sessions`, opened once (opening it is a round trip).
    pub(crate) sessions: async_nats::jetstream::kv::Store,
    /// `mqtt-session-will`, opened once.
    pub(crate) wills: async_nats::jetstream::kv::Store,
    /// Counts changes of membership that may hand entries over (a peer
    /// gone, stopped or replaced, an epoch moved on): the ownership sweep
    /// runs again when it moved.
    pub(crate) handovers: std::sync::atomic::AtomicU64,
    /// The revisions of `mqtt-sessions` keys last seen, so a claim can
    /// skip its read.
    known: Mutex<crate::ownership::KnownRevisions>,
    pub(crate) mailboxes: Vec<Arc<Mailbox<Event>>>,
    /// Live peers (not taken for gone): replica → (process instance,
    /// epoch).
    pub(crate) live: Mutex<std::collections::HashMap<String, (String, u64)>>,
    /// Process instances taken for gone or stopped (or replaced by a newer
    /// process of their replica ID), and since when on this clock.
    pub(crate) gone: Mutex<std::collections::HashMap<String, std::time::Instant>>,
    /// Until when this replica decides for others (DESIGN.md §5: its own
    /// last landed membership write was sent less than T before).
    pub(crate) decides_until: Mutex<Option<std::time::Instant>>,
    /// Events a full mailbox handed back, per shard.
    held: Mutex<Vec<Vec<Event>>>,
    /// The record formats each live peer reads (oldest, newest), by
    /// replica ID, from its `mqtt-members` entry (see [`crate::floor`]).
    pub(crate) member_reads: Mutex<std::collections::HashMap<String, [u16; 2]>>,
    /// Claims made with Clean Start 1 that the ownership watch saw, by
    /// client identifier (see [`crate::sweeper::clean_start_seen`]).
    pub(crate) clean_starts: Mutex<std::collections::HashMap<String, fleetmq_core::cluster::records::OwnerRecord>>,
    pub(crate) stop: Notify,
    pub(crate) stopping: AtomicBool,
    /// Numbers this process's retained writes (their `Fleetmq-Write`
    /// header).
    pub(crate) writes: std::sync::atomic::AtomicU64,
    /// When a failed retained write was last logged, and how many were
    /// not logged since.
    pub(crate) warned: Mutex<(Option<std::time::Instant>, u64)>,
    /// Another process runs this replica ID: this one must not touch its
    /// membership entry, not even to leave.
    pub(crate) duplicate: AtomicBool,
}

impl Shared {
    /// The process instances of the live replicas with their epochs, this
    /// one's included.
    pub(crate) fn live_instances(&self) -> std::collections::HashMap<String, u64> {
        let mut live: std::collections::HashMap<String, u64> =
            self.live.lock().map(|l| l.values().cloned().collect()).unwrap_or_default();
        live.insert(self.config.instance.clone(), self.status.epoch());
        live
    }

    /// When `instance` was taken for gone or stopped, if it was.
    pub(crate) fn gone_at(&self, instance: &str) -> Option<std::time::Instant> {
        self.gone.lock().ok().and_then(|g| g.get(instance).copied())
    }

    /// Whether this replica may decide for others now (DESIGN.md §5).
    pub(crate) fn decides_for_others(&self) -> bool {
        let until = self.decides_until.lock().ok().and_then(|u| *u);
        until.is_some_and(|until| std::time::Instant::now() < until)
    }

    /// The revisions of `mqtt-sessions` keys last seen (only the bridge
    /// thread locks it).
    pub(crate) fn known_revisions(&self) -> std::sync::MutexGuard<'_, crate::ownership::KnownRevisions> {
        self.known.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Offer `event` to `shard`'s mailbox, holding it when full.
    pub(crate) fn send_event(&self, shard: usize, event: Event) {
        let mut held = self.held.lock().expect("bridge-only lock");
        if held[shard].is_empty() {
            if let Err(event) = self.mailboxes[shard].push(event) {
                held[shard].push(event);
            }
        } else {
            held[shard].push(event);
        }
    }

    /// Offer `event` to every shard.
    pub(crate) fn broadcast(&self, event: Event) {
        for shard in 0..self.mailboxes.len() {
            self.send_event(shard, event.clone());
        }
    }

    /// Offer the held events again, in order.
    fn offer_held(&self) {
        let mut held = self.held.lock().expect("bridge-only lock");
        for (shard, queue) in held.iter_mut().enumerate() {
            let mut sent = 0;
            for event in queue.iter() {
                if self.mailboxes[shard].push(event.clone()).is_err() {
                    break;
                }
                sent += 1;
            }
            queue.drain(..sent);
        }
    }
}

/// The handle the broker keeps: send requests, read the status, stop.
pub struct Bridge {
    requests: Sender<Request>,
    wake: Arc<Notify>,
    status: Arc<ClusterStatus>,
    mailboxes: Vec<Arc<Mailbox<Event>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Bridge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bridge").field("replica", &self.status.replica_id).finish_non_exhaustive()
    }
}

impl Bridge {
    /// Start the bridge thread: connect the state and lease connections,
    /// check the JetStream API level, create or check the buckets and the
    /// format floor, start membership, and return once the first
    /// membership write landed (the replica serves) or
    /// [`START_WAIT`] passed (it starts fenced and keeps trying).
    ///
    /// # Errors
    /// Any [`StartError`] of the checks; the thread is stopped.
    pub fn start(config: BridgeConfig) -> Result<Bridge, StartError> {
        let (tx, rx) = bounded(REQUEST_QUEUE);
        let wake = Arc::new(Notify::new());
        let status = Arc::new(ClusterStatus::new(config.replica_id.clone(), config.instance.clone(), config.shards));
        let mailboxes: Vec<_> = (0..config.shards).map(|_| Arc::new(Mailbox::new(EVENT_QUEUE))).collect();
        let (started_tx, started_rx) = std::sync::mpsc::channel::<Result<Arc<Shared>, StartError>>();
        let thread = {
            let (wake, status, mailboxes) = (wake.clone(), status.clone(), mailboxes.clone());
            std::thread::Builder::new()
                .name("fleetmq-bridge".into())
                .spawn(move || {
                    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                        Ok(rt) => rt,
                        Err(e) => {
                            let _ = started_tx.send(Err(StartError::Config(format!("bridge runtime: {e}"))));
                            return;
                        }
                    };
                    runtime.block_on(run(config, status, mailboxes, rx, wake, started_tx));
                })
                .map_err(|e| StartError::Config(format!("bridge thread: {e}")))?
        };
        // Setup retries for 2/3 of START_WAIT, then membership and the
        // retained load have half of it each.
        let shared = match started_rx.recv_timeout(START_WAIT * 2) {
            Ok(Ok(shared)) => shared,
            Ok(Err(e)) => {
                let _ = thread.join();
                return Err(e);
            }
            Err(_) => {
                return Err(StartError::Connect(format!("no answer within {:?}", START_WAIT * 2)));
            }
        };
        Ok(Bridge { requests: tx, wake, status, mailboxes, thread: Mutex::new(Some(thread)), shared })
    }

    /// Queue `request` and wake the bridge.
    ///
    /// # Errors
    /// The queue is full: the request is handed back.
    pub fn send(&self, request: Request) -> Result<(), Request> {
        match self.requests.try_send(request) {
            Ok(()) => {
                self.wake.notify_one();
                Ok(())
            }
            Err(TrySendError::Full(r) | TrySendError::Disconnected(r)) => {
                self.status.stats.queue_full.fetch_add(1, Ordering::Relaxed);
                Err(r)
            }
        }
    }

    /// Requests queued and not yet taken by the bridge.
    pub fn queue_depth(&self) -> usize {
        self.requests.len()
    }

    /// The cluster's status, shared.
    pub fn status(&self) -> &Arc<ClusterStatus> {
        &self.status
    }

    /// Shard `shard`'s event mailbox.
    pub fn mailbox(&self, shard: usize) -> Arc<Mailbox<Event>> {
        self.mailboxes[shard].clone()
    }

    /// Stop: what is queued is still carried out (up to a few seconds),
    /// then the thread ends and is joined. Later calls do nothing.
    pub fn stop(&self) {
        self.shared.stopping.store(true, Ordering::Release);
        self.shared.stop.notify_waiters();
        self.wake.notify_one();
        let thread = self.thread.lock().ok().and_then(|mut t| t.take());
        if let Some(thread) = thread {
            if thread.join().is_err() {
                warn!(target: "bridge", "bridge: the bridge thread panicked");
            }
        }
    }
}

impl Drop for Bridge {
    fn drop(&mut self) {
        self.stop();
    }
}

/// How long the stop waits for requests in flight.
const STOP_DRAIN: Duration = Duration::from_secs(3);

async fn run(
    config: BridgeConfig,
    status: Arc<ClusterStatus>,
    mailboxes: Vec<Arc<Mailbox<Event>>>,
    requests: Receiver<Request>,
    wake: Arc<Notify>,
    started: std::sync::mpsc::Sender<Result<Arc<Shared>, StartError>>,
) {
    let shared = match start(config, status, mailboxes).await {
        Ok(shared) => shared,
        Err(e) => {
            let _ = started.send(Err(e));
            return;
        }
    };
    let local = tokio::task::LocalSet::new();
    local
        .run_until(async move {
            let (first_write_tx, first_write_rx) = oneshot::channel();
            tokio::task::spawn_local(membership::run(shared.clone(), first_write_tx));
            tokio::task::spawn_local(ownership::watch(shared.clone()));
            tokio::task::spawn_local(retained::watch(shared.clone()));
            tokio::task::spawn_local(sweeper::run(shared.clone()));
            tokio::task::spawn_local(crate::floor::watch(shared.clone()));
            // Ready to serve once the first membership write landed, or
            // fenced after the wait (membership keeps trying).
            let _ = tokio::time::timeout(START_WAIT / 2, first_write_rx).await;
            // And the retained messages loaded: SUBSCRIBEs are answered
            // from the local copy.
            let loaded_by = tokio::time::Instant::now() + START_WAIT / 2;
            while !shared.status.retained_loaded() && tokio::time::Instant::now() < loaded_by {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            let _ = started.send(Ok(shared.clone()));
            loop {
                tokio::select! {
                    () = wake.notified() => {}
                    () = shared.stop.notified() => {}
                    // Held events are offered again at least this often.
                    () = tokio::time::sleep(Duration::from_millis(20)) => {}
                }
                shared.offer_held();
                while let Ok(request) = requests.try_recv() {
                    shared.status.stats.started();
                    tokio::task::spawn_local(handle(shared.clone(), request));
                }
                if shared.stopping.load(Ordering::Acquire) {
                    break;
                }
            }
            // Leave: the peers see this replica stopped now rather than
            // gone member_ttl later, and the wills it handed over start
            // their grace.
            membership::leave(&shared).await;
            let drain_by = tokio::time::Instant::now() + STOP_DRAIN;
            while shared.status.stats.in_flight.load(Ordering::Relaxed) > 0 && tokio::time::Instant::now() < drain_by {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            info!(target: "bridge", "bridge: stopped");
        })
        .await;
}

async fn start(
    config: BridgeConfig,
    status: Arc<ClusterStatus>,
    mailboxes: Vec<Arc<Mailbox<Event>>>,
) -> Result<Arc<Shared>, StartError> {
    let name = |part: &str| format!("fleetmq-{}-{part}", config.replica_id);
    let state_client = connect(&config.cluster, name("state")).await?;
    let lease_client = connect(&config.cluster, name("lease")).await?;
    let context = |client: async_nats::Client| {
        jetstream::ContextBuilder::new().timeout(JS_TIMEOUT).build(client)
    };
    let state = context(state_client.clone());
    let lease = context(lease_client);
    // JetStream may still be electing (a cluster just started, a server
    // restarting: "no suitable peers for placement"): what did not answer
    // is tried again for a while; an incompatible answer stops at once.
    let retry_until = tokio::time::Instant::now() + START_WAIT * 2 / 3;
    let (level, floor) = loop {
        let attempt = async {
            let level = setup::check_api_level(&state).await?;
            setup::ensure_buckets(&state, usize::from(config.cluster.nats_replicas), config.cluster.member_ttl).await?;
            let floor = setup::check_floor(&state).await?;
            Ok::<_, StartError>((level, floor))
        };
        match attempt.await {
            Ok(done) => break done,
            Err(StartError::Connect(why)) if tokio::time::Instant::now() < retry_until => {
                warn!(target: "bridge", %why, "bridge: JetStream not ready yet, trying again");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => return Err(e),
        }
    };
    info!(target: "bridge", level, floor, replica = %config.replica_id, "bridge: JetStream ready");
    status.floor.store(floor, Ordering::Release);
    let sessions = state
        .get_key_value(fleetmq_core::cluster::records::bucket::SESSIONS)
        .await
        .map_err(|e| StartError::Connect(format!("bucket mqtt-sessions: {e}")))?;
    let wills = state
        .get_key_value(fleetmq_core::cluster::records::bucket::WILLS)
        .await
        .map_err(|e| StartError::Connect(format!("bucket mqtt-session-will: {e}")))?;
    let shards = mailboxes.len();
    Ok(Arc::new(Shared {
        config,
        status,
        state,
        lease,
        state_client,
        sessions,
        wills,
        handovers: std::sync::atomic::AtomicU64::new(0),
        known: Mutex::new(crate::ownership::KnownRevisions::default()),
        mailboxes,
        live: Mutex::new(std::collections::HashMap::new()),
        gone: Mutex::new(std::collections::HashMap::new()),
        decides_until: Mutex::new(None),
        held: Mutex::new(vec![Vec::new(); shards]),
        clean_starts: Mutex::new(std::collections::HashMap::new()),
        member_reads: Mutex::new(std::collections::HashMap::new()),
        stop: Notify::new(),
        stopping: AtomicBool::new(false),
        duplicate: AtomicBool::new(false),
        writes: std::sync::atomic::AtomicU64::new(0),
        warned: Mutex::new((None, 0)),
    }))
}

async fn handle(shared: Arc<Shared>, request: Request) {
    match request {
        Request::Claim { client_id, conn, clean_start, reply } => {
            let outcome = if shared.status.is_fenced() {
                Err(ClaimError::Fenced)
            } else {
                ownership::claim(&shared, &client_id, conn, clean_start).await
            };
            // Nobody waits any more (the CONNECT was refused past its
            // budget): the claim that landed is given up again.
            if let Err(Ok(claimed)) = reply.send(outcome) {
                ownership::release(&shared, &client_id, claimed.revision).await;
            }
        }
        Request::Release { client_id, revision } => ownership::release(&shared, &client_id, revision).await,
        Request::WillPut { client_id, record, reply } => {
            // A will whose CONNECT was refused meanwhile is deleted again:
            // no will for a refused device (DESIGN.md §6).
            if let Err(Ok(revision)) = reply.send(sweeper::put_will(&shared, &client_id, record).await) {
                let _ = sweeper::delete_will(&shared, &client_id, revision).await;
            }
        }
        Request::WillDelayed { client_id, revision, due_at_ms, reply } => {
            let _ = reply.send(sweeper::will_delayed(&shared, &client_id, revision, due_at_ms).await);
        }
        Request::WillDelete { client_id, revision } => {
            if let Err(e) = sweeper::delete_will(&shared, &client_id, revision).await {
                tracing::debug!(target: "cluster", %client_id, error = %e, "cluster: will not deleted (replaced, or store unavailable)");
            }
        }
        Request::Ping { reply } => {
            let _ = reply.send(std::time::Instant::now());
        }
        Request::RetainedPut { topic, record, previous, wait, reply } => {
            let started = std::time::Instant::now();
            let put = retained::Put { topic, record, previous, wait, waited: reply.is_some() };
            let outcome = retained::put(&shared, &put).await;
            shared.status.stats.record(crate::OpKind::Retained, started.elapsed());
            if let Err(e) = &outcome {
                retained::failed(&shared, &put, e);
            }
            if let Some(reply) = reply {
                let _ = reply.send(outcome);
            }
        }
    }
    shared.status.stats.finished();
}
