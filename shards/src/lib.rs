//! fleetmq-shards: the fleetmq server (DESIGN.md §2–§3).
//!
//! One glommio `LocalExecutor` per core ("shard"), each with its own
//! listener on the shared port (SO_REUSEPORT), its own subscription trie and
//! its own copy of the route table. [`server::run`] starts the shards and
//! the admin HTTP thread and returns when [`shutdown::Shutdown`] fires.

mod acceptor;
mod arrival;
mod access;
pub mod admin;
pub mod alloc;
pub mod auth;
mod cluster;
#[cfg(feature = "heap-census")]
mod census;
pub mod cert;
mod closing;
mod deferred;
pub mod config;
mod connection;
mod limits;
mod mesh;
pub mod metrics;
mod outbound;
mod park;
mod pending;
mod runtime;
pub mod server;
mod shard;
pub mod shutdown;
mod signal;
mod signin;
mod store;
pub mod tls;
mod transport;
pub mod ws;

/// Checks what of the mesh settings the start reads from files (the
/// certificates: readable, signed by `cluster.mesh_ca`, naming the
/// replica), for `fleetmq check-config`; nothing without a `[cluster]`
/// section or mesh certificates.
///
/// # Errors
/// The first problem, naming its key.
pub fn check_mesh(settings: &fleetmq_core::settings::Settings) -> anyhow::Result<()> {
    mesh::check(settings)
}

/// The shard, in `0..shards`, that owns `client_id`: where a connection
/// with that client identifier is served and its session kept, unless the
/// session was moved to its subscribers' shard (DESIGN.md §3, "Ownership
/// is explicit"). Stable for the process's life and across processes of
/// one build; for tests and tools that need to know where a client lands.
pub fn home_shard(client_id: &str, shards: usize) -> usize {
    shard::owner_of(client_id, shards)
}
