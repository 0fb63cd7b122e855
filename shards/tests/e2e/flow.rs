//! Flow control towards subscribers: messages beyond the in-flight window
//! wait in the session and go out as acknowledgements free room.

use std::time::Duration;

use crate::harness::Broker;
use crate::raw::{wire, Incoming, RawClient};

fn publish_qos1(topic: &str, packet_id: u16, payload: &[u8]) -> Vec<u8> {
    let mut body = wire::string(topic.as_bytes());
    body.extend_from_slice(&packet_id.to_be_bytes());
    body.extend_from_slice(payload);
    wire::packet(0x32, &body)
}

#[test]
fn queued_qos1_messages_go_out_as_the_subscriber_acknowledges() {
    // [MQTT-4.9.0-2]-style window (here the broker's own in-flight cap of
    // 2): the rest waits and is sent as each PUBACK frees a place.
    let broker = Broker::two_shards(&["--set", "limits.max_client_writes_pending=2"]);
    let mut sub = RawClient::connect(broker.mqtt);
    assert_eq!(sub.handshake(&wire::Connect::v311("flow-sub").encode()).1, 0);
    sub.send(&wire::subscribe(1, "flow/t", 1, false));
    assert!(matches!(sub.read(Duration::from_secs(5)), Incoming::Packet { header: 0x90, .. }));

    let mut publisher = RawClient::connect(broker.mqtt);
    assert_eq!(publisher.handshake(&wire::Connect::v311("flow-pub").encode()).1, 0);
    for id in 1..=10u16 {
        publisher.send(&publish_qos1("flow/t", id, &id.to_be_bytes()));
    }
    let mut received = Vec::new();
    while received.len() < 10 {
        match sub.read(Duration::from_secs(5)) {
            Incoming::Packet { header, body } if header & 0xF0 == 0x30 => {
                // topic (2 + 6 bytes), packet id, payload
                let packet_id = [body[8], body[9]];
                received.push(u16::from_be_bytes([body[10], body[11]]));
                sub.send(&wire::packet(0x40, &packet_id));
            }
            other => panic!("after {} messages: {other:02x?}; broker stderr:\n{}", received.len(), broker.stderr()),
        }
    }
    assert_eq!(received, (1..=10).collect::<Vec<_>>(), "all, in order");
}
