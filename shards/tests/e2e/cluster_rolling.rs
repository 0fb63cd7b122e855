//! A rolling restart (DESIGN.md §6 "replica stopped", "rolling upgrade";
//! issue 24): three replicas with the mesh, a persistent QoS 1
//! subscriber and a QoS 1 publisher at a steady rate, each sent by a
//! load balancer to a live replica and to another one when theirs goes;
//! every replica is stopped with SIGTERM and started again, one at a
//! time, each back and ready before the next. Every acknowledged value
//! reaches the subscriber, in order, with no gap; a value comes twice
//! only as a DUP redelivery, or because the publisher sent it again (its
//! acknowledgement was lost with its replica). The logs of every process
//! show no panic and no error. Real rumqttc clients, real replicas, a
//! real 3-server NATS cluster.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use bytes::Bytes;
use rumqttc::v5::mqttbytes::v5::PubAckReason;
use tokio::time::timeout;

use crate::clients::{unique, v5};
use crate::cluster::wait_ready;
use crate::cluster_mesh::{start, wait_links, Certs};
use crate::harness::Broker;
use crate::nats::NatsCluster;

/// What a load balancer in front of the replicas knows: each replica's
/// MQTT port while it takes connections.
struct Balancer {
    ports: Mutex<Vec<Option<u16>>>,
    next: AtomicUsize,
}

impl Balancer {
    /// A live replica's port other than `failed` (the one a client just
    /// lost), taken in turn.
    fn pick(&self, failed: Option<u16>) -> Option<u16> {
        let ports = self.ports.lock().unwrap();
        let live: Vec<u16> = ports.iter().flatten().copied().filter(|p| Some(*p) != failed).collect();
        (!live.is_empty()).then(|| live[self.next.fetch_add(1, Ordering::Relaxed) % live.len()])
    }

    fn set(&self, replica: usize, port: Option<u16>) {
        self.ports.lock().unwrap()[replica] = port;
    }
}

/// What the clients saw, for the checks at the end.
#[derive(Default)]
struct Seen {
    /// Each value the subscriber received, with its DUP flag, in order.
    received: Vec<(u32, bool)>,
    /// The values the publisher had acknowledged.
    acked: Vec<u32>,
    /// The values the publisher sent more than once (no acknowledgement
    /// came for an earlier send).
    resent: HashSet<u32>,
    /// Anything wrong the clients noticed on the way.
    faults: Vec<String>,
    /// Reconnections of the subscriber and the publisher.
    moves: [usize; 2],
}

/// The persistent subscriber `id` (Session Expiry 300 s): subscribes to
/// `roll/#` at QoS 1 on its first connection (Clean Start 1), then
/// connects again with Clean Start 0 wherever the balancer sends it,
/// expecting Session Present 1 [MQTT-3.2.2-2]. `subscribed` is set once
/// the first SUBACK came.
async fn subscriber(lb: Arc<Balancer>, id: String, seen: Arc<Mutex<Seen>>, subscribed: Arc<AtomicBool>, stop: Arc<AtomicBool>) {
    let mut failed = None;
    while !stop.load(Ordering::Acquire) {
        let Some(port) = lb.pick(failed) else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let first = !subscribed.load(Ordering::Acquire);
        let mut options = v5::options(port, &id, first);
        options.set_session_expiry_interval(Some(300));
        let (client, mut eventloop) = v5::AsyncClient::new(options, 1000);
        if first {
            client.subscribe("roll/#", v5::QoS::AtLeastOnce).await.expect("subscribe request");
        }
        loop {
            let event = match timeout(Duration::from_millis(200), eventloop.poll()).await {
                Err(_) if stop.load(Ordering::Acquire) => return,
                Err(_) => continue,
                Ok(event) => event,
            };
            match event {
                Ok(v5::Event::Incoming(v5::Packet::ConnAck(ack))) => {
                    if !first && !ack.session_present {
                        seen.lock().unwrap().faults.push(format!("subscriber: Session Present 0 at port {port}"));
                    }
                }
                Ok(v5::Event::Incoming(v5::Packet::SubAck(_))) => subscribed.store(true, Ordering::Release),
                Ok(v5::Event::Incoming(v5::Packet::Publish(p))) => {
                    let n = std::str::from_utf8(&p.payload).ok().and_then(|s| s.parse().ok());
                    let mut seen = seen.lock().unwrap();
                    match n {
                        Some(n) => seen.received.push((n, p.dup)),
                        None => seen.faults.push(format!("subscriber: payload {:?}", p.payload)),
                    }
                }
                Ok(_) => {}
                Err(_) => break,
            }
        }
        failed = Some(port);
        seen.lock().unwrap().moves[0] += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A QoS 1 publisher (clean session) of the numbers 0, 1, 2… to
/// `roll/values`, one every `every`, each sent until acknowledged: on a
/// lost connection, a refusal or no PUBACK within 15 s it connects
/// wherever the balancer sends it and sends the same number again.
async fn publisher(lb: Arc<Balancer>, seen: Arc<Mutex<Seen>>, every: Duration, stop: Arc<AtomicBool>) {
    let id = unique("roll-pub");
    let (mut n, mut sent_once) = (0u32, None);
    let mut failed = None;
    'connect: while !stop.load(Ordering::Acquire) {
        let Some(port) = lb.pick(failed) else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        failed = Some(port);
        let (client, mut eventloop) = v5::AsyncClient::new(v5::options(port, &id, true), 100);
        let connected = timeout(Duration::from_secs(5), async {
            loop {
                match eventloop.poll().await {
                    Ok(v5::Event::Incoming(v5::Packet::ConnAck(ack))) => return ack.code == rumqttc::v5::mqttbytes::v5::ConnectReturnCode::Success,
                    Ok(_) => {}
                    Err(_) => return false,
                }
            }
        });
        if !matches!(connected.await, Ok(true)) {
            seen.lock().unwrap().moves[1] += 1;
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        }
        while !stop.load(Ordering::Acquire) {
            if sent_once == Some(n) {
                seen.lock().unwrap().resent.insert(n);
            }
            sent_once = Some(n);
            client.publish("roll/values", v5::QoS::AtLeastOnce, false, Bytes::from(n.to_string())).await.expect("publish request");
            let acked = timeout(Duration::from_secs(15), async {
                loop {
                    match eventloop.poll().await {
                        Ok(v5::Event::Incoming(v5::Packet::PubAck(ack))) => return ack.reason == PubAckReason::Success,
                        Ok(_) => {}
                        Err(_) => return false,
                    }
                }
            });
            if !matches!(acked.await, Ok(true)) {
                seen.lock().unwrap().moves[1] += 1;
                continue 'connect;
            }
            seen.lock().unwrap().acked.push(n);
            n += 1;
            tokio::time::sleep(every).await;
        }
    }
}

/// What is wrong with what the subscriber received, given what was
/// acknowledged and sent again: its first copies of the values must be
/// 0, 1, 2… with none missing up to the last acknowledged [MQTT-4.6.0-5]
/// (a value that was never acknowledged may be among them), and a value
/// received again must carry DUP [MQTT-4.4.0-1] unless its publisher
/// sent it again.
fn faults(seen: &Seen) -> Vec<String> {
    let mut out = Vec::new();
    let mut firsts = HashSet::new();
    let mut next = 0u32;
    for (i, (n, dup)) in seen.received.iter().enumerate() {
        if firsts.insert(*n) {
            if *n != next {
                let around = &seen.received[i.saturating_sub(5)..(i + 5).min(seen.received.len())];
                out.push(format!("value {n} first received where {next} was due (around: {around:?})"));
                next = *n;
            }
            next += 1;
        } else if !dup && !seen.resent.contains(n) {
            let around = &seen.received[i.saturating_sub(5)..(i + 5).min(seen.received.len())];
            out.push(format!("value {n} received again without DUP (around: {around:?})"));
        }
    }
    if let Some(missing) = seen.acked.iter().find(|n| !firsts.contains(n)) {
        out.push(format!("acknowledged value {missing} never received (of {})", seen.acked.len()));
    }
    out
}

/// Lines of `log` that tell of a panic or an error.
fn bad_lines(log: &str) -> Vec<&str> {
    log.lines().filter(|l| l.contains("panicked") || l.contains(" ERROR ")).collect()
}

#[test]
fn a_rolling_restart_of_every_replica_loses_and_reorders_no_acknowledged_value() {
    let nats = NatsCluster::start(3);
    let certs = Certs::new("ra,rb,rc");
    let ids = ["ra", "rb", "rc"];
    let mut replicas: Vec<Broker> = ids.iter().map(|id| start(id, &nats, &certs, &[])).collect();
    for r in &replicas {
        wait_links(r, 2, Duration::from_secs(20));
    }
    let lb = Arc::new(Balancer { ports: Mutex::new(replicas.iter().map(|r| Some(r.mqtt_port())).collect()), next: AtomicUsize::new(0) });
    let seen = Arc::new(Mutex::new(Seen::default()));
    let (subscribed, stop_pub, stop_sub) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
    let rt = crate::nats::runtime();
    let sub = rt.spawn(subscriber(lb.clone(), unique("roll-sub"), seen.clone(), subscribed.clone(), stop_sub.clone()));
    let deadline = Instant::now() + Duration::from_secs(10);
    while !subscribed.load(Ordering::Acquire) {
        assert!(Instant::now() < deadline, "no SUBACK within 10 s");
        thread::sleep(Duration::from_millis(20));
    }
    let publishing = rt.spawn(publisher(lb.clone(), seen.clone(), Duration::from_millis(5), stop_pub.clone()));
    thread::sleep(Duration::from_secs(2));

    let mut stopped = Vec::new();
    for (i, id) in ids.iter().enumerate() {
        // The balancer sends no new connection there, then it stops.
        lb.set(i, None);
        let before = seen.lock().unwrap().acked.len();
        let status = replicas[i].stop_with_sigterm();
        assert!(status.success(), "{id} stopped cleanly: {status:?}");
        let mut back = start(id, &nats, &certs, &[]);
        wait_ready(&back, 200, Duration::from_secs(30));
        wait_links(&back, 2, Duration::from_secs(20));
        std::mem::swap(&mut replicas[i], &mut back);
        stopped.push(back);
        lb.set(i, Some(replicas[i].mqtt_port()));
        thread::sleep(Duration::from_secs(2));
        let after = seen.lock().unwrap().acked.len();
        assert!(after > before + 20, "the publisher goes on while {id} restarts: {before} → {after}");
    }

    thread::sleep(Duration::from_secs(1));
    stop_pub.store(true, Ordering::Release);
    rt.block_on(publishing).expect("the publisher ends");
    let last = *seen.lock().unwrap().acked.last().expect("values acknowledged");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !seen.lock().unwrap().received.iter().any(|(n, _)| *n == last) && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(50));
    }
    // Anything still on its way (a redelivery) arrives too.
    thread::sleep(Duration::from_millis(500));
    stop_sub.store(true, Ordering::Release);
    rt.block_on(sub).expect("the subscriber ends");

    let seen = seen.lock().unwrap();
    let mut wrong = seen.faults.clone();
    wrong.extend(faults(&seen));
    let dups = seen.received.len() - seen.received.iter().map(|(n, _)| n).collect::<HashSet<_>>().len();
    eprintln!(
        "rolling restart: {} acknowledged, {} received ({dups} again), {} sent again, subscriber moved {} times, publisher {}",
        seen.acked.len(),
        seen.received.len(),
        seen.resent.len(),
        seen.moves[0],
        seen.moves[1]
    );
    assert!(wrong.is_empty(), "{wrong:#?}");
    for (broker, what) in stopped.iter().map(|b| (b, "stopped")).chain(replicas.iter().map(|b| (b, "running"))) {
        let log = broker.stderr();
        assert!(bad_lines(&log).is_empty(), "a {what} replica logged: {:#?}", bad_lines(&log));
    }
}
