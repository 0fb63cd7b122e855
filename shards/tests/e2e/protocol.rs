//! CONNECT handling and malformed input, byte by byte over a raw socket,
//! plus MQTT 3.1 with mosquitto.

use crate::clients::{unique, WAIT};
use crate::harness::{mosquitto_pub, Broker, MosquittoSub};
use crate::raw::{wire, Incoming, RawClient};

/// SUBSCRIBE with fixed-header flags 0000 instead of the required 0010
/// [MQTT-3.8.1-1]: malformed.
fn subscribe_with_wrong_flags(v5: bool) -> Vec<u8> {
    let mut packet = wire::subscribe(1, "a/b", 0, v5);
    packet[0] = 0x80;
    packet
}

/// A malformed packet closes only its own connection: MQTT 5 gets
/// DISCONNECT 0x81 first [MQTT-4.13.1-1], 3.1.1 is just closed
/// [MQTT-4.8.0-1]; a subscriber on the same broker keeps receiving.
#[test]
fn malformed_packet_closes_only_that_connection() {
    let broker = Broker::two_shards(&[]);
    let topic = unique("bystander");
    let mut bystander = MosquittoSub::start(&broker, &["-t", &topic, "-q", "1"]);

    let mut v5 = RawClient::connect(broker.mqtt);
    assert_eq!(
        v5.handshake(&wire::Connect::v5(&unique("bad5")).encode()).1,
        0
    );
    v5.send(&subscribe_with_wrong_flags(true));
    let seen = v5.packets_until_closed(WAIT);
    assert_eq!(
        seen.first().map(|(h, b)| (*h, b.first().copied())),
        Some((0xE0, Some(0x81))),
        "{seen:02x?}"
    );

    let mut v311 = RawClient::connect(broker.mqtt);
    assert_eq!(
        v311.handshake(&wire::Connect::v311(&unique("bad311")).encode()),
        (0, 0)
    );
    v311.send(&subscribe_with_wrong_flags(false));
    assert_eq!(
        v311.packets_until_closed(WAIT),
        vec![],
        "3.1.1: closed without a packet"
    );

    mosquitto_pub(&broker, &["-t", &topic, "-q", "1", "-m", "still fine"]);
    assert_eq!(
        bystander.next_message(WAIT),
        Some(format!("1 0 {topic} still fine"))
    );
}

/// With `limits.max_packet_size=1KiB` the MQTT 5 CONNACK announces Maximum
/// Packet Size 1024 and a larger PUBLISH gets DISCONNECT 0x95 (MQTT 5
/// §3.2.2.3.6, §4.13); a 3.1.1 one gets a closed connection.
#[test]
fn packet_over_max_packet_size_gets_disconnect_0x95() {
    let broker = Broker::two_shards(&["--set", "limits.max_packet_size=1KiB"]);
    let mut v5 = RawClient::connect(broker.mqtt);
    v5.send(&wire::Connect::v5(&unique("big5")).encode());
    match v5.read(WAIT) {
        Incoming::Packet { header: 0x20, body } => {
            assert_eq!(body[1], 0, "CONNACK success");
            assert!(
                body.windows(5).any(|w| w == [0x27, 0, 0, 4, 0]),
                "Maximum Packet Size 1024 in {body:02x?}"
            );
        }
        other => panic!("expected CONNACK, got {other:02x?}"),
    }
    v5.send(&wire::publish_qos0("big", &[b'x'; 2000], true));
    let seen = v5.packets_until_closed(WAIT);
    assert_eq!(
        seen.first().map(|(h, b)| (*h, b.first().copied())),
        Some((0xE0, Some(0x95))),
        "{seen:02x?}"
    );

    let mut v311 = RawClient::connect(broker.mqtt);
    assert_eq!(
        v311.handshake(&wire::Connect::v311(&unique("big311")).encode()),
        (0, 0)
    );
    v311.send(&wire::publish_qos0("big", &[b'x'; 2000], false));
    assert_eq!(
        v311.packets_until_closed(WAIT),
        vec![],
        "3.1.1: closed without a packet"
    );
}

/// A first packet other than CONNECT closes the connection [MQTT-3.1.0-1].
#[test]
fn first_packet_other_than_connect_closes_the_connection() {
    let broker = Broker::two_shards(&[]);
    let mut client = RawClient::connect(broker.mqtt);
    client.send(&wire::PINGREQ);
    assert_eq!(client.packets_until_closed(WAIT), vec![]);
}

/// An unknown protocol level gets CONNACK return code 1 and a close
/// [MQTT-3.1.2-2].
#[test]
fn unknown_protocol_level_gets_connack_1() {
    let broker = Broker::two_shards(&[]);
    let mut client = RawClient::connect(broker.mqtt);
    client.send(
        &wire::Connect {
            level: 7,
            ..wire::Connect::v311(&unique("future"))
        }
        .encode(),
    );
    assert_eq!(client.packets_until_closed(WAIT), vec![(0x20, vec![0, 1])]);
}

/// A CONNECT with `flags`, `properties` (MQTT 5 only) and client
/// identifier bytes `client_id`, keep alive 60.
fn raw_connect(level: u8, flags: u8, properties: &[u8], client_id: &[u8]) -> Vec<u8> {
    let mut body = vec![0, 4, b'M', b'Q', b'T', b'T', level, flags, 0, 60];
    if level == 5 {
        body.push(properties.len() as u8);
        body.extend_from_slice(properties);
    }
    body.extend_from_slice(&(client_id.len() as u16).to_be_bytes());
    body.extend_from_slice(client_id);
    let mut packet = vec![0x10, body.len() as u8];
    packet.extend_from_slice(&body);
    packet
}

/// A malformed MQTT 5 CONNECT gets a CONNACK with its reason code before
/// the close (MQTT 5 §4.13.1, [MQTT-3.1.4-1]): 0x81 for a set reserved
/// flag [MQTT-3.1.2-3] and for a client identifier that is not UTF-8
/// [MQTT-1.5.4-1], 0x82 for a property given twice (§3.1.2.11). MQTT
/// 3.1.1 has no such code: the connection is only closed.
#[test]
fn a_malformed_mqtt5_connect_gets_connack_0x81_or_0x82_before_the_close() {
    let broker = Broker::two_shards(&[]);
    // Session Expiry Interval (0x11) twice.
    let twice = [0x11, 0, 0, 0, 10, 0x11, 0, 0, 0, 20];
    let cases: [(&str, Vec<u8>, u8); 3] = [
        ("reserved flag", raw_connect(5, 0x03, &[], b"reserved"), 0x81),
        ("client id not UTF-8", raw_connect(5, 0x02, &[], b"\xff\xfe"), 0x81),
        ("a property twice", raw_connect(5, 0x02, &twice, b"twice"), 0x82),
    ];
    for (what, connect, reason) in cases {
        let mut client = RawClient::connect(broker.mqtt);
        client.send(&connect);
        assert_eq!(
            client.packets_until_closed(WAIT),
            vec![(0x20, vec![0, reason, 0])],
            "{what}"
        );
    }
    let mut v311 = RawClient::connect(broker.mqtt);
    v311.send(&raw_connect(4, 0x03, &[], b"reserved311"));
    assert_eq!(v311.packets_until_closed(WAIT), vec![], "3.1.1: closed without a packet");
    let mut fine = RawClient::connect(broker.mqtt);
    assert_eq!(fine.handshake(&wire::Connect::v5(&unique("after")).encode()).1, 0);
}

/// MQTT 3.1.1: an empty client identifier with clean session 0 gets CONNACK
/// return code 2 and a close [MQTT-3.1.3-8]; with clean session 1 it is
/// accepted [MQTT-3.1.3-6].
#[test]
fn mqtt311_empty_client_id_needs_clean_session() {
    let broker = Broker::two_shards(&[]);
    let mut refused = RawClient::connect(broker.mqtt);
    refused.send(
        &wire::Connect {
            clean: false,
            ..wire::Connect::v311("")
        }
        .encode(),
    );
    assert_eq!(refused.packets_until_closed(WAIT), vec![(0x20, vec![0, 2])]);

    let mut accepted = RawClient::connect(broker.mqtt);
    assert_eq!(
        accepted.handshake(&wire::Connect::v311("").encode()),
        (0, 0)
    );
}

/// MQTT 3.1 (protocol name MQIsdp, level 3) clients publish and subscribe.
#[test]
fn mqtt31_clients_publish_and_subscribe() {
    let broker = Broker::two_shards(&[]);
    let topic = unique("v31");
    let mut sub = MosquittoSub::start(&broker, &["-V", "mqttv31", "-t", &topic, "-q", "1"]);
    mosquitto_pub(
        &broker,
        &["-V", "mqttv31", "-t", &topic, "-q", "1", "-m", "old"],
    );
    assert_eq!(sub.next_message(WAIT), Some(format!("1 0 {topic} old")));

    let mut raw = RawClient::connect(broker.mqtt);
    let id = unique("raw31");
    let connect = wire::Connect {
        level: 3,
        ..wire::Connect::v311(&id)
    };
    assert_eq!(raw.handshake(&connect.encode()), (0, 0));
    raw.send(&wire::publish_qos0(&topic, b"raw", false));
    assert_eq!(sub.next_message(WAIT), Some(format!("0 0 {topic} raw")));
}
