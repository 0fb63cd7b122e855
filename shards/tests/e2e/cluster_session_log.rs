//! Session logs (DESIGN.md §4, §6, §7; issue 24): a QoS 1/2 value that a
//! persistent session of the cluster wants (on any replica, connected or
//! not) is in its workspace's stream `LOG_mqtt-sessions-<workspace>`
//! before its publisher's PUBACK/PUBREC; values nobody persistent wants
//! are not; a persistent session taken up at another replica (after a
//! clean disconnect, or its replica SIGKILLed) gets every acknowledged
//! value it was owed, in order, then live values, with no gap and no
//! duplicate; a log capped small (`cluster.session_log_max_bytes`) drops
//! its oldest and a session that had not read them counts them missed;
//! with every NATS server stopped no publish is acknowledged and then
//! lost. Real rumqttc clients, real replicas, a real 3-server NATS
//! cluster.

use std::collections::HashSet;
use std::time::Duration;

use bytes::Bytes;

use crate::clients::{unique, v5};
use crate::cluster::replica;
use crate::cluster_ingest::through_an_outage;
use crate::harness::Broker;
use crate::nats::NatsCluster;

/// `member_ttl` of these tests.
const TTL: &str = "cluster.member_ttl=5s";

/// The default workspace's session log.
pub(crate) const LOG: &str = "LOG_mqtt-sessions-_";

/// One message of a session log: its topic header and payload (the
/// properties, then the MQTT payload: without properties, one 0 byte
/// first).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Logged {
    seq: u64,
    pub(crate) topic: String,
    qos: String,
    pub(crate) payload: Vec<u8>,
}

/// Every message of `stream` now (`None`: no such stream), in order.
pub(crate) async fn logged(nats: &NatsCluster, stream: &str) -> Option<Vec<Logged>> {
    let js = async_nats::jetstream::new(crate::nats::connect(&nats.urls()).await);
    let mut s = js.get_stream(stream).await.ok()?;
    let state = s.info().await.expect("stream info").state.clone();
    let mut out = Vec::new();
    if state.messages == 0 {
        return Some(out);
    }
    for seq in state.first_sequence..=state.last_sequence {
        let Some(m) = crate::nats::stream_message(&s, seq).await else { continue };
        let header = |name: &str| m.headers.get(name).map(|v| v.as_str().to_owned()).unwrap_or_default();
        out.push(Logged { seq, topic: header("Mqtt-Topic"), qos: header("Mqtt-Qos"), payload: m.payload.to_vec() });
    }
    Some(out)
}

/// The MQTT payloads of `messages` (no properties were sent: one 0 byte
/// of property length first).
pub(crate) fn payloads(messages: &[Logged]) -> Vec<String> {
    messages
        .iter()
        .map(|m| {
            assert_eq!(m.payload.first(), Some(&0), "no properties: {m:?}");
            String::from_utf8_lossy(&m.payload[1..]).into_owned()
        })
        .collect()
}

/// MQTT 5 options of `id` on `broker` with a Session Expiry Interval.
pub(crate) fn persistent(broker: &Broker, id: &str, clean_start: bool, expiry: u32) -> v5::MqttOptions {
    let mut o = v5::options(broker.mqtt_port(), id, clean_start);
    o.set_session_expiry_interval(Some(expiry));
    o
}

/// Publishes `payload` to `topic` at `qos` from `p` and waits for its
/// acknowledgement (none at QoS 0).
pub(crate) async fn publish(p: &mut v5::Client, topic: &str, qos: v5::QoS, payload: &str) {
    p.client.publish(topic, qos, false, Bytes::from(payload.to_owned())).await.expect("publish request");
    match qos {
        v5::QoS::AtMostOnce => tokio::time::sleep(Duration::from_millis(50)).await,
        v5::QoS::AtLeastOnce => drop(p.wait_for("PUBACK", |p| matches!(p, v5::Packet::PubAck(_))).await),
        v5::QoS::ExactlyOnce => drop(p.wait_for("PUBCOMP", |p| matches!(p, v5::Packet::PubComp(_))).await),
    }
}

/// A QoS 1/2 value is in the log before its acknowledgement exactly when
/// a persistent session wants it at QoS 1 or 2, on this replica (at once
/// after its SUBACK) or another (its record), connected or not; not at
/// QoS 0, not for a QoS 0 subscription, not for a clean session, not once
/// the session ended. No log exists before a persistent session wants
/// something.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_value_a_persistent_session_wants_is_in_its_workspace_log_before_its_acknowledgement() {
    let nats = NatsCluster::start(3);
    let a = replica("ra", &nats.urls(), &["--set", TTL]);
    let b = replica("rb", &nats.urls(), &["--set", TTL]);
    let mut pa = v5::Client::connect(a.mqtt_port(), &unique("pa")).await;
    let mut pb = v5::Client::connect(b.mqtt_port(), &unique("pb")).await;

    // A clean subscriber wants it: no log.
    let mut clean = v5::Client::connect(a.mqtt_port(), &unique("clean")).await;
    clean.subscribe("s/#", v5::QoS::AtLeastOnce).await;
    publish(&mut pa, "s/0", v5::QoS::AtLeastOnce, "for the clean one").await;
    assert_eq!(logged(&nats, LOG).await, None, "no log before a persistent session wants anything");

    let id = unique("keeper");
    let (mut c, _) = v5::Client::connect_with(persistent(&a, &id, true, 300)).await;
    c.subscribe("s/+", v5::QoS::AtLeastOnce).await;
    c.subscribe("z/#", v5::QoS::AtMostOnce).await;
    // Here, right after the SUBACK.
    publish(&mut pa, "s/1", v5::QoS::AtLeastOnce, "one").await;
    let now = logged(&nats, LOG).await.expect("the log, created by its first value");
    assert_eq!(payloads(&now), ["one"], "in the log once the PUBACK is here");
    assert_eq!((now[0].topic.as_str(), now[0].qos.as_str()), ("s/1", "1"));
    // At B, once B's watch has the record (written before the SUBACK).
    tokio::time::sleep(Duration::from_millis(500)).await;
    publish(&mut pb, "s/2", v5::QoS::ExactlyOnce, "two").await;
    publish(&mut pb, "s/3", v5::QoS::AtMostOnce, "QoS 0: live only").await;
    publish(&mut pb, "z/1", v5::QoS::AtLeastOnce, "a QoS 0 subscription: live only").await;
    publish(&mut pb, "other", v5::QoS::AtLeastOnce, "nobody's").await;
    publish(&mut pb, "s/4", v5::QoS::AtLeastOnce, "four").await;
    let now = logged(&nats, LOG).await.unwrap();
    assert_eq!(payloads(&now), ["one", "two", "four"]);
    assert_eq!(now[1].qos, "2");
    // Offline, kept: still logged.
    c.client.disconnect().await.expect("disconnect");
    tokio::time::sleep(Duration::from_millis(300)).await;
    publish(&mut pb, "s/5", v5::QoS::AtLeastOnce, "five").await;
    publish(&mut pa, "s/6", v5::QoS::AtLeastOnce, "six").await;
    assert_eq!(payloads(&logged(&nats, LOG).await.unwrap()), ["one", "two", "four", "five", "six"]);
    // Ended (Clean Start, expiry 0): no longer logged, here or there.
    let (c, _) = v5::Client::connect_with(v5::options(a.mqtt_port(), &id, true)).await;
    c.client.disconnect().await.expect("disconnect");
    tokio::time::sleep(Duration::from_millis(500)).await;
    publish(&mut pa, "s/7", v5::QoS::AtLeastOnce, "seven").await;
    publish(&mut pb, "s/8", v5::QoS::AtLeastOnce, "eight").await;
    assert_eq!(payloads(&logged(&nats, LOG).await.unwrap()), ["one", "two", "four", "five", "six"]);
    let count = |broker: &Broker| {
        let (_, text) = broker.admin_get("/metrics");
        text.lines()
            .find(|l| l.starts_with("fleetmq_session_log_appends_total{stream=\"log\"}"))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .expect("the log's counter")
    };
    assert_eq!(count(&a) + count(&b), 5.0);
}

/// A log capped small (`cluster.session_log_max_bytes` = 1 MiB) drops its
/// oldest values: it keeps at most that many bytes, the newest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_capped_small_drops_its_oldest_values() {
    let nats = NatsCluster::start(3);
    let a = replica("ra", &nats.urls(), &["--set", TTL, "--set", "cluster.session_log_max_bytes=1MiB"]);
    let id = unique("capped");
    let (mut c, _) = v5::Client::connect_with(persistent(&a, &id, true, 300)).await;
    c.subscribe("big/+", v5::QoS::AtLeastOnce).await;
    c.client.disconnect().await.expect("disconnect");
    let mut p = v5::Client::connect(a.mqtt_port(), &unique("pub")).await;
    let filler = "x".repeat(16 << 10);
    for n in 0..150 {
        publish(&mut p, "big/v", v5::QoS::AtLeastOnce, &format!("{n:03}{filler}")).await;
    }
    let now = logged(&nats, LOG).await.unwrap();
    let numbers: Vec<u32> = payloads(&now).iter().map(|p| p[..3].parse().unwrap()).collect();
    assert!(numbers.len() < 70, "at most 1 MiB of 16 KiB values: {}", numbers.len());
    assert_eq!(numbers.last(), Some(&149), "the newest kept");
    let first = numbers[0];
    assert!(first > 0, "the oldest dropped");
    assert_eq!(numbers, (first..150).collect::<Vec<_>>(), "the newest, in order, with no gap");
    assert!(now[0].seq > 1);
}

/// Every NATS server stopped while a publisher runs with a persistent
/// session wanting its values and no ingest stream (`store.kind =
/// "none"`: the session log alone decides the PUBACK): publishes are
/// refused (0x80) within the wait, never acknowledged and then missing
/// from the log; service resumes once NATS is back.
#[test]
fn with_every_nats_server_stopped_no_value_is_acknowledged_and_missing_from_the_log() {
    let nats = NatsCluster::start(3);
    let a = replica("ra", &nats.urls(), &["--set", TTL, "--set", "cluster.session_log_append_wait=2s", "--set", "store.kind=none"]);
    crate::nats::block_on(async {
        let (mut c, _) = v5::Client::connect_with(persistent(&a, "outage-keeper", true, 300)).await;
        c.subscribe("o/v", v5::QoS::AtLeastOnce).await;
        c.client.disconnect().await.expect("disconnect");
    });
    let told = through_an_outage(&nats, &a);
    let stored: HashSet<u64> = crate::nats::block_on(logged(&nats, LOG))
        .expect("the log")
        .iter()
        .filter_map(|m| std::str::from_utf8(&m.payload[1..]).ok()?.parse().ok())
        .collect();
    let lost: Vec<_> = told.acked.iter().filter(|v| !stored.contains(v)).take(10).collect();
    assert!(lost.is_empty(), "acknowledged and not in the log: {lost:?} (of {} acknowledged)", told.acked.len());
}

/// Publishes `values` (numbers, as text) at QoS 1 to `topic` from `p`,
/// each acknowledged before the next.
async fn publish_numbers(p: &mut v5::Client, topic: &str, values: std::ops::Range<u32>) {
    for n in values {
        publish(p, topic, v5::QoS::AtLeastOnce, &n.to_string()).await;
    }
}

/// The numbers `c` receives until `last` (each checked QoS 1), at most
/// 20 s; panics on anything out of order (a gap or a duplicate).
async fn receive_numbers(c: &mut v5::Client, expected: std::ops::Range<u32>, what: &str) {
    let mut got = Vec::new();
    for want in expected.clone() {
        let Some(p) = c.try_next_publish(Duration::from_secs(20)).await else {
            panic!("{what}: nothing after {got:?} (wanted {expected:?})");
        };
        let n: u32 = std::str::from_utf8(&p.payload).unwrap().parse().unwrap();
        assert_eq!(p.qos, v5::QoS::AtLeastOnce, "{what}: min(1, 1) [MQTT-3.8.4-8]");
        assert_eq!(n, want, "{what}: in order, no gap, no duplicate [MQTT-4.6.0-5]; before it {:?}", &got[got.len().saturating_sub(5)..]);
        got.push(n);
    }
}

/// A persistent QoS 1 subscriber at A, A SIGKILLed, values published at B
/// meanwhile (each acknowledged): the subscriber resumes at C (Clean
/// Start 0, Session Present [MQTT-3.2.2-2]) and gets every one, in order,
/// then live values, with no gap and no duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_whose_replica_was_killed_gets_every_acknowledged_value_in_order_at_another_then_live_ones() {
    let nats = NatsCluster::start(3);
    let mut a = replica("ra", &nats.urls(), &["--set", TTL]);
    let b = replica("rb", &nats.urls(), &["--set", TTL]);
    let c3 = replica("rc", &nats.urls(), &["--set", TTL]);
    let id = unique("owed");
    let (mut c, _) = v5::Client::connect_with(persistent(&a, &id, true, 300)).await;
    c.subscribe("owed/+", v5::QoS::AtLeastOnce).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut p = v5::Client::connect(b.mqtt_port(), &unique("pub")).await;
    publish_numbers(&mut p, "owed/x", 0..20).await;
    receive_numbers(&mut c, 0..20, "at A, from the log").await;
    // Its cursor written (at most every 100 ms) with the PUBACKs.
    tokio::time::sleep(Duration::from_millis(600)).await;
    a.kill();
    drop(c);
    publish_numbers(&mut p, "owed/x", 20..220).await;
    let (mut c, connack) = v5::Client::connect_with(persistent(&c3, &id, false, 300)).await;
    assert!(matches!(connack, v5::Packet::ConnAck(ref ack) if ack.session_present), "taken up: {connack:?}");
    receive_numbers(&mut c, 20..220, "at C, owed while away").await;
    publish_numbers(&mut p, "owed/x", 220..260).await;
    receive_numbers(&mut c, 220..260, "at C, live").await;
    c.expect_no_publish(Duration::from_millis(500)).await;
}

/// The session's replica gone another way: SIGTERM (its clean stop
/// releases its client identifiers), or SIGKILL with the client back
/// only after the replica was taken for gone and its claims swept. The
/// session record is still there: resumed at C with Session Present 1
/// [MQTT-3.2.2-2] and every value owed, in order, once (a fresh-user pass
/// found Session Present 0 and nothing in both cases).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_whose_replica_stopped_or_was_killed_long_ago_is_resumed_with_every_value() {
    let nats = NatsCluster::start(3);
    let b = replica("rb", &nats.urls(), &["--set", TTL]);
    let c3 = replica("rc", &nats.urls(), &["--set", TTL]);
    let mut p = v5::Client::connect(b.mqtt_port(), &unique("pub")).await;
    for (how, topic) in [("sigterm", "gone/t"), ("sigkill", "gone/k")] {
        let mut a = replica("ra", &nats.urls(), &["--set", TTL]);
        let id = unique(how);
        let (mut c, _) = v5::Client::connect_with(persistent(&a, &id, true, 300)).await;
        c.subscribe(topic, v5::QoS::AtLeastOnce).await;
        publish_numbers(&mut p, topic, 0..5).await;
        receive_numbers(&mut c, 0..5, how).await;
        tokio::time::sleep(Duration::from_millis(600)).await;
        if how == "sigterm" {
            a.stop_with_sigterm();
        } else {
            a.kill();
            // Taken for gone within 1.7 x member_ttl (5 s), its claims swept.
            tokio::time::sleep(Duration::from_secs(12)).await;
        }
        drop(c);
        publish_numbers(&mut p, topic, 5..55).await;
        let (mut c, connack) = v5::Client::connect_with(persistent(&c3, &id, false, 300)).await;
        assert!(matches!(connack, v5::Packet::ConnAck(ref ack) if ack.session_present), "{how}: taken up: {connack:?}");
        receive_numbers(&mut c, 5..55, how).await;
        publish_numbers(&mut p, topic, 55..60).await;
        receive_numbers(&mut c, 55..60, how).await;
        c.expect_no_publish(Duration::from_millis(300)).await;
    }
}

/// The same after a clean disconnect at A: resumed at B, every value
/// published meanwhile (at A and at C), in order, then live ones, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_left_cleanly_gets_every_value_in_order_at_another_replica_then_live_ones() {
    let nats = NatsCluster::start(3);
    let a = replica("ra", &nats.urls(), &["--set", TTL]);
    let b = replica("rb", &nats.urls(), &["--set", TTL]);
    let id = unique("away");
    let (mut c, _) = v5::Client::connect_with(persistent(&a, &id, true, 300)).await;
    c.subscribe("away/#", v5::QoS::AtLeastOnce).await;
    let mut pa = v5::Client::connect(a.mqtt_port(), &unique("pa")).await;
    publish_numbers(&mut pa, "away/1", 0..10).await;
    receive_numbers(&mut c, 0..10, "at A").await;
    c.client.disconnect().await.expect("disconnect");
    tokio::time::sleep(Duration::from_millis(300)).await;
    publish_numbers(&mut pa, "away/1", 10..110).await;
    let (mut c, connack) = v5::Client::connect_with(persistent(&b, &id, false, 300)).await;
    assert!(matches!(connack, v5::Packet::ConnAck(ref ack) if ack.session_present), "taken up: {connack:?}");
    receive_numbers(&mut c, 10..110, "at B, owed while away").await;
    publish_numbers(&mut pa, "away/1", 110..150).await;
    receive_numbers(&mut c, 110..150, "at B, live from A").await;
    let mut pb = v5::Client::connect(b.mqtt_port(), &unique("pb")).await;
    publish_numbers(&mut pb, "away/2", 150..170).await;
    receive_numbers(&mut c, 150..170, "at B, live from B").await;
    c.expect_no_publish(Duration::from_millis(500)).await;
}

/// A log capped small drops values a session had not read: at its resume
/// it gets those still there, in order, and they are counted missed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn values_dropped_from_a_capped_log_before_a_session_read_them_are_counted_missed() {
    let nats = NatsCluster::start(3);
    let args = ["--set", TTL, "--set", "cluster.session_log_max_bytes=1MiB"];
    let a = replica("ra", &nats.urls(), &args);
    let b = replica("rb", &nats.urls(), &args);
    let id = unique("missing");
    let (mut c, _) = v5::Client::connect_with(persistent(&a, &id, true, 300)).await;
    c.subscribe("big/+", v5::QoS::AtLeastOnce).await;
    let mut p = v5::Client::connect(a.mqtt_port(), &unique("pub")).await;
    publish(&mut p, "big/v", v5::QoS::AtLeastOnce, "first").await;
    assert_eq!(c.next_publish().await.payload, Bytes::from("first"));
    tokio::time::sleep(Duration::from_millis(300)).await;
    c.client.disconnect().await.expect("disconnect");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let filler = "x".repeat(16 << 10);
    for n in 0..150 {
        publish(&mut p, "big/v", v5::QoS::AtLeastOnce, &format!("{n:03}{filler}")).await;
    }
    let kept = logged(&nats, LOG).await.unwrap();
    let first_kept: u32 = payloads(&kept)[0][..3].parse().unwrap();
    let mut options = persistent(&b, &id, false, 300);
    options.set_max_packet_size(Some(1 << 20));
    let (mut c, _) = v5::Client::connect_with(options).await;
    for want in first_kept..150 {
        let got = c.next_publish().await;
        assert_eq!(std::str::from_utf8(&got.payload[..3]).unwrap().parse::<u32>().unwrap(), want);
    }
    c.expect_no_publish(Duration::from_millis(500)).await;
    assert_eq!(b.metric_sum("fleetmq_session_log_values_missed_total"), f64::from(first_kept), "the values dropped unread");
}
