//! The command line (every option also reads an environment variable).

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

/// The ingest stream's name (/work/coord/ingest-contract.md, DESIGN.md §7).
pub const DEFAULT_STREAM: &str = "mqtt-ingest";

/// Options of `fleetmq-pg-consumer`.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "fleetmq-pg-consumer",
    version,
    about = "Writes fleetmq's JetStream ingest stream (store.kind = \"jetstream\") into a \
             PostgreSQL table: a durable pull consumer, one transaction per batch, \
             acknowledged after the commit, idempotent on Nats-Msg-Id."
)]
pub struct Options {
    /// NATS server URLs (comma-separated or repeated), the servers the
    /// fleetmq cluster uses (`cluster.nats_urls`).
    #[arg(
        long = "nats-url",
        env = "FLEETMQ_PG_NATS_URL",
        value_delimiter = ',',
        default_value = "nats://127.0.0.1:4222"
    )]
    pub nats_urls: Vec<String>,

    /// NATS credentials file (JWT and NKey seed), when the servers want one.
    #[arg(long, env = "FLEETMQ_PG_NATS_CREDS")]
    pub nats_creds: Option<PathBuf>,

    /// NATS user name (with --nats-password).
    #[arg(long, env = "FLEETMQ_PG_NATS_USER", requires = "nats_password")]
    pub nats_user: Option<String>,

    /// NATS password (with --nats-user).
    #[arg(
        long,
        env = "FLEETMQ_PG_NATS_PASSWORD",
        requires = "nats_user",
        hide_env_values = true
    )]
    pub nats_password: Option<String>,

    /// The ingest stream to read.
    #[arg(long, env = "FLEETMQ_PG_STREAM", default_value = DEFAULT_STREAM)]
    pub stream: String,

    /// The durable consumer's name: created on the stream when missing,
    /// and its position survives restarts of this program and of NATS.
    /// Several copies of this program with the same name share the work.
    #[arg(
        long,
        env = "FLEETMQ_PG_DURABLE",
        default_value = "fleetmq-pg-consumer"
    )]
    pub durable: String,

    /// Which subjects to read: `mqtt-ingest.>` for every workspace,
    /// `mqtt-ingest.<workspace>.>` for one (`_` is the default workspace).
    #[arg(
        long,
        env = "FLEETMQ_PG_FILTER_SUBJECT",
        default_value = "mqtt-ingest.>"
    )]
    pub filter_subject: String,

    /// PostgreSQL connection string (`host=... user=... dbname=...` or
    /// `postgresql://user@host:port/db`). TLS is not supported: connect
    /// over a local socket, loopback or a trusted network.
    #[arg(
        long,
        env = "FLEETMQ_PG_POSTGRES",
        default_value = "host=127.0.0.1 user=postgres dbname=postgres"
    )]
    pub postgres: String,

    /// The table to write (`name` or `schema.name`, letters, digits and
    /// `_`); created when missing.
    #[arg(long, env = "FLEETMQ_PG_TABLE", default_value = "mqtt_ingest", value_parser = parse_table)]
    pub table: String,

    /// Most messages per fetch and per transaction (1..=10000).
    #[arg(
        long,
        env = "FLEETMQ_PG_BATCH_SIZE",
        default_value_t = 500,
        value_parser = clap::value_parser!(u16).range(1..=10_000)
    )]
    pub batch_size: u16,

    /// How long NATS waits for this program's acknowledgement before it
    /// delivers a message again (1s..=1h). A batch that PostgreSQL holds
    /// longer is kept alive with progress acknowledgements.
    #[arg(
        long,
        env = "FLEETMQ_PG_ACK_WAIT",
        default_value = "30s",
        value_parser = parse_ack_wait
    )]
    pub ack_wait: Duration,

    /// How long one fetch waits for a first message when the stream has
    /// none for this consumer (100ms..=30s); also the longest a stop
    /// request waits for an idle fetch.
    #[arg(
        long,
        env = "FLEETMQ_PG_FETCH_WAIT",
        default_value = "1s",
        value_parser = parse_fetch_wait
    )]
    pub fetch_wait: Duration,

    /// How long the first connection to NATS and to PostgreSQL may take
    /// before the program gives up (1s..=5m).
    #[arg(
        long,
        env = "FLEETMQ_PG_CONNECT_TIMEOUT",
        default_value = "5s",
        value_parser = parse_connect_timeout
    )]
    pub connect_timeout: Duration,
}

/// A table name: `name` or `schema.name`, each part 1..=63 ASCII letters,
/// digits or `_`, not starting with a digit (so it can be quoted safely).
fn parse_table(text: &str) -> Result<String, String> {
    let parts: Vec<&str> = text.split('.').collect();
    let valid = |part: &str| {
        (1..=63).contains(&part.len())
            && part.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
            && !part.as_bytes()[0].is_ascii_digit()
    };
    if parts.len() <= 2 && parts.iter().all(|part| valid(part)) {
        Ok(text.to_owned())
    } else {
        Err(
            "a table is `name` or `schema.name`, each 1 to 63 letters, digits or `_`, \
             not starting with a digit"
                .into(),
        )
    }
}

fn parse_duration_in(text: &str, min: Duration, max: Duration) -> Result<Duration, String> {
    let value = humantime::parse_duration(text).map_err(|e| e.to_string())?;
    if value < min || value > max {
        return Err(format!(
            "{} is outside {}..={}",
            humantime::format_duration(value),
            humantime::format_duration(min),
            humantime::format_duration(max)
        ));
    }
    Ok(value)
}

fn parse_ack_wait(text: &str) -> Result<Duration, String> {
    parse_duration_in(text, Duration::from_secs(1), Duration::from_secs(3600))
}

fn parse_fetch_wait(text: &str) -> Result<Duration, String> {
    parse_duration_in(text, Duration::from_millis(100), Duration::from_secs(30))
}

fn parse_connect_timeout(text: &str) -> Result<Duration, String> {
    parse_duration_in(text, Duration::from_secs(1), Duration::from_secs(300))
}

impl Options {
    /// The table name quoted for SQL: `"name"` or `"schema"."name"`.
    pub fn quoted_table(&self) -> String {
        self.table
            .split('.')
            .map(|part| format!("\"{part}\""))
            .collect::<Vec<_>>()
            .join(".")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_table_name_with_a_quote_or_a_space_is_refused() {
        assert!(parse_table("mqtt_ingest").is_ok());
        assert!(parse_table("history.mqtt_ingest").is_ok());
        for bad in [
            "",
            "a\"b",
            "a b",
            "a.b.c",
            "1abc",
            "a;drop",
            ".a",
            &"x".repeat(64),
        ] {
            assert!(parse_table(bad).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn durations_outside_their_range_are_refused() {
        assert_eq!(parse_ack_wait("30s"), Ok(Duration::from_secs(30)));
        assert!(parse_ack_wait("500ms").is_err());
        assert!(parse_ack_wait("2h").is_err());
        assert!(parse_fetch_wait("50ms").is_err());
        assert!(parse_fetch_wait("soon").is_err());
    }

    #[test]
    fn the_defaults_parse_and_quote_the_table() {
        let options = Options::try_parse_from(["fleetmq-pg-consumer", "--table", "h.t"]).unwrap();
        assert_eq!(options.quoted_table(), "\"h\".\"t\"");
        assert_eq!(options.stream, DEFAULT_STREAM);
        assert_eq!(options.batch_size, 500);
        assert!(Options::try_parse_from(["x", "--batch-size", "0"]).is_err());
        assert!(Options::try_parse_from(["x", "--nats-user", "u"]).is_err());
    }
}
