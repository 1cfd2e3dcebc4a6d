//! [`RdmaTransportConfig`]: the tuning of one RDMA transport.

use std::time::Duration;

/// Tuning of one RDMA transport.
#[derive(Clone, Debug)]
pub struct RdmaTransportConfig {
    /// Payloads smaller than this go inline on TCP: one control round trip
    /// costs more than the copy.
    pub min_rdma_bytes: u32,
    /// Size of one pool buffer; larger payloads go inline on TCP.
    pub buffer_bytes: u32,
    /// With two rails up, a payload of at least this many bytes is split
    /// in two halves moved on both at once.
    pub stripe_bytes: u32,
    /// Pool buffers (registered once, as one region).
    pub pool_buffers: u32,
    /// Send queue depth: RDMA requests in flight at once.
    pub sq_depth: u32,
    /// Limit for one RDMA READ/WRITE, from post to completion.
    pub op_timeout: Duration,
    /// Leases kept across requests (hot blobs skip the control round trip).
    /// Each pins an arena slot, so keep it well below the arena's slots.
    pub lease_cache: usize,
    /// `transport = rdma`: fail at connect unless RDMA is negotiated.
    pub require_rdma: bool,
    /// Completions are reaped by the owner's event loop running
    /// [`RdmaTransport::cq_driver`](super::RdmaTransport::cq_driver) (a ublk queue's ring), not by a
    /// completion thread of the rail's own.
    pub driven: bool,
    /// Driven: how long the driver polls the completion queue for a
    /// transfer in flight before it sleeps on the completion channel.
    pub busy_poll: Duration,
}

impl Default for RdmaTransportConfig {
    fn default() -> Self {
        Self {
            min_rdma_bytes: 512,
            buffer_bytes: 1 << 20,
            stripe_bytes: 128 << 10,
            pool_buffers: 32,
            sq_depth: 64,
            op_timeout: Duration::from_secs(5),
            lease_cache: 64,
            require_rdma: false,
            driven: false,
            busy_poll: Duration::ZERO,
        }
    }
}
