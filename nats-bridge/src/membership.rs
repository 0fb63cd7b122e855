//! Driving the membership machine (core `cluster::membership`) with NATS:
//! heartbeats on the lease connection, the store probe and the
//! `mqtt-members` watch on the state connection (DESIGN.md §5, §14).
//!
//! A heartbeat is a raw publish to `$KV.mqtt-members.<replica>` with a
//! per-message TTL of `member_ttl` (not async-nats `create_with_ttl`, which
//! loses the TTL over a marker); each runs as its own task, so a slow one
//! never delays the next.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::kv::Operation;
use async_nats::jetstream::message::PublishMessage;
use bytes::Bytes;
use fleetmq_core::cluster::membership::{Change, FenceReason, Membership, PROBE_INTERVAL};
use fleetmq_core::cluster::records::{bucket, MemberRecord, Record, FORMATS_READ};
use fleetmq_core::settings::format_duration;
use tokio::sync::{mpsc, oneshot};
use tracing::{info, warn};

use crate::bridge::{Event, Shared};
use crate::stats::OpKind;
use crate::watch::{follow, Seen, Start};

/// What the tasks report to the membership loop.
enum Report {
    Landed(u64, u64),
    Failed(u64, String),
    ProbeAnswered(Instant),
    Present { replica: String, revision: u64, record: Option<MemberRecord> },
    Missing { replica: String, revision: u64 },
}

/// Unix milliseconds now.
pub(crate) fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// This replica's entry in `mqtt-members` (`leaving`: the last one, written
/// at a clean stop before the entry is deleted; `follows`: the instance
/// whose leaving entry this process took the replica ID over from).
fn member_record(shared: &Shared, leaving: bool, follows: Option<&str>) -> MemberRecord {
    let config = &shared.config;
    MemberRecord {
        format: shared.status.write_format(),
        replica: config.replica_id.clone(),
        instance: config.instance.clone(),
        started_at_ms: config.started_at_ms,
        member_ttl_ms: config.cluster.member_ttl.as_millis() as u64,
        mesh: config.mesh.clone(),
        mesh_versions: if config.mesh.is_empty() { Vec::new() } else { config.mesh_versions.clone() },
        reads: [*FORMATS_READ.start(), *FORMATS_READ.end()],
        epoch: shared.status.epoch(),
        leaving,
        follows: follows.map(str::to_owned),
    }
}

fn member_subject(shared: &Shared) -> String {
    format!("$KV.{}.{}", bucket::MEMBERS, shared.config.replica_id)
}

/// Another process's entry under this replica ID, read before this one
/// writes anything (a write first would hide it: the `mqtt-members` watch
/// shows the last value of each key). A leaving entry is a process that
/// stops, not a duplicate; an entry that cannot be read is taken for none.
async fn entry_of_another(shared: &Shared) -> Option<MemberRecord> {
    let kv = shared.state.get_key_value(bucket::MEMBERS).await.ok()?;
    let entry = kv.entry(&shared.config.replica_id).await.ok()??;
    if entry.operation != Operation::Put {
        return None;
    }
    let record = MemberRecord::decode(&entry.value).ok()?;
    (record.instance != shared.config.instance).then_some(record)
}

/// How long one try of the leaving entry waits for its acknowledgement.
const LEAVE_TRY_WAIT: Duration = Duration::from_secs(1);

/// The pause before the leaving entry is tried again: a server that just
/// came back (from SIGSTOP, say) may answer "no stream found" or not at
/// all for a moment.
const LEAVE_PAUSE: Duration = Duration::from_millis(200);

/// Leave at a clean stop: a last entry that says so, on the lease
/// connection, expiring a second later, so that the peers log this
/// replica as stopped at once rather than gone after `member_ttl` and T/2.
/// (Not deleted: a delete right after it could replace it in the bucket
/// before a watcher read it.) A try that fails or is not acknowledged
/// within [`LEAVE_TRY_WAIT`] is made again after [`LEAVE_PAUSE`], until
/// one lands or `by` (the stop's budget) passes; one warning then if none
/// landed. A duplicate leaves nothing: the entry is the other process's.
pub(crate) async fn leave(shared: &Shared, by: tokio::time::Instant) {
    if shared.duplicate.load(std::sync::atomic::Ordering::Acquire) {
        return;
    }
    let record = Bytes::from(member_record(shared, true, None).encode());
    let subject = member_subject(shared);
    let write = || {
        // The shortest TTL JetStream takes.
        let leaving = PublishMessage::build().payload(record.clone()).ttl(Duration::from_secs(1));
        let sent = shared.lease.send_publish(subject.clone(), leaving);
        async move {
            match tokio::time::timeout(LEAVE_TRY_WAIT, async { sent.await?.await }).await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err(format!("not acknowledged within {}", format_duration(LEAVE_TRY_WAIT))),
            }
        }
    };
    match try_until(by, LEAVE_PAUSE, write).await {
        Ok(1) => {}
        Ok(tries) => info!(target: "cluster", tries, "cluster: leaving written after {tries} tries"),
        Err(Unlanded { tries, last }) => {
            let error = last.unwrap_or_else(|| "the last try unanswered at the end of the stop budget".into());
            warn!(target: "cluster", tries, %error, "cluster: leaving not written: the others take this replica for gone");
        }
    }
}

/// Why [`try_until`] gave up.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Unlanded<E> {
    /// Tries made (at least one).
    pub(crate) tries: u32,
    /// The last try's error; `None` when it was still unanswered at the
    /// deadline (and dropped there).
    pub(crate) last: Option<E>,
}

/// Runs `attempt` until one succeeds or `by` passes, pausing `pause`
/// after each failure (less when `by` comes first); a try still running
/// at `by` is dropped.
///
/// # Errors
/// [`Unlanded`] when no try succeeded by `by`.
///
/// # Cancel safety
/// Dropping the future drops the try in progress.
pub(crate) async fn try_until<E, F: Future<Output = Result<(), E>>>(
    by: tokio::time::Instant,
    pause: Duration,
    mut attempt: impl FnMut() -> F,
) -> Result<u32, Unlanded<E>> {
    let mut tries = 0;
    loop {
        tries += 1;
        let failed = match tokio::time::timeout_at(by, attempt()).await {
            Ok(Ok(())) => return Ok(tries),
            Ok(Err(e)) => e,
            Err(_) => return Err(Unlanded { tries, last: None }),
        };
        tokio::time::sleep_until(by.min(tokio::time::Instant::now() + pause)).await;
        if tokio::time::Instant::now() >= by {
            return Err(Unlanded { tries, last: Some(failed) });
        }
    }
}

/// Run membership until the bridge stops. `first_write` fires when the
/// replica first serves, or when it finds another process running its
/// replica ID (it then stays not ready).
pub(crate) async fn run(shared: Arc<Shared>, first_write: oneshot::Sender<()>) {
    let config = &shared.config;
    let ttl = config.cluster.member_ttl;
    let me = config.replica_id.clone();
    let mut machine = Membership::new(me.clone(), ttl, Instant::now());
    let subject = member_subject(&shared);
    let (report, mut reports) = mpsc::unbounded_channel();
    let mut first_write = Some(first_write);
    // Whether another process holds this replica ID (DESIGN.md §12), and
    // whom this one took it over from.
    let mut standing = Standing::default();
    match entry_of_another(&shared).await {
        Some(other) if other.leaving => standing.follows = Some(other.instance),
        Some(other) => {
            warn!(target: "cluster", replica = %me, other = %other.instance,
                "cluster: duplicate replica id: another process (instance {}) runs replica {me}; this one stays not ready until it is gone", other.instance);
            standing.duplicate = Some(other.instance);
            publish_status(&shared, &machine, Some(FenceReason::Starting), standing.duplicate.as_deref());
            shared.duplicate.store(true, std::sync::atomic::Ordering::Release);
            if let Some(first) = first_write.take() {
                let _ = first.send(());
            }
        }
        None => {}
    }
    tokio::task::spawn_local(watch_members(shared.clone(), report.clone()));
    let mut last_probe: Option<Instant> = None;
    // Whether this process served before (an Unfenced after that is a
    // return from a fence).
    let mut served = false;
    let mut fenced_reason: Option<FenceReason> = Some(FenceReason::Starting);
    while !shared.stopping.load(std::sync::atomic::Ordering::Acquire) {
        let now = Instant::now();
        if standing.duplicate.is_none() && machine.heartbeat_due(now) {
            let id = machine.sent(now);
            let payload = Bytes::from(member_record(&shared, false, standing.follows.as_deref()).encode());
            tokio::task::spawn_local(heartbeat(shared.clone(), subject.clone(), payload, ttl, id, report.clone()));
        }
        if last_probe.is_none_or(|at| now.duration_since(at) >= PROBE_INTERVAL) {
            last_probe = Some(now);
            tokio::task::spawn_local(probe(shared.clone(), report.clone()));
        }
        for change in machine.tick(now) {
            if change == Change::Unfenced {
                if let Some(first) = first_write.take() {
                    let _ = first.send(());
                }
                if served {
                    // Back from a fence: what was handed over then is the
                    // cluster's (wills and claims of older epochs).
                    let epoch = shared.status.next_epoch();
                    shared.handovers.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    info!(target: "cluster", epoch, "cluster: back from a fence, new epoch");
                    // Taken for gone meanwhile, its routes were swept:
                    // written again.
                    shared.rewrite_routes.store(true, std::sync::atomic::Ordering::Release);
                }
                served = true;
            }
            apply(&shared, &change, &mut fenced_reason);
        }
        if let Ok(mut until) = shared.decides_until.lock() {
            *until = machine.decides_until();
        }
        publish_status(&shared, &machine, fenced_reason, standing.duplicate.as_deref());
        shared.duplicate.store(standing.duplicate.is_some(), std::sync::atomic::Ordering::Release);
        let next_probe = last_probe.map_or(now, |at| at + PROBE_INTERVAL);
        let deadline = machine.next_deadline(now).min(next_probe).max(now + Duration::from_millis(5));
        tokio::select! {
            Some(r) = reports.recv() => {
                handle(&mut machine, &mut standing, &shared, r, &mut fenced_reason);
                // Take what else arrived before the next tick.
                while let Ok(r) = reports.try_recv() {
                    handle(&mut machine, &mut standing, &shared, r, &mut fenced_reason);
                }
            }
            () = tokio::time::sleep_until(deadline.into()) => {}
            () = shared.stop.notified() => {}
        }
    }
}

/// This process's standing under its replica ID.
#[derive(Default)]
struct Standing {
    /// The instance of another process that runs this replica ID: this
    /// one stays not ready and writes nothing while it does.
    duplicate: Option<String>,
    /// The instance of the process that ran this replica ID before and
    /// stopped cleanly (its leaving entry read): said in this process's
    /// entries ([`MemberRecord::follows`]).
    follows: Option<String>,
}

/// Feed `report` to the machine; a change it causes at once (a peer left)
/// is applied at once, in the order of the reports.
fn handle(
    machine: &mut Membership,
    standing: &mut Standing,
    shared: &Shared,
    report: Report,
    fenced_reason: &mut Option<FenceReason>,
) {
    let now = Instant::now();
    let me = &shared.config.replica_id;
    match report {
        Report::Landed(id, revision) => machine.landed(id, revision),
        Report::Failed(id, why) => {
            machine.failed(id);
            tracing::debug!(target: "cluster", %why, "cluster: membership write failed");
        }
        Report::ProbeAnswered(at) => machine.probe_answered(at),
        Report::Present { replica, revision, record } => {
            let other_instance = record.as_ref().filter(|r| r.instance != shared.config.instance);
            if &replica == me {
                if let Some(other) = other_instance {
                    if other.leaving {
                        // The other process stops: this one takes over
                        // and says whom from.
                        standing.duplicate = None;
                        standing.follows = Some(other.instance.clone());
                        return;
                    }
                    // Two processes with one replica ID: the one started
                    // later steps back (ties broken by instance).
                    let mine = (shared.config.started_at_ms, shared.config.instance.as_str());
                    if (other.started_at_ms, other.instance.as_str()) < mine {
                        if standing.duplicate.is_none() {
                            warn!(target: "cluster", replica = %me, other = %other.instance,
                                "cluster: duplicate replica id: another process (started earlier) runs replica {me}; this one stays not ready");
                        }
                        standing.duplicate = Some(other.instance.clone());
                    }
                    return;
                }
            }
            let leaving = record.as_ref().is_some_and(|r| r.leaving);
            if let Some(r) = &record {
                let known = shared.live.lock().ok().and_then(|live| live.get(&replica).map(|(i, _)| i.clone()));
                if known.is_some() && known == r.follows {
                    // The process it follows stopped cleanly; its leaving
                    // entry was replaced before this watch read it.
                    if let Some(left @ Change::PeerLeft(_)) = machine.entry_leaving(&replica, revision, now) {
                        apply(shared, &left, fenced_reason);
                    }
                }
                if let Ok(mut reads) = shared.member_reads.lock() {
                    reads.insert(replica.clone(), r.reads);
                }
                // Seen alive: not gone (whatever this replica concluded).
                if let Ok(mut gone) = shared.gone.lock() {
                    gone.remove(&r.instance);
                }
                let replaced = shared
                    .live
                    .lock()
                    .ok()
                    .and_then(|mut live| live.insert(replica.clone(), (r.instance.clone(), r.epoch)));
                if replaced.as_ref().is_some_and(|(old, epoch)| *old == r.instance && *epoch < r.epoch) {
                    // Back from a fence: its older claims are handed over.
                    shared.handovers.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                let replaced = replaced.filter(|(old, _)| *old != r.instance);
                if let Some((old, _)) = replaced {
                    // A new process of that replica ID: the old one is gone.
                    info!(target: "cluster", peer = %replica, old = %old, "cluster: replica restarted");
                    mark_gone(shared, &old, now);
                }
                if !r.leaving {
                    crate::routes::member_seen(shared, r);
                }
                if r.member_ttl_ms != shared.config.cluster.member_ttl.as_millis() as u64 {
                    warn!(target: "cluster", peer = %replica, their_ttl_ms = r.member_ttl_ms,
                        "cluster: a member runs with another member_ttl");
                }
            }
            let change = if leaving {
                machine.entry_leaving(&replica, revision, now)
            } else {
                machine.entry_present(&replica, revision, now)
            };
            match change {
                Some(left @ Change::PeerLeft(_)) => apply(shared, &left, fenced_reason),
                Some(change) => info!(target: "cluster", ?change, "cluster: member joined"),
                None => {}
            }
        }
        Report::Missing { replica, revision } => {
            if &replica == me && standing.duplicate.is_some() {
                // The other process is gone: this one takes over.
                standing.duplicate = None;
                return;
            }
            machine.entry_missing(&replica, revision, now);
        }
    }
}

fn apply(shared: &Shared, change: &Change, fenced_reason: &mut Option<FenceReason>) {
    match change {
        Change::Fenced(reason) => {
            warn!(target: "cluster", reason = reason.as_str(), "cluster: fenced: closing connections, refusing CONNECT");
            *fenced_reason = Some(*reason);
            shared.broadcast(Event::Fenced(*reason));
            if *reason == FenceReason::StoreSilent {
                let client = shared.state_client.clone();
                tokio::task::spawn_local(async move {
                    let _ = client.force_reconnect().await;
                });
            }
        }
        Change::Unfenced => {
            info!(target: "cluster", "cluster: serving");
            *fenced_reason = None;
            shared.broadcast(Event::Unfenced);
        }
        Change::PeerGone(peer) => {
            warn!(target: "cluster", %peer, "cluster: replica gone");
            peer_out(shared, peer);
        }
        Change::PeerLeft(peer) => {
            info!(target: "cluster", %peer, "cluster: replica stopped");
            peer_out(shared, peer);
        }
        Change::PeerJoined(peer) => info!(target: "cluster", %peer, "cluster: replica joined"),
        _ => {}
    }
}

/// `peer` is gone or stopped: its process's wills and claims are the
/// sweeper's from now on.
fn peer_out(shared: &Shared, peer: &str) {
    crate::routes::member_out(shared, peer);
    let instance = shared.live.lock().ok().and_then(|mut live| live.remove(peer));
    if let Ok(mut reads) = shared.member_reads.lock() {
        reads.remove(peer);
    }
    if let Some((instance, _)) = instance {
        mark_gone(shared, &instance, Instant::now());
    }
}

/// Instances remembered as gone at most; the oldest are forgotten first
/// (an unknown instance's entries are still swept once old enough).
const GONE_MAX: usize = 4096;

fn mark_gone(shared: &Shared, instance: &str, now: Instant) {
    if let Ok(mut gone) = shared.gone.lock() {
        if gone.len() >= GONE_MAX {
            if let Some(oldest) = gone.iter().min_by_key(|(_, at)| **at).map(|(i, _)| i.clone()) {
                gone.remove(&oldest);
            }
        }
        gone.entry(instance.to_owned()).or_insert(now);
    }
    shared.handovers.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

fn publish_status(shared: &Shared, machine: &Membership, fenced: Option<FenceReason>, duplicate: Option<&str>) {
    let reason = match (duplicate, fenced) {
        (Some(other), _) => Some(format!(
            "duplicate replica id: another process (instance {other}) runs replica {}",
            shared.config.replica_id
        )),
        (None, Some(r)) => Some(r.as_str().to_owned()),
        (None, None) => None,
    };
    let mut members = machine.live_peers();
    if fenced.is_none() {
        members.push(shared.config.replica_id.clone());
        members.sort();
    }
    shared.status.set_members(members);
    shared.status.set_duplicate(duplicate.is_some());
    shared.status.set_fenced(fenced.is_some() || duplicate.is_some(), reason);
}

async fn heartbeat(
    shared: Arc<Shared>,
    subject: String,
    payload: Bytes,
    ttl: Duration,
    id: u64,
    report: mpsc::UnboundedSender<Report>,
) {
    let started = Instant::now();
    let publish = PublishMessage::build().payload(payload).ttl(ttl);
    let outcome = match shared.lease.send_publish(subject, publish).await {
        Ok(ack) => ack.await,
        Err(e) => Err(e),
    };
    shared.status.stats.record(OpKind::Heartbeat, started.elapsed());
    let _ = report.send(match outcome {
        Ok(ack) => Report::Landed(id, ack.sequence),
        Err(e) if e.kind() == PublishErrorKind::TimedOut => Report::Failed(id, "timed out".into()),
        Err(e) => Report::Failed(id, e.to_string()),
    });
}

async fn probe(shared: Arc<Shared>, report: mpsc::UnboundedSender<Report>) {
    let started = Instant::now();
    if shared.state.query_account().await.is_ok() {
        shared.status.stats.record(OpKind::Probe, started.elapsed());
        let _ = report.send(Report::ProbeAnswered(Instant::now()));
    }
}

/// Watch `mqtt-members` (state connection) and report every entry.
async fn watch_members(shared: Arc<Shared>, report: mpsc::UnboundedSender<Report>) {
    follow(&shared, bucket::MEMBERS, Start::History, None, |seen| {
        let Seen::Entry(entry) = seen else { return };
        let replica = entry.key.clone();
        let r = match entry.operation {
            Operation::Put => {
                Report::Present { replica, revision: entry.revision, record: MemberRecord::decode(&entry.value).ok() }
            }
            Operation::Delete | Operation::Purge => Report::Missing { replica, revision: entry.revision },
        };
        let _ = report.send(r);
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;
    use std::future::{ready, Ready};
    use tokio::time::Instant;

    /// A write whose n-th try (from 1, counted in `tries`) answers
    /// `outcome(n)` at once.
    fn counted<'a, E>(
        tries: &'a Cell<u32>,
        outcome: impl Fn(u32) -> Result<(), E> + 'a,
    ) -> impl FnMut() -> Ready<Result<(), E>> + 'a {
        move || {
            tries.set(tries.get() + 1);
            ready(outcome(tries.get()))
        }
    }

    #[tokio::test]
    async fn a_write_that_fails_twice_then_lands_is_tried_three_times_with_a_pause_between() {
        let tries = Cell::new(0);
        let started = Instant::now();
        let write = counted(&tries, |n| if n < 3 { Err("no stream found") } else { Ok(()) });
        let landed = try_until(started + Duration::from_secs(3), Duration::from_millis(20), write).await;
        assert_eq!(landed, Ok(3));
        assert!(started.elapsed() >= Duration::from_millis(40), "{:?}", started.elapsed());
    }

    #[tokio::test]
    async fn writes_that_keep_failing_stop_at_the_deadline_with_the_last_error() {
        let tries = Cell::new(0);
        let started = Instant::now();
        let by = started + Duration::from_millis(200);
        let write = counted(&tries, |n| Err(format!("failure {n}")));
        let Err(Unlanded { tries: made, last }) = try_until(by, Duration::from_millis(20), write).await else {
            panic!("nothing landed");
        };
        assert!(made >= 2 && made == tries.get(), "{made} tries");
        assert_eq!(last, Some(format!("failure {made}")));
        assert!(Instant::now() >= by && started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());
    }

    #[tokio::test]
    async fn a_write_unanswered_at_the_deadline_is_dropped_there() {
        let started = Instant::now();
        let by = started + Duration::from_millis(50);
        let unanswered = || std::future::pending::<Result<(), String>>();
        let gave_up = try_until(by, Duration::from_millis(20), unanswered).await;
        assert_eq!(gave_up, Err(Unlanded { tries: 1, last: None }));
        assert!(started.elapsed() < Duration::from_secs(1), "{:?}", started.elapsed());
    }
}
