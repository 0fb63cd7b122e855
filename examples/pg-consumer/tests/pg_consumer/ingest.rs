//! The ingest stream as fleetmq's `store.kind = "jetstream"` makes it
//! (/work/coord/ingest-contract.md), values published into it with the
//! contract's headers, and the consumer binary as a child process.

use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer::pull, stream};
use async_nats::HeaderMap;
use bytes::Bytes;

use crate::servers::{signal, tail, wait_exit, TempDir};

/// The stream's name and subjects (the contract).
pub(crate) const STREAM: &str = "mqtt-ingest";

/// Creates the ingest stream: `mqtt-ingest.>`, file storage, one copy,
/// 2 min duplicate window.
pub(crate) async fn create_stream(js: &jetstream::Context) {
    js.create_stream(stream::Config {
        name: STREAM.into(),
        subjects: vec!["mqtt-ingest.>".into()],
        storage: stream::StorageType::File,
        duplicate_window: Duration::from_secs(120),
        ..Default::default()
    })
    .await
    .expect("create the ingest stream");
}

/// One value as the broker appends it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Value {
    /// `Nats-Msg-Id`.
    pub(crate) msg_id: String,
    /// `Mqtt-Topic`.
    pub(crate) topic: String,
    /// `Mqtt-Client-Id`.
    pub(crate) client_id: String,
    /// The payload.
    pub(crate) payload: Vec<u8>,
}

impl Value {
    /// Value `i` of client `client`: topic `dev/<client>/v`, a payload with
    /// non-UTF-8 bytes.
    pub(crate) fn numbered(client: &str, i: u32) -> Value {
        let mut payload = format!("{client}:{i}:").into_bytes();
        payload.extend_from_slice(&[0xff, 0x00, 0xfe]);
        Value {
            msg_id: format!("{client}:{i}"),
            topic: format!("dev/{client}/v"),
            client_id: client.into(),
            payload,
        }
    }
}

/// Appends `values` to the default workspace's subject with the contract's
/// four headers, 500 in flight at most; waits for every JetStream ack.
pub(crate) async fn publish(js: &jetstream::Context, values: &[Value]) {
    for chunk in values.chunks(500) {
        let mut acks = Vec::with_capacity(chunk.len());
        for value in chunk {
            let mut headers = HeaderMap::new();
            headers.insert("Nats-Msg-Id", value.msg_id.as_str());
            headers.insert("Mqtt-Topic", value.topic.as_str());
            headers.insert("Mqtt-Qos", "1");
            headers.insert("Mqtt-Client-Id", value.client_id.as_str());
            let ack = js
                .publish_with_headers("mqtt-ingest._", headers, Bytes::from(value.payload.clone()))
                .await
                .expect("publish into the stream");
            acks.push(ack);
        }
        for ack in acks {
            ack.await.expect("JetStream acknowledges the value");
        }
    }
}

/// Waits (10 s at most) until durable `name` has nothing pending and
/// nothing unacknowledged.
pub(crate) async fn wait_all_acknowledged(js: &jetstream::Context, name: &str) {
    let stream = js.get_stream(STREAM).await.expect("the stream");
    let mut last = String::from("not created");
    for _ in 0..200 {
        // The consumer process creates it when it starts.
        if let Ok(mut consumer) = stream.get_consumer::<pull::Config>(name).await {
            let info = consumer.info().await.expect("consumer info");
            if info.num_pending == 0 && info.num_ack_pending == 0 {
                return;
            }
            last = format!(
                "{} pending, {} unacknowledged",
                info.num_pending, info.num_ack_pending
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("durable {name} after 10 s: {last}");
}

/// Rows in `table`.
pub(crate) async fn count(pg: &tokio_postgres::Client, table: &str) -> i64 {
    pg.query_one(&format!("SELECT count(*) FROM {table}"), &[])
        .await
        .map(|row| row.get(0))
        .unwrap_or(0)
}

/// Waits (at most `timeout`) until `table` has `n` rows; returns the count
/// seen last.
pub(crate) async fn wait_for_rows(
    pg: &tokio_postgres::Client,
    table: &str,
    n: i64,
    timeout: Duration,
) -> i64 {
    let deadline = Instant::now() + timeout;
    loop {
        let seen = count(pg, table).await;
        if seen >= n || Instant::now() >= deadline {
            return seen;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The consumer binary as a child process, its log in a file; killed on
/// drop (its log printed when the test panics).
pub(crate) struct Consumer {
    child: Option<Child>,
    log: PathBuf,
    _dir: TempDir,
}

impl Consumer {
    /// Starts `fleetmq-pg-consumer --nats-url <nats> --postgres <pg>` with
    /// a 2 s ack wait, 200 ms fetch wait, and `extra` arguments.
    pub(crate) fn start(nats: &str, pg: &str, extra: &[&str]) -> Consumer {
        let dir = TempDir::new("consumer");
        let log = dir.path("consumer.log");
        let file = std::fs::File::create(&log).expect("create the log");
        // FLEETMQ_PG_CONSUMER_BIN: another build (e.g. release, to measure).
        let binary = std::env::var_os("FLEETMQ_PG_CONSUMER_BIN")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_fleetmq-pg-consumer")));
        let child = Command::new(binary)
            .args([
                "--nats-url",
                nats,
                "--postgres",
                pg,
                "--ack-wait",
                "2s",
                "--fetch-wait",
                "200ms",
            ])
            .args(extra)
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::from(file.try_clone().expect("clone a file handle")))
            .stderr(Stdio::from(file))
            .spawn()
            .expect("start fleetmq-pg-consumer");
        Consumer {
            child: Some(child),
            log,
            _dir: dir,
        }
    }

    /// SIGKILL, reaped.
    pub(crate) fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM and its exit status (10 s at most).
    pub(crate) fn terminate(&mut self) -> Option<ExitStatus> {
        let mut child = self.child.take()?;
        signal(&child, libc::SIGTERM);
        let status = wait_exit(&mut child, Duration::from_secs(10));
        if status.is_none() {
            let _ = child.kill();
            let _ = child.wait();
        }
        status
    }

    /// Its exit status when it exits within `timeout` by itself.
    pub(crate) fn exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let status = wait_exit(self.child.as_mut()?, timeout);
        if status.is_some() {
            self.child = None;
        }
        status
    }

    /// What it logged so far.
    pub(crate) fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Consumer {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("--- consumer log at the panic ---\n{}", tail(&self.log, 40));
        }
        self.kill();
    }
}
