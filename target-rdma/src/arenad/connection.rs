//! One connection's life: its handshake (ended early if a source holding
//! fewer takes its handshake place), then a reader that reads requests and
//! starts each (answered inline when it touches only resident blobs, else
//! off the task: a range read of a cold blob awaited on the swap's ring,
//! the rest on the blocking pool, so a cold fault-in never delays the next
//! request), and a writer that alone writes the socket
//! ([`crate::arenad::outbox`]), two futures of the connection's task. It
//! ends on the client's close, a protocol error, the write deadline or
//! shutdown; its leases end after its last request finished.

use std::net::SocketAddr;
use std::pin::pin;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Instant;

use tokio::io::{AsyncWriteExt, BufReader};
use tokio::net::tcp::OwnedReadHalf;
use tokio::net::TcpStream;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tracing::{debug, warn};

use crate::arenad::admission::{busy_frame, Counted, Handshaking, HANDSHAKES_FULL};
use crate::arenad::barrier::WriteBarrier;
use crate::arenad::dispatch::{place, Dispatch, Wait};
use crate::arenad::events;
use crate::arenad::fatal::Fatal;
use crate::arenad::frames::{FrameCheck, Incoming, Tagger};
use crate::arenad::handshake::handshake;
use crate::arenad::outbox::{self, Outbox, QueueLimits, WriterEnd};
use crate::arenad::request::Decoded;
use crate::arenad::served::SessionRails;
use crate::arenad::session::{Session, Traffic};
use crate::arenad::shared::Shared;
use crate::proto::{FrameError, Header, HEADER_LEN, MAX_INLINE, TAG_LEN};
use crate::store::HolderId;

/// A request's reader state, moved into each read and back, so a read in
/// progress is never dropped half way through a frame while the reader
/// also waits for its jobs.
struct ReadSide {
    reader: BufReader<OwnedReadHalf>,
    check: FrameCheck,
}

impl ReadSide {
    async fn next(mut self) -> (Self, Result<Option<Incoming>, Fatal>) {
        let r = self.check.read(&mut self.reader).await.map_err(Fatal::from);
        (self, r)
    }

    /// Whether the next request is already read whole (it starts without
    /// waiting for the socket, so an answer held back for it is not
    /// delayed by the client's sending).
    fn next_is_read(&self) -> bool {
        let b = self.reader.buffer();
        let Some(head) = b
            .get(..HEADER_LEN)
            .and_then(|h| <&[u8; HEADER_LEN]>::try_from(h).ok())
        else {
            return false;
        };
        let tag = if self.check.key.is_some() { TAG_LEN } else { 0 };
        Header::decode(head).is_ok_and(|h| b.len() >= HEADER_LEN + h.body_len as usize + tag)
    }
}

/// Serves one accepted connection to its end.
pub(super) async fn run(
    shared: Arc<Shared>,
    id: HolderId,
    peer: SocketAddr,
    mut stream: TcpStream,
    open: Counted,
    handshaking: Handshaking,
) {
    let _ = stream.set_nodelay(true);
    let started = Instant::now();
    let Handshaking { place, displaced } = handshaking;
    let shook = tokio::select! {
        biased;
        () = shared.stop.stopped() => return,
        () = displaced.notified() => None,
        r = handshake(&shared, id, &mut stream, place) => Some(r),
    };
    let Some(shook) = shook else {
        // Its place went to a source holding fewer (counted and logged
        // by the accept loop): the BUSY frame only if it is written at
        // once.
        let _ = stream.try_write(&busy_frame(HANDSHAKES_FULL));
        return;
    };
    let session = match shook {
        Ok(s) => s,
        Err(fatal) => {
            let frame = fatal.report(&shared.obs, id, peer);
            if !frame.is_empty() {
                let _ = tokio::time::timeout(shared.limits.write_timeout, stream.write_all(&frame))
                    .await;
            }
            return;
        }
    };
    shared.obs.hello_ok(started.elapsed());
    let (client_key, server_key) = match session.keys {
        Some(k) => (Some(k.client_to_server), Some(k.server_to_client)),
        None => (None, None),
    };
    let (rd, wr) = stream.into_split();
    let tagger = Tagger {
        version: session.version,
        key: server_key,
    };
    let traffic = Traffic::new(shared.obs.volume(&session.vol.name));
    let conn = Arc::new(Session {
        id,
        peer,
        vol: session.vol,
        fence: session.fence,
        version: session.version,
        epoch: AtomicU64::new(session.epoch),
        rails: SessionRails::new(session.granted, session.lease_keys, session.per_rail),
        outbox: Outbox::new(
            QueueLimits {
                frames: shared.limits.max_queued_frames,
                bytes: shared.limits.max_queued_bytes,
            },
            wr,
            tagger,
        ),
        barrier: WriteBarrier::default(),
        traffic,
    });
    shared.sessions.insert(&conn);
    shared.obs.session_opened();
    let dispatch = Dispatch {
        shared: Arc::clone(&shared),
        conn: Arc::clone(&conn),
    };
    let budget_bytes = u32::try_from(shared.limits.max_queued_bytes).unwrap_or(u32::MAX);
    let side = ReadSide {
        reader: BufReader::with_capacity(64 << 10, rd),
        check: FrameCheck {
            version: session.version,
            key: client_key,
            seq: 0,
            max_inline: shared.store.blob_bytes().min(MAX_INLINE),
            budget: Arc::new(Semaphore::new(budget_bytes as usize)),
            budget_bytes,
        },
    };
    // The reader and the writer are two futures of this one task: an
    // answer queued by the reader is written when the reader next
    // waits, on the same thread, without waking another task (the
    // QD1 path gains no hop); a pool job's answer wakes this task.
    let reading = async {
        let result = read_requests(&dispatch, side).await;
        let last = result.err().map(|f| f.report(&shared.obs, id, peer));
        let last = last.filter(|f| !f.is_empty());
        let refused = last.is_some();
        conn.outbox.finish(last);
        refused
    };
    let writing = outbox::write(&conn.outbox, shared.limits.write_timeout);
    let (refused, end) = tokio::join!(reading, writing);
    match end {
        WriterEnd::Deadline => {
            warn!(
                event = events::CONNECTION_NOT_READING,
                conn = id,
                write_timeout_secs = shared.limits.write_timeout.as_secs(),
                "disconnected: its answers were not read within the write deadline"
            );
        }
        WriterEnd::Io(ref e) => {
            debug!(event = ublk_metrics::events::PEER_DISCONNECTED, conn = id, error = %e)
        }
        WriterEnd::Drained => {}
    }
    // Its RDMA lease keys are deregistered before its leases are released.
    conn.rails.close();
    shared.sessions.remove(id);
    shared.obs.session_closed();
    conn.traffic.closed();
    // Every request of the connection has finished: no lease can be
    // granted to it after this.
    let store = Arc::clone(&shared.store);
    let _ = shared.pool.run(move || store.drop_holder(id)).await;
    if refused && matches!(end, WriterEnd::Drained) {
        // Closing with requests unread would reset the stream and
        // could destroy the error frame before the client reads it.
        conn.outbox.linger(shared.limits.write_timeout).await;
    }
    drop(open);
}

/// Reads and starts requests until the client closes, a request is
/// fatal, the connection ends (write deadline, a REVOKE found its queue
/// full) or the server stops; returns once every started request is done.
async fn read_requests(d: &Dispatch, side: ReadSide) -> Result<(), Fatal> {
    let (shared, conn) = (&d.shared, &d.conn);
    let mut jobs: JoinSet<Result<(), Fatal>> = JoinSet::new();
    let mut read = pin!(side.next());
    // Made once: each registers with a Notify (the stop signal's is
    // every connection's), not once per request.
    let mut stopped = pin!(shared.stop.stopped());
    let mut ended = pin!(conn.outbox.ended());
    let result = loop {
        tokio::select! {
            biased;
            () = &mut stopped => break Ok(()),
            () = &mut ended => break Ok(()),
            Some(done) = jobs.join_next(), if !jobs.is_empty() => {
                match done {
                    Ok(Ok(())) => {}
                    Ok(Err(fatal)) => break Err(fatal),
                    Err(e) => break Err(Fatal::Internal(format!("a request's task failed: {e}"))),
                }
            }
            (side, next) = &mut read => {
                let req = match next {
                    Ok(Some(req)) => req,
                    Ok(None) => break Ok(()),
                    Err(fatal) => break Err(fatal),
                };
                // The next request already read whole: the answers
                // are written together by the writer once the reader
                // waits.
                let more = side.next_is_read();
                read.set(side.next());
                if let Err(fatal) = start(d, req, more, &mut jobs).await {
                    break Err(fatal);
                }
            }
        }
    };
    // Requests already started finish (their answers are queued, and
    // a FLUSH among them completes) before the connection ends.
    while let Some(done) = jobs.join_next().await {
        // A second fatal request is counted and logged; the session
        // already ends with the first one's error frame.
        if let Ok(Err(fatal)) = done {
            drop(fatal.report(&shared.obs, conn.id, conn.peer));
        }
    }
    result
}

/// Starts one request: refused beyond `max_inflight`, answered inline
/// when cheap (straight to the socket unless `more` requests are
/// already read), else spawned off the task
/// ([`Dispatch::execute_off_task`]).
async fn start(
    d: &Dispatch,
    req: Incoming,
    more: bool,
    jobs: &mut JoinSet<Result<(), Fatal>>,
) -> Result<(), Fatal> {
    let (shared, conn) = (&d.shared, &d.conn);
    let h = req.header;
    if !conn.outbox.begin_request(shared.limits.max_inflight) {
        return Err(Fatal::Request(
            h.opcode,
            h.request_id,
            FrameError::TooManyInFlight {
                request_id: h.request_id,
                limit: shared.limits.max_inflight,
            },
        ));
    }
    let started = Instant::now();
    let req = Decoded::decode(req)?;
    let placed = place(h.opcode);
    if placed.inline {
        if let Some(answered) = d.execute(&h, &req.request(), Wait::No).transpose() {
            return d.answer(h, started, answered, !more).await;
        }
        // Its blob needs the disk: off the task, so this thread does
        // not wait for it.
    }
    let ticket = placed.mutates.then(|| conn.barrier.begin());
    let covers = placed.flush.then(|| conn.barrier.last());
    let d = d.clone();
    jobs.spawn(async move {
        if let Some(upto) = covers {
            d.conn.barrier.wait_through(upto).await;
        }
        let (answered, direct) = d.execute_off_task(h, req).await;
        if let Some(t) = ticket {
            d.conn.barrier.end(t);
        }
        d.answer(h, started, answered, direct).await
    });
    Ok(())
}
