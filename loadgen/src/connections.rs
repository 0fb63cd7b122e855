//! Connection scenarios: `connect-storm` (open `--connections` at
//! `--connect-rate` per second on a fixed schedule, CONNACK latency from
//! the scheduled time; or, with `--connect-window N`, as fast as the
//! broker answers with at most N under way, latency from each one's
//! start) and `idle` (the same, then hold them with keep-alive and report
//! the broker's RSS per connection).

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use fleetmq_core::packet::Packet;
use glommio::timer::sleep;

use crate::client::{ClientError, Conn};
use crate::latency::Latency;
use crate::options::{RunArgs, Scenario};
use crate::report::{ConnectionFigures, Report};
use crate::runtime::{
    join_executors, now_ns, progress, rss_kib, spawn_executors, Shared, ThreadResult,
};
use crate::scenario::{start, wait_ready, RunError};
use crate::schedule::Schedule;
use crate::transport::TransportOptions;

/// How often a held connection wakes to look at the stop flag.
const HOLD_POLL: Duration = Duration::from_secs(1);

/// Time for the broker's memory to settle after the last connection.
const SETTLE: Duration = Duration::from_secs(1);

/// Runs `connect-storm` or `idle`, connecting over `transport`.
///
/// # Errors
/// [`RunError::Usage`] when `--broker-pid` names no readable process,
/// [`RunError::Failed`] when no connection could be made.
pub fn run(args: RunArgs, transport: TransportOptions) -> Result<Report, RunError> {
    let rss_before = match args.broker_pid {
        Some(pid) => Some(rss_kib(pid).ok_or_else(|| {
            RunError::Usage(format!(
                "--broker-pid {pid}: cannot read /proc/{pid}/status"
            ))
        })?),
        None => None,
    };
    let shared = Arc::new(Shared::new(0));
    let handles = {
        let (args, shared) = (Arc::new(args.clone()), shared.clone());
        spawn_executors(&args.clone(), move |t| {
            executor(args.clone(), transport.clone(), shared.clone(), t)
        })
        .map_err(|e| RunError::Failed(format!("{e:#}")))?
    };
    wait_ready(&shared, args.threads).map_err(RunError::Failed)?;
    let t0 = start(&shared, &args);
    let running = Arc::new(AtomicBool::new(true));
    let progress = progress(shared.clone(), running.clone(), true);
    let target = args.connections;
    // Closed loop: at least 1,000 connections a second, else the schedule.
    let rate = if args.connect_window > 0 { 1_000 } else { args.connect_rate };
    let deadline = t0
        + (target as f64 / rate as f64 * 1e9) as u64
        + 2 * args.connect_timeout.as_nanos() as u64
        + 1_000_000_000;
    let mut last_connack = t0;
    loop {
        let (ok, failed) = (
            shared.connected.load(Ordering::Acquire),
            shared.failed.load(Ordering::Acquire),
        );
        if ok + failed >= target || now_ns() > deadline {
            break;
        }
        last_connack = now_ns();
        std::thread::sleep(Duration::from_millis(1));
    }
    let connected_in_s = (last_connack.saturating_sub(t0)) as f64 / 1e9;
    let mut figures = ConnectionFigures {
        target,
        connected: shared.connected.load(Ordering::Acquire),
        failed: shared.failed.load(Ordering::Acquire),
        ..Default::default()
    };
    if args.scenario == Scenario::Idle && figures.connected > 0 {
        hold(&shared, args.duration.max(SETTLE));
        if let (Some(pid), Some(before)) = (args.broker_pid, rss_before) {
            let after = rss_kib(pid);
            figures.broker_rss_before_kib = Some(before);
            figures.broker_rss_after_kib = after;
            figures.broker_kib_per_connection =
                after.map(|a| (a as f64 - before as f64) / figures.connected as f64);
        }
    }
    shared.stop.store(true, Ordering::Release);
    running.store(false, Ordering::Release);
    let latency = join_executors(handles);
    if let Some(p) = progress {
        let _ = p.join();
    }
    if figures.connected == 0 {
        let first = shared
            .setup_error
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        return Err(RunError::Failed(format!(
            "no connection succeeded: {}",
            first.unwrap_or_default()
        )));
    }
    let mut r = Report::new(&args, &latency);
    figures.connect_per_s = if connected_in_s > 0.0 {
        figures.connected as f64 / connected_in_s
    } else {
        0.0
    };
    r.measured_s = connected_in_s;
    r.throughput_per_s = figures.connect_per_s;
    r.errors = shared.errors();
    let dropped = crate::report::failed_mid_run(&r.errors);
    if figures.connected < target {
        r.check = format!(
            "{} of {target} connections failed",
            target - figures.connected
        );
        r.passed = false;
    } else if dropped > 0 {
        r.check = format!("{dropped} connections failed while held (closed by the broker, socket errors, malformed or unexpected packets)");
        r.passed = false;
    }
    r.connections = Some(figures);
    Ok(r)
}

async fn executor(
    args: Arc<RunArgs>,
    transport: TransportOptions,
    shared: Arc<Shared>,
    thread: usize,
) -> ThreadResult {
    shared.ready.fetch_add(1, Ordering::AcqRel);
    let Some(t0) = shared.wait_start().await else {
        return ThreadResult::default();
    };
    let client = Rc::new(Client {
        shared,
        latency: RefCell::new(Latency::default()),
        opts: args.connect_options(args.keep_alive, &transport),
        urls: args.urls.clone(),
        hold: args.scenario == Scenario::Idle,
        prefix: args.client_id_prefix(),
        session: args
            .keep_session
            .then(|| args.protocol.version().is_v5().then_some(args.session_expiry)),
    });
    let mine = (thread as u64..args.connections).step_by(args.threads);
    let mut tasks = Vec::new();
    if args.connect_window > 0 {
        // Closed loop: this thread's share of the window, each worker
        // taking the thread's next connection as its last one is answered.
        let workers = args.connect_window.div_ceil(args.threads as u64).max(1);
        let next = Rc::new(RefCell::new(mine));
        for _ in 0..workers {
            let (client, next) = (client.clone(), next.clone());
            tasks.push(glommio::spawn_local(async move {
                loop {
                    let Some(c) = next.borrow_mut().next() else { break };
                    let conn = client.connect(c, now_ns()).await;
                    if let Some(conn) = conn.filter(|_| client.hold) {
                        // Held in a task of its own: the worker goes on.
                        let client = client.clone();
                        glommio::spawn_local(async move { client.hold(conn).await }).detach();
                    }
                }
            }));
        }
    } else {
        let schedule = Schedule::new(args.connect_rate, 1, 0);
        for c in mine {
            let client = client.clone();
            let due = t0 + schedule.due_at(c);
            tasks.push(glommio::spawn_local(async move {
                let now = now_ns();
                if due > now {
                    sleep(Duration::from_nanos(due - now)).await;
                }
                if let Some(conn) = client.connect(c, due).await {
                    client.hold(conn).await;
                }
            }));
        }
    }
    for t in tasks {
        t.await;
    }
    // Held connections (closed loop) end at the stop flag.
    while client.hold && !client.shared.stopped() {
        sleep(Duration::from_millis(50)).await;
    }
    let latency = client.latency.take();
    ThreadResult { latency }
}

/// What an executor's connections share.
struct Client {
    shared: Arc<Shared>,
    latency: RefCell<Latency>,
    opts: crate::client::ConnectOptions,
    urls: Vec<crate::transport::url::BrokerUrl>,
    /// `idle`: connections are held after CONNACK.
    hold: bool,
    prefix: String,
    /// `--keep-session`: Clean Start 0, with on MQTT 5 a Session Expiry
    /// Interval (`Some(None)` on 3.1.1, which has none).
    session: Option<Option<u32>>,
}

impl Client {
    /// Connection `c`, counted and its CONNACK latency recorded from
    /// `since` (ns); `None` when it failed (counted too).
    async fn connect(&self, c: u64, since: u64) -> Option<Conn> {
        let url = &self.urls[c as usize % self.urls.len()];
        let id = format!("{}-c{c}", self.prefix);
        let connected = match self.session {
            Some(expiry) => Conn::connect_session(url, &id, &self.opts, false, expiry).await,
            None => Conn::connect(url, &id, &self.opts).await,
        };
        match connected {
            Ok(conn) => {
                self.latency.borrow_mut().record_ns(now_ns().saturating_sub(since));
                self.shared.connected.fetch_add(1, Ordering::AcqRel);
                Some(conn)
            }
            Err(e) => {
                self.shared.client_error(&e);
                self.shared.fail_setup(format!("{}: {e}", url.text));
                self.shared.failed.fetch_add(1, Ordering::AcqRel);
                None
            }
        }
    }

    /// `idle`: holds `conn` until the run stops; `connect-storm`: drops it.
    async fn hold(&self, conn: Conn) {
        if self.hold {
            if let Err(e) = hold_idle(conn, &self.shared, self.opts.keep_alive).await {
                self.shared.client_error(&e);
            }
        }
    }
}

/// How long `idle` keeps holding once a held connection failed, so that
/// the failures of the others (a broker that died closes them all) are
/// counted before the run ends.
const FAILURE_GRACE: Duration = Duration::from_secs(1);

/// Waits `duration` while the connections are held, or until
/// [`FAILURE_GRACE`] after the first held connection failed: the check
/// fails then anyway, and waiting out a long `--duration` would only hide
/// it.
fn hold(shared: &Shared, duration: Duration) {
    let until = std::time::Instant::now() + duration;
    let mut failing_since = None;
    while std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_millis(50));
        if crate::report::failed_mid_run(&shared.errors()) > 0 {
            let since = *failing_since.get_or_insert_with(std::time::Instant::now);
            if since.elapsed() >= FAILURE_GRACE {
                return;
            }
        }
    }
}

/// Holds an idle connection until the run stops: PINGREQ every half
/// Keep Alive, answers read and dropped.
async fn hold_idle(mut conn: Conn, shared: &Shared, keep_alive: u16) -> Result<(), ClientError> {
    let _ = conn.stream.set_read_timeout(Some(HOLD_POLL));
    let ping_every = u64::from(keep_alive) * 500_000_000;
    let mut last_ping = now_ns();
    while !shared.stopped() {
        match conn.fill().await {
            Ok(_) => while conn.decode_buffered()?.is_some() {},
            Err(ClientError::Timeout(_)) => {}
            Err(_) if shared.stopped() => return Ok(()),
            Err(e) => return Err(e),
        }
        if ping_every > 0 && now_ns() - last_ping >= ping_every {
            conn.send(&Packet::PingReq).await?;
            last_ping = now_ns();
        }
    }
    Ok(())
}
