//! A connection's outbound side: a queue bounded in frames and bytes, and
//! the writer (a future of the connection's task) that alone writes the
//! socket. Answers (from the reader or a blocking-pool job) and REVOKEs (from whichever thread the store
//! revoked on) are pushed here; the writer seals them (version byte, tag
//! and sequence number) in the order they reach the socket, so tags stay
//! right however the producers interleave.
//!
//! A client that does not drain its answers within the write deadline is
//! disconnected, and so is one whose queue a REVOKE finds full: the revoke
//! path never waits for a client. The queue's lock guards only the queue;
//! it is never held across a socket write or an await.

use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::pin::pin;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::io::AsyncWriteExt;
use tokio::net::tcp::OwnedWriteHalf;
use tokio::sync::Notify;

use crate::arenad::frames::Tagger;

/// How many frames and bytes a connection's queue may hold.
#[derive(Clone, Copy, Debug)]
pub(super) struct QueueLimits {
    pub(super) frames: usize,
    pub(super) bytes: usize,
}

struct Out {
    frame: Vec<u8>,
    /// An answer (counted in flight until written), not a REVOKE.
    answer: bool,
}

#[derive(PartialEq, Eq, Clone, Copy)]
enum State {
    Open,
    /// No more frames: the writer exits once the queue is written.
    Finishing,
    /// Ended (write deadline, a full queue at REVOKE, a failed write):
    /// queued frames are dropped.
    Closed,
}

struct Queue {
    frames: VecDeque<Out>,
    bytes: usize,
    state: State,
}

/// The queue shared by the connection's producers and its writer.
pub(super) struct Outbox {
    queue: Mutex<Queue>,
    limits: QueueLimits,
    /// Requests read and not yet answered on the socket: the reader
    /// refuses one beyond the announced `max_inflight`.
    inflight: AtomicU32,
    /// The writer waits on it for frames.
    wake: Notify,
    /// Answers wait on it for room.
    room: Notify,
    /// Tasks waiting for the connection to end.
    ended: Notify,
}

/// Why a REVOKE was not queued.
pub(super) enum NotQueued {
    /// The client does not read: its queue is full.
    Full,
    /// The connection is ending.
    Ended,
}

impl Outbox {
    pub(super) fn new(limits: QueueLimits) -> Self {
        Self {
            queue: Mutex::new(Queue {
                frames: VecDeque::new(),
                bytes: 0,
                state: State::Open,
            }),
            limits,
            inflight: AtomicU32::new(0),
            wake: Notify::new(),
            room: Notify::new(),
            ended: Notify::new(),
        }
    }

    /// Counts a request read; `false` (and nothing counted) when `limit`
    /// are already in flight.
    pub(super) fn begin_request(&self, limit: u32) -> bool {
        self.inflight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < limit).then_some(n + 1)
            })
            .is_ok()
    }

    /// Queues a request's answer, waiting for room; `false` when the
    /// connection ended instead (the answer is dropped).
    pub(super) async fn answer(&self, frame: Vec<u8>) -> bool {
        let mut frame = Some(frame);
        loop {
            let mut room = pin!(self.room.notified());
            room.as_mut().enable();
            {
                let mut q = self.queue.lock();
                match q.state {
                    State::Open => {}
                    State::Finishing | State::Closed => {
                        self.inflight.fetch_sub(1, Ordering::AcqRel);
                        return false;
                    }
                }
                let len = frame.as_ref().map_or(0, Vec::len);
                let fits = q.frames.len() < self.limits.frames
                    && (q.frames.is_empty() || q.bytes + len <= self.limits.bytes);
                if fits {
                    let frame = frame.take().expect("queued once");
                    q.bytes += frame.len();
                    q.frames.push_back(Out {
                        frame,
                        answer: true,
                    });
                    drop(q);
                    self.wake.notify_one();
                    return true;
                }
            }
            room.await;
        }
    }

    /// Queues a REVOKE without waiting.
    pub(super) fn revoke(&self, frame: Vec<u8>) -> Result<(), NotQueued> {
        let mut q = self.queue.lock();
        if q.state != State::Open {
            return Err(NotQueued::Ended);
        }
        if q.frames.len() >= self.limits.frames {
            return Err(NotQueued::Full);
        }
        q.bytes += frame.len();
        q.frames.push_back(Out {
            frame,
            answer: false,
        });
        drop(q);
        self.wake.notify_one();
        Ok(())
    }

    /// No more frames except `last` (an error frame that ends the session):
    /// the writer sends what is queued, then closes the socket.
    pub(super) fn finish(&self, last: Option<Vec<u8>>) {
        let mut q = self.queue.lock();
        if q.state != State::Open {
            return;
        }
        if let Some(frame) = last {
            q.bytes += frame.len();
            q.frames.push_back(Out {
                frame,
                answer: false,
            });
        }
        q.state = State::Finishing;
        drop(q);
        self.notify_all();
    }

    /// Ends the connection now; queued frames are dropped.
    pub(super) fn close(&self) {
        let mut q = self.queue.lock();
        q.state = State::Closed;
        q.frames.clear();
        q.bytes = 0;
        drop(q);
        self.notify_all();
    }

    fn notify_all(&self) {
        self.wake.notify_one();
        self.room.notify_waiters();
        self.ended.notify_waiters();
    }

    /// Whether the connection is ending (finishing or closed).
    fn ending(&self) -> bool {
        self.queue.lock().state != State::Open
    }

    /// Resolves once the connection is ending.
    pub(super) async fn ended(&self) {
        loop {
            let mut n = pin!(self.ended.notified());
            n.as_mut().enable();
            if self.ending() {
                return;
            }
            n.await;
        }
    }

    /// Moves every queued frame into `batch`; `None` when the writer is
    /// done (finished and drained, or closed).
    fn take(&self, batch: &mut Vec<Out>) -> Option<()> {
        let mut q = self.queue.lock();
        if q.state == State::Closed || (q.frames.is_empty() && q.state == State::Finishing) {
            return None;
        }
        batch.extend(q.frames.drain(..));
        q.bytes = 0;
        drop(q);
        if !batch.is_empty() {
            self.room.notify_waiters();
        }
        Some(())
    }
}

/// Why the writer stopped writing.
pub(super) enum WriterEnd {
    /// Everything queued was written.
    Drained,
    /// The client did not take a batch within the write deadline.
    Deadline,
    /// The socket failed (the client went away).
    Io(io::Error),
}

/// The connection's writer: takes the queued frames in order, seals them
/// and writes them, each batch within `deadline`.
pub(super) async fn write(
    outbox: &Outbox,
    mut socket: OwnedWriteHalf,
    mut tagger: Tagger,
    deadline: Duration,
) -> WriterEnd {
    let mut batch = Vec::new();
    let end = loop {
        let mut wake = pin!(outbox.wake.notified());
        wake.as_mut().enable();
        if outbox.take(&mut batch).is_none() {
            break WriterEnd::Drained;
        }
        if batch.is_empty() {
            wake.await;
            continue;
        }
        let mut answers = 0;
        for out in &mut batch {
            tagger.seal(&mut out.frame);
            answers += u32::from(out.answer);
        }
        match tokio::time::timeout(deadline, write_batch(&mut socket, &batch)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => break WriterEnd::Io(e),
            Err(_) => break WriterEnd::Deadline,
        }
        batch.clear();
        outbox.inflight.fetch_sub(answers, Ordering::AcqRel);
    };
    match end {
        WriterEnd::Drained => {
            // The peer reads the last frames before the end of the stream.
            let _ = tokio::time::timeout(deadline, socket.shutdown()).await;
        }
        _ => outbox.close(),
    }
    end
}

/// Writes the frames of `batch` with as few syscalls as the socket takes.
async fn write_batch(socket: &mut OwnedWriteHalf, batch: &[Out]) -> io::Result<()> {
    let mut slices: Vec<IoSlice<'_>> = batch.iter().map(|o| IoSlice::new(&o.frame)).collect();
    let mut slices = &mut slices[..];
    while !slices.is_empty() {
        let n = socket.write_vectored(slices).await?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut slices, n);
    }
    Ok(())
}
