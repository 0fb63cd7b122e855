//! End-to-end tests of `fleetmq-pg-consumer`: the real binary between a
//! real nats-server (JetStream) and a real PostgreSQL.

/// PostgreSQL and nats-server on free ports, cleaned up on drop.
#[path = "pg_consumer/servers.rs"]
mod servers;

/// The ingest stream, publishers and the consumer process.
#[path = "pg_consumer/ingest.rs"]
mod ingest;

/// Delivered again, PostgreSQL away: nothing lost, nothing twice.
#[path = "pg_consumer/exactly_once.rs"]
mod exactly_once;

/// MQTT publishers through a fleetmq replica into the table, the consumer
/// killed mid-stream.
#[path = "pg_consumer/through_fleetmq.rs"]
mod through_fleetmq;

/// What it says and how it exits when a server is away.
#[path = "pg_consumer/startup.rs"]
mod startup;

/// Rows per second (ignored by default).
#[path = "pg_consumer/measure.rs"]
mod measure;
