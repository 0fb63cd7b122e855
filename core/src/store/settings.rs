//! `[store]` settings (DESIGN.md §7, §15).

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::settings::{check, duration, format_duration, format_size, size, SettingsError};

/// Which store makes accepted values durable (DESIGN.md §7).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StoreKind {
    /// Acknowledged on receipt, nothing kept across a restart.
    None,
    /// An append-only log per shard in [`Store::dir`], with group commit;
    /// sessions and retained messages are recovered from it at restart.
    /// The default of a single node.
    #[default]
    Local,
    /// NATS JetStream: the ingest stream `mqtt-ingest` (DESIGN.md §7,
    /// /work/coord/ingest-contract.md). The default in cluster mode;
    /// needs a `[cluster]` section.
    Jetstream,
}

/// The ingest stream's retention (`store.ingest_retention`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IngestRetention {
    /// Values stay until `store.ingest_max_age` or `store.max_bytes`
    /// (full: publishes refused, 0x97): any number of consumers read it.
    #[default]
    Limits,
    /// A value goes once a consumer acknowledged it: what a single
    /// database writer wants (one consumer per subject filter, explicit
    /// acknowledgements).
    Workqueue,
}

/// When the local store syncs its log (`store.fsync`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Fsync {
    /// A sync as soon as anything waits for one: no gathering beyond what
    /// arrives while the previous sync runs.
    Always,
    /// Group commit: one write and `fdatasync` at a time, each covering
    /// everything appended before it started. A write starts as soon as
    /// the previous sync ends (or at once when none runs), after the
    /// connections already runnable have appended, so the batch grows as
    /// the disk slows and an acknowledgement waits about one sync at low
    /// load, at most the sync under way and its own; the gathering before
    /// a write is bounded by [`Store::fsync_window`].
    #[default]
    Batch,
    /// Written to the page cache, never synced: survives a crash of the
    /// process, not of the machine.
    Never,
}

/// `[store]` settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Store {
    /// The store. Default `"local"` for a single node; with a
    /// `[cluster]` section and no `store.kind` given, `"jetstream"`.
    pub kind: StoreKind,
    /// Data directory for the `local` store, held by one process at a time
    /// (lock file `LOCK`). Default `"./data"`.
    pub dir: PathBuf,
    /// When the log is synced. Default `"batch"`.
    pub fsync: Fsync,
    /// `"batch"`: the longest the committer gathers appends before it
    /// starts a write (it starts at once when nothing else is runnable,
    /// and an acknowledgement may also wait for the sync under way).
    /// Default 2 ms, 100µs..=100ms.
    #[serde(with = "duration")]
    pub fsync_window: Duration,
    /// Bound on the log (snapshot and segments): compaction keeps it near
    /// what is live; while it is over this, publishes are refused (0x97)
    /// until compaction brings it back under. With `"jetstream"`: the
    /// ingest stream's `max_bytes` (discard new: full, publishes are
    /// refused with 0x97). Default 1 GiB, 1MiB..=1TiB.
    #[serde(with = "size")]
    pub max_bytes: usize,
    /// `"jetstream"`: the ingest stream's retention. Default `"limits"`.
    pub ingest_retention: IngestRetention,
    /// `"jetstream"`: how long the ingest stream keeps a value (its
    /// `max_age`). Default 7 days, 1m..=365d.
    #[serde(with = "duration")]
    pub ingest_max_age: Duration,
    /// `"jetstream"`: the ingest stream's duplicate window, keyed on
    /// `Nats-Msg-Id`: an append retried within it is stored once. At most
    /// `store.ingest_max_age`. Default 2 minutes, 1s..=1d.
    #[serde(with = "duration")]
    pub ingest_duplicate_window: Duration,
    /// Start even when a log is damaged in the middle, dropping the
    /// damaged record and everything after it in that shard's log (values
    /// acknowledged after it are lost). Default false: such a log stops
    /// the start, naming the file and offset.
    pub truncate_corrupt: bool,
}

impl Default for Store {
    fn default() -> Self {
        Store {
            kind: StoreKind::Local,
            dir: PathBuf::from("./data"),
            fsync: Fsync::Batch,
            fsync_window: Duration::from_millis(2),
            max_bytes: 1 << 30,
            ingest_retention: IngestRetention::Limits,
            ingest_max_age: Duration::from_secs(7 * 86_400),
            ingest_duplicate_window: Duration::from_secs(120),
            truncate_corrupt: false,
        }
    }
}

impl Store {
    /// Checks every range.
    ///
    /// # Errors
    /// `store.fsync_window` outside 100µs..=100ms, `store.max_bytes`
    /// outside 1MiB..=1TiB, `store.ingest_max_age` outside 1m..=365d,
    /// `store.ingest_duplicate_window` outside 1s..=1d or above
    /// `store.ingest_max_age`, an empty `store.dir` for the local store.
    /// (`store.kind = "jetstream"` without `[cluster]` is refused by
    /// [`crate::settings::Settings::validate`].)
    pub fn validate(&self) -> Result<(), SettingsError> {
        let window = (Duration::from_micros(100), Duration::from_millis(100));
        check("store.fsync_window", self.fsync_window, window.0, window.1, format_duration)?;
        check("store.max_bytes", self.max_bytes, 1 << 20, 1 << 40, format_size)?;
        let day = Duration::from_secs(86_400);
        check("store.ingest_max_age", self.ingest_max_age, Duration::from_secs(60), day * 365, format_duration)?;
        let most = self.ingest_max_age.min(day);
        check("store.ingest_duplicate_window", self.ingest_duplicate_window, Duration::from_secs(1), most, format_duration)?;
        if self.kind == StoreKind::Local && self.dir.as_os_str().is_empty() {
            return Err(SettingsError::Invalid {
                key: "store.dir",
                value: String::new(),
                allowed: "a directory path".into(),
            });
        }
        Ok(())
    }

    /// The keys given a value other than their default that
    /// [`Store::kind`] does not use: `store.ingest_*` unless
    /// `"jetstream"`; `store.dir`, `store.fsync`, `store.fsync_window`
    /// and `store.truncate_corrupt` unless `"local"`; `store.max_bytes`
    /// with `"none"`. They are accepted (one configuration file can serve
    /// a single node and a cluster, as the other keys' sections do:
    /// `[cluster]` settings are read without a cluster too) and the
    /// broker warns about each, naming it, at start and in
    /// `fleetmq check-config`.
    pub fn unused_keys(&self) -> Vec<&'static str> {
        let d = Store::default();
        let (local, jetstream) = (self.kind == StoreKind::Local, self.kind == StoreKind::Jetstream);
        [
            ("store.dir", !local && self.dir != d.dir),
            ("store.fsync", !local && self.fsync != d.fsync),
            ("store.fsync_window", !local && self.fsync_window != d.fsync_window),
            ("store.truncate_corrupt", !local && self.truncate_corrupt != d.truncate_corrupt),
            ("store.max_bytes", self.kind == StoreKind::None && self.max_bytes != d.max_bytes),
            ("store.ingest_retention", !jetstream && self.ingest_retention != d.ingest_retention),
            ("store.ingest_max_age", !jetstream && self.ingest_max_age != d.ingest_max_age),
            ("store.ingest_duplicate_window", !jetstream && self.ingest_duplicate_window != d.ingest_duplicate_window),
        ]
        .into_iter()
        .filter_map(|(key, unused)| unused.then_some(key))
        .collect()
    }

    /// The text of [`Store::unused_keys`]' warning about `key`.
    pub fn unused_warning(&self, key: &str) -> String {
        let kind = match self.kind {
            StoreKind::None => "none",
            StoreKind::Local => "local",
            StoreKind::Jetstream => "jetstream",
        };
        let applies = match key {
            k if k.starts_with("store.ingest_") => "\"jetstream\"",
            "store.max_bytes" => "\"local\" and \"jetstream\"",
            _ => "\"local\"",
        };
        format!("{key} has no effect with store.kind = \"{kind}\" (it applies to {applies})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_local_store_is_checked() {
        let mut s = Store { kind: StoreKind::Local, ..Store::default() };
        assert_eq!(s.validate(), Ok(()));
        s.fsync_window = Duration::from_secs(1);
        assert_eq!(s.validate().unwrap_err().to_string(), "store.fsync_window = 1s is out of range 100us..=100ms");
        s.fsync_window = Duration::from_millis(2);
        s.max_bytes = 1000;
        assert_eq!(s.validate().unwrap_err().to_string(), "store.max_bytes = 1000B is out of range 1MiB..=1TiB");
    }

    #[test]
    fn the_ingest_settings_are_checked_and_the_window_fits_the_age() {
        let mut s = Store { kind: StoreKind::Jetstream, ..Store::default() };
        assert_eq!(s.validate(), Ok(()));
        s.ingest_max_age = Duration::from_secs(10);
        assert_eq!(s.validate().unwrap_err().to_string(), "store.ingest_max_age = 10s is out of range 1m..=365d");
        s.ingest_max_age = Duration::from_secs(60);
        assert_eq!(s.validate().unwrap_err().to_string(), "store.ingest_duplicate_window = 2m is out of range 1s..=1m");
        s.ingest_duplicate_window = Duration::from_secs(30);
        assert_eq!(s.validate(), Ok(()));
        let t: Store = toml::from_str(
            "kind = \"jetstream\"\ningest_retention = \"workqueue\"\ningest_max_age = \"1d\"\ningest_duplicate_window = \"5m\"\n",
        )
        .unwrap();
        assert_eq!((t.kind, t.ingest_retention), (StoreKind::Jetstream, IngestRetention::Workqueue));
        assert_eq!((t.ingest_max_age, t.ingest_duplicate_window), (Duration::from_secs(86_400), Duration::from_secs(300)));
    }

    #[test]
    fn keys_the_kind_does_not_use_are_named_when_given() {
        let local = Store::default();
        assert!(local.unused_keys().is_empty(), "the defaults name nothing");
        let mut s = Store { ingest_max_age: Duration::from_secs(86_400), ..Store::default() };
        assert_eq!(s.unused_keys(), ["store.ingest_max_age"]);
        assert_eq!(
            s.unused_warning("store.ingest_max_age"),
            "store.ingest_max_age has no effect with store.kind = \"local\" (it applies to \"jetstream\")"
        );
        s.ingest_retention = IngestRetention::Workqueue;
        s.ingest_duplicate_window = Duration::from_secs(5);
        assert_eq!(s.unused_keys(), ["store.ingest_retention", "store.ingest_max_age", "store.ingest_duplicate_window"]);
        s.kind = StoreKind::Jetstream;
        assert!(s.unused_keys().is_empty(), "jetstream uses them");
        s.fsync = Fsync::Always;
        s.dir = PathBuf::from("/var/lib/fleetmq");
        assert_eq!(s.unused_keys(), ["store.dir", "store.fsync"]);
        let none = Store { kind: StoreKind::None, max_bytes: 2 << 30, ..Store::default() };
        assert_eq!(none.unused_keys(), ["store.max_bytes"]);
        assert!(none.unused_warning("store.max_bytes").contains("\"none\""));
    }

    #[test]
    fn store_keys_parse_from_toml() {
        let s: Store = toml::from_str(
            "kind = \"local\"\ndir = \"/var/lib/fleetmq\"\nfsync = \"always\"\nfsync_window = \"5ms\"\nmax_bytes = \"2GiB\"\ntruncate_corrupt = true\n",
        )
        .unwrap();
        assert_eq!(s.kind, StoreKind::Local);
        assert_eq!(s.fsync, Fsync::Always);
        assert_eq!(s.fsync_window, Duration::from_millis(5));
        assert_eq!(s.max_bytes, 2 << 30);
        assert!(s.truncate_corrupt);
    }
}
