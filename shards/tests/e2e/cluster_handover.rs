//! What a replica hands over to the cluster when it is killed, fenced or
//! stopped (DESIGN.md §5, §6): wills whose MQTT 5 Will Delay Interval was
//! running, the ownership entries of its client identifiers, and the
//! CONNECT path while NATS is slow.
//!
//! Short timings (`member_ttl` 5 s, `will_stop_grace` 2 s): with them a
//! killed replica is taken for gone about 7.5 s after its last write.

use std::thread;
use std::time::{Duration, Instant};

use fleetmq_core::cluster::records::client_key;

use crate::cluster::{cluster_args, connect_v5, expect_disconnect, replica, wait_ready};
use crate::harness::{Broker, MosquittoSub};
use crate::nats::{NatsCluster, NatsProxy};
use crate::raw::{wire as build, Incoming, RawClient};

const TIMING: [&str; 4] = [
    "--set",
    "cluster.member_ttl=5s",
    "--set",
    "cluster.will_stop_grace=2s",
];

/// An MQTT 5 device `id` on `broker` with a will on `wills/<id>`
/// (payload `offline`), its Will Delay Interval `delay` and Session
/// Expiry Interval `expiry` (seconds).
fn device(broker: &Broker, id: &str, delay: u32, expiry: u32) -> RawClient {
    let topic = format!("wills/{id}");
    let connect = build::Connect {
        will: Some(build::Will {
            topic: &topic,
            payload: b"offline",
            delay_secs: Some(delay),
            payload_format: None,
        }),
        session_expiry: Some(expiry),
        ..build::Connect::v5(id)
    };
    let mut client = RawClient::connect(broker.mqtt);
    assert_eq!(client.handshake(&connect.encode()).1, 0, "CONNECT of {id}");
    client
}

/// The wills `watcher` sees until `until` after `t0`: (topic, when after
/// `t0`).
fn wills_until(
    watcher: &mut MosquittoSub,
    t0: Instant,
    until: Duration,
) -> Vec<(String, Duration)> {
    let mut seen = Vec::new();
    while t0.elapsed() < until {
        if let Some(line) = watcher.next_message(Duration::from_millis(200)) {
            // `... <topic> <payload>` (mosquitto_sub -v).
            let topic = line
                .split_whitespace()
                .rev()
                .nth(1)
                .unwrap_or_default()
                .to_owned();
            seen.push((topic, t0.elapsed()));
        }
    }
    seen
}

/// When `topic`'s will came, if it came exactly once.
fn once(wills: &[(String, Duration)], topic: &str) -> Duration {
    let at: Vec<Duration> = wills
        .iter()
        .filter(|(t, _)| t == topic)
        .map(|(_, at)| *at)
        .collect();
    assert_eq!(at.len(), 1, "{topic}: {wills:?}");
    at[0]
}

#[test]
fn delayed_wills_of_a_killed_replica_are_sent_when_due_and_a_shorter_session_expiry_sends_them_sooner(
) {
    let nats = NatsCluster::start(3);
    let mut a = replica("ra", &nats.urls(), &TIMING);
    let b = replica("rb", &nats.urls(), &TIMING);
    let mut watcher = MosquittoSub::start(&b, &["-t", "wills/#", "-v"]);
    // Connections that ended on A, their wills waiting for their delay.
    let waiting = device(&a, "waiting", 20, 3600);
    let session_ends = device(&a, "session-ends", 60, 12);
    let comes_back = device(&a, "comes-back", 20, 3600);
    // One still open when A dies: its delay starts then.
    let _open = device(&a, "open", 4, 3600);
    let t0 = Instant::now();
    drop((waiting, session_ends, comes_back));
    thread::sleep(Duration::from_secs(1));
    a.kill();
    // Back on B within its delay: no will (DESIGN.md §5).
    thread::sleep(Duration::from_secs(2));
    let _back = device(&b, "comes-back", 20, 3600);
    let wills = wills_until(&mut watcher, t0, Duration::from_secs(26));
    // A is taken for gone ~8.5 s after t0. Each will goes once, at the
    // later of the grace (2 s after that) and its own wait: the rest of a
    // 20 s delay (t0 + 20 s, not gone + 20 s) ...
    let at = once(&wills, "wills/waiting");
    assert!(
        at >= Duration::from_secs(19) && at <= Duration::from_secs(24),
        "waiting: {at:?}"
    );
    // ... a session that ends before the delay: at its end, t0 + 12 s
    // [MQTT-3.1.3-9] ...
    let at = once(&wills, "wills/session-ends");
    assert!(
        at >= Duration::from_millis(11_500) && at <= Duration::from_secs(17),
        "session-ends: {at:?}"
    );
    // ... and the open connection's 4 s delay counts from A's end.
    let at = once(&wills, "wills/open");
    assert!(
        at >= Duration::from_secs(10) && at <= Duration::from_secs(18),
        "open: {at:?}"
    );
    assert!(
        !wills.iter().any(|(t, _)| t == "wills/comes-back"),
        "{wills:?}"
    );
}

#[test]
fn the_wills_of_a_replica_cut_off_from_nats_are_sent_once_by_another_after_it_fenced() {
    let nats = NatsCluster::start(3);
    let proxy = NatsProxy::start(nats.client_addr(0));
    let mut a = {
        let mut args = cluster_args("ra", &[proxy.url()]);
        args.extend(TIMING.iter().map(|s| s.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Broker::start(&args)
    };
    let b = replica("rb", &nats.urls(), &TIMING);
    let mut watcher = MosquittoSub::start(&b, &["-t", "wills/#", "-v"]);
    let waiting = device(&a, "waiting", 10, 3600);
    let mut open = device(&a, "open", 0, 0);
    let t0 = Instant::now();
    drop(waiting);
    thread::sleep(Duration::from_secs(1));
    // A loses NATS: it fences within 7T/6 (5.8 s), closing its connections
    // with 0x8B and handing their wills over; B takes it for gone ~7.5 s
    // after its last write.
    drop(proxy);
    expect_disconnect(&mut open, 0x8b, Duration::from_secs(8));
    let (reason, _) = wait_ready(&a, 503, Duration::from_secs(2));
    assert!(reason.contains("fenced"), "{reason}");
    let wills = wills_until(&mut watcher, t0, Duration::from_secs(20));
    // Each once: the open one at gone + grace, the waiting one at the
    // later of that and t0 + 10 s.
    let at = once(&wills, "wills/open");
    assert!(
        at >= Duration::from_secs(8) && at <= Duration::from_secs(16),
        "open: {at:?}"
    );
    let at = once(&wills, "wills/waiting");
    assert!(
        at >= Duration::from_secs(9) && at <= Duration::from_secs(16),
        "waiting: {at:?}"
    );
    a.kill();
}

/// The entry of `client_id` in `mqtt-sessions`: (operation, replica).
fn owner_entry(nats: &NatsCluster, client_id: &str) -> Option<(String, String)> {
    crate::nats::block_on(async {
        let client = async_nats::connect(nats.url(0)).await.unwrap();
        let js = async_nats::jetstream::new(client);
        let kv = js.get_key_value("mqtt-sessions").await.unwrap();
        let entry = kv.entry(client_key(client_id)).await.unwrap()?;
        let replica = serde_json::from_slice::<serde_json::Value>(&entry.value)
            .ok()
            .and_then(|v| v["replica"].as_str().map(str::to_owned))
            .unwrap_or_default();
        Some((format!("{:?}", entry.operation), replica))
    })
}

#[test]
fn a_killed_replicas_client_identifiers_are_swept_and_one_that_reconnected_elsewhere_stays() {
    let nats = NatsCluster::start(3);
    let mut a = replica("ra", &nats.urls(), &TIMING);
    let b = replica("rb", &nats.urls(), &TIMING);
    let (code, _away) = connect_v5(&a, "stays-away");
    assert_eq!(code, 0);
    let (code, _moves) = connect_v5(&a, "moves");
    assert_eq!(code, 0);
    assert_eq!(
        owner_entry(&nats, "stays-away").map(|e| e.1).as_deref(),
        Some("ra")
    );
    a.kill();
    // A CONNECT on B for a client identifier A owned does not wait for A
    // to be taken for gone, nor for the sweep.
    let started = Instant::now();
    let (code, mut moved) = connect_v5(&b, "moves");
    assert_eq!(code, 0);
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "CONNACK after {:?}",
        started.elapsed()
    );
    // A is gone ~7.5 s after its last write; the leader then sweeps its
    // entries with a compare-and-set: the one B re-claimed stays.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match owner_entry(&nats, "stays-away") {
            Some((op, _)) if op == "Put" => {}
            _ => break,
        }
        assert!(
            Instant::now() < deadline,
            "the entry of a gone replica's client was not swept"
        );
        thread::sleep(Duration::from_millis(250));
    }
    assert_eq!(
        owner_entry(&nats, "moves"),
        Some(("Put".to_owned(), "rb".to_owned()))
    );
    moved.send(&build::subscribe(1, "t", 0, true));
    assert!(matches!(
        moved.read(Duration::from_secs(2)),
        Incoming::Packet { header: 0x90, .. }
    ));
    assert!(
        b.stderr().contains("swept the client identifier ownership"),
        "{}",
        b.stderr()
    );
}
