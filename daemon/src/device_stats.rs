//! Per-device I/O counters, shared by every queue thread of a device.
//!
//! Relaxed atomics only: they are statistics, not synchronisation, and a
//! queue must never wait on another queue to count a request.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use serde::{Deserialize, Serialize};
use ublk_metrics::histogram::HistogramSnapshot;
use ublk_metrics::{IoOp, LatencyHistogram};

/// Live counters of one device.
#[derive(Default, Debug)]
pub struct DeviceStats {
    reads: AtomicU64,
    writes: AtomicU64,
    flushes: AtomicU64,
    discards: AtomicU64,
    write_zeroes: AtomicU64,
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
    bytes_discarded: AtomicU64,
    errors: AtomicU64,
    in_flight: AtomicU64,
    /// Per op (in `IoOp::ALL` order), completed requests' latencies: this
    /// device's own, whatever `per_device_labels` says.
    latency: [LatencyHistogram; IoOp::COUNT],
}

/// A copy of the counters at one moment, as `ublkctl stats` shows them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatsSnapshot {
    /// Completed READs.
    pub reads: u64,
    /// Completed WRITEs (FUA included).
    pub writes: u64,
    /// Completed FLUSHes.
    pub flushes: u64,
    /// Completed DISCARDs.
    pub discards: u64,
    /// Completed WRITE_ZEROES.
    pub write_zeroes: u64,
    /// Bytes read.
    pub bytes_read: u64,
    /// Bytes written.
    pub bytes_written: u64,
    /// Bytes discarded or zeroed.
    pub bytes_discarded: u64,
    /// Requests completed with an error.
    pub errors: u64,
    /// Requests being served now.
    pub in_flight: u64,
    /// Latency histograms of completed requests (successful or not), per
    /// op in `IoOp::ALL` order (`read`, `write`, `flush`, `discard`,
    /// `write_zeroes`).
    #[serde(default)]
    pub latency: [HistogramSnapshot; IoOp::COUNT],
}

/// Decrements the in-flight gauge when the request ends, however it ends
/// (completion, error, or the future being dropped at queue shutdown).
pub struct InFlight<'a>(&'a AtomicU64);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

impl DeviceStats {
    /// Marks a request as started.
    pub fn start(&self) -> InFlight<'_> {
        self.in_flight.fetch_add(1, Relaxed);
        InFlight(&self.in_flight)
    }

    /// Requests being served now: the guest's load, which a rebuild gives
    /// way to.
    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(Relaxed)
    }

    /// Counts a successful request.
    pub fn done(&self, op: IoOp, bytes: u64) {
        let (count, byte_counter) = match op {
            IoOp::Read => (&self.reads, Some(&self.bytes_read)),
            IoOp::Write => (&self.writes, Some(&self.bytes_written)),
            IoOp::Flush => (&self.flushes, None),
            IoOp::Discard => (&self.discards, Some(&self.bytes_discarded)),
            IoOp::WriteZeroes => (&self.write_zeroes, Some(&self.bytes_discarded)),
        };
        count.fetch_add(1, Relaxed);
        if let Some(b) = byte_counter {
            b.fetch_add(bytes, Relaxed);
        }
    }

    /// Records how long a completed request (successful or not) took.
    pub fn completed_in(&self, op: IoOp, latency: std::time::Duration) {
        self.latency[op.index()].record(latency);
    }

    /// Counts a request that failed, in the target or before reaching it.
    pub fn failed(&self) {
        self.errors.fetch_add(1, Relaxed);
    }

    /// The counters now.
    pub fn snapshot(&self) -> StatsSnapshot {
        StatsSnapshot {
            reads: self.reads.load(Relaxed),
            writes: self.writes.load(Relaxed),
            flushes: self.flushes.load(Relaxed),
            discards: self.discards.load(Relaxed),
            write_zeroes: self.write_zeroes.load(Relaxed),
            bytes_read: self.bytes_read.load(Relaxed),
            bytes_written: self.bytes_written.load(Relaxed),
            bytes_discarded: self.bytes_discarded.load(Relaxed),
            errors: self.errors.load(Relaxed),
            in_flight: self.in_flight.load(Relaxed),
            latency: std::array::from_fn(|i| self.latency[i].snapshot()),
        }
    }
}
