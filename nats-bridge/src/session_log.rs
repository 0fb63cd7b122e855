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
//! removes it. This replica's own records are left out: its shards set
//! their sessions' entries themselves, before the SUBACK.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::kv::Operation;
use async_nats::jetstream::stream::{Config, DiscardPolicy, RetentionPolicy, StorageType};
use fleetmq_core::cluster::records::{bucket, Record as _};
use fleetmq_core::cluster::session_log::{interest_key_of_record, logged_filters, stream, subject};
use fleetmq_core::cluster::sessions::SessionRecord;
use tokio::time::Instant;

use crate::bridge::Shared;
use crate::watch::{follow, Seen, Start};

/// The duplicate window of a session log, at most its `max_age`.
const DUPLICATE_WINDOW: Duration = Duration::from_secs(120);

/// The config of `workspace`'s session log: `max_bytes` and `max_age` as
/// given, `replicas` copies.
pub(crate) fn config(workspace: &str, max_bytes: usize, max_age: Duration, replicas: usize) -> Config {
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
        if let Ok(mut interest) = shared.interest.write() {
            match record {
                Some(r) if r.replica == me => {}
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
}
