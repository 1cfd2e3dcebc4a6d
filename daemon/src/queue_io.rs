//! A queue's arena session and the I/O buffers it moves payloads between:
//! one [`QueueIo`] per queue thread. The session is target-rdma's
//! [`Session`] (TCP or RDMA, one `BlobIo`); what is ublkd's own is the
//! libublk buffer per tag, registered once for RDMA.

use std::sync::Arc;

use libublk::helpers::IoBuf;
use target_rdma::blob::{BlobIo, Transport};
use target_rdma::client::{RdmaTransport, Session, TransportGroup};

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

/// One queue's arena session and its I/O buffers. Cloning shares both.
///
/// The session is declared before the buffers and only ever lent out
/// ([`QueueIo::session`]), so the last clone drops it (deregistering the
/// buffers) before the buffers' memory is freed.
#[derive(Clone)]
pub struct QueueIo {
    session: Session,
    bufs: Arc<TagBuffers>,
}

impl QueueIo {
    /// A TCP session (`transport = tcp`).
    pub fn tcp(client: target_rdma::client::ArenaClient, bufs: TagBuffers) -> Self {
        Self {
            session: Session::Tcp(client),
            bufs: Arc::new(bufs),
        }
    }

    /// An RDMA session (`transport = rdma` or `auto`); when the transport
    /// negotiated RDMA, `bufs` are registered with it once, so payloads move
    /// straight between them and the arena. A failed registration is logged
    /// and counted by the transport, whose payloads then bounce through its
    /// own registered pool. `group` holds the device's other queues (see
    /// [`TransportGroup`]).
    pub fn rdma(t: RdmaTransport, bufs: TagBuffers, group: &Arc<TransportGroup>) -> Self {
        if t.uses_rdma() {
            for b in &bufs.bufs {
                // SAFETY: the memory lives in `bufs`, which this struct keeps
                // alive until after the transport is gone (see the type
                // docs); each tag's buffer is used by one request at a time,
                // and only through the transport while that request runs.
                // Group members reach the transport only to end cached
                // leases, which moves no payload.
                if let Err(e) = unsafe { t.register_io_buffers(b.as_mut_ptr(), b.len()) } {
                    tracing::warn!(event = "rdma.register_failed", bytes = b.len(), error = %e);
                }
            }
        }
        Self {
            session: Session::rdma(t, group),
            bufs: Arc::new(bufs),
        }
    }

    /// The queue's session, lent for as long as this handle lives.
    pub fn session(&self) -> &Session {
        &self.session
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
        .all(|io| io.session().transport() == Transport::Rdma)
    {
        return Some((Transport::Rdma, None));
    }
    let why = ios.iter().find_map(|io| io.session().tcp_reason());
    Some((Transport::Tcp, why))
}
