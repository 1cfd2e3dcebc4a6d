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

use std::sync::atomic::Ordering;
use std::sync::Arc;

use tracing::info;

use crate::arenad::epochs::{EpochError, VolumeEpoch};
use crate::arenad::lease_keys::LeaseKeys;
use crate::arenad::session::Session;
use crate::arenad::shared::Shared;

impl Shared {
    /// Raises `fence` to `epoch` (see [`crate::arenad::epochs::Epochs::raise`]),
    /// ending the leases of the sessions it fences out before it returns.
    /// Blocks: call it on the blocking pool.
    pub(super) fn raise_and_fence(
        &self,
        fence: &Arc<VolumeEpoch>,
        epoch: u64,
    ) -> Result<u64, EpochError> {
        self.epochs
            .raise(fence, epoch, || self.fence_out(fence, epoch))
    }

    /// Every session of `fence`'s volume below `epoch` loses its leases:
    /// its keys are deregistered, then the store ends the leases (their
    /// slots go back as if released without COMMIT).
    fn fence_out(&self, fence: &Arc<VolumeEpoch>, epoch: u64) {
        let older: Vec<Arc<Session>> = self
            .conns
            .lock()
            .values()
            .filter(|s| Arc::ptr_eq(&s.fence, fence) && s.epoch.load(Ordering::Acquire) < epoch)
            .cloned()
            .collect();
        for s in older {
            if s.rail.lease_keys {
                LeaseKeys::drop_keys(&s.rail.keys);
            }
            let ended = self.store.end_leases_of(s.id);
            if ended > 0 {
                self.obs.leases_fenced(ended as u64);
                info!(
                    event = "epoch.leases_fenced",
                    conn = s.id,
                    volume = %s.vol.name,
                    epoch,
                    session_epoch = s.epoch.load(Ordering::Acquire),
                    leases = ended,
                    "a raise fenced this session out: its leases are ended and their RDMA keys deregistered"
                );
            }
        }
    }
}
