//! The credential check budget per user name
//! (`limits.auth_check_rate_per_credential`): a token bucket per key that
//! bounds the checks that may fail, so a flood of wrong passwords costs at
//! most `rate` password hashes per second per user name.
//!
//! A check takes one share before it runs ([`Budget::take`]) and gives it
//! back when it succeeds ([`Budget::give_back`]): only failures spend the
//! budget. A bucket refills at `rate` shares per second up to `rate` (one
//! second's worth); a full bucket is the same as none, so only user names
//! that failed recently hold an entry. Like [`super::throttle::Throttle`],
//! it holds no lock and reads no clock.

use std::collections::HashMap;
use std::time::SystemTime;

use super::throttle::{drop_oldest, since};

/// Shares are counted in thousandths of a check, so refills need no
/// floating point.
const MILLI: u64 = 1000;

#[derive(Debug, Clone, Copy)]
struct Bucket {
    /// Thousandths of a check available at `at`.
    shares: u64,
    at: SystemTime,
}

/// Token buckets per key, at most `max_keys` of them.
#[derive(Debug)]
pub struct Budget {
    /// Checks per second, and the burst.
    rate: u64,
    max_keys: usize,
    buckets: HashMap<u64, Bucket>,
}

impl Budget {
    /// `rate` checks per second per key (at least 1) in bursts of `rate`,
    /// for at most `max_keys` keys (at least 1) with a spent share.
    pub fn new(rate: u32, max_keys: usize) -> Budget {
        Budget {
            rate: u64::from(rate.max(1)),
            max_keys: max_keys.max(1),
            buckets: HashMap::new(),
        }
    }

    fn full(&self) -> u64 {
        self.rate * MILLI
    }

    /// The bucket's shares at `now`, refilled since it was last touched.
    fn level(&self, bucket: &Bucket, now: SystemTime) -> u64 {
        let refill = since(now, bucket.at).as_millis() as u64 * self.rate;
        bucket.shares.saturating_add(refill).min(self.full())
    }

    /// Takes one check's share for `key` at `now`: `false` (and nothing
    /// taken) when the key has spent its budget.
    pub fn take(&mut self, key: u64, now: SystemTime) -> bool {
        let level = match self.buckets.get(&key) {
            Some(bucket) => self.level(bucket, now),
            None => self.full(),
        };
        if level < MILLI {
            return false;
        }
        if !self.buckets.contains_key(&key) && self.buckets.len() >= self.max_keys {
            self.make_room(now);
        }
        let shares = level - MILLI;
        self.buckets.insert(key, Bucket { shares, at: now });
        true
    }

    /// Gives back the share a successful check took for `key` at `now`.
    pub fn give_back(&mut self, key: u64, now: SystemTime) {
        let Some(bucket) = self.buckets.get(&key).copied() else {
            return;
        };
        let level = (self.level(&bucket, now) + MILLI).min(self.full());
        if level == self.full() {
            self.buckets.remove(&key);
        } else {
            self.buckets.insert(
                key,
                Bucket {
                    shares: level,
                    at: now,
                },
            );
        }
    }

    /// Keys holding a bucket that is not full (or not yet pruned).
    pub fn len(&self) -> usize {
        self.buckets.len()
    }

    /// Whether no key holds a bucket.
    pub fn is_empty(&self) -> bool {
        self.buckets.is_empty()
    }

    /// Drops the buckets that are full again at `now`; if that is not
    /// enough, the least recently used tenth of the bound (which hands
    /// those keys a full bucket early: at most one second's worth more).
    fn make_room(&mut self, now: SystemTime) {
        let full = self.full();
        let rate = self.rate;
        self.buckets.retain(|_, b| {
            let refill = since(now, b.at).as_millis() as u64 * rate;
            b.shares.saturating_add(refill) < full
        });
        drop_oldest(&mut self.buckets, self.max_keys, |b| b.at);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use proptest::prelude::*;

    use super::*;

    fn at_ms(ms: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000) + Duration::from_millis(ms)
    }

    #[test]
    fn a_burst_of_rate_checks_passes_then_one_per_refill() {
        let mut b = Budget::new(4, 100);
        for _ in 0..4 {
            assert!(b.take(7, at_ms(0)));
        }
        assert!(!b.take(7, at_ms(0)), "the fifth in the same instant");
        assert!(!b.take(7, at_ms(249)));
        assert!(b.take(7, at_ms(250)), "a quarter second refills one");
        assert!(!b.take(7, at_ms(250)));
        assert!(b.take(8, at_ms(250)), "other keys have their own");
    }

    #[test]
    fn successful_checks_give_their_share_back() {
        let mut b = Budget::new(2, 100);
        for _ in 0..100 {
            assert!(b.take(7, at_ms(0)));
            b.give_back(7, at_ms(0));
        }
        assert!(b.is_empty(), "a full bucket is not kept");
    }

    #[test]
    fn memory_stays_bounded() {
        let mut b = Budget::new(1, 50);
        for key in 0..10_000u64 {
            assert!(b.take(key, at_ms(key)), "a new key has its budget");
            assert!(b.len() <= 50);
        }
        assert!(!b.take(9_999, at_ms(9_999)), "the newest key is remembered");
    }

    proptest! {
        /// Whatever the sequence of takes and give-backs, the checks a key
        /// runs that fail (taken, never given back) within any time span T
        /// never exceed rate + rate × T.
        #[test]
        fn failed_checks_never_exceed_the_rate(
            rate in 1u32..20,
            steps in proptest::collection::vec((0u64..300, any::<bool>()), 1..400),
        ) {
            let mut b = Budget::new(rate, 1000);
            let mut now = 0;
            let mut failed = Vec::new();
            for (gap, succeeds) in steps {
                now += gap;
                if b.take(1, at_ms(now)) {
                    if succeeds {
                        b.give_back(1, at_ms(now));
                    } else {
                        failed.push(now);
                    }
                }
            }
            let rate = u64::from(rate);
            for (i, start) in failed.iter().enumerate() {
                for (j, end) in failed.iter().enumerate().skip(i) {
                    let span_ms = end - start;
                    let allowed = rate + rate * span_ms / 1000;
                    prop_assert!((j - i + 1) as u64 <= allowed,
                        "{} failed checks within {span_ms} ms at rate {rate}", j - i + 1);
                }
            }
        }
    }
}
