//! What the server serves and with which limits: the volumes with their
//! secrets, the limits every connection is held to, and the arena's RDMA
//! registration.

use std::sync::Arc;
use std::time::Duration;

use crate::auth::Secret;
use crate::proto::{Endpoint, RailAccept};
use crate::rdma::{Access, MemoryRegion, QueuePair, RdmaError, RdmaProvider};
use crate::store::{Store, VolumeId};

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
        let arena = unsafe { provider.register(base, len, Access::RemoteReadWrite)? };
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
