//! The server's state, shared by the accept loop and every connection
//! task: the store, the volumes served, the limits, and each mechanism's
//! own state as a field of its own type: the connection counters
//! ([`Admission`]), the authenticated sessions, where REVOKEs are queued
//! ([`Sessions`]), the epochs and their fence ([`Fencing`]), the cold
//! blobs due to be faulted in ([`Promotion`]), the blocking pool and the
//! stop signal ([`Stop`]).

use std::sync::Arc;

use parking_lot::RwLock;

use crate::arenad::admission::Admission;
use crate::arenad::blocking::Blocking;
use crate::arenad::fenced::Fencing;
use crate::arenad::observability::ArenadObservability;
use crate::arenad::promotion::Promotion;
use crate::arenad::served::{ServedRails, ServedVolume, ServerLimits};
use crate::arenad::sessions::Sessions;
use crate::arenad::stop::Stop;
use crate::store::Store;

/// The server's state, shared by the accept loop and every connection
/// task (the server is a handle on it).
pub(super) struct Shared {
    pub(super) rdma: ServedRails,
    pub(super) store: Arc<Store>,
    /// Replaced whole by [`Server::set_volumes`] (SIGHUP): a handshake
    /// takes the list in force when it starts, sessions never look again.
    pub(super) volumes: RwLock<Arc<Vec<Arc<ServedVolume>>>>,
    /// Every volume's epoch, and the raise that fences sessions out.
    pub(super) fencing: Arc<Fencing>,
    pub(super) limits: ServerLimits,
    /// Authenticated connections by holder: where REVOKEs are queued.
    pub(super) sessions: Arc<Sessions>,
    /// The connection counters and ids.
    pub(super) admission: Admission,
    pub(super) promotion: Promotion,
    pub(super) stop: Stop,
    pub(super) pool: Blocking,
    pub(super) obs: Arc<ArenadObservability>,
}
