//! Driver statistics of the RDMA transport: plain atomic counters and gauges
//! that the metrics crate exports as `ublk_driver_<name>_total` (counters)
//! and `ublk_driver_<name>` (gauges). Counters only ever increase.
//!
//! Accounting, checked by tests: every RDMA work request posted ends in
//! exactly one attempt outcome, so `rdma_requests = rdma_transferred +
//! rdma_failed + rdma_timed_out + in flight`. A block request whose attempts
//! failed and that was then served over TCP counts once in `rdma_declined`
//! (and once in `tcp_payload_qp_error`); one whose lease answer made no sense
//! counts in `rdma_protocol_errors` and is never posted.

use std::sync::atomic::{AtomicU64, Ordering};

use super::{RdmaOp, WcCategory};

/// Why a payload went over the TCP stream instead of RDMA: a closed set.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TcpReason {
    /// Smaller than `min_rdma_bytes`: a control round trip costs more.
    BelowThreshold,
    /// Larger than one registered buffer.
    TooLarge,
    /// The peer declined RDMA (no device, or the rail setup failed there).
    Declined,
    /// Registering the caller's memory failed.
    RegistrationFailed,
    /// The QP is in error and being re-established.
    QpError,
    /// This host has no usable RDMA device (`transport = auto`).
    NoLocalDevice,
    /// The peer had no slot to lease (BUSY even after our idle cached
    /// leases were given back); an inline request needs no lease.
    ArenaBusy,
}

impl TcpReason {
    /// Every reason, for exporters that pre-create series.
    pub const ALL: [TcpReason; 7] = [
        Self::BelowThreshold,
        Self::TooLarge,
        Self::Declined,
        Self::RegistrationFailed,
        Self::QpError,
        Self::NoLocalDevice,
        Self::ArenaBusy,
    ];

    /// Stable lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            Self::BelowThreshold => "below_threshold",
            Self::TooLarge => "too_large",
            Self::Declined => "declined_by_peer",
            Self::RegistrationFailed => "registration_failed",
            Self::QpError => "qp_error",
            Self::NoLocalDevice => "no_local_device",
            Self::ArenaBusy => "arena_busy",
        }
    }
}

/// The per-direction share of the request counters: every increment of a
/// per-op counter goes with one of the matching total in [`RdmaStats`],
/// so the two directions always sum to the total.
#[derive(Default, Debug)]
pub struct OpCounters {
    /// RDMA work requests posted.
    pub requests: AtomicU64,
    /// Work requests whose payload moved by RDMA.
    pub transferred: AtomicU64,
    /// Requests that failed on RDMA and were served over TCP.
    pub declined: AtomicU64,
    /// Work requests that failed.
    pub failed: AtomicU64,
    /// Work requests that timed out.
    pub timed_out: AtomicU64,
    /// Payload requests sent inline on TCP, by reason ([`TcpReason::ALL`] order).
    pub tcp: [AtomicU64; 7],
    /// Bytes of those payloads, by reason.
    pub tcp_bytes: [AtomicU64; 7],
}

/// Counters and gauges of one RDMA transport (one queue's connection).
#[derive(Default, Debug)]
pub struct RdmaStats {
    /// Per direction (index 0: READ, 1: WRITE); see [`RdmaStats::op`].
    pub per_op: [OpCounters; 2],
    /// RDMA READ/WRITE requests posted.
    pub rdma_requests: AtomicU64,
    /// Requests whose payload moved by RDMA.
    pub rdma_transferred: AtomicU64,
    /// Block requests that failed on RDMA and were then served over TCP (failover).
    pub rdma_declined: AtomicU64,
    /// Work requests that completed in error (or could not be posted).
    pub rdma_failed: AtomicU64,
    /// Block requests refused before posting because the peer's lease or rail answer made no sense.
    pub rdma_protocol_errors: AtomicU64,
    /// Work requests that got no completion in time.
    pub rdma_timed_out: AtomicU64,
    /// Payload requests sent inline on TCP, by reason (see [`TcpReason::ALL`]).
    pub tcp_payload: [AtomicU64; 7],
    /// Transfers served from pre-registered memory (the pool or a registered I/O region).
    pub registrations_pooled: AtomicU64,
    /// Transfers that registered the caller's memory just for themselves.
    pub registrations_per_op: AtomicU64,
    /// Transfers that copied through a pool buffer because the caller's memory was not registered.
    pub bounce_copies: AtomicU64,
    /// Memory registrations that failed.
    pub registration_failures: AtomicU64,
    /// ALLOC requests the peer refused.
    pub alloc_failures: AtomicU64,
    /// GET requests and lease ends (COMMIT/RELEASE) the peer refused.
    pub lease_failures: AtomicU64,
    /// Reads and writes served by a cached lease (no control round trip).
    pub lease_cache_hits: AtomicU64,
    /// Cached leases given back because the peer revoked them.
    pub lease_revocations: AtomicU64,
    /// Work completions in error, by category (index: [`WcCategory`] order).
    pub wc_errors: [AtomicU64; 6],
    /// Completions whose wr id matched no waiter.
    pub unknown_completions: AtomicU64,
    /// Rails (QP + endpoint exchange) established, the first included.
    pub rail_connects: AtomicU64,
    /// Rails that failed to come up.
    pub rail_connect_failures: AtomicU64,
    /// Bytes moved by RDMA READ.
    pub bytes_read: AtomicU64,
    /// Bytes moved by RDMA WRITE.
    pub bytes_written: AtomicU64,
    /// Gauge: pool buffers.
    pub pool_buffers: AtomicU64,
    /// Gauge: pool buffers in use now.
    pub pool_in_use: AtomicU64,
    /// Gauge: most pool buffers ever in use at once.
    pub pool_peak: AtomicU64,
}

pub(crate) const WC_ORDER: [WcCategory; 6] = [
    WcCategory::RetryExceeded,
    WcCategory::RnrRetryExceeded,
    WcCategory::RemoteAccess,
    WcCategory::LocalProtection,
    WcCategory::Flush,
    WcCategory::Other,
];

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

impl RdmaStats {
    /// The per-direction counters of `op`.
    pub fn op(&self, op: RdmaOp) -> &OpCounters {
        match op {
            RdmaOp::Read => &self.per_op[0],
            RdmaOp::Write => &self.per_op[1],
        }
    }

    /// Increments a total and its share for `op`.
    pub fn inc_op(
        &self,
        op: RdmaOp,
        total: impl Fn(&Self) -> &AtomicU64,
        share: impl Fn(&OpCounters) -> &AtomicU64,
    ) {
        bump(total(self));
        bump(share(self.op(op)));
    }

    /// Counts a payload request of `bytes` sent over TCP for `reason`.
    pub fn tcp_payload(&self, op: RdmaOp, reason: TcpReason, bytes: usize) {
        let i = reason as usize;
        bump(&self.tcp_payload[i]);
        bump(&self.op(op).tcp[i]);
        self.op(op).tcp_bytes[i].fetch_add(bytes as u64, Ordering::Relaxed);
    }

    /// Payload requests sent over TCP for `reason`.
    pub fn tcp_count(&self, reason: TcpReason) -> u64 {
        self.tcp_payload[reason as usize].load(Ordering::Relaxed)
    }

    /// Counts a work completion error.
    pub fn wc_error(&self, cat: WcCategory) {
        let i = WC_ORDER.iter().position(|c| *c == cat).unwrap_or(5);
        bump(&self.wc_errors[i]);
    }

    /// Increments a counter.
    pub fn inc(&self, c: impl Fn(&Self) -> &AtomicU64) {
        bump(c(self));
    }

    /// Marks one pool buffer taken, keeping the peak.
    pub fn pool_take(&self) {
        let now = self.pool_in_use.fetch_add(1, Ordering::Relaxed) + 1;
        self.pool_peak.fetch_max(now, Ordering::Relaxed);
    }

    /// Marks one pool buffer returned.
    pub fn pool_return(&self) {
        self.pool_in_use.fetch_sub(1, Ordering::Relaxed);
    }

    /// Every counter (`_total` when exported) and gauge by its public name.
    pub fn snapshot(&self) -> Vec<(&'static str, u64)> {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let mut v = vec![
            ("rdma_requests", g(&self.rdma_requests)),
            ("rdma_transferred", g(&self.rdma_transferred)),
            ("rdma_declined_served_tcp", g(&self.rdma_declined)),
            ("rdma_failed", g(&self.rdma_failed)),
            ("rdma_protocol_errors", g(&self.rdma_protocol_errors)),
            ("rdma_timed_out", g(&self.rdma_timed_out)),
        ];
        for r in TcpReason::ALL {
            v.push((tcp_name(r), self.tcp_count(r)));
        }
        v.extend([
            ("registrations_pooled", g(&self.registrations_pooled)),
            ("registrations_per_op", g(&self.registrations_per_op)),
            ("bounce_copies", g(&self.bounce_copies)),
            ("registration_failures", g(&self.registration_failures)),
            ("alloc_failures", g(&self.alloc_failures)),
            ("lease_failures", g(&self.lease_failures)),
            ("lease_cache_hits", g(&self.lease_cache_hits)),
            ("lease_revocations", g(&self.lease_revocations)),
        ]);
        for (i, c) in WC_ORDER.iter().enumerate() {
            v.push((wc_name(*c), g(&self.wc_errors[i])));
        }
        v.extend([
            ("unknown_completions", g(&self.unknown_completions)),
            ("rail_connects", g(&self.rail_connects)),
            ("rail_connect_failures", g(&self.rail_connect_failures)),
            ("bytes_read", g(&self.bytes_read)),
            ("bytes_written", g(&self.bytes_written)),
            ("pool_buffers", g(&self.pool_buffers)),
            ("pool_buffers_in_use", g(&self.pool_in_use)),
            ("pool_buffers_peak", g(&self.pool_peak)),
        ]);
        v
    }

    /// Names of the gauges in [`snapshot`](Self::snapshot); all others are counters.
    pub const GAUGES: [&'static str; 3] =
        ["pool_buffers", "pool_buffers_in_use", "pool_buffers_peak"];
}

fn tcp_name(r: TcpReason) -> &'static str {
    match r {
        TcpReason::BelowThreshold => "tcp_payload_below_threshold",
        TcpReason::TooLarge => "tcp_payload_too_large",
        TcpReason::Declined => "tcp_payload_declined_by_peer",
        TcpReason::RegistrationFailed => "tcp_payload_registration_failed",
        TcpReason::QpError => "tcp_payload_qp_error",
        TcpReason::NoLocalDevice => "tcp_payload_no_local_device",
        TcpReason::ArenaBusy => "tcp_payload_arena_busy",
    }
}

fn wc_name(c: WcCategory) -> &'static str {
    match c {
        WcCategory::RetryExceeded => "wc_error_retry_exceeded",
        WcCategory::RnrRetryExceeded => "wc_error_rnr_retry_exceeded",
        WcCategory::RemoteAccess => "wc_error_remote_access",
        WcCategory::LocalProtection => "wc_error_local_protection",
        WcCategory::Flush => "wc_error_flush",
        WcCategory::Other => "wc_error_other",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get(s: &RdmaStats, name: &str) -> u64 {
        s.snapshot().iter().find(|(n, _)| *n == name).unwrap().1
    }

    #[test]
    fn snapshot_names_are_unique_and_map_their_counters() {
        let s = RdmaStats::default();
        let snap = s.snapshot();
        let mut names: Vec<_> = snap.iter().map(|(n, _)| *n).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), snap.len());
        for r in TcpReason::ALL {
            s.tcp_payload(RdmaOp::Write, r, 10);
            assert_eq!(get(&s, tcp_name(r)), 1, "{}", r.name());
            assert_eq!(
                s.op(RdmaOp::Write).tcp_bytes[r as usize].load(Ordering::Relaxed),
                10
            );
        }
        s.inc_op(RdmaOp::Read, |s| &s.rdma_failed, |o| &o.failed);
        assert_eq!(get(&s, "rdma_failed"), 1);
        assert_eq!(s.op(RdmaOp::Read).failed.load(Ordering::Relaxed), 1);
        for c in WC_ORDER {
            s.wc_error(c);
            assert_eq!(get(&s, wc_name(c)), 1, "{}", c.name());
        }
        s.inc(|s| &s.rdma_transferred);
        assert_eq!(get(&s, "rdma_transferred"), 1);
        for g in RdmaStats::GAUGES {
            assert!(names.contains(&g));
        }
    }

    #[test]
    fn pool_gauges_keep_the_peak() {
        let s = RdmaStats::default();
        s.pool_take();
        s.pool_take();
        s.pool_return();
        s.pool_take();
        s.pool_return();
        s.pool_return();
        assert_eq!(
            (get(&s, "pool_buffers_in_use"), get(&s, "pool_buffers_peak")),
            (0, 2)
        );
    }
}
