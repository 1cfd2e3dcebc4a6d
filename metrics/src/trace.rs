//! Sampled request traces: one root span per logical block request and one
//! child span per transport attempt, emitted as structured `tracing` records
//! (`span.request`, `span.attempt`) when the request ends, and only when it
//! is retained.
//!
//! Whether a request is worth keeping is known only at its end (was it
//! slow, did it fail?), so nothing is emitted while it runs: what a span
//! needs is already in the request's tracker slot (start, op, correlation
//! id) and the attempts' outcomes reach the observer with the target's
//! result, so [`Tracer::finish`] gets everything at completion, from values
//! on the completing thread's stack. No span object is allocated per I/O.
//!
//! Retention: deterministic head sampling of `sample_rate_ppm` requests per
//! million (a function of the trace id, so the same request is always in or
//! out), plus every request or attempt that failed, timed out, was
//! cancelled, or took at least the slow threshold. A root is retained when
//! one of its attempts is (`linked_child`), and a retained root emits all
//! its attempts. The reason is a closed set ([`Retention`]).
//!
//! Trace ids are process-local 128-bit values: a per-process random high
//! half and the request's [`CorrelationId`] as the low half, so a trace id
//! names one request of one process run, and the log lines of that request
//! (`corr`) are one search away.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use crate::correlation::CorrelationId;
use crate::events;
use crate::labels::{closed_enum, count_variants, IoOp, Phase, Reason, Transport};

/// Highest head-sampling rate: every request.
pub const MAX_SAMPLE_RATE_PPM: u32 = 1_000_000;

/// ETIMEDOUT: a request that ended with it was retained as a timeout.
const ETIMEDOUT: u32 = 110;

/// A process-local 128-bit trace id (rendered as 32 lower-case hex digits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceId(u128);

/// High half of every trace id of this process: random per process run, so
/// ids of two runs (whose correlation ids both start at 1) do not collide in
/// an exemplar store that outlives one of them.
fn process_prefix() -> u64 {
    static PREFIX: OnceLock<u64> = OnceLock::new();
    *PREFIX.get_or_init(|| {
        use std::hash::{BuildHasher, Hasher};
        // `RandomState` is seeded from the OS's random source.
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        h.finish() | 1
    })
}

impl TraceId {
    /// The trace id of the request with correlation id `corr`.
    #[inline]
    pub fn of(corr: CorrelationId) -> TraceId {
        TraceId((u128::from(process_prefix()) << 64) | u128::from(corr.get()))
    }

    /// The request's correlation id (the low half).
    pub fn correlation_id(self) -> u64 {
        self.0 as u64
    }

    /// The numeric value.
    pub fn get(self) -> u128 {
        self.0
    }
}

impl fmt::Display for TraceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

closed_enum! {
    /// Why a span was kept.
    Retention {
        /// Chosen by the deterministic head sample.
        HeadSampled => "head_sampled",
        /// Took at least the slow threshold.
        Slow => "slow",
        /// Failed (other than by a timeout) or was cancelled.
        Error => "error",
        /// Failed by a timeout.
        Timeout => "timeout",
        /// Kept because a span linked to it (its attempt, or a sibling
        /// attempt's root) was.
        LinkedChild => "linked_child",
    }
}

/// How a span ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpanEnd {
    /// Completed successfully.
    Success,
    /// Failed in `phase` for `reason`.
    Failure {
        /// Where.
        phase: Phase,
        /// Why.
        reason: Reason,
    },
    /// Abandoned before it completed.
    Cancelled,
}

impl SpanEnd {
    fn outcome(self) -> &'static str {
        match self {
            SpanEnd::Success => "success",
            SpanEnd::Failure { .. } => "failure",
            SpanEnd::Cancelled => "cancelled",
        }
    }
}

/// A logical block request at its end: the root span.
#[derive(Debug, Clone, Copy)]
pub struct RequestRecord<'a> {
    /// Its correlation id (the trace id's low half).
    pub corr: CorrelationId,
    /// Target label.
    pub target: &'a str,
    /// Device id (logged only).
    pub device: Option<u32>,
    /// Block op.
    pub op: IoOp,
    /// Transport of its first attempt.
    pub transport: Transport,
    /// Time from the target taking it to its end.
    pub latency_ns: u64,
    /// How it ended.
    pub end: SpanEnd,
    /// The positive errno the kernel got, when it failed.
    pub errno: Option<u32>,
}

/// One physical attempt of a request: a child span.
#[derive(Debug, Clone, Copy)]
pub struct AttemptRecord {
    /// The transport it ran on.
    pub transport: Transport,
    /// Its duration; `None` when only the transport saw its end (the RDMA
    /// attempt of a failover), logged as `duration_us=-1`.
    pub latency_ns: Option<u64>,
    /// How it ended.
    pub end: SpanEnd,
}

/// Trace settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceConfig {
    /// Head-sampled requests per million (above [`MAX_SAMPLE_RATE_PPM`] is
    /// treated as it).
    pub sample_rate_ppm: u32,
    /// Requests and attempts taking at least this long are retained;
    /// `None` retains none for being slow.
    pub slow_threshold: Option<Duration>,
}

/// Decides which requests are retained and emits their spans. Clones share
/// the slow threshold, so [`Tracer::set_slow_threshold`] (a reload) reaches
/// every device's.
#[derive(Debug, Clone)]
pub struct Tracer {
    /// [`process_prefix`], read once here rather than per request.
    prefix: u64,
    /// A request is head-sampled when its hash is below this: the rate as
    /// a fraction of the hash range, so the test is one compare.
    sample_limit: u128,
    /// 0: nothing is retained for being slow.
    slow_ns: Arc<AtomicU64>,
}

/// Multiplier of the sampling hash (2^64 / golden ratio): consecutive
/// correlation ids land evenly over the whole range, so the sampled share
/// is the configured rate even over short runs.
const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

/// The hash bound of `ppm`: `h < limit` exactly when `h * 10^6 / 2^64 <
/// ppm`, the rate's share of the 64-bit hash range (rounded up, so the
/// bound is exact for integer hashes).
fn sample_limit(ppm: u32) -> u128 {
    (u128::from(ppm) << 64).div_ceil(u128::from(MAX_SAMPLE_RATE_PPM))
}

fn threshold_ns(slow: Option<Duration>) -> u64 {
    slow.map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

impl Tracer {
    /// A tracer with `config`.
    pub fn new(config: TraceConfig) -> Tracer {
        let ppm = config.sample_rate_ppm.min(MAX_SAMPLE_RATE_PPM);
        Tracer {
            prefix: process_prefix(),
            sample_limit: sample_limit(ppm),
            slow_ns: Arc::new(AtomicU64::new(threshold_ns(config.slow_threshold))),
        }
    }

    /// Retains requests and attempts of at least `slow` from now on (`None`:
    /// none for being slow).
    pub fn set_slow_threshold(&self, slow: Option<Duration>) {
        self.slow_ns.store(threshold_ns(slow), Ordering::Relaxed);
    }

    /// Whether the head sample keeps `corr`'s request: a function of its
    /// trace id only.
    #[inline]
    pub fn head_sampled(&self, corr: CorrelationId) -> bool {
        let h = (corr.get() ^ self.prefix).wrapping_mul(GOLDEN);
        u128::from(h) < self.sample_limit
    }

    /// Whether a request that succeeded after `latency_ns`, every attempt of
    /// it succeeded too, is retained: the one test the common request
    /// needs, so its caller can skip building the records [`Tracer::finish`]
    /// takes. Exact because an attempt runs within its request, so no
    /// attempt of a request below the slow threshold is above it.
    #[inline]
    pub fn keeps_success(&self, corr: CorrelationId, latency_ns: u64) -> bool {
        let slow = self.slow_ns.load(Ordering::Relaxed);
        (slow != 0 && latency_ns >= slow) || self.head_sampled(corr)
    }

    /// A span's own reason to be kept, if any.
    #[inline]
    fn own(&self, end: SpanEnd, latency_ns: u64, errno: Option<u32>) -> Option<Retention> {
        match end {
            SpanEnd::Failure {
                reason: Reason::Timeout,
                ..
            } => Some(Retention::Timeout),
            SpanEnd::Failure { .. } if errno == Some(ETIMEDOUT) => Some(Retention::Timeout),
            SpanEnd::Failure { .. } | SpanEnd::Cancelled => Some(Retention::Error),
            SpanEnd::Success => {
                let slow = self.slow_ns.load(Ordering::Relaxed);
                (slow != 0 && latency_ns >= slow).then_some(Retention::Slow)
            }
        }
    }

    /// Ends `req`'s trace: when the request or one of its `attempts` is
    /// retained, emits the root and every attempt and returns the trace id
    /// (for exemplars); otherwise emits nothing.
    #[inline]
    pub fn finish(&self, req: &RequestRecord<'_>, attempts: &[AttemptRecord]) -> Option<TraceId> {
        let root = self
            .own(req.end, req.latency_ns, req.errno)
            .or_else(|| {
                self.head_sampled(req.corr)
                    .then_some(Retention::HeadSampled)
            })
            .or_else(|| {
                attempts
                    .iter()
                    .any(|a| self.own(a.end, a.latency_ns.unwrap_or(0), None).is_some())
                    .then_some(Retention::LinkedChild)
            })?;
        self.emit(req, attempts, root)
    }

    #[cold]
    fn emit(
        &self,
        req: &RequestRecord<'_>,
        attempts: &[AttemptRecord],
        root: Retention,
    ) -> Option<TraceId> {
        let id = TraceId::of(req.corr);
        let device = req.device.map_or(-1, i64::from);
        let (phase, reason) = failure_labels(req.end);
        tracing::info!(
            event = events::SPAN_REQUEST,
            trace_id = %id,
            span_id = %SpanId(1),
            corr = req.corr.get(),
            target = req.target,
            device,
            op = req.op.as_str(),
            transport = req.transport.as_str(),
            outcome = req.end.outcome(),
            errno = req.errno.unwrap_or(0),
            phase,
            reason,
            duration_us = req.latency_ns / 1000,
            attempts = attempts.len(),
            retention = root.as_str(),
            "request span"
        );
        for (i, a) in attempts.iter().enumerate() {
            // An attempt with no reason of its own is kept with its root.
            let retention = self
                .own(a.end, a.latency_ns.unwrap_or(0), None)
                .unwrap_or(root);
            let (phase, reason) = failure_labels(a.end);
            tracing::info!(
                event = events::SPAN_ATTEMPT,
                trace_id = %id,
                span_id = %SpanId(2 + i as u64),
                parent_span_id = %SpanId(1),
                corr = req.corr.get(),
                attempt = i,
                op = req.op.as_str(),
                transport = a.transport.as_str(),
                outcome = a.end.outcome(),
                phase,
                reason,
                duration_us = a.latency_ns.map_or(-1, |ns| (ns / 1000) as i64),
                retention = retention.as_str(),
                "attempt span"
            );
        }
        Some(id)
    }
}

/// `phase` and `reason` of a span (empty unless it failed).
fn failure_labels(end: SpanEnd) -> (&'static str, &'static str) {
    match end {
        SpanEnd::Failure { phase, reason } => (phase.as_str(), reason.as_str()),
        _ => ("", ""),
    }
}

/// A span id within its trace (16 hex digits): the root is 1, attempt `i`
/// is `2 + i`.
struct SpanId(u64);

impl fmt::Display for SpanId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tracer(ppm: u32, slow_ms: u64) -> Tracer {
        Tracer::new(TraceConfig {
            sample_rate_ppm: ppm,
            slow_threshold: (slow_ms > 0).then(|| Duration::from_millis(slow_ms)),
        })
    }

    fn req(corr: CorrelationId, latency_ms: u64, end: SpanEnd) -> RequestRecord<'static> {
        RequestRecord {
            corr,
            target: "arena",
            device: Some(0),
            op: IoOp::Read,
            transport: Transport::Tcp,
            latency_ns: latency_ms * 1_000_000,
            end,
            errno: match end {
                SpanEnd::Failure { .. } => Some(5),
                _ => None,
            },
        }
    }

    fn ok(latency_ms: u64) -> AttemptRecord {
        AttemptRecord {
            transport: Transport::Tcp,
            latency_ns: Some(latency_ms * 1_000_000),
            end: SpanEnd::Success,
        }
    }

    #[test]
    fn trace_ids_are_128_bit_hex_carrying_the_correlation_id() {
        let c = CorrelationId::next();
        let id = TraceId::of(c);
        let s = id.to_string();
        assert_eq!(s.len(), 32);
        assert!(s
            .bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
        assert_eq!(id.correlation_id(), c.get());
        assert_ne!(id.get() >> 64, 0, "the process half is set");
        assert_eq!(TraceId::of(c), id, "deterministic");
    }

    #[test]
    fn head_sampling_is_deterministic_and_close_to_the_rate() {
        for ppm in [0, 100, 10_000, 500_000, MAX_SAMPLE_RATE_PPM, u32::MAX] {
            let t = tracer(ppm, 0);
            let n = 200_000u64;
            let ids: Vec<CorrelationId> = (0..n).map(|_| CorrelationId::next()).collect();
            let hits = ids.iter().filter(|c| t.head_sampled(**c)).count() as f64;
            let want = n as f64 * f64::from(ppm.min(MAX_SAMPLE_RATE_PPM)) / 1e6;
            assert!(
                (hits - want).abs() <= want * 0.1 + 3.0,
                "{ppm} ppm: {hits} of {n}, want ~{want}"
            );
            assert!(ids.iter().all(|c| t.head_sampled(*c) == t.head_sampled(*c)));
        }
    }

    #[test]
    fn the_sample_bound_is_the_rate_share_of_the_hash_range() {
        let hashes = [
            0,
            1,
            u64::MAX,
            u64::MAX / 2,
            GOLDEN,
            18_446_744_073_709,
            18_446_744_073_710,
        ];
        for ppm in [0, 1, 100, 999_999, MAX_SAMPLE_RATE_PPM] {
            for h in hashes
                .iter()
                .copied()
                .chain((0..1000u64).map(|i| i.wrapping_mul(GOLDEN)))
            {
                let by_product =
                    ((u128::from(h) * u128::from(MAX_SAMPLE_RATE_PPM)) >> 64) < u128::from(ppm);
                assert_eq!(
                    u128::from(h) < sample_limit(ppm),
                    by_product,
                    "ppm {ppm} hash {h}"
                );
            }
        }
    }

    #[test]
    fn keeps_success_agrees_with_finish_on_successful_requests() {
        let t = tracer(10_000, 5);
        for i in 1..5000u64 {
            let corr = CorrelationId::next();
            let latency_ms = i % 8;
            let record = req(corr, latency_ms, SpanEnd::Success);
            let attempt = AttemptRecord {
                transport: Transport::Tcp,
                latency_ns: Some(record.latency_ns / 2),
                end: SpanEnd::Success,
            };
            assert_eq!(
                t.keeps_success(corr, record.latency_ns),
                t.finish(&record, &[attempt]).is_some(),
                "request {i}"
            );
        }
    }

    #[test]
    fn a_changed_slow_threshold_reaches_every_clone() {
        let t = tracer(0, 0);
        let device = t.clone();
        assert_eq!(device.own(SpanEnd::Success, 150_000_000, None), None);
        t.set_slow_threshold(Some(Duration::from_millis(100)));
        assert_eq!(
            device.own(SpanEnd::Success, 150_000_000, None),
            Some(Retention::Slow)
        );
        assert_eq!(device.own(SpanEnd::Success, 50_000_000, None), None);
        t.set_slow_threshold(None);
        assert_eq!(device.own(SpanEnd::Success, 150_000_000, None), None);
    }

    #[test]
    fn unsampled_fast_successes_emit_nothing() {
        let t = tracer(0, 100);
        assert_eq!(
            t.finish(&req(CorrelationId::next(), 5, SpanEnd::Success), &[ok(5)]),
            None
        );
    }

    #[test]
    fn slow_failed_timed_out_and_cancelled_requests_are_retained() {
        let t = tracer(0, 100);
        let fail = |reason| SpanEnd::Failure {
            phase: Phase::Poll,
            reason,
        };
        for (end, latency, attempt_end) in [
            (SpanEnd::Success, 150, SpanEnd::Success),
            (fail(Reason::Io), 1, fail(Reason::Io)),
            (fail(Reason::Timeout), 1, fail(Reason::Timeout)),
            (SpanEnd::Cancelled, 1, SpanEnd::Cancelled),
        ] {
            let c = CorrelationId::next();
            let a = AttemptRecord {
                end: attempt_end,
                ..ok(latency)
            };
            assert_eq!(
                t.finish(&req(c, latency, end), &[a]),
                Some(TraceId::of(c)),
                "{end:?}"
            );
        }
        assert_eq!(
            t.own(fail(Reason::Timeout), 0, None),
            Some(Retention::Timeout)
        );
        assert_eq!(
            t.own(fail(Reason::Io), 0, Some(110)),
            Some(Retention::Timeout)
        );
        assert_eq!(t.own(SpanEnd::Cancelled, 0, None), Some(Retention::Error));
        assert_eq!(
            t.own(SpanEnd::Success, 100_000_000, None),
            Some(Retention::Slow)
        );
    }

    #[test]
    fn a_root_is_retained_when_an_attempt_is() {
        let t = tracer(0, 0);
        let c = CorrelationId::next();
        let failed_rdma = AttemptRecord {
            transport: Transport::Rdma,
            latency_ns: None,
            end: SpanEnd::Failure {
                phase: Phase::Completion,
                reason: Reason::WcError,
            },
        };
        // The request succeeded (failed over to TCP): only its attempt failed.
        assert_eq!(
            t.finish(&req(c, 1, SpanEnd::Success), &[failed_rdma, ok(1)]),
            Some(TraceId::of(c))
        );
    }

    #[test]
    fn everything_is_sampled_at_the_cap() {
        let t = tracer(u32::MAX, 0);
        let c = CorrelationId::next();
        assert_eq!(
            t.finish(&req(c, 1, SpanEnd::Success), &[ok(1)]),
            Some(TraceId::of(c))
        );
    }
}
