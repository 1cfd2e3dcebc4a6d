//! The server's state, shared by the accept loop and every connection
//! task: the store, the volumes served, the limits, the connection
//! counters, the authenticated sessions (where REVOKEs are queued), the
//! blocking pool and the stop signal.

use std::collections::HashMap;
use std::pin::pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};
use tokio::sync::Notify;
use tracing::warn;

use crate::arenad::blocking::Blocking;
use crate::arenad::epochs::Epochs;
use crate::arenad::observability::ArenadObservability;
use crate::arenad::outbox::NotQueued;
use crate::arenad::served::{ServedVolume, ServerLimits, ServerRdma};
use crate::arenad::session::Session;
use crate::proto;
use crate::store::{HolderId, Store};

/// The server's state, shared by the accept loop and every connection
/// task (the server is a handle on it).
pub(super) struct Shared {
    pub(super) rdma: Option<ServerRdma>,
    pub(super) store: Arc<Store>,
    /// Replaced whole by [`Server::set_volumes`] (SIGHUP): a handshake
    /// takes the list in force when it starts, sessions never look again.
    pub(super) volumes: RwLock<Arc<Vec<Arc<ServedVolume>>>>,
    /// Every volume's epoch, by name: a volume added by a reload gets one
    /// like those served from the start.
    pub(super) epochs: Epochs,
    pub(super) limits: ServerLimits,
    /// Authenticated connections by holder: where REVOKEs are queued.
    pub(super) conns: Mutex<HashMap<HolderId, Arc<Session>>>,
    pub(super) next_conn: AtomicU64,
    /// Connections with a task, authenticated or not.
    pub(super) open: Arc<AtomicUsize>,
    /// Connections still in their handshake.
    pub(super) unauthenticated: Arc<AtomicUsize>,
    pub(super) stopping: AtomicBool,
    pub(super) stop: Notify,
    pub(super) pool: Blocking,
    pub(super) obs: Arc<ArenadObservability>,
}

impl Shared {
    /// Resolves once [`Server::shutdown`] was called.
    pub(super) async fn stopped(&self) {
        let mut n = pin!(self.stop.notified());
        n.as_mut().enable();
        if self.stopping.load(Ordering::SeqCst) {
            return;
        }
        n.await;
    }

    /// Queues a REVOKE for `holder`; a client whose queue is full is not
    /// reading, and is disconnected (its leases end with it).
    pub(super) fn revoke(&self, holder: HolderId, key: u64, token: u64) {
        let Some(conn) = self.conns.lock().get(&holder).cloned() else {
            return;
        };
        let mut frame = Vec::new();
        proto::encode_revoke(&mut frame, key, token);
        if let Err(NotQueued::Full) = conn.outbox.revoke(frame) {
            warn!(
                event = "connection.not_reading",
                conn = holder,
                max_queued_frames = self.limits.max_queued_frames,
                "disconnected: a REVOKE found its queue full"
            );
            conn.outbox.close();
        }
    }
}
