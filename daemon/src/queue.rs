//! The I/O plane's kernel side: one thread per hardware queue, each with
//! its own io_uring (libublk's thread-local ring) and local executor, one
//! task per tag, and its own target (its own arena connection).
//!
//! A TCP queue's arena connection is driven on the queue's own ring
//! ([`QueueRing`]): a POLL_ADD on its socket ends the ring wait when answers
//! arrive, the queue thread reads them and completes their requests itself,
//! and a TIMEOUT every tick sweeps request deadlines; no reader thread and
//! no cross-thread wake per request. An RDMA queue's completion queue is
//! reaped the same way: polled (for up to `busy_poll_us`) while
//! transfers are in flight, then a POLL_ADD on its completion channel.
//! Whatever still completes on another thread (an RDMA session's control
//! stream, answered by its reader thread) wakes the queue through
//! [`CrossThread`], which writes the queue's eventfd, and a helper task
//! keeps a POLL_ADD on that eventfd in the ring so the write becomes a CQE
//! that ends the thread's wait in the kernel.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::rc::Rc;
use std::sync::Arc;

use io_uring::{opcode, types};
use libublk::io::UblkQueue;
use libublk::uring_async::ublk_submit_sqe_async;
use libublk::{BufDesc, UblkError, UblkUringData};
use target_rdma::block::{ArenaTarget, DeviceSize};
use target_rdma::client::tcp::ring::Ring;
use target_rdma::client::tcp::TICK;
use ublk_metrics::events;

use crate::io::{serve, IoDesc};
use crate::observability::DeviceObs;
use crate::queue_io::QueueIo;
use crate::wake::{CrossThread, EventFd};

/// Serves one tag until the queue goes down. The tag's buffer comes from
/// the queue's [`TagBuffers`](crate::queue_io::TagBuffers) (registered once
/// for RDMA): the kernel copies WRITE data into it and READ data out of it,
/// and the transport moves payloads straight from and into it.
async fn io_task(
    q: &UblkQueue<'_>,
    tag: u16,
    io: &QueueIo,
    size: &DeviceSize,
    efd: &Arc<EventFd>,
    dev: &DeviceObs,
) -> Result<(), UblkError> {
    let Some(buf) = io
        .buffers()
        .tag(tag)
        .filter(|b| b.len() >= q.dev.dev_info.max_io_buf_bytes as usize)
    else {
        tracing::error!(event = events::QUEUE_NO_BUFFER, qid = q.get_qid(), tag);
        return Err(UblkError::OtherError(-libc::EINVAL));
    };
    q.submit_io_prep_cmd(tag, BufDesc::Slice(buf.as_slice()), 0, Some(buf))
        .await?;
    let target = ArenaTarget::new(io.volume(), size.clone());
    loop {
        let desc = IoDesc::from(q.get_iod(tag));
        // SAFETY: this task alone serves tag `tag`, so nothing else touches
        // its buffer while the request runs (the kernel copies in and out
        // only between our COMMIT and the next FETCH completion); the
        // buffer lives in `io`, which outlives this borrow.
        let data = unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr(), buf.len()) };
        let res = CrossThread::new(
            serve(&target, &desc, data, dev, q.get_qid(), tag),
            Arc::clone(efd),
        )
        .await;
        q.submit_io_commit_cmd(tag, BufDesc::Slice(buf.as_slice()), res)
            .await?;
    }
}

/// Keeps a POLL_ADD on the eventfd armed so foreign wake-ups end the ring wait.
async fn wake_task(efd: Arc<EventFd>) {
    loop {
        let sqe = opcode::PollAdd::new(types::Fd(efd.as_raw_fd()), libc::POLLIN as u32).build();
        match ublk_submit_sqe_async(sqe, UblkUringData::Target as u64).await {
            Ok(r) if r >= 0 => {
                efd.drain();
            }
            Ok(r) => {
                tracing::error!(event = events::QUEUE_WAKE_POLL_FAILED, errno = -r);
                return;
            }
            Err(e) => {
                tracing::error!(event = events::QUEUE_WAKE_POLL_FAILED, error = %e);
                return;
            }
        }
    }
}

/// The queue's ring as a driven arena client's event loop.
struct QueueRing;

/// The deadline sweep's timeout; the kernel reads it when it is submitted.
static TICK_TS: types::Timespec = types::Timespec::new()
    .sec(TICK.as_secs())
    .nsec(TICK.subsec_nanos());

impl Ring for QueueRing {
    async fn readable(&self, fd: RawFd) -> io::Result<()> {
        let sqe = opcode::PollAdd::new(types::Fd(fd), libc::POLLIN as u32).build();
        match ublk_submit_sqe_async(sqe, UblkUringData::Target as u64).await {
            Ok(r) if r >= 0 => Ok(()),
            Ok(r) => Err(io::Error::from_raw_os_error(-r)),
            Err(e) => Err(io::Error::other(e.to_string())),
        }
    }

    async fn tick(&self) {
        // -ETIME is how a timeout completes; a failed submission (the ring
        // is going down) ends the wait as well.
        let sqe = opcode::Timeout::new(&TICK_TS).build();
        let _ = ublk_submit_sqe_async(sqe, UblkUringData::Target as u64).await;
    }
}

/// Runs queue `qid` of `dev` over its arena session `io` (a block device
/// of `size` bytes, which `ublkctl resize` may grow) until the device stops.
pub fn run(
    qid: u16,
    dev: &libublk::io::UblkDev,
    io: QueueIo,
    size: DeviceSize,
    obs: Arc<DeviceObs>,
) {
    let efd = match EventFd::new() {
        Ok(e) => Arc::new(e),
        Err(e) => {
            tracing::error!(event = events::QUEUE_EVENTFD_FAILED, qid, error = %e);
            return;
        }
    };
    let q = match UblkQueue::new(qid, dev) {
        Ok(q) => Rc::new(q),
        Err(e) => {
            tracing::error!(event = events::QUEUE_CREATE_FAILED, qid, error = %e);
            return;
        }
    };
    let io = Rc::new(io);
    let exe = Rc::new(smol::LocalExecutor::new());
    let mut tasks = Vec::new();
    for tag in q.tags() {
        let (q, io, size, efd, obs) = (
            Rc::clone(&q),
            Rc::clone(&io),
            size.clone(),
            Arc::clone(&efd),
            Arc::clone(&obs),
        );
        tasks.push(exe.spawn(async move {
            match io_task(&q, tag, &io, &size, &efd, &obs).await {
                Err(UblkError::QueueIsDown) | Ok(()) => {}
                Err(e) => tracing::error!(event = events::QUEUE_TAG_FAILED, qid, tag, error = %e),
            }
        }));
    }
    let waker = exe.spawn(wake_task(Arc::clone(&efd)));
    // A TCP session's answers and an RDMA session's completions are
    // reaped on this ring. The drivers' wakes come from this thread, but
    // for a reconnect or a new rail made by another (the device
    // manager's), so they are woken like the tags are.
    let driver = io.session().client().driver().map(|d| {
        exe.spawn(CrossThread::new(
            async move { d.run(&QueueRing).await },
            Arc::clone(&efd),
        ))
    });
    let cq_driver = io.session().rdma_cq_driver().map(|d| {
        exe.spawn(CrossThread::new(
            async move { d.run(&QueueRing).await },
            Arc::clone(&efd),
        ))
    });
    let run_exe = Rc::clone(&exe);
    smol::block_on(exe.run(async move {
        let run_ops = || while run_exe.try_tick() {};
        let done = || tasks.iter().all(|t| t.is_finished());
        if let Err(e) = libublk::wait_and_handle_io_events(&q, Some(20), run_ops, done).await {
            tracing::error!(event = events::QUEUE_LOOP_FAILED, qid, error = %e);
        }
    }));
    drop(waker);
    drop(driver);
    drop(cq_driver);
    tracing::info!(event = events::QUEUE_STOPPED, qid);
}
