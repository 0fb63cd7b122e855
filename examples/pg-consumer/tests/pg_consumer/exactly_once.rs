//! The consumer's promise: every value of the stream ends up in the table
//! exactly once, whatever happens to the consumer between fetch, commit and
//! acknowledgement.

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
    // Its stderr is a file, not a terminal: no colour codes in the log.
    assert!(!second.log().contains('\u{1b}'), "ANSI escape codes in a log file: {:?}", second.log());

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
