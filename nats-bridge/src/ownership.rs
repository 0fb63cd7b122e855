//! Client identifier ownership in `mqtt-sessions` (DESIGN.md §3 "Session
//! ownership", §4): a claim is a create or a compare-and-set on the
//! revision read; every replica watches the bucket, and a claim by another
//! replica reaches the shard that serves that client identifier as
//! [`Event::TakenOver`].

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::kv::Operation;
use async_nats::jetstream::message::PublishMessage;
use fleetmq_core::cluster::records::{bucket, client_id_of_key, client_key, OwnerRecord, Record};
use futures_util::StreamExt as _;
use tracing::{debug, info};

use crate::bridge::{ClaimError, Claimed, Event, Shared};
use crate::membership::unix_ms;
use crate::stats::OpKind;
use crate::watch::{follow, Seen, Start};

/// Compare-and-set attempts before a claim gives up (each conflict means
/// another replica claimed in between; the last claim wins).
const CLAIM_ATTEMPTS: usize = 8;

fn subject(key: &str) -> String {
    format!("$KV.{}.{key}", bucket::SESSIONS)
}

/// Whether a publish failed on its expected last subject sequence (10071,
/// or 10164 on replicated streams: notes/jetstream.md §2.3).
fn is_conflict(e: &async_nats::jetstream::context::PublishError) -> bool {
    e.kind() == PublishErrorKind::WrongLastSequence || e.to_string().contains("10164")
}

/// Client identifier keys' latest revisions in `mqtt-sessions` as this
/// replica last saw them (its own claims and releases, and every entry the
/// watch delivers), so that a claim is one compare-and-set instead of a
/// read and a compare-and-set (DESIGN.md §8). Only a guess: a stale or
/// missing revision costs a conflict, after which the claim reads the key
/// as before. Keyed by a 64-bit hash of the key (a collision is a stale
/// guess too); at most [`KNOWN_MAX`] entries (16 bytes each plus the
/// table's), forgotten all at once when full.
#[derive(Debug, Default)]
pub(crate) struct KnownRevisions {
    /// Key hash → the latest revision seen, with [`FOREIGN`] set when
    /// another process wrote it.
    revisions: std::collections::HashMap<u64, u64>,
}

/// Revisions [`KnownRevisions`] holds at most (about 8 MiB).
const KNOWN_MAX: usize = 1 << 18;

/// The bit of a known revision that says another process wrote it
/// (JetStream sequences stay far below it).
const FOREIGN: u64 = 1 << 63;

impl KnownRevisions {
    fn hash(key: &str) -> u64 {
        use std::hash::Hasher as _;
        // Only this process compares these hashes: any stable-in-process
        // hash does.
        let mut h = std::collections::hash_map::DefaultHasher::new();
        h.write(key.as_bytes());
        h.finish()
    }

    /// The revision to expect for `key` (0: none seen, create), and
    /// whether another process (replica) wrote it.
    pub(crate) fn expect(&self, key: &str) -> (u64, bool) {
        let known = self.revisions.get(&Self::hash(key)).copied().unwrap_or(0);
        (known & !FOREIGN, known & FOREIGN != 0)
    }

    /// `key` was seen at `revision`, written by another process when
    /// `foreign` (kept if newer than what is known).
    pub(crate) fn saw(&mut self, key: &str, revision: u64, foreign: bool) {
        if self.revisions.len() >= KNOWN_MAX {
            self.revisions.clear();
        }
        let known = self.revisions.entry(Self::hash(key)).or_insert(0);
        if revision > *known & !FOREIGN {
            *known = revision | if foreign { FOREIGN } else { 0 };
        }
    }
}

/// Claim `client_id` for connection `conn`: write this replica's record
/// expecting the revision this replica last saw for the key (none seen:
/// create), one round trip; on a conflict, read the key and write
/// expecting the revision read, until a write lands.
///
/// # Errors
/// [`ClaimError::Unavailable`] when JetStream does not answer or keeps
/// conflicting.
/// `clean_start`: the CONNECT's Clean Start flag, recorded in the entry
/// ([`OwnerRecord::clean_start`]).
pub(crate) async fn claim(shared: &Shared, client_id: &str, conn: u64, clean_start: bool) -> Result<Claimed, ClaimError> {
    let started = Instant::now();
    let key = client_key(client_id);
    let record = OwnerRecord {
        format: shared.status.write_format(),
        client_id: client_id.to_owned(),
        replica: shared.config.replica_id.clone(),
        instance: shared.config.instance.clone(),
        conn,
        claimed_at_ms: unix_ms(),
        epoch: shared.status.epoch(),
        clean_start,
    };
    let payload: bytes::Bytes = record.encode().into();
    let mut guess = Some(shared.known_revisions().expect(&key));
    for _ in 0..CLAIM_ATTEMPTS {
        let (expected, previous, moved) = match guess.take() {
            Some((expected, foreign)) => (expected, None, foreign),
            None => {
                let (expected, previous) = read(shared, &key).await?;
                let moved = previous.is_some();
                (expected, previous, moved)
            }
        };
        let publish = PublishMessage::build().payload(payload.clone()).expected_last_subject_sequence(expected);
        let outcome = match shared.state.send_publish(subject(&key), publish).await {
            Ok(ack) => ack.await,
            Err(e) => Err(e),
        };
        match outcome {
            Ok(ack) => {
                shared.known_revisions().saw(&key, ack.sequence, false);
                shared.status.stats.record(OpKind::Claim, started.elapsed());
                return Ok(Claimed { revision: ack.sequence, previous, moved });
            }
            Err(e) if is_conflict(&e) => continue,
            Err(e) => return Err(ClaimError::Unavailable(e.to_string())),
        }
    }
    Err(ClaimError::Unavailable(format!("{CLAIM_ATTEMPTS} conflicting claims in a row")))
}

/// Read `key`: the revision to expect (0: no entry) and the replica that
/// holds it when another process does.
async fn read(shared: &Shared, key: &str) -> Result<(u64, Option<String>), ClaimError> {
    let entry = shared.sessions.entry(key).await.map_err(|e| ClaimError::Unavailable(e.to_string()))?;
    Ok(match &entry {
        None => (0, None),
        Some(e) => {
            let previous = (e.operation == Operation::Put)
                .then(|| OwnerRecord::decode(&e.value).ok())
                .flatten()
                .filter(|r| r.instance != shared.config.instance)
                .map(|r| r.replica);
            (e.revision, previous)
        }
    })
}

/// Delete the claim on `client_id` if `revision` is still the latest (a
/// delete marker expecting that revision); a later claim elsewhere stays.
pub(crate) async fn release(shared: &Shared, client_id: &str, revision: u64) {
    let started = Instant::now();
    let publish = PublishMessage::build()
        .header("KV-Operation", "DEL")
        .expected_last_subject_sequence(revision);
    let key = client_key(client_id);
    let outcome = match shared.state.send_publish(subject(&key), publish).await {
        Ok(ack) => ack.await.map(|ack| shared.known_revisions().saw(&key, ack.sequence, false)),
        Err(e) => Err(e),
    };
    shared.status.stats.record(OpKind::Release, started.elapsed());
    if let Err(e) = outcome {
        debug!(target: "cluster", client_id, error = %e, "cluster: release not written (claimed again, or store unavailable)");
    }
}

/// Watch `mqtt-sessions` from its current end and turn every claim by
/// another process into [`Event::TakenOver`] for the shard that serves
/// the client identifier.
pub(crate) async fn watch(shared: Arc<Shared>) {
    follow(&shared, bucket::SESSIONS, Start::New, None, |seen| {
        let Seen::Entry(entry) = seen else { return };
        let record = (entry.operation == Operation::Put).then(|| OwnerRecord::decode(&entry.value).ok()).flatten();
        let foreign = record.as_ref().is_some_and(|r| r.instance != shared.config.instance);
        shared.known_revisions().saw(&entry.key, entry.revision, foreign);
        let Some(record) = record else { return };
        crate::sweeper::clean_start_seen(&shared, &record);
        if record.instance == shared.config.instance {
            return;
        }
        let Some(client_id) = client_id_of_key(&entry.key) else { return };
        let shard = (shared.config.owner_of)(&client_id, shared.mailboxes.len());
        let (revision, replica, clean_start) = (entry.revision, record.replica, record.clean_start);
        shared.send_event(shard, Event::TakenOver { client_id, revision, replica, clean_start });
    })
    .await;
}

/// The ownership sweep runs again at least this often, as well as when a
/// peer is gone, stopped, replaced or back from a fence.
const SCAN_EVERY: Duration = Duration::from_secs(60);

/// Deletes of the ownership sweep in flight at most.
const SWEEP_WINDOW: usize = 256;

/// How long the scan waits for the next entry before it takes the bucket
/// as read.
const SCAN_QUIET: Duration = Duration::from_secs(5);

/// What the ownership sweep remembers between runs (reset when the leader
/// lock is lost).
#[derive(Debug, Default)]
pub(crate) struct OwnerSweep {
    /// When it last scanned.
    last: Option<Instant>,
    /// [`Shared::handovers`] at that scan.
    handovers: u64,
}

/// Whether `owner`'s claim is handed over: its process is gone (or
/// stopped, or replaced), or it fenced since the claim (its epoch moved
/// on: every connection was closed then). A process this replica never
/// saw counts as gone once this replica has watched the members for T
/// (every live one writes each T/10) and the claim is older than 2T.
fn handed_over(owner: &OwnerRecord, live: &HashMap<String, u64>, shared: &Shared, now_ms: u64) -> bool {
    if let Some(epoch) = live.get(&owner.instance) {
        return owner.epoch < *epoch;
    }
    if shared.gone_at(&owner.instance).is_some() {
        return true;
    }
    let ttl_ms = shared.config.cluster.member_ttl.as_millis() as u64;
    now_ms.saturating_sub(shared.config.started_at_ms) > ttl_ms
        && owner.claimed_at_ms.saturating_add(2 * ttl_ms) < now_ms
}

/// The leader's sweep of `mqtt-sessions` (DESIGN.md §4): when membership
/// handed something over since the last run (or [`SCAN_EVERY`] passed),
/// read every entry and delete those whose owner is gone, each with a
/// compare-and-set on the revision read, so that an entry claimed again
/// meanwhile (by a live replica) stays. A CONNECT does not wait for this:
/// a claim takes any entry over.
pub(crate) async fn sweep(shared: &Shared, state: &mut OwnerSweep) {
    let handovers = shared.handovers.load(Ordering::Relaxed);
    let due = state.last.is_none_or(|at| at.elapsed() >= SCAN_EVERY) || handovers != state.handovers;
    if !due {
        return;
    }
    state.last = Some(Instant::now());
    state.handovers = handovers;
    let stale = match scan(shared).await {
        Ok(stale) => stale,
        Err(e) => {
            debug!(target: "cluster", error = %e, "cluster: ownership sweep could not read mqtt-sessions");
            state.last = None;
            return;
        }
    };
    // Pipelined, SWEEP_WINDOW deletes in flight: a gone replica may leave
    // many entries (its persistent sessions' too), and the sweeper's lease
    // is renewed in the same loop.
    let deletes = futures_util::stream::iter(stale).map(|(key, revision)| async move {
        // Each delete is a decision for others.
        if !shared.decides_for_others() {
            return false;
        }
        let publish = PublishMessage::build().header("KV-Operation", "DEL").expected_last_subject_sequence(revision);
        match shared.state.send_publish(subject(&key), publish).await {
            Ok(ack) => ack.await.is_ok(),
            Err(_) => false,
        }
    });
    let swept = deletes.buffer_unordered(SWEEP_WINDOW).filter(|landed| std::future::ready(*landed)).count().await;
    if swept > 0 {
        info!(target: "cluster", swept, "cluster: swept the client identifier ownership of gone replicas");
    }
}

/// Every entry of `mqtt-sessions` whose owner is handed over: (key,
/// revision).
async fn scan(shared: &Shared) -> Result<Vec<(String, u64)>, String> {
    let mut stream = shared.state.get_stream(format!("KV_{}", bucket::SESSIONS)).await.map_err(|e| e.to_string())?;
    let info = stream.info().await.map_err(|e| e.to_string())?;
    if info.state.messages == 0 {
        return Ok(Vec::new());
    }
    let last = info.state.last_sequence;
    let live = shared.live_instances();
    let now_ms = unix_ms();
    let mut watch = shared.sessions.watch_with_history(">").await.map_err(|e| e.to_string())?;
    let mut stale = Vec::new();
    while let Ok(Some(Ok(entry))) = tokio::time::timeout(SCAN_QUIET, watch.next()).await {
        if entry.operation == Operation::Put {
            if let Ok(owner) = OwnerRecord::decode(&entry.value) {
                // This process's own current claims are live (`live` holds
                // its instance at its epoch).
                if handed_over(&owner, &live, shared, now_ms) {
                    stale.push((entry.key.clone(), entry.revision));
                }
            }
        }
        if entry.delta == 0 || entry.revision >= last {
            break;
        }
    }
    Ok(stale)
}
