//! What waits for NATS stays bounded (DESIGN.md §3, §6, §7): a replica
//! flooded with retained values on distinct topics while every NATS server
//! is stopped, or while NATS is slow, keeps its memory within a stated
//! bound. Past the bound of retained writes waiting for NATS (4,096 writes
//! or 32 MiB), a QoS 0 value is dropped and counted
//! (`fleetmq_cluster_retained_dropped_total`), a QoS 1 one refused: MQTT 5
//! PUBACK 0x97 Quota exceeded, MQTT 3.1.1 the connection closed with no
//! PUBACK for it. Once NATS answers again, retained values are stored and
//! acknowledged as before.
//!
//! Before the bound (s36): every retained write became a task of its own
//! on the bridge thread, waiting up to `session_log_append_wait` and
//! longer; a debug build flooded by one client reached +4.3 GiB in 25 s
//! and fenced only after 24 s, the bridge thread busy with the tasks.

use std::io::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use crate::cluster::{replica, wait_ready};
use crate::cluster_retained::publish;
use crate::harness::Broker;
use crate::nats::{NatsCluster, NatsProxy};
use crate::raw::{wire as build, Incoming, RawClient};

/// How much the replica's RSS may grow while flooded (the bound holds
/// ~4,096 writes and 32 MiB of records; measured: +22 MiB).
const RSS_BOUND_KIB: u64 = 100 << 10;

/// The payload of every flooded value.
const PAYLOAD: [u8; 256] = [b'x'; 256];

/// A connected MQTT 5 (or 3.1.1) client.
fn client(broker: &Broker, id: &str, v5: bool) -> RawClient {
    let mut c = RawClient::connect(broker.mqtt);
    let connect = if v5 { build::Connect::v5(id) } else { build::Connect::v311(id) };
    assert_eq!(c.handshake(&connect.encode()).1, 0, "CONNACK of {id}");
    c
}

/// Floods retained QoS 0 values on distinct topics `<prefix>/<n>` until
/// `stop` or the broker closes the connection; returns how many were sent.
fn flood_qos0(c: RawClient, prefix: &'static str, stop: Arc<AtomicBool>) -> thread::JoinHandle<u64> {
    thread::spawn(move || {
        let mut stream = c.into_stream();
        let mut batch = Vec::with_capacity(64 << 10);
        let mut n = 0u64;
        while !stop.load(Ordering::Relaxed) {
            batch.clear();
            for _ in 0..128 {
                let mut packet = build::publish_qos0(&format!("{prefix}/{n}"), &PAYLOAD, true);
                packet[0] |= 0x01; // RETAIN
                batch.extend(packet);
                n += 1;
            }
            if stream.write_all(&batch).is_err() {
                break;
            }
        }
        n
    })
}

/// What an MQTT 5 QoS 1 flooder was told: PUBACKs by reason code.
#[derive(Debug, Default)]
struct Acks {
    success: u64,
    /// 0x97: past the bound of what waits for NATS.
    quota_exceeded: u64,
    /// 0x80: not stored within `session_log_append_wait`.
    unspecified: u64,
    other: Vec<u8>,
}

/// Floods retained QoS 1 values on distinct topics `<prefix>/<n>` from an
/// MQTT 5 client, keeping 500 unacknowledged (below the broker's Receive
/// Maximum of 1,000), until `stop` or the broker closes the connection.
fn flood_qos1(mut c: RawClient, prefix: &'static str, stop: Arc<AtomicBool>) -> thread::JoinHandle<Acks> {
    thread::spawn(move || {
        let mut free: Vec<u16> = (1..=500).collect();
        let mut acks = Acks::default();
        let mut n = 0u64;
        while !stop.load(Ordering::Relaxed) {
            let mut batch = Vec::new();
            while let Some(pid) = free.pop() {
                batch.extend(publish(&format!("{prefix}/{n}"), &PAYLOAD, 1, true, pid, true));
                n += 1;
            }
            if !batch.is_empty() && c.try_send(&batch).is_err() {
                break;
            }
            match c.read(Duration::from_millis(100)) {
                Incoming::Packet { header: 0x40, body } => {
                    free.push(u16::from_be_bytes([body[0], body[1]]));
                    match body.get(2).copied().unwrap_or(0) {
                        0 => acks.success += 1,
                        0x97 => acks.quota_exceeded += 1,
                        0x80 => acks.unspecified += 1,
                        code => acks.other.push(code),
                    }
                }
                Incoming::Packet { .. } | Incoming::TimedOut => {}
                Incoming::Closed => break,
            }
        }
        acks
    })
}

/// The replica's RSS growth over `base_kib` at its highest while `until`
/// is false, sampled every 100 ms (at most `within`; no longer once past
/// [`RSS_BOUND_KIB`], so that a failing run stops its flood early).
fn peak_growth_kib(broker: &Broker, base_kib: u64, within: Duration, until: impl Fn() -> bool) -> u64 {
    let started = Instant::now();
    let mut peak = 0;
    while !until() && started.elapsed() < within && peak < RSS_BOUND_KIB {
        peak = peak.max(broker.rss_kib().saturating_sub(base_kib));
        thread::sleep(Duration::from_millis(100));
    }
    peak.max(broker.rss_kib().saturating_sub(base_kib))
}

/// A retained QoS 1 value published on `broker` is acknowledged (0x00)
/// and read back by a new subscription.
fn retained_works(broker: &Broker, topic: &str) {
    // What the flood left waiting for NATS drains first (until then a
    // QoS 1 retained value is refused with 0x97, as it should be).
    let drained_by = Instant::now() + Duration::from_secs(20);
    while broker.metric_sum("fleetmq_cluster_retained_waiting") > 0.0 {
        assert!(Instant::now() < drained_by, "retained writes still waiting for NATS after 20 s");
        thread::sleep(Duration::from_millis(100));
    }
    // JetStream may still be electing the bucket's leader after a restart
    // of the whole cluster: a refusal (0x80, not stored in time) is an
    // answer the client sends again on.
    let acked_by = Instant::now() + Duration::from_secs(40);
    // Claims too (CONNACK 0x88 Server unavailable until then).
    let mut publisher = loop {
        let mut c = RawClient::connect(broker.mqtt);
        match c.handshake(&build::Connect::v5("after-outage").encode()).1 {
            0 => break c,
            0x88 if Instant::now() < acked_by => thread::sleep(Duration::from_millis(500)),
            code => panic!("CONNACK 0x{code:02x} after the outage"),
        }
    };
    for pid in 1.. {
        publisher.send(&publish(topic, b"back", 1, true, pid, true));
        match publisher.read(Duration::from_secs(15)) {
            Incoming::Packet { header: 0x40, body } if body.get(2).copied().unwrap_or(0) == 0 => break,
            Incoming::Packet { header: 0x40, body } if body.get(2) == Some(&0x80) && Instant::now() < acked_by => {}
            other => panic!("expected PUBACK 0x00, got {other:02x?}"),
        }
    }
    // Applied from the bucket's watch, after the flooded values that
    // landed before it.
    let started = Instant::now();
    loop {
        let mut reader = client(broker, "", false);
        reader.send(&build::subscribe(1, topic, 0, false));
        loop {
            match reader.read(Duration::from_millis(500)) {
                Incoming::Packet { header, body } if header & 0xf0 == 0x30 => {
                    assert!(body.ends_with(b"back"), "{body:02x?}");
                    eprintln!("{topic} retained after {:?}", started.elapsed());
                    return;
                }
                Incoming::Packet { .. } => {}
                _ => break,
            }
        }
        assert!(started.elapsed() < Duration::from_secs(30), "{topic} not retained after 30 s");
    }
}

#[test]
fn retained_floods_while_every_nats_server_is_stopped_cost_bounded_memory_and_service_resumes() {
    let mut nats = NatsCluster::start(3);
    // The default member_ttl (10 s): the replica fences ~12 s after the
    // stop (DESIGN.md §5), and the flood goes on until then.
    let a = replica("ra", &nats.urls(), &[]);
    // Connected while NATS answers (a CONNECT claims its client
    // identifier there).
    let qos0 = client(&a, "flood-qos0", true);
    let qos1: Vec<RawClient> = (0..4).map(|i| client(&a, &format!("flood-qos1-{i}"), true)).collect();
    let mut v311 = client(&a, "device-311", false);
    let base = a.rss_kib();
    for i in 0..3 {
        nats.stop(i);
    }
    let stopped_at = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let f0 = flood_qos0(qos0, "flood", stop.clone());
    let full_by = Instant::now() + Duration::from_secs(5);
    while a.metric_sum("fleetmq_cluster_retained_waiting") < 4096.0 {
        assert!(Instant::now() < full_by, "the retained writes waiting for NATS never reached their bound");
        thread::sleep(Duration::from_millis(50));
    }
    // At the bound: QoS 1 values are refused at once.
    let f1: Vec<_> = qos1.into_iter().map(|c| flood_qos1(c, "flood1", stop.clone())).collect();
    // MQTT 3.1.1 has no reason code in PUBACK: a refused QoS 1 value
    // closes the connection, and it is not acknowledged (DESIGN.md §7).
    v311.send(&publish("flood311/1", &PAYLOAD, 1, true, 1, false));
    let mut seen = Vec::new();
    let closed_by = Instant::now() + Duration::from_secs(5);
    loop {
        match v311.read(closed_by.saturating_duration_since(Instant::now())) {
            Incoming::Packet { header, body } => seen.push((header, body)),
            Incoming::Closed => break,
            Incoming::TimedOut => panic!(
                "the 3.1.1 device is still open 5 s after its refused publish (seen {seen:02x?}); waiting {}, refused {}",
                a.metric_sum("fleetmq_cluster_retained_waiting"),
                a.metric_sum("fleetmq_cluster_retained_refused_total")
            ),
        }
    }
    assert!(seen.iter().all(|(header, _)| *header != 0x40), "3.1.1 refusal acknowledged: {seen:02x?}");
    assert!(stopped_at.elapsed() < Duration::from_secs(8), "closed only at the fence");
    // Flooded until the replica fences and closes the connections.
    let fenced = || a.metric_sum("fleetmq_cluster_fenced") == 1.0 && a.metric_sum("fleetmq_clients_connected") == 0.0;
    let growth = peak_growth_kib(&a, base, Duration::from_secs(30), fenced);
    let fenced_after = stopped_at.elapsed();
    stop.store(true, Ordering::Relaxed);
    let sent = f0.join().expect("QoS 0 flooder");
    let acks: Vec<Acks> = f1.into_iter().map(|f| f.join().expect("QoS 1 flooder")).collect();
    let dropped = a.metric_sum("fleetmq_cluster_retained_dropped_total");
    let refused = a.metric_sum("fleetmq_cluster_retained_refused_total");
    eprintln!(
        "sent {sent} QoS 0, acks {acks:?}; RSS +{} MiB at most; fenced after {fenced_after:?}; dropped {dropped}, refused {refused}",
        growth >> 10
    );
    assert!(growth < RSS_BOUND_KIB, "RSS grew by {} MiB (bound {} MiB)", growth >> 10, RSS_BOUND_KIB >> 10);
    // The bridge thread is not kept from its membership by the flood.
    assert!(fenced_after < Duration::from_secs(17), "fenced after {fenced_after:?} (DESIGN.md §6: ~12 s)");
    assert!(dropped > 0.0, "no QoS 0 value dropped at the bound (sent {sent})");
    assert!(acks.iter().any(|a| a.quota_exceeded > 0), "no QoS 1 value refused with 0x97: {acks:?}");
    assert!(acks.iter().all(|a| a.success == 0 && a.other.is_empty()), "{acks:?}");
    assert!(refused > 0.0);
    assert!(!a.stderr().contains("panicked"), "{}", a.stderr());
    nats.restart_all();
    wait_ready(&a, 200, Duration::from_secs(60));
    retained_works(&a, "after/outage");
}

#[test]
fn a_retained_flood_while_nats_is_slow_costs_bounded_memory_without_fencing() {
    let nats = NatsCluster::start(1);
    let proxy = NatsProxy::start(nats.client_addr(0));
    let a = replica("ra", &[proxy.url()], &["--set", "cluster.nats_replicas=1"]);
    let qos0 = client(&a, "flood-qos0", true);
    let base = a.rss_kib();
    // DESIGN.md §6: NATS slow up to 2 s a round trip is full service.
    proxy.set_round_trip(Duration::from_secs(2));
    let stop = Arc::new(AtomicBool::new(false));
    let f0 = flood_qos0(qos0, "slow", stop.clone());
    let started = Instant::now();
    let growth = peak_growth_kib(&a, base, Duration::from_secs(10), || {
        let (status, body) = a.admin_get("/health/ready");
        assert_eq!(status, 200, "fenced with NATS at 2 s a round trip after {:?}: {body}", started.elapsed());
        false
    });
    stop.store(true, Ordering::Relaxed);
    let sent = f0.join().expect("QoS 0 flooder");
    let dropped = a.metric_sum("fleetmq_cluster_retained_dropped_total");
    eprintln!("sent {sent}; RSS +{} MiB at most; dropped {dropped}", growth >> 10);
    assert!(growth < RSS_BOUND_KIB, "RSS grew by {} MiB (bound {} MiB)", growth >> 10, RSS_BOUND_KIB >> 10);
    assert!(dropped > 0.0, "no QoS 0 value dropped at the bound (sent {sent})");
    proxy.set_round_trip(Duration::ZERO);
    retained_works(&a, "after/slow");
    assert!(!a.stderr().contains("panicked"), "{}", a.stderr());
}

/// A stop with every NATS server gone skips the writes that would only
/// wait out their bounds (the purge of its routes, 5 s; its leaving
/// record, 1 s): it took about 6 s, now well under 1.5 s. The others take
/// it for gone after member_ttl, as after a kill.
#[test]
fn a_stop_with_every_nats_server_gone_does_not_wait_for_them() {
    let mut nats = NatsCluster::start(3);
    let mut a = replica("stop-away", &nats.urls(), &["--set", "cluster.member_ttl=5s"]);
    for i in 0..nats.len() {
        nats.kill(i);
    }
    // async-nats sees the connections close at once.
    thread::sleep(Duration::from_millis(1500));
    let asked = Instant::now();
    let status = a.stop_with_sigterm();
    let took = asked.elapsed();
    println!("the stop took {took:?}");
    assert!(status.success(), "{status:?}\n{}", a.stderr());
    assert!(took < Duration::from_millis(1500), "the stop took {took:?}\n{}", a.stderr());
    assert!(a.stderr().contains("NATS away at the stop"), "{}", a.stderr());
}
