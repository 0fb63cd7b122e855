//! The leader lock and the sweeper (DESIGN.md §4, §5): one replica at a
//! time holds the lease key `sweeper` in `mqtt-leader` and, while it
//! decides for others (its own last landed membership write was sent less
//! than T ago), sends the wills of connections whose replica is stopped,
//! fenced or gone, once `will_stop_grace` or what is left of the will's
//! own wait (Will Delay, or a shorter Session Expiry), whichever is
//! longer, has passed and unless the client reconnected anywhere
//! meanwhile; and sweeps those replicas' entries in `mqtt-sessions`
//! ([`crate::ownership::sweep`]); and ends the persistent sessions of
//! gone processes once they expired ([`crate::expiry`]).
//!
//! A will is handed over when its process is no live member (gone,
//! stopped, or replaced by a new process of its replica ID) or when it was
//! declared at an older epoch than its process's current one (the process
//! fenced since, which closed its connections and handed their wills over).
//!
//! The lease is built from raw publishes with an expected last subject
//! sequence and a per-message TTL (not async-nats `create_with_ttl`,
//! DESIGN.md §14). A will is sent once: the sweeper first deletes it with
//! a compare-and-set on the revision it read, and sends it only when that
//! delete landed, so two sweepers (a lease that changed hands) cannot both
//! send it.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::kv::Operation;
use async_nats::jetstream::message::PublishMessage;
use bytes::Bytes;
use fleetmq_core::cluster::records::{bucket, client_key, ended_will_key, is_ended_will_key, OwnerRecord, Record};
use fleetmq_core::cluster::wills::{Reconnected, WillRecord};
use tracing::{debug, info, warn};

use crate::bridge::{Event, Shared};
use crate::membership::unix_ms;
use crate::ownership::OwnerSweep;
use crate::watch::{follow, Seen, Start};

/// The lease key in `mqtt-leader`.
const LEASE_KEY: &str = "sweeper";

/// How often the sweeper looks at the wills.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// A will in `mqtt-session-will` as the watch brought it
/// ([`Shared::will_map`], by key).
#[derive(Debug, Clone)]
pub(crate) struct KnownWill {
    /// Its revision.
    revision: u64,
    record: WillRecord,
    /// When this replica's watch brought this revision.
    seen: Instant,
}

/// Write `record` as `client_id`'s will. With `clean_start` (the
/// CONNECT's Clean Start 1), a will of another process's connection (or
/// of this one's before a fence) with this client identifier that waits
/// for its Will Delay Interval is kept first under
/// [`ended_will_key`]: the new CONNECT ended its session, so it is due
/// now (MQTT 5 §3.1.2.5), and the sweeper sends it once its process is
/// handed over — or drops it, its process being alive and having sent it
/// itself at the take-over (see [`sweep_ended`]). Replaced, it was lost.
///
/// # Errors
/// JetStream did not take it.
pub(crate) async fn put_will(shared: &Shared, client_id: &str, record: Bytes, clean_start: bool) -> Result<u64, String> {
    if let Some(ended) = clean_start.then(|| ended_by_clean_start(shared, client_id)).flatten() {
        let subject = format!("$KV.{}.{}", bucket::WILLS, ended_will_key(client_id));
        let kept = match shared.state.send_publish(subject, PublishMessage::build().payload(ended.encode().into())).await {
            Ok(ack) => ack.await.map(|_| ()).map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        if let Err(e) = kept {
            warn!(target: "cluster", client_id, error = %e, "cluster: the will of a session ended by this CONNECT was not kept: it is lost");
        }
    }
    let subject = format!("$KV.{}.{}", bucket::WILLS, client_key(client_id));
    let ack = shared.state.send_publish(subject, PublishMessage::build().payload(record)).await.map_err(|e| e.to_string())?;
    ack.await.map(|a| a.sequence).map_err(|e| e.to_string())
}

/// `client_id`'s will, stored at `revision`, is held by this replica for
/// its delay after its connection ended: record `due_at_ms` in it (a
/// compare-and-set on `revision`), so that the sweeper sends it then if
/// this replica is gone. The new revision.
///
/// # Errors
/// The will was replaced or deleted meanwhile, or JetStream did not answer.
pub(crate) async fn will_delayed(shared: &Shared, client_id: &str, revision: u64, due_at_ms: u64) -> Result<u64, String> {
    let key = client_key(client_id);
    let entry = shared.wills.entry(&key).await.map_err(|e| e.to_string())?;
    let Some(entry) = entry.filter(|e| e.revision == revision && e.operation == Operation::Put) else {
        return Err("the will was replaced".into());
    };
    let mut record = WillRecord::decode(&entry.value).map_err(|e| e.to_string())?;
    record.due_at_ms = Some(due_at_ms);
    let subject = format!("$KV.{}.{key}", bucket::WILLS);
    let publish = PublishMessage::build().payload(record.encode().into()).expected_last_subject_sequence(revision);
    let ack = shared.state.send_publish(subject, publish).await.map_err(|e| e.to_string())?;
    ack.await.map(|a| a.sequence).map_err(|e| e.to_string())
}

/// The will in the bucket (as the watch brought it) whose session a
/// CONNECT of `client_id` with Clean Start 1 on this replica ends: one of
/// another process's connection, or of this process's before a fence,
/// that has a Will Delay Interval (as [`WillRecord::after_claim`] reads a
/// claim: one without a delay is withheld when its client is back).
fn ended_by_clean_start(shared: &Shared, client_id: &str) -> Option<WillRecord> {
    let wills = shared.will_map.lock().ok()?;
    let record = &wills.get(&client_key(client_id))?.record;
    let other = record.instance != shared.config.instance || record.epoch < shared.status.epoch();
    (other && record.delay_s > 0).then(|| record.clone())
}

/// Delete `client_id`'s will if `revision` is still its latest.
pub(crate) async fn delete_will(shared: &Shared, client_id: &str, revision: u64) -> Result<(), String> {
    delete_will_key(shared, &client_key(client_id), revision).await
}

/// Delete the will at `key` if `revision` is still its latest.
async fn delete_will_key(shared: &Shared, key: &str, revision: u64) -> Result<(), String> {
    let subject = format!("$KV.{}.{key}", bucket::WILLS);
    let publish = crate::setup::delete_marker().expected_last_subject_sequence(revision);
    let ack = shared.state.send_publish(subject, publish).await.map_err(|e| e.to_string())?;
    ack.await.map(|_| ()).map_err(|e| e.to_string())
}

/// Run the lease and the sweeper until the bridge stops.
pub(crate) async fn run(shared: Arc<Shared>) {
    tokio::task::spawn_local(watch_wills(shared.clone()));
    let ttl = shared.config.cluster.member_ttl;
    let grace = shared.config.cluster.will_stop_grace;
    let mut lease = Lease::default();
    let mut orphaned: HashMap<String, Orphaned> = HashMap::new();
    let mut owners = OwnerSweep::default();
    let mut sessions = crate::expiry::SessionSweep::default();
    let mut was_fenced = true;
    let mut serving_since = Instant::now();
    let mut last_sweep = Instant::now();
    while !shared.stopping.load(Ordering::Acquire) {
        let fenced = shared.status.is_fenced();
        if fenced {
            lease.revision = None;
        } else {
            lease.keep(&shared, ttl).await;
        }
        // The grace counts from when this replica serves again (after a
        // whole-NATS outage it saw nothing meanwhile).
        if was_fenced && !fenced {
            orphaned.clear();
            sessions = crate::expiry::SessionSweep::default();
            serving_since = Instant::now();
        }
        was_fenced = fenced;
        forget_clean_starts(&shared);
        if lease.revision.is_none() {
            // A new holder of the lock scans everything once.
            owners = OwnerSweep::default();
        }
        if !fenced && lease.valid(ttl) && shared.decides_for_others() && last_sweep.elapsed() >= SWEEP_EVERY {
            last_sweep = Instant::now();
            sweep(&shared, &mut orphaned, grace, serving_since).await;
            sweep_ended(&shared).await;
            crate::expiry::sweep(&shared, &mut sessions, serving_since).await;
            crate::ownership::sweep(&shared, &mut owners).await;
            crate::routes::sweep(&shared).await;
            crate::floor::raise(&shared).await;
        }
        tokio::select! {
            () = tokio::time::sleep(ttl / 6) => {}
            () = shared.stop.notified() => {}
        }
    }
}

/// When a will was first seen handed over, on this clock and in Unix
/// milliseconds.
#[derive(Debug, Clone, Copy)]
struct Orphaned {
    since: Instant,
    since_ms: u64,
}

/// This replica's hold on the lease.
#[derive(Default)]
struct Lease {
    /// The revision of the last write that landed, while held.
    revision: Option<u64>,
    /// When that write was sent.
    sent_at: Option<Instant>,
}

impl Lease {
    /// Held, counted from the send time of the last write that landed,
    /// with a third of the TTL to spare.
    fn valid(&self, ttl: Duration) -> bool {
        self.revision.is_some() && self.sent_at.is_some_and(|at| at.elapsed() < ttl * 2 / 3)
    }

    /// Renew the lease if held (compare-and-set on its revision), or take
    /// it when free (no key, or a delete or expiry marker).
    async fn keep(&mut self, shared: &Shared, ttl: Duration) {
        if self.sent_at.is_some_and(|at| at.elapsed() < ttl / 3) && self.revision.is_some() {
            return;
        }
        let expected = match self.revision {
            Some(revision) => revision,
            None => {
                let Ok(kv) = shared.state.get_key_value(bucket::LEADER).await else { return };
                match kv.entry(LEASE_KEY).await {
                    Ok(None) => 0,
                    Ok(Some(e)) if e.operation != Operation::Put => e.revision,
                    // Held by someone (maybe this process before a fence):
                    // wait for it to expire.
                    Ok(Some(_)) | Err(_) => return,
                }
            }
        };
        let value = format!(
            "{{\"format\":1,\"replica\":\"{}\",\"instance\":\"{}\"}}",
            shared.config.replica_id, shared.config.instance
        );
        let subject = format!("$KV.{}.{LEASE_KEY}", bucket::LEADER);
        let publish = PublishMessage::build().payload(value.into()).expected_last_subject_sequence(expected).ttl(ttl);
        let sent = Instant::now();
        let outcome = match shared.lease.send_publish(subject, publish).await {
            Ok(ack) => ack.await,
            Err(e) => Err(e),
        };
        match outcome {
            Ok(ack) => {
                if self.revision.is_none() {
                    info!(target: "cluster", replica = %shared.config.replica_id, "cluster: this replica sweeps (leader lock taken)");
                }
                self.revision = Some(ack.sequence);
                self.sent_at = Some(sent);
            }
            Err(e) => {
                if self.revision.take().is_some() {
                    // A compare-and-set refused: another replica holds it
                    // now; anything else: JetStream did not take the
                    // renewal (an outage, an election), and the lock
                    // lapses after its TTL unless taken again.
                    let why = e.to_string();
                    if why.contains("wrong last sequence") {
                        warn!(target: "cluster", error = %why, "cluster: leader lock taken by another replica; this one stops sweeping");
                    } else {
                        warn!(target: "cluster", error = %why, ttl = ?ttl, "cluster: leader lock not renewed (JetStream did not take it); this one stops sweeping until it takes the lock again");
                    }
                }
            }
        }
    }
}

/// Send or withhold every handed-over will whose wait is over (see the
/// module's doc).
async fn sweep(shared: &Shared, orphaned: &mut HashMap<String, Orphaned>, grace: Duration, serving_since: Instant) {
    let live = shared.live_instances();
    let (now, now_ms) = (Instant::now(), unix_ms());
    let due: Vec<(String, u64, WillRecord)> = {
        let Ok(wills) = shared.will_map.lock() else { return };
        orphaned.retain(|key, _| wills.contains_key(key));
        wills
            .iter()
            .filter(|(key, _)| !is_ended_will_key(key))
            .filter_map(|(key, KnownWill { revision, record, .. })| {
                if live.get(&record.instance).is_some_and(|epoch| record.epoch >= *epoch) {
                    orphaned.remove(key);
                    return None;
                }
                let orphan = *orphaned.entry(key.clone()).or_insert_with(|| {
                    // Since its process was taken for gone (or stopped),
                    // when this replica knows it; and never before this
                    // replica serves.
                    let since = shared.gone_at(&record.instance).unwrap_or(now).max(serving_since);
                    let ago = now.saturating_duration_since(since).as_millis() as u64;
                    Orphaned { since, since_ms: now_ms.saturating_sub(ago) }
                });
                let wait = record.sweep_wait(orphan.since_ms, grace);
                let over = now.saturating_duration_since(orphan.since) >= wait;
                (over || session_ended(shared, record)).then(|| (key.clone(), *revision, record.clone()))
            })
            .collect()
    };
    for (key, revision, record) in due {
        // Each send is a decision for others: only while this replica's
        // own lease is current.
        if !shared.decides_for_others() {
            return;
        }
        orphaned.remove(&key);
        let back = client_back(shared, &record).await;
        let Ok(back) = back else { continue };
        // Delete first: only the sweeper whose delete landed sends it.
        if delete_will(shared, &record.client_id, revision).await.is_err() {
            continue;
        }
        if back == Reconnected::Resumed {
            shared.status.stats.wills_withheld.fetch_add(1, Ordering::Relaxed);
            debug!(target: "cluster", client_id = %record.client_id, "cluster: will withheld, the client is back");
            continue;
        }
        let Some(will) = record.will() else { continue };
        shared.status.stats.wills_sent.fetch_add(1, Ordering::Relaxed);
        info!(target: "cluster", client_id = %record.client_id, replica = %record.replica, "cluster: sending the will of a connection handed over by its replica");
        let shard = (shared.config.owner_of)(&record.client_id, shared.mailboxes.len());
        shared.send_event(shard, Event::PublishWill { will });
    }
}

/// Send or drop the wills whose session a Clean Start 1 CONNECT on another
/// replica ended (see [`put_will`]): sent at once (delete first, as
/// [`sweep`] does) when its process is handed over; dropped when its
/// process is still live `2 × member_ttl` after the will was kept — a
/// process that died before is taken for gone by then (DESIGN.md §5), so
/// it was alive when its client came back, and sent the will itself.
async fn sweep_ended(shared: &Shared) {
    let live = shared.live_instances();
    let alive_for = 2 * shared.config.cluster.member_ttl;
    let ended: Vec<(String, u64, Option<WillRecord>)> = {
        let Ok(wills) = shared.will_map.lock() else { return };
        wills
            .iter()
            .filter(|(key, _)| is_ended_will_key(key))
            .filter_map(|(key, known)| {
                let record = &known.record;
                let alive = live.get(&record.instance).is_some_and(|epoch| record.epoch >= *epoch);
                match alive {
                    false => Some((key.clone(), known.revision, Some(record.clone()))),
                    true if known.seen.elapsed() >= alive_for => Some((key.clone(), known.revision, None)),
                    true => None,
                }
            })
            .collect()
    };
    for (key, revision, send) in ended {
        if !shared.decides_for_others() {
            return;
        }
        // Delete first: only the sweeper whose delete landed sends it.
        if delete_will_key(shared, &key, revision).await.is_err() {
            continue;
        }
        let Some(will) = send.as_ref().and_then(WillRecord::will) else { continue };
        let record = send.as_ref().expect("a will to send has its record");
        shared.status.stats.wills_sent.fetch_add(1, Ordering::Relaxed);
        info!(target: "cluster", client_id = %record.client_id, replica = %record.replica, "cluster: sending the will of a handed-over connection whose session a Clean Start ended");
        let shard = (shared.config.owner_of)(&record.client_id, shared.mailboxes.len());
        shared.send_event(shard, Event::PublishWill { will });
    }
}

/// Whether the will's client connected again since (anywhere), and how
/// ([`WillRecord::after_claim`]): its client identifier is claimed by
/// another process, or by its own after it came back from a fence.
async fn client_back(shared: &Shared, record: &WillRecord) -> Result<Reconnected, String> {
    let entry = shared.sessions.entry(client_key(&record.client_id)).await.map_err(|e| e.to_string())?;
    Ok(match entry {
        Some(e) if e.operation == Operation::Put => {
            OwnerRecord::decode(&e.value).map_or(Reconnected::No, |owner| record.after_claim(&owner))
        }
        _ => Reconnected::No,
    })
}

/// The ownership watch saw the claim `owner` (in revision order): the
/// latest claim of a client identifier, when made with Clean Start 1, is
/// remembered (while a will of its client identifier is in the bucket,
/// see [`forget_clean_starts`]), so that the sweeper sends a handed-over
/// delayed will whose session it ended at once rather than when its wait
/// is over.
pub(crate) fn clean_start_seen(shared: &Shared, owner: &OwnerRecord) {
    if let Ok(mut seen) = shared.clean_starts.lock() {
        if owner.clean_start {
            seen.insert(owner.client_id.clone(), owner.clone());
        } else {
            seen.remove(&owner.client_id);
        }
    }
}

/// Whether a claim with Clean Start 1 ended the session of `record`'s
/// delayed will since it was declared (MQTT 5 §3.1.2.5).
fn session_ended(shared: &Shared, record: &WillRecord) -> bool {
    let seen = shared.clean_starts.lock();
    seen.ok()
        .and_then(|seen| seen.get(&record.client_id).map(|owner| record.after_claim(owner)))
        .is_some_and(|back| back == Reconnected::SessionEnded)
}

/// Forget the Clean Start claims of client identifiers that have no will
/// in the bucket (bounded by the claims made between two calls).
fn forget_clean_starts(shared: &Shared) {
    let Ok(wills) = shared.will_map.lock() else { return };
    if let Ok(mut seen) = shared.clean_starts.lock() {
        seen.retain(|client_id, _| wills.contains_key(&client_key(client_id)));
    }
}

/// Keep [`Shared::will_map`] current from a watch on
/// `mqtt-session-will`.
async fn watch_wills(shared: Arc<Shared>) {
    follow(&shared, bucket::WILLS, Start::History, None, |seen| {
        let Seen::Entry(entry) = seen else { return };
        let Ok(mut wills) = shared.will_map.lock() else { return };
        match entry.operation {
            Operation::Put => match WillRecord::decode(&entry.value) {
                Ok(record) => {
                    wills.insert(entry.key, KnownWill { revision: entry.revision, record, seen: Instant::now() });
                }
                Err(_) => {
                    wills.remove(&entry.key);
                }
            },
            Operation::Delete | Operation::Purge => {
                wills.remove(&entry.key);
            }
        }
    })
    .await;
}
