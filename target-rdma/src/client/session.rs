//! A queue's arena session on whichever data path it negotiated, as one
//! [`BlobIo`]: the block target runs over it unchanged for TCP and RDMA, and
//! each operation's [`Via`] says which path carried the payload.

use std::sync::Arc;

use super::rdma::{CqDriver, RdmaStats, RdmaTransport, TransportGroup};
use super::ArenaClient;
use crate::blob::{ArenaError, BlobIo, Transport, Via};

/// One queue's session. Cloning shares it.
#[derive(Clone)]
pub enum Session {
    /// Payloads inline on the TCP control stream (`transport = tcp`).
    Tcp(ArenaClient),
    /// Payloads by one-sided RDMA, TCP as counted fallback (`transport =
    /// rdma` or `auto`).
    Rdma(Arc<RdmaTransport>),
}

impl Session {
    /// An RDMA session that joins `group`, the device's other queues (see
    /// [`TransportGroup`]).
    pub fn rdma(t: RdmaTransport, group: &Arc<TransportGroup>) -> Self {
        let t = Arc::new(t);
        t.join(group);
        Self::Rdma(t)
    }

    /// The control-stream client (connection state, reconnects).
    pub fn client(&self) -> &ArenaClient {
        match self {
            Self::Tcp(c) => c,
            Self::Rdma(t) => t.client(),
        }
    }

    /// Why an RDMA-capable session serves TCP; `None` when it uses RDMA or
    /// was configured for TCP.
    pub fn tcp_reason(&self) -> Option<String> {
        match self {
            Self::Tcp(_) => None,
            Self::Rdma(t) => t.rdma_status().err(),
        }
    }

    /// The completion driver of a driven RDMA session, which its owner
    /// runs on its event loop; `None` on TCP or when not driven.
    pub fn rdma_cq_driver(&self) -> Option<CqDriver> {
        match self {
            Self::Tcp(_) => None,
            Self::Rdma(t) => t.cq_driver(),
        }
    }

    /// The RDMA transport's statistics, `None` on TCP.
    pub fn rdma_stats(&self) -> Option<Arc<RdmaStats>> {
        match self {
            Self::Tcp(_) => None,
            Self::Rdma(t) => Some(Arc::clone(t.stats())),
        }
    }
}

impl BlobIo for Session {
    fn transport(&self) -> Transport {
        match self {
            Self::Tcp(c) => c.transport(),
            Self::Rdma(t) => t.transport(),
        }
    }

    fn blob_bytes(&self) -> u32 {
        self.client().session_blob_bytes()
    }

    async fn read(&self, key: u64, offset: u32, out: &mut [u8]) -> Result<Via, ArenaError> {
        match self {
            Self::Tcp(c) => BlobIo::read(c, key, offset, out).await,
            Self::Rdma(t) => t.read(key, offset, out).await,
        }
    }

    async fn write(&self, key: u64, offset: u32, data: &[u8]) -> Result<Via, ArenaError> {
        match self {
            Self::Tcp(c) => BlobIo::write(c, key, offset, data).await,
            Self::Rdma(t) => t.write(key, offset, data).await,
        }
    }

    async fn remove(&self, start: u64, end: u64) -> Result<u64, ArenaError> {
        match self {
            Self::Tcp(c) => c.remove(start, end).await,
            Self::Rdma(t) => t.remove(start, end).await,
        }
    }

    async fn flush(&self) -> Result<(), ArenaError> {
        match self {
            Self::Tcp(c) => c.flush().await,
            // COMMITs the device's dirty cached leases first.
            Self::Rdma(t) => t.flush().await,
        }
    }
}
