//! At start, an unreachable server is a clear message and a non-zero exit,
//! not a silent retry loop.

use std::time::Duration;

use crate::ingest::Consumer;
use crate::servers::{free_port, Postgres};

#[test]
fn it_exits_non_zero_naming_postgresql_or_nats_when_either_is_unreachable_at_start() {
    let closed = free_port();
    let pg_away = format!("host=127.0.0.1 port={closed} user=postgres");
    let nats_away = format!("nats://127.0.0.1:{closed}");

    let mut consumer = Consumer::start(&nats_away, &pg_away, &["--connect-timeout", "2s"]);
    let status = consumer.exit(Duration::from_secs(10)).expect("it exits");
    assert_eq!(status.code(), Some(1));
    let log = consumer.log();
    assert!(
        log.contains("PostgreSQL (host 127.0.0.1 port") && log.contains("Connection refused"),
        "{log}"
    );

    let postgres = Postgres::start();
    let mut consumer = Consumer::start(&nats_away, &postgres.url(), &["--connect-timeout", "2s"]);
    let status = consumer.exit(Duration::from_secs(10)).expect("it exits");
    assert_eq!(status.code(), Some(1));
    let log = consumer.log();
    assert!(
        log.contains(&format!("NATS ({nats_away}) is unreachable")),
        "{log}"
    );
}
