//! The local store compacted while the broker serves (DESIGN.md §7,
//! `store.max_bytes`): the log is kept near what is live, a store full of
//! live data refuses publishes and takes them again once space is freed,
//! and SIGKILL in a loop while compactions run loses nothing acknowledged.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::{Duration, Instant};

use bytes::Bytes;
use rumqttc::v5::mqttbytes::v5::PubAckReason;

use crate::clients::{unique, v4, v5, WAIT};
use crate::harness::Broker;
use crate::store::{
    kill, local, publish_from_until_killed, resume_and_check, v5_persistent, TempDir,
};

/// Bytes of the store's snapshot and segments in `dir`.
fn log_bytes(dir: &Path) -> u64 {
    let mut total = 0;
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() {
            total += std::fs::read_dir(&path)
                .unwrap()
                .flatten()
                .map(|e| e.metadata().map_or(0, |m| m.len()))
                .sum::<u64>();
        } else if entry.file_name().to_string_lossy().starts_with("snapshot-") {
            total += entry.metadata().map_or(0, |m| m.len());
        }
    }
    total
}

/// Waits until `fleetmq_store_compactions_total` reaches `n`.
async fn wait_for_compactions(broker: &Broker, n: f64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while broker.metric_sum("fleetmq_store_compactions_total") < n {
        assert!(
            Instant::now() < deadline,
            "no compaction: {}",
            broker.stderr()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Publish `n` values of `size` bytes at QoS 1 to `topic`, one at a time,
/// each acknowledged with success.
async fn publish_acknowledged(client: &mut v5::Client, topic: &str, n: usize, size: usize) {
    for i in 0..n {
        let mut value = format!("{i} ").into_bytes();
        value.resize(size, b'x');
        client
            .client
            .publish(topic, v5::QoS::AtLeastOnce, false, value)
            .await
            .unwrap();
        match client
            .wait_for("PUBACK", |p| matches!(p, v5::Packet::PubAck(_)))
            .await
        {
            v5::Packet::PubAck(ack) => assert_eq!(ack.reason, PubAckReason::Success, "value {i}"),
            _ => unreachable!(),
        }
    }
}

/// While the broker serves, values nobody keeps (acknowledged, replaced
/// retained values) leave the log: after 6 MB of such values the store
/// holds a few hundred kilobytes, and what is live (a persistent session's
/// queued values, the last retained value) survives SIGKILL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_log_is_compacted_while_serving_to_what_is_live() {
    let dir = TempDir::new("compact");
    let extra = ["--set", "store.max_bytes=16MiB"];
    let broker = local(&dir.0, &extra);
    let port = broker.mqtt_port();
    let (id, topic) = (unique("compactsub"), unique("compact/t"));
    let (mut sub, _) = v5::Client::connect_with(v5_persistent(port, &id)).await;
    sub.subscribe(&format!("{topic}/kept"), v5::QoS::AtLeastOnce)
        .await;
    sub.disconnect().await;
    tokio::task::block_in_place(|| broker.wait_for_clients(0, WAIT));

    let mut publisher = v5::Client::connect(port, &unique("compactpub")).await;
    for value in ["first", "second"] {
        publisher
            .client
            .publish(format!("{topic}/r"), v5::QoS::AtLeastOnce, true, value)
            .await
            .unwrap();
        publisher
            .wait_for("PUBACK", |p| matches!(p, v5::Packet::PubAck(_)))
            .await;
    }
    publish_acknowledged(&mut publisher, &format!("{topic}/kept"), 10, 16).await;
    publish_acknowledged(&mut publisher, &format!("{topic}/noise"), 1500, 4096).await;
    wait_for_compactions(&broker, 1.0).await;
    // Compaction is due once 2 MiB (an eighth of max_bytes) are new.
    let bytes = log_bytes(&dir.0);
    assert!(
        bytes < 4 << 20,
        "{bytes} bytes of log after 6 MB of values nobody keeps"
    );
    let live = broker.metric_sum("fleetmq_store_snapshot_bytes");
    assert!(live > 0.0 && live < 64_000.0, "snapshot of {live} bytes");
    eprintln!(
        "log {bytes} bytes, snapshot {live} bytes, {} compactions",
        broker.metric_sum("fleetmq_store_compactions_total")
    );
    kill(broker);

    let broker = local(&dir.0, &extra);
    let (mut sub, connack) = v5::Client::connect_with(v5_persistent(broker.mqtt_port(), &id)).await;
    assert!(
        matches!(connack, v5::Packet::ConnAck(ref c) if c.session_present),
        "{connack:?}"
    );
    for i in 0..10 {
        let got = sub.next_publish().await;
        assert!(
            got.payload.starts_with(format!("{i} ").as_bytes()),
            "value {i} in order: {:?}",
            got.payload
        );
    }
    sub.expect_no_publish(Duration::from_millis(300)).await;
    let mut fresh = v5::Client::connect(broker.mqtt_port(), &unique("compactfresh")).await;
    fresh
        .subscribe(&format!("{topic}/r"), v5::QoS::AtLeastOnce)
        .await;
    assert_eq!(fresh.next_publish().await.payload, Bytes::from("second"));
    fresh.expect_no_publish(Duration::from_millis(300)).await;
}

/// `store.max_bytes` bounds what is live: when values a persistent session
/// keeps fill it, MQTT 5 publishes get PUBACK 0x97 Quota exceeded, an
/// MQTT 3.1.1 publisher is disconnected, readiness answers 503 naming the
/// bound; left idle, the full store is not compacted again and again
/// (at most twice in 6 s); the session can still resume and take its values, which frees
/// the space, and the broker takes publishes again by itself. Every
/// value that got a successful PUBACK was delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_full_of_live_values_refuses_publishes_until_they_are_taken() {
    let dir = TempDir::new("full");
    let broker = local(
        &dir.0,
        &[
            "--set",
            "store.max_bytes=1MiB",
            "--set",
            "limits.max_subscriber_queue=100000",
        ],
    );
    let port = broker.mqtt_port();
    let (id, topic) = (unique("fullsub"), unique("full/t"));
    let (mut sub, _) = v5::Client::connect_with(v5_persistent(port, &id)).await;
    sub.subscribe(&topic, v5::QoS::AtLeastOnce).await;
    sub.disconnect().await;
    tokio::task::block_in_place(|| broker.wait_for_clients(0, WAIT));

    let mut publisher = v5::Client::connect(port, &unique("fullpub")).await;
    let mut accepted = Vec::new();
    let mut refused = false;
    for i in 0..1000u32 {
        let mut value = format!("{i} ").into_bytes();
        value.resize(8 << 10, b'x');
        publisher
            .client
            .publish(&topic, v5::QoS::AtLeastOnce, false, value)
            .await
            .unwrap();
        match publisher
            .wait_for("PUBACK", |p| matches!(p, v5::Packet::PubAck(_)))
            .await
        {
            v5::Packet::PubAck(ack) if ack.reason == PubAckReason::Success => accepted.push(i),
            v5::Packet::PubAck(ack) => {
                assert_eq!(ack.reason, PubAckReason::QuotaExceeded);
                refused = true;
                break;
            }
            _ => unreachable!(),
        }
    }
    assert!(
        refused,
        "1 MiB of live values was never refused: {} accepted",
        accepted.len()
    );
    assert!(
        (50..=128).contains(&accepted.len()),
        "{} values of 8 KiB accepted under 1 MiB",
        accepted.len()
    );
    let (status, body) = broker.admin_get("/health/ready");
    assert_eq!(status, 503, "{body}");
    assert!(
        body.contains("store full") && body.contains("store.max_bytes = 1048576"),
        "{body}"
    );
    // Full and idle: nothing written could free space, so the live values
    // are not rewritten again and again (was: a compaction every second,
    // each roll's new segment headers counting as something new).
    let before = broker.metric_sum("fleetmq_store_compactions_total");
    tokio::time::sleep(Duration::from_secs(6)).await;
    let idle = broker.metric_sum("fleetmq_store_compactions_total") - before;
    assert!(
        idle <= 2.0,
        "{idle} compactions in 6 s of a full, idle store: {}",
        broker.stderr()
    );
    assert_eq!(broker.admin_get("/health/ready").0, 503);
    // MQTT 3.1.1 has no reason code: the connection is closed.
    let mut old = v4::Client::connect(port, &unique("full311")).await;
    old.client
        .publish(&topic, v4::QoS::AtLeastOnce, false, "refused")
        .await
        .unwrap();
    assert!(old.closed_with(WAIT).await.is_some());

    // The session resumes while the store is full, and takes its values.
    let (mut sub, connack) = v5::Client::connect_with(v5_persistent(port, &id)).await;
    assert!(
        matches!(connack, v5::Packet::ConnAck(ref c) if c.session_present),
        "{connack:?}"
    );
    let mut got = BTreeSet::new();
    while let Some(p) = sub.try_next_publish(Duration::from_secs(2)).await {
        let text = String::from_utf8_lossy(&p.payload).into_owned();
        got.insert(text.split(' ').next().unwrap().parse::<u32>().unwrap());
    }
    for i in &accepted {
        assert!(got.contains(i), "value {i} was acknowledged and is lost");
    }
    crate::store::ready_again(&broker).await;
    publisher
        .client
        .publish(&topic, v5::QoS::AtLeastOnce, false, "after")
        .await
        .unwrap();
    match publisher
        .wait_for("PUBACK", |p| matches!(p, v5::Packet::PubAck(_)))
        .await
    {
        v5::Packet::PubAck(ack) => assert_eq!(ack.reason, PubAckReason::Success),
        _ => unreachable!(),
    }
    assert_eq!(sub.next_publish().await.payload, Bytes::from("after"));
    assert!(
        broker.stderr().contains("publishes accepted"),
        "{}",
        broker.stderr()
    );
}

/// SIGKILL in a loop while compactions run (a second publisher's 1 KiB
/// values, which nobody keeps, make one due every MiB of log), each kill
/// while one runs (`fleetmq_store_compacting`): over eight kills a
/// persistent subscriber that was away gets every value that
/// was acknowledged, in publish order (DESIGN.md §7) [MQTT-4.3.2-3].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_during_compactions_loses_nothing_acknowledged() {
    let dir = TempDir::new("killcompact");
    let extra = [
        "--set",
        "store.max_bytes=8MiB",
        "--set",
        "limits.max_subscriber_queue=1000000",
    ];
    let (id, topic) = (unique("kcsub"), unique("kc/t"));
    let broker = local(&dir.0, &extra);
    let (mut sub, _) = v4::Client::connect_with(v4::options(broker.mqtt_port(), &id, false)).await;
    sub.subscribe(&topic, v4::QoS::AtLeastOnce).await;
    sub.disconnect().await;
    tokio::task::block_in_place(|| broker.wait_for_clients(0, WAIT));
    let (mut acked, mut compactions) = (BTreeSet::new(), 0.0);
    let mut broker = Some(broker);
    for round in 0..8u64 {
        let b = broker.take().unwrap_or_else(|| local(&dir.0, &extra));
        let port = b.mqtt_port();
        // Values stored but not acknowledged before a kill are not sent
        // again: each round numbers its own.
        let next = round * 1_000_000;
        let kept = tokio::spawn({
            let topic = topic.clone();
            async move { publish_from_until_killed(port, &topic, v4::QoS::AtLeastOnce, next, 0).await }
        });
        let noise = tokio::spawn({
            let topic = format!("{topic}/noise");
            async move { publish_from_until_killed(port, &topic, v4::QoS::AtLeastOnce, 0, 1024).await }
        });
        // Kill while a compaction runs, at a different point each round:
        // in the first one of the process, or in a later one (after one
        // replaced the files).
        if round % 2 == 1 {
            wait_for_compactions(&b, 1.0).await;
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while b.metric_sum("fleetmq_store_compacting") < 1.0 {
            assert!(Instant::now() < deadline, "no compaction: {}", b.stderr());
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        tokio::time::sleep(Duration::from_millis(7 * round)).await;
        compactions += b.metric_sum("fleetmq_store_compactions_total");
        kill(b);
        acked.extend(kept.await.unwrap());
        noise.await.unwrap();
    }
    assert!(
        acked.len() > 300,
        "the load ran: {} values acknowledged",
        acked.len()
    );

    let broker = local(&dir.0, &extra);
    let received = resume_and_check(&broker, &id, &acked).await;
    eprintln!(
        "{compactions} compactions finished over 8 kills; acknowledged {}, received {}",
        acked.len(),
        received.len()
    );
}
