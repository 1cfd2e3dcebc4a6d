//! A one-thread io_uring loop that stands in for a ublk queue thread in
//! tests and benchmarks: [`UringLoop::block_on`] polls one future and
//! waits in the ring for the completions of the operations it submitted
//! (and for wakes from other threads, through an eventfd it polls, as
//! ublkd's queue does), as libublk's queue loop does, so a driven client
//! ([`crate::client::ClientConfig::driven`]) runs here exactly as it does
//! in ublkd, without the kernel module.

use std::cell::RefCell;
use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::thread::{self, ThreadId};

use io_uring::{opcode, squeue, types, IoUring};
use rustix::event::{eventfd, EventfdFlags};

use crate::client::tcp::ring::Ring;
use crate::client::tcp::TICK;

/// The deadline sweep's timeout, read by the kernel when it is submitted.
static TICK_TS: types::Timespec = types::Timespec::new()
    .sec(TICK.as_secs())
    .nsec(TICK.subsec_nanos());

/// An operation in flight: its result once completed, and who to wake.
#[derive(Default)]
struct Slot {
    result: Option<i32>,
    waker: Option<Waker>,
}

/// One thread's ring and the futures of the operations in it.
pub struct UringLoop {
    ring: RefCell<IoUring>,
    ops: RefCell<HashMap<u64, Slot>>,
    next: std::cell::Cell<u64>,
    woken: Arc<Flag>,
    /// A poll of the eventfd is in the ring.
    armed: std::cell::Cell<bool>,
}

/// The loop's waker: a flag for wakes on the loop's thread, and an
/// eventfd the ring polls for wakes from other threads (a driven client
/// reconnected by another thread hands its receiver over so).
struct Flag {
    woken: AtomicBool,
    efd: OwnedFd,
    owner: ThreadId,
}

impl Wake for Flag {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::SeqCst);
        if thread::current().id() != self.owner {
            let _ = rustix::io::write(&self.efd, &1u64.to_ne_bytes());
        }
    }
}

/// The user data of the eventfd's poll.
const WAKE: u64 = 0;

impl UringLoop {
    /// A loop with a ring of 64 entries.
    pub fn new() -> io::Result<Self> {
        Ok(Self {
            ring: RefCell::new(IoUring::new(64)?),
            ops: RefCell::default(),
            next: std::cell::Cell::new(WAKE + 1),
            woken: Arc::new(Flag {
                woken: AtomicBool::new(false),
                efd: eventfd(0, EventfdFlags::NONBLOCK | EventfdFlags::CLOEXEC)?,
                owner: thread::current().id(),
            }),
            armed: std::cell::Cell::new(false),
        })
    }

    /// Runs `f` to completion on this thread, waiting in the ring whenever
    /// it is pending and nothing on this thread woke it.
    pub fn block_on<F: Future>(&self, f: F) -> F::Output {
        let mut f = pin!(f);
        let waker = Waker::from(Arc::clone(&self.woken));
        let mut cx = Context::from_waker(&waker);
        assert_eq!(
            thread::current().id(),
            self.woken.owner,
            "a loop runs on the thread that made it"
        );
        loop {
            self.woken.woken.store(false, Ordering::SeqCst);
            if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
                return v;
            }
            if self.woken.woken.load(Ordering::SeqCst) {
                continue;
            }
            let mut ring = self.ring.borrow_mut();
            if !self.armed.get() {
                let fd = types::Fd(self.woken.efd.as_raw_fd());
                let sqe = opcode::PollAdd::new(fd, libc::POLLIN as u32)
                    .build()
                    .user_data(WAKE);
                // SAFETY: a poll of the eventfd, which lives as long as the
                // ring (both are this loop's).
                while unsafe { ring.submission().push(&sqe) }.is_err() {
                    ring.submit().expect("io_uring submit");
                }
                self.armed.set(true);
            }
            if let Err(e) = ring.submit_and_wait(1) {
                assert_eq!(e.raw_os_error(), Some(libc::EINTR), "io_uring_enter: {e}");
            }
            let mut ops = self.ops.borrow_mut();
            for cqe in ring.completion() {
                if cqe.user_data() == WAKE {
                    let mut buf = [0u8; 8];
                    let _ = rustix::io::read(&self.woken.efd, &mut buf);
                    self.armed.set(false);
                    continue;
                }
                if let Some(slot) = ops.get_mut(&cqe.user_data()) {
                    slot.result = Some(cqe.result());
                    if let Some(w) = slot.waker.take() {
                        w.wake();
                    }
                }
            }
        }
    }

    /// Submits `sqe`; ready with its result.
    fn op(&self, sqe: squeue::Entry) -> Op<'_> {
        let id = self.next.get();
        self.next.set(id + 1);
        Op {
            lp: self,
            id,
            sqe: Some(sqe.user_data(id)),
        }
    }
}

/// One submitted operation's future.
struct Op<'a> {
    lp: &'a UringLoop,
    id: u64,
    /// Not pushed to the ring yet.
    sqe: Option<squeue::Entry>,
}

impl Future for Op<'_> {
    type Output = i32;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<i32> {
        if let Some(sqe) = self.sqe.take() {
            let mut ring = self.lp.ring.borrow_mut();
            // SAFETY: the entries this loop submits (POLL_ADD on a
            // descriptor, TIMEOUT on a static timespec) point at no memory
            // that could go away before they complete.
            while unsafe { ring.submission().push(&sqe) }.is_err() {
                ring.submit().expect("io_uring submit");
            }
            self.lp.ops.borrow_mut().insert(self.id, Slot::default());
        }
        let mut ops = self.lp.ops.borrow_mut();
        let slot = ops.entry(self.id).or_default();
        match slot.result {
            Some(r) => {
                ops.remove(&self.id);
                Poll::Ready(r)
            }
            None => {
                slot.waker = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

impl Drop for Op<'_> {
    fn drop(&mut self) {
        // A completion that comes later finds no slot and is ignored.
        self.lp.ops.borrow_mut().remove(&self.id);
    }
}

impl Ring for UringLoop {
    async fn readable(&self, fd: RawFd) -> io::Result<()> {
        let sqe = opcode::PollAdd::new(types::Fd(fd), libc::POLLIN as u32).build();
        match self.op(sqe).await {
            r if r >= 0 => Ok(()),
            r => Err(io::Error::from_raw_os_error(-r)),
        }
    }

    async fn tick(&self) {
        // -ETIME is how a timeout completes.
        self.op(opcode::Timeout::new(&TICK_TS).build()).await;
    }
}
