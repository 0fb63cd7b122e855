//! One shard's life on its executor (DESIGN.md §3): the tasks that read
//! the other shards' channels, accept connections, flush cross-shard
//! batches and wake parked connections; the periodic duties of the tick;
//! and the stop.
//!
//! [`run_shard`] is the whole life in named steps; each step is a function
//! of its own so that a new concern (the cluster's mailboxes, a store)
//! adds a step instead of growing one body.

use std::os::fd::OwnedFd;
use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use futures_lite::StreamExt;
use glommio::channels::channel_mesh::Receivers;
use glommio::timer::sleep;
use tracing::warn;

use crate::connection::{handed_over, moved_in, resume, ConnSettings};
use crate::limits::ShardGate;
use crate::metrics::Metrics;
use crate::park::Parker;
use crate::shard::{Route, Shard, ShardMsg};
use crate::shutdown::Shutdown;
use crate::transport::ListenerKind;

/// How often a shard runs its tick (the duties of [`Tick`]) and checks the
/// shutdown flag.
pub(crate) const SHUTDOWN_POLL: Duration = Duration::from_millis(50);

/// A shard that ran tasks for less than 1/`QUIET_SHARE` of the last
/// second is quiet: it gives its freed memory back to the system at once.
const QUIET_SHARE: u32 = 20;

/// How long a stopping shard waits for its connections to flush and close.
const STOP_GRACE: Duration = Duration::from_secs(3);

/// What a shard needs besides its [`Shard`] and [`ConnSettings`].
pub(crate) struct ShardStart {
    /// The shard's own listening sockets (one per listener, SO_REUSEPORT).
    pub(crate) fds: Vec<(OwnedFd, ListenerKind)>,
    /// Fires when the broker stops.
    pub(crate) shutdown: Shutdown,
    /// Counted up once the shard accepts connections.
    pub(crate) started: Arc<AtomicUsize>,
    /// The replica's cluster, `None` on a single node.
    pub(crate) cluster: Option<Arc<crate::cluster::Node>>,
    /// The shard that publishes the `$SYS` topics gets the process's
    /// metrics and the interval (`server.sys_interval`).
    pub(crate) sys: Option<(Arc<Metrics>, Duration)>,
}

/// Run one shard until shutdown, then stop it: start its tasks, tick,
/// close every connection and wait (at most [`STOP_GRACE`]) for them.
pub(crate) async fn run_shard(
    shard: Rc<Shard>,
    settings: Rc<ConnSettings>,
    receivers: Receivers<ShardMsg>,
    start: ShardStart,
) {
    let ShardStart {
        fds,
        shutdown,
        started,
        cluster,
        sys,
    } = start;
    // The shard's pending connections and credential checks, for every
    // listener of the shard and the connections other shards hand it.
    let doors = ShardGate::new(settings.connect_timeout, shard.shards);
    spawn_inbox_readers(&shard, &settings, &doors, receivers);
    if let Some(node) = cluster {
        crate::cluster::spawn_events(shard.clone(), node);
    }
    crate::acceptor::spawn_acceptors(&shard, &settings, &doors, fds);
    spawn_flusher(&shard);
    let committer = shard.store.start();
    let parker = start_parker(&shard, &settings);
    started.fetch_add(1, Ordering::AcqRel);

    let mut tick = Tick::new(sys);
    while !shutdown.is_triggered() {
        sleep(SHUTDOWN_POLL).await;
        tick.run(&shard, &settings, parker.is_some());
    }
    stop_shard(&shard, &settings, parker.as_deref()).await;
    // What the connections appended is written before the shard ends.
    shard.store.stop();
    if let Some(committer) = committer {
        committer.await;
    }
}

/// One task per other shard, reading its channel in order.
fn spawn_inbox_readers(
    shard: &Rc<Shard>,
    settings: &Rc<ConnSettings>,
    doors: &Rc<ShardGate>,
    mut receivers: Receivers<ShardMsg>,
) {
    for (from, mut stream) in receivers.streams() {
        let (shard, settings, doors) = (shard.clone(), settings.clone(), doors.clone());
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
                    ShardMsg::Arrivals(arrivals) => {
                        for arrival in arrivals {
                            crate::arrival::arrived(&shard, &settings, &doors, arrival);
                        }
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
}

/// The flusher: sends what connections batched for the other shards once
/// the ready tasks of this turn have run (see `Shard::flush_soon`).
fn spawn_flusher(shard: &Rc<Shard>) {
    let shard = shard.clone();
    glommio::spawn_local(async move {
        loop {
            shard.flush_signal.wait().await;
            shard.flush().await;
        }
    })
    .detach();
}

/// The shard's [`Parker`] and the task that resumes the connections it
/// wakes; `None` (idle connections stay awake) when the system refused it.
fn start_parker(shard: &Rc<Shard>, settings: &Rc<ConnSettings>) -> Option<Rc<Parker>> {
    match Parker::start(shard.id) {
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
    }
}

/// The periodic duties of a shard, run every [`SHUTDOWN_POLL`]: the inbox
/// and the flush, load, deadlines, memory, `$SYS`, and once a second
/// session expiry and the refusal log.
struct Tick {
    last_tick: Instant,
    last_expiry: Instant,
    last_sys: Option<Instant>,
    /// Time spent running tasks since the last expiry pass.
    ran_since_expiry: Duration,
    sys: Option<(Arc<Metrics>, Duration)>,
    #[cfg(feature = "heap-census")]
    census_at: Vec<Instant>,
}

impl Tick {
    fn new(sys: Option<(Arc<Metrics>, Duration)>) -> Tick {
        // glommio's stats restart from zero at each read.
        let _ = glommio::executor().executor_stats();
        let now = Instant::now();
        Tick {
            last_tick: now,
            last_expiry: now,
            last_sys: None,
            ran_since_expiry: Duration::ZERO,
            sys,
            #[cfg(feature = "heap-census")]
            census_at: crate::census::due(now),
        }
    }

    fn run(&mut self, shard: &Shard, settings: &ConnSettings, park_idle: bool) {
        shard.poll_inbox();
        shard.try_flush();
        let now = Instant::now();
        let ran = glommio::executor().executor_stats().executor_runtime();
        self.ran_since_expiry += ran;
        let wall = now - std::mem::replace(&mut self.last_tick, now);
        shard.set_load((ran.as_micros() * 1000 / wall.as_micros().max(1)).min(1000) as u32);
        shard.check_deadlines(now);
        #[cfg(feature = "heap-census")]
        if self.census_at.last().is_some_and(|at| now >= *at) {
            self.census_at.pop();
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
        if let Some((metrics, interval)) = &self.sys {
            if self
                .last_sys
                .is_none_or(|at| now.duration_since(at) >= *interval)
            {
                self.last_sys = Some(now);
                shard.publish_sys(&metrics.totals());
                shard.try_flush();
            }
        }
        if now.duration_since(self.last_expiry) >= Duration::from_secs(1) {
            self.every_second(shard, settings, park_idle, now);
        }
    }

    fn every_second(
        &mut self,
        shard: &Shard,
        settings: &ConnSettings,
        park_idle: bool,
        now: Instant,
    ) {
        let quiet = self.ran_since_expiry < now.duration_since(self.last_expiry) / QUIET_SHARE;
        self.ran_since_expiry = Duration::ZERO;
        self.last_expiry = now;
        shard.expire(now, park_idle);
        shard.try_flush();
        if shard.id == 0 {
            settings.gate.log_pending_refusals(false);
        }
        if quiet {
            // A quiet shard (its connections idle or parked) returns what
            // it freed now rather than page by page: a forced collect also
            // frees the pages mimalloc keeps for reuse and purges without
            // waiting. It walks every page of this thread's heap, at most
            // once a second and only when quiet.
            crate::alloc::collect(true);
        }
    }
}

/// Close every connection (parked ones are resumed to be closed) and wait,
/// at most [`STOP_GRACE`], until they are gone and what is queued for the
/// other shards (a connection moving or handed over) is sent: they close
/// it themselves.
async fn stop_shard(shard: &Rc<Shard>, settings: &Rc<ConnSettings>, parker: Option<&Parker>) {
    // No connection lingers past the shard's stop (crate::closing).
    let stop_by = Instant::now() + STOP_GRACE;
    crate::closing::stop_by(stop_by);
    shard.stop_signal.notify();
    // Wills are not sent at a stop: in cluster mode they wait for their
    // clients elsewhere (DESIGN.md §5, will_stop_grace).
    crate::cluster::hand_over_wills();
    shard.close_all();
    for parked in parker.iter().flat_map(|p| p.stop()) {
        resume(shard.clone(), settings.clone(), parked, BytesMut::new());
    }
    while (shard.live_connections.get() > 0 || !shard.try_flush()) && Instant::now() < stop_by {
        sleep(Duration::from_millis(10)).await;
    }
}
