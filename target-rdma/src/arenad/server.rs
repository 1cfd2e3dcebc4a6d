//! The control-stream server: an event-driven core on a tokio runtime.
//! A connection costs a socket and a small task until its handshake is
//! done; then it is a reader task and a writer task with a bounded
//! outbound queue. Requests of one connection run concurrently (answers
//! are matched by request id), the cheap ones inline on the reader, those
//! that may block on the disk on a fixed blocking pool. No lock shared
//! between connections is held across a socket read or write
//! (ARCHITECTURE.md lists every lock). Every protocol violation answers a
//! `Protocol` error naming the problem, is counted by class, and closes
//! that connection only.

use std::collections::HashMap;
use std::io;
use std::net::TcpListener;
use std::pin::pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::{Mutex, RwLock};
use tokio::sync::Notify;
use tracing::warn;

use crate::arenad::blocking::Blocking;
use crate::arenad::connection::Connection;
use crate::arenad::epochs::Epochs;
use crate::arenad::observability::ArenadObservability;
use crate::arenad::outbox::NotQueued;
use crate::auth::Secret;
use crate::proto::{self, Endpoint, RailAccept};
use crate::rdma::{MemoryRegion, QueuePair, RdmaError, RdmaProvider};
use crate::store::{HolderId, Store, VolumeId};

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
    /// Requests one connection may have in flight (announced in CHALLENGE);
    /// one more is a protocol error.
    pub max_inflight: u32,
    /// Time a connection has to complete its HELLO.
    pub handshake_timeout: Duration,
    /// Accept version-1 sessions (no frame tags, no epochs).
    pub allow_v1: bool,
    /// Most connections that have not completed their HELLO, within
    /// `max_connections`: what a flood of unauthenticated sockets can hold.
    pub max_unauthenticated: u32,
    /// Longest a batch of queued frames may take to reach the socket (a
    /// client that does not read its answers): past it the connection
    /// ends, and its leases with it.
    pub write_timeout: Duration,
    /// Most frames in one connection's outbound queue.
    pub max_queued_frames: usize,
    /// Most bytes in one connection's outbound queue, and of request
    /// bodies it has in flight.
    pub max_queued_bytes: usize,
    /// Threads of the blocking pool.
    pub blocking_threads: usize,
    /// Longest shutdown gives connections to finish and drain.
    pub shutdown_timeout: Duration,
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

    pub(super) fn accept(
        &self,
        client: &Endpoint,
    ) -> Result<(Box<dyn QueuePair>, RailAccept), RdmaError> {
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
pub(super) struct Rail {
    pub(super) granted: bool,
    pub(super) qp: Option<Box<dyn QueuePair>>,
}

/// The server. Create with [`Server::new`], run with [`Server::serve`].
pub struct Server {
    pub(super) rdma: Option<ServerRdma>,
    pub(super) store: Arc<Store>,
    /// Replaced whole by [`Server::set_volumes`] (SIGHUP): a handshake
    /// takes the list in force when it starts, sessions never look again.
    pub(super) volumes: RwLock<Arc<Vec<Arc<ServedVolume>>>>,
    /// Every volume's epoch, by name: a volume added by a reload gets one
    /// like those served from the start.
    pub(super) epochs: Epochs,
    pub(super) limits: ServerLimits,
    /// Authenticated connections by holder: where REVOKEs are queued.
    pub(super) conns: Mutex<HashMap<HolderId, Arc<Connection>>>,
    pub(super) next_conn: AtomicU64,
    /// Connections with a task, authenticated or not.
    pub(super) open: Arc<AtomicUsize>,
    /// Connections still in their handshake.
    pub(super) unauthenticated: Arc<AtomicUsize>,
    stopping: AtomicBool,
    stop: Notify,
    pub(super) pool: Blocking,
    pub(super) obs: Arc<ArenadObservability>,
}

impl Server {
    /// Builds a server over an open store, starts its blocking pool and
    /// installs its revoke hook. Clients that ask for RDMA are granted it
    /// when `rdma` is set. The volumes' epochs are `epochs`. Every answer,
    /// refusal and session is reported to `obs`.
    pub fn new(
        store: Arc<Store>,
        volumes: Vec<ServedVolume>,
        epochs: Epochs,
        limits: ServerLimits,
        rdma: Option<ServerRdma>,
        obs: Arc<ArenadObservability>,
    ) -> io::Result<Arc<Self>> {
        let pool = Blocking::start(limits.blocking_threads)?;
        let server = Arc::new(Self {
            rdma,
            store,
            volumes: RwLock::new(Arc::new(volumes.into_iter().map(Arc::new).collect())),
            epochs,
            limits,
            conns: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(1),
            open: Arc::default(),
            unauthenticated: Arc::default(),
            stopping: AtomicBool::new(false),
            stop: Notify::new(),
            pool,
            obs,
        });
        // The hook runs on whichever thread revoked (without the store
        // lock): it only queues, never waits for the client.
        let weak: Weak<Server> = Arc::downgrade(&server);
        server
            .store
            .set_revoke_hook(Box::new(move |holder, _vol, key, token| {
                if let Some(server) = weak.upgrade() {
                    server.revoke(holder, key, token);
                }
            }));
        Ok(server)
    }

    /// Serves `volumes` to new sessions from now on: an added volume
    /// opens, a rotated secret is the one a new HELLO must prove, a removed
    /// volume is refused. Sessions already open keep the volume and secret
    /// they authenticated with.
    pub fn set_volumes(&self, volumes: Vec<ServedVolume>) {
        *self.volumes.write() = Arc::new(volumes.into_iter().map(Arc::new).collect());
    }

    /// Stops accepting and makes every connection end once its requests
    /// in flight are answered (see [`Server::serve`]).
    pub fn shutdown(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        self.stop.notify_waiters();
    }

    /// Resolves once [`Server::shutdown`] was called.
    pub(super) async fn stopped(&self) {
        let mut n = pin!(self.stop.notified());
        n.as_mut().enable();
        if self.stopping.load(Ordering::SeqCst) {
            return;
        }
        n.await;
    }

    /// Queues a REVOKE for `holder`; a client whose queue is full is not
    /// reading, and is disconnected (its leases end with it).
    fn revoke(&self, holder: HolderId, key: u64, token: u64) {
        let Some(conn) = self.conns.lock().get(&holder).cloned() else {
            return;
        };
        let mut frame = Vec::new();
        proto::encode_revoke(&mut frame, key, token);
        if let Err(NotQueued::Full) = conn.outbox.revoke(frame) {
            warn!(
                event = "connection.not_reading",
                conn = holder,
                max_queued_frames = self.limits.max_queued_frames,
                "disconnected: a REVOKE found its queue full"
            );
            conn.outbox.close();
        }
    }

    /// Accepts connections until [`Server::shutdown`], then gives the open
    /// ones up to `shutdown_timeout` to finish their requests and drain
    /// their answers (each within the write deadline) before returning.
    pub fn serve(self: &Arc<Self>, listener: TcpListener) -> io::Result<()> {
        let workers = std::thread::available_parallelism().map_or(2, |n| n.get().clamp(1, 16));
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers)
            .thread_name("arenad-io")
            .enable_io()
            .enable_time()
            .build()?;
        let served = rt.block_on(Arc::clone(self).accept_loop(listener));
        // Connections past the shutdown deadline are cut here.
        rt.shutdown_timeout(Duration::from_secs(1));
        served
    }
}
