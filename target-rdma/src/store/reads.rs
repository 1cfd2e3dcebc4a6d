//! Range reads of the swap file in flight together on one shared io_uring,
//! awaited rather than waited for.
//!
//! A cold 4 KiB read run on a thread of its own (a blocking-pool job, its
//! own ring, one `io_uring_enter` waiting for it) keeps one read in flight
//! per thread, and each read costs two thread wake-ups: the disk sees as
//! many reads as there are threads, far below what NVMe needs for its
//! bandwidth. Here the caller pushes its read on the shared ring, submits it
//! and awaits the answer; one completion thread reaps every completion and
//! wakes the waiting task. The reads in flight are bounded (`capacity`),
//! the rest wait for room asynchronously.
//!
//! Each read's buffer belongs to the in-flight table from submission until
//! its completion is reaped, whatever happens to the task that asked for
//! it: a caller that goes away never frees memory the kernel still writes.

use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::Duration;

use io_uring::{opcode, types, IoUring};
use parking_lot::Mutex;
use tokio::sync::{oneshot, OwnedSemaphorePermit, Semaphore};

use super::aligned::AlignedBuf;

/// The completion marking a close: the completion thread exits once every
/// read in flight has completed.
const CLOSE: u64 = u64::MAX;

/// How long the completion thread waits before submitting again: a read
/// whose own submission failed (a transient EAGAIN/EBUSY) is carried by
/// that pass even when no other read comes to carry it.
const RESUBMIT: Duration = Duration::from_millis(100);

/// A read's outcome: its buffer, filled, or why not.
type Done = Result<AlignedBuf, io::Error>;

/// A read the kernel owns until its completion is reaped.
struct Pending {
    buf: AlignedBuf,
    tx: oneshot::Sender<Done>,
    _room: OwnedSemaphorePermit,
}

/// The reads in flight, by their ring `user_data`.
struct Table {
    slots: Vec<Option<Pending>>,
    free: Vec<usize>,
    closing: bool,
}

impl Table {
    fn in_flight(&self) -> usize {
        self.slots.len() - self.free.len()
    }
}

struct Shared {
    ring: IoUring,
    /// Also serialises pushes on the ring's submission queue.
    table: Mutex<Table>,
    bytes_read: AtomicU64,
}

/// The shared ring and its completion thread; dropping it waits for the
/// reads in flight to complete.
pub(super) struct Reads {
    shared: Arc<Shared>,
    room: Arc<Semaphore>,
    fd: RawFd,
    thread: Option<JoinHandle<()>>,
}

impl Reads {
    /// A ring over `fd` (which must outlive it) with at most `capacity`
    /// reads in flight.
    pub(super) fn start(fd: RawFd, capacity: u32) -> io::Result<Reads> {
        let capacity = capacity.max(1);
        // One submission entry to spare for the close marker; completions
        // (twice the entries) never outnumber the reads in flight.
        let ring = IoUring::new((capacity + 1).next_power_of_two())?;
        let shared = Arc::new(Shared {
            ring,
            table: Mutex::new(Table {
                slots: (0..capacity).map(|_| None).collect(),
                free: (0..capacity as usize).rev().collect(),
                closing: false,
            }),
            bytes_read: AtomicU64::new(0),
        });
        let reaper = Arc::clone(&shared);
        let thread = thread::Builder::new()
            .name("arenad-swap-rd".into())
            .spawn(move || reap(&reaper))?;
        Ok(Reads {
            shared,
            room: Arc::new(Semaphore::new(capacity as usize)),
            fd,
            thread: Some(thread),
        })
    }

    /// Reads `buf.len()` bytes at file offset `offset` into `buf` (aligned
    /// for O_DIRECT), once there is room in flight.
    pub(super) async fn read(&self, offset: u64, buf: AlignedBuf) -> Done {
        let room = Arc::clone(&self.room)
            .acquire_owned()
            .await
            .map_err(|_| io::Error::other("swap reads closed"))?;
        let (tx, rx) = oneshot::channel();
        self.push(offset, buf, tx, room)?;
        // A failed enter leaves the entry queued: the next submission (any
        // caller's, or the completion thread's within `RESUBMIT`) carries it.
        if let Err(e) = submit(&self.shared.ring) {
            tracing::warn!(event = "swap.read_submit_failed", error = %e);
        }
        rx.await
            .map_err(|_| io::Error::other("swap read abandoned"))?
    }

    fn push(
        &self,
        offset: u64,
        mut buf: AlignedBuf,
        tx: oneshot::Sender<Done>,
        room: OwnedSemaphorePermit,
    ) -> io::Result<()> {
        let len = u32::try_from(buf.len()).map_err(|_| io::Error::other("read too long"))?;
        let mut t = self.shared.table.lock();
        // The permit guarantees a free slot.
        let Some(i) = t.free.pop() else {
            return Err(io::Error::other("swap read table full"));
        };
        let entry = opcode::Read::new(types::Fd(self.fd), buf.as_mut_ptr(), len)
            .offset(offset)
            .build()
            .user_data(i as u64);
        // SAFETY: the table lock is held, so this is the only submission
        // queue in use; the buffer is heap memory that moves into the table
        // (its address does not change) and stays there until the
        // completion thread reaps this entry's completion.
        let pushed = unsafe {
            let mut sq = self.shared.ring.submission_shared();
            let r = sq.push(&entry);
            sq.sync();
            r
        };
        if pushed.is_err() {
            t.free.push(i);
            return Err(io::Error::other("swap read queue full"));
        }
        t.slots[i] = Some(Pending {
            buf,
            tx,
            _room: room,
        });
        Ok(())
    }

    pub(super) fn bytes_read(&self) -> u64 {
        self.shared.bytes_read.load(Ordering::Relaxed)
    }
}

impl Drop for Reads {
    fn drop(&mut self) {
        self.room.close();
        {
            let mut t = self.shared.table.lock();
            t.closing = true;
            let nop = opcode::Nop::new().build().user_data(CLOSE);
            // SAFETY: as in `push`; a NOP names no memory.
            let pushed = unsafe {
                let mut sq = self.shared.ring.submission_shared();
                let r = sq.push(&nop);
                sq.sync();
                r
            };
            if pushed.is_err() {
                tracing::error!(event = "swap.reads_close_failed");
            }
        }
        let _ = submit(&self.shared.ring);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn submit(ring: &IoUring) -> io::Result<usize> {
    loop {
        match ring.submitter().submit() {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            r => return r,
        }
    }
}

/// The completion thread: reaps completions and hands each read's buffer
/// to its waiting task, until closed with nothing in flight.
fn reap(shared: &Shared) {
    let mut done = Vec::new();
    let wait = types::Timespec::from(RESUBMIT);
    let args = types::SubmitArgs::new().timespec(&wait);
    loop {
        if let Err(e) = shared.ring.submitter().submit_with_args(1, &args) {
            // ETIME: `RESUBMIT` passed with nothing completed.
            let timed_out = e.raw_os_error() == Some(rustix::io::Errno::TIME.raw_os_error());
            if !timed_out && e.kind() != io::ErrorKind::Interrupted {
                // Transient (EBUSY, EAGAIN): completions still land in the
                // queue, reaped below.
                tracing::warn!(event = "swap.read_wait_failed", error = %e);
                thread::sleep(Duration::from_millis(1));
            }
        }
        let finished = {
            let mut t = shared.table.lock();
            // SAFETY: only this thread reads the completion queue.
            for cqe in unsafe { shared.ring.completion_shared() } {
                let i = cqe.user_data();
                if i == CLOSE {
                    continue;
                }
                if let Some(p) = t.slots.get_mut(i as usize).and_then(Option::take) {
                    t.free.push(i as usize);
                    done.push((p, cqe.result()));
                }
            }
            t.closing && t.in_flight() == 0
        };
        for (p, res) in done.drain(..) {
            let want = p.buf.len();
            let out = if res < 0 {
                Err(io::Error::from_raw_os_error(-res))
            } else if res as usize != want {
                Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("short read of {res} of {want} bytes"),
                ))
            } else {
                shared.bytes_read.fetch_add(want as u64, Ordering::Relaxed);
                Ok(p.buf)
            };
            let _ = p.tx.send(out);
        }
        if finished {
            return;
        }
    }
}
