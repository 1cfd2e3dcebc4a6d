//! What a raise of a volume's epoch does to the sessions it fences out.
//! Refusing their data operations is not enough: a session holding a lease
//! could still write its slot by RDMA, and the new writer could be handed
//! the same slot. So before a raise is answered every lease of every
//! session of the volume below the new epoch is ended, its RDMA key
//! deregistered first, as a lease ended by force is (the store reports each
//! to the force-end hook before unpinning its slot).
//!
//! Locks: the connection table is held only to copy the sessions out; each
//! session's keys are dropped under that session's own lock, one key at a
//! time; the store lock is taken last, and the force-end hook takes the
//! table and the keys under it, never the other way round. Nothing here
//! touches a socket.

use std::sync::Arc;

use crate::arenad::blocking::Blocking;
use crate::arenad::epochs::{EpochError, Epochs, VolumeEpoch};
use crate::arenad::fatal::Fatal;
use crate::arenad::observability::ArenadObservability;
use crate::arenad::sessions::Sessions;
use crate::store::Store;

/// Every volume's epoch, by name (a volume added by a reload gets one like
/// those served from the start), and what a raise needs to fence out the
/// sessions below it.
pub(super) struct Fencing {
    pub(super) epochs: Epochs,
    sessions: Arc<Sessions>,
    store: Arc<Store>,
    obs: Arc<ArenadObservability>,
}

impl Fencing {
    pub(super) fn new(
        epochs: Epochs,
        sessions: Arc<Sessions>,
        store: Arc<Store>,
        obs: Arc<ArenadObservability>,
    ) -> Self {
        Self {
            epochs,
            sessions,
            store,
            obs,
        }
    }

    /// Raises `fence` to `epoch` (see [`crate::arenad::epochs::Epochs::raise`]),
    /// ending the leases of the sessions it fences out before it returns.
    /// Blocks: call it on the blocking pool.
    pub(super) fn raise_and_fence(
        &self,
        fence: &Arc<VolumeEpoch>,
        epoch: u64,
    ) -> Result<u64, EpochError> {
        self.epochs.raise(fence, epoch, || {
            self.sessions
                .fence_out(&self.store, &self.obs, fence, epoch)
        })
    }

    /// Raises `fence` to `epoch`; a raise (a file sync, draining the
    /// operations admitted under the old epoch, ending the leases of the
    /// sessions it fences out), or waiting for the one under way to the
    /// same epoch, runs on the blocking `pool`.
    pub(super) async fn raise_epoch(
        self: &Arc<Self>,
        pool: &Blocking,
        fence: &Arc<VolumeEpoch>,
        epoch: u64,
    ) -> Result<u64, Fatal> {
        if fence.settled(epoch) {
            return Ok(fence.current());
        }
        let (fencing, fence) = (Arc::clone(self), Arc::clone(fence));
        pool.run(move || fencing.raise_and_fence(&fence, epoch))
            .await
            .map_err(|_| Fatal::Internal("the epoch raise panicked".into()))?
            .map_err(Fatal::Epoch)
    }
}
