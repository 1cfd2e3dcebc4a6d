//! One live control connection: the handshake that opens it, the table of
//! requests in flight on it, and the receiver that matches answers to
//! them, queues revocations, fails requests past their deadline and samples
//! the socket's TCP_INFO (run by the client's reader thread, or by the
//! owner's loop for a driven connection: the `Handoff` gives it each new
//! receiver, and `NoWait` keeps a driven send from blocking that loop).
//!
//! Answers that do not fit their request are counted apart from frames
//! that do not parse: an answer naming a request that is not in flight, or
//! with another opcode (`response_id_mismatches`: the stream's correlation
//! is broken, the connection is closed), and a READ answer of another
//! length than asked (`length_mismatches`: that request fails).

use std::collections::{HashMap, HashSet, VecDeque};
use std::future::{poll_fn, Future};
use std::io::{self, IoSlice, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

use futures::channel::oneshot;
use parking_lot::Mutex;
use rustix::event::{poll, PollFd, PollFlags, Timespec};
use rustix::net::{sendmsg, SendAncillaryBuffer, SendFlags};
use tokio::sync::Semaphore;
use tracing::debug;

use super::frames::{Body, FrameReader, Landing, Trailer};
use super::source::Source;
use super::tcp_info::Sampler;
use super::{ClientConfig, Shared, MAX_QUEUED_REVOCATIONS, TICK};
use crate::auth::{self, FrameKey, SessionKeys};
use crate::blob::ArenaError;
use crate::proto::{
    self, Challenge, FrameError, Header, Hello, Lease, Opcode, RailAccept, Status, Welcome,
    CAP_RDMA, CAP_RDMA_LEASE_KEYS, CAP_TCP_DATA, HANDSHAKE_VERSION, HEADER_LEN, MAC_LEN, VERSION,
    VERSION_2,
};

/// A successful answer.
pub(super) enum Reply {
    Empty,
    Lease(Lease),
    Count(u64),
    Data(Vec<u8>),
    /// A READ body read straight into the request's [`Landing`].
    Landed,
    NotFound,
    Rail(RailAccept),
}

/// The sending half of a connection: the stream, and in a version-2
/// session the key and sequence number that tag each frame.
pub(super) struct Writer {
    pub(super) stream: TcpStream,
    version: u8,
    key: Option<FrameKey>,
    seq: u64,
    /// In a driven connection, where its answers are read while a send
    /// waits for room (see [`NoWait`]).
    pub(super) driven: Option<(Arc<Handoff>, Duration)>,
}

impl Writer {
    /// Sends a request: its encoded head, then the payload (vectored, so a
    /// WRITE's payload is never copied), then its tag in a version-2
    /// session. `digest` is the body's, computed by the caller without the
    /// lock this writer is behind.
    pub(super) fn send(
        &mut self,
        head: &mut [u8],
        payload: &[u8],
        digest: Option<&[u8; 32]>,
    ) -> io::Result<()> {
        head[4] = self.version;
        let tag = match (&self.key, digest) {
            (Some(key), Some(digest)) => {
                let header: &[u8; HEADER_LEN] = head[..HEADER_LEN].try_into().expect("a header");
                let tag = key.tag(self.seq, header, digest);
                self.seq += 1;
                Some(tag)
            }
            _ => None,
        };
        let tag: &[u8] = tag.as_ref().map_or(&[], |t| &t[..]);
        match &self.driven {
            Some((answers, limit)) => {
                let mut out = NoWait::new(&self.stream, answers, *limit);
                proto::write_vectored_all(&mut out, &[head, payload, tag])
            }
            None => proto::write_vectored_all(&mut self.stream, &[head, payload, tag]),
        }
    }
}

pub(super) struct Pending {
    pub(super) op: Opcode,
    /// Bytes a READ asked for: its answer must carry exactly these.
    pub(super) want_len: Option<u32>,
    /// Where a large READ answer goes, when the caller offered its buffer.
    pub(super) landing: Option<Arc<Landing>>,
    pub(super) deadline: Instant,
    pub(super) tx: oneshot::Sender<Result<Reply, ArenaError>>,
}

pub(super) struct PendingTable {
    pub(super) map: HashMap<u64, Pending>,
    /// Set once the connection is dead; no request may be added after.
    pub(super) dead: Option<String>,
    /// Requests that timed out, whose answers may still come.
    expired: Expired,
}

impl Default for PendingTable {
    fn default() -> Self {
        Self {
            map: HashMap::new(),
            dead: None,
            expired: Expired::new(),
        }
    }
}

/// One live connection.
pub(super) struct Conn {
    /// The socket's descriptor, for shutting it down without the writer's
    /// lock (a driven send holds it while it reads answers, which may end
    /// the connection). Not a second handle: every descriptor a queue's
    /// connection holds counts against ublkd's `LimitNOFILE`.
    socket: RawFd,
    pub(super) writer: Mutex<Writer>,
    pub(super) pending: Mutex<PendingTable>,
    pub(super) slots: Semaphore,
    pub(super) welcome: Welcome,
    pub(super) max_inline: u32,
    /// Which connection of this client this is (1 for the first).
    pub(super) epoch: u64,
    /// The protocol version the session speaks.
    pub(super) version: u8,
    /// Checks the tags of the server's frames (version 2).
    pub(super) server_key: Option<FrameKey>,
}

impl Conn {
    pub(super) fn is_dead(&self) -> bool {
        self.pending.lock().dead.is_some()
    }

    /// Requests waiting for their answers.
    pub(super) fn in_flight(&self) -> usize {
        self.pending.lock().map.len()
    }

    /// Marks the connection dead and fails everything in flight.
    pub(super) fn kill(&self, peer: &str, detail: &str) {
        let drained: Vec<Pending> = {
            let mut t = self.pending.lock();
            if t.dead.is_none() {
                t.dead = Some(detail.to_owned());
            }
            t.map.drain().map(|(_, p)| p).collect()
        };
        for p in drained {
            let _ = p.tx.send(Err(ArenaError::Disconnected {
                peer: peer.to_owned(),
                detail: detail.to_owned(),
            }));
        }
        self.slots.close();
        // SAFETY: `socket` is the descriptor of the writer's stream, which
        // `self` owns and never replaces, so it is open for as long as
        // `self` is borrowed here.
        let fd = unsafe { BorrowedFd::borrow_raw(self.socket) };
        let _ = rustix::net::shutdown(fd, rustix::net::Shutdown::Both);
    }
}

/// Connects, authenticates both ways and returns the live connection. A
/// reconnect insists on the blob size agreed the first time (`agreed`) and
/// presents the writer's current `epoch`; a `driven` connection's sends
/// never block its owner's loop (its answers are read there).
pub(super) fn handshake(
    cfg: &ClientConfig,
    agreed: u32,
    epoch: u64,
    driven: Option<Arc<Handoff>>,
) -> Result<Conn, ArenaError> {
    let peer = &cfg.peer;
    let io_err = |source: io::Error| ArenaError::Connect {
        peer: peer.clone(),
        source,
    };
    let waited = |what: &str| {
        io::Error::new(
            io::ErrorKind::TimedOut,
            format!("{what} timed out after {} s", seconds(cfg.connect_timeout)),
        )
    };
    // A read past the socket's timeout says "Resource temporarily
    // unavailable" (EAGAIN): name it as the timeout it is.
    let proto_err = |source: FrameError| match source {
        FrameError::Io(e) if is_timeout(&e) => ArenaError::Connect {
            peer: peer.clone(),
            source: waited("handshake (no answer from the peer; is it still starting?)"),
        },
        FrameError::Io(e) => ArenaError::Connect {
            peer: peer.clone(),
            source: e,
        },
        source => ArenaError::Protocol {
            peer: peer.clone(),
            source,
        },
    };
    let addrs: Vec<_> = peer.to_socket_addrs().map_err(io_err)?.collect();
    let mut last = io::Error::new(io::ErrorKind::NotFound, "address resolved to nothing");
    let mut stream = None;
    for a in &addrs {
        match TcpStream::connect_timeout(a, cfg.connect_timeout) {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(e) if is_timeout(&e) => last = waited("connect"),
            Err(e) => last = e,
        }
    }
    let mut stream = stream.ok_or_else(|| io_err(last))?;
    stream.set_nodelay(true).map_err(io_err)?;
    stream
        .set_read_timeout(Some(cfg.connect_timeout))
        .map_err(io_err)?;

    let mut body = Vec::new();
    let h = read_answer(&mut stream, &mut body).map_err(proto_err)?;
    refused(peer, &h, &body)?;
    let ch = Challenge::decode(&h, &body).map_err(proto_err)?;
    // The newest version both speak; below VERSION only if the caller
    // allows it (a downgrade would lose the frame tags).
    let ours = u16::from(*cfg.versions.start())..=u16::from((*cfg.versions.end()).min(VERSION));
    let Some(version) = ours
        .clone()
        .rev()
        .find(|v| (ch.min_version..=ch.max_version).contains(v))
    else {
        return Err(ArenaError::Refused {
            peer: peer.clone(),
            status: Status::VersionMismatch,
            message: format!(
                "peer speaks versions {}..={}, this client {}..={}",
                ch.min_version,
                ch.max_version,
                ours.start(),
                ours.end()
            ),
        });
    };
    let mut hello = Hello {
        version,
        caps: if cfg.offer_rdma {
            CAP_TCP_DATA | CAP_RDMA | CAP_RDMA_LEASE_KEYS
        } else {
            CAP_TCP_DATA
        },
        blob_bytes: if agreed != 0 { agreed } else { cfg.blob_bytes },
        epoch: if version >= u16::from(VERSION_2) {
            epoch
        } else {
            0
        },
        client_nonce: auth::nonce(),
        mac: [0; MAC_LEN],
        volume: cfg.volume.clone(),
    };
    hello.mac = cfg.secret.sign_hello(&ch, &hello);
    let mut frame = Vec::new();
    hello.encode(&mut frame);
    stream.write_all(&frame).map_err(io_err)?;

    let h = read_answer(&mut stream, &mut body).map_err(proto_err)?;
    if h.status == Status::AuthFailed {
        return Err(ArenaError::AuthFailed {
            peer: peer.clone(),
            volume: cfg.volume.clone(),
        });
    }
    refused(peer, &h, &body)?;
    let welcome = Welcome::decode(&h, &body, version).map_err(proto_err)?;
    if !cfg.secret.verify_welcome(&ch, &hello, &welcome) {
        return Err(ArenaError::PeerNotAuthentic {
            peer: peer.clone(),
            volume: cfg.volume.clone(),
        });
    }
    let keys = (version >= u16::from(VERSION_2)).then(|| cfg.secret.session_keys(&ch, &hello));
    let (client_key, server_key) = match keys {
        Some(SessionKeys {
            client_to_server,
            server_to_client,
        }) => (Some(client_to_server), Some(server_to_client)),
        None => (None, None),
    };
    stream.set_read_timeout(Some(TICK)).map_err(io_err)?;
    debug!(
        event = "session.opened",
        session = welcome.session_id,
        generation = welcome.generation
    );
    let version = version as u8;
    Ok(Conn {
        socket: stream.as_raw_fd(),
        writer: Mutex::new(Writer {
            stream,
            version,
            key: client_key,
            seq: 0,
            driven: driven.map(|h| (h, cfg.request_timeout)),
        }),
        pending: Mutex::new(PendingTable::default()),
        slots: Semaphore::new(ch.max_inflight as usize),
        welcome,
        max_inline: ch.max_inline,
        epoch: 0,
        version,
        server_key,
    })
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// `5`, or `0.5` for limits below a second.
fn seconds(d: std::time::Duration) -> String {
    if d.subsec_millis() == 0 {
        d.as_secs().to_string()
    } else {
        format!("{:.1}", d.as_secs_f64())
    }
}

fn read_answer(stream: &mut TcpStream, body: &mut Vec<u8>) -> Result<Header, FrameError> {
    let h = proto::read_frame(stream, body)?.ok_or(FrameError::Truncated {
        got: 0,
        want: proto::HEADER_LEN,
    })?;
    h.expect_version(HANDSHAKE_VERSION)?;
    Ok(h)
}

/// Checks a server frame's version and, in a version-2 session, its tag
/// (the `seq`-th frame from the server).
fn check_frame(
    conn: &Conn,
    h: &Header,
    trailer: Option<&Trailer>,
    seq: u64,
) -> Result<(), FrameError> {
    h.expect_version(conn.version)?;
    match (&conn.server_key, trailer) {
        (None, _) => Ok(()),
        (Some(key), Some(t)) if key.verify(seq, &h.encode(), &t.digest, &t.tag) => Ok(()),
        (Some(_), _) => Err(FrameError::BadTag {
            op: h.opcode.name(),
            seq,
        }),
    }
}

fn refused(peer: &str, h: &Header, body: &[u8]) -> Result<(), ArenaError> {
    if h.status == Status::Ok {
        return Ok(());
    }
    Err(ArenaError::Refused {
        peer: peer.to_owned(),
        status: h.status,
        message: proto::decode_error(body),
    })
}

/// Ids of requests that timed out, so their answers, if they come, are
/// told from answers to requests never sent. Bounded: the oldest are
/// forgotten first (an answer that late then counts as a mismatch).
struct Expired {
    order: VecDeque<u64>,
    ids: HashSet<u64>,
}

impl Expired {
    const KEEP: usize = 4096;

    fn new() -> Self {
        Self {
            order: VecDeque::new(),
            ids: HashSet::new(),
        }
    }

    fn add(&mut self, id: u64) {
        if self.order.len() >= Self::KEEP {
            if let Some(old) = self.order.pop_front() {
                self.ids.remove(&old);
            }
        }
        self.order.push_back(id);
        self.ids.insert(id);
    }

    /// Whether `id` timed out (each late answer is recognised once).
    fn take(&mut self, id: u64) -> bool {
        self.ids.remove(&id)
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
            reader: FrameReader::with_pool(Arc::clone(&shared.bodies), conn.server_key.is_some()),
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

    /// The socket, for the owner's loop to wait on.
    pub(super) fn fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        self.source.stream.as_raw_fd()
    }

    /// Which connection this reads.
    pub(super) fn conn(&self) -> &Arc<Conn> {
        &self.conn
    }

    /// Reads and dispatches the frames that have arrived (a blocking
    /// source waits up to its read timeout for the first), expiring
    /// requests every [`TICK`]. Returns `false` once the connection has
    /// ended; it is then dead and its requests failed.
    pub(super) fn pump(&mut self) -> bool {
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
                Ok(Some((h, body, trailer))) => {
                    if let Some(t) = &mut self.tcp {
                        t.answered(&self.source.stream);
                    }
                    let checked =
                        check_frame(conn, &h, trailer.as_ref(), self.seq).map_err(Broken::Frame);
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
    pub(super) fn fail(&mut self, why: String) {
        if !self.ended {
            self.end(Some(why));
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
            debug!(event = "peer.disconnected", detail = %why);
            self.conn.kill(&self.peer, &why);
        }
        false
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
    shared.cfg.stats.frame_error(e.class());
    ublk_metrics::events::protocol_frame_error(e.class(), e);
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
        (Status::Ok, Opcode::Alloc | Opcode::Get) => Ok(Reply::Lease(
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
        (Status::NotFound, Opcode::Read | Opcode::Get) => Ok(Reply::NotFound),
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

/// Where a driven client's connections put their receivers for the driver.
#[derive(Default)]
pub(super) struct Handoff {
    pub(super) rx: Mutex<Option<Receiver>>,
    waker: Mutex<Option<Waker>>,
    /// The sweep, parked while no request is in flight.
    pub(super) sweeper: Mutex<Option<Waker>>,
    /// The client is gone: the driver stops.
    pub(super) closed: AtomicBool,
}

impl Handoff {
    /// Gives the driver a new connection's receiver (the old one ended).
    pub(super) fn install(&self, rx: Receiver) {
        *self.rx.lock() = Some(rx);
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
                Some(r) if !r.conn().is_dead() => Poll::Ready(true),
                _ => Poll::Pending,
            }
        })
    }
}

/// A driven connection's socket as a `Write` that never blocks the loop:
/// when the socket is full it waits (at most `limit`) for room, reading
/// the answers that arrive meanwhile.
pub(super) struct NoWait<'a> {
    stream: &'a TcpStream,
    answers: &'a Handoff,
    limit: Duration,
}

impl<'a> NoWait<'a> {
    pub(super) fn new(stream: &'a TcpStream, answers: &'a Handoff, limit: Duration) -> Self {
        Self {
            stream,
            answers,
            limit,
        }
    }

    /// Waits until the socket has room, pumping answers as they come.
    fn wait(&self, until: Instant) -> io::Result<()> {
        loop {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("no room to send for {:?}", self.limit),
                ));
            }
            let fd = self.stream.as_fd();
            let mut fds = [PollFd::new(&fd, PollFlags::OUT | PollFlags::IN)];
            let timeout = Timespec::try_from(left).map_err(io::Error::other)?;
            match poll(&mut fds, Some(&timeout)) {
                Ok(_) => {}
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(e.into()),
            }
            let ready = fds[0].revents();
            if ready.intersects(PollFlags::IN | PollFlags::HUP | PollFlags::ERR) {
                self.answers.pump();
            }
            if ready.intersects(PollFlags::OUT | PollFlags::HUP | PollFlags::ERR) {
                return Ok(());
            }
        }
    }
}

impl Write for NoWait<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.write_vectored(&[IoSlice::new(buf)])
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        let until = Instant::now() + self.limit;
        loop {
            let flags = SendFlags::DONTWAIT | SendFlags::NOSIGNAL;
            match sendmsg(
                self.stream,
                bufs,
                &mut SendAncillaryBuffer::default(),
                flags,
            ) {
                Ok(n) => return Ok(n),
                Err(rustix::io::Errno::INTR) => {}
                Err(rustix::io::Errno::AGAIN) => self.wait(until)?,
                Err(e) => return Err(e.into()),
            }
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}
