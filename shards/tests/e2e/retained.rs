//! Retained messages with mosquitto clients: stored, replaced, cleared by an
//! empty payload, delivered with RETAIN=1 on subscribe; a live delivery has
//! RETAIN=0 unless the subscription asks for Retain As Published.

use std::time::Duration;

use crate::clients::{unique, WAIT};
use crate::harness::{mosquitto_pub, Broker, MosquittoSub};

/// A new subscription gets the last retained message with RETAIN=1
/// [MQTT-3.3.1-5] [MQTT-3.3.1-6] [MQTT-3.3.1-8]; a second retained publish
/// replaces it [MQTT-3.3.1-7]; an empty retained payload clears it and is
/// not stored [MQTT-3.3.1-10] [MQTT-3.3.1-11].
#[test]
fn retained_message_is_set_replaced_and_cleared_by_an_empty_payload() {
    let broker = Broker::two_shards(&[]);
    let t = unique("ret");
    let topic = format!("{t}/temp");
    mosquitto_pub(&broker, &["-t", &topic, "-q", "1", "-r", "-m", "v1"]);
    let mut sub = MosquittoSub::start(&broker, &["-t", &format!("{t}/#"), "-q", "1"]);
    assert_eq!(sub.next_message(WAIT), Some(format!("1 1 {topic} v1")));
    drop(sub);

    mosquitto_pub(&broker, &["-t", &topic, "-q", "1", "-r", "-m", "v2"]);
    let mut sub = MosquittoSub::start(&broker, &["-t", &format!("{t}/#"), "-q", "1"]);
    assert_eq!(
        sub.next_message(WAIT),
        Some(format!("1 1 {topic} v2")),
        "replaced"
    );
    assert_eq!(
        sub.next_message(Duration::from_millis(200)),
        None,
        "only the latest is kept"
    );
    drop(sub);

    mosquitto_pub(&broker, &["-t", &topic, "-q", "1", "-r", "-n"]);
    let mut sub = MosquittoSub::start(&broker, &["-t", &format!("{t}/#"), "-q", "1"]);
    assert_eq!(
        sub.next_message(Duration::from_millis(500)),
        None,
        "cleared"
    );
}

/// A retained publish to an existing subscriber arrives with RETAIN=0
/// [MQTT-3.3.1-9]; over MQTT 5 with Retain As Published it keeps RETAIN=1
/// [MQTT-3.3.1-13], without it RETAIN=0 [MQTT-3.3.1-12].
#[test]
fn live_delivery_clears_retain_unless_retain_as_published() {
    let broker = Broker::two_shards(&[]);
    let topic = unique("live");
    let mut v311 = MosquittoSub::start(&broker, &["-V", "mqttv311", "-t", &topic, "-q", "1"]);
    let mut v5_plain = MosquittoSub::start(&broker, &["-V", "mqttv5", "-t", &topic, "-q", "1"]);
    let mut v5_rap = MosquittoSub::start(
        &broker,
        &[
            "-V",
            "mqttv5",
            "-t",
            &topic,
            "-q",
            "1",
            "--retain-as-published",
        ],
    );
    mosquitto_pub(&broker, &["-t", &topic, "-q", "1", "-r", "-m", "now"]);
    assert_eq!(
        v311.next_message(WAIT),
        Some(format!("1 0 {topic} now")),
        "3.1.1"
    );
    assert_eq!(
        v5_plain.next_message(WAIT),
        Some(format!("1 0 {topic} now")),
        "5 without RAP"
    );
    assert_eq!(
        v5_rap.next_message(WAIT),
        Some(format!("1 1 {topic} now")),
        "5 with RAP"
    );
}
