//! `compare BASELINE.json CANDIDATE.json`: a table of the candidate against
//! the baseline and a verdict for CI.

use serde_json::Value;

/// Thresholds of `compare`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Thresholds {
    /// The candidate's p99 may exceed the baseline's by at most this
    /// fraction (0.10 = 10 %).
    pub max_p99_regression: f64,
    /// The candidate's throughput must be at least this fraction of the
    /// baseline's.
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
    /// When a field is missing: the file is not a loadgen report.
    pub fn from_json(v: &Value) -> Result<Figures, String> {
        let num = |path: &[&str]| -> Result<f64, String> {
            let mut cur = v;
            for p in path {
                cur = cur
                    .get(p)
                    .ok_or_else(|| format!("missing field `{}`", path.join(".")))?;
            }
            cur.as_f64()
                .ok_or_else(|| format!("field `{}` is not a number", path.join(".")))
        };
        Ok(Figures {
            throughput: num(&["throughput_per_s"])?,
            p50: num(&["latency_us", "p50"])?,
            p99: num(&["latency_us", "p99"])?,
            p999: num(&["latency_us", "p999"])?,
            kib_per_connection: v
                .pointer("/connections/broker_kib_per_connection")
                .and_then(Value::as_f64),
        })
    }
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
    // Both zero (no samples, e.g. idle) is not a regression.
    if baseline.p99 > 0.0 && p99_ratio > 1.0 + t.max_p99_regression {
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

/// Parses `10%` or `0.1` as a fraction.
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
}
