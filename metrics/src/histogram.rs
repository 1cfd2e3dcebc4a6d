//! Fixed-bucket latency histogram.
//!
//! The exporter's own histograms queue every observation in growable blocks
//! until the next scrape or upkeep, which allocates on the I/O path and grows
//! without bound when nobody scrapes. A request's latency only needs to land
//! in one of a fixed set of buckets, so this histogram is an array of atomic
//! counters: recording is two relaxed additions, no allocation, and memory is
//! fixed at registration. Each thread records into its own shard
//! ([`crate::shard`]), so queues do not contend for the same lines.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::shard::{self, Padded};

/// Upper bounds of the latency buckets, in seconds (`le` values).
///
/// Chosen so that common SLO thresholds are exact bucket edges: 100 us,
/// 1 ms, 10 ms, 100 ms, 1 s; the top finite bucket is the 30 s stall
/// threshold, so everything above it is a stalled request.
pub const LATENCY_BUCKETS_SECONDS: [f64; 20] = [
    0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025,
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

const BOUNDS_NS: [u64; 20] = [
    10_000,
    25_000,
    50_000,
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    25_000_000,
    50_000_000,
    100_000_000,
    250_000_000,
    500_000_000,
    1_000_000_000,
    2_500_000_000,
    5_000_000_000,
    10_000_000_000,
    30_000_000_000,
];

const SLOTS: usize = BOUNDS_NS.len() + 1;

/// A latency histogram with the buckets of [`LATENCY_BUCKETS_SECONDS`].
#[derive(Debug)]
pub struct LatencyHistogram {
    shards: Box<[Padded<Shard>]>,
}

#[derive(Debug, Default)]
struct Shard {
    // Non-cumulative per-bucket counts; the last slot is +Inf.
    buckets: [AtomicU64; SLOTS],
    sum_ns: AtomicU64,
}

impl Default for LatencyHistogram {
    fn default() -> Self {
        Self {
            shards: shard::new_shards(),
        }
    }
}

/// Point-in-time copy of a histogram (`ublkctl stats` gets one per device
/// and op, and takes quantiles of the difference of two).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct HistogramSnapshot {
    /// Non-cumulative counts per bucket; the last is above 30 s.
    pub buckets: [u64; SLOTS],
    /// Sum of all observations in nanoseconds.
    pub sum_ns: u64,
}

impl HistogramSnapshot {
    /// Number of observations.
    pub fn count(&self) -> u64 {
        self.buckets.iter().sum()
    }

    /// The `q` quantile (0..=1) estimated as Prometheus'
    /// `histogram_quantile` does: linear within the bucket it falls in, the
    /// bucket's upper bound for the last (+Inf) one, which has none.
    /// `None` without observations.
    pub fn quantile(&self, q: f64) -> Option<Duration> {
        let total = self.count();
        if total == 0 {
            return None;
        }
        let rank = q.clamp(0.0, 1.0) * total as f64;
        let mut below = 0u64;
        for (i, &n) in self.buckets.iter().enumerate() {
            if n > 0 && (below + n) as f64 >= rank {
                let Some(&upper) = BOUNDS_NS.get(i) else {
                    return Some(Duration::from_nanos(BOUNDS_NS[BOUNDS_NS.len() - 1]));
                };
                let lower = if i == 0 { 0 } else { BOUNDS_NS[i - 1] };
                let within = ((rank - below as f64) / n as f64).clamp(0.0, 1.0);
                let ns = lower as f64 + (upper - lower) as f64 * within;
                return Some(Duration::from_nanos(ns as u64));
            }
            below += n;
        }
        None
    }

    /// The observations since `earlier` (a snapshot of the same histogram).
    pub fn since(&self, earlier: &HistogramSnapshot) -> HistogramSnapshot {
        let mut d = *self;
        for (b, e) in d.buckets.iter_mut().zip(earlier.buckets.iter()) {
            *b = b.saturating_sub(*e);
        }
        d.sum_ns = d.sum_ns.saturating_sub(earlier.sum_ns);
        d
    }
}

impl LatencyHistogram {
    /// Records one observation in nanoseconds.
    #[inline]
    pub fn record_ns(&self, ns: u64) {
        // Linear scan: block I/O latencies sit in the first few buckets, so
        // this usually ends after 3-6 comparisons.
        let mut i = 0;
        while i < BOUNDS_NS.len() && ns > BOUNDS_NS[i] {
            i += 1;
        }
        let s = &*self.shards[shard::current()];
        s.buckets[i].fetch_add(1, Ordering::Relaxed);
        s.sum_ns.fetch_add(ns, Ordering::Relaxed);
    }

    /// Records one observation.
    #[inline]
    pub fn record(&self, d: Duration) {
        self.record_ns(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    }

    /// Copies the counts (summed over the shards).
    pub fn snapshot(&self) -> HistogramSnapshot {
        let mut snap = HistogramSnapshot {
            buckets: [0; SLOTS],
            sum_ns: 0,
        };
        for s in self.shards.iter() {
            for (dst, src) in snap.buckets.iter_mut().zip(s.buckets.iter()) {
                *dst = dst.wrapping_add(src.load(Ordering::Relaxed));
            }
            snap.sum_ns = snap.sum_ns.wrapping_add(s.sum_ns.load(Ordering::Relaxed));
        }
        snap
    }

    /// Appends the `_bucket`, `_sum` and `_count` samples of one series.
    /// `labels` is the pre-rendered label list without braces (may be empty).
    pub(crate) fn render(&self, name: &str, labels: &str, out: &mut String) {
        let snap = self.snapshot();
        let sep = if labels.is_empty() { "" } else { "," };
        let mut cumulative = 0u64;
        for (i, count) in snap.buckets.iter().enumerate() {
            cumulative += count;
            let _ = match LATENCY_BUCKETS_SECONDS.get(i) {
                Some(le) => writeln!(
                    out,
                    "{name}_bucket{{{labels}{sep}le=\"{le}\"}} {cumulative}"
                ),
                None => writeln!(
                    out,
                    "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {cumulative}"
                ),
            };
        }
        // The count is the +Inf bucket read above, so the two always agree
        // even while observations race with the scrape.
        let sum = snap.sum_ns as f64 / 1e9;
        if labels.is_empty() {
            let _ = writeln!(out, "{name}_sum {sum}\n{name}_count {cumulative}");
        } else {
            let _ = writeln!(
                out,
                "{name}_sum{{{labels}}} {sum}\n{name}_count{{{labels}}} {cumulative}"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn quantiles_interpolate_within_buckets_like_promql() {
        let h = LatencyHistogram::default();
        assert_eq!(h.snapshot().quantile(0.5), None);
        // 90 requests in (100us, 250us], 10 in (5ms, 10ms].
        for _ in 0..90 {
            h.record_ns(200_000);
        }
        for _ in 0..10 {
            h.record_ns(7_000_000);
        }
        let s = h.snapshot();
        // Rank 50 of 90 in the 100..250us bucket: 100 + 150 * 50/90.
        assert_eq!(s.quantile(0.5), Some(Duration::from_nanos(183_333)));
        // Rank 99: the 9th of 10 in 5..10ms.
        assert_eq!(s.quantile(0.99), Some(Duration::from_nanos(9_500_000)));
        // Above the last bound: reported as the last bound.
        h.record_ns(60_000_000_000);
        assert_eq!(h.snapshot().quantile(1.0), Some(Duration::from_secs(30)));
        let later = h.snapshot();
        let d = later.since(&s);
        assert_eq!(d.count(), 1);
        assert_eq!(d.quantile(0.5), Some(Duration::from_secs(30)));
    }

    use super::*;

    #[test]
    fn bounds_match_seconds() {
        for (ns, s) in BOUNDS_NS.iter().zip(LATENCY_BUCKETS_SECONDS.iter()) {
            assert!(((*ns as f64 / 1e9) - s).abs() < 1e-12);
        }
    }

    #[test]
    fn observations_land_on_inclusive_upper_bounds() {
        let h = LatencyHistogram::default();
        h.record_ns(10_000); // le=0.00001
        h.record_ns(10_001); // le=0.000025
        h.record(Duration::from_secs(30)); // le=30
        h.record(Duration::from_secs(31)); // +Inf
        let s = h.snapshot();
        assert_eq!(s.buckets[0], 1);
        assert_eq!(s.buckets[1], 1);
        assert_eq!(s.buckets[19], 1);
        assert_eq!(s.buckets[20], 1);
        assert_eq!(s.count(), 4);
    }

    #[test]
    fn render_is_cumulative() {
        let h = LatencyHistogram::default();
        h.record_ns(50_000);
        h.record_ns(2_000_000);
        let mut out = String::new();
        h.render("x_seconds", "op=\"read\"", &mut out);
        assert!(out.contains("x_seconds_bucket{op=\"read\",le=\"0.00005\"} 1\n"));
        assert!(out.contains("x_seconds_bucket{op=\"read\",le=\"0.0025\"} 2\n"));
        assert!(out.contains("x_seconds_bucket{op=\"read\",le=\"+Inf\"} 2\n"));
        assert!(out.contains("x_seconds_count{op=\"read\"} 2\n"));
        assert!(out.contains("x_seconds_sum{op=\"read\"} 0.00205\n"));
    }
}
