//! A shard's links to the other replicas: per peer, the values this
//! shard's publishers sent it, numbered and kept until acknowledged
//! ([`super::queue::Queue`]), and the task that dials the peer and sends them
//! ([`run_link`]).

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use bytestring::ByteString;
use fleetmq_core::cluster::peers::{Peer, PeerId, PeerSet};
use fleetmq_core::shared::Strategy;
use fleetmq_core::mesh::{self, Frame};
use fleetmq_core::session::Message;
use futures_lite::future::or;
use futures_lite::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use glommio::net::TcpStream;
use glommio::timer::sleep;
use rustls::pki_types::ServerName;
use tokio::sync::oneshot;
use tracing::{debug, info, warn};

use super::queue::{Groups, Queue};
use super::{Mesh, PeerStats, RefusedFor, KEEPALIVE_DEAD, KEEPALIVE_IDLE};
use crate::shard::Shard;
use crate::signal::Signal;

/// How long a dial may take (TCP connect, TLS handshake, Hello answer).
const DIAL_TIMEOUT: Duration = Duration::from_secs(5);

/// The first pause before a link is dialed again; it doubles up to
/// [`BACKOFF_MAX`] while dials fail.
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);

/// Whom a link dials.
#[derive(Clone)]
struct Target {
    replica: String,
    instance: String,
    addr: String,
    versions: Vec<u16>,
}

/// One link of this shard to one peer replica.
pub(crate) struct Outgoing {
    /// The peer's id in the live list.
    peer: PeerId,
    target: RefCell<Target>,
    /// Bumped when the peer restarted or moved (the connection is
    /// dropped and dialed again) or left.
    epoch: Cell<u64>,
    removed: Cell<bool>,
    queue: RefCell<Queue>,
    /// Wakes the link's task: values or announces to send, or its
    /// epoch changed.
    signal: Signal,
    stats: Arc<PeerStats>,
    /// The version agreed on the connection that is up; 0 while down.
    version: Cell<u16>,
    /// Route announces to write on the connection that is up (version
    /// 3), and those written whose answer is awaited, by number. A
    /// connection that ends drops both: its waiters hear nothing (a peer
    /// whose link is down is not waited for).
    announces: RefCell<Vec<Frame>>,
    answers: RefCell<HashMap<u64, oneshot::Sender<()>>>,
    next_announce: Cell<u64>,
}

impl Outgoing {
    /// The connection ended (or never was): no announce waits on it.
    fn down(&self) {
        self.version.set(0);
        self.announces.borrow_mut().clear();
        self.answers.borrow_mut().clear();
    }
}

/// A shard's links to the other replicas, by peer id. Empty (and a no-op
/// on the publish path) without a mesh.
#[derive(Default)]
pub(crate) struct ShardLinks {
    mesh: RefCell<Option<Arc<Mesh>>>,
    links: RefCell<Vec<Option<Rc<Outgoing>>>>,
    /// The round robin of each shared group over replicas (one turn
    /// per group: a turn shared by two groups matching one topic gave
    /// the second the same replica every time).
    turns: RefCell<HashMap<ByteString, u64>>,
}

impl ShardLinks {
    /// Whether any link exists (the publish path asks first).
    pub(crate) fn active(&self) -> bool {
        self.mesh.borrow().is_some()
    }

    /// Send `message` to `peer` if this shard links to it (a peer not
    /// linked is not in the live list: nothing to keep for it), for its
    /// plain subscriptions (`plain`: it has one matching) and the shared
    /// subscription `groups` it was picked for.
    pub(crate) fn forward(&self, peer: PeerId, message: &Arc<Message>, groups: Groups, plain: bool) {
        let links = self.links.borrow();
        let Some(mesh) = &*self.mesh.borrow() else { return };
        let Some(Some(link)) = links.get(peer.index()) else { return };
        let mut queue = link.queue.borrow_mut();
        let before = queue.bytes;
        let dropped = queue.push(message.clone(), groups, plain);
        let after = queue.bytes;
        drop(queue);
        link.stats.buffer_bytes.fetch_add(after as i64 - before as i64, Ordering::Relaxed);
        if dropped > 0 {
            link.stats.lost.fetch_add(dropped, Ordering::Relaxed);
            mesh.stats.lost.fetch_add(dropped, Ordering::Relaxed);
        }
        link.signal.notify();
    }

    /// The replica a shared subscription group gets a value at, among
    /// this one (`local`: it has members of the group) and the linked
    /// replicas of `peers`: `None` for this one (or none at all).
    /// `strategy` as `shared.strategy`: `local_first` keeps it here when
    /// it can; `hash_client_id` picks by the publisher (`origin`), so one
    /// publisher's values keep their order at one replica; `random`;
    /// `round_robin` and `sticky` take the replicas in turn (a sticky
    /// member is chosen inside the replica), each group its own turn.
    ///
    /// Only peers whose link from this shard is up take part while one
    /// of them (or this replica) has members: a peer whose link is down
    /// (cut, or its process killed: its socket closes at once, long
    /// before it is taken for gone) would keep every other value in its
    /// buffer, lost if it died, while a member elsewhere was free [MQTT
    /// 5 §4.8.2: another member SHOULD get it]. With no member reachable,
    /// the down peers are picked as before: the buffer keeps the values
    /// for the heal.
    pub(crate) fn pick(&self, group: &ByteString, strategy: Strategy, local: bool, peers: PeerSet, origin: u64) -> Option<PeerId> {
        let links = self.links.borrow();
        let linked: Vec<(PeerId, bool)> = peers
            .iter()
            .filter_map(|p| match links.get(p.index()) {
                Some(Some(link)) => Some((p, link.version.get() != 0)),
                _ => None,
            })
            .collect();
        let up = linked.iter().filter(|(_, up)| *up).count();
        let candidates: Vec<PeerId> = linked.iter().filter(|(_, is_up)| *is_up || (up == 0 && !local)).map(|(p, _)| *p).collect();
        if candidates.is_empty() || (local && strategy == Strategy::LocalFirst) {
            return None;
        }
        let n = (candidates.len() + usize::from(local)) as u64;
        let at = match strategy {
            Strategy::HashClientId => origin % n,
            Strategy::Random => rand::random::<u64>() % n,
            _ => {
                let mut turns = self.turns.borrow_mut();
                let turn = match turns.get_mut(group) {
                    Some(turn) => turn,
                    None => turns.entry(group.clone()).or_default(),
                };
                *turn = turn.wrapping_add(1);
                (*turn - 1) % n
            }
        } as usize;
        match (local, at) {
            (true, 0) => None,
            (true, at) => Some(candidates[at - 1]),
            (false, at) => Some(candidates[at]),
        }
    }

    /// The peers of `peers` a value can be sent to for a shared group
    /// only: those whose link from this shard is up in a version that
    /// says so ([`mesh::GROUPS_ONLY_VERSION`]); an older one would hand it
    /// to its plain subscribers as well.
    pub(crate) fn groups_only(&self, peers: PeerSet) -> PeerSet {
        let links = self.links.borrow();
        let mut able = PeerSet::new();
        for p in peers.iter() {
            if matches!(links.get(p.index()), Some(Some(link)) if link.version.get() >= mesh::GROUPS_ONLY_VERSION) {
                able.insert(p);
            }
        }
        able
    }

    /// Whether the link from this shard to some peer of `peers` is up.
    pub(crate) fn any_up(&self, peers: PeerSet) -> bool {
        let links = self.links.borrow();
        peers.iter().any(|p| matches!(links.get(p.index()), Some(Some(link)) if link.version.get() != 0))
    }

    /// Announce to every peer linked with version 3 or later now that
    /// this replica (process `instance`) wants (`present`) or no longer
    /// wants `filter`, as its write at `revision` of `mqtt-routes` says;
    /// one answer to await per peer, heard once the peer applied it on
    /// all of its shards (dropped unheard if the link goes down first).
    /// Peers whose link is down or older are not told: the watch tells
    /// them.
    pub(crate) fn announce(&self, instance: &str, filter: &str, revision: u64, present: bool) -> Vec<oneshot::Receiver<()>> {
        let links = self.links.borrow();
        let mut answers = Vec::new();
        for link in links.iter().flatten() {
            if link.version.get() < mesh::ANNOUNCE_VERSION {
                continue;
            }
            let id = link.next_announce.get() + 1;
            link.next_announce.set(id);
            let (tx, rx) = oneshot::channel();
            link.answers.borrow_mut().insert(id, tx);
            link.announces.borrow_mut().push(Frame::Route {
                id,
                revision,
                present,
                instance: instance.to_owned(),
                filter: filter.to_owned(),
            });
            link.signal.notify();
            answers.push(rx);
        }
        answers
    }

    /// The live peers changed: link to new ones, drop links to those
    /// gone, dial again those that restarted or moved.
    pub(crate) fn set_peers(&self, shard: &Rc<Shard>, mesh: &Arc<Mesh>, peers: &[Peer]) {
        *self.mesh.borrow_mut() = Some(mesh.clone());
        // Readiness: the peers to link to (every shard says the same).
        let linkable = peers.iter().filter(|p| {
            p.id.index() < PeerSet::MAX_PEERS
                && p.replica != mesh.replica
                && !p.mesh.is_empty()
                && mesh::choose_version(super::spoken(), &p.mesh_versions).is_some()
        });
        mesh.expect(linkable.map(|p| p.replica.clone()), Instant::now());
        let mut links = self.links.borrow_mut();
        let mut live = PeerSet::new();
        for peer in peers {
            if peer.id.index() >= PeerSet::MAX_PEERS || peer.replica == mesh.replica {
                continue;
            }
            if peer.mesh.is_empty() {
                if mesh.first_time(format!("no mesh {} {}", peer.replica, peer.instance)) {
                    warn!(target: "mesh", peer = %peer.replica, "mesh: no link: the peer runs without a mesh (no mesh certificates)");
                }
                continue;
            }
            live.insert(peer.id);
            let target = Target {
                replica: peer.replica.clone(),
                instance: peer.instance.clone(),
                addr: peer.mesh.clone(),
                versions: peer.mesh_versions.clone(),
            };
            if links.len() <= peer.id.index() {
                links.resize(peer.id.index() + 1, None);
            }
            match &links[peer.id.index()] {
                Some(link) => {
                    let mut current = link.target.borrow_mut();
                    if current.instance != target.instance || current.addr != target.addr {
                        *current = target;
                        link.epoch.set(link.epoch.get() + 1);
                        link.signal.notify();
                    }
                }
                None => {
                    let link = Rc::new(Outgoing {
                        peer: peer.id,
                        stats: mesh.stats.peer(&target.replica),
                        target: RefCell::new(target),
                        epoch: Cell::new(0),
                        removed: Cell::new(false),
                        queue: RefCell::new(Queue::new(mesh.buffer_per_link)),
                        signal: Signal::default(),
                        version: Cell::new(0),
                        announces: RefCell::new(Vec::new()),
                        answers: RefCell::new(HashMap::new()),
                        next_announce: Cell::new(0),
                    });
                    links[peer.id.index()] = Some(link.clone());
                    glommio::spawn_local(run_link(shard.clone(), mesh.clone(), link)).detach();
                }
            }
        }
        for (i, slot) in links.iter_mut().enumerate() {
            if slot.is_some() && !live.contains(PeerId(i as u16)) {
                let link = slot.take().expect("checked");
                link.removed.set(true);
                link.epoch.set(link.epoch.get() + 1);
                link.signal.notify();
            }
        }
    }

    /// The shard stops: every link ends.
    pub(crate) fn stop(&self) {
        for link in self.links.borrow_mut().drain(..).flatten() {
            link.removed.set(true);
            link.signal.notify();
        }
    }
}

/// Dial `link`'s peer and send its values until the link is removed or
/// the shard stops, dialing again with a backoff after each failure.
async fn run_link(shard: Rc<Shard>, mesh: Arc<Mesh>, link: Rc<Outgoing>) {
    let mut backoff = BACKOFF_MIN;
    while !link.removed.get() && !shard.stopping.get() {
        let epoch = link.epoch.get();
        let replica = link.target.borrow().replica.clone();
        match connect_and_send(&shard, &mesh, &link, epoch).await {
            Ok(()) => backoff = BACKOFF_MIN,
            Err(Failed { why, up_since }) => {
                if let Some(since) = up_since {
                    // Dialed again at once after a link that lived; one
                    // that breaks right after its handshake backs off
                    // (and logs a line pair per backoff, not per 100 ms).
                    if since.elapsed() >= BACKOFF_MAX {
                        backoff = BACKOFF_MIN;
                    }
                    info!(target: "mesh", peer = %replica, shard = shard.id, "mesh: link down: {why}");
                } else {
                    debug!(target: "mesh", peer = %replica, shard = shard.id, "mesh: dial failed: {why}");
                }
            }
        }
        if link.removed.get() || shard.stopping.get() {
            break;
        }
        // Down (or not up yet): the values picked for a shared group go
        // to a member reachable now, at once and after each failed dial.
        if give_back_groups(&shard, &mesh, &link, false) {
            shard.flush_soon().await;
        }
        // Woken early when the peer restarted or moved (a new epoch).
        let _ = or(async { sleep(backoff).await }, async {
            while link.epoch.get() == epoch && !link.removed.get() {
                link.signal.wait().await;
            }
        })
        .await;
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
    // Gone: a shared group's values go to another member, even one
    // whose link is down (its buffer keeps them); the rest is no one's
    // any more: counted lost (a peer taken for gone, or this process
    // stopping, with values unacknowledged).
    let replica = link.target.borrow().replica.clone();
    if !shard.stopping.get() && give_back_groups(&shard, &mesh, &link, true) {
        shard.flush_soon().await;
    }
    let queue = std::mem::replace(&mut *link.queue.borrow_mut(), Queue::new(0));
    link.stats.buffer_bytes.fetch_sub(queue.bytes as i64, Ordering::Relaxed);
    let lost = queue.len() as u64;
    if lost > 0 {
        link.stats.lost.fetch_add(lost, Ordering::Relaxed);
        mesh.stats.lost.fetch_add(lost, Ordering::Relaxed);
        warn!(target: "mesh", peer = %replica, shard = shard.id, values = lost,
              "mesh: link removed with values its peer never acknowledged: dropped (fleetmq_mesh_values_lost_total)");
    }
}

/// The link is down (`gone`: removed for good): the values in its buffer
/// that its peer was picked for shared groups for go to another member
/// of each group ([`Shard::redispatch_groups`] says which, and why a
/// duplicate is possible); what no group keeps for the peer any more and
/// no plain subscription there wants becomes a gap in the numbering
/// ([`Queue::keep_groups`]). Returns whether a value went anywhere (the
/// shard's queues want a flush).
fn give_back_groups(shard: &Rc<Shard>, mesh: &Mesh, link: &Outgoing, gone: bool) -> bool {
    let picks = link.queue.borrow().group_picks();
    if picks.is_empty() {
        return false;
    }
    let values: Vec<_> = picks.iter().map(|(_, m, groups)| (m.clone(), groups.clone())).collect();
    let (left, moved, lost) = shard.redispatch_groups(link.peer, &values, gone);
    if moved == 0 && lost == 0 {
        return false;
    }
    let mut queue = link.queue.borrow_mut();
    let before = queue.bytes;
    for ((seq, _, groups), left) in picks.iter().zip(left) {
        if left.len() != groups.len() {
            queue.keep_groups(*seq, left);
        }
    }
    let after = queue.bytes;
    drop(queue);
    link.stats.buffer_bytes.fetch_sub(before as i64 - after as i64, Ordering::Relaxed);
    mesh.stats.redispatched.fetch_add(moved, Ordering::Relaxed);
    let replica = link.target.borrow().replica.clone();
    if lost > 0 {
        link.stats.lost.fetch_add(lost, Ordering::Relaxed);
        mesh.stats.lost.fetch_add(lost, Ordering::Relaxed);
        warn!(target: "mesh", peer = %replica, shard = shard.id, values = lost,
              "mesh: shared group values kept for a peer taken for gone, and no other member: dropped (fleetmq_mesh_values_lost_total)");
    }
    if moved > 0 {
        info!(target: "mesh", peer = %replica, shard = shard.id, values = moved,
              "mesh: link down: its shared group values went to other members (fleetmq_mesh_values_redispatched_total)");
    }
    true
}

/// Why a connection ended.
pub(crate) struct Failed {
    why: String,
    /// When it came up (its Hello was answered), if it did.
    up_since: Option<Instant>,
}

fn failed(why: impl std::fmt::Display) -> Failed {
    Failed { why: why.to_string(), up_since: None }
}

async fn within<T>(limit: Duration, f: impl std::future::Future<Output = Result<T, Failed>>) -> Result<T, Failed> {
    or(f, async {
        sleep(limit).await;
        Err(failed("timed out"))
    })
    .await
}

/// One connection of `link`: dial, Hello, then send values and read
/// acknowledgements until it breaks or `epoch` is over.
async fn connect_and_send(shard: &Rc<Shard>, mesh: &Arc<Mesh>, link: &Rc<Outgoing>, epoch: u64) -> Result<(), Failed> {
    let target = link.target.borrow().clone();
    if fleetmq_core::mesh::choose_version(super::spoken(), &target.versions).is_none() {
        if mesh.first_time(format!("version {} {}", target.replica, target.instance)) {
            warn!(target: "mesh", peer = %target.replica, versions = ?target.versions,
                  "mesh: no link: no mesh protocol version in common (this build speaks {:?})", super::spoken());
        }
        // Waits for the peer to change (an upgrade restarts it).
        while link.epoch.get() == epoch && !link.removed.get() {
            link.signal.wait().await;
        }
        return Ok(());
    }
    let (tls, accepted) = within(DIAL_TIMEOUT, dial(mesh, &target, shard.id)).await?;
    let (before, after) = {
        let mut queue = link.queue.borrow_mut();
        let before = queue.bytes;
        queue.restart(accepted.delivered);
        (before, queue.bytes)
    };
    link.stats.buffer_bytes.fetch_add(after as i64 - before as i64, Ordering::Relaxed);
    let _up = Up::new(mesh, link);
    let up_since = Some(Instant::now());
    // Every time: the first link to a peer, and each one back after a cut
    // (the matching "link down" names the cause).
    info!(target: "mesh", peer = %target.replica, shard = shard.id, version = accepted.version, "mesh: link up");
    let version = accepted.version;
    link.version.set(version);
    let keepalive = version >= mesh::KEEPALIVE_VERSION;
    let (reader, mut writer) = futures_lite::io::split(tls);
    let reading = read_acks(mesh, link, reader, keepalive, up_since);
    // The keepalive: a tick a second; one that finds nothing written
    // since the last asks the writer for an empty Values frame (no timer
    // per write or per wait on the path of the values).
    let (wrote, ping_due) = (Cell::new(true), Cell::new(false));
    let ticking = async {
        if !keepalive {
            return std::future::pending::<Result<(), Failed>>().await;
        }
        loop {
            sleep(KEEPALIVE_IDLE).await;
            if !wrote.replace(false) {
                ping_due.set(true);
                link.signal.notify();
            }
        }
    };
    let writing = async {
        let mut out = BytesMut::new();
        loop {
            if link.epoch.get() != epoch || link.removed.get() || shard.stopping.get() {
                return Ok(());
            }
            out.clear();
            for frame in link.announces.borrow_mut().drain(..) {
                mesh::encode(&frame, version, &mut out);
            }
            let n = link.queue.borrow_mut().next_frame(mesh.max_frame, version, Instant::now(), &mut out);
            let n = match n {
                Some(n) => n,
                None if !out.is_empty() => 0,
                None if ping_due.replace(false) => {
                    // Numbered after the last value sent; the acceptor
                    // answers it with an Ack.
                    let next = link.queue.borrow().sent + 1;
                    mesh::encode_values(next, version, std::iter::empty(), &mut out);
                    0
                }
                None => {
                    link.signal.wait().await;
                    continue;
                }
            };
            let broke = |e: std::io::Error| Failed { why: e.to_string(), up_since };
            writer.write_all(&out).await.map_err(broke)?;
            writer.flush().await.map_err(broke)?;
            wrote.set(true);
            mesh.stats.bytes_out.fetch_add(out.len() as u64, Ordering::Relaxed);
            mesh.stats.values_out.fetch_add(n as u64, Ordering::Relaxed);
        }
    };
    let ended = or(writing, or(reading, ticking)).await;
    link.down();
    ended
}

/// Counts a link up while it lives.
struct Up {
    mesh: Arc<Mesh>,
    stats: Arc<PeerStats>,
}

impl Up {
    fn new(mesh: &Arc<Mesh>, link: &Outgoing) -> Up {
        mesh.stats.links_up.fetch_add(1, Ordering::Relaxed);
        link.stats.link_up(mesh.shards);
        Up { mesh: mesh.clone(), stats: link.stats.clone() }
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        self.mesh.stats.links_up.fetch_sub(1, Ordering::Relaxed);
        self.stats.link_down(Instant::now());
    }
}

type ClientTls = futures_rustls::client::TlsStream<TcpStream>;

/// TCP, TLS and the Hello to `target`.
async fn dial(mesh: &Arc<Mesh>, target: &Target, shard: usize) -> Result<(ClientTls, mesh::Accepted), Failed> {
    let addr = resolve(&target.addr).await?;
    let tcp = TcpStream::connect(addr).await.map_err(|e| failed(format!("connect {addr}: {e}")))?;
    let _ = tcp.set_nodelay(true);
    let name = ServerName::try_from(target.replica.clone()).map_err(|e| failed(format!("server name: {e}")))?;
    let connector = futures_rustls::TlsConnector::from(mesh.tls.client.clone());
    let mut tls = match connector.connect(name, tcp).await {
        Ok(tls) => tls,
        Err(e) => {
            let Some(why) = super::tls::refused_for(&e) else { return Err(failed(format!("TLS: {e}"))) };
            mesh.stats.refused(why);
            if mesh.log_due(format!("tls {} {}", target.replica, why.as_str())) {
                let what = match why {
                    RefusedFor::Certificate => "a certificate not from cluster.mesh_ca, or not naming the peer",
                    _ => "the peer does not speak TLS 1.3 there",
                };
                warn!(target: "mesh", peer = %target.replica, %addr, error = %e, reason = why.as_str(), "mesh: refused: TLS handshake failed ({what})");
            }
            return Err(failed(format!("TLS: {e}")));
        }
    };
    let mut out = BytesMut::new();
    let hello = Frame::Hello {
        versions: super::spoken().to_vec(),
        replica: mesh.replica.clone(),
        instance: mesh.instance.clone(),
        link: shard as u32,
    };
    mesh::encode(&hello, mesh::FIRST_VERSION, &mut out);
    tls.write_all(&out).await.map_err(failed)?;
    tls.flush().await.map_err(failed)?;
    let mut buf = BytesMut::new();
    match read_frame(&mut tls, &mut buf, mesh.max_frame).await? {
        Frame::HelloAck(Ok(accepted)) => Ok((tls, accepted)),
        Frame::HelloAck(Err(refusal)) => {
            let why = match refusal {
                fleetmq_core::mesh::Refusal::NoCommonVersion => RefusedFor::Version,
                fleetmq_core::mesh::Refusal::NameMismatch => RefusedFor::Certificate,
                _ => RefusedFor::Name,
            };
            mesh.stats.refused(why);
            if mesh.log_due(format!("refused {} {}", target.replica, refusal.as_str())) {
                warn!(target: "mesh", peer = %target.replica, reason = refusal.as_str(), "mesh: the peer refused the link");
            }
            Err(failed(format!("refused: {}", refusal.as_str())))
        }
        _ => Err(failed("no answer to the Hello")),
    }
}

/// `addr` (`host:port`) as a socket address; a host name is resolved on
/// a blocking thread, not on the shard.
async fn resolve(addr: &str) -> Result<SocketAddr, Failed> {
    if let Ok(a) = addr.parse() {
        return Ok(a);
    }
    let name = addr.to_owned();
    glommio::executor()
        .spawn_blocking(move || name.to_socket_addrs().ok().and_then(|mut a| a.next()))
        .await
        .ok_or_else(|| failed(format!("cannot resolve {addr}")))
}

/// Read until one whole frame is in `buf`, and take it.
pub(crate) async fn read_frame(
    stream: &mut (impl AsyncRead + Unpin),
    buf: &mut BytesMut,
    max_frame: usize,
) -> Result<Frame, Failed> {
    loop {
        if let Some(frame) = mesh::decode(buf, max_frame).map_err(failed)? {
            return Ok(frame);
        }
        let mut chunk = [0u8; 8192];
        let n = stream.read(&mut chunk).await.map_err(failed)?;
        if n == 0 {
            return Err(failed("closed by the peer"));
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// Read the receiver's acknowledgements until the connection breaks or,
/// with the `keepalive` (version 2), none comes for [`KEEPALIVE_DEAD`].
async fn read_acks(
    mesh: &Arc<Mesh>,
    link: &Outgoing,
    mut reader: impl AsyncRead + Unpin,
    keepalive: bool,
    up_since: Option<Instant>,
) -> Result<(), Failed> {
    let mut buf = BytesMut::new();
    loop {
        let Some(read) = super::or_dead(keepalive, read_frame(&mut reader, &mut buf, mesh.max_frame)).await else {
            let why = format!("no answer for {} s (the peer stopped, froze or is unreachable)", KEEPALIVE_DEAD.as_secs());
            return Err(Failed { why, up_since });
        };
        let frame = read.map_err(|f| Failed { why: f.why, up_since })?;
        if let Frame::RouteAck { id } = frame {
            if let Some(answer) = link.answers.borrow_mut().remove(&id) {
                let _ = answer.send(());
            }
            continue;
        }
        if let Frame::Ack { delivered } = frame {
            let mut queue = link.queue.borrow_mut();
            let before = queue.bytes;
            let sent = queue.sent;
            queue.acked(delivered.min(sent));
            let after = queue.bytes;
            drop(queue);
            link.stats.buffer_bytes.fetch_sub(before as i64 - after as i64, Ordering::Relaxed);
        }
    }
}
