//! Range reads of the swap file in flight together on io_uring, awaited
//! rather than waited for.
//!
//! A cold 4 KiB read run on a thread of its own (a blocking-pool job, its
//! own ring, one `io_uring_enter` waiting for it) keeps one read in flight
//! per thread, and each read costs two thread wake-ups: the disk sees as
//! many reads as there are threads, far below what NVMe needs. Here the
//! caller pushes its read on a ring and awaits the answer, on one of two
//! kinds of lane:
//!
//! - a thread's own lane ([`Reads::serve_here`], one per arenad worker
//!   thread): its ring is driven by a task of that thread's current-thread
//!   runtime. The reads its tasks push during one turn of the runtime go
//!   to the kernel in one `io_uring_enter`, and their completions are
//!   reaped on the same thread when the ring's descriptor polls readable
//!   (the kernel runs a read's completion on the thread that submitted
//!   it): no other thread is woken, and a batch of completions wakes the
//!   thread once;
//! - else the shared lane: one `io_uring_enter` per read, and one
//!   completion thread that reaps every completion and wakes the waiting
//!   task (callers outside arenad's workers: tests, tools).
//!
//! The reads in flight over all lanes are bounded (`capacity`); the rest
//! wait for room asynchronously. Each read's buffer belongs to its lane's
//! in-flight table from the push until its completion is reaped, whatever
//! happens to the task that asked for it: a caller that goes away never
//! frees memory the kernel still writes. A lane that goes away first waits
//! for its reads to complete.

use std::cell::RefCell;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::Duration;

use io_uring::{opcode, types, IoUring};
use parking_lot::Mutex;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::runtime::{Handle, RuntimeFlavor};
use tokio::sync::{oneshot, Notify, OwnedSemaphorePermit, Semaphore};
use ublk_metrics::events;

use super::aligned::AlignedBuf;
use super::disk::{DiskFile, Transfer};
use super::error::{io_err, refused, Refusal, StoreError};

/// The completion marking a close: the completion thread exits once every
/// read in flight has completed.
const CLOSE: u64 = u64::MAX;

/// How long a lane waits before submitting again: a read whose submission
/// failed (a transient EAGAIN/EBUSY) is carried by that pass even when no
/// other read comes to carry it.
const RESUBMIT: Duration = Duration::from_millis(100);

/// A read's outcome: its buffer, filled, or why not.
type Done = Result<AlignedBuf, StoreError>;

/// What a failed read was doing, in its error.
const READING: &str = "reading swap extent from";

/// Tells `Reads` apart in a thread's lanes.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// The lanes of this thread, one per `Reads` that serves here.
    static LANES: RefCell<Vec<Arc<Lane>>> = const { RefCell::new(Vec::new()) };
}

/// A read the kernel owns until its completion is reaped.
struct Pending {
    buf: AlignedBuf,
    tx: oneshot::Sender<Done>,
    _room: OwnedSemaphorePermit,
}

/// A lane's reads in flight, by their ring `user_data`.
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

/// What every lane of one swap file shares.
struct Common {
    id: u64,
    /// The swap file, kept open while any lane may still submit a read of it.
    file: DiskFile,
    /// Its path, for errors.
    path: PathBuf,
    capacity: u32,
    room: Arc<Semaphore>,
    bytes_read: AtomicU64,
}

/// One ring and its in-flight table.
struct Lane {
    common: Arc<Common>,
    ring: IoUring,
    /// Also serialises pushes on the ring's submission queue.
    table: Mutex<Table>,
    /// A thread's lane: reads pushed and not yet submitted, and the wake
    /// of the task that submits them.
    unsubmitted: AtomicUsize,
    pushed: Notify,
}

/// A swap file's reads: the shared lane and its completion thread, and the
/// room in flight; dropping it waits for the shared lane's reads.
pub(super) struct Reads {
    common: Arc<Common>,
    shared: Arc<Lane>,
    thread: Option<JoinHandle<()>>,
}

impl Reads {
    /// Reads of `file` (at `path`) with at most `capacity` reads in flight
    /// over all lanes.
    pub(super) fn start(file: &DiskFile, path: &Path, capacity: u32) -> io::Result<Reads> {
        let capacity = capacity.max(1);
        let common = Arc::new(Common {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            file: file.try_clone()?,
            path: path.to_path_buf(),
            capacity,
            room: Arc::new(Semaphore::new(capacity as usize)),
            bytes_read: AtomicU64::new(0),
        });
        // One submission entry to spare for the close marker.
        let shared = Arc::new(Lane::new(Arc::clone(&common), capacity + 1, false)?);
        let reaper = Arc::clone(&shared);
        let thread = thread::Builder::new()
            .name("arenad-swap-rd".into())
            .spawn(move || reap_thread(&reaper))?;
        Ok(Reads {
            common,
            shared,
            thread: Some(thread),
        })
    }

    /// Gives the calling thread a lane of its own, driven by a task spawned
    /// on the thread's current-thread tokio runtime (called from within
    /// it): this thread's reads are submitted and reaped here from now on.
    pub(super) fn serve_here(&self) -> io::Result<()> {
        let handle = Handle::try_current().map_err(io::Error::other)?;
        if handle.runtime_flavor() != RuntimeFlavor::CurrentThread {
            return Err(io::Error::other(
                "a swap-read lane needs a current-thread runtime",
            ));
        }
        if local_lane(self.common.id).is_some() {
            return Ok(());
        }
        let lane = Arc::new(Lane::new(
            Arc::clone(&self.common),
            self.common.capacity,
            true,
        )?);
        // SAFETY: `RingFd` owns (a handle on) the lane, so the ring's
        // descriptor stays open and the same while the `AsyncFd` exists.
        let ready = unsafe {
            AsyncFd::register_with_interest(RingFd(Arc::clone(&lane)), Interest::READABLE)
        }
        .map_err(|e| e.into_parts().1)?;
        LANES.with(|l| l.borrow_mut().push(lane));
        handle.spawn(drive(ready));
        Ok(())
    }

    /// Reads `buf.len()` bytes at file offset `offset` into `buf` (aligned
    /// for O_DIRECT), once there is room in flight: on this thread's lane
    /// if it has one, else on the shared lane.
    pub(super) async fn read(&self, offset: u64, buf: AlignedBuf) -> Done {
        let room = Arc::clone(&self.common.room)
            .acquire_owned()
            .await
            .map_err(|_| self.refused(Refusal::SwapReadsClosed))?;
        let (tx, rx) = oneshot::channel();
        if let Some(lane) = local_lane(self.common.id) {
            lane.push(offset, buf, tx, room)?;
            // Submitted by the lane's task once this turn's other tasks
            // have pushed theirs.
            lane.unsubmitted.fetch_add(1, Ordering::AcqRel);
            lane.pushed.notify_one();
        } else {
            self.shared.push(offset, buf, tx, room)?;
            // A failed enter leaves the entry queued: the next submission
            // (any caller's, or the completion thread's within `RESUBMIT`)
            // carries it.
            if let Err(e) = submit(&self.shared.ring) {
                tracing::warn!(event = events::SWAP_READ_SUBMIT_FAILED, error = %e);
            }
        }
        rx.await
            .map_err(|_| self.refused(Refusal::SwapReadAbandoned))?
    }

    fn refused(&self, refusal: Refusal) -> StoreError {
        refused(READING, &self.common.path, refusal)
    }

    pub(super) fn bytes_read(&self) -> u64 {
        self.common.bytes_read.load(Ordering::Relaxed)
    }

    /// Whether the calling thread has a lane of its own.
    #[cfg(test)]
    pub(super) fn served_here(&self) -> bool {
        local_lane(self.common.id).is_some()
    }
}

impl Drop for Reads {
    fn drop(&mut self) {
        self.common.room.close();
        {
            let mut t = self.shared.table.lock();
            t.closing = true;
            let nop = opcode::Nop::new().build().user_data(CLOSE);
            // SAFETY: as in `Lane::push`; a NOP names no memory.
            let pushed = unsafe {
                let mut sq = self.shared.ring.submission_shared();
                let r = sq.push(&nop);
                sq.sync();
                r
            };
            if pushed.is_err() {
                tracing::error!(event = events::SWAP_READS_CLOSE_FAILED);
            }
        }
        let _ = submit(&self.shared.ring);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// This thread's lane for the `Reads` numbered `id`.
fn local_lane(id: u64) -> Option<Arc<Lane>> {
    LANES
        .try_with(|l| l.borrow().iter().find(|x| x.common.id == id).cloned())
        .ok()
        .flatten()
}

impl Lane {
    /// A lane of `entries` submission entries; `own` for a thread's own,
    /// whose completions need not interrupt the thread.
    fn new(common: Arc<Common>, entries: u32, own: bool) -> io::Result<Lane> {
        let slots = common.capacity as usize;
        // Completions (twice the entries) never outnumber the reads in
        // flight.
        let entries = entries.next_power_of_two();
        // A thread's own ring: a completion is posted at the thread's next
        // system call (it makes one every turn: a socket read or write, the
        // reactor's poll), or wakes it if it sleeps, rather than sending a
        // running thread an interrupt (a costly exit to the hypervisor in a
        // VM). Kernels before 5.19 refuse the flag: a ring without it.
        let ring = match own {
            true => IoUring::builder()
                .setup_coop_taskrun()
                .build(entries)
                .or_else(|_| IoUring::new(entries))?,
            false => IoUring::new(entries)?,
        };
        Ok(Lane {
            common,
            ring,
            table: Mutex::new(Table {
                slots: (0..slots).map(|_| None).collect(),
                free: (0..slots).rev().collect(),
                closing: false,
            }),
            unsubmitted: AtomicUsize::new(0),
            pushed: Notify::new(),
        })
    }

    fn push(
        &self,
        offset: u64,
        mut buf: AlignedBuf,
        tx: oneshot::Sender<Done>,
        room: OwnedSemaphorePermit,
    ) -> Result<(), StoreError> {
        let len = u32::try_from(buf.len())
            .map_err(|_| io_err(READING, &self.common.path)(io::Error::other("read too long")))?;
        let mut t = self.table.lock();
        // The permit guarantees a free slot.
        let Some(i) = t.free.pop() else {
            return Err(refused(
                READING,
                &self.common.path,
                Refusal::SwapReadTableFull,
            ));
        };
        let transfer = Transfer {
            offset,
            len,
            data: None,
        };
        if let Some(res) = self.common.file.queue(transfer) {
            t.free.push(i);
            drop(t);
            let _ = tx.send(self.common.outcome(res, buf));
            return Ok(());
        }
        let fd = types::Fd(self.common.file.as_raw_fd());
        let entry = opcode::Read::new(fd, buf.as_mut_ptr(), len)
            .offset(offset)
            .build()
            .user_data(i as u64);
        // SAFETY: the table lock is held, so this is the only submission
        // queue in use; the buffer is heap memory that moves into the table
        // (its address does not change) and stays there until this entry's
        // completion is reaped; the file stays open as long as the lane.
        let pushed = unsafe {
            let mut sq = self.ring.submission_shared();
            let r = sq.push(&entry);
            sq.sync();
            r
        };
        if pushed.is_err() {
            t.free.push(i);
            return Err(refused(
                READING,
                &self.common.path,
                Refusal::SwapReadQueueFull,
            ));
        }
        t.slots[i] = Some(Pending {
            buf,
            tx,
            _room: room,
        });
        Ok(())
    }

    /// Submits a thread lane's pushed reads in one enter; `false` when
    /// some are left for a later pass.
    fn submit_pushed(&self) -> bool {
        let n = self.unsubmitted.swap(0, Ordering::AcqRel);
        if n == 0 {
            return true;
        }
        match submit(&self.ring) {
            Ok(done) if done >= n => true,
            r => {
                if let Err(e) = r {
                    tracing::warn!(event = events::SWAP_READ_SUBMIT_FAILED, error = %e);
                }
                // Still queued: counted again for the next pass (an enter
                // submits whatever the queue holds).
                self.unsubmitted.fetch_add(1, Ordering::AcqRel);
                false
            }
        }
    }

    /// Hands every completed read's buffer (or error) to its waiting task;
    /// whether the lane is closing with nothing left in flight.
    fn reap(&self) -> bool {
        let mut done = Vec::new();
        let finished = {
            let mut t = self.table.lock();
            // SAFETY: the table lock is held, so this is the only reader of
            // the completion queue.
            for cqe in unsafe { self.ring.completion_shared() } {
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
        for (p, res) in done {
            let _ = p.tx.send(self.common.outcome(res, p.buf));
        }
        finished
    }
}

impl Common {
    /// What a read into `buf` that completed with `res` gives its task.
    fn outcome(&self, res: i32, buf: AlignedBuf) -> Done {
        let want = buf.len();
        if res < 0 {
            Err(io_err(READING, &self.path)(io::Error::from_raw_os_error(
                -res,
            )))
        } else if res as usize != want {
            Err(io_err(READING, &self.path)(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("short read of {res} of {want} bytes"),
            )))
        } else {
            self.bytes_read.fetch_add(want as u64, Ordering::Relaxed);
            Ok(buf)
        }
    }
}

impl Drop for Lane {
    /// Waits for every read still in flight (or queued: submitted now),
    /// whose buffer the kernel may write until it completes; if the ring
    /// cannot be waited on, their buffers are leaked rather than freed.
    fn drop(&mut self) {
        loop {
            self.reap();
            let left = self.table.lock().in_flight();
            if left == 0 {
                return;
            }
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    tracing::error!(event = events::SWAP_READ_DRAIN_FAILED, error = %e, in_flight = left);
                    for p in self
                        .table
                        .get_mut()
                        .slots
                        .iter_mut()
                        .filter_map(Option::take)
                    {
                        std::mem::forget(p.buf);
                    }
                    return;
                }
            }
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

/// A lane's ring descriptor, polled for completions.
struct RingFd(Arc<Lane>);

impl AsRawFd for RingFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.ring.as_raw_fd()
    }
}

/// A thread lane's task: submits the reads pushed during a turn of the
/// runtime together, and reaps completions when the ring polls readable,
/// until the runtime ends (or its reactor fails: then the thread's reads
/// go to the shared lane, and this lane's drain once it is dropped).
async fn drive(ready: AsyncFd<RingFd>) {
    let lane = &ready.get_ref().0;
    // However the task ends (its runtime shut down, its reactor failed),
    // the thread's reads go to the shared lane from then on.
    let _unbind = Unbind(lane.common.id);
    let mut retry = false;
    loop {
        tokio::select! {
            biased;
            r = ready.readable() => match r {
                Ok(mut guard) => {
                    lane.reap();
                    // A completion posted after the reap raises a new
                    // edge, seen at the runtime's next poll.
                    guard.clear_ready();
                }
                Err(e) => {
                    tracing::error!(event = events::SWAP_READ_LANE_FAILED, error = %e);
                    break;
                }
            },
            // Woken by the first read pushed this turn, this task runs
            // after the tasks already queued (the reader's new requests,
            // the reads woken with it), which push theirs first.
            () = lane.pushed.notified() => retry = !lane.submit_pushed(),
            () = tokio::time::sleep(RESUBMIT), if retry => {
                retry = !lane.submit_pushed();
            }
        }
    }
}

/// Takes a thread's lane for the `Reads` numbered `.0` out of its lanes.
struct Unbind(u64);

impl Drop for Unbind {
    fn drop(&mut self) {
        let id = self.0;
        let gone = LANES
            .try_with(|l| {
                let mut l = l.try_borrow_mut().ok()?;
                let i = l.iter().position(|x| x.common.id == id)?;
                Some(l.swap_remove(i))
            })
            .ok()
            .flatten();
        // Dropped (draining, if this was the last handle) outside the borrow.
        drop(gone);
    }
}

/// The shared lane's completion thread: reaps completions and hands each
/// read's buffer to its waiting task, until closed with nothing in flight.
fn reap_thread(lane: &Lane) {
    let wait = types::Timespec::from(RESUBMIT);
    let args = types::SubmitArgs::new().timespec(&wait);
    loop {
        if let Err(e) = lane.ring.submitter().submit_with_args(1, &args) {
            // ETIME: `RESUBMIT` passed with nothing completed.
            let timed_out = e.raw_os_error() == Some(rustix::io::Errno::TIME.raw_os_error());
            if !timed_out && e.kind() != io::ErrorKind::Interrupted {
                // Transient (EBUSY, EAGAIN): completions still land in the
                // queue, reaped below.
                tracing::warn!(event = events::SWAP_READ_WAIT_FAILED, error = %e);
                thread::sleep(Duration::from_millis(1));
            }
        }
        if lane.reap() {
            return;
        }
    }
}
