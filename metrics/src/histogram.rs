//! Fixed-bucket latency histogram.
//!
//! The exporter's own histograms queue every observation in growable blocks
//! until the next scrape or upkeep, which allocates on the I/O path and grows
//! without bound when nobody scrapes. A request's latency only needs to land
//! in one of a fixed set of buckets, so this histogram is an array of atomic
//! counters: recording is two relaxed additions, no allocation, and memory is
//! fixed at registration. Each thread records into its own shard
//! ([`crate::shard`]), so queues do not contend for the same lines.
//!
//! Each histogram also keeps one exemplar per bucket: the trace id of the
//! latest retained request that landed there ([`LatencyHistogram::exemplar`]),
//! rendered only in the OpenMetrics exposition. The store is fixed (one cell
//! per bucket), written after the observation and only for retained traces.

use std::fmt::Write as _;
use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::time::Duration;

use crate::correlation::CorrelationId;
use crate::shard::{self, Padded};
use crate::trace::TraceId;

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
    exemplars: [ExemplarCell; SLOTS],
}

/// The latest exemplar of one bucket, behind a sequence lock: a writer
/// that finds another one writing skips (an exemplar is a pointer to one
/// example, losing one under contention loses nothing), a reader retries.
#[derive(Debug, Default)]
struct ExemplarCell {
    // Odd while a writer is in the cell.
    seq: AtomicU64,
    // 0: no exemplar yet.
    corr: AtomicU64,
    value_ns: AtomicU64,
    unix_ms: AtomicU64,
}

/// One bucket's exemplar: which request, its latency, and when.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exemplar {
    /// The retained request's trace.
    pub trace: TraceId,
    /// Its latency in nanoseconds.
    pub value_ns: u64,
    /// Unix time of the observation in milliseconds.
    pub unix_ms: u64,
}

impl ExemplarCell {
    fn write(&self, corr: u64, value_ns: u64, unix_ms: u64) {
        let seq = self.seq.load(Ordering::Relaxed);
        if seq & 1 == 1
            || self
                .seq
                .compare_exchange(seq, seq + 1, Ordering::Acquire, Ordering::Relaxed)
                .is_err()
        {
            return;
        }
        self.corr.store(corr, Ordering::Relaxed);
        self.value_ns.store(value_ns, Ordering::Relaxed);
        self.unix_ms.store(unix_ms, Ordering::Relaxed);
        self.seq.store(seq + 2, Ordering::Release);
    }

    fn read(&self) -> Option<Exemplar> {
        for _ in 0..8 {
            let before = self.seq.load(Ordering::Acquire);
            if before & 1 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let corr = self.corr.load(Ordering::Relaxed);
            let value_ns = self.value_ns.load(Ordering::Relaxed);
            let unix_ms = self.unix_ms.load(Ordering::Relaxed);
            fence(Ordering::Acquire);
            if self.seq.load(Ordering::Relaxed) == before {
                return (corr != 0).then(|| Exemplar {
                    trace: TraceId::of(CorrelationId::from_raw(corr)),
                    value_ns,
                    unix_ms,
                });
            }
        }
        // A writer kept the cell busy: show no exemplar this scrape.
        None
    }
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
            exemplars: Default::default(),
        }
    }
}

/// The bucket an observation of `ns` lands in.
#[inline]
fn bucket(ns: u64) -> usize {
    // Linear scan: block I/O latencies sit in the first few buckets, so
    // this usually ends after 3-6 comparisons.
    let mut i = 0;
    while i < BOUNDS_NS.len() && ns > BOUNDS_NS[i] {
        i += 1;
    }
    i
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
        let s = &*self.shards[shard::current()];
        s.buckets[bucket(ns)].fetch_add(1, Ordering::Relaxed);
        s.sum_ns.fetch_add(ns, Ordering::Relaxed);
    }

    /// Records one observation.
    #[inline]
    pub fn record(&self, d: Duration) {
        self.record_ns(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    }

    /// Makes `corr`'s request the exemplar of the bucket an observation of
    /// `ns` lands in. Call it after [`Self::record_ns`] of the same value,
    /// so a scrape that shows the exemplar also counts its observation
    /// (the render reads exemplars before counts).
    pub fn exemplar(&self, ns: u64, corr: CorrelationId) {
        let unix_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        self.exemplars[bucket(ns)].write(corr.get(), ns, unix_ms);
    }

    /// The exemplar of each bucket (the last is `+Inf`).
    pub fn exemplars(&self) -> [Option<Exemplar>; SLOTS] {
        std::array::from_fn(|i| self.exemplars[i].read())
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
    /// With `exemplars` (OpenMetrics only), a bucket line that has one ends
    /// with ` # {trace_id="..."} <seconds> <unix seconds>`.
    pub(crate) fn render(&self, name: &str, labels: &str, exemplars: bool, out: &mut String) {
        // Exemplars first: each was written after its observation, so the
        // counts read next include every exemplar shown.
        let ex = if exemplars {
            self.exemplars()
        } else {
            [None; SLOTS]
        };
        let snap = self.snapshot();
        let sep = if labels.is_empty() { "" } else { "," };
        let mut cumulative = 0u64;
        for (i, count) in snap.buckets.iter().enumerate() {
            cumulative += count;
            let _ = match LATENCY_BUCKETS_SECONDS.get(i) {
                Some(le) => write!(
                    out,
                    "{name}_bucket{{{labels}{sep}le=\"{le}\"}} {cumulative}"
                ),
                None => write!(
                    out,
                    "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {cumulative}"
                ),
            };
            if let Some(e) = ex[i] {
                let _ = write!(
                    out,
                    " # {{trace_id=\"{}\"}} {} {}.{:03}",
                    e.trace,
                    e.value_ns as f64 / 1e9,
                    e.unix_ms / 1000,
                    e.unix_ms % 1000
                );
            }
            out.push('\n');
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
        h.render("x_seconds", "op=\"read\"", false, &mut out);
        assert!(out.contains("x_seconds_bucket{op=\"read\",le=\"0.00005\"} 1\n"));
        assert!(out.contains("x_seconds_bucket{op=\"read\",le=\"0.0025\"} 2\n"));
        assert!(out.contains("x_seconds_bucket{op=\"read\",le=\"+Inf\"} 2\n"));
        assert!(out.contains("x_seconds_count{op=\"read\"} 2\n"));
        assert!(out.contains("x_seconds_sum{op=\"read\"} 0.00205\n"));
    }

    #[test]
    fn the_latest_exemplar_of_a_bucket_renders_on_its_line_only() {
        let h = LatencyHistogram::default();
        let (a, b, c) = (
            CorrelationId::from_raw(7),
            CorrelationId::from_raw(8),
            CorrelationId::from_raw(9),
        );
        for (ns, corr) in [(2_000_000, a), (2_100_000, b), (40_000_000_000, c)] {
            h.record_ns(ns);
            h.exemplar(ns, corr);
        }
        let mut plain = String::new();
        h.render("x_seconds", "", false, &mut plain);
        assert!(!plain.contains('#'), "no exemplars outside OpenMetrics");
        let mut out = String::new();
        h.render("x_seconds", "", true, &mut out);
        let line = |le: &str| {
            out.lines()
                .find(|l| l.starts_with(&format!("x_seconds_bucket{{le=\"{le}\"}}")))
                .unwrap()
                .to_string()
        };
        let mid = line("0.0025");
        assert!(
            mid.starts_with("x_seconds_bucket{le=\"0.0025\"} 2 # {trace_id=\""),
            "{mid}"
        );
        assert!(
            mid.contains(&TraceId::of(b).to_string()),
            "latest wins: {mid}"
        );
        assert!(mid.contains("} 0.0021 "), "{mid}");
        assert!(line("+Inf").contains(&TraceId::of(c).to_string()));
        assert!(!line("0.001").contains('#'));
    }
}
