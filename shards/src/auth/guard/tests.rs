//! The guard's state machine with time as an input.

use std::time::Duration;

use proptest::prelude::*;

use super::*;

fn config(trust_addresses: bool) -> GuardConfig {
    GuardConfig {
        throttle: ThrottleConfig {
            threshold: 3,
            window: Duration::from_secs(60),
            backoff: Duration::from_secs(30),
            backoff_max: Duration::from_secs(900),
        },
        trust_addresses,
        check_rate: 4,
        max_entries: 1000,
        known_devices: 1000,
    }
}

fn at_ms(ms: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000) + Duration::from_millis(ms)
}

fn at(secs: u64) -> SystemTime {
    at_ms(secs * 1000)
}

/// User `user` from address `address` as device `device`.
fn attempt(user: u64, address: u64, device: u64) -> Attempt {
    Attempt {
        user: Some(user),
        known_user: Some(user + KNOWN),
        address: Some(address),
        device: Some(device),
    }
}

/// User `user` as device `device`, addresses not trusted.
fn from_anywhere(user: u64, device: u64) -> Attempt {
    Attempt {
        address: None,
        ..attempt(user, 0, device)
    }
}

/// Added to a user's key for its remembered devices' budget.
const KNOWN: u64 = 1 << 32;

const ALICE: u64 = 1;
const DEVICE: u64 = 100;
const HOME: u64 = 1000;
const ELSEWHERE: u64 = 2000;

fn check(state: &mut State, a: &Attempt, succeeds: bool, now: SystemTime) -> Verdict {
    let verdict = state.admit(a, now);
    if let Verdict::Check { .. } = verdict {
        state.settle(a, verdict, succeeds, now);
    }
    verdict
}

const CHECKED: Verdict = Verdict::Check {
    recognised: false,
    known: false,
};
const KNOWN_CHECKED: Verdict = Verdict::Check {
    recognised: false,
    known: true,
};
const RECOGNISED: Verdict = Verdict::Check {
    recognised: true,
    known: true,
};
const UNRECOGNISED: Verdict = Verdict::Refuse(Refusal::Unrecognised);

#[test]
fn failures_for_a_user_name_refuse_new_combinations_but_check_a_known_device() {
    let mut s = State::new(&config(false));
    let device = from_anywhere(ALICE, DEVICE);
    assert_eq!(check(&mut s, &device, true, at(0)), CHECKED);
    for i in 0..3 {
        let guess = from_anywhere(ALICE, 500 + i);
        assert_eq!(
            check(&mut s, &guess, false, at(1 + i)),
            CHECKED,
            "guess {i}"
        );
    }
    let right_guess = from_anywhere(ALICE, 600);
    assert_eq!(s.admit(&right_guess, at(5)), UNRECOGNISED, "even if right");
    assert_eq!(check(&mut s, &device, true, at(5)), RECOGNISED);
    assert_eq!(check(&mut s, &device, true, at(6)), RECOGNISED, "again");
    assert_eq!(s.admit(&right_guess, at(40)), CHECKED, "the backoff ended");
}

#[test]
fn a_known_device_that_fails_backs_off_on_its_own() {
    let mut s = State::new(&config(false));
    let device = from_anywhere(ALICE, DEVICE);
    check(&mut s, &device, true, at(0));
    for i in 0..3 {
        check(&mut s, &from_anywhere(ALICE, 500 + i), false, at(1));
    }
    // Someone who knows the client identifier guesses as the device.
    for i in 0..3 {
        assert_eq!(check(&mut s, &device, false, at(2 + i)), RECOGNISED);
    }
    assert_eq!(
        s.admit(&device, at(6)),
        Verdict::Refuse(Refusal::DeviceBackingOff)
    );
    let other = from_anywhere(ALICE, DEVICE + 1);
    check(&mut s, &other, true, at(40));
    assert_eq!(
        check(&mut s, &device, true, at(40)),
        KNOWN_CHECKED,
        "both backoffs over"
    );
}

#[test]
fn addresses_back_off_only_when_trusted() {
    for trust in [false, true] {
        let mut s = State::new(&config(trust));
        let address = |a| trust.then_some(a);
        for i in 0..3 {
            let guess = Attempt {
                address: address(HOME),
                ..attempt(10 + i, HOME, 500 + i)
            };
            check(&mut s, &guess, false, at(0));
        }
        let neighbour = Attempt {
            address: address(HOME),
            ..attempt(ALICE, HOME, DEVICE)
        };
        let expected = if trust { UNRECOGNISED } else { CHECKED };
        assert_eq!(s.admit(&neighbour, at(1)), expected, "trusted: {trust}");
    }
}

#[test]
fn a_device_recognised_from_its_trusted_address_is_checked_during_its_backoff() {
    let mut s = State::new(&config(true));
    let device = attempt(ALICE, HOME, DEVICE);
    check(&mut s, &device, true, at(0));
    for i in 0..3 {
        check(&mut s, &attempt(20 + i, HOME, 500 + i), false, at(1));
    }
    assert_eq!(check(&mut s, &device, true, at(2)), RECOGNISED);
    let same_id_elsewhere = attempt(ALICE, ELSEWHERE, DEVICE + 7);
    check(&mut s, &same_id_elsewhere, true, at(2));
}

#[test]
fn failing_checks_per_user_name_stay_within_the_rate_and_successes_are_free() {
    let mut config = config(false);
    config.throttle.threshold = 1000;
    let mut s = State::new(&config);
    let mut checked = 0;
    for i in 0..100 {
        let a = from_anywhere(ALICE, i);
        if check(&mut s, &a, false, at(0)) == CHECKED {
            checked += 1;
        }
    }
    assert_eq!(checked, 4, "one second's worth at once");
    let a = from_anywhere(ALICE, 1);
    assert_eq!(s.admit(&a, at(0)), Verdict::Refuse(Refusal::OverBudget));
    assert_eq!(check(&mut s, &a, false, at_ms(250)), CHECKED, "refilled");
    let bob = from_anywhere(2, 1);
    assert_eq!(check(&mut s, &bob, true, at(1)), CHECKED);
    for _ in 0..100 {
        assert_eq!(
            check(&mut s, &bob, true, at(1)),
            KNOWN_CHECKED,
            "successes give back"
        );
    }
}

#[test]
fn a_flood_of_new_combinations_cannot_spend_the_budget_of_known_devices() {
    let mut config = config(false);
    config.throttle.threshold = 1000;
    let mut s = State::new(&config);
    let device = from_anywhere(ALICE, DEVICE);
    check(&mut s, &device, true, at(0));
    for i in 0..4 {
        check(&mut s, &from_anywhere(ALICE, 500 + i), false, at(1));
    }
    let late = from_anywhere(ALICE, 600);
    assert_eq!(s.admit(&late, at(1)), Verdict::Refuse(Refusal::OverBudget));
    assert_eq!(check(&mut s, &device, true, at(1)), KNOWN_CHECKED);
}

#[test]
fn a_check_that_never_ran_gives_its_budget_share_back() {
    let mut s = State::new(&config(false));
    let a = from_anywhere(ALICE, 500);
    for _ in 0..10 {
        let verdict = s.admit(&a, at(0));
        assert_eq!(verdict, CHECKED);
        s.abandon(&a, verdict, at(0));
    }
}

#[test]
fn a_success_does_not_clear_the_user_names_failures() {
    let mut s = State::new(&config(false));
    let device = from_anywhere(ALICE, DEVICE);
    for i in 0..2 {
        check(&mut s, &from_anywhere(ALICE, 500 + i), false, at(i));
    }
    check(&mut s, &device, true, at(2));
    check(&mut s, &from_anywhere(ALICE, 502), false, at(3));
    assert_eq!(
        s.admit(&from_anywhere(ALICE, 503), at(4)),
        UNRECOGNISED,
        "a device signing in says nothing about who else is guessing"
    );
}

#[test]
fn an_anonymous_combination_is_never_remembered() {
    let guard = Guard::new(&config(false), SignInMetrics::default());
    let peer = "192.0.2.1".parse().unwrap();
    assert_eq!(guard.attempt(Some("alice"), "", peer).device, None);
    assert!(guard.attempt(Some("alice"), "c1", peer).device.is_some());
    let trusted = Guard::new(&config(true), SignInMetrics::default());
    let a = trusted.attempt(Some("alice"), "", peer);
    assert!(a.device.is_some() && a.address.is_some());
    let other = trusted.attempt(Some("alice"), "", "192.0.2.2".parse().unwrap());
    assert_ne!(a.device, other.device, "the address is part of the device");
    assert_ne!(a.user, trusted.attempt(Some("bob"), "", peer).user);
}

/// One step of a property run: who tries, when, and whether the
/// credentials are right (the device's always are).
#[derive(Debug, Clone)]
enum Step {
    Device {
        gap_ms: u64,
    },
    Attacker {
        gap_ms: u64,
        user: u64,
        client: u64,
        address: u64,
        right: bool,
    },
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        (0u64..5_000).prop_map(|gap_ms| Step::Device { gap_ms }),
        (
            0u64..2_000,
            0u64..3,
            0u64..50,
            0u64..3,
            proptest::bool::weighted(0.05)
        )
            .prop_map(|(gap_ms, user, client, address, right)| Step::Attacker {
                gap_ms,
                user,
                client,
                address,
                right
            }),
    ]
}

proptest! {
    /// Whatever the attackers do (never with the device's client
    /// identifier): the device, once signed in, is never refused because
    /// of their failures (at most for a spent budget); an attacker's new
    /// combination is never checked while its user name backs off; the
    /// failing checks per user name stay within the rate; the tables stay
    /// within their bounds.
    #[test]
    fn attackers_cannot_lock_out_a_known_device_nor_guess_fast(
        trust in any::<bool>(),
        steps in proptest::collection::vec(step(), 1..300),
    ) {
        let mut config = config(trust);
        // Small enough to prune often; the attackers' successes cannot
        // push the device out of a table this size.
        config.max_entries = 20;
        let mut s = State::new(&config);
        let device = Attempt { address: trust.then_some(HOME), ..attempt(ALICE, HOME, DEVICE) };
        let mut now = 0;
        prop_assert_eq!(check(&mut s, &device, true, at_ms(now)), CHECKED);
        let mut failed_checks: Vec<(u64, u64)> = Vec::new();
        for step in steps {
            match step {
                Step::Device { gap_ms } => {
                    now += gap_ms;
                    let verdict = check(&mut s, &device, true, at_ms(now));
                    prop_assert!(
                        matches!(verdict, Verdict::Check { .. } | Verdict::Refuse(Refusal::OverBudget)),
                        "device refused at {now}: {verdict:?}"
                    );
                }
                Step::Attacker { gap_ms, user, client, address, right } => {
                    now += gap_ms;
                    let a = Attempt {
                        user: Some(user),
                        known_user: Some(user + KNOWN),
                        address: trust.then_some(ELSEWHERE + address),
                        device: Some(DEVICE + 1 + user * 100 + client),
                    };
                    let backing_off = s.failures.blocked_until(user, at_ms(now)).is_some()
                        || a.address.is_some_and(|k| s.failures.blocked_until(k, at_ms(now)).is_some());
                    let known = s.devices.contains(a.device.unwrap());
                    let verdict = check(&mut s, &a, right, at_ms(now));
                    if backing_off && !known {
                        prop_assert_eq!(verdict, UNRECOGNISED);
                    }
                    if matches!(verdict, Verdict::Check { .. }) && !right {
                        failed_checks.push((user, now));
                    }
                }
            }
            prop_assert!(s.failures.len() <= 20 && s.device_failures.len() <= 20);
            prop_assert!(s.devices.len() <= 1000 && s.budget.len() <= 20);
        }
        for user in 0..3 {
            let times: Vec<u64> = failed_checks.iter().filter(|(u, _)| *u == user).map(|(_, t)| *t).collect();
            for (i, start) in times.iter().enumerate() {
                for (j, end) in times.iter().enumerate().skip(i) {
                    // Two budgets per user name: new combinations and
                    // remembered devices.
                    prop_assert!((j - i + 1) as u64 <= 2 * (4 + 4 * (end - start) / 1000));
                }
            }
        }
    }
}
