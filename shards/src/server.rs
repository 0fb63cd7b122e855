//! Starting and stopping the broker: listeners, shards, admin HTTP.

use std::io::Write as _;
use std::net::{SocketAddr, TcpListener as StdListener};
use std::os::fd::{FromRawFd, IntoRawFd, OwnedFd};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use fleetmq_core::session::{ConnectLimits, SessionLimits};
use fleetmq_core::settings::Settings;
use fleetmq_core::topic::TopicLimits;
use futures_lite::future::or;
use futures_lite::StreamExt;
use glommio::channels::channel_mesh::MeshBuilder;
use glommio::net::TcpListener;
use glommio::timer::sleep;
use glommio::{LocalExecutorBuilder, Placement};
use socket2::{Domain, Protocol, Socket, Type};
use tracing::{info, warn};

use crate::auth::Authenticator;
use crate::connection::{accepted, handed_over, moved_in, resume, ConnSettings};
use crate::limits::Gate;
use crate::metrics::Metrics;
use crate::park::Parker;
use crate::shard::{Global, Route, Shard, ShardLimits, ShardMsg};
use crate::shutdown::Shutdown;
use crate::tls::TlsConfig;
use crate::transport::ListenerKind;
use bytes::BytesMut;
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

/// How often a shard checks the shutdown flag.
const SHUTDOWN_POLL: Duration = Duration::from_millis(50);

/// A shard that ran tasks for less than 1/`QUIET_SHARE` of the last
/// second is quiet: it gives its freed memory back to the system at once.
const QUIET_SHARE: u32 = 20;

/// How long a stopping shard waits for its connections to flush and close.
const STOP_GRACE: Duration = Duration::from_secs(3);

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
    let cpus = allowed_cpus();
    let shards = if settings.server.shards == 0 {
        shards_per_core()
    } else {
        settings.server.shards
    };

    // Sign-in, access control and certificates, checked before binding.
    let auth = Arc::new(
        Authenticator::from_settings(&settings)
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

    // Bind each listener once per shard with SO_REUSEPORT; port 0 is
    // resolved by the first bind and reused by the others.
    let mut per_shard: Vec<Vec<(OwnedFd, ListenerKind)>> =
        (0..shards).map(|_| Vec::new()).collect();
    let mut bound = Vec::new();
    let listeners = [
        (ListenerKind::Tcp, "listeners.tcp", &settings.listeners.tcp),
        (ListenerKind::Tls, "listeners.tls", &settings.listeners.tls),
        (ListenerKind::Ws, "listeners.ws", &settings.listeners.ws),
        (ListenerKind::Wss, "listeners.wss", &settings.listeners.wss),
    ];
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
                let listener = bind_reuseport(addr)
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
    let reloader = spawn_reloader(auth.clone(), shutdown.clone())?;

    let metrics = Metrics::new(shards);
    let ready = Arc::new(AtomicBool::new(false));
    let admin = if settings.admin.listen.is_empty() {
        None
    } else {
        let addr: SocketAddr = settings
            .admin
            .listen
            .parse()
            .with_context(|| format!("admin.listen: bad address {}", settings.admin.listen))?;
        Some(
            crate::admin::spawn(addr, metrics.clone(), ready.clone())
                .context("cannot start the admin HTTP server")?,
        )
    };

    let limits = &settings.limits;
    let topic = TopicLimits {
        max_levels: limits.max_topic_levels as usize,
        max_bytes: limits.max_topic_bytes as usize,
    };
    let conn_settings = ConnSettings {
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
    };
    let shard_limits = ShardLimits {
        session: Arc::new(SessionLimits {
            receive_maximum: limits.receive_maximum,
            max_queue: limits.max_subscriber_queue as usize,
            max_subscriptions: limits.max_subscriptions_per_client as usize,
            topic,
            max_inflight: limits.max_client_writes_pending.min(u32::from(u16::MAX)) as u16,
            topic_alias_maximum: limits.topic_alias_maximum,
        }),
        max_offline_sessions: limits.max_offline_sessions as usize,
        max_client_writes_pending: limits.max_client_writes_pending as usize,
        max_client_write_bytes: limits.max_client_write_bytes,
        shared: settings.shared.clone(),
        move_publishers: settings.server.move_publishers,
    };

    let global = Arc::new(Global::new(shards));
    let mesh = MeshBuilder::<ShardMsg, _>::full(shards, SHARD_CHANNEL_CAPACITY);
    let started = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut handles = Vec::new();
    for (id, fds) in per_shard.into_iter().enumerate() {
        let cpu = cpus[id % cpus.len()];
        let (mesh, metrics_all) = (mesh.clone(), metrics.clone());
        let (metrics, global, shutdown) = (metrics.shard(id), global.clone(), shutdown.clone());
        let (conn_settings, shard_limits, started) =
            (conn_settings.clone(), shard_limits.clone(), started.clone());
        // Shard 0 publishes the $SYS topics.
        let sys = (id == 0).then(|| (metrics_all.clone(), settings.server.sys_interval));
        let handle = LocalExecutorBuilder::new(Placement::Fixed(cpu))
            .name(&format!("fleetmq-shard-{id}"))
            .io_memory(SHARD_IO_MEMORY)
            .spawn(move || async move {
                let (senders, receivers) = mesh.join().await.expect("the shard mesh forms");
                let shard = Rc::new(Shard::new(
                    id,
                    shards,
                    shard_limits,
                    metrics,
                    global,
                    senders,
                ));
                let settings = Rc::new(conn_settings);
                run_shard(shard, settings, fds, receivers, shutdown, started, sys).await;
            })
            .map_err(|e| anyhow::anyhow!("cannot start shard {id}: {e}"))?;
        handles.push(handle);
    }
    let start_by = Instant::now() + Duration::from_secs(10);
    while started.load(Ordering::Acquire) < shards {
        if Instant::now() > start_by {
            bail!("the shards did not start within 10 s");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    for (kind, addr) in &bound {
        announce(format_args!("fleetmq: listening {} {addr}", kind.name()));
        info!(target: "broker", %addr, shards, listener = kind.name(), "listening");
    }
    if let Some(admin) = &admin {
        announce(format_args!("fleetmq: listening admin {}", admin.local_addr));
    }
    // Ready for the admin endpoint first: whoever saw the line may ask
    // `/health/ready` at once (found as a 503 in an e2e test).
    ready.store(true, Ordering::Release);
    announce(format_args!("fleetmq: ready"));

    let mut failed = false;
    for handle in handles {
        if handle.join().is_err() {
            failed = true;
        }
    }
    ready.store(false, Ordering::Release);
    // What the last burst of refusals counted is in the log too.
    conn_settings.gate.log_pending_refusals(true);
    let _ = reloader.join();
    if let Some(admin) = admin {
        admin.stop();
    }
    info!(target: "broker", "stopped");
    if failed {
        bail!("a shard stopped with a panic");
    }
    Ok(())
}

/// Writes one start-up line (`fleetmq: listening …`, `fleetmq: ready`) to
/// stdout and flushes it. A closed stdout (`fleetmq serve | head -1`) is
/// not the broker's failure: the line is dropped (`println!` would panic
/// the main thread and stop the broker).
fn announce(line: std::fmt::Arguments<'_>) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}").and_then(|()| out.flush());
}

async fn run_shard(
    shard: Rc<Shard>,
    settings: Rc<ConnSettings>,
    fds: Vec<(OwnedFd, ListenerKind)>,
    mut receivers: glommio::channels::channel_mesh::Receivers<ShardMsg>,
    shutdown: Shutdown,
    started: Arc<std::sync::atomic::AtomicUsize>,
    sys: Option<(Arc<Metrics>, Duration)>,
) {
    for (from, mut stream) in receivers.streams() {
        let (shard, settings) = (shard.clone(), settings.clone());
        glommio::spawn_local(async move {
            while let Some(msg) = stream.next().await {
                // Connections are taken here, in channel order, before the
                // messages after them (see `shard::placement`).
                match msg {
                    ShardMsg::Handoff(handoff) => {
                        if let Route::NotHere(generation) = handoff.route {
                            shard.forget_moved(from, &handoff.negotiated.client_id, generation);
                        }
                        // Connection tasks are made aside (crate::alloc).
                        crate::alloc::spawn_aside(handed_over(
                            shard.clone(),
                            settings.clone(),
                            *handoff,
                        ));
                    }
                    ShardMsg::Move(moving) => {
                        if let Some(moved) = shard.move_in(from, *moving) {
                            moved_in(shard.clone(), settings.clone(), moved);
                        }
                    }
                    other => {
                        shard.on_remote(from, other);
                        shard.try_flush();
                    }
                }
            }
        })
        .detach();
    }
    for (fd, kind) in fds {
        // SAFETY: the fd is a listening socket we own.
        let listener = unsafe { TcpListener::from_raw_fd(std::os::fd::IntoRawFd::into_raw_fd(fd)) };
        let (shard, settings) = (shard.clone(), settings.clone());
        glommio::spawn_local(async move {
            loop {
                // The pending accept's poll is not aside: it lives until
                // the next connection arrives, and would hold a page of the
                // aside heap resident when the connections it let in have
                // parked (perf/RESULTS.md, 2026-12-02, session 17). The
                // stream is: it lives while the connection is awake.
                let accept = or(async { Some(listener.shared_accept().await) }, async {
                    shard.stop_signal.wait().await;
                    None
                });
                match accept.await {
                    Some(Ok(socket)) => {
                        let stream = crate::alloc::aside(|| socket.bind_to_executor());
                        // Connection tasks are made aside (crate::alloc):
                        // they end when their connection parks.
                        crate::alloc::spawn_aside(accepted(
                            shard.clone(),
                            settings.clone(),
                            stream,
                            kind,
                        ));
                    }
                    Some(Err(e)) => {
                        warn!(target: "broker", error = %e, "accept failed");
                        sleep(Duration::from_millis(10)).await;
                    }
                    None => break,
                }
            }
        })
        .detach();
    }
    // The flusher: sends what connections batched for the other shards
    // once the ready tasks of this turn have run (see `Shard::flush_soon`).
    {
        let shard = shard.clone();
        glommio::spawn_local(async move {
            loop {
                shard.flush_signal.wait().await;
                shard.flush().await;
            }
        })
        .detach();
    }
    let parker = match Parker::start(shard.id) {
        Ok(parker) => {
            let (shard, settings, waker) = (shard.clone(), settings.clone(), parker.clone());
            glommio::spawn_local(async move {
                loop {
                    let woken = waker.next_woken().await;
                    if woken.is_empty() {
                        break;
                    }
                    for parked in woken {
                        resume(shard.clone(), settings.clone(), parked, BytesMut::new());
                    }
                }
            })
            .detach();
            Some(parker)
        }
        Err(e) => {
            warn!(target: "broker", error = %e, "idle connections will not be parked");
            None
        }
    };
    started.fetch_add(1, Ordering::AcqRel);

    let mut last_expiry = Instant::now();
    let mut last_sys: Option<Instant> = None;
    // glommio's stats restart from zero at each read.
    let _ = glommio::executor().executor_stats();
    let mut last_tick = Instant::now();
    #[cfg(feature = "heap-census")]
    let mut census_at = crate::census::due(last_tick);
    // Time spent running tasks since the last expiry pass.
    let mut ran_since_expiry = Duration::ZERO;
    while !shutdown.is_triggered() {
        sleep(SHUTDOWN_POLL).await;
        shard.poll_inbox();
        shard.try_flush();
        let now = Instant::now();
        let ran = glommio::executor().executor_stats().executor_runtime();
        ran_since_expiry += ran;
        let wall = now - std::mem::replace(&mut last_tick, now);
        shard.set_load((ran.as_micros() * 1000 / wall.as_micros().max(1)).min(1000) as u32);
        shard.check_deadlines(now);
        #[cfg(feature = "heap-census")]
        if census_at.last().is_some_and(|at| now >= *at) {
            census_at.pop();
            crate::census::take(shard.id);
        }
        // Let mimalloc finish the frees other threads handed to this
        // thread's heap, free its empty pages and purge what is due. It
        // does so on its own only when this thread allocates again, which
        // a shard whose connections just parked may not do for seconds;
        // a busy shard allocates, so it is left alone. Not forced: purges
        // keep their delay (`MIMALLOC_PURGE_DELAY`).
        if ran < wall / 2 {
            crate::alloc::collect(false);
        }
        if let Some((metrics, interval)) = &sys {
            if last_sys.is_none_or(|at| now.duration_since(at) >= *interval) {
                last_sys = Some(now);
                shard.publish_sys(&metrics.totals());
                shard.try_flush();
            }
        }
        if now.duration_since(last_expiry) >= Duration::from_secs(1) {
            let quiet = ran_since_expiry < now.duration_since(last_expiry) / QUIET_SHARE;
            ran_since_expiry = Duration::ZERO;
            last_expiry = now;
            shard.expire(now, parker.is_some());
            shard.try_flush();
            if shard.id == 0 {
                settings.gate.log_pending_refusals(false);
            }
            if quiet {
                // A quiet shard (its connections idle or parked) returns
                // what it freed now rather than page by page: a forced
                // collect also frees the pages mimalloc keeps for reuse
                // and purges without waiting. It walks every page of this
                // thread's heap, at most once a second and only when quiet.
                crate::alloc::collect(true);
            }
        }
    }
    shard.stop_signal.notify();
    shard.close_all();
    for parked in parker.iter().flat_map(|p| p.stop()) {
        resume(shard.clone(), settings.clone(), parked, BytesMut::new());
    }
    // Also until what is queued for the other shards (a connection moving
    // or handed over) is sent: they close it themselves.
    let stop_by = Instant::now() + STOP_GRACE;
    while (shard.live_connections.get() > 0 || !shard.try_flush()) && Instant::now() < stop_by {
        sleep(Duration::from_millis(10)).await;
    }
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
    let handle = std::thread::Builder::new().name("fleetmq-reload".into()).spawn(move || {
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
fn refuse_if_listened_on(addr: SocketAddr) -> std::io::Result<()> {
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
fn bind_reuseport(addr: SocketAddr) -> std::io::Result<StdListener> {
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    socket.set_reuse_address(true)?;
    socket.set_reuse_port(true)?;
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
