//! Session logs (DESIGN.md §4, §7; issue 24; the encoding is
//! [`fleetmq_core::cluster::session_log`]'s): the streams, created on a
//! workspace's first append, and what the other replicas' persistent
//! sessions want, from the watch of `mqtt-session-state`.
//!
//! # The streams
//! `LOG_mqtt-sessions-<workspace token>`, subject
//! `mqtt-sessions.<workspace token>`: file storage,
//! `cluster.nats_replicas` copies, limits retention, `max_age` =
//! `limits.max_session_expiry` (no session waits longer for a value),
//! `max_bytes` = `cluster.session_log_max_bytes` with discard old (a log
//! full drops its oldest values: a session that had not read them misses
//! them, counted at its resume), direct gets allowed (backlogs are read
//! with batched direct gets), a duplicate window of 2 minutes (at most
//! `max_age`) on the ingest append's `Nats-Msg-Id`. Created lazily, on the
//! first value a workspace's log takes, by whichever replica appends it
//! first (a stream per workspace that never had a persistent session
//! would be waste); checked like the other streams (every flag echoed
//! back; limits other than the settings' updated to them). One check per
//! workspace per process: concurrent first appends wait for one.
//!
//! # Interest
//! Every persistent session record of another replica, as the watch
//! brings it, sets that session's entry of the shared
//! [`Interest`](fleetmq_core::cluster::session_log::Interest); a delete
//! removes it. This process's own records are left out: its shards set
//! their sessions' entries themselves, before the SUBACK. Records an
//! earlier process of this replica ID wrote (before a restart) are not:
//! those sessions wait offline for their clients, or for the sweeper to
//! end them when they expire ([`crate::expiry`]).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::kv::Operation;
use async_nats::jetstream::stream::{Config, DiscardPolicy, RetentionPolicy, StorageType};
use fleetmq_core::cluster::records::{bucket, Record as _};
use fleetmq_core::cluster::session_log::{decode, interest_key_of_record, logged_filters, stream, subject};
use futures_util::StreamExt;
use fleetmq_core::cluster::sessions::SessionRecord;
use tokio::time::Instant;

use crate::bridge::Shared;
use crate::request::{Event, LogBatch, LogEntry};
use crate::watch::{follow, Seen, Start};

/// The duplicate window of a session log, at most its `max_age`.
const DUPLICATE_WINDOW: Duration = Duration::from_secs(120);

/// The config of `workspace`'s session log: `max_bytes` and `max_age` as
/// given, `replicas` copies.
pub(crate) fn config(workspace: &str, max_bytes: usize, max_age: Duration, replicas: usize) -> Config {
    // `limits.max_session_expiry = 0s` (no session outlives its
    // connection) is not JetStream's 0, "kept for ever".
    let max_age = max_age.max(LEAST_AGE);
    Config {
        name: stream(workspace),
        subjects: vec![subject(workspace)],
        retention: RetentionPolicy::Limits,
        discard: DiscardPolicy::Old,
        max_bytes: i64::try_from(max_bytes).unwrap_or(i64::MAX),
        max_age,
        duplicate_window: DUPLICATE_WINDOW.min(max_age),
        allow_direct: true,
        num_replicas: replicas,
        storage: StorageType::File,
        ..Config::default()
    }
}

/// The shortest `max_age` of a session log.
const LEAST_AGE: Duration = Duration::from_secs(1);

/// What of `want` the stream's `got` config lacks: `(field, wanted,
/// found)`, the field named with the setting it comes from.
pub(crate) fn mismatches(want: &Config, got: &Config) -> Vec<(&'static str, String, String)> {
    let mut out = Vec::new();
    let mut check = |field: &'static str, w: String, g: String| {
        if w != g {
            out.push((field, w, g));
        }
    };
    check("subjects", want.subjects.join(","), got.subjects.join(","));
    check("retention", format!("{:?}", want.retention), format!("{:?}", got.retention));
    check("discard", format!("{:?}", want.discard), format!("{:?}", got.discard));
    check("allow_direct", want.allow_direct.to_string(), got.allow_direct.to_string());
    check("max_bytes (cluster.session_log_max_bytes)", want.max_bytes.to_string(), got.max_bytes.to_string());
    check("max_age (limits.max_session_expiry)", format!("{:?}", want.max_age), format!("{:?}", got.max_age));
    check("duplicate_window", format!("{:?}", want.duplicate_window), format!("{:?}", got.duplicate_window));
    check("num_replicas (cluster.nats_replicas)", want.num_replicas.to_string(), got.num_replicas.to_string());
    check("storage", format!("{:?}", want.storage), format!("{:?}", got.storage));
    out
}

/// The fields [`ensure`] updates to the settings when a stream has others.
const LIMITS: [&str; 3] = ["max_bytes (cluster.session_log_max_bytes)", "max_age (limits.max_session_expiry)", "duplicate_window"];

/// Make sure `workspace`'s session log exists as the settings ask, by
/// `deadline` (once per process and workspace; a failure is tried again by
/// the next append).
///
/// # Errors
/// Why not (JetStream did not answer, or the stream differs in what
/// cannot be changed): the value is refused (MQTT 5: 0x80).
pub(crate) async fn ensure(shared: &Shared, workspace: &str, deadline: Instant) -> Result<(), String> {
    let name = stream(workspace);
    let cell = {
        let Ok(mut logs) = shared.logs.lock() else { return Err("poisoned".to_owned()) };
        logs.entry(name.clone()).or_default().clone()
    };
    if cell.initialized() {
        return Ok(());
    }
    let made = cell.get_or_try_init(|| async {
        match tokio::time::timeout_at(deadline, create_or_check(shared, workspace)).await {
            Ok(outcome) => outcome,
            Err(_) => Err(format!("stream {name}: not created or checked in time")),
        }
    });
    made.await.map(|_| ()).map_err(|e| {
        tracing::warn!(target: "cluster", stream = %name, error = %e, "cluster: session log not ready");
        e
    })
}

/// Create `workspace`'s session log, or check (and update the limits of)
/// the one there.
async fn create_or_check(shared: &Shared, workspace: &str) -> Result<(), String> {
    let cluster = &shared.config.cluster;
    let want = config(
        workspace,
        cluster.session_log_max_bytes,
        shared.config.session_log_max_age,
        usize::from(cluster.nats_replicas),
    );
    let js = &shared.state;
    let mut got = crate::setup::stream_config(js, &want).await.map_err(|e| e.to_string())?;
    let wrong = mismatches(&want, &got);
    if !wrong.is_empty() && wrong.iter().all(|(field, ..)| LIMITS.contains(field)) {
        let mut update = got.clone();
        update.max_bytes = want.max_bytes;
        update.max_age = want.max_age;
        update.duplicate_window = want.duplicate_window;
        got = js.update_stream(update).await.map_err(|e| format!("stream {}: limits not updated: {e}", want.name))?.config;
        tracing::info!(target: "cluster", stream = %want.name, "cluster: session log limits updated to the settings");
    }
    if let Some((field, wanted, found)) = mismatches(&want, &got).first() {
        return Err(format!(
            "stream {}: {field} is {found}, fleetmq needs {wanted} (a stream made with other settings, or a server \
             that dropped a flag it does not know)",
            want.name
        ));
    }
    tracing::debug!(target: "cluster", stream = %want.name, "cluster: session log ready");
    Ok(())
}

/// Values a tail hands the shards in one event at most.
const TAIL_BATCH: usize = 256;

/// Bytes a direct get batch may answer with at most.
const READ_MAX_BYTES: usize = 4 << 20;

/// How long a read waits for each answer of its batch.
const READ_WAIT: Duration = Duration::from_secs(5);

/// The log value `message` (a stream message of `workspace`'s log at
/// `seq`, with `headers`) as the shards deliver it, its
/// [`Message::stored`](fleetmq_core::session::Message::stored) the
/// sequence: `None` when it does not decode (logged and skipped).
fn entry(workspace: &str, seq: u64, headers: Option<&async_nats::HeaderMap>, payload: bytes::Bytes) -> Option<LogEntry> {
    let now_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
    let header = |name: &str| headers.and_then(|h| h.get(name)).map(|v| v.as_str());
    // The expiry counts from when the broker received it: as long ago on
    // this clock as on the wall clock.
    let received_at = |ms: u64| {
        let ago = Duration::from_millis(now_ms.saturating_sub(ms));
        std::time::Instant::now().checked_sub(ago).unwrap_or_else(std::time::Instant::now)
    };
    let received_ms = header(fleetmq_core::cluster::session_log::RECEIVED_MS).and_then(|v| v.parse().ok()).unwrap_or(now_ms);
    match decode(workspace, header, payload, received_at(received_ms)) {
        Ok(mut d) => {
            d.message.stored = seq;
            Some(LogEntry { seq, message: Arc::new(d.message) })
        }
        Err(e) => {
            tracing::warn!(target: "cluster", workspace, seq, error = %e, "cluster: a session log value that cannot be read; skipped");
            None
        }
    }
}

/// Follow `workspace`'s session log until the bridge stops, unless this
/// replica follows it already: one ordered consumer (ephemeral, one
/// replica, no acknowledgements; made again after an error from the last
/// sequence read), starting after the log's last sequence when it
/// starts. Every shard hears the start ([`Event::LogValues`] with no
/// value) and then every value, in batches of at most [`TAIL_BATCH`].
pub(crate) async fn tail(shared: Arc<Shared>, workspace: String) {
    {
        let Ok(mut tails) = shared.tails.lock() else { return };
        if !tails.insert(workspace.clone()) {
            return;
        }
    }
    let name: Arc<str> = Arc::from(workspace.as_str());
    let mut through: Option<u64> = None;
    let mut backoff = Duration::from_millis(250);
    while !shared.stopping.load(Ordering::Acquire) {
        let started = async {
            ensure(&shared, &workspace, Instant::now() + Duration::from_secs(10)).await?;
            let mut stream = shared.state.get_stream(stream(&workspace)).await.map_err(|e| e.to_string())?;
            let last = stream.info().await.map_err(|e| e.to_string())?.state.last_sequence;
            let from = through.unwrap_or(last);
            let config = async_nats::jetstream::consumer::pull::OrderedConfig {
                deliver_policy: async_nats::jetstream::consumer::DeliverPolicy::ByStartSequence { start_sequence: from + 1 },
                ..Default::default()
            };
            let consumer = stream.create_consumer(config).await.map_err(|e| e.to_string())?;
            let messages = consumer.messages().await.map_err(|e| e.to_string())?;
            Ok::<_, String>((from, messages))
        }
        .await;
        let (from, mut messages) = match started {
            Ok(started) => started,
            Err(e) => {
                tracing::debug!(target: "cluster", workspace, error = %e, "cluster: session log tail not started; trying again");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        backoff = Duration::from_millis(250);
        if through.is_none() {
            through = Some(from);
            shared.broadcast(Event::LogValues { workspace: name.clone(), through: from, values: Arc::from(Vec::new()) });
            tracing::debug!(target: "cluster", workspace, after = from, "cluster: following the session log");
        }
        loop {
            let first = tokio::select! {
                next = messages.next() => next,
                () = shared.stop.notified() => None,
            };
            let mut batch = Vec::new();
            let mut failed = !take(&workspace, first, &mut batch, &mut through);
            while !failed && batch.len() < TAIL_BATCH {
                match futures_util::FutureExt::now_or_never(messages.next()) {
                    Some(next) => failed = !take(&workspace, next, &mut batch, &mut through),
                    None => break,
                }
            }
            if let Some(t) = through {
                if !batch.is_empty() || !failed {
                    shared.room_for_events().await;
                    shared.broadcast(Event::LogValues { workspace: name.clone(), through: t, values: Arc::from(batch) });
                }
            }
            if failed {
                break;
            }
        }
        if shared.stopping.load(Ordering::Acquire) {
            break;
        }
        tokio::time::sleep(backoff).await;
    }
}

/// Add what a tail's consumer gave (`next`) to `batch`, its sequence to
/// `through`; `false` when the consumer failed or ended.
fn take<E>(
    workspace: &str,
    next: Option<Result<async_nats::jetstream::Message, E>>,
    batch: &mut Vec<LogEntry>,
    through: &mut Option<u64>,
) -> bool {
    let Some(Ok(m)) = next else { return false };
    let Ok(info) = m.info() else { return true };
    let seq = info.stream_sequence;
    *through = Some(seq);
    if let Some(e) = entry(workspace, seq, m.headers.as_ref(), m.payload.clone()) {
        batch.push(e);
    }
    true
}

/// Read up to `max` values of `workspace`'s log from sequence `from` on:
/// one direct get batch (`$JS.API.DIRECT.GET.<stream>` with `{"seq",
/// "batch", "max_bytes"}`, answered by any replica of the stream), the
/// values in order and whether they reach the log's end.
///
/// # Errors
/// The log does not exist, or JetStream did not answer in time.
pub(crate) async fn read(shared: &Shared, workspace: &str, from: u64, max: usize) -> Result<LogBatch, String> {
    let client = &shared.state_client;
    let inbox = client.new_inbox();
    let mut answers = client.subscribe(inbox.clone()).await.map_err(|e| e.to_string())?;
    let request = serde_json::json!({ "seq": from.max(1), "batch": max.max(1), "max_bytes": READ_MAX_BYTES });
    client
        .publish_with_reply(format!("$JS.API.DIRECT.GET.{}", stream(workspace)), inbox, request.to_string().into())
        .await
        .map_err(|e| e.to_string())?;
    let mut batch = LogBatch::default();
    // Messages of the log after the last one answered, as the server
    // counts them (each answer and the end-of-batch carry it).
    let mut pending: Option<u64> = None;
    loop {
        let Ok(Some(m)) = tokio::time::timeout(READ_WAIT, answers.next()).await else {
            return Err(format!("no answer from the session log of {workspace:?} in time"));
        };
        let header = |name: &str| m.headers.as_ref().and_then(|h| h.get(name)).map(|v| v.as_str().to_owned());
        if let Some(n) = header("Nats-Num-Pending").and_then(|v| v.parse().ok()) {
            pending = Some(n);
        }
        match m.status.map(|s| s.as_u16()) {
            // The end of the batch.
            Some(204) => break,
            // Nothing at or after `from`.
            Some(404) => {
                batch.end = true;
                break;
            }
            Some(code) => return Err(format!("direct get answered {code} {}", m.description.clone().unwrap_or_default())),
            None => {}
        }
        let Some(seq) = header("Nats-Sequence").and_then(|v| v.parse::<u64>().ok()) else { continue };
        if let Some(e) = entry(workspace, seq, m.headers.as_ref(), m.payload.clone()) {
            batch.values.push(e);
        }
        if batch.values.len() >= max && pending.is_none() {
            break;
        }
    }
    batch.end |= match pending {
        Some(n) => n == 0,
        None => batch.values.len() < max,
    };
    let _ = answers.unsubscribe().await;
    Ok(batch)
}

/// Watch `mqtt-session-state` until the bridge stops: the other replicas'
/// persistent sessions' subscriptions into the shared interest.
pub(crate) async fn watch(shared: Arc<Shared>) {
    let me = shared.config.replica_id.clone();
    follow(&shared, bucket::SESSION_STATE, Start::History, Some(Duration::from_millis(50)), |seen| {
        let entry = match seen {
            Seen::Quiet => {
                shared.interest_loaded.store(true, Ordering::Release);
                return;
            }
            Seen::Entry(entry) => entry,
        };
        let key = interest_key_of_record(&entry.key);
        let record = match entry.operation {
            Operation::Put => SessionRecord::decode(&entry.value).ok(),
            Operation::Delete | Operation::Purge => None,
        };
        crate::expiry::seen(&shared, &entry.key, entry.revision, record.as_ref());
        if let Ok(mut interest) = shared.interest.write() {
            match record {
                Some(r) if written_here(&r, &me, &shared.config.instance) => {}
                Some(r) => {
                    let filters = logged_filters(r.subscriptions.iter().map(|s| (s.filter.as_str(), s.qos)));
                    interest.set(key, filters, false);
                }
                None => interest.remove(key, false),
            }
        }
        if entry.delta == 0 {
            shared.interest_loaded.store(true, Ordering::Release);
        }
    })
    .await;
}

/// Whether `record` was written by this process (`instance` of replica
/// `me`), whose shards set its interest themselves. One that an earlier
/// process of this replica ID wrote (before a restart) is another's: its
/// session is not here (until its client comes back), and values for it
/// must still go to the log. A record of an older build, without its
/// process, is taken as this process's when it names this replica.
fn written_here(record: &SessionRecord, me: &str, instance: &str) -> bool {
    match &record.instance {
        Some(i) => i == instance,
        None => record.replica == me,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_log_as_created_has_no_mismatch_and_a_changed_limit_names_its_setting() {
        let want = config("acme", 1 << 20, Duration::from_secs(3600), 3);
        assert!(mismatches(&want, &want).is_empty());
        assert_eq!(want.name, "LOG_mqtt-sessions-acme");
        assert_eq!(want.discard, DiscardPolicy::Old);
        let other = config("acme", 2 << 20, Duration::from_secs(3600), 3);
        let fields: Vec<_> = mismatches(&want, &other).into_iter().map(|m| m.0).collect();
        assert_eq!(fields, ["max_bytes (cluster.session_log_max_bytes)"]);
        assert!(LIMITS.contains(&fields[0]));
        let short = config("acme", 1 << 20, Duration::from_secs(30), 1);
        assert_eq!(short.duplicate_window, Duration::from_secs(30), "at most max_age");
    }

    #[test]
    fn a_max_session_expiry_of_zero_is_a_log_kept_one_second_not_for_ever() {
        // JetStream reads max_age 0 as no limit.
        let zero = config("acme", 1 << 20, Duration::ZERO, 1);
        assert_eq!(zero.max_age, Duration::from_secs(1));
        assert_eq!(zero.duplicate_window, Duration::from_secs(1));
    }
}
