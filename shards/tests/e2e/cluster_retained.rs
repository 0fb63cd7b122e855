//! Retained messages in cluster mode against real NATS (DESIGN.md §7): a
//! QoS 1/2 retained value is acknowledged, and delivered to live
//! subscribers, only once `mqtt-retained` has it; when JetStream cannot
//! take it within
//! `cluster.session_log_append_wait` it is refused (MQTT 5: 0x80; 3.1.1:
//! the connection closes after what came before) and retained nowhere
//! afterwards, and delivered to nobody; acknowledgements and deliveries
//! stay in order per connection; values are
//! carried byte-exact up to NATS `max_payload`, and refused beyond (0x97).
//!
//! One NATS server with the fault proxy in front of it: replica A talks to
//! NATS through the proxy (held: what NATS sends waits, so A's writes land
//! but their acknowledgements do not come back), replica B talks to NATS
//! directly.

use std::thread;
use std::time::{Duration, Instant};

use crate::cluster::replica;
use crate::harness::Broker;
use crate::nats::{NatsCluster, NatsProxy};
use crate::raw::{wire as build, Incoming, RawClient};

/// One NATS server, the proxy, replica A behind the proxy (with `a_extra`
/// settings) and replica B straight to NATS.
struct Setup {
    proxy: NatsProxy,
    a: Broker,
    b: Broker,
    _nats: NatsCluster,
}

fn setup(a_extra: &[&str]) -> Setup {
    let nats = NatsCluster::start(1);
    let proxy = NatsProxy::start(nats.client_addr(0));
    // store.kind = none: these tests are about `mqtt-retained` alone (a
    // QoS 1 value that is not retained is acknowledged at once); the
    // ingest stream's own waits and refusals are `cluster_ingest`'s.
    let one = ["--set", "cluster.nats_replicas=1", "--set", "store.kind=none"];
    let a_args: Vec<&str> = one.iter().chain(a_extra).copied().collect();
    let a = replica("ra", &[proxy.url()], &a_args);
    let b = replica("rb", &nats.urls(), &one);
    Setup {
        proxy,
        a,
        b,
        _nats: nats,
    }
}

/// The wait of the tests that run past it (the setting's default is 10 s).
const WAIT_5S: [&str; 2] = ["--set", "cluster.session_log_append_wait=5s"];

/// A PUBLISH at `qos` (1 or 2) with packet identifier `pid`.
pub(crate) fn publish(topic: &str, payload: &[u8], qos: u8, retain: bool, pid: u16, v5: bool) -> Vec<u8> {
    let mut body = build::string(topic.as_bytes());
    body.extend(pid.to_be_bytes());
    if v5 {
        body.push(0);
    }
    body.extend_from_slice(payload);
    build::packet(0x30 | (qos << 1) | u8::from(retain), &body)
}

/// A connected client (MQTT 5 when `v5`).
fn client(broker: &Broker, id: &str, v5: bool) -> RawClient {
    let mut c = RawClient::connect(broker.mqtt);
    let connect = if v5 {
        build::Connect::v5(id)
    } else {
        build::Connect::v311(id)
    };
    assert_eq!(c.handshake(&connect.encode()).1, 0, "CONNACK");
    c
}

/// An MQTT 5 client subscribed to `filter` at `qos` (SUBACK read).
fn subscribed(broker: &Broker, id: &str, filter: &str, qos: u8) -> RawClient {
    let mut c = client(broker, id, true);
    c.send(&build::subscribe(1, filter, qos, true));
    assert!(matches!(c.read(Duration::from_secs(2)), Incoming::Packet { header: 0x90, .. }));
    c
}

/// The next packet: an acknowledgement (PUBACK 0x40, PUBREC 0x50) as
/// (packet type, packet identifier, reason code).
fn next_ack(c: &mut RawClient, within: Duration) -> (u8, u16, u8) {
    match c.read(within) {
        Incoming::Packet { header, body } if matches!(header, 0x40 | 0x50) && body.len() >= 2 => (
            header,
            u16::from_be_bytes([body[0], body[1]]),
            body.get(2).copied().unwrap_or(0),
        ),
        other => panic!("expected PUBACK or PUBREC, got {:02x?}", short(&other)),
    }
}

/// `incoming` with a long body cut, for messages.
fn short(incoming: &Incoming) -> String {
    match incoming {
        Incoming::Packet { header, body } => format!(
            "packet {header:02x} of {} bytes {:02x?}",
            body.len(),
            &body[..body.len().min(16)]
        ),
        other => format!("{other:?}"),
    }
}

/// The retained messages a new MQTT 3.1.1 subscription to `filter` gets
/// from `broker`: (topic, payload).
fn retained_on(broker: &Broker, filter: &str) -> Vec<(String, Vec<u8>)> {
    let mut c = client(broker, "", false);
    c.send(&build::subscribe(1, filter, 0, false));
    let mut seen = Vec::new();
    while let Incoming::Packet { header, body } = c.read(Duration::from_millis(700)) {
        if header & 0xf0 == 0x30 {
            assert_eq!(
                header & 0x01,
                1,
                "[MQTT-3.3.1-9]: RETAIN set for a new subscription"
            );
            let len = usize::from(u16::from_be_bytes([body[0], body[1]]));
            let topic = String::from_utf8_lossy(&body[2..2 + len]).into_owned();
            seen.push((topic, body[2 + len..].to_vec()));
        }
    }
    seen
}

/// Waits (at most `within`) until `broker` retains exactly `payload` on
/// `topic` (nothing when `None`).
fn wait_retained(broker: &Broker, topic: &str, payload: Option<&[u8]>, within: Duration) {
    let deadline = Instant::now() + within;
    loop {
        let seen = retained_on(broker, topic);
        let now: Option<&[u8]> = seen.first().map(|(_, p)| p.as_slice());
        if seen.len() <= 1 && now == payload {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{topic}: retained {:?}, expected {:?}",
            now.map(String::from_utf8_lossy),
            payload.map(String::from_utf8_lossy)
        );
    }
}

/// Waits (at most `within`) until the sum of metric `name` on `broker`
/// reaches `at_least`.
fn wait_metric(broker: &Broker, name: &str, at_least: f64, within: Duration) {
    let deadline = Instant::now() + within;
    while broker.metric_sum(name) < at_least {
        assert!(
            Instant::now() < deadline,
            "{name} = {} after {within:?}",
            broker.metric_sum(name)
        );
        thread::sleep(Duration::from_millis(100));
    }
}

/// A PUBACK with a reason code of 0x80 or above says the broker did not
/// accept the PUBLISH (MQTT 5 §3.4.2.1): a value that may still be
/// refused is delivered to nobody until `mqtt-retained` has it.
#[test]
fn a_retained_publish_is_acknowledged_and_delivered_live_only_once_nats_has_it() {
    let s = setup(&[]);
    let mut watcher = client(&s.a, "watcher", true);
    watcher.send(&build::subscribe(1, "plant/#", 0, true));
    assert!(matches!(
        watcher.read(Duration::from_secs(2)),
        Incoming::Packet { header: 0x90, .. }
    ));
    let mut publisher = client(&s.a, "publisher", true);

    s.proxy.set_hold(true);
    publisher.send(&publish("plant/boiler", b"82C", 1, true, 1, true));
    // Not delivered while it may still be refused.
    let early = watcher.read(Duration::from_secs(1));
    assert_eq!(early, Incoming::TimedOut, "delivered while NATS held its answer: {}", short(&early));
    // DESIGN.md §7: no PUBACK before mqtt-retained has the value.
    let early = publisher.read(Duration::from_secs(1));
    assert_eq!(
        early,
        Incoming::TimedOut,
        "acknowledged while NATS held its answer: {}",
        short(&early)
    );
    s.proxy.set_hold(false);
    match watcher.read(Duration::from_secs(5)) {
        Incoming::Packet { header, body } if header & 0xf0 == 0x30 => {
            assert!(body.ends_with(b"82C"))
        }
        other => panic!("no live delivery once NATS has it: {}", short(&other)),
    }
    assert_eq!(
        next_ack(&mut publisher, Duration::from_secs(5)),
        (0x40, 1, 0)
    );
    // The value is in the bucket: another replica has it.
    wait_retained(&s.b, "plant/boiler", Some(b"82C"), Duration::from_secs(5));
    wait_retained(&s.a, "plant/boiler", Some(b"82C"), Duration::from_secs(5));
}

/// Sets `topic` to `payload` from `publisher` on A (packet identifier 1)
/// and waits until B has it.
fn set_retained(s: &Setup, publisher: &mut RawClient, topic: &str, payload: &[u8]) {
    publisher.send(&publish(topic, payload, 1, true, 1, true));
    assert_eq!(next_ack(publisher, Duration::from_secs(5)), (0x40, 1, 0));
    wait_retained(&s.b, topic, Some(payload), Duration::from_secs(5));
}

/// Holds NATS' answers while `publisher` sends `payload` for `topic`
/// (packet identifier `pid`): refused with 0x80 once the wait (5 s) is
/// over. Then releases them and waits until A undid the write, which
/// landed (only NATS' answer was held).
fn refused_while_held(s: &Setup, publisher: &mut RawClient, topic: &str, payload: &[u8], pid: u16) {
    refused_while_held_at(s, publisher, (topic, payload), 1, pid);
}

/// [`refused_while_held`] at `qos` (1: PUBACK, 2: PUBREC 0x80).
fn refused_while_held_at(s: &Setup, publisher: &mut RawClient, (topic, payload): (&str, &[u8]), qos: u8, pid: u16) {
    let undone = s.a.metric_sum("fleetmq_cluster_retained_undone_total");
    s.proxy.set_hold(true);
    let sent = Instant::now();
    publisher.send(&publish(topic, payload, qos, true, pid, true));
    let ack = if qos == 2 { 0x50 } else { 0x40 };
    assert_eq!(
        next_ack(publisher, Duration::from_secs(8)),
        (ack, pid, 0x80)
    );
    let took = sent.elapsed();
    assert!(
        took >= Duration::from_millis(4500),
        "refused after {took:?}"
    );
    thread::sleep(Duration::from_secs(1));
    s.proxy.set_hold(false);
    wait_metric(
        &s.a,
        "fleetmq_cluster_retained_undone_total",
        undone + 1.0,
        Duration::from_secs(15),
    );
    assert!(s.a.metric_sum("fleetmq_cluster_retained_refused_total") >= 1.0);
}

#[test]
fn an_acknowledgement_lost_past_the_nats_timeout_is_found_in_the_bucket_within_the_wait() {
    // The default wait (10 s) is longer than a JetStream acknowledgement
    // may take (5 s): past that, the replica looks for its write in the
    // bucket, finds it once NATS answers, and acknowledges.
    let s = setup(&[]);
    let mut publisher = client(&s.a, "patient", true);
    s.proxy.set_hold(true);
    publisher.send(&publish("plant/pump", b"on", 1, true, 1, true));
    let early = publisher.read(Duration::from_secs(7));
    assert_eq!(early, Incoming::TimedOut, "{}", short(&early));
    s.proxy.set_hold(false);
    assert_eq!(
        next_ack(&mut publisher, Duration::from_secs(5)),
        (0x40, 1, 0)
    );
    wait_retained(&s.b, "plant/pump", Some(b"on"), Duration::from_secs(5));
    assert_eq!(
        s.a.metric_sum("fleetmq_cluster_retained_refused_total"),
        0.0
    );
}

#[test]
fn with_the_local_store_too_the_acknowledgement_waits_for_nats() {
    let dir = crate::security::TempDir::new("cluster-local");
    let data = format!("store.dir={}", dir.path("data").display());
    let s = setup(&["--set", "store.kind=local", "--set", &data]);
    let mut publisher = client(&s.a, "both", true);
    s.proxy.set_hold(true);
    publisher.send(&publish("plant/fan", b"slow", 1, true, 1, true));
    publisher.send(&publish("plant/log", b"x", 1, false, 2, true));
    // The local store syncs in milliseconds; NATS holds: nothing yet.
    let early = publisher.read(Duration::from_millis(1500));
    assert_eq!(early, Incoming::TimedOut, "{}", short(&early));
    s.proxy.set_hold(false);
    assert_eq!(
        next_ack(&mut publisher, Duration::from_secs(5)),
        (0x40, 1, 0)
    );
    assert_eq!(
        next_ack(&mut publisher, Duration::from_secs(5)),
        (0x40, 2, 0)
    );
    wait_retained(&s.b, "plant/fan", Some(b"slow"), Duration::from_secs(5));
}

#[test]
fn a_retained_publish_nats_does_not_take_in_time_is_refused_with_0x80_and_retained_nowhere() {
    let s = setup(&WAIT_5S);
    let mut publisher = client(&s.a, "publisher", true);
    set_retained(&s, &mut publisher, "plant/valve", b"open");
    refused_while_held(&s, &mut publisher, "plant/valve", b"shut", 2);
    // No replica keeps the refused value.
    for broker in [&s.a, &s.b] {
        wait_retained(broker, "plant/valve", Some(b"open"), Duration::from_secs(5));
    }
    thread::sleep(Duration::from_secs(1));
    for broker in [&s.a, &s.b] {
        wait_retained(broker, "plant/valve", Some(b"open"), Duration::ZERO);
    }
    // The client may send again: accepted once NATS answers.
    publisher.send(&publish("plant/valve", b"shut", 1, true, 3, true));
    assert_eq!(
        next_ack(&mut publisher, Duration::from_secs(5)),
        (0x40, 3, 0)
    );
    wait_retained(&s.b, "plant/valve", Some(b"shut"), Duration::from_secs(5));
}

/// MQTT 5 §4.3.3: once the publisher has the PUBREC 0x80 (NATS did not
/// take the retained QoS 2 value within the wait), its packet identifier
/// is free: a PUBLISH reusing it is a new message, acknowledged PUBREC
/// 0x00 only once `mqtt-retained` has it, and forwarded exactly once (it
/// was answered 0x00 and dropped before).
#[test]
fn a_qos2_identifier_refused_with_0x80_is_free_and_its_reuse_is_retained_and_forwarded_once() {
    let s = setup(&WAIT_5S);
    let mut watcher = client(&s.a, "q2watcher", true);
    watcher.send(&build::subscribe(1, "line/#", 2, true));
    assert!(matches!(watcher.read(Duration::from_secs(2)), Incoming::Packet { header: 0x90, .. }));
    let mut publisher = client(&s.a, "q2publisher", true);
    set_retained(&s, &mut publisher, "line/speed", b"10");
    // The subscriber got the value set before (published at QoS 1).
    match watcher.read(Duration::from_secs(2)) {
        Incoming::Packet { header, body } if header & 0xf6 == 0x32 => watcher.send(&build::packet(0x40, &body[12..14])),
        other => panic!("expected the QoS 1 PUBLISH of 10: {}", short(&other)),
    }
    refused_while_held_at(&s, &mut publisher, ("line/speed", b"20"), 2, 7);
    wait_retained(&s.b, "line/speed", Some(b"10"), Duration::from_secs(5));
    // PUBREC 0x80: not accepted, so never forwarded.
    let refused = watcher.read(Duration::from_millis(500));
    assert_eq!(refused, Incoming::TimedOut, "the refused value was forwarded: {}", short(&refused));

    s.proxy.set_hold(true);
    publisher.send(&publish("line/speed", b"30", 2, true, 7, true));
    let early = publisher.read(Duration::from_secs(1));
    assert_eq!(early, Incoming::TimedOut, "PUBREC before NATS has it: {}", short(&early));
    s.proxy.set_hold(false);
    assert_eq!(next_ack(&mut publisher, Duration::from_secs(5)), (0x50, 7, 0));
    publisher.send(&build::pubrel(7));
    assert!(matches!(publisher.read(Duration::from_secs(5)), Incoming::Packet { header: 0x70, .. }));
    wait_retained(&s.b, "line/speed", Some(b"30"), Duration::from_secs(5));
    let mut forwarded = 0;
    while let Incoming::Packet { header, body } = watcher.read(Duration::from_secs(1)) {
        if header & 0xf0 == 0x30 && body.ends_with(b"30") {
            forwarded += 1;
            // Complete the QoS 2 delivery: PUBREC, then PUBCOMP on PUBREL.
            let pid = u16::from_be_bytes([body[2 + 10], body[2 + 11]]);
            watcher.send(&build::packet(0x50, &pid.to_be_bytes()));
        } else if header == 0x62 {
            watcher.send(&build::packet(0x70, &body[..2]));
        }
    }
    assert_eq!(forwarded, 1, "the reuse forwarded exactly once");
}

#[test]
fn a_3_1_1_client_whose_retained_publish_is_refused_is_closed_after_what_came_before() {
    let s = setup(&WAIT_5S);
    let mut watcher = client(&s.a, "line-watcher", false);
    watcher.send(&build::subscribe(1, "line/#", 0, false));
    assert!(matches!(watcher.read(Duration::from_secs(2)), Incoming::Packet { header: 0x90, .. }));
    let mut device = client(&s.a, "old-device", false);
    s.proxy.set_hold(true);
    let sent = Instant::now();
    device.send(&publish("line/count", b"1", 1, false, 1, false));
    device.send(&publish("line/state", b"on", 1, true, 2, false));
    device.send(&publish("line/count", b"2", 1, false, 3, false));
    // 3.1.1 has no reason code: the connection is closed after the PUBACK
    // of what came before, and nothing after is acknowledged (the device
    // sends 2 and 3 again).
    let seen = device.packets_until_closed(Duration::from_secs(10));
    let took = sent.elapsed();
    s.proxy.set_hold(false);
    assert_eq!(seen, vec![(0x40, vec![0, 1])], "packets before the close");
    assert!(took >= Duration::from_millis(4500), "closed after {took:?}");
    // Nor was anything after the first delivered: the resends are the
    // only copies.
    let mut delivered = Vec::new();
    while let Incoming::Packet { header, body } = watcher.read(Duration::from_millis(500)) {
        if header & 0xf0 == 0x30 {
            delivered.push(String::from_utf8_lossy(&body[2 + 10..]).into_owned());
        }
    }
    assert_eq!(delivered, ["1"], "delivered to the watcher");
}

/// MQTT 3.1.1: a retained QoS 2 publish NATS does not take within the
/// wait closes the connection (no PUBREC); its write is undone. The device
/// reconnects with Clean Session 0 and sends it again (DUP, the same
/// packet identifier): it is a new attempt, stored, and PUBREC comes only
/// once `mqtt-retained` has it — never acknowledged and then lost
/// (DESIGN.md §7; the session kept no identifier for it).
#[test]
fn a_3_1_1_retained_qos2_publish_refused_and_resent_after_reconnect_is_retained() {
    let s = setup(&WAIT_5S);
    let undone = s.a.metric_sum("fleetmq_cluster_retained_undone_total");
    let connect = build::Connect { clean: false, ..build::Connect::v311("old-qos2") };
    let mut device = RawClient::connect(s.a.mqtt);
    assert_eq!(device.handshake(&connect.encode()).1, 0);
    s.proxy.set_hold(true);
    device.send(&publish("line/mode", b"auto", 2, true, 4, false));
    assert_eq!(device.packets_until_closed(Duration::from_secs(10)), vec![], "closed, nothing acknowledged");
    thread::sleep(Duration::from_secs(1));
    s.proxy.set_hold(false);
    wait_metric(&s.a, "fleetmq_cluster_retained_undone_total", undone + 1.0, Duration::from_secs(15));
    wait_retained(&s.b, "line/mode", None, Duration::from_secs(5));

    let mut device = RawClient::connect(s.a.mqtt);
    assert_eq!(device.handshake(&connect.encode()), (1, 0), "session present");
    let mut resend = publish("line/mode", b"auto", 2, true, 4, false);
    resend[0] |= 0x08;
    device.send(&resend);
    assert_eq!(next_ack(&mut device, Duration::from_secs(5)), (0x50, 4, 0));
    // PUBREC came once the bucket had it: every replica retains it.
    for broker in [&s.b, &s.a] {
        wait_retained(broker, "line/mode", Some(b"auto"), Duration::from_secs(5));
    }
}

#[test]
fn acknowledgements_stay_in_order_when_retained_and_other_publishes_mix() {
    let s = setup(&[]);
    let mut publisher = client(&s.a, "mixer", true);
    let mut other = client(&s.a, "bystander", true);
    s.proxy.set_hold(true);
    publisher.send(&publish("order/r1", b"a", 1, true, 1, true));
    publisher.send(&publish("order/n", b"b", 1, false, 2, true));
    publisher.send(&publish("order/r2", b"c", 2, true, 3, true));
    publisher.send(&publish("order/n", b"d", 1, false, 4, true));
    // The non-retained ones wait behind the retained ones before them.
    let early = publisher.read(Duration::from_millis(1500));
    assert_eq!(early, Incoming::TimedOut, "{}", short(&early));
    // Another connection is not held up by them.
    other.send(&publish("order/n", b"e", 1, false, 9, true));
    assert_eq!(next_ack(&mut other, Duration::from_secs(2)), (0x40, 9, 0));
    s.proxy.set_hold(false);
    // [MQTT-4.6.0-2] PUBACKs and [MQTT-4.6.0-3] PUBRECs in the order of
    // the PUBLISHes.
    let acks: Vec<_> = (0..4)
        .map(|_| next_ack(&mut publisher, Duration::from_secs(5)))
        .collect();
    assert_eq!(
        acks,
        vec![(0x40, 1, 0), (0x40, 2, 0), (0x50, 3, 0), (0x40, 4, 0)]
    );
}

/// A publisher's values reach subscribers in the order it sent them
/// `[MQTT-4.6.0-5]` even when retained values the cluster has not stored
/// yet are among them: what came after a held value is held behind it,
/// not sent ahead of it — while the connection goes on reading (its
/// PINGREQ is answered, the other values' writes go out meanwhile).
#[test]
fn values_behind_a_retained_value_nats_has_not_stored_wait_in_order_while_the_connection_reads_on() {
    let s = setup(&[]);
    let mut watcher = subscribed(&s.a, "order-watcher", "seq/#", 1);
    let mut publisher = client(&s.a, "sequencer", true);
    s.proxy.set_hold(true);
    publisher.send(&publish("seq/r", b"r1", 1, true, 1, true));
    publisher.send(&build::packet(0x30, &[build::string(b"seq/n"), b"\0a".to_vec()].concat()));
    publisher.send(&publish("seq/n", b"b", 1, false, 2, true));
    publisher.send(&publish("seq/r", b"r2", 1, true, 3, true));
    publisher.send(&build::packet(0x30, &[build::string(b"seq/n"), b"\0c".to_vec()].concat()));
    // The connection reads on: PINGREQ answered while NATS holds the
    // writes (the acknowledgements wait, in order).
    publisher.send(&[0xc0, 0]);
    assert!(
        matches!(publisher.read(Duration::from_secs(2)), Incoming::Packet { header: 0xd0, .. }),
        "no PINGRESP while retained writes were held"
    );
    let early = watcher.read(Duration::from_secs(1));
    assert_eq!(early, Incoming::TimedOut, "delivered ahead of the held value: {}", short(&early));
    s.proxy.set_hold(false);
    let acks: Vec<_> = (0..3).map(|_| next_ack(&mut publisher, Duration::from_secs(5))).collect();
    assert_eq!(acks, vec![(0x40, 1, 0), (0x40, 2, 0), (0x40, 3, 0)]);
    assert_eq!(deliveries(&mut watcher, Duration::from_secs(2)), ["r1", "a", "b", "r2", "c"]);
    wait_retained(&s.b, "seq/r", Some(b"r2"), Duration::from_secs(5));
}

/// Past the values a shard holds for one publisher (256) its
/// connection stops reading until the cluster answers, then goes on:
/// every value arrives, in order, none lost to the pause.
#[test]
fn a_publisher_with_a_full_held_queue_pauses_and_resumes_losing_nothing() {
    let s = setup(&[]);
    let mut watcher = subscribed(&s.a, "flood-watcher", "flood/#", 0);
    let mut publisher = client(&s.a, "flooder", true);
    // Past the 256 held, and with them under the 1,000 writes a QoS 0
    // subscriber may have pending (beyond, the watcher's own drops).
    const N: usize = 600;
    s.proxy.set_hold(true);
    publisher.send(&publish("flood/r", b"first", 1, true, 1, true));
    let mut burst = Vec::new();
    for i in 0..N {
        burst.extend(build::packet(0x30, &[build::string(b"flood/n"), vec![0], i.to_string().into_bytes()].concat()));
    }
    publisher.send(&burst);
    let early = watcher.read(Duration::from_secs(1));
    assert_eq!(early, Incoming::TimedOut, "delivered ahead of the held value: {}", short(&early));
    s.proxy.set_hold(false);
    assert_eq!(next_ack(&mut publisher, Duration::from_secs(5)), (0x40, 1, 0));
    let got = deliveries(&mut watcher, Duration::from_secs(2));
    let expected: Vec<String> = std::iter::once("first".to_owned()).chain((0..N).map(|i| i.to_string())).collect();
    assert_eq!(got, expected, "every value, in the order sent [MQTT-4.6.0-5]");
    assert_eq!(s.a.metric_sum("fleetmq_messages_dropped_total"), 0.0);
}

#[test]
fn a_retained_deletion_is_acknowledged_once_durable_and_a_refused_one_leaves_the_value() {
    let s = setup(&WAIT_5S);
    let mut publisher = client(&s.a, "publisher", true);
    set_retained(&s, &mut publisher, "plant/door", b"closed");
    // [MQTT-3.3.1-6] an empty retained payload clears the topic; refused,
    // it clears nothing anywhere.
    refused_while_held(&s, &mut publisher, "plant/door", b"", 2);
    for broker in [&s.a, &s.b] {
        wait_retained(
            broker,
            "plant/door",
            Some(b"closed"),
            Duration::from_secs(5),
        );
    }

    // Acknowledged only once NATS has the deletion, then cleared everywhere.
    s.proxy.set_hold(true);
    publisher.send(&publish("plant/door", b"", 1, true, 3, true));
    let early = publisher.read(Duration::from_millis(1500));
    assert_eq!(early, Incoming::TimedOut, "{}", short(&early));
    s.proxy.set_hold(false);
    assert_eq!(
        next_ack(&mut publisher, Duration::from_secs(5)),
        (0x40, 3, 0)
    );
    for broker in [&s.a, &s.b] {
        wait_retained(broker, "plant/door", None, Duration::from_secs(5));
    }
}

/// `len` bytes that differ from one position to the next.
fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 31 + i / 251) as u8).collect()
}

#[test]
fn a_900_kb_retained_value_crosses_replicas_byte_exact_and_one_past_max_payload_is_refused() {
    let nats = NatsCluster::start(3);
    // Room for MQTT packets larger than NATS' max_payload (1 MiB).
    let big = ["--set", "limits.max_packet_size=4MiB"];
    let a = replica("ra", &nats.urls(), &big);
    let b = replica("rb", &nats.urls(), &big);
    let value = pattern(900_000);
    let mut publisher = client(&a, "camera", true);
    publisher.send(&publish("site/snapshot", &value, 1, true, 1, true));
    assert_eq!(
        next_ack(&mut publisher, Duration::from_secs(10)),
        (0x40, 1, 0)
    );
    // Byte-exact on the other replica, and on this one from the bucket.
    for broker in [&b, &a] {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let seen = retained_on(broker, "site/snapshot");
            if seen.len() == 1 && seen[0].1.len() == value.len() {
                assert!(seen[0].1 == value, "the 900 kB value changed on its way");
                break;
            }
            assert!(
                Instant::now() < deadline,
                "not retained: {} values",
                seen.len()
            );
        }
    }

    // Larger than NATS max_payload: refused with 0x97 Quota exceeded,
    // logged with its size and the limit; the value before stays.
    let huge = pattern(1_100_000);
    publisher.send(&publish("site/snapshot", &huge, 1, true, 2, true));
    assert_eq!(
        next_ack(&mut publisher, Duration::from_secs(10)),
        (0x40, 2, 0x97)
    );
    let logged = Instant::now() + Duration::from_secs(5);
    while !a.stderr().contains("a record of 1100") {
        assert!(
            Instant::now() < logged,
            "no log line naming the size: {}",
            a.stderr()
        );
        thread::sleep(Duration::from_millis(100));
    }
    assert!(
        a.stderr().contains("the NATS max_payload less 512 for the write's headers"),
        "{}",
        a.stderr()
    );
    assert!(a.metric_sum("fleetmq_cluster_retained_refused_total") >= 1.0);
    // MQTT 3.1.1: closed after what came before.
    let mut device = client(&a, "old-camera", false);
    device.send(&publish("site/other", b"small", 1, true, 1, false));
    device.send(&publish("site/other", &huge, 1, true, 2, false));
    let seen = device.packets_until_closed(Duration::from_secs(10));
    assert_eq!(seen, vec![(0x40, vec![0, 1])], "packets before the close");
    let seen = retained_on(&b, "site/snapshot");
    assert!(
        seen.len() == 1 && seen[0].1 == value,
        "the value before the refused one stays"
    );
}

#[test]
fn records_of_format_1_are_read_and_a_cluster_at_floor_1_gets_format_1_written() {
    let nats = NatsCluster::start(1);
    // store.kind = none: these tests are about `mqtt-retained` alone (a
    // QoS 1 value that is not retained is acknowledged at once); the
    // ingest stream's own waits and refusals are `cluster_ingest`'s.
    let one = ["--set", "cluster.nats_replicas=1", "--set", "store.kind=none"];
    let a = replica("ra", &nats.urls(), &one);
    // A member of an older build, reading only format 1, is live: the
    // floor stays where it is put below (see cluster_floor.rs).
    let _old = crate::cluster_floor::OldMember::start(&nats);
    // As an older build wrote it: JSON, the payload in base64 ("hello").
    let kv = |bucket: &'static str| {
        let url = nats.url(0);
        async move {
            let client = async_nats::connect(url).await.unwrap();
            async_nats::jetstream::new(client)
                .get_key_value(bucket)
                .await
                .unwrap()
        }
    };
    let key = fleetmq_core::cluster::retained::retained_key("legacy/old");
    crate::nats::block_on(async {
        let old = r#"{"format":1,"topic":"legacy/old","payload":"aGVsbG8=","qos":1}"#;
        kv("mqtt-retained")
            .await
            .put(&key, old.into())
            .await
            .unwrap();
        // A cluster that still has a member reading only format 1.
        kv("mqtt-cluster-floor")
            .await
            .put("floor", r#"{"format":1,"floor":1}"#.into())
            .await
            .unwrap();
    });
    wait_retained(&a, "legacy/old", Some(b"hello"), Duration::from_secs(5));
    // A replica joining at floor 1 writes what every member reads.
    let b = replica("rb", &nats.urls(), &one);
    let mut publisher = client(&b, "writer", true);
    publisher.send(&publish("legacy/new", b"\x00\xffraw", 1, true, 1, true));
    assert_eq!(
        next_ack(&mut publisher, Duration::from_secs(5)),
        (0x40, 1, 0)
    );
    let written = crate::nats::block_on(async {
        let key = fleetmq_core::cluster::retained::retained_key("legacy/new");
        kv("mqtt-retained")
            .await
            .get(&key)
            .await
            .unwrap()
            .expect("stored")
    });
    assert_eq!(written.first(), Some(&b'{'), "format 1 is JSON");
    wait_retained(
        &a,
        "legacy/new",
        Some(b"\x00\xffraw"),
        Duration::from_secs(5),
    );
    // Format 1 cannot carry 900 kB within max_payload: refused, 0x97.
    publisher.send(&publish("legacy/big", &pattern(900_000), 1, true, 2, true));
    assert_eq!(
        next_ack(&mut publisher, Duration::from_secs(10)),
        (0x40, 2, 0x97)
    );
}

/// `KV_mqtt-retained` refuses every write (`refuse`: its
/// `max_msg_size` 1 byte), or takes them again (-1: no limit).
fn refuse_retained_writes(nats: &NatsCluster, refuse: bool) {
    crate::nats::block_on(async {
        let client = async_nats::connect(nats.url(0)).await.unwrap();
        let js = async_nats::jetstream::new(client);
        let mut stream = js.get_stream("KV_mqtt-retained").await.unwrap();
        let mut config = stream.info().await.unwrap().config.clone();
        config.max_message_size = if refuse { 1 } else { -1 };
        js.update_stream(config).await.unwrap();
    });
}

/// The payloads of the PUBLISHes `watcher` (MQTT 5, QoS 1 subscription
/// to `tank/#`) gets within `within`, acknowledged.
fn deliveries(watcher: &mut RawClient, within: Duration) -> Vec<String> {
    let mut payloads = Vec::new();
    while let Incoming::Packet { header, body } = watcher.read(within) {
        if header & 0xf0 != 0x30 {
            continue;
        }
        let topic_len = usize::from(u16::from_be_bytes([body[0], body[1]]));
        let mut at = 2 + topic_len;
        if header & 0x06 != 0 {
            watcher.send(&build::packet(0x40, &body[at..at + 2]));
            at += 2;
        }
        // MQTT 5 properties: none besides a short length here.
        let props = usize::from(body[at]);
        payloads.push(String::from_utf8_lossy(&body[at + 1 + props..]).into_owned());
    }
    payloads
}

/// JetStream refuses a retained value (larger than the bucket's
/// `max_msg_size`): PUBACK 0x80 — the broker did not accept the PUBLISH
/// (MQTT 5 §3.4.2.1) — and no subscriber on any replica got it; the
/// publisher's next PUBLISH, behind it, is delivered after the refusal
/// `[MQTT-4.6.0-5]`; once JetStream takes writes again, the resend is
/// the one copy every subscriber gets (before: the refused value reached
/// the live subscribers at once, and the resend a second time).
#[test]
fn a_retained_value_jetstream_refuses_is_delivered_to_nobody_and_its_resend_once() {
    let nats = NatsCluster::start(1);
    let args = ["--set", "cluster.nats_replicas=1", "--set", "cluster.session_log_append_wait=2s"];
    let a = replica("ra", &nats.urls(), &args);
    let b = replica("rb", &nats.urls(), &args);
    let mut watchers: Vec<RawClient> = [(&a, "watch-a"), (&b, "watch-b")]
        .into_iter()
        .map(|(broker, id)| {
            let mut watcher = client(broker, id, true);
            watcher.send(&build::subscribe(1, "tank/#", 1, true));
            assert!(matches!(watcher.read(Duration::from_secs(2)), Incoming::Packet { header: 0x90, .. }));
            watcher
        })
        .collect();
    let mut publisher = client(&a, "tank-sensor", true);
    publisher.send(&publish("tank/level", b"10", 1, true, 1, true));
    assert_eq!(next_ack(&mut publisher, Duration::from_secs(5)), (0x40, 1, 0));
    // On A at once; on B through the bucket's watch (retained, no mesh).
    assert_eq!(deliveries(&mut watchers[0], Duration::from_millis(500)), ["10"]);
    wait_retained(&b, "tank/level", Some(b"10"), Duration::from_secs(5));

    refuse_retained_writes(&nats, true);
    publisher.send(&publish("tank/level", b"20", 1, true, 2, true));
    publisher.send(&publish("tank/level", b"after", 1, false, 3, true));
    assert_eq!(next_ack(&mut publisher, Duration::from_secs(5)), (0x40, 2, 0x80));
    assert_eq!(next_ack(&mut publisher, Duration::from_secs(5)), (0x40, 3, 0));
    assert_eq!(deliveries(&mut watchers[0], Duration::from_millis(500)), ["after"], "the refused value went out");
    assert!(a.metric_sum("fleetmq_cluster_retained_refused_total") >= 1.0);

    refuse_retained_writes(&nats, false);
    publisher.send(&publish("tank/level", b"20", 1, true, 4, true));
    assert_eq!(next_ack(&mut publisher, Duration::from_secs(5)), (0x40, 4, 0));
    assert_eq!(deliveries(&mut watchers[0], Duration::from_secs(1)), ["20"], "the resend, once");
    assert!(deliveries(&mut watchers[1], Duration::from_millis(300)).is_empty(), "B's live subscribers: no mesh yet");
    for broker in [&a, &b] {
        wait_retained(broker, "tank/level", Some(b"20"), Duration::from_secs(5));
    }
}
