//! Routes and discovery for the mesh (DESIGN.md §3, §4, §11; issue 25).
//!
//! - **Peers.** Each replica ID other than this one's gets a [`PeerId`] the
//!   first time its `mqtt-members` entry is seen ([`PeerNumbers`]: kept for
//!   the life of the process, never reused, at most
//!   [`PeerSet::MAX_PEERS`](fleetmq_core::cluster::peers::PeerSet::MAX_PEERS);
//!   beyond, logged once and ignored). [`Event::Peers`] (every live peer)
//!   goes to every shard when the set changes: a member joins, restarts
//!   (new instance), changes its mesh address or versions, leaves or is
//!   taken for gone. Peers are sent while this replica is fenced too: the
//!   list is what the `mqtt-members` watch last said, and a fenced replica
//!   has no clients whose values the mesh would carry (the mesh decides
//!   on its links itself).
//! - **This replica's routes.** Shards say when a filter gained its first
//!   or lost its last local subscriber on them ([`Request::Route`]); the
//!   bridge keeps the union over shards ([`LocalRoutes`]) and writes one
//!   entry per filter ([`route_key`], a [`RouteRecord`]) when the first
//!   shard wants it, deleting it after the last. One write per key at a
//!   time, the latest wish last (per-key order), keys written side by
//!   side (pipelined); a write that fails is tried again with a backoff.
//!   A shard's SUBACK waits for the put (at most 2 s, the shard's side).
//! - **The others' routes.** A watch of `mqtt-routes` (every present
//!   entry, then changes) keeps a [`RouteTable`]: entries of live peers
//!   written by their live process go to every shard as
//!   [`Event::Routes`] batches; a peer taken for gone or stopped has all
//!   of its filters removed.
//! - **Cleanup.** At start (before ready) a replica purges its own
//!   leftovers by subject (one request); a clean stop purges its own; the
//!   sweeper deletes the entries of processes taken for gone (each with a
//!   compare-and-set on the revision read). A replica back from a fence
//!   writes its entries again (it may have been taken for gone and swept
//!   meanwhile).
//!
//! [`Request::Route`]: crate::Request::Route

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::kv::Operation;
use async_nats::jetstream::message::PublishMessage;
use fleetmq_core::cluster::peers::{Peer, PeerNumbers, RouteChange};
use fleetmq_core::cluster::records::{bucket, MemberRecord, Record};
use fleetmq_core::cluster::routes::{
    is_route_key_of, parse_route_key, replica_routes_subject, route_key, LocalRoutes, RemoteEntry, RouteRecord, RouteTable,
};
use futures_util::StreamExt;
use tokio::sync::oneshot;
use tracing::{debug, info, warn};

use crate::bridge::{Event, Shared};
use crate::stats::OpKind;
use crate::watch::{follow, Seen, Start};

/// Route changes sent to the shards in one [`Event::Routes`] at most.
const BATCH: usize = 1024;

/// First backoff after a failed route write; doubles up to 5 s.
const FIRST_BACKOFF: Duration = Duration::from_millis(250);

/// Deletes of gone processes' entries the sweeper keeps in flight.
const SWEEP_WINDOW: usize = 256;

/// Peers and the other replicas' routes, shared by the membership loop and
/// the routes watch (bridge thread only).
#[derive(Default)]
pub(crate) struct Remote {
    numbers: PeerNumbers,
    /// Live peers by replica ID.
    peers: BTreeMap<String, Peer>,
    table: RouteTable,
    /// Replica IDs refused a number (logged once).
    unnumbered: HashSet<String>,
    /// When each process's entries were first seen not live (for the
    /// sweeper), by instance.
    not_live_since: HashMap<String, Instant>,
    /// Changes the watch made to the table and has not sent yet (it
    /// sends in batches): an announce sends them first, so its barrier
    /// comes after them.
    pending: Vec<RouteChange>,
}

/// Send `changes` to the shards, with the lock on `remote` held: events
/// from the watch, membership and announces reach every shard in the
/// order the table made them.
fn send_changes(shared: &Shared, remote: &Remote, changes: Vec<RouteChange>) {
    shared.status.stats.routes_remote.store(remote.table.applied() as u64, Ordering::Relaxed);
    if !changes.is_empty() {
        shared.broadcast(Event::Routes(changes.into()));
    }
}

/// `replica` (process `instance`) announced over the mesh that it wants
/// (`present`) or no longer wants `filter`, at `revision` of
/// `mqtt-routes`: merged into the table (see [`RouteTable`]), the changes
/// sent to every shard, and after them an [`Event::Applied`]; `done`
/// hears when every shard took it (the announce's answer waits for it).
/// An announce that changes nothing gets the barrier too: what the watch
/// sent before it may still be on its way to a shard.
pub(crate) fn announced(shared: &Shared, announce: Announce, done: oneshot::Sender<()>) {
    let Ok(mut remote) = shared.remote.lock() else { return };
    let key = route_key(&announce.replica, &announce.filter);
    let entry = RemoteEntry {
        revision: announce.revision,
        replica: announce.replica,
        instance: announce.instance,
        filter: announce.filter,
    };
    let mut changes = std::mem::take(&mut remote.pending);
    changes.extend(remote.table.announced(&key, entry, announce.present));
    send_changes(shared, &remote, changes);
    shared.broadcast(Event::Applied(crate::request::Applied::new(shared.mailboxes.len(), done)));
}

/// A route announce read from a mesh link (see [`announced`]).
#[derive(Debug, Clone)]
pub struct Announce {
    /// The announcing replica (the link's peer).
    pub replica: String,
    /// Its process (the member record's instance).
    pub instance: String,
    /// The filter.
    pub filter: String,
    /// The revision of its write in `mqtt-routes`.
    pub revision: u64,
    /// A put (wanted) or a delete.
    pub present: bool,
}

fn send_peers(shared: &Shared, remote: &Remote) {
    let peers: Arc<[Peer]> = remote.peers.values().cloned().collect();
    shared.broadcast(Event::Peers(peers));
}

/// `record` was read from `mqtt-members` (a live entry; leaving ones go
/// through [`member_out`]).
pub(crate) fn member_seen(shared: &Shared, record: &MemberRecord) {
    if record.replica == shared.config.replica_id || record.leaving {
        return;
    }
    let Ok(mut remote) = shared.remote.lock() else { return };
    let Some(id) = remote.numbers.number(&record.replica) else {
        if remote.unnumbered.insert(record.replica.clone()) {
            warn!(target: "cluster", peer = %record.replica, max = fleetmq_core::cluster::peers::PeerSet::MAX_PEERS,
                "cluster: more replicas than peer numbers: this one is ignored by the mesh");
        }
        return;
    };
    let peer = Peer {
        id,
        replica: record.replica.clone(),
        instance: record.instance.clone(),
        mesh: record.mesh.clone(),
        mesh_versions: record.mesh_versions.clone(),
    };
    if remote.peers.get(&record.replica) == Some(&peer) {
        return;
    }
    info!(target: "cluster", peer = %peer.replica, id = id.0, instance = %peer.instance, mesh = %peer.mesh, "cluster: peer");
    remote.peers.insert(record.replica.clone(), peer);
    send_peers(shared, &remote);
    let changes = remote.table.member_live(&record.replica, &record.instance, id);
    send_changes(shared, &remote, changes);
}

/// `replica` was taken for gone or stopped: no longer a peer, its routes
/// removed.
pub(crate) fn member_out(shared: &Shared, replica: &str) {
    let Ok(mut remote) = shared.remote.lock() else { return };
    if remote.peers.remove(replica).is_none() {
        return;
    }
    send_peers(shared, &remote);
    let changes = remote.table.member_out(replica);
    if !changes.is_empty() {
        info!(target: "cluster", peer = %replica, routes = changes.len(), "cluster: routes of a replica no longer live removed");
    }
    send_changes(shared, &remote, changes);
}

/// Watch `mqtt-routes` until the bridge stops: the other replicas'
/// entries, applied as their members allow, in batches.
pub(crate) async fn watch(shared: Arc<Shared>) {
    let me = shared.config.replica_id.clone();
    // Every flush after the snapshot (its last entry, or a quiet period
    // when the bucket is empty) finds routes_loaded set.
    let flush = |loaded: bool| {
        if let Ok(mut remote) = shared.remote.lock() {
            let pending = std::mem::take(&mut remote.pending);
            send_changes(&shared, &remote, pending);
        }
        if loaded && !shared.routes_loaded.swap(true, Ordering::AcqRel) {
            tracing::debug!(target: "cluster", "cluster: the other replicas' routes loaded");
        }
    };
    follow(&shared, bucket::ROUTES, Start::History, Some(Duration::from_millis(50)), |seen| {
        let entry = match seen {
            Seen::Quiet => return flush(true),
            Seen::Entry(entry) => entry,
        };
        let Some((replica, _)) = parse_route_key(&entry.key) else { return };
        if replica == me {
            return;
        }
        let Ok(mut remote) = shared.remote.lock() else { return };
        let record = match entry.operation {
            // The record's filter (a long filter's key holds its hash) must
            // make the key.
            Operation::Put => RouteRecord::decode(&entry.value)
                .ok()
                .filter(|r| r.replica == replica && is_route_key_of(&entry.key, &r.replica, &r.filter)),
            Operation::Delete | Operation::Purge => None,
        };
        let changes = match record {
            Some(r) => remote.table.put(
                &entry.key,
                RemoteEntry { revision: entry.revision, replica: r.replica, instance: r.instance, filter: r.filter },
            ),
            // A malformed entry counts as none.
            None => remote.table.delete(&entry.key, entry.revision),
        };
        remote.pending.extend(changes);
        let full = remote.pending.len() >= BATCH;
        drop(remote);
        if entry.delta == 0 || full {
            flush(entry.delta == 0);
        }
    })
    .await;
}

/// Purge this replica's entries by subject (one request): its leftovers
/// from an earlier process at start, its own at a clean stop. The peers
/// hear nothing of it (a purge by subject leaves no marker): they drop
/// the entries of a process that is not live anyway.
pub(crate) async fn purge_own(shared: &Shared) {
    let subject = replica_routes_subject(&shared.config.replica_id);
    let purged = async {
        let stream = shared.state.get_stream(format!("KV_{}", bucket::ROUTES)).await.map_err(|e| e.to_string())?;
        stream.purge().filter(subject.clone()).await.map_err(|e| e.to_string())
    };
    match tokio::time::timeout(Duration::from_secs(5), purged).await {
        Ok(Ok(r)) if r.purged > 0 => info!(target: "cluster", purged = r.purged, "cluster: routes of an earlier process purged"),
        Ok(Ok(_)) => {}
        Ok(Err(e)) => warn!(target: "cluster", error = %e, %subject, "cluster: own routes not purged"),
        Err(_) => warn!(target: "cluster", %subject, "cluster: own routes not purged within 5 s"),
    }
    shared.status.set_routes_purged();
}

/// The sweeper's part (DESIGN.md §4): delete every entry whose process is
/// taken for gone or stopped (or not live for 2 × `member_ttl`: one this
/// replica never saw live), each only if its revision is still the one
/// read.
pub(crate) async fn sweep(shared: &Shared) {
    let live = shared.live_instances();
    let ttl = shared.config.cluster.member_ttl;
    let now = Instant::now();
    let stale: Vec<(String, u64)> = {
        let Ok(mut remote) = shared.remote.lock() else { return };
        let not_live = remote.table.not_live();
        let seen: HashSet<&str> = not_live.iter().map(|(_, _, i)| i.as_str()).collect();
        remote.not_live_since.retain(|i, _| seen.contains(i.as_str()));
        not_live
            .into_iter()
            .filter(|(_, _, instance)| !live.contains_key(instance))
            .filter(|(_, _, instance)| {
                let since = *remote.not_live_since.entry(instance.clone()).or_insert(now);
                shared.gone_at(instance).is_some() || now.saturating_duration_since(since) >= 2 * ttl
            })
            .map(|(key, revision, _)| (key, revision))
            .collect()
    };
    if stale.is_empty() {
        return;
    }
    let deletes = futures_util::stream::iter(stale).map(|(key, revision)| async move {
        if !shared.decides_for_others() {
            return false;
        }
        // Gone after setup::DELETED_TTL: a filter subscribed once leaves
        // nothing in the bucket for good.
        let marker = crate::setup::delete_marker().expected_last_subject_sequence(revision);
        let outcome = match shared.state.send_publish(format!("$KV.{}.{key}", bucket::ROUTES), marker).await {
            Ok(ack) => ack.await,
            Err(e) => Err(e),
        };
        match outcome {
            Ok(_) => true,
            Err(e) => {
                // The bucket holds something else (purged by subject: no
                // marker came): forgotten here, not tried again each turn.
                if crate::ownership::is_conflict(&e) {
                    if let Ok(mut remote) = shared.remote.lock() {
                        let changes = remote.table.forget(&key, revision);
                        send_changes(shared, &remote, changes);
                    }
                }
                false
            }
        }
    });
    let swept = deletes.buffer_unordered(SWEEP_WINDOW).filter(|landed| std::future::ready(*landed)).count().await;
    if swept > 0 {
        info!(target: "cluster", swept, "cluster: swept the routes of replicas taken for gone");
    }
}

/// One key of this replica in `mqtt-routes`, as the writer sees it.
#[derive(Default)]
struct Key {
    /// A shard wants the filter.
    want: bool,
    /// The bucket holds the entry (a put landed last).
    landed: bool,
    /// A write of it is under way.
    busy: bool,
    /// The revision of the last write that landed.
    revision: u64,
    /// The shard that asked last (a delete is announced through it).
    shard: usize,
    /// SUBACKs waiting for the put.
    waiters: Vec<oneshot::Sender<Option<u64>>>,
}

/// This replica's routes: what its shards want, and the writes that make
/// `mqtt-routes` say so (bridge thread only).
pub(crate) struct Writer {
    shared: Arc<Shared>,
    local: LocalRoutes,
    keys: HashMap<String, Key>,
}

/// The writer, shared by the bridge's loop and its write tasks.
pub(crate) type Writers = Rc<RefCell<Writer>>;

impl Writer {
    /// No route wanted yet.
    pub(crate) fn new(shared: Arc<Shared>) -> Writers {
        Rc::new(RefCell::new(Writer { shared, local: LocalRoutes::new(), keys: HashMap::new() }))
    }
}

/// Shard `shard` wants `filter` (`add`) or no longer does; `landed` hears
/// the put's revision once the entry is in the bucket (at once when it
/// is), `None` when nobody wants it any more before it landed.
pub(crate) fn request(writers: &Writers, filter: String, shard: usize, add: bool, landed: Option<oneshot::Sender<Option<u64>>>) {
    let mut w = writers.borrow_mut();
    if shard >= fleetmq_core::route::ShardSet::MAX_SHARDS {
        return;
    }
    let changed = if add { w.local.add(&filter, shard) } else { w.local.remove(&filter, shard) };
    let wanted = w.local.len() as u64;
    w.shared.status.stats.routes_local.store(wanted, Ordering::Relaxed);
    let key = w.keys.entry(filter.clone()).or_default();
    key.shard = shard;
    if changed {
        key.want = add;
        if !add {
            for waiter in key.waiters.drain(..) {
                let _ = waiter.send(None);
            }
        }
    }
    if let Some(landed) = landed {
        if key.want && key.landed && !key.busy {
            let _ = landed.send(Some(key.revision));
        } else if key.want {
            // Those that stopped waiting (their 2 s are over) go.
            key.waiters.retain(|w| !w.is_closed());
            key.waiters.push(landed);
        } else {
            let _ = landed.send(None);
        }
    }
    let start = !key.busy && key.want != key.landed;
    if start {
        key.busy = true;
    } else if !key.busy && !key.want && !key.landed && key.waiters.is_empty() {
        w.keys.remove(&filter);
    }
    drop(w);
    if start {
        tokio::task::spawn_local(write_key(writers.clone(), filter));
    }
}

/// Say again what this replica wants of every key it knows: a put for
/// each wanted filter, a delete (with its marker, so peers hear of it) for
/// each other one. After a purge of this replica's entries (a duplicate's
/// wait is over) the bucket holds none of them; after a fence it may hold
/// any: the sweeper may have deleted them, and deletes of filters whose
/// subscribers the fence closed may have failed meanwhile (a fresh-user
/// pass saw such entries stay for good, and the mesh kept sending their
/// values).
pub(crate) fn rewrite(writers: &Writers) {
    let mut start = Vec::new();
    {
        let mut w = writers.borrow_mut();
        for (filter, key) in w.keys.iter_mut() {
            key.landed = !key.want;
            if !key.busy {
                key.busy = true;
                start.push(filter.clone());
            }
        }
    }
    for filter in start {
        tokio::task::spawn_local(write_key(writers.clone(), filter));
    }
}

/// Write `filter`'s entry until the bucket says what the shards want.
async fn write_key(writers: Writers, filter: String) {
    let mut backoff = FIRST_BACKOFF;
    loop {
        let (shared, want) = {
            let mut w = writers.borrow_mut();
            let shared = w.shared.clone();
            let Some(key) = w.keys.get_mut(&filter) else { return };
            if key.want == key.landed || shared.stopping.load(Ordering::Acquire) {
                key.busy = false;
                if !key.want && !key.landed && key.waiters.is_empty() {
                    w.keys.remove(&filter);
                }
                return;
            }
            (shared, key.want)
        };
        let started = Instant::now();
        let outcome = write(&shared, &filter, want).await;
        shared.status.stats.record(OpKind::Route, started.elapsed());
        match outcome {
            Ok(revision) => {
                backoff = FIRST_BACKOFF;
                let mut w = writers.borrow_mut();
                if let Some(key) = w.keys.get_mut(&filter) {
                    key.landed = want;
                    key.revision = revision;
                    if want && key.want {
                        for waiter in key.waiters.drain(..) {
                            let _ = waiter.send(Some(revision));
                        }
                    }
                    if !want && shared.config.shards > key.shard {
                        // Nobody waits for a delete: the shard that asked
                        // last announces it to the peers.
                        shared.send_event(key.shard, Event::RouteDeleted { filter: filter.clone(), revision });
                    }
                }
            }
            Err(e) => {
                debug!(target: "cluster", %filter, error = %e, "cluster: route not written, trying again");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
}

/// Put (`want`) or delete this replica's entry for `filter`: the write's
/// revision.
async fn write(shared: &Shared, filter: &str, want: bool) -> Result<u64, String> {
    let key = route_key(&shared.config.replica_id, filter);
    let subject = format!("$KV.{}.{key}", bucket::ROUTES);
    let publish = if want {
        let record = RouteRecord {
            format: shared.status.write_format(),
            replica: shared.config.replica_id.clone(),
            instance: shared.config.instance.clone(),
            filter: filter.to_owned(),
        };
        PublishMessage::build().payload(record.encode().into())
    } else {
        crate::setup::delete_marker()
    };
    let ack = shared.state.send_publish(subject, publish).await.map_err(|e| e.to_string())?;
    ack.await.map(|ack| ack.sequence).map_err(|e| e.to_string())
}
