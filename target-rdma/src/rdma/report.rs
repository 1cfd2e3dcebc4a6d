//! The RDMA transport's statistics in the metrics crate's driver contract:
//! a device's queues (one [`RdmaTransport`](super::RdmaTransport) each) are
//! summed and mapped onto the well-known names of
//! [`ublk_metrics::driver::names`], per op where the transport splits them.
//! Names the contract does not know (wc error categories, lease cache,
//! rails, bounce copies, bytes) are reported under their own names.

use std::borrow::Cow;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use ublk_metrics::driver::{names, CounterValue, GaugeValue};
use ublk_metrics::{DriverSnapshot, IoOp};

use super::stats::{OpCounters, RdmaStats, TcpReason};
use super::RdmaOp;

/// The driver statistics of one device: the sum over its queues.
#[derive(Debug)]
pub struct RdmaDriverStats {
    driver: &'static str,
    queues: Vec<Arc<RdmaStats>>,
}

impl RdmaDriverStats {
    /// Sums `queues`. `driver` is the `driver` label: `rdma` when the device
    /// negotiated RDMA, `tcp` when it serves every payload inline (an `auto`
    /// device whose peer or host has no RDMA), so its TCP payloads are
    /// reported with the reason and not mixed with RDMA devices.
    pub fn new(driver: &'static str, queues: Vec<Arc<RdmaStats>>) -> Self {
        Self { driver, queues }
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
        for (i, category) in super::stats::WC_ORDER.iter().enumerate() {
            counters.push(CounterValue {
                reason: Some(Cow::Borrowed(category.name())),
                ..counter("wc_errors", None, self.sum(|q| &q.wc_errors[i]))
            });
        }
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
        b.wc_error(super::super::WcCategory::RetryExceeded);
        b.inc(|s| &s.alloc_failures);
        a.pool_buffers.store(4, Ordering::Relaxed);
        a.pool_take();
        let snap = RdmaDriverStats::new("rdma", vec![a, b]).snapshot();
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
            stats: Some(RdmaDriverStats::new("rdma", vec![q]).snapshot()),
        }]);
        assert!(
            text.contains("ublkb0: warning: configured for RDMA but moved no payload over RDMA"),
            "{text}"
        );
    }
}
