//! The format floor during a rolling upgrade (DESIGN.md §4, §6): replicas
//! write only formats all members read, and the leader raises the floor
//! when the last old one is gone; every replica follows the floor and
//! writes the newer format from then on.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use async_nats::jetstream::message::PublishMessage;
use fleetmq_core::cluster::records::{FloorRecord, Record as _};
use fleetmq_core::cluster::retained::{retained_key, RetainedRecord};

use crate::cluster::replica;
use crate::harness::Broker;
use crate::nats::NatsCluster;

/// `member_ttl` of the replicas and of the old member's entries.
const TTL: Duration = Duration::from_secs(5);

/// The replicas' settings.
const ARGS: [&str; 4] = [
    "--set",
    "cluster.nats_replicas=1",
    "--set",
    "cluster.member_ttl=5s",
];

/// A member of an older build that reads only format 1, as its entry in
/// `mqtt-members` shows it, rewritten every second (with a TTL of
/// [`TTL`]) until dropped; then it expires and the others take it for gone.
pub(crate) struct OldMember {
    running: Arc<AtomicBool>,
    beat: Option<thread::JoinHandle<()>>,
}

impl OldMember {
    pub(crate) fn start(nats: &NatsCluster) -> OldMember {
        let url = nats.url(0);
        let running = Arc::new(AtomicBool::new(true));
        let keep = running.clone();
        let started_at_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64;
        let record = serde_json::json!({
            "format": 1, "replica": "old", "instance": "0123456789abcdef", "started_at_ms": started_at_ms,
            "member_ttl_ms": TTL.as_millis() as u64, "mesh": "", "mesh_versions": [1], "reads": [1, 1],
        })
        .to_string();
        let beat = thread::spawn(move || {
            crate::nats::block_on(async move {
                let js = async_nats::jetstream::new(async_nats::connect(url).await.unwrap());
                while keep.load(Ordering::Acquire) {
                    let publish = PublishMessage::build()
                        .payload(record.clone().into())
                        .ttl(TTL);
                    js.send_publish("$KV.mqtt-members.old", publish)
                        .await
                        .unwrap()
                        .await
                        .unwrap();
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            })
        });
        // Its first entry is in before anything else happens.
        thread::sleep(Duration::from_millis(300));
        OldMember {
            running,
            beat: Some(beat),
        }
    }
}

impl Drop for OldMember {
    fn drop(&mut self) {
        self.running.store(false, Ordering::Release);
        if let Some(beat) = self.beat.take() {
            let _ = beat.join();
        }
    }
}

/// `bucket` (created by the replicas), on a new connection to `nats`.
async fn kv(url: String, bucket: &str) -> async_nats::jetstream::kv::Store {
    let js = async_nats::jetstream::new(async_nats::connect(url).await.unwrap());
    js.get_key_value(bucket).await.unwrap()
}

/// Write `value` as a KV entry of `bucket`.
pub(crate) fn put(nats: &NatsCluster, bucket: &'static str, key: &str, value: String) {
    let (url, key) = (nats.url(0), key.to_owned());
    crate::nats::block_on(
        async move { kv(url, bucket).await.put(&key, value.into()).await.unwrap() },
    );
}

/// The raw value of `key` in `bucket`.
pub(crate) fn get(nats: &NatsCluster, bucket: &'static str, key: &str) -> Option<Vec<u8>> {
    let (url, key) = (nats.url(0), key.to_owned());
    crate::nats::block_on(async move {
        kv(url, bucket)
            .await
            .get(&key)
            .await
            .unwrap()
            .map(|v| v.to_vec())
    })
}

/// The cluster's format floor as stored.
fn floor(nats: &NatsCluster) -> u16 {
    FloorRecord::decode(&get(nats, "mqtt-cluster-floor", "floor").expect("a floor"))
        .unwrap()
        .floor
}

/// Retain `payload` on `topic` through `broker` (QoS 1: acknowledged once
/// `mqtt-retained` has it), and the format of the record stored.
fn retained_format(nats: &NatsCluster, broker: &Broker, topic: &str, payload: &str) -> u16 {
    crate::harness::mosquitto_pub(broker, &["-t", topic, "-m", payload, "-r", "-q", "1"]);
    let raw = get(nats, "mqtt-retained", &retained_key(topic)).expect("stored");
    let record = RetainedRecord::from_value(&raw).unwrap();
    assert_eq!(record.payload.as_ref(), payload.as_bytes());
    record.format
}

#[test]
fn the_leader_raises_the_floor_once_the_last_old_member_is_gone_and_every_replica_then_writes_format_2(
) {
    let nats = NatsCluster::start(1);
    // A replica creates the buckets, and stops.
    replica("ra", &nats.urls(), &ARGS).stop_with_sigterm();
    // A cluster mid-upgrade: the floor at 1, a member that reads only 1.
    put(
        &nats,
        "mqtt-cluster-floor",
        "floor",
        r#"{"format":1,"floor":1}"#.into(),
    );
    let old = OldMember::start(&nats);
    let a = replica("ra", &nats.urls(), &ARGS);
    let b = replica("rb", &nats.urls(), &ARGS);
    // While it lives, the floor stays and both write format 1.
    thread::sleep(Duration::from_secs(3));
    assert_eq!(floor(&nats), 1, "raised while a member reads only format 1");
    assert_eq!(retained_format(&nats, &a, "upgrade/a", "1a"), 1);
    assert_eq!(retained_format(&nats, &b, "upgrade/b", "1b"), 1);
    // It goes: its entry expires TTL after its last write and it is taken
    // for gone TTL/2 later; then the leader raises the floor.
    drop(old);
    let gone = Instant::now();
    while floor(&nats) != 2 {
        assert!(
            gone.elapsed() < Duration::from_secs(20),
            "the floor was not raised"
        );
        thread::sleep(Duration::from_millis(250));
    }
    let raised = gone.elapsed();
    assert!(
        raised >= TTL,
        "raised {raised:?} after the old member's last write: before it was gone"
    );
    // Both replicas follow the floor: what they write now is format 2.
    for (broker, topic) in [(&a, "upgrade/a"), (&b, "upgrade/b")] {
        let deadline = Instant::now() + Duration::from_secs(5);
        while retained_format(&nats, broker, topic, "2") != 2 {
            assert!(
                Instant::now() < deadline,
                "{topic}: still format 1 after the floor was raised"
            );
            thread::sleep(Duration::from_millis(200));
        }
    }
}
