//! `run SCENARIO`: the coordinating main thread. It starts the executors,
//! waits for every client's setup, sets the start time, watches the run,
//! drains, stops, and builds the [`Report`].

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::flow::{self, Plan};
use crate::options::{Rate, RunArgs, Scenario};
use crate::report::Report;
use crate::runtime::{join_executors, now_ns, progress, spawn_executors, Shared};
use crate::transport::TransportOptions;

/// Closed loop: a window full with no progress for this long counts its
/// messages as lost and frees it, so one lost QoS 0 message cannot stall a
/// run.
const STALL_NS: u64 = 500_000_000;

/// The drain after the measured interval ends when nothing moved for this
/// long, or after [`DRAIN_MAX_NS`].
const DRAIN_IDLE_NS: u64 = 1_000_000_000;
const DRAIN_MAX_NS: u64 = 10_000_000_000;

/// Why `run` failed before producing a report.
#[derive(Debug)]
pub enum RunError {
    /// The options do not fit together; exit 2.
    Usage(String),
    /// The scenario exists but is not implemented yet; exit 2.
    NotImplemented(&'static str),
    /// The broker could not be used (unreachable, refused); exit 1.
    Failed(String),
}

impl std::fmt::Display for RunError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RunError::Usage(m) | RunError::Failed(m) => f.write_str(m),
            RunError::NotImplemented(what) => write!(f, "{what} is not implemented yet"),
        }
    }
}

/// Runs one scenario to its report, over the transports its URLs name.
///
/// # Errors
/// [`RunError::Usage`] for options that do not fit together or TLS files
/// that do not load; [`RunError::Failed`] when nothing could be measured
/// (broker unreachable, TLS handshake or WebSocket upgrade failed, CONNACK
/// refused).
pub fn run(args: RunArgs) -> Result<Report, RunError> {
    args.check().map_err(RunError::Usage)?;
    let transport = args
        .transport
        .load(&args.client_urls().all())
        .map_err(RunError::Usage)?;
    now_ns();
    crate::runtime::raise_fd_limit();
    match args.scenario {
        Scenario::FanIn | Scenario::FanOut => run_flow(args, transport),
        Scenario::ConnectStorm | Scenario::Idle => crate::connections::run(args, transport),
        Scenario::Shared | Scenario::Persistent => {
            crate::verify::run(args.verify_config(&transport))
                .map_err(|e| RunError::Failed(format!("setup failed: {e}")))
        }
    }
}

/// Waits until every executor is ready; the setup error otherwise.
pub(crate) fn wait_ready(shared: &Shared, threads: usize) -> Result<(), String> {
    loop {
        if shared.abort.load(Ordering::Acquire) {
            let e = shared
                .setup_error
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone();
            return Err(e.unwrap_or_else(|| "setup failed".into()));
        }
        if shared.ready.load(Ordering::Acquire) >= threads {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Sets the start (5 ms from now) and the measured interval; returns t0.
pub(crate) fn start(shared: &Shared, args: &RunArgs) -> u64 {
    let t0 = now_ns() + 5_000_000;
    let from = t0 + args.warmup.as_nanos() as u64;
    shared.measure_start.store(from, Ordering::Release);
    shared
        .measure_end
        .store(from + args.duration.as_nanos() as u64, Ordering::Release);
    shared.t0.store(t0, Ordering::Release);
    t0
}

fn run_flow(args: RunArgs, transport: TransportOptions) -> Result<Report, RunError> {
    let plan = Arc::new(Plan {
        prefix: args.prefix(),
        publishers: args.publisher_count(),
        subscribers: args.subscriber_count(),
        urls: args.client_urls(),
        args: args.clone(),
        transport,
    });
    let shared = Arc::new(Shared::new(plan.subscribers));
    let handles = {
        let (plan, shared) = (plan.clone(), shared.clone());
        spawn_executors(&args, move |t| {
            flow::executor(plan.clone(), shared.clone(), t)
        })
        .map_err(|e| RunError::Failed(format!("{e:#}")))?
    };
    if let Err(e) = wait_ready(&shared, args.threads) {
        shared.stop.store(true, Ordering::Release);
        join_executors(handles);
        return Err(RunError::Failed(format!("setup failed: {e}")));
    }
    start(&shared, &args);
    let running = Arc::new(AtomicBool::new(true));
    let progress = progress(shared.clone(), running.clone(), false);
    watch(&shared, &args);
    drain(&shared, &plan);
    shared.stop.store(true, Ordering::Release);
    running.store(false, Ordering::Release);
    let latency = join_executors(handles);
    if let Some(p) = progress {
        let _ = p.join();
    }
    Ok(flow_report(&args, &plan, &shared, &latency))
}

/// Sleeps through the run; in closed loop, frees a window stalled by loss.
fn watch(shared: &Shared, args: &RunArgs) {
    let end = shared.measure_end.load(Ordering::Acquire);
    let mut last = (u64::MAX, u64::MAX);
    let mut last_change = now_ns();
    while now_ns() < end {
        std::thread::sleep(Duration::from_millis(10));
        if args.rate != Rate::Max {
            continue;
        }
        let now = (
            shared.published.load(Ordering::Relaxed),
            shared.received_total(),
        );
        let t = now_ns();
        if now != last {
            (last, last_change) = (now, t);
        } else if t - last_change > STALL_NS && shared.window_free(args.window) == 0 {
            let published = now.0;
            let mut lost = 0;
            for (r, f) in shared.received.iter().zip(&shared.forgiven) {
                let gap =
                    published.saturating_sub(r.load(Ordering::Relaxed) + f.load(Ordering::Relaxed));
                f.fetch_add(gap, Ordering::Relaxed);
                lost += gap;
            }
            shared.error("window stalled 0.5 s: messages presumed lost", lost);
            last_change = t;
        }
    }
}

/// After the measured interval: wait until every counted message arrived
/// and was acknowledged, or nothing moved for a second.
fn drain(shared: &Shared, plan: &Plan) {
    let qos0 = plan.args.qos == 0;
    let begin = now_ns();
    let mut last = (u64::MAX, u64::MAX, u64::MAX);
    let mut last_change = begin;
    loop {
        std::thread::sleep(Duration::from_millis(10));
        let sent = shared.sent_measured.load(Ordering::Relaxed);
        let received = shared.received_measured.load(Ordering::Relaxed);
        let acked = shared.acked.load(Ordering::Relaxed);
        let published = shared.published.load(Ordering::Relaxed);
        let finished = shared.publishers_finished.load(Ordering::Acquire) >= plan.publishers;
        if finished && received >= sent * plan.subscribers as u64 && (qos0 || acked >= published) {
            return;
        }
        let t = now_ns();
        if (sent, received, acked) != last {
            (last, last_change) = ((sent, received, acked), t);
        } else if t - last_change > DRAIN_IDLE_NS || t - begin > DRAIN_MAX_NS {
            return;
        }
    }
}

fn flow_report(
    args: &RunArgs,
    plan: &Plan,
    shared: &Shared,
    latency: &crate::latency::Latency,
) -> Report {
    let mut r = Report::new(args, latency);
    let secs = args.duration.as_secs_f64();
    r.publishers = plan.publishers;
    r.subscribers = plan.subscribers;
    r.sent = shared.sent_measured.load(Ordering::Relaxed);
    r.expected = r.sent * plan.subscribers as u64;
    r.received = shared.received_measured.load(Ordering::Relaxed);
    r.published_total = shared.published.load(Ordering::Relaxed);
    r.acked_total = shared.acked.load(Ordering::Relaxed);
    let acks = shared.ack_latency.lock().unwrap_or_else(|e| e.into_inner());
    r.ack_latency_us = (acks.count() > 0).then(|| acks.summary());
    drop(acks);
    r.sent_per_s = r.sent as f64 / secs;
    r.received_per_s = r.received as f64 / secs;
    r.throughput_per_s = r.received_per_s;
    r.errors = shared.errors();
    r.by_url = crate::report::by_url(
        &plan.urls,
        plan.publishers,
        &shared
            .received_measured_by
            .iter()
            .map(|n| n.load(Ordering::Relaxed))
            .collect::<Vec<_>>(),
    );
    let mut problems = Vec::new();
    if r.sent == 0 {
        problems.push("nothing was sent".to_string());
    }
    if args.qos > 0 {
        if r.received != r.expected {
            problems.push(format!(
                "received {} of {} expected at QoS {}",
                r.received, r.expected, args.qos
            ));
        }
        if r.acked_total != r.published_total {
            problems.push(format!(
                "{} of {} publishes acknowledged",
                r.acked_total, r.published_total
            ));
        }
    } else if r.received < r.expected {
        problems.push(format!(
            "lost {} of {} deliveries at QoS 0",
            r.expected - r.received,
            r.expected
        ));
    }
    let failed = crate::report::failed_mid_run(&r.errors);
    if failed > 0 {
        problems.push(format!(
            "{failed} connections failed mid-run (closed by the broker, socket errors, malformed or unexpected packets)"
        ));
    }
    if r.sent > 0 && r.received == 0 {
        problems.push("nothing was delivered".to_string());
    }
    if !problems.is_empty() {
        r.check = problems.join("; ");
        // QoS 0 loss alone is reported, not fatal; losing everything is.
        r.passed = args.qos == 0 && r.sent > 0 && r.received > 0 && failed == 0;
    }
    r
}
