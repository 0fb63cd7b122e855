//! The whole path: MQTT QoS 1 publishers (rumqttc) → a fleetmq replica
//! with `store.kind = "jetstream"` → the ingest stream → the consumer →
//! PostgreSQL. DESIGN.md §7: a PUBACK means the value is in the stream, so
//! every acknowledged publish must reach the table, once.

use std::collections::HashSet;
use std::fs::File;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rumqttc::{AsyncClient, Event, MqttOptions, Packet, QoS};

use crate::ingest::{count, wait_all_acknowledged, wait_for_rows, Consumer};
use crate::servers::{tail, Nats, Postgres, TempDir};

/// How long fleetmq may take to print `fleetmq: ready`.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// Publishes `n` QoS 1 values as client `id` (topic `dev/<id>/v`, payload
/// `<id>:<i>`), pausing 5 ms every 100; returns how many PUBACKs came.
///
/// # Panics
///
/// The connection fails, or no PUBACK comes for 20 s.
async fn publish_qos1(broker: SocketAddr, id: String, n: u32) -> u32 {
    let mut options = MqttOptions::new(id.clone(), broker.ip().to_string(), broker.port());
    options.set_keep_alive(Duration::from_secs(30));
    options.set_inflight(50);
    let (client, mut events) = AsyncClient::new(options, 100);
    let sender = tokio::spawn(async move {
        for i in 0..n {
            let payload = format!("{id}:{i}");
            client
                .publish(format!("dev/{id}/v"), QoS::AtLeastOnce, false, payload)
                .await
                .expect("queue a publish");
            if i % 100 == 99 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        client
    });
    let mut acknowledged = 0;
    while acknowledged < n {
        match tokio::time::timeout(Duration::from_secs(20), events.poll()).await {
            Ok(Ok(Event::Incoming(Packet::PubAck(_)))) => acknowledged += 1,
            Ok(Ok(_)) => {}
            Ok(Err(why)) => panic!("MQTT connection failed after {acknowledged} PUBACKs: {why}"),
            Err(_) => panic!("no PUBACK for 20 s after {acknowledged}"),
        }
    }
    let client = sender.await.expect("the sender");
    let _ = client.disconnect().await;
    acknowledged
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_acknowledged_mqtt_publish_is_in_the_table_exactly_once_after_the_consumer_is_killed_mid_stream(
) {
    const CLIENTS: u32 = 4;
    const EACH: u32 = 2_500;
    const TOTAL: i64 = (CLIENTS * EACH) as i64;
    let nats = Nats::start();
    let postgres = Postgres::start();
    let fleetmq = Fleetmq::start(&nats.url());
    let pg = postgres.client().await;
    let mut consumer = Consumer::start(&nats.url(), &postgres.url(), &["--batch-size", "100"]);

    let publishers: Vec<_> = (0..CLIENTS)
        .map(|c| tokio::spawn(publish_qos1(fleetmq.mqtt, format!("pub-{c}"), EACH)))
        .collect();
    let seen = wait_for_rows(&pg, "mqtt_ingest", 1_000, Duration::from_secs(20)).await;
    consumer.kill();
    let at_kill = count(&pg, "mqtt_ingest").await;
    assert!(
        seen >= 1_000,
        "the consumer wrote {seen} rows in 20 s:\n{}",
        consumer.log()
    );
    assert!(
        at_kill < TOTAL,
        "killed after the last value: not mid-stream"
    );
    let mut consumer = Consumer::start(&nats.url(), &postgres.url(), &["--batch-size", "100"]);

    let mut acknowledged = 0;
    for publisher in publishers {
        acknowledged += publisher.await.expect("a publisher");
    }
    assert_eq!(i64::from(acknowledged), TOTAL);
    let seen = wait_for_rows(&pg, "mqtt_ingest", TOTAL, Duration::from_secs(20)).await;
    assert_eq!(seen, TOTAL, "rows (killed at {at_kill})");
    wait_all_acknowledged(&nats_js(&nats).await, "fleetmq-pg-consumer").await;

    let rows = pg
        .query(
            "SELECT client_id, topic, qos, payload FROM mqtt_ingest",
            &[],
        )
        .await
        .expect("read the table");
    assert_eq!(rows.len() as i64, TOTAL, "a value twice or one extra");
    let mut values = HashSet::new();
    for row in &rows {
        let client: Option<String> = row.get(0);
        let client = client.expect("Mqtt-Client-Id");
        assert_eq!(
            row.get::<_, Option<String>>(1),
            Some(format!("dev/{client}/v"))
        );
        assert_eq!(row.get::<_, Option<i16>>(2), Some(1));
        let payload = String::from_utf8(row.get(3)).expect("the payload as sent");
        assert!(
            payload.starts_with(&format!("{client}:")),
            "{payload} from {client}"
        );
        assert!(values.insert(payload.clone()), "{payload} twice");
    }
    for c in 0..CLIENTS {
        for i in 0..EACH {
            assert!(
                values.contains(&format!("pub-{c}:{i}")),
                "pub-{c}:{i} is missing"
            );
        }
    }
    assert!(consumer.terminate().is_some_and(|s| s.success()));
}

async fn nats_js(nats: &Nats) -> async_nats::jetstream::Context {
    async_nats::jetstream::new(
        async_nats::connect(nats.url())
            .await
            .expect("connect to NATS"),
    )
}

/// A fleetmq replica (`fleetmq serve`) with `store.kind = "jetstream"`
/// against one NATS server: the ingest stream's writer. Killed on drop.
pub(crate) struct Fleetmq {
    child: Option<Child>,
    /// Its MQTT listener.
    pub(crate) mqtt: std::net::SocketAddr,
    stderr: PathBuf,
    _dir: TempDir,
}

/// The `fleetmq` binary: `$FLEETMQ_BIN`, else `fleetmq` beside this test's
/// own folder (`target/<profile>/fleetmq`, which `cargo nextest run
/// --workspace` and scripts/test.sh build).
fn fleetmq_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("FLEETMQ_BIN") {
        return PathBuf::from(path);
    }
    let exe = std::env::current_exe().expect("the test's path");
    let path = exe
        .parent()
        .and_then(Path::parent)
        .map(|dir| dir.join("fleetmq"))
        .filter(|path| path.is_file());
    path.unwrap_or_else(|| {
        panic!(
            "the fleetmq binary is not beside {}: `cargo build -p fleetmq-shards` first, \
             or set FLEETMQ_BIN",
            exe.display()
        )
    })
}

impl Fleetmq {
    /// Starts a replica on free loopback ports, cluster of one, NATS at
    /// `nats`, one copy of each stream, and waits for `fleetmq: ready`.
    ///
    /// # Panics
    ///
    /// The binary is missing, or it does not print `fleetmq: ready` within
    /// 30 s (the message carries its stderr).
    pub(crate) fn start(nats: &str) -> Fleetmq {
        use std::io::BufRead;
        let dir = TempDir::new("fleetmq");
        let stderr = dir.path("fleetmq.log");
        let mut child = Command::new(fleetmq_binary())
            .args([
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--admin",
                "127.0.0.1:0",
                "--set",
            ])
            .arg(format!(
                "store.dir={:?}",
                dir.path("data").display().to_string()
            ))
            .args(["--set", "cluster.replica_id=r1", "--set"])
            .arg(format!("cluster.nats_urls=[{nats:?}]"))
            .args([
                "--set",
                "cluster.nats_replicas=1",
                "--set",
                "store.kind=\"jetstream\"",
            ])
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(File::create(&stderr).expect("create the log")))
            .spawn()
            .expect("start fleetmq");
        let (lines_tx, lines) = std::sync::mpsc::channel();
        let stdout = child.stdout.take().expect("piped stdout");
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout)
                .lines()
                .map_while(Result::ok)
            {
                if lines_tx.send(line).is_err() {
                    break;
                }
            }
        });
        let deadline = Instant::now() + READY_TIMEOUT;
        let mut mqtt = None;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match lines.recv_timeout(left) {
                Ok(line) if line.starts_with("fleetmq: listening mqtt-tcp ") => {
                    mqtt = line.rsplit(' ').next().and_then(|addr| addr.parse().ok());
                }
                Ok(line) if line == "fleetmq: ready" => break,
                Ok(_) => {}
                Err(_) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    panic!("fleetmq did not get ready:\n{}", tail(&stderr, 40));
                }
            }
        }
        let mqtt = mqtt.expect("fleetmq printed its MQTT address");
        Fleetmq {
            child: Some(child),
            mqtt,
            stderr,
            _dir: dir,
        }
    }
}

impl Drop for Fleetmq {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "--- fleetmq log at the panic ---\n{}",
                tail(&self.stderr, 30)
            );
        }
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
