//! Latency histograms in microseconds: one per executor while running,
//! merged at the end, serialized as hdrhistogram V2 in base64.

use base64::Engine;
use hdrhistogram::serialization::{Deserializer, Serializer, V2Serializer};
use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

/// The highest latency recorded, µs (60 s); anything above counts as this.
pub const MAX_LATENCY_US: u64 = 60_000_000;

/// A latency histogram, µs, 3 significant digits.
#[derive(Debug, Clone)]
pub struct Latency(Histogram<u64>);

impl Default for Latency {
    fn default() -> Self {
        Latency(Histogram::new_with_bounds(1, MAX_LATENCY_US, 3).expect("valid histogram bounds"))
    }
}

impl Latency {
    /// Records one latency given in ns (rounded up to whole µs, at least 1).
    pub fn record_ns(&mut self, ns: u64) {
        self.0
            .saturating_record(ns.div_ceil(1000).clamp(1, MAX_LATENCY_US));
    }

    /// Adds every value of `other` to this histogram.
    pub fn merge(&mut self, other: &Latency) {
        // Same bounds on both sides: `add` cannot fail.
        let _ = self.0.add(&other.0);
    }

    /// Number of recorded values.
    pub fn count(&self) -> u64 {
        self.0.len()
    }

    /// The summary of percentiles, µs.
    pub fn summary(&self) -> LatencySummary {
        let h = &self.0;
        let empty = h.is_empty();
        let q = |q: f64| if empty { 0 } else { h.value_at_quantile(q) };
        LatencySummary {
            count: h.len(),
            min: if empty { 0 } else { h.min() },
            mean: if empty { 0.0 } else { h.mean() },
            p50: q(0.50),
            p90: q(0.90),
            p99: q(0.99),
            p999: q(0.999),
            max: if empty { 0 } else { h.max() },
        }
    }

    /// The histogram in hdrhistogram's V2 format, base64.
    pub fn to_base64(&self) -> String {
        let mut out = Vec::new();
        // Writing into a Vec cannot fail.
        let _ = V2Serializer::new().serialize(&self.0, &mut out);
        base64::engine::general_purpose::STANDARD.encode(out)
    }

    /// Reads back what [`Latency::to_base64`] wrote.
    ///
    /// # Errors
    /// When the text is not base64 or not a V2 histogram.
    pub fn from_base64(text: &str) -> Result<Latency, String> {
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(text)
            .map_err(|e| format!("histogram is not base64: {e}"))?;
        let h: Histogram<u64> = Deserializer::new()
            .deserialize(&mut &bytes[..])
            .map_err(|e| format!("histogram is not hdrhistogram V2: {e:?}"))?;
        Ok(Latency(h))
    }
}

/// Percentiles of a latency histogram, µs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct LatencySummary {
    /// Values recorded.
    pub count: u64,
    /// Smallest value.
    pub min: u64,
    /// Mean.
    pub mean: f64,
    /// Median.
    pub p50: u64,
    /// 90th percentile.
    pub p90: u64,
    /// 99th percentile.
    pub p99: u64,
    /// 99.9th percentile.
    pub p999: u64,
    /// Largest value.
    pub max: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merged_histograms_hold_every_value_of_both() {
        let mut a = Latency::default();
        let mut b = Latency::default();
        for us in 1..=900 {
            a.record_ns(us * 1000);
        }
        for us in 901..=1000 {
            b.record_ns(us * 1000);
        }
        a.merge(&b);
        let s = a.summary();
        assert_eq!(s.count, 1000);
        assert_eq!(s.min, 1);
        assert_eq!(s.p50, 500);
        assert_eq!(s.p99, 990);
        assert_eq!(s.max, 1000);
    }

    #[test]
    fn merging_an_empty_histogram_changes_nothing() {
        let mut a = Latency::default();
        a.record_ns(5_000);
        a.merge(&Latency::default());
        assert_eq!(a.summary().count, 1);
        assert_eq!(a.summary().p50, 5);
    }

    #[test]
    fn latencies_beyond_the_range_are_clamped_not_lost() {
        let mut a = Latency::default();
        a.record_ns(0);
        a.record_ns(u64::MAX / 2);
        assert_eq!(a.count(), 2);
        assert_eq!(a.summary().min, 1);
    }

    #[test]
    fn base64_round_trip_keeps_the_distribution() {
        let mut a = Latency::default();
        for us in [3u64, 30, 300, 3000, 30_000] {
            a.record_ns(us * 1000);
        }
        let b = Latency::from_base64(&a.to_base64()).unwrap();
        assert_eq!(a.summary(), b.summary());
        assert!(Latency::from_base64("not base64!").is_err());
    }
}
