//! What the bridge needs to start, and the two NATS connections.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::{Client, ConnectOptions};
use fleetmq_core::cluster::settings::Cluster;

use crate::StartError;

/// What [`crate::Bridge::start`] needs.
#[derive(Debug, Clone)]
pub struct BridgeConfig {
    /// The `[cluster]` settings (DESIGN.md §15).
    pub cluster: Cluster,
    /// This replica's ID (`cluster.replica_id` or the host name).
    pub replica_id: String,
    /// A random ID of this process, distinct from any other process's.
    pub instance: String,
    /// When this process started, Unix milliseconds.
    pub started_at_ms: u64,
    /// How many shards route events ([`crate::Bridge::mailboxes`]).
    pub shards: usize,
    /// The shard that owns a client identifier (the broker's `owner_of`).
    pub owner_of: fn(&str, usize) -> usize,
    /// The mesh address the member record advertises (`host:port`, the
    /// bound port when `cluster.mesh_listen` asks for port 0); empty: no
    /// mesh.
    pub mesh: String,
    /// The mesh protocol versions the member record says this replica
    /// speaks (ignored without a mesh).
    pub mesh_versions: Vec<u16>,
    /// `store.kind = "jetstream"`: the `[store]` settings of the ingest
    /// stream, created or checked at start (`None`: no ingest stream).
    pub ingest: Option<fleetmq_core::settings::Store>,
    /// How long a session log keeps a value (`limits.max_session_expiry`:
    /// no session waits longer for one), its streams' `max_age`.
    pub session_log_max_age: Duration,
}

/// How long a JetStream API call or publish acknowledgement may take
/// before it counts as failed (the write may still land: every write is
/// idempotent, DESIGN.md §14).
pub(crate) const JS_TIMEOUT: Duration = Duration::from_secs(5);

/// The NATS ping interval: async-nats' default of 60 s takes 2–3 minutes
/// to see a frozen server (notes/jetstream.md); the store probe is what
/// detects silence, this only keeps a dead TCP connection from lingering.
const PING_INTERVAL: Duration = Duration::from_secs(5);

/// Connect to NATS as `name` (`fleetmq-<replica>-state` or `-lease`),
/// with the credentials and TLS of `cluster`: to any of
/// `cluster.nats_urls` (a random one first, then each in turn until one
/// answers), or with `first` (one of them) to that one. Every later
/// connection attempt (a reconnect after a server closed the connection,
/// or one [`crate::liveness`] forced) goes to the next server of the pool
/// after the one it was connected to, passing over those `unanswered`
/// (or that failed their last attempt) while another is left
/// ([`Rotation`]), so that a reconnect forced away from a frozen server
/// neither goes back to it nor waits out the connect timeout at a server
/// known not to answer. Each attempt waits [`connect_timeout`].
///
/// # Errors
/// [`StartError::Connect`] when no server answers within the connection
/// timeout (with `first`: when that one does not), or a credentials or
/// certificate file cannot be read.
pub(crate) async fn connect(cluster: &Cluster, name: String, first: Option<&str>, unanswered: &Arc<Unanswered>) -> Result<Client, StartError> {
    connect_steered(cluster, name, first, unanswered).await.map(|(client, _)| client)
}

/// [`connect`], with the connection's [`Rotation`], to steer a later
/// reconnect ([`Rotation::steer`]).
///
/// # Errors
/// As [`connect`].
pub(crate) async fn connect_steered(
    cluster: &Cluster,
    name: String,
    first: Option<&str>,
    unanswered: &Arc<Unanswered>,
) -> Result<(Client, Arc<Rotation>), StartError> {
    // What an error names: the one server tried, or all of them.
    let tried = first.map_or_else(|| cluster.nats_urls.join(", "), str::to_owned);
    let first = match first {
        Some(first) => {
            Some(first.parse().map_err(|e| StartError::Config(format!("cluster.nats_urls: {first:?}: {e}")))?)
        }
        None => None,
    };
    let urls: Vec<async_nats::ServerAddr> = cluster
        .nats_urls
        .iter()
        .map(|u| u.parse().map_err(|e| StartError::Config(format!("cluster.nats_urls: {u:?}: {e}"))))
        .collect::<Result<_, _>>()?;
    let attempts = if first.is_some() { 1 } else { urls.len().max(1) };
    let rotation = Arc::new(Rotation::new(first, unanswered.clone()));
    let mut last = String::new();
    for _ in 0..attempts {
        let options = options(cluster, name.clone(), rotation.clone()).await?;
        match options.connect(urls.clone()).await {
            Ok(client) => return Ok((client, rotation)),
            Err(e) => last = e.to_string(),
        }
    }
    Err(StartError::Connect(format!("{tried}: {last}")))
}

/// The connect options of [`connect`]: events logged, pings, timeouts,
/// credentials and TLS from `cluster`, servers picked by `rotation`.
async fn options(cluster: &Cluster, name: String, rotation: Arc<Rotation>) -> Result<ConnectOptions, StartError> {
    let label = name.clone();
    let steered = rotation.clone();
    let mut options = ConnectOptions::new()
        .event_callback(move |event| {
            // async-nats' own lines are filtered to warnings by default
            // (shards' main): these say what happened, naming the part.
            let label = label.clone();
            // A disconnect asked for to move the connection to a chosen
            // server (`leader.rs`) is no fault.
            let moving = steered.steered();
            async move {
                match event {
                    async_nats::Event::Disconnected if moving => {
                        tracing::info!(target: "bridge", connection = %label, "bridge: NATS disconnected to move to the chosen server")
                    }
                    async_nats::Event::Disconnected
                    | async_nats::Event::LameDuckMode
                    | async_nats::Event::ServerError(_)
                    | async_nats::Event::ClientError(_) => {
                        tracing::warn!(target: "bridge", connection = %label, "bridge: NATS {event}")
                    }
                    async_nats::Event::SlowConsumer(_) => {
                        tracing::debug!(target: "bridge", connection = %label, "bridge: NATS {event}")
                    }
                    _ => tracing::info!(target: "bridge", connection = %label, "bridge: NATS {event}"),
                }
            }
        })
        .name(name)
        .ping_interval(PING_INTERVAL)
        .connection_timeout(connect_timeout(cluster.member_ttl))
        .request_timeout(Some(JS_TIMEOUT))
        .max_reconnects(None)
        .reconnect_to_server_callback(move |pool, _| std::future::ready(rotation.pick(&pool)));
    let file = |p: &PathBuf| !p.as_os_str().is_empty();
    if file(&cluster.nats_credentials) {
        options = options
            .credentials_file(&cluster.nats_credentials)
            .await
            .map_err(|e| StartError::Config(format!("cluster.nats_credentials: {}: {e}", cluster.nats_credentials.display())))?;
    }
    if file(&cluster.nats_nkey_file) {
        let seed = std::fs::read_to_string(&cluster.nats_nkey_file)
            .map_err(|e| StartError::Config(format!("cluster.nats_nkey_file: {}: {e}", cluster.nats_nkey_file.display())))?;
        options = options.nkey(seed.trim().to_owned());
    }
    if !cluster.nats_user.is_empty() {
        options = options.user_and_password(cluster.nats_user.clone(), cluster.nats_password.clone());
    }
    if !cluster.nats_token.is_empty() {
        options = options.token(cluster.nats_token.clone());
    }
    if cluster.nats_tls {
        options = options.require_tls(true);
    }
    if file(&cluster.nats_tls_ca) {
        options = options.add_root_certificates(cluster.nats_tls_ca.clone());
    }
    if file(&cluster.nats_tls_cert) {
        options = options.add_client_certificate(cluster.nats_tls_cert.clone(), cluster.nats_tls_key.clone());
    }
    Ok(options)
}

/// How long one connection attempt may take (TCP, TLS, the server's
/// INFO and the answer to CONNECT): T/5 of `member_ttl`, within 1–5 s
/// (2 s at the default T = 10 s, the Go client's default). A reconnect
/// forced away from a frozen server (found at T/2 + T/10) has about 0.35T
/// before the fence ([`crate::liveness`]); one attempt that waits this
/// out at a server that does not answer must leave room for the next.
pub(crate) fn connect_timeout(member_ttl: Duration) -> Duration {
    (member_ttl / 5).clamp(Duration::from_secs(1), Duration::from_secs(5))
}

/// The URLs of `cluster.nats_urls` that did not answer their last probe
/// (`shared::ServerUrls::probe`), shared by every connection's
/// [`Rotation`]: their reconnects go there only when no other server is
/// left to try.
#[derive(Debug, Default)]
pub(crate) struct Unanswered(Mutex<Vec<async_nats::ServerAddr>>);

impl Unanswered {
    /// Record the answer of `url`'s last probe (`silent`: none).
    pub(crate) fn set(&self, url: &str, silent: bool) {
        let (Ok(addr), Ok(mut known)) = (url.parse::<async_nats::ServerAddr>(), self.0.lock()) else { return };
        known.retain(|a| *a != addr);
        if silent {
            known.push(addr);
        }
    }

    fn contains(&self, addr: &async_nats::ServerAddr) -> bool {
        self.0.lock().is_ok_and(|known| known.contains(addr))
    }
}

/// Which server of the pool (the configured URLs, and the ones the
/// servers advertise) each connection attempt of one connection goes to:
/// `first` if given; else, starting after the server of the previous
/// attempt in the pool's order (at a random one the first time), the
/// first that is neither that server nor one that did not answer (its
/// probe, [`Unanswered`], or its last attempt); the first of those only
/// when no other is left, and the previous server last. async-nats asks
/// before every attempt (`reconnect_to_server_callback`); its own choice
/// is random: after a forced reconnect it would pick the frozen server
/// again one time in three, and a plain "next in the pool" picked a URL
/// that had never answered (fresh-user pass s46c: its connect timeout,
/// then 5 s, fenced the replica).
pub(crate) struct Rotation {
    /// The server of the first attempt, taken by it.
    first: Mutex<Option<async_nats::ServerAddr>>,
    /// The server of the previous attempt.
    last: Mutex<Option<async_nats::ServerAddr>>,
    /// The URLs that did not answer their probe.
    unanswered: Arc<Unanswered>,
    /// When each server (its URL) was last picked: a failed attempt
    /// counts against a server for [`FAILURE_REMEMBERED`] after it.
    picked: Mutex<std::collections::HashMap<String, std::time::Instant>>,
}

/// How long a server whose last connection attempt failed is tried only
/// after the others: within one reconnect, not for good (async-nats
/// clears a server's failed attempts only when it connects there, and a
/// server that failed during an outage answers again after it: fresh-user
/// pass s47, a freeze after an outage fenced every replica).
const FAILURE_REMEMBERED: Duration = Duration::from_secs(30);

impl Rotation {
    pub(crate) fn new(first: Option<async_nats::ServerAddr>, unanswered: Arc<Unanswered>) -> Rotation {
        Rotation { first: Mutex::new(first), last: Mutex::new(None), unanswered, picked: Mutex::default() }
    }

    /// The server of the next attempt (`None`: async-nats chooses, only
    /// with an empty pool). The first attempt after a connection was lost
    /// goes at once; after that async-nats' backoff applies (up to 4 s).
    pub(crate) fn pick(&self, pool: &[async_nats::Server]) -> Option<async_nats::ReconnectToServer> {
        let lock = |m: &Mutex<Option<async_nats::ServerAddr>>| m.lock().map(|mut g| g.take()).unwrap_or(None);
        if let Some(first) = lock(&self.first) {
            self.remember(&first);
            return Some(async_nats::ReconnectToServer { addr: first, delay: Some(Duration::ZERO) });
        }
        if pool.is_empty() {
            return None;
        }
        let previous = self.last.lock().ok().and_then(|g| g.clone());
        let previous_at = previous.as_ref().and_then(|p| pool.iter().position(|s| s.addr == *p));
        let start = match previous_at {
            Some(i) => i + 1,
            None => rand::Rng::gen_range(&mut rand::thread_rng(), 0..pool.len()),
        };
        // 0: may answer; 1: did not answer its probe, or its last
        // attempt, lately; 2: just left.
        let picked = self.picked.lock();
        let failed_lately = |server: &async_nats::Server| {
            server.failed_attempts > 0
                && picked.as_ref().is_ok_and(|p| p.get(server.addr.as_url_str()).is_some_and(|at| at.elapsed() < FAILURE_REMEMBERED))
        };
        let rank = |at: usize| {
            let server = &pool[at];
            if Some(at) == previous_at {
                2
            } else if failed_lately(server) || self.unanswered.contains(&server.addr) {
                1
            } else {
                0
            }
        };
        let at = (0..pool.len()).map(|i| (start + i) % pool.len()).min_by_key(|&at| rank(at)).unwrap_or(0);
        // Released before `remember` takes it again.
        drop(picked);
        let addr = pool[at].addr.clone();
        self.remember(&addr);
        Some(async_nats::ReconnectToServer { addr, delay: None })
    }

    /// The next attempt goes to `url` (one of `cluster.nats_urls`): a
    /// reconnect forced to reach the server that leads a stream.
    pub(crate) fn steer(&self, url: &str) {
        if let (Ok(addr), Ok(mut first)) = (url.parse(), self.first.lock()) {
            *first = Some(addr);
        }
    }

    /// Whether the next reconnect is steered ([`Rotation::steer`]) and
    /// has not happened yet.
    pub(crate) fn steered(&self) -> bool {
        self.first.lock().is_ok_and(|first| first.is_some())
    }

    fn remember(&self, addr: &async_nats::ServerAddr) {
        if let Ok(mut last) = self.last.lock() {
            *last = Some(addr.clone());
        }
        if let Ok(mut picked) = self.picked.lock() {
            picked.insert(addr.as_url_str().to_owned(), std::time::Instant::now());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(urls: &[&str]) -> Vec<async_nats::Server> {
        urls.iter()
            .map(|u| async_nats::Server {
                addr: u.parse().unwrap(),
                failed_attempts: 0,
                did_connect: false,
                is_discovered: false,
                last_error: None,
            })
            .collect()
    }

    /// The server the next attempt goes to, after one at `from`.
    fn after(rotation: &Rotation, pool: &[async_nats::Server], from: &str) -> String {
        rotation.steer(from);
        rotation.pick(pool).unwrap();
        rotation.pick(pool).unwrap().addr.as_url_str().to_owned()
    }

    #[test]
    fn a_reconnect_passes_over_urls_that_did_not_answer_their_probe() {
        let unanswered = Arc::new(Unanswered::default());
        unanswered.set("nats://10.255.255.1:4222", true);
        let pool = pool(&["nats://n1:4222", "nats://10.255.255.1:4222", "nats://n2:4222", "nats://n0:4222"]);
        let rotation = Rotation::new(None, unanswered.clone());
        assert_eq!(after(&rotation, &pool, "nats://n1:4222"), "nats://n2:4222");
        assert_eq!(after(&rotation, &pool, "nats://n2:4222"), "nats://n0:4222");
        assert_eq!(after(&rotation, &pool, "nats://n0:4222"), "nats://n1:4222");
        // Answered a later probe: in turn again.
        unanswered.set("nats://10.255.255.1:4222", false);
        assert_eq!(after(&rotation, &pool, "nats://n1:4222"), "nats://10.255.255.1:4222");
    }

    #[test]
    fn a_reconnect_passes_over_servers_whose_last_attempt_failed_and_goes_back_to_the_one_left_last() {
        let mut pool = pool(&["nats://n0:4222", "nats://n1:4222", "nats://n2:4222"]);
        pool[1].failed_attempts = 1;
        let rotation = Rotation::new(None, Arc::default());
        // A failure long ago (an outage since over): in turn.
        assert_eq!(after(&rotation, &pool, "nats://n0:4222"), "nats://n1:4222");
        // Tried lately and failed: passed over.
        assert_eq!(after(&rotation, &pool, "nats://n0:4222"), "nats://n2:4222");
        // Every other one failed: the one that failed first in turn,
        // before the one just left.
        pool[2].failed_attempts = 3;
        assert_eq!(after(&rotation, &pool, "nats://n0:4222"), "nats://n1:4222");
        // One server only: that one.
        let one = &pool[..1];
        assert_eq!(after(&rotation, one, "nats://n0:4222"), "nats://n0:4222");
    }

    #[test]
    fn the_connect_timeout_is_a_fifth_of_member_ttl_within_1_to_5_s() {
        assert_eq!(connect_timeout(Duration::from_secs(10)), Duration::from_secs(2));
        assert_eq!(connect_timeout(Duration::from_secs(3)), Duration::from_secs(1));
        assert_eq!(connect_timeout(Duration::from_secs(120)), Duration::from_secs(5));
        // Room for one attempt at a server that does not answer between
        // the silence found (T/2 + T/10) and the fence (7T/6), with the
        // next heartbeat (T/10) and 0.2T for JetStream, at the default T.
        let t = Duration::from_secs(10);
        assert!(t / 2 + t / 10 + connect_timeout(t) + t / 10 + t / 5 <= t * 7 / 6);
    }
}
