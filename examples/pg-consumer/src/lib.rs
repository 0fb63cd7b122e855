//! fleetmq-pg-consumer: writes fleetmq's ingest stream into PostgreSQL.
//!
//! With `store.kind = "jetstream"`, fleetmq appends every accepted QoS 1/2
//! PUBLISH to the JetStream stream `mqtt-ingest` before it acknowledges it
//! (DESIGN.md §7; the headers are fixed in the ingest contract, see
//! [`row`]). This program reads that stream with a durable pull consumer and
//! explicit acknowledgements, writes each batch into a table in one
//! transaction and acknowledges the batch's messages only after the commit:
//! JetStream is the durable buffer between the broker and the database. The
//! table's primary key is `Nats-Msg-Id` (`ON CONFLICT DO NOTHING`), so a
//! value delivered again after a crash between commit and acknowledgement is
//! not written twice.
//!
//! The library is [`run`] with its [`Options`]; the binary parses the
//! options, sets up logging and turns SIGTERM/SIGINT into a stop.

pub mod options;
pub mod row;
pub mod run;
pub mod table;

pub use options::Options;
pub use run::{run, Summary};

/// Why the consumer could not start. Once running, failures are retried
/// and logged, never returned.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// `--postgres` is not a valid connection string.
    #[error("the PostgreSQL connection string is not valid: {0}")]
    PostgresConfig(String),
    /// PostgreSQL refused or did not answer within `--connect-timeout`.
    #[error("PostgreSQL ({target}) is unreachable: {why}")]
    PostgresUnreachable {
        /// Hosts and ports (no password).
        target: String,
        /// The driver's error.
        why: String,
    },
    /// `CREATE TABLE IF NOT EXISTS` failed.
    #[error("PostgreSQL refused to create the table {table}: {source}")]
    CreateTable {
        /// The quoted table name.
        table: String,
        /// The driver's error.
        source: tokio_postgres::Error,
    },
    /// No NATS server of `--nats-url` accepted a connection within
    /// `--connect-timeout` (or a URL or the credentials file is bad).
    #[error("NATS ({urls}) is unreachable: {why}")]
    NatsUnreachable {
        /// The URLs tried.
        urls: String,
        /// The client's error.
        why: String,
    },
    /// The NATS account has no JetStream.
    #[error("NATS answered but its JetStream is not available: {0}")]
    NoJetStream(String),
    /// Creating or updating the durable consumer failed.
    #[error("cannot create the durable consumer {durable} on stream {stream}: {why}")]
    Consumer {
        /// `--durable`.
        durable: String,
        /// `--stream`.
        stream: String,
        /// JetStream's error.
        why: String,
    },
}
