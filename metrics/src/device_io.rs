//! Device I/O accounting: requests, bytes, errors and latency per target and
//! op.

use crate::histogram::LatencyHistogram;
use crate::labels::{device_label, validate_target, ErrnoClass, IoOp, LabelError};
use crate::shard::ShardedCounter;
use crate::telemetry::Telemetry;
use std::sync::Arc;
use std::time::Duration;

struct OpHandles {
    requests: Arc<ShardedCounter>,
    bytes: Arc<ShardedCounter>,
    errors: [Arc<ShardedCounter>; ErrnoClass::COUNT],
    latency: Arc<LatencyHistogram>,
}

/// The I/O counters and latency histograms of one target (and, with
/// per-device labels, one device).
///
/// Every series is registered here, once; [`IoMetrics::record`] only indexes
/// fixed arrays and adds to atomics.
pub struct IoMetrics {
    target: Box<str>,
    device: Option<u32>,
    ops: [OpHandles; IoOp::COUNT],
}

impl std::fmt::Debug for IoMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IoMetrics")
            .field("target", &self.target)
            .field("device", &self.device)
            .finish_non_exhaustive()
    }
}

impl IoMetrics {
    /// Registers the series of `target` (`arena`, `mem`, ...). Pass
    /// `Some(device id)` only when the operator enabled
    /// `metrics.per_device_labels`: it adds a `device` label to every series
    /// and so multiplies their number by the number of devices.
    pub fn new(
        telemetry: &Telemetry,
        target: &str,
        device: Option<u32>,
    ) -> Result<Self, LabelError> {
        validate_target(target)?;
        let dev = device.map(device_label);
        let ops = IoOp::ALL.map(|op| {
            let mut base: Vec<(&'static str, &str)> = vec![("target", target), ("op", op.as_str())];
            if let Some(d) = &dev {
                base.push(("device", d));
            }
            let errors = ErrnoClass::ALL.map(|class| {
                let mut l = base.clone();
                l.push(("errno", class.as_str()));
                telemetry.sharded_counter("ublk_io_errors_total", &l)
            });
            OpHandles {
                // Sharded per queue thread: every request adds to these.
                // Registered series render from the start (zero), so rate()
                // works from the first scrape instead of the first request.
                requests: telemetry.sharded_counter("ublk_io_requests_total", &base),
                bytes: telemetry.sharded_counter("ublk_io_bytes_total", &base),
                errors,
                latency: telemetry.histogram("ublk_io_latency_seconds", &base),
            }
        });
        Ok(IoMetrics {
            target: target.into(),
            device,
            ops,
        })
    }

    /// The target label.
    pub fn target(&self) -> &str {
        &self.target
    }

    /// The device label, when per-device labels are on.
    pub fn device(&self) -> Option<u32> {
        self.device
    }

    /// The latency histogram of `op` (for exemplars).
    pub fn latency(&self, op: IoOp) -> &LatencyHistogram {
        &self.ops[op.index()].latency
    }

    /// Accounts one completed request. `bytes` counts only on success;
    /// `Err(errno)` takes a Linux errno of either sign.
    #[inline]
    pub fn record(&self, op: IoOp, bytes: u64, result: Result<(), i32>, latency: Duration) {
        self.record_ns(
            op,
            bytes,
            result,
            u64::try_from(latency.as_nanos()).unwrap_or(u64::MAX),
        );
    }

    /// [`Self::record`] with the latency in nanoseconds.
    #[inline]
    pub fn record_ns(&self, op: IoOp, bytes: u64, result: Result<(), i32>, latency_ns: u64) {
        let h = &self.ops[op.index()];
        h.requests.increment(1);
        match result {
            Ok(()) => h.bytes.increment(bytes),
            Err(errno) => h.errors[ErrnoClass::from_errno(errno).index()].increment(1),
        }
        h.latency.record_ns(latency_ns);
    }
}
