//! Time for the replication core, on any executor.
//!
//! A ublk queue thread runs its own io_uring executor, not tokio, so the
//! core cannot use tokio's timers. Hedged reads start one timer per read:
//! a timer thread that must be woken (a syscall) for each new timer, as
//! `futures-timer`'s is, would cost more than the read it hedges. The
//! [`system`] clock's one thread sleeps until its earliest deadline and is
//! woken only when a new timer is due before that, which uniform hedge
//! delays almost never are: a timer costs an allocation and a short lock.
//!
//! The core reads time only through [`Timers`], so the replication model
//! test runs it on virtual time (`ublk_metrics::ManualClock`, the manual
//! clock every test uses) and a seed replays the same interleaving.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll, Waker};
use std::thread::{self, Thread};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use ublk_metrics::clock::{Clock, ManualClock};

/// A timer's future: ready at its deadline, woken from any thread.
pub type Sleep = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Where the replication core gets the time and its timers: a [`Clock`]
/// whose time is also an [`Instant`], since deadlines are computed on it.
pub trait Timers: Clock {
    /// The current time, the same as [`Clock::now_ns`].
    fn now(&self) -> Instant;
    /// A future ready at `deadline`.
    fn sleep_until(&self, deadline: Instant) -> Sleep;
    /// A future ready `d` from now.
    fn sleep(&self, d: Duration) -> Sleep {
        self.sleep_until(self.now() + d)
    }
}

/// The process's clock: real time, one timer thread for every device.
pub fn system() -> Arc<dyn Timers> {
    static CLOCK: OnceLock<Arc<SystemClock>> = OnceLock::new();
    let c = CLOCK.get_or_init(|| {
        let timers = Arc::new(TimerHeap::default());
        let t = Arc::clone(&timers);
        let thread = thread::Builder::new()
            .name("replica-timer".into())
            .spawn(move || t.run(Instant::now))
            .expect("spawn the replication timer thread");
        Arc::new(SystemClock {
            origin: Instant::now(),
            timers,
            thread: thread.thread().clone(),
        })
    });
    Arc::clone(c) as Arc<dyn Timers>
}

struct SystemClock {
    /// The instant of [`Clock::now_ns`] 1.
    origin: Instant,
    timers: Arc<TimerHeap>,
    thread: Thread,
}

impl Clock for SystemClock {
    fn now_ns(&self) -> u64 {
        let ns = self.origin.elapsed().as_nanos();
        u64::try_from(ns).unwrap_or(u64::MAX).saturating_add(1)
    }
}

impl Timers for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }

    fn sleep_until(&self, deadline: Instant) -> Sleep {
        let timers = Arc::clone(&self.timers);
        let thread = self.thread.clone();
        Box::pin(Timer {
            deadline,
            register: Some(Box::new(move |slot| {
                if timers.add(deadline, slot) {
                    thread.unpark();
                }
            })),
            slot: Arc::default(),
        })
    }
}

/// One pending timer's waker, shared by its future and the heap.
#[derive(Default)]
struct Slot {
    waker: Mutex<Option<Waker>>,
}

impl Slot {
    fn fire(&self) {
        if let Some(w) = self.waker.lock().take() {
            w.wake();
        }
    }
}

struct Entry {
    at: Instant,
    seq: u64,
    slot: Arc<Slot>,
}

impl PartialEq for Entry {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.seq) == (o.at, o.seq)
    }
}
impl Eq for Entry {}
impl PartialOrd for Entry {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Entry {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(o.at, o.seq))
    }
}

/// Pending timers by deadline, and when their thread plans to look next.
#[derive(Default)]
struct TimerHeap {
    state: Mutex<TimerState>,
    seq: AtomicU64,
}

#[derive(Default)]
struct TimerState {
    heap: BinaryHeap<Reverse<Entry>>,
    /// When the timer thread wakes up next on its own; `None` while it
    /// sleeps with nothing to wait for.
    planned: Option<Instant>,
    /// Set while the thread sleeps.
    parked: bool,
}

impl TimerHeap {
    /// Queues `slot` for `at`; whether the thread must be woken (it would
    /// otherwise look too late).
    fn add(&self, at: Instant, slot: Arc<Slot>) -> bool {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let mut s = self.state.lock();
        s.heap.push(Reverse(Entry { at, seq, slot }));
        s.parked && s.planned.is_none_or(|p| at < p)
    }

    /// Fires every timer due at `now()`; returns the next deadline.
    fn fire_due(&self, now: Instant) -> Option<Instant> {
        let mut due = Vec::new();
        let next = {
            let mut s = self.state.lock();
            while s.heap.peek().is_some_and(|e| e.0.at <= now) {
                due.push(s.heap.pop().expect("peeked").0.slot);
            }
            s.heap.peek().map(|e| e.0.at)
        };
        for slot in due {
            slot.fire();
        }
        next
    }

    fn run(&self, now: impl Fn() -> Instant) {
        loop {
            let fired_next = self.fire_due(now());
            // A timer added since `fire_due` (its `add` saw the thread awake
            // and did not unpark it) may be earlier than `fired_next`, or
            // the only one: the sleep below must be planned from both.
            let next = {
                let mut s = self.state.lock();
                let next = match (fired_next, s.heap.peek().map(|e| e.0.at)) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
                s.planned = next;
                s.parked = true;
                next
            };
            match next {
                Some(at) => thread::park_timeout(at.saturating_duration_since(now())),
                None => thread::park(),
            }
            self.state.lock().parked = false;
        }
    }
}

/// How a timer gets into its heap: on its first pending poll.
type Register = Box<dyn FnOnce(Arc<Slot>) + Send>;

/// A timer's future: ready once real time reaches its deadline; the heap
/// only wakes it.
struct Timer {
    deadline: Instant,
    register: Option<Register>,
    slot: Arc<Slot>,
}

impl Future for Timer {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if Instant::now() >= self.deadline {
            return Poll::Ready(());
        }
        *self.slot.waker.lock() = Some(cx.waker().clone());
        if let Some(register) = self.register.take() {
            register(Arc::clone(&self.slot));
        }
        // Fired between the check and the waker's registration?
        if Instant::now() >= self.deadline {
            return Poll::Ready(());
        }
        Poll::Pending
    }
}

impl Drop for Timer {
    fn drop(&mut self) {
        // The heap keeps the slot until its deadline; it wakes no one.
        self.slot.waker.lock().take();
    }
}

/// Virtual time: timers fire only as a test advances the clock.
impl Timers for ManualClock {
    fn now(&self) -> Instant {
        self.instant()
    }

    fn sleep_until(&self, deadline: Instant) -> Sleep {
        Box::pin(ManualClock::sleep_until(self, deadline))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::executor::block_on;

    #[test]
    fn system_timers_fire_in_deadline_order_from_any_thread() {
        let clock = system();
        let start = clock.now();
        let order = Arc::new(Mutex::new(Vec::new()));
        let threads: Vec<_> = [30u64, 10, 20]
            .into_iter()
            .map(|ms| {
                let (clock, order) = (Arc::clone(&clock), Arc::clone(&order));
                thread::spawn(move || {
                    block_on(clock.sleep_until(start + Duration::from_millis(ms)));
                    order.lock().push(ms);
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert!(clock.now() >= start + Duration::from_millis(30));
        let mut got = order.lock().clone();
        got.sort_unstable();
        assert_eq!(got, [10, 20, 30]);
    }

    #[test]
    fn a_dropped_timer_wakes_no_one_and_a_past_deadline_is_ready() {
        let clock = system();
        drop(clock.sleep(Duration::from_millis(1)));
        block_on(clock.sleep_until(clock.now() - Duration::from_millis(5)));
        block_on(clock.sleep(Duration::from_millis(2)));
    }

    #[test]
    fn the_manual_clock_is_timers_on_virtual_time() {
        let clock = ManualClock::new();
        assert_eq!(Timers::now(&clock), clock.instant());
        let mut s = Timers::sleep(&clock, Duration::from_secs(5));
        let mut cx = Context::from_waker(Waker::noop());
        assert!(s.as_mut().poll(&mut cx).is_pending());
        clock.advance(Duration::from_secs(5));
        assert!(s.as_mut().poll(&mut cx).is_ready());
    }
}
