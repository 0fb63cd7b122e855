//! The mesh (DESIGN.md §3, §6 "mesh cut", §11; issue 25) between real
//! replicas over real mutual TLS 1.3 with certificates from `fleetmq
//! cert`: links up in the status, values published on one replica reach
//! the subscribers of the others once and in order, a cut buffers and
//! delivers after it heals, a full buffer drops the oldest and counts
//! them, a certificate from another CA is refused and counted, and a
//! replica killed and restarted links again.

use std::path::PathBuf;
use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

use crate::cluster::replica;
use crate::harness::{Broker, MosquittoSub};
use crate::nats::{free_ports, NatsCluster, NatsProxy};
use crate::raw::{wire as build, Incoming, RawClient};

/// A folder of mesh certificates made by `fleetmq cert --names ...`,
/// removed when dropped.
pub(crate) struct Certs(PathBuf);

impl Certs {
    pub(crate) fn new(names: &str) -> Certs {
        let dir = std::env::temp_dir().join(format!("fleetmq-mesh-{}-{}", std::process::id(), rand_suffix()));
        let out = Command::new(env!("CARGO_BIN_EXE_fleetmq"))
            .args(["cert", "--out"])
            .arg(&dir)
            .args(["--names", names])
            .output()
            .expect("fleetmq cert runs");
        assert!(out.status.success(), "fleetmq cert: {}", String::from_utf8_lossy(&out.stderr));
        Certs(dir)
    }

    pub(crate) fn path(&self, file: &str) -> String {
        self.0.join(file).display().to_string()
    }
}

impl Drop for Certs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn rand_suffix() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(Instant::now().elapsed().as_nanos());
    h.finish()
}

/// The settings of replica `id` with the mesh on loopback (port 0 unless
/// `listen` says otherwise), its certificates from `certs` (the CA from
/// `ca`, by default the same folder), and `extra`.
pub(crate) fn mesh_args(id: &str, certs: &Certs, ca: Option<&Certs>, extra: &[&str]) -> Vec<String> {
    let mut args = vec![
        "--set".to_owned(),
        "cluster.member_ttl=5s".to_owned(),
        "--set".to_owned(),
        format!("cluster.mesh_cert={}", certs.path(&format!("{id}.pem"))),
        "--set".to_owned(),
        format!("cluster.mesh_key={}", certs.path(&format!("{id}.key"))),
        "--set".to_owned(),
        format!("cluster.mesh_ca={}", ca.unwrap_or(certs).path("ca.pem")),
    ];
    if !extra.contains(&"--shards") {
        // One link per peer (each shard dials its own).
        args.extend(["--shards".to_owned(), "1".to_owned()]);
    }
    if !extra.iter().any(|a| a.starts_with("cluster.mesh_listen")) {
        args.extend(["--set".to_owned(), "cluster.mesh_listen=127.0.0.1:0".to_owned()]);
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

pub(crate) fn start(id: &str, nats: &NatsCluster, certs: &Certs, extra: &[&str]) -> Broker {
    let args = mesh_args(id, certs, None, extra);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    replica(id, &nats.urls(), &args)
}

pub(crate) fn status(broker: &Broker) -> serde_json::Value {
    let (code, body) = broker.admin_get("/api/v1/status");
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).expect("status is JSON")
}

pub(crate) fn links_up(broker: &Broker) -> i64 {
    status(broker)["cluster"]["mesh_links_up"].as_i64().unwrap_or(-1)
}

/// Waits until `broker` has `n` mesh links up.
pub(crate) fn wait_links(broker: &Broker, n: i64, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    while links_up(broker) != n {
        assert!(Instant::now() < deadline, "mesh links up stayed {} (wanted {n}): {}", links_up(broker), status(broker));
        thread::sleep(Duration::from_millis(100));
    }
}

/// A publisher on `broker` (MQTT 5).
pub(crate) fn publisher(broker: &Broker, id: &str) -> RawClient {
    let mut c = RawClient::connect(broker.mqtt);
    assert_eq!(c.handshake(&build::Connect::v5(id).encode()).1, 0);
    c
}

/// Publishes `probe` values on `topic` from `client` until every one of
/// `subs` got one (the routes of their replicas reached the publisher's),
/// then reads what the probes left.
pub(crate) fn until_routed(client: &mut RawClient, topic: &str, subs: &mut [&mut MosquittoSub]) {
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut got = vec![false; subs.len()];
    while got.iter().any(|g| !g) {
        assert!(Instant::now() < deadline, "the routes did not reach the publisher's replica within 15 s");
        client.send(&build::publish_qos0(topic, b"probe", true));
        for (sub, got) in subs.iter_mut().zip(got.iter_mut()) {
            while let Some(m) = sub.next_message(Duration::from_millis(100)) {
                assert!(m.ends_with(" probe"), "{m}");
                *got = true;
            }
        }
    }
    thread::sleep(Duration::from_millis(300));
    for sub in subs.iter_mut() {
        while sub.next_message(Duration::from_millis(200)).is_some() {}
    }
}

/// The payloads `sub` receives until `timeout` passes without one.
pub(crate) fn payloads(sub: &mut MosquittoSub, timeout: Duration) -> Vec<String> {
    let mut out = Vec::new();
    while let Some(m) = sub.next_message(timeout) {
        out.push(m.rsplit(' ').next().unwrap_or_default().to_owned());
    }
    out
}

pub(crate) fn numbers(n: usize) -> Vec<String> {
    (0..n).map(|i| i.to_string()).collect()
}

#[test]
fn two_replicas_link_over_mutual_tls_and_the_status_shows_the_links() {
    let nats = NatsCluster::start(3);
    let certs = Certs::new("ma,mb");
    let a = start("ma", &nats, &certs, &[]);
    let b = start("mb", &nats, &certs, &[]);
    wait_links(&a, 1, Duration::from_secs(15));
    wait_links(&b, 1, Duration::from_secs(15));
    let s = status(&a);
    let peers = &s["cluster"]["mesh"]["peers"];
    assert_eq!(peers[0]["replica"], "mb", "{s}");
    assert_eq!(peers[0]["state"], "up", "{s}");
    assert_eq!(a.metric_sum("fleetmq_mesh_links_up"), 1.0);
    assert_eq!(a.metric_sum("fleetmq_mesh_refused_total"), 0.0);
    assert!(a.stderr().contains("mesh: link up"), "{}", a.stderr());
}

#[test]
fn a_replica_without_mesh_certificates_says_the_mesh_is_off() {
    let nats = NatsCluster::start(3);
    let a = replica("plain", &nats.urls(), &["--set", "cluster.member_ttl=5s"]);
    let s = status(&a);
    assert_eq!(s["cluster"]["mesh_links_up"], 0, "{s}");
    assert!(s["cluster"]["mesh"]["off"].is_string(), "{s}");
    assert!(a.stderr().contains("mesh: off"), "{}", a.stderr());
}

#[test]
fn a_value_published_on_one_replica_reaches_the_subscribers_of_the_others_once_and_in_order() {
    let nats = NatsCluster::start(3);
    let certs = Certs::new("pa,pb,pc");
    let a = start("pa", &nats, &certs, &[]);
    let b = start("pb", &nats, &certs, &["--shards", "2"]);
    let c = start("pc", &nats, &certs, &[]);
    for r in [&a, &b, &c] {
        wait_links(r, 2 * if std::ptr::eq(r, &b) { 2 } else { 1 }, Duration::from_secs(20));
    }
    // B: an exact and overlapping wildcard subscriptions on one session;
    // C: a multi-level wildcard.
    let mut on_b = MosquittoSub::start(&b, &["-t", "s/x", "-t", "s/+", "-t", "+/x"]);
    let mut on_c = MosquittoSub::start(&c, &["-t", "s/#"]);
    let mut on_b_other = MosquittoSub::start(&b, &["-t", "other"]);
    let mut publisher = publisher(&a, "pub-a");
    until_routed(&mut publisher, "s/x", &mut [&mut on_b, &mut on_c]);
    for i in 0..300 {
        publisher.send(&build::publish_qos0("s/x", i.to_string().as_bytes(), true));
    }
    // Each value once per subscriber (overlapping subscriptions of one
    // session give one copy), in the order published [MQTT-4.6.0-5].
    assert_eq!(payloads(&mut on_b, Duration::from_secs(3)), numbers(300));
    assert_eq!(payloads(&mut on_c, Duration::from_secs(1)), numbers(300));
    assert_eq!(on_b_other.next_message(Duration::from_millis(200)), None, "nothing for a filter that does not match");
    assert!(b.metric_sum("fleetmq_mesh_values_in_total") >= 300.0);
    assert_eq!(a.metric_sum("fleetmq_mesh_values_in_total"), 0.0, "nothing came back to the publisher's replica");
}

#[test]
fn an_unsubscribe_stops_the_values_going_to_that_replica() {
    let nats = NatsCluster::start(3);
    let certs = Certs::new("ua,ub");
    let a = start("ua", &nats, &certs, &[]);
    let b = start("ub", &nats, &certs, &[]);
    wait_links(&a, 1, Duration::from_secs(15));
    let mut sub = RawClient::connect(b.mqtt);
    assert_eq!(sub.handshake(&build::Connect::v5("sub-b").encode()).1, 0);
    sub.send(&build::subscribe(1, "u/+", 0, true));
    assert!(matches!(sub.read(Duration::from_secs(3)), Incoming::Packet { header: 0x90, .. }));
    let mut publisher = publisher(&a, "pub-u");
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        assert!(Instant::now() < deadline, "no value crossed");
        publisher.send(&build::publish_qos0("u/1", b"v", true));
        if let Incoming::Packet { header: 0x30, .. } = sub.read(Duration::from_millis(100)) {
            break;
        }
    }
    // UNSUBSCRIBE u/+ (MQTT 5: no properties) and its UNSUBACK.
    let mut body = 2u16.to_be_bytes().to_vec();
    body.push(0);
    body.extend(build::string(b"u/+"));
    sub.send(&build::packet(0xa2, &body));
    loop {
        match sub.read(Duration::from_secs(3)) {
            Incoming::Packet { header: 0xb0, .. } => break,
            Incoming::Packet { header: 0x30, .. } => {}
            other => panic!("expected UNSUBACK, got {other:?}"),
        }
    }
    thread::sleep(Duration::from_secs(2));
    let sent_before = a.metric_sum("fleetmq_mesh_values_out_total");
    for _ in 0..50 {
        publisher.send(&build::publish_qos0("u/1", b"w", true));
    }
    thread::sleep(Duration::from_secs(1));
    assert_eq!(a.metric_sum("fleetmq_mesh_values_out_total"), sent_before, "no value goes to a replica without the route");
    assert!(!matches!(sub.read(Duration::from_millis(300)), Incoming::Packet { header: 0x30, .. }));
}

/// Replica A (with `a_extra`) and replica B whose mesh is behind a fault
/// proxy (B listens on a free port, the proxy forwards to it, B
/// advertises the proxy), a subscriber on B to `<prefix>/#` and a
/// publisher on A whose values reach it; then the cut: what B says is
/// held, the link is closed and every new one hangs in its handshake.
struct Cut {
    proxy: NatsProxy,
    a: Broker,
    on_b: MosquittoSub,
    publisher: RawClient,
    _b: Broker,
    _certs: Certs,
    _nats: NatsCluster,
}

fn cut(prefix: &str, a_extra: &[&str]) -> Cut {
    let nats = NatsCluster::start(3);
    let (ida, idb) = (format!("{prefix}a"), format!("{prefix}b"));
    let certs = Certs::new(&format!("{ida},{idb}"));
    let a = start(&ida, &nats, &certs, a_extra);
    let listen = format!("127.0.0.1:{}", free_ports(1)[0]);
    let proxy = NatsProxy::start(listen.parse().unwrap());
    let advertise = proxy.url().trim_start_matches("nats://").to_owned();
    let (listen, advertise) = (format!("cluster.mesh_listen={listen}"), format!("cluster.mesh_advertise={advertise}"));
    let b = start(&idb, &nats, &certs, &["--set", &listen, "--set", &advertise]);
    wait_links(&a, 1, Duration::from_secs(15));
    let mut on_b = MosquittoSub::start(&b, &["-t", &format!("{prefix}/#")]);
    let mut publisher = publisher(&a, &format!("pub-{prefix}"));
    until_routed(&mut publisher, &format!("{prefix}/x"), &mut [&mut on_b]);
    proxy.set_hold(true);
    proxy.cut_all();
    wait_links(&a, 0, Duration::from_secs(5));
    Cut { proxy, a, on_b, publisher, _b: b, _certs: certs, _nats: nats }
}

impl Cut {
    /// Heals the cut: what was held goes, the hanging links are closed
    /// and dialed again.
    fn heal(&self) {
        self.proxy.set_hold(false);
        self.proxy.cut_all();
    }
}

#[test]
fn a_mesh_cut_keeps_the_values_and_delivers_them_when_it_heals() {
    let mut cut = cut("cut", &[]);
    for i in 0..500 {
        cut.publisher.send(&build::publish_qos0("cut/x", i.to_string().as_bytes(), true));
    }
    thread::sleep(Duration::from_secs(2));
    let kept = status(&cut.a)["cluster"]["mesh"]["peers"][0]["buffer_bytes"].as_i64().unwrap_or(0);
    assert!(kept > 0, "{}", status(&cut.a));
    assert_eq!(cut.on_b.next_message(Duration::from_millis(100)), None);
    cut.heal();
    // Every value once, in order, after the heal (DESIGN.md §6;
    // [MQTT-4.6.0-5] across the cut).
    assert_eq!(payloads(&mut cut.on_b, Duration::from_secs(8)), numbers(500));
    assert_eq!(cut.a.metric_sum("fleetmq_mesh_values_lost_total"), 0.0);
    wait_links(&cut.a, 1, Duration::from_secs(10));
    // The cut and the heal are both in the log: "link down" with its
    // cause, and "link up" again (before, only the first link up of a
    // peer process was logged).
    let log = cut.a.stderr();
    // The heal may release a held handshake just before it closes the
    // links, so a third "link up" can come between: count at least two,
    // the second after the cut's "link down".
    let down = log.find("mesh: link down: ").unwrap_or_else(|| panic!("{log}"));
    assert!(log.matches("mesh: link up").count() >= 2, "{log}");
    assert!(log[down..].contains("mesh: link up"), "{log}");
}

/// Two replicas, A's links to B cut: after the grace A names B as
/// missing (status, `fleetmq_mesh_peers_missing`) and stays ready: with
/// one peer, which side is at fault cannot be told, and a cut in both
/// directions would otherwise make both replicas unready, the whole
/// service out of its load balancer (DESIGN.md §6: a mesh cut does not
/// affect clients; §12 lists what makes a replica unready).
#[test]
fn a_replica_cut_off_from_its_only_peer_names_it_missing_and_stays_ready() {
    let cut = cut("rdy", &[]);
    let b = &cut._b;
    // The grace: 2 x member_ttl (5 s here), at least 10 s.
    assert_eq!(status(&cut.a)["cluster"]["mesh"]["ready_grace_s"], 10);
    let ready = |broker: &Broker| broker.admin_get("/health/ready");
    let deadline = Instant::now() + Duration::from_secs(20);
    while status(&cut.a)["cluster"]["mesh"]["missing"][0]["replica"] != "rdyb" {
        assert!(Instant::now() < deadline, "rdyb never missing: {}", status(&cut.a));
        assert_eq!(ready(&cut.a), (200, "ready".to_owned()), "ready within the grace");
        thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(cut.a.metric_sum("fleetmq_mesh_peers_missing"), 1.0);
    assert_eq!(ready(&cut.a), (200, "ready".to_owned()), "{}", status(&cut.a));
    assert_eq!(ready(b), (200, "ready".to_owned()));
    cut.heal();
    wait_links(&cut.a, 1, Duration::from_secs(15));
    assert_eq!(ready(&cut.a), (200, "ready".to_owned()));
    assert_eq!(status(&cut.a)["cluster"]["mesh"]["missing"], serde_json::json!([]));
}

#[test]
fn a_replica_alone_with_a_mesh_is_ready() {
    let nats = NatsCluster::start(3);
    let certs = Certs::new("solo");
    let a = start("solo", &nats, &certs, &[]);
    assert_eq!(a.admin_get("/health/ready"), (200, "ready".to_owned()));
    assert_eq!(status(&a)["cluster"]["mesh"]["missing"], serde_json::json!([]));
}

#[test]
fn past_a_full_mesh_buffer_the_oldest_values_are_dropped_and_counted() {
    let mut cut = cut("full", &["--set", "cluster.mesh_buffer=8KiB"]);
    let payload = |i: usize| format!("{i:0>100}");
    for i in 0..400 {
        cut.publisher.send(&build::publish_qos0("full/x", payload(i).as_bytes(), true));
    }
    thread::sleep(Duration::from_secs(1));
    cut.heal();
    let got = payloads(&mut cut.on_b, Duration::from_secs(8));
    let lost = cut.a.metric_sum("fleetmq_mesh_values_lost_total") as usize;
    assert!(lost > 300, "8 KiB holds a few dozen values of 100 bytes: {lost} lost");
    // The newest ones, in order: the oldest were dropped.
    let expected: Vec<String> = (lost..400).map(payload).collect();
    assert_eq!(got, expected);
}

#[test]
fn a_replica_with_a_certificate_from_another_ca_is_refused_and_counted() {
    let nats = NatsCluster::start(3);
    let certs = Certs::new("xa,xb");
    let other = Certs::new("xb");
    let a = start("xa", &nats, &certs, &[]);
    // B's certificate and CA are another deployment's.
    let args = mesh_args("xb", &other, None, &[]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let b = replica("xb", &nats.urls(), &args);
    let deadline = Instant::now() + Duration::from_secs(15);
    while a.metric_sum("fleetmq_mesh_refused_total") < 1.0 || b.metric_sum("fleetmq_mesh_refused_total") < 1.0 {
        assert!(Instant::now() < deadline, "no refusal counted");
        thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(links_up(&a), 0);
    assert_eq!(links_up(&b), 0);
    // Both ends count a certificate refusal: the acceptor too, which
    // hears it as the dialer's alert ("received fatal alert: UnknownCA",
    // counted as `protocol` before).
    thread::sleep(Duration::from_secs(1));
    for r in [&a, &b] {
        assert!(r.metric_sum("fleetmq_mesh_refused_total{reason=\"certificate\"}") >= 2.0, "{}", r.admin_get("/metrics").1);
        assert_eq!(r.metric_sum("fleetmq_mesh_refused_total{reason=\"protocol\"}"), 0.0, "{}", r.admin_get("/metrics").1);
    }
    // Logged once a minute per peer and reason (its dials, and its dials
    // to us), not once per dial.
    thread::sleep(Duration::from_secs(2));
    assert!(a.stderr().matches("mesh: refused").count() <= 2, "{}", a.stderr());
    assert!(a.stderr().contains("reason=\"certificate\"") || a.stderr().contains("reason=certificate"), "{}", a.stderr());
    assert_eq!(status(&a)["cluster"]["mesh"]["peers"][0]["state"], "down");
}

/// A fourth replica deployed with another CA's certificate: it is the
/// one not ready (cut off from all three peers); the three that link to
/// each other stay ready and name it under `missing` (before, all four
/// answered 503 after the grace: one bad deploy took the whole cluster
/// out of its load balancer; a fresh-user pass found it).
#[test]
fn a_replica_that_no_peer_accepts_is_not_ready_and_leaves_the_others_ready() {
    let nats = NatsCluster::start(3);
    let certs = Certs::new("ma,mb,mc");
    let other = Certs::new("md");
    let good: Vec<Broker> = ["ma", "mb", "mc"].iter().map(|id| start(id, &nats, &certs, &[])).collect();
    for r in &good {
        wait_links(r, 2, Duration::from_secs(15));
    }
    let args = mesh_args("md", &other, None, &[]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let d = replica("md", &nats.urls(), &args);
    // The grace is 10 s (2 x member_ttl 5 s, at least 10 s): past it, d
    // is not ready and names its peers.
    let deadline = Instant::now() + Duration::from_secs(30);
    let (code, body) = loop {
        let (code, body) = d.admin_get("/health/ready");
        if code == 503 || Instant::now() > deadline {
            break (code, body);
        }
        thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("mesh: no link to live peer ma"), "{body}");
    // The three others see d missing for the grace too, and stay ready.
    for r in &good {
        let deadline = Instant::now() + Duration::from_secs(15);
        while status(r)["cluster"]["mesh"]["missing"][0]["replica"] != "md" {
            assert!(Instant::now() < deadline, "md never missing: {}", status(r));
            thread::sleep(Duration::from_millis(200));
        }
        assert_eq!(r.admin_get("/health/ready"), (200, "ready".to_owned()), "{}", status(r));
        assert_eq!(r.metric_sum("fleetmq_mesh_peers_missing"), 1.0);
        assert_eq!(links_up(r), 2);
    }
}

#[test]
fn a_replica_killed_and_restarted_links_again_and_receives() {
    let nats = NatsCluster::start(3);
    let certs = Certs::new("ka,kb");
    let a = start("ka", &nats, &certs, &[]);
    let mut b = start("kb", &nats, &certs, &[]);
    wait_links(&a, 1, Duration::from_secs(15));
    b.kill();
    drop(b);
    wait_links(&a, 0, Duration::from_secs(10));
    let b = start("kb", &nats, &certs, &[]);
    wait_links(&a, 1, Duration::from_secs(30));
    let mut on_b = MosquittoSub::start(&b, &["-t", "k/#"]);
    let mut publisher = publisher(&a, "pub-k");
    until_routed(&mut publisher, "k/x", &mut [&mut on_b]);
    for i in 0..100 {
        publisher.send(&build::publish_qos0("k/x", i.to_string().as_bytes(), true));
    }
    assert_eq!(payloads(&mut on_b, Duration::from_secs(3)), numbers(100));
}

/// Every payload each of `subs` receives until none comes for `quiet`.
pub(crate) fn drain(subs: &mut [&mut MosquittoSub], quiet: Duration) -> Vec<Vec<String>> {
    let mut got = vec![Vec::new(); subs.len()];
    let mut last = Instant::now();
    while last.elapsed() < quiet {
        for (sub, got) in subs.iter_mut().zip(got.iter_mut()) {
            while let Some(m) = sub.next_message(Duration::from_millis(20)) {
                got.push(m.rsplit(' ').next().unwrap_or_default().to_owned());
                last = Instant::now();
            }
        }
    }
    got
}

/// Publishes `probe-<i>` on `topic` until `members` (one shared group)
/// received one between them, so the group's routes reached the
/// publisher's replica; then lets the rest arrive and forgets them.
pub(crate) fn until_group_routed(publisher: &mut RawClient, topic: &str, members: &mut [&mut MosquittoSub], wanted: usize) {
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut seen = vec![false; members.len()];
    while seen.iter().filter(|s| **s).count() < wanted {
        assert!(Instant::now() < deadline, "the group's routes did not reach the publisher's replica within 15 s");
        for _ in 0..4 {
            publisher.send(&build::publish_qos0(topic, b"probe", true));
        }
        for (m, seen) in members.iter_mut().zip(seen.iter_mut()) {
            while m.next_message(Duration::from_millis(100)).is_some() {
                *seen = true;
            }
        }
    }
    thread::sleep(Duration::from_millis(300));
    drain(members, Duration::from_millis(300));
}

#[test]
fn a_shared_group_with_members_on_two_other_replicas_gets_each_value_once() {
    let nats = NatsCluster::start(3);
    let certs = Certs::new("ga,gb,gc");
    let a = start("ga", &nats, &certs, &[]);
    let b = start("gb", &nats, &certs, &[]);
    let c = start("gc", &nats, &certs, &[]);
    for r in [&a, &b, &c] {
        wait_links(r, 2, Duration::from_secs(20));
    }
    let mut on_b = MosquittoSub::start(&b, &["-t", "$share/g/sh/#"]);
    let mut on_c = MosquittoSub::start(&c, &["-t", "$share/g/sh/#"]);
    // A second group matching the same topic, with members on all three
    // replicas: each group takes its own turns (one turn shared by both
    // gave group g the same replica for every value; fresh-user pass).
    let mut h_a = MosquittoSub::start(&a, &["-t", "$share/h/sh/x"]);
    let mut h_b = MosquittoSub::start(&b, &["-t", "$share/h/sh/x"]);
    let mut h_c = MosquittoSub::start(&c, &["-t", "$share/h/sh/x"]);
    // A plain subscriber on C gets every value besides the group.
    let mut plain_c = MosquittoSub::start(&c, &["-t", "sh/x"]);
    let mut publisher = publisher(&a, "pub-g");
    until_group_routed(&mut publisher, "sh/x", &mut [&mut on_b, &mut on_c], 2);
    until_group_routed(&mut publisher, "sh/x", &mut [&mut h_a, &mut h_b, &mut h_c], 3);
    drain(&mut [&mut plain_c, &mut on_b, &mut on_c], Duration::from_millis(300));
    for i in 0..200 {
        publisher.send(&build::publish_qos0("sh/x", i.to_string().as_bytes(), true));
    }
    let got = drain(&mut [&mut on_b, &mut on_c, &mut plain_c, &mut h_a, &mut h_b, &mut h_c], Duration::from_secs(2));
    let mut h: Vec<u32> = got[3].iter().chain(&got[4]).chain(&got[5]).map(|p| p.parse().unwrap()).collect();
    h.sort_unstable();
    assert_eq!(h, (0..200).collect::<Vec<u32>>(), "group h: a {} b {} c {}", got[3].len(), got[4].len(), got[5].len());
    // Each value to exactly one member of the group, cluster-wide
    // [MQTT-4.8.2-3]; round robin over the replicas reaches both.
    let mut group: Vec<u32> = got[0].iter().chain(&got[1]).map(|p| p.parse().unwrap()).collect();
    group.sort_unstable();
    assert_eq!(group, (0..200).collect::<Vec<u32>>(), "b {} c {}", got[0].len(), got[1].len());
    assert!(!got[0].is_empty() && !got[1].is_empty(), "b {} c {}", got[0].len(), got[1].len());
    assert_eq!(got[2], numbers(200));
}

/// Three linked replicas `{p}a`, `{p}b` and `{p}c`, a member of the shared
/// group `g` on `{topic}/#` (QoS 1) on B and on C, and a publisher on A
/// whose probes reached both (fields dropped in order: the NATS cluster
/// last).
pub(crate) struct GroupOnBAndC {
    pub(crate) on_b: MosquittoSub,
    pub(crate) on_c: MosquittoSub,
    pub(crate) publisher: RawClient,
    pub(crate) a: Broker,
    pub(crate) _b: Broker,
    pub(crate) c: Broker,
    _certs: Certs,
    _nats: NatsCluster,
}

impl GroupOnBAndC {
    pub(crate) fn start(p: &str, topic: &str) -> GroupOnBAndC {
        let nats = NatsCluster::start(3);
        let certs = Certs::new(&format!("{p}a,{p}b,{p}c"));
        let a = start(&format!("{p}a"), &nats, &certs, &[]);
        let b = start(&format!("{p}b"), &nats, &certs, &[]);
        let c = start(&format!("{p}c"), &nats, &certs, &[]);
        for r in [&a, &b, &c] {
            wait_links(r, 2, Duration::from_secs(20));
        }
        let filter = format!("$share/g/{topic}/#");
        let mut on_b = MosquittoSub::start(&b, &["-q", "1", "-t", &filter]);
        let mut on_c = MosquittoSub::start(&c, &["-q", "1", "-t", &filter]);
        let mut publisher = publisher(&a, &format!("pub-{p}"));
        until_group_routed(&mut publisher, &format!("{topic}/x"), &mut [&mut on_b, &mut on_c], 2);
        GroupOnBAndC { on_b, on_c, publisher, a, _b: b, c, _certs: certs, _nats: nats }
    }
}

/// A shared group with members on B and C, the publisher on A: C's
/// process SIGKILLed. Its links close at once; A stops picking C then,
/// not when C is taken for gone (~15 s later): every acknowledged value
/// published from a second after the kill reaches B's member (before,
/// every other one went into C's buffer and was lost with it: 174 of 600
/// in a fresh-user pass) [MQTT-4.8.2-3 and MQTT 5 §4.8.2: another member
/// SHOULD get it].
#[test]
fn a_shared_group_member_replica_killed_leaves_the_values_to_the_members_still_there() {
    let mut g = GroupOnBAndC::start("k", "kill");
    let publisher = &mut g.publisher;
    let mut send = |i: u32| {
        publisher.send(&build::publish("kill/x", 1, (i % 60_000 + 1) as u16, (false, false), i.to_string().as_bytes(), true));
        match publisher.read(Duration::from_secs(10)) {
            Incoming::Packet { header: 0x40, .. } => {}
            other => panic!("PUBACK for {i}: {other:?}"),
        }
        thread::sleep(Duration::from_millis(10));
    };
    for i in 0..50 {
        send(i);
    }
    g.c.kill();
    let killed = Instant::now();
    let mut after = 50;
    while killed.elapsed() < Duration::from_secs(1) {
        send(after);
        after += 1;
    }
    // From here on: C's links are down (its sockets closed with it).
    let first_checked = after;
    for i in first_checked..first_checked + 200 {
        send(i);
    }
    let got: Vec<u32> = payloads(&mut g.on_b, Duration::from_secs(3)).iter().map(|p| p.parse().unwrap()).collect();
    let missing: Vec<u32> = (first_checked..first_checked + 200).filter(|i| !got.contains(i)).collect();
    assert!(missing.is_empty(), "{} of 200 acknowledged values published after the kill reached no member: {missing:?}", missing.len());
}

#[test]
fn local_first_keeps_a_shared_group_on_the_publishing_replica_when_it_has_a_member() {
    let nats = NatsCluster::start(3);
    let certs = Certs::new("la,lb");
    let a = start("la", &nats, &certs, &["--set", "shared.strategy=local_first"]);
    let b = start("lb", &nats, &certs, &["--set", "shared.strategy=local_first"]);
    wait_links(&a, 1, Duration::from_secs(15));
    let mut on_b = MosquittoSub::start(&b, &["-t", "$share/w/lf/#"]);
    let mut publisher = publisher(&a, "pub-lf");
    // A member only on the other replica: the values cross.
    until_group_routed(&mut publisher, "lf/x", &mut [&mut on_b], 1);
    // With a member on the publishing replica too, they stay there.
    let mut on_a = MosquittoSub::start(&a, &["-t", "$share/w/lf/#"]);
    thread::sleep(Duration::from_millis(500));
    for i in 0..100 {
        publisher.send(&build::publish_qos0("lf/x", i.to_string().as_bytes(), true));
    }
    let got = drain(&mut [&mut on_a, &mut on_b], Duration::from_secs(2));
    assert_eq!(got[0], numbers(100), "every value at the member on the publishing replica");
    assert!(got[1].is_empty(), "none crossed: {:?}", got[1]);
    drop(on_a);
    thread::sleep(Duration::from_secs(1));
    for i in 0..100 {
        publisher.send(&build::publish_qos0("lf/x", i.to_string().as_bytes(), true));
    }
    assert_eq!(payloads(&mut on_b, Duration::from_secs(3)), numbers(100));
}

/// A replica is ready only once it has the other replicas' routes: a
/// value published on it right after its start reaches their subscribers
/// (before, a replica could be ready with no routes applied, and the
/// first values published on it went nowhere else).
#[test]
fn a_value_published_right_after_a_replica_starts_reaches_the_other_replicas_subscribers() {
    let nats = NatsCluster::start(3);
    let certs = Certs::new("ea,eb0,eb1,eb2");
    let a = start("ea", &nats, &certs, &[]);
    let mut on_a = MosquittoSub::start(&a, &["-q", "1", "-t", "early/#"]);
    // Its route is in mqtt-routes once the SUBACK is sent.
    thread::sleep(Duration::from_millis(300));
    for round in 0..3 {
        let b = start(&format!("eb{round}"), &nats, &certs, &[]);
        // At once: no wait for links or routes beyond the start's own.
        let mut p = publisher(&b, &format!("early-pub-{round}"));
        p.send(&build::publish(&format!("early/{round}"), 1, 1, (false, false), b"first", true));
        match p.read(Duration::from_secs(10)) {
            Incoming::Packet { header: 0x40, .. } => {}
            other => panic!("PUBACK: {other:?}"),
        }
        let got = on_a.next_message(Duration::from_secs(10)).unwrap_or_default();
        assert!(got.ends_with(&format!("early/{round} first")), "round {round}: {got:?}");
        drop(p);
        drop(b);
    }
}

/// A mesh listener on a port another process listens on (here the first
/// replica's MQTT port) refuses the start naming `cluster.mesh_listen`:
/// SO_REUSEPORT would otherwise share the port and take some of its
/// connections (a fresh-user pass saw 5 of 20 mosquitto_pub fail). A
/// `mesh_cert` that is not a certificate file but endless (`/dev/zero`)
/// refuses the start too, without reading it all (it took 24 GB).
#[test]
fn a_mesh_port_in_use_or_an_endless_certificate_file_refuses_the_start() {
    let nats = NatsCluster::start(3);
    let certs = Certs::new("ia,ib");
    let a = start("ia", &nats, &certs, &[]);
    let taken = format!("cluster.mesh_listen={}", a.mqtt);
    let args = mesh_args("ib", &certs, None, &["--set", &taken]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (ok, stderr) = crate::cluster::refused_start("ib", &nats.urls(), &args);
    assert!(!ok && stderr.contains("cluster.mesh_listen"), "{stderr}");
    let args = mesh_args("ib", &certs, None, &["--set", "cluster.mesh_cert=/dev/zero"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (ok, stderr) = crate::cluster::refused_start("ib", &nats.urls(), &args);
    assert!(!ok && stderr.contains("cluster.mesh_cert") && stderr.contains("longer than"), "{stderr}");
}

/// A replica that stops cleanly leaves the others' mesh status and
/// per-peer series (before, it stayed listed as `down` with
/// `fleetmq_mesh_peer_links_up` 0 until they restarted, so an alert on it
/// fired for good after a scale-down; fresh-user pass).
#[test]
fn a_replica_that_stops_leaves_the_mesh_status_of_the_others() {
    let nats = NatsCluster::start(3);
    let certs = Certs::new("sa,sb");
    let a = start("sa", &nats, &certs, &[]);
    let b = start("sb", &nats, &certs, &[]);
    wait_links(&a, 1, Duration::from_secs(15));
    assert!(a.admin_get("/metrics").1.contains("peer=\"sb\""));
    drop(b);
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let s = status(&a);
        if s["cluster"]["mesh"]["peers"].as_array().is_some_and(Vec::is_empty) {
            break;
        }
        assert!(Instant::now() < deadline, "the stopped replica is still listed: {s}");
        thread::sleep(Duration::from_millis(200));
    }
    assert!(!a.admin_get("/metrics").1.contains("peer=\"sb\""), "no per-peer series left for the stopped replica");
}
