//! Persistent sessions in `mqtt-session-state` (DESIGN.md §4, §6; issue
//! 24): a session written by one replica goes on at another one with its
//! subscriptions (CONNACK Session Present 1), after a clean disconnect and
//! after its replica is SIGKILLed; Clean Start at another replica ends it
//! everywhere; an expired one is not taken up; the record follows the
//! subscriptions before each SUBACK/UNSUBACK. Real rumqttc clients, real
//! replicas on a real 3-server NATS cluster.

use std::time::{Duration, Instant};

use bytes::Bytes;
use fleetmq_core::cluster::records::client_key;

use crate::clients::{unique, v5};
use crate::cluster::replica;
use crate::harness::Broker;
use crate::nats::NatsCluster;

/// `member_ttl` of these tests.
const TTL: &str = "cluster.member_ttl=5s";

/// `client_id`'s record in `mqtt-session-state`, as JSON (`None`: none).
async fn record(nats: &NatsCluster, client_id: &str) -> Option<serde_json::Value> {
    let js = async_nats::jetstream::new(crate::nats::connect(&nats.urls()).await);
    let kv = js.get_key_value("mqtt-session-state").await.expect("the bucket");
    let value = kv.get(client_key(client_id)).await.expect("a read")?;
    Some(serde_json::from_slice(&value).expect("a JSON record"))
}

/// Waits until `check(record)` holds, at most 10 s; the record then.
async fn record_until(
    nats: &NatsCluster,
    client_id: &str,
    what: &str,
    check: impl Fn(&Option<serde_json::Value>) -> bool,
) -> Option<serde_json::Value> {
    let started = Instant::now();
    loop {
        let r = record(nats, client_id).await;
        if check(&r) {
            return r;
        }
        assert!(started.elapsed() < Duration::from_secs(10), "{what}: still {r:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The filters of a record, sorted.
fn filters(record: &serde_json::Value) -> Vec<String> {
    let mut f: Vec<String> = record["subscriptions"]
        .as_array()
        .expect("subscriptions")
        .iter()
        .map(|s| s["filter"].as_str().unwrap().to_owned())
        .collect();
    f.sort();
    f
}

/// MQTT 5 options of `id` on `broker` with a Session Expiry Interval.
fn persistent(broker: &Broker, id: &str, clean_start: bool, expiry: u32) -> v5::MqttOptions {
    let mut o = v5::options(broker.mqtt_port(), id, clean_start);
    o.set_session_expiry_interval(Some(expiry));
    o
}

pub(crate) fn session_present(connack: &v5::Packet) -> bool {
    match connack {
        v5::Packet::ConnAck(c) => c.session_present,
        other => panic!("expected a CONNACK, got {other:?}"),
    }
}

/// Publishes `payload` to `topic` at QoS 1 from a fresh client of
/// `broker` and waits for its PUBACK.
async fn publish(broker: &Broker, topic: &str, payload: &'static str) {
    let mut p = v5::Client::connect(broker.mqtt_port(), &unique("pub")).await;
    p.client.publish(topic, v5::QoS::AtLeastOnce, false, Bytes::from(payload)).await.expect("publish request");
    p.wait_for("PUBACK", |p| matches!(p, v5::Packet::PubAck(_))).await;
}

/// Subscribes `filter` with Subscription Identifier `id`.
async fn subscribe_with_id(c: &mut v5::Client, filter: &str, qos: v5::QoS, id: usize) {
    let props = rumqttc::v5::mqttbytes::v5::SubscribeProperties { id: Some(id), user_properties: Vec::new() };
    c.client
        .subscribe_with_properties(filter, qos, props)
        .await
        .expect("subscribe request");
    c.wait_for("SUBACK", |p| matches!(p, v5::Packet::SubAck(_))).await;
}

/// A session made on A, its client gone cleanly, goes on at B: Session
/// Present [MQTT-3.2.2-2], its subscriptions with their options and
/// identifiers [MQTT-3.3.4-3] deliver there without a new SUBSCRIBE; the
/// record said every change before the SUBACK/UNSUBACK, and says offline
/// once the client left. A's copy is gone: the client back at A later
/// finds the session as B left it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_persistent_session_goes_on_at_another_replica_with_its_subscriptions() {
    let nats = NatsCluster::start(3);
    let a = replica("ra", &nats.urls(), &["--set", TTL]);
    let b = replica("rb", &nats.urls(), &["--set", TTL]);
    let id = unique("roamer");

    let (mut c, connack) = v5::Client::connect_with(persistent(&a, &id, true, 300)).await;
    assert!(!session_present(&connack));
    subscribe_with_id(&mut c, "s/a", v5::QoS::AtLeastOnce, 7).await;
    c.subscribe("s/b/#", v5::QoS::AtMostOnce).await;
    c.subscribe("s/gone", v5::QoS::AtMostOnce).await;
    // Written before each SUBACK: read right after the last one.
    let r = record(&nats, &id).await.expect("the record after the SUBACKs");
    assert_eq!(filters(&r), ["s/a", "s/b/#", "s/gone"]);
    assert_eq!(r["replica"], "ra");
    assert_eq!(r["expiry_s"], 300);
    assert!(r.get("offline_since_ms").is_none(), "connected: {r}");
    let sub_a = r["subscriptions"].as_array().unwrap().iter().find(|s| s["filter"] == "s/a").unwrap().clone();
    assert_eq!((sub_a["qos"].as_u64(), sub_a["identifier"].as_u64()), (Some(1), Some(7)), "{sub_a}");
    c.client.unsubscribe("s/gone").await.expect("unsubscribe request");
    c.wait_for("UNSUBACK", |p| matches!(p, v5::Packet::UnsubAck(_))).await;
    let r = record(&nats, &id).await.expect("the record after the UNSUBACK");
    assert_eq!(filters(&r), ["s/a", "s/b/#"], "before the UNSUBACK");
    c.client.disconnect().await.expect("disconnect");
    record_until(&nats, &id, "offline once the client left", |r| {
        r.as_ref().is_some_and(|r| r["offline_since_ms"].as_u64().is_some())
    })
    .await;

    let (mut c, connack) = v5::Client::connect_with(persistent(&b, &id, false, 300)).await;
    assert!(session_present(&connack), "taken up at B: {connack:?}");
    record_until(&nats, &id, "B's, online", |r| {
        r.as_ref().is_some_and(|r| r["replica"] == "rb" && r.get("offline_since_ms").is_none())
    })
    .await;
    publish(&b, "s/a", "one").await;
    let got = c.next_publish().await;
    assert_eq!(got.payload, Bytes::from("one"));
    assert_eq!(got.qos, v5::QoS::AtLeastOnce, "min(1, 1)");
    let ids = got.properties.as_ref().map(|p| p.subscription_identifiers.clone()).unwrap_or_default();
    assert_eq!(ids, [7], "the Subscription Identifier came along [MQTT-3.3.4-3]");
    publish(&b, "s/b/x", "two").await;
    let got = c.next_publish().await;
    assert_eq!((got.payload.clone(), got.qos), (Bytes::from("two"), v5::QoS::AtMostOnce), "min(1, 0)");
    publish(&b, "s/gone", "three").await;
    c.expect_no_publish(Duration::from_millis(500)).await;

    // A change at B, then back at A: A finds B's session, not its own.
    c.subscribe("s/c", v5::QoS::AtLeastOnce).await;
    c.client.disconnect().await.expect("disconnect");
    record_until(&nats, &id, "offline at B", |r| r.as_ref().is_some_and(|r| r["offline_since_ms"].as_u64().is_some())).await;
    let (mut c, connack) = v5::Client::connect_with(persistent(&a, &id, false, 300)).await;
    assert!(session_present(&connack));
    publish(&a, "s/c", "four").await;
    assert_eq!(c.next_publish().await.payload, Bytes::from("four"), "the subscription made at B");
}

/// A persistent session's shared subscription is part of it (MQTT 5
/// §4.1: the Session State holds the client's subscriptions): taken up at
/// another replica, the session is a member of its group there again and
/// gets the group's values without a new SUBSCRIBE. (Before, the take-up
/// dropped it: the values went to no one.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_persistent_sessions_shared_subscription_goes_on_at_another_replica() {
    let nats = NatsCluster::start(3);
    let a = replica("ra", &nats.urls(), &["--set", TTL]);
    let b = replica("rb", &nats.urls(), &["--set", TTL]);
    let id = unique("member");
    let (mut c, _) = v5::Client::connect_with(persistent(&a, &id, true, 300)).await;
    c.subscribe("$share/g/sh/x", v5::QoS::AtLeastOnce).await;
    publish(&a, "sh/x", "at A").await;
    assert_eq!(c.next_publish().await.payload, Bytes::from("at A"));
    c.client.disconnect().await.expect("disconnect");
    record_until(&nats, &id, "offline", |r| r.as_ref().is_some_and(|r| r["offline_since_ms"].as_u64().is_some())).await;

    let (mut c, connack) = v5::Client::connect_with(persistent(&b, &id, false, 300)).await;
    assert!(session_present(&connack), "taken up at B: {connack:?}");
    publish(&b, "sh/x", "at B").await;
    let got = c.next_publish().await;
    assert_eq!((got.payload, got.qos), (Bytes::from("at B"), v5::QoS::AtLeastOnce), "the group's value, at the member's QoS");
}

/// Clean Start at another replica ends the session everywhere: no
/// Session Present [MQTT-3.2.2-1], the record deleted once the new
/// connection (Session Expiry 0) ends, and the client back at the first
/// replica finds no session there either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clean_start_at_another_replica_ends_the_session_everywhere() {
    let nats = NatsCluster::start(3);
    let a = replica("ra", &nats.urls(), &["--set", TTL]);
    let b = replica("rb", &nats.urls(), &["--set", TTL]);
    let id = unique("cleaner");

    let (mut c, _) = v5::Client::connect_with(persistent(&a, &id, true, 300)).await;
    c.subscribe("e/x", v5::QoS::AtLeastOnce).await;
    c.client.disconnect().await.expect("disconnect");
    record_until(&nats, &id, "offline", |r| r.as_ref().is_some_and(|r| r["offline_since_ms"].as_u64().is_some())).await;

    let (c, connack) = v5::Client::connect_with(v5::options(b.mqtt_port(), &id, true)).await;
    assert!(!session_present(&connack), "Clean Start [MQTT-3.2.2-1]");
    record_until(&nats, &id, "deleted by the Clean Start", |r| r.is_none()).await;
    c.client.disconnect().await.expect("disconnect");

    let (mut c, connack) = v5::Client::connect_with(persistent(&a, &id, false, 300)).await;
    assert!(!session_present(&connack), "A's copy ended too: {connack:?}");
    publish(&a, "e/x", "stale").await;
    c.expect_no_publish(Duration::from_millis(500)).await;
}

/// The replica serving a persistent session is SIGKILLed with the client
/// connected: the client goes on at another replica with its
/// subscriptions. A session whose Session Expiry Interval ran out is not
/// taken up (MQTT 5 §3.1.2.11.2).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_outlives_its_replica_killed_but_not_its_expiry() {
    let nats = NatsCluster::start(3);
    let mut a = replica("ra", &nats.urls(), &["--set", TTL]);
    let b = replica("rb", &nats.urls(), &["--set", TTL]);
    let (id, short) = (unique("survivor"), unique("shortlived"));

    let (mut s, _) = v5::Client::connect_with(persistent(&a, &short, true, 2)).await;
    s.subscribe("k/short", v5::QoS::AtLeastOnce).await;
    s.client.disconnect().await.expect("disconnect");
    let (mut c, _) = v5::Client::connect_with(persistent(&a, &id, true, 300)).await;
    c.subscribe("k/+", v5::QoS::AtLeastOnce).await;
    a.kill();
    drop(c);

    let (mut c, connack) = v5::Client::connect_with(persistent(&b, &id, false, 300)).await;
    assert!(session_present(&connack), "taken up after A's SIGKILL: {connack:?}");
    publish(&b, "k/1", "after the kill").await;
    assert_eq!(c.next_publish().await.payload, Bytes::from("after the kill"));

    // Killed before A could expire it: the record stays, expired.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let (mut s, connack) = v5::Client::connect_with(persistent(&b, &short, false, 2)).await;
    assert!(!session_present(&connack), "expired 2 s after its client left: {connack:?}");
    publish(&b, "k/short", "not for it").await;
    s.expect_no_publish(Duration::from_millis(500)).await;
}

/// A client identifier reused across workspaces: `u1` (workspace `w1`)
/// leaves replica A, whose NATS round trip is slowed to 2 s, and `u2`
/// (workspace `w2`) connects with the same identifier and Clean Start 1
/// on B at once. A's
/// "offline" write reaches NATS after B's record: a compare-and-set on
/// the revision A last wrote, it conflicts, A no longer owns the
/// identifier, and the write is dropped (counted) — B's record stays, not
/// A's stale one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_offline_write_of_the_replica_a_reused_client_identifier_left_does_not_replace_the_new_owners_record() {
    use crate::security::{passwd, TempDir};
    let nats = NatsCluster::start(3);
    let dir = TempDir::new("session-reuse");
    let file = dir.path("passwd");
    passwd(&file, "u1", "pw", Some("w1"));
    passwd(&file, "u2", "pw", Some("w2"));
    let auth = format!("auth.password_file=\"{}\"", file.display());
    let proxy = crate::nats::NatsProxy::start(nats.client_addr(0));
    let a = replica("ra", &[proxy.url()], &["--set", TTL, "--set", &auth]);
    let b = replica("rb", &nats.urls(), &["--set", TTL, "--set", &auth]);
    let id = unique("reused");
    let login = |broker: &Broker, user: &str| {
        // u2 starts clean: a session held by another identity is refused
        // (0x85, DESIGN.md §9) while it lasts; Clean Start ends it
        // [MQTT-3.1.2-4] and the identifier is u2's.
        let mut o = persistent(broker, &id, user == "u2", 300);
        o.set_credentials(user, "pw");
        o
    };

    let (mut c, _) = v5::Client::connect_with(login(&a, "u1")).await;
    c.subscribe("from/w1", v5::QoS::AtLeastOnce).await;
    let r = record(&nats, &id).await.expect("A's record");
    assert_eq!((r["replica"].as_str(), r["workspace"].as_str()), (Some("ra"), Some("w1")), "{r}");
    // Past the flap delay of A's claim: B's claim does not wait.
    tokio::time::sleep(Duration::from_millis(1_200)).await;

    proxy.set_round_trip(Duration::from_secs(2));
    c.client.disconnect().await.expect("disconnect");
    drop(c);
    let (mut c2, _) = v5::Client::connect_with(login(&b, "u2")).await;
    c2.subscribe("from/w2", v5::QoS::AtLeastOnce).await;
    let r = record(&nats, &id).await.expect("B's record");
    assert_eq!((r["replica"].as_str(), r["workspace"].as_str()), (Some("rb"), Some("w2")), "{r}");

    // A's offline write arrives ~1 s after it was sent; its conflict is
    // resolved through the same slow link (two reads): 8 s is plenty.
    let deadline = Instant::now() + Duration::from_secs(8);
    while a.metric_sum("fleetmq_cluster_session_records_stale_total") < 1.0 {
        let r = record(&nats, &id).await.expect("a record");
        assert_eq!(r["replica"].as_str(), Some("rb"), "A's stale write replaced B's record: {r}");
        assert!(Instant::now() < deadline, "A's late write was neither dropped nor counted");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    proxy.set_round_trip(Duration::ZERO);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let r = record(&nats, &id).await.expect("B's record stays");
    assert_eq!((r["replica"].as_str(), r["workspace"].as_str()), (Some("rb"), Some("w2")), "{r}");
    assert!(r.get("offline_since_ms").is_none(), "B's client is connected: {r}");
    assert_eq!(filters(&r), ["\u{0}w2/from/w2"], "{r}");
    drop(c2);
}
