//! The failed sign-in throttle (DESIGN.md §9: `auth_failure_threshold`,
//! `auth_failure_window`, `auth_failure_backoff`, `auth_failure_backoff_max`).
//!
//! Failures are counted per key ([`super::guard`] keys by user name, by
//! source address when addresses are trusted, and by recognised device).
//! Once a key reaches the threshold within the window it is blocked for the
//! backoff; a failure within one window after a backoff ends blocks it
//! again for twice as long, up to the maximum. A key that stays quiet for a
//! window after its last backoff (or after its first counted failure)
//! starts from scratch.
//!
//! Keys are 64-bit keyed hashes, so an entry costs the same whatever the
//! length of the user name behind it. Memory is bounded: entries whose
//! state has lapsed are pruned, and beyond [`Throttle::max_keys`] the least
//! recently failed entries are dropped. The throttle holds no lock and
//! reads no clock: the time is an input, and its owner serializes calls.

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use fleetmq_core::settings::Limits;

/// Default bound on the number of keys a [`Throttle`] remembers
/// (`limits.auth_throttle_max_entries`).
pub const DEFAULT_MAX_KEYS: usize = 100_000;

/// The throttle's parameters, usually [`ThrottleConfig::from_limits`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThrottleConfig {
    /// Failures within `window` that start a backoff. Default 10.
    pub threshold: u32,
    /// Window in which failures are counted. Default 60 s.
    pub window: Duration,
    /// First backoff. Default 30 s.
    pub backoff: Duration,
    /// Longest backoff; doubling stops here. Default 15 min.
    pub backoff_max: Duration,
}

impl ThrottleConfig {
    /// The `limits.auth_failure_*` settings.
    pub fn from_limits(limits: &Limits) -> Self {
        ThrottleConfig {
            threshold: limits.auth_failure_threshold,
            window: limits.auth_failure_window,
            backoff: limits.auth_failure_backoff,
            backoff_max: limits.auth_failure_backoff_max,
        }
    }
}

impl Default for ThrottleConfig {
    fn default() -> Self {
        ThrottleConfig::from_limits(&Limits::default())
    }
}

/// `now - then`, zero when the clock went back.
pub(crate) fn since(now: SystemTime, then: SystemTime) -> Duration {
    now.duration_since(then).unwrap_or(Duration::ZERO)
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    /// Failures counted since `window_start` (before the first backoff).
    failures: u32,
    window_start: SystemTime,
    /// End of the current or last backoff; `None` before the first one.
    blocked_until: Option<SystemTime>,
    /// Length of the current or last backoff.
    backoff: Duration,
    last_failure: SystemTime,
}

impl Entry {
    fn new(now: SystemTime) -> Entry {
        Entry {
            failures: 0,
            window_start: now,
            blocked_until: None,
            backoff: Duration::ZERO,
            last_failure: now,
        }
    }

    /// Whether nothing about this entry matters any more at `now`.
    fn lapsed(&self, now: SystemTime, window: Duration) -> bool {
        match self.blocked_until {
            Some(until) => now >= until && since(now, until) > window,
            None => since(now, self.window_start) > window,
        }
    }
}

/// Counts failed sign-ins per key and says which keys are backing off.
#[derive(Debug)]
pub struct Throttle {
    config: ThrottleConfig,
    max_keys: usize,
    entries: HashMap<u64, Entry>,
}

impl Throttle {
    /// A throttle remembering at most [`DEFAULT_MAX_KEYS`] keys.
    pub fn new(config: ThrottleConfig) -> Self {
        Throttle::with_max_keys(config, DEFAULT_MAX_KEYS)
    }

    /// A throttle remembering at most `max_keys` keys (at least 1).
    pub fn with_max_keys(config: ThrottleConfig, max_keys: usize) -> Self {
        Throttle {
            config,
            max_keys: max_keys.max(1),
            entries: HashMap::new(),
        }
    }

    /// The bound on remembered keys.
    pub fn max_keys(&self) -> usize {
        self.max_keys
    }

    /// Keys remembered now (blocked, counting, or not yet pruned).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no key is remembered.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The end of `key`'s backoff when it is backing off at `now`, else
    /// `None`. A blocked key's sign-in must be refused without checking its
    /// credentials.
    pub fn blocked_until(&self, key: u64, now: SystemTime) -> Option<SystemTime> {
        let until = self.entries.get(&key)?.blocked_until?;
        (now < until).then_some(until)
    }

    /// Records a failed sign-in for `key` at `now` and returns the end of
    /// the backoff it starts, if it starts one. A failure while `key` is
    /// already blocked changes nothing (it was not checked).
    pub fn record_failure(&mut self, key: u64, now: SystemTime) -> Option<SystemTime> {
        let config = self.config;
        if !self.entries.contains_key(&key) && self.entries.len() >= self.max_keys {
            prune(&mut self.entries, now, config.window, self.max_keys);
        }
        let entry = self.entries.entry(key).or_insert_with(|| Entry::new(now));
        if entry.lapsed(now, config.window) {
            *entry = Entry::new(now);
        }
        entry.last_failure = now;
        match entry.blocked_until {
            Some(until) if now < until => None,
            Some(_) => {
                // Failing again soon after a backoff: twice as long.
                entry.backoff = (entry.backoff * 2).min(config.backoff_max);
                entry.blocked_until = Some(now + entry.backoff);
                entry.blocked_until
            }
            None => {
                entry.failures += 1;
                if entry.failures < config.threshold {
                    return None;
                }
                entry.backoff = config.backoff.min(config.backoff_max);
                entry.blocked_until = Some(now + entry.backoff);
                entry.blocked_until
            }
        }
    }

    /// Forgets `key` (e.g. a recognised device after a successful sign-in).
    pub fn forget(&mut self, key: u64) {
        self.entries.remove(&key);
    }

    /// Drops every entry that no longer matters at `now`.
    pub fn prune(&mut self, now: SystemTime) {
        let window = self.config.window;
        self.entries.retain(|_, e| !e.lapsed(now, window));
    }
}

/// Makes room for one more key: lapsed entries go first; if that is not
/// enough, the least recently failed tenth of the bound goes too.
fn prune(entries: &mut HashMap<u64, Entry>, now: SystemTime, window: Duration, max: usize) {
    entries.retain(|_, e| !e.lapsed(now, window));
    drop_oldest(entries, max, |e| e.last_failure);
}

/// When `entries` holds `max` or more, drops the oldest by `age` (at least
/// one, and a tenth of `max` at once so the scan is rare).
pub(crate) fn drop_oldest<V>(
    entries: &mut HashMap<u64, V>,
    max: usize,
    age: impl Fn(&V) -> SystemTime,
) {
    if entries.len() < max {
        return;
    }
    let drop = (entries.len() + 1 - max).max(max / 10).min(entries.len());
    let mut by_age: Vec<(SystemTime, u64)> = entries.iter().map(|(k, v)| (age(v), *k)).collect();
    by_age.select_nth_unstable_by_key(drop - 1, |(t, _)| *t);
    for (_, key) in by_age.into_iter().take(drop) {
        entries.remove(&key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> ThrottleConfig {
        ThrottleConfig {
            threshold: 3,
            window: Duration::from_secs(60),
            backoff: Duration::from_secs(30),
            backoff_max: Duration::from_secs(100),
        }
    }

    const K: u64 = 1;

    fn at(secs: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000 + secs)
    }

    /// `limits.auth_throttle_max_entries` documents 80 bytes a slot.
    #[test]
    fn a_slot_is_80_bytes_whatever_the_key() {
        assert_eq!(std::mem::size_of::<(u64, Entry)>(), 80);
    }

    #[test]
    fn failures_below_the_threshold_do_not_block() {
        let mut t = Throttle::new(config());
        assert_eq!(t.record_failure(1234, at(0)), None);
        assert_eq!(t.record_failure(1234, at(1)), None);
        assert_eq!(t.blocked_until(1234, at(2)), None);
    }

    #[test]
    fn the_threshold_within_the_window_blocks_for_the_backoff() {
        let mut t = Throttle::new(config());
        t.record_failure(K, at(0));
        t.record_failure(K, at(1));
        assert_eq!(t.record_failure(K, at(2)), Some(at(32)));
        assert_eq!(t.blocked_until(K, at(31)), Some(at(32)));
        assert_eq!(t.blocked_until(K, at(32)), None);
        assert_eq!(t.blocked_until(2, at(3)), None);
    }

    #[test]
    fn failures_spread_beyond_the_window_do_not_block() {
        let mut t = Throttle::new(config());
        t.record_failure(K, at(0));
        t.record_failure(K, at(50));
        assert_eq!(t.record_failure(K, at(61)), None, "window restarted at 61");
        assert_eq!(t.record_failure(K, at(62)), None);
        assert!(t.record_failure(K, at(63)).is_some());
    }

    #[test]
    fn each_failure_after_a_backoff_doubles_it_up_to_the_maximum() {
        let mut t = Throttle::new(config());
        for s in 0..3 {
            t.record_failure(K, at(s));
        }
        // Blocked 2..32; failures while blocked are not counted.
        assert_eq!(t.record_failure(K, at(10)), None);
        assert_eq!(t.record_failure(K, at(32)), Some(at(32 + 60)));
        assert_eq!(t.record_failure(K, at(92)), Some(at(92 + 100)), "capped");
        assert_eq!(t.record_failure(K, at(192)), Some(at(192 + 100)));
    }

    #[test]
    fn a_quiet_window_after_a_backoff_starts_from_scratch() {
        let mut t = Throttle::new(config());
        for s in 0..3 {
            t.record_failure(K, at(s));
        }
        // Backoff ended at 32; quiet until 32 + 60 + 1.
        assert_eq!(t.record_failure(K, at(93)), None);
        assert_eq!(t.blocked_until(K, at(94)), None);
    }

    #[test]
    fn forgetting_a_key_clears_its_failures() {
        let mut t = Throttle::new(config());
        t.record_failure(K, at(0));
        t.record_failure(K, at(1));
        t.forget(K);
        assert_eq!(t.record_failure(K, at(2)), None);
    }

    #[test]
    fn memory_stays_bounded_dropping_the_oldest_keys() {
        let mut t = Throttle::with_max_keys(config(), 100);
        for i in 0..1000u64 {
            t.record_failure(i, at(i / 100));
        }
        assert!(t.len() <= 100, "{}", t.len());
        // The newest key is still remembered.
        t.record_failure(999, at(10));
        t.record_failure(999, at(10));
        assert!(t.blocked_until(999, at(10)).is_some());
    }

    #[test]
    fn pruning_drops_lapsed_entries_and_keeps_blocked_ones() {
        let mut t = Throttle::new(config());
        t.record_failure(3, at(0));
        for s in 100..103 {
            t.record_failure(4, at(s));
        }
        t.prune(at(110));
        assert_eq!(t.len(), 1);
        assert!(t.blocked_until(4, at(110)).is_some());
    }
}
