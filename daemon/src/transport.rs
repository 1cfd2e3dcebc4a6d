//! A queue's arena session, whichever data path it negotiated: the TCP
//! inline client or the RDMA transport. One [`QueueIo`] per queue thread;
//! the block target ([`ArenaTarget`](target_rdma::block::ArenaTarget)) is
//! built over a per-request [`RoutedIo`] view of it, so the I/O plane is
//! the same code for both and a request learns whether one of its payloads
//! failed over from RDMA to TCP (for the request/attempt accounting).

use std::cell::Cell;
use std::sync::Arc;

use libublk::helpers::IoBuf;
use target_rdma::blob::{ArenaError, BlobIo, Transport};
use target_rdma::client::ArenaClient;
use target_rdma::rdma::{RdmaTransport, TransportGroup, Via};
use ublk_metrics::Transport as MetricsTransport;

/// The data path a device ended up with (what `ublkctl list` shows).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Negotiated {
    /// Payloads inline on TCP.
    Tcp,
    /// Payloads by one-sided RDMA (TCP only as counted fallback).
    Rdma,
}

impl Negotiated {
    /// Stable lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Tcp => "tcp",
            Self::Rdma => "rdma",
        }
    }

    /// The transport label of the metrics crate.
    pub fn metrics(self) -> MetricsTransport {
        match self {
            Self::Tcp => MetricsTransport::Tcp,
            Self::Rdma => MetricsTransport::Rdma,
        }
    }
}

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

#[derive(Clone)]
enum Path {
    Tcp(ArenaClient),
    Rdma(Arc<RdmaTransport>),
}

/// One queue's arena session and its I/O buffers. Cloning shares both.
///
/// The transport is declared before the buffers and never handed out on
/// its own, so the last clone drops it (deregistering the buffers) before
/// the buffers' memory is freed.
#[derive(Clone)]
pub struct QueueIo {
    path: Path,
    bufs: Arc<TagBuffers>,
}

impl QueueIo {
    /// A TCP session (`transport = tcp`).
    pub fn tcp(client: ArenaClient, bufs: TagBuffers) -> Self {
        Self {
            path: Path::Tcp(client),
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
        let t = Arc::new(t);
        t.join(group);
        Self {
            path: Path::Rdma(t),
            bufs: Arc::new(bufs),
        }
    }

    /// The queue's I/O buffers.
    pub fn buffers(&self) -> &TagBuffers {
        &self.bufs
    }

    /// The control-stream client (connection state, peer checks).
    pub fn client(&self) -> &ArenaClient {
        match &self.path {
            Path::Tcp(c) => c,
            Path::Rdma(t) => t.client(),
        }
    }

    /// The RDMA transport's statistics, `None` on TCP.
    pub fn rdma_stats(&self) -> Option<Arc<target_rdma::rdma::DriverStats>> {
        match &self.path {
            Path::Tcp(_) => None,
            Path::Rdma(t) => Some(Arc::clone(t.stats())),
        }
    }

    /// The data path in use now (cheap: called per request).
    pub fn negotiated(&self) -> Negotiated {
        match &self.path {
            Path::Rdma(t) if t.uses_rdma() => Negotiated::Rdma,
            _ => Negotiated::Tcp,
        }
    }

    /// Why an RDMA-capable session serves TCP, `None` when it uses RDMA or
    /// was configured for TCP.
    pub fn tcp_reason(&self) -> Option<String> {
        match &self.path {
            Path::Tcp(_) => None,
            Path::Rdma(t) => t.rdma_status().err(),
        }
    }

    /// Makes every acknowledged write durable (COMMITs cached RDMA leases first).
    pub async fn flush(&self) -> Result<(), ArenaError> {
        match &self.path {
            Path::Tcp(c) => c.flush().await,
            Path::Rdma(t) => t.flush().await,
        }
    }
}

/// One request's view of a [`QueueIo`]: records whether any of its payloads
/// failed over from RDMA to TCP.
pub struct RoutedIo<'a> {
    io: &'a QueueIo,
    failed_over: Cell<bool>,
}

impl<'a> RoutedIo<'a> {
    /// A fresh view for one request.
    pub fn new(io: &'a QueueIo) -> Self {
        Self {
            io,
            failed_over: Cell::new(false),
        }
    }

    /// The queue's session.
    pub fn io(&self) -> &'a QueueIo {
        self.io
    }

    /// Whether a payload of this request failed over to TCP.
    pub fn failed_over(&self) -> bool {
        self.failed_over.get()
    }

    fn note(&self, via: Via) {
        if matches!(via, Via::Failover(_)) {
            self.failed_over.set(true);
        }
    }
}

impl BlobIo for RoutedIo<'_> {
    fn transport(&self) -> Transport {
        match &self.io.path {
            Path::Tcp(c) => c.transport(),
            Path::Rdma(t) => t.transport(),
        }
    }

    fn blob_bytes(&self) -> u32 {
        self.io.client().session_blob_bytes()
    }

    async fn read(&self, key: u64, offset: u32, out: &mut [u8]) -> Result<bool, ArenaError> {
        match &self.io.path {
            Path::Tcp(c) => c.read(key, offset, out).await,
            Path::Rdma(t) => {
                let (found, via) = t.read_via(key, offset, out).await?;
                self.note(via);
                Ok(found)
            }
        }
    }

    async fn write(&self, key: u64, offset: u32, data: &[u8]) -> Result<(), ArenaError> {
        match &self.io.path {
            Path::Tcp(c) => c.write(key, offset, data).await,
            Path::Rdma(t) => {
                self.note(t.write_via(key, offset, data).await?);
                Ok(())
            }
        }
    }

    async fn remove(&self, start: u64, end: u64) -> Result<u64, ArenaError> {
        match &self.io.path {
            Path::Tcp(c) => c.remove(start, end).await,
            Path::Rdma(t) => t.remove(start, end).await,
        }
    }

    async fn flush(&self) -> Result<(), ArenaError> {
        self.io.flush().await
    }
}
