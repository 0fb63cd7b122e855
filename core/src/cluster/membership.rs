//! Membership and fencing, as a state machine with time as an input
//! (DESIGN.md §5).
//!
//! All timing derives from `member_ttl` = T:
//!
//! | step | rule | T = 10 s |
//! | --- | --- | --- |
//! | heartbeat | rewrite the own entry every T/10, without waiting for earlier writes | 1 s |
//! | self-fence | no write landed for 7T/6, counted from the *send* time of the last write that landed; or the own entry found missing: at once | 11.7 s |
//! | peer gone | its entry missing for T/2 more on the observer's clock | 15–17 s after its last write |
//! | decides for others | only while its own last landed write was sent less than T ago | 10 s |
//!
//! Plus the store probe on the state connection: fenced after
//! [`PROBE_SILENCE`] without an answer.
//!
//! The caller (the bridge) owns the clock and the NATS connections: it
//! asks [`Membership::heartbeat_due`], tells the machine when a write was
//! sent and when it landed, feeds it what the `mqtt-members` watch shows,
//! and reads the [`Change`]s that [`Membership::tick`] returns.

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// How long the state connection may stay without an answer to the store
/// probe before the replica fences (DESIGN.md §5: 15 s).
pub const PROBE_SILENCE: Duration = Duration::from_secs(15);

/// How often the store probe runs on the state connection (DESIGN.md §5).
pub const PROBE_INTERVAL: Duration = Duration::from_secs(2);

/// Why a replica is fenced: it closes its connections, refuses CONNECT
/// (0x88) and answers 503 on readiness (DESIGN.md §5, §12).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FenceReason {
    /// No membership write landed for 7T/6 (counted from the send time of
    /// the last one that did).
    LeaseLapsed,
    /// The own entry in `mqtt-members` was found missing (expired or
    /// deleted) after the last write that landed.
    OwnEntryMissing,
    /// The state connection answered no store probe for [`PROBE_SILENCE`].
    StoreSilent,
    /// Not started: no membership write has landed yet.
    Starting,
}

impl FenceReason {
    /// The reason as readiness and `/api/v1/status` show it.
    pub fn as_str(self) -> &'static str {
        match self {
            FenceReason::LeaseLapsed => "fenced: membership lease lapsed",
            FenceReason::OwnEntryMissing => "fenced: own membership entry missing",
            FenceReason::StoreSilent => "fenced: store unreachable",
            FenceReason::Starting => "starting: membership not established",
        }
    }
}

/// What changed in a [`Membership::tick`]: the caller acts on each.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Change {
    /// The replica is fenced from now on.
    Fenced(FenceReason),
    /// The replica serves again.
    Unfenced,
    /// A peer is taken for gone: its wills and ownership entries are the
    /// sweeper's to handle.
    PeerGone(String),
    /// A peer appeared (or came back).
    PeerJoined(String),
    /// A peer stopped cleanly: its last entry says it leaves. Its wills
    /// and ownership entries are the sweeper's to handle, as for a gone
    /// one, from now on.
    PeerLeft(String),
}

/// A peer as this replica's watch sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Peer {
    /// When the entry was found missing, on this replica's clock; `None`
    /// while it is present.
    missing_since: Option<Instant>,
    /// Taken for gone or left (reported once).
    gone: bool,
}

/// A write in flight: when it was sent.
type WriteId = u64;

/// The membership and fencing state of one replica.
#[derive(Debug)]
pub struct Membership {
    ttl: Duration,
    me: String,
    /// Send times of the writes in flight, by id.
    in_flight: HashMap<WriteId, Instant>,
    next_write: WriteId,
    /// The send time of the latest write that landed.
    last_landed_sent: Option<Instant>,
    /// The revision of the latest own write that landed.
    last_landed_revision: u64,
    /// When the last heartbeat was sent.
    last_sent: Option<Instant>,
    /// The own entry was seen missing after the last landed write.
    own_missing: bool,
    /// When the store probe last answered (or the machine started).
    last_probe_answer: Instant,
    /// The reason currently reported, `None` when serving.
    fenced: Option<FenceReason>,
    peers: HashMap<String, Peer>,
}

impl Membership {
    /// A replica named `me`, starting fenced ([`FenceReason::Starting`])
    /// at `now`, with `member_ttl` = `ttl` (DESIGN.md §10: 5 s – 2 min,
    /// checked by the settings).
    pub fn new(me: impl Into<String>, ttl: Duration, now: Instant) -> Membership {
        Membership {
            ttl,
            me: me.into(),
            in_flight: HashMap::new(),
            next_write: 0,
            last_landed_sent: None,
            last_landed_revision: 0,
            last_sent: None,
            own_missing: false,
            last_probe_answer: now,
            fenced: Some(FenceReason::Starting),
            peers: HashMap::new(),
        }
    }

    /// `member_ttl`.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// The heartbeat period, T/10.
    pub fn heartbeat_interval(&self) -> Duration {
        self.ttl / 10
    }

    /// How long after the send time of the last landed write the replica
    /// fences: 7T/6.
    pub fn fence_after(&self) -> Duration {
        self.ttl * 7 / 6
    }

    /// Whether a heartbeat should be sent at `now` (one per T/10, whether
    /// or not earlier ones have landed).
    pub fn heartbeat_due(&self, now: Instant) -> bool {
        self.last_sent
            .is_none_or(|at| now.saturating_duration_since(at) >= self.heartbeat_interval())
    }

    /// A heartbeat was sent at `now`; the id names it in
    /// [`Membership::landed`] or [`Membership::failed`].
    pub fn sent(&mut self, now: Instant) -> WriteId {
        let id = self.next_write;
        self.next_write += 1;
        self.in_flight.insert(id, now);
        self.last_sent = Some(now);
        id
    }

    /// Write `id` landed as `revision` of the own entry. A write that lands
    /// late still counts, from its own send time.
    pub fn landed(&mut self, id: WriteId, revision: u64) {
        let Some(sent) = self.in_flight.remove(&id) else { return };
        if self.last_landed_sent.is_none_or(|at| sent > at) {
            self.last_landed_sent = Some(sent);
        }
        if revision > self.last_landed_revision {
            self.last_landed_revision = revision;
            self.own_missing = false;
        }
    }

    /// Write `id` failed or timed out. (A timed-out write may still land:
    /// it is then not counted, which only fences earlier, never later.)
    pub fn failed(&mut self, id: WriteId) {
        self.in_flight.remove(&id);
    }

    /// The store probe on the state connection answered at `now`.
    pub fn probe_answered(&mut self, now: Instant) {
        if now > self.last_probe_answer {
            self.last_probe_answer = now;
        }
    }

    /// The watch shows the entry of `replica` present at `revision`.
    pub fn entry_present(&mut self, replica: &str, revision: u64, now: Instant) -> Option<Change> {
        if replica == self.me {
            if revision > self.last_landed_revision {
                // A write of ours whose ack has not arrived yet.
                self.last_landed_revision = revision;
                self.own_missing = false;
            }
            return None;
        }
        let _ = now;
        let peer = self.peers.entry(replica.to_owned()).or_insert(Peer { missing_since: None, gone: true });
        peer.missing_since = None;
        if std::mem::replace(&mut peer.gone, false) {
            return Some(Change::PeerJoined(replica.to_owned()));
        }
        None
    }

    /// The watch shows the last entry of `replica`, at `revision`: its
    /// process stops (a clean stop writes it, with a short TTL, after it
    /// closed its connections). Reported as [`Change::PeerLeft`] at once,
    /// rather than [`Change::PeerGone`] after the entry expired and T/2.
    /// (The entry is not deleted: in a bucket that keeps one value per key
    /// a delete right after it could replace it before a watcher read it.)
    pub fn entry_leaving(&mut self, replica: &str, revision: u64, now: Instant) -> Option<Change> {
        if replica == self.me {
            return None;
        }
        let _ = (revision, now);
        let peer = self.peers.entry(replica.to_owned()).or_insert(Peer { missing_since: None, gone: true });
        peer.missing_since = None;
        (!std::mem::replace(&mut peer.gone, true)).then(|| Change::PeerLeft(replica.to_owned()))
    }

    /// The watch shows the entry of `replica` gone (deleted, purged or
    /// expired) at `revision`.
    pub fn entry_missing(&mut self, replica: &str, revision: u64, now: Instant) {
        if replica == self.me {
            if revision > self.last_landed_revision {
                self.own_missing = true;
            }
            return;
        }
        if let Some(peer) = self.peers.get_mut(replica) {
            if peer.missing_since.is_none() {
                peer.missing_since = Some(now);
            }
        }
    }

    /// Whether this replica may decide for others (declare peers gone,
    /// send their wills, sweep their ownership entries): only while its
    /// own last landed write was sent less than T ago (DESIGN.md §5), and
    /// its own entry was not found missing since. A replica whose own
    /// entry may have expired cannot tell that the others still see it.
    pub fn decides_for_others(&self, now: Instant) -> bool {
        self.decides_until().is_some_and(|until| now < until)
    }

    /// Until when (exclusive) [`Membership::decides_for_others`] holds if
    /// no other write lands: the send time of the last landed write plus
    /// T; `None` when it does not hold at all (nothing landed, or the own
    /// entry found missing).
    pub fn decides_until(&self) -> Option<Instant> {
        if self.own_missing {
            return None;
        }
        self.last_landed_sent.map(|at| at + self.ttl)
    }

    /// Why the replica is fenced, `None` when it serves.
    pub fn fenced(&self) -> Option<FenceReason> {
        self.fenced
    }

    /// Peers currently present (not taken for gone), sorted.
    pub fn live_peers(&self) -> Vec<String> {
        let mut live: Vec<String> =
            self.peers.iter().filter(|(_, p)| !p.gone).map(|(id, _)| id.clone()).collect();
        live.sort();
        live
    }

    /// When [`Membership::tick`] should run next at the latest: the next
    /// heartbeat, fence or peer deadline.
    pub fn next_deadline(&self, now: Instant) -> Instant {
        let mut at = self.last_sent.map_or(now, |s| s + self.heartbeat_interval());
        if let Some(sent) = self.last_landed_sent {
            at = at.min(sent + self.fence_after());
        }
        at = at.min(self.last_probe_answer + PROBE_SILENCE);
        for peer in self.peers.values().filter(|p| !p.gone) {
            if let Some(since) = peer.missing_since {
                at = at.min(since + self.ttl / 2);
            }
        }
        if let Some(until) = self.decides_until().filter(|until| *until > now) {
            // It stops deciding then (peers whose T/2 ran out meanwhile are
            // declared once it decides again, at the write that lands).
            at = at.min(until);
        }
        at.max(now)
    }

    /// Re-evaluate at `now`: the fence and the peers.
    pub fn tick(&mut self, now: Instant) -> Vec<Change> {
        let mut changes = Vec::new();
        let reason = self.fence_reason(now);
        if reason != self.fenced {
            self.fenced = reason;
            changes.push(match reason {
                Some(r) => Change::Fenced(r),
                None => Change::Unfenced,
            });
        }
        let half = self.ttl / 2;
        let decides = self.decides_for_others(now);
        let mut gone: Vec<Change> = Vec::new();
        for (id, peer) in self.peers.iter_mut() {
            let Some(since) = peer.missing_since else { continue };
            if peer.gone {
                continue;
            }
            if decides && now.saturating_duration_since(since) >= half {
                // Only a replica whose own lease is current may take a
                // peer for gone: one cut off sees everyone's entry vanish.
                peer.gone = true;
                gone.push(Change::PeerGone(id.clone()));
            }
        }
        gone.sort_by(|a, b| peer_of(a).cmp(peer_of(b)));
        changes.extend(gone);
        changes
    }

    fn fence_reason(&self, now: Instant) -> Option<FenceReason> {
        let Some(sent) = self.last_landed_sent else {
            return Some(FenceReason::Starting);
        };
        if now.saturating_duration_since(self.last_probe_answer) >= PROBE_SILENCE {
            return Some(FenceReason::StoreSilent);
        }
        if self.own_missing {
            return Some(FenceReason::OwnEntryMissing);
        }
        if now.saturating_duration_since(sent) >= self.fence_after() {
            return Some(FenceReason::LeaseLapsed);
        }
        None
    }
}

/// The peer a [`Change::PeerGone`] or [`Change::PeerLeft`] names.
fn peer_of(change: &Change) -> &str {
    match change {
        Change::PeerGone(id) | Change::PeerLeft(id) | Change::PeerJoined(id) => id,
        Change::Fenced(_) | Change::Unfenced => "",
    }
}

#[cfg(test)]
mod tests;
