//! One block request, observed once: from the queue taking it to its
//! completion, [`RequestObs`] (and, once the request reaches its target,
//! [`AttemptObs`]) owns its tracker slot, its logical request and physical
//! attempt accounting, the device's `ublkctl stats` counters, the peer flag
//! readiness reads, and its `request.failed` event. The I/O plane only says
//! what happened; every sink is updated here.
//!
//! Dropped before it finishes (the queue went down mid-request), the
//! request and its attempt count as cancelled and the slot is cleared.

use std::time::{Duration, Instant};

use target_rdma::blob::Via;
use ublk_metrics::{
    events, AttemptSpan, CorrelationId, ErrnoClass, IoOp, Phase, Reason, RequestSpan, TrackerGuard,
    TrackerTable, Transport,
};

use super::DeviceObs;
use crate::device_stats::InFlight;

/// How a request failed: what the kernel gets and where it belongs in the
/// failure taxonomy of `docs/METRICS.md`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Failure {
    /// Positive errno (the kernel gets it negated).
    pub errno: i32,
    /// Where it failed.
    pub phase: Phase,
    /// Why.
    pub reason: Reason,
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
    tracker: Option<TrackerGuard<&'a TrackerTable>>,
    /// Set when the tracker refused the slot (a bug, logged): the latency
    /// is then measured here.
    untracked_since: Option<Instant>,
    span: RequestSpan<'a>,
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
                tracing::error!(event = "tracker.failed", device = self.id(), error = %e);
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
            tracker,
            untracked_since,
            span: self.acct.start_request(op, transport, corr),
        }
    }

    /// The queue got a request of an op ublkd does not serve: refused with
    /// `EOPNOTSUPP` before it is anything the families can name.
    pub fn unsupported(&self, op_flags: u32) {
        self.stats.failed();
        tracing::warn!(
            event = "request.rejected",
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
        let (phase, reason) = (Phase::Post, Reason::Protocol);
        events::request_failed(
            self.corr,
            Some(self.dev.id()),
            self.op,
            ErrnoClass::from_errno(errno),
            phase,
            reason,
        );
        tracing::warn!(
            event = "request.rejected",
            corr = self.corr.get(),
            op_flags,
            start_sector,
            nr_sectors,
            errno
        );
        self.complete(0, Err(errno));
        self.span.fail(phase, reason);
    }

    /// The request goes to its target: its first attempt starts.
    pub fn dispatched(self) -> AttemptObs<'a> {
        AttemptObs {
            _inflight: self.dev.stats.start(),
            attempt: self.span.attempt(self.transport),
            req: self,
        }
    }

    /// Device I/O families (count, bytes or errno class, latency) and the
    /// tracker slot.
    fn complete(&mut self, bytes: u64, result: Result<(), i32>) {
        let latency = match self.tracker.take() {
            Some(g) => g.complete(&self.dev.io, bytes, result),
            None => {
                let latency = self.untracked_since.map_or(Duration::ZERO, |s| s.elapsed());
                self.dev.io.record(self.op, bytes, result, latency);
                latency
            }
        };
        self.dev.stats.completed_in(self.op, latency);
    }
}

impl AttemptObs<'_> {
    /// The target served the request; `via` says how its payloads went. A
    /// failover is one failed attempt on the first transport, one on TCP,
    /// and one failover.
    pub fn succeeded(mut self, bytes: u64, via: Via) {
        let mut attempt = self.attempt;
        if via.failed_over() {
            // The RDMA attempt failed (its work request errored or timed
            // out, counted by the driver) and TCP carried the payload.
            attempt.fail(Phase::Completion, Reason::WcError);
            self.req.span.failover(Transport::Tcp);
            attempt = self.req.span.attempt(Transport::Tcp);
        }
        attempt.succeed();
        let req = &mut self.req;
        req.dev.peer_ok();
        req.dev.stats.done(req.op, bytes);
        req.complete(bytes, Ok(()));
        let RequestObs { span, .. } = self.req;
        span.succeed();
    }

    /// The target failed the request with `error`, classified as `failure`.
    pub fn failed(mut self, failure: &Failure, error: &dyn std::fmt::Display) {
        let Failure {
            errno,
            phase,
            reason,
            peer_gone,
        } = *failure;
        self.attempt.fail(phase, reason);
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
        tracing::debug!(event = "request.error", corr = req.corr.get(), error = %error);
        req.complete(0, Err(errno));
        let RequestObs { span, .. } = self.req;
        span.fail(phase, reason);
    }
}
