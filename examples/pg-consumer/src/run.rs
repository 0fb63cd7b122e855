//! The consumer loop: fetch a batch, write it in one transaction, then
//! acknowledge every message of it.

use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer, consumer::PullConsumer, stream};
use futures_util::StreamExt;
use tokio::sync::watch;
use tokio_postgres::{Client, NoTls};
use tracing::{debug, error, info, warn};

use crate::options::Options;
use crate::row::Row;
use crate::table;
use crate::Error;

/// How often the progress line is logged while values flow.
const PROGRESS_EVERY: Duration = Duration::from_secs(10);

/// The pause between two attempts when NATS or PostgreSQL fails while
/// running (doubled up to [`MAX_BACKOFF`]).
const FIRST_BACKOFF: Duration = Duration::from_millis(200);
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// What one run did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Summary {
    /// Rows committed that were not in the table yet.
    pub written: u64,
    /// Messages already in the table (a redelivery): acknowledged, not
    /// written again.
    pub duplicates: u64,
    /// Messages that lacked a header of the contract (stored anyway).
    pub incomplete: u64,
    /// Transactions committed.
    pub batches: u64,
}

/// Connects to PostgreSQL (creating the table) and NATS, then writes the
/// stream into the table until `stop` turns true; the batch being written
/// then is finished and acknowledged first.
///
/// While running, a failing PostgreSQL or NATS is retried (with a backoff
/// up to 5 s, logged), never given up: a batch not yet committed is kept
/// alive with progress acknowledgements and written when PostgreSQL is
/// back; a stream that does not exist yet is waited for.
///
/// # Errors
///
/// Only at start: PostgreSQL or NATS unreachable within
/// `--connect-timeout`, the table cannot be created, NATS has no
/// JetStream, or the durable consumer cannot be created.
pub async fn run(options: &Options, mut stop: watch::Receiver<bool>) -> Result<Summary, Error> {
    let mut pg = connect_postgres(options).await?;
    let table = options.quoted_table();
    table::create_table(&pg, &table)
        .await
        .map_err(|source| Error::CreateTable {
            table: table.clone(),
            source,
        })?;
    let nats = connect_nats(options).await?;
    let js = jetstream::new(nats.clone());
    js.query_account()
        .await
        .map_err(|e| Error::NoJetStream(e.to_string()))?;
    info!(urls = ?options.nats_urls, table = %table, "connected to NATS and PostgreSQL");

    let Some(stream) = wait_for_stream(&js, &options.stream, &mut stop).await else {
        return Ok(Summary::default());
    };
    let consumer = create_consumer(&stream, options).await?;
    info!(
        stream = %options.stream,
        durable = %options.durable,
        filter = %options.filter_subject,
        "reading"
    );

    let mut summary = Summary::default();
    let mut window = (Instant::now(), Summary::default());
    let mut backoff = FIRST_BACKOFF;
    while !*stop.borrow() {
        let batch = match fetch(&consumer, options).await {
            Ok(batch) => {
                backoff = FIRST_BACKOFF;
                batch
            }
            Err(why) => {
                warn!(error = %why, "fetching from the stream failed; retrying");
                pause(&mut backoff, &mut stop).await;
                continue;
            }
        };
        if batch.is_empty() {
            continue;
        }
        let Some(done) = write(&mut pg, options, &table, &batch, &mut stop).await else {
            warn!(
                messages = batch.len(),
                "stopping with a batch PostgreSQL did not take: handed back to NATS"
            );
            hand_back(&nats, &batch).await;
            break;
        };
        acknowledge(&nats, &batch).await;
        summary.written += done.written;
        summary.duplicates += done.duplicates;
        summary.incomplete += done.incomplete;
        summary.batches += 1;
        log_progress(&mut window, &summary, &batch);
    }
    info!(
        written = summary.written,
        duplicates = summary.duplicates,
        batches = summary.batches,
        "stopped"
    );
    Ok(summary)
}

/// Connects to PostgreSQL within `--connect-timeout`; the connection's task
/// runs on the runtime until the connection closes.
async fn connect_postgres(options: &Options) -> Result<Client, Error> {
    let mut config: tokio_postgres::Config = options
        .postgres
        .parse()
        .map_err(|e: tokio_postgres::Error| Error::PostgresConfig(e.to_string()))?;
    config.connect_timeout(options.connect_timeout);
    let target = postgres_target(&config);
    let connect = config.connect(NoTls);
    let (client, connection) = tokio::time::timeout(options.connect_timeout, connect)
        .await
        .map_err(|_| Error::PostgresUnreachable {
            target: target.clone(),
            why: format!("no answer within {:?}", options.connect_timeout),
        })?
        .map_err(|e| Error::PostgresUnreachable {
            target,
            why: with_sources(&e),
        })?;
    tokio::spawn(async move {
        if let Err(why) = connection.await {
            warn!(error = %why, "PostgreSQL connection closed");
        }
    });
    Ok(client)
}

/// Where a PostgreSQL config points (hosts and ports; never the password).
fn postgres_target(config: &tokio_postgres::Config) -> String {
    let hosts: Vec<String> = config
        .get_hosts()
        .iter()
        .map(|host| match host {
            tokio_postgres::config::Host::Tcp(name) => name.clone(),
            tokio_postgres::config::Host::Unix(path) => path.display().to_string(),
        })
        .collect();
    let ports: Vec<String> = config.get_ports().iter().map(u16::to_string).collect();
    let ports = if ports.is_empty() {
        "5432".to_owned()
    } else {
        ports.join(",")
    };
    format!("host {} port {ports}", hosts.join(","))
}

/// An error and its sources, `a: b: c` (tokio-postgres and async-nats put
/// the cause, e.g. "Connection refused", in the source).
fn with_sources(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let more = cause.to_string();
        if !text.contains(&more) {
            text = format!("{text}: {more}");
        }
        source = cause.source();
    }
    text
}

/// Connects to NATS within `--connect-timeout` (one attempt per URL; the
/// client reconnects by itself afterwards).
async fn connect_nats(options: &Options) -> Result<async_nats::Client, Error> {
    let unreachable = |why: String| Error::NatsUnreachable {
        urls: options.nats_urls.join(","),
        why,
    };
    let mut addrs = Vec::new();
    for url in &options.nats_urls {
        let addr: async_nats::ServerAddr = url
            .parse()
            .map_err(|e| unreachable(format!("bad URL {url:?}: {e}")))?;
        addrs.push(addr);
    }
    let mut connect = async_nats::ConnectOptions::new()
        .name("fleetmq-pg-consumer")
        .connection_timeout(options.connect_timeout)
        // Notice a silent server within ~30 s, not the default ~2-3 min
        // (DESIGN.md §14).
        .ping_interval(Duration::from_secs(10))
        .max_reconnects(None);
    if let Some(path) = &options.nats_creds {
        connect = connect
            .credentials_file(path)
            .await
            .map_err(|e| unreachable(format!("credentials file {}: {e}", path.display())))?;
    }
    if let (Some(user), Some(password)) = (&options.nats_user, &options.nats_password) {
        connect = connect.user_and_password(user.clone(), password.clone());
    }
    tokio::time::timeout(options.connect_timeout, connect.connect(addrs))
        .await
        .map_err(|_| unreachable(format!("no answer within {:?}", options.connect_timeout)))?
        .map_err(|e| unreachable(with_sources(&e)))
}

/// The stream, waited for (checked every second, logged every 10 s) while
/// it does not exist; `None` when told to stop meanwhile.
async fn wait_for_stream(
    js: &jetstream::Context,
    name: &str,
    stop: &mut watch::Receiver<bool>,
) -> Option<stream::Stream> {
    let mut logged: Option<Instant> = None;
    while !*stop.borrow() {
        match js.get_stream(name).await {
            Ok(stream) => return Some(stream),
            Err(why) => {
                if logged.is_none_or(|at| at.elapsed() >= PROGRESS_EVERY) {
                    warn!(
                        stream = name,
                        error = %why,
                        "waiting for the ingest stream (fleetmq with store.kind = \"jetstream\" creates it)"
                    );
                    logged = Some(Instant::now());
                }
                let _ = tokio::time::timeout(Duration::from_secs(1), stop.changed()).await;
            }
        }
    }
    None
}

/// Creates the durable pull consumer, or updates it to these options.
async fn create_consumer(
    stream: &stream::Stream,
    options: &Options,
) -> Result<PullConsumer, Error> {
    let config = consumer::pull::Config {
        durable_name: Some(options.durable.clone()),
        filter_subject: options.filter_subject.clone(),
        ack_policy: consumer::AckPolicy::Explicit,
        ack_wait: options.ack_wait,
        deliver_policy: consumer::DeliverPolicy::All,
        // Room for the batch in hand and one more (messages acknowledged
        // but not yet counted by the server).
        max_ack_pending: 2 * i64::from(options.batch_size),
        ..Default::default()
    };
    stream
        .create_consumer(config)
        .await
        .map_err(|e| Error::Consumer {
            durable: options.durable.clone(),
            stream: options.stream.clone(),
            why: e.to_string(),
        })
}

/// One fetch: waits up to `--fetch-wait` for a first message, then takes
/// what is there, `--batch-size` at most.
async fn fetch(
    consumer: &PullConsumer,
    options: &Options,
) -> Result<Vec<jetstream::Message>, async_nats::Error> {
    let mut messages = consumer
        .fetch()
        .max_messages(usize::from(options.batch_size))
        .expires(options.fetch_wait)
        .messages()
        .await?;
    let mut batch = Vec::with_capacity(usize::from(options.batch_size));
    while let Some(message) = messages.next().await {
        match message {
            Ok(message) => batch.push(message),
            // 409 (e.g. the consumer was deleted) ends the fetch: keep what
            // came before it, and fail only when nothing did.
            Err(why) if batch.is_empty() => return Err(why),
            Err(why) => {
                debug!(error = %why, "fetch ended early");
                break;
            }
        }
    }
    Ok(batch)
}

/// What one committed batch did.
struct Written {
    written: u64,
    duplicates: u64,
    incomplete: u64,
}

/// Writes `batch` in one transaction, retrying (reconnecting to PostgreSQL
/// when the connection broke) until it commits; `None` when told to stop
/// before it could.
async fn write(
    pg: &mut Client,
    options: &Options,
    table: &str,
    batch: &[jetstream::Message],
    stop: &mut watch::Receiver<bool>,
) -> Option<Written> {
    let mut incomplete = 0;
    let rows: Vec<Row> = batch
        .iter()
        .map(|message| {
            let (seq, received_at) = match message.info() {
                Ok(info) => (info.stream_sequence, info.published.into()),
                Err(_) => (0, std::time::SystemTime::now()),
            };
            let (row, complete) = Row::from_parts(
                message.subject.as_str(),
                message.headers.as_ref(),
                message.payload.clone(),
                seq,
                received_at,
            );
            if !complete {
                incomplete += 1;
                warn!(seq, subject = %message.subject, "a message lacks a header of the ingest contract; stored with NULLs");
            }
            row
        })
        .collect();
    let mut backoff = FIRST_BACKOFF;
    let mut kept_alive = Instant::now();
    loop {
        match table::write_batch(pg, table, &rows).await {
            Ok(written) => {
                return Some(Written {
                    written,
                    duplicates: rows.len() as u64 - written,
                    incomplete,
                });
            }
            Err(why) => {
                error!(error = %why, rows = rows.len(), "writing a batch to PostgreSQL failed; retrying")
            }
        }
        if *stop.borrow() {
            return None;
        }
        pause(&mut backoff, stop).await;
        if kept_alive.elapsed() >= options.ack_wait / 2 {
            for message in batch {
                let _ = message.ack_with(jetstream::AckKind::Progress).await;
            }
            kept_alive = Instant::now();
        }
        if pg.is_closed() {
            match connect_postgres(options).await {
                Ok(client) => {
                    info!("reconnected to PostgreSQL");
                    *pg = client;
                }
                Err(why) => warn!(error = %why, "PostgreSQL still unreachable"),
            }
        }
    }
}

/// Acknowledges every message of a committed batch and flushes them out; a
/// lost acknowledgement only means a redelivery, which writes nothing
/// twice.
async fn acknowledge(nats: &async_nats::Client, batch: &[jetstream::Message]) {
    let mut failed = 0;
    for message in batch {
        if message.ack().await.is_err() {
            failed += 1;
        }
    }
    if let Err(why) = nats.flush().await {
        warn!(error = %why, "flushing acknowledgements failed");
    }
    if failed > 0 {
        warn!(
            failed,
            "acknowledgements not sent: those messages come again and are skipped"
        );
    }
}

/// Negative acknowledgements for messages fetched but not written (a stop
/// while PostgreSQL is away), so NATS delivers them again at once instead
/// of after the ack wait.
async fn hand_back(nats: &async_nats::Client, batch: &[jetstream::Message]) {
    for message in batch {
        let _ = message.ack_with(jetstream::AckKind::Nak(None)).await;
    }
    let _ = nats.flush().await;
}

/// Sleeps `backoff` (or until told to stop) and doubles it up to the cap.
async fn pause(backoff: &mut Duration, stop: &mut watch::Receiver<bool>) {
    let _ = tokio::time::timeout(*backoff, stop.changed()).await;
    *backoff = (*backoff * 2).min(MAX_BACKOFF);
}

/// Logs the rows written over the last [`PROGRESS_EVERY`].
fn log_progress(window: &mut (Instant, Summary), now: &Summary, batch: &[jetstream::Message]) {
    let elapsed = window.0.elapsed();
    if elapsed < PROGRESS_EVERY {
        return;
    }
    let written = now.written - window.1.written;
    let last_seq = batch
        .last()
        .and_then(|m| m.info().ok())
        .map(|i| i.stream_sequence);
    info!(
        written,
        duplicates = now.duplicates - window.1.duplicates,
        rows_per_s = (written as f64 / elapsed.as_secs_f64()).round(),
        last_seq,
        "progress"
    );
    *window = (Instant::now(), *now);
}
