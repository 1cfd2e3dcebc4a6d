//! What a connection must get past before the server spends a thread on
//! it: its place in the connection limits, one absolute deadline for its
//! handshake, and throttled logs for the resource errors of a flood.

use std::io::{self, Read};
use std::net::TcpStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Counts a connection in one of the server's limits while it lives.
pub(super) struct Counted<'a>(pub(super) &'a AtomicUsize);

impl<'a> Counted<'a> {
    /// Takes a place below `limit`, or `None` when all are taken.
    pub(super) fn take(count: &'a AtomicUsize, limit: u32) -> Option<Self> {
        count
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < limit as usize).then_some(n + 1)
            })
            .ok()
            .map(|_| Counted(count))
    }
}

impl<'a> Counted<'a> {
    /// Keeps the place taken without this guard; whoever holds the counter
    /// gives it back with a new `Counted` over it.
    pub(super) fn leak(self) -> &'a AtomicUsize {
        let count = self.0;
        std::mem::forget(self);
        count
    }
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The handshake's reads, each bounded by what is left of one absolute
/// deadline (a per-read timeout would let a client that sends a byte at a
/// time hold its connection for 171 timeouts).
pub(super) struct Deadline<'a> {
    pub(super) stream: &'a TcpStream,
    pub(super) until: Instant,
}

impl Read for Deadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "handshake deadline passed",
            ));
        }
        self.stream.set_read_timeout(Some(left))?;
        self.stream.read(buf)
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
