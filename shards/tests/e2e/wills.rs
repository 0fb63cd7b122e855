//! Wills: published when a client vanishes (killed, keep-alive timeout,
//! MQTT 5 DISCONNECT 0x04), not after a normal DISCONNECT; the MQTT 5 Will
//! Delay Interval holds it back and a reconnect within the delay cancels it.

use std::time::{Duration, Instant};

use rumqttc::v5::mqttbytes::v5::{LastWill, LastWillProperties};

use crate::clients::{unique, v4, v5, WAIT};
use crate::harness::{mosquitto_pub, Broker, MosquittoSub};
use crate::raw::{wire, RawClient};

/// mosquitto_sub with a will, killed with SIGKILL (no DISCONNECT): the will
/// is published [MQTT-3.1.2-8], over both protocol versions.
#[test]
fn will_is_published_when_the_client_is_killed() {
    let broker = Broker::two_shards(&[]);
    for version in ["mqttv311", "mqttv5"] {
        let will_topic = unique("will/killed");
        let mut watcher = MosquittoSub::start(&broker, &["-t", &will_topic, "-q", "1"]);
        let doomed = MosquittoSub::start(
            &broker,
            &[
                "-V",
                version,
                "-t",
                &unique("idle"),
                "--will-topic",
                &will_topic,
                "--will-payload",
                "gone",
                "--will-qos",
                "1",
            ],
        );
        doomed.kill();
        assert_eq!(
            watcher.next_message(WAIT),
            Some(format!("1 0 {will_topic} gone")),
            "{version}"
        );
    }
}

/// mosquitto_pub with a will publishes and disconnects normally: its message
/// arrives and its will does not [MQTT-3.1.2-10] [MQTT-3.14.4-3].
#[test]
fn will_is_not_published_after_a_clean_disconnect() {
    let broker = Broker::two_shards(&[]);
    for version in ["mqttv311", "mqttv5"] {
        let t = unique("will/clean");
        let mut watcher = MosquittoSub::start(&broker, &["-t", &format!("{t}/#"), "-q", "1"]);
        let (will_topic, msg_topic) = (format!("{t}/will"), format!("{t}/msg"));
        mosquitto_pub(
            &broker,
            &[
                "-V",
                version,
                "-t",
                &msg_topic,
                "-q",
                "1",
                "-m",
                "bye",
                "--will-topic",
                &will_topic,
                "--will-payload",
                "gone",
            ],
        );
        assert_eq!(
            watcher.next_message(WAIT),
            Some(format!("1 0 {msg_topic} bye")),
            "{version}"
        );
        assert_eq!(
            watcher.next_message(Duration::from_millis(500)),
            None,
            "{version}: no will"
        );
    }
}

fn delayed_will_options(port: u16, id: &str, topic: &str) -> v5::MqttOptions {
    let mut o = v5::options(port, id, false);
    o.set_session_expiry_interval(Some(60));
    let props = LastWillProperties {
        delay_interval: Some(2),
        payload_format_indicator: None,
        message_expiry_interval: None,
        content_type: None,
        response_topic: None,
        correlation_data: None,
        user_properties: Vec::new(),
    };
    o.set_last_will(LastWill::new(
        topic,
        id.to_owned(),
        v5::QoS::AtLeastOnce,
        false,
        Some(props),
    ));
    o
}

/// MQTT 5 wills with Will Delay Interval 2 s: of two killed clients, the one
/// that reconnects within the delay has no will published [MQTT-3.1.3-9];
/// the other one's will comes about 2 s after the kill, not before
/// [MQTT-3.1.2-8].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn will_delay_holds_the_will_back_and_a_reconnect_cancels_it() {
    let broker = Broker::two_shards(&[]);
    let port = broker.mqtt_port();
    let t = unique("will/delay");
    let mut watcher = v4::Client::connect(port, &unique("watcher")).await;
    watcher
        .subscribe(&format!("{t}/#"), v4::QoS::AtLeastOnce)
        .await;
    let (returning, leaving) = (unique("returning"), unique("leaving"));
    let topic_of = |id: &str| format!("{t}/{id}");
    let (a, _) = v5::Client::connect_with(delayed_will_options(
        port,
        &returning,
        &topic_of(&returning),
    ))
    .await;
    let (b, _) =
        v5::Client::connect_with(delayed_will_options(port, &leaving, &topic_of(&leaving))).await;
    a.kill().await;
    b.kill().await;
    let killed = Instant::now();
    let (_a_again, connack) = v5::Client::connect_with(delayed_will_options(
        port,
        &returning,
        &topic_of(&returning),
    ))
    .await;
    assert!(
        matches!(connack, v5::Packet::ConnAck(ref c) if c.session_present),
        "{connack:?}"
    );

    let will = watcher
        .try_next_publish(Duration::from_secs(5))
        .await
        .expect("the leaving client's will");
    let after = killed.elapsed();
    assert_eq!(
        std::str::from_utf8(&will.payload).unwrap(),
        leaving,
        "only the client that stayed away"
    );
    assert!(
        after >= Duration::from_millis(1500),
        "will published {after:?} after the kill, before its 2 s delay"
    );
    assert!(
        after <= Duration::from_millis(4000),
        "will published {after:?} after the kill"
    );
    let rest = Duration::from_millis(3500).saturating_sub(killed.elapsed());
    watcher
        .expect_no_publish(rest.max(Duration::from_millis(200)))
        .await;
}

/// A killed MQTT 5 client with Will Delay Interval 30 s and Session Expiry
/// Interval 60 s comes back with Clean Start 1: that ends its old session,
/// so the will is published then, not 30 s later nor never (MQTT 5
/// §3.1.3.2.2: the will waits "until the Will Delay Interval has passed or
/// the Session ends, whichever happens first"); the new connection is not
/// to that session, so [MQTT-3.1.3-9] does not cancel it. Session Present 0
/// [MQTT-3.2.2-2]. Found by a fresh-user pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clean_start_ends_the_old_session_and_publishes_its_delayed_will() {
    let broker = Broker::two_shards(&[]);
    let port = broker.mqtt_port();
    let t = unique("will/clean-start");
    let mut watcher = v4::Client::connect(port, &unique("watcher")).await;
    watcher.subscribe(&format!("{t}/#"), v4::QoS::AtLeastOnce).await;
    let id = unique("back-clean");
    let options = |clean_start: bool| {
        let mut o = delayed_will_options(port, &id, &format!("{t}/{id}"));
        o.set_clean_start(clean_start);
        if let Some(will) = o.last_will().as_mut() {
            will.properties.as_mut().expect("set above").delay_interval = Some(30);
            o.set_last_will(will.clone());
        }
        o
    };
    let (client, _) = v5::Client::connect_with(options(false)).await;
    client.kill().await;
    tokio::task::block_in_place(|| broker.wait_for_clients(1, WAIT));
    watcher.expect_no_publish(Duration::from_millis(300)).await;
    let (_back, connack) = v5::Client::connect_with(options(true)).await;
    assert!(matches!(connack, v5::Packet::ConnAck(ref c) if !c.session_present), "{connack:?}");
    let will = watcher.next_publish().await;
    assert_eq!(std::str::from_utf8(&will.payload).unwrap(), id);
}

/// MQTT 5 DISCONNECT with reason 0x04 (Disconnect with Will Message) is a
/// clean close that still publishes the will [MQTT-3.14.2-1].
#[test]
fn disconnect_with_reason_0x04_publishes_the_will() {
    let broker = Broker::two_shards(&[]);
    let will_topic = unique("will/0x04");
    let mut watcher = MosquittoSub::start(&broker, &["-t", &will_topic, "-q", "1"]);
    let mut client = RawClient::connect(broker.mqtt);
    let will = wire::Will {
        topic: &will_topic,
        payload: b"asked for",
        delay_secs: None,
        payload_format: None,
    };
    let id = unique("c");
    let connect = wire::Connect {
        will: Some(will),
        ..wire::Connect::v5(&id)
    };
    assert_eq!(client.handshake(&connect.encode()).1, 0);
    client.send(&wire::disconnect_v5(0x04));
    client.packets_until_closed(WAIT);
    assert_eq!(
        watcher.next_message(WAIT),
        Some(format!("0 0 {will_topic} asked for"))
    );
}

/// A 3.1.1 client with Keep Alive 1 s that sends nothing after CONNECT is
/// disconnected after 1.5 s [MQTT-3.1.2-22] and its will is published.
#[test]
fn keep_alive_timeout_closes_the_connection_and_publishes_the_will() {
    let broker = Broker::two_shards(&[]);
    let will_topic = unique("will/keepalive");
    let mut watcher = MosquittoSub::start(&broker, &["-t", &will_topic, "-q", "1"]);
    let mut client = RawClient::connect(broker.mqtt);
    let will = wire::Will {
        topic: &will_topic,
        payload: b"silent",
        delay_secs: None,
        payload_format: None,
    };
    let id = unique("quiet");
    let connect = wire::Connect {
        keep_alive: 1,
        will: Some(will),
        ..wire::Connect::v311(&id)
    };
    assert_eq!(client.handshake(&connect.encode()), (0, 0));
    let connacked = Instant::now();
    let seen = client.packets_until_closed(Duration::from_secs(4));
    let after = connacked.elapsed();
    assert!(
        seen.is_empty(),
        "3.1.1 gets no packet before the close: {seen:02x?}"
    );
    assert!(
        (Duration::from_millis(1400)..=Duration::from_millis(2500)).contains(&after),
        "closed {after:?} after CONNACK, expected about 1.5 s"
    );
    assert_eq!(
        watcher.next_message(WAIT),
        Some(format!("0 0 {will_topic} silent"))
    );
}

/// An MQTT 5 will whose Payload Format Indicator says UTF-8 but whose
/// payload is not gets CONNACK 0x99 (MQTT 5 §3.1.3.2.3: the server MAY
/// validate it); with valid UTF-8 it is accepted.
#[test]
fn a_will_payload_marked_utf8_that_is_not_gets_connack_0x99() {
    let broker = Broker::two_shards(&[]);
    let connect = |id: &str, payload: &'static [u8]| {
        let will = wire::Will {
            topic: "will/format",
            payload,
            delay_secs: None,
            payload_format: Some(1),
        };
        let mut client = RawClient::connect(broker.mqtt);
        client.handshake(&wire::Connect { will: Some(will), ..wire::Connect::v5(id) }.encode()).1
    };
    assert_eq!(connect(&unique("bad"), b"\xff\xfe"), 0x99);
    assert_eq!(connect(&unique("good"), "gone ✓".as_bytes()), 0);
}

/// A will is a publish the broker makes for the client, and `$SYS/` is the
/// broker's (MQTT 5 §4.7.2): a CONNECT whose Will Topic is under `$SYS/`
/// is refused, MQTT 5 CONNACK 0x87 Not authorized, 3.1.1 return code 5
/// [MQTT-3.2.2-6] (a refusing CONNACK, then the connection closes), and
/// nothing is published there, retained or not.
#[test]
fn a_will_under_sys_is_refused_at_connect() {
    let broker = Broker::two_shards(&[]);
    let mut watcher = MosquittoSub::start(&broker, &["-t", "$SYS/fake/#", "-v"]);
    for (connect, refused) in [
        (wire::Connect::v5("spoof-5"), 0x87),
        (wire::Connect::v311("spoof-3"), 5),
    ] {
        let connect = wire::Connect {
            will: Some(wire::Will { topic: "$SYS/fake/alert", payload: b"SPOOFED", delay_secs: None, payload_format: None }),
            ..connect
        };
        let mut client = RawClient::connect(broker.mqtt);
        assert_eq!(client.handshake(&connect.encode()).1, refused, "level {}", connect.level);
    }
    assert_eq!(watcher.next_message(Duration::from_secs(1)), None, "a will reached $SYS");
    let mut late = MosquittoSub::start(&broker, &["-t", "$SYS/fake/#", "-v"]);
    assert_eq!(late.next_message(Duration::from_millis(500)), None, "a will was retained under $SYS");
}
