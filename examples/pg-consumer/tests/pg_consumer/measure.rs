//! Throughput of the consumer (not run by default: `cargo nextest run -p
//! fleetmq-pg-consumer --run-ignored only measure`, with
//! `FLEETMQ_PG_CONSUMER_BIN=target/release/fleetmq-pg-consumer` for the
//! release build; perf/RESULTS.md quotes it).

use std::time::{Duration, Instant};

use async_nats::jetstream;

use crate::ingest::{count, create_stream, publish, Consumer, Value};
use crate::servers::{Nats, Postgres};

/// The backlog drained per run.
const BACKLOG: u32 = 100_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: prints rows/s"]
async fn measure_rows_per_second_draining_a_backlog() {
    let nats = Nats::start();
    let js = jetstream::new(
        async_nats::connect(nats.url())
            .await
            .expect("connect to NATS"),
    );
    create_stream(&js).await;
    let values: Vec<Value> = (0..BACKLOG)
        .map(|i| Value::numbered(&format!("m{}", i % 100), i))
        .collect();
    publish(&js, &values).await;
    for fsync in [false, true] {
        for batch in ["100", "500", "2000"] {
            let postgres = Postgres::start_with_fsync(fsync);
            let pg = postgres.client().await;
            let durable = format!("measure-{batch}-{fsync}");
            let started = Instant::now();
            let mut consumer = Consumer::start(
                &nats.url(),
                &postgres.url(),
                &["--batch-size", batch, "--durable", &durable],
            );
            let mut rows = 0;
            while rows < i64::from(BACKLOG) {
                assert!(
                    started.elapsed() < Duration::from_secs(300),
                    "{rows} rows in 300 s"
                );
                assert!(
                    consumer.exit(Duration::ZERO).is_none(),
                    "{}",
                    consumer.log()
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
                rows = count(&pg, "mqtt_ingest").await;
            }
            let elapsed = started.elapsed();
            assert!(consumer.terminate().is_some_and(|s| s.success()));
            println!(
                "fsync={fsync} batch={batch}: {BACKLOG} rows in {:.2} s = {:.0} rows/s (from the consumer's start)",
                elapsed.as_secs_f64(),
                f64::from(BACKLOG) / elapsed.as_secs_f64()
            );
        }
    }
}
