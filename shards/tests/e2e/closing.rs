//! The broker's last packet reaches a client that is still writing
//! (DESIGN.md §7, "Closing"; issue 27; cases/disconnect-read-after-reset.md).
//!
//! After a DISCONNECT with a reason code or a refusing CONNACK the broker
//! ends its sending side and reads what the client still sends for a
//! bounded time and amount before it closes, so the client's writes do not
//! meet a reset and the client reads the reason. Each test writes after
//! the broker's last packet was sent, as the Eclipse Paho MQTT 5
//! interoperability test `test_flow_control2` does: every write must
//! succeed, and the whole last packet must be read with its reason code,
//! over TCP, TLS and WebSocket, with the TLS and WebSocket connections
//! bridged to another shard or served where they were accepted.

use std::net::TcpStream;
use std::thread;
use std::time::{Duration, Instant};

use crate::clients::{unique, WAIT};
use crate::harness::Broker;
use crate::mqtt5::packet::{self, ConnAck, Props};
use crate::mqtt5::prop;
use crate::raw::{wire, Incoming, RawClient};
use crate::security::{
    client_config, handshake, set, set_str, start, tls_stream, ws_connect, Ca, Chunk, Direct, Mqtt,
    TempDir, Tls, Wire, Ws,
};

/// The transports a test runs over.
#[derive(Debug, Clone, Copy)]
enum Kind {
    Tcp,
    Tls,
    Ws,
}

const KINDS: [Kind; 3] = [Kind::Tcp, Kind::Tls, Kind::Ws];

/// A client's connection on any transport.
enum AnyWire {
    Tcp(Direct<TcpStream>),
    Tls(Box<Direct<Tls>>),
    Ws(Box<Ws<TcpStream>>),
}

impl Wire for AnyWire {
    fn try_send(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        match self {
            AnyWire::Tcp(w) => w.try_send(bytes),
            AnyWire::Tls(w) => w.try_send(bytes),
            AnyWire::Ws(w) => w.try_send(bytes),
        }
    }

    fn receive(&mut self, timeout: Duration) -> Chunk {
        match self {
            AnyWire::Tcp(w) => w.receive(timeout),
            AnyWire::Tls(w) => w.receive(timeout),
            AnyWire::Ws(w) => w.receive(timeout),
        }
    }
}

/// A two-shard broker with TCP, TLS and WebSocket listeners.
struct Setup {
    broker: Broker,
    ca: Ca,
    _dir: TempDir,
}

impl Setup {
    fn start(extra: &[&str]) -> Setup {
        let dir = TempDir::new("closing");
        let ca = Ca::new("closing CA");
        let cert = ca.server("broker");
        let mut args = vec!["--shards".to_string(), "2".to_string()];
        set(&mut args, "listeners.tls", r#"["127.0.0.1:0"]"#);
        set(&mut args, "listeners.ws", r#"["127.0.0.1:0"]"#);
        set_str(&mut args, "tls.cert", &dir.put("server.pem", &cert.0));
        set_str(&mut args, "tls.key", &dir.put("server.key", &cert.1));
        args.extend(extra.iter().map(|a| a.to_string()));
        Setup {
            broker: start(&args),
            ca,
            _dir: dir,
        }
    }

    /// A connection of `kind`, before its CONNECT.
    fn open(&self, kind: Kind) -> Mqtt<AnyWire> {
        let wire = match kind {
            Kind::Tcp => {
                let tcp = TcpStream::connect(self.broker.mqtt).unwrap();
                tcp.set_nodelay(true).unwrap();
                AnyWire::Tcp(Direct(tcp))
            }
            Kind::Tls => {
                let addr = self.broker.listener("mqtt-tls");
                let mut tls = tls_stream(addr, client_config(&self.ca, None, &[]));
                handshake(&mut tls).expect("TLS handshake");
                AnyWire::Tls(Box::new(Direct(tls)))
            }
            Kind::Ws => AnyWire::Ws(Box::new(ws_connect(&self.broker))),
        };
        Mqtt::new(wire, true)
    }

    /// A connection of `kind` whose MQTT 5 CONNECT (`props`, keep alive
    /// `keep_alive`) was accepted.
    fn connected(
        &self,
        kind: Kind,
        client_id: &str,
        keep_alive: u16,
        props: &Props,
    ) -> Mqtt<AnyWire> {
        let mut c = self.open(kind);
        let connack = c
            .connect(&packet::connect(client_id, true, keep_alive, props))
            .unwrap_or_else(|| panic!("{kind:?}: no CONNACK"));
        assert_eq!(connack.reason, 0, "{kind:?}: {connack:?}");
        c
    }
}

/// What the client writes after the broker's last packet: 64 PINGREQs.
fn filler() -> Vec<u8> {
    [0xC0, 0x00].repeat(64)
}

/// Client IDs on both shards, so that TLS and WebSocket connections are
/// bridged to another shard or served where accepted.
fn ids(what: &str) -> [String; 2] {
    let mut on = [None, None];
    while on.iter().any(Option::is_none) {
        let id = unique(what);
        on[fleetmq_shards::home_shard(&id, 2)].get_or_insert(id);
    }
    on.map(Option::unwrap)
}

/// The broker has sent its last packet: write three times, 50 ms apart
/// (each write must succeed: the broker reads what it will drop; had it
/// closed, the second would draw a reset and the third fail), then read
/// packets until the one of type `last` (a DISCONNECT, 0xE0, or a CONNACK,
/// 0x20), which must come whole, then the end of the stream. Returns the
/// last packet's reason code (its first byte; 0 when it has none) and what
/// else was read before it.
fn hears_last(c: &mut Mqtt<AnyWire>, what: &str, last: u8) -> (u8, Vec<u8>) {
    let mut before = Vec::new();
    for _ in 0..3 {
        c.wire.try_send(&filler()).unwrap_or_else(|e| {
            panic!("{what}: a write after the broker's last packet failed: {e}")
        });
        thread::sleep(Duration::from_millis(50));
    }
    let reason = loop {
        match c.read(WAIT) {
            Incoming::Packet { header, body } if header == last => {
                break if last == 0x20 {
                    ConnAck::parse(&body).reason
                } else {
                    body.first().copied().unwrap_or(0)
                };
            }
            Incoming::Packet { header, .. } => before.push(header),
            other => panic!("{what}: {other:02x?} before the last packet (0x{last:02x})"),
        }
    };
    assert_eq!(
        c.read(WAIT),
        Incoming::Closed,
        "{what}: the stream ends after the last packet"
    );
    (reason, before)
}

/// Paho's `test_flow_control2`: 1,001 QoS 2 PUBLISHes written at once
/// against a Receive Maximum of 1,000; a PUBREL for each PUBREC, written
/// while the DISCONNECT 0x93 (Receive Maximum exceeded, [MQTT-3.3.4-9])
/// is on its way; the client reads it whole.
#[test]
fn a_client_writing_pubrels_reads_disconnect_0x93_for_the_1001st_qos2_publish() {
    let setup = Setup::start(&[]);
    for kind in KINDS {
        for id in ids("flow-control2") {
            let what = format!("{kind:?} {id}");
            let mut c = setup.connected(kind, &id, 60, &Props::new());
            let mut burst = Vec::new();
            for i in 1..=1001u16 {
                burst.extend(packet::publish(
                    "flow/control2",
                    2,
                    false,
                    i,
                    Some(&Props::new()),
                    b"x",
                ));
            }
            c.wire.try_send(&burst).expect("the burst is written");
            let (mut pubrecs, mut reason) = (0, None);
            while reason.is_none() {
                match c.read(WAIT) {
                    Incoming::Packet { header: 0x50, body } => {
                        pubrecs += 1;
                        let id = u16::from_be_bytes([body[0], body[1]]);
                        c.wire
                            .try_send(&packet::ack(0x62, id))
                            .unwrap_or_else(|e| panic!("{what}: PUBREL {id} not written: {e}"));
                    }
                    Incoming::Packet { header: 0xE0, body } => reason = body.first().copied(),
                    Incoming::Packet { .. } => {}
                    other => panic!(
                        "{what}: {other:02x?} after {pubrecs} PUBRECs, before the DISCONNECT"
                    ),
                }
            }
            assert_eq!(reason, Some(0x93), "{what}");
            assert_eq!(
                pubrecs, 1000,
                "{what}: a PUBREC for each PUBLISH within the window"
            );
            // Written after the DISCONNECT came, before the client read it.
            c.wire
                .try_send(&filler())
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(c.read(WAIT), Incoming::Closed, "{what}");
        }
    }
}

/// Take-over: the connection that loses its client ID gets DISCONNECT
/// 0x8E (Session taken over, [MQTT-3.1.4-3]) and reads it while writing.
#[test]
fn a_client_taken_over_while_writing_reads_disconnect_0x8e() {
    let setup = Setup::start(&[]);
    for kind in KINDS {
        for id in ids("taken-over") {
            let mut old = setup.connected(kind, &id, 60, &Props::new());
            let _new = setup.connected(Kind::Tcp, &id, 60, &Props::new());
            let (reason, _) = hears_last(&mut old, &format!("{kind:?} {id}"), 0xE0);
            assert_eq!(reason, 0x8E, "{kind:?}");
        }
    }
}

/// Malformed packets: DISCONNECT 0x81 for a PUBLISH of QoS 3
/// ([MQTT-3.3.1-4]), 0x82 for an unknown Topic Alias with an empty topic
/// (MQTT 5 §3.3.2.3.4); the bytes after the bad packet and those written
/// later are read and dropped.
#[test]
fn a_client_reads_disconnect_0x81_or_0x82_for_a_malformed_packet_it_wrote_more_after() {
    let setup = Setup::start(&[]);
    let qos3 = wire::packet(0x36, &[0, 1, b't', 0, 1, 0]);
    let alias = Props::new().int(prop::TOPIC_ALIAS, 64);
    let unknown_alias = packet::publish("", 0, false, 0, Some(&alias), b"x");
    for (bad, expected) in [(qos3, 0x81), (unknown_alias, 0x82)] {
        for kind in KINDS {
            for id in ids("malformed") {
                let what = format!("{kind:?} {id} 0x{expected:02x}");
                let mut c = setup.connected(kind, &id, 60, &Props::new());
                let mut bytes = bad.clone();
                bytes.extend([0xC0, 0x00].repeat(2048));
                c.wire
                    .try_send(&bytes)
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                let (reason, _) = hears_last(&mut c, &what, 0xE0);
                assert_eq!(reason, expected, "{what}");
            }
        }
    }
}

/// A QoS 1 and a QoS 2 PUBLISH, then a malformed packet in the same
/// write, with the default (durable) store: the PUBACK and the PUBREC,
/// which wait until the values are on disk, come before the DISCONNECT
/// 0x81, nothing after it [MQTT-3.14.4-1], and the stream ends well
/// within the linger's second (a fresh-user pass saw the DISCONNECT
/// first, the acknowledgements after it, and the close only after 2 s).
#[test]
fn acknowledgements_waiting_for_the_store_come_before_the_disconnect_and_nothing_after() {
    let setup = Setup::start(&[]);
    let qos3 = wire::packet(0x36, &[0, 1, b't', 0, 1, 0]);
    for kind in KINDS {
        for id in ids("ack-then-disconnect") {
            let what = format!("{kind:?} {id}");
            let mut c = setup.connected(kind, &id, 60, &Props::new());
            let mut bytes = packet::publish("acks/first", 1, false, 1, Some(&Props::new()), b"one");
            bytes.extend(packet::publish("acks/first", 2, false, 2, Some(&Props::new()), b"two"));
            bytes.extend(&qos3);
            let sent = Instant::now();
            c.wire.try_send(&bytes).unwrap_or_else(|e| panic!("{what}: {e}"));
            let (reason, before) = hears_last(&mut c, &what, 0xE0);
            let took = sent.elapsed();
            assert_eq!(reason, 0x81, "{what}");
            assert_eq!(before, [0x40, 0x50], "{what}: PUBACK and PUBREC before the DISCONNECT");
            // hears_last writes for 150 ms; the linger ends at most 1 s
            // after the DISCONNECT.
            assert!(took < Duration::from_millis(1_500), "{what}: closed after {took:?}");
        }
    }
}

/// Keep alive: a client silent for 1.5 × its Keep Alive gets DISCONNECT
/// 0x8D (Keep Alive timeout, [MQTT-3.1.2-22]), and reads it even though it
/// writes after it was sent.
#[test]
fn a_client_past_its_keep_alive_reads_disconnect_0x8d_though_it_writes_after_it() {
    let setup = Setup::start(&[]);
    // Each client on a thread of its own: 1.5 s is the deadline, checked
    // every 50 ms; each writes 0.5 s after it.
    thread::scope(|scope| {
        for kind in KINDS {
            for id in ids("keep-alive") {
                let setup = &setup;
                scope.spawn(move || {
                    let what = format!("{kind:?} {id}");
                    let mut c = setup.connected(kind, &id, 1, &Props::new());
                    thread::sleep(Duration::from_millis(2000));
                    let (reason, _) = hears_last(&mut c, &what, 0xE0);
                    assert_eq!(reason, 0x8D, "{what}");
                });
            }
        }
    });
}

/// Shutdown: every client gets DISCONNECT 0x8B (Server shutting down) and
/// reads it while writing; the broker still exits within its grace.
#[test]
fn clients_writing_through_a_shutdown_read_disconnect_0x8b() {
    let mut setup = Setup::start(&[]);
    let clients: Vec<_> = KINDS
        .iter()
        .flat_map(|&kind| ids("shutdown").map(move |id| (kind, id)))
        .map(|(kind, id)| {
            (
                format!("{kind:?} {id}"),
                setup.connected(kind, &id, 60, &Props::new()),
            )
        })
        .collect();
    let stopping = Instant::now();
    thread::scope(|scope| {
        for (what, mut c) in clients {
            scope.spawn(move || {
                // Written once the DISCONNECT is on its way.
                thread::sleep(Duration::from_millis(200));
                let (reason, _) = hears_last(&mut c, &what, 0xE0);
                assert_eq!(reason, 0x8B, "{what}");
            });
        }
        let status = setup.broker.stop_with_sigterm();
        assert!(status.success(), "{status:?}");
    });
    assert!(
        stopping.elapsed() < Duration::from_secs(5),
        "stopped in {:?}",
        stopping.elapsed()
    );
}

/// Shutdown with clients that write flat out (1 KB QoS 0 PUBLISHes as
/// fast as their sockets take them) over TCP and WebSocket, two shards:
/// each reads DISCONNECT 0x8B before its stream ends, also when its
/// WebSocket connection is bridged to the shard owning its client
/// identifier (`tests/interop/sigterm_writers.py`, standard-library
/// Python). A fresh-user pass saw 4 of 6 WebSocket clients miss it: the
/// bridge took the owner's closed end for the client's and stopped
/// carrying what the owner wrote last, and the accepting shard stopped
/// without waiting for its bridges.
#[test]
fn clients_writing_flat_out_through_a_shutdown_read_disconnect_0x8b() {
    let status = std::process::Command::new("python3")
        .arg(crate::interop::root().join("tests/interop/sigterm_writers.py"))
        .arg(env!("CARGO_BIN_EXE_fleetmq"))
        .args(["--shards", "2", "--clients", "3", "--runs", "3"])
        .status()
        .expect("python3 runs");
    assert!(status.success(), "a client missed its DISCONNECT 0x8B (see the script's lines above)");
}

/// A refusing CONNACK (0x8C Bad authentication method: the broker offers
/// no enhanced authentication, MQTT 5 §4.12) is read whole by a client
/// that wrote on after its CONNECT [MQTT-3.2.2-5].
#[test]
fn a_client_writing_after_a_refused_connect_reads_the_refusing_connack() {
    let setup = Setup::start(&[]);
    for kind in KINDS {
        let what = format!("{kind:?}");
        let mut c = setup.open(kind);
        let props = Props::new().bytes(prop::AUTH_METHOD, b"SCRAM-SHA-1");
        let mut bytes = packet::connect(&unique("refused"), true, 60, &props);
        bytes.extend(filler());
        c.wire
            .try_send(&bytes)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        let (reason, before) = hears_last(&mut c, &what, 0x20);
        assert_eq!((reason, before), (0x8C, vec![]), "{what}");
    }
}

/// Over WebSocket, a client's Close frame is answered with a Close frame
/// (RFC 6455 §5.5.1), and the broker sends one before it closes.
#[test]
fn websocket_close_frames_are_exchanged_both_ways() {
    use async_tungstenite::tungstenite::Message;
    let setup = Setup::start(&[]);
    for id in ids("ws-close") {
        // The client closes first.
        let Mqtt {
            wire: AnyWire::Ws(mut ws),
            ..
        } = setup.connected(Kind::Ws, &id, 60, &Props::new())
        else {
            unreachable!()
        };
        ws.0.close(None).expect("Close frame sent");
        let answer = loop {
            match ws.0.read() {
                Ok(Message::Close(frame)) => break Ok(frame),
                Ok(_) => {}
                Err(e) => break Err(e.to_string()),
            }
        };
        assert!(
            answer.is_ok(),
            "{id}: the broker answers a Close frame with one: {answer:?}"
        );
        // The broker closes first (take-over): DISCONNECT, then a Close frame.
        let mut c = setup.connected(Kind::Ws, &id, 60, &Props::new());
        let _new = setup.connected(Kind::Tcp, &id, 60, &Props::new());
        let AnyWire::Ws(ws) = &mut c.wire else {
            unreachable!()
        };
        let mut got = Vec::new();
        let close = loop {
            match ws.0.read() {
                Ok(Message::Binary(data)) => got.extend_from_slice(&data),
                Ok(Message::Close(frame)) => break Ok(frame),
                Ok(_) => {}
                Err(e) => break Err(e.to_string()),
            }
        };
        assert_eq!(got.first(), Some(&0xE0), "{id}: {got:02x?}");
        assert_eq!(got.get(2), Some(&0x8E), "{id}: {got:02x?}");
        assert!(
            close.is_ok(),
            "{id}: a Close frame after the DISCONNECT: {close:?}"
        );
    }
}

/// 2,000 clients at once each send a malformed packet and write on: each
/// reads its DISCONNECT 0x81 whole; clients that then neither write nor
/// close are closed after the 1 s linger, and the broker's descriptors and
/// memory come back to where they were.
#[test]
fn a_flood_of_closing_clients_leaves_descriptors_and_memory_where_they_were() {
    const CLIENTS: usize = 2000;
    let broker = Broker::two_shards(&[]);
    // Warm up: the shards' first connections allocate their pools.
    let warm: Vec<_> = (0..100).map(|_| RawClient::connect(broker.mqtt)).collect();
    drop(warm);
    thread::sleep(Duration::from_millis(500));
    let (fds_before, rss_before) = (broker.fd_count(), broker.rss_kib());
    let mut clients: Vec<RawClient> = (0..CLIENTS)
        .map(|_| {
            let mut c = RawClient::connect(broker.mqtt);
            let (header, reason) = c.handshake(&packet::connect("", true, 60, &Props::new()));
            assert_eq!((header, reason), (0, 0), "session present, reason code");
            c
        })
        .collect();
    let mut bad = wire::packet(0x36, &[0, 1, b't', 0, 1, 0]);
    bad.extend([0xC0, 0x00].repeat(2048));
    for c in &mut clients {
        c.try_send(&bad).expect("the malformed packet is written");
    }
    for c in &mut clients {
        c.try_send(&filler())
            .expect("a write after the DISCONNECT was sent");
    }
    let read_at = Instant::now();
    for (i, c) in clients.iter_mut().enumerate() {
        match c.read(WAIT) {
            Incoming::Packet { header: 0xE0, body } => {
                assert_eq!(body.first(), Some(&0x81), "client {i}")
            }
            other => panic!("client {i}: {other:02x?}"),
        }
    }
    // The broker ended its sending side: each reads the end of the stream.
    for (i, c) in clients.iter_mut().enumerate() {
        assert_eq!(c.read(WAIT), Incoming::Closed, "client {i}");
    }
    let peak = broker.fd_count();
    // No client closed: the broker closes them when the linger ends.
    let deadline = read_at + Duration::from_secs(5);
    let fds_after = loop {
        let fds = broker.fd_count();
        if fds <= fds_before + 10 || Instant::now() > deadline {
            break fds;
        }
        thread::sleep(Duration::from_millis(100));
    };
    let closed_in = read_at.elapsed();
    let rss_after = broker.rss_kib();
    eprintln!(
        "descriptors {fds_before} -> peak {peak} -> {fds_after} in {closed_in:?}; RSS {rss_before} KiB -> {rss_after} KiB"
    );
    assert!(
        fds_after <= fds_before + 10,
        "descriptors {fds_before} before, {fds_after} after {closed_in:?}"
    );
    assert!(
        rss_after <= rss_before + 32 * 1024,
        "RSS {rss_before} KiB before, {rss_after} KiB after the flood"
    );
}
