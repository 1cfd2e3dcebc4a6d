//! What a connection must get past before the server spends more than a
//! socket and a small task on it: its place in the connection limits, and
//! throttled logs for the resource errors of a flood.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The server's connection counters: the connections with a task
/// (authenticated or not), those still in their handshake, and the next
/// connection's id.
pub(super) struct Admission {
    open: Arc<AtomicUsize>,
    unauthenticated: Arc<AtomicUsize>,
    next_conn: AtomicU64,
}

impl Admission {
    pub(super) fn new() -> Self {
        Self {
            open: Arc::default(),
            unauthenticated: Arc::default(),
            next_conn: AtomicU64::new(1),
        }
    }

    /// Takes a place among the connections with a task, below `limit`.
    pub(super) fn open(&self, limit: u32) -> Option<Counted> {
        Counted::take(&self.open, limit)
    }

    /// Takes a place among the connections in their handshake, below
    /// `limit`.
    pub(super) fn handshaking(&self, limit: u32) -> Option<Counted> {
        Counted::take(&self.unauthenticated, limit)
    }

    /// The next connection's id.
    pub(super) fn next_id(&self) -> u64 {
        self.next_conn.fetch_add(1, Ordering::Relaxed)
    }

    /// How many connections have a task now.
    pub(super) fn open_now(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }
}

/// Counts a connection in one of the server's limits while it lives.
pub(super) struct Counted(Arc<AtomicUsize>);

impl Counted {
    /// Takes a place below `limit`, or `None` when all are taken.
    fn take(count: &Arc<AtomicUsize>, limit: u32) -> Option<Self> {
        count
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < limit as usize).then_some(n + 1)
            })
            .ok()
            .map(|_| Counted(Arc::clone(count)))
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Logs a recurring resource error at most once per interval, with how many
/// were not logged since.
#[derive(Default)]
pub(super) struct Throttled {
    last: Option<Instant>,
    muted: u64,
}

const LOG_INTERVAL: Duration = Duration::from_secs(10);

impl Throttled {
    pub(super) fn log(&mut self, log: impl FnOnce(u64)) {
        if self.last.is_some_and(|t| t.elapsed() < LOG_INTERVAL) {
            self.muted += 1;
            return;
        }
        self.last = Some(Instant::now());
        log(std::mem::take(&mut self.muted));
    }
}
