//! The loadgen over mqtts://, ws:// and wss:// against a broker with
//! `tls`, `ws` and `wss` listeners (certificates made here by rcgen, as
//! shards/tests/e2e/security.rs does), and the ways a secured connection
//! fails: each must exit non-zero at once with a message naming TLS or
//! the WebSocket upgrade.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};

use super::{assert_ok, loadgen, read_json, start_broker_set, temp_json, Broker};

/// A temporary folder, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!("loadgen-tls-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    /// Writes `text` to `name`; returns the path as a string.
    fn put(&self, name: &str, text: &str) -> String {
        let path = self.0.join(name);
        std::fs::write(&path, text).unwrap();
        path.display().to_string()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A certificate authority made for one test.
struct Ca {
    cert: rcgen::Certificate,
    key: KeyPair,
}

impl Ca {
    fn new(name: &str) -> Ca {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let key = KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        Ca { cert, key }
    }

    fn pem(&self) -> String {
        self.cert.pem()
    }

    /// A certificate for CN `cn` and `sans` (IP addresses become IP SANs):
    /// (certificate PEM, key PEM).
    fn issue(&self, cn: &str, sans: &[&str]) -> (String, String) {
        let sans: Vec<String> = sans.iter().map(|s| s.to_string()).collect();
        let mut params = CertificateParams::new(sans).unwrap();
        params.distinguished_name = rcgen::DistinguishedName::new();
        params.distinguished_name.push(DnType::CommonName, cn);
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.cert, &self.key).unwrap();
        (cert.pem(), key.serialize_pem())
    }
}

/// A broker with `tls`, `ws` and `wss` listeners (and the plain one)
/// serving `cert`, plus the settings `extra` (`key=value`).
fn secure_broker(dir: &TempDir, cert: &(String, String), extra: &[String]) -> Broker {
    let mut set = vec![
        r#"listeners.tls=["127.0.0.1:0"]"#.to_string(),
        r#"listeners.ws=["127.0.0.1:0"]"#.to_string(),
        r#"listeners.wss=["127.0.0.1:0"]"#.to_string(),
        format!("tls.cert={:?}", dir.put("server.pem", &cert.0)),
        format!("tls.key={:?}", dir.put("server.key", &cert.1)),
    ];
    set.extend_from_slice(extra);
    let set: Vec<&str> = set.iter().map(String::as_str).collect();
    start_broker_set("1", &set)
}

/// One URL per scheme, on `broker`'s listeners.
fn urls(broker: &Broker) -> [String; 4] {
    [
        format!("mqtt://127.0.0.1:{}", broker.port),
        format!("mqtts://127.0.0.1:{}", broker.port_of("mqtt-tls")),
        format!("ws://127.0.0.1:{}", broker.port_of("mqtt-ws")),
        format!("wss://127.0.0.1:{}", broker.port_of("mqtt-wss")),
    ]
}

/// `args`, then `--url U` for each of `urls`.
fn with_urls<'a>(args: &[&'a str], urls: &'a [String]) -> Vec<&'a str> {
    let mut all = args.to_vec();
    for u in urls {
        all.extend(["--url", u.as_str()]);
    }
    all
}

/// Runs the loadgen, expecting a failure within `within`; returns stderr.
fn fails_fast(args: &[&str], within: Duration) -> String {
    let started = Instant::now();
    let out = loadgen(args);
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
    assert!(
        started.elapsed() < within,
        "{args:?} took {:?}",
        started.elapsed()
    );
    stderr
}

#[test]
fn fan_in_at_qos_1_counts_every_message_over_mqtts_and_wss() {
    let dir = TempDir::new("fan-in");
    let ca = Ca::new("loadgen CA");
    let broker = secure_broker(&dir, &ca.issue("broker", &["127.0.0.1", "localhost"]), &[]);
    let ca_file = dir.put("ca.pem", &ca.pem());
    let [_, mqtts, _, wss] = urls(&broker);
    for url in [mqtts, wss] {
        let json = temp_json(&format!("fan-in-{}.json", &url[..url.find(':').unwrap()]));
        let out = loadgen(&[
            "run",
            "fan-in",
            "--url",
            &url,
            "--ca-file",
            &ca_file,
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
        assert_ok(&out);
        let r = read_json(&json);
        let n = |k: &str| r[k].as_u64().unwrap_or_else(|| panic!("{k} in {r}"));
        assert!(n("sent") > 0, "{url}: {r}");
        assert_eq!(n("sent"), n("received"), "{url}: {r}");
        assert_eq!(n("expected"), n("received"), "{url}: {r}");
        assert_eq!(n("acked_total"), n("published_total"), "{url}: {r}");
        assert_eq!(r["check"], "ok", "{url}");
        let _ = std::fs::remove_file(&json);
    }
}

#[test]
fn every_scenario_runs_with_clients_spread_over_all_four_schemes() {
    let dir = TempDir::new("all");
    let ca = Ca::new("loadgen CA");
    let broker = secure_broker(&dir, &ca.issue("broker", &["127.0.0.1"]), &[]);
    let urls = urls(&broker);
    // Four publishers and four subscribers: one of each per scheme.
    let flow = ["--qos", "1", "--publishers", "4", "--subscribers", "4"];
    let runs: [&[&str]; 6] = [
        &["run", "fan-out", "--duration", "1s", "--warmup", "200ms"],
        &["run", "shared", "--duration", "1s"],
        &[
            "run",
            "persistent",
            "--rate",
            "1000",
            "--duration",
            "2s",
            "--reconnect-every",
            "700ms",
            "--offline-for",
            "300ms",
        ],
        &[
            "soak",
            "--rate",
            "1000",
            "--duration",
            "1s",
            "--report-every",
            "1s",
        ],
        &["run", "connect-storm", "--connections", "40"],
        &[
            "run",
            "idle",
            "--connections",
            "8",
            "--keep-alive",
            "2",
            "--duration",
            "1500ms",
        ],
    ];
    for (i, run) in runs.into_iter().enumerate() {
        let json = temp_json(&format!("all-{i}.json"));
        let mut args = with_urls(run, &urls);
        if i < 4 {
            args.extend(flow);
        }
        // --insecure: the broker's CA is not given.
        args.extend(["--insecure", "--json", json.to_str().unwrap()]);
        assert_ok(&loadgen(&args));
        let r = read_json(&json);
        assert_eq!(r["check"], "ok", "{args:?}: {r}");
        assert!(r["errors"].as_object().is_none_or(|e| e.is_empty()), "{r}");
        if let Some(v) = r.get("verify").filter(|v| !v.is_null()) {
            assert_eq!(v["missing"], 0, "{args:?}: {r}");
            assert!(v["published"].as_u64().unwrap() > 0, "{r}");
        } else if let Some(c) = r.get("connections").filter(|c| !c.is_null()) {
            assert_eq!(c["connected"], c["target"], "{args:?}: {r}");
        } else {
            assert!(r["sent"].as_u64().unwrap() > 0, "{r}");
            assert_eq!(r["received"], r["expected"], "{args:?}: {r}");
        }
        let _ = std::fs::remove_file(&json);
    }
}

#[test]
fn a_broker_certificate_from_an_unknown_ca_exits_1_naming_tls() {
    let dir = TempDir::new("wrong-ca");
    let ca = Ca::new("loadgen CA");
    let broker = secure_broker(&dir, &ca.issue("broker", &["127.0.0.1"]), &[]);
    let other = dir.put("other.pem", &Ca::new("another CA").pem());
    let [_, mqtts, _, wss] = urls(&broker);
    for url in [&mqtts, &wss] {
        for command in [&["run", "fan-in"][..], &["soak"][..]] {
            let mut args = command.to_vec();
            args.extend(["--url", url, "--ca-file", &other, "--duration", "1s"]);
            let stderr = fails_fast(&args, Duration::from_secs(10));
            assert!(
                stderr.contains("TLS handshake failed"),
                "{args:?}: {stderr}"
            );
            assert!(stderr.contains("UnknownIssuer"), "{args:?}: {stderr}");
        }
    }
}

#[test]
fn a_certificate_for_another_name_exits_1_naming_tls() {
    let dir = TempDir::new("wrong-name");
    let ca = Ca::new("loadgen CA");
    let broker = secure_broker(&dir, &ca.issue("broker", &["broker.example"]), &[]);
    let ca_file = dir.put("ca.pem", &ca.pem());
    let [_, mqtts, _, wss] = urls(&broker);
    for url in [&mqtts, &wss] {
        let args = ["run", "fan-in", "--url", url, "--ca-file", &ca_file];
        let stderr = fails_fast(&args, Duration::from_secs(10));
        assert!(stderr.contains("TLS handshake failed"), "{stderr}");
        assert!(stderr.contains("not valid for name"), "{stderr}");
    }
}

#[test]
fn a_refused_websocket_upgrade_exits_1_with_its_http_status() {
    let dir = TempDir::new("ws-refused");
    let ca = Ca::new("loadgen CA");
    let broker = secure_broker(&dir, &ca.issue("broker", &["127.0.0.1"]), &[]);
    let ws = format!("ws://127.0.0.1:{}/not-mqtt", broker.port_of("mqtt-ws"));
    let wss = format!("wss://127.0.0.1:{}", broker.port_of("mqtt-wss"));
    for args in [
        &["run", "fan-in", "--url", &ws][..],
        &["soak", "--url", &ws][..],
        &[
            "run",
            "fan-in",
            "--url",
            &wss,
            "--insecure",
            "--ws-path",
            "/x",
        ][..],
        &[
            "run",
            "connect-storm",
            "--connections",
            "20",
            "--url",
            &wss,
            "--insecure",
            "--ws-path",
            "/x",
        ][..],
    ] {
        let stderr = fails_fast(args, Duration::from_secs(10));
        assert!(
            stderr.contains("WebSocket upgrade failed"),
            "{args:?}: {stderr}"
        );
        assert!(stderr.contains("HTTP 404"), "{args:?}: {stderr}");
    }
}

#[test]
fn the_wrong_protocol_on_a_port_fails_fast_instead_of_hanging() {
    let dir = TempDir::new("mismatch");
    let ca = Ca::new("loadgen CA");
    let broker = secure_broker(&dir, &ca.issue("broker", &["127.0.0.1"]), &[]);
    let plain = broker.port;
    let tls = broker.port_of("mqtt-tls");
    for (url, names) in [
        (format!("mqtts://127.0.0.1:{plain}"), "TLS"),
        (format!("wss://127.0.0.1:{plain}"), "TLS"),
        (format!("ws://127.0.0.1:{plain}"), "WebSocket"),
        (format!("ws://127.0.0.1:{tls}"), "WebSocket"),
    ] {
        for command in [&["run", "fan-in"][..], &["soak"][..]] {
            let mut args = command.to_vec();
            args.extend(["--url", &url, "--insecure", "--connect-timeout", "2s"]);
            let stderr = fails_fast(&args, Duration::from_secs(10));
            assert!(stderr.contains(names), "{args:?}: {stderr}");
        }
    }
}

#[test]
fn mutual_tls_connects_with_the_client_certificate_and_fails_without() {
    let dir = TempDir::new("mtls");
    let ca = Ca::new("loadgen CA");
    let clients = Ca::new("clients CA");
    let extra = [
        format!("tls.client_ca={:?}", dir.put("clients.pem", &clients.pem())),
        "tls.require_client_cert=true".to_string(),
    ];
    let broker = secure_broker(&dir, &ca.issue("broker", &["127.0.0.1"]), &extra);
    let ca_file = dir.put("ca.pem", &ca.pem());
    let device = clients.issue("device-1", &[]);
    let cert = dir.put("device.pem", &device.0);
    let key = dir.put("device.key", &device.1);
    let [_, mqtts, _, wss] = urls(&broker);
    for url in [&mqtts, &wss] {
        let base = ["--url", url, "--ca-file", &ca_file];
        let mut ok = vec!["run", "connect-storm", "--connections", "5"];
        ok.extend(base);
        ok.extend(["--cert", &cert, "--key", &key]);
        assert_ok(&loadgen(&ok));
        let mut soak = vec!["soak", "--duration", "1s", "--rate", "200"];
        soak.extend(base);
        soak.extend(["--cert", &cert, "--key", &key]);
        assert_ok(&loadgen(&soak));
        let mut without = vec!["run", "fan-in"];
        without.extend(base);
        let stderr = fails_fast(&without, Duration::from_secs(10));
        assert!(stderr.contains("TLS"), "{stderr}");
    }
}

#[test]
fn tls_options_that_do_not_load_exit_2() {
    let dir = TempDir::new("bad-options");
    let pem = dir.put("empty.pem", "");
    for args in [
        &[
            "run",
            "fan-in",
            "--url",
            "mqtts://127.0.0.1:1",
            "--ca-file",
            "/nonexistent.pem",
        ][..],
        &["soak", "--url", "wss://127.0.0.1:1", "--ca-file", &pem][..],
        &["run", "fan-in", "--cert", &pem][..],
        &["run", "fan-in", "--ca-file", &pem, "--insecure"][..],
        &["run", "fan-in", "--url", "mqtt://127.0.0.1:1/path"][..],
        &[
            "run",
            "fan-in",
            "--url",
            "ws://127.0.0.1:1",
            "--ws-path",
            "mqtt",
        ][..],
    ] {
        let out = loadgen(args);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
