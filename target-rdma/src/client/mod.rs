//! `ArenaClient`: one authenticated control connection to `arenad` with many
//! requests in flight.
//!
//! The client is executor-agnostic on purpose: a ublk queue thread runs its
//! own io_uring executor, not tokio. Requests are written by the caller
//! under a short lock and answered by a reader thread through oneshot
//! channels, so any executor can await them. The same reader thread wakes
//! every [`TICK`] to fail requests past their deadline, which keeps per-request
//! timeouts without a timer runtime.
//!
//! After a disconnect the next call reconnects and idempotent requests
//! (inline READ/WRITE, REMOVE) are retried once. FLUSH is never papered
//! over: if the peer restarted (new generation) while writes it had
//! acknowledged were not yet flushed, the next FLUSH fails with
//! [`ArenaError::UnflushedDataLost`], because those writes are gone.

mod payload_stats;
mod reader;
mod session;

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::io::{self, Write};
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use futures::channel::oneshot;
use parking_lot::Mutex;
use tokio::sync::Semaphore;
use tracing::{debug, warn};

pub use payload_stats::{TcpPayloadStats, REASON_CONFIGURED_TCP};
pub use reader::{Body, BodyPool, FrameReader, Landing, OWNED_BODY_MIN};
pub use session::Session;

use crate::auth::{self, Secret};
use crate::blob::{ArenaError, BlobIo, Transport, Via};
use crate::proto::{
    self, Challenge, Endpoint, FrameError, Header, Hello, Lease, Opcode, RailAccept, Request,
    Status, Welcome, CAP_RDMA, CAP_TCP_DATA, MAC_LEN, VERSION,
};

/// How often the reader thread checks request deadlines.
const TICK: Duration = Duration::from_millis(50);
/// Revocations kept for the lease owner to collect; older ones are dropped and counted.
const MAX_QUEUED_REVOCATIONS: usize = 4096;

/// Where and how to connect.
#[derive(Clone, Debug)]
pub struct ClientConfig {
    /// `host:port` of `arenad`.
    pub peer: String,
    /// Volume to open.
    pub volume: String,
    /// The volume's secret.
    pub secret: Secret,
    /// Blob size the caller was built for; 0 accepts the volume's.
    pub blob_bytes: u32,
    /// Limit for TCP connect plus handshake.
    pub connect_timeout: Duration,
    /// Limit for each request, from send to answer.
    pub request_timeout: Duration,
    /// Where inline payloads are counted; shared by a device's connections.
    pub payload_stats: Option<Arc<TcpPayloadStats>>,
    /// Offer `CAP_RDMA` in HELLO (the RDMA transport sets it).
    pub offer_rdma: bool,
    /// The writes a FLUSH through this client vouches for; see
    /// [`FlushDomain`]. `new` gives each config a domain of its own.
    pub flush_domain: Arc<FlushDomain>,
}

impl ClientConfig {
    /// A config with 5 s connect and 30 s request timeouts.
    pub fn new(peer: impl Into<String>, volume: impl Into<String>, secret: Secret) -> Self {
        Self {
            peer: peer.into(),
            volume: volume.into(),
            secret,
            blob_bytes: 0,
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(30),
            payload_stats: None,
            offer_rdma: false,
            flush_domain: Arc::default(),
        }
    }
}

/// A successful answer.
enum Reply {
    Empty,
    Lease(Lease),
    Count(u64),
    Data(Vec<u8>),
    /// A READ body read straight into the request's [`Landing`].
    Landed,
    NotFound,
    Rail(RailAccept),
}

struct Pending {
    op: Opcode,
    /// Where a large READ answer goes, when the caller offered its buffer.
    landing: Option<Arc<Landing>>,
    deadline: Instant,
    tx: oneshot::Sender<Result<Reply, ArenaError>>,
}

#[derive(Default)]
struct PendingTable {
    map: HashMap<u64, Pending>,
    /// Set once the connection is dead; no request may be added after.
    dead: Option<String>,
}

/// One live connection.
struct Conn {
    writer: Mutex<TcpStream>,
    pending: Mutex<PendingTable>,
    slots: Semaphore,
    welcome: Welcome,
    max_inline: u32,
    /// Which connection of this client this is (1 for the first).
    epoch: u64,
}

impl Conn {
    fn is_dead(&self) -> bool {
        self.pending.lock().dead.is_some()
    }

    /// Marks the connection dead and fails everything in flight.
    fn kill(&self, peer: &str, detail: &str) {
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
        let _ = self.writer.lock().shutdown(Shutdown::Both);
    }
}

/// Counters a client keeps about itself.
#[derive(Default, Debug)]
pub struct ClientCounters {
    /// Connections established (the first one included).
    pub connects: AtomicU64,
    /// Requests that failed for lack of an answer in time.
    pub timeouts: AtomicU64,
    /// Idempotent requests retried after a reconnect.
    pub retries: AtomicU64,
    /// Answers that arrived after their request had timed out.
    pub late_answers: AtomicU64,
    /// Times the peer's generation changed between connections.
    pub peer_restarts: AtomicU64,
    /// Revocations received.
    pub revocations: AtomicU64,
    /// Revocations dropped because the owner did not collect them.
    pub revocations_dropped: AtomicU64,
}

/// The clients whose acknowledged writes one FLUSH vouches for.
///
/// The peer's FLUSH makes every write it acknowledged durable, whichever
/// connection carried it, and a block device's FLUSH covers writes completed
/// on any of its queues. So the queue connections of one device share a
/// domain: a FLUSH through any of them fails with
/// [`ArenaError::UnflushedDataLost`] if a peer restart lost a write
/// acknowledged through any of them, and succeeds once their writes are
/// flushed.
#[derive(Debug, Default)]
pub struct FlushDomain {
    state: Mutex<Durability>,
}

#[derive(Debug, Default)]
struct Durability {
    /// The peer generation the domain's connections were last opened in.
    generation: Option<u64>,
    /// Writes acknowledged so far.
    acked: u64,
    /// `acked` as of the start of the last successful FLUSH.
    flushed: u64,
    /// Set when a restart lost acknowledged writes; the next FLUSH fails.
    lost: Option<(u64, u64)>,
}

struct Shared {
    cfg: ClientConfig,
    conn: Mutex<Option<Arc<Conn>>>,
    next_id: AtomicU64,
    blob_bytes: AtomicU32,
    bodies: Arc<BodyPool>,
    counters: ClientCounters,
    revocations: Mutex<VecDeque<(u64, u64)>>,
}

/// A client of one volume on one `arenad`. Cheap to clone; clones share the
/// connection.
#[derive(Clone)]
pub struct ArenaClient {
    shared: Arc<Shared>,
}

impl ArenaClient {
    /// Connects and authenticates, failing with a message that names the
    /// peer and the cause.
    pub fn connect(cfg: ClientConfig) -> Result<Self, ArenaError> {
        let client = Self {
            shared: Arc::new(Shared {
                cfg,
                conn: Mutex::new(None),
                next_id: AtomicU64::new(1),
                blob_bytes: AtomicU32::new(0),
                bodies: Arc::default(),
                counters: ClientCounters::default(),
                revocations: Mutex::new(VecDeque::new()),
            }),
        };
        client.conn()?;
        Ok(client)
    }

    /// The peer's answer to our HELLO on the current connection.
    pub fn welcome(&self) -> Result<Welcome, ArenaError> {
        Ok(self.conn()?.welcome.clone())
    }

    /// Blob size of the volume.
    pub fn blob_bytes(&self) -> Result<u32, ArenaError> {
        Ok(self.conn()?.welcome.blob_bytes)
    }

    /// Blob size agreed at the first handshake; it cannot change for a volume.
    pub fn session_blob_bytes(&self) -> u32 {
        self.shared.blob_bytes.load(Ordering::Relaxed)
    }

    /// Whether the connection is currently up.
    pub fn is_connected(&self) -> bool {
        self.shared
            .conn
            .lock()
            .as_ref()
            .is_some_and(|c| !c.is_dead())
    }

    /// Which connection is live now (1 for the first, +1 per reconnect),
    /// or `None` while disconnected. Leases and RDMA rails belong to one
    /// connection: a different epoch means they are gone.
    pub fn connection_epoch(&self) -> Option<u64> {
        self.shared
            .conn
            .lock()
            .as_ref()
            .filter(|c| !c.is_dead())
            .map(|c| c.epoch)
    }

    /// Counts an acknowledged write (inline WRITE, COMMIT, REMOVE, or one
    /// another data path made, such as RDMA into a leased slot), so that a
    /// peer restart before the next FLUSH makes that FLUSH fail instead of
    /// claiming durability.
    pub fn record_acknowledged_write(&self) {
        self.shared.cfg.flush_domain.state.lock().acked += 1;
    }

    /// Exchanges QP endpoints on the current connection (RAIL_CONNECT);
    /// only valid when its WELCOME granted `CAP_RDMA`.
    pub async fn rail_connect(&self, endpoint: Endpoint) -> Result<RailAccept, ArenaError> {
        match self.call(&Request::RailConnect(endpoint)).await? {
            Reply::Rail(r) => Ok(r),
            _ => Err(self.unexpected(Opcode::RailConnect)),
        }
    }

    /// The client's own counters.
    pub fn counters(&self) -> &ClientCounters {
        &self.shared.counters
    }

    /// Leases the peer asked back, as `(key, token)`; the owner must COMMIT
    /// or RELEASE each.
    pub fn take_revocations(&self) -> Vec<(u64, u64)> {
        self.shared.revocations.lock().drain(..).collect()
    }

    /// The current connection, reconnecting if it is gone.
    fn conn(&self) -> Result<Arc<Conn>, ArenaError> {
        let mut slot = self.shared.conn.lock();
        if let Some(c) = slot.as_ref().filter(|c| !c.is_dead()) {
            return Ok(Arc::clone(c));
        }
        let agreed = self.shared.blob_bytes.load(Ordering::Relaxed);
        let mut conn = handshake(&self.shared.cfg, agreed)?;
        conn.epoch = self
            .shared
            .counters
            .connects
            .fetch_add(1, Ordering::Relaxed)
            + 1;
        let conn = Arc::new(conn);
        {
            let mut d = self.shared.cfg.flush_domain.state.lock();
            let new = conn.welcome.generation;
            if let Some(old) = d.generation.filter(|g| *g != new) {
                self.shared
                    .counters
                    .peer_restarts
                    .fetch_add(1, Ordering::Relaxed);
                warn!(
                    event = "peer.restarted",
                    old_generation = old,
                    new_generation = new
                );
                if d.acked > d.flushed {
                    d.lost = Some((old, new));
                }
                d.flushed = d.acked;
            }
            d.generation = Some(new);
        }
        self.shared
            .blob_bytes
            .store(conn.welcome.blob_bytes, Ordering::Relaxed);
        let reader_stream =
            conn.writer
                .lock()
                .try_clone()
                .map_err(|source| ArenaError::Connect {
                    peer: self.shared.cfg.peer.clone(),
                    source,
                })?;
        let shared = Arc::clone(&self.shared);
        let for_reader = Arc::clone(&conn);
        thread::Builder::new()
            .name("arena-client-rx".into())
            .spawn(move || read_loop(&shared, &for_reader, reader_stream))
            .map_err(|source| ArenaError::Connect {
                peer: self.shared.cfg.peer.clone(),
                source,
            })?;
        *slot = Some(Arc::clone(&conn));
        Ok(conn)
    }

    async fn call(&self, req: &Request<'_>) -> Result<Reply, ArenaError> {
        self.call_into(req, None).await
    }

    /// [`Self::call`], for a READ whose answer may land in `out` directly
    /// (`Reply::Landed` then means `out` holds the data). Idempotent
    /// requests are retried once over a new connection.
    async fn call_into(
        &self,
        req: &Request<'_>,
        mut out: Option<&mut [u8]>,
    ) -> Result<Reply, ArenaError> {
        let idempotent = matches!(
            req,
            Request::Read { .. } | Request::Write { .. } | Request::Remove { .. }
        );
        match self.call_once(req, out.as_deref_mut()).await {
            Err(ArenaError::Disconnected { .. }) if idempotent => {
                self.shared.counters.retries.fetch_add(1, Ordering::Relaxed);
                self.call_once(req, out).await
            }
            r => r,
        }
    }

    async fn call_once(
        &self,
        req: &Request<'_>,
        out: Option<&mut [u8]>,
    ) -> Result<Reply, ArenaError> {
        /// Gives the buffer back however the request ends, dropped included.
        struct Abandon(Arc<Landing>);
        impl Drop for Abandon {
            fn drop(&mut self) {
                self.0.abandon();
            }
        }
        let landing = out.filter(|o| o.len() >= OWNED_BODY_MIN).map(|o| {
            // SAFETY: `o` stays borrowed by this future until the `Abandon`
            // guard below drops, and its drop runs `abandon` (on completion,
            // failure, or the future being dropped); this future does not
            // touch the buffer at all.
            unsafe { Landing::new(o) }
        });
        let _abandon = landing.clone().map(Abandon);
        let peer = &self.shared.cfg.peer;
        let disconnected = |detail: &str| ArenaError::Disconnected {
            peer: peer.clone(),
            detail: detail.to_owned(),
        };
        let conn = self.conn()?;
        let _permit = conn
            .slots
            .acquire()
            .await
            .map_err(|_| disconnected("connection closed"))?;
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        {
            let mut t = conn.pending.lock();
            if let Some(why) = &t.dead {
                return Err(disconnected(why));
            }
            t.map.insert(
                id,
                Pending {
                    op: req.opcode(),
                    landing,
                    deadline: Instant::now() + self.shared.cfg.request_timeout,
                    tx,
                },
            );
        }
        let mut head = Vec::with_capacity(64);
        proto::encode_request_head(&mut head, id, req);
        let payload: &[u8] = match req {
            Request::Write { data, .. } => data,
            _ => &[],
        };
        let sent = {
            let mut w = conn.writer.lock();
            proto::write_vectored_all(&mut *w, &head, payload)
        };
        if let Err(e) = sent {
            conn.kill(peer, &format!("send failed: {e}"));
        }
        rx.await
            .unwrap_or_else(|_| Err(disconnected("answer channel closed")))
    }

    fn unexpected(&self, op: Opcode) -> ArenaError {
        ArenaError::Protocol {
            peer: self.shared.cfg.peer.clone(),
            source: FrameError::Unexpected {
                op: op.name(),
                detail: "answer of the wrong shape",
            },
        }
    }

    /// Writes `data` at `offset` inside blob `key`, inline on the stream.
    pub async fn write(&self, key: u64, offset: u32, data: &[u8]) -> Result<(), ArenaError> {
        let req = Request::Write { key, offset, data };
        match self.call(&req).await? {
            Reply::Empty => {
                self.record_acknowledged_write();
                if let Some(s) = &self.shared.cfg.payload_stats {
                    s.write(data.len());
                }
                Ok(())
            }
            _ => Err(self.unexpected(Opcode::Write)),
        }
    }

    /// Reads `out.len()` bytes at `offset` of blob `key` inline. Returns
    /// `false` (and zeros) when the blob was never written.
    pub async fn read(&self, key: u64, offset: u32, out: &mut [u8]) -> Result<bool, ArenaError> {
        let req = Request::Read {
            key,
            offset,
            len: out.len() as u32,
        };
        match self.call_into(&req, Some(&mut *out)).await? {
            Reply::Landed => {
                if let Some(s) = &self.shared.cfg.payload_stats {
                    s.read(out.len());
                }
                Ok(true)
            }
            Reply::Data(d) if d.len() == out.len() => {
                out.copy_from_slice(&d);
                if let Some(s) = &self.shared.cfg.payload_stats {
                    s.read(d.len());
                }
                self.shared.bodies.give(d);
                Ok(true)
            }
            Reply::NotFound => {
                out.fill(0);
                if let Some(s) = &self.shared.cfg.payload_stats {
                    s.read(0);
                }
                Ok(false)
            }
            _ => Err(self.unexpected(Opcode::Read)),
        }
    }

    /// Leases blob `key` for writing.
    pub async fn alloc(&self, key: u64) -> Result<Lease, ArenaError> {
        match self.call(&Request::Alloc { key }).await? {
            Reply::Lease(l) => Ok(l),
            _ => Err(self.unexpected(Opcode::Alloc)),
        }
    }

    /// Leases blob `key` for reading; `None` when it holds nothing.
    pub async fn get(&self, key: u64) -> Result<Option<Lease>, ArenaError> {
        match self.call(&Request::Get { key }).await? {
            Reply::Lease(l) => Ok(Some(l)),
            Reply::NotFound => Ok(None),
            _ => Err(self.unexpected(Opcode::Get)),
        }
    }

    /// Publishes an ALLOC lease's slot as the blob's content.
    pub async fn commit(&self, key: u64, token: u64) -> Result<(), ArenaError> {
        match self.call(&Request::Commit { key, token }).await? {
            Reply::Empty => {
                self.record_acknowledged_write();
                Ok(())
            }
            _ => Err(self.unexpected(Opcode::Commit)),
        }
    }

    /// Drops leases, in batches of at most [`proto::MAX_RELEASE_BATCH`].
    pub async fn release(&self, tokens: &[u64]) -> Result<(), ArenaError> {
        for chunk in tokens.chunks(proto::MAX_RELEASE_BATCH as usize) {
            match self
                .call(&Request::Release {
                    tokens: chunk.to_vec(),
                })
                .await?
            {
                Reply::Empty => {}
                _ => return Err(self.unexpected(Opcode::Release)),
            }
        }
        Ok(())
    }

    /// Drops blobs `start..end`; returns how many existed.
    pub async fn remove(&self, start: u64, end: u64) -> Result<u64, ArenaError> {
        match self.call(&Request::Remove { start, end }).await? {
            Reply::Count(n) => {
                self.record_acknowledged_write();
                Ok(n)
            }
            _ => Err(self.unexpected(Opcode::Remove)),
        }
    }

    /// Makes every write acknowledged before this call durable on the peer.
    pub async fn flush(&self) -> Result<(), ArenaError> {
        let upto = {
            let mut d = self.shared.cfg.flush_domain.state.lock();
            if let Some((old, new)) = d.lost.take() {
                return Err(ArenaError::UnflushedDataLost {
                    peer: self.shared.cfg.peer.clone(),
                    old,
                    new,
                });
            }
            (d.acked, d.generation)
        };
        match self.call(&Request::Flush).await? {
            Reply::Empty => {
                let mut d = self.shared.cfg.flush_domain.state.lock();
                if d.generation != upto.1 {
                    // The peer restarted between our writes and this FLUSH.
                    if let Some((old, new)) = d.lost.take() {
                        return Err(ArenaError::UnflushedDataLost {
                            peer: self.shared.cfg.peer.clone(),
                            old,
                            new,
                        });
                    }
                }
                d.flushed = d.flushed.max(upto.0);
                Ok(())
            }
            _ => Err(self.unexpected(Opcode::Flush)),
        }
    }

    /// Closes the connection; the next call reconnects.
    pub fn disconnect(&self) {
        if let Some(c) = self.shared.conn.lock().take() {
            c.kill(&self.shared.cfg.peer, "closed by the client");
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        if let Some(c) = self.conn.lock().take() {
            c.kill(&self.cfg.peer, "client dropped");
        }
    }
}

/// Connects, authenticates both ways and returns the live connection. A
/// reconnect insists on the blob size agreed the first time (`agreed`).
fn handshake(cfg: &ClientConfig, agreed: u32) -> Result<Conn, ArenaError> {
    let peer = &cfg.peer;
    let io_err = |source: io::Error| ArenaError::Connect {
        peer: peer.clone(),
        source,
    };
    let proto_err = |source: FrameError| match source {
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
    let version = u16::from(VERSION);
    if !(ch.min_version..=ch.max_version).contains(&version) {
        return Err(ArenaError::Refused {
            peer: peer.clone(),
            status: Status::VersionMismatch,
            message: format!(
                "peer speaks versions {}..={}, this client {version}",
                ch.min_version, ch.max_version
            ),
        });
    }
    let mut hello = Hello {
        version,
        caps: if cfg.offer_rdma {
            CAP_TCP_DATA | CAP_RDMA
        } else {
            CAP_TCP_DATA
        },
        blob_bytes: if agreed != 0 { agreed } else { cfg.blob_bytes },
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
    let welcome = Welcome::decode(&h, &body).map_err(proto_err)?;
    if !cfg.secret.verify_welcome(&ch, &hello, &welcome) {
        return Err(ArenaError::PeerNotAuthentic {
            peer: peer.clone(),
            volume: cfg.volume.clone(),
        });
    }
    stream.set_read_timeout(Some(TICK)).map_err(io_err)?;
    debug!(
        event = "session.opened",
        session = welcome.session_id,
        generation = welcome.generation
    );
    Ok(Conn {
        writer: Mutex::new(stream),
        pending: Mutex::new(PendingTable::default()),
        slots: Semaphore::new(ch.max_inflight as usize),
        welcome,
        max_inline: ch.max_inline,
        epoch: 0,
    })
}

fn read_answer(stream: &mut TcpStream, body: &mut Vec<u8>) -> Result<Header, FrameError> {
    proto::read_frame(stream, body)?.ok_or(FrameError::Truncated {
        got: 0,
        want: proto::HEADER_LEN,
    })
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

/// The reader thread: dispatches answers, queues revocations, expires requests.
fn read_loop(shared: &Shared, conn: &Conn, mut stream: TcpStream) {
    let peer = &shared.cfg.peer;
    let mut reader = FrameReader::with_pool(Arc::clone(&shared.bodies));
    let mut last_sweep = Instant::now();
    let why = loop {
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
        match reader.next(&mut stream, land) {
            Ok(Some((h, body))) => {
                if let Err(e) = dispatch(shared, conn, &h, body) {
                    break format!("protocol error: {e}");
                }
            }
            Ok(None) => break "peer closed the connection".to_owned(),
            Err(FrameError::Io(e))
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) => {}
            Err(e) => break e.to_string(),
        }
        if conn.is_dead() {
            return;
        }
        if last_sweep.elapsed() >= TICK {
            last_sweep = Instant::now();
            expire(shared, conn);
        }
    };
    debug!(event = "peer.disconnected", detail = %why);
    conn.kill(peer, &why);
}

/// Fails every request whose deadline has passed.
fn expire(shared: &Shared, conn: &Conn) {
    let now = Instant::now();
    let expired: Vec<Pending> = {
        let mut t = conn.pending.lock();
        let ids: Vec<u64> = t
            .map
            .iter()
            .filter(|(_, p)| p.deadline <= now)
            .map(|(id, _)| *id)
            .collect();
        ids.iter().filter_map(|id| t.map.remove(id)).collect()
    };
    for p in expired {
        shared.counters.timeouts.fetch_add(1, Ordering::Relaxed);
        let _ = p.tx.send(Err(ArenaError::TimedOut {
            op: p.op,
            peer: shared.cfg.peer.clone(),
            after: shared.cfg.request_timeout,
        }));
    }
}

fn dispatch(shared: &Shared, conn: &Conn, h: &Header, body: Body<'_>) -> Result<(), FrameError> {
    if !h.is_response() {
        return Err(FrameError::Unexpected {
            op: h.opcode.name(),
            detail: "server frame without the response flag",
        });
    }
    if h.opcode == Opcode::Revoke {
        let rv = proto::decode_revoke(h, body.bytes())?;
        shared.counters.revocations.fetch_add(1, Ordering::Relaxed);
        let mut q = shared.revocations.lock();
        if q.len() >= MAX_QUEUED_REVOCATIONS {
            q.pop_front();
            shared
                .counters
                .revocations_dropped
                .fetch_add(1, Ordering::Relaxed);
        }
        q.push_back(rv);
        return Ok(());
    }
    let Some(p) = conn.pending.lock().map.remove(&h.request_id) else {
        shared.counters.late_answers.fetch_add(1, Ordering::Relaxed);
        return Ok(());
    };
    if p.op != h.opcode {
        return Err(FrameError::Unexpected {
            op: h.opcode.name(),
            detail: "answer opcode differs from the request's",
        });
    }
    let reply = match (h.status, h.opcode) {
        (Status::Ok, Opcode::Alloc | Opcode::Get) => {
            Ok(Reply::Lease(proto::decode_lease(h, body.bytes())?))
        }
        (Status::Ok, Opcode::Remove) => Ok(Reply::Count(proto::decode_count(h, body.bytes())?)),
        (Status::Ok, Opcode::Read) => match body {
            Body::Landed(_) => Ok(Reply::Landed),
            body => Ok(Reply::Data(body.into_vec())),
        },
        (Status::Ok, Opcode::RailConnect) => Ok(Reply::Rail(RailAccept::decode(h, body.bytes())?)),
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
        return Err(FrameError::TooLong {
            what: "inline answer",
            len: h.body_len.into(),
            max: conn.max_inline.into(),
        });
    }
    let _ = p.tx.send(reply);
    Ok(())
}

impl BlobIo for ArenaClient {
    fn transport(&self) -> Transport {
        Transport::Tcp
    }
    fn blob_bytes(&self) -> u32 {
        self.session_blob_bytes()
    }
    async fn read(&self, key: u64, offset: u32, out: &mut [u8]) -> Result<Via, ArenaError> {
        let found = ArenaClient::read(self, key, offset, out).await?;
        Ok(if found { Via::Tcp } else { Via::Nothing })
    }
    async fn write(&self, key: u64, offset: u32, data: &[u8]) -> Result<Via, ArenaError> {
        ArenaClient::write(self, key, offset, data).await?;
        Ok(Via::Tcp)
    }
    fn remove(&self, start: u64, end: u64) -> impl Future<Output = Result<u64, ArenaError>> {
        ArenaClient::remove(self, start, end)
    }
    fn flush(&self) -> impl Future<Output = Result<(), ArenaError>> {
        ArenaClient::flush(self)
    }
}
