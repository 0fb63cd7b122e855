//! QoS 0, 1 and 2 delivery with rumqttc (3.1.1 and 5) and mosquitto, and
//! the downgrade to the QoS the subscription was granted.

use std::time::Duration;

use crate::clients::{unique, v4, v5, WAIT};
use crate::harness::{mosquitto_pub, Broker, MosquittoSub};

fn qos4(n: u8) -> v4::QoS {
    [
        v4::QoS::AtMostOnce,
        v4::QoS::AtLeastOnce,
        v4::QoS::ExactlyOnce,
    ][n as usize]
}

fn qos5(n: u8) -> v5::QoS {
    [
        v5::QoS::AtMostOnce,
        v5::QoS::AtLeastOnce,
        v5::QoS::ExactlyOnce,
    ][n as usize]
}

/// Every (published QoS, subscribed QoS) pair over MQTT 3.1.1: the message
/// arrives once, at the minimum of the two [MQTT-3.8.4-8]; the publisher's
/// flow completes (PUBACK for 1, PUBCOMP for 2).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mqtt311_delivers_every_qos_at_the_minimum_of_published_and_granted() {
    let broker = Broker::two_shards(&[]);
    let port = broker.mqtt_port();
    let topic = unique("qos311");
    let mut publisher = v4::Client::connect(port, &unique("pub")).await;
    for sub_qos in 0..=2u8 {
        let mut sub = v4::Client::connect(port, &unique("sub")).await;
        let filter = format!("{topic}/{sub_qos}/#");
        sub.subscribe(&filter, qos4(sub_qos)).await;
        for pub_qos in 0..=2u8 {
            let payload = format!("pub{pub_qos}-sub{sub_qos}");
            publisher
                .client
                .publish(
                    format!("{topic}/{sub_qos}/x"),
                    qos4(pub_qos),
                    false,
                    payload.clone(),
                )
                .await
                .unwrap();
            match pub_qos {
                1 => drop(
                    publisher
                        .wait_for("PUBACK", |p| matches!(p, v4::Packet::PubAck(_)))
                        .await,
                ),
                2 => drop(
                    publisher
                        .wait_for("PUBCOMP", |p| matches!(p, v4::Packet::PubComp(_)))
                        .await,
                ),
                _ => {}
            }
            let got = sub.try_next_publish(WAIT).await;
            let got = got.unwrap_or_else(|| {
                panic!("published QoS {pub_qos}, granted {sub_qos}: no PUBLISH")
            });
            assert_eq!(got.payload, payload.as_bytes());
            assert_eq!(
                got.qos,
                qos4(pub_qos.min(sub_qos)),
                "published {pub_qos}, granted {sub_qos}"
            );
            assert!(!got.retain);
        }
        sub.expect_no_publish(Duration::from_millis(100)).await;
        sub.disconnect().await;
    }
}

/// The same matrix over MQTT 5 [MQTT-3.8.4-8].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mqtt5_delivers_every_qos_at_the_minimum_of_published_and_granted() {
    let broker = Broker::two_shards(&[]);
    let port = broker.mqtt_port();
    let topic = unique("qos5");
    let mut publisher = v5::Client::connect(port, &unique("pub")).await;
    for sub_qos in 0..=2u8 {
        let mut sub = v5::Client::connect(port, &unique("sub")).await;
        let filter = format!("{topic}/{sub_qos}/#");
        sub.subscribe(&filter, qos5(sub_qos)).await;
        for pub_qos in 0..=2u8 {
            let payload = format!("pub{pub_qos}-sub{sub_qos}");
            publisher
                .client
                .publish(
                    format!("{topic}/{sub_qos}/x"),
                    qos5(pub_qos),
                    false,
                    payload.clone(),
                )
                .await
                .unwrap();
            match pub_qos {
                1 => drop(
                    publisher
                        .wait_for("PUBACK", |p| matches!(p, v5::Packet::PubAck(_)))
                        .await,
                ),
                2 => drop(
                    publisher
                        .wait_for("PUBCOMP", |p| matches!(p, v5::Packet::PubComp(_)))
                        .await,
                ),
                _ => {}
            }
            let got = sub.try_next_publish(WAIT).await;
            let got = got.unwrap_or_else(|| {
                panic!("published QoS {pub_qos}, granted {sub_qos}: no PUBLISH")
            });
            assert_eq!(got.payload, payload.as_bytes());
            assert_eq!(
                got.qos,
                qos5(pub_qos.min(sub_qos)),
                "published {pub_qos}, granted {sub_qos}"
            );
            assert!(!got.retain);
        }
        sub.expect_no_publish(Duration::from_millis(100)).await;
        sub.disconnect().await;
    }
}

/// mosquitto_pub at QoS 2 to a mosquitto_sub subscribed at QoS 1 (both
/// protocol versions): one message, delivered at QoS 1 [MQTT-3.8.4-8].
#[test]
fn mosquitto_qos2_publish_reaches_a_qos1_subscriber_at_qos1() {
    let broker = Broker::two_shards(&[]);
    for version in ["mqttv311", "mqttv5"] {
        let topic = unique("down");
        let mut sub = MosquittoSub::start(&broker, &["-V", version, "-t", &topic, "-q", "1"]);
        mosquitto_pub(
            &broker,
            &["-V", version, "-t", &topic, "-q", "2", "-m", "hello"],
        );
        assert_eq!(
            sub.next_message(WAIT).as_deref(),
            Some(format!("1 0 {topic} hello").as_str()),
            "{version}"
        );
        assert_eq!(
            sub.next_message(Duration::from_millis(200)),
            None,
            "{version}: delivered once"
        );
    }
}

/// mosquitto clients at QoS 0, 1 and 2 end to end, over both versions.
#[test]
fn mosquitto_clients_exchange_messages_at_qos_0_1_and_2() {
    let broker = Broker::two_shards(&[]);
    for version in ["mqttv311", "mqttv5"] {
        for qos in ["0", "1", "2"] {
            let topic = unique("mq");
            let mut sub = MosquittoSub::start(&broker, &["-V", version, "-t", &topic, "-q", qos]);
            mosquitto_pub(
                &broker,
                &["-V", version, "-t", &topic, "-q", qos, "-m", "21.5"],
            );
            let want = format!("{qos} 0 {topic} 21.5");
            assert_eq!(
                sub.next_message(WAIT).as_deref(),
                Some(want.as_str()),
                "{version} QoS {qos}"
            );
        }
    }
}

/// A message published after the subscriber's SUBACK reaches it, whichever
/// shards the two clients landed on: 100 fresh subscribers, each sent one
/// QoS 1 message as soon as its SUBACK arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_right_after_suback_reaches_the_new_subscriber() {
    let broker = Broker::two_shards(&[]);
    let port = broker.mqtt_port();
    let mut publisher = v4::Client::connect(port, &unique("pub")).await;
    let mut lost = Vec::new();
    for round in 0..100 {
        let topic = unique("fresh");
        let mut sub = v4::Client::connect(port, &unique("sub")).await;
        sub.subscribe(&topic, v4::QoS::AtLeastOnce).await;
        publisher
            .client
            .publish(&topic, v4::QoS::AtLeastOnce, false, "first")
            .await
            .unwrap();
        publisher
            .wait_for("PUBACK", |p| matches!(p, v4::Packet::PubAck(_)))
            .await;
        if sub.try_next_publish(Duration::from_secs(1)).await.is_none() {
            lost.push(round);
        }
        sub.disconnect().await;
    }
    assert!(
        lost.is_empty(),
        "rounds whose message published after SUBACK never arrived: {lost:?}"
    );
}
