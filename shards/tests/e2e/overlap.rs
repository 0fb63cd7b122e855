//! Overlapping subscriptions of one client: one delivery at the highest
//! granted QoS, carrying every matching subscription identifier.

use std::time::Duration;

use rumqttc::v5::mqttbytes::v5::SubscribeProperties;

use crate::clients::{unique, v4, v5};
use crate::harness::Broker;

/// `T/#` at QoS 1 and `T/+` at QoS 0 overlap on `T/x`: a QoS 2 publish
/// arrives once, at QoS 1 [MQTT-3.3.4-2] (MQTT 3.1.1: [MQTT-3.3.5-1]).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mqtt311_overlapping_subscriptions_deliver_once_at_the_highest_qos() {
    let broker = Broker::two_shards(&[]);
    let port = broker.mqtt_port();
    let t = unique("ov");
    let mut sub = v4::Client::connect(port, &unique("sub")).await;
    sub.subscribe(&format!("{t}/#"), v4::QoS::AtLeastOnce).await;
    sub.subscribe(&format!("{t}/+"), v4::QoS::AtMostOnce).await;
    let publisher = v4::Client::connect(port, &unique("pub")).await;
    publisher
        .client
        .publish(format!("{t}/x"), v4::QoS::ExactlyOnce, false, "once")
        .await
        .unwrap();
    let got = sub.next_publish().await;
    assert_eq!(
        (got.qos, &got.payload[..]),
        (v4::QoS::AtLeastOnce, &b"once"[..])
    );
    sub.expect_no_publish(Duration::from_millis(300)).await;
}

/// MQTT 5: the same overlap with Subscription Identifiers 7 and 9 gives one
/// PUBLISH at QoS 1 that carries both identifiers [MQTT-3.3.4-2]
/// [MQTT-3.3.4-3].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mqtt5_overlapping_subscriptions_deliver_once_with_both_subscription_identifiers() {
    let broker = Broker::two_shards(&[]);
    let port = broker.mqtt_port();
    let t = unique("ov5");
    let mut sub = v5::Client::connect(port, &unique("sub")).await;
    for (filter, qos, id) in [
        (format!("{t}/#"), v5::QoS::AtLeastOnce, 7),
        (format!("{t}/+"), v5::QoS::AtMostOnce, 9),
    ] {
        let props = SubscribeProperties {
            id: Some(id),
            user_properties: Vec::new(),
        };
        sub.client
            .subscribe_with_properties(filter, qos, props)
            .await
            .unwrap();
        sub.wait_for("SUBACK", |p| matches!(p, v5::Packet::SubAck(_)))
            .await;
    }
    let publisher = v5::Client::connect(port, &unique("pub")).await;
    publisher
        .client
        .publish(format!("{t}/x"), v5::QoS::ExactlyOnce, false, "once")
        .await
        .unwrap();
    let got = sub.next_publish().await;
    assert_eq!(
        (got.qos, &got.payload[..]),
        (v5::QoS::AtLeastOnce, &b"once"[..])
    );
    let mut ids = got
        .properties
        .map(|p| p.subscription_identifiers)
        .unwrap_or_default();
    ids.sort_unstable();
    assert_eq!(
        ids,
        vec![7, 9],
        "both subscription identifiers in the one PUBLISH"
    );
    sub.expect_no_publish(Duration::from_millis(300)).await;
}
