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

pub(crate) const TIMING: [&str; 4] = [
    "--set",
    "cluster.member_ttl=5s",
    "--set",
    "cluster.will_stop_grace=2s",
];

/// An MQTT 5 device `id` on `broker` with a will on `wills/<id>`
/// (payload `offline`), its Will Delay Interval `delay` and Session
/// Expiry Interval `expiry` (seconds).
pub(crate) fn device(broker: &Broker, id: &str, delay: u32, expiry: u32) -> RawClient {
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
pub(crate) fn wills_until(
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
pub(crate) fn once(wills: &[(String, Duration)], topic: &str) -> Duration {
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
    // Back on B within its delay, the session going on (Clean Start 0):
    // no will (DESIGN.md §5, [MQTT-3.1.3-9]).
    thread::sleep(Duration::from_secs(2));
    let _back = crate::cluster_wills::reconnect(&b, "comes-back", false);
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

/// The `mqtt-session-will` entry of `client_id`: its operation.
pub(crate) fn will_entry(nats: &NatsCluster, client_id: &str) -> Option<String> {
    crate::nats::block_on(async {
        let client = async_nats::connect(nats.url(0)).await.unwrap();
        let js = async_nats::jetstream::new(client);
        let kv = js.get_key_value("mqtt-session-will").await.unwrap();
        let entry = kv.entry(client_key(client_id)).await.unwrap()?;
        Some(format!("{:?}", entry.operation))
    })
}

/// A CONNECT of `id` (with a will when `will`) to `mqtt`: its CONNACK
/// code (None: none came within 20 s) and how long it took.
fn timed_connect(
    mqtt: std::net::SocketAddr,
    id: &str,
    will: bool,
) -> (Option<u8>, Duration, RawClient) {
    let topic = format!("wills/{id}");
    let connect = build::Connect {
        will: will.then_some(build::Will {
            topic: &topic,
            payload: b"offline",
            delay_secs: None,
            payload_format: None,
        }),
        ..build::Connect::v5(id)
    };
    let mut client = RawClient::connect(mqtt);
    let started = Instant::now();
    client.send(&connect.encode());
    let code = match client.read(Duration::from_secs(20)) {
        Incoming::Packet { header: 0x20, body } if body.len() >= 2 => Some(body[1]),
        _ => None,
    };
    (code, started.elapsed(), client)
}

#[test]
fn nats_at_four_seconds_a_round_trip_fences_nothing_loses_nothing_acknowledged_and_answers_every_connect_in_budget(
) {
    let nats = NatsCluster::start(1);
    let proxy = NatsProxy::start(nats.client_addr(0));
    // The default member_ttl (10 s): DESIGN.md §6 "NATS slow 2–6 s".
    let budget = Duration::from_secs(6);
    let a = replica(
        "ra",
        &[proxy.url()],
        &[
            "--set",
            "cluster.nats_replicas=1",
            "--set",
            "cluster.connect_budget=6s",
        ],
    );
    let (code, mut sub) = connect_v5(&a, "sub");
    assert_eq!(code, 0);
    sub.send(&build::subscribe(1, "data/#", 1, true));
    assert!(matches!(
        sub.read(Duration::from_secs(2)),
        Incoming::Packet { header: 0x90, .. }
    ));
    let (code, mut publisher) = connect_v5(&a, "pub");
    assert_eq!(code, 0);
    let mut wills = MosquittoSub::start(&a, &["-t", "wills/#", "-v"]);
    proxy.set_round_trip(Duration::from_secs(4));
    thread::sleep(Duration::from_secs(1));
    let slow_since = Instant::now();
    // Readiness all along: no fence (7T/6 is 11.7 s; a write lands 4 s
    // after it was sent).
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = {
        let (stop, admin) = (stop.clone(), a.admin);
        thread::spawn(move || {
            let mut not_ready = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                if let Ok((status, body)) = crate::harness::http_get(admin, "/health/ready") {
                    if status != 200 {
                        not_ready.push(body);
                    }
                }
                thread::sleep(Duration::from_millis(250));
            }
            not_ready
        })
    };
    // CONNECTs: the claim of a new client identifier is one round trip
    // (4 s), a will one more (8 s in all, past the 6 s budget). Each is answered within the budget,
    // accepted or refused with 0x88 [MQTT-3.2.2-6: 0x88 Server unavailable].
    let devices: Vec<_> = (0..6)
        .map(|i| {
            let mqtt = a.mqtt;
            let with_will = i % 2 == 1;
            thread::spawn(move || {
                let id = format!("device-{i}");
                let (code, took, client) = timed_connect(mqtt, &id, with_will);
                (id, with_will, code, took, client)
            })
        })
        .collect();
    // Meanwhile QoS 1 publishes: each acknowledged one reaches the
    // subscriber; a retained one is acknowledged once NATS has it.
    for pid in 1..=20u16 {
        publisher.send(&crate::cluster_retained::publish(
            "data/x",
            &pid.to_be_bytes(),
            1,
            false,
            pid,
            true,
        ));
    }
    publisher.send(&crate::cluster_retained::publish(
        "state/kept",
        b"kept",
        1,
        true,
        21,
        true,
    ));
    let mut acked = Vec::new();
    let until = Instant::now() + Duration::from_secs(15);
    while acked.len() < 21 && Instant::now() < until {
        if let Incoming::Packet { header: 0x40, body } = publisher.read(Duration::from_millis(500))
        {
            acked.push(u16::from_be_bytes([body[0], body[1]]));
        }
    }
    assert_eq!(
        acked,
        (1..=21).collect::<Vec<u16>>(),
        "PUBACKs in order, the retained one too"
    );
    let mut delivered = Vec::new();
    while let Incoming::Packet { header, body } = sub.read(Duration::from_millis(500)) {
        if header & 0xf0 == 0x30 {
            delivered.push(u16::from_be_bytes([
                body[body.len() - 2],
                body[body.len() - 1],
            ]));
        }
    }
    for pid in 1..=20u16 {
        assert!(
            delivered.contains(&pid),
            "acknowledged value {pid} not delivered: {delivered:?}"
        );
    }
    let answered: Vec<_> = devices.into_iter().map(|d| d.join().unwrap()).collect();
    for (id, with_will, code, took, _) in &answered {
        assert!(
            matches!(code, Some(0) | Some(0x88)),
            "{id} (will: {with_will}): CONNACK {code:?} after {took:?}"
        );
        assert!(
            *took <= budget + Duration::from_millis(1500),
            "{id}: CONNACK after {took:?}"
        );
    }
    // NATS stays slow past T (10 s): still no fence.
    thread::sleep(Duration::from_secs(11).saturating_sub(slow_since.elapsed()));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let not_ready = watcher.join().unwrap();
    assert!(
        not_ready.is_empty(),
        "not ready while NATS was slow: {not_ready:?}"
    );
    assert!(
        slow_since.elapsed() >= Duration::from_secs(10),
        "the slow phase was too short to mean anything"
    );
    // NATS fast again; what landed late for a refused CONNECT is undone.
    proxy.set_round_trip(Duration::ZERO);
    thread::sleep(Duration::from_secs(6));
    for (id, with_will, code, took, _) in &answered {
        let entry = will_entry(&nats, id);
        if *with_will && *code == Some(0) {
            assert_eq!(
                entry.as_deref(),
                Some("Put"),
                "{id}: accepted after {took:?}, its will is stored"
            );
        } else {
            assert!(
                entry.as_deref() != Some("Put"),
                "{id}: refused after {took:?}, yet a will is stored"
            );
        }
    }
    // No will was sent for anyone (all connections are still open).
    assert_eq!(wills.next_message(Duration::from_millis(500)), None);
    // The acknowledged retained value is there for a new subscriber.
    let (_, mut late) = connect_v5(&a, "late");
    late.send(&build::subscribe(1, "state/#", 1, true));
    let mut kept = false;
    while let Incoming::Packet { header, body } = late.read(Duration::from_secs(2)) {
        kept |= header & 0xf0 == 0x30 && body.ends_with(b"kept");
    }
    assert!(kept, "the acknowledged retained value is lost");
    let refused = answered.iter().filter(|d| d.2 == Some(0x88)).count();
    eprintln!(
        "NATS at 4 s: {} CONNECTs accepted, {refused} refused with 0x88",
        answered.len() - refused
    );
}

#[test]
fn a_replica_back_from_a_fence_it_alone_saw_hands_the_wills_of_its_closed_connections_over_once() {
    let nats = NatsCluster::start(1);
    let proxy = NatsProxy::start(nats.client_addr(0));
    let mut settings = vec!["--set", "cluster.nats_replicas=1"];
    settings.extend(TIMING);
    let a = replica("ra", &[proxy.url()], &settings);
    let b = replica("rb", &nats.urls(), &settings);
    let mut open = device(&a, "open", 0, 0);
    // What NATS sends A is held: A's writes land (the others keep seeing
    // it) but it hears of none, and fences, closing its connections and
    // handing their wills over.
    proxy.set_hold(true);
    expect_disconnect(&mut open, 0x8b, Duration::from_secs(10));
    let (_, status) = b.admin_get("/api/v1/status");
    assert!(
        status.contains("\"members\":[\"ra\",\"rb\"]"),
        "B lost sight of A: {status}"
    );
    // Released: A serves again at a new epoch, and the will of the
    // connection it closed is sent once, by the leader, after the grace.
    proxy.set_hold(false);
    wait_ready(&a, 200, Duration::from_secs(15));
    let sent = || {
        a.metric_sum("fleetmq_cluster_wills_sent_total")
            + b.metric_sum("fleetmq_cluster_wills_sent_total")
    };
    let deadline = Instant::now() + Duration::from_secs(15);
    while sent() < 1.0 {
        assert!(
            Instant::now() < deadline,
            "the handed-over will was not sent"
        );
        thread::sleep(Duration::from_millis(250));
    }
    thread::sleep(Duration::from_secs(3));
    assert_eq!(sent(), 1.0, "sent more than once");
    assert_ne!(will_entry(&nats, "open").as_deref(), Some("Put"));
}

/// Waits (at most `within`) until `client_id`'s `mqtt-sessions` entry is
/// `wanted` (`None`: a delete marker or none).
fn wait_owner(nats: &NatsCluster, client_id: &str, wanted: Option<&str>, within: Duration) {
    let deadline = Instant::now() + within;
    loop {
        let now = owner_entry(nats, client_id).filter(|(op, _)| op == "Put").map(|e| e.1);
        if now.as_deref() == wanted {
            return;
        }
        assert!(Instant::now() < deadline, "{client_id}: owner {now:?} after {within:?}, expected {wanted:?}");
        thread::sleep(Duration::from_millis(100));
    }
}

/// An MQTT 5 client `id` with Session Expiry Interval `expiry` seconds.
fn session(broker: &Broker, id: &str, expiry: u32) -> RawClient {
    let connect = build::Connect { session_expiry: Some(expiry), ..build::Connect::v5(id) };
    let mut client = RawClient::connect(broker.mqtt);
    assert_eq!(client.handshake(&connect.encode()).1, 0, "CONNECT of {id}");
    client
}

#[test]
fn a_persistent_sessions_ownership_outlives_its_connection_until_the_session_expires() {
    let nats = NatsCluster::start(3);
    let a = replica("ra", &nats.urls(), &TIMING);
    let b = replica("rb", &nats.urls(), &TIMING);
    // A clean session's client identifier is given up when its connection
    // ends; a persistent session's stays with the replica that keeps the
    // session (no write to NATS at the disconnect).
    drop(session(&a, "goes", 0));
    drop(session(&a, "keeps", 4));
    wait_owner(&nats, "goes", None, Duration::from_secs(3));
    assert_eq!(owner_entry(&nats, "keeps"), Some(("Put".to_owned(), "ra".to_owned())));
    // Back on the same replica: its own entry is claimed over.
    let mut back = session(&a, "keeps", 4);
    back.send(&build::subscribe(1, "t", 0, true));
    assert!(matches!(back.read(Duration::from_secs(2)), Incoming::Packet { header: 0x90, .. }));
    // Taken over by another replica within a second, the parked claim
    // notwithstanding (DESIGN.md §6).
    let (code, moved) = connect_v5(&b, "keeps");
    assert_eq!(code, 0);
    expect_disconnect(&mut back, 0x8e, Duration::from_secs(1));
    wait_owner(&nats, "keeps", Some("rb"), Duration::from_secs(1));
    // Clean Start with no expiry (connect_v5), but taken from another
    // replica: B keeps the entry past the end of the connection (will
    // grace + 2 member TTLs), so that the sweeper, had A been lost with
    // this client's will, reads the client as back (DESIGN.md §5).
    drop(moved);
    thread::sleep(Duration::from_secs(2));
    assert_eq!(owner_entry(&nats, "keeps").map(|e| e.1).as_deref(), Some("rb"), "parked: it came from A");
    // A persistent session on B (its own claim over B's entry: not taken
    // from another replica): parked, and released once its expiry (4 s)
    // passed since the connection ended; the older parked claims, A's and
    // B's, never remove it.
    drop(session(&b, "keeps", 4));
    let ended = Instant::now();
    thread::sleep(Duration::from_secs(3));
    assert_eq!(owner_entry(&nats, "keeps").map(|e| e.1).as_deref(), Some("rb"), "parked for the session's expiry");
    wait_owner(&nats, "keeps", None, Duration::from_secs(4));
    assert!(ended.elapsed() >= Duration::from_secs(4), "released after {:?}", ended.elapsed());
}
