//! `KV_mqtt-sessions` does not grow forever (DESIGN.md §4): the release of
//! a clean session's client identifier is a delete marker with a TTL (10 s,
//! `ownership::RELEASED_TTL`); when it expires the server writes its own
//! expiry marker, which goes after the bucket's `subject_delete_marker_ttl`
//! (5 minutes as fleetmq makes the bucket; 2 s here, set on the stream by
//! the test so that it waits seconds, not minutes), and then the client
//! identifier leaves no subject. Claims of a released client identifier
//! work at every stage: while its marker is there, while the server's is,
//! and once nothing is; a take-over across replicas still closes the old
//! connection (0x8E).
//!
//! Delete markers an older build left for good (no TTL) are written again
//! with the TTL by the leader's ownership sweep, so an existing cluster
//! sheds them too.
//!
//! Before (s36): every released client identifier left a delete marker
//! for good, one subject per client identifier that ever connected.

use std::thread;
use std::time::{Duration, Instant};

use crate::cluster::{connect_v5, expect_disconnect, replica};
use crate::nats::NatsCluster;
use crate::raw::wire as build;

/// Client identifiers that connect and disconnect cleanly.
const N: usize = 300;

/// The release marker's TTL (`ownership::RELEASED_TTL`).
const RELEASED_TTL: Duration = Duration::from_secs(10);

/// The server's expiry markers' TTL on the bucket, as the test sets it.
const MARKER_TTL: Duration = Duration::from_secs(2);

/// The subjects of `KV_mqtt-sessions` now (stream info `num_subjects`).
fn subjects(nats: &NatsCluster) -> u64 {
    stream_subjects(nats, "KV_mqtt-sessions")
}

/// The subjects of `stream` now (stream info `num_subjects`).
pub(crate) fn stream_subjects(nats: &NatsCluster, stream: &'static str) -> u64 {
    let url = nats.url(0);
    crate::nats::block_on(async move {
        let js = async_nats::jetstream::new(async_nats::connect(url).await.unwrap());
        let mut stream = js.get_stream(stream).await.unwrap();
        stream.info().await.unwrap().state.subjects_count
    })
}

/// The server's expiry markers on `KV_mqtt-sessions` last `ttl` (fleetmq
/// checks only that the bucket has them).
fn set_marker_ttl(nats: &NatsCluster, ttl: Duration) {
    set_stream_marker_ttl(nats, "KV_mqtt-sessions", ttl);
}

/// The server's expiry markers on `stream` last `ttl`.
pub(crate) fn set_stream_marker_ttl(nats: &NatsCluster, stream: &'static str, ttl: Duration) {
    let url = nats.url(0);
    crate::nats::block_on(async move {
        let js = async_nats::jetstream::new(async_nats::connect(url).await.unwrap());
        let mut stream = js.get_stream(stream).await.unwrap();
        let mut config = stream.info().await.unwrap().config.clone();
        config.subject_delete_marker_ttl = Some(ttl);
        js.update_stream(config).await.unwrap();
    });
}

/// Writes `n` delete markers without a TTL into `KV_mqtt-sessions`, as
/// releases of a build before the fix did (for good).
fn legacy_markers(nats: &NatsCluster, n: usize) {
    let url = nats.url(0);
    crate::nats::block_on(async move {
        let js = async_nats::jetstream::new(async_nats::connect(url).await.unwrap());
        for i in 0..n {
            let publish = async_nats::jetstream::message::PublishMessage::build().header("KV-Operation", "DEL");
            js.send_publish(format!("$KV.mqtt-sessions.legacy-{i}"), publish).await.unwrap().await.unwrap();
        }
    });
}

/// Connects `client_id` with MQTT 5 and disconnects it cleanly (DISCONNECT
/// 0x00, Session Expiry 0: its claim is released at once).
fn come_and_go(broker: &crate::harness::Broker, client_id: &str) {
    let (code, mut c) = connect_v5(broker, client_id);
    assert_eq!(code, 0, "CONNACK of {client_id}");
    c.send(&build::disconnect_v5(0));
}

/// Waits (at most `within`) until `KV_mqtt-sessions` has at most `most`
/// subjects; returns how long it took.
fn wait_subjects_at_most(nats: &NatsCluster, most: u64, within: Duration) -> Duration {
    wait_stream_subjects_at_most(nats, "KV_mqtt-sessions", most, within)
}

/// Waits (at most `within`) until `stream` has at most `most` subjects;
/// returns how long it took.
pub(crate) fn wait_stream_subjects_at_most(nats: &NatsCluster, stream: &'static str, most: u64, within: Duration) -> Duration {
    let started = Instant::now();
    loop {
        let now = stream_subjects(nats, stream);
        if now <= most {
            return started.elapsed();
        }
        assert!(started.elapsed() < within, "{stream} still has {now} subjects after {within:?} (at most {most} expected)");
        thread::sleep(Duration::from_millis(500));
    }
}

#[test]
fn released_client_identifiers_leave_mqtt_sessions_for_good_and_can_be_claimed_at_every_stage() {
    let nats = NatsCluster::start(3);
    let settings = ["--set", "cluster.member_ttl=5s"];
    let a = replica("ra", &nats.urls(), &settings);
    let b = replica("rb", &nats.urls(), &settings);
    set_marker_ttl(&nats, MARKER_TTL);
    // A live connection keeps its entry throughout.
    let (code, mut live) = connect_v5(&a, "stays");
    assert_eq!(code, 0);
    let base = subjects(&nats);
    assert_eq!(base, 1, "the live connection's claim");
    // A cluster that ran a build whose releases left markers for good: the
    // leader's sweep writes them again with the TTL once they are older
    // than 3 × RELEASED_TTL (its next run, within a minute).
    legacy_markers(&nats, 50);
    let legacy_at = Instant::now();
    let run = std::process::id();
    for i in 0..N {
        come_and_go(if i % 2 == 0 { &a } else { &b }, &format!("storm-{run}-{i}"));
    }
    let after_storm = subjects(&nats);
    assert!(after_storm > base, "{after_storm} subjects after {N} client identifiers came and went");
    // A client identifier released just now is claimed again over its
    // marker (on the replica it was on: a claim moved from another replica
    // is parked for the will grace, parked.rs).
    come_and_go(&a, &format!("storm-{run}-0"));
    // Gone within the marker's TTL and the server's marker's: the live
    // claim stays (and the 50 legacy markers, still young).
    let bound = RELEASED_TTL + MARKER_TTL + Duration::from_secs(15);
    let took = wait_subjects_at_most(&nats, base + 50, bound);
    eprintln!("{after_storm} subjects after the storm, the live claim and the legacy markers left after {took:?}");
    // Claimed again once nothing is left of it (a replica's guess of its
    // revision is stale by then: the claim reads the key and creates it).
    come_and_go(&b, &format!("storm-{run}-1"));
    come_and_go(&a, &format!("storm-{run}-2"));
    // Take-over across replicas still closes the old connection.
    let (code, _taker) = connect_v5(&b, "stays");
    assert_eq!(code, 0);
    expect_disconnect(&mut live, 0x8e, Duration::from_secs(3));
    // The legacy markers go after the sweep that follows their 30th
    // second (sweeps run every 60 s), their TTL and the server's marker.
    let legacy_bound = Duration::from_secs(60 + 30) + RELEASED_TTL + MARKER_TTL + Duration::from_secs(10);
    wait_subjects_at_most(&nats, base, legacy_bound.saturating_sub(legacy_at.elapsed()));
    eprintln!("legacy markers gone {:?} after they were written", legacy_at.elapsed());
}

/// Cleared retained topics and deleted wills leave `KV_mqtt-retained` and
/// `KV_mqtt-session-will` for good, as released client identifiers leave
/// `KV_mqtt-sessions`: their delete markers carry the TTL
/// (`setup::DELETED_TTL`, 10 s), then the server's expiry marker goes
/// (2 s here). Before (s37): one subject per retained topic ever cleared
/// and per client identifier that ever had a will, for good.
#[test]
fn cleared_retained_topics_and_deleted_wills_leave_their_buckets_for_good() {
    const TOPICS: usize = 50;
    let nats = NatsCluster::start(3);
    let a = replica("ra", &nats.urls(), &["--set", "cluster.member_ttl=5s"]);
    set_stream_marker_ttl(&nats, "KV_mqtt-retained", MARKER_TTL);
    set_stream_marker_ttl(&nats, "KV_mqtt-session-will", MARKER_TTL);
    let (code, mut publisher) = connect_v5(&a, "publisher");
    assert_eq!(code, 0);
    for (i, payload) in (0..TOPICS).map(|i| (i, &b"kept"[..])).chain((0..TOPICS).map(|i| (i, &b""[..]))) {
        let pid = (i + 1) as u16;
        publisher.send(&build::publish(&format!("gone/{i}"), 1, pid, (false, true), payload, true));
        match publisher.read(Duration::from_secs(10)) {
            crate::raw::Incoming::Packet { header: 0x40, body } => assert_eq!(body[..2], pid.to_be_bytes(), "PUBACK of {pid}"),
            other => panic!("PUBACK of gone/{i}: {other:?}"),
        }
    }
    // Clients with wills that disconnect normally: their wills are deleted.
    for i in 0..TOPICS {
        let mut device = crate::cluster_handover::device(&a, &format!("willing-{i}"), 0, 0);
        device.send(&build::disconnect_v5(0));
    }
    assert!(stream_subjects(&nats, "KV_mqtt-retained") > 0, "the clears are markers first");
    let bound = Duration::from_secs(10) + MARKER_TTL + Duration::from_secs(15);
    let retained = wait_stream_subjects_at_most(&nats, "KV_mqtt-retained", 0, bound);
    let wills = wait_stream_subjects_at_most(&nats, "KV_mqtt-session-will", 0, bound);
    eprintln!("{TOPICS} cleared retained topics left after {retained:?}, {TOPICS} deleted wills {wills:?} later");
}
