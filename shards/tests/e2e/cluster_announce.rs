//! Route announces over the mesh (protocol version 3; issue 25): a
//! subscriber on replica B holds its SUBACK, a client publishes at once
//! on replica A, and the value reaches the subscriber, for every one of
//! many fresh filters. The SUBACK waited for B's write of `mqtt-routes`
//! and for A's answer to B's announce (A applied the route on all of its
//! shards); without the announce (a peer speaking version 2) A learns the
//! route from its watch of the bucket some milliseconds later, and a
//! value published meanwhile goes to nobody on B. The same for the
//! CONNACK of a persistent session taken up from another replica.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use crate::cluster::cluster_args;
use crate::cluster_mesh::{mesh_args, publisher, status, wait_links, Certs};
use crate::harness::Broker;
use crate::nats::NatsCluster;
use crate::raw::{wire as build, Incoming, RawClient};

/// Replica `id` with the mesh and `--shards 2` (the announce must be
/// applied on every shard, not only the one its link reached), with
/// `env` set.
fn start(id: &str, nats: &NatsCluster, certs: &Certs, env: &[(&str, &str)]) -> Broker {
    let mut args = cluster_args(id, &nats.urls());
    args.extend(mesh_args(id, certs, None, &["--shards", "2"]));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Broker::start_with_env(&args, env)
}

/// The topic of a PUBLISH packet's body (MQTT 5).
fn topic_of(body: &[u8]) -> String {
    let n = usize::from(u16::from_be_bytes([body[0], body[1]]));
    String::from_utf8_lossy(&body[2..2 + n]).into_owned()
}

/// What [`subscribe_then_publish`] saw.
struct Run {
    /// Filters whose value never arrived.
    missed: Vec<String>,
    /// Each SUBACK's time after its SUBSCRIBE was written.
    subacks: Vec<Duration>,
}

/// For each of `n` fresh filters `<prefix>/<i>`: `sub` subscribes, and as
/// soon as its SUBACK is read `publisher` publishes one value on it. The
/// values that arrive (during the run and for 3 s after) are counted.
fn subscribe_then_publish(sub: &mut RawClient, publisher: &mut RawClient, prefix: &str, n: usize) -> Run {
    let mut got = HashSet::new();
    let mut subacks = Vec::new();
    let read = |sub: &mut RawClient, timeout: Duration, got: &mut HashSet<String>| -> Option<u8> {
        match sub.read(timeout) {
            Incoming::Packet { header, body } if header & 0xf0 == 0x30 => {
                got.insert(topic_of(&body));
                Some(0x30)
            }
            Incoming::Packet { header, .. } => Some(header),
            Incoming::TimedOut => None,
            Incoming::Closed => panic!("the subscriber's connection closed"),
        }
    };
    for i in 0..n {
        let filter = format!("{prefix}/{i}");
        let sent = Instant::now();
        sub.send(&build::subscribe((i % 60_000 + 1) as u16, &filter, 0, true));
        loop {
            match read(sub, Duration::from_secs(5), &mut got) {
                Some(0x90) => break,
                Some(_) => {}
                None => panic!("no SUBACK for {filter} within 5 s"),
            }
        }
        subacks.push(sent.elapsed());
        publisher.send(&build::publish_qos0(&filter, b"first", true));
    }
    while read(sub, Duration::from_secs(3), &mut got).is_some() {}
    let missed = (0..n).map(|i| format!("{prefix}/{i}")).filter(|f| !got.contains(f)).collect();
    Run { missed, subacks }
}

fn quantile(sorted: &[Duration], q: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

fn describe(run: &Run) -> String {
    let mut s = run.subacks.clone();
    s.sort();
    format!(
        "{} missed of {}; SUBACK median {:?}, p99 {:?}, max {:?}",
        run.missed.len(),
        run.subacks.len(),
        quantile(&s, 0.5),
        quantile(&s, 0.99),
        s[s.len() - 1]
    )
}

/// Two replicas linked, what keeps them running, and the run.
struct Two {
    run: Run,
    a: Broker,
    b: Broker,
    _certs: Certs,
    _nats: NatsCluster,
}

/// Two replicas linked (B's environment `env_b`), a subscriber on B and
/// a publisher on A, and the run over `n` filters.
fn two_replicas_run(prefix: &str, env_b: &[(&str, &str)], n: usize) -> Two {
    let nats = NatsCluster::start(3);
    let (ida, idb) = (format!("{prefix}a"), format!("{prefix}b"));
    let certs = Certs::new(&format!("{ida},{idb}"));
    let a = start(&ida, &nats, &certs, &[]);
    let b = start(&idb, &nats, &certs, env_b);
    // Each of the two shards dials one link to the other replica.
    wait_links(&a, 2, Duration::from_secs(15));
    wait_links(&b, 2, Duration::from_secs(15));
    let mut sub = RawClient::connect(b.mqtt);
    assert_eq!(sub.handshake(&build::Connect::v5(&format!("sub-{prefix}")).encode()).1, 0);
    let mut publisher = publisher(&a, &format!("pub-{prefix}"));
    let run = subscribe_then_publish(&mut sub, &mut publisher, prefix, n);
    eprintln!("{prefix}: {}", describe(&run));
    Two { run, a, b, _certs: certs, _nats: nats }
}

#[test]
fn a_value_published_on_another_replica_right_after_the_suback_reaches_the_subscriber() {
    let Two { run, a, b, .. } = two_replicas_run("ann", &[], 200);
    // Once the client holds its SUBACK the subscription exists, and a
    // value the server takes ownership of goes to every client with a
    // matching subscription [MQTT-4.5.0-1], whichever replica took it.
    assert!(run.missed.is_empty(), "{}: {:?}", describe(&run), run.missed);
    assert_eq!(b.metric_sum("fleetmq_routes_late_total"), 0.0, "no SUBACK waited past 2 s");
    // The links agreed the newest version (the log names it).
    let newest = format!("version={}", fleetmq_core::mesh::VERSIONS.last().expect("one at least"));
    assert!(a.stderr().contains(&newest) && b.stderr().contains(&newest), "{newest}: {}", b.stderr());
}

#[test]
fn with_a_peer_that_speaks_version_2_the_link_stays_up_and_routes_come_from_the_watch() {
    let two = two_replicas_run("old", &[("FLEETMQ_MESH_VERSIONS", "1,2")], 200);
    let (run, a, b) = (&two.run, &two.a, &two.b);
    // Linked in version 2 both ways, no announce: the SUBACK waits only
    // for the bucket, and a value published at once may miss (the
    // route reaches A through its watch).
    assert!(b.stderr().contains("version=2") && !b.stderr().contains("version=3"), "{}", b.stderr());
    assert_eq!(status(a)["cluster"]["mesh_links_up"], 2);
    assert_eq!(status(b)["cluster"]["mesh_links_up"], 2);
    // The watch brought every route meanwhile: a second value on each
    // filter arrives.
    let mut publisher = publisher(a, "pub-old-2");
    let mut sub = RawClient::connect(b.mqtt);
    assert_eq!(sub.handshake(&build::Connect::v5("sub-old-2").encode()).1, 0);
    sub.send(&build::subscribe(1, "old/#", 0, true));
    assert!(matches!(sub.read(Duration::from_secs(5)), Incoming::Packet { header: 0x90, .. }));
    std::thread::sleep(Duration::from_secs(1));
    publisher.send(&build::publish_qos0("old/7", b"second", true));
    assert!(matches!(sub.read(Duration::from_secs(5)), Incoming::Packet { header: 0x30, .. }), "{}", describe(run));
}

#[test]
fn a_value_published_on_another_replica_right_after_a_session_take_up_reaches_the_client() {
    // Three replicas: sessions start on C, are taken up on B, values are
    // published on A (which knew no route to either before).
    let nats = NatsCluster::start(3);
    let certs = Certs::new("tua,tub,tuc");
    let one_shard: &[&str] = &["--shards", "1"];
    let replica = |id: &str| {
        let mut args = cluster_args(id, &nats.urls());
        args.extend(mesh_args(id, &certs, None, one_shard));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Broker::start(&args)
    };
    let (a, b, c) = (replica("tua"), replica("tub"), replica("tuc"));
    for r in [&a, &b, &c] {
        wait_links(r, 2, Duration::from_secs(15));
    }
    let mut publisher = publisher(&a, "pub-tu");
    let mut missed = Vec::new();
    // Each take-up waits out the 1 s flap delay of its claim
    // (fleetmq_nats_bridge::FLAP_DELAY): 30 of them.
    for i in 0..30 {
        let (id, topic) = (format!("tu-{i}"), format!("tu/{i}"));
        let persistent = build::Connect { clean: false, session_expiry: Some(300), ..build::Connect::v5(&id) };
        let mut on_c = RawClient::connect(c.mqtt);
        assert_eq!(on_c.handshake(&persistent.encode()), (0, 0));
        on_c.send(&build::subscribe(1, &topic, 0, true));
        assert!(matches!(on_c.read(Duration::from_secs(5)), Incoming::Packet { header: 0x90, .. }));
        on_c.send(&build::disconnect_v5(0));
        assert!(matches!(on_c.read(Duration::from_secs(5)), Incoming::Closed));
        // Taken up at B: Session Present 1 [MQTT-3.2.2-2], its
        // subscription live again; the CONNACK waited for its route.
        let mut on_b = RawClient::connect(b.mqtt);
        assert_eq!(on_b.handshake(&persistent.encode()), (1, 0), "{id}");
        publisher.send(&build::publish_qos0(&topic, b"first", true));
        match on_b.read(Duration::from_secs(3)) {
            Incoming::Packet { header, body } if header & 0xf0 == 0x30 => assert_eq!(topic_of(&body), topic),
            _ => missed.push(topic),
        }
        on_b.send(&build::disconnect_v5(0));
    }
    // [MQTT-4.5.0-1]: the client holds its CONNACK, its subscription
    // exists; a value A took goes to it.
    assert!(missed.is_empty(), "{} of 30 missed: {missed:?}", missed.len());
}
