//! Checked flows: `run persistent`, `run shared` and `soak`. Every message
//! is accounted for: per publisher, which sequence numbers arrived, which
//! twice, which out of order.
//!
//! These scenarios are about correctness over time rather than peak rate,
//! so they use plain std threads and blocking sockets (one thread per
//! client) with the same codec and PUBLISH template as the glommio flows:
//! simple to reason about, and every wait has a deadline.
//!
//! - publishers `{prefix}/{i}` publish at `--qos`, open loop at `--rate` or
//!   closed loop under `--window` (published but not yet received, per
//!   tracker), with at most 1000 (or Receive Maximum) unacknowledged each;
//! - `persistent`: each subscriber keeps a session (clean start 0, Session
//!   Expiry for MQTT 5), disconnects every `--reconnect-every` and stays away
//!   `--offline-for`, expecting `session present` when it comes back;
//! - `shared`: N members of `$share/{group}/{prefix}/+`; each message must
//!   reach exactly one member;
//! - `soak`: subscribers on `{prefix}/+`, one line every `--report-every`.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::BytesMut;
use bytestring::ByteString;
use fleetmq_core::packet::codec::{decode, encode};
use fleetmq_core::packet::{Connect, Disconnect, Packet, ProtocolVersion, QoS};
use serde::{Deserialize, Serialize};

use crate::client::{
    connect_properties, put_response, stamp, ClientError, ConnectOptions,
};
use crate::inflight::SeqSet;
use crate::latency::Latency;
use crate::options::{BrokerUrl, Rate};
use crate::report::Report;
use crate::runtime::now_ns;
use crate::transport::sync_stream::{self, SyncStream};
use crate::transport::tls::classify_io;

mod publisher;

use publisher::{connect_again, publisher};

/// Messages written per publisher turn at most.
const BATCH: u64 = 64;
/// Unacknowledged QoS 1/2 publishes per publisher at most.
const MAX_INFLIGHT: u64 = 1000;
/// How long a blocked read waits before looking at the flags again.
const POLL: Duration = Duration::from_millis(20);
/// The drain ends when nothing arrived for this long (and every subscriber
/// is online), or after [`DRAIN_MAX`].
const DRAIN_IDLE: Duration = Duration::from_secs(2);
const DRAIN_MAX: Duration = Duration::from_secs(15);
/// With `--through-restarts`: a broker just started may take a while to
/// recover and resend what its sessions hold, so the drain waits longer
/// before it counts a value as missing.
const RESTART_DRAIN_IDLE: Duration = Duration::from_secs(10);
const RESTART_DRAIN_MAX: Duration = Duration::from_secs(60);

/// A client of a checked flow, by role and index.
#[derive(Debug, Clone, Copy)]
enum Client {
    Subscriber(usize),
    Publisher(usize),
}

/// Which checked flow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Persistent-session subscribers that reconnect on a schedule.
    Persistent,
    /// Members of one shared-subscription group.
    Shared,
    /// Plain subscribers, interval reports.
    Soak,
}

/// What a checked flow needs to know.
#[derive(Debug, Clone)]
pub struct VerifyConfig {
    /// The flow.
    pub mode: Mode,
    /// Scenario name for the report.
    pub scenario: String,
    /// The options as given, for the report.
    pub options: serde_json::Value,
    /// Where each publisher and subscriber connects.
    pub urls: crate::options::Urls,
    /// CONNECT options (version, credentials, timeout).
    pub connect: ConnectOptions,
    /// QoS of publishes and subscriptions.
    pub qos: u8,
    /// Payload bytes (≥ 16).
    pub payload_size: usize,
    /// Offered rate.
    pub rate: Rate,
    /// Closed loop: published but not yet received per tracker, at most.
    pub window: u64,
    /// How long the publishers run.
    pub duration: Duration,
    /// Publishers.
    pub publishers: usize,
    /// Subscribers (shared: group members).
    pub subscribers: usize,
    /// Topic prefix.
    pub prefix: String,
    /// Client identifiers' prefix: `{client_id_prefix}-{tag}{i}`.
    pub client_id_prefix: String,
    /// Shared subscription group name.
    pub share_group: String,
    /// Persistent: time connected between disconnects.
    pub reconnect_every: Duration,
    /// Persistent: time away.
    pub offline_for: Duration,
    /// Persistent, MQTT 5: Session Expiry Interval, s.
    pub session_expiry: u32,
    /// Soak: interval report period.
    pub report_every: Option<Duration>,
    /// Soak: keep going through broker restarts (sessions kept, clients
    /// reconnect, publishers resend what is unacknowledged).
    pub through_restarts: bool,
}

impl VerifyConfig {
    fn filter(&self) -> String {
        match self.mode {
            Mode::Shared => format!("$share/{}/{}/+", self.share_group, self.prefix),
            _ => format!("{}/+", self.prefix),
        }
    }

    /// One tracker per subscriber, or one for the whole group.
    fn trackers(&self) -> usize {
        match self.mode {
            Mode::Shared => 1,
            _ => self.subscribers,
        }
    }

    fn tracker_of(&self, subscriber: usize) -> usize {
        match self.mode {
            Mode::Shared => 0,
            _ => subscriber,
        }
    }
}

// ---------------------------------------------------------------------------
// Accounting

/// What one arrival was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arrival {
    /// First time this sequence number arrived.
    New,
    /// It arrived before.
    Duplicate,
}

/// Per-publisher accounting of one logical receiver (a subscriber, or a
/// whole shared group).
#[derive(Debug, Default, Clone)]
pub struct Tracker {
    seen: Vec<SeqSet>,
    /// Distinct messages received.
    pub distinct: u64,
    /// Arrivals of messages already received.
    pub duplicates: u64,
}

impl Tracker {
    /// A tracker for `publishers` publishers.
    pub fn new(publishers: usize) -> Tracker {
        Tracker {
            seen: vec![SeqSet::default(); publishers],
            ..Tracker::default()
        }
    }

    /// Records message `k` of `publisher`; `None` for an unknown publisher.
    pub fn record(&mut self, publisher: usize, k: u64) -> Option<Arrival> {
        if self.seen.get_mut(publisher)?.insert(k) {
            self.distinct += 1;
            Some(Arrival::New)
        } else {
            self.duplicates += 1;
            Some(Arrival::Duplicate)
        }
    }

    /// Messages missing given how many each publisher sent.
    pub fn missing(&self, sent: &[u64]) -> u64 {
        self.seen
            .iter()
            .zip(sent)
            .map(|(s, &n)| n - s.count_below(n))
            .sum()
    }

    /// Gaps so far: messages below the highest arrived per publisher that
    /// have not arrived (yet).
    pub fn holes(&self) -> u64 {
        self.seen.iter().map(SeqSet::holes).sum()
    }

    /// Values of publisher `publisher` in `acked` (acknowledged to it)
    /// that never arrived here.
    pub fn lost_of(&self, publisher: usize, acked: &SeqSet) -> u64 {
        self.seen
            .get(publisher)
            .map_or(0, |seen| acked.not_in(seen))
    }
}

/// Per-publisher order as one connection-holding subscriber sees it: a new
/// message numbered below the highest already seen is a violation.
#[derive(Debug, Default)]
pub struct OrderCheck {
    highest: Vec<Option<u64>>,
}

impl OrderCheck {
    /// For `publishers` publishers.
    pub fn new(publishers: usize) -> OrderCheck {
        OrderCheck {
            highest: vec![None; publishers],
        }
    }

    /// Records a *new* arrival; true when it breaks the order.
    pub fn violates(&mut self, publisher: usize, k: u64) -> bool {
        let Some(h) = self.highest.get_mut(publisher) else {
            return false;
        };
        match *h {
            Some(max) if k < max => true,
            _ => {
                *h = Some(k);
                false
            }
        }
    }
}

// ---------------------------------------------------------------------------
// A blocking client

/// A blocking MQTT connection (std socket, TCP, TLS or WebSocket, read
/// deadlines).
pub struct SyncConn {
    stream: SyncStream,
    buf: BytesMut,
    scratch: Vec<u8>,
    out: BytesMut,
    version: ProtocolVersion,
    max_packet_size: usize,
    /// CONNACK's Session Present.
    pub session_present: bool,
    /// Receive Maximum announced by the broker.
    pub receive_maximum: u16,
}

impl SyncConn {
    /// Connects to `url` (TCP, then TLS and the WebSocket upgrade as its
    /// scheme says) and waits for a successful CONNACK.
    ///
    /// # Errors
    /// Connect, TLS, WebSocket, refusal, timeout or I/O errors.
    pub fn connect(
        url: &BrokerUrl,
        client_id: &str,
        o: &ConnectOptions,
        clean_start: bool,
        session_expiry: Option<u32>,
    ) -> Result<SyncConn, ClientError> {
        let stream = sync_stream::open(url, &o.transport, o.timeout)?;
        let mut conn = SyncConn {
            stream,
            buf: BytesMut::with_capacity(4096),
            scratch: vec![0; 64 * 1024],
            out: BytesMut::new(),
            version: o.version,
            max_packet_size: o.max_packet_size,
            session_present: false,
            receive_maximum: u16::MAX,
        };
        let connect = Connect {
            protocol: o.version,
            clean_start,
            keep_alive: 0,
            client_id: ByteString::from(client_id),
            will: None,
            username: o.username.as_deref().map(ByteString::from),
            password: o
                .password
                .as_ref()
                .map(|p| bytes::Bytes::from(p.clone().into_bytes())),
            properties: connect_properties(o, session_expiry),
        };
        conn.send(&Packet::Connect(Box::new(connect)))?;
        match conn.next_within(o.timeout, "CONNACK")? {
            Packet::ConnAck(ack) if ack.reason.is_error() => {
                Err(ClientError::Refused(format!("{}", ack.reason)))
            }
            Packet::ConnAck(ack) => {
                conn.session_present = ack.session_present;
                if let Some(m) = ack.properties.receive_maximum {
                    conn.receive_maximum = m;
                }
                Ok(conn)
            }
            _ => Err(ClientError::Unexpected("expected CONNACK")),
        }
    }

    /// Subscribes and waits for a successful SUBACK.
    ///
    /// # Errors
    /// Refusal, timeout or I/O errors.
    pub fn subscribe(
        &mut self,
        filter: &str,
        qos: QoS,
        timeout: Duration,
    ) -> Result<(), ClientError> {
        self.send(&crate::client::subscribe_packet(filter, qos))?;
        let deadline = now_ns() + timeout.as_nanos() as u64;
        loop {
            let left = Duration::from_nanos(deadline.saturating_sub(now_ns()));
            match self.next_within(left, "SUBACK")? {
                Packet::SubAck(ack) => {
                    return match ack.reasons.first() {
                        Some(r) if !r.is_error() => Ok(()),
                        Some(r) => Err(ClientError::SubscribeRefused(format!("{filter}: {r}"))),
                        None => Err(ClientError::Unexpected("SUBACK without reason codes")),
                    }
                }
                // Only fresh sessions subscribe, so nothing is queued yet.
                Packet::Publish(_) | Packet::PubRel(_) => {
                    return Err(ClientError::Unexpected("PUBLISH before SUBACK"))
                }
                _ => {}
            }
        }
    }

    /// Encodes and writes one packet.
    ///
    /// # Errors
    /// I/O errors.
    pub fn send(&mut self, p: &Packet) -> Result<(), ClientError> {
        self.out.clear();
        encode(p, self.version, &mut self.out)
            .map_err(|_| ClientError::Unexpected("cannot encode"))?;
        self.stream.write_all(&self.out).map_err(classify_io)
    }

    /// Writes raw bytes.
    ///
    /// # Errors
    /// I/O errors.
    pub fn write(&mut self, bytes: &[u8]) -> Result<(), ClientError> {
        self.stream.write_all(bytes).map_err(classify_io)
    }

    fn next_within(
        &mut self,
        timeout: Duration,
        what: &'static str,
    ) -> Result<Packet, ClientError> {
        let deadline = now_ns() + timeout.as_nanos() as u64;
        loop {
            if let Some(p) = self.decode()? {
                return Ok(p);
            }
            let left = deadline.saturating_sub(now_ns());
            let got = left > 0 && self.fill(Duration::from_nanos(left))?;
            if !got && now_ns() >= deadline {
                return Err(ClientError::Timeout(what));
            }
        }
    }

    /// Decodes the next buffered packet.
    ///
    /// # Errors
    /// Malformed bytes.
    pub fn decode(&mut self) -> Result<Option<Packet>, ClientError> {
        decode(&mut self.buf, Some(self.version), self.max_packet_size).map_err(ClientError::Decode)
    }

    /// Reads once, waiting at most `timeout`; false when nothing came.
    ///
    /// # Errors
    /// End of stream or I/O errors.
    pub fn fill(&mut self, timeout: Duration) -> Result<bool, ClientError> {
        match self.stream.read_within(&mut self.scratch, timeout) {
            Ok(None) => Ok(false),
            Ok(Some(0)) => Err(ClientError::Closed),
            Ok(Some(n)) => {
                self.buf.extend_from_slice(&self.scratch[..n]);
                Ok(true)
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => Ok(false),
            Err(e) => Err(classify_io(e)),
        }
    }

    /// Sends DISCONNECT (normal) and closes, ignoring errors.
    pub fn disconnect(mut self) {
        let _ = self.send(&Packet::Disconnect(Disconnect::default()));
        self.stream.shutdown();
    }
}

// ---------------------------------------------------------------------------
// The run

/// State shared by every client thread and the coordinator.
struct Ctx {
    cfg: VerifyConfig,
    /// Start of publishing, ns; 0 until set.
    t0: AtomicU64,
    /// End of publishing, ns.
    end: AtomicU64,
    /// Set when publishing is over: subscribers stop disconnecting.
    publishing_done: AtomicBool,
    stop: AtomicBool,
    abort: AtomicBool,
    fatal: Mutex<Option<String>>,
    errors: Mutex<BTreeMap<String, u64>>,
    /// Per publisher: messages written.
    sent: Vec<AtomicU64>,
    published: AtomicU64,
    acked: AtomicU64,
    trackers: Vec<Mutex<Tracker>>,
    /// Per tracker: distinct received (for the closed-loop window).
    distinct: Vec<AtomicU64>,
    /// Per subscriber: deliveries (duplicates included).
    deliveries: Vec<AtomicU64>,
    order_violations: AtomicU64,
    reconnects: AtomicU64,
    sessions_lost: AtomicU64,
    /// Per publisher: sequence numbers the broker acknowledged (PUBACK,
    /// or PUBREC at QoS 2).
    acked_values: Vec<Mutex<SeqSet>>,
    /// Duplicate arrivals by the QoS they were delivered at.
    duplicates_by_qos: [AtomicU64; 3],
    /// Per subscriber: connected now.
    online: Vec<AtomicBool>,
    /// Per subscriber: latencies since the last interval report.
    interval: Vec<Mutex<Latency>>,
    /// Subscribers subscribed and ready.
    ready: AtomicU64,
}

impl Ctx {
    fn error(&self, kind: &str) {
        let mut e = self.errors.lock().unwrap_or_else(|e| e.into_inner());
        *e.entry(kind.to_string()).or_default() += 1;
    }

    fn fail(&self, message: String) {
        self.fatal
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_or_insert(message);
        self.abort.store(true, Ordering::Release);
    }

    fn over(&self) -> bool {
        self.stop.load(Ordering::Acquire) || self.abort.load(Ordering::Acquire)
    }

    fn url(&self, client: Client) -> &BrokerUrl {
        match client {
            Client::Subscriber(j) => self.cfg.urls.subscriber(j),
            Client::Publisher(i) => self.cfg.urls.publisher(i),
        }
    }

    fn window_free(&self) -> u64 {
        let published = self.published.load(Ordering::Relaxed);
        self.distinct
            .iter()
            .map(|d| {
                self.cfg
                    .window
                    .saturating_sub(published.saturating_sub(d.load(Ordering::Relaxed)))
            })
            .min()
            .unwrap_or(0)
    }

    fn sent_now(&self) -> Vec<u64> {
        self.sent
            .iter()
            .map(|s| s.load(Ordering::Relaxed))
            .collect()
    }
}

/// Runs a checked flow to its report.
///
/// # Errors
/// A message when the clients could not be set up (unreachable broker,
/// refused CONNACK or SUBACK).
pub fn run(cfg: VerifyConfig) -> Result<Report, String> {
    now_ns();
    let (subs, pubs) = (cfg.subscribers, cfg.publishers);
    let ctx = Arc::new(Ctx {
        t0: AtomicU64::new(0),
        end: AtomicU64::new(0),
        publishing_done: AtomicBool::new(false),
        stop: AtomicBool::new(false),
        abort: AtomicBool::new(false),
        fatal: Mutex::new(None),
        errors: Mutex::new(BTreeMap::new()),
        sent: (0..pubs).map(|_| AtomicU64::new(0)).collect(),
        published: AtomicU64::new(0),
        acked: AtomicU64::new(0),
        trackers: (0..cfg.trackers())
            .map(|_| Mutex::new(Tracker::new(pubs)))
            .collect(),
        distinct: (0..cfg.trackers()).map(|_| AtomicU64::new(0)).collect(),
        deliveries: (0..subs).map(|_| AtomicU64::new(0)).collect(),
        order_violations: AtomicU64::new(0),
        reconnects: AtomicU64::new(0),
        sessions_lost: AtomicU64::new(0),
        acked_values: (0..pubs).map(|_| Mutex::new(SeqSet::default())).collect(),
        duplicates_by_qos: Default::default(),
        online: (0..subs).map(|_| AtomicBool::new(false)).collect(),
        interval: (0..subs).map(|_| Mutex::new(Latency::default())).collect(),
        ready: AtomicU64::new(0),
        cfg,
    });
    let mut sub_threads = Vec::new();
    for j in 0..subs {
        let ctx = ctx.clone();
        sub_threads.push(spawn(format!("lg-sub-{j}"), move || subscriber(&ctx, j)));
    }
    let setup_time = 2 * ctx.cfg.connect.timeout.as_nanos() as u64 + 1_000_000_000;
    let mut pub_threads = Vec::new();
    if wait_ready(&ctx, subs as u64, setup_time) {
        for i in 0..pubs {
            let ctx = ctx.clone();
            pub_threads.push(spawn(format!("lg-pub-{i}"), move || publisher(&ctx, i)));
        }
        wait_ready(&ctx, (subs + pubs) as u64, setup_time);
    }
    let finish = |ctx: &Ctx,
                  subs: Vec<std::thread::JoinHandle<Latency>>,
                  pubs: Vec<std::thread::JoinHandle<()>>| {
        ctx.publishing_done.store(true, Ordering::Release);
        for p in pubs {
            let _ = p.join();
        }
        ctx.stop.store(true, Ordering::Release);
        let mut all = Latency::default();
        for s in subs {
            if let Ok(l) = s.join() {
                all.merge(&l);
            }
        }
        all
    };
    if ctx.abort.load(Ordering::Acquire) {
        finish(&ctx, sub_threads, pub_threads);
        let e = ctx.fatal.lock().unwrap_or_else(|e| e.into_inner()).clone();
        return Err(e.unwrap_or_else(|| "setup failed".into()));
    }
    let t0 = now_ns() + 5_000_000;
    ctx.end
        .store(t0 + ctx.cfg.duration.as_nanos() as u64, Ordering::Release);
    ctx.t0.store(t0, Ordering::Release);
    watch(&ctx, t0);
    // Publishers stop at the end and wait for their acknowledgements.
    for p in pub_threads {
        let _ = p.join();
    }
    ctx.publishing_done.store(true, Ordering::Release);
    drain(&ctx);
    let latency = finish(&ctx, sub_threads, Vec::new());
    Ok(report(&ctx, &latency))
}

fn wait_ready(ctx: &Ctx, n: u64, within_ns: u64) -> bool {
    let deadline = now_ns() + within_ns;
    while ctx.ready.load(Ordering::Acquire) < n {
        if ctx.abort.load(Ordering::Acquire) {
            return false;
        }
        if now_ns() > deadline {
            ctx.fail("clients did not become ready in time".into());
            return false;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    true
}

fn spawn<T: Send + 'static, F: FnOnce() -> T + Send + 'static>(
    name: String,
    f: F,
) -> std::thread::JoinHandle<T> {
    std::thread::Builder::new()
        .name(name)
        .spawn(f)
        .expect("a client thread starts")
}

/// Sleeps through the publishing interval; prints interval lines.
fn watch(ctx: &Ctx, t0: u64) {
    let end = ctx.end.load(Ordering::Acquire);
    let every = ctx.cfg.report_every.map(|d| d.as_nanos() as u64);
    let mut next = every.map(|e| t0 + e);
    let (mut last_pub, mut last_recv, mut last_t) = (0u64, 0u64, t0);
    while now_ns() < end && !ctx.abort.load(Ordering::Acquire) {
        std::thread::sleep(
            Duration::from_millis(5).min(Duration::from_nanos(end.saturating_sub(now_ns()))),
        );
        let t = now_ns();
        if let (Some(n), Some(e)) = (next, every) {
            if t >= n {
                next = Some(n + e);
                let (p, r) = interval_line(ctx, t0, t, last_t, last_pub, last_recv);
                (last_pub, last_recv, last_t) = (p, r, t);
            }
        }
    }
    if let Some(_e) = every {
        if now_ns() > last_t + 100_000_000 {
            interval_line(ctx, t0, now_ns(), last_t, last_pub, last_recv);
        }
    }
}

fn interval_line(
    ctx: &Ctx,
    t0: u64,
    t: u64,
    last_t: u64,
    last_pub: u64,
    last_recv: u64,
) -> (u64, u64) {
    let published = ctx.published.load(Ordering::Relaxed);
    let received: u64 = ctx
        .deliveries
        .iter()
        .map(|d| d.load(Ordering::Relaxed))
        .sum();
    let mut lat = Latency::default();
    for l in &ctx.interval {
        let taken = std::mem::take(&mut *l.lock().unwrap_or_else(|e| e.into_inner()));
        lat.merge(&taken);
    }
    let (mut dup, mut holes) = (0, 0);
    for tr in &ctx.trackers {
        let tr = tr.lock().unwrap_or_else(|e| e.into_inner());
        dup += tr.duplicates;
        holes += tr.holes();
    }
    let errors: u64 = ctx
        .errors
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .values()
        .sum();
    let order = ctx.order_violations.load(Ordering::Relaxed);
    let secs = (t - last_t) as f64 / 1e9;
    let s = lat.summary();
    let bad = order > 0 || (ctx.cfg.qos == 2 && dup > 0) || errors > 0;
    println!(
        "[{:>8.1}s] sent {:>9.0} msg/s  received {:>9.0} msg/s  p99 {:>7} µs  max {:>7} µs  duplicates {dup}  order {order}  gaps {holes}  errors {errors}{}",
        (t - t0) as f64 / 1e9,
        (published - last_pub) as f64 / secs,
        (received - last_recv) as f64 / secs,
        s.p99,
        s.max,
        if bad { "  VIOLATION" } else { "" }
    );
    use std::io::Write as _;
    let _ = std::io::stdout().flush();
    (published, received)
}

/// After publishing: wait until every tracker has every message (with all
/// subscribers online), or nothing moved for [`DRAIN_IDLE`]
/// ([`RESTART_DRAIN_IDLE`] with `--through-restarts`).
fn drain(ctx: &Ctx) {
    let (idle, max) = if ctx.cfg.through_restarts {
        (RESTART_DRAIN_IDLE, RESTART_DRAIN_MAX)
    } else {
        (DRAIN_IDLE, DRAIN_MAX)
    };
    let begin = now_ns();
    let mut last = u64::MAX;
    let mut last_change = begin;
    loop {
        if ctx.abort.load(Ordering::Acquire) {
            return;
        }
        let published = ctx.published.load(Ordering::Relaxed);
        let all_online = ctx.online.iter().all(|o| o.load(Ordering::Acquire));
        let distinct: Vec<u64> = ctx
            .distinct
            .iter()
            .map(|d| d.load(Ordering::Relaxed))
            .collect();
        if all_online && distinct.iter().all(|&d| d >= published) {
            // Give late duplicates a moment to show.
            std::thread::sleep(Duration::from_millis(100));
            return;
        }
        let progress: u64 = ctx
            .deliveries
            .iter()
            .map(|d| d.load(Ordering::Relaxed))
            .sum();
        let t = now_ns();
        if progress != last || !all_online {
            (last, last_change) = (progress, t);
        } else if t - last_change > idle.as_nanos() as u64 {
            return;
        }
        if t - begin > max.as_nanos() as u64 {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// With `--through-restarts`: whether `e` is a lost connection (the
/// broker went away or closed it) that the client survives by reconnecting,
/// rather than a failure of the run.
fn lost_connection(ctx: &Ctx, e: &ClientError) -> bool {
    ctx.cfg.through_restarts
        && !ctx.over()
        && matches!(
            e,
            ClientError::Closed | ClientError::Io(_) | ClientError::Timeout(_) | ClientError::Connect(_)
        )
}

enum Next {
    Reconnect,
    Stop,
}

fn subscriber(ctx: &Ctx, j: usize) -> Latency {
    let cfg = &ctx.cfg;
    let persistent = cfg.mode == Mode::Persistent || cfg.through_restarts;
    let tag = match cfg.mode {
        Mode::Persistent => "ps",
        Mode::Shared => "sh",
        Mode::Soak => "sk",
    };
    let id = format!("{}-{tag}{j}", cfg.client_id_prefix);
    let url = ctx.url(Client::Subscriber(j));
    let mut st = SubState {
        order: OrderCheck::new(cfg.publishers),
        total: Latency::default(),
        qos2_pending: BTreeSet::new(),
        acks: BytesMut::new(),
    };
    let mut first = true;
    loop {
        // MQTT 5 starts a fresh session that outlives the connection;
        // 3.1.1 needs Clean Session 0 from the first CONNECT.
        let clean = if persistent {
            first && cfg.connect.version.is_v5()
        } else {
            true
        };
        let expiry = persistent.then_some(cfg.session_expiry);
        let connected = if first || !cfg.through_restarts {
            SyncConn::connect(url, &id, &cfg.connect, clean, expiry)
        } else {
            connect_again(ctx, url, &id, expiry)
        };
        let mut conn = match connected {
            Ok(c) => c,
            Err(e) => {
                if !ctx.over() {
                    ctx.error(e.kind());
                    ctx.fail(format!("{} ({id}): {e}", url.text));
                }
                break;
            }
        };
        if persistent && !first && !conn.session_present {
            ctx.sessions_lost.fetch_add(1, Ordering::Relaxed);
            ctx.error("session not present after reconnect");
        }
        if !conn.session_present {
            if let Err(e) = conn.subscribe(&cfg.filter(), qos_of(cfg.qos), cfg.connect.timeout) {
                if !first && lost_connection(ctx, &e) {
                    continue;
                }
                if !ctx.over() {
                    ctx.error(e.kind());
                    ctx.fail(format!("{} ({id}): {e}", url.text));
                }
                break;
            }
        }
        if first {
            ctx.ready.fetch_add(1, Ordering::AcqRel);
            first = false;
        }
        ctx.online[j].store(true, Ordering::Release);
        let until = (cfg.mode == Mode::Persistent)
            .then(|| now_ns() + cfg.reconnect_every.as_nanos() as u64);
        let result = receive(ctx, j, &mut conn, &mut st, until);
        ctx.online[j].store(false, Ordering::Release);
        match result {
            Ok(Next::Reconnect) => {
                conn.disconnect();
                ctx.reconnects.fetch_add(1, Ordering::Relaxed);
                let back = now_ns() + cfg.offline_for.as_nanos() as u64;
                while now_ns() < back && !ctx.publishing_done.load(Ordering::Acquire) && !ctx.over()
                {
                    std::thread::sleep(Duration::from_millis(5));
                }
                if ctx.over() {
                    break;
                }
            }
            Ok(Next::Stop) => {
                conn.disconnect();
                break;
            }
            Err(e) if lost_connection(ctx, &e) => {}
            Err(e) => {
                if !ctx.over() {
                    ctx.error(e.kind());
                    ctx.fail(format!("subscriber {id}: {e}"));
                }
                break;
            }
        }
    }
    st.total
}

struct SubState {
    order: OrderCheck,
    total: Latency,
    /// QoS 2 packet identifiers PUBREC'd and not yet released (kept across
    /// reconnects, like the session).
    qos2_pending: BTreeSet<u16>,
    acks: BytesMut,
}

fn qos_of(q: u8) -> QoS {
    QoS::from_u8(q).unwrap_or(QoS::AtMostOnce)
}

fn receive(
    ctx: &Ctx,
    j: usize,
    conn: &mut SyncConn,
    st: &mut SubState,
    until: Option<u64>,
) -> Result<Next, ClientError> {
    let tr = ctx.cfg.tracker_of(j);
    let version = conn.version;
    // What came with the CONNACK (a resumed session's queue may follow it
    // in the same read) is decoded before waiting for more: after the
    // publishers stop, nothing else would come to wake the read.
    let mut buffered = !conn.buf.is_empty();
    loop {
        if ctx.over() {
            return Ok(Next::Stop);
        }
        if until.is_some_and(|u| now_ns() >= u) && !ctx.publishing_done.load(Ordering::Acquire) {
            return Ok(Next::Reconnect);
        }
        if !std::mem::take(&mut buffered) && !conn.fill(POLL)? {
            continue;
        }
        let now = now_ns();
        let (mut n, mut lat) = (0u64, Vec::new());
        while let Some(p) = conn.decode()? {
            match p {
                Packet::Publish(p) => {
                    match (p.qos, p.packet_id) {
                        (QoS::AtLeastOnce, Some(id)) => {
                            put_response(&mut st.acks, version, id, Packet::PubAck)
                        }
                        (QoS::ExactlyOnce, Some(id)) => {
                            put_response(&mut st.acks, version, id, Packet::PubRec);
                            // Already received, awaiting PUBREL: not a new delivery.
                            if !st.qos2_pending.insert(id.get()) {
                                continue;
                            }
                        }
                        _ => {}
                    }
                    n += 1;
                    let Some((sent, seq)) = stamp(&p.payload) else {
                        ctx.error("payload without a stamp");
                        continue;
                    };
                    let (i, k) = ((seq >> 40) as usize, seq & ((1 << 40) - 1));
                    let arrival = ctx.trackers[tr]
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .record(i, k);
                    match arrival {
                        Some(Arrival::New) => {
                            ctx.distinct[tr].fetch_add(1, Ordering::Relaxed);
                            if st.order.violates(i, k) {
                                ctx.order_violations.fetch_add(1, Ordering::Relaxed);
                            }
                            let ns = now.saturating_sub(sent);
                            st.total.record_ns(ns);
                            lat.push(ns);
                        }
                        Some(Arrival::Duplicate) => {
                            ctx.duplicates_by_qos[p.qos as usize].fetch_add(1, Ordering::Relaxed);
                        }
                        None => ctx.error("message from an unknown publisher"),
                    }
                }
                Packet::PubRel(r) => {
                    st.qos2_pending.remove(&r.packet_id.get());
                    put_response(&mut st.acks, version, r.packet_id, Packet::PubComp);
                }
                Packet::Disconnect(_) => return Err(ClientError::Closed),
                _ => {}
            }
        }
        ctx.deliveries[j].fetch_add(n, Ordering::Relaxed);
        if !lat.is_empty() {
            let mut l = ctx.interval[j].lock().unwrap_or_else(|e| e.into_inner());
            for ns in lat {
                l.record_ns(ns);
            }
        }
        if !st.acks.is_empty() {
            let r = conn.write(&st.acks);
            st.acks.clear();
            r?;
        }
    }
}

/// Figures only the checked flows have.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct VerifyFigures {
    /// Messages published (written) in total.
    pub published: u64,
    /// PUBACK/PUBCOMP received.
    pub acked: u64,
    /// Distinct messages received (per tracker: each subscriber, or the
    /// shared group as one), summed.
    pub received_distinct: u64,
    /// PUBLISH packets delivered to subscribers, duplicates included.
    pub deliveries: u64,
    /// Messages that never arrived (per tracker, summed).
    pub missing: u64,
    /// Messages that arrived more than once.
    pub duplicates: u64,
    /// Of those, arrivals delivered at QoS 1 (allowed: at least once).
    pub duplicates_qos1: u64,
    /// Of those, arrivals delivered at QoS 2 (never allowed: exactly once).
    pub duplicates_qos2: u64,
    /// Values the broker acknowledged to their publisher (PUBACK, or
    /// PUBREC at QoS 2) that a subscriber never received (per tracker,
    /// summed): what a broker must never lose.
    pub lost_acknowledged: u64,
    /// New messages numbered below one already seen from the same
    /// publisher on the same subscriber.
    pub order_violations: u64,
    /// Persistent: disconnect/reconnect cycles; soak with
    /// `--through-restarts`: connections lost and made again (publishers
    /// and subscribers).
    pub reconnects: u64,
    /// Reconnects where the broker had lost the session.
    pub sessions_lost: u64,
    /// Deliveries per subscriber (shared: per group member).
    pub per_subscriber: Vec<u64>,
}

fn report(ctx: &Ctx, latency: &Latency) -> Report {
    let cfg = &ctx.cfg;
    let mut r = Report::with_meta(&cfg.scenario, cfg.options.clone(), cfg.duration, latency);
    let sent = ctx.sent_now();
    let published: u64 = sent.iter().sum();
    let (mut distinct, mut missing, mut duplicates, mut lost) = (0, 0, 0, 0);
    for t in &ctx.trackers {
        let t = t.lock().unwrap_or_else(|e| e.into_inner());
        distinct += t.distinct;
        duplicates += t.duplicates;
        missing += t.missing(&sent);
        for (i, acked) in ctx.acked_values.iter().enumerate() {
            lost += t.lost_of(i, &acked.lock().unwrap_or_else(|e| e.into_inner()));
        }
    }
    let dup = |q: usize| ctx.duplicates_by_qos[q].load(Ordering::Relaxed);
    let per_subscriber: Vec<u64> = ctx
        .deliveries
        .iter()
        .map(|d| d.load(Ordering::Relaxed))
        .collect();
    let v = VerifyFigures {
        published,
        acked: ctx.acked.load(Ordering::Relaxed),
        received_distinct: distinct,
        deliveries: per_subscriber.iter().sum(),
        missing,
        duplicates,
        duplicates_qos1: dup(1),
        duplicates_qos2: dup(2),
        lost_acknowledged: lost,
        order_violations: ctx.order_violations.load(Ordering::Relaxed),
        reconnects: ctx.reconnects.load(Ordering::Relaxed),
        sessions_lost: ctx.sessions_lost.load(Ordering::Relaxed),
        per_subscriber,
    };
    let secs = cfg.duration.as_secs_f64();
    r.publishers = cfg.publishers;
    r.subscribers = cfg.subscribers;
    r.sent = published;
    r.expected = published * cfg.trackers() as u64;
    r.received = distinct;
    r.published_total = published;
    r.acked_total = v.acked;
    r.sent_per_s = published as f64 / secs;
    r.received_per_s = distinct as f64 / secs;
    r.throughput_per_s = r.received_per_s;
    r.errors = ctx.errors.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let mut problems = Vec::new();
    if let Some(f) = ctx.fatal.lock().unwrap_or_else(|e| e.into_inner()).clone() {
        problems.push(f);
    }
    if published == 0 {
        problems.push("nothing was sent".into());
    }
    if !r.errors.is_empty() && problems.is_empty() {
        problems.push(format!("{} client errors", r.errors.values().sum::<u64>()));
    }
    let reliable = cfg.qos > 0;
    if v.missing > 0 && reliable {
        problems.push(format!(
            "{} of {} messages missing at QoS {}",
            v.missing, r.expected, cfg.qos
        ));
    }
    if v.lost_acknowledged > 0 {
        problems.push(format!(
            "{} acknowledged values never received",
            v.lost_acknowledged
        ));
    }
    if reliable && v.acked != published {
        problems.push(format!("{} of {published} publishes acknowledged", v.acked));
    }
    if reliable && v.order_violations > 0 {
        problems.push(format!(
            "{} per-publisher order violations",
            v.order_violations
        ));
    }
    if v.duplicates_qos2 > 0 {
        problems.push(format!("{} duplicates at QoS 2", v.duplicates_qos2));
    } else if v.duplicates > 0 && (cfg.qos == 2 || (reliable && cfg.mode == Mode::Shared)) {
        problems.push(format!("{} duplicates", v.duplicates));
    }
    if v.sessions_lost > 0 {
        problems.push(format!("session lost on {} reconnects", v.sessions_lost));
    }
    if !problems.is_empty() {
        r.check = problems.join("; ");
        r.passed = false;
    } else if v.missing > 0 {
        r.check = format!("ok ({} missing at QoS 0, reported only)", v.missing);
    }
    r.verify = Some(v);
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tracker_counts_new_duplicates_and_missing() {
        let mut t = Tracker::new(2);
        for k in [0, 1, 3, 4] {
            assert_eq!(t.record(0, k), Some(Arrival::New));
        }
        assert_eq!(t.record(0, 1), Some(Arrival::Duplicate));
        assert_eq!(t.record(0, 4), Some(Arrival::Duplicate));
        assert_eq!(t.record(5, 0), None, "unknown publisher");
        assert_eq!((t.distinct, t.duplicates), (4, 2));
        assert_eq!(t.holes(), 1, "2 is a gap");
        // Publisher 0 sent 6 (2 and 5 missing), publisher 1 sent 2 (both).
        assert_eq!(t.missing(&[6, 2]), 4);
        assert_eq!(t.record(0, 2), Some(Arrival::New));
        assert_eq!(t.holes(), 0);
        assert_eq!(t.missing(&[5, 0]), 0);
    }

    #[test]
    fn order_is_per_publisher() {
        let mut o = OrderCheck::new(2);
        assert!(!o.violates(0, 5));
        assert!(!o.violates(1, 0), "another publisher has its own order");
        assert!(o.violates(0, 3));
        assert!(!o.violates(0, 6));
    }
}
