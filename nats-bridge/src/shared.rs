//! [`Shared`]: what the tasks on the bridge thread share (the two NATS
//! connections, the opened buckets, what membership learned), and how the
//! bridge makes it at start (connect, check, create the buckets).

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::{self, Context};
use tokio::sync::Notify;
use tracing::{debug, info, warn};

use crate::bridge::{StartError, START_WAIT};
use crate::config::{connect, connect_steered, JS_TIMEOUT};
use crate::mailbox::Mailbox;
use crate::{setup, BridgeConfig, ClusterStatus, Event};

/// Events the bridge holds for one shard whose mailbox is full at most,
/// about: past it the watches stop reading ([`Shared::room_for_events`]).
pub(crate) const HELD_MAX: usize = 10_000;

/// How often a watch waiting for room offers the held events again.
const HELD_RETRY: Duration = Duration::from_millis(5);

/// What the tasks on the bridge thread share.
pub(crate) struct Shared {
    pub(crate) config: BridgeConfig,
    pub(crate) status: Arc<ClusterStatus>,
    /// The state connection's JetStream context.
    pub(crate) state: Context,
    /// The lease connection's JetStream context.
    pub(crate) lease: Context,
    pub(crate) state_client: async_nats::Client,
    /// The ingest connection (`store.kind = "jetstream"`): the appends
    /// that go to the ingest stream only (`appender.rs`), at the server
    /// that leads `mqtt-ingest` when it is one of `cluster.nats_urls`
    /// (see `leader.rs`). Without the ingest stream, the state
    /// connection.
    pub(crate) ingest_client: async_nats::Client,
    /// Steers the ingest connection's next reconnect (see `leader.rs`).
    pub(crate) ingest_rotation: Arc<crate::config::Rotation>,
    /// The server left last by the ingest connection as silent, and when
    /// (`liveness.rs`): not gone back to for a while (see `leader.rs`).
    pub(crate) ingest_left: Mutex<Option<(String, std::time::Instant)>>,
    /// The NATS servers of `cluster.nats_urls` by name, as far as they
    /// answered the start's probes; `leader.rs` asks the others again
    /// (with the ingest stream).
    pub(crate) server_urls: Mutex<ServerUrls>,
    /// `mqtt-sessions`, opened once (opening it is a round trip).
    pub(crate) sessions: async_nats::jetstream::kv::Store,
    /// `mqtt-session-will`, opened once.
    pub(crate) wills: async_nats::jetstream::kv::Store,
    /// `mqtt-session-state`, on the state connection.
    pub(crate) session_state: async_nats::jetstream::kv::Store,
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
    /// Claims started and not yet answered: releases wait while there
    /// are any (see `releases.rs`).
    pub(crate) claims_in_flight: std::sync::atomic::AtomicUsize,
    /// Every will in `mqtt-session-will`, by key, as its watch brings
    /// them (see [`crate::sweeper`]).
    pub(crate) will_map: Mutex<std::collections::HashMap<String, crate::sweeper::KnownWill>>,
    /// Every session record in `mqtt-session-state`, by key, as its watch
    /// brings them, without their subscriptions (see [`crate::expiry`]).
    pub(crate) session_map: Mutex<std::collections::HashMap<String, crate::expiry::KnownSession>>,
    /// The peers and the other replicas' routes (see `routes.rs`).
    pub(crate) remote: Mutex<crate::routes::Remote>,
    /// The routes watch has handed the shards every entry present at
    /// start (the start waits for it, as for the retained messages).
    pub(crate) routes_loaded: AtomicBool,
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
    /// Back from a fence: this replica's routes are written again (the
    /// sweeper may have deleted them meanwhile).
    pub(crate) rewrite_routes: AtomicBool,
    /// The retained writes waiting for NATS (see `budget.rs`).
    pub(crate) budget: Arc<crate::budget::Budget>,
    /// The undos of refused retained writes looking for them (see
    /// `budget.rs`).
    pub(crate) undos: Arc<crate::budget::Budget>,
    /// The ingest appends waiting for NATS (see `budget.rs`, `ingest.rs`).
    pub(crate) ingest: Arc<crate::budget::Budget>,
    /// When an ingest refusal was last logged, and how many were not
    /// logged since.
    pub(crate) ingest_warned: Mutex<(Option<std::time::Instant>, u64)>,
    /// What persistent sessions want (see `session_log.rs`), read by the
    /// shards on their publish path.
    pub(crate) interest: Arc<std::sync::RwLock<fleetmq_core::cluster::session_log::Interest>>,
    /// The watch of `mqtt-session-state` has applied every record present
    /// at start (the start waits for it, as for the routes).
    pub(crate) interest_loaded: AtomicBool,
    /// `mqtt-session-cursor`, on the state connection.
    pub(crate) cursors: async_nats::jetstream::kv::Store,
    /// The workspaces whose session log this replica follows (see
    /// `session_log::tail`).
    pub(crate) tails: Mutex<std::collections::HashSet<String>>,
    /// The session log streams created or checked, by workspace token.
    pub(crate) logs: Mutex<std::collections::HashMap<String, Arc<tokio::sync::OnceCell<()>>>>,
    /// Counts the state connection's forced reconnects (see
    /// `liveness.rs`): an append waiting for its acknowledgement sends
    /// itself again when it moves (what was sent to the silent server is
    /// not answered).
    pub(crate) state_moved: tokio::sync::watch::Sender<u64>,
    /// The same for the ingest connection.
    pub(crate) ingest_moved: tokio::sync::watch::Sender<u64>,
    /// The order of the appends made as tasks of their own, per stream
    /// (`order.rs`).
    pub(crate) orders: crate::order::Orders,
}

impl Shared {
    /// Publish `publish` on `subject` through the state connection, sent
    /// by `deadline`: async-nats waits for room in its acknowledgement
    /// window (5,000 publishes) and its command queue with no deadline of
    /// ours, so a publish still waiting there at the deadline was not
    /// sent. Returns its acknowledgement to await.
    ///
    /// # Errors
    /// Why it was not sent (the connection refused it, or the deadline).
    pub(crate) async fn publish_by(
        &self,
        subject: &str,
        publish: jetstream::message::PublishMessage,
        deadline: tokio::time::Instant,
    ) -> Result<jetstream::context::PublishAckFuture, String> {
        match tokio::time::timeout_at(deadline, self.state.send_publish(subject.to_owned(), publish)).await {
            Ok(Ok(ack)) => Ok(ack),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err("not sent to NATS in time".to_owned()),
        }
    }

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

    /// Answer an ingest append's `reply` with `outcome` (one event of its
    /// own for [`AppendReply::Shard`]: the pipeline batches them itself).
    pub(crate) fn answer_append(&self, reply: crate::request::AppendReply, outcome: crate::request::AppendOutcome) {
        match reply {
            crate::request::AppendReply::Oneshot(reply) => {
                let _ = reply.send(outcome);
            }
            crate::request::AppendReply::Shard { shard, token } => self.send_event(shard, Event::Appended(vec![(token, outcome)])),
        }
    }

    /// Offer `event` to every shard.
    pub(crate) fn broadcast(&self, event: Event) {
        for shard in 0..self.mailboxes.len() {
            self.send_event(shard, event.clone());
        }
    }

    /// Resolves once no shard has [`HELD_MAX`] events held or more: the
    /// watches wait here before they read their next entry, so a shard
    /// that does not drain its mailbox makes them stop reading (NATS then
    /// holds the rest) rather than grow what the bridge holds for it.
    pub(crate) async fn room_for_events(&self) {
        loop {
            self.offer_held();
            let most = self.held.lock().expect("bridge-only lock").iter().map(Vec::len).max().unwrap_or(0);
            if most < HELD_MAX {
                return;
            }
            tokio::time::sleep(HELD_RETRY).await;
        }
    }

    /// Offer the held events again, in order.
    pub(crate) fn offer_held(&self) {
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

/// A connection named `name` made to the server that leads `stream`,
/// when that server is one of `cluster.nats_urls` and is not `current`
/// (the server of a connection already there); `None` otherwise (`urls`:
/// see [`url_of`]). For the state connection, at `KV_mqtt-sessions`'
/// leader: every CONNECT writes that bucket and its watch delivers every
/// write back (DESIGN.md §8): at the leader, a write, its acknowledgement
/// and its delivery are relayed between no NATS servers; elsewhere each
/// one is (perf/RESULTS.md, issue 23, wt-23c: NATS messages and CPU per
/// cluster CONNECT). Chosen once at start: when leadership moves later,
/// or the connection is made again after a disconnect (to any server, as
/// before), it stays where it is (slower, not wrong). (The ingest
/// connection follows its stream's leader: `leader.rs`.)
async fn at_leader(
    config: &BridgeConfig,
    state: &Context,
    urls: &mut ServerUrls,
    stream: &str,
    name: &str,
    current: &str,
) -> Option<async_nats::Client> {
    let leader = state.get_stream(stream).await.ok()?.info().await.ok()?.cluster.as_ref()?.leader.clone()?;
    if leader == current {
        return None;
    }
    let url = url_of(config, urls, &leader).await?;
    let client = connect(&config.cluster, name.to_owned(), Some(&url), &urls.unanswered).await.ok()?;
    info!(target: "bridge", %leader, %url, %stream, connection = name, "bridge: {name} at the leader of {stream}");
    Some(client)
}

/// Which server each URL of `cluster.nats_urls` reaches, as far as asked
/// (see [`ServerUrls::probe`]).
#[derive(Debug, Default, Clone)]
pub(crate) struct ServerUrls {
    /// Server name → URL.
    by_name: std::collections::HashMap<String, String>,
    /// URLs that did not answer a probe: not asked again until
    /// [`ServerUrls::ask_silent_again`].
    silent: std::collections::HashSet<String>,
    /// URLs already named in a warning (once per process).
    told: std::collections::HashSet<String>,
    /// URLs that reach a server another URL reaches: not asked again.
    aliases: std::collections::HashSet<String>,
    /// The URLs that did not answer their last probe, as every
    /// connection's reconnects see them (`config::Rotation`): shared by
    /// the copies.
    pub(crate) unanswered: Arc<crate::config::Unanswered>,
}

impl ServerUrls {
    /// Let the URLs that did not answer be probed again (a server that
    /// was down may lead now: `leader.rs`).
    pub(crate) fn ask_silent_again(&mut self) {
        self.silent.clear();
    }

    /// Ask every URL of `cluster.nats_urls` not known yet, and not
    /// silent, which server it is: all at once, a connection each
    /// (`fleetmq-<replica>-probe`, closed again) given [`PROBE_WAIT`]. One
    /// that does not answer is left silent and named in a warning, once
    /// per process. Nothing with one URL (there is no choice to make).
    pub(crate) async fn probe(&mut self, config: &BridgeConfig) {
        if config.cluster.nats_urls.len() < 2 {
            return;
        }
        let name = format!("fleetmq-{}-probe", config.replica_id);
        let ask: Vec<&String> = config
            .cluster
            .nats_urls
            .iter()
            .filter(|url| !self.by_name.values().any(|known| known == *url) && !self.silent.contains(*url) && !self.aliases.contains(*url))
            .collect();
        let answers = futures_util::future::join_all(ask.into_iter().map(|url| {
            let name = name.clone();
            let unanswered = &self.unanswered;
            async move { (url, tokio::time::timeout(PROBE_WAIT, connect(&config.cluster, name, Some(url), unanswered)).await) }
        }))
        .await;
        for (url, answer) in answers {
            self.unanswered.set(url, !matches!(answer, Ok(Ok(_))));
            let why = match answer {
                Ok(Ok(probe)) => {
                    let server = probe.server_info().server_name;
                    if let Some(other) = self.by_name.get(&server).filter(|other| *other != url) {
                        self.aliases.insert(url.clone());
                        if self.told.insert(url.clone()) {
                            warn!(target: "bridge", %url, %other, %server, "bridge: two URLs of cluster.nats_urls reach the same NATS server");
                        }
                        continue;
                    }
                    self.by_name.insert(server, url.clone());
                    continue;
                }
                Ok(Err(e)) => e.to_string(),
                Err(_) => format!("no answer within {PROBE_WAIT:?} (stopped or frozen?)"),
            };
            self.silent.insert(url.clone());
            if self.told.insert(url.clone()) {
                warn!(target: "bridge", %url, error = %why, "bridge: a NATS server of cluster.nats_urls did not answer; connections are not placed there");
            } else {
                debug!(target: "bridge", %url, error = %why, "bridge: a NATS server of cluster.nats_urls still does not answer");
            }
        }
    }

    /// A URL that answered, at random (spreads the connections of the
    /// replicas); `None` when none was asked or none answered.
    pub(crate) fn answering(&self) -> Option<String> {
        let known: Vec<&String> = self.by_name.values().collect();
        (!known.is_empty()).then(|| known[rand::Rng::gen_range(&mut rand::thread_rng(), 0..known.len())].clone())
    }
}

/// How long a probe waits for a server to answer: a server of the
/// cluster answers within milliseconds; one stopped (or frozen) must not
/// hold a replica's start for the whole connect timeout.
const PROBE_WAIT: Duration = Duration::from_secs(1);

/// The URL of the server named `server` among `cluster.nats_urls`
/// (`None`: none that answers is), from `urls`, probed when it is not
/// known ([`ServerUrls::probe`]). Only with two URLs or more.
pub(crate) async fn url_of(config: &BridgeConfig, urls: &mut ServerUrls, server: &str) -> Option<String> {
    if !urls.by_name.contains_key(server) {
        urls.probe(config).await;
    }
    urls.by_name.get(server).cloned()
}

/// [`connect_steered`] to `first` (a server that answered a probe, or a
/// stream's leader) when there is one, else, or when it fails, to any of
/// `cluster.nats_urls`: a server that does not answer costs the start the
/// connect timeout only when no probe could tell.
///
/// # Errors
/// As [`connect_steered`] without `first`.
async fn connect_answering(
    config: &BridgeConfig,
    urls: &ServerUrls,
    name: String,
    first: Option<String>,
) -> Result<(async_nats::Client, Arc<crate::config::Rotation>), StartError> {
    if let Some(first) = first {
        if let Ok(made) = connect_steered(&config.cluster, name.clone(), Some(&first), &urls.unanswered).await {
            return Ok(made);
        }
    }
    connect_steered(&config.cluster, name, None, &urls.unanswered).await
}

/// Open the KV bucket `name` (created by `setup::ensure_buckets`), asked
/// again until `until` when JetStream does not answer: a cluster busy or
/// electing a leader at the start answers late, and one timed-out request
/// stopped the start (measured in CI with other clusters running).
///
/// # Errors
/// [`StartError::Connect`] naming the bucket, once `until` passed.
async fn open_bucket(state: &Context, name: &str, until: tokio::time::Instant) -> Result<async_nats::jetstream::kv::Store, StartError> {
    loop {
        match state.get_key_value(name).await {
            Ok(store) => return Ok(store),
            Err(e) if tokio::time::Instant::now() < until => {
                warn!(target: "bridge", bucket = name, error = %e, "bridge: bucket not opened yet, trying again");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => return Err(StartError::Connect(format!("bucket {name}: {e}"))),
        }
    }
}

/// Connect, check and set up JetStream (retrying what did not answer for
/// a while), and make what the bridge's tasks share.
pub(crate) async fn start(
    config: BridgeConfig,
    status: Arc<ClusterStatus>,
    mailboxes: Vec<Arc<Mailbox<Event>>>,
) -> Result<Arc<Shared>, StartError> {
    let name = |part: &str| format!("fleetmq-{}-{part}", config.replica_id);
    // Which URLs answer, all asked at once: the connections go to those.
    let mut urls = ServerUrls::default();
    urls.probe(&config).await;
    let (state_client, _) = connect_answering(&config, &urls, name("state"), urls.answering()).await?;
    let (lease_client, _) = connect_answering(&config, &urls, name("lease"), urls.answering()).await?;
    let context = |client: async_nats::Client| {
        jetstream::ContextBuilder::new().timeout(JS_TIMEOUT).build(client)
    };
    let state = context(state_client.clone());
    let lease = context(lease_client);
    // JetStream may still be electing (a cluster just started, a server
    // restarting: "no suitable peers for placement"): what did not answer
    // is tried again for a while; an incompatible answer stops at once.
    let retry_until = tokio::time::Instant::now() + START_WAIT * 2 / 3;
    // The same reason is logged once, a new one at once.
    let mut logged = String::new();
    let (level, floor) = loop {
        let attempt = async {
            let level = setup::check_api_level(&state).await?;
            setup::ensure_buckets(&state, usize::from(config.cluster.nats_replicas), config.cluster.member_ttl).await?;
            if let Some(store) = &config.ingest {
                setup::ensure_ingest(&state, store, usize::from(config.cluster.nats_replicas)).await?;
            }
            let floor = setup::check_floor(&state).await?;
            Ok::<_, StartError>((level, floor))
        };
        match attempt.await {
            Ok(done) => break done,
            Err(StartError::Connect(why)) if tokio::time::Instant::now() < retry_until => {
                if why != logged {
                    warn!(target: "bridge", %why, give_up_in = ?retry_until.saturating_duration_since(tokio::time::Instant::now()),
                        "bridge: JetStream not ready yet, trying again every 0.5 s");
                    logged = why;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => return Err(e),
        }
    };
    info!(target: "bridge", level, floor, replica = %config.replica_id, "bridge: JetStream ready");
    status.raise_floor(floor);
    let sessions_stream = format!("KV_{}", fleetmq_core::cluster::records::bucket::SESSIONS);
    let current = state_client.server_info().server_name.clone();
    let (state_client, state) = match at_leader(&config, &state, &mut urls, &sessions_stream, &name("state"), &current).await {
        Some(client) => {
            let context = context(client.clone());
            (client, context)
        }
        None => (state_client, state),
    };
    let (ingest_client, ingest_rotation) = match &config.ingest {
        Some(_) => {
            let leader = crate::leader::ingest_leader(&state).await;
            let url = match &leader {
                Some(leader) => url_of(&config, &mut urls, leader).await,
                None => None,
            };
            // At the leader; else at a server that answered; else any.
            let (client, rotation) = connect_answering(&config, &urls, name("ingest"), url.or_else(|| urls.answering())).await?;
            let leader = leader.as_deref().unwrap_or("not known");
            info!(target: "bridge", server = %client.server_info().server_name, %leader, "bridge: ingest connection made");
            (client, rotation)
        }
        None => (state_client.clone(), Arc::new(crate::config::Rotation::new(None, urls.unanswered.clone()))),
    };
    use fleetmq_core::cluster::records::bucket;
    let open_until = tokio::time::Instant::now() + START_WAIT / 3;
    let sessions = open_bucket(&state, bucket::SESSIONS, open_until).await?;
    let wills = open_bucket(&state, bucket::WILLS, open_until).await?;
    let session_state = open_bucket(&state, bucket::SESSION_STATE, open_until).await?;
    let cursors = open_bucket(&state, bucket::SESSION_CURSOR, open_until).await?;
    let shards = mailboxes.len();
    Ok(Arc::new(Shared {
        config,
        status,
        state,
        lease,
        state_client,
        ingest_client,
        ingest_rotation,
        ingest_left: Mutex::new(None),
        server_urls: Mutex::new(urls),
        sessions,
        wills,
        session_state,
        handovers: std::sync::atomic::AtomicU64::new(0),
        known: Mutex::new(crate::ownership::KnownRevisions::default()),
        mailboxes,
        live: Mutex::new(std::collections::HashMap::new()),
        gone: Mutex::new(std::collections::HashMap::new()),
        decides_until: Mutex::new(None),
        held: Mutex::new(vec![Vec::new(); shards]),
        clean_starts: Mutex::new(std::collections::HashMap::new()),
        will_map: Mutex::new(std::collections::HashMap::new()),
        session_map: Mutex::new(std::collections::HashMap::new()),
        remote: Mutex::new(crate::routes::Remote::default()),
        routes_loaded: AtomicBool::new(false),
        member_reads: Mutex::new(std::collections::HashMap::new()),
        claims_in_flight: std::sync::atomic::AtomicUsize::new(0),
        stop: Notify::new(),
        stopping: AtomicBool::new(false),
        duplicate: AtomicBool::new(false),
        rewrite_routes: AtomicBool::new(false),
        writes: std::sync::atomic::AtomicU64::new(0),
        warned: Mutex::new((None, 0)),
        budget: Arc::new(crate::budget::Budget::writes()),
        undos: Arc::new(crate::budget::Budget::undos()),
        ingest: Arc::new(crate::budget::Budget::ingest()),
        ingest_warned: Mutex::new((None, 0)),
        interest: Arc::new(std::sync::RwLock::new(fleetmq_core::cluster::session_log::Interest::default())),
        interest_loaded: AtomicBool::new(false),
        logs: Mutex::new(std::collections::HashMap::new()),
        cursors,
        tails: Mutex::new(std::collections::HashSet::new()),
        state_moved: tokio::sync::watch::Sender::new(0),
        ingest_moved: tokio::sync::watch::Sender::new(0),
        orders: crate::order::Orders::default(),
    }))
}
