//! The consumer's promise: every value of the stream ends up in the table
//! exactly once, whatever happens to the consumer between fetch, commit and
//! acknowledgement.

use std::collections::HashMap;
use std::time::Duration;

use async_nats::jetstream;
use async_nats::HeaderMap;
use bytes::Bytes;

use crate::ingest::{
    count, create_stream, publish, wait_all_acknowledged, wait_for_rows, Consumer, Value,
};
use crate::servers::{Nats, Postgres};

/// The table the consumer writes by default.
const TABLE: &str = "mqtt_ingest";

/// Every row by msg_id: (topic, qos, client_id, payload).
async fn rows(
    pg: &tokio_postgres::Client,
) -> HashMap<String, (Option<String>, Option<i16>, Option<String>, Vec<u8>)> {
    pg.query(
        &format!("SELECT msg_id, topic, qos, client_id, payload FROM {TABLE}"),
        &[],
    )
    .await
    .expect("read the table")
    .into_iter()
    .map(|row| (row.get(0), (row.get(1), row.get(2), row.get(3), row.get(4))))
    .collect()
}

/// A nats-server with the ingest stream, a PostgreSQL, a JetStream context
/// and a PostgreSQL client.
async fn start() -> (Nats, Postgres, jetstream::Context, tokio_postgres::Client) {
    let nats = Nats::start();
    let postgres = Postgres::start();
    let js = jetstream::new(
        async_nats::connect(nats.url())
            .await
            .expect("connect to NATS"),
    );
    create_stream(&js).await;
    let pg = postgres.client().await;
    (nats, postgres, js, pg)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_value_is_in_the_table_exactly_once_after_the_consumer_is_killed_mid_stream() {
    const VALUES: u32 = 20_000;
    let (nats, postgres, js, pg) = start().await;

    let values: Vec<Value> = (0..VALUES)
        .map(|i| Value::numbered(&format!("c{}", i % 4), i))
        .collect();
    // Values keep arriving (250 every 20 ms) while the consumer is killed
    // and started again.
    let publisher = {
        let (js, values) = (js.clone(), values.clone());
        tokio::spawn(async move {
            for chunk in values.chunks(250) {
                publish(&js, chunk).await;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    let mut consumer = Consumer::start(&nats.url(), &postgres.url(), &["--batch-size", "100"]);
    let seen = wait_for_rows(&pg, TABLE, 2_000, Duration::from_secs(20)).await;
    consumer.kill();
    let at_kill = count(&pg, TABLE).await;
    assert!(
        seen >= 2_000,
        "the consumer wrote {seen} rows in 20 s:\n{}",
        consumer.log()
    );
    assert!(
        at_kill < i64::from(VALUES),
        "killed after the last value: not mid-stream"
    );

    // Its unacknowledged batch comes again after the 2 s ack wait, to the
    // consumer started again under the same durable name.
    let mut consumer = Consumer::start(&nats.url(), &postgres.url(), &["--batch-size", "100"]);
    publisher.await.expect("the publisher");
    let seen = wait_for_rows(&pg, TABLE, i64::from(VALUES), Duration::from_secs(20)).await;
    assert_eq!(
        seen,
        i64::from(VALUES),
        "rows after the restart (killed at {at_kill})"
    );
    wait_all_acknowledged(&js, "fleetmq-pg-consumer").await;
    assert_eq!(
        count(&pg, TABLE).await,
        i64::from(VALUES),
        "no row twice, none extra"
    );

    let rows = rows(&pg).await;
    for value in &values {
        let row = rows
            .get(&value.msg_id)
            .unwrap_or_else(|| panic!("{} is missing", value.msg_id));
        assert_eq!(
            row,
            &(
                Some(value.topic.clone()),
                Some(1),
                Some(value.client_id.clone()),
                value.payload.clone()
            )
        );
    }

    let status = consumer
        .terminate()
        .expect("it stops within 10 s of SIGTERM");
    assert!(status.success(), "exit status after SIGTERM: {status}");
    assert!(consumer.log().contains("stopped"), "{}", consumer.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_value_delivered_again_is_not_written_twice_and_every_header_has_its_column() {
    let (nats, postgres, js, pg) = start().await;
    let values: Vec<Value> = (0..300).map(|i| Value::numbered("d", i)).collect();
    publish(&js, &values).await;
    // One with every optional header, one with none at all.
    let mut headers = HeaderMap::new();
    for (name, value) in [
        ("Nats-Msg-Id", "acme:1"),
        ("Mqtt-Topic", "plant/1/temp"),
        ("Mqtt-Qos", "2"),
        ("Mqtt-Client-Id", "sensor-1"),
        ("Mqtt-Retain", "1"),
        ("Mqtt-Workspace", "acme"),
    ] {
        headers.insert(name, value);
    }
    js.publish_with_headers("mqtt-ingest.acme", headers, Bytes::from_static(b"21.5"))
        .await
        .expect("publish")
        .await
        .expect("stored");
    let bare = js
        .publish("mqtt-ingest._", Bytes::from_static(b"no headers"))
        .await
        .expect("publish")
        .await
        .expect("stored");

    let mut first = Consumer::start(&nats.url(), &postgres.url(), &["--durable", "first"]);
    assert_eq!(
        wait_for_rows(&pg, TABLE, 302, Duration::from_secs(20)).await,
        302
    );
    wait_all_acknowledged(&js, "first").await;
    assert!(first.terminate().is_some_and(|s| s.success()));
    let written_at = "SELECT max(written_at)::text FROM mqtt_ingest";
    let before: String = pg.query_one(written_at, &[]).await.expect("query").get(0);

    // A second durable reads the whole stream again: every value is
    // delivered a second time and none is written again.
    let mut second = Consumer::start(&nats.url(), &postgres.url(), &["--durable", "second"]);
    wait_all_acknowledged(&js, "second").await;
    assert!(second.terminate().is_some_and(|s| s.success()));
    assert_eq!(count(&pg, TABLE).await, 302);
    let after: String = pg.query_one(written_at, &[]).await.expect("query").get(0);
    assert_eq!(before, after, "a row was written again");
    // 302 duplicates, or more when a slow commit outlived the 2 s ack wait
    // and a batch came twice.
    assert!(second.log().contains("stopped written=0 duplicates=3"), "{}", second.log());

    let row = pg
        .query_one(
            "SELECT topic, qos, retain, client_id, workspace, payload, subject FROM mqtt_ingest \
             WHERE msg_id = 'acme:1'",
            &[],
        )
        .await
        .expect("the acme row");
    assert_eq!(
        row.get::<_, Option<String>>(0).as_deref(),
        Some("plant/1/temp")
    );
    assert_eq!(row.get::<_, Option<i16>>(1), Some(2));
    assert!(row.get::<_, bool>(2));
    assert_eq!(row.get::<_, Option<String>>(3).as_deref(), Some("sensor-1"));
    assert_eq!(row.get::<_, Option<String>>(4).as_deref(), Some("acme"));
    assert_eq!(row.get::<_, Vec<u8>>(5), b"21.5");
    assert_eq!(row.get::<_, String>(6), "mqtt-ingest.acme");

    let key = format!("stream-seq:{}", bare.sequence);
    let row = pg
        .query_one(
            "SELECT topic, qos, client_id, workspace, payload FROM mqtt_ingest WHERE msg_id = $1",
            &[&key],
        )
        .await
        .expect("the row without headers is kept");
    assert_eq!(row.get::<_, Option<String>>(0), None);
    assert_eq!(row.get::<_, Option<i16>>(1), None);
    assert_eq!(row.get::<_, Option<String>>(2), None);
    assert_eq!(row.get::<_, Option<String>>(3), None);
    assert_eq!(row.get::<_, Vec<u8>>(4), b"no headers");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn values_that_arrive_while_postgresql_is_down_are_written_when_it_is_back() {
    let (nats, mut postgres, js, pg) = start().await;
    let before: Vec<Value> = (0..200).map(|i| Value::numbered("e", i)).collect();
    let during: Vec<Value> = (200..400).map(|i| Value::numbered("e", i)).collect();
    let mut consumer = Consumer::start(&nats.url(), &postgres.url(), &[]);
    publish(&js, &before).await;
    assert_eq!(
        wait_for_rows(&pg, TABLE, 200, Duration::from_secs(20)).await,
        200
    );
    drop(pg);

    postgres.stop_server();
    publish(&js, &during).await;
    // Longer than the 2 s ack wait: the batch in hand is kept alive, or
    // delivered again, and either way written once.
    tokio::time::sleep(Duration::from_secs(3)).await;
    postgres.start_again();

    let pg = postgres.client().await;
    assert_eq!(
        wait_for_rows(&pg, TABLE, 400, Duration::from_secs(20)).await,
        400
    );
    wait_all_acknowledged(&js, "fleetmq-pg-consumer").await;
    assert_eq!(count(&pg, TABLE).await, 400);
    let log = consumer.log();
    assert!(
        log.contains("writing a batch to PostgreSQL failed; retrying"),
        "{log}"
    );
    assert!(log.contains("reconnected to PostgreSQL"), "{log}");
    assert!(consumer.terminate().is_some_and(|s| s.success()));
}
