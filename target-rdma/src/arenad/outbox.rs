//! A connection's outbound side: a queue bounded in frames and bytes, and
//! the writer (a future of the connection's task) that writes the socket.
//! Answers (from the reader or a blocking-pool job) and REVOKEs (from
//! whichever thread the store revoked on) are pushed here; the writer seals
//! them (version byte, tag and sequence number) in the order they reach
//! the socket, so tags stay right however the producers interleave.
//!
//! An answer that finds nothing queued and nobody writing is sealed and
//! written straight to the socket by the task that has it (one
//! non-blocking write: the QD1 path wakes no other future); what the
//! socket does not take goes to the front of the queue for the writer.
//! Whoever writes holds the `writing` mark, taken under the queue's lock
//! with the frame's sequence number, so only one writes at a time and in
//! sequence order.
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
use rustix::net::Shutdown;
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
    /// Sealed already, with this many bytes on the socket: the rest of a
    /// direct write the socket did not take whole.
    written: Option<usize>,
}

impl Out {
    fn new(frame: Vec<u8>, answer: bool) -> Self {
        Self {
            frame,
            answer,
            written: None,
        }
    }
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
    /// Someone (the writer, or a direct answer) is writing the socket.
    writing: bool,
    /// The sequence number the next frame sealed gets.
    seq: u64,
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
    socket: OwnedWriteHalf,
    tagger: Tagger,
}

/// Why a REVOKE was not queued.
pub(super) enum NotQueued {
    /// The client does not read: its queue is full.
    Full,
    /// The connection is ending.
    Ended,
}

impl Outbox {
    /// The outbound side of the connection whose write half is `socket`,
    /// its frames sealed by `tagger` from sequence number 0.
    pub(super) fn new(limits: QueueLimits, socket: OwnedWriteHalf, tagger: Tagger) -> Self {
        Self {
            queue: Mutex::new(Queue {
                frames: VecDeque::new(),
                bytes: 0,
                state: State::Open,
                writing: false,
                seq: 0,
            }),
            limits,
            inflight: AtomicU32::new(0),
            wake: Notify::new(),
            room: Notify::new(),
            ended: Notify::new(),
            socket,
            tagger,
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

    /// Sends a request's answer: when `direct`, written now if nothing is
    /// queued and nobody writes; else queued (waiting for room), for the
    /// writer's next batch. `false` when the connection ended instead (the
    /// answer is dropped).
    pub(super) async fn answer(&self, frame: Vec<u8>, direct: bool) -> bool {
        if !direct {
            return self.queue_answer(frame).await;
        }
        match self.write_direct(frame) {
            Direct::Done(sent) => sent,
            Direct::Busy(frame) => self.queue_answer(frame).await,
        }
    }

    /// Seals and writes `frame` without waiting, if the socket is free.
    fn write_direct(&self, mut frame: Vec<u8>) -> Direct {
        let seq = {
            let mut q = self.queue.lock();
            if q.state != State::Open {
                drop(q);
                self.inflight.fetch_sub(1, Ordering::AcqRel);
                return Direct::Done(false);
            }
            if q.writing || !q.frames.is_empty() {
                return Direct::Busy(frame);
            }
            q.writing = true;
            q.seq += 1;
            q.seq - 1
        };
        self.tagger.seal(seq, &mut frame);
        // A failed write is left to the writer, which meets it again and
        // ends the connection.
        let n = self.socket.try_write(&frame).unwrap_or(0);
        let mut q = self.queue.lock();
        q.writing = false;
        if n == frame.len() {
            let more = !q.frames.is_empty();
            drop(q);
            self.inflight.fetch_sub(1, Ordering::AcqRel);
            if more {
                self.wake.notify_one();
            }
            return Direct::Done(true);
        }
        if q.state == State::Closed {
            return Direct::Done(false);
        }
        q.bytes += frame.len() - n;
        q.frames.push_front(Out {
            frame,
            answer: true,
            written: Some(n),
        });
        drop(q);
        self.wake.notify_one();
        Direct::Done(true)
    }

    /// Queues an answer, waiting for room.
    async fn queue_answer(&self, frame: Vec<u8>) -> bool {
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
                    q.frames.push_back(Out::new(frame, true));
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
        q.frames.push_back(Out::new(frame, false));
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
            q.frames.push_back(Out::new(frame, false));
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

    /// Moves every queued frame into `batch` and takes the `writing` mark
    /// for them, returning the sequence number of the first to seal; an
    /// empty batch while someone else writes; `None` when the writer is
    /// done (finished and drained, or closed).
    fn take(&self, batch: &mut Vec<Out>) -> Option<u64> {
        let mut q = self.queue.lock();
        if q.state == State::Closed || (q.frames.is_empty() && q.state == State::Finishing) {
            return None;
        }
        let first = q.seq;
        if q.writing || q.frames.is_empty() {
            return Some(first);
        }
        batch.extend(q.frames.drain(..));
        q.bytes = 0;
        q.seq += batch.iter().filter(|o| o.written.is_none()).count() as u64;
        q.writing = true;
        drop(q);
        self.room.notify_waiters();
        Some(first)
    }

    /// Gives the `writing` mark back after a batch.
    fn written(&self) {
        self.queue.lock().writing = false;
    }
}

impl Outbox {
    /// After the writer shut the stream down: reads and drops what the
    /// client still sends until it closes, for at most `deadline`.
    pub(super) async fn linger(&self, deadline: Duration) {
        let socket: &tokio::net::TcpStream = self.socket.as_ref();
        let mut sink = vec![0u8; 64 << 10];
        let _ = tokio::time::timeout(deadline, async {
            loop {
                if socket.readable().await.is_err() {
                    return;
                }
                match socket.try_read(&mut sink) {
                    Ok(0) => return,
                    Err(e) if e.kind() != io::ErrorKind::WouldBlock => return,
                    _ => {}
                }
            }
        })
        .await;
    }
}

/// What a direct write did.
enum Direct {
    /// Written or queued (`true`), or dropped (the connection ended).
    Done(bool),
    /// The socket is someone else's now: the frame, to be queued.
    Busy(Vec<u8>),
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
pub(super) async fn write(outbox: &Outbox, deadline: Duration) -> WriterEnd {
    let mut batch = Vec::new();
    let end = loop {
        let mut wake = pin!(outbox.wake.notified());
        wake.as_mut().enable();
        let Some(mut seq) = outbox.take(&mut batch) else {
            break WriterEnd::Drained;
        };
        if batch.is_empty() {
            wake.await;
            continue;
        }
        let mut answers = 0;
        for out in &mut batch {
            if out.written.is_none() {
                outbox.tagger.seal(seq, &mut out.frame);
                seq += 1;
            }
            answers += u32::from(out.answer);
        }
        match tokio::time::timeout(deadline, write_batch(&outbox.socket, &batch)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => break WriterEnd::Io(e),
            Err(_) => break WriterEnd::Deadline,
        }
        batch.clear();
        outbox.written();
        outbox.inflight.fetch_sub(answers, Ordering::AcqRel);
    };
    let how = match end {
        // The peer reads the last frames before the end of the stream.
        WriterEnd::Drained => Shutdown::Write,
        _ => {
            outbox.close();
            Shutdown::Both
        }
    };
    let _ = rustix::net::shutdown(outbox.socket.as_ref(), how);
    end
}

/// Writes the frames of `batch` with as few syscalls as the socket takes.
async fn write_batch(socket: &OwnedWriteHalf, batch: &[Out]) -> io::Result<()> {
    let mut slices: Vec<IoSlice<'_>> = batch
        .iter()
        .map(|o| IoSlice::new(&o.frame[o.written.unwrap_or(0)..]))
        .collect();
    let mut slices = &mut slices[..];
    while !slices.is_empty() {
        match socket.try_write_vectored(slices) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut slices, n),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => socket.writable().await?,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
