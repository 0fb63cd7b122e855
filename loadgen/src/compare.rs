//! `compare BASELINE.json CANDIDATE.json`: a table of the candidate against
//! the baseline and a verdict for CI.
//!
//! [`compare_files`] refuses what cannot be compared (exit status 2): a
//! file that is not a result of `run --json` or is larger than
//! [`MAX_RESULT_BYTES`], two results of different workloads
//! ([`Workload`]), a baseline that measured nothing.

use std::io::Read;
use std::path::Path;

use serde_json::Value;

/// The largest result file `compare` reads, bytes (64 MiB). A `--json`
/// result is a few KiB to a few hundred KiB (its histogram); anything
/// larger is not one, and a device such as `/dev/zero` must not be read
/// until memory runs out.
pub const MAX_RESULT_BYTES: u64 = 64 * 1024 * 1024;

/// Thresholds of `compare`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Thresholds {
    /// The candidate's p99 may exceed the baseline's by at most this
    /// fraction (0.10 = 10 %); at least 0 ([`parse_p99_regression`]).
    pub max_p99_regression: f64,
    /// The candidate's throughput must be at least this fraction of the
    /// baseline's; above 0 and at most 1 ([`parse_throughput_ratio`]).
    pub min_throughput_ratio: f64,
}

/// The figures of one report that `compare` looks at.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Figures {
    /// Delivered msg/s (or connections/s).
    pub throughput: f64,
    /// p50 latency, µs.
    pub p50: f64,
    /// p99 latency, µs.
    pub p99: f64,
    /// p99.9 latency, µs.
    pub p999: f64,
    /// Broker KiB per idle connection, when measured.
    pub kib_per_connection: Option<f64>,
}

impl Figures {
    /// Reads the figures of a `--json` report.
    ///
    /// # Errors
    /// When a field is missing (the file is not a loadgen report), or a
    /// figure is negative or not finite. The broker's KiB per connection
    /// may be negative (its RSS fell during the run) but must be finite.
    pub fn from_json(v: &Value) -> Result<Figures, String> {
        let num = |path: &[&str]| -> Result<f64, String> {
            let mut cur = v;
            for p in path {
                cur = cur
                    .get(p)
                    .ok_or_else(|| {
                        format!(
                            "missing field `{}`: not a result of `run --json`",
                            path.join(".")
                        )
                    })?;
            }
            let n = cur
                .as_f64()
                .ok_or_else(|| format!("field `{}` is not a number", path.join(".")))?;
            if !n.is_finite() || n < 0.0 {
                return Err(format!(
                    "field `{}` is {n}: figures must be finite and not negative",
                    path.join(".")
                ));
            }
            Ok(n)
        };
        let kib_per_connection = match v.pointer("/connections/broker_kib_per_connection") {
            None | Some(Value::Null) => None,
            Some(k) => match k.as_f64() {
                Some(k) if k.is_finite() => Some(k),
                _ => {
                    return Err(format!(
                        "field `connections.broker_kib_per_connection` is {k}, not a finite number"
                    ))
                }
            },
        };
        Ok(Figures {
            throughput: num(&["throughput_per_s"])?,
            p50: num(&["latency_us", "p50"])?,
            p99: num(&["latency_us", "p99"])?,
            p999: num(&["latency_us", "p999"])?,
            kib_per_connection,
        })
    }
}

/// What a result measured besides its figures: the scenario and the
/// options that change its figures. Two results are compared only when
/// their workloads are the same ([`Workload::differences`]); a fan-in
/// result against a fan-out one, or QoS 0 against QoS 1, says nothing about
/// a regression.
///
/// Flows (fan-in, fan-out, shared, persistent, soak) compare the protocol,
/// the transports, QoS, payload size, rate (and `--window` in closed loop),
/// publishers and subscribers (and `persistent`'s reconnect cycle);
/// `connect-storm` and `idle` compare the protocol, the transports,
/// `--connections` and `--connect-rate`. What a result does not record is
/// absent on that side. The duration, the warm-up, the broker's address
/// and the loadgen's own threads and CPUs may differ.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Workload {
    /// (what, value) in a fixed order; [`Value::Null`] when not recorded.
    fields: Vec<(&'static str, Value)>,
}

impl Workload {
    /// The workload of a `--json` report.
    pub fn from_json(v: &Value) -> Workload {
        let at = |pointer: &str| v.pointer(pointer).cloned().unwrap_or(Value::Null);
        let scenario = at("/scenario");
        let mut fields = vec![
            ("scenario", scenario.clone()),
            ("--protocol", at("/options/protocol")),
            ("transport", transports(&client_urls(v))),
        ];
        let connections = matches!(scenario.as_str(), Some("connect-storm" | "idle"));
        if connections {
            fields.push(("--connections", at("/options/connections")));
            fields.push(("--connect-rate", at("/options/connect_rate")));
            // Absent from the JSON of a loadgen before the option: 0.
            let window = at("/options/connect_window");
            fields.push(("--connect-window", if window.is_null() { 0.into() } else { window }));
        } else {
            let rate = at("/options/rate");
            let closed_loop = rate.as_str() == Some("max");
            fields.push(("--qos", at("/options/qos")));
            fields.push(("--payload-size", at("/options/payload_size")));
            fields.push(("--rate", rate));
            if closed_loop {
                fields.push(("--window", at("/options/window")));
            }
            fields.push(("publishers", at("/publishers")));
            fields.push(("subscribers", at("/subscribers")));
            if scenario.as_str() == Some("persistent") {
                fields.push(("--reconnect-every", at("/options/reconnect_every")));
                fields.push(("--offline-for", at("/options/offline_for")));
            }
        }
        Workload { fields }
    }

    /// How `other` differs from this workload, one `what: this vs other`
    /// per difference; empty when they are the same. Different scenarios
    /// are reported alone (their other options do not line up).
    pub fn differences(&self, other: &Workload) -> Vec<String> {
        let shown = |v: &Value| match v {
            Value::Null => "(not recorded)".to_string(),
            Value::String(s) => s.clone(),
            v => v.to_string(),
        };
        let get = |w: &Workload, what: &str| {
            w.fields
                .iter()
                .find(|(k, _)| *k == what)
                .map_or(Value::Null, |(_, v)| v.clone())
        };
        let scenario = (get(self, "scenario"), get(other, "scenario"));
        let names: Vec<&'static str> = if scenario.0 != scenario.1 {
            vec!["scenario"]
        } else {
            let mut names: Vec<&'static str> = self.fields.iter().map(|(k, _)| *k).collect();
            for (k, _) in &other.fields {
                if !names.contains(k) {
                    names.push(k);
                }
            }
            names
        };
        names
            .into_iter()
            .filter_map(|what| {
                let (a, b) = (get(self, what), get(other, what));
                (a != b).then(|| format!("{what}: {} vs {}", shown(&a), shown(&b)))
            })
            .collect()
    }
}

/// The URLs a result's clients used: `options.pub_urls` and
/// `options.sub_urls`, each `options.urls` when empty or not recorded
/// (a loadgen before `--pub-url`); [`Value::Null`] without `options.urls`.
fn client_urls(v: &Value) -> Value {
    let urls = v.pointer("/options/urls");
    let Some(default) = urls.and_then(Value::as_array) else {
        return Value::Null;
    };
    let used = |key: &str| match v.pointer(key).and_then(Value::as_array) {
        Some(l) if !l.is_empty() => l.clone(),
        _ => default.clone(),
    };
    let mut all = used("/options/pub_urls");
    all.extend(used("/options/sub_urls"));
    Value::Array(all)
}

/// The transports of a list of URLs: their schemes, aliases
/// folded (`tcp` is `mqtt`; `ssl` and `tls` are `mqtts`), sorted, each
/// once; [`Value::Null`] when the result records no URL.
fn transports(urls: &Value) -> Value {
    let Some(urls) = urls.as_array() else {
        return Value::Null;
    };
    let mut schemes: Vec<String> = urls
        .iter()
        .filter_map(Value::as_str)
        .map(|u| {
            let scheme = u
                .split_once("://")
                .map_or("", |(s, _)| s)
                .to_ascii_lowercase();
            match scheme.as_str() {
                "tcp" => "mqtt".to_string(),
                "ssl" | "tls" => "mqtts".to_string(),
                _ => scheme,
            }
        })
        .collect();
    schemes.sort();
    schemes.dedup();
    Value::String(schemes.join(","))
}

/// Reads the `--json` result at `path` as JSON, at most
/// [`MAX_RESULT_BYTES`]. A regular file or a pipe (`<(...)`) is read;
/// anything else (a directory, a device such as `/dev/zero`, a socket) is
/// refused without reading it.
///
/// # Errors
/// A message naming the file: it cannot be opened or read, is not a
/// regular file or a pipe, is larger than [`MAX_RESULT_BYTES`], or is not
/// JSON.
pub fn read_result(path: &Path) -> Result<Value, String> {
    use std::os::unix::fs::FileTypeExt;
    let name = path.display();
    let too_large = || {
        format!(
            "{name}: larger than {} MiB: not a result of `run --json`",
            MAX_RESULT_BYTES / (1024 * 1024)
        )
    };
    let check = |meta: &std::fs::Metadata| {
        let kind = meta.file_type();
        let what = if kind.is_file() || kind.is_fifo() {
            None
        } else if kind.is_dir() {
            Some("a directory")
        } else if kind.is_char_device() || kind.is_block_device() {
            Some("a device")
        } else {
            Some("a socket or other special file")
        };
        if let Some(what) = what {
            return Err(format!(
                "{name}: {what}, not a regular file: not a result of `run --json`"
            ));
        }
        if kind.is_file() && meta.len() > MAX_RESULT_BYTES {
            return Err(too_large());
        }
        Ok(())
    };
    // Checked before opening (opening a device can have effects of its
    // own) and again on what was opened.
    check(&std::fs::metadata(path).map_err(|e| format!("{name}: {e}"))?)?;
    let file = std::fs::File::open(path).map_err(|e| format!("{name}: {e}"))?;
    check(&file.metadata().map_err(|e| format!("{name}: {e}"))?)?;
    let mut bytes = Vec::new();
    file.take(MAX_RESULT_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("{name}: {e}"))?;
    if bytes.len() as u64 > MAX_RESULT_BYTES {
        return Err(too_large());
    }
    serde_json::from_slice(&bytes).map_err(|e| format!("{name}: not JSON: {e}"))
}

/// Reads two `--json` results and compares the candidate against the
/// baseline.
///
/// # Errors
/// Input that cannot be compared (exit status 2), with a message naming
/// the file: what [`read_result`] or [`Figures::from_json`] refuses, two
/// results of different workloads ([`Workload::differences`]), or a
/// baseline whose throughput is 0 (it measured nothing, so any candidate
/// would pass).
pub fn compare_files(baseline: &Path, candidate: &Path, t: &Thresholds) -> Result<Verdict, String> {
    let (b, c) = (read_result(baseline)?, read_result(candidate)?);
    let figures = |v: &Value, path: &Path| {
        Figures::from_json(v).map_err(|e| format!("{}: {e}", path.display()))
    };
    let (bf, cf) = (figures(&b, baseline)?, figures(&c, candidate)?);
    let differences = Workload::from_json(&b).differences(&Workload::from_json(&c));
    if !differences.is_empty() {
        return Err(format!(
            "{} and {} measure different workloads, so they cannot be compared: {}",
            baseline.display(),
            candidate.display(),
            differences.join("; ")
        ));
    }
    if bf.throughput == 0.0 {
        return Err(format!(
            "{}: the baseline's throughput_per_s is 0: it measured nothing, so there is \
             nothing to compare against",
            baseline.display()
        ));
    }
    Ok(compare(&bf, &cf, t))
}

/// The outcome of a comparison: the table and the regressions found.
#[derive(Debug, Clone, PartialEq)]
pub struct Verdict {
    /// Printable table.
    pub table: String,
    /// One line per regression; empty when the candidate passes.
    pub regressions: Vec<String>,
}

/// Compares `candidate` against `baseline`.
pub fn compare(baseline: &Figures, candidate: &Figures, t: &Thresholds) -> Verdict {
    let mut regressions = Vec::new();
    let ratio = |b: f64, c: f64| {
        if b > 0.0 {
            c / b
        } else if c > 0.0 {
            f64::INFINITY
        } else {
            1.0
        }
    };
    let throughput_ratio = ratio(baseline.throughput, candidate.throughput);
    if throughput_ratio < t.min_throughput_ratio {
        regressions.push(format!(
            "throughput {:.0}/s is {:.3} × the baseline's {:.0}/s (minimum {:.3})",
            candidate.throughput, throughput_ratio, baseline.throughput, t.min_throughput_ratio
        ));
    }
    let p99_ratio = ratio(baseline.p99, candidate.p99);
    // Both zero (no samples, e.g. idle) is not a regression; a baseline
    // of 0 µs against a candidate that has latency is (ratio infinite).
    if p99_ratio > 1.0 + t.max_p99_regression {
        regressions.push(format!(
            "p99 {} µs is {:+.1} % over the baseline's {} µs (maximum {:+.1} %)",
            candidate.p99,
            (p99_ratio - 1.0) * 100.0,
            baseline.p99,
            t.max_p99_regression * 100.0
        ));
    }
    let mut table = format!(
        "{:<22} {:>14} {:>14} {:>9}\n",
        "figure", "baseline", "candidate", "ratio"
    );
    let mut row = |name: &str, b: f64, c: f64| {
        table += &format!("{name:<22} {b:>14.1} {c:>14.1} {:>9.3}\n", ratio(b, c));
    };
    row("throughput /s", baseline.throughput, candidate.throughput);
    row("p50 µs", baseline.p50, candidate.p50);
    row("p99 µs", baseline.p99, candidate.p99);
    row("p99.9 µs", baseline.p999, candidate.p999);
    if let (Some(b), Some(c)) = (baseline.kib_per_connection, candidate.kib_per_connection) {
        row("KiB per connection", b, c);
    }
    Verdict { table, regressions }
}

/// Parses `10%` or `0.1` as a fraction: a finite number, at least 0.
///
/// # Errors
/// Not a number or a percentage, or negative.
pub fn parse_fraction(s: &str) -> Result<f64, String> {
    let (num, scale) = match s.strip_suffix('%') {
        Some(n) => (n, 100.0),
        None => (s, 1.0),
    };
    let v: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a number or percentage"))?;
    if !v.is_finite() || v < 0.0 {
        return Err(format!("`{s}` must be a non-negative number"));
    }
    Ok(v / scale)
}

/// Parses `--max-p99-regression`: a percentage of at least 0 % (`10%`,
/// `150%`) or a plain fraction from 0 to 1 (`0.1`). A plain number above 1
/// is refused: `10` would allow 1000 % where 10 % was meant.
///
/// # Errors
/// Not a number or a percentage, negative, or a plain number above 1.
pub fn parse_p99_regression(s: &str) -> Result<f64, String> {
    let range = "the allowed p99 increase must be at least 0 %, as a percentage (10%) \
                 or a fraction from 0 to 1 (0.1)";
    let v = parse_fraction(s).map_err(|_| format!("`{s}`: {range}"))?;
    if !s.ends_with('%') && v > 1.0 {
        let percent = format!("{:.4}", v * 100.0);
        let percent = percent.trim_end_matches('0').trim_end_matches('.');
        return Err(format!(
            "`{s}`: {range}; write {percent}% if an increase of {percent} % is meant"
        ));
    }
    Ok(v)
}

/// Parses `--min-throughput-ratio`: above 0 and at most 1, as a fraction
/// (`0.95`) or a percentage (`95%`). 0 would pass any candidate; above 1
/// would fail one exactly as fast as the baseline.
///
/// # Errors
/// Not a number or a percentage, or outside (0, 1].
pub fn parse_throughput_ratio(s: &str) -> Result<f64, String> {
    let range = "the candidate/baseline throughput ratio must be above 0 and at most 1 \
                 (0.95 or 95%)";
    match parse_fraction(s) {
        Ok(v) if v > 0.0 && v <= 1.0 => Ok(v),
        _ => Err(format!("`{s}`: {range}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Thresholds = Thresholds {
        max_p99_regression: 0.10,
        min_throughput_ratio: 0.95,
    };

    fn fig(throughput: f64, p99: f64) -> Figures {
        Figures {
            throughput,
            p99,
            ..Figures::default()
        }
    }

    #[test]
    fn a_candidate_within_both_thresholds_passes() {
        assert!(compare(&fig(1000.0, 100.0), &fig(950.0, 110.0), &T)
            .regressions
            .is_empty());
    }

    #[test]
    fn throughput_below_the_ratio_fails() {
        let v = compare(&fig(1000.0, 100.0), &fig(949.0, 100.0), &T);
        assert_eq!(v.regressions.len(), 1);
        assert!(v.regressions[0].starts_with("throughput"));
    }

    #[test]
    fn p99_beyond_the_regression_fails() {
        let v = compare(&fig(1000.0, 100.0), &fig(1000.0, 111.0), &T);
        assert_eq!(v.regressions.len(), 1);
        assert!(v.regressions[0].starts_with("p99"));
    }

    #[test]
    fn both_regressions_are_reported() {
        assert_eq!(
            compare(&fig(1000.0, 100.0), &fig(10.0, 1000.0), &T)
                .regressions
                .len(),
            2
        );
    }

    #[test]
    fn a_baseline_p99_of_zero_against_a_candidate_with_latency_is_a_regression() {
        let v = compare(&fig(1000.0, 0.0), &fig(1000.0, 1071.0), &T);
        assert_eq!(v.regressions.len(), 1);
        assert!(v.regressions[0].starts_with("p99"), "{:?}", v.regressions);
        // Both without latency samples (an idle run): no regression.
        assert!(compare(&fig(1000.0, 0.0), &fig(1000.0, 0.0), &T)
            .regressions
            .is_empty());
    }

    #[test]
    fn faster_and_lower_latency_passes() {
        assert!(compare(&fig(1000.0, 100.0), &fig(5000.0, 10.0), &T)
            .regressions
            .is_empty());
    }

    #[test]
    fn fractions_parse_as_percent_or_plain() {
        assert_eq!(parse_fraction("10%"), Ok(0.10));
        assert_eq!(parse_fraction("0.95"), Ok(0.95));
        assert!(parse_fraction("ten").is_err());
    }

    #[test]
    fn figures_are_read_from_a_report() {
        let v: Value = serde_json::json!({
            "throughput_per_s": 12.5,
            "latency_us": {"p50": 1, "p99": 2, "p999": 3},
            "connections": {"broker_kib_per_connection": 0.7}
        });
        let f = Figures::from_json(&v).unwrap();
        assert_eq!(f.throughput, 12.5);
        assert_eq!(f.p99, 2.0);
        assert_eq!(f.kib_per_connection, Some(0.7));
        assert!(Figures::from_json(&serde_json::json!({})).is_err());
    }

    #[test]
    fn negative_figures_are_bad_input() {
        let mut v: Value = serde_json::json!({
            "throughput_per_s": 12.5,
            "latency_us": {"p50": 1, "p99": -2, "p999": 3}
        });
        let err = Figures::from_json(&v).unwrap_err();
        assert!(
            err.contains("latency_us.p99") && err.contains("negative"),
            "{err}"
        );
        v["latency_us"]["p99"] = 2.into();
        v["throughput_per_s"] = (-1.0).into();
        assert!(Figures::from_json(&v)
            .unwrap_err()
            .contains("throughput_per_s"));
        v["throughput_per_s"] = 1.into();
        v["connections"] = serde_json::json!({"broker_kib_per_connection": "x"});
        assert!(Figures::from_json(&v).is_err());
        // The broker's RSS may fall during an idle run.
        v["connections"] = serde_json::json!({"broker_kib_per_connection": -0.5});
        assert_eq!(
            Figures::from_json(&v).unwrap().kib_per_connection,
            Some(-0.5)
        );
    }

    #[test]
    fn the_throughput_ratio_must_be_above_0_and_at_most_1() {
        assert_eq!(parse_throughput_ratio("0.95"), Ok(0.95));
        assert_eq!(parse_throughput_ratio("95%"), Ok(0.95));
        assert_eq!(parse_throughput_ratio("1"), Ok(1.0));
        for bad in ["0", "0%", "-0.5", "95", "101%", "NaN", "inf", "ninety"] {
            let err = parse_throughput_ratio(bad).unwrap_err();
            assert!(err.contains("above 0 and at most 1"), "{bad}: {err}");
        }
    }

    #[test]
    fn the_p99_regression_must_be_at_least_0_and_a_plain_number_at_most_1() {
        assert_eq!(parse_p99_regression("0"), Ok(0.0));
        assert_eq!(parse_p99_regression("10%"), Ok(0.10));
        assert_eq!(parse_p99_regression("0.1"), Ok(0.1));
        assert_eq!(parse_p99_regression("250%"), Ok(2.5));
        for bad in ["-1%", "-0.1", "NaN", "inf", "ten"] {
            let err = parse_p99_regression(bad).unwrap_err();
            assert!(err.contains("at least 0 %"), "{bad}: {err}");
        }
        let err = parse_p99_regression("10").unwrap_err();
        assert!(err.contains("write 1000%"), "{err}");
    }

    fn report(scenario: &str, qos: u8, publishers: u64, throughput: f64) -> Value {
        serde_json::json!({
            "scenario": scenario,
            "options": {
                "urls": ["mqtt://127.0.0.1:1883"],
                "protocol": "3.1.1",
                "qos": qos,
                "payload_size": 64,
                "rate": "max",
                "window": 1000,
                "connections": 1000,
                "connect_rate": 2000
            },
            "publishers": publishers,
            "subscribers": 1,
            "throughput_per_s": throughput,
            "latency_us": {"p50": 1, "p99": 2, "p999": 3}
        })
    }

    #[test]
    fn results_of_different_workloads_differ_and_say_how() {
        let w = |v: &Value| Workload::from_json(v);
        let fan_in = w(&report("fan-in", 0, 10, 1.0));
        assert!(fan_in.differences(&fan_in.clone()).is_empty());
        assert_eq!(
            fan_in.differences(&w(&report("fan-out", 0, 10, 1.0))),
            ["scenario: fan-in vs fan-out"]
        );
        assert_eq!(
            fan_in.differences(&w(&report("fan-in", 1, 100, 1.0))),
            ["--qos: 0 vs 1", "publishers: 10 vs 100"]
        );
        let mut tls = report("fan-in", 0, 10, 1.0);
        tls["options"]["urls"] = serde_json::json!(["tls://a:1", "mqtts://b"]);
        assert_eq!(fan_in.differences(&w(&tls)), ["transport: mqtt vs mqtts"]);
        // --sub-url replaces --url for the subscribers: its scheme counts.
        let mut tls_subscribers = report("fan-in", 0, 10, 1.0);
        tls_subscribers["options"]["sub_urls"] = serde_json::json!(["mqtts://b"]);
        assert_eq!(
            fan_in.differences(&w(&tls_subscribers)),
            ["transport: mqtt vs mqtt,mqtts"]
        );
        let mut cross = report("fan-in", 0, 10, 1.0);
        cross["options"]["pub_urls"] = serde_json::json!(["mqtt://a:1"]);
        cross["options"]["sub_urls"] = serde_json::json!(["tcp://b:2"]);
        assert!(fan_in.differences(&w(&cross)).is_empty());
        let mut unrecorded = report("fan-in", 0, 10, 1.0);
        unrecorded["options"] = Value::Null;
        assert!(fan_in
            .differences(&w(&unrecorded))
            .contains(&"--qos: 0 vs (not recorded)".to_string()));
    }

    #[test]
    fn connection_scenarios_ignore_the_flow_options_and_compare_their_own() {
        let w = |v: &Value| Workload::from_json(v);
        let storm = report("connect-storm", 0, 0, 1.0);
        assert!(w(&storm)
            .differences(&w(&report("connect-storm", 1, 0, 1.0)))
            .is_empty());
        let mut faster = storm.clone();
        faster["options"]["connect_rate"] = 5000.into();
        assert_eq!(
            w(&storm).differences(&w(&faster)),
            ["--connect-rate: 2000 vs 5000"]
        );
    }

    /// A file in a folder of its own, removed on drop.
    struct TempFile(std::path::PathBuf);

    impl TempFile {
        fn new(name: &str, text: &str) -> TempFile {
            let dir =
                std::env::temp_dir().join(format!("loadgen-compare-{name}-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let path = dir.join(format!("{name}.json"));
            std::fs::write(&path, text).unwrap();
            TempFile(path)
        }
    }

    impl Drop for TempFile {
        fn drop(&mut self) {
            if let Some(dir) = self.0.parent() {
                let _ = std::fs::remove_dir_all(dir);
            }
        }
    }

    #[test]
    fn devices_directories_and_oversized_files_are_refused_unread() {
        let err = read_result(Path::new("/dev/zero")).unwrap_err();
        assert!(
            err.contains("/dev/zero: a device, not a regular file"),
            "{err}"
        );
        let err = read_result(&std::env::temp_dir()).unwrap_err();
        assert!(err.contains("a directory"), "{err}");
        let big = TempFile::new("big", "");
        // Sparse: nothing is written.
        std::fs::File::options()
            .write(true)
            .open(&big.0)
            .unwrap()
            .set_len(MAX_RESULT_BYTES + 1)
            .unwrap();
        let err = read_result(&big.0).unwrap_err();
        assert!(err.contains("larger than 64 MiB"), "{err}");
        let text = TempFile::new("text", "not json");
        assert!(read_result(&text.0).unwrap_err().contains("not JSON"));
    }

    #[test]
    fn a_pipe_is_read_like_a_file() {
        let dir = TempFile::new("fifo", "");
        let fifo = dir.0.with_extension("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: `c` is a NUL-terminated path that outlives the call.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let writer = {
            let fifo = fifo.clone();
            std::thread::spawn(move || std::fs::write(fifo, r#"{"a": 1}"#).unwrap())
        };
        assert_eq!(read_result(&fifo), Ok(serde_json::json!({"a": 1})));
        writer.join().unwrap();
    }

    #[test]
    fn a_baseline_that_measured_nothing_is_refused() {
        let empty = TempFile::new("empty", &report("fan-in", 0, 10, 0.0).to_string());
        let some = TempFile::new("some", &report("fan-in", 0, 10, 500.0).to_string());
        let err = compare_files(&empty.0, &some.0, &T).unwrap_err();
        assert!(err.contains("throughput_per_s is 0"), "{err}");
        let v = compare_files(&some.0, &empty.0, &T).unwrap();
        assert_eq!(
            v.regressions.len(),
            1,
            "a candidate that measured nothing regresses"
        );
    }

    #[test]
    fn results_of_different_scenarios_are_refused() {
        let fan_in = TempFile::new("fan-in", &report("fan-in", 0, 10, 500.0).to_string());
        let fan_out = TempFile::new("fan-out", &report("fan-out", 0, 10, 500.0).to_string());
        let err = compare_files(&fan_in.0, &fan_out.0, &T).unwrap_err();
        assert!(
            err.contains("different workloads") && err.contains("scenario: fan-in vs fan-out"),
            "{err}"
        );
        assert!(compare_files(&fan_in.0, &fan_in.0, &T).is_ok());
    }
}
