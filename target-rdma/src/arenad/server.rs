//! The control-stream server: one thread per connection, frames handled in
//! order, responses batched while more requests are already buffered.
//!
//! A connection reads one frame at a time, so its memory is bounded by one
//! frame plus its buffers no matter how much a client pipelines; the client
//! bounds its own pipeline by the `max_inflight` announced in CHALLENGE.
//! Every protocol violation answers a `Protocol` error naming the problem,
//! is counted by class, and closes that connection only.

use std::collections::{BTreeMap, HashMap};
use std::io::{self, BufReader, BufWriter, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, OnceLock, Weak};
use std::thread;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tracing::{debug, info, warn};

use crate::arenad::telemetry::ArenadTelemetry;
use crate::auth::{self, Secret};
use crate::proto::{
    self, Challenge, FrameError, Header, Hello, Opcode, RailAccept, Request, Status, Welcome,
    CAP_RDMA, CAP_TCP_DATA, MAC_LEN, MAX_INLINE, VERSION,
};
use crate::rdma::{Endpoint, MemoryRegion, QueuePair, RdmaError, RdmaProvider};
use crate::store::{HolderId, Store, StoreError, VolumeId};

/// A volume as the server knows it: its store id and its secret.
pub struct ServedVolume {
    /// Name clients open.
    pub name: String,
    /// Secret the HELLO MAC must be made with.
    pub secret: Secret,
    /// The store's id for it.
    pub id: VolumeId,
    /// Quota in blobs, reported in WELCOME.
    pub quota_blobs: u64,
}

/// Limits the server enforces.
#[derive(Clone, Debug)]
pub struct ServerLimits {
    /// Most concurrent connections.
    pub max_connections: u32,
    /// Pipeline depth announced to clients.
    pub max_inflight: u32,
    /// Time a connection has to complete its HELLO.
    pub handshake_timeout: Duration,
}

/// Counters of runtime events, read by tests and the metrics exporter.
#[derive(Default)]
pub struct ServerCounters {
    /// Connections that completed the handshake.
    pub sessions: AtomicU64,
    /// Connections refused because `max_connections` was reached.
    pub refused: AtomicU64,
    /// HELLOs refused for a bad MAC or an unknown volume.
    pub auth_failures: AtomicU64,
    /// Revocations sent to clients.
    pub revokes_sent: AtomicU64,
    /// RDMA rails (QPs) brought up for clients.
    pub rdma_rails: AtomicU64,
    /// Clients that asked for RDMA and were declined (no device, or the QP setup failed).
    pub rdma_declined: AtomicU64,
    protocol_errors: Mutex<BTreeMap<&'static str, u64>>,
}

impl ServerCounters {
    fn protocol_error(&self, class: &'static str) {
        *self.protocol_errors.lock().entry(class).or_default() += 1;
    }

    /// Protocol errors so far, by class.
    pub fn protocol_errors(&self) -> BTreeMap<&'static str, u64> {
        self.protocol_errors.lock().clone()
    }
}

/// What the connection thread shares with the rest of the server.
struct Conn {
    /// A handle to shut the socket down from outside (graceful stop).
    socket: TcpStream,
    /// Responses and revocations both go through here.
    writer: Mutex<BufWriter<TcpStream>>,
}

/// The arena registered with an RDMA device: what RAIL_CONNECT hands out.
pub struct ServerRdma {
    // Field order is drop order: the region is deregistered before the
    // provider (and its protection domain) goes.
    arena: MemoryRegion,
    provider: Arc<dyn RdmaProvider>,
    qp_depth: u32,
}

impl ServerRdma {
    /// Registers `store`'s arena for remote read and write on `provider`.
    pub fn register(
        provider: Arc<dyn RdmaProvider>,
        store: &Store,
        qp_depth: u32,
    ) -> Result<Self, RdmaError> {
        let (base, len) = store.arena_region();
        // SAFETY: the arena mapping lives as long as the store, and the
        // server holds the store (declared after `rdma`, so dropped later);
        // remote access only touches slots leased to the accessing client.
        let arena = unsafe { provider.register(base, len, true)? };
        Ok(Self {
            arena,
            provider,
            qp_depth,
        })
    }

    /// The device the arena is registered on.
    pub fn device_name(&self) -> String {
        self.provider.device_name()
    }

    fn accept(&self, client: &Endpoint) -> Result<(Box<dyn QueuePair>, RailAccept), RdmaError> {
        let qp = self.provider.create_qp(self.qp_depth)?;
        qp.connect(client)?;
        let acc = RailAccept {
            endpoint: qp.endpoint(),
            arena_base: self.arena.addr as u64,
            arena_len: self.arena.len as u64,
            rkey: self.arena.rkey,
        };
        Ok((qp, acc))
    }
}

/// A connection's RDMA state: whether its HELLO was granted `CAP_RDMA`,
/// and its one QP (replaced when the client re-establishes the rail).
#[derive(Default)]
struct Rail {
    granted: bool,
    qp: Option<Box<dyn QueuePair>>,
}

/// The server. Create with [`Server::new`], run with [`Server::serve`].
pub struct Server {
    rdma: Option<ServerRdma>,
    store: Arc<Store>,
    volumes: Vec<ServedVolume>,
    limits: ServerLimits,
    counters: ServerCounters,
    conns: Mutex<HashMap<HolderId, Arc<Conn>>>,
    next_conn: AtomicU64,
    stopping: AtomicBool,
    telemetry: OnceLock<Arc<ArenadTelemetry>>,
}

/// Why a connection ended early; each becomes an error frame before close.
enum Fatal {
    Frame(FrameError),
    Store(Opcode, u64, StoreError),
    Auth(&'static str),
    Hello(Status, String),
    Io(io::Error),
}

impl From<FrameError> for Fatal {
    fn from(e: FrameError) -> Self {
        Fatal::Frame(e)
    }
}
impl From<io::Error> for Fatal {
    fn from(e: io::Error) -> Self {
        Fatal::Io(e)
    }
}

/// Status a store error answers with, and whether it ends the connection.
fn store_status(e: &StoreError) -> (Status, bool) {
    match e {
        StoreError::NoSpace { .. } => (Status::NoSpace, false),
        StoreError::QuotaExceeded { .. } => (Status::QuotaExceeded, false),
        StoreError::Busy { .. } | StoreError::LeaseLimit { .. } => (Status::Busy, false),
        StoreError::LeaseLost { .. } => (Status::LeaseLost, false),
        StoreError::UnknownLease { .. }
        | StoreError::LeaseMismatch { .. }
        | StoreError::OutOfRange { .. } => (Status::Protocol, true),
        StoreError::UnknownVolume { .. }
        | StoreError::Io { .. }
        | StoreError::Uring { .. }
        | StoreError::ArenaMap { .. }
        | StoreError::Corrupt { .. }
        | StoreError::InvalidConfig { .. }
        | StoreError::Locked { .. }
        | StoreError::Integrity { .. }
        | StoreError::OldFormat { .. } => (Status::Internal, false),
    }
}

impl Server {
    /// Builds a server over an open store and installs its revoke hook.
    pub fn new(store: Arc<Store>, volumes: Vec<ServedVolume>, limits: ServerLimits) -> Arc<Self> {
        Self::with_rdma(store, volumes, limits, None)
    }

    /// Like [`Server::new`], granting RDMA to clients that ask when `rdma` is set.
    pub fn with_rdma(
        store: Arc<Store>,
        volumes: Vec<ServedVolume>,
        limits: ServerLimits,
        rdma: Option<ServerRdma>,
    ) -> Arc<Self> {
        let server = Arc::new(Self {
            rdma,
            store,
            volumes,
            limits,
            counters: ServerCounters::default(),
            conns: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(1),
            stopping: AtomicBool::new(false),
            telemetry: OnceLock::new(),
        });
        // The store may call the hook with its lock held, so the hook only
        // queues; a dedicated thread does the socket writes.
        let (tx, rx) = mpsc::channel::<(HolderId, u64, u64)>();
        let weak: Weak<Server> = Arc::downgrade(&server);
        thread::Builder::new()
            .name("arenad-revoke".into())
            .spawn(move || {
                for (holder, key, token) in rx {
                    let Some(server) = weak.upgrade() else { return };
                    server.send_revoke(holder, key, token);
                }
            })
            .expect("spawn revoke thread");
        let tx = Mutex::new(tx);
        server
            .store
            .set_revoke_hook(Box::new(move |holder, _vol, key, token| {
                let _ = tx.lock().send((holder, key, token));
            }));
        server
    }

    /// Runtime event counters.
    pub fn counters(&self) -> &ServerCounters {
        &self.counters
    }

    /// Feeds the arenad metrics from now on (once).
    pub fn set_telemetry(&self, telemetry: Arc<ArenadTelemetry>) {
        let _ = self.telemetry.set(telemetry);
    }

    /// Connections with a completed handshake, now.
    pub fn connections(&self) -> usize {
        self.conns.lock().len()
    }

    /// Stops accepting, ends every connection after the request it is
    /// handling, and makes [`Server::serve`] return.
    pub fn shutdown(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        for conn in self.conns.lock().values() {
            let _ = conn.socket.shutdown(Shutdown::Read);
        }
    }

    fn send_revoke(&self, holder: HolderId, key: u64, token: u64) {
        let Some(conn) = self.conns.lock().get(&holder).cloned() else {
            return;
        };
        let mut frame = Vec::new();
        proto::encode_revoke(&mut frame, key, token);
        let mut w = conn.writer.lock();
        if w.write_all(&frame).and_then(|_| w.flush()).is_ok() {
            self.counters.revokes_sent.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Accepts connections until [`Server::shutdown`], then waits for every
    /// connection thread to finish.
    pub fn serve(self: &Arc<Self>, listener: TcpListener) -> io::Result<()> {
        listener.set_nonblocking(true)?;
        let mut threads = Vec::new();
        while !self.stopping.load(Ordering::SeqCst) {
            if !wait_readable(&listener, Duration::from_millis(200))? {
                threads.retain(|t: &thread::JoinHandle<()>| !t.is_finished());
                continue;
            }
            let (stream, peer) = match listener.accept() {
                Ok(v) => v,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => {
                    warn!(event = "accept.failed", error = %e);
                    thread::sleep(Duration::from_millis(50));
                    continue;
                }
            };
            stream.set_nonblocking(false)?;
            if self.conns.lock().len() >= self.limits.max_connections as usize {
                self.counters.refused.fetch_add(1, Ordering::Relaxed);
                warn!(
                    event = "connection.refused",
                    reason = "max_connections",
                    limit = self.limits.max_connections
                );
                let mut frame = Vec::new();
                proto::encode_error(
                    &mut frame,
                    Opcode::Challenge,
                    0,
                    Status::Busy,
                    "too many connections",
                );
                let _ = (&stream).write_all(&frame);
                continue;
            }
            let id = self.next_conn.fetch_add(1, Ordering::Relaxed);
            let server = Arc::clone(self);
            debug!(event = "connection.accepted", conn = id, peer = %peer);
            threads.push(
                thread::Builder::new()
                    .name(format!("arenad-conn-{id}"))
                    .spawn(move || server.run_conn(id, stream))?,
            );
        }
        for t in threads {
            let _ = t.join();
        }
        Ok(())
    }

    fn run_conn(&self, id: HolderId, stream: TcpStream) {
        let result = self.conn_loop(id, &stream);
        self.conns.lock().remove(&id);
        self.store.drop_holder(id);
        if let Err(fatal) = result {
            self.report_fatal(id, &stream, fatal);
        }
        let _ = stream.shutdown(Shutdown::Both);
    }

    /// Counts, logs and answers the error that ends a connection.
    fn report_fatal(&self, id: HolderId, stream: &TcpStream, fatal: Fatal) {
        let mut frame = Vec::new();
        match fatal {
            Fatal::Io(e) => {
                debug!(event = "peer.disconnected", conn = id, error = %e);
                return;
            }
            Fatal::Frame(FrameError::Io(e)) => {
                debug!(event = "peer.disconnected", conn = id, error = %e);
                return;
            }
            Fatal::Frame(e) => {
                self.counters.protocol_error(e.class());
                if let Some(t) = self.telemetry.get() {
                    t.frame_error(&e);
                }
                warn!(event = "protocol.error", conn = id, class = e.class(), error = %e);
                proto::encode_error(
                    &mut frame,
                    Opcode::Hello,
                    0,
                    Status::Protocol,
                    &e.to_string(),
                );
            }
            Fatal::Store(op, request_id, e) => {
                self.counters.protocol_error("bad_lease_or_range");
                warn!(event = "protocol.error", conn = id, class = "bad_lease_or_range", op = op.name(), error = %e);
                proto::encode_error(&mut frame, op, request_id, Status::Protocol, &e.to_string());
            }
            Fatal::Auth(why) => {
                self.counters.auth_failures.fetch_add(1, Ordering::Relaxed);
                if let Some(t) = self.telemetry.get() {
                    t.auth_failed();
                }
                warn!(event = "auth.failed", conn = id, reason = why);
                proto::encode_error(
                    &mut frame,
                    Opcode::Hello,
                    0,
                    Status::AuthFailed,
                    "authentication failed",
                );
            }
            Fatal::Hello(status, msg) => {
                self.counters.protocol_error("hello");
                if let Some(t) = self.telemetry.get() {
                    t.hello_refused(status);
                }
                warn!(event = "hello.refused", conn = id, status = status.name(), detail = %msg);
                proto::encode_error(&mut frame, Opcode::Hello, 0, status, &msg);
            }
        }
        let mut w = stream;
        let _ = w.write_all(&frame);
    }

    /// Runs the handshake; returns the volume the session is bound to.
    fn handshake(&self, id: HolderId, stream: &TcpStream) -> Result<(&ServedVolume, bool), Fatal> {
        let ch = Challenge {
            min_version: u16::from(VERSION),
            max_version: u16::from(VERSION),
            server_nonce: auth::nonce(),
            max_inflight: self.limits.max_inflight,
            max_inline: self.store.blob_bytes().min(MAX_INLINE),
        };
        let mut frame = Vec::new();
        ch.encode(&mut frame);
        (&*stream).write_all(&frame)?;

        stream.set_read_timeout(Some(self.limits.handshake_timeout))?;
        let mut body = Vec::new();
        let h = proto::read_frame(&mut &*stream, &mut body)?.ok_or(FrameError::Truncated {
            got: 0,
            want: proto::HEADER_LEN,
        })?;
        let hello = Hello::decode(&h, &body)?;
        stream.set_read_timeout(None)?;

        if !(ch.min_version..=ch.max_version).contains(&hello.version) {
            return Err(Fatal::Hello(
                Status::VersionMismatch,
                format!(
                    "client chose version {}, server speaks {}..={}",
                    hello.version, ch.min_version, ch.max_version
                ),
            ));
        }
        // An unknown volume and a wrong secret look the same to the client,
        // so a scan cannot discover volume names.
        let vol = self
            .volumes
            .iter()
            .find(|v| v.name == hello.volume)
            .ok_or(Fatal::Auth("unknown volume"))?;
        if !vol.secret.verify_hello(&ch, &hello) {
            return Err(Fatal::Auth("bad mac"));
        }
        let blob = self.store.blob_bytes();
        if hello.blob_bytes != 0 && hello.blob_bytes != blob {
            return Err(Fatal::Hello(
                Status::Protocol,
                format!(
                    "blob size mismatch: client expects {}, volume uses {blob}",
                    hello.blob_bytes
                ),
            ));
        }
        let rdma = hello.caps & CAP_RDMA != 0;
        if rdma && self.rdma.is_none() {
            self.counters.rdma_declined.fetch_add(1, Ordering::Relaxed);
            info!(
                event = "rdma.declined",
                conn = id,
                reason = "no RDMA device on this peer"
            );
        }
        let granted = rdma && self.rdma.is_some();
        let mut welcome = Welcome {
            session_id: id,
            generation: self.store.generation(),
            blob_bytes: blob,
            caps: hello.caps
                & if granted {
                    CAP_TCP_DATA | CAP_RDMA
                } else {
                    CAP_TCP_DATA
                },
            quota_blobs: vol.quota_blobs,
            mac: [0; MAC_LEN],
        };
        welcome.mac = vol.secret.sign_welcome(&ch, &hello, &welcome);
        welcome.encode(&mut frame);
        (&*stream).write_all(&frame)?;
        self.counters.sessions.fetch_add(1, Ordering::Relaxed);
        info!(event = "session.opened", conn = id, volume = %vol.name, generation = welcome.generation, rdma = granted);
        Ok((vol, granted))
    }

    fn conn_loop(&self, id: HolderId, stream: &TcpStream) -> Result<(), Fatal> {
        stream.set_nodelay(true)?;
        let started = Instant::now();
        let (vol, granted) = self.handshake(id, stream)?;
        if let Some(t) = self.telemetry.get() {
            t.hello_ok(started.elapsed());
        }
        let mut rail = Rail { granted, qp: None };
        let conn = Arc::new(Conn {
            socket: stream.try_clone()?,
            writer: Mutex::new(BufWriter::with_capacity(256 << 10, stream.try_clone()?)),
        });
        self.conns.lock().insert(id, Arc::clone(&conn));
        if self.stopping.load(Ordering::SeqCst) {
            return Ok(());
        }

        let mut reader = BufReader::with_capacity(256 << 10, stream.try_clone()?);
        let mut body = Vec::new();
        let mut out = Vec::new();
        while let Some(h) = proto::read_frame(&mut reader, &mut body)? {
            let started = Instant::now();
            let mut w = conn.writer.lock();
            let answered = self.handle(vol.id, id, &h, &body, &mut out, &mut *w, &mut rail);
            if let Some(t) = self.telemetry.get() {
                match &answered {
                    Ok(()) => t.answered(h.opcode, &out, started.elapsed()),
                    Err(Fatal::Store(op, ..)) => t.refused(*op, started.elapsed()),
                    Err(_) => {}
                }
            }
            answered?;
            if reader.buffer().is_empty() {
                w.flush()?;
            }
        }
        conn.writer.lock().flush()?;
        Ok(())
    }

    /// Executes one request and writes its answer to `w`. A READ's payload
    /// goes from the arena slot straight into the socket buffer, unstaged.
    #[allow(clippy::too_many_arguments)]
    fn handle(
        &self,
        vol: VolumeId,
        holder: HolderId,
        h: &Header,
        body: &[u8],
        out: &mut Vec<u8>,
        w: &mut impl Write,
        rail: &mut Rail,
    ) -> Result<(), Fatal> {
        let op = h.opcode;
        let rid = h.request_id;
        let result = match proto::decode_request(h, body)? {
            Request::Read { key, offset, len } => {
                let sent =
                    self.store
                        .read_with(vol, key, offset, len as usize, |bytes| match bytes {
                            Some(b) => {
                                proto::encode_read_head(out, rid, len);
                                w.write_all(out).and_then(|()| w.write_all(b))
                            }
                            None => {
                                proto::encode_error(out, op, rid, Status::NotFound, "");
                                w.write_all(out)
                            }
                        });
                match sent {
                    Ok(io) => return Ok(io?),
                    Err(e) => Err(e),
                }
            }
            Request::Alloc { key } => self
                .store
                .alloc(vol, key, holder)
                .map(|lease| proto::encode_lease(out, op, rid, lease)),
            Request::Get { key } => self.store.get(vol, key, holder).map(|lease| match lease {
                Some(lease) => proto::encode_lease(out, op, rid, lease),
                None => proto::encode_error(out, op, rid, Status::NotFound, ""),
            }),
            Request::Commit { key, token } => self
                .store
                .commit(vol, key, token, holder)
                .map(|()| proto::encode_ok(out, op, rid)),
            Request::Release { tokens } => tokens
                .iter()
                .try_for_each(|t| self.store.release(*t, holder))
                .map(|()| proto::encode_ok(out, op, rid)),
            Request::Remove { start, end } => self
                .store
                .remove(vol, start, end)
                .map(|n| proto::encode_count(out, op, rid, n)),
            Request::Flush => self.store.flush().map(|()| proto::encode_ok(out, op, rid)),
            Request::Write { key, offset, data } => self
                .store
                .write(vol, key, offset, data)
                .map(|()| proto::encode_ok(out, op, rid)),
            Request::RailConnect(client) => {
                let Some(rdma) = self.rdma.as_ref().filter(|_| rail.granted) else {
                    return Err(Fatal::Frame(FrameError::Unexpected {
                        op: op.name(),
                        detail: "RAIL_CONNECT on a session that was not granted CAP_RDMA",
                    }));
                };
                // One QP per connection: a new RAIL_CONNECT replaces the old one.
                rail.qp = None;
                match rdma.accept(&client) {
                    Ok((qp, acc)) => {
                        rail.qp = Some(qp);
                        self.counters.rdma_rails.fetch_add(1, Ordering::Relaxed);
                        acc.encode(out, rid);
                    }
                    Err(e) => {
                        self.counters.rdma_declined.fetch_add(1, Ordering::Relaxed);
                        warn!(event = "rdma.declined", conn = holder, error = %e);
                        proto::encode_error(
                            out,
                            op,
                            rid,
                            Status::Internal,
                            &format!("RDMA rail refused: {e}"),
                        );
                    }
                }
                Ok(())
            }
        };
        if let Err(e) = result {
            let (status, fatal) = store_status(&e);
            if fatal {
                return Err(Fatal::Store(op, rid, e));
            }
            if status == Status::Internal {
                warn!(event = "store.error", conn = holder, op = op.name(), error = %e);
            }
            proto::encode_error(out, op, rid, status, &e.to_string());
        }
        w.write_all(out)?;
        Ok(())
    }
}

/// Waits up to `timeout` for the listener to have a connection pending.
fn wait_readable(listener: &TcpListener, timeout: Duration) -> io::Result<bool> {
    let mut pfd = libc::pollfd {
        fd: listener.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: `pfd` is a valid, initialised pollfd that outlives the call,
    // and we pass a count of exactly one.
    let n = unsafe { libc::poll(&mut pfd, 1, timeout.as_millis() as libc::c_int) };
    match n {
        -1 => {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                Ok(false)
            } else {
                Err(e)
            }
        }
        0 => Ok(false),
        _ => Ok(true),
    }
}
