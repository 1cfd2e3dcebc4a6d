//! Time source for trackers and the scanner.
//!
//! Ages are compared against thresholds of seconds; tests must be able to
//! stand exactly on a boundary (29.9 s vs 30 s) without sleeping, so the
//! clock is a trait with a manual implementation.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Monotonic nanoseconds since an arbitrary origin.
///
/// Implementations must never return 0: trackers use 0 to mean "idle slot".
pub trait Clock: Send + Sync + 'static {
    /// Current time in nanoseconds, never 0, never decreasing.
    fn now_ns(&self) -> u64;
}

/// The process's monotonic clock.
///
/// Reading `CLOCK_MONOTONIC` costs ~40 ns on some virtual machines, twice
/// per I/O; reading the invariant TSC (through `quanta`, which calibrates it
/// against `CLOCK_MONOTONIC` and falls back to it when the TSC is not
/// usable) costs a few ns.
#[derive(Debug, Clone)]
pub struct MonotonicClock {
    clock: quanta::Clock,
    origin: u64,
}

impl MonotonicClock {
    /// A clock whose origin is now.
    pub fn new() -> Self {
        let clock = quanta::Clock::new();
        let origin = clock.raw();
        MonotonicClock { clock, origin }
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for MonotonicClock {
    #[inline]
    fn now_ns(&self) -> u64 {
        // +1 keeps the first reading distinct from the idle marker.
        self.clock.delta_as_nanos(self.origin, self.clock.raw()) + 1
    }
}

/// A clock that moves only when told to; for tests of thresholds.
#[derive(Debug)]
pub struct ManualClock {
    now: AtomicU64,
}

impl ManualClock {
    /// Starts at 1 ns.
    pub fn new() -> Self {
        ManualClock {
            now: AtomicU64::new(1),
        }
    }

    /// Moves the clock forward.
    pub fn advance(&self, by: Duration) {
        let ns = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
        let _ = self
            .now
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| {
                Some(t.saturating_add(ns))
            });
    }
}

impl Default for ManualClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for ManualClock {
    fn now_ns(&self) -> u64 {
        self.now.load(Ordering::Acquire)
    }
}

/// Wall-clock seconds since the Unix epoch, for `*_timestamp_seconds` gauges.
pub(crate) fn unix_seconds() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}
