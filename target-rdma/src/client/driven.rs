//! The vocabulary of the client's driven paths, where the owner's event
//! loop (a ublk queue thread's io_uring) does the waiting a thread of the
//! client's own would do otherwise: a TCP connection's answers are read by
//! `tcp::ring::Driver`, an RDMA rail's completions reaped by
//! `rdma::CqDriver`, both on the owner's [`Ring`], sweeping deadlines every
//! [`TICK`].
//!
//! What a driver serves is replaced under it (a reconnect, a new rail), so
//! each reaches its driver through a hand-off: a new connection's receiver
//! through [`Handoff`], a new rail's completion engine through
//! [`CqHandoff`].

use std::future::{poll_fn, Future};
use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Poll, Waker};
use std::time::Duration;

use parking_lot::Mutex;

/// How often request deadlines are checked (by a reader or completion
/// thread, or a driven client's driver).
pub const TICK: Duration = Duration::from_millis(50);

/// The owner's event loop, as a driven client needs it.
pub trait Ring {
    /// Ready once `fd` is readable, hung up or failed; it may also be
    /// ready early (the driver then finds nothing to read and waits again).
    fn readable(&self, fd: RawFd) -> impl Future<Output = io::Result<()>>;
    /// Ready after about [`TICK`]: the driver's deadline sweeps.
    fn tick(&self) -> impl Future<Output = ()>;
}

/// The receiving half of a driven connection, as its driver runs it.
pub(super) trait Receive: Send {
    /// Reads and dispatches what has arrived; `false` once the connection
    /// has ended.
    fn pump(&mut self) -> bool;
    /// The socket, for the owner's loop to wait on.
    fn fd(&self) -> RawFd;
    /// Ends the connection because its owner's loop cannot read it.
    fn fail(&mut self, why: String);
    /// Whether the connection it reads is dead.
    fn is_dead(&self) -> bool;
}

/// Where a driven client's connections put their receivers for the driver.
#[derive(Default)]
pub(super) struct Handoff {
    pub(super) rx: Mutex<Option<Box<dyn Receive>>>,
    waker: Mutex<Option<Waker>>,
    /// The sweep, parked while no request is in flight.
    pub(super) sweeper: Mutex<Option<Waker>>,
    /// The client is gone: the driver stops.
    pub(super) closed: AtomicBool,
}

impl Handoff {
    /// Gives the driver a new connection's receiver (the old one ended).
    pub(super) fn install(&self, rx: impl Receive + 'static) {
        *self.rx.lock() = Some(Box::new(rx));
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
    pub(super) fn live(&self) -> impl Future<Output = bool> + '_ {
        poll_fn(|cx| {
            *self.waker.lock() = Some(cx.waker().clone());
            if self.closed.load(Ordering::SeqCst) {
                return Poll::Ready(false);
            }
            match &*self.rx.lock() {
                Some(r) if !r.is_dead() => Poll::Ready(true),
                _ => Poll::Pending,
            }
        })
    }
}

/// A rail's completion engine, as [`CqHandoff`] weighs it.
pub(super) trait Engine {
    /// Requests in flight.
    fn in_flight(&self) -> usize;
    /// Whether it was shut down.
    fn stopped(&self) -> bool;
}

/// Where a driven transport's rails hand their engines to the driver.
pub(super) struct CqHandoff<E> {
    state: Mutex<HandoffState<E>>,
}

struct HandoffState<E> {
    /// The engine served now.
    engine: Option<Arc<E>>,
    /// A newer rail's, served once `engine` has nothing left in flight.
    next: Option<Arc<E>>,
    waker: Option<Waker>,
    /// The transport is gone: the driver ends.
    closed: bool,
}

impl<E> Default for CqHandoff<E> {
    fn default() -> Self {
        Self {
            state: Mutex::new(HandoffState {
                engine: None,
                next: None,
                waker: None,
                closed: false,
            }),
        }
    }
}

impl<E: Engine> CqHandoff<E> {
    /// A new rail's engine: the driver serves it once the previous one has
    /// nothing left in flight.
    pub(super) fn install(&self, engine: &Arc<E>) {
        let w = {
            let mut s = self.state.lock();
            s.next = Some(Arc::clone(engine));
            s.waker.take()
        };
        if let Some(w) = w {
            w.wake();
        }
    }

    /// The transport is dropped: the driver ends.
    pub(super) fn close(&self) {
        let w = {
            let mut s = self.state.lock();
            s.closed = true;
            s.engine = None;
            s.next = None;
            s.waker.take()
        };
        if let Some(w) = w {
            w.wake();
        }
    }

    /// The engine to serve; `Err(())` once closed. Registers `waker` for
    /// the next install or close.
    pub(super) fn current(&self, waker: &Waker) -> Result<Option<Arc<E>>, ()> {
        let mut s = self.state.lock();
        if s.closed {
            return Err(());
        }
        s.waker = Some(waker.clone());
        if s.next.is_some()
            && s.engine
                .as_ref()
                .is_none_or(|e| e.in_flight() == 0 || e.stopped())
        {
            s.engine = s.next.take();
        }
        Ok(s.engine.clone())
    }
}
