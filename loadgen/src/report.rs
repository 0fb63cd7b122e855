//! The result of a run: a human summary on stdout and the `--json` file
//! (figures, the serialized histogram, run metadata).

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::latency::{Latency, LatencySummary};
use crate::options::RunArgs;

/// Connection figures of `connect-storm` and `idle`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ConnectionFigures {
    /// Connections asked for.
    pub target: u64,
    /// Connections that got a successful CONNACK.
    pub connected: u64,
    /// Connections that failed.
    pub failed: u64,
    /// connect-storm: successful connections per second.
    pub connect_per_s: f64,
    /// idle: the broker's RSS before connecting, KiB.
    pub broker_rss_before_kib: Option<u64>,
    /// idle: the broker's RSS with every connection open, KiB.
    pub broker_rss_after_kib: Option<u64>,
    /// idle: (after − before) / connected, KiB.
    pub broker_kib_per_connection: Option<f64>,
}

/// The clients of a flow that connected to one broker URL, and what its
/// subscribers received.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UrlFigures {
    /// The URL as given.
    pub url: String,
    /// Publishers connected to it.
    pub publishers: usize,
    /// Subscribers connected to it.
    pub subscribers: usize,
    /// Deliveries of measured messages to its subscribers.
    pub received: u64,
}

/// Per broker URL (in the order first named, publishers' URLs first): the
/// clients on it and what its subscribers received, from each subscriber's
/// measured deliveries (`received[j]` for subscriber j). Empty when every
/// client used one URL.
pub fn by_url(urls: &crate::options::Urls, publishers: usize, received: &[u64]) -> Vec<UrlFigures> {
    let mut out: Vec<UrlFigures> = Vec::new();
    let mut at = |url: &str| -> usize {
        if let Some(k) = out.iter().position(|f| f.url == url) {
            return k;
        }
        out.push(UrlFigures {
            url: url.to_string(),
            publishers: 0,
            subscribers: 0,
            received: 0,
        });
        out.len() - 1
    };
    let mut slots = Vec::new();
    for i in 0..publishers {
        slots.push((at(&urls.publisher(i).text), None));
    }
    for (j, n) in received.iter().enumerate() {
        slots.push((at(&urls.subscriber(j).text), Some(*n)));
    }
    for (k, received) in slots {
        match received {
            None => out[k].publishers += 1,
            Some(n) => {
                out[k].subscribers += 1;
                out[k].received += n;
            }
        }
    }
    if out.len() < 2 {
        out.clear();
    }
    out
}

/// Everything `--json` writes; `compare` reads it back.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    /// "fleetmq-loadgen".
    pub tool: String,
    /// The loadgen's version.
    pub version: String,
    /// The scenario's name.
    pub scenario: String,
    /// When the run ended, seconds since the Unix epoch.
    pub timestamp_unix_s: u64,
    /// CPUs of the machine.
    pub machine_cores: usize,
    /// The options of the run.
    pub options: serde_json::Value,
    /// Length of the measured interval, seconds.
    pub measured_s: f64,
    /// Publishers.
    pub publishers: usize,
    /// Subscribers.
    pub subscribers: usize,
    /// Messages sent stamped inside the measured interval.
    pub sent: u64,
    /// Deliveries expected for them (sent × subscribers).
    pub expected: u64,
    /// Deliveries received of them.
    pub received: u64,
    /// Messages published in total, warm-up and drain included.
    pub published_total: u64,
    /// PUBACK/PUBCOMP received in total (QoS 1/2).
    pub acked_total: u64,
    /// sent / measured_s.
    pub sent_per_s: f64,
    /// received / measured_s: delivered messages per second.
    pub received_per_s: f64,
    /// The figure `compare` checks: received_per_s, or connect_per_s for
    /// connect-storm.
    pub throughput_per_s: f64,
    /// End-to-end latency (flows) or CONNACK latency (connections), µs.
    pub latency_us: LatencySummary,
    /// The latency histogram, hdrhistogram V2, base64.
    pub histogram_v2_base64: String,
    /// Publish-to-acknowledgement latency (PUBACK at QoS 1, PUBREC at QoS
    /// 2) of the measured messages, µs; absent at QoS 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ack_latency_us: Option<LatencySummary>,
    /// Errors by kind.
    pub errors: BTreeMap<String, u64>,
    /// Flows whose clients used more than one broker URL (`--url`,
    /// `--pub-url`, `--sub-url`): the clients and deliveries per URL.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub by_url: Vec<UrlFigures>,
    /// Connection figures (connect-storm, idle).
    pub connections: Option<ConnectionFigures>,
    /// Per-message accounting of `persistent`, `shared` and `soak`.
    #[serde(default)]
    pub verify: Option<crate::verify::VerifyFigures>,
    /// "ok", or what went wrong (loss, missing acks).
    pub check: String,
    /// False when the run must exit non-zero: loss or missing acks at
    /// QoS 1/2, nothing sent, no connection made. Loss at QoS 0 is reported
    /// but passes.
    pub passed: bool,
}

impl Report {
    /// A report with the metadata filled and every figure zero.
    pub fn new(args: &RunArgs, latency: &Latency) -> Report {
        let scenario = serde_json::to_value(args.scenario)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default();
        let mut options = serde_json::to_value(args).unwrap_or(serde_json::Value::Null);
        // The prefix the clients used, also when it was the default.
        if let Some(o) = options.as_object_mut() {
            o.insert("client_id_prefix".into(), args.client_id_prefix().into());
        }
        Report::with_meta(&scenario, options, args.duration, latency)
    }

    /// A report for `scenario` with these options, every figure zero.
    pub fn with_meta(
        scenario: &str,
        options: serde_json::Value,
        measured: std::time::Duration,
        latency: &Latency,
    ) -> Report {
        Report {
            tool: "fleetmq-loadgen".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            scenario: scenario.to_string(),
            timestamp_unix_s: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            machine_cores: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            options,
            measured_s: measured.as_secs_f64(),
            publishers: 0,
            subscribers: 0,
            sent: 0,
            expected: 0,
            received: 0,
            published_total: 0,
            acked_total: 0,
            sent_per_s: 0.0,
            received_per_s: 0.0,
            throughput_per_s: 0.0,
            latency_us: latency.summary(),
            histogram_v2_base64: latency.to_base64(),
            ack_latency_us: None,
            errors: BTreeMap::new(),
            by_url: Vec::new(),
            connections: None,
            verify: None,
            check: "ok".into(),
            passed: true,
        }
    }

    /// The human summary.
    pub fn summary(&self) -> String {
        let mut s = String::new();
        let l = &self.latency_us;
        // Connection scenarios measure their connect phase (then `idle`
        // holds the connections for --duration); the others, --duration.
        let measured = if self.connections.is_some() { "to connect" } else { "measured" };
        s += &format!(
            "scenario {}  ({:.1} s {measured})\n",
            self.scenario, self.measured_s
        );
        if let Some(c) = &self.connections {
            s += &format!(
                "connections  {} of {} connected, {} failed",
                c.connected, c.target, c.failed
            );
            if c.connect_per_s > 0.0 {
                s += &format!(", {:.0} connections/s", c.connect_per_s);
            }
            s += "\n";
            if let (Some(b), Some(a), Some(k)) = (
                c.broker_rss_before_kib,
                c.broker_rss_after_kib,
                c.broker_kib_per_connection,
            ) {
                s += &format!(
                    "broker RSS   {b} KiB before, {a} KiB after: {k:.2} KiB per connection\n"
                );
                if a < b {
                    // Seen right after another run: the broker was still
                    // giving back that run's memory.
                    s += "             (the broker's RSS fell during the run: it was still \
                          returning memory from earlier work; measure a broker that has \
                          been idle a few seconds, or a fresh one)\n";
                }
            }
            s += "CONNACK latency (µs)\n";
        } else {
            s += &format!(
                "clients      {} publishers, {} subscribers\n\
                 sent         {} ({:.0} msg/s)\n\
                 received     {} of {} expected ({:.0} msg/s)\n",
                self.publishers,
                self.subscribers,
                self.sent,
                self.sent_per_s,
                self.received,
                self.expected,
                self.received_per_s
            );
            if self.acked_total > 0 {
                s += &format!(
                    "acked        {} of {} published (warm-up and drain included)\n",
                    self.acked_total, self.published_total
                );
            }
            s += "latency (µs, from the scheduled send time when --rate is a number)\n";
        }
        s += &format!(
            "  p50 {}  p90 {}  p99 {}  p99.9 {}  max {}  (mean {:.1}, {} samples)\n",
            l.p50, l.p90, l.p99, l.p999, l.max, l.mean, l.count
        );
        if let Some(a) = &self.ack_latency_us {
            s += &format!(
                "publish to PUBACK/PUBREC (µs)\n  p50 {}  p90 {}  p99 {}  p99.9 {}  max {}  (mean {:.1}, {} samples)\n",
                a.p50, a.p90, a.p99, a.p999, a.max, a.mean, a.count
            );
        }
        for (k, u) in self.by_url.iter().enumerate() {
            s += &format!(
                "{}{}: {} publishers, {} subscribers, received {}\n",
                if k == 0 { "by broker    " } else { "             " },
                u.url,
                u.publishers,
                u.subscribers,
                u.received
            );
        }
        if let Some(v) = &self.verify {
            s += &format!(
                "checked      {} distinct received, {} missing, {} acknowledged but never received, {} duplicates (QoS 1: {}, QoS 2: {}), {} order violations ({} deliveries)\n",
                v.received_distinct,
                v.missing,
                v.lost_acknowledged,
                v.duplicates,
                v.duplicates_qos1,
                v.duplicates_qos2,
                v.order_violations,
                v.deliveries
            );
            if v.reconnects > 0 || v.sessions_lost > 0 {
                s += &format!(
                    "sessions     {} reconnects, {} sessions lost\n",
                    v.reconnects, v.sessions_lost
                );
            }
            if v.per_subscriber.len() > 1 {
                let list: Vec<String> = v.per_subscriber.iter().map(u64::to_string).collect();
                s += &format!("per member   {}\n", list.join(" "));
            }
        }
        if self.errors.is_empty() {
            s += "errors       none\n";
        } else {
            s += "errors\n";
            for (kind, n) in &self.errors {
                s += &format!("  {kind}: {n}\n");
            }
        }
        s += &format!("check        {}\n", self.check);
        s
    }
}

/// The `--json` file, opened before the run: a path that cannot be written
/// (a missing folder, no permission, a directory) fails at once, not after
/// the whole run. An existing file keeps its content until
/// [`JsonFile::write`]; a file this created is removed again by
/// [`JsonFile::discard`] when the run produced no report.
#[derive(Debug)]
pub struct JsonFile {
    path: PathBuf,
    file: File,
    /// [`JsonFile::create`] made the file.
    created: bool,
}

impl JsonFile {
    /// Opens `path` for writing, creating it when missing.
    ///
    /// # Errors
    /// When the file cannot be created or opened for writing; the message
    /// names the path.
    pub fn create(path: &Path) -> anyhow::Result<JsonFile> {
        let fail = |e: std::io::Error| anyhow::anyhow!("cannot write {}: {e}", path.display());
        let (file, created) = match File::options().write(true).create_new(true).open(path) {
            Ok(file) => (file, true),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                (File::options().write(true).open(path).map_err(fail)?, false)
            }
            Err(e) => return Err(fail(e)),
        };
        Ok(JsonFile {
            path: path.to_path_buf(),
            file,
            created,
        })
    }

    /// Replaces the file's content with `report` as pretty JSON.
    ///
    /// # Errors
    /// When the file cannot be written.
    pub fn write(mut self, report: &Report) -> anyhow::Result<()> {
        let text = serde_json::to_string_pretty(report)? + "\n";
        let fail = |e: std::io::Error| anyhow::anyhow!("cannot write {}: {e}", self.path.display());
        // Not a regular file (`/dev/stdout`, a pipe): nothing to truncate.
        if self.file.metadata().map_err(fail)?.is_file() {
            self.file.set_len(0).map_err(fail)?;
        }
        self.file.write_all(text.as_bytes()).map_err(fail)
    }

    /// Removes the file again if [`JsonFile::create`] made it.
    pub fn discard(self) {
        if self.created {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Connections that failed mid-run: the broker closed them or sent
/// DISCONNECT, their socket failed, or the broker sent a malformed or
/// unexpected packet (errors of those kinds in `errors`). A broker that
/// drops its clients or breaks the protocol is unusable, whatever the QoS
/// (exit status 1).
pub fn failed_mid_run(errors: &BTreeMap<String, u64>) -> u64 {
    [
        "closed by broker",
        "disconnected by broker",
        "socket error",
        "malformed packet",
        "unexpected packet",
    ]
        .iter()
        .filter_map(|kind| errors.get(*kind))
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn idle_report(before: u64, after: u64) -> Report {
        let mut r = Report::with_meta("idle", serde_json::Value::Null, std::time::Duration::from_secs(1), &Latency::default());
        r.connections = Some(ConnectionFigures {
            target: 100,
            connected: 100,
            broker_rss_before_kib: Some(before),
            broker_rss_after_kib: Some(after),
            broker_kib_per_connection: Some((after as f64 - before as f64) / 100.0),
            ..Default::default()
        });
        r
    }

    #[test]
    fn the_options_name_the_client_id_prefix_used_also_by_default() {
        use clap::Parser;
        let args = crate::options::tests::Cli::try_parse_from(["x", "fan-in"]).unwrap().run;
        let report = Report::new(&args, &Latency::default());
        assert_eq!(report.options["client_id_prefix"], format!("lg{}", std::process::id()));
    }

    #[test]
    fn a_broker_whose_rss_fell_during_an_idle_run_is_pointed_out() {
        let fell = idle_report(12_772, 12_704).summary();
        assert!(fell.contains("-0.68 KiB per connection"), "{fell}");
        assert!(fell.contains("the broker's RSS fell during the run"), "{fell}");
        let grew = idle_report(8_000, 8_064).summary();
        assert!(grew.contains("0.64 KiB per connection"), "{grew}");
        assert!(!grew.contains("fell"), "{grew}");
    }

    #[test]
    fn a_json_path_in_a_missing_folder_fails_before_anything_runs() {
        let path = std::env::temp_dir()
            .join(format!("loadgen-no-such-folder-{}", std::process::id()))
            .join("x.json");
        let err = JsonFile::create(&path).unwrap_err().to_string();
        assert!(
            err.starts_with(&format!("cannot write {}: ", path.display())),
            "{err}"
        );
        assert!(
            JsonFile::create(&std::env::temp_dir()).is_err(),
            "a directory"
        );
    }

    #[test]
    fn a_json_file_is_replaced_on_write_and_removed_on_discard_only_if_new() {
        let dir = std::env::temp_dir().join(format!("loadgen-json-file-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (old, new) = (dir.join("old.json"), dir.join("new.json"));
        std::fs::write(&old, "x".repeat(100_000)).unwrap();
        JsonFile::create(&old).unwrap().discard();
        assert_eq!(
            std::fs::read_to_string(&old).unwrap().len(),
            100_000,
            "kept"
        );
        JsonFile::create(&new).unwrap().discard();
        assert!(
            !new.exists(),
            "a file made for a run that failed is removed"
        );
        let r = idle_report(8_000, 8_064);
        JsonFile::create(&old).unwrap().write(&r).unwrap();
        let back: Report = serde_json::from_str(&std::fs::read_to_string(&old).unwrap()).unwrap();
        assert_eq!(back.scenario, "idle");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn figures_by_url_count_each_client_where_it_connected() {
        use clap::Parser;
        let args = |extra: &[&str]| {
            let mut argv = vec!["x", "fan-out"];
            argv.extend_from_slice(extra);
            crate::options::tests::Cli::try_parse_from(argv).unwrap().run
        };
        let one = args(&["--url", "mqtt://127.0.0.1:1"]);
        assert!(by_url(&one.client_urls(), 1, &[5, 5]).is_empty(), "one URL: no breakdown");
        let cross = args(&[
            "--pub-url",
            "mqtt://127.0.0.1:1",
            "--sub-url",
            "mqtt://127.0.0.1:1,mqtt://127.0.0.1:2",
        ]);
        let figures = by_url(&cross.client_urls(), 2, &[10, 0, 10, 0, 10]);
        let row = |url: &str, publishers, subscribers, received| UrlFigures {
            url: url.into(),
            publishers,
            subscribers,
            received,
        };
        assert_eq!(
            figures,
            [row("mqtt://127.0.0.1:1", 2, 3, 30), row("mqtt://127.0.0.1:2", 0, 2, 0)]
        );
        let mut r = Report::with_meta("fan-out", serde_json::Value::Null, std::time::Duration::from_secs(1), &Latency::default());
        r.by_url = figures;
        let text = r.summary();
        assert!(
            text.contains("by broker    mqtt://127.0.0.1:1: 2 publishers, 3 subscribers, received 30\n             mqtt://127.0.0.1:2: 0 publishers, 2 subscribers, received 0\n"),
            "{text}"
        );
    }

    #[test]
    fn acked_says_it_counts_the_warm_up_too() {
        let mut r = Report::with_meta("fan-in", serde_json::Value::Null, std::time::Duration::from_secs(1), &Latency::default());
        r.published_total = 40;
        r.acked_total = 40;
        r.sent = 30;
        assert!(r.summary().contains("acked        40 of 40 published (warm-up and drain included)"));
    }
}
