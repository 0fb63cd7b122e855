//! Sessions: a persistent session queues QoS 1 messages while its client is
//! away and delivers them in order on return; a clean one does not; a second
//! connection with the same client identifier takes the session over, also
//! when the two connections were accepted on different shards.

use std::time::Duration;

use crate::clients::{unique, v4, v5, WAIT};
use crate::harness::Broker;

/// Messages published while the subscriber is away.
const OFFLINE_MESSAGES: usize = 50;

async fn publish_numbered_v4(port: u16, topic: &str) {
    let mut publisher = v4::Client::connect(port, &unique("pub")).await;
    for i in 0..OFFLINE_MESSAGES {
        publisher
            .client
            .publish(topic, v4::QoS::AtLeastOnce, false, i.to_string())
            .await
            .unwrap();
    }
    for _ in 0..OFFLINE_MESSAGES {
        publisher
            .wait_for("PUBACK", |p| matches!(p, v4::Packet::PubAck(_)))
            .await;
    }
    publisher.disconnect().await;
}

/// MQTT 3.1.1, clean session 0: 50 QoS 1 messages published while the
/// subscriber is offline arrive on reconnect, in order [MQTT-3.1.2-4]
/// [MQTT-4.6.0-6], with session present 1 [MQTT-3.2.2-2].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mqtt311_persistent_session_delivers_offline_messages_in_order_on_reconnect() {
    let broker = Broker::two_shards(&[]);
    let port = broker.mqtt_port();
    let (id, topic) = (unique("persist"), unique("persist/t"));
    let (mut sub, connack) = v4::Client::connect_with(v4::options(port, &id, false)).await;
    assert!(
        matches!(connack, v4::Packet::ConnAck(ref c) if !c.session_present),
        "{connack:?}"
    );
    sub.subscribe(&topic, v4::QoS::AtLeastOnce).await;
    sub.disconnect().await;
    tokio::task::block_in_place(|| broker.wait_for_clients(0, WAIT));

    publish_numbered_v4(port, &topic).await;

    let (mut sub, connack) = v4::Client::connect_with(v4::options(port, &id, false)).await;
    assert!(
        matches!(connack, v4::Packet::ConnAck(ref c) if c.session_present),
        "{connack:?}"
    );
    for i in 0..OFFLINE_MESSAGES {
        let got = sub.next_publish().await;
        assert_eq!(
            String::from_utf8_lossy(&got.payload),
            i.to_string(),
            "message {i} in order"
        );
        assert_eq!(got.qos, v4::QoS::AtLeastOnce);
    }
    sub.expect_no_publish(Duration::from_millis(200)).await;
}

/// MQTT 5, Clean Start 0 and Session Expiry Interval 60 s: the same 50
/// messages arrive on reconnect, in order [MQTT-3.1.2-5].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mqtt5_session_with_expiry_delivers_offline_messages_in_order_on_reconnect() {
    let broker = Broker::two_shards(&[]);
    let port = broker.mqtt_port();
    let (id, topic) = (unique("persist5"), unique("persist5/t"));
    let options = || {
        let mut o = v5::options(port, &id, false);
        o.set_session_expiry_interval(Some(60));
        o
    };
    let (mut sub, _) = v5::Client::connect_with(options()).await;
    sub.subscribe(&topic, v5::QoS::AtLeastOnce).await;
    sub.disconnect().await;
    tokio::task::block_in_place(|| broker.wait_for_clients(0, WAIT));

    publish_numbered_v4(port, &topic).await;

    let (mut sub, connack) = v5::Client::connect_with(options()).await;
    assert!(
        matches!(connack, v5::Packet::ConnAck(ref c) if c.session_present),
        "{connack:?}"
    );
    for i in 0..OFFLINE_MESSAGES {
        let got = sub.next_publish().await;
        assert_eq!(
            String::from_utf8_lossy(&got.payload),
            i.to_string(),
            "message {i} in order"
        );
    }
    sub.expect_no_publish(Duration::from_millis(200)).await;
}

/// A clean session (3.1.1 clean session 1; MQTT 5 Session Expiry 0) ends
/// with its connection: nothing is kept for it [MQTT-3.1.2-6], and a later
/// connection finds no session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clean_session_does_not_keep_messages_while_offline() {
    let broker = Broker::two_shards(&[]);
    let port = broker.mqtt_port();
    let (id311, id5, topic) = (unique("clean"), unique("clean5"), unique("clean/t"));
    let (mut a, _) = v4::Client::connect_with(v4::options(port, &id311, true)).await;
    a.subscribe(&topic, v4::QoS::AtLeastOnce).await;
    a.disconnect().await;
    let (mut b, _) = v5::Client::connect_with(v5::options(port, &id5, true)).await;
    b.subscribe(&topic, v5::QoS::AtLeastOnce).await;
    b.disconnect().await;
    tokio::task::block_in_place(|| broker.wait_for_clients(0, WAIT));

    publish_numbered_v4(port, &topic).await;

    let (mut a, connack) = v4::Client::connect_with(v4::options(port, &id311, false)).await;
    assert!(
        matches!(connack, v4::Packet::ConnAck(ref c) if !c.session_present),
        "{connack:?}"
    );
    let (mut b, connack) = v5::Client::connect_with(v5::options(port, &id5, false)).await;
    assert!(
        matches!(connack, v5::Packet::ConnAck(ref c) if !c.session_present),
        "{connack:?}"
    );
    a.expect_no_publish(Duration::from_millis(300)).await;
    b.expect_no_publish(Duration::from_millis(10)).await;
}

/// Pairs of connections with the same client identifier; with 2 shards and
/// connections spread by the kernel, many pairs are accepted on different
/// shards. The first connection is closed, with DISCONNECT 0x8E over MQTT 5
/// [MQTT-3.1.4-3]; the second one works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn take_over_closes_the_old_connection_on_either_shard() {
    const PAIRS: usize = 24;
    let broker = Broker::two_shards(&[]);
    let port = broker.mqtt_port();
    let mut tasks = Vec::new();
    for pair in 0..PAIRS {
        tasks.push(tokio::spawn(async move {
            let id = unique(&format!("takeover{pair}"));
            let topic = unique("takeover/t");
            if pair % 2 == 0 {
                let mut old = v5::Client::connect(port, &id).await;
                let mut new = v5::Client::connect(port, &id).await;
                let err = old.closed_with(WAIT).await;
                let reason = err.as_ref().and_then(v5::server_disconnect_reason);
                assert_eq!(
                    reason,
                    Some(0x8E),
                    "pair {pair}: old connection ended with {err:?}"
                );
                new.subscribe(&topic, v5::QoS::AtLeastOnce).await;
                new.client
                    .publish(&topic, v5::QoS::AtLeastOnce, false, "still here")
                    .await
                    .unwrap();
                assert_eq!(
                    &new.next_publish().await.payload[..],
                    b"still here",
                    "pair {pair}"
                );
                Survivor::V5(new)
            } else {
                let mut old = v4::Client::connect(port, &id).await;
                let mut new = v4::Client::connect(port, &id).await;
                assert!(
                    old.closed_with(WAIT).await.is_some(),
                    "pair {pair}: old connection closed"
                );
                new.subscribe(&topic, v4::QoS::AtLeastOnce).await;
                new.client
                    .publish(&topic, v4::QoS::AtLeastOnce, false, "still here")
                    .await
                    .unwrap();
                assert_eq!(
                    &new.next_publish().await.payload[..],
                    b"still here",
                    "pair {pair}"
                );
                Survivor::V4(new)
            }
        }));
    }
    let mut survivors = Vec::new();
    for task in tasks {
        survivors.push(task.await.unwrap());
    }
    // One connection per client identifier is left.
    tokio::task::block_in_place(|| broker.wait_for_clients(PAIRS, WAIT));
    drop(survivors);
}

/// The connection that took a session over, kept open until the end.
enum Survivor {
    V4(#[allow(dead_code)] v4::Client),
    V5(#[allow(dead_code)] v5::Client),
}
