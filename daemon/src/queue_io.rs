//! A queue's way to its volume and the I/O buffers it moves payloads
//! between: one [`QueueIo`] per queue thread. The way is target-rdma's
//! [`VolumeIo`] (one session, or the replication core over one per
//! member), which the block target runs on directly; what is ublkd's own
//! is the libublk buffer per tag, registered once for RDMA, kept alive
//! until the sessions that use it are gone.

use std::sync::Arc;

use libublk::helpers::IoBuf;
use target_rdma::blob::{BlobIo, Transport};
use target_rdma::client::{RdmaTransport, Session};
use target_rdma::replica::{ReplicatedIo, VolumeIo};
use ublk_metrics::events;

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
            tracing::warn!(event = events::RDMA_REGISTER_FAILED, bytes = b.len(), error = %e);
        }
    }
}

/// One queue's way to its volume and its I/O buffers. Cloning shares both.
///
/// The volume's sessions are declared before the buffers and only ever
/// lent out, so the last clone drops them (deregistering the buffers)
/// before the buffers' memory is freed.
#[derive(Clone)]
pub struct QueueIo {
    volume: Arc<VolumeIo>,
    bufs: Arc<TagBuffers>,
}

impl QueueIo {
    /// A volume on one peer, over `session` (whose transport has `bufs`
    /// registered, see [`register_buffers`]).
    pub fn single(session: Session, bufs: Arc<TagBuffers>) -> Self {
        Self {
            volume: Arc::new(VolumeIo::single(session)),
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
            volume: Arc::new(VolumeIo::replicated(io, sessions)),
            bufs,
        }
    }

    /// The queue's way to its volume: what its block target runs on.
    pub fn volume(&self) -> &VolumeIo {
        &self.volume
    }

    /// The queue's first session (the only one of a volume on one peer).
    pub fn session(&self) -> &Session {
        self.volume.session()
    }

    /// The queue's sessions, one per member it was opened with.
    pub fn sessions(&self) -> &[Session] {
        self.volume.sessions()
    }

    /// The queue's I/O buffers.
    pub fn buffers(&self) -> &TagBuffers {
        &self.bufs
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
