//! The control-stream server: one thread per connection, frames handled in
//! order, responses batched while more requests are already buffered.
//!
//! A connection reads one frame at a time, so its memory is bounded by one
//! frame plus its buffers no matter how much a client pipelines; the client
//! bounds its own pipeline by the `max_inflight` announced in CHALLENGE.
//! Every protocol violation answers a `Protocol` error naming the problem,
//! is counted by class, and closes that connection only.

use std::collections::HashMap;
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Weak};
use std::thread;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};
use rustix::event::{poll, PollFd, PollFlags, Timespec};
use tracing::{debug, info, warn};

use crate::arenad::admission::{Counted, Deadline, Throttled};
use crate::arenad::epochs::{Epochs, VolumeEpoch};
use crate::arenad::frames::{truncated, FrameCheck, FrameWriter, ReadError};
use crate::arenad::observability::ArenadObservability;
use crate::auth::{self, Secret, SessionKeys};
use crate::proto::{
    self, Challenge, Endpoint, FrameError, Header, Hello, Opcode, RailAccept, Request, Status,
    Welcome, CAP_RDMA, CAP_TCP_DATA, HANDSHAKE_VERSION, HEADER_LEN, MAC_LEN, MAX_HELLO_BODY,
    MAX_INLINE, VERSION, VERSION_1, VERSION_2,
};
use crate::rdma::{MemoryRegion, QueuePair, RdmaError, RdmaProvider};
use crate::store::{HolderId, Store, StoreError, VolumeId};
use ublk_metrics::ConnectionRefusal;

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
    /// Accept version-1 sessions (no frame tags, no epochs).
    pub allow_v1: bool,
    /// Most connections that have not completed their HELLO, within
    /// `max_connections`: what a flood of unauthenticated sockets can hold.
    pub max_unauthenticated: u32,
    /// Longest a socket write may block (a client that does not read its
    /// answers): past it the connection ends, and its leases with it.
    pub write_timeout: Duration,
}

/// What the connection thread shares with the rest of the server.
struct Conn {
    /// A handle to shut the socket down from outside (graceful stop).
    socket: TcpStream,
    /// Responses and revocations both go through here.
    writer: Mutex<FrameWriter>,
}

/// What a session is bound to once its HELLO is accepted.
struct Session {
    vol: Arc<ServedVolume>,
    /// The volume's epoch.
    fence: Arc<VolumeEpoch>,
    granted: bool,
    version: u8,
    keys: Option<SessionKeys>,
    /// The writer's membership epoch.
    epoch: u64,
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
    /// Replaced whole by [`Server::set_volumes`] (SIGHUP): a handshake
    /// takes the list in force when it starts, sessions never look again.
    volumes: RwLock<Arc<Vec<Arc<ServedVolume>>>>,
    /// Every volume's epoch, by name: a volume added by a reload gets one
    /// like those served from the start.
    epochs: Epochs,
    limits: ServerLimits,
    conns: Mutex<HashMap<HolderId, Arc<Conn>>>,
    next_conn: AtomicU64,
    /// Connections with a thread, authenticated or not.
    open: AtomicUsize,
    /// Connections still in their handshake.
    unauthenticated: AtomicUsize,
    stopping: AtomicBool,
    obs: Arc<ArenadObservability>,
}

/// Why a connection ended early; each becomes an error frame before close.
enum Fatal {
    Frame(FrameError),
    /// A protocol error in a request whose header named this opcode and id.
    Request(Opcode, u64, FrameError),
    Store(Opcode, u64, StoreError),
    Auth(&'static str),
    Hello(Status, String),
    /// Closed before sending a byte.
    Probe,
    Epoch(crate::arenad::epochs::EpochError),
    Io(io::Error),
}

impl From<FrameError> for Fatal {
    fn from(e: FrameError) -> Self {
        Fatal::Frame(e)
    }
}
impl From<ReadError> for Fatal {
    fn from(e: ReadError) -> Self {
        match e {
            ReadError::Io(e) => Fatal::Io(e),
            ReadError::Frame(e) => Fatal::Frame(e),
            ReadError::Request(op, id, e) => Fatal::Request(op, id, e),
        }
    }
}
impl From<io::Error> for Fatal {
    fn from(e: io::Error) -> Self {
        Fatal::Io(e)
    }
}

impl Server {
    /// Builds a server over an open store and installs its revoke hook.
    /// Clients that ask for RDMA are granted it when `rdma` is set. The
    /// volumes' epochs are `epochs`. Every answer,
    /// refusal and session is reported to `obs`.
    pub fn new(
        store: Arc<Store>,
        volumes: Vec<ServedVolume>,
        epochs: Epochs,
        limits: ServerLimits,
        rdma: Option<ServerRdma>,
        obs: Arc<ArenadObservability>,
    ) -> Arc<Self> {
        let server = Arc::new(Self {
            rdma,
            store,
            volumes: RwLock::new(Arc::new(volumes.into_iter().map(Arc::new).collect())),
            epochs,
            limits,
            conns: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(1),
            open: AtomicUsize::new(0),
            unauthenticated: AtomicUsize::new(0),
            stopping: AtomicBool::new(false),
            obs,
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

    /// Serves `volumes` to new sessions from now on: an added volume
    /// opens, a rotated secret is the one a new HELLO must prove, a removed
    /// volume is refused. Sessions already open keep the volume and secret
    /// they authenticated with.
    pub fn set_volumes(&self, volumes: Vec<ServedVolume>) {
        *self.volumes.write() = Arc::new(volumes.into_iter().map(Arc::new).collect());
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
        let _ = w.send(&mut frame, &[]).and_then(|_| w.flush());
    }

    /// Accepts connections until [`Server::shutdown`], then waits for every
    /// connection thread to finish.
    pub fn serve(self: &Arc<Self>, listener: TcpListener) -> io::Result<()> {
        listener.set_nonblocking(true)?;
        let mut threads = Vec::new();
        let (mut accept_errors, mut spawn_errors, mut refusals) = (
            Throttled::default(),
            Throttled::default(),
            Throttled::default(),
        );
        let mut backoff = Duration::from_millis(10);
        while !self.stopping.load(Ordering::SeqCst) {
            if !wait_readable(&listener, Duration::from_millis(200))? {
                threads.retain(|t: &thread::JoinHandle<()>| !t.is_finished());
                continue;
            }
            let (stream, peer) = match listener.accept() {
                Ok(v) => v,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => {
                    // EMFILE, ENFILE, ENOMEM, ...: keep serving the
                    // connections there are, try again after a backoff.
                    self.obs.accept_failed();
                    accept_errors.log(|muted| warn!(event = "accept.failed", error = %e, unlogged = muted, "backing off"));
                    thread::sleep(backoff);
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                    continue;
                }
            };
            backoff = Duration::from_millis(10);
            // Both limits hold from the first byte: a socket that never
            // sends HELLO takes a place like any other.
            let refuse = |reason: ConnectionRefusal, message: &str, refusals: &mut Throttled| {
                self.obs.connection_refused(reason);
                refusals.log(|muted| {
                    warn!(
                        event = "connection.refused",
                        reason = reason.as_str(),
                        max_connections = self.limits.max_connections,
                        max_unauthenticated = self.limits.max_unauthenticated,
                        unlogged = muted
                    )
                });
                let mut frame = Vec::new();
                proto::encode_error(&mut frame, Opcode::Challenge, 0, Status::Busy, message);
                // Non-blocking: the refusal never waits on the peer.
                let _ = stream.set_nonblocking(true);
                let _ = (&stream).write(&frame);
            };
            let Some(open) = Counted::take(&self.open, self.limits.max_connections) else {
                refuse(
                    ConnectionRefusal::MaxConnections,
                    "too many connections",
                    &mut refusals,
                );
                continue;
            };
            let Some(handshaking) =
                Counted::take(&self.unauthenticated, self.limits.max_unauthenticated)
            else {
                refuse(
                    ConnectionRefusal::MaxUnauthenticated,
                    "too many connections in their handshake",
                    &mut refusals,
                );
                continue;
            };
            let id = self.next_conn.fetch_add(1, Ordering::Relaxed);
            let server = Arc::clone(self);
            debug!(event = "connection.accepted", conn = id, peer = %peer);
            // The places move to the thread, which gives them back when the
            // connection (or its handshake) ends.
            let (open, handshaking) = (open.leak(), handshaking.leak());
            let spawned = stream.set_nonblocking(false).and_then(|()| {
                thread::Builder::new()
                    .name(format!("arenad-conn-{id}"))
                    .spawn(move || {
                        let open = Counted(&server.open);
                        let handshaking = Counted(&server.unauthenticated);
                        server.run_conn(id, peer, stream, handshaking);
                        drop(open);
                    })
            });
            match spawned {
                Ok(t) => threads.push(t),
                Err(e) => {
                    drop((Counted(open), Counted(handshaking)));
                    self.obs.connection_refused(ConnectionRefusal::SpawnFailed);
                    spawn_errors.log(|muted| warn!(event = "connection.spawn_failed", error = %e, unlogged = muted));
                }
            }
        }
        for t in threads {
            let _ = t.join();
        }
        Ok(())
    }

    fn run_conn(
        &self,
        id: HolderId,
        peer: std::net::SocketAddr,
        stream: TcpStream,
        handshaking: Counted<'_>,
    ) {
        let result = self.conn_loop(id, &stream, handshaking);
        let conn = self.conns.lock().remove(&id);
        if conn.is_some() {
            self.obs.session_closed();
        }
        self.store.drop_holder(id);
        if let Err(fatal) = result {
            let mut frame = self.report_fatal(id, peer, fatal);
            // After the handshake the error is a frame of the session
            // (version, tag); before it, a handshake frame.
            match (&conn, frame.is_empty()) {
                (_, true) => {}
                (Some(c), false) => {
                    let mut w = c.writer.lock();
                    let _ = w.send(&mut frame, &[]).and_then(|()| w.flush());
                }
                (None, false) => {
                    let _ = (&stream).write_all(&frame);
                }
            }
        }
        let _ = stream.shutdown(Shutdown::Both);
    }

    /// Counts and logs the error that ends a connection; returns the error
    /// frame that answers it (empty when the peer just went away). Logs
    /// name the peer's address where an operator needs it (refused
    /// handshakes); metrics never do.
    fn report_fatal(&self, id: HolderId, peer: std::net::SocketAddr, fatal: Fatal) -> Vec<u8> {
        let mut frame = Vec::new();
        match fatal {
            Fatal::Io(e) => {
                debug!(event = "peer.disconnected", conn = id, error = %e);
            }
            Fatal::Probe => {
                self.obs.probe();
                debug!(event = "connection.probe", conn = id);
            }
            Fatal::Frame(FrameError::Io(e)) => {
                debug!(event = "peer.disconnected", conn = id, error = %e);
            }
            Fatal::Request(_, _, FrameError::Io(e)) => {
                debug!(event = "peer.disconnected", conn = id, error = %e);
            }
            Fatal::Frame(e) => {
                self.obs.frame_error(&e);
                warn!(event = "protocol.error", conn = id, class = e.class(), error = %e);
                proto::encode_error(
                    &mut frame,
                    Opcode::Hello,
                    0,
                    Status::Protocol,
                    &e.to_string(),
                );
            }
            Fatal::Request(op, request_id, e) => {
                self.obs.frame_error(&e);
                warn!(event = "protocol.error", conn = id, class = e.class(), op = op.name(), request_id, error = %e);
                proto::encode_error(&mut frame, op, request_id, Status::Protocol, &e.to_string());
            }
            Fatal::Store(op, request_id, e) => {
                warn!(event = "protocol.error", conn = id, class = "bad_lease_or_range", op = op.name(), error = %e);
                proto::encode_error(&mut frame, op, request_id, Status::Protocol, &e.to_string());
            }
            Fatal::Auth(why) => {
                self.obs.auth_failed();
                warn!(event = "auth.failed", conn = id, peer = %peer, reason = why);
                proto::encode_error(
                    &mut frame,
                    Opcode::Hello,
                    0,
                    Status::AuthFailed,
                    "authentication failed",
                );
            }
            Fatal::Hello(status, msg) => {
                self.obs.hello_refused(status);
                warn!(event = "hello.refused", conn = id, peer = %peer, status = status.name(), detail = %msg);
                proto::encode_error(&mut frame, Opcode::Hello, 0, status, &msg);
            }
            Fatal::Epoch(e) => {
                warn!(event = "epoch.persist_failed", conn = id, error = %e);
                proto::encode_error(
                    &mut frame,
                    Opcode::Hello,
                    0,
                    Status::Internal,
                    &e.to_string(),
                );
            }
        }
        frame
    }

    /// Runs the handshake; returns what the session is bound to.
    fn handshake(&self, id: HolderId, stream: &TcpStream) -> Result<Session, Fatal> {
        let min_version = if self.limits.allow_v1 {
            VERSION_1
        } else {
            VERSION_2
        };
        let ch = Challenge {
            min_version: u16::from(min_version),
            max_version: u16::from(VERSION),
            server_nonce: auth::nonce(),
            max_inflight: self.limits.max_inflight,
            max_inline: self.store.blob_bytes().min(MAX_INLINE),
        };
        let mut frame = Vec::new();
        ch.encode(&mut frame);
        // A connection closed before its first byte is a probe (a health
        // check, a port scan), not a protocol error: the CHALLENGE may meet
        // a reset, or the first read an end of stream.
        let gone = |e: &io::Error| {
            matches!(
                e.kind(),
                io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe
            )
        };
        match (&*stream).write_all(&frame) {
            Err(e) if gone(&e) => return Err(Fatal::Probe),
            r => r?,
        }

        let mut r = Deadline {
            stream,
            until: Instant::now() + self.limits.handshake_timeout,
        };
        let mut hb = [0u8; HEADER_LEN];
        match r.read(&mut hb[..1]) {
            Ok(0) => return Err(Fatal::Probe),
            Ok(_) => {}
            Err(e) if gone(&e) => return Err(Fatal::Probe),
            Err(e) => return Err(Fatal::Io(e)),
        }
        r.read_exact(&mut hb[1..]).map_err(truncated)?;
        let h = Header::decode(&hb)?;
        h.expect_version(HANDSHAKE_VERSION)?;
        if h.body_len > MAX_HELLO_BODY {
            return Err(Fatal::Frame(FrameError::TooLong {
                what: "HELLO body",
                len: h.body_len.into(),
                max: MAX_HELLO_BODY.into(),
            }));
        }
        let mut body = vec![0u8; h.body_len as usize];
        r.read_exact(&mut body).map_err(truncated)?;
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
        let volumes = Arc::clone(&self.volumes.read());
        let vol = volumes
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
        let version = hello.version as u8;
        let fence = self.epochs.volume(&vol.name);
        if version < VERSION_2 && fence.current() > 0 {
            return Err(Fatal::Hello(
                Status::VersionMismatch,
                format!(
                    "volume {:?} has a membership epoch: it needs protocol version 2",
                    vol.name
                ),
            ));
        }
        let epoch = self
            .epochs
            .raise(&fence, hello.epoch)
            .map_err(Fatal::Epoch)?;
        let rdma = hello.caps & CAP_RDMA != 0;
        if rdma && self.rdma.is_none() {
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
            epoch,
            mac: [0; MAC_LEN],
        };
        welcome.mac = vol.secret.sign_welcome(&ch, &hello, &welcome);
        welcome.encode(&mut frame, hello.version);
        (&*stream).write_all(&frame)?;
        info!(event = "session.opened", conn = id, volume = %vol.name, generation = welcome.generation, rdma = granted, version, epoch = hello.epoch);
        Ok(Session {
            vol: Arc::clone(vol),
            fence,
            granted,
            version,
            keys: (version >= VERSION_2).then(|| vol.secret.session_keys(&ch, &hello)),
            epoch: hello.epoch,
        })
    }

    fn conn_loop(
        &self,
        id: HolderId,
        stream: &TcpStream,
        handshaking: Counted<'_>,
    ) -> Result<(), Fatal> {
        stream.set_nodelay(true)?;
        stream.set_write_timeout(Some(self.limits.write_timeout))?;
        let started = Instant::now();
        let session = self.handshake(id, stream);
        drop(handshaking);
        let mut session = session?;
        self.obs.hello_ok(started.elapsed());
        let mut rail = Rail {
            granted: session.granted,
            qp: None,
        };
        let (client_key, server_key) = match session.keys.take() {
            Some(k) => (Some(k.client_to_server), Some(k.server_to_client)),
            None => (None, None),
        };
        let conn = Arc::new(Conn {
            socket: stream.try_clone()?,
            writer: Mutex::new(FrameWriter {
                out: BufWriter::with_capacity(256 << 10, stream.try_clone()?),
                version: session.version,
                key: server_key,
                seq: 0,
            }),
        });
        self.conns.lock().insert(id, Arc::clone(&conn));
        self.obs.session_opened();
        if self.stopping.load(Ordering::SeqCst) {
            return Ok(());
        }

        let mut reader = BufReader::with_capacity(256 << 10, stream.try_clone()?);
        let mut check = FrameCheck {
            version: session.version,
            key: client_key,
            seq: 0,
        };
        let max_inline = self.store.blob_bytes().min(MAX_INLINE);
        let mut body = Vec::new();
        let mut out = Vec::new();
        while let Some(h) = check.read(&mut reader, &mut body, max_inline)? {
            let started = Instant::now();
            let mut w = conn.writer.lock();
            let answered = self.handle(&mut session, id, &h, &body, &mut out, &mut w, &mut rail);
            match &answered {
                Ok(status) => self.obs.answered(h.opcode, *status, started.elapsed()),
                Err(Fatal::Store(op, ..)) => self.obs.refused(*op, started.elapsed()),
                Err(_) => {}
            }
            answered?;
            if reader.buffer().is_empty() {
                w.flush()?;
            }
        }
        conn.writer.lock().flush()?;
        Ok(())
    }

    /// Executes one request, writes its answer to `w` and returns the
    /// answer's status. A READ's payload goes from the arena slot straight
    /// into the socket buffer, unstaged.
    #[allow(clippy::too_many_arguments)]
    fn handle(
        &self,
        session: &mut Session,
        holder: HolderId,
        h: &Header,
        body: &[u8],
        out: &mut Vec<u8>,
        w: &mut FrameWriter,
        rail: &mut Rail,
    ) -> Result<Status, Fatal> {
        let op = h.opcode;
        let rid = h.request_id;
        let vol = session.vol.id;
        let ok = |()| Status::Ok;
        let req = proto::decode_request(h, body).map_err(|e| Fatal::Request(op, rid, e))?;
        if let Request::Epoch { epoch } = req {
            if session.version < VERSION_2 {
                return Err(Fatal::Request(
                    op,
                    rid,
                    FrameError::Unexpected {
                        op: op.name(),
                        detail: "EPOCH needs protocol version 2",
                    },
                ));
            }
            session.epoch = session.epoch.max(epoch);
            let status = match self.epochs.raise(&session.fence, session.epoch) {
                Ok(now) if now > session.epoch => {
                    proto::encode_error(out, op, rid, Status::StaleEpoch, &stale(session, now));
                    Status::StaleEpoch
                }
                Ok(now) => {
                    proto::encode_epoch(out, rid, now);
                    Status::Ok
                }
                Err(e) => {
                    warn!(event = "epoch.persist_failed", conn = holder, error = %e);
                    proto::encode_error(out, op, rid, Status::Internal, &e.to_string());
                    Status::Internal
                }
            };
            w.send(out, &[])?;
            return Ok(status);
        }
        // Every data operation runs admitted under the volume's epoch, so a
        // raise waits for it and a stale session gets none.
        let _admitted = match req {
            Request::Release { .. } | Request::RailConnect(_) => None,
            _ => match session.fence.admit(session.epoch) {
                Ok(a) => Some(a),
                Err(now) if session.version < VERSION_2 => {
                    return Err(Fatal::Hello(
                        Status::VersionMismatch,
                        format!(
                        "volume {:?} moved to membership epoch {now}: it needs protocol version 2",
                        session.vol.name
                    ),
                    ))
                }
                Err(now) => {
                    proto::encode_error(out, op, rid, Status::StaleEpoch, &stale(session, now));
                    w.send(out, &[])?;
                    return Ok(Status::StaleEpoch);
                }
            },
        };
        let result = match req {
            Request::Epoch { .. } => unreachable!("answered above"),
            Request::Read { key, offset, len } => {
                let sent =
                    self.store
                        .read_with(vol, key, offset, len as usize, |bytes| match bytes {
                            Some(b) => {
                                proto::encode_read_head(out, rid, len);
                                w.send(out, b).map(ok)
                            }
                            None => {
                                proto::encode_error(out, op, rid, Status::NotFound, "");
                                w.send(out, &[]).map(|()| Status::NotFound)
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
                .map(|lease| proto::encode_lease(out, op, rid, lease))
                .map(ok),
            Request::Get { key } => self.store.get(vol, key, holder).map(|lease| match lease {
                Some(lease) => {
                    proto::encode_lease(out, op, rid, lease);
                    Status::Ok
                }
                None => {
                    proto::encode_error(out, op, rid, Status::NotFound, "");
                    Status::NotFound
                }
            }),
            Request::Commit { key, token } => self
                .store
                .commit(vol, key, token, holder)
                .map(|()| proto::encode_ok(out, op, rid))
                .map(ok),
            Request::Release { tokens } => tokens
                .iter()
                .try_for_each(|t| self.store.release(*t, holder))
                .map(|()| proto::encode_ok(out, op, rid))
                .map(ok),
            Request::Remove { start, end } => self
                .store
                .remove(vol, start, end)
                .map(|n| proto::encode_count(out, op, rid, n))
                .map(ok),
            Request::Flush => self
                .store
                .flush()
                .map(|()| proto::encode_ok(out, op, rid))
                .map(ok),
            Request::Write { key, offset, data } => self
                .store
                .write(vol, key, offset, data)
                .map(|()| proto::encode_ok(out, op, rid))
                .map(ok),
            Request::RailConnect(client) => {
                let Some(rdma) = self.rdma.as_ref().filter(|_| rail.granted) else {
                    return Err(Fatal::Request(
                        op,
                        rid,
                        FrameError::Unexpected {
                            op: op.name(),
                            detail: "RAIL_CONNECT on a session that was not granted CAP_RDMA",
                        },
                    ));
                };
                // One QP per connection: a new RAIL_CONNECT replaces the old one.
                rail.qp = None;
                match rdma.accept(&client) {
                    Ok((qp, acc)) => {
                        rail.qp = Some(qp);
                        acc.encode(out, rid);
                        Ok(Status::Ok)
                    }
                    Err(e) => {
                        warn!(event = "rdma.declined", conn = holder, error = %e);
                        proto::encode_error(
                            out,
                            op,
                            rid,
                            Status::Internal,
                            &format!("RDMA rail refused: {e}"),
                        );
                        Ok(Status::Internal)
                    }
                }
            }
        };
        let status = match result {
            Ok(status) => status,
            Err(e) => {
                let status = e.status();
                if status == Status::Protocol {
                    return Err(Fatal::Store(op, rid, e));
                }
                if status == Status::Internal {
                    warn!(event = "store.error", conn = holder, op = op.name(), error = %e);
                }
                proto::encode_error(out, op, rid, status, &e.to_string());
                status
            }
        };
        w.send(out, &[])?;
        Ok(status)
    }
}

fn stale(session: &Session, now: u64) -> String {
    format!(
        "stale epoch: this session is at epoch {}, volume {:?} at {now}: a newer writer owns it",
        session.epoch, session.vol.name
    )
}

/// Waits up to `timeout` for the listener to have a connection pending.
fn wait_readable(listener: &TcpListener, timeout: Duration) -> io::Result<bool> {
    let mut fds = [PollFd::new(listener, PollFlags::IN)];
    let timeout = Timespec::try_from(timeout).map_err(io::Error::other)?;
    match poll(&mut fds, Some(&timeout)) {
        Ok(n) => Ok(n > 0),
        Err(rustix::io::Errno::INTR) => Ok(false),
        Err(e) => Err(e.into()),
    }
}
