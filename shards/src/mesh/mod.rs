//! The mesh (DESIGN.md §3, §6 "mesh cut", §11): live values replica to
//! replica over mutual TLS 1.3, in one hop.
//!
//! How links map to shards: **every shard dials one link to each peer
//! replica** and sends on it the values its own clients publish
//! ([`outgoing`]); the peer serves the link on whichever of its shards
//! accepted it and dispatches each value there like a publish, to its
//! subscribers on every shard through the normal route table
//! ([`incoming`]). No cross-shard hop on the sending side, and per
//! publisher order holds end to end: a publisher stays on its shard in
//! cluster mode (`server.move_publishers` is off there, trap 11 of
//! notes/cluster-seams.md), its values take one link, the receiving
//! shard dispatches them in order, and each shard pair's channel keeps
//! order. perf/RESULTS.md (session 38) has the figures.
//!
//! A link is one-way for values: the dialer numbers each value and keeps
//! it until the acceptor acknowledges it; after a reconnect the acceptor
//! says what it delivered on that link and the dialer sends from there on
//! (no loss, no duplicate while the acceptor's process lives). A link
//! that is down keeps up to `cluster.mesh_buffer` per peer (split over
//! the shards); past it the oldest are dropped and counted, as is what
//! a peer taken for gone never acknowledged. The values in it that were
//! sent there for a shared subscription group go to another member as
//! soon as one is reachable (`Shard::redispatch_groups`): at least once,
//! [MQTT 5 §4.8.2].

use std::collections::{HashMap, HashSet};
use std::net::{SocketAddr, TcpListener as StdListener};
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use fleetmq_core::settings::Settings;
use tracing::warn;

pub(crate) mod incoming;
pub(crate) mod outgoing;
mod queue;
mod tls;

pub(crate) use outgoing::ShardLinks;

/// The mesh protocol versions this process offers in its member record
/// (`mesh_versions`) and its Hello, and accepts in a peer's Hello:
/// every version this build speaks ([`fleetmq_core::mesh::VERSIONS`]), or
/// those of them the environment variable `FLEETMQ_MESH_VERSIONS` lists
/// (comma-separated, e.g. `1,2`: a rolling-upgrade drill, or a test of an
/// older peer). A list naming none of them is not used. Read once per
/// process.
pub(crate) fn spoken() -> &'static [u16] {
    use fleetmq_core::mesh::VERSIONS;
    static SPOKEN: std::sync::OnceLock<Vec<u16>> = std::sync::OnceLock::new();
    SPOKEN.get_or_init(|| {
        let listed = std::env::var("FLEETMQ_MESH_VERSIONS").unwrap_or_default();
        let chosen: Vec<u16> = VERSIONS
            .iter()
            .copied()
            .filter(|v| listed.split(',').any(|l| l.trim().parse::<u16>().ok() == Some(*v)))
            .collect();
        if chosen.is_empty() {
            VERSIONS.to_vec()
        } else {
            chosen
        }
    })
}

/// How long a link's dialer writes nothing before it sends a keepalive
/// (an empty Values frame, mesh protocol version 2).
pub(crate) const KEEPALIVE_IDLE: Duration = Duration::from_secs(1);

/// How long either end of a version-2 link reads nothing before it takes
/// the link for dead and closes it (a stopped, frozen or unreachable
/// peer): the dialer then keeps its values in the buffer and dials
/// again. About 3 to 4 keepalives missed.
pub(crate) const KEEPALIVE_DEAD: Duration = Duration::from_secs(4);

/// `read`'s output, or `None` when `keepalive` is on (a version-2 link)
/// and it takes longer than [`KEEPALIVE_DEAD`]: the peer is taken for
/// dead.
pub(crate) async fn or_dead<T>(keepalive: bool, read: impl std::future::Future<Output = T>) -> Option<T> {
    futures_lite::future::or(async { Some(read.await) }, async {
        if !keepalive {
            std::future::pending::<()>().await;
        }
        glommio::timer::sleep(KEEPALIVE_DEAD).await;
        None
    })
    .await
}

/// How long a peer this replica should link to may lack a link from one
/// of its shards before the replica says it is not ready, at least: a
/// link that can be made again is, within the longest pause between
/// dials (5 s, reached after about 6 s of failed dials) plus a whole
/// dial (5 s). The grace is the larger of this and 2 × `member_ttl`
/// ([`ready_grace`]).
pub(crate) const LINK_GRACE_MIN: Duration = Duration::from_secs(10);

/// The readiness grace of the mesh for `member_ttl`: at least
/// [`LINK_GRACE_MIN`], and longer than a killed or frozen peer takes to
/// be declared gone (at most 1.7 × `member_ttl` after its last write,
/// DESIGN.md §5), so one lost replica does not make every other replica
/// unready: only a replica that cannot reach a peer the others take for
/// live says so. 20 s with the default `member_ttl` of 10 s.
pub(crate) fn ready_grace(member_ttl: Duration) -> Duration {
    LINK_GRACE_MIN.max(member_ttl * 2)
}

/// Why a link was refused (`fleetmq_mesh_refused_total{reason}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RefusedFor {
    /// A certificate: the TLS handshake failed on one (from another CA,
    /// none, expired, a server certificate that does not name the peer
    /// dialed; or the peer's alert saying so of ours:
    /// [`tls::refused_for`]), or a valid client certificate that does
    /// not name the replica its Hello claims.
    Certificate,
    /// The Hello names the accepting replica itself (two processes with
    /// one replica ID).
    Name,
    /// No mesh protocol version in common.
    Version,
    /// Not TLS, not a Hello, a malformed frame, or no answer in time.
    Protocol,
    /// Too many TLS handshakes in progress on the listener shard
    /// ([`incoming::HANDSHAKES_MAX`]): closed at once.
    Busy,
}

impl RefusedFor {
    const ALL: [RefusedFor; 5] =
        [RefusedFor::Certificate, RefusedFor::Name, RefusedFor::Version, RefusedFor::Protocol, RefusedFor::Busy];

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            RefusedFor::Certificate => "certificate",
            RefusedFor::Name => "name",
            RefusedFor::Version => "version",
            RefusedFor::Protocol => "protocol",
            RefusedFor::Busy => "busy",
        }
    }
}

/// One peer replica's figures, summed over this replica's shards.
#[derive(Debug, Default)]
pub(crate) struct PeerStats {
    /// This replica's links to it that are up (one per shard at most).
    pub(crate) links_up: AtomicI64,
    /// Bytes of values kept for it (unacknowledged or unsent).
    pub(crate) buffer_bytes: AtomicI64,
    /// Values for it dropped from a full buffer.
    pub(crate) lost: AtomicU64,
    /// Since when some shard has no link up to it (after all had one);
    /// `None` while all have, or before they ever all had.
    pub(crate) incomplete_since: Mutex<Option<Instant>>,
}

impl PeerStats {
    /// A link to the peer came up: `shards` links up ends an incomplete
    /// stretch.
    pub(crate) fn link_up(&self, shards: usize) {
        let up = self.links_up.fetch_add(1, Ordering::Relaxed) + 1;
        if up as usize >= shards {
            *self.incomplete_since.lock().unwrap_or_else(|e| e.into_inner()) = None;
        }
    }

    /// A link to the peer went down.
    pub(crate) fn link_down(&self, now: Instant) {
        self.links_up.fetch_sub(1, Ordering::Relaxed);
        self.incomplete_since.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(now);
    }
}

/// A peer this replica should link to and does not, from every shard,
/// for longer than the readiness grace.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Missing {
    /// Its replica ID.
    pub(crate) replica: String,
    /// This replica's links up to it (of one per shard).
    pub(crate) links_up: i64,
    /// How long not every shard has had a link to it.
    pub(crate) for_: Duration,
}

/// The mesh's counters (`/metrics`, `/api/v1/status`).
#[derive(Debug, Default)]
pub(crate) struct MeshStats {
    pub(crate) links_up: AtomicI64,
    pub(crate) links_in: AtomicI64,
    pub(crate) bytes_in: AtomicU64,
    pub(crate) bytes_out: AtomicU64,
    pub(crate) values_in: AtomicU64,
    pub(crate) values_out: AtomicU64,
    pub(crate) lost: AtomicU64,
    /// Shared group deliveries taken from a link that went down and given
    /// to another member (see `Shard::redispatch_groups`).
    pub(crate) redispatched: AtomicU64,
    refused: [AtomicU64; 5],
    /// Replica ID → its figures (peers met over the process's life).
    peers: Mutex<HashMap<String, Arc<PeerStats>>>,
}

impl MeshStats {
    /// Count a refused link.
    pub(crate) fn refused(&self, why: RefusedFor) {
        let at = RefusedFor::ALL.iter().position(|r| *r == why).unwrap_or(0);
        self.refused[at].fetch_add(1, Ordering::Relaxed);
    }

    /// The peers some shard links to now (a link holds its peer's
    /// figures: one that left or was taken for gone drops out of the
    /// status and the per-peer series, so an alert on its links does not
    /// fire for good after a scale-down), sorted by replica ID.
    fn linked(&self) -> Vec<(String, Arc<PeerStats>)> {
        let peers = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        let mut linked: Vec<_> =
            peers.iter().filter(|(_, p)| Arc::strong_count(p) > 1).map(|(r, p)| (r.clone(), p.clone())).collect();
        linked.sort_by(|a, b| a.0.cmp(&b.0));
        linked
    }

    /// The figures of the peer `replica`.
    pub(crate) fn peer(&self, replica: &str) -> Arc<PeerStats> {
        let mut peers = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        peers.entry(replica.to_owned()).or_default().clone()
    }
}

/// What an acceptor remembers of one link (the dialer's instance and
/// link number): the highest sequence number it delivered, and which
/// connection of that link is the current one.
#[derive(Debug, Default)]
pub(crate) struct Received {
    pub(crate) delivered: u64,
    pub(crate) generation: u64,
}

/// One link's [`Received`], shared by its connections.
pub(crate) type ReceivedRef = Arc<Mutex<Received>>;

/// Links remembered by an acceptor at most; past it, those with no
/// connection are forgotten (their dialer restarted, or left).
const RECEIVED_MAX: usize = 4096;

/// How long one warning (a source and a reason) stays quiet after it was
/// logged: a rogue or misconfigured dialer retrying every few seconds
/// gives a line a minute, not one a dial, and not one for good.
pub(crate) const LOG_EVERY: Duration = Duration::from_secs(60);

/// When each warning was last logged, by key (a source and a reason).
#[derive(Debug, Default)]
struct LogLimit {
    last: HashMap<String, Instant>,
}

impl LogLimit {
    /// Whether `key` is to be logged at `now` (never logged, or
    /// [`LOG_EVERY`] ago or more; then remembered). At most
    /// [`RECEIVED_MAX`] keys: those past their quiet time go first, all
    /// of them if none is.
    fn due(&mut self, key: String, now: Instant) -> bool {
        if self.last.get(&key).is_some_and(|at| now.saturating_duration_since(*at) < LOG_EVERY) {
            return false;
        }
        if self.last.len() >= RECEIVED_MAX {
            self.last.retain(|_, at| now.saturating_duration_since(*at) < LOG_EVERY);
            if self.last.len() >= RECEIVED_MAX {
                self.last.clear();
            }
        }
        self.last.insert(key, now);
        true
    }
}

/// The mesh of this process: certificates, the bound listener, figures.
pub(crate) struct Mesh {
    /// This replica's ID.
    pub(crate) replica: String,
    /// This process's mesh instance (random): with a shard number, the key
    /// under which acceptors remember a link.
    pub(crate) instance: String,
    tls: tls::MeshTls,
    /// The address the member record advertises (`host:port`).
    pub(crate) advertise: String,
    /// Bytes kept per link (`cluster.mesh_buffer` / shards).
    pub(crate) buffer_per_link: usize,
    /// The largest frame sent or read.
    pub(crate) max_frame: usize,
    pub(crate) shards: usize,
    pub(crate) stats: MeshStats,
    received: Mutex<HashMap<(String, u32), ReceivedRef>>,
    /// Each shard's listening socket, taken when the shard starts.
    listeners: Mutex<Vec<Option<OwnedFd>>>,
    /// What was logged once already (`mesh:` lines per peer).
    logged: Mutex<HashSet<String>>,
    /// When rate-limited warnings were last logged.
    log_limit: Mutex<LogLimit>,
    /// The peers this replica should link to (live, with a mesh and a
    /// protocol version in common), by replica ID, with since when.
    expected: Mutex<HashMap<String, Instant>>,
    /// How long a peer may lack a link before readiness says so
    /// ([`ready_grace`]).
    pub(crate) ready_grace: Duration,
}

impl std::fmt::Debug for Mesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mesh").field("replica", &self.replica).field("advertise", &self.advertise).finish()
    }
}

impl Mesh {
    /// Load the mesh certificates and bind `cluster.mesh_listen` once per
    /// shard (SO_REUSEPORT; port 0 picks a free port), for `replica`.
    /// `None` (with a warning) when no certificate is configured: the
    /// replica runs without a mesh.
    ///
    /// # Errors
    /// Bad certificate settings or files, or the listener cannot be bound.
    pub(crate) fn start(settings: &Settings, replica: &str, shards: usize) -> anyhow::Result<Option<Arc<Mesh>>> {
        let Some(cluster) = &settings.cluster else { return Ok(None) };
        let Some(tls) = tls::MeshTls::load(cluster, replica)? else {
            warn!(target: "mesh", "mesh: off: no cluster.mesh_cert, mesh_key and mesh_ca (`fleetmq cert`); values published here reach no other replica's subscribers");
            return Ok(None);
        };
        let mut addr: SocketAddr = cluster
            .mesh_listen
            .parse()
            .with_context(|| format!("cluster.mesh_listen: bad address {}", cluster.mesh_listen))?;
        // SO_REUSEPORT would share a port another process listens on
        // (the MQTT port, another replica's mesh) and take some of its
        // connections: refuse it, as the MQTT listeners do.
        if addr.port() != 0 {
            crate::server::refuse_if_listened_on(addr)
                .with_context(|| format!("cannot listen on {addr} (cluster.mesh_listen)"))?;
        }
        let mut fds = Vec::new();
        for _ in 0..shards {
            let listener = bind(addr).with_context(|| format!("cannot listen on {addr} (cluster.mesh_listen)"))?;
            addr = listener.local_addr()?;
            fds.push(Some(OwnedFd::from(listener)));
        }
        let advertise = advertised(&cluster.mesh_advertise, addr);
        tracing::info!(target: "mesh", %addr, %advertise, "mesh: listening");
        crate::server::announce(format_args!("fleetmq: listening mesh {addr}"));
        Ok(Some(Arc::new(Mesh {
            replica: replica.to_owned(),
            instance: format!("{:016x}", rand::random::<u64>()),
            tls,
            advertise,
            buffer_per_link: (cluster.mesh_buffer / shards.max(1)).max(1),
            max_frame: fleetmq_core::mesh::max_frame(settings.limits.max_packet_size),
            shards,
            stats: MeshStats::default(),
            received: Mutex::new(HashMap::new()),
            listeners: Mutex::new(fds),
            logged: Mutex::new(HashSet::new()),
            log_limit: Mutex::new(LogLimit::default()),
            expected: Mutex::new(HashMap::new()),
            ready_grace: ready_grace(cluster.member_ttl),
        })))
    }

    /// The live peers are `peers` (replica ID each) now: those this
    /// replica should link to from now on, keeping since when each was.
    pub(crate) fn expect(&self, peers: impl Iterator<Item = String>, now: Instant) {
        let mut expected = self.expected.lock().unwrap_or_else(|e| e.into_inner());
        let old = std::mem::take(&mut *expected);
        for replica in peers {
            let since = old.get(&replica).copied().unwrap_or(now);
            expected.insert(replica, since);
        }
    }

    /// The peers this replica should link to that have not had a link
    /// from every shard for [`Mesh::ready_grace`] or longer at `now`,
    /// sorted by replica ID.
    pub(crate) fn missing(&self, now: Instant) -> Vec<Missing> {
        let expected = self.expected.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let mut missing: Vec<Missing> = expected
            .into_iter()
            .filter_map(|(replica, since)| {
                let peer = self.stats.peer(&replica);
                let links_up = peer.links_up.load(Ordering::Relaxed);
                if links_up as usize >= self.shards {
                    return None;
                }
                let incomplete = *peer.incomplete_since.lock().unwrap_or_else(|e| e.into_inner());
                let from = incomplete.map_or(since, |at| at.max(since));
                let for_ = now.saturating_duration_since(from);
                (for_ >= self.ready_grace).then_some(Missing { replica, links_up, for_ })
            })
            .collect();
        missing.sort_by(|a, b| a.replica.cmp(&b.replica));
        missing
    }

    /// Why the replica is not ready for the mesh (DESIGN.md §12): the
    /// peers it should link to and has not, from every shard, for
    /// [`Mesh::ready_grace`], when they are more than half of the live
    /// peers it should link to; `None` otherwise. One peer that cannot
    /// link (a certificate of another CA, a cut to it) leaves the others
    /// ready: it is the one cut off from most of its peers, and readiness
    /// there takes it out of its load balancer; the others name it in
    /// `missing` (`/api/v1/status`) and `fleetmq_mesh_peers_missing`.
    /// With one peer, a replica missing it stays ready and only names it:
    /// which of the two is at fault cannot be told, and a cut between
    /// the two would otherwise take both out of their load balancer, the
    /// whole service, for values the buffer keeps until the link is back
    /// (DESIGN.md §6: a mesh cut does not affect clients).
    pub(crate) fn not_ready(&self) -> Option<String> {
        let missing = self.missing(Instant::now());
        let expected = self.expected.lock().unwrap_or_else(|e| e.into_inner()).len();
        if missing.is_empty() || expected < 2 || missing.len() * 2 <= expected {
            return None;
        }
        let list: Vec<String> = missing
            .iter()
            .map(|m| format!("{} ({} of {} links up, for {} s)", m.replica, m.links_up, self.shards, m.for_.as_secs()))
            .collect();
        Some(format!("mesh: no link to live peer {}", list.join(", ")))
    }

    /// Shard `shard`'s listening socket (once).
    pub(crate) fn take_listener(&self, shard: usize) -> Option<OwnedFd> {
        self.listeners.lock().unwrap_or_else(|e| e.into_inner()).get_mut(shard)?.take()
    }

    /// Whether `what` is logged for the first time (then remembered).
    pub(crate) fn first_time(&self, what: String) -> bool {
        let mut logged = self.logged.lock().unwrap_or_else(|e| e.into_inner());
        if logged.len() >= RECEIVED_MAX {
            logged.clear();
        }
        logged.insert(what)
    }

    /// Whether the warning `key` (a source and a reason) is to be logged
    /// now: at most once per [`LOG_EVERY`].
    pub(crate) fn log_due(&self, key: String) -> bool {
        self.log_limit.lock().unwrap_or_else(|e| e.into_inner()).due(key, Instant::now())
    }

    /// What this replica remembers of the link `(instance, link)`.
    pub(crate) fn received(&self, instance: &str, link: u32) -> ReceivedRef {
        let mut received = self.received.lock().unwrap_or_else(|e| e.into_inner());
        if received.len() >= RECEIVED_MAX {
            received.retain(|_, r| Arc::strong_count(r) > 1);
        }
        received.entry((instance.to_owned(), link)).or_default().clone()
    }

    /// The `mesh` object of `/api/v1/status`: links up, and per peer its
    /// links up out of one per shard, buffered bytes and values lost.
    pub(crate) fn status_json(&self) -> serde_json::Value {
        let relaxed = Ordering::Relaxed;
        let list: Vec<_> = self
            .stats
            .linked()
            .iter()
            .map(|(replica, p)| {
                let up = p.links_up.load(relaxed);
                serde_json::json!({
                    "replica": replica,
                    "links_up": up,
                    "links": self.shards,
                    "state": if up as usize >= self.shards { "up" } else if up > 0 { "partial" } else { "down" },
                    "buffer_bytes": p.buffer_bytes.load(relaxed),
                    "values_lost": p.lost.load(relaxed),
                })
            })
            .collect();
        let missing: Vec<_> = self
            .missing(Instant::now())
            .into_iter()
            .map(|m| serde_json::json!({"replica": m.replica, "links_up": m.links_up, "for_s": m.for_.as_secs()}))
            .collect();
        serde_json::json!({
            "listen": self.advertise,
            "links_per_peer": self.shards,
            "links_in": self.stats.links_in.load(relaxed),
            "peers": list,
            "missing": missing,
            "ready_grace_s": self.ready_grace.as_secs(),
        })
    }

    /// The mesh's `/metrics` series, text format.
    pub(crate) fn render_metrics(&self, out: &mut String) {
        use std::fmt::Write as _;
        let relaxed = Ordering::Relaxed;
        let s = &self.stats;
        let _ = writeln!(
            out,
            "# HELP fleetmq_mesh_links_up Mesh links from this replica that are up (one per shard and peer)\n# TYPE fleetmq_mesh_links_up gauge\nfleetmq_mesh_links_up {}",
            s.links_up.load(relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP fleetmq_mesh_links_in Mesh links from other replicas served here\n# TYPE fleetmq_mesh_links_in gauge\nfleetmq_mesh_links_in {}",
            s.links_in.load(relaxed)
        );
        for (name, help, v) in [
            ("mesh_bytes_in", "Bytes read from mesh links (TLS payload)", &s.bytes_in),
            ("mesh_bytes_out", "Bytes written to mesh links (TLS payload)", &s.bytes_out),
            ("mesh_values_in", "Values received over the mesh and delivered here", &s.values_in),
            ("mesh_values_out", "Values sent over the mesh (a value sent again after a cut counts again)", &s.values_out),
            ("mesh_values_lost", "Values for another replica dropped: oldest first from a full mesh buffer (cluster.mesh_buffer), or unacknowledged in the buffer of a peer taken for gone", &s.lost),
            ("mesh_values_redispatched", "Shared group values in the buffer of a link that went down given to another member of the group (a value the peer had delivered may come twice)", &s.redispatched),
        ] {
            let _ = writeln!(out, "# HELP fleetmq_{name} {help}\n# TYPE fleetmq_{name} counter\nfleetmq_{name}_total {}", v.load(relaxed));
        }
        let _ = writeln!(out, "# HELP fleetmq_mesh_refused Mesh links refused, by reason\n# TYPE fleetmq_mesh_refused counter");
        for (why, n) in RefusedFor::ALL.iter().zip(&s.refused) {
            let _ = writeln!(out, "fleetmq_mesh_refused_total{{reason=\"{}\"}} {}", why.as_str(), n.load(relaxed));
        }
        let _ = writeln!(
            out,
            "# HELP fleetmq_mesh_peers_missing Live peers this replica has not linked to from every shard for the readiness grace\n# TYPE fleetmq_mesh_peers_missing gauge\nfleetmq_mesh_peers_missing {}",
            self.missing(Instant::now()).len()
        );
        let peers = s.linked();
        let _ = writeln!(out, "# HELP fleetmq_mesh_peer_links_up Links up to each peer replica\n# TYPE fleetmq_mesh_peer_links_up gauge");
        for (replica, p) in peers.iter() {
            let _ = writeln!(out, "fleetmq_mesh_peer_links_up{{peer=\"{replica}\"}} {}", p.links_up.load(relaxed));
        }
        let _ = writeln!(out, "# HELP fleetmq_mesh_buffer_bytes Bytes of values kept for each peer replica (unsent or unacknowledged)\n# TYPE fleetmq_mesh_buffer_bytes gauge");
        for (replica, p) in peers.iter() {
            let _ = writeln!(out, "fleetmq_mesh_buffer_bytes{{peer=\"{replica}\"}} {}", p.buffer_bytes.load(relaxed));
        }
    }
}

/// Checks the mesh settings of `settings` as the start does, without
/// binding (`fleetmq check-config`): `mesh_cert`, `mesh_key` and
/// `mesh_ca` readable, PEM, at most 1 MiB each, the certificate signed by
/// the CA and naming the replica ID (`cluster.replica_id`, else from the
/// host name), the key its pair. `mesh_listen` and `mesh_advertise` are
/// checked with the other ranges (`Settings::validate`).
///
/// # Errors
/// The first of these that fails, naming its key.
pub(crate) fn check(settings: &Settings) -> anyhow::Result<()> {
    let Some(cluster) = &settings.cluster else { return Ok(()) };
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    tls::MeshTls::load(cluster, &cluster.replica_id_or(host.trim()))?;
    Ok(())
}

/// The address to advertise: `mesh_advertise`, else the bound address,
/// with the host name instead of an unspecified IP.
fn advertised(advertise: &str, bound: SocketAddr) -> String {
    if !advertise.is_empty() {
        return advertise.to_owned();
    }
    if bound.ip().is_unspecified() {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        let host = host.trim();
        let host = if host.is_empty() { "localhost" } else { host };
        return format!("{host}:{}", bound.port());
    }
    bound.to_string()
}

/// A listening socket every shard binds (SO_REUSEPORT).
fn bind(addr: SocketAddr) -> std::io::Result<StdListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    socket.set_reuse_address(true)?;
    socket.set_reuse_port(true)?;
    socket.set_nodelay(true)?;
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(1024)?;
    Ok(socket.into())
}

#[cfg(test)]
mod tests {
    use super::{advertised, LogLimit, LOG_EVERY};
    use std::time::{Duration, Instant};

    #[test]
    fn a_refusal_is_logged_again_after_a_minute_and_another_reason_at_once() {
        let mut limit = LogLimit::default();
        let t = Instant::now();
        assert!(limit.due("10.0.0.1 certificate".into(), t));
        assert!(!limit.due("10.0.0.1 certificate".into(), t + Duration::from_secs(5)), "quiet within the minute");
        assert!(limit.due("10.0.0.1 protocol".into(), t + Duration::from_secs(5)), "another reason from the source");
        assert!(limit.due("10.0.0.2 certificate".into(), t + Duration::from_secs(5)), "another source");
        assert!(limit.due("10.0.0.1 certificate".into(), t + LOG_EVERY), "again after the minute, not never");
    }

    #[test]
    fn an_unspecified_listen_address_advertises_the_host_name() {
        assert_eq!(advertised("", "127.0.0.1:7884".parse().unwrap()), "127.0.0.1:7884");
        assert_eq!(advertised("m.example:1", "0.0.0.0:7884".parse().unwrap()), "m.example:1");
        let host = advertised("", "0.0.0.0:7884".parse().unwrap());
        assert!(host.ends_with(":7884") && !host.starts_with("0.0.0.0"), "{host}");
    }
}
