//! One NATS server of three frozen (SIGSTOP: its sockets stay open and
//! silent) under a replica's connections: the bridge notices the silence
//! (no echo back for member_ttl/2) and reconnects to another server, well
//! before the fence deadline (7T/6), so no replica fences and the
//! publishers are served on (DESIGN.md §6 "one NATS server lost").
//! Before s41 every replica whose connection used the frozen server
//! fenced after ~14 s ("store unreachable") and refused its publishes.

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use crate::cluster::{replica, wait_ready};
use crate::harness::Broker;
use crate::nats::NatsCluster;
use crate::raw::{wire as build, Incoming, RawClient};

/// What a steady QoS 1 publisher was told.
#[derive(Debug, Default)]
struct Told {
    /// Values acknowledged with 0x00.
    acked: HashSet<u64>,
    /// Values refused, with when they were sent (since the start).
    refused: Vec<(u64, u8, Duration)>,
    /// When the connection was closed under the publisher, or a CONNECT
    /// refused.
    closed: Vec<Duration>,
    /// Values sent.
    sent: u64,
}

/// Publishes a QoS 1 value (its number, topic `steady/v`) every `every` on
/// `broker` as `id` until `stop`, then waits up to 12 s (past
/// session_log_append_wait) for the last acknowledgements.
fn steady_publisher(
    broker: &Broker,
    id: &'static str,
    every: Duration,
    stop: Arc<AtomicBool>,
    told: Arc<Mutex<Told>>,
    t0: Instant,
) -> thread::JoinHandle<()> {
    let addr = broker.mqtt;
    thread::spawn(move || {
        let mut n = 0u64;
        'connections: loop {
            if stop.load(Ordering::Relaxed) {
                return;
            }
            let Ok(mut c) = RawClient::try_connect(addr) else {
                told.lock().unwrap().closed.push(t0.elapsed());
                thread::sleep(Duration::from_millis(200));
                continue;
            };
            if c.handshake(&build::Connect::v5(id).encode()).1 != 0 {
                told.lock().unwrap().closed.push(t0.elapsed());
                thread::sleep(Duration::from_millis(200));
                continue;
            }
            // packet identifier → (value, sent at)
            let mut open: BTreeMap<u16, (u64, Duration)> = BTreeMap::new();
            let mut next = Instant::now();
            let mut stopped_at: Option<Instant> = None;
            loop {
                if stopped_at.is_none() && stop.load(Ordering::Relaxed) {
                    stopped_at = Some(Instant::now());
                }
                if stopped_at.is_some_and(|at| open.is_empty() || at.elapsed() > Duration::from_secs(12)) {
                    return;
                }
                if stopped_at.is_none() && Instant::now() >= next {
                    let pid = (n % 60_000) as u16 + 1;
                    let publish = build::publish("steady/v", 1, pid, (false, false), n.to_string().as_bytes(), true);
                    if c.try_send(&publish).is_err() {
                        told.lock().unwrap().closed.push(t0.elapsed());
                        continue 'connections;
                    }
                    open.insert(pid, (n, t0.elapsed()));
                    told.lock().unwrap().sent += 1;
                    n += 1;
                    next += every;
                }
                match c.read(next.saturating_duration_since(Instant::now()).max(Duration::from_millis(5))) {
                    Incoming::Packet { header: 0x40, body } => {
                        let pid = u16::from_be_bytes([body[0], body[1]]);
                        let Some((value, at)) = open.remove(&pid) else { continue };
                        let mut t = told.lock().unwrap();
                        match body.get(2).copied().unwrap_or(0) {
                            0 => drop(t.acked.insert(value)),
                            code => t.refused.push((value, code, at)),
                        }
                    }
                    Incoming::Packet { .. } | Incoming::TimedOut => {}
                    Incoming::Closed => {
                        told.lock().unwrap().closed.push(t0.elapsed());
                        if stopped_at.is_some() {
                            return;
                        }
                        continue 'connections;
                    }
                }
            }
        }
    })
}

/// The values of the ingest stream `mqtt-ingest` now (payloads parsed as
/// numbers).
fn ingested_values(nats: &NatsCluster) -> HashSet<u64> {
    crate::cluster_ingest::ingested(nats)
        .iter()
        .filter_map(|m| std::str::from_utf8(&m.payload).ok()?.parse().ok())
        .collect()
}

/// The retained messages on `topic` that a new subscriber of `broker`
/// gets (payloads).
fn retained_on(broker: &Broker, topic: &str) -> Vec<Vec<u8>> {
    let mut c = RawClient::connect(broker.mqtt);
    if c.handshake(&build::Connect::v311("").encode()).1 != 0 {
        return Vec::new();
    }
    c.send(&build::subscribe(1, topic, 0, false));
    let mut seen = Vec::new();
    while let Incoming::Packet { header, body } = c.read(Duration::from_millis(500)) {
        if header & 0xf0 == 0x30 {
            let topic_len = usize::from(u16::from_be_bytes([body[0], body[1]]));
            seen.push(body[2 + topic_len..].to_vec());
        }
    }
    seen
}

#[test]
fn one_frozen_nats_server_under_the_replicas_connections_fences_no_replica_and_loses_no_acknowledged_value() {
    let nats = NatsCluster::start(3);
    // The default member_ttl (10 s): the fence deadline is 11.7 s, the
    // silence bound 5 s.
    let a = replica("ra", &nats.urls(), &[]);
    let b = replica("rb", &nats.urls(), &[]);
    // The server A's state connection uses (requests, ingest, watches;
    // both state connections go to the mqtt-sessions leader at start).
    let victim = (0..3)
        .find(|&i| nats.connection_names(i).iter().any(|n| n == "fleetmq-ra-state"))
        .expect("A's state connection is at one of the servers");
    let on_victim = nats.connection_names(victim);
    let t0 = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let told = Arc::new(Mutex::new(Told::default()));
    let publisher = steady_publisher(&a, "steady-pub", Duration::from_millis(50), stop.clone(), told.clone(), t0);
    let until = Instant::now() + Duration::from_secs(20);
    while told.lock().unwrap().acked.len() < 40 {
        assert!(Instant::now() < until, "no service before the freeze: {:?}", told.lock().unwrap());
        thread::sleep(Duration::from_millis(50));
    }
    nats.pause(victim);
    let paused_at = t0.elapsed();
    // Frozen for 20 s, past the fence deadline (11.7 s) and the store
    // probe's bound (15 s): readiness sampled on both replicas.
    let mut not_ready: Vec<(char, Duration, String)> = Vec::new();
    let mut moved_at: Option<Duration> = None;
    let mut retained_set = false;
    let mut retained_seen: Option<Duration> = None;
    while t0.elapsed() < paused_at + Duration::from_secs(20) {
        for (name, broker) in [('a', &a), ('b', &b)] {
            let (status, body) = broker.admin_get("/health/ready");
            if status != 200 {
                not_ready.push((name, t0.elapsed() - paused_at, body));
            }
        }
        if moved_at.is_none() && a.metric_sum("fleetmq_cluster_nats_reconnects_forced_total") >= 1.0 {
            moved_at = Some(t0.elapsed());
        }
        // The watches moved too: a retained value set on B after the move
        // reaches A's copy (A's retained watch runs on its state
        // connection).
        if let Some(moved) = moved_at {
            if !retained_set && t0.elapsed() > moved + Duration::from_secs(1) {
                crate::harness::mosquitto_pub(&b, &["-t", "frozen/flag", "-m", "after", "-r", "-q", "1"]);
                retained_set = true;
            } else if retained_set && retained_seen.is_none() && retained_on(&a, "frozen/flag") == [b"after".to_vec()] {
                retained_seen = Some(t0.elapsed());
            }
        }
        thread::sleep(Duration::from_millis(200));
    }
    nats.resume(victim);
    // Served on after the thaw too.
    let acked_then = told.lock().unwrap().acked.len();
    let until = Instant::now() + Duration::from_secs(20);
    while told.lock().unwrap().acked.len() < acked_then + 40 {
        assert!(Instant::now() < until, "no service after the thaw");
        thread::sleep(Duration::from_millis(50));
    }
    stop.store(true, Ordering::Relaxed);
    publisher.join().unwrap();
    let told = std::mem::take(&mut *told.lock().unwrap());
    let forced = a.metric_sum("fleetmq_cluster_nats_reconnects_forced_total");
    let report = format!(
        "victim n{victim} (had {on_victim:?}), paused at {paused_at:?}, first forced reconnect of A at {:?}, \
         forced reconnects A {forced} B {}, sent {}, acknowledged {}, refused {:?}, closed {:?}, not ready {not_ready:?}",
        moved_at.map(|m| m - paused_at),
        b.metric_sum("fleetmq_cluster_nats_reconnects_forced_total"),
        told.sent,
        told.acked.len(),
        told.refused,
        told.closed,
    );
    println!("{report}");
    // No replica fenced, nor was ever not ready.
    assert!(not_ready.is_empty(), "{report}");
    // A left the frozen server within T/2 + T/10 (+ load).
    let moved = moved_at.unwrap_or_else(|| panic!("A was never forced to reconnect: {report}")) - paused_at;
    assert!(moved < Duration::from_secs(9), "{report}");
    // Its publisher was never closed, nor refused (a value sent before
    // the move is sent again on the new connection: stored once).
    assert!(told.closed.is_empty(), "{report}");
    assert!(told.refused.is_empty(), "{report}");
    // The watches came along.
    assert!(retained_seen.is_some(), "the retained value set on B after the move never reached A: {report}");
    // Every acknowledged value is in the ingest stream.
    let stored = ingested_values(&nats);
    let lost: Vec<_> = told.acked.iter().filter(|v| !stored.contains(v)).take(10).collect();
    assert!(lost.is_empty(), "acknowledged and not in the stream: {lost:?}: {report}");
    wait_ready(&a, 200, Duration::from_secs(1));
}
