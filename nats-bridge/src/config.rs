//! What the bridge needs to start, and the two NATS connections.

use std::path::PathBuf;
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
/// `cluster.nats_urls`, or with `first` (one of them) to that one; after a
/// disconnect, to any of them again.
///
/// # Errors
/// [`StartError::Connect`] when no server answers within the connection
/// timeout (with `first`: when that one does not), or a credentials or
/// certificate file cannot be read.
pub(crate) async fn connect(cluster: &Cluster, name: String, first: Option<&str>) -> Result<Client, StartError> {
    let label = name.clone();
    let mut options = ConnectOptions::new()
        .event_callback(move |event| {
            // async-nats' own lines are filtered to warnings by default
            // (shards' main): these say what happened, naming the part.
            let label = label.clone();
            async move {
                match event {
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
        .connection_timeout(Duration::from_secs(5))
        .request_timeout(Some(JS_TIMEOUT))
        .max_reconnects(None);
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
    if let Some(first) = first {
        let first: async_nats::ServerAddr =
            first.parse().map_err(|e| StartError::Config(format!("cluster.nats_urls: {first:?}: {e}")))?;
        // Asked before every connection attempt, the first included: that
        // one goes to `first`, the others (reconnects) anywhere.
        let pending = std::sync::atomic::AtomicBool::new(true);
        options = options.reconnect_to_server_callback(move |_, _| {
            let pick = pending
                .swap(false, std::sync::atomic::Ordering::Relaxed)
                .then(|| async_nats::ReconnectToServer { addr: first.clone(), delay: Some(Duration::ZERO) });
            std::future::ready(pick)
        });
    }
    let urls: Vec<async_nats::ServerAddr> = cluster
        .nats_urls
        .iter()
        .map(|u| u.parse().map_err(|e| StartError::Config(format!("cluster.nats_urls: {u:?}: {e}"))))
        .collect::<Result<_, _>>()?;
    options
        .connect(urls)
        .await
        .map_err(|e| StartError::Connect(format!("{}: {e}", cluster.nats_urls.join(", "))))
}
