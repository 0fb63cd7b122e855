//! Recognised devices (`limits.auth_known_devices`): the combinations
//! (user name, client identifier, and source address when addresses are
//! trusted) that signed in successfully, so that while their user name
//! backs off they are still checked (see [`super::guard`]).
//!
//! A combination is held as its 64-bit keyed hash with the time of its
//! last success: 24 bytes a slot (about 30–60 with the hash table's
//! slack), whatever the user name. Beyond the
//! bound the least recent successes are forgotten. Only verified sign-ins
//! (a password or a JWT that checked out) add entries, so a client without
//! credentials cannot fill the table. No lock, no clock: the time is an
//! input.

use std::collections::HashMap;
use std::time::SystemTime;

use super::throttle::drop_oldest;

/// The combinations that signed in, at most `max` of them.
#[derive(Debug)]
pub struct KnownDevices {
    max: usize,
    last_success: HashMap<u64, SystemTime>,
}

impl KnownDevices {
    /// A table of at most `max` combinations; 0 remembers none.
    pub fn new(max: usize) -> KnownDevices {
        KnownDevices {
            max,
            last_success: HashMap::new(),
        }
    }

    /// Whether `device` signed in successfully and is still remembered.
    pub fn contains(&self, device: u64) -> bool {
        self.last_success.contains_key(&device)
    }

    /// Notes a successful sign-in of `device` at `now`.
    pub fn remember(&mut self, device: u64, now: SystemTime) {
        if self.max == 0 {
            return;
        }
        if !self.last_success.contains_key(&device) {
            drop_oldest(&mut self.last_success, self.max, |t| *t);
        }
        self.last_success.insert(device, now);
    }

    /// Combinations remembered now.
    pub fn len(&self) -> usize {
        self.last_success.len()
    }

    /// Whether none is remembered.
    pub fn is_empty(&self) -> bool {
        self.last_success.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn at(secs: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000 + secs)
    }

    #[test]
    fn a_success_is_remembered() {
        let mut d = KnownDevices::new(10);
        assert!(!d.contains(1));
        d.remember(1, at(0));
        assert!(d.contains(1));
        assert!(!d.contains(2));
    }

    #[test]
    fn beyond_the_bound_the_least_recent_successes_are_forgotten() {
        let mut d = KnownDevices::new(100);
        d.remember(0, at(0));
        for key in 1..1_000u64 {
            d.remember(key, at(key));
            // The first device keeps signing in: it stays.
            d.remember(0, at(key));
            assert!(d.len() <= 100, "{}", d.len());
        }
        assert!(d.contains(0), "recently successful");
        assert!(d.contains(999));
        assert!(!d.contains(1), "the oldest success went");
    }

    #[test]
    fn a_slot_is_24_bytes_whatever_the_user_name() {
        assert_eq!(std::mem::size_of::<(u64, SystemTime)>(), 24);
    }

    #[test]
    fn a_bound_of_zero_remembers_nothing() {
        let mut d = KnownDevices::new(0);
        d.remember(1, at(0));
        assert!(d.is_empty());
    }
}
