//! The sign-in guard: which credential checks run, and what a failure
//! costs (DESIGN.md §9; README "Failed sign-ins").
//!
//! It guards the checks that verify a secret (a password against the
//! password file, a JWT). For each attempt it looks at up to three keys:
//! the user name, the source address (only with
//! `limits.trust_client_addresses`, since otherwise one address may hide a
//! whole fleet behind a NAT or a load balancer), and the *device*: the
//! combination of user name, client identifier and, when addresses are
//! trusted, address.
//!
//! - A failure counts towards the user name and the address
//!   ([`Throttle`]); at the threshold they back off.
//! - A success remembers the device ([`KnownDevices`]). While its user name
//!   or address backs off, a remembered device is still checked, with a
//!   throttle of its own, so failures someone else made cannot lock it
//!   out. Any other combination is refused unchecked, even with the right
//!   password: a guesser learns nothing during a backoff.
//! - Every check takes a share of its user name's budget ([`Budget`]) and
//!   a success gives it back, so however many CONNECTs come, the failing
//!   checks (password hashes) per user name stay within
//!   `limits.auth_check_rate_per_credential` per second. Remembered
//!   devices have a budget of their own per user name, so a flood of new
//!   combinations cannot spend theirs: at most twice the rate in all.
//!
//! [`State`] is the pure state machine (time is an input, no clock, no
//! lock); [`Guard`] wraps it in a mutex with the keyed hasher and the
//! metrics.

use std::hash::{BuildHasher, Hash};
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::SystemTime;

use fleetmq_core::settings::Limits;

use super::budget::Budget;
use super::devices::KnownDevices;
use super::throttle::{Throttle, ThrottleConfig};
use crate::metrics::{BackoffDecision, SignInMetrics, ThrottleTable};

/// The guard's parameters, usually [`GuardConfig::from_limits`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GuardConfig {
    /// The `limits.auth_failure_*` backoff.
    pub throttle: ThrottleConfig,
    /// `limits.trust_client_addresses`: whether addresses are keys.
    pub trust_addresses: bool,
    /// `limits.auth_check_rate_per_credential`: failing checks per second
    /// per user name.
    pub check_rate: u32,
    /// `limits.auth_throttle_max_entries`: bound of each throttle table.
    pub max_entries: usize,
    /// `limits.auth_known_devices`: bound of the recognised devices.
    pub known_devices: usize,
}

impl GuardConfig {
    /// From the `limits.*` settings.
    pub fn from_limits(limits: &Limits) -> GuardConfig {
        GuardConfig {
            throttle: ThrottleConfig::from_limits(limits),
            trust_addresses: limits.trust_client_addresses,
            check_rate: limits.auth_check_rate_per_credential,
            max_entries: limits.auth_throttle_max_entries as usize,
            known_devices: limits.auth_known_devices as usize,
        }
    }
}

/// One sign-in, as the guard's keys (64-bit keyed hashes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attempt {
    /// The user name; `None` when the CONNECT has none.
    pub user: Option<u64>,
    /// The user name's budget for remembered devices; `None` without a
    /// user name.
    pub known_user: Option<u64>,
    /// The source address; `None` unless addresses are trusted.
    pub address: Option<u64>,
    /// The device (user name, client identifier, trusted address); `None`
    /// when the client identifier is empty and addresses are not trusted,
    /// since anyone could present that combination.
    pub device: Option<u64>,
}

/// What to do with an [`Attempt`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Check the credentials, then [`State::settle`].
    Check {
        /// The user name or address backs off, and the check runs only
        /// because the device signed in before.
        recognised: bool,
        /// The device signed in before: the check took a share of the
        /// remembered devices' budget.
        known: bool,
    },
    /// Refuse without checking.
    Refuse(Refusal),
}

/// Why an attempt is refused unchecked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The user name or the address backs off and this combination has not
    /// signed in recently.
    Unrecognised,
    /// The combination signed in before but backs off itself.
    DeviceBackingOff,
    /// The user name has spent its check budget.
    OverBudget,
}

/// The guard's tables. No lock, no clock.
#[derive(Debug)]
pub struct State {
    /// User names and trusted addresses.
    failures: Throttle,
    /// Remembered devices' own failures.
    device_failures: Throttle,
    devices: KnownDevices,
    budget: Budget,
}

impl State {
    /// Empty tables sized by `config`.
    pub fn new(config: &GuardConfig) -> State {
        State {
            failures: Throttle::with_max_keys(config.throttle, config.max_entries),
            device_failures: Throttle::with_max_keys(config.throttle, config.max_entries),
            devices: KnownDevices::new(config.known_devices),
            budget: Budget::new(config.check_rate, config.max_entries),
        }
    }

    /// Whether `attempt` is checked at `now`. A [`Verdict::Check`] has
    /// taken a share of the user name's budget: [`State::settle`] it.
    pub fn admit(&mut self, attempt: &Attempt, now: SystemTime) -> Verdict {
        let blocked =
            |key: Option<u64>| key.is_some_and(|k| self.failures.blocked_until(k, now).is_some());
        let backing_off = blocked(attempt.user) || blocked(attempt.address);
        let known = attempt.device.filter(|d| self.devices.contains(*d));
        if backing_off {
            let Some(device) = known else {
                return Verdict::Refuse(Refusal::Unrecognised);
            };
            if self.device_failures.blocked_until(device, now).is_some() {
                return Verdict::Refuse(Refusal::DeviceBackingOff);
            }
        }
        let known = known.is_some();
        if let Some(budget) = budget_key(attempt, known) {
            if !self.budget.take(budget, now) {
                return Verdict::Refuse(Refusal::OverBudget);
            }
        }
        Verdict::Check {
            recognised: backing_off,
            known,
        }
    }

    /// Records how the check [`State::admit`] allowed with `verdict`
    /// ended: a success remembers the device, clears its own failures and
    /// gives the budget share back; a failure counts towards the user
    /// name, the address and, when it is remembered, the device.
    pub fn settle(
        &mut self,
        attempt: &Attempt,
        verdict: Verdict,
        succeeded: bool,
        now: SystemTime,
    ) {
        if succeeded {
            if let Some(device) = attempt.device {
                self.devices.remember(device, now);
                self.device_failures.forget(device);
            }
            self.abandon(attempt, verdict, now);
            return;
        }
        for key in [attempt.user, attempt.address].into_iter().flatten() {
            self.failures.record_failure(key, now);
        }
        if let Some(device) = attempt.device.filter(|d| self.devices.contains(*d)) {
            self.device_failures.record_failure(device, now);
        }
    }

    /// Gives back the budget share [`State::admit`] took for a check that
    /// did not run; nothing else changes.
    pub fn abandon(&mut self, attempt: &Attempt, verdict: Verdict, now: SystemTime) {
        if let Verdict::Check { known, .. } = verdict {
            if let Some(budget) = budget_key(attempt, known) {
                self.budget.give_back(budget, now);
            }
        }
    }

    /// Entries per table, for the metrics.
    fn sizes(&self) -> [(ThrottleTable, usize); 4] {
        [
            (ThrottleTable::Failures, self.failures.len()),
            (ThrottleTable::DeviceFailures, self.device_failures.len()),
            (ThrottleTable::KnownDevices, self.devices.len()),
            (ThrottleTable::Budgets, self.budget.len()),
        ]
    }
}

/// The budget a check of `attempt` spends: the user name's, or its
/// remembered devices' when `known`.
fn budget_key(attempt: &Attempt, known: bool) -> Option<u64> {
    if known {
        attempt.known_user
    } else {
        attempt.user
    }
}

/// [`State`] behind a mutex, with the keyed hasher that turns names into
/// keys and the metrics. `Send + Sync`; sign-ins take the lock twice (a
/// few hundred nanoseconds each), never while checking a credential.
#[derive(Debug)]
pub struct Guard {
    trust_addresses: bool,
    /// Keyed with random keys per process, so no one can pick names whose
    /// keys collide.
    hasher: std::collections::hash_map::RandomState,
    state: Mutex<State>,
    metrics: SignInMetrics,
}

impl Guard {
    /// A guard with empty tables counting into `metrics`.
    pub fn new(config: &GuardConfig, metrics: SignInMetrics) -> Guard {
        Guard {
            trust_addresses: config.trust_addresses,
            hasher: std::collections::hash_map::RandomState::new(),
            state: Mutex::new(State::new(config)),
            metrics,
        }
    }

    fn key(&self, what: impl Hash) -> u64 {
        self.hasher.hash_one(what)
    }

    /// The keys of a sign-in as `username`, `client_id`, from `peer`.
    pub fn attempt(&self, username: Option<&str>, client_id: &str, peer: IpAddr) -> Attempt {
        let address = self.trust_addresses.then_some(peer);
        let identifies = !client_id.is_empty() || address.is_some();
        Attempt {
            user: username.map(|u| self.key(("user", u))),
            known_user: username.map(|u| self.key(("known user", u))),
            address: address.map(|a| self.key(("address", a))),
            device: identifies.then(|| self.key(("device", username, client_id, address))),
        }
    }

    /// [`State::admit`], counted.
    pub fn admit(&self, attempt: &Attempt, now: SystemTime) -> Verdict {
        let mut state = self.lock();
        let verdict = state.admit(attempt, now);
        drop(state);
        let decision = match verdict {
            Verdict::Check {
                recognised: false, ..
            } => return verdict,
            Verdict::Check {
                recognised: true, ..
            } => BackoffDecision::RecognisedChecked,
            Verdict::Refuse(Refusal::Unrecognised) => BackoffDecision::UnrecognisedRefused,
            Verdict::Refuse(Refusal::DeviceBackingOff) => BackoffDecision::RecognisedBackingOff,
            Verdict::Refuse(Refusal::OverBudget) => BackoffDecision::OverBudget,
        };
        self.metrics.count(decision);
        verdict
    }

    /// [`State::settle`] for a check allowed by `verdict`, counted.
    pub fn settle(&self, attempt: &Attempt, verdict: Verdict, succeeded: bool, now: SystemTime) {
        let mut state = self.lock();
        state.settle(attempt, verdict, succeeded, now);
        let sizes = state.sizes();
        drop(state);
        if succeeded
            && matches!(
                verdict,
                Verdict::Check {
                    recognised: true,
                    ..
                }
            )
        {
            self.metrics.count(BackoffDecision::RecognisedAccepted);
        }
        for (table, entries) in sizes {
            self.metrics.set_entries(table, entries);
        }
    }

    /// [`State::abandon`].
    pub fn abandon(&self, attempt: &Attempt, verdict: Verdict, now: SystemTime) {
        self.lock().abandon(attempt, verdict, now);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // Every update leaves the tables consistent: after a panic
        // elsewhere, keep going with what is there.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests;
