//! Start-up checks against JetStream (DESIGN.md §4, §14): the account API
//! level, the buckets (created when absent, refused when incompatible or
//! when the server dropped a flag it was given), the member TTL and the
//! format floor.

use std::collections::HashMap;
use std::time::Duration;

use async_nats::jetstream::stream::{Config, DiscardPolicy, RetentionPolicy, StorageType};
use async_nats::jetstream::Context;
use fleetmq_core::cluster::records::{bucket, floor_readable, FloorRecord, Record, FLOOR_KEY, FORMAT};

use crate::StartError;

/// The lowest JetStream API level the bridge works with: 1 is nats-server
/// 2.11 (per-message TTL and limit markers). DESIGN.md §14 names 2.15.1
/// (level 5) as the tested server.
pub(crate) const MIN_API_LEVEL: usize = 1;

/// How long a delete or expiry marker stays in a bucket: long enough for
/// every watcher to hear of it.
const MARKER_TTL: Duration = Duration::from_secs(300);

/// How long a delete marker fleetmq writes stays in a bucket (its
/// `Nats-TTL`): a released client identifier, a cleared retained topic,
/// a will deleted. A marker without one stays for good: one subject per
/// key that ever existed. When it expires the server writes its own
/// expiry marker in its place (the watches hear of it as a purge: the key
/// is still empty), which goes after [`MARKER_TTL`], leaving nothing
/// (measured on nats-server 2.15.1, s36). Watchers hear of the delete when
/// it is written; a replica that starts later finds no key.
pub(crate) const DELETED_TTL: Duration = Duration::from_secs(10);

/// A delete marker for a KV key that goes after [`DELETED_TTL`].
pub(crate) fn delete_marker() -> async_nats::jetstream::message::PublishMessage {
    async_nats::jetstream::message::PublishMessage::build().header("KV-Operation", "DEL").ttl(DELETED_TTL)
}

/// `key`'s newest value in the KV bucket `store`, read from its stream's
/// leader (`$JS.API.STREAM.MSG.GET` with `last_by_subj`): not a direct
/// get, which any replica of an R3 bucket may answer from behind. A
/// take-up must see the last write that landed (the cursor that listed a
/// QoS 2 PUBLISH just before its replica was SIGKILLed: DESIGN.md §7).
/// `None`: no entry, or a delete or purge marker.
///
/// # Errors
/// JetStream did not answer (the text of its error).
pub(crate) async fn leader_value(store: &async_nats::jetstream::kv::Store, key: &str) -> Result<Option<bytes::Bytes>, String> {
    use async_nats::jetstream::stream::LastRawMessageErrorKind;
    let subject = format!("{}{key}", store.prefix);
    match store.stream.get_last_raw_message_by_subject(&subject).await {
        Ok(message) => {
            // A delete or purge, or the server's marker of an expired
            // or removed message (as async-nats reads KV entries).
            let headers = &message.headers;
            let deleted = headers.get("KV-Operation").is_some_and(|op| matches!(op.as_str(), "DEL" | "PURGE"))
                || headers.get(async_nats::header::NATS_MARKER_REASON).is_some();
            Ok((!deleted).then_some(message.payload))
        }
        Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => Ok(None),
        Err(e) => Err(e.to_string()),
    }
}

/// The stream metadata key holding `member_ttl` in milliseconds on
/// `KV_mqtt-members`: every replica must use the bucket's value.
pub(crate) const MEMBER_TTL_KEY: &str = "fleetmq.member_ttl_ms";

/// Refuse a server below [`MIN_API_LEVEL`].
///
/// # Errors
/// [`StartError::Incompatible`] naming the level found; [`StartError::Connect`]
/// when JetStream does not answer (not enabled, or no meta leader).
pub(crate) async fn check_api_level(js: &Context) -> Result<usize, StartError> {
    let account = js.query_account().await.map_err(|e| {
        let text = e.to_string();
        // 503 / 10008: JetStream is on but has no meta leader (a cluster
        // that lost its quorum, or is still electing one).
        let hint = if text.contains("10008") || text.contains("code 503") {
            "JetStream is temporarily unavailable: its cluster has no meta leader (a quorum of its servers down, or still electing)"
        } else {
            "is JetStream enabled, and the server 2.11 or newer?"
        };
        StartError::Connect(format!("JetStream account info ($JS.API.INFO): {text} ({hint})"))
    })?;
    let level = account.requests.level;
    if level < MIN_API_LEVEL {
        return Err(StartError::Incompatible(format!(
            "JetStream API level {level}: fleetmq needs level {MIN_API_LEVEL} or more (nats-server 2.11+, tested with 2.15.1)"
        )));
    }
    Ok(level)
}

/// The stream of KV bucket `name` as fleetmq creates it: history 1, file
/// storage, `replicas` copies, direct gets, per-message TTL with limit
/// markers (so watchers hear of expiries).
pub(crate) fn bucket_config(name: &str, replicas: usize, member_ttl: Duration) -> Config {
    let mut metadata = HashMap::new();
    metadata.insert("fleetmq.format".to_owned(), FORMAT.to_string());
    if name == bucket::MEMBERS {
        metadata.insert(MEMBER_TTL_KEY.to_owned(), member_ttl.as_millis().to_string());
    }
    Config {
        name: format!("KV_{name}"),
        subjects: vec![format!("$KV.{name}.>")],
        max_messages_per_subject: 1,
        discard: DiscardPolicy::New,
        allow_direct: true,
        allow_rollup: true,
        deny_delete: true,
        num_replicas: replicas,
        storage: StorageType::File,
        allow_message_ttl: true,
        subject_delete_marker_ttl: Some(MARKER_TTL),
        max_age: Duration::ZERO,
        duplicate_window: Duration::from_secs(120),
        metadata,
        ..Config::default()
    }
}

/// What of `want` the stream's actual `got` config lacks or contradicts:
/// `(field, wanted, found)` for each.
pub(crate) fn config_mismatches(want: &Config, got: &Config) -> Vec<(&'static str, String, String)> {
    let mut out = Vec::new();
    let mut check = |field: &'static str, w: String, g: String| {
        if w != g {
            out.push((field, w, g));
        }
    };
    check("max_msgs_per_subject", want.max_messages_per_subject.to_string(), got.max_messages_per_subject.to_string());
    check("allow_direct", want.allow_direct.to_string(), got.allow_direct.to_string());
    check("allow_msg_ttl", want.allow_message_ttl.to_string(), got.allow_message_ttl.to_string());
    check(
        "subject_delete_marker_ttl",
        want.subject_delete_marker_ttl.is_some().to_string(),
        got.subject_delete_marker_ttl.is_some().to_string(),
    );
    check("num_replicas", want.num_replicas.to_string(), got.num_replicas.to_string());
    check("storage", format!("{:?}", want.storage), format!("{:?}", got.storage));
    check("subjects", want.subjects.join(","), got.subjects.join(","));
    if let Some(ttl) = want.metadata.get(MEMBER_TTL_KEY) {
        check(
            "metadata.fleetmq.member_ttl_ms (cluster.member_ttl)",
            ttl.clone(),
            got.metadata.get(MEMBER_TTL_KEY).cloned().unwrap_or_default(),
        );
    }
    out
}

/// Create every bucket of DESIGN.md §4 that is absent; check those that
/// exist and what the server made of those it created.
///
/// # Errors
/// [`StartError::Incompatible`] naming the stream and the field (a bucket
/// made with other settings, a `member_ttl` other than the bucket's, a flag
/// the server dropped); [`StartError::Connect`] when JetStream does not
/// answer.
pub(crate) async fn ensure_buckets(js: &Context, replicas: usize, member_ttl: Duration) -> Result<(), StartError> {
    for name in bucket::ALL {
        let want = bucket_config(name, replicas, member_ttl);
        let got = stream_config(js, &want).await?;
        let wrong = config_mismatches(&want, &got);
        if let Some((field, wanted, found)) = wrong.first() {
            return Err(StartError::Incompatible(format!(
                "stream {}: {field} is {found}, fleetmq needs {wanted} (a bucket made with other settings, \
                 or a server that dropped a flag it does not know)",
                want.name
            )));
        }
    }
    Ok(())
}

/// The ingest stream as `store` asks for it (DESIGN.md §7,
/// ingest-contract.md): `mqtt-ingest`, subjects `mqtt-ingest.>`, file
/// storage, `replicas` copies, `store.ingest_retention`,
/// `store.ingest_max_age`, `store.max_bytes` with discard new (full:
/// publishes refused, never old values dropped unread),
/// `store.ingest_duplicate_window`.
pub(crate) fn ingest_config(store: &fleetmq_core::settings::Store, replicas: usize) -> Config {
    use fleetmq_core::cluster::ingest;
    use fleetmq_core::settings::IngestRetention;
    Config {
        name: ingest::STREAM.to_owned(),
        subjects: vec![ingest::SUBJECTS.to_owned()],
        retention: match store.ingest_retention {
            IngestRetention::Limits => RetentionPolicy::Limits,
            IngestRetention::Workqueue => RetentionPolicy::WorkQueue,
        },
        discard: DiscardPolicy::New,
        max_bytes: i64::try_from(store.max_bytes).unwrap_or(i64::MAX),
        max_age: store.ingest_max_age,
        duplicate_window: store.ingest_duplicate_window,
        num_replicas: replicas,
        storage: StorageType::File,
        ..Config::default()
    }
}

/// What of the ingest stream's `want` config its `got` config lacks:
/// `(field, wanted, found)`, the field named with the setting it comes
/// from.
pub(crate) fn ingest_mismatches(want: &Config, got: &Config) -> Vec<(&'static str, String, String)> {
    let mut out = Vec::new();
    let mut check = |field: &'static str, w: String, g: String| {
        if w != g {
            out.push((field, w, g));
        }
    };
    check("subjects", want.subjects.join(","), got.subjects.join(","));
    check("retention (store.ingest_retention)", format!("{:?}", want.retention), format!("{:?}", got.retention));
    check("discard", format!("{:?}", want.discard), format!("{:?}", got.discard));
    check("max_bytes (store.max_bytes)", want.max_bytes.to_string(), got.max_bytes.to_string());
    check("max_age (store.ingest_max_age)", format!("{:?}", want.max_age), format!("{:?}", got.max_age));
    check(
        "duplicate_window (store.ingest_duplicate_window)",
        format!("{:?}", want.duplicate_window),
        format!("{:?}", got.duplicate_window),
    );
    check("num_replicas (cluster.nats_replicas)", want.num_replicas.to_string(), got.num_replicas.to_string());
    check("storage", format!("{:?}", want.storage), format!("{:?}", got.storage));
    out
}

/// Create the ingest stream when absent; when it exists with other
/// limits (`store.max_bytes`, `store.ingest_max_age`,
/// `store.ingest_duplicate_window`), update them to the settings'; then
/// check that every flag set is echoed back.
///
/// # Errors
/// [`StartError::Incompatible`] naming the field and the setting when the
/// stream differs in what cannot be changed (retention, storage, replicas
/// as the server refuses) or the server dropped a flag;
/// [`StartError::Connect`] when JetStream does not answer.
pub(crate) async fn ensure_ingest(js: &Context, store: &fleetmq_core::settings::Store, replicas: usize) -> Result<(), StartError> {
    let want = ingest_config(store, replicas);
    let mut got = stream_config(js, &want).await?;
    let limits = ["max_bytes (store.max_bytes)", "max_age (store.ingest_max_age)", "duplicate_window (store.ingest_duplicate_window)"];
    let wrong = ingest_mismatches(&want, &got);
    if !wrong.is_empty() && wrong.iter().all(|(field, ..)| limits.contains(field)) {
        let mut update = got.clone();
        update.max_bytes = want.max_bytes;
        update.max_age = want.max_age;
        update.duplicate_window = want.duplicate_window;
        match js.update_stream(update).await {
            Ok(info) => {
                tracing::info!(target: "bridge", stream = %want.name, "bridge: ingest stream limits updated to the settings");
                got = info.config;
            }
            Err(e) => {
                return Err(StartError::Incompatible(format!("stream {}: cannot update its limits to the settings: {e}", want.name)))
            }
        }
    }
    if let Some((field, wanted, found)) = ingest_mismatches(&want, &got).first() {
        return Err(StartError::Incompatible(format!(
            "stream {}: {field} is {found}, the settings ask for {wanted} (a stream made with other settings, \
             or a server that dropped a flag it does not know)",
            want.name
        )));
    }
    Ok(())
}

/// The config of stream `want.name` as the server has it: created from
/// `want` when absent.
///
/// # Errors
/// [`StartError::Connect`] when JetStream does not answer.
pub(crate) async fn stream_config(js: &Context, want: &Config) -> Result<Config, StartError> {
    let info = |e: &dyn std::fmt::Display| StartError::Connect(format!("stream {}: {e}", want.name));
    match js.get_stream(&want.name).await {
        Ok(mut stream) => Ok(stream.info().await.map_err(|e| info(&e))?.config.clone()),
        Err(_) => match js.create_stream(want.clone()).await {
            Ok(mut stream) => Ok(stream.info().await.map(|i| i.config.clone()).unwrap_or_else(|_| want.clone())),
            // Another replica made it at the same moment (or with other
            // settings): read what is there.
            Err(create) => {
                let mut stream = js
                    .get_stream(&want.name)
                    .await
                    .map_err(|_| StartError::Connect(format!("cannot create stream {}: {create}", want.name)))?;
                Ok(stream.info().await.map_err(|e| info(&e))?.config.clone())
            }
        },
    }
}

/// Read the format floor, writing [`FORMAT`] as the floor when there is
/// none yet.
///
/// # Errors
/// [`StartError::Incompatible`] when this build cannot read the floor's
/// format, naming it.
pub(crate) async fn check_floor(js: &Context) -> Result<u16, StartError> {
    let kv = js
        .get_key_value(bucket::FLOOR)
        .await
        .map_err(|e| StartError::Connect(format!("bucket {}: {e}", bucket::FLOOR)))?;
    let entry = kv
        .entry(FLOOR_KEY)
        .await
        .map_err(|e| StartError::Connect(format!("bucket {}: {e}", bucket::FLOOR)))?;
    let floor = match entry {
        Some(e) if e.operation == async_nats::jetstream::kv::Operation::Put => FloorRecord::decode(&e.value)
            .map_err(|err| StartError::Incompatible(format!("{}/{FLOOR_KEY}: {err}", bucket::FLOOR)))?
            .floor,
        _ => {
            let record = FloorRecord { format: FORMAT, floor: FORMAT };
            // Create only: a floor another replica wrote meanwhile wins.
            let _ = kv.create(FLOOR_KEY, record.encode().into()).await;
            FORMAT
        }
    };
    if !floor_readable(floor) {
        return Err(StartError::Incompatible(format!(
            "the cluster's format floor is {floor} ({}/{FLOOR_KEY}): this build reads formats {}..={}; upgrade it",
            bucket::FLOOR,
            fleetmq_core::cluster::records::FORMATS_READ.start(),
            fleetmq_core::cluster::records::FORMATS_READ.end(),
        )));
    }
    Ok(floor)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bucket_as_created_has_no_mismatch_and_a_dropped_flag_is_named() {
        let want = bucket_config(bucket::MEMBERS, 3, Duration::from_secs(10));
        assert!(config_mismatches(&want, &want).is_empty());
        let mut dropped = want.clone();
        dropped.allow_message_ttl = false;
        dropped.subject_delete_marker_ttl = None;
        let wrong = config_mismatches(&want, &dropped);
        assert_eq!(wrong[0].0, "allow_msg_ttl");
        assert_eq!(wrong.len(), 2);
    }

    #[test]
    fn the_ingest_stream_as_created_has_no_mismatch_and_a_changed_limit_names_its_setting() {
        let store = fleetmq_core::settings::Store::default();
        let want = ingest_config(&store, 3);
        assert!(ingest_mismatches(&want, &want).is_empty());
        assert_eq!(want.discard, DiscardPolicy::New);
        let mut other = store.clone();
        other.ingest_retention = fleetmq_core::settings::IngestRetention::Workqueue;
        other.max_bytes = 2 << 30;
        let wrong = ingest_mismatches(&want, &ingest_config(&other, 3));
        let fields: Vec<_> = wrong.iter().map(|w| w.0).collect();
        assert_eq!(fields, ["retention (store.ingest_retention)", "max_bytes (store.max_bytes)"]);
    }

    #[test]
    fn another_member_ttl_is_a_mismatch_naming_the_setting() {
        let want = bucket_config(bucket::MEMBERS, 1, Duration::from_secs(10));
        let got = bucket_config(bucket::MEMBERS, 1, Duration::from_secs(20));
        let wrong = config_mismatches(&want, &got);
        assert_eq!(wrong.len(), 1);
        assert!(wrong[0].0.contains("cluster.member_ttl"));
        assert_eq!((wrong[0].1.as_str(), wrong[0].2.as_str()), ("10000", "20000"));
    }
}
