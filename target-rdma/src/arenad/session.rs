//! An authenticated connection's shared state: what it is bound to (its
//! volume, its epoch fence and the writer epoch it presented), its RDMA
//! rail, its outbound queue and its FLUSH barrier. Each lock here is the
//! connection's own (the rail's lease keys are also taken by the store's
//! force-end hook).

use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use crate::arenad::barrier::WriteBarrier;
use crate::arenad::epochs::VolumeEpoch;
use crate::arenad::outbox::Outbox;
use crate::arenad::served::{Rail, ServedVolume};
use crate::store::HolderId;

/// What the reader, the blocking-pool jobs and the writer of one
/// authenticated connection share.
pub(super) struct Session {
    pub(super) id: HolderId,
    pub(super) peer: SocketAddr,
    pub(super) vol: Arc<ServedVolume>,
    pub(super) fence: Arc<VolumeEpoch>,
    pub(super) version: u8,
    /// The writer's membership epoch (raised by EPOCH requests).
    pub(super) epoch: AtomicU64,
    pub(super) rail: Rail,
    pub(super) outbox: Outbox,
    pub(super) barrier: WriteBarrier,
}
