//! End-to-end tests of `fleetmq-loadgen` against a real `fleetmq` broker.
//!
//! The broker binary is `$CARGO_TARGET_DIR/<profile>/fleetmq` (default
//! `<workspace>/target`), built with `cargo build -p fleetmq-shards` when
//! missing. Each test starts its own broker on port 0 and kills it on drop.

/// mqtts://, ws:// and wss:// brokers: every scenario over TLS and
/// WebSocket, certificates made here by rcgen, and the failures (unknown
/// CA, wrong name, refused upgrade, missing client certificate).
#[path = "loadgen/transports.rs"]
mod transports;

/// `soak --through-restarts` while the broker is killed with SIGKILL and
/// started again: the checker's counts (lost acknowledged values,
/// duplicates by QoS, order) and its verdict.
#[path = "loadgen/restarts.rs"]
mod restarts;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// A broker process, killed on drop.
struct Broker {
    child: Child,
    /// The `mqtt-tcp` listener's port.
    port: u16,
    /// Every `fleetmq: listening KIND ADDR` line: (kind, port).
    listeners: Vec<(String, u16)>,
}

impl Broker {
    /// The port of the listener of `kind` (`mqtt-tls`, `mqtt-ws`,
    /// `mqtt-wss`).
    fn port_of(&self, kind: &str) -> u16 {
        self.listeners
            .iter()
            .find(|(k, _)| k == kind)
            .map(|(_, p)| *p)
            .unwrap_or_else(|| panic!("no {kind} listener in {:?}", self.listeners))
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn broker_binary() -> PathBuf {
    let workspace = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace.join("target"));
    // The profile folder is the one this test binary sits in (…/debug/deps/…).
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_fleetmq-loadgen"));
    let profile_dir = exe
        .parent()
        .map(PathBuf::from)
        .unwrap_or_else(|| target.join("debug"));
    let path = profile_dir.join("fleetmq");
    if !path.exists() {
        let release = profile_dir.file_name().is_some_and(|n| n == "release");
        let mut build = Command::new(env!("CARGO"));
        build
            .args(["build", "-p", "fleetmq-shards", "--bin", "fleetmq"])
            .current_dir(&workspace);
        if release {
            build.arg("--release");
        }
        let status = build.status().expect("cargo runs");
        assert!(status.success(), "building the fleetmq broker failed");
    }
    path
}

fn start_broker() -> Broker {
    start_broker_with("1")
}

fn start_broker_with(shards: &str) -> Broker {
    start_broker_set(shards, &[])
}

fn start_broker_set(shards: &str, set: &[&str]) -> Broker {
    start_broker_on("127.0.0.1:0", shards, set)
}

/// A broker listening on `listen`, with `--shards shards`, the local store
/// off unless `set` (`--set` values, applied after) turns it on.
fn start_broker_on(listen: &str, shards: &str, set: &[&str]) -> Broker {
    let mut child = Command::new(broker_binary())
        .args([
            "serve",
            "--listen",
            listen,
            "--admin",
            "",
            "--shards",
            shards,
            "--set",
            "store.kind=none",
        ])
        .args(set.iter().flat_map(|s| ["--set", s]))
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("the broker starts");
    let stdout = child.stdout.take().expect("piped stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut listeners = Vec::new();
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some((kind, addr)) = line
                .strip_prefix("fleetmq: listening ")
                .and_then(|rest| rest.trim().split_once(' '))
            {
                if let Some(port) = addr.rsplit(':').next().and_then(|p| p.parse::<u16>().ok()) {
                    listeners.push((kind.to_string(), port));
                }
            }
            if line.trim() == "fleetmq: ready" {
                let _ = tx.send(std::mem::take(&mut listeners));
            }
        }
    });
    let mut broker = Broker {
        child,
        port: 0,
        listeners: Vec::new(),
    };
    match rx.recv_timeout(Duration::from_secs(30)) {
        Ok(listeners) => broker.listeners = listeners,
        Err(e) => panic!("the broker did not announce its readiness: {e:?}"),
    }
    broker.port = broker.port_of("mqtt-tcp");
    broker
}

fn loadgen(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_fleetmq-loadgen"))
        .args(args)
        .output()
        .expect("fleetmq-loadgen runs")
}

#[test]
fn fan_in_at_qos_1_delivers_every_message_it_counts() {
    let broker = start_broker();
    let dir = std::env::temp_dir().join(format!("loadgen-e2e-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("fan-in.json");
    let url = format!("mqtt://127.0.0.1:{}", broker.port);
    // A window below the broker's default Receive Maximum (1000).
    let out = loadgen(&[
        "run",
        "fan-in",
        "--url",
        &url,
        "--qos",
        "1",
        "--duration",
        "2s",
        "--warmup",
        "500ms",
        "--window",
        "500",
        "--json",
        json.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "loadgen failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let n = |k: &str| {
        report[k]
            .as_u64()
            .unwrap_or_else(|| panic!("field {k} in {report}"))
    };
    assert!(n("sent") > 0, "something was sent: {report}");
    assert_eq!(
        n("sent"),
        n("received"),
        "one subscriber receives every message sent"
    );
    assert_eq!(n("expected"), n("received"));
    assert_eq!(
        n("acked_total"),
        n("published_total"),
        "every publish is acknowledged"
    );
    assert_eq!(report["latency_us"]["count"].as_u64(), Some(n("received")));
    assert_eq!(report["check"], "ok");
    assert!(report["histogram_v2_base64"]
        .as_str()
        .is_some_and(|h| !h.is_empty()));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_unreachable_broker_fails_fast_with_a_clear_message() {
    let url = unreachable_url();
    let started = std::time::Instant::now();
    let out = loadgen(&[
        "run",
        "fan-in",
        "--url",
        &url,
        "--duration",
        "1s",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("TCP connect failed"));
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[test]
fn invalid_options_exit_2() {
    assert_eq!(
        loadgen(&["run", "fan-in", "--payload-size", "8"])
            .status
            .code(),
        Some(2)
    );
    assert_eq!(
        loadgen(&["run", "fan-in", "--rate", "lots"]).status.code(),
        Some(2)
    );
}

/// A `mqtt://` URL on loopback where nothing listens (a port the kernel
/// just handed out and took back).
fn unreachable_url() -> String {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    format!("mqtt://127.0.0.1:{port}")
}

fn read_json(path: &std::path::Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn temp_json(name: &str) -> PathBuf {
    // Not the fan-in test's folder: that test removes it when done.
    std::env::temp_dir().join(format!("loadgen-e2e-{}-{name}", std::process::id()))
}

fn assert_ok(out: &std::process::Output) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "loadgen failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

#[test]
fn persistent_subscriber_gets_everything_back_across_reconnects() {
    let broker = start_broker();
    let url = format!("mqtt://127.0.0.1:{}", broker.port);
    for protocol in ["3.1.1", "5"] {
        let json = temp_json(&format!("persistent-{protocol}.json"));
        let out = loadgen(&[
            "run",
            "persistent",
            "--url",
            &url,
            "--protocol",
            protocol,
            "--qos",
            "1",
            "--rate",
            "2000",
            "--duration",
            "3s",
            "--reconnect-every",
            "1s",
            "--offline-for",
            "500ms",
            "--json",
            json.to_str().unwrap(),
        ]);
        assert_ok(&out);
        let r = read_json(&json);
        let v = &r["verify"];
        assert!(v["published"].as_u64().unwrap() > 1000, "{r}");
        assert_eq!(v["missing"], 0, "{r}");
        assert_eq!(v["order_violations"], 0, "{r}");
        assert_eq!(v["sessions_lost"], 0, "{r}");
        assert!(
            v["reconnects"].as_u64().unwrap() >= 1,
            "it went offline: {r}"
        );
        assert_eq!(v["received_distinct"], v["published"], "{r}");
        assert_eq!(r["check"], "ok");
    }
}

#[test]
fn shared_group_members_split_the_messages_exactly_once() {
    let broker = start_broker_with("2");
    let url = format!("mqtt://127.0.0.1:{}", broker.port);
    let json = temp_json("shared.json");
    let out = loadgen(&[
        "run",
        "shared",
        "--url",
        &url,
        "--qos",
        "1",
        "--subscribers",
        "3",
        "--duration",
        "2s",
        "--window",
        "500",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert_ok(&out);
    let r = read_json(&json);
    let v = &r["verify"];
    let members: Vec<u64> = v["per_subscriber"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m.as_u64().unwrap())
        .collect();
    assert_eq!(members.len(), 3);
    assert!(members.iter().all(|&m| m > 0), "every member got some: {r}");
    assert_eq!(
        members.iter().sum::<u64>(),
        v["published"].as_u64().unwrap(),
        "{r}"
    );
    assert_eq!(v["missing"], 0, "{r}");
    assert_eq!(v["duplicates"], 0, "{r}");
    assert_eq!(r["check"], "ok");
}

#[test]
fn soak_reports_every_interval_and_checks_every_message() {
    let broker = start_broker();
    let url = format!("mqtt://127.0.0.1:{}", broker.port);
    let json = temp_json("soak.json");
    let out = loadgen(&[
        "soak",
        "--url",
        &url,
        "--qos",
        "2",
        "--rate",
        "1000",
        "--duration",
        "3s",
        "--report-every",
        "1s",
        "--json",
        json.to_str().unwrap(),
    ]);
    let stdout = assert_ok(&out);
    let lines = stdout.lines().filter(|l| l.starts_with('[')).count();
    assert!((3..=4).contains(&lines), "one line per interval: {stdout}");
    assert!(stdout.contains("p99"), "{stdout}");
    let r = read_json(&json);
    let v = &r["verify"];
    assert!(v["published"].as_u64().unwrap() >= 2900, "{r}");
    assert_eq!(v["received_distinct"], v["published"], "{r}");
    assert_eq!(v["duplicates"], 0, "{r}");
    assert_eq!(v["acked"], v["published"], "{r}");
}

#[test]
fn checked_flows_fail_fast_on_an_unreachable_broker_and_bad_options() {
    let url = unreachable_url();
    let started = std::time::Instant::now();
    for args in [
        &["soak", "--url", &url, "--duration", "1s"][..],
        &["run", "persistent", "--url", &url, "--duration", "1s"][..],
        &["run", "shared", "--url", &url, "--duration", "1s"][..],
    ] {
        let out = loadgen(args);
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("TCP connect failed"));
    }
    assert!(started.elapsed() < Duration::from_secs(10));
    for args in [
        &["soak", "--report-every", "0s"][..],
        &["soak", "--publishers", "0"][..],
        &["run", "persistent", "--reconnect-every", "0s"][..],
        &["run", "persistent", "--session-expiry", "0"][..],
        &["run", "shared", "--share-group", "a/b"][..],
    ] {
        assert_eq!(loadgen(args).status.code(), Some(2), "{args:?}");
    }
}

/// A `fleetmq-loadgen proxy` process, killed on drop.
struct ProxyProcess {
    child: Child,
    port: u16,
}

impl Drop for ProxyProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_proxy(upstream: u16, extra: &[&str]) -> ProxyProcess {
    let upstream = format!("127.0.0.1:{upstream}");
    let mut child = Command::new(env!("CARGO_BIN_EXE_fleetmq-loadgen"))
        .args(["proxy", "--listen", "127.0.0.1:0", "--upstream", &upstream])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("the proxy starts");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    // "fleetmq-loadgen proxy: listening 127.0.0.1:PORT -> ..."
    let port = line
        .split_whitespace()
        .nth(3)
        .and_then(|a| a.rsplit(':').next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no port in {line:?}"));
    ProxyProcess { child, port }
}

/// MQTT 3.1.1 CONNECT, client id "px", clean session, keep alive 0.
const CONNECT: &[u8] = &[
    0x10, 14, 0, 4, b'M', b'Q', b'T', b'T', 4, 2, 0, 0, 0, 2, b'p', b'x',
];

fn connack_round_trip(port: u16) -> std::io::Result<Duration> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    let t = std::time::Instant::now();
    s.write_all(CONNECT)?;
    let mut ack = [0u8; 4];
    s.read_exact(&mut ack)?;
    assert_eq!(ack, [0x20, 2, 0, 0], "CONNACK accepted");
    Ok(t.elapsed())
}

#[test]
fn proxy_delays_a_broker_round_trip_and_cuts_on_sigusr1() {
    let broker = start_broker();
    let direct = connack_round_trip(broker.port).unwrap();
    let proxy = start_proxy(broker.port, &["--delay", "200ms"]);
    let rtt = connack_round_trip(proxy.port).unwrap();
    assert!(
        rtt >= Duration::from_millis(400),
        "200 ms each way: {rtt:?} (direct {direct:?})"
    );
    assert!(rtt < Duration::from_secs(3), "{rtt:?}");

    // SIGUSR1 cuts open connections; new ones still work.
    use std::io::Read;
    let mut s = std::net::TcpStream::connect(("127.0.0.1", proxy.port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    // SAFETY: signalling our own child process.
    unsafe { libc::kill(proxy.child.id() as libc::pid_t, libc::SIGUSR1) };
    let t = std::time::Instant::now();
    let mut buf = [0u8; 1];
    assert!(matches!(s.read(&mut buf), Ok(0) | Err(_)), "cut by SIGUSR1");
    assert!(t.elapsed() < Duration::from_secs(2));
    assert!(connack_round_trip(proxy.port).is_ok());
}

#[test]
fn proxy_holds_replies_until_sigusr2() {
    use std::io::{Read, Write};
    let broker = start_broker();
    let proxy = start_proxy(broker.port, &["--hold-upstream"]);
    let mut s = std::net::TcpStream::connect(("127.0.0.1", proxy.port)).unwrap();
    s.write_all(CONNECT).unwrap();
    s.set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let mut ack = [0u8; 4];
    assert!(s.read_exact(&mut ack).is_err(), "CONNACK held");
    // SAFETY: signalling our own child process.
    unsafe { libc::kill(proxy.child.id() as libc::pid_t, libc::SIGUSR2) };
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.read_exact(&mut ack).unwrap();
    assert_eq!(ack, [0x20, 2, 0, 0]);
}

#[test]
fn proxy_bad_input_fails_clearly() {
    let out = loadgen(&["proxy", "--listen", "127.0.0.1:0", "--upstream", "nowhere"]);
    assert_eq!(out.status.code(), Some(2));
    let out = loadgen(&[
        "proxy",
        "--listen",
        "127.0.0.1:0",
        "--upstream",
        "127.0.0.1:1",
        "--bandwidth",
        "lots",
    ]);
    assert_eq!(out.status.code(), Some(2));
    // A port already taken: exit 1 at once.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let out = loadgen(&["proxy", "--listen", &addr, "--upstream", "127.0.0.1:1"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot listen"));
}

#[test]
fn persistent_exits_non_zero_when_the_broker_drops_queued_messages() {
    // A 100-message queue per subscriber: 1 s offline at 2000 msg/s overflows it.
    let broker = start_broker_set("1", &["limits.max_subscriber_queue=100"]);
    let url = format!("mqtt://127.0.0.1:{}", broker.port);
    let out = loadgen(&[
        "run",
        "persistent",
        "--url",
        &url,
        "--qos",
        "1",
        "--rate",
        "2000",
        "--duration",
        "2s",
        "--reconnect-every",
        "500ms",
        "--offline-for",
        "1s",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(stdout.contains("missing at QoS 1"), "{stdout}");
}

/// A broker that dies mid-run makes the run fail (exit 1, "broker
/// unusable"), also where QoS 0 loss alone would only be reported: idle
/// connections and a QoS 0 fan-out. `idle` ends about a second after its
/// held connections fail rather than waiting out --duration.
#[test]
fn a_broker_that_dies_mid_run_fails_idle_and_qos0_runs() {
    for scenario in [
        &["run", "idle", "--connections", "50", "--duration", "60s"][..],
        &[
            "run",
            "fan-out",
            "--subscribers",
            "5",
            "--qos",
            "0",
            "--rate",
            "2000",
            "--duration",
            "6s",
        ][..],
    ] {
        let mut broker = start_broker();
        let url = format!("mqtt://127.0.0.1:{}", broker.port);
        let started = std::time::Instant::now();
        let child = Command::new(env!("CARGO_BIN_EXE_fleetmq-loadgen"))
            .args(scenario)
            .args(["--url", &url])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("fleetmq-loadgen runs");
        std::thread::sleep(Duration::from_secs(2));
        let _ = broker.child.kill();
        let _ = broker.child.wait();
        let out = child.wait_with_output().expect("fleetmq-loadgen ends");
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(1),
            "{scenario:?} after the broker died:\n{text}"
        );
        if scenario[1] == "idle" {
            assert!(started.elapsed() < Duration::from_secs(15), "idle took {:?}", started.elapsed());
        }
    }
}

/// A 1-second MQTT 3.1.1 `run fan-out` with `subscribers` subscribers
/// against a [`fake_broker`] that sends `after_suback` after each SUBACK:
/// the exit code, stdout and stderr.
fn fan_out_from_fake_broker(after_suback: &'static [u8], subscribers: &str) -> (Option<i32>, String, String) {
    let port = fake_broker(after_suback, &[]);
    let out = loadgen(&[
        "run", "fan-out", "--url", &format!("mqtt://127.0.0.1:{port}"), "--protocol", "3.1.1",
        "--subscribers", subscribers, "--duration", "1s", "--warmup", "0s",
    ]);
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.code(), text(&out.stdout), text(&out.stderr))
}

/// A fake MQTT 3.1.1 broker on a free port: it answers CONNECT with
/// CONNACK, SUBSCRIBE with SUBACK (QoS 0 granted) followed by `after_suback`
/// (raw bytes), each PUBLISH with `after_publish`, PINGREQ with PINGRESP,
/// and reads and drops the rest. It runs on threads that end with the test
/// process.
fn fake_broker(after_suback: &'static [u8], after_publish: &'static [u8]) -> u16 {
    use std::io::{Read, Write};
    fn read_packet(s: &mut std::net::TcpStream) -> std::io::Result<(u8, Vec<u8>)> {
        let mut first = [0u8; 1];
        s.read_exact(&mut first)?;
        let (mut len, mut shift) = (0usize, 0);
        loop {
            let mut b = [0u8; 1];
            s.read_exact(&mut b)?;
            len |= usize::from(b[0] & 0x7F) << shift;
            shift += 7;
            if b[0] & 0x80 == 0 {
                break;
            }
        }
        let mut body = vec![0u8; len];
        s.read_exact(&mut body)?;
        Ok((first[0], body))
    }
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut s) = stream else { continue };
            std::thread::spawn(move || -> std::io::Result<()> {
                read_packet(&mut s)?; // CONNECT
                s.write_all(&[0x20, 0x02, 0x00, 0x00])?;
                loop {
                    let (first, body) = read_packet(&mut s)?;
                    match first >> 4 {
                        8 => {
                            s.write_all(&[0x90, 0x03, body[0], body[1], 0x00])?;
                            s.write_all(after_suback)?;
                        }
                        3 => s.write_all(after_publish)?,
                        12 => s.write_all(&[0xD0, 0x00])?,
                        _ => {}
                    }
                }
            });
        }
    });
    port
}

/// A broker that sends a malformed PUBLISH fails even a QoS 0 run (where
/// loss alone is not fatal): exit 1, and stderr says what was wrong with
/// the packet.
#[test]
fn a_malformed_publish_from_the_broker_fails_a_qos0_run_and_says_why() {
    // PUBLISH QoS 0 whose Topic Name (9 bytes) runs past its 3-byte body.
    let (code, stdout, stderr) = fan_out_from_fake_broker(&[0x30, 0x03, 0x00, 0x09, b'a'], "2");
    assert_eq!(code, Some(1), "stdout: {stdout}\nstderr: {stderr}");
    assert!(
        stderr.contains("malformed packet: PUBLISH field runs past the end of the packet"),
        "stderr: {stderr}"
    );
    assert!(stdout.contains("failed mid-run"), "stdout: {stdout}");
}

/// A broker that accepts everything and delivers nothing fails a QoS 0 run.
#[test]
fn a_qos0_run_in_which_nothing_is_delivered_fails() {
    let (code, stdout, _) = fan_out_from_fake_broker(&[], "2");
    assert_eq!(code, Some(1), "stdout: {stdout}");
    assert!(stdout.contains("nothing was delivered"), "stdout: {stdout}");
}

/// A malformed acknowledgement fails a QoS 1 run, and stderr says what was
/// wrong with it (the publisher's acknowledgement reader has its own decode).
#[test]
fn a_malformed_puback_fails_the_run_and_says_why() {
    // PUBACK with fixed-header flags 0b0010: reserved bits must be 0.
    let port = fake_broker(&[], &[0x42, 0x02, 0x00, 0x01]);
    let out = loadgen(&[
        "run", "fan-in", "--url", &format!("mqtt://127.0.0.1:{port}"), "--protocol", "3.1.1",
        "--publishers", "2", "--subscribers", "1", "--qos", "1", "--duration", "1s", "--warmup", "0s",
    ]);
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(1), "stdout: {stdout}\nstderr: {stderr}");
    assert!(stderr.contains("reserved fixed header flags"), "stderr: {stderr}");
}

/// A PUBLISH whose Topic Name breaks the rules (a wildcard
/// `[MQTT-3.3.2-2]`, bytes that are not UTF-8 `[MQTT-1.5.4-1]`) fails the
/// run and stderr says which rule.
#[test]
fn a_publish_with_a_bad_topic_name_fails_the_run_and_says_why() {
    for (packet, why) in [
        (&[0x30u8, 0x05, 0x00, 0x03, b'a', b'/', b'#'][..], "wildcard"),
        (&[0x30u8, 0x04, 0x00, 0x02, 0xFF, 0xFE][..], "not UTF-8"),
    ] {
        let packet: &'static [u8] = Box::leak(packet.to_vec().into_boxed_slice());
        let (code, _, stderr) = fan_out_from_fake_broker(packet, "1");
        assert_eq!(code, Some(1), "stderr: {stderr}");
        assert!(stderr.contains("bad PUBLISH Topic Name") && stderr.contains(why), "stderr: {stderr}");
    }
}

/// A broker announcing a PUBLISH far larger than the run's payloads (here
/// the largest Remaining Length MQTT allows, 256 MiB) fails the run at its
/// fixed header, saying so, rather than having every subscriber buffer up
/// to 256 MiB waiting for it.
#[test]
fn a_publish_announced_far_larger_than_the_payloads_fails_the_run_at_once() {
    let (code, stdout, stderr) = fan_out_from_fake_broker(&[0x30, 0xFF, 0xFF, 0xFF, 0x7F], "2");
    assert_eq!(code, Some(1), "stdout: {stdout}\nstderr: {stderr}");
    assert!(stderr.contains("bad packet from the broker: packet of 268435460 bytes exceeds the maximum of"), "stderr: {stderr}");
    assert!(stdout.contains("failed mid-run"), "stdout: {stdout}");
}

/// `run idle` says that its timed phase is the connect phase (the
/// connections are then held for --duration), not a measured interval.
#[test]
fn idle_reports_its_connect_phase_as_such() {
    let broker = start_broker();
    let out = loadgen(&[
        "run", "idle", "--url", &format!("mqtt://127.0.0.1:{}", broker.port),
        "--connections", "20", "--duration", "1s",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    assert!(stdout.starts_with("scenario idle  (") && stdout.contains(" s to connect)"), "{stdout}");
}


/// `--connect-window`: every connection of a storm and of `idle` gets in,
/// at most that many under way at once, and idle holds them all (the
/// broker's RSS per connection is reported).
#[test]
fn a_closed_loop_storm_connects_everyone_and_idle_holds_them() {
    let broker = start_broker();
    let url = format!("mqtt://127.0.0.1:{}", broker.port);
    let pid = broker.child.id().to_string();
    for scenario in [
        &["run", "connect-storm", "--connections", "300", "--connect-window", "7"][..],
        &["run", "idle", "--connections", "200", "--connect-window", "16", "--duration", "1s", "--broker-pid", &pid],
    ] {
        let json = temp_json(&format!("window-{}.json", scenario[1]));
        let mut args = scenario.to_vec();
        args.extend(["--url", &url, "--json", json.to_str().unwrap()]);
        assert_ok(&loadgen(&args));
        let r = read_json(&json);
        assert_eq!(r["check"], "ok", "{r}");
        assert_eq!(r["connections"]["connected"], r["connections"]["target"], "{r}");
        assert!(r["options"]["connect_window"].as_u64().unwrap() > 0, "{r}");
        assert!(r["connections"]["connect_per_s"].as_f64().unwrap() > 0.0, "{r}");
        if scenario[1] == "idle" {
            assert!(r["connections"]["broker_kib_per_connection"].is_number(), "{r}");
        }
    }
}

/// `fleetmq-loadgen ARGS` under a 4 GiB address-space limit, killed after
/// `limit`: a compare that reads without bound fails the test instead of
/// the machine.
fn loadgen_bounded(args: &[&str], limit: Duration) -> std::process::Output {
    let mut child = Command::new("sh")
        .arg("-c")
        .arg("ulimit -v 4194304 && exec \"$0\" \"$@\"")
        .arg(env!("CARGO_BIN_EXE_fleetmq-loadgen"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("fleetmq-loadgen runs");
    let started = std::time::Instant::now();
    while child.try_wait().expect("waits").is_none() {
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("fleetmq-loadgen {args:?} still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("output")
}

/// A minimal `run --json` result.
fn result_json(scenario: &str, qos: u8, throughput: f64) -> serde_json::Value {
    serde_json::json!({
        "tool": "fleetmq-loadgen",
        "scenario": scenario,
        "options": {
            "urls": ["mqtt://127.0.0.1:1883"],
            "protocol": "3.1.1",
            "qos": qos,
            "payload_size": 64,
            "rate": "max",
            "window": 1000
        },
        "publishers": 10,
        "subscribers": 1,
        "throughput_per_s": throughput,
        "latency_us": {"p50": 10, "p99": 20, "p999": 30}
    })
}

fn write_result(name: &str, v: &serde_json::Value) -> PathBuf {
    let path = temp_json(name);
    std::fs::write(&path, v.to_string()).unwrap();
    path
}

#[test]
fn compare_refuses_a_device_at_once_instead_of_reading_it_forever() {
    let baseline = write_result("compare-device.json", &result_json("fan-in", 0, 100.0));
    let out = loadgen_bounded(
        &["compare", baseline.to_str().unwrap(), "/dev/zero"],
        Duration::from_secs(10),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("/dev/zero: a device, not a regular file"),
        "{stderr}"
    );
    let _ = std::fs::remove_file(&baseline);
}

#[test]
fn compare_refuses_different_scenarios_and_a_baseline_that_measured_nothing() {
    let fan_in = write_result("compare-fan-in.json", &result_json("fan-in", 0, 100.0));
    let fan_out = write_result("compare-fan-out.json", &result_json("fan-out", 0, 100.0));
    let qos1 = write_result("compare-qos1.json", &result_json("fan-in", 1, 100.0));
    let empty = write_result("compare-empty.json", &result_json("fan-in", 0, 0.0));
    let negative = write_result("compare-negative.json", &result_json("fan-in", 0, -5.0));
    for (candidate, needle) in [
        (&fan_out, "scenario: fan-in vs fan-out"),
        (&qos1, "--qos: 0 vs 1"),
        (&negative, "throughput_per_s"),
    ] {
        let out = loadgen(&[
            "compare",
            fan_in.to_str().unwrap(),
            candidate.to_str().unwrap(),
        ]);
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert_eq!(
            out.status.code(),
            Some(2),
            "{candidate:?}: {stdout}{stderr}"
        );
        assert!(stderr.contains(needle), "{stderr}");
        assert!(!stdout.contains("no regression"), "{stdout}");
    }
    let out = loadgen(&["compare", empty.to_str().unwrap(), fan_in.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("measured nothing"), "{stderr}");
    let out = loadgen(&[
        "compare",
        fan_in.to_str().unwrap(),
        fan_in.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stdout).contains("no regression"));
    for p in [fan_in, fan_out, qos1, empty, negative] {
        let _ = std::fs::remove_file(p);
    }
}

#[test]
fn compare_thresholds_outside_their_range_are_refused_naming_the_option() {
    for (option, value, range) in [
        ("--min-throughput-ratio", "0", "above 0 and at most 1"),
        ("--min-throughput-ratio", "95", "above 0 and at most 1"),
        ("--min-throughput-ratio", "-1", "above 0 and at most 1"),
        ("--max-p99-regression", "-5%", "at least 0 %"),
        ("--max-p99-regression", "10", "at least 0 %"),
    ] {
        // `--option=value` and `--option value` alike, also for a value
        // that starts with '-'.
        let joined = format!("{option}={value}");
        for args in [vec![joined.as_str()], vec![option, value]] {
            let mut all = vec!["compare", "a.json", "b.json"];
            all.extend(&args);
            let out = loadgen(&all);
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
            assert!(
                stderr.contains(option) && stderr.contains(range),
                "{args:?}: {stderr}"
            );
        }
    }
}

#[test]
fn a_json_path_that_cannot_be_written_fails_before_the_run_starts() {
    // A broker that is not there: a run that started would fail to connect.
    let url = unreachable_url();
    let missing = "/nonexistent/dir/x.json";
    for command in ["run fan-in", "run persistent", "soak"] {
        let mut args: Vec<&str> = command.split(' ').collect();
        args.extend(["--url", &url, "--duration", "1s", "--json", missing]);
        let out = loadgen(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{command}: {stderr}");
        assert!(
            stderr.contains(&format!("--json: cannot write {missing}")),
            "{command}: {stderr}"
        );
        assert!(
            !stderr.contains("TCP connect failed"),
            "{command}: {stderr}"
        );
    }
    // A path that can be written, for a run that fails: no file is left.
    let json = temp_json("unreachable.json");
    let out = loadgen(&[
        "run",
        "fan-in",
        "--url",
        &url,
        "--json",
        json.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(!json.exists(), "the file made for the run is removed");
}

/// `--pub-url` / `--sub-url` against two independent brokers (no mesh
/// between them): a subscriber receives only what is published on its own
/// broker, so the counts per broker the report prints show which broker
/// each client used.
#[test]
fn pub_and_sub_urls_put_each_client_on_its_broker() {
    let (a, b) = (start_broker(), start_broker());
    let (a, b) = (
        format!("mqtt://127.0.0.1:{}", a.port),
        format!("mqtt://127.0.0.1:{}", b.port),
    );
    // Open loop, 1 s measured: subscribers receiving nothing must not
    // stall a closed-loop window.
    let run = |name: &str, args: &[&str]| {
        let json = temp_json(name);
        let mut argv = vec!["run"];
        argv.extend_from_slice(args);
        argv.extend_from_slice(&["--duration", "1s", "--warmup", "300ms", "--json"]);
        argv.push(json.to_str().unwrap());
        let out = loadgen(&argv);
        let report = read_json(&json);
        let _ = std::fs::remove_file(&json);
        (out, report)
    };
    // Fan-out: the publisher on A, four subscribers spread over A and B
    // (0 and 2 on A, 1 and 3 on B).
    let spread = format!("{a},{b}");
    let (out, report) = run(
        "fan-out-spread.json",
        &["fan-out", "--pub-url", &a, "--sub-url", &spread, "--subscribers", "4", "--rate", "2000"],
    );
    let stdout = assert_ok(&out);
    let sent = report["sent"].as_u64().unwrap();
    assert!(sent > 0, "{report}");
    assert_eq!(report["received"].as_u64(), Some(2 * sent), "{report}");
    assert_eq!(
        report["by_url"],
        serde_json::json!([
            {"url": a, "publishers": 1, "subscribers": 2, "received": 2 * sent},
            {"url": b, "publishers": 0, "subscribers": 2, "received": 0},
        ]),
        "{report}"
    );
    assert!(
        stdout.contains(&format!(
            "by broker    {a}: 1 publishers, 2 subscribers, received {}\n             {b}: 0 publishers, 2 subscribers, received 0\n",
            2 * sent
        )),
        "{stdout}"
    );
    assert!(
        stdout.contains(&format!("lost {} of {} deliveries at QoS 0", 2 * sent, 4 * sent)),
        "{stdout}"
    );
    // Fan-in: every publisher on A, the subscriber on B: nothing crosses,
    // and the run says so (exit 1), with the counts per broker.
    let fan_in = ["fan-in", "--publishers", "3", "--qos", "1", "--rate", "300"];
    let (out, report) = run(
        "fan-in-cross.json",
        &[&fan_in[..], &["--pub-url", &a, "--sub-url", &b]].concat(),
    );
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stdout));
    assert!(report["sent"].as_u64().unwrap() > 0, "{report}");
    assert_eq!(report["received"].as_u64(), Some(0));
    assert_eq!(
        report["by_url"],
        serde_json::json!([
            {"url": a, "publishers": 3, "subscribers": 0, "received": 0},
            {"url": b, "publishers": 0, "subscribers": 1, "received": 0},
        ])
    );
    assert!(
        report["check"].as_str().unwrap().contains("nothing was delivered"),
        "{report}"
    );
    assert_eq!(
        report["acked_total"], report["published_total"],
        "A acknowledged every publish: the publishers were on A"
    );
    // Both on B (--url A unused): everything arrives, and one URL in use
    // means no breakdown.
    let (out, report) = run(
        "fan-in-same.json",
        &[&fan_in[..], &["--url", &a, "--pub-url", &b, "--sub-url", &b]].concat(),
    );
    assert_ok(&out);
    assert_eq!(report["received"], report["sent"]);
    assert!(report.get("by_url").is_none(), "{report}");
}
