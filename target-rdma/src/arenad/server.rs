//! The control-stream server: an event-driven core on tokio, an accept
//! loop handing each connection to one of a fixed set of single-threaded
//! worker runtimes ([`crate::arenad::workers`]).
//! A connection costs a socket and a small task until its handshake is
//! done; then it is a reader and a writer (two futures of its task) with a
//! bounded outbound queue. Requests of one connection run concurrently (answers
//! are matched by request id), the cheap ones inline on the reader, those
//! that may block on the disk on a fixed blocking pool. No lock shared
//! between connections is held across a socket read or write
//! (ARCHITECTURE.md lists every lock). Every protocol violation answers a
//! `Protocol` error naming the problem, is counted by class, and closes
//! that connection only.

use std::io;
use std::net::TcpListener;
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::{Mutex, RwLock};
use tokio::runtime::Runtime;

use crate::arenad::accept::accept_loop;
use crate::arenad::admission::Admission;
use crate::arenad::blocking::Blocking;
use crate::arenad::epochs::Epochs;
use crate::arenad::events;
use crate::arenad::fenced::Fencing;
use crate::arenad::observability::ArenadObservability;
use crate::arenad::promotion::Promotion;
use crate::arenad::sessions::Sessions;
use crate::arenad::shared::Shared;
use crate::arenad::stop::Stop;
use crate::arenad::workers::Workers;
use crate::store::Store;

pub use crate::arenad::served::{ServedRails, ServedVolume, ServerLimits, ServerRdma};

/// The server. Create with [`Server::new`], run with [`Server::serve`].
pub struct Server {
    pub(super) shared: Arc<Shared>,
    /// The accept loop's runtime and the connections' worker threads,
    /// started with the server and taken by [`Server::serve`].
    cores: Mutex<Option<(Runtime, Workers)>>,
}

impl Server {
    /// Builds a server over an open store, starts its worker threads and
    /// blocking pool and installs its revoke hook. Clients that ask for RDMA are granted it
    /// when `rdma` serves a rail. The volumes' epochs are `epochs`. Every answer,
    /// refusal and session is reported to `obs`.
    pub fn new(
        store: Arc<Store>,
        volumes: Vec<ServedVolume>,
        epochs: Epochs,
        limits: ServerLimits,
        rdma: ServedRails,
        obs: Arc<ArenadObservability>,
    ) -> io::Result<Arc<Self>> {
        let pool = Blocking::start(limits.blocking_threads)?;
        let accept = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .build()?;
        let threads = std::thread::available_parallelism().map_or(2, |n| n.get().clamp(1, 16));
        // Each worker submits and reaps its connections' cold range reads
        // on a ring of its own (no completion thread between the disk and
        // the connection).
        let reads = Arc::clone(&store);
        let workers = Workers::start(threads, move || {
            if let Err(e) = reads.serve_swap_reads_here() {
                tracing::warn!(event = events::SWAP_READ_RING_UNAVAILABLE, error = %e, "this worker's cold reads use the swap's shared ring");
            }
        })?;
        let sessions = Arc::new(Sessions::default());
        let fencing = Fencing::new(
            epochs,
            Arc::clone(&sessions),
            Arc::clone(&store),
            Arc::clone(&obs),
        );
        let promotion = Promotion::new(limits.promote_cold_after, store.stats().slots_total);
        let shared = Arc::new(Shared {
            rdma,
            store,
            volumes: RwLock::new(Arc::new(volumes.into_iter().map(Arc::new).collect())),
            fencing: Arc::new(fencing),
            limits,
            sessions,
            admission: Admission::new(),
            promotion,
            stop: Stop::new(),
            pool,
            obs,
        });
        // The hook runs on whichever thread revoked (without the store
        // lock): it only queues, never waits for the client.
        let weak: Weak<Shared> = Arc::downgrade(&shared);
        shared
            .store
            .set_revoke_hook(Box::new(move |holder, _vol, key, token| {
                if let Some(shared) = weak.upgrade() {
                    shared
                        .sessions
                        .revoke(holder, key, token, shared.limits.max_queued_frames);
                }
            }));
        // Runs under the store lock: it only deregisters the lease's RDMA key
        // (the session's key lock, a syscall; no completion waited for).
        let weak: Weak<Shared> = Arc::downgrade(&shared);
        shared
            .store
            .set_force_end_hook(Box::new(move |holder, token| {
                if let Some(shared) = weak.upgrade() {
                    shared.sessions.force_ended(holder, token);
                }
            }));
        Ok(Arc::new(Server {
            shared,
            cores: Mutex::new(Some((accept, workers))),
        }))
    }

    /// Serves `volumes` to new sessions from now on: an added volume
    /// opens, a rotated secret is the one a new HELLO must prove, a removed
    /// volume is refused. Sessions already open keep the volume and secret
    /// they authenticated with.
    pub fn set_volumes(&self, volumes: Vec<ServedVolume>) {
        *self.shared.volumes.write() = Arc::new(volumes.into_iter().map(Arc::new).collect());
    }

    /// Stops accepting and makes every connection end once its requests
    /// in flight are answered (see [`Server::serve`]).
    pub fn shutdown(&self) {
        self.shared.stop.stop();
    }

    /// Accepts connections until [`Server::shutdown`], then gives the open
    /// ones up to `shutdown_timeout` to finish their requests and drain
    /// their answers (each within the write deadline) before returning;
    /// those still open then are cut. Serves once.
    pub fn serve(self: &Arc<Self>, listener: TcpListener) -> io::Result<()> {
        let (accept, workers) = self
            .cores
            .lock()
            .take()
            .ok_or_else(|| io::Error::other("the server already served"))?;
        let served = accept.block_on(accept_loop(Arc::clone(&self.shared), listener, &workers));
        workers.stop();
        accept.shutdown_timeout(Duration::from_secs(1));
        served
    }
}
