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

use crate::correlation::CorrelationId;
use crate::events;
use crate::histogram::LatencyHistogram;
use crate::labels::{IoOp, Outcome, Phase, Reason, Transport};
use crate::shard::{ShardedCounter, ShardedGauge};
use crate::telemetry::Telemetry;
use metrics::Counter;
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::sync::Arc;

const T: usize = Transport::COUNT;
const O: usize = IoOp::COUNT;

/// Started, finished and in flight, per op and transport. Every request
/// touches these from its queue's thread, so they are sharded per thread
/// (registered series render from the start, at zero).
struct Flow {
    started: [[Arc<ShardedCounter>; T]; O],
    outcomes: [[[Arc<ShardedCounter>; Outcome::COUNT]; T]; O],
    inflight: [[Arc<ShardedGauge>; T]; O],
}

impl Flow {
    fn new(
        tel: &Telemetry,
        started: &'static str,
        outcomes: &'static str,
        inflight: &'static str,
    ) -> Flow {
        let labels = |op: IoOp, t: Transport| vec![("op", op.as_str()), ("transport", t.as_str())];
        Flow {
            started: IoOp::ALL
                .map(|op| Transport::ALL.map(|t| tel.sharded_counter(started, &labels(op, t)))),
            outcomes: IoOp::ALL.map(|op| {
                Transport::ALL.map(|t| {
                    Outcome::ALL.map(|o| {
                        let mut l = labels(op, t);
                        l.push(("outcome", o.as_str()));
                        tel.sharded_counter(outcomes, &l)
                    })
                })
            }),
            inflight: IoOp::ALL
                .map(|op| Transport::ALL.map(|t| tel.sharded_gauge(inflight, &labels(op, t)))),
        }
    }

    #[inline]
    fn start(&self, op: IoOp, t: Transport) {
        self.started[op.index()][t.index()].increment(1);
        self.inflight[op.index()][t.index()].increment();
    }

    #[inline]
    fn finish(&self, op: IoOp, t: Transport, outcome: Outcome) {
        self.outcomes[op.index()][t.index()][outcome.index()].increment(1);
        self.inflight[op.index()][t.index()].decrement();
    }
}

/// The request/attempt accounting of one daemon (create one, share it).
pub struct RequestAccounting {
    telemetry: std::sync::Arc<Telemetry>,
    requests: Flow,
    attempts: Flow,
    attempt_latency: [[Arc<LatencyHistogram>; T]; O],
    failovers: [[[Counter; T]; T]; O],
    // Failure counters are registered on first use: the full phase x reason
    // x transport product is large, the set that occurs is small, and the
    // failure path can afford a lock.
    failures: Mutex<BTreeMap<(bool, Transport, Phase, Reason), Counter>>,
}

impl std::fmt::Debug for RequestAccounting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestAccounting").finish_non_exhaustive()
    }
}

impl RequestAccounting {
    /// Registers the families.
    pub fn new(telemetry: &std::sync::Arc<Telemetry>) -> Self {
        let tel = &**telemetry;
        RequestAccounting {
            telemetry: std::sync::Arc::clone(telemetry),
            requests: Flow::new(
                tel,
                "ublk_requests_started_total",
                "ublk_request_outcomes_total",
                "ublk_requests_inflight",
            ),
            attempts: Flow::new(
                tel,
                "ublk_attempts_started_total",
                "ublk_attempt_outcomes_total",
                "ublk_attempts_inflight",
            ),
            attempt_latency: IoOp::ALL.map(|op| {
                Transport::ALL.map(|t| {
                    tel.histogram(
                        "ublk_attempt_latency_seconds",
                        &[("op", op.as_str()), ("transport", t.as_str())],
                    )
                })
            }),
            failovers: IoOp::ALL.map(|op| {
                Transport::ALL.map(|from| {
                    Transport::ALL.map(|to| {
                        tel.counter(
                            "ublk_failovers_total",
                            &[
                                ("op", op.as_str()),
                                ("from", from.as_str()),
                                ("to", to.as_str()),
                            ],
                        )
                    })
                })
            }),
            failures: Mutex::new(BTreeMap::new()),
        }
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
        self.requests.start(op, transport);
        RequestSpan {
            acct: self,
            op,
            transport,
            corr,
            failed_over: false,
            done: false,
        }
    }

    /// The attempt latency histogram of (`op`, `transport`), for exemplars.
    pub fn attempt_latency(&self, op: IoOp, transport: Transport) -> &LatencyHistogram {
        &self.attempt_latency[op.index()][transport.index()]
    }

    fn failure(&self, request: bool, t: Transport, phase: Phase, reason: Reason) {
        let mut map = self.failures.lock();
        let c = map.entry((request, t, phase, reason)).or_insert_with(|| {
            let family = if request {
                "ublk_request_failures_total"
            } else {
                "ublk_attempt_failures_total"
            };
            self.telemetry.counter(
                family,
                &[
                    ("transport", t.as_str()),
                    ("phase", phase.as_str()),
                    ("reason", reason.as_str()),
                ],
            )
        });
        c.increment(1);
    }
}

/// A logical request in flight; records exactly one outcome.
#[must_use = "dropping the span records the request as cancelled"]
pub struct RequestSpan<'a> {
    acct: &'a RequestAccounting,
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
        self.acct.attempts.start(self.op, transport);
        AttemptSpan {
            acct: self.acct,
            op: self.op,
            transport,
            corr: self.corr,
            done: false,
        }
    }

    /// Records that the request moved from its first transport to `to`.
    /// Counted once per request however many times it is called, so a
    /// request that retries on TCP several times is still one failover.
    pub fn failover(&mut self, to: Transport) {
        if self.failed_over || to == self.transport {
            return;
        }
        self.failed_over = true;
        self.acct.failovers[self.op.index()][self.transport.index()][to.index()].increment(1);
        events::transport_failover(self.corr, self.op, self.transport, to);
    }

    /// The request completed successfully.
    pub fn succeed(mut self) {
        self.finish(Outcome::Success);
    }

    /// The request failed terminally in `phase` for `reason`. The caller
    /// logs `request.failed` ([`events::request_failed`]) because only it
    /// knows the errno returned to the kernel.
    pub fn fail(mut self, phase: Phase, reason: Reason) {
        self.acct.failure(true, self.transport, phase, reason);
        self.finish(Outcome::Failure);
    }

    fn finish(&mut self, outcome: Outcome) {
        if !self.done {
            self.done = true;
            self.acct.requests.finish(self.op, self.transport, outcome);
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
    acct: &'a RequestAccounting,
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

    /// The attempt failed in `phase` for `reason` after `latency_ns`
    /// (`None`: its end was seen only by the transport, as for the RDMA
    /// attempt of a failover, and it stays out of the histogram); logs
    /// `attempt.failed`.
    pub fn fail(mut self, phase: Phase, reason: Reason, latency_ns: Option<u64>) {
        self.acct.failure(false, self.transport, phase, reason);
        events::attempt_failed(self.corr, self.op, self.transport, phase, reason);
        if let Some(ns) = latency_ns {
            self.observe(ns);
        }
        self.finish(Outcome::Failure);
    }

    fn observe(&self, latency_ns: u64) {
        self.acct
            .attempt_latency(self.op, self.transport)
            .record_ns(latency_ns);
    }

    fn finish(&mut self, outcome: Outcome) {
        if !self.done {
            self.done = true;
            self.acct.attempts.finish(self.op, self.transport, outcome);
        }
    }
}

impl Drop for AttemptSpan<'_> {
    fn drop(&mut self) {
        self.finish(Outcome::Cancelled);
    }
}
