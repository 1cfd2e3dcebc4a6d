//! The workspace's time source.
//!
//! Ages are compared against thresholds of seconds; tests must be able to
//! stand exactly on a boundary (29.9 s vs 30 s) without sleeping, and the
//! replication core's timers must run on virtual time for its model test,
//! so the clock is a trait with one manual implementation for both. The
//! replica's timers extend the trait (`target_rdma::replica::clock::Timers`).

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

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

/// A clock that moves only when told to, with timers that fire as it passes
/// their deadlines: threshold tests stand exactly on a boundary, and the
/// replication model test replays the same interleaving from a seed.
#[derive(Debug)]
pub struct ManualClock {
    /// The instant of [`Clock::now_ns`] 1, the clock's start, for callers
    /// that compute deadlines as [`Instant`]s.
    origin: Instant,
    now: AtomicU64,
    /// Pending timers by (deadline in ns, order of creation).
    timers: Mutex<BTreeMap<(u64, u64), Arc<Alarm>>>,
    seq: AtomicU64,
}

impl ManualClock {
    /// Starts at 1 ns.
    pub fn new() -> Self {
        ManualClock {
            origin: Instant::now(),
            now: AtomicU64::new(1),
            timers: Mutex::default(),
            seq: AtomicU64::new(0),
        }
    }

    /// Time since the clock was made.
    pub fn elapsed(&self) -> Duration {
        Duration::from_nanos(self.now_ns() - 1)
    }

    /// The current time as an [`Instant`].
    pub fn instant(&self) -> Instant {
        self.origin + self.elapsed()
    }

    /// Moves the clock forward and fires every timer due.
    pub fn advance(&self, by: Duration) {
        let ns = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
        let _ = self
            .now
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| {
                Some(t.saturating_add(ns))
            });
        let now = self.now_ns();
        let due = {
            let mut timers = self.timers.lock();
            let later = timers.split_off(&(now.saturating_add(1), 0));
            std::mem::replace(&mut *timers, later)
        };
        for alarm in due.into_values() {
            alarm.fire();
        }
    }

    /// Moves the clock to `at` (if later) and fires every timer due.
    pub fn advance_to(&self, at: Instant) {
        self.advance(at.saturating_duration_since(self.instant()));
    }

    /// The earliest deadline a pending timer waits for.
    pub fn next_deadline(&self) -> Option<Instant> {
        let timers = self.timers.lock();
        let (&(ns, _), _) = timers
            .iter()
            .find(|(_, a)| !a.cancelled.load(Ordering::Acquire))?;
        Some(self.origin + Duration::from_nanos(ns - 1))
    }

    /// A future ready once the clock reaches `deadline`.
    pub fn sleep_until(&self, deadline: Instant) -> ManualSleep {
        let alarm = Arc::new(Alarm::default());
        let ns = u64::try_from(deadline.saturating_duration_since(self.origin).as_nanos())
            .unwrap_or(u64::MAX)
            .saturating_add(1);
        // Under the lock, so that an `advance` past `ns` either comes
        // before the check or finds the timer.
        let mut timers = self.timers.lock();
        if ns > self.now_ns() {
            let seq = self.seq.fetch_add(1, Ordering::Relaxed);
            timers.insert((ns, seq), Arc::clone(&alarm));
        } else {
            alarm.fired.store(true, Ordering::Release);
        }
        ManualSleep { alarm }
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

/// A [`ManualClock`] timer's state, shared by its future and the clock.
#[derive(Debug, Default)]
struct Alarm {
    fired: AtomicBool,
    /// Its future was dropped: nobody waits for it.
    cancelled: AtomicBool,
    waker: Mutex<Option<Waker>>,
}

impl Alarm {
    fn fire(&self) {
        self.fired.store(true, Ordering::Release);
        if let Some(w) = self.waker.lock().take() {
            w.wake();
        }
    }
}

/// A [`ManualClock`] timer: ready once the clock is advanced to its deadline.
#[derive(Debug)]
pub struct ManualSleep {
    alarm: Arc<Alarm>,
}

impl Future for ManualSleep {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.alarm.fired.load(Ordering::Acquire) {
            return Poll::Ready(());
        }
        *self.alarm.waker.lock() = Some(cx.waker().clone());
        // Fired between the check and the waker's registration?
        if self.alarm.fired.load(Ordering::Acquire) {
            return Poll::Ready(());
        }
        Poll::Pending
    }
}

impl Drop for ManualSleep {
    fn drop(&mut self) {
        // The clock keeps the alarm until its deadline; it wakes no one.
        self.alarm.cancelled.store(true, Ordering::Release);
        self.alarm.waker.lock().take();
    }
}

/// Wall-clock seconds since the Unix epoch, for `*_timestamp_seconds` gauges.
pub(crate) fn unix_seconds() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_time_moves_only_when_advanced_and_fires_due_timers() {
        let clock = ManualClock::new();
        let mut s = std::pin::pin!(clock.sleep_until(clock.instant() + Duration::from_secs(5)));
        let mut cx = Context::from_waker(Waker::noop());
        assert!(s.as_mut().poll(&mut cx).is_pending());
        assert_eq!(
            clock.next_deadline(),
            Some(clock.instant() + Duration::from_secs(5))
        );
        clock.advance(Duration::from_secs(4));
        assert!(s.as_mut().poll(&mut cx).is_pending());
        clock.advance(Duration::from_secs(1));
        assert!(s.as_mut().poll(&mut cx).is_ready());
        assert_eq!(clock.elapsed(), Duration::from_secs(5));
        assert_eq!(clock.now_ns(), 5_000_000_001);
        assert_eq!(clock.next_deadline(), None);
    }

    #[test]
    fn a_dropped_manual_timer_is_no_deadline_and_a_past_one_is_ready() {
        let clock = ManualClock::new();
        drop(clock.sleep_until(clock.instant() + Duration::from_secs(1)));
        assert_eq!(clock.next_deadline(), None);
        let mut s = std::pin::pin!(clock.sleep_until(clock.instant()));
        assert!(s
            .as_mut()
            .poll(&mut Context::from_waker(Waker::noop()))
            .is_ready());
    }
}
