//! What the server serves and with which limits: the volumes with their
//! secrets, the limits every connection is held to, and the arena's RDMA
//! registration.

use std::sync::Arc;
use std::time::Duration;

use crate::arenad::windows::LeaseWindows;
use crate::auth::Secret;
use crate::proto::{Endpoint, RailAccept};
use crate::rdma::{Access, Isolation, MemoryRegion, QueuePair, RdmaError, RdmaProvider, Window};
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

/// The arena registered with an RDMA device: what RAIL_CONNECT hands out,
/// and (isolated per lease) what lease windows are bound over.
pub struct ServerRdma {
    // Field order is drop order: the region is deregistered before the
    // provider (and its protection domain) goes.
    arena: MemoryRegion,
    provider: Arc<dyn RdmaProvider>,
    qp_depth: u32,
    isolation: Isolation,
    blob_bytes: usize,
}

impl ServerRdma {
    /// Registers `store`'s arena on `provider`: for window binds only
    /// (`Isolation::Lease`: a device without type-2 windows is an error
    /// naming the alternative), or for remote read and write by everyone
    /// with the key (`Isolation::Shared`).
    pub fn register(
        provider: Arc<dyn RdmaProvider>,
        store: &Store,
        qp_depth: u32,
        isolation: Isolation,
    ) -> Result<Self, RdmaError> {
        let access = match isolation {
            Isolation::Lease => {
                provider
                    .window_support()
                    .map_err(|detail| RdmaError::Device {
                        device: provider.device_name(),
                        detail: format!(
                            "{detail}: rdma_isolation = \"lease\" needs them \
                             (rdma_isolation = \"shared\" trusts every RDMA client with every volume)"
                        ),
                    })?;
                Access::Windows
            }
            Isolation::Shared => Access::Remote,
        };
        let (base, len) = store.arena_region();
        // SAFETY: the arena mapping lives as long as the store, and the
        // server holds the store (declared after `rdma`, so dropped later);
        // remote access only touches slots leased to the accessing client
        // (enforced by the windows with `Isolation::Lease`).
        let arena = unsafe { provider.register(base, len, access)? };
        Ok(Self {
            arena,
            provider,
            qp_depth,
            isolation,
            blob_bytes: store.blob_bytes() as usize,
        })
    }

    /// What the keys handed to sessions reach.
    pub fn isolation(&self) -> Isolation {
        self.isolation
    }

    /// Binds a window over the slot at `slot_offset` for `qp`'s peer.
    pub(super) fn bind(
        &self,
        qp: &dyn QueuePair,
        slot_offset: u64,
        write: bool,
    ) -> Result<Window, RdmaError> {
        let addr = self.arena.addr + slot_offset as usize;
        qp.bind_window(&self.arena, addr, self.blob_bytes, write)
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
            rkey: match self.isolation {
                Isolation::Shared => self.arena.rkey,
                // No key to the whole arena: each lease answer carries one.
                Isolation::Lease => 0,
            },
        };
        Ok((qp, acc))
    }
}

/// A connection's RDMA state: whether its HELLO was granted `CAP_RDMA`
/// (and offered `CAP_RDMA_WINDOWS`), its one QP (replaced when the client
/// re-establishes the rail) and the lease windows bound on it.
pub(super) struct Rail {
    pub(super) granted: bool,
    pub(super) windows_offered: bool,
    // Field order is drop order: the windows go before the QP they are
    // bound to.
    pub(super) windows: LeaseWindows,
    pub(super) qp: Option<Box<dyn QueuePair>>,
}

impl Rail {
    /// A session's rail before RAIL_CONNECT.
    pub(super) fn new(granted: bool, windows_offered: bool) -> Self {
        Self {
            granted,
            windows_offered,
            windows: LeaseWindows::default(),
            qp: None,
        }
    }

    /// Ends the rail: every window invalidated, then the QP failed and
    /// destroyed. Called before the session's leases are released.
    pub(super) fn close(&mut self) {
        self.windows.clear();
        if let Some(qp) = self.qp.take() {
            qp.fail();
        }
    }
}
