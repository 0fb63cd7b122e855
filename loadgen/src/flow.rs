//! Message-flow scenarios: `fan-in` (N publishers on `{prefix}/{i}` → M
//! subscribers on `{prefix}/+`) and `fan-out` (publishers on
//! `{prefix}/all` → N subscribers on it).
//!
//! Every client is connected and subscribed before the start; then the
//! publishers run for warm-up plus duration, open loop on a
//! [`Schedule`] or closed loop under `--window`. Only messages stamped
//! inside the measured interval count; after it the run drains until every
//! counted message arrived (or nothing moved for a second).

use std::cell::{Cell, RefCell};
use std::num::NonZeroU16;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Buf, BytesMut};
use fleetmq_core::packet::codec::Peeked;
use fleetmq_core::packet::{Packet, ProtocolVersion, QoS};
use futures_lite::future::{or, yield_now};
use futures_lite::io::{split, AsyncWriteExt, ReadHalf};
use glommio::timer::sleep;

use crate::client::{
    put_response, stamp, write_flushed, ClientError, Conn, ConnectOptions, PublishTemplate,
};
use crate::latency::Latency;
use crate::options::{Rate, RunArgs, Scenario, Urls};
use crate::runtime::{now_ns, Gate, Shared, Signal, ThreadResult};
use crate::schedule::Schedule;
use crate::transport::async_stream::Stream;
use crate::transport::TransportOptions;

/// How often a blocked read wakes to look at the stop flag.
const POLL_STOP: Duration = Duration::from_millis(100);

/// Messages encoded per publisher turn at most.
const BATCH: u64 = 64;

/// In-flight QoS 1/2 publishes per publisher at most (also capped by the
/// broker's Receive Maximum).
const MAX_INFLIGHT: u32 = 1000;

/// One client's role.
#[derive(Debug, Clone, Copy)]
enum Role {
    Subscriber(usize),
    Publisher(usize),
}

/// The plan every executor reads: who connects where with what.
pub struct Plan {
    /// The options.
    pub args: RunArgs,
    /// Topic prefix.
    pub prefix: String,
    /// Publishers.
    pub publishers: usize,
    /// Subscribers.
    pub subscribers: usize,
    /// TLS configuration and WebSocket path, loaded from `args`.
    pub transport: TransportOptions,
    /// Where each publisher and subscriber connects.
    pub urls: Urls,
}

impl Plan {
    fn topic_of(&self, publisher: usize) -> String {
        match self.args.scenario {
            Scenario::FanOut => format!("{}/all", self.prefix),
            _ => format!("{}/{publisher}", self.prefix),
        }
    }

    fn filter(&self) -> String {
        match self.args.scenario {
            Scenario::FanOut => format!("{}/all", self.prefix),
            _ => format!("{}/+", self.prefix),
        }
    }

    fn roles_of(&self, thread: usize) -> Vec<Role> {
        let all = (0..self.subscribers)
            .map(Role::Subscriber)
            .chain((0..self.publishers).map(Role::Publisher));
        all.enumerate()
            .filter(|(c, _)| c % self.args.threads == thread)
            .map(|(_, r)| r)
            .collect()
    }

    fn connect_options(&self) -> ConnectOptions {
        // Flow clients send no PINGREQ: a QoS 0 subscriber only reads, so
        // runs longer than 1.5 × --keep-alive need a larger value (or 0,
        // which some brokers refuse: rumqttd does).
        self.args
            .connect_options(self.args.keep_alive, &self.transport)
    }
}

/// One executor's part of a flow run: connect its clients, wait for the
/// start, run them, and hand back its latencies.
pub async fn executor(plan: Arc<Plan>, shared: Arc<Shared>, thread: usize) -> ThreadResult {
    let opts = plan.connect_options();
    let prefix = plan.args.client_id_prefix();
    let mut clients = Vec::new();
    for role in plan.roles_of(thread) {
        if shared.abort.load(Ordering::Acquire) {
            return ThreadResult::default();
        }
        let url = match role {
            Role::Subscriber(j) => plan.urls.subscriber(j),
            Role::Publisher(i) => plan.urls.publisher(i),
        };
        let id = match role {
            Role::Subscriber(j) => format!("{prefix}-s{j}"),
            Role::Publisher(i) => format!("{prefix}-p{i}"),
        };
        let setup = async {
            let mut conn = Conn::connect(url, &id, &opts).await?;
            if let Role::Subscriber(_) = role {
                conn.subscribe(&plan.filter(), plan.args.qos(), plan.args.connect_timeout)
                    .await?;
            }
            Ok::<_, ClientError>(conn)
        };
        match setup.await {
            Ok(conn) => clients.push((role, conn)),
            Err(e) => {
                shared.fail_setup(format!("{} ({}): {e}", url.text, id));
                return ThreadResult::default();
            }
        }
    }
    shared.ready.fetch_add(1, Ordering::AcqRel);
    let Some(t0) = shared.wait_start().await else {
        return ThreadResult::default();
    };
    let latency = Rc::new(RefCell::new(Latency::default()));
    let gate = Rc::new(Gate::default());
    let mut tasks = Vec::new();
    for (role, conn) in clients {
        let (plan, shared, latency, gate) =
            (plan.clone(), shared.clone(), latency.clone(), gate.clone());
        tasks.push(glommio::spawn_local(async move {
            let result = match role {
                Role::Subscriber(j) => subscriber(&shared, j, conn, &latency, &gate).await,
                Role::Publisher(i) => publisher(&plan, &shared, i, conn, &gate, t0).await,
            };
            if let Err(e) = result {
                if !shared.stopped() {
                    shared.client_error(&e);
                }
            }
        }));
    }
    if plan.args.threads > 1 {
        // Subscribers on other executors cannot wake this gate: poll.
        let (gate, shared) = (gate.clone(), shared.clone());
        glommio::spawn_local(async move {
            while !shared.stopped() {
                sleep(Duration::from_micros(200)).await;
                if gate.has_waiters() {
                    gate.wake_all();
                }
            }
        })
        .detach();
    }
    for t in tasks {
        t.await;
    }
    let latency = latency.take();
    ThreadResult { latency }
}

async fn subscriber(
    shared: &Shared,
    j: usize,
    mut conn: Conn,
    latency: &RefCell<Latency>,
    gate: &Gate,
) -> Result<(), ClientError> {
    let _ = conn.stream.set_read_timeout(Some(POLL_STOP));
    let (from, to) = (
        shared.measure_start.load(Ordering::Acquire),
        shared.measure_end.load(Ordering::Acquire),
    );
    let version = conn.version;
    let mut out = BytesMut::new();
    while !shared.stopped() {
        match conn.fill().await {
            Ok(_) => {}
            Err(ClientError::Timeout(_)) => continue,
            Err(e) => return Err(e),
        }
        let now = now_ns();
        let (mut all, mut measured) = (0u64, 0u64);
        {
            let mut latency = latency.borrow_mut();
            // PUBLISHes are read in place (no `Packet` built: at millions of
            // deliveries a second the moves of that value showed as a third
            // of the loadgen's time); anything else is decoded.
            loop {
                match conn.peek_publish()? {
                    Peeked::Incomplete => break,
                    Peeked::Publish(p) => {
                        all += 1;
                        if let Some((sent, _seq)) = stamp(p.payload) {
                            if (from..to).contains(&sent) {
                                measured += 1;
                                latency.record_ns(now.saturating_sub(sent));
                            }
                        }
                        match (p.qos, p.packet_id) {
                            (QoS::AtLeastOnce, Some(id)) => {
                                put_response(&mut out, version, id, Packet::PubAck)
                            }
                            (QoS::ExactlyOnce, Some(id)) => {
                                put_response(&mut out, version, id, Packet::PubRec)
                            }
                            _ => {}
                        }
                        let len = p.len;
                        conn.buf.advance(len);
                    }
                    Peeked::Other => match conn.decode_buffered()? {
                        Some(Packet::PubRel(r)) => {
                            put_response(&mut out, version, r.packet_id, Packet::PubComp)
                        }
                        Some(Packet::Disconnect(_)) => return Err(ClientError::Closed),
                        _ => {}
                    },
                }
            }
        }
        shared.received[j].fetch_add(all, Ordering::Relaxed);
        shared
            .received_measured
            .fetch_add(measured, Ordering::Relaxed);
        shared.received_measured_by[j].fetch_add(measured, Ordering::Relaxed);
        if !out.is_empty() {
            conn.write(&out).await?;
            out.clear();
        }
        gate.wake_all();
    }
    Ok(())
}

/// A publisher's state shared by its generator, writer and ack reader.
struct PubState {
    out: RefCell<BytesMut>,
    write: Signal,
    acked: Signal,
    inflight: Cell<u32>,
    done: Cell<bool>,
    failed: Cell<bool>,
    version: ProtocolVersion,
    /// Send stamps of the QoS 1/2 messages awaiting their acknowledgement,
    /// oldest first (acknowledgements come in publish order
    /// `[MQTT-4.6.0-2]`, `[MQTT-4.6.0-3]`).
    sent: RefCell<std::collections::VecDeque<u64>>,
    /// Publish-to-acknowledgement latency of the measured messages.
    ack_latency: RefCell<crate::latency::Latency>,
}

async fn publisher(
    plan: &Plan,
    shared: &Arc<Shared>,
    i: usize,
    conn: Conn,
    gate: &Gate,
    t0: u64,
) -> Result<(), ClientError> {
    let args = &plan.args;
    let qos = args.qos();
    let template = PublishTemplate::with_retain(&plan.topic_of(i), qos, args.payload_size, conn.version, args.retain);
    let max_inflight = u32::from(conn.receive_maximum).min(MAX_INFLIGHT);
    let state = Rc::new(PubState {
        out: RefCell::new(BytesMut::with_capacity(template.len() * BATCH as usize)),
        write: Signal::default(),
        acked: Signal::default(),
        inflight: Cell::new(0),
        done: Cell::new(false),
        failed: Cell::new(false),
        version: conn.version,
        sent: RefCell::new(std::collections::VecDeque::new()),
        ack_latency: RefCell::new(crate::latency::Latency::default()),
    });
    let Conn {
        mut stream,
        buf,
        max_packet_size,
        ..
    } = conn;
    let _ = stream.set_read_timeout(Some(POLL_STOP));
    let flush = stream.needs_flush();
    let (reader, mut writer) = split(stream);
    let reader_task = glommio::spawn_local(read_acks(state.clone(), reader, buf, max_packet_size, shared.clone()));
    let writer_state = state.clone();
    let writer_task = glommio::spawn_local(async move {
        loop {
            writer_state.write.wait().await;
            let chunk = writer_state.out.borrow_mut().split();
            if !chunk.is_empty() && write_flushed(&mut writer, &chunk, flush).await.is_err() {
                writer_state.failed.set(true);
                writer_state.acked.notify();
                return Err(ClientError::Closed);
            }
            if writer_state.done.get() && writer_state.out.borrow().is_empty() {
                let _ = writer.close().await;
                return Ok(());
            }
        }
    });

    let (from, to) = (
        shared.measure_start.load(Ordering::Acquire),
        shared.measure_end.load(Ordering::Acquire),
    );
    let schedule = match args.rate {
        Rate::PerSecond(r) => Some(Schedule::new(r, plan.publishers as u64, i as u64)),
        Rate::Max => None,
    };
    // Open loop: every message due before the end of the measured interval.
    let last = schedule.map(|s| s.due_count(to - t0 - 1));
    let give_up = to + 2_000_000_000;
    let mut k = 0u64;
    let mut next_id = 0u16;
    while !shared.stopped() && !state.failed.get() {
        let now = now_ns();
        // Acknowledgements this publisher may still await (QoS 1/2).
        let room = if qos == QoS::AtMostOnce {
            u64::MAX
        } else {
            u64::from(max_inflight - state.inflight.get())
        };
        let want = match (schedule, last) {
            (Some(s), Some(last)) => {
                if k >= last {
                    break;
                }
                if now >= give_up {
                    shared.error("not sent: publisher backlog at the end", last - k);
                    break;
                }
                let due = s.due_count(now.saturating_sub(t0)).min(last);
                if due <= k {
                    sleep(Duration::from_nanos(t0 + s.due_at(k) - now)).await;
                    continue;
                }
                (due - k).min(BATCH).min(room)
            }
            _ => {
                if now >= to {
                    break;
                }
                let most = BATCH.min((args.window / plan.publishers as u64).max(1)).min(room);
                // Counted as published here (see `Shared::window_reserve`).
                shared.window_reserve(args.window, most)
            }
        };
        if want == 0 {
            if room == 0 {
                state.acked.wait().await;
            } else {
                // Closed loop: the window is full.
                or(gate.wait(), sleep(Duration::from_millis(5))).await;
            }
            continue;
        }
        let mut measured = 0;
        {
            let mut out = state.out.borrow_mut();
            for _ in 0..want {
                let stamp = schedule.map_or(now, |s| t0 + s.due_at(k));
                measured += u64::from((from..to).contains(&stamp));
                let id = (qos != QoS::AtMostOnce).then(|| {
                    next_id = next_id.checked_add(1).unwrap_or(1);
                    NonZeroU16::new(next_id).unwrap_or(NonZeroU16::MIN)
                });
                template.put(&mut out, stamp, (i as u64) << 40 | k, id);
                if id.is_some() {
                    state.sent.borrow_mut().push_back(stamp);
                }
                k += 1;
            }
        }
        if qos != QoS::AtMostOnce {
            state.inflight.set(state.inflight.get() + want as u32);
        }
        if schedule.is_some() {
            shared.published.fetch_add(want, Ordering::Relaxed);
        }
        shared.sent_measured.fetch_add(measured, Ordering::Relaxed);
        state.write.notify();
        yield_now().await;
    }
    shared.publishers_finished.fetch_add(1, Ordering::AcqRel);
    // Wait for the outstanding acknowledgements, then DISCONNECT.
    while state.inflight.get() > 0 && !shared.stopped() && !state.failed.get() {
        or(state.acked.wait(), sleep(POLL_STOP)).await;
    }
    let _ = fleetmq_core::packet::codec::encode(
        &Packet::Disconnect(Default::default()),
        state.version,
        &mut state.out.borrow_mut(),
    );
    state.done.set(true);
    state.write.notify();
    let written = writer_task.await;
    reader_task.await;
    shared.ack_latency.lock().unwrap_or_else(|e| e.into_inner()).merge(&state.ack_latency.borrow());
    written
}

async fn read_acks(
    state: Rc<PubState>,
    mut reader: ReadHalf<Stream>,
    buf: BytesMut,
    max_packet_size: usize,
    shared: Arc<Shared>,
) {
    let mut conn = AckReader {
        buf,
        scratch: vec![0; 16 * 1024],
    };
    loop {
        if state.done.get() && (state.inflight.get() == 0 || shared.stopped()) {
            return;
        }
        match conn.fill(&mut reader).await {
            Ok(()) => {}
            Err(ClientError::Timeout(_)) => continue,
            Err(e) => {
                if !state.done.get() && !shared.stopped() {
                    shared.client_error(&e);
                }
                state.failed.set(true);
                state.acked.notify();
                return;
            }
        }
        let mut acked = 0u32;
        loop {
            match fleetmq_core::packet::codec::decode(
                &mut conn.buf,
                Some(state.version),
                max_packet_size,
            ) {
                Ok(Some(Packet::PubAck(_))) => {
                    acked += 1;
                    ack_received(&state, &shared);
                }
                Ok(Some(Packet::PubComp(_))) => acked += 1,
                Ok(Some(Packet::PubRec(r))) => {
                    ack_received(&state, &shared);
                    put_response(
                        &mut state.out.borrow_mut(),
                        state.version,
                        r.packet_id,
                        Packet::PubRel,
                    );
                    state.write.notify();
                }
                Ok(Some(Packet::Disconnect(_))) => {
                    shared.error("disconnected by broker", 1);
                    state.failed.set(true);
                    break;
                }
                Ok(Some(_)) => {}
                Ok(None) => break,
                Err(e) => {
                    shared.client_error(&ClientError::Decode(e));
                    state.failed.set(true);
                    break;
                }
            }
        }
        if acked > 0 {
            state
                .inflight
                .set(state.inflight.get().saturating_sub(acked));
            shared.acked.fetch_add(u64::from(acked), Ordering::Relaxed);
            state.acked.notify();
        }
        if state.failed.get() {
            state.acked.notify();
            return;
        }
    }
}

/// The oldest message awaiting its acknowledgement got it: record its
/// latency if it was sent in the measured interval.
fn ack_received(state: &PubState, shared: &Shared) {
    let Some(sent) = state.sent.borrow_mut().pop_front() else { return };
    let (from, to) = (shared.measure_start.load(Ordering::Relaxed), shared.measure_end.load(Ordering::Relaxed));
    if (from..to).contains(&sent) {
        state.ack_latency.borrow_mut().record_ns(now_ns().saturating_sub(sent));
    }
}

struct AckReader {
    buf: BytesMut,
    scratch: Vec<u8>,
}

impl AckReader {
    async fn fill(&mut self, reader: &mut ReadHalf<Stream>) -> Result<(), ClientError> {
        use futures_lite::io::AsyncReadExt;
        match reader.read(&mut self.scratch).await {
            Ok(0) => Err(ClientError::Closed),
            Ok(n) => {
                self.buf.extend_from_slice(&self.scratch[..n]);
                Ok(())
            }
            Err(e) => Err(crate::transport::tls::classify_io(e)),
        }
    }
}
