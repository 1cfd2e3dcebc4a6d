//! A queue's way to its volume and the I/O buffers it moves payloads
//! between: one [`QueueIo`] per queue thread. The way is target-rdma's
//! [`Session`] (TCP or RDMA) for a volume on one peer, or the replication
//! core's [`ReplicatedIo`] over one session per member; both are one
//! `BlobIo`, so the block target does not change. What is ublkd's own is
//! the libublk buffer per tag, registered once for RDMA.

use std::sync::Arc;

use libublk::helpers::IoBuf;
use target_rdma::blob::{ArenaError, BlobIo, Transport, Via};
use target_rdma::client::{RdmaTransport, Session};
use target_rdma::replica::ReplicatedIo;

/// A queue's I/O buffers: one page-aligned buffer of `io_buf` bytes per
/// tag, allocated when the device is added and registered once for RDMA.
pub struct TagBuffers {
    bufs: Vec<IoBuf<u8>>,
}

impl TagBuffers {
    /// Allocates `depth` buffers of `io_buf` bytes (both bounded by the
    /// config checks: at most 4096 x 1 MiB; zero is taken as one).
    pub fn new(depth: usize, io_buf: usize) -> Self {
        Self {
            bufs: (0..depth.max(1))
                .map(|_| IoBuf::new(io_buf.max(1)))
                .collect(),
        }
    }

    /// Tag `tag`'s buffer, `None` past the depth.
    pub fn tag(&self, tag: u16) -> Option<&IoBuf<u8>> {
        self.bufs.get(usize::from(tag))
    }
}

/// Registers a queue's tag buffers with an RDMA transport once, so payloads
/// move straight between them and the arena; nothing when the transport
/// serves TCP. A failed registration is logged and counted by the
/// transport, whose payloads then bounce through its own registered pool.
pub fn register_buffers(t: &RdmaTransport, bufs: &Arc<TagBuffers>) {
    if !t.uses_rdma() {
        return;
    }
    for b in &bufs.bufs {
        // SAFETY: the memory lives in `bufs`, which every `QueueIo` holding
        // this transport's session keeps alive until after the session is
        // gone (see the type docs); each tag's buffer is used by one request
        // at a time, and only through the transport while that request
        // runs. Group members reach the transport only to end cached
        // leases, which moves no payload. A replicated volume's background
        // session is never given a queue's buffers.
        if let Err(e) = unsafe { t.register_io_buffers(b.as_mut_ptr(), b.len()) } {
            tracing::warn!(event = "rdma.register_failed", bytes = b.len(), error = %e);
        }
    }
}

/// One queue's way to its volume and its I/O buffers. Cloning shares both.
///
/// The sessions are declared before the buffers and only ever lent out, so
/// the last clone drops them (deregistering the buffers) before the
/// buffers' memory is freed.
#[derive(Clone)]
pub struct QueueIo {
    path: Path,
    bufs: Arc<TagBuffers>,
}

#[derive(Clone)]
enum Path {
    /// A volume on one peer: the queue's session.
    Single(Session),
    /// A replicated volume: the core's request path for this queue, and
    /// the queue's session of each member it was opened with (for the
    /// peer monitor and the buffers' lifetime).
    Replicated {
        io: Arc<ReplicatedIo<Session>>,
        sessions: Vec<Session>,
    },
}

impl QueueIo {
    /// A volume on one peer, over `session` (whose transport has `bufs`
    /// registered, see [`register_buffers`]).
    pub fn single(session: Session, bufs: Arc<TagBuffers>) -> Self {
        Self {
            path: Path::Single(session),
            bufs,
        }
    }

    /// A replicated volume: `io` is the queue's request path, `sessions`
    /// the queue's session of every member (each with `bufs` registered).
    pub fn replicated(
        io: ReplicatedIo<Session>,
        sessions: Vec<Session>,
        bufs: Arc<TagBuffers>,
    ) -> Self {
        Self {
            path: Path::Replicated {
                io: Arc::new(io),
                sessions,
            },
            bufs,
        }
    }

    /// The queue's first session (the only one of a volume on one peer):
    /// its handshake answers (quota, blob size) hold for every member.
    pub fn session(&self) -> &Session {
        &self.sessions()[0]
    }

    /// The queue's sessions, one per member it was opened with.
    pub fn sessions(&self) -> &[Session] {
        match &self.path {
            Path::Single(s) => std::slice::from_ref(s),
            Path::Replicated { sessions, .. } => sessions,
        }
    }

    /// The queue's I/O buffers.
    pub fn buffers(&self) -> &TagBuffers {
        &self.bufs
    }
}

impl BlobIo for QueueIo {
    fn transport(&self) -> Transport {
        match &self.path {
            Path::Single(s) => s.transport(),
            Path::Replicated { io, .. } => io.transport(),
        }
    }

    fn blob_bytes(&self) -> u32 {
        match &self.path {
            Path::Single(s) => s.blob_bytes(),
            Path::Replicated { io, .. } => io.blob_bytes(),
        }
    }

    async fn read(&self, key: u64, offset: u32, out: &mut [u8]) -> Result<Via, ArenaError> {
        match &self.path {
            Path::Single(s) => s.read(key, offset, out).await,
            Path::Replicated { io, .. } => io.read(key, offset, out).await,
        }
    }

    async fn write(&self, key: u64, offset: u32, data: &[u8]) -> Result<Via, ArenaError> {
        match &self.path {
            Path::Single(s) => s.write(key, offset, data).await,
            Path::Replicated { io, .. } => io.write(key, offset, data).await,
        }
    }

    async fn remove(&self, start: u64, end: u64) -> Result<u64, ArenaError> {
        match &self.path {
            Path::Single(s) => s.remove(start, end).await,
            Path::Replicated { io, .. } => io.remove(start, end).await,
        }
    }

    async fn flush(&self) -> Result<(), ArenaError> {
        match &self.path {
            Path::Single(s) => s.flush().await,
            Path::Replicated { io, .. } => io.flush().await,
        }
    }
}

/// The data path a device's queues negotiated: RDMA when every queue did,
/// else TCP with the first reason a queue gave; `None` without queues.
pub fn negotiated(ios: &[QueueIo]) -> Option<(Transport, Option<String>)> {
    ios.first()?;
    if ios
        .iter()
        .flat_map(QueueIo::sessions)
        .all(|s| s.transport() == Transport::Rdma)
    {
        return Some((Transport::Rdma, None));
    }
    let why = ios
        .iter()
        .flat_map(QueueIo::sessions)
        .find_map(Session::tcp_reason);
    Some((Transport::Tcp, why))
}
