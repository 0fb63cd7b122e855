//! Many retained messages in cluster mode (issue 23; DESIGN.md §4): values
//! retained at QoS 1 on replica A reach a new `#` and `p/#` subscription on
//! replicas B and C, and on a replica D started after they exist (its start
//! loads `mqtt-retained` in bulk, and it is ready only once every shard has
//! the whole load): every value byte for byte, each once, with RETAIN set
//! `[MQTT-3.3.1-9]`, after the SUBACK.
//!
//! The size keeps the test short; more than a shard mailbox holds (16,384
//! events), so D's load also goes through the bridge's held events. The
//! 80,000 of the issue are a benchmark: perf/cluster-retained-80k.sh.

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use crate::cluster::replica;
use crate::harness::Broker;
use crate::nats::NatsCluster;
use crate::raw::{split_packet, wire, RawClient};

/// Retained values in the test.
const COUNT: usize = 20_000;

/// How long a subscription may take to receive them all (debug build,
/// loaded machine).
const RECEIVE_WITHIN: Duration = Duration::from_secs(20);

/// The topic of value `i`: `p/<i/1000>/<i>`, as in the issue.
fn topic(i: usize) -> String {
    format!("p/{}/{i}", i / 1000)
}

/// Value `i`'s 32 bytes: its index, then bytes over the whole range.
fn payload(i: usize) -> Vec<u8> {
    let mut out = (i as u64).to_be_bytes().to_vec();
    out.extend((0..24).map(|k| (i * 7 + k * 37) as u8));
    out
}

fn connect(broker: &Broker, client_id: &str) -> RawClient {
    let mut client = RawClient::connect(broker.mqtt);
    assert_eq!(
        client.handshake(&wire::Connect::v311(client_id).encode()),
        (0, 0),
        "{client_id}: CONNACK"
    );
    client
}

/// Publish the [`COUNT`] values on `broker` at QoS 1, retained, 500
/// unacknowledged at a time; returns once every PUBACK came.
fn retain_all(broker: &Broker) {
    let mut stream = connect(broker, "retainer").into_stream();
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let (mut buf, mut acked) = (Vec::new(), 0);
    for window in (0..COUNT).collect::<Vec<_>>().chunks(500) {
        let mut batch = Vec::new();
        for &i in window {
            let id = ((i % 60_000) as u16 + 1).to_be_bytes();
            let body = [wire::string(topic(i).as_bytes()), id.to_vec(), payload(i)].concat();
            batch.extend(wire::packet(0x33, &body));
        }
        stream.write_all(&batch).unwrap();
        let until = acked + window.len();
        while acked < until {
            while let Some((header, _, used)) = split_packet(&buf) {
                buf.drain(..used);
                assert_eq!(header, 0x40, "PUBACK expected");
                acked += 1;
            }
            if acked < until {
                let mut chunk = [0; 4096];
                let n = stream.read(&mut chunk).expect("PUBACKs within 30 s");
                assert!(n > 0, "the broker closed the retaining connection");
                buf.extend_from_slice(&chunk[..n]);
            }
        }
    }
}

/// A new MQTT 3.1.1 subscription to `filter` at `qos` on `broker` gets
/// every value, byte for byte, each once, RETAIN set, after its SUBACK
/// (QoS 1 ones acknowledged as they come); returns how long the last took.
fn receives_all(broker: &Broker, name: &str, filter: &str, qos: u8) -> Duration {
    let mut stream = connect(broker, &format!("{name}-{qos}")).into_stream();
    stream
        .set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let started = Instant::now();
    stream
        .write_all(&wire::subscribe(1, filter, qos, false))
        .unwrap();
    let (mut seen, mut distinct, mut subacked) = (vec![false; COUNT], 0, false);
    let (mut buf, mut chunk) = (Vec::new(), vec![0; 64 << 10]);
    while distinct < COUNT {
        assert!(
            started.elapsed() < RECEIVE_WITHIN,
            "{name} {filter} QoS {qos}: {distinct} of {COUNT} retained values in {RECEIVE_WITHIN:?}"
        );
        let n = match stream.read(&mut chunk) {
            Ok(0) => panic!("{name}: the broker closed the subscription"),
            Ok(n) => n,
            Err(_) => continue,
        };
        buf.extend_from_slice(&chunk[..n]);
        let (mut at, mut acks) = (0, Vec::new());
        while let Some((header, body, used)) = split_packet(&buf[at..]) {
            at += used;
            if header == 0x90 {
                assert_eq!(body, [0, 1, qos], "{name}: SUBACK granting QoS {qos}");
                subacked = true;
                continue;
            }
            assert_eq!(header & 0xf0, 0x30, "{name}: only PUBLISH after the SUBACK");
            assert!(subacked, "{name}: a retained value came before the SUBACK");
            assert_eq!(
                header & 0x01,
                1,
                "[MQTT-3.3.1-9]: RETAIN set for a new subscription"
            );
            assert_eq!(
                (header >> 1) & 3,
                qos,
                "{name}: min(QoS 1 stored, QoS {qos} granted)"
            );
            let len = usize::from(u16::from_be_bytes([body[0], body[1]]));
            let got_topic = std::str::from_utf8(&body[2..2 + len]).unwrap();
            let mut payload_at = 2 + len;
            if qos > 0 {
                acks.extend(wire::packet(0x40, &body[payload_at..payload_at + 2]));
                payload_at += 2;
            }
            let i: usize = got_topic.rsplit('/').next().unwrap().parse().unwrap();
            assert_eq!(
                got_topic,
                topic(i),
                "{name}: a topic that was never retained"
            );
            assert!(!seen[i], "{name}: {got_topic} twice");
            assert_eq!(
                body[payload_at..],
                payload(i),
                "{name}: {got_topic} byte for byte"
            );
            seen[i] = true;
            distinct += 1;
        }
        buf.drain(..at);
        if !acks.is_empty() {
            stream.write_all(&acks).unwrap();
        }
    }
    started.elapsed()
}

/// Waits (at most `within`) until `broker` retains the last value.
fn wait_for_last(broker: &Broker, within: Duration) {
    let deadline = Instant::now() + within;
    let last = COUNT - 1;
    loop {
        let mut client = connect(broker, "");
        client.send(&wire::subscribe(1, &topic(last), 0, false));
        let mut got = false;
        while let crate::raw::Incoming::Packet { header, body } =
            client.read(Duration::from_millis(300))
        {
            got |= header & 0xf0 == 0x30 && body.ends_with(&payload(last));
        }
        if got {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{:?} did not get {} in {within:?}",
            broker.mqtt,
            topic(last)
        );
    }
}

#[test]
fn every_retained_value_reaches_a_wildcard_subscriber_on_every_replica_and_on_one_started_after() {
    let nats = NatsCluster::start(3);
    let a = replica("ra", &nats.urls(), &[]);
    let b = replica("rb", &nats.urls(), &[]);
    let c = replica("rc", &nats.urls(), &[]);
    let stored = Instant::now();
    retain_all(&a);
    eprintln!(
        "{COUNT} retained values stored on A in {:?}",
        stored.elapsed()
    );
    for (name, broker) in [("B", &b), ("C", &c)] {
        wait_for_last(broker, Duration::from_secs(20));
        for (filter, qos) in [("#", 0), ("p/#", 1)] {
            let took = receives_all(broker, name, filter, qos);
            eprintln!("{name} {filter} QoS {qos}: {COUNT} in {took:?}");
        }
    }
    // D starts with the values in the bucket: ready only once its shards
    // hold them all, so a subscription right away gets every one.
    let started = Instant::now();
    let d = replica("rd", &nats.urls(), &[]);
    eprintln!("D ready in {:?} with {COUNT} retained", started.elapsed());
    for (filter, qos) in [("#", 1), ("p/#", 0)] {
        let took = receives_all(&d, "D", filter, qos);
        eprintln!("D {filter} QoS {qos}: {COUNT} in {took:?}");
    }
}
