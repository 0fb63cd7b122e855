//! What every scenario shares: the process clock, executors (one glommio
//! LocalExecutor per `--threads`), the cross-thread counters, error counts,
//! local wake signals and the progress line.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::future::Future;
use std::io::IsTerminal;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use glommio::{LocalExecutorBuilder, Placement};

use crate::latency::Latency;
use crate::options::RunArgs;

static EPOCH: OnceLock<Instant> = OnceLock::new();

/// ns since the process clock started; the time base of every payload stamp.
pub fn now_ns() -> u64 {
    EPOCH.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// Counters shared by every executor and the coordinating main thread.
#[derive(Default)]
pub struct Shared {
    /// Start of the run (ns on [`now_ns`]'s clock); 0 until set.
    pub t0: AtomicU64,
    /// Publish-to-acknowledgement latency (PUBACK at QoS 1, PUBREC at QoS
    /// 2) of the measured messages, merged by each publisher when it ends.
    pub ack_latency: std::sync::Mutex<Latency>,
    /// Start of the measured interval, ns.
    pub measure_start: AtomicU64,
    /// End of the measured interval, ns.
    pub measure_end: AtomicU64,
    /// Set when setup failed somewhere: every executor gives up.
    pub abort: AtomicBool,
    /// Set when the run is over: every task finishes.
    pub stop: AtomicBool,
    /// Executors whose clients finished their setup.
    pub ready: AtomicUsize,
    /// The first setup error, for the message.
    pub setup_error: Mutex<Option<String>>,
    /// Messages published (queued for writing) in total, warm-up included.
    pub published: AtomicU64,
    /// Messages received per subscriber, warm-up included.
    pub received: Vec<AtomicU64>,
    /// Per subscriber: messages presumed lost after a window stall.
    pub forgiven: Vec<AtomicU64>,
    /// Messages stamped inside the measured interval, sent.
    pub sent_measured: AtomicU64,
    /// Deliveries of such messages, over all subscribers.
    pub received_measured: AtomicU64,
    /// Deliveries of such messages per subscriber.
    pub received_measured_by: Vec<AtomicU64>,
    /// PUBACK (QoS 1) or PUBCOMP (QoS 2) received by publishers.
    pub acked: AtomicU64,
    /// Publishers that stopped sending.
    pub publishers_finished: AtomicUsize,
    /// Connections that got a successful CONNACK.
    pub connected: AtomicU64,
    /// Connections that failed to open.
    pub failed: AtomicU64,
    errors: Mutex<BTreeMap<String, u64>>,
}

impl Shared {
    /// Counters for `subscribers` subscribers.
    pub fn new(subscribers: usize) -> Shared {
        Shared {
            ack_latency: std::sync::Mutex::new(Latency::default()),
            received: (0..subscribers).map(|_| AtomicU64::new(0)).collect(),
            forgiven: (0..subscribers).map(|_| AtomicU64::new(0)).collect(),
            received_measured_by: (0..subscribers).map(|_| AtomicU64::new(0)).collect(),
            ..Shared::default()
        }
    }

    /// Counts one error of `kind`.
    pub fn error(&self, kind: &str, n: u64) {
        let mut errors = self.errors.lock().unwrap_or_else(|e| e.into_inner());
        *errors.entry(kind.to_string()).or_default() += n;
    }

    /// Counts a client's error by its kind, and prints the first error of
    /// each kind in full on stderr (the summary shows only counts by
    /// kind; the text says what was wrong, e.g. which field of a packet).
    pub fn client_error(&self, e: &crate::client::ClientError) {
        let mut errors = self.errors.lock().unwrap_or_else(|e| e.into_inner());
        let count = errors.entry(e.kind().to_string()).or_default();
        if *count == 0 {
            eprintln!("fleetmq-loadgen: {e}");
        }
        *count += 1;
    }

    /// Errors by kind so far.
    pub fn errors(&self) -> BTreeMap<String, u64> {
        self.errors
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Records a setup failure and tells every executor to give up.
    pub fn fail_setup(&self, message: String) {
        let mut first = self.setup_error.lock().unwrap_or_else(|e| e.into_inner());
        first.get_or_insert(message);
        self.abort.store(true, Ordering::Release);
    }

    /// True once the run is over.
    pub fn stopped(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    /// Deliveries over all subscribers, warm-up included.
    pub fn received_total(&self) -> u64 {
        self.received
            .iter()
            .map(|r| r.load(Ordering::Relaxed))
            .sum()
    }

    /// Closed loop: how many more messages may be published before some
    /// subscriber has `window` outstanding.
    pub fn window_free(&self, window: u64) -> u64 {
        self.free_after(window, self.published.load(Ordering::Relaxed))
    }

    /// Closed loop: takes up to `most` messages of the window for one
    /// publisher, counting them as published at once, so publishers on
    /// other threads never see the same room (together they stay within
    /// `window`). Returns how many were taken; 0 when the window is full.
    pub fn window_reserve(&self, window: u64, most: u64) -> u64 {
        let mut published = self.published.load(Ordering::Relaxed);
        loop {
            let n = self.free_after(window, published).min(most);
            if n == 0 {
                return 0;
            }
            match self.published.compare_exchange_weak(
                published,
                published + n,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return n,
                Err(now) => published = now,
            }
        }
    }

    /// Room left in the window of the fullest subscriber once `published`
    /// messages were published.
    fn free_after(&self, window: u64, published: u64) -> u64 {
        let mut free = window;
        for (r, f) in self.received.iter().zip(&self.forgiven) {
            let done = r.load(Ordering::Relaxed) + f.load(Ordering::Relaxed);
            free = free.min(window.saturating_sub(published.saturating_sub(done)));
        }
        free
    }

    /// Waits (polling, 1 ms) until the coordinator sets the start time;
    /// `None` when the run was aborted.
    pub async fn wait_start(&self) -> Option<u64> {
        loop {
            if self.abort.load(Ordering::Acquire) {
                return None;
            }
            let t0 = self.t0.load(Ordering::Acquire);
            if t0 != 0 {
                return Some(t0);
            }
            glommio::timer::sleep(Duration::from_millis(1)).await;
        }
    }
}

/// What one executor hands back.
#[derive(Default)]
pub struct ThreadResult {
    /// Latencies it recorded.
    pub latency: Latency,
}

/// Runs `make(thread_index)` on `args.threads` executors, pinned per
/// `--cpu`; returns their join handles.
///
/// # Errors
/// When an executor cannot start (e.g. io_uring unavailable, bad CPU).
pub fn spawn_executors<F, Fut>(
    args: &RunArgs,
    make: F,
) -> anyhow::Result<Vec<glommio::ExecutorJoinHandle<ThreadResult>>>
where
    F: Fn(usize) -> Fut + Send + Sync + Clone + 'static,
    Fut: Future<Output = ThreadResult> + 'static,
{
    let mut handles = Vec::new();
    for t in 0..args.threads {
        let placement = match &args.cpu {
            Some(cpus) if !cpus.0.is_empty() => Placement::Fixed(cpus.0[t % cpus.0.len()]),
            _ => Placement::Unbound,
        };
        let make = make.clone();
        let handle = LocalExecutorBuilder::new(placement)
            .name(&format!("loadgen-{t}"))
            .spawn(move || make(t))
            .map_err(|e| anyhow::anyhow!("cannot start executor {t}: {e}"))?;
        handles.push(handle);
    }
    Ok(handles)
}

/// Joins the executors and merges their histograms.
pub fn join_executors(handles: Vec<glommio::ExecutorJoinHandle<ThreadResult>>) -> Latency {
    let mut all = Latency::default();
    for h in handles {
        if let Ok(r) = h.join() {
            all.merge(&r.latency);
        }
    }
    all
}

/// A wake-up for one waiting task on this executor (like a local Notify):
/// a notification before the wait is not lost.
#[derive(Default)]
pub struct Signal {
    set: Cell<bool>,
    waker: RefCell<Option<Waker>>,
}

impl Signal {
    /// Wakes the waiter, or lets the next wait return at once.
    pub fn notify(&self) {
        self.set.set(true);
        if let Some(w) = self.waker.borrow_mut().take() {
            w.wake();
        }
    }

    /// Waits for a notification.
    pub fn wait(&self) -> impl Future<Output = ()> + '_ {
        std::future::poll_fn(move |cx: &mut Context<'_>| {
            if self.set.replace(false) {
                Poll::Ready(())
            } else {
                *self.waker.borrow_mut() = Some(cx.waker().clone());
                Poll::Pending
            }
        })
    }
}

/// A wake-up for many waiting tasks on this executor: `wake_all` releases
/// everyone waiting at that moment.
#[derive(Default)]
pub struct Gate {
    generation: Cell<u64>,
    waiters: RefCell<Vec<Waker>>,
}

impl Gate {
    /// Releases every current waiter.
    pub fn wake_all(&self) {
        self.generation.set(self.generation.get() + 1);
        for w in self.waiters.borrow_mut().drain(..) {
            w.wake();
        }
    }

    /// True when some task waits.
    pub fn has_waiters(&self) -> bool {
        !self.waiters.borrow().is_empty()
    }

    /// Waits for the next [`Gate::wake_all`].
    pub fn wait(&self) -> GateWait<'_> {
        GateWait {
            gate: self,
            generation: self.generation.get(),
        }
    }
}

/// The future of [`Gate::wait`].
pub struct GateWait<'a> {
    gate: &'a Gate,
    generation: u64,
}

impl Future for GateWait<'_> {
    type Output = ();
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.gate.generation.get() != self.generation {
            Poll::Ready(())
        } else {
            self.gate.waiters.borrow_mut().push(cx.waker().clone());
            Poll::Pending
        }
    }
}

/// Prints a progress line on stderr every second while `running`, when
/// stderr is a terminal. `label` says what the counters count.
pub fn progress(
    shared: Arc<Shared>,
    running: Arc<AtomicBool>,
    connections: bool,
) -> Option<std::thread::JoinHandle<()>> {
    if !std::io::stderr().is_terminal() {
        return None;
    }
    std::thread::Builder::new()
        .name("loadgen-progress".into())
        .spawn(move || {
            let started = Instant::now();
            let (mut last_sent, mut last_recv) = (0u64, 0u64);
            while running.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_secs(1));
                let errors: u64 = shared.errors().values().sum();
                let t = started.elapsed().as_secs();
                if connections {
                    let c = shared.connected.load(Ordering::Relaxed);
                    eprint!("\r[{t:>4}s] connected {c}  failed {}  errors {errors}   ", shared.failed.load(Ordering::Relaxed));
                } else {
                    let sent = shared.published.load(Ordering::Relaxed);
                    let recv = shared.received_total();
                    eprint!(
                        "\r[{t:>4}s] sent {:>10.0} msg/s  received {:>10.0} msg/s  errors {errors}   ",
                        (sent - last_sent) as f64,
                        (recv - last_recv) as f64
                    );
                    (last_sent, last_recv) = (sent, recv);
                }
            }
            eprintln!();
        })
        .ok()
}

/// Raises the open-file limit to its hard maximum (idle runs hold
/// thousands of sockets).
pub fn raise_fd_limit() {
    // SAFETY: getrlimit/setrlimit write to and read from a valid struct.
    unsafe {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            let _ = libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

/// The resident set size of process `pid` from /proc/PID/status, KiB.
pub fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Publishers on several threads take room from one window at once:
    /// together they never take more than the window (the broker would
    /// count the excess as a slow subscriber's and drop QoS 0 messages).
    #[test]
    fn concurrent_publishers_never_take_more_than_the_window() {
        for _ in 0..50 {
            let shared = Arc::new(Shared::new(2));
            let taken: u64 = std::thread::scope(|s| {
                let threads: Vec<_> = (0..4)
                    .map(|_| {
                        let shared = shared.clone();
                        s.spawn(move || {
                            let mut mine = 0;
                            loop {
                                match shared.window_reserve(1000, 7) {
                                    0 => return mine,
                                    n => mine += n,
                                }
                            }
                        })
                    })
                    .collect();
                threads.into_iter().map(|t| t.join().unwrap()).sum()
            });
            assert_eq!(taken, 1000);
            assert_eq!(shared.published.load(Ordering::Relaxed), 1000);
            assert_eq!(shared.window_free(1000), 0);
            // One subscriber receives 400: the other still holds the window.
            shared.received[0].fetch_add(400, Ordering::Relaxed);
            assert_eq!(shared.window_reserve(1000, 7), 0);
            shared.received[1].fetch_add(300, Ordering::Relaxed);
            assert_eq!(shared.window_reserve(1000, 500), 300);
        }
    }
}
