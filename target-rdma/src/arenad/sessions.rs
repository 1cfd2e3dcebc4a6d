//! The authenticated sessions by holder: where a REVOKE is queued, where
//! the store's force-end hook finds a lease's RDMA key, and which sessions
//! a raise of a volume's epoch fences out.
//!
//! Locks: the table is held only for an insert, a remove, or to copy
//! sessions out; whatever is then done to a session (queueing a frame,
//! dropping its keys under its own lock) happens after it is released.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use parking_lot::Mutex;
use tracing::{info, warn};

use crate::arenad::epochs::VolumeEpoch;
use crate::arenad::events;
use crate::arenad::lease_keys::LeaseKeys;
use crate::arenad::observability::ArenadObservability;
use crate::arenad::outbox::NotQueued;
use crate::arenad::session::Session;
use crate::proto;
use crate::store::{HolderId, Store};

/// The authenticated connections by holder.
#[derive(Default)]
pub(super) struct Sessions {
    conns: Mutex<HashMap<HolderId, Arc<Session>>>,
}

impl Sessions {
    /// Makes `conn` one of the sessions (once its handshake succeeded).
    pub(super) fn insert(&self, conn: &Arc<Session>) {
        self.conns.lock().insert(conn.id, Arc::clone(conn));
    }

    /// Every session, copied out of the table.
    pub(super) fn all(&self) -> Vec<Arc<Session>> {
        self.conns.lock().values().cloned().collect()
    }

    /// Takes `id` out of the sessions (its connection ended).
    pub(super) fn remove(&self, id: HolderId) {
        self.conns.lock().remove(&id);
    }

    /// Queues a REVOKE for `holder`; a client whose queue is full is not
    /// reading, and is disconnected (its leases end with it).
    pub(super) fn revoke(&self, holder: HolderId, key: u64, token: u64, max_queued_frames: usize) {
        let Some(conn) = self.conns.lock().get(&holder).cloned() else {
            return;
        };
        let mut frame = Vec::new();
        proto::encode_revoke(&mut frame, key, token);
        if let Err(NotQueued::Full) = conn.outbox.revoke(frame) {
            warn!(
                event = events::CONNECTION_NOT_READING,
                conn = holder,
                max_queued_frames,
                "disconnected: a REVOKE found its queue full"
            );
            conn.outbox.close();
        }
    }

    /// The store ended `holder`'s lease `token` by force (called under the
    /// store lock, before the slot is unpinned): its key is deregistered.
    /// The holder's QP stays up: a transfer with the dead key is refused
    /// with a remote access error, which the client sees at once.
    pub(super) fn force_ended(&self, holder: HolderId, token: u64) {
        let Some(conn) = self.conns.lock().get(&holder).cloned() else {
            return;
        };
        if conn.rails.lease_keys && conn.rails.keys.lock().end(token) {
            warn!(
                event = events::RDMA_LEASE_KEY_FORCE_ENDED,
                conn = holder,
                token,
                "a revoked lease was not given back in time: its RDMA key is deregistered"
            );
        }
    }

    /// Every session of `fence`'s volume below `epoch` loses its leases:
    /// its keys are deregistered, then the store ends the leases (their
    /// slots go back as if released without COMMIT). The table is held
    /// only to copy the sessions out; each session's keys are dropped under
    /// that session's own lock, one key at a time; the store lock is taken
    /// last.
    pub(super) fn fence_out(
        &self,
        store: &Store,
        obs: &ArenadObservability,
        fence: &Arc<VolumeEpoch>,
        epoch: u64,
    ) {
        let older: Vec<Arc<Session>> = self
            .conns
            .lock()
            .values()
            .filter(|s| Arc::ptr_eq(&s.fence, fence) && s.epoch.load(Ordering::Acquire) < epoch)
            .cloned()
            .collect();
        for s in older {
            if s.rails.lease_keys {
                LeaseKeys::drop_keys(&s.rails.keys);
            }
            let ended = store.end_leases_of(s.id);
            if ended > 0 {
                obs.leases_fenced(ended as u64);
                info!(
                    event = events::EPOCH_LEASES_FENCED,
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
