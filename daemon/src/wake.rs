//! Waking a queue thread's executor from another thread.
//!
//! A queue thread sleeps in `io_uring_enter` waiting for completions; the
//! arena client completes requests from its own reader thread. Rescheduling
//! the task in the local executor is not enough, because nothing would
//! return the queue thread from the kernel. So every target future is
//! wrapped in [`CrossThread`], whose waker also writes an eventfd that the
//! queue's ring polls (see `queue.rs`), turning a foreign wake-up into a
//! CQE.

use std::future::Future;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::thread::{self, ThreadId};

use rustix::event::{eventfd, EventfdFlags};

/// A non-blocking eventfd.
#[derive(Debug)]
pub struct EventFd(OwnedFd);

impl EventFd {
    /// A fresh eventfd with counter 0.
    pub fn new() -> io::Result<Self> {
        let fd = eventfd(0, EventfdFlags::NONBLOCK | EventfdFlags::CLOEXEC)?;
        Ok(Self(fd))
    }

    /// Adds 1 to the counter, making the fd readable.
    pub fn signal(&self) {
        // EAGAIN (counter saturated) still leaves the fd readable, so the
        // result needs no handling.
        let _ = rustix::io::write(&self.0, &1u64.to_ne_bytes());
    }

    /// Resets the counter; returns whether it was signalled.
    pub fn drain(&self) -> bool {
        let mut buf = [0u8; 8];
        matches!(rustix::io::read(&self.0, &mut buf), Ok(8))
    }
}

impl AsRawFd for EventFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

/// The waker handed to wrapped futures.
struct Notify {
    inner: Waker,
    efd: Arc<EventFd>,
    owner: ThreadId,
}

impl Wake for Notify {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.inner.wake_by_ref();
        // A wake on the queue thread itself happens while its executor runs;
        // only a foreign thread has to kick the ring.
        if thread::current().id() != self.owner {
            self.efd.signal();
        }
    }
}

/// Wraps a future so that wake-ups from any thread reach the queue thread.
pub struct CrossThread<F> {
    inner: F,
    efd: Arc<EventFd>,
    cached: Option<Waker>,
}

impl<F> CrossThread<F> {
    /// Wraps `inner`; polls must happen on the thread that owns `efd`'s ring.
    pub fn new(inner: F, efd: Arc<EventFd>) -> Self {
        Self {
            inner,
            efd,
            cached: None,
        }
    }
}

impl<F: Future> Future for CrossThread<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        // SAFETY: `inner` is structurally pinned: it is never moved out of
        // `self`, and the other fields are not pinned.
        let this = unsafe { self.get_unchecked_mut() };
        let reuse = matches!(&this.cached, Some(w) if w.will_wake(cx.waker()));
        if !reuse {
            this.cached = Some(Waker::from(Arc::new(Notify {
                inner: cx.waker().clone(),
                efd: Arc::clone(&this.efd),
                owner: thread::current().id(),
            })));
        }
        let waker = this
            .cached
            .as_ref()
            .map_or_else(|| cx.waker().clone(), Clone::clone);
        let mut cx = Context::from_waker(&waker);
        // SAFETY: see above; `inner` stays in place for the life of `this`.
        unsafe { Pin::new_unchecked(&mut this.inner) }.poll(&mut cx)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use futures::channel::oneshot;

    use super::*;

    struct Count(AtomicUsize);
    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn a_foreign_wake_signals_the_eventfd_and_the_inner_waker() {
        let efd = Arc::new(EventFd::new().unwrap());
        let (tx, rx) = oneshot::channel::<u32>();
        let mut fut = Box::pin(CrossThread::new(rx, Arc::clone(&efd)));
        let count = Arc::new(Count(AtomicUsize::new(0)));
        let waker = Waker::from(Arc::clone(&count));
        let mut cx = Context::from_waker(&waker);
        assert!(fut.as_mut().poll(&mut cx).is_pending());
        assert!(!efd.drain(), "nothing signalled yet");
        thread::spawn(move || tx.send(7).unwrap()).join().unwrap();
        assert!(efd.drain(), "the sender's thread kicked the eventfd");
        assert_eq!(count.0.load(Ordering::SeqCst), 1);
        assert!(matches!(fut.as_mut().poll(&mut cx), Poll::Ready(Ok(7))));
    }

    #[test]
    fn a_local_wake_does_not_touch_the_eventfd() {
        let efd = Arc::new(EventFd::new().unwrap());
        let (tx, rx) = oneshot::channel::<u32>();
        let mut fut = Box::pin(CrossThread::new(rx, Arc::clone(&efd)));
        let count = Arc::new(Count(AtomicUsize::new(0)));
        let waker = Waker::from(Arc::clone(&count));
        let mut cx = Context::from_waker(&waker);
        assert!(fut.as_mut().poll(&mut cx).is_pending());
        tx.send(1).unwrap();
        assert!(!efd.drain());
        assert_eq!(count.0.load(Ordering::SeqCst), 1);
    }
}
