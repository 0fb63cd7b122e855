//! The open-loop send schedule: `rate` messages per second in total, shared
//! by `publishers` publishers, as a pure function of time.
//!
//! Message `g` (0-based, over all publishers) is due at
//! `g × 10^9 / rate` ns after the start, and belongs to publisher
//! `g mod publishers`. A publisher that falls behind sends every overdue
//! message at once, each stamped with its *scheduled* time, so latency
//! includes the queueing its lateness caused (no coordinated omission).
//! Because due counts derive from the clock alone, how late or how often a
//! publisher checks never changes which messages exist or their stamps.

/// One publisher's share of the schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Schedule {
    rate: u64,
    publishers: u64,
    index: u64,
}

impl Schedule {
    /// The schedule of publisher `index` of `publishers` at `rate` msg/s in
    /// total.
    ///
    /// # Panics
    /// When `rate` or `publishers` is 0 or `index >= publishers`.
    pub fn new(rate: u64, publishers: u64, index: u64) -> Schedule {
        assert!(rate > 0 && publishers > 0 && index < publishers);
        Schedule {
            rate,
            publishers,
            index,
        }
    }

    /// When this publisher's `k`-th message is due, ns after the start.
    pub fn due_at(&self, k: u64) -> u64 {
        let g = u128::from(k) * u128::from(self.publishers) + u128::from(self.index);
        (g * 1_000_000_000 / u128::from(self.rate)) as u64
    }

    /// How many of this publisher's messages are due at or before
    /// `elapsed_ns` after the start: messages `0..due_count` are due.
    pub fn due_count(&self, elapsed_ns: u64) -> u64 {
        // The last global index g with g × 10^9 / rate ≤ elapsed (floored
        // division) is ⌊((elapsed + 1) × rate − 1) / 10^9⌋.
        let last = ((u128::from(elapsed_ns) + 1) * u128::from(self.rate) - 1) / 1_000_000_000;
        let last = last as u64;
        if last < self.index {
            0
        } else {
            (last - self.index) / self.publishers + 1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn total_due(rate: u64, publishers: u64, elapsed_ns: u64) -> u64 {
        (0..publishers)
            .map(|i| Schedule::new(rate, publishers, i).due_count(elapsed_ns))
            .sum()
    }

    #[test]
    fn n_per_second_over_t_seconds_is_exactly_n_times_t() {
        for (rate, publishers) in [(20_000, 100), (1, 1), (7, 3), (999_983, 10), (3, 7)] {
            for secs in [1u64, 2, 5] {
                let end = secs * 1_000_000_000;
                // Messages due strictly before the end of the window.
                assert_eq!(
                    total_due(rate, publishers, end - 1),
                    rate * secs,
                    "rate {rate} × {publishers}"
                );
            }
        }
    }

    #[test]
    fn due_count_agrees_with_due_at() {
        let s = Schedule::new(7, 3, 2);
        for k in 0..50 {
            let t = s.due_at(k);
            assert_eq!(s.due_count(t), k + 1, "message {k} is due at its own time");
            if t > 0 {
                assert_eq!(s.due_count(t - 1), k, "and not a nanosecond before");
            }
        }
    }

    #[test]
    fn send_delays_change_neither_the_count_nor_the_stamps() {
        let s = Schedule::new(20_000, 10, 3);
        let end = 1_000_000_000u64;
        let mut stamps_on_time = Vec::new();
        for k in 0..s.due_count(end - 1) {
            stamps_on_time.push(s.due_at(k));
        }
        // A publisher that wakes at irregular, late moments and catches up.
        let mut sent = 0;
        let mut stamps_late = Vec::new();
        let mut now = 0u64;
        let mut step = 1u64;
        while now < end {
            let due = s.due_count(now);
            while sent < due {
                stamps_late.push(s.due_at(sent));
                sent += 1;
            }
            step = (step * 7919) % 3_000_001 + 1; // up to 3 ms late
            now += step;
        }
        let due = s.due_count(end - 1);
        while sent < due {
            stamps_late.push(s.due_at(sent));
            sent += 1;
        }
        assert_eq!(stamps_late, stamps_on_time);
        assert_eq!(stamps_on_time.len(), 2_000);
    }

    #[test]
    fn publishers_interleave_evenly() {
        let a = Schedule::new(1_000, 2, 0);
        let b = Schedule::new(1_000, 2, 1);
        assert_eq!(a.due_at(0), 0);
        assert_eq!(b.due_at(0), 1_000_000);
        assert_eq!(a.due_at(1), 2_000_000);
    }
}
