//! An authenticated connection's shared state: what it is bound to (its
//! volume, its epoch fence and the writer epoch it presented), its RDMA
//! rails, its outbound queue and its FLUSH barrier. Each lock here is the
//! connection's own (the rails' lease keys are also taken by the store's
//! force-end hook).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crate::arenad::barrier::WriteBarrier;
use ublk_metrics::VolumeCounters;

use crate::arenad::epochs::VolumeEpoch;
use crate::arenad::observability::{arena_op, outcome};
use crate::arenad::outbox::Outbox;
use crate::arenad::served::{ServedVolume, SessionRails};
use crate::proto::{Opcode, Status};
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
    pub(super) rails: SessionRails,
    pub(super) outbox: Outbox,
    pub(super) barrier: WriteBarrier,
    /// What `arenactl sessions` shows of its traffic.
    pub(super) traffic: Traffic,
}

/// A session's age and control-stream traffic, counted as each answer is
/// sent (RDMA payloads move one-sided and are not seen by arenad).
pub(super) struct Traffic {
    /// Its volume's metric counters (shared with the volume's other
    /// sessions).
    volume: Arc<VolumeCounters>,
    pub(super) opened: Instant,
    pub(super) requests: AtomicU64,
    pub(super) bytes_in: AtomicU64,
    pub(super) bytes_out: AtomicU64,
}

impl Traffic {
    /// Counts the session open in `volume`'s gauge until [`Self::closed`].
    pub(super) fn new(volume: Arc<VolumeCounters>) -> Self {
        volume.session_opened();
        Self {
            volume,
            opened: Instant::now(),
            requests: AtomicU64::new(0),
            bytes_in: AtomicU64::new(0),
            bytes_out: AtomicU64::new(0),
        }
    }

    /// One request of `op` of `bytes_in` bytes (header and body)
    /// answered with `status` in `bytes_out`.
    pub(super) fn answered(&self, op: Opcode, status: Status, bytes_in: u64, bytes_out: u64) {
        self.volume
            .answered(arena_op(op), outcome(status), bytes_in + bytes_out);
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.bytes_in.fetch_add(bytes_in, Ordering::Relaxed);
        self.bytes_out.fetch_add(bytes_out, Ordering::Relaxed);
    }

    /// The session ended.
    pub(super) fn closed(&self) {
        self.volume.session_closed();
    }
}
