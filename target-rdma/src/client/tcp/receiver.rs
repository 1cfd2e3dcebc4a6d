//! The receiving half of a live control connection: it matches answers to
//! the requests in flight, queues revocations, fails requests past their
//! deadline and samples the socket's TCP_INFO (run by the client's reader
//! thread, or by the owner's loop for a driven connection: the `Handoff`
//! gives it each new receiver).
//!
//! Answers that do not fit their request are counted apart from frames
//! that do not parse: an answer naming a request that is not in flight, or
//! with another opcode (`response_id_mismatches`: the stream's correlation
//! is broken, the connection is closed), and a READ answer of another
//! length than asked (`length_mismatches`: that request fails).

use std::io;
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Weak};
use std::time::Instant;

use tracing::debug;
use ublk_metrics::events;

use super::conn::{Conn, Pending, Reply};
use super::frames::{Body, FrameReader, Protection, Trailer};
use super::shared::{Shared, MAX_QUEUED_REVOCATIONS};
use super::source::Source;
use super::tcp_info::Sampler;
use crate::auth::FrameKey;
use crate::blob::ArenaError;
use crate::client::driven::{Receive, TICK};
use crate::proto::{self, FrameError, Header, Opcode, RailAccept, Status};

/// Checks a server frame's version and, from version 2, its tag (the
/// `seq`-th frame from the server), opening a sealed body in place.
fn check_frame(
    conn: &Conn,
    h: &Header,
    trailer: Option<&Trailer>,
    seq: u64,
    body: &mut Body<'_>,
) -> Result<(), FrameError> {
    h.expect_version(conn.version)?;
    let verified = match (&conn.server_key, trailer) {
        (None, _) => true,
        (
            Some(FrameKey::Tag(key)),
            Some(Trailer {
                digest: Some(d),
                tag,
            }),
        ) => key.verify(seq, &h.encode(), d, tag),
        (Some(FrameKey::Seal(key)), Some(t)) => {
            key.open(seq, &h.encode(), body.bytes_mut(), &t.tag)
        }
        (Some(_), _) => false,
    };
    if verified {
        Ok(())
    } else {
        Err(FrameError::BadTag {
            op: h.opcode.name(),
            seq,
        })
    }
}

/// Why the reader stops reading a connection.
enum Broken {
    /// A frame that did not parse (counted as a frame error).
    Frame(FrameError),
    /// An answer that matches no request in flight (counted as such).
    Mismatch(String),
}

/// The receiving half of a connection: reads the answers, dispatches them,
/// queues revocations and expires requests. The client's reader thread
/// runs it ([`read_loop`]), or the owner's event loop does (a driven
/// connection, see [`super::ring`]). It holds the client only weakly: once
/// the last `ArenaClient` is dropped the connection is closed (a reader
/// holding it would keep the session open on the peer forever).
pub(super) struct Receiver {
    client: Weak<Shared>,
    conn: Arc<Conn>,
    source: Source,
    reader: FrameReader,
    /// TCP_INFO of the socket, until the connection ends.
    tcp: Option<Sampler>,
    peer: String,
    /// Frames received: the next one's place in the stream (its tag).
    seq: u64,
    last_sweep: Instant,
    ended: bool,
}

impl Receiver {
    /// The receiver of `conn`, reading `stream` (a clone of its socket);
    /// `nonblocking` for a driven connection.
    pub(super) fn new(
        shared: &Arc<Shared>,
        conn: &Arc<Conn>,
        stream: TcpStream,
        nonblocking: bool,
    ) -> Self {
        Self {
            client: Arc::downgrade(shared),
            reader: FrameReader::with_pool(
                Arc::clone(&shared.bodies),
                match &conn.server_key {
                    None => Protection::Plain,
                    Some(FrameKey::Tag(_)) => Protection::Tagged,
                    Some(FrameKey::Seal(_)) => Protection::Sealed,
                },
            ),
            tcp: Some(Sampler::open(&shared.cfg.tcp_links, &stream)),
            peer: shared.cfg.peer.clone(),
            conn: Arc::clone(conn),
            source: Source {
                stream,
                nonblocking,
                drained: false,
            },
            seq: 0,
            last_sweep: Instant::now(),
            ended: false,
        }
    }

    /// Expires overdue requests, at most once per [`TICK`].
    fn sweep(&mut self, shared: &Shared) {
        if self.last_sweep.elapsed() >= TICK {
            self.last_sweep = Instant::now();
            expire(shared, &self.conn);
        }
    }

    /// Ends the connection (`why`: the reason to fail its requests with;
    /// `None` when it was already killed); always `false`.
    fn end(&mut self, why: Option<String>) -> bool {
        self.ended = true;
        if let Some(t) = self.tcp.take() {
            t.close(&self.source.stream);
        }
        if let Some(why) = why {
            debug!(event = events::PEER_DISCONNECTED, detail = %why);
            self.conn.kill(&self.peer, &why);
        }
        false
    }
}

impl Receive for Receiver {
    /// The socket, for the owner's loop to wait on.
    fn fd(&self) -> RawFd {
        self.source.stream.as_raw_fd()
    }

    /// Reads and dispatches the frames that have arrived (a blocking
    /// source waits up to its read timeout for the first), expiring
    /// requests every [`TICK`]. Returns `false` once the connection has
    /// ended; it is then dead and its requests failed.
    fn pump(&mut self) -> bool {
        if self.ended {
            return false;
        }
        // Called once the socket is readable (or to look): read it again.
        self.source.drained = false;
        loop {
            let Some(shared) = self.client.upgrade() else {
                return self.end(Some("client dropped".to_owned()));
            };
            let shared = &*shared;
            let conn = &*self.conn;
            let land = |h: &Header| {
                let t = conn.pending.lock();
                let p = t.map.get(&h.request_id)?;
                (h.is_response()
                    && h.status == Status::Ok
                    && h.opcode == Opcode::Read
                    && p.op == Opcode::Read)
                    .then(|| p.landing.clone())
                    .flatten()
            };
            let why = match self.reader.next(&mut self.source, land) {
                Ok(Some((h, mut body, trailer))) => {
                    if let Some(t) = &mut self.tcp {
                        t.answered(&self.source.stream);
                    }
                    let checked = check_frame(conn, &h, trailer.as_ref(), self.seq, &mut body)
                        .map_err(Broken::Frame);
                    self.seq += 1;
                    match checked.and_then(|()| dispatch(shared, conn, &h, body)) {
                        Ok(()) => None,
                        Err(Broken::Frame(e)) => {
                            frame_error(shared, &e);
                            Some(format!("protocol error: {e}"))
                        }
                        Err(Broken::Mismatch(why)) => Some(format!("protocol error: {why}")),
                    }
                }
                Ok(None) => Some("peer closed the connection".to_owned()),
                Err(FrameError::Io(e))
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    self.sweep(shared);
                    return true;
                }
                Err(e) => {
                    frame_error(shared, &e);
                    Some(e.to_string())
                }
            };
            if why.is_some() {
                return self.end(why);
            }
            if conn.is_dead() {
                return self.end(None);
            }
            self.sweep(shared);
        }
    }

    /// Ends the connection because its owner's loop cannot read it.
    fn fail(&mut self, why: String) {
        if !self.ended {
            self.end(Some(why));
        }
    }

    fn is_dead(&self) -> bool {
        self.conn.is_dead()
    }
}

/// The reader thread of a connection that is not driven.
pub(super) fn read_loop(mut rx: Receiver) {
    while rx.pump() {}
}

/// Counts and logs a frame that did not parse. A stream that failed or
/// ended mid-frame is a lost connection, not a malformed frame.
fn frame_error(shared: &Shared, e: &FrameError) {
    if matches!(e, FrameError::Io(_) | FrameError::Truncated { .. }) {
        return;
    }
    shared.cfg.stats.frame_error(e.class().as_str());
    ublk_metrics::events::protocol_frame_error(e.class().as_str(), e);
}

/// Fails every request whose deadline has passed, remembering their ids
/// so that their answers, if they come, count as late.
pub(super) fn expire(shared: &Shared, conn: &Conn) {
    let now = Instant::now();
    let expired: Vec<Pending> = {
        let mut t = conn.pending.lock();
        let ids: Vec<u64> = t
            .map
            .iter()
            .filter(|(_, p)| p.deadline <= now)
            .map(|(id, _)| *id)
            .collect();
        ids.iter()
            .filter_map(|id| {
                let p = t.map.remove(id)?;
                t.expired.add(*id);
                Some(p)
            })
            .collect()
    };
    for p in expired {
        shared.cfg.stats.count(|s| &s.request_timeouts);
        let _ = p.tx.send(Err(ArenaError::TimedOut {
            op: p.op,
            peer: shared.cfg.peer.clone(),
            after: shared.cfg.request_timeout,
        }));
    }
}

/// Counts, logs and describes an answer that fits no request in flight.
fn mismatch(shared: &Shared, h: &Header, expected: Option<Opcode>) -> Broken {
    shared.cfg.stats.count(|s| &s.response_id_mismatches);
    let expected = expected.map_or("none", Opcode::name);
    ublk_metrics::events::protocol_response_id_mismatch(h.request_id, h.opcode.name(), expected);
    Broken::Mismatch(format!(
        "{} answer to request id {}, which is {}",
        h.opcode.name(),
        h.request_id,
        if expected == "none" {
            "not in flight".to_owned()
        } else {
            format!("a {expected}")
        }
    ))
}

fn dispatch(shared: &Shared, conn: &Conn, h: &Header, body: Body<'_>) -> Result<(), Broken> {
    if !h.is_response() {
        return Err(Broken::Frame(FrameError::Unexpected {
            op: h.opcode.name(),
            detail: "server frame without the response flag",
        }));
    }
    if h.opcode == Opcode::Revoke {
        let rv = proto::decode_revoke(h, body.bytes()).map_err(Broken::Frame)?;
        shared.cfg.stats.count(|s| &s.revocations_received);
        let mut q = shared.revocations.lock();
        if q.len() >= MAX_QUEUED_REVOCATIONS {
            q.pop_front();
            shared.cfg.stats.count(|s| &s.revocations_dropped);
        }
        q.push_back(rv);
        return Ok(());
    }
    let found = {
        let mut t = conn.pending.lock();
        match t.map.remove(&h.request_id) {
            Some(p) => Ok(p),
            None => Err(t.expired.take(h.request_id)),
        }
    };
    let p = match found {
        Ok(p) => p,
        Err(true) => {
            shared.cfg.stats.count(|s| &s.late_answers);
            return Ok(());
        }
        Err(false) => return Err(mismatch(shared, h, None)),
    };
    if p.op != h.opcode {
        let broken = mismatch(shared, h, Some(p.op));
        // Back in the table, so the connection's end fails it with the
        // reason like every other request in flight.
        conn.pending.lock().map.insert(h.request_id, p);
        return Err(broken);
    }
    if let (Status::Ok, Some(want)) = (h.status, p.want_len) {
        if h.body_len != want {
            shared.cfg.stats.count(|s| &s.length_mismatches);
            ublk_metrics::events::protocol_length_mismatch(
                h.request_id,
                h.opcode.name(),
                want.into(),
                h.body_len.into(),
            );
            let _ = p.tx.send(Err(ArenaError::Protocol {
                peer: shared.cfg.peer.clone(),
                source: FrameError::BadBodyLength {
                    op: h.opcode.name(),
                    len: h.body_len as usize,
                    expected: format!("{want} (the length requested)"),
                },
            }));
            return Ok(());
        }
    }
    let frame = Broken::Frame;
    let reply = match (h.status, h.opcode) {
        (Status::Ok, Opcode::Alloc | Opcode::Get | Opcode::GetResident) => Ok(Reply::Lease(
            proto::decode_lease(h, body.bytes()).map_err(frame)?,
        )),
        (Status::Ok, Opcode::Remove | Opcode::Epoch) => Ok(Reply::Count(
            proto::decode_count(h, body.bytes()).map_err(frame)?,
        )),
        (Status::Ok, Opcode::Read) => match body {
            Body::Landed(_) => Ok(Reply::Landed),
            body => Ok(Reply::Data(body.into_vec())),
        },
        (Status::Ok, Opcode::RailConnect) => Ok(Reply::Rail(
            RailAccept::decode(h, body.bytes()).map_err(frame)?,
        )),
        (Status::Ok, _) => Ok(Reply::Empty),
        (Status::NotFound, Opcode::Read | Opcode::Get | Opcode::GetResident) => Ok(Reply::NotFound),
        (status, op) => Err(ArenaError::Status {
            op,
            peer: shared.cfg.peer.clone(),
            status,
            message: proto::decode_error(body.bytes()),
        }),
    };
    if matches!(&reply, Ok(Reply::Data(_) | Reply::Landed)) && h.body_len > conn.max_inline {
        return Err(Broken::Frame(FrameError::TooLong {
            what: "inline answer",
            len: h.body_len.into(),
            max: conn.max_inline.into(),
        }));
    }
    let _ = p.tx.send(reply);
    Ok(())
}
