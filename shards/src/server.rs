//! Starting and stopping the broker: listeners, shards, admin HTTP.

use std::io::Write as _;
use std::net::{SocketAddr, TcpListener as StdListener};
use std::os::fd::{FromRawFd, IntoRawFd, OwnedFd};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use fleetmq_core::session::{ConnectLimits, SessionLimits};
use fleetmq_core::settings::Settings;
use fleetmq_core::topic::TopicLimits;
use glommio::channels::channel_mesh::MeshBuilder;
use glommio::{LocalExecutorBuilder, Placement};
use socket2::{Domain, Protocol, Socket, Type};
use tracing::info;

use crate::auth::Authenticator;
use crate::connection::ConnSettings;
use crate::limits::Gate;
use crate::metrics::Metrics;
use crate::runtime::{run_shard, ShardStart, SHUTDOWN_POLL};
use crate::shard::{Global, Shard, ShardLimits, ShardMsg};
use crate::shutdown::Shutdown;
use crate::tls::TlsConfig;
use crate::transport::ListenerKind;
use fleetmq_core::session::AuthorizeCache;

/// Capacity of each cross-shard channel, in messages (each message is a
/// batch of deliveries or one control message).
const SHARD_CHANNEL_CAPACITY: usize = 1024;

/// Bytes of io_uring registered buffers per shard (glommio's `io_memory`).
/// glommio draws them only for file reads and DMA buffers, which the
/// broker does not use (sockets read into their own buffers, the wake-up
/// `eventfd` into its source); its default of 10 MiB was registered with
/// the rings, so pinned and resident, on every shard. When the pool is
/// used up glommio takes buffers from the heap instead.
const SHARD_IO_MEMORY: usize = 64 << 10;

/// Run the broker with `settings` until `shutdown` fires: bind every
/// listener (port 0 picks a free port, shared by all shards), start the
/// admin HTTP server and one shard per core (or `server.shards`), print one
/// `fleetmq: listening <kind> <addr>` line per listener and `fleetmq:
/// ready` on stdout, then serve.
///
/// # Errors
/// A listener or the admin port cannot be bound, or a shard cannot start.
pub fn run(settings: Settings, shutdown: Shutdown) -> anyhow::Result<()> {
    raise_fd_limit(settings.limits.max_clients as u64);
    let shards = shard_count(&settings);
    let (auth, tls) = load_security(&settings)?;
    // Before listening: a store another process holds stops the start.
    let mut opened = crate::store::open_if_local(&settings.store)?;
    let _store_lock = opened.as_mut().and_then(|o| o.take_lock());
    let listeners = bind_listeners(&settings, shards)?;
    let reloader = spawn_reloader(auth.clone(), shutdown.clone())?;
    let metrics = Metrics::with_sign_in(shards, auth.sign_in_metrics());
    let store = opened.map(|o| crate::store::LocalStart::new(o, &settings.store, &metrics, shards));
    let compactor = match &store {
        Some(local) => Some(local.start_compactor(shutdown.clone()).context("cannot start the store's compactor")?),
        None => None,
    };
    let ready = Arc::new(AtomicBool::new(false));
    let cluster = start_cluster(&settings, shards, &metrics)?;
    let admin = start_admin(&settings, &metrics, &ready)?;
    let conn_settings = conn_settings(&settings, auth, tls, cluster.clone());
    let plan = ShardPlan {
        shards,
        conn_settings: conn_settings.clone(),
        limits: shard_limits(&settings),
        cluster: cluster.clone(),
        metrics,
        shutdown,
        sys_interval: settings.server.sys_interval,
        store,
        ingest: settings.store.kind == fleetmq_core::settings::StoreKind::Jetstream,
    };
    let handles = start_shards(plan, listeners.per_shard)?;
    announce_ready(&listeners.bound, admin.as_ref(), shards, &ready);
    if let Some(node) = &cluster {
        crate::cluster::announce_when_ready(node);
    } else {
        announce(format_args!("fleetmq: ready"));
    }

    let mut failed = false;
    for handle in handles {
        if handle.join().is_err() {
            failed = true;
        }
    }
    ready.store(false, Ordering::Release);
    if let Some(compactor) = compactor {
        compactor.stop();
    }
    // What the last burst of refusals counted is in the log too.
    conn_settings.gate.log_pending_refusals(true);
    let _ = reloader.join();
    if let Some(cluster) = cluster {
        cluster.stop();
    }
    if let Some(admin) = admin {
        admin.stop();
    }
    info!(target: "broker", "stopped");
    if failed {
        bail!("a shard stopped with a panic");
    }
    Ok(())
}

/// The shard count: `server.shards`, or one per CPU when it is 0.
fn shard_count(settings: &Settings) -> usize {
    if settings.server.shards == 0 {
        shards_per_core()
    } else {
        settings.server.shards
    }
}

/// Join the cluster when `[cluster]` is set (DESIGN.md §4–§5): the NATS
/// bridge starts, checks JetStream and establishes membership before the
/// shards accept connections.
///
/// # Errors
/// NATS cannot be reached or a start-up check refused.
fn start_cluster(
    settings: &Settings,
    shards: usize,
    metrics: &Arc<Metrics>,
) -> anyhow::Result<Option<Arc<crate::cluster::Node>>> {
    if settings.cluster.is_none() {
        return Ok(None);
    }
    let node = crate::cluster::Node::start(settings, shards)?;
    metrics.set_cluster(node.clone());
    Ok(Some(node))
}

/// Sign-in, access control and certificates, loaded before binding.
fn load_security(
    settings: &Settings,
) -> anyhow::Result<(Arc<Authenticator>, Option<Arc<TlsConfig>>)> {
    let auth = Arc::new(
        Authenticator::from_settings(settings)
            .context("cannot load the authentication settings")?,
    );
    let needs_tls = !settings.listeners.tls.is_empty() || !settings.listeners.wss.is_empty();
    let tls = if needs_tls {
        Some(Arc::new(TlsConfig::new(&settings.tls).context(
            "cannot load the TLS certificate (tls.cert, tls.key)",
        )?))
    } else {
        None
    };
    Ok((auth, tls))
}

/// Every MQTT listener, bound once per shard.
struct Listeners {
    /// Each shard's sockets, in shard order.
    per_shard: Vec<Vec<(OwnedFd, ListenerKind)>>,
    /// Each listener's kind and address (its port resolved), for the
    /// start-up lines.
    bound: Vec<(ListenerKind, SocketAddr)>,
}

/// Bind each listener once per shard with SO_REUSEPORT; port 0 is resolved
/// by the first bind and reused by the others.
fn bind_listeners(settings: &Settings, shards: usize) -> anyhow::Result<Listeners> {
    let mut per_shard: Vec<Vec<(OwnedFd, ListenerKind)>> =
        (0..shards).map(|_| Vec::new()).collect();
    let mut bound = Vec::new();
    let listeners = [
        (ListenerKind::Tcp, "listeners.tcp", &settings.listeners.tcp),
        (ListenerKind::Tls, "listeners.tls", &settings.listeners.tls),
        (ListenerKind::Ws, "listeners.ws", &settings.listeners.ws),
        (ListenerKind::Wss, "listeners.wss", &settings.listeners.wss),
    ];
    // A silent connection the kernel holds may wait up to KERNEL_WAIT_MAX
    // before it is accepted: with a shorter connect_timeout it would stay
    // open past it, so the hold is only asked for with a long enough one.
    let defer = settings.limits.connect_timeout >= crate::deferred::KERNEL_WAIT_MAX;
    for (kind, key, addrs) in listeners {
        for addr in addrs {
            let mut addr: SocketAddr = addr
                .parse()
                .with_context(|| format!("{key}: bad address {addr}"))?;
            if addr.port() != 0 {
                refuse_if_listened_on(addr)
                    .with_context(|| format!("cannot listen on {addr} ({key})"))?;
            }
            for fds in per_shard.iter_mut() {
                let listener = bind_reuseport(addr, defer)
                    .with_context(|| format!("cannot listen on {addr} ({key})"))?;
                addr = listener.local_addr()?;
                // SAFETY: into_raw_fd hands over ownership of a valid fd.
                fds.push((
                    unsafe { OwnedFd::from_raw_fd(listener.into_raw_fd()) },
                    kind,
                ));
            }
            bound.push((kind, addr));
        }
    }
    Ok(Listeners { per_shard, bound })
}

/// The admin HTTP server on `admin.listen`, or `None` when it is empty.
fn start_admin(
    settings: &Settings,
    metrics: &Arc<Metrics>,
    ready: &Arc<AtomicBool>,
) -> anyhow::Result<Option<crate::admin::AdminHandle>> {
    if settings.admin.listen.is_empty() {
        return Ok(None);
    }
    let addr: SocketAddr = settings
        .admin
        .listen
        .parse()
        .with_context(|| format!("admin.listen: bad address {}", settings.admin.listen))?;
    let admin = crate::admin::spawn(addr, metrics.clone(), ready.clone())
        .context("cannot start the admin HTTP server")?;
    Ok(Some(admin))
}

/// What every connection task reads: the CONNECT limits, sign-in, TLS and
/// the admission gate, from `settings.limits` and `settings.auth`.
fn conn_settings(
    settings: &Settings,
    auth: Arc<Authenticator>,
    tls: Option<Arc<TlsConfig>>,
    cluster: Option<Arc<crate::cluster::Node>>,
) -> ConnSettings {
    let limits = &settings.limits;
    let topic = topic_limits(settings);
    ConnSettings {
        connect: ConnectLimits {
            receive_maximum: limits.receive_maximum,
            max_packet_size: limits.max_packet_size,
            max_keep_alive: limits.max_keep_alive.as_secs().min(u64::from(u16::MAX)) as u16,
            max_session_expiry: limits.max_session_expiry.as_secs().min(u64::from(u32::MAX)) as u32,
            topic,
            topic_alias_maximum: limits.topic_alias_maximum,
        },
        max_connect_packet_bytes: limits.max_connect_packet_bytes.min(limits.max_packet_size),
        connect_timeout: limits.connect_timeout,
        max_clients: limits.max_clients as usize,
        auth,
        tls,
        gate: Gate::new(
            limits.max_pending_connections as usize,
            limits.max_connects_authenticating as usize,
            limits
                .trust_client_addresses
                .then_some(limits.max_connections_per_source as usize),
            limits.max_connections_per_credential as usize,
        ),
        acl_cache: AuthorizeCache {
            ttl: settings.auth.acl_cache_ttl,
            ..AuthorizeCache::default()
        },
        cluster,
    }
}

fn topic_limits(settings: &Settings) -> TopicLimits {
    TopicLimits {
        max_levels: settings.limits.max_topic_levels as usize,
        max_bytes: settings.limits.max_topic_bytes as usize,
    }
}

/// What each shard's sessions and queues may hold, from `settings.limits`.
fn shard_limits(settings: &Settings) -> ShardLimits {
    let limits = &settings.limits;
    ShardLimits {
        session: Arc::new(SessionLimits {
            receive_maximum: limits.receive_maximum,
            max_queue: limits.max_subscriber_queue as usize,
            max_subscriptions: limits.max_subscriptions_per_client as usize,
            topic: topic_limits(settings),
            max_inflight: limits.max_client_writes_pending.min(u32::from(u16::MAX)) as u16,
            topic_alias_maximum: limits.topic_alias_maximum,
        }),
        max_offline_sessions: limits.max_offline_sessions as usize,
        max_client_writes_pending: limits.max_client_writes_pending as usize,
        max_client_write_bytes: limits.max_client_write_bytes,
        shared: settings.shared.clone(),
        // A moved session leaves its client identifier's home shard, where
        // the cluster's take-over events arrive: not in cluster mode.
        move_publishers: settings.server.move_publishers && settings.cluster.is_none(),
    }
}

/// What [`start_shards`] gives every shard.
struct ShardPlan {
    shards: usize,
    conn_settings: ConnSettings,
    limits: ShardLimits,
    metrics: Arc<Metrics>,
    shutdown: Shutdown,
    cluster: Option<Arc<crate::cluster::Node>>,
    /// `server.sys_interval`, for the shard that publishes `$SYS`.
    sys_interval: Duration,
    /// The local store, opened and recovered (`store.kind = "local"`).
    store: Option<Arc<crate::store::LocalStart>>,
    /// `store.kind = "jetstream"`: QoS 1/2 values go to the ingest stream.
    ingest: bool,
}

/// How long [`start_shards`] waits for every shard to accept connections.
const SHARD_START_WAIT: Duration = Duration::from_secs(10);

/// Start one executor per shard, each pinned to a CPU this process may run
/// on, and wait until every one accepts connections.
///
/// # Errors
/// An executor cannot be made, or the shards did not start within
/// [`SHARD_START_WAIT`].
fn start_shards(
    plan: ShardPlan,
    per_shard: Vec<Vec<(OwnedFd, ListenerKind)>>,
) -> anyhow::Result<Vec<glommio::ExecutorJoinHandle<()>>> {
    let cpus = allowed_cpus();
    let shards = plan.shards;
    let global = Arc::new(Global::new(shards));
    let mesh = MeshBuilder::<ShardMsg, _>::full(shards, SHARD_CHANNEL_CAPACITY);
    let started = Arc::new(AtomicUsize::new(0));
    // Shards that restored what the local store recovered (see below).
    let restored = Arc::new(AtomicUsize::new(0));
    let mut handles = Vec::new();
    for (id, fds) in per_shard.into_iter().enumerate() {
        let cpu = cpus[id % cpus.len()];
        let (mesh, global, restored) = (mesh.clone(), global.clone(), restored.clone());
        let (conn_settings, limits) = (plan.conn_settings.clone(), plan.limits.clone());
        let metrics = plan.metrics.shard(id);
        let local = plan.store.clone();
        let clustered = plan.cluster.is_some();
        let ingest = plan.ingest;
        let start = ShardStart {
            fds,
            shutdown: plan.shutdown.clone(),
            started: started.clone(),
            cluster: plan.cluster.clone(),
            // Shard 0 publishes the $SYS topics.
            sys: (id == 0).then(|| (plan.metrics.clone(), plan.sys_interval)),
        };
        let handle = LocalExecutorBuilder::new(Placement::Fixed(cpu))
            .name(&format!("fleetmq-shard-{id}"))
            .io_memory(SHARD_IO_MEMORY)
            .spawn(move || async move {
                let (senders, receivers) = mesh.join().await.expect("the shard mesh forms");
                let store = crate::store::ShardStore::new(id, local.as_deref(), clustered, ingest);
                let shard = Rc::new(Shard::new(id, shards, limits, metrics, global, senders, store));
                if let Some(local) = local {
                    shard.restore(&local.opened.recovered, crate::store::unix_ms());
                }
                // No shard takes connections before every shard restored
                // its sessions: their subscriptions' routes are in every
                // inbox by then, so a value published at once reaches a
                // recovered subscriber on another shard (before, a shard
                // that restored sooner routed it to nobody live: it was
                // logged, and delivered only after the next restart).
                restored.fetch_add(1, Ordering::AcqRel);
                while restored.load(Ordering::Acquire) < shards {
                    glommio::timer::sleep(Duration::from_millis(1)).await;
                }
                run_shard(shard, Rc::new(conn_settings), receivers, start).await;
            })
            .map_err(|e| anyhow::anyhow!("cannot start shard {id}: {e}"))?;
        handles.push(handle);
    }
    let start_by = Instant::now() + SHARD_START_WAIT;
    while started.load(Ordering::Acquire) < shards {
        if Instant::now() > start_by {
            bail!("the shards did not start within 10 s");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(handles)
}

/// Print the listening lines and turn readiness on (the caller prints
/// `fleetmq: ready`).
fn announce_ready(
    bound: &[(ListenerKind, SocketAddr)],
    admin: Option<&crate::admin::AdminHandle>,
    shards: usize,
    ready: &AtomicBool,
) {
    for (kind, addr) in bound {
        announce(format_args!("fleetmq: listening {} {addr}", kind.name()));
        info!(target: "broker", %addr, shards, listener = kind.name(), "listening");
    }
    if let Some(admin) = admin {
        announce(format_args!(
            "fleetmq: listening admin {}",
            admin.local_addr
        ));
    }
    // Ready for the admin endpoint first: whoever saw the line may ask
    // `/health/ready` at once (found as a 503 in an e2e test). In cluster
    // mode it answers the cluster's reason while there is one.
    ready.store(true, Ordering::Release);
}

/// Writes one start-up line (`fleetmq: listening …`, `fleetmq: ready`) to
/// stdout and flushes it. A closed stdout (`fleetmq serve | head -1`) is
/// not the broker's failure: the line is dropped (`println!` would panic
/// the main thread and stop the broker).
pub(crate) fn announce(line: std::fmt::Arguments<'_>) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}").and_then(|()| out.flush());
}

/// How often the reloader looks at the password, ACL and JWKS files.
const RELOAD_POLL: Duration = Duration::from_secs(2);

/// A thread that re-reads the password, ACL and key files on SIGHUP and
/// when one of them changes (modification time or size), until shutdown.
/// The TLS certificate reloads itself on change (see [`TlsConfig`]).
fn spawn_reloader(
    auth: Arc<Authenticator>,
    shutdown: Shutdown,
) -> anyhow::Result<std::thread::JoinHandle<()>> {
    let hup = Arc::new(AtomicBool::new(false));
    signal_hook::flag::register(signal_hook::consts::SIGHUP, hup.clone())
        .context("cannot watch SIGHUP")?;
    let stamp = |files: &[std::path::PathBuf]| -> Vec<Option<(std::time::SystemTime, u64)>> {
        files
            .iter()
            .map(|f| {
                std::fs::metadata(f)
                    .ok()
                    .and_then(|m| Some((m.modified().ok()?, m.len())))
            })
            .collect()
    };
    let files = auth.watched_files();
    let mut last = stamp(&files);
    let handle = std::thread::Builder::new()
        .name("fleetmq-reload".into())
        .spawn(move || {
            let mut waited = Duration::ZERO;
            while !shutdown.is_triggered() {
                std::thread::sleep(SHUTDOWN_POLL);
                waited += SHUTDOWN_POLL;
                let signalled = hup.swap(false, Ordering::AcqRel);
                if !signalled && waited < RELOAD_POLL {
                    continue;
                }
                waited = Duration::ZERO;
                let now = stamp(&files);
                if signalled || now != last {
                    last = now;
                    // A file that fails is logged by `reload` (each one, with
                    // the previous data kept).
                    if auth.reload().is_ok() {
                        info!(target: "broker", signalled, "reloaded password, ACL and key files");
                    }
                }
            }
        })?;
    Ok(handle)
}

/// Fails with `AddrInUse` when a socket already listens on `addr`.
///
/// The shards' sockets share their port through `SO_REUSEPORT`, which lets
/// any other socket with that option, of the same user, join the group:
/// a second broker started on the same port would start silently and take
/// part of the connections. A bind without `SO_REUSEPORT` cannot join a
/// listening group, so it fails when anything listens there, a fleetmq
/// of an earlier start included (and, done by a later start, when this
/// one listens). `SO_REUSEADDR` lets it pass connections of an earlier
/// run that linger in `TIME_WAIT`. The probe is closed before the shards
/// bind: a listener that appears in between is not seen.
///
/// A broker that was just stopped (a restart) holds its listening sockets
/// for some milliseconds after its process ends (io_uring releases them
/// after the process): the probe tries again for up to
/// [`LISTENER_RELEASE_WAIT`] before it gives up.
pub(crate) fn refuse_if_listened_on(addr: SocketAddr) -> std::io::Result<()> {
    let give_up = Instant::now() + LISTENER_RELEASE_WAIT;
    loop {
        let probe = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
        probe.set_reuse_address(true)?;
        match probe.bind(&addr.into()) {
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && Instant::now() < give_up => {
                std::thread::sleep(Duration::from_millis(20));
            }
            result => return result,
        }
    }
}

/// How long [`refuse_if_listened_on`] waits for a listener that is going
/// away (the stopped broker of a restart): its sockets were seen to linger
/// 10–20 ms after its exit; a listener still there after this is taken to
/// be live.
const LISTENER_RELEASE_WAIT: Duration = Duration::from_secs(1);

/// A listening socket on `addr` that every shard binds (`SO_REUSEPORT`:
/// the kernel spreads new connections over the shards' sockets).
///
/// Its accept queue is as long as the kernel allows
/// (`net.core.somaxconn`, 4096 by default): a fleet reconnecting at once
/// sends SYNs faster than a shard accepts, and each one the queue drops
/// costs its client a SYN retransmission, one second later at the least.
/// Measured with 1,024: a storm of 10,000 connections at 100,000/s on one
/// shard overflowed the queue 143 and 333 times in two runs, and none
/// with somaxconn (perf/RESULTS.md, 2026-12-02, session 16).
///
/// `TCP_NODELAY` is set here once: Linux copies it to each connection the
/// socket accepts, which saves a `setsockopt` per connection
/// (`crate::acceptor`).
///
/// `TCP_DEFER_ACCEPT` keeps a connection that has sent nothing out of the
/// accept queue for [`crate::deferred::DEFER_ACCEPT`]: every MQTT client
/// speaks first, so a storm's connections reach the broker with their
/// CONNECT (or ClientHello, or WebSocket upgrade), and a load generator
/// that opens its sockets faster than it writes their CONNECTs no longer
/// fills `limits.max_pending_connections` with sockets that look silent
/// and are evicted as such (perf/RESULTS.md, 2026-12-06, session 37).
/// Silent connections come in only after that second, already old enough
/// to give way to others (`crate::pending`). `defer` false leaves it
/// off: with `limits.connect_timeout` under
/// [`crate::deferred::KERNEL_WAIT_MAX`] the kernel could hold a silent
/// connection (two SYN-ACKs when the accept queue was full) past the
/// timeout.
fn bind_reuseport(addr: SocketAddr, defer: bool) -> std::io::Result<StdListener> {
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    socket.set_reuse_address(true)?;
    socket.set_reuse_port(true)?;
    socket.set_nodelay(true)?;
    if defer {
        crate::deferred::set_defer_accept(&socket)?;
    }
    socket.bind(&addr.into())?;
    // Linux caps the backlog at `net.core.somaxconn`.
    socket.listen(libc::c_int::MAX)?;
    Ok(socket.into())
}

/// The shard count `server.shards = 0` (the default) starts in this
/// process: one per CPU it may run on (honours `taskset`), at least 1.
#[must_use]
pub fn shards_per_core() -> usize {
    allowed_cpus().len().max(1)
}

/// The CPUs this process may run on (honours `taskset`), in order.
fn allowed_cpus() -> Vec<usize> {
    // SAFETY: a zeroed cpu_set_t is valid; sched_getaffinity fills it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return vec![0];
        }
        let cpus: Vec<usize> = (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &set))
            .collect();
        if cpus.is_empty() {
            vec![0]
        } else {
            cpus
        }
    }
}

/// Raise the open-file limit towards `max_clients` plus headroom, and the
/// locked-memory limit that glommio's io_uring rings need. Best effort.
fn raise_fd_limit(max_clients: u64) {
    // SAFETY: plain getrlimit/setrlimit on local structs.
    unsafe {
        let mut lim: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 {
            let target = (max_clients + 1024).min(lim.rlim_max);
            if lim.rlim_cur < target {
                lim.rlim_cur = target;
                let _ = libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
            }
        }
        let unlimited = libc::rlimit {
            rlim_cur: libc::RLIM_INFINITY,
            rlim_max: libc::RLIM_INFINITY,
        };
        let _ = libc::setrlimit(libc::RLIMIT_MEMLOCK, &unlimited);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepted_connections_have_tcp_nodelay_from_the_listening_socket() {
        let listener = bind_reuseport("127.0.0.1:0".parse().unwrap(), true).unwrap();
        let _client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (accepted, _) = listener.accept().unwrap();
        assert!(accepted.nodelay().unwrap(), "no setsockopt per connection needed");
    }
}
