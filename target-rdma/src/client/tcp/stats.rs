//! Driver statistics of the TCP inline data path, reported through the
//! metrics crate's transport-neutral `DriverStats` trait.
//!
//! One `TcpPayloadStats` is shared by every queue connection of a device, so
//! the device reports one set of counters whatever its queue count.

use std::borrow::Cow;
use std::sync::atomic::{AtomicU64, Ordering};

use ublk_metrics::driver::names;
use ublk_metrics::driver::CounterValue;
use ublk_metrics::{DriverSnapshot, DriverStats, IoOp};

/// Why a payload travelled on the TCP stream; a closed set (metric label).
/// The TCP transport has one: the device is configured for it. The RDMA
/// transport adds its fallback reasons.
pub const REASON_CONFIGURED_TCP: &str = "configured_tcp";

/// Payload requests and bytes carried inline, per direction.
#[derive(Debug, Default)]
pub struct TcpPayloadStats {
    read_requests: AtomicU64,
    read_bytes: AtomicU64,
    write_requests: AtomicU64,
    write_bytes: AtomicU64,
}

impl TcpPayloadStats {
    /// Counts one inline READ answered with `bytes` of payload (0 when the
    /// blob did not exist and nothing moved).
    pub fn read(&self, bytes: usize) {
        self.read_requests.fetch_add(1, Ordering::Relaxed);
        self.read_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    /// Counts one inline WRITE of `bytes`.
    pub fn write(&self, bytes: usize) {
        self.write_requests.fetch_add(1, Ordering::Relaxed);
        self.write_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
    }
}

fn counter(name: &'static str, op: IoOp, value: &AtomicU64) -> CounterValue {
    CounterValue {
        name: Cow::Borrowed(name),
        op: Some(op),
        reason: Some(Cow::Borrowed(REASON_CONFIGURED_TCP)),
        value: value.load(Ordering::Relaxed),
    }
}

impl DriverStats for TcpPayloadStats {
    fn snapshot(&self) -> DriverSnapshot {
        DriverSnapshot {
            driver: Cow::Borrowed("tcp"),
            counters: vec![
                counter(names::TCP_PAYLOAD_REQUESTS, IoOp::Read, &self.read_requests),
                counter(names::TCP_PAYLOAD_BYTES, IoOp::Read, &self.read_bytes),
                counter(
                    names::TCP_PAYLOAD_REQUESTS,
                    IoOp::Write,
                    &self.write_requests,
                ),
                counter(names::TCP_PAYLOAD_BYTES, IoOp::Write, &self.write_bytes),
            ],
            gauges: Vec::new(),
        }
    }
}
