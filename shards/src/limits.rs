//! Connection limits enforced before and after authentication (DESIGN.md
//! §9): pending connections, concurrent credential checks, connections per
//! source address and per credential. Each admitted connection holds
//! guards that give the slot back when dropped, on whichever shard the
//! connection ends.

use std::collections::HashMap;
use std::net::IpAddr;
use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tracing::warn;

use crate::pending::PendingSet;
use crate::signin::SignInQueue;

/// How often a refusal reason is logged at most (the count in between is
/// reported with it).
const LOG_INTERVAL: Duration = Duration::from_secs(10);

/// Process-wide counters behind the limits.
pub(crate) struct Gate {
    max_pending: usize,
    max_authenticating: usize,
    max_per_source: Option<usize>,
    max_per_credential: usize,
    pending: AtomicUsize,
    /// See [`Gate::unread_pending`].
    unread: AtomicUsize,
    authenticating: AtomicUsize,
    per_source: Mutex<HashMap<IpAddr, usize>>,
    per_credential: Mutex<HashMap<String, usize>>,
    refusals: Mutex<HashMap<&'static str, (Instant, u64)>>,
}

/// A shard's own side of the limits: its pending connections, which give
/// way to newcomers at `max_pending_connections` (`crate::pending`), and
/// its queue of credential checks (`crate::signin`).
pub(crate) struct ShardGate {
    pub(crate) pending: Rc<PendingSet>,
    pub(crate) sign_in: Rc<SignInQueue>,
}

impl ShardGate {
    /// An empty one for a shard, of `shards`, whose connections have
    /// `connect_timeout` to send their CONNECT.
    pub(crate) fn new(connect_timeout: Duration, shards: usize) -> Rc<ShardGate> {
        Rc::new(ShardGate {
            pending: Rc::new(PendingSet::new(connect_timeout, shards)),
            sign_in: Rc::new(SignInQueue::default()),
        })
    }
}

/// A counted slot; dropping it gives the slot back.
pub(crate) struct Slot {
    gate: Arc<Gate>,
    kind: SlotKind,
}

enum SlotKind {
    Pending,
    Authenticating,
    Source(IpAddr),
    Credential(String),
}

impl Drop for Slot {
    fn drop(&mut self) {
        let gate = &self.gate;
        match &self.kind {
            SlotKind::Pending => {
                gate.pending.fetch_sub(1, Ordering::Relaxed);
            }
            SlotKind::Authenticating => {
                gate.authenticating.fetch_sub(1, Ordering::Relaxed);
            }
            SlotKind::Source(ip) => release(&gate.per_source, ip),
            SlotKind::Credential(user) => release(&gate.per_credential, user),
        }
    }
}

fn release<K: std::hash::Hash + Eq>(map: &Mutex<HashMap<K, usize>>, key: &K) {
    let mut map = map.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(n) = map.get_mut(key) {
        *n -= 1;
        if *n == 0 {
            map.remove(key);
        }
    }
}

fn take<K: std::hash::Hash + Eq>(map: &Mutex<HashMap<K, usize>>, key: K, max: usize) -> bool {
    let mut map = map.lock().unwrap_or_else(|e| e.into_inner());
    let n = map.entry(key).or_insert(0);
    if *n >= max {
        return false;
    }
    *n += 1;
    true
}

impl Gate {
    /// Limits from the settings; `max_per_source` is `None` unless client
    /// addresses are trusted (`limits.trust_client_addresses`).
    pub(crate) fn new(max_pending: usize, max_authenticating: usize, max_per_source: Option<usize>, max_per_credential: usize) -> Arc<Gate> {
        Arc::new(Gate {
            max_pending,
            max_authenticating,
            max_per_source,
            max_per_credential,
            pending: AtomicUsize::new(0),
            unread: AtomicUsize::new(0),
            authenticating: AtomicUsize::new(0),
            per_source: Mutex::new(HashMap::new()),
            per_credential: Mutex::new(HashMap::new()),
            refusals: Mutex::new(HashMap::new()),
        })
    }

    fn counter(self: &Arc<Gate>, counter: &AtomicUsize, max: usize, kind: SlotKind) -> Option<Slot> {
        if counter.fetch_add(1, Ordering::Relaxed) >= max {
            counter.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        Some(Slot { gate: self.clone(), kind })
    }

    /// `max_pending_connections`.
    pub(crate) fn max_pending(&self) -> usize {
        self.max_pending
    }

    /// Pending connections, on any shard, whose bytes were found waiting
    /// unread at an eviction and whose task has not read since
    /// (`crate::pending`): while there are some, a shard is behind.
    pub(crate) fn unread_pending(&self) -> usize {
        self.unread.load(Ordering::Relaxed)
    }

    /// One more (`true`) or one fewer connection waiting unread.
    pub(crate) fn unread_changed(&self, more: bool) {
        if more {
            self.unread.fetch_add(1, Ordering::Relaxed);
        } else {
            self.unread.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// A connection between accept and CONNACK (`max_pending_connections`).
    pub(crate) fn pending(self: &Arc<Gate>) -> Option<Slot> {
        self.counter(&self.pending, self.max_pending, SlotKind::Pending)
    }

    /// A credential check under way (`max_connects_authenticating`).
    pub(crate) fn authenticating(self: &Arc<Gate>) -> Option<Slot> {
        self.counter(&self.authenticating, self.max_authenticating, SlotKind::Authenticating)
    }

    /// A connection from `ip` (`max_connections_per_source`); always
    /// granted, uncounted, when client addresses are not trusted.
    pub(crate) fn source(self: &Arc<Gate>, ip: IpAddr) -> Result<Option<Slot>, ()> {
        let Some(max) = self.max_per_source else { return Ok(None) };
        if take(&self.per_source, ip, max) {
            Ok(Some(Slot { gate: self.clone(), kind: SlotKind::Source(ip) }))
        } else {
            Err(())
        }
    }

    /// A connection signed in as `user` (`max_connections_per_credential`).
    pub(crate) fn credential(self: &Arc<Gate>, user: &str) -> Option<Slot> {
        take(&self.per_credential, user.to_owned(), self.max_per_credential)
            .then(|| Slot { gate: self.clone(), kind: SlotKind::Credential(user.to_owned()) })
    }

    /// Log a refusal for `reason`: the first of a burst at once, the rest
    /// as one count per reason at most every 10 s (see
    /// [`Gate::log_pending_refusals`]).
    pub(crate) fn log_refusal(&self, reason: &'static str) {
        self.refused(reason, Instant::now()).into_iter().for_each(log_refused);
    }

    /// Log the refusals counted but not yet logged: those whose reason was
    /// last logged at least 10 s ago, or all of them when `stopping`.
    /// Called from a shard's tick, so a burst's count is logged even when
    /// no refusal follows it.
    pub(crate) fn log_pending_refusals(&self, stopping: bool) {
        self.pending_refusals(Instant::now(), stopping).into_iter().for_each(log_refused);
    }

    /// Count a refusal for `reason` at `now`; returns (reason, count) to
    /// log now, if its last line is at least [`LOG_INTERVAL`] old.
    fn refused(&self, reason: &'static str, now: Instant) -> Option<(&'static str, u64)> {
        let mut refusals = self.refusals.lock().unwrap_or_else(|e| e.into_inner());
        let entry = refusals.entry(reason).or_insert((now - LOG_INTERVAL, 0));
        entry.1 += 1;
        due(reason, entry, now, false)
    }

    /// The (reason, count) pairs counted but not logged, due at `now` (all
    /// of them when `all`).
    fn pending_refusals(&self, now: Instant, all: bool) -> Vec<(&'static str, u64)> {
        let mut refusals = self.refusals.lock().unwrap_or_else(|e| e.into_inner());
        refusals
            .iter_mut()
            .filter_map(|(reason, entry)| due(reason, entry, now, all))
            .collect()
    }
}

/// The one log line for `count` refusals for `reason`.
fn log_refused((reason, count): (&'static str, u64)) {
    warn!(target: "broker", reason, count, "connections refused");
}

/// `entry` is (last logged, counted since): when it has a count and its
/// last line is at least [`LOG_INTERVAL`] old (or `always`), it restarts at
/// `now` and its count is returned to be logged.
fn due(
    reason: &'static str,
    entry: &mut (Instant, u64),
    now: Instant,
    always: bool,
) -> Option<(&'static str, u64)> {
    if entry.1 == 0 || !(always || now.duration_since(entry.0) >= LOG_INTERVAL) {
        return None;
    }
    let count = std::mem::take(&mut entry.1);
    entry.0 = now;
    Some((reason, count))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_given_back_when_dropped() {
        let gate = Gate::new(1, 1, Some(1), 1);
        let pending = gate.pending().expect("first");
        assert!(gate.pending().is_none(), "second is over the limit");
        drop(pending);
        assert!(gate.pending().is_some());
        let ip: IpAddr = "10.0.0.1".parse().unwrap();
        let source = gate.source(ip).unwrap();
        assert!(gate.source(ip).is_err());
        assert!(gate.source("10.0.0.2".parse().unwrap()).is_ok(), "per address");
        drop(source);
        assert!(gate.source(ip).is_ok());
        let alice = gate.credential("alice").unwrap();
        assert!(gate.credential("alice").is_none());
        drop(alice);
        assert!(gate.credential("alice").is_some());
    }

    /// A burst is logged as its first refusal at once and the rest as
    /// one count when 10 s have passed, even with no refusal after it, or
    /// at shutdown; nothing is logged twice.
    #[test]
    fn a_burst_of_refusals_is_logged_in_full_without_a_later_refusal() {
        let gate = Gate::new(1, 1, None, 1);
        let t0 = Instant::now();
        assert_eq!(gate.refused("pending", t0), Some(("pending", 1)));
        for _ in 0..1_300 {
            assert_eq!(gate.refused("pending", t0), None);
        }
        assert_eq!(gate.refused("per_source", t0), Some(("per_source", 1)));
        assert!(gate.pending_refusals(t0 + Duration::from_secs(9), false).is_empty());
        assert_eq!(
            gate.pending_refusals(t0 + LOG_INTERVAL, false),
            [("pending", 1_300)],
            "the rest of the burst, once the interval has passed"
        );
        assert!(gate.pending_refusals(t0 + 3 * LOG_INTERVAL, false).is_empty(), "logged once");
        let t1 = t0 + 3 * LOG_INTERVAL;
        assert_eq!(gate.refused("pending", t1), Some(("pending", 1)));
        assert_eq!(gate.refused("pending", t1), None);
        assert_eq!(gate.pending_refusals(t1, true), [("pending", 1)], "at shutdown");
        assert!(gate.pending_refusals(t1, true).is_empty());
    }

    #[test]
    fn sources_are_not_counted_unless_trusted() {
        let gate = Gate::new(1, 1, None, 1);
        let ip: IpAddr = "10.0.0.1".parse().unwrap();
        for _ in 0..10 {
            assert!(matches!(gate.source(ip), Ok(None)));
        }
    }
}
