//! The bridge thread: start-up, the request loop, events to the shards,
//! and the stop.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{bounded, Receiver, Sender, TrySendError};
use tokio::sync::{oneshot, Notify};
use tracing::{info, warn};

use crate::budget::{Budget, Ticket};
use crate::mailbox::Mailbox;
use crate::{membership, ownership, retained, sweeper, BridgeConfig};

pub use crate::request::{AppendOutcome, AppendReply, Appended, ClaimError, Claimed, Event, IngestError, LogAppend, LogBatch, LogEntry, Qos2Flow, Request, RetainedError, StreamMessage};
pub(crate) use crate::shared::Shared;
pub use crate::status::ClusterStatus;

/// Requests queued for the bridge at most; beyond, [`Bridge::send`]
/// refuses (the caller answers as for an unavailable store).
const REQUEST_QUEUE: usize = 65_536;

/// Events queued per shard mailbox; beyond, the bridge holds them and
/// offers them again on its next turn.
const EVENT_QUEUE: usize = 16_384;

/// The bridge takes its queue at least this often, woken or not.
pub const TURN_AT_LEAST: Duration = Duration::from_millis(20);

/// How long [`Bridge::start`] waits for NATS, the buckets and the first
/// membership write.
pub(crate) const START_WAIT: Duration = Duration::from_secs(30);

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

/// The handle the broker keeps: send requests, read the status, stop.
pub struct Bridge {
    requests: Sender<(Request, Option<Ticket>)>,
    /// The retained writes waiting for NATS (see `budget.rs`).
    budget: Arc<Budget>,
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
        let budget = shared.budget.clone();
        Ok(Bridge { requests: tx, budget, wake, status, mailboxes, thread: Mutex::new(Some(thread)), shared })
    }

    /// Queue `request` and wake the bridge.
    ///
    /// # Errors
    /// The queue is full, or (a [`Request::RetainedPut`])
    /// [`RETAINED_WAITING_MAX`](crate::RETAINED_WAITING_MAX) retained
    /// writes or [`RETAINED_WAITING_BYTES`](crate::RETAINED_WAITING_BYTES)
    /// bytes of them already wait for NATS: the request is handed back,
    /// counted (`retained_dropped` when nobody waits for the write, else
    /// `retained_refused`) and logged at most once a second.
    pub fn send(&self, request: Request) -> Result<(), Request> {
        self.queue(request)?;
        self.wake.notify_one();
        Ok(())
    }

    /// Queue `request` without waking the bridge: it is taken on the
    /// bridge's next turn, within [`TURN_AT_LEAST`] (for what waits
    /// anyway, as [`Request::Release`] does: no wake, no thread switch).
    ///
    /// # Errors
    /// As [`Bridge::send`].
    pub fn send_quietly(&self, request: Request) -> Result<(), Request> {
        self.queue(request)
    }

    fn queue(&self, request: Request) -> Result<(), Request> {
        let ticket = match &request {
            Request::RetainedPut { topic, record, reply, .. } => {
                let size = topic.len() + record.as_ref().map_or(0, bytes::Bytes::len);
                match self.budget.take(size) {
                    Some(ticket) => Some(ticket),
                    None => {
                        retained::over_budget(&self.shared, topic, reply.is_some(), &self.budget);
                        return Err(request);
                    }
                }
            }
            Request::IngestAppend { ingest, session_log, .. } => {
                let size = ingest.as_ref().map_or(0, |m| m.size()) + session_log.as_ref().map_or(0, |l| l.message.size());
                match self.shared.ingest.take(size) {
                    Some(ticket) => Some(ticket),
                    None => {
                        let error = IngestError::Queue(format!(
                            "{} appends ({} bytes) already wait for NATS, at most {} ({} bytes)",
                            self.shared.ingest.count(),
                            self.shared.ingest.bytes(),
                            crate::INGEST_WAITING_MAX,
                            crate::INGEST_WAITING_BYTES
                        ));
                        crate::ingest::refused(&self.shared, &error);
                        return Err(request);
                    }
                }
            }
            _ => None,
        };
        let ingest = matches!(request, Request::IngestAppend { .. });
        self.requests.try_send((request, ticket)).map_err(|(TrySendError::Full(r) | TrySendError::Disconnected(r))| {
            self.status.stats.queue_full.fetch_add(1, Ordering::Relaxed);
            if ingest {
                self.status.stats.ingest_refused_queue.fetch_add(1, Ordering::Relaxed);
            }
            r.0
        })
    }

    /// The ingest appends waiting for NATS now (queued or in flight):
    /// `fleetmq_session_log_appends_held`.
    pub fn ingest_waiting(&self) -> usize {
        self.shared.ingest.count()
    }

    /// What the cluster's persistent sessions want (see
    /// [`fleetmq_core::cluster::session_log::Interest`]): the shards read
    /// it on the publish path of QoS 1/2 values and set their own
    /// sessions' entries; the bridge applies the other replicas' records.
    pub fn interest(&self) -> &Arc<std::sync::RwLock<fleetmq_core::cluster::session_log::Interest>> {
        &self.shared.interest
    }

    /// The retained writes waiting for NATS now: how many, and their bytes
    /// (records and topics, with 1 KiB each for the rest).
    pub fn retained_waiting(&self) -> (usize, usize) {
        (self.budget.count(), self.budget.bytes())
    }

    /// Requests queued and not yet taken by the bridge, and releases it
    /// holds while claims are in flight (see [`Request::Release`]).
    pub fn queue_depth(&self) -> usize {
        self.requests.len() + self.status.stats.releases_held.load(Ordering::Relaxed) as usize
    }

    /// Where each NATS connection of the bridge is: `(connection,
    /// server name, connected)` for `state`, `lease` and, with
    /// `store.kind = "jetstream"`, `ingest` (the server's name as its INFO
    /// gave it: the last one while the connection is down). For
    /// `/api/v1/status`'s `cluster.bridge.connections`.
    pub fn connections(&self) -> Vec<(&'static str, String, bool)> {
        let at = |client: &async_nats::Client| {
            let up = client.connection_state() == async_nats::connection::State::Connected;
            (client.server_info().server_name, up)
        };
        let mut out = Vec::with_capacity(3);
        for (name, client) in [("state", self.shared.state_client.clone()), ("lease", self.shared.lease.client())] {
            let (server, up) = at(&client);
            out.push((name, server, up));
        }
        if self.shared.config.ingest.is_some() {
            let (server, up) = at(&self.shared.ingest_client);
            out.push(("ingest", server, up));
        }
        out
    }

    /// The cluster's status, shared.
    pub fn status(&self) -> &Arc<ClusterStatus> {
        &self.status
    }

    /// A route announce read from a mesh link (protocol version 3):
    /// merged with what the watch of `mqtt-routes` said (by revision),
    /// the changes sent to every shard; the answer resolves once every
    /// shard took them (the announce's answer to its replica waits for
    /// it). Called on a shard's thread: a short lock of the route table,
    /// no wait for NATS (a poisoned lock: the answer is dropped).
    pub fn announced(&self, announce: crate::Announce) -> oneshot::Receiver<()> {
        let (done, applied) = oneshot::channel();
        crate::routes::announced(&self.shared, announce, done);
        applied
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

/// Start `request` as a task of its own on the bridge thread, counted in
/// flight (a claim also in [`Shared::claims_in_flight`] until answered).
fn start_request(shared: &Arc<Shared>, request: Request, ticket: Option<Ticket>) {
    shared.status.stats.started();
    if matches!(request, Request::Claim { .. }) {
        shared.claims_in_flight.fetch_add(1, Ordering::Relaxed);
    }
    // Boxed: `handle`'s future is as large as its largest arm (kilobytes:
    // an append holds two publishes with their timers), and tokio moves a
    // task's future into its cell and overwrites it with the output when
    // done, two copies of that size per request; boxed, each is the size
    // of a pointer (perf: a third of the bridge thread's time in memmove
    // at ~50k appends/s, perf/RESULTS.md 2026-12-07 session 42).
    tokio::task::spawn_local(Box::pin(crate::request::handle(shared.clone(), request, ticket)));
}

/// How long the stop waits for its leaving entry (tried again until it
/// lands) and the requests in flight, together.
const STOP_DRAIN: Duration = Duration::from_secs(3);

/// [`STOP_DRAIN`] when NATS is away: what is in flight is not answered.
const STOP_DRAIN_AWAY: Duration = Duration::from_millis(300);

/// Whether NATS is known to be away: this replica is fenced, or its state
/// or lease connection is not connected (async-nats sees a server's
/// connection close at once; all servers gone: it stays down).
fn nats_away(shared: &Shared) -> bool {
    use async_nats::connection::State;
    shared.status.is_fenced()
        || shared.state_client.connection_state() != State::Connected
        || shared.lease.client().connection_state() != State::Connected
}

async fn run(
    config: BridgeConfig,
    status: Arc<ClusterStatus>,
    mailboxes: Vec<Arc<Mailbox<Event>>>,
    requests: Receiver<(Request, Option<Ticket>)>,
    wake: Arc<Notify>,
    started: std::sync::mpsc::Sender<Result<Arc<Shared>, StartError>>,
) {
    let shared = match crate::shared::start(config, status, mailboxes).await {
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
            tokio::task::spawn_local(crate::liveness::watch(shared.clone(), crate::liveness::Connection::State));
            tokio::task::spawn_local(crate::liveness::watch(shared.clone(), crate::liveness::Connection::Lease));
            if shared.config.ingest.is_some() {
                tokio::task::spawn_local(crate::liveness::watch(shared.clone(), crate::liveness::Connection::Ingest));
                tokio::task::spawn_local(crate::leader::follow(shared.clone()));
            }
            tokio::task::spawn_local(membership::run(shared.clone(), first_write_tx));
            tokio::task::spawn_local(ownership::watch(shared.clone()));
            tokio::task::spawn_local(retained::watch(shared.clone()));
            tokio::task::spawn_local(sweeper::run(shared.clone()));
            tokio::task::spawn_local(crate::floor::watch(shared.clone()));
            tokio::task::spawn_local(crate::routes::watch(shared.clone()));
            tokio::task::spawn_local(crate::session_log::watch(shared.clone()));
            // Ready to serve once the first membership write landed, or
            // fenced after the wait (membership keeps trying).
            let _ = tokio::time::timeout(START_WAIT / 2, first_write_rx).await;
            // And the retained messages loaded: SUBSCRIBEs are answered
            // from the local copy.
            let loaded_by = tokio::time::Instant::now() + START_WAIT / 2;
            // And the other replicas' routes: a value published once this
            // replica is ready reaches their subscribers.
            // And what persistent sessions want: a value published once
            // this replica is ready reaches their session logs.
            let loaded = |shared: &Shared| {
                shared.status.retained_loaded()
                    && shared.routes_loaded.load(Ordering::Acquire)
                    && shared.interest_loaded.load(Ordering::Acquire)
            };
            while !loaded(&shared) && tokio::time::Instant::now() < loaded_by {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            // An earlier process's routes go before this one writes any
            // (not a duplicate's: the entries are the other process's;
            // purged once it is gone, and what this one wants rewritten).
            let mut purge_due = true;
            if !shared.duplicate.load(Ordering::Acquire) {
                crate::routes::purge_own(&shared).await;
                purge_due = false;
            }
            let _ = started.send(Ok(shared.clone()));
            let routes = crate::routes::Writer::new(shared.clone());
            let sessions = crate::session_state::Writer::new(shared.clone());
            let cursors = crate::cursors::Writer::new(shared.clone());
            let mut releases = crate::releases::HeldReleases::default();
            let appender = crate::appender::Appender::start(shared.clone());
            loop {
                tokio::select! {
                    () = wake.notified() => {}
                    () = shared.stop.notified() => {}
                    // Held events are offered again, and quiet requests
                    // taken, at least this often.
                    () = tokio::time::sleep(TURN_AT_LEAST) => {}
                }
                shared.offer_held();
                if purge_due && !shared.duplicate.load(Ordering::Acquire) && !shared.stopping.load(Ordering::Acquire) {
                    crate::routes::purge_own(&shared).await;
                    crate::routes::rewrite(&routes);
                    purge_due = false;
                }
                if shared.rewrite_routes.swap(false, Ordering::AcqRel) {
                    crate::routes::rewrite(&routes);
                }
                let now = std::time::Instant::now();
                while let Ok((request, ticket)) = requests.try_recv() {
                    match request {
                        // Off every CONNECT's path: after the claims.
                        Request::Release { client_id, revision } => releases.hold(client_id, revision, now),
                        // In the order sent (per-key order), here.
                        Request::Route { filter, shard, add, landed } => {
                            crate::routes::request(&routes, filter, shard, add, landed);
                        }
                        Request::SessionPut { client_id, record, landed } => {
                            crate::session_state::request(&sessions, client_id, record, landed);
                        }
                        Request::CursorPut { client_id, record, landed } => {
                            crate::cursors::request(&cursors, client_id, record, landed);
                        }
                        // Runs until the bridge stops: not counted in flight.
                        Request::LogTail { workspace } => {
                            tokio::task::spawn_local(crate::session_log::tail(shared.clone(), workspace));
                        }
                        // The common case, pipelined as one (see `appender.rs`).
                        Request::IngestAppend { ingest: Some(message), session_log: None, qos2: None, wait, reply } => {
                            appender.push(*message, wait, reply, ticket);
                        }
                        request => start_request(&shared, request, ticket),
                    }
                }
                let stopping = shared.stopping.load(Ordering::Acquire);
                let claims = shared.claims_in_flight.load(Ordering::Relaxed);
                for (client_id, revision) in releases.due(claims, stopping, now) {
                    start_request(&shared, Request::Release { client_id, revision }, None);
                }
                shared.status.stats.releases_held.store(releases.len() as u64, Ordering::Relaxed);
                if stopping {
                    break;
                }
            }
            // With NATS known to be away (fenced, or a connection down),
            // the writes below could only wait out their bounds (5 s and
            // 1 s): skipped, and the others take this replica for gone
            // after member_ttl (their sweepers delete its routes).
            let away = nats_away(&shared);
            if away {
                info!(target: "cluster", "cluster: NATS away at the stop: own routes not purged, no leaving record (the others take this replica for gone after member_ttl)");
            }
            // A clean stop takes its routes along (the peers drop them when
            // it leaves anyway).
            if !away && !shared.duplicate.load(Ordering::Acquire) {
                crate::routes::purge_own(&shared).await;
            }
            // Leave: the peers see this replica stopped now rather than
            // gone member_ttl later, and the wills it handed over start
            // their grace.
            // Tried again within the stop's budget when a try fails.
            let drain_by = tokio::time::Instant::now() + if away { STOP_DRAIN_AWAY } else { STOP_DRAIN };
            if !away {
                membership::leave(&shared, drain_by).await;
            }
            while shared.status.stats.in_flight.load(Ordering::Relaxed) > 0 && tokio::time::Instant::now() < drain_by {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            info!(target: "bridge", "bridge: stopped");
        })
        .await;
}
