//! When a publisher moves to the shard of its subscribers: the decision,
//! one PUBLISH at a time (DESIGN.md §3; the moving itself is in
//! fleetmq-shards, `shard::placement`). No I/O and no clock reads: the
//! caller passes the time.

use std::cell::Cell;
use std::time::{Duration, Instant};

/// PUBLISH packets over which a publisher's rate is judged.
pub const MOVE_AFTER: u16 = 64;

/// The shortest time [`MOVE_AFTER`] PUBLISH packets may take for their
/// publisher to move: 1,000 messages/s.
pub const MOVE_MIN_SPAN: Duration = Duration::from_millis(64);

/// What a connection's task tracks to decide whether its publisher moves:
/// the shard its messages went to, how many since it was last judged, and
/// since when. 24 bytes; kept in the connection's task, so a parked
/// connection does not hold it.
#[derive(Debug, Default)]
pub struct Mover {
    target: u8,
    count: u16,
    since: Option<Instant>,
}

impl Mover {
    /// Note where one PUBLISH went: `reach` has bit `s` set for each shard
    /// `s` it went to (this shard's own subscribers included), 0 for none.
    /// `here` is this shard. Returns the shard to move to once the last
    /// [`MOVE_AFTER`] went to it alone over at least [`MOVE_MIN_SPAN`];
    /// sets `unmovable` for good once one went anywhere else.
    pub fn note(&mut self, reach: u64, here: usize, now: Instant, unmovable: &Cell<bool>) -> Option<usize> {
        if reach == 0 || unmovable.get() {
            return None;
        }
        let to = reach.trailing_zeros() as usize;
        let first = self.since.is_none();
        if reach.count_ones() != 1 || to == here || (!first && usize::from(self.target) != to) {
            unmovable.set(true);
            return None;
        }
        if first {
            self.target = to as u8;
            self.since = Some(now);
        }
        self.count += 1;
        if self.count < MOVE_AFTER {
            return None;
        }
        let since = self.since.replace(now).expect("set above");
        self.count = 0;
        (now.duration_since(since) >= MOVE_MIN_SPAN).then_some(to)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed(mover: &mut Mover, unmovable: &Cell<bool>, reach: u64, n: u16, start: Instant, step: Duration) -> Option<usize> {
        let mut answer = None;
        for i in 0..n {
            answer = answer.or(mover.note(reach, 0, start + step * u32::from(i), unmovable));
        }
        answer
    }

    #[test]
    fn a_slow_publisher_to_one_other_shard_moves_after_64_messages() {
        let (mut mover, unmovable) = (Mover::default(), Cell::new(false));
        let t = Instant::now();
        assert_eq!(feed(&mut mover, &unmovable, 1 << 3, MOVE_AFTER - 1, t, Duration::from_millis(2)), None);
        assert_eq!(mover.note(1 << 3, 0, t + Duration::from_millis(200), &unmovable), Some(3));
        assert!(!unmovable.get());
    }

    #[test]
    fn a_fast_publisher_stays_until_it_slows_down() {
        let (mut mover, unmovable) = (Mover::default(), Cell::new(false));
        let t = Instant::now();
        // 64 in 6.3 ms: 10,000 messages/s.
        assert_eq!(feed(&mut mover, &unmovable, 1 << 1, MOVE_AFTER, t, Duration::from_micros(100)), None);
        assert!(!unmovable.get());
        // The next 64 at 500 messages/s.
        let later = t + Duration::from_millis(10);
        assert_eq!(feed(&mut mover, &unmovable, 1 << 1, MOVE_AFTER, later, Duration::from_millis(2)), Some(1));
    }

    #[test]
    fn a_publisher_that_reached_this_shard_or_two_shards_or_another_shard_never_moves() {
        let t = Instant::now();
        for first in [1 << 0, (1 << 1) | (1 << 2), 1 << 2] {
            let (mut mover, unmovable) = (Mover::default(), Cell::new(false));
            if first != 1 << 2 {
                mover.note(first, 0, t, &unmovable);
            } else {
                mover.note(1 << 1, 0, t, &unmovable);
                mover.note(first, 0, t, &unmovable);
            }
            assert!(unmovable.get(), "{first:b}");
            assert_eq!(feed(&mut mover, &unmovable, 1 << 1, 200, t, Duration::from_millis(5)), None);
        }
    }

    proptest::proptest! {
        /// Whatever the shards its messages reach and however fast: a
        /// publisher is sent only to the one shard every message it sent
        /// so far reached (never its own), only after MOVE_AFTER of them
        /// since it last was judged, and never once a message went
        /// anywhere else.
        #[test]
        fn moves_only_to_the_one_shard_every_message_went_to(
            steps in proptest::collection::vec((proptest::sample::select(vec![0u64, 1, 2, 4, 6, 8]), 0u64..5_000), 0..400),
        ) {
            let (mut mover, unmovable) = (Mover::default(), Cell::new(false));
            let mut now = Instant::now();
            let mut seen = 0u64;
            let mut since_judged = 0;
            for (reach, micros) in steps {
                now += Duration::from_micros(micros);
                seen |= reach;
                since_judged += u16::from(reach != 0);
                let answer = mover.note(reach, 0, now, &unmovable);
                let clean = seen.count_ones() <= 1 && seen & 1 == 0;
                proptest::prop_assert_eq!(unmovable.get(), !clean);
                if let Some(to) = answer {
                    proptest::prop_assert!(clean);
                    proptest::prop_assert_eq!(1u64 << to, seen);
                    proptest::prop_assert_eq!(since_judged, MOVE_AFTER);
                }
                if since_judged == MOVE_AFTER {
                    since_judged = 0;
                }
            }
        }
    }

    #[test]
    fn a_mover_is_24_bytes() {
        assert!(std::mem::size_of::<Mover>() <= 24, "{}", std::mem::size_of::<Mover>());
    }

    #[test]
    fn messages_nobody_subscribed_to_do_not_count() {
        let (mut mover, unmovable) = (Mover::default(), Cell::new(false));
        let t = Instant::now();
        assert_eq!(feed(&mut mover, &unmovable, 0, 500, t, Duration::from_millis(2)), None);
        assert!(!unmovable.get());
        assert_eq!(mover.count, 0);
    }
}
