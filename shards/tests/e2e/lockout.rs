//! Failed sign-ins (issue 29, DESIGN.md §9): nobody can lock a device out
//! with wrong passwords, and guessing stays slow. Against the real binary,
//! with clients bound to distinct 127.0.0.x source addresses (any of them
//! reaches a loopback listener on Linux), as a device behind a NAT and an
//! attacker elsewhere would be.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};

use crate::clients::unique;
use crate::harness::Broker;
use crate::mqtt5::metric_with;
use crate::raw::{Incoming, RawClient};
use crate::security::{assert_refused, passwd, refused, set, set_str, start, Login, TempDir};

/// 127.0.0.`last`.
fn local(last: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(127, 0, 0, last))
}

/// The device's address (a NAT it may share with others).
const DEVICE: u8 = 2;
/// An attacker's address.
const ATTACKER: u8 = 3;

/// A broker with a password file holding `dev` (password `right`) and
/// `bob` (`bobs`), anonymous clients refused, and `extra` settings.
fn password_broker(dir: &TempDir, extra: &[(&str, &str)]) -> Broker {
    let file = dir.path("passwd");
    passwd(&file, "dev", "right", None);
    passwd(&file, "bob", "bobs", None);
    let mut args = Vec::new();
    set_str(&mut args, "auth.password_file", &file.display().to_string());
    set(&mut args, "auth.allow_anonymous", "false");
    for (key, value) in extra {
        set(&mut args, key, value);
    }
    start(&args)
}

/// `fleetmq_auth_backoff_total{decision="DECISION"}`.
fn decided(broker: &Broker, decision: &str) -> f64 {
    metric_with(
        broker,
        "fleetmq_auth_backoff_total",
        &format!("decision=\"{decision}\""),
    )
}

/// `fleetmq_auth_throttle_entries{table="TABLE"}`.
fn entries(broker: &Broker, table: &str) -> f64 {
    metric_with(
        broker,
        "fleetmq_auth_throttle_entries",
        &format!("table=\"{table}\""),
    )
}

/// Wrong passwords: what a flood sent and what the broker answered.
#[derive(Default)]
struct Flood {
    sent: AtomicUsize,
    /// CONNACK reason codes, in no particular order.
    codes: Mutex<Vec<u8>>,
    /// Set once the code 0x87 (refused unchecked) was seen.
    backing_off: AtomicBool,
}

impl Flood {
    fn count(&self, code: u8) -> usize {
        self.codes
            .lock()
            .unwrap()
            .iter()
            .filter(|c| **c == code)
            .count()
    }
}

/// On `threads` threads, MQTT 5 CONNECTs from `source` with fresh client
/// identifiers and the wrong password for `users` in turn, until at
/// least `n` were sent and `done` is set.
fn flood(
    addr: SocketAddr,
    source: IpAddr,
    users: &[&str],
    n: usize,
    threads: usize,
    done: &AtomicBool,
    flood: &Flood,
) {
    thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = flood.sent.fetch_add(1, Ordering::Relaxed);
                if i >= n && done.load(Ordering::Relaxed) {
                    return;
                }
                let user = users[i % users.len()];
                let code = Login::v5(&unique("guess"))
                    .user(user, "wrong")
                    .reason_from(addr, source);
                if code == 0x87 {
                    flood.backing_off.store(true, Ordering::Relaxed);
                }
                flood.codes.lock().unwrap().push(code);
            });
        }
    });
}

/// Waits until `flood` was refused unchecked once (so a backoff is in
/// force), then runs `device`'s reconnects and sets `done`.
fn during(flood: &Flood, done: &AtomicBool, device: impl FnOnce()) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !flood.backing_off.load(Ordering::Relaxed) {
        assert!(
            Instant::now() < deadline,
            "the flood was never refused unchecked"
        );
        thread::sleep(Duration::from_millis(10));
    }
    device();
    done.store(true, Ordering::Relaxed);
}

/// Runs `attempt` (wrong credentials, returning the CONNACK code) until
/// one is refused unchecked with 0x87, so the user name or the address
/// backs off; waits a little after each 0x89 (the check budget, 4 per
/// second by default, was spent). Returns the codes seen.
fn until_backing_off(mut attempt: impl FnMut() -> u8) -> Vec<u8> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut codes = Vec::new();
    while codes.last() != Some(&0x87) {
        assert!(Instant::now() < deadline, "never backed off: {codes:02x?}");
        let code = attempt();
        assert!(matches!(code, 0x86 | 0x87 | 0x89), "{code:02x}");
        if code == 0x89 {
            thread::sleep(Duration::from_millis(50));
        }
        codes.push(code);
    }
    codes
}

/// Five reconnects of the device (MQTT 3.1.1, as in the field report)
/// with the right password and client identifier `client_id` from
/// `source`: the CONNACK return codes.
fn reconnects(addr: SocketAddr, source: IpAddr, client_id: &str) -> Vec<u8> {
    (0..5)
        .map(|_| {
            Login::v311(client_id)
                .user("dev", "right")
                .reason_from(addr, source)
        })
        .collect()
}

/// (1) 400 wrong passwords for eight other user names, from the address
/// the device shares (client addresses not trusted, the default): the
/// device reconnects every time, while the flood's user names back off.
#[test]
fn a_flood_of_wrong_passwords_for_other_users_from_a_devices_address_does_not_stop_it_reconnecting()
{
    let dir = TempDir::new("lockout-nat");
    let broker = password_broker(&dir, &[]);
    let addr = broker.mqtt;
    let others = ["u0", "u1", "u2", "u3", "u4", "u5", "u6", "u7"];
    let (done, flooded) = (AtomicBool::new(false), Flood::default());
    let mut codes = Vec::new();
    thread::scope(|s| {
        s.spawn(|| flood(addr, local(DEVICE), &others, 400, 4, &done, &flooded));
        during(&flooded, &done, || {
            codes = reconnects(addr, local(DEVICE), "device-nat")
        });
    });
    assert_eq!(codes, [0; 5], "the device reconnects during the flood");
    assert!(flooded.sent.load(Ordering::Relaxed) >= 400);
    assert!(flooded.count(0x87) > 0, "the flood's user names backed off");
    assert!(
        flooded.count(0x86) <= others.len() * 14,
        "at most threshold + budget verified answers per user name: {}",
        flooded.count(0x86)
    );
}

/// (2) 400 wrong passwords for the device's own user name from another
/// address: the device, which signed in before, reconnects every time
/// with its client identifier; it is let through as a recognised device
/// (counted), and the flood is refused unchecked.
#[test]
fn a_flood_of_wrong_passwords_for_a_devices_user_name_does_not_stop_it_reconnecting() {
    let dir = TempDir::new("lockout-user");
    let broker = password_broker(&dir, &[]);
    let addr = broker.mqtt;
    assert_eq!(
        reconnects(addr, local(DEVICE), "device-7")[..1],
        [0],
        "signed in before"
    );
    let (done, flooded) = (AtomicBool::new(false), Flood::default());
    let mut codes = Vec::new();
    thread::scope(|s| {
        s.spawn(|| flood(addr, local(ATTACKER), &["dev"], 400, 4, &done, &flooded));
        during(&flooded, &done, || {
            codes = reconnects(addr, local(DEVICE), "device-7")
        });
    });
    assert_eq!(codes, [0; 5], "the device reconnects during the flood");
    assert_eq!(decided(&broker, "recognised_checked"), 5.0);
    assert_eq!(decided(&broker, "recognised_accepted"), 5.0);
    assert_eq!(
        decided(&broker, "unrecognised_refused"),
        flooded.count(0x87) as f64
    );
    assert_eq!(entries(&broker, "known_devices"), 1.0);
}

/// (3) Right after a flood for the device's user name, the right password
/// from the attacker's address with a fresh client identifier is refused
/// unchecked, 0x87 (3.1.1: 5), like the wrong ones: a guesser learns
/// nothing during the backoff. Of the 400 guesses on four connections at
/// a time, at most the threshold (10) plus the three others in flight got
/// a verified answer.
#[test]
fn right_after_a_flood_the_right_password_with_a_fresh_client_identifier_is_refused() {
    let dir = TempDir::new("lockout-guess");
    let broker = password_broker(&dir, &[]);
    let addr = broker.mqtt;
    let (done, flooded) = (AtomicBool::new(false), Flood::default());
    thread::scope(|s| {
        s.spawn(|| flood(addr, local(ATTACKER), &["dev"], 400, 4, &done, &flooded));
        during(&flooded, &done, || {});
    });
    let right = |v5: bool, source: u8| {
        let id = unique("fresh");
        let login = if v5 { Login::v5(&id) } else { Login::v311(&id) };
        login.user("dev", "right").reason_from(addr, local(source))
    };
    assert_eq!(
        right(true, ATTACKER),
        0x87,
        "a right guess, refused unchecked"
    );
    assert_eq!(right(false, ATTACKER), 5);
    assert_eq!(
        right(true, 4),
        0x87,
        "from any address: the user name backs off"
    );
    let verified = flooded.count(0x86);
    assert!(
        (10..=13).contains(&verified),
        "{verified} verified answers to 400 guesses"
    );
    assert_eq!(
        flooded.count(0x87) + verified + flooded.count(0x89),
        flooded.codes.lock().unwrap().len()
    );
    assert_refused(&broker, "auth_throttled", (flooded.count(0x87) + 3) as f64);
    assert_eq!(
        decided(&broker, "unrecognised_refused"),
        (flooded.count(0x87) + 3) as f64
    );
}

/// (4) With `limits.trust_client_addresses = true` the per-address limits
/// of DESIGN.md §9 apply: ten failures from one address back it off for
/// every user name (the right password of another user from it is
/// refused, from another address accepted), except for a device that
/// signed in from that address before; the address is part of what
/// recognises a device; and `max_connections_per_source` counts.
#[test]
fn with_trusted_client_addresses_the_per_address_limits_apply() {
    let dir = TempDir::new("lockout-trusted");
    let broker = password_broker(
        &dir,
        &[
            ("limits.trust_client_addresses", "true"),
            ("limits.max_connections_per_source", "3"),
        ],
    );
    let addr = broker.mqtt;
    let (home, guesser, elsewhere) = (local(5), local(6), local(7));
    Login::v5("device-t")
        .user("dev", "right")
        .open_from(addr, home)
        .disconnect();
    let users: Vec<String> = (0..10).map(|i| format!("x{i}")).collect();
    for user in &users {
        assert_eq!(
            Login::v5(&unique("g"))
                .user(user, "wrong")
                .reason_from(addr, home),
            0x86
        );
    }
    assert_eq!(
        Login::v5(&unique("b"))
            .user("bob", "bobs")
            .reason_from(addr, home),
        0x87,
        "the address backs off for every user name"
    );
    assert_eq!(
        Login::v5(&unique("b"))
            .user("bob", "bobs")
            .reason_from(addr, guesser),
        0
    );
    assert_eq!(
        Login::v5("device-t")
            .user("dev", "right")
            .reason_from(addr, home),
        0,
        "the device signed in from this address before"
    );
    // The user name backs off too (failures from a third address).
    until_backing_off(|| {
        Login::v5(&unique("g"))
            .user("dev", "wrong")
            .reason_from(addr, guesser)
    });
    assert_eq!(
        Login::v5("device-t")
            .user("dev", "right")
            .reason_from(addr, home),
        0
    );
    assert_eq!(
        Login::v5("device-t")
            .user("dev", "right")
            .reason_from(addr, elsewhere),
        0x87,
        "the same client identifier from another address is another device"
    );
    // max_connections_per_source = 3: the fourth from one address is closed.
    let held: Vec<_> = (0..3)
        .map(|_| {
            Login::v5(&unique("s"))
                .user("bob", "bobs")
                .open_from(addr, elsewhere)
        })
        .collect();
    assert!(held.iter().all(|c| c.connack.reason == 0));
    let mut fourth = RawClient::connect_from(addr, elsewhere);
    fourth.send(&Login::v5(&unique("s")).user("bob", "bobs").encode());
    assert_eq!(fourth.read(Duration::from_secs(5)), Incoming::Closed);
    assert_eq!(
        Login::v5(&unique("s"))
            .user("bob", "bobs")
            .reason_from(addr, local(8)),
        0
    );
    assert_refused(&broker, "max_connections_per_source", 1.0);
}

const JWT_SECRET: &[u8] = b"lockout-secret";

/// An HS256 token for `sub` signed with `secret`, valid for 10 minutes.
fn token(secret: &[u8], sub: &str) -> String {
    let exp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 600;
    jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        &serde_json::json!({ "sub": sub, "exp": exp }),
        &jsonwebtoken::EncodingKey::from_secret(secret),
    )
    .unwrap()
}

/// A broker taking HS256 JWTs signed with [`JWT_SECRET`], with `extra`.
fn jwt_broker(dir: &TempDir, extra: &[(&str, &str)]) -> Broker {
    let mut args = Vec::new();
    set_str(
        &mut args,
        "auth.jwt.secret_file",
        &dir.put("secret", JWT_SECRET),
    );
    set(&mut args, "auth.allow_anonymous", "false");
    for (key, value) in extra {
        set(&mut args, key, value);
    }
    start(&args)
}

/// (5) 10,000 distinct attacker combinations (user name, client
/// identifier, one of 100 trusted addresses) with wrongly signed JWTs, and
/// 1,500 distinct successful ones, with every table bounded at 1,000: the
/// guard's tables reach their bound and stay within it.
#[test]
fn ten_thousand_distinct_attacker_combinations_keep_the_throttles_memory_within_its_bound() {
    let dir = TempDir::new("lockout-memory");
    let broker = jwt_broker(
        &dir,
        &[
            ("limits.trust_client_addresses", "true"),
            ("limits.auth_failure_threshold", "1000"),
            ("limits.auth_throttle_max_entries", "1000"),
            ("limits.auth_known_devices", "1000"),
        ],
    );
    let addr = broker.mqtt;
    let rss_before = broker.rss_kib();
    let (bad, done) = (AtomicUsize::new(0), AtomicBool::new(false));
    let most = Mutex::new(0.0f64);
    thread::scope(|s| {
        // The tables' sizes while the flood goes on.
        s.spawn(|| {
            while !done.load(Ordering::Relaxed) {
                let sizes = ["failures", "budgets", "known_devices", "device_failures"];
                let n = sizes
                    .iter()
                    .map(|t| entries(&broker, t))
                    .fold(0.0, f64::max);
                let mut most = most.lock().unwrap();
                *most = most.max(n);
                drop(most);
                thread::sleep(Duration::from_millis(100));
            }
        });
        let workers: Vec<_> = (0..4)
            .map(|t| {
                let bad = &bad;
                s.spawn(move || {
                    for i in (t..11_500).step_by(4) {
                        let source = IpAddr::V4(Ipv4Addr::new(127, 0, 1, 1 + (i % 100) as u8));
                        let user = format!("attacker-{i}");
                        let secret: &[u8] = if i < 10_000 { b"guessed" } else { JWT_SECRET };
                        let code = Login::v5(&format!("c{i}"))
                            .user(&user, &token(secret, &user))
                            .reason_from(addr, source);
                        assert_eq!(code, if i < 10_000 { 0x86 } else { 0 }, "attempt {i}");
                        bad.fetch_add(usize::from(code != 0), Ordering::Relaxed);
                    }
                })
            })
            .collect();
        for worker in workers {
            worker.join().unwrap();
        }
        done.store(true, Ordering::Relaxed);
    });
    assert_eq!(bad.load(Ordering::Relaxed), 10_000);
    let most = *most.lock().unwrap();
    assert!(
        most <= 1000.0,
        "a table held {most} entries during the flood"
    );
    for table in ["failures", "budgets", "known_devices", "device_failures"] {
        let n = entries(&broker, table);
        assert!(n <= 1000.0, "{table}: {n} entries");
    }
    assert!(
        entries(&broker, "failures") >= 500.0,
        "the bound was reached and pruned"
    );
    assert!(entries(&broker, "known_devices") >= 500.0);
    let rss_after = broker.rss_kib();
    eprintln!("RSS before {rss_before} KiB, after 11,500 sign-ins {rss_after} KiB");
}

/// The same for JWT sign-ins: a device that signed in with a token is
/// still let in with a valid token while wrongly signed tokens for its
/// user name back the user name off; a fresh client identifier is
/// refused.
#[test]
fn a_jwt_device_is_not_locked_out_by_wrongly_signed_tokens_for_its_user_name() {
    let dir = TempDir::new("lockout-jwt");
    let broker = jwt_broker(&dir, &[]);
    let addr = broker.mqtt;
    let good = token(JWT_SECRET, "dev-j");
    assert_eq!(
        Login::v311("jwt-device")
            .user("dev-j", &good)
            .reason_from(addr, local(DEVICE)),
        0
    );
    let forged = token(b"guessed", "dev-j");
    let codes = until_backing_off(|| {
        Login::v5(&unique("g"))
            .user("dev-j", &forged)
            .reason_from(addr, local(ATTACKER))
    });
    assert_eq!(
        codes.iter().filter(|c| **c == 0x86).count(),
        10,
        "{codes:02x?}"
    );
    for _ in 0..3 {
        assert_eq!(
            Login::v311("jwt-device")
                .user("dev-j", &good)
                .reason_from(addr, local(DEVICE)),
            0
        );
    }
    assert_eq!(
        Login::v5(&unique("f"))
            .user("dev-j", &good)
            .reason_from(addr, local(ATTACKER)),
        0x87
    );
    assert_eq!(decided(&broker, "recognised_accepted"), 3.0);
}

/// A flood of wrong passwords for one user name on many connections at
/// once gets at most `auth_check_rate_per_credential` (2) password hashes
/// per second; the rest are refused unchecked with 0x89 at once, so they
/// never fill `max_connects_authenticating` (4): another user signs in
/// every time during the flood.
#[test]
fn a_flood_for_one_user_name_is_hashed_at_the_check_rate_and_does_not_starve_sign_in() {
    let dir = TempDir::new("lockout-budget");
    let broker = password_broker(
        &dir,
        &[
            ("limits.auth_failure_threshold", "1000000"),
            ("limits.auth_check_rate_per_credential", "2"),
            ("limits.max_connects_authenticating", "4"),
        ],
    );
    let addr = broker.mqtt;
    let (done, flooded) = (AtomicBool::new(false), Flood::default());
    let started = Instant::now();
    let mut bob = Vec::new();
    thread::scope(|s| {
        s.spawn(|| flood(addr, local(ATTACKER), &["dev"], 200, 12, &done, &flooded));
        thread::sleep(Duration::from_millis(300));
        for _ in 0..5 {
            bob.push(
                Login::v5(&unique("bob"))
                    .user("bob", "bobs")
                    .reason_from(addr, local(4)),
            );
            thread::sleep(Duration::from_millis(100));
        }
        done.store(true, Ordering::Relaxed);
    });
    let elapsed = started.elapsed().as_secs_f64();
    assert_eq!(bob, [0; 5], "another user signs in during the flood");
    let hashed = flooded.count(0x86) as f64;
    assert!(
        hashed <= 2.0 + 2.0 * elapsed,
        "{hashed} hashes in {elapsed:.1} s"
    );
    assert!(
        flooded.count(0x89) > 100,
        "refused unchecked: {}",
        flooded.count(0x89)
    );
    assert_eq!(refused(&broker, "max_connects_authenticating"), 0.0);
    // Counted once the CONNACK is out: wait for the last few.
    assert_refused(
        &broker,
        "auth_check_rate_per_credential",
        flooded.count(0x89) as f64,
    );
    assert!(decided(&broker, "over_budget") > 100.0);
}
