//! A driven connection: its answers are read by the owner's event loop (a
//! ublk queue thread's io_uring) instead of a reader thread, so an answer
//! completes its request on the thread that waits for it: no thread hop
//! and no cross-thread wake per request.
//!
//! The owner runs [`Driver::run`] on its loop, over a [`Ring`] that tells
//! it when the socket is readable and ticks for the deadline sweeps. The
//! frames, tags, dispatch and expiry are the reader thread's own code (the
//! connection's `Receiver`): only who calls it changes. A reconnect (made
//! by whichever call finds the connection dead) hands the new receiver to
//! the driver through a [`Handoff`].
//!
//! Sends stay on the caller, as with a reader thread, but never block the
//! loop: a send that finds the socket full waits for room while reading
//! the answers that arrive meanwhile ([`NoWait`]), so a peer blocked on
//! sending answers cannot deadlock against a client blocked on sending
//! requests.

use std::future::{poll_fn, Future};
use std::io::{self, IoSlice, Write};
use std::net::TcpStream;
use std::os::fd::{AsFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rustix::event::{poll, PollFd, PollFlags, Timespec};
use rustix::net::{sendmsg, SendAncillaryBuffer, SendFlags};
use tracing::warn;

use super::conn::{expire, Receiver};
use super::Shared;

/// The owner's event loop, as a driven client needs it.
pub trait Ring {
    /// Ready once `fd` is readable, hung up or failed; it may also be
    /// ready early (the driver then finds nothing to read and waits again).
    fn readable(&self, fd: RawFd) -> impl Future<Output = io::Result<()>>;
    /// Ready after about [`super::TICK`]: the driver's deadline sweeps.
    fn tick(&self) -> impl Future<Output = ()>;
}

/// Where a driven client's connections put their receivers for the driver.
#[derive(Default)]
pub(super) struct Handoff {
    rx: Mutex<Option<Receiver>>,
    waker: Mutex<Option<Waker>>,
    /// The sweep, parked while no request is in flight.
    sweeper: Mutex<Option<Waker>>,
    /// The client is gone: the driver stops.
    closed: AtomicBool,
}

impl Handoff {
    /// Gives the driver a new connection's receiver (the old one ended).
    pub(super) fn install(&self, rx: Receiver) {
        *self.rx.lock() = Some(rx);
        self.wake();
    }

    /// The client is gone.
    pub(super) fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.wake();
        self.in_flight();
    }

    /// A request went in flight: the deadline sweep runs again.
    pub(super) fn in_flight(&self) {
        if let Some(w) = self.sweeper.lock().take() {
            w.wake();
        }
    }

    fn wake(&self) {
        if let Some(w) = self.waker.lock().take() {
            w.wake();
        }
    }

    /// Reads what has arrived; the socket to wait on next, `None` once the
    /// connection ended (or none was installed).
    pub(super) fn pump(&self) -> Option<RawFd> {
        let mut rx = self.rx.lock();
        let r = rx.as_mut()?;
        r.pump().then(|| r.fd())
    }

    /// Ready with `true` once a live receiver is installed, `false` once
    /// the client is gone.
    fn live(&self) -> impl Future<Output = bool> + '_ {
        poll_fn(|cx| {
            *self.waker.lock() = Some(cx.waker().clone());
            if self.closed.load(Ordering::SeqCst) {
                return Poll::Ready(false);
            }
            match &*self.rx.lock() {
                Some(r) if !r.conn().is_dead() => Poll::Ready(true),
                _ => Poll::Pending,
            }
        })
    }
}

/// Runs a driven client's receiving side on its owner's loop; see
/// [`super::ArenaClient::driver`].
pub struct Driver {
    pub(super) client: Weak<Shared>,
    pub(super) handoff: Arc<Handoff>,
}

impl Driver {
    /// Reads answers and expires requests until the client is dropped.
    /// Without it running, a driven client's requests are never answered.
    pub async fn run(&self, ring: &impl Ring) {
        futures::future::join(self.receive(ring), self.sweep(ring)).await;
    }

    async fn receive(&self, ring: &impl Ring) {
        while self.handoff.live().await {
            while let Some(fd) = self.handoff.pump() {
                if let Err(e) = ring.readable(fd).await {
                    warn!(event = "peer.poll_failed", error = %e);
                    if let Some(r) = self.handoff.rx.lock().as_mut() {
                        r.fail(format!("poll failed: {e}"));
                    }
                }
            }
        }
    }

    /// Deadlines of requests on a quiet connection (a busy one is swept as
    /// its answers are read). Parked while nothing is in flight, so an idle
    /// queue's ring really idles.
    async fn sweep(&self, ring: &impl Ring) {
        loop {
            let busy = poll_fn(|cx| {
                *self.handoff.sweeper.lock() = Some(cx.waker().clone());
                if self.handoff.closed.load(Ordering::SeqCst) {
                    return Poll::Ready(false);
                }
                let Some(shared) = self.client.upgrade() else {
                    return Poll::Ready(false);
                };
                let conn = shared.conn.lock().clone();
                match conn {
                    Some(c) if c.in_flight() > 0 => Poll::Ready(true),
                    _ => Poll::Pending,
                }
            });
            if !busy.await {
                return;
            }
            ring.tick().await;
            let Some(shared) = self.client.upgrade() else {
                return;
            };
            let conn = shared.conn.lock().clone();
            if let Some(c) = conn {
                expire(&shared, &c);
            }
        }
    }
}

/// A driven connection's socket as a `Write` that never blocks the loop:
/// when the socket is full it waits (at most `limit`) for room, reading
/// the answers that arrive meanwhile.
pub(super) struct NoWait<'a> {
    stream: &'a TcpStream,
    answers: &'a Handoff,
    limit: Duration,
}

impl<'a> NoWait<'a> {
    pub(super) fn new(stream: &'a TcpStream, answers: &'a Handoff, limit: Duration) -> Self {
        Self {
            stream,
            answers,
            limit,
        }
    }

    /// Waits until the socket has room, pumping answers as they come.
    fn wait(&self, until: Instant) -> io::Result<()> {
        loop {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("no room to send for {:?}", self.limit),
                ));
            }
            let fd = self.stream.as_fd();
            let mut fds = [PollFd::new(&fd, PollFlags::OUT | PollFlags::IN)];
            let timeout = Timespec::try_from(left).map_err(io::Error::other)?;
            match poll(&mut fds, Some(&timeout)) {
                Ok(_) => {}
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(e.into()),
            }
            let ready = fds[0].revents();
            if ready.intersects(PollFlags::IN | PollFlags::HUP | PollFlags::ERR) {
                self.answers.pump();
            }
            if ready.intersects(PollFlags::OUT | PollFlags::HUP | PollFlags::ERR) {
                return Ok(());
            }
        }
    }
}

impl Write for NoWait<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.write_vectored(&[IoSlice::new(buf)])
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        let until = Instant::now() + self.limit;
        loop {
            let flags = SendFlags::DONTWAIT | SendFlags::NOSIGNAL;
            match sendmsg(
                self.stream,
                bufs,
                &mut SendAncillaryBuffer::default(),
                flags,
            ) {
                Ok(n) => return Ok(n),
                Err(rustix::io::Errno::INTR) => {}
                Err(rustix::io::Errno::AGAIN) => self.wait(until)?,
                Err(e) => return Err(e.into()),
            }
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}
