//! [`TransportGroup`]: the RDMA transports of one block device, whose
//! cached leases a FLUSH, a REMOVE or a BUSY answer on any of them must
//! reach, and [`Removing`], a REMOVE in progress across them.

use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use super::leases::Member;

/// The RDMA transports of one block device, one per queue.
///
/// Each member caches leases on its own connection, but a block FLUSH covers
/// writes completed on every queue and a DISCARD removes blobs that any
/// queue's cached lease may point at. So a member's FLUSH first COMMITs the
/// dirty cached leases of all members, and its REMOVE first ends every
/// member's cached leases in the range (after their current users). A BUSY
/// member also gives back the idle cached leases of the others.
#[derive(Default)]
pub struct TransportGroup {
    members: Mutex<Vec<Weak<dyn Member>>>,
}

impl TransportGroup {
    /// An empty group.
    pub fn new() -> Arc<Self> {
        Arc::default()
    }

    /// Adds a member (a transport joining, see
    /// [`RdmaTransport::join`](super::RdmaTransport::join)).
    pub(super) fn add(&self, member: Weak<dyn Member>) {
        self.members.lock().push(member);
    }

    /// The members other than `me`.
    pub(super) fn others(&self, me: &dyn Member) -> Vec<Arc<dyn Member>> {
        let mut m = self.members.lock();
        m.retain(|w| w.strong_count() > 0);
        m.iter()
            .filter_map(Weak::upgrade)
            .filter(|t| !std::ptr::addr_eq(Arc::as_ptr(t), me))
            .collect()
    }
}

/// Marks a REMOVE in progress on every member of a group, until dropped.
pub(super) struct Removing<'a>(&'a [&'a dyn Member]);

impl<'a> Removing<'a> {
    pub(super) fn start(members: &'a [&'a dyn Member]) -> Self {
        for t in members {
            t.leases().remove_started();
        }
        Self(members)
    }
}

impl Drop for Removing<'_> {
    fn drop(&mut self) {
        for t in self.0 {
            t.leases().remove_ended();
        }
    }
}
