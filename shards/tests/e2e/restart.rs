//! What the local store brings back after SIGKILL beyond sessions and
//! retained messages (DESIGN.md §7): deliveries in flight keep their packet
//! identifiers and resume where they stopped, inbound QoS 2 identifiers stay
//! open, wills of connections open at the crash are sent after their delay,
//! a CONNACK promises only what is durable, and QoS 2 publishers reach an
//! online persistent QoS 2 subscriber exactly once across kills.

use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rumqttc::v5::mqttbytes::v5::{LastWill, LastWillProperties};

use crate::clients::{unique, v5, WAIT};
use crate::harness::Broker;
use crate::raw::{wire, Incoming, RawClient};
use crate::store::TempDir;

/// `--shards 2` and the local store in `dir`; a subscriber's queue holds
/// what a whole test publishes (nothing dropped for room).
fn local(dir: &Path) -> Broker {
    let dir = format!("store.dir={}", dir.display());
    let queue = "limits.max_subscriber_queue=1000000";
    Broker::start(&[
        "--shards",
        "2",
        "--set",
        "store.kind=local",
        "--set",
        &dir,
        "--set",
        queue,
    ])
}

/// SIGKILL, and wait for the process to end.
fn kill(broker: Broker) {
    broker.signal(libc::SIGKILL);
    drop(broker);
}

/// PUBLISH (MQTT 5, no properties).
fn publish(topic: &str, qos: u8, packet_id: u16, dup: bool, payload: &[u8]) -> Vec<u8> {
    let mut body = wire::string(topic.as_bytes());
    if qos > 0 {
        body.extend_from_slice(&packet_id.to_be_bytes());
    }
    body.push(0);
    body.extend_from_slice(payload);
    wire::packet(0x30 | qos << 1 | u8::from(dup) << 3, &body)
}

/// PUBACK (0x40), PUBREC (0x50), PUBREL (0x62) or PUBCOMP (0x70) for
/// `packet_id`, reason Success.
fn response(header: u8, packet_id: u16) -> Vec<u8> {
    wire::packet(header, &packet_id.to_be_bytes())
}

/// A PUBLISH as received: QoS, DUP, packet identifier, topic, payload.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Got {
    qos: u8,
    dup: bool,
    packet_id: u16,
    topic: String,
    payload: Vec<u8>,
}

/// What arrives: a PUBLISH, or another packet (header, packet identifier).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Packet {
    Publish(Got),
    Other(u8, u16),
}

/// The next packet within `wait` (MQTT 5 framing), `None` when none came.
fn next(client: &mut RawClient, wait: Duration) -> Option<Packet> {
    match client.read(wait) {
        Incoming::Packet { header, body } => Some(parse(header, &body)),
        Incoming::Closed => panic!("the broker closed the connection"),
        Incoming::TimedOut => None,
    }
}

/// A packet from its fixed header byte and body (MQTT 5).
fn parse(header: u8, body: &[u8]) -> Packet {
    if header >> 4 != 3 {
        let packet_id = if body.len() >= 2 {
            u16::from_be_bytes([body[0], body[1]])
        } else {
            0
        };
        return Packet::Other(header, packet_id);
    }
    let qos = (header >> 1) & 3;
    let topic_len = usize::from(u16::from_be_bytes([body[0], body[1]]));
    let topic = String::from_utf8(body[2..2 + topic_len].to_vec()).unwrap();
    let mut at = 2 + topic_len;
    let mut packet_id = 0;
    if qos > 0 {
        packet_id = u16::from_be_bytes([body[at], body[at + 1]]);
        at += 2;
    }
    // Property length (a variable byte integer) and properties.
    let (mut len, mut shift) = (0usize, 0);
    loop {
        let b = body[at];
        at += 1;
        len |= usize::from(b & 0x7f) << shift;
        shift += 7;
        if b & 0x80 == 0 {
            break;
        }
    }
    at += len;
    let payload = body[at..].to_vec();
    Packet::Publish(Got {
        qos,
        dup: header & 0x08 != 0,
        packet_id,
        topic,
        payload,
    })
}

/// Connect `id` (MQTT 5, Clean Start 0, Session Expiry 600 s); returns the
/// client and Session Present.
fn connect_persistent(broker: &Broker, id: &str) -> (RawClient, bool) {
    let mut client = RawClient::connect(broker.listener("mqtt-tcp"));
    let connect = wire::Connect {
        clean: false,
        session_expiry: Some(600),
        ..wire::Connect::v5(id)
    };
    let (flags, reason) = client.handshake(&connect.encode());
    assert_eq!(reason, 0, "CONNACK reason");
    (client, flags & 1 == 1)
}

/// The next `n` packets, each within [`WAIT`].
fn take(client: &mut RawClient, n: usize) -> Vec<Packet> {
    (0..n)
        .map(|i| next(client, WAIT).unwrap_or_else(|| panic!("packet {i} of {n} did not come")))
        .collect()
}

fn publish_of(p: &Packet) -> &Got {
    match p {
        Packet::Publish(g) => g,
        other => panic!("expected PUBLISH, got {other:02x?}"),
    }
}

/// A subscriber's QoS 1 delivery not yet acknowledged, a QoS 2 delivery
/// that got its PUBREC (so its PUBREL was sent) and one that did not, and a
/// publisher's QoS 2 PUBLISH with its PUBREC but no PUBREL, then SIGKILL.
/// After the restart the subscriber gets the QoS 1 and the unreceived QoS 2
/// deliveries again with their packet identifiers and DUP set
/// [MQTT-4.4.0-1], and for the received one PUBREL, never the PUBLISH again
/// [MQTT-4.3.3-6]; the publisher's resent PUBLISH gets PUBREC and is not
/// forwarded twice [MQTT-4.3.3-10], its PUBREL gets PUBCOMP
/// [MQTT-4.3.3-11]. Once everything is completed a second kill brings
/// nothing back.
#[test]
fn deliveries_in_flight_keep_their_identifiers_and_qos2_flows_resume_where_they_stopped_after_sigkill(
) {
    let dir = TempDir::new("inflight");
    let broker = local(&dir.0);
    let (sub_id, pub_id, t) = (unique("ifsub"), unique("ifpub"), unique("inflight"));
    let (mut sub, _) = connect_persistent(&broker, &sub_id);
    sub.send(&wire::subscribe(1, &format!("{t}/#"), 2, true));
    assert!(matches!(take(&mut sub, 1)[0], Packet::Other(0x90, 1)));
    let (mut publisher, _) = connect_persistent(&broker, &pub_id);
    publisher.send(&publish(&format!("{t}/1"), 1, 1, false, b"one"));
    publisher.send(&publish(&format!("{t}/2"), 2, 2, false, b"two"));
    publisher.send(&publish(&format!("{t}/3"), 2, 3, false, b"three"));
    publisher.send(&publish(&format!("{t}/4"), 2, 77, false, b"four"));
    let acks = take(&mut publisher, 4);
    assert_eq!(
        acks,
        vec![
            Packet::Other(0x40, 1),
            Packet::Other(0x50, 2),
            Packet::Other(0x50, 3),
            Packet::Other(0x50, 77)
        ]
    );
    let got: Vec<Got> = take(&mut sub, 4)
        .iter()
        .map(|p| publish_of(p).clone())
        .collect();
    let payloads: Vec<&[u8]> = got.iter().map(|g| &g.payload[..]).collect();
    assert_eq!(payloads, [&b"one"[..], b"two", b"three", b"four"]);
    assert!(got.iter().all(|g| !g.dup));
    // The second delivery gets its PUBREC: PUBREL comes back.
    sub.send(&response(0x50, got[1].packet_id));
    assert_eq!(
        take(&mut sub, 1),
        vec![Packet::Other(0x62, got[1].packet_id)]
    );
    kill(broker);

    let broker = local(&dir.0);
    let (mut sub, present) = connect_persistent(&broker, &sub_id);
    assert!(present, "Session Present [MQTT-3.2.2-2]");
    let resent = take(&mut sub, 4);
    let expected = [
        Packet::Publish(Got {
            dup: true,
            ..got[0].clone()
        }),
        Packet::Other(0x62, got[1].packet_id),
        Packet::Publish(Got {
            dup: true,
            ..got[2].clone()
        }),
        Packet::Publish(Got {
            dup: true,
            ..got[3].clone()
        }),
    ];
    for e in &expected {
        assert!(resent.contains(e), "{e:?} resent; got {resent:?}");
    }
    assert_eq!(
        next(&mut sub, Duration::from_millis(300)),
        None,
        "nothing else, no PUBLISH of the released one"
    );
    // The publisher resends its QoS 2 PUBLISH: PUBREC, and not forwarded.
    let (mut publisher, present) = connect_persistent(&broker, &pub_id);
    assert!(present);
    publisher.send(&publish(&format!("{t}/4"), 2, 77, true, b"four"));
    assert_eq!(take(&mut publisher, 1), vec![Packet::Other(0x50, 77)]);
    publisher.send(&response(0x62, 77));
    assert_eq!(take(&mut publisher, 1), vec![Packet::Other(0x70, 77)]);
    assert_eq!(
        next(&mut sub, Duration::from_millis(500)),
        None,
        "the resent PUBLISH is not forwarded again"
    );
    // Complete everything.
    sub.send(&response(0x40, got[0].packet_id));
    sub.send(&response(0x70, got[1].packet_id));
    for g in &got[2..] {
        sub.send(&response(0x50, g.packet_id));
        assert_eq!(take(&mut sub, 1), vec![Packet::Other(0x62, g.packet_id)]);
        sub.send(&response(0x70, g.packet_id));
    }
    // A SUBACK after them: the broker read them all and its log covers
    // them (an acknowledgement waits for everything logged before it).
    sub.send(&wire::subscribe(2, &format!("{t}/other"), 1, true));
    assert!(matches!(take(&mut sub, 1)[0], Packet::Other(0x90, 2)));
    kill(broker);

    let broker = local(&dir.0);
    let (mut sub, present) = connect_persistent(&broker, &sub_id);
    assert!(present);
    assert_eq!(
        next(&mut sub, Duration::from_millis(500)),
        None,
        "completed deliveries stay completed"
    );
}

/// A raw MQTT 5 connection with a will on `topic` (QoS 1) delayed
/// `delay` s, Session Expiry 600 s.
fn with_will(broker: &Broker, id: &str, topic: &str, delay: u32) -> RawClient {
    let mut client = RawClient::connect(broker.listener("mqtt-tcp"));
    let will = wire::Will {
        topic,
        payload: id.as_bytes(),
        delay_secs: Some(delay),
        payload_format: None,
    };
    let connect = wire::Connect {
        clean: false,
        session_expiry: Some(600),
        will: Some(will),
        ..wire::Connect::v5(id)
    };
    let mut bytes = connect.encode();
    // Will QoS 1 (Connect Flags bits 3-4; the flags follow the fixed
    // header, the protocol name and level), so a persistent watcher
    // keeps it.
    assert!(bytes[1] < 0x80, "a one-byte remaining length");
    bytes[2 + 6 + 1] |= 0x08;
    let (_, reason) = client.handshake(&bytes);
    assert_eq!(reason, 0);
    client
}

/// Wills of connections open at a SIGKILL are sent after the restart: one
/// with Session Expiry 0 at once, updating the retained message it sets
/// (Will Retain [MQTT-3.1.2-17]); one delayed 2 s about 2 s after the
/// restart, not before [MQTT-3.1.3-9]; one whose client is back within its
/// delay never [MQTT-3.1.3-9]; one whose connection ended normally before
/// the kill never [MQTT-3.1.2-10]; and one whose delay was already running
/// at the kill when it is due, counted in wall-clock time across the
/// restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wills_of_connections_open_at_sigkill_are_sent_after_their_delay_unless_the_client_is_back()
{
    let dir = TempDir::new("wills");
    let broker = local(&dir.0);
    let port = broker.mqtt_port();
    let t = unique("rwill");
    let watcher_id = unique("rwatch");
    let mut o = v5::options(port, &watcher_id, false);
    o.set_session_expiry_interval(Some(600));
    let (mut watcher, _) = v5::Client::connect_with(o).await;
    watcher
        .subscribe(&format!("{t}/#"), v5::QoS::AtLeastOnce)
        .await;
    watcher.disconnect().await;
    // Session Expiry 0, Will Retain, no delay.
    let (at_once, delayed, back, normal, running) = (
        unique("rwa"),
        unique("rwb"),
        unique("rwc"),
        unique("rwd"),
        unique("rwe"),
    );
    let mut o = v5::options(port, &at_once, true);
    o.set_last_will(LastWill::new(
        format!("{t}/a"),
        "at once",
        v5::QoS::AtLeastOnce,
        true,
        None::<LastWillProperties>,
    ));
    let (_a, _) = v5::Client::connect_with(o).await;
    let _b = with_will(&broker, &delayed, &format!("{t}/b"), 2);
    let _c = with_will(&broker, &back, &format!("{t}/c"), 2);
    let mut d = with_will(&broker, &normal, &format!("{t}/d"), 0);
    d.send(&wire::disconnect_v5(0));
    let e = with_will(&broker, &running, &format!("{t}/e"), 6);
    tokio::task::block_in_place(|| broker.wait_for_clients(4, WAIT));
    drop(e);
    let e_ended = Instant::now();
    tokio::task::block_in_place(|| broker.wait_for_clients(3, WAIT));
    tokio::time::sleep(Duration::from_secs(3)).await;
    kill(broker);

    let restarting = Instant::now();
    let broker = tokio::task::block_in_place(|| local(&dir.0));
    let ready = Instant::now();
    let port = broker.mqtt_port();
    // Back within its delay: its will is not sent.
    let (_c, present) = tokio::task::block_in_place(|| connect_persistent(&broker, &back));
    assert!(present);
    let mut o = v5::options(port, &watcher_id, false);
    o.set_session_expiry_interval(Some(600));
    let (mut watcher, _) = v5::Client::connect_with(o).await;
    let mut arrived = BTreeMap::new();
    while let Some(p) = watcher
        .try_next_publish(ready + Duration::from_secs(7) - Instant::now())
        .await
    {
        let topic = String::from_utf8_lossy(&p.topic).into_owned();
        assert!(
            arrived.insert(topic.clone(), Instant::now()).is_none(),
            "{topic} once"
        );
    }
    let at = |name: &str| arrived.get(&format!("{t}/{name}")).copied();
    assert!(
        at("a").is_some(),
        "the will of the connection with Session Expiry 0: {arrived:?}"
    );
    let b = at("b").expect("the delayed will");
    assert!(
        b >= restarting + Duration::from_secs(2),
        "not before its delay: {:?} after the restart",
        b - restarting
    );
    assert!(
        b <= ready + Duration::from_millis(3500),
        "about its delay after the restart: {:?}",
        b - ready
    );
    assert_eq!(at("c"), None, "the client came back within the delay");
    assert_eq!(at("d"), None, "DISCONNECT 0x00 discarded the will");
    let e = at("e").expect("the will whose delay was running");
    assert!(
        e >= e_ended + Duration::from_secs(6),
        "not before its delay: {:?}",
        e - e_ended
    );
    assert!(
        e < restarting + Duration::from_secs(5),
        "counted across the restart: {:?} after it",
        e - restarting
    );
    // Will Retain: the retained message of its topic.
    let mut fresh = v5::Client::connect(port, &unique("rfresh")).await;
    fresh
        .subscribe(&format!("{t}/a"), v5::QoS::AtLeastOnce)
        .await;
    let retained = fresh.next_publish().await;
    assert_eq!(
        (&retained.payload[..], retained.retain),
        (&b"at once"[..], true)
    );
}

/// A CONNACK is written only once the store has what it promises: killed
/// as soon as the CONNACK of a new persistent session with a will arrives,
/// the restarted broker has the session (Session Present [MQTT-3.2.2-2])
/// and sends the will (no delay: sent even though the client is back).
#[test]
fn a_connack_is_written_once_the_store_has_the_session_and_the_will() {
    let dir = TempDir::new("connack");
    for round in 0..5 {
        let broker = local(&dir.0);
        let (id, watcher_id, topic) = (unique("rconn"), unique("rconnw"), unique("rconn/will"));
        let (mut watcher, _) = connect_persistent(&broker, &watcher_id);
        watcher.send(&wire::subscribe(1, &topic, 1, true));
        assert!(matches!(take(&mut watcher, 1)[0], Packet::Other(0x90, 1)));
        watcher.send(&wire::disconnect_v5(0));
        let _client = with_will(&broker, &id, &topic, 0);
        kill(broker);
        let broker = local(&dir.0);
        let (mut again, present) = connect_persistent(&broker, &id);
        assert!(
            present,
            "round {round}: the session survives a kill right after its CONNACK"
        );
        let (mut watcher, _) = connect_persistent(&broker, &watcher_id);
        let will = publish_of(&take(&mut watcher, 1)[0]).clone();
        assert_eq!(
            (will.topic, will.payload),
            (topic, id.clone().into_bytes()),
            "round {round}"
        );
        again.send(&wire::disconnect_v5(0));
        kill(broker);
    }
}

/// The broker's MQTT port, changed by each restart (0: down).
type Port = Arc<Mutex<u16>>;

/// Connect `id` (MQTT 5, Clean Start 0, Session Expiry 600 s) to the
/// broker on `port`; `None` while nothing listens there.
fn try_connect_persistent(port: u16, id: &str) -> Option<(RawClient, bool)> {
    let mut client = RawClient::try_connect(([127, 0, 0, 1], port).into()).ok()?;
    let connect = wire::Connect {
        clean: false,
        session_expiry: Some(600),
        ..wire::Connect::v5(id)
    };
    client.send(&connect.encode());
    match client.read(WAIT) {
        Incoming::Packet { header: 0x20, body } if body.len() >= 2 && body[1] == 0 => {
            Some((client, body[0] & 1 == 1))
        }
        _ => None,
    }
}

/// Publisher `i`: QoS 2 `"{i} {seq}"` on `topic`, 50 in flight, through
/// restarts, until `stop`; returns the sequence numbers that got their
/// PUBREC. A raw client that keeps its session as MQTT asks: a packet
/// identifier is reused only after its PUBCOMP [MQTT-2.2.1-3], and after a
/// reconnect what is unacknowledged is resent in order, PUBLISH with DUP
/// or PUBREL [MQTT-4.4.0-1]. (rumqttc 0.25 reuses an identifier after
/// PUBREC and so has its next message taken for a resend.)
fn qos2_publisher(i: usize, topic: &str, port: &Port, stop: &Mutex<bool>) -> HashSet<u64> {
    let id = format!("{}-{i}", unique("xpub"));
    // Packet identifier -> (sequence number, PUBREC received), in flight.
    let mut inflight: BTreeMap<u16, (u64, bool)> = BTreeMap::new();
    let (mut next, mut acked) = (0u64, HashSet::new());
    let payload = |seq: u64| format!("{i} {seq}").into_bytes();
    while !*stop.lock().unwrap() {
        let Some((mut client, present)) = try_connect_persistent(*port.lock().unwrap(), &id) else {
            std::thread::sleep(Duration::from_millis(50));
            continue;
        };
        if !inflight.is_empty() {
            assert!(present, "the publisher's session survives");
        }
        let mut order: Vec<(u16, u64, bool)> =
            inflight.iter().map(|(p, (s, r))| (*p, *s, *r)).collect();
        order.sort_by_key(|(_, seq, _)| *seq);
        for (pid, seq, released) in order {
            client.send(&if released {
                response(0x62, pid)
            } else {
                publish(topic, 2, pid, true, &payload(seq))
            });
        }
        loop {
            if *stop.lock().unwrap() {
                return acked;
            }
            while inflight.len() < 50 {
                let pid = (1..=50).find(|p| !inflight.contains_key(p)).unwrap();
                client.send(&publish(topic, 2, pid, false, &payload(next)));
                inflight.insert(pid, (next, false));
                next += 1;
            }
            match client.read(Duration::from_millis(200)) {
                Incoming::Packet { header: 0x50, body } => {
                    let pid = u16::from_be_bytes([body[0], body[1]]);
                    let entry = inflight
                        .get_mut(&pid)
                        .expect("PUBREC for a packet in flight");
                    assert!(
                        body.len() < 3 || body[2] < 0x80,
                        "PUBREC refused: {body:02x?}"
                    );
                    acked.insert(entry.0);
                    entry.1 = true;
                    client.send(&response(0x62, pid));
                }
                Incoming::Packet { header: 0x70, body } => {
                    inflight.remove(&u16::from_be_bytes([body[0], body[1]]));
                }
                Incoming::Packet { header, body } => {
                    panic!("publisher {i}: unexpected {header:02x} {body:02x?}")
                }
                Incoming::TimedOut => {}
                Incoming::Closed => break,
            }
        }
    }
    acked
}

/// What a QoS 2 subscriber that keeps its session (MQTT 5, Clean Start 0,
/// across restarts) delivered to its application, per publisher in arrival
/// order: a PUBLISH whose packet identifier it holds (PUBREC sent, no
/// PUBREL yet) is the same message again and not delivered, as a receiver
/// storing the identifier does (MQTT 5 §4.3.3, Method B) [MQTT-4.3.3-10];
/// every PUBREL gets PUBCOMP [MQTT-4.3.3-11]. A raw client: rumqttc 0.25
/// takes a PUBREL it does not expect (a resend after a restart, which
/// [MQTT-4.4.0-1] asks for) for a fatal error.
fn qos2_subscriber(
    id: &str,
    filter: &str,
    port: &Port,
    stop: &Mutex<bool>,
) -> BTreeMap<usize, Vec<u64>> {
    let (mut open, mut delivered) = (HashSet::new(), BTreeMap::<usize, Vec<u64>>::new());
    let mut subscribed = false;
    let mut quiet_since = Instant::now();
    while !(*stop.lock().unwrap() && quiet_since.elapsed() > Duration::from_secs(3)) {
        let Some((mut client, present)) = try_connect_persistent(*port.lock().unwrap(), id) else {
            std::thread::sleep(Duration::from_millis(50));
            continue;
        };
        assert!(present || !subscribed, "the subscriber's session survives");
        if !subscribed {
            client.send(&wire::subscribe(1, filter, 2, true));
            subscribed = true;
        }
        loop {
            if *stop.lock().unwrap() && quiet_since.elapsed() > Duration::from_secs(3) {
                break;
            }
            let packet = match client.read(Duration::from_millis(200)) {
                Incoming::Packet { header, body } => parse(header, &body),
                Incoming::TimedOut => continue,
                Incoming::Closed => break,
            };
            match packet {
                Packet::Publish(g) => {
                    quiet_since = Instant::now();
                    assert_eq!(g.qos, 2);
                    if open.insert(g.packet_id) {
                        let text = String::from_utf8(g.payload).unwrap();
                        let (publisher, seq) = text.split_once(' ').unwrap();
                        delivered
                            .entry(publisher.parse().unwrap())
                            .or_default()
                            .push(seq.parse().unwrap());
                    } else {
                        assert!(
                            g.dup,
                            "a PUBLISH with an identifier in use is a resend [MQTT-3.3.1-1]"
                        );
                    }
                    client.send(&response(0x50, g.packet_id));
                }
                Packet::Other(0x62, packet_id) => {
                    open.remove(&packet_id);
                    client.send(&response(0x70, packet_id));
                }
                Packet::Other(0x90, _) => {}
                other => panic!("unexpected {other:02x?}"),
            }
        }
    }
    delivered
}

/// Four QoS 2 publishers and an online persistent QoS 2 subscriber, the
/// broker killed with SIGKILL three times under load: every value that got
/// its PUBREC reaches the subscriber's application exactly once, in order
/// per publisher (DESIGN.md §7; [MQTT-4.3.3-10], [MQTT-4.4.0-1],
/// [MQTT-4.6.0-2]).
#[test]
fn qos2_publishers_reach_an_online_persistent_qos2_subscriber_exactly_once_across_sigkills() {
    let dir = TempDir::new("exactly");
    let mut broker = local(&dir.0);
    let port: Port = Arc::new(Mutex::new(broker.mqtt_port()));
    let (stop, stop_sub) = (Arc::new(Mutex::new(false)), Arc::new(Mutex::new(false)));
    let t = unique("exactly");
    let sub = std::thread::spawn({
        let (id, filter, port, stop) = (
            unique("xsub"),
            format!("{t}/+"),
            port.clone(),
            stop_sub.clone(),
        );
        move || qos2_subscriber(&id, &filter, &port, &stop)
    });
    std::thread::sleep(Duration::from_millis(500));
    let publishers: Vec<_> = (0..4)
        .map(|i| {
            let (topic, port, stop) = (format!("{t}/{i}"), port.clone(), stop.clone());
            std::thread::spawn(move || qos2_publisher(i, &topic, &port, &stop))
        })
        .collect();
    for _ in 0..3 {
        std::thread::sleep(Duration::from_millis(1500));
        *port.lock().unwrap() = 0;
        kill(broker);
        broker = local(&dir.0);
        *port.lock().unwrap() = broker.mqtt_port();
    }
    // Let the publishers finish what they have in flight on the last run.
    std::thread::sleep(Duration::from_millis(1500));
    *stop.lock().unwrap() = true;
    let mut acked = Vec::new();
    for p in publishers {
        acked.push(p.join().unwrap());
    }
    *stop_sub.lock().unwrap() = true;
    let delivered = sub.join().unwrap();
    for (i, acked) in acked.iter().enumerate() {
        let got = delivered.get(&i).cloned().unwrap_or_default();
        let unique: HashSet<u64> = got.iter().copied().collect();
        assert_eq!(
            unique.len(),
            got.len(),
            "publisher {i}: {} duplicates",
            got.len() - unique.len()
        );
        assert!(
            got.windows(2).all(|w| w[0] < w[1]),
            "publisher {i}: order kept"
        );
        let lost: Vec<u64> = acked
            .iter()
            .filter(|s| !unique.contains(s))
            .copied()
            .collect();
        assert!(
            lost.is_empty(),
            "publisher {i}: {} of {} acknowledged values lost, e.g. {:?}",
            lost.len(),
            acked.len(),
            &lost[..lost.len().min(5)]
        );
        assert!(
            acked.len() > 100,
            "publisher {i}: the load ran ({} acknowledged)",
            acked.len()
        );
        eprintln!(
            "publisher {i}: {} acknowledged, {} delivered once each",
            acked.len(),
            got.len()
        );
    }
}
