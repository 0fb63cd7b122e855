//! `store.kind = "jetstream"`, the cluster default (DESIGN.md §7): every
//! accepted QoS 1/2 PUBLISH is in the ingest stream `mqtt-ingest`
//! (contract: /work/coord/ingest-contract.md) before its PUBACK/PUBREC;
//! refused (MQTT 5: 0x80) when JetStream does not take it within
//! `cluster.session_log_append_wait`; never acknowledged and then lost.
//! Against a real 3-server NATS cluster, the stream at R3.

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use crate::cluster::{replica, wait_ready};
use crate::harness::Broker;
use crate::nats::{NatsCluster, NatsProxy};
use crate::raw::{wire as build, Incoming, RawClient};

/// One message of the ingest stream: sequence, subject, headers (name →
/// values), payload.
#[derive(Debug, Clone)]
pub(crate) struct Ingested {
    subject: String,
    headers: BTreeMap<String, Vec<String>>,
    pub(crate) payload: Vec<u8>,
}

impl Ingested {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.first()).map(String::as_str)
    }
}

/// Every message of `mqtt-ingest` now, in stream order (any server that
/// answers). Read with `$JS.API.STREAM.MSG.GET` and its header block
/// parsed here: async-nats' reader of that answer keeps only the last
/// value of a header given twice (a user property may be).
pub(crate) fn ingested(nats: &NatsCluster) -> Vec<Ingested> {
    use futures_util::StreamExt as _;
    let urls = nats.urls();
    crate::nats::block_on(async move {
        let client = crate::nats::connect(&urls).await;
        let js = async_nats::jetstream::new(client.clone());
        // One ordered consumer reads them all, in stream order (a request
        // per message took ~2 ms each: tens of seconds for a run's
        // values); asked again while JetStream elects (a server was just
        // killed: its requests time out).
        let until = std::time::Instant::now() + std::time::Duration::from_secs(30);
        let (count, mut messages) = loop {
            let made = async {
                let mut stream = js.get_stream("mqtt-ingest").await.map_err(|e| e.to_string())?;
                let count = stream.info().await.map_err(|e| e.to_string())?.state.messages;
                let config = async_nats::jetstream::consumer::pull::OrderedConfig::default();
                let consumer = stream.create_consumer(config).await.map_err(|e| e.to_string())?;
                let messages = consumer.messages().await.map_err(|e| e.to_string())?;
                Ok::<_, String>((count, messages))
            };
            match made.await {
                Ok(made) => break made,
                Err(e) if std::time::Instant::now() < until => {
                    eprintln!("mqtt-ingest not readable yet: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
                }
                Err(e) => panic!("mqtt-ingest not readable within 30 s: {e}"),
            }
        };
        let mut out = Vec::new();
        while out.len() < count as usize {
            let next = tokio::time::timeout(std::time::Duration::from_secs(20), messages.next()).await;
            let m = next.expect("the stream's messages within 20 s").expect("a message").expect("not an error");
            let mut headers: BTreeMap<String, Vec<String>> = BTreeMap::new();
            for (name, values) in m.headers.iter().flat_map(|h| h.iter()) {
                headers.entry(name.to_string()).or_default().extend(values.iter().map(|v| v.as_str().to_owned()));
            }
            out.push(Ingested { subject: m.subject.to_string(), headers, payload: m.payload.to_vec() });
        }
        out
    })
}

/// The places where the ingest stream holds a value after a larger one
/// (the publisher numbers its values in the order it sends them):
/// (earlier in the stream, later in the stream), at most 10.
pub(crate) fn inversions(nats: &NatsCluster) -> Vec<(u64, u64)> {
    let values: Vec<u64> = ingested(nats)
        .iter()
        .filter_map(|m| std::str::from_utf8(&m.payload).ok()?.parse().ok())
        .collect();
    let out: Vec<(u64, u64)> = values.windows(2).filter(|w| w[1] <= w[0]).map(|w| (w[0], w[1])).take(10).collect();
    if !out.is_empty() {
        println!("stream order: {values:?}");
    }
    out
}

/// Connects `id` (MQTT 5 unless `v311`), CONNACK 0 expected.
fn client(broker: &Broker, id: &str, v311: bool, session_expiry: Option<u32>) -> RawClient {
    let mut c = RawClient::connect(broker.mqtt);
    let mut connect = if v311 { build::Connect::v311(id) } else { build::Connect::v5(id) };
    if session_expiry.is_some() {
        connect.clean = false;
        connect.session_expiry = session_expiry;
    }
    assert_eq!(c.handshake(&connect.encode()).1, 0, "CONNACK of {id}");
    c
}

/// The next packet with fixed header `header`, skipping others; its body.
fn expect(c: &mut RawClient, header: u8, within: Duration) -> Vec<u8> {
    let until = Instant::now() + within;
    loop {
        match c.read(until.saturating_duration_since(Instant::now())) {
            Incoming::Packet { header: h, body } if h == header => return body,
            Incoming::Packet { .. } => continue,
            other => panic!("expected packet 0x{header:02x}, got {other:02x?}"),
        }
    }
}

#[test]
fn qos1_and_qos2_publishes_are_in_the_ingest_stream_before_their_acknowledgement_with_the_contracts_headers() {
    let nats = NatsCluster::start(3);
    let a = replica("ra", &nats.urls(), &[]);
    let mut c = client(&a, "dev-1", false, None);
    // QoS 1: in the stream once the PUBACK is here (DESIGN.md §7).
    c.send(&build::publish("plant/t1", 1, 1, (false, false), b"21.5", true));
    let puback = expect(&mut c, 0x40, Duration::from_secs(10));
    assert_eq!(&puback[..2], &[0, 1]);
    assert_eq!(puback.get(2).copied().unwrap_or(0), 0, "PUBACK success");
    let now = ingested(&nats);
    assert_eq!(now.len(), 1, "{now:?}");
    let m = &now[0];
    assert_eq!(m.subject, "mqtt-ingest._");
    assert_eq!(m.payload, b"21.5");
    assert_eq!(m.header("Mqtt-Topic"), Some("plant/t1"));
    assert_eq!(m.header("Mqtt-Qos"), Some("1"));
    assert_eq!(m.header("Mqtt-Client-Id"), Some("dev-1"));
    assert_eq!(m.header("Mqtt-Retain"), None);
    assert_eq!(m.header("Mqtt-Workspace"), None);
    let first_id = m.header("Nats-Msg-Id").expect("Nats-Msg-Id").to_owned();
    // QoS 2, retained: in the stream once the PUBREC is here; the flow
    // goes on to PUBCOMP.
    c.send(&build::publish("plant/t2", 2, 2, (false, true), b"x", true));
    let pubrec = expect(&mut c, 0x50, Duration::from_secs(10));
    assert_eq!(pubrec.get(2).copied().unwrap_or(0), 0, "PUBREC success");
    let now = ingested(&nats);
    assert_eq!(now.len(), 2, "{now:?}");
    assert_eq!(now[1].header("Mqtt-Qos"), Some("2"));
    assert_eq!(now[1].header("Mqtt-Retain"), Some("1"));
    c.send(&build::pubrel(2));
    expect(&mut c, 0x70, Duration::from_secs(5));
    // Packet identifier 1 again, a new value: stored as a new message
    // (the ID is not the packet identifier, which MQTT reuses at once).
    c.send(&build::publish("plant/t1", 1, 1, (false, false), b"21.6", true));
    expect(&mut c, 0x40, Duration::from_secs(10));
    let now = ingested(&nats);
    assert_eq!(now.len(), 3, "a reused packet identifier is a new value: {now:?}");
    assert_eq!(now[2].payload, b"21.6");
    assert_ne!(now[2].header("Nats-Msg-Id"), Some(first_id.as_str()));
    // QoS 0 is not stored.
    c.send(&build::publish_qos0("plant/t0", b"q0", true));
    c.send(&build::publish("plant/t1", 1, 3, (false, false), b"after q0", true));
    expect(&mut c, 0x40, Duration::from_secs(10));
    let now = ingested(&nats);
    assert_eq!(now.iter().map(|m| m.payload.clone()).collect::<Vec<_>>(), [&b"21.5"[..], b"x", b"21.6", b"after q0"]);
    // MQTT 3.1.1 too.
    let mut old = client(&a, "dev-311", true, None);
    old.send(&build::publish("plant/t3", 1, 9, (false, false), b"v311", false));
    expect(&mut old, 0x40, Duration::from_secs(10));
    let now = ingested(&nats);
    assert_eq!(now.last().map(|m| (m.payload.clone(), m.header("Mqtt-Client-Id").map(str::to_owned))), Some((b"v311".to_vec(), Some("dev-311".to_owned()))));
    // The gauge and the counter are served.
    assert_eq!(a.metric_sum("fleetmq_session_log_appends_total"), 5.0);
    assert_eq!(a.metric_sum("fleetmq_session_log_appends_held"), 0.0);
    // User properties: a name given twice is two headers, in order (MQTT 5
    // §3.3.2.3.7: a name may appear more than once); one whose name cannot
    // be a header's goes base64, name and value.
    let mut body = Vec::new();
    body.extend_from_slice(&(b"plant/up".len() as u16).to_be_bytes());
    body.extend_from_slice(b"plant/up");
    body.extend_from_slice(&4u16.to_be_bytes());
    let mut props = Vec::new();
    for (name, value) in [("k", "v1"), ("k", "v2"), ("bad name", "x")] {
        props.push(0x26);
        for text in [name, value] {
            props.extend_from_slice(&(text.len() as u16).to_be_bytes());
            props.extend_from_slice(text.as_bytes());
        }
    }
    body.push(u8::try_from(props.len()).expect("short properties"));
    body.extend_from_slice(&props);
    body.extend_from_slice(b"up");
    c.send(&build::packet(0x32, &body));
    expect(&mut c, 0x40, Duration::from_secs(10));
    let now = ingested(&nats);
    let m = now.last().expect("the value with user properties");
    assert_eq!(m.payload, b"up");
    assert_eq!(m.headers.get("Mqtt-User-k"), Some(&vec!["v1".to_owned(), "v2".to_owned()]), "{m:?}");
    assert_eq!(m.headers.get("Mqtt-User-B64"), Some(&vec!["YmFkIG5hbWU=:eA==".to_owned()]), "{m:?}");
}

/// Each replica's ingest connection (the appends of values no persistent
/// session wants, the common case) is at the NATS server that leads
/// `mqtt-ingest`, whichever URL it reached first: no
/// append or acknowledgement is relayed between NATS servers (≈ 3 µs of
/// nats-server's CPU per value, perf/RESULTS.md session 45). Three
/// replicas: by chance all three would be there one time in 27.
#[test]
fn each_replicas_ingest_connection_is_at_the_ingest_streams_leader() {
    let nats = NatsCluster::start(3);
    let ids = ["il1", "il2", "il3"];
    let brokers: Vec<_> = ids.iter().map(|id| replica(id, &nats.urls(), &[])).collect();
    let leader = nats.stream_leader("mqtt-ingest").expect("mqtt-ingest has a leader");
    for id in ids {
        let name = format!("fleetmq-{id}-ingest");
        let at: Vec<usize> = (0..nats.len()).filter(|&i| nats.connection_names(i).contains(&name)).collect();
        assert_eq!(at, vec![leader], "{name}: on servers {at:?}, the leader of mqtt-ingest is n{leader}");
    }
    // Where each connection is, in /api/v1/status.
    for broker in &brokers {
        let (code, body) = broker.admin_get("/api/v1/status");
        assert_eq!(code, 200, "{body}");
        let status: serde_json::Value = serde_json::from_str(&body).expect("JSON");
        let connections = &status["cluster"]["bridge"]["connections"];
        assert_eq!(connections["ingest"]["server"], nats.name(leader), "{connections}");
        for name in ["state", "lease", "ingest"] {
            assert_eq!(connections[name]["connected"], true, "{name}: {connections}");
            let server = connections[name]["server"].as_str().unwrap_or_default();
            assert!((0..nats.len()).any(|i| nats.name(i) == server), "{name} at {server:?}: {connections}");
        }
    }
    for (i, broker) in brokers.iter().enumerate() {
        let mut c = client(broker, &format!("il-dev-{i}"), false, None);
        c.send(&build::publish("plant/il", 1, 1, (false, false), format!("v{i}").as_bytes(), true));
        let puback = expect(&mut c, 0x40, Duration::from_secs(10));
        assert_eq!(puback.get(2).copied().unwrap_or(0), 0, "PUBACK success");
    }
    let stored: Vec<_> = ingested(&nats).iter().map(|m| String::from_utf8_lossy(&m.payload).into_owned()).collect();
    assert_eq!(stored.len(), 3, "{stored:?}");
    for i in 0..3 {
        assert!(stored.contains(&format!("v{i}")), "{stored:?}");
    }
}

/// The ingest connection follows the stream's leader: when the leader
/// steps down and another server leads, the replica moves its ingest
/// connection there within a few seconds (it asks every 5 s), counts
/// it, and the publisher meanwhile is neither refused nor closed, its
/// values stored once each.
#[test]
fn the_ingest_connection_follows_the_ingest_streams_leader() {
    let nats = NatsCluster::start(3);
    let a = replica("fl", &nats.urls(), &[]);
    let at = |nats: &NatsCluster| -> Vec<usize> {
        (0..nats.len()).filter(|&i| nats.connection_names(i).iter().any(|n| n == "fleetmq-fl-ingest")).collect()
    };
    let first = nats.stream_leader("mqtt-ingest").expect("mqtt-ingest has a leader");
    assert_eq!(at(&nats), vec![first], "made at the leader");
    let stop = Arc::new(AtomicBool::new(false));
    let told = Arc::new(Mutex::new(Told::default()));
    let running = publisher(&a, "fl-pub", stop.clone(), told.clone());
    let acked = |told: &Mutex<Told>| told.lock().unwrap().acked.len();
    let until = Instant::now() + Duration::from_secs(20);
    while acked(&told) < 200 {
        assert!(Instant::now() < until, "no service before the step-down");
        thread::sleep(Duration::from_millis(50));
    }
    let urls = nats.urls();
    let answer = crate::nats::block_on(async move {
        let client = crate::nats::connect(&urls).await;
        client.request("$JS.API.STREAM.LEADER.STEPDOWN.mqtt-ingest", "".into()).await.map(|m| m.payload)
    });
    assert!(answer.is_ok(), "step-down asked: {answer:?}");
    let until = Instant::now() + Duration::from_secs(20);
    let next = loop {
        match nats.stream_leader("mqtt-ingest") {
            Some(leader) if leader != first => break leader,
            _ => assert!(Instant::now() < until, "no other leader after the step-down"),
        }
        thread::sleep(Duration::from_millis(100));
    };
    let until = Instant::now() + Duration::from_secs(20);
    while at(&nats) != vec![next] {
        assert!(Instant::now() < until, "the ingest connection stayed at {:?}, the leader is n{next}", at(&nats));
        thread::sleep(Duration::from_millis(200));
    }
    assert!(a.metric_sum("fleetmq_cluster_ingest_connection_moves_total") >= 1.0);
    let before = acked(&told);
    let until = Instant::now() + Duration::from_secs(20);
    while acked(&told) < before + 200 {
        assert!(Instant::now() < until, "no service after the move");
        thread::sleep(Duration::from_millis(50));
    }
    stop.store(true, Ordering::Relaxed);
    running.join().unwrap();
    let told = told.lock().unwrap();
    assert_eq!((told.refused, told.closed), (0, 0), "{told:?}");
    assert!(told.other.is_empty(), "{:?}", told.other);
    assert_none_lost(&nats, &told);
    // (Not asserted here: the order across the step-down. Appends in
    // flight when the old leader refuses one may be stored by the new
    // one before it is sent again: the README's "at the very end of an
    // election". A lost or frozen server is where the order is checked.)
}

/// A NATS server that was down when a replica started, and leads
/// `mqtt-ingest` later, is found (its URL asked again) and the replica's
/// ingest connection moves there.
#[test]
fn the_ingest_connection_follows_the_leader_to_a_server_that_was_down_when_the_replica_started() {
    let mut nats = NatsCluster::start(3);
    // The stream is made (three copies) while every server is up.
    let first = replica("fd1", &nats.urls(), &[]);
    drop(first);
    let away = (nats.stream_leader("mqtt-ingest").expect("a leader") + 1) % 3;
    nats.stop(away);
    let b = replica("fd2", &nats.urls(), &[]);
    nats.restart(away);
    let urls = nats.urls();
    let until = Instant::now() + Duration::from_secs(40);
    // Leadership moved until the server that was away leads.
    while nats.stream_leader("mqtt-ingest") != Some(away) {
        assert!(Instant::now() < until, "n{away} never led mqtt-ingest");
        let urls = urls.clone();
        let _ = crate::nats::block_on(async move {
            let client = crate::nats::connect(&urls).await;
            client.request("$JS.API.STREAM.LEADER.STEPDOWN.mqtt-ingest", "".into()).await.map(|m| m.payload)
        });
        thread::sleep(Duration::from_millis(1500));
    }
    let until = Instant::now() + Duration::from_secs(20);
    while !nats.connection_names(away).iter().any(|n| n == "fleetmq-fd2-ingest") {
        assert!(Instant::now() < until, "the ingest connection never reached n{away}, the leader: {}", b.stderr());
        thread::sleep(Duration::from_millis(200));
    }
    assert!(b.metric_sum("fleetmq_cluster_ingest_connection_moves_total") >= 1.0);
    let mut c = client(&b, "fd-dev", false, None);
    c.send(&build::publish("plant/fd", 1, 1, (false, false), b"after", true));
    let puback = expect(&mut c, 0x40, Duration::from_secs(10));
    assert_eq!(puback.get(2).copied().unwrap_or(0), 0, "PUBACK success");
}

#[test]
fn a_publish_resent_with_dup_is_stored_at_least_once_at_qos1_and_once_per_open_flow_at_qos2() {
    let nats = NatsCluster::start(3);
    let a = replica("ra", &nats.urls(), &[]);
    let mut c = client(&a, "dup-1", false, Some(300));
    // QoS 1 sent, the connection lost before its PUBACK is read: the
    // client sends it again with DUP after it reconnects [MQTT-4.4.0-1].
    c.send(&build::publish("d/q1", 1, 7, (false, false), b"one", true));
    // QoS 2 sent and its PUBREC read: the flow is open.
    c.send(&build::publish("d/q2", 2, 8, (false, false), b"two", true));
    expect(&mut c, 0x50, Duration::from_secs(10));
    // Resent on the same connection while the flow is open: PUBREC again,
    // not a second copy [MQTT-4.3.3-9].
    c.send(&build::publish("d/q2", 2, 8, (true, false), b"two", true));
    expect(&mut c, 0x50, Duration::from_secs(10));
    drop(c);
    thread::sleep(Duration::from_millis(300));
    let mut c = client(&a, "dup-1", false, Some(300));
    c.send(&build::publish("d/q1", 1, 7, (true, false), b"one", true));
    let puback = expect(&mut c, 0x40, Duration::from_secs(10));
    assert_eq!(puback.get(2).copied().unwrap_or(0), 0);
    // The QoS 2 flow is still open in the session: resent with DUP, it is
    // not stored again; PUBREL ends it.
    c.send(&build::publish("d/q2", 2, 8, (true, false), b"two", true));
    expect(&mut c, 0x50, Duration::from_secs(10));
    c.send(&build::pubrel(8));
    expect(&mut c, 0x70, Duration::from_secs(5));
    let now = ingested(&nats);
    let ones = now.iter().filter(|m| m.payload == b"one").count();
    let twos = now.iter().filter(|m| m.payload == b"two").count();
    assert!(ones >= 1, "QoS 1 at least once: {now:?}");
    assert_eq!(twos, 1, "QoS 2 once per open flow: {now:?}");
}

/// What a QoS 1 publisher was told, by payload number.
#[derive(Debug, Default)]
pub(crate) struct Told {
    /// Acknowledged with 0x00.
    pub(crate) acked: HashSet<u64>,
    /// Refused with 0x80 (not taken within the wait).
    pub(crate) refused: u64,
    /// Other reason codes.
    pub(crate) other: Vec<u8>,
    /// Connections closed under it.
    pub(crate) closed: u64,
}

/// Publishes QoS 1 values numbered from 0 on `broker` as `id`, at most 50
/// unacknowledged, reconnecting when the connection closes (a fenced
/// replica closes it, a CONNECT is refused while NATS is away), until
/// `stop`.
fn publisher(broker: &Broker, id: &'static str, stop: Arc<AtomicBool>, told: Arc<Mutex<Told>>) -> thread::JoinHandle<u64> {
    let addr = broker.mqtt;
    thread::spawn(move || {
        let mut n = 0u64;
        'connections: while !stop.load(Ordering::Relaxed) {
            let Ok(mut c) = RawClient::try_connect(addr) else {
                thread::sleep(Duration::from_millis(200));
                continue;
            };
            if c.handshake(&build::Connect::v5(id).encode()).1 != 0 {
                thread::sleep(Duration::from_millis(200));
                continue;
            }
            // packet identifier → payload number
            let mut open: BTreeMap<u16, u64> = BTreeMap::new();
            let mut next_pid = 1u16;
            while !stop.load(Ordering::Relaxed) {
                while open.len() < 50 {
                    let pid = next_pid;
                    next_pid = if next_pid == 1000 { 1 } else { next_pid + 1 };
                    if c.try_send(&build::publish("o/v", 1, pid, (false, false), n.to_string().as_bytes(), true)).is_err() {
                        told.lock().unwrap().closed += 1;
                        continue 'connections;
                    }
                    open.insert(pid, n);
                    n += 1;
                }
                match c.read(Duration::from_millis(100)) {
                    Incoming::Packet { header: 0x40, body } => {
                        let pid = u16::from_be_bytes([body[0], body[1]]);
                        let Some(value) = open.remove(&pid) else { continue };
                        let mut t = told.lock().unwrap();
                        match body.get(2).copied().unwrap_or(0) {
                            0 => drop(t.acked.insert(value)),
                            0x80 => t.refused += 1,
                            code => t.other.push(code),
                        }
                    }
                    Incoming::Packet { .. } | Incoming::TimedOut => {}
                    Incoming::Closed => {
                        told.lock().unwrap().closed += 1;
                        continue 'connections;
                    }
                }
            }
        }
        n
    })
}

/// Every value acknowledged to a publisher is in the stream.
fn assert_none_lost(nats: &NatsCluster, told: &Told) {
    let stored: HashSet<u64> = ingested(nats)
        .iter()
        .filter_map(|m| std::str::from_utf8(&m.payload).ok()?.parse().ok())
        .collect();
    let lost: Vec<_> = told.acked.iter().filter(|v| !stored.contains(v)).take(10).collect();
    assert!(lost.is_empty(), "acknowledged and not in the stream: {lost:?} (of {} acknowledged)", told.acked.len());
}

#[test]
fn with_every_nats_server_stopped_publishes_are_refused_within_the_wait_none_acknowledged_is_lost_and_service_resumes() {
    let nats = NatsCluster::start(3);
    let a = replica("ra", &nats.urls(), &["--set", "cluster.session_log_append_wait=2s"]);
    let told = through_an_outage(&nats, &a);
    assert_none_lost(&nats, &told);
}

/// Publishes QoS 1 values on `a` (topic `o/v`) until 200 are
/// acknowledged, stops (SIGSTOP) every NATS server of `nats` until a
/// publish is refused (0x80, within the wait of 2 s: well before the
/// replica fences at ~12 s and closes the connection) and 2 s more, then
/// resumes them and publishes until 200 more are acknowledged. What the
/// publisher was told; no reason code but 0x00 and 0x80.
pub(crate) fn through_an_outage(nats: &NatsCluster, a: &Broker) -> Told {
    let stop = Arc::new(AtomicBool::new(false));
    let told = Arc::new(Mutex::new(Told::default()));
    let running = publisher(a, "outage-pub", stop.clone(), told.clone());
    let acked = |told: &Mutex<Told>| told.lock().unwrap().acked.len();
    let until = Instant::now() + Duration::from_secs(20);
    while acked(&told) < 200 {
        assert!(Instant::now() < until, "no service before the outage: {:?}", told.lock().unwrap().other);
        thread::sleep(Duration::from_millis(50));
    }
    for i in 0..3 {
        nats.pause(i);
    }
    let paused_at = Instant::now();
    while told.lock().unwrap().refused == 0 {
        assert!(paused_at.elapsed() < Duration::from_secs(6), "nothing refused 6 s into the outage");
        thread::sleep(Duration::from_millis(20));
    }
    let refused_after = paused_at.elapsed();
    assert!(refused_after < Duration::from_secs(5), "first refusal after {refused_after:?}");
    assert!(a.metric_sum("fleetmq_session_log_appends_refused_total") >= 1.0);
    thread::sleep(Duration::from_secs(2));
    for i in 0..3 {
        nats.resume(i);
    }
    // Service resumes: new values acknowledged.
    wait_ready(a, 200, Duration::from_secs(40));
    let before = acked(&told);
    let until = Instant::now() + Duration::from_secs(40);
    while acked(&told) < before + 200 {
        assert!(Instant::now() < until, "service did not resume: {} acknowledged since", acked(&told) - before);
        thread::sleep(Duration::from_millis(50));
    }
    stop.store(true, Ordering::Relaxed);
    running.join().unwrap();
    let told = std::mem::take(&mut *told.lock().unwrap());
    assert!(told.other.is_empty(), "unexpected reason codes {:?}", told.other);
    told
}

#[test]
fn one_nats_server_killed_does_not_affect_the_publishers() {
    let mut nats = NatsCluster::start(3);
    let a = replica("ra", &nats.urls(), &[]);
    let stop = Arc::new(AtomicBool::new(false));
    let told = Arc::new(Mutex::new(Told::default()));
    let running = publisher(&a, "kill-pub", stop.clone(), told.clone());
    let acked = |told: &Mutex<Told>| told.lock().unwrap().acked.len();
    let until = Instant::now() + Duration::from_secs(20);
    while acked(&told) < 200 {
        assert!(Instant::now() < until, "no service before the kill");
        thread::sleep(Duration::from_millis(50));
    }
    // The ingest stream's leader, the likeliest to matter.
    let victim = nats.stream_leader("mqtt-ingest").unwrap_or(0);
    nats.kill(victim);
    let before = acked(&told);
    let until = Instant::now() + Duration::from_secs(20);
    while acked(&told) < before + 500 {
        assert!(Instant::now() < until, "service stalled after one server died: {} since", acked(&told) - before);
        thread::sleep(Duration::from_millis(50));
    }
    stop.store(true, Ordering::Relaxed);
    running.join().unwrap();
    let told = told.lock().unwrap();
    assert_eq!((told.refused, told.closed), (0, 0), "refusals or closes with two of three servers up: {told:?}");
    assert!(told.other.is_empty(), "{:?}", told.other);
    assert_none_lost(&nats, &told);
    // In the publisher's order, across the leader's death and the
    // election (what failed goes again first, the first alone).
    let inverted = inversions(&nats);
    assert!(inverted.is_empty(), "stored out of publish order (earlier, later): {inverted:?}");
}

#[test]
fn the_jetstream_store_without_a_cluster_section_does_not_start() {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_fleetmq"));
    cmd.args(["serve", "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--set", "store.kind=jetstream"]);
    let out = crate::harness::run_with_timeout(&mut cmd, Duration::from_secs(20));
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("store.kind = \"jetstream\" needs a [cluster] section"), "{stderr}");
}

#[test]
fn a_3_1_1_client_whose_publish_is_not_taken_in_time_is_closed_after_what_came_before() {
    let nats = NatsCluster::start(1);
    let proxy = NatsProxy::start(nats.client_addr(0));
    let a = replica("ra", &[proxy.url()], &["--set", "cluster.nats_replicas=1", "--set", "cluster.session_log_append_wait=2s"]);
    let mut device = client(&a, "old-device", true, None);
    device.send(&build::publish("line/count", 1, 1, (false, false), b"1", false));
    expect(&mut device, 0x40, Duration::from_secs(10));
    // NATS holds its answers: the next publishes are not taken within the
    // wait (2 s). MQTT 3.1.1 has no reason code: the connection is closed
    // after the PUBACKs of what came before, and nothing after is
    // acknowledged (the device sends them again) (DESIGN.md §7).
    proxy.set_hold(true);
    let sent = Instant::now();
    device.send(&build::publish("line/count", 1, 2, (false, false), b"2", false));
    device.send(&build::publish("line/count", 1, 3, (false, false), b"3", false));
    let seen = device.packets_until_closed(Duration::from_secs(10));
    let took = sent.elapsed();
    proxy.set_hold(false);
    assert_eq!(seen, Vec::<(u8, Vec<u8>)>::new(), "nothing acknowledged after the refused value");
    assert!(took >= Duration::from_millis(1800) && took < Duration::from_secs(8), "closed after {took:?}");
    assert!(a.metric_sum("fleetmq_session_log_appends_refused_total") >= 1.0);
    // Service goes on: the resend is acknowledged.
    let mut device = client(&a, "old-device", true, None);
    device.send(&build::publish("line/count", 1, 2, (true, false), b"2", false));
    expect(&mut device, 0x40, Duration::from_secs(10));
}

/// A QoS 1 value too large for one NATS message (the payload fits MQTT's
/// 1 MiB `limits.max_packet_size` but, with the ingest headers, not NATS'
/// 1 MiB `max_payload`), or whose headers exceed the 64 KiB JetStream
/// stores with a message, cannot be stored: refused at once with 0x97
/// Quota exceeded (MQTT 5 §3.4.2.1), not after the whole
/// `cluster.session_log_append_wait` while every later acknowledgement of
/// the client waits behind it; the next value is stored and acknowledged,
/// the refused one is in neither the stream nor a subscriber.
#[test]
fn a_value_too_large_for_a_nats_message_or_a_stream_is_refused_at_once_and_the_next_one_goes_on() {
    let nats = NatsCluster::start(3);
    let a = replica("ra", &nats.urls(), &["--set", "cluster.session_log_append_wait=20s"]);
    let mut device = client(&a, "big-device", false, None);
    // 1 MiB as MQTT counts it (fixed header 5, topic 2 + 200, packet
    // identifier 2, properties 1), and more with the NATS headers
    // (`Mqtt-Topic` repeats the topic).
    let topic = format!("big/{}", "t".repeat(196));
    let big = vec![b'x'; 1_048_576 - 5 - 202 - 2 - 1];
    refused_at_once_then_next(&mut device, &build::publish(&topic, 1, 1, (false, false), &big, true), 1, b"small");

    // Headers JetStream does not store with a message (over 64 KiB: two
    // user properties of 40 KB, MQTT 5 §3.3.2.3.7), in a 80 KB packet.
    let mut body = build::string(b"big/props");
    body.extend(3u16.to_be_bytes());
    let mut props = Vec::new();
    for name in ["first", "second"] {
        props.push(0x26);
        props.extend(build::string(name.as_bytes()));
        props.extend(build::string(&vec![b'v'; 40_000]));
    }
    body.extend(build::varint(props.len()));
    body.extend(props);
    body.extend(b"propped");
    refused_at_once_then_next(&mut device, &build::packet(0x32, &body), 3, b"after");

    let stored: Vec<Vec<u8>> = ingested(&nats).into_iter().map(|m| m.payload).collect();
    assert_eq!(stored, vec![b"small".to_vec(), b"after".to_vec()], "only the small ones in mqtt-ingest");
    assert_eq!(a.metric_sum("fleetmq_session_log_appends_refused_total"), 2.0);
}

/// Sends `publish` (QoS 1, packet identifier `id`) and then a QoS 1
/// `next` (identifier `id + 1`): the first gets PUBACK 0x97, the second
/// success, both within 5 s.
fn refused_at_once_then_next(device: &mut RawClient, publish: &[u8], id: u16, next: &[u8]) {
    let started = Instant::now();
    device.send(publish);
    device.send(&build::publish("big/next", 1, id + 1, (false, false), next, true));
    let refused = expect(device, 0x40, Duration::from_secs(25));
    assert_eq!((refused[..2].to_vec(), refused.get(2).copied()), (id.to_be_bytes().to_vec(), Some(0x97)), "PUBACK 0x97: {refused:02x?}");
    let acked = expect(device, 0x40, Duration::from_secs(25));
    assert_eq!((acked[..2].to_vec(), acked.get(2).copied().unwrap_or(0)), ((id + 1).to_be_bytes().to_vec(), 0), "the next one acknowledged: {acked:02x?}");
    assert!(started.elapsed() < Duration::from_secs(5), "refused at once, not after the wait: {:?}", started.elapsed());
}

/// A NATS server of `cluster.nats_urls` frozen (SIGSTOP: it accepts
/// connections and never answers) when a replica starts: every URL is
/// asked at once which server it is, the frozen one given a second and
/// named in one warning, and the replica's connections go to servers that
/// answered, so that it starts about as fast as one that does not list
/// it, and takes values (fresh-user passes s45 D1 and s46 D1: the start
/// waited for the 5 s connect timeout of each probe, and of each
/// connection that picked the frozen server, silently: 10-17 s).
#[test]
fn a_frozen_nats_server_at_start_is_named_once_and_the_replica_starts() {
    let mut nats = NatsCluster::start(3);
    // The streams made while every server is up.
    drop(replica("fz1", &nats.urls(), &[]));
    // The server that leads neither the meta group nor the sessions
    // bucket, when there is one: the start needs JetStream to answer.
    let busy = [nats.meta_leader(), nats.stream_leader("KV_mqtt-sessions")];
    let frozen = (0..3).find(|i| !busy.contains(&Some(*i))).unwrap_or(2);
    nats.wait_ready(Duration::from_secs(20));
    nats.pause(frozen);
    let frozen_url = nats.url(frozen);
    let answering: Vec<String> = (0..3).filter(|i| *i != frozen).map(|i| nats.url(i)).collect();
    // JetStream settles after the freeze (its requests may time out for a
    // while, whatever server they go through): a first start waits for
    // that, then one that does not list the frozen server is timed, for
    // comparison.
    drop(replica("fz4", &answering, &[]));
    let t0 = Instant::now();
    let plain = replica("fz3", &answering, &[]);
    let plain_start = t0.elapsed();
    // Listed first: a connection made to the first URL picked would wait.
    let mut urls = vec![frozen_url.clone()];
    urls.extend(answering.iter().cloned());
    let t0 = Instant::now();
    let b = replica("fz2", &urls, &[]);
    let start = t0.elapsed();
    let mut c = client(&b, "fz-dev", false, None);
    c.send(&build::publish("plant/fz", 1, 1, (false, false), b"v", true));
    let puback = expect(&mut c, 0x40, Duration::from_secs(15));
    assert_eq!(puback.get(2).copied().unwrap_or(0), 0, "PUBACK success");
    nats.resume(frozen);
    let log = b.stderr();
    let warned: Vec<&str> = log.lines().filter(|l| l.contains("did not answer") && l.contains(&frozen_url)).collect();
    assert_eq!(warned.len(), 1, "one warning naming {frozen_url}: {log}");
    // The state and lease connections were made right after the probes
    // (1 s), not after a connect timeout at the frozen server.
    let first = log.lines().find_map(log_seconds).expect("a log line with a time");
    for connection in ["fleetmq-fz2-state", "fleetmq-fz2-lease"] {
        let made = log
            .lines()
            .find(|l| l.contains("NATS connected") && l.ends_with(&format!("connection={connection}")))
            .and_then(log_seconds)
            .unwrap_or_else(|| panic!("{connection} connected: {log}"));
        assert!((made - first).rem_euclid(86_400.0) < 2.5, "{connection} connected {:.2} s after the start: {log}", made - first);
    }
    // JetStream itself may still time one request of the start out (5 s)
    // while it settles from the freeze (a stream whose leader was the
    // frozen server answers once another is elected), whatever URLs a
    // replica lists: seen in the setup checks, and in CI (s47) between
    // the ingest connection and "serving". What the frozen URL costs is
    // the connection times above; the whole start may take one such
    // timeout more.
    let settling = Duration::from_secs(6);
    assert!(
        start < plain_start + Duration::from_secs(4) + settling,
        "started in {start:?}, one that does not list the frozen server in {plain_start:?}: {log}"
    );
    drop(plain);
}

/// The time of day of a `tracing` log line (`2026-12-07T23:03:47.053568Z
/// ...`), in seconds.
fn log_seconds(line: &str) -> Option<f64> {
    let time = line.get(11..26)?;
    let (h, rest) = time.split_once(':')?;
    let (m, s) = rest.split_once(':')?;
    Some(h.parse::<f64>().ok()? * 3600.0 + m.parse::<f64>().ok()? * 60.0 + s.parse::<f64>().ok()?)
}
