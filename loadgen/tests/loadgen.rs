//! End-to-end tests of `fleetmq-loadgen` against a real `fleetmq` broker.
//!
//! The broker binary is `$CARGO_TARGET_DIR/<profile>/fleetmq` (default
//! `<workspace>/target`), built with `cargo build -p fleetmq-shards` when
//! missing. Each test starts its own broker on port 0 and kills it on drop.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// A broker process, killed on drop.
struct Broker {
    child: Child,
    port: u16,
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
    let mut child = Command::new(broker_binary())
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--admin",
            "",
            "--shards",
            "1",
            "--set",
            "store.kind=none",
        ])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("the broker starts");
    let stdout = child.stdout.take().expect("piped stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut port = None;
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(addr) = line.strip_prefix("fleetmq: listening mqtt-tcp ") {
                port = addr
                    .rsplit(':')
                    .next()
                    .and_then(|p| p.trim().parse::<u16>().ok());
            }
            if line.trim() == "fleetmq: ready" {
                let _ = tx.send(port);
            }
        }
    });
    let mut broker = Broker { child, port: 0 };
    match rx.recv_timeout(Duration::from_secs(30)) {
        Ok(Some(port)) => broker.port = port,
        other => panic!("the broker did not announce its port and readiness: {other:?}"),
    }
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
    // Bind then drop a listener: a port nothing listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let started = std::time::Instant::now();
    let out = loadgen(&[
        "run",
        "fan-in",
        "--url",
        &format!("mqtt://127.0.0.1:{port}"),
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
