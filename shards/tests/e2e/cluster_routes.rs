//! `mqtt-routes` (DESIGN.md §4, §10; issue 25): one entry per distinct
//! filter per replica, written before the SUBACK and deleted with the last
//! local subscriber; a shared subscription and a workspace's filter as
//! subscribed; another replica applies the entries of live peers only; a
//! replica SIGKILLed has its entries swept once taken for gone, and a
//! restarted one purges its leftovers before it is ready. Against a real
//! 3-server NATS cluster, `member_ttl` 5 s.

use std::thread;
use std::time::{Duration, Instant};

use fleetmq_core::cluster::routes::route_key;

use crate::cluster::replica;
use crate::harness::Broker;
use crate::nats::NatsCluster;
use crate::raw::{wire as build, Incoming, RawClient};
use crate::security::{passwd, Login, TempDir};

/// `member_ttl` of these tests.
const TTL: &str = "cluster.member_ttl=5s";

/// The entries of `mqtt-routes` whose key starts with `replica.`: (key,
/// record as JSON).
fn entries(nats: &NatsCluster, replica: &str) -> Vec<(String, serde_json::Value)> {
    let (urls, prefix) = (nats.urls(), format!("{replica}."));
    crate::nats::block_on(async move {
        use futures_util::StreamExt;
        let js = async_nats::jetstream::new(crate::nats::connect(&urls).await);
        // JetStream may answer an error, or nothing, for a moment after
        // NATS came back (a stream leader being elected): asked again,
        // for up to 15 s.
        let deadline = Instant::now() + Duration::from_secs(15);
        let (kv, listing) = loop {
            let got = match js.get_key_value("mqtt-routes").await {
                Ok(kv) => kv.keys().await.map(|listing| (kv, listing)).map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            match got {
                Ok(got) => break got,
                Err(e) => assert!(Instant::now() < deadline, "keys of mqtt-routes: {e}"),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        let keys: Vec<String> = listing.filter_map(|k| async { k.ok() }).collect().await;
        let mut out = Vec::new();
        for key in keys.into_iter().filter(|k| k.starts_with(&prefix) && k[prefix.len()..].find('.').is_none()) {
            if let Ok(Some(value)) = kv.get(&key).await {
                out.push((key, serde_json::from_slice(&value).expect("a JSON record")));
            }
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    })
}

/// The filters of `replica`'s entries, sorted.
fn filters(nats: &NatsCluster, replica: &str) -> Vec<String> {
    let mut f: Vec<String> =
        entries(nats, replica).into_iter().map(|(_, r)| r["filter"].as_str().unwrap().to_owned()).collect();
    f.sort();
    f
}

/// Waits until `what()` is `want`, at most `within`.
fn eventually<T: PartialEq + std::fmt::Debug>(within: Duration, want: T, what: impl Fn() -> T) -> Duration {
    let started = Instant::now();
    loop {
        let now = what();
        if now == want {
            return started.elapsed();
        }
        assert!(started.elapsed() < within, "still {now:?} after {within:?}, expected {want:?}");
        thread::sleep(Duration::from_millis(100));
    }
}

/// An MQTT 5 client of `broker` signed in with `login`.
fn client(broker: &Broker, login: &Login) -> RawClient {
    let mut c = RawClient::connect(broker.mqtt);
    assert_eq!(c.handshake(&login.encode()).1, 0, "CONNACK of {}", login.client_id);
    c
}

/// SUBSCRIBE `filter` (MQTT 5, QoS 0) and read its SUBACK.
fn subscribe(c: &mut RawClient, packet_id: u16, filter: &str) {
    c.send(&build::subscribe(packet_id, filter, 0, true));
    match c.read(Duration::from_secs(5)) {
        Incoming::Packet { header: 0x90, body } => assert_eq!(body[3..], [0], "SUBACK of {filter}: {body:02x?}"),
        other => panic!("expected the SUBACK of {filter}, got {other:02x?}"),
    }
}

/// UNSUBSCRIBE `filter` (MQTT 5) and read its UNSUBACK.
fn unsubscribe(c: &mut RawClient, packet_id: u16, filter: &str) {
    let mut body = packet_id.to_be_bytes().to_vec();
    body.push(0);
    body.extend(build::string(filter.as_bytes()));
    c.send(&build::packet(0xa2, &body));
    assert!(matches!(c.read(Duration::from_secs(5)), Incoming::Packet { header: 0xb0, .. }), "UNSUBACK of {filter}");
}

/// Replica `rb`: two shards, anonymous clients and user `a1` of workspace
/// `alpha` (password `pw`).
fn replica_b(nats: &NatsCluster, dir: &TempDir) -> Broker {
    let file = dir.path("passwd");
    if !file.exists() {
        passwd(&file, "a1", "pw", Some("alpha"));
    }
    let file = format!("auth.password_file=\"{}\"", file.display());
    replica("rb", &nats.urls(), &["--shards", "2", "--set", TTL, "--set", &file, "--set", "auth.allow_anonymous=true"])
}

#[test]
fn a_replica_writes_one_route_per_filter_before_the_suback_and_deletes_it_with_the_last_subscriber() {
    let nats = NatsCluster::start(3);
    let dir = TempDir::new("cluster-routes");
    let a = replica("ra", &nats.urls(), &["--set", TTL]);
    let b = replica_b(&nats, &dir);

    // The first subscriber: its SUBACK comes once the entry is written.
    let mut first = client(&b, &Login::v5("sub-0"));
    let started = Instant::now();
    subscribe(&mut first, 1, "r/+/x");
    let new_filter = started.elapsed();
    let written = entries(&nats, "rb");
    assert_eq!(written.len(), 1, "{written:?}");
    assert_eq!(written[0].0, route_key("rb", "r/+/x"));
    assert_eq!(written[0].1["filter"], "r/+/x");
    assert_eq!(written[0].1["replica"], "rb");
    // More subscribers of the filter, spread over B's two shards by
    // client identifier: still one entry.
    let mut more: Vec<RawClient> = (1..8).map(|i| client(&b, &Login::v5(&format!("sub-{i}")))).collect();
    let started = Instant::now();
    for c in &mut more {
        subscribe(c, 1, "r/+/x");
    }
    let written_filter = started.elapsed() / 7;
    eprintln!("SUBSCRIBE to SUBACK: {new_filter:?} for a new filter (route written first), {written_filter:?} on average for one written");
    assert_eq!(filters(&nats, "rb"), ["r/+/x"]);
    // A applies B's entry.
    eventually(Duration::from_secs(3), 1.0, || a.metric_sum("fleetmq_routes_remote"));
    assert_eq!(b.metric_sum("fleetmq_routes_local"), 1.0);

    // Unsubscribed one by one: the entry stays while one is left...
    for c in &mut more {
        unsubscribe(c, 2, "r/+/x");
    }
    thread::sleep(Duration::from_millis(300));
    assert_eq!(filters(&nats, "rb"), ["r/+/x"]);
    // ... and goes with the last.
    unsubscribe(&mut first, 2, "r/+/x");
    eventually(Duration::from_secs(3), Vec::<String>::new(), || filters(&nats, "rb"));
    eventually(Duration::from_secs(3), 0.0, || a.metric_sum("fleetmq_routes_remote"));

    // A shared subscription is its own entry, as subscribed; a workspace's
    // filter carries its prefix (U+0000, the workspace, `/`).
    subscribe(&mut first, 3, "$share/g/x");
    let mut alpha = client(&b, &Login::v5("alpha-1").user("a1", "pw"));
    subscribe(&mut alpha, 1, "w/#");
    assert_eq!(filters(&nats, "rb"), ["\u{0}alpha/w/#", "$share/g/x"]);
    assert!(entries(&nats, "rb").iter().any(|(k, _)| *k == route_key("rb", "\u{0}alpha/w/#")));
    eventually(Duration::from_secs(3), 2.0, || a.metric_sum("fleetmq_routes_remote"));
    let (_, status) = b.admin_get("/api/v1/status");
    let status: serde_json::Value = serde_json::from_str(&status).expect("JSON");
    let routes = &status["cluster"]["routes"];
    assert_eq!((routes["local"].as_u64(), routes["remote"].as_u64(), routes["late"].as_u64()), (Some(2), Some(0), Some(0)), "{status}");
    assert_eq!(b.metric_sum("fleetmq_routes_late_total"), 0.0);
    drop((first, more, alpha));
}

#[test]
fn the_routes_of_a_replica_killed_are_purged_at_its_restart_and_swept_once_it_is_gone() {
    let nats = NatsCluster::start(3);
    let dir = TempDir::new("cluster-routes-gone");
    let a = replica("ra", &nats.urls(), &["--set", TTL]);
    let mut b = replica_b(&nats, &dir);
    let mut c = client(&b, &Login::v5("sub-k"));
    subscribe(&mut c, 1, "k/1");
    subscribe(&mut c, 2, "k/2");
    eventually(Duration::from_secs(3), 2.0, || a.metric_sum("fleetmq_routes_remote"));

    // SIGKILLed and started again at once: the leftovers are purged before
    // it is ready, and A applies nothing of the old process.
    b.kill();
    drop(c);
    assert_eq!(filters(&nats, "rb"), ["k/1", "k/2"], "left over");
    // (It waits for the killed process's entry in mqtt-members to expire.)
    let b = replica_b(&nats, &dir);
    crate::cluster::wait_ready(&b, 200, Duration::from_secs(15));
    assert_eq!(filters(&nats, "rb"), Vec::<String>::new(), "purged before ready");
    eventually(Duration::from_secs(5), 0.0, || a.metric_sum("fleetmq_routes_remote"));
    // Rewritten by the new process's subscribers, and applied by A.
    let mut c = client(&b, &Login::v5("sub-k"));
    subscribe(&mut c, 1, "k/3");
    let written = entries(&nats, "rb");
    assert_eq!(written.len(), 1);
    assert_ne!(written[0].1["instance"], serde_json::Value::Null);
    eventually(Duration::from_secs(5), 1.0, || a.metric_sum("fleetmq_routes_remote"));

    // SIGKILLed for good: taken for gone (T + T/2 after its last write), A
    // drops its routes and, as the sweeper, deletes its entries.
    let mut b = b;
    b.kill();
    drop(c);
    let took = eventually(Duration::from_secs(20), 0.0, || a.metric_sum("fleetmq_routes_remote"));
    let swept = eventually(Duration::from_secs(10), Vec::<String>::new(), || filters(&nats, "rb"));
    eprintln!("routes of a killed replica: dropped by A after {took:?}, swept {swept:?} later");
}

/// Every NATS server lost: replica B fences and closes its subscriber,
/// whose route it cannot delete while NATS is away. Once NATS is back and
/// B serves again, the entry goes, and replica A drops it (before: it
/// stayed for good, and the mesh kept sending B the values of a filter
/// nobody on B wanted; found by a fresh-user pass).
#[test]
fn the_route_of_a_subscriber_closed_by_a_fence_goes_once_nats_is_back() {
    let mut nats = NatsCluster::start(3);
    let a = replica("ra", &nats.urls(), &["--set", TTL]);
    let b = replica("rb", &nats.urls(), &["--set", TTL]);
    let mut sub = RawClient::connect(b.mqtt);
    assert_eq!(sub.handshake(&build::Connect::v5("fenced-sub").encode()).1, 0);
    subscribe(&mut sub, 1, "fenced/#");
    eventually(Duration::from_secs(5), 1.0, || a.metric_sum("fleetmq_routes_remote"));
    for i in 0..3 {
        nats.stop(i);
    }
    // Fenced (7T/6 ≈ 6 s): its connections closed, the subscriber's too.
    crate::cluster::wait_ready(&b, 503, Duration::from_secs(15));
    crate::cluster::expect_disconnect(&mut sub, 0x8b, Duration::from_secs(3));
    // Long enough for the failing delete's retries to wait their longest
    // (5 s): B serves again while its delete waits.
    thread::sleep(Duration::from_secs(15));
    nats.restart_all();
    crate::cluster::wait_ready(&b, 200, Duration::from_secs(30));
    crate::cluster::wait_ready(&a, 200, Duration::from_secs(30));
    eventually(Duration::from_secs(15), Vec::<String>::new(), || filters(&nats, "rb"));
    eventually(Duration::from_secs(5), 0.0, || a.metric_sum("fleetmq_routes_remote"));
}
