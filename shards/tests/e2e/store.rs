//! The durable local store (`store.kind = "local"`, DESIGN.md §7): what a
//! broker killed with SIGKILL brings back at restart, that no acknowledged
//! value is lost under load, damaged logs, the lock, and a full disk.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::clients::{unique, v4, v5, WAIT};
use crate::harness::{run_with_timeout, Broker};

/// A directory under the system temp dir, removed when dropped.
pub(crate) struct TempDir(pub(crate) PathBuf);

impl TempDir {
    pub(crate) fn new(what: &str) -> TempDir {
        static N: AtomicU64 = AtomicU64::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("fleetmq-e2e-{what}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `--shards 2` and the local store in `dir`, then `extra`.
pub(crate) fn local(dir: &Path, extra: &[&str]) -> Broker {
    let dir = format!("store.dir={}", dir.display());
    let mut args = vec!["--shards", "2", "--set", "store.kind=local", "--set", &dir];
    args.extend_from_slice(extra);
    Broker::start(&args)
}

/// SIGKILL, and wait for the process to end.
pub(crate) fn kill(broker: Broker) {
    broker.signal(libc::SIGKILL);
    drop(broker);
}

pub(crate) fn v5_persistent(port: u16, id: &str) -> v5::MqttOptions {
    let mut o = v5::options(port, id, false);
    o.set_session_expiry_interval(Some(600));
    o
}

/// MQTT 5 persistent session with a Subscription Identifier: values and a
/// retained message published while it is away survive SIGKILL, arrive in
/// order on reconnect with the identifier [MQTT-3.3.4-3] and session
/// present [MQTT-3.2.2-2]; the retained message reaches a new subscriber;
/// what the session acknowledged is not sent again after a second kill.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_and_retained_messages_survive_sigkill() {
    let dir = TempDir::new("restart");
    let broker = local(&dir.0, &[]);
    let (id, topic) = (unique("dur"), unique("dur/t"));
    let (mut sub, _) = v5::Client::connect_with(v5_persistent(broker.mqtt_port(), &id)).await;
    let props = rumqttc::v5::mqttbytes::v5::SubscribeProperties { id: Some(7), user_properties: vec![] };
    sub.client.subscribe_with_properties(format!("{topic}/#"), v5::QoS::AtLeastOnce, props).await.unwrap();
    sub.wait_for("SUBACK", |p| matches!(p, v5::Packet::SubAck(_))).await;
    sub.disconnect().await;
    tokio::task::block_in_place(|| broker.wait_for_clients(0, WAIT));
    let mut publisher = v5::Client::connect(broker.mqtt_port(), &unique("durpub")).await;
    publisher.client.publish(format!("{topic}/r"), v5::QoS::AtLeastOnce, true, "kept").await.unwrap();
    for i in 0..20 {
        publisher.client.publish(format!("{topic}/q"), v5::QoS::AtLeastOnce, false, i.to_string()).await.unwrap();
    }
    for _ in 0..21 {
        publisher.wait_for("PUBACK", |p| matches!(p, v5::Packet::PubAck(_))).await;
    }
    kill(broker);

    let broker = local(&dir.0, &[]);
    let port = broker.mqtt_port();
    let mut fresh = v5::Client::connect(port, &unique("fresh")).await;
    fresh.subscribe(&format!("{topic}/r"), v5::QoS::AtLeastOnce).await;
    let retained = fresh.next_publish().await;
    assert_eq!((retained.payload, retained.retain), (Bytes::from("kept"), true));
    let (mut sub, connack) = v5::Client::connect_with(v5_persistent(port, &id)).await;
    assert!(matches!(connack, v5::Packet::ConnAck(ref c) if c.session_present), "{connack:?}");
    let first = sub.next_publish().await;
    assert_eq!(first.payload, Bytes::from("kept"));
    for i in 0..20 {
        let got = sub.next_publish().await;
        assert_eq!(got.payload, Bytes::from(i.to_string()), "value {i} in order");
        let ids = got.properties.as_ref().map(|p| p.subscription_identifiers.clone()).unwrap_or_default();
        assert_eq!(ids, vec![7], "the Subscription Identifier survives the restart");
    }
    sub.expect_no_publish(Duration::from_millis(300)).await;
    sub.disconnect().await;
    tokio::task::block_in_place(|| broker.wait_for_clients(1, WAIT));
    kill(broker);

    let broker = local(&dir.0, &[]);
    let (mut sub, connack) = v5::Client::connect_with(v5_persistent(broker.mqtt_port(), &id)).await;
    assert!(matches!(connack, v5::Packet::ConnAck(ref c) if c.session_present), "{connack:?}");
    sub.expect_no_publish(Duration::from_millis(500)).await;
}

/// Publish `0, 1, 2, ...` as fast as the broker acknowledges (100 in
/// flight) until the connection dies; returns the values acknowledged
/// (PUBACK for QoS 1, PUBREC for QoS 2).
async fn publish_until_killed(port: u16, topic: &str, qos: v4::QoS) -> BTreeSet<u64> {
    publish_from_until_killed(port, topic, qos, 0, 0).await
}

/// [`publish_until_killed`] from `first` on, each value followed by a
/// space and `pad` bytes.
pub(crate) async fn publish_from_until_killed(port: u16, topic: &str, qos: v4::QoS, first: u64, pad: usize) -> BTreeSet<u64> {
    use rumqttc::{Event, Incoming, Outgoing};
    let mut options = v4::options(port, &unique("loadpub"), true);
    options.set_inflight(100);
    let (client, mut eventloop) = rumqttc::AsyncClient::new(options, 200);
    let topic = topic.to_owned();
    let feeder = tokio::spawn(async move {
        for i in first.. {
            let mut value = i.to_string();
            if pad > 0 {
                value.push(' ');
                value.extend(std::iter::repeat_n('x', pad));
            }
            if client.publish(&topic, qos, false, value).await.is_err() {
                return;
            }
        }
    });
    let (mut next, mut in_flight, mut acked) = (first, std::collections::HashMap::new(), BTreeSet::new());
    while let Ok(event) = eventloop.poll().await {
        match event {
            Event::Outgoing(Outgoing::Publish(pkid)) => {
                in_flight.insert(pkid, next);
                next += 1;
            }
            Event::Incoming(Incoming::PubAck(ack)) => acked.extend(in_flight.remove(&ack.pkid)),
            Event::Incoming(Incoming::PubRec(rec)) => acked.extend(in_flight.remove(&rec.pkid)),
            _ => {}
        }
    }
    feeder.abort();
    acked
}

/// SIGKILL under QoS 1 or 2 load: a persistent subscriber that was away
/// gets every acknowledged value after the restart, in publish order, and
/// at QoS 2 each exactly once (DESIGN.md §7) [MQTT-4.3.3-2].
async fn no_acknowledged_value_is_lost(qos: v4::QoS) {
    let dir = TempDir::new("load");
    let extra = ["--set", "limits.max_subscriber_queue=1000000"];
    let broker = local(&dir.0, &extra);
    let (id, topic) = (unique("loadsub"), unique("load/t"));
    let (mut sub, _) = v4::Client::connect_with(v4::options(broker.mqtt_port(), &id, false)).await;
    sub.subscribe(&topic, qos).await;
    sub.disconnect().await;
    tokio::task::block_in_place(|| broker.wait_for_clients(0, WAIT));
    let port = broker.mqtt_port();
    let load = tokio::spawn({
        let topic = topic.clone();
        async move { publish_until_killed(port, &topic, qos).await }
    });
    tokio::time::sleep(Duration::from_millis(1500)).await;
    kill(broker);
    let acked = load.await.unwrap();
    assert!(acked.len() > 100, "the load ran: {} values acknowledged", acked.len());

    let broker = local(&dir.0, &extra);
    let received = resume_and_check(&broker, &id, &acked).await;
    if qos == v4::QoS::ExactlyOnce {
        assert!(received.windows(2).all(|w| w[0] < w[1]), "QoS 2: each value once");
    }
    eprintln!("acknowledged {}, received {} after the restart", acked.len(), received.len());
}

/// The persistent MQTT 3.1.1 session `id` resumed on `broker`: the values
/// it gets (numbers, as [`publish_from_until_killed`] sends them), checked
/// to hold every one of `acked` (none lost) in publish order.
pub(crate) async fn resume_and_check(broker: &Broker, id: &str, acked: &BTreeSet<u64>) -> Vec<u64> {
    let (mut sub, _) = v4::Client::connect_with(v4::options(broker.mqtt_port(), id, false)).await;
    let mut received = Vec::new();
    while let Some(p) = sub.try_next_publish(Duration::from_secs(2)).await {
        let text = String::from_utf8_lossy(&p.payload).into_owned();
        received.push(text.split(' ').next().unwrap().parse::<u64>().unwrap());
    }
    let seen: BTreeSet<u64> = received.iter().copied().collect();
    let lost: Vec<u64> = acked.iter().filter(|v| !seen.contains(v)).copied().collect();
    assert!(lost.is_empty(), "{} of {} acknowledged values lost, e.g. {:?}", lost.len(), acked.len(), &lost[..lost.len().min(5)]);
    assert!(received.windows(2).all(|w| w[0] <= w[1]), "publish order kept");
    received
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_acknowledged_qos1_value_is_lost_when_the_broker_is_killed_under_load() {
    no_acknowledged_value_is_lost(v4::QoS::AtLeastOnce).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_acknowledged_qos2_value_is_lost_or_doubled_when_the_broker_is_killed_under_load() {
    no_acknowledged_value_is_lost(v4::QoS::ExactlyOnce).await;
}

/// Run `fleetmq serve` on `dir` expecting it to refuse to start; returns
/// its stderr.
fn refused_start(dir: &Path, extra: &[&str]) -> String {
    let dir = format!("store.dir={}", dir.display());
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_fleetmq"));
    cmd.args(["serve", "--listen", "127.0.0.1:0", "--admin", "", "--set", "store.kind=local", "--set", &dir]);
    cmd.args(extra);
    let out = run_with_timeout(&mut cmd, Duration::from_secs(20));
    assert!(!out.status.success(), "started: {}", String::from_utf8_lossy(&out.stdout));
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The shard logs holding records, with their frames.
fn logs(dir: &Path) -> Vec<(PathBuf, Vec<(u64, Bytes)>)> {
    let mut out = Vec::new();
    for shard in std::fs::read_dir(dir).unwrap().flatten().filter(|e| e.file_name().to_string_lossy().starts_with("shard-")) {
        for seg in std::fs::read_dir(shard.path()).unwrap().flatten() {
            let data = Bytes::from(std::fs::read(seg.path()).unwrap());
            let frames = fleetmq_core::store::scan(&data).unwrap().frames;
            if frames.len() > 1 {
                out.push((seg.path(), frames));
            }
        }
    }
    out
}

/// Publish `n` retained values (one topic each) and SIGKILL the broker.
async fn retained_then_killed(dir: &Path, prefix: &str, n: usize) {
    let broker = local(dir, &[]);
    let mut publisher = v4::Client::connect(broker.mqtt_port(), &unique("tornpub")).await;
    for i in 0..n {
        publisher.client.publish(format!("{prefix}/{i}"), v4::QoS::AtLeastOnce, true, format!("value {i}")).await.unwrap();
        publisher.wait_for("PUBACK", |p| matches!(p, v4::Packet::PubAck(_))).await;
    }
    kill(broker);
}

/// The retained topics a new subscriber to `prefix/#` gets.
async fn retained_topics(broker: &Broker, prefix: &str) -> BTreeSet<String> {
    let mut sub = v4::Client::connect(broker.mqtt_port(), &unique("tornsub")).await;
    sub.subscribe(&format!("{prefix}/#"), v4::QoS::AtLeastOnce).await;
    let mut topics = BTreeSet::new();
    while let Some(p) = sub.try_next_publish(Duration::from_millis(500)).await {
        topics.insert(p.topic);
    }
    topics
}

/// A log whose last record was cut by the crash (here: truncated at its
/// first, a middle and its last byte): the cut record is dropped, never
/// read as data, the broker starts, and everything before it is there.
/// (Every byte of the last record is covered by the store's unit test.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_torn_tail_is_truncated_and_the_rest_recovered() {
    let dir = TempDir::new("torn");
    let prefix = unique("torn");
    retained_then_killed(&dir.0, &prefix, 5).await;
    let (path, frames) = logs(&dir.0).pop().expect("a log with records");
    let (last, body) = frames.last().unwrap().clone();
    let end = last + 8 + body.len() as u64;
    let saved = std::fs::read(&path).unwrap();
    for cut in [last + 1, last + (end - last) / 2, end - 1] {
        std::fs::write(&path, &saved).unwrap();
        std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(cut).unwrap();
        let copy = TempDir::new("torncopy");
        for e in std::fs::read_dir(&dir.0).unwrap().flatten() {
            copy_tree(&e.path(), &copy.0.join(e.file_name()));
        }
        let broker = local(&copy.0, &[]);
        let topics = retained_topics(&broker, &prefix).await;
        assert!(broker.stderr().contains("dropping a torn or damaged tail"), "{}", broker.stderr());
        // Each shard logs its own publisher's values: the cut one is gone
        // (4 left) unless the cut record was not a value.
        assert!(topics.len() >= 4, "cut at {cut}: {topics:?}");
    }
}

fn copy_tree(from: &Path, to: &Path) {
    if from.is_dir() {
        std::fs::create_dir_all(to).unwrap();
        for e in std::fs::read_dir(from).unwrap().flatten() {
            copy_tree(&e.path(), &to.join(e.file_name()));
        }
    } else {
        std::fs::copy(from, to).unwrap();
    }
}

/// A flipped bit in a record in the middle of a log stops the start,
/// naming the file and the byte offset; `store.truncate_corrupt = true`
/// starts anyway, with what came before the damage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flipped_bit_in_the_middle_refuses_the_start_naming_file_and_offset() {
    let dir = TempDir::new("flip");
    let prefix = unique("flip");
    retained_then_killed(&dir.0, &prefix, 6).await;
    let (path, frames) = logs(&dir.0).pop().expect("a log with records");
    assert!(frames.len() >= 4, "{frames:?}");
    let (middle, _) = frames[frames.len() / 2];
    let mut data = std::fs::read(&path).unwrap();
    data[middle as usize + 12] ^= 0x10;
    std::fs::write(&path, &data).unwrap();
    let stderr = refused_start(&dir.0, &[]);
    let named = format!("{} is damaged at byte offset {middle}", path.display());
    assert!(stderr.contains(&named), "{stderr}");
    assert!(stderr.contains("store.truncate_corrupt = true"), "{stderr}");
    let broker = local(&dir.0, &["--set", "store.truncate_corrupt=true"]);
    let topics = retained_topics(&broker, &prefix).await;
    assert!(topics.len() < 6 && !topics.is_empty(), "{topics:?}");
}

/// A start right after a SIGKILL (as a supervisor restarts), before the
/// killed process is even reaped, takes the store over: the kernel
/// releases the dead process's lock only once its io_uring rings are torn
/// down, and the start waits for that instead of refusing "in use".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_right_after_a_sigkill_waits_for_the_dead_process_lock() {
    let dir = TempDir::new("relock");
    let prefix = unique("relock");
    let mut waited = 0;
    for round in 0..3 {
        let broker = local(&dir.0, &[]);
        let mut publisher = v4::Client::connect(broker.mqtt_port(), &unique("relockc")).await;
        publisher.client.publish(format!("{prefix}/{round}"), v4::QoS::AtLeastOnce, true, "v").await.unwrap();
        publisher.wait_for("PUBACK", |p| matches!(p, v4::Packet::PubAck(_))).await;
        // Killed, not yet reaped (a zombie until `broker` is dropped).
        broker.signal(libc::SIGKILL);
        let again = local(&dir.0, &[]);
        waited += usize::from(again.stderr().contains("waiting for the lock of a process that ended"));
        assert_eq!(retained_topics(&again, &prefix).await.len(), round + 1);
        drop(broker);
        kill(again);
    }
    eprintln!("the start waited for the dead process's lock in {waited} of 3 rounds");
}

/// A second process on the same `store.dir` refuses to start, naming the
/// PID of the one that holds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_process_on_one_store_dir_is_refused_naming_the_holder() {
    let dir = TempDir::new("lock");
    let broker = local(&dir.0, &[]);
    let pid = std::fs::read_to_string(dir.0.join("LOCK")).unwrap();
    let stderr = refused_start(&dir.0, &[]);
    assert!(stderr.contains(&format!("in use by another fleetmq process (PID {},", pid.trim())), "{stderr}");
    // The holder still serves.
    let mut c = v4::Client::connect(broker.mqtt_port(), &unique("lockc")).await;
    c.subscribe("x", v4::QoS::AtLeastOnce).await;
    let started = Instant::now();
    kill(broker);
    // Free again once the holder is gone.
    let again = local(&dir.0, &[]);
    assert!(started.elapsed() < Duration::from_secs(30));
    drop(again);
}

/// How long a sync on the loop device may take on a busy machine.
pub(crate) const SLOW_DISK: Duration = Duration::from_secs(30);

/// A small ext4 file system on a loop device, mounted for one test and
/// unmounted (and its image removed) when dropped, also when it fails.
pub(crate) struct SmallDisk {
    pub(crate) mount: TempDir,
    image: PathBuf,
}

impl SmallDisk {
    /// An 8 MiB ext4 (which keeps `O_DIRECT`); `Err` says why it cannot be
    /// made here (not root, no loop devices).
    pub(crate) fn mount() -> Result<SmallDisk, String> {
        let mount = TempDir::new("disk");
        let image = mount.0.with_extension("img");
        let run = |cmd: &mut Command| -> Result<(), String> {
            let out = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
            out.status.success().then_some(()).ok_or_else(|| format!("{cmd:?}: {}", String::from_utf8_lossy(&out.stderr)))
        };
        run(Command::new("truncate").args(["-s", "8M"]).arg(&image))?;
        run(Command::new("mkfs.ext4").arg("-q").arg(&image))?;
        if let Err(e) = run(Command::new("mount").args(["-o", "loop"]).arg(&image).arg(&mount.0)) {
            let _ = std::fs::remove_file(&image);
            return Err(e);
        }
        Ok(SmallDisk { mount, image })
    }

    /// [`SmallDisk::mount`], or `None` with a SKIPPED line saying why
    /// (it needs root and loop devices; the CI machines have both).
    pub(crate) fn mount_or_skip() -> Option<SmallDisk> {
        SmallDisk::mount().map_err(|why| eprintln!("SKIPPED: cannot mount a small ext4 here: {why}")).ok()
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.mount.0).status();
        let _ = std::fs::remove_file(&self.image);
    }
}

/// A full disk: MQTT 5 publishes get PUBACK 0x97 Quota exceeded, a 3.1.1
/// publisher is disconnected, readiness answers 503 with the reason, and
/// once space returns the broker takes publishes again by itself; after a
/// SIGKILL every value that got a successful PUBACK is there (DESIGN.md
/// §7: never acknowledged and then lost).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_refuses_publishes_and_service_resumes_when_space_returns() {
    let Some(disk) = SmallDisk::mount_or_skip() else { return };
    let dir = disk.mount.0.join("data");
    let broker = local(&dir, &["--set", "limits.max_subscriber_queue=1000000"]);
    let port = broker.mqtt_port();
    let (id, topic) = (unique("fullsub"), unique("full/t"));
    let (mut sub, _) = v5::Client::connect_with(v5_persistent(port, &id)).await;
    sub.subscribe(&topic, v5::QoS::AtLeastOnce).await;
    sub.disconnect().await;
    // Leave about 256 KiB free.
    let filler = disk.mount.0.join("filler");
    let free = nix_free_bytes(&disk.mount.0);
    let status = Command::new("fallocate").args(["-l", &(free.saturating_sub(256 << 10)).to_string()]).arg(&filler).status().unwrap();
    assert!(status.success());

    let mut publisher = v5::Client::connect(port, &unique("fullpub")).await;
    let payload = vec![b'x'; 8 << 10];
    let (mut accepted, mut refused) = (Vec::new(), 0);
    for i in 0..400u32 {
        let mut value = i.to_string().into_bytes();
        value.extend_from_slice(b" ");
        value.extend_from_slice(&payload);
        publisher.client.publish(&topic, v5::QoS::AtLeastOnce, false, value).await.unwrap();
        // A sync on a loop device waits for the disk under it, which other
        // builds on this machine may keep busy.
        match publisher.wait_for_within("PUBACK", SLOW_DISK, |p| matches!(p, v5::Packet::PubAck(_))).await {
            v5::Packet::PubAck(ack) if ack.reason == rumqttc::v5::mqttbytes::v5::PubAckReason::Success => accepted.push(i),
            v5::Packet::PubAck(ack) => {
                assert_eq!(ack.reason, rumqttc::v5::mqttbytes::v5::PubAckReason::QuotaExceeded);
                refused += 1;
                break;
            }
            _ => unreachable!(),
        }
    }
    assert_eq!(refused, 1, "the disk filled up: {} accepted", accepted.len());
    let (status, body) = broker.admin_get("/health/ready");
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("store failing"), "{body}");
    assert!(broker.metric_sum("fleetmq_store_failures_total") >= 1.0);
    // MQTT 3.1.1 has no reason code: the connection is closed.
    let mut old = v4::Client::connect(port, &unique("full311")).await;
    old.client.publish(&topic, v4::QoS::AtLeastOnce, false, "refused").await.unwrap();
    assert!(old.closed_with(WAIT).await.is_some());

    std::fs::remove_file(&filler).unwrap();
    ready_again(&broker).await;
    publisher.client.publish(&topic, v5::QoS::AtLeastOnce, false, "after").await.unwrap();
    match publisher.wait_for_within("PUBACK", SLOW_DISK, |p| matches!(p, v5::Packet::PubAck(_))).await {
        v5::Packet::PubAck(ack) => assert_eq!(ack.reason, rumqttc::v5::mqttbytes::v5::PubAckReason::Success),
        _ => unreachable!(),
    }
    kill(broker);

    let broker = local(&dir, &["--set", "limits.max_subscriber_queue=1000000"]);
    let (mut sub, _) = v5::Client::connect_with(v5_persistent(broker.mqtt_port(), &id)).await;
    let mut got = BTreeSet::new();
    while let Some(p) = sub.try_next_publish(Duration::from_secs(1)).await {
        let text = String::from_utf8_lossy(&p.payload).into_owned();
        got.insert(text.split(' ').next().unwrap().to_owned());
    }
    for i in &accepted {
        assert!(got.contains(&i.to_string()), "value {i} was acknowledged and is lost");
    }
    assert!(got.contains("after"));
    kill(broker);
}

/// Wait until the broker is ready again (at most [`SLOW_DISK`]) after
/// the disk got space back.
pub(crate) async fn ready_again(broker: &crate::harness::Broker) {
    let deadline = Instant::now() + SLOW_DISK;
    while broker.admin_get("/health/ready").0 != 200 {
        assert!(
            Instant::now() < deadline,
            "not ready again: {:?}",
            broker.admin_get("/health/ready")
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Bytes free on the file system of `path`.
pub(crate) fn nix_free_bytes(path: &Path) -> u64 {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: statvfs on a NUL-terminated path into a zeroed struct.
    assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut s) }, 0);
    s.f_bavail * s.f_frsize
}
