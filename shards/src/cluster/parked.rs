//! Client identifier claims that outlive their connection (DESIGN.md §4,
//! §8): when the connection of a persistent session ends, its session
//! stays on this replica, and so does its entry in `mqtt-sessions`. The
//! claim is parked here instead of released at once, and released when
//! the session's expiry interval has passed since the connection ended.
//! A claim taken from another replica, a clean session's too, stays at
//! least `will_stop_grace` plus 2 × `member_ttl` (until a lost replica is
//! taken for gone, then its grace): a client that came here from a lost
//! replica and left again is still "back" for the sweeper, which would
//! otherwise send the lost replica's will for it (DESIGN.md §5).
//!
//! This saves a JetStream write (and a watch delivery on every replica)
//! per disconnect of a persistent session; a client that comes back here
//! claims over its own entry in one compare-and-set as before. Nothing
//! safety-related depends on the release: a claim anywhere takes any entry
//! over, take-over is decided by the claims' revisions, and a later claim
//! by another replica makes the parked one moot (its release would only
//! fail its compare-and-set). The will sweeper reads a parked entry as
//! "the client came back" when it is another process's (DESIGN.md §5),
//! which it is when the client reconnected elsewhere and left again.
//!
//! A session ended early (an MQTT 5 DISCONNECT setting Session Expiry 0,
//! a take-over with Clean Start) keeps its entry until the expiry it had
//! at the CONNECT: a stale hint, released then. The leader sweeps a
//! stopped or gone replica's entries, parked ones included.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use fleetmq_nats_bridge::Request;

use super::{shard_state, Node};

/// Claims parked per shard at most; beyond, a claim is released at once.
const PARKED_MAX: usize = 100_000;

/// How long a claim whose session never expires (MQTT 5 Session Expiry
/// 0xFFFFFFFF, when `limits.max_session_expiry` allows it) stays parked.
pub(super) const FOREVER: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

/// Release this shard's parked claims that are due (a full bridge queue
/// loses only the release: the entry stays until the next claim).
pub(super) fn release_due(node: &Node) {
    let due = shard_state(|sc| sc.parked.borrow_mut().take_due(Instant::now()));
    for (client_id, revision) in due {
        let _ = node.bridge.send_quietly(Request::Release {
            client_id,
            revision,
        });
    }
}

/// A shard's parked claims.
#[derive(Default)]
pub(crate) struct Parked {
    /// Client identifier → (claim revision, when it is released).
    by_id: HashMap<String, (u64, Instant)>,
    /// (when, claim revision) → client identifier, soonest first.
    due: BTreeMap<(Instant, u64), String>,
}

impl Parked {
    /// Park the claim on `client_id` at `revision` until `until`; `false`
    /// when full (release it now instead).
    pub(crate) fn park(&mut self, client_id: &str, revision: u64, until: Instant) -> bool {
        if let Some((old, _)) = self.by_id.get(client_id) {
            if *old > revision {
                // A newer claim of this client identifier is parked.
                return true;
            }
        }
        self.remove(client_id);
        if self.by_id.len() >= PARKED_MAX {
            return false;
        }
        self.by_id.insert(client_id.to_owned(), (revision, until));
        self.due.insert((until, revision), client_id.to_owned());
        true
    }

    /// A newer claim of `client_id` (here or on another replica) makes
    /// its parked one moot: forget it without a release.
    pub(crate) fn remove(&mut self, client_id: &str) {
        if let Some((revision, until)) = self.by_id.remove(client_id) {
            self.due.remove(&(until, revision));
        }
    }

    /// Take the claims due by `now`: (client identifier, revision).
    pub(crate) fn take_due(&mut self, now: Instant) -> Vec<(String, u64)> {
        let mut out = Vec::new();
        while let Some(entry) = self.due.first_entry() {
            if entry.key().0 > now {
                break;
            }
            let ((_, revision), client_id) = entry.remove_entry();
            self.by_id.remove(&client_id);
            out.push((client_id, revision));
        }
        out
    }

    /// Claims parked now.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.by_id.len()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_parked_claim_is_released_once_its_session_expiry_passed() {
        let now = Instant::now();
        let mut parked = Parked::default();
        assert!(parked.park("a", 5, now + Duration::from_secs(10)));
        assert!(parked.park("b", 6, now + Duration::from_secs(5)));
        assert!(parked.take_due(now).is_empty());
        assert_eq!(
            parked.take_due(now + Duration::from_secs(6)),
            vec![("b".to_owned(), 6)]
        );
        assert_eq!(
            parked.take_due(now + Duration::from_secs(60)),
            vec![("a".to_owned(), 5)]
        );
        assert_eq!(parked.len(), 0);
    }

    #[test]
    fn a_newer_claim_makes_the_parked_one_moot() {
        let now = Instant::now();
        let mut parked = Parked::default();
        assert!(parked.park("a", 5, now));
        parked.remove("a");
        assert!(parked.take_due(now).is_empty());
        // An older claim parked after a newer one does not replace it.
        assert!(parked.park("a", 9, now));
        assert!(parked.park("a", 7, now));
        assert_eq!(parked.take_due(now), vec![("a".to_owned(), 9)]);
    }
}
