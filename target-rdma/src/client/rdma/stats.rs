//! Driver statistics of the RDMA transport: plain atomic counters and
//! gauges per queue ([`RdmaStats`]), summed per device and reported in the
//! metrics crate's driver contract ([`RdmaDriverStats`]) under the
//! well-known names of [`ublk_metrics::driver::names`], per op where the
//! transport splits them; names the contract does not know (wc error
//! categories, lease cache, rails, bounce copies, bytes) are reported under
//! their own. Counters only ever increase.
//!
//! Accounting, checked by tests: every RDMA work request posted ends in
//! exactly one attempt outcome, so `rdma_requests = rdma_transferred +
//! rdma_failed + rdma_timed_out + in flight`. A block request whose attempts
//! failed and that was then served over TCP counts once in
//! `rdma_declined_served_tcp` (and once in `tcp_payload_requests` with reason
//! `qp_error`); one whose lease answer made no sense counts in
//! `rdma_protocol_errors` and is never posted.

use std::borrow::Cow;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use ublk_metrics::driver::{names, CounterValue, GaugeValue, RailValue};
use ublk_metrics::{DriverSnapshot, IoOp};

use crate::client::tcp::ClientStats;
use crate::proto::MAX_RAILS;
use crate::rdma::{RdmaOp, WcCategory};

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
    /// A read of a blob that is in swap only: the peer reads just the
    /// range from swap rather than faulting the whole blob in first.
    ColdBlob,
}

impl TcpReason {
    /// Every reason, for exporters that pre-create series.
    pub const ALL: [TcpReason; 8] = [
        Self::BelowThreshold,
        Self::TooLarge,
        Self::Declined,
        Self::RegistrationFailed,
        Self::QpError,
        Self::NoLocalDevice,
        Self::ArenaBusy,
        Self::ColdBlob,
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
            Self::ColdBlob => "cold_blob",
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
    pub tcp: [AtomicU64; TcpReason::ALL.len()],
    /// Bytes of those payloads, by reason.
    pub tcp_bytes: [AtomicU64; TcpReason::ALL.len()],
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
    pub tcp_payload: [AtomicU64; TcpReason::ALL.len()],
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
    /// Payloads split across two rails.
    pub striped: AtomicU64,
    /// Gauge: pool buffers.
    pub pool_buffers: AtomicU64,
    /// Gauge: pool buffers in use now.
    pub pool_in_use: AtomicU64,
    /// Gauge: most pool buffers ever in use at once.
    pub pool_peak: AtomicU64,
    /// Per rail (index: the rail's).
    pub rails: [RailCounters; MAX_RAILS],
}

/// One rail of a transport: its device, its state and what it carried.
#[derive(Default, Debug)]
pub struct RailCounters {
    /// The local RDMA device (empty: none).
    pub device: OnceLock<String>,
    /// Why it will not be used, once it will not.
    pub off: OnceLock<String>,
    /// Its QP is up.
    pub up: AtomicBool,
    /// Since when (Unix ms) its QP is down after being lost or failing to
    /// come up; 0 while up.
    pub down_since_ms: AtomicU64,
    /// QPs brought up on it.
    pub connects: AtomicU64,
    /// Transfers it moved (each chunk of a striped payload counts).
    pub transfers: AtomicU64,
    /// Payload bytes it moved.
    pub bytes: AtomicU64,
    /// Gauge: payload bytes posted on it and not completed yet.
    pub outstanding: AtomicU64,
    /// Its QP failed under load (an error completion or a timeout).
    pub lost: AtomicU64,
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
}

/// The driver statistics of one device: the sum over its queues.
#[derive(Debug)]
pub struct RdmaDriverStats {
    driver: &'static str,
    queues: Vec<Arc<RdmaStats>>,
    client: Arc<ClientStats>,
}

impl RdmaDriverStats {
    /// Sums `queues`. `driver` is the `driver` label: `rdma` when the device
    /// negotiated RDMA, `tcp` when it serves every payload inline (an `auto`
    /// device whose peer or host has no RDMA), so its TCP payloads are
    /// reported with the reason and not mixed with RDMA devices.
    /// `client` is what the queues' control connections share: its
    /// connection counters are reported too (its inline payloads are
    /// already counted by the queues, by reason).
    pub fn new(
        driver: &'static str,
        queues: Vec<Arc<RdmaStats>>,
        client: Arc<ClientStats>,
    ) -> Self {
        Self {
            driver,
            queues,
            client,
        }
    }

    /// Each rail with a device on some queue, over the queues.
    fn rails(&self) -> Vec<RailValue> {
        (0..MAX_RAILS)
            .filter_map(|i| {
                let rails = self.queues.iter().map(|q| &q.rails[i]);
                let device = rails.clone().find_map(|r| r.device.get())?.clone();
                let mut v = RailValue {
                    rail: i as u8,
                    rdma_device: device,
                    ..RailValue::default()
                };
                for r in rails {
                    v.queues += 1;
                    v.queues_up += u32::from(r.up.load(Ordering::Relaxed));
                    if v.off.is_none() {
                        v.off = r.off.get().cloned();
                    }
                    let since = r.down_since_ms.load(Ordering::Relaxed);
                    if since != 0 && !r.up.load(Ordering::Relaxed) {
                        v.down_since_ms = Some(v.down_since_ms.map_or(since, |s| s.min(since)));
                    }
                    for (t, c) in [
                        (&mut v.transfers, &r.transfers),
                        (&mut v.bytes, &r.bytes),
                        (&mut v.outstanding, &r.outstanding),
                        (&mut v.lost, &r.lost),
                        (&mut v.connects, &r.connects),
                    ] {
                        *t = t.saturating_add(c.load(Ordering::Relaxed));
                    }
                }
                Some(v)
            })
            .collect()
    }

    fn sum(&self, f: impl Fn(&RdmaStats) -> &AtomicU64) -> u64 {
        self.queues
            .iter()
            .fold(0u64, |a, q| a.saturating_add(f(q).load(Ordering::Relaxed)))
    }
}

fn io_op(op: RdmaOp) -> IoOp {
    match op {
        RdmaOp::Read => IoOp::Read,
        RdmaOp::Write => IoOp::Write,
    }
}

fn counter(name: &'static str, op: Option<IoOp>, value: u64) -> CounterValue {
    CounterValue {
        name: Cow::Borrowed(name),
        op,
        reason: None,
        value,
    }
}

impl ublk_metrics::DriverStats for RdmaDriverStats {
    fn snapshot(&self) -> DriverSnapshot {
        let mut counters = Vec::with_capacity(64);
        type Share = fn(&OpCounters) -> &AtomicU64;
        let per_op: [(&'static str, Share); 5] = [
            (names::RDMA_REQUESTS, |o| &o.requests),
            (names::RDMA_TRANSFERRED, |o| &o.transferred),
            (names::RDMA_DECLINED_SERVED_TCP, |o| &o.declined),
            (names::RDMA_FAILED, |o| &o.failed),
            (names::RDMA_TIMED_OUT, |o| &o.timed_out),
        ];
        for op in [RdmaOp::Read, RdmaOp::Write] {
            for (name, share) in per_op {
                counters.push(counter(
                    name,
                    Some(io_op(op)),
                    self.sum(|q| share(q.op(op))),
                ));
            }
            for reason in TcpReason::ALL {
                let i = reason as usize;
                for (name, value) in [
                    (names::TCP_PAYLOAD_REQUESTS, self.sum(|q| &q.op(op).tcp[i])),
                    (
                        names::TCP_PAYLOAD_BYTES,
                        self.sum(|q| &q.op(op).tcp_bytes[i]),
                    ),
                ] {
                    counters.push(CounterValue {
                        reason: Some(Cow::Borrowed(reason.name())),
                        ..counter(name, Some(io_op(op)), value)
                    });
                }
            }
            let bytes = match op {
                RdmaOp::Read => self.sum(|q| &q.bytes_read),
                RdmaOp::Write => self.sum(|q| &q.bytes_written),
            };
            counters.push(counter("rdma_bytes", Some(io_op(op)), bytes));
        }
        type Total = fn(&RdmaStats) -> &AtomicU64;
        let totals: [(&'static str, Total); 11] = [
            (names::RDMA_PROTOCOL_ERRORS, |s| &s.rdma_protocol_errors),
            (names::REGISTRATIONS_POOLED, |s| &s.registrations_pooled),
            (names::REGISTRATIONS_PER_OP, |s| &s.registrations_per_op),
            (names::REGISTRATION_FAILURES, |s| &s.registration_failures),
            // ALLOC refused by the peer: no arena slot for the write.
            (names::ALLOCATION_FAILURES, |s| &s.alloc_failures),
            (names::LEASE_FAILURES, |s| &s.lease_failures),
            ("bounce_copies", |s| &s.bounce_copies),
            ("lease_cache_hits", |s| &s.lease_cache_hits),
            ("lease_revocations", |s| &s.lease_revocations),
            ("rail_connects", |s| &s.rail_connects),
            ("rail_connect_failures", |s| &s.rail_connect_failures),
        ];
        for (name, total) in totals {
            counters.push(counter(name, None, self.sum(total)));
        }
        for (i, category) in WC_ORDER.iter().enumerate() {
            counters.push(CounterValue {
                reason: Some(Cow::Borrowed(category.name())),
                ..counter("wc_errors", None, self.sum(|q| &q.wc_errors[i]))
            });
        }
        counters.extend(self.client.connection_counters());
        let buffers = self.sum(|q| &q.pool_buffers);
        let in_use = self.sum(|q| &q.pool_in_use);
        let gauges = [
            (names::BUFFER_POOL_FREE, buffers.saturating_sub(in_use)),
            (names::BUFFER_POOL_IN_USE, in_use),
            (names::BUFFER_POOL_PEAK, self.sum(|q| &q.pool_peak)),
        ]
        .into_iter()
        .map(|(name, v)| GaugeValue {
            name: Cow::Borrowed(name),
            value: v as f64,
        })
        .collect();
        DriverSnapshot {
            driver: Cow::Borrowed(self.driver),
            counters,
            gauges,
            rails: self.rails(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ublk_metrics::driver::{summarize, DeviceDriverReport};
    use ublk_metrics::{DriverStats as _, Transport};

    fn queue() -> Arc<RdmaStats> {
        Arc::new(RdmaStats::default())
    }

    #[test]
    fn every_tcp_reason_and_wc_category_is_reported_under_its_own_label() {
        let q = queue();
        for (i, r) in TcpReason::ALL.iter().enumerate() {
            for _ in 0..=i {
                q.tcp_payload(RdmaOp::Write, *r, 10);
            }
        }
        for c in WC_ORDER {
            q.wc_error(c);
        }
        let snap = RdmaDriverStats::new("rdma", vec![q], Arc::default()).snapshot();
        let with = |name: &str, reason: &str| {
            snap.counters
                .iter()
                .filter(|c| c.name == name && c.reason.as_deref() == Some(reason))
                .map(|c| c.value)
                .sum::<u64>()
        };
        for (i, r) in TcpReason::ALL.iter().enumerate() {
            let n = i as u64 + 1;
            assert_eq!(
                with(names::TCP_PAYLOAD_REQUESTS, r.name()),
                n,
                "{}",
                r.name()
            );
            assert_eq!(with(names::TCP_PAYLOAD_BYTES, r.name()), 10 * n);
        }
        for c in WC_ORDER {
            assert_eq!(with("wc_errors", c.name()), 1, "{}", c.name());
        }
    }

    #[test]
    fn queues_are_summed_per_op_and_reason_under_the_well_known_names() {
        let (a, b) = (queue(), queue());
        for q in [&a, &b] {
            q.inc_op(RdmaOp::Read, |s| &s.rdma_requests, |o| &o.requests);
            q.inc_op(RdmaOp::Read, |s| &s.rdma_transferred, |o| &o.transferred);
            q.bytes_read.fetch_add(4096, Ordering::Relaxed);
        }
        a.inc_op(RdmaOp::Write, |s| &s.rdma_requests, |o| &o.requests);
        a.inc_op(RdmaOp::Write, |s| &s.rdma_timed_out, |o| &o.timed_out);
        a.inc_op(RdmaOp::Write, |s| &s.rdma_declined, |o| &o.declined);
        a.tcp_payload(RdmaOp::Write, TcpReason::QpError, 8192);
        b.tcp_payload(RdmaOp::Read, TcpReason::Declined, 512);
        b.wc_error(WcCategory::RetryExceeded);
        b.inc(|s| &s.alloc_failures);
        a.pool_buffers.store(4, Ordering::Relaxed);
        a.pool_take();
        let snap = RdmaDriverStats::new("rdma", vec![a, b], Arc::default()).snapshot();
        assert_eq!(snap.driver, "rdma");
        let c = |name, op| snap.counter(name, op);
        assert_eq!(c(names::RDMA_REQUESTS, Some(IoOp::Read)), 2);
        assert_eq!(c(names::RDMA_REQUESTS, Some(IoOp::Write)), 1);
        assert_eq!(c(names::RDMA_TRANSFERRED, None), 2);
        assert_eq!(c(names::RDMA_TIMED_OUT, Some(IoOp::Write)), 1);
        assert_eq!(c(names::RDMA_DECLINED_SERVED_TCP, Some(IoOp::Write)), 1);
        assert_eq!(c(names::TCP_PAYLOAD_REQUESTS, Some(IoOp::Write)), 1);
        assert_eq!(c(names::TCP_PAYLOAD_BYTES, Some(IoOp::Write)), 8192);
        assert_eq!(c(names::TCP_PAYLOAD_REQUESTS, Some(IoOp::Read)), 1);
        assert_eq!(c(names::ALLOCATION_FAILURES, None), 1);
        assert_eq!(c("rdma_bytes", Some(IoOp::Read)), 8192);
        let reason = |name: &str, op, r: TcpReason| {
            snap.counters
                .iter()
                .find(|v| {
                    v.name == name && v.op == Some(op) && v.reason.as_deref() == Some(r.name())
                })
                .map(|v| v.value)
        };
        assert_eq!(
            reason(names::TCP_PAYLOAD_REQUESTS, IoOp::Write, TcpReason::QpError),
            Some(1)
        );
        assert_eq!(
            reason(names::TCP_PAYLOAD_REQUESTS, IoOp::Read, TcpReason::Declined),
            Some(1)
        );
        assert_eq!(
            reason(names::TCP_PAYLOAD_REQUESTS, IoOp::Read, TcpReason::TooLarge),
            Some(0)
        );
        assert!(snap.counters.iter().any(|v| v.name == "wc_errors"
            && v.reason.as_deref() == Some("retry_exceeded")
            && v.value == 1));
        let g = |name: &str| snap.gauges.iter().find(|g| g.name == name).unwrap().value;
        assert_eq!(
            (
                g(names::BUFFER_POOL_FREE),
                g(names::BUFFER_POOL_IN_USE),
                g(names::BUFFER_POOL_PEAK)
            ),
            (3.0, 1.0, 1.0)
        );

        let text = summarize(&[DeviceDriverReport {
            device: 3,
            configured: Transport::Rdma,
            stats: Some(snap),
        }]);
        assert!(
            text.contains(
                "ublkb3: RDMA data path - Read: 2 transfers over RDMA, 1 payload requests over TCP"
            ),
            "{text}"
        );
        assert!(
            text.contains("ublkb3:   rdma_timed_out (write): 1"),
            "{text}"
        );
        assert!(!text.contains("warning"), "{text}");
    }

    #[test]
    fn an_rdma_device_that_moved_nothing_over_rdma_is_warned_about() {
        let q = queue();
        q.tcp_payload(RdmaOp::Write, TcpReason::QpError, 4096);
        let text = summarize(&[DeviceDriverReport {
            device: 0,
            configured: Transport::Rdma,
            stats: Some(RdmaDriverStats::new("rdma", vec![q], Arc::default()).snapshot()),
        }]);
        assert!(
            text.contains("ublkb0: warning: configured for RDMA but moved no payload over RDMA"),
            "{text}"
        );
    }
}
