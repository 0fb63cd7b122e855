//! Long client identifiers, topic filters and topics in cluster mode (s40):
//! their KV keys are hashed past 768 bytes (`fleetmq_core::cluster::keys`),
//! so no subject the replica builds from them passes nats-server's 4 KiB
//! control line, which dropped the whole state connection. A 3,900-byte
//! client identifier connects and moves to another replica with its
//! session; a 4,000-byte filter gets its SUBACK at once, routes across
//! replicas and moves with its session; a retained value on a 4,000-byte
//! topic is read on another replica and cleared from there. Real rumqttc
//! clients, real replicas (with the mesh), a real 3-server NATS cluster.

use std::time::{Duration, Instant};

use bytes::Bytes;
use fleetmq_core::cluster::records::client_key;

use crate::clients::{unique, v5};
use crate::cluster_mesh::{start, wait_links, Certs};
use crate::harness::Broker;
use crate::nats::NatsCluster;

/// Topics and filters up to 4,096 bytes accepted (the default is 1,024).
const LONG_TOPICS: [&str; 2] = ["--set", "limits.max_topic_bytes=4096"];

/// MQTT 5 options of `id` on `broker` with a Session Expiry Interval of
/// 300 s.
fn persistent(broker: &Broker, id: &str, clean_start: bool) -> v5::MqttOptions {
    let mut o = v5::options(broker.mqtt_port(), id, clean_start);
    o.set_session_expiry_interval(Some(300));
    o
}

fn session_present(connack: &v5::Packet) -> bool {
    match connack {
        v5::Packet::ConnAck(c) => c.session_present,
        other => panic!("expected a CONNACK, got {other:?}"),
    }
}

/// A SUBACK that granted `qos`.
fn granted(suback: &v5::Packet, qos: u8) {
    let v5::Packet::SubAck(s) = suback else { panic!("expected a SUBACK, got {suback:?}") };
    assert_eq!(s.return_codes.len(), 1);
    let want = rumqttc::v5::mqttbytes::v5::SubscribeReasonCode::Success(qos_of(qos));
    assert_eq!(s.return_codes, [want], "granted");
}

fn qos_of(qos: u8) -> v5::QoS {
    match qos {
        0 => v5::QoS::AtMostOnce,
        1 => v5::QoS::AtLeastOnce,
        _ => v5::QoS::ExactlyOnce,
    }
}

/// No NATS server of `nats` dropped a client for a protocol line over its
/// `max_control_line` (what a long key used to cause).
fn no_control_line_exceeded(nats: &NatsCluster) {
    for i in 0..nats.len() {
        let log = nats.log(i);
        assert!(!log.contains("maximum control line exceeded"), "NATS server {i} dropped a connection:\n{log}");
    }
}

/// `id` (3,900 bytes, MQTT allows up to 65,535 [MQTT-3.1.3-5]) connects
/// on A at once, and moves to B with its session: Session Present 1
/// [MQTT-3.2.2-2], its subscription delivering there [MQTT-3.3.4-3]. Its
/// records are under the hashed key and carry the identifier.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_3900_byte_client_identifier_connects_and_moves_to_another_replica_with_its_session() {
    let nats = NatsCluster::start(3);
    let certs = Certs::new("la,lb");
    let a = start("la", &nats, &certs, &[]);
    let b = start("lb", &nats, &certs, &[]);
    let prefix = unique("long");
    let id = format!("{prefix}{}", "i".repeat(3_900 - prefix.len()));
    assert_eq!(id.len(), 3_900);

    let started = Instant::now();
    let (mut c, connack) = v5::Client::connect_with(persistent(&a, &id, true)).await;
    let connect_took = started.elapsed();
    assert!(!session_present(&connack));
    assert!(connect_took < Duration::from_secs(2), "CONNACK after {connect_took:?}");
    granted(&c.subscribe("long/id", v5::QoS::AtLeastOnce).await, 1);
    c.client.disconnect().await.expect("disconnect");
    drop(c);

    // The session record, under the hashed key, names the client.
    let key = client_key(&id);
    assert!(key.len() < 100, "hashed: {key}");
    let js = async_nats::jetstream::new(crate::nats::connect(&nats.urls()).await);
    let kv = js.get_key_value("mqtt-session-state").await.expect("the bucket");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let record: Option<serde_json::Value> =
            kv.get(&key).await.expect("a read").map(|v| serde_json::from_slice(&v).expect("JSON"));
        if let Some(r) = record.filter(|r| r["offline_since_ms"].as_u64().is_some()) {
            assert_eq!(r["client_id"].as_str(), Some(id.as_str()), "the record carries the identifier");
            break;
        }
        assert!(Instant::now() < deadline, "no offline session record under {key}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let started = Instant::now();
    let (mut c, connack) = v5::Client::connect_with(persistent(&b, &id, false)).await;
    let move_took = started.elapsed();
    assert!(session_present(&connack), "taken up at B: {connack:?}");
    assert!(move_took < Duration::from_secs(3), "CONNACK at B after {move_took:?}");
    let p = v5::Client::connect(b.mqtt_port(), &unique("pub")).await;
    p.client.publish("long/id", v5::QoS::AtLeastOnce, false, Bytes::from("moved")).await.expect("publish");
    assert_eq!(c.next_publish().await.payload, Bytes::from("moved"));

    // And back to A with a take-over while connected at B.
    let (mut back, connack) = v5::Client::connect_with(persistent(&a, &id, false)).await;
    assert!(session_present(&connack), "taken up at A again: {connack:?}");
    let p = v5::Client::connect(a.mqtt_port(), &unique("pub")).await;
    p.client.publish("long/id", v5::QoS::AtLeastOnce, false, Bytes::from("back")).await.expect("publish");
    assert_eq!(back.next_publish().await.payload, Bytes::from("back"));
    eprintln!("3,900-byte client identifier: CONNACK {connect_took:?}, moved with Session Present 1 in {move_took:?}");
    no_control_line_exceeded(&nats);
}

/// A 4,000-byte filter: SUBACK at once (it used to wait 2 s for a route
/// write that never landed), a value published on another replica reaches
/// it, and it moves with its session to that other replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_4000_byte_filter_gets_its_suback_at_once_and_routes_across_replicas() {
    let nats = NatsCluster::start(3);
    let certs = Certs::new("fa,fb");
    let a = start("fa", &nats, &certs, &LONG_TOPICS);
    let b = start("fb", &nats, &certs, &LONG_TOPICS);
    wait_links(&a, 1, Duration::from_secs(15));
    wait_links(&b, 1, Duration::from_secs(15));
    let stem = format!("{}/", unique("f"));
    let level = "l".repeat(4_000 - stem.len() - 2);
    let filter = format!("{stem}{level}/+");
    assert_eq!(filter.len(), 4_000);
    let topic = format!("{stem}{level}/x");
    let id = unique("longsub");

    let (mut sub, _) = v5::Client::connect_with(persistent(&b, &id, true)).await;
    let started = Instant::now();
    granted(&sub.subscribe(&filter, v5::QoS::AtLeastOnce).await, 1);
    let suback_took = started.elapsed();
    assert!(suback_took < Duration::from_secs(1), "SUBACK after {suback_took:?}");

    // Published on A: reaches B's subscriber once B's route is in.
    let p = v5::Client::connect(a.mqtt_port(), &unique("pub")).await;
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        p.client.publish(&topic, v5::QoS::AtMostOnce, false, Bytes::from("probe")).await.expect("publish");
        if let Some(got) = sub.try_next_publish(Duration::from_millis(200)).await {
            assert_eq!(&got.topic[..], topic.as_bytes());
            break;
        }
        assert!(Instant::now() < deadline, "the long filter's route did not reach A");
    }
    sub.client.disconnect().await.expect("disconnect");
    drop(sub);

    // The session moves to A with its long subscription, which delivers
    // there [MQTT-3.3.4-3].
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (mut sub, connack) = v5::Client::connect_with(persistent(&a, &id, false)).await;
    assert!(session_present(&connack), "taken up at A: {connack:?}");
    let p = v5::Client::connect(b.mqtt_port(), &unique("pub")).await;
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        p.client.publish(&topic, v5::QoS::AtLeastOnce, false, Bytes::from("moved")).await.expect("publish");
        if let Some(got) = sub.try_next_publish(Duration::from_millis(300)).await {
            if got.payload == "moved" {
                break;
            }
        }
        assert!(Instant::now() < deadline, "the moved long subscription got nothing from B");
    }
    eprintln!("4,000-byte filter: SUBACK in {suback_took:?}");
    no_control_line_exceeded(&nats);
}

/// A retained value on a 4,000-byte topic, set on A, is sent to a new
/// subscription on B [MQTT-3.3.1-9]; cleared from B (an empty retained
/// payload [MQTT-3.3.1-6]), it is gone on A too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retained_value_on_a_4000_byte_topic_is_read_on_another_replica_and_cleared_from_there() {
    let nats = NatsCluster::start(3);
    let a = crate::cluster::replica("ta", &nats.urls(), &["--set", "cluster.member_ttl=5s", LONG_TOPICS[0], LONG_TOPICS[1]]);
    let b = crate::cluster::replica("tb", &nats.urls(), &["--set", "cluster.member_ttl=5s", LONG_TOPICS[0], LONG_TOPICS[1]]);
    let stem = format!("{}/", unique("t"));
    let topic = format!("{stem}{}", "t".repeat(4_000 - stem.len()));
    assert_eq!(topic.len(), 4_000);

    let mut p = v5::Client::connect(a.mqtt_port(), &unique("pub")).await;
    p.client.publish(&topic, v5::QoS::AtLeastOnce, true, Bytes::from("kept")).await.expect("publish");
    p.wait_for("PUBACK", |p| matches!(p, v5::Packet::PubAck(_))).await;

    let retained_on = |broker: &Broker| {
        let (port, topic) = (broker.mqtt_port(), topic.clone());
        async move {
            let mut s = v5::Client::connect(port, &unique("read")).await;
            granted(&s.subscribe(&topic, v5::QoS::AtLeastOnce).await, 1);
            s.try_next_publish(Duration::from_millis(700)).await
        }
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    let got = loop {
        if let Some(got) = retained_on(&b).await {
            break got;
        }
        assert!(Instant::now() < deadline, "the retained value did not reach B");
    };
    assert!(got.retain, "RETAIN set for a new subscription [MQTT-3.3.1-9]");
    assert_eq!((&got.topic[..], got.payload.clone()), (topic.as_bytes(), Bytes::from("kept")));

    let mut p = v5::Client::connect(b.mqtt_port(), &unique("pub")).await;
    p.client.publish(&topic, v5::QoS::AtLeastOnce, true, Bytes::new()).await.expect("publish");
    p.wait_for("PUBACK", |p| matches!(p, v5::Packet::PubAck(_))).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while let Some(got) = retained_on(&a).await {
        assert!(Instant::now() < deadline, "the clear from B did not reach A: still {:?}", got.payload);
    }
    no_control_line_exceeded(&nats);
}

/// The ingest stream (`store.kind = "jetstream"`, the cluster default)
/// takes a QoS 1 value from a 3,900-byte client identifier on a 4,000-byte
/// topic with a long user property: they travel as headers (never in the
/// subject, which names only the workspace), the PUBACK says success, and
/// the state connection stays up for the next value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_client_identifier_topic_and_user_property_reach_the_ingest_stream_as_headers() {
    let nats = NatsCluster::start(3);
    let a = crate::cluster::replica("ia", &nats.urls(), &["--set", "cluster.member_ttl=5s", LONG_TOPICS[0], LONG_TOPICS[1]]);
    let prefix = unique("ingest");
    let id = format!("{prefix}{}", "c".repeat(3_900 - prefix.len()));
    let topic = format!("{prefix}/{}", "t".repeat(4_000 - prefix.len() - 1));
    let (name, value) = ("n".repeat(2_000), "v".repeat(20_000));
    let mut c = v5::Client::connect(a.mqtt_port(), &id).await;
    let props = rumqttc::v5::mqttbytes::v5::PublishProperties {
        user_properties: vec![(name.clone(), value.clone())],
        ..Default::default()
    };
    c.client
        .publish_with_properties(topic.clone(), v5::QoS::AtLeastOnce, false, Bytes::from("long"), props)
        .await
        .expect("publish");
    let ack = c.wait_for("PUBACK", |p| matches!(p, v5::Packet::PubAck(_))).await;
    let v5::Packet::PubAck(ack) = ack else { unreachable!() };
    assert_eq!(ack.reason, rumqttc::v5::mqttbytes::v5::PubAckReason::Success);
    c.client.publish("short", v5::QoS::AtLeastOnce, false, Bytes::from("next")).await.expect("publish");
    c.wait_for("PUBACK", |p| matches!(p, v5::Packet::PubAck(_))).await;

    let js = async_nats::jetstream::new(crate::nats::connect(&nats.urls()).await);
    let mut stream = js.get_stream("mqtt-ingest").await.expect("the ingest stream");
    let last = stream.info().await.expect("info").state.last_sequence;
    let long = stream.get_raw_message(last - 1).await.expect("the long value");
    assert_eq!(long.subject.as_str(), "mqtt-ingest._");
    let header = |n: &str| long.headers.get(n).map(|v| v.as_str().to_owned());
    assert_eq!(header("Mqtt-Client-Id").as_deref(), Some(id.as_str()));
    assert_eq!(header("Mqtt-Topic").as_deref(), Some(topic.as_str()));
    assert_eq!(header(&format!("Mqtt-User-{name}")).as_deref(), Some(value.as_str()));
    let next = stream.get_raw_message(last).await.expect("the next value");
    assert_eq!(&next.payload[..], b"next");
    no_control_line_exceeded(&nats);
}
