//! One block request, observed once: from the queue taking it to its
//! completion, [`RequestObs`] (and, once the request reaches its target,
//! [`AttemptObs`]) owns its tracker slot, its logical request and physical
//! attempt accounting, the device's `ublkctl stats` counters, the peer flag
//! readiness reads, its `request.failed` event and, with tracing on, its
//! spans and exemplars. The I/O plane only says what happened; every sink
//! is updated here.
//!
//! A span is kept or not only at the request's end (was it slow, did it
//! fail?), so the observer carries what the spans need in fields it has
//! anyway (start in the tracker slot, op, correlation id, the time the
//! attempt was dispatched) and hands them to the tracer at completion: no
//! allocation per I/O, nothing emitted for a request that is not retained.
//!
//! Dropped before it finishes (the queue went down mid-request), the
//! request and its attempt count as cancelled, the slot is cleared and,
//! with tracing on, the cancelled request's spans are emitted.

use std::time::{Duration, Instant};

use target_rdma::blob::Via;
use ublk_metrics::{
    events, AttemptRecord, AttemptSpan, CorrelationId, ErrnoClass, FailureCause, IoOp, Phase,
    Reason, RequestRecord, RequestSpan, SpanEnd, TrackerGuard, TrackerTable, Transport,
};

use super::{DeviceObs, TARGET};
use crate::device_stats::InFlight;

/// How a request failed: what the kernel gets and where it belongs in the
/// failure taxonomy of `docs/METRICS.md`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Failure {
    /// Positive errno (the kernel gets it negated).
    pub errno: i32,
    /// Where it failed and why.
    pub cause: FailureCause,
    /// The arena connection is gone: readiness reports `peer_disconnected`
    /// until it is back.
    pub peer_gone: bool,
}

/// A request the queue took, not yet at its target.
#[must_use = "dropping the observer records the request as cancelled"]
pub struct RequestObs<'a> {
    dev: &'a DeviceObs,
    op: IoOp,
    /// Transport of the first attempt.
    transport: Transport,
    corr: CorrelationId,
    slot: Slot<'a>,
    span: RequestSpan<'a>,
}

/// The request's tracker slot and the timing its spans need; dropped
/// before [`Slot::complete`], the request was cancelled.
struct Slot<'a> {
    dev: &'a DeviceObs,
    op: IoOp,
    transport: Transport,
    corr: CorrelationId,
    tracker: Option<TrackerGuard<&'a TrackerTable>>,
    /// Set when the tracker refused the slot (a bug, logged): the latency
    /// is then measured here.
    untracked_since: Option<Instant>,
    /// Time from the start to the dispatch of the first attempt, once
    /// dispatched.
    dispatched_ns: Option<u64>,
    done: bool,
}

/// A request at its target: one attempt in flight on the transport it
/// started on.
#[must_use = "dropping the observer records the request as cancelled"]
pub struct AttemptObs<'a> {
    req: RequestObs<'a>,
    attempt: AttemptSpan<'a>,
    _inflight: InFlight<'a>,
}

impl DeviceObs {
    /// The queue took a request of `op` on (`queue`, `tag`), whose first
    /// attempt goes on `transport`: its slot is set and it counts as
    /// started.
    #[inline]
    pub fn begin(&self, queue: u16, tag: u16, op: IoOp, transport: Transport) -> RequestObs<'_> {
        let tracker = match self.table.start(queue, tag, op) {
            Ok(g) => Some(g),
            Err(e) => {
                // ublk never reuses a busy tag and the table has the device's
                // geometry, so this is a bug; count the request anyway.
                tracing::error!(event = events::TRACKER_FAILED, device = self.id(), error = %e);
                None
            }
        };
        let untracked_since = tracker.is_none().then(Instant::now);
        let corr = tracker
            .as_ref()
            .map_or_else(CorrelationId::next, |g| g.correlation_id());
        RequestObs {
            dev: self,
            op,
            transport,
            corr,
            slot: Slot {
                dev: self,
                op,
                transport,
                corr,
                tracker,
                untracked_since,
                dispatched_ns: None,
                done: false,
            },
            span: self.acct.start_request(op, transport, corr),
        }
    }

    /// The queue got a request of an op ublkd does not serve: refused with
    /// `EOPNOTSUPP` before it is anything the families can name.
    pub fn unsupported(&self, op_flags: u32) {
        self.stats.failed();
        tracing::warn!(
            event = events::REQUEST_REJECTED,
            op_flags,
            errno = libc::EOPNOTSUPP
        );
    }
}

impl<'a> RequestObs<'a> {
    /// The request's descriptor did not make sense (refused with `errno`
    /// before reaching the target): a failure in `post`, `protocol`.
    pub fn rejected(mut self, errno: i32, op_flags: u32, start_sector: u64, nr_sectors: u32) {
        self.dev.stats.failed();
        let cause = FailureCause::PostProtocol;
        let (phase, reason) = (cause.phase(), cause.reason());
        events::request_failed(
            self.corr,
            Some(self.dev.id()),
            self.op,
            ErrnoClass::from_errno(errno),
            phase,
            reason,
        );
        tracing::warn!(
            event = events::REQUEST_REJECTED,
            corr = self.corr.get(),
            op_flags,
            start_sector,
            nr_sectors,
            errno
        );
        let end = SpanEnd::Failure { phase, reason };
        self.slot
            .complete(0, Err(errno), end, errno.unsigned_abs(), [None, None]);
        self.span.fail(cause);
    }

    /// The request goes to its target: its first attempt starts.
    pub fn dispatched(mut self) -> AttemptObs<'a> {
        self.slot.dispatched_ns = Some(self.slot.elapsed_ns());
        AttemptObs {
            _inflight: self.dev.stats.start(),
            attempt: self.span.attempt(self.transport),
            req: self,
        }
    }
}

/// The attempts of a request as its spans show them: the first, and the
/// TCP attempt it failed over to.
type Attempts = [Option<AttemptRecord>; 2];

impl Slot<'_> {
    /// Time since the start.
    fn elapsed_ns(&self) -> u64 {
        let d = match &self.tracker {
            Some(g) => g.elapsed(),
            None => self.untracked_since.map_or(Duration::ZERO, |s| s.elapsed()),
        };
        u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
    }

    /// Device I/O families (count, bytes or errno class, latency), the
    /// tracker slot, the `ublkctl stats` latency and, with tracing on, the
    /// spans and exemplars. `errno` is positive, 0 on success; `attempts` as
    /// far as the caller knows them (none: never dispatched). Returns the
    /// request's latency and the last attempt's, from its dispatch.
    fn complete(
        &mut self,
        bytes: u64,
        result: Result<(), i32>,
        end: SpanEnd,
        errno: u32,
        attempts: Attempts,
    ) -> (u64, Option<u64>) {
        self.done = true;
        let latency_ns = match self.tracker.take() {
            Some(g) => {
                let d = g.complete(&self.dev.io, bytes, result);
                u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
            }
            None => {
                let latency = self.untracked_since.map_or(Duration::ZERO, |s| s.elapsed());
                self.dev.io.record(self.op, bytes, result, latency);
                u64::try_from(latency.as_nanos()).unwrap_or(u64::MAX)
            }
        };
        self.dev
            .stats
            .completed_in(self.op, Duration::from_nanos(latency_ns));
        let attempt_ns = self.dispatched_ns.map(|d| latency_ns.saturating_sub(d));
        self.trace(latency_ns, end, errno, attempt_ns, attempts);
        (latency_ns, attempt_ns)
    }

    /// The root span of this request; `errno` positive, 0 for none.
    fn record(&self, latency_ns: u64, end: SpanEnd, errno: u32) -> RequestRecord<'static> {
        RequestRecord {
            corr: self.corr,
            target: TARGET,
            device: Some(self.dev.id()),
            op: self.op,
            transport: self.transport,
            latency_ns,
            end,
            errno: (errno != 0).then_some(errno),
        }
    }

    /// Hands the request to the tracer; a retained one becomes the
    /// exemplar of its latency buckets (request and measured attempts).
    #[inline]
    fn trace(
        &self,
        latency_ns: u64,
        end: SpanEnd,
        errno: u32,
        last_attempt_ns: Option<u64>,
        mut attempts: Attempts,
    ) {
        let Some(tracer) = &self.dev.tracer else {
            return;
        };
        let all_succeeded =
            end == SpanEnd::Success && attempts.iter().flatten().all(|a| a.end == SpanEnd::Success);
        if all_succeeded && !tracer.keeps_success(self.corr, latency_ns) {
            return;
        }
        // The last attempt present is timed from the dispatch.
        if let Some(last) = attempts.iter_mut().rev().flatten().next() {
            last.latency_ns = last_attempt_ns;
        }
        let n = attempts.iter().flatten().count();
        let list: [AttemptRecord; 2] = attempts.map(|a| {
            a.unwrap_or(AttemptRecord {
                transport: self.transport,
                latency_ns: None,
                end: SpanEnd::Cancelled,
            })
        });
        let record = self.record(latency_ns, end, errno);
        if tracer.finish(&record, &list[..n]).is_some() {
            self.dev.io.latency(self.op).exemplar(latency_ns, self.corr);
            for a in &list[..n] {
                if let Some(ns) = a.latency_ns {
                    self.dev
                        .acct
                        .attempt_latency(self.op, a.transport)
                        .exemplar(ns, self.corr);
                }
            }
        }
    }
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        if self.done || self.dev.tracer.is_none() {
            return;
        }
        // Cancelled: its spans say so (the tracker guard, dropped after
        // this, clears the slot).
        let latency_ns = self.elapsed_ns();
        let attempt = self.dispatched_ns.map(|d| AttemptRecord {
            transport: self.transport,
            latency_ns: Some(latency_ns.saturating_sub(d)),
            end: SpanEnd::Cancelled,
        });
        let record = self.record(latency_ns, SpanEnd::Cancelled, 0);
        if let Some(tracer) = &self.dev.tracer {
            tracer.finish(&record, attempt.as_slice());
        }
    }
}

impl AttemptObs<'_> {
    /// The target served the request; `via` says how its payloads went. A
    /// failover is one failed attempt on the first transport, one on TCP,
    /// and one failover.
    ///
    /// The failed RDMA attempt of a failover ends where only the transport
    /// sees it: it has no duration here, and the TCP attempt is timed from
    /// the dispatch.
    pub fn succeeded(mut self, bytes: u64, via: Via) {
        let mut attempt = self.attempt;
        let ok = AttemptRecord {
            transport: self.req.transport,
            latency_ns: None,
            end: SpanEnd::Success,
        };
        let mut attempts: Attempts = [Some(ok), None];
        if via.failed_over() {
            // The RDMA attempt failed (its work request errored or timed
            // out, counted by the driver) and TCP carried the payload.
            let (phase, reason) = (Phase::Completion, Reason::WcError);
            attempt = self.req.span.fail_over(attempt, None, Transport::Tcp);
            attempts = [
                Some(AttemptRecord {
                    end: SpanEnd::Failure { phase, reason },
                    ..ok
                }),
                Some(AttemptRecord {
                    transport: Transport::Tcp,
                    ..ok
                }),
            ];
        }
        let req = &mut self.req;
        req.dev.peer_ok();
        req.dev.stats.done(req.op, bytes);
        let (_, attempt_ns) = req
            .slot
            .complete(bytes, Ok(()), SpanEnd::Success, 0, attempts);
        attempt.succeed(attempt_ns.unwrap_or(0));
        let RequestObs { span, .. } = self.req;
        span.succeed();
    }

    /// The target failed the request with `error`, classified as `failure`.
    pub fn failed(mut self, failure: &Failure, error: &dyn std::fmt::Display) {
        let Failure {
            errno,
            cause,
            peer_gone,
        } = *failure;
        let (phase, reason) = (cause.phase(), cause.reason());
        let req = &mut self.req;
        if peer_gone {
            req.dev.peer_lost(phase, reason);
        }
        req.dev.stats.failed();
        events::request_failed(
            req.corr,
            Some(req.dev.id()),
            req.op,
            ErrnoClass::from_errno(errno),
            phase,
            reason,
        );
        tracing::debug!(event = events::REQUEST_ERROR, corr = req.corr.get(), error = %error);
        let end = SpanEnd::Failure { phase, reason };
        let attempt = AttemptRecord {
            transport: req.transport,
            latency_ns: None,
            end,
        };
        let (_, attempt_ns) = req.slot.complete(
            0,
            Err(errno),
            end,
            errno.unsigned_abs(),
            [Some(attempt), None],
        );
        self.attempt.fail(cause, attempt_ns);
        let RequestObs { span, .. } = self.req;
        span.fail(cause);
    }
}
