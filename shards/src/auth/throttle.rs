//! The failed sign-in throttle (DESIGN.md §9: `auth_failure_threshold`,
//! `auth_failure_window`, `auth_failure_backoff`, `auth_failure_backoff_max`).
//!
//! Failures are counted per key (the lead keys by source address and by
//! user name). Once a key reaches the threshold within the window it is
//! blocked for the backoff; a failure within one window after a backoff ends
//! blocks it again for twice as long, up to the maximum. A key that stays
//! quiet for a window after its last backoff (or after its first counted
//! failure) starts from scratch.
//!
//! Memory is bounded: entries whose state has lapsed are pruned, and beyond
//! [`Throttle::max_keys`] the least recently failed entries are dropped.
//! Only the sign-in path takes the lock, so a `Mutex<HashMap>` is enough.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use fleetmq_core::settings::Limits;

/// Default bound on the number of keys a [`Throttle`] remembers.
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
    /// Whether nothing about this entry matters any more at `now`.
    fn lapsed(&self, now: SystemTime, window: Duration) -> bool {
        let since = |t: SystemTime| now.duration_since(t).unwrap_or(Duration::ZERO);
        match self.blocked_until {
            Some(until) => now >= until && since(until) > window,
            None => since(self.window_start) > window,
        }
    }
}

/// Counts failed sign-ins per key and says which keys are backing off.
/// `Send + Sync`; share it in an `Arc`.
#[derive(Debug)]
pub struct Throttle {
    config: ThrottleConfig,
    max_keys: usize,
    entries: Mutex<HashMap<String, Entry>>,
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
            entries: Mutex::new(HashMap::new()),
        }
    }

    /// The bound on remembered keys.
    pub fn max_keys(&self) -> usize {
        self.max_keys
    }

    /// Keys remembered now (blocked, counting, or not yet pruned).
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether no key is remembered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The end of `key`'s backoff when it is backing off at `now`, else
    /// `None`. A blocked key's sign-in must be refused without checking its
    /// credentials.
    pub fn blocked_until(&self, key: &str, now: SystemTime) -> Option<SystemTime> {
        let entries = self.lock();
        let until = entries.get(key)?.blocked_until?;
        (now < until).then_some(until)
    }

    /// Records a failed sign-in for `key` at `now` and returns the end of
    /// the backoff it starts, if it starts one. A failure while `key` is
    /// already blocked changes nothing (it was not checked).
    pub fn record_failure(&self, key: &str, now: SystemTime) -> Option<SystemTime> {
        let config = self.config;
        let mut entries = self.lock();
        if !entries.contains_key(key) && entries.len() >= self.max_keys {
            prune(&mut entries, now, config.window, self.max_keys);
        }
        let entry = entries.entry(key.to_owned()).or_insert(Entry {
            failures: 0,
            window_start: now,
            blocked_until: None,
            backoff: Duration::ZERO,
            last_failure: now,
        });
        if entry.lapsed(now, config.window) {
            *entry = Entry {
                failures: 0,
                window_start: now,
                blocked_until: None,
                backoff: Duration::ZERO,
                last_failure: now,
            };
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

    /// Forgets `key` (e.g. a user name after a successful sign-in).
    pub fn forget(&self, key: &str) {
        self.lock().remove(key);
    }

    /// Drops every entry that no longer matters at `now`.
    pub fn prune(&self, now: SystemTime) {
        let mut entries = self.lock();
        entries.retain(|_, e| !e.lapsed(now, self.config.window));
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        // A panic while holding the lock cannot leave a map half-updated in a
        // way that matters here: keep going with what is there.
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Makes room for one more key: lapsed entries go first; if that is not
/// enough, the least recently failed tenth of the bound goes too.
fn prune(entries: &mut HashMap<String, Entry>, now: SystemTime, window: Duration, max: usize) {
    entries.retain(|_, e| !e.lapsed(now, window));
    if entries.len() < max {
        return;
    }
    let drop = (entries.len() + 1 - max).max(max / 10).min(entries.len());
    let mut by_age: Vec<(SystemTime, String)> = entries
        .iter()
        .map(|(k, e)| (e.last_failure, k.clone()))
        .collect();
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

    fn at(secs: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000 + secs)
    }

    #[test]
    fn failures_below_the_threshold_do_not_block() {
        let t = Throttle::new(config());
        assert_eq!(t.record_failure("1.2.3.4", at(0)), None);
        assert_eq!(t.record_failure("1.2.3.4", at(1)), None);
        assert_eq!(t.blocked_until("1.2.3.4", at(2)), None);
    }

    #[test]
    fn the_threshold_within_the_window_blocks_for_the_backoff() {
        let t = Throttle::new(config());
        t.record_failure("k", at(0));
        t.record_failure("k", at(1));
        assert_eq!(t.record_failure("k", at(2)), Some(at(32)));
        assert_eq!(t.blocked_until("k", at(31)), Some(at(32)));
        assert_eq!(t.blocked_until("k", at(32)), None);
        assert_eq!(t.blocked_until("other", at(3)), None);
    }

    #[test]
    fn failures_spread_beyond_the_window_do_not_block() {
        let t = Throttle::new(config());
        t.record_failure("k", at(0));
        t.record_failure("k", at(50));
        assert_eq!(
            t.record_failure("k", at(61)),
            None,
            "window restarted at 61"
        );
        assert_eq!(t.record_failure("k", at(62)), None);
        assert!(t.record_failure("k", at(63)).is_some());
    }

    #[test]
    fn each_failure_after_a_backoff_doubles_it_up_to_the_maximum() {
        let t = Throttle::new(config());
        for s in 0..3 {
            t.record_failure("k", at(s));
        }
        // Blocked 2..32; failures while blocked are not counted.
        assert_eq!(t.record_failure("k", at(10)), None);
        assert_eq!(t.record_failure("k", at(32)), Some(at(32 + 60)));
        assert_eq!(t.record_failure("k", at(92)), Some(at(92 + 100)), "capped");
        assert_eq!(t.record_failure("k", at(192)), Some(at(192 + 100)));
    }

    #[test]
    fn a_quiet_window_after_a_backoff_starts_from_scratch() {
        let t = Throttle::new(config());
        for s in 0..3 {
            t.record_failure("k", at(s));
        }
        // Backoff ended at 32; quiet until 32 + 60 + 1.
        assert_eq!(t.record_failure("k", at(93)), None);
        assert_eq!(t.blocked_until("k", at(94)), None);
    }

    #[test]
    fn forgetting_a_key_clears_its_failures() {
        let t = Throttle::new(config());
        t.record_failure("k", at(0));
        t.record_failure("k", at(1));
        t.forget("k");
        assert_eq!(t.record_failure("k", at(2)), None);
    }

    #[test]
    fn memory_stays_bounded_dropping_the_oldest_keys() {
        let t = Throttle::with_max_keys(config(), 100);
        for i in 0..1000u64 {
            t.record_failure(&format!("k{i}"), at(i / 100));
        }
        assert!(t.len() <= 100, "{}", t.len());
        // The newest key is still remembered.
        t.record_failure("k999", at(10));
        t.record_failure("k999", at(10));
        assert!(t.blocked_until("k999", at(10)).is_some());
    }

    #[test]
    fn pruning_drops_lapsed_entries_and_keeps_blocked_ones() {
        let t = Throttle::new(config());
        t.record_failure("old", at(0));
        for s in 100..103 {
            t.record_failure("blocked", at(s));
        }
        t.prune(at(110));
        assert_eq!(t.len(), 1);
        assert!(t.blocked_until("blocked", at(110)).is_some());
    }
}
