//! Connection and abuse limits (DESIGN.md §9; issue 5), each reached from
//! outside: the specified refusal, the refusal counted in
//! `fleetmq_connect_refused_total{reason}`, and the broker still serving
//! everyone else. Out-of-range values stop the start, naming key and range.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

use crate::clients::{unique, WAIT};
use crate::harness::{run_with_timeout, Broker};
use crate::mqtt5::packet::{self, Props};
use crate::mqtt5::Client;
use crate::raw::{Incoming, RawClient};
use crate::security::{assert_refused, passwd, refused, set, set_str, start, Login, TempDir};

/// Opens `n` TCP connections that send nothing.
fn silent_connections(addr: SocketAddr, n: usize) -> Vec<TcpStream> {
    (0..n)
        .map(|i| TcpStream::connect(addr).unwrap_or_else(|e| panic!("connection {i}: {e}")))
        .collect()
}

/// Whether the broker has closed `stream` (EOF or reset), without waiting.
fn is_closed(stream: &TcpStream) -> bool {
    stream.set_nonblocking(true).unwrap();
    let mut byte = [0u8; 1];
    let closed = match stream.peek(&mut byte) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) if e.kind() == ErrorKind::WouldBlock => false,
        Err(_) => true,
    };
    stream.set_nonblocking(false).unwrap();
    closed
}

/// Waits (at most 5 s) until `expected` of `streams` are closed, then a
/// little longer to catch any more; returns how many are closed.
fn closed_count(streams: &[TcpStream], expected: usize) -> usize {
    let count = || streams.iter().filter(|s| is_closed(s)).count();
    let deadline = Instant::now() + Duration::from_secs(5);
    while count() < expected && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(50));
    }
    thread::sleep(Duration::from_millis(300));
    count()
}

/// Sends a CONNECT on a fresh connection: the CONNACK reason code, or
/// `None` when the broker closes without one.
fn try_connect(addr: SocketAddr, login: &Login) -> Option<u8> {
    let mut raw = RawClient::connect(addr);
    raw.send(&login.encode());
    match raw.read(WAIT) {
        Incoming::Packet { header: 0x20, body } => Some(body[1]),
        Incoming::Closed => None,
        other => panic!("expected CONNACK or a close, got {other:02x?}"),
    }
}

/// Retries a CONNECT for at most 5 s until it is accepted.
fn connects_within_5_s(addr: SocketAddr, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match try_connect(addr, &Login::v5(&unique("late"))) {
            Some(0) => return,
            other => assert!(
                Instant::now() < deadline,
                "{what}: still refused ({other:?}) after 5 s"
            ),
        }
        thread::sleep(Duration::from_millis(100));
    }
}

/// A publisher and a subscriber exchange a message: the broker serves.
fn still_serves(addr: SocketAddr) {
    let topic = unique("still");
    let mut sub = Client::v5(addr, &unique("still-sub"), true, Props::new());
    sub.subscribe(&topic, 1);
    let mut publisher = Client::v5(addr, &unique("still-pub"), true, Props::new());
    assert_eq!(publisher.publish(&topic, 1, false, Props::new(), b"ok"), 0);
    assert_eq!(sub.expect_publish().text(), "ok");
}

/// 300 silent connections from 127.0.0.1 with
/// `max_connections_per_source = 200` (enforced with
/// `trust_client_addresses`): the 100 beyond are closed at once, a
/// well-behaved client from the same address is refused while the 200 stay,
/// and gets in once they are gone.
#[test]
fn connections_beyond_max_connections_per_source_are_closed_until_the_others_go() {
    let mut args = Vec::new();
    set(&mut args, "limits.max_connections_per_source", "200");
    set(&mut args, "limits.trust_client_addresses", "true");
    set(&mut args, "limits.connect_timeout", "60s");
    let broker = start(&args);
    let conns = silent_connections(broker.mqtt, 300);
    assert_eq!(
        closed_count(&conns, 100),
        100,
        "exactly the 100 beyond the limit"
    );
    assert_eq!(
        try_connect(broker.mqtt, &Login::v5(&unique("polite"))),
        None,
        "the address is at its limit"
    );
    assert_refused(&broker, "max_connections_per_source", 101.0);
    drop(conns);
    connects_within_5_s(broker.mqtt, "after the silent connections closed");
    still_serves(broker.mqtt);
}

/// `max_clients = 3`: the fourth client gets CONNACK 0x89 Server busy
/// (3.1.1: 3, Server unavailable); when one leaves, the next gets in.
#[test]
fn a_client_beyond_max_clients_is_refused_with_0x89_server_busy() {
    let mut args = Vec::new();
    set(&mut args, "limits.max_clients", "3");
    let broker = start(&args);
    let addr = broker.mqtt;
    let first = Client::v5(addr, &unique("c1"), true, Props::new());
    let _second = Client::v5(addr, &unique("c2"), true, Props::new());
    let mut third = Client::v5(addr, &unique("c3"), true, Props::new());
    assert_eq!(Login::v5(&unique("c4")).reason(addr), 0x89);
    assert_eq!(Login::v311(&unique("c4")).reason(addr), 3);
    assert_refused(&broker, "max_clients", 2.0);
    let topic = unique("full");
    third.subscribe(&topic, 1);
    third.publish(&topic, 1, false, Props::new(), b"still served");
    assert_eq!(third.expect_publish().text(), "still served");
    first.disconnect();
    connects_within_5_s(addr, "after a client left");
}

/// `max_pending_connections = 5`, one shard: of 10 connections that send
/// nothing (5, and 5 more once the broker has the first), the 5 oldest are closed to make room for the newest
/// (`pending_evicted`), and a client still gets in at once, making room
/// too. 5 connections that are sending large CONNECTs at a pace that
/// finishes within `connect_timeout` keep their places: a sixth is closed
/// at once (`max_pending_connections`). Connected clients never count.
/// The log accounts for every refusal by the time the broker stops: the
/// burst's first at once, the rest counted in a later line.
#[test]
fn at_max_pending_connections_the_oldest_silent_ones_make_room() {
    let mut args = vec!["--shards".to_owned(), "1".to_owned()];
    set(&mut args, "limits.max_pending_connections", "5");
    set(&mut args, "limits.connect_timeout", "60s");
    let broker = start(&args);
    let mut bystander = Client::v5(broker.mqtt, &unique("bystander"), true, Props::new());
    // The kernel hands a silent connection over after a second
    // (TCP_DEFER_ACCEPT), those of one second in no set order: five, then
    // five more once the broker has the first.
    let mut conns = silent_connections(broker.mqtt, 5);
    thread::sleep(Duration::from_millis(1_500));
    conns.extend(silent_connections(broker.mqtt, 5));
    assert_eq!(closed_count(&conns, 5), 5);
    assert!(conns[..5].iter().all(is_closed), "the 5 oldest made room");
    assert_refused(&broker, "pending_evicted", 5.0);
    assert_eq!(
        try_connect(broker.mqtt, &Login::v5(&unique("device"))),
        Some(0),
        "at once"
    );
    assert_eq!(
        closed_count(&conns[5..], 1),
        1,
        "one of the oldest left made room for it"
    );
    assert_refused(&broker, "pending_evicted", 6.0);
    let topic = unique("pending");
    bystander.subscribe(&topic, 1);
    bystander.publish(
        &topic,
        1,
        false,
        Props::new(),
        b"connected clients are not pending",
    );
    assert_eq!(
        bystander.expect_publish().text(),
        "connected clients are not pending"
    );
    drop(conns);
    thread::sleep(Duration::from_millis(300));

    // Five large CONNECTs (60 KB wills), 2 KB every 100 ms each: all of
    // it within 3 s, well within the timeout.
    let will = vec![b'w'; 60_000];
    let ids: Vec<String> = (0..5).map(|_| unique("large")).collect();
    let connects: Vec<Vec<u8>> = ids
        .iter()
        .map(|id| {
            Login {
                will: Some(("wills/large", &will, false)),
                ..Login::v5(id)
            }
            .encode()
        })
        .collect();
    let mut senders: Vec<TcpStream> = (0..5)
        .map(|_| TcpStream::connect(broker.mqtt).unwrap())
        .collect();
    let started = Instant::now();
    let mut sent = 0;
    // Past the first second (the benefit of the doubt), on the pace alone.
    while started.elapsed() < Duration::from_millis(1_500) {
        for (stream, connect) in senders.iter_mut().zip(&connects) {
            stream.write_all(&connect[sent..sent + 2_000]).unwrap();
        }
        sent += 2_000;
        thread::sleep(Duration::from_millis(100));
    }
    // Its first byte, so that the kernel hands it over at once.
    let mut sixth = TcpStream::connect(broker.mqtt).unwrap();
    sixth.write_all(&[0x10]).unwrap();
    assert_eq!(
        closed_count(std::slice::from_ref(&sixth), 1),
        1,
        "every pending connection is progressing"
    );
    assert!(senders.iter().all(|s| !is_closed(s)));
    assert_refused(&broker, "max_pending_connections", 1.0);
    for (stream, connect) in senders.iter_mut().zip(&connects) {
        stream.write_all(&connect[sent..]).unwrap();
        let mut connack = [0u8; 4];
        stream.set_read_timeout(Some(WAIT)).unwrap();
        stream.read_exact(&mut connack[..2]).unwrap();
        assert_eq!(connack[0], 0x20, "a CONNACK");
    }
    drop(senders);
    let reasons = ["pending_evicted", "max_pending_connections"];
    let counted = reasons.map(|reason| refused(&broker, reason));
    let mut broker = broker;
    assert!(broker.stop_with_sigterm().success());
    for (reason, counted) in reasons.into_iter().zip(counted) {
        assert_eq!(logged_refusals(&broker, reason) as f64, counted, "{reason}");
    }
}

/// The sum of the `count` fields of the broker's "connections refused"
/// lines for `reason`, read once its last line ("stopped") is in.
fn logged_refusals(broker: &Broker, reason: &str) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(2);
    while !broker.stderr().contains("stopped") && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(10));
    }
    broker
        .stderr()
        .lines()
        .filter(|l| {
            l.contains("connections refused") && l.contains(&format!("reason=\"{reason}\""))
        })
        .map(|l| {
            let count = l.split("count=").nth(1).expect("a count field");
            count.split_whitespace().next().unwrap().parse::<u64>().expect("a number")
        })
        .sum()
}

/// Writes `bytes` on a fresh connection and asserts the broker answers
/// exactly `answer` and then closes the connection cleanly (end of stream,
/// not a reset, which could make a client lose the answer) within 1 s.
fn answered_then_closed(addr: SocketAddr, bytes: &[u8], answer: &[u8], what: &str) {
    answered_then_closed_in_parts(addr, &[bytes], answer, what);
}

/// [`answered_then_closed`] for bytes written in `parts`, 100 ms apart.
fn answered_then_closed_in_parts(addr: SocketAddr, parts: &[&[u8]], answer: &[u8], what: &str) {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.set_write_timeout(Some(WAIT)).unwrap();
    stream.set_read_timeout(Some(WAIT)).unwrap();
    for (i, part) in parts.iter().enumerate() {
        if i > 0 {
            thread::sleep(Duration::from_millis(100));
        }
        stream.write_all(part).unwrap_or_else(|e| panic!("{what}: writing the CONNECT: {e}"));
    }
    let written = Instant::now();
    let mut got = Vec::new();
    let mut buf = [0u8; 64];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                panic!("{what}: still open after 5 s")
            }
            Err(e) => panic!("{what}: {e} after {got:02x?}"),
        }
    }
    assert_eq!(got, answer, "{what}");
    assert!(written.elapsed() < Duration::from_secs(1), "{what}: closed {:?} after the last write", written.elapsed());
}

/// `max_connect_packet_bytes` (64 KiB by default; it also bounds the
/// will): a CONNECT of 1 MiB, and one whose will makes it 71 KB, get
/// CONNACK 0x95 Packet too large on MQTT 5 (§3.2.2.2) and nothing on
/// MQTT 3.1.1, which has no such code; either way the connection then
/// ends cleanly and at once. The same when the fixed header comes in a
/// write of its own; a header announcing 256 MiB and then nothing is
/// closed within a second. A 60 KB will is fine, and connected clients
/// never notice.
#[test]
fn a_connect_larger_than_max_connect_packet_bytes_is_refused() {
    let broker = start(&[]);
    let addr = broker.mqtt;
    let topic = unique("big");
    let mut bystander = Client::v5(addr, &unique("bystander"), true, Props::new());
    bystander.subscribe(&topic, 1);

    let mut props = Props::new();
    let value = "x".repeat(62_000);
    for i in 0..17 {
        props = props.user(&format!("k{i}"), &value);
    }
    let huge = packet::connect(&unique("huge"), true, 60, &props);
    assert!(huge.len() >= 1 << 20, "{} bytes", huge.len());
    const CONNACK_0X95: &[u8] = &[0x20, 0x03, 0x00, 0x95, 0x00];
    answered_then_closed(addr, &huge, CONNACK_0X95, "a 1 MiB CONNECT");

    let big_will = vec![b'w'; 65_000];
    let will_topic = "t".repeat(6_000);
    let id = unique("big-will");
    let login = Login {
        will: Some((&will_topic, &big_will, false)),
        ..Login::v5(&id)
    };
    answered_then_closed(addr, &login.encode(), CONNACK_0X95, "a 71 KB will");
    let id = unique("big-will-311");
    let login = Login {
        v5: false,
        will: Some((&will_topic, &big_will, false)),
        ..Login::v5(&id)
    };
    answered_then_closed(addr, &login.encode(), &[], "a 71 KB will over MQTT 3.1.1");
    // The fixed header of the 1 MiB CONNECT (first byte and a 3-byte
    // Remaining Length) in a write of its own, the rest 100 ms later.
    answered_then_closed_in_parts(addr, &[&huge[..4], &huge[4..]], CONNACK_0X95, "a 1 MiB CONNECT, header first");
    answered_then_closed(addr, &[0x10, 0xFF, 0xFF, 0xFF, 0x7F], &[], "a 256 MiB CONNECT header alone");
    let fine_will = vec![b'w'; 60_000];
    let id = unique("fine-will");
    Login {
        will: Some(("wills/fine", &fine_will, false)),
        ..Login::v5(&id)
    }
    .accepted(addr);

    let mut publisher = Client::v5(addr, &unique("pub"), true, Props::new());
    assert_eq!(
        publisher.publish(&topic, 1, false, Props::new(), b"unaffected"),
        0
    );
    assert_eq!(bystander.expect_publish().text(), "unaffected");
    assert_refused(&broker, "max_connect_packet_bytes", 5.0);
}

/// `connect_timeout = 1s`: a connection that sends nothing, or half a
/// CONNECT, is closed about 1 s after it was accepted; a connected client
/// is not affected.
#[test]
fn a_connection_without_a_complete_connect_is_closed_after_connect_timeout() {
    let mut args = Vec::new();
    set(&mut args, "limits.connect_timeout", "1s");
    let broker = start(&args);
    let mut good = Client::v5(broker.mqtt, &unique("good"), true, Props::new());
    let connect = Login::v5(&unique("half")).encode();
    let opened = Instant::now();
    let silent = TcpStream::connect(broker.mqtt).unwrap();
    let mut half = TcpStream::connect(broker.mqtt).unwrap();
    half.write_all(&connect[..connect.len() / 2]).unwrap();
    for (what, mut stream) in [("silent", silent), ("half a CONNECT", half)] {
        stream.set_read_timeout(Some(WAIT)).unwrap();
        let mut buf = [0u8; 16];
        let read = stream.read(&mut buf);
        let after = opened.elapsed();
        assert!(matches!(read, Ok(0) | Err(_)), "{what}: {read:?}");
        assert!(
            read.as_ref()
                .err()
                .is_none_or(|e| !matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut)),
            "{what}: still open after 5 s"
        );
        assert!(
            after >= Duration::from_millis(900) && after < Duration::from_millis(2500),
            "{what}: closed after {after:?}, connect_timeout is 1 s"
        );
    }
    assert_refused(&broker, "connect_timeout", 2.0);
    let topic = unique("good");
    good.subscribe(&topic, 1);
    good.publish(&topic, 1, false, Props::new(), b"still connected");
    assert_eq!(good.expect_publish().text(), "still connected");
}

/// Subscribes `client` to `n` filters `prefix/0..n` in SUBSCRIBEs of 100;
/// asserts every one granted at QoS 0.
fn subscribe_many(client: &mut Client, prefix: &str, n: usize) {
    let filters: Vec<String> = (0..n).map(|i| format!("{prefix}/{i}")).collect();
    for chunk in filters.chunks(100) {
        let batch: Vec<(&str, u8)> = chunk.iter().map(|f| (f.as_str(), 0)).collect();
        let codes = client.subscribe_with(&batch, Props::new());
        assert_eq!(codes, vec![0; batch.len()]);
    }
}

/// `max_subscriptions_per_client = 1000`: the 1,001st subscription gets
/// SUBACK 0x97 Quota exceeded (3.1.1: 0x80); replacing an existing one is
/// still allowed.
#[test]
fn the_1001st_subscription_is_refused_with_0x97_quota_exceeded() {
    let mut args = Vec::new();
    set(&mut args, "limits.max_subscriptions_per_client", "1000");
    let broker = start(&args);
    let prefix = unique("many");
    let mut client = Client::v5(broker.mqtt, &unique("subs"), true, Props::new());
    subscribe_many(&mut client, &prefix, 1000);
    let extra = format!("{prefix}/1000");
    assert_eq!(client.subscribe_with(&[(&extra, 0)], Props::new()), [0x97]);
    let first = format!("{prefix}/0");
    assert_eq!(
        client.subscribe_with(&[(&first, 1)], Props::new()),
        [1],
        "the same filter again replaces, it does not add"
    );
    let mut old = Client::v311(broker.mqtt, &unique("subs-311"), true);
    subscribe_many(&mut old, &prefix, 1000);
    assert_eq!(old.subscribe_with(&[(&extra, 0)], Props::new()), [0x80]);
    client.publish(&first, 1, false, Props::new(), b"subscribed");
    assert_eq!(client.expect_publish().text(), "subscribed");
}

/// `max_topic_levels = 4`, `max_topic_bytes = 32`: longer filters get
/// SUBACK 0x8F Topic Filter invalid (3.1.1: 0x80); a PUBLISH to a longer
/// topic name ends the connection with DISCONNECT 0x90 Topic Name invalid
/// (3.1.1: closed).
#[test]
fn topics_beyond_max_topic_levels_or_max_topic_bytes_are_refused() {
    let mut args = Vec::new();
    set(&mut args, "limits.max_topic_levels", "4");
    set(&mut args, "limits.max_topic_bytes", "32");
    let broker = start(&args);
    let addr = broker.mqtt;
    let (x32, x33) = ("x".repeat(32), "x".repeat(33));
    let mut c = Client::v5(addr, &unique("levels"), true, Props::new());
    let codes = c.subscribe_with(
        &[
            ("a/b/c/d", 0),
            ("a/b/c/d/e", 0),
            ("+/+/+/+/#", 0),
            (&x32, 0),
            (&x33, 0),
        ],
        Props::new(),
    );
    assert_eq!(codes, [0, 0x8F, 0x8F, 0, 0x8F]);
    let mut old = Client::v311(addr, &unique("levels-311"), true);
    assert_eq!(
        old.subscribe_with(&[("a/b/c/d/e", 0), ("a/b", 0)], Props::new()),
        [0x80, 0]
    );

    assert_eq!(c.publish("a/b/c/d", 1, false, Props::new(), b"4 levels"), 0);
    c.publish_nowait("a/b/c/d/e", 1, false, Props::new(), b"5 levels");
    assert_eq!(c.closed_with(WAIT), Some(0x90), "too many levels");
    let mut c = Client::v5(addr, &unique("bytes"), true, Props::new());
    c.publish_nowait(&x33, 0, false, Props::new(), b"33 bytes");
    assert_eq!(c.closed_with(WAIT), Some(0x90), "too many bytes");
    old.publish_nowait("a/b/c/d/e", 0, false, Props::new(), b"5 levels");
    assert_eq!(
        old.closed_with(WAIT),
        None,
        "3.1.1: closed without DISCONNECT"
    );
    still_serves(addr);
}

/// The failed sign-in throttle (`auth_failure_threshold = 3`, backoff
/// 2 s): after 3 wrong passwords for a user name, even the right password
/// is refused with 0x87 (3.1.1: 5) without being checked, from a client
/// identifier that never signed in; other users from the same address are
/// not affected (client addresses are not trusted by default); after the
/// backoff it works again.
#[test]
fn after_the_failure_threshold_even_the_right_password_is_refused_until_the_backoff_ends() {
    let dir = TempDir::new("throttle");
    let file = dir.path("passwd");
    passwd(&file, "alice", "right", None);
    passwd(&file, "bob", "bobs", None);
    let mut args = Vec::new();
    set_str(&mut args, "auth.password_file", &file.display().to_string());
    set(&mut args, "auth.allow_anonymous", "false");
    set(&mut args, "limits.auth_failure_threshold", "3");
    set(&mut args, "limits.auth_failure_backoff", "2s");
    let broker = start(&args);
    let addr = broker.mqtt;
    for attempt in 1..=3 {
        let reason = Login::v5(&unique("guess"))
            .user("alice", "guess")
            .reason(addr);
        assert_eq!(reason, 0x86, "wrong password, attempt {attempt}");
    }
    let blocked = Instant::now();
    assert_eq!(
        Login::v5(&unique("a")).user("alice", "right").reason(addr),
        0x87,
        "the 4th attempt, with the right password, within the backoff"
    );
    assert_eq!(
        Login::v311(&unique("a"))
            .user("alice", "right")
            .reason(addr),
        5
    );
    assert_eq!(
        Login::v5(&unique("b")).user("bob", "bobs").reason(addr),
        0,
        "the address does not back off: it may be a NAT in front of a fleet"
    );
    assert!(
        blocked.elapsed() < Duration::from_millis(1500),
        "checked within the backoff"
    );
    assert_refused(&broker, "bad_credentials", 3.0);
    assert_refused(&broker, "auth_throttled", 2.0);
    thread::sleep(Duration::from_millis(2300).saturating_sub(blocked.elapsed()));
    Login::v5(&unique("a"))
        .user("alice", "right")
        .accepted(addr);
}

/// `max_connections_per_credential = 2`: the third connection signed in as
/// the same user gets CONNACK 0x97 Quota exceeded (3.1.1: 3); other users
/// are not affected, and a slot given back is usable again.
#[test]
fn the_third_connection_of_a_user_is_refused_with_max_connections_per_credential_2() {
    let dir = TempDir::new("per-credential");
    let file = dir.path("passwd");
    passwd(&file, "alice", "pw", None);
    passwd(&file, "bob", "pw", None);
    let mut args = Vec::new();
    set_str(&mut args, "auth.password_file", &file.display().to_string());
    set(&mut args, "auth.allow_anonymous", "false");
    set(&mut args, "limits.max_connections_per_credential", "2");
    let broker = start(&args);
    let addr = broker.mqtt;
    let first = Login::v5(&unique("a1")).user("alice", "pw").accepted(addr);
    let _second = Login::v311(&unique("a2"))
        .user("alice", "pw")
        .accepted(addr);
    assert_eq!(
        Login::v5(&unique("a3")).user("alice", "pw").reason(addr),
        0x97
    );
    assert_eq!(
        Login::v311(&unique("a3")).user("alice", "pw").reason(addr),
        3
    );
    Login::v5(&unique("b1")).user("bob", "pw").accepted(addr);
    assert_refused(&broker, "max_connections_per_credential", 2.0);
    first.disconnect();
    let deadline = Instant::now() + Duration::from_secs(2);
    while Login::v5(&unique("a3")).user("alice", "pw").reason(addr) != 0 {
        assert!(
            Instant::now() < deadline,
            "the slot is not given back within 2 s"
        );
        thread::sleep(Duration::from_millis(100));
    }
}

/// `max_connects_authenticating = 1`: while one argon2 check runs (tens of
/// milliseconds), CONNECTs that need another get CONNACK 0x89 Server busy
/// (one user name's checks cannot make room for each other); the broker
/// keeps serving, and once the burst is over sign-in works. The user
/// name's check budget (`auth_check_rate_per_credential`) is raised out of
/// the way: it too answers 0x89, counted under its own reason.
#[test]
fn connects_beyond_max_connects_authenticating_get_0x89_server_busy() {
    let dir = TempDir::new("authenticating");
    let file = dir.path("passwd");
    passwd(&file, "alice", "pw", None);
    let mut args = Vec::new();
    set_str(&mut args, "auth.password_file", &file.display().to_string());
    set(&mut args, "auth.allow_anonymous", "false");
    set(&mut args, "limits.max_connects_authenticating", "1");
    set(&mut args, "limits.auth_check_rate_per_credential", "1000");
    let broker = start(&args);
    let addr = broker.mqtt;
    // Twenty CONNECTs written at once, each needing a password check.
    let mut clients: Vec<RawClient> = (0..20).map(|_| RawClient::connect(addr)).collect();
    for client in &mut clients {
        client.send(&Login::v5(&unique("burst")).user("alice", "pw").encode());
    }
    let reasons: Vec<Option<u8>> = clients
        .iter_mut()
        .map(|c| match c.read(WAIT) {
            Incoming::Packet { header: 0x20, body } => Some(body[1]),
            _ => None,
        })
        .collect();
    assert!(reasons.contains(&Some(0)), "some got in: {reasons:?}");
    assert!(reasons.contains(&Some(0x89)), "some were refused as busy: {reasons:?}");
    assert!(reasons.iter().all(|r| matches!(r, Some(0) | Some(0x89))), "{reasons:?}");
    let busy = reasons.iter().filter(|r| **r == Some(0x89)).count();
    assert_refused(&broker, "max_connects_authenticating", busy as f64);
    drop(clients);
    Login::v5(&unique("after")).user("alice", "pw").accepted(addr);
}

/// DESIGN.md §9: "out-of-range values stop the start with an error naming
/// the key and its range" (exit status 2, nothing bound).
#[test]
fn out_of_range_limits_refuse_to_start_naming_the_key_and_its_range() {
    let cases = [
        (
            "limits.auth_failure_threshold=0",
            "limits.auth_failure_threshold = 0 is out of range 1..=1000000",
        ),
        (
            "limits.auth_failure_backoff_max=10s",
            "limits.auth_failure_backoff_max = 10s is out of range 30s..=1d",
        ),
        (
            "limits.max_connections_per_source=0",
            "limits.max_connections_per_source = 0 is out of range 1..=10000000",
        ),
        (
            "limits.max_connections_per_credential=0",
            "limits.max_connections_per_credential = 0 is out of range 1..=10000000",
        ),
        (
            "limits.max_pending_connections=0",
            "limits.max_pending_connections = 0 is out of range 1..=1000000",
        ),
        (
            "limits.max_connects_authenticating=0",
            "limits.max_connects_authenticating = 0 is out of range 1..=1000000",
        ),
        (
            "limits.max_connect_packet_bytes=512B",
            "limits.max_connect_packet_bytes = 512B is out of range 1KiB..=16MiB",
        ),
        (
            "limits.connect_timeout=0s",
            "limits.connect_timeout = 0s is out of range 1s..=5m",
        ),
        (
            "limits.max_subscriptions_per_client=0",
            "limits.max_subscriptions_per_client = 0 is out of range 1..=1000000",
        ),
        (
            "limits.max_topic_levels=1025",
            "limits.max_topic_levels = 1025 is out of range 1..=1024",
        ),
        (
            "limits.max_topic_bytes=70000",
            "limits.max_topic_bytes = 70000 is out of range 1..=65535",
        ),
        (
            "auth.acl_cache_ttl=0s",
            "auth.acl_cache_ttl = 0s is out of range 1s..=1h",
        ),
    ];
    for (setting, message) in cases {
        let out = run_with_timeout(
            Command::new(env!("CARGO_BIN_EXE_fleetmq"))
                .args(["serve", "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0"])
                .args(["--set", "store.kind=none", "--set", setting]),
            Duration::from_secs(10),
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{setting}: {stderr}");
        assert!(
            stderr.contains(message),
            "{setting}: expected {message:?} in {stderr}"
        );
        assert!(
            !String::from_utf8_lossy(&out.stdout).contains("fleetmq: ready"),
            "{setting}: never ready"
        );
    }
}

/// A subscriber that never reads costs the broker at most about twice
/// `limits.max_client_write_bytes`: QoS 0 messages beyond it are dropped
/// and counted (`queue_full`), however large they are, and the publisher
/// is never stalled.
#[test]
fn a_subscriber_that_never_reads_holds_bounded_memory_for_large_qos0_messages() {
    use crate::harness::Broker;
    use crate::raw::wire;
    let broker = Broker::start(&["--shards", "1", "--set", "limits.max_client_write_bytes=1MiB"]);
    let topic = unique("nonreader");
    let mut sleeper = RawClient::connect(broker.mqtt);
    assert_eq!(sleeper.handshake(&wire::Connect::v311(&unique("sleeper")).encode()), (0, 0));
    sleeper.send(&wire::subscribe(1, &topic, 0, false));
    assert!(matches!(sleeper.read(WAIT), Incoming::Packet { header: 0x90, .. }));
    let mut publisher = RawClient::connect(broker.mqtt);
    assert_eq!(publisher.handshake(&wire::Connect::v311(&unique("flood")).encode()), (0, 0));
    let before = broker.rss_kib();
    let payload = vec![0x5a; 512 * 1024];
    let publish = wire::publish_qos0(&topic, &payload, false);
    // 100 × 512 KiB = 50 MiB published; loopback buffers absorb ~10 MiB.
    for _ in 0..100 {
        publisher.send(&publish);
    }
    // A PINGREQ answered means every PUBLISH before it was handled.
    publisher.send(&[0xC0, 0x00]);
    assert!(matches!(publisher.read(WAIT), Incoming::Packet { header: 0xD0, .. }), "the publisher was stalled");
    let grown = broker.rss_kib().saturating_sub(before);
    assert!(grown < 20 * 1024, "the broker grew by {grown} KiB for one subscriber that does not read");
    assert!(broker.metric_sum("fleetmq_messages_dropped_total") > 0.0, "nothing was dropped");
}

/// The same across shards: the publisher's shard holds what it routes to
/// the subscribers' shard only up to a bound in bytes, so large messages
/// from a fast publisher do not pile up there either. (The client
/// identifiers are fixed, so the owners are the same on every run: with
/// two shards, some of the four subscribers live on the other shard.)
#[test]
fn large_qos0_messages_to_another_shard_hold_bounded_memory() {
    use crate::harness::Broker;
    use crate::raw::wire;
    let broker = Broker::two_shards(&["--set", "limits.max_client_write_bytes=1MiB"]);
    let topic = unique("crossflood");
    let mut sleepers = Vec::new();
    for i in 0..4 {
        let mut sleeper = RawClient::connect(broker.mqtt);
        assert_eq!(sleeper.handshake(&wire::Connect::v311(&format!("cross-sleeper-{i}")).encode()), (0, 0));
        sleeper.send(&wire::subscribe(1, &topic, 0, false));
        assert!(matches!(sleeper.read(WAIT), Incoming::Packet { header: 0x90, .. }));
        sleepers.push(sleeper);
    }
    let mut publisher = RawClient::connect(broker.mqtt);
    assert_eq!(publisher.handshake(&wire::Connect::v311("cross-flood").encode()), (0, 0));
    let before = broker.rss_kib();
    let publish = wire::publish_qos0(&topic, &vec![0x5a; 500_000], false);
    // 400 × 500 KB = 200 MB published.
    for _ in 0..400 {
        publisher.send(&publish);
    }
    publisher.send(&[0xC0, 0x00]);
    assert!(matches!(publisher.read(WAIT), Incoming::Packet { header: 0xD0, .. }), "the publisher was stalled");
    // Dropped messages' pages go back to the system after mimalloc's purge
    // delay (10 ms of allocator activity), later on a loaded machine: what
    // counts is that memory settles under the bound, not the instant.
    let settle_by = Instant::now() + Duration::from_secs(2);
    let mut grown = broker.rss_kib().saturating_sub(before);
    while grown >= 40 * 1024 && Instant::now() < settle_by {
        thread::sleep(Duration::from_millis(50));
        grown = broker.rss_kib().saturating_sub(before);
    }
    assert!(grown < 40 * 1024, "the broker grew by {grown} KiB for subscribers that do not read");
}

/// Each listening socket's accept queue is as long as the kernel allows
/// (`net.core.somaxconn`), read back with `ss`: a fleet reconnecting at
/// once overflowed a queue of 1,024, and every SYN dropped cost its client
/// a retransmission a second later (perf/RESULTS.md, 2026-12-02,
/// session 16).
#[test]
fn listening_sockets_take_the_longest_accept_queue_the_kernel_allows() {
    let somaxconn: u32 = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
        .expect("read net.core.somaxconn")
        .trim()
        .parse()
        .expect("net.core.somaxconn is a number");
    let broker = Broker::start(&["--shards", "2"]);
    let port = broker.mqtt.port();
    let out = Command::new("ss")
        .args(["-ltnH", &format!("sport = :{port}")])
        .output()
        .expect("run ss (iproute2; scripts/test.sh installs it)");
    assert!(out.status.success(), "ss: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    // `ss -ltn` shows a listening socket's backlog in its Send-Q column.
    let backlogs: Vec<u32> = text
        .lines()
        .map(|line| line.split_whitespace().nth(2).expect("a Send-Q column").parse().expect("a number"))
        .collect();
    assert_eq!(backlogs, [somaxconn, somaxconn], "one socket per shard: {text}");
}
