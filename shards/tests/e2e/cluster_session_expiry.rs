//! Session expiry across replicas (DESIGN.md §4, §5; issue 24): a
//! persistent session whose replica was SIGKILLed and whose client never
//! came back is ended by the sweeper once its Session Expiry Interval has
//! passed since its connection ended (the disconnect time its record
//! gives, else when its replica was taken for gone): its record, its
//! cursor and its QoS 2 flows are deleted, its interest goes everywhere
//! (a value it wanted is no longer logged), and a later CONNECT with
//! Clean Start 0 gets Session Present 0. A client back before the expiry
//! keeps everything; a session expiring on a live replica ends the same
//! way. Real rumqttc clients, real replicas, a real 3-server NATS cluster.

use std::time::{Duration, Instant};

use fleetmq_core::cluster::records::{client_key, qos2_key};

use crate::clients::{unique, v5};
use crate::cluster::replica;
use crate::cluster_session_log::{logged, payloads, persistent, publish, LOG};
use crate::cluster_session_state::session_present;
use crate::nats::NatsCluster;

/// `member_ttl` of these tests: a killed replica is taken for gone
/// 7.5–8.5 s after its last membership write.
const TTL: &str = "cluster.member_ttl=5s";

/// Whether `key` has a value in `bucket` now (a delete marker is none).
async fn present(nats: &NatsCluster, bucket: &str, key: &str) -> bool {
    let js = async_nats::jetstream::new(crate::nats::connect(&nats.urls()).await);
    let kv = js.get_key_value(bucket).await.expect("the bucket");
    kv.get(key).await.expect("a read").is_some()
}

/// The three entries of `client_id`'s session: record, cursor, and its
/// QoS 2 flow with packet identifier 7.
async fn entries(nats: &NatsCluster, client_id: &str) -> [bool; 3] {
    [
        present(nats, "mqtt-session-state", &client_key(client_id)).await,
        present(nats, "mqtt-session-cursor", &client_key(client_id)).await,
        present(nats, "mqtt-session-qos2", &qos2_key(client_id, 7)).await,
    ]
}

/// Writes an open inbound QoS 2 flow of `client_id` (packet identifier 7)
/// into `mqtt-session-qos2`, as a publisher's replica does before its
/// PUBREC.
async fn open_qos2_flow(nats: &NatsCluster, client_id: &str) {
    let js = async_nats::jetstream::new(crate::nats::connect(&nats.urls()).await);
    let kv = js.get_key_value("mqtt-session-qos2").await.expect("the bucket");
    // JetStream may refuse a write for a moment under load (its stream
    // leader being elected: "stream not found"): tried again, up to 10 s.
    let deadline = Instant::now() + Duration::from_secs(10);
    while let Err(e) = kv.put(qos2_key(client_id, 7), "a message ID".into()).await {
        assert!(Instant::now() < deadline, "written: {e}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits until `client_id`'s record is gone, at most `within`; how long
/// it took.
async fn record_gone(nats: &NatsCluster, client_id: &str, within: Duration) -> Duration {
    let started = Instant::now();
    while present(nats, "mqtt-session-state", &client_key(client_id)).await {
        assert!(started.elapsed() < within, "{client_id}: its record still there after {within:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    started.elapsed()
}

/// A persistent session (expiry 3 s) at A with its client connected, and
/// another whose client left A 1 s before A is SIGKILLed: the sweeper
/// ends each once its expiry has passed since its connection ended — the
/// left one as soon as A is taken for gone (its record says when it
/// left), the connected one 3 s after that (when A was taken for gone).
/// Record, cursor and QoS 2 flow are deleted; a QoS 1 value it wanted is
/// no longer appended to the log; Clean Start 0 at B gets Session
/// Present 0 [MQTT-3.2.2-3].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_replicas_session_ends_once_its_expiry_passed_and_is_no_longer_logged_for() {
    let nats = NatsCluster::start(3);
    let mut a = replica("ra", &nats.urls(), &["--set", TTL]);
    let b = replica("rb", &nats.urls(), &["--set", TTL]);
    let (held, left) = (unique("held"), unique("left"));
    let mut pb = v5::Client::connect(b.mqtt_port(), &unique("pb")).await;

    let (mut l, _) = v5::Client::connect_with(persistent(&a, &left, true, 3)).await;
    l.subscribe("exp/left", v5::QoS::AtLeastOnce).await;
    let (mut c, _) = v5::Client::connect_with(persistent(&a, &held, true, 3)).await;
    c.subscribe("exp/held", v5::QoS::AtLeastOnce).await;
    // B's watch has the records.
    tokio::time::sleep(Duration::from_millis(500)).await;
    publish(&mut pb, "exp/held", v5::QoS::AtLeastOnce, "read").await;
    publish(&mut pb, "exp/left", v5::QoS::AtLeastOnce, "read").await;
    assert_eq!(&c.next_publish().await.payload[..], b"read");
    assert_eq!(&l.next_publish().await.payload[..], b"read");
    open_qos2_flow(&nats, &held).await;
    open_qos2_flow(&nats, &left).await;
    // The cursors written (at most every 100 ms) with the PUBACKs.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(entries(&nats, &held).await, [true; 3], "record, cursor, QoS 2 flow");
    assert_eq!(entries(&nats, &left).await, [true; 3]);

    l.client.disconnect().await.expect("disconnect");
    tokio::time::sleep(Duration::from_secs(1)).await;
    a.kill();
    let killed = Instant::now();
    drop((c, l));
    // Logged for both while they wait (A's records, at B).
    let before = logged(&nats, LOG).await.expect("the log").len();
    publish(&mut pb, "exp/held", v5::QoS::AtLeastOnce, "owed").await;
    assert_eq!(logged(&nats, LOG).await.unwrap().len(), before + 1, "logged while the session may come back");

    record_gone(&nats, &left, Duration::from_secs(30)).await;
    let left_gone = killed.elapsed();
    record_gone(&nats, &held, Duration::from_secs(30)).await;
    let held_gone = killed.elapsed();
    assert!(left_gone >= Duration::from_secs(7), "not before A is taken for gone: {left_gone:?}");
    assert!(
        held_gone >= left_gone + Duration::from_millis(1500),
        "3 s after A was taken for gone: {held_gone:?} (the one that had left: {left_gone:?})"
    );
    // The cursor and the flow go right after the record.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(entries(&nats, &held).await, [false; 3], "record, cursor, QoS 2 flow gone");
    assert_eq!(entries(&nats, &left).await, [false; 3]);
    assert_eq!(b.metric_sum("fleetmq_cluster_sessions_swept_total"), 2.0);

    // Its interest went with the record: no longer logged.
    let before = logged(&nats, LOG).await.unwrap();
    publish(&mut pb, "exp/held", v5::QoS::AtLeastOnce, "nobody's").await;
    publish(&mut pb, "exp/left", v5::QoS::AtLeastOnce, "nobody's").await;
    assert_eq!(logged(&nats, LOG).await.unwrap(), before, "nothing appended for ended sessions");

    let (mut c, connack) = v5::Client::connect_with(persistent(&b, &held, false, 3)).await;
    assert!(!session_present(&connack), "the session ended: Session Present 0 [MQTT-3.2.2-3]: {connack:?}");
    publish(&mut pb, "exp/held", v5::QoS::AtLeastOnce, "no subscription").await;
    c.expect_no_publish(Duration::from_millis(500)).await;
}

/// A client whose replica was SIGKILLed comes back at B before its
/// session expired: Session Present 1, every value owed, and the session
/// stays past the time it would have expired. Then it leaves B (alive):
/// B ends it when its expiry passes, the same way — record, cursor, QoS 2
/// flow gone, no longer logged, Session Present 0 after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_back_before_its_expiry_keeps_its_session_and_a_live_replica_ends_it_the_same_way() {
    let nats = NatsCluster::start(3);
    let mut a = replica("ra", &nats.urls(), &["--set", TTL]);
    let b = replica("rb", &nats.urls(), &["--set", TTL]);
    let id = unique("back");
    let mut pb = v5::Client::connect(b.mqtt_port(), &unique("pb")).await;
    let (mut c, _) = v5::Client::connect_with(persistent(&a, &id, true, 6)).await;
    c.subscribe("back/+", v5::QoS::AtLeastOnce).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    publish(&mut pb, "back/1", v5::QoS::AtLeastOnce, "0").await;
    assert_eq!(&c.next_publish().await.payload[..], b"0");
    tokio::time::sleep(Duration::from_millis(600)).await;
    a.kill();
    let killed = Instant::now();
    drop(c);
    for n in 1..6 {
        publish(&mut pb, "back/1", v5::QoS::AtLeastOnce, &n.to_string()).await;
    }
    // A is taken for gone 7.5–8.5 s after its last write; the session
    // would expire 6 s after that.
    tokio::time::sleep(Duration::from_secs(10).saturating_sub(killed.elapsed())).await;
    assert!(present(&nats, "mqtt-session-state", &client_key(&id)).await, "not expired yet");
    let (mut c, connack) = v5::Client::connect_with(persistent(&b, &id, false, 6)).await;
    assert!(session_present(&connack), "back in time [MQTT-3.2.2-2]: {connack:?}");
    for n in 1..6 {
        let p = c.next_publish().await;
        assert_eq!(std::str::from_utf8(&p.payload).unwrap(), n.to_string(), "owed while away, in order");
    }
    open_qos2_flow(&nats, &id).await;
    // Past the time it would have expired at A.
    tokio::time::sleep(Duration::from_secs(20).saturating_sub(killed.elapsed())).await;
    assert_eq!(entries(&nats, &id).await, [true; 3], "kept: record, cursor, QoS 2 flow");
    assert_eq!(b.metric_sum("fleetmq_cluster_sessions_swept_total"), 0.0);
    publish(&mut pb, "back/1", v5::QoS::AtLeastOnce, "live").await;
    assert_eq!(&c.next_publish().await.payload[..], b"live");

    // It leaves B, alive: B ends it 6 s later.
    tokio::time::sleep(Duration::from_millis(300)).await;
    c.client.disconnect().await.expect("disconnect");
    let left = Instant::now();
    let took = record_gone(&nats, &id, Duration::from_secs(15)).await;
    assert!(left.elapsed() >= Duration::from_millis(5500), "not before its expiry: {took:?}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(entries(&nats, &id).await, [false; 3], "record, cursor, QoS 2 flow gone");
    let before = payloads(&logged(&nats, LOG).await.unwrap());
    publish(&mut pb, "back/1", v5::QoS::AtLeastOnce, "nobody's").await;
    assert_eq!(payloads(&logged(&nats, LOG).await.unwrap()), before, "no longer logged");
    let (_c, connack) = v5::Client::connect_with(persistent(&b, &id, false, 6)).await;
    assert!(!session_present(&connack), "ended: Session Present 0 [MQTT-3.2.2-3]: {connack:?}");
}
