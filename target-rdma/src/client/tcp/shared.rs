//! The state an [`ArenaClient`](super::ArenaClient)'s clones share: the
//! config, the live connection, the revocations the peer sent and, when
//! driven, the hand-off to its driver. Its receivers hold it weakly.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, AtomicU64};
use std::sync::Arc;

use parking_lot::Mutex;

use super::config::ClientConfig;
use super::conn::Conn;
use super::frames::BodyPool;
use crate::client::driven::Handoff;

/// Revocations kept for the lease owner to collect; older ones are dropped and counted.
pub(super) const MAX_QUEUED_REVOCATIONS: usize = 4096;

pub(super) struct Shared {
    pub(super) cfg: ClientConfig,
    pub(super) conn: Mutex<Option<Arc<Conn>>>,
    pub(super) next_id: AtomicU64,
    pub(super) blob_bytes: AtomicU32,
    pub(super) bodies: Arc<BodyPool>,
    /// Connections made so far: the epoch of the live one.
    pub(super) connects: AtomicU64,
    /// The membership epoch presented by the next HELLO (see
    /// [`ClientConfig::epoch`]).
    pub(super) epoch: AtomicU64,
    pub(super) revocations: Mutex<VecDeque<(u64, u64)>>,
    /// A driven client's receivers, for its [`Driver`].
    pub(super) handoff: Option<Arc<Handoff>>,
}

impl Drop for Shared {
    fn drop(&mut self) {
        if let Some(c) = self.conn.lock().take() {
            c.kill(&self.cfg.peer, "client dropped");
        }
        if let Some(h) = &self.handoff {
            h.close();
        }
    }
}
