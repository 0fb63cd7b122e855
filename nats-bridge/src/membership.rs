//! Driving the membership machine (core `cluster::membership`) with NATS:
//! heartbeats on the lease connection, the store probe and the
//! `mqtt-members` watch on the state connection (DESIGN.md §5, §14).
//!
//! A heartbeat is a raw publish to `$KV.mqtt-members.<replica>` with a
//! per-message TTL of `member_ttl` (not async-nats `create_with_ttl`, which
//! loses the TTL over a marker); each runs as its own task, so a slow one
//! never delays the next.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::kv::Operation;
use async_nats::jetstream::message::PublishMessage;
use bytes::Bytes;
use fleetmq_core::cluster::membership::{Change, FenceReason, Membership, PROBE_INTERVAL};
use fleetmq_core::cluster::records::{bucket, MemberRecord, Record, FORMATS_READ};
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

/// Run membership until the bridge stops. `first_write` fires when the
/// replica first serves.
pub(crate) async fn run(shared: Arc<Shared>, first_write: oneshot::Sender<()>) {
    let config = &shared.config;
    let ttl = config.cluster.member_ttl;
    let me = config.replica_id.clone();
    let mut machine = Membership::new(me.clone(), ttl, Instant::now());
    let record = MemberRecord {
        format: shared.status.write_format(),
        replica: me.clone(),
        instance: config.instance.clone(),
        started_at_ms: config.started_at_ms,
        member_ttl_ms: ttl.as_millis() as u64,
        mesh: if config.cluster.mesh_advertise.is_empty() {
            config.cluster.mesh_listen.clone()
        } else {
            config.cluster.mesh_advertise.clone()
        },
        mesh_versions: vec![1],
        reads: [*FORMATS_READ.start(), *FORMATS_READ.end()],
    };
    let payload = Bytes::from(record.encode());
    let subject = format!("$KV.{}.{me}", bucket::MEMBERS);
    let (report, mut reports) = mpsc::unbounded_channel();
    tokio::task::spawn_local(watch_members(shared.clone(), report.clone()));
    let mut first_write = Some(first_write);
    let mut last_probe: Option<Instant> = None;
    // Set while another process holds this replica ID (DESIGN.md §12).
    let mut duplicate: Option<String> = None;
    let mut fenced_reason: Option<FenceReason> = Some(FenceReason::Starting);
    while !shared.stopping.load(std::sync::atomic::Ordering::Acquire) {
        let now = Instant::now();
        if duplicate.is_none() && machine.heartbeat_due(now) {
            let id = machine.sent(now);
            tokio::task::spawn_local(heartbeat(shared.clone(), subject.clone(), payload.clone(), ttl, id, report.clone()));
        }
        if last_probe.is_none_or(|at| now.duration_since(at) >= PROBE_INTERVAL) {
            last_probe = Some(now);
            tokio::task::spawn_local(probe(shared.clone(), report.clone()));
        }
        for change in machine.tick(now) {
            apply(&shared, &change, &mut fenced_reason);
            if change == Change::Unfenced {
                if let Some(first) = first_write.take() {
                    let _ = first.send(());
                }
            }
        }
        publish_status(&shared, &machine, fenced_reason, duplicate.as_deref());
        shared.duplicate.store(duplicate.is_some(), std::sync::atomic::Ordering::Release);
        let next_probe = last_probe.map_or(now, |at| at + PROBE_INTERVAL);
        let deadline = machine.next_deadline(now).min(next_probe).max(now + Duration::from_millis(5));
        tokio::select! {
            Some(r) = reports.recv() => {
                handle(&mut machine, &mut duplicate, &shared, r);
                // Take what else arrived before the next tick.
                while let Ok(r) = reports.try_recv() {
                    handle(&mut machine, &mut duplicate, &shared, r);
                }
            }
            () = tokio::time::sleep_until(deadline.into()) => {}
            () = shared.stop.notified() => {}
        }
    }
}

fn handle(machine: &mut Membership, duplicate: &mut Option<String>, shared: &Shared, report: Report) {
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
                    // Two processes with one replica ID: the one started
                    // later steps back (ties broken by instance).
                    let mine = (shared.config.started_at_ms, shared.config.instance.as_str());
                    if (other.started_at_ms, other.instance.as_str()) < mine {
                        if duplicate.is_none() {
                            warn!(target: "cluster", replica = %me, other = %other.instance,
                                "cluster: duplicate replica id: another process (started earlier) runs replica {me}; this one stays not ready");
                        }
                        *duplicate = Some(other.instance.clone());
                    }
                    return;
                }
            }
            if let Some(r) = &record {
                if let Ok(mut live) = shared.live.lock() {
                    live.insert(replica.clone(), r.instance.clone());
                }
                if r.member_ttl_ms != shared.config.cluster.member_ttl.as_millis() as u64 {
                    warn!(target: "cluster", peer = %replica, their_ttl_ms = r.member_ttl_ms,
                        "cluster: a member runs with another member_ttl");
                }
            }
            if let Some(change) = machine.entry_present(&replica, revision, now) {
                info!(target: "cluster", ?change, "cluster: member joined");
            }
        }
        Report::Missing { replica, revision } => {
            if &replica == me && duplicate.is_some() {
                // The other process is gone: this one takes over.
                *duplicate = None;
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
            if let Ok(mut live) = shared.live.lock() {
                live.remove(peer);
            }
        }
        Change::PeerJoined(peer) => info!(target: "cluster", %peer, "cluster: replica joined"),
        _ => {}
    }
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
