//! Logical requests vs physical attempts.
//!
//! A block request that fails over from RDMA to TCP is one logical request
//! but two physical attempts. Counting both, each with its own started /
//! outcome / in-flight triple, makes a lost terminal edge visible:
//!
//! ```text
//! started_total{op,transport} = sum by (op,transport) (outcomes_total) + inflight
//! ```
//!
//! holds for requests and for attempts, by construction: every start returns
//! a span that records exactly one outcome (dropping it records
//! `cancelled`). Attempts that end (succeed or fail) also record their
//! duration, when the observer measured it, by the transport they ran on
//! (`ublk_attempt_latency_seconds`).
//!
//! A daemon's exposition holds the series it can move and no others: the
//! transports a ublkd serves ([`Transport::SERVED`]), the failover it makes
//! (RDMA to TCP) and the failure causes the taxonomy places
//! ([`FailureCause`]) are registered when the accounting is created, so
//! every family, failures included, renders at zero from the first scrape;
//! anything else (the in-process transport of tests and benchmarks)
//! registers on its first request. The I/O path finds the handles through
//! a `OnceLock`, a load once it is set, never a lock.

use crate::correlation::CorrelationId;
use crate::events;
use crate::histogram::LatencyHistogram;
use crate::labels::{FailureCause, IoOp, Outcome, Phase, Reason, Transport};
use crate::shard::{ShardedCounter, ShardedGauge};
use crate::telemetry::Telemetry;
use metrics::Counter;
use std::sync::{Arc, OnceLock};

const T: usize = Transport::COUNT;
const O: usize = IoOp::COUNT;

/// The failovers a ublkd makes: a payload that cannot go over RDMA goes
/// over the TCP control connection. Nothing moves the other way.
const FAILOVERS: [(Transport, Transport); 1] = [(Transport::Rdma, Transport::Tcp)];

/// Started, finished and in flight, per op, of one transport. Every
/// request touches these from its queue's thread, so they are sharded per
/// thread (registered series render from the start, at zero).
struct Flow {
    started: [Arc<ShardedCounter>; O],
    outcomes: [[Arc<ShardedCounter>; Outcome::COUNT]; O],
    inflight: [Arc<ShardedGauge>; O],
}

impl Flow {
    fn new(
        tel: &Telemetry,
        t: Transport,
        started: &'static str,
        outcomes: &'static str,
        inflight: &'static str,
    ) -> Flow {
        let labels = |op: IoOp| vec![("op", op.as_str()), ("transport", t.as_str())];
        Flow {
            started: IoOp::ALL.map(|op| tel.sharded_counter(started, &labels(op))),
            outcomes: IoOp::ALL.map(|op| {
                Outcome::ALL.map(|o| {
                    let mut l = labels(op);
                    l.push(("outcome", o.as_str()));
                    tel.sharded_counter(outcomes, &l)
                })
            }),
            inflight: IoOp::ALL.map(|op| tel.sharded_gauge(inflight, &labels(op))),
        }
    }

    #[inline]
    fn start(&self, op: IoOp) {
        self.started[op.index()].increment(1);
        self.inflight[op.index()].increment();
    }

    #[inline]
    fn finish(&self, op: IoOp, outcome: Outcome) {
        self.outcomes[op.index()][outcome.index()].increment(1);
        self.inflight[op.index()].decrement();
    }
}

/// Every series of one transport.
struct TransportSeries {
    requests: Flow,
    attempts: Flow,
    attempt_latency: [Arc<LatencyHistogram>; O],
    request_failures: [Counter; FailureCause::COUNT],
    attempt_failures: [Counter; FailureCause::COUNT],
}

impl TransportSeries {
    fn new(tel: &Telemetry, t: Transport) -> Self {
        let failures = |family: &'static str| {
            FailureCause::ALL.map(|c| {
                tel.counter(
                    family,
                    &[
                        ("transport", t.as_str()),
                        ("phase", c.phase().as_str()),
                        ("reason", c.reason().as_str()),
                    ],
                )
            })
        };
        TransportSeries {
            requests: Flow::new(
                tel,
                t,
                "ublk_requests_started_total",
                "ublk_request_outcomes_total",
                "ublk_requests_inflight",
            ),
            attempts: Flow::new(
                tel,
                t,
                "ublk_attempts_started_total",
                "ublk_attempt_outcomes_total",
                "ublk_attempts_inflight",
            ),
            attempt_latency: IoOp::ALL.map(|op| {
                tel.histogram(
                    "ublk_attempt_latency_seconds",
                    &[("op", op.as_str()), ("transport", t.as_str())],
                )
            }),
            request_failures: failures("ublk_request_failures_total"),
            attempt_failures: failures("ublk_attempt_failures_total"),
        }
    }
}

/// The request/attempt accounting of one daemon (create one, share it).
pub struct RequestAccounting {
    telemetry: Arc<Telemetry>,
    transports: [OnceLock<TransportSeries>; T],
    /// `ublk_failovers_total` by op, of each (from, to).
    failovers: [[OnceLock<[Counter; O]>; T]; T],
    /// `ublk_attempt_failures_total{phase="completion",reason="wc_error"}`
    /// of each transport: the attempts that failed over.
    wc_errors: [OnceLock<Counter>; T],
}

impl std::fmt::Debug for RequestAccounting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestAccounting").finish_non_exhaustive()
    }
}

impl RequestAccounting {
    /// Registers the families of what a ublkd serves (see the module
    /// documentation).
    pub fn new(telemetry: &Arc<Telemetry>) -> Self {
        let acct = RequestAccounting {
            telemetry: Arc::clone(telemetry),
            transports: Default::default(),
            failovers: Default::default(),
            wc_errors: Default::default(),
        };
        for t in Transport::SERVED {
            acct.series(t);
        }
        for (from, to) in FAILOVERS {
            acct.failovers(from, to);
            acct.wc_errors(from);
        }
        acct
    }

    #[inline]
    fn series(&self, t: Transport) -> &TransportSeries {
        self.transports[t.index()].get_or_init(|| TransportSeries::new(&self.telemetry, t))
    }

    fn failovers(&self, from: Transport, to: Transport) -> &[Counter; O] {
        self.failovers[from.index()][to.index()].get_or_init(|| {
            IoOp::ALL.map(|op| {
                self.telemetry.counter(
                    "ublk_failovers_total",
                    &[
                        ("op", op.as_str()),
                        ("from", from.as_str()),
                        ("to", to.as_str()),
                    ],
                )
            })
        })
    }

    fn wc_errors(&self, t: Transport) -> &Counter {
        self.wc_errors[t.index()].get_or_init(|| {
            self.telemetry.counter(
                "ublk_attempt_failures_total",
                &[
                    ("transport", t.as_str()),
                    ("phase", Phase::Completion.as_str()),
                    ("reason", Reason::WcError.as_str()),
                ],
            )
        })
    }

    /// Starts a logical request. `transport` is the transport of its first
    /// attempt; the request's outcome is counted under it even after a
    /// failover, so the equality holds per label set (the failover itself is
    /// in `ublk_failovers_total` and in the attempts).
    #[inline]
    pub fn start_request(
        &self,
        op: IoOp,
        transport: Transport,
        corr: CorrelationId,
    ) -> RequestSpan<'_> {
        let series = self.series(transport);
        series.requests.start(op);
        RequestSpan {
            acct: self,
            series,
            op,
            transport,
            corr,
            failed_over: false,
            done: false,
        }
    }

    /// The attempt latency histogram of (`op`, `transport`), for exemplars.
    pub fn attempt_latency(&self, op: IoOp, transport: Transport) -> &LatencyHistogram {
        &self.series(transport).attempt_latency[op.index()]
    }
}

/// A logical request in flight; records exactly one outcome.
#[must_use = "dropping the span records the request as cancelled"]
pub struct RequestSpan<'a> {
    acct: &'a RequestAccounting,
    series: &'a TransportSeries,
    op: IoOp,
    transport: Transport,
    corr: CorrelationId,
    failed_over: bool,
    done: bool,
}

impl std::fmt::Debug for RequestSpan<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestSpan")
            .field("op", &self.op)
            .field("transport", &self.transport)
            .field("corr", &self.corr)
            .finish()
    }
}

impl<'a> RequestSpan<'a> {
    /// Starts a physical attempt on `transport`.
    #[inline]
    pub fn attempt(&self, transport: Transport) -> AttemptSpan<'a> {
        let series = self.acct.series(transport);
        series.attempts.start(self.op);
        AttemptSpan {
            series,
            op: self.op,
            transport,
            corr: self.corr,
            done: false,
        }
    }

    /// The payload of `attempt` could not go over its transport (an RDMA
    /// work request failed or timed out) and goes over `to` instead:
    /// `attempt` fails in `completion` for `wc_error` after `latency_ns`
    /// (`None`: only the transport saw its end, and it stays out of the
    /// histogram), and the attempt on `to` starts. The failover is counted
    /// once per request however often its payload moves, so a request that
    /// retries on TCP several times is still one failover.
    pub fn fail_over(
        &mut self,
        attempt: AttemptSpan<'a>,
        latency_ns: Option<u64>,
        to: Transport,
    ) -> AttemptSpan<'a> {
        let failed = self.acct.wc_errors(attempt.transport);
        attempt.failed(failed, Phase::Completion, Reason::WcError, latency_ns);
        if !self.failed_over && to != self.transport {
            self.failed_over = true;
            self.acct.failovers(self.transport, to)[self.op.index()].increment(1);
            events::transport_failover(self.corr, self.op, self.transport, to);
        }
        self.attempt(to)
    }

    /// The request completed successfully.
    pub fn succeed(mut self) {
        self.finish(Outcome::Success);
    }

    /// The request failed terminally for `cause`. The caller logs
    /// `request.failed` ([`events::request_failed`]) because only it knows
    /// the errno returned to the kernel.
    pub fn fail(mut self, cause: FailureCause) {
        self.series.request_failures[cause.index()].increment(1);
        self.finish(Outcome::Failure);
    }

    fn finish(&mut self, outcome: Outcome) {
        if !self.done {
            self.done = true;
            self.series.requests.finish(self.op, outcome);
        }
    }
}

impl Drop for RequestSpan<'_> {
    fn drop(&mut self) {
        self.finish(Outcome::Cancelled);
    }
}

/// A physical attempt in flight; records exactly one outcome.
#[must_use = "dropping the span records the attempt as cancelled"]
pub struct AttemptSpan<'a> {
    series: &'a TransportSeries,
    op: IoOp,
    transport: Transport,
    corr: CorrelationId,
    done: bool,
}

impl std::fmt::Debug for AttemptSpan<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AttemptSpan")
            .field("op", &self.op)
            .field("transport", &self.transport)
            .finish()
    }
}

impl AttemptSpan<'_> {
    /// The attempt succeeded after `latency_ns`.
    pub fn succeed(mut self, latency_ns: u64) {
        self.observe(latency_ns);
        self.finish(Outcome::Success);
    }

    /// The attempt failed for `cause` after `latency_ns` (`None`: its end
    /// was seen only by the transport, and it stays out of the histogram);
    /// logs `attempt.failed`.
    pub fn fail(self, cause: FailureCause, latency_ns: Option<u64>) {
        let counter = &self.series.attempt_failures[cause.index()];
        self.failed(counter, cause.phase(), cause.reason(), latency_ns);
    }

    fn failed(mut self, counter: &Counter, phase: Phase, reason: Reason, latency_ns: Option<u64>) {
        counter.increment(1);
        events::attempt_failed(self.corr, self.op, self.transport, phase, reason);
        if let Some(ns) = latency_ns {
            self.observe(ns);
        }
        self.finish(Outcome::Failure);
    }

    fn observe(&self, latency_ns: u64) {
        self.series.attempt_latency[self.op.index()].record_ns(latency_ns);
    }

    fn finish(&mut self, outcome: Outcome) {
        if !self.done {
            self.done = true;
            self.series.attempts.finish(self.op, outcome);
        }
    }
}

impl Drop for AttemptSpan<'_> {
    fn drop(&mut self) {
        self.finish(Outcome::Cancelled);
    }
}
