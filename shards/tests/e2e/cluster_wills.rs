//! A delayed will and a new connection elsewhere (MQTT 5 §3.1.2.5): the
//! Will Message is delayed "until the Will Delay Interval has passed or the
//! Session ends, whichever happens first". A CONNECT with Clean Start 1
//! ends the old session, so a pending delayed will is published at once;
//! with Clean Start 0 the session goes on and it is not sent
//! `[MQTT-3.1.3-9]`. On one node, and across replicas: the will held by the
//! replica that served the ended connection, the will of a connection open
//! when another replica takes its client identifier over, and the will of a
//! killed replica's connection that the sweeper holds.
//!
//! Short timings (`member_ttl` 5 s, `will_stop_grace` 2 s); every will has
//! a Will Delay Interval of 60 s, so "at once" is told from "when due".

use std::thread;
use std::time::{Duration, Instant};

use crate::cluster::{expect_disconnect, replica};
use crate::cluster_handover::{device, once, will_entry, wills_until, TIMING};
use crate::harness::{Broker, MosquittoSub};
use crate::nats::NatsCluster;
use crate::raw::{wire as build, RawClient};

/// The Will Delay Interval of every device here, seconds.
const DELAY: u32 = 60;

/// The replicas' settings: one NATS server, the short timings.
const ARGS: [&str; 6] = [
    "--set",
    "cluster.nats_replicas=1",
    TIMING[0],
    TIMING[1],
    TIMING[2],
    TIMING[3],
];

/// How soon a will published "at once" must arrive.
const AT_ONCE: Duration = Duration::from_secs(5);

/// A CONNECT of `id` to `broker` without a will, Session Expiry 3600 s,
/// Clean Start `clean_start`: the open client.
pub(crate) fn reconnect(broker: &Broker, id: &str, clean_start: bool) -> RawClient {
    let connect = build::Connect {
        clean: clean_start,
        session_expiry: Some(3600),
        ..build::Connect::v5(id)
    };
    let mut client = RawClient::connect(broker.mqtt);
    assert_eq!(client.handshake(&connect.encode()).1, 0, "CONNECT of {id}");
    client
}

/// Two replicas (one NATS server) with short timings, and a watcher of
/// `wills/#` on the first.
fn two_replicas() -> (NatsCluster, Broker, Broker, MosquittoSub) {
    let nats = NatsCluster::start(1);
    let a = replica("ra", &nats.urls(), &ARGS);
    let b = replica("rb", &nats.urls(), &ARGS);
    let watcher = MosquittoSub::start(&a, &["-t", "wills/#", "-v"]);
    (nats, a, b, watcher)
}

/// Waits (at most 10 s) until `client_id`'s will is out of
/// `mqtt-session-will` (sent or forgotten, not waiting).
fn will_record_gone(nats: &NatsCluster, client_id: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while will_entry(nats, client_id).as_deref() == Some("Put") {
        assert!(
            Instant::now() < deadline,
            "{client_id}: its will still waits in mqtt-session-will"
        );
        thread::sleep(Duration::from_millis(200));
    }
}

/// The will of `fresh` (back with Clean Start 1 at `t0`) arrives at once;
/// the will of `resumes` (back with Clean Start 0) never does, and is
/// forgotten, not merely waiting: its record is gone too.
fn fresh_at_once_resumes_never(nats: &NatsCluster, watcher: &mut MosquittoSub, t0: Instant) {
    let wills = wills_until(watcher, t0, AT_ONCE + Duration::from_secs(2));
    assert!(once(&wills, "wills/fresh") <= AT_ONCE, "{wills:?}");
    assert!(
        !wills.iter().any(|(t, _)| t == "wills/resumes"),
        "[MQTT-3.1.3-9]: {wills:?}"
    );
    will_record_gone(nats, "resumes");
}

#[test]
fn a_delayed_will_waiting_on_one_replica_is_sent_at_once_when_its_client_comes_back_elsewhere_with_clean_start(
) {
    let (nats, a, b, mut watcher) = two_replicas();
    // Both connections end abnormally on A: their wills wait 60 s there.
    drop((
        device(&a, "fresh", DELAY, 3600),
        device(&a, "resumes", DELAY, 3600),
    ));
    thread::sleep(Duration::from_secs(1));
    let t0 = Instant::now();
    let _fresh = reconnect(&b, "fresh", true);
    let _resumes = reconnect(&b, "resumes", false);
    fresh_at_once_resumes_never(&nats, &mut watcher, t0);
}

#[test]
fn a_connection_taken_over_from_another_replica_with_clean_start_sends_its_delayed_will_at_once() {
    let (nats, a, b, mut watcher) = two_replicas();
    let mut fresh = device(&a, "fresh", DELAY, 3600);
    let mut resumes = device(&a, "resumes", DELAY, 3600);
    let t0 = Instant::now();
    let _new = reconnect(&b, "fresh", true);
    let _again = reconnect(&b, "resumes", false);
    // [MQTT-3.1.4-3]: the old connections are closed with 0x8E.
    expect_disconnect(&mut fresh, 0x8e, Duration::from_secs(3));
    expect_disconnect(&mut resumes, 0x8e, Duration::from_secs(3));
    fresh_at_once_resumes_never(&nats, &mut watcher, t0);
}

#[test]
fn the_sweeper_sends_a_killed_replicas_delayed_will_at_once_when_its_client_came_back_with_clean_start(
) {
    let nats = NatsCluster::start(1);
    let mut a = replica("ra", &nats.urls(), &ARGS);
    let b = replica("rb", &nats.urls(), &ARGS);
    let mut watcher = MosquittoSub::start(&b, &["-t", "wills/#", "-v"]);
    // One connection ended (its will waiting 60 s on A), one still open.
    let ended = device(&a, "ended", DELAY, 3600);
    let _open = device(&a, "open", DELAY, 3600);
    let _resumes = device(&a, "resumes", DELAY, 3600);
    drop(ended);
    thread::sleep(Duration::from_secs(1));
    a.kill();
    let t0 = Instant::now();
    let _ended = reconnect(&b, "ended", true);
    let _open = reconnect(&b, "open", true);
    let _resumes = reconnect(&b, "resumes", false);
    // A is taken for gone ~7.5 s after its last write; B, the sweeper,
    // sends the two wills whose session ended then, not after their 60 s
    // delay nor after the grace.
    let wills = wills_until(&mut watcher, t0, Duration::from_secs(16));
    for topic in ["wills/ended", "wills/open"] {
        let at = once(&wills, topic);
        assert!(at <= Duration::from_secs(12), "{topic}: {at:?}");
    }
    assert!(
        !wills.iter().any(|(t, _)| t == "wills/resumes"),
        "[MQTT-3.1.3-9]: {wills:?}"
    );
}

#[test]
fn on_one_node_clean_start_sends_a_pending_delayed_will_at_once_and_a_resume_does_not() {
    let broker = Broker::start(&[]);
    let mut watcher = MosquittoSub::start(&broker, &["-t", "wills/#", "-v"]);
    drop((
        device(&broker, "fresh", DELAY, 3600),
        device(&broker, "resumes", DELAY, 3600),
    ));
    thread::sleep(Duration::from_millis(500));
    let t0 = Instant::now();
    let _fresh = reconnect(&broker, "fresh", true);
    let _resumes = reconnect(&broker, "resumes", false);
    let wills = wills_until(&mut watcher, t0, Duration::from_secs(3));
    assert!(
        once(&wills, "wills/fresh") <= Duration::from_secs(1),
        "{wills:?}"
    );
    assert!(
        !wills.iter().any(|(t, _)| t == "wills/resumes"),
        "[MQTT-3.1.3-9]: {wills:?}"
    );
}

/// How a client back on replica B after A was killed leaves (see
/// [`BackCase`]).
#[derive(Clone, Copy, PartialEq)]
enum Leave {
    Stays,
    /// DISCONNECT 0x00: its will is deleted `[MQTT-3.14.4-3]`.
    Normally,
    /// The network connection drops: its will is published
    /// `[MQTT-3.1.2-8]`, after its own delay.
    Abnormally,
}

/// A device with a will (payload `from-a`, Will Delay `a_delay` s) on A;
/// A is SIGKILLed; the device is back on B within `will_stop_grace` with
/// Clean Start `clean`, a will of its own (payload `from-b`, Will Delay
/// the given seconds) or none, then `leave`s. `expect`: the will payloads
/// that must arrive on `wills/<id>`, each exactly once.
struct BackCase {
    id: &'static str,
    a_delay: u32,
    clean: bool,
    b_will: Option<u32>,
    leave: Leave,
    expect: &'static [&'static str],
}

/// MQTT 5 §3.1.2.5 and DESIGN.md §5 for a client back on another replica
/// after its replica was killed, whether or not its new CONNECT declares
/// a will of its own (which is stored over the killed replica's record in
/// `mqtt-session-will`):
/// - the killed replica's will without a delay is not sent, the client
///   being back within the grace (DESIGN.md §5);
/// - its delayed will is not sent when the client resumes the session
///   (Clean Start 0) `[MQTT-3.1.3-9]`, and is sent once when Clean Start 1
///   ended the session ("until the Will Delay Interval has passed or the
///   Session ends, whichever happens first");
/// - the new connection's own will follows the usual rules: deleted by a
///   normal DISCONNECT `[MQTT-3.14.4-3]`, published (after its own delay)
///   when the connection drops `[MQTT-3.1.2-8]`.
#[test]
fn a_client_back_from_a_killed_replica_with_or_without_a_will_gets_exactly_the_wills_mqtt_says() {
    use Leave::*;
    let cases = [
        BackCase { id: "n-will-drop", a_delay: 0, clean: true, b_will: Some(0), leave: Abnormally, expect: &["from-b"] },
        BackCase { id: "n-will-bye", a_delay: 0, clean: true, b_will: Some(0), leave: Normally, expect: &[] },
        BackCase { id: "n-none-drop", a_delay: 0, clean: true, b_will: None, leave: Abnormally, expect: &[] },
        BackCase { id: "n-delayed-drop", a_delay: 0, clean: false, b_will: Some(2), leave: Abnormally, expect: &["from-b"] },
        BackCase { id: "d-resume-drop", a_delay: DELAY, clean: false, b_will: Some(0), leave: Abnormally, expect: &["from-b"] },
        BackCase { id: "d-resume-bye", a_delay: DELAY, clean: false, b_will: None, leave: Normally, expect: &[] },
        BackCase { id: "d-fresh-stay", a_delay: DELAY, clean: true, b_will: Some(0), leave: Stays, expect: &["from-a"] },
        BackCase { id: "d-fresh-drop", a_delay: DELAY, clean: true, b_will: Some(0), leave: Abnormally, expect: &["from-a", "from-b"] },
        BackCase { id: "d-fresh-bye", a_delay: DELAY, clean: true, b_will: Some(0), leave: Normally, expect: &["from-a"] },
    ];
    let nats = NatsCluster::start(1);
    let mut a = replica("ra", &nats.urls(), &ARGS);
    let b = replica("rb", &nats.urls(), &ARGS);
    let mut watcher = MosquittoSub::start(&b, &["-t", "wills/#", "-v"]);
    let topics: Vec<String> = cases.iter().map(|c| format!("wills/{}", c.id)).collect();
    let connect = |broker: &Broker, case: &BackCase, topic: &str, will: Option<(&'static [u8], u32)>, clean: bool| {
        let connect = build::Connect {
            will: will.map(|(payload, delay)| build::Will { topic, payload, delay_secs: Some(delay), payload_format: None }),
            clean,
            session_expiry: Some(3600),
            ..build::Connect::v5(case.id)
        };
        let mut client = RawClient::connect(broker.mqtt);
        assert_eq!(client.handshake(&connect.encode()).1, 0, "CONNECT of {}", case.id);
        client
    };
    let on_a: Vec<RawClient> =
        cases.iter().zip(&topics).map(|(c, t)| connect(&a, c, t, Some((b"from-a", c.a_delay)), true)).collect();
    // Older than the flap delay: B takes them over at once.
    thread::sleep(Duration::from_millis(1200));
    a.kill();
    drop(on_a);
    let t0 = Instant::now();
    thread::sleep(Duration::from_secs(1));
    let mut stay = Vec::new();
    for (case, topic) in cases.iter().zip(&topics) {
        let mut client = connect(&b, case, topic, case.b_will.map(|d| (&b"from-b"[..], d)), case.clean);
        match case.leave {
            Stays => stay.push(client),
            Normally => client.send(&build::disconnect_v5(0x00)),
            Abnormally => drop(client),
        }
    }
    // A is taken for gone ~7.5 s after its last write, its wills handed
    // over then; the grace (2 s) is over by ~10 s.
    let mut seen: Vec<(String, String)> = Vec::new();
    while t0.elapsed() < Duration::from_secs(16) {
        if let Some(line) = watcher.next_message(Duration::from_millis(200)) {
            let mut words = line.split_whitespace().rev();
            let (payload, topic) = (words.next().unwrap_or_default(), words.next().unwrap_or_default());
            seen.push((topic.to_owned(), payload.to_owned()));
        }
    }
    for (case, topic) in cases.iter().zip(&topics) {
        let mut got: Vec<&str> = seen.iter().filter(|(t, _)| t == topic).map(|(_, p)| p.as_str()).collect();
        got.sort_unstable();
        assert_eq!(got, case.expect, "{}: wills {seen:?}", case.id);
    }
    drop(stay);
}
