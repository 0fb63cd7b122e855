//! Releases yield to claims: the release of a client identifier whose
//! connection ended (a delete marker in `mqtt-sessions` expecting the
//! claim's revision) is held on the bridge while claims are in flight,
//! and started once none is, or once it has waited [`RELEASE_WAIT`].
//!
//! A claim is on a CONNECT's path to its CONNACK; a release is not on
//! anybody's path. In a storm of connections that come and go, every
//! release started at once competes with the claims for the NATS
//! servers' CPU (each is a replicated write and a watch delivery, like a
//! claim): held, the claims land first, and the releases follow when the
//! storm is over (perf/RESULTS.md, issue 23, wt-23c). The NATS work is the
//! same; only its order changes.
//!
//! Nothing safety-related waits on a release (see `shards/src/cluster/parked.rs`):
//! take-over is decided by the claims' revisions, and a held release whose
//! client identifier was claimed again meanwhile (here or elsewhere) only
//! fails its compare-and-set, as it would have a moment later. The entries
//! of ended clean sessions stay in the bucket at most [`RELEASE_WAIT`]
//! longer, and at most [`HELD_MAX`] of them.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// The longest a release is held while claims keep arriving.
pub(crate) const RELEASE_WAIT: Duration = Duration::from_secs(1);

/// Releases held at most; beyond, the oldest start at once.
pub(crate) const HELD_MAX: usize = 65_536;

/// A release waiting for the claims in flight: (client identifier, the
/// claim's revision), and since when.
#[derive(Debug, Default)]
pub(crate) struct HeldReleases {
    queue: VecDeque<(Instant, String, u64)>,
}

impl HeldReleases {
    /// Hold the release of `client_id`'s claim at `revision`, from `now`.
    pub(crate) fn hold(&mut self, client_id: String, revision: u64, now: Instant) {
        self.queue.push_back((now, client_id, revision));
    }

    /// Releases held now.
    pub(crate) fn len(&self) -> usize {
        self.queue.len()
    }

    /// Take the releases to start now, oldest first: every one when no
    /// claim is in flight (`claims_in_flight` 0) or `all` (the bridge
    /// stops), else those held [`RELEASE_WAIT`] or longer and the oldest
    /// beyond [`HELD_MAX`].
    pub(crate) fn due(
        &mut self,
        claims_in_flight: usize,
        all: bool,
        now: Instant,
    ) -> Vec<(String, u64)> {
        let mut out = Vec::new();
        let everything = all || claims_in_flight == 0;
        while let Some((since, _, _)) = self.queue.front() {
            let due = everything
                || self.queue.len() > HELD_MAX
                || now.saturating_duration_since(*since) >= RELEASE_WAIT;
            if !due {
                break;
            }
            let Some((_, client_id, revision)) = self.queue.pop_front() else {
                break;
            };
            out.push((client_id, revision));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn releases_wait_while_claims_are_in_flight_and_start_when_none_is() {
        let t0 = Instant::now();
        let mut held = HeldReleases::default();
        held.hold("a".into(), 3, t0);
        held.hold("b".into(), 4, t0 + Duration::from_millis(10));
        assert!(
            held.due(5, false, t0 + Duration::from_millis(20))
                .is_empty(),
            "claims in flight: held"
        );
        assert_eq!(held.len(), 2);
        assert_eq!(
            held.due(0, false, t0 + Duration::from_millis(30)),
            vec![("a".to_owned(), 3), ("b".to_owned(), 4)]
        );
        assert_eq!(held.len(), 0);
    }

    #[test]
    fn a_release_held_for_the_longest_wait_starts_even_while_claims_keep_coming() {
        let t0 = Instant::now();
        let mut held = HeldReleases::default();
        held.hold("a".into(), 3, t0);
        held.hold("b".into(), 4, t0 + Duration::from_millis(500));
        assert_eq!(
            held.due(7, false, t0 + RELEASE_WAIT),
            vec![("a".to_owned(), 3)]
        );
        assert_eq!(
            held.due(7, true, t0 + RELEASE_WAIT),
            vec![("b".to_owned(), 4)],
            "a stop starts every one"
        );
    }

    #[test]
    fn beyond_the_bound_the_oldest_start_at_once() {
        let t0 = Instant::now();
        let mut held = HeldReleases::default();
        for i in 0..=HELD_MAX as u64 {
            held.hold(format!("c{i}"), i, t0);
        }
        assert_eq!(held.due(1, false, t0), vec![("c0".to_owned(), 0)]);
        assert_eq!(held.len(), HELD_MAX);
    }
}
