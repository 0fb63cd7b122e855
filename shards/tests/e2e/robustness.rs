//! A stopped subscriber (one that never reads its socket) must not stall
//! the publisher or the other subscribers, and must not make the broker's
//! memory grow without bound: its queue fills to
//! `limits.max_subscriber_queue`, then the oldest messages are dropped and
//! counted (DESIGN.md §9; issue 4, Robustness).

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use crate::clients::{unique, WAIT};
use crate::harness::Broker;
use crate::mqtt5::{metric_with, packet, Client, QUIET};

use packet::Props;

/// The inode of the socket listening on TCP `port` on 127.0.0.1.
fn listening_inode(port: u16) -> u64 {
    let table = std::fs::read_to_string("/proc/net/tcp").expect("/proc/net/tcp");
    let local = format!("0100007F:{port:04X}");
    for line in table.lines().skip(1) {
        let fields: Vec<&str> = line.split_whitespace().collect();
        // local_address rem_address st ... inode (field 9); st 0A is LISTEN.
        if fields.len() > 9 && fields[1] == local && fields[3] == "0A" {
            return fields[9].parse().expect("an inode");
        }
    }
    panic!("no socket listens on 127.0.0.1:{port}")
}

/// The pid of the process that holds the listening socket of
/// `broker.mqtt` (the harness keeps its child's pid to itself).
fn broker_pid(broker: &Broker) -> u32 {
    let needle = format!("socket:[{}]", listening_inode(broker.mqtt_port()));
    let candidates: Vec<u32> = std::fs::read_dir("/proc")
        .expect("/proc")
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    let owns = |pid: u32| {
        std::fs::read_dir(format!("/proc/{pid}/fd")).is_ok_and(|fds| {
            fds.filter_map(Result::ok).any(|fd| {
                std::fs::read_link(fd.path()).is_ok_and(|l| l.to_string_lossy() == needle)
            })
        })
    };
    candidates
        .into_iter()
        .find(|&pid| owns(pid))
        .expect("the broker process holds its listening socket")
}

/// VmRSS of `pid`, KiB.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("VmRSS in /proc/PID/status")
}

/// An MQTT 5 subscriber at QoS 1 on `topic` with a small receive buffer
/// that reads its CONNACK and SUBACK and then never reads again.
fn stopped_subscriber(addr: SocketAddr, topic: &str) -> TcpStream {
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    socket.connect(&addr.into()).expect("connect");
    let mut stream: TcpStream = socket.into();
    stream
        .write_all(&packet::connect(&unique("stopped"), true, 0, &Props::new()))
        .unwrap();
    stream
        .write_all(&packet::subscribe(1, &[(topic, 1)], Some(&Props::new())))
        .unwrap();
    // CONNACK and SUBACK, each with a one-byte Remaining Length here.
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut seen = Vec::new();
    let mut chunk = [0u8; 64];
    loop {
        let first_len = seen.get(1).map(|&len| 2 + usize::from(len));
        let second = first_len.and_then(|at| Some((seen.get(at)?, seen.get(at + 1)?)));
        if let Some((&header, &len)) = second {
            assert_eq!(
                (seen[0], header),
                (0x20, 0x90),
                "CONNACK then SUBACK: {seen:02x?}"
            );
            if seen.len() >= first_len.unwrap() + 2 + usize::from(len) {
                break;
            }
        }
        let n = stream.read(&mut chunk).expect("CONNACK and SUBACK");
        assert!(n > 0, "closed before SUBACK: {seen:02x?}");
        seen.extend_from_slice(&chunk[..n]);
    }
    stream
}

/// Messages of each QoS the publisher sends in
/// [`stopped_subscriber_stalls_nobody_and_memory_stays_bounded`].
const MESSAGES: usize = 4000;

/// Payload bytes of each message.
const PAYLOAD_BYTES: usize = 16 * 1024;

/// How far (messages) the publisher may run ahead of the reading
/// subscriber: half of `limits.max_client_writes_pending`.
const READER_LAG: usize = 50;

/// What the stopped subscriber is sent in all, MiB.
const SENT_MIB: u64 = (2 * MESSAGES * PAYLOAD_BYTES / (1024 * 1024)) as u64;

/// A subscriber that never reads, while a publisher sends 4,000 QoS 1 and
/// 4,000 QoS 0 messages of 16 KiB (125 MiB for it), each QoS 0 followed by
/// a QoS 1 whose PUBACK it awaits, and never more than [`READER_LAG`]
/// ahead of a reading subscriber: every PUBACK comes within 1 s, a reading
/// subscriber gets every message, the broker's RSS grows by less than half
/// of what the stopped subscriber was sent (measured: ~30 MiB with a queue
/// of 500 and 100 writes pending; it stays there for 8,000 messages), and
/// the drops are counted in
/// `fleetmq_messages_dropped_total{reason="queue_full"}`.
#[test]
fn stopped_subscriber_stalls_nobody_and_memory_stays_bounded() {
    let broker = Broker::two_shards(&[
        "--set",
        "limits.max_subscriber_queue=500",
        "--set",
        "limits.max_client_writes_pending=100",
    ]);
    let pid = broker_pid(&broker);
    let topic = unique("flood");
    let _stopped = stopped_subscriber(broker.mqtt, &topic);
    let mut reader = Client::v5(broker.mqtt, &unique("reader"), true, Props::new());
    reader.subscribe(&topic, 1);
    let received = Arc::new(AtomicUsize::new(0));
    let counter = received.clone();
    let counting = thread::spawn(move || {
        let mut got = BTreeSet::new();
        let mut quiet_since = Instant::now();
        while quiet_since.elapsed() < Duration::from_millis(1500) {
            if let Some(p) = reader.recv(QUIET) {
                got.insert(String::from_utf8_lossy(&p.payload[..12]).into_owned());
                counter.store(got.len(), Ordering::Relaxed);
                quiet_since = Instant::now();
            }
        }
        got
    });
    let mut publisher = Client::v5(broker.mqtt, &unique("pub"), true, Props::new());
    let rss_before = rss_kib(pid);
    let started = Instant::now();
    let mut slowest_ack = Duration::ZERO;
    let mut payload = vec![b'.'; PAYLOAD_BYTES];
    for i in 0..MESSAGES {
        // The reading subscriber is a debug-built test thread: keep the
        // publisher at most READER_LAG messages ahead of it, so that what
        // it misses can only be the stopped subscriber's doing.
        let lag_since = Instant::now();
        while 2 * i > received.load(Ordering::Relaxed) + READER_LAG {
            assert!(
                lag_since.elapsed() < WAIT,
                "the reading subscriber stalled at {}",
                2 * i
            );
            thread::sleep(Duration::from_micros(200));
        }
        payload[..12].copy_from_slice(format!("q0-{i:09}").as_bytes());
        publisher.publish(&topic, 0, false, Props::new(), &payload);
        payload[..12].copy_from_slice(format!("q1-{i:09}").as_bytes());
        let sent = Instant::now();
        assert_eq!(
            publisher.publish(&topic, 1, false, Props::new(), &payload),
            0
        );
        slowest_ack = slowest_ack.max(sent.elapsed());
    }
    let publishing = started.elapsed();
    let rss_after = rss_kib(pid);
    let got = counting.join().expect("the reading subscriber");
    let dropped = metric_with(
        &broker,
        "fleetmq_messages_dropped_total",
        "reason=\"queue_full\"",
    );

    assert!(
        slowest_ack < Duration::from_secs(1),
        "a PUBACK took {slowest_ack:?}"
    );
    assert!(
        publishing < Duration::from_secs(30),
        "publishing took {publishing:?}"
    );
    for qos in 0..=1 {
        let missing: Vec<usize> = (0..MESSAGES)
            .filter(|i| !got.contains(&format!("q{qos}-{i:09}")))
            .collect();
        assert!(
            missing.is_empty(),
            "the reading subscriber missed {} of {MESSAGES} QoS {qos} messages, first {:?}",
            missing.len(),
            &missing[..missing.len().min(10)]
        );
    }
    let grown_mib = rss_after.saturating_sub(rss_before) / 1024;
    assert!(
        grown_mib < SENT_MIB / 2,
        "broker RSS grew by {grown_mib} MiB ({rss_before} -> {rss_after} KiB) for {SENT_MIB} MiB sent to a stopped subscriber"
    );
    assert!(dropped > 0.0, "no drop counted for the stopped subscriber");
}
