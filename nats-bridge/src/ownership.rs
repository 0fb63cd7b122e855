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
use fleetmq_core::cluster::records::{bucket, client_key, is_client_key_of, OwnerRecord, Record};
use futures_util::StreamExt as _;
use tracing::{debug, info};

use crate::bridge::{ClaimError, Claimed, Event, Shared};
use crate::membership::unix_ms;
use crate::stats::OpKind;
use crate::watch::{follow, Seen, Start};

/// Compare-and-set attempts before a claim gives up (each conflict means
/// another replica claimed in between; the last claim wins).
const CLAIM_ATTEMPTS: usize = 8;

/// A claim that finds another replica's claim of the same client
/// identifier made less than this long ago waits out the rest before it
/// writes (see [`flap_wait`]).
pub const FLAP_DELAY: Duration = Duration::from_secs(1);

fn subject(key: &str) -> String {
    format!("$KV.{}.{key}", bucket::SESSIONS)
}

/// How long the delete marker of a released claim stays in
/// `mqtt-sessions` ([`crate::setup::DELETED_TTL`]). Nothing waits for the
/// marker itself: a claim that expected its revision after it expired
/// conflicts, reads the key and claims over what it found (one more round
/// trip), as after any other write.
pub(crate) const RELEASED_TTL: Duration = crate::setup::DELETED_TTL;

/// The delete marker that gives up a claim at `revision` (a release, or
/// the sweep of a gone replica's claim): only if that claim is still the
/// key's latest entry, and gone after [`RELEASED_TTL`].
fn release_marker(revision: u64) -> PublishMessage {
    crate::setup::delete_marker().expected_last_subject_sequence(revision)
}

/// Whether a publish failed on its expected last subject sequence (10071,
/// or 10164 on replicated streams: notes/jetstream.md §2.3).
pub(crate) fn is_conflict(e: &async_nats::jetstream::context::PublishError) -> bool {
    e.kind() == PublishErrorKind::WrongLastSequence || e.to_string().contains("10164")
}

/// Client identifier keys' latest revisions in `mqtt-sessions` as this
/// replica last saw them (its own claims and releases, and every entry the
/// watch delivers), so that a claim is one compare-and-set instead of a
/// read and a compare-and-set (DESIGN.md §8). Only a guess: a stale or
/// missing revision costs a conflict, after which the claim reads the key
/// as before. Keyed by a 64-bit hash of the key (a collision is a stale
/// guess too); at most [`KNOWN_MAX`] entries (24 bytes each plus the
/// table's), forgotten all at once when full.
#[derive(Debug, Default)]
pub(crate) struct KnownRevisions {
    /// Key hash → the latest revision seen, with [`FOREIGN`] set when
    /// another process wrote it, and when that process claimed it (Unix
    /// milliseconds, its [`OwnerRecord::claimed_at_ms`]; 0 for this
    /// process's own writes).
    revisions: std::collections::HashMap<u64, (u64, u64)>,
}

/// Revisions [`KnownRevisions`] holds at most (about 12 MiB).
const KNOWN_MAX: usize = 1 << 18;

/// The bit of a known revision that says another process wrote it
/// (JetStream sequences stay far below it).
const FOREIGN: u64 = 1 << 63;

/// What this replica knows of a client identifier's entry in
/// `mqtt-sessions`: the revision to expect (0: none, create) and, when
/// another process (replica) wrote it, when that process claimed it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Known {
    /// The revision to expect.
    pub(crate) revision: u64,
    /// Another process's claim: its `claimed_at_ms` (Unix milliseconds).
    pub(crate) foreign_claim_ms: Option<u64>,
}

impl KnownRevisions {
    fn hash(key: &str) -> u64 {
        use std::hash::Hasher as _;
        // Only this process compares these hashes: any stable-in-process
        // hash does.
        let mut h = std::collections::hash_map::DefaultHasher::new();
        h.write(key.as_bytes());
        h.finish()
    }

    /// What is known of `key` (revision 0: none seen, create).
    pub(crate) fn expect(&self, key: &str) -> Known {
        let (known, claimed_at_ms) = self.revisions.get(&Self::hash(key)).copied().unwrap_or((0, 0));
        Known { revision: known & !FOREIGN, foreign_claim_ms: (known & FOREIGN != 0).then_some(claimed_at_ms) }
    }

    /// Whether this process wrote `key` at `revision`, and knew it before
    /// the watch brought it back (the write's acknowledgement came
    /// first): the watch has nothing to learn from it.
    pub(crate) fn wrote(&self, key: &str, revision: u64) -> bool {
        self.revisions.get(&Self::hash(key)).is_some_and(|known| known.0 == revision)
    }

    /// `key` was seen at `revision`, claimed by another process at
    /// `foreign_claim_ms` when `Some` (kept if newer than what is known).
    pub(crate) fn saw(&mut self, key: &str, revision: u64, foreign_claim_ms: Option<u64>) {
        if self.revisions.len() >= KNOWN_MAX {
            self.revisions.clear();
        }
        let known = self.revisions.entry(Self::hash(key)).or_insert((0, 0));
        if revision > known.0 & !FOREIGN {
            *known = match foreign_claim_ms {
                Some(at) => (revision | FOREIGN, at),
                None => (revision, 0),
            };
        }
    }
}

/// How long a claim of a client identifier waits before it writes over
/// another replica's claim made at `foreign_claim_ms` (Unix milliseconds;
/// `now_ms` this replica's clock): the rest of [`FLAP_DELAY`] since that
/// claim. A client identifier that flaps between replicas (two clients
/// with one identifier, each reconnecting at once when taken over) is so
/// slowed to about one take-over a second per pair of replicas, instead
/// of a war as fast as the replicas go (a flapping jail, as nats-server's
/// MQTT has). A claim in the future (clocks apart) waits the whole delay,
/// never more.
pub(crate) fn flap_wait(foreign_claim_ms: Option<u64>, now_ms: u64) -> Duration {
    let Some(at) = foreign_claim_ms else { return Duration::ZERO };
    let age = Duration::from_millis(now_ms.saturating_sub(at));
    FLAP_DELAY.saturating_sub(age)
}

/// Claim `client_id` for connection `conn`: write this replica's record
/// expecting the revision this replica last saw for the key (none seen:
/// create), one round trip; on a conflict, read the key and write
/// expecting the revision read, until a write lands. Before it writes over
/// another replica's claim made less than [`FLAP_DELAY`] ago (known from
/// the watch, or found by the read after a conflict), it waits out the
/// rest ([`flap_wait`]): the replica that just lost the identifier knows
/// it from the entry itself, however late its watch.
///
/// Claims of one client identifier on this replica run side by side; each
/// conflict is followed by a read, so every one lands, each on a later
/// revision than the one it read (the last to land wins, as across
/// replicas).
///
/// A read or write JetStream did not answer, or refused for another
/// reason than the revision (a bucket without a leader yet after a NATS
/// outage, a server lost under the connection), is asked again after
/// [`crate::patience::Patience`]'s pauses, while
/// `cluster.connect_budget` from the claim's start lasts and the CONNECT
/// still waits (`abandoned()` false: the shard refused it with 0x88 at its
/// budget's end): a CONNECT in that moment is answered late, not refused
/// (a CI run saw 0x88 right after readiness came back from a full NATS
/// outage, while `mqtt-sessions` still elected its leader).
///
/// # Errors
/// [`ClaimError::Unavailable`] when JetStream does not answer within that
/// budget or keeps conflicting; [`ClaimError::Fenced`] when the replica
/// fenced while the claim waited.
/// `clean_start`: the CONNECT's Clean Start flag, recorded in the entry
/// ([`OwnerRecord::clean_start`]).
pub(crate) async fn claim(
    shared: &Shared,
    client_id: &str,
    (conn, clean_start): (u64, bool),
    abandoned: &dyn Fn() -> bool,
) -> Result<Claimed, ClaimError> {
    let started = Instant::now();
    // JetStream not answering (a bucket electing its leader, a server
    // lost): asked again within the CONNECT's budget, while the CONNECT
    // waits (`abandoned`: it was refused meanwhile).
    let mut patience = crate::patience::Patience::of(shared);
    let mut retry = |e: String| {
        let Some(wait) = patience.next(shared, abandoned()) else { return Err(ClaimError::Unavailable(e)) };
        debug!(target: "cluster", client_id, error = %e, ?wait, "cluster: claim not answered: asking again");
        Ok(wait)
    };
    let mut waited = Duration::ZERO;
    let key = client_key(client_id);
    let mut record = OwnerRecord {
        format: shared.status.write_format(),
        client_id: client_id.to_owned(),
        replica: shared.config.replica_id.clone(),
        instance: shared.config.instance.clone(),
        conn,
        claimed_at_ms: 0,
        epoch: shared.status.epoch(),
        clean_start,
    };
    let mut guess = Some(shared.known_revisions().expect(&key));
    let mut conflicts = 0;
    while conflicts < CLAIM_ATTEMPTS {
        let (known, previous) = match guess.take() {
            Some(known) => (known, None),
            None => match read(shared, &key).await {
                Ok(read) => read,
                Err(ClaimError::Unavailable(e)) => {
                    tokio::time::sleep(retry(e)?).await;
                    continue;
                }
                Err(e) => return Err(e),
            },
        };
        let wait = flap_wait(known.foreign_claim_ms, unix_ms());
        if !wait.is_zero() {
            shared.status.stats.claims_delayed.fetch_add(1, Ordering::Relaxed);
            debug!(target: "cluster", client_id, ?wait, "cluster: client identifier claimed by another replica just now: waiting");
            tokio::time::sleep(wait).await;
            waited += wait;
            if shared.status.is_fenced() {
                return Err(ClaimError::Fenced);
            }
        }
        // Stamped when written: the time other replicas' claims wait from.
        record.claimed_at_ms = unix_ms();
        let payload: bytes::Bytes = record.encode().into();
        let publish = PublishMessage::build().payload(payload).expected_last_subject_sequence(known.revision);
        let outcome = match shared.state.send_publish(subject(&key), publish).await {
            Ok(ack) => ack.await,
            Err(e) => Err(e),
        };
        match outcome {
            Ok(ack) => {
                shared.known_revisions().saw(&key, ack.sequence, None);
                // As the watch would (it skips this replica's writes it
                // already knows: `KnownRevisions::wrote`).
                crate::sweeper::clean_start_seen(shared, &record);
                shared.status.stats.record(OpKind::Claim, started.elapsed().saturating_sub(waited));
                // Another process's claim, or (its claim swept or
                // released) a record another process wrote: its session
                // is taken up here.
                let moved = known.foreign_claim_ms.is_some() || crate::expiry::written_elsewhere(shared, client_id);
                return Ok(Claimed { revision: ack.sequence, previous, moved });
            }
            Err(e) if is_conflict(&e) => conflicts += 1,
            // Landed or not: read again first (a claim that landed late
            // conflicts with itself, and is this process's own).
            Err(e) => tokio::time::sleep(retry(e.to_string())?).await,
        }
    }
    Err(ClaimError::Unavailable(format!("{CLAIM_ATTEMPTS} conflicting claims in a row")))
}

/// Read `key`: what is known of it now, and the replica that holds it
/// when another process does.
async fn read(shared: &Shared, key: &str) -> Result<(Known, Option<String>), ClaimError> {
    let entry = shared.sessions.entry(key).await.map_err(|e| ClaimError::Unavailable(e.to_string()))?;
    Ok(match &entry {
        None => (Known { revision: 0, foreign_claim_ms: None }, None),
        Some(e) => {
            let foreign = (e.operation == Operation::Put)
                .then(|| OwnerRecord::decode(&e.value).ok())
                .flatten()
                .filter(|r| r.instance != shared.config.instance);
            let known = Known { revision: e.revision, foreign_claim_ms: foreign.as_ref().map(|r| r.claimed_at_ms) };
            (known, foreign.map(|r| r.replica))
        }
    })
}

/// Delete the claim on `client_id` if `revision` is still the latest (a
/// delete marker expecting that revision, gone after [`RELEASED_TTL`]); a
/// later claim elsewhere stays.
pub(crate) async fn release(shared: &Shared, client_id: &str, revision: u64) {
    let started = Instant::now();
    let publish = release_marker(revision);
    let key = client_key(client_id);
    let outcome = match shared.state.send_publish(subject(&key), publish).await {
        Ok(ack) => ack.await.map(|ack| shared.known_revisions().saw(&key, ack.sequence, None)),
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
        // This replica's own claim or release, known since its
        // acknowledgement (which recorded it as the claim would have
        // here): no record to decode, no shard to tell. Every replica's
        // watch delivers every write; most are the replica's own.
        if shared.known_revisions().wrote(&entry.key, entry.revision) {
            return;
        }
        let record = (entry.operation == Operation::Put).then(|| OwnerRecord::decode(&entry.value).ok()).flatten();
        let foreign = record.as_ref().filter(|r| r.instance != shared.config.instance).map(|r| r.claimed_at_ms);
        shared.known_revisions().saw(&entry.key, entry.revision, foreign);
        let Some(record) = record else { return };
        crate::sweeper::clean_start_seen(&shared, &record);
        if record.instance == shared.config.instance {
            return;
        }
        // The record names the client identifier (a long one's key is a
        // hash); one that does not make the key is not trusted.
        if !is_client_key_of(&entry.key, &record.client_id) {
            return;
        }
        let client_id = record.client_id;
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
/// a claim takes any entry over. Delete markers older than
/// [`RELEASED_TTL`] (written before releases carried a TTL: a cluster
/// that ran an older build) are written again with the TTL, so they go
/// too.
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
        match shared.state.send_publish(subject(&key), release_marker(revision)).await {
            Ok(ack) => ack.await.is_ok(),
            Err(_) => false,
        }
    });
    let swept = deletes.buffer_unordered(SWEEP_WINDOW).filter(|landed| std::future::ready(*landed)).count().await;
    if swept > 0 {
        info!(target: "cluster", swept, "cluster: swept the client identifier ownership of gone replicas (and delete markers without a TTL)");
    }
}

/// Every entry of `mqtt-sessions` whose owner is handed over, and every
/// delete marker that outlived [`RELEASED_TTL`] (one without a TTL):
/// (key, revision).
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
    // A marker with the TTL is gone RELEASED_TTL after it was written; one
    // still there well after that has none (clocks of the replica and the
    // NATS server may differ a little).
    let legacy_before_s = (now_ms / 1000) as i64 - 3 * RELEASED_TTL.as_secs() as i64;
    while let Ok(Some(Ok(entry))) = tokio::time::timeout(SCAN_QUIET, watch.next()).await {
        match entry.operation {
            Operation::Put => {
                if let Ok(owner) = OwnerRecord::decode(&entry.value) {
                    // This process's own current claims are live (`live`
                    // holds its instance at its epoch).
                    if handed_over(&owner, &live, shared, now_ms) {
                        stale.push((entry.key.clone(), entry.revision));
                    }
                }
            }
            Operation::Delete if entry.created.unix_timestamp() < legacy_before_s => {
                stale.push((entry.key.clone(), entry.revision));
            }
            // The server's expiry markers carry the bucket's
            // subject_delete_marker_ttl.
            Operation::Delete | Operation::Purge => {}
        }
        if entry.delta == 0 || entry.revision >= last {
            break;
        }
    }
    Ok(stale)
}

#[cfg(test)]
mod tests {
    use super::{flap_wait, Known, KnownRevisions, FLAP_DELAY};
    use std::time::Duration;

    #[test]
    fn a_claim_over_another_replicas_fresh_claim_waits_out_the_rest_of_the_flap_delay() {
        let now = 1_000_000;
        assert_eq!(flap_wait(None, now), Duration::ZERO, "no other replica's claim: no wait");
        assert_eq!(flap_wait(Some(now), now), FLAP_DELAY);
        assert_eq!(flap_wait(Some(now - 300), now), Duration::from_millis(700));
        assert_eq!(flap_wait(Some(now - 1_000), now), Duration::ZERO);
        assert_eq!(flap_wait(Some(now - 60_000), now), Duration::ZERO, "an old claim: no wait");
        assert_eq!(flap_wait(Some(now + 5_000), now), FLAP_DELAY, "a claim from the future waits the delay, no more");
    }

    #[test]
    fn known_revisions_remember_who_claimed_last_and_when() {
        let mut known = KnownRevisions::default();
        assert_eq!(known.expect("k"), Known { revision: 0, foreign_claim_ms: None });
        known.saw("k", 5, Some(42));
        assert_eq!(known.expect("k"), Known { revision: 5, foreign_claim_ms: Some(42) });
        known.saw("k", 4, None);
        assert_eq!(known.expect("k").revision, 5, "an older revision is ignored");
        known.saw("k", 6, None);
        assert_eq!(known.expect("k"), Known { revision: 6, foreign_claim_ms: None }, "this replica's own write");
    }
}
